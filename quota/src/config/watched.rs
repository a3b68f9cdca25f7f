//! The limits files' reload: read again when their contents change, and
//! loaded once they have settled (the reloader in `crate::reload` polls
//! this).

use std::path::PathBuf;

use super::domains::Domains;
use super::error::LimitsError;

/// The files' contents as read: each file's bytes, or why it could not be read.
type Contents = Vec<Result<Vec<u8>, String>>;

/// Reads a config from files again when their contents change, once they
/// have settled: the same at two polls in a row (a file written in two
/// steps, read between them, is not loaded half-written unless its writer
/// stalls for a whole interval; what is loaded is what was read).
#[derive(Debug)]
pub struct Watched {
    paths: Vec<PathBuf>,
    last: Contents,
    /// Contents seen changed at the last poll, not loaded yet.
    settling: Option<Contents>,
}

impl Watched {
    /// Watches `paths`, taking their current contents as already loaded.
    pub fn new(paths: Vec<PathBuf>) -> Self {
        let last = read(&paths);
        Self { paths, last, settling: None }
    }

    /// `None` when no file changed, or a change has not settled yet;
    /// otherwise the result of loading them all, as read. Contents, not
    /// mtimes, are compared: an edit within the same second (or a file
    /// replaced by a rename) is still noticed.
    pub fn poll(&mut self) -> Option<Result<Domains, LimitsError>> {
        let now = read(&self.paths);
        if now == self.last {
            self.settling = None;
            return None;
        }
        if self.settling.as_ref() != Some(&now) {
            self.settling = Some(now);
            return None;
        }
        self.settling = None;
        let loaded = Domains::parse_files(&self.paths, &now);
        self.last = now;
        Some(loaded)
    }

    /// The files loaded as they are now, settled or not (an operator's
    /// word: SIGHUP).
    pub fn load_now(&mut self) -> Result<Domains, LimitsError> {
        let now = read(&self.paths);
        self.settling = None;
        let loaded = Domains::parse_files(&self.paths, &now);
        self.last = now;
        loaded
    }
}

fn read(paths: &[PathBuf]) -> Contents {
    paths.iter().map(|path| std::fs::read(path).map_err(|e| e.to_string())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const V1: &str = "domain: t\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 5}\n";
    const V2: &str = "domain: t\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 9}\n";

    #[test]
    fn a_change_is_loaded_once_it_has_settled() -> Result<(), String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let path = dir.path().join("limits.yaml");
        std::fs::write(&path, V1).map_err(|e| e.to_string())?;
        let mut watched = Watched::new(vec![path.clone()]);
        assert!(watched.poll().is_none(), "unchanged");
        // Half-written (a prefix that parses): seen, not loaded.
        std::fs::write(&path, "domain: t\n").map_err(|e| e.to_string())?;
        assert!(watched.poll().is_none(), "a change is not loaded at the poll that first sees it");
        std::fs::write(&path, V2).map_err(|e| e.to_string())?;
        assert!(watched.poll().is_none(), "changed again since: still settling");
        let loaded = watched.poll().ok_or("settled: loaded")?.map_err(|e| e.to_string())?;
        assert!(loaded.domain("t").is_some());
        assert!(watched.poll().is_none(), "loaded once");
        Ok(())
    }
}
