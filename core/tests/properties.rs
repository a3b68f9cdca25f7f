//! Property tests of every registered algorithm and of the bucket table: for
//! arbitrary arrival sequences and costs, no interval admits more than the
//! algorithm's stated bound, `retry_after` is exact (never early, never
//! late), an idle bucket decides like a fresh one, undoing a take is
//! invisible, and the bounded table behaves exactly like one independent
//! bucket per key. Algorithms are taken from the registry, so a new one is
//! covered without touching this file. Some algorithms make promises of their
//! own, checked at the end: the shaper paces, concurrency never exceeds its
//! limit and never leaks a slot, warm-up never beats the plain token bucket.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::sync::Arc;

use floodgate_core::algorithm::{
    Admission, Concurrency, Decision, Grant, Params, Policy, Registration, Release, TokenBucket, WarmUp, ALGORITHMS,
};
use floodgate_core::store::Step;
use floodgate_core::table::{Slot, Table, WAYS};
use floodgate_core::time::{Nanos, SECOND};
use proptest::prelude::*;

const T0: Nanos = Nanos::from_nanos(1_700_000_000 * SECOND.get());

/// A registered algorithm built from its example, with `limit` and, where it
/// has one, `period` replaced.
fn build(registration: &Registration, limit: u64, period: &str) -> Arc<dyn Policy> {
    let mut fields: serde_json::Map<String, serde_json::Value> = serde_json::from_str(registration.example).unwrap();
    if fields.contains_key("period") {
        fields.insert("period".into(), period.into());
    }
    registration.build(Params::new("rule", limit, fields)).unwrap()
}

/// A registered algorithm and a configured instance of it.
type Case = (&'static Registration, Arc<dyn Policy>);

/// Any registered algorithm with a limit and a period.
fn policies() -> impl Strategy<Value = Case> {
    (0..ALGORITHMS.len(), 1u64..20, prop_oneof![Just("1s"), Just("10s"), Just("7s")]).prop_map(
        |(index, limit, period)| {
            let registration = &ALGORITHMS[index];
            (registration, build(registration, limit, period))
        },
    )
}

/// The span the algorithm's window (or a default) sets the pace of.
fn span_of(policy: &dyn Policy) -> Nanos {
    policy.quota().window.unwrap_or(SECOND.times(10))
}

/// Gaps between arrivals (up to a fifth of `span`) and costs.
fn arrivals(span: Nanos, max_cost: u64) -> impl Strategy<Value = Vec<(Nanos, u64)>> {
    prop::collection::vec((0..span.get() / 5, 1..=max_cost.max(1)), 1..200)
        .prop_map(|v| v.into_iter().map(|(gap, cost)| (Nanos::from_nanos(gap), cost)).collect())
}

fn policies_with_arrivals() -> impl Strategy<Value = (Case, Vec<(Nanos, u64)>)> {
    policies().prop_flat_map(|p| {
        let (span, capacity) = (span_of(p.1.as_ref()), p.1.capacity());
        (Just(p), arrivals(span, capacity))
    })
}

/// A fresh bucket after every arrival was decided on it, and the time of the last.
fn settle(policy: &dyn Policy, arrivals: &[(Nanos, u64)]) -> (Vec<u8>, Nanos) {
    let mut slot = vec![0u8; policy.state_len()];
    let mut now = T0;
    policy.write_fresh(&mut slot, now);
    for &(gap, cost) in arrivals {
        now += gap;
        policy.decide(&mut slot, now, cost);
    }
    (slot, now)
}

/// Decides every arrival on one bucket: (time, cost, decision).
fn run(policy: &dyn Policy, arrivals: &[(Nanos, u64)]) -> Vec<(Nanos, u64, Decision)> {
    let mut slot = vec![0u8; policy.state_len()];
    let mut now = T0;
    policy.write_fresh(&mut slot, now);
    arrivals
        .iter()
        .map(|&(gap, cost)| {
            now += gap;
            (now, cost, policy.decide(&mut slot, now, cost))
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn no_interval_admits_more_than_the_stated_bound(((registration, policy), arrivals) in policies_with_arrivals()) {
        let admitted: Vec<(Nanos, u64)> =
            run(policy.as_ref(), &arrivals).into_iter().filter(|(_, _, d)| d.allowed()).map(|(t, c, _)| (t, c)).collect();
        let period = span_of(policy.as_ref());
        for span in [period - Nanos::from_nanos(1), Nanos::from_nanos(period.get() / 2), period.times(3)] {
            let bound = policy.admitted_bound(span);
            for (i, &(start, _)) in admitted.iter().enumerate() {
                let used: u64 = admitted[i..].iter().take_while(|(t, _)| *t <= start + span).map(|(_, c)| c).sum();
                prop_assert!(used <= bound, "{} admitted {used} > {bound} in [{start}, +{span}]", registration.name);
            }
        }
    }

    #[test]
    fn retry_after_is_exact(
        ((registration, policy), arrivals) in policies_with_arrivals(),
        cost in 1u64..4,
    ) {
        let cost = cost.min(policy.capacity());
        let mut slot = vec![0u8; policy.state_len()];
        let mut now = T0;
        policy.write_fresh(&mut slot, now);
        for (gap, c) in arrivals {
            now += gap;
            policy.decide(&mut slot, now, c);
            let mut probe = slot.clone();
            let decision = policy.decide(&mut probe, now, cost);
            if decision.allowed() {
                prop_assert_eq!(decision.retry_after(), Nanos::ZERO);
                continue;
            }
            let wait = decision.retry_after();
            prop_assert!(wait > Nanos::ZERO && wait < Nanos::NEVER);
            let mut early = slot.clone();
            prop_assert!(!policy.decide(&mut early, now + wait - Nanos::from_nanos(1), cost).allowed(), "{}: admitted 1 ns before retry_after", registration.name);
            let mut on_time = slot.clone();
            prop_assert!(policy.decide(&mut on_time, now + wait, cost).allowed(), "{}: denied at retry_after", registration.name);
        }
    }

    /// What makes reusing idle buckets fair: an idle bucket is a fresh one.
    #[test]
    fn an_idle_bucket_decides_like_a_fresh_one(
        ((registration, policy), arrivals) in policies_with_arrivals(),
        later in 0u64..30 * SECOND.get(),
        cost in 1u64..4,
    ) {
        let cost = cost.min(policy.capacity());
        let (mut slot, now) = settle(policy.as_ref(), &arrivals);
        let at = now + Nanos::from_nanos(later);
        if policy.is_idle(&slot, at) {
            let mut fresh = vec![0u8; policy.state_len()];
            policy.write_fresh(&mut fresh, at);
            prop_assert_eq!(policy.decide(&mut slot, at, cost), policy.decide(&mut fresh, at, cost), "{}", registration.name);
        }
    }

    /// `idle_at` is exactly when a bucket left alone becomes idle, and it
    /// stays idle after: a store expiring keys then never forgets a count.
    #[test]
    fn idle_at_is_the_first_instant_a_bucket_is_idle_for_good(
        ((registration, policy), arrivals) in policies_with_arrivals(),
        later in 0u64..30 * SECOND.get(),
    ) {
        let mut slot = vec![0u8; policy.state_len()];
        let mut now = T0;
        policy.write_fresh(&mut slot, now);
        for (gap, c) in arrivals {
            now += gap;
            policy.decide(&mut slot, now, c);
            let idle_at = policy.idle_at(&slot, now);
            prop_assert!(idle_at >= now, "{}", registration.name);
            prop_assert!(policy.is_idle(&slot, idle_at), "{}: not idle at idle_at", registration.name);
            prop_assert!(policy.is_idle(&slot, idle_at + Nanos::from_nanos(later)), "{}: busy again after idle_at", registration.name);
            if idle_at > now {
                prop_assert!(!policy.is_idle(&slot, idle_at - Nanos::from_nanos(1)), "{}: idle before idle_at", registration.name);
            }
        }
    }

    /// One group of a table, keys from a pool larger than the group: every
    /// decision equals that of a private bucket per key, except when the
    /// group is full — and it is full only when all its entries are live.
    #[test]
    fn the_table_is_a_set_of_independent_buckets(
        (registration, policy) in policies(),
        ops in prop::collection::vec((0u64..9, 0u64..3 * SECOND.get(), 1u64..3), 1..300),
    ) {
        let table = Table::new(Arc::clone(&policy), registration.tag, WAYS as u32);
        let mut group = table.empty_group();
        let mut model: HashMap<u64, Vec<u8>> = HashMap::new();
        let mut now = T0;
        for (key, gap, cost) in ops {
            now += Nanos::from_nanos(gap);
            let fingerprint = 0x9e37_79b9_7f4a_7c15 ^ key;
            let cost = cost.min(policy.capacity());
            let (outcome, write) = match table.decide(group.clone(), fingerprint, now, cost) {
                Step::Write(next, outcome) => (outcome, Some(next)),
                Step::Keep(outcome) => (outcome, None),
            };
            match outcome {
                None => {
                    let live = model
                        .iter()
                        .filter(|(k, state)| **k != fingerprint && !policy.is_idle(state, now))
                        .count();
                    prop_assert!(live >= WAYS, "full with only {live} live buckets");
                    prop_assert!(write.is_none());
                }
                Some(Slot { value: decision, .. }) => {
                    let state = model.entry(fingerprint).or_insert_with(|| {
                        let mut fresh = vec![0u8; policy.state_len()];
                        policy.write_fresh(&mut fresh, now);
                        fresh
                    });
                    let mut next = state.clone();
                    let expected = policy.decide(&mut next, now, cost);
                    prop_assert_eq!(decision, expected);
                    if expected.allowed() {
                        *state = next;
                    }
                    if let Some(next) = write {
                        group = next;
                    }
                }
            }
        }
    }

    /// Units given back later (a lease's return, of
    /// all it was granted or of an unused part; a delayed request whose
    /// client left) never let an interval admit more than the stated bound,
    /// counting only the units not given back (those are never used: a
    /// request that did not go on, tokens a lease did not spend), and a
    /// release never makes more available than it gives back.
    #[test]
    fn undos_at_any_later_time_never_exceed_the_bound(
        (registration, policy) in policies(),
        ops in prop::collection::vec(
            (0u64..4, 0u64..2 * SECOND.get(), 1u64..20, any::<prop::sample::Index>(), any::<prop::sample::Index>()),
            1..200,
        ),
    ) {
        let mut slot = vec![0u8; policy.state_len()];
        let mut now = T0;
        policy.write_fresh(&mut slot, now);
        // Every take: (when, units still counted, undone or returned).
        let mut takes: Vec<(Nanos, u64, bool)> = Vec::new();
        for (op, gap, cost, pick, part) in ops {
            now += Nanos::from_nanos(gap);
            let open: Vec<usize> = (0..takes.len()).filter(|i| !takes[*i].2).collect();
            if op == 0 && !open.is_empty() {
                // An undo of the whole take, or the return of an unused part
                // of it (a lease's): the part used stays admitted.
                let i = open[pick.index(open.len())];
                let (at, taken, _) = takes[i];
                let unused = 1 + part.index(taken as usize) as u64;
                let why = if unused == taken { Release::Undo } else { Release::Return { granted: taken } };
                let before = policy.decide(&mut slot.clone(), now, 0).remaining;
                policy.release(&mut slot, now, Grant { cost: unused, at }, why);
                let back = policy.decide(&mut slot.clone(), now, 0).remaining.saturating_sub(before);
                prop_assert!(back <= unused, "{}: {back} back for {unused} of a take of {taken}", registration.name);
                takes[i] = (at, taken - unused, true);
            } else {
                let cost = cost.min(policy.capacity());
                if policy.decide(&mut slot, now, cost).allowed() {
                    takes.push((now, cost, false));
                }
            }
        }
        let admitted: Vec<(Nanos, u64)> = takes.iter().map(|&(at, units, _)| (at, units)).collect();
        let period = span_of(policy.as_ref());
        for span in [Nanos::from_nanos(0), period - Nanos::from_nanos(1), Nanos::from_nanos(period.get() / 2), period.times(3)] {
            let most = most_in_any(&admitted, span, true);
            let bound = policy.admitted_bound(span);
            prop_assert!(most <= bound, "{} admitted {most} > {bound} within {span}", registration.name);
        }
    }

    /// Taking units and undoing the take is invisible to every later decision.
    #[test]
    fn an_undo_is_invisible(
        ((registration, policy), arrivals) in policies_with_arrivals(),
        cost in 1u64..20,
        later in 0u64..20 * SECOND.get(),
        probe_cost in 1u64..20,
    ) {
        let (cost, probe_cost) = (cost.min(policy.capacity()), probe_cost.min(policy.capacity()));
        let (slot, now) = settle(policy.as_ref(), &arrivals);
        let mut taken = slot.clone();
        if policy.decide(&mut taken, now, cost).allowed() {
            policy.release(&mut taken, now, Grant { cost, at: now }, Release::Undo);
            let (mut a, mut b) = (slot.clone(), taken);
            let probe = now + Nanos::from_nanos(later);
            prop_assert_eq!(policy.decide(&mut a, probe, probe_cost), policy.decide(&mut b, probe, probe_cost), "{}", registration.name);
        }
    }

    #[test]
    fn arbitrary_stored_bytes_never_panic(
        (registration, policy) in policies(),
        stored in prop::collection::vec(any::<u8>(), 0..120),
        fingerprint in any::<u64>(),
        cost in 1u64..5,
        now in any::<u64>(),
    ) {
        let now = Nanos::from_nanos(now);
        let table = Table::new(Arc::clone(&policy), registration.tag, 64);
        let grant = Grant { cost, at: now };
        let _ = table.decide(stored.clone(), fingerprint, now, cost.min(policy.capacity()));
        let _ = table.release(stored.clone(), fingerprint, now, grant, Release::Undo);
        let _ = table.release(stored.clone(), fingerprint, now, grant, Release::Done);
        let mut slot = stored.clone();
        let _ = policy.decide(&mut slot, now, cost);
        let _ = policy.is_idle(&stored, now);
    }

    /// The shaper's promise: what leaves (admission time plus delay) never
    /// exceeds the rate after the burst, and nobody waits past `max_delay`.
    #[test]
    fn the_shaper_paces_its_output_and_bounds_every_wait(
        limit in 1u64..20,
        burst in 1u64..5,
        max_delay_ms in 1u64..5_000,
        arrivals in arrivals(SECOND.times(10), 1),
    ) {
        let shaper = floodgate_core::algorithm::Shaper::new(limit, SECOND.times(10), burst, Nanos::from_millis(max_delay_ms));
        let interval = SECOND.times(10).get().div_ceil(limit);
        let mut departures: Vec<Nanos> = Vec::new();
        for (now, _, decision) in run(&shaper, &arrivals) {
            match decision.admission {
                Admission::Now => departures.push(now),
                Admission::Delayed(delay) => {
                    prop_assert!(delay <= Nanos::from_millis(max_delay_ms));
                    departures.push(now + delay);
                }
                Admission::Denied { .. } | Admission::Pending => {}
            }
        }
        departures.sort();
        for (i, &start) in departures.iter().enumerate() {
            for span in [Nanos::from_nanos(interval - 1), Nanos::from_nanos(interval * 3), SECOND.times(10)] {
                let left = departures[i..].iter().take_while(|t| **t <= start + span).count() as u64;
                prop_assert!(left <= burst + span.get() / interval, "{left} left within {span} of {start}");
            }
        }
    }

    /// Concurrency under random interleavings of acquires, releases (Done and
    /// Undo), lost releases and time passing, against a model of the grants
    /// still out: slots younger than `slot_ttl` are always counted (never
    /// more than `limit` of them), a denial is always justified by slots that
    /// may still be held (none older than the longest hold: no leak), and the
    /// in-flight sum the table reports lies between the two.
    #[test]
    fn concurrency_never_exceeds_the_limit_and_never_leaks(
        limit in 1u64..8,
        slot_ttl_ms in 1u64..20_000,
        ops in prop::collection::vec(
            prop_oneof![
                4 => (1u64..4).prop_map(Op::Acquire),
                2 => any::<usize>().prop_map(Op::Done),
                1 => any::<usize>().prop_map(Op::Undo),
                1 => any::<usize>().prop_map(Op::Lose),
                2 => (0u64..5_000).prop_map(Op::Wait),
            ],
            1..300,
        ),
    ) {
        let slot_ttl = Nanos::from_millis(slot_ttl_ms);
        let concurrency = Concurrency::new(limit, slot_ttl);
        let longest = concurrency.longest_hold();
        prop_assert!(longest > slot_ttl);
        let tag = Registration::find("concurrency").unwrap().tag;
        let table = Table::new(Arc::new(concurrency), tag, WAYS as u32);
        let mut group = table.empty_group();
        let fingerprint = 7;
        let mut now = T0;
        let mut gauge = 0i64;
        // Grants not given back: (taken at, cost, release lost).
        let mut out: Vec<(Nanos, u64, bool)> = Vec::new();
        let sum = |out: &[(Nanos, u64, bool)], alive: &dyn Fn(Nanos) -> bool| -> u64 {
            out.iter().filter(|(at, _, _)| alive(*at)).map(|(_, cost, _)| cost).sum()
        };
        let ops = ops.into_iter().chain([Op::Wait(longest.get() / 1_000_000 + 1), Op::Acquire(1)]);
        for op in ops {
            match op {
                Op::Acquire(cost) => {
                    let cost = cost.min(limit);
                    let (outcome, write) = match table.decide(group.clone(), fingerprint, now, cost) {
                        Step::Write(next, outcome) => (outcome, Some(next)),
                        Step::Keep(outcome) => (outcome, None),
                    };
                    let Some(Slot { value: decision, held_change, .. }) = outcome else {
                        panic!("one key never fills a group")
                    };
                    gauge += held_change;
                    if let Some(next) = write {
                        group = next;
                    }
                    if decision.allowed() {
                        out.push((now, cost, false));
                    } else {
                        let maybe_held = sum(&out, &|at| now < at + longest);
                        prop_assert!(maybe_held + cost > limit, "denied with only {maybe_held} possibly held of {limit}");
                    }
                }
                Op::Done(pick) | Op::Undo(pick) => {
                    let releasable: Vec<usize> = (0..out.len()).filter(|&i| !out[i].2).collect();
                    if let Some(&index) = releasable.get(pick % releasable.len().max(1)) {
                        let (at, cost, _) = out.remove(index);
                        let why = if matches!(op, Op::Done(_)) { Release::Done } else { Release::Undo };
                        if let Step::Write(next, change) = table.release(group.clone(), fingerprint, now, Grant { cost, at }, why) {
                            group = next;
                            gauge += change;
                        }
                    }
                }
                Op::Lose(pick) => {
                    let count = out.len();
                    if count > 0 {
                        out[pick % count].2 = true;
                    }
                }
                Op::Wait(ms) => now += Nanos::from_millis(ms),
            }
            let surely_held = sum(&out, &|at| now < at + slot_ttl);
            prop_assert!(surely_held <= limit, "{surely_held} slots younger than slot_ttl, limit {limit}");
            prop_assert!(gauge >= 0 && (gauge as u64) <= sum(&out, &|_| true), "gauge {gauge}, out {out:?}");
        }
        // The last acquire came after every earlier slot expired: it is all
        // that is held, and all the gauge shows.
        prop_assert_eq!(out.iter().filter(|(at, _, _)| *at == now).count(), 1);
        prop_assert_eq!(gauge, 1);
    }

    /// Warm-up never admits more than the plain token bucket with the same
    /// limit, period and burst, on the same arrivals. With unit costs: at
    /// every point it has admitted at most as many. With any costs a running
    /// total cannot be compared (greedy admission is not monotone: a token
    /// bucket with burst 7 can get ahead of one with burst 8 when the larger
    /// one admits a big request early), so the promise is that what warm-up
    /// admits, replayed alone through the plain token bucket, is all admitted:
    /// it fits the token bucket's envelope.
    #[test]
    fn warm_up_never_admits_more_than_the_plain_token_bucket(
        limit in 1u64..20,
        burst in 1u64..30,
        period in prop_oneof![Just(SECOND), Just(SECOND.times(7)), Just(SECOND.times(10))],
        warmup_ms in 1u64..60_000,
        cold_factor in 2u64..6,
        arrivals in arrivals(SECOND.times(10), 30),
    ) {
        let warm = WarmUp::new(limit, period, burst, Nanos::from_millis(warmup_ms), cold_factor);
        let plain = TokenBucket::new(limit, period, burst);
        let units: Vec<(Nanos, u64)> = arrivals.iter().map(|&(gap, _)| (gap, 1)).collect();
        let (mut warm_count, mut plain_count) = (0, 0);
        for (w, p) in run(&warm, &units).into_iter().zip(run(&plain, &units)) {
            warm_count += u64::from(w.2.allowed());
            plain_count += u64::from(p.2.allowed());
            prop_assert!(warm_count <= plain_count, "warm-up {warm_count} > token bucket {plain_count} at {}", w.0);
        }
        let costs: Vec<(Nanos, u64)> = arrivals.into_iter().map(|(gap, cost)| (gap, cost.min(burst))).collect();
        let mut admitted = Vec::new();
        let mut since_last = Nanos::ZERO;
        for ((gap, _), (_, cost, decision)) in costs.iter().zip(run(&warm, &costs)) {
            since_last += *gap;
            if decision.allowed() {
                admitted.push((since_last, cost));
                since_last = Nanos::ZERO;
            }
        }
        for (at, cost, decision) in run(&plain, &admitted) {
            prop_assert!(decision.allowed(), "the token bucket refuses warm-up's admission of {cost} at {at}");
        }
    }
}

/// A step of the concurrency model.
#[derive(Debug, Clone)]
enum Op {
    /// A request of this cost arrives.
    Acquire(u64),
    /// A request still out ends (the pick modulo those whose release is not lost).
    Done(usize),
    /// A request still out is not served after all.
    Undo(usize),
    /// A request's release will never come (a VM crash, a lost callback).
    Lose(usize),
    /// Milliseconds pass.
    Wait(u64),
}

/// A registered algorithm by name, with these fields (JSON) and `limit`.
fn build_named(name: &str, limit: u64, fields: &str) -> Arc<dyn Policy> {
    Registration::find(name).unwrap().build(Params::new("rule", limit, serde_json::from_str(fields).unwrap())).unwrap()
}

/// The admitted requests among `decided`: (time, cost).
fn admitted_of(decided: &[(Nanos, u64, Decision)]) -> Vec<(Nanos, u64)> {
    decided.iter().filter(|(_, _, d)| d.allowed()).map(|&(t, c, _)| (t, c)).collect()
}

/// The most units admitted in any `[s, s + span]` (`closed`) or `[s, s + span)`.
fn most_in_any(admitted: &[(Nanos, u64)], span: Nanos, closed: bool) -> u64 {
    (0..admitted.len())
        .map(|i| {
            let end = admitted[i].0 + span;
            admitted[i..].iter().take_while(|(t, _)| if closed { *t <= end } else { *t < end }).map(|(_, c)| c).sum()
        })
        .max()
        .unwrap_or(0)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// The example builds the weighted sliding window; with `sub_windows`
    /// it must keep the same promises: its stated bound, exact
    /// `retry_after`, an idle bucket that decides like a fresh one — and
    /// never more than `limit` in any interval of `period · (N − 1) / N`.
    #[test]
    fn sliding_sub_windows_keep_their_promises(
        limit in 1u64..20,
        sub_windows in 2u64..=60,
        period in prop_oneof![Just("1s"), Just("10s"), Just("7s")],
        arrivals in arrivals(SECOND.times(10), 3),
        cost in 1u64..4,
        later in 0u64..30 * SECOND.get(),
    ) {
        let policy = build_named("sliding_window", limit, &format!(r#"{{"period": "{period}", "sub_windows": {sub_windows}}}"#));
        let period = span_of(policy.as_ref());
        let arrivals: Vec<(Nanos, u64)> = arrivals.into_iter().map(|(gap, c)| (Nanos::from_nanos(gap.get() % (period.get() / 5)), c.min(limit))).collect();
        let admitted = admitted_of(&run(policy.as_ref(), &arrivals));
        let most = most_in_any(&admitted, Nanos::from_nanos(period.get() / sub_windows * (sub_windows - 1)), true);
        prop_assert!(most <= limit, "{most} > {limit} within period·(N − 1)/N");
        for span in [period - Nanos::from_nanos(1), period, Nanos::from_nanos(period.get() / 2), period.times(3)] {
            let most = most_in_any(&admitted, span, true);
            prop_assert!(most <= policy.admitted_bound(span), "{most} > {} in {span}", policy.admitted_bound(span));
        }

        let cost = cost.min(limit);
        let mut slot = vec![0u8; policy.state_len()];
        let mut now = T0;
        policy.write_fresh(&mut slot, now);
        for (gap, c) in arrivals {
            now += gap;
            policy.decide(&mut slot, now, c);
            let decision = policy.decide(&mut slot.clone(), now, cost);
            if !decision.allowed() {
                let wait = decision.retry_after();
                prop_assert!(!policy.decide(&mut slot.clone(), now + wait - Nanos::from_nanos(1), cost).allowed(), "admitted 1 ns early");
                prop_assert!(policy.decide(&mut slot.clone(), now + wait, cost).allowed(), "denied at retry_after");
            }
        }
        let at = now + Nanos::from_nanos(later);
        if policy.is_idle(&slot, at) {
            let mut fresh = vec![0u8; policy.state_len()];
            policy.write_fresh(&mut fresh, at);
            prop_assert_eq!(policy.decide(&mut slot, at, cost), policy.decide(&mut fresh, at, cost));
        }
    }

    /// The sliding log is exact: no `[s, s + period)` admits more than `limit`.
    #[test]
    fn the_sliding_log_never_admits_more_than_limit_in_a_period(
        limit in 1u64..20,
        period in prop_oneof![Just("1s"), Just("10s"), Just("7s")],
        arrivals in arrivals(SECOND, 3),
    ) {
        let policy = build_named("sliding_log", limit, &format!(r#"{{"period": "{period}"}}"#));
        let arrivals: Vec<(Nanos, u64)> = arrivals.into_iter().map(|(gap, c)| (gap, c.min(limit))).collect();
        let admitted = admitted_of(&run(policy.as_ref(), &arrivals));
        let most = most_in_any(&admitted, span_of(policy.as_ref()), false);
        prop_assert!(most <= limit, "{most} > {limit} in one period");
    }
}
