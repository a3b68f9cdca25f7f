//! Floodgate's benchmark: per-request cost against no filter, Envoy's own
//! `local_ratelimit` and a no-op wasm filter; latency of every path on one
//! connection; accuracy under load on both workers; memory with a million
//! distinct clients. Prints markdown tables with the speed targets and writes
//! the raw numbers as JSON. It measures and reports; it asserts nothing about
//! time.
//!
//! Run it through `make -f bench/bench.mk filter-bench` (or `filter-bench-quick`);
//! the environment variables it reads are listed in [`BenchSettings::from_env`].
//! What it measures is the table in [`variants`].

// A benchmark binary: a failed set-up step should stop the run loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod accuracy;
mod callouts;
mod filters;
mod global_report;
mod latency;
mod load;
mod memory;
mod results;
mod rig;
mod settings;
mod setup_check;
mod stats;
mod targets;
mod throughput;
mod variants;
mod verdicts;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::process::Command;

use filters::Module;
use serde_json::{json, Value};
use settings::BenchSettings;
use variants::Ports;

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

/// Stops the run before anything starts when a module it loads is missing.
fn check_modules(s: &BenchSettings) {
    let probing = s.runs("throughput") && s.selected().iter().any(|v| v.probe);
    let native = s.selected().iter().any(|v| (v.filters)(&Ports::default()).module() == Some(Module::Native));
    let mut modules = vec![&s.paths.floodgate_wasm, &s.paths.noop_wasm];
    if probing {
        modules.push(&s.paths.probe_wasm);
    }
    if native {
        modules.extend([&s.paths.floodgate_native, &s.paths.noop_native]);
    }
    for module in modules {
        assert!(
            module.exists(),
            "{} is missing: build it (make -f bench/bench.mk filter-bench builds them)",
            module.display()
        );
    }
}

/// The run's heading: when, where, which Envoy and settings.
fn heading(s: &BenchSettings, out: &mut String, date: &str, machine: &Value, envoy_version: &str) {
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
    let shown: Vec<String> = s.describe().iter().map(|(k, v)| format!("{k}={v}")).collect();
    let _ = writeln!(out, "- settings: `{}`", shown.join(" "));
}

/// A part of the run: it measures, appends its tables to the output and its
/// raw numbers to the JSON.
type Part = fn(&BenchSettings, &mut String, &mut BTreeMap<String, Value>);

/// The parts, in the order they run (`BENCH_PARTS` picks them by name).
const PARTS: [(&str, Part); 4] = [
    ("throughput", throughput::throughput),
    ("latency", latency::latency),
    ("accuracy", accuracy::accuracy),
    ("memory", memory::memory),
];

fn main() {
    floodgate_e2e::process::stop_processes_on_panic();
    let s = BenchSettings::from_env(&PARTS.map(|(name, _)| name));
    check_modules(&s);
    let date = shell("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]);
    let machine = machine();
    let envoy_version = shell(&s.paths.envoy, &["--version"]);
    let mut out = String::new();
    heading(&s, &mut out, &date, &machine, &envoy_version);
    let mut raw: BTreeMap<String, Value> = BTreeMap::new();
    setup_check::check_envoy_local(&s, &mut out, &mut raw);
    for (name, part) in PARTS {
        if s.runs(name) {
            part(&s, &mut out, &mut raw);
        }
    }
    raw.insert("date".into(), json!(date));
    raw.insert(
        "settings".into(),
        Value::Object(s.describe().into_iter().map(|(k, v)| (k.to_string(), json!(v))).collect()),
    );
    raw.insert("machine".into(), machine);
    raw.insert("envoy".into(), json!(envoy_version));
    raw.insert("floodgate_wasm".into(), json!(s.paths.floodgate_wasm.display().to_string()));
    raw.insert("floodgate_native".into(), json!(s.paths.floodgate_native.display().to_string()));
    std::fs::create_dir_all(&s.results_dir).unwrap();
    let file = s.results_dir.join(format!("bench-{}.json", date.replace(':', "")));
    std::fs::write(&file, serde_json::to_string_pretty(&raw).unwrap()).unwrap();
    let _ = writeln!(out, "\nRaw results: {}", file.display());
    println!("{out}");
    let _ = std::fs::remove_dir_all(&s.paths.scratch);
}
