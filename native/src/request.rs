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

/// Rules naming up to this many headers keep their values on the stack.
const INLINE_HEADERS: usize = 8;

/// The first value of each header the rules name, by its place among them:
/// on the stack for a few (no allocation per request), else on the heap.
/// Filled where it lies (no copy of the room into its place).
struct HeaderValues<'f> {
    /// Read from Envoy yet.
    read: bool,
    inline: [Option<&'f [u8]>; INLINE_HEADERS],
    /// Used instead of `inline` when the rules name more headers.
    heap: Vec<Option<&'f [u8]>>,
}

impl<'f> HeaderValues<'f> {
    /// None read yet. Made field by field, not copied from a constant (a
    /// copy of its bytes is a call to memcpy).
    fn unread() -> Self {
        HeaderValues { read: false, inline: [None; INLINE_HEADERS], heap: Vec::new() }
    }

    fn get(&self, index: usize) -> Option<&'f [u8]> {
        let values = if self.heap.is_empty() { &self.inline[..] } else { &self.heap[..] };
        values.get(index).copied().flatten()
    }

    /// Room for one value of each of `count` names, all `None` (as they
    /// are until read).
    fn room(&mut self, count: usize) -> &mut [Option<&'f [u8]>] {
        if count <= INLINE_HEADERS {
            &mut self.inline[..]
        } else {
            self.heap = vec![None; count];
            &mut self.heap[..]
        }
    }
}

/// One request during its headers hook.
pub struct StreamRequest<'f> {
    filter: &'f Filter<'f>,
    names: &'f [String],
    /// The first value of each of `names`, once read.
    headers: HeaderValues<'f>,
    remote_address: Read<'f>,
    attributes: [Read<'f>; Attribute::COUNT],
}

impl<'f> StreamRequest<'f> {
    /// The request of `filter`'s stream, whose headers rules name by their
    /// place in `names`.
    pub fn new(filter: &'f Filter<'f>, names: &'f [String]) -> Self {
        StreamRequest {
            filter,
            names,
            headers: HeaderValues::unread(),
            remote_address: None,
            attributes: [None; Attribute::COUNT],
        }
    }
}

/// The first value of each of `names` (lower case, as Envoy keeps header
/// names) among the request's headers, in one pass over them that ends
/// once every name has its value.
fn first_values<'f>(
    names: &[String],
    values: &mut HeaderValues<'f>,
    each_header: impl FnOnce(&mut dyn FnMut(&'f [u8], &'f [u8]) -> bool),
) {
    debug_assert!(!values.read, "read once");
    values.read = true;
    let slots = values.room(names.len());
    let mut missing = names.len();
    each_header(&mut |name, value| {
        for (wanted, found) in names.iter().zip(slots.iter_mut()) {
            if found.is_none() && wanted.as_bytes() == name {
                *found = Some(value);
                missing -= 1;
            }
        }
        missing > 0
    });
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
        if !self.headers.read {
            let filter = self.filter;
            first_values(self.names, &mut self.headers, |visit| filter.each_request_header(visit));
        }
        self.headers.get(id.0)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The first value of each name, whether the rules name a few headers
    /// (kept on the stack) or many (on the heap); absent names read `None`.
    #[test]
    fn first_values_keep_the_first_of_each_name_for_few_and_many_names() {
        let headers: [(&[u8], &[u8]); 4] = [(b"b", b"1"), (b"a", b"2"), (b"b", b"3"), (b"k9", b"9")];
        for count in [2, INLINE_HEADERS, INLINE_HEADERS + 2] {
            let mut names: Vec<String> = vec!["a".into(), "b".into()];
            names.extend((2..count).map(|i| format!("k{i}")));
            let mut visited = 0;
            let mut values = HeaderValues::unread();
            first_values(&names, &mut values, |visit| {
                for (name, value) in &headers {
                    visited += 1;
                    if !visit(name, value) {
                        break;
                    }
                }
            });
            assert_eq!(visited, if count == 2 { 2 } else { headers.len() }, "{count} names: read until all are found");
            assert!(values.read);
            assert_eq!(values.heap.is_empty(), count <= INLINE_HEADERS, "{count} names");
            assert_eq!(values.get(0), Some(&b"2"[..]));
            assert_eq!(values.get(1), Some(&b"1"[..]), "the first of a repeated name");
            assert_eq!(values.get(2), None);
            assert_eq!(values.get(9), (count > 9).then_some(&b"9"[..]));
            assert_eq!(values.get(count), None, "past the names");
        }
    }
}
