//! Sliding window: counters of fixed windows aligned to the epoch, read as a
//! window that slides with the clock. Two precisions:
//!
//! - **Weighted estimate** (default): counters of whole periods. At offset `e`
//!   into window `k`, the estimate is `⌈prev · (P − e) / P⌉ + curr`: the
//!   previous window's count weighted by the part of it still inside the
//!   sliding period (rounded up, so rounding never admits more), plus the
//!   current count. A request of cost `c` is admitted while
//!   `estimate + c ≤ limit`.
//! - **Sub-windows** (`sub_windows: N`, Sentinel's `LeapArray`): `N` counters
//!   of `S = ⌈P / N⌉` each (rounded up, so the `N` of them never cover less
//!   than the period). A request is admitted while the sum of the last `N`
//!   counters (the current one included) plus its cost fits `limit`.
//!
//! # State
//!
//! `8 + 4 · slots` bytes, where `slots` is 2 (weighted: previous and current
//! window) or `N`: bytes `0..8` hold the index of the newest counter
//! (`instant / span`, `span` being `P` or `S`) as a little-endian u64; for
//! every counter `i` of the last `slots` (`newest − slots < i ≤ newest`),
//! bytes `8 + 4 · (i mod slots)` hold its count as a little-endian u32
//! (`limit ≤ 10⁹` fits). 16 bytes weighted, 16 to 248 with sub-windows.
//!
//! # Bounds ([`Algorithm::admitted_bound`])
//!
//! Over any closed interval of `D` nanoseconds (`L` the limit, `P` the
//! period): weighted, at most `L + ⌊L · (D − 1) / P⌋` (`L` for `D = 0`),
//! tight for `D ≤ P`, so up to `2L − 1` within one period; with `N`
//! sub-windows of `S`, at most `L · ⌈(⌈D / S⌉ + 1) / N⌉`, tight. The proofs
//! are in `docs/bounds.md`; the property tests check both.

use super::{nanos_u128, Algorithm, CountingWindow, Decision, FromParams, Grant, Params, Quota, Release};
use crate::error::ConfigError;
use crate::time::Nanos;

/// The most sub-windows a rule may ask for.
pub const MAX_SUB_WINDOWS: usize = 60;

/// Sliding-window parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingWindow {
    limit: u64,
    period: Nanos,
    /// Counters kept: 2 (weighted) or the number of sub-windows.
    slots: u64,
    /// Span of one counter: the period (weighted) or a sub-window.
    span: Nanos,
    weighted: bool,
}

/// A bucket's counters: the newest counter's index, and the counts of the
/// last `slots` counters, counter `i` at `counts[i mod slots]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingState {
    /// Index (`instant / span`) of the newest counter.
    pub newest: u64,
    counts: [u32; MAX_SUB_WINDOWS],
}

impl SlidingWindow {
    /// The weighted estimate: at most about `limit` units per `period`.
    pub fn weighted(limit: u64, period: Nanos) -> Self {
        let period = period.max(Nanos::ONE);
        Self { limit: limit.max(1), period, slots: 2, span: period, weighted: true }
    }

    /// `sub_windows` counters (clamped to 2..=60) of `period / sub_windows`
    /// each (rounded up).
    pub fn with_sub_windows(limit: u64, period: Nanos, sub_windows: u64) -> Self {
        let period = period.max(Nanos::ONE);
        let slots = sub_windows.clamp(2, MAX_SUB_WINDOWS as u64);
        Self { limit: limit.max(1), period, slots, span: period.div_ceil(slots), weighted: false }
    }

    fn index_of(&self, instant: Nanos) -> u64 {
        instant / self.span
    }

    fn start_of(&self, index: u64) -> u128 {
        u128::from(index) * u128::from(self.span.get())
    }

    fn slot(&self, index: u64) -> usize {
        (index % self.slots) as usize // < slots ≤ 60
    }

    /// The count of counter `index` (zero outside the last `slots`).
    fn count_of(&self, state: &SlidingState, index: u64) -> u64 {
        let kept = index <= state.newest && state.newest - index < self.slots;
        if kept {
            state.counts.get(self.slot(index)).map_or(0, |c| u64::from(*c))
        } else {
            0
        }
    }

    fn is_empty(&self, state: &SlidingState) -> bool {
        state.counts.iter().take(self.slots as usize).all(|c| *c == 0)
    }

    /// The state with counter `index` (≥ `newest`) made the newest: the
    /// counters it passes start at zero.
    fn rolled(&self, mut state: SlidingState, index: u64) -> SlidingState {
        let passed = (index - state.newest).min(self.slots);
        for step in 1..=passed {
            let slot = self.slot(state.newest.wrapping_add(step));
            if let Some(count) = state.counts.get_mut(slot) {
                *count = 0;
            }
        }
        state.newest = index;
        state
    }

    /// The state that counts at `now`, and the instant it is read at.
    ///
    /// When the wall clock stepped back, a newest counter less than the
    /// sliding span ahead keeps its counts, read from its start (the counts
    /// must not reopen); one further ahead is not trusted (a clock once set
    /// far ahead must not lock a key out until then) and starts afresh, as
    /// does a state with nothing counted, so an idle bucket is a fresh one.
    fn view(&self, state: SlidingState, now: Nanos) -> (SlidingState, Nanos) {
        let current = self.index_of(now);
        let (state, at) = if state.newest <= current {
            (self.rolled(state, current), now)
        } else if state.newest - current < self.slots {
            (state, nanos_u128(self.start_of(state.newest)))
        } else {
            return (self.fresh(now), now);
        };
        if self.is_empty(&state) {
            (self.fresh(now), now)
        } else {
            (state, at)
        }
    }

    /// Units the window counts at `at` (within the newest counter).
    fn estimate(&self, state: &SlidingState, at: Nanos) -> u64 {
        if self.weighted {
            let newest = state.newest;
            let previous = u128::from(self.count_of(state, newest.wrapping_sub(1)));
            let into = u128::from(at.get()).saturating_sub(self.start_of(newest));
            let left = u128::from(self.period.get()).saturating_sub(into);
            let weighted = super::div_ceil_u128(previous * left, u128::from(self.period.get()));
            // ≤ a u32 count: fits.
            (weighted as u64).saturating_add(self.count_of(state, newest))
        } else {
            state.counts.iter().take(self.slots as usize).map(|c| u64::from(*c)).sum()
        }
    }

    /// Time from `at` until the window counts at most `budget`, if nothing
    /// more is admitted.
    fn wait_until(&self, state: &SlidingState, at: Nanos, budget: u64) -> Nanos {
        let newest = state.newest;
        let until = if self.weighted {
            // Within the window holding the current count, or (when that
            // count alone is over budget) the next one, where it becomes the
            // previous count: find the offset where the weighted part fits.
            let current = self.count_of(state, newest);
            let (start, previous, current) = if current <= budget {
                (self.start_of(newest), self.count_of(state, newest.wrapping_sub(1)), current)
            } else {
                (self.start_of(newest.saturating_add(1)), current, 0)
            };
            let room = u128::from(budget - current);
            let period = u128::from(self.period.get());
            // ⌈previous·(P − x)/P⌉ ≤ room  ⇔  x ≥ P − ⌊room·P/previous⌋.
            let offset = if previous == 0 { 0 } else { period.saturating_sub(room * period / u128::from(previous)) };
            (start + offset).max(u128::from(at.get()))
        } else {
            // Counters drop out oldest first, one per sub-window.
            let mut counted = self.estimate(state, at);
            let mut passed = 0;
            while counted > budget && passed < self.slots {
                passed += 1;
                let leaving =
                    newest.saturating_add(passed).checked_sub(self.slots).map_or(0, |i| self.count_of(state, i));
                counted -= leaving.min(counted);
            }
            if passed == 0 {
                u128::from(at.get())
            } else {
                self.start_of(newest.saturating_add(passed))
            }
        };
        nanos_u128(until.saturating_sub(u128::from(at.get())))
    }

    /// Remaining units, and the time until one more is available.
    fn report(&self, state: &SlidingState, at: Nanos, counted: u64) -> (u64, Nanos) {
        let reset = if counted == 0 { Nanos::ZERO } else { self.wait_until(state, at, counted - 1) };
        (self.limit.saturating_sub(counted), reset)
    }
}

impl Algorithm for SlidingWindow {
    type State = SlidingState;

    fn state_len(&self) -> usize {
        8 + 4 * self.slots as usize
    }

    fn decode(&self, bytes: &[u8]) -> Option<SlidingState> {
        let mut state = SlidingState { newest: super::get_u64(bytes, 0)?, counts: [0; MAX_SUB_WINDOWS] };
        for (i, count) in state.counts.iter_mut().take(self.slots as usize).enumerate() {
            let raw: [u8; 4] = bytes.get(8 + 4 * i..12 + 4 * i)?.try_into().ok()?;
            *count = u32::from_le_bytes(raw);
        }
        Some(state)
    }

    fn encode(&self, state: &SlidingState, out: &mut [u8]) {
        super::put_u64(out, 0, state.newest);
        for (i, count) in state.counts.iter().take(self.slots as usize).enumerate() {
            if let Some(dst) = out.get_mut(8 + 4 * i..12 + 4 * i) {
                dst.copy_from_slice(&count.to_le_bytes());
            }
        }
    }

    fn capacity(&self) -> u64 {
        self.limit
    }

    fn quota(&self) -> Quota {
        Quota { limit: self.limit, window: Some(self.period) }
    }

    /// Nothing counted, the newest counter the current one.
    fn fresh(&self, now: Nanos) -> SlidingState {
        SlidingState { newest: self.index_of(now), counts: [0; MAX_SUB_WINDOWS] }
    }

    /// Admits `cost` units if the window has room for them; counts them in
    /// the newest counter.
    fn decide(&self, state: SlidingState, now: Nanos, cost: u64) -> (Decision, SlidingState) {
        let (state, at) = self.view(state, now);
        // Nonzero only after a clock step back: the state is read later.
        let ahead = at - now;
        let counted = self.estimate(&state, at);
        match counted.checked_add(cost).filter(|after| *after <= self.limit) {
            Some(after_count) => {
                let mut after = state;
                let slot = self.slot(state.newest);
                let taken = self.count_of(&state, state.newest) + cost; // ≤ limit ≤ 10⁹
                if let Some(count) = after.counts.get_mut(slot) {
                    *count = u32::try_from(taken).unwrap_or(u32::MAX);
                }
                let (remaining, reset) = self.report(&after, at, after_count);
                (Decision::admit(remaining, reset + ahead), after)
            }
            None => {
                let retry_after = if cost > self.limit {
                    Nanos::NEVER
                } else {
                    self.wait_until(&state, at, self.limit - cost) + ahead
                };
                let (remaining, reset) = self.report(&state, at, counted);
                (Decision::deny(remaining, reset + ahead, retry_after), state)
            }
        }
    }

    /// Undo gives units back only into the counter they were taken in, if
    /// it is still kept.
    fn release(&self, state: SlidingState, now: Nanos, grant: Grant, why: Release) -> Option<SlidingState> {
        if why == Release::Done {
            return None;
        }
        let (mut state, _) = self.view(state, now);
        let taken_in = self.index_of(grant.at);
        if self.count_of(&state, taken_in) == 0 {
            return None;
        }
        let slot = self.slot(taken_in);
        let count = state.counts.get_mut(slot)?;
        *count = count.saturating_sub(u32::try_from(grant.cost).unwrap_or(u32::MAX));
        Some(state)
    }

    /// Nothing counted within the sliding period.
    fn is_idle(&self, state: SlidingState, now: Nanos) -> bool {
        self.is_empty(&self.view(state, now).0)
    }

    /// When the newest counter holding units has rolled out of the last
    /// `slots` (two whole periods after its start, weighted: the previous
    /// window's count weighs until the current one ends).
    fn idle_at(&self, state: SlidingState, now: Nanos) -> Nanos {
        let (state, _) = self.view(state, now);
        let last_used =
            (0..self.slots).map(|back| state.newest.wrapping_sub(back)).find(|i| self.count_of(&state, *i) > 0);
        match last_used {
            Some(index) => nanos_u128(self.start_of(index.saturating_add(self.slots))).max(now),
            None => now,
        }
    }

    /// See the module documentation for the proofs.
    fn admitted_bound(&self, span: Nanos) -> u64 {
        let limit = u128::from(self.limit);
        let bound = if self.weighted {
            limit + limit * u128::from(span.get().saturating_sub(1)) / u128::from(self.period.get())
        } else {
            let touched = u128::from(span.get().div_ceil(self.span.get())) + 1;
            limit * touched.div_ceil(u128::from(self.slots))
        };
        u64::try_from(bound).unwrap_or(u64::MAX)
    }

    fn batchable(&self) -> bool {
        true
    }

    /// The newest counter (a period, or a sub-window): units count there,
    /// and the bounds above hold for units spent within it; its counts then
    /// fade out over the counters that follow.
    fn counting_window(&self, state: &SlidingState, now: Nanos) -> Option<CountingWindow> {
        let newest = self.view(*state, now).0.newest;
        let end = nanos_u128(self.start_of(newest.saturating_add(1)));
        Some(CountingWindow { index: newest, end, renews: false })
    }

    /// The units in the newest counter at `at`, over the limit if need be
    /// (a counter holds at most `u32::MAX`).
    fn count(&self, state: SlidingState, at: Nanos, units: u64) -> SlidingState {
        let (mut state, _) = self.view(state, at);
        let slot = self.slot(state.newest);
        let taken = self.count_of(&state, state.newest).saturating_add(units);
        if let Some(count) = state.counts.get_mut(slot) {
            *count = u32::try_from(taken).unwrap_or(u32::MAX);
        }
        state
    }
}

impl FromParams for SlidingWindow {
    const FIELDS: &'static [&'static str] = &["period", "sub_windows"];

    /// `period` (required) and `sub_windows` (2 to 60; without it, the
    /// weighted estimate).
    fn from_params(params: &mut Params) -> Result<Self, ConfigError> {
        let period = params.required_duration("period")?;
        Ok(match params.amount("sub_windows", 2, MAX_SUB_WINDOWS as u64)? {
            None => Self::weighted(params.limit(), period),
            Some(n) => Self::with_sub_windows(params.limit(), period, n),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::SECOND;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const T0: Nanos = Nanos::from_secs(1_700_000_000); // a multiple of 10 s

    fn admitted(window: &SlidingWindow, state: &mut SlidingState, now: Nanos, cost: u64, tries: u64) -> u64 {
        (0..tries)
            .filter(|_| {
                let (decision, next) = window.decide(*state, now, cost);
                *state = next;
                decision.allowed()
            })
            .count() as u64
    }

    /// The decision for one probe, leaving the state alone.
    fn probe(window: &SlidingWindow, state: SlidingState, now: Nanos, cost: u64) -> Decision {
        window.decide(state, now, cost).0
    }

    fn assert_retry_exact(window: &SlidingWindow, state: SlidingState, now: Nanos, cost: u64, expected: Nanos) {
        let denied = probe(window, state, now, cost);
        assert!(!denied.allowed());
        assert_eq!(denied.retry_after(), expected);
        assert!(!probe(window, state, now + expected - Nanos::from_nanos(1), cost).allowed(), "1 ns early must deny");
        assert!(probe(window, state, now + expected, cost).allowed(), "on time must admit");
    }

    #[test]
    fn weighted_burst_then_the_previous_window_fades_out() {
        let window = SlidingWindow::weighted(10, SECOND.times(10));
        let mut state = window.fresh(T0);
        assert_eq!(admitted(&window, &mut state, T0, 1, 15), 10);
        // Same window: nothing more until the next window, where the 10 weigh
        // fully at its start, then one unit leaves per second.
        assert_retry_exact(&window, state, T0, 1, SECOND.times(11));
        let next = T0 + SECOND.times(10);
        assert_eq!(probe(&window, state, next, 1).remaining, 0);
        let later = T0 + SECOND.times(13) + Nanos::from_millis(500);
        // ⌈10 · 6.5 / 10⌉ = 7 counted: 3 fit, and the next frees at 14 s.
        let decision = probe(&window, state, later, 3);
        assert!(decision.allowed());
        assert_eq!(decision.remaining, 0);
        assert_eq!(decision.reset, Nanos::from_millis(500));
        assert_retry_exact(&window, state, later, 4, Nanos::from_millis(500));
        assert!(window.is_idle(state, T0 + SECOND.times(20)));
        assert!(!window.is_idle(state, T0 + SECOND.times(20) - Nanos::from_nanos(1)));
    }

    #[test]
    fn weighted_retry_after_is_exact_for_larger_costs() {
        let window = SlidingWindow::weighted(7, SECOND.times(10));
        let mut state = window.fresh(T0 + SECOND.times(2));
        assert_eq!(admitted(&window, &mut state, T0 + SECOND.times(2), 3, 1), 1);
        assert_eq!(admitted(&window, &mut state, T0 + SECOND.times(9), 3, 1), 1);
        // 6 counted now; 4 more fit only once ⌈6·(10 − x)/10⌉ ≤ 3 in the next
        // window: x ≥ 5 s.
        assert_retry_exact(&window, state, T0 + SECOND.times(9), 4, SECOND.times(6));
        // A whole limit waits for the previous count to leave completely.
        assert_retry_exact(&window, state, T0 + SECOND.times(9), 7, SECOND.times(11));
        assert_eq!(probe(&window, state, T0, 8).retry_after(), Nanos::NEVER);
    }

    #[test]
    fn weighted_bound_is_reached_by_bursts_either_side_of_a_boundary() {
        let limit = 10;
        let period = SECOND.times(10);
        let window = SlidingWindow::weighted(limit, period);
        let end = T0 + period - Nanos::from_nanos(1);
        let mut state = window.fresh(end);
        assert_eq!(admitted(&window, &mut state, end, 1, 20), 10);
        // Half a period later (4.999999999 s into the next window) half the
        // previous window still weighs: 4 fit; the interval [end, later] is
        // 5 s long.
        let later = end + period.halved();
        assert_eq!(admitted(&window, &mut state, later, 1, 20), 4);
        assert_eq!(window.admitted_bound(later - end), 14);
        assert_eq!(window.admitted_bound(period), 2 * limit - 1);
        assert_eq!(window.admitted_bound(Nanos::ZERO), limit);
    }

    #[test]
    fn sub_windows_slide_one_counter_at_a_time() {
        let window = SlidingWindow::with_sub_windows(6, SECOND.times(6), 3); // 2 s counters
        let mut state = window.fresh(T0);
        assert_eq!(admitted(&window, &mut state, T0, 2, 1), 1);
        assert_eq!(admitted(&window, &mut state, T0 + SECOND.times(2), 1, 1), 1);
        assert_eq!(admitted(&window, &mut state, T0 + SECOND.times(5), 3, 2), 1);
        // 2 + 1 + 3 counted. One unit: at 6 s the first counter (2) leaves.
        assert_retry_exact(&window, state, T0 + SECOND.times(5), 1, SECOND);
        // Three units: the second counter (1) must leave too, at 8 s.
        assert_retry_exact(&window, state, T0 + SECOND.times(5), 3, SECOND.times(3));
        // Four: the newest (3) too, at 10 s.
        assert_retry_exact(&window, state, T0 + SECOND.times(5), 4, SECOND.times(5));
        let denied = probe(&window, state, T0 + SECOND.times(5), 1);
        assert_eq!((denied.remaining, denied.reset), (0, SECOND));
        assert!(!window.is_idle(state, T0 + SECOND.times(9) + Nanos::from_nanos(999_999_999)));
        assert!(window.is_idle(state, T0 + SECOND.times(10)));
    }

    #[test]
    fn sub_windows_admit_twice_the_limit_only_across_a_whole_period() {
        let window = SlidingWindow::with_sub_windows(5, SECOND.times(10), 5); // 2 s counters
        let first = T0 + SECOND.times(2) - Nanos::from_nanos(1);
        let mut state = window.fresh(first);
        assert_eq!(admitted(&window, &mut state, first, 1, 9), 5);
        // Everything until the counter N − 1 later is denied...
        assert!(!probe(&window, state, T0 + SECOND.times(10) - Nanos::from_nanos(1), 1).allowed());
        // ...and then a second burst: 10 in an interval of 8 s + 1 ns.
        let second = T0 + SECOND.times(10);
        assert_eq!(admitted(&window, &mut state, second, 1, 9), 5);
        assert_eq!(window.admitted_bound(second - first - Nanos::from_nanos(1)), 5, "(N − 1)·S");
        assert_eq!(window.admitted_bound(second - first), 10);
        assert_eq!(window.admitted_bound(SECOND.times(10)), 10);
    }

    #[test]
    fn a_period_that_does_not_divide_rounds_the_sub_window_up() {
        let window = SlidingWindow::with_sub_windows(1, SECOND.times(7), 60);
        assert_eq!(window.span, Nanos::from_nanos(116_666_667));
        let start = Nanos::from_nanos(116_666_667 * 10_000_000_000); // a sub-window starts here
        let (_, state) = window.decide(window.fresh(start), start, 1);
        // Blocked for 60 whole sub-windows: never less than the period.
        assert_retry_exact(&window, state, start, 1, Nanos::from_nanos(116_666_667 * 60));
        assert!(Nanos::from_nanos(116_666_667 * 60) >= SECOND.times(7));
    }

    #[test]
    fn undo_only_into_the_counter_the_units_came_from() {
        for window in
            [SlidingWindow::weighted(10, SECOND.times(10)), SlidingWindow::with_sub_windows(10, SECOND.times(10), 5)]
        {
            let (_, state) = window.decide(window.fresh(T0), T0, 3);
            let (_, state) = window.decide(state, T0 + SECOND.times(3), 4);
            let grant = Grant { cost: 4, at: T0 + SECOND.times(3) };
            let undone = window.release(state, T0 + SECOND.times(3), grant, Release::Undo).unwrap();
            assert_eq!(probe(&window, undone, T0 + SECOND.times(3), 1).remaining, 6);
            assert_eq!(window.release(state, T0 + SECOND.times(3), grant, Release::Done), None);
            let never_taken = Grant { cost: 1, at: T0 + SECOND.times(15) };
            assert_eq!(window.release(state, T0 + SECOND.times(15), never_taken, Release::Undo), None);
            let long_gone = Grant { cost: 1, at: T0 };
            assert_eq!(window.release(state, T0 + SECOND.times(30), long_gone, Release::Undo), None);
        }
    }

    #[test]
    fn a_clock_step_back_keeps_the_counts_and_a_far_future_is_forgotten() {
        let window = SlidingWindow::weighted(2, SECOND.times(10));
        let later = T0 + SECOND.times(10);
        let (_, state) = window.decide(window.fresh(later), later, 2);
        let back = T0 + SECOND.times(9);
        let denied = probe(&window, state, back, 1);
        assert!(!denied.allowed());
        // Read from the start of the stored window, 1 s ahead: the 2 units
        // weigh 1 once half the window after it has passed, 16 s from now.
        assert_eq!(denied.retry_after(), SECOND.times(16));
        let far = SlidingState { newest: window.index_of(T0) + 2, counts: [2; MAX_SUB_WINDOWS] };
        assert!(probe(&window, far, T0, 2).allowed());
    }

    #[test]
    fn state_round_trips_through_bytes() {
        let window = SlidingWindow::with_sub_windows(100, SECOND.times(10), 4);
        let (_, state) = window.decide(window.fresh(T0), T0, 7);
        let (_, state) = window.decide(state, T0 + SECOND.times(3), 9);
        let mut bytes = vec![0u8; window.state_len()];
        assert_eq!(bytes.len(), 24);
        window.encode(&state, &mut bytes);
        assert_eq!(window.decode(&bytes), Some(state));
        assert_eq!(window.decode(&bytes[..23]), None);
        assert_eq!(SlidingWindow::weighted(5, SECOND).state_len(), 16);
    }

    #[test]
    fn parses_sub_windows() {
        let build = |json: &str| {
            SlidingWindow::from_params(&mut Params::new("rules[0]", 5, serde_json::from_str(json).unwrap()))
        };
        assert!(build(r#"{"period": "1s"}"#).unwrap().weighted);
        assert_eq!(build(r#"{"period": "1s", "sub_windows": 60}"#).unwrap().slots, 60);
        let error = build(r#"{"period": "1s", "sub_windows": 61}"#).unwrap_err();
        assert_eq!(error.field, "rules[0].sub_windows");
        assert_eq!(error.message, "must be between 2 and 60, got 61");
    }

    #[test]
    fn units_count_in_the_newest_counter_until_it_ends() {
        let at = T0 + SECOND.times(4);
        let weighted = SlidingWindow::weighted(10, SECOND.times(10));
        let counted = weighted.counting_window(&weighted.fresh(at), at);
        assert_eq!(
            counted,
            Some(CountingWindow { index: at / SECOND.times(10), end: T0 + SECOND.times(10), renews: false })
        );
        let sub = SlidingWindow::with_sub_windows(10, SECOND.times(10), 5);
        let counted = sub.counting_window(&sub.fresh(at), at);
        assert_eq!(counted.map(|w| (w.index, w.end)), Some((at / SECOND.times(2), T0 + SECOND.times(6))));
    }
}
