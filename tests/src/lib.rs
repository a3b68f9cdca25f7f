//! The one harness of the end-to-end tests, the plots, the bench and the
//! quota service's suites: real processes on free loopback ports — Envoy
//! (`--concurrency 2`) with a build of Floodgate, the quota service's
//! binary, `redis-server` and Redis Cluster — Envoy bootstraps as
//! structured values, a raw HTTP/1.1 client, and JWTs for `jwt_authn`.
//!
//! By concern: `ports` (ports, scratch directories, the repository root,
//! built files), `process` (every process started, killed on drop or on a
//! panic), `bootstrap` (the pieces of a bootstrap, and the [`Build`] of
//! Floodgate they load), `setup` (the Envoy under test), `envoy` (the
//! process and its admin endpoint), `http` (the client), `load` (concurrent
//! loads), `access_log` (admissions counted by instant), `quota` (the
//! service's binary), `redis`, `jwt`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod access_log;
pub mod bootstrap;
pub mod envoy;
pub mod http;
pub mod jwt;
pub mod load;
pub mod ports;
pub mod process;
pub mod quota;
pub mod redis;
pub mod setup;

pub use crate::redis::{RedisCluster, RedisServer};
pub use access_log::{Admission, AdmissionLog};
pub use bootstrap::Build;
pub use envoy::{assert_both_workers_served, envoy_bin, validate, Envoy, EnvoyOptions, Update};
pub use http::{Conn, HttpResponse};
pub use jwt::Issuer;
pub use load::{hammer, hammer_with, Shot};
pub use ports::{free_port, repo_root, scratch_dir};
pub use quota::{quota_bin, QuotaOptions, QuotaServer};
pub use setup::Setup;
