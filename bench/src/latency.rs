//! The latency part: sequential requests on one keep-alive connection, one
//! variant after another, round by round; percentiles of each run, their
//! medians over rounds, ratios to each variant's reference, and the targets.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use floodgate_e2e::Conn;
use serde_json::{json, Value};

use crate::rig::Rig;
use crate::settings::BenchSettings;
use crate::stats::{load_average, median, ms, per_round, percentile, ratio};
use crate::targets::{ReportTable, RoundFigure};
use crate::variants::Variant;
use crate::verdicts;

/// The longest one run of sequential requests may take, whatever its count.
const MAX_RUN: Duration = Duration::from_secs(60);

/// One run of sequential requests.
#[derive(Clone, Copy, Debug, Default)]
struct Run {
    requests: u64,
    p50_us: u64,
    p90_us: u64,
    p99_us: u64,
    /// Answers other than 200.
    non_200: u64,
    /// Requests that got no answer (the connection is opened again).
    errors: u64,
}

impl Run {
    fn to_json(self) -> Value {
        json!({
            "requests": self.requests, "p50_us": self.p50_us, "p90_us": self.p90_us, "p99_us": self.p99_us,
            "non_200": self.non_200, "errors": self.errors,
        })
    }
}

/// Sends up to `requests` requests one after another on one keep-alive
/// connection, for at most `max_time`, cycling through `keys` API keys as
/// `bench/wrk.lua` does; the latency of each answered request, from writing
/// it to reading the whole answer.
fn sequential(port: u16, keys: u32, requests: u64, max_time: Duration) -> Run {
    let names: Vec<String> = (0..keys).map(|k| format!("key-{k:02}")).collect();
    let mut conn = Conn::open(port).ok();
    let mut latencies = Vec::with_capacity(requests.min(1 << 20) as usize);
    let mut run = Run::default();
    let deadline = Instant::now() + max_time;
    for n in 0..requests {
        if Instant::now() >= deadline {
            break;
        }
        let key = names[(n % u64::from(keys.max(1))) as usize].as_bytes();
        let start = Instant::now();
        let answer = conn.as_mut().and_then(|c| c.try_request("GET", "/api/items", &[("x-api-key", key)]).ok());
        run.requests += 1;
        match answer {
            Some(response) => {
                latencies.push(start.elapsed().as_micros() as u64);
                run.non_200 += u64::from(response.status != 200);
            }
            None => {
                run.errors += 1;
                conn = Conn::open(port).ok();
            }
        }
    }
    latencies.sort_unstable();
    (run.p50_us, run.p90_us, run.p99_us) =
        (percentile(&latencies, 50.0), percentile(&latencies, 90.0), percentile(&latencies, 99.0));
    run
}

/// One variant's runs.
struct Series {
    variant: &'static Variant,
    runs: Vec<Run>,
}

impl Series {
    fn per_round(&self, f: impl Fn(&Run) -> u64) -> Vec<f64> {
        self.runs.iter().map(|r| f(r) as f64).collect()
    }
}

pub fn latency(s: &BenchSettings, out: &mut String, raw: &mut BTreeMap<String, Value>) {
    let variants: Vec<&Variant> = s.selected().into_iter().filter(|v| v.latency).collect();
    let _ = writeln!(out, "\n## Latency on one connection\n");
    if variants.is_empty() {
        let _ = writeln!(out, "No variant of this part is in `BENCH_VARIANTS`.");
        return;
    }
    let rig = Rig::start(s, "lat", &variants);
    for (envoy, v) in rig.envoys.iter().zip(&variants) {
        eprintln!("latency: warm-up {} ({} s)", v.id, s.warmup);
        sequential(envoy.port, v.keys, u64::MAX, Duration::from_secs(s.warmup));
    }
    let mut series: Vec<Series> = variants.iter().map(|&variant| Series { variant, runs: Vec::new() }).collect();
    let mut load_averages = vec![load_average()];
    for round in 1..=s.rounds {
        for (envoy, one) in rig.envoys.iter().zip(&mut series) {
            let run = sequential(envoy.port, one.variant.keys, s.latency_requests, MAX_RUN);
            eprintln!(
                "latency: round {round}/{} {:>2}: p50 {} ms  p90 {} ms  p99 {} ms  non-200 {}  errors {}",
                s.rounds,
                one.variant.id,
                ms(run.p50_us as f64),
                ms(run.p90_us as f64),
                ms(run.p99_us as f64),
                run.non_200,
                run.errors
            );
            one.runs.push(run);
        }
        load_averages.push(load_average());
    }
    let rows = table(s, out, &series, &load_averages);
    let figures = |id: &str, metric: RoundFigure| {
        let one = series.iter().find(|one| one.variant.id == id)?;
        (metric == RoundFigure::LatencyP50).then(|| one.per_round(|r| r.p50_us))
    };
    let targets = verdicts::report(out, ReportTable::Latency, &variants, &s.paths.quota_unit, &figures);
    raw.insert(
        "latency".into(),
        json!({
            "requests_per_run": s.latency_requests, "rounds": s.rounds, "warmup_s": s.warmup,
            "load_averages": load_averages, "variants": rows, "targets": targets,
        }),
    );
}

/// The table; returns its rows for the JSON file.
fn table(s: &BenchSettings, out: &mut String, series: &[Series], load_averages: &[f64]) -> Vec<Value> {
    let (load_min, load_max) = crate::stats::spread(load_averages);
    let _ = writeln!(
        out,
        "{} sequential requests per variant per round on one HTTP/1.1 keep-alive connection (so one worker), \
         the next sent when the last is answered, after {} s of the same as a warm-up; {} round(s), alternating; \
         medians over rounds. Ratios to the reference: medians of per-round ratios. One-minute load average at the \
         start and after each round: {load_min:.1}–{load_max:.1}.\n",
        s.latency_requests, s.warmup, s.rounds
    );
    let _ = writeln!(
        out,
        "| variant | p50 ms | p90 ms | p99 ms | reference | p50 ÷ reference | p99 ÷ reference | non-200 | errors |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---|---:|---:|---:|---:|");
    let mut rows = Vec::new();
    for one in series {
        let med = |f: fn(&Run) -> u64| median(&one.per_round(f));
        let reference = one.variant.reference.and_then(|id| series.iter().find(|other| other.variant.id == id));
        let against =
            |f: fn(&Run) -> u64| reference.map_or(f64::NAN, |r| median(&per_round(&one.per_round(f), &r.per_round(f))));
        let (p50_ratio, p99_ratio) = (against(|r| r.p50_us), against(|r| r.p99_us));
        let _ = writeln!(
            out,
            "| ({}) {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            one.variant.id,
            one.variant.label,
            ms(med(|r| r.p50_us)),
            ms(med(|r| r.p90_us)),
            ms(med(|r| r.p99_us)),
            reference.map_or("—".to_string(), |r| format!("({})", r.variant.id)),
            ratio(p50_ratio, 1.0),
            ratio(p99_ratio, 1.0),
            one.runs.iter().map(|r| r.non_200).sum::<u64>(),
            one.runs.iter().map(|r| r.errors).sum::<u64>(),
        );
        rows.push(json!({
            "id": one.variant.id, "label": one.variant.label,
            "median": {"p50_us": med(|r| r.p50_us), "p90_us": med(|r| r.p90_us), "p99_us": med(|r| r.p99_us)},
            "reference": one.variant.reference, "p50_ratio_reference": p50_ratio, "p99_ratio_reference": p99_ratio,
            "rounds": one.runs.iter().map(|r| r.to_json()).collect::<Vec<_>>(),
        }));
    }
    rows
}
