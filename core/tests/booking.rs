//! Property tests of leases ahead (`floodgate_core::lease::booking`): for every
//! algorithm that counts in windows, random checks now, bookings of the next
//! window (whose units are then spent in bursts anywhere in that window) and
//! returns of bookings before their window starts never admit more in any
//! interval than the algorithm's stated bound; a fixed window's budgets stay
//! its limit per window; and a decision's `retry_after` stays exact.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use floodgate_core::algorithm::{Params, Policy, Registration, ALGORITHMS};
use floodgate_core::lease::booking::{self, Booking};
use floodgate_core::time::{Nanos, SECOND};
use proptest::prelude::*;

const T0: Nanos = Nanos::from_nanos(1_700_000_000 * SECOND.get());

/// What a step does after `gap` ns.
#[derive(Debug, Clone, Copy)]
enum Step {
    /// A check of `cost` units now.
    Check(u64),
    /// A lease ahead of up to `units` of the next window, spent at a point
    /// of that window (`at` in thousandths of it: 0 its first instant, 1000
    /// its last).
    Book { units: u64, at: u64 },
    /// A return of up to `units` of the latest lease ahead, if its window
    /// has not started.
    Return(u64),
}

fn steps(span: Nanos) -> impl Strategy<Value = Vec<(Nanos, Step)>> {
    let step = prop_oneof![
        3 => (1u64..5).prop_map(Step::Check),
        2 => (1u64..12, prop_oneof![Just(0u64), Just(1000), 0u64..1000]).prop_map(|(units, at)| Step::Book { units, at }),
        1 => (1u64..6).prop_map(Step::Return),
    ];
    prop::collection::vec((0..span.get() / 3, step), 1..150)
        .prop_map(|v| v.into_iter().map(|(gap, s)| (Nanos::from_nanos(gap), s)).collect())
}

/// A fixed window, a weighted sliding window, or one with sub-windows.
fn windowed() -> impl Strategy<Value = (String, Arc<dyn Policy>)> {
    let period = prop_oneof![Just("1s"), Just("7s"), Just("10s")];
    (0..3usize, 1u64..30, period, 2u64..7).prop_map(|(kind, limit, period, n)| {
        let (name, fields) = match kind {
            0 => ("fixed_window", format!(r#"{{"period": "{period}"}}"#)),
            1 => ("sliding_window", format!(r#"{{"period": "{period}"}}"#)),
            _ => ("sliding_window", format!(r#"{{"period": "{period}", "sub_windows": {n}}}"#)),
        };
        let policy =
            Registration::find(name).unwrap().build(Params::new("rule", limit, serde_json::from_str(&fields).unwrap()));
        (format!("{name} {limit} {fields}"), policy.unwrap())
    })
}

/// A bucket with its booking, as the quota service keeps it, and what it
/// let through: (instant spent, units).
struct Bucket {
    policy: Arc<dyn Policy>,
    state: Vec<u8>,
    booking: Option<Booking>,
    spent: Vec<(Nanos, u64)>,
    /// Leases ahead: (window start, index into `spent` of their units).
    ahead: Vec<(Nanos, usize)>,
}

impl Bucket {
    fn new(policy: Arc<dyn Policy>) -> Self {
        let mut state = vec![0; policy.state_len()];
        policy.write_fresh(&mut state, T0);
        Bucket { policy, state, booking: None, spent: Vec::new(), ahead: Vec::new() }
    }

    /// A fresh bucket at T0 after `steps`, each a gap (under a third of a
    /// window) and a step; and the instant of the last.
    fn driven(policy: Arc<dyn Policy>, steps: Vec<(Nanos, Step)>) -> (Self, Nanos) {
        let period = policy.quota().window.unwrap_or(SECOND);
        let mut bucket = Bucket::new(policy);
        let mut now = T0;
        for (gap, step) in steps {
            now += Nanos::from_nanos(gap.get() % (period.get() / 3).max(1));
            bucket.step(now, step);
        }
        (bucket, now)
    }

    fn step(&mut self, now: Nanos, step: Step) {
        let policy = self.policy.as_ref();
        self.booking = booking::settle(policy, &mut self.state, self.booking, now);
        match step {
            Step::Check(cost) => {
                if booking::decide(policy, &mut self.state, self.booking, now, cost).allowed() {
                    self.spent.push((now, cost));
                }
            }
            Step::Book { units, at } => {
                let Some(ahead) = booking::ahead(policy, &self.state, self.booking, now) else { return };
                let units = units.min(ahead.room);
                if units == 0 {
                    return;
                }
                let after = booking::book(policy, &self.state, self.booking, &ahead, units);
                assert!(after.is_some(), "a booking within the room fits");
                self.booking = after;
                // Spent within the window it is for: from its start to its last instant.
                let last = ahead.window.end - Nanos::from_nanos(1);
                let at = ahead.starts
                    + Nanos::from_nanos(((last - ahead.starts).get() as u128 * u128::from(at) / 1000) as u64);
                self.ahead.push((ahead.starts, self.spent.len()));
                self.spent.push((at, units));
            }
            Step::Return(units) => {
                let Some(&(starts, index)) = self.ahead.last() else { return };
                if now >= starts {
                    return;
                }
                let (after, back) = booking::unbook(self.booking, starts, units.min(self.spent[index].1));
                self.booking = after;
                self.spent[index].1 -= back;
            }
        }
    }
}

/// The most units spent in any `[s, s + span]`.
fn most_in_any(spent: &[(Nanos, u64)], span: Nanos) -> u64 {
    spent
        .iter()
        .map(|&(start, _)| spent.iter().filter(|(t, _)| *t >= start && *t <= start + span).map(|(_, u)| u).sum())
        .max()
        .unwrap_or(0)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn leases_ahead_keep_every_windowed_algorithm_within_its_bound(
        (name, policy) in windowed(),
        steps in steps(SECOND.times(4)),
    ) {
        let period = policy.quota().window.unwrap();
        let (bucket, _) = Bucket::driven(policy.clone(), steps);
        let spent: Vec<(Nanos, u64)> = bucket.spent.iter().copied().filter(|(_, u)| *u > 0).collect();
        for span in [Nanos::ZERO, period - Nanos::from_nanos(1), Nanos::from_nanos(period.get() / 2), period, period.times(3)] {
            let (most, bound) = (most_in_any(&spent, span), policy.admitted_bound(span));
            prop_assert!(most <= bound, "{name}: {most} spent within {span} > {bound}: {spent:?}");
        }
    }

    /// A fixed window's windows are independent: each window's checks and
    /// leases ahead together stay within its limit, and the current
    /// window's checks are decided exactly as without any booking (only a
    /// denial's `retry_after` may reach further: the next window's budget
    /// is partly booked already).
    #[test]
    fn a_fixed_windows_bookings_never_touch_the_current_window(
        limit in 1u64..30,
        steps in steps(SECOND),
    ) {
        let fields = serde_json::from_str(r#"{"period": "1s"}"#).unwrap();
        let policy = Registration::find("fixed_window").unwrap().build(Params::new("rule", limit, fields)).unwrap();
        let mut bucket = Bucket::new(policy.clone());
        let mut now = T0;
        for (gap, step) in steps {
            now += gap;
            if let Step::Check(cost) = step {
                let mut settled = bucket.state.clone();
                let pending = booking::settle(policy.as_ref(), &mut settled, bucket.booking, now);
                if pending.is_some() {
                    // Nothing of the next window shows in this one's decisions.
                    let with = booking::decide(policy.as_ref(), &mut settled.clone(), pending, now, cost);
                    let without = policy.decide(&mut settled.clone(), now, cost);
                    prop_assert_eq!((with.allowed(), with.remaining, with.reset), (without.allowed(), without.remaining, without.reset));
                    prop_assert!(with.retry_after() >= without.retry_after());
                }
            }
            bucket.step(now, step);
        }
        let mut per_window = std::collections::BTreeMap::<u64, u64>::new();
        for (t, units) in &bucket.spent {
            *per_window.entry(t.get() / SECOND.get()).or_default() += units;
        }
        for (window, used) in per_window {
            prop_assert!(used <= limit, "window {window}: {used} > {limit}");
        }
    }

    #[test]
    fn retry_after_stays_exact_with_a_booking(
        (name, policy) in windowed(),
        steps in steps(SECOND.times(4)),
        cost in 1u64..4,
    ) {
        let period = policy.quota().window.unwrap();
        let cost = cost.min(policy.capacity());
        let mut bucket = Bucket::new(policy.clone());
        let mut now = T0;
        // What a check of `cost` would get at `t`, the bucket left as it is.
        let probe = |bucket: &Bucket, t: Nanos| {
            let mut state = bucket.state.clone();
            let pending = booking::settle(policy.as_ref(), &mut state, bucket.booking, t);
            booking::decide(policy.as_ref(), &mut state, pending, t, cost)
        };
        for (gap, step) in steps {
            now += Nanos::from_nanos(gap.get() % (period.get() / 3).max(1));
            bucket.step(now, step);
            let decision = probe(&bucket, now);
            if decision.allowed() {
                continue;
            }
            let wait = decision.retry_after();
            prop_assert!(wait > Nanos::ZERO && wait < Nanos::NEVER, "{name}: {decision:?}");
            prop_assert!(!probe(&bucket, now + wait - Nanos::from_nanos(1)).allowed(), "{name}: admitted 1 ns before retry_after");
            prop_assert!(probe(&bucket, now + wait).allowed(), "{name}: denied at retry_after");
        }
    }

    /// A booking never makes a bucket forget units too early: until
    /// `idle_at`, a bucket holding one is not a fresh one.
    #[test]
    fn a_bucket_holding_a_booking_lives_until_its_units_stop_counting(
        (name, policy) in windowed(),
        steps in steps(SECOND.times(4)),
    ) {
        let (bucket, now) = Bucket::driven(policy.clone(), steps);
        let Some(pending) = bucket.booking else { return Ok(()) };
        let idle_at = booking::idle_at(policy.as_ref(), &bucket.state, bucket.booking, now);
        let mut settled = bucket.state.clone();
        booking::settle(policy.as_ref(), &mut settled, Some(pending), idle_at - Nanos::from_nanos(1));
        prop_assert!(!policy.is_idle(&settled, idle_at - Nanos::from_nanos(1)), "{name}: idle before idle_at");
        prop_assert!(policy.is_idle(&settled, idle_at), "{name}: not idle at idle_at");
    }
}

/// Only the algorithms that count in windows can be booked ahead.
#[test]
fn only_windowed_algorithms_are_booked() {
    for registration in ALGORITHMS {
        let policy = registration.build_example(5).unwrap();
        let mut state = vec![0; policy.state_len()];
        policy.write_fresh(&mut state, T0);
        let windowed = policy.counting_window(&state, T0).is_some();
        assert_eq!(booking::ahead(policy.as_ref(), &state, None, T0).is_some(), windowed, "{}", registration.name);
    }
}
