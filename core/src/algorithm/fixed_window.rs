//! Fixed window: at most `limit` units in each window of `period`, windows
//! aligned to the epoch (so every instance that shares a clock agrees on where
//! a window starts), as envoyproxy/ratelimit counts.

use super::Decision;
use crate::time::Nanos;

/// Fixed-window parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedWindow {
    limit: u64,
    period: Nanos,
}

/// A window's state: which window, and how much of it is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowState {
    /// Index of the window (`instant / period`).
    pub window: u64,
    /// Units admitted in that window.
    pub used: u64,
}

impl FixedWindow {
    /// At most `limit` units per `period`.
    pub fn new(limit: u64, period: Nanos) -> Self {
        Self { limit: limit.max(1), period: period.max(1) }
    }

    /// Units admitted in one window.
    pub fn capacity(&self) -> u64 {
        self.limit
    }

    /// An unused window at `now`.
    pub fn fresh(&self, now: Nanos) -> WindowState {
        WindowState { window: now / self.period, used: 0 }
    }

    /// The state that counts at `now`: the stored one while its window is
    /// current (or the next, see below), else an unused current window.
    pub fn current(&self, state: WindowState, now: Nanos) -> WindowState {
        // The stored window is the current one, or the next one when the
        // wall clock stepped back across a boundary: that window keeps its
        // count rather than reopening (which would admit a second `limit`).
        // A window further ahead is not trusted (a clock once set far ahead
        // must not lock a key out until then): it starts afresh.
        let window = now / self.period;
        if state.window == window || state.window == window.saturating_add(1) {
            state
        } else {
            self.fresh(now)
        }
    }

    /// Admits `cost` units if the current window has room for them.
    pub fn decide(&self, state: WindowState, now: Nanos, cost: u64) -> (Decision, WindowState) {
        let state = self.current(state, now);
        let window_left = state.window.saturating_add(1).saturating_mul(self.period).saturating_sub(now);
        match state.used.checked_add(cost).filter(|used| *used <= self.limit) {
            Some(used) => {
                let after = WindowState { used, ..state };
                (self.report(after, true, window_left, 0), after)
            }
            None => {
                let retry_after = if cost > self.limit { Nanos::MAX } else { window_left };
                (self.report(state, false, window_left, retry_after), state)
            }
        }
    }

    /// Admits as many units as the window has room for, up to `wanted`.
    pub fn take_up_to(&self, state: WindowState, now: Nanos, wanted: u64) -> (u64, Decision, WindowState) {
        let state = self.current(state, now);
        let granted = (self.limit - state.used.min(self.limit)).min(wanted);
        let (decision, after) = self.decide(state, now, granted);
        (granted, decision, after)
    }

    /// Gives back `cost` units admitted earlier in the same window.
    pub fn refund(&self, state: WindowState, now: Nanos, cost: u64) -> WindowState {
        let state = self.current(state, now);
        WindowState { used: state.used.saturating_sub(cost), ..state }
    }

    /// True when nothing is used in the current window.
    pub fn is_idle(&self, state: WindowState, now: Nanos) -> bool {
        self.current(state, now).used == 0
    }

    fn report(&self, state: WindowState, allowed: bool, window_left: Nanos, retry_after: Nanos) -> Decision {
        let remaining = self.limit.saturating_sub(state.used);
        let reset = if state.used == 0 { 0 } else { window_left };
        Decision { allowed, remaining, reset, retry_after }
    }

    /// Encodes a state as 16 little-endian bytes.
    pub fn encode(state: WindowState, out: &mut [u8]) {
        super::put_u64(out, 0, state.window);
        super::put_u64(out, 8, state.used);
    }

    /// Decodes 16 bytes written by [`FixedWindow::encode`].
    pub fn decode(bytes: &[u8]) -> Option<WindowState> {
        Some(WindowState { window: super::get_u64(bytes, 0)?, used: super::get_u64(bytes, 8)? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::SECOND;

    const T0: Nanos = 1_700_000_000 * SECOND; // a multiple of 10 s

    #[test]
    fn admits_the_limit_per_window_and_resets_at_the_boundary() {
        let window = FixedWindow::new(3, 10 * SECOND);
        let mut state = window.fresh(T0 + 4 * SECOND);
        for expected in [2, 1, 0] {
            let (decision, next) = window.decide(state, T0 + 4 * SECOND, 1);
            assert!(decision.allowed);
            assert_eq!(decision.remaining, expected);
            assert_eq!(decision.reset, 6 * SECOND);
            state = next;
        }
        let (denied, _) = window.decide(state, T0 + 4 * SECOND, 1);
        assert!(!denied.allowed);
        assert_eq!(denied.retry_after, 6 * SECOND);
        assert!(!window.decide(state, T0 + 10 * SECOND - 1, 1).0.allowed);
        assert!(window.decide(state, T0 + 10 * SECOND, 1).0.allowed);
    }

    #[test]
    fn a_clock_step_back_does_not_reopen_the_window() {
        let window = FixedWindow::new(2, 10 * SECOND);
        let (_, _, used) = window.take_up_to(window.fresh(T0 + 10 * SECOND), T0 + 10 * SECOND, 2);
        // The clock steps back into the previous window.
        let (decision, _) = window.decide(used, T0 + 9 * SECOND, 1);
        assert!(!decision.allowed);
    }

    #[test]
    fn a_window_far_ahead_is_not_trusted() {
        let window = FixedWindow::new(2, 10 * SECOND);
        let far = WindowState { window: u64::MAX, used: 2 };
        assert!(window.decide(far, T0, 1).0.allowed);
        let next = WindowState { window: T0 / (10 * SECOND) + 2, used: 2 };
        assert!(window.decide(next, T0, 1).0.allowed);
    }

    #[test]
    fn take_up_to_grants_only_what_is_left() {
        let window = FixedWindow::new(10, SECOND);
        let (granted, _, state) = window.take_up_to(window.fresh(T0), T0, 7);
        assert_eq!(granted, 7);
        let (granted, decision, state) = window.take_up_to(state, T0, 7);
        assert_eq!(granted, 3);
        assert_eq!(decision.remaining, 0);
        assert_eq!(window.refund(state, T0, 4).used, 6);
        assert!(window.is_idle(state, T0 + SECOND));
    }
}
