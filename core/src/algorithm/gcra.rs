//! Leaky bucket as a meter, in its GCRA form: a bucket is one number, the
//! theoretical arrival time (TAT) of the next request if traffic flowed at
//! exactly the configured rate. A request is admitted when the backlog it
//! would leave, `TAT - now`, fits in the tolerance of `burst` requests.
//!
//! The same arithmetic, given room to wait (`max_delay`), is the leaky bucket
//! as a *shaper* ([`super::Shaper`]): a request whose backlog overflows the
//! tolerance by at most `max_delay` is admitted after that overflow.

use super::{Admission, Algorithm, CountingWindow, Decision, FromParams, Grant, Params, Quota, Release};
use crate::error::ConfigError;
use crate::time::Nanos;

/// GCRA parameters: one unit of cost every `interval`, at most `burst` units
/// back to back, and up to `max_delay` of waiting (zero for a meter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gcra {
    limit: u64,
    period: Nanos,
    interval: Nanos,
    tolerance: Nanos,
    burst: u64,
    max_delay: Nanos,
}

impl Gcra {
    /// A meter admitting `limit` units per `period`, `burst` of them at once.
    ///
    /// The emission interval `period / limit` is rounded up, so rounding can
    /// only ever admit less than the configured rate, never more.
    pub fn new(limit: u64, period: Nanos, burst: u64) -> Self {
        let limit = limit.max(1);
        let period = period.max(Nanos::ONE);
        let interval = period.div_ceil(limit);
        let burst = burst.max(1);
        Self { limit, period, interval, tolerance: interval.times(burst), burst, max_delay: Nanos::ZERO }
    }

    /// The same meter, letting requests wait up to `max_delay` (a shaper).
    pub fn with_max_delay(self, max_delay: Nanos) -> Self {
        Self { max_delay, ..self }
    }

    /// The TAT a grant of `cost` units pushed forward.
    fn span_of(&self, cost: u64) -> Nanos {
        self.interval.times(cost)
    }

    /// Units that fit in `slack`.
    fn units_in(&self, slack: Nanos) -> u64 {
        slack / self.interval
    }

    /// Remaining units and reset, given the TAT after the decision.
    fn report(&self, tat: Nanos, now: Nanos) -> (u64, Nanos) {
        let room = self.tolerance + self.max_delay;
        let backlog = (tat - now).min(room);
        let slack = room - backlog;
        let remaining = self.units_in(slack);
        // One more unit fits once the slack grows to the next whole interval.
        // Saturating: with a year-long period and a huge burst the tolerance
        // itself saturates, and so would this (found by fuzzing).
        let reset =
            if backlog == Nanos::ZERO { Nanos::ZERO } else { self.interval.times(remaining.saturating_add(1)) - slack };
        (remaining, reset)
    }
}

impl Algorithm for Gcra {
    /// The TAT.
    type State = Nanos;

    fn state_len(&self) -> usize {
        8
    }

    fn decode(&self, bytes: &[u8]) -> Option<Nanos> {
        super::get_u64(bytes, 0).map(Nanos::from_nanos)
    }

    fn encode(&self, tat: &Nanos, out: &mut [u8]) {
        super::put_u64(out, 0, tat.get());
    }

    /// The burst, plus what fits in the longest wait.
    fn capacity(&self) -> u64 {
        self.burst.saturating_add(self.units_in(self.max_delay))
    }

    fn quota(&self) -> Quota {
        Quota { limit: self.limit, window: Some(self.period) }
    }

    /// No backlog.
    fn fresh(&self, now: Nanos) -> Nanos {
        now
    }

    /// Admits `cost` units if the backlog they leave fits the tolerance (or,
    /// for a shaper, overflows it by at most `max_delay`: admitted after the
    /// overflow). A denial leaves the TAT alone.
    fn decide(&self, tat: Nanos, now: Nanos, cost: u64) -> (Decision, Nanos) {
        let new_tat = tat.max(now) + self.span_of(cost);
        let backlog = new_tat - now;
        let overflow = backlog - self.tolerance;
        if overflow <= self.max_delay {
            let (remaining, reset) = self.report(new_tat, now);
            let admission = if overflow == Nanos::ZERO { Admission::Now } else { Admission::Delayed(overflow) };
            (Decision { admission, remaining, reset }, new_tat)
        } else {
            let retry_after = if cost > self.capacity() { Nanos::NEVER } else { overflow - self.max_delay };
            let (remaining, reset) = self.report(tat, now);
            (Decision::deny(remaining, reset, retry_after), tat)
        }
    }

    /// Undo moves the TAT back by the part of the grant's span still ahead:
    /// as if the grant had been the last take from an empty backlog, its
    /// span ended `span` after it was taken, and the time passed since has
    /// drained it (a backlog drained to nothing loses the rest). An undo at
    /// the instant of the grant moves it back by the whole span; a request
    /// that waits (a shaper's) and leaves gives back what it had not waited.
    /// The unused part of a larger grant ([`Release::Return`]) gives back its
    /// own span, out of what is still ahead of the whole grant's.
    fn release(&self, tat: Nanos, now: Nanos, grant: Grant, why: Release) -> Option<Nanos> {
        if why == Release::Done {
            return None;
        }
        let span = self.span_of(grant.cost);
        let ahead = (grant.at + self.span_of(why.granted(grant))) - now;
        // A TAT at or before `now` means "no backlog", so lowering it past
        // `now` is harmless.
        (ahead > Nanos::ZERO).then(|| tat - span.min(ahead))
    }

    /// No backlog.
    fn is_idle(&self, tat: Nanos, now: Nanos) -> bool {
        tat <= now
    }

    /// When the backlog ends.
    fn idle_at(&self, tat: Nanos, now: Nanos) -> Nanos {
        tat.max(now)
    }

    /// The burst, then one unit per interval of the span and of the wait.
    fn admitted_bound(&self, span: Nanos) -> u64 {
        self.burst.saturating_add(self.units_in(self.max_delay + span))
    }

    fn batchable(&self) -> bool {
        true
    }

    /// A meter's slots, as a token bucket's (see `TokenBucket`'s): an
    /// allowance holds a share of its rate, slot by slot. A shaper (one
    /// that delays) holds none.
    fn allowance_slot(&self, _tat: &Nanos, now: Nanos) -> Option<CountingWindow> {
        if self.max_delay > Nanos::ZERO {
            return None;
        }
        let index = now / self.period;
        Some(CountingWindow { index, end: self.period.times(index.saturating_add(1)), renews: false })
    }

    /// Takes `units` whatever the backlog: the TAT moves on by their span,
    /// past the tolerance if need be (a backlog the rate drains first).
    fn count(&self, tat: Nanos, at: Nanos, units: u64) -> Nanos {
        tat.max(at) + self.span_of(units)
    }
}

impl FromParams for Gcra {
    const FIELDS: &'static [&'static str] = &["period", "burst"];

    /// `period` (required) and `burst` (default 1: strict pacing).
    fn from_params(params: &mut Params) -> Result<Self, ConfigError> {
        let period = params.required_duration("period")?;
        let burst = params.units("burst")?.unwrap_or(1);
        Ok(Self::new(params.limit(), period, burst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::SECOND;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const T0: Nanos = Nanos::from_secs(1_700_000_000);

    fn take_all(meter: &Gcra, tat: Nanos, now: Nanos) -> Nanos {
        let (remaining, _) = meter.report(tat, now);
        meter.decide(tat, now, remaining).1
    }

    #[test]
    fn admits_the_burst_back_to_back_then_paces() {
        let meter = Gcra::new(10, SECOND.times(10), 3); // one per second, 3 at once
        let mut tat = meter.fresh(T0);
        for expected_remaining in [2, 1, 0] {
            let (decision, next) = meter.decide(tat, T0, 1);
            assert_eq!(decision.admission, Admission::Now);
            assert_eq!(decision.remaining, expected_remaining);
            tat = next;
        }
        let (denied, same) = meter.decide(tat, T0, 1);
        assert!(!denied.allowed());
        assert_eq!(same, tat, "a denial leaves the state alone");
        assert_eq!(denied.retry_after(), SECOND);
        assert_eq!(denied.reset, SECOND);
        assert!(!meter.decide(tat, T0 + SECOND - Nanos::from_nanos(1), 1).0.allowed());
        assert!(meter.decide(tat, T0 + SECOND, 1).0.allowed());
    }

    #[test]
    fn burst_of_one_is_strict_pacing() {
        let meter = Gcra::new(2, SECOND, 1); // every 500 ms
        let (first, tat) = meter.decide(meter.fresh(T0), T0, 1);
        assert!(first.allowed());
        let (second, _) = meter.decide(tat, T0 + Nanos::from_nanos(499_999_999), 1);
        assert!(!second.allowed());
        assert_eq!(second.retry_after(), Nanos::from_nanos(1));
        assert!(meter.decide(tat, T0 + Nanos::from_millis(500), 1).0.allowed());
    }

    #[test]
    fn retry_after_for_a_larger_cost_is_exact() {
        let meter = Gcra::new(3, SECOND.times(10), 6);
        let tat = take_all(&meter, meter.fresh(T0), T0);
        let (denied, _) = meter.decide(tat, T0, 4);
        let wait = denied.retry_after();
        assert!(!meter.decide(tat, T0 + wait - Nanos::from_nanos(1), 4).0.allowed());
        assert!(meter.decide(tat, T0 + wait, 4).0.allowed());
    }

    #[test]
    fn rounding_the_interval_never_over_admits() {
        // 7 per minute does not divide evenly into nanoseconds.
        let meter = Gcra::new(7, SECOND.times(60), 7);
        let mut tat = meter.fresh(T0);
        let mut admitted = 0;
        // Offer one request every millisecond for two minutes.
        for ms in 0..120_000u64 {
            let (decision, next) = meter.decide(tat, T0 + Nanos::from_millis(ms), 1);
            if decision.allowed() {
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
        let meter = Gcra::new(1, SECOND.times(366 * 86_400), 1_000_000_000);
        let (first, tat) = meter.decide(meter.fresh(T0), T0, 1);
        assert!(first.allowed());
        let (second, _) = meter.decide(tat, T0, 1_000_000_000);
        assert!(second.reset > Nanos::ZERO);
    }

    #[test]
    fn undo_and_idleness() {
        let meter = Gcra::new(10, SECOND.times(10), 5);
        let (_, tat) = meter.decide(meter.fresh(T0), T0, 2);
        assert!(!meter.is_idle(tat, T0));
        let grant = Grant { cost: 2, at: T0 };
        assert!(meter.is_idle(meter.release(tat, T0, grant, Release::Undo).unwrap(), T0));
        assert_eq!(meter.release(tat, T0, grant, Release::Done), None);
        assert!(meter.is_idle(tat, T0 + SECOND.times(2)));
    }

    #[test]
    fn an_undo_later_gives_back_only_the_span_not_drained() {
        // A lease returned late: one per second, burst 10. 5 taken at T0; 5.5 s
        // later the backlog has drained and 10 are taken: the 5 are gone.
        let meter = Gcra::new(60, SECOND.times(60), 10);
        let (_, leased) = meter.decide(meter.fresh(T0), T0, 5);
        let later = T0 + Nanos::from_millis(5_500);
        let (_, spent) = meter.decide(leased, later, 10);
        assert_eq!(meter.release(spent, later, Grant { cost: 5, at: T0 }, Release::Undo), None);
        // 2.5 s after the grant, 2.5 s of its 5 are still ahead.
        let soon = T0 + Nanos::from_millis(2_500);
        let undone = meter.release(leased, soon, Grant { cost: 5, at: T0 }, Release::Undo).unwrap();
        assert_eq!(undone, leased - Nanos::from_millis(2_500));
    }
}
