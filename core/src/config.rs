//! Plugin configuration: JSON parsed strictly in two stages. Serde structs
//! with `deny_unknown_fields` take the text; [`Config::parse`] then checks
//! every value and builds a [`Config`] that cannot hold an invalid state.
//! Every error names the field (as a path like `rules[1].period`) and the
//! value it rejected.

mod entries;

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::algorithm::{Params, Policy, Quota, Registration, ALGORITHMS};
use crate::bounds::MAX_AMOUNT;
use crate::descriptor::{Cost, DescriptorEntry, HeaderId, HeaderMatcher, PathMatch, RequestMatch, StringMatch};
use crate::error::ConfigError;
use crate::global::settings::{global_rule, GlobalRule, QuotaService, RawService, GLOBAL};
use crate::table::Table;

/// Buckets per rule when neither the rule nor the plugin sets `max_keys`.
pub const DEFAULT_MAX_KEYS: u32 = 65_536;
/// The most buckets one rule may have.
pub const MAX_MAX_KEYS: u64 = 1 << 20;
/// Compare-and-swap retries per rule per request when none is configured.
pub const DEFAULT_CAS_RETRIES: u32 = 8;
/// Requests one worker keeps waiting for a shaper when none is configured.
pub const DEFAULT_MAX_DELAYED: u32 = 1024;
const MAX_RULES: usize = 64;
/// The most units a worker may take ahead at once.
const MAX_WORKER_BATCH: u64 = 1_000_000;
const MAX_DESCRIPTORS: usize = 16;
const MAX_BODY: usize = 4096;

fn error(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::new(field, message)
}

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

/// A rule as written. Fields not named here belong to the rule's algorithm,
/// which takes them from `params` and refuses any it does not know (so a
/// rule still has no unknown fields).
#[derive(Deserialize)]
struct RawRule {
    name: String,
    #[serde(default, rename = "match")]
    request_match: RawMatch,
    #[serde(default)]
    descriptors: Vec<RawDescriptor>,
    algorithm: Option<String>,
    limit: Option<u64>,
    cost: Option<u64>,
    cost_from_header: Option<RawCostHeader>,
    #[serde(default)]
    shadow_mode: bool,
    max_keys: Option<u64>,
    worker_batch: Option<u64>,
    #[serde(default)]
    scope: Scope,
    #[serde(flatten)]
    params: Map<String, Value>,
}

/// Where a rule's limit is kept.
#[derive(Deserialize, Default, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// In this Envoy's shared data, exact across its workers.
    #[default]
    Local,
    /// In the central quota service, for the whole fleet (see [`crate::global`]).
    Global,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawMatch {
    path_exact: Option<String>,
    path_prefix: Option<String>,
    methods: Option<Vec<String>>,
    authority: Option<String>,
    route_name: Option<String>,
    route_metadata: Option<entries::RawMetadataMatcher>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCostHeader {
    header_name: String,
    max: u64,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum RawDescriptor {
    RequestHeaders(RawRequestHeaders),
    RemoteAddress(RawEmpty),
    MaskedRemoteAddress(RawMasked),
    GenericKey(RawGenericKey),
    HeaderValueMatch(RawHeaderValueMatch),
    Metadata(entries::RawMetadata),
    QueryParameters(entries::RawQueryParameters),
    QueryParameterValueMatch(entries::RawQueryParameterValueMatch),
    DestinationCluster(RawEmpty),
    SourceCluster(RawEmpty),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "an empty object {}")]
struct RawEmpty {}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRequestHeaders {
    header_name: String,
    descriptor_key: String,
    #[serde(default)]
    skip_if_absent: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMasked {
    #[serde(default = "default_v4_mask")]
    v4_prefix_mask_len: u8,
    #[serde(default = "default_v6_mask")]
    v6_prefix_mask_len: u8,
}

fn default_v4_mask() -> u8 {
    32
}

fn default_v6_mask() -> u8 {
    128
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGenericKey {
    descriptor_value: String,
    #[serde(default = "default_generic_key")]
    descriptor_key: String,
}

fn default_generic_key() -> String {
    "generic_key".into()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHeaderValueMatch {
    descriptor_value: String,
    #[serde(default = "default_header_match_key")]
    descriptor_key: String,
    #[serde(default = "default_true")]
    expect_match: bool,
    headers: Vec<RawHeaderMatcher>,
}

fn default_header_match_key() -> String {
    "header_match".into()
}

fn default_true() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHeaderMatcher {
    name: String,
    string_match: Option<RawStringMatch>,
    present_match: Option<bool>,
    #[serde(default)]
    invert_match: bool,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum RawStringMatch {
    Exact(String),
    Prefix(String),
    Suffix(String),
    Contains(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawResponse {
    #[serde(default = "default_status")]
    status: u32,
    #[serde(default = "default_body")]
    body: String,
    #[serde(default)]
    headers: HeaderStyle,
    #[serde(default = "default_true")]
    headers_on_allowed: bool,
}

impl Default for RawResponse {
    fn default() -> Self {
        Self {
            status: default_status(),
            body: default_body(),
            headers: HeaderStyle::default(),
            headers_on_allowed: true,
        }
    }
}

fn default_status() -> u32 {
    429
}

fn default_body() -> String {
    "Too Many Requests\n".into()
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

/// Which rate-limit headers responses carry.
#[derive(Deserialize, Default, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum HeaderStyle {
    /// IETF `RateLimit` and `RateLimit-Policy` (draft-ietf-httpapi-ratelimit-headers-10).
    #[default]
    Ietf,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`.
    #[serde(rename = "x-ratelimit")]
    XRateLimit,
    /// None (a limited response still carries `Retry-After`).
    None,
}

/// The limited response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// HTTP status of a limited response (400–599).
    pub status: u32,
    /// Body of a limited response.
    pub body: String,
    /// Which rate-limit headers to send.
    pub headers: HeaderStyle,
    /// Whether allowed responses carry the rate-limit headers too.
    pub headers_on_allowed: bool,
}

/// One validated rule.
#[derive(Debug, Clone)]
pub struct Rule {
    /// The rule's name: in metrics, logs, shared-data keys and headers.
    pub name: String,
    /// Which requests the rule applies to.
    pub request_match: RequestMatch,
    /// What identifies a bucket.
    pub descriptors: Vec<DescriptorEntry>,
    /// The algorithm.
    pub algorithm: &'static Registration,
    /// Cost per request.
    pub cost: Cost,
    /// Count and log, but do not enforce.
    pub shadow_mode: bool,
    /// The rule's bucket table, decided by its algorithm (for a global
    /// rule: its lease pools).
    pub table: Table,
    /// For a global rule, how it asks the quota service and falls back.
    pub global: Option<GlobalRule>,
    /// Units a worker takes from a bucket at once and spends from its own
    /// memory (`worker_batch`), if set.
    pub worker_batch: Option<u64>,
}

impl Rule {
    /// The configured algorithm.
    pub fn policy(&self) -> &dyn Policy {
        self.table.policy()
    }

    /// What the limit looks like to a client (`limit` and window).
    pub fn quota(&self) -> Quota {
        self.policy().quota()
    }
}

/// A validated plugin configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The rules, in order. Every rule that applies must allow a request.
    pub rules: Vec<Rule>,
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
    /// The request headers rules read, indexed by [`HeaderId`]; lower case.
    pub header_names: Vec<String>,
}

/// Interns header names so each is fetched once per request.
#[derive(Default)]
struct Headers {
    names: Vec<String>,
    index: HashMap<String, usize>,
}

impl Headers {
    fn id(&mut self, field: &str, name: &str) -> Result<HeaderId, ConfigError> {
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

    fn validate(raw: RawConfig) -> Result<Config, ConfigError> {
        if raw.rules.is_empty() {
            return Err(error("rules", "must list at least one rule, got []"));
        }
        if raw.rules.len() > MAX_RULES {
            return Err(error("rules", format!("at most {MAX_RULES} rules, got {}", raw.rules.len())));
        }
        let default_max_keys = match raw.max_keys {
            None => u64::from(DEFAULT_MAX_KEYS),
            Some(n) => check_range("max_keys", n, 1, MAX_MAX_KEYS)?,
        };
        let response = validate_response(raw.response)?;
        let max_cas_retries = match raw.max_cas_retries {
            None => DEFAULT_CAS_RETRIES,
            Some(n) => check_range("max_cas_retries", u64::from(n), 0, 64)? as u32,
        };
        let max_delayed_per_worker = match raw.max_delayed_per_worker {
            None => DEFAULT_MAX_DELAYED,
            Some(n) => check_range("max_delayed_per_worker", u64::from(n), 0, 100_000)? as u32,
        };
        let global = raw.global.map(RawService::validate).transpose()?;
        let mut headers = Headers::default();
        let mut rules: Vec<Rule> = Vec::with_capacity(raw.rules.len());
        for (index, rule) in raw.rules.into_iter().enumerate() {
            let at = format!("rules[{index}]");
            let rule = validate_rule(&at, rule, default_max_keys, global.as_ref(), &mut headers)?;
            if rules.iter().any(|r| r.name == rule.name) {
                return Err(error(
                    format!("{at}.name"),
                    format!("{:?} is used by an earlier rule; names must be unique", rule.name),
                ));
            }
            rules.push(rule);
        }
        Ok(Config {
            rules,
            response,
            shadow_mode: raw.shadow_mode,
            failure_mode: raw.failure_mode,
            max_cas_retries,
            max_delayed_per_worker,
            global,
            header_names: headers.names,
        })
    }
}

fn check_range(field: &str, value: u64, min: u64, max: u64) -> Result<u64, ConfigError> {
    if value < min || value > max {
        let bound = if min == max { format!("be {min}") } else { format!("be between {min} and {max}") };
        return Err(error(field, format!("must {bound}, got {value}")));
    }
    Ok(value)
}

fn validate_response(raw: RawResponse) -> Result<Response, ConfigError> {
    check_range("response.status", u64::from(raw.status), 400, 599)?;
    if raw.body.len() > MAX_BODY {
        return Err(error("response.body", format!("at most {MAX_BODY} bytes, got {}", raw.body.len())));
    }
    Ok(Response {
        status: raw.status,
        body: raw.body,
        headers: raw.headers,
        headers_on_allowed: raw.headers_on_allowed,
    })
}

fn validate_rule(
    at: &str,
    raw: RawRule,
    default_max_keys: u64,
    service: Option<&QuotaService>,
    headers: &mut Headers,
) -> Result<Rule, ConfigError> {
    let name = raw.name;
    let name_ok = !name.is_empty()
        && name.len() <= 64
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !name_ok {
        return Err(error(
            format!("{at}.name"),
            format!("{name:?} is not a rule name: use 1 to 64 letters, digits, '_' or '-'"),
        ));
    }
    let request_match = validate_match(&format!("{at}.match"), raw.request_match, headers)?;
    if raw.descriptors.len() > MAX_DESCRIPTORS {
        return Err(error(
            format!("{at}.descriptors"),
            format!("at most {MAX_DESCRIPTORS} entries, got {}", raw.descriptors.len()),
        ));
    }
    let descriptors = raw
        .descriptors
        .into_iter()
        .enumerate()
        .map(|(i, d)| validate_descriptor(&format!("{at}.descriptors[{i}]"), d, headers))
        .collect::<Result<Vec<_>, _>>()?;
    let max_keys = match raw.max_keys {
        None => default_max_keys,
        Some(n) => check_range(&format!("{at}.max_keys"), n, 1, MAX_MAX_KEYS)?,
    };
    // A rule whose descriptor is all constants has exactly one bucket.
    let max_keys = if crate::descriptor::is_constant(&descriptors) { 1 } else { max_keys as u32 };
    let (algorithm, table, global) = if raw.scope == Scope::Global {
        let (table, global) = global_rule(at, service, raw.limit, raw.algorithm, raw.params, max_keys)?;
        (&GLOBAL, table, Some(global))
    } else {
        for only_global in ["mode", "fallback"] {
            if raw.params.contains_key(only_global) {
                return Err(error(format!("{at}.{only_global}"), "applies only to a rule with \"scope\": \"global\""));
            }
        }
        let Some(limit) = raw.limit else { return Err(error(at, "missing field `limit`")) };
        let limit = check_range(&format!("{at}.limit"), limit, 1, MAX_AMOUNT)?;
        let name_of_algorithm = raw.algorithm.as_deref().unwrap_or("token_bucket");
        let Some(algorithm) = Registration::find(name_of_algorithm) else {
            let known: Vec<&str> = ALGORITHMS.iter().map(|a| a.name).collect();
            return Err(error(
                format!("{at}.algorithm"),
                format!("unknown algorithm {name_of_algorithm:?}: use one of {}", known.join(", ")),
            ));
        };
        let policy = algorithm.build(Params::new(at, limit, raw.params))?;
        (algorithm, Table::new(policy, algorithm.tag, max_keys), None)
    };
    let capacity = table.policy().capacity();
    let fixed_cost = check_range(&format!("{at}.cost"), raw.cost.unwrap_or(1), 1, capacity)?;
    let cost = match raw.cost_from_header {
        None => Cost::Fixed(fixed_cost),
        Some(from) => {
            let header = headers.id(&format!("{at}.cost_from_header.header_name"), &from.header_name)?;
            let max = check_range(&format!("{at}.cost_from_header.max"), from.max, 1, capacity)?;
            if fixed_cost > max {
                return Err(error(
                    format!("{at}.cost"),
                    format!("the default cost {fixed_cost} exceeds cost_from_header.max {max}"),
                ));
            }
            Cost::FromHeader { header, default: fixed_cost, max }
        }
    };
    let worker_batch = match raw.worker_batch {
        None => None,
        Some(_) if global.is_some() => {
            return Err(error(
                format!("{at}.worker_batch"),
                "applies only to local rules (a global rule's pools are its batches)",
            ))
        }
        Some(_) if !table.policy().batchable() => {
            return Err(error(
                format!("{at}.worker_batch"),
                format!(
                    "does not apply to {}: its units cannot be taken ahead and spent later without breaking its limit",
                    algorithm.name
                ),
            ))
        }
        Some(n) => Some(check_range(&format!("{at}.worker_batch"), n, 2, capacity.min(MAX_WORKER_BATCH))?),
    };
    Ok(Rule {
        table,
        name,
        request_match,
        descriptors,
        algorithm,
        cost,
        shadow_mode: raw.shadow_mode,
        global,
        worker_batch,
    })
}

fn validate_match(at: &str, raw: RawMatch, headers: &mut Headers) -> Result<RequestMatch, ConfigError> {
    let path = match (raw.path_exact, raw.path_prefix) {
        (Some(_), Some(_)) => return Err(error(at, "give path_exact or path_prefix, not both")),
        (Some(p), None) => Some(PathMatch::Exact(check_path(&format!("{at}.path_exact"), p)?)),
        (None, Some(p)) => Some(PathMatch::Prefix(check_path(&format!("{at}.path_prefix"), p)?)),
        (None, None) => None,
    };
    let methods = match raw.methods {
        Some(methods) if methods.is_empty() => {
            return Err(error(format!("{at}.methods"), "must list at least one method, got []"))
        }
        Some(methods) => {
            for (i, m) in methods.iter().enumerate() {
                if m.is_empty() || !m.bytes().all(|b| b.is_ascii_uppercase()) {
                    return Err(error(
                        format!("{at}.methods[{i}]"),
                        format!("{m:?} is not an HTTP method (upper case, e.g. \"GET\")"),
                    ));
                }
            }
            Some((headers.id(at, ":method")?, methods))
        }
        None => None,
    };
    let authority = match raw.authority {
        Some(a) if a.is_empty() => return Err(error(format!("{at}.authority"), "must not be empty")),
        Some(a) => Some((headers.id(at, ":authority")?, a)),
        None => None,
    };
    let path = match path {
        Some(p) => Some((headers.id(at, ":path")?, p)),
        None => None,
    };
    let route_name = raw.route_name.map(|name| entries::route_name(&format!("{at}.route_name"), name)).transpose()?;
    let route_metadata =
        raw.route_metadata.map(|m| entries::route_metadata(&format!("{at}.route_metadata"), m)).transpose()?;
    Ok(RequestMatch { path, methods, authority, route_name, route_metadata })
}

fn check_path(field: &str, path: String) -> Result<String, ConfigError> {
    if !path.starts_with('/') {
        return Err(error(field, format!("{path:?} must start with '/'")));
    }
    Ok(path)
}

fn check_key(field: &str, key: &str) -> Result<(), ConfigError> {
    if key.is_empty() || key.len() > 128 {
        return Err(error(field, format!("{key:?} must be 1 to 128 bytes")));
    }
    Ok(())
}

fn validate_descriptor(at: &str, raw: RawDescriptor, headers: &mut Headers) -> Result<DescriptorEntry, ConfigError> {
    Ok(match raw {
        RawDescriptor::RequestHeaders(r) => {
            check_key(&format!("{at}.request_headers.descriptor_key"), &r.descriptor_key)?;
            DescriptorEntry::RequestHeaders {
                header: headers.id(&format!("{at}.request_headers.header_name"), &r.header_name)?,
                key: r.descriptor_key,
                skip_if_absent: r.skip_if_absent,
            }
        }
        RawDescriptor::RemoteAddress(RawEmpty {}) => DescriptorEntry::RemoteAddress,
        RawDescriptor::MaskedRemoteAddress(m) => {
            check_range(
                &format!("{at}.masked_remote_address.v4_prefix_mask_len"),
                u64::from(m.v4_prefix_mask_len),
                0,
                32,
            )?;
            check_range(
                &format!("{at}.masked_remote_address.v6_prefix_mask_len"),
                u64::from(m.v6_prefix_mask_len),
                0,
                128,
            )?;
            DescriptorEntry::MaskedRemoteAddress {
                v4_prefix_len: m.v4_prefix_mask_len,
                v6_prefix_len: m.v6_prefix_mask_len,
            }
        }
        RawDescriptor::GenericKey(g) => {
            check_key(&format!("{at}.generic_key.descriptor_key"), &g.descriptor_key)?;
            check_key(&format!("{at}.generic_key.descriptor_value"), &g.descriptor_value)?;
            DescriptorEntry::GenericKey { key: g.descriptor_key, value: g.descriptor_value }
        }
        RawDescriptor::HeaderValueMatch(h) => {
            let here = format!("{at}.header_value_match");
            check_key(&format!("{here}.descriptor_key"), &h.descriptor_key)?;
            check_key(&format!("{here}.descriptor_value"), &h.descriptor_value)?;
            if h.headers.is_empty() {
                return Err(error(format!("{here}.headers"), "must list at least one header, got []"));
            }
            let matchers = h
                .headers
                .into_iter()
                .enumerate()
                .map(|(i, m)| {
                    let field = format!("{here}.headers[{i}]");
                    let string_match = match (m.string_match, m.present_match) {
                        (Some(_), Some(_)) => {
                            return Err(error(&field, "give string_match or present_match, not both"))
                        }
                        (None, None) => return Err(error(&field, "needs string_match or present_match")),
                        (None, Some(present)) => StringMatch::Present(present),
                        (Some(RawStringMatch::Exact(s)), None) => StringMatch::Exact(s.into_bytes()),
                        (Some(RawStringMatch::Prefix(s)), None) => StringMatch::Prefix(s.into_bytes()),
                        (Some(RawStringMatch::Suffix(s)), None) => StringMatch::Suffix(s.into_bytes()),
                        (Some(RawStringMatch::Contains(s)), None) => StringMatch::Contains(s.into_bytes()),
                    };
                    Ok(HeaderMatcher {
                        header: headers.id(&format!("{field}.name"), &m.name)?,
                        string_match,
                        invert_match: m.invert_match,
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            DescriptorEntry::HeaderValueMatch {
                key: h.descriptor_key,
                value: h.descriptor_value,
                expect_match: h.expect_match,
                headers: matchers,
            }
        }
        RawDescriptor::Metadata(m) => entries::metadata(&format!("{at}.metadata"), m)?,
        RawDescriptor::QueryParameters(q) => entries::query_parameters(&format!("{at}.query_parameters"), q, headers)?,
        RawDescriptor::QueryParameterValueMatch(q) => {
            entries::query_parameter_value_match(&format!("{at}.query_parameter_value_match"), q, headers)?
        }
        RawDescriptor::DestinationCluster(RawEmpty {}) => DescriptorEntry::DestinationCluster,
        RawDescriptor::SourceCluster(RawEmpty {}) => DescriptorEntry::SourceCluster,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
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
        assert_eq!(config.header_names, vec![":path".to_string(), "x-api-key".to_string()]);
        assert_eq!(config.failure_mode, FailureMode::Allow);
        assert_eq!(config.max_cas_retries, DEFAULT_CAS_RETRIES);
    }

    #[test]
    fn defaults_are_what_the_readme_says() {
        let config = Config::parse(br#"{"rules": [{"name": "r", "limit": 5, "period": "1s"}]}"#).unwrap();
        let rule = &config.rules[0];
        assert_eq!(rule.algorithm.name, "token_bucket");
        assert_eq!(rule.policy().capacity(), 5);
        assert_eq!(rule.cost, Cost::Fixed(1));
        assert_eq!(rule.table.capacity(), 4, "a constant descriptor needs one bucket (one group)");
        assert_eq!(config.response.status, 429);
        assert_eq!(config.response.headers, HeaderStyle::Ietf);
        let leaky =
            Config::parse(br#"{"rules": [{"name": "r", "algorithm": "leaky_bucket", "limit": 5, "period": "1s"}]}"#)
                .unwrap();
        assert_eq!(leaky.rules[0].policy().capacity(), 1);
    }

    #[test]
    fn header_names_are_interned_once_and_lower_cased() {
        let config = Config::parse(
            br#"{"rules": [
              {"name": "a", "limit": 1, "period": "1s", "descriptors": [{"request_headers": {"header_name": "X-Key", "descriptor_key": "k"}}]},
              {"name": "b", "limit": 1, "period": "1s", "descriptors": [{"request_headers": {"header_name": "x-key", "descriptor_key": "k"}}],
               "cost_from_header": {"header_name": "x-cost", "max": 1}}]}"#,
        )
        .unwrap();
        assert_eq!(config.header_names, vec!["x-key".to_string(), "x-cost".to_string()]);
    }
}
