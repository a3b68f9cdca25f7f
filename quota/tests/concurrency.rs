//! Many parallel clients leasing and checking one limit, against each store:
//! the total admitted never passes the limit, grants shrink as quota runs
//! low, and returned tokens can be used again.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;

use common::{Backend, Fixture};
use floodgate_e2e::RedisServer;
use serde_json::json;

const LIMITS: &str = r#"
domain: fleet
descriptors:
  - key: api
    rate_limit: {unit: hour, requests_per_unit: 5000}
"#;

const LIMIT: u64 = 5_000;
const CLIENTS: usize = 16;

/// What one client took: tokens leased and requests checked through.
#[derive(Default, Debug)]
struct Taken {
    leased: u64,
    checked: u64,
    grants: Vec<(u64, u64, String)>, // (granted, remaining after, lease id)
}

async fn client(f: Arc<Fixture>, id: usize) -> Taken {
    let mut taken = Taken::default();
    // Half the clients lease in batches (like proxies), half check one
    // request at a time; all of them until the service says no more.
    let leasing = id % 2 == 0;
    let mut empty_answers = 0;
    while empty_answers < 3 {
        if leasing {
            let lease = format!("c{id}-{}", taken.grants.len());
            let r = f
                .lease(json!({"domain": "fleet", "leases": [{"id": lease, "descriptor": [["api", "all"]], "wanted": 400, "rate": 200.0 + id as f64 * 50.0}]}))
                .await;
            let granted = r["leases"][0]["granted"].as_u64().unwrap();
            let remaining = r["leases"][0]["remaining"].as_u64().unwrap();
            taken.leased += granted;
            taken.grants.push((granted, remaining, lease));
            if granted == 0 {
                empty_answers += 1;
            }
        } else {
            let r = f.check(json!({"domain": "fleet", "descriptors": [[["api", "all"]]], "hits": 1})).await;
            if r["allowed"] == true {
                taken.checked += 1;
            } else {
                empty_answers += 1;
            }
        }
    }
    taken
}

async fn many_clients_never_pass_the_limit(backend: Backend) {
    let f = Arc::new(Fixture::new(backend, LIMITS).await);
    let tasks: Vec<_> = (0..CLIENTS).map(|id| tokio::spawn(client(f.clone(), id))).collect();
    let mut all = Vec::new();
    for task in tasks {
        all.push(task.await.unwrap());
    }
    let leased: u64 = all.iter().map(|t| t.leased).sum();
    let checked: u64 = all.iter().map(|t| t.checked).sum();
    assert_eq!(leased + checked, LIMIT, "everything admitted exactly once: leased {leased} + checked {checked}");
    assert!(checked > 0 && leased > 0, "both kinds of client got some: {checked} {leased}");

    // Every grant was at most half of what remained before it, and once
    // below 10 % every grant was paced down to a handful.
    for t in &all {
        for (granted, after, _) in &t.grants {
            let before = granted + after;
            assert!(*granted <= before.div_ceil(2), "granted {granted} of {before}");
            if before * 10 < LIMIT {
                assert!(*granted <= 1, "low-water grant {granted} of {before}");
            }
        }
    }

    // Returned tokens are available again, to anyone.
    let (_, _, big) = all.iter().flat_map(|t| &t.grants).find(|(granted, _, _)| *granted >= 40).unwrap();
    let r = f.give_back(json!({"domain": "fleet", "returns": [{"id": big, "tokens": 40}]})).await;
    assert_eq!(r["returned"][0], 40);
    let tasks: Vec<_> = (0..CLIENTS).map(|id| tokio::spawn(client(f.clone(), id + CLIENTS))).collect();
    let mut again = 0;
    for task in tasks {
        let t = task.await.unwrap();
        again += t.leased + t.checked;
    }
    assert_eq!(again, 40, "exactly the returned tokens were admitted again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_many_clients_never_pass_the_limit() {
    many_clients_never_pass_the_limit(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_many_clients_never_pass_the_limit() {
    many_clients_never_pass_the_limit(Backend::Redis).await;
}

/// Two service instances sharing one Redis share one limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_one_redis_share_the_limit() {
    let first = Arc::new(Fixture::new(Backend::Redis, LIMITS).await);
    let url = first.redis.as_ref().unwrap().url();
    let second = Arc::new(Fixture::serve(Some(url), None, LIMITS, common::Options::default()).await);
    second.clock.set(floodgate_core::time::Clock::now(&*first.clock));
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|id| tokio::spawn(client(if id % 4 < 2 { first.clone() } else { second.clone() }, id)))
        .collect();
    let mut total = 0;
    for task in tasks {
        let t = task.await.unwrap();
        total += t.leased + t.checked;
    }
    assert_eq!(total, LIMIT);
}

/// Two instances racing on one key through the one-round-trip path (each
/// deciding on what it last saw, Redis's clock estimated and checked by the
/// script) admit exactly the limit between them. Alone, an instance decides in
/// one round trip per call; racing, a call that finds the other's write
/// decides again on what the script answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_race_on_one_key_through_one_round_trip() {
    use floodgate_core::time::SECOND;
    use floodgate_quota::config::Limit;
    use floodgate_quota::store::{BucketCheck, QuotaStore, RedisOptions, RedisStore};

    let redis = RedisServer::start();
    let instance = || {
        let options = RedisOptions::redis_clock(std::time::Duration::from_secs(5));
        Arc::new(RedisStore::new(&redis.url(), options).unwrap())
    };
    let (a, b) = (instance(), instance());
    // 2000 a year: nothing is earned back during the test.
    let limit = Limit::new("token_bucket", 2_000, SECOND.times(365 * 86_400), "{}").unwrap();
    let item = [BucketCheck { key: "fg:{race}:tb:one".into(), limit, cost: 1, shadow: false }];
    let store_a = Arc::new(QuotaStore::new(a.clone()));
    let store_b = Arc::new(QuotaStore::new(b.clone()));

    // Alone: the first call reads (no clock yet), then one round trip each.
    assert!(store_a.check(&item).await.unwrap().committed);
    let before = a.round_trips();
    for _ in 0..100 {
        assert!(store_a.check(&item).await.unwrap().committed);
    }
    let after = a.round_trips();
    assert_eq!((after.0 - before.0, after.1 - before.1), (100, 100), "one round trip per call");

    // Racing: 32 clients, half on each instance, 3,200 calls for 1,899 left.
    let (a0, b0) = (a.round_trips(), b.round_trips());
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let store = if i % 2 == 0 { store_a.clone() } else { store_b.clone() };
            let item = item.clone();
            tokio::spawn(async move {
                let mut admitted = 0u64;
                for _ in 0..100 {
                    admitted += u64::from(store.check(&item).await.unwrap().committed);
                }
                admitted
            })
        })
        .collect();
    let mut admitted = 101;
    for task in tasks {
        admitted += task.await.unwrap();
    }
    assert_eq!(admitted, 2_000, "exactly the limit between the two instances");
    let (a1, b1) = (a.round_trips(), b.round_trips());
    let transactions = (a1.0 - a0.0) + (b1.0 - b0.0);
    let round_trips = (a1.1 - a0.1) + (b1.1 - b0.1);
    assert!(round_trips > transactions, "the instances raced: {round_trips} round trips, {transactions} transactions");
    assert!(transactions < 3_200, "calls on the hot key were coalesced: {transactions} transactions for 3,200 calls");
}

/// A service core too busy to read Redis's reply for a while must not
/// leave its estimate of Redis's clock behind by that while: the script
/// refuses a decision on a time more than 100 ms from Redis's, so an
/// estimate behind by the time a reply waited had every write of a
/// saturated instance refused until its deadline. Here the one thread of
/// the runtime is blocked while a call's reply waits; the next call is
/// still written at its first attempt.
#[tokio::test(flavor = "current_thread")]
async fn a_reply_read_late_does_not_put_the_clock_estimate_behind() {
    use floodgate_core::time::SECOND;
    use floodgate_quota::config::Limit;
    use floodgate_quota::store::{BucketCheck, QuotaStore, RedisOptions, RedisStore};

    let redis = RedisServer::start();
    let options = RedisOptions::redis_clock(std::time::Duration::from_secs(5));
    let instance = Arc::new(RedisStore::new(&redis.url(), options).unwrap());
    let store = Arc::new(QuotaStore::new(instance.clone()));
    let limit = Limit::new("token_bucket", 1_000, SECOND.times(3_600), "{}").unwrap();
    let item = [BucketCheck { key: "fg:{late}:tb:one".into(), limit, cost: 1, shadow: false }];
    // The first call reads Redis's clock; the second has an estimate.
    for _ in 0..2 {
        assert!(store.check(&item).await.unwrap().committed);
    }
    let late = tokio::spawn({
        let (store, item) = (store.clone(), item.clone());
        async move { store.check(&item).await.unwrap().committed }
    });
    // The call is sent (a few turns of the runtime) to a Redis frozen for
    // the first 30 ms of the 300 the thread is busy: Redis reads its clock
    // 30 ms after the send, and the reply waits 270 ms to be read.
    redis.pause();
    for _ in 0..4 {
        tokio::task::yield_now().await;
    }
    std::thread::sleep(std::time::Duration::from_millis(30));
    redis.resume();
    std::thread::sleep(std::time::Duration::from_millis(270));
    assert!(late.await.unwrap());
    let before = instance.round_trips();
    assert!(store.check(&item).await.unwrap().committed);
    let after = instance.round_trips();
    assert_eq!(after.1 - before.1, 1, "written at the first attempt");
}

const SHARED: &str = r#"
domain: shared
descriptors:
  - key: k
    rate_limit: {unit: hour, requests_per_unit: 1000000000}
"#;

/// Keys every instance's calls lease and return.
const KEYS: usize = 512;

/// Three service instances on one Redis, two callers on each leasing all of
/// 512 keys in one call and returning half of every lease in the next, all
/// at once:
/// every call is answered (instances writing the same keys take turns
/// instead of racing: before, they lost every race to each other's rounds
/// and a call in three timed out, with nothing at fault), and conservation
/// is exact: every key holds what the answers say was granted and not
/// given back. The functional tests' store timeout (2 s): what is counted
/// is a 503 from instances that never stop racing, not a slow machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_leasing_the_same_512_keys_a_call_answer_every_call() {
    const CALLS: usize = 3;
    let redis = floodgate_e2e::RedisServer::start();
    let mut instances = Vec::new();
    for _ in 0..3 {
        let options = common::Options { redis_time: true, ..common::Options::default() };
        instances.push(Arc::new(Fixture::serve(Some(redis.url()), None, SHARED, options).await));
    }
    // Two callers on each instance.
    let tasks: Vec<_> = (0..2 * instances.len())
        .map(|n| {
            let f = instances[n % instances.len()].clone();
            tokio::spawn(async move {
                let mut held = vec![0u64; KEYS];
                let mut failures = Vec::new();
                for call in 0..CALLS {
                    let id = |i: usize| format!("i{n}-{call}-{i}");
                    let leases: Vec<_> = (0..KEYS)
                        .map(|i| json!({"id": id(i), "descriptor": [["k", format!("key{i}")]], "wanted": 10}))
                        .collect();
                    let (status, body) = f.post("/v1/lease", &json!({"domain": "shared", "leases": leases})).await;
                    if status != 200 {
                        failures.push(format!("lease: {status} {body}"));
                        continue;
                    }
                    for (i, grant) in body["leases"].as_array().unwrap().iter().enumerate() {
                        held[i] += grant["granted"].as_u64().unwrap();
                    }
                    let returns: Vec<_> = (0..KEYS).map(|i| json!({"id": id(i), "tokens": 5})).collect();
                    let (status, body) = f.post("/v1/return", &json!({"domain": "shared", "returns": returns})).await;
                    if status != 200 {
                        failures.push(format!("return: {status} {body}"));
                        continue;
                    }
                    for (i, back) in body["returned"].as_array().unwrap().iter().enumerate() {
                        held[i] -= back.as_u64().unwrap();
                    }
                }
                (held, failures)
            })
        })
        .collect();
    let mut held = vec![0u64; KEYS];
    let mut failures = Vec::new();
    for task in tasks {
        let (mine, failed) = task.await.unwrap();
        held.iter_mut().zip(mine).for_each(|(all, one)| *all += one);
        failures.extend(failed);
    }
    assert!(failures.is_empty(), "{} of {} calls failed: {failures:#?}", failures.len(), 6 * 2 * CALLS);
    for chunk in (0..KEYS).collect::<Vec<_>>().chunks(32) {
        let descriptors: Vec<_> = chunk.iter().map(|i| json!([["k", format!("key{i}")]])).collect();
        let answer = instances[0].check(json!({"domain": "shared", "descriptors": descriptors, "hits": 0})).await;
        for (i, result) in chunk.iter().zip(answer["results"].as_array().unwrap()) {
            let used = 1_000_000_000 - result["remaining"].as_u64().unwrap();
            assert_eq!(used, held[*i], "key{i}: the store's count is what the answers granted and took back");
        }
    }
}
