//! Plugin configuration: JSON parsed strictly in two stages. Serde structs
//! with `deny_unknown_fields` take the text; [`Config::parse`] then checks
//! every value and builds a [`Config`] that cannot hold an invalid state.
//! Every error names the field (as a path like `rules[1].period`) and the
//! value it rejected.
//!
//! By concern, each check beside the type it checks: the plugin-wide
//! settings here; a rule in `rule`, its `match` in `request_match`, its
//! descriptor entries in `descriptors` (headers and the connection) and
//! `entries` (Envoy's attributes), the `response` section in `response`, and
//! what they all check alike (field errors, ranges, keys, header names) in
//! the leaf `checks`. The `global` section is `crate::global::settings`'.

mod checks;
mod descriptors;
mod entries;
mod request_match;
mod response;
mod rule;

use serde::Deserialize;

use crate::error::ConfigError;
use crate::global::settings::{QuotaService, RawService};
use checks::{check_range, error, Headers};
use response::RawResponse;
pub use response::{HeaderStyle, Response};
use rule::RawRule;
pub use rule::{Rule, Scope, DEFAULT_MAX_KEYS, MAX_MAX_KEYS};

/// Compare-and-swap retries per rule per request when none is configured.
pub const DEFAULT_CAS_RETRIES: u32 = 8;
/// Requests one worker keeps waiting for a shaper when none is configured.
pub const DEFAULT_MAX_DELAYED: u32 = 1024;
const MAX_RULES: usize = 64;

// ---- stage one: the document as written -------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    rules: Vec<RawRule>,
    #[serde(default)]
    response: RawResponse,
    max_keys: Option<u64>,
    #[serde(default)]
    shadow_mode: bool,
    #[serde(default)]
    failure_mode: FailureMode,
    max_cas_retries: Option<u32>,
    max_delayed_per_worker: Option<u32>,
    global: Option<RawService>,
}

// ---- stage two: validated ---------------------------------------------------

/// What to do when the limiter cannot decide exactly: retries ran out, the
/// rule's table has no free bucket, or shared data failed.
#[derive(Deserialize, Default, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FailureMode {
    /// Let the request through (Envoy's `failure_mode_deny: false`).
    #[default]
    Allow,
    /// Answer it as limited.
    Deny,
}

/// A validated plugin configuration: its rules, and the settings every
/// rule shares.
#[derive(Debug, Clone)]
pub struct Config {
    /// The rules, in order. Every rule that applies must allow a request.
    pub rules: Vec<Rule>,
    /// What every rule shares.
    pub settings: PluginSettings,
}

/// The plugin-wide settings: what the limiter keeps as they are.
#[derive(Debug, Clone)]
pub struct PluginSettings {
    /// The limited response.
    pub response: Response,
    /// Shadow mode for every rule.
    pub shadow_mode: bool,
    /// Outcome when a decision cannot be made exactly.
    pub failure_mode: FailureMode,
    /// Compare-and-swap retries per rule per request.
    pub max_cas_retries: u32,
    /// Most requests one worker keeps waiting (delayed by a shaper) at once.
    pub max_delayed_per_worker: u32,
    /// The quota service global rules ask (the `global` section).
    pub global: Option<QuotaService>,
    /// The request headers rules read, indexed by [`HeaderId`](crate::descriptor::HeaderId); lower case.
    pub header_names: Vec<String>,
}

impl Config {
    /// Parses and validates the plugin configuration.
    pub fn parse(json: &[u8]) -> Result<Config, ConfigError> {
        let mut deserializer = serde_json::Deserializer::from_slice(json);
        let raw: RawConfig = serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
            let path = e.path().to_string();
            error(path, e.inner().to_string())
        })?;
        deserializer.end().map_err(|e| error(".", e.to_string()))?;
        Self::validate(raw)
    }

    /// Checks the plugin-wide settings in the order they are read, then the
    /// rules (which take their defaults from them).
    fn validate(raw: RawConfig) -> Result<Config, ConfigError> {
        if raw.rules.is_empty() {
            return Err(error("rules", "must list at least one rule, got []"));
        }
        if raw.rules.len() > MAX_RULES {
            return Err(error("rules", format!("at most {MAX_RULES} rules, got {}", raw.rules.len())));
        }
        let default_max_keys = rule::max_keys("max_keys", raw.max_keys, u64::from(DEFAULT_MAX_KEYS))?;
        let response = raw.response.validate()?;
        let max_cas_retries = bounded_or("max_cas_retries", raw.max_cas_retries, DEFAULT_CAS_RETRIES, 64)?;
        let max_delayed_per_worker =
            bounded_or("max_delayed_per_worker", raw.max_delayed_per_worker, DEFAULT_MAX_DELAYED, 100_000)?;
        let global = raw.global.map(RawService::validate).transpose()?;
        let mut headers = Headers::default();
        let rules = validate_rules(raw.rules, default_max_keys, global.as_ref(), &mut headers)?;
        let settings = PluginSettings {
            response,
            shadow_mode: raw.shadow_mode,
            failure_mode: raw.failure_mode,
            max_cas_retries,
            max_delayed_per_worker,
            global,
            header_names: headers.names,
        };
        Ok(Config { rules, settings })
    }
}

/// A count at `field` from 0 to `max`, `default` when absent.
fn bounded_or(field: &str, raw: Option<u32>, default: u32, max: u32) -> Result<u32, ConfigError> {
    match raw {
        None => Ok(default),
        Some(n) => Ok(check_range(field, u64::from(n), 0, u64::from(max))? as u32),
    }
}

/// Every rule, in order, each name used once.
fn validate_rules(
    raw: Vec<RawRule>,
    default_max_keys: u64,
    service: Option<&QuotaService>,
    headers: &mut Headers,
) -> Result<Vec<Rule>, ConfigError> {
    let mut rules: Vec<Rule> = Vec::with_capacity(raw.len());
    for (index, rule) in raw.into_iter().enumerate() {
        let at = format!("rules[{index}]");
        let rule = rule.validate(&at, default_max_keys, service, headers)?;
        if rules.iter().any(|r| r.name == rule.name) {
            return Err(error(
                format!("{at}.name"),
                format!("{:?} is used by an earlier rule; names must be unique", rule.name),
            ));
        }
        rules.push(rule);
    }
    Ok(rules)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Quota;
    use crate::descriptor::Cost;
    use crate::time::SECOND;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const SAMPLE: &str = r#"{"rules": [{"name": "per-api-key", "match": {"path_prefix": "/api"},
        "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "api_key"}}],
        "algorithm": "token_bucket", "limit": 100, "period": "1m", "burst": 20}],
        "response": {"status": 429, "headers": "ietf"}, "max_keys": 65536}"#;

    #[test]
    fn the_documented_sample_parses() {
        let config = Config::parse(SAMPLE.as_bytes()).unwrap();
        let rule = &config.rules[0];
        assert_eq!(rule.name, "per-api-key");
        assert_eq!(rule.quota(), Quota { limit: 100, window: Some(SECOND.times(60)) });
        assert_eq!(rule.policy().capacity(), 20);
        assert_eq!(rule.table.capacity(), 65_536);
        assert_eq!(config.settings.header_names, vec![":path".to_string(), "x-api-key".to_string()]);
        assert_eq!(config.settings.failure_mode, FailureMode::Allow);
        assert_eq!(config.settings.max_cas_retries, DEFAULT_CAS_RETRIES);
    }

    #[test]
    fn defaults_are_what_the_readme_says() {
        let config = Config::parse(br#"{"rules": [{"name": "r", "limit": 5, "period": "1s"}]}"#).unwrap();
        let rule = &config.rules[0];
        assert_eq!(rule.algorithm.name, "token_bucket");
        assert_eq!(rule.policy().capacity(), 5);
        assert_eq!(rule.cost, Cost::Fixed(1));
        assert_eq!(rule.table.capacity(), 4, "a constant descriptor needs one bucket (one group)");
        assert_eq!(config.settings.response.status, 429);
        assert_eq!(config.settings.response.headers, HeaderStyle::Ietf);
        let leaky =
            Config::parse(br#"{"rules": [{"name": "r", "algorithm": "leaky_bucket", "limit": 5, "period": "1s"}]}"#)
                .unwrap();
        assert_eq!(leaky.rules[0].policy().capacity(), 1);
    }
}
