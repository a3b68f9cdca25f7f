//! Leaky bucket as a shaper (NGINX `limit_req` with `delay`, Guava's
//! `acquire`): requests above the rate are **delayed, not rejected**. A
//! request is admitted at once while the backlog fits the burst, delayed by
//! the overflow while that is at most `max_delay`, and denied (with the
//! exact `Retry-After`) beyond. Delayed requests leave one per emission
//! interval, so what goes upstream never exceeds the rate after the burst.
//!
//! It is the GCRA meter's arithmetic with room to wait; the filter pauses a
//! delayed request and resumes it from its own worker when the delay is over.

use super::{Algorithm, Decision, FromParams, Gcra, Grant, Params, Quota, Release};
use crate::error::ConfigError;
use crate::time::Nanos;

/// A shaper: a [`Gcra`] that lets requests wait up to `max_delay`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shaper(Gcra);

impl Shaper {
    /// `limit` units per `period`, `burst` at once, waits up to `max_delay`.
    pub fn new(limit: u64, period: Nanos, burst: u64, max_delay: Nanos) -> Self {
        Self(Gcra::new(limit, period, burst).with_max_delay(max_delay))
    }
}

impl Algorithm for Shaper {
    type State = Nanos;

    fn state_len(&self) -> usize {
        self.0.state_len()
    }

    fn decode(&self, bytes: &[u8]) -> Option<Nanos> {
        self.0.decode(bytes)
    }

    fn encode(&self, tat: &Nanos, out: &mut [u8]) {
        self.0.encode(tat, out);
    }

    fn capacity(&self) -> u64 {
        self.0.capacity()
    }

    fn quota(&self) -> Quota {
        self.0.quota()
    }

    fn fresh(&self, now: Nanos) -> Nanos {
        self.0.fresh(now)
    }

    fn decide(&self, tat: Nanos, now: Nanos, cost: u64) -> (Decision, Nanos) {
        self.0.decide(tat, now, cost)
    }

    /// Undo (a delayed request that left, or a later rule's denial) frees
    /// its place in the schedule.
    fn release(&self, tat: Nanos, now: Nanos, grant: Grant, why: Release) -> Option<Nanos> {
        self.0.release(tat, now, grant, why)
    }

    fn is_idle(&self, tat: Nanos, now: Nanos) -> bool {
        self.0.is_idle(tat, now)
    }

    fn idle_at(&self, tat: Nanos, now: Nanos) -> Nanos {
        self.0.idle_at(tat, now)
    }

    /// Admissions (not departures): the burst, the queue, then the rate.
    fn admitted_bound(&self, span: Nanos) -> u64 {
        self.0.admitted_bound(span)
    }
}

impl FromParams for Shaper {
    const FIELDS: &'static [&'static str] = &["period", "burst", "max_delay"];

    const LOCAL_ONLY: Option<&'static str> = Some(
        "a shaper delays requests in the proxy, and a check or lease can only admit or deny; use leaky_bucket \
         (the same schedule, denying instead of delaying)",
    );

    /// `period` and `max_delay` (required), `burst` (default 1: every
    /// request after the first is paced).
    fn from_params(params: &mut Params) -> Result<Self, ConfigError> {
        let meter = Gcra::from_params(params)?;
        let max_delay = params.required_duration("max_delay")?;
        Ok(Self(meter.with_max_delay(max_delay)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Admission;
    use crate::time::SECOND;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const T0: Nanos = Nanos::from_secs(1_700_000_000);

    #[test]
    fn delays_above_the_rate_then_denies_beyond_max_delay() {
        // One per second, two at once, waits up to 3 s.
        let shaper = Shaper::new(10, SECOND.times(10), 2, SECOND.times(3));
        let mut tat = shaper.fresh(T0);
        let mut admissions = Vec::new();
        for _ in 0..6 {
            let (decision, next) = shaper.decide(tat, T0, 1);
            admissions.push(decision.admission);
            tat = next;
        }
        let second = |n| Admission::Delayed(SECOND.times(n));
        assert_eq!(
            admissions,
            vec![
                Admission::Now,
                Admission::Now,
                second(1),
                second(2),
                second(3),
                Admission::Denied { retry_after: SECOND }
            ]
        );
        assert_eq!(shaper.capacity(), 5);
    }

    #[test]
    fn a_delay_is_exact_and_shrinks_as_time_passes() {
        let shaper = Shaper::new(2, SECOND, 1, SECOND); // every 500 ms
        let (_, tat) = shaper.decide(shaper.fresh(T0), T0, 1);
        let (later, _) = shaper.decide(tat, T0 + Nanos::from_millis(100), 1);
        assert_eq!(later.admission, Admission::Delayed(Nanos::from_millis(400)));
    }

    #[test]
    fn requires_max_delay() {
        let mut params = Params::new("rules[0]", 5, serde_json::from_str(r#"{"period": "1s"}"#).unwrap());
        let error = Shaper::from_params(&mut params).unwrap_err();
        assert_eq!(error.field, "rules[0]");
        assert!(error.message.contains("max_delay"), "{}", error.message);
    }
}
