//! What a global-mode variant asked the quota service for, read from
//! Envoy's and the service's counters.

use floodgate_e2e::{Envoy, QuotaServer};
use serde_json::{json, Value};

/// What a global-mode variant asked the quota service for: the filter's own
/// counters (`wasmcustom.floodgate.global.*`, and the rules' `fallback`
/// decisions), the service's `floodgate_quota_requests_total`, and the
/// requests Envoy received. Read before, in the middle of and after each
/// round; the service's counts include anything idle Envoys of other
/// variants on the same instance sent meanwhile.
#[derive(Clone, Copy, Debug, Default)]
pub struct CalloutCounts {
    /// Requests Envoy received.
    pub requests: u64,
    /// Callouts the filter sent, and those answered OK.
    pub sent: u64,
    pub ok: u64,
    /// Requests that found their pool empty and waited for a refresh, and
    /// how long they waited in all.
    pub waits: u64,
    pub wait_ms: u64,
    /// Decisions the rules' fallback made.
    pub fallback: u64,
    /// Calls the service answered, by endpoint.
    pub service_lease: u64,
    pub service_check: u64,
    pub service_return: u64,
}

impl CalloutCounts {
    /// The counters now.
    pub fn read(envoy: &Envoy, quota: &QuotaServer) -> CalloutCounts {
        let stats = envoy.stats_flushed();
        let stat = |name: &str| stats.get(&format!("wasmcustom.floodgate.global.{name}")).copied().unwrap_or(0);
        let fallback = stats
            .iter()
            .filter(|(name, _)| name.starts_with("wasmcustom.floodgate.rule.") && name.ends_with(".fallback"))
            .map(|(_, v)| v)
            .sum();
        CalloutCounts {
            requests: stats.get("http.bench.downstream_rq_total").copied().unwrap_or(0),
            sent: stat("callouts_sent"),
            ok: stat("callouts_ok"),
            waits: stat("refill_waits"),
            wait_ms: stat("refill_wait_ms"),
            fallback,
            service_lease: quota.requests("lease"),
            service_check: quota.requests("check"),
            service_return: quota.requests("return"),
        }
    }

    /// Applies `f` to each pair of counters.
    fn zip(self, other: CalloutCounts, f: impl Fn(u64, u64) -> u64) -> CalloutCounts {
        CalloutCounts {
            requests: f(self.requests, other.requests),
            sent: f(self.sent, other.sent),
            ok: f(self.ok, other.ok),
            waits: f(self.waits, other.waits),
            wait_ms: f(self.wait_ms, other.wait_ms),
            fallback: f(self.fallback, other.fallback),
            service_lease: f(self.service_lease, other.service_lease),
            service_check: f(self.service_check, other.service_check),
            service_return: f(self.service_return, other.service_return),
        }
    }

    /// The counts from `before` to `self`.
    pub fn since(self, before: CalloutCounts) -> CalloutCounts {
        self.zip(before, u64::saturating_sub)
    }

    /// The sum of two counts.
    pub fn add(self, other: CalloutCounts) -> CalloutCounts {
        self.zip(other, |a, b| a + b)
    }

    /// The calls the service answered, all endpoints.
    pub fn service(&self) -> u64 {
        self.service_lease + self.service_check + self.service_return
    }

    /// Callouts the filter sent per request Envoy received.
    pub fn per_request(&self) -> f64 {
        self.sent as f64 / self.requests.max(1) as f64
    }

    /// The share of requests that waited for a refresh.
    pub fn waited_share(&self) -> f64 {
        self.waits as f64 / self.requests.max(1) as f64
    }

    pub fn to_json(self) -> Value {
        json!({
            "requests": self.requests, "callouts_sent": self.sent, "callouts_ok": self.ok,
            "refill_waits": self.waits, "refill_wait_ms": self.wait_ms, "fallback_decisions": self.fallback,
            "service_lease_calls": self.service_lease, "service_check_calls": self.service_check,
            "service_return_calls": self.service_return,
        })
    }
}
