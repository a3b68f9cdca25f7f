//! The configuration of the descriptor entries and match conditions that
//! read Envoy's attributes rather than headers: `metadata`,
//! `query_parameters`, `query_parameter_value_match`, and `match.route_name`
//! and `match.route_metadata` (`destination_cluster` and `source_cluster`
//! have no fields). Shaped as Envoy's `RateLimit.Action`s and
//! `MetadataMatcher`; every error names the field.

use serde::Deserialize;

use super::checks::{check_key, default_true, error, string_or_present, Headers, RawStringMatch};
use crate::descriptor::{DescriptorEntry, MetadataMatcher, MetadataValueMatch, QueryMatcher};
use crate::error::ConfigError;
use crate::metadata::{MetadataKey, MetadataSource};

/// The longest namespace, path segment, parameter or route name.
const MAX_NAME_BYTES: usize = 256;
/// The deepest metadata path.
const MAX_PATH_SEGMENTS: usize = 16;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMetadata {
    descriptor_key: String,
    metadata_key: RawMetadataKey,
    default_value: Option<String>,
    #[serde(default)]
    source: RawSource,
    #[serde(default)]
    skip_if_absent: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMetadataKey {
    key: String,
    path: Vec<RawPathSegment>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a path segment {\"key\": name}")]
struct RawPathSegment {
    key: String,
}

#[derive(Deserialize, Default)]
enum RawSource {
    #[default]
    #[serde(rename = "DYNAMIC")]
    Dynamic,
    #[serde(rename = "ROUTE_ENTRY")]
    RouteEntry,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawQueryParameters {
    query_parameter_name: String,
    descriptor_key: String,
    #[serde(default)]
    skip_if_absent: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawQueryParameterValueMatch {
    descriptor_value: String,
    #[serde(default = "default_query_match_key")]
    descriptor_key: String,
    #[serde(default = "default_true")]
    expect_match: bool,
    query_parameters: Vec<RawQueryMatcher>,
}

fn default_query_match_key() -> String {
    "query_match".into()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawQueryMatcher {
    name: String,
    string_match: Option<RawStringMatch>,
    present_match: Option<bool>,
}

/// `match.route_metadata`: Envoy's `MetadataMatcher` with a `string_match`,
/// `bool_match` or `present_match` value.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMetadataMatcher {
    filter: String,
    path: Vec<RawPathSegment>,
    value: RawValueMatcher,
    #[serde(default)]
    invert: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawValueMatcher {
    string_match: Option<RawStringMatch>,
    bool_match: Option<bool>,
    present_match: Option<bool>,
}

fn check_name(field: &str, name: &str) -> Result<(), ConfigError> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES {
        return Err(error(field, format!("{name:?} must be 1 to {MAX_NAME_BYTES} bytes")));
    }
    Ok(())
}

fn metadata_key(at: &str, namespace: String, path: Vec<RawPathSegment>) -> Result<MetadataKey, ConfigError> {
    if path.is_empty() || path.len() > MAX_PATH_SEGMENTS {
        return Err(error(
            format!("{at}.path"),
            format!("must list 1 to {MAX_PATH_SEGMENTS} segments ({{\"key\": name}}), got {}", path.len()),
        ));
    }
    for (i, segment) in path.iter().enumerate() {
        check_name(&format!("{at}.path[{i}].key"), &segment.key)?;
    }
    Ok(MetadataKey { namespace, path: path.into_iter().map(|s| s.key).collect() })
}

/// Validates a `metadata` entry at `at` (the entry's own field, `….metadata`).
pub(super) fn metadata(at: &str, raw: RawMetadata) -> Result<DescriptorEntry, ConfigError> {
    check_key(&format!("{at}.descriptor_key"), &raw.descriptor_key)?;
    check_name(&format!("{at}.metadata_key.key"), &raw.metadata_key.key)?;
    let metadata_key = metadata_key(&format!("{at}.metadata_key"), raw.metadata_key.key, raw.metadata_key.path)?;
    if let Some(default) = &raw.default_value {
        check_key(&format!("{at}.default_value"), default)?;
        if raw.skip_if_absent {
            return Err(error(
                format!("{at}.skip_if_absent"),
                "has no effect with default_value (the default is used instead): give one or the other",
            ));
        }
    }
    Ok(DescriptorEntry::Metadata {
        key: raw.descriptor_key,
        source: match raw.source {
            RawSource::Dynamic => MetadataSource::Dynamic,
            RawSource::RouteEntry => MetadataSource::RouteEntry,
        },
        metadata_key,
        default_value: raw.default_value,
        skip_if_absent: raw.skip_if_absent,
    })
}

/// Validates a `query_parameters` entry at `at`.
pub(super) fn query_parameters(
    at: &str,
    raw: RawQueryParameters,
    headers: &mut Headers,
) -> Result<DescriptorEntry, ConfigError> {
    check_name(&format!("{at}.query_parameter_name"), &raw.query_parameter_name)?;
    check_key(&format!("{at}.descriptor_key"), &raw.descriptor_key)?;
    Ok(DescriptorEntry::QueryParameters {
        path: headers.id(at, ":path")?,
        name: raw.query_parameter_name,
        key: raw.descriptor_key,
        skip_if_absent: raw.skip_if_absent,
    })
}

/// Validates a `query_parameter_value_match` entry at `at`.
pub(super) fn query_parameter_value_match(
    at: &str,
    raw: RawQueryParameterValueMatch,
    headers: &mut Headers,
) -> Result<DescriptorEntry, ConfigError> {
    check_key(&format!("{at}.descriptor_key"), &raw.descriptor_key)?;
    check_key(&format!("{at}.descriptor_value"), &raw.descriptor_value)?;
    if raw.query_parameters.is_empty() {
        return Err(error(format!("{at}.query_parameters"), "must list at least one parameter, got []"));
    }
    let parameters = raw
        .query_parameters
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let field = format!("{at}.query_parameters[{i}]");
            check_name(&format!("{field}.name"), &m.name)?;
            let string_match = string_or_present(&field, m.string_match, m.present_match)?;
            Ok(QueryMatcher { name: m.name, string_match })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(DescriptorEntry::QueryParameterValueMatch {
        path: headers.id(at, ":path")?,
        key: raw.descriptor_key,
        value: raw.descriptor_value,
        expect_match: raw.expect_match,
        parameters,
    })
}

/// Validates `match.route_name` at `at`.
pub(super) fn route_name(at: &str, name: String) -> Result<String, ConfigError> {
    check_name(at, &name)?;
    Ok(name)
}

/// Validates `match.route_metadata` at `at`.
pub(super) fn route_metadata(at: &str, raw: RawMetadataMatcher) -> Result<MetadataMatcher, ConfigError> {
    check_name(&format!("{at}.filter"), &raw.filter)?;
    let key = metadata_key(at, raw.filter, raw.path)?;
    let value = match (raw.value.string_match, raw.value.bool_match, raw.value.present_match) {
        (Some(raw), None, None) => MetadataValueMatch::String(raw.validate()),
        (None, Some(b), None) => MetadataValueMatch::Bool(b),
        (None, None, Some(true)) => MetadataValueMatch::Present,
        (None, None, Some(false)) => {
            return Err(error(
                format!("{at}.value.present_match"),
                "only true is supported: for an absent value, use present_match: true with invert: true",
            ))
        }
        _ => return Err(error(format!("{at}.value"), "needs exactly one of string_match, bool_match, present_match")),
    };
    Ok(MetadataMatcher { key, value, invert: raw.invert })
}

#[cfg(test)]
mod tests {
    use crate::config::Config;
    use crate::descriptor::{DescriptorEntry, HeaderId, MetadataValueMatch, StringMatch};
    use crate::metadata::{MetadataKey, MetadataSource};
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn every_new_entry_and_condition_parses_with_envoys_defaults() {
        let config = Config::parse(
            br#"{"rules": [{"name": "r", "limit": 5, "period": "1s",
                "match": {"route_name": "api", "route_metadata": {"filter": "floodgate", "path": [{"key": "tier"}],
                          "value": {"string_match": {"prefix": "go"}}}},
                "descriptors": [
                  {"metadata": {"descriptor_key": "user",
                                "metadata_key": {"key": "envoy.filters.http.jwt_authn", "path": [{"key": "jwt_payload"}, {"key": "sub"}]}}},
                  {"metadata": {"descriptor_key": "tier", "source": "ROUTE_ENTRY", "default_value": "free",
                                "metadata_key": {"key": "floodgate", "path": [{"key": "tier"}]}}},
                  {"query_parameters": {"query_parameter_name": "key", "descriptor_key": "api_key", "skip_if_absent": true}},
                  {"query_parameter_value_match": {"descriptor_value": "debug", "query_parameters": [{"name": "debug", "present_match": true}]}},
                  {"destination_cluster": {}},
                  {"source_cluster": {}}]}]}"#,
        )
        .unwrap();
        let rule = &config.rules[0];
        assert_eq!(rule.request_match.route_name.as_deref(), Some("api"));
        let route_metadata = rule.request_match.route_metadata.as_ref().unwrap();
        assert_eq!(route_metadata.value, MetadataValueMatch::String(StringMatch::Prefix(b"go".to_vec())));
        assert!(!route_metadata.invert);
        assert_eq!(config.settings.header_names, vec![":path".to_string()]);
        assert_eq!(
            rule.descriptors[0],
            DescriptorEntry::Metadata {
                key: "user".into(),
                source: MetadataSource::Dynamic,
                metadata_key: MetadataKey {
                    namespace: "envoy.filters.http.jwt_authn".into(),
                    path: vec!["jwt_payload".into(), "sub".into()]
                },
                default_value: None,
                skip_if_absent: false,
            }
        );
        assert!(matches!(
            &rule.descriptors[1],
            DescriptorEntry::Metadata { source: MetadataSource::RouteEntry, default_value: Some(d), .. } if d == "free"
        ));
        assert_eq!(
            rule.descriptors[2],
            DescriptorEntry::QueryParameters {
                path: HeaderId(0),
                name: "key".into(),
                key: "api_key".into(),
                skip_if_absent: true
            }
        );
        assert!(matches!(
            &rule.descriptors[3],
            DescriptorEntry::QueryParameterValueMatch { key, expect_match: true, .. } if key == "query_match"
        ));
        assert_eq!(rule.descriptors[4..], [DescriptorEntry::DestinationCluster, DescriptorEntry::SourceCluster]);
        assert_eq!(rule.table.capacity(), 65_536, "per-user: not one bucket");
    }
}
