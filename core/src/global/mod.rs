//! Global mode: limits held by the central quota service for a whole fleet,
//! enforced here from leased quota.
//!
//! The hot path never waits for the network while quota lasts. Per rule and
//! descriptor a pool of leased tokens ([`crate::lease`]) lives in the rule's
//! bucket table in shared data and is spent with the same compare-and-swap
//! loop as a local bucket; exactly one worker of the Envoy claims a pool's
//! refresh (single flight) and a claim that is not answered in time can be
//! taken over. Here: the [`calls`] that carry claims, returns and checks to
//! the service and read its answers, the rule's [`settings`], and its
//! [`fallback`] machine: when the service cannot be reached, it switches the
//! rule to its local fall-back and probes the service again with backoff.
//!
//! Everything here is pure: time comes in as an argument, and the host layer
//! only dispatches callouts and applies their answers.

pub mod calls;
pub mod fallback;
pub mod settings;

/// How often a worker looks again at the pools its paused requests wait on
/// (its tick while any waits for a refill): an answer refills a pool on the
/// worker that asked, and a request paused on another worker sees the new
/// tokens on its own next tick.
pub const REFILL_TICK: crate::time::Nanos = crate::time::Nanos::from_millis(2);
