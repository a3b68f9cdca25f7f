//! Envoy metrics for the limiter's counts, defined once per configuration.
//!
//! Counts add up in the worker ([`Metric`]) and reach Envoy when the worker
//! flushes them: on its tick, at most [`FLUSH_PERIOD`] after the first count
//! since the last flush (a call's answer too leaves its counts for the
//! tick). So neither a request nor a call's answer makes a host call for its
//! counts; Envoy's stats lag the worker by at most the flush period.
//!
//! In `/stats` a counter `floodgate.allowed` appears as
//! `wasmcustom.floodgate.allowed`; in `/stats/prometheus` as
//! `wasmcustom_floodgate_allowed` (or with a `rule` label for the per-rule
//! counters, given the `stats_tags` in the shipped Envoy configs). Rules
//! whose algorithm holds units in flight also get an `in_flight` gauge.

use std::cell::Cell;
use std::time::Duration;

use floodgate_core::config::Rule;
use floodgate_core::global::calls::CallError;
use floodgate_core::limiter::{CompiledRule, Counters, Limiter, RequestEvent, RuleEvent, StoreEvent};
use floodgate_filter_common::metrics::{self as names, COUNTERS, FAILURES, RULE_EVENTS, STORE_EVENTS};
use proxy_wasm::types::MetricType;

use crate::host::Host;

pub use floodgate_filter_common::metrics::Counter;

/// The longest Envoy's stats lag the worker's counts.
pub const FLUSH_PERIOD: Duration = Duration::from_millis(100);

/// A counter, or a gauge that changes by offsets, as this worker counts it:
/// what it has added since its last flush. A metric the host refused to
/// define counts nothing.
#[derive(Debug, Default)]
pub struct Metric {
    id: Option<u32>,
    pending: Cell<i64>,
}

impl Metric {
    fn define(host: &impl Host, kind: MetricType, name: &str) -> Self {
        Metric { id: host.define_metric(kind, name).ok(), pending: Cell::new(0) }
    }

    /// Adds `by` (a gauge: may be negative).
    fn add(&self, by: i64) {
        if self.id.is_some() {
            self.pending.set(self.pending.get().saturating_add(by));
        }
    }

    /// Hands what was added to Envoy (Envoy adds a positive offset to a
    /// gauge and subtracts a negative one).
    fn flush(&self, host: &impl Host) {
        let pending = self.pending.replace(0);
        if let (Some(id), 1.. | ..=-1) = (self.id, pending) {
            // A failed increment loses these counts; nothing to do about it here.
            let _ = host.increment_metric(id, pending);
        }
    }
}

fn counter(host: &impl Host, name: &str) -> Metric {
    Metric::define(host, MetricType::Counter, name)
}

/// A gauge. Every worker's VM defines it under the same name, and Envoy keeps
/// one gauge per name for the process, so each worker's changes add up.
fn gauge(host: &impl Host, name: &str) -> Metric {
    Metric::define(host, MetricType::Gauge, name)
}

/// Adds `by` to counter `metric`.
pub fn increment(metric: &Metric, by: u64) {
    metric.add(i64::try_from(by).unwrap_or(i64::MAX));
}

/// One rule's metrics: the host data of its [`CompiledRule`].
pub struct RuleMetrics {
    events: [Metric; RULE_EVENTS.len()],
    /// For a global rule: 1 while its fall-back is in force, else 0 (set
    /// directly, not flushed).
    fallback_active: Option<u32>,
    /// Units in flight, for algorithms that hold units until requests end.
    in_flight: Metric,
}

impl RuleMetrics {
    /// Defines `floodgate.rule.<name>.<event>` for every rule event, the
    /// gauge `floodgate.rule.<name>.in_flight` if the rule's algorithm holds
    /// units while requests are in flight, and a global rule's
    /// `floodgate.rule.<name>.fallback_active` gauge.
    pub fn define(host: &impl Host, rule: &Rule) -> Self {
        let name = |metric: &str| names::rule_metric(&rule.name, metric);
        Self {
            events: RULE_EVENTS.map(|(_, event)| counter(host, &name(event))),
            in_flight: if rule.policy().holds_until_done() {
                gauge(host, &name(names::IN_FLIGHT))
            } else {
                Metric::default()
            },
            fallback_active: rule
                .global
                .as_ref()
                .and_then(|_| host.define_metric(MetricType::Gauge, &name(names::FALLBACK_ACTIVE)).ok()),
        }
    }

    fn flush(&self, host: &impl Host) {
        self.events.iter().for_each(|metric| metric.flush(host));
        self.in_flight.flush(host);
    }
}

/// The plugin-wide counters.
pub struct Metrics {
    /// By [`Counter`].
    counters: [Metric; COUNTERS.len()],
    store: [Metric; STORE_EVENTS.len()],
    /// Calls failed, by kind (see [`Metrics::count_failed_callout`]).
    callouts_failed: [Metric; FAILURES.len()],
}

impl Metrics {
    /// Defines every plugin-wide metric.
    pub fn define(host: &impl Host) -> Self {
        let plugin = |name: &str| counter(host, &names::plugin_metric(name));
        Self {
            counters: COUNTERS.map(|(_, name)| plugin(name)),
            store: STORE_EVENTS.map(|(_, name)| plugin(name)),
            callouts_failed: FAILURES.map(|kind| counter(host, &names::failure_metric(kind))),
        }
    }

    /// Adds `by` to `counter`.
    pub fn count(&self, counter: Counter, by: u64) {
        if let Some(metric) = self.counters.get(counter as usize) {
            increment(metric, by);
        }
    }

    /// Counts a failed call by kind (see [`names::failure_index`]).
    pub fn count_failed_callout(&self, why: &CallError) {
        if let Some(metric) = self.callouts_failed.get(names::failure_index(why)) {
            increment(metric, 1);
        }
    }

    /// Hands every count of this worker to Envoy: the plugin-wide ones and
    /// those of `limiter`'s rules.
    pub fn flush(&self, host: &impl Host, limiter: &Limiter<RuleMetrics>) {
        let every = self.counters.iter().chain(&self.store).chain(&self.callouts_failed);
        every.for_each(|metric| metric.flush(host));
        limiter.rules().iter().for_each(|rule| rule.host.flush(host));
    }

    /// Sets every global rule's `fallback_active` gauge from this worker's view.
    pub fn set_modes(&self, host: &impl Host, limiter: &Limiter<RuleMetrics>) {
        for compiled in limiter.rules() {
            if let Some(id) = compiled.host.fallback_active {
                let _ = host.record_metric(id, u64::from(compiled.in_fallback()));
            }
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
    fn request(&mut self, event: RequestEvent) {
        self.0.count(names::request_counter(event), 1);
    }

    fn rule(&mut self, rule: &CompiledRule<RuleMetrics>, event: RuleEvent) {
        if let Some(metric) = names::rule_event_index(event).and_then(|i| rule.host.events.get(i)) {
            increment(metric, 1);
        }
    }

    /// Moves the rule's in-flight gauge.
    fn in_flight(&mut self, rule: &CompiledRule<RuleMetrics>, change: i64) {
        rule.host.in_flight.add(change);
    }

    fn store(&mut self, event: StoreEvent, count: u64) {
        if let Some(metric) = names::store_event_index(event).and_then(|i| self.0.store.get(i)) {
            increment(metric, count);
        }
    }
}
