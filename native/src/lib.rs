//! Floodgate's Envoy HTTP filter as a native module, loaded by Envoy's
//! `envoy.filters.http.dynamic_modules` filter: the same configuration and
//! the same core as the wasm build (`floodgate-filter`), with buckets in
//! process memory instead of Envoy's shared data.
//!
//! Every decision is the core's (`floodgate-core`), and what becomes of a
//! request around it is the wasm build's too (`floodgate-filter-common`);
//! this crate is the host layer: Envoy's hooks in, Envoy's callbacks out.
//! `native/DESIGN.md` has the design, `native/ABI.md` the ABI as checked
//! on Envoy 1.40, and `native/CHECKS.md` what was run on it.
//!
//! The crate by concern:
//! - `abi`: Envoy's dynamic module ABI — the only code that crosses it, and
//!   the only `unsafe` code; every hook catches panics;
//! - `config`: a configuration, created on Envoy's main thread: parsed,
//!   checked (`support`: what this build cannot serve), its metrics defined
//!   (`metrics`) and its buckets created in `memory`;
//! - `client`: a global configuration's quota client on Envoy's main thread
//!   (its leases, returns and probes), reached from the workers through
//!   `relay`;
//! - `worker`: a configuration's state on one worker thread (its limiter,
//!   its paused requests), as the wasm build's per-worker VM holds it;
//! - `stream`: one request's stream, over `request` (the request as the core
//!   reads it); it sends its own check;
//! - `memory`: the buckets in process memory as the core's store, one map
//!   per `filter_name`, deciding in place;
//! - `waker`: the thread that ends a paused request's wait and runs a global
//!   configuration's timer;
//! - `log`: the `log` crate and panics, in Envoy's log.

// Every `unsafe` block, `unsafe impl` and exported symbol is in `abi`.
#![deny(unsafe_code)]

#[allow(unsafe_code)]
mod abi;
mod client;
mod config;
mod log;
pub mod memory;
mod metrics;
mod relay;
mod request;
mod stream;
mod support;
mod waker;
mod worker;

use std::hash::{BuildHasher, Hasher};
use std::time::{SystemTime, UNIX_EPOCH};

use floodgate_core::time::Nanos;

/// The wall clock, in nanoseconds since the Unix epoch: the one epoch every
/// worker shares (the wasm build reads Envoy's, which is the same clock),
/// and the quota service's grants count on.
fn now() -> Nanos {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        // Seconds and nanoseconds added in 64 bits (not through `as_nanos`'s
        // 128), saturating as that did.
        .map_or(Nanos::ZERO, |d| {
            Nanos::from_nanos(d.as_secs().saturating_mul(1_000_000_000).saturating_add(u64::from(d.subsec_nanos())))
        })
}

/// Sixteen unpredictable bytes for the hashing secret (std's random hasher
/// keys, from the operating system, mixed with the time).
fn entropy() -> [u8; 16] {
    let mut out = [0u8; 16];
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(now().get());
        hasher.write_usize(i);
        chunk.copy_from_slice(&hasher.finish().to_le_bytes());
    }
    out
}
