//! When a pool of leased tokens needs more, and how much to ask for.
//!
//! A refresh is due early, so that steady traffic never finds the pool
//! empty: while the pool still holds enough for twice the time refreshes
//! have been taking (at the observed rate), or for the next few requests of a
//! thin key ([`THIN_REQUESTS`], within the last quarter of the lease's life),
//! and before the lease expires (within the last callout timeout or those
//! few requests' time, whichever is longer, but not before the last quarter
//! of the lease's life), and never later than twice the time refreshes
//! have been taking before it.
//! The ask tops the pool up to one lease horizon at the observed rate; the
//! service then caps the grant so no Envoy takes more than its share.

use crate::time::{Nanos, SECOND};

/// The largest ask (the protocol's limit on `wanted`).
pub const MAX_WANTED: u64 = 1_000_000_000;

/// The least time a refresh is assumed to take, however fast the last ones were.
pub const MIN_LATENCY: Nanos = Nanos::from_nanos(5_000_000);

/// The shortest time a rate is averaged over (or the horizon, if shorter):
/// long enough that a few requests just after a refresh do not look like a
/// flood, short enough that a new pool under a long horizon sizes its asks to
/// its traffic within a second.
pub const RATE_FLOOR: Nanos = SECOND;

/// Requests a thin key's refresh runs ahead of: the pool is due while it
/// still holds this many, or this many requests' time before its lease
/// expires (both within the lease's last quarter), so that a request of the
/// key is likely to come while the refresh can still be in flight in time
/// (with steady random arrivals, none comes within three requests' time
/// only one time in twenty).
pub const THIN_REQUESTS: f64 = 3.0;

/// A pool's observed consumption: tokens spent since an instant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateSeen {
    /// Tokens spent since `since`.
    pub spent: u64,
    /// Start of the observation.
    pub since: Nanos,
}

/// A lease's life: from when its tokens count until they expire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Life {
    /// When its tokens start counting.
    pub from: Nanos,
    /// When they expire.
    pub until: Nanos,
}

impl Life {
    /// `1 / part` of its length.
    fn share(&self, part: u64) -> Nanos {
        (self.until - self.from) / part
    }
}

/// When and how much to refresh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefreshPolicy {
    /// The longest one refresh may take: the callout timeout.
    pub lead: Nanos,
    /// How long one grant should last at the observed rate.
    pub horizon: Nanos,
}

impl RefreshPolicy {
    /// Observed consumption in tokens per second: what `seen` spent,
    /// averaged over at least [`RATE_FLOOR`] (or the horizon, if shorter),
    /// so that a few requests just after a refresh do not look like a flood.
    pub fn rate(&self, seen: RateSeen, now: Nanos) -> f64 {
        let window = (now - seen.since).max(self.horizon.min(RATE_FLOOR)).max(Nanos::ONE);
        window.per_second(seen.spent as f64)
    }

    /// How long a refresh should be allowed to take: twice what refreshes
    /// have been taking (`latency`, at least [`MIN_LATENCY`]).
    pub fn turnaround(&self, latency: Nanos) -> Nanos {
        latency.max(MIN_LATENCY).times(2)
    }

    /// The time a thin key's few requests ([`THIN_REQUESTS`]) take at `rate`.
    pub fn few_requests(rate: f64) -> Nanos {
        let few_requests = if rate > 0.0 { THIN_REQUESTS / rate } else { 0.0 };
        // `as` saturates: a rate near zero makes it "forever" (callers cap it).
        Nanos::from_secs_f64(few_requests)
    }

    /// Whether a pool should be refreshed at `now`: it holds `usable`
    /// tokens of a lease of `life`, it is spent at `rate`, and refreshes
    /// have been taking `latency`.
    pub fn due(&self, usable: u64, life: Life, rate: f64, latency: Nanos, now: Nanos) -> bool {
        let lead = self.turnaround(latency).max(Self::few_requests(rate).min(life.share(4)));
        let runs_dry_soon = usable as f64 <= lead.events_at(rate);
        usable == 0 || runs_dry_soon || self.expires_soon(life, rate, latency, now)
    }

    /// Whether a lease of `life` is close enough to its end at `now` to
    /// refresh it: within the last callout timeout or a thin key's few
    /// requests' time (whichever is longer, but not before the last quarter
    /// of its life), and never later than a refresh's
    /// [`RefreshPolicy::turnaround`] before it.
    pub fn expires_soon(&self, life: Life, rate: f64, latency: Nanos, now: Nanos) -> bool {
        self.within(4, life, rate, latency, now)
    }

    /// Whether a lease that ends with its window is close enough to its end
    /// at `now` to ask for the next window's: as [`RefreshPolicy::expires_soon`],
    /// but as early as the last half of its life. A thin key's requests are
    /// few, and one must come in that span to ask; asking early costs
    /// nothing (one ask per window either way, and the tokens held meanwhile
    /// are this window's, spent first).
    pub fn next_due(&self, life: Life, rate: f64, latency: Nanos, now: Nanos) -> bool {
        self.within(2, life, rate, latency, now)
    }

    /// Whether `now` is within the margin before the end of `life`, at most
    /// `1 / part` of it (see [`RefreshPolicy::expires_soon`]).
    fn within(&self, part: u64, life: Life, rate: f64, latency: Nanos, now: Nanos) -> bool {
        let margin = life.share(part).min(self.lead.max(Self::few_requests(rate)));
        life.until - now <= margin.max(self.turnaround(latency))
    }

    /// The rate observation to keep after a refresh at `now`: what was spent
    /// since it began, scaled down to the last horizon once the observation
    /// is older than two horizons, so the rate follows traffic without
    /// starting from nothing at every lease.
    pub fn carry(&self, seen: RateSeen, now: Nanos) -> RateSeen {
        let age = now - seen.since;
        if age <= self.horizon.times(2) {
            return seen;
        }
        let kept = u128::from(seen.spent) * u128::from(self.horizon.get()) / u128::from(age.get().max(1));
        RateSeen { spent: u64::try_from(kept).unwrap_or(u64::MAX), since: now - self.horizon }
    }

    /// The rate observation of a pool that had nothing usable since
    /// `idle_since` and is spent again at `now`: after a whole horizon
    /// without tokens, an observation begun before the pause is mostly the
    /// pause, and would make the asks of revived traffic tiny; it starts
    /// afresh instead.
    pub fn revive(&self, seen: RateSeen, idle_since: Nanos, now: Nanos) -> RateSeen {
        if seen.since < idle_since && now - idle_since >= self.horizon {
            RateSeen { spent: 0, since: now }
        } else {
            seen
        }
    }

    /// Tokens to ask for at `rate` while `usable` are still held: what tops
    /// the pool up to one horizon's worth, at least one. (Asking for more
    /// would leave the held tokens to expire unspent, stranded in this
    /// Envoy until then.)
    pub fn wanted(&self, rate: f64, usable: u64) -> u64 {
        let ask = self.horizon.events_at(rate).ceil();
        // `as` saturates, and NaN becomes 0: both end in the clamp.
        (ask as u64).saturating_sub(usable).clamp(1, MAX_WANTED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const T0: Nanos = Nanos::from_secs(1_700_000_000);

    fn seen(spent: u64, since: Nanos) -> RateSeen {
        RateSeen { spent, since }
    }

    fn life(from: Nanos, until: Nanos) -> Life {
        Life { from, until }
    }

    fn policy() -> RefreshPolicy {
        RefreshPolicy { lead: Nanos::from_millis(300), horizon: SECOND }
    }

    /// Leases of 10 s, as a rule with `lease_horizon: "10s"` asks for.
    fn long() -> RefreshPolicy {
        RefreshPolicy { horizon: SECOND.times(10), ..policy() }
    }

    #[test]
    fn the_rate_is_averaged_over_at_least_a_horizon() {
        let p = policy();
        assert_eq!(p.rate(seen(100, T0), T0 + SECOND.times(2)), 50.0);
        assert_eq!(p.rate(seen(5, T0), T0 + Nanos::from_millis(1)), 5.0, "5 in 1 ms is not 5000/s");
        assert_eq!(p.rate(seen(0, T0), T0), 0.0);
    }

    #[test]
    fn a_young_pool_under_a_long_horizon_averages_over_a_second_not_the_horizon() {
        let p = long();
        assert_eq!(p.rate(seen(5, T0), T0 + Nanos::from_millis(500)), 5.0, "not 0.5/s for 10 s");
        assert_eq!(p.rate(seen(30, T0), T0 + SECOND.times(3)), 10.0);
        assert_eq!(p.rate(seen(100, T0), T0 + SECOND.times(20)), 5.0);
        // Its first ask is a horizon at the floor's rate: 10 for a 10 s lease, not 2.
        assert_eq!(p.wanted(p.rate(seen(1, T0), T0), 0), 10);
    }

    #[test]
    fn a_pool_revived_after_a_horizon_without_tokens_observes_afresh() {
        let p = long();
        let idle_since = T0 + SECOND.times(5);
        let s = |n| SECOND.times(n);
        assert_eq!(p.revive(seen(50, T0), idle_since, idle_since + s(10)), seen(0, idle_since + s(10)));
        assert_eq!(
            p.revive(seen(50, T0), idle_since, idle_since + s(9)),
            seen(50, T0),
            "a pause shorter than the horizon"
        );
        let since = idle_since + s(10);
        assert_eq!(
            p.revive(seen(3, since), idle_since, since + s(1)),
            seen(3, since),
            "observed since the pause already"
        );
    }

    #[test]
    fn due_before_running_dry_or_expiring() {
        let p = policy();
        let (start, far) = (T0 - SECOND, T0 + SECOND.times(60));
        let ms = Nanos::from_millis;
        // 100/s with refreshes taking 100 ms: below 20 tokens it is due.
        assert!(!p.due(21, life(start, far), 100.0, ms(100), T0));
        assert!(p.due(20, life(start, far), 100.0, ms(100), T0));
        // Fast refreshes count as 5 ms: 1000/s is due at 10 tokens.
        assert!(!p.due(11, life(start, far), 1000.0, ms(1), T0));
        assert!(p.due(10, life(start, far), 1000.0, ms(1), T0));
        assert!(p.due(0, life(start, far), 0.0, ms(1), T0), "an empty pool is always due");
        // A 1 s lease is due in its last quarter (shorter than the 300 ms timeout).
        assert!(!p.due(1_000, life(T0, T0 + SECOND), 1.0, ms(1), T0 + ms(749)));
        assert!(p.due(1_000, life(T0, T0 + SECOND), 1.0, ms(1), T0 + ms(750)));
        // A 60 s lease is due in the last callout timeout.
        assert!(!p.due(1_000, life(T0, T0 + SECOND.times(60)), 1000.0, ms(1), T0 + SECOND.times(60) - ms(301)));
        assert!(p.due(1_000, life(T0, T0 + SECOND.times(60)), 1000.0, ms(1), T0 + SECOND.times(60) - ms(300)));
    }

    #[test]
    fn a_thin_key_is_due_a_few_requests_before_it_runs_dry_or_expires() {
        let p = long();
        let ms = Nanos::from_millis;
        let end = T0 + SECOND.times(10);
        // 3 requests a second on a 10 s lease: due with three tokens left
        // (not only at a fraction of one), and in the last second.
        assert!(!p.due(4, life(T0, end), 3.0, ms(5), T0 + SECOND));
        assert!(p.due(3, life(T0, end), 3.0, ms(5), T0 + SECOND));
        assert!(!p.due(100, life(T0, end), 3.0, ms(5), end - ms(1_001)));
        assert!(p.due(100, life(T0, end), 3.0, ms(5), end - SECOND));
        // Never earlier than the lease's last quarter: 0.1/s is not due with 3 left for 30 s.
        assert!(!p.due(3, life(T0, end), 0.1, ms(5), T0 + SECOND));
        assert!(p.due(100, life(T0, end), 0.1, ms(5), end - ms(2_500)));
    }

    #[test]
    fn the_next_window_is_asked_for_from_the_last_half_of_a_lease_and_never_too_late() {
        let p = policy();
        let (start, end) = (T0, T0 + SECOND);
        let ms = Nanos::from_millis;
        // A busy key: the callout timeout before the end (not the quarter).
        assert!(!p.next_due(life(start, end), 1000.0, ms(1), end - ms(301)));
        assert!(p.next_due(life(start, end), 1000.0, ms(1), end - ms(300)));
        assert!(
            !p.expires_soon(life(start, end), 1000.0, ms(1), end - ms(300)),
            "a refresh waits for the last quarter"
        );
        // A thin key: its few requests' time, up to half the lease's life.
        assert!(p.next_due(life(start, end), 5.0, ms(1), end - ms(500)));
        assert!(!p.next_due(life(start, end), 5.0, ms(1), end - ms(501)));
        // Refreshes that take 400 ms: 800 ms ahead, whatever the share.
        assert!(p.next_due(life(start, end), 1000.0, ms(400), end - ms(800)));
        assert!(p.expires_soon(life(start, end), 1000.0, ms(400), end - ms(800)));
    }

    #[test]
    fn the_rate_observation_carries_over_refreshes() {
        let p = policy();
        assert_eq!(p.carry(seen(150, T0), T0 + SECOND), seen(150, T0), "young: kept whole");
        // 300 over 3 s: the last second's share, 100, from a second ago.
        assert_eq!(p.carry(seen(300, T0), T0 + SECOND.times(3)), seen(100, T0 + SECOND.times(2)));
        assert_eq!(p.rate(seen(100, T0 + SECOND.times(2)), T0 + SECOND.times(3)), 100.0);
    }

    #[test]
    fn the_ask_tops_the_pool_up_to_a_horizon_within_bounds() {
        let p = policy();
        assert_eq!(p.wanted(100.0, 0), 100);
        assert_eq!(p.wanted(100.0, 30), 70, "the 30 held are spent first");
        assert_eq!(p.wanted(100.0, 500), 1);
        assert_eq!(p.wanted(0.0, 0), 1);
        assert_eq!(p.wanted(f64::NAN, 0), 1);
        assert_eq!(p.wanted(1e30, 0), MAX_WANTED);
    }
}
