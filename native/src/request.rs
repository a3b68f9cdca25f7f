//! The request as the core reads it ([`Request`]), over Envoy's dynamic
//! module ABI: each header and attribute is asked of Envoy at most once,
//! when a rule first needs it, and read where Envoy keeps it — nothing is
//! copied.

use floodgate_core::descriptor::{Attribute, HeaderId, Request};
use floodgate_core::metadata::{Found, MetadataKey, MetadataSource};

use crate::abi::{self, AttributeId, Filter};

/// A value asked of Envoy: not yet (`None`), absent, or Envoy's bytes.
type Read<'f> = Option<Option<&'f [u8]>>;

/// One request during its headers hook.
pub struct StreamRequest<'f> {
    filter: &'f Filter<'f>,
    names: &'f [String],
    headers: Vec<Read<'f>>,
    remote_address: Read<'f>,
    attributes: [Read<'f>; Attribute::COUNT],
}

impl<'f> StreamRequest<'f> {
    /// The request of `filter`'s stream, whose headers rules name by their
    /// place in `names`.
    pub fn new(filter: &'f Filter<'f>, names: &'f [String]) -> Self {
        StreamRequest { filter, names, headers: Vec::new(), remote_address: None, attributes: [None; Attribute::COUNT] }
    }
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
        let name = self.names.get(id.0)?;
        if self.headers.len() < self.names.len() {
            self.headers.resize(self.names.len(), None);
        }
        let filter = self.filter;
        *self.headers.get_mut(id.0)?.get_or_insert_with(|| filter.request_header(name))
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

    /// Envoy serves metadata one key deep, with its type: a string, a number
    /// or a boolean (anything else reads as absent, which is what the core
    /// makes of it too). Longer paths are refused with the configuration.
    fn metadata(&mut self, source: MetadataSource, key: &MetadataKey) -> Found<'_> {
        let [name] = key.path.as_slice() else { return Found::Absent };
        let source = match source {
            MetadataSource::Dynamic => abi::MetadataSource::Dynamic,
            MetadataSource::RouteEntry => abi::MetadataSource::Route,
        };
        let filter = self.filter;
        if let Some(value) = filter.metadata_string(source, &key.namespace, name) {
            return Found::String(value);
        }
        if let Some(value) = filter.metadata_number(source, &key.namespace, name) {
            return Found::Number(value);
        }
        filter.metadata_bool(source, &key.namespace, name).map_or(Found::Absent, Found::Bool)
    }
}
