//! What the runs add up to, as markdown tables and a CSV: per fleet size,
//! key count, rate per Envoy and balancer, the service's calls and store
//! writes per request beside check mode's, the requests' waits, windows
//! over their limit, utilisation under excess demand, and the service
//! cores the load needs at the throughput `make quota-bench` measured.

use std::fmt::Write as _;

use crate::fleet::{CallSizes, FleetOutcome, LEASE_TTL};
use crate::grid::Run;
use crate::keys::Balancer;
use crate::stats::Tally;

/// One service core's throughput, from `make quota-bench`'s latest
/// recorded run (docs/benchmarks.md, "Quota service", recorded run of
/// 2026-11-26 05:48 UTC): checks a second, and leases a second at 1, 10
/// and 200 leases a call.
#[derive(Debug, Clone, Copy)]
pub struct Throughput {
    /// `/v1/check` calls a second (one descriptor each).
    pub checks: f64,
    /// `(leases per call, leases a second)`.
    pub leases: [(f64, f64); 3],
}

/// The memory store (`memory check`, `memory leases, N per call`).
pub const MEMORY: Throughput =
    Throughput { checks: 71_110.0, leases: [(1.0, 55_060.0), (10.0, 178_091.0), (200.0, 367_868.0)] };
/// Redis (`redis check`, `redis leases, N per call`); a Redis Cluster
/// shard serves one domain's keys alike (they share its hash tag).
pub const REDIS: Throughput =
    Throughput { checks: 44_238.0, leases: [(1.0, 33_332.0), (10.0, 64_609.0), (200.0, 80_264.0)] };

impl Throughput {
    /// Seconds of a service core one call of `items` leases takes: the
    /// measured per-call times, linear between the measured sizes (and
    /// beyond the last, with the slope before it). A return call is
    /// costed as a lease call of as many items (not measured).
    pub fn call_secs(&self, items: f64) -> f64 {
        let time = |(k, rate): (f64, f64)| k / rate;
        let points = self.leases.map(|p| (p.0, time(p)));
        let segment = if items <= points[1].0 { (points[0], points[1]) } else { (points[1], points[2]) };
        let ((k0, t0), (k1, t1)) = segment;
        let t = t0 + (items - k0) * (t1 - t0) / (k1 - k0);
        t.max(time(self.leases[0]) * 0.5)
    }

    /// Service cores `calls` over `secs` seconds need.
    pub fn cores_for_calls(&self, calls: &CallSizes, secs: f64) -> f64 {
        let busy: f64 =
            calls.lease.iter().chain(calls.returns.iter()).map(|(&k, &n)| n * self.call_secs(k as f64)).sum();
        busy / secs
    }

    /// Service cores `checks` a second need.
    pub fn cores_for_checks(&self, checks: f64) -> f64 {
        checks / self.checks
    }
}

/// The figures of one run that the tables print.
#[derive(Debug, Clone, Copy, Default)]
pub struct Figures {
    /// Requests a second, fleet-wide.
    pub requests: f64,
    /// Lease calls and return calls a second.
    pub lease_calls: f64,
    /// See [`Figures::lease_calls`].
    pub return_calls: f64,
    /// Leases a second.
    pub leases: f64,
    /// Store values written a second.
    pub writes: f64,
    /// Share of requests that waited.
    pub waited: f64,
    /// Waits' p50, p90, p99 (ms), of the requests that waited.
    pub waits: [f64; 3],
    /// Fixed windows over their limit before the restart.
    pub over: u64,
    /// Token buckets over their own bound (`burst + rate × span`, spans of
    /// 1 s and 10 s) before the restart, and over the leased bound (`+ rate
    /// × lease lifetime`).
    pub over_bucket: (u64, u64),
    /// Admitted ÷ what each window's arrivals could use, keys limited below their demand.
    pub used: Option<f64>,
    /// Service cores, memory store and Redis.
    pub cores: [f64; 2],
    /// Body bytes a second, both ways.
    pub bytes: f64,
}

impl Figures {
    /// Calls per request.
    pub fn calls_per_request(&self) -> f64 {
        (self.lease_calls + self.return_calls) / self.requests.max(1e-9)
    }

    /// Store values written per request.
    pub fn writes_per_request(&self) -> f64 {
        self.writes / self.requests.max(1e-9)
    }
}

/// Lease mode's figures of `run`.
pub fn lease_figures(run: &Run) -> Figures {
    let o = &run.outcome;
    let calls = run.calls();
    let (lease, returns) = calls.counts();
    let over_bucket = (
        o.bucket_spans.iter().map(|s| s.over_own).sum::<u64>(),
        o.bucket_spans.iter().map(|s| s.over_leased).sum::<u64>(),
    );
    Figures {
        requests: o.requests / o.secs,
        lease_calls: lease / o.secs,
        return_calls: returns / o.secs,
        leases: o.leases / o.secs,
        writes: o.writes / o.secs,
        waited: o.waited / o.requests.max(1e-9),
        waits: o.waits.quantiles(),
        over: o.over_before,
        over_bucket,
        used: (o.excess_usable > 0.0).then(|| o.excess_admitted / o.excess_usable),
        cores: [MEMORY.cores_for_calls(calls, o.secs), REDIS.cores_for_calls(calls, o.secs)],
        bytes: bytes(o, calls),
    }
}

/// Check mode's figures of `run` (its baseline), if it ran one.
pub fn check_figures(run: &Run) -> Option<Figures> {
    let o = &run.outcome;
    let c = o.check.as_ref()?;
    let checks = c.requests / o.secs;
    Some(Figures {
        requests: checks,
        lease_calls: checks,
        return_calls: 0.0,
        leases: 0.0,
        writes: c.writes / o.secs,
        waited: 1.0,
        waits: c.waits.quantiles(),
        over: c.over,
        over_bucket: (c.over_bucket, c.over_bucket),
        used: (c.excess.1 > 0.0).then(|| c.excess.0 / c.excess.1),
        cores: [MEMORY.cores_for_checks(checks), REDIS.cores_for_checks(checks)],
        bytes: 0.0,
    })
}

/// Body bytes a second, both ways: the items' (weighted) and each call's own.
fn bytes(o: &FleetOutcome, calls: &CallSizes) -> f64 {
    let (lease, returns) = calls.counts();
    (o.item_bytes + lease * o.lease_call_bytes + returns * o.return_call_bytes) / o.secs
}

/// A number in engineering style: `1.2 k`, `3.45 M`.
pub fn si(x: f64) -> String {
    match x {
        x if x >= 1e9 => format!("{:.2} G", x / 1e9),
        x if x >= 1e6 => format!("{:.2} M", x / 1e6),
        x if x >= 1e3 => format!("{:.1} k", x / 1e3),
        x => format!("{x:.1}"),
    }
}

fn pct(x: f64) -> String {
    format!("{:.1} %", 100.0 * x)
}

fn pct_or_dash(x: Option<f64>) -> String {
    x.map_or("–".into(), pct)
}

fn waits(f: &Figures) -> String {
    if f.waited <= 0.0 {
        return "– (0 %)".into();
    }
    format!("{} · {:.1}/{:.1}/{:.1}", pct(f.waited), f.waits[0], f.waits[1], f.waits[2])
}

/// The grid's runs of `per_envoy` requests a second per Envoy, paired:
/// the uniform balancer's run and the key-affine one's of each size.
fn pairs(runs: &[Run], per_envoy: f64) -> Vec<(&Run, Option<&Run>)> {
    let grid: Vec<&Run> =
        runs.iter().filter(|r| r.in_grid && r.traffic.is_some_and(|t| t.per_envoy == per_envoy)).collect();
    grid.iter()
        .filter(|r| r.traffic.is_some_and(|t| t.balancer == Balancer::Uniform))
        .map(|u| {
            let same = |r: &&&Run| {
                r.traffic
                    .zip(u.traffic)
                    .is_some_and(|(a, b)| a.balancer == Balancer::KeyAffine && a.envoys == b.envoys && a.keys == b.keys)
            };
            (*u, grid.iter().find(same).copied())
        })
        .collect()
}

fn size(run: &Run) -> (u32, String) {
    let t = run.traffic;
    (run.outcome.envoys, si(t.map_or(run.outcome.total_keys as f64, |t| t.keys as f64)))
}

/// The judging table for `per_envoy`: calls and store writes per request
/// (check mode, strict leases under both balancers), windows over a limit
/// before the restart, utilisation under excess demand.
pub fn judging_table(runs: &[Run], per_envoy: f64) -> String {
    let mut md = String::from(
        "| Envoys | keys | requests/s | check: calls/req | writes/req | uniform leases: calls/req | leases/req | writes/req | key-affine leases: calls/req | writes/req | fixed windows over, before the restart (check / uniform / key-affine) | buckets over `burst + rate × span` (check / uniform / key-affine) | used under excess demand (check / uniform / key-affine) |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (u, a) in pairs(runs, per_envoy) {
        let (envoys, keys) = size(u);
        let lease = lease_figures(u);
        let check = check_figures(u).unwrap_or_default();
        let affine = a.map(lease_figures).unwrap_or_default();
        let _ = writeln!(
            md,
            "| {envoys} | {keys} | {} | {:.2} | {:.2} | {:.3} | {:.3} | {:.2} | {:.3} | {:.2} | {} / {} / {} | {} / {} / {} | {} / {} / {} |",
            si(lease.requests),
            check.calls_per_request(),
            check.writes_per_request(),
            lease.calls_per_request(),
            lease.leases / lease.requests.max(1e-9),
            lease.writes_per_request(),
            affine.calls_per_request(),
            affine.writes_per_request(),
            check.over,
            lease.over,
            affine.over,
            check.over_bucket.0,
            lease.over_bucket.0,
            affine.over_bucket.0,
            pct_or_dash(check.used),
            pct_or_dash(lease.used),
            pct_or_dash(affine.used),
        );
    }
    md
}

/// The waits table for `per_envoy`: share of requests that waited, and
/// p50/p90/p99 of their waits (ms).
pub fn waits_table(runs: &[Run], per_envoy: f64) -> String {
    let mut md = String::from(
        "| Envoys | keys | check: waited · p50/p90/p99 ms | uniform leases | key-affine leases | uniform: waits at a cold pair | waited out `max_wait` |\n|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (u, a) in pairs(runs, per_envoy) {
        let (envoys, keys) = size(u);
        let o = &u.outcome;
        let n = o.requests.max(1e-9);
        let _ = writeln!(
            md,
            "| {envoys} | {keys} | {} | {} | {} | {} | {} |",
            check_figures(u).map_or("–".into(), |f| waits(&f)),
            waits(&lease_figures(u)),
            a.map_or("–".into(), |a| waits(&lease_figures(a))),
            pct(o.waited_cold / n),
            pct(o.waited_out / n),
        );
    }
    md
}

/// The service's load for `per_envoy`: calls and leases a second, the
/// service cores they need on the memory store and on Redis, bytes, state.
pub fn load_table(runs: &[Run], per_envoy: f64) -> String {
    let mut md = String::from(
        "| Envoys | keys | check: calls/s · cores memory / Redis | uniform leases: calls/s | leases/s | leases/call | cores memory / Redis | body bytes/s | store state | key-affine: calls/s | leases/call | cores memory / Redis |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (u, a) in pairs(runs, per_envoy) {
        let (envoys, keys) = size(u);
        let lease = lease_figures(u);
        let check = check_figures(u).unwrap_or_default();
        let affine = a.map(lease_figures).unwrap_or_default();
        let per_call = |f: &Figures| if f.lease_calls > 0.0 { f.leases / f.lease_calls } else { 0.0 };
        let _ = writeln!(
            md,
            "| {envoys} | {keys} | {} · {:.2} / {:.2} | {} | {} | {:.1} | {:.2} / {:.2} | {}B | {}B | {} | {:.1} | {:.2} / {:.2} |",
            si(check.lease_calls),
            check.cores[0],
            check.cores[1],
            si(lease.lease_calls + lease.return_calls),
            si(lease.leases),
            per_call(&lease),
            lease.cores[0],
            lease.cores[1],
            si(lease.bytes),
            si(u.outcome.state_mean),
            si(affine.lease_calls + affine.return_calls),
            per_call(&affine),
            affine.cores[0],
            affine.cores[1],
        );
    }
    md
}

/// Limits in detail: windows over after the restart by when they started,
/// token buckets over spans, and the pools' tables.
pub fn limits_table(runs: &[Run]) -> String {
    let mut md = String::from(
        "| run | fixed windows over, before / after the restart (of) | after: ≤1 s / ≤5 s / ≤10 s / ≤20 s / later | buckets over `burst + rate × T`, T = 1 s / 10 s (of) | over `… + rate × lease lifetime` | worst ÷ own bound | used under excess: per-second / per-minute / buckets | pools evicted from a table /s | admitted with no room in a table |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for run in runs.iter().filter(|r| r.traffic.is_some()) {
        let o = &run.outcome;
        let b = &o.bucket_spans;
        let shape = |i: usize| {
            let (admitted, usable) = o.excess_by_shape.get(i).copied().unwrap_or_default();
            if usable > 0.0 {
                pct(admitted / usable)
            } else {
                "–".into()
            }
        };
        let a = o.over_after_by;
        let _ = writeln!(
            md,
            "| {} | {} / {} ({}) | {} / {} / {} / {} / {} | {} / {} ({}) | {} / {} | {:.2} | {} / {} / {} | {} | {} |",
            o.name,
            o.over_before,
            o.over_after,
            o.windows_checked,
            a[0],
            a[1],
            a[2],
            a[3],
            a[4],
            b[0].over_own,
            b[1].over_own,
            b[0].checked,
            b[0].over_leased,
            b[1].over_leased,
            b[0].worst_ratio.max(b[1].worst_ratio),
            shape(0),
            shape(1),
            shape(2),
            si(o.evictions / o.secs),
            pct(o.table_full / o.requests.max(1e-9)),
        );
    }
    md
}

/// How each grid run was sampled.
pub fn plans_table(runs: &[Run]) -> String {
    let mut md = String::from(
        "| run | requests/s (real) | simulated req/s | keys simulated | per stratum | rate cap | table groups per Envoy | virtual workers (calls model) |\n|---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for run in runs.iter().filter(|r| r.traffic.is_some()) {
        let o = &run.outcome;
        let exact = o.exact;
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            o.name,
            si(o.requests / o.secs),
            si(run.simulated_rate),
            o.simulated_keys,
            if exact || run.plan.per_stratum == u64::MAX { "all".into() } else { run.plan.per_stratum.to_string() },
            if exact || run.plan.rate_cap.is_infinite() { "–".into() } else { format!("{:.0}", run.plan.rate_cap) },
            run.table_groups,
            run.modelled.as_ref().map_or("– (simulated)".into(), |m| {
                format!("{}{}", m.virtual_workers, if m.replicated { " (copies)" } else { "" })
            }),
        );
    }
    md
}

/// One line of a comparison: a figure, whole and sampled, and their ratio.
fn compare(md: &mut String, what: &str, whole: f64, sampled: f64, digits: usize) {
    let ratio = if whole.abs() > 1e-12 { format!("{:+.1} %", 100.0 * (sampled / whole - 1.0)) } else { "–".into() };
    let _ = writeln!(md, "| {what} | {whole:.digits$} | {sampled:.digits$} | {ratio} |");
}

/// The sampled run against the whole one: every figure the grid reports.
pub fn sampling_check(whole: &Run, sampled: &Run) -> String {
    let (w, s) = (lease_figures(whole), lease_figures(sampled));
    let mut md =
        String::from("| figure | simulated whole | sampled as the grid samples | difference |\n|---|---:|---:|---:|\n");
    compare(&mut md, "requests/s", w.requests, s.requests, 0);
    compare(&mut md, "calls/request", w.calls_per_request(), s.calls_per_request(), 4);
    compare(&mut md, "lease calls/s", w.lease_calls, s.lease_calls, 1);
    compare(&mut md, "return calls/s", w.return_calls, s.return_calls, 1);
    compare(&mut md, "leases/request", w.leases / w.requests, s.leases / s.requests, 4);
    compare(&mut md, "store writes/request", w.writes_per_request(), s.writes_per_request(), 4);
    compare(&mut md, "share waited", w.waited, s.waited, 4);
    for (i, p) in ["p50", "p90", "p99"].iter().enumerate() {
        compare(&mut md, &format!("wait {p}, ms"), w.waits[i], s.waits[i], 2);
    }
    compare(&mut md, "used under excess demand", w.used.unwrap_or(0.0), s.used.unwrap_or(0.0), 4);
    compare(&mut md, "service cores (memory)", w.cores[0], s.cores[0], 3);
    compare(&mut md, "store state, MB", whole.outcome.state_mean / 1e6, sampled.outcome.state_mean / 1e6, 2);
    if let (Some(wc), Some(sc)) = (check_figures(whole), check_figures(sampled)) {
        compare(&mut md, "check mode: writes/request", wc.writes_per_request(), sc.writes_per_request(), 4);
    }
    let _ = writeln!(md, "| windows over before the restart (as simulated) | {} | {} | |", w.over, s.over);
    md
}

/// The calls model against the calls simulated: the model fed every item
/// of the whole run (each standing for itself) and fed a sample's.
pub fn calls_check(whole: &Run, sampled: &Run) -> String {
    let simulated = whole.outcome.sim_calls.counts();
    let all = whole.modelled.as_ref().map_or((0.0, 0.0), |m| m.calls.counts());
    let modelled = sampled.modelled.as_ref().map_or((0.0, 0.0), |m| m.calls.counts());
    let secs = whole.outcome.secs;
    let per_call = |leases: f64, calls: f64| if calls > 0.0 { leases / calls } else { 0.0 };
    let mut md = String::from(
        "| figure | simulated whole | modelled from all its items | difference | modelled from a sample | difference |\n|---|---:|---:|---:|---:|---:|\n",
    );
    let line = |md: &mut String, what: &str, whole: f64, all: f64, sample: f64| {
        let diff =
            |x: f64| if whole.abs() > 1e-12 { format!("{:+.1} %", 100.0 * (x / whole - 1.0)) } else { "–".into() };
        let _ = writeln!(md, "| {what} | {whole:.2} | {all:.2} | {} | {sample:.2} | {} |", diff(all), diff(sample));
    };
    line(&mut md, "lease calls/s", simulated.0 / secs, all.0 / secs, modelled.0 / secs);
    line(&mut md, "return calls/s", simulated.1 / secs, all.1 / secs, modelled.1 / secs);
    line(
        &mut md,
        "leases/lease call",
        per_call(whole.outcome.leases, simulated.0),
        per_call(whole.outcome.leases, all.0),
        per_call(sampled.outcome.leases, modelled.0),
    );
    md
}

/// Leases per request by key rate and fleet size under `balancer`, every
/// key count of a size together, beside `m = r·L/N` (a uniform balancer's
/// pair's requests per lease lifetime; a key-affine pair sees `r·L`).
pub fn thin_pairs(runs: &[Run], rates: &[f64], fleets: &[u32], per_envoy: f64, balancer: Balancer) -> String {
    let mut out = String::new();
    let ttl = LEASE_TTL.as_secs_f64();
    let affine = balancer == Balancer::KeyAffine;
    let _ = write!(out, "| rate r (req/s, keys within ×√10) |");
    for n in fleets {
        let m = if affine { "m = r·L" } else { "m = r·L/N" };
        let _ = write!(out, " N = {n}: leases/request ({m}) |");
    }
    out.push_str("\n|---|");
    out.push_str(&"---:|".repeat(fleets.len()));
    out.push('\n');
    let of_balancer: Vec<&Run> = runs
        .iter()
        .filter(|r| r.in_grid && r.traffic.is_some_and(|t| t.balancer == balancer && t.per_envoy == per_envoy))
        .collect();
    for &r in rates {
        let _ = write!(out, "| {r} |");
        for &n in fleets {
            let (mut requests, mut leases) = (0.0, 0.0);
            for run in of_balancer.iter().filter(|run| run.outcome.envoys == n) {
                for k in &run.outcome.per_key {
                    if k.rate >= r / 10f64.sqrt() && k.rate < r * 10f64.sqrt() {
                        requests += k.requests;
                        leases += k.leases;
                    }
                }
            }
            // A pair's requests per lease lifetime.
            let m = if affine { r * ttl } else { r * ttl / f64::from(n) };
            if requests <= 0.0 {
                let _ = write!(out, " – (m = {m}) |");
            } else {
                let _ = write!(out, " {:.2} (m = {m}) |", leases / requests);
            }
        }
        out.push('\n');
    }
    out
}

/// The overshoot table's header.
pub const OVERSHOOT_HEADER: &str = "| Envoys | mode | leases per request | waited: keys below their limit | \
keys above it | admitted without a lease | used of limits under excess | over: most in a window | worst case | \
beyond it |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|";

/// One row of the overshoot table; `worst` is the bound at every Envoy.
pub fn overshoot_row(o: &FleetOutcome, worst: u64) -> String {
    let n = o.requests.max(1.0);
    let mode = if o.name.ends_with("overshoot") { "budget 1/s" } else { "strict" };
    let share = |(a, b): (f64, f64)| if b > 0.0 { a / b } else { 0.0 };
    format!(
        "| {} | {mode} | {:.3} | {:.2} % | {:.2} % | {:.2} % | {:.1} % | {} | {worst} | {} |",
        o.envoys,
        o.leases / n,
        100.0 * o.waited_under / o.requests_under.max(1.0),
        100.0 * (o.waited - o.waited_under) / (o.requests - o.requests_under).max(1.0),
        100.0 * o.unleased / n,
        100.0 * share((o.excess_admitted, o.excess_limit)),
        o.max_over,
        o.over_worst_case,
    )
}

/// The CSV header.
pub const CSV_HEADER: &str = "name,envoys,keys,per_envoy,balancer,exact,simulated_keys,simulated_rps,requests_per_s,lease_calls_per_s,return_calls_per_s,calls_per_request,leases_per_s,writes_per_request,waited_share,wait_p50_ms,wait_p90_ms,wait_p99_ms,waited_cold_share,waited_out_share,denied_share,over_before,over_after,windows_checked,bucket_over_own_1s,bucket_over_own_10s,bucket_over_leased_1s,bucket_over_leased_10s,used_under_excess,cores_memory,cores_redis,body_bytes_per_s,state_bytes_mean,state_record_bytes_mean,evictions_per_s,table_full_share,check_calls_per_request,check_writes_per_request,check_wait_p50_ms,check_wait_p99_ms,check_over,check_used,check_cores_memory,check_cores_redis";

/// One CSV line.
pub fn csv(run: &Run) -> String {
    let o = &run.outcome;
    let f = lease_figures(run);
    let c = check_figures(run);
    let n = o.requests.max(1e-9);
    let t = run.traffic;
    let b = &o.bucket_spans;
    let check = c.map_or(",,,,,,,".to_string(), |c| {
        format!(
            "{:.4},{:.4},{:.2},{:.2},{},{:.4},{:.3},{:.3}",
            c.calls_per_request(),
            c.writes_per_request(),
            c.waits[0],
            c.waits[2],
            c.over,
            c.used.unwrap_or(0.0),
            c.cores[0],
            c.cores[1]
        )
    });
    format!(
        "{},{},{},{},{},{},{},{:.1},{:.1},{:.2},{:.2},{:.5},{:.2},{:.5},{:.5},{:.2},{:.2},{:.2},{:.5},{:.5},{:.5},{},{},{},{},{},{},{},{:.4},{:.3},{:.3},{:.0},{:.0},{:.0},{:.2},{:.6},{check}",
        o.name,
        o.envoys,
        o.total_keys,
        t.map_or(0.0, |t| t.per_envoy),
        t.map_or("-", |t| t.balancer.label()),
        o.exact,
        o.simulated_keys,
        run.simulated_rate,
        f.requests,
        f.lease_calls,
        f.return_calls,
        f.calls_per_request(),
        f.leases,
        f.writes_per_request(),
        f.waited,
        f.waits[0],
        f.waits[1],
        f.waits[2],
        o.waited_cold / n,
        o.waited_out / n,
        o.denied / n,
        o.over_before,
        o.over_after,
        o.windows_checked,
        b[0].over_own,
        b[1].over_own,
        b[0].over_leased,
        b[1].over_leased,
        f.used.unwrap_or(0.0),
        f.cores[0],
        f.cores[1],
        f.bytes,
        o.state_mean,
        o.state_records_mean,
        o.evictions / o.secs,
        o.table_full / n,
    )
}

/// `tally`'s p50/p90/p99 as text.
pub fn quantiles(tally: &Tally) -> String {
    let q = tally.quantiles();
    format!("{:.1}/{:.1}/{:.1}", q[0], q[1], q[2])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_calls_cost_follows_the_measured_rows() {
        // At the measured sizes, the measured time per call.
        assert!((MEMORY.call_secs(1.0) - 1.0 / 55_060.0).abs() < 1e-12);
        assert!((MEMORY.call_secs(10.0) - 10.0 / 178_091.0).abs() < 1e-12);
        assert!((REDIS.call_secs(200.0) - 200.0 / 80_264.0).abs() < 1e-12);
        // Between them, in between.
        let five = MEMORY.call_secs(5.0);
        assert!(five > MEMORY.call_secs(1.0) && five < MEMORY.call_secs(10.0));
        let mut calls = CallSizes::default();
        calls.add(1, 0, 55_060.0);
        assert!((MEMORY.cores_for_calls(&calls, 1.0) - 1.0).abs() < 1e-9);
    }
}
