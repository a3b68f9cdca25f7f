//! The filter's quota client: everything one worker does with the quota
//! service, in one place. What the calls mean (when a pool refreshes, how
//! much it asks, what an answer does) is decided in the core
//! (`floodgate_core::lease`, `floodgate_core::global`); here calls are
//! queued, batched, sent and matched with their answers.
//!
//! - `callouts`: what this worker has to send (refreshes, returns, checks,
//!   probes), held back to share a call, and the calls awaiting answers;
//! - `client`: sending them through Envoy's HTTP callouts, and applying
//!   what comes back (grants become leases, check answers finish their
//!   requests, a failed call brings the rules' fall-back in).

mod callouts;
mod client;

pub(crate) use callouts::{Callout, Callouts};
