//! The filter's metrics in the native build: the wasm build's names
//! (`floodgate-filter-common`), defined with the configuration on Envoy's
//! main thread and moved by each stream, through the stream, as its events
//! happen, and by the configuration's quota client on the main thread.
//! Envoy's counters are process-wide atomics, so nothing is kept back in
//! the worker to be flushed later, as the wasm build must (a host call
//! there costs a trip out of the sandbox).
//!
//! In `/stats` they read `dynamicmodulescustom.floodgate.<name>` (Envoy's
//! prefix for a dynamic module's metrics; the module's `metrics_namespace`
//! changes it).

use floodgate_core::config::Config;
use floodgate_core::global::calls::CallError;
use floodgate_core::limiter::{CompiledRule, Counters, Limiter, RequestEvent, RuleEvent, StoreEvent};
use floodgate_filter_common::metrics::{self as names, Counter, COUNTERS, FAILURES, RULE_EVENTS, STORE_EVENTS};

use crate::abi::{ConfigEnvoy, Definer, Filter};

/// One rule's metric ids: the host data of its [`CompiledRule`].
#[derive(Debug, Clone, Default)]
pub struct RuleIds {
    events: [Option<usize>; RULE_EVENTS.len()],
    /// Units in flight, for algorithms that hold units until requests end.
    in_flight: Option<usize>,
    /// A global rule's gauge: 1 while its fall-back is in force.
    fallback_active: Option<usize>,
}

/// Every metric id of a configuration (`None`: Envoy refused to define it,
/// and it counts nothing).
#[derive(Debug, Clone)]
pub struct MetricIds {
    counters: [Option<usize>; COUNTERS.len()],
    store: [Option<usize>; STORE_EVENTS.len()],
    /// Global mode's failed calls, by kind.
    callouts_failed: [Option<usize>; FAILURES.len()],
    rules: Vec<RuleIds>,
}

impl MetricIds {
    /// Defines every metric of `config`: the plugin-wide ones and each
    /// rule's (a global rule's `fallback_active` gauge too), under the same
    /// names as the wasm build.
    pub fn define(definer: &Definer<'_>, config: &Config) -> Self {
        let plugin = |name: &str| definer.counter(&names::plugin_metric(name));
        let rules = config
            .rules
            .iter()
            .map(|rule| {
                let name = |metric: &str| names::rule_metric(&rule.name, metric);
                RuleIds {
                    events: RULE_EVENTS.map(|(_, event)| definer.counter(&name(event))),
                    in_flight: rule
                        .policy()
                        .holds_until_done()
                        .then(|| definer.gauge(&name(names::IN_FLIGHT)))
                        .flatten(),
                    fallback_active: rule.global.as_ref().and_then(|_| definer.gauge(&name(names::FALLBACK_ACTIVE))),
                }
            })
            .collect();
        MetricIds {
            counters: COUNTERS.map(|(_, name)| plugin(name)),
            store: STORE_EVENTS.map(|(_, name)| plugin(name)),
            callouts_failed: FAILURES.map(|kind| definer.counter(&names::failure_metric(kind))),
            rules,
        }
    }

    /// Rule `index`'s ids.
    pub fn rule(&self, index: usize) -> RuleIds {
        self.rules.get(index).cloned().unwrap_or_default()
    }

    /// A [`Counters`] sink that moves the metrics through `filter`.
    pub fn on<'a>(&'a self, filter: &'a Filter<'_>) -> Counts<'a> {
        Counts { ids: self, sink: Sink::Stream(filter) }
    }

    /// A sink that moves the metrics through the configuration, on the
    /// main thread (units in flight are not among them: only requests hold
    /// units in flight).
    pub fn on_config<'a>(&'a self, config: &'a ConfigEnvoy<'_>) -> Counts<'a> {
        Counts { ids: self, sink: Sink::Config(config) }
    }

    /// A sink that counts nothing: for a stream torn down without its last
    /// event, when no stream is left to count through.
    pub fn nowhere(&self) -> Counts<'_> {
        Counts { ids: self, sink: Sink::Nowhere }
    }

    /// Sets every global rule's `fallback_active` gauge from `limiter`'s
    /// view of the modes, through the configuration.
    pub fn set_modes(&self, config: &ConfigEnvoy<'_>, limiter: &Limiter<RuleIds>) {
        for compiled in limiter.rules() {
            if let Some(id) = compiled.host.fallback_active {
                config.set_gauge(id, u64::from(compiled.in_fallback()));
            }
        }
    }
}

/// Where counts go.
enum Sink<'a> {
    Stream(&'a Filter<'a>),
    Config(&'a ConfigEnvoy<'a>),
    Nowhere,
}

/// Moves a configuration's metrics through one stream, or through the
/// configuration itself.
pub struct Counts<'a> {
    ids: &'a MetricIds,
    sink: Sink<'a>,
}

impl Counts<'_> {
    /// Adds `by` to `counter`.
    pub fn count(&mut self, counter: Counter, by: u64) {
        if let Some(id) = self.ids.counters.get(counter as usize).copied().flatten() {
            self.add(id, by);
        }
    }

    /// Counts a failed call by kind (see [`names::failure_index`]).
    pub fn count_failed(&mut self, why: &CallError) {
        if let Some(id) = self.ids.callouts_failed.get(names::failure_index(why)).copied().flatten() {
            self.add(id, 1);
        }
    }

    fn add(&self, id: usize, by: u64) {
        if by == 0 {
            return;
        }
        match self.sink {
            Sink::Stream(filter) => filter.increment_counter(id, by),
            Sink::Config(config) => config.increment_counter(id, by),
            Sink::Nowhere => {}
        }
    }
}

impl Counters<RuleIds> for Counts<'_> {
    fn request(&mut self, event: RequestEvent) {
        self.count(names::request_counter(event), 1);
    }

    fn rule(&mut self, rule: &CompiledRule<RuleIds>, event: RuleEvent) {
        if let Some(id) = names::rule_event_index(event).and_then(|i| rule.host.events.get(i).copied().flatten()) {
            self.add(id, 1);
        }
    }

    fn store(&mut self, event: StoreEvent, count: u64) {
        if let Some(id) = names::store_event_index(event).and_then(|i| self.ids.store.get(i).copied().flatten()) {
            self.add(id, count);
        }
    }

    fn in_flight(&mut self, rule: &CompiledRule<RuleIds>, change: i64) {
        if let (Sink::Stream(filter), Some(id)) = (&self.sink, rule.host.in_flight) {
            filter.move_gauge(id, change);
        }
    }
}
