//! Units of the next counting window taken before it starts: what a lease
//! ahead takes from a bucket, and how a bucket holding such a *booking*
//! decides until that window starts. The quota service keeps the booking
//! beside the bucket's state (see `docs/protocol.md`, "Leases ahead"); the
//! filter's own buckets never hold one.
//!
//! Only an algorithm that counts in windows ([`Policy::counting_window`]:
//! fixed windows, sliding windows and their sub-windows) can be booked
//! ahead, and only its next window: the one starting where the window that
//! counts now ends. Booked units are spent in that window and nowhere else
//! (a lease ahead starts with it and ends with it), so they are counted
//! there. The rule:
//!
//! 1. **A booking takes what the bucket admits at the window's start**, as
//!    the bucket stands now with everything booked before it: the
//!    algorithm's own decision at that instant.
//! 2. **While it is pending, every decision now must leave it admissible
//!    at the window's start.** For a fixed window this always holds: its
//!    window renews ([`CountingWindow::renews`]), nothing counted now counts
//!    then, and the two windows' budgets are independent. For a sliding
//!    window it is a real constraint: what is counted now still weighs in
//!    full at the next window's start (the weighted estimate there is the
//!    whole current count; the last `N` sub-windows there include the
//!    current one), so the rest of the current window and the booking share
//!    one limit. A unit booked ahead is a unit the current window can no
//!    longer admit, and a check may be denied because of a booking.
//! 3. **Once the window starts, the booking is counted in it** as units
//!    taken at its start ([`Policy::count`], even over a limit a reload has
//!    lowered since: those units were granted and will be spent), and the
//!    bucket decides as one without bookings.
//!
//! # Why the algorithms' bounds still hold
//!
//! Booked units are counted at the start of their window and spent within
//! it, so "spent by instant `t`" is at most "counted by `t`" in every window,
//! and each admission's check (rule 2), and the booking's own (rule 1), held
//! with everything counted before it. That is all the proofs of the bounds
//! use (see `algorithm/sliding_window.rs`): for the weighted estimate, every
//! unit counted in window `k + 1` by offset `g` satisfies
//! `count ≤ L − ⌈a·(P − g)/P⌉` with `a` the final count of window `k`, since
//! the booking was admissible at offset 0 with that final count (rule 2 kept
//! it so until `k` ended) and the weight only falls with the offset; for
//! sub-windows, any `N` consecutive counters sum to at most `L`, checked by
//! their last counting event, a booking's included. `tests/booking.rs`
//! holds every algorithm with a counting window to its stated bound under
//! random checks, bookings and returns, booked units spent at random
//! instants of their window.

use crate::algorithm::{CountingWindow, Decision, Policy};
use crate::time::Nanos;

/// Units counted in the window that starts at `starts`, taken before it
/// started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Booking {
    /// When the window the units are counted in starts.
    pub starts: Nanos,
    /// The units.
    pub units: u64,
}

/// The next window of a bucket at `now`, for a booking: when it starts, the
/// window, and what it still admits at its start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ahead {
    /// When it starts: the end of the window that counts now.
    pub starts: Nanos,
    /// The window itself (its index and end).
    pub window: CountingWindow,
    /// Units a booking may still take (rule 1).
    pub room: u64,
}

/// The pending part of `booking` at `now`, after counting it into `state`
/// if its window has started (rule 3). Call it before anything else on a
/// bucket read from storage.
pub fn settle(policy: &dyn Policy, state: &mut [u8], booking: Option<Booking>, now: Nanos) -> Option<Booking> {
    let booking = booking.filter(|b| b.units > 0)?;
    if now < booking.starts {
        return Some(booking);
    }
    policy.count(state, booking.starts, booking.units);
    None
}

/// Whether units counted now still count at the next window's start
/// (a sliding window), so they share its room with a booking.
fn shares_room(policy: &dyn Policy, state: &[u8], now: Nanos) -> bool {
    policy.counting_window(state, now).is_some_and(|w| !w.renews)
}

/// What the window starting at `booking.starts` admits there, with `state`
/// as it is and the booking counted: `None` when it no longer fits.
fn at_start(policy: &dyn Policy, state: &[u8], booking: Booking) -> Option<Decision> {
    let mut probe = state.to_vec();
    Some(policy.decide(&mut probe, booking.starts, booking.units)).filter(Decision::allowed)
}

/// Decides `cost` units at `now` on a bucket holding `booking` (pending:
/// [`settle`]d at `now`), writing the state back when admitted: the
/// algorithm's decision, unless the booking would no longer fit at its
/// window's start (rule 2). `remaining` is what both allow; a denial's
/// `retry_after` is exact, as the algorithm's own.
pub fn decide(policy: &dyn Policy, state: &mut [u8], booking: Option<Booking>, now: Nanos, cost: u64) -> Decision {
    let Some(booking) = booking.filter(|b| b.units > 0 && now < b.starts) else {
        return policy.decide(state, now, cost);
    };
    let mut after = state.to_vec();
    let decision = policy.decide(&mut after, now, cost);
    // `cost` counted now, admitted or not: whether the booking fits then.
    let mut with_cost = state.to_vec();
    policy.count(&mut with_cost, now, cost);
    let fits = at_start(policy, &with_cost, booking).is_some();
    if decision.allowed() && fits {
        state.copy_from_slice(&after);
        return Decision { remaining: room_now(policy, state, booking, now, decision.remaining), ..decision };
    }
    let remaining = room_now(policy, state, booking, now, policy.decide(&mut state.to_vec(), now, 0).remaining);
    let retry_after = if fits && now + decision.retry_after() < booking.starts {
        // Only the algorithm denies, and the booking still fits once it admits.
        decision.retry_after()
    } else {
        // Not before the booked window starts; from then on, the algorithm
        // decides with the booking counted.
        let mut settled = state.to_vec();
        policy.count(&mut settled, booking.starts, booking.units);
        let then = policy.decide(&mut settled, booking.starts, cost).retry_after();
        (booking.starts - now) + then
    };
    Decision::deny(remaining, decision.reset, retry_after)
}

/// `remaining` now (the algorithm's) reduced to what the booking leaves,
/// when units counted now share the next window's room.
fn room_now(policy: &dyn Policy, state: &[u8], booking: Booking, now: Nanos, remaining: u64) -> u64 {
    if !shares_room(policy, state, now) {
        return remaining;
    }
    remaining.min(at_start(policy, state, booking).map_or(0, |d| d.remaining))
}

/// The next window at `now` and its room for a booking, given what `booking`
/// already holds; `None` when the algorithm does not count in windows, or a
/// pending booking is of another window (the clock stepped back across a
/// window's start).
pub fn ahead(policy: &dyn Policy, state: &[u8], booking: Option<Booking>, now: Nanos) -> Option<Ahead> {
    let current = policy.counting_window(state, now)?;
    let starts = current.end;
    let window = policy.counting_window(state, starts)?;
    let booked = match booking.filter(|b| b.units > 0) {
        Some(b) if b.starts != starts => return None,
        Some(b) => b.units,
        None => 0,
    };
    let room = at_start(policy, state, Booking { starts, units: booked }).map_or(0, |d| d.remaining);
    Some(Ahead { starts, window, room })
}

/// Books `units` more of the window [`ahead`] found (rule 1); the booking
/// after, or `None` when they do not fit.
pub fn book(policy: &dyn Policy, state: &[u8], booking: Option<Booking>, ahead: &Ahead, units: u64) -> Option<Booking> {
    let booked = booking.filter(|b| b.starts == ahead.starts).map_or(0, |b| b.units);
    let after = Booking { starts: ahead.starts, units: booked.checked_add(units)? };
    at_start(policy, state, after).map(|_| after)
}

/// Takes up to `units` of the booking for the window starting at `starts`
/// back (a lease ahead returned before its window started): the booking
/// after, and how many were taken back.
pub fn unbook(booking: Option<Booking>, starts: Nanos, units: u64) -> (Option<Booking>, u64) {
    match booking {
        Some(b) if b.starts == starts => {
            let back = units.min(b.units);
            let left = b.units - back;
            ((left > 0).then_some(Booking { units: left, ..b }), back)
        }
        other => (other, 0),
    }
}

/// When the bucket, left alone, is idle for good: the algorithm's
/// [`Policy::idle_at`], and with a booking pending, no earlier than when
/// the booked units stop counting.
pub fn idle_at(policy: &dyn Policy, state: &[u8], booking: Option<Booking>, now: Nanos) -> Nanos {
    let idle = policy.idle_at(state, now);
    match booking.filter(|b| b.units > 0 && now < b.starts) {
        Some(b) => {
            let mut settled = state.to_vec();
            policy.count(&mut settled, b.starts, b.units);
            idle.max(policy.idle_at(&settled, b.starts))
        }
        None => idle,
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{fresh, policy};
    use super::*;
    use crate::time::SECOND;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const T0: Nanos = Nanos::from_secs(1_700_000_000);
    const MS: Nanos = Nanos::from_nanos(1_000_000);

    #[test]
    fn a_fixed_windows_next_window_is_booked_independently_of_the_current_one() {
        let window = policy("fixed_window", 10, r#"{"period": "1s"}"#);
        let now = T0 + MS.times(800);
        let mut state = fresh(window.as_ref(), now);
        assert!(window.decide(&mut state, now, 9).allowed());
        let ahead = ahead(window.as_ref(), &state, None, now).unwrap();
        assert_eq!((ahead.starts, ahead.window.index, ahead.room), (T0 + SECOND, T0 / SECOND + 1, 10));
        let booking = book(window.as_ref(), &state, None, &ahead, 10);
        assert_eq!(booking, Some(Booking { starts: T0 + SECOND, units: 10 }));
        assert_eq!(book(window.as_ref(), &state, booking, &ahead, 1), None, "the next window is full");
        // The current window keeps its own last unit, and reports it.
        let d = decide(window.as_ref(), &mut state, booking, now, 0);
        assert_eq!(d.remaining, 1);
        assert!(decide(window.as_ref(), &mut state, booking, now, 1).allowed());
        assert!(!decide(window.as_ref(), &mut state, booking, now, 1).allowed());
        // At its start the booking is counted there: the next window is full.
        let later = T0 + SECOND;
        assert_eq!(settle(window.as_ref(), &mut state, booking, later), None);
        let denied = window.decide(&mut state, later, 1);
        assert_eq!((denied.allowed(), denied.retry_after()), (false, SECOND));
    }

    #[test]
    fn a_sliding_windows_booking_and_current_window_share_the_limit() {
        for fields in [r#"{"period": "1s"}"#, r#"{"period": "1s", "sub_windows": 4}"#] {
            let sliding = policy("sliding_window", 10, fields);
            let sliding = sliding.as_ref();
            let now = T0 + MS.times(900);
            let mut state = fresh(sliding, now);
            assert!(sliding.decide(&mut state, now, 6).allowed());
            let ahead = ahead(sliding, &state, None, now).unwrap();
            assert_eq!(ahead.room, 4, "{fields}: the 6 counted now still weigh in full at the next start");
            let booking = book(sliding, &state, None, &ahead, 3);
            assert!(booking.is_some());
            // One unit left for the rest of this window, not four.
            assert_eq!(decide(sliding, &mut state, booking, now, 0).remaining, 1, "{fields}");
            assert!(decide(sliding, &mut state, booking, now, 1).allowed());
            let denied = decide(sliding, &mut state, booking, now + MS, 1);
            assert!(!denied.allowed(), "{fields}: the booking holds the rest");
            // Exact: from the next start the booking is counted, and the
            // algorithm says when a unit frees up.
            let mut settled = state.clone();
            assert_eq!(settle(sliding, &mut settled, booking, ahead.starts), None);
            let retry = ahead.starts - (now + MS) + sliding.decide(&mut settled.clone(), ahead.starts, 1).retry_after();
            assert_eq!(denied.retry_after(), retry, "{fields}");
            assert!(sliding.decide(&mut settled, now + MS + retry, 1).allowed(), "{fields}");
        }
    }

    #[test]
    fn a_return_before_the_window_starts_unbooks() {
        let booking = Some(Booking { starts: T0, units: 5 });
        assert_eq!(unbook(booking, T0, 3), (Some(Booking { starts: T0, units: 2 }), 3));
        assert_eq!(unbook(booking, T0, 9), (None, 5));
        assert_eq!(unbook(booking, T0 + SECOND, 3), (booking, 0), "another window's booking");
    }

    #[test]
    fn a_booking_counts_even_over_a_limit_lowered_since() {
        let before = policy("fixed_window", 10, r#"{"period": "1s"}"#);
        let now = T0 + MS.times(900);
        let state = fresh(before.as_ref(), now);
        let ahead = ahead(before.as_ref(), &state, None, now).unwrap();
        let booking = book(before.as_ref(), &state, None, &ahead, 8);
        let after = policy("fixed_window", 5, r#"{"period": "1s"}"#);
        let mut state = state;
        settle(after.as_ref(), &mut state, booking, T0 + SECOND);
        assert_eq!(after.decide(&mut state, T0 + SECOND, 0).remaining, 0, "the 8 count, though 5 is the limit now");
    }

    #[test]
    fn a_bucket_with_a_booking_is_kept_until_the_booked_units_stop_counting() {
        let window = policy("fixed_window", 10, r#"{"period": "1s"}"#);
        let now = T0 + MS.times(900);
        let state = fresh(window.as_ref(), now);
        assert_eq!(idle_at(window.as_ref(), &state, None, now), now);
        let booking = Some(Booking { starts: T0 + SECOND, units: 1 });
        assert_eq!(idle_at(window.as_ref(), &state, booking, now), T0 + SECOND.times(2));
        // Algorithms without counting windows are never booked.
        let bucket = policy("token_bucket", 10, r#"{"period": "1s"}"#);
        assert_eq!(ahead(bucket.as_ref(), &fresh(bucket.as_ref(), now), None, now), None);
    }
}
