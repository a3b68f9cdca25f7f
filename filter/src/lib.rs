//! Floodgate's Envoy HTTP filter.
//!
//! This crate is the only code that talks to the proxy: it reads the plugin
//! configuration, adapts Envoy's shared data, headers, clock and metrics to
//! the traits of `floodgate-core`, and turns verdicts into responses. Every
//! decision is made in the core; here a verdict becomes "go on", "answer
//! limited", or "pause" — until a shaper's delay is over, a lease pool is
//! refilled, or the quota service answers a check — and a request's permit
//! is given back when its stream ends.
//!
//! Each worker's root context finishes the requests it paused (Envoy lets
//! only that worker resume them) and owns every call to the quota service
//! but checks, so answers arrive at the root whatever becomes of the
//! request that caused them. The SDK delivers an answer to the context that
//! was *active* when the call was made (switching the effective context
//! does not change that), so a request's handler does not dispatch a lease
//! itself: it posts to its worker's own shared queue, which Envoy runs on
//! the same worker at the event loop's next turn, in the root context, and
//! the root dispatches at once. A check is the one call that is its
//! request's alone: the handler dispatches it, its answer comes back to the
//! request's context (no hop through the root either way), and Envoy
//! cancels it if the request goes first. A paused request is finished from
//! the handler of the answer that frees it. So no tick lies between a
//! request and the network, nor between an answer and the request; ticks
//! are for timers: a shaper's delays, the end of a request's wait, probes
//! of a failing service, refills another worker asked for, and flushing
//! counts.
//!
//! The crate by concern:
//! - `root`: a configuration's root context on one VM — the plugin, the tick,
//!   the calls requests posted, the answers to them;
//! - `plugin`: what a configuration's requests on one worker share, and the
//!   host of a request's path through it (decide, act on the outcome,
//!   release: `floodgate_filter_common::requests`, shared with the native
//!   build);
//! - `outcome` (from `floodgate-filter-common`, shared with the native
//!   build): the one decision of what becomes of a request — go on, answer
//!   limited, pause, resume, or give back because its client left;
//! - `http`: one request's context (and its check's call);
//! - `quota`: the host of the quota client (`floodgate_filter_common::quota`:
//!   what this worker has to send, sending it, and applying the answers):
//!   its calls leave from the worker's root context, a check from its
//!   request's;
//! - `waiting` (from `floodgate-filter-common`): the requests a worker
//!   keeps paused, and when to wake up;
//! - `host`: the `Host` trait, every call the filter makes to Envoy, and
//!   over it the core's traits (shared data as the store, the request);
//! - `envoy`: `Host` over proxy-wasm's ABI, the only caller of it;
//! - `metrics`: counts kept in the worker and flushed to Envoy on a tick
//!   (their names are `floodgate-filter-common`'s).
//!
//! For tests, `fake_host` (a `Host` that records what it is asked, on a
//! fake clock) and `outcome_tests` (pausing and resuming against it);
//! `mock_host` (proxy-wasm's ABI, mocked) and `host_tests` (the whole
//! filter through the SDK's real dispatcher, its host calls and its
//! allocations).
//!
//! Every call to the host goes through `Host`; the SDK's trait callbacks
//! (`Context`, `HttpContext`, `RootContext`) are only entry points. `Envoy`
//! calls `proxy_wasm::hostcalls`, which return `Result`s, rather than the
//! SDK's trait helpers, several of which unwrap; header values are read as
//! bytes only, because the SDK's `String` getters panic on non-UTF-8 input.
//!
//! The SDK exports every callback of the ABI, and Envoy enters the VM for
//! each one a module exports; `make wasm` keeps only those in
//! `exports.txt`, the callbacks implemented here, so a request pays no VM
//! entry for its log or its bodies' chunks.

mod envoy;
#[cfg(test)]
mod fake_host;
mod host;
#[cfg(test)]
mod host_tests;
mod http;
mod metrics;
#[cfg(test)]
mod mock_host;
#[cfg(test)]
mod outcome_tests;
mod plugin;
mod quota;
mod root;

// What becomes of a request and the paused requests are the same in both
// builds (`floodgate-filter-common`); here they are the crate's own modules.
use floodgate_filter_common::{outcome, waiting};

use proxy_wasm::traits::RootContext;
use proxy_wasm::types::LogLevel;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> { Box::new(root::FloodgateRoot::new(context_id)) });
}}

#[cfg(test)]
mod tests {
    /// The SDK's callbacks and the export each arrives through.
    const CALLBACKS: &[(&str, &str)] = &[
        ("on_vm_start", "proxy_on_vm_start"),
        ("on_configure", "proxy_on_configure"),
        ("on_tick", "proxy_on_tick"),
        ("on_queue_ready", "proxy_on_queue_ready"),
        ("on_done", "proxy_on_done"),
        ("on_log", "proxy_on_log"),
        ("on_foreign_function", "proxy_on_foreign_function"),
        ("on_http_call_response", "proxy_on_http_call_response"),
        ("on_grpc_call_response", "proxy_on_grpc_close"),
        ("on_grpc_stream_initial_metadata", "proxy_on_grpc_receive_initial_metadata"),
        ("on_grpc_stream_message", "proxy_on_grpc_receive"),
        ("on_grpc_stream_trailing_metadata", "proxy_on_grpc_receive_trailing_metadata"),
        ("on_grpc_stream_close", "proxy_on_grpc_close"),
        ("on_http_request_headers", "proxy_on_request_headers"),
        ("on_http_request_body", "proxy_on_request_body"),
        ("on_http_request_trailers", "proxy_on_request_trailers"),
        ("on_http_response_headers", "proxy_on_response_headers"),
        ("on_http_response_body", "proxy_on_response_body"),
        ("on_http_response_trailers", "proxy_on_response_trailers"),
        ("on_new_connection", "proxy_on_new_connection"),
        ("on_downstream_data", "proxy_on_downstream_data"),
        ("on_downstream_close", "proxy_on_downstream_connection_close"),
        ("on_upstream_data", "proxy_on_upstream_data"),
        ("on_upstream_close", "proxy_on_upstream_connection_close"),
    ];

    /// A callback implemented here whose export `make wasm` dropped would
    /// never be called by Envoy: each one's export is in `exports.txt`.
    #[test]
    fn every_callback_the_filter_implements_is_kept() {
        let kept: Vec<&str> = include_str!("../exports.txt")
            .lines()
            .map(|line| line.split('#').next().unwrap_or_default().trim())
            .filter(|name| !name.is_empty())
            .collect();
        // The filter's own code: every module but the test harnesses.
        let mut files = vec![std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/src"))];
        let mut implemented = Vec::new();
        while let Some(path) = files.pop() {
            if path.is_dir() {
                files.extend(std::fs::read_dir(&path).unwrap().map(|entry| entry.unwrap().path()));
                continue;
            }
            let name = path.file_name().unwrap().to_string_lossy();
            if name.ends_with("_tests.rs") || name == "mock_host.rs" || name == "fake_host.rs" {
                continue;
            }
            let source = std::fs::read_to_string(&path).unwrap();
            for (callback, export) in CALLBACKS {
                if source.contains(&format!("fn {callback}(")) {
                    implemented.push(*callback);
                    assert!(kept.contains(export), "{name} implements {callback}: exports.txt must keep {export}");
                }
            }
        }
        for callback in ["on_configure", "on_tick", "on_queue_ready", "on_done", "on_http_call_response"] {
            assert!(implemented.contains(&callback), "the scan finds {callback}");
        }
    }
}
