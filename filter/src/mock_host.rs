//! A mock of Envoy's proxy-wasm host, for unit tests of the host layer.
//!
//! On a native target the SDK's imports (`proxy_get_shared_data`,
//! `proxy_http_call`, …) are plain `extern "C"` symbols, so this module
//! defines them: the filter runs unchanged, through the SDK's real
//! dispatcher, against a host whose every effect is recorded. Tests drive it
//! through the SDK's exports (`proxy_on_context_create`,
//! `proxy_on_request_headers`, `proxy_on_tick`, …) as Envoy would.
//!
//! The SDK's dispatcher is per thread, as each Envoy worker has its own VM,
//! and so is this host's state: each test thread is one worker. Shared data
//! is an `Arc` that several workers (threads) may share, as in Envoy.
//!
//! It follows what was measured of Envoy (`../shared/design/host-facts.md`):
//! a callout to an unknown cluster is refused at dispatch, shared data has
//! compare-and-swap per key, switching to a context that has ended fails,
//! and a metric defined twice under one name is the same metric. A header
//! map the host does not have at that point (a reset callout's) is
//! `BadArgument`, as Envoy's `getHeaderMapValue` answers; the SDK panics on
//! it, which is why the filter asks only for what the host said is there.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType, Status, StreamType};

/// Envoy's shared data: value and compare-and-swap version per key.
pub type SharedMap = Arc<Mutex<HashMap<String, (Vec<u8>, u32)>>>;

/// Header pairs, in order.
pub type Headers = Vec<(String, String)>;

/// A call the filter dispatched.
#[derive(Debug, Clone)]
pub struct HttpCall {
    /// The token the host returned.
    pub token: u32,
    /// The cluster called.
    pub cluster: String,
    /// The call's headers (`:method`, `:path`, …).
    pub headers: Headers,
    /// The call's body.
    pub body: Vec<u8>,
    /// The timeout asked, in milliseconds.
    pub timeout_ms: u32,
    /// The context it was dispatched as (its answer goes to that context).
    pub context: u32,
    /// The filter callback it was dispatched from.
    pub handler: &'static str,
}

impl HttpCall {
    /// The value of header `name`, if sent.
    pub fn header(&self, name: &str) -> Option<&str> {
        value(&self.headers, name)
    }
}

fn value<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
}

/// A local response the filter sent.
#[derive(Debug, Clone)]
pub struct LocalResponse {
    /// The context it was sent for.
    pub context_id: u32,
    /// Its status.
    pub status: u32,
    /// Its headers.
    pub headers: Headers,
}

impl LocalResponse {
    /// The value of header `name`, if sent.
    pub fn header(&self, name: &str) -> Option<&str> {
        value(&self.headers, name)
    }
}

/// One worker's host.
#[derive(Debug, Default)]
pub struct MockHost {
    /// The shared data of the workers of one Envoy.
    pub shared: SharedMap,
    /// The host clock, nanoseconds since the Unix epoch.
    pub now: u64,
    /// The plugin configuration.
    pub configuration: Vec<u8>,
    /// The clusters Envoy has.
    pub clusters: HashSet<String>,
    /// Contexts that exist (created, not yet done).
    pub live: HashSet<u32>,
    /// The context host calls act on.
    pub effective: u32,
    /// Request headers per context.
    pub request_headers: HashMap<u32, Headers>,
    /// Response headers the filter added, per context.
    pub response_headers: HashMap<u32, Headers>,
    /// Calls dispatched, in order.
    pub calls: Vec<HttpCall>,
    /// The answer being delivered: its headers (none for a reset stream,
    /// whose header map Envoy does not have) and body.
    pub answer: Option<(Option<Headers>, Vec<u8>)>,
    /// How often the filter read an answer's body.
    pub body_reads: usize,
    /// Requests resumed, in order.
    pub resumed: Vec<u32>,
    /// The filter callback each request was resumed from, in order.
    pub resumed_in: Vec<&'static str>,
    /// The filter callback running now (the test driver sets it).
    pub handler: &'static str,
    /// Local responses sent, in order.
    pub responses: Vec<LocalResponse>,
    /// Metric names by id (id = index + 1).
    pub metric_names: Vec<String>,
    /// Metric values by id.
    pub metric_values: HashMap<u32, i64>,
    /// The tick period last set, in milliseconds.
    pub tick_ms: u32,
    /// Log lines.
    pub logs: Vec<(u32, String)>,
    /// `proxy_done` was called.
    pub done: bool,
    /// Host calls by kind (the ABI function's name without `proxy_`).
    pub host_calls: std::collections::BTreeMap<&'static str, u32>,
    /// Properties the host has besides `source.address` (always
    /// `10.0.0.7:4242`), by path with its segments joined by `.`.
    pub properties: HashMap<String, Vec<u8>>,
    /// Every property read, in order (paths joined by `.`).
    pub property_reads: Vec<String>,
    /// Shared queues by id: the registering context, and what waits in it.
    pub queues: HashMap<u32, (u32, Vec<Vec<u8>>)>,
    /// Queues posted to since the event loop last turned, in order: Envoy
    /// calls `on_queue_ready` for each on the registering worker.
    pub posted: Vec<u32>,
    next_token: u32,
}

thread_local! {
    static HOST: RefCell<MockHost> = RefCell::new(MockHost::default());
}

thread_local! {
    /// Heap allocations this worker's guest code made, and whether the host
    /// is running now (its own allocations, and the buffers it hands the
    /// guest, are the host's, as Envoy's are: not counted).
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
    static IN_HOST: Cell<bool> = const { Cell::new(false) };
}

/// Counts the guest's heap allocations per worker (thread), so tests can
/// assert a request path allocates nothing.
struct CountingAllocator;

// SAFETY: every call is forwarded to the system allocator unchanged.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count_allocation();
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count_allocation();
        System.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count_allocation();
        System.realloc(ptr, layout, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

fn count_allocation() {
    // `try_with`: a thread being torn down has no counters left.
    let _ = IN_HOST.try_with(|in_host| {
        if !in_host.get() {
            let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        }
    });
}

/// Heap allocations this worker's guest code has made so far.
pub fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

/// A host function running: counted by kind, and what it allocates is the
/// host's until the guard is dropped.
struct InHost(bool);

fn enter(kind: &'static str) -> InHost {
    let outer = IN_HOST.with(|in_host| in_host.replace(true));
    with(|host| *host.host_calls.entry(kind).or_default() += 1);
    InHost(outer)
}

impl Drop for InHost {
    fn drop(&mut self) {
        IN_HOST.with(|in_host| in_host.set(self.0));
    }
}

/// Runs `f` on this worker's host.
pub fn with<R>(f: impl FnOnce(&mut MockHost) -> R) -> R {
    HOST.with(|host| f(&mut host.borrow_mut()))
}

impl MockHost {
    /// The value of metric `name` (0 if never touched).
    pub fn metric(&self, name: &str) -> i64 {
        self.metric_names
            .iter()
            .position(|n| n == name)
            .and_then(|i| self.metric_values.get(&(i as u32 + 1)))
            .copied()
            .unwrap_or(0)
    }

    /// Whether metric `id` was defined.
    fn defines(&self, id: u32) -> bool {
        id != 0 && id as usize <= self.metric_names.len()
    }
}

unsafe fn text<'a>(data: *const u8, size: usize) -> &'a str {
    std::str::from_utf8(bytes(data, size)).unwrap()
}

unsafe fn bytes<'a>(data: *const u8, size: usize) -> &'a [u8] {
    if size == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(data, size)
    }
}

/// Hands `value` to the SDK as memory it will free as a `Vec` of exactly
/// this length and capacity.
unsafe fn give(value: &[u8], data: *mut *mut u8, size: *mut usize) {
    let boxed: Box<[u8]> = value.to_vec().into_boxed_slice();
    *size = boxed.len();
    *data = Box::into_raw(boxed).cast::<u8>();
}

/// Reads the SDK's serialized header map.
unsafe fn read_map(data: *const u8, size: usize) -> Headers {
    let raw = bytes(data, size);
    let word = |at: usize| u32::from_le_bytes(raw[at..at + 4].try_into().unwrap()) as usize;
    let count = word(0);
    let mut at = 4 + count * 8;
    (0..count)
        .map(|i| {
            let (name_len, value_len) = (word(4 + i * 8), word(8 + i * 8));
            let name = String::from_utf8(raw[at..at + name_len].to_vec()).unwrap();
            at += name_len + 1;
            let value = String::from_utf8(raw[at..at + value_len].to_vec()).unwrap();
            at += value_len + 1;
            (name, value)
        })
        .collect()
}

/// The header map `map` as the host has it now; a map the host does not
/// have at this point (an answer's headers after a reset) is `BadArgument`,
/// as in Envoy.
fn header_map(host: &MockHost, map: MapType) -> Result<&[(String, String)], Status> {
    let headers = match map {
        MapType::HttpRequestHeaders => host.request_headers.get(&host.effective),
        MapType::HttpCallResponseHeaders => host.answer.as_ref().and_then(|(headers, _)| headers.as_ref()),
        _ => None,
    };
    headers.map(Vec::as_slice).ok_or(Status::BadArgument)
}

#[no_mangle]
unsafe extern "C" fn proxy_log(level: LogLevel, data: *const u8, size: usize) -> Status {
    let _host = enter("log");
    let line = text(data, size).to_string();
    eprintln!("[mock host {level:?}] {line}");
    with(|host| host.logs.push((level as u32, line)));
    Status::Ok
}

#[no_mangle]
unsafe extern "C" fn proxy_get_log_level(level: *mut LogLevel) -> Status {
    let _host = enter("get_log_level");
    *level = LogLevel::Debug;
    Status::Ok
}

#[no_mangle]
unsafe extern "C" fn proxy_get_current_time_nanoseconds(time: *mut u64) -> Status {
    let _host = enter("get_current_time_nanoseconds");
    *time = with(|host| host.now);
    Status::Ok
}

#[no_mangle]
extern "C" fn proxy_set_tick_period_milliseconds(period: u32) -> Status {
    let _host = enter("set_tick_period_milliseconds");
    with(|host| host.tick_ms = period);
    Status::Ok
}

#[no_mangle]
unsafe extern "C" fn proxy_get_buffer_bytes(
    buffer: BufferType,
    start: usize,
    max_size: usize,
    data: *mut *mut u8,
    size: *mut usize,
) -> Status {
    let _host = enter("get_buffer_bytes");
    let content = with(|host| match buffer {
        BufferType::PluginConfiguration => Some(host.configuration.clone()),
        BufferType::HttpCallResponseBody => {
            host.body_reads += 1;
            host.answer.as_ref().map(|(_, body)| body.clone())
        }
        _ => None,
    });
    match content {
        Some(content) => {
            let from = start.min(content.len());
            let to = from.saturating_add(max_size).min(content.len());
            give(&content[from..to], data, size);
            Status::Ok
        }
        None => Status::NotFound,
    }
}

#[no_mangle]
unsafe extern "C" fn proxy_get_header_map_value(
    map: MapType,
    key: *const u8,
    key_size: usize,
    data: *mut *mut u8,
    size: *mut usize,
) -> Status {
    let _host = enter("get_header_map_value");
    let key = text(key, key_size);
    let found = with(|host| header_map(host, map).map(|headers| value(headers, key).map(str::to_string)));
    match found {
        Ok(Some(value)) => {
            give(value.as_bytes(), data, size);
            Status::Ok
        }
        Ok(None) => Status::NotFound,
        Err(status) => status,
    }
}

#[no_mangle]
unsafe extern "C" fn proxy_add_header_map_value(
    map: MapType,
    key: *const u8,
    key_size: usize,
    value: *const u8,
    value_size: usize,
) -> Status {
    let _host = enter("add_header_map_value");
    assert_eq!(map, MapType::HttpResponseHeaders, "the filter adds response headers only");
    let pair = (text(key, key_size).to_string(), text(value, value_size).to_string());
    with(|host| host.response_headers.entry(host.effective).or_default().push(pair));
    Status::Ok
}

#[no_mangle]
unsafe extern "C" fn proxy_get_property(
    path: *const u8,
    path_size: usize,
    data: *mut *mut u8,
    size: *mut usize,
) -> Status {
    let _host = enter("get_property");
    let path = text(path, path_size).replace('\0', ".");
    let value = with(|host| {
        host.property_reads.push(path.clone());
        host.properties.get(&path).cloned()
    });
    match (path.as_str(), value) {
        ("source.address", _) => give(b"10.0.0.7:4242", data, size),
        (_, Some(value)) => give(&value, data, size),
        (_, None) => return Status::NotFound,
    }
    Status::Ok
}

#[no_mangle]
unsafe extern "C" fn proxy_get_shared_data(
    key: *const u8,
    key_size: usize,
    data: *mut *mut u8,
    size: *mut usize,
    cas: *mut u32,
) -> Status {
    let _host = enter("get_shared_data");
    let key = text(key, key_size);
    let entry = with(|host| host.shared.lock().unwrap().get(key).cloned());
    match entry {
        Some((value, version)) => {
            give(&value, data, size);
            *cas = version;
            Status::Ok
        }
        None => Status::NotFound,
    }
}

#[no_mangle]
unsafe extern "C" fn proxy_set_shared_data(
    key: *const u8,
    key_size: usize,
    value: *const u8,
    value_size: usize,
    cas: u32,
) -> Status {
    let _host = enter("set_shared_data");
    let key = text(key, key_size).to_string();
    let value = bytes(value, value_size).to_vec();
    with(|host| {
        let mut shared = host.shared.lock().unwrap();
        let entry = shared.entry(key).or_insert_with(|| (Vec::new(), 0));
        if cas != 0 && cas != entry.1 {
            return Status::CasMismatch;
        }
        *entry = (value, entry.1 + 1);
        Status::Ok
    })
}

#[no_mangle]
extern "C" fn proxy_set_effective_context(context_id: u32) -> Status {
    let _host = enter("set_effective_context");
    with(|host| {
        if host.live.contains(&context_id) {
            host.effective = context_id;
            Status::Ok
        } else {
            Status::BadArgument
        }
    })
}

#[no_mangle]
extern "C" fn proxy_continue_stream(stream: StreamType) -> Status {
    let _host = enter("continue_stream");
    assert_eq!(stream, StreamType::HttpRequest, "the filter resumes requests only");
    with(|host| {
        host.resumed.push(host.effective);
        let handler = host.handler;
        host.resumed_in.push(handler);
    });
    Status::Ok
}

#[no_mangle]
unsafe extern "C" fn proxy_send_local_response(
    status: u32,
    _details: *const u8,
    _details_size: usize,
    _body: *const u8,
    _body_size: usize,
    headers: *const u8,
    headers_size: usize,
    _grpc_status: i32,
) -> Status {
    let _host = enter("send_local_response");
    let headers = read_map(headers, headers_size);
    with(|host| host.responses.push(LocalResponse { context_id: host.effective, status, headers }));
    Status::Ok
}

#[no_mangle]
unsafe extern "C" fn proxy_http_call(
    upstream: *const u8,
    upstream_size: usize,
    headers: *const u8,
    headers_size: usize,
    body: *const u8,
    body_size: usize,
    _trailers: *const u8,
    _trailers_size: usize,
    timeout_ms: u32,
    token: *mut u32,
) -> Status {
    let _host = enter("http_call");
    let cluster = text(upstream, upstream_size).to_string();
    let headers = read_map(headers, headers_size);
    let body = bytes(body, body_size).to_vec();
    with(|host| {
        if !host.clusters.contains(&cluster) {
            return Status::BadArgument;
        }
        host.next_token += 1;
        *token = host.next_token;
        let (context, handler) = (host.effective, host.handler);
        host.calls.push(HttpCall { token: host.next_token, cluster, headers, body, timeout_ms, context, handler });
        Status::Ok
    })
}

#[no_mangle]
unsafe extern "C" fn proxy_register_shared_queue(name: *const u8, name_size: usize, id: *mut u32) -> Status {
    let _host = enter("register_shared_queue");
    let _ = text(name, name_size);
    *id = with(|host| {
        host.next_token += 1;
        let context = host.effective;
        host.queues.insert(host.next_token, (context, Vec::new()));
        host.next_token
    });
    Status::Ok
}

#[no_mangle]
unsafe extern "C" fn proxy_enqueue_shared_queue(id: u32, data: *const u8, size: usize) -> Status {
    let _host = enter("enqueue_shared_queue");
    let value = bytes(data, size).to_vec();
    with(|host| match host.queues.get_mut(&id) {
        Some((_, items)) => {
            items.push(value);
            host.posted.push(id);
            Status::Ok
        }
        None => Status::NotFound,
    })
}

#[no_mangle]
unsafe extern "C" fn proxy_dequeue_shared_queue(id: u32, data: *mut *mut u8, size: *mut usize) -> Status {
    let _host = enter("dequeue_shared_queue");
    let item = with(|host| match host.queues.get_mut(&id) {
        None => Err(Status::NotFound),
        Some((_, items)) if items.is_empty() => Err(Status::Empty),
        Some((_, items)) => Ok(items.remove(0)),
    });
    match item {
        Ok(value) => {
            give(&value, data, size);
            Status::Ok
        }
        Err(status) => status,
    }
}

#[no_mangle]
extern "C" fn proxy_done() -> Status {
    let _host = enter("done");
    with(|host| host.done = true);
    Status::Ok
}

#[no_mangle]
unsafe extern "C" fn proxy_define_metric(_kind: MetricType, name: *const u8, name_size: usize, id: *mut u32) -> Status {
    let _host = enter("define_metric");
    let name = text(name, name_size).to_string();
    *id = with(|host| match host.metric_names.iter().position(|n| *n == name) {
        Some(index) => index as u32 + 1,
        None => {
            host.metric_names.push(name);
            host.metric_names.len() as u32
        }
    });
    Status::Ok
}

#[no_mangle]
extern "C" fn proxy_increment_metric(id: u32, offset: i64) -> Status {
    let _host = enter("increment_metric");
    with(|host| {
        if !host.defines(id) {
            return Status::NotFound;
        }
        *host.metric_values.entry(id).or_default() += offset;
        Status::Ok
    })
}

#[no_mangle]
extern "C" fn proxy_record_metric(id: u32, value: u64) -> Status {
    let _host = enter("record_metric");
    with(|host| {
        if !host.defines(id) {
            return Status::NotFound;
        }
        host.metric_values.insert(id, value as i64);
        Status::Ok
    })
}

#[no_mangle]
unsafe extern "C" fn proxy_get_metric(id: u32, value: *mut u64) -> Status {
    let _host = enter("get_metric");
    *value = with(|host| host.metric_values.get(&id).copied().unwrap_or(0)) as u64;
    Status::Ok
}

/// Host functions the SDK can call but the filter never does: defined so the
/// test binary links, and fatal if reached. (The linker matches names only;
/// as they are never called, their parameters are left out.)
macro_rules! never_called {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        extern "C" fn $name() -> Status {
            eprintln!("the filter called {}, which the mock host does not model", stringify!($name));
            std::process::abort()
        }
    )*};
}

never_called!(
    proxy_set_buffer_bytes,
    proxy_get_header_map_pairs,
    proxy_set_header_map_pairs,
    proxy_remove_header_map_value,
    proxy_replace_header_map_value,
    proxy_set_property,
    proxy_resolve_shared_queue,
    proxy_close_stream,
    proxy_grpc_call,
    proxy_grpc_stream,
    proxy_grpc_send,
    proxy_grpc_cancel,
    proxy_grpc_close,
    proxy_get_status,
    proxy_call_foreign_function,
);
