//! The issues' targets, as data on the variant rows (see [`crate::variants`]),
//! judged on ratios within one run: each round's ratio of the two variants
//! measured in it, then the median over rounds with its spread.

use crate::stats::{median, per_round};

/// The tables of the report: each prints the targets that belong to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReportTable {
    /// Every throughput variant.
    Throughput,
    /// Floodgate's global-mode variants beside their local references.
    Global,
    /// Sequential requests on one connection.
    Latency,
}

/// A per-round figure of one variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoundFigure {
    /// wrk's requests per second.
    Rps,
    /// wrk's 99th percentile latency.
    P99,
    /// The filter's callouts per request over the round's second half (steady load).
    CalloutsSteady,
    /// The share of requests that waited for a pool's refresh over the
    /// round's second half (steady load: a round's first requests find 1,000
    /// cold pools, whose first leases they wait for).
    WaitedSteady,
    /// The median latency of sequential requests on one connection.
    LatencyP50,
}

impl RoundFigure {
    fn name(self) -> &'static str {
        match self {
            RoundFigure::Rps => "req/s",
            RoundFigure::P99 => "p99 under load",
            RoundFigure::CalloutsSteady => "callouts per request at steady load (second halves)",
            RoundFigure::WaitedSteady => "requests that waited for a refresh at steady load (second halves)",
            RoundFigure::LatencyP50 => "p50 on one connection",
        }
    }

    /// The table whose figures this metric comes from.
    fn table(self) -> ReportTable {
        match self {
            RoundFigure::Rps | RoundFigure::P99 => ReportTable::Throughput,
            RoundFigure::CalloutsSteady | RoundFigure::WaitedSteady => ReportTable::Global,
            RoundFigure::LatencyP50 => ReportTable::Latency,
        }
    }
}

/// What a target compares, for the variant whose row carries it.
#[derive(Clone, Copy, Debug)]
pub enum Measure {
    /// The variant's own figure.
    Value(RoundFigure),
    /// The variant's figure ÷ `against`'s, round by round.
    Ratio {
        /// What is compared.
        metric: RoundFigure,
        /// The other variant's id.
        against: &'static str,
    },
    /// Requests per second of two paths, each against the same set-up
    /// without its filter: (this ÷ `ceiling`) ÷ (`other` ÷ `other_ceiling`),
    /// round by round. For paths that do not route alike (a direct response
    /// against a proxied one).
    OverCeilings {
        /// This variant's set-up without the filter.
        ceiling: &'static str,
        /// The other path.
        other: &'static str,
        /// The other path's set-up without its filter.
        other_ceiling: &'static str,
    },
}

/// Which side of `bound` meets the target.
#[derive(Clone, Copy, Debug)]
pub enum Bound {
    /// At least this.
    AtLeast(f64),
    /// At most this.
    AtMost(f64),
}

/// A target of an issue.
#[derive(Clone, Copy, Debug)]
pub struct Target {
    /// The issue that sets it.
    pub issue: u32,
    /// What is measured.
    pub measure: Measure,
    /// Where it must be.
    pub bound: Bound,
    /// The `BENCH_QUOTA_UNIT` the issue states the target for, if any.
    pub quota_unit: Option<&'static str>,
}

/// A target's figure over the rounds of a run.
#[derive(Debug)]
pub struct TargetOutcome {
    /// One value per round.
    pub rounds: Vec<f64>,
    /// Their median, which is judged.
    pub median: f64,
    /// Whether the median meets the bound.
    pub met: bool,
}

/// The per-round figures of a variant by id, `None` when it did not run.
pub type Figures<'a> = dyn Fn(&str, RoundFigure) -> Option<Vec<f64>> + 'a;

impl Target {
    /// A target of issue `issue` that is not tied to a quota unit.
    pub const fn new(issue: u32, measure: Measure, bound: Bound) -> Target {
        Target { issue, measure, bound, quota_unit: None }
    }

    /// The table it is printed under, for a target on a variant that is
    /// (`global_mode`) or is not one of Floodgate's global-mode variants.
    pub fn table(&self, global_mode: bool) -> ReportTable {
        let metric = match self.measure {
            Measure::Value(metric) | Measure::Ratio { metric, .. } => metric,
            Measure::OverCeilings { .. } => RoundFigure::Rps,
        };
        match metric.table() {
            ReportTable::Throughput if global_mode => ReportTable::Global,
            table => table,
        }
    }

    /// Its figure for variant `id`, or the id of a variant it needs that did not run.
    pub fn evaluate(&self, id: &'static str, figures: &Figures) -> Result<TargetOutcome, &'static str> {
        let get = |v: &'static str, m: RoundFigure| figures(v, m).filter(|f| !f.is_empty()).ok_or(v);
        let rounds = match self.measure {
            Measure::Value(metric) => get(id, metric)?,
            Measure::Ratio { metric, against } => per_round(&get(id, metric)?, &get(against, metric)?),
            Measure::OverCeilings { ceiling, other, other_ceiling } => {
                let own = per_round(&get(id, RoundFigure::Rps)?, &get(ceiling, RoundFigure::Rps)?);
                let others = per_round(&get(other, RoundFigure::Rps)?, &get(other_ceiling, RoundFigure::Rps)?);
                per_round(&own, &others)
            }
        };
        let median = median(&rounds);
        let met = match self.bound {
            Bound::AtLeast(b) => median >= b,
            Bound::AtMost(b) => median <= b,
        };
        Ok(TargetOutcome { rounds, median, met })
    }

    /// What it says, e.g. "(d) ÷ (c), req/s ≥ 0.90".
    pub fn describe(&self, id: &str) -> String {
        let what = match self.measure {
            Measure::Value(metric) => format!("({id}) {}", metric.name()),
            Measure::Ratio { metric, against } => format!("({id}) ÷ ({against}), {}", metric.name()),
            Measure::OverCeilings { ceiling, other, other_ceiling } => {
                format!("(({id}) ÷ ({ceiling})) ÷ (({other}) ÷ ({other_ceiling})), req/s: each path against its set-up without the filter")
            }
        };
        let (sign, bound) = match self.bound {
            Bound::AtLeast(b) => ("≥", b),
            Bound::AtMost(b) => ("≤", b),
        };
        let bound = match self.measure {
            Measure::Value(RoundFigure::WaitedSteady) => format!("{:.1}%", 100.0 * bound),
            _ => format!("{bound:.2}"),
        };
        format!("{what} {sign} {bound}")
    }

    /// A measured figure: a share in percent, callouts to five places, ratios to three.
    pub fn format(&self, value: f64) -> String {
        match self.measure {
            Measure::Value(RoundFigure::WaitedSteady) => format!("{:.2}%", 100.0 * value),
            Measure::Value(_) => format!("{value:.5}"),
            _ => format!("{value:.3}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(id: &str, metric: RoundFigure) -> Option<Vec<f64>> {
        match (id, metric) {
            ("x", RoundFigure::Rps) => Some(vec![90.0, 80.0, 100.0]),
            ("y", RoundFigure::Rps) => Some(vec![100.0, 100.0, 100.0]),
            ("x", RoundFigure::WaitedSteady) => Some(vec![0.01, 0.002, 0.004]),
            _ => None,
        }
    }

    #[test]
    fn ratios_are_taken_round_by_round_then_the_median_is_judged() {
        let target = Target::new(14, Measure::Ratio { metric: RoundFigure::Rps, against: "y" }, Bound::AtLeast(0.9));
        let outcome = target.evaluate("x", &figures).unwrap();
        assert_eq!(outcome.rounds, vec![0.9, 0.8, 1.0]);
        assert!(outcome.met, "median 0.9 meets ≥ 0.9");
        let stricter = Target { bound: Bound::AtLeast(0.91), ..target };
        assert!(!stricter.evaluate("x", &figures).unwrap().met);
    }

    #[test]
    fn an_upper_bound_and_a_missing_variant() {
        let waited = Target::new(15, Measure::Value(RoundFigure::WaitedSteady), Bound::AtMost(0.005));
        assert!(waited.evaluate("x", &figures).unwrap().met, "median 0.004");
        let ratio = Target::new(15, Measure::Ratio { metric: RoundFigure::Rps, against: "z" }, Bound::AtLeast(1.0));
        assert_eq!(ratio.evaluate("x", &figures).unwrap_err(), "z");
    }

    #[test]
    fn over_ceilings_divides_each_path_by_its_own_ceiling() {
        let target = Target::new(
            15,
            Measure::OverCeilings { ceiling: "y", other: "y", other_ceiling: "y" },
            Bound::AtLeast(1.0),
        );
        let outcome = target.evaluate("x", &figures).unwrap();
        assert_eq!(outcome.rounds, vec![0.9, 0.8, 1.0]);
        assert!(!outcome.met);
    }
}
