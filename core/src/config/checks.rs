//! What every part of the configuration checks the same way: the error that
//! names a field, number ranges, descriptor keys, string matches and header
//! names. A leaf: the rules, the match, the descriptor entries and the
//! response all import it, and it imports none of them.

use std::collections::HashMap;

use serde::Deserialize;

use crate::descriptor::{HeaderId, StringMatch};
use crate::error::ConfigError;

/// The error at `field` (a path like `rules[1].period`).
pub(super) fn error(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::new(field, message)
}

/// `value` if it lies in `min..=max`; the error names the bounds and the value.
pub(super) fn check_range(field: &str, value: u64, min: u64, max: u64) -> Result<u64, ConfigError> {
    if value < min || value > max {
        let bound = if min == max { format!("be {min}") } else { format!("be between {min} and {max}") };
        return Err(error(field, format!("must {bound}, got {value}")));
    }
    Ok(value)
}

/// A descriptor key or constant value: what the quota service and the
/// shared-data keys carry, so it is bounded.
pub(super) fn check_key(field: &str, key: &str) -> Result<(), ConfigError> {
    if key.is_empty() || key.len() > 128 {
        return Err(error(field, format!("{key:?} must be 1 to 128 bytes")));
    }
    Ok(())
}

/// Serde's default for the flags that Envoy defaults to true.
pub(super) fn default_true() -> bool {
    true
}

/// Envoy's `StringMatcher` as written (`exact`, `prefix`, `suffix`, `contains`).
#[derive(Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub(super) enum RawStringMatch {
    Exact(String),
    Prefix(String),
    Suffix(String),
    Contains(String),
}

impl RawStringMatch {
    /// The matcher on bytes (header and parameter values need not be UTF-8).
    pub(super) fn validate(self) -> StringMatch {
        match self {
            RawStringMatch::Exact(s) => StringMatch::Exact(s.into_bytes()),
            RawStringMatch::Prefix(s) => StringMatch::Prefix(s.into_bytes()),
            RawStringMatch::Suffix(s) => StringMatch::Suffix(s.into_bytes()),
            RawStringMatch::Contains(s) => StringMatch::Contains(s.into_bytes()),
        }
    }
}

/// A value matcher that takes either a `string_match` or a `present_match`
/// (Envoy's `HeaderMatcher` and `QueryParameterMatcher`), at `field`.
pub(super) fn string_or_present(
    field: &str,
    string_match: Option<RawStringMatch>,
    present_match: Option<bool>,
) -> Result<StringMatch, ConfigError> {
    match (string_match, present_match) {
        (Some(_), Some(_)) => Err(error(field, "give string_match or present_match, not both")),
        (None, None) => Err(error(field, "needs string_match or present_match")),
        (None, Some(present)) => Ok(StringMatch::Present(present)),
        (Some(raw), None) => Ok(raw.validate()),
    }
}

/// Interns header names so each is fetched once per request.
#[derive(Default)]
pub(super) struct Headers {
    /// The names in the order first met: [`HeaderId`] indexes them.
    pub(super) names: Vec<String>,
    index: HashMap<String, usize>,
}

impl Headers {
    /// The id of header `name` (any case; pseudo-headers with their `:`),
    /// refused at `field` unless it is a valid header name.
    pub(super) fn id(&mut self, field: &str, name: &str) -> Result<HeaderId, ConfigError> {
        let lower = name.to_ascii_lowercase();
        let body = lower.strip_prefix(':').unwrap_or(&lower);
        let valid = !body.is_empty()
            && body.len() <= 256
            && body.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
        if !valid {
            return Err(error(field, format!("{name:?} is not a valid header name")));
        }
        let next = self.names.len();
        let id = *self.index.entry(lower.clone()).or_insert(next);
        if id == next {
            self.names.push(lower);
        }
        Ok(HeaderId(id))
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn header_names_are_interned_once_and_lower_cased() {
        let config = Config::parse(
            br#"{"rules": [
              {"name": "a", "limit": 1, "period": "1s", "descriptors": [{"request_headers": {"header_name": "X-Key", "descriptor_key": "k"}}]},
              {"name": "b", "limit": 1, "period": "1s", "descriptors": [{"request_headers": {"header_name": "x-key", "descriptor_key": "k"}}],
               "cost_from_header": {"header_name": "x-cost", "max": 1}}]}"#,
        )
        .unwrap();
        assert_eq!(config.settings.header_names, vec!["x-key".to_string(), "x-cost".to_string()]);
    }
}
