//! The shape `make fleet-validate` runs twice — on real Envoys and a real
//! `floodgate-quota` on this machine, and in the simulation — and the
//! figures it compares: lease calls, leases, return calls, share waited,
//! wait p50/p99, windows over the limit.
//!
//! The shape: `envoys` Envoys of two workers, each sent `per_envoy`
//! requests a second (two paced client connections, one per worker), a
//! uniform balancer (each request's user drawn at random); one global rule
//! on the `x-user` header, per-second fixed windows of `limit` per user;
//! `users` users share `1 − hot_share` of the traffic (far below their
//! limit), one user (`hot`) gets `hot_share` of it (above its limit).

use floodgate_core::time::Nanos;

use crate::fleet::{default_quota, simulate, table_groups, FleetConfig, FleetOutcome};
use crate::keys::{self, Envoys, Key, Shape as Limited};
use crate::rng::Network;

/// One size of the comparison.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    /// Envoys (two workers each).
    pub envoys: u32,
    /// Requests a second each Envoy is sent.
    pub per_envoy: f64,
    /// Users below their limit.
    pub users: usize,
    /// The hot user's share of the requests.
    pub hot_share: f64,
    /// Each user's limit, per second (fixed windows).
    pub limit: u64,
    /// Traffic before the measured span.
    pub warmup: Nanos,
    /// The measured span.
    pub measure: Nanos,
}

impl Shape {
    /// Requests a second, fleet-wide.
    pub fn fleet_rate(&self) -> f64 {
        f64::from(self.envoys) * self.per_envoy
    }

    /// Requests a second of one user below its limit.
    pub fn user_rate(&self) -> f64 {
        self.fleet_rate() * (1.0 - self.hot_share) / self.users as f64
    }

    /// The quota service's limits file for the shape.
    pub fn limits(&self) -> String {
        format!(
            "domain: {}\ndescriptors:\n  - key: user\n    rate_limit: {{unit: second, requests_per_unit: {}}}\n",
            keys::DOMAIN,
            self.limit
        )
    }

    /// The filter's configuration: one global rule on `x-user`, the
    /// quota service's defaults otherwise (timeout 300 ms, `max_wait` 200 ms).
    pub fn plugin(&self, cluster: &str) -> String {
        format!(
            r#"{{"rules": [{{"name": "per-user", "scope": "global", "fallback": "deny",
  "descriptors": [{{"request_headers": {{"header_name": "x-user", "descriptor_key": "user"}}}}]}}],
  "global": {{"cluster": "{cluster}", "domain": "{}"}}}}"#,
            keys::DOMAIN
        )
    }

    /// The user of a request, from a uniform random number: the hot user
    /// for `hot_share` of them, else one of `users`.
    pub fn user(&self, random: u64) -> String {
        let unit = (random >> 11) as f64 / (1u64 << 53) as f64;
        if unit < self.hot_share {
            "hot".into()
        } else {
            format!("user-{}", (random % self.users as u64))
        }
    }
}

/// The two sizes: 3 and 6 Envoys at 300 requests a second each, 300 users
/// (per-second limits of 40, one or two requests a second at each Envoy),
/// one in ten requests a hot user's (90 or 180 a second against its 40).
pub const SHAPES: [Shape; 2] = [
    Shape {
        envoys: 3,
        per_envoy: 300.0,
        users: 300,
        hot_share: 0.1,
        limit: 40,
        warmup: Nanos::from_secs(10),
        measure: Nanos::from_secs(30),
    },
    Shape {
        envoys: 6,
        per_envoy: 300.0,
        users: 300,
        hot_share: 0.1,
        limit: 40,
        warmup: Nanos::from_secs(10),
        measure: Nanos::from_secs(30),
    },
];

/// One-way delays on this machine's loopback, the service's own time
/// included: 100–500 µs (an Envoy's callout to a local service adds about
/// 0.2 ms at p50 on an idle machine, docs/benchmarks.md).
pub const LOOPBACK: Network = Network::Loopback { low: 100, high: 500 };

/// What one run of a shape measured, per second of its measured span.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Figures {
    /// Requests a second.
    pub requests: f64,
    /// Lease calls a second.
    pub lease_calls: f64,
    /// Leases (items of lease calls) a second.
    pub leases: f64,
    /// Return calls a second.
    pub return_calls: f64,
    /// Share of requests that waited for a refill.
    pub waited: f64,
    /// p50 and p99 of those waits, ms.
    pub wait_p50: f64,
    /// See [`Figures::wait_p50`].
    pub wait_p99: f64,
    /// Per-second windows of a user over its limit.
    pub windows_over: u64,
    /// The hot user's admissions a second.
    pub hot_admitted: f64,
}

/// The simulation's keys for `shape`: the users, then the hot user.
pub fn keys_of(shape: &Shape) -> Result<Vec<Key>, String> {
    let mut keys = keys::flat(shape.users, shape.user_rate(), shape.limit)?;
    let hot = shape.fleet_rate() * shape.hot_share;
    keys.push(Key::new(shape.users, hot, Limited::PerSecond, shape.limit, true, Envoys::All)?);
    Ok(keys)
}

/// Simulates `shape` with `seed`.
pub fn simulated(shape: &Shape, seed: u64) -> Result<(Figures, FleetOutcome), String> {
    let keys = keys_of(shape)?;
    let hot = keys.len() - 1;
    let config = FleetConfig {
        name: format!("validate-{}", shape.envoys),
        envoys: shape.envoys,
        total_keys: keys.len() as u64,
        keys,
        exact: true,
        table_groups: table_groups(1.0),
        warmup: shape.warmup,
        measure: shape.measure,
        after: Nanos::ZERO,
        restart_at: None,
        seed,
        allowances: true,
        overshoot: None,
        check_baseline: false,
        record_items: false,
        network: LOOPBACK,
        quota: default_quota(),
    };
    let o = simulate(&config)?;
    let secs = o.secs;
    let [p50, _, p99] = o.waits.quantiles();
    let hot_admitted = o.per_key.get(hot).map_or(0.0, |k| k.admitted);
    let figures = Figures {
        requests: o.requests / secs,
        lease_calls: o.sim_lease_calls as f64 / secs,
        leases: o.sim_leases as f64 / secs,
        return_calls: o.sim_return_calls as f64 / secs,
        waited: o.waited / o.requests.max(1.0),
        wait_p50: p50,
        wait_p99: p99,
        windows_over: o.over_before + o.over_after,
        hot_admitted: hot_admitted / secs,
    };
    Ok((figures, o))
}
