//! How big a lease is: the one implementation of lease sizing, used by the
//! quota service for both of its stores. Pure functions of plain integers;
//! times are nanoseconds (`u64`), like the rest of the core.
//!
//! * [`lease_target`] (before the store is asked): what a caller should get
//!   if quota were plentiful, from the rate it reports.
//! * [`grant_cap`] (inside the store's atomic step): the most the store may
//!   hand out given what remains, so that no caller takes more than a
//!   fraction of it and the last part of a window is paced out instead of
//!   grabbed.

/// Nanoseconds in a second.
const SECOND_NS: u64 = 1_000_000_000;

/// Below `remaining * LOW_WATER_DIVISOR < capacity` (10 % left) grants are
/// paced over the time left, not just halved.
pub const LOW_WATER_DIVISOR: u64 = 10;

/// Tokens a lease aims for: enough for the caller's observed `rate` (tokens
/// per second) over one lease lifetime `ttl_ns`, at least 1 and at most what
/// it asked for (`wanted`) and the rule's `capacity`. A caller that reports
/// no rate starts with 1 % of the capacity.
pub fn lease_target(wanted: u64, rate: Option<f64>, ttl_ns: u64, capacity: u64) -> u64 {
    let ceiling = wanted.min(capacity);
    if ceiling == 0 {
        return 0;
    }
    let aim = match rate {
        Some(rate) if rate.is_finite() && rate > 0.0 => {
            // f64 -> u64 `as` saturates, so an absurd rate is just "a lot".
            (rate * ttl_ns as f64 / SECOND_NS as f64).ceil() as u64
        }
        _ => capacity / 100,
    };
    aim.clamp(1, ceiling)
}

/// The most a single lease may take when `remaining` tokens are left out of
/// `capacity`, `horizon_ns` is the time over which what remains must last
/// (the rest of a fixed window; a token bucket's period) and leases live
/// `ttl_ns`.
///
/// * Never more than half of what remains (rounded up, so the last token can
///   still be leased).
/// * Below 10 % of the capacity, never more than the share of what remains
///   that one lease lifetime represents in the horizon (at least 1): the tail
///   of the window is spread over its remaining time.
///
/// Exact integer arithmetic over the whole `u64` range (products in `u128`).
pub fn grant_cap(remaining: u64, capacity: u64, horizon_ns: u64, ttl_ns: u64) -> u64 {
    if remaining == 0 {
        return 0;
    }
    let half = remaining.div_ceil(2);
    if remaining.saturating_mul(LOW_WATER_DIVISOR) >= capacity {
        return half;
    }
    let paced = (u128::from(remaining) * u128::from(ttl_ns)).div_ceil(u128::from(horizon_ns.max(1)));
    half.min(u64::try_from(paced).unwrap_or(u64::MAX).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = SECOND_NS;

    #[test]
    fn target_follows_the_observed_rate() {
        // 200 tokens/s over a 1 s lease: 200.
        assert_eq!(lease_target(1_000, Some(200.0), S, 10_000), 200);
        // A faster caller gets more.
        assert!(lease_target(1_000, Some(800.0), S, 10_000) > 200);
        // Never above what was asked for, nor the capacity.
        assert_eq!(lease_target(50, Some(800.0), S, 10_000), 50);
        assert_eq!(lease_target(1_000, Some(800.0), S, 30), 30);
        // A slow caller still gets one.
        assert_eq!(lease_target(1_000, Some(0.01), S, 10_000), 1);
    }

    #[test]
    fn target_without_a_rate_is_one_percent() {
        assert_eq!(lease_target(1_000, None, S, 10_000), 100);
        assert_eq!(lease_target(1_000, Some(f64::NAN), S, 10_000), 100);
        assert_eq!(lease_target(1_000, None, S, 10), 1);
        assert_eq!(lease_target(0, None, S, 10), 0);
    }

    #[test]
    fn cap_is_half_of_what_remains_while_plenty_is_left() {
        assert_eq!(grant_cap(1_000, 1_000, 60 * S, S), 500);
        assert_eq!(grant_cap(100, 1_000, 60 * S, S), 50);
        assert_eq!(grant_cap(0, 1_000, 60 * S, S), 0);
    }

    #[test]
    fn cap_shrinks_and_paces_below_low_water() {
        // 90 of 1000 left with 30 s of window to go and 1 s leases: 3 per lease.
        assert_eq!(grant_cap(90, 1_000, 30 * S, S), 3);
        // With 1 s to go, pacing allows all of it, halving still applies.
        assert_eq!(grant_cap(90, 1_000, S, S), 45);
        // The last token is always leasable.
        assert_eq!(grant_cap(1, 1_000, 30 * S, S), 1);
        // Monotonic: less remaining never means a larger cap.
        let mut last = u64::MAX;
        for remaining in (1..=1_000u64).rev() {
            let cap = grant_cap(remaining, 1_000, 30 * S, S);
            assert!(cap <= last, "cap grew at {remaining}");
            assert!(cap <= remaining.div_ceil(2));
            last = cap;
        }
    }

    #[test]
    fn cap_is_exact_at_the_edges_of_the_range() {
        // 10^9 per year, a year to go, 60 s leases: no overflow, exact.
        let year = 365 * 24 * 3_600 * S;
        assert_eq!(grant_cap(99_999_999, 1_000_000_000, year, 60 * S), 191);
        assert_eq!(grant_cap(u64::MAX, u64::MAX, u64::MAX, u64::MAX), u64::MAX.div_ceil(2));
        assert_eq!(grant_cap(1, u64::MAX, 0, u64::MAX), 1);
    }
}
