//! The global-mode table: each Floodgate global-mode variant beside its local
//! reference, with what it asked the quota service for; then its targets.

use std::fmt::Write as _;

use serde_json::{json, Value};

use crate::callouts::CalloutCounts;
use crate::load::WrkResult;
use crate::results::{against_reference, columns, Results, VariantResult};
use crate::settings::BenchSettings;
use crate::stats::ms;
use crate::targets::ReportTable;
use crate::verdicts;

/// The table, its targets and its warnings. Returns the rows' summary for
/// the JSON file (null when no global-mode variant ran) and the targets'.
pub fn report(out: &mut String, s: &BenchSettings, results: &Results) -> (Value, Vec<Value>) {
    let global: Vec<&VariantResult> = results.0.iter().filter(|r| r.variant.service.counts_callouts()).collect();
    if global.is_empty() {
        return (Value::Null, Vec::new());
    }
    let columns = columns(ReportTable::Global);
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
         for a refresh (mean wait ms) | requests that waited, second halves | fallback decisions | non-2xx |"
    );
    let _ =
        writeln!(out, "|---|---:|---:|---:|{}---:|---:|---:|---:|---:|---:|---:|---:|", "---:|".repeat(columns.len()));
    let summary: Vec<Value> = global.iter().map(|r| row(out, results, r, &columns)).collect();
    let variants: Vec<_> = global.iter().map(|r| r.variant).collect();
    let targets =
        verdicts::report(out, ReportTable::Global, &variants, &s.paths.quota_unit, &|id, m| results.figures(id, m));
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
    let total = r.callouts.iter().fold(CalloutCounts::default(), |a, &c| a.add(c));
    let steady = r.callouts_second_half.iter().fold(CalloutCounts::default(), |a, &c| a.add(c));
    let service_per_request = total.service() as f64 / total.requests.max(1) as f64;
    let rps = r.median(WrkResult::rps);
    let non_2xx: u64 = r.rounds.iter().map(|w| w.non_2xx).sum();
    let cells: String = columns.iter().map(|c| format!(" {} |", crate::stats::ratio(rps, results.rps(c)))).collect();
    let _ = writeln!(
        out,
        "| ({id}) {} | {rps:.0} | {} | {} |{cells} {} | {:.5} | {:.5} | {service_per_request:.5} | \
         {:.2}% ({:.1}) | {:.2}% | {} | {non_2xx} |",
        r.variant.label,
        ms(r.median(|w| w.p50_us as f64)),
        ms(r.median(|w| w.p99_us as f64)),
        against_reference(results, r),
        total.per_request(),
        steady.per_request(),
        100.0 * total.waited_share(),
        total.wait_ms as f64 / total.waits.max(1) as f64,
        100.0 * steady.waited_share(),
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
