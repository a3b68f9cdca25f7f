//! What the limiter's tests share: a configuration built on a memory store,
//! requests given by their headers, and counters that tally by rule index.

use std::collections::HashMap;

pub(super) use crate::algorithm::Admission;
pub(super) use crate::config::Config;
pub(super) use crate::descriptor::StaticRequest;
pub(super) use crate::lease::pool::{GrantedLease, Leftover};
pub(super) use crate::store::{MemoryStore, Step};
pub(super) use crate::time::{Nanos, SECOND};

pub(super) use super::{CanWait, RequestEvent};
use super::{CompiledRule, Counters, Limiter, RuleEvent, StoreEvent};

pub(super) const T0: Nanos = Nanos::from_secs(1_700_000_000);

/// One rule of 3 per hour per `x-api-key`.
pub(super) const PER_KEY: &str = r#"{"rules": [{"name": "per-key", "limit": 3, "period": "1h",
    "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "k"}}]}], "max_keys": 64}"#;

/// A global rule per `x-api-key`, with a local fall-back of 2 per hour.
pub(super) const GLOBAL: &str = r#"{"rules": [{"name": "fleet", "scope": "global",
    "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "api_key"}}],
    "fallback": {"limit": 2, "period": "1h"}}],
    "global": {"cluster": "quota", "domain": "edge"}, "max_keys": 64}"#;

/// What the limiter counted, by rule index (rules carry their index as host data).
#[derive(Default)]
pub(super) struct Tally {
    pub requests: HashMap<RequestEvent, u64>,
    pub rules: HashMap<(usize, &'static str), u64>,
    pub store: HashMap<&'static str, u64>,
    pub in_flight: HashMap<usize, i64>,
}

impl Counters<usize> for Tally {
    fn request(&mut self, event: RequestEvent) {
        *self.requests.entry(event).or_default() += 1;
    }
    fn rule(&mut self, rule: &CompiledRule<usize>, event: RuleEvent) {
        let name = match event {
            RuleEvent::Allowed => "allowed",
            RuleEvent::Delayed => "delayed",
            RuleEvent::Limited => "limited",
            RuleEvent::ShadowLimited => "shadow_limited",
            RuleEvent::Fallback => "fallback",
            RuleEvent::Overshoot => "overshoot",
        };
        *self.rules.entry((rule.host, name)).or_default() += 1;
    }
    fn store(&mut self, event: StoreEvent, count: u64) {
        *self.store.entry(format!("{event:?}").leak()).or_default() += count;
    }
    fn in_flight(&mut self, rule: &CompiledRule<usize>, change: i64) {
        *self.in_flight.entry(rule.host).or_default() += change;
    }
}

pub(super) fn build(json: &str, store: &MemoryStore) -> Limiter<usize> {
    build_with(json, store, [7; 16])
}

pub(super) fn build_with(json: &str, store: &MemoryStore, entropy: [u8; 16]) -> Limiter<usize> {
    let mut next = 0;
    Limiter::prepare(Config::parse(json.as_bytes()).unwrap(), store, entropy, |_| {
        next += 1;
        next - 1
    })
    .unwrap()
}

/// A request whose headers are given by name.
pub(super) fn request(limiter: &Limiter<usize>, headers: &[(&str, &str)]) -> StaticRequest {
    let values = limiter
        .header_names()
        .iter()
        .map(|name| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_bytes().to_vec()))
        .collect();
    StaticRequest { headers: values, remote_address: Some(b"10.0.0.1:5555".to_vec()), ..Default::default() }
}

pub(super) fn admitted(
    limiter: &Limiter<usize>,
    store: &MemoryStore,
    now: Nanos,
    headers: &[(&str, &str)],
    tally: &mut Tally,
) -> bool {
    limiter.check(store, now, &mut request(limiter, headers), tally).0.allowed()
}

/// A grant of `granted` tokens for 10 s, under a limit of 100 per minute.
pub(super) fn lease(id: u64, granted: u64) -> GrantedLease {
    GrantedLease {
        lease: id,
        granted,
        valid: SECOND.times(10),
        starts: Nanos::ZERO,
        index: 0,
        windows: 0,
        limit: 100,
        window: SECOND.times(60),
        unleased: 50,
        reset: SECOND.times(30),
        near_limit: false,
        report_only: false,
        checked: false,
    }
}
