//! Envoy's side of the core's traits: shared data as the [`Store`], request
//! headers, the downstream address and Envoy's attributes (metadata, route,
//! clusters) as the [`Request`], the host clock.

use std::hash::{BuildHasher, Hasher};
use std::time::UNIX_EPOCH;

use floodgate_core::descriptor::{Attribute, HeaderId, Request};
use floodgate_core::store::{Cas, Store, StoreError};
use floodgate_core::time::Nanos;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{MapType, Status};

/// Envoy's shared data for this plugin's `vm_id`: one map for every worker.
pub struct SharedData;

impl Store for SharedData {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, Cas)>, StoreError> {
        match hostcalls::get_shared_data(key) {
            Ok((value, Some(cas))) => Ok(Some((value.unwrap_or_default(), cas))),
            Ok((None, None)) => Ok(None),
            Ok((Some(_), None)) | Err(_) => Err(StoreError::Host),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(StoreError::CasMismatch),
            Err(_) => Err(StoreError::Host),
        }
    }
}

/// The host's wall clock in nanoseconds since the Unix epoch: the one epoch
/// every worker shares. (Under `wasm32-wasip1`, `SystemTime::now()` is not
/// the host clock.)
pub fn now() -> Nanos {
    hostcalls::get_current_time().ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map_or(Nanos::ZERO, Nanos::from)
}

/// Sixteen unpredictable bytes for the hashing secret: std's random hasher
/// keys (WASI `random_get`, which Envoy serves from its own RNG), mixed with
/// the host time.
pub fn entropy() -> [u8; 16] {
    let mut out = [0u8; 16];
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(now().get());
        hasher.write_usize(i);
        chunk.copy_from_slice(&hasher.finish().to_le_bytes());
    }
    out
}

/// What a request read of its headers, by [`HeaderId`]: not yet asked
/// (`None`), absent, or the value. Kept by the worker between requests, so
/// a request allocates no room for it.
pub type HeaderReads = Vec<Option<Option<Vec<u8>>>>;

/// The request as Envoy holds it. Each header and attribute the
/// configuration needs is fetched at most once, when a rule first asks for it.
pub struct HostRequest<'a> {
    names: &'a [String],
    headers: HeaderReads,
    remote_address: Option<Option<Vec<u8>>>,
    attributes: [Option<Option<Vec<u8>>>; Attribute::COUNT],
}

impl<'a> HostRequest<'a> {
    /// A request whose headers will be looked up by the names in `names`,
    /// kept in `reads` (emptied first).
    pub fn new(names: &'a [String], mut reads: HeaderReads) -> Self {
        reads.clear();
        reads.resize(names.len(), None);
        Self { names, headers: reads, remote_address: None, attributes: Default::default() }
    }

    /// Gives the room for header values back, for the next request.
    pub fn into_reads(self) -> HeaderReads {
        self.headers
    }
}

/// The property that holds `attribute` (measured on Envoy 1.40; see
/// `docs/envoy-attributes.md`), its segments joined by NUL as the ABI takes
/// a path. The metadata properties are whole serialized `Metadata`
/// messages: a single value read by path would come back without its type.
fn property_path(attribute: Attribute) -> &'static [u8] {
    match attribute {
        Attribute::DynamicMetadata => b"metadata",
        Attribute::RouteMetadata => b"xds\0route_metadata",
        Attribute::RouteName => b"xds\0route_name",
        Attribute::DestinationCluster => b"xds\0cluster_name",
        Attribute::SourceCluster => b"xds\0node\0cluster",
    }
}

/// `source.address`, as a property path.
const SOURCE_ADDRESS: &[u8] = b"source\0address";

impl Request for HostRequest<'_> {
    fn header(&mut self, id: HeaderId) -> Option<&[u8]> {
        let name = self.names.get(id.0)?;
        let slot = self.headers.get_mut(id.0)?;
        slot.get_or_insert_with(|| hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name).ok().flatten())
            .as_deref()
    }

    /// `source.address`: the downstream remote address Envoy settled on —
    /// the connection's peer, or the client address Envoy took from
    /// `x-forwarded-for` when the connection manager is configured to trust it.
    fn remote_address(&mut self) -> Option<&[u8]> {
        self.remote_address.get_or_insert_with(|| get_property(SOURCE_ADDRESS)).as_deref()
    }

    /// Missing, empty and unserializable properties are all `None`.
    fn attribute(&mut self, attribute: Attribute) -> Option<&[u8]> {
        self.attributes
            .get_mut(attribute.index())?
            .get_or_insert_with(|| get_property(property_path(attribute)).filter(|v| !v.is_empty()))
            .as_deref()
    }
}

extern "C" {
    /// The host ABI's property read.
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> Status;

    /// The host ABI's local reply (Envoy's `sendLocalResponse`).
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> Status;
}

/// Reads property `path` (segments joined by NUL) through the host ABI
/// itself: the path is a constant, where the SDK's `get_property` builds it
/// per call. `None` when the host has no such property, or refuses.
fn get_property(path: &'static [u8]) -> Option<Vec<u8>> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: the path is valid for its length; the host writes a buffer it
    // allocated through the SDK's `proxy_on_memory_allocate` (a Vec of
    // exactly `size` bytes, forgotten) into `data` and `size`.
    match unsafe { proxy_get_property(path.as_ptr(), path.len(), &mut data, &mut size) } {
        // SAFETY: as above: ours to own, as the SDK's own getters do.
        Status::Ok if !data.is_null() => Some(unsafe { Vec::from_raw_parts(data, size, size) }),
        _ => None,
    }
}

/// Answers the current request with `status`, `headers` and `body`, through
/// the host ABI itself: the headers are serialized into `buffer`, which the
/// worker keeps between replies. (The SDK's `send_http_response` allocates
/// a buffer per call, and panics on any status but `Ok`.)
pub fn send_local_reply<'n, 'v>(
    status: u32,
    headers: impl Iterator<Item = (&'n str, &'v str)> + Clone,
    body: &[u8],
    buffer: &mut Vec<u8>,
) -> Result<(), Status> {
    serialize_map(headers, buffer);
    // SAFETY: every pointer is valid for its length for the whole call, and
    // the host only reads them.
    let status = unsafe {
        proxy_send_local_response(
            status,
            std::ptr::null(),
            0,
            body.as_ptr(),
            body.len(),
            buffer.as_ptr(),
            buffer.len(),
            -1,
        )
    };
    match status {
        Status::Ok => Ok(()),
        other => Err(other),
    }
}

/// A header map in the host ABI's layout: the number of pairs, each pair's
/// name and value lengths (u32, little-endian), then each name and value
/// followed by a NUL.
fn serialize_map<'n, 'v>(pairs: impl Iterator<Item = (&'n str, &'v str)> + Clone, out: &mut Vec<u8>) {
    out.clear();
    let count = pairs.clone().count();
    out.extend_from_slice(&u32::try_from(count).unwrap_or(u32::MAX).to_le_bytes());
    for (name, value) in pairs.clone() {
        for len in [name.len(), value.len()] {
            out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_le_bytes());
        }
    }
    for (name, value) in pairs {
        for text in [name, value] {
            out.extend_from_slice(text.as_bytes());
            out.push(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout the SDK's own serializer writes, and Envoy reads.
    #[test]
    fn a_header_map_is_laid_out_as_the_abi_wants() {
        let mut out = vec![9; 3];
        serialize_map([("retry-after", "5"), ("a", "")].into_iter(), &mut out);
        let mut want = Vec::new();
        for n in [2u32, 11, 1, 1, 0] {
            want.extend_from_slice(&n.to_le_bytes());
        }
        want.extend_from_slice(b"retry-after\x005\x00a\x00\x00");
        assert_eq!(out, want);
    }
}
