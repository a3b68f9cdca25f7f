//! Global mode: limits held by the central quota service for a whole fleet,
//! enforced here from leased quota.
//!
//! The hot path never waits for the network while quota lasts. Per rule and
//! descriptor a [`pool`] of leased tokens lives in the rule's bucket table in
//! shared data and is spent with the same compare-and-swap loop as a local
//! bucket. The [`refresh`] policy decides, on the request that notices it,
//! when the pool needs more (before it runs dry at the observed rate, or
//! before its lease expires) and how much to ask for; exactly one worker of
//! the Envoy claims the refresh (single flight) and a claim that is not
//! answered in time can be taken over. When the service cannot be reached,
//! the rule's [`fallback`] machine switches it to its local fall-back and
//! probes the service again with backoff.
//!
//! Everything here is pure: time comes in as an argument, and the host layer
//! only dispatches callouts and applies their answers.

pub mod calls;
pub mod fallback;
pub mod pool;
pub mod refresh;
pub mod settings;
