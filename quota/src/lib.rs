//! Floodgate's central quota service: fleet-wide limits shared by many
//! Envoys, decided one request at a time (`/v1/check`) or leased in batches
//! (`/v1/lease`, `/v1/return`), and Envoy's own rate limit service API over
//! gRPC ([`rls`]) and Envoy's rate limit quota service
//! ([`rlqs`]). The wire types are the `floodgate-protocol` crate's, shared
//! with the filter. See `docs/protocol.md` for the wire format and
//! `quota/README.md` for running it.

pub mod auth;
pub mod clock;
pub mod config;
pub mod http;
pub mod metrics;
pub mod notices;
pub mod reload;
pub mod rlqs;
pub mod rls;
pub mod server;
pub mod service;
pub mod store;
