//! The filter's metrics in the native build: the wasm build's names
//! (`floodgate-filter-common`), defined with the configuration on Envoy's
//! main thread and moved by each stream, through the stream, as its events
//! happen. Envoy's counters are process-wide atomics, so nothing is kept
//! back in the worker to be flushed later, as the wasm build must (a host
//! call there costs a trip out of the sandbox).
//!
//! In `/stats` they read `dynamicmodulescustom.floodgate.<name>` (Envoy's
//! prefix for a dynamic module's metrics; the module's `metrics_namespace`
//! changes it).

use floodgate_core::config::Config;
use floodgate_core::limiter::{CompiledRule, Counters, RequestEvent, RuleEvent, StoreEvent};
use floodgate_filter_common::metrics::{self as names, Counter, COUNTERS, FAILURES, RULE_EVENTS, STORE_EVENTS};

use crate::abi::{Definer, Filter};

/// One rule's metric ids: the host data of its [`CompiledRule`].
#[derive(Debug, Clone, Default)]
pub struct RuleIds {
    events: [Option<usize>; RULE_EVENTS.len()],
    /// Units in flight, for algorithms that hold units until requests end.
    in_flight: Option<usize>,
}

/// Every metric id of a configuration (`None`: Envoy refused to define it,
/// and it counts nothing).
#[derive(Debug, Clone)]
pub struct MetricIds {
    counters: [Option<usize>; COUNTERS.len()],
    store: [Option<usize>; STORE_EVENTS.len()],
    /// Global mode's failed calls, by kind: defined as in the wasm build,
    /// moved once global mode is served.
    #[allow(dead_code)]
    callouts_failed: [Option<usize>; FAILURES.len()],
    rules: Vec<RuleIds>,
}

impl MetricIds {
    /// Defines every metric of `config`: the plugin-wide ones and each
    /// rule's, under the same names as the wasm build.
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
    pub fn on<'a>(&'a self, filter: &'a Filter<'_>) -> StreamCounters<'a> {
        StreamCounters { ids: self, filter: Some(filter) }
    }

    /// A sink that counts nothing: for a stream torn down without its last
    /// event, when no stream is left to count through.
    pub fn nowhere(&self) -> StreamCounters<'_> {
        StreamCounters { ids: self, filter: None }
    }
}

/// Moves a configuration's metrics through one stream.
pub struct StreamCounters<'a> {
    ids: &'a MetricIds,
    filter: Option<&'a Filter<'a>>,
}

impl StreamCounters<'_> {
    /// Adds `by` to `counter`.
    pub fn count(&mut self, counter: Counter, by: u64) {
        if let Some(id) = self.ids.counters.get(counter as usize).copied().flatten() {
            self.add(id, by);
        }
    }

    fn add(&self, id: usize, by: u64) {
        if let (Some(filter), 1..) = (self.filter, by) {
            filter.increment_counter(id, by);
        }
    }
}

impl Counters<RuleIds> for StreamCounters<'_> {
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
        if let (Some(filter), Some(id)) = (self.filter, rule.host.in_flight) {
            filter.move_gauge(id, change);
        }
    }
}
