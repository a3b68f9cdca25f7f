//! The limiter: every rule that applies to a request decides on its bucket in
//! the shared store; the request passes only if all allow.
//!
//! Rules decide in order. A rule that denies stops the check, and the units
//! already taken by earlier rules for this request are given back, so a
//! request denied by a later rule does not consume from earlier ones. (In a
//! race, that refund can make another request see a bucket emptier than it
//! will end up: the limiter may under-admit for an instant, never over-admit.)

use crate::algorithm::Decision;
use crate::config::{Config, Cost, FailureMode, Rule};
use crate::descriptor::{fingerprint, Request};
use crate::store::{measure_and_replace, LoopError, Replaced, Store, StoreError};
use crate::table::TableOutcome;
use crate::text::InlineText;
use crate::time::Nanos;

/// Shared-data key holding the per-VM secret that keys descriptor hashing.
pub const SEED_KEY: &str = "fg:seed";

/// Room for a group's key, `fg:<rule>:<group>`: a rule name is at most 64
/// bytes and a group number at most 7 digits, 75 bytes in all.
type Key = InlineText<96>;

/// Host memory per shared-data entry beyond its key and value: measured on
/// Envoy 1.40 at about 97 bytes with a million clients (allocator rounding
/// included); 128 leaves a margin, since this is stated as a bound.
pub const SHARED_DATA_ENTRY_OVERHEAD: u64 = 128;

/// A per-rule outcome worth counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleEvent {
    /// The rule allowed a request that was let through.
    Allowed,
    /// The rule denied a request, which was answered as limited.
    Limited,
    /// The rule would have denied, but is in shadow mode.
    ShadowLimited,
}

/// A store-level occurrence worth counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreEvent {
    /// Writes that lost a race and were decided again.
    CasRetries,
    /// Decisions abandoned after the last retry; the failure mode applied.
    RetriesExhausted,
    /// Idle buckets of other descriptors reused.
    SlotEvictions,
    /// New descriptors that found every bucket of their group live; the
    /// failure mode applied.
    TableFull,
    /// Shared-data reads or writes that failed; the failure mode applied.
    StoreErrors,
    /// Stored groups that did not decode and were started afresh.
    CorruptState,
}

/// Receives what the limiter counts. The filter maps these to Envoy metrics.
pub trait Counters {
    /// Counts one per-rule outcome.
    fn rule(&mut self, rule: usize, event: RuleEvent);
    /// Counts `count` store occurrences.
    fn store(&mut self, event: StoreEvent, count: u64);
}

/// The rule whose numbers a response reports: the one that denied, or else
/// the most restrictive that allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// Index of the rule in [`Config::rules`].
    pub rule: usize,
    /// Its decision.
    pub decision: Decision,
}

/// The verdict on one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// Whether to let the request through.
    pub allowed: bool,
    /// The first rule in shadow mode that would have denied it, if any.
    pub shadow_limited: Option<usize>,
    /// Some rule could not decide and the failure mode applied.
    pub failed: bool,
    /// The numbers for the rate-limit headers, if any rule decided.
    pub report: Option<Report>,
}

#[derive(Clone, Copy)]
struct Taken {
    rule: usize,
    group: u32,
    fingerprint: u64,
    cost: u64,
}

/// A configured limiter: built once per configuration, asked once per request.
#[derive(Debug)]
pub struct Limiter {
    config: Config,
    hash_key: (u64, u64),
    /// Per rule, `fg:<name>:`: a group's shared-data key is this and its number.
    key_prefixes: Vec<String>,
}

impl Limiter {
    /// Prepares `config` on `store`: reads the per-VM hashing secret (creating
    /// it from `entropy` if this is the first configuration), and creates
    /// every bucket group of every rule that does not exist yet.
    ///
    /// Creation is not atomic on Envoy, so this must run before traffic on a
    /// single thread: the filter calls it from `on_configure`, which Envoy
    /// runs on its main thread before the workers'.
    pub fn prepare(config: Config, store: &dyn Store, entropy: [u8; 16]) -> Result<Limiter, StoreError> {
        store.create_if_absent(SEED_KEY, &entropy)?;
        let seed = store.get(SEED_KEY)?.map(|(v, _)| v).unwrap_or_default();
        let word = |at: usize| crate::algorithm::get_u64(&seed, at).unwrap_or(0);
        let key_prefixes = config.rules.iter().map(|rule| format!("fg:{}:", rule.name)).collect();
        let limiter = Limiter { hash_key: (word(0), word(8)), config, key_prefixes };
        let mut key = Key::default();
        for (index, rule) in limiter.config.rules.iter().enumerate() {
            let groups = rule.table.groups();
            // Groups are created in order, so the last one existing means all do.
            limiter.write_key(index, groups - 1, &mut key)?;
            if store.get(key.as_str())?.is_some() {
                continue;
            }
            let empty = rule.table.empty_group();
            for group in 0..groups {
                limiter.write_key(index, group, &mut key)?;
                store.create_if_absent(key.as_str(), &empty)?;
            }
        }
        Ok(limiter)
    }

    /// The configuration this limiter enforces.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Writes the shared-data key of a rule's bucket group into `key`. It
    /// always fits (see [`Key`]); if it did not, that would be a store error
    /// rather than a wrong key.
    fn write_key(&self, rule: usize, group: u32, key: &mut Key) -> Result<(), StoreError> {
        key.clear();
        let prefix = self.key_prefixes.get(rule).map_or("", String::as_str);
        if key.push_str(prefix) && key.push_u64(u64::from(group)) {
            Ok(())
        } else {
            Err(StoreError::Host)
        }
    }

    /// The most host memory a rule's buckets can take, in bytes.
    pub fn shared_data_bytes(&self, rule: usize) -> u64 {
        let Some(r) = self.config.rules.get(rule) else { return 0 };
        let groups = r.table.groups();
        // The longest key is the last group's.
        let mut key = Key::default();
        let key_len = self.write_key(rule, groups - 1, &mut key).map_or(0, |()| key.len()) as u64;
        u64::from(groups) * (SHARED_DATA_ENTRY_OVERHEAD + key_len + r.table.max_group_len() as u64)
    }

    /// Decides on `request` at `now`.
    pub fn check(
        &self,
        store: &dyn Store,
        now: Nanos,
        request: &mut dyn Request,
        counters: &mut dyn Counters,
    ) -> Verdict {
        let mut taken: Vec<Taken> = Vec::new();
        let mut key = Key::default();
        let mut verdict = Verdict { allowed: true, shadow_limited: None, failed: false, report: None };
        let mut shadowed: Vec<usize> = Vec::new();
        for (index, rule) in self.config.rules.iter().enumerate() {
            if !rule.request_match.matches(request) {
                continue;
            }
            let Some(fp) = fingerprint(self.hash_key, &rule.name, &rule.descriptors, request) else {
                continue;
            };
            let cost = request_cost(rule, request);
            let group = rule.table.group_of(fp);
            let shadow = rule.shadow_mode || self.config.shadow_mode;
            let result = self.write_key(index, group, &mut key).map_err(LoopError::Store).and_then(|()| {
                measure_and_replace(store, key.as_str(), self.config.max_cas_retries, |group| {
                    rule.table.decide(group, fp, now, cost)
                })
            });
            let decided = match result {
                Ok(Replaced { outcome, retries }) => {
                    if retries > 0 {
                        counters.store(StoreEvent::CasRetries, u64::from(retries));
                    }
                    match outcome {
                        TableOutcome::Decided { decision, reused_idle, was_corrupt } => {
                            if reused_idle {
                                counters.store(StoreEvent::SlotEvictions, 1);
                            }
                            if was_corrupt {
                                counters.store(StoreEvent::CorruptState, 1);
                            }
                            Some(decision)
                        }
                        TableOutcome::Full => {
                            counters.store(StoreEvent::TableFull, 1);
                            None
                        }
                    }
                }
                Err(LoopError::RetriesExhausted) => {
                    self.count_exhausted(counters);
                    None
                }
                Err(LoopError::Store(_)) => {
                    counters.store(StoreEvent::StoreErrors, 1);
                    None
                }
            };
            match decided {
                Some(decision) if decision.allowed => {
                    taken.push(Taken { rule: index, group, fingerprint: fp, cost });
                    verdict.report = Some(more_restrictive(verdict.report, Report { rule: index, decision }));
                }
                Some(_) if shadow => {
                    verdict.shadow_limited = verdict.shadow_limited.or(Some(index));
                    shadowed.push(index);
                }
                Some(decision) => {
                    self.give_back(store, now, &taken, counters);
                    counters.rule(index, RuleEvent::Limited);
                    shadowed.iter().for_each(|&i| counters.rule(i, RuleEvent::ShadowLimited));
                    return Verdict { allowed: false, report: Some(Report { rule: index, decision }), ..verdict };
                }
                None => {
                    verdict.failed = true;
                    if self.config.failure_mode == FailureMode::Deny && !shadow {
                        self.give_back(store, now, &taken, counters);
                        shadowed.iter().for_each(|&i| counters.rule(i, RuleEvent::ShadowLimited));
                        return Verdict { allowed: false, report: None, ..verdict };
                    }
                }
            }
        }
        taken.iter().for_each(|t| counters.rule(t.rule, RuleEvent::Allowed));
        shadowed.iter().for_each(|&i| counters.rule(i, RuleEvent::ShadowLimited));
        verdict
    }

    fn give_back(&self, store: &dyn Store, now: Nanos, taken: &[Taken], counters: &mut dyn Counters) {
        let mut key = Key::default();
        for t in taken.iter().rev() {
            let Some(rule) = self.config.rules.get(t.rule) else { continue };
            let result = self.write_key(t.rule, t.group, &mut key).map_err(LoopError::Store).and_then(|()| {
                measure_and_replace(store, key.as_str(), self.config.max_cas_retries, |group| {
                    rule.table.refund(group, t.fingerprint, now, t.cost)
                })
            });
            match result {
                Ok(Replaced { retries, .. }) if retries > 0 => {
                    counters.store(StoreEvent::CasRetries, u64::from(retries))
                }
                Ok(_) => {}
                Err(LoopError::RetriesExhausted) => self.count_exhausted(counters),
                Err(LoopError::Store(_)) => counters.store(StoreEvent::StoreErrors, 1),
            }
        }
    }

    fn count_exhausted(&self, counters: &mut dyn Counters) {
        if self.config.max_cas_retries > 0 {
            counters.store(StoreEvent::CasRetries, u64::from(self.config.max_cas_retries));
        }
        counters.store(StoreEvent::RetriesExhausted, 1);
    }
}

/// The cost of `request` under `rule`.
fn request_cost(rule: &Rule, request: &mut dyn Request) -> u64 {
    match &rule.cost {
        Cost::Fixed(cost) => *cost,
        Cost::FromHeader { header, default, max } => {
            request.header(*header).and_then(parse_decimal).map_or(*default, |cost| cost.clamp(1, *max))
        }
    }
}

/// A plain decimal number of at most 19 digits (so it fits a u64).
fn parse_decimal(bytes: &[u8]) -> Option<u64> {
    if bytes.is_empty() || bytes.len() > 19 || !bytes.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(bytes.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0')))
}

/// The report with fewer units remaining; on a tie, the one that takes
/// longer to recover.
fn more_restrictive(current: Option<Report>, candidate: Report) -> Report {
    match current {
        Some(current)
            if (current.decision.remaining, std::cmp::Reverse(current.decision.reset))
                <= (candidate.decision.remaining, std::cmp::Reverse(candidate.decision.reset)) =>
        {
            current
        }
        _ => candidate,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::descriptor::StaticRequest;
    use crate::store::{MemoryStore, Step};
    use crate::time::SECOND;
    use std::cell::Cell;
    use std::collections::HashMap;
    use std::rc::Rc;

    const T0: Nanos = 1_700_000_000 * SECOND;

    #[derive(Default)]
    struct Tally {
        rules: HashMap<(usize, &'static str), u64>,
        store: HashMap<&'static str, u64>,
    }

    impl Counters for Tally {
        fn rule(&mut self, rule: usize, event: RuleEvent) {
            let name = match event {
                RuleEvent::Allowed => "allowed",
                RuleEvent::Limited => "limited",
                RuleEvent::ShadowLimited => "shadow_limited",
            };
            *self.rules.entry((rule, name)).or_default() += 1;
        }
        fn store(&mut self, event: StoreEvent, count: u64) {
            *self.store.entry(format!("{event:?}").leak()).or_default() += count;
        }
    }

    fn build(json: &str, store: &MemoryStore) -> Limiter {
        Limiter::prepare(Config::parse(json.as_bytes()).unwrap(), store, [7; 16]).unwrap()
    }

    /// A request whose headers are given by name.
    fn request(limiter: &Limiter, headers: &[(&str, &str)]) -> StaticRequest {
        let values = limiter
            .config()
            .header_names
            .iter()
            .map(|name| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_bytes().to_vec()))
            .collect();
        StaticRequest { headers: values, remote_address: Some(b"10.0.0.1:5555".to_vec()) }
    }

    fn admitted(
        limiter: &Limiter,
        store: &MemoryStore,
        now: Nanos,
        headers: &[(&str, &str)],
        tally: &mut Tally,
    ) -> bool {
        limiter.check(store, now, &mut request(limiter, headers), tally).allowed
    }

    const PER_KEY: &str = r#"{"rules": [{"name": "per-key", "limit": 3, "period": "1h",
        "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "k"}}]}], "max_keys": 64}"#;

    #[test]
    fn each_key_gets_exactly_its_limit() {
        let store = MemoryStore::default();
        let limiter = build(PER_KEY, &store);
        let mut tally = Tally::default();
        for key in ["a", "b", "c"] {
            let ok = (0..10).filter(|_| admitted(&limiter, &store, T0, &[("x-api-key", key)], &mut tally)).count();
            assert_eq!(ok, 3, "key {key}");
        }
        assert_eq!(tally.rules[&(0, "allowed")], 9);
        assert_eq!(tally.rules[&(0, "limited")], 21);
    }

    #[test]
    fn prepare_creates_every_group_once_and_keeps_the_seed() {
        let store = MemoryStore::default();
        let first = build(PER_KEY, &store);
        assert_eq!(store.len(), 1 + 16, "seed + 64 keys / 4 ways");
        let again = Limiter::prepare(Config::parse(PER_KEY.as_bytes()).unwrap(), &store, [9; 16]).unwrap();
        assert_eq!(first.hash_key, again.hash_key, "a later configuration keeps the first secret");
        assert_eq!(store.len(), 17);
        assert_eq!(
            first.shared_data_bytes(0),
            16 * (SHARED_DATA_ENTRY_OVERHEAD + "fg:per-key:15".len() as u64 + 2 + 4 * 24)
        );
    }

    #[test]
    fn the_longest_key_fits() {
        let name = "n".repeat(64);
        let json = format!(r#"{{"rules": [{{"name": "{name}", "limit": 1, "period": "1s", "max_keys": 4}}]}}"#);
        let store = MemoryStore::default();
        let limiter = build(&json, &store);
        let mut key = Key::default();
        let most_groups = (crate::config::MAX_MAX_KEYS / 4 - 1) as u32;
        assert_eq!(limiter.write_key(0, most_groups, &mut key), Ok(()));
        assert_eq!(key.as_str(), format!("fg:{name}:{most_groups}"));
    }

    #[test]
    fn a_request_without_the_header_skips_the_rule() {
        let store = MemoryStore::default();
        let limiter = build(PER_KEY, &store);
        let mut tally = Tally::default();
        for _ in 0..10 {
            let verdict = limiter.check(&store, T0, &mut request(&limiter, &[]), &mut tally);
            assert!(verdict.allowed);
            assert_eq!(verdict.report, None);
        }
    }

    const TWO_RULES: &str = r#"{"rules": [
        {"name": "global", "limit": 10, "period": "1h"},
        {"name": "per-key", "limit": 2, "period": "1h",
         "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "k"}}]}]}"#;

    #[test]
    fn a_request_denied_by_a_later_rule_does_not_consume_from_earlier_ones() {
        let store = MemoryStore::default();
        let limiter = build(TWO_RULES, &store);
        let mut tally = Tally::default();
        // Key "a" may pass twice; its 8 denied requests must not drain "global".
        let a = (0..10).filter(|_| admitted(&limiter, &store, T0, &[("x-api-key", "a")], &mut tally)).count();
        assert_eq!(a, 2);
        // So 8 more units of the global 10 are left for other keys.
        let others =
            (0..20).filter(|i| admitted(&limiter, &store, T0, &[("x-api-key", &format!("k{i}"))], &mut tally)).count();
        assert_eq!(others, 8);
        assert_eq!(tally.rules[&(1, "limited")], 8);
        assert_eq!(tally.rules[&(0, "limited")], 12);
    }

    #[test]
    fn the_report_is_the_most_restrictive_rule() {
        let store = MemoryStore::default();
        let limiter = build(TWO_RULES, &store);
        let mut tally = Tally::default();
        let verdict = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally);
        let report = verdict.report.unwrap();
        assert_eq!(report.rule, 1);
        assert_eq!(report.decision.remaining, 1);
        let verdict = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally);
        verdict.report.unwrap();
        let denied = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally);
        assert!(!denied.allowed);
        let report = denied.report.unwrap();
        assert_eq!(report.rule, 1);
        assert_eq!(report.decision.retry_after, 1800 * SECOND, "2 per hour: one every 30 minutes");
    }

    #[test]
    fn shadow_mode_lets_everything_through_and_counts() {
        let json = PER_KEY.replace(r#""limit": 3"#, r#""limit": 3, "shadow_mode": true"#);
        let store = MemoryStore::default();
        let limiter = build(&json, &store);
        let mut tally = Tally::default();
        for _ in 0..10 {
            let verdict = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally);
            assert!(verdict.allowed);
        }
        assert_eq!(tally.rules[&(0, "allowed")], 3);
        assert_eq!(tally.rules[&(0, "shadow_limited")], 7);
        let verdict = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally);
        assert_eq!(verdict.shadow_limited, Some(0), "the verdict names the rule");
        // Global shadow mode does the same.
        let json = PER_KEY.replace(r#""max_keys": 64"#, r#""max_keys": 64, "shadow_mode": true"#);
        let store = MemoryStore::default();
        let limiter = build(&json, &store);
        let all = (0..10).filter(|_| admitted(&limiter, &store, T0, &[("x-api-key", "a")], &mut tally)).count();
        assert_eq!(all, 10);
    }

    #[test]
    fn a_shadow_denial_is_counted_even_when_a_later_rule_denies() {
        let json = r#"{"rules": [
            {"name": "watch", "limit": 1, "period": "1h", "shadow_mode": true},
            {"name": "enforce", "limit": 1, "period": "1h"}]}"#;
        let store = MemoryStore::default();
        let limiter = build(json, &store);
        let mut tally = Tally::default();
        assert!(admitted(&limiter, &store, T0, &[], &mut tally));
        let verdict = limiter.check(&store, T0, &mut request(&limiter, &[]), &mut tally);
        assert!(!verdict.allowed);
        assert_eq!(verdict.shadow_limited, Some(0));
        assert_eq!(tally.rules[&(0, "shadow_limited")], 1);
        assert_eq!(tally.rules[&(1, "limited")], 1);
    }

    #[test]
    fn refill_over_time() {
        let json = PER_KEY.replace(r#""period": "1h""#, r#""period": "3s""#);
        let store = MemoryStore::default();
        let limiter = build(&json, &store);
        let mut tally = Tally::default();
        let burst = (0..5).filter(|_| admitted(&limiter, &store, T0, &[("x-api-key", "a")], &mut tally)).count();
        assert_eq!(burst, 3);
        assert!(!admitted(&limiter, &store, T0 + SECOND - 1, &[("x-api-key", "a")], &mut tally));
        assert!(admitted(&limiter, &store, T0 + SECOND, &[("x-api-key", "a")], &mut tally));
        assert!(!admitted(&limiter, &store, T0 + SECOND, &[("x-api-key", "a")], &mut tally));
    }

    #[test]
    fn cost_from_header_is_bounded() {
        let json = r#"{"rules": [{"name": "tokens", "limit": 100, "period": "1h", "cost": 2,
            "cost_from_header": {"header_name": "x-cost", "max": 40}}]}"#;
        let store = MemoryStore::default();
        let limiter = build(json, &store);
        let mut tally = Tally::default();
        let mut remaining = |headers: &[(&str, &str)]| {
            limiter.check(&store, T0, &mut request(&limiter, headers), &mut tally).report.unwrap().decision.remaining
        };
        assert_eq!(remaining(&[("x-cost", "10")]), 90);
        assert_eq!(remaining(&[("x-cost", "1000000")]), 50, "clamped to max 40");
        assert_eq!(remaining(&[("x-cost", "0")]), 49, "at least 1");
        assert_eq!(remaining(&[("x-cost", "ten")]), 47, "unreadable: the default cost");
        assert_eq!(remaining(&[]), 45, "absent: the default cost");
    }

    /// Rivals on other workers take units between our read and our write; the
    /// loop must re-decide on what they left, so the total admitted by us and
    /// them together never exceeds the limit.
    #[test]
    fn conflicting_writers_never_over_admit() {
        let json = r#"{"rules": [{"name": "hot", "limit": 5, "period": "1h"}]}"#;
        let store = MemoryStore::default();
        let limiter = build(json, &store);
        let rule = &limiter.config().rules[0];
        let fp = fingerprint(limiter.hash_key, "hot", &rule.descriptors, &mut request(&limiter, &[])).unwrap();
        let table = rule.table.clone();
        let rival_admitted = Rc::new(Cell::new(0));
        let counted = Rc::clone(&rival_admitted);
        store.interfere(100, move |_, group: &[u8]| match table.decide(group.to_vec(), fp, T0, 1) {
            Step::Write(next, _) => {
                counted.set(counted.get() + 1);
                Some(next)
            }
            Step::Keep(_) => None,
        });
        let mut tally = Tally::default();
        let ours = (0..20).filter(|_| admitted(&limiter, &store, T0, &[], &mut tally)).count();
        assert_eq!(ours + rival_admitted.get(), 5, "ours {ours}, rivals {}", rival_admitted.get());
        assert!(tally.store["CasRetries"] > 0);
    }

    #[test]
    fn exhausted_retries_follow_the_failure_mode() {
        for (mode, expect_allowed) in [("allow", true), ("deny", false)] {
            let json = format!(
                r#"{{"rules": [{{"name": "hot", "limit": 5, "period": "1h"}}], "max_cas_retries": 2, "failure_mode": "{mode}"}}"#
            );
            let store = MemoryStore::default();
            let limiter = build(&json, &store);
            store.interfere(3, |_, _: &[u8]| None);
            let mut tally = Tally::default();
            let verdict = limiter.check(&store, T0, &mut request(&limiter, &[]), &mut tally);
            assert_eq!(verdict.allowed, expect_allowed, "{mode}");
            assert!(verdict.failed);
            assert_eq!(tally.store["RetriesExhausted"], 1);
            assert_eq!(tally.store["CasRetries"], 2);
        }
    }

    #[test]
    fn a_full_table_follows_the_failure_mode_and_never_evicts_live_buckets() {
        let json = r#"{"rules": [{"name": "r", "limit": 1, "period": "1h", "max_keys": 4,
            "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "k"}}]}],
            "failure_mode": "deny"}"#;
        let store = MemoryStore::default();
        let limiter = build(json, &store);
        let mut tally = Tally::default();
        for key in ["a", "b", "c", "d"] {
            assert!(admitted(&limiter, &store, T0, &[("x-api-key", key)], &mut tally));
        }
        assert!(!admitted(&limiter, &store, T0, &[("x-api-key", "e")], &mut tally));
        assert_eq!(tally.store["TableFull"], 1);
        // "a" is still limited: its bucket was not handed to "e".
        assert!(!admitted(&limiter, &store, T0, &[("x-api-key", "a")], &mut tally));
    }

    #[test]
    fn a_missing_group_is_a_store_error_not_a_racy_create() {
        let store = MemoryStore::default();
        let limiter = build(PER_KEY, &store);
        let empty = MemoryStore::default();
        let mut tally = Tally::default();
        let verdict = limiter.check(&empty, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally);
        assert!(verdict.allowed && verdict.failed);
        assert_eq!(tally.store["StoreErrors"], 1);
        assert!(empty.is_empty(), "nothing was created on the request path");
    }
}
