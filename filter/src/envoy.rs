//! The real host: [`Host`] over proxy-wasm's ABI, the only code that calls
//! it. Calls go through `proxy_wasm::hostcalls`, which return `Result`s,
//! rather than the SDK's trait helpers, several of which unwrap; a property
//! read and the local reply go to the ABI itself, to spare the per-call
//! allocations of the SDK's wrappers.

use std::cell::RefCell;
use std::time::{Duration, UNIX_EPOCH};

use floodgate_core::headers::HeaderBlock;
use floodgate_core::store::Cas;
use floodgate_core::time::Nanos;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType, Status};

use crate::host::Host;

/// Envoy, through proxy-wasm's ABI.
#[derive(Default)]
pub struct EnvoyHost {
    /// A local reply's serialized headers, kept between replies.
    reply_buffer: RefCell<Vec<u8>>,
}

impl Host for EnvoyHost {
    fn request_header(&self, name: &str) -> Result<Option<Vec<u8>>, Status> {
        hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
    }

    fn property(&self, path: &'static [u8]) -> Result<Option<Vec<u8>>, Status> {
        get_property(path)
    }

    fn add_response_header(&self, name: &str, value: &str) -> Result<(), Status> {
        hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value)
    }

    /// The headers are serialized into a buffer the worker keeps between
    /// replies. (The SDK's `send_http_response` allocates a buffer per call,
    /// and panics on any status but `Ok`.)
    fn send_local_reply(&self, status: u32, headers: &HeaderBlock, body: &[u8]) -> Result<(), Status> {
        // A reply in progress cannot be re-entered: the host calls back
        // nothing of this VM while it sends one.
        let Ok(mut buffer) = self.reply_buffer.try_borrow_mut() else { return Err(Status::InternalFailure) };
        serialize_map(headers.iter(), &mut buffer);
        // SAFETY: every pointer is valid for its length for the whole call,
        // and the host only reads them.
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

    fn set_effective_context(&self, context_id: u32) -> Result<(), Status> {
        hostcalls::set_effective_context(context_id)
    }

    fn resume_request(&self) -> Result<(), Status> {
        hostcalls::resume_http_request()
    }

    fn get_shared_data(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<Cas>), Status> {
        hostcalls::get_shared_data(key)
    }

    fn set_shared_data(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), Status> {
        hostcalls::set_shared_data(key, Some(value), cas)
    }

    fn register_queue(&self, name: &str) -> Result<u32, Status> {
        hostcalls::register_shared_queue(name)
    }

    fn enqueue(&self, queue: u32) -> Result<(), Status> {
        hostcalls::enqueue_shared_queue(queue, None)
    }

    fn dequeue(&self, queue: u32) -> Result<Option<Vec<u8>>, Status> {
        hostcalls::dequeue_shared_queue(queue)
    }

    fn dispatch_call(
        &self,
        cluster: &str,
        headers: Vec<(&str, &str)>,
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<u32, Status> {
        hostcalls::dispatch_http_call(cluster, headers, body, vec![], timeout)
    }

    fn call_answer_header(&self, name: &str) -> Result<Option<Vec<u8>>, Status> {
        hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, name)
    }

    fn call_answer_body(&self, size: usize) -> Result<Option<Vec<u8>>, Status> {
        hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, size)
    }

    fn plugin_configuration(&self) -> Result<Option<Vec<u8>>, Status> {
        hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
    }

    /// Under `wasm32-wasip1`, `SystemTime::now()` is not the host clock:
    /// this is.
    fn current_time(&self) -> Result<Nanos, Status> {
        let since_epoch = hostcalls::get_current_time()?.duration_since(UNIX_EPOCH).unwrap_or_default();
        Ok(Nanos::from(since_epoch))
    }

    fn set_tick_period(&self, period: Duration) -> Result<(), Status> {
        hostcalls::set_tick_period(period)
    }

    fn define_metric(&self, kind: MetricType, name: &str) -> Result<u32, Status> {
        hostcalls::define_metric(kind, name)
    }

    fn increment_metric(&self, id: u32, offset: i64) -> Result<(), Status> {
        hostcalls::increment_metric(id, offset)
    }

    fn record_metric(&self, id: u32, value: u64) -> Result<(), Status> {
        hostcalls::record_metric(id, value)
    }

    fn done(&self) -> Result<(), Status> {
        hostcalls::done()
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
/// per call.
fn get_property(path: &'static [u8]) -> Result<Option<Vec<u8>>, Status> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: the path is valid for its length; the host writes a buffer it
    // allocated through the SDK's `proxy_on_memory_allocate` (a Vec of
    // exactly `size` bytes, forgotten) into `data` and `size`.
    match unsafe { proxy_get_property(path.as_ptr(), path.len(), &mut data, &mut size) } {
        // SAFETY: as above: ours to own, as the SDK's own getters do.
        Status::Ok if !data.is_null() => Ok(Some(unsafe { Vec::from_raw_parts(data, size, size) })),
        Status::Ok => Ok(None),
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
