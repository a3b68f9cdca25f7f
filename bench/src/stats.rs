//! Medians, spreads, percentiles, the number formats of the tables, and
//! the load average.

/// The median; NaN for no values.
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The smallest and the largest value; NaN for no values.
pub fn spread(values: &[f64]) -> (f64, f64) {
    if values.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    values.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)))
}

/// The nearest-rank `p`th percentile of `sorted` (ascending); 0 for none.
pub fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// `x / y` to three places, or a dash when a variant was not run.
pub fn ratio(x: f64, y: f64) -> String {
    let r = x / y;
    if r.is_finite() {
        format!("{r:.3}")
    } else {
        "—".to_string()
    }
}

/// Microseconds as milliseconds, three places.
pub fn ms(us: f64) -> String {
    format!("{:.3}", us / 1000.0)
}

/// Per-round ratios `x[i] / y[i]` of two variants measured in the same rounds.
pub fn per_round(x: &[f64], y: &[f64]) -> Vec<f64> {
    x.iter().zip(y).map(|(a, b)| a / b).collect()
}

/// The one-minute load average now, reported beside the figures.
pub fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!((percentile(&v, 50.0), percentile(&v, 90.0), percentile(&v, 99.0)), (50, 90, 99));
        assert_eq!(percentile(&[7], 99.0), 7);
        assert_eq!(percentile(&[], 50.0), 0);
    }

    #[test]
    fn median_and_spread() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
        assert_eq!(spread(&[3.0, 1.0, 2.0]), (1.0, 3.0));
    }
}
