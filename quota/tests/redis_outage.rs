//! Redis going away: callers get a clean 503 with a message, bounded by the
//! store timeout (never a hang), and the service serves again by itself once
//! Redis is back, without being restarted.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::{Backend, Fixture, Options};
use floodgate_e2e::{free_port, RedisServer};
use floodgate_quota::server::Limits;
use serde_json::{json, Value};

const LIMITS: &str = "domain: test\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1000}\n";

fn options() -> Options {
    Options { store_timeout: Duration::from_millis(300), ..Options::default() }
}

fn check() -> Value {
    json!({"domain": "test", "descriptors": [[["k", "v"]]]})
}

fn lease() -> Value {
    json!({"domain": "test", "leases": [{"id": "outage", "descriptor": [["k", "v"]], "wanted": 5}]})
}

fn give_back() -> Value {
    json!({"domain": "test", "returns": [{"id": "outage", "tokens": 5}]})
}

async fn assert_unavailable(f: &Fixture) {
    for (path, body) in [("/v1/check", check()), ("/v1/lease", lease()), ("/v1/return", give_back())] {
        let (status, body) = f.post(path, &body).await;
        assert_eq!(status, 503, "{path}: {body}");
        let message = body["error"].as_str().unwrap_or_default();
        assert!(message.contains("store"), "{path}: the error says what failed: {body}");
    }
    let ready = f.client.get(format!("{}/readyz", f.base)).send().await.unwrap();
    assert_eq!(ready.status().as_u16(), 503);
    let live = f.client.get(format!("{}/healthz", f.base)).send().await.unwrap();
    assert_eq!(live.status().as_u16(), 200, "liveness does not depend on Redis");
}

/// Polls until a check succeeds (a bounded wait, not a timed assertion).
async fn wait_until_serving(f: &Fixture) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) = f.post("/v1/check", &check()).await;
        if status == 200 {
            return body;
        }
        assert_eq!(status, 503, "only 503 while Redis comes back: {body}");
        assert!(Instant::now() < deadline, "never served again: {body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_mid_test_gives_503_and_the_service_recovers() {
    let mut f = Fixture::with(Backend::Redis, LIMITS, options()).await;
    assert_eq!(f.check(check()).await["allowed"], true);

    f.redis.as_mut().unwrap().stop();
    assert_unavailable(&f).await;
    assert_unavailable(&f).await;
    assert!(f.metrics().await.contains("floodgate_quota_store_errors_total{kind="), "store errors are counted");

    f.redis.as_mut().unwrap().restart();
    let r = wait_until_serving(&f).await;
    assert_eq!(r["allowed"], true);
    let r = f.lease(lease()).await;
    assert_eq!(r["leases"][0]["code"], "ok");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_times_out_cleanly_and_recovers() {
    let f = Fixture::with(Backend::Redis, LIMITS, options()).await;
    assert_eq!(f.check(check()).await["allowed"], true);
    f.redis.as_ref().unwrap().pause();
    let (status, body) = f.post("/v1/check", &check()).await;
    assert_eq!(status, 503, "{body}");
    f.redis.as_ref().unwrap().resume();
    wait_until_serving(&f).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_started_before_redis_serves_once_redis_is_up() {
    let mut redis = RedisServer::stopped_on(free_port());
    let f = Fixture::serve(Some(redis.url()), None, LIMITS, options()).await;
    assert_unavailable(&f).await;
    redis.restart();
    let r = wait_until_serving(&f).await;
    assert_eq!(r["results"][0]["remaining"], 999);
}

const PER_MINUTE: &str =
    "domain: test\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1000}\n";

/// Uses up 1000/min, kills Redis with SIGKILL, starts it again on the same
/// data, and returns what a check says once the service serves again.
async fn used_up_then_redis_killed_and_restarted(redis: RedisServer) -> Value {
    let mut f = Fixture::serve(Some(redis.url()), Some(redis), PER_MINUTE, options()).await;
    for _ in 0..10 {
        let r = f.check(json!({"domain": "test", "descriptors": [[["k", "v"]]], "hits": 100})).await;
        assert_eq!(r["allowed"], true, "{r}");
    }
    let r = f.check(check()).await;
    assert_eq!(r["allowed"], false, "1000 used: {r}");

    let redis = f.redis.as_mut().unwrap();
    redis.stop();
    redis.restart();
    // The service's clock stands still: the same minute.
    wait_until_serving(&f).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_shipped_redis_conf_counts_survive_a_redis_crash() {
    let r = used_up_then_redis_killed_and_restarted(RedisServer::start_persistent(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("redis.conf"),
    ))
    .await;
    assert_eq!(r["allowed"], false, "the 1000 used before the restart still count: {r}");
    assert_eq!(r["results"][0]["remaining"], 0, "{r}");
}

/// What the README warns about: without persistence, a restart forgets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_persistence_a_redis_restart_forgets_the_counts() {
    let r = used_up_then_redis_killed_and_restarted(RedisServer::start()).await;
    assert_eq!(r["allowed"], true, "{r}");
    assert_eq!(r["results"][0]["remaining"], 999, "{r}");
}

/// Checks while Redis is frozen: each a 503 counted as a timeout, with the
/// timeout's message.
async fn assert_frozen_is_a_timeout(f: &Fixture) {
    let mut messages = Vec::new();
    for _ in 0..6 {
        let (status, body) = f.post("/v1/check", &check()).await;
        assert_eq!(status, 503, "{body}");
        messages.push(body["error"].as_str().unwrap_or_default().to_string());
    }
    let metrics = f.metrics().await;
    let kinds: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("floodgate_quota_store_errors_total{") && !l.ends_with(" 0"))
        .collect();
    assert!(kinds.iter().all(|l| l.contains(r#"kind="timeout""#)), "{kinds:?}\n{messages:?}");
    assert!(messages.iter().all(|m| m == "the store did not answer in time"), "{messages:?}");
}

/// A frozen Redis is one kind of failure, whatever stage the call was at:
/// connected, or connecting and waiting between connection attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_is_counted_as_a_timeout_only() {
    let f = Fixture::with(Backend::Redis, LIMITS, options()).await;
    assert_eq!(f.check(check()).await["allowed"], true);
    f.redis.as_ref().unwrap().pause();
    assert_frozen_is_a_timeout(&f).await;
    f.redis.as_ref().unwrap().resume();

    let redis = RedisServer::start();
    redis.pause();
    let f = Fixture::serve(Some(redis.url()), Some(redis), LIMITS, options()).await;
    assert_frozen_is_a_timeout(&f).await;
}

/// An idle instance whose Redis restarted answers its next call from the new
/// Redis, instead of failing it on the dead connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_call_after_a_redis_restart_on_an_idle_instance_is_served() {
    let mut f = Fixture::with(Backend::Redis, LIMITS, options()).await;
    assert_eq!(f.check(check()).await["allowed"], true);
    let redis = f.redis.as_mut().unwrap();
    redis.stop();
    redis.restart();
    for (path, body) in [("/v1/check", check()), ("/v1/lease", lease()), ("/v1/return", give_back())] {
        let (status, reply) = f.post(path, &body).await;
        assert_eq!(status, 200, "{path}: {reply}");
    }
    let ready = f.client.get(format!("{}/readyz", f.base)).send().await.unwrap();
    assert_eq!(ready.status().as_u16(), 200);
}

/// Used units of the one bucket, read without taking any; polls while Redis
/// comes back (a bounded wait, not a timed assertion).
async fn used(f: &Fixture) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) =
            f.post("/v1/check", &json!({"domain": "test", "descriptors": [[["k", "v"]]], "hits": 0})).await;
        if status == 200 {
            return 1000 - body["results"][0]["remaining"].as_u64().unwrap();
        }
        assert!(Instant::now() < deadline, "never served again: {body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A Redis call that timed out (503) still runs when Redis wakes up. Retrying
/// a return or a lease with its id must then be harmless, so that the 200
/// answers always account for what was taken (a retried return was once
/// applied twice). (The return bodies also carry the old `descriptor`/`window`
/// fields, which the service ignores: the old protocol accepted the same
/// requests, and applied the return twice.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_return_or_lease_is_safe_to_retry() {
    let f = Fixture::with(Backend::Redis, LIMITS, options()).await;
    let redis = f.redis.as_ref().unwrap();
    let lease = |id: &str| json!({"domain": "test", "leases": [{"id": id, "descriptor": [["k", "v"]], "wanted": 30, "rate": 1000.0}]});
    let r = f.lease(lease("first")).await;
    assert_eq!(r["leases"][0]["granted"], 30);
    let window = r["leases"][0]["window"].clone();
    let give_back = json!({"domain": "test", "returns": [
        {"id": "first", "tokens": 10, "descriptor": [["k", "v"]], "window": window}]});

    redis.pause();
    let (status, body) = f.post("/v1/return", &give_back).await;
    assert_eq!(status, 503, "{body}");
    let (status, body) =
        f.post("/v1/check", &json!({"domain": "test", "descriptors": [[["k", "v"]]], "hits": 5})).await;
    assert_eq!(status, 503, "{body}");
    let (status, body) = f.post("/v1/lease", &lease("second")).await;
    assert_eq!(status, 503, "{body}");
    redis.resume();
    let before_retries = used(&f).await;
    eprintln!("used after the 503s, before any retry: {before_retries}");

    // The caller retries the return and the lease, not the check.
    let returned = f.give_back(give_back.clone()).await["returned"][0].as_u64().unwrap();
    let second = f.lease(lease("second")).await;
    let granted = second["leases"][0]["granted"].as_u64().unwrap();
    let after = used(&f).await;
    // What the 200 answers say was taken: 30 leased, 10 given back (by the
    // timed-out call or by its retry, never both), the second lease's grant;
    // the 503'd check may or may not have taken its 5 (never more).
    assert!(after == 20 + granted || after == 25 + granted, "used {after}, granted {granted}, returned {returned}");
    // Whichever applied it, the retry says what the return gave back (the
    // timed-out call's answer never arrived, so the caller learns it here).
    assert_eq!(returned, 10, "the retry repeats what the return gave back");
    let again = f.give_back(give_back).await;
    assert_eq!((again["returned"][0].clone(), again["replayed"][0].clone()), (json!(10), json!(true)), "once");
    assert_eq!(used(&f).await, after);
}

/// A Redis killed with SIGKILL refuses connections, and calls say so at once:
/// `unavailable`, not a `timeout` after waiting out the store timeout in
/// reconnection attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_redis_is_unavailable_at_once_not_a_timeout() {
    let mut f = Fixture::with(Backend::Redis, LIMITS, options()).await;
    assert_eq!(f.check(check()).await["allowed"], true);
    f.redis.as_mut().unwrap().stop();
    for _ in 0..3 {
        let (status, body) = f.post("/v1/check", &check()).await;
        assert_eq!(status, 503, "{body}");
    }
    let metrics = f.metrics().await;
    assert!(metrics.contains(r#"floodgate_quota_store_errors_total{kind="unavailable",store="redis"} 3"#), "{metrics}");
    assert!(metrics.contains(r#"floodgate_quota_store_errors_total{kind="timeout",store="redis"} 0"#), "{metrics}");
}

/// Calls queued behind one another on a hot key are bounded by the store
/// timeout too: 300 checks at once on one key while Redis is frozen take
/// batches of 64 in turn, and each call, its wait for its turn included,
/// is answered a timeout within a few store timeouts (not one per batch
/// ahead of it: 1.5 s and more for the last ones).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_queued_on_a_hot_key_are_bounded_by_the_store_timeout_too() {
    // 300 connections from one address: no per-peer share.
    let limits = Limits { max_connections_per_peer: 0, ..Limits::default() };
    let f = Fixture::with(Backend::Redis, LIMITS, Options { limits, ..options() }).await;
    assert_eq!(f.check(check()).await["allowed"], true);
    f.redis.as_ref().unwrap().pause();
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..300 {
        let (client, url) = (f.client.clone(), format!("{}/v1/check", f.base));
        calls.spawn(async move {
            let sent = Instant::now();
            let response = client.post(url).json(&check()).send().await.expect("request");
            let status = response.status().as_u16();
            let body: Value = response.json().await.expect("a JSON body");
            (status, body, sent.elapsed())
        });
    }
    let answers = calls.join_all().await;
    f.redis.as_ref().unwrap().resume();
    let slowest = answers.iter().map(|(_, _, took)| *took).max().unwrap();
    for (status, body, _) in &answers {
        assert_eq!(*status, 503, "{body}");
        assert_eq!(body["error"], "the store did not answer in time", "{body}");
    }
    assert!(slowest < Duration::from_millis(1_200), "a queued call waited {slowest:?} (--store-timeout 300ms)");
    wait_until_serving(&f).await;
}
