//! What the native build cannot serve of a valid configuration, refused
//! when the configuration loads with the field named, as the parser
//! refuses an invalid one: Envoy's dynamic module ABI (`v0.2.0`) does not
//! expose everything proxy-wasm does (`native/ABI.md`).
//!
//! - metadata is read one key deep (a namespace and one key: Envoy has no
//!   nested lookup), so a `metadata` entry or a `route_metadata` condition
//!   with a longer path is refused;
//! - the node's cluster is not exposed, so `source_cluster` is refused.

use floodgate_core::config::Config;
use floodgate_core::descriptor::DescriptorEntry;
use floodgate_core::error::ConfigError;
use floodgate_core::metadata::MetadataKey;

/// `Ok` when the native build serves everything `config` asks for.
pub fn check(config: &Config) -> Result<(), ConfigError> {
    for (r, rule) in config.rules.iter().enumerate() {
        if let Some(matcher) = &rule.request_match.route_metadata {
            one_key_deep(&format!("rules[{r}].match.route_metadata.path"), &matcher.key)?;
        }
        for (d, entry) in rule.descriptors.iter().enumerate() {
            match entry {
                DescriptorEntry::Metadata { metadata_key, .. } => {
                    one_key_deep(&format!("rules[{r}].descriptors[{d}].metadata.metadata_key.path"), metadata_key)?;
                }
                DescriptorEntry::SourceCluster => {
                    return Err(ConfigError::new(
                        format!("rules[{r}].descriptors[{d}].source_cluster"),
                        "the native build cannot read this Envoy's service cluster (Envoy's dynamic module ABI does not expose the node): use a generic_key with the cluster's name",
                    ));
                }
                _ => {}
            }
        }
    }
    Ok(())
}

fn one_key_deep(field: &str, key: &MetadataKey) -> Result<(), ConfigError> {
    match key.path.len() {
        1 => Ok(()),
        keys => Err(ConfigError::new(
            field,
            format!(
                "{keys} keys: the native build reads metadata one key deep (a namespace and one key; Envoy's dynamic module ABI has no nested lookup). For a JWT claim, have jwt_authn copy it to a header (claim_to_headers) and use request_headers"
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(json: &str) -> Option<String> {
        check(&Config::parse(json.as_bytes()).unwrap()).err().map(|e| e.to_string())
    }

    #[test]
    fn what_the_abi_serves_passes_and_the_rest_is_refused_by_field() {
        let one_key = r#"{"rules": [{"name": "u", "limit": 1, "period": "1s",
            "match": {"route_metadata": {"filter": "ns", "path": [{"key": "tier"}], "value": {"present_match": true}}},
            "descriptors": [{"metadata": {"descriptor_key": "user",
                "metadata_key": {"key": "envoy.filters.http.header_to_metadata", "path": [{"key": "user"}]}}},
                {"destination_cluster": {}}, {"remote_address": {}}]}]}"#;
        assert_eq!(refusal(one_key), None);
        let claim = r#"{"rules": [{"name": "u", "limit": 1, "period": "1s",
            "descriptors": [{"metadata": {"descriptor_key": "user",
                "metadata_key": {"key": "envoy.filters.http.jwt_authn", "path": [{"key": "jwt_payload"}, {"key": "sub"}]}}}]}]}"#;
        let message = refusal(claim).unwrap();
        assert!(message.contains("rules[0].descriptors[0].metadata.metadata_key.path: 2 keys"), "{message}");
        let source =
            r#"{"rules": [{"name": "u", "limit": 1, "period": "1s", "descriptors": [{"source_cluster": {}}]}]}"#;
        assert!(refusal(source).unwrap().contains("rules[0].descriptors[0].source_cluster"));
        let global = r#"{"rules": [{"name": "g", "scope": "global", "descriptors": [{"generic_key": {"descriptor_value": "a"}}]}],
            "global": {"cluster": "quota", "domain": "edge"}}"#;
        assert_eq!(refusal(global), None, "global rules are served");
    }
}
