//! End-to-end, one block per algorithm beyond the token bucket: a real
//! Envoy 1.40 with two workers. Counts are asserted; where an algorithm's
//! promise is about time (a shaper delays), only lower bounds on elapsed
//! time are asserted, which a slow machine cannot break.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use floodgate_e2e::{assert_both_workers_served, hammer, Conn, Envoy, Response, Setup};

/// Sends one request from each of `clients` connections at once; returns
/// each response with the time it took, in the order the clients started.
fn burst(envoy: &Envoy, clients: usize, path: &'static str) -> Vec<(Response, Duration)> {
    let barrier = Arc::new(Barrier::new(clients));
    let port = envoy.port;
    let handles: Vec<_> = (0..clients)
        .map(|_| {
            let barrier = Arc::clone(&barrier);
            thread::spawn(move || {
                let mut conn = Conn::open(port).unwrap();
                barrier.wait();
                let started = Instant::now();
                let response = conn.get(path, &[]);
                (response, started.elapsed())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// One request per second, one at once, waits up to 5 s.
const SHAPER: &str = r#"{"rules": [{"name": "paced", "algorithm": "shaper",
    "limit": 10, "period": "10s", "max_delay": "5s"}]}"#;

#[test]
fn the_shaper_delays_requests_to_the_rate_and_denies_beyond_max_delay() {
    let envoy = Envoy::start(&Setup::new(SHAPER));
    let mut results = burst(&envoy, 10, "/");
    results.sort_by_key(|(_, took)| *took);
    let served: Vec<Duration> = results.iter().filter(|(r, _)| r.status == 200).map(|(_, t)| *t).collect();
    let denied: Vec<&Response> = results.iter().filter(|(r, _)| r.status == 429).map(|(r, _)| r).collect();
    assert_eq!(served.len(), 6, "one at once and five paced within max_delay: {results:?}");
    assert_eq!(denied.len(), 4);
    // The k-th served request went on no earlier than k seconds after the
    // burst (less the time the burst took to arrive, well under 0.5 s).
    for (k, took) in served.iter().enumerate() {
        assert!(*took + Duration::from_millis(500) >= Duration::from_secs(k as u64), "request {k} took {took:?}");
    }
    for limited in denied {
        let retry: u64 = limited.header("retry-after").unwrap().parse().unwrap();
        assert!((1..=6).contains(&retry), "retry-after {retry}");
    }
    assert_eq!(envoy.stat("wasmcustom.floodgate.delayed"), 5);
    assert_eq!(envoy.stat("wasmcustom.floodgate.rule.paced.delayed"), 5);
    assert_eq!(envoy.stat("wasmcustom.floodgate.allowed"), 6);
    assert_eq!(envoy.stat("wasmcustom.floodgate.limited"), 4);
    let requested = envoy.stat("wasmcustom.floodgate.delay_requested_ms");
    let actual = envoy.stat("wasmcustom.floodgate.delay_actual_ms");
    assert!((14_000..=15_000).contains(&requested), "1 + 2 + 3 + 4 + 5 s requested, got {requested} ms");
    assert!(actual >= requested, "waited {actual} ms for {requested} ms asked");
}

#[test]
fn a_client_that_leaves_while_delayed_frees_its_place() {
    let envoy = Envoy::start(&Setup::new(SHAPER));
    assert_eq!(envoy.connect().get("/", &[]).status, 200, "the first goes at once");
    // Five more wait 1..5 s; their clients give up at once.
    let port = envoy.port;
    for _ in 0..5 {
        let mut conn = Conn::open(port).unwrap();
        let _ = conn.send_only("GET", "/", &[]);
        drop(conn);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while envoy.stat("wasmcustom.floodgate.delay_abandoned") < 5 {
        assert!(Instant::now() < deadline, "abandoned waits were not counted");
        thread::sleep(Duration::from_millis(20));
    }
    // Their places are free again: the next request waits about a second,
    // where it would have been denied (6 s > max_delay) had they been kept.
    let started = Instant::now();
    let response = envoy.connect().get("/", &[]);
    assert_eq!(response.status, 200, "{response:?}");
    assert!(started.elapsed() >= Duration::from_millis(500));
    assert_eq!(envoy.stat("wasmcustom.floodgate.delayed"), 1);
}

/// A per-API-key rule of 20 per hour with `algorithm` (its fields as JSON).
fn per_key(algorithm: &str) -> String {
    format!(
        r#"{{"rules": [{{"name": "per-key", "match": {{"path_prefix": "/api"}},
            "descriptors": [{{"request_headers": {{"header_name": "x-api-key", "descriptor_key": "api_key"}}}}],
            "limit": 20, "period": "1h", {algorithm}}}], "max_keys": 1024}}"#
    )
}

/// 24 clients x 40 requests over 10 keys on both workers: 96 requests per
/// key, of which exactly the limit (20) pass, whatever the interleaving.
fn assert_exact_per_key(envoy: &Envoy) {
    let ok = hammer(envoy, 24, 40, |client, i| format!("key-{}", (client + i) % 10));
    assert_eq!(ok.len(), 10, "{ok:?}");
    for (key, n) in &ok {
        assert_eq!(*n, 20, "key {key} got {n} through");
    }
    assert_both_workers_served(envoy);
    assert_eq!(envoy.stat("wasmcustom.floodgate.rule.per-key.allowed"), 200);
    assert_eq!(envoy.stat("wasmcustom.floodgate.rule.per-key.limited"), 960 - 200);
}

#[test]
fn the_weighted_sliding_window_is_exact_per_key_across_both_workers() {
    // Even across an hour boundary: the previous hour's 20 still weigh 20
    // (rounded up) for the first three minutes of the next.
    let envoy = Envoy::start(&Setup::new(&per_key(r#""algorithm": "sliding_window""#)));
    assert_exact_per_key(&envoy);
}

#[test]
fn the_sub_window_sliding_window_is_exact_per_key_across_both_workers() {
    let envoy = Envoy::start(&Setup::new(&per_key(r#""algorithm": "sliding_window", "sub_windows": 60"#)));
    assert_exact_per_key(&envoy);
}

#[test]
fn the_sliding_log_is_exact_per_key_and_retry_after_is_when_the_oldest_entry_leaves() {
    let envoy = Envoy::start(&Setup::new(&per_key(r#""algorithm": "sliding_log""#)));
    assert_exact_per_key(&envoy);
    let denied = envoy.connect().get("/api/items", &[("x-api-key", b"key-0")]);
    assert_eq!(denied.status, 429);
    // The oldest of key-0's 20 entries leaves an hour after it was logged, a
    // few seconds ago at most (rounded up to whole seconds).
    let retry: u64 = denied.header("retry-after").unwrap().parse().unwrap();
    assert!((3_500..=3_600).contains(&retry), "retry-after {retry}");
}
