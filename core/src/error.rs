//! The configuration error every part of a configuration reports. A leaf:
//! the parser, the algorithms and global mode's settings all build it, and it
//! imports nothing of theirs.

use std::fmt;

/// A configuration error: which field, and what is wrong with its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Path of the field, e.g. `rules[0].limit` (`.` for the whole document).
    pub field: String,
    /// What is wrong, quoting the value.
    pub message: String,
}

impl ConfigError {
    /// An error about `field`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError { field: field.into(), message: message.into() }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid floodgate config: {}: {}", self.field, self.message)
    }
}

impl std::error::Error for ConfigError {}
