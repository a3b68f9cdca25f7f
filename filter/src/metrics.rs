//! Envoy metrics for the limiter's counts, defined once per configuration.
//!
//! Counts add up in the worker ([`Metric`]) and reach Envoy when the worker
//! flushes them: on its tick, at most [`FLUSH_PERIOD`] after the first count
//! since the last flush, and at the end of every root-context callback. So a
//! request makes no host call for its counts; Envoy's stats lag the worker
//! by at most the flush period.
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
use proxy_wasm::types::MetricType;

use crate::host::Host;

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
        let name = |metric: &str| format!("floodgate.rule.{}.{metric}", rule.name);
        Self {
            events: RULE_EVENTS.map(|(_, event)| counter(host, &name(event))),
            in_flight: if rule.policy().holds_until_done() {
                gauge(host, &name("in_flight"))
            } else {
                Metric::default()
            },
            fallback_active: rule
                .global
                .as_ref()
                .and_then(|_| host.define_metric(MetricType::Gauge, &name("fallback_active")).ok()),
        }
    }

    fn flush(&self, host: &impl Host) {
        self.events.iter().for_each(|metric| metric.flush(host));
        self.in_flight.flush(host);
    }
}

/// The plugin-wide counters.
pub struct Metrics {
    allowed: Metric,
    limited: Metric,
    shadow_limited: Metric,
    store: [Metric; STORE_EVENTS.len()],
    /// Requests a shaper delayed, and that went on after waiting.
    pub delayed: Metric,
    /// Milliseconds of delay the shaper asked for, summed.
    pub delay_requested_ms: Metric,
    /// Milliseconds delayed requests actually waited, summed.
    pub delay_actual_ms: Metric,
    /// Delayed requests whose client left while they waited.
    pub delay_abandoned: Metric,
    /// Requests denied because this worker already had
    /// `max_delayed_per_worker` requests waiting.
    delay_queue_full: Metric,
    /// Lease-pool refreshes claimed.
    pub refreshes: Metric,
    /// Calls sent to the quota service.
    pub callouts_sent: Metric,
    /// Calls answered usably.
    pub callouts_ok: Metric,
    /// Calls failed, by kind (see [`Metrics::count_failed_callout`]).
    callouts_failed: [Metric; 5],
    /// Tokens granted to this Envoy's pools.
    pub tokens_leased: Metric,
    /// Unspent tokens given back to the service.
    pub tokens_returned: Metric,
    /// Tokens whose lease ended before they were spent.
    pub tokens_expired: Metric,
    /// Requests that waited for an empty pool's refill.
    pub refill_waits: Metric,
    /// Milliseconds they waited, summed.
    pub refill_wait_ms: Metric,
}

impl Metrics {
    /// Defines every plugin-wide metric.
    pub fn define(host: &impl Host) -> Self {
        let counter = |name: &str| counter(host, name);
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
        increment(&self.callouts_failed[kind], 1);
    }

    /// Hands every count of this worker to Envoy: the plugin-wide ones and
    /// those of `limiter`'s rules. (Every field is named, so a new metric
    /// cannot be left out of the flush.)
    pub fn flush(&self, host: &impl Host, limiter: &Limiter<RuleMetrics>) {
        let Metrics {
            allowed,
            limited,
            shadow_limited,
            store,
            delayed,
            delay_requested_ms,
            delay_actual_ms,
            delay_abandoned,
            delay_queue_full,
            refreshes,
            callouts_sent,
            callouts_ok,
            callouts_failed,
            tokens_leased,
            tokens_returned,
            tokens_expired,
            refill_waits,
            refill_wait_ms,
        } = self;
        let single = [
            allowed,
            limited,
            shadow_limited,
            delayed,
            delay_requested_ms,
            delay_actual_ms,
            delay_abandoned,
            delay_queue_full,
            refreshes,
            callouts_sent,
            callouts_ok,
            tokens_leased,
            tokens_returned,
            tokens_expired,
            refill_waits,
            refill_wait_ms,
        ];
        single.into_iter().chain(store).chain(callouts_failed).for_each(|metric| metric.flush(host));
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
        let metrics = self.0;
        increment(
            match event {
                RequestEvent::Allowed => &metrics.allowed,
                RequestEvent::Limited => &metrics.limited,
                RequestEvent::ShadowLimited => &metrics.shadow_limited,
                RequestEvent::NoRoomToWait => &metrics.delay_queue_full,
            },
            1,
        );
    }

    fn rule(&mut self, rule: &CompiledRule<RuleMetrics>, event: RuleEvent) {
        if let Some(metric) = RULE_EVENTS.iter().position(|(e, _)| *e == event).and_then(|i| rule.host.events.get(i)) {
            increment(metric, 1);
        }
    }

    /// Moves the rule's in-flight gauge.
    fn in_flight(&mut self, rule: &CompiledRule<RuleMetrics>, change: i64) {
        rule.host.in_flight.add(change);
    }

    fn store(&mut self, event: StoreEvent, count: u64) {
        if let Some(metric) = STORE_EVENTS.iter().position(|(e, _)| *e == event).and_then(|i| self.0.store.get(i)) {
            increment(metric, count);
        }
    }
}
