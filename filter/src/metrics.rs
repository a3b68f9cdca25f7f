//! Envoy metrics for the limiter's counts, defined once per configuration.
//!
//! In `/stats` a counter `floodgate.allowed` appears as
//! `wasmcustom.floodgate.allowed`; in `/stats/prometheus` as
//! `wasmcustom_floodgate_allowed` (or with a `rule` label for the per-rule
//! counters, given the `stats_tags` in the shipped Envoy configs). Rules
//! whose algorithm holds units in flight also get an `in_flight` gauge.

use floodgate_core::config::Rule;
use floodgate_core::global::calls::CallError;
use floodgate_core::limiter::{CompiledRule, Counters, Limiter, RuleEvent, StoreEvent, Verdict};
use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

const STORE_EVENTS: [(StoreEvent, &str); 6] = [
    (StoreEvent::CasRetries, "cas_retries"),
    (StoreEvent::RetriesExhausted, "retries_exhausted"),
    (StoreEvent::SlotEvictions, "slot_evictions"),
    (StoreEvent::TableFull, "table_full"),
    (StoreEvent::StoreErrors, "store_errors"),
    (StoreEvent::CorruptState, "corrupt_state"),
];

const RULE_EVENTS: [(RuleEvent, &str); 5] = [
    (RuleEvent::Allowed, "allowed"),
    (RuleEvent::Delayed, "delayed"),
    (RuleEvent::Limited, "limited"),
    (RuleEvent::ShadowLimited, "shadow_limited"),
    (RuleEvent::Fallback, "fallback"),
];

const FAILURES: [&str; 5] = ["not_sent", "refused", "timeout", "bad_status", "bad_answer"];

/// A metric id; `None` is a metric the host refused to define, and counting
/// it is skipped.
type Id = Option<u32>;

fn counter(name: &str) -> Id {
    hostcalls::define_metric(MetricType::Counter, name).ok()
}

/// A gauge. Every worker's VM defines it under the same name, and Envoy keeps
/// one gauge per name for the process, so each worker's changes add up.
fn gauge(name: &str) -> Id {
    hostcalls::define_metric(MetricType::Gauge, name).ok()
}

/// Adds `by` to counter `id`.
pub fn increment(id: Id, by: u64) {
    if let (Some(id), Ok(by @ 1..)) = (id, i64::try_from(by)) {
        // A failed increment loses one count; nothing to do about it here.
        let _ = hostcalls::increment_metric(id, by);
    }
}

/// One rule's metrics: the host data of its [`CompiledRule`].
pub struct RuleMetrics {
    events: [Id; RULE_EVENTS.len()],
    /// For a global rule: 1 while its fall-back is in force, else 0.
    fallback_active: Id,
    /// Units in flight, for algorithms that hold units until requests end.
    in_flight: Id,
}

impl RuleMetrics {
    /// Defines `floodgate.rule.<name>.<event>` for every rule event, the
    /// gauge `floodgate.rule.<name>.in_flight` if the rule's algorithm holds
    /// units while requests are in flight, and a global rule's
    /// `floodgate.rule.<name>.fallback_active` gauge.
    pub fn define(rule: &Rule) -> Self {
        let name = |metric: &str| format!("floodgate.rule.{}.{metric}", rule.name);
        Self {
            events: RULE_EVENTS.map(|(_, event)| counter(&name(event))),
            in_flight: if rule.policy().holds_until_done() { gauge(&name("in_flight")) } else { None },
            fallback_active: rule.global.as_ref().and_then(|_| gauge(&name("fallback_active"))),
        }
    }
}

/// The plugin-wide counters.
pub struct Metrics {
    allowed: Id,
    limited: Id,
    shadow_limited: Id,
    store: [Id; STORE_EVENTS.len()],
    /// Requests a shaper delayed, and that went on after waiting.
    pub delayed: Id,
    /// Milliseconds of delay the shaper asked for, summed.
    pub delay_requested_ms: Id,
    /// Milliseconds delayed requests actually waited, summed.
    pub delay_actual_ms: Id,
    /// Delayed requests whose client left while they waited.
    pub delay_abandoned: Id,
    /// Requests denied because this worker already had
    /// `max_delayed_per_worker` requests waiting.
    pub delay_queue_full: Id,
    /// Lease-pool refreshes claimed.
    pub refreshes: Id,
    /// Calls sent to the quota service.
    pub callouts_sent: Id,
    /// Calls answered usably.
    pub callouts_ok: Id,
    /// Calls failed, by kind (see [`Metrics::count_failed_callout`]).
    callouts_failed: [Id; 5],
    /// Tokens granted to this Envoy's pools.
    pub tokens_leased: Id,
    /// Unspent tokens given back to the service.
    pub tokens_returned: Id,
    /// Tokens whose lease ended before they were spent.
    pub tokens_expired: Id,
    /// Requests that waited for an empty pool's refill.
    pub refill_waits: Id,
    /// Milliseconds they waited, summed.
    pub refill_wait_ms: Id,
}

impl Metrics {
    /// Defines every plugin-wide metric.
    pub fn define() -> Self {
        Self {
            allowed: counter("floodgate.allowed"),
            limited: counter("floodgate.limited"),
            shadow_limited: counter("floodgate.shadow_limited"),
            store: STORE_EVENTS.map(|(_, name)| counter(&format!("floodgate.{name}"))),
            delayed: counter("floodgate.delayed"),
            delay_requested_ms: counter("floodgate.delay_requested_ms"),
            delay_actual_ms: counter("floodgate.delay_actual_ms"),
            delay_abandoned: counter("floodgate.delay_abandoned"),
            delay_queue_full: counter("floodgate.delay_queue_full"),
            refreshes: counter("floodgate.global.refreshes"),
            callouts_sent: counter("floodgate.global.callouts_sent"),
            callouts_ok: counter("floodgate.global.callouts_ok"),
            callouts_failed: FAILURES.map(|kind| counter(&format!("floodgate.global.callouts_{kind}"))),
            tokens_leased: counter("floodgate.global.tokens_leased"),
            tokens_returned: counter("floodgate.global.tokens_returned"),
            tokens_expired: counter("floodgate.global.tokens_expired"),
            refill_waits: counter("floodgate.global.refill_waits"),
            refill_wait_ms: counter("floodgate.global.refill_wait_ms"),
        }
    }

    /// Counts a failed call by kind: `not_sent` (Envoy refused it, e.g. no
    /// such cluster), `refused` (503: no connection), `timeout` (504),
    /// `bad_status` (any other non-2xx or a reset stream), `bad_answer`.
    pub fn count_failed_callout(&self, why: &CallError) {
        let kind = match why {
            CallError::NotSent(_) => 0,
            CallError::Status(Some(503)) => 1,
            CallError::Status(Some(504)) => 2,
            CallError::Status(_) => 3,
            CallError::Body(_) => 4,
        };
        increment(self.callouts_failed[kind], 1);
    }

    /// Sets every global rule's `fallback_active` gauge from this worker's view.
    pub fn set_modes(&self, limiter: &Limiter<RuleMetrics>) {
        for compiled in limiter.rules() {
            if let Some(id) = compiled.host.fallback_active {
                let _ = hostcalls::record_metric(id, u64::from(compiled.in_fallback()));
            }
        }
    }

    /// Counts a request's verdict: allowed (now or after a delay) or limited.
    pub fn count_verdict(&self, verdict: &Verdict) {
        increment(if verdict.allowed() { self.allowed } else { self.limited }, 1);
        if verdict.shadow_limited.is_some() {
            increment(self.shadow_limited, 1);
        }
    }

    /// A [`Counters`] sink for one check.
    pub fn counters(&self) -> MetricCounters<'_> {
        MetricCounters(self)
    }
}

/// Forwards the limiter's counts to Envoy.
pub struct MetricCounters<'a>(&'a Metrics);

impl Counters<RuleMetrics> for MetricCounters<'_> {
    fn rule(&mut self, rule: &CompiledRule<RuleMetrics>, event: RuleEvent) {
        let index = RULE_EVENTS.iter().position(|(e, _)| *e == event);
        increment(index.and_then(|i| rule.host.events.get(i).copied().flatten()), 1);
    }

    /// Moves the rule's in-flight gauge (Envoy adds a positive offset to a
    /// gauge and subtracts a negative one).
    fn in_flight(&mut self, rule: &CompiledRule<RuleMetrics>, change: i64) {
        if let Some(id) = rule.host.in_flight {
            // A failed update loses this change; nothing to do about it here.
            let _ = hostcalls::increment_metric(id, change);
        }
    }

    fn store(&mut self, event: StoreEvent, count: u64) {
        let index = STORE_EVENTS.iter().position(|(e, _)| *e == event);
        increment(index.and_then(|i| self.0.store[i]), count);
    }
}
