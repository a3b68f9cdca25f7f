//! Real Envoys (`$ENVOY_BIN`, 1.40, two workers each) with Envoy's own rate
//! limit quota filter (`envoy.filters.http.rate_limit_quota`) reporting to
//! the real `floodgate-quota` binary, configured by the shipped example
//! (`examples/envoy-rlqs.yaml` and `examples/rlqs-limits.yaml`, ports
//! swapped for free ones): three Envoys, one bucket per tenant at 50 a
//! second, a tenant at 3× its limit skewed 70/20/10 over the Envoys and one
//! at half its limit. After two report intervals the fleet admits, per 5 s
//! span, 0.85–1.10 of the limit; demand moved from one Envoy to another is
//! followed within two intervals; the tenant below its limit is never
//! denied while the service serves; two service instances on one Redis hold the same bound; a killed
//! service gives the example's fall-back (10 a second per Envoy) once the
//! assignments expire, and the shares come back after a restart. The two
//! scenarios run side by side, so the whole takes about as long as the
//! longer one (some 90 s: the report interval is 5 s whatever Envoy is told).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use floodgate_e2e::{free_port, Conn, Envoy, QuotaServer};

/// The limit of a tenant in the example's limits file, a second.
const LIMIT: f64 = 50.0;
/// Envoy 1.40's report interval.
const INTERVAL: u64 = 5;

fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples").join(name)
}

/// The example bootstrap with its ports replaced; each must occur once.
fn bootstrap(listener: u16, admin: u16, grpc: u16, backend: u16) -> String {
    let mut text = std::fs::read_to_string(example("envoy-rlqs.yaml")).unwrap();
    for (from, port) in [
        ("port_value: 10000}", listener),
        ("port_value: 9901}", admin),
        ("port_value: 8082}", grpc),
        ("port_value: 8080}", backend),
    ] {
        assert_eq!(text.matches(from).count(), 1, "{from} in the example");
        text = text.replace(from, &format!("port_value: {port}}}"));
    }
    text
}

/// The binary with the example limits, RLQS on `grpc`, on `store`.
fn quota(grpc: u16, store: &str) -> QuotaServer {
    let limits = std::fs::read_to_string(example("rlqs-limits.yaml")).unwrap();
    QuotaServer::start_with(&limits, store, &["--grpc-listen", &format!("127.0.0.1:{grpc}")])
}

/// A plain HTTP backend answering 200 to everything, on its own runtime.
fn backend() -> (tokio::runtime::Runtime, u16) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let port = listener.local_addr().unwrap().port();
    let app = axum::Router::new().fallback(|| async { "backend" });
    runtime.spawn(async move { axum::serve(listener, app).await });
    (runtime, port)
}

/// One answer: when (since the load started), through which Envoy, for
/// which tenant, admitted or not.
#[derive(Debug, Clone, Copy)]
struct Answer {
    at: Duration,
    envoy: usize,
    tenant: usize,
    admitted: bool,
}

/// Steady requests of one tenant through one Envoy at a rate that can be
/// changed (millirequests a second), each answer recorded.
struct Load {
    started: Instant,
    stop: Arc<AtomicBool>,
    rates: Vec<Arc<AtomicU64>>,
    answers: Arc<Mutex<Vec<Answer>>>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl Load {
    /// `rates[envoy][tenant]` requests a second, tenant `i` sent as
    /// `x-tenant: names[i]`.
    fn start(ports: &[u16], names: &'static [&'static str], rates: &[[f64; 2]]) -> Load {
        let started = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let answers = Arc::new(Mutex::new(Vec::new()));
        let mut handles = Vec::new();
        let mut threads = Vec::new();
        for (envoy, port) in ports.iter().copied().enumerate() {
            for (tenant, name) in names.iter().enumerate() {
                let rate = Arc::new(AtomicU64::new((rates[envoy][tenant] * 1000.0) as u64));
                handles.push(Arc::clone(&rate));
                let (stop, answers) = (Arc::clone(&stop), Arc::clone(&answers));
                threads.push(thread::spawn(move || {
                    let mut conn = Conn::open(port).unwrap();
                    let mut next = Instant::now();
                    while !stop.load(Ordering::Relaxed) {
                        let per_second = rate.load(Ordering::Relaxed) as f64 / 1000.0;
                        next += Duration::from_secs_f64(1.0 / per_second.max(0.1));
                        if let Some(wait) = next.checked_duration_since(Instant::now()) {
                            thread::sleep(wait);
                        }
                        let response = match conn.try_request("GET", "/", &[("x-tenant", name.as_bytes())]) {
                            Ok(response) => response,
                            Err(_) => {
                                conn = Conn::open(port).unwrap();
                                continue;
                            }
                        };
                        assert!(matches!(response.status, 200 | 429), "{response:?}");
                        let answer = Answer { at: started.elapsed(), envoy, tenant, admitted: response.status == 200 };
                        answers.lock().unwrap().push(answer);
                    }
                }));
            }
        }
        Load { started, stop, rates: handles, answers, threads }
    }

    /// Sets Envoy `envoy`'s rate of tenant `tenant`.
    fn set(&self, envoy: usize, tenant: usize, per_second: f64) {
        self.rates[envoy * 2 + tenant].store((per_second * 1000.0) as u64, Ordering::Relaxed);
    }

    /// Sleeps until `second` of the load.
    fn until(&self, second: u64) {
        if let Some(wait) = (self.started + Duration::from_secs(second)).checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        }
    }

    /// Admitted requests of `tenant` in `[from, from + INTERVAL)` seconds,
    /// through `envoy` (or all).
    fn admitted(&self, tenant: usize, envoy: Option<usize>, from: u64) -> usize {
        let (from, to) = (Duration::from_secs(from), Duration::from_secs(from + INTERVAL));
        let answers = self.answers.lock().unwrap();
        answers
            .iter()
            .filter(|a| a.tenant == tenant && envoy.is_none_or(|e| a.envoy == e) && a.admitted)
            .filter(|a| a.at >= from && a.at < to)
            .count()
    }

    fn denied(&self, tenant: usize) -> Vec<Answer> {
        self.answers.lock().unwrap().iter().filter(|a| a.tenant == tenant && !a.admitted).copied().collect()
    }

    fn stop(self) -> Vec<Answer> {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads {
            thread.join().unwrap();
        }
        Arc::try_unwrap(self.answers).unwrap().into_inner().unwrap()
    }
}

/// Asserts the fleet's admitted requests of the hot tenant in the spans
/// starting at each of `from` are within 0.85–1.10 of the limit.
fn assert_within_the_bound(load: &Load, what: &str, spans: &[u64]) {
    for &from in spans {
        let admitted = load.admitted(HOT, None, from) as f64;
        let ratio = admitted / (LIMIT * INTERVAL as f64);
        let per_envoy: Vec<usize> = (0..3).map(|e| load.admitted(HOT, Some(e), from)).collect();
        assert!(
            (0.85..=1.10).contains(&ratio),
            "{what}: {admitted} admitted in [{from}, {from}+{INTERVAL}) s, {ratio:.3} of the limit (per Envoy {per_envoy:?})"
        );
    }
}

/// The tenants: 3× the limit, and half of it.
const TENANTS: &[&str] = &["hot", "calm"];
const HOT: usize = 0;
const CALM: usize = 1;

/// Per Envoy: the hot tenant's 150 a second 70/20/10, the calm one's 25.
fn skewed() -> Vec<[f64; 2]> {
    [0.7, 0.2, 0.1].iter().map(|part| [3.0 * LIMIT * part, 0.5 * LIMIT * part]).collect()
}

/// Three Envoys on one service (memory store): shares, demand moved, the
/// fall-back when the service is killed, and the shares back after its
/// restart.
fn one_service(backend: u16) {
    let grpc = free_port();
    let mut service = quota(grpc, "memory");
    let envoys: Vec<Envoy> =
        (0..3).map(|_| Envoy::start_bootstrap(move |port, admin| bootstrap(port, admin, grpc, backend))).collect();
    let ports: Vec<u16> = envoys.iter().map(|e| e.port).collect();
    let load = Load::start(&ports, TENANTS, &skewed());

    // Two report intervals (and a second of slack for the phases): shared.
    load.until(27);
    assert_within_the_bound(&load, "steady", &[12, 17, 22]);
    let before: Vec<usize> = (0..3).map(|e| load.admitted(HOT, Some(e), 22)).collect();
    assert!(before[0] > 3 * before[2], "the shares follow the demand: {before:?}");

    // Demand moves from Envoy 0 to Envoy 2: followed within two intervals.
    load.set(0, HOT, 0.1 * 3.0 * LIMIT);
    load.set(2, HOT, 0.7 * 3.0 * LIMIT);
    load.until(44);
    assert_within_the_bound(&load, "moved", &[39]);
    let after: Vec<usize> = (0..3).map(|e| load.admitted(HOT, Some(e), 39)).collect();
    assert!(after[2] > 3 * after[0], "the shares follow the demand moved: {after:?}");

    // The service killed: the assignments hold their 15 s, then each Envoy
    // falls back to the example's 10 a second (+ its bucket of 10).
    service.kill();
    load.until(67);
    for envoy in 0..3 {
        let admitted = load.admitted(HOT, Some(envoy), 62);
        assert!((40..=62).contains(&admitted), "fall-back of Envoy {envoy}: {admitted} admitted in [62, 67) s");
    }

    // Restarted: the Envoys report again and get their shares back.
    // Within an interval the Envoys report again (their streams reopen),
    // in two more each has its share.
    service.restart();
    load.until(89);
    assert_within_the_bound(&load, "restarted", &[84]);

    // The tenant below its limit is never denied while the service serves
    // (from the kill until the Envoys' first report after the restart,
    // each Envoy's own fall-back of 10 a second rightly denies part of
    // Envoy 0's 17.5).
    let answers = load.stop();
    let outage = Duration::from_secs(44)..Duration::from_secs(67 + INTERVAL + 1);
    let calm_denied: Vec<&Answer> =
        answers.iter().filter(|a| a.tenant == CALM && !a.admitted && !outage.contains(&a.at)).collect();
    assert!(calm_denied.is_empty(), "the tenant below its limit was denied: {calm_denied:?}");
    drop(envoys);
}

/// Two service instances on one Redis, the Envoys split between them: the
/// same bound.
fn two_services_on_redis(backend: u16) {
    let redis = RedisServer::start();
    let store = format!("redis://127.0.0.1:{}/", redis.port);
    let (grpc_a, grpc_b) = (free_port(), free_port());
    let (_a, _b) = (quota(grpc_a, &store), quota(grpc_b, &store));
    let envoys: Vec<Envoy> = [grpc_a, grpc_a, grpc_b]
        .into_iter()
        .map(|grpc| Envoy::start_bootstrap(move |port, admin| bootstrap(port, admin, grpc, backend)))
        .collect();
    let ports: Vec<u16> = envoys.iter().map(|e| e.port).collect();
    let load = Load::start(&ports, TENANTS, &skewed());
    load.until(27);
    assert_within_the_bound(&load, "two instances on one Redis", &[12, 17, 22]);
    assert!(load.denied(CALM).is_empty(), "the tenant below its limit was denied: {:?}", load.denied(CALM));
    load.stop();
}

/// A `redis-server` of this test's own on a free loopback port.
struct RedisServer {
    port: u16,
    child: std::process::Child,
}

impl RedisServer {
    fn start() -> RedisServer {
        let port = free_port();
        let child = std::process::Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server on PATH");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            thread::sleep(Duration::from_millis(20));
        }
        RedisServer { port, child }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn envoys_rate_limit_quota_filter_shares_the_limit() {
    let (_runtime, backend) = backend();
    let one = thread::spawn(move || one_service(backend));
    let two = thread::spawn(move || two_services_on_redis(backend));
    let results = [("one service", one.join()), ("two services on Redis", two.join())];
    for (what, result) in results {
        if let Err(panic) = result {
            std::panic::resume_unwind(Box::new(format!("{what}: {:?}", panic.downcast_ref::<String>())));
        }
    }
}

#[test]
fn the_example_validates() {
    let output = floodgate_e2e::validate(&example("envoy-rlqs.yaml"));
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let text = std::fs::read_to_string(example("envoy-rlqs.yaml")).unwrap();
    let commands: Vec<&str> = text.lines().skip(1).take(2).collect();
    assert!(commands[0].contains("floodgate-quota --config quota/examples/rlqs-limits.yaml --grpc-listen"));
    assert!(commands[1].contains("envoy -c quota/examples/envoy-rlqs.yaml"));
    // Never a token bucket where Envoy 1.40 crashes on one.
    let no_assignment = text.split("no_assignment_behavior:").nth(1).unwrap();
    let until_next = no_assignment.split("expired_assignment_behavior:").next().unwrap();
    assert!(!until_next.contains("token_bucket"), "{until_next}");
}
