//! Envoy metrics for the limiter's counts, defined once per configuration.
//!
//! In `/stats` a counter `floodgate.allowed` appears as
//! `wasmcustom.floodgate.allowed`; in `/stats/prometheus` as
//! `wasmcustom_floodgate_allowed` (or with a `rule` label for the per-rule
//! counters, given the `stats_tags` in the shipped Envoy configs).

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

/// Adds `by` to counter `id`.
pub fn increment(id: Id, by: u64) {
    if let (Some(id), Ok(by @ 1..)) = (id, i64::try_from(by)) {
        // A failed increment loses one count; nothing to do about it here.
        let _ = hostcalls::increment_metric(id, by);
    }
}

/// One rule's counters: the host data of its [`CompiledRule`].
pub struct RuleMetrics([Id; RULE_EVENTS.len()]);

impl RuleMetrics {
    /// Defines `floodgate.rule.<name>.<event>` for every rule event.
    pub fn define(rule: &Rule) -> Self {
        Self(RULE_EVENTS.map(|(_, event)| counter(&format!("floodgate.rule.{}.{event}", rule.name))))
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
        increment(index.and_then(|i| rule.host.0.get(i).copied().flatten()), 1);
    }

    fn store(&mut self, event: StoreEvent, count: u64) {
        let index = STORE_EVENTS.iter().position(|(e, _)| *e == event);
        increment(index.and_then(|i| self.0.store[i]), count);
    }
}
