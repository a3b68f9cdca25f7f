//! The plugin configurations shipped in `deploy/` are the ones the filter
//! accepts: every Istio `WasmPlugin`'s `pluginConfig`, turned into JSON the
//! way Istio hands it to the filter, and every compose sidecar's Envoy
//! configuration go through the filter's own parser; every invalid example in
//! `deploy/test/invalid-plugin-configs/` is refused with its message.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::fs;
use std::path::{Path, PathBuf};

use floodgate_core::config::Config;
use floodgate_core::error::ConfigError;
use floodgate_e2e::repo_root;
use serde::Deserialize;
use serde_json::Value as Json;
use serde_norway::Value as Yaml;

/// The `.yaml` files of a folder of the repository, sorted.
fn yaml_files(dir: &str) -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = fs::read_dir(repo_root().join(dir))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "yaml"))
        .collect();
    paths.sort();
    paths
}

fn documents(path: &Path) -> Vec<Yaml> {
    let text = fs::read_to_string(path).unwrap();
    serde_norway::Deserializer::from_str(&text)
        .map(|doc| Yaml::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .collect()
}

/// A YAML value as Istio passes it to the filter: `pluginConfig` is a
/// `google.protobuf.Struct`, whose numbers are doubles, written out by Go's
/// protobuf JSON encoder (whole numbers below 1e21 without a fraction).
fn istio_json(value: &Yaml) -> Json {
    match value {
        Yaml::Null => Json::Null,
        Yaml::Bool(b) => Json::Bool(*b),
        Yaml::String(s) => Json::String(s.clone()),
        Yaml::Number(n) => {
            let double = n.as_f64().unwrap();
            if double.fract() == 0.0 && double.abs() < 1e21 && double.abs() <= i64::MAX as f64 {
                Json::from(double as i64)
            } else {
                Json::from(double)
            }
        }
        Yaml::Sequence(items) => Json::Array(items.iter().map(istio_json).collect()),
        Yaml::Mapping(map) => Json::Object(
            map.iter()
                .map(|(key, value)| {
                    let key = key.as_str().unwrap_or_else(|| panic!("a Struct key must be a string: {key:?}"));
                    (key.to_string(), istio_json(value))
                })
                .collect(),
        ),
        Yaml::Tagged(tagged) => panic!("a tagged YAML value cannot be a Struct value: {tagged:?}"),
    }
}

/// Every `WasmPlugin` in the file, with its `pluginConfig` parsed by the filter.
fn parse_wasm_plugins(path: &Path) -> Vec<(String, Result<Config, ConfigError>)> {
    documents(path)
        .iter()
        .filter(|doc| doc["kind"] == "WasmPlugin")
        .map(|doc| {
            let name = doc["metadata"]["name"].as_str().unwrap_or("?").to_string();
            let plugin_config = doc["spec"]
                .get("pluginConfig")
                .unwrap_or_else(|| panic!("{}: WasmPlugin {name} has no spec.pluginConfig", path.display()));
            let json = serde_json::to_vec(&istio_json(plugin_config)).unwrap();
            (name, Config::parse(&json))
        })
        .collect()
}

#[test]
fn every_shipped_wasm_plugin_config_is_accepted_by_the_filter() {
    let mut accepted = 0;
    for path in yaml_files("deploy/istio") {
        for (name, parsed) in parse_wasm_plugins(&path) {
            if let Err(e) = parsed {
                panic!("{}: WasmPlugin {name}: {e}", path.display());
            }
            accepted += 1;
        }
    }
    assert!(accepted >= 1, "no WasmPlugin found in deploy/istio");
}

/// A global rule's callouts go to the cluster its `global` section names;
/// in a sidecar that is Istio's outbound cluster of the quota Service's port
/// (`outbound|<port>||<service>.<namespace>.svc.cluster.local`), and a name
/// that matches no Service fails every callout into the fall-back.
#[test]
fn every_shipped_global_section_names_the_quota_service_of_quota_yaml() {
    let docs = documents(&repo_root().join("deploy/istio/quota.yaml"));
    let service = docs
        .iter()
        .find(|doc| doc["kind"] == "Service" && doc["metadata"]["name"] == "floodgate-quota")
        .expect("quota.yaml has no Service floodgate-quota");
    let namespace = service["metadata"]["namespace"].as_str().unwrap();
    let port = service["spec"]["ports"][0]["port"].as_u64().unwrap();
    let host = format!("floodgate-quota.{namespace}.svc.cluster.local");
    let mut checked = 0;
    for path in yaml_files("deploy/istio") {
        for (name, parsed) in parse_wasm_plugins(&path) {
            let Some(global) = parsed.unwrap().settings.global else { continue };
            let at = format!("{}: WasmPlugin {name}", path.display());
            assert_eq!(global.cluster, format!("outbound|{port}||{host}"), "{at}: global.cluster");
            assert_eq!(global.authority, format!("{host}:{port}"), "{at}: global.authority");
            checked += 1;
        }
    }
    assert!(checked >= 1, "no WasmPlugin in deploy/istio has a global section");
}

#[test]
fn istio_json_writes_whole_numbers_as_integers_as_go_does() {
    let yaml: Yaml = serde_norway::from_str("{limit: 100, period: 1m, ratio: 0.5, big: 1.0e21}").unwrap();
    assert_eq!(
        serde_json::to_string(&istio_json(&yaml)).unwrap(),
        r#"{"big":1e+21,"limit":100,"period":"1m","ratio":0.5}"#
    );
}

/// Each example starts with a line `# refused: <start of the error>`.
#[test]
fn every_invalid_plugin_config_example_is_refused_with_its_message() {
    let mut refused = 0;
    for path in yaml_files("deploy/test/invalid-plugin-configs") {
        let text = fs::read_to_string(&path).unwrap();
        let expected = text
            .lines()
            .next()
            .and_then(|line| line.strip_prefix("# refused: "))
            .unwrap_or_else(|| panic!("{} does not start with `# refused: …`", path.display()));
        let plugins = parse_wasm_plugins(&path);
        assert_eq!(plugins.len(), 1, "{}: one WasmPlugin per example", path.display());
        let (name, parsed) = &plugins[0];
        let err = match parsed {
            Ok(_) => panic!("{}: WasmPlugin {name} was accepted", path.display()),
            Err(e) => e,
        };
        let message = format!("{}: {}", err.field, err.message);
        assert!(message.starts_with(expected), "{}:\n  got      {message}\n  expected {expected}", path.display());
        refused += 1;
    }
    assert!(refused >= 5, "only {refused} invalid examples found");
}

/// The plugin configuration of every wasm filter in an Envoy bootstrap.
fn envoy_plugin_configs(value: &Yaml, found: &mut Vec<String>) {
    match value {
        Yaml::Mapping(map) => {
            if let Some(config) = map.get("configuration") {
                if config["@type"] == "type.googleapis.com/google.protobuf.StringValue" {
                    found.push(config["value"].as_str().unwrap().to_string());
                }
            }
            map.values().for_each(|v| envoy_plugin_configs(v, found));
        }
        Yaml::Sequence(items) => items.iter().for_each(|v| envoy_plugin_configs(v, found)),
        _ => {}
    }
}

#[test]
fn the_compose_sidecars_plugin_config_is_accepted_by_the_filter() {
    let path = repo_root().join("deploy/compose/envoy.yaml");
    let mut configs = Vec::new();
    for doc in documents(&path) {
        envoy_plugin_configs(&doc, &mut configs);
    }
    assert_eq!(configs.len(), 1, "{}: one Floodgate filter expected", path.display());
    if let Err(e) = Config::parse(configs[0].as_bytes()) {
        panic!("{}: {e}", path.display());
    }
}
