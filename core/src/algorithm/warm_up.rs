//! Warm-up: a token bucket that, after being idle, starts below its rate and
//! ramps up to it over `warmup`, so a cold backend is not hit at full rate at
//! once (Guava's `SmoothWarmingUp`, Sentinel's warm-up control).
//!
//! The model, in the bucket's GCRA form (a token bucket as one timestamp, the
//! theoretical arrival time `tat`; see [`super::Gcra`]):
//!
//! - A request of cost `c` is admitted when the backlog `tat - now` is at most
//!   `(burst - c) × T`, with `T = period / limit` (rounded up): exactly the
//!   test of a leaky bucket with that burst, so any `c ≤ burst` is admitted
//!   once the backlog drains.
//! - An admitted request pushes `tat` by `c × I(w)` instead of `c × T`, where
//!   `w` is the bucket's *warmth*: the time since the first request after
//!   idleness, capped at `warmup`. The rate `1 / I(w)` ramps linearly from
//!   `limit / cold_factor` (w = 0) to `limit` (w = `warmup`):
//!   `I(w) = ⌈period × cold_factor × warmup / (limit × (warmup + (cold_factor − 1) × w))⌉`,
//!   which is never below `T`. The burst ramps with it: a cold bucket admits
//!   `1 + (burst − 1) × T / I(0)` requests at once, about `burst / cold_factor`.
//! - A bucket whose backlog has been empty for `warmup` is *idle*: cold
//!   again, exactly like a never-seen one. Light traffic that never builds a
//!   backlog keeps a bucket warm as long as gaps stay under `warmup`.
//!
//! Because every admission costs at least what it costs the leaky bucket, and
//! the admission test is the same, no interval admits more than the leaky
//! bucket's bound (`burst + span / T`), and on any arrivals warm-up admits no
//! more than the plain token bucket (property-tested).

use super::{Algorithm, Decision, FromParams, Grant, Params, Quota, Release};
use crate::error::ConfigError;
use crate::time::Nanos;

/// `cold_factor` when none is configured: Guava's and Sentinel's default.
pub const DEFAULT_COLD_FACTOR: u64 = 3;

/// Warm-up parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WarmUp {
    limit: u64,
    period: Nanos,
    /// `T`: the emission interval at full rate.
    interval: Nanos,
    /// `burst × T`.
    tolerance: Nanos,
    burst: u64,
    warmup: Nanos,
    cold_factor: u64,
}

/// A bucket's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WarmState {
    /// The theoretical arrival time: the backlog ends here.
    pub tat: Nanos,
    /// When the current warm-up began (the first request after idleness).
    pub warm_since: Nanos,
    /// Where the backlog had ended before the last admission that found none,
    /// so that undoing that admission restores how long the bucket had been
    /// without backlog (its way back to cold).
    pub backlog_ended: Nanos,
}

impl WarmUp {
    /// `limit` per `period` once warm, `burst` at once, ramping from
    /// `limit / cold_factor` over `warmup`.
    pub fn new(limit: u64, period: Nanos, burst: u64, warmup: Nanos, cold_factor: u64) -> Self {
        let limit = limit.max(1);
        let period = period.max(Nanos::ONE);
        let interval = period.div_ceil(limit);
        let burst = burst.max(1);
        Self {
            limit,
            period,
            interval,
            tolerance: interval.times(burst),
            burst,
            warmup: warmup.max(Nanos::ONE),
            cold_factor: cold_factor.max(1),
        }
    }

    /// The time one unit takes at `warmth` (rounded up: never faster than the ramp).
    pub fn interval_at(&self, warmth: Nanos) -> Nanos {
        if warmth >= self.warmup {
            return self.interval;
        }
        let (warmup, factor) = (u128::from(self.warmup.get()), u128::from(self.cold_factor));
        let numerator = u128::from(self.period.get()) * factor * warmup;
        let denominator = u128::from(self.limit) * (warmup + (factor - 1) * u128::from(warmth.get()));
        super::nanos_u128(super::div_ceil_u128(numerator, denominator))
    }

    /// When the current warm-up began, as seen at `now`: now, if the bucket
    /// has gone cold.
    fn warm_since(&self, state: &WarmState, now: Nanos) -> Nanos {
        if self.cold(state, now) {
            now
        } else {
            state.warm_since
        }
    }

    fn cold(&self, state: &WarmState, now: Nanos) -> bool {
        state.tat + self.warmup <= now
    }

    /// The interval in force at `at` for a warm-up that began at `since`.
    fn interval_since(&self, since: Nanos, at: Nanos) -> Nanos {
        self.interval_at(at - since)
    }

    /// Remaining units (at the interval in force) and the time until one
    /// more fits (an upper bound: warming up only brings it closer).
    fn report(&self, tat: Nanos, now: Nanos, interval: Nanos) -> (u64, Nanos) {
        let backlog = tat - now;
        let Some(room) = (self.tolerance - self.interval).checked_sub(backlog) else {
            return (0, backlog - (self.tolerance - self.interval));
        };
        let remaining = (room / interval).saturating_add(1);
        let reset = if backlog == Nanos::ZERO {
            Nanos::ZERO
        } else {
            match (self.tolerance - self.interval).checked_sub(interval.times(remaining)) {
                Some(threshold) => backlog - threshold,
                None => backlog,
            }
        };
        (remaining, reset)
    }
}

impl Algorithm for WarmUp {
    type State = WarmState;

    fn state_len(&self) -> usize {
        24
    }

    fn decode(&self, bytes: &[u8]) -> Option<WarmState> {
        Some(WarmState {
            tat: Nanos::from_nanos(super::get_u64(bytes, 0)?),
            warm_since: Nanos::from_nanos(super::get_u64(bytes, 8)?),
            backlog_ended: Nanos::from_nanos(super::get_u64(bytes, 16)?),
        })
    }

    fn encode(&self, state: &WarmState, out: &mut [u8]) {
        super::put_u64(out, 0, state.tat.get());
        super::put_u64(out, 8, state.warm_since.get());
        super::put_u64(out, 16, state.backlog_ended.get());
    }

    fn capacity(&self) -> u64 {
        self.burst
    }

    fn quota(&self) -> Quota {
        Quota { limit: self.limit, window: Some(self.period) }
    }

    /// Cold: no backlog for `warmup` already.
    fn fresh(&self, now: Nanos) -> WarmState {
        let ended = now - self.warmup;
        WarmState { tat: ended, warm_since: now, backlog_ended: ended }
    }

    /// The leaky bucket's test; an admission costs the interval of the
    /// bucket's warmth. A cold bucket starts warming up at this request.
    fn decide(&self, state: WarmState, now: Nanos, cost: u64) -> (Decision, WarmState) {
        let warm_since = self.warm_since(&state, now);
        let interval = self.interval_since(warm_since, now);
        let backlog = state.tat - now;
        let room = self.tolerance.checked_sub(self.interval.times(cost));
        match room {
            Some(room) if backlog <= room => {
                let backlog_ended = if state.tat <= now { state.tat } else { state.backlog_ended };
                let tat = state.tat.max(now) + interval.times(cost);
                let (remaining, reset) = self.report(tat, now, interval);
                (Decision::admit(remaining, reset), WarmState { tat, warm_since, backlog_ended })
            }
            _ => {
                let retry_after = room.map_or(Nanos::NEVER, |room| backlog - room);
                let (remaining, reset) = self.report(state.tat, now, interval);
                (Decision::deny(remaining, reset, retry_after), state)
            }
        }
    }

    /// Undo takes the grant's time back out of the backlog: the part of what
    /// it was charged still ahead (as for the leaky bucket, as if it had been
    /// the last take from an empty backlog, drained since), and never more
    /// than its units cost at the bucket's warmth now, so a bucket that warmed
    /// up meanwhile does not gain more units than were taken. If that empties
    /// the backlog, the bucket is as long without backlog as before the
    /// grant. A grant from before the current warm-up is not in this backlog.
    /// The unused part of a larger grant ([`Release::Return`]) gives back its
    /// own charge, out of what is still ahead of the whole grant's.
    fn release(&self, state: WarmState, now: Nanos, grant: Grant, why: Release) -> Option<WarmState> {
        if why == Release::Done || grant.at < state.warm_since || self.cold(&state, now) {
            return None;
        }
        let interval = self.interval_since(state.warm_since, grant.at);
        let charged = interval.times(grant.cost);
        let worth_now = self.interval_since(state.warm_since, now.max(grant.at)).times(grant.cost);
        let back = charged.min(worth_now).min((grant.at + interval.times(why.granted(grant))) - now);
        if back == Nanos::ZERO {
            return None;
        }
        let tat = state.tat - back;
        let tat = if tat <= grant.at { tat.min(state.backlog_ended) } else { tat };
        Some(WarmState { tat, ..state })
    }

    /// Cold again: no backlog for `warmup`.
    fn is_idle(&self, state: WarmState, now: Nanos) -> bool {
        self.cold(&state, now)
    }

    /// `warmup` after the backlog ends.
    fn idle_at(&self, state: WarmState, now: Nanos) -> Nanos {
        (state.tat + self.warmup).max(now)
    }

    /// The leaky bucket's bound: the admission test is its test, and every
    /// admission pushes `tat` at least as far. Over the admissions in an
    /// interval, `tat` moves by at least `units × T` from the first (at or
    /// after the start) and the last leaves it at most `tolerance` past the
    /// end, so `units × T ≤ span + burst × T`.
    fn admitted_bound(&self, span: Nanos) -> u64 {
        self.burst.saturating_add(span / self.interval)
    }

    fn batchable(&self) -> bool {
        true
    }
}

impl FromParams for WarmUp {
    const FIELDS: &'static [&'static str] = &["period", "burst", "warmup", "cold_factor"];

    /// `period` and `warmup` (required), `burst` (default `limit`),
    /// `cold_factor` (2–100, default 3).
    fn from_params(params: &mut Params) -> Result<Self, ConfigError> {
        let period = params.required_duration("period")?;
        let burst = params.units("burst")?.unwrap_or(params.limit());
        let warmup = params.required_duration("warmup")?;
        let cold_factor = params.amount("cold_factor", 2, 100)?.unwrap_or(DEFAULT_COLD_FACTOR);
        Ok(Self::new(params.limit(), period, burst, warmup, cold_factor))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::TokenBucket;
    use crate::time::SECOND;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const T0: Nanos = Nanos::from_secs(1_700_000_000);

    /// One per second once warm, 10 at once, one per 3 s when cold, warm after a minute.
    fn bucket() -> WarmUp {
        WarmUp::new(10, SECOND.times(10), 10, SECOND.times(60), 3)
    }

    /// Offers `n` unit requests at `now`; returns how many were admitted.
    fn burst(bucket: &WarmUp, state: &mut WarmState, now: Nanos, n: usize) -> usize {
        (0..n)
            .filter(|_| {
                let (decision, next) = bucket.decide(*state, now, 1);
                *state = next;
                decision.allowed()
            })
            .count()
    }

    #[test]
    fn the_interval_ramps_linearly_in_rate_from_cold_to_warm() {
        let bucket = bucket();
        // Rate 1/3, 1/2, 2/3, 5/6 and 1 per second at 0, 15, 30, 45 and 60 s.
        assert_eq!(bucket.interval_at(Nanos::ZERO), SECOND.times(3));
        assert_eq!(bucket.interval_at(SECOND.times(15)), SECOND.times(2));
        assert_eq!(bucket.interval_at(SECOND.times(30)), Nanos::from_millis(1500));
        assert_eq!(bucket.interval_at(SECOND.times(45)), Nanos::from_millis(1200));
        assert_eq!(bucket.interval_at(SECOND.times(60)), SECOND);
        assert_eq!(bucket.interval_at(SECOND.times(600)), SECOND);
        // Rounded up: 10 s × 3 × 60 s / (10 × (60 s + 2 × 1 ns)) is just under 3 s.
        assert_eq!(bucket.interval_at(Nanos::from_nanos(1)), SECOND.times(3));
    }

    #[test]
    fn an_undo_later_takes_back_only_what_is_ahead_at_todays_interval() {
        // A lease returned after the bucket warmed: warm after 5 s, one
        // per second when warm.
        let bucket = WarmUp::new(60, SECOND.times(60), 10, SECOND.times(5), 3);
        let (taken, state) = bucket.decide(bucket.fresh(T0), T0, 5);
        assert!(taken.allowed());
        assert_eq!(state.tat, T0 + SECOND.times(15), "5 units at the cold interval of 3 s");
        let grant = Grant { cost: 5, at: T0 };
        // A second later the bucket is warmer: 5 units cost less than they
        // were charged, and only that comes back.
        let later = T0 + SECOND;
        let undone = bucket.release(state, later, grant, Release::Undo).unwrap();
        assert_eq!(undone.tat, state.tat - bucket.interval_at(SECOND).times(5));
        // Once the backlog the grant made has drained, nothing comes back.
        assert_eq!(bucket.release(state, T0 + SECOND.times(15), grant, Release::Undo), None);
    }

    #[test]
    fn a_cold_burst_admits_a_third_of_what_a_token_bucket_does() {
        let bucket = bucket();
        let mut state = bucket.fresh(T0);
        assert_eq!(burst(&bucket, &mut state, T0, 20), 4, "1 + 9 s of room / 3 s per request");
        assert_eq!(state.tat, T0 + SECOND.times(12));
        let plain = TokenBucket::new(10, SECOND.times(10), 10);
        let mut tokens = plain.fresh(T0);
        let admitted = (0..20)
            .filter(|_| {
                let (decision, next) = plain.decide(tokens, T0, 1);
                tokens = next;
                decision.allowed()
            })
            .count();
        assert_eq!(admitted, 10);
    }

    #[test]
    fn retry_after_and_the_numbers_are_exact() {
        let bucket = bucket();
        let mut state = bucket.fresh(T0);
        burst(&bucket, &mut state, T0, 4);
        let (denied, _) = bucket.decide(state, T0, 1);
        assert!(!denied.allowed());
        // Backlog 12 s, room for one more at 9 s.
        assert_eq!(denied.retry_after(), SECOND.times(3));
        assert_eq!((denied.remaining, denied.reset), (0, SECOND.times(3)));
        assert!(!bucket.decide(state, T0 + SECOND.times(3) - Nanos::from_nanos(1), 1).0.allowed());
        let (admitted, _) = bucket.decide(state, T0 + SECOND.times(3), 1);
        assert!(admitted.allowed());
        // Warmth 3 s: interval ⌈10 s × 180 / (10 × 66)⌉ = 2.727… s; backlog 9 s + 2.73 s.
        assert_eq!(bucket.interval_at(SECOND.times(3)), Nanos::from_nanos(2_727_272_728));
        assert_eq!(admitted.remaining, 0);
        assert_eq!(bucket.decide(state, T0, 11).0.retry_after(), Nanos::NEVER, "more than the burst: never");
    }

    #[test]
    fn sustained_load_warms_up_to_the_full_rate_in_warmup() {
        let bucket = bucket();
        let mut state = bucket.fresh(T0);
        // A request every 100 ms for two minutes.
        let mut per_10s = Vec::new();
        for window in 0..12u64 {
            let start = T0 + SECOND.times(10 * window);
            let admitted = (0..100u64).filter(|k| {
                let (decision, next) = bucket.decide(state, start + Nanos::from_millis(100 * k), 1);
                state = next;
                decision.allowed()
            });
            per_10s.push(admitted.count());
        }
        // Cold: the burst of 4, then about one per 3 s. The rate at the middle
        // of the next windows is 1/2, 0.61, 0.72, 0.83, 0.94 per second (the
        // backlog carries a fraction over); once warm, exactly the limit.
        assert_eq!(per_10s, [4 + 3, 5, 6, 7, 9, 9, 10, 10, 10, 10, 10, 10]);
    }

    #[test]
    fn light_traffic_keeps_it_warm_and_a_long_pause_makes_it_cold() {
        let bucket = bucket();
        let mut state = WarmState { tat: T0, warm_since: T0 - SECOND.times(120), backlog_ended: T0 };
        // Warm: a burst of 10.
        let mut warm = state;
        assert_eq!(burst(&bucket, &mut warm, T0 + SECOND.times(59), 20), 10);
        // One request every 30 s keeps it warm (never 60 s without backlog).
        for k in 1..=10u64 {
            assert_eq!(burst(&bucket, &mut state, T0 + SECOND.times(30 * k), 1), 1);
        }
        assert!(!bucket.is_idle(state, T0 + SECOND.times(301 + 59)));
        assert_eq!(burst(&bucket, &mut state.clone(), T0 + SECOND.times(301 + 59), 20), 10);
        // 60 s without backlog: cold, exactly like a new bucket.
        let cold_at = state.tat + SECOND.times(60);
        assert!(bucket.is_idle(state, cold_at));
        assert!(!bucket.is_idle(state, cold_at - Nanos::from_nanos(1)));
        assert_eq!(burst(&bucket, &mut state, cold_at, 20), 4);
    }

    #[test]
    fn undo_restores_the_backlog_and_the_way_back_to_cold() {
        let bucket = bucket();
        let cold = bucket.fresh(T0);
        let (_, taken) = bucket.decide(cold, T0, 2);
        let undone = bucket.release(taken, T0, Grant { cost: 2, at: T0 }, Release::Undo).unwrap();
        assert!(bucket.is_idle(undone, T0), "undoing the first request leaves the bucket cold");
        assert_eq!(bucket.release(taken, T0, Grant { cost: 2, at: T0 }, Release::Done), None);
        // Within a backlog, undo takes back exactly what was charged.
        let (_, more) = bucket.decide(taken, T0 + SECOND, 1);
        let back = bucket.release(more, T0 + SECOND, Grant { cost: 1, at: T0 + SECOND }, Release::Undo).unwrap();
        assert_eq!(back, taken);
        // A grant from an earlier warm-up is not in this one's backlog.
        let later = T0 + SECOND.times(600);
        let (_, rewarmed) = bucket.decide(taken, later, 1);
        assert_eq!(bucket.release(rewarmed, later, Grant { cost: 2, at: T0 }, Release::Undo), None);
    }

    #[test]
    fn cold_factor_must_be_between_2_and_100() {
        for (factor, ok) in [(1, false), (2, true), (100, true), (101, false)] {
            let fields = serde_json::json!({"period": "1s", "warmup": "1m", "cold_factor": factor});
            let mut params = Params::new("rules[0]", 5, fields.as_object().unwrap().clone());
            assert_eq!(WarmUp::from_params(&mut params).is_ok(), ok, "{factor}");
        }
        let mut params = Params::new("rules[0]", 5, serde_json::json!({"period": "1s"}).as_object().unwrap().clone());
        let error = WarmUp::from_params(&mut params).unwrap_err();
        assert!(error.message.contains("warmup"), "{}", error.message);
        let mut params = Params::new(
            "rules[0]",
            5,
            serde_json::json!({"period": "1s", "warmup": "1m"}).as_object().unwrap().clone(),
        );
        let bucket = WarmUp::from_params(&mut params).unwrap();
        assert_eq!((bucket.cold_factor, bucket.burst), (DEFAULT_COLD_FACTOR, 5));
    }
}
