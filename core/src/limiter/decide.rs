//! The decision path: [`Limiter::check`] asks every rule that applies to a
//! request, [`Limiter::settle`] finishes a request whose check-mode rules the
//! quota service answered, and [`Limiter::release`] gives a permit's units
//! back.

use crate::algorithm::{Admission, Decision, Release};
use crate::descriptor::{fingerprint_from, has_entries, protocol_descriptor, Request};
use crate::global::calls::{CheckAnswer, CheckItem};
use crate::global::settings::{Fallback, GlobalMode};
use crate::store::Store;
use crate::table::Table;
use crate::time::Nanos;

use super::pass::{Pass, Ruling, Target};
use super::rule::Bucket;
use super::{CanWait, CompiledRule, Counters, Limiter, Permit, RuleEvent, Verdict};

impl<H> Limiter<H> {
    /// Decides on `request` at `now`. An admitted request's permit holds what
    /// each rule took; a denied or pending request's permit is empty (its
    /// units were already given back), except when check-mode rules are to
    /// be asked: then the permit holds the other rules' units until
    /// [`Limiter::settle`].
    pub fn check(
        &self,
        store: &dyn Store,
        now: Nanos,
        request: &mut dyn Request,
        counters: &mut dyn Counters<H>,
    ) -> (Verdict, Permit) {
        self.check_waited(store, now, request, CanWait::Yes, counters)
    }

    /// [`Limiter::check`] for a request that may not wait, or not any more
    /// (see [`CanWait`]). Every final verdict is counted here
    /// ([`RequestEvent`](super::RequestEvent)); a pending one when it is
    /// settled.
    pub fn check_waited(
        &self,
        store: &dyn Store,
        now: Nanos,
        request: &mut dyn Request,
        can_wait: CanWait,
        counters: &mut dyn Counters<H>,
    ) -> (Verdict, Permit) {
        let (mut verdict, mut permit) = (Verdict::default(), Permit::default());
        self.check_into(store, now, request, can_wait, counters, (&mut verdict, &mut permit));
        (verdict, permit)
    }

    /// [`Limiter::check_waited`] into a verdict and permit the caller holds
    /// (a host's own, where they are kept: not moved out and in again).
    /// Both are made anew first.
    pub fn check_into(
        &self,
        store: &dyn Store,
        now: Nanos,
        request: &mut dyn Request,
        can_wait: CanWait,
        counters: &mut dyn Counters<H>,
        (verdict, permit): (&mut Verdict, &mut Permit),
    ) {
        verdict.reset();
        permit.reset();
        let mut pass = Pass::new(self, store, now, can_wait, counters, (verdict, permit));
        let waited_out = can_wait == CanWait::WaitedOut;
        for (index, compiled) in self.rules.iter().enumerate() {
            let Some(target) = self.target(index, compiled, request) else { continue };
            let ruling = pass.rule(&target, request, waited_out);
            if pass.take(&target, ruling).is_break() {
                return pass.ended();
            }
        }
        pass.finish()
    }

    /// Finishes a request whose check-mode rules were asked: `answers` holds
    /// one answer per item of `verdict.checks`, or `None` when the call
    /// failed (then each rule follows its fall-back). Returns the final
    /// verdict and permit.
    pub fn settle(
        &self,
        store: &dyn Store,
        now: Nanos,
        mut verdict: Verdict,
        permit: Permit,
        answers: Option<&[CheckAnswer]>,
        counters: &mut dyn Counters<H>,
    ) -> (Verdict, Permit) {
        let checks = std::mem::take(&mut verdict.checks);
        verdict.admission = match std::mem::take(&mut verdict.deferred_delay) {
            Nanos::ZERO => Admission::Now,
            delay => Admission::Delayed(delay),
        };
        let mut permit = permit;
        let mut pass = Pass::new(self, store, now, CanWait::Yes, counters, (&mut verdict, &mut permit));
        for (at, item) in checks.iter().enumerate() {
            let Some(compiled) = self.rules.get(item.rule) else { continue };
            let target = Target {
                index: item.rule,
                compiled,
                fingerprint: item.fingerprint,
                cost: item.hits,
                shadow: self.in_shadow(compiled),
            };
            let ruling = match (answers.and_then(|a| a.get(at)), &compiled.rule.global) {
                (Some(answer), _) => {
                    Ruling::Decided { decision: Some(answer.decision), bucket: Bucket::Service, quota: answer.quota }
                }
                (None, Some(global)) => pass.fall_back(&target, &global.fallback),
                (None, None) => Ruling::Skip,
            };
            if pass.take(&target, ruling).is_break() {
                pass.ended();
                return (verdict, permit);
            }
        }
        pass.finish();
        (verdict, permit)
    }

    /// Whether releasing `permit` for `why` would touch any bucket: when a
    /// request ends, only rules that hold units in flight give any back. A
    /// host may skip the release (and reading its clock) when not.
    pub fn needs_release(&self, permit: &Permit, why: Release) -> bool {
        // Every request that ends asks: answered without a look at its
        // permit when no table could take anything back.
        if why == Release::Done && !self.holds_until_done {
            return false;
        }
        permit.held().any(|held| {
            let table = self.rules.get(held.rule).and_then(|compiled| compiled.table(held.bucket));
            let undone = why == Release::Undo && (held.bucket == Bucket::Reserve || table.is_some());
            undone || table.is_some_and(Table::holds_until_done)
        })
    }

    /// Gives back what `permit` holds, for `why`: the one way units return,
    /// whether a request ended ([`Release::Done`]: only rules that hold units
    /// in flight are touched) or was not served after all ([`Release::Undo`]).
    pub fn release(&self, store: &dyn Store, now: Nanos, permit: Permit, why: Release, counters: &mut dyn Counters<H>) {
        for held in permit.held().rev() {
            let Some(compiled) = self.rules.get(held.rule) else { continue };
            if held.bucket == Bucket::Reserve {
                if why == Release::Undo {
                    self.refund_reserve(compiled, held.fingerprint, held.grant);
                }
                continue;
            }
            let Some(table) = compiled.table(held.bucket) else { continue };
            if why == Release::Done && !table.holds_until_done() {
                continue;
            }
            let group = table.group_of(held.fingerprint);
            let result = compiled.on_group(store, held.bucket, group, self.settings.max_cas_retries, |stored| {
                table.release(stored, held.fingerprint, now, held.grant, why)
            });
            if let Some(change) = self.count_loop(result, counters).filter(|change| *change != 0) {
                counters.in_flight(compiled, change);
            }
        }
    }

    /// Rule `compiled` as it applies to `request`, or `None` when it does
    /// not (its match fails, or its descriptor cannot be formed).
    fn target<'a>(
        &self,
        index: usize,
        compiled: &'a CompiledRule<H>,
        request: &mut dyn Request,
    ) -> Option<Target<'a, H>> {
        let rule = &compiled.rule;
        if !rule.request_match.matches(request) {
            return None;
        }
        let fingerprint = fingerprint_from(&compiled.hasher, &rule.descriptors, request)?;
        // The quota service limits a descriptor by its entries and refuses
        // one with none (and the whole call with it): a global rule whose
        // entries the request all dropped (`skip_if_absent`) does not apply.
        if rule.global.is_some() && compiled.may_drop_every_entry && !has_entries(&rule.descriptors, request) {
            return None;
        }
        let cost = rule.cost.of(request);
        Some(Target { index, compiled, fingerprint, cost, shadow: self.in_shadow(compiled) })
    }
}

impl<H> Pass<'_, H> {
    /// How `target`'s rule rules on the request: on its local bucket, by its
    /// fall-back while the service fails, by the service (a check, asked
    /// later), or from its lease pool.
    fn rule(&mut self, target: &Target<H>, request: &mut dyn Request, waited_out: bool) -> Ruling {
        let compiled = target.compiled;
        let Some(global) = &compiled.rule.global else {
            return match compiled.rule.worker_batch {
                Some(batch) => self.decide_batched(target, batch),
                None => self.decide_local(target, Bucket::Main),
            };
        };
        if compiled.in_fallback() {
            return self.fall_back(target, &global.fallback);
        }
        if global.mode == GlobalMode::Check {
            if let Some(descriptor) = protocol_descriptor(&compiled.rule.descriptors, request) {
                let (rule, hits, fingerprint) = (target.index, target.cost, target.fingerprint);
                self.verdict.checks.push(CheckItem { rule, descriptor, hits, fingerprint });
            }
            return Ruling::Skip;
        }
        match self.spend_pool(target, request) {
            // Waited as long as it may and still no tokens: while the service
            // answers, that is a denial (its grants are what the fleet may
            // admit); only a failing service brings the fall-back in.
            Ruling::Pending if waited_out && compiled.in_fallback() => self.fall_back(target, &global.fallback),
            Ruling::Pending if waited_out => {
                let denial = Decision::deny(0, Nanos::ZERO, self.limiter.refill_retry());
                Ruling::local(Some(denial), Bucket::Main)
            }
            ruling => ruling,
        }
    }

    /// Decides by a global rule's fall-back while the service fails.
    pub(super) fn fall_back(&mut self, target: &Target<H>, fallback: &Fallback) -> Ruling {
        self.counters.rule(target.compiled, RuleEvent::Fallback);
        match fallback {
            Fallback::Allow => Ruling::Skip,
            Fallback::Deny => Ruling::local(Some(Decision::deny(0, Nanos::ZERO, Nanos::ZERO)), Bucket::Fallback),
            Fallback::Local(_) => self.decide_local(target, Bucket::Fallback),
        }
    }

    /// Decides the request's cost on its bucket in one of the rule's tables.
    fn decide_local(&mut self, target: &Target<H>, bucket: Bucket) -> Ruling {
        let Some(table) = target.compiled.table(bucket) else { return Ruling::local(None, bucket) };
        let (fingerprint, now, cost) = (target.fingerprint, self.now, target.cost);
        let group = table.group_of(fingerprint);
        let result =
            target.compiled.on_group(self.store, bucket, group, self.limiter.settings.max_cas_retries, |stored| {
                table.decide(stored, fingerprint, now, cost)
            });
        Ruling::local(self.limiter.slot_of(target.compiled, result, self.counters), bucket)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use std::cell::Cell;
    use std::rc::Rc;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

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
    fn a_request_without_the_header_skips_the_rule() {
        let store = MemoryStore::default();
        let limiter = build(PER_KEY, &store);
        let mut tally = Tally::default();
        for _ in 0..10 {
            let verdict = limiter.check(&store, T0, &mut request(&limiter, &[]), &mut tally).0;
            assert!(verdict.allowed());
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
        let verdict = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally).0;
        let report = verdict.report.unwrap();
        assert_eq!(report.rule, 1);
        assert_eq!(report.decision.remaining, 1);
        let verdict = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally).0;
        verdict.report.unwrap();
        let denied = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally).0;
        assert!(!denied.allowed());
        let report = denied.report.unwrap();
        assert_eq!(report.rule, 1);
        assert_eq!(report.decision.retry_after(), SECOND.times(1800), "2 per hour: one every 30 minutes");
    }

    #[test]
    fn shadow_mode_lets_everything_through_and_counts() {
        let json = PER_KEY.replace(r#""limit": 3"#, r#""limit": 3, "shadow_mode": true"#);
        let store = MemoryStore::default();
        let limiter = build(&json, &store);
        let mut tally = Tally::default();
        for _ in 0..10 {
            let verdict = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally).0;
            assert!(verdict.allowed());
        }
        assert_eq!(tally.rules[&(0, "allowed")], 3);
        assert_eq!(tally.rules[&(0, "shadow_limited")], 7);
        let verdict = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally).0;
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
        let verdict = limiter.check(&store, T0, &mut request(&limiter, &[]), &mut tally).0;
        assert!(!verdict.allowed());
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
        assert!(!admitted(&limiter, &store, T0 + SECOND - Nanos::from_nanos(1), &[("x-api-key", "a")], &mut tally));
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
            limiter.check(&store, T0, &mut request(&limiter, headers), &mut tally).0.report.unwrap().decision.remaining
        };
        assert_eq!(remaining(&[("x-cost", "10")]), 90);
        assert_eq!(remaining(&[("x-cost", "1000000")]), 50, "clamped to max 40");
        assert_eq!(remaining(&[("x-cost", "0")]), 49, "at least 1");
        assert_eq!(remaining(&[("x-cost", "ten")]), 47, "unreadable: the default cost");
        assert_eq!(remaining(&[("x-cost", "99999999999999999999999")]), 7, "too large for a number: the max");
        assert_eq!(remaining(&[]), 5, "absent: the default cost");
    }

    #[test]
    fn conflicting_writers_never_over_admit() {
        let json = r#"{"rules": [{"name": "hot", "limit": 5, "period": "1h"}]}"#;
        let store = MemoryStore::default();
        let limiter = build(json, &store);
        let rule = &limiter.rules()[0].rule;
        let fp =
            crate::descriptor::fingerprint(limiter.hash_key, "hot", &rule.descriptors, &mut request(&limiter, &[]))
                .unwrap();
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
            let verdict = limiter.check(&store, T0, &mut request(&limiter, &[]), &mut tally).0;
            assert_eq!(verdict.allowed(), expect_allowed, "{mode}");
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
        let verdict = limiter.check(&empty, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally).0;
        assert!(verdict.allowed() && verdict.failed);
        assert_eq!(tally.store["StoreErrors"], 1);
        assert!(empty.is_empty(), "nothing was created on the request path");
    }

    const SHAPED: &str = r#"{"rules": [
        {"name": "paced", "algorithm": "shaper", "limit": 1, "period": "1s", "max_delay": "2s"},
        {"name": "per-key", "limit": 1, "period": "1h",
         "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "k"}}]}]}"#;

    #[test]
    fn a_shaper_delays_and_a_later_denial_gives_its_place_back() {
        let store = MemoryStore::default();
        let limiter = build(SHAPED, &store);
        let mut tally = Tally::default();
        let mut check =
            |key: &str| limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", key)]), &mut tally);
        assert_eq!(check("a").0.admission, Admission::Now);
        let (second, permit) = check("b");
        assert_eq!(second.admission, Admission::Delayed(SECOND));
        assert!(!permit.is_empty());
        // "a" is denied by the per-key rule: its place in the pacer is freed,
        // so "c" waits 2 s (behind "b"), not 3 s.
        assert!(!check("a").0.allowed());
        assert_eq!(check("c").0.admission, Admission::Delayed(SECOND.times(2)));
        assert!(!check("d").0.allowed(), "3 s would exceed max_delay");
        assert_eq!(tally.rules[&(0, "delayed")], 2);
    }

    /// Every request is counted once, when its verdict is final: the host
    /// only flushes what the limiter counts.
    #[test]
    fn each_request_is_counted_once_by_what_became_of_it() {
        let store = MemoryStore::default();
        let limiter = build(PER_KEY, &store);
        let mut tally = Tally::default();
        for _ in 0..5 {
            admitted(&limiter, &store, T0, &[("x-api-key", "a")], &mut tally);
        }
        assert_eq!(tally.requests[&RequestEvent::Allowed], 3);
        assert_eq!(tally.requests[&RequestEvent::Limited], 2);
        assert_eq!(tally.requests.get(&RequestEvent::ShadowLimited), None);
    }

    /// A request that would wait on a worker that keeps as many paused as
    /// it may is denied by the limiter, takes nothing, and is counted as
    /// limited (its delaying rule too), not as allowed.
    #[test]
    fn a_request_that_cannot_wait_is_denied_and_takes_nothing() {
        let store = MemoryStore::default();
        let limiter = build(SHAPED, &store);
        let mut tally = Tally::default();
        let mut check = |key: &str, can_wait: CanWait| {
            limiter.check_waited(&store, T0, &mut request(&limiter, &[("x-api-key", key)]), can_wait, &mut tally)
        };
        assert_eq!(check("a", CanWait::NoRoom).0.admission, Admission::Now, "no wait: no room needed");
        let (refused, permit) = check("b", CanWait::NoRoom);
        assert_eq!(refused.admission, Admission::Denied { retry_after: SECOND });
        assert!(permit.is_empty(), "what it took went back");
        assert_eq!(check("c", CanWait::Yes).0.admission, Admission::Delayed(SECOND), "b's place was given back");
        assert_eq!(tally.requests[&RequestEvent::NoRoomToWait], 1);
        assert_eq!(tally.requests[&RequestEvent::Limited], 1);
        assert_eq!(tally.requests[&RequestEvent::Allowed], 2);
        assert_eq!(tally.rules[&(0, "limited")], 1);
        assert_eq!(tally.rules[&(0, "delayed")], 1);
    }

    #[test]
    fn undoing_a_permit_frees_its_units_and_done_touches_only_rules_that_hold() {
        let store = MemoryStore::default();
        let limiter = build(PER_KEY, &store);
        let mut tally = Tally::default();
        let key = "fg:per-key:".to_string();
        let (verdict, permit) = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally);
        assert!(verdict.allowed());
        let Some(held) = permit.held().next().copied() else { panic!("the permit holds the rule's units") };
        let group = format!("{key}{}", limiter.rules()[0].rule.table.group_of(held.fingerprint));
        let before = store.get(&group).unwrap();
        limiter.release(&store, T0, permit, Release::Done, &mut tally);
        assert_eq!(store.get(&group).unwrap(), before, "a token bucket keeps its units when a request ends");
        let (_, permit) = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally);
        limiter.release(&store, T0, permit, Release::Undo, &mut tally);
        let ok = (0..5).filter(|_| admitted(&limiter, &store, T0, &[("x-api-key", "a")], &mut tally)).count();
        assert_eq!(ok, 2, "3 per hour: one kept by the ended request, one given back by the undo");
    }

    /// A request that ends has something to give back only where a rule
    /// holds units until done; one undone gives back whatever it took.
    #[test]
    fn only_rules_holding_units_until_done_need_a_release_when_a_request_ends() {
        let store = MemoryStore::default();
        let mut tally = Tally::default();
        let rate = build(PER_KEY, &store);
        let (_, permit) = rate.check(&store, T0, &mut request(&rate, &[("x-api-key", "a")]), &mut tally);
        assert!(!permit.is_empty());
        assert!(!rate.needs_release(&permit, Release::Done), "a token bucket holds nothing in flight");
        assert!(rate.needs_release(&permit, Release::Undo), "what it took goes back");
        let json = r#"{"rules": [
            {"name": "rate", "limit": 100, "period": "1h"},
            {"name": "slots", "algorithm": "concurrency", "limit": 2, "slot_ttl": "30s"}]}"#;
        let store = MemoryStore::default();
        let slots = build(json, &store);
        let (_, permit) = slots.check(&store, T0, &mut request(&slots, &[]), &mut tally);
        assert!(slots.needs_release(&permit, Release::Done), "its slot goes back");
        assert!(!slots.needs_release(&Permit::default(), Release::Done), "nothing held, nothing to give back");
    }

    #[test]
    fn concurrency_holds_until_done_and_reports_what_is_in_flight() {
        let json = r#"{"rules": [
            {"name": "rate", "limit": 100, "period": "1h"},
            {"name": "slots", "algorithm": "concurrency", "limit": 2, "slot_ttl": "30s"}],
            "response": {"status": 503}}"#;
        let store = MemoryStore::default();
        let limiter = build(json, &store);
        assert_eq!(limiter.response().status, 503);
        let mut tally = Tally::default();
        let check = |now: Nanos, tally: &mut Tally| limiter.check(&store, now, &mut request(&limiter, &[]), tally);
        let (first, a) = check(T0, &mut tally);
        let (_, b) = check(T0, &mut tally);
        let (denied, empty) = check(T0, &mut tally);
        assert!(first.allowed() && !denied.allowed() && empty.is_empty());
        let report = denied.report.unwrap();
        assert_eq!(report.rule, 1);
        assert_eq!(report.decision.retry_after(), SECOND.times(40), "until the slots' epoch is reclaimed");
        assert_eq!(tally.in_flight.get(&1), Some(&2));
        assert_eq!(tally.in_flight.get(&0), None, "a token bucket holds nothing in flight");
        // A request that ends frees its slot; the token bucket keeps its token.
        limiter.release(&store, T0, a, Release::Done, &mut tally);
        assert_eq!(tally.in_flight[&1], 1);
        let (again, c) = check(T0 + SECOND, &mut tally);
        assert!(again.allowed());
        assert_eq!(again.report.unwrap().decision.remaining, 0);
        // b and c are never released (their VM crashed): both are reclaimed
        // 40 s after their epoch began, and leave the gauge then.
        drop((b, c));
        assert!(!check(T0 + SECOND.times(40) - Nanos::from_nanos(1), &mut tally).0.allowed());
        let (reclaimed, _) = check(T0 + SECOND.times(40), &mut tally);
        assert!(reclaimed.allowed());
        assert_eq!(tally.in_flight[&1], 1, "two reclaimed, one taken");
        assert_eq!(tally.rules[&(0, "allowed")], 4);
        assert_eq!(tally.rules[&(1, "limited")], 2);
    }

    #[test]
    fn check_mode_asks_once_for_every_descriptor_and_settles_on_the_answer() {
        let json = GLOBAL.replace(r#""scope": "global","#, r#""scope": "global", "mode": "check","#);
        let store = MemoryStore::default();
        let limiter = build(&json, &store);
        let mut tally = Tally::default();
        let (verdict, permit) = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally);
        assert_eq!(verdict.admission, Admission::Pending);
        assert_eq!(verdict.checks.len(), 1);
        let denied = [CheckAnswer { decision: Decision::deny(0, SECOND, SECOND.times(5)), quota: None }];
        let (settled, _) = limiter.settle(&store, T0, verdict.clone(), permit, Some(&denied), &mut tally);
        assert_eq!(settled.admission, Admission::Denied { retry_after: SECOND.times(5) });
        let (settled, _) = limiter.settle(&store, T0, verdict, Permit::default(), None, &mut tally);
        assert!(settled.allowed(), "no answer: the local fall-back decides");
        assert_eq!(tally.rules[&(0, "fallback")], 1);
    }

    /// A global rule whose every entry a request dropped (`skip_if_absent`)
    /// does not apply to it: the quota service refuses a descriptor with no
    /// entries, and with it the whole call, which carries other leases too.
    #[test]
    fn a_global_rule_whose_entries_are_all_dropped_does_not_apply() {
        let json = GLOBAL
            .replace(r#""descriptor_key": "api_key"}"#, r#""descriptor_key": "api_key", "skip_if_absent": true}"#);
        assert_ne!(json, GLOBAL);
        let store = MemoryStore::default();
        let limiter = build(&json, &store);
        let mut tally = Tally::default();
        let (verdict, _) = limiter.check(&store, T0, &mut request(&limiter, &[]), &mut tally);
        assert_eq!(verdict.admission, Admission::Now);
        assert!(verdict.refreshes.is_empty() && verdict.report.is_none(), "the rule did not apply: {verdict:?}");
        let (verdict, _) = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally);
        assert_eq!(verdict.admission, Admission::Pending);
        assert_eq!(verdict.refreshes[0].descriptor, vec![("api_key".to_string(), "a".to_string())]);
    }

    /// A request whose check-mode rule must be asked, or whose pool is
    /// empty, waits for the quota service: with no room to wait it is
    /// denied at once, and nothing it took is kept.
    #[test]
    fn a_request_that_cannot_wait_for_the_service_is_denied() {
        let json = r#"{"rules": [
            {"name": "site", "limit": 100, "period": "1h"},
            {"name": "fleet", "scope": "global", "mode": "check",
             "descriptors": [{"generic_key": {"descriptor_value": "all"}}]}],
            "global": {"cluster": "quota", "domain": "edge"}}"#;
        let store = MemoryStore::default();
        let limiter = build(json, &store);
        let mut tally = Tally::default();
        let (verdict, permit) =
            limiter.check_waited(&store, T0, &mut request(&limiter, &[]), CanWait::NoRoom, &mut tally);
        assert_eq!(verdict.admission, Admission::Denied { retry_after: SECOND });
        assert!(permit.is_empty() && verdict.checks.is_empty());
        assert_eq!(tally.requests[&RequestEvent::Limited], 1);

        let pooled = build(GLOBAL, &store);
        let (verdict, permit) =
            pooled.check_waited(&store, T0, &mut request(&pooled, &[("x-api-key", "a")]), CanWait::NoRoom, &mut tally);
        assert_eq!(verdict.admission, Admission::Denied { retry_after: SECOND });
        assert!(permit.is_empty());
        assert_eq!(verdict.refreshes.len(), 1, "the refresh it claimed is still asked for");
        assert_eq!(tally.requests[&RequestEvent::NoRoomToWait], 2);
    }

    #[test]
    fn a_delay_and_a_check_on_one_request_settle_into_a_delay() {
        let json = r#"{"rules": [
            {"name": "paced", "algorithm": "shaper", "limit": 1, "period": "1s", "max_delay": "2s"},
            {"name": "fleet", "scope": "global", "mode": "check",
             "descriptors": [{"generic_key": {"descriptor_value": "all"}}],
             "fallback": {"limit": 5, "period": "1h"}}],
            "global": {"cluster": "quota", "domain": "edge"}}"#;
        let store = MemoryStore::default();
        let limiter = build(json, &store);
        let mut tally = Tally::default();
        let allowed = [CheckAnswer { decision: Decision::admit(9, Nanos::ZERO), quota: None }];
        let ask = |tally: &mut Tally, answers: Option<&[CheckAnswer]>| {
            let (verdict, permit) = limiter.check(&store, T0, &mut request(&limiter, &[]), tally);
            assert_eq!(verdict.admission, Admission::Pending);
            limiter.settle(&store, T0, verdict, permit, answers, tally).0.admission
        };
        assert_eq!(ask(&mut tally, Some(&allowed)), Admission::Now);
        assert_eq!(ask(&mut tally, Some(&allowed)), Admission::Delayed(SECOND));
        // No answer: the local fall-back decides, and is counted once.
        assert_eq!(ask(&mut tally, None), Admission::Delayed(SECOND.times(2)));
        assert_eq!(tally.rules[&(0, "allowed")], 3);
        assert_eq!(tally.rules[&(0, "delayed")], 2);
        assert_eq!(tally.rules[&(1, "allowed")], 3);
        assert_eq!(tally.rules[&(1, "fallback")], 1);
    }
}
