//! Redis Cluster: a real three-master cluster on loopback (started and
//! killed by the harness). Each domain's keys sit in its hash tag's slot, so
//! every call runs on the master owning it, `TIME` included; two domains on
//! two masters both work; a slot moved to another master is followed; a
//! stopped or frozen master gives clean 503s and is served again by itself.
//! (The behaviour suite runs on the cluster too, in `behaviour.rs`.)

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::{Fixture, Options};
use floodgate_e2e::redis::{RedisCluster, CLUSTER_NODE_TIMEOUT_MS};
use serde_json::{json, Value};

fn limits(domain: &str) -> String {
    format!(
        "domain: {domain:?}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: 3}}\n  - key: big\n    rate_limit: {{unit: hour, requests_per_unit: 1000}}\n"
    )
}

fn check(domain: &str, descriptors: Value) -> Value {
    json!({"domain": domain, "descriptors": descriptors})
}

fn options() -> Options {
    Options { store_timeout: Duration::from_millis(300), ..Options::default() }
}

async fn serve(cluster: RedisCluster, yaml: &str, options: Options) -> Fixture {
    let mut f = Fixture::serve(Some(cluster.url()), None, yaml, options).await;
    f.cluster = Some(cluster);
    f
}

async fn start_cluster() -> RedisCluster {
    tokio::task::spawn_blocking(RedisCluster::start).await.unwrap()
}

fn cluster_of(f: &Fixture) -> &RedisCluster {
    f.cluster.as_ref().unwrap()
}

/// Every key stored on node `node`.
fn keys_on(cluster: &RedisCluster, node: usize) -> Vec<String> {
    let mut keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut cluster.connection(node)).unwrap();
    keys.sort();
    keys
}

/// A check, a lease and its return, each over several keys of `domain`.
async fn use_domain(f: &Fixture, domain: &str) {
    let r = f.check(check(domain, json!([[["k", "a"]], [["k", "b"]], [["big", "c"]]]))).await;
    assert_eq!(r["allowed"], true, "{r}");
    let lease = json!({"domain": domain, "leases": [
        {"id": "l1", "descriptor": [["big", "c"]], "wanted": 10, "rate": 100.0},
        {"id": "l2", "descriptor": [["k", "a"]], "wanted": 1, "rate": 1.0},
    ]});
    let r = f.lease(lease).await;
    assert_eq!(r["leases"][0]["granted"], 10, "{r}");
    assert_eq!(r["leases"][1]["granted"], 1, "{r}");
    let r =
        f.give_back(json!({"domain": domain, "returns": [{"id": "l1", "tokens": 4}, {"id": "l2", "tokens": 1}]})).await;
    assert_eq!(r["returned"], json!([4, 1]), "{r}");
    let r = f.check(check(domain, json!([[["big", "c"]]]))).await;
    assert_eq!(r["results"][0]["remaining"], 1000 - 1 - 10 + 4 - 1, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_domains_on_two_masters_both_work_each_on_its_own_master() {
    let cluster = start_cluster().await;
    // Two domains whose hash tags land on different masters.
    let names = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"];
    let owner = |name: &str| cluster.owner_of(&format!("{{{name}}}"));
    let first = names[0];
    let second = *names.iter().find(|n| owner(n) != owner(first)).unwrap();
    let (a, b) = (owner(first), owner(second));
    let idle = 3 - a - b;
    let yaml = format!("{}\n---\n{}", limits(first), limits(second));
    // Redis's clock: the TIME of each read must run on the keys' master.
    let f = serve(cluster, &yaml, Options { redis_time: true, ..options() }).await;

    use_domain(&f, first).await;
    use_domain(&f, second).await;

    let c = cluster_of(&f);
    for (domain, node) in [(first, a), (second, b)] {
        let keys = keys_on(c, node);
        assert_eq!(keys.len(), 5, "3 buckets and 2 lease records of {domain} on node {node}: {keys:?}");
        assert!(keys.iter().all(|k| k.starts_with(&format!("fg:{{{domain}}}:"))), "{keys:?}");
        assert!(c.calls(node, "time") > 0, "node {node} told the time for {domain}");
        assert!(c.calls(node, "evalsha") > 0, "node {node} ran the writes for {domain}");
    }
    assert_eq!(keys_on(c, idle), Vec::<String>::new());
    assert_eq!(c.calls(idle, "time"), 0, "no clock read went to the master owning neither domain");
    assert_eq!(c.calls(idle, "evalsha"), 0);
    let ready = f.client.get(format!("{}/readyz", f.base)).send().await.unwrap();
    assert_eq!(ready.status().as_u16(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_moved_to_another_master_is_followed_with_its_counts() {
    let f = serve(start_cluster().await, &limits("test"), options()).await;
    for remaining in [2, 1] {
        let r = f.check(check("test", json!([[["k", "a"]]]))).await;
        assert_eq!(r["results"][0]["remaining"], remaining);
    }
    let c = cluster_of(&f);
    let slot = c.slot_of("{test}");
    let from = c.owner_of_slot(slot);
    let to = (from + 1) % 3;
    tokio::task::block_in_place(|| c.move_slot(slot, to));
    let moved_before = c.errors(from, "MOVED");

    // The service still holds the old slot map: its next call gets MOVED.
    let r = f.check(check("test", json!([[["k", "a"]]]))).await;
    assert_eq!(r["allowed"], true, "{r}");
    assert_eq!(r["results"][0]["remaining"], 0, "the count moved with the slot: {r}");
    assert!(c.errors(from, "MOVED") > moved_before, "the old master redirected the call");
    let r = f.check(check("test", json!([[["k", "a"]]]))).await;
    assert_eq!(r["allowed"], false, "{r}");
    assert!(!keys_on(c, to).is_empty());
    assert_eq!(keys_on(c, from), Vec::<String>::new());
}

async fn assert_unavailable(f: &Fixture, kind: &str) {
    let before = store_errors(f, kind).await;
    for (path, body) in [
        ("/v1/check", check("test", json!([[["k", "a"]], [["big", "b"]]]))),
        ("/v1/lease", json!({"domain": "test", "leases": [{"id": "l", "descriptor": [["big", "b"]], "wanted": 5}]})),
    ] {
        let (status, body) = f.post(path, &body).await;
        assert_eq!(status, 503, "{path}: {body}");
        assert!(body["error"].as_str().unwrap_or_default().contains("store"), "{path}: {body}");
    }
    assert!(store_errors(f, kind).await >= before + 2, "counted as {kind}: {}", f.metrics().await);
}

async fn store_errors(f: &Fixture, kind: &str) -> u64 {
    let prefix = format!(r#"floodgate_quota_store_errors_total{{kind="{kind}",store="redis"}} "#);
    f.metrics().await.lines().find_map(|l| l.strip_prefix(&prefix)).map_or(0, |n| n.parse().unwrap())
}

/// Polls until a check succeeds (a bounded wait, not a timed assertion).
async fn wait_until_serving(f: &Fixture) -> Value {
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let (status, body) = f.post("/v1/check", &check("test", json!([[["k", "a"]]]))).await;
        if status == 200 {
            return body;
        }
        assert_eq!(status, 503, "only 503 while the master comes back: {body}");
        assert!(Instant::now() < deadline, "never served again: {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_master_of_a_domain_stopped_gives_503_then_serves_again_by_itself() {
    let mut f = serve(start_cluster().await, &limits("test"), options()).await;
    assert_eq!(f.check(check("test", json!([[["k", "a"]]]))).await["allowed"], true);
    let owner = cluster_of(&f).owner_of("{test}");

    f.cluster.as_mut().unwrap().stop_node(owner);
    assert_unavailable(&f, "unavailable").await;
    // Past the node timeout the other masters mark it failed; still 503.
    tokio::time::sleep(Duration::from_millis(CLUSTER_NODE_TIMEOUT_MS * 2)).await;
    let (status, body) = f.post("/v1/check", &check("test", json!([[["k", "a"]]]))).await;
    assert_eq!(status, 503, "{body}");

    let c = f.cluster.as_mut().unwrap();
    tokio::task::block_in_place(|| {
        c.start_node(owner);
        c.wait_until_ok();
    });
    // Without persistence the restarted master forgot the count.
    let r = wait_until_serving(&f).await;
    assert_eq!(r["results"][0]["remaining"], 2, "{r}");
    let ready = f.client.get(format!("{}/readyz", f.base)).send().await.unwrap();
    assert_eq!(ready.status().as_u16(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_master_times_out_then_serves_when_thawed() {
    let f = serve(start_cluster().await, &limits("test"), options()).await;
    assert_eq!(f.check(check("test", json!([[["k", "a"]]]))).await["allowed"], true);
    let c = cluster_of(&f);
    let owner = c.owner_of("{test}");
    c.freeze_node(owner, true);
    let started = Instant::now();
    assert_unavailable(&f, "timeout").await;
    c.freeze_node(owner, false);
    // Frozen for less than the node timeout, so no master was marked failed;
    // the count survived. The check that timed out was sent (a decision is
    // one round trip) and may have run when the master woke up: a 503 means
    // "maybe applied", never more than once.
    assert!(started.elapsed() < Duration::from_millis(CLUSTER_NODE_TIMEOUT_MS), "the test itself was slow");
    let r = wait_until_serving(&f).await;
    let remaining = r["results"][0]["remaining"].as_u64().unwrap();
    assert!(remaining == 1 || remaining == 0, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_domain_whose_keys_have_no_common_hash_tag_is_refused_by_name() {
    // `fg:{}odd}:…` has an empty hash tag: Redis hashes each key whole, so
    // the keys of one call could span slots.
    let f = serve(start_cluster().await, &limits("}odd"), options()).await;
    let (status, body) = f.post("/v1/check", &check("}odd", json!([[["k", "a"]], [["k", "b"]]]))).await;
    assert_eq!(status, 503, "{body}");
    let message = body["error"].as_str().unwrap();
    assert!(
        message.contains("different Redis Cluster hash tags") && message.contains("must not start with '}'"),
        "{body}"
    );
    let r = f.check(check("}odd", json!([[["k", "a"]]]))).await;
    assert_eq!(r["allowed"], true, "one key is one slot: {r}");
}
