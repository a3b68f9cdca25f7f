//! The ABI's types, and Envoy's callbacks that Floodgate uses, behind
//! safe wrappers whose lifetimes are the ABI's (see the parent module).

use std::ffi::c_void;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ptr::{self, NonNull};

/// The ABI version this module was built for; Envoy compares it with its
/// own at load and logs whether they match.
pub(super) const ABI_VERSION: &[u8] = b"v0.2.0\0";

// ---------------------------------------------------------------------------
// Types (as in abi.h)
// ---------------------------------------------------------------------------

/// `envoy_dynamic_module_type_envoy_buffer`: bytes Envoy owns.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    ptr: *const u8,
    length: usize,
}

impl EnvoyBuffer {
    const EMPTY: EnvoyBuffer = EnvoyBuffer { ptr: ptr::null(), length: 0 };
}

/// `envoy_dynamic_module_type_module_buffer`: bytes the module owns, which
/// Envoy only reads during the call.
#[repr(C)]
#[derive(Clone, Copy)]
struct ModuleBuffer {
    ptr: *const u8,
    length: usize,
}

impl ModuleBuffer {
    fn of(bytes: &[u8]) -> Self {
        ModuleBuffer { ptr: bytes.as_ptr(), length: bytes.len() }
    }
}

/// `envoy_dynamic_module_type_module_http_header`.
#[repr(C)]
struct ModuleHeader {
    key_ptr: *const u8,
    key_length: usize,
    value_ptr: *const u8,
    value_length: usize,
}

/// `envoy_dynamic_module_type_envoy_http_header`: a header Envoy owns.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyHeader {
    key_ptr: *const u8,
    key_length: usize,
    value_ptr: *const u8,
    value_length: usize,
}

impl EnvoyHeader {
    const EMPTY: EnvoyHeader =
        EnvoyHeader { key_ptr: ptr::null(), key_length: 0, value_ptr: ptr::null(), value_length: 0 };
}

/// A C enum of the ABI (passed and returned as a 32-bit integer).
pub(super) type AbiEnum = u32;

/// `envoy_dynamic_module_type_http_header_type`.
const REQUEST_HEADER: AbiEnum = 0;
const RESPONSE_HEADER: AbiEnum = 2;

/// `envoy_dynamic_module_type_metrics_result_Success`.
const METRICS_SUCCESS: AbiEnum = 0;

/// `envoy_dynamic_module_type_on_http_filter_request_headers_status`.
pub(super) const HEADERS_CONTINUE: AbiEnum = 0;
pub(super) const HEADERS_STOP_ITERATION: AbiEnum = 1;
/// Stops the headers and everything after them (body, trailers) until the
/// module resumes the stream, without buffering past Envoy's watermark: what
/// a paused request needs, as the wasm build's `Action::Pause` does.
pub(super) const HEADERS_STOP_ALL_AND_WATERMARK: AbiEnum = 4;

/// `..._body_status_Continue` and `..._trailers_status_Continue`.
pub(super) const CONTINUE: AbiEnum = 0;

/// `envoy_dynamic_module_type_http_callout_init_result_Success`.
const CALLOUT_SENT: AbiEnum = 0;

/// `envoy_dynamic_module_type_http_callout_result`: how a call ended.
const CALLOUT_SUCCESS: AbiEnum = 0;
const CALLOUT_RESET: AbiEnum = 1;
const CALLOUT_TOO_LARGE: AbiEnum = 2;

/// A log level (`envoy_dynamic_module_type_log_level`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum LogLevel {
    /// `Trace`.
    Trace = 0,
    /// `Debug`.
    Debug = 1,
    /// `Info`.
    Info = 2,
    /// `Warn`.
    Warn = 3,
    /// `Error`.
    Error = 4,
    /// `Critical`.
    Critical = 5,
}

/// An attribute of a stream (`envoy_dynamic_module_type_attribute_id`; only
/// those read, with their numbers in the enum).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum AttributeId {
    /// `source.address`: the downstream remote address, `ip:port`.
    SourceAddress = 24,
    /// `xds.cluster_name`: the matched route's upstream cluster.
    XdsClusterName = 57,
    /// `xds.route_name`: the matched route's name (empty when unnamed).
    XdsRouteName = 61,
}

/// Where metadata is read (`envoy_dynamic_module_type_metadata_source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum MetadataSource {
    /// The stream's dynamic metadata.
    Dynamic = 0,
    /// The matched route's metadata.
    Route = 1,
}

// ---------------------------------------------------------------------------
// Callbacks: Envoy's functions, only those Floodgate uses
// ---------------------------------------------------------------------------

extern "C" {
    fn envoy_dynamic_module_callback_log_enabled(level: AbiEnum) -> bool;
    fn envoy_dynamic_module_callback_log_v2(
        level: AbiEnum,
        message: ModuleBuffer,
        source_file: ModuleBuffer,
        source_line: u32,
    );

    fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: *mut c_void,
        name: ModuleBuffer,
        label_names: *const ModuleBuffer,
        label_names_length: usize,
        counter_id: *mut usize,
    ) -> AbiEnum;
    fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        config: *mut c_void,
        name: ModuleBuffer,
        label_names: *const ModuleBuffer,
        label_names_length: usize,
        gauge_id: *mut usize,
    ) -> AbiEnum;
    fn envoy_dynamic_module_callback_http_filter_increment_counter(
        filter: *mut c_void,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> AbiEnum;
    fn envoy_dynamic_module_callback_http_filter_increment_gauge(
        filter: *mut c_void,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> AbiEnum;
    fn envoy_dynamic_module_callback_http_filter_decrement_gauge(
        filter: *mut c_void,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> AbiEnum;

    fn envoy_dynamic_module_callback_http_get_headers_size(filter: *mut c_void, header_type: AbiEnum) -> usize;
    fn envoy_dynamic_module_callback_http_get_headers(
        filter: *mut c_void,
        header_type: AbiEnum,
        result: *mut EnvoyHeader,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_add_header(
        filter: *mut c_void,
        header_type: AbiEnum,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        filter: *mut c_void,
        attribute: AbiEnum,
        result: *mut EnvoyBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_get_metadata_string(
        filter: *mut c_void,
        source: AbiEnum,
        namespace: ModuleBuffer,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_get_metadata_number(
        filter: *mut c_void,
        source: AbiEnum,
        namespace: ModuleBuffer,
        key: ModuleBuffer,
        result: *mut f64,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_get_metadata_bool(
        filter: *mut c_void,
        source: AbiEnum,
        namespace: ModuleBuffer,
        key: ModuleBuffer,
        result: *mut bool,
    ) -> bool;

    fn envoy_dynamic_module_callback_http_send_response(
        filter: *mut c_void,
        status_code: u32,
        headers: *const ModuleHeader,
        headers_length: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );
    fn envoy_dynamic_module_callback_http_filter_continue_decoding(filter: *mut c_void);

    fn envoy_dynamic_module_callback_http_filter_scheduler_new(filter: *mut c_void) -> *mut c_void;
    fn envoy_dynamic_module_callback_http_filter_scheduler_commit(scheduler: *mut c_void, event_id: u64);
    fn envoy_dynamic_module_callback_http_filter_scheduler_delete(scheduler: *mut c_void);

    fn envoy_dynamic_module_callback_http_filter_http_callout(
        filter: *mut c_void,
        callout_id: *mut u64,
        cluster: ModuleBuffer,
        headers: *const ModuleHeader,
        headers_length: usize,
        body: ModuleBuffer,
        timeout_milliseconds: u64,
    ) -> AbiEnum;

    fn envoy_dynamic_module_callback_http_filter_config_http_callout(
        config: *mut c_void,
        callout_id: *mut u64,
        cluster: ModuleBuffer,
        headers: *const ModuleHeader,
        headers_length: usize,
        body: ModuleBuffer,
        timeout_milliseconds: u64,
    ) -> AbiEnum;
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(config: *mut c_void) -> *mut c_void;
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(scheduler: *mut c_void, event_id: u64);
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(scheduler: *mut c_void);
    fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        config: *mut c_void,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> AbiEnum;
    fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
        config: *mut c_void,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> AbiEnum;
}

// ---------------------------------------------------------------------------
// Safe wrappers
// ---------------------------------------------------------------------------

/// Whether Envoy logs `level` for dynamic modules.
pub fn log_enabled(level: LogLevel) -> bool {
    // SAFETY: takes a plain value; callable from any thread.
    unsafe { envoy_dynamic_module_callback_log_enabled(level as AbiEnum) }
}

/// Writes `message` to Envoy's log (`[dynamic_modules]`), at `level`,
/// naming `file` and `line` of the module's source.
pub fn log(level: LogLevel, message: &str, file: &str, line: u32) {
    // SAFETY: the buffers are valid for the call, which only reads them;
    // callable from any thread.
    unsafe {
        envoy_dynamic_module_callback_log_v2(
            level as AbiEnum,
            ModuleBuffer::of(message.as_bytes()),
            ModuleBuffer::of(file.as_bytes()),
            line,
        );
    }
}

/// The Envoy side of a configuration while it is being created
/// (`envoy_dynamic_module_on_http_filter_config_new`, on the main thread):
/// what defines its metrics.
pub struct Definer<'a> {
    config: *mut c_void,
    _creating: PhantomData<&'a ()>,
}

impl Definer<'_> {
    /// The configuration `config` Envoy is creating, for the hook's length.
    pub(super) fn during_creation(config: *mut c_void) -> Self {
        Definer { config, _creating: PhantomData }
    }

    /// Defines counter `name`; its id, or `None` when Envoy refused it.
    pub fn counter(&self, name: &str) -> Option<usize> {
        let mut id = 0;
        // SAFETY: `config` is the configuration Envoy is creating (valid for
        // this hook); the name is read during the call; `id` is writable.
        let result = unsafe {
            envoy_dynamic_module_callback_http_filter_config_define_counter(
                self.config,
                ModuleBuffer::of(name.as_bytes()),
                ptr::null(),
                0,
                &mut id,
            )
        };
        (result == METRICS_SUCCESS).then_some(id)
    }

    /// Defines gauge `name`; its id, or `None` when Envoy refused it.
    pub fn gauge(&self, name: &str) -> Option<usize> {
        let mut id = 0;
        // SAFETY: as for `counter`.
        let result = unsafe {
            envoy_dynamic_module_callback_http_filter_config_define_gauge(
                self.config,
                ModuleBuffer::of(name.as_bytes()),
                ptr::null(),
                0,
                &mut id,
            )
        };
        (result == METRICS_SUCCESS).then_some(id)
    }

    /// A scheduler that posts events to this configuration on Envoy's main
    /// thread, from any thread; `None` when Envoy gave none.
    pub fn scheduler(&self) -> Option<ConfigScheduler> {
        // SAFETY: `config` is the configuration Envoy is creating; Envoy
        // holds it in a shared pointer already, so the scheduler it makes
        // reaches it for as long as it lives.
        let scheduler = unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_new(self.config) };
        NonNull::new(scheduler).map(|scheduler| ConfigScheduler { scheduler })
    }
}

/// A configuration's Envoy side during one of its main-thread hooks (a
/// scheduled event, a call's answer): `'h` is the hook. It sends calls
/// that belong to the configuration, not to any request, and moves the
/// configuration's metrics.
pub struct ConfigEnvoy<'h> {
    config: *mut c_void,
    _hook: PhantomData<&'h ()>,
}

impl ConfigEnvoy<'_> {
    /// Configuration `config`, for the length of one of its hooks.
    pub(super) fn during_hook(config: *mut c_void) -> Self {
        ConfigEnvoy { config, _hook: PhantomData }
    }

    /// Sends an HTTP call to `cluster` (`headers` with `:method`, `:path`
    /// and `:authority`), answered in the configuration's callout hook on
    /// the main thread; its id, or why Envoy did not send it.
    pub fn http_callout(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u64,
    ) -> Result<u64, String> {
        let headers = module_headers(headers);
        let mut id = 0;
        // SAFETY: `config` is this hook's configuration; every buffer (the
        // header array and what it points into) is read during the call; `id`
        // is writable.
        let result = unsafe {
            envoy_dynamic_module_callback_http_filter_config_http_callout(
                self.config,
                &mut id,
                ModuleBuffer::of(cluster.as_bytes()),
                headers.as_ptr(),
                headers.len(),
                ModuleBuffer::of(body),
                timeout_ms,
            )
        };
        callout_sent(result, id)
    }

    /// Adds `by` to counter `id` (defined by this configuration).
    pub fn increment_counter(&self, id: usize, by: u64) {
        // SAFETY: `config` is this hook's configuration, which defined `id`; no labels.
        unsafe {
            envoy_dynamic_module_callback_http_filter_config_increment_counter(self.config, id, ptr::null(), 0, by)
        };
    }

    /// Sets gauge `id` (defined by this configuration) to `value`.
    pub fn set_gauge(&self, id: usize, value: u64) {
        // SAFETY: as for `increment_counter`.
        unsafe { envoy_dynamic_module_callback_http_filter_config_set_gauge(self.config, id, ptr::null(), 0, value) };
    }
}

/// Header pairs as the ABI takes them, pointing into `headers`.
fn module_headers(headers: &[(&str, &str)]) -> Vec<ModuleHeader> {
    headers
        .iter()
        .map(|(name, value)| ModuleHeader {
            key_ptr: name.as_ptr(),
            key_length: name.len(),
            value_ptr: value.as_ptr(),
            value_length: value.len(),
        })
        .collect()
}

/// A callout's id, or why Envoy did not send it
/// (`envoy_dynamic_module_type_http_callout_init_result`).
fn callout_sent(result: AbiEnum, id: u64) -> Result<u64, String> {
    match result {
        CALLOUT_SENT => Ok(id),
        1 => Err("Envoy refused it: a required header is missing".into()),
        2 => Err("Envoy has no such cluster".into()),
        3 => Err("Envoy refused it: its id is in use".into()),
        4 => Err("Envoy could not create the request (no healthy host?)".into()),
        other => Err(format!("Envoy refused it ({other})")),
    }
}

/// An HTTP call's answer, as Envoy hands it to a callout hook: for the
/// length of the hook.
pub struct CalloutAnswer<'h> {
    result: AbiEnum,
    headers: &'h [EnvoyHeader],
    body: &'h [EnvoyBuffer],
}

/// How a call's answer came back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answered<'h> {
    /// A response: its status (`None` when absent or unreadable) and its
    /// body, in Envoy's chunks.
    Response {
        /// `:status`.
        status: Option<u16>,
        /// The body's chunks, in order.
        body: Vec<&'h [u8]>,
    },
    /// The stream was reset (no response).
    Reset,
    /// The response was larger than Envoy's buffer for it.
    TooLarge,
}

impl<'h> CalloutAnswer<'h> {
    /// The answer Envoy lends: `result`, `n_headers` headers at `headers`
    /// and `n_chunks` body chunks at `chunks`.
    ///
    /// # Safety
    /// The pointers must be what Envoy passed to the hook (null, or valid
    /// for the given counts), for the length of the hook.
    pub(super) unsafe fn lent(
        result: AbiEnum,
        headers: *const EnvoyHeader,
        n_headers: usize,
        chunks: *const EnvoyBuffer,
        n_chunks: usize,
    ) -> Self {
        // SAFETY: the caller's contract.
        let headers = unsafe { slice_or_empty(headers, n_headers) };
        // SAFETY: the caller's contract.
        let body = unsafe { slice_or_empty(chunks, n_chunks) };
        CalloutAnswer { result, headers, body }
    }

    /// What came back.
    pub fn read(&self) -> Answered<'h> {
        match self.result {
            CALLOUT_SUCCESS => {
                let status = self.headers.iter().find_map(|header| {
                    // SAFETY: Envoy lends each header's bytes for the hook.
                    let (key, value) = unsafe {
                        (
                            lent(true, buffer(header.key_ptr, header.key_length)),
                            lent(true, buffer(header.value_ptr, header.value_length)),
                        )
                    };
                    (key == Some(b":status")).then(|| value.and_then(|v| std::str::from_utf8(v).ok()?.parse().ok()))?
                });
                // SAFETY: Envoy lends each chunk for the hook.
                let body = self.body.iter().filter_map(|chunk| unsafe { lent(true, *chunk) }).collect();
                Answered::Response { status, body }
            }
            CALLOUT_RESET => Answered::Reset,
            CALLOUT_TOO_LARGE => Answered::TooLarge,
            _ => Answered::Reset,
        }
    }
}

fn buffer(ptr: *const u8, length: usize) -> EnvoyBuffer {
    EnvoyBuffer { ptr, length }
}

/// `n` items at `items`, or none when `items` is null or `n` is zero.
///
/// # Safety
/// A non-null `items` must point to `n` valid items for the caller's borrow.
unsafe fn slice_or_empty<'a, T>(items: *const T, n: usize) -> &'a [T] {
    if items.is_null() || n == 0 {
        return &[];
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(items, n) }
}

/// A configuration's scheduler: [`ConfigScheduler::commit`] makes Envoy run
/// the configuration's `envoy_dynamic_module_on_http_filter_config_scheduled`
/// on its main thread, from any thread; a no-op once the configuration is
/// gone. Deleted when dropped.
pub struct ConfigScheduler {
    scheduler: NonNull<c_void>,
}

// SAFETY: the ABI's commit posts to the main thread's dispatcher, safe from
// any thread (the same as a stream's scheduler); deleting it frees Envoy's
// small object holding a weak reference to the configuration, which no
// other thread uses by then (the owner drops it once).
unsafe impl Send for ConfigScheduler {}
// SAFETY: `commit` is the only method taking `&self`, and it is thread-safe.
unsafe impl Sync for ConfigScheduler {}

impl ConfigScheduler {
    /// Asks Envoy to run the configuration's scheduled hook with `event`.
    pub fn commit(&self, event: u64) {
        // SAFETY: the scheduler is alive until dropped.
        unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_commit(self.scheduler.as_ptr(), event) }
    }
}

impl Drop for ConfigScheduler {
    fn drop(&mut self) {
        // SAFETY: created by `config_scheduler_new`, deleted once, here.
        unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_delete(self.scheduler.as_ptr()) }
    }
}

/// One stream's Envoy side, during one of its event hooks: `'h` is the hook.
/// Reading methods take `&self` and lend Envoy's bytes for as long as that
/// borrow; methods that may change what was lent (a header added, a reply
/// sent, the stream resumed) take `&mut self`, so nothing lent outlives them.
pub struct Filter<'h> {
    envoy: *mut c_void,
    _hook: PhantomData<&'h ()>,
}

impl Filter<'_> {
    /// Stream `envoy`, for the length of one of its hooks.
    pub(super) fn during_hook(envoy: *mut c_void) -> Self {
        Filter { envoy, _hook: PhantomData }
    }

    /// Lends the request headers (pseudo-headers such as `:path` too, names
    /// in lower case) to `visit`, in Envoy's order, so the first value of a
    /// repeated header comes first, until `visit` returns false. The whole
    /// map is read in two calls: Envoy's lookup of one header by name costs
    /// about as much as copying out every header of a typical request.
    pub fn each_request_header<'s>(&'s self, mut visit: impl FnMut(&'s [u8], &'s [u8]) -> bool) {
        /// Requests with up to this many headers are read into the stack.
        const ON_STACK: usize = 32;
        // SAFETY: `envoy` is this hook's stream.
        let count = unsafe { envoy_dynamic_module_callback_http_get_headers_size(self.envoy, REQUEST_HEADER) };
        // Not zeroed first: Envoy writes every one of the `count` it reads.
        let mut on_stack = [MaybeUninit::<EnvoyHeader>::uninit(); ON_STACK];
        let mut on_heap = Vec::new();
        let room: *mut EnvoyHeader = match on_stack.get_mut(..count) {
            Some(headers) => headers.as_mut_ptr().cast(),
            None => {
                on_heap.resize(count, EnvoyHeader::EMPTY);
                on_heap.as_mut_ptr()
            }
        };
        // SAFETY: `room` has space for the `count` headers Envoy has just
        // counted (nothing changes the map between the two calls: both run
        // in this hook, on its worker), and Envoy writes each of them when
        // it answers true. What Envoy lends stays valid until the hook ends
        // or a header is changed, which `&mut self` methods rule out while
        // `&self` is borrowed.
        if !unsafe { envoy_dynamic_module_callback_http_get_headers(self.envoy, REQUEST_HEADER, room) } {
            return;
        }
        // SAFETY: the `count` headers at `room` are written (above).
        let headers = unsafe { std::slice::from_raw_parts(room.cast_const(), count) };
        for header in headers {
            // SAFETY: as above.
            let (name, value) = unsafe {
                (
                    lent(true, buffer(header.key_ptr, header.key_length)),
                    lent(true, buffer(header.value_ptr, header.value_length)),
                )
            };
            if let (Some(name), Some(value)) = (name, value) {
                if !visit(name, value) {
                    return;
                }
            }
        }
    }

    /// A string attribute of the stream; `None` when Envoy has none.
    pub fn attribute(&self, id: AttributeId) -> Option<&[u8]> {
        let mut value = EnvoyBuffer::EMPTY;
        // SAFETY: as for `each_request_header`.
        let found = unsafe {
            envoy_dynamic_module_callback_http_filter_get_attribute_string(self.envoy, id as AbiEnum, &mut value)
        };
        // SAFETY: as for `each_request_header`.
        unsafe { lent(found, value) }
    }

    /// The string at `key` in namespace `namespace` of the `source`
    /// metadata; `None` when absent or not a string.
    pub fn metadata_string(&self, source: MetadataSource, namespace: &str, key: &str) -> Option<&[u8]> {
        let mut value = EnvoyBuffer::EMPTY;
        // SAFETY: as for `each_request_header`.
        let found = unsafe {
            envoy_dynamic_module_callback_http_get_metadata_string(
                self.envoy,
                source as AbiEnum,
                ModuleBuffer::of(namespace.as_bytes()),
                ModuleBuffer::of(key.as_bytes()),
                &mut value,
            )
        };
        // SAFETY: as for `each_request_header`.
        unsafe { lent(found, value) }
    }

    /// The number at `key` in namespace `namespace` of the `source`
    /// metadata; `None` when absent or not a number.
    pub fn metadata_number(&self, source: MetadataSource, namespace: &str, key: &str) -> Option<f64> {
        let mut value = 0.0;
        // SAFETY: `envoy` is this hook's stream; the buffers are read during
        // the call; `value` is writable.
        let found = unsafe {
            envoy_dynamic_module_callback_http_get_metadata_number(
                self.envoy,
                source as AbiEnum,
                ModuleBuffer::of(namespace.as_bytes()),
                ModuleBuffer::of(key.as_bytes()),
                &mut value,
            )
        };
        found.then_some(value)
    }

    /// The boolean at `key` in namespace `namespace` of the `source`
    /// metadata; `None` when absent or not a boolean.
    pub fn metadata_bool(&self, source: MetadataSource, namespace: &str, key: &str) -> Option<bool> {
        let mut value = false;
        // SAFETY: as for `metadata_number`.
        let found = unsafe {
            envoy_dynamic_module_callback_http_get_metadata_bool(
                self.envoy,
                source as AbiEnum,
                ModuleBuffer::of(namespace.as_bytes()),
                ModuleBuffer::of(key.as_bytes()),
                &mut value,
            )
        };
        found.then_some(value)
    }

    /// Adds `by` to counter `id` (defined by this stream's configuration).
    pub fn increment_counter(&self, id: usize, by: u64) {
        // SAFETY: `envoy` is this hook's stream, whose configuration defined
        // `id`; no labels.
        unsafe { envoy_dynamic_module_callback_http_filter_increment_counter(self.envoy, id, ptr::null(), 0, by) };
    }

    /// Moves gauge `id` (defined by this stream's configuration) by `change`.
    pub fn move_gauge(&self, id: usize, change: i64) {
        let by = change.unsigned_abs();
        // SAFETY: as for `increment_counter`.
        unsafe {
            if change > 0 {
                envoy_dynamic_module_callback_http_filter_increment_gauge(self.envoy, id, ptr::null(), 0, by);
            } else if change < 0 {
                envoy_dynamic_module_callback_http_filter_decrement_gauge(self.envoy, id, ptr::null(), 0, by);
            }
        }
    }

    /// Adds a header to the response on its way to the client.
    ///
    /// Add, as the wasm build does (an upstream's own header of the name
    /// stays): the ABI's set also looks the name up first and costs Envoy
    /// about twice as much. Only from the response's own hook: during the
    /// request's, Envoy has no response map yet and refuses the header; and
    /// Envoy 1.40's ABI has no call that adds several at once.
    pub fn add_response_header(&mut self, name: &str, value: &[u8]) -> bool {
        // SAFETY: `envoy` is this hook's stream; the buffers are read during
        // the call.
        unsafe {
            envoy_dynamic_module_callback_http_add_header(
                self.envoy,
                RESPONSE_HEADER,
                ModuleBuffer::of(name.as_bytes()),
                ModuleBuffer::of(value),
            )
        }
    }

    /// Answers the request with `status`, `headers` and `body` instead of
    /// sending it upstream. Envoy may complete the stream before this
    /// returns (`envoy_dynamic_module_on_http_filter_stream_complete` runs
    /// inline): the caller holds no borrow of the stream's state across it.
    pub fn send_response<'n, 'v>(
        &mut self,
        status: u32,
        headers: impl Iterator<Item = (&'n str, &'v str)>,
        body: &[u8],
        details: &str,
    ) {
        let headers: Vec<(&str, &str)> = headers.collect();
        let headers = module_headers(&headers);
        // SAFETY: `envoy` is this hook's stream; every buffer (the header
        // array and the strings it points into, which outlive the call) is
        // read during the call only.
        unsafe {
            envoy_dynamic_module_callback_http_send_response(
                self.envoy,
                status,
                headers.as_ptr(),
                headers.len(),
                ModuleBuffer::of(body),
                ModuleBuffer::of(details.as_bytes()),
            );
        }
    }

    /// Resumes a request its headers hook paused. The rest of the filter
    /// chain may run inline, hooks of this stream included.
    pub fn continue_decoding(&mut self) {
        // SAFETY: `envoy` is this hook's stream.
        unsafe { envoy_dynamic_module_callback_http_filter_continue_decoding(self.envoy) }
    }

    /// Sends an HTTP call to `cluster` on behalf of this stream (`headers`
    /// with `:method`, `:path` and `:authority`), answered in the stream's
    /// callout hook on its worker while the stream lives (Envoy cancels it
    /// when the stream goes); its id, or why Envoy did not send it.
    pub fn http_callout(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u64,
    ) -> Result<u64, String> {
        let headers = module_headers(headers);
        let mut id = 0;
        // SAFETY: `envoy` is this hook's stream; every buffer is read during
        // the call; `id` is writable.
        let result = unsafe {
            envoy_dynamic_module_callback_http_filter_http_callout(
                self.envoy,
                &mut id,
                ModuleBuffer::of(cluster.as_bytes()),
                headers.as_ptr(),
                headers.len(),
                ModuleBuffer::of(body),
                timeout_ms,
            )
        };
        callout_sent(result, id)
    }

    /// A scheduler that wakes this stream on its worker from any thread;
    /// `None` when Envoy gave none.
    pub fn scheduler(&mut self) -> Option<Scheduler> {
        // SAFETY: `envoy` is this hook's stream.
        let scheduler = unsafe { envoy_dynamic_module_callback_http_filter_scheduler_new(self.envoy) };
        NonNull::new(scheduler).map(|scheduler| Scheduler { scheduler })
    }
}

/// Turns what a getter lent into a slice: `None` when it found nothing.
///
/// # Safety
/// `value` must be what Envoy just lent, valid for the caller's borrow.
pub(super) unsafe fn lent<'a>(found: bool, value: EnvoyBuffer) -> Option<&'a [u8]> {
    if !found {
        return None;
    }
    if value.ptr.is_null() || value.length == 0 {
        return Some(&[]);
    }
    // SAFETY: Envoy lends `length` readable bytes at `ptr` (the caller's
    // contract).
    Some(unsafe { std::slice::from_raw_parts(value.ptr, value.length) })
}

/// A stream's scheduler: [`Scheduler::wake`] makes Envoy run the stream's
/// `envoy_dynamic_module_on_http_filter_scheduled` on its worker, from any
/// thread; a no-op once the stream is gone. Deleted when dropped.
pub struct Scheduler {
    scheduler: NonNull<c_void>,
}

// SAFETY: the ABI documents `scheduler_commit` as safe from any thread;
// deleting it only frees Envoy's small object holding a weak reference to
// the stream and its dispatcher, which no other thread uses by then (the
// owner drops the last reference).
unsafe impl Send for Scheduler {}
// SAFETY: `wake` is the only method taking `&self`, and it is thread-safe.
unsafe impl Sync for Scheduler {}

impl Scheduler {
    /// Asks Envoy to run the stream's scheduled hook with `event`.
    pub fn wake(&self, event: u64) {
        // SAFETY: the scheduler is alive until dropped.
        unsafe { envoy_dynamic_module_callback_http_filter_scheduler_commit(self.scheduler.as_ptr(), event) }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // SAFETY: created by `scheduler_new`, deleted once, here.
        unsafe { envoy_dynamic_module_callback_http_filter_scheduler_delete(self.scheduler.as_ptr()) }
    }
}
