//! Descriptors: what identifies a bucket, taken from the request the way
//! Envoy's rate-limit actions take it (`request_headers`, `remote_address`,
//! `masked_remote_address`, `generic_key`, `header_value_match`), and the
//! request matching that decides whether a rule applies at all, and what a
//! request costs.

use std::net::IpAddr;

use crate::hash::SipHasher;

/// A header the configuration refers to, as an index into the list of header
/// names it needs ([`crate::config::Config::header_names`]). The filter fetches
/// each one from Envoy at most once per request, and only if a rule asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HeaderId(pub usize);

/// The request as the limiter sees it. Values are raw bytes: header values
/// need not be UTF-8 and are never required to be.
pub trait Request {
    /// The value of header `id`, or `None` when the request lacks it.
    fn header(&mut self, id: HeaderId) -> Option<&[u8]>;

    /// The downstream remote address as Envoy determined it (`ip:port`,
    /// `[v6]:port`, or a bare ip), or `None` when it is not an IP address.
    fn remote_address(&mut self) -> Option<&[u8]>;
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

impl HeaderMatcher {
    fn matches(&self, request: &mut dyn Request) -> bool {
        let value = request.header(self.header);
        let matched = match (&self.string_match, value) {
            (StringMatch::Present(present), value) => value.is_some() == *present,
            (_, None) => false,
            (StringMatch::Exact(want), Some(v)) => v == want.as_slice(),
            (StringMatch::Prefix(want), Some(v)) => v.starts_with(want),
            (StringMatch::Suffix(want), Some(v)) => v.ends_with(want),
            (StringMatch::Contains(want), Some(v)) => {
                want.is_empty() || v.windows(want.len()).any(|w| w == want.as_slice())
            }
        };
        matched != self.invert_match
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
    /// that are not UTF-8 have each invalid sequence replaced by U+FFFD.
    pub fn to_text(&self) -> String {
        match self {
            Value::Bytes(bytes) => String::from_utf8_lossy(bytes).into_owned(),
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
    for entry in entries {
        match entry {
            DescriptorEntry::RequestHeaders { header, key, skip_if_absent } => match request.header(*header) {
                Some(value) => visit(key, Value::Bytes(value)),
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
    let mut hasher = SipHasher::new(key.0, key.1);
    hasher.write_field(rule_name.as_bytes());
    let applies = extract(entries, request, |key, value| match value {
        // Constants and header values hash their key and bytes; addresses
        // their kind and octets (a subnet also its prefix length).
        Value::Bytes(bytes) => {
            hasher.write_field(key.as_bytes());
            hasher.write_field(bytes);
        }
        Value::Address(ip) => {
            hasher.write_field(key.as_bytes());
            write_ip(&mut hasher, ip);
        }
        Value::Subnet(ip, prefix) => {
            hasher.write_field(key.as_bytes());
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

/// True when every entry is a constant: the rule has one bucket, whatever the request.
pub fn is_constant(entries: &[DescriptorEntry]) -> bool {
    entries.iter().all(|e| matches!(e, DescriptorEntry::GenericKey { .. } | DescriptorEntry::HeaderValueMatch { .. }))
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
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestMatch {
    /// The `:path` condition and the header it reads.
    pub path: Option<(HeaderId, PathMatch)>,
    /// Allowed `:method`s (any if empty) and the header it reads.
    pub methods: Option<(HeaderId, Vec<String>)>,
    /// The `:authority`, compared without case, and the header it reads.
    pub authority: Option<(HeaderId, String)>,
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
}

impl Request for StaticRequest {
    fn header(&mut self, id: HeaderId) -> Option<&[u8]> {
        self.headers.get(id.0)?.as_deref()
    }

    fn remote_address(&mut self) -> Option<&[u8]> {
        self.remote_address.as_deref()
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
        }
    }

    fn api_key() -> Vec<DescriptorEntry> {
        vec![DescriptorEntry::RequestHeaders { header: HeaderId(0), key: "api_key".into(), skip_if_absent: false }]
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
}
