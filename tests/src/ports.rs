//! Where things are: loopback ports and scratch directories for every
//! process the harness starts, the repository's root, and the files the
//! build makes.

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// A loopback port nothing listened on a moment ago, never handed out twice
/// in this process: the tests of one file run side by side, and Envoy binds
/// its listeners with `SO_REUSEPORT`, so two Envoys given the same port would
/// both bind it and share each other's connections. Another process may
/// still take it before it is bound (the machine is shared): [`crate::envoy::Envoy`]
/// starts again on new ports when that happens.
pub fn free_port() -> u16 {
    static GIVEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// A new directory of this process's own under the system's temporary
/// directory, for a process's configuration and log; left in place, so a
/// failed test's Envoy log can still be read.
pub fn scratch_dir() -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "floodgate-e2e-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    fs::create_dir_all(&dir).unwrap();
    dir
}

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// A file the build makes: `$var` if set, else `default` under the
/// repository root; it must exist (`build` is the command that makes it).
pub fn built_file(var: &str, default: &str, build: &str) -> PathBuf {
    let path = std::env::var(var).map(PathBuf::from).unwrap_or_else(|_| repo_root().join(default));
    assert!(path.exists(), "{} is missing: build it with `{build}`", path.display());
    path
}
