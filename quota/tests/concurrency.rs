//! Many parallel clients leasing and checking one limit, against each store:
//! the total admitted never passes the limit, grants shrink as quota runs
//! low, and returned tokens can be used again.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;

use common::{Backend, Fixture};
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
