//! The host-agnostic part of Floodgate's Envoy filter, shared by its two
//! builds: the wasm module (`floodgate-filter`, proxy-wasm) and the native
//! module (`floodgate-native`, Envoy's dynamic modules). The limiter
//! decides in `floodgate-core`; here is what each build's host layer does
//! with a request around that decision, so neither writes it twice.
//!
//! - `outcome`: the one decision of what becomes of a request — go on,
//!   answer limited, pause, resume, or give back because its client left;
//! - `requests`: a request's path through a worker — decided, the outcome
//!   carried out, finished when its wait is over, its permit given back —
//!   over what a build's worker does with it ([`requests::RequestHost`]);
//! - `quota`: the quota client — which calls to send when, batched, matched
//!   with their answers, which are applied (grants, check answers, failures)
//!   — over how a build sends a call ([`quota::QuotaHost`]);
//! - `waiting`: the requests a worker keeps paused, bounded;
//! - `metrics`: the metrics' names and what each counts;
//! - `log`: log lines kept to one a second (a shadow rule's, a failing call's).

pub mod log;
pub mod metrics;
pub mod outcome;
pub mod quota;
pub mod requests;
#[cfg(test)]
mod testing;
pub mod waiting;
