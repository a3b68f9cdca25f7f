//! Everything a run can be told through the environment.

use std::path::{Path, PathBuf};

use crate::filters::Paths;
use crate::load::WrkSettings;
use crate::variants::{self, Variant, VARIANTS};

/// Everything a run can be told through the environment.
#[derive(Clone, Debug)]
pub struct BenchSettings {
    pub paths: Paths,
    pub wrk: WrkSettings,
    /// Throughput and latency rounds (each runs every variant once).
    pub rounds: usize,
    /// Seconds of load per variant per round.
    pub duration: u64,
    /// Seconds of warm-up load per Envoy before the first round.
    pub warmup: u64,
    /// Sequential requests per variant per latency round.
    pub latency_requests: u64,
    /// Seconds of load per accuracy case.
    pub accuracy_secs: u64,
    /// Connections of the accuracy load.
    pub accuracy_connections: usize,
    /// Distinct keys sent in the memory run.
    pub memory_keys: u64,
    /// Connections of the memory load.
    pub memory_connections: usize,
    /// Upper bound on the memory run's duration, in seconds.
    pub memory_max_secs: u64,
    /// Which parts run, by name.
    pub parts: Vec<String>,
    /// Which variants run, by id (see [`VARIANTS`]).
    pub variants: Vec<String>,
    /// Where the JSON goes.
    pub results_dir: PathBuf,
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

fn string_or(name: &str, default: &str) -> String {
    std::env::var(name).ok().filter(|v| !v.is_empty()).unwrap_or(default.into())
}

/// Stops the run when `name` lists something `known` does not have.
fn check_names(name: &str, given: &[String], known: &[&str]) {
    let unknown: Vec<&str> = given.iter().map(String::as_str).filter(|g| !known.contains(g)).collect();
    assert!(unknown.is_empty(), "{name} names {unknown:?}, which are not among {known:?}");
}

impl BenchSettings {
    /// Reads `ENVOY_BIN`, `FLOODGATE_WASM`, `NOOP_WASM`, `PROBE_WASM`,
    /// `QUOTA_BIN`, `WRK_BIN`, `BENCH_ROUNDS` (5), `BENCH_DURATION` (5 s),
    /// `BENCH_WARMUP` (2 s), `BENCH_CONNECTIONS` (16), `BENCH_THREADS` (2),
    /// `BENCH_LATENCY_REQUESTS` (3,000), `BENCH_ACCURACY_SECS` (5),
    /// `BENCH_ACCURACY_CONNECTIONS` (32), `BENCH_MEMORY_KEYS` (1,000,000),
    /// `BENCH_MEMORY_CONNECTIONS` (16), `BENCH_MEMORY_MAX_SECS` (300),
    /// `BENCH_QUOTA_UNIT` (`second`), `BENCH_PARTS` (all of `parts`),
    /// `BENCH_VARIANTS` (the rows marked `default`) and `BENCH_RESULTS_DIR`
    /// (`bench/results`). Relative paths are taken from the repository root.
    pub fn from_env(parts: &[&str]) -> BenchSettings {
        let root = repo_root();
        let path = |var: &str, default: &str| {
            let p = PathBuf::from(string_or(var, default));
            if p.is_absolute() {
                p
            } else {
                root.join(p)
            }
        };
        let scratch = std::env::temp_dir().join(format!("floodgate-bench-{}", std::process::id()));
        std::fs::create_dir_all(&scratch).unwrap();
        let settings = BenchSettings {
            paths: Paths {
                envoy: string_or("ENVOY_BIN", "envoy"),
                floodgate_wasm: path("FLOODGATE_WASM", "target/wasm32-wasip1/release/floodgate.wasm"),
                noop_wasm: path("NOOP_WASM", "target/wasm32-wasip1/release/floodgate_bench_noop.wasm"),
                probe_wasm: path("PROBE_WASM", "target/wasm32-wasip1/release/floodgate_bench_probe.wasm"),
                quota_bin: path("QUOTA_BIN", "target/release/floodgate-quota"),
                scratch,
                quota_unit: string_or("BENCH_QUOTA_UNIT", "second"),
            },
            wrk: WrkSettings {
                bin: string_or("WRK_BIN", "wrk"),
                script: root.join("bench/wrk.lua").display().to_string(),
                connections: env_or("BENCH_CONNECTIONS", 16),
                threads: env_or("BENCH_THREADS", 2),
            },
            rounds: env_or("BENCH_ROUNDS", 5),
            duration: env_or("BENCH_DURATION", 5),
            warmup: env_or("BENCH_WARMUP", 2),
            latency_requests: env_or("BENCH_LATENCY_REQUESTS", 3000),
            accuracy_secs: env_or("BENCH_ACCURACY_SECS", 5),
            accuracy_connections: env_or("BENCH_ACCURACY_CONNECTIONS", 32),
            memory_keys: env_or("BENCH_MEMORY_KEYS", 1_000_000),
            memory_connections: env_or("BENCH_MEMORY_CONNECTIONS", 16),
            memory_max_secs: env_or("BENCH_MEMORY_MAX_SECS", 300),
            parts: list("BENCH_PARTS", &parts.join(",")),
            variants: list("BENCH_VARIANTS", &variants::default_ids()),
            results_dir: path("BENCH_RESULTS_DIR", "bench/results"),
        };
        check_names("BENCH_PARTS", &settings.parts, parts);
        check_names("BENCH_VARIANTS", &settings.variants, &VARIANTS.iter().map(|v| v.id).collect::<Vec<_>>());
        settings
    }

    /// The settings that shape the numbers, as `NAME=value` pairs.
    pub fn describe(&self) -> Vec<(&'static str, String)> {
        vec![
            ("BENCH_PARTS", self.parts.join(",")),
            ("BENCH_VARIANTS", self.variants.join(",")),
            ("BENCH_ROUNDS", self.rounds.to_string()),
            ("BENCH_DURATION", self.duration.to_string()),
            ("BENCH_WARMUP", self.warmup.to_string()),
            ("BENCH_CONNECTIONS", self.wrk.connections.to_string()),
            ("BENCH_THREADS", self.wrk.threads.to_string()),
            ("BENCH_LATENCY_REQUESTS", self.latency_requests.to_string()),
            ("BENCH_ACCURACY_SECS", self.accuracy_secs.to_string()),
            ("BENCH_ACCURACY_CONNECTIONS", self.accuracy_connections.to_string()),
            ("BENCH_MEMORY_KEYS", self.memory_keys.to_string()),
            ("BENCH_MEMORY_CONNECTIONS", self.memory_connections.to_string()),
            ("BENCH_MEMORY_MAX_SECS", self.memory_max_secs.to_string()),
            ("BENCH_QUOTA_UNIT", self.paths.quota_unit.clone()),
        ]
    }

    /// Whether `part` runs.
    pub fn runs(&self, part: &str) -> bool {
        self.parts.iter().any(|p| p == part)
    }

    /// The selected variants, in the table's order.
    pub fn selected(&self) -> Vec<&'static Variant> {
        VARIANTS.iter().filter(|v| self.variants.iter().any(|id| id == v.id)).collect()
    }
}

/// The repository root (this crate lives in `bench/`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}
