//! What the runs add up to: per fleet size the service's load (calls,
//! leases, bytes, state) scaled from the sampled keys, the requests'
//! waits, windows over the limit and utilisation; the thin-pair table.

use std::fmt::Write as _;

use crate::fleet::{FleetOutcome, LEASE_TTL, WORKERS};

/// The service's calls a second, as simulated and as the batching model
/// puts them for the whole fleet.
#[derive(Debug, Clone, Copy)]
pub struct Calls {
    /// Lease calls a second.
    pub lease: f64,
    /// Return calls a second.
    pub returns: f64,
}

impl Calls {
    /// Both kinds.
    pub fn total(&self) -> f64 {
        self.lease + self.returns
    }
}

/// The calls a second the simulation itself made (only the simulated keys'
/// claims share calls: with sampling, fewer than the whole fleet's).
pub fn simulated(o: &FleetOutcome) -> Calls {
    Calls { lease: o.sim_lease_calls as f64 / o.secs, returns: o.sim_return_calls as f64 / o.secs }
}

/// The calls a second of the whole fleet, from the weighted rates at which
/// its workers' claims and returns come (the batching model of
/// `Callouts`): per worker, a claim a request waits for (rate `u`) leaves
/// at once and takes everything held along; held claims and returns (rate
/// `g`, held `d` on average) leave when the first of them is due, unless a
/// claim that leaves at once came first. With arrivals at random, a cycle
/// from one call to the next is `1/(u+g)` plus, when a held item came
/// first, `min(d, time to the next urgent claim)`; calls at a held item's
/// deadline come `g·e^(−u·d) / (1 + g·(1 − e^(−u·d))/u)` a second. A call
/// carries at most `MAX_ITEMS` leases.
pub fn modelled(o: &FleetOutcome) -> Calls {
    let workers = f64::from(o.envoys) * f64::from(WORKERS);
    let per = |x: f64| x / workers / o.secs;
    let (u, h, r) = (per(o.urgent), per(o.held), per(o.return_items));
    let hold_h = if o.held > 0.0 { o.hold_secs / o.held } else { 0.0 };
    let hold_r = crate::fleet::RETURN_HOLD.as_secs_f64();
    let g = h + r;
    if u + g <= 0.0 {
        return Calls { lease: 0.0, returns: 0.0 };
    }
    let d = if g > 0.0 { (h * hold_h + r * hold_r) / g } else { 0.0 };
    let absorbed = if u > 0.0 { (1.0 - (-u * d).exp()) / u } else { d };
    let deadline = g * (-u * d).exp() / (1.0 + g * absorbed);
    let cycles = u + deadline;
    let lease = (u + deadline * (1.0 - (-h / cycles).exp())).max((u + h) / crate::fleet::MAX_LEASES_PER_CALL);
    let returns = (cycles * (1.0 - (-r / cycles).exp())).max(r / crate::fleet::MAX_LEASES_PER_CALL);
    Calls { lease: lease * workers, returns: returns * workers }
}

/// The calls a second reported: as simulated when every key was, else modelled.
pub fn calls(o: &FleetOutcome) -> Calls {
    if o.exact {
        simulated(o)
    } else {
        modelled(o)
    }
}

/// Leases a second (weighted).
pub fn leases(o: &FleetOutcome) -> f64 {
    (o.urgent + o.held) / o.secs
}

/// Body bytes a second, both ways, weighted.
pub fn bytes(o: &FleetOutcome) -> f64 {
    let c = calls(o);
    (o.item_bytes + c.lease * o.secs * o.lease_call_bytes + c.returns * o.secs * o.return_call_bytes) / o.secs
}

fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let at = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted.get(at).copied().unwrap_or(0.0)
}

fn si(x: f64) -> String {
    match x {
        x if x >= 1e9 => format!("{:.2} G", x / 1e9),
        x if x >= 1e6 => format!("{:.2} M", x / 1e6),
        x if x >= 1e3 => format!("{:.1} k", x / 1e3),
        x => format!("{x:.1}"),
    }
}

/// The header of the main table.
pub const HEADER: &str = "| Envoys | keys (simulated) | calls/s | leases/s | leases/call | body bytes/s | requests/s | waited | waits p50/p99 ms | windows over limit (before / after restart) | utilisation under excess | store state |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|";

/// One row of the main table.
pub fn row(o: &FleetOutcome) -> String {
    let c = calls(o);
    let leases = leases(o);
    let util = if o.excess_usable > 0.0 {
        format!(
            "{:.1} % ({:.1} % of the limit)",
            100.0 * o.excess_admitted / o.excess_usable,
            100.0 * o.excess_admitted / o.excess_limit.max(1e-9)
        )
    } else {
        "–".into()
    };
    let sim = if o.exact { String::new() } else { format!(" (sim {})", si(simulated(o).total())) };
    format!(
        "| {} | {} ({}) | {}{} | {} | {:.1} | {}B | {} | {:.2} % | {:.1} / {:.1} | {} / {} of {} | {} | {}B |",
        o.envoys,
        si(o.total_keys as f64),
        o.simulated_keys,
        si(c.total()),
        sim,
        si(leases),
        if c.lease > 0.0 { leases / c.lease } else { 0.0 },
        si(bytes(o)),
        si(o.requests / o.secs),
        100.0 * o.waited / o.requests.max(1e-9),
        percentile(&o.wait_ms, 0.5),
        percentile(&o.wait_ms, 0.99),
        o.over_before,
        o.over_after,
        o.windows_checked,
        util,
        si(o.state_mean),
    )
}

/// The CSV header.
pub const CSV_HEADER: &str = "name,envoys,keys,simulated_keys,exact,calls_per_s,lease_calls_per_s,return_calls_per_s,sim_calls_per_s,model_calls_per_s,leases_per_s,leases_per_call,body_bytes_per_s,requests_per_s,waited_share,waited_cold_share,waited_out_share,denied_share,wait_p50_ms,wait_p99_ms,windows_checked,over_before_restart,over_after_restart,bucket_peak_ratio,excess_utilisation,state_bytes_mean,state_bytes_peak,state_record_bytes_mean,returned_tokens_per_s,expired_tokens_per_s,util_per_second,util_per_minute,util_bucket,over_after_1s,over_after_5s,over_after_10s,over_after_20s,over_after_later,waited_warm_share,waited_dry_allowance_share,excess_of_limit";

/// Admitted ÷ limit (0 when nothing was limited).
pub fn share((admitted, limit): (f64, f64)) -> f64 {
    if limit > 0.0 {
        admitted / limit
    } else {
        0.0
    }
}

/// One CSV line.
pub fn csv(o: &FleetOutcome) -> String {
    let c = calls(o);
    let n = o.requests.max(1e-9);
    let util = share((o.excess_admitted, o.excess_usable));
    format!(
        "{},{},{},{},{},{:.1},{:.1},{:.1},{:.1},{:.1},{:.1},{:.2},{:.0},{:.1},{:.5},{:.5},{:.5},{:.5},{:.2},{:.2},{},{},{},{:.3},{:.4},{:.0},{:.0},{:.0},{:.1},{:.1},{:.4},{:.4},{:.4},{},{},{},{},{},{:.5},{:.5},{:.4}",
        o.name,
        o.envoys,
        o.total_keys,
        o.simulated_keys,
        o.exact,
        c.total(),
        c.lease,
        c.returns,
        simulated(o).total(),
        modelled(o).total(),
        leases(o),
        if c.lease > 0.0 { leases(o) / c.lease } else { 0.0 },
        bytes(o),
        o.requests / o.secs,
        o.waited / n,
        o.waited_cold / n,
        o.waited_out / n,
        o.denied / n,
        percentile(&o.wait_ms, 0.5),
        percentile(&o.wait_ms, 0.99),
        o.windows_checked,
        o.over_before,
        o.over_after,
        o.bucket_peak,
        util,
        o.state_mean,
        o.state_peak,
        o.state_records_mean,
        o.returned_tokens / o.secs,
        o.expired_tokens / o.secs,
        share(o.excess_by_shape[0]),
        share(o.excess_by_shape[1]),
        share(o.excess_by_shape[2]),
        o.over_after_by[0],
        o.over_after_by[1],
        o.over_after_by[2],
        o.over_after_by[3],
        o.over_after_by[4],
        o.waited_warm_under / n,
        o.waited_dry_allowance / n,
        share((o.excess_admitted, o.excess_limit)),
    )
}

/// The overshoot table's header.
pub const OVERSHOOT_HEADER: &str = "| Envoys | mode | leases per request | waited: keys below their limit | \
keys above it | admitted without a lease | used of limits under excess | over: most in a window | worst case | \
beyond it |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|";

/// One row of the overshoot table; `worst` is the bound at every Envoy.
pub fn overshoot_row(o: &FleetOutcome, worst: u64) -> String {
    let n = o.requests.max(1.0);
    let mode = if o.name.ends_with("overshoot") { "budget 1/s" } else { "strict" };
    format!(
        "| {} | {mode} | {:.3} | {:.2} % | {:.2} % | {:.2} % | {:.1} % | {} | {worst} | {} |",
        o.envoys,
        o.sim_leases as f64 / n,
        100.0 * o.waited_under / o.requests_under.max(1.0),
        100.0 * (o.waited - o.waited_under) / (o.requests - o.requests_under).max(1.0),
        100.0 * o.unleased / n,
        100.0 * share((o.excess_admitted, o.excess_limit)),
        o.max_over,
        o.over_worst_case,
    )
}

/// Callouts (leases asked for) per request by key rate and fleet size, from
/// the simulated keys (every key-count run of one fleet size together),
/// beside `m = r·L/N` (a pair's expected requests per lease lifetime) and
/// `2/(1 + m)`: a request at a cold pair costs the lease it waits for and
/// the one its empty pool claims at once after it.
pub fn thin_pairs(outcomes: &[FleetOutcome], rates: &[f64], fleets: &[u32]) -> String {
    let mut out = String::new();
    let ttl = LEASE_TTL.as_secs_f64();
    let _ = write!(out, "| rate r (req/s, keys within ×√10) |");
    for n in fleets {
        let _ = write!(out, " N = {n}: measured (m = r·L/N; 2/(1+m)) |");
    }
    out.push('\n');
    out.push_str("|---|");
    out.push_str(&"---|".repeat(fleets.len()));
    out.push('\n');
    for &r in rates {
        let _ = write!(out, "| {r} |");
        for &n in fleets {
            let (mut requests, mut leases) = (0u64, 0u64);
            for o in outcomes.iter().filter(|o| o.envoys == n) {
                for &(rate, _, q, l) in &o.per_key {
                    if rate >= r / 10f64.sqrt() && rate < r * 10f64.sqrt() {
                        requests += q;
                        leases += l;
                    }
                }
            }
            let m = r * ttl / f64::from(n);
            if requests == 0 {
                let _ = write!(out, " – (m = {m}; {:.2}) |", 2.0 / (1.0 + m));
            } else {
                let _ = write!(
                    out,
                    " {:.2} of {requests} (m = {m}; {:.2}) |",
                    leases as f64 / requests as f64,
                    2.0 / (1.0 + m)
                );
            }
        }
        out.push('\n');
    }
    out
}
