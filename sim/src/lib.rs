//! The fleet simulation (`make fleet-sim`) and its check against real
//! Envoys (`make fleet-validate`): fleets of simulated Envoys running the
//! real lease pools in the real bucket tables against the quota service's
//! real decisions, on a virtual clock.
//!
//! By concern: `keys` (the traffic: keys, rates, limits, balancers, and how
//! a fleet too large to simulate whole is sampled), `fleet` (one fleet's
//! run: Envoys, workers, pools, the service, check mode beside it), `calls`
//! (a worker's batching of its calls, the filter's rule), `service` (the
//! quota service's decisions on a store of bytes), `replay` (the calls
//! model for a sampled fleet), `grid` (what `make fleet-sim` runs),
//! `report` (its tables), `validate` (the shape `make fleet-validate` runs
//! both here and on real Envoys), `stats` and `rng` (weighted percentiles,
//! deterministic draws).

pub mod calls;
pub mod fleet;
pub mod grid;
pub mod keys;
pub mod replay;
pub mod report;
pub mod rng;
pub mod service;
pub mod stats;
pub mod validate;
