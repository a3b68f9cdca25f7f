//! The native build's global mode checked on the real Envoy 1.40 (two
//! workers each) and the real quota service, on loopback: the checks
//! recorded in `native/CHECKS.md`. Until the end-to-end suites run over both
//! builds, this is how they are run again:
//!
//! ```text
//! make native && cargo build -p floodgate-quota
//! cargo run -p floodgate-native --example global_checks            # every check
//! cargo run -p floodgate-native --example global_checks -- hostile # the checks whose name has "hostile"
//! ```
//!
//! Each check prints what it saw and panics (exit code 101) when a count is
//! not what it must be. It uses the end-to-end harness (`floodgate-e2e`):
//! its Envoy, its HTTP client and its quota service, with a bootstrap of its
//! own that loads `target/native/libfloodgate_native.so`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::fs;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use floodgate_e2e::bootstrap::{self, Listener, DIRECT_RESPONSE_ROUTE};
use floodgate_e2e::{assert_both_workers_served, repo_root, Conn, Envoy, QuotaServer};

/// The limits of the end-to-end suite's global tests (`tests/tests/global.rs`).
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
/// API key when `route` is `None`), as the end-to-end suite writes it.
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

fn module() -> PathBuf {
    let path = repo_root().join("target/native/libfloodgate_native.so");
    assert!(path.exists(), "{} is missing: build it with `make native`", path.display());
    path
}

/// The native filter as an `http_filters` item, under `filter_name`.
fn native_filter(filter_name: &str, config: &str) -> String {
    let config = config.replace('\'', "''").replace('\n', " ");
    format!(
        r#"          - name: envoy.filters.http.dynamic_modules
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter
              dynamic_module_config:
                module: {{local: {{filename: "{module}"}}}}
                do_not_close: true
              filter_name: {filter_name}
              filter_config:
                "@type": type.googleapis.com/google.protobuf.StringValue
                value: '{config}'
"#,
        module = module().display()
    )
}

/// A listener on `port` with the native filter (`filter_name`, `config`).
fn listener(port: u16, filter_name: &str, config: &str) -> String {
    let virtual_host = format!("              routes:\n{DIRECT_RESPONSE_ROUTE}");
    let http_filters = native_filter(filter_name, config);
    Listener {
        port,
        stat_prefix: "e2e",
        manager: "          use_remote_address: true\n",
        virtual_host: &virtual_host,
        http_filters: &http_filters,
        balanced: true,
    }
    .fields()
}

/// Envoy with the native filter running `config`, and the quota service's
/// cluster on `service_ports`.
fn envoy_for(service_ports: &[u16], config: &str) -> Envoy {
    let cluster = bootstrap::clusters(&[bootstrap::cluster("floodgate-quota", service_ports, "0.25s", false)]);
    Envoy::start_bootstrap(|port, admin| {
        format!(
            "static_resources:\n  listeners:\n  - name: main\n{}{cluster}{}",
            listener(port, "floodgate", config),
            bootstrap::admin(admin)
        )
    })
}

/// A loopback port nobody listens on.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// What a load run saw.
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

/// Polls `done` every 20 ms for at most `within`.
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

/// A stat of the native build (`dynamicmodulescustom.floodgate.<name>`).
fn stat(envoy: &Envoy, name: &str) -> u64 {
    envoy.stat(&format!("dynamicmodulescustom.floodgate.{name}"))
}

fn stat_now(envoy: &Envoy, name: &str) -> u64 {
    envoy.stat_now(&format!("dynamicmodulescustom.floodgate.{name}"))
}

/// Two Envoys share the service's 30 per hour in lease mode: never more,
/// and (demand far above it) all but the last tenth the service paces out;
/// five API keys' 20 per hour each, held fleet-wide.
fn lease_mode_holds_the_fleet_limit_over_two_envoys() {
    let service = QuotaServer::start(LIMITS, "memory");
    let config = plugin(Some("api"), "lease", r#""deny""#);
    let envoys = [envoy_for(&[service.port], &config), envoy_for(&[service.port], &config)];
    let first = envoys[0].connect().get("/", &[]);
    assert_eq!(first.status, 200, "{}", envoys[0].log_tail());
    println!("  first answer: ratelimit-policy {:?}", first.header("ratelimit-policy"));
    assert_eq!(first.header("ratelimit-policy"), Some("\"fleet\";q=30;w=3600"));
    let seen = load(&[&envoys[0], &envoys[1]], 4, Duration::from_secs(3), |_, _| String::new());
    let admitted = seen.admitted + 1;
    println!("  route=api, 30/h, 2 Envoys x 4 connections for 3 s: {admitted} admitted, {} limited", seen.limited);
    assert_eq!(seen.other, 0, "{seen:?}");
    assert!((27..=30).contains(&admitted), "{admitted} admitted");
    for envoy in &envoys {
        assert_eq!(stat(envoy, "rule.fleet.fallback"), 0);
        assert_both_workers_served(envoy);
    }
    let config = plugin(None, "lease", r#""deny""#);
    let envoys = [envoy_for(&[service.port], &config), envoy_for(&[service.port], &config)];
    let seen = load(&[&envoys[0], &envoys[1]], 3, Duration::from_secs(6), |c, i| format!("key-{}", (c + i) % 5));
    println!(
        "  api_key=*, 20/h each, 5 keys over 2 Envoys for 6 s: {} admitted, {} limited",
        seen.admitted, seen.limited
    );
    assert_eq!(seen.other, 0, "{seen:?}");
    assert!((90..=100).contains(&seen.admitted), "{seen:?}");
}

/// Check mode: one `/v1/check` per request, exactly the service's 30 of 60
/// requests over two Envoys.
fn check_mode_is_exact_over_two_envoys() {
    let service = QuotaServer::start(LIMITS, "memory");
    let config = plugin(Some("api"), "check", r#""deny""#);
    let envoys = [envoy_for(&[service.port], &config), envoy_for(&[service.port], &config)];
    let mut conns = [envoys[0].connect(), envoys[0].connect(), envoys[1].connect(), envoys[1].connect()];
    let admitted = (0..60).filter(|i| conns[i % 4].get("/", &[]).status == 200).count();
    let checks = service.metric("floodgate_quota_requests_total", &[r#"endpoint="check""#]);
    println!("  route=api in check mode, 60 requests over 2 Envoys: {admitted} admitted, {checks} checks");
    assert_eq!(admitted, 30);
    assert_eq!(checks, 60.0, "one /v1/check per request");
    let limited = conns[0].get("/", &[]);
    assert_eq!(limited.status, 429);
    println!("  a denied check: 429, retry-after {:?}", limited.header("retry-after"));
    assert!(limited.header("retry-after").is_some());
}

/// The service dies: the local fall-back decides at once, and global mode
/// comes back by itself when it returns.
fn a_dead_service_means_the_fallback_then_global_mode_again() {
    let mut service = QuotaServer::start(LIMITS, "memory");
    let fallback = r#"{"limit": 5, "period": "1h"}"#;
    let envoy = envoy_for(&[service.port], &plugin(Some("fleet"), "lease", fallback));
    let before = load(&[&envoy], 2, Duration::from_secs(2), |_, _| String::new());
    println!("  before: {before:?}");
    assert!(before.admitted > 0 && before.other == 0, "{before:?}");
    assert_eq!(stat(&envoy, "rule.fleet.fallback_active"), 0);

    service.kill();
    let during = load(&[&envoy], 2, Duration::from_secs(3), |_, _| String::new());
    println!("  service killed: {during:?}");
    assert_eq!(during.other, 0, "no failed request while the service is down: {during:?}");
    assert!(eventually(Duration::from_secs(2), || stat_now(&envoy, "rule.fleet.fallback_active") == 1));
    let (fallback, refused) = (stat(&envoy, "rule.fleet.fallback"), stat(&envoy, "global.callouts_refused"));
    println!("  fallback_active 1, {fallback} requests the fall-back decided, callouts_refused {refused}");
    assert!(fallback > 0);
    assert!(refused > 0, "a refused connection is a 503");

    let down = Instant::now();
    service.restart();
    assert!(
        eventually(Duration::from_secs(5), || {
            let _ = envoy.connect().try_request("GET", "/", &[]);
            stat_now(&envoy, "rule.fleet.fallback_active") == 0
        }),
        "global mode did not come back within 5 s of the restart\n{}",
        envoy.log_tail()
    );
    println!("  restarted: global mode again {:.1} s later", down.elapsed().as_secs_f64());
    let started = Instant::now();
    let after = load(&[&envoy], 2, Duration::from_secs(3), |_, _| String::new());
    let bound = 100.0 + 20.0 * (started.elapsed().as_secs_f64() + 1.0);
    println!("  after: {after:?} (bound {bound:.0})");
    assert_eq!(after.other, 0, "{after:?}");
    assert!((after.admitted as f64) <= bound, "after the restart: {after:?} > {bound:.0}");
}

/// Every request of a new API key finds its pool empty and waits for its
/// lease: it is resumed by its own stream (on its worker) when the lease is
/// applied, never errs, and waits about a round trip.
fn a_request_waiting_for_a_refill_is_resumed_on_its_worker() {
    let service = QuotaServer::start(LIMITS, "memory");
    let envoy = envoy_for(&[service.port], &plugin(None, "lease", r#""deny""#));
    let seen = load(&[&envoy], 4, Duration::from_secs(2), |c, i| format!("new-{c}-{i}"));
    let waits = stat(&envoy, "global.refill_waits");
    let waited_ms = stat(&envoy, "global.refill_wait_ms");
    println!(
        "  {} new keys over 4 connections: {} admitted, {} limited, {} other; refill_waits {waits}, {waited_ms} ms in all, slowest {:?}",
        seen.admitted + seen.limited + seen.other,
        seen.admitted,
        seen.limited,
        seen.other,
        seen.slowest
    );
    assert_eq!(seen.limited + seen.other, 0, "{seen:?}");
    assert_eq!(waits, seen.admitted, "each request of a new key waited for its lease");
    assert!(seen.slowest < Duration::from_millis(300), "no request waited out its max_wait: {:?}", seen.slowest);
    assert_both_workers_served(&envoy);
}

/// A hot key: leases refresh in the background, not per request.
fn a_hot_key_refreshes_in_the_background() {
    let service = QuotaServer::start(LIMITS, "memory");
    let envoy = envoy_for(&[service.port], &plugin(Some("hot"), "lease", r#""deny""#));
    let seen = load(&[&envoy], 8, Duration::from_secs(5), |_, _| String::new());
    let leases = service.metric("floodgate_quota_requests_total", &[r#"endpoint="lease""#]);
    let per_request = leases / seen.admitted as f64;
    println!("  {} requests, {leases} lease calls: {per_request:.5} per request", seen.admitted);
    assert_eq!(seen.limited + seen.other, 0, "{seen:?}");
    assert!(per_request <= 0.02, "{leases} lease calls for {} requests", seen.admitted);
}

/// A fake quota service answering every call with `answer` (byte by byte,
/// 100 ms apart, with `drip`; closing the connection at once, with no
/// answer).
fn fake_service(answer: &'static [u8], drip: bool) -> u16 {
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

/// Hostile answers (garbage, 10 MB, the wrong fields, a slow drip, a reset)
/// in lease mode and in check mode: the fall-back decides, failures are
/// counted, and Envoy never goes down.
fn hostile_answers_mean_fallback_never_a_crash() {
    let huge: &'static [u8] = Box::leak(
        format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{}", 10 << 20, "x".repeat(10 << 20))
            .into_bytes()
            .into_boxed_slice(),
    );
    let cases: [(&str, &'static [u8], bool); 5] = [
        ("wrong JSON", b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nnot json!", false),
        ("10 MB body", huge, false),
        ("missing fields", b"HTTP/1.1 200 OK\r\ncontent-length: 23\r\n\r\n{\"leases\": [{\"x\": 1}]}", false),
        ("slow drip", b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\n\r\n{\"leases\":[]", true),
        ("reset", b"", false),
    ];
    for mode in ["lease", "check"] {
        for (what, answer, drip) in cases {
            let port = fake_service(answer, drip);
            let mut envoy = envoy_for(&[port], &plugin(Some("api"), mode, r#"{"limit": 3, "period": "1h"}"#));
            let seen = load(&[&envoy], 2, Duration::from_secs(2), |_, _| String::new());
            let kinds: Vec<(&str, u64)> = ["bad_answer", "timeout", "bad_status", "refused", "not_sent"]
                .into_iter()
                .map(|k| (k, stat(&envoy, &format!("global.callouts_{k}"))))
                .filter(|(_, n)| *n > 0)
                .collect();
            let failed: u64 = kinds.iter().map(|(_, n)| n).sum();
            let fallback = stat(&envoy, "rule.fleet.fallback");
            println!(
                "  {mode}, {what}: {} admitted, {} limited, {} other; {fallback} decided by the fall-back, failed calls {kinds:?}",
                seen.admitted, seen.limited, seen.other
            );
            assert!(envoy.is_running(), "{mode}, {what}: Envoy went down\n{}", envoy.log_tail());
            assert_eq!(seen.other, 0, "{mode}, {what}: {seen:?}\n{}", envoy.log_tail());
            assert!(seen.admitted <= 3, "{mode}, {what}: the local fall-back's 3 per hour: {seen:?}");
            assert!(fallback > 0, "{mode}, {what}: the fall-back decided");
            assert!(failed > 0, "{mode}, {what}: failures counted");
            let log = envoy.log_tail();
            assert!(!log.contains("panic"), "{mode}, {what}: {log}");
        }
    }
}

/// A listener update that removes the global rule: the old configuration's
/// unspent tokens go back to the service, sent by the new configuration
/// (the old one's calls die with it).
fn removing_a_global_rule_gives_its_unspent_tokens_back() {
    let service = QuotaServer::start_with(LIMITS, "memory", &["--lease-ttl", "20s"]);
    let dir = std::env::temp_dir().join(format!("floodgate-native-checks-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let lds = dir.join("lds.yaml");
    let lds_file = |port: u16, config: &str| {
        format!(
            "resources:\n  - \"@type\": type.googleapis.com/envoy.config.listener.v3.Listener\n    name: main\n{}",
            listener(port, "floodgate", config)
        )
    };
    let cluster = bootstrap::clusters(&[bootstrap::cluster("floodgate-quota", &[service.port], "0.25s", false)]);
    let port = free_port();
    fs::write(&lds, lds_file(port, &plugin(Some("stock"), "lease", r#""deny""#))).unwrap();
    let envoy = Envoy::start_bootstrap(|_, admin| {
        format!(
            "node: {{id: e2e, cluster: e2e}}\ndynamic_resources:\n  lds_config:\n    resource_api_version: V3\n    \
             path_config_source:\n      path: {lds}\n      watched_directory: {{path: {dir}}}\nstatic_resources:\n{cluster}{admin}",
            lds = lds.display(),
            dir = dir.display(),
            admin = bootstrap::admin(admin),
        )
    });
    let mut conn = Conn::open(port).unwrap();
    let admitted = (0..20).filter(|_| conn.get("/", &[]).status == 200).count();
    drop(conn);
    assert_eq!(admitted, 20);
    let before = service.metric("floodgate_quota_tokens_returned_total", &[]);
    let updates = envoy.stat("listener_manager.lds.update_success");
    let local = r#"{"rules": [{"name": "local", "limit": 5, "period": "1s"}]}"#;
    fs::write(dir.join("lds.next"), lds_file(port, local)).unwrap();
    fs::rename(dir.join("lds.next"), &lds).unwrap();
    assert!(eventually(Duration::from_secs(10), || envoy.stat_now("listener_manager.lds.update_success") > updates));
    assert!(
        eventually(Duration::from_secs(10), || service.metric("floodgate_quota_tokens_returned_total", &[]) > before),
        "no tokens came back when the rule went away\n{}",
        envoy.log_tail()
    );
    let returned = service.metric("floodgate_quota_tokens_returned_total", &[]) - before;
    println!(
        "  20 requests on a global rule, then a listener update without it: {returned} tokens returned (tokens_returned {})",
        stat(&envoy, "global.tokens_returned")
    );
}

/// A `global.cluster` Envoy does not have: said plainly in the log at the
/// first call, and the rules use their fall-back.
fn a_missing_cluster_is_said_plainly_and_rules_fall_back() {
    let config = plugin(Some("api"), "lease", r#"{"limit": 3, "period": "1h"}"#).replace("floodgate-quota", "nosuch");
    let envoy = Envoy::start_bootstrap(|port, admin| {
        format!(
            "static_resources:\n  listeners:\n  - name: main\n{}{}",
            listener(port, "floodgate", &config),
            bootstrap::admin(admin)
        )
    });
    assert!(eventually(Duration::from_secs(2), || stat_now(&envoy, "rule.fleet.fallback_active") == 1));
    let seen = load(&[&envoy], 2, Duration::from_millis(500), |_, _| String::new());
    let said = envoy.log_tail().lines().any(|line| line.contains(r#"global.cluster "nosuch" cannot be called"#));
    println!("  {} admitted (the fall-back's 3), {} limited; the log says so: {said}", seen.admitted, seen.limited);
    assert!(said, "{}", envoy.log_tail());
    assert_eq!((seen.admitted, seen.other), (3, 0), "{seen:?}");
    assert!(stat(&envoy, "global.callouts_not_sent") > 0);
}

/// Two listeners of one Envoy: configurations with the same `filter_name`
/// share their buckets, different names do not.
fn buckets_are_shared_per_filter_name() {
    let rule = r#"{"rules": [{"name": "site", "limit": 3, "period": "1h",
        "descriptors": [{"generic_key": {"descriptor_value": "all"}}]}]}"#;
    let (second, third) = (free_port(), free_port());
    let envoy = Envoy::start_bootstrap(|port, admin| {
        format!(
            "static_resources:\n  listeners:\n  - name: a\n{}  - name: b\n{}  - name: c\n{}{}",
            listener(port, "shared", rule),
            listener(second, "shared", rule),
            listener(third, "other", rule),
            bootstrap::admin(admin)
        )
    });
    let status = |port: u16| Conn::open(port).unwrap().get("/", &[]).status;
    let on_a: Vec<u16> = (0..2).map(|_| status(envoy.port)).collect();
    let on_b: Vec<u16> = (0..2).map(|_| status(second)).collect();
    let on_c: Vec<u16> = (0..3).map(|_| status(third)).collect();
    println!("  limit 3: listener a (\"shared\") {on_a:?}, b (\"shared\") {on_b:?}, c (\"other\") {on_c:?}");
    assert_eq!((on_a, on_b, on_c), (vec![200, 200], vec![200, 429], vec![200, 200, 200]));
}

fn main() {
    let checks: [(&str, fn()); 9] = [
        ("lease_mode_holds_the_fleet_limit_over_two_envoys", lease_mode_holds_the_fleet_limit_over_two_envoys),
        ("check_mode_is_exact_over_two_envoys", check_mode_is_exact_over_two_envoys),
        (
            "a_dead_service_means_the_fallback_then_global_mode_again",
            a_dead_service_means_the_fallback_then_global_mode_again,
        ),
        (
            "a_request_waiting_for_a_refill_is_resumed_on_its_worker",
            a_request_waiting_for_a_refill_is_resumed_on_its_worker,
        ),
        ("a_hot_key_refreshes_in_the_background", a_hot_key_refreshes_in_the_background),
        ("hostile_answers_mean_fallback_never_a_crash", hostile_answers_mean_fallback_never_a_crash),
        ("removing_a_global_rule_gives_its_unspent_tokens_back", removing_a_global_rule_gives_its_unspent_tokens_back),
        (
            "a_missing_cluster_is_said_plainly_and_rules_fall_back",
            a_missing_cluster_is_said_plainly_and_rules_fall_back,
        ),
        ("buckets_are_shared_per_filter_name", buckets_are_shared_per_filter_name),
    ];
    let only: Vec<String> = std::env::args().skip(1).collect();
    for (name, check) in checks {
        if only.is_empty() || only.iter().any(|o| name.contains(o.as_str())) {
            println!("{name}");
            let started = Instant::now();
            check();
            println!("  ok ({:.1} s)", started.elapsed().as_secs_f64());
        }
    }
}
