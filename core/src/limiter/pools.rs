//! A global rule's lease pools, as the limiter keeps them in the rule's
//! table: a request spends from its pool (claiming a refresh when one is
//! due), the service's grant becomes the pool's lease, a refresh that got no
//! answer is abandoned, and unspent tokens are taken back out when the
//! configuration goes away. The pool's arithmetic is [`crate::lease::pool`].

use crate::algorithm::Algorithm;
use crate::descriptor::{protocol_descriptor, DescriptorEntry, Request};
use crate::global::calls::Refresh;
use crate::hash::SipHasher;
use crate::lease::overshoot::{notice_key, NearSet};
use crate::lease::pool::{Applied, GrantedLease, LeasePool, PoolState, Spend};
use crate::store::{measure_and_replace, Step, Store};
use crate::time::{Nanos, SECOND};

use super::pass::{Pass, Ruling, Target};
use super::rule::Bucket;
use super::{CompiledRule, Counters, Limiter, RuleEvent, NEAR_KEY};

impl<H> Pass<'_, H> {
    /// Spends the request's cost from its pool, claiming a refresh if one is
    /// due (the claim joins the verdict's refreshes).
    pub(super) fn spend_pool(&mut self, target: &Target<H>, request: &mut dyn Request) -> Ruling {
        let compiled = target.compiled;
        let Some(pool) = self.limiter.pool_of(compiled) else { return Ruling::local(None, Bucket::Main) };
        let (fingerprint, now, cost) = (target.fingerprint, self.now, target.cost);
        // A key the fleet heard is near its limit is admitted only with a lease.
        let near_until = match pool.overshoot {
            Some(_) => self.limiter.near_until(&compiled.rule.descriptors, request, now),
            None => None,
        };
        let table = &compiled.rule.table;
        let group = table.group_of(fingerprint);
        let result =
            compiled.on_group(self.store, Bucket::Main, group, self.limiter.settings.max_cas_retries, |stored| {
                table.update(stored, fingerprint, now, |slot| {
                    let mut state: PoolState = pool.decode(slot).unwrap_or_else(|| pool.fresh(now));
                    if let Some(until) = near_until {
                        state.without_lease.strict_until = state.without_lease.strict_until.max(until);
                    }
                    let (spend, claim, after) = pool.spend(state, now, cost);
                    let changed = after != state;
                    pool.encode(&after, slot);
                    let quota = after.quote.quota();
                    ((spend, claim, quota), changed)
                })
            });
        let Some((spend, claim, quota)) = self.limiter.slot_of(compiled, result, self.counters) else {
            return Ruling::local(None, Bucket::Main);
        };
        if let Some(claim) = claim {
            if let Some(descriptor) = protocol_descriptor(&compiled.rule.descriptors, request) {
                let lease = self.limiter.lease_id(&compiled.rule.name, fingerprint, claim.started);
                let rule = target.index;
                let sent = claim.started;
                self.verdict.refreshes.push(Refresh { rule, group, fingerprint, claim, sent, lease, descriptor });
            }
        }
        if matches!(spend, Spend::Unleased(_)) {
            self.counters.rule(compiled, RuleEvent::Overshoot);
        }
        match spend {
            Spend::Taken(decision) | Spend::Unleased(decision) | Spend::Denied(decision) => {
                Ruling::Decided { decision: Some(decision), bucket: Bucket::Main, quota }
            }
            Spend::Empty => Ruling::Pending,
        }
    }
}

impl<H> Limiter<H> {
    /// Applies the quota service's answer to a refresh: the grant becomes the
    /// pool's lease unless a newer one is in place. Returns what happened
    /// (the caller returns leftover or stale tokens to the service), or
    /// `None` when the pool could not be updated.
    pub fn apply_lease(
        &self,
        store: &dyn Store,
        now: Nanos,
        refresh: &Refresh,
        grant: &GrantedLease,
        counters: &mut dyn Counters<H>,
    ) -> Option<Applied> {
        let compiled = self.rules.get(refresh.rule)?;
        let pool = self.pool_of(compiled)?;
        let result = compiled.on_group(store, Bucket::Main, refresh.group, self.settings.max_cas_retries, |group| {
            compiled.rule.table.update(group, refresh.fingerprint, now, |slot| {
                let state = pool.decode(slot).unwrap_or_else(|| pool.fresh(now));
                let (applied, after) = pool.apply(state, now, (refresh.claim.started, refresh.sent), grant);
                let changed = after != state;
                pool.encode(&after, slot);
                (applied, changed)
            })
        });
        self.slot_of(compiled, result, counters)
    }

    /// Ends a refresh that got no answer, so the next request may claim again.
    pub fn abandon_lease(&self, store: &dyn Store, now: Nanos, refresh: &Refresh, counters: &mut dyn Counters<H>) {
        let Some(compiled) = self.rules.get(refresh.rule) else { return };
        let Some(pool) = self.pool_of(compiled) else { return };
        let result = compiled.on_group(store, Bucket::Main, refresh.group, self.settings.max_cas_retries, |group| {
            compiled.rule.table.update(group, refresh.fingerprint, now, |slot| {
                let Some(after) = pool.decode(slot).and_then(|state| pool.abandon(state, &refresh.claim)) else {
                    return ((), false);
                };
                pool.encode(&after, slot);
                ((), true)
            })
        });
        let _ = self.slot_of(compiled, result, counters);
    }

    /// Takes the unspent tokens out of every lease pool of every global rule,
    /// to give them back to the service: when this configuration goes away
    /// (a rule removed or changed, or Envoy shutting down). Each pool is
    /// emptied by compare-and-swap, so when every worker does this at once,
    /// each lease's tokens are taken once. Returns `(lease, tokens)`.
    pub fn take_unspent(&self, store: &dyn Store, now: Nanos) -> Vec<(u64, u64)> {
        let mut taken = Vec::new();
        for compiled in &self.rules {
            let Some(pool) = self.pool_of(compiled) else { continue };
            let table = &compiled.rule.table;
            for group in 0..table.groups() {
                let mut here = Vec::new();
                let result = compiled.on_group(store, Bucket::Main, group, self.settings.max_cas_retries, |stored| {
                    // Decided again after a lost race: start the list over.
                    here.clear();
                    table.update_every(stored, |slot| {
                        let Some(state) = pool.decode(slot) else { return false };
                        let (unspent, emptied) = pool.take_unspent(state, now);
                        if unspent.iter().all(|(lease, _)| *lease == 0) {
                            return false;
                        }
                        here.extend(unspent.into_iter().filter(|(lease, _)| *lease != 0));
                        pool.encode(&emptied, slot);
                        true
                    })
                });
                if result.is_ok() {
                    taken.append(&mut here);
                }
            }
        }
        taken
    }

    /// Records the near-limit notices a lease answer brought (`(key, for
    /// how long)`, see [`crate::lease::overshoot`]): in this worker's copy at
    /// once, and in shared data for the other workers, which read it on
    /// their tick.
    pub fn heard_near(&self, store: &dyn Store, now: Nanos, notices: &[(u64, Nanos)]) {
        let mut heard = NearSet::default();
        for &(key, span) in notices {
            heard.heard(key, now + span, now);
        }
        if !self.near.borrow_mut().merge(&heard, now) {
            return;
        }
        let _ = measure_and_replace(store, NEAR_KEY, self.settings.max_cas_retries, |bytes| {
            let mut stored = NearSet::decode(&bytes);
            match stored.merge(&heard, now) {
                true => Step::Write(stored.encode(), ()),
                false => Step::Keep(()),
            }
        });
    }

    /// Reads the near-limit notices from shared data into this worker's copy.
    pub(super) fn read_near(&self, store: &dyn Store) {
        if let Ok(Some((bytes, _))) = store.get(NEAR_KEY) {
            *self.near.borrow_mut() = NearSet::decode(&bytes);
        }
    }

    /// Until when the request's key is near its limit, if this worker heard
    /// so (the descriptor is built only while some notice holds).
    fn near_until(&self, entries: &[DescriptorEntry], request: &mut dyn Request, now: Nanos) -> Option<Nanos> {
        let near = self.near.borrow();
        if near.is_quiet(now) {
            return None;
        }
        near.until(notice_key(&protocol_descriptor(entries, request)?), now)
    }

    /// What a request that waited out an empty pool is told: try again once
    /// a refresh could have answered.
    pub(super) fn refill_retry(&self) -> Nanos {
        self.settings.global.as_ref().map_or(SECOND, |s| s.timeout.max(Nanos::from_millis(1)))
    }

    /// The pools' arithmetic, if `compiled` is a global rule.
    fn pool_of(&self, compiled: &CompiledRule<H>) -> Option<LeasePool> {
        Some(compiled.rule.global.as_ref()?.pool)
    }

    /// A lease id unique to this claim: the pool, the claim's instant, keyed
    /// by this Envoy's secret (so two Envoys never pick the same id). Never 0.
    fn lease_id(&self, rule: &str, fp: u64, started: Nanos) -> u64 {
        let mut hasher = SipHasher::new(self.hash_key.0 ^ 0x6c65_6173_6521, self.hash_key.1);
        hasher.write_field(rule.as_bytes());
        hasher.write(&fp.to_le_bytes());
        hasher.write(&started.get().to_le_bytes());
        hasher.finish().max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn an_empty_pool_is_pending_and_claims_one_refresh_then_spends_the_grant() {
        let store = MemoryStore::default();
        let limiter = build(GLOBAL, &store);
        let mut tally = Tally::default();
        let alice = &[("x-api-key", "alice")];
        let (verdict, permit) = limiter.check(&store, T0, &mut request(&limiter, alice), &mut tally);
        assert_eq!(verdict.admission, Admission::Pending);
        assert!(permit.is_empty());
        let [refresh] = verdict.refreshes.as_slice() else { panic!("one claim: {:?}", verdict.refreshes) };
        assert_eq!(refresh.descriptor, vec![("api_key".to_string(), "alice".to_string())]);
        // A second request before the answer waits too, without a second claim.
        let (again, _) = limiter.check(&store, T0 + Nanos::from_nanos(1), &mut request(&limiter, alice), &mut tally);
        assert_eq!((again.admission, again.refreshes.len()), (Admission::Pending, 0));
        assert_eq!(
            limiter.apply_lease(&store, T0, refresh, &lease(refresh.lease, 3), &mut tally),
            Some(Applied::Replaced(Leftover::default()))
        );
        let ok = (0..5).filter(|_| admitted(&limiter, &store, T0 + Nanos::from_nanos(2), alice, &mut tally)).count();
        assert_eq!(ok, 3, "exactly the granted tokens, then pending again");
        assert_eq!(tally.rules[&(0, "allowed")], 3);
    }

    /// A request under two global rules whose pools are both empty claims
    /// both refreshes in one pass (they leave in one call: one round trip,
    /// not one per rule), takes nothing meanwhile, and goes on once both
    /// have answered.
    #[test]
    fn every_empty_pool_of_a_request_claims_at_once() {
        let two = GLOBAL.replace(
            r#""fallback": {"limit": 2, "period": "1h"}}],"#,
            r#""fallback": {"limit": 2, "period": "1h"}},
               {"name": "second", "scope": "global",
                "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "key2"}}]}],"#,
        );
        let store = MemoryStore::default();
        let limiter = build(&two, &store);
        let mut tally = Tally::default();
        let alice = &[("x-api-key", "alice")];
        let (verdict, permit) = limiter.check(&store, T0, &mut request(&limiter, alice), &mut tally);
        assert_eq!(verdict.admission, Admission::Pending);
        assert!(permit.is_empty(), "nothing held while it waits");
        assert_eq!(verdict.refreshes.iter().map(|r| r.rule).collect::<Vec<_>>(), vec![0, 1], "both claimed at once");
        for refresh in &verdict.refreshes {
            limiter.apply_lease(&store, T0, refresh, &lease(refresh.lease, 1), &mut tally);
        }
        assert!(admitted(&limiter, &store, T0 + Nanos::from_nanos(1), alice, &mut tally), "both answered: it goes on");
    }

    /// `GLOBAL` with an overshoot budget of `limit` a second.
    fn overshooting(limit: u64) -> String {
        let budget = format!(r#""scope": "global", "overshoot": {{"limit": {limit}, "period": "1s"}},"#);
        GLOBAL.replace(r#""scope": "global","#, &budget)
    }

    /// A rule with an overshoot budget admits a key this Envoy holds no
    /// lease for at once, and its refresh reports what it so admitted; a
    /// rule without one (the default) makes the request wait.
    #[test]
    fn a_rule_with_an_overshoot_budget_admits_a_cold_key_at_once_and_reports_it() {
        let store = MemoryStore::default();
        let limiter = build(&overshooting(1), &store);
        let mut tally = Tally::default();
        let alice = &[("x-api-key", "alice")];
        let (verdict, _) = limiter.check(&store, T0, &mut request(&limiter, alice), &mut tally);
        assert!(verdict.allowed(), "{verdict:?}");
        let [refresh] = verdict.refreshes.as_slice() else { panic!("one claim: {:?}", verdict.refreshes) };
        assert_eq!(refresh.claim.reported, 1);
        let (again, _) = limiter.check(&store, T0 + Nanos::from_nanos(1), &mut request(&limiter, alice), &mut tally);
        assert_eq!(again.admission, Admission::Pending, "the budget of 1 a second is spent");
        assert_eq!((tally.rules[&(0, "allowed")], tally.rules[&(0, "overshoot")]), (1, 1));

        let strict = build(GLOBAL, &MemoryStore::default());
        let (verdict, _) = strict.check(&store, T0, &mut request(&strict, alice), &mut tally);
        assert_eq!(verdict.admission, Admission::Pending);
    }

    /// A key the fleet heard is near its limit (a notice brought by any
    /// lease answer) is admitted only with a lease, on every worker: the
    /// one that heard at once, the others from their next tick.
    #[test]
    fn a_near_limit_notice_holds_every_worker_strict_for_that_key() {
        let store = MemoryStore::default();
        let limiter = build(&overshooting(5), &store);
        let other = build(&overshooting(5), &store);
        let mut tally = Tally::default();
        let key = |name: &str| notice_key(&[("api_key".into(), name.into())]);
        limiter.heard_near(&store, T0, &[(key("alice"), SECOND), (key("bob"), SECOND)]);
        let verdict = |l: &Limiter<usize>, key, at, tally: &mut Tally| {
            l.check(&store, at, &mut request(l, &[("x-api-key", key)]), tally).0.admission
        };
        assert_eq!(verdict(&other, "alice", T0, &mut tally), Admission::Now, "not heard yet");
        assert_eq!(verdict(&limiter, "alice", T0, &mut tally), Admission::Pending, "strict: it waits for a lease");
        other.read_modes(&store);
        assert_eq!(verdict(&other, "bob", T0, &mut tally), Admission::Pending, "heard from shared data");
        assert_eq!(verdict(&other, "carol", T0, &mut tally), Admission::Now, "another key");
        assert_eq!(verdict(&other, "bob", T0 + SECOND, &mut tally), Admission::Now, "the notice is over");
    }

    #[test]
    fn a_request_that_waited_out_its_refresh_is_denied_unless_the_service_fails() {
        let store = MemoryStore::default();
        let limiter = build(GLOBAL, &store);
        let mut tally = Tally::default();
        let waited_out = |tally: &mut Tally| {
            limiter.check_waited(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), CanWait::WaitedOut, tally).0
        };
        let verdict = waited_out(&mut tally);
        assert_eq!(verdict.admission, Admission::Denied { retry_after: Nanos::from_millis(300) });
        limiter.record_callout(&store, T0, 0, false);
        let verdict = waited_out(&mut tally);
        assert!(verdict.allowed(), "the local fall-back decides: {verdict:?}");
        assert_eq!(tally.rules[&(0, "fallback")], 1);
    }

    #[test]
    fn unspent_tokens_are_taken_once_when_a_configuration_goes_away() {
        let store = MemoryStore::default();
        let limiter = build(GLOBAL, &store);
        let mut tally = Tally::default();
        for key in ["alice", "bob"] {
            let (verdict, _) = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", key)]), &mut tally);
            let refresh = &verdict.refreshes[0];
            limiter.apply_lease(&store, T0, refresh, &lease(refresh.lease, 10), &mut tally);
        }
        assert!(admitted(&limiter, &store, T0, &[("x-api-key", "alice")], &mut tally));
        let mut unspent = limiter.take_unspent(&store, T0);
        unspent.sort_by_key(|(_, tokens)| *tokens);
        assert_eq!(unspent.iter().map(|(_, t)| *t).collect::<Vec<_>>(), vec![9, 10]);
        let other_worker = build(GLOBAL, &store);
        assert!(other_worker.take_unspent(&store, T0).is_empty(), "taken once");
        assert!(limiter.take_unspent(&store, T0 + SECOND.times(11)).is_empty());
    }

    #[test]
    fn held_tokens_of_a_replaced_lease_are_given_back_with_the_current_ones() {
        let store = MemoryStore::default();
        let limiter = build(GLOBAL, &store);
        let mut tally = Tally::default();
        let alice = [("x-api-key", "alice")];
        let (verdict, _) = limiter.check(&store, T0, &mut request(&limiter, &alice), &mut tally);
        let first = verdict.refreshes[0].clone();
        limiter.apply_lease(&store, T0, &first, &lease(first.lease, 10), &mut tally);
        // Spend until the pool is due (a few tokens before it runs dry), and
        // replace the lease while it still holds some.
        let mut now = T0;
        let second = loop {
            now += Nanos::from_millis(100);
            let (verdict, _) = limiter.check(&store, now, &mut request(&limiter, &alice), &mut tally);
            assert!(verdict.allowed());
            if let Some(refresh) = verdict.refreshes.first() {
                break refresh.clone();
            }
        };
        let applied = limiter.apply_lease(&store, now, &second, &lease(second.lease, 10), &mut tally);
        assert_eq!(applied, Some(Applied::Replaced(Leftover::default())), "the old lease's tokens are kept");
        let mut unspent = limiter.take_unspent(&store, now);
        unspent.sort_by_key(|(_, tokens)| *tokens);
        let [(held, kept), (current, 10)] = unspent.as_slice() else { panic!("{unspent:?}") };
        assert_eq!((*held, *current), (first.lease, second.lease));
        assert!((1..10).contains(kept), "{kept}");
        assert!(limiter.take_unspent(&store, now).is_empty(), "taken once");
    }
}
