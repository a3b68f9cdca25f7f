//! The request as the core reads it ([`Request`]), over Envoy's dynamic
//! module ABI: each attribute is asked of Envoy at most once, when a rule
//! first needs it, the headers all at once when a rule first needs one
//! (one pass over Envoy's map costs less than one lookup by name), and
//! everything is read where Envoy keeps it — nothing is copied.

use floodgate_core::descriptor::{Attribute, HeaderId, Request};
use floodgate_core::metadata::{Found, MetadataKey, MetadataSource, Wanted};

use crate::abi::{self, AttributeId, Filter};

/// A value asked of Envoy: not yet (`None`), absent, or Envoy's bytes.
type Read<'f> = Option<Option<&'f [u8]>>;

/// One request during its headers hook.
pub struct StreamRequest<'f> {
    filter: &'f Filter<'f>,
    names: &'f [String],
    /// The first value of each of `names`, once read.
    headers: Option<Vec<Option<&'f [u8]>>>,
    remote_address: Read<'f>,
    attributes: [Read<'f>; Attribute::COUNT],
}

impl<'f> StreamRequest<'f> {
    /// The request of `filter`'s stream, whose headers rules name by their
    /// place in `names`.
    pub fn new(filter: &'f Filter<'f>, names: &'f [String]) -> Self {
        StreamRequest { filter, names, headers: None, remote_address: None, attributes: [None; Attribute::COUNT] }
    }
}

/// The first value of each of `names` (lower case, as Envoy keeps header
/// names) among the request's headers, in one pass over them.
fn first_values<'f>(filter: &'f Filter<'f>, names: &[String]) -> Vec<Option<&'f [u8]>> {
    let mut values = vec![None; names.len()];
    filter.each_request_header(|name, value| {
        for (wanted, found) in names.iter().zip(values.iter_mut()) {
            if found.is_none() && wanted.as_bytes() == name {
                *found = Some(value);
            }
        }
    });
    values
}

/// The attribute Envoy serves for `attribute`, if it serves one as a string.
fn attribute_id(attribute: Attribute) -> Option<AttributeId> {
    match attribute {
        Attribute::RouteName => Some(AttributeId::XdsRouteName),
        Attribute::DestinationCluster => Some(AttributeId::XdsClusterName),
        // Whole serialized metadata is not served: metadata is read by key
        // (`Request::metadata` below). Nor is the node's cluster; the
        // configuration is refused for what needs it (`crate::support`).
        Attribute::DynamicMetadata | Attribute::RouteMetadata | Attribute::SourceCluster => None,
    }
}

impl Request for StreamRequest<'_> {
    fn header(&mut self, id: HeaderId) -> Option<&[u8]> {
        let (filter, names) = (self.filter, self.names);
        let headers = self.headers.get_or_insert_with(|| first_values(filter, names));
        headers.get(id.0).copied().flatten()
    }

    /// `source.address`: the downstream remote address Envoy settled on, as
    /// the wasm build reads it.
    fn remote_address(&mut self) -> Option<&[u8]> {
        let filter = self.filter;
        *self.remote_address.get_or_insert_with(|| filter.attribute(AttributeId::SourceAddress))
    }

    /// Missing and empty values are both `None`, as in the wasm build.
    fn attribute(&mut self, attribute: Attribute) -> Option<&[u8]> {
        let filter = self.filter;
        let id = attribute_id(attribute)?;
        *self
            .attributes
            .get_mut(attribute.index())?
            .get_or_insert_with(|| filter.attribute(id).filter(|value| !value.is_empty()))
    }

    /// Envoy serves metadata one key deep, asked for as a string, a number
    /// or a boolean (anything else reads as absent, which is what the core
    /// makes of it too); longer paths are refused with the configuration.
    /// Envoy logs an error for every value asked for as a kind it is not,
    /// so only the kinds the caller uses are asked for, a string first: a
    /// `metadata` entry or a `string_match` (a string or nothing) and a
    /// `bool_match` never log, a `present_match` logs only for a value that
    /// is not a string. A value of a kind the caller cannot use logs once.
    fn metadata(&mut self, source: MetadataSource, key: &MetadataKey, wanted: Wanted) -> Found<'_> {
        let [name] = key.path.as_slice() else { return Found::Absent };
        let source = match source {
            MetadataSource::Dynamic => abi::MetadataSource::Dynamic,
            MetadataSource::RouteEntry => abi::MetadataSource::Route,
        };
        let filter = self.filter;
        let string = || filter.metadata_string(source, &key.namespace, name).map(Found::String);
        let number = || filter.metadata_number(source, &key.namespace, name).map(Found::Number);
        let boolean = || filter.metadata_bool(source, &key.namespace, name).map(Found::Bool);
        let found = match wanted {
            Wanted::String => string(),
            Wanted::Bool => boolean(),
            Wanted::Scalar => string().or_else(number).or_else(boolean),
        };
        found.unwrap_or(Found::Absent)
    }
}
