//! One behaviour suite, run against every store (as limitador's
//! `test_with_all_storage_impls`): the memory store, a real redis-server and
//! a real three-master Redis Cluster.
//! A manual clock drives both (the Redis scripts then take the service's
//! time as an argument), so retry-after and reset values are asserted exactly.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;

use common::{Backend, Fixture, T0};
use floodgate_core::algorithm::{Decision, Grant, Params, Policy, Registration, Release};
use floodgate_core::rng::Rng;
use floodgate_core::time::{Clock, Nanos, SECOND};
use floodgate_quota::config::offered_algorithms;
use serde_json::{json, Value};

const LIMITS: &str = r#"
domain: test
descriptors:
  - key: fw
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: tb
    rate_limit: {unit: second, requests_per_unit: 1, algorithm: token_bucket, burst: 3}
  - key: big
    rate_limit: {unit: hour, requests_per_unit: 1000}
  - key: bucket
    rate_limit: {unit: minute, requests_per_unit: 600, algorithm: token_bucket}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: free
    rate_limit: {unlimited: true}
  - key: lb
    rate_limit: {unit: second, requests_per_unit: 2, algorithm: leaky_bucket, burst: 3}
  - key: sw
    rate_limit: {unit: minute, requests_per_unit: 4, algorithm: sliding_window}
  - key: sws
    rate_limit: {unit: minute, requests_per_unit: 4, algorithm: sliding_window, sub_windows: 6}
  - key: sl
    rate_limit: {unit: minute, requests_per_unit: 3, algorithm: sliding_log}
  - key: wu
    rate_limit: {unit: second, requests_per_unit: 4, algorithm: warm_up, burst: 4, warmup: 10s, cold_factor: 2}
  - key: tb10
    rate_limit: {unit: minute, requests_per_unit: 60, algorithm: token_bucket, burst: 10}
  - key: lb10
    rate_limit: {unit: minute, requests_per_unit: 60, algorithm: leaky_bucket, burst: 10}
  - key: wu10
    rate_limit: {unit: minute, requests_per_unit: 60, algorithm: warm_up, burst: 10, warmup: 2s}
  - key: sec
    rate_limit: {unit: second, requests_per_unit: 100}
  - key: sws1
    rate_limit: {unit: second, requests_per_unit: 10, algorithm: sliding_window}
"#;

/// A key of `LIMITS` for every algorithm the limits file offers (the
/// registry's: [`assert_every_offered_algorithm_has_a_case`]), with what
/// `LIMITS` configures for it, written out again so the core's oracle reads
/// the numbers independently of the service's parser: the descriptor key,
/// the core's name, `requests_per_unit`, the period (ms) and the
/// algorithm's own fields.
const CASES: [(&str, &str, u64, u64, &str); 7] = [
    ("fw", "fixed_window", 3, 60_000, "{}"),
    ("tb", "token_bucket", 1, 1_000, r#"{"burst": 3}"#),
    ("lb", "leaky_bucket", 2, 1_000, r#"{"burst": 3}"#),
    ("sw", "sliding_window", 4, 60_000, "{}"),
    ("sws", "sliding_window", 4, 60_000, r#"{"sub_windows": 6}"#),
    ("sl", "sliding_log", 3, 60_000, "{}"),
    ("wu", "warm_up", 4, 1_000, r#"{"burst": 4, "warmup": "10s", "cold_factor": 2}"#),
];

/// Every algorithm the service offers (the core's registry) has a case, so
/// a new algorithm cannot be left out of the tests that go through them all.
fn assert_every_offered_algorithm_has_a_case() {
    for registration in offered_algorithms() {
        assert!(CASES.iter().any(|case| case.1 == registration.name), "{}: no case in CASES", registration.name);
    }
}

/// The filter's own algorithm for the same rule: the oracle.
fn core_policy(name: &str, limit: u64, period_ms: u64, fields: &str) -> Arc<dyn Policy> {
    let mut fields: serde_json::Map<String, Value> = serde_json::from_str(fields).unwrap();
    fields.insert("period".into(), format!("{period_ms}ms").into());
    Registration::find(name).unwrap().build(Params::new("rule", limit, fields)).unwrap()
}

/// One bucket decided by the core beside the service, on the service's clock.
struct Oracle {
    policy: Arc<dyn Policy>,
    slot: Vec<u8>,
}

impl Oracle {
    fn new(name: &str, limit: u64, period_ms: u64, fields: &str, now: Nanos) -> Self {
        let policy = core_policy(name, limit, period_ms, fields);
        let mut slot = vec![0; policy.state_len()];
        policy.write_fresh(&mut slot, now);
        Oracle { policy, slot }
    }

    fn decide(&mut self, now: Nanos, cost: u64) -> Decision {
        self.policy.decide(&mut self.slot, now, cost)
    }

    /// What a zero-cost check reports, without changing the bucket.
    fn peek(&self, now: Nanos) -> Decision {
        let mut copy = self.slot.clone();
        self.policy.decide(&mut copy, now, 0)
    }
}

/// Nanoseconds as the service answers them: whole milliseconds, rounded up.
fn ms_up(ns: Nanos) -> Value {
    if ns.get() == u64::MAX {
        Value::Null
    } else {
        json!(ns.get().div_ceil(1_000_000))
    }
}

const MS: Nanos = Nanos::from_millis(1);

fn check(descriptors: Value, hits: u64) -> Value {
    json!({"domain": "test", "descriptors": descriptors, "hits": hits})
}

/// A lease with an id of its own.
fn lease(key: &str, value: &str, wanted: u64, rate: f64) -> Value {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let id = format!("lease-{}", NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    lease_as(&id, key, value, wanted, rate)
}

fn lease_as(id: &str, key: &str, value: &str, wanted: u64, rate: f64) -> Value {
    json!({"domain": "test", "leases": [{"id": id, "descriptor": [[key, value]], "wanted": wanted, "rate": rate}]})
}

/// A lease with an id of its own, for the window numbered `window`.
fn lease_for(window: u64, key: &str, value: &str, wanted: u64, rate: f64) -> Value {
    let mut body = lease(key, value, wanted, rate);
    body["leases"][0]["window"] = json!(window);
    body
}

/// The per-second window holding `at`, as leases name it.
fn second_of(at: Nanos) -> u64 {
    at.get() / SECOND.get()
}

fn give_back(id: &str, tokens: u64) -> Value {
    json!({"domain": "test", "returns": [{"id": id, "tokens": tokens}]})
}

async fn fixed_window_admits_the_limit_then_denies_until_the_window_ends(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    f.clock.set(T0 + SECOND.times(20));
    for remaining in [2, 1, 0] {
        let r = f.check(check(json!([[["fw", "a"]]]), 1)).await;
        assert_eq!(r["allowed"], true, "{r}");
        assert_eq!(
            r["results"][0],
            json!({"code": "ok", "limit": 3, "window_ms": 60000, "remaining": remaining, "reset_ms": 40000})
        );
    }
    let r = f.check(check(json!([[["fw", "a"]]]), 1)).await;
    assert_eq!(r["allowed"], false);
    assert_eq!(r["retry_after_ms"], 40000);
    assert_eq!(r["results"][0]["code"], "over_limit");
    assert_eq!(r["results"][0]["retry_after_ms"], 40000);
    assert_eq!(r["results"][0]["remaining"], 0);

    f.clock.advance(SECOND.times(40) - MS);
    let r = f.check(check(json!([[["fw", "a"]]]), 1)).await;
    assert_eq!(r["allowed"], false);
    assert_eq!(r["retry_after_ms"], 1);

    f.clock.advance(MS);
    let r = f.check(check(json!([[["fw", "a"]]]), 1)).await;
    assert_eq!(r["allowed"], true);
    assert_eq!(r["results"][0]["remaining"], 2);
    assert_eq!(r["results"][0]["reset_ms"], 60000);

    // Another value of the same key-only rule is another counter.
    let r = f.check(check(json!([[["fw", "b"]]]), 3)).await;
    assert_eq!(r["allowed"], true);
    assert_eq!(r["results"][0]["remaining"], 0);
}

async fn token_bucket_refills_at_its_rate_with_exact_retry_after(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    let r = f.check(check(json!([[["tb", "a"]]]), 1)).await;
    assert_eq!(r["results"][0], json!({"code": "ok", "limit": 1, "window_ms": 1000, "remaining": 2, "reset_ms": 1000}));
    f.check(check(json!([[["tb", "a"]]]), 2)).await;
    let r = f.check(check(json!([[["tb", "a"]]]), 1)).await;
    assert_eq!(r["allowed"], false);
    assert_eq!(r["retry_after_ms"], 1000);
    let r = f.check(check(json!([[["tb", "a"]]]), 2)).await;
    assert_eq!(r["retry_after_ms"], 2000);

    f.clock.advance(MS.times(999));
    let r = f.check(check(json!([[["tb", "a"]]]), 1)).await;
    assert_eq!(r["allowed"], false);
    assert_eq!(r["retry_after_ms"], 1);
    assert_eq!(r["results"][0]["reset_ms"], 1);

    f.clock.advance(MS);
    let r = f.check(check(json!([[["tb", "a"]]]), 1)).await;
    assert_eq!(r["allowed"], true);
    assert_eq!(r["results"][0]["remaining"], 0);
    assert_eq!(r["results"][0]["reset_ms"], 1000);

    // Long idle: full again, never beyond the burst.
    f.clock.advance(SECOND.times(3_600));
    let r = f.check(check(json!([[["tb", "a"]]]), 0)).await;
    assert_eq!(r["results"][0]["remaining"], 3);
    assert_eq!(r["results"][0]["reset_ms"], 0);
}

async fn a_cost_above_the_capacity_never_succeeds(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    for key in ["tb", "fw"] {
        let r = f.check(check(json!([[[key, "a"]]]), 4)).await;
        assert_eq!(r["allowed"], false, "{key}");
        assert_eq!(r["retry_after_ms"], Value::Null, "{key}: {r}");
        assert_eq!(r["results"][0]["retry_after_ms"], Value::Null, "{key}");
        assert!(r.as_object().unwrap().contains_key("retry_after_ms"), "never is an explicit null");
    }
}

async fn check_is_all_or_nothing(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    f.check(check(json!([[["fw", "x"]]]), 3)).await;
    let r = f.check(check(json!([[["tb", "y"]], [["fw", "x"]]]), 1)).await;
    assert_eq!(r["allowed"], false);
    // The bucket that would have admitted reports its untouched state.
    assert_eq!(r["results"][0], json!({"code": "ok", "limit": 1, "window_ms": 1000, "remaining": 3, "reset_ms": 0}));
    assert_eq!(r["results"][1]["code"], "over_limit");
    assert_eq!(r["retry_after_ms"], 60000);
    let r = f.check(check(json!([[["tb", "y"]]]), 1)).await;
    assert_eq!(r["results"][0]["remaining"], 2, "the denied request took nothing from tb");
}

async fn a_descriptor_listed_twice_costs_twice(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    let r = f.check(check(json!([[["fw", "d"]], [["fw", "d"]]]), 1)).await;
    assert_eq!(r["allowed"], true);
    assert_eq!(r["results"][0]["remaining"], 1);
    assert_eq!(r["results"][1]["remaining"], 1);
    let r = f.check(check(json!([[["fw", "d"]], [["fw", "d"]]]), 1)).await;
    assert_eq!(r["allowed"], false, "two units needed, one left: {r}");
    let r = f.check(check(json!([[["fw", "d"]]]), 1)).await;
    assert_eq!(r["allowed"], true);
    assert_eq!(r["results"][0]["remaining"], 0);
}

async fn shadow_mode_reports_but_does_not_deny(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    let r = f.check(check(json!([[["shadow", "s"]]]), 1)).await;
    assert_eq!(r["results"][0]["shadow_over_limit"], Value::Null);
    let r = f.check(check(json!([[["shadow", "s"]]]), 1)).await;
    assert_eq!(r["allowed"], true);
    assert_eq!(r["results"][0]["code"], "ok");
    assert_eq!(r["results"][0]["shadow_over_limit"], true);
    assert!(f
        .metrics()
        .await
        .contains(r#"floodgate_quota_decisions_total{domain="test",kind="check",result="shadow_denied"} 1"#));
    // A lease says the rule is in shadow mode, so running out must not deny.
    let r = f.lease(lease("shadow", "s", 5, 1.0)).await;
    assert_eq!(r["leases"][0]["shadow"], true, "{r}");
    assert_eq!(r["leases"][0]["granted"], 0, "the shadow bucket is spent: {r}");
    let r = f.lease(lease("fw", "s", 1, 1.0)).await;
    assert_eq!(r["leases"][0].get("shadow"), None);
    // A real limit still denies alongside it.
    f.check(check(json!([[["fw", "z"]]]), 3)).await;
    let r = f.check(check(json!([[["shadow", "s"]], [["fw", "z"]]]), 1)).await;
    assert_eq!(r["allowed"], false);
}

async fn unlimited_and_unmatched_descriptors_are_allowed(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    let r = f.check(check(json!([[["free", "x"]], [["nothing", "y"]], [["fw", "a"], ["deeper", "b"]]]), 1000)).await;
    assert_eq!(
        r,
        json!({"allowed": true, "results": [{"code": "unlimited"}, {"code": "no_rule"}, {"code": "no_rule"}]})
    );
    let r = f.lease(lease("free", "x", 500, 10.0)).await;
    assert_eq!(r["leases"][0], json!({"code": "unlimited", "granted": 500, "valid_ms": 1000}));
}

async fn leases_follow_the_rate_and_shrink_as_quota_runs_low(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    let window = T0.get() / SECOND.times(3_600).get();
    // 50 tokens/s over a 1 s lease: 50.
    let r = f.lease(lease("big", "a", 100, 50.0)).await;
    assert_eq!(
        r["leases"][0],
        json!({"code": "ok", "granted": 50, "valid_ms": 1000, "limit": 1000, "window_ms": 3600000, "remaining": 950, "reset_ms": 3600000, "window": window})
    );
    // A much faster caller gets more, but never more than half of what remains.
    let mut grants = Vec::new();
    let mut remaining = 950;
    loop {
        let r = f.lease(lease("big", "a", 1_000, 100_000.0)).await;
        let granted = r["leases"][0]["granted"].as_u64().unwrap();
        assert!(granted <= (remaining as u64).div_ceil(2), "{granted} of {remaining}");
        remaining = r["leases"][0]["remaining"].as_i64().unwrap();
        if granted == 0 {
            break;
        }
        grants.push(granted);
    }
    assert_eq!(grants[..3], [475, 238, 119], "halving while plenty is left");
    assert!(grants.windows(2).all(|w| w[1] <= w[0]), "grants never grow as quota runs low: {grants:?}");
    // Below 10 % with an hour to go, the rest is paced over the hour: one
    // token now, then nothing more at this instant however often one asks.
    assert!(remaining > 0 && remaining * 10 < 1000, "stopped below the low-water mark: {remaining} left");
    assert_eq!(grants.last(), Some(&1), "{grants:?}");
    for _ in 0..20 {
        assert_eq!(f.lease(lease("big", "a", 10, 10.0)).await["leases"][0]["granted"], 0);
    }
    // Checks are not paced: they take what is left, never more.
    let r = f.check(check(json!([[["big", "a"]]]), remaining as u64)).await;
    assert_eq!(r["allowed"], true);
    let r = f.check(check(json!([[["big", "a"]]]), 1)).await;
    assert_eq!(r["allowed"], false, "everything was taken, nothing more");
}

/// Below the low-water mark, a fast caller cannot take the rest of the window
/// in a burst (a caller once took the last tenth of a minute's limit in 10 ms
/// with 41 s left); over the tail of the window the grants follow time (at
/// most one lease lifetime ahead of the even pace), whatever rate the caller
/// reports.
async fn the_tail_of_a_window_is_paced_per_time_not_per_call(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    // 1000 per hour (`big`), 95 left with 41 s of the window to go.
    let start = T0 + SECOND.times(3_559);
    f.clock.set(start);
    assert_eq!(f.check(check(json!([[["big", "p"]]]), 905)).await["allowed"], true);
    let mut taken = 0u64;
    let mut burst = 0u64;
    for step in 0..41 * 4 {
        for _ in 0..10 {
            let r = f.lease(lease("big", "p", 1_000, 5.0)).await;
            taken += r["leases"][0]["granted"].as_u64().unwrap();
        }
        if step == 0 {
            burst = taken;
        }
        // Never ahead of the even pace (95 over 41 s) by more than a lease
        // lifetime (1 s), plus the one token a caught-up schedule allows.
        let elapsed = MS.times(step * 250);
        let pace = ((elapsed + SECOND).get() * 95).div_ceil(SECOND.times(41).get()) + 1;
        assert!(taken <= pace, "{taken} taken {elapsed} into the tail; the pace allows {pace}");
        f.clock.advance(MS.times(250));
    }
    assert!(burst <= 3, "the first burst of 10 leases took {burst} of the last 95");
    assert!(taken >= 90, "the tail was handed out over the window: {taken} of 95");
}

async fn a_lease_never_outlives_its_window(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    f.clock.set(T0 + SECOND.times(3_599) + MS.times(600));
    let r = f.lease(lease("big", "b", 10, 10.0)).await;
    assert_eq!(r["leases"][0]["valid_ms"], 400);
    // Sized to the 400 ms it can be spent in at 10/s, not to a whole lease lifetime.
    assert_eq!(r["leases"][0]["granted"], 4);

    // A sliding window's tokens count in its current window (or
    // sub-window): spent after it ends, its bound would not cover them.
    let at = T0 + SECOND.times(59) + MS.times(700);
    f.clock.set(at);
    for (key, span) in [("sw", SECOND.times(60)), ("sws", SECOND.times(10))] {
        let r = f.lease(lease(key, "b", 1, 1.0)).await;
        assert_eq!(r["leases"][0]["valid_ms"], 300, "{key}: {r}");
        assert_eq!(r["leases"][0]["window"], at.get() / span.get(), "{key}: {r}");
    }
    let r = f.lease(lease("tb", "b", 1, 1.0)).await;
    assert_eq!((r["leases"][0]["valid_ms"].clone(), r["leases"][0]["window"].clone()), (json!(1_000), json!(0)));
}

async fn returned_tokens_are_available_again(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    let r = f.lease(lease_as("r1", "big", "r", 1_000, 100_000.0)).await;
    assert_eq!(r["leases"][0]["granted"], 500);
    let returned = f
        .give_back(
            json!({"domain": "test", "returns": [{"id": "r1", "tokens": 100}, {"id": "unknown", "tokens": 100}]}),
        )
        .await;
    assert_eq!(returned, json!({"returned": [100, 0]}), "an unknown lease gives back nothing");
    let r = f.check(check(json!([[["big", "r"]]]), 0)).await;
    assert_eq!(r["results"][0]["remaining"], 600);
    // A lease gives back once: a retried return is harmless (a replay,
    // repeating what the first gave back, so a caller whose first attempt
    // timed out learns what went back).
    let returned = f.give_back(give_back("r1", 100)).await;
    assert_eq!(returned, json!({"returned": [100], "replayed": [true]}), "a second return of a lease is a replay");
    let r = f.check(check(json!([[["big", "r"]]]), 0)).await;
    assert_eq!(r["results"][0]["remaining"], 600, "and gives back nothing more");
    // Never more than the lease granted.
    f.lease(lease_as("r3", "big", "r", 1_000, 100_000.0)).await;
    let returned = f.give_back(give_back("r3", 10_000)).await;
    assert_eq!(returned["returned"][0], 300);

    // After the window, returns are void: the new window never saw those tokens.
    f.clock.set(T0 + SECOND.times(59));
    let r = f.lease(lease_as("r2", "fw", "r", 3, 100.0)).await;
    assert_eq!(r["leases"][0]["granted"], 2);
    f.clock.advance(SECOND.times(2));
    f.check(check(json!([[["fw", "r"]]]), 2)).await;
    let returned = f.give_back(give_back("r2", 2)).await;
    assert_eq!(returned["returned"][0], 0);
    let r = f.check(check(json!([[["fw", "r"]]]), 0)).await;
    assert_eq!(r["results"][0]["remaining"], 1);

    // A token bucket takes back only what it has not earned again since.
    // (At 100,000 a second the caller is the key's leader: it gets all the
    // bucket holds, not the paced half.)
    let r = f.lease(lease_as("b1", "bucket", "r", 1_000, 100_000.0)).await;
    assert_eq!(r["leases"][0]["granted"], 600);
    assert_eq!(r["leases"][0]["window"], 0);
    f.clock.advance(SECOND.times(20)); // earns 200: 200 of 600
    let returned = f.give_back(give_back("b1", 1_000)).await;
    assert_eq!(returned["returned"][0], 400, "200 of the lease's 600 were earned again meanwhile");
    let r = f.check(check(json!([[["bucket", "r"]]]), 0)).await;
    assert_eq!(r["results"][0]["remaining"], 600);
}

/// Lease 5, wait until the bucket has earned its burst again, spend the burst
/// with checks, return the lease: the return must not let more through at once
/// than the burst (it let 15 of a burst of 10 through, and a warm-up bucket
/// took back 7 for a lease of 5).
async fn a_return_never_lets_more_through_than_the_burst(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    for key in ["tb10", "lb10", "wu10"] {
        let id = format!("burst-{key}");
        // (A cold warm-up bucket grants 2: half of what it admits at once.)
        let r = f.lease(lease_as(&id, key, "x", 5, 1_000.0)).await;
        let granted = r["leases"][0]["granted"].as_u64().unwrap();
        assert!(granted >= 2, "{key}: {r}");
        f.clock.advance(MS.times(5_500));
        let mut admitted = 0;
        while f.check(check(json!([[[key, "x"]]]), 1)).await["allowed"] == true {
            admitted += 1;
        }
        let returned = f.give_back(give_back(&id, granted)).await["returned"][0].as_u64().unwrap();
        assert!(returned <= granted, "{key}: {returned} taken back for a lease of {granted}");
        while f.check(check(json!([[[key, "x"]]]), 1)).await["allowed"] == true {
            admitted += 1;
        }
        assert!(admitted <= 10, "{key}: {admitted} admitted at once against a burst of 10");
    }
}

/// A lease that returns the part it did not use gets all of that part back
/// while the tokens its bucket earned since the grant do not exceed the
/// part it used: 1 s after the grant a bucket of 1 per second earned 1, the
/// lease used 1, so its other tokens all go back (counting the 1 earned
/// against the part returned would lose one).
async fn a_partial_return_gives_back_the_unused_part(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    let r = f.lease(lease_as("part", "tb10", "p", 8, 1_000.0)).await;
    let granted = r["leases"][0]["granted"].as_u64().unwrap();
    assert!(granted >= 2, "{r}");
    while f.check(check(json!([[["tb10", "p"]]]), 1)).await["allowed"] == true {}
    f.clock.advance(SECOND);
    let returned = f.give_back(give_back("part", granted - 1)).await["returned"][0].as_u64().unwrap();
    assert_eq!(returned, granted - 1);
    let mut admitted = 0;
    while f.check(check(json!([[["tb10", "p"]]]), 1)).await["allowed"] == true {
        admitted += 1;
    }
    assert_eq!(admitted, granted, "the token earned and the {returned} returned");
}

/// Tokens that were never leased cannot be "given back" (else a return after
/// the window was used up admitted as much again). (The body also carries the
/// old `descriptor` and `window` fields, which the service ignores, so the
/// same request is a valid return for the old protocol, which accepted it.)
async fn a_return_gives_back_only_what_a_lease_granted(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    let r = f.check(check(json!([[["big", "u"]]]), 1_000)).await;
    assert_eq!(r["allowed"], true);
    let window = T0.get() / SECOND.times(3_600).get();
    let returned = f
        .give_back(json!({"domain": "test", "returns": [
            {"id": "never-leased", "descriptor": [["big", "u"]], "tokens": 1_000, "window": window}]}))
        .await;
    assert_eq!(returned["returned"][0], 0, "{returned}");
    let r = f.check(check(json!([[["big", "u"]]]), 1)).await;
    assert_eq!(r["allowed"], false, "the window's 1000 were all used: {r}");
}

/// Units a caller admitted without a lease (a rule's overshoot budget) and
/// reported with a lease count in the bucket, past the limit if need be, also
/// when the lease gets nothing; the answer says when the key is near its
/// limit.
async fn reported_units_count_also_when_nothing_is_granted(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    f.clock.set(T0 + SECOND.times(20));
    let reporting = |value: &str, reported: u64| {
        let mut body = lease("fw", value, 1, 1.0);
        body["leases"][0]["reported"] = json!(reported);
        body
    };
    let first = f.lease(reporting("r", 2)).await;
    assert_eq!(first["leases"][0]["granted"], 1, "the last one: {first}");
    assert_eq!(first["leases"][0]["near_limit"], true);
    let over = f.lease(reporting("r", 4)).await;
    assert_eq!(over["leases"][0]["granted"], 0, "{over}");
    let r = f.check(check(json!([[["fw", "r"]]]), 0)).await;
    assert_eq!(r["results"][0]["remaining"], 0, "{r}");
    f.clock.advance(SECOND.times(40));
    let fresh = f.lease(reporting("s", 3)).await;
    assert_eq!(fresh["leases"][0]["granted"], 0, "{fresh}");
    let r = f.check(check(json!([[["fw", "s"]]]), 1)).await;
    assert_eq!(r["allowed"], false, "counted though nothing was granted: {r}");
    let far = f.lease(lease("big", "r", 1, 1.0)).await;
    assert_eq!(far["leases"][0].get("near_limit"), None, "absent while far below: {far}");
}

/// A key found near its limit while deciding a lease that reported units
/// is posted: every lease call that asks for notices gets it back (any key
/// it leases), until the window after that one has ended; one that does not
/// ask gets none.
async fn a_key_found_near_its_limit_is_noticed_to_callers_that_ask(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    f.clock.set(T0 + SECOND.times(20));
    let mut body = lease("sec", "hot", 1, 1.0);
    body["leases"][0]["reported"] = json!(90);
    assert_eq!(f.lease(body).await["leases"][0]["near_limit"], true);
    let mut asking = lease("big", "other", 1, 1.0);
    asking["notices"] = json!(true);
    let answer = f.lease(asking.clone()).await;
    assert_eq!(answer["near"][0]["descriptor"], json!([["sec", "hot"]]), "{answer}");
    assert!(answer["near"][0]["for_ms"].as_u64().unwrap() > 1000, "through the next window: {answer}");
    assert_eq!(f.lease(lease("big", "other", 1, 1.0)).await.get("near"), None, "not asked");
}

/// A lease retried with its id (after a timeout, say) is answered from its
/// record: the same grant, `replayed`, and nothing more taken.
async fn a_lease_retried_with_its_id_is_not_granted_twice(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    let first = f.lease(lease_as("same", "big", "i", 100, 50.0)).await;
    assert_eq!(first["leases"][0]["granted"], 50);
    assert_eq!(first["leases"][0].get("replayed"), None);
    f.clock.advance(MS.times(300));
    let again = f.lease(lease_as("same", "big", "i", 100, 50.0)).await;
    let mut expected = first["leases"][0].clone();
    expected["replayed"] = json!(true);
    expected["valid_ms"] = json!(700);
    expected["reset_ms"] = json!(3_599_700);
    assert_eq!(again["leases"][0], expected, "the same grant, with the time left");
    let r = f.check(check(json!([[["big", "i"]]]), 0)).await;
    assert_eq!(r["results"][0]["remaining"], 950, "taken once");
    // Another id is another lease.
    let other = f.lease(lease_as("other", "big", "i", 100, 50.0)).await;
    assert_eq!(other["leases"][0]["remaining"], 900);
    assert!(f.metrics().await.contains(r#"floodgate_quota_tokens_granted_total{domain="test"} 100"#));
}

/// A lease id replays only the lease it names. Leased on one descriptor, the
/// id is refused on another (it was granted 100 there, replayed, on a rule
/// whose limit is 60), also after the lease was returned; the same lease
/// retried after its return holds nothing.
async fn a_lease_id_replays_only_its_own_lease(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    let first = f.lease(lease_as("x", "big", "a", 100, 100.0)).await;
    assert_eq!(first["leases"][0]["granted"], 100);
    for _ in 0..2 {
        let (status, body) = f.post("/v1/lease", &lease_as("x", "fw", "b", 100, 100.0)).await;
        assert_eq!(status, 422, "{body}");
        let error = body["error"].as_str().unwrap();
        assert!(error.contains(r#"leases[0].id "x""#) && error.contains("another descriptor"), "{error}");
        // The lease named is another caller's: the error names its id only,
        // never its bucket (descriptor values: an address, a user).
        assert!(!error.contains(r#""big""#) && !error.contains("fg:{"), "names only the id: {error}");
        assert_eq!(f.check(check(json!([[["fw", "b"]]]), 0)).await["results"][0]["remaining"], 3, "nothing taken");
        f.give_back(give_back("x", 100)).await;
    }
    let again = f.lease(lease_as("x", "big", "a", 100, 100.0)).await;
    assert_eq!(again["leases"][0]["replayed"], true, "{again}");
    assert_eq!(again["leases"][0]["granted"], 0, "returned: it holds nothing now: {again}");
    assert_eq!(again["leases"][0]["valid_ms"], 0, "{again}");
}

/// A retried return says that the lease was returned already, so a caller
/// whose first attempt got a 503 learns it went through.
async fn a_retried_return_says_it_was_returned_already(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    f.lease(lease_as("once", "big", "a", 10, 10.0)).await;
    let first = f.give_back(give_back("once", 10)).await;
    assert_eq!(first, json!({"returned": [10]}), "a first return is not a replay");
    let retried = f
        .give_back(json!({"domain": "test", "returns": [{"id": "once", "tokens": 10}, {"id": "never", "tokens": 1}]}))
        .await;
    // A replay repeats what the first return gave back (a first attempt that
    // timed out but was applied told nobody).
    assert_eq!(retried, json!({"returned": [10, 0], "replayed": [true, false]}));
}

/// After a reload lowers a token bucket's burst, a return says what the bucket
/// has again under the limit now in force (the new burst), not what the
/// lease's old limit would have held (48 reported where 10 went back, before),
/// and the metric counts the same.
async fn a_return_after_a_lower_burst_says_what_really_went_back(backend: Backend) {
    let yaml = |burst: u64| {
        format!(
            "domain: test\ndescriptors:\n  - key: b\n    rate_limit: {{unit: hour, requests_per_unit: 1, \
             algorithm: token_bucket, burst: {burst}}}\n"
        )
    };
    let f = Fixture::new(backend, &yaml(50)).await;
    let granted = f.lease(lease_as("l", "b", "x", 50, 1000.0)).await["leases"][0]["granted"].as_u64().unwrap();
    assert!(granted > 10, "{granted}");
    assert_eq!(f.check(check(json!([[["b", "x"]]]), 50 - granted)).await["allowed"], true);
    f.service.set_domains(common::domains(&yaml(10)));
    let back = f.give_back(give_back("l", granted)).await;
    assert_eq!(back, json!({"returned": [10]}), "the bucket holds at most the new burst");
    for _ in 0..10 {
        assert_eq!(f.check(check(json!([[["b", "x"]]]), 1)).await["allowed"], true);
    }
    assert_eq!(f.check(check(json!([[["b", "x"]]]), 1)).await["allowed"], false, "10 went back, no more");
    assert!(f.metrics().await.contains(r#"floodgate_quota_tokens_returned_total{domain="test"} 10"#));
}

/// Every offered algorithm, through the service, answers exactly what the
/// filter's core computes for the same rule, arrivals and clock: admissions
/// and denials, `remaining`, `reset_ms` and `retry_after_ms` (`null` for a
/// cost above what the algorithm ever admits at once).
async fn every_algorithm_checks_exactly_as_the_core_decides(backend: Backend) {
    // (ms to advance first, hits): bursts, denials, partial and full
    // recoveries across window boundaries, costs above every capacity.
    const STEPS: [(u64, u64); 18] = [
        (0, 1),
        (0, 2),
        (0, 1),
        (0, 1),
        (250, 1),
        (0, 3),
        (1_000, 1),
        (5_000, 2),
        (0, 2),
        (0, 1),
        (9_999, 1),
        (20_000, 4),
        (0, 1),
        (30_000, 1),
        (0, 5),
        (7_000, 2),
        (61_000, 0),
        (0, 3),
    ];
    assert_every_offered_algorithm_has_a_case();
    let f = Fixture::new(backend, LIMITS).await;
    let start = T0 + MS.times(7_500); // not on any window boundary
    f.clock.set(start);
    let mut oracles: Vec<Oracle> = CASES
        .iter()
        .map(|(_, name, limit, period, fields)| Oracle::new(name, *limit, *period, fields, start))
        .collect();
    let mut outcomes = vec![(0, 0); CASES.len()];
    for (step, (advance, hits)) in STEPS.into_iter().enumerate() {
        f.clock.advance(MS.times(advance));
        let now = f.clock.now();
        for (i, (key, name, limit, period, _)) in CASES.iter().enumerate() {
            let r = f.check(check(json!([[[key, "o"]]]), hits)).await;
            let want = oracles[i].decide(now, hits);
            let got = &r["results"][0];
            let at = format!("{name} ({key}) step {step}: {r}");
            assert_eq!(r["allowed"], want.allowed(), "{at}");
            assert_eq!(got["code"], if want.allowed() { "ok" } else { "over_limit" }, "{at}");
            assert_eq!(got["limit"], *limit, "{at}");
            assert_eq!(got["window_ms"], *period, "{at}");
            assert_eq!(got["remaining"], want.remaining, "{at}");
            assert_eq!(got["reset_ms"], ms_up(want.reset), "{at}");
            if want.allowed() {
                assert_eq!(got.get("retry_after_ms"), None, "{at}");
                outcomes[i].0 += 1;
            } else {
                assert_eq!(got["retry_after_ms"], ms_up(want.retry_after()), "{at}");
                assert_eq!(r["retry_after_ms"], ms_up(want.retry_after()), "{at}");
                outcomes[i].1 += 1;
            }
        }
    }
    for (i, (admitted, denied)) in outcomes.iter().enumerate() {
        assert!(
            *admitted >= 3 && *denied >= 2,
            "{}: the steps exercise both outcomes: {admitted}/{denied}",
            CASES[i].0
        );
    }
}

/// Leases and returns of every offered algorithm follow the core too: a
/// grant takes what the core takes for that cost, lasts the lease lifetime
/// (to the end of its window for an algorithm that counts in windows), and a return is the core's
/// undo of that grant: what it frees, and only that, is available again.
async fn every_algorithm_leases_and_takes_returns_as_the_core_does(backend: Backend) {
    assert_every_offered_algorithm_has_a_case();
    let f = Fixture::new(backend, LIMITS).await;
    let start = T0 + MS.times(59_400); // 600 ms before a minute ends
    f.clock.set(start);
    for (i, (key, name, limit, period, fields)) in CASES.iter().enumerate() {
        let mut oracle = Oracle::new(name, *limit, *period, fields, start);
        let id = format!("every-{i}");
        let leased_at = f.clock.now();
        // Something used first, so that the lease and the return are not
        // into a full bucket.
        f.check(check(json!([[[key, "l"]]]), 1)).await;
        oracle.decide(leased_at, 1);
        let r = f.lease(lease_as(&id, key, "l", 2, 1_000.0)).await;
        let got = &r["leases"][0];
        let granted = got["granted"].as_u64().unwrap();
        assert!(granted > 0, "{name}: {r}");
        let want = oracle.decide(leased_at, granted);
        assert!(want.allowed(), "{name}: the core admits the grant");
        assert_eq!(got["remaining"], want.remaining, "{name}: {r}");
        // Tokens of an algorithm that counts in windows are valid until the
        // window they are counted in ends (the fixed window, first, is leased
        // 600 ms before its window ends); the others' for the lease lifetime.
        let (valid, window) = match oracle.policy.counting_window(&oracle.slot, leased_at) {
            Some(counted) => ((counted.end - leased_at).floor_millis().min(1_000), counted.index),
            None => (1_000, 0),
        };
        assert_eq!(got["valid_ms"], valid, "{name}: {r}");
        // Asked at 1,000 a second, the caller leads a token or leaky bucket:
        // having taken all of it, it is told to come back when the bucket
        // is full again (within the lease's life), not at its next unit.
        let leads = matches!(*name, "token_bucket" | "leaky_bucket") && want.remaining == 0;
        let reset = if leads { json!(valid) } else { ms_up(want.reset) };
        assert_eq!(got["reset_ms"], reset, "{name}: {r}");
        assert_eq!(got["window"], window, "{name}: {r}");

        f.clock.advance(MS.times(100));
        let now = f.clock.now();
        let before = oracle.peek(now).remaining;
        // One token of the grant goes back, as the service gives back a
        // lease's unused part.
        let part = Grant { cost: 1, at: leased_at };
        oracle.policy.release(&mut oracle.slot, now, part, Release::Return { granted });
        let freed = oracle.peek(now).remaining - before;
        let returned = f.give_back(give_back(&id, 1)).await;
        assert_eq!(returned["returned"][0], freed, "{name}: {returned}");
        let r = f.check(check(json!([[[key, "l"]]]), 0)).await;
        assert_eq!(r["results"][0]["remaining"], oracle.peek(now).remaining, "{name}: {r}");
        assert_eq!(r["results"][0]["reset_ms"], ms_up(oracle.peek(now).reset), "{name}: {r}");
        let again = f.give_back(give_back(&id, 1)).await;
        assert_eq!(again, json!({"returned": [freed], "replayed": [true]}), "{name}: once, then replays");
        let r = f.check(check(json!([[[key, "l"]]]), 0)).await;
        assert_eq!(r["results"][0]["remaining"], oracle.peek(now).remaining, "{name}: once: {r}");
    }
}

/// A lease naming the next window, shortly before it starts, gets tokens
/// of that window: from its budget (not the current one's, which may be
/// used up), usable from its start (`starts_ms`) for a lease lifetime, and
/// counted there once it starts.
async fn a_lease_ahead_is_granted_from_the_next_windows_budget(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    let now = T0 + MS.times(800);
    f.clock.set(now);
    assert_eq!(f.check(check(json!([[["sec", "a"]]]), 100)).await["allowed"], true);
    let next = second_of(now) + 1;
    let r = f.lease(lease_for(next, "sec", "a", 500, 60.0)).await;
    assert_eq!(
        r["leases"][0],
        json!({"code": "ok", "granted": 50, "valid_ms": 1200, "starts_ms": 200, "limit": 100, "window_ms": 1000,
               "remaining": 50, "reset_ms": 1200, "window": next, "near_limit": true}),
        "60/s over the second it may be used, at most half of the next window's 100 (the current one is used up)"
    );
    let r = f.lease(lease_for(next, "sec", "a", 500, 60.0)).await;
    assert_eq!((r["leases"][0]["granted"].clone(), r["leases"][0]["remaining"].clone()), (json!(25), json!(25)));
    // The current window stays used up; the next one's checks see what was leased ahead.
    assert_eq!(f.check(check(json!([[["sec", "a"]]]), 1)).await["allowed"], false);
    f.clock.set(T0 + SECOND);
    let r = f.check(check(json!([[["sec", "a"]]]), 0)).await;
    assert_eq!(r["results"][0]["remaining"], 25, "{r}");
    assert_eq!(f.check(check(json!([[["sec", "a"]]]), 25)).await["allowed"], true);
    assert_eq!(f.check(check(json!([[["sec", "a"]]]), 1)).await["allowed"], false, "75 leased ahead + 25 checked");
}

/// Only the next window is leased ahead, and only when it starts within a
/// lease lifetime: naming any other window, or none, leases the current
/// window's tokens as before the field existed.
async fn a_lease_naming_another_window_gets_the_current_ones(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    let now = T0 + MS.times(800);
    f.clock.set(now);
    let current = second_of(now);
    for (named, what) in
        [(None, "none"), (Some(current), "the current"), (Some(current + 2), "two ahead"), (Some(0), "long past")]
    {
        let mut body = lease("sec", "b", 10, 10.0);
        if let Some(window) = named {
            body["leases"][0]["window"] = json!(window);
        }
        let r = f.lease(body).await;
        let got = &r["leases"][0];
        assert_eq!((got["window"].clone(), got["valid_ms"].clone()), (json!(current), json!(200)), "{what}: {r}");
        assert_eq!(got.get("starts_ms"), None, "{what}: {r}");
    }
    // A minute's next window starts 40 s from now, past a lease lifetime.
    f.clock.set(T0 + SECOND.times(20));
    let minute = (T0 + SECOND.times(20)).get() / SECOND.times(60).get();
    let r = f.lease(lease_for(minute + 1, "fw", "b", 1, 1.0)).await;
    assert_eq!(r["leases"][0]["window"], minute, "{r}");
    assert_eq!(r["leases"][0].get("starts_ms"), None, "{r}");
}

/// A lease ahead retried with its id is answered from its record (the time
/// left until its window starts, nothing taken again); returned before its
/// window starts it is taken off that window's budget, returned while its
/// window counts it goes back there, and after that window it gives back
/// nothing.
async fn leases_ahead_replay_and_return_into_their_own_window(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    let now = T0 + MS.times(700);
    f.clock.set(now);
    let next = second_of(now) + 1;
    let ahead = |id: &str| {
        let mut body = lease_as(id, "sec", "r", 40, 40.0);
        body["leases"][0]["window"] = json!(next);
        body
    };
    let first = f.lease(ahead("ahead-1")).await;
    assert_eq!(
        (first["leases"][0]["granted"].clone(), first["leases"][0]["starts_ms"].clone()),
        (json!(40), json!(300))
    );
    f.clock.advance(MS.times(100));
    let again = f.lease(ahead("ahead-1")).await;
    let got = &again["leases"][0];
    assert_eq!((got["granted"].clone(), got["replayed"].clone()), (json!(40), json!(true)), "{again}");
    assert_eq!(
        (got["starts_ms"].clone(), got["valid_ms"].clone(), got["window"].clone()),
        (json!(200), json!(1200), json!(next))
    );
    // Before its window starts: off the booking, whole, once.
    assert_eq!(f.give_back(give_back("ahead-1", 15)).await["returned"][0], 15);
    let again = f.give_back(give_back("ahead-1", 15)).await;
    assert_eq!(again, json!({"returned": [15], "replayed": [true]}), "a lease gives back once, then replays");
    // Half of the 75 the next window has left now.
    assert_eq!(f.lease(ahead("ahead-2")).await["leases"][0]["granted"], 38);
    f.clock.set(T0 + SECOND + MS.times(10));
    let r = f.check(check(json!([[["sec", "r"]]]), 0)).await;
    assert_eq!(r["results"][0]["remaining"], 100 - 25 - 38, "{r}");
    // While its window counts: back into it.
    assert_eq!(f.give_back(give_back("ahead-2", 10)).await["returned"][0], 10);
    assert_eq!(f.check(check(json!([[["sec", "r"]]]), 0)).await["results"][0]["remaining"], 47);
    // After its window: nothing (the window that counts now never saw them).
    let next = second_of(f.clock.now()) + 1;
    let mut body = lease_as("ahead-3", "sec", "r", 30, 30.0);
    body["leases"][0]["window"] = json!(next);
    f.clock.set(T0 + SECOND + MS.times(900));
    assert_eq!(f.lease(body).await["leases"][0]["granted"], 30);
    f.clock.set(T0 + SECOND.times(3));
    assert_eq!(f.give_back(give_back("ahead-3", 30)).await["returned"][0], 0);
    assert_eq!(f.check(check(json!([[["sec", "r"]]]), 0)).await["results"][0]["remaining"], 100);
}

/// A sliding window's next window still weighs the current one's counts
/// in full at its start: a lease ahead takes only what they leave there,
/// and what it takes, the rest of the current window can no longer admit.
async fn a_sliding_windows_lease_ahead_shares_the_limit_with_the_current_window(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    let now = T0 + MS.times(900);
    f.clock.set(now);
    assert_eq!(f.check(check(json!([[["sws1", "s"]]]), 6)).await["allowed"], true);
    let next = second_of(now) + 1;
    let r = f.lease(lease_for(next, "sws1", "s", 100, 100.0)).await;
    let got = &r["leases"][0];
    assert_eq!((got["window"].clone(), got["starts_ms"].clone()), (json!(next), json!(100)), "{r}");
    // The 6 still weigh in full at the next start: 4 left there, half of them granted.
    assert_eq!((got["granted"].clone(), got["remaining"].clone()), (json!(2), json!(2)), "{r}");
    let r = f.check(check(json!([[["sws1", "s"]]]), 0)).await;
    assert_eq!(r["results"][0]["remaining"], 2, "10 − 6 counted − 2 leased ahead: {r}");
    let denied = f.check(check(json!([[["sws1", "s"]]]), 3)).await;
    assert_eq!(denied["allowed"], false);
    // Not before the next window starts; then 6 + 2 count, and the 6 fade.
    let retry = denied["retry_after_ms"].as_u64().unwrap();
    assert!(retry > 100, "{denied}");
    f.clock.set(now + MS.times(retry));
    assert_eq!(f.check(check(json!([[["sws1", "s"]]]), 3)).await["allowed"], true);
}

/// One caller asking for allowances of a key under several ids holds at most a
/// quarter of its limit a window in all of them (the bound of one allowance):
/// asked three times for 24 a window of 100 a second, it gets one allowance
/// and then leases of one window (before: three allowances, 72 a window for
/// the term, whatever it spent); another caller (another address) gets its
/// own.
async fn one_caller_holds_at_most_a_quarter_of_a_keys_limit_in_allowances(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    // Late in a window: its pace tells, and leases of it are short.
    f.clock.set(T0 + MS.times(900));
    let ask = |id: &str| {
        json!({"domain": "test", "leases": [{"id": id, "descriptor": [["sec", "k"]], "wanted": 100, "rate": 15.0,
               "per_window": true}]})
    };
    let mut held = Vec::new();
    for i in 0..3 {
        let grant = f.lease(ask(&format!("mine{i}"))).await["leases"][0].clone();
        if grant.get("windows").is_some_and(|w| w.as_u64().unwrap() > 1) {
            held.push(grant["granted"].as_u64().unwrap());
        }
    }
    assert_eq!(held, [24], "one allowance of 24, then leases of one window");
    let other = Fixture::client_from("127.0.0.2");
    let (status, theirs) = f.post_from(&other, "/v1/lease", &ask("theirs")).await;
    assert_eq!(status, 200, "{theirs}");
    assert!(theirs["leases"][0]["windows"].as_u64().unwrap_or(0) > 1, "another caller's own allowance: {theirs}");
}

/// Whatever mix of checks, leases of the current window and leases ahead
/// comes, over several windows: the grants and admissions counted in each
/// window (leases ahead in the window they are for) never pass its limit.
async fn the_grants_and_checks_of_a_window_never_pass_its_limit(backend: Backend) {
    let f = Fixture::new(backend, LIMITS).await;
    let mut rng = Rng::new(0x2545_f491_4f6c_dd1d);
    let mut random = move |n: u64| rng.below(n);
    let mut counted: std::collections::BTreeMap<u64, u64> = std::collections::BTreeMap::new();
    f.clock.set(T0 + MS.times(3));
    for _ in 0..240 {
        let now = f.clock.now();
        let window = second_of(now);
        match random(3) {
            0 => {
                let hits = 1 + random(20);
                if f.check(check(json!([[["sec", "m"]]]), hits)).await["allowed"] == true {
                    *counted.entry(window).or_default() += hits;
                }
            }
            1 => {
                let r = f.lease(lease("sec", "m", 1 + random(80), random(200) as f64)).await;
                *counted.entry(window).or_default() += r["leases"][0]["granted"].as_u64().unwrap();
            }
            _ => {
                let r = f.lease(lease_for(window + 1, "sec", "m", 1 + random(80), random(200) as f64)).await;
                let got = &r["leases"][0];
                *counted.entry(got["window"].as_u64().unwrap()).or_default() += got["granted"].as_u64().unwrap();
            }
        }
        f.clock.advance(MS.times(1 + random(40)));
    }
    assert!(counted.len() >= 4, "{counted:?}");
    for (window, used) in &counted {
        assert!(*used <= 100, "window {window}: {used} granted and admitted: {counted:?}");
    }
    assert!(counted.values().filter(|used| **used >= 90).count() >= 3, "the windows were used: {counted:?}");
}

macro_rules! with_all_stores {
    ($($case:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::Backend::Memory).await;
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::Backend::Redis).await;
                }
            )*
        }
        mod redis_cluster {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::Backend::RedisCluster).await;
                }
            )*
        }
    };
}

with_all_stores!(
    fixed_window_admits_the_limit_then_denies_until_the_window_ends,
    token_bucket_refills_at_its_rate_with_exact_retry_after,
    a_cost_above_the_capacity_never_succeeds,
    check_is_all_or_nothing,
    a_descriptor_listed_twice_costs_twice,
    shadow_mode_reports_but_does_not_deny,
    unlimited_and_unmatched_descriptors_are_allowed,
    leases_follow_the_rate_and_shrink_as_quota_runs_low,
    a_lease_never_outlives_its_window,
    returned_tokens_are_available_again,
    a_return_never_lets_more_through_than_the_burst,
    a_partial_return_gives_back_the_unused_part,
    a_return_gives_back_only_what_a_lease_granted,
    a_lease_retried_with_its_id_is_not_granted_twice,
    reported_units_count_also_when_nothing_is_granted,
    a_key_found_near_its_limit_is_noticed_to_callers_that_ask,
    a_lease_id_replays_only_its_own_lease,
    a_retried_return_says_it_was_returned_already,
    a_return_after_a_lower_burst_says_what_really_went_back,
    the_tail_of_a_window_is_paced_per_time_not_per_call,
    every_algorithm_checks_exactly_as_the_core_decides,
    every_algorithm_leases_and_takes_returns_as_the_core_does,
    a_lease_ahead_is_granted_from_the_next_windows_budget,
    a_lease_naming_another_window_gets_the_current_ones,
    leases_ahead_replay_and_return_into_their_own_window,
    a_sliding_windows_lease_ahead_shares_the_limit_with_the_current_window,
    the_grants_and_checks_of_a_window_never_pass_its_limit,
    one_caller_holds_at_most_a_quarter_of_a_keys_limit_in_allowances,
);

/// With Redis's own clock (the default), decisions still come out right and
/// keys are hash-tagged by domain and expire once idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_clock_mode_decides_and_keys_expire() {
    let f = Fixture::with(Backend::Redis, LIMITS, common::Options { redis_time: true, ..Default::default() }).await;
    for _ in 0..3 {
        assert_eq!(f.check(check(json!([[["fw", "a"]]]), 1)).await["allowed"], true);
    }
    let r = f.check(check(json!([[["fw", "a"]]]), 1)).await;
    assert_eq!(r["allowed"], false);
    let retry = r["retry_after_ms"].as_u64().unwrap();
    assert!(retry > 0 && retry <= 60_000, "{retry}");
    let mut conn = f.redis.as_ref().unwrap().connection();
    let mut keys: Vec<String> = ::redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
    // Beside the bucket, each write's mark (so a resent script knows what its
    // first send wrote), in the domain's hash tag, gone within the store
    // timeout and a second.
    for mark in keys.iter().filter(|k| k.contains(":tx:")) {
        assert!(mark.starts_with("fg:{test}:tx:"), "{mark}");
        let ttl: i64 = ::redis::cmd("PTTL").arg(mark).query(&mut conn).unwrap();
        assert!(ttl > 0 && ttl <= 3_000, "marks expire: {ttl}");
    }
    keys.retain(|k| !k.contains(":tx:"));
    assert_eq!(keys, vec![r#"fg:{test}:fw:[["fw","a"]]"#.to_string()]);
    let ttl: i64 = ::redis::cmd("PTTL").arg(&keys[0]).query(&mut conn).unwrap();
    assert!(ttl > 0 && ttl <= 61_000, "idle keys expire: {ttl}");
}
