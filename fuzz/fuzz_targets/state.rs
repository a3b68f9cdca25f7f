//! Decoding stored state: a group value or bucket slot holding any bytes is
//! read as (possibly) corrupt, never panics, and whatever is written back
//! decodes cleanly.
#![no_main]

use arbitrary::Arbitrary;
use floodgate_core::algorithm::{Kind, Policy};
use floodgate_core::store::Step;
use floodgate_core::table::{Table, TableOutcome};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input {
    kind: u8,
    limit: u16,
    burst: u16,
    period_ms: u32,
    max_keys: u8,
    stored: Vec<u8>,
    fingerprint: u64,
    cost: u16,
    now: u64,
}

fuzz_target!(|input: Input| {
    let kind = match input.kind % 3 {
        0 => Kind::TokenBucket,
        1 => Kind::LeakyBucket,
        _ => Kind::FixedWindow,
    };
    let period = u64::from(input.period_ms.max(1)) * 1_000_000;
    let policy = Policy::new(kind, u64::from(input.limit.max(1)), period, u64::from(input.burst.max(1)));
    let table = Table::new(kind, policy, u32::from(input.max_keys.max(1)));
    let cost = u64::from(input.cost.max(1)).min(policy.capacity());
    if let Step::Write(next, _) = table.decide(input.stored.clone(), input.fingerprint, input.now, cost) {
        match table.decide(next, input.fingerprint, input.now, cost) {
            Step::Write(_, TableOutcome::Decided { was_corrupt, .. }) | Step::Keep(TableOutcome::Decided { was_corrupt, .. }) => {
                assert!(!was_corrupt, "a group written by the table must decode")
            }
            _ => panic!("the key just written must have its bucket"),
        }
    }
    let _ = table.refund(input.stored.clone(), input.fingerprint, input.now, cost);
    let mut slot = input.stored.clone();
    let _ = policy.decide(&mut slot, input.now, cost);
    policy.refund(&mut slot, input.now, cost);
    let _ = policy.is_idle(&input.stored, input.now);
});
