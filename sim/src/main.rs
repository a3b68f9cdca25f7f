//! `make fleet-sim`: fleets of 10 to 10,000 simulated Envoys over 10³ to
//! 10⁶ keys, running the real lease pools against the quota service's real
//! decisions on a virtual clock (see docs/benchmarks.md, "Fleet
//! simulation"). Writes a markdown report and a CSV to the results
//! directory and the calls-per-second plot to the plot path.
//!
//!     floodgate-fleet-sim [RESULTS_DIR] [PLOT_SVG]

mod fleet;
mod keys;
mod report;
mod rng;
mod service;

use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use floodgate_chart::{Axis, Figure, Legend, Mark, Panel, Scale};
use floodgate_core::time::{Nanos, SECOND};

use floodgate_core::lease::overshoot::{worst_case_over, Overshoot};

use crate::fleet::{simulate, FleetConfig, FleetOutcome};

/// The fixed seed: the same run gives the same numbers.
const SEED: u64 = 21;

/// Fleet sizes and key counts of the grid.
const FLEETS: [u32; 4] = [10, 100, 1_000, 10_000];
const KEY_COUNTS: [u64; 4] = [1_000, 10_000, 100_000, 1_000_000];

/// Keys simulated one by one (the head), and keys drawn per stratum of the tail.
const HEAD: u64 = 1_000;
const PER_STRATUM: u64 = 150;

/// Virtual time: warm-up, measured span, then the span with the restart.
const WARMUP: Nanos = Nanos::from_secs(70);
const MEASURE: Nanos = Nanos::from_secs(60);
const AFTER: Nanos = Nanos::from_secs(35);
const RESTART_AT: Nanos = Nanos::from_nanos(2_500_000_000);

fn grid(allowances: bool) -> Result<Vec<FleetConfig>, String> {
    let mut configs = Vec::new();
    for &total in &KEY_COUNTS {
        let keys = keys::zipf(total, HEAD, PER_STRATUM, SEED ^ total)?;
        for &envoys in &FLEETS {
            configs.push(FleetConfig {
                name: format!("{envoys}x{total}"),
                envoys,
                total_keys: total,
                keys: keys.clone(),
                warmup: WARMUP,
                measure: MEASURE,
                after: AFTER,
                restart_at: Some(RESTART_AT),
                seed: SEED ^ total ^ (u64::from(envoys) << 32),
                allowances,
                overshoot: None,
            });
        }
    }
    Ok(configs)
}

/// The end-to-end test's size (`tests/tests/long_tail.rs`): 3 Envoys, 300
/// keys at 3 requests a second, per-second windows of 40.
fn e2e(allowances: bool) -> Result<FleetConfig, String> {
    Ok(FleetConfig {
        name: "e2e-3x300".into(),
        envoys: 3,
        total_keys: 300,
        keys: keys::flat(300)?,
        warmup: WARMUP,
        measure: MEASURE,
        after: Nanos::ZERO,
        restart_at: None,
        seed: SEED,
        allowances,
        overshoot: None,
    })
}

/// Fleet sizes of the overshoot table (3: the end-to-end test's).
const OVERSHOOT_FLEETS: [u32; 4] = [3, 100, 1_000, 10_000];

/// The overshoot table: thin keys (`keys::thin`) over fleets of
/// [`OVERSHOOT_FLEETS`], strict and with a budget of 1 a second.
fn overshoot_grid(allowances: bool) -> Result<Vec<FleetConfig>, String> {
    let keys = keys::thin(200)?;
    let mut configs = Vec::new();
    for &envoys in &OVERSHOOT_FLEETS {
        for overshoot in [None, Some(OVERSHOOT)] {
            configs.push(FleetConfig {
                name: format!("{envoys}x200-{}", if overshoot.is_some() { "overshoot" } else { "strict" }),
                envoys,
                total_keys: 200,
                keys: keys.clone(),
                warmup: WARMUP,
                measure: Nanos::from_secs(30),
                after: Nanos::ZERO,
                restart_at: None,
                seed: SEED ^ u64::from(envoys),
                allowances,
                overshoot,
            });
        }
    }
    Ok(configs)
}

/// The overshoot table's budget: 1 unit a second per key and Envoy.
const OVERSHOOT: Overshoot = Overshoot { limit: 1, period: SECOND };

/// Runs `configs` on two threads (the machine's cores); results in order.
fn run_all(configs: &[FleetConfig]) -> Result<Vec<FleetOutcome>, String> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<FleetOutcome, String>>>> = Mutex::new(vec![None; configs.len()]);
    std::thread::scope(|scope| {
        for _ in 0..2 {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(config) = configs.get(i) else { break };
                let started = Instant::now();
                let outcome = simulate(config);
                eprintln!("fleet-sim: {} in {:.1} s", config.name, started.elapsed().as_secs_f64());
                if let Ok(mut results) = results.lock() {
                    if let Some(slot) = results.get_mut(i) {
                        *slot = Some(outcome);
                    }
                }
            });
        }
    });
    let results = results.into_inner().map_err(|_| "a simulation thread panicked".to_string())?;
    results.into_iter().map(|r| r.unwrap_or_else(|| Err("a configuration did not run".into()))).collect()
}

fn main() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().unwrap_or_else(|| "target/fleet-sim".into());
    let plot = args.next().unwrap_or_else(|| "docs/plots/fleet-sim.svg".into());
    let started = Instant::now();
    // `FLEET_SIM_ALLOWANCES=0`: the service grants no allowances (to compare).
    let allowances = std::env::var("FLEET_SIM_ALLOWANCES").map_or(true, |v| v != "0");
    let mut configs = grid(allowances)?;
    // `FLEET_SIM_ONLY=10x1000,100x10000`: just those sizes (while working on it).
    if let Ok(only) = std::env::var("FLEET_SIM_ONLY") {
        let names: Vec<&str> = only.split(',').collect();
        configs.retain(|c| names.contains(&c.name.as_str()));
    }
    let overshoot = overshoot_grid(allowances)?;
    let grid_len = configs.len();
    configs.extend(overshoot);
    configs.push(e2e(allowances)?);
    let mut outcomes = run_all(&configs)?;
    let e2e = outcomes.pop().ok_or("no e2e outcome")?;
    let overshoot = outcomes.split_off(grid_len);

    let mut md = String::new();
    let _ = writeln!(md, "# Fleet simulation\n");
    let _ = writeln!(
        md,
        "Real `LeasePool`s (floodgate-core) against the quota service's real decisions (`floodgate_quota::store::decide`) \
         on a virtual clock; seed {SEED}. Per size: {} s warm-up, {} s measured, then {} s in which the store is emptied \
         (a restart) {:.1} s in. Keys: the {HEAD} hottest simulated each, the tail sampled ({PER_STRATUM} keys per \
         doubling of rank, each weighted by its stratum's size over {PER_STRATUM}); calls/s, leases/s, bytes and state \
         are scaled by those weights. Calls/s is the batching model's for the whole fleet (the simulated calls, which \
         only the sampled keys share, in brackets) except at 10³ keys, where every key is simulated and the count is \
         the simulation's own. Bytes: JSON bodies both ways, no HTTP headers. Allowances: {}.\n",
        WARMUP / SECOND,
        MEASURE / SECOND,
        AFTER / SECOND,
        RESTART_AT.as_secs_f64(),
        if allowances { "granted to the leases that ask (as the filter does)" } else { "OFF (FLEET_SIM_ALLOWANCES=0)" },
    );
    let _ = writeln!(md, "{}", report::HEADER);
    for o in &outcomes {
        let _ = writeln!(md, "{}", report::row(o));
    }
    let _ = writeln!(
        md,
        "\nUtilisation under excess demand by shape (admitted ÷ what each window's arrivals could use of its \
         limit, `min(arrivals, limit)`), and windows over the limit after the restart by how long after it they \
         started (a window spanning it: 0 s):\n\n| Envoys | keys | per-second windows | per-minute windows | token buckets | over, ≤1 s | ≤5 s | ≤10 s | ≤20 s | later |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for o in &outcomes {
        let pct = |x: (f64, f64)| if x.1 > 0.0 { format!("{:.1} %", 100.0 * report::share(x)) } else { "–".into() };
        let b = o.over_after_by;
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            o.envoys,
            o.total_keys,
            pct(o.excess_by_shape[0]),
            pct(o.excess_by_shape[1]),
            pct(o.excess_by_shape[2]),
            b[0],
            b[1],
            b[2],
            b[3],
            b[4]
        );
    }
    let _ = writeln!(md, "\nModel check (every key simulated, 10³ keys): simulated calls/s vs the batching model's:\n");
    for o in outcomes.iter().filter(|o| o.exact) {
        let _ = writeln!(
            md,
            "- {} Envoys: {:.1} simulated, {:.1} modelled",
            o.envoys,
            report::simulated(o).total(),
            report::modelled(o).total()
        );
    }
    let _ =
        writeln!(md, "\nCallouts per request, thin pairs (L = lease lifetime {} s):\n", fleet::LEASE_TTL.as_secs_f64());
    let _ = writeln!(md, "{}", report::thin_pairs(&outcomes, &[0.1, 1.0, 10.0, 100.0], &FLEETS));
    let _ = writeln!(
        md,
        "\nThin pairs with an overshoot budget: 200 keys with per-second windows of 10, three in four at 2 req/s, one \
         in four at 20 req/s (twice its limit), spread evenly over the fleet; strict (the default) against a budget of \
         1 unit a second per key and Envoy, 30 s measured. Over: the most any window admitted above its limit, and \
         the worst case `E × limit × (⌈W/period⌉ + 1)` at the largest E (Envoys that admitted the key without a lease in \
         a window) the run allows; beyond it: windows above their own E's worst case (must be 0).\n\n{}",
        report::OVERSHOOT_HEADER
    );
    for o in &overshoot {
        let worst = worst_case_over(u64::from(o.envoys), &OVERSHOOT, SECOND);
        let _ = writeln!(md, "{}", report::overshoot_row(o, worst));
    }
    let n = e2e.requests.max(1.0);
    let _ = writeln!(
        md,
        "E2E COMPARISON (3 Envoys x 300 keys, per-second windows of 40, keys at 3 req/s, {} s): callouts per request {:.3} \
         ({} leases / {:.0} requests; {} lease calls, {:.3} per request), share waited {:.4} (of which at a cold pair, no live lease: {:.4}), share denied {:.4} (waited out {:.4}), windows over the limit {}\n",
        MEASURE / SECOND,
        e2e.sim_leases as f64 / n,
        e2e.sim_leases,
        e2e.requests,
        e2e.sim_lease_calls,
        e2e.sim_lease_calls as f64 / n,
        e2e.waited / n,
        e2e.waited_cold / n,
        e2e.denied / n,
        e2e.waited_out / n,
        e2e.over_before + e2e.over_after,
    );
    if let Some(big) = outcomes.iter().find(|o| o.envoys == 10_000 && o.total_keys == 1_000_000) {
        let c = report::calls(big);
        let _ = writeln!(
            md,
            "At 10,000 Envoys x 10⁶ keys the quota service must sustain {:.0} calls/s ({:.0} lease, {:.0} return), {:.0} leases/s \
             (each one store transaction on the bucket plus its record), {:.1} MB/s of bodies, {:.1} MB of state ({:.1} MB of it lease records). \
             Every key of one domain carries the domain as its Redis Cluster hash tag (`fg:{{edge}}:…`), so one domain's load is one shard's: \
             a cluster of N shards spreads domains, not keys.\n",
            c.total(),
            c.lease,
            c.returns,
            report::leases(big),
            report::bytes(big) / 1e6,
            big.state_mean / 1e6,
            big.state_records_mean / 1e6,
        );
    }
    print!("{md}");
    // Not in the report: the report is deterministic (the same bytes from
    // the same code), the wall time is the machine's.
    eprintln!("fleet-sim: wall time {:.0} s", started.elapsed().as_secs_f64());

    std::fs::create_dir_all(&dir).map_err(|e| format!("{dir}: {e}"))?;
    std::fs::write(format!("{dir}/fleet-sim.md"), &md).map_err(|e| e.to_string())?;
    let mut csv = String::from(report::CSV_HEADER);
    csv.push('\n');
    for o in outcomes.iter().chain(std::iter::once(&e2e)) {
        csv.push_str(&report::csv(o));
        csv.push('\n');
    }
    std::fs::write(format!("{dir}/fleet-sim.csv"), csv).map_err(|e| e.to_string())?;
    let svg = calls_figure(&outcomes).to_svg();
    if let Some(parent) = std::path::Path::new(&plot).parent() {
        std::fs::create_dir_all(parent).map_err(|e| e.to_string())?;
    }
    std::fs::write(&plot, svg).map_err(|e| format!("{plot}: {e}"))?;
    eprintln!("fleet-sim: wrote {dir}/fleet-sim.md, {dir}/fleet-sim.csv and {plot}");
    Ok(())
}

/// The plot: the quota service's calls per second by fleet size, one line
/// per key count, on log-log axes.
fn calls_figure(outcomes: &[FleetOutcome]) -> Figure {
    const COLORS: [&str; 6] = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"];
    let lines = KEY_COUNTS
        .iter()
        .zip(COLORS.iter().cycle())
        .map(|(&total, color)| Mark::Line {
            legend: Legend::new(format!("{total} keys"), color),
            points: outcomes
                .iter()
                .filter(|o| o.total_keys == total)
                .map(|o| (f64::from(o.envoys), report::calls(o).total()))
                .collect(),
            step: false,
            dashed: false,
            width: 2.0,
            markers: true,
        })
        .collect();
    Figure {
        title: "Quota service calls/s by fleet size (fleet simulation)".into(),
        subtitle: Vec::new(),
        x: Axis::new("Envoys", Scale::Log),
        plot_height: 360.0,
        panels: vec![Panel { y: Axis::new("calls/s", Scale::Log), marks: lines }],
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use crate::keys::{Key, Shape};

    /// Three Envoys, a few keys of each shape, some limited below their
    /// demand, for a few seconds: no window lets more through fleet-wide
    /// than its limit, and a request waits only where its pair is cold.
    #[test]
    fn a_small_fleet_never_passes_a_limit_and_waits_only_at_cold_pairs() {
        let shapes = [Shape::PerSecond, Shape::PerMinute, Shape::Bucket];
        let keys: Vec<Key> = (0..18)
            .map(|i| {
                let shape = shapes[i % 3];
                let rate = [0.5, 2.0, 8.0, 20.0, 40.0, 3.0][i % 6];
                let over = i % 6 == 4;
                let per_period = shape.period().events_at(rate);
                let limit = if over { per_period / 2.0 } else { per_period * 3.0 + 5.0 };
                Key::new(i, rate, 1.0, shape, limit.ceil() as u64, over).unwrap()
            })
            .collect();
        let config = FleetConfig {
            name: "test".into(),
            envoys: 3,
            total_keys: keys.len() as u64,
            keys,
            warmup: Nanos::from_secs(2),
            measure: Nanos::from_secs(10),
            after: Nanos::ZERO,
            restart_at: None,
            seed: 7,
            allowances: true,
            overshoot: None,
        };
        let out = simulate(&config).unwrap();
        assert!(out.windows_checked > 100, "{out:?}");
        assert_eq!((out.over_before, out.over_after), (0, 0), "{out:?}");
        assert!(out.waited > 0.0, "cold pairs wait");
        // Leases of one window: a request waits only at a cold pair, or at
        // one whose lease went to the one request it had seen, when the
        // key's tokens were no longer plentiful (12 of 2,218 here). An
        // allowance sized λ + 2√λ + 1 runs dry in a window now and then, and
        // its requests wait for a lease of that window. No wait lasts the
        // whole `max_wait`.
        assert_eq!(out.waited_warm_under, 0.0, "warm waits: {out:?}");
        assert!(out.waited_after_one * 100.0 <= 2.0 * out.requests, "{out:?}");
        assert!(out.waited_dry_allowance * 100.0 <= 3.0 * out.requests, "{out:?}");
        assert_eq!(out.waited_out, 0.0, "{out:?}");
        let again = simulate(&config).unwrap();
        assert_eq!((again.requests, again.sim_leases, again.waited), (out.requests, out.sim_leases, out.waited));
    }
}
