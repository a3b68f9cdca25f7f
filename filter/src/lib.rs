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
