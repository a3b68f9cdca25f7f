//! The filter's quota client, the same in both builds: everything a host
//! does with the quota service. What the calls mean (when a pool
//! refreshes, how much it asks, what an answer does) is decided in the core
//! (`floodgate_core::lease`, `floodgate_core::global`); here calls are
//! queued, batched, sent through the host and matched with their answers.
//!
//! - `callouts`: what a host has to send (refreshes, returns, checks,
//!   probes), held back to share a call, and the calls awaiting answers;
//! - `client`: sending them through the host ([`QuotaHost`]), and applying
//!   what comes back (grants become leases, check answers finish their
//!   requests, a failed call brings the rules' fall-back in).

pub mod callouts;
pub mod client;

pub use callouts::{Callout, Callouts, Outgoing, StatusCall};
pub use client::QuotaHost;
