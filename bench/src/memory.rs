//! The memory part: Envoy's memory with a million distinct clients against
//! one rule, beside a control with the smallest table.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use floodgate_e2e::Envoy;
use serde_json::{json, Value};

use crate::filters::{self, Filters};
use crate::load::{closed_loop, LoadResult};
use crate::settings::BenchSettings;
use crate::variants::PER_KEY;

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
fn memory_run(s: &BenchSettings, envoy: &Envoy) -> MemoryRun {
    // A second for start-up allocations to settle before the first reading.
    std::thread::sleep(Duration::from_secs(1));
    let before = envoy.memory();
    eprintln!("memory: {}: {} distinct keys over {} connections", envoy.name(), s.memory_keys, s.memory_connections);
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

/// The plugin configuration of the memory rule with `max_keys`. Buckets stay
/// live for a while after a request (100 per minute: one token takes 0.6 s
/// to come back), so the table sees both reuse of idle buckets
/// (slot_evictions) and, if clients arrive fast enough, full groups.
fn plugin_config(max_keys: u64) -> String {
    format!(
        r#"{{"rules": [{{"name": "{MEM_RULE}", "descriptors": {PER_KEY}, "limit": 100, "period": "1m",
             "max_keys": {max_keys}}}]}}"#
    )
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / 1048576.0)
}

fn diff(a: u64, b: u64) -> i64 {
    a as i64 - b as i64
}

pub fn memory(s: &BenchSettings, out: &mut String, raw: &mut BTreeMap<String, Value>) {
    let filters = |max_keys: u64| Filters::Floodgate(plugin_config(max_keys));
    // The control is the same module, rule and load with the smallest table
    // (max_keys 4: one group): the difference between the two Envoys is the
    // table, apart from Envoy, the VM and the module, which both carry.
    let control = {
        let envoy = filters::start("mem-control", &filters(4), &s.paths);
        memory_run(s, &envoy)
    };
    let (fg, stats) = {
        let envoy = filters::start("mem-floodgate", &filters(MEM_MAX_KEYS), &s.paths);
        let run = memory_run(s, &envoy);
        (run, envoy.stats_flushed())
    };
    let stat = |name: &str| stats.get(&format!("wasmcustom.floodgate.{name}")).copied().unwrap_or(0);
    let counters = ["slot_evictions", "table_full", "store_errors", "corrupt_state", "allowed", "limited"];
    let counters: BTreeMap<&str, u64> = counters.into_iter().map(|name| (name, stat(name))).collect();
    let bound = stated_bound(&plugin_config(MEM_MAX_KEYS));
    table(s, out, &control, &fg, bound);
    summary(s, out, &control, &fg, bound, &counters);
    let r = &fg.load;
    let reading = |m: (u64, u64)| json!({"allocated": m.0, "heap_size": m.1});
    raw.insert(
        "memory".into(),
        json!({
            "rule": MEM_RULE, "max_keys": MEM_MAX_KEYS, "keys_sent": r.total.allowed + r.total.limited + r.total.other,
            "wall_s": r.wall.as_secs_f64(), "readme_bound_bytes": bound,
            "control_max_keys_4": {
                "before": reading(control.before), "after": reading(control.after),
                "wall_s": control.load.wall.as_secs_f64(),
            },
            "floodgate": {"before": reading(fg.before), "after": reading(fg.after)},
            "responses": {"allowed": r.total.allowed, "limited": r.total.limited, "other": r.total.other},
            "counters": counters,
        }),
    );
}

/// The heading and the table of both Envoys' readings.
fn table(s: &BenchSettings, out: &mut String, control: &MemoryRun, fg: &MemoryRun, bound: u64) {
    let r = &fg.load;
    let _ = writeln!(
        out,
        "\n## Memory\n\n{} requests with distinct `x-api-key` values ({:.0} s, {} connections) against one \
         token-bucket rule `{MEM_RULE}` with max_keys {MEM_MAX_KEYS}; the control is the same rule and load with \
         max_keys 4 (a one-group table). Envoy's admin `/memory`, MiB. README bound for this rule: \
         (65536 / 4) × ({} + {} + 2 + 4 × 24) = {bound} bytes ({} MiB).\n",
        r.total.allowed + r.total.limited + r.total.other,
        r.wall.as_secs_f64(),
        s.memory_connections,
        floodgate_core::limiter::SHARED_DATA_ENTRY_OVERHEAD,
        format!("fg:{MEM_RULE}:{}", MEM_MAX_KEYS / 4 - 1).len(),
        mib(bound)
    );
    let _ = writeln!(out, "| Envoy | measure | configured, idle | after the keys | growth with traffic |");
    let _ = writeln!(out, "|---|---|---:|---:|---:|");
    let names = [("control (max_keys 4)".to_string(), control), (format!("Floodgate (max_keys {MEM_MAX_KEYS})"), fg)];
    for (name, run) in names {
        for (measure, before, after) in
            [("allocated", run.before.0, run.after.0), ("heap_size", run.before.1, run.after.1)]
        {
            let growth = format!("{:+.1}", diff(after, before) as f64 / 1048576.0);
            let _ = writeln!(out, "| {name} | {measure} | {} | {} | {growth} |", mib(before), mib(after));
        }
    }
}

/// The table's size against the README's bound, the responses and the counters.
fn summary(
    s: &BenchSettings,
    out: &mut String,
    control: &MemoryRun,
    fg: &MemoryRun,
    bound: u64,
    counters: &BTreeMap<&str, u64>,
) {
    let r = &fg.load;
    let sent = r.total.allowed + r.total.limited + r.total.other;
    let groups = MEM_MAX_KEYS / 4;
    // Floodgate creates its table's entries when the configuration loads;
    // their values grow to full size as clients take buckets.
    let table_configured = diff(fg.before.0, control.before.0);
    let table_after = diff(fg.after.0, control.after.0);
    let growth = diff(fg.after.0, fg.before.0);
    let verdict = if table_after <= bound as i64 { "within" } else { "OVER" };
    let _ = writeln!(
        out,
        "\nThe table (`allocated`, Floodgate − control): {table_configured} bytes when configured, {table_after} bytes \
         after the keys ({:.1} per group, {:.2}% of the bound): {verdict} the README bound of {bound} bytes \
         ({} per group). Floodgate's growth with traffic: {growth} bytes. \
         Responses: {} allowed, {} limited, {} other. Counters after the run: \
         slot_evictions {}, table_full {}, store_errors {}, corrupt_state {}.",
        table_after as f64 / groups as f64,
        100.0 * table_after as f64 / bound as f64,
        bound / groups,
        r.total.allowed,
        r.total.limited,
        r.total.other,
        counters["slot_evictions"],
        counters["table_full"],
        counters["store_errors"],
        counters["corrupt_state"],
    );
    if sent < s.memory_keys {
        let _ = writeln!(
            out,
            "\n**Note:** only {sent} of {} keys were sent within the {} s bound.",
            s.memory_keys, s.memory_max_secs
        );
    }
}
