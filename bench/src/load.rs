//! Load generators: `wrk` for throughput and latency, and a small closed-loop
//! client on the e2e harness's `Conn` that counts responses per key (for
//! accuracy) or just sends distinct keys (for memory).

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use floodgate_e2e::Conn;
use serde_json::{json, Value};

/// How wrk is run.
#[derive(Clone, Debug)]
pub struct WrkSettings {
    /// The wrk binary.
    pub bin: String,
    /// The Lua script that picks the `x-api-key` of each request.
    pub script: String,
    /// Keep-alive connections.
    pub connections: u32,
    /// wrk threads.
    pub threads: u32,
}

/// One wrk run's summary.
#[derive(Clone, Debug)]
pub struct WrkResult {
    /// Completed requests.
    pub requests: u64,
    /// Wall time of the run, in microseconds.
    pub duration_us: u64,
    /// Median latency, microseconds.
    pub p50_us: u64,
    /// 99th percentile latency, microseconds.
    pub p99_us: u64,
    /// Responses that were not 2xx/3xx (the 429s of a limiting variant).
    pub non_2xx: u64,
    /// Socket errors (connect, read, write, timeout).
    pub socket_errors: u64,
}

impl WrkResult {
    /// Requests per second.
    pub fn rps(&self) -> f64 {
        self.requests as f64 / (self.duration_us.max(1) as f64 / 1e6)
    }

    /// One line for the progress log.
    pub fn summary(&self, id: &str) -> String {
        format!(
            "{id:>2}: {:>9.0} req/s  p50 {:.3} ms  p99 {:.3} ms  non-2xx {}  errors {}",
            self.rps(),
            self.p50_us as f64 / 1000.0,
            self.p99_us as f64 / 1000.0,
            self.non_2xx,
            self.socket_errors
        )
    }

    /// The raw numbers, for the JSON file.
    pub fn to_json(&self) -> Value {
        json!({
            "requests": self.requests, "duration_us": self.duration_us, "rps": self.rps(),
            "p50_us": self.p50_us, "p99_us": self.p99_us,
            "non_2xx": self.non_2xx, "socket_errors": self.socket_errors,
        })
    }
}

/// Runs wrk against `port` for `seconds`, cycling through `keys` API keys,
/// and parses the line the script's `done()` prints.
pub fn wrk(settings: &WrkSettings, port: u16, seconds: u64, keys: u32) -> WrkResult {
    let output = Command::new(&settings.bin)
        .arg(format!("-t{}", settings.threads))
        .arg(format!("-c{}", settings.connections))
        .arg(format!("-d{seconds}s"))
        // A request never takes this long on loopback; the bound keeps a
        // stuck Envoy from stalling the run.
        .args(["--timeout", "5s", "--latency", "-s", &settings.script])
        .arg(format!("http://127.0.0.1:{port}/api/items"))
        .args(["--", &keys.to_string()])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", settings.bin));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("BENCH_RESULT "))
        .unwrap_or_else(|| panic!("wrk printed no result:\n{stdout}\n{}", String::from_utf8_lossy(&output.stderr)));
    let fields: HashMap<&str, u64> = line
        .split_whitespace()
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            Some((k, v.parse().ok()?))
        })
        .collect();
    let get = |k: &str| fields.get(k).copied().unwrap_or(0);
    WrkResult {
        requests: get("requests"),
        duration_us: get("duration_us"),
        p50_us: get("p50_us"),
        p99_us: get("p99_us"),
        non_2xx: get("status_errors"),
        socket_errors: get("connect_errors") + get("read_errors") + get("write_errors") + get("timeouts"),
    }
}

/// Responses to one key.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counts {
    /// 200s.
    pub allowed: u64,
    /// 429s.
    pub limited: u64,
    /// Anything else, and failed requests.
    pub other: u64,
}

impl Counts {
    fn add(&mut self, other: Counts) {
        self.allowed += other.allowed;
        self.limited += other.limited;
        self.other += other.other;
    }
}

/// What a closed-loop run did.
#[derive(Debug, Default)]
pub struct LoadResult {
    /// Per key, when keys were tracked.
    pub per_key: HashMap<String, Counts>,
    /// All responses.
    pub total: Counts,
    /// From the first request sent to the last one sent.
    pub send_span: Duration,
    /// From the first request sent to the last response received: every
    /// decision of the run happened within it.
    pub decision_span: Duration,
    /// Wall time of the whole run.
    pub wall: Duration,
}

/// A closed-loop load: `connections` threads, each with one keep-alive
/// connection, sending `GET /api/items` with `x-api-key: key(connection,
/// sequence)` back to back until `max_requests` have been sent in all or
/// `max_time` has passed, whichever comes first.
pub fn closed_loop(
    port: u16,
    connections: usize,
    max_requests: u64,
    max_time: Duration,
    track_keys: bool,
    key: &(dyn Fn(usize, u64) -> String + Sync),
) -> LoadResult {
    let sent = AtomicU64::new(0);
    let start = Instant::now();
    let deadline = start + max_time;
    // First and last send instants over all threads, as offsets from `start`.
    let first_ns = AtomicU64::new(u64::MAX);
    let last_ns = AtomicU64::new(0);
    let last_response_ns = AtomicU64::new(0);
    let merged = Mutex::new(LoadResult::default());
    std::thread::scope(|scope| {
        for c in 0..connections {
            let (sent, first_ns, last_ns, last_response_ns, merged) =
                (&sent, &first_ns, &last_ns, &last_response_ns, &merged);
            scope.spawn(move || {
                let mut per_key: HashMap<String, Counts> = HashMap::new();
                let mut total = Counts::default();
                let mut conn = Conn::open(port).ok();
                let mut seq = 0u64;
                while Instant::now() < deadline && sent.fetch_add(1, Ordering::Relaxed) < max_requests {
                    let k = key(c, seq);
                    seq += 1;
                    let at = start.elapsed().as_nanos() as u64;
                    first_ns.fetch_min(at, Ordering::Relaxed);
                    last_ns.fetch_max(at, Ordering::Relaxed);
                    let status = match conn.as_mut() {
                        Some(open) => open.try_request("GET", "/api/items", &[("x-api-key", k.as_bytes())]).ok(),
                        None => None,
                    }
                    .map(|r| r.status);
                    last_response_ns.fetch_max(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    let counts = match status {
                        Some(200) => Counts { allowed: 1, ..Counts::default() },
                        Some(429) => Counts { limited: 1, ..Counts::default() },
                        other => {
                            // A broken connection is replaced, so one error
                            // does not end this connection's share of the load.
                            if other.is_none() {
                                conn = Conn::open(port).ok();
                            }
                            Counts { other: 1, ..Counts::default() }
                        }
                    };
                    total.add(counts);
                    if track_keys {
                        per_key.entry(k).or_default().add(counts);
                    }
                }
                let mut m = merged.lock().unwrap();
                m.total.add(total);
                for (k, v) in per_key {
                    m.per_key.entry(k).or_default().add(v);
                }
            });
        }
    });
    let mut result = merged.into_inner().unwrap();
    let (first, last, last_response) = (first_ns.into_inner(), last_ns.into_inner(), last_response_ns.into_inner());
    let first = if first == u64::MAX { last } else { first };
    result.send_span = Duration::from_nanos(last.saturating_sub(first));
    result.decision_span = Duration::from_nanos(last_response.saturating_sub(first));
    result.wall = start.elapsed();
    result
}

/// Checks that the wrk script exists (a clearer message than wrk's).
pub fn check_script(script: &str) {
    assert!(Path::new(script).exists(), "wrk script {script} is missing");
}
