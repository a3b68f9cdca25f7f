//! The host, as the filter sees it: every call the filter makes to Envoy is
//! a method of [`Host`], implemented over proxy-wasm's ABI by
//! [`crate::envoy::EnvoyHost`] and, in tests, by a fake that records what it is
//! asked. Over it, Envoy's side of the core's traits: shared data as the
//! [`Store`], the request's headers, address and attributes as the
//! [`Request`].

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use floodgate_core::descriptor::{Attribute, HeaderId, Request};
use floodgate_core::headers::HeaderBlock;
use floodgate_core::store::{Cas, Store, StoreError};
use floodgate_core::time::Nanos;
use proxy_wasm::types::{MetricType, Status};

/// Everything the filter asks of its host. Each call acts on the context
/// the host holds as effective (the callback's own, unless switched with
/// [`Host::set_effective_context`]). Every method returns the host's
/// refusal rather than panicking, as the SDK's trait helpers do; byte
/// values are owned buffers the host filled, so reading one allocates
/// nothing on the guest's side beyond what the ABI hands over.
pub trait Host {
    /// Request header `name` of the current request, as bytes (a value is
    /// not assumed to be UTF-8); `None` when absent.
    fn request_header(&self, name: &str) -> Result<Option<Vec<u8>>, Status>;

    /// Property `path` (its segments joined by NUL); `None` when the host
    /// has no such property.
    fn property(&self, path: &'static [u8]) -> Result<Option<Vec<u8>>, Status>;

    /// Adds a header to the current request's response.
    fn add_response_header(&self, name: &str, value: &str) -> Result<(), Status>;

    /// Answers the current request with `status`, `headers` and `body`
    /// instead of sending it upstream.
    fn send_local_reply(&self, status: u32, headers: &HeaderBlock, body: &[u8]) -> Result<(), Status>;

    /// Makes `context_id` the context later calls act on. Fails when that
    /// context has ended, or belongs to another worker.
    fn set_effective_context(&self, context_id: u32) -> Result<(), Status>;

    /// Resumes the current (paused) request.
    fn resume_request(&self) -> Result<(), Status>;

    /// Shared data `key`: its value and version, as the ABI gives them (a
    /// missing key is `(None, None)`).
    fn get_shared_data(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<Cas>), Status>;

    /// Writes shared data `key` if it is still at version `cas` (`None`:
    /// unconditionally); a stale `cas` is `Status::CasMismatch`.
    fn set_shared_data(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), Status>;

    /// Registers a shared queue under `name`; its id. The registering
    /// context receives its `on_queue_ready`.
    fn register_queue(&self, name: &str) -> Result<u32, Status>;

    /// Posts an empty item to queue `queue`.
    fn enqueue(&self, queue: u32) -> Result<(), Status>;

    /// Takes the next item of queue `queue`; `None` when it is empty.
    fn dequeue(&self, queue: u32) -> Result<Option<Vec<u8>>, Status>;

    /// Dispatches an HTTP call to `cluster` as the current context, which
    /// receives its answer; its token.
    fn dispatch_call(
        &self,
        cluster: &str,
        headers: Vec<(&str, &str)>,
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<u32, Status>;

    /// Header `name` of the call answer being delivered.
    fn call_answer_header(&self, name: &str) -> Result<Option<Vec<u8>>, Status>;

    /// The first `size` bytes of the body of the call answer being delivered.
    fn call_answer_body(&self, size: usize) -> Result<Option<Vec<u8>>, Status>;

    /// The plugin configuration, as written.
    fn plugin_configuration(&self) -> Result<Option<Vec<u8>>, Status>;

    /// The host's wall clock, nanoseconds since the Unix epoch: the one
    /// epoch every worker shares.
    fn current_time(&self) -> Result<Nanos, Status>;

    /// Sets how often this root context's tick runs (zero: never).
    fn set_tick_period(&self, period: Duration) -> Result<(), Status>;

    /// Defines a metric; its id. The same name gives the same metric.
    fn define_metric(&self, kind: MetricType, name: &str) -> Result<u32, Status>;

    /// Adds `offset` to metric `id`.
    fn increment_metric(&self, id: u32, offset: i64) -> Result<(), Status>;

    /// Sets gauge `id` to `value`.
    fn record_metric(&self, id: u32, value: u64) -> Result<(), Status>;

    /// Tells the host a root context that asked to stay is done.
    fn done(&self) -> Result<(), Status>;

    /// [`Host::current_time`], or the epoch when the host cannot say: a
    /// decision at the epoch is one more conservative than a panic.
    fn now(&self) -> Nanos {
        self.current_time().unwrap_or(Nanos::ZERO)
    }
}

/// Envoy's shared data for this plugin's `vm_id`, one map for every
/// worker, as the core's [`Store`].
pub struct SharedData<'h, H>(pub &'h H);

impl<H: Host> Store for SharedData<'_, H> {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, Cas)>, StoreError> {
        match self.0.get_shared_data(key) {
            Ok((value, Some(cas))) => Ok(Some((value.unwrap_or_default(), cas))),
            Ok((None, None)) => Ok(None),
            Ok((Some(_), None)) | Err(_) => Err(StoreError::Host),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
        match self.0.set_shared_data(key, value, cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(StoreError::CasMismatch),
            Err(_) => Err(StoreError::Host),
        }
    }
}

/// Sixteen unpredictable bytes for the hashing secret: std's random hasher
/// keys (WASI `random_get`, which Envoy serves from its own RNG), mixed with
/// the host time.
pub fn entropy(host: &impl Host) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(host.now().get());
        hasher.write_usize(i);
        chunk.copy_from_slice(&hasher.finish().to_le_bytes());
    }
    out
}

/// What a request read of its headers, by [`HeaderId`]: not yet asked
/// (`None`), absent, or the value. Kept by the worker between requests, so
/// a request allocates no room for it.
pub type HeaderReads = Vec<Option<Option<Vec<u8>>>>;

/// The request as the host holds it. Each header and attribute the
/// configuration needs is fetched at most once, when a rule first asks for it.
pub struct HostRequest<'a, H> {
    host: &'a H,
    names: &'a [String],
    headers: HeaderReads,
    remote_address: Option<Option<Vec<u8>>>,
    attributes: [Option<Option<Vec<u8>>>; Attribute::COUNT],
}

impl<'a, H: Host> HostRequest<'a, H> {
    /// The current request of `host`, whose headers will be looked up by
    /// the names in `names`, kept in `reads` (emptied first).
    pub fn new(host: &'a H, names: &'a [String], mut reads: HeaderReads) -> Self {
        reads.clear();
        reads.resize(names.len(), None);
        Self { host, names, headers: reads, remote_address: None, attributes: Default::default() }
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

impl<H: Host> Request for HostRequest<'_, H> {
    fn header(&mut self, id: HeaderId) -> Option<&[u8]> {
        let name = self.names.get(id.0)?;
        let slot = self.headers.get_mut(id.0)?;
        let host = self.host;
        slot.get_or_insert_with(|| host.request_header(name).ok().flatten()).as_deref()
    }

    /// `source.address`: the downstream remote address Envoy settled on —
    /// the connection's peer, or the client address Envoy took from
    /// `x-forwarded-for` when the connection manager is configured to trust it.
    fn remote_address(&mut self) -> Option<&[u8]> {
        let host = self.host;
        self.remote_address.get_or_insert_with(|| host.property(SOURCE_ADDRESS).ok().flatten()).as_deref()
    }

    /// Missing, empty and unserializable properties are all `None`.
    fn attribute(&mut self, attribute: Attribute) -> Option<&[u8]> {
        let host = self.host;
        self.attributes
            .get_mut(attribute.index())?
            .get_or_insert_with(|| host.property(property_path(attribute)).ok().flatten().filter(|v| !v.is_empty()))
            .as_deref()
    }
}
