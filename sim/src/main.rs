//! `make fleet-sim`: fleets of 10 to 10,000 simulated Envoys over 10³ to
//! 10⁶ keys, at 100 and 1,000 requests a second per Envoy, behind a
//! uniform and a key-affine balancer, running the real lease pools in the
//! real bucket tables against the quota service's real decisions on a
//! virtual clock, beside check mode on the same requests (see
//! docs/benchmarks.md, "Fleet simulation"). Writes a markdown report and a
//! CSV to the results directory and the calls-per-request plot to the plot
//! path.
//!
//!     floodgate-fleet-sim [RESULTS_DIR] [PLOT_SVG]

use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use floodgate_chart::{Axis, Figure, Legend, Mark, Panel, Scale};
use floodgate_core::lease::overshoot::worst_case_over;
use floodgate_core::time::SECOND;

use floodgate_fleet_sim::grid::{self, Job, Run, BUDGET, FLEETS, KEY_COUNTS, PER_ENVOY, SEED};
use floodgate_fleet_sim::keys::Balancer;
use floodgate_fleet_sim::report;

/// Runs `jobs` on two threads (the machine's cores), the costliest first;
/// results in the jobs' order.
fn run_all(jobs: &[Job]) -> Result<Vec<Run>, String> {
    let mut order: Vec<(usize, &Job)> = jobs.iter().enumerate().collect();
    order.sort_by(|(_, a), (_, b)| b.cost().total_cmp(&a.cost()));
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<Run, String>>>> = Mutex::new(vec![None; jobs.len()]);
    std::thread::scope(|scope| {
        for _ in 0..2 {
            scope.spawn(|| {
                while let Some(&(i, job)) = order.get(next.fetch_add(1, Ordering::SeqCst)) {
                    let started = Instant::now();
                    let run = job.run();
                    eprintln!("fleet-sim: {} in {:.1} s", job.config.name, started.elapsed().as_secs_f64());
                    if let Ok(mut results) = results.lock() {
                        if let Some(slot) = results.get_mut(i) {
                            *slot = Some(run);
                        }
                    }
                }
            });
        }
    });
    let results = results.into_inner().map_err(|_| "a simulation thread panicked".to_string())?;
    results.into_iter().map(|r| r.unwrap_or_else(|| Err("a configuration did not run".into()))).collect()
}

/// The run named `name`.
fn named<'a>(runs: &'a [Run], name: &str) -> Option<&'a Run> {
    runs.iter().find(|r| r.outcome.name == name)
}

fn main() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().unwrap_or_else(|| "target/fleet-sim".into());
    let plot = args.next().unwrap_or_else(|| "docs/plots/fleet-sim.svg".into());
    let started = Instant::now();
    let budget = match std::env::var("FLEET_SIM_BUDGET") {
        Ok(text) => text.parse::<f64>().map_err(|e| format!("FLEET_SIM_BUDGET={text}: {e}"))?,
        Err(_) => BUDGET,
    };
    let mut jobs = grid::grid(budget)?;
    jobs.extend(grid::sampling_check()?);
    jobs.extend(grid::e2e()?);
    jobs.extend(grid::overshoot()?);
    // `FLEET_SIM_ONLY=100x10000@100,e2e`: only the runs whose names contain one of these.
    if let Ok(only) = std::env::var("FLEET_SIM_ONLY") {
        let parts: Vec<&str> = only.split(',').collect();
        jobs.retain(|j| parts.iter().any(|p| j.config.name.contains(p)));
    }
    let runs = run_all(&jobs)?;
    let md = report(&runs, budget);
    print!("{md}");
    // Not in the report: the report is deterministic (the same bytes from
    // the same code), the wall time is the machine's.
    eprintln!("fleet-sim: wall time {:.0} s", started.elapsed().as_secs_f64());

    std::fs::create_dir_all(&dir).map_err(|e| format!("{dir}: {e}"))?;
    std::fs::write(format!("{dir}/fleet-sim.md"), &md).map_err(|e| e.to_string())?;
    let mut csv = String::from(report::CSV_HEADER);
    csv.push('\n');
    for run in &runs {
        csv.push_str(&report::csv(run));
        csv.push('\n');
    }
    std::fs::write(format!("{dir}/fleet-sim.csv"), csv).map_err(|e| e.to_string())?;
    let svg = plot_calls(&runs).to_svg();
    if let Some(parent) = std::path::Path::new(&plot).parent() {
        std::fs::create_dir_all(parent).map_err(|e| e.to_string())?;
    }
    std::fs::write(&plot, svg).map_err(|e| format!("{plot}: {e}"))?;
    eprintln!("fleet-sim: wrote {dir}/fleet-sim.md, {dir}/fleet-sim.csv and {plot}");
    Ok(())
}

/// The whole report, from the runs.
fn report(runs: &[Run], budget: f64) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# Fleet simulation\n");
    let _ = writeln!(
        md,
        "Seed {SEED}; budget {budget:.0} simulated requests a second per configuration. Per configuration: {} s \
         warm-up, {} s measured, then {} s in which the store is emptied (a restart) {:.1} s in. Strict lease mode \
         (the default) under a uniform and a key-affine balancer; check mode on the same requests (uniform runs).\n",
        grid::WARMUP / SECOND,
        grid::MEASURE / SECOND,
        grid::AFTER / SECOND,
        grid::RESTART_AT.as_secs_f64(),
    );
    for &per_envoy in &PER_ENVOY {
        let _ = writeln!(md, "## {per_envoy:.0} requests a second per Envoy\n");
        let _ = writeln!(md, "Calls, store writes, limits:\n\n{}", report::judging_table(runs, per_envoy));
        let _ = writeln!(
            md,
            "Waits (share of requests that waited · p50/p90/p99 of their waits, ms):\n\n{}",
            report::waits_table(runs, per_envoy)
        );
        let _ = writeln!(md, "The service's load:\n\n{}", report::load_table(runs, per_envoy));
        let rates = [0.1, 1.0, 10.0, 100.0, 1000.0];
        for balancer in grid::BALANCERS {
            let _ = writeln!(
                md,
                "Leases per request by key rate, {} balancer:\n\n{}",
                balancer.label(),
                report::thin_pairs(runs, &rates, &FLEETS, per_envoy, balancer)
            );
        }
    }
    let _ = writeln!(md, "## Limits in detail\n\n{}", report::limits_table(runs));
    let _ = writeln!(md, "## How each configuration was sampled\n\n{}", report::plans_table(runs));
    let (envoys, keys, per_envoy) = grid::SAMPLING_CHECK;
    for balancer in grid::BALANCERS {
        let label = balancer.label();
        let (Some(whole), Some(sampled)) =
            (named(runs, &format!("check-whole-{label}")), named(runs, &format!("check-sampled-{label}")))
        else {
            continue;
        };
        let _ = writeln!(
            md,
            "## Sampling check, {label} balancer\n\n{envoys} Envoys × {keys} keys at {per_envoy:.0} requests a second \
             per Envoy, simulated whole and sampled as the grid samples (budget an eighth of its traffic: {} keys, \
             {} per stratum, rate cap {:.0}/s, {} virtual workers):\n\n{}",
            sampled.outcome.simulated_keys,
            sampled.plan.per_stratum,
            sampled.plan.rate_cap,
            sampled.modelled.as_ref().map_or(0, |m| m.virtual_workers),
            report::sampling_check(whole, sampled)
        );
    }
    if let (Some(whole), Some(sampled)) = (named(runs, "e2e-whole"), named(runs, "e2e-sampled")) {
        let _ = writeln!(
            md,
            "## Calls model where calls carry several leases\n\nThe end-to-end shape (3 Envoys × 300 keys at 3 \
             requests a second, per-second windows of 40) simulated whole, against the model fed one key in ten \
             (each standing for ten):\n\n{}",
            report::calls_check(whole, sampled)
        );
        let o = &whole.outcome;
        let n = o.requests.max(1.0);
        let (lease, returns) = o.sim_calls.counts();
        let _ = writeln!(
            md,
            "End-to-end shape, simulated: {:.4} lease calls, {:.4} return calls and {:.4} leases per request; \
             {:.2} % of requests waited ({:.2} % at a cold pair), waits p50/p90/p99 {} ms; windows over the limit {}.\n",
            lease / n,
            returns / n,
            o.leases / n,
            100.0 * o.waited / n,
            100.0 * o.waited_cold / n,
            report::quantiles(&o.waits),
            o.over_before + o.over_after,
        );
    }
    let overshoot: Vec<&Run> = runs.iter().filter(|r| r.outcome.name.contains("x200-")).collect();
    if !overshoot.is_empty() {
        let _ = writeln!(
            md,
            "## Thin pairs with an overshoot budget\n\n200 keys with per-second windows of 10, three in four at 2 \
             req/s, one in four at 20 req/s (twice its limit), spread evenly over the fleet; strict against a budget \
             of 1 unit a second per key and Envoy, 30 s measured.\n\n{}",
            report::OVERSHOOT_HEADER
        );
        for run in overshoot {
            let worst = worst_case_over(u64::from(run.outcome.envoys), &grid::OVERSHOOT, SECOND);
            let _ = writeln!(md, "{}", report::overshoot_row(&run.outcome, worst));
        }
        md.push('\n');
    }
    md
}

/// Calls per request by fleet size at 1,000 requests a second per Envoy:
/// one line per key count and balancer (dashed: key-affine), and check
/// mode's one call per request.
fn plot_calls(runs: &[Run]) -> Figure {
    const COLORS: [&str; 4] = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"];
    let mut lines = Vec::new();
    for balancer in grid::BALANCERS {
        for (&keys, color) in KEY_COUNTS.iter().zip(COLORS) {
            let points = runs
                .iter()
                .filter(|r| {
                    r.traffic.is_some_and(|t| t.balancer == balancer && t.keys == keys && t.per_envoy == 1_000.0)
                })
                .map(|r| (f64::from(r.outcome.envoys), report::lease_figures(r).calls_per_request()))
                .collect();
            lines.push(Mark::Line {
                legend: Legend::new(format!("{}, {} keys", balancer.label(), report::si(keys as f64)), color),
                points,
                step: false,
                dashed: balancer == Balancer::KeyAffine,
                width: 2.0,
                markers: true,
            });
        }
    }
    lines.push(Mark::Line {
        legend: Legend::new("check mode", "#7f7f7f"),
        points: FLEETS.iter().map(|&n| (f64::from(n), 1.0)).collect(),
        step: false,
        dashed: false,
        width: 1.0,
        markers: false,
    });
    Figure {
        title: "Quota service calls per request, strict lease mode (fleet simulation, 1,000 req/s per Envoy)".into(),
        subtitle: Vec::new(),
        x: Axis::new("Envoys", Scale::Log),
        plot_height: 360.0,
        panels: vec![Panel { y: Axis::new("calls per request", Scale::Log), marks: lines }],
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use floodgate_core::time::Nanos;

    use floodgate_fleet_sim::fleet::{default_quota, simulate, table_groups, FleetConfig};
    use floodgate_fleet_sim::keys::{Envoys, Key, Shape};
    use floodgate_fleet_sim::rng::Network;

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
                Key::new(i, rate, shape, limit.ceil() as u64, over, Envoys::All).unwrap()
            })
            .collect();
        let config = FleetConfig {
            name: "test".into(),
            envoys: 3,
            total_keys: keys.len() as u64,
            keys,
            exact: true,
            table_groups: table_groups(1.0),
            warmup: Nanos::from_secs(2),
            measure: Nanos::from_secs(10),
            after: Nanos::ZERO,
            restart_at: None,
            seed: 7,
            allowances: true,
            overshoot: None,
            check_baseline: true,
            record_items: false,
            network: Network::Datacenter,
            quota: default_quota(),
        };
        let out = simulate(&config).unwrap();
        // Fixed windows one by one; token buckets over every span of 1 s
        // and 10 s, against burst + rate × (span + lease lifetime).
        assert!(out.windows_checked > 50, "{out:?}");
        assert_eq!((out.over_before, out.over_after), (0, 0), "{out:?}");
        assert_eq!(out.bucket_spans.map(|s| (s.checked, s.over_leased)), [(6, 0), (6, 0)], "{out:?}");
        assert!(out.waited > 0.0, "cold pairs wait");
        // Leases of one window: a request waits only at a cold pair, or at
        // one whose lease went to the one request it had seen, when the
        // key's tokens were no longer plentiful. An allowance sized
        // λ + 2√λ + 1 runs dry in a window now and then, and its requests
        // wait for a lease of that window. No wait lasts the whole
        // `max_wait`.
        assert_eq!(out.waited_warm_under, 0.0, "warm waits: {out:?}");
        assert!(out.waited_after_one * 100.0 <= 2.0 * out.requests, "{out:?}");
        assert!(out.waited_dry_allowance * 100.0 <= 3.0 * out.requests, "{out:?}");
        assert_eq!(out.waited_out, 0.0, "{out:?}");
        // Check mode on the same requests: every one asked, none over.
        let check = out.check.as_ref().unwrap();
        assert_eq!(check.requests, out.requests);
        assert_eq!(check.over, 0, "{check:?}");
        let again = simulate(&config).unwrap();
        assert_eq!((again.requests, again.sim_leases, again.waited), (out.requests, out.sim_leases, out.waited));
    }
}
