//! How big a lease of one window (or one lifetime) is, used by the
//! quota service for both of its stores. Pure functions of token counts and
//! times ([`Nanos`], like the rest of the core).
//!
//! * [`lease_target`] (before the store is asked): what a caller should get
//!   if quota were plentiful, from the rate it reports.
//! * [`Pace`] (inside the store's atomic step): the most the store may hand
//!   out given what remains, so that no caller takes more than half of it,
//!   and below the low-water mark the rest is handed out no faster than
//!   evenly over the time left, across all callers. The pace is kept per
//!   bucket as one instant, "paced until": how far the even schedule of
//!   what remains has been handed out. (A key's leader, with no callers to
//!   share the tail with, is not paced: see `grant`.)
//! * [`ahead_cap`]: the same for a lease ahead, of the next window before it
//!   starts: half of what that window has left, and nothing of its tail.

use super::allowance::low_count;
use super::refresh::RATE_FLOOR;
use crate::time::Nanos;

/// Below `remaining * LOW_WATER_DIVISOR < capacity` (10 % left) grants are
/// paced over the time left, not just halved.
pub const LOW_WATER_DIVISOR: u64 = 10;

/// The low end of what a caller's reported `rate` (tokens per second)
/// vouches for: it is observed over about [`RATE_FLOOR`], and the callers
/// that ask are the ones that just saw requests, so the count it stands for
/// is read at its low end ([`low_count`]). Used to size the leases of a key
/// heading for its limit in a window that outlasts them.
pub fn low_rate(rate: f64) -> f64 {
    let observed = RATE_FLOOR.as_secs_f64();
    low_count(rate * observed) / observed
}

/// Tokens a lease aims for: enough for the caller's observed `rate` (tokens
/// per second) over the time `usable` the lease may be used (its lifetime, or
/// less when its window ends sooner), at least 1 and at most what
/// it asked for (`wanted`) and the rule's `capacity`. A caller that reports
/// no rate starts with 1 % of the capacity.
pub fn lease_target(wanted: u64, rate: Option<f64>, usable: Nanos, capacity: u64) -> u64 {
    let ceiling = wanted.min(capacity);
    if ceiling == 0 {
        return 0;
    }
    let aim = match rate {
        Some(rate) if rate.is_finite() && rate > 0.0 => {
            // f64 -> u64 `as` saturates, so an absurd rate is just "a lot".
            usable.events_at(rate).ceil() as u64
        }
        _ => capacity / 100,
    };
    aim.clamp(1, ceiling)
}

fn low_water(remaining: u64, capacity: u64) -> bool {
    remaining.saturating_mul(LOW_WATER_DIVISOR) < capacity
}

/// A bucket's pace, as a lease sees it at the instant it is decided: what
/// remains of the bucket's `capacity`, over the `horizon` in which it must
/// last (the rest of a fixed window; a token bucket's period), for leases
/// that live `ttl`, and how far the even schedule of what remains has been
/// handed out (`paced_until`, kept per bucket as one instant).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pace {
    /// Tokens left.
    pub remaining: u64,
    /// The bucket's capacity.
    pub capacity: u64,
    /// The time over which what remains must last.
    pub horizon: Nanos,
    /// How long leases live.
    pub ttl: Nanos,
    /// How far the even schedule has been handed out.
    pub paced_until: Nanos,
}

impl Pace {
    /// The most a single lease may take at `now`.
    ///
    /// * Never more than half of what remains (rounded up, so the last
    ///   token can still be leased).
    /// * Below 10 % of the capacity, what remains is spread evenly over the
    ///   horizon: a lease may take the share of the schedule that keeps it
    ///   at most one lease lifetime ahead of now (at least 1 once the
    ///   schedule has caught up with now, 0 while it is ahead). However
    ///   often and fast callers come, the tail of a window follows time.
    ///
    /// Exact integer arithmetic over the whole `u64` range (products in `u128`).
    pub fn cap(&self, now: Nanos) -> u64 {
        let Pace { remaining, capacity, horizon, ttl, paced_until } = *self;
        if remaining == 0 {
            return 0;
        }
        let half = remaining.div_ceil(2);
        if !low_water(remaining, capacity) {
            return half;
        }
        let start = paced_until.max(now);
        let room = (now + ttl) - start;
        let paced = u128::from(room.get()) * u128::from(remaining) / u128::from(horizon.get().max(1));
        let paced = u64::try_from(paced).unwrap_or(u64::MAX);
        let paced = if start == now { paced.max(1) } else { paced };
        half.min(paced)
    }

    /// How long after `now` [`Pace::cap`] gives a lease at least one token
    /// again, when it gives none now although tokens remain: the schedule
    /// must come within a lease lifetime of the time by one token's share
    /// of the horizon (and at the latest when it has caught up with time).
    /// A caller refused by the pace is told to come back then, not at the
    /// end of the window: the tail is still to be handed out.
    pub fn retry(&self, now: Nanos) -> Nanos {
        let one_token = self.horizon / self.remaining;
        let next = (self.paced_until - self.ttl + one_token).min(self.paced_until);
        next - now
    }

    /// The bucket's "paced until" after `granted` tokens were leased at
    /// `now`: below the low-water mark the schedule advances by the time
    /// those tokens stand for at the even pace (`granted × horizon /
    /// remaining`, rounded up); above it nothing is paced and it stays as
    /// it was.
    pub fn after(&self, granted: u64, now: Nanos) -> Nanos {
        let Pace { remaining, capacity, horizon, paced_until, .. } = *self;
        if granted == 0 || remaining == 0 || !low_water(remaining, capacity) {
            return paced_until;
        }
        let span = (u128::from(granted) * u128::from(horizon.get())).div_ceil(u128::from(remaining));
        paced_until.max(now) + Nanos::from_nanos(u64::try_from(span).unwrap_or(u64::MAX))
    }
}

/// The most a lease ahead may take of the next window, before it starts,
/// when `remaining` of `capacity` are left there: never more than half, as
/// any lease, and nothing below the low-water mark: a window's tail is
/// handed out in the window, paced over its time by [`Pace::cap`].
pub fn ahead_cap(remaining: u64, capacity: u64) -> u64 {
    if low_water(remaining, capacity) {
        0
    } else {
        remaining.div_ceil(2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::SECOND;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const S: u64 = SECOND.get();

    #[test]
    fn a_reported_rate_is_read_at_its_low_end() {
        // A second's 9 requests vouch for 4 a second; one or none for none.
        assert_eq!(low_rate(9.0), 4.0);
        assert_eq!(low_rate(1.0), 0.0);
        assert_eq!(low_rate(0.0), 0.0);
        // A steady 10,000 a second is still about 10,000.
        assert!(low_rate(10_000.0) > 9_800.0);
    }

    // The cases read in plain nanoseconds.
    fn target(wanted: u64, rate: Option<f64>, usable: u64, capacity: u64) -> u64 {
        lease_target(wanted, rate, Nanos::from_nanos(usable), capacity)
    }

    fn pace_of(remaining: u64, capacity: u64, horizon: u64, ttl: u64, paced: u64) -> Pace {
        let n = Nanos::from_nanos;
        Pace { remaining, capacity, horizon: n(horizon), ttl: n(ttl), paced_until: n(paced) }
    }

    fn cap(remaining: u64, capacity: u64, horizon: u64, ttl: u64, paced: u64, now: u64) -> u64 {
        pace_of(remaining, capacity, horizon, ttl, paced).cap(Nanos::from_nanos(now))
    }

    fn pace(granted: u64, remaining: u64, capacity: u64, horizon: u64, paced: u64, now: u64) -> u64 {
        pace_of(remaining, capacity, horizon, 0, paced).after(granted, Nanos::from_nanos(now)).get()
    }

    #[test]
    fn target_follows_the_observed_rate() {
        // 200 tokens/s over a 1 s lease: 200.
        assert_eq!(target(1_000, Some(200.0), S, 10_000), 200);
        // A faster caller gets more.
        assert!(target(1_000, Some(800.0), S, 10_000) > 200);
        // Never above what was asked for, nor the capacity.
        assert_eq!(target(50, Some(800.0), S, 10_000), 50);
        assert_eq!(target(1_000, Some(800.0), S, 30), 30);
        // A slow caller still gets one.
        assert_eq!(target(1_000, Some(0.01), S, 10_000), 1);
    }

    #[test]
    fn target_without_a_rate_is_one_percent() {
        assert_eq!(target(1_000, None, S, 10_000), 100);
        assert_eq!(target(1_000, Some(f64::NAN), S, 10_000), 100);
        assert_eq!(target(1_000, None, S, 10), 1);
        assert_eq!(target(0, None, S, 10), 0);
    }

    #[test]
    fn cap_is_half_of_what_remains_while_plenty_is_left() {
        assert_eq!(cap(1_000, 1_000, 60 * S, S, 0, T), 500);
        assert_eq!(cap(100, 1_000, 60 * S, S, 0, T), 50);
        assert_eq!(cap(0, 1_000, 60 * S, S, 0, T), 0);
        // Above the low-water mark nothing is paced.
        assert_eq!(pace(50, 100, 1_000, 60 * S, 7, T), 7);
    }

    const T: u64 = 1_700_000_000 * S;

    #[test]
    fn below_low_water_grants_follow_the_even_pace() {
        // 90 of 1000 left with 30 s to go and 1 s leases: 3 per lease lifetime.
        assert_eq!(cap(90, 1_000, 30 * S, S, 0, T), 3);
        let after = pace(3, 90, 1_000, 30 * S, 0, T);
        assert_eq!(after, T + S);
        // The schedule is a lease lifetime ahead: nothing more right now,
        // however often a caller asks.
        assert_eq!(cap(87, 1_000, 30 * S, S, after, T), 0);
        // Time passes: the pace hands out more.
        assert_eq!(cap(87, 1_000, 29 * S, S, after, T + S), 3);
        // The last token is leasable once the schedule has caught up.
        assert_eq!(cap(1, 1_000, 30 * S, S, T, T), 1);
        assert_eq!(cap(1, 1_000, 30 * S, S, T + 1, T), 0);
        // With 1 s to go, pacing allows all of it, halving still applies.
        assert_eq!(cap(90, 1_000, S, S, 0, T), 45);
    }

    #[test]
    fn a_caller_refused_by_the_pace_learns_when_it_gives_again() {
        // 87 left over 29 s, the schedule 1 s ahead of now: nothing now.
        let (paced, now) = (T + S, T);
        assert_eq!(cap(87, 1_000, 29 * S, S, paced, now), 0);
        let retry = pace_of(87, 1_000, 29 * S, S, paced).retry(Nanos::from_nanos(now));
        let at = now + retry.get();
        assert!(retry < Nanos::from_nanos(S), "{retry:?}");
        // Then (the horizon shrunk by the wait) the pace gives one; a twentieth
        // of the wait earlier, not yet (the horizon's shrinking brings the
        // token a little sooner than the retry says: never later).
        assert_eq!(cap(87, 1_000, 29 * S - retry.get(), S, paced, at), 1);
        let early = retry.get() / 20;
        assert_eq!(cap(87, 1_000, 29 * S - retry.get() + early, S, paced, at - early), 0);
        // A schedule far ahead: at the latest once it has caught up with time.
        let far = T + 10 * S;
        let retry = pace_of(1, 1_000, 60 * S, S, far).retry(Nanos::from_nanos(T));
        assert_eq!(retry, Nanos::from_nanos(10 * S));
    }

    #[test]
    fn a_fast_caller_drains_the_tail_only_as_time_passes() {
        let (capacity, window_end, ttl) = (1_000u64, T + 41 * S, S);
        let mut remaining = 95u64;
        let mut paced = 0;
        let mut now = T;
        let mut taken_by = Vec::new();
        while now < window_end {
            // A hundred calls at every millisecond-ish instant.
            for _ in 0..100 {
                let cap = cap(remaining, capacity, window_end - now, ttl, paced, now);
                paced = pace(cap, remaining, capacity, window_end - now, paced, now);
                remaining -= cap;
            }
            taken_by.push((now - T, 95 - remaining));
            now += S / 4;
        }
        for (elapsed, taken) in &taken_by {
            // Never ahead of the even pace by more than one lease lifetime.
            let allowed = (u128::from(*elapsed + ttl) * 95).div_ceil(u128::from(41 * S)) as u64 + 1;
            assert!(*taken <= allowed, "{taken} taken after {elapsed} ns; the pace allows {allowed}");
        }
        assert!(remaining <= 3, "the tail was handed out over the window: {remaining} left");
    }

    #[test]
    fn cap_is_exact_at_the_edges_of_the_range() {
        // 10^9 per year, a year to go, 60 s leases: no overflow, exact.
        let year = 365 * 24 * 3_600 * S;
        assert_eq!(cap(99_999_999, 1_000_000_000, year, 60 * S, 0, T), 190);
        assert_eq!(cap(u64::MAX, u64::MAX, u64::MAX, u64::MAX, 0, T), u64::MAX.div_ceil(2));
        assert_eq!(cap(1, u64::MAX, 0, u64::MAX, 0, T), 1);
        assert_eq!(pace(u64::MAX, 1, u64::MAX, u64::MAX, u64::MAX, T), u64::MAX);
    }
}
