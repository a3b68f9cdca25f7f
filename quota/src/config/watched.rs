//! The limits files' reload: read again when their contents change (the
//! reloader in `crate::reload` polls this).

use std::path::{Path, PathBuf};

use super::domains::Domains;
use super::error::LimitsError;

/// Reads a config from files again when their contents change.
#[derive(Debug)]
pub struct Watched {
    paths: Vec<PathBuf>,
    last: Vec<Option<Vec<u8>>>,
}

impl Watched {
    /// Watches `paths`, taking their current contents as already loaded.
    pub fn new(paths: Vec<PathBuf>) -> Self {
        let last = paths.iter().map(|p| read_bytes(p)).collect();
        Self { paths, last }
    }

    /// `None` when no file changed; otherwise the result of loading them all.
    /// Contents, not mtimes, are compared: an edit within the same second
    /// (or a file replaced by a rename) is still noticed.
    pub fn poll(&mut self) -> Option<Result<Domains, LimitsError>> {
        let now: Vec<Option<Vec<u8>>> = self.paths.iter().map(|p| read_bytes(p)).collect();
        if now == self.last {
            return None;
        }
        self.last = now;
        Some(Domains::load(&self.paths))
    }
}

fn read_bytes(path: &Path) -> Option<Vec<u8>> {
    std::fs::read(path).ok()
}
