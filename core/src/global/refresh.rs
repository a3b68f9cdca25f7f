//! When a pool of leased tokens needs more, and how much to ask for.
//!
//! A refresh is due early: while the pool still holds enough for twice the
//! time refreshes have been taking (at the observed rate), and before its
//! lease expires (in the last quarter of its life, or the last callout
//! timeout, whichever is shorter), so steady traffic never finds it empty.
//! The ask follows the traffic: enough for two lease horizons at the
//! observed rate; the service then caps the grant so no Envoy takes more
//! than its share.

use crate::time::{Nanos, SECOND};

/// The largest ask (the protocol's limit on `wanted`).
pub const MAX_WANTED: u64 = 1_000_000_000;

/// The least time a refresh is assumed to take, however fast the last ones were.
pub const MIN_LATENCY: Nanos = Nanos(5_000_000);

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

    /// Whether a pool should be refreshed at `now`: it holds `usable`
    /// tokens of a lease valid from `leased_at` to `expires_at`, is spent at
    /// `rate`, and refreshes have been taking `latency`.
    pub fn due(&self, usable: u64, leased_at: Nanos, expires_at: Nanos, rate: f64, latency: Nanos, now: Nanos) -> bool {
        let lead = latency.max(MIN_LATENCY).times(2);
        let runs_dry_soon = usable as f64 <= rate * lead.get() as f64 / SECOND.get() as f64;
        let margin = self.lead.min(Nanos((expires_at - leased_at).get() / 4));
        usable == 0 || runs_dry_soon || expires_at - now <= margin
    }

    /// The rate observation to keep after a refresh at `now`: what was spent
    /// since `since`, scaled down to the last horizon once the observation
    /// is older than two horizons, so the rate follows traffic without
    /// starting from nothing at every lease.
    pub fn carry(&self, spent: u64, since: Nanos, now: Nanos) -> (u64, Nanos) {
        let age = now - since;
        if age <= self.horizon.times(2) {
            return (spent, since);
        }
        let kept = u128::from(spent) * u128::from(self.horizon.get()) / u128::from(age.get().max(1));
        (u64::try_from(kept).unwrap_or(u64::MAX), now - self.horizon)
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
        let (start, far) = (T0 - SECOND, T0 + SECOND.times(60));
        let ms = Nanos::from_millis;
        // 100/s with refreshes taking 100 ms: below 20 tokens it is due.
        assert!(!p.due(21, start, far, 100.0, ms(100), T0));
        assert!(p.due(20, start, far, 100.0, ms(100), T0));
        // Fast refreshes count as 5 ms: 100/s is due at 1 token.
        assert!(!p.due(2, start, far, 100.0, ms(1), T0));
        assert!(p.due(1, start, far, 100.0, ms(1), T0));
        assert!(p.due(0, start, far, 0.0, ms(1), T0), "an empty pool is always due");
        // A 1 s lease is due in its last quarter (shorter than the 300 ms timeout).
        assert!(!p.due(1_000, T0, T0 + SECOND, 1.0, ms(1), T0 + ms(749)));
        assert!(p.due(1_000, T0, T0 + SECOND, 1.0, ms(1), T0 + ms(750)));
        // A 60 s lease is due in the last callout timeout.
        assert!(!p.due(1_000, T0, T0 + SECOND.times(60), 1.0, ms(1), T0 + SECOND.times(60) - ms(301)));
        assert!(p.due(1_000, T0, T0 + SECOND.times(60), 1.0, ms(1), T0 + SECOND.times(60) - ms(300)));
    }

    #[test]
    fn the_rate_observation_carries_over_refreshes() {
        let p = policy();
        assert_eq!(p.carry(150, T0, T0 + SECOND), (150, T0), "young: kept whole");
        // 300 over 3 s: the last second's share, 100, from a second ago.
        assert_eq!(p.carry(300, T0, T0 + SECOND.times(3)), (100, T0 + SECOND.times(2)));
        assert_eq!(p.rate(100, T0 + SECOND.times(2), T0 + SECOND.times(3)), 100.0);
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
