//! Floodgate's core: everything the rate limiter decides, as plain Rust.
//!
//! Nothing here talks to a proxy. The Envoy filter (`floodgate-filter`) and the
//! quota service (`floodgate-quota`) are thin layers over these modules, which
//! are tested natively with an in-memory store and a fake clock, and in wasm
//! (`wasm32-unknown-unknown` under `wasm-bindgen-test` in Node, the V8 engine
//! Envoy embeds: `make test-core-wasm`).

pub mod algorithm;
pub mod bounds;
pub mod config;
pub mod descriptor;
pub mod error;
pub mod global;
pub mod hash;
pub mod headers;
pub mod lease;
pub mod limiter;
pub mod metadata;
pub mod query;
pub mod rng;
pub mod store;
pub mod table;
pub mod text;
pub mod time;
pub mod value;
