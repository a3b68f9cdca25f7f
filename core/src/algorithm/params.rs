//! A rule's algorithm fields, handed to the algorithm that owns them.
//!
//! The configuration knows the fields every rule has (name, match,
//! descriptors, limit, cost…); everything else belongs to the rule's
//! algorithm, which takes its fields from [`Params`] by name and validates
//! them. A field no algorithm takes is an unknown field; one that another
//! algorithm takes "does not apply" to this one.

use serde_json::{Map, Value};

use super::{Registration, ALGORITHMS};
use crate::bounds::{MAX_AMOUNT, MAX_PERIOD};
use crate::error::ConfigError;
use crate::time::{parse_duration, Nanos};

/// The algorithm fields of one rule, with where they sit in the document.
#[derive(Debug, Clone)]
pub struct Params {
    at: String,
    limit: u64,
    fields: Map<String, Value>,
}

impl Params {
    /// The fields of the rule at path `at` (e.g. `rules[0]`) whose `limit`
    /// (already validated) is given.
    pub fn new(at: &str, limit: u64, fields: Map<String, Value>) -> Self {
        Self { at: at.to_string(), limit, fields }
    }

    /// The rule's `limit`.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// An error about field `name`.
    pub fn error(&self, name: &str, message: impl Into<String>) -> ConfigError {
        ConfigError { field: format!("{}.{name}", self.at), message: message.into() }
    }

    /// Takes duration field `name` (`"500ms"`, `"1m"`, … up to 366 days).
    pub fn duration(&mut self, name: &str) -> Result<Option<Nanos>, ConfigError> {
        let Some(value) = self.fields.remove(name) else { return Ok(None) };
        let Some(text) = value.as_str() else {
            return Err(self.error(name, format!("{value} is not a duration: write it as a string, e.g. \"1s\"")));
        };
        let span = parse_duration(text).map_err(|e| self.error(name, e.to_string()))?;
        if span > MAX_PERIOD {
            return Err(self.error(name, format!("{text:?} is longer than 366d")));
        }
        Ok(Some(span))
    }

    /// Takes duration field `name`, which must be given.
    pub fn required_duration(&mut self, name: &str) -> Result<Nanos, ConfigError> {
        self.duration(name)?
            .ok_or_else(|| ConfigError { field: self.at.clone(), message: format!("missing field `{name}`") })
    }

    /// Takes whole-number field `name`, which must lie in `min..=max`.
    pub fn amount(&mut self, name: &str, min: u64, max: u64) -> Result<Option<u64>, ConfigError> {
        let Some(value) = self.fields.remove(name) else { return Ok(None) };
        let Some(n) = value.as_u64() else {
            return Err(self.error(name, format!("{value} is not a whole number")));
        };
        if n < min || n > max {
            return Err(self.error(name, format!("must be between {min} and {max}, got {n}")));
        }
        Ok(Some(n))
    }

    /// Takes a unit count such as `burst` (1 to 10⁹).
    pub fn units(&mut self, name: &str) -> Result<Option<u64>, ConfigError> {
        self.amount(name, 1, MAX_AMOUNT)
    }

    /// Refuses what is left: fields of other algorithms, and unknown fields.
    pub(super) fn finish(self, algorithm: &Registration) -> Result<(), ConfigError> {
        let Some(name) = self.fields.keys().next() else { return Ok(()) };
        let takes =
            if algorithm.fields.is_empty() { "no other fields".to_string() } else { algorithm.fields.join(", ") };
        let message = if ALGORITHMS.iter().any(|a| a.fields.contains(&name.as_str())) {
            format!("does not apply to {} (it takes {takes}); remove it", algorithm.name)
        } else {
            format!("unknown field `{name}` (the {} algorithm takes {takes})", algorithm.name)
        };
        Err(self.error(name, message))
    }
}
