//! End to end, global mode: real Envoys (two workers each) with the filter,
//! and the real quota service, on loopback. Counts are asserted: what the
//! whole fleet admits against what the service's limit allows.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use floodgate_e2e::{assert_both_workers_served, AdmissionLog, Conn, Envoy, QuotaServer, RedisServer, Setup, Update};

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
/// API key when `route` is `None`), a request waiting at most 300 ms for a refill.
fn plugin(route: Option<&str>, mode: &str, fallback: &str) -> String {
    plugin_waiting(route, mode, fallback, "300ms")
}

/// The same, a request waiting at most `max_wait` for a refill.
fn plugin_waiting(route: Option<&str>, mode: &str, fallback: &str, max_wait: &str) -> String {
    let descriptor = match route {
        Some(route) => format!(r#"{{"generic_key": {{"descriptor_key": "route", "descriptor_value": "{route}"}}}}"#),
        None => r#"{"request_headers": {"header_name": "x-api-key", "descriptor_key": "api_key"}}"#.to_string(),
    };
    format!(
        r#"{{"rules": [{{"name": "fleet", "scope": "global", "mode": "{mode}", "fallback": {fallback},
            "descriptors": [{descriptor}]}}],
          "global": {{"cluster": "floodgate-quota", "domain": "edge", "timeout": "500ms", "max_wait": "{max_wait}"}}}}"#
    )
}

/// Holds the tests that run three Envoys or more under unpaced load to one
/// at a time: two of them side by side on a 2-core machine (eight Envoys,
/// their clients and the services) can starve a callout past its 500 ms
/// timeout, and a rule then falls back (once, 313 decisions in the
/// per-second test), which says nothing of the filter. The single-Envoy
/// tests still run beside them.
fn one_fleet_at_a_time() -> MutexGuard<'static, ()> {
    static FLEETS: Mutex<()> = Mutex::new(());
    FLEETS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
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
    let service = QuotaServer::start(LIMITS, "memory");
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
    assert!(envoy.filter_stat("global.callouts_ok") > 0);
    assert_eq!(envoy.filter_stat("rule.fleet.fallback"), 0);
}

/// Three Envoys with two workers each share one limit through the service:
/// the fleet never admits more than the token bucket allows over the run,
/// and, with demand far above it, uses at least 90% of it.
fn fleet_shares_one_limit(stores: &[QuotaServer]) {
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
        assert!(envoy.filter_stat("allowed") > 0, "an Envoy admitted nothing");
        assert_eq!(envoy.filter_stat("rule.fleet.fallback"), 0);
    }
}

#[test]
fn three_envoys_share_one_global_limit_memory_store() {
    let _one_fleet_at_a_time = one_fleet_at_a_time();
    fleet_shares_one_limit(&[QuotaServer::start(LIMITS, "memory")]);
}

#[test]
fn three_envoys_share_one_global_limit_redis_and_two_service_instances() {
    let _one_fleet_at_a_time = one_fleet_at_a_time();
    let redis = RedisServer::start();
    let url = redis.url();
    fleet_shares_one_limit(&[QuotaServer::start(LIMITS, &url), QuotaServer::start(LIMITS, &url)]);
}

#[test]
fn per_client_global_rules_hold_each_clients_limit_fleet_wide() {
    let _one_fleet_at_a_time = one_fleet_at_a_time();
    let service = QuotaServer::start(LIMITS, "memory");
    let config = plugin(None, "lease", r#""deny""#);
    let envoys: Vec<Envoy> = (0..3).map(|_| envoy_for(&[service.port], &config)).collect();
    // 5 keys, every client cycling through them on all three Envoys.
    let seen =
        load(&envoys.iter().collect::<Vec<_>>(), 3, Duration::from_secs(8), |c, i| format!("key-{}", (c + i) % 5));
    assert_eq!(seen.other, 0, "{seen:?}");
    assert!(seen.admitted <= 5 * 20, "20 per key and hour, 5 keys: {seen:?}");
    assert!(seen.admitted >= 5 * 18, "at least 90% of each key's limit used: {seen:?}");
}

/// Limits of the per-second windows test: fixed windows of a second, one
/// far below its demand, one far above it.
const SECOND_WINDOWS: &str = "domain: edge
descriptors:
  - key: route
    value: second
    rate_limit: {unit: second, requests_per_unit: 100}
  - key: route
    value: light
    rate_limit: {unit: second, requests_per_unit: 1000}
";

/// Per-second fixed windows, counted window by window. Three Envoys with two
/// workers each, far more demand than the limit of 100 a second, for 22 s: by
/// the instant each Envoy let a request through, no second ever admits more
/// than 100 fleet-wide, and every whole second uses at least 90. A fourth
/// Envoy, far below its own limit, switches from one second's lease to the
/// next without waiting: once warmed up, its requests wait for a refresh only
/// in the moment an answer takes to arrive, not once a second as they would if
/// a lease ended with its window and the next were asked for only then.
#[test]
fn per_second_windows_hold_window_by_window_and_are_leased_ahead() {
    let _one_fleet_at_a_time = one_fleet_at_a_time();
    let service = QuotaServer::start(SECOND_WINDOWS, "memory");
    let logs: Vec<AdmissionLog> = (0..3)
        .map(|i| {
            let path = std::env::temp_dir().join(format!("floodgate-windows-{}-{i}.log", std::process::id()));
            AdmissionLog::new(&path, None)
        })
        .collect();
    let heavy = plugin(Some("second"), "lease", r#""deny""#);
    let envoys: Vec<Envoy> = logs
        .iter()
        .map(|log| {
            let mut setup = Setup::new(&heavy).with_cluster("floodgate-quota", &[service.port]);
            setup.manager_fields.insert("access_log".into(), log.access_log());
            Envoy::start(&setup)
        })
        .collect();
    let quiet = envoy_for(&[service.port], &plugin(Some("light"), "lease", r#""deny""#));
    let run_for = Duration::from_secs(22);

    // 20 requests a second to the fourth Envoy, alongside the load.
    let light_port = quiet.port;
    let warm_up = Duration::from_secs(3);
    let light = thread::spawn(move || {
        let mut conn = Conn::open(light_port).unwrap();
        let (started, mut statuses) = (Instant::now(), Vec::new());
        while started.elapsed() < warm_up + run_for {
            statuses.push(conn.get("/", &[]).status);
            thread::sleep(Duration::from_millis(50));
        }
        statuses
    });
    // A new pool's first asks are small (its rate is observed from
    // nothing), so its first second waits a few times: counted apart.
    thread::sleep(warm_up);
    let warming_waits = quiet.filter_stat("global.refill_waits");
    let started = std::time::SystemTime::now();
    let seen = load(&envoys.iter().collect::<Vec<_>>(), 4, run_for, |_, _| String::new());
    let ended = std::time::SystemTime::now();
    let light = light.join().unwrap();
    thread::sleep(Duration::from_millis(500)); // the access logs' flush

    assert_eq!(seen.other, 0, "{seen:?}");
    assert!(seen.limited > 10 * seen.admitted, "demand must far exceed the limit: {seen:?}");
    let mut per_second = std::collections::BTreeMap::<u64, u64>::new();
    let mut logged = 0;
    for log in &logs {
        for admission in log.read() {
            *per_second.entry(admission.at_ns / 1_000_000_000).or_default() += 1;
            logged += 1;
        }
    }
    assert_eq!(logged, seen.admitted, "every admitted request is in the access logs");
    let second = |t: std::time::SystemTime| t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let whole = (second(started) + 1)..second(ended);
    assert!(whole.end - whole.start >= 20, "{whole:?}");
    for (at, admitted) in &per_second {
        assert!(*admitted <= 100, "second {at} admitted {admitted} > 100 fleet-wide: {per_second:?}");
    }
    for at in whole {
        let admitted = per_second.get(&at).copied().unwrap_or(0);
        assert!(admitted >= 90, "second {at} used only {admitted} of 100: {per_second:?}");
    }
    for envoy in &envoys {
        assert!(envoy.filter_stat("allowed") > 0, "an Envoy admitted nothing");
        assert_eq!(envoy.filter_stat("rule.fleet.fallback"), 0);
    }

    // Without leases ahead, the first request of every second waits: 22
    // or more. With them, only those that come in the moment between one
    // second's lease and the next (an answer's delay, longer on a loaded
    // machine).
    assert!(light.iter().all(|status| *status == 200), "the quiet Envoy is far below its limit: {light:?}");
    let waits = quiet.filter_stat("global.refill_waits") - warming_waits;
    eprintln!("quiet Envoy: {} requests, {warming_waits} waited while warming up, {waits} after", light.len());
    assert!(waits <= 10, "{waits} requests waited for a refresh over 22 seconds");
}

/// Check mode over two Envoys, two connections each: exactly the service's
/// 30 of 40 requests, one `/v1/check` per request, and a denial carries
/// `Retry-After`.
#[test]
fn check_mode_asks_once_per_request_and_holds_the_limit() {
    let service = QuotaServer::start(LIMITS, "memory");
    let config = plugin(Some("api"), "check", r#""deny""#);
    let envoys = [envoy_for(&[service.port], &config), envoy_for(&[service.port], &config)];
    let mut conns = [envoys[0].connect(), envoys[1].connect(), envoys[0].connect(), envoys[1].connect()];
    let admitted = (0..40).filter(|i| conns[i % 4].get("/", &[]).status == 200).count();
    assert_eq!(admitted, 30);
    let checks = service.metric("floodgate_quota_requests_total", &[r#"endpoint="check""#]);
    assert_eq!(checks, 40.0, "one /v1/check per request");
    let limited = conns[0].get("/", &[]);
    assert_eq!(limited.status, 429);
    assert!(limited.header("retry-after").is_some(), "{limited:?}");
}

/// Every request of a new API key finds its pool empty and waits for its
/// first lease: it goes on when the lease's answer comes (a request still
/// waiting at its `max_wait` would be denied: the rule falls back to
/// `deny`), on whichever worker it came to, and never errs. `max_wait` is
/// long (2 s), so that a slow answer on a loaded machine is not mistaken
/// for a lost one.
#[test]
fn a_request_waiting_for_a_refill_goes_on_when_the_lease_comes() {
    let service = QuotaServer::start(LIMITS, "memory");
    let envoy = envoy_for(&[service.port], &plugin_waiting(None, "lease", r#""deny""#, "2s"));
    let seen = load(&[&envoy], 4, Duration::from_secs(2), |c, i| format!("new-{c}-{i}"));
    let waits = envoy.filter_stat("global.refill_waits");
    eprintln!("{seen:?}; refill_waits {waits}, {} ms in all", envoy.filter_stat("global.refill_wait_ms"));
    assert!(seen.admitted > 0, "{seen:?}");
    assert_eq!(seen.limited + seen.other, 0, "{seen:?}\n{}", envoy.log_tail());
    assert_eq!(waits, seen.admitted, "each request of a new key waited for its lease");
    assert_both_workers_served(&envoy);
}

/// A `global.cluster` Envoy does not have: said plainly in the log at the
/// first call, and the rules use their fall-back.
#[test]
fn a_misspelt_cluster_is_said_plainly_and_rules_fall_back() {
    let config = plugin(Some("api"), "lease", r#"{"limit": 3, "period": "1h"}"#).replace("floodgate-quota", "nosuch");
    let envoy = Envoy::start(&Setup::new(&config));
    assert!(
        eventually(Duration::from_secs(5), || envoy.filter_stat_now("rule.fleet.fallback_active") == 1),
        "{}",
        envoy.log_tail()
    );
    let seen = load(&[&envoy], 2, Duration::from_millis(500), |_, _| String::new());
    assert_eq!((seen.admitted, seen.other), (3, 0), "the fall-back's 3 an hour: {seen:?}");
    assert!(envoy.filter_stat("global.callouts_not_sent") > 0);
    let log = envoy.log();
    assert!(log.contains(r#"global.cluster "nosuch" cannot be called"#), "{log}");
}

#[test]
fn a_hot_key_refreshes_in_the_background_not_per_request() {
    let service = QuotaServer::start(LIMITS, "memory");
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
    let mut service = QuotaServer::start(LIMITS, "memory");
    let fallback = r#"{"limit": 5, "period": "1h"}"#;
    let envoy = envoy_for(&[service.port], &plugin(Some("fleet"), "lease", fallback));
    let before = load(&[&envoy], 2, Duration::from_secs(2), |_, _| String::new());
    assert!(before.admitted > 0 && before.other == 0, "{before:?}");
    assert_eq!(envoy.filter_stat("rule.fleet.fallback_active"), 0);

    service.kill();
    let during = load(&[&envoy], 2, Duration::from_secs(3), |_, _| String::new());
    assert_eq!(during.other, 0, "no failed request while the service is down: {during:?}");
    assert!(eventually(Duration::from_secs(2), || envoy.filter_stat_now("rule.fleet.fallback_active") == 1));
    assert!(envoy.filter_stat("rule.fleet.fallback") > 0);
    assert!(envoy.filter_stat("global.callouts_refused") > 0, "a refused connection is a 503");

    service.restart();
    assert!(
        eventually(Duration::from_secs(5), || {
            let _ = envoy.connect().try_request("GET", "/", &[]);
            envoy.filter_stat_now("rule.fleet.fallback_active") == 0
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
    let service = QuotaServer::start(LIMITS, &redis.url());
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

/// A fake quota service answering every call with `answer` (byte by byte,
/// 100 ms apart, with `drip`; closing the connection unanswered, if empty).
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
                    if answer.is_empty() {
                        // A reset: the request read, the connection dropped.
                        return;
                    }
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

/// Hostile answers — not JSON, a 10 MB body, the wrong fields, a slow drip
/// past the timeout, a connection dropped unanswered — to leases and to
/// checks: no request fails, the fall-back decides, each failure is
/// counted by its kind, and nothing panics.
#[test]
fn a_service_answering_garbage_means_fallback_never_a_panic() {
    let huge: &'static [u8] = Box::leak(
        format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{}", 10 << 20, "x".repeat(10 << 20))
            .into_bytes()
            .into_boxed_slice(),
    );
    // A failed call is counted as the kind of failure it is: an answer that
    // came, but wrong; none in time; a connection that gave none.
    let answered_wrong = ["bad_answer", "timeout", "bad_status"].as_slice();
    let cases: [(&str, &'static [u8], bool, &[&str]); 5] = [
        ("wrong JSON", b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nnot json!", false, answered_wrong),
        ("10 MB body", huge, false, answered_wrong),
        (
            "missing fields",
            b"HTTP/1.1 200 OK\r\ncontent-length: 23\r\n\r\n{\"leases\": [{\"x\": 1}]}",
            false,
            answered_wrong,
        ),
        ("slow drip", b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\n\r\n{\"leases\":[]", true, answered_wrong),
        ("reset", b"", false, &["refused"]),
    ];
    for mode in ["lease", "check"] {
        for (what, answer, drip, kinds) in cases {
            let port = garbage_service(answer, drip);
            let mut envoy = envoy_for(&[port], &plugin(Some("api"), mode, r#"{"limit": 3, "period": "1h"}"#));
            let seen = load(&[&envoy], 2, Duration::from_secs(2), |_, _| String::new());
            assert!(envoy.is_running(), "{mode}, {what}: Envoy went down");
            assert_eq!(seen.other, 0, "{mode}, {what}: {seen:?}\n{}", envoy.log_tail());
            assert!(seen.admitted <= 3, "{mode}, {what}: the local fall-back's 3 per hour: {seen:?}");
            // Requests the fall-back decided, not the fall-back gauge at the end:
            // this service answers its probes (`/readyz`) with a 200 too, so the
            // rule goes back to global mode between failed leases, and the gauge
            // read at any one instant may catch it there (seen with the 10 MB
            // body, whose lease takes longest to fail).
            // Counters that only grow, read once flushed: the failing calls'
            // probes keep them moving, so they never settle.
            let stats = envoy.stats_flushed();
            let stat = |name: &str| stats.get(&envoy.filter_stat_name(name)).copied().unwrap_or(0);
            assert!(stat("rule.fleet.fallback") > 0, "{mode}, {what}: the fall-back decided");
            let failed = kinds.iter().map(|k| stat(&format!("global.callouts_{k}"))).sum::<u64>();
            assert!(failed > 0, "{mode}, {what}: failures counted as {kinds:?}");
            assert!(!envoy.log().contains("panicked"), "{mode}, {what}: {}", envoy.log());
        }
    }
}

#[test]
fn removing_a_global_rule_gives_its_unspent_tokens_back() {
    // Leases long enough to outlive the listener's drain.
    let service = QuotaServer::start_with(LIMITS, "memory", &["--lease-ttl", "20s"]);
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
