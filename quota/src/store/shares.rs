//! The store's part of RLQS shares: per bucket, the table of the Envoys
//! reporting it (their demand and what each was assigned, see
//! `floodgate_core::lease::shares`), read, decided on and written back in
//! one transaction per report of a bucket, on any store. On Redis every
//! service instance reads and writes the same table with the same
//! compare-and-swap as the buckets, so instances sharing a Redis share the
//! limit among all the Envoys of all of them.

use floodgate_core::lease::shares::{counting_window, Assigned, Report, ShareTable, Shares};
use floodgate_core::time::Nanos;

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

/// Records `item` in the table `stored` holds at `now`: the assignment and
/// the table to write.
fn decide(item: &ShareReport, stored: Option<&[u8]>, now: Nanos) -> (Option<Assigned>, Next) {
    let shares = item.shares(now);
    let mut table = ShareTable::decode(stored);
    let assigned = shares.report(&mut table, item.report, now);
    let idle_at = table.idle_at(shares.window.map(|w| w.end));
    let next = Next { bytes: table.encode(), idle_at, keep_until: idle_at, kind: Kind::Bucket, owner: None };
    (assigned, next)
}

impl QuotaStore {
    /// Records each report in its bucket's shares and answers each
    /// assignment (`None`: a bucket's first report, not answered yet): one
    /// transaction per report (reports of one bucket in order), all
    /// submitted together (on Redis, one script per slot).
    pub async fn report_shares(&self, items: &[ShareReport]) -> Vec<Result<Option<Assigned>, StoreFailure>> {
        let transactions = items
            .iter()
            .map(|item| {
                let keys = vec![item.key.clone()];
                let item = item.clone();
                let decide: Decider<Option<Assigned>> = Box::new(move |values, now| {
                    let (assigned, next) = decide(&item, values.first().and_then(|v| v.as_deref()), now);
                    (assigned, vec![Some(next)])
                });
                (keys, decide)
            })
            .collect();
        self.transact(transactions).await
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
}
