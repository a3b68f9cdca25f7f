//! Fixed window: at most `limit` units in each window of `period`, windows
//! aligned to the epoch (so every instance that shares a clock agrees on where
//! a window starts), as envoyproxy/ratelimit counts.

use super::{Algorithm, CountingWindow, Decision, FromParams, Grant, Params, Quota, Release};
use crate::error::ConfigError;
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
        Self { limit: limit.max(1), period: period.max(Nanos::ONE) }
    }

    /// The index of the window holding `instant`.
    pub fn window_of(&self, instant: Nanos) -> u64 {
        instant / self.period
    }

    /// The state that counts at `now`: the stored one while its window is
    /// current (or the next, see below), else an unused current window.
    pub fn current(&self, state: WindowState, now: Nanos) -> WindowState {
        // The stored window is the current one, or the next one when the
        // wall clock stepped back across a boundary: that window keeps its
        // count rather than reopening (which would admit a second `limit`).
        // A window further ahead is not trusted (a clock once set far ahead
        // must not lock a key out until then): it starts afresh.
        let window = self.window_of(now);
        if state.window == window || state.window == window.saturating_add(1) {
            state
        } else {
            self.fresh(now)
        }
    }

    /// Time from `now` to the end of `window`.
    fn left_in(&self, window: u64, now: Nanos) -> Nanos {
        self.period.times(window.saturating_add(1)) - now
    }

    fn report(&self, state: WindowState, window_left: Nanos) -> (u64, Nanos) {
        let reset = if state.used == 0 { Nanos::ZERO } else { window_left };
        (self.limit.saturating_sub(state.used), reset)
    }
}

impl Algorithm for FixedWindow {
    type State = WindowState;

    fn state_len(&self) -> usize {
        16
    }

    fn decode(&self, bytes: &[u8]) -> Option<WindowState> {
        Some(WindowState { window: super::get_u64(bytes, 0)?, used: super::get_u64(bytes, 8)? })
    }

    fn encode(&self, state: &WindowState, out: &mut [u8]) {
        super::put_u64(out, 0, state.window);
        super::put_u64(out, 8, state.used);
    }

    fn capacity(&self) -> u64 {
        self.limit
    }

    fn quota(&self) -> Quota {
        Quota { limit: self.limit, window: Some(self.period) }
    }

    /// An unused current window.
    fn fresh(&self, now: Nanos) -> WindowState {
        WindowState { window: self.window_of(now), used: 0 }
    }

    /// Admits `cost` units if the current window has room for them.
    fn decide(&self, state: WindowState, now: Nanos, cost: u64) -> (Decision, WindowState) {
        let state = self.current(state, now);
        let window_left = self.left_in(state.window, now);
        match state.used.checked_add(cost).filter(|used| *used <= self.limit) {
            Some(used) => {
                let after = WindowState { used, ..state };
                let (remaining, reset) = self.report(after, window_left);
                (Decision::admit(remaining, reset), after)
            }
            None => {
                let retry_after = if cost > self.limit { Nanos::NEVER } else { window_left };
                let (remaining, reset) = self.report(state, window_left);
                (Decision::deny(remaining, reset, retry_after), state)
            }
        }
    }

    /// Undo gives units back only into the window they were taken in: a
    /// later window never counted them.
    fn release(&self, state: WindowState, now: Nanos, grant: Grant, why: Release) -> Option<WindowState> {
        let state = self.current(state, now);
        (why.gives_back() && state.window == self.window_of(grant.at) && state.used > 0)
            .then(|| WindowState { used: state.used.saturating_sub(grant.cost), ..state })
    }

    /// Nothing used in the current window.
    fn is_idle(&self, state: WindowState, now: Nanos) -> bool {
        self.current(state, now).used == 0
    }

    /// The end of the window the units were counted in.
    fn idle_at(&self, state: WindowState, now: Nanos) -> Nanos {
        let state = self.current(state, now);
        if state.used == 0 {
            now
        } else {
            self.period.times(state.window.saturating_add(1))
        }
    }

    /// An interval of up to one period overlaps two windows (a burst at the
    /// end of one and the start of the next); each further period adds one.
    fn admitted_bound(&self, span: Nanos) -> u64 {
        self.limit.saturating_mul((span / self.period).saturating_add(2))
    }

    fn batchable(&self) -> bool {
        true
    }

    /// The window that counts at `now`: units count only there.
    fn counting_window(&self, state: &WindowState, now: Nanos) -> Option<CountingWindow> {
        let window = self.current(*state, now).window;
        Some(CountingWindow { index: window, end: self.period.times(window.saturating_add(1)), renews: true })
    }

    /// The units in the window that counts at `at`, over the limit if need be.
    fn count(&self, state: WindowState, at: Nanos, units: u64) -> WindowState {
        let state = self.current(state, at);
        WindowState { used: state.used.saturating_add(units), ..state }
    }
}

impl FromParams for FixedWindow {
    const FIELDS: &'static [&'static str] = &["period"];

    /// `period` (required).
    fn from_params(params: &mut Params) -> Result<Self, ConfigError> {
        Ok(Self::new(params.limit(), params.required_duration("period")?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::SECOND;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const T0: Nanos = Nanos::from_secs(1_700_000_000); // a multiple of 10 s

    fn take(window: &FixedWindow, state: WindowState, now: Nanos, cost: u64) -> WindowState {
        window.decide(state, now, cost).1
    }

    #[test]
    fn admits_the_limit_per_window_and_resets_at_the_boundary() {
        let window = FixedWindow::new(3, SECOND.times(10));
        let at = T0 + SECOND.times(4);
        let mut state = window.fresh(at);
        for expected in [2, 1, 0] {
            let (decision, next) = window.decide(state, at, 1);
            assert!(decision.allowed());
            assert_eq!(decision.remaining, expected);
            assert_eq!(decision.reset, SECOND.times(6));
            state = next;
        }
        let (denied, _) = window.decide(state, at, 1);
        assert!(!denied.allowed());
        assert_eq!(denied.retry_after(), SECOND.times(6));
        assert!(!window.decide(state, T0 + SECOND.times(10) - Nanos::from_nanos(1), 1).0.allowed());
        assert!(window.decide(state, T0 + SECOND.times(10), 1).0.allowed());
    }

    #[test]
    fn a_clock_step_back_does_not_reopen_the_window() {
        let window = FixedWindow::new(2, SECOND.times(10));
        let later = T0 + SECOND.times(10);
        let used = take(&window, window.fresh(later), later, 2);
        // The clock steps back into the previous window.
        assert!(!window.decide(used, T0 + SECOND.times(9), 1).0.allowed());
    }

    #[test]
    fn a_window_far_ahead_is_not_trusted() {
        let window = FixedWindow::new(2, SECOND.times(10));
        let far = WindowState { window: u64::MAX, used: 2 };
        assert!(window.decide(far, T0, 1).0.allowed());
        let next = WindowState { window: window.window_of(T0) + 2, used: 2 };
        assert!(window.decide(next, T0, 1).0.allowed());
    }

    #[test]
    fn undo_only_into_the_window_the_units_came_from() {
        let window = FixedWindow::new(10, SECOND);
        let state = take(&window, window.fresh(T0), T0, 7);
        let grant = Grant { cost: 4, at: T0 };
        assert_eq!(window.release(state, T0, grant, Release::Undo).unwrap().used, 3);
        assert_eq!(window.release(state, T0, grant, Release::Done), None);
        assert_eq!(window.release(state, T0 + SECOND, grant, Release::Undo), None, "the window is over");
        let earlier = Grant { cost: 4, at: T0 - SECOND };
        assert_eq!(window.release(state, T0, earlier, Release::Undo), None, "taken in another window");
        assert!(window.is_idle(state, T0 + SECOND));
    }

    #[test]
    fn units_count_until_their_window_ends() {
        let window = FixedWindow::new(10, SECOND.times(10));
        let at = T0 + SECOND.times(4);
        let counted = window.counting_window(&window.fresh(at), at);
        let expected = CountingWindow { index: window.window_of(at), end: T0 + SECOND.times(10), renews: true };
        assert_eq!(counted, Some(expected));
        // After a clock step back, units go into the window the state holds.
        let later = take(&window, window.fresh(T0 + SECOND.times(10)), T0 + SECOND.times(10), 1);
        assert_eq!(window.counting_window(&later, at).map(|w| w.end), Some(T0 + SECOND.times(20)));
    }
}
