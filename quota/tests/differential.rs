//! The two stores are one implementation: a long pseudo-random sequence of
//! checks, leases (some retried, most of them naming the next window:
//! leases ahead), returns and clock steps, over limits drawn
//! from the whole configurable range (every offered algorithm, 1 to 10⁹
//! units per second to per year, bursts up to 10⁹, any sub-windows,
//! warm-ups and cold factors), is run against the memory store and
//! a real redis-server driven by the same fake clock, and every answer
//! must be identical to the nanosecond.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::T0;
use floodgate_core::algorithm::Registration;
use floodgate_core::bounds::MAX_AMOUNT;
use floodgate_core::rng::Rng;
use floodgate_core::time::{Clock, FakeClock, Nanos, SECOND};
use floodgate_e2e::RedisServer;
use floodgate_quota::config::{offered_algorithms, Limit};
use floodgate_quota::store::{BucketCheck, BucketLease, LeaseReturn, LocalStore, QuotaStore, RedisOptions, RedisStore};

/// The sequence's draws beyond the core's deterministic generator (so a
/// failure replays exactly).
trait Draws {
    /// 1 ..= most, spread evenly over the orders of magnitude.
    fn magnitude(&mut self, most: u64) -> u64;
}

impl Draws for Rng {
    fn magnitude(&mut self, most: u64) -> u64 {
        let digits = self.below(10) as u32;
        (1 + self.below(10u64.pow(digits))).min(most)
    }
}

const DAY: Nanos = Nanos::from_secs(86_400);
const PERIODS: [Nanos; 7] = [
    Nanos::from_secs(1),
    Nanos::from_secs(60),
    Nanos::from_secs(3_600),
    DAY,
    Nanos::from_secs(7 * 86_400),
    Nanos::from_secs(30 * 86_400),
    Nanos::from_secs(365 * 86_400),
];

/// Any algorithm the limits file offers (the registry's, so a new one is
/// drawn too), with its own fields drawn by name.
fn random_limit(rng: &mut Rng) -> Limit {
    let offered: Vec<&Registration> = offered_algorithms().collect();
    let registration = offered[rng.below(offered.len() as u64) as usize];
    let period = PERIODS[rng.below(PERIODS.len() as u64) as usize];
    // A sliding log stores every admission: its limit is capped at 1000.
    let limit = if registration.name == "sliding_log" { 1 + rng.below(1_000) } else { rng.magnitude(MAX_AMOUNT) };
    let mut fields = serde_json::Map::new();
    for field in registration.fields.iter().filter(|f| **f != "period") {
        if let Some(value) = random_field(rng, field) {
            fields.insert(field.to_string(), value);
        }
    }
    let fields = serde_json::Value::Object(fields).to_string();
    Limit::new(registration.name, limit, period, &fields).unwrap()
}

/// A value of an algorithm's own field over its whole range, or none (the
/// default); a field with no draw here fails the test until it has one.
fn random_field(rng: &mut Rng, field: &str) -> Option<serde_json::Value> {
    match field {
        "burst" => Some(rng.magnitude(MAX_AMOUNT).into()),
        "sub_windows" => (rng.below(2) == 1).then(|| (2 + rng.below(59)).into()),
        "warmup" => Some(["1s", "30s", "10m", "7d"][rng.below(4) as usize].into()),
        "cold_factor" => Some((2 + rng.below(99)).into()),
        other => panic!("no draw for the algorithm field {other:?}: add one"),
    }
}

/// One of the last few leases (older ones have mostly expired).
fn recent<T: Clone>(rng: &mut Rng, leases: &[T]) -> T {
    let back = rng.below(leases.len().min(4) as u64) as usize;
    leases[leases.len() - 1 - back].clone()
}

/// The window a lease names: mostly the next one (a lease ahead, for the
/// algorithms that count in windows), sometimes none, the current one, or
/// one that is neither.
fn named_window(rng: &mut Rng, limit: &Limit, now: Nanos) -> Option<u64> {
    let policy = limit.policy();
    let mut fresh = vec![0; policy.state_len()];
    policy.write_fresh(&mut fresh, now);
    let current = policy.counting_window(&fresh, now).map_or(0, |w| w.index);
    match rng.below(6) {
        0 => None,
        1 => Some(current),
        2 => Some(rng.next_u64()),
        _ => Some(current + 1),
    }
}

fn stores(redis: &RedisServer, clock: &Arc<FakeClock>) -> (QuotaStore, QuotaStore) {
    let shared: Arc<dyn Clock> = clock.clone();
    let memory = QuotaStore::new(Arc::new(LocalStore::new(shared.clone(), 100_000)));
    let options = RedisOptions { timeout: Duration::from_secs(5), clock: Some(shared), clock_bound: None };
    (memory, QuotaStore::new(Arc::new(RedisStore::new(&redis.url(), options).unwrap())))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_and_redis_stores_answer_identically_across_the_whole_range() {
    let redis = RedisServer::start();
    let clock = Arc::new(FakeClock::new(T0 + Nanos::from_micros(123_457)));
    let (memory, remote) = stores(&redis, &clock);
    let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
    let limits: Vec<Limit> = (0..24).map(|_| random_limit(&mut rng)).collect();
    let ttl = SECOND;
    let mut leases: Vec<BucketLease> = Vec::new();
    let mut seen = [0usize; 4];
    // Outcomes worth comparing: admitted checks, denied checks, grants,
    // replayed grants, tokens given back, grants ahead of their window,
    // ids of another lease refused.
    let mut outcomes = [0usize; 7];

    for step in 0..3_000 {
        let pick = |rng: &mut Rng| {
            let l = rng.below(limits.len() as u64) as usize;
            (format!("fg:{{t}}:k{l}:v{}", rng.below(2)), limits[l].clone())
        };
        // Costs near the limit matter most: some tiny, some up to the whole capacity.
        let cost = |rng: &mut Rng, limit: &Limit| match rng.below(3) {
            0 => rng.below(5),
            1 => rng.below(limit.capacity() / 4 + 1),
            _ => rng.below(limit.capacity() + 2),
        };
        match rng.below(10) {
            0..=3 => {
                let mut items: Vec<BucketCheck> = (0..1 + rng.below(3))
                    .map(|_| {
                        let (key, limit) = pick(&mut rng);
                        BucketCheck { cost: cost(&mut rng, &limit), key, limit, shadow: rng.below(6) == 0 }
                    })
                    .collect();
                // The service merges duplicate buckets before a store sees them.
                items.sort_by(|a, b| a.key.cmp(&b.key));
                items.dedup_by(|a, b| a.key == b.key);
                let a = memory.check(&items).await.unwrap();
                let b = remote.check(&items).await.unwrap();
                assert_eq!(a, b, "step {step}: check {items:?}");
                outcomes[usize::from(!a.committed)] += 1;
                seen[0] += 1;
            }
            4..=6 => {
                let items: Vec<BucketLease> = (0..1 + rng.below(2))
                    .map(|i| {
                        let (key, limit) = pick(&mut rng);
                        let rate = match rng.below(3) {
                            0 => None,
                            _ => Some(rng.magnitude(MAX_AMOUNT) as f64 / 7.0),
                        };
                        let wanted = cost(&mut rng, &limit);
                        let window = named_window(&mut rng, &limit, clock.now());
                        let per_window = rng.below(2) == 0;
                        // Now and then units admitted without a lease.
                        let reported = if rng.below(6) == 0 { rng.below(4) } else { 0 };
                        let new = format!("fg:{{t}}:lease:{step}-{i}");
                        // Now and then a retry of an earlier lease, rarely
                        // with its id on another bucket.
                        match (rng.below(4), rng.below(5)) {
                            (0, 0) if !leases.is_empty() => {
                                let record = recent(&mut rng, &leases).record;
                                let caller = None;
                                BucketLease {
                                    key,
                                    limit,
                                    wanted,
                                    rate,
                                    window,
                                    per_window,
                                    reported,
                                    record,
                                    caller,
                                    check: false,
                                }
                            }
                            (0, _) if !leases.is_empty() => recent(&mut rng, &leases),
                            _ => {
                                let (record, caller) = (new, None);
                                BucketLease {
                                    key,
                                    limit,
                                    wanted,
                                    rate,
                                    window,
                                    per_window,
                                    reported,
                                    record,
                                    caller,
                                    check: false,
                                }
                            }
                        }
                    })
                    .collect();
                let a = memory.lease(&items, ttl).await.unwrap();
                let b = remote.lease(&items, ttl).await.unwrap();
                assert_eq!(a, b, "step {step}: lease {items:?}");
                let grants = a.as_deref().unwrap_or_default();
                outcomes[2] += grants.iter().filter(|g| g.granted > 0 && !g.replayed).count();
                outcomes[3] += grants.iter().filter(|g| g.replayed).count();
                outcomes[5] += grants.iter().filter(|g| g.granted > 0 && g.starts > Nanos::ZERO).count();
                outcomes[6] += usize::from(a.is_err());
                leases.extend(items);
                seen[1] += 1;
            }
            7 => {
                let record = match leases.len() {
                    0 => "fg:{t}:lease:none".to_string(),
                    _ => recent(&mut rng, &leases).record,
                };
                let items = [LeaseReturn { record, tokens: rng.magnitude(MAX_AMOUNT) }];
                let a = memory.give_back(&items, &|_| None).await.unwrap();
                let b = remote.give_back(&items, &|_| None).await.unwrap();
                assert_eq!(a, b, "step {step}: return {items:?}");
                outcomes[4] += usize::from(a[0].returned > 0);
                seen[2] += 1;
            }
            _ => {
                // From a microsecond to weeks, across windows of every size.
                let span = match rng.below(4) {
                    0 => rng.below(1_000_000),
                    1 => rng.below(SECOND.get()),
                    2 => rng.below(SECOND.times(8).get()),
                    _ => rng.below(DAY.times(40).get()),
                };
                clock.advance(Nanos::from_nanos(span));
                seen[3] += 1;
            }
        }
    }
    assert!(seen.iter().all(|n| *n > 100), "every kind of step ran: {seen:?}");
    assert!(outcomes.iter().all(|n| *n > 20), "every kind of outcome was compared: {outcomes:?}");
}

/// The case where the old Lua copy (double arithmetic) and the core
/// disagreed by a microsecond: a token bucket of 348,573,278 per year that
/// is 193,572,398 tokens short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_yearly_bucket_waits_exactly_as_long_in_both_stores() {
    let redis = RedisServer::start();
    let clock = Arc::new(FakeClock::new(T0));
    let (memory, remote) = stores(&redis, &clock);
    let limit = Limit::new("token_bucket", 348_573_278, DAY.times(365), "{}").unwrap();
    let take = |cost| [BucketCheck { key: "fg:{t}:huge".into(), limit: limit.clone(), cost, shadow: false }];
    for store in [&memory, &remote] {
        assert!(store.check(&take(348_573_278)).await.unwrap().committed);
        let denied = store.check(&take(193_572_398)).await.unwrap();
        assert!(!denied.committed);
        // ceil(193,572,398 × 31,536,000 s / 348,573,278) in whole nanoseconds.
        assert_eq!(denied.decisions[0].retry_after(), Nanos::from_nanos(17_512_814_460_000_001));
    }
}
