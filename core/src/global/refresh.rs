//! When a pool of leased tokens needs more, and how much to ask for.
//!
//! A refresh is due early: while the pool still holds enough for the time a
//! refresh can take (twice the callout timeout, at the observed rate), and
//! before its lease expires, so steady traffic never finds it empty. The ask
//! follows the traffic: enough for two lease horizons at the observed rate;
//! the service then caps the grant so no Envoy takes more than its share.

use crate::time::{Nanos, SECOND};

/// The largest ask (the protocol's limit on `wanted`).
pub const MAX_WANTED: u64 = 1_000_000_000;

/// When and how much to refresh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefreshPolicy {
    /// The longest one refresh may take: the callout timeout.
    pub lead: Nanos,
    /// How long one grant should last at the observed rate.
    pub horizon: Nanos,
}

impl RefreshPolicy {
    /// Observed consumption in tokens per second: `spent` tokens since
    /// `since`, averaged over at least one horizon, so that a few requests
    /// just after a refresh do not look like a flood.
    pub fn rate(&self, spent: u64, since: Nanos, now: Nanos) -> f64 {
        let window = (now - since).max(self.horizon).max(Nanos(1));
        spent as f64 * SECOND.get() as f64 / window.get() as f64
    }

    /// Whether a pool holding `usable` tokens, which expire at `expires_at`,
    /// should be refreshed at `now` when it is spent at `rate`.
    pub fn due(&self, usable: u64, expires_at: Nanos, rate: f64, now: Nanos) -> bool {
        let lead = self.lead.times(2);
        let runs_dry_soon = usable as f64 <= rate * lead.get() as f64 / SECOND.get() as f64;
        usable == 0 || runs_dry_soon || expires_at - now <= lead
    }

    /// Tokens to ask for at `rate`: two horizons' worth, at least one.
    pub fn wanted(&self, rate: f64) -> u64 {
        let ask = (rate * self.horizon.times(2).get() as f64 / SECOND.get() as f64).ceil();
        // `as` saturates, and NaN becomes 0: both end in the clamp.
        (ask as u64).clamp(1, MAX_WANTED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Nanos = Nanos(1_700_000_000 * SECOND.0);

    fn policy() -> RefreshPolicy {
        RefreshPolicy { lead: Nanos::from_millis(300), horizon: SECOND }
    }

    #[test]
    fn the_rate_is_averaged_over_at_least_a_horizon() {
        let p = policy();
        assert_eq!(p.rate(100, T0, T0 + SECOND.times(2)), 50.0);
        assert_eq!(p.rate(5, T0, T0 + Nanos::from_millis(1)), 5.0, "5 in 1 ms is not 5000/s");
        assert_eq!(p.rate(0, T0, T0), 0.0);
    }

    #[test]
    fn due_before_running_dry_or_expiring() {
        let p = policy();
        let far = T0 + SECOND.times(60);
        // 100/s: a refresh takes up to 300 ms, so below 60 tokens it is due.
        assert!(!p.due(61, far, 100.0, T0));
        assert!(p.due(60, far, 100.0, T0));
        assert!(p.due(0, far, 0.0, T0), "an empty pool is always due");
        // Plenty of tokens, but the lease ends within two leads.
        assert!(p.due(1_000, T0 + Nanos::from_millis(600), 1.0, T0));
        assert!(!p.due(1_000, T0 + Nanos::from_millis(601), 1.0, T0));
    }

    #[test]
    fn the_ask_follows_the_rate_within_bounds() {
        let p = policy();
        assert_eq!(p.wanted(100.0), 200);
        assert_eq!(p.wanted(0.0), 1);
        assert_eq!(p.wanted(f64::NAN), 1);
        assert_eq!(p.wanted(1e30), MAX_WANTED);
    }
}
