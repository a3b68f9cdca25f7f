//! Property tests of the algorithms and the bucket table: for arbitrary
//! arrival sequences and costs, no window admits more than the algorithm's
//! bound, `retry_after` is exact (never early, never late), and the bounded
//! table behaves exactly like one independent bucket per key.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;

use floodgate_core::algorithm::{Decision, Kind, Policy};
use floodgate_core::store::Step;
use floodgate_core::table::{Table, TableOutcome, WAYS};
use floodgate_core::time::{Nanos, SECOND};
use proptest::prelude::*;

const T0: Nanos = 1_700_000_000 * SECOND;

fn kinds() -> impl Strategy<Value = Kind> {
    prop_oneof![Just(Kind::TokenBucket), Just(Kind::LeakyBucket), Just(Kind::FixedWindow)]
}

/// (limit, period, burst) with the burst forced to the limit for fixed windows.
fn params() -> impl Strategy<Value = (Kind, u64, Nanos, u64)> {
    (kinds(), 1u64..20, prop_oneof![Just(SECOND), Just(10 * SECOND), Just(7 * SECOND + 3)], 1u64..20).prop_map(
        |(kind, limit, period, burst)| (kind, limit, period, if kind == Kind::FixedWindow { limit } else { burst }),
    )
}

/// Gaps between arrivals (up to a fifth of the period) and costs.
fn arrivals(period: Nanos, max_cost: u64) -> impl Strategy<Value = Vec<(Nanos, u64)>> {
    prop::collection::vec((0..period / 5, 1..=max_cost), 1..200)
}

fn run(policy: &Policy, arrivals: &[(Nanos, u64)]) -> Vec<(Nanos, u64, Decision)> {
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

/// The most units the algorithm may admit in any window of `window` ns.
fn window_bound(kind: Kind, limit: u64, period: Nanos, burst: u64, window: Nanos) -> u64 {
    match kind {
        Kind::TokenBucket => burst + (u128::from(window) * u128::from(limit) / u128::from(period)) as u64,
        Kind::LeakyBucket => burst + window / period.div_ceil(limit),
        // Any window shorter than a period overlaps at most two aligned windows.
        Kind::FixedWindow => 2 * limit,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn no_window_admits_more_than_the_bound(
        ((kind, limit, period, burst), arrivals) in params().prop_flat_map(|p| (Just(p), arrivals(p.2, p.3))),
    ) {
        let policy = Policy::new(kind, limit, period, burst);
        let admitted: Vec<(Nanos, u64)> =
            run(&policy, &arrivals).into_iter().filter(|(_, _, d)| d.allowed).map(|(t, c, _)| (t, c)).collect();
        for window in [period - 1, period / 2] {
            let bound = window_bound(kind, limit, period, burst, window);
            for (i, &(start, _)) in admitted.iter().enumerate() {
                let used: u64 = admitted[i..].iter().take_while(|(t, _)| *t <= start + window).map(|(_, c)| c).sum();
                prop_assert!(used <= bound, "{kind:?} admitted {used} > {bound} in [{start}, +{window}]");
            }
        }
        if kind == Kind::FixedWindow {
            let mut per_window: HashMap<u64, u64> = HashMap::new();
            for (t, c) in &admitted {
                *per_window.entry(t / period).or_default() += c;
            }
            prop_assert!(per_window.values().all(|used| *used <= limit));
        }
    }

    #[test]
    fn retry_after_is_exact(
        (kind, limit, period, burst) in params(),
        arrivals in arrivals(10 * SECOND, 3),
        cost in 1u64..4,
    ) {
        let policy = Policy::new(kind, limit, period, burst);
        let cost = cost.min(policy.capacity());
        let mut slot = vec![0u8; policy.state_len()];
        let mut now = T0;
        policy.write_fresh(&mut slot, now);
        for (gap, c) in arrivals {
            now += gap % period;
            policy.decide(&mut slot, now, c.min(policy.capacity()));
            let mut probe = slot.clone();
            let decision = policy.decide(&mut probe, now, cost);
            if decision.allowed {
                prop_assert_eq!(decision.retry_after, 0);
                continue;
            }
            let wait = decision.retry_after;
            prop_assert!(wait > 0 && wait < Nanos::MAX);
            let mut early = slot.clone();
            prop_assert!(!policy.decide(&mut early, now + wait - 1, cost).allowed, "{kind:?}: admitted 1 ns before retry_after");
            let mut on_time = slot.clone();
            prop_assert!(policy.decide(&mut on_time, now + wait, cost).allowed, "{kind:?}: denied at retry_after");
        }
    }

    /// One group of a table, keys from a pool larger than the group: every
    /// decision equals that of a private bucket per key, except when the
    /// group is full — and it is full only when all its entries are live.
    #[test]
    fn the_table_is_a_set_of_independent_buckets(
        (kind, limit, period, burst) in params(),
        ops in prop::collection::vec((0u64..9, 0u64..3 * SECOND, 1u64..3), 1..300),
    ) {
        let policy = Policy::new(kind, limit, period, burst);
        let table = Table::new(kind, policy, WAYS as u32);
        let mut group = table.empty_group();
        let mut model: HashMap<u64, Vec<u8>> = HashMap::new();
        let mut now = T0;
        for (key, gap, cost) in ops {
            now += gap;
            let fingerprint = 0x9e37_79b9_7f4a_7c15 ^ key;
            let cost = cost.min(policy.capacity());
            let (outcome, write) = match table.decide(group.clone(), fingerprint, now, cost) {
                Step::Write(next, outcome) => (outcome, Some(next)),
                Step::Keep(outcome) => (outcome, None),
            };
            match outcome {
                TableOutcome::Full => {
                    let live = model
                        .iter()
                        .filter(|(k, state)| **k != fingerprint && !policy.is_idle(state, now))
                        .count();
                    prop_assert!(live >= WAYS, "full with only {live} live buckets");
                    prop_assert!(write.is_none());
                }
                TableOutcome::Decided { decision, .. } => {
                    let state = model.entry(fingerprint).or_insert_with(|| {
                        let mut fresh = vec![0u8; policy.state_len()];
                        policy.write_fresh(&mut fresh, now);
                        fresh
                    });
                    let mut next = state.clone();
                    let expected = policy.decide(&mut next, now, cost);
                    prop_assert_eq!(decision, expected);
                    if expected.allowed {
                        *state = next;
                    }
                    if let Some(next) = write {
                        group = next;
                    }
                }
            }
        }
    }

    /// Taking units and giving them back is invisible to every later decision.
    #[test]
    fn a_refund_undoes_a_take(
        ((kind, limit, period, burst), arrivals) in params().prop_flat_map(|p| (Just(p), arrivals(p.2, p.3))),
        cost in 1u64..20,
        later in 0u64..20 * SECOND,
        probe_cost in 1u64..20,
    ) {
        let policy = Policy::new(kind, limit, period, burst);
        let (cost, probe_cost) = (cost.min(policy.capacity()), probe_cost.min(policy.capacity()));
        let mut slot = vec![0u8; policy.state_len()];
        let mut now = T0;
        policy.write_fresh(&mut slot, now);
        for (gap, c) in arrivals {
            now += gap;
            policy.decide(&mut slot, now, c);
        }
        let mut taken = slot.clone();
        if policy.decide(&mut taken, now, cost).allowed {
            policy.refund(&mut taken, now, cost);
            let (mut a, mut b) = (slot.clone(), taken);
            prop_assert_eq!(policy.decide(&mut a, now + later, probe_cost), policy.decide(&mut b, now + later, probe_cost));
        }
    }

    #[test]
    fn arbitrary_stored_bytes_never_panic(
        (kind, limit, period, burst) in params(),
        stored in prop::collection::vec(any::<u8>(), 0..120),
        fingerprint in any::<u64>(),
        cost in 1u64..5,
    ) {
        let policy = Policy::new(kind, limit, period, burst);
        let table = Table::new(kind, policy, 64);
        let _ = table.decide(stored.clone(), fingerprint, T0, cost.min(policy.capacity()));
        let _ = table.refund(stored.clone(), fingerprint, T0, cost);
        let mut slot = stored.clone();
        let _ = policy.decide(&mut slot, T0, cost);
        let _ = policy.is_idle(&stored, T0);
    }
}
