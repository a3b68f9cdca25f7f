//! Leases: how much of a fleet-wide limit one proxy may hold, for how long,
//! and how it spends what it holds. One implementation, used by the quota
//! service (both stores, the fleet simulation) and by the filter's pools.
//!
//! The service's side:
//! * [`sizing`] (re-exported here): how many tokens a lease of one window
//!   (or one lifetime) gets: the caller's pace, never more than half of
//!   what remains, the tail of a window paced over its time.
//! * [`allowance`]: leases that cover many windows of a fixed window (or
//!   slots of a token or leaky bucket), an
//!   allowance per window, booked in each of those windows' budgets, so a
//!   key far below its limit costs one lease per term, not one per window.
//! * [`booking`]: units of the next window taken before it starts (leases
//!   ahead), and how a bucket holding them decides until then.
//!
//! The proxy's side:
//! * [`pool`]: what one Envoy holds of one descriptor's limit, in one entry
//!   of the rule's bucket table in shared data: spent by requests, renewed
//!   ahead of need (single flight across workers), given back when replaced.
//! * [`refresh`]: when a pool needs more, and how much to ask for.
//! * [`overshoot`]: the opt-in budget of units a pool may admit without a
//!   lease (thin pairs at fleet scale), reported to the service, and the
//!   bound it keeps.
//!
//! How these go over the wire is `crate::global::calls`; the limiter's
//! face to them is `crate::limiter` (`apply_lease`, `take_unspent`, …).

pub mod allowance;
pub mod booking;
pub mod overshoot;
pub mod pool;
pub mod refresh;
pub mod shares;
mod sizing;
#[cfg(test)]
mod testing;

pub use pool::{Applied, Claim, GrantedLease, LeasePool, PoolState, Spend};
pub use sizing::*;
