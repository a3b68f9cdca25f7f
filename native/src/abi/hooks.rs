//! The module's event hooks: what Envoy calls. Each turns its raw pointers
//! into the safe types of `callbacks`, hands them to the safe code, and
//! catches any panic there.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use super::callbacks::{
    lent, AbiEnum, CalloutAnswer, ConfigEnvoy, Definer, EnvoyBuffer, EnvoyHeader, Filter, ABI_VERSION, CONTINUE,
    HEADERS_CONTINUE, HEADERS_STOP_ALL_AND_WATERMARK, HEADERS_STOP_ITERATION,
};
use crate::config::FilterConfig;
use crate::stream::{HeadersStatus, Stream};

// ---------------------------------------------------------------------------
// Event hooks: the module's functions Envoy calls
// ---------------------------------------------------------------------------

/// Runs a hook's body, and turns a panic into `otherwise`: a panic must
/// never unwind into Envoy (the module's panic hook has logged it).
fn guard<T>(otherwise: T, body: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(otherwise)
}

/// A stream's module object, from the pointer Envoy hands back.
///
/// # Safety
/// `module` must be a pointer `envoy_dynamic_module_on_http_filter_new`
/// returned and `..._destroy` has not yet freed.
unsafe fn stream<'a>(module: *const c_void) -> &'a Stream {
    // SAFETY: the caller's contract; only shared references are made, since
    // hooks of one stream may nest (one may complete the stream inline).
    unsafe { &*(module as *const Stream) }
}

/// The Envoy side of a stream during a hook.
fn filter<'h>(envoy: *mut c_void) -> Filter<'h> {
    Filter::during_hook(envoy)
}

/// Loads the module: installs the log and the panic hook; returns the ABI
/// version it was built for.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const u8 {
    guard(ptr::null(), || {
        crate::log::install();
        log::info!("floodgate: native module built for Envoy 1.40's dynamic module ABI v0.2.0");
        ABI_VERSION.as_ptr()
    })
}

/// A configuration is created (main thread): parsed, checked and prepared,
/// or refused (null).
///
/// # Safety
/// Envoy passes its configuration object and two buffers valid for the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    config_envoy: *mut c_void,
    name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> *const c_void {
    guard(ptr::null(), || {
        // SAFETY: Envoy lends both buffers for this call.
        let (name, config) = unsafe { (lent(true, name).unwrap_or_default(), lent(true, config).unwrap_or_default()) };
        let definer = Definer::during_creation(config_envoy);
        match FilterConfig::new(&definer, name, config) {
            Some(config) => Box::into_raw(Box::new(config)) as *const c_void,
            None => ptr::null(),
        }
    })
}

/// A configuration is destroyed: no stream of it is left.
///
/// # Safety
/// `config` is what `envoy_dynamic_module_on_http_filter_config_new` returned.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: *const c_void) {
    guard((), || {
        // SAFETY: made by `Box::into_raw` in `..._config_new`, freed once, here.
        drop(unsafe { Box::from_raw(config as *mut FilterConfig) });
    });
}

/// A configuration's scheduled event (main thread): its calls to the quota
/// service are sent, its timer's work done.
///
/// # Safety
/// `config` is what `envoy_dynamic_module_on_http_filter_config_new` returned.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    config_envoy: *mut c_void,
    config: *const c_void,
    event: u64,
) {
    guard((), || {
        // SAFETY: Envoy calls this only while the configuration lives.
        let config = unsafe { &*(config as *const FilterConfig) };
        config.on_scheduled(&ConfigEnvoy::during_hook(config_envoy), event);
    });
}

/// The answer to one of a configuration's calls (main thread).
///
/// # Safety
/// `config` is what `envoy_dynamic_module_on_http_filter_config_new`
/// returned; the headers and body chunks are Envoy's, valid for the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    config_envoy: *mut c_void,
    config: *const c_void,
    callout_id: u64,
    result: AbiEnum,
    headers: *const EnvoyHeader,
    n_headers: usize,
    body: *const EnvoyBuffer,
    n_chunks: usize,
) {
    guard((), || {
        // SAFETY: Envoy calls this only while the configuration lives.
        let config = unsafe { &*(config as *const FilterConfig) };
        // SAFETY: Envoy lends the headers and chunks for this call.
        let answer = unsafe { CalloutAnswer::lent(result, headers, n_headers, body, n_chunks) };
        config.on_answer(&ConfigEnvoy::during_hook(config_envoy), callout_id, &answer);
    });
}

/// A stream starts (its worker thread): its module object.
///
/// # Safety
/// `config` is what `envoy_dynamic_module_on_http_filter_config_new` returned.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: *const c_void,
    _filter_envoy: *mut c_void,
) -> *const c_void {
    guard(ptr::null(), || {
        // SAFETY: Envoy keeps the configuration alive while it has streams.
        let config = unsafe { &*(config as *const FilterConfig) };
        Box::into_raw(Stream::boxed(config)) as *const c_void
    })
}

/// The request's headers: the decision.
///
/// # Safety
/// `module` is this stream's object.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    filter_envoy: *mut c_void,
    module: *const c_void,
    _end_of_stream: bool,
) -> AbiEnum {
    guard(HEADERS_CONTINUE, || {
        // SAFETY: the caller's contract.
        let stream = unsafe { stream(module) };
        match stream.on_request_headers(&mut filter(filter_envoy)) {
            HeadersStatus::Continue => HEADERS_CONTINUE,
            HeadersStatus::Replied => HEADERS_STOP_ITERATION,
            HeadersStatus::Paused => HEADERS_STOP_ALL_AND_WATERMARK,
        }
    })
}

/// The response's headers: the rate-limit headers are added.
///
/// # Safety
/// `module` is this stream's object.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    filter_envoy: *mut c_void,
    module: *const c_void,
    _end_of_stream: bool,
) -> AbiEnum {
    guard(HEADERS_CONTINUE, || {
        // SAFETY: the caller's contract.
        let stream = unsafe { stream(module) };
        stream.on_response_headers(&mut filter(filter_envoy));
        HEADERS_CONTINUE
    })
}

/// The stream's scheduler woke it (a paused request's delay is over).
///
/// # Safety
/// `module` is this stream's object.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    filter_envoy: *mut c_void,
    module: *const c_void,
    event: u64,
) {
    guard((), || {
        // SAFETY: the caller's contract.
        let stream = unsafe { stream(module) };
        stream.on_scheduled(&mut filter(filter_envoy), event);
    });
}

/// The answer to one of the stream's calls (its check), on its worker.
///
/// # Safety
/// `module` is this stream's object; the headers and body chunks are
/// Envoy's, valid for the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    filter_envoy: *mut c_void,
    module: *const c_void,
    callout_id: u64,
    result: AbiEnum,
    headers: *const EnvoyHeader,
    n_headers: usize,
    body: *const EnvoyBuffer,
    n_chunks: usize,
) {
    guard((), || {
        // SAFETY: the caller's contract.
        let stream = unsafe { stream(module) };
        // SAFETY: Envoy lends the headers and chunks for this call.
        let answer = unsafe { CalloutAnswer::lent(result, headers, n_headers, body, n_chunks) };
        stream.on_answer(&mut filter(filter_envoy), callout_id, &answer);
    });
}

/// The stream ended (completed, reset or failed): what it holds goes back.
///
/// # Safety
/// `module` is this stream's object.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    filter_envoy: *mut c_void,
    module: *const c_void,
) {
    guard((), || {
        // SAFETY: the caller's contract.
        let stream = unsafe { stream(module) };
        stream.on_complete(&mut filter(filter_envoy));
    });
}

/// The stream's module object is freed (never while one of its hooks runs):
/// kept for a next stream of this thread.
///
/// # Safety
/// `module` is this stream's object, freed once, here.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(module: *const c_void) {
    guard((), || {
        // SAFETY: made by `Box::into_raw` in `..._filter_new`; no hook of
        // the stream is on the stack, so no reference to it remains.
        Stream::recycle(unsafe { Box::from_raw(module as *mut Stream) });
    });
}

// Hooks Envoy 1.40 requires of every HTTP filter module but Floodgate does
// not use: a body or trailers pass on, and it starts no streamed callouts
// (its calls are one-shot). None touches its arguments, so none can panic.

/// Request body: passes on.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    _: *mut c_void,
    _: *const c_void,
    _: bool,
) -> AbiEnum {
    CONTINUE
}

/// Request trailers: pass on.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(_: *mut c_void, _: *const c_void) -> AbiEnum {
    CONTINUE
}

/// Response body: passes on.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    _: *mut c_void,
    _: *const c_void,
    _: bool,
) -> AbiEnum {
    CONTINUE
}

/// Response trailers: pass on.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(_: *mut c_void, _: *const c_void) -> AbiEnum {
    CONTINUE
}

/// A streamed callout's headers: Floodgate starts none.
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

/// A streamed callout's data: Floodgate starts none.
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

/// A streamed callout's trailers: Floodgate starts none.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _: *mut c_void,
    _: *const c_void,
    _: u64,
    _: *const c_void,
    _: usize,
) {
}

/// A streamed callout completed: Floodgate starts none.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(_: *mut c_void, _: *const c_void, _: u64) {}

/// A streamed callout was reset: Floodgate starts none.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _: *mut c_void,
    _: *const c_void,
    _: u64,
    _: AbiEnum,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A panic in a hook's body never leaves the hook: it answers as told.
    #[test]
    fn a_hook_that_panics_answers_its_fallback() {
        assert_eq!(guard(HEADERS_STOP_ITERATION, || HEADERS_CONTINUE), HEADERS_CONTINUE);
        let caught = guard(HEADERS_CONTINUE, || -> AbiEnum { panic!("a bug in the module") });
        assert_eq!(caught, HEADERS_CONTINUE);
    }
}
