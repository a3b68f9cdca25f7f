//! End to end, global mode for the long tail: three real Envoys
//! (two workers each) and the real quota service on loopback, hundreds of
//! per-user keys at a few requests a second each, spread over the Envoys as
//! a load balancer spreads them, under per-second and per-minute fixed
//! windows. Every admission is logged with its user and instant, and counted
//! window by window.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use floodgate_core::rng::Rng;
use floodgate_e2e::{AdmissionLog, Conn, Envoy, QuotaServer, RedisServer, Setup};

/// Per user: 40 a second and 600 a minute, fixed windows (the limits
/// file's default algorithm); `user_s=hot` and `user_m=hot` alike.
const LIMITS: &str = "domain: edge
descriptors:
  - key: user_s
    rate_limit: {unit: second, requests_per_unit: 40}
  - key: user_m
    rate_limit: {unit: minute, requests_per_unit: 600}
  - key: user_thin
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: user_b
    rate_limit: {unit: second, requests_per_unit: 40, algorithm: token_bucket, burst: 40}
";

/// Both rules key on the `x-user` header, each under its own descriptor key.
const PLUGIN: &str = r#"{"rules": [
    {"name": "per-second", "scope": "global", "fallback": "deny",
     "descriptors": [{"request_headers": {"header_name": "x-user", "descriptor_key": "user_s"}}]},
    {"name": "per-minute", "scope": "global", "fallback": "deny",
     "descriptors": [{"request_headers": {"header_name": "x-user", "descriptor_key": "user_m"}}]}],
  "global": {"cluster": "floodgate-quota", "domain": "edge", "timeout": "500ms", "max_wait": "300ms"}}"#;

/// The per-second rule alone.
const PLUGIN_SECOND: &str = r#"{"rules": [
    {"name": "per-second", "scope": "global", "fallback": "deny",
     "descriptors": [{"request_headers": {"header_name": "x-user", "descriptor_key": "user_s"}}]}],
  "global": {"cluster": "floodgate-quota", "domain": "edge", "timeout": "500ms", "max_wait": "300ms"}}"#;

/// A rule with an overshoot budget of 1 a second per key and Envoy.
const PLUGIN_OVERSHOOT: &str = r#"{"rules": [
    {"name": "thin", "scope": "global", "fallback": "deny", "overshoot": {"limit": 1, "period": "1s"},
     "descriptors": [{"request_headers": {"header_name": "x-user", "descriptor_key": "user_thin"}}]}],
  "global": {"cluster": "floodgate-quota", "domain": "edge", "timeout": "500ms", "max_wait": "300ms"}}"#;

/// A per-user token bucket (40 a second, burst 40).
const PLUGIN_BUCKET: &str = r#"{"rules": [
    {"name": "bucket", "scope": "global", "fallback": "deny",
     "descriptors": [{"request_headers": {"header_name": "x-user", "descriptor_key": "user_b"}}]}],
  "global": {"cluster": "floodgate-quota", "domain": "edge", "timeout": "500ms", "max_wait": "300ms"}}"#;

const USERS: usize = 300;
/// Requests a second each client thread sends; two threads an Envoy.
const PER_THREAD: u64 = 150;

/// Three Envoys running `plugin` against the service on `port`, each
/// logging its admissions, with the user (`x-user`), to a file of its own
/// named by `label`, and calling the service from an address of its own
/// (127.0.0.11 to .13), as a fleet's Envoys do: the service tells its
/// callers apart by address, and bounds what one caller's allowances hold
/// of a key (on 127.0.0.1 alike, the three would be one caller sharing
/// one caller's share). The logs, the Envoys and their ports.
fn logged_envoys(label: &str, plugin: &str, port: u16) -> (Vec<AdmissionLog>, Vec<Envoy>, Vec<u16>) {
    let logs: Vec<AdmissionLog> = (0..3)
        .map(|i| {
            let path = std::env::temp_dir().join(format!("floodgate-{label}-{}-{i}.log", std::process::id()));
            AdmissionLog::new(&path, Some("x-user"))
        })
        .collect();
    let envoys: Vec<Envoy> = logs
        .iter()
        .enumerate()
        .map(|(i, log)| {
            let mut setup = Setup::new(plugin)
                .with_cluster("floodgate-quota", &[port])
                .with_source_address(&format!("127.0.0.{}", 11 + i));
            setup.manager_fields.insert("access_log".into(), log.access_log());
            Envoy::start(&setup)
        })
        .collect();
    let ports = envoys.iter().map(|e| e.port).collect();
    (logs, envoys, ports)
}

/// `(instant ns, user)` of every admission in the logs.
fn admissions(logs: &[AdmissionLog]) -> Vec<(u64, String)> {
    logs.iter()
        .flat_map(AdmissionLog::read)
        .map(|admission| (admission.at_ns, admission.header.expect("the user is logged")))
        .collect()
}

/// Admissions per (user, window of `window_ns`).
fn per_window(admitted: &[(u64, String)], window_ns: u64) -> HashMap<(String, u64), u64> {
    let mut counts = HashMap::new();
    for (at, user) in admitted {
        *counts.entry((user.clone(), at / window_ns)).or_default() += 1;
    }
    counts
}

/// What a paced load saw.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    admitted: u64,
    limited: u64,
    other: u64,
}

impl Seen {
    fn add(self, other: Seen) -> Seen {
        Seen {
            admitted: self.admitted + other.admitted,
            limited: self.limited + other.limited,
            other: self.other + other.other,
        }
    }
}

/// Two threads to each Envoy of `ports`, each sending [`PER_THREAD`]
/// requests a second for `run_for`, each request's user picked by `user`
/// (from a per-thread random number): paced, as a load balancer's share of
/// many clients' traffic.
fn paced(ports: &[u16], run_for: Duration, user: fn(u64) -> String) -> Seen {
    let stop = Arc::new(AtomicBool::new(false));
    let handles: Vec<_> = ports
        .iter()
        .flat_map(|port| [(*port, 0u64), (*port, 1)])
        .enumerate()
        .map(|(n, (port, _))| {
            let stop = Arc::clone(&stop);
            thread::spawn(move || {
                let mut conn = Conn::open(port).unwrap();
                let mut seen = Seen::default();
                // Odd, so never the generator's one stuck state.
                let mut random =
                    Rng::new((0x9e37_79b9_7f4a_7c15u64 ^ (n as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9)) | 1);
                let period = Duration::from_nanos(1_000_000_000 / PER_THREAD);
                let mut next = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    let name = user(random.next_u64());
                    match conn.try_request("GET", "/", &[("x-user", name.as_bytes())]) {
                        Ok(r) if r.status == 200 => seen.admitted += 1,
                        Ok(r) if r.status == 429 => seen.limited += 1,
                        Ok(_) | Err(_) => {
                            seen.other += 1;
                            conn = Conn::open(port).unwrap();
                        }
                    }
                    next += period;
                    if let Some(wait) = next.checked_duration_since(Instant::now()) {
                        thread::sleep(wait);
                    }
                }
                seen
            })
        })
        .collect();
    thread::sleep(run_for);
    stop.store(true, Ordering::Relaxed);
    handles.into_iter().map(|h| h.join().unwrap()).fold(Seen::default(), Seen::add)
}

/// One load of `secs` over `ports`, never paused (a pause lets the pools'
/// allowances lapse, and their next rate observation spans it), and what
/// the fleet counted after its first 5 s, the warm-up in which every (user,
/// Envoy) pair's first request waits for its first lease (the counters are
/// read then as they stand, without waiting for them to settle): requests,
/// those that waited and the callouts, printed under `label`. Returns what
/// the load saw, how long it ran (s) and the requests after the warm-up.
fn steady_load(label: &str, envoys: &[Envoy], ports: &[u16], secs: u64, user: fn(u64) -> String) -> (Seen, f64, u64) {
    let started = Instant::now();
    let load = {
        let ports = ports.to_vec();
        thread::spawn(move || paced(&ports, Duration::from_secs(secs), user))
    };
    thread::sleep(Duration::from_secs(5));
    let counters = ["global.refill_waits", "global.callouts_sent", "allowed", "limited"];
    let warm: Vec<u64> = counters.iter().map(|name| total_now(envoys, name)).collect();
    let seen = load.join().unwrap();
    let ran = started.elapsed().as_secs_f64();
    let steady: Vec<u64> = counters.iter().zip(&warm).map(|(name, warm)| total(envoys, name) - warm).collect();
    let (waited, calls, requests) = (steady[0], steady[1], steady[2] + steady[3]);
    eprintln!(
        "{label}: {seen:?}; after the first 5 s, {requests} requests: {waited} waited ({:.3} %), {calls} callouts ({:.4} a request)",
        100.0 * waited as f64 / requests as f64,
        calls as f64 / requests as f64
    );
    (seen, ran, requests)
}

fn many_users(random: u64) -> String {
    format!("user-{}", random % USERS as u64)
}

/// The fleet's sums of a counter of the filter, as the Envoys have them now.
fn total_now(envoys: &[Envoy], name: &str) -> u64 {
    envoys.iter().map(|e| e.filter_stat_now(name)).sum()
}

/// The fleet's sums of a counter of the filter, once settled.
fn total(envoys: &[Envoy], name: &str) -> u64 {
    envoys.iter().map(|e| e.filter_stat(name)).sum()
}

fn second_of(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap().as_secs()
}

/// Hundreds of users at about 3 requests a second each (1 a second at each
/// Envoy), far below their limits: none is denied, and counted window by
/// window, no user ever passes either limit, though each Envoy holds
/// allowances for many windows. The service restarted mid-run (Redis keeps
/// the counts): nothing over the limit, and no request fails. The share of
/// requests that waited and the callouts per request are printed.
fn long_tail(store: &str, restart: bool) {
    let mut service = QuotaServer::start(LIMITS, store);
    let (logs, envoys, ports) = logged_envoys(&format!("long-tail-{store:.5}"), PLUGIN, service.port);

    let (seen, _, requests) = steady_load(store, &envoys, &ports, 40, many_users);
    if (seen.limited, seen.other) != (0, 0) {
        // A denial here is a fall-back (a failed call), a full queue of
        // paused requests, or a wait past `max_wait`: the message says
        // which rule, which of those, and how calls failed.
        let counts = [
            "rule.per-second.limited",
            "rule.per-minute.limited",
            "rule.per-second.fallback",
            "rule.per-minute.fallback",
            "delay_queue_full",
            "global.refill_waited_out",
            "global.callouts_timeout",
            "global.callouts_refused",
            "global.callouts_not_sent",
            "global.callouts_bad_status",
            "global.callouts_bad_answer",
        ]
        .map(|name| format!("{name} {}", total(&envoys, name)));
        panic!("{store}: far below every limit: {seen:?} ({})", counts.join(", "));
    }
    assert!(requests > 25 * 800, "{store}: the load ran at its pace: {seen:?}");
    if restart {
        // The service goes away for a second and comes back: the pools'
        // allowances still count; what the service decides after is
        // decided with the counts Redis kept.
        let before = total(&envoys, "rule.per-second.fallback");
        let (ports2, down) = (ports.clone(), Duration::from_secs(6));
        let load = thread::spawn(move || paced(&ports2, down, many_users));
        thread::sleep(Duration::from_secs(2));
        service.kill();
        thread::sleep(Duration::from_secs(1));
        service.restart();
        let seen = load.join().unwrap();
        eprintln!(
            "{store}: around the restart {seen:?}; fall-back decided {}",
            total(&envoys, "rule.per-second.fallback") - before
        );
        assert_eq!(seen.other, 0, "{store}: {seen:?}");
    }

    // Counted window by window, by the instant each Envoy admitted.
    thread::sleep(Duration::from_millis(500)); // the access logs' flush
    let admitted = admissions(&logs);
    assert!(admitted.len() as u64 >= seen.admitted, "every admission is logged");
    for (window_ns, limit, what) in [(1_000_000_000u64, 40u64, "second"), (60_000_000_000, 600, "minute")] {
        let counts = per_window(&admitted, window_ns);
        let most = counts.values().max().copied().unwrap_or(0);
        assert!(most <= limit, "{store}: a user passed {limit} a {what}: {most}");
    }
}

/// Holds the suite to one test at a time. Each runs three Envoys of two
/// workers, a quota service and hundreds of paced users: side by side on a
/// 2-core machine they starved each other's callouts past their timeout
/// (37 % of requests waited, and rules fell back to `deny`), which says
/// nothing of the filter and makes the waits and callouts they print
/// meaningless.
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static SUITE: Mutex<()> = Mutex::new(());
    SUITE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[test]
fn the_long_tail_holds_every_limit_memory_store() {
    let _one_at_a_time = one_at_a_time();
    long_tail("memory", false);
}

#[test]
fn the_long_tail_holds_every_limit_redis_and_a_restart() {
    let _one_at_a_time = one_at_a_time();
    let redis = RedisServer::start();
    long_tail(&redis.url(), true);
}

/// One user far above its limit (900 requests a second against 40), spread
/// over three Envoys, then all of it moved to one: within a few seconds
/// that Envoy gets the user's whole share, window by window never more
/// than the limit fleet-wide, and at least 90 % of it used.
#[test]
fn demand_moved_to_one_envoy_gets_the_share_within_a_few_seconds() {
    let _one_at_a_time = one_at_a_time();
    let service = QuotaServer::start(LIMITS, "memory");
    // Held to the end: an Envoy stops when dropped.
    let (logs, _envoys, ports) = logged_envoys("moved", PLUGIN_SECOND, service.port);
    let hot = |_: u64| "hot".to_string();
    // 6 threads at 150 a second: 900 a second of one user, far above 40.
    paced(&ports, Duration::from_secs(4), hot);
    let moved_at = SystemTime::now();
    paced(&ports[..1], Duration::from_secs(8), hot);
    let ended = SystemTime::now();
    thread::sleep(Duration::from_millis(500));

    let admitted = admissions(&logs);
    let counts = per_window(&admitted, 1_000_000_000);
    let most = counts.values().max().copied().unwrap_or(0);
    assert!(most <= 40, "a second passed the limit: {most}");
    // From 3 s after the move: only the one Envoy has demand, and it uses the share.
    let only_one = admissions(&logs[..1]);
    let one = per_window(&only_one, 1_000_000_000);
    for second in (second_of(moved_at) + 3)..second_of(ended) {
        let got = one.get(&("hot".to_string(), second)).copied().unwrap_or(0);
        assert!(got >= 36, "second {second}: the Envoy with all the demand got {got} of 40: {one:?}");
    }
}

/// Thin pairs with an overshoot budget (`{"limit": 1, "period": "1s"}`):
/// 450 users at 2 requests a second each, twice their limit of 1 a second,
/// spread over three Envoys (each sees a user 2/3 of a second apart, about
/// as often as a lease lasts). Requests at a pool without a lease are
/// admitted from the budget instead of waiting, reported, and counted
/// window by window no user passes the README's bound, `limit + E × 1 ×
/// (⌈1 s / 1 s⌉ + 1)` with E = 3 Envoys; the limit still limits.
#[test]
fn an_overshoot_budget_admits_thin_keys_at_once_within_its_bound() {
    let _one_at_a_time = one_at_a_time();
    let service = QuotaServer::start(LIMITS, "memory");
    let (logs, envoys, ports) = logged_envoys("overshoot", PLUGIN_OVERSHOOT, service.port);
    let seen = paced(&ports, Duration::from_secs(10), |random| format!("user-{}", random % 450));
    let (overshoot, waited) = (total(&envoys, "rule.thin.overshoot"), total(&envoys, "global.refill_waits"));
    eprintln!("overshoot: {seen:?}; {overshoot} admitted without a lease, {waited} waited for a lease");
    thread::sleep(Duration::from_millis(500)); // the access logs' flush
    let counts = per_window(&admissions(&logs), 1_000_000_000);
    let most = counts.values().max().copied().unwrap_or(0);
    let bound = 1 + 3 * 2;
    assert!(most <= bound, "a user passed the bound of {bound} in a second: {most}");
    assert!(overshoot > 0, "some requests were admitted without a lease");
    assert!(seen.limited > seen.admitted / 4, "the limit still limits: {seen:?}");
    assert_eq!(seen.other, 0, "{seen:?}");
}

/// The long tail under a token bucket (40 a second, burst 40, per user)
/// on the same load as the fixed windows' (hundreds of users at about 3
/// requests a second, far below their limits): none is denied, none passes
/// `burst + rate × 2 s` in a second. The share of requests that waited and
/// the callouts per request are printed, beside the fixed windows'.
#[test]
fn the_long_tail_under_a_token_bucket_is_never_denied() {
    let _one_at_a_time = one_at_a_time();
    let service = QuotaServer::start(LIMITS, "memory");
    let (logs, envoys, ports) = logged_envoys("bucket-tail", PLUGIN_BUCKET, service.port);
    let (seen, _, _) = steady_load("bucket long tail", &envoys, &ports, 40, many_users);
    assert_eq!((seen.limited, seen.other), (0, 0), "far below every limit: {seen:?}");
    thread::sleep(Duration::from_millis(500)); // the access logs' flush
    let counts = per_window(&admissions(&logs), 1_000_000_000);
    let most = counts.values().max().copied().unwrap_or(0);
    assert!(most <= 40 + 40 * 2, "a user passed burst + rate × 2 s in a second: {most}");
}

/// The long tail under a token bucket (40 a second, burst 40, per user):
/// 300 users at about 3 requests a second, and one user at about 150,
/// spread over three Envoys. The thin users' pairs hold allowances (a
/// share of the refill, slot by slot); the hot user's leases last a
/// lifetime (the service's `--lease-ttl`, 1 s). Over any span `T` the fleet
/// admits at most `burst + rate × (T + 1 s)` of a user: checked for the hot
/// user over the whole run and for every user second by second. The share
/// of requests that waited after the first 5 s is printed (the hot user's,
/// over its limit, wait for the service's pace).
#[test]
fn the_long_tail_under_a_token_bucket_holds_its_bound() {
    let _one_at_a_time = one_at_a_time();
    let service = QuotaServer::start(LIMITS, "memory");
    let (logs, envoys, ports) = logged_envoys("bucket", PLUGIN_BUCKET, service.port);
    // One request in six is the hot user's: about 150 a second.
    let user = |random: u64| if random % 6 == 0 { "hot".to_string() } else { many_users(random / 6) };
    let (seen, secs, _) = steady_load("bucket", &envoys, &ports, 20, user);
    thread::sleep(Duration::from_millis(500)); // the access logs' flush
    let admitted = admissions(&logs);
    let hot = admitted.iter().filter(|(_, user)| user == "hot").count() as f64;
    let bound = 40.0 + 40.0 * (secs + 1.0);
    eprintln!("bucket: the hot user got {hot} (bound {bound:.0})");
    assert!(hot <= bound, "the hot user got {hot}, more than burst + rate × (T + 1 s) = {bound:.0}");
    assert!(hot >= 40.0 * secs * 0.5, "the hot user got its share: {hot} in {secs:.1} s");
    let counts = per_window(&admitted, 1_000_000_000);
    let most = counts.values().max().copied().unwrap_or(0);
    assert!(most <= 40 + 40 * 2, "a user passed burst + rate × 2 s in a second: {most}");
    assert_eq!(seen.other, 0, "{seen:?}");
}
