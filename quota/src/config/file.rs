//! The limits file: envoyproxy/ratelimit's YAML shape, read in one pass
//! with every check inside deserialization, so an error carries the line,
//! column and field path. A level's entries are checked for duplicates here;
//! a `rate_limit` is read in `rate_limit`.

use std::collections::HashMap;
use std::fmt;

use serde::Deserialize;

use super::error::LimitsError;
use super::rate_limit::RawRateLimit;
use super::tree::{DescriptorRule, Domain, KeyEntries, Node};

/// Longest domain name, key or value accepted, in bytes (also on the wire).
pub const MAX_NAME_LEN: usize = floodgate_protocol::MAX_ENTRY_LEN;

/// Parses one YAML document (one domain); `origin` names it in errors.
pub(super) fn parse(origin: &str, text: &str) -> Result<Domain, LimitsError> {
    let deserializer = serde_norway::Deserializer::from_str(text);
    let file: FileDoc = serde_path_to_error::deserialize(deserializer).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let location = inner.location().map(|l| (l.line(), l.column()));
        let message = strip_path(&strip_location(&inner.to_string()));
        LimitsError { origin: origin.to_string(), location, path, message }
    })?;
    let Some(descriptors) = file.descriptors else {
        return Err(LimitsError::plain(
            origin,
            "descriptors is missing: a limits file lists its descriptors (`descriptors: []` for none), so that a \
             file cut short while it is written is refused, not loaded without its limits"
                .into(),
        ));
    };
    Ok(Domain { name: file.domain.0, root: Node { rule: None, children: descriptors.0 } })
}

/// serde_norway appends " at line L column C"; the location is reported once,
/// in front, instead.
fn strip_location(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(at) => message[..at].to_string(),
        None => message.to_string(),
    }
}

/// serde_norway also prefixes its own, coarser path ("descriptors[0]: ...");
/// the precise one from serde_path_to_error is reported instead.
fn strip_path(message: &str) -> String {
    match (message.find(": "), message.find(' ')) {
        (Some(colon), Some(space)) if colon < space => message[colon + 2..].to_string(),
        _ => message.to_string(),
    }
}

/// A file must list its descriptors (`descriptors: []` for none): a file
/// cut short after its `domain` line (written in two steps, read between
/// them) is refused instead of loaded as a domain without limits.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileDoc {
    domain: DomainName,
    #[serde(default, deserialize_with = "listed")]
    descriptors: Option<Children>,
}

/// A `descriptors` field that is there (a list, or empty: `descriptors:`).
fn listed<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Children>, D::Error> {
    Children::deserialize(d).map(Some)
}

struct DomainName(String);

impl<'de> Deserialize<'de> for DomainName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        check_name("domain", &name).map_err(serde::de::Error::custom)?;
        Ok(DomainName(name))
    }
}

fn check_name(what: &str, text: &str) -> Result<(), String> {
    if text.is_empty() {
        return Err(format!("{what} must not be empty"));
    }
    if text.len() > MAX_NAME_LEN {
        return Err(format!("{what} is {} bytes long; at most {MAX_NAME_LEN} are allowed", text.len()));
    }
    Ok(())
}

/// A level's list of descriptors, checked for duplicates.
#[derive(Default)]
struct Children(HashMap<String, KeyEntries>);

impl<'de> Deserialize<'de> for Children {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_option(ChildrenVisitor)
    }
}

struct ChildrenVisitor;

impl<'de> serde::de::Visitor<'de> for ChildrenVisitor {
    type Value = Children;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a sequence of descriptors")
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<Children, E> {
        Ok(Children::default())
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Children, E> {
        Ok(Children::default())
    }

    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Children, D::Error> {
        d.deserialize_seq(self)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Children, A::Error> {
        let mut children = HashMap::new();
        while seq.next_element_seed(Entry(&mut children))?.is_some() {}
        Ok(Children(children))
    }
}

/// One entry of a level, added to the level's `children`. A duplicate is
/// refused while its own mapping is being read, so that the error carries the
/// duplicate's line and column (not the list's or the file's).
struct Entry<'a>(&'a mut HashMap<String, KeyEntries>);

impl<'de> serde::de::DeserializeSeed<'de> for Entry<'_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Entry<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a descriptor (a mapping with `key`)")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        let entry = FileDescriptor::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
        let node = Node { rule: entry.rule, children: entry.descriptors.0 };
        let slot = self.0.entry(entry.key.clone()).or_default();
        let duplicate = match entry.value {
            Some(value) => {
                let dup = slot.values.contains_key(&value).then(|| format!("key {:?} with value {value:?}", entry.key));
                slot.values.insert(value, node);
                dup
            }
            None => {
                let dup = slot.any.is_some().then(|| format!("key {:?} without a value", entry.key));
                slot.any = Some(node);
                dup
            }
        };
        match duplicate {
            Some(which) => {
                Err(serde::de::Error::custom(format!("duplicate descriptor: {which} appears twice at this level")))
            }
            None => Ok(()),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, try_from = "RawDescriptor")]
struct FileDescriptor {
    key: String,
    value: Option<String>,
    rule: Option<DescriptorRule>,
    descriptors: Children,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDescriptor {
    key: String,
    value: Option<String>,
    rate_limit: Option<RawRateLimit>,
    #[serde(default)]
    descriptors: Children,
    #[serde(default)]
    shadow_mode: bool,
    /// Accepted for compatibility; per-descriptor metrics are not kept.
    #[serde(default)]
    #[allow(dead_code)]
    detailed_metric: bool,
}

impl TryFrom<RawDescriptor> for FileDescriptor {
    type Error = String;

    fn try_from(raw: RawDescriptor) -> Result<Self, String> {
        check_name("key", &raw.key)?;
        if let Some(value) = &raw.value {
            check_name("value", value)?;
        }
        let rule = match raw.rate_limit {
            None => {
                if raw.shadow_mode {
                    return Err(format!("descriptor {:?}: shadow_mode needs a rate_limit", raw.key));
                }
                None
            }
            Some(rate) => Some(rate.into_rule(&raw.key, raw.shadow_mode)?),
        };
        Ok(FileDescriptor { key: raw.key, value: raw.value, rule, descriptors: raw.descriptors })
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::config::limit::{Limit, DEFAULT_ALGORITHM};
    use crate::config::Domains;
    use floodgate_core::time::SECOND;

    pub(in crate::config) fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    pub(in crate::config) const SAMPLE: &str = r#"
domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: path
    value: /login
    rate_limit: {unit: MINUTE, requests_per_unit: 5, algorithm: token_bucket, burst: 2}
  - key: path
    descriptors:
      - key: method
        value: POST
        shadow_mode: true
        rate_limit: {unit: hour, requests_per_unit: 100}
  - key: internal
    rate_limit: {unlimited: true}
"#;

    #[test]
    fn parses_the_ratelimit_shape_with_extensions() {
        let domain = Domains::parse_one("sample", SAMPLE).unwrap();
        assert_eq!(domain.name, "edge");
        let Some(DescriptorRule::Limited { limit, shadow }) = domain.rule_for(&pairs(&[("path", "/login")])) else {
            panic!()
        };
        assert_eq!(*limit, Limit::new("token_bucket", 5, SECOND.times(60), r#"{"burst":2}"#).unwrap());
        assert_eq!(limit.capacity(), 2);
        assert!(!shadow);
        let Some(DescriptorRule::Limited { limit, shadow }) =
            domain.rule_for(&pairs(&[("remote_address", "10.0.0.1")]))
        else {
            panic!()
        };
        assert_eq!(limit.algorithm().name, DEFAULT_ALGORITHM);
        assert_eq!(limit.capacity(), 10);
        assert!(!shadow);
        assert_eq!(domain.rule_for(&pairs(&[("internal", "x")])), Some(&DescriptorRule::Unlimited));
    }

    #[test]
    fn errors_name_line_and_field() {
        let text = "domain: edge\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 1\n";
        let err = Domains::parse_one("f.yaml", text).unwrap_err();
        assert_eq!(err.location.map(|l| l.0), Some(5), "{err}");
        let text = err.to_string();
        assert!(text.starts_with("f.yaml:5:"), "{text}");
        assert!(text.contains("descriptors[0].rate_limit.unit"), "{text}");
        assert!(text.contains("unknown unit \"fortnight\""), "{text}");
    }
}
