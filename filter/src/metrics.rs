//! Envoy metrics for the limiter's counts, defined once per configuration.
//!
//! In `/stats` a counter `floodgate.allowed` appears as
//! `wasmcustom.floodgate.allowed`; in `/stats/prometheus` as
//! `wasmcustom_floodgate_allowed` (or with a `rule` label for the per-rule
//! counters, given the `stats_tags` in the shipped Envoy configs). Rules
//! whose algorithm holds units in flight also get an `in_flight` gauge.

use floodgate_core::config::Rule;
use floodgate_core::limiter::{CompiledRule, Counters, RuleEvent, StoreEvent, Verdict};
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

const RULE_EVENTS: [(RuleEvent, &str); 4] = [
    (RuleEvent::Allowed, "allowed"),
    (RuleEvent::Delayed, "delayed"),
    (RuleEvent::Limited, "limited"),
    (RuleEvent::ShadowLimited, "shadow_limited"),
];

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
    /// Units in flight, for algorithms that hold units until requests end.
    in_flight: Id,
}

impl RuleMetrics {
    /// Defines `floodgate.rule.<name>.<event>` for every rule event, and the
    /// gauge `floodgate.rule.<name>.in_flight` if the rule's algorithm holds
    /// units while requests are in flight.
    pub fn define(rule: &Rule) -> Self {
        let name = |metric: &str| format!("floodgate.rule.{}.{metric}", rule.name);
        Self {
            events: RULE_EVENTS.map(|(_, event)| counter(&name(event))),
            in_flight: if rule.policy().holds_until_done() { gauge(&name("in_flight")) } else { None },
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
