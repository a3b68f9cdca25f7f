//! Descriptors: what identifies a bucket, taken from the request the way
//! Envoy's rate-limit actions take it (`request_headers`, `remote_address`,
//! `masked_remote_address`, `generic_key`, `header_value_match`, `metadata`,
//! `query_parameters`, `query_parameter_value_match`, `destination_cluster`,
//! `source_cluster`), the request matching that decides whether a rule
//! applies at all, and what a request costs.
//!
//! Every value an entry contributes is bounded ([`crate::value`]).

use std::net::IpAddr;

use crate::hash::SipHasher;
use crate::metadata::{self, Found, MetadataKey, MetadataSource, Wanted};
use crate::query;
use crate::value::{bounded_text, BoundedValue};

/// A header the configuration refers to, as an index into the list of header
/// names it needs ([`crate::config::Config::header_names`]). The filter fetches
/// each one from Envoy at most once per request, and only if a rule asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HeaderId(pub usize);

/// What Envoy knows of a request besides its headers and address, for the
/// entries and conditions that read it. `docs/envoy-attributes.md` says how
/// Envoy serves each one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Attribute {
    /// The request's dynamic metadata, a serialized `envoy.config.core.v3.Metadata`.
    DynamicMetadata,
    /// The matched route's metadata, a serialized `Metadata`.
    RouteMetadata,
    /// The matched route's name.
    RouteName,
    /// The matched route's upstream cluster.
    DestinationCluster,
    /// This Envoy's service cluster (`node.cluster`, or `--service-cluster`).
    SourceCluster,
}

impl Attribute {
    /// How many attributes there are; [`Attribute::index`] is below it.
    pub const COUNT: usize = 5;

    /// A dense index, for a per-request cache.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The metadata a `metadata` entry or condition with `source` reads.
    pub fn metadata(source: MetadataSource) -> Attribute {
        match source {
            MetadataSource::Dynamic => Attribute::DynamicMetadata,
            MetadataSource::RouteEntry => Attribute::RouteMetadata,
        }
    }
}

/// The request as the limiter sees it. Values are raw bytes: header values
/// need not be UTF-8 and are never required to be.
pub trait Request {
    /// The value of header `id`, or `None` when the request lacks it.
    fn header(&mut self, id: HeaderId) -> Option<&[u8]>;

    /// The downstream remote address as Envoy determined it (`ip:port`,
    /// `[v6]:port`, or a bare ip), or `None` when it is not an IP address.
    fn remote_address(&mut self) -> Option<&[u8]>;

    /// `attribute`'s bytes, or `None` when Envoy has none (or only empty bytes).
    fn attribute(&mut self, attribute: Attribute) -> Option<&[u8]>;

    /// The value at `key` in the metadata `source` names, where the caller
    /// uses only the kinds of value `wanted` says (a host may answer
    /// [`Found::Absent`] for any other). By default it is found in the
    /// serialized metadata [`Request::attribute`] gives (what the wasm build
    /// reads), whatever its kind; a host that reads metadata by key instead
    /// answers it itself.
    fn metadata(&mut self, source: MetadataSource, key: &MetadataKey, wanted: Wanted) -> Found<'_> {
        let _ = wanted;
        match self.attribute(Attribute::metadata(source)) {
            Some(blob) => metadata::lookup(blob, key),
            None => Found::Absent,
        }
    }
}

/// How much a request takes from a bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cost {
    /// Every request costs this.
    Fixed(u64),
    /// The request header's decimal value, clamped to `1..=max`; `default`
    /// when the header is absent or not a number.
    FromHeader {
        /// The header read.
        header: HeaderId,
        /// Cost when the header is absent or unreadable.
        default: u64,
        /// The most one request can cost.
        max: u64,
    },
}

impl Cost {
    /// What `request` costs.
    pub fn of(&self, request: &mut dyn Request) -> u64 {
        match self {
            Cost::Fixed(cost) => *cost,
            Cost::FromHeader { header, default, max } => {
                request.header(*header).and_then(parse_decimal).map_or(*default, |cost| cost.clamp(1, *max))
            }
        }
    }
}

/// A plain decimal number; one too large for a u64 reads as `u64::MAX`, so
/// a huge cost header costs the configured maximum, not the default.
fn parse_decimal(bytes: &[u8]) -> Option<u64> {
    if bytes.is_empty() || !bytes.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(bytes.iter().fold(0u64, |n, d| n.saturating_mul(10).saturating_add(u64::from(d - b'0'))))
}

/// How a header value is compared in `header_value_match`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StringMatch {
    /// The whole value equals this.
    Exact(Vec<u8>),
    /// The value starts with this.
    Prefix(Vec<u8>),
    /// The value ends with this.
    Suffix(Vec<u8>),
    /// The value contains this.
    Contains(Vec<u8>),
    /// The header is present (`true`) or absent (`false`).
    Present(bool),
}

/// One header condition of a `header_value_match` descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderMatcher {
    /// The header to look at.
    pub header: HeaderId,
    /// How to compare it.
    pub string_match: StringMatch,
    /// Inverts the result.
    pub invert_match: bool,
}

impl StringMatch {
    /// Whether `value` (`None`: absent) matches.
    pub fn matches(&self, value: Option<&[u8]>) -> bool {
        match (self, value) {
            (StringMatch::Present(present), value) => value.is_some() == *present,
            (_, None) => false,
            (StringMatch::Exact(want), Some(v)) => v == want.as_slice(),
            (StringMatch::Prefix(want), Some(v)) => v.starts_with(want),
            (StringMatch::Suffix(want), Some(v)) => v.ends_with(want),
            (StringMatch::Contains(want), Some(v)) => {
                want.is_empty() || v.windows(want.len()).any(|w| w == want.as_slice())
            }
        }
    }
}

impl HeaderMatcher {
    fn matches(&self, request: &mut dyn Request) -> bool {
        self.string_match.matches(request.header(self.header)) != self.invert_match
    }
}

/// One parameter condition of a `query_parameter_value_match` descriptor:
/// on the parameter's first value, percent-decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryMatcher {
    /// The parameter's name (decoded).
    pub name: String,
    /// How to compare its value; `Present(false)` holds when it is absent.
    pub string_match: StringMatch,
}

impl QueryMatcher {
    fn matches(&self, path: Option<&[u8]>) -> bool {
        let Some(raw) = path.and_then(|p| query::first_value(p, self.name.as_bytes())) else {
            return self.string_match.matches(None);
        };
        let value = BoundedValue::collect(query::Decoded::new(raw));
        self.string_match.matches(Some(value.as_bytes()))
    }
}

/// A condition on a value in metadata (Envoy's `MetadataMatcher`, in part).
#[derive(Debug, Clone, PartialEq)]
pub struct MetadataMatcher {
    /// Where the value is.
    pub key: MetadataKey,
    /// What it must be.
    pub value: MetadataValueMatch,
    /// Inverts the result.
    pub invert: bool,
}

/// What a [`MetadataMatcher`] asks of the value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetadataValueMatch {
    /// A string matching this (`Present` is not used here).
    String(StringMatch),
    /// This boolean.
    Bool(bool),
    /// Any string, number or boolean.
    Present,
}

impl MetadataValueMatch {
    /// The kinds of value it can match.
    pub fn wanted(&self) -> Wanted {
        match self {
            MetadataValueMatch::String(_) => Wanted::String,
            MetadataValueMatch::Bool(_) => Wanted::Bool,
            MetadataValueMatch::Present => Wanted::Scalar,
        }
    }
}

impl MetadataMatcher {
    /// Whether the serialized metadata `metadata` (`None`: none) matches.
    pub fn matches(&self, metadata: Option<&[u8]>) -> bool {
        self.matches_found(metadata.map_or(Found::Absent, |m| metadata::lookup(m, &self.key)))
    }

    /// Whether `found`, the value at [`MetadataMatcher::key`], matches.
    pub fn matches_found(&self, found: Found<'_>) -> bool {
        let matched = match (&self.value, found) {
            (MetadataValueMatch::String(want), Found::String(s)) => want.matches(Some(s)),
            (MetadataValueMatch::Bool(want), Found::Bool(b)) => *want == b,
            (MetadataValueMatch::Present, Found::String(_) | Found::Number(_) | Found::Bool(_)) => true,
            _ => false,
        };
        matched != self.invert
    }
}

/// One descriptor entry: a (key, value) pair taken from the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DescriptorEntry {
    /// The value of a request header. A request without the header skips the
    /// rule, unless `skip_if_absent`, which drops just this entry.
    RequestHeaders {
        /// The header read.
        header: HeaderId,
        /// The descriptor key.
        key: String,
        /// Drop this entry instead of the rule when the header is absent.
        skip_if_absent: bool,
    },
    /// The downstream remote address, without the port.
    RemoteAddress,
    /// The remote address masked to a prefix (one bucket per subnet).
    MaskedRemoteAddress {
        /// Prefix length kept of IPv4 addresses.
        v4_prefix_len: u8,
        /// Prefix length kept of IPv6 addresses.
        v6_prefix_len: u8,
    },
    /// A constant entry.
    GenericKey {
        /// The descriptor key.
        key: String,
        /// The constant value.
        value: String,
    },
    /// A constant entry produced only when the request's headers match
    /// (`expect_match: true`) or do not match (`false`); otherwise the rule is skipped.
    HeaderValueMatch {
        /// The descriptor key.
        key: String,
        /// The constant value.
        value: String,
        /// Whether the headers must match or must not.
        expect_match: bool,
        /// All must match for the headers to match.
        headers: Vec<HeaderMatcher>,
    },
    /// A string in the request's dynamic metadata or the route's metadata
    /// (Envoy's `metadata` action). A number, a boolean, a struct or an empty
    /// string counts as absent, as in Envoy; absent, the entry is
    /// `default_value`, or dropped with `skip_if_absent`, or else the rule
    /// is skipped.
    Metadata {
        /// The descriptor key.
        key: String,
        /// Which metadata.
        source: MetadataSource,
        /// Where in it.
        metadata_key: MetadataKey,
        /// The value when the metadata has none.
        default_value: Option<String>,
        /// Drop this entry instead of the rule when there is no value.
        skip_if_absent: bool,
    },
    /// The first value of a query parameter, percent-decoded. A request
    /// without the parameter skips the rule, unless `skip_if_absent`, which
    /// drops just this entry.
    QueryParameters {
        /// The `:path` header, which holds the query.
        path: HeaderId,
        /// The parameter's name (decoded).
        name: String,
        /// The descriptor key.
        key: String,
        /// Drop this entry instead of the rule when the parameter is absent.
        skip_if_absent: bool,
    },
    /// A constant entry produced only when the query parameters match
    /// (`expect_match: true`) or do not match (`false`); otherwise the rule
    /// is skipped.
    QueryParameterValueMatch {
        /// The `:path` header, which holds the query.
        path: HeaderId,
        /// The descriptor key.
        key: String,
        /// The constant value.
        value: String,
        /// Whether the parameters must match or must not.
        expect_match: bool,
        /// All must match for the parameters to match.
        parameters: Vec<QueryMatcher>,
    },
    /// The matched route's upstream cluster, keyed `destination_cluster`. A
    /// request whose route has none (no route, a direct response) skips the rule.
    DestinationCluster,
    /// This Envoy's service cluster, keyed `source_cluster` (empty when
    /// Envoy has none, as Envoy sends it).
    SourceCluster,
}

/// One descriptor entry's value as taken from a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value<'a> {
    /// Bytes: a header value (need not be UTF-8) or a configured constant.
    Bytes(&'a [u8]),
    /// The downstream address, without the port.
    Address(IpAddr),
    /// The downstream address masked to `prefix` bits: a subnet.
    Subnet(IpAddr, u8),
}

impl Value<'_> {
    /// The value as the quota service's protocol carries it: text. Addresses
    /// are written as Envoy writes them (`10.0.0.7`, `10.1.2.0/24`); bytes
    /// that are not UTF-8 have each invalid sequence replaced by U+FFFD (and
    /// the text is kept within [`crate::value::MAX_VALUE_BYTES`]).
    pub fn to_text(&self) -> String {
        match self {
            Value::Bytes(bytes) => bounded_text(bytes),
            Value::Address(ip) => ip.to_string(),
            Value::Subnet(ip, prefix) => format!("{ip}/{prefix}"),
        }
    }
}

/// Takes the descriptor `entries` from `request`, handing each (key, value)
/// pair to `visit` in order. Returns false when the rule does not apply to
/// the request (a needed header is absent, a header match fails, no IP
/// address); entries already visited are then to be ignored.
///
/// This is the one place descriptors are read: the local limiter hashes the
/// pairs into a fingerprint ([`fingerprint`]), global mode sends them to the
/// quota service ([`protocol_descriptor`]).
pub fn extract(entries: &[DescriptorEntry], request: &mut dyn Request, mut visit: impl FnMut(&str, Value<'_>)) -> bool {
    // Where a value too long to contribute as it is gets its stand-in
    // (made when one is).
    let mut spare = None;
    for entry in entries {
        match entry {
            DescriptorEntry::RequestHeaders { header, key, skip_if_absent } => match request.header(*header) {
                Some(value) => visit(key, Value::Bytes(BoundedValue::bound(value, &mut spare))),
                None if *skip_if_absent => {}
                None => return false,
            },
            DescriptorEntry::RemoteAddress => {
                let Some(ip) = request.remote_address().and_then(parse_ip) else { return false };
                visit("remote_address", Value::Address(ip));
            }
            DescriptorEntry::MaskedRemoteAddress { v4_prefix_len, v6_prefix_len } => {
                let Some(ip) = request.remote_address().and_then(parse_ip) else { return false };
                let prefix = if ip.is_ipv4() { *v4_prefix_len } else { *v6_prefix_len };
                visit("masked_remote_address", Value::Subnet(mask(ip, prefix), prefix));
            }
            DescriptorEntry::GenericKey { key, value } => visit(key, Value::Bytes(value.as_bytes())),
            DescriptorEntry::HeaderValueMatch { key, value, expect_match, headers } => {
                let matched = headers.iter().all(|m| m.matches(request));
                if matched != *expect_match {
                    return false;
                }
                visit(key, Value::Bytes(value.as_bytes()));
            }
            DescriptorEntry::Metadata { key, source, metadata_key, default_value, skip_if_absent } => {
                let found = request.metadata(*source, metadata_key, Wanted::String).non_empty_string();
                match (found, default_value) {
                    (Some(value), _) => visit(key, Value::Bytes(BoundedValue::bound(value, &mut spare))),
                    (None, Some(default)) => visit(key, Value::Bytes(default.as_bytes())),
                    (None, None) if *skip_if_absent => {}
                    (None, None) => return false,
                }
            }
            DescriptorEntry::QueryParameters { path, name, key, skip_if_absent } => {
                match request.header(*path).and_then(|p| query::first_value(p, name.as_bytes())) {
                    Some(raw) => {
                        let collected = spare.insert(BoundedValue::collect(query::Decoded::new(raw)));
                        visit(key, Value::Bytes(collected.as_bytes()));
                    }
                    None if *skip_if_absent => {}
                    None => return false,
                }
            }
            DescriptorEntry::QueryParameterValueMatch { path, key, value, expect_match, parameters } => {
                let path = request.header(*path);
                if parameters.iter().all(|m| m.matches(path)) != *expect_match {
                    return false;
                }
                visit(key, Value::Bytes(value.as_bytes()));
            }
            DescriptorEntry::DestinationCluster => match request.attribute(Attribute::DestinationCluster) {
                Some(cluster) => visit("destination_cluster", Value::Bytes(BoundedValue::bound(cluster, &mut spare))),
                None => return false,
            },
            DescriptorEntry::SourceCluster => {
                let cluster = request.attribute(Attribute::SourceCluster).unwrap_or_default();
                visit("source_cluster", Value::Bytes(BoundedValue::bound(cluster, &mut spare)));
            }
        }
    }
    true
}

/// Computes the keyed fingerprint of the descriptor `entries` of rule
/// `rule_name` for `request`, or `None` when the rule does not apply to it.
pub fn fingerprint(
    key: (u64, u64),
    rule_name: &str,
    entries: &[DescriptorEntry],
    request: &mut dyn Request,
) -> Option<u64> {
    fingerprint_from(&rule_hasher(key, rule_name, entries), entries, request)
}

/// The hash state every fingerprint of a rule starts from, made once per
/// rule, not once per request: keyed, the rule's name fed, and its first
/// entry's key too when every request the rule applies to feeds that key
/// first (see [`rule_hasher`]).
#[derive(Debug, Clone)]
pub struct RuleHasher {
    state: SipHasher,
    /// The first entry's key is fed already.
    first_key_fed: bool,
}

/// The [`RuleHasher`] of rule `rule_name` with descriptor `entries`. A
/// first entry that is a header the request must have, or a constant,
/// feeds its key first whenever the rule applies, so that key is fed here;
/// the state, hence every fingerprint, is the same either way.
pub fn rule_hasher(key: (u64, u64), rule_name: &str, entries: &[DescriptorEntry]) -> RuleHasher {
    let mut state = SipHasher::new(key.0, key.1);
    state.write_field(rule_name.as_bytes());
    let first_key = match entries.first() {
        Some(DescriptorEntry::RequestHeaders { key, skip_if_absent: false, .. })
        | Some(DescriptorEntry::GenericKey { key, .. }) => Some(key),
        _ => None,
    };
    if let Some(first_key) = first_key {
        state.write_field(first_key.as_bytes());
    }
    RuleHasher { state, first_key_fed: first_key.is_some() }
}

/// [`fingerprint`], from its rule's [`rule_hasher`].
pub fn fingerprint_from(rule: &RuleHasher, entries: &[DescriptorEntry], request: &mut dyn Request) -> Option<u64> {
    let mut hasher = rule.state.clone();
    // The first entry visited is the first entry (or the rule does not
    // apply); its key is fed already if `first_key_fed`.
    let mut key_fed = rule.first_key_fed;
    let mut write_key = |hasher: &mut SipHasher, key: &str| {
        if !std::mem::take(&mut key_fed) {
            hasher.write_field(key.as_bytes());
        }
    };
    let applies = extract(entries, request, |key, value| match value {
        // Constants and header values hash their key and bytes; addresses
        // their kind and octets (a subnet also its prefix length).
        Value::Bytes(bytes) => {
            write_key(&mut hasher, key);
            hasher.write_field(bytes);
        }
        Value::Address(ip) => {
            write_key(&mut hasher, key);
            write_ip(&mut hasher, ip);
        }
        Value::Subnet(ip, prefix) => {
            write_key(&mut hasher, key);
            write_ip(&mut hasher, ip);
            hasher.write(&[prefix]);
        }
    });
    applies.then(|| hasher.finish())
}

/// The descriptor `entries` of `request` as the quota service's protocol
/// carries them (ordered `[key, value]` pairs), or `None` when the rule does
/// not apply to it.
pub fn protocol_descriptor(entries: &[DescriptorEntry], request: &mut dyn Request) -> Option<Vec<(String, String)>> {
    let mut pairs = Vec::with_capacity(entries.len());
    extract(entries, request, |key, value| pairs.push((key.to_string(), value.to_text()))).then_some(pairs)
}

/// True when a request can drop every entry (each has `skip_if_absent`),
/// leaving a descriptor with none.
pub fn may_drop_every_entry(entries: &[DescriptorEntry]) -> bool {
    entries.iter().all(|e| {
        matches!(
            e,
            DescriptorEntry::RequestHeaders { skip_if_absent: true, .. }
                | DescriptorEntry::Metadata { skip_if_absent: true, .. }
                | DescriptorEntry::QueryParameters { skip_if_absent: true, .. }
        )
    })
}

/// True when the rule applies to `request` with at least one entry.
pub fn has_entries(entries: &[DescriptorEntry], request: &mut dyn Request) -> bool {
    let mut any = false;
    extract(entries, request, |_, _| any = true) && any
}

/// True when every entry is a constant: the rule has one bucket, whatever
/// the request. (This Envoy's service cluster does not change while it runs.)
pub fn is_constant(entries: &[DescriptorEntry]) -> bool {
    entries.iter().all(|e| {
        matches!(
            e,
            DescriptorEntry::GenericKey { .. }
                | DescriptorEntry::HeaderValueMatch { .. }
                | DescriptorEntry::QueryParameterValueMatch { .. }
                | DescriptorEntry::SourceCluster
        )
    })
}

fn write_ip(hasher: &mut SipHasher, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => hasher.write_field(&v4.octets()),
        IpAddr::V6(v6) => hasher.write_field(&v6.octets()),
    }
}

/// Parses `1.2.3.4`, `1.2.3.4:80`, `::1`, `[::1]:80` into an address.
pub fn parse_ip(raw: &[u8]) -> Option<IpAddr> {
    let text = std::str::from_utf8(raw).ok()?;
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Some(ip);
    }
    let host = match text.strip_prefix('[') {
        Some(rest) => rest.split_once(']')?.0,
        None => text.rsplit_once(':')?.0,
    };
    host.parse().ok()
}

fn mask(ip: IpAddr, prefix_len: u8) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => {
            let bits = u32::from(v4);
            let kept = if prefix_len == 0 { 0 } else { bits & (u32::MAX << (32 - u32::from(prefix_len.min(32)))) };
            IpAddr::V4(kept.into())
        }
        IpAddr::V6(v6) => {
            let bits = u128::from(v6);
            let kept = if prefix_len == 0 { 0 } else { bits & (u128::MAX << (128 - u32::from(prefix_len.min(128)))) };
            IpAddr::V6(kept.into())
        }
    }
}

/// How a rule's path condition compares `:path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    /// The path without its query string equals this (Envoy's route `path`).
    Exact(String),
    /// The path starts with this (Envoy's route `prefix`).
    Prefix(String),
}

/// Which requests a rule applies to. Every condition given must hold.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RequestMatch {
    /// The `:path` condition and the header it reads.
    pub path: Option<(HeaderId, PathMatch)>,
    /// Allowed `:method`s (any if empty) and the header it reads.
    pub methods: Option<(HeaderId, Vec<String>)>,
    /// The `:authority`, compared without case, and the header it reads.
    pub authority: Option<(HeaderId, String)>,
    /// The matched route's name.
    pub route_name: Option<String>,
    /// A condition on the matched route's metadata.
    pub route_metadata: Option<MetadataMatcher>,
}

impl RequestMatch {
    /// True when the request meets every condition. A request lacking a
    /// pseudo-header a condition needs does not match.
    pub fn matches(&self, request: &mut dyn Request) -> bool {
        if let Some((id, path_match)) = &self.path {
            let Some(path) = request.header(*id) else { return false };
            let ok = match path_match {
                PathMatch::Exact(want) => {
                    let end = path.iter().position(|b| *b == b'?').unwrap_or(path.len());
                    &path[..end] == want.as_bytes()
                }
                PathMatch::Prefix(want) => path.starts_with(want.as_bytes()),
            };
            if !ok {
                return false;
            }
        }
        if let Some((id, methods)) = &self.methods {
            let Some(method) = request.header(*id) else { return false };
            if !methods.iter().any(|m| m.as_bytes() == method) {
                return false;
            }
        }
        if let Some((id, authority)) = &self.authority {
            let Some(value) = request.header(*id) else { return false };
            if !value.eq_ignore_ascii_case(authority.as_bytes()) {
                return false;
            }
        }
        if let Some(name) = &self.route_name {
            if request.attribute(Attribute::RouteName) != Some(name.as_bytes()) {
                return false;
            }
        }
        if let Some(matcher) = &self.route_metadata {
            let found = request.metadata(MetadataSource::RouteEntry, &matcher.key, matcher.value.wanted());
            if !matcher.matches_found(found) {
                return false;
            }
        }
        true
    }
}

/// A [`Request`] over fixed values, for tests and fuzzing.
#[derive(Debug, Clone, Default)]
pub struct StaticRequest {
    /// Header values by [`HeaderId`] index (`None`: absent).
    pub headers: Vec<Option<Vec<u8>>>,
    /// The remote address.
    pub remote_address: Option<Vec<u8>>,
    /// Attribute values by [`Attribute::index`] (`None`: absent).
    pub attributes: [Option<Vec<u8>>; Attribute::COUNT],
}

impl Request for StaticRequest {
    fn header(&mut self, id: HeaderId) -> Option<&[u8]> {
        self.headers.get(id.0)?.as_deref()
    }

    fn remote_address(&mut self) -> Option<&[u8]> {
        self.remote_address.as_deref()
    }

    fn attribute(&mut self, attribute: Attribute) -> Option<&[u8]> {
        self.attributes.get(attribute.index())?.as_deref().filter(|v| !v.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const KEY: (u64, u64) = (7, 11);

    fn request(headers: &[Option<&[u8]>], remote: Option<&str>) -> StaticRequest {
        StaticRequest {
            headers: headers.iter().map(|h| h.map(<[u8]>::to_vec)).collect(),
            remote_address: remote.map(|r| r.as_bytes().to_vec()),
            ..Default::default()
        }
    }

    fn api_key() -> Vec<DescriptorEntry> {
        vec![DescriptorEntry::RequestHeaders { header: HeaderId(0), key: "api_key".into(), skip_if_absent: false }]
    }

    /// A rule's first key fed with its hash state, once, or per request: the
    /// same fingerprint, the SipHash of the rule's name and each entry's key
    /// and value as fields, in order (what shared data's buckets are keyed by
    /// and must stay).
    #[test]
    fn a_first_key_fed_ahead_gives_the_same_fingerprint() {
        let plain = |fields: &[&[u8]]| {
            let mut hasher = SipHasher::new(KEY.0, KEY.1);
            for field in fields {
                hasher.write_field(field);
            }
            hasher.finish()
        };
        let generic = DescriptorEntry::GenericKey { key: "tier".into(), value: "gold".into() };
        let optional =
            DescriptorEntry::RequestHeaders { header: HeaderId(0), key: "api_key".into(), skip_if_absent: true };
        type Case<'a> = (Vec<DescriptorEntry>, bool, Vec<&'a [u8]>);
        let cases: [Case; 4] = [
            (api_key(), true, vec![b"r", b"api_key", b"alice"]),
            (vec![generic.clone()], true, vec![b"r", b"tier", b"gold"]),
            ([api_key(), vec![generic.clone()]].concat(), true, vec![b"r", b"api_key", b"alice", b"tier", b"gold"]),
            (vec![optional, generic], false, vec![b"r", b"api_key", b"alice", b"tier", b"gold"]),
        ];
        for (entries, fed, fields) in cases {
            assert_eq!(rule_hasher(KEY, "r", &entries).first_key_fed, fed, "{entries:?}");
            let found = fingerprint(KEY, "r", &entries, &mut request(&[Some(b"alice")], None));
            assert_eq!(found, Some(plain(&fields)), "{entries:?}");
        }
        // A skipped first entry: the next one's key is fed per request.
        let skipped = vec![
            DescriptorEntry::RequestHeaders { header: HeaderId(0), key: "api_key".into(), skip_if_absent: true },
            DescriptorEntry::GenericKey { key: "tier".into(), value: "gold".into() },
        ];
        let found = fingerprint(KEY, "r", &skipped, &mut request(&[None], None));
        assert_eq!(found, Some(plain(&[b"r", b"tier", b"gold"])));
        assert_eq!(fingerprint(KEY, "r", &api_key(), &mut request(&[None], None)), None, "a required header missing");
    }

    #[test]
    fn a_header_value_names_the_bucket() {
        let a = fingerprint(KEY, "r", &api_key(), &mut request(&[Some(b"alice")], None));
        let a2 = fingerprint(KEY, "r", &api_key(), &mut request(&[Some(b"alice")], None));
        let b = fingerprint(KEY, "r", &api_key(), &mut request(&[Some(b"bob")], None));
        let other_rule = fingerprint(KEY, "s", &api_key(), &mut request(&[Some(b"alice")], None));
        assert!(a.is_some());
        assert_eq!(a, a2);
        assert_ne!(a, b);
        assert_ne!(a, other_rule);
    }

    #[test]
    fn a_missing_header_skips_the_rule_unless_skip_if_absent() {
        assert_eq!(fingerprint(KEY, "r", &api_key(), &mut request(&[None], None)), None);
        let lenient =
            vec![DescriptorEntry::RequestHeaders { header: HeaderId(0), key: "k".into(), skip_if_absent: true }];
        assert!(fingerprint(KEY, "r", &lenient, &mut request(&[None], None)).is_some());
    }

    #[test]
    fn non_utf8_and_huge_values_are_just_bytes() {
        let huge = vec![0xffu8; 100_000];
        assert!(fingerprint(KEY, "r", &api_key(), &mut request(&[Some(&huge)], None)).is_some());
        assert!(fingerprint(KEY, "r", &api_key(), &mut request(&[Some(&[0xc3, 0x28])], None)).is_some());
    }

    #[test]
    fn remote_address_ignores_the_port() {
        let entries = vec![DescriptorEntry::RemoteAddress];
        let one = fingerprint(KEY, "r", &entries, &mut request(&[], Some("10.0.0.1:1234")));
        let same = fingerprint(KEY, "r", &entries, &mut request(&[], Some("10.0.0.1:9999")));
        let other = fingerprint(KEY, "r", &entries, &mut request(&[], Some("10.0.0.2:1234")));
        assert!(one.is_some());
        assert_eq!(one, same);
        assert_ne!(one, other);
        let v6 = fingerprint(KEY, "r", &entries, &mut request(&[], Some("[::1]:80")));
        assert_eq!(v6, fingerprint(KEY, "r", &entries, &mut request(&[], Some("::1"))));
        assert_eq!(fingerprint(KEY, "r", &entries, &mut request(&[], Some("not-an-ip"))), None);
        assert_eq!(fingerprint(KEY, "r", &entries, &mut request(&[], None)), None);
    }

    #[test]
    fn masked_remote_address_groups_a_subnet() {
        let entries = vec![DescriptorEntry::MaskedRemoteAddress { v4_prefix_len: 24, v6_prefix_len: 64 }];
        let a = fingerprint(KEY, "r", &entries, &mut request(&[], Some("10.1.2.3:1")));
        let b = fingerprint(KEY, "r", &entries, &mut request(&[], Some("10.1.2.200:1")));
        let c = fingerprint(KEY, "r", &entries, &mut request(&[], Some("10.1.3.3:1")));
        assert_eq!(a, b);
        assert_ne!(a, c);
        let d = fingerprint(KEY, "r", &entries, &mut request(&[], Some("[2001:db8::1]:1")));
        let e = fingerprint(KEY, "r", &entries, &mut request(&[], Some("[2001:db8::ffff]:1")));
        assert_eq!(d, e);
    }

    #[test]
    fn header_value_match_applies_only_when_headers_match() {
        let entries = vec![DescriptorEntry::HeaderValueMatch {
            key: "header_match".into(),
            value: "beta".into(),
            expect_match: true,
            headers: vec![HeaderMatcher {
                header: HeaderId(0),
                string_match: StringMatch::Prefix(b"beta-".to_vec()),
                invert_match: false,
            }],
        }];
        assert!(fingerprint(KEY, "r", &entries, &mut request(&[Some(b"beta-7")], None)).is_some());
        assert_eq!(fingerprint(KEY, "r", &entries, &mut request(&[Some(b"prod")], None)), None);
        assert_eq!(fingerprint(KEY, "r", &entries, &mut request(&[None], None)), None);
    }

    #[test]
    fn string_matches() {
        let check = |m: StringMatch, invert: bool, value: Option<&[u8]>| {
            HeaderMatcher { header: HeaderId(0), string_match: m, invert_match: invert }
                .matches(&mut request(&[value], None))
        };
        assert!(check(StringMatch::Exact(b"a".to_vec()), false, Some(b"a")));
        assert!(!check(StringMatch::Exact(b"a".to_vec()), false, Some(b"ab")));
        assert!(check(StringMatch::Suffix(b"b".to_vec()), false, Some(b"ab")));
        assert!(check(StringMatch::Contains(b"xy".to_vec()), false, Some(b"axyb")));
        assert!(check(StringMatch::Present(false), false, None));
        assert!(check(StringMatch::Exact(b"a".to_vec()), true, Some(b"b")));
    }

    #[test]
    fn path_method_and_authority_conditions() {
        let rule = RequestMatch {
            path: Some((HeaderId(0), PathMatch::Exact("/login".into()))),
            methods: Some((HeaderId(1), vec!["POST".into()])),
            authority: Some((HeaderId(2), "api.example.com".into())),
            ..Default::default()
        };
        let hit = |path: &[u8], method: &[u8], host: Option<&[u8]>| {
            rule.matches(&mut request(&[Some(path), Some(method), host], None))
        };
        assert!(hit(b"/login", b"POST", Some(b"API.example.com")));
        assert!(hit(b"/login?next=/", b"POST", Some(b"api.example.com")));
        assert!(!hit(b"/login/x", b"POST", Some(b"api.example.com")));
        assert!(!hit(b"/login", b"GET", Some(b"api.example.com")));
        assert!(!hit(b"/login", b"POST", None));
        let prefix = RequestMatch { path: Some((HeaderId(0), PathMatch::Prefix("/api".into()))), ..Default::default() };
        assert!(prefix.matches(&mut request(&[Some(b"/api/v1")], None)));
        assert!(!prefix.matches(&mut request(&[None], None)), "no :path, no match");
    }

    #[test]
    fn one_extraction_feeds_the_fingerprint_and_the_protocol() {
        let entries = vec![
            DescriptorEntry::GenericKey { key: "route".into(), value: "api".into() },
            DescriptorEntry::RequestHeaders { header: HeaderId(0), key: "api_key".into(), skip_if_absent: false },
            DescriptorEntry::MaskedRemoteAddress { v4_prefix_len: 24, v6_prefix_len: 64 },
            DescriptorEntry::RemoteAddress,
        ];
        let mut req = request(&[Some(b"alice\xff")], Some("10.1.2.3:80"));
        let pairs = protocol_descriptor(&entries, &mut req).unwrap();
        let expected = [
            ("route", "api"),
            ("api_key", "alice\u{fffd}"),
            ("masked_remote_address", "10.1.2.0/24"),
            ("remote_address", "10.1.2.3"),
        ];
        assert_eq!(pairs, expected.map(|(k, v)| (k.to_string(), v.to_string())));
        assert!(fingerprint(KEY, "r", &entries, &mut req).is_some());
        let mut without_key = request(&[None], Some("10.1.2.3:80"));
        assert_eq!(protocol_descriptor(&entries, &mut without_key), None);
        assert_eq!(fingerprint(KEY, "r", &entries, &mut without_key), None);
    }

    /// A request with `path` as header 0 and the given attributes.
    fn with_attributes(path: Option<&str>, attributes: &[(Attribute, &[u8])]) -> StaticRequest {
        let mut request = request(&[path.map(str::as_bytes)], None);
        for (attribute, value) in attributes {
            request.attributes[attribute.index()] = Some(value.to_vec());
        }
        request
    }

    fn pairs(entries: &[DescriptorEntry], request: &mut StaticRequest) -> Option<Vec<(String, String)>> {
        protocol_descriptor(entries, request)
    }

    fn pair(key: &str, value: &str) -> (String, String) {
        (key.to_string(), value.to_string())
    }

    fn claims() -> Vec<u8> {
        use crate::metadata::build::{metadata, ProtoValue as Value};
        let text = |s: &str| Value::String(s.as_bytes().to_vec());
        metadata(&[(
            b"envoy.filters.http.jwt_authn",
            vec![(
                b"jwt_payload".to_vec(),
                Value::Struct(vec![
                    (b"sub".to_vec(), text("alice")),
                    (b"customer".to_vec(), Value::Number(42.0)),
                    (b"admin".to_vec(), Value::Bool(true)),
                    (b"org".to_vec(), Value::Struct(vec![(b"id".to_vec(), text("acme"))])),
                    (b"blank".to_vec(), text("")),
                ]),
            )],
        )])
    }

    fn claim(path: &[&str], default_value: Option<&str>, skip_if_absent: bool) -> Vec<DescriptorEntry> {
        let mut full = vec!["jwt_payload".to_string()];
        full.extend(path.iter().map(|s| s.to_string()));
        vec![DescriptorEntry::Metadata {
            key: "user".into(),
            source: MetadataSource::Dynamic,
            metadata_key: MetadataKey { namespace: "envoy.filters.http.jwt_authn".into(), path: full },
            default_value: default_value.map(str::to_string),
            skip_if_absent,
        }]
    }

    #[test]
    fn a_metadata_string_is_the_value_and_anything_else_is_absent_as_in_envoy() {
        let blob = claims();
        let mut req = with_attributes(None, &[(Attribute::DynamicMetadata, &blob)]);
        assert_eq!(pairs(&claim(&["sub"], None, false), &mut req), Some(vec![pair("user", "alice")]));
        assert_eq!(pairs(&claim(&["org", "id"], None, false), &mut req), Some(vec![pair("user", "acme")]));
        for absent in [&["missing"][..], &["customer"], &["admin"], &["org"], &["blank"], &["sub", "deeper"]] {
            assert_eq!(pairs(&claim(absent, None, false), &mut req), None, "{absent:?} skips the rule");
            assert_eq!(pairs(&claim(absent, None, true), &mut req), Some(vec![]), "{absent:?}: entry dropped");
            assert_eq!(
                pairs(&claim(absent, Some("anonymous"), false), &mut req),
                Some(vec![pair("user", "anonymous")]),
                "{absent:?}: the default"
            );
        }
        // No dynamic metadata at all: the same as an absent value.
        let mut bare = with_attributes(None, &[]);
        assert_eq!(pairs(&claim(&["sub"], Some("anonymous"), false), &mut bare), Some(vec![pair("user", "anonymous")]));
        assert_eq!(fingerprint(KEY, "r", &claim(&["sub"], None, false), &mut bare), None);
    }

    #[test]
    fn a_rules_only_entry_dropped_by_skip_if_absent_leaves_one_shared_bucket() {
        // Not skipped: the rule applies with no entries, and every request
        // without the value has the same bucket (the rule's name alone).
        let blob = claims();
        let entries = claim(&["missing"], None, true);
        let with_claims =
            fingerprint(KEY, "r", &entries, &mut with_attributes(None, &[(Attribute::DynamicMetadata, &blob)]));
        let bare = fingerprint(KEY, "r", &entries, &mut with_attributes(None, &[]));
        assert!(with_claims.is_some());
        assert_eq!(with_claims, bare);
    }

    #[test]
    fn a_real_value_equal_to_the_default_value_shares_its_bucket() {
        let blob = claims();
        let entries = claim(&["sub"], Some("alice"), false);
        let alice = fingerprint(KEY, "r", &entries, &mut with_attributes(None, &[(Attribute::DynamicMetadata, &blob)]));
        let defaulted = fingerprint(KEY, "r", &entries, &mut with_attributes(None, &[]));
        assert!(alice.is_some());
        assert_eq!(alice, defaulted);
    }

    #[test]
    fn metadata_from_the_route_and_malformed_metadata() {
        use crate::metadata::build::{metadata, ProtoValue as Value};
        let route = metadata(&[(b"floodgate", vec![(b"tier".to_vec(), Value::String(b"gold".to_vec()))])]);
        let entries = vec![DescriptorEntry::Metadata {
            key: "tier".into(),
            source: MetadataSource::RouteEntry,
            metadata_key: MetadataKey { namespace: "floodgate".into(), path: vec!["tier".into()] },
            default_value: None,
            skip_if_absent: false,
        }];
        let mut req =
            with_attributes(None, &[(Attribute::RouteMetadata, &route), (Attribute::DynamicMetadata, b"junk")]);
        assert_eq!(pairs(&entries, &mut req), Some(vec![pair("tier", "gold")]));
        let mut junk = with_attributes(None, &[(Attribute::RouteMetadata, b"\x0a\xff\xff")]);
        assert_eq!(pairs(&entries, &mut junk), None);
    }

    #[test]
    fn a_huge_claim_contributes_a_bounded_distinct_value() {
        use crate::metadata::build::{metadata, ProtoValue as Value};
        use crate::value::MAX_VALUE_BYTES;
        let blob = |sub: &[u8]| {
            metadata(&[(
                b"envoy.filters.http.jwt_authn",
                vec![(b"jwt_payload".to_vec(), Value::Struct(vec![(b"sub".to_vec(), Value::String(sub.to_vec()))]))],
            )])
        };
        let (a, b) = ([vec![b'u'; 5000], b"a".to_vec()].concat(), [vec![b'u'; 5000], b"b".to_vec()].concat());
        let (blob_a, blob_b) = (blob(&a), blob(&b));
        let mut req_a = with_attributes(None, &[(Attribute::DynamicMetadata, &blob_a)]);
        let mut req_b = with_attributes(None, &[(Attribute::DynamicMetadata, &blob_b)]);
        let entries = claim(&["sub"], None, false);
        let text_a = pairs(&entries, &mut req_a).unwrap().remove(0).1;
        let text_b = pairs(&entries, &mut req_b).unwrap().remove(0).1;
        assert_eq!(text_a.len(), MAX_VALUE_BYTES);
        assert_ne!(text_a, text_b);
        assert_ne!(fingerprint(KEY, "r", &entries, &mut req_a), fingerprint(KEY, "r", &entries, &mut req_b));
    }

    fn user_param(skip_if_absent: bool) -> Vec<DescriptorEntry> {
        vec![DescriptorEntry::QueryParameters {
            path: HeaderId(0),
            name: "user".into(),
            key: "user".into(),
            skip_if_absent,
        }]
    }

    #[test]
    fn a_query_parameter_is_its_first_decoded_value() {
        let value = |path: &str| pairs(&user_param(false), &mut with_attributes(Some(path), &[]));
        assert_eq!(value("/a?user=bob"), Some(vec![pair("user", "bob")]));
        assert_eq!(value("/a?x=1&user=b%C3%B6b&user=eve"), Some(vec![pair("user", "böb")]));
        assert_eq!(value("/a?user=%zz+1"), Some(vec![pair("user", "%zz+1")]));
        assert_eq!(value("/a?user"), Some(vec![pair("user", "")]));
        assert_eq!(value("/a?user=%ff"), Some(vec![pair("user", "\u{fffd}")]));
        assert_eq!(value("/a?users=bob"), None);
        assert_eq!(value("/a"), None);
        assert_eq!(pairs(&user_param(false), &mut with_attributes(None, &[])), None, "no :path");
        assert_eq!(pairs(&user_param(true), &mut with_attributes(Some("/a"), &[])), Some(vec![]));
        // Encoded or not, one value is one bucket; another value another.
        let fp = |path: &str| fingerprint(KEY, "r", &user_param(false), &mut with_attributes(Some(path), &[]));
        assert_eq!(fp("/?user=a%20b"), fp("/?user=a b"));
        assert_ne!(fp("/?user=a%20b"), fp("/?user=a+b"));
        // A hostile value: bounded, and still told apart.
        let long = |tail: &str| format!("/?user={}{tail}", "%41".repeat(10_000));
        let text = value(&long("x")).unwrap().remove(0).1;
        assert_eq!(text.len(), crate::value::MAX_VALUE_BYTES);
        assert_ne!(fp(&long("x")), fp(&long("y")));
    }

    #[test]
    fn query_parameter_value_match_applies_only_when_parameters_match() {
        let entries = |expect_match: bool, string_match: StringMatch| {
            vec![DescriptorEntry::QueryParameterValueMatch {
                path: HeaderId(0),
                key: "query_match".into(),
                value: "debug".into(),
                expect_match,
                parameters: vec![QueryMatcher { name: "mode".into(), string_match }],
            }]
        };
        let applies = |entries: &[DescriptorEntry], path: &str| {
            pairs(entries, &mut with_attributes(Some(path), &[])) == Some(vec![pair("query_match", "debug")])
        };
        let exact = entries(true, StringMatch::Exact(b"a b".to_vec()));
        assert!(applies(&exact, "/?mode=a%20b"));
        assert!(!applies(&exact, "/?mode=a+b"));
        assert!(!applies(&exact, "/"));
        assert!(applies(&entries(false, StringMatch::Exact(b"a b".to_vec())), "/?mode=x"));
        let present = entries(true, StringMatch::Present(true));
        assert!(applies(&present, "/?mode"));
        assert!(!applies(&present, "/?other"));
        let absent = entries(true, StringMatch::Present(false));
        assert!(applies(&absent, "/?other"));
        assert!(!applies(&absent, "/?mode="));
    }

    #[test]
    fn clusters_name_their_entries_as_envoy_does() {
        let entries = vec![DescriptorEntry::DestinationCluster, DescriptorEntry::SourceCluster];
        let mut req =
            with_attributes(None, &[(Attribute::DestinationCluster, b"svc-a"), (Attribute::SourceCluster, b"edge")]);
        assert_eq!(
            pairs(&entries, &mut req),
            Some(vec![pair("destination_cluster", "svc-a"), pair("source_cluster", "edge")])
        );
        // No route cluster (no route, a direct response): the rule is skipped.
        assert_eq!(pairs(&entries, &mut with_attributes(None, &[(Attribute::SourceCluster, b"edge")])), None);
        // No service cluster: an empty value, as Envoy sends it.
        let mut no_source = with_attributes(None, &[]);
        assert_eq!(pairs(&[DescriptorEntry::SourceCluster], &mut no_source), Some(vec![pair("source_cluster", "")]));
        assert!(is_constant(&[DescriptorEntry::SourceCluster]));
        assert!(!is_constant(&entries));
    }

    #[test]
    fn route_name_and_route_metadata_conditions() {
        use crate::metadata::build::{metadata, ProtoValue as Value};
        let route = metadata(&[(
            b"floodgate",
            vec![(b"tier".to_vec(), Value::String(b"gold".to_vec())), (b"paid".to_vec(), Value::Bool(true))],
        )]);
        let key = |name: &str| MetadataKey { namespace: "floodgate".into(), path: vec![name.into()] };
        let by_name = RequestMatch { route_name: Some("api".into()), ..Default::default() };
        let on = |attributes: &[(Attribute, &[u8])], rule: &RequestMatch| {
            rule.matches(&mut with_attributes(None, attributes))
        };
        assert!(on(&[(Attribute::RouteName, b"api")], &by_name));
        assert!(!on(&[(Attribute::RouteName, b"api2")], &by_name));
        assert!(!on(&[], &by_name), "no route, no match");
        let metadata_rule = |field: &str, value: MetadataValueMatch, invert: bool| RequestMatch {
            route_metadata: Some(MetadataMatcher { key: key(field), value, invert }),
            ..Default::default()
        };
        let gold = metadata_rule("tier", MetadataValueMatch::String(StringMatch::Exact(b"gold".to_vec())), false);
        assert!(on(&[(Attribute::RouteMetadata, &route)], &gold));
        assert!(!on(&[], &gold));
        assert!(on(
            &[],
            &metadata_rule("tier", MetadataValueMatch::String(StringMatch::Exact(b"gold".to_vec())), true)
        ));
        assert!(on(
            &[(Attribute::RouteMetadata, &route)],
            &metadata_rule("paid", MetadataValueMatch::Bool(true), false)
        ));
        assert!(!on(
            &[(Attribute::RouteMetadata, &route)],
            &metadata_rule("tier", MetadataValueMatch::Bool(true), false)
        ));
        assert!(on(&[(Attribute::RouteMetadata, &route)], &metadata_rule("tier", MetadataValueMatch::Present, false)));
        assert!(!on(&[(Attribute::RouteMetadata, &route)], &metadata_rule("nope", MetadataValueMatch::Present, false)));
    }

    #[test]
    fn a_long_header_value_is_bounded_for_the_service_and_still_told_apart() {
        // Two bearer tokens alike in their first 300 bytes.
        let a = [vec![b't'; 300], b"alice".to_vec()].concat();
        let b = [vec![b't'; 300], b"bob".to_vec()].concat();
        let text = |v: &[u8]| protocol_descriptor(&api_key(), &mut request(&[Some(v)], None)).unwrap().remove(0).1;
        assert_eq!(text(&a).len(), crate::value::MAX_VALUE_BYTES);
        assert_ne!(text(&a), text(&b));
        let fp = |v: &[u8]| fingerprint(KEY, "r", &api_key(), &mut request(&[Some(v)], None));
        assert_ne!(fp(&a), fp(&b));
    }
}
