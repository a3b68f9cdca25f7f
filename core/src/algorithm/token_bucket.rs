//! Token bucket: holds up to `capacity` tokens and earns `limit` tokens per
//! `period`, continuously. A request of cost `c` takes `c` tokens or is denied.

use super::{
    div_ceil_u128, nanos_u128, Algorithm, CountingWindow, Decision, FromParams, Grant, Params, Quota, Release,
};
use crate::error::ConfigError;
use crate::time::Nanos;

/// A token bucket's parameters. All three are non-zero (the config layer
/// guarantees it; [`TokenBucket::new`] clamps zeros to one so arithmetic
/// never divides by zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBucket {
    limit: u64,
    period: Nanos,
    capacity: u64,
}

/// A bucket's state: whole tokens held, and the instant up to which tokens
/// have been credited. Time not yet worth a whole token carries over, so
/// frequent updates never starve the refill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenState {
    /// Whole tokens in the bucket.
    pub tokens: u64,
    /// Tokens have been credited for all time before this instant.
    pub credited_until: Nanos,
}

impl TokenBucket {
    /// A bucket earning `limit` tokens per `period` and holding at most `capacity`.
    pub fn new(limit: u64, period: Nanos, capacity: u64) -> Self {
        Self { limit: limit.max(1), period: period.max(Nanos::ONE), capacity: capacity.max(1) }
    }

    /// The state at `now`: earned tokens credited, capped at the capacity.
    pub fn refill(&self, state: TokenState, now: Nanos) -> TokenState {
        if state.tokens >= self.capacity {
            return self.fresh(now);
        }
        let Some(elapsed) = now.checked_sub(state.credited_until) else {
            // The clock stepped back: credit nothing until it catches up.
            return state;
        };
        let earned = u128::from(elapsed.get()) * u128::from(self.limit) / u128::from(self.period.get());
        let tokens = u128::from(state.tokens) + earned;
        if tokens >= u128::from(self.capacity) {
            return self.fresh(now);
        }
        // Advance only by the time the whole tokens took (rounded up, so the
        // bucket can never earn a token early); the rest carries over.
        let spent = div_ceil_u128(earned * u128::from(self.period.get()), u128::from(self.limit));
        TokenState {
            tokens: tokens as u64, // < capacity, fits
            credited_until: state.credited_until + nanos_u128(spent.min(u128::from(elapsed.get()))),
        }
    }

    /// Time from `credited_until` until `tokens` more tokens have been earned.
    fn time_to_earn(&self, tokens: u64) -> Nanos {
        nanos_u128(div_ceil_u128(u128::from(tokens) * u128::from(self.period.get()), u128::from(self.limit)))
    }

    fn report(&self, state: TokenState, now: Nanos) -> (u64, Nanos) {
        let next_token =
            if state.tokens >= self.capacity { Nanos::ZERO } else { state.credited_until + self.time_to_earn(1) - now };
        (state.tokens, next_token)
    }
}

impl Algorithm for TokenBucket {
    type State = TokenState;

    fn state_len(&self) -> usize {
        16
    }

    fn decode(&self, bytes: &[u8]) -> Option<TokenState> {
        Some(TokenState {
            tokens: super::get_u64(bytes, 0)?,
            credited_until: Nanos::from_nanos(super::get_u64(bytes, 8)?),
        })
    }

    fn encode(&self, state: &TokenState, out: &mut [u8]) {
        super::put_u64(out, 0, state.tokens);
        super::put_u64(out, 8, state.credited_until.get());
    }

    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn quota(&self) -> Quota {
        Quota { limit: self.limit, window: Some(self.period) }
    }

    /// A full bucket.
    fn fresh(&self, now: Nanos) -> TokenState {
        TokenState { tokens: self.capacity, credited_until: now }
    }

    fn decide(&self, state: TokenState, now: Nanos, cost: u64) -> (Decision, TokenState) {
        let state = self.refill(state, now);
        if state.tokens >= cost {
            let after = TokenState { tokens: state.tokens - cost, ..state };
            let (remaining, reset) = self.report(after, now);
            (Decision::admit(remaining, reset), after)
        } else {
            let retry_after = if cost > self.capacity {
                Nanos::NEVER
            } else {
                state.credited_until + self.time_to_earn(cost - state.tokens) - now
            };
            let (remaining, reset) = self.report(state, now);
            (Decision::deny(remaining, reset, retry_after), state)
        }
    }

    /// Undo puts back the grant's tokens the bucket has not earned again
    /// since they were taken (never beyond the capacity). The bucket may have
    /// been full since, its refill lost at the brim: as if the grant had been
    /// the last take from a full bucket, every token earned since counts as
    /// earned back. An undo at the instant of the grant puts all of it back.
    /// The unused part of a larger grant ([`Release::Return`]) goes back
    /// whole while the tokens earned since do not exceed the part used.
    fn release(&self, state: TokenState, now: Nanos, grant: Grant, why: Release) -> Option<TokenState> {
        if why == Release::Done {
            return None;
        }
        let since = now.checked_sub(grant.at).unwrap_or(Nanos::ZERO);
        let earned = div_ceil_u128(u128::from(since.get()) * u128::from(self.limit), u128::from(self.period.get()));
        let back = u128::from(grant.cost).min(u128::from(why.granted(grant)).saturating_sub(earned));
        if back == 0 {
            return None;
        }
        let state = self.refill(state, now);
        let tokens = u128::from(state.tokens) + back;
        Some(if tokens >= u128::from(self.capacity) {
            self.fresh(now)
        } else {
            TokenState { tokens: tokens as u64, ..state } // < capacity, fits
        })
    }

    /// Full at `now`.
    fn is_idle(&self, state: TokenState, now: Nanos) -> bool {
        self.refill(state, now).tokens >= self.capacity
    }

    /// When the missing tokens are earned: `floor((t − c) · limit / period)`
    /// reaches `m` exactly when `t − c ≥ ⌈m · period / limit⌉`.
    fn idle_at(&self, state: TokenState, now: Nanos) -> Nanos {
        if self.is_idle(state, now) {
            return now;
        }
        let missing = self.capacity.saturating_sub(state.tokens);
        (state.credited_until + self.time_to_earn(missing)).max(now)
    }

    /// The burst, then what the rate earns.
    fn admitted_bound(&self, span: Nanos) -> u64 {
        let earned = u128::from(span.get()) * u128::from(self.limit) / u128::from(self.period.get());
        self.capacity.saturating_add(u64::try_from(earned).unwrap_or(u64::MAX))
    }

    fn batchable(&self) -> bool {
        true
    }

    /// Slots of one period, numbered from the epoch: an allowance holds a
    /// share of the refill (its units in each slot, counted at the slot's
    /// start). Its holder spends a slot's units within that slot, so over
    /// any span the fleet admits at most the burst plus the refill over the
    /// span, plus the units the allowances hold in the slot in progress
    /// when the span starts (at most 3/4 of `limit`; see the README).
    fn allowance_slot(&self, _state: &TokenState, now: Nanos) -> Option<CountingWindow> {
        let index = now / self.period;
        Some(CountingWindow { index, end: self.period.times(index.saturating_add(1)), renews: false })
    }

    /// Takes `units` whatever the bucket holds: what it lacks becomes a
    /// debt, paid off by the refill before it earns again (its
    /// `credited_until` moves on by the time the missing tokens take).
    fn count(&self, state: TokenState, at: Nanos, units: u64) -> TokenState {
        let state = self.refill(state, at);
        match state.tokens.checked_sub(units) {
            Some(tokens) => TokenState { tokens, ..state },
            None => {
                TokenState { tokens: 0, credited_until: state.credited_until + self.time_to_earn(units - state.tokens) }
            }
        }
    }
}

impl FromParams for TokenBucket {
    const FIELDS: &'static [&'static str] = &["period", "burst"];

    /// `period` (required) and `burst` (default: `limit`).
    fn from_params(params: &mut Params) -> Result<Self, ConfigError> {
        let period = params.required_duration("period")?;
        let burst = params.units("burst")?.unwrap_or(params.limit());
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

    fn take_all(bucket: &TokenBucket, state: TokenState, now: Nanos) -> TokenState {
        let tokens = bucket.refill(state, now).tokens;
        bucket.decide(state, now, tokens).1
    }

    #[test]
    fn a_fresh_bucket_admits_its_burst_then_denies() {
        let bucket = TokenBucket::new(10, SECOND.times(10), 5);
        let mut state = bucket.fresh(T0);
        for expected_remaining in (0..5).rev() {
            let (decision, next) = bucket.decide(state, T0, 1);
            assert!(decision.allowed());
            assert_eq!(decision.remaining, expected_remaining);
            state = next;
        }
        let (denied, _) = bucket.decide(state, T0, 1);
        assert!(!denied.allowed());
        assert_eq!(denied.remaining, 0);
        // One token per second: exactly one second to wait.
        assert_eq!(denied.retry_after(), SECOND);
        assert_eq!(denied.reset, SECOND);
    }

    #[test]
    fn refills_exactly_at_the_rate() {
        let bucket = TokenBucket::new(10, SECOND.times(10), 10);
        let empty = take_all(&bucket, bucket.fresh(T0), T0);
        assert_eq!(empty.tokens, 0);
        assert_eq!(bucket.refill(empty, T0 + SECOND - Nanos::from_nanos(1)).tokens, 0);
        assert_eq!(bucket.refill(empty, T0 + SECOND).tokens, 1);
        assert_eq!(bucket.refill(empty, T0 + SECOND.times(3) + Nanos::from_millis(500)).tokens, 3);
        assert_eq!(bucket.refill(empty, T0 + SECOND.times(60)).tokens, 10);
    }

    #[test]
    fn frequent_updates_do_not_starve_the_refill() {
        // 100 per minute: a token every 600 ms. Updating every millisecond must
        // still earn 100 tokens in a minute.
        let bucket = TokenBucket::new(100, SECOND.times(60), 100);
        let mut state = take_all(&bucket, bucket.fresh(T0), T0);
        for ms in 1..=60_000u64 {
            state = bucket.refill(state, T0 + Nanos::from_millis(ms));
        }
        assert_eq!(state.tokens, 100);
    }

    #[test]
    fn retry_after_is_exact_for_costs_and_never_early() {
        let bucket = TokenBucket::new(3, SECOND.times(10), 6); // a token every 3.33 s
        let empty = take_all(&bucket, bucket.fresh(T0), T0);
        let (denied, _) = bucket.decide(empty, T0, 2);
        assert!(!denied.allowed());
        let wait = denied.retry_after();
        assert!(
            !bucket.decide(empty, T0 + wait - Nanos::from_nanos(1), 2).0.allowed(),
            "one nanosecond early must still deny"
        );
        assert!(bucket.decide(empty, T0 + wait, 2).0.allowed(), "at retry_after it must admit");
    }

    #[test]
    fn a_cost_above_capacity_is_never_admitted() {
        let bucket = TokenBucket::new(10, SECOND, 5);
        let (decision, _) = bucket.decide(bucket.fresh(T0), T0, 6);
        assert!(!decision.allowed());
        assert_eq!(decision.retry_after(), Nanos::NEVER);
    }

    #[test]
    fn undo_restores_and_caps_at_capacity_and_done_keeps_the_tokens() {
        let bucket = TokenBucket::new(10, SECOND.times(10), 4);
        let (_, state) = bucket.decide(bucket.fresh(T0), T0, 3);
        assert_eq!(state.tokens, 1);
        let grant = |cost| Grant { cost, at: T0 };
        assert_eq!(bucket.release(state, T0, grant(2), Release::Undo).unwrap().tokens, 3);
        assert_eq!(bucket.release(state, T0, grant(50), Release::Undo).unwrap().tokens, 4);
        assert!(bucket.is_idle(bucket.release(state, T0, grant(3), Release::Undo).unwrap(), T0));
        assert_eq!(bucket.release(state, T0, grant(3), Release::Done), None);
    }

    #[test]
    fn an_undo_later_puts_back_only_what_was_not_earned_again() {
        // A lease returned late: 60 per minute, burst 10. 5 taken at T0; 5.5 s
        // later the bucket is full again and 10 are taken: the 5 were earned
        // back meanwhile (lost at the brim), so their undo puts back none.
        let bucket = TokenBucket::new(60, SECOND.times(60), 10);
        let (_, leased) = bucket.decide(bucket.fresh(T0), T0, 5);
        let later = T0 + Nanos::from_millis(5_500);
        let (_, spent) = bucket.decide(leased, later, 10);
        assert_eq!(bucket.release(spent, later, Grant { cost: 5, at: T0 }, Release::Undo), None);
        // 2.5 s after the grant, 2.5 of its 5 tokens are not earned again
        // yet: 2 whole ones come back.
        let soon = T0 + Nanos::from_millis(2_500);
        let (_, spent) = bucket.decide(leased, soon, 7);
        let undone = bucket.release(spent, soon, Grant { cost: 5, at: T0 }, Release::Undo).unwrap();
        assert_eq!(undone.tokens, 2);
    }

    #[test]
    fn a_returned_part_of_a_grant_counts_what_was_earned_against_the_part_used() {
        // 1 per second, burst 20: a lease of 10 and 10 more taken at T0.
        let bucket = TokenBucket::new(60, SECOND.times(60), 20);
        let (_, leased) = bucket.decide(bucket.fresh(T0), T0, 10);
        let (_, empty) = bucket.decide(leased, T0, 10);
        let part = Grant { cost: 5, at: T0 };
        let returned = |after: u64| {
            bucket.release(empty, T0 + SECOND.times(after), part, Release::Return { granted: 10 }).map(|s| s.tokens)
        };
        // 3 s later 3 tokens were earned, fewer than the 5 used: the 5
        // unused all come back (an undo of 5 alone would give back 2).
        assert_eq!(returned(3), Some(8));
        // 8 s later 8 were earned: of the 10 granted only 2 are not earned
        // again, and only those come back.
        assert_eq!(returned(8), Some(10));
        assert_eq!(returned(10), None);
    }

    #[test]
    fn a_clock_step_backwards_credits_nothing() {
        let bucket = TokenBucket::new(10, SECOND.times(10), 10);
        let state = take_all(&bucket, bucket.fresh(T0), T0);
        assert_eq!(bucket.refill(state, T0 - SECOND), state);
    }

    #[test]
    fn state_round_trips_through_bytes() {
        let bucket = TokenBucket::new(10, SECOND, 10);
        let state = TokenState { tokens: 7, credited_until: T0 + Nanos::from_nanos(3) };
        let mut bytes = [0u8; 16];
        bucket.encode(&state, &mut bytes);
        assert_eq!(bucket.decode(&bytes), Some(state));
        assert_eq!(bucket.decode(&bytes[..15]), None);
    }
}
