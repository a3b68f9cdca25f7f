//! Token bucket: holds up to `capacity` tokens and earns `limit` tokens per
//! `period`, continuously. A request of cost `c` takes `c` tokens or is denied.

use super::{div_ceil_u128, Decision};
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
        Self { limit: limit.max(1), period: period.max(1), capacity: capacity.max(1) }
    }

    /// Tokens the bucket holds when full.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// A full bucket, as a never-seen key starts.
    pub fn fresh(&self, now: Nanos) -> TokenState {
        TokenState { tokens: self.capacity, credited_until: now }
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
        let earned = u128::from(elapsed) * u128::from(self.limit) / u128::from(self.period);
        let tokens = u128::from(state.tokens) + earned;
        if tokens >= u128::from(self.capacity) {
            return self.fresh(now);
        }
        // Advance only by the time the whole tokens took (rounded up, so the
        // bucket can never earn a token early); the rest carries over.
        let spent = div_ceil_u128(earned * u128::from(self.period), u128::from(self.limit));
        TokenState {
            tokens: tokens as u64, // < capacity, fits
            credited_until: state.credited_until.saturating_add(spent.min(u128::from(elapsed)) as u64),
        }
    }

    /// Time from `credited_until` until `tokens` more tokens have been earned.
    fn time_to_earn(&self, tokens: u64) -> Nanos {
        let span = div_ceil_u128(u128::from(tokens) * u128::from(self.period), u128::from(self.limit));
        u64::try_from(span).unwrap_or(Nanos::MAX)
    }

    /// Takes `cost` tokens if the bucket holds them. Returns the decision and
    /// the new state (the refilled state when denied).
    pub fn decide(&self, state: TokenState, now: Nanos, cost: u64) -> (Decision, TokenState) {
        let state = self.refill(state, now);
        if state.tokens >= cost {
            let after = TokenState { tokens: state.tokens - cost, ..state };
            (self.report(after, now, true, 0), after)
        } else {
            let retry_after = if cost > self.capacity {
                Nanos::MAX
            } else {
                let ready_at = state.credited_until.saturating_add(self.time_to_earn(cost - state.tokens));
                ready_at.saturating_sub(now)
            };
            (self.report(state, now, false, retry_after), state)
        }
    }

    /// Takes as many tokens as the bucket holds, up to `wanted`.
    pub fn take_up_to(&self, state: TokenState, now: Nanos, wanted: u64) -> (u64, Decision, TokenState) {
        let state = self.refill(state, now);
        let granted = state.tokens.min(wanted);
        let (decision, after) = self.decide(state, now, granted);
        (granted, decision, after)
    }

    /// Gives back `cost` tokens taken earlier (never beyond the capacity).
    pub fn refund(&self, state: TokenState, now: Nanos, cost: u64) -> TokenState {
        let state = self.refill(state, now);
        let tokens = state.tokens.saturating_add(cost);
        if tokens >= self.capacity {
            self.fresh(now)
        } else {
            TokenState { tokens, ..state }
        }
    }

    /// True when the bucket is full at `now`: indistinguishable from a fresh one.
    pub fn is_idle(&self, state: TokenState, now: Nanos) -> bool {
        self.refill(state, now).tokens >= self.capacity
    }

    fn report(&self, state: TokenState, now: Nanos, allowed: bool, retry_after: Nanos) -> Decision {
        let next_token = if state.tokens >= self.capacity {
            0
        } else {
            state.credited_until.saturating_add(self.time_to_earn(1)).saturating_sub(now)
        };
        Decision { allowed, remaining: state.tokens, reset: next_token, retry_after }
    }

    /// Encodes a state as 16 little-endian bytes.
    pub fn encode(state: TokenState, out: &mut [u8]) {
        super::put_u64(out, 0, state.tokens);
        super::put_u64(out, 8, state.credited_until);
    }

    /// Decodes 16 bytes written by [`TokenBucket::encode`].
    pub fn decode(bytes: &[u8]) -> Option<TokenState> {
        Some(TokenState { tokens: super::get_u64(bytes, 0)?, credited_until: super::get_u64(bytes, 8)? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::SECOND;

    const T0: Nanos = 1_700_000_000 * SECOND;

    #[test]
    fn a_fresh_bucket_admits_its_burst_then_denies() {
        let bucket = TokenBucket::new(10, 10 * SECOND, 5);
        let mut state = bucket.fresh(T0);
        for expected_remaining in (0..5).rev() {
            let (decision, next) = bucket.decide(state, T0, 1);
            assert!(decision.allowed);
            assert_eq!(decision.remaining, expected_remaining);
            state = next;
        }
        let (denied, _) = bucket.decide(state, T0, 1);
        assert!(!denied.allowed);
        assert_eq!(denied.remaining, 0);
        // One token per second: exactly one second to wait.
        assert_eq!(denied.retry_after, SECOND);
        assert_eq!(denied.reset, SECOND);
    }

    #[test]
    fn refills_exactly_at_the_rate() {
        let bucket = TokenBucket::new(10, 10 * SECOND, 10);
        let (_, _, empty) = bucket.take_up_to(bucket.fresh(T0), T0, 10);
        assert_eq!(empty.tokens, 0);
        assert_eq!(bucket.refill(empty, T0 + SECOND - 1).tokens, 0);
        assert_eq!(bucket.refill(empty, T0 + SECOND).tokens, 1);
        assert_eq!(bucket.refill(empty, T0 + 3 * SECOND + 500_000_000).tokens, 3);
        assert_eq!(bucket.refill(empty, T0 + 60 * SECOND).tokens, 10);
    }

    #[test]
    fn frequent_updates_do_not_starve_the_refill() {
        // 100 per minute: a token every 600 ms. Updating every millisecond must
        // still earn 100 tokens in a minute.
        let bucket = TokenBucket::new(100, 60 * SECOND, 100);
        let (_, _, mut state) = bucket.take_up_to(bucket.fresh(T0), T0, 100);
        for ms in 1..=60_000u64 {
            state = bucket.refill(state, T0 + ms * 1_000_000);
        }
        assert_eq!(state.tokens, 100);
    }

    #[test]
    fn retry_after_is_exact_for_costs_and_never_early() {
        let bucket = TokenBucket::new(3, 10 * SECOND, 6); // a token every 3.33 s
        let (_, _, empty) = bucket.take_up_to(bucket.fresh(T0), T0, 6);
        let (denied, _) = bucket.decide(empty, T0, 2);
        assert!(!denied.allowed);
        let wait = denied.retry_after;
        assert!(!bucket.decide(empty, T0 + wait - 1, 2).0.allowed, "one nanosecond early must still deny");
        assert!(bucket.decide(empty, T0 + wait, 2).0.allowed, "at retry_after it must admit");
    }

    #[test]
    fn a_cost_above_capacity_is_never_admitted() {
        let bucket = TokenBucket::new(10, SECOND, 5);
        let (decision, _) = bucket.decide(bucket.fresh(T0), T0, 6);
        assert!(!decision.allowed);
        assert_eq!(decision.retry_after, Nanos::MAX);
    }

    #[test]
    fn refund_restores_and_caps_at_capacity() {
        let bucket = TokenBucket::new(10, 10 * SECOND, 4);
        let (_, state) = bucket.decide(bucket.fresh(T0), T0, 3);
        assert_eq!(state.tokens, 1);
        assert_eq!(bucket.refund(state, T0, 2).tokens, 3);
        assert_eq!(bucket.refund(state, T0, 50).tokens, 4);
        assert!(bucket.is_idle(bucket.refund(state, T0, 3), T0));
    }

    #[test]
    fn a_clock_step_backwards_credits_nothing() {
        let bucket = TokenBucket::new(10, 10 * SECOND, 10);
        let (_, _, state) = bucket.take_up_to(bucket.fresh(T0), T0, 10);
        assert_eq!(bucket.refill(state, T0 - SECOND), state);
    }

    #[test]
    fn state_round_trips_through_bytes() {
        let state = TokenState { tokens: 7, credited_until: T0 + 3 };
        let mut bytes = [0u8; 16];
        TokenBucket::encode(state, &mut bytes);
        assert_eq!(TokenBucket::decode(&bytes), Some(state));
        assert_eq!(TokenBucket::decode(&bytes[..15]), None);
    }
}
