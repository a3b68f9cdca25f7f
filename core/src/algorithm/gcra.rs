//! Leaky bucket as a meter, in its GCRA form: a bucket is one number, the
//! theoretical arrival time (TAT) of the next request if traffic flowed at
//! exactly the configured rate. A request is admitted when the backlog it
//! would leave, `TAT - now`, fits in the tolerance of `burst` requests.

use super::Decision;
use crate::time::Nanos;

/// GCRA parameters: one unit of cost every `interval`, and at most `burst`
/// units back to back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gcra {
    interval: Nanos,
    tolerance: Nanos,
    burst: u64,
}

impl Gcra {
    /// A meter admitting `limit` units per `period`, `burst` of them at once.
    ///
    /// The emission interval `period / limit` is rounded up, so rounding can
    /// only ever admit less than the configured rate, never more.
    pub fn new(limit: u64, period: Nanos, burst: u64) -> Self {
        let interval = period.max(1).div_ceil(limit.max(1));
        let burst = burst.max(1);
        Self { interval, tolerance: interval.saturating_mul(burst), burst }
    }

    /// Units admitted back to back by an idle meter.
    pub fn capacity(&self) -> u64 {
        self.burst
    }

    /// The TAT of a never-seen key: no backlog.
    pub fn fresh(&self, now: Nanos) -> Nanos {
        now
    }

    /// Admits `cost` units if the backlog they leave fits the tolerance.
    /// Returns the decision and the new TAT (unchanged when denied).
    pub fn decide(&self, tat: Nanos, now: Nanos, cost: u64) -> (Decision, Nanos) {
        let start = tat.max(now);
        let new_tat = start.saturating_add(cost.saturating_mul(self.interval));
        let backlog = new_tat - now;
        if backlog <= self.tolerance {
            (self.report(new_tat, now, true, 0), new_tat)
        } else {
            let retry_after = if cost > self.burst { Nanos::MAX } else { backlog - self.tolerance };
            (self.report(tat, now, false, retry_after), tat)
        }
    }

    /// Admits as many units as fit, up to `wanted`.
    pub fn take_up_to(&self, tat: Nanos, now: Nanos, wanted: u64) -> (u64, Decision, Nanos) {
        let granted = self.report(tat, now, true, 0).remaining.min(wanted);
        let (decision, tat) = self.decide(tat, now, granted);
        (granted, decision, tat)
    }

    /// Gives back `cost` units admitted earlier.
    pub fn refund(&self, tat: Nanos, _now: Nanos, cost: u64) -> Nanos {
        // A TAT at or before `now` means "no backlog", so lowering it past
        // `now` is harmless.
        tat.saturating_sub(cost.saturating_mul(self.interval))
    }

    /// True when the meter has no backlog: indistinguishable from a fresh one.
    pub fn is_idle(&self, tat: Nanos, now: Nanos) -> bool {
        tat <= now
    }

    fn report(&self, tat: Nanos, now: Nanos, allowed: bool, retry_after: Nanos) -> Decision {
        let backlog = tat.saturating_sub(now).min(self.tolerance);
        let slack = self.tolerance - backlog;
        let remaining = slack / self.interval;
        // One more unit fits once the slack grows to the next whole interval.
        // Saturating: with a year-long period and a huge burst the tolerance
        // itself saturates, and so would this (found by fuzzing).
        let reset = if backlog == 0 {
            0
        } else {
            remaining.saturating_add(1).saturating_mul(self.interval).saturating_sub(slack)
        };
        Decision { allowed, remaining, reset, retry_after }
    }

    /// Encodes a TAT as 8 little-endian bytes.
    pub fn encode(tat: Nanos, out: &mut [u8]) {
        super::put_u64(out, 0, tat);
    }

    /// Decodes 8 bytes written by [`Gcra::encode`].
    pub fn decode(bytes: &[u8]) -> Option<Nanos> {
        super::get_u64(bytes, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::SECOND;

    const T0: Nanos = 1_700_000_000 * SECOND;

    #[test]
    fn admits_the_burst_back_to_back_then_paces() {
        let meter = Gcra::new(10, 10 * SECOND, 3); // one per second, 3 at once
        let mut tat = meter.fresh(T0);
        for expected_remaining in [2, 1, 0] {
            let (decision, next) = meter.decide(tat, T0, 1);
            assert!(decision.allowed);
            assert_eq!(decision.remaining, expected_remaining);
            tat = next;
        }
        let (denied, same) = meter.decide(tat, T0, 1);
        assert!(!denied.allowed);
        assert_eq!(same, tat, "a denial leaves the state alone");
        assert_eq!(denied.retry_after, SECOND);
        assert_eq!(denied.reset, SECOND);
        assert!(!meter.decide(tat, T0 + SECOND - 1, 1).0.allowed);
        assert!(meter.decide(tat, T0 + SECOND, 1).0.allowed);
    }

    #[test]
    fn burst_of_one_is_strict_pacing() {
        let meter = Gcra::new(2, SECOND, 1); // every 500 ms
        let (first, tat) = meter.decide(meter.fresh(T0), T0, 1);
        assert!(first.allowed);
        let (second, _) = meter.decide(tat, T0 + 499_999_999, 1);
        assert!(!second.allowed);
        assert_eq!(second.retry_after, 1);
        assert!(meter.decide(tat, T0 + 500_000_000, 1).0.allowed);
    }

    #[test]
    fn retry_after_for_a_larger_cost_is_exact() {
        let meter = Gcra::new(3, 10 * SECOND, 6);
        let (_, _, tat) = meter.take_up_to(meter.fresh(T0), T0, 6);
        let (denied, _) = meter.decide(tat, T0, 4);
        let wait = denied.retry_after;
        assert!(!meter.decide(tat, T0 + wait - 1, 4).0.allowed);
        assert!(meter.decide(tat, T0 + wait, 4).0.allowed);
    }

    #[test]
    fn rounding_the_interval_never_over_admits() {
        // 7 per minute does not divide evenly into nanoseconds.
        let meter = Gcra::new(7, 60 * SECOND, 7);
        let mut tat = meter.fresh(T0);
        let mut admitted = 0;
        // Offer one request every millisecond for two minutes.
        for ms in 0..120_000u64 {
            let (decision, next) = meter.decide(tat, T0 + ms * 1_000_000, 1);
            if decision.allowed {
                admitted += 1;
            }
            tat = next;
        }
        // Burst of 7, then at most 7 more per minute over 2 minutes.
        assert!(admitted <= 7 + 14, "admitted {admitted}");
        assert!(admitted >= 7 + 13, "admitted {admitted}");
    }

    #[test]
    fn extreme_but_valid_parameters_do_not_overflow() {
        // limit 1 per 366 days with a burst of 10^9: the tolerance saturates.
        let meter = Gcra::new(1, 366 * 86_400 * SECOND, 1_000_000_000);
        let (first, tat) = meter.decide(meter.fresh(T0), T0, 1);
        assert!(first.allowed);
        let (second, _) = meter.decide(tat, T0, 1_000_000_000);
        assert!(second.reset > 0);
    }

    #[test]
    fn refund_and_idleness() {
        let meter = Gcra::new(10, 10 * SECOND, 5);
        let (_, tat) = meter.decide(meter.fresh(T0), T0, 2);
        assert!(!meter.is_idle(tat, T0));
        assert!(meter.is_idle(meter.refund(tat, T0, 2), T0));
        assert!(meter.is_idle(tat, T0 + 2 * SECOND));
    }
}
