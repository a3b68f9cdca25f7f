//! Leases: how much of a fleet-wide limit one proxy may hold, for how long,
//! and how it spends what it holds. Every lease rule lives here, once, and
//! both sides call it: the quota service (both of its stores) and the fleet
//! simulation decide grants with [`grant`], the filter's pools spend and
//! refresh with [`pool`].
//!
//! The service's side:
//! * [`grant`]: the one entry point, what an ask gets of a key's bucket (a
//!   lease of the window that counts now, a lease ahead of the next one, an
//!   allowance of many) and what a return gives back;
//! * [`bucket`]: the key's bucket as the service keeps it, the algorithm's
//!   state with what leases hold of it, and its stored bytes;
//! * [`sizing`]: how many tokens a lease of one window (or one lifetime)
//!   gets: the caller's pace, never more than half of what remains, the
//!   tail of a window paced over its time;
//! * [`allowance`]: leases that cover many windows of a fixed window (or
//!   slots of a token or leaky bucket), an allowance per window, booked in
//!   each of those windows' budgets, so a key far below its limit costs one
//!   lease per term, not one per window;
//! * [`booking`]: units of the next window taken before it starts (leases
//!   ahead), and how a bucket holding them decides until then;
//! * [`holding`]: what one caller holds of a key in allowances, and the
//!   bound on it ([`holding::grant_held`]: [`grant`] with that bound);
//! * [`restart`]: what a store that forgot its buckets (a memory store
//!   restarted) counts for the allowances granted before it forgot;
//! * [`shares`]: the same limits served to Envoy's own quota filter
//!   (RLQS): a key's limit shared among the Envoys that report it, by
//!   demand, as a token bucket each.
//!
//! The proxy's side:
//! * [`pool`]: what one Envoy holds of one descriptor's limit, in one entry
//!   of the rule's bucket table: spent by requests, renewed ahead of need
//!   (single flight across workers), given back when replaced; its state in
//!   typed parts, each with its own encoding;
//! * [`refresh`]: when a pool needs more, and how much to ask for;
//! * [`overshoot`]: the opt-in budget of units a pool may admit without a
//!   lease (thin pairs at fleet scale), reported to the service, and the
//!   bound it keeps.
//!
//! How these go over the wire is `crate::global::calls`; the limiter's
//! face to them (a pool in its rule's table) is `crate::limiter`
//! (`apply_lease`, `take_unspent`, …).

pub mod allowance;
pub mod booking;
pub mod bucket;
pub mod grant;
pub mod holding;
pub mod overshoot;
pub mod pool;
pub mod refresh;
pub mod restart;
pub mod shares;
pub mod sizing;
#[cfg(test)]
mod testing;

pub use pool::{Applied, Claim, GrantedLease, LeasePool, PoolState, Spend};
