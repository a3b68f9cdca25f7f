//! The accuracy part: whether a per-key limit holds under load on both
//! workers, Floodgate beside Envoy's own `local_ratelimit`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use serde_json::{json, Value};

use crate::filters::{self, EnvoyBucket, Filters};
use crate::load::{closed_loop, LoadResult};
use crate::settings::BenchSettings;
use crate::variants::PER_KEY;

/// The accuracy bucket: 100 per 10 s, burst 100.
const ACC_LIMIT: u64 = 100;
const ACC_PERIOD_S: u64 = 10;

/// A limiter under test.
struct Limiter {
    name: &'static str,
    filters: Filters,
    /// Whether it refills continuously, so that it is judged against the
    /// exact bound; otherwise against the most a fill timer of unknown phase allows.
    continuous: bool,
}

fn limiters() -> [Limiter; 2] {
    [
        Limiter {
            name: "floodgate",
            filters: Filters::Floodgate(format!(
                r#"{{"rules": [{{"name": "acc", "descriptors": {PER_KEY}, "algorithm": "token_bucket",
                     "limit": {ACC_LIMIT}, "period": "{ACC_PERIOD_S}s", "burst": {ACC_LIMIT}}}]}}"#
            )),
            continuous: true,
        },
        Limiter {
            name: "envoy-local",
            filters: Filters::EnvoyLocal(EnvoyBucket { max_tokens: 100, tokens_per_fill: 100, fill_interval: "10s" }),
            continuous: false,
        },
    ]
}

/// One accuracy case on a fresh Envoy: the load's result and the connections
/// each worker accepted during it.
fn accuracy_case(s: &BenchSettings, limiter: &Limiter, keys: usize) -> (LoadResult, Vec<u64>) {
    let envoy = filters::start(&format!("acc-{}-{keys}", limiter.name), &limiter.filters, &s.paths);
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

pub fn accuracy(s: &BenchSettings, out: &mut String, raw: &mut BTreeMap<String, Value>) {
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
    for limiter in &limiters() {
        for keys in [1usize, 50] {
            eprintln!("accuracy: {}, {keys} key(s), {} s", limiter.name, s.accuracy_secs);
            let (r, per_worker) = accuracy_case(s, limiter, keys);
            cases.push(report_case(s, out, limiter, keys, &r, &per_worker));
        }
    }
    raw.insert("accuracy".into(), json!({
        "limit": ACC_LIMIT, "period_s": ACC_PERIOD_S, "burst": ACC_LIMIT, "seconds": s.accuracy_secs, "cases": cases,
    }));
}

/// One case's row and warnings; returns the case for the JSON file.
fn report_case(
    s: &BenchSettings,
    out: &mut String,
    limiter: &Limiter,
    keys: usize,
    r: &LoadResult,
    per_worker: &[u64],
) -> Value {
    let name = limiter.name;
    // The bucket's clock runs from its first decision to its last; both lie
    // within [first request sent, last response received]. The span to the
    // last request *sent* can fall short of the decisions by one response
    // time, and when it ends just before a token is due that wrongly reads
    // as one token of over-admission.
    let elapsed = r.decision_span.as_secs_f64();
    let continuous = ACC_LIMIT + (ACC_LIMIT as f64 * elapsed / ACC_PERIOD_S as f64).floor() as u64;
    let timer = ACC_LIMIT + ACC_LIMIT * ((elapsed / ACC_PERIOD_S as f64).floor() as u64 + 1);
    let bound = if limiter.continuous { continuous } else { timer };
    let allowed: Vec<u64> = r.per_key.values().map(|c| c.allowed).collect();
    let (min, max) = (allowed.iter().min().copied().unwrap_or(0), allowed.iter().max().copied().unwrap_or(0));
    let over_keys = allowed.iter().filter(|&&a| a > bound).count();
    let over: u64 = allowed.iter().map(|&a| a.saturating_sub(bound)).sum();
    let over_continuous: u64 = allowed.iter().map(|&a| a.saturating_sub(continuous)).sum();
    let (bound_text, over_text) = if limiter.continuous {
        (format!("{continuous}"), format!("{over}"))
    } else {
        (
            format!("{timer} (timer) / {continuous} (continuous)"),
            format!("{over} (timer) / {over_continuous} (continuous)"),
        )
    };
    let _ = writeln!(
        out,
        "| {name} | {keys} | {} | {} | {:.2} | {bound_text} | {min}–{max} | {} | {over_keys} | {over_text} |",
        per_worker.iter().map(u64::to_string).collect::<Vec<_>>().join(" / "),
        r.total.allowed + r.total.limited + r.total.other,
        elapsed,
        r.total.allowed,
    );
    if r.total.other > 0 {
        let _ = writeln!(out, "\n**Warning:** {name}/{keys}: {} responses neither 200 nor 429.\n", r.total.other);
    }
    if per_worker.iter().filter(|&&n| n > 0).count() < 2 {
        let _ = writeln!(out, "\n**Warning:** {name}/{keys}: not every worker took connections.\n");
    }
    json!({
        "limiter": name, "keys": keys, "connections": s.accuracy_connections,
        "connections_per_worker": per_worker, "elapsed_s": elapsed,
        "send_span_s": r.send_span.as_secs_f64(), "wall_s": r.wall.as_secs_f64(),
        "bound_continuous": continuous, "bound_timer": timer,
        "allowed": r.total.allowed, "limited": r.total.limited, "other": r.total.other,
        "allowed_per_key": r.per_key.iter().map(|(k, c)| (k.clone(), json!(c.allowed))).collect::<serde_json::Map<_, _>>(),
    })
}
