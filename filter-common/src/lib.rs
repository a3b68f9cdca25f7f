//! The host-agnostic part of Floodgate's Envoy filter, shared by its two
//! builds: the wasm module (`floodgate-filter`, proxy-wasm) and the native
//! module (`floodgate-native`, Envoy's dynamic modules). The limiter
//! decides in `floodgate-core`; here is what each build's host layer does
//! with a request around that decision, so neither writes it twice.
//!
//! - `outcome`: the one decision of what becomes of a request — go on,
//!   answer limited, pause, resume, or give back because its client left;
//! - `waiting`: the requests a worker keeps paused, bounded;
//! - `metrics`: the metrics' names and what each counts;
//! - `log`: log lines kept to one a second (a shadow rule's, a failing call's).

pub mod log;
pub mod metrics;
pub mod outcome;
pub mod waiting;
