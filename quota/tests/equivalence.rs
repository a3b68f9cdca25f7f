//! The two stores are one algorithm: a long pseudo-random sequence of
//! checks, leases, returns and clock steps (awkward rates, microsecond
//! steps) is run against the memory store and a real redis-server driven by
//! the same manual clock, and every answer must be identical to the
//! microsecond.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{RedisServer, T0};
use floodgate_quota::clock::{Clock, ManualClock, SECOND_US};
use floodgate_quota::config::{Algorithm, Limit};
use floodgate_quota::store::{CheckItem, LeaseItem, MemoryStore, RedisOptions, RedisStore, ReturnItem};

/// xorshift64*: deterministic, so a failure replays exactly.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn limits() -> Vec<Limit> {
    vec![
        // 7 tokens per 3 s: a token every 428,571.43 µs, never a whole number.
        Limit { algorithm: Algorithm::TokenBucket, limit: 7, period: 3 * SECOND_US, capacity: 10 },
        Limit { algorithm: Algorithm::TokenBucket, limit: 1_000, period: 60 * SECOND_US, capacity: 50 },
        Limit { algorithm: Algorithm::FixedWindow, limit: 13, period: 7 * SECOND_US, capacity: 13 },
        Limit { algorithm: Algorithm::FixedWindow, limit: 500, period: 3_600 * SECOND_US, capacity: 500 },
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_and_redis_stores_answer_identically() {
    let redis = RedisServer::start();
    let clock = Arc::new(ManualClock::new(T0 + 123_457));
    let shared: Arc<dyn Clock> = clock.clone();
    let memory = MemoryStore::new(shared.clone(), 10_000);
    let options = RedisOptions { timeout: Duration::from_secs(5), clock: Some(shared) };
    let remote = RedisStore::new(&redis.url(), options).unwrap();
    let limits = limits();
    let ttl = SECOND_US;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut leases: Vec<String> = Vec::new();
    let mut seen = [0usize; 4];

    for step in 0..3_000 {
        let pick = |rng: &mut Rng| {
            let l = rng.below(limits.len() as u64) as usize;
            let v = rng.below(3) as usize;
            (l * 3 + v, format!("k{l}:v{v}"), limits[l])
        };
        match rng.below(10) {
            0..=3 => {
                let n = 1 + rng.below(3);
                let items: Vec<CheckItem> = (0..n)
                    .map(|_| {
                        let (_, key, limit) = pick(&mut rng);
                        CheckItem { key, limit, cost: rng.below(5), shadow: rng.below(6) == 0 }
                    })
                    .collect();
                // Duplicate keys are merged by the service before a store sees them.
                let mut unique = items.clone();
                unique.sort_by(|a, b| a.key.cmp(&b.key));
                unique.dedup_by(|a, b| a.key == b.key);
                let a = memory.check(&unique).unwrap();
                let b = remote.check(&unique).await.unwrap();
                assert_eq!(a, b, "step {step}: check {unique:?}");
                seen[0] += 1;
            }
            4..=6 => {
                let n = 1 + rng.below(2);
                let items: Vec<LeaseItem> = (0..n)
                    .map(|i| {
                        let (_, key, limit) = pick(&mut rng);
                        // Now and then a retry of an earlier lease.
                        let record = match rng.below(8) {
                            0 if !leases.is_empty() => leases[rng.below(leases.len() as u64) as usize].clone(),
                            _ => format!("fg:{{t}}:lease:{step}-{i}"),
                        };
                        LeaseItem { key, limit, want: 1 + rng.below(40), record }
                    })
                    .collect();
                let a = memory.lease(&items, ttl).unwrap();
                let b = remote.lease(&items, ttl).await.unwrap();
                assert_eq!(a, b, "step {step}: lease {items:?}");
                leases.extend(items.into_iter().map(|i| i.record));
                seen[1] += 1;
            }
            7 => {
                let record = match leases.len() as u64 {
                    0 => "fg:{t}:lease:none".to_string(),
                    n => leases[rng.below(n) as usize].clone(),
                };
                let items = [ReturnItem { record, tokens: rng.below(20) }];
                let a = memory.give_back(&items).unwrap();
                let b = remote.give_back(&items).await.unwrap();
                assert_eq!(a, b, "step {step}: return {items:?}");
                seen[2] += 1;
            }
            _ => {
                // From a microsecond to a few seconds, sometimes across windows.
                let span = match rng.below(3) {
                    0 => rng.below(1_000),
                    1 => rng.below(SECOND_US),
                    _ => rng.below(8 * SECOND_US),
                };
                clock.advance(span);
                seen[3] += 1;
            }
        }
    }
    assert!(seen.iter().all(|n| *n > 100), "every kind of step ran: {seen:?}");
}
