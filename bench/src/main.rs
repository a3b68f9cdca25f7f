//! Floodgate's benchmark (issue 4): per-request cost against no filter,
//! Envoy's own `local_ratelimit` and a no-op wasm filter; accuracy under load
//! on both workers; memory with a million distinct clients. Prints markdown
//! tables and writes the raw numbers as JSON. It measures and reports; it
//! asserts nothing about time.
//!
//! Run it through `make -f bench/bench.mk filter-bench` (or `filter-bench-quick`);
//! the environment variables it reads are listed in [`Settings::from_env`].

// A benchmark binary: a failed set-up step should stop the run loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod envoy;
mod load;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use envoy::{Envoy, EnvoyBucket, Filters, Paths, QuotaService, HOT_KEY};
use load::{closed_loop, wrk, LoadResult, WrkResult, WrkSettings};
use serde_json::{json, Value};

/// Everything a run can be told through the environment.
#[derive(Clone, Debug)]
struct Settings {
    paths: Paths,
    wrk: WrkSettings,
    /// Throughput rounds (each runs every variant once).
    rounds: usize,
    /// Seconds of load per variant per round.
    duration: u64,
    /// Seconds of warm-up load per Envoy before the first round.
    warmup: u64,
    /// Seconds of load per accuracy case.
    accuracy_secs: u64,
    /// Connections of the accuracy load.
    accuracy_connections: usize,
    /// Distinct keys sent in the memory run.
    memory_keys: u64,
    /// Connections of the memory load.
    memory_connections: usize,
    /// Upper bound on the memory run's duration, in seconds.
    memory_max_secs: u64,
    /// Which parts run: any of `throughput`, `accuracy`, `memory`.
    parts: Vec<String>,
    /// Which throughput variants run, by id (see [`variants`]).
    variants: Vec<String>,
    /// Where the JSON goes.
    results_dir: PathBuf,
}

/// A comma-separated list from the environment.
fn list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or(default.to_string())
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v.trim().parse().unwrap_or_else(|_| panic!("{name}={v:?} is not valid")),
        _ => default,
    }
}

impl Settings {
    /// Reads `ENVOY_BIN`, `FLOODGATE_WASM`, `NOOP_WASM`, `QUOTA_BIN`, `WRK_BIN`,
    /// `BENCH_ROUNDS` (5), `BENCH_DURATION` (5 s), `BENCH_WARMUP` (2 s),
    /// `BENCH_CONNECTIONS` (16), `BENCH_THREADS` (2), `BENCH_ACCURACY_SECS`
    /// (5), `BENCH_ACCURACY_CONNECTIONS` (32), `BENCH_MEMORY_KEYS`
    /// (1,000,000), `BENCH_MEMORY_CONNECTIONS` (16), `BENCH_MEMORY_MAX_SECS`
    /// (300), `BENCH_QUOTA_UNIT` (`second`), `BENCH_PARTS` (`throughput,accuracy,memory`), `BENCH_VARIANTS`
    /// ([`DEFAULT_VARIANTS`]; the diagnostic variants `g`, `h`, `gkt` and the
    /// host-call probes `pt`, `ph`, `pm`, `pg`, `ps`, `pr` are opt-in) and
    /// `BENCH_RESULTS_DIR` (`bench/results`). Relative paths are taken from
    /// the repository root.
    fn from_env() -> Settings {
        let root = repo_root();
        let path = |var: &str, default: &str| {
            let p = PathBuf::from(std::env::var(var).ok().filter(|v| !v.is_empty()).unwrap_or(default.to_string()));
            if p.is_absolute() {
                p
            } else {
                root.join(p)
            }
        };
        let scratch = std::env::temp_dir().join(format!("floodgate-bench-{}", std::process::id()));
        std::fs::create_dir_all(&scratch).unwrap();
        Settings {
            paths: Paths {
                envoy: std::env::var("ENVOY_BIN").ok().filter(|v| !v.is_empty()).unwrap_or("envoy".into()),
                floodgate_wasm: path("FLOODGATE_WASM", "target/wasm32-wasip1/release/floodgate.wasm"),
                noop_wasm: path("NOOP_WASM", "target/wasm32-wasip1/release/floodgate_bench_noop.wasm"),
                probe_wasm: path("PROBE_WASM", "target/wasm32-wasip1/release/floodgate_bench_probe.wasm"),
                quota_bin: path("QUOTA_BIN", "target/release/floodgate-quota"),
                scratch,
                quota_unit: std::env::var("BENCH_QUOTA_UNIT").ok().filter(|v| !v.is_empty()).unwrap_or("second".into()),
            },
            wrk: WrkSettings {
                bin: std::env::var("WRK_BIN").ok().filter(|v| !v.is_empty()).unwrap_or("wrk".into()),
                script: root.join("bench/wrk.lua").display().to_string(),
                connections: env_or("BENCH_CONNECTIONS", 16),
                threads: env_or("BENCH_THREADS", 2),
            },
            rounds: env_or("BENCH_ROUNDS", 5),
            duration: env_or("BENCH_DURATION", 5),
            warmup: env_or("BENCH_WARMUP", 2),
            accuracy_secs: env_or("BENCH_ACCURACY_SECS", 5),
            accuracy_connections: env_or("BENCH_ACCURACY_CONNECTIONS", 32),
            memory_keys: env_or("BENCH_MEMORY_KEYS", 1_000_000),
            memory_connections: env_or("BENCH_MEMORY_CONNECTIONS", 16),
            memory_max_secs: env_or("BENCH_MEMORY_MAX_SECS", 300),
            parts: list("BENCH_PARTS", "throughput,accuracy,memory"),
            variants: list("BENCH_VARIANTS", DEFAULT_VARIANTS),
            results_dir: path("BENCH_RESULTS_DIR", "bench/results"),
        }
    }

    /// The settings that shape the numbers, as `NAME=value` pairs.
    fn describe(&self) -> Vec<(&'static str, String)> {
        vec![
            ("BENCH_PARTS", self.parts.join(",")),
            ("BENCH_VARIANTS", self.variants.join(",")),
            ("BENCH_ROUNDS", self.rounds.to_string()),
            ("BENCH_DURATION", self.duration.to_string()),
            ("BENCH_WARMUP", self.warmup.to_string()),
            ("BENCH_CONNECTIONS", self.wrk.connections.to_string()),
            ("BENCH_THREADS", self.wrk.threads.to_string()),
            ("BENCH_ACCURACY_SECS", self.accuracy_secs.to_string()),
            ("BENCH_ACCURACY_CONNECTIONS", self.accuracy_connections.to_string()),
            ("BENCH_MEMORY_KEYS", self.memory_keys.to_string()),
            ("BENCH_MEMORY_CONNECTIONS", self.memory_connections.to_string()),
            ("BENCH_MEMORY_MAX_SECS", self.memory_max_secs.to_string()),
            ("BENCH_QUOTA_UNIT", self.paths.quota_unit.clone()),
        ]
    }

    fn runs(&self, part: &str) -> bool {
        self.parts.iter().any(|p| p == part)
    }
}

/// The repository root (this crate lives in `bench/`).
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

// ---------------------------------------------------------------- variants

/// The per-key descriptor every Floodgate rule here uses, like Envoy's
/// `request_headers` action of variant (b).
const PER_KEY: &str = r#"[{"request_headers": {"header_name": "x-api-key", "descriptor_key": "api_key"}}]"#;

/// Key and path: a second per-client rule for variant (f).
const PER_KEY_AND_PATH: &str = r#"[{"request_headers": {"header_name": "x-api-key", "descriptor_key": "api_key"}},
    {"request_headers": {"header_name": ":path", "descriptor_key": "path"}}]"#;

/// A Floodgate rule that never limits: 10⁹ per second, burst 10⁹, per key.
fn never_limiting_rule(name: &str, descriptors: &str) -> String {
    format!(r#"{{"name": "{name}", "descriptors": {descriptors}, "limit": 1000000000, "period": "1s"}}"#)
}

/// Calls per request of each host-call probe variant.
const PROBE_REPEATS: u32 = 10;

/// The variants issue 4 asks for, Envoy's global filter against the quota
/// service with its ceiling (issue 10), and Floodgate's global mode with its
/// local references (issue 7).
const DEFAULT_VARIANTS: &str = "a,b,c,d,d2,e,f,u,r,dk,gk,i,gl,gc";

/// The API keys wrk cycles through, and how many the many-keys variants use.
const KEYS: u32 = 16;
const MANY_KEYS: u32 = 1000;

/// The API keys wrk cycles through for variant `id`.
fn keys_of(id: &str) -> u32 {
    if matches!(id, "dk" | "gk" | "gkt") {
        MANY_KEYS
    } else {
        KEYS
    }
}

/// The Floodgate global-mode variants (floodgate-quota must run for them).
const GLOBAL_MODE: [&str; 4] = ["gk", "gkt", "gl", "gc"];

/// The lease lifetime of the opt-in variant (gkt): the service's
/// `--lease-ttl` and the rule's `lease_horizon`.
const LONG_LEASE: &str = "10s";

/// Where the proxied variants send requests (an upstream Envoy), and
/// floodgate-quota's gRPC and HTTP ports (and the HTTP port of the instance
/// with [`LONG_LEASE`] leases); 0 when no variant needs them.
#[derive(Clone, Copy, Debug, Default)]
struct Global {
    upstream: u16,
    grpc: u16,
    quota_http: u16,
    long_lease_http: u16,
}

/// A Floodgate global rule named `name` in `mode`, asking floodgate-quota on
/// `quota` (domain `bench`, default timeouts, plus `global_extra` fields of
/// the `global` section). Its limit is the service's; with fallback `deny`,
/// a decision the service could not make shows as a 429.
fn global_rule(quota: u16, name: &str, mode: &str, descriptors: &str, global_extra: &str) -> Filters {
    Filters::FloodgateGlobal {
        config: format!(
            r#"{{"rules": [{{"name": "{name}", "scope": "global", "mode": "{mode}", "fallback": "deny",
                 "descriptors": {descriptors}}}],
               "global": {{"cluster": "floodgate-quota", "domain": "bench"{global_extra}}}}}"#
        ),
        quota,
    }
}

/// Every throughput variant, in the order they run each round: the issue's
/// (a)–(f), then diagnostic ones that split Floodgate's cost (opt-in with
/// `BENCH_VARIANTS`).
fn variants(global: Global) -> Vec<(&'static str, &'static str, Filters)> {
    let per_key = never_limiting_rule("per-api-key", PER_KEY);
    let probe = |call: &str| Filters::Probe(format!("{call}={PROBE_REPEATS}"));
    let hot_key =
        format!(r#"[{{"generic_key": {{"descriptor_key": "{}", "descriptor_value": "{}"}}}}]"#, HOT_KEY.0, HOT_KEY.1);
    vec![
        ("a", "no rate-limit filter", Filters::None),
        (
            "b",
            "Envoy local_ratelimit, per key, never limits",
            Filters::EnvoyLocal(EnvoyBucket {
                max_tokens: 1_000_000_000,
                tokens_per_fill: 1_000_000_000,
                fill_interval: "1s",
            }),
        ),
        ("c", "no-op wasm filter", Filters::Noop),
        ("d", "Floodgate, per key, never limits", Filters::Floodgate(format!(r#"{{"rules": [{per_key}]}}"#))),
        (
            "d2",
            "Floodgate as (d), no headers on allowed",
            Filters::Floodgate(format!(r#"{{"rules": [{per_key}], "response": {{"headers_on_allowed": false}}}}"#)),
        ),
        (
            "e",
            "Floodgate, per key, limits most (10/s per key)",
            Filters::Floodgate(format!(
                r#"{{"rules": [{{"name": "per-api-key", "descriptors": {PER_KEY}, "limit": 10, "period": "1s"}}]}}"#
            )),
        ),
        (
            "f",
            "Floodgate, three rules on each request",
            Filters::Floodgate(format!(
                r#"{{"rules": [{per_key}, {}, {}]}}"#,
                never_limiting_rule("per-key-and-path", PER_KEY_AND_PATH),
                never_limiting_rule("whole-site", r#"[{"generic_key": {"descriptor_value": "all"}}]"#),
            )),
        ),
        // Envoy's own global rate limit filter, a gRPC call to
        // floodgate-quota (memory store) per request, and its ceiling: both
        // proxy to an upstream Envoy, as the filter needs a route entry.
        ("u", "no filter, proxied to an upstream Envoy", Filters::Routed { upstream: global.upstream }),
        (
            "r",
            "Envoy global ratelimit → floodgate-quota gRPC, per key, never limits",
            Filters::EnvoyGlobal { upstream: global.upstream, grpc: global.grpc },
        ),
        // Floodgate's global mode (issue 7) against floodgate-quota's HTTP
        // API (the process of (r)), the limit in the service's limits file
        // far above the load: the cost of global decisions, not of limiting.
        // Each beside its local reference: (dk) for (gk), (i) for (gl), (gc).
        ("dk", "Floodgate local as (d), 1000 keys", Filters::Floodgate(format!(r#"{{"rules": [{per_key}]}}"#))),
        (
            "gk",
            "Floodgate global, lease, per key (1000 keys)",
            global_rule(global.quota_http, "per-api-key", "lease", PER_KEY, ""),
        ),
        // (i): one bucket for everything: both workers on one shared-data
        // key (host mutex, compare-and-swap conflicts).
        (
            "i",
            "Floodgate, one global bucket (hot key)",
            Filters::Floodgate(format!(
                r#"{{"rules": [{}]}}"#,
                never_limiting_rule("whole-site", r#"[{"generic_key": {"descriptor_value": "all"}}]"#)
            )),
        ),
        (
            "gl",
            "Floodgate global, lease, one hot key",
            global_rule(global.quota_http, "whole-site", "lease", &hot_key, ""),
        ),
        (
            "gc",
            "Floodgate global, check mode, one hot key",
            global_rule(global.quota_http, "whole-site", "check", &hot_key, ""),
        ),
        // Diagnostics. (g): the filter runs but no rule applies — no header
        // read, no hashing, no shared data, one counter: the fixed cost.
        (
            "g",
            "Floodgate, rule never applies (fixed cost)",
            Filters::Floodgate(format!(
                r#"{{"rules": [{{"name": "per-api-key", "match": {{"path_exact": "/never"}}, "descriptors": {PER_KEY},
                     "limit": 1000000000, "period": "1s"}}]}}"#
            )),
        ),
        // (h): as (d2) and no rate-limit headers at all (none on 429s either).
        (
            "h",
            "Floodgate as (d), headers none",
            Filters::Floodgate(format!(r#"{{"rules": [{per_key}], "response": {{"headers": "none"}}}}"#)),
        ),
        // Host-call probes: each repeats one call PROBE_REPEATS times per
        // request; (probe − c) / PROBE_REPEATS is that call's cost.
        ("pt", "probe: 10 × get_current_time", probe("time")),
        ("ph", "probe: 10 × get request header", probe("header")),
        ("pm", "probe: 10 × increment_metric", probe("metric")),
        ("pg", "probe: 10 × get_shared_data", probe("shared_get")),
        ("ps", "probe: 10 × get_shared_data + set_shared_data (cas)", probe("shared_cas")),
        ("pr", "probe: 10 × set response header", probe("response_header")),
        // (gkt): as (gk) with leases living 10 s instead of 1 s (a second
        // service instance): how much of (gk)'s callouts the lifetime causes.
        (
            "gkt",
            "Floodgate global as (gk), leases of 10 s",
            global_rule(
                global.long_lease_http,
                "per-api-key",
                "lease",
                PER_KEY,
                &format!(r#", "lease_horizon": "{LONG_LEASE}""#),
            ),
        ),
    ]
}

// -------------------------------------------------------------- statistics

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// `x / y` to three places, or a dash when a variant was not run.
fn ratio(x: f64, y: f64) -> String {
    let r = x / y;
    if r.is_finite() {
        format!("{r:.3}")
    } else {
        "—".to_string()
    }
}

fn ms(us: f64) -> String {
    format!("{:.3}", us / 1000.0)
}

// -------------------------------------------------------------- throughput

struct VariantResult {
    id: &'static str,
    label: &'static str,
    rounds: Vec<WrkResult>,
    /// Global-mode variants only: the callouts of each round, and of its
    /// second half (the pools' rate estimates have caught up with the load
    /// by then: steady load).
    callouts: Vec<Callouts>,
    callouts_second_half: Vec<Callouts>,
}

/// What a global-mode variant asked the quota service for: the filter's own
/// counters (`wasmcustom.floodgate.global.*`, and the rules' `fallback`
/// decisions), the service's `floodgate_quota_requests_total`, and the
/// requests Envoy received. Read before, in the middle of and after each
/// round; the service's counts include anything idle Envoys of other
/// variants on the same instance sent meanwhile.
#[derive(Clone, Copy, Debug, Default)]
struct Callouts {
    requests: u64,
    sent: u64,
    ok: u64,
    /// Requests that found their pool empty and waited for a refresh, and
    /// how long they waited in all.
    waits: u64,
    wait_ms: u64,
    fallback: u64,
    service_lease: u64,
    service_check: u64,
    service_return: u64,
}

impl Callouts {
    fn read(envoy: &Envoy, quota: &QuotaService) -> Callouts {
        let stats = envoy.stats();
        let stat = |name: &str| stats.get(&format!("wasmcustom.floodgate.global.{name}")).copied().unwrap_or(0);
        let fallback = stats
            .iter()
            .filter(|(name, _)| name.starts_with("wasmcustom.floodgate.rule.") && name.ends_with(".fallback"))
            .map(|(_, v)| v)
            .sum();
        Callouts {
            requests: stats.get("http.bench.downstream_rq_total").copied().unwrap_or(0),
            sent: stat("callouts_sent"),
            ok: stat("callouts_ok"),
            waits: stat("refill_waits"),
            wait_ms: stat("refill_wait_ms"),
            fallback,
            service_lease: quota.requests("lease"),
            service_check: quota.requests("check"),
            service_return: quota.requests("return"),
        }
    }

    /// The counts from `before` to `self`.
    fn since(self, before: Callouts) -> Callouts {
        Callouts {
            requests: self.requests.saturating_sub(before.requests),
            sent: self.sent.saturating_sub(before.sent),
            ok: self.ok.saturating_sub(before.ok),
            waits: self.waits.saturating_sub(before.waits),
            wait_ms: self.wait_ms.saturating_sub(before.wait_ms),
            fallback: self.fallback.saturating_sub(before.fallback),
            service_lease: self.service_lease.saturating_sub(before.service_lease),
            service_check: self.service_check.saturating_sub(before.service_check),
            service_return: self.service_return.saturating_sub(before.service_return),
        }
    }

    fn service(&self) -> u64 {
        self.service_lease + self.service_check + self.service_return
    }

    fn add(self, other: Callouts) -> Callouts {
        Callouts {
            requests: self.requests + other.requests,
            sent: self.sent + other.sent,
            ok: self.ok + other.ok,
            waits: self.waits + other.waits,
            wait_ms: self.wait_ms + other.wait_ms,
            fallback: self.fallback + other.fallback,
            service_lease: self.service_lease + other.service_lease,
            service_check: self.service_check + other.service_check,
            service_return: self.service_return + other.service_return,
        }
    }

    /// Callouts the filter sent per request Envoy received.
    fn per_request(&self) -> f64 {
        self.sent as f64 / self.requests.max(1) as f64
    }

    fn to_json(self) -> Value {
        json!({
            "requests": self.requests, "callouts_sent": self.sent, "callouts_ok": self.ok,
            "refill_waits": self.waits, "refill_wait_ms": self.wait_ms, "fallback_decisions": self.fallback,
            "service_lease_calls": self.service_lease, "service_check_calls": self.service_check,
            "service_return_calls": self.service_return,
        })
    }
}

/// The one-minute load average now.
fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

fn throughput(s: &Settings, out: &mut String, raw: &mut BTreeMap<String, Value>) {
    load::check_script(&s.wrk.script);
    // The upstream Envoy and the quota service run only for the variants
    // that need them, and live until the end of the throughput part.
    let proxied = s.variants.iter().any(|v| v == "u" || v == "r");
    let upstream = proxied.then(|| Envoy::start("tp-upstream", &Filters::None, &s.paths));
    let asks_quota = |v: &String| v == "r" || (v != "gkt" && GLOBAL_MODE.contains(&v.as_str()));
    let quota = s.variants.iter().any(asks_quota).then(|| QuotaService::start(&s.paths, "quota", &[]));
    let long_lease = s
        .variants
        .iter()
        .any(|v| v == "gkt")
        .then(|| QuotaService::start(&s.paths, "quota-long-lease", &["--lease-ttl", LONG_LEASE]));
    let global = Global {
        upstream: upstream.as_ref().map_or(0, |e| e.port),
        grpc: quota.as_ref().map_or(0, |q| q.grpc_port),
        quota_http: quota.as_ref().map_or(0, |q| q.http_port),
        long_lease_http: long_lease.as_ref().map_or(0, |q| q.http_port),
    };
    let mut variants = variants(global);
    variants.retain(|(id, _, _)| s.variants.iter().any(|v| v == id));
    assert!(!variants.is_empty(), "BENCH_VARIANTS selects no variant");
    eprintln!("throughput: starting {} Envoys", variants.len());
    // All Envoys start up front; an idle Envoy costs no CPU, and alternating
    // them round by round spreads any drift in the machine over all variants.
    let mut envoys: Vec<Envoy> =
        variants.iter().map(|(id, _, filters)| Envoy::spawn(&format!("tp-{id}"), filters, &s.paths)).collect();
    for envoy in &mut envoys {
        envoy.wait_ready();
    }
    for (envoy, (id, _, _)) in envoys.iter().zip(&variants) {
        eprintln!("throughput: warm-up {id} ({} s)", s.warmup);
        if s.warmup > 0 {
            wrk(&s.wrk, envoy.port, s.warmup, keys_of(id));
        }
    }
    let mut results: Vec<VariantResult> = variants
        .iter()
        .map(|(id, label, _)| VariantResult {
            id,
            label,
            rounds: Vec::new(),
            callouts: Vec::new(),
            callouts_second_half: Vec::new(),
        })
        .collect();
    let mut load_averages = vec![load_average()];
    for round in 1..=s.rounds {
        for (envoy, result) in envoys.iter().zip(&mut results) {
            let service = if result.id == "gkt" { long_lease.as_ref() } else { quota.as_ref() };
            let counting = service.filter(|_| GLOBAL_MODE.contains(&result.id));
            let before = counting.map(|q| Callouts::read(envoy, q));
            let (r, middle) = std::thread::scope(|scope| {
                let middle = counting.map(|q| {
                    scope.spawn(move || {
                        std::thread::sleep(Duration::from_secs(s.duration) / 2);
                        Callouts::read(envoy, q)
                    })
                });
                let r = wrk(&s.wrk, envoy.port, s.duration, keys_of(result.id));
                (r, middle.map(|m| m.join().unwrap()))
            });
            if let (Some(q), Some(before), Some(middle)) = (counting, before, middle) {
                let after = Callouts::read(envoy, q);
                result.callouts.push(after.since(before));
                result.callouts_second_half.push(after.since(middle));
            }
            eprintln!(
                "throughput: round {round}/{} {:>2}: {:>9.0} req/s  p50 {} ms  p99 {} ms  non-2xx {}  errors {}",
                s.rounds,
                result.id,
                r.rps(),
                ms(r.p50_us as f64),
                ms(r.p99_us as f64),
                r.non_2xx,
                r.socket_errors
            );
            result.rounds.push(r);
        }
        load_averages.push(load_average());
    }
    let med = |r: &VariantResult, f: &dyn Fn(&WrkResult) -> f64| median(&r.rounds.iter().map(f).collect::<Vec<_>>());
    let rps: Vec<f64> = results.iter().map(|r| med(r, &WrkResult::rps)).collect();
    // Ratios need (a) and (b) in the run; without them they show as NaN.
    let rps_of = |id: &str| results.iter().zip(&rps).find(|(r, _)| r.id == id).map_or(f64::NAN, |(_, v)| *v);
    let (rps_a, rps_b) = (rps_of("a"), rps_of("b"));
    let (load_min, load_max) =
        load_averages.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &l| (lo.min(l), hi.max(l)));
    let _ = writeln!(
        out,
        "\n## Throughput\n\nwrk, {} connections, {} threads, HTTP/1.1 keep-alive on loopback, {KEYS} keys \
         ({MANY_KEYS} for (dk), (gk) and (gkt)); {} round(s) of {} s per variant, alternating; medians over rounds. \
         One-minute load average at the start and after each round: {load_min:.1}–{load_max:.1}.\n",
        s.wrk.connections, s.wrk.threads, s.rounds, s.duration
    );
    let _ = writeln!(out, "| variant | req/s | p50 ms | p99 ms | ratio to (a) | ratio to (b) | non-2xx per round |");
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|");
    let mut json_variants = Vec::new();
    for (r, rps) in results.iter().zip(&rps) {
        let p50 = med(r, &|w| w.p50_us as f64);
        let p99 = med(r, &|w| w.p99_us as f64);
        let non_2xx = med(r, &|w| w.non_2xx as f64);
        let _ = writeln!(
            out,
            "| ({}) {} | {:.0} | {} | {} | {} | {} | {:.0} |",
            r.id,
            r.label,
            rps,
            ms(p50),
            ms(p99),
            ratio(*rps, rps_a),
            ratio(*rps, rps_b),
            non_2xx
        );
        json_variants.push(json!({
            "id": r.id, "label": r.label,
            "median": {"rps": rps, "p50_us": p50, "p99_us": p99, "ratio_a": rps / rps_a, "ratio_b": rps / rps_b},
            "rounds": r.rounds.iter().map(WrkResult::to_json).collect::<Vec<_>>(),
            "callouts": r.callouts.iter().map(|c| c.to_json()).collect::<Vec<_>>(),
            "callouts_second_half": r.callouts_second_half.iter().map(|c| c.to_json()).collect::<Vec<_>>(),
        }));
    }
    // Sanity of the set-up, reported rather than asserted.
    for r in &results {
        let limited: u64 = r.rounds.iter().map(|w| w.non_2xx).sum();
        let errors: u64 = r.rounds.iter().map(|w| w.socket_errors).sum();
        let limits = r.id == "e";
        if limits && limited == 0 {
            let _ = writeln!(
                out,
                "\n**Warning:** ({}) was meant to limit most requests but answered none as limited.",
                r.id
            );
        }
        if !limits && limited > 0 {
            let _ = writeln!(out, "\n**Warning:** ({}) answered {limited} requests with non-2xx.", r.id);
        }
        if errors > 0 {
            let _ = writeln!(out, "\n**Warning:** ({}) had {errors} socket errors.", r.id);
        }
    }
    let limited_share = |id: &str| {
        let r = results.iter().find(|r| r.id == id)?;
        let limited: u64 = r.rounds.iter().map(|w| w.non_2xx).sum();
        Some(100.0 * limited as f64 / r.rounds.iter().map(|w| w.requests).sum::<u64>().max(1) as f64)
    };
    let _ = writeln!(
        out,
        "\n(c)/(a) = {} is the floor cost of a wasm filter. Targets: (d) ≥ 0.97 × (c): (d)/(c) = {}; \
         (d) ≥ (b): (d)/(b) = {}.",
        ratio(rps_of("c"), rps_a),
        ratio(rps_of("d"), rps_of("c")),
        ratio(rps_of("d"), rps_b),
    );
    if let Some(at) = variants.iter().position(|(id, _, _)| *id == "r") {
        // The filter acts only when it calls the service: count the answers.
        let calls = envoys[at].stats().get("cluster.upstream.ratelimit.ok").copied().unwrap_or(0);
        let _ = writeln!(
            out,
            "\n(r)/(u) = {}: Envoy's global ratelimit filter with one gRPC call to floodgate-quota per request, \
             against the same proxying without it ((u) is (r)'s ceiling; the quota service shares the two cores). \
             (r) got {calls} OK answers from the service.",
            ratio(rps_of("r"), rps_of("u")),
        );
        if calls == 0 {
            let _ = writeln!(out, "\n**Warning:** (r) never got an answer from the quota service.");
        }
    }
    let global_mode = global_mode_report(out, &results, &rps_of);
    if let Some(share) = limited_share("e") {
        let _ = writeln!(out, "\nIn (e), {share:.1}% of requests were limited (the 429 path).");
    }
    // Wall time per request with the machine saturated (load generator
    // included): the gaps between variants are what each piece costs.
    let per_request: Vec<String> =
        results.iter().zip(&rps).map(|(r, v)| format!("({}) {:.2}", r.id, 1e6 / v)).collect();
    let _ = writeln!(out, "\nTime per request (1 / req/s), µs: {}.", per_request.join(", "));
    let probes: Vec<String> = results
        .iter()
        .zip(&rps)
        .filter(|(r, _)| r.id.starts_with('p'))
        .map(|(r, v)| format!("{}: {:.2}", r.label, (1e6 / v - 1e6 / rps_of("c")) / f64::from(PROBE_REPEATS)))
        .collect();
    if !probes.is_empty() {
        let _ = writeln!(out, "\nCost of one host call, µs ((probe − c) / {PROBE_REPEATS}): {}.", probes.join("; "));
    }
    raw.insert(
        "throughput".into(),
        json!({
            "connections": s.wrk.connections, "threads": s.wrk.threads, "rounds": s.rounds,
            "duration_s": s.duration, "warmup_s": s.warmup, "variants": json_variants,
            "load_averages": load_averages, "global_mode": global_mode,
        }),
    );
}

/// Each global-mode variant and the local variant it is measured against:
/// the same keys, the same rule shape, only the scope differs.
const GLOBAL_REFERENCES: [(&str, &str); 4] = [("gk", "dk"), ("gkt", "dk"), ("gl", "i"), ("gc", "i")];

/// The targets of issue 7 for lease mode: throughput against local mode,
/// and callouts per request at steady load.
const LEASE_THROUGHPUT_TARGET: f64 = 0.95;
const LEASE_CALLOUTS_TARGET: f64 = 0.02;

/// The global-mode table (issue 7): each global variant beside its local
/// reference, with callouts per request; then the targets. Returns the
/// summary for the JSON file (null when no global variant ran).
fn global_mode_report(out: &mut String, results: &[VariantResult], rps_of: &dyn Fn(&str) -> f64) -> Value {
    let find = |id: &str| results.iter().find(|r| r.id == id);
    if !GLOBAL_MODE.iter().any(|id| find(id).is_some()) {
        return Value::Null;
    }
    // Ratios within each round (both ran in it, a minute apart at most):
    // less exposed to drift in a noisy machine than the ratio of medians.
    let paired = |x: &VariantResult, y: &VariantResult| {
        median(&x.rounds.iter().zip(&y.rounds).map(|(a, b)| a.rps() / b.rps()).collect::<Vec<_>>())
    };
    let _ = writeln!(
        out,
        "\n### Global mode\n\nFloodgate's global rules asking floodgate-quota (memory store, HTTP API, the limit in its \
         limits file far above the load, fallback `deny`). Callouts per request: the filter's `global.callouts_sent` \
         ÷ Envoy's `downstream_rq_total`, over whole rounds and over the second half of each round (steady load: \
         each Envoy idles while the others are loaded, so its pools start every round cold); service calls: \
         `floodgate_quota_requests_total` for `lease` + `check` + `return` ÷ the same requests, whole rounds; waits: the \
         filter's `global.refill_waits` and `refill_wait_ms`.\n"
    );
    let _ = writeln!(
        out,
        "| variant | req/s | p50 ms | p99 ms | ÷ (a) | ÷ (d) | ÷ local reference (per-round median) | \
         callouts / request | callouts / request, second halves | service calls / request | requests that waited \
         for a refresh (mean wait ms) | fallback decisions | non-2xx |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut summary = Vec::new();
    for (id, reference) in GLOBAL_REFERENCES {
        let Some(r) = find(id) else { continue };
        let med = |f: &dyn Fn(&WrkResult) -> f64| median(&r.rounds.iter().map(f).collect::<Vec<_>>());
        let requests: u64 = r.rounds.iter().map(|w| w.requests).sum();
        let total = r.callouts.iter().fold(Callouts::default(), |a, &c| a.add(c));
        let steady = r.callouts_second_half.iter().fold(Callouts::default(), |a, &c| a.add(c));
        let service_per_request = total.service() as f64 / total.requests.max(1) as f64;
        let against_reference = find(reference).map_or(f64::NAN, |l| paired(r, l));
        let rps = rps_of(id);
        let non_2xx: u64 = r.rounds.iter().map(|w| w.non_2xx).sum();
        let _ = writeln!(
            out,
            "| ({id}) {} | {rps:.0} | {} | {} | {} | {} | ({reference}) {} | {:.5} | {:.5} | {service_per_request:.5} | \
             {:.2}% ({:.1}) | {} | {non_2xx} |",
            r.label,
            ms(med(&|w| w.p50_us as f64)),
            ms(med(&|w| w.p99_us as f64)),
            ratio(rps, rps_of("a")),
            ratio(rps, rps_of("d")),
            ratio(against_reference, 1.0),
            total.per_request(),
            steady.per_request(),
            100.0 * total.waits as f64 / total.requests.max(1) as f64,
            total.wait_ms as f64 / total.waits.max(1) as f64,
            total.fallback,
        );
        summary.push(json!({
            "id": id, "reference": reference, "requests": requests, "ratio_reference_paired": against_reference,
            "ratio_reference_medians": rps / rps_of(reference), "ratio_d": rps / rps_of("d"),
            "callouts_per_request": total.per_request(), "callouts_per_request_second_halves": steady.per_request(),
            "service_calls_per_request": service_per_request,
            "totals": total.to_json(), "second_halves": steady.to_json(), "non_2xx": non_2xx,
        }));
    }
    let verdict = |met: bool| if met { "met" } else { "**not met**" };
    for item in summary.iter().filter(|v| v["id"] != "gc") {
        let id = item["id"].as_str().unwrap_or("");
        let throughput = item["ratio_reference_paired"].as_f64().unwrap_or(f64::NAN);
        let callouts = item["callouts_per_request_second_halves"].as_f64().unwrap_or(f64::NAN);
        let _ = writeln!(
            out,
            "\nLease mode ({id}): throughput {} of its local reference ({}) — target ≥ {LEASE_THROUGHPUT_TARGET}: {}; \
             {callouts:.5} callouts per request at steady load (second halves) — target ≤ \
             {LEASE_CALLOUTS_TARGET}: {}.",
            ratio(throughput, 1.0),
            item["reference"].as_str().unwrap_or(""),
            verdict(throughput >= LEASE_THROUGHPUT_TARGET),
            verdict(callouts <= LEASE_CALLOUTS_TARGET),
        );
    }
    for item in &summary {
        if item["totals"]["fallback_decisions"].as_u64().unwrap_or(0) > 0 {
            let _ = writeln!(
                out,
                "\n**Warning:** ({}) decided with its fallback: the service did not answer every callout.",
                item["id"].as_str().unwrap_or("")
            );
        }
    }
    Value::Array(summary)
}

// ---------------------------------------------------------------- accuracy

/// The accuracy bucket: 100 per 10 s, burst 100.
const ACC_LIMIT: u64 = 100;
const ACC_PERIOD_S: u64 = 10;

/// One accuracy case on a fresh Envoy: the load's result and the connections
/// each worker accepted during it.
fn accuracy_case(s: &Settings, limiter: &str, filters: &Filters, keys: usize) -> (LoadResult, Vec<u64>) {
    let envoy = Envoy::start(&format!("acc-{limiter}-{keys}"), filters, &s.paths);
    let before = envoy.worker_connections();
    // Connection c starts at key c and steps through the keys, so every key
    // is sent on many connections, and so through both workers.
    let key = move |c: usize, seq: u64| format!("acc-{}", (c as u64 + seq) % keys as u64);
    let result =
        closed_loop(envoy.port, s.accuracy_connections, u64::MAX, Duration::from_secs(s.accuracy_secs), true, &key);
    let after = envoy.worker_connections();
    let per_worker: Vec<u64> =
        after.iter().zip(before.iter().chain(std::iter::repeat(&0))).map(|(a, b)| a.saturating_sub(*b)).collect();
    (result, per_worker)
}

fn accuracy(s: &Settings, out: &mut String, raw: &mut BTreeMap<String, Value>) {
    let floodgate = Filters::Floodgate(format!(
        r#"{{"rules": [{{"name": "acc", "descriptors": {PER_KEY}, "algorithm": "token_bucket",
             "limit": {ACC_LIMIT}, "period": "{ACC_PERIOD_S}s", "burst": {ACC_LIMIT}}}]}}"#
    ));
    let native = Filters::EnvoyLocal(EnvoyBucket { max_tokens: 100, tokens_per_fill: 100, fill_interval: "10s" });
    let _ = writeln!(
        out,
        "\n## Accuracy under load\n\nOne bucket per key: {ACC_LIMIT} per {ACC_PERIOD_S} s, burst {ACC_LIMIT}. \
         {} keep-alive connections for {} s, each stepping through the keys; a fresh Envoy per case. \
         Elapsed = from the first request sent to the last response received (every decision lies within it). Floodgate's bound per key is burst + rate × elapsed (rounded down). \
         Envoy's bucket (max_tokens 100, tokens_per_fill 100, fill_interval 10s) allows 100 + 100 × fills; \
         the fill timer's phase is unknown, so at most ⌊elapsed / 10 s⌋ + 1 fills, and its continuous-refill \
         reading equals Floodgate's bound: both are shown.\n",
        s.accuracy_connections, s.accuracy_secs
    );
    let _ = writeln!(
        out,
        "| limiter | keys | connections per worker | requests | elapsed s | bound per key | allowed per key (min–max) | allowed in all | keys over bound | admitted over bound |"
    );
    let _ = writeln!(out, "|---|---:|---|---:|---:|---|---|---:|---:|---:|");
    let mut cases = Vec::new();
    for (limiter, filters) in [("floodgate", &floodgate), ("envoy-local", &native)] {
        for keys in [1usize, 50] {
            eprintln!("accuracy: {limiter}, {keys} key(s), {} s", s.accuracy_secs);
            let (r, per_worker) = accuracy_case(s, limiter, filters, keys);
            // The bucket's clock runs from its first decision to its last;
            // both lie within [first request sent, last response received].
            // The span to the last request *sent* can fall short of the
            // decisions by one response time, and when it ends just before a
            // token is due that wrongly reads as one token of over-admission.
            let elapsed = r.decision_span.as_secs_f64();
            let continuous = ACC_LIMIT + (ACC_LIMIT as f64 * elapsed / ACC_PERIOD_S as f64).floor() as u64;
            let timer = ACC_LIMIT + ACC_LIMIT * ((elapsed / ACC_PERIOD_S as f64).floor() as u64 + 1);
            // Over-admission is judged against the exact bound for Floodgate
            // and against the lenient (most fills possible) one for Envoy.
            let bound = if limiter == "floodgate" { continuous } else { timer };
            let allowed: Vec<u64> = r.per_key.values().map(|c| c.allowed).collect();
            let (min, max) = (allowed.iter().min().copied().unwrap_or(0), allowed.iter().max().copied().unwrap_or(0));
            let over_keys = allowed.iter().filter(|&&a| a > bound).count();
            let over: u64 = allowed.iter().map(|&a| a.saturating_sub(bound)).sum();
            let over_continuous: u64 = allowed.iter().map(|&a| a.saturating_sub(continuous)).sum();
            let bound_text = if limiter == "floodgate" {
                format!("{continuous}")
            } else {
                format!("{timer} (timer) / {continuous} (continuous)")
            };
            let over_text = if limiter == "floodgate" {
                format!("{over}")
            } else {
                format!("{over} (timer) / {over_continuous} (continuous)")
            };
            let _ = writeln!(
                out,
                "| {limiter} | {keys} | {} | {} | {:.2} | {bound_text} | {min}–{max} | {} | {over_keys} | {over_text} |",
                per_worker.iter().map(u64::to_string).collect::<Vec<_>>().join(" / "),
                r.total.allowed + r.total.limited + r.total.other,
                elapsed,
                r.total.allowed,
            );
            if r.total.other > 0 {
                let _ = writeln!(
                    out,
                    "\n**Warning:** {limiter}/{keys}: {} responses neither 200 nor 429.\n",
                    r.total.other
                );
            }
            if per_worker.iter().filter(|&&n| n > 0).count() < 2 {
                let _ = writeln!(out, "\n**Warning:** {limiter}/{keys}: not every worker took connections.\n");
            }
            cases.push(json!({
                "limiter": limiter, "keys": keys, "connections": s.accuracy_connections,
                "connections_per_worker": per_worker, "elapsed_s": elapsed,
                "send_span_s": r.send_span.as_secs_f64(), "wall_s": r.wall.as_secs_f64(),
                "bound_continuous": continuous, "bound_timer": timer,
                "allowed": r.total.allowed, "limited": r.total.limited, "other": r.total.other,
                "allowed_per_key": r.per_key.iter().map(|(k, c)| (k.clone(), json!(c.allowed))).collect::<serde_json::Map<_, _>>(),
            }));
        }
    }
    raw.insert("accuracy".into(), json!({
        "limit": ACC_LIMIT, "period_s": ACC_PERIOD_S, "burst": ACC_LIMIT, "seconds": s.accuracy_secs, "cases": cases,
    }));
}

// ------------------------------------------------------------------ memory

/// The memory rule's name and table size.
const MEM_RULE: &str = "mem";
const MEM_MAX_KEYS: u64 = 65_536;

/// The shared-data bound the README states for a configuration's first
/// rule, as the filter itself computes it (`Limiter::shared_data_bytes`).
fn stated_bound(plugin_config: &str) -> u64 {
    let config = floodgate_core::config::Config::parse(plugin_config.as_bytes()).expect("the memory rule parses");
    let store = floodgate_core::store::MemoryStore::default();
    let limiter = floodgate_core::limiter::Limiter::prepare(config, &store, [0; 16], |_| ()).expect("prepare");
    limiter.shared_data_bytes(0)
}

/// Envoy's `/memory` (allocated, heap_size) before and after a load.
struct MemoryRun {
    before: (u64, u64),
    after: (u64, u64),
    load: LoadResult,
}

/// Reads `/memory` once Envoy is configured and idle, sends `memory_keys`
/// requests with distinct keys, and reads it again.
fn memory_run(s: &Settings, envoy: &Envoy) -> MemoryRun {
    // A second for start-up allocations to settle before the first reading.
    std::thread::sleep(Duration::from_secs(1));
    let before = envoy.memory();
    eprintln!("memory: {}: {} distinct keys over {} connections", envoy.name, s.memory_keys, s.memory_connections);
    let connections = s.memory_connections as u64;
    let key = move |c: usize, seq: u64| format!("client-{:07}", seq * connections + c as u64);
    let load = closed_loop(
        envoy.port,
        s.memory_connections,
        s.memory_keys,
        Duration::from_secs(s.memory_max_secs),
        false,
        &key,
    );
    std::thread::sleep(Duration::from_secs(1));
    MemoryRun { before, after: envoy.memory(), load }
}

fn memory(s: &Settings, out: &mut String, raw: &mut BTreeMap<String, Value>) {
    // Buckets stay live for a while after a request (100 per minute: one
    // token takes 0.6 s to come back), so the table sees both reuse of idle
    // buckets (slot_evictions) and, if clients arrive fast enough, full groups.
    let plugin_config = |max_keys: u64| {
        format!(
            r#"{{"rules": [{{"name": "{MEM_RULE}", "descriptors": {PER_KEY}, "limit": 100, "period": "1m",
                 "max_keys": {max_keys}}}]}}"#
        )
    };
    let filters = |max_keys: u64| Filters::Floodgate(plugin_config(max_keys));
    // The control is the same module, rule and load with the smallest table
    // (max_keys 4: one group): the difference between the two Envoys is the
    // table, apart from Envoy, the VM and the module, which both carry.
    let control = {
        let envoy = Envoy::start("mem-control", &filters(4), &s.paths);
        memory_run(s, &envoy)
    };
    let (fg, stats) = {
        let envoy = Envoy::start("mem-floodgate", &filters(MEM_MAX_KEYS), &s.paths);
        let run = memory_run(s, &envoy);
        (run, envoy.stats())
    };
    let stat = |name: &str| stats.get(&format!("wasmcustom.floodgate.{name}")).copied().unwrap_or(0);
    let r = &fg.load;
    let sent = r.total.allowed + r.total.limited + r.total.other;
    let bound = stated_bound(&plugin_config(MEM_MAX_KEYS));
    let groups = MEM_MAX_KEYS / 4;
    let mib = |b: u64| format!("{:.1}", b as f64 / 1048576.0);
    let diff = |a: u64, b: u64| a as i64 - b as i64;
    let signed_mib = |d: i64| format!("{:+.1}", d as f64 / 1048576.0);
    let _ = writeln!(
        out,
        "\n## Memory\n\n{sent} requests with distinct `x-api-key` values ({:.0} s, {} connections) against one \
         token-bucket rule `{MEM_RULE}` with max_keys {MEM_MAX_KEYS}; the control is the same rule and load with \
         max_keys 4 (a one-group table). Envoy's admin `/memory`, MiB. README bound for this rule: \
         (65536 / 4) × ({} + {} + 2 + 4 × 24) = {bound} bytes ({} MiB).\n",
        r.wall.as_secs_f64(),
        s.memory_connections,
        floodgate_core::limiter::SHARED_DATA_ENTRY_OVERHEAD,
        format!("fg:{MEM_RULE}:{}", MEM_MAX_KEYS / 4 - 1).len(),
        mib(bound)
    );
    let _ = writeln!(out, "| Envoy | measure | configured, idle | after the keys | growth with traffic |");
    let _ = writeln!(out, "|---|---|---:|---:|---:|");
    let names = [("control (max_keys 4)".to_string(), &control), (format!("Floodgate (max_keys {MEM_MAX_KEYS})"), &fg)];
    for (name, run) in names {
        for (measure, before, after) in
            [("allocated", run.before.0, run.after.0), ("heap_size", run.before.1, run.after.1)]
        {
            let _ = writeln!(
                out,
                "| {name} | {measure} | {} | {} | {} |",
                mib(before),
                mib(after),
                signed_mib(diff(after, before))
            );
        }
    }
    // Floodgate creates its table's entries when the configuration loads;
    // their values grow to full size as clients take buckets.
    let table_configured = diff(fg.before.0, control.before.0);
    let table_after = diff(fg.after.0, control.after.0);
    let growth = diff(fg.after.0, fg.before.0);
    let verdict = |d: i64| if d <= bound as i64 { "within" } else { "OVER" };
    let _ = writeln!(
        out,
        "\nThe table (`allocated`, Floodgate − control): {table_configured} bytes when configured, {table_after} bytes \
         after the keys ({:.1} per group, {:.2}% of the bound): {} the README bound of {bound} bytes \
         ({} per group). Floodgate's growth with traffic: {growth} bytes. \
         Responses: {} allowed, {} limited, {} other. Counters after the run: \
         slot_evictions {}, table_full {}, store_errors {}, corrupt_state {}.",
        table_after as f64 / groups as f64,
        100.0 * table_after as f64 / bound as f64,
        verdict(table_after),
        bound / groups,
        r.total.allowed,
        r.total.limited,
        r.total.other,
        stat("slot_evictions"),
        stat("table_full"),
        stat("store_errors"),
        stat("corrupt_state"),
    );
    if sent < s.memory_keys {
        let _ = writeln!(
            out,
            "\n**Note:** only {sent} of {} keys were sent within the {} s bound.",
            s.memory_keys, s.memory_max_secs
        );
    }
    let reading = |m: (u64, u64)| json!({"allocated": m.0, "heap_size": m.1});
    raw.insert(
        "memory".into(),
        json!({
            "rule": MEM_RULE, "max_keys": MEM_MAX_KEYS, "keys_sent": sent, "wall_s": r.wall.as_secs_f64(),
            "readme_bound_bytes": bound,
            "control_max_keys_4": {
                "before": reading(control.before), "after": reading(control.after),
                "wall_s": control.load.wall.as_secs_f64(),
            },
            "floodgate": {"before": reading(fg.before), "after": reading(fg.after)},
            "responses": {"allowed": r.total.allowed, "limited": r.total.limited, "other": r.total.other},
            "counters": {
                "slot_evictions": stat("slot_evictions"), "table_full": stat("table_full"),
                "store_errors": stat("store_errors"), "corrupt_state": stat("corrupt_state"),
                "allowed": stat("allowed"), "limited": stat("limited"),
            },
        }),
    );
}

// ------------------------------------------------------------ set-up check

/// Checks, before measuring anything, that variant (b)'s configuration really
/// limits per key: with a bucket of 3 per minute, key A gets 3 of 5 and key B
/// still gets both of its 2.
fn check_envoy_local(s: &Settings, out: &mut String, raw: &mut BTreeMap<String, Value>) {
    let filters = Filters::EnvoyLocal(EnvoyBucket { max_tokens: 3, tokens_per_fill: 3, fill_interval: "60s" });
    let envoy = Envoy::start("check-envoy-local", &filters, &s.paths);
    let mut statuses = Vec::new();
    for key in ["key-a", "key-a", "key-a", "key-a", "key-a", "key-b", "key-b"] {
        // A new connection per request, so requests land on both workers.
        let status = floodgate_e2e::Conn::open(envoy.port)
            .ok()
            .and_then(|mut c| c.try_request("GET", "/api/items", &[("x-api-key", key.as_bytes())]).ok())
            .map_or(0, |r| r.status);
        statuses.push((key, status));
    }
    let ok = statuses.iter().map(|(_, s)| *s).eq([200, 200, 200, 429, 429, 200, 200]);
    let shown: Vec<String> = statuses.iter().map(|(k, s)| format!("{k}:{s}")).collect();
    let _ = writeln!(
        out,
        "\nCheck of (b)'s per-key configuration with a bucket of 3 per minute: {} — {}.",
        shown.join(" "),
        if ok { "limits per key as expected" } else { "**NOT as expected (3 of 5 for key-a, 2 of 2 for key-b)**" }
    );
    raw.insert("check_envoy_local".into(), json!({"statuses": shown, "as_expected": ok}));
}

// ------------------------------------------------------------------ output

fn shell(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn machine() -> Value {
    let cpu = shell("lscpu", &[])
        .lines()
        .find_map(|l| l.strip_prefix("Model name:").map(|m| m.trim().to_string()))
        .unwrap_or_default();
    let mem_kib: u64 = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    json!({
        "nproc": shell("nproc", &[]), "cpu": cpu, "memory_gib": format!("{:.1}", mem_kib as f64 / 1048576.0),
        "kernel": shell("uname", &["-sr"]), "loadavg_at_start": std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim(),
    })
}

fn main() {
    envoy::stop_envoys_on_panic();
    let s = Settings::from_env();
    let probing = s.runs("throughput") && s.variants.iter().any(|v| v.starts_with('p'));
    let mut modules = vec![&s.paths.floodgate_wasm, &s.paths.noop_wasm];
    if probing {
        modules.push(&s.paths.probe_wasm);
    }
    for wasm in modules {
        assert!(
            wasm.exists(),
            "{} is missing: build it (make -f bench/bench.mk filter-bench builds them)",
            wasm.display()
        );
    }
    let date = shell("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]);
    let machine = machine();
    let envoy_version = shell(&s.paths.envoy, &["--version"]);
    let mut out = String::new();
    let _ = writeln!(out, "# Floodgate benchmark\n");
    let _ = writeln!(out, "- date: {date}");
    let _ = writeln!(
        out,
        "- machine: {} CPUs ({}), {} GiB, {}; load average at start: {}",
        machine["nproc"].as_str().unwrap_or(""),
        machine["cpu"].as_str().unwrap_or(""),
        machine["memory_gib"].as_str().unwrap_or(""),
        machine["kernel"].as_str().unwrap_or(""),
        machine["loadavg_at_start"].as_str().unwrap_or("")
    );
    let _ = writeln!(
        out,
        "- envoy: {} (`--concurrency 2 --disable-hot-restart`)",
        envoy_version.lines().last().unwrap_or("")
    );
    let settings = s.describe();
    let shown: Vec<String> = settings.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let _ = writeln!(out, "- settings: `{}`", shown.join(" "));
    let mut raw: BTreeMap<String, Value> = BTreeMap::new();
    check_envoy_local(&s, &mut out, &mut raw);
    if s.runs("throughput") {
        throughput(&s, &mut out, &mut raw);
    }
    if s.runs("accuracy") {
        accuracy(&s, &mut out, &mut raw);
    }
    if s.runs("memory") {
        memory(&s, &mut out, &mut raw);
    }
    raw.insert("date".into(), json!(date));
    raw.insert(
        "settings".into(),
        Value::Object(settings.into_iter().map(|(k, v)| (k.to_string(), json!(v))).collect()),
    );
    raw.insert("machine".into(), machine);
    raw.insert("envoy".into(), json!(envoy_version));
    raw.insert("floodgate_wasm".into(), json!(s.paths.floodgate_wasm.display().to_string()));
    std::fs::create_dir_all(&s.results_dir).unwrap();
    let file = s.results_dir.join(format!("bench-{}.json", date.replace(':', "")));
    std::fs::write(&file, serde_json::to_string_pretty(&raw).unwrap()).unwrap();
    let _ = writeln!(out, "\nRaw results: {}", file.display());
    println!("{out}");
    let _ = std::fs::remove_dir_all(&s.paths.scratch);
}
