//! The calls model for a sampled fleet. A call carries whatever one worker
//! holds when it leaves, so calls cannot be summed key by key: a sampled
//! key's claims meet far fewer other claims in the simulation than in the
//! real fleet. Instead the claims and returns the simulation queued (each
//! standing for `weight` real ones of a real worker) are dealt to a few
//! *virtual workers*, each getting the real worker's share of every kind —
//! item `i` kept with probability `weight × V / W` (`V` virtual workers,
//! `W` real ones), at its own instant and with its own timing — and each
//! virtual worker batches them by the filter's rule ([`Batcher`], the one
//! the simulation itself uses). The fleet's calls are the virtual workers'
//! times `W / V`.
//!
//! What it assumes: that a real worker's items are a superposition of many
//! keys' items, each like a simulated one of its stratum (so their
//! instants, including those tied to window boundaries, are the simulated
//! ones); the simulated answers' timing, which moves later claims, is the
//! sampled fleet's. `make fleet-sim` checks it against fleets simulated
//! without sampling (docs/benchmarks.md, "Fleet simulation").

use floodgate_core::time::{Nanos, SECOND};

use crate::calls::{Batcher, Timing};
use crate::fleet::{CallSizes, Item};
use crate::rng::Map;

/// The most items the model replays (keeps its time small).
const MAX_REPLAYED: f64 = 3_000_000.0;

/// What the model says of a fleet's calls in `[from, until)`.
#[derive(Debug, Clone, Default)]
pub struct Modelled {
    /// Calls by size, fleet-wide (weighted to the whole fleet).
    pub calls: CallSizes,
    /// Virtual workers replayed.
    pub virtual_workers: u32,
    /// Whether some item stood for more than one item per virtual worker
    /// (copies at one instant share a call: the model undercounts there).
    pub replicated: bool,
}

/// Replays `items` (in the order they were queued) over virtual workers
/// standing for `workers` real ones; counts the calls that leave in
/// `[from, until)`.
pub fn calls(items: &[Item], workers: u32, from: Nanos, until: Nanos, seed: u64) -> Modelled {
    let real = f64::from(workers.max(1));
    // As many virtual workers as the real ones, unless that replays more
    // than `MAX_REPLAYED` items.
    let total: f64 = items.iter().map(|i| i.weight).sum();
    let by_cost = (MAX_REPLAYED * real / total.max(1.0)).floor().max(1.0);
    let virtual_workers = by_cost.min(real) as u32;
    let v = f64::from(virtual_workers);
    // Each pair's items go together, as many copies of its whole stream as
    // its weight asks: chosen systematically along the pairs ordered by
    // how many items they have (a running sum of the copies each asks, cut
    // at whole numbers from a random start), so that busy and quiet pairs
    // are kept in proportion; each copy to a virtual worker drawn for it,
    // each but the first shifted by its own whole number of seconds.
    let mut dealt: Vec<Vec<Item>> = vec![Vec::new(); virtual_workers as usize];
    let mut replicated = false;
    let span = (until - from) / SECOND;
    let mut pairs: Map<u64, (f64, u64)> = Map::default();
    for item in items {
        let entry = pairs.entry(item.pair).or_insert((item.weight, 0));
        entry.1 += 1;
    }
    let mut order: Vec<(u64, f64, u64)> = pairs.into_iter().map(|(pair, (w, n))| (pair, w, n)).collect();
    order.sort_by(|a, b| b.2.cmp(&a.2).then(a.1.total_cmp(&b.1)).then(a.0.cmp(&b.0)));
    let mut running = crate::rng::unit(seed ^ 0x7265_706c_6179);
    let mut copies_of: Map<u64, Vec<(usize, Nanos)>> = Map::default();
    for (pair, weight, _) in order {
        let expected = weight * v / real;
        let count = ((running + expected).floor() - running.floor()) as u64;
        running += expected;
        let mut rng = crate::rng::seeded(seed ^ crate::rng::mix(pair ^ 0x7265_706c_6179));
        let copies = (0..count)
            .map(|copy| {
                let to = rng.below(u64::from(virtual_workers)) as usize;
                let shift =
                    if copy == 0 { Nanos::ZERO } else { SECOND.times(1 + rng.below(span.saturating_sub(1).max(1))) };
                (to, shift)
            })
            .collect();
        copies_of.insert(pair, copies);
    }
    for item in items {
        let Some(copies) = copies_of.get(&item.pair) else { continue };
        for &(to, shift) in copies.iter() {
            // Another pair's item like it, shifted by whole seconds (its
            // window boundaries stay boundaries), within the measured span;
            // outside it, only the item itself.
            let at = if shift == Nanos::ZERO {
                item.at
            } else if from <= item.at && item.at < until {
                replicated = true;
                from + (item.at - from + shift) % (until - from)
            } else {
                continue;
            };
            let Some(list) = dealt.get_mut(to) else { continue };
            let moved = at.get().wrapping_sub(item.at.get());
            let shift = |t: Nanos| Nanos::from_nanos(t.get().wrapping_add(moved));
            let timing = item.timing.map(|t| Timing { not_before: shift(t.not_before), send_by: shift(t.send_by) });
            list.push(Item { at, timing, ..*item });
        }
    }
    let mut calls = CallSizes::default();
    let scale = real / v;
    for list in &mut dealt {
        list.sort_by_key(|i| i.at);
        replay_worker(list, from, until, scale, &mut calls);
    }
    Modelled { calls, virtual_workers, replicated }
}

/// One virtual worker: its items in order, batched by the filter's rule;
/// each call in `[from, until)` counted `scale` times.
fn replay_worker(items: &[Item], from: Nanos, until: Nanos, scale: f64, calls: &mut CallSizes) {
    let mut batcher: Batcher<(), ()> = Batcher::default();
    let mut count = |batcher: &mut Batcher<(), ()>, now: Nanos| {
        let out = batcher.take_outgoing(now);
        if from <= now && now < until {
            for leases in &out.leases {
                calls.add(leases.len(), 0, scale);
            }
            for returns in &out.returns {
                calls.add(0, returns.len(), scale);
            }
        }
    };
    for item in items {
        while let Some(due) = batcher.hold_until().filter(|&h| h <= item.at) {
            count(&mut batcher, due);
        }
        match item.timing {
            Some(timing) => batcher.refresh(timing, (), item.at),
            None => batcher.give_back((), item.at),
        }
        if batcher.has_outgoing(item.at) {
            count(&mut batcher, item.at);
        }
    }
    while let Some(due) = batcher.hold_until() {
        count(&mut batcher, due);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use floodgate_core::lease::pool::MAX_BATCH_DELAY;
    use floodgate_core::time::SECOND;

    const T0: Nanos = Nanos::from_secs(1_000);

    /// Items of weight 1 on one worker are replayed as they were: each
    /// urgent claim a call, taking along what is held.
    #[test]
    fn one_worker_unweighted_is_the_rule_itself() {
        let urgent = |ms| Item {
            at: T0 + Nanos::from_millis(ms),
            timing: Some(Timing { not_before: T0, send_by: T0 + Nanos::from_millis(ms) }),
            weight: 1.0,
            pair: ms,
        };
        let held = |ms| Item {
            at: T0 + Nanos::from_millis(ms),
            timing: Some(Timing { not_before: T0, send_by: T0 + Nanos::from_millis(ms) + MAX_BATCH_DELAY }),
            weight: 1.0,
            pair: ms,
        };
        let items = [
            held(0),
            urgent(5),
            held(100),
            held(105),
            urgent(500),
            Item { at: T0, timing: None, weight: 1.0, pair: 7 },
        ];
        let mut items = items.to_vec();
        items.sort_by_key(|i| i.at);
        let m = calls(&items, 1, T0, T0 + SECOND.times(5), 1);
        assert_eq!(m.virtual_workers, 1);
        // 5 ms: the held one and the return go along; 120 ms: the two held
        // ones together; 500 ms: alone.
        let (lease, returns) = m.calls.counts();
        assert_eq!((lease, returns), (3.0, 1.0));
        assert_eq!(m.calls.lease.get(&2), Some(&2.0));
    }

    /// Weighted items are dealt to the real share and scaled back: 1,000
    /// workers, 20,000 items standing for 100 each, replayed over as many
    /// virtual workers as real ones (2 million items, within the model's
    /// budget); standing for 1,000 each, over as many as the budget allows.
    #[test]
    fn weights_are_dealt_to_virtual_workers_and_scaled_back() {
        for (weight, workers) in [(100.0, 1_000), (1_000.0, 150)] {
            let items: Vec<Item> = (0..20_000u64)
                .map(|i| {
                    let at = T0 + Nanos::from_micros(i * 500);
                    Item { at, timing: Some(Timing { not_before: at, send_by: at }), weight, pair: i }
                })
                .collect();
            let m = calls(&items, 1_000, T0, T0 + SECOND.times(100), 3);
            assert_eq!(m.virtual_workers, workers, "weight {weight}");
            let (lease, _) = m.calls.counts();
            // Every item is urgent: one call each, whatever the dealing.
            let expected = 20_000.0 * weight;
            assert!((lease / expected - 1.0).abs() < 0.02, "weight {weight}: {lease}");
        }
    }

    /// A whole fleet's own items, each standing for itself, replayed over
    /// as many virtual workers as it has real ones: the model gives the
    /// calls the simulation made, within a few percent (items are dealt to
    /// workers by pair, not to the worker that made them).
    #[test]
    fn a_whole_fleets_items_replay_to_its_own_calls() {
        use crate::fleet::{default_quota, measure_from, simulate, table_groups, FleetConfig};
        use crate::rng::Network;
        let config = FleetConfig {
            name: "replay".into(),
            envoys: 3,
            total_keys: 120,
            keys: crate::keys::flat(120, 3.0, 40).unwrap(),
            exact: true,
            table_groups: table_groups(1.0),
            warmup: SECOND.times(40),
            measure: SECOND.times(30),
            after: Nanos::ZERO,
            restart_at: None,
            seed: 5,
            allowances: true,
            overshoot: None,
            check_baseline: false,
            record_items: true,
            network: Network::Datacenter,
            quota: default_quota(),
        };
        let out = simulate(&config).unwrap();
        let from = measure_from();
        let m = calls(&out.items, 6, from, from + config.measure, 5);
        let (simulated, modelled) = (out.sim_calls.counts(), m.calls.counts());
        assert!(simulated.0 > 100.0 && simulated.1 > 20.0, "{simulated:?}");
        for (s, m) in [(simulated.0, modelled.0), (simulated.1, modelled.1)] {
            assert!((m / s - 1.0).abs() < 0.1, "simulated {simulated:?}, modelled {modelled:?}");
        }
    }
}
