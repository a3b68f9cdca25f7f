//! The global-mode table (issue 7): each Floodgate global-mode variant
//! beside its local reference, with what it asked the quota service for;
//! then its targets.

use std::fmt::Write as _;

use serde_json::{json, Value};

use crate::envoy::{Envoy, QuotaService};
use crate::load::WrkResult;
use crate::settings::Settings;
use crate::stats::ms;
use crate::targets;
use crate::throughput::{against_reference, columns, Results, VariantResult};
use crate::variants::Table;

/// What a global-mode variant asked the quota service for: the filter's own
/// counters (`wasmcustom.floodgate.global.*`, and the rules' `fallback`
/// decisions), the service's `floodgate_quota_requests_total`, and the
/// requests Envoy received. Read before, in the middle of and after each
/// round; the service's counts include anything idle Envoys of other
/// variants on the same instance sent meanwhile.
#[derive(Clone, Copy, Debug, Default)]
pub struct Callouts {
    requests: u64,
    sent: u64,
    ok: u64,
    /// Requests that found their pool empty and waited for a refresh, and
    /// how long they waited in all.
    waits: u64,
    wait_ms: u64,
    fallback: u64,
    service_lease: u64,
    service_check: u64,
    service_return: u64,
}

impl Callouts {
    /// The counters now.
    pub fn read(envoy: &Envoy, quota: &QuotaService) -> Callouts {
        let stats = envoy.stats();
        let stat = |name: &str| stats.get(&format!("wasmcustom.floodgate.global.{name}")).copied().unwrap_or(0);
        let fallback = stats
            .iter()
            .filter(|(name, _)| name.starts_with("wasmcustom.floodgate.rule.") && name.ends_with(".fallback"))
            .map(|(_, v)| v)
            .sum();
        Callouts {
            requests: stats.get("http.bench.downstream_rq_total").copied().unwrap_or(0),
            sent: stat("callouts_sent"),
            ok: stat("callouts_ok"),
            waits: stat("refill_waits"),
            wait_ms: stat("refill_wait_ms"),
            fallback,
            service_lease: quota.requests("lease"),
            service_check: quota.requests("check"),
            service_return: quota.requests("return"),
        }
    }

    /// Applies `f` to each pair of counters.
    fn zip(self, other: Callouts, f: impl Fn(u64, u64) -> u64) -> Callouts {
        Callouts {
            requests: f(self.requests, other.requests),
            sent: f(self.sent, other.sent),
            ok: f(self.ok, other.ok),
            waits: f(self.waits, other.waits),
            wait_ms: f(self.wait_ms, other.wait_ms),
            fallback: f(self.fallback, other.fallback),
            service_lease: f(self.service_lease, other.service_lease),
            service_check: f(self.service_check, other.service_check),
            service_return: f(self.service_return, other.service_return),
        }
    }

    /// The counts from `before` to `self`.
    pub fn since(self, before: Callouts) -> Callouts {
        self.zip(before, u64::saturating_sub)
    }

    fn add(self, other: Callouts) -> Callouts {
        self.zip(other, |a, b| a + b)
    }

    fn service(&self) -> u64 {
        self.service_lease + self.service_check + self.service_return
    }

    /// Callouts the filter sent per request Envoy received.
    pub fn per_request(&self) -> f64 {
        self.sent as f64 / self.requests.max(1) as f64
    }

    /// The share of requests that waited for a refresh.
    pub fn waited_share(&self) -> f64 {
        self.waits as f64 / self.requests.max(1) as f64
    }

    pub fn to_json(self) -> Value {
        json!({
            "requests": self.requests, "callouts_sent": self.sent, "callouts_ok": self.ok,
            "refill_waits": self.waits, "refill_wait_ms": self.wait_ms, "fallback_decisions": self.fallback,
            "service_lease_calls": self.service_lease, "service_check_calls": self.service_check,
            "service_return_calls": self.service_return,
        })
    }
}

/// The table, its targets and its warnings. Returns the rows' summary for
/// the JSON file (null when no global-mode variant ran) and the targets'.
pub fn report(out: &mut String, s: &Settings, results: &Results) -> (Value, Vec<Value>) {
    let global: Vec<&VariantResult> = results.0.iter().filter(|r| r.variant.service.counts_callouts()).collect();
    if global.is_empty() {
        return (Value::Null, Vec::new());
    }
    let columns = columns(Table::Global);
    let _ = writeln!(
        out,
        "\n### Global mode\n\nFloodgate's global rules asking floodgate-quota (memory store, HTTP API, the limit in its \
         limits file far above the load, fallback `deny`). Callouts per request: the filter's `global.callouts_sent` \
         ÷ Envoy's `downstream_rq_total`, over whole rounds and over the second half of each round (steady load: \
         each Envoy idles while the others are loaded, so its pools start every round cold); service calls: \
         `floodgate_quota_requests_total` for `lease` + `check` + `return` ÷ the same requests, whole rounds; waits: the \
         filter's `global.refill_waits` and `refill_wait_ms`.\n"
    );
    let heads: String = columns.iter().map(|c| format!(" ÷ ({c}) |")).collect();
    let _ = writeln!(
        out,
        "| variant | req/s | p50 ms | p99 ms |{heads} ÷ local reference (per-round median) | \
         callouts / request | callouts / request, second halves | service calls / request | requests that waited \
         for a refresh (mean wait ms) | fallback decisions | non-2xx |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|{}---:|---:|---:|---:|---:|---:|---:|", "---:|".repeat(columns.len()));
    let summary: Vec<Value> = global.iter().map(|r| row(out, results, r, &columns)).collect();
    let variants: Vec<_> = global.iter().map(|r| r.variant).collect();
    let targets = targets::report(out, Table::Global, &variants, &s.paths.quota_unit, &|id, m| results.figures(id, m));
    for r in &global {
        if r.callouts.iter().any(|c| c.fallback > 0) {
            let _ = writeln!(
                out,
                "\n**Warning:** ({}) decided with its fallback: the service did not answer every callout.",
                r.variant.id
            );
        }
    }
    (Value::Array(summary), targets)
}

/// One variant's row; returns its summary.
fn row(out: &mut String, results: &Results, r: &VariantResult, columns: &[&str]) -> Value {
    let (id, reference) = (r.variant.id, r.variant.reference.unwrap_or_default());
    let requests: u64 = r.rounds.iter().map(|w| w.requests).sum();
    let total = r.callouts.iter().fold(Callouts::default(), |a, &c| a.add(c));
    let steady = r.callouts_second_half.iter().fold(Callouts::default(), |a, &c| a.add(c));
    let service_per_request = total.service() as f64 / total.requests.max(1) as f64;
    let rps = r.median(WrkResult::rps);
    let non_2xx: u64 = r.rounds.iter().map(|w| w.non_2xx).sum();
    let cells: String = columns.iter().map(|c| format!(" {} |", crate::stats::ratio(rps, results.rps(c)))).collect();
    let _ = writeln!(
        out,
        "| ({id}) {} | {rps:.0} | {} | {} |{cells} {} | {:.5} | {:.5} | {service_per_request:.5} | \
         {:.2}% ({:.1}) | {} | {non_2xx} |",
        r.variant.label,
        ms(r.median(|w| w.p50_us as f64)),
        ms(r.median(|w| w.p99_us as f64)),
        against_reference(results, r),
        total.per_request(),
        steady.per_request(),
        100.0 * total.waited_share(),
        total.wait_ms as f64 / total.waits.max(1) as f64,
        total.fallback,
    );
    let mut summary = json!({
        "id": id, "reference": reference, "requests": requests,
        "ratio_reference_paired": results.paired(r, reference), "ratio_reference_medians": rps / results.rps(reference),
        "callouts_per_request": total.per_request(), "callouts_per_request_second_halves": steady.per_request(),
        "service_calls_per_request": service_per_request,
        "totals": total.to_json(), "second_halves": steady.to_json(), "non_2xx": non_2xx,
    });
    for c in columns {
        summary[format!("ratio_{c}")] = json!(rps / results.rps(c));
    }
    summary
}
