//! Weighted samples: each simulated wait stands for its key's weight in
//! real requests, so its distribution is read with those weights.

/// Values with weights, for weighted percentiles.
#[derive(Debug, Clone, Default)]
pub struct Tally {
    samples: Vec<(f32, f32)>,
    total: f64,
}

impl Tally {
    /// Adds `value` standing for `weight` observations.
    pub fn add(&mut self, value: f64, weight: f64) {
        self.samples.push((value as f32, weight as f32));
        self.total += weight;
    }

    /// The weighted `p50`, `p90` and `p99`.
    pub fn quantiles(&self) -> [f64; 3] {
        let mut sorted = self.samples.clone();
        sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
        let total: f64 = sorted.iter().map(|s| f64::from(s.1)).sum();
        let mut out = [0.0; 3];
        for (slot, p) in out.iter_mut().zip([0.5, 0.9, 0.99]) {
            let goal = p * total;
            let mut seen = 0.0;
            *slot = sorted.last().map_or(0.0, |s| f64::from(s.0));
            for (value, weight) in &sorted {
                seen += f64::from(*weight);
                if seen >= goal {
                    *slot = f64::from(*value);
                    break;
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_count_as_observations() {
        let mut t = Tally::default();
        t.add(1.0, 1.0);
        t.add(10.0, 9.0);
        assert_eq!(t.quantiles(), [10.0, 10.0, 10.0]);
        let mut u = Tally::default();
        (1..=100).for_each(|i| u.add(f64::from(i), 1.0));
        assert_eq!(u.quantiles(), [50.0, 90.0, 99.0]);
        assert_eq!(Tally::default().quantiles(), [0.0; 3]);
    }
}
