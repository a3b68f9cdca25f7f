//! The throughput part's figures: each variant's wrk rounds and callouts,
//! looked up by id for ratios and targets.

use crate::callouts::CalloutCounts;
use crate::load::WrkResult;
use crate::stats::{median, per_round, ratio};
use crate::targets::{ReportTable, RoundFigure};
use crate::variants::{Variant, VARIANTS};

/// One variant's rounds.
pub struct VariantResult {
    pub variant: &'static Variant,
    pub rounds: Vec<WrkResult>,
    /// Global-mode variants only: the callouts of each round, and of its
    /// second half (the pools' rate estimates have caught up with the load
    /// by then: steady load).
    pub callouts: Vec<CalloutCounts>,
    pub callouts_second_half: Vec<CalloutCounts>,
}

impl VariantResult {
    /// The median over rounds of `f`.
    pub fn median(&self, f: impl Fn(&WrkResult) -> f64) -> f64 {
        median(&self.rounds.iter().map(f).collect::<Vec<_>>())
    }

    fn per_round(&self, f: impl Fn(&WrkResult) -> f64) -> Vec<f64> {
        self.rounds.iter().map(f).collect()
    }
}

/// Every variant's rounds, in the table's order.
pub struct Results(pub Vec<VariantResult>);

impl Results {
    pub fn get(&self, id: &str) -> Option<&VariantResult> {
        self.0.iter().find(|r| r.variant.id == id)
    }

    /// The median req/s of `id`; NaN when it did not run.
    pub fn rps(&self, id: &str) -> f64 {
        self.get(id).map_or(f64::NAN, |r| r.median(WrkResult::rps))
    }

    /// The median of the per-round req/s ratios of `r` to `id`; NaN when `id` did not run.
    pub fn paired(&self, r: &VariantResult, id: &str) -> f64 {
        self.get(id).map_or(f64::NAN, |other| {
            median(&per_round(&r.per_round(WrkResult::rps), &other.per_round(WrkResult::rps)))
        })
    }

    /// The per-round figures the targets judge.
    pub fn figures(&self, id: &str, metric: RoundFigure) -> Option<Vec<f64>> {
        let r = self.get(id)?;
        match metric {
            RoundFigure::Rps => Some(r.per_round(WrkResult::rps)),
            RoundFigure::P99 => Some(r.per_round(|w| w.p99_us as f64)),
            RoundFigure::CalloutsSteady => {
                Some(r.callouts_second_half.iter().map(CalloutCounts::per_request).collect())
            }
            RoundFigure::WaitedSteady => Some(r.callouts_second_half.iter().map(CalloutCounts::waited_share).collect()),
            RoundFigure::LatencyP50 => None,
        }
    }
}

/// The variants whose req/s are ratio columns of `table`.
pub fn columns(table: ReportTable) -> Vec<&'static str> {
    VARIANTS.iter().filter(|v| v.column_of.contains(&table)).map(|v| v.id).collect()
}

/// `(ref) ratio` of the variant to its reference, median of per-round ratios; a dash without one.
pub fn against_reference(results: &Results, r: &VariantResult) -> String {
    r.variant.reference.map_or("—".to_string(), |id| format!("({id}) {}", ratio(results.paired(r, id), 1.0)))
}
