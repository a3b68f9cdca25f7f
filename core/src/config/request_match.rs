//! A rule's `match`: which requests it applies to, by path, method,
//! authority, route name or route metadata.

use serde::Deserialize;

use super::checks::{error, Headers};
use super::entries::{self, RawMetadataMatcher};
use crate::descriptor::{HeaderId, PathMatch, RequestMatch};
use crate::error::ConfigError;

/// A rule's `match` as written.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMatch {
    path_exact: Option<String>,
    path_prefix: Option<String>,
    methods: Option<Vec<String>>,
    authority: Option<String>,
    route_name: Option<String>,
    route_metadata: Option<RawMetadataMatcher>,
}

impl RawMatch {
    /// The validated `match` at `at` (`rules[i].match`).
    pub(super) fn validate(self, at: &str, headers: &mut Headers) -> Result<RequestMatch, ConfigError> {
        let path = check_path_match(at, self.path_exact, self.path_prefix)?;
        // Headers are interned in this order (methods, authority, path): it
        // decides the header ids, so it stays as it was.
        let methods = self.methods.map(|m| check_methods(at, m, headers)).transpose()?;
        let authority = self.authority.map(|a| check_authority(at, a, headers)).transpose()?;
        let path = path.map(|p| Ok::<_, ConfigError>((headers.id(at, ":path")?, p))).transpose()?;
        let route_name =
            self.route_name.map(|name| entries::route_name(&format!("{at}.route_name"), name)).transpose()?;
        let route_metadata =
            self.route_metadata.map(|m| entries::route_metadata(&format!("{at}.route_metadata"), m)).transpose()?;
        Ok(RequestMatch { path, methods, authority, route_name, route_metadata })
    }
}

/// `path_exact` or `path_prefix`, at most one of them.
fn check_path_match(at: &str, exact: Option<String>, prefix: Option<String>) -> Result<Option<PathMatch>, ConfigError> {
    Ok(match (exact, prefix) {
        (Some(_), Some(_)) => return Err(error(at, "give path_exact or path_prefix, not both")),
        (Some(p), None) => Some(PathMatch::Exact(check_path(&format!("{at}.path_exact"), p)?)),
        (None, Some(p)) => Some(PathMatch::Prefix(check_path(&format!("{at}.path_prefix"), p)?)),
        (None, None) => None,
    })
}

fn check_path(field: &str, path: String) -> Result<String, ConfigError> {
    if !path.starts_with('/') {
        return Err(error(field, format!("{path:?} must start with '/'")));
    }
    Ok(path)
}

/// `methods`: at least one, each an upper-case token.
fn check_methods(
    at: &str,
    methods: Vec<String>,
    headers: &mut Headers,
) -> Result<(HeaderId, Vec<String>), ConfigError> {
    if methods.is_empty() {
        return Err(error(format!("{at}.methods"), "must list at least one method, got []"));
    }
    for (i, m) in methods.iter().enumerate() {
        if m.is_empty() || !m.bytes().all(|b| b.is_ascii_uppercase()) {
            return Err(error(
                format!("{at}.methods[{i}]"),
                format!("{m:?} is not an HTTP method (upper case, e.g. \"GET\")"),
            ));
        }
    }
    Ok((headers.id(at, ":method")?, methods))
}

fn check_authority(at: &str, authority: String, headers: &mut Headers) -> Result<(HeaderId, String), ConfigError> {
    if authority.is_empty() {
        return Err(error(format!("{at}.authority"), "must not be empty"));
    }
    Ok((headers.id(at, ":authority")?, authority))
}
