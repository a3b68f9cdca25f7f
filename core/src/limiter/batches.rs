//! Per-worker batches (`worker_batch`) in the decision path. A request of a
//! batched rule spends from its key's reserve in the worker's memory
//! ([`super::reserves`]) while the reserve has enough and is still valid;
//! otherwise it decides on the shared bucket as any request does, and in the
//! same compare-and-swap gives back what the old reserve did not spend and
//! takes up to `worker_batch` units: its own cost and the rest as the new
//! reserve. Every unit admitted was taken from the shared bucket, so nothing
//! is admitted that the bucket did not grant. Reserves past their time are
//! given back on the worker's tick ([`Limiter::return_reserves`]).

use crate::algorithm::{Admission, Decision, Grant};
use crate::store::Store;
use crate::time::Nanos;

use super::pass::{Pass, Ruling, Target};
use super::reserves::{Reserve, RESERVE_LIFETIME};
use super::rule::Bucket;
use super::{CompiledRule, Counters, Limiter};

impl<H> Pass<'_, H> {
    /// Decides a request of a rule with `worker_batch`: from its key's
    /// reserve if it can, else on the shared bucket, taking up to `batch`
    /// units (the rest kept as the new reserve) and giving back what the old
    /// reserve did not spend, in one compare-and-swap.
    pub(super) fn decide_batched(&mut self, target: &Target<H>, batch: u64) -> Ruling {
        let compiled = target.compiled;
        let (fingerprint, now, cost) = (target.fingerprint, self.now, target.cost);
        let old = {
            let mut reserves = compiled.reserves.borrow_mut();
            if let Some(decision) = reserves.get_mut(fingerprint).and_then(|reserve| reserve.spend(now, cost)) {
                return Ruling::local(Some(decision), Bucket::Reserve);
            }
            reserves.take(fingerprint)
        };
        let table = &compiled.rule.table;
        let policy = table.policy();
        let group = table.group_of(fingerprint);
        let result =
            compiled.on_group(self.store, Bucket::Main, group, self.limiter.settings.max_cas_retries, |stored| {
                table.update(stored, fingerprint, now, |slot| {
                    let mut changed = false;
                    if let Some(old) = old.filter(|old| old.units > 0) {
                        let (grant, why) = old.unspent();
                        changed |= policy.release(slot, now, grant, why);
                    }
                    let decision = policy.decide(slot, now, cost);
                    let mut ahead = 0;
                    if decision.admission == Admission::Now {
                        changed = true;
                        let wanted = batch.saturating_sub(cost).min(decision.remaining);
                        if wanted > 0 && policy.decide(slot, now, wanted).allowed() {
                            ahead = wanted;
                        }
                    }
                    let window_end = policy.counting_window(slot, now).map(|window| window.end);
                    ((decision, ahead, window_end), changed)
                })
            });
        let Some((decision, ahead, window_end)) = self.limiter.slot_of(compiled, result, self.counters) else {
            // Nothing was written: the old reserve is still this worker's.
            if let Some(evicted) = old.and_then(|old| compiled.reserves.borrow_mut().insert(old)) {
                self.limiter.give_back(self.store, compiled, evicted, now, self.counters);
            }
            return Ruling::local(None, Bucket::Main);
        };
        if ahead > 0 {
            let until = window_end.map_or(now + RESERVE_LIFETIME, |end| end.min(now + RESERVE_LIFETIME));
            let left = Decision::admit(decision.remaining.saturating_sub(ahead), decision.reset);
            let granted = cost + ahead;
            let reserve = Reserve { fingerprint, units: ahead, taken_at: now, granted, until, decision: left };
            if let Some(evicted) = compiled.reserves.borrow_mut().insert(reserve) {
                self.limiter.give_back(self.store, compiled, evicted, now, self.counters);
            }
        }
        Ruling::local(Some(decision), Bucket::Main)
    }
}

impl<H> Limiter<H> {
    /// Gives back the units of reserves that have ended by `now` (of every
    /// reserve, if `all`: the configuration goes away).
    pub fn return_reserves(&self, store: &dyn Store, now: Nanos, all: bool, counters: &mut dyn Counters<H>) {
        let mut ended = Vec::new();
        for compiled in self.rules.iter().filter(|c| c.rule.worker_batch.is_some()) {
            compiled.reserves.borrow_mut().take_ended(now, all, &mut ended);
            for reserve in ended.drain(..) {
                self.give_back(store, compiled, reserve, now, counters);
            }
        }
    }

    /// True while this worker keeps units taken ahead (its tick must come
    /// back to give them back when they end).
    pub fn holds_reserves(&self) -> bool {
        self.rules.iter().any(|compiled| !compiled.reserves.borrow().is_empty())
    }

    /// Gives a reserve's unspent units back to its bucket.
    fn give_back(
        &self,
        store: &dyn Store,
        compiled: &CompiledRule<H>,
        reserve: Reserve,
        now: Nanos,
        counters: &mut dyn Counters<H>,
    ) {
        if reserve.units == 0 {
            return;
        }
        let table = &compiled.rule.table;
        let (grant, why) = reserve.unspent();
        let group = table.group_of(reserve.fingerprint);
        let result = compiled.on_group(store, Bucket::Main, group, self.settings.max_cas_retries, |stored| {
            table.release(stored, reserve.fingerprint, now, grant, why)
        });
        let _ = self.count_loop(result, counters);
    }

    /// Puts units a request took from its reserve back into it (the request
    /// was not served after all), if the reserve it took them from is still
    /// kept.
    pub(super) fn refund_reserve(&self, compiled: &CompiledRule<H>, fingerprint: u64, grant: Grant) {
        if let Some(reserve) = compiled.reserves.borrow_mut().get_mut(fingerprint) {
            if reserve.taken_at <= grant.at && grant.at < reserve.until {
                reserve.units = reserve.units.saturating_add(grant.cost);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::super::testing::*;
    use super::*;
    use crate::algorithm::Release;

    /// 10 an hour per key, taken 4 at a time.
    const BATCHED: &str = r#"{"rules": [{"name": "per-key", "limit": 10, "period": "1h", "worker_batch": 4,
        "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "k"}}]}]}"#;

    /// What the shared bucket of `key` has left at `now`: what a request of
    /// the same rule without batches is told, its unit given back at once.
    fn shared_remaining(store: &MemoryStore, json: &str, key: &str, now: Nanos) -> u64 {
        let plain = build(&json.replace(r#", "worker_batch": 4"#, ""), store);
        let mut tally = Tally::default();
        let (verdict, permit) = plain.check(store, now, &mut request(&plain, &[("x-api-key", key)]), &mut tally);
        plain.release(store, now, permit, Release::Undo, &mut tally);
        verdict.report.map_or(0, |r| r.decision.remaining + u64::from(verdict.allowed()))
    }

    #[test]
    fn a_batched_rule_takes_ahead_and_spends_from_the_reserve() {
        let store = MemoryStore::default();
        let limiter = build(BATCHED, &store);
        let mut tally = Tally::default();
        assert!(admitted(&limiter, &store, T0, &[("x-api-key", "a")], &mut tally));
        assert_eq!(shared_remaining(&store, BATCHED, "a", T0), 6, "one for the request, three ahead");
        let before = store.get("fg:per-key:0").ok();
        for _ in 0..3 {
            let verdict = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally).0;
            assert!(verdict.allowed());
        }
        assert_eq!(store.get("fg:per-key:0").ok(), before, "spent from the worker's reserve: no write");
        assert_eq!(shared_remaining(&store, BATCHED, "a", T0), 6, "the reserve was spent, not the bucket");
        assert_eq!(tally.rules[&(0, "allowed")], 4, "every admission counted");
    }

    /// Two workers (two limiters on one store) never admit more than the
    /// limit between them, and what one holds comes back once its reserve
    /// ends, so the whole limit is used in the end.
    #[test]
    fn two_workers_never_admit_more_than_the_limit_and_leftovers_come_back() {
        let store = MemoryStore::default();
        let workers = [build(BATCHED, &store), build(BATCHED, &store)];
        let mut tally = Tally::default();
        let mut admitted_now = 0;
        for i in 0..40 {
            let worker = &workers[i % 2];
            admitted_now += usize::from(admitted(worker, &store, T0, &[("x-api-key", "a")], &mut tally));
        }
        assert!(admitted_now <= 10, "{admitted_now} admitted of 10");
        assert!(admitted_now >= 10 - 3, "at most a batch less one held by the other worker: {admitted_now}");
        let later = T0 + RESERVE_LIFETIME;
        for worker in &workers {
            worker.return_reserves(&store, later, false, &mut tally);
            assert!(!worker.holds_reserves(), "ended reserves are given back");
        }
        let rest =
            (0..40).filter(|i| admitted(&workers[i % 2], &store, later, &[("x-api-key", "a")], &mut tally)).count();
        assert_eq!(admitted_now + rest, 10, "the whole limit, never more");
    }

    /// A reserve that ends unspent goes back whole, for a bucket that earns
    /// units back over time too: its units are the unused part of the grant
    /// the request that took them was part of, so the time since is counted
    /// against that request's unit, not against the reserve (as an undo of
    /// the reserve alone it lost a unit each time: 9 became 8).
    #[test]
    fn an_unspent_reserve_goes_back_whole() {
        let store = MemoryStore::default();
        let limiter = build(BATCHED, &store);
        let mut tally = Tally::default();
        assert!(admitted(&limiter, &store, T0, &[("x-api-key", "a")], &mut tally));
        let later = T0 + RESERVE_LIFETIME;
        limiter.return_reserves(&store, later, false, &mut tally);
        assert!(!limiter.holds_reserves());
        assert_eq!(shared_remaining(&store, BATCHED, "a", later), 9, "one used, three back");
        // Taken again and replaced by a new batch when it cannot serve:
        // the old reserve's units go back whole in the same update.
        assert!(admitted(&limiter, &store, later, &[("x-api-key", "a")], &mut tally));
        let after = later + RESERVE_LIFETIME;
        assert!(admitted(&limiter, &store, after, &[("x-api-key", "a")], &mut tally));
        limiter.return_reserves(&store, after + RESERVE_LIFETIME, false, &mut tally);
        assert_eq!(shared_remaining(&store, BATCHED, "a", after + RESERVE_LIFETIME), 7, "three used");
    }

    /// A fixed window's units count only in their window: a reserve ends
    /// with it, and what it holds is not spent in the next.
    #[test]
    fn a_reserve_ends_with_the_window_its_units_count_in() {
        let json = BATCHED.replace(r#""period": "1h""#, r#""period": "1h", "algorithm": "fixed_window""#);
        let store = MemoryStore::default();
        let limiter = build(&json, &store);
        let mut tally = Tally::default();
        // T0 is 20 s into its minute and 1h windows are aligned to the hour.
        let window_end = T0.floor_to(Nanos::from_secs(3600)) + Nanos::from_secs(3600);
        let just_before = window_end - Nanos::from_nanos(1);
        assert!(admitted(&limiter, &store, just_before, &[("x-api-key", "a")], &mut tally));
        let reserve =
            *limiter.rules()[0].reserves.borrow_mut().get_mut(limiter_fingerprint(&limiter, "a")).expect("kept");
        assert_eq!(reserve.until, window_end);
        assert_eq!(reserve.units, 3);
        // In the next window the reserve is not spent: the request takes anew.
        assert!(admitted(&limiter, &store, window_end, &[("x-api-key", "a")], &mut tally));
        assert_eq!(shared_remaining(&store, &json, "a", window_end), 6, "a new window: one taken, three ahead");
    }

    #[test]
    fn a_request_denied_by_a_later_rule_gives_its_units_back_to_the_reserve() {
        let json = r#"{"rules": [{"name": "batched", "limit": 100, "period": "1h", "worker_batch": 4},
            {"name": "strict", "limit": 1, "period": "1h"}]}"#;
        let store = MemoryStore::default();
        let limiter = build(json, &store);
        let mut tally = Tally::default();
        assert!(admitted(&limiter, &store, T0, &[], &mut tally));
        for _ in 0..10 {
            assert!(!admitted(&limiter, &store, T0, &[], &mut tally), "the strict rule denies");
        }
        let fingerprint = limiter_fingerprint(&limiter, "");
        assert_eq!(limiter.rules()[0].reserves.borrow_mut().get_mut(fingerprint).map(|r| r.units), Some(3));
    }

    fn limiter_fingerprint(limiter: &Limiter<usize>, key: &str) -> u64 {
        let rule = &limiter.rules()[0].rule;
        let mut request = request(limiter, &[("x-api-key", key)]);
        crate::descriptor::fingerprint(limiter.hash_key, &rule.name, &rule.descriptors, &mut request).expect("a key")
    }
}
