//! An HTTP filter for Envoy's dynamic module ABI (Envoy 1.40, `v0.2.0`)
//! that does nothing: every request continues untouched. The benchmark
//! loads it as variant (nc), the floor cost of any native filter (Envoy's
//! `dynamic_modules` filter and one hook call per request event), as the
//! no-op wasm filter (c) is the wasm build's: Floodgate's native build
//! costs what it adds on top of this.
//!
//! It exports exactly the hooks Envoy 1.40 requires of an HTTP filter
//! module (`native/ABI.md`; Envoy refuses a module that lacks one, naming
//! it), touches no argument, allocates nothing (the configuration and
//! every stream share one static object) and calls nothing of Envoy's.

use std::ffi::c_void;

/// The ABI version the module was built for; Envoy matches it at load.
const ABI_VERSION: &[u8] = b"v0.2.0\0";

/// Request and response events: continue.
const CONTINUE: u32 = 0;

/// The one object Envoy hands back to every hook: a configuration or a
/// stream must be non-null, and this one holds nothing.
static NOTHING: u8 = 0;

fn nothing() -> *const c_void {
    std::ptr::from_ref(&NOTHING).cast()
}

/// Envoy's bytes lent for a call (`envoy_dynamic_module_type_envoy_buffer`).
#[repr(C)]
pub struct EnvoyBuffer {
    ptr: *const u8,
    length: usize,
}

/// Loads the module: its ABI version.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const u8 {
    ABI_VERSION.as_ptr()
}

/// A configuration: accepted, whatever it says.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    _: *mut c_void,
    _: EnvoyBuffer,
    _: EnvoyBuffer,
) -> *const c_void {
    nothing()
}

/// A configuration goes: nothing to free.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(_: *const c_void) {}

/// A stream: the shared object.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(_: *const c_void, _: *mut c_void) -> *const c_void {
    nothing()
}

/// Request headers: continue.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    _: *mut c_void,
    _: *const c_void,
    _: bool,
) -> u32 {
    CONTINUE
}

/// Request body: continue.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(_: *mut c_void, _: *const c_void, _: bool) -> u32 {
    CONTINUE
}

/// Request trailers: continue.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(_: *mut c_void, _: *const c_void) -> u32 {
    CONTINUE
}

/// Response headers: continue.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    _: *mut c_void,
    _: *const c_void,
    _: bool,
) -> u32 {
    CONTINUE
}

/// Response body: continue.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(_: *mut c_void, _: *const c_void, _: bool) -> u32 {
    CONTINUE
}

/// Response trailers: continue.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(_: *mut c_void, _: *const c_void) -> u32 {
    CONTINUE
}

/// A stream's scheduled event: it schedules none.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(_: *mut c_void, _: *const c_void, _: u64) {}

/// A stream completed: nothing to do.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(_: *mut c_void, _: *const c_void) {}

/// A stream goes: nothing to free.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(_: *const c_void) {}

/// A callout's answer: it makes none.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    _: *mut c_void,
    _: *const c_void,
    _: u64,
    _: u32,
    _: *const c_void,
    _: usize,
    _: *const c_void,
    _: usize,
) {
}

/// A streamed callout's headers: it starts none.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _: *mut c_void,
    _: *const c_void,
    _: u64,
    _: *const c_void,
    _: usize,
    _: bool,
) {
}

/// A streamed callout's data: it starts none.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _: *mut c_void,
    _: *const c_void,
    _: u64,
    _: *const c_void,
    _: usize,
    _: bool,
) {
}

/// A streamed callout's trailers: it starts none.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _: *mut c_void,
    _: *const c_void,
    _: u64,
    _: *const c_void,
    _: usize,
) {
}

/// A streamed callout completed: it starts none.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(_: *mut c_void, _: *const c_void, _: u64) {}

/// A streamed callout was reset: it starts none.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _: *mut c_void,
    _: *const c_void,
    _: u64,
    _: u32,
) {
}

/// The downstream's write buffer is full: nothing to do.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _: *mut c_void,
    _: *const c_void,
) {
}

/// The downstream's write buffer drained: nothing to do.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _: *mut c_void,
    _: *const c_void,
) {
}
