//! `make fleet-validate`: the fleet simulation checked against real Envoys.
//! Each shape of `floodgate_fleet_sim::validate` runs on this machine — a
//! real `floodgate-quota` (memory store), real Envoys (`--concurrency 2`)
//! loading the wasm filter, paced clients — and in the simulation; the
//! figures are printed side by side: lease calls, leases, return calls,
//! share waited, wait p50/p99, windows over the limit.
//!
//! On the real side, calls and leases are the service's own counts
//! (`floodgate_quota_requests_total`, `floodgate_quota_decisions_total`),
//! requests and waits the Envoys' counters (`allowed`, `limited`,
//! `global.refill_waits`), all read after the warm-up and at the end of
//! the measured span. Every request is logged with when Envoy began to
//! answer it: a request's wait is its time to answer, and the waits are the
//! `refill_waits` longest of them (a request that did not wait is answered
//! in well under a millisecond); windows over are counted per user and
//! second from the same log.
//!
//!     fleet-validate          # both shapes
//!
//! Needs `make wasm`, Envoy (`make deps-envoy`) and the quota service's
//! binary (`FLOODGATE_QUOTA_BIN`, else the debug build).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use floodgate_core::rng::Rng;
use floodgate_e2e::{scratch_dir, Conn, Envoy, QuotaServer, Setup};
use floodgate_fleet_sim::validate::{self, Figures, Shape, SHAPES};
use serde_json::json;

/// The simulation's seed.
const SEED: u64 = 31;

/// One logged request: when Envoy began to answer it (ns since the epoch),
/// how long after its arrival (ns), its status and its user.
#[derive(Debug, Clone)]
struct Logged {
    answered_ns: u64,
    took_ns: u64,
    status: u16,
    user: String,
}

/// An access log of every request to `path`: start, time to answer,
/// status, user.
fn access_log(path: &std::path::Path) -> serde_json::Value {
    json!([{
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": path.display().to_string(),
            "log_format": {"text_format_source": {"inline_string":
                "%START_TIME(%s.%9f)% %COMMON_DURATION(DS_RX_BEG:DS_TX_BEG:ns)% %RESPONSE_CODE% %REQ(X-USER)%\n"}},
        },
    }])
}

fn read_log(path: &std::path::Path) -> Vec<Logged> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split(' ');
            let (start, took, status, user) = (fields.next()?, fields.next()?, fields.next()?, fields.next()?);
            let (secs, nanos) = start.split_once('.')?;
            let took_ns: u64 = took.parse().ok()?;
            let start_ns = secs.parse::<u64>().ok()? * 1_000_000_000 + nanos.parse::<u64>().ok()?;
            Some(Logged { answered_ns: start_ns + took_ns, took_ns, status: status.parse().ok()?, user: user.into() })
        })
        .collect()
}

fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// Two paced client connections to each Envoy (one per worker), each at
/// half the Envoy's rate, each request's user drawn by the shape, until
/// `stop`.
fn paced(shape: Shape, ports: Vec<u16>, stop: Arc<AtomicBool>) -> Vec<thread::JoinHandle<u64>> {
    let per_thread = shape.per_envoy / 2.0;
    ports
        .into_iter()
        .flat_map(|port| [port, port])
        .enumerate()
        .map(|(n, port)| {
            let stop = Arc::clone(&stop);
            thread::spawn(move || {
                let mut conn = Conn::open(port).unwrap();
                let mut random =
                    Rng::new((0x9e37_79b9_7f4a_7c15u64 ^ (n as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9)) | 1);
                let period = Duration::from_secs_f64(1.0 / per_thread);
                let mut next = Instant::now();
                let mut failed = 0;
                while !stop.load(Ordering::Relaxed) {
                    let user = shape.user(random.next_u64());
                    match conn.try_request("GET", "/", &[("x-user", user.as_bytes())]) {
                        Ok(r) if r.status == 200 || r.status == 429 => {}
                        Ok(_) | Err(_) => {
                            failed += 1;
                            conn = Conn::open(port).unwrap();
                        }
                    }
                    next += period;
                    if let Some(wait) = next.checked_duration_since(Instant::now()) {
                        thread::sleep(wait);
                    }
                }
                failed
            })
        })
        .collect()
}

/// The counters read at one instant: the service's lease calls, return
/// calls and leases; the fleet's requests and waits.
#[derive(Debug, Clone, Copy, Default)]
struct Counters {
    at_ns: u64,
    lease_calls: f64,
    return_calls: f64,
    leases: f64,
    requests: f64,
    waited: f64,
}

fn counters(service: &QuotaServer, envoys: &[Envoy]) -> Counters {
    let fleet = |name: &str| -> f64 {
        envoys
            .iter()
            .map(|e| e.stats_now().get(&format!("wasmcustom.floodgate.{name}")).copied().unwrap_or(0) as f64)
            .sum()
    };
    // The filter hands its counts to Envoy on each worker's tick (100 ms).
    thread::sleep(Duration::from_millis(250));
    let at_ns = now_ns();
    Counters {
        at_ns,
        lease_calls: service.requests("lease") as f64,
        return_calls: service.requests("return") as f64,
        leases: service.metric("floodgate_quota_decisions_total", &["kind=\"lease\""]),
        requests: fleet("allowed") + fleet("limited"),
        waited: fleet("global.refill_waits"),
    }
}

/// Runs `shape` on real Envoys: the figures of its measured span.
fn real(shape: &Shape) -> Result<Figures, String> {
    // On loopback every Envoy is 127.0.0.1, one caller to the service, and
    // one caller's allowances of a key are bounded as one (a quarter of a
    // window's limit): 28 % of requests waited on three Envoys, against
    // 0.4 % with callers not told apart. The simulation's Envoys are a
    // fleet's, each its own address: so are the real ones here.
    let service = QuotaServer::start_with(&shape.limits(), "memory", &["--callers", "none"]);
    let dir = scratch_dir();
    let logs: Vec<PathBuf> = (0..shape.envoys).map(|i| dir.join(format!("envoy-{i}.log"))).collect();
    let envoys: Vec<Envoy> = logs
        .iter()
        .map(|log| {
            let mut setup =
                Setup::new(&shape.plugin("floodgate-quota")).with_cluster("floodgate-quota", &[service.port]);
            setup.manager_fields.insert("access_log".into(), access_log(log));
            Envoy::start(&setup)
        })
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let load = paced(*shape, envoys.iter().map(|e| e.port).collect(), Arc::clone(&stop));
    thread::sleep(Duration::from(shape.warmup).saturating_sub(Duration::from_millis(250)));
    let before = counters(&service, &envoys);
    let end = Duration::from(shape.warmup + shape.measure);
    thread::sleep(end.saturating_sub(started.elapsed()).saturating_sub(Duration::from_millis(250)));
    let after = counters(&service, &envoys);
    stop.store(true, Ordering::Relaxed);
    let failed: u64 = load.into_iter().map(|h| h.join().unwrap_or(1)).sum();
    if failed > 0 {
        return Err(format!("{failed} requests got neither 200 nor 429"));
    }
    thread::sleep(Duration::from_millis(500)); // the access logs' flush
    let secs = (after.at_ns - before.at_ns) as f64 / 1e9;
    let logged: Vec<Logged> = logs
        .iter()
        .flat_map(|log| read_log(log))
        .filter(|l| before.at_ns <= l.answered_ns && l.answered_ns < after.at_ns)
        .collect();
    let waited = after.waited - before.waited;
    let mut took: Vec<u64> = logged.iter().map(|l| l.took_ns).collect();
    took.sort_unstable_by(|a, b| b.cmp(a));
    let waits: Vec<u64> = took.into_iter().take(waited as usize).collect();
    // Longest first: p99 is near the front, p50 in the middle.
    let quantile = |p: f64| -> f64 {
        let at = ((waits.len() as f64 - 1.0) * (1.0 - p)).round().max(0.0) as usize;
        waits.get(at).map_or(0.0, |&ns| ns as f64 / 1e6)
    };
    let mut windows: HashMap<(&str, u64), u64> = HashMap::new();
    for l in logged.iter().filter(|l| l.status == 200) {
        *windows.entry((l.user.as_str(), l.answered_ns / 1_000_000_000)).or_default() += 1;
    }
    let windows_over = windows.values().filter(|&&n| n > shape.limit).count() as u64;
    let hot = logged.iter().filter(|l| l.status == 200 && l.user == "hot").count() as f64;
    let requests = after.requests - before.requests;
    Ok(Figures {
        requests: requests / secs,
        lease_calls: (after.lease_calls - before.lease_calls) / secs,
        leases: (after.leases - before.leases) / secs,
        return_calls: (after.return_calls - before.return_calls) / secs,
        waited: waited / requests.max(1.0),
        wait_p50: quantile(0.5),
        wait_p99: quantile(0.99),
        windows_over,
        hot_admitted: hot / secs,
    })
}

fn row(label: &str, real: f64, sim: f64, digits: usize) -> String {
    let diff = if real.abs() > 1e-9 { format!("{:+.0} %", 100.0 * (sim / real - 1.0)) } else { "–".into() };
    format!("| {label} | {real:.digits$} | {sim:.digits$} | {diff} |")
}

fn main() -> Result<(), String> {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("# fleet-validate\n\nLoad average at the start: {}\n", load.trim());
    for shape in SHAPES {
        let started = Instant::now();
        let real = real(&shape)?;
        let (sim, _) = validate::simulated(&shape, SEED)?;
        eprintln!("fleet-validate: {} Envoys in {:.0} s", shape.envoys, started.elapsed().as_secs_f64());
        println!(
            "## {} Envoys × 2 workers, {:.0} requests/s each: {} users at {:.2}/s, one at {:.0}/s, limits {}/s; {} s warm-up, {} s measured\n",
            shape.envoys,
            shape.per_envoy,
            shape.users,
            shape.user_rate(),
            shape.fleet_rate() * shape.hot_share,
            shape.limit,
            shape.warmup.as_secs_f64(),
            shape.measure.as_secs_f64(),
        );
        println!("| figure | real | simulated | simulated − real |\n|---|---:|---:|---:|");
        println!("{}", row("requests/s", real.requests, sim.requests, 0));
        println!("{}", row("lease calls/s", real.lease_calls, sim.lease_calls, 1));
        println!("{}", row("leases/s", real.leases, sim.leases, 1));
        println!("{}", row("return calls/s", real.return_calls, sim.return_calls, 2));
        println!("{}", row("share waited, %", 100.0 * real.waited, 100.0 * sim.waited, 2));
        println!("{}", row("wait p50, ms", real.wait_p50, sim.wait_p50, 2));
        println!("{}", row("wait p99, ms", real.wait_p99, sim.wait_p99, 2));
        println!("{}", row("hot user admitted/s", real.hot_admitted, sim.hot_admitted, 1));
        println!("| windows over the limit | {} | {} | |\n", real.windows_over, sim.windows_over);
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("Load average at the end: {}", load.trim());
    Ok(())
}
