//! A rule's `descriptors[]`: one entry each, shaped as Envoy's
//! `RateLimit.Action`s. The entries that read headers or the connection are
//! here; those that read Envoy's attributes (metadata, query parameters) are
//! in `entries`.

use serde::Deserialize;

use super::checks::{check_key, check_range, default_true, error, string_or_present, Headers, RawStringMatch};
use super::entries::{self, RawMetadata, RawQueryParameterValueMatch, RawQueryParameters};
use crate::descriptor::{DescriptorEntry, HeaderMatcher};
use crate::error::ConfigError;

/// One descriptor entry as written: an object with exactly one action.
#[derive(Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub(super) enum RawDescriptor {
    RequestHeaders(RawRequestHeaders),
    RemoteAddress(RawEmpty),
    MaskedRemoteAddress(RawMasked),
    GenericKey(RawGenericKey),
    HeaderValueMatch(RawHeaderValueMatch),
    Metadata(RawMetadata),
    QueryParameters(RawQueryParameters),
    QueryParameterValueMatch(RawQueryParameterValueMatch),
    DestinationCluster(RawEmpty),
    SourceCluster(RawEmpty),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "an empty object {}")]
pub(super) struct RawEmpty {}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRequestHeaders {
    header_name: String,
    descriptor_key: String,
    #[serde(default)]
    skip_if_absent: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMasked {
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
pub(super) struct RawGenericKey {
    descriptor_value: String,
    #[serde(default = "default_generic_key")]
    descriptor_key: String,
}

fn default_generic_key() -> String {
    "generic_key".into()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawHeaderValueMatch {
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHeaderMatcher {
    name: String,
    string_match: Option<RawStringMatch>,
    present_match: Option<bool>,
    #[serde(default)]
    invert_match: bool,
}

impl RawDescriptor {
    /// The validated entry at `at` (`rules[i].descriptors[j]`).
    pub(super) fn validate(self, at: &str, headers: &mut Headers) -> Result<DescriptorEntry, ConfigError> {
        Ok(match self {
            RawDescriptor::RequestHeaders(r) => request_headers(&format!("{at}.request_headers"), r, headers)?,
            RawDescriptor::RemoteAddress(RawEmpty {}) => DescriptorEntry::RemoteAddress,
            RawDescriptor::MaskedRemoteAddress(m) => masked_remote_address(&format!("{at}.masked_remote_address"), m)?,
            RawDescriptor::GenericKey(g) => generic_key(&format!("{at}.generic_key"), g)?,
            RawDescriptor::HeaderValueMatch(h) => header_value_match(&format!("{at}.header_value_match"), h, headers)?,
            RawDescriptor::Metadata(m) => entries::metadata(&format!("{at}.metadata"), m)?,
            RawDescriptor::QueryParameters(q) => {
                entries::query_parameters(&format!("{at}.query_parameters"), q, headers)?
            }
            RawDescriptor::QueryParameterValueMatch(q) => {
                entries::query_parameter_value_match(&format!("{at}.query_parameter_value_match"), q, headers)?
            }
            RawDescriptor::DestinationCluster(RawEmpty {}) => DescriptorEntry::DestinationCluster,
            RawDescriptor::SourceCluster(RawEmpty {}) => DescriptorEntry::SourceCluster,
        })
    }
}

/// A `request_headers` entry at `at` (the entry's own field, `….request_headers`).
fn request_headers(at: &str, r: RawRequestHeaders, headers: &mut Headers) -> Result<DescriptorEntry, ConfigError> {
    check_key(&format!("{at}.descriptor_key"), &r.descriptor_key)?;
    Ok(DescriptorEntry::RequestHeaders {
        header: headers.id(&format!("{at}.header_name"), &r.header_name)?,
        key: r.descriptor_key,
        skip_if_absent: r.skip_if_absent,
    })
}

/// A `masked_remote_address` entry at `at`.
fn masked_remote_address(at: &str, m: RawMasked) -> Result<DescriptorEntry, ConfigError> {
    check_range(&format!("{at}.v4_prefix_mask_len"), u64::from(m.v4_prefix_mask_len), 0, 32)?;
    check_range(&format!("{at}.v6_prefix_mask_len"), u64::from(m.v6_prefix_mask_len), 0, 128)?;
    Ok(DescriptorEntry::MaskedRemoteAddress {
        v4_prefix_len: m.v4_prefix_mask_len,
        v6_prefix_len: m.v6_prefix_mask_len,
    })
}

/// A `generic_key` entry at `at`.
fn generic_key(at: &str, g: RawGenericKey) -> Result<DescriptorEntry, ConfigError> {
    check_key(&format!("{at}.descriptor_key"), &g.descriptor_key)?;
    check_key(&format!("{at}.descriptor_value"), &g.descriptor_value)?;
    Ok(DescriptorEntry::GenericKey { key: g.descriptor_key, value: g.descriptor_value })
}

/// A `header_value_match` entry at `at`.
fn header_value_match(at: &str, h: RawHeaderValueMatch, headers: &mut Headers) -> Result<DescriptorEntry, ConfigError> {
    check_key(&format!("{at}.descriptor_key"), &h.descriptor_key)?;
    check_key(&format!("{at}.descriptor_value"), &h.descriptor_value)?;
    if h.headers.is_empty() {
        return Err(error(format!("{at}.headers"), "must list at least one header, got []"));
    }
    let matchers = h
        .headers
        .into_iter()
        .enumerate()
        .map(|(i, m)| header_matcher(&format!("{at}.headers[{i}]"), m, headers))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(DescriptorEntry::HeaderValueMatch {
        key: h.descriptor_key,
        value: h.descriptor_value,
        expect_match: h.expect_match,
        headers: matchers,
    })
}

/// One of a `header_value_match`'s `headers[]`, at `field`.
fn header_matcher(field: &str, m: RawHeaderMatcher, headers: &mut Headers) -> Result<HeaderMatcher, ConfigError> {
    let string_match = string_or_present(field, m.string_match, m.present_match)?;
    Ok(HeaderMatcher {
        header: headers.id(&format!("{field}.name"), &m.name)?,
        string_match,
        invert_match: m.invert_match,
    })
}
