//! The store's calls, made of transactions: a check (all its buckets in one
//! transaction: all or nothing), a call of leases (one transaction per
//! lease, each bucket with its lease's record: independent, so one slow or
//! contended key holds no other) and returns (per lease: read its record,
//! then give back to the bucket it names). Every decision is `decide`'s.

use floodgate_core::lease::grant::Ask;
use floodgate_core::lease::overshoot::near_limit;
use floodgate_core::time::Nanos;

use super::decide::{self, LeaseRecord};
use super::lanes::Decider;
use super::{
    BucketCheck, BucketLease, CheckOutcome, IdInUse, LeaseAnswer, LeaseOutcome, LeaseReturn, QuotaStore, ReturnOutcome,
    StoreFailure, Writes, LEASE_RECORD_MARGIN,
};
use crate::config::Limit;

/// How often a return starts over because a lease record changed between
/// reading it and deciding (a lease id reused after its record expired).
const RETURN_ATTEMPTS: usize = 4;

fn stored(values: &[Option<Vec<u8>>], at: usize) -> Option<&[u8]> {
    values.get(at).and_then(|v| v.as_deref())
}

impl QuotaStore {
    /// Takes each item's cost from its bucket if all non-shadow buckets
    /// admit. Items must name distinct buckets.
    pub async fn check(&self, items: &[BucketCheck]) -> Result<CheckOutcome, StoreFailure> {
        let keys: Vec<String> = items.iter().map(|i| i.key.clone()).collect();
        let items = items.to_vec();
        self.transact_one(keys, move |values, now| check(&items, values, now)).await
    }

    /// Takes a batch of tokens from each bucket and records each grant under
    /// its lease's record key; a lease already recorded is answered from its
    /// record (a returned one as holding nothing), unless it is of another
    /// bucket (then that lease takes nothing and the answer names it). Each
    /// lease is a transaction of its own, so the leases are independent: a
    /// failure of one fails the call (the caller retries it with the same
    /// ids, which replays the others), but never undoes or holds another.
    /// Leases of one bucket are taken in order: the second sees what the
    /// first took.
    pub async fn lease(&self, items: &[BucketLease], ttl: Nanos) -> Result<LeaseAnswer, StoreFailure> {
        let transactions = items
            .iter()
            .map(|item| {
                let keys = vec![item.key.clone(), item.record.clone()];
                let item = item.clone();
                let decide: Decider<Option<LeaseOutcome>> =
                    Box::new(move |values, now| lease_on(&item, values, now, ttl));
                (keys, decide)
            })
            .collect();
        let mut grants = Vec::with_capacity(items.len());
        let mut in_use = None;
        for (index, answer) in self.transact(transactions).await.into_iter().enumerate() {
            match answer? {
                Some(grant) => grants.push(grant),
                None => {
                    in_use.get_or_insert(IdInUse { index });
                }
            }
        }
        Ok(in_use.map_or(Ok(grants), Err))
    }

    /// Gives back unused tokens of recorded leases; returns how many each
    /// took back. `limit_now` names the limit now in force for a bucket (a
    /// reload may have lowered it since the lease: what a return says it
    /// gave back is what the bucket has again under it).
    pub async fn give_back(
        &self,
        items: &[LeaseReturn],
        limit_now: &(dyn Fn(&str) -> Option<Limit> + Sync),
    ) -> Result<Vec<ReturnOutcome>, StoreFailure> {
        let mut outcomes: Vec<Option<ReturnOutcome>> = vec![None; items.len()];
        for _ in 0..RETURN_ATTEMPTS {
            let open: Vec<usize> = (0..items.len()).filter(|i| outcomes.get(*i).is_some_and(Option::is_none)).collect();
            if open.is_empty() {
                break;
            }
            // Which bucket each lease came from; the decision below checks
            // that the records still say so.
            let reads = open
                .iter()
                .filter_map(|i| items.get(*i))
                .map(|item| {
                    let decide: Decider<Option<String>> = Box::new(|values, now| {
                        (LeaseRecord::live(stored(values, 0), now).map(|r| r.bucket), vec![None; values.len()])
                    });
                    (vec![item.record.clone()], decide)
                })
                .collect();
            let buckets = self.transact(reads).await;
            let mut returns = Vec::new();
            let mut which = Vec::new();
            for (i, bucket) in open.iter().zip(buckets) {
                let (Some(item), Some(slot)) = (items.get(*i), outcomes.get_mut(*i)) else { continue };
                let Some(bucket) = bucket? else {
                    // No live record: nothing to give back.
                    *slot = Some(ReturnOutcome { returned: 0, replayed: false });
                    continue;
                };
                let (item, now_limit) = (item.clone(), limit_now(&bucket));
                let keys = vec![item.record.clone(), bucket.clone()];
                let decide: Decider<Option<ReturnOutcome>> =
                    Box::new(move |values, now| give_back(&item, &bucket, now_limit.as_ref(), values, now));
                returns.push((keys, decide));
                which.push(*i);
            }
            for (i, outcome) in which.into_iter().zip(self.transact(returns).await) {
                if let Some(slot) = outcomes.get_mut(i) {
                    *slot = outcome?;
                }
            }
        }
        outcomes.into_iter().map(|o| o.ok_or(StoreFailure::Contended)).collect()
    }
}

fn check(items: &[BucketCheck], values: &[Option<Vec<u8>>], now: Nanos) -> (CheckOutcome, Writes) {
    let mut decisions = Vec::with_capacity(items.len());
    let mut writes: Writes = vec![None; values.len()];
    let mut committed = true;
    for (at, item) in items.iter().enumerate() {
        let (d, next) = decide::check(&item.limit, stored(values, at), now, item.cost);
        committed &= d.allowed() || item.shadow;
        if d.allowed() && stored(values, at) != Some(next.bytes.as_slice()) {
            if let Some(slot) = writes.get_mut(at) {
                *slot = Some(next);
            }
        }
        decisions.push(d);
    }
    if !committed {
        // Nothing is taken anywhere; admitting buckets report their
        // untouched state.
        writes.iter_mut().for_each(|w| *w = None);
        for (at, (item, d)) in items.iter().zip(decisions.iter_mut()).enumerate() {
            if d.allowed() {
                *d = decide::peek(&item.limit, stored(values, at), now);
            }
        }
    }
    (CheckOutcome { committed, decisions }, writes)
}

/// One lease on `[bucket, record]` (their stored values): its outcome and
/// what to write to each; `None` when its id is recorded for another
/// bucket (nothing taken). Every store runs it inside its transaction; the
/// fleet simulation runs it on its own map.
pub fn lease_on(
    item: &BucketLease,
    values: &[Option<Vec<u8>>],
    now: Nanos,
    ttl: Nanos,
) -> (Option<LeaseOutcome>, Writes) {
    let (bucket, record) = (0, 1);
    let mut writes: Writes = vec![None; values.len()];
    if let Some(done) = LeaseRecord::live(stored(values, record), now) {
        if done.bucket != item.key {
            return (None, writes);
        }
        let d = decide::peek(&item.limit, stored(values, bucket), now);
        // A returned lease holds nothing any more.
        let (granted, valid) = if done.returned { (0, Nanos::ZERO) } else { (done.granted, done.valid_until - now) };
        let outcome = LeaseOutcome {
            granted,
            remaining: d.remaining,
            reset: d.reset,
            window: done.window,
            windows: done.windows,
            valid,
            starts: done.granted_at - now,
            replayed: true,
            near_limit: near_limit(d.remaining, item.limit.policy().capacity()),
            checked: false,
        };
        return (Some(outcome), writes);
    }
    let ask = Ask {
        wanted: item.wanted,
        rate: item.rate,
        window: item.window,
        per_window: item.per_window,
        reported: item.reported,
        check: item.check,
    };
    let decide::Leased { allotment: got, next } =
        decide::lease(&item.limit, &item.key, stored(values, bucket), now, ask, ttl);
    // Reported units count even when nothing is granted.
    if got.granted > 0 || item.reported > 0 {
        if let Some(slot) = writes.get_mut(bucket) {
            *slot = Some(next);
        }
    }
    if got.granted > 0 && !got.checked {
        let done = LeaseRecord::of(&item.key, &item.limit, &got, now, LEASE_RECORD_MARGIN);
        if let Some(slot) = writes.get_mut(record) {
            *slot = Some(done.to_next(item.caller));
        }
    }
    let outcome = LeaseOutcome {
        granted: got.granted,
        remaining: got.decision.remaining,
        reset: got.decision.reset,
        window: got.window,
        windows: got.windows,
        valid: got.valid,
        starts: got.starts_at - now,
        replayed: false,
        near_limit: got.near_limit,
        checked: got.checked,
    };
    (Some(outcome), writes)
}

/// One return on `[record, bucket]`; `None` when the record no longer names
/// `bucket` (read for it before): start over.
fn give_back(
    item: &LeaseReturn,
    bucket: &str,
    limit_now: Option<&Limit>,
    values: &[Option<Vec<u8>>],
    now: Nanos,
) -> (Option<ReturnOutcome>, Writes) {
    let (record, at) = (0, 1);
    let mut writes: Writes = vec![None; values.len()];
    let Some(mut done) = LeaseRecord::live(stored(values, record), now) else {
        return (Some(ReturnOutcome { returned: 0, replayed: false }), writes);
    };
    if done.bucket != bucket {
        return (None, writes);
    }
    if done.returned {
        // A replay repeats what the first return gave back.
        return (Some(ReturnOutcome { returned: done.given_back, replayed: true }), writes);
    }
    let (mut back, next) = decide::give_back(&done, stored(values, at), now, item.tokens);
    if let (Some(limit), Some(next)) = (limit_now, next.as_ref()) {
        // The lease's limit may be higher than the one in force now (a
        // reload lowered a burst): the bucket holds only what this one
        // allows, so only that came back. (A lease ahead's window has not
        // started: what it gives back is counted there.)
        if *limit != done.limit && now >= done.granted_at {
            let before = decide::peek(limit, stored(values, at), now).remaining;
            let after = decide::peek(limit, Some(&next.bytes), now).remaining;
            back = back.min(after.saturating_sub(before));
        }
    }
    done.returned = true;
    done.given_back = back;
    if let Some(slot) = writes.get_mut(record) {
        *slot = Some(done.to_next(None));
    }
    if let (Some(slot), Some(next)) = (writes.get_mut(at), next) {
        *slot = Some(next);
    }
    (Some(ReturnOutcome { returned: back, replayed: false }), writes)
}
