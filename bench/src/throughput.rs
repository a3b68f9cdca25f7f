//! The throughput part: every selected variant under wrk, alternated round
//! by round; the table, its sanity warnings, per-request costs and targets,
//! then the global-mode table.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use floodgate_e2e::Envoy;
use serde_json::{json, Value};

use crate::callouts::CalloutCounts;
use crate::global_report;
use crate::load::{self, wrk, WrkResult};
use crate::results::{against_reference, columns, Results, VariantResult};
use crate::rig::Rig;
use crate::settings::BenchSettings;
use crate::stats::{load_average, ms, ratio};
use crate::targets::ReportTable;
use crate::variants::{QuotaBackend, KEYS, PROBE_REPEATS};
use crate::verdicts;

pub fn throughput(s: &BenchSettings, out: &mut String, raw: &mut BTreeMap<String, Value>) {
    load::check_script(&s.wrk.script);
    let variants = s.selected();
    assert!(!variants.is_empty(), "BENCH_VARIANTS selects no variant");
    let rig = Rig::start(s, "tp", &variants);
    for (envoy, v) in rig.envoys.iter().zip(&variants) {
        eprintln!("throughput: warm-up {} ({} s)", v.id, s.warmup);
        if s.warmup > 0 {
            wrk(&s.wrk, envoy.port, s.warmup, v.keys);
        }
    }
    let mut results = Results(
        variants
            .iter()
            .map(|&variant| VariantResult {
                variant,
                rounds: Vec::new(),
                callouts: Vec::new(),
                callouts_second_half: Vec::new(),
            })
            .collect(),
    );
    let mut load_averages = vec![load_average()];
    for round in 1..=s.rounds {
        for (envoy, result) in rig.envoys.iter().zip(&mut results.0) {
            measure(s, &rig, envoy, result);
            eprintln!(
                "throughput: round {round}/{} {}",
                s.rounds,
                result.rounds.last().unwrap().summary(result.variant.id)
            );
        }
        load_averages.push(load_average());
    }
    let json_variants = table(s, out, &results, &load_averages);
    warnings(out, &results);
    let mut targets =
        verdicts::report(out, ReportTable::Throughput, &variants, &s.paths.quota_unit, &|id, m| results.figures(id, m));
    rls_answers(out, &rig, &results);
    costs(out, &results);
    let (global_mode, global_targets) = global_report::report(out, s, &results);
    targets.extend(global_targets);
    raw.insert(
        "throughput".into(),
        json!({
            "connections": s.wrk.connections, "threads": s.wrk.threads, "rounds": s.rounds,
            "duration_s": s.duration, "warmup_s": s.warmup, "variants": json_variants,
            "load_averages": load_averages, "global_mode": global_mode, "targets": targets,
        }),
    );
}

/// One round of one variant: wrk, and for a global-mode variant its
/// callouts before, in the middle of and after the load.
fn measure(s: &BenchSettings, rig: &Rig, envoy: &Envoy, result: &mut VariantResult) {
    if result.variant.rewarm > 0 {
        wrk(&s.wrk, envoy.port, result.variant.rewarm, result.variant.keys);
    }
    let counting = rig.callout_service(result.variant);
    let before = counting.map(|q| CalloutCounts::read(envoy, q));
    let (r, middle) = std::thread::scope(|scope| {
        let middle = counting.map(|q| {
            scope.spawn(move || {
                std::thread::sleep(Duration::from_secs(s.duration) / 2);
                CalloutCounts::read(envoy, q)
            })
        });
        let r = wrk(&s.wrk, envoy.port, s.duration, result.variant.keys);
        (r, middle.map(|m| m.join().unwrap()))
    });
    if let (Some(q), Some(before), Some(middle)) = (counting, before, middle) {
        let after = CalloutCounts::read(envoy, q);
        result.callouts.push(after.since(before));
        result.callouts_second_half.push(after.since(middle));
    }
    result.rounds.push(r);
}

/// The main table; returns its rows for the JSON file.
fn table(s: &BenchSettings, out: &mut String, results: &Results, load_averages: &[f64]) -> Vec<Value> {
    let (load_min, load_max) = crate::stats::spread(load_averages);
    let columns = columns(ReportTable::Throughput);
    let _ = writeln!(
        out,
        "\n## Throughput\n\nwrk, {} connections, {} threads, HTTP/1.1 keep-alive on loopback, {KEYS} keys{}; \
         {} round(s) of {} s per variant, alternating; medians over rounds. \
         One-minute load average at the start and after each round: {load_min:.1}–{load_max:.1}.\n",
        s.wrk.connections,
        s.wrk.threads,
        other_key_counts(results),
        s.rounds,
        s.duration
    );
    let heads: String = columns.iter().map(|c| format!(" ratio to ({c}) |")).collect();
    let _ = writeln!(
        out,
        "| variant | req/s | p50 ms | p99 ms |{heads} ÷ reference (per-round median) | non-2xx per round |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|{}---:|---:|", "---:|".repeat(columns.len()));
    let mut rows = Vec::new();
    for r in &results.0 {
        let (id, label) = (r.variant.id, r.variant.label);
        let rps = r.median(WrkResult::rps);
        let (p50, p99) = (r.median(|w| w.p50_us as f64), r.median(|w| w.p99_us as f64));
        let cells: String = columns.iter().map(|c| format!(" {} |", ratio(rps, results.rps(c)))).collect();
        let mut median_json = json!({"rps": rps, "p50_us": p50, "p99_us": p99});
        for c in &columns {
            median_json[format!("ratio_{c}")] = json!(rps / results.rps(c));
        }
        let _ = writeln!(
            out,
            "| ({id}) {label} | {rps:.0} | {} | {} |{cells} {} | {:.0} |",
            ms(p50),
            ms(p99),
            against_reference(results, r),
            r.median(|w| w.non_2xx as f64)
        );
        rows.push(json!({
            "id": id, "label": label,
            "median": median_json,
            "rounds": r.rounds.iter().map(WrkResult::to_json).collect::<Vec<_>>(),
            "callouts": r.callouts.iter().map(|c| c.to_json()).collect::<Vec<_>>(),
            "callouts_second_half": r.callouts_second_half.iter().map(|c| c.to_json()).collect::<Vec<_>>(),
        }));
    }
    rows
}

/// The variants that cycle through another number of keys than [`KEYS`],
/// e.g. " (1000 for (dk), (gk))".
fn other_key_counts(results: &Results) -> String {
    let mut by_count: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    for r in results.0.iter().filter(|r| r.variant.keys != KEYS) {
        by_count.entry(r.variant.keys).or_default().push(format!("({})", r.variant.id));
    }
    let parts: Vec<String> = by_count.iter().map(|(n, ids)| format!("{n} for {}", ids.join(", "))).collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!(" ({})", parts.join("; "))
    }
}

/// Sanity of the set-up, reported rather than asserted.
fn warnings(out: &mut String, results: &Results) {
    for r in &results.0 {
        let id = r.variant.id;
        let limited: u64 = r.rounds.iter().map(|w| w.non_2xx).sum();
        let errors: u64 = r.rounds.iter().map(|w| w.socket_errors).sum();
        if r.variant.limits && limited == 0 {
            let _ =
                writeln!(out, "\n**Warning:** ({id}) was meant to limit most requests but answered none as limited.");
        }
        if !r.variant.limits && limited > 0 {
            let _ = writeln!(out, "\n**Warning:** ({id}) answered {limited} requests with non-2xx.");
        }
        if errors > 0 {
            let _ = writeln!(out, "\n**Warning:** ({id}) had {errors} socket errors.");
        }
    }
}

/// For Envoy's own global filter: its ratio to its ceiling (medians), and
/// the answers it got from the service (the filter acts only when it calls
/// the service).
fn rls_answers(out: &mut String, rig: &Rig, results: &Results) {
    for (envoy, r) in rig.envoys.iter().zip(&results.0).filter(|(_, r)| r.variant.service == QuotaBackend::Rls) {
        let (id, ceiling) = (r.variant.id, r.variant.reference.unwrap_or_default());
        let calls = envoy.stats_flushed().get("cluster.upstream.ratelimit.ok").copied().unwrap_or(0);
        let _ = writeln!(
            out,
            "\n({id})/({ceiling}) = {}: Envoy's global ratelimit filter with one gRPC call to floodgate-quota per \
             request, against the same proxying without it (({ceiling}) is ({id})'s ceiling; the quota service \
             shares the two cores). ({id}) got {calls} OK answers from the service.",
            ratio(r.median(WrkResult::rps), results.rps(ceiling)),
        );
        if calls == 0 {
            let _ = writeln!(out, "\n**Warning:** ({id}) never got an answer from the quota service.");
        }
    }
}

/// The share of limited requests of the limiting variants, the wall time
/// per request of every variant, and the cost of one host call of each probe.
fn costs(out: &mut String, results: &Results) {
    for r in results.0.iter().filter(|r| r.variant.limits) {
        let limited: u64 = r.rounds.iter().map(|w| w.non_2xx).sum();
        let share = 100.0 * limited as f64 / r.rounds.iter().map(|w| w.requests).sum::<u64>().max(1) as f64;
        let _ = writeln!(out, "\nIn ({}), {share:.1}% of requests were limited (the 429 path).", r.variant.id);
    }
    // Wall time per request with the machine saturated (load generator
    // included): the gaps between variants are what each piece costs.
    let per_request: Vec<String> =
        results.0.iter().map(|r| format!("({}) {:.2}", r.variant.id, 1e6 / r.median(WrkResult::rps))).collect();
    let _ = writeln!(out, "\nTime per request (1 / req/s), µs: {}.", per_request.join(", "));
    let probes: Vec<String> = results
        .0
        .iter()
        .filter(|r| r.variant.probe)
        .map(|r| {
            let reference = results.rps(r.variant.reference.unwrap_or_default());
            let cost = (1e6 / r.median(WrkResult::rps) - 1e6 / reference) / f64::from(PROBE_REPEATS);
            format!("{}: {cost:.2}", r.variant.label)
        })
        .collect();
    if !probes.is_empty() {
        let _ = writeln!(out, "\nCost of one host call, µs ((probe − c) / {PROBE_REPEATS}): {}.", probes.join("; "));
    }
}
