//! The limits file: envoyproxy/ratelimit's YAML shape, so its users can bring
//! their files, plus optional extensions: `algorithm`, and that algorithm's
//! own fields, which the core's registry lists and validates.
//!
//! Parsing happens in one pass with validation inside deserialization, so that
//! every error, including semantic ones (a zero limit, an unknown unit, a
//! duplicate entry), carries the YAML line and column and the field path.
//! The result is [`Domains`] that cannot hold an invalid rule.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use floodgate_core::algorithm::{Params, Policy, Registration, ALGORITHMS};
use floodgate_core::bounds::MAX_AMOUNT;
use floodgate_core::time::{Nanos, SECOND};
use serde::Deserialize;

/// Longest domain name, key or value accepted, in bytes (also on the wire).
pub const MAX_NAME_LEN: usize = floodgate_protocol::MAX_ENTRY_LEN;

/// The algorithm of a rule without `algorithm`: a fixed window, as
/// envoyproxy/ratelimit counts.
pub const DEFAULT_ALGORITHM: &str = "fixed_window";

/// The algorithms the service offers: the core's, except those that can
/// only run in the proxy (their registration says why).
fn offered_algorithms() -> impl Iterator<Item = &'static Registration> {
    ALGORITHMS.iter().filter(|r| r.local_only.is_none())
}

/// The registration of algorithm `name`, or why the service does not offer it.
fn offered(name: &str) -> Result<&'static Registration, String> {
    match Registration::find(name) {
        Some(registration) => match registration.local_only {
            None => Ok(registration),
            Some(why) => Err(format!("algorithm {name:?} is not offered by the quota service: {why}")),
        },
        None => Err(format!(
            "unknown algorithm {name:?}: the quota service supports {DEFAULT_ALGORITHM} (the default), {}",
            offered_algorithms().map(|r| r.name).filter(|n| *n != DEFAULT_ALGORITHM).collect::<Vec<_>>().join(", ")
        )),
    }
}

/// The core's name for the field the limits file calls `unit`.
const PERIOD: &str = "period";

/// Every offered algorithm's own fields (`burst`, `warmup`…), once each, in
/// registry order: what a limits file may write beside `unit` and
/// `requests_per_unit`, for the core to validate.
fn algorithm_fields() -> Vec<&'static str> {
    let mut fields: Vec<&'static str> = Vec::new();
    for field in offered_algorithms().flat_map(|r| r.fields.iter().copied()) {
        if field != PERIOD && !fields.contains(&field) {
            fields.push(field);
        }
    }
    fields
}

/// A validated limit (cheap to clone): one of the core's algorithms, built by the core from
/// the rule (`requests_per_unit` is its `limit`, `unit` its `period`, the
/// algorithm's own fields as written), and what is needed to build it again
/// (lease records keep it, so a return is decided under the limit its lease
/// was granted under).
#[derive(Clone)]
pub struct Limit {
    algorithm: &'static Registration,
    limit: u64,
    period: Nanos,
    /// The algorithm's own fields (`burst`, `sub_windows`…), as JSON.
    fields: Arc<str>,
    policy: Arc<dyn Policy>,
}

impl Limit {
    /// Builds the offered algorithm named `algorithm` admitting `limit`
    /// units per `period` (whole milliseconds), with its own `fields` (a JSON
    /// object, e.g. `{"burst": 5}`), validated by the core. The error names
    /// the field as the limits file does.
    pub fn new(algorithm: &str, limit: u64, period: Nanos, fields: &str) -> Result<Self, String> {
        let registration = offered(algorithm)?;
        let mut params: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(fields).map_err(|e| format!("algorithm fields {fields:?}: {e}"))?;
        for field in params.keys() {
            if !registration.fields.contains(&field.as_str()) || field == PERIOD {
                let takes: Vec<&str> = registration.fields.iter().copied().filter(|f| *f != PERIOD).collect();
                let takes = if takes.is_empty() { "no other fields".to_string() } else { takes.join(", ") };
                return Err(format!("{field} does not apply to algorithm {} (it takes {takes})", registration.name));
            }
        }
        let fields: Arc<str> = serde_json::Value::Object(params.clone()).to_string().into();
        let millis = Nanos::from_millis(1).get();
        if period == Nanos::ZERO || period.get() % millis != 0 {
            return Err(format!("the period must be a positive whole number of milliseconds, not {period}"));
        }
        params.insert(PERIOD.into(), format!("{}ms", period.get() / millis).into());
        let policy = registration.build(Params::new(RULE, limit, params)).map_err(|e| {
            let field = e.field.strip_prefix(RULE).unwrap_or(&e.field).trim_start_matches('.');
            match field {
                "" => format!("{} (algorithm {})", e.message, registration.name),
                "limit" => format!("requests_per_unit: {}", e.message),
                PERIOD => format!("unit: {}", e.message),
                field => format!("{field}: {}", e.message),
            }
        })?;
        Ok(Self { algorithm: registration, limit, period, fields, policy })
    }

    /// The algorithm's registration in the core.
    pub fn algorithm(&self) -> &'static Registration {
        self.algorithm
    }

    /// Units per period (`requests_per_unit`).
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The period (the `unit`).
    pub fn period(&self) -> Nanos {
        self.period
    }

    /// The algorithm's own fields as JSON (`{}` when none).
    pub fn fields(&self) -> &str {
        &self.fields
    }

    /// The most units one decision can take (`burst` for the bucket
    /// algorithms, `requests_per_unit` for the window and log algorithms).
    pub fn capacity(&self) -> u64 {
        self.policy.capacity()
    }

    /// The core's algorithm, ready to decide on stored bytes.
    pub fn policy(&self) -> &dyn Policy {
        self.policy.as_ref()
    }
}

/// Where [`Limit::new`] says the core's errors are (stripped again).
const RULE: &str = "rate_limit";

impl PartialEq for Limit {
    /// Same inputs, same algorithm.
    fn eq(&self, other: &Self) -> bool {
        (self.algorithm.name, self.limit, self.period, &*self.fields)
            == (other.algorithm.name, other.limit, other.period, &*other.fields)
    }
}

impl Eq for Limit {}

impl fmt::Debug for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limit")
            .field("algorithm", &self.algorithm.name)
            .field("limit", &self.limit)
            .field("period", &self.period)
            .field("fields", &self.fields)
            .finish()
    }
}

/// What a matched descriptor is subject to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DescriptorRule {
    /// Counted against `limit`; with `shadow` set, over-limit decisions are
    /// counted in metrics but reported as allowed.
    Limited {
        /// The limit.
        limit: Limit,
        /// `shadow_mode` from the file.
        shadow: bool,
    },
    /// `unlimited: true`: always allowed, never counted.
    Unlimited,
}

/// One level of the descriptor tree.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Node {
    rule: Option<DescriptorRule>,
    children: HashMap<String, KeyEntries>,
}

/// Entries of one key at one level: the key-only entry and key+value entries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct KeyEntries {
    any: Option<Node>,
    values: HashMap<String, Node>,
}

/// One domain's limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Domain {
    /// The domain name.
    pub name: String,
    root: Node,
}

impl Domain {
    /// The rule for a request descriptor (ordered key/value entries), following
    /// envoyproxy/ratelimit: at each level a key+value entry wins over a
    /// key-only entry, and only the entry matching the last pair applies.
    pub fn rule_for<'a>(&'a self, entries: &[(String, String)]) -> Option<&'a DescriptorRule> {
        let mut node = &self.root;
        let last = entries.len().checked_sub(1)?;
        for (i, (key, value)) in entries.iter().enumerate() {
            let by_key = node.children.get(key)?;
            node = by_key.values.get(value).or(by_key.any.as_ref())?;
            if i == last {
                return node.rule.as_ref();
            }
        }
        None
    }
}

/// Every configured domain.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Domains {
    domains: HashMap<String, Domain>,
}

impl Domains {
    /// The domain named `name`.
    pub fn domain(&self, name: &str) -> Option<&Domain> {
        self.domains.get(name)
    }

    /// Number of domains.
    pub fn len(&self) -> usize {
        self.domains.len()
    }

    /// True when no domain is configured.
    pub fn is_empty(&self) -> bool {
        self.domains.is_empty()
    }

    /// Parses one YAML document (one domain); `origin` names it in errors.
    pub fn parse_one(origin: &str, text: &str) -> Result<Domain, LimitsError> {
        let deserializer = serde_norway::Deserializer::from_str(text);
        let file: FileDoc = serde_path_to_error::deserialize(deserializer).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            let location = inner.location().map(|l| (l.line(), l.column()));
            let message = strip_path(&strip_location(&inner.to_string()));
            LimitsError { origin: origin.to_string(), location, path, message }
        })?;
        Ok(Domain { name: file.domain.0, root: Node { rule: None, children: file.descriptors.0 } })
    }

    /// Reads and parses every file; each defines one domain, and a domain may
    /// be defined only once.
    pub fn load(paths: &[PathBuf]) -> Result<Domains, LimitsError> {
        let mut domains = HashMap::new();
        for path in paths {
            let origin = path.display().to_string();
            let text =
                std::fs::read_to_string(path).map_err(|e| LimitsError::plain(&origin, format!("cannot read: {e}")))?;
            let domain = Self::parse_one(&origin, &text)?;
            if domains.contains_key(&domain.name) {
                return Err(LimitsError::plain(
                    &origin,
                    format!("domain {:?} is defined in more than one file", domain.name),
                ));
            }
            domains.insert(domain.name.clone(), domain);
        }
        Ok(Domains { domains })
    }

    /// Builds a config from domains already parsed (tests, embedding).
    pub fn from_domains(list: impl IntoIterator<Item = Domain>) -> Domains {
        Domains { domains: list.into_iter().map(|d| (d.name.clone(), d)).collect() }
    }
}

/// Why a limits file was refused: which file, where, which field, and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitsError {
    /// The file (or other origin) of the text.
    pub origin: String,
    /// Line and column (1-based) where known.
    pub location: Option<(usize, usize)>,
    /// The field path, e.g. `descriptors[0].rate_limit.unit`.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl LimitsError {
    fn plain(origin: &str, message: String) -> Self {
        Self { origin: origin.to_string(), location: None, path: String::new(), message }
    }
}

impl fmt::Display for LimitsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.origin)?;
        if let Some((line, column)) = self.location {
            write!(f, ":{line}:{column}")?;
        }
        if !self.path.is_empty() && self.path != "." {
            write!(f, ": {}", self.path)?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for LimitsError {}

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

// ---- the file format, validated while it is deserialized ----

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileDoc {
    domain: DomainName,
    #[serde(default)]
    descriptors: Children,
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

/// A `rate_limit` as written: envoyproxy/ratelimit's fields, `algorithm`,
/// and the algorithm's own fields, which the core validates (so this parser
/// knows no algorithm's fields by name: any offered algorithm's is taken).
#[derive(Default)]
struct RawRateLimit {
    unit: Option<Unit>,
    requests_per_unit: Option<u64>,
    unlimited: bool,
    algorithm: Option<AlgorithmName>,
    fields: serde_json::Map<String, serde_json::Value>,
}

impl<'de> Deserialize<'de> for RawRateLimit {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(RateLimitVisitor)
    }
}

struct RateLimitVisitor;

/// A field of a `rate_limit`; an unknown one is refused while its key is
/// read, so that the error points at the key.
enum Field {
    Unit,
    RequestsPerUnit,
    Unlimited,
    Algorithm,
    /// Accepted for compatibility with envoyproxy/ratelimit; unused.
    Name,
    /// One of an offered algorithm's own fields.
    Own(String),
}

impl<'de> Deserialize<'de> for Field {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(FieldVisitor)
    }
}

struct FieldVisitor;

impl serde::de::Visitor<'_> for FieldVisitor {
    type Value = Field;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E: serde::de::Error>(self, name: &str) -> Result<Field, E> {
        Ok(match name {
            "unit" => Field::Unit,
            "requests_per_unit" => Field::RequestsPerUnit,
            "unlimited" => Field::Unlimited,
            "algorithm" => Field::Algorithm,
            "name" => Field::Name,
            _ if algorithm_fields().contains(&name) => Field::Own(name.to_string()),
            _ => {
                return Err(E::custom(format!(
                    "unknown field `{name}`, expected unit, requests_per_unit, unlimited, name, algorithm or an \
                     algorithm's field ({})",
                    algorithm_fields().join(", ")
                )))
            }
        })
    }
}

/// Sets a field read once; a repeated field is an error.
fn once<T, E: serde::de::Error>(slot: &mut Option<T>, field: &str, value: T) -> Result<(), E> {
    if slot.replace(value).is_some() {
        return Err(E::custom(format!("duplicate field `{field}`")));
    }
    Ok(())
}

impl<'de> serde::de::Visitor<'de> for RateLimitVisitor {
    type Value = RawRateLimit;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a rate_limit (a mapping with unit and requests_per_unit, or unlimited)")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<RawRateLimit, A::Error> {
        let mut raw = RawRateLimit::default();
        let mut unlimited = None;
        while let Some(field) = map.next_key::<Field>()? {
            match field {
                Field::Unit => once(&mut raw.unit, "unit", map.next_value()?)?,
                Field::RequestsPerUnit => once(&mut raw.requests_per_unit, "requests_per_unit", map.next_value()?)?,
                Field::Unlimited => once(&mut unlimited, "unlimited", map.next_value()?)?,
                Field::Algorithm => once(&mut raw.algorithm, "algorithm", map.next_value()?)?,
                Field::Name => {
                    let _: Option<String> = map.next_value()?;
                }
                Field::Own(name) => {
                    let value: serde_json::Value = map.next_value()?;
                    if raw.fields.insert(name.clone(), value).is_some() {
                        return Err(serde::de::Error::custom(format!("duplicate field `{name}`")));
                    }
                }
            }
        }
        raw.unlimited = unlimited.unwrap_or(false);
        Ok(raw)
    }
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

impl RawRateLimit {
    fn into_rule(self, key: &str, shadow: bool) -> Result<DescriptorRule, String> {
        if self.unlimited {
            if self.unit.is_some()
                || self.requests_per_unit.is_some()
                || self.algorithm.is_some()
                || !self.fields.is_empty()
            {
                return Err(format!(
                    "descriptor {key:?}: rate_limit with unlimited: true must not set unit, requests_per_unit, algorithm or {}",
                    algorithm_fields().join(", ")
                ));
            }
            return Ok(DescriptorRule::Unlimited);
        }
        let (Some(unit), Some(limit)) = (self.unit, self.requests_per_unit) else {
            return Err(format!(
                "descriptor {key:?}: rate_limit needs both unit and requests_per_unit (or unlimited: true)"
            ));
        };
        if limit == 0 || limit > MAX_AMOUNT {
            return Err(format!(
                "descriptor {key:?}: requests_per_unit must be between 1 and {MAX_AMOUNT}, not {limit}"
            ));
        }
        let algorithm = self.algorithm.map_or(DEFAULT_ALGORITHM, |a| a.0);
        let fields = serde_json::Value::Object(self.fields).to_string();
        let limit = Limit::new(algorithm, limit, unit.0, &fields).map_err(|e| format!("descriptor {key:?}: {e}"))?;
        Ok(DescriptorRule::Limited { limit, shadow })
    }
}

/// A `unit`, case-insensitive as envoyproxy/ratelimit reads it.
struct Unit(Nanos);

impl<'de> Deserialize<'de> for Unit {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        let seconds: u64 = match text.to_ascii_lowercase().as_str() {
            "second" => 1,
            "minute" => 60,
            "hour" => 3_600,
            "day" => 86_400,
            "week" => 7 * 86_400,
            // envoyproxy/ratelimit's fixed lengths for these calendar units.
            "month" => 30 * 86_400,
            "year" => 365 * 86_400,
            _ => {
                return Err(serde::de::Error::custom(format!(
                    "unknown unit {text:?}: use second, minute, hour, day, week, month or year"
                )))
            }
        };
        Ok(Unit(SECOND.times(seconds)))
    }
}

/// An offered algorithm's registry name; others are refused here, where the
/// error points at the value.
struct AlgorithmName(&'static str);

impl<'de> Deserialize<'de> for AlgorithmName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        offered(&text).map(|r| AlgorithmName(r.name)).map_err(serde::de::Error::custom)
    }
}

/// Reads a config from files again when their contents change.
#[derive(Debug)]
pub struct Watched {
    paths: Vec<PathBuf>,
    last: Vec<Option<Vec<u8>>>,
}

impl Watched {
    /// Watches `paths`, taking their current contents as already loaded.
    pub fn new(paths: Vec<PathBuf>) -> Self {
        let last = paths.iter().map(|p| read_bytes(p)).collect();
        Self { paths, last }
    }

    /// `None` when no file changed; otherwise the result of loading them all.
    /// Contents, not mtimes, are compared: an edit within the same second
    /// (or a file replaced by a rename) is still noticed.
    pub fn poll(&mut self) -> Option<Result<Domains, LimitsError>> {
        let now: Vec<Option<Vec<u8>>> = self.paths.iter().map(|p| read_bytes(p)).collect();
        if now == self.last {
            return None;
        }
        self.last = now;
        Some(Domains::load(&self.paths))
    }
}

fn read_bytes(path: &Path) -> Option<Vec<u8>> {
    std::fs::read(path).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    const SAMPLE: &str = r#"
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
    fn key_and_value_wins_and_only_the_last_entry_applies() {
        let domain = Domains::parse_one("sample", SAMPLE).unwrap();
        // /login has no nested method entry: the key+value node wins at level 1
        // and has no children, so nothing matches.
        assert_eq!(domain.rule_for(&pairs(&[("path", "/login"), ("method", "POST")])), None);
        // Another path falls to the key-only entry, whose child matches.
        let Some(DescriptorRule::Limited { shadow, .. }) =
            domain.rule_for(&pairs(&[("path", "/x"), ("method", "POST")]))
        else {
            panic!()
        };
        assert!(shadow);
        // The key-only path node itself has no limit.
        assert_eq!(domain.rule_for(&pairs(&[("path", "/x")])), None);
        assert_eq!(domain.rule_for(&pairs(&[("path", "/x"), ("method", "GET")])), None);
        assert_eq!(domain.rule_for(&[]), None);
        assert_eq!(domain.rule_for(&pairs(&[("nope", "1")])), None);
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
