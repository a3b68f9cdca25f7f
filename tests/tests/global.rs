//! End to end, global mode: real Envoys (two workers each) with the filter,
//! and the real quota service, on loopback. Counts are asserted: what the
//! whole fleet admits against what the service's limit allows.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use floodgate_e2e::{Conn, Envoy, QuotaService, RedisServer, Setup, Update};

/// Limits of the domain `edge`:
/// - `route=api`: 30 per hour, a token bucket holding 30 (no refill within a test);
/// - `route=fleet`: a token bucket of 100 at once and 20 per second;
/// - `api_key=*`: 20 per hour per key;
/// - `route=stock`: 100,000 a day, hardly refilling within a test;
/// - `route=hot`: plenty (a hot key for single-flight counting).
const LIMITS: &str = "domain: edge
descriptors:
  - key: route
    value: api
    rate_limit: {unit: hour, requests_per_unit: 30, algorithm: token_bucket, burst: 30}
  - key: route
    value: fleet
    rate_limit: {unit: second, requests_per_unit: 20, algorithm: token_bucket, burst: 100}
  - key: route
    value: stock
    rate_limit: {unit: day, requests_per_unit: 100000, algorithm: token_bucket}
  - key: route
    value: hot
    rate_limit: {unit: second, requests_per_unit: 1000000, algorithm: token_bucket}
  - key: api_key
    rate_limit: {unit: hour, requests_per_unit: 20, algorithm: token_bucket, burst: 20}
";

/// A plugin config with one global rule keyed by `route=<route>` (or by the
/// API key when `route` is `None`).
fn plugin(route: Option<&str>, mode: &str, fallback: &str) -> String {
    let descriptor = match route {
        Some(route) => format!(r#"{{"generic_key": {{"descriptor_key": "route", "descriptor_value": "{route}"}}}}"#),
        None => r#"{"request_headers": {"header_name": "x-api-key", "descriptor_key": "api_key"}}"#.to_string(),
    };
    format!(
        r#"{{"rules": [{{"name": "fleet", "scope": "global", "mode": "{mode}", "fallback": {fallback},
            "descriptors": [{descriptor}]}}],
          "global": {{"cluster": "floodgate-quota", "domain": "edge", "timeout": "500ms", "max_wait": "300ms"}}}}"#
    )
}

fn envoy_for(service_ports: &[u16], plugin: &str) -> Envoy {
    Envoy::start(&Setup::new(plugin).with_cluster("floodgate-quota", service_ports))
}

/// What a load run saw: admitted, limited, anything else; and the run's length.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    admitted: u64,
    limited: u64,
    other: u64,
    slowest: Duration,
}

/// Sends requests from `clients` connections to each Envoy for `run_for`;
/// `key(client, i)` picks the x-api-key.
fn load(envoys: &[&Envoy], clients: usize, run_for: Duration, key: fn(usize, usize) -> String) -> Seen {
    let stop = Arc::new(AtomicBool::new(false));
    let handles: Vec<_> = envoys
        .iter()
        .flat_map(|envoy| (0..clients).map(move |c| (envoy.port, c)))
        .map(|(port, client)| {
            let stop = Arc::clone(&stop);
            thread::spawn(move || {
                let mut conn = Conn::open(port).unwrap();
                let mut seen = Seen::default();
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let k = key(client, i);
                    i += 1;
                    let started = Instant::now();
                    match conn.try_request("GET", "/", &[("x-api-key", k.as_bytes())]) {
                        Ok(r) if r.status == 200 => seen.admitted += 1,
                        Ok(r) if r.status == 429 => seen.limited += 1,
                        Ok(_) | Err(_) => {
                            seen.other += 1;
                            conn = Conn::open(port).unwrap();
                        }
                    }
                    seen.slowest = seen.slowest.max(started.elapsed());
                }
                seen
            })
        })
        .collect();
    thread::sleep(run_for);
    stop.store(true, Ordering::Relaxed);
    handles.into_iter().map(|h| h.join().unwrap()).fold(Seen::default(), |a, b| Seen {
        admitted: a.admitted + b.admitted,
        limited: a.limited + b.limited,
        other: a.other + b.other,
        slowest: a.slowest.max(b.slowest),
    })
}

/// Polls `done` every 20 ms for at most `within`; false if it never held.
fn eventually(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if done() {
            return true;
        }
        thread::sleep(Duration::from_millis(20));
    }
    done()
}

#[test]
fn one_envoy_spends_leases_and_never_passes_the_service_limit() {
    let service = QuotaService::start(LIMITS, "memory");
    let envoy = envoy_for(&[service.port], &plugin(Some("api"), "lease", r#""deny""#));
    let mut conn = envoy.connect();
    let first = conn.get("/", &[]);
    assert_eq!(first.status, 200, "{}", envoy.log_tail());
    // The service's limit and the pool's numbers, not the filter's config.
    assert_eq!(first.header("ratelimit-policy"), Some("\"fleet\";q=30;w=3600"));
    let admitted = 1 + (0..59).filter(|_| conn.get("/", &[]).status == 200).count();
    // Never more than the service's 30 per hour; the service paces out its
    // last tenth over the rest of the hour, so 27 to 30 within the test.
    assert!((27..=30).contains(&admitted), "{admitted} admitted\n{}", envoy.log_tail());
    let limited = conn.get("/", &[]);
    assert_eq!(limited.status, 429);
    assert!(limited.header("retry-after").is_some());
    assert!(envoy.stat("wasmcustom.floodgate.global.callouts_ok") > 0);
    assert_eq!(envoy.stat("wasmcustom.floodgate.rule.fleet.fallback"), 0);
}

/// Three Envoys with two workers each share one limit through the service:
/// the fleet never admits more than the token bucket allows over the run,
/// and, with demand far above it, uses at least 90% of it.
fn fleet_shares_one_limit(stores: &[QuotaService]) {
    let ports: Vec<u16> = stores.iter().map(|s| s.port).collect();
    let config = plugin(Some("fleet"), "lease", r#""deny""#);
    let envoys: Vec<Envoy> = (0..3).map(|_| envoy_for(&ports, &config)).collect();
    let started = Instant::now();
    let seen = load(&envoys.iter().collect::<Vec<_>>(), 4, Duration::from_secs(20), |_, _| String::new());
    let elapsed = started.elapsed().as_secs_f64();
    // 100 at once, then 20 per second (one more second for answers in flight).
    let bound = 100.0 + 20.0 * (elapsed + 1.0);
    let fair = 100.0 + 20.0 * (elapsed - 1.0);
    assert_eq!(seen.other, 0, "{seen:?}");
    assert!(seen.limited > 10 * seen.admitted, "demand must far exceed the limit: {seen:?}");
    assert!((seen.admitted as f64) <= bound, "the fleet admitted {} > {bound:.0}", seen.admitted);
    assert!(
        seen.admitted as f64 >= 0.9 * fair,
        "only {} of {fair:.0} used: quota stranded in one Envoy while others starve?",
        seen.admitted
    );
    for envoy in &envoys {
        assert!(envoy.stat("wasmcustom.floodgate.allowed") > 0, "an Envoy admitted nothing");
        assert_eq!(envoy.stat("wasmcustom.floodgate.rule.fleet.fallback"), 0);
    }
}

#[test]
fn three_envoys_share_one_global_limit_memory_store() {
    fleet_shares_one_limit(&[QuotaService::start(LIMITS, "memory")]);
}

#[test]
fn three_envoys_share_one_global_limit_redis_and_two_service_instances() {
    let redis = RedisServer::start();
    let url = redis.url();
    fleet_shares_one_limit(&[QuotaService::start(LIMITS, &url), QuotaService::start(LIMITS, &url)]);
}

#[test]
fn per_client_global_rules_hold_each_clients_limit_fleet_wide() {
    let service = QuotaService::start(LIMITS, "memory");
    let config = plugin(None, "lease", r#""deny""#);
    let envoys: Vec<Envoy> = (0..3).map(|_| envoy_for(&[service.port], &config)).collect();
    // 5 keys, every client cycling through them on all three Envoys.
    let seen =
        load(&envoys.iter().collect::<Vec<_>>(), 3, Duration::from_secs(8), |c, i| format!("key-{}", (c + i) % 5));
    assert_eq!(seen.other, 0, "{seen:?}");
    assert!(seen.admitted <= 5 * 20, "20 per key and hour, 5 keys: {seen:?}");
    assert!(seen.admitted >= 5 * 18, "at least 90% of each key's limit used: {seen:?}");
}

#[test]
fn check_mode_asks_once_per_request_and_holds_the_limit() {
    let service = QuotaService::start(LIMITS, "memory");
    let envoy = envoy_for(&[service.port], &plugin(Some("api"), "check", r#""deny""#));
    let mut conn = envoy.connect();
    let admitted = (0..40).filter(|_| conn.get("/", &[]).status == 200).count();
    assert_eq!(admitted, 30);
    let checks = service.metric("floodgate_quota_requests_total", &[r#"endpoint="check""#]);
    assert_eq!(checks, 40.0, "one /v1/check per request");
}

#[test]
fn a_hot_key_refreshes_in_the_background_not_per_request() {
    let service = QuotaService::start(LIMITS, "memory");
    let config = plugin(Some("hot"), "lease", r#""deny""#);
    let envoy = envoy_for(&[service.port], &config);
    let seen = load(&[&envoy], 8, Duration::from_secs(8), |_, _| String::new());
    assert_eq!(seen.limited + seen.other, 0, "{seen:?}");
    let leases = service.metric("floodgate_quota_requests_total", &[r#"endpoint="lease""#]);
    let per_request = leases / seen.admitted as f64;
    eprintln!("{} requests, {leases} lease calls: {per_request:.5} per request", seen.admitted);
    assert!(per_request <= 0.02, "{leases} lease calls for {} requests", seen.admitted);
}

#[test]
fn a_dead_quota_service_means_the_local_fallback_then_global_mode_again() {
    let mut service = QuotaService::start(LIMITS, "memory");
    let fallback = r#"{"limit": 5, "period": "1h"}"#;
    let envoy = envoy_for(&[service.port], &plugin(Some("fleet"), "lease", fallback));
    let before = load(&[&envoy], 2, Duration::from_secs(2), |_, _| String::new());
    assert!(before.admitted > 0 && before.other == 0, "{before:?}");
    assert_eq!(envoy.stat("wasmcustom.floodgate.rule.fleet.fallback_active"), 0);

    service.kill();
    let during = load(&[&envoy], 2, Duration::from_secs(3), |_, _| String::new());
    assert_eq!(during.other, 0, "no failed request while the service is down: {during:?}");
    assert!(eventually(Duration::from_secs(2), || envoy.stat_now("wasmcustom.floodgate.rule.fleet.fallback_active") == 1));
    assert!(envoy.stat("wasmcustom.floodgate.rule.fleet.fallback") > 0);
    assert!(envoy.stat("wasmcustom.floodgate.global.callouts_refused") > 0, "a refused connection is a 503");

    service.restart();
    assert!(
        eventually(Duration::from_secs(5), || {
            let _ = envoy.connect().try_request("GET", "/", &[]);
            envoy.stat_now("wasmcustom.floodgate.rule.fleet.fallback_active") == 0
        }),
        "global mode did not come back within 5 s of the restart\n{}",
        envoy.log_tail()
    );
    let started = Instant::now();
    let after = load(&[&envoy], 2, Duration::from_secs(3), |_, _| String::new());
    let bound = 100.0 + 20.0 * (started.elapsed().as_secs_f64() + 1.0);
    assert_eq!(after.other, 0, "{after:?}");
    assert!((after.admitted as f64) <= bound, "after the restart: {after:?} > {bound:.0}");
}

#[test]
fn a_frozen_redis_behind_the_service_never_holds_requests_past_the_bound() {
    let redis = RedisServer::start();
    let service = QuotaService::start(LIMITS, &redis.url());
    let envoy = envoy_for(&[service.port], &plugin(Some("api"), "lease", r#""allow""#));
    assert_eq!(envoy.connect().get("/", &[]).status, 200);
    redis.pause();
    let seen = load(&[&envoy], 2, Duration::from_secs(3), |_, _| String::new());
    redis.resume();
    assert_eq!(seen.other, 0, "{seen:?}");
    // max_wait 300 ms, callouts time out at 500 ms: nobody waits much
    // longer (slack for a loaded machine).
    assert!(seen.slowest < Duration::from_secs(2), "a request waited {:?}", seen.slowest);
}

/// A fake quota service answering every call with `answer`.
fn garbage_service(answer: &'static [u8], drip: bool) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            thread::spawn(move || {
                let mut stream = stream;
                let mut buf = [0u8; 65536];
                let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
                while stream.read(&mut buf).is_ok_and(|n| n > 0) {
                    if drip {
                        for byte in answer {
                            if stream.write_all(&[*byte]).is_err() {
                                return;
                            }
                            thread::sleep(Duration::from_millis(100));
                        }
                    } else if stream.write_all(answer).is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

#[test]
fn a_service_answering_garbage_means_fallback_never_a_panic() {
    let huge: &'static [u8] = Box::leak(
        format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{}", 10 << 20, "x".repeat(10 << 20))
            .into_bytes()
            .into_boxed_slice(),
    );
    let cases: [(&str, &'static [u8], bool); 4] = [
        ("wrong JSON", b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nnot json!", false),
        ("10 MB body", huge, false),
        ("missing fields", b"HTTP/1.1 200 OK\r\ncontent-length: 23\r\n\r\n{\"leases\": [{\"x\": 1}]}", false),
        ("slow drip", b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\n\r\n{\"leases\":[]", true),
    ];
    for (what, answer, drip) in cases {
        let port = garbage_service(answer, drip);
        let envoy = envoy_for(&[port], &plugin(Some("api"), "lease", r#"{"limit": 3, "period": "1h"}"#));
        let seen = load(&[&envoy], 2, Duration::from_secs(2), |_, _| String::new());
        assert_eq!(seen.other, 0, "{what}: {seen:?}\n{}", envoy.log_tail());
        assert!(seen.admitted <= 3, "{what}: the local fall-back's 3 per hour: {seen:?}");
        // Read at once: this service answers its probes (`/readyz`) with a 200
        // too, so a while after the load the rule is back in global mode.
        assert_eq!(envoy.stat_now("wasmcustom.floodgate.rule.fleet.fallback_active"), 1, "{what}");
        let failed = ["bad_answer", "timeout", "bad_status"]
            .iter()
            .map(|k| envoy.stat(&format!("wasmcustom.floodgate.global.callouts_{k}")))
            .sum::<u64>();
        assert!(failed > 0, "{what}: failures counted");
        assert!(!envoy.log_tail().contains("panicked"), "{what}: {}", envoy.log_tail());
    }
}

#[test]
fn removing_a_global_rule_gives_its_unspent_tokens_back() {
    // Leases long enough to outlive the listener's drain.
    let service = QuotaService::start_with(LIMITS, "memory", &["--lease-ttl", "20s"]);
    let global =
        Setup::new(&plugin(Some("stock"), "lease", r#""deny""#)).with_cluster("floodgate-quota", &[service.port]);
    let envoy = Envoy::start_dynamic(&global);
    // Light traffic on a generous limit: the pool holds tokens to spare.
    let seen = load(&[&envoy], 1, Duration::from_millis(300), |_, _| String::new());
    assert!(seen.admitted > 0 && seen.limited == 0, "{seen:?}");
    let before = service.metric("floodgate_quota_tokens_returned_total", &[]);
    let local = Setup::new(r#"{"rules": [{"name": "local", "limit": 5, "period": "1s"}]}"#)
        .with_cluster("floodgate-quota", &[service.port]);
    assert_eq!(envoy.update_listener(&local), Update::Accepted);
    assert!(
        eventually(Duration::from_secs(5), || service.metric("floodgate_quota_tokens_returned_total", &[]) > before),
        "no tokens came back when the rule went away; return calls: {}\n{}",
        service.metric("floodgate_quota_requests_total", &[r#"endpoint="return""#]),
        envoy
            .log_tail()
            .lines()
            .filter(|l| l.contains("wasm") || l.contains("lds") || l.contains("listener"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}
