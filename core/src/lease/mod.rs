//! Leases: how much of a fleet-wide limit one proxy may hold, for how long.
//! The one implementation of lease sizing and of allowances, used by the
//! quota service for both of its stores and by the filter's pools.
//!
//! * [`sizing`] (re-exported here): how many tokens a lease of one window
//!   (or one lifetime) gets: the caller's pace, never more than half of
//!   what remains, the tail of a window paced over its time.
//! * [`allowance`]: leases that cover many windows of a fixed window, an
//!   allowance per window, booked in each of those windows' budgets, so a
//!   key far below its limit costs one lease per term, not one per window.

pub mod allowance;
mod sizing;

pub use sizing::*;
