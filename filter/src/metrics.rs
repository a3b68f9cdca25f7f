//! Envoy metrics for the limiter's counts, defined once per configuration.
//!
//! In `/stats` a counter `floodgate.allowed` appears as
//! `wasmcustom.floodgate.allowed`; in `/stats/prometheus` as
//! `wasmcustom_floodgate_allowed` (or with a `rule` label for the per-rule
//! counters, given the `stats_tags` in the shipped Envoy configs).

use floodgate_core::config::Config;
use floodgate_core::limiter::{Counters, RuleEvent, StoreEvent, Verdict};
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

/// Metric ids of one plugin configuration. An id of `None` is a metric the
/// host refused to define; counting it is skipped.
pub struct Metrics {
    allowed: Option<u32>,
    limited: Option<u32>,
    shadow_limited: Option<u32>,
    store: [Option<u32>; STORE_EVENTS.len()],
    /// Per rule: allowed, limited, shadow_limited.
    rules: Vec<[Option<u32>; 3]>,
}

fn counter(name: &str) -> Option<u32> {
    hostcalls::define_metric(MetricType::Counter, name).ok()
}

fn increment(id: Option<u32>, by: u64) {
    if let (Some(id), Ok(by @ 1..)) = (id, i64::try_from(by)) {
        // A failed increment loses one count; nothing to do about it here.
        let _ = hostcalls::increment_metric(id, by);
    }
}

impl Metrics {
    /// Defines every metric of `config`.
    pub fn define(config: &Config) -> Self {
        Self {
            allowed: counter("floodgate.allowed"),
            limited: counter("floodgate.limited"),
            shadow_limited: counter("floodgate.shadow_limited"),
            store: STORE_EVENTS.map(|(_, name)| counter(&format!("floodgate.{name}"))),
            rules: config
                .rules
                .iter()
                .map(|rule| {
                    ["allowed", "limited", "shadow_limited"]
                        .map(|event| counter(&format!("floodgate.rule.{}.{event}", rule.name)))
                })
                .collect(),
        }
    }

    /// Counts a request's verdict.
    pub fn count_verdict(&self, verdict: &Verdict) {
        increment(if verdict.allowed { self.allowed } else { self.limited }, 1);
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

impl Counters for MetricCounters<'_> {
    fn rule(&mut self, rule: usize, event: RuleEvent) {
        let slot = match event {
            RuleEvent::Allowed => 0,
            RuleEvent::Limited => 1,
            RuleEvent::ShadowLimited => 2,
        };
        increment(self.0.rules.get(rule).and_then(|ids| ids[slot]), 1);
    }

    fn store(&mut self, event: StoreEvent, count: u64) {
        let index = STORE_EVENTS.iter().position(|(e, _)| *e == event);
        increment(index.and_then(|i| self.0.store[i]), count);
    }
}
