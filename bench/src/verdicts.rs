//! The verdicts on a table's targets: one line per target of its variants,
//! printed under the table.

use std::fmt::Write as _;

use serde_json::{json, Value};

use crate::stats::spread;
use crate::targets::{Figures, ReportTable};
use crate::variants::Variant;

/// Prints one line per target of `variants` that belongs to `table`, with
/// the median over rounds, its spread and met or missed; returns them for
/// the JSON file. `quota_unit` is this run's `BENCH_QUOTA_UNIT`.
pub fn report(
    out: &mut String,
    table: ReportTable,
    variants: &[&Variant],
    quota_unit: &str,
    figures: &Figures,
) -> Vec<Value> {
    let mut lines = Vec::new();
    let mut summary = Vec::new();
    for variant in variants {
        for target in variant.targets.iter().filter(|t| t.table(variant.service.counts_callouts()) == table) {
            let mut line = format!("- Issue {}: {}: ", target.issue, target.describe(variant.id));
            let outcome = target.evaluate(variant.id, figures);
            match &outcome {
                Ok(o) => {
                    let (lo, hi) = spread(&o.rounds);
                    let _ = write!(
                        line,
                        "**{}** ({}–{} over {} round(s)) — {}",
                        target.format(o.median),
                        target.format(lo),
                        target.format(hi),
                        o.rounds.len(),
                        if o.met { "met" } else { "**missed**" }
                    );
                }
                Err(missing) => {
                    let _ = write!(line, "not measured: ({missing}) did not run");
                }
            }
            if let Some(unit) = target.quota_unit {
                let _ = write!(line, " (stated for `BENCH_QUOTA_UNIT={unit}`");
                let _ = write!(
                    line,
                    "{})",
                    if unit == quota_unit { String::new() } else { format!("; this run: {quota_unit}") }
                );
            }
            lines.push(line);
            summary.push(json!({
                "issue": target.issue, "variant": variant.id, "target": target.describe(variant.id),
                "rounds": outcome.as_ref().map(|o| o.rounds.clone()).unwrap_or_default(),
                "median": outcome.as_ref().map_or(f64::NAN, |o| o.median),
                "met": outcome.as_ref().ok().map(|o| o.met),
            }));
        }
    }
    if !lines.is_empty() {
        let _ = writeln!(
            out,
            "\nTargets (the median over rounds of each round's figure, smallest–largest round in brackets):\n"
        );
        for line in lines {
            let _ = writeln!(out, "{line}");
        }
    }
    summary
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::targets::RoundFigure;
    use crate::variants::VARIANTS;

    #[test]
    fn one_line_per_target_of_the_table_with_its_median_spread_and_verdict() {
        let d: Vec<&Variant> = VARIANTS.iter().filter(|v| v.id == "d").collect();
        let figures = |id: &str, metric: RoundFigure| match (id, metric) {
            ("d", RoundFigure::Rps) => Some(vec![90.0, 80.0, 100.0]),
            ("c", RoundFigure::Rps) => Some(vec![100.0; 3]),
            _ => None,
        };
        let mut out = String::new();
        let summary = report(&mut out, ReportTable::Throughput, &d, "second", &figures);
        assert!(
            out.contains("- Issue 14: (d) ÷ (c), req/s ≥ 0.90: **0.900** (0.800–1.000 over 3 round(s)) — met\n"),
            "{out}"
        );
        assert!(out.contains("- Issue 14: (d) ÷ (c), p99 under load ≤ 1.20: not measured"), "{out}");
        assert_eq!(summary.len(), 2);
        let mut none = String::new();
        assert!(report(&mut none, ReportTable::Global, &d, "second", &figures).is_empty());
        assert!(none.is_empty(), "no target of (d) belongs to the global table");
        let gl: Vec<&Variant> = VARIANTS.iter().filter(|v| v.id == "gl").collect();
        let mut global = String::new();
        assert!(report(&mut global, ReportTable::Throughput, &gl, "second", &figures).is_empty(), "{global}");
        assert_eq!(
            report(&mut global, ReportTable::Global, &gl, "second", &figures).len(),
            2,
            "(gl) ÷ (i) and its callouts"
        );
    }
}
