//! Why a limits file was refused. A leaf: the rest of the module builds it.

use std::fmt;

/// Why a limits file was refused: which file, where, which field, and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitsError {
    /// The file (or other origin) of the text.
    pub origin: String,
    /// Line and column (1-based) where known.
    pub location: Option<(usize, usize)>,
    /// The field path, e.g. `descriptors[0].rate_limit.unit`.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl LimitsError {
    /// An error of the whole file (no line, no field).
    pub(super) fn plain(origin: &str, message: String) -> Self {
        Self { origin: origin.to_string(), location: None, path: String::new(), message }
    }
}

impl fmt::Display for LimitsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.origin)?;
        if let Some((line, column)) = self.location {
            write!(f, ":{line}:{column}")?;
        }
        if !self.path.is_empty() && self.path != "." {
            write!(f, ": {}", self.path)?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for LimitsError {}
