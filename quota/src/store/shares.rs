//! The store's part of RLQS shares: per bucket, the table of the Envoys
//! reporting it (their demand and what each was assigned, see
//! `floodgate_core::lease::shares`), read, decided on and written back in
//! one transaction, on any store. On Redis every service instance reads and
//! writes the same table with the same compare-and-swap as the buckets, so
//! instances sharing a Redis share the limit among all the Envoys of all of
//! them.
//!
//! [`ShareReports`] coalesces the reports of an instance's streams: the
//! reports of one bucket that arrive while its last transaction waits for
//! its turn are decided together, in the order they came, in one
//! transaction (one table read, decided on report after report, written
//! once), so a bucket costs one transaction per turn, not one per Envoy:
//! a hundred Envoys reporting the same thousand buckets cost the store a
//! thousand small transactions per turn, not a hundred thousand.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use floodgate_core::lease::shares::{counting_window, Assigned, Report, ShareTable, Shares};
use floodgate_core::time::Nanos;
use tokio::sync::oneshot;

use super::decide::{Kind, Next};
use super::lanes::Decider;
use super::{QuotaStore, StoreFailure};
use crate::config::Limit;

/// The store key of a bucket's shares: the domain as the Redis Cluster hash
/// tag (as every key of the domain), `rlqs`, the algorithm's key and the
/// descriptor's entries as JSON. Its own key: the counts of Envoys on RLQS
/// are theirs, apart from the checks' and leases' bucket of the same
/// descriptor.
pub fn shares_key(domain: &str, limit: &Limit, entries: &[(String, String)]) -> String {
    let entries = serde_json::to_string(entries).unwrap_or_default();
    format!("fg:{{{domain}}}:rlqs:{}:{entries}", limit.algorithm().key)
}

/// One Envoy's report of one bucket, to record in the bucket's shares.
#[derive(Debug, Clone)]
pub struct ShareReport {
    /// See [`shares_key`].
    pub key: String,
    /// The bucket's rule.
    pub limit: Limit,
    /// The protocol's timings (see [`Shares`]); the limit and window are
    /// filled in from `limit` when decided.
    pub timings: Timings,
    /// What the Envoy reported.
    pub report: Report,
}

/// How often Envoys report, how long an assignment lasts and when an idle
/// bucket is abandoned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timings {
    /// See [`Shares::report_interval`].
    pub report_interval: Nanos,
    /// See [`Shares::ttl`].
    pub ttl: Nanos,
    /// See [`Shares::abandon_after`].
    pub abandon_after: Nanos,
}

impl ShareReport {
    /// The rule at `now`: the limit's rate, and the window it counts in.
    fn shares(&self, now: Nanos) -> Shares {
        Shares {
            limit: self.limit.limit(),
            period: self.limit.period(),
            window: counting_window(self.limit.policy(), now),
            report_interval: self.timings.report_interval,
            ttl: self.timings.ttl,
            abandon_after: self.timings.abandon_after,
        }
    }
}

/// Records `items` (reports of one bucket, in order) in the table `stored`
/// holds at `now`: each report's assignment, and the table to write.
fn decide<'a>(
    items: impl IntoIterator<Item = &'a ShareReport>,
    stored: Option<&[u8]>,
    now: Nanos,
) -> (Vec<Option<Assigned>>, Next) {
    let mut table = ShareTable::decode(stored);
    let mut assigned = Vec::new();
    let mut window_end = None;
    for item in items {
        let shares = item.shares(now);
        assigned.push(shares.report(&mut table, item.report, now));
        window_end = shares.window.map(|w| w.end);
    }
    let idle_at = table.idle_at(window_end);
    let next = Next { bytes: table.encode(), idle_at, keep_until: idle_at, kind: Kind::Bucket, owner: None };
    (assigned, next)
}

#[cfg(test)]
impl QuotaStore {
    /// Records each report in its bucket's shares and answers each
    /// assignment (`None`: a bucket's first report, not answered yet): one
    /// transaction per report (reports of one bucket in order), all
    /// submitted together. The reference [`ShareReports`] is tested against:
    /// the service decides reports coalesced.
    pub async fn report_shares(&self, items: &[ShareReport]) -> Vec<Result<Option<Assigned>, StoreFailure>> {
        let transactions = items
            .iter()
            .map(|item| {
                let keys = vec![item.key.clone()];
                let item = item.clone();
                let decide: Decider<Option<Assigned>> = Box::new(move |values, now| {
                    let (assigned, next) = decide([&item], values.first().and_then(|v| v.as_deref()), now);
                    (assigned.into_iter().next().flatten(), vec![Some(next)])
                });
                (keys, decide)
            })
            .collect();
        self.transact(transactions).await
    }
}

/// What one report of a bucket gets.
pub type ShareAnswer = Result<Option<Assigned>, StoreFailure>;

/// A report waiting for its bucket's transaction, and where its answer goes.
type Waiting = (ShareReport, oneshot::Sender<ShareAnswer>);

/// The reports of one bucket waiting for the transaction that will decide
/// them, and which transaction that is.
struct Pending {
    transaction: u64,
    reports: Vec<Waiting>,
}

/// Coalesces bucket reports of many callers (one instance's RLQS streams)
/// into one store transaction per bucket at a time: see the module's doc.
/// A report joins its bucket's reports waiting for a transaction not
/// decided yet; the first report of a bucket with none waiting starts one.
/// A transaction takes its bucket's waiting reports when it is first
/// decided (later reports wait for the next one), so each report is decided
/// once, in the order of arrival per bucket, exactly as one transaction
/// each would be.
#[derive(Default)]
pub struct ShareReports {
    pending: Mutex<Waitlist>,
}

#[derive(Default)]
struct Waitlist {
    next: u64,
    by_key: HashMap<String, Pending>,
}

impl std::fmt::Debug for ShareReports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShareReports").finish_non_exhaustive()
    }
}

/// Where a transaction leaves the answers' senders of the reports it took.
type Taken = Arc<Mutex<Option<Vec<oneshot::Sender<ShareAnswer>>>>>;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Each value is replaced whole: a poisoned lock still holds a consistent one.
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl ShareReports {
    /// Records each report in its bucket's shares on `store` and answers
    /// each assignment (`None`: a bucket's first report, not answered yet),
    /// in the order of `items`. Reports of one bucket from other callers
    /// waiting at the same time are decided in the same transaction.
    pub async fn report(self: &Arc<Self>, store: &QuotaStore, items: Vec<ShareReport>) -> Vec<ShareAnswer> {
        let mut answers = Vec::with_capacity(items.len());
        let mut started = Vec::new();
        {
            let mut pending = lock(&self.pending);
            for item in items {
                let (sender, answer) = oneshot::channel();
                answers.push(answer);
                if let Some(waiting) = pending.by_key.get_mut(&item.key) {
                    waiting.reports.push((item, sender));
                    continue;
                }
                let transaction = pending.next;
                pending.next += 1;
                started.push((item.key.clone(), transaction));
                pending.by_key.insert(item.key.clone(), Pending { transaction, reports: vec![(item, sender)] });
            }
        }
        if !started.is_empty() {
            // On a task of its own: the answers of other callers' reports
            // it takes do not depend on this caller staying.
            tokio::spawn(Arc::clone(self).decide(store.clone(), started));
        }
        let mut out = Vec::with_capacity(answers.len());
        for answer in answers {
            out.push(answer.await.unwrap_or_else(|_| Err(StoreFailure::Unavailable("the report was dropped".into()))));
        }
        out
    }

    /// Takes the reports of `key` waiting for `transaction` (if it still
    /// waits): later reports of the key then start another.
    fn take(&self, key: &str, transaction: u64) -> Vec<Waiting> {
        let mut pending = lock(&self.pending);
        match pending.by_key.get(key) {
            Some(waiting) if waiting.transaction == transaction => {
                pending.by_key.remove(key).map(|p| p.reports).unwrap_or_default()
            }
            _ => Vec::new(),
        }
    }

    /// Runs the transactions `started` (a key and its transaction's
    /// number each) and answers every report each took.
    async fn decide(self: Arc<Self>, store: QuotaStore, started: Vec<(String, u64)>) {
        let mut takens: Vec<Taken> = Vec::with_capacity(started.len());
        // The transactions' deadline (the one `transact` sets, now): a
        // transaction reached after it is answered `timeout` whatever it
        // decides, so it decides nothing (a backlog of late work would
        // make the next reports late too).
        let deadline = store.backend().deadline();
        let transactions = started
            .iter()
            .map(|(key, transaction)| {
                let taken: Taken = Arc::new(Mutex::new(None));
                takens.push(Arc::clone(&taken));
                let keys = vec![key.clone()];
                let (me, key, transaction) = (Arc::clone(&self), key.clone(), *transaction);
                let mut reports: Option<Vec<ShareReport>> = None;
                let decide: Decider<Vec<Option<Assigned>>> = Box::new(move |values, now| {
                    if deadline.is_some_and(|deadline| tokio::time::Instant::now() >= deadline) {
                        // Late: its reports, not taken, fail with it.
                        return (Vec::new(), vec![None]);
                    }
                    // The first decision takes the waiting reports; a retry
                    // (a lost race) decides the same ones again.
                    let reports = reports.get_or_insert_with(|| {
                        let (reports, senders): (Vec<ShareReport>, Vec<_>) =
                            me.take(&key, transaction).into_iter().unzip();
                        *lock(&taken) = Some(senders);
                        reports
                    });
                    if reports.is_empty() {
                        return (Vec::new(), vec![None]);
                    }
                    let (assigned, next) = decide(reports.iter(), values.first().and_then(|v| v.as_deref()), now);
                    (assigned, vec![Some(next)])
                });
                (keys, decide)
            })
            .collect();
        let decided = store.transact(transactions).await;
        for (((key, transaction), taken), decided) in started.iter().zip(takens).zip(decided) {
            // A transaction never decided (it timed out waiting for its
            // turn) took nothing: its reports are taken here, to be failed.
            let senders = lock(&taken)
                .take()
                .unwrap_or_else(|| self.take(key, *transaction).into_iter().map(|(_, sender)| sender).collect());
            match decided {
                Ok(assigned) => {
                    for (sender, assigned) in senders.into_iter().zip(assigned) {
                        let _ = sender.send(Ok(assigned));
                    }
                }
                Err(failure) => {
                    for sender in senders {
                        let _ = sender.send(Err(failure.clone()));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;

    use floodgate_core::lease::shares::{Assignment, TokenBucket, MICROS};
    use floodgate_core::time::{FakeClock, SECOND};

    use super::*;
    use crate::store::LocalStore;

    fn item(envoy: u64, allowed: u64) -> ShareReport {
        ShareReport {
            key: shares_key("edge", &limit(), &[("tenant".into(), "a".into())]),
            limit: limit(),
            timings: Timings {
                report_interval: Nanos::from_secs(5),
                ttl: Nanos::from_secs(15),
                abandon_after: Nanos::from_secs(30),
            },
            report: Report { envoy, allowed, denied: 0, elapsed: Nanos::from_secs(5) },
        }
    }

    fn limit() -> Limit {
        Limit::new("fixed_window", 50, SECOND, "{}").unwrap()
    }

    #[tokio::test]
    async fn the_store_keeps_the_table_between_reports() {
        let clock = Arc::new(FakeClock::new(Nanos::from_secs(1_700_000_000)));
        let store = QuotaStore::new(Arc::new(LocalStore::new(clock.clone(), 100)));
        // A first report (over no time) gets no answer yet.
        let mut unknown = item(1, 1);
        unknown.report.elapsed = Nanos::ZERO;
        assert_eq!(store.report_shares(&[unknown]).await, vec![Ok(None)]);
        let first = store.report_shares(&[item(1, 500)]).await;
        let rate = |a: &Result<Option<Assigned>, StoreFailure>| match a.as_ref().unwrap().unwrap().assignment {
            Assignment::TokenBucket(b) => b.rate() / MICROS,
            _ => 0,
        };
        assert_eq!(rate(&first[0]), 50);
        clock.advance(SECOND);
        // A second Envoy: the first holds everything, so a newcomer's floor.
        let second = store.report_shares(&[item(2, 500)]).await;
        assert_eq!(
            second[0].as_ref().unwrap().unwrap().assignment,
            Assignment::TokenBucket(TokenBucket { max_tokens: 3, tokens_per_fill: 6, fill_interval: SECOND })
        );
        // Both report again, in one call, in order: the first gets its
        // part of the demand (50 of 150 a second: 16), the second then
        // the room the first left (25 of the 34).
        clock.advance(Nanos::from_secs(4));
        let both = store.report_shares(&[item(1, 250), item(2, 250)]).await;
        assert_eq!((rate(&both[0]), rate(&both[1])), (16, 25));
        clock.advance(Nanos::from_secs(5));
        let both = store.report_shares(&[item(1, 250), item(2, 250)]).await;
        assert_eq!((rate(&both[0]), rate(&both[1])), (25, 25));
    }

    /// Reports of one bucket from several streams at once are decided in
    /// one transaction, in the order they came, exactly as one transaction
    /// each in that order would be: the same answers, the same table.
    #[tokio::test(flavor = "current_thread")]
    async fn coalesced_reports_are_decided_as_one_at_a_time_would_be() {
        let at = Nanos::from_secs(1_700_000_000);
        let (one_by_one, coalesced) = (Arc::new(FakeClock::new(at)), Arc::new(FakeClock::new(at)));
        let alone = QuotaStore::new(Arc::new(LocalStore::new(one_by_one.clone(), 100)));
        let together = QuotaStore::new(Arc::new(LocalStore::new(coalesced.clone(), 100)));
        let reports = Arc::new(ShareReports::default());
        let rounds = [[(1, 0), (2, 0), (3, 0)], [(1, 400), (2, 100), (3, 50)], [(3, 600), (1, 10), (2, 90)]];
        for (round, envoys) in rounds.iter().enumerate() {
            let first = round == 0;
            let report = |(envoy, allowed): (u64, u64)| {
                let mut report = item(envoy, allowed);
                if first {
                    report.report.elapsed = Nanos::ZERO;
                }
                report
            };
            let mut expected = Vec::new();
            for envoy in envoys.iter() {
                expected.extend(alone.report_shares(&[report(*envoy)]).await);
            }
            // Every stream's report made before any is decided: one
            // transaction takes them all.
            let [a, b, c] = [0, 1, 2].map(|i| report(envoys[i]));
            let (a, b, c) = tokio::join!(
                reports.report(&together, vec![a]),
                reports.report(&together, vec![b]),
                reports.report(&together, vec![c])
            );
            let answers = [a, b, c];
            let answers: Vec<ShareAnswer> = answers.into_iter().flatten().collect();
            assert_eq!(answers, expected, "round {round}");
            assert!(reports.pending.lock().unwrap().by_key.is_empty(), "nothing left waiting");
            one_by_one.advance(Nanos::from_secs(5));
            coalesced.advance(Nanos::from_secs(5));
        }
    }
}
