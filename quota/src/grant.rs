//! How big a lease is. Two halves, both pure:
//!
//! * [`lease_target`] (service side, before the store is asked): what the
//!   caller should get if quota were plentiful, from the rate it reports.
//! * [`grant_cap`] (inside the store's atomic step, mirrored line for line in
//!   the Redis Lua scripts): the most the store may hand out given what
//!   remains, so that no caller takes more than a fraction of it and the last
//!   part of a window is paced out instead of grabbed.

use crate::clock::{Micros, SECOND_US};

/// Below `remaining * LOW_WATER_DIVISOR < capacity` (10 % left) grants are
/// paced over the time left, not just halved.
pub const LOW_WATER_DIVISOR: u64 = 10;

/// Tokens a lease aims for: enough for the caller's observed `rate`
/// (tokens per second) over one lease lifetime `ttl`, at least 1 and at most
/// what it asked for (`wanted`) and the rule's `capacity`. A caller that
/// reports no rate starts with 1 % of the capacity.
pub fn lease_target(wanted: u64, rate: Option<f64>, ttl: Micros, capacity: u64) -> u64 {
    let ceiling = wanted.min(capacity);
    if ceiling == 0 {
        return 0;
    }
    let aim = match rate {
        Some(rate) if rate.is_finite() && rate > 0.0 => {
            // f64 -> u64 `as` saturates, so an absurd rate is just "a lot".
            (rate * ttl as f64 / SECOND_US as f64).ceil() as u64
        }
        _ => capacity / 100,
    };
    aim.clamp(1, ceiling)
}

/// The most a single lease may take when `remaining` tokens are left out of
/// `capacity`, `horizon` is the time over which what remains must last (the
/// rest of a fixed window; a token bucket's period) and leases live `ttl`.
///
/// * Never more than half of what remains (rounded up, so the last token can
///   still be leased).
/// * Below 10 % of the capacity, never more than the share of what remains
///   that one lease lifetime represents in the horizon (at least 1): the tail
///   of the window is spread over its remaining time.
///
/// Arithmetic stays below 2^53 for capacities up to 10^9 and lifetimes up to
/// 60 s (the config and CLI enforce both), so the Lua mirror is exact.
pub fn grant_cap(remaining: u64, capacity: u64, horizon: Micros, ttl: Micros) -> u64 {
    if remaining == 0 {
        return 0;
    }
    let half = remaining.div_ceil(2);
    if remaining.saturating_mul(LOW_WATER_DIVISOR) >= capacity {
        return half;
    }
    let paced = u128::from(remaining) * u128::from(ttl);
    let paced = u64::try_from(paced.div_ceil(u128::from(horizon.max(1)))).unwrap_or(u64::MAX);
    half.min(paced.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_follows_the_observed_rate() {
        // 200 tokens/s over a 1 s lease: 200.
        assert_eq!(lease_target(1_000, Some(200.0), SECOND_US, 10_000), 200);
        // A faster caller gets more.
        assert!(lease_target(1_000, Some(800.0), SECOND_US, 10_000) > 200);
        // Never above what was asked for, nor the capacity.
        assert_eq!(lease_target(50, Some(800.0), SECOND_US, 10_000), 50);
        assert_eq!(lease_target(1_000, Some(800.0), SECOND_US, 30), 30);
        // A slow caller still gets one.
        assert_eq!(lease_target(1_000, Some(0.01), SECOND_US, 10_000), 1);
    }

    #[test]
    fn target_without_a_rate_is_one_percent() {
        assert_eq!(lease_target(1_000, None, SECOND_US, 10_000), 100);
        assert_eq!(lease_target(1_000, Some(f64::NAN), SECOND_US, 10_000), 100);
        assert_eq!(lease_target(1_000, None, SECOND_US, 10), 1);
        assert_eq!(lease_target(0, None, SECOND_US, 10), 0);
    }

    #[test]
    fn cap_is_half_of_what_remains_while_plenty_is_left() {
        assert_eq!(grant_cap(1_000, 1_000, 60 * SECOND_US, SECOND_US), 500);
        assert_eq!(grant_cap(100, 1_000, 60 * SECOND_US, SECOND_US), 50);
        assert_eq!(grant_cap(0, 1_000, 60 * SECOND_US, SECOND_US), 0);
    }

    #[test]
    fn cap_shrinks_and_paces_below_low_water() {
        // 90 of 1000 left with 30 s of window to go and 1 s leases: 3 per lease.
        assert_eq!(grant_cap(90, 1_000, 30 * SECOND_US, SECOND_US), 3);
        // With 1 s to go, pacing allows all of it, halving still applies.
        assert_eq!(grant_cap(90, 1_000, SECOND_US, SECOND_US), 45);
        // The last token is always leasable.
        assert_eq!(grant_cap(1, 1_000, 30 * SECOND_US, SECOND_US), 1);
        // Monotonic: less remaining never means a larger cap.
        let mut last = u64::MAX;
        for remaining in (1..=1_000u64).rev() {
            let cap = grant_cap(remaining, 1_000, 30 * SECOND_US, SECOND_US);
            assert!(cap <= last, "cap grew at {remaining}");
            assert!(cap <= remaining.div_ceil(2));
            last = cap;
        }
    }
}
