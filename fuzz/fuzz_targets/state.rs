//! Decoding stored state: a group value or bucket slot holding any bytes is
//! read as (possibly) corrupt, never panics, and whatever is written back
//! decodes cleanly — for every registered algorithm.
#![no_main]

use arbitrary::Arbitrary;
use floodgate_core::algorithm::{Grant, Params, Release, ALGORITHMS};
use floodgate_core::store::Step;
use floodgate_core::table::{Slot, Table};
use floodgate_core::time::Nanos;
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input {
    algorithm: u8,
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
    let registration = &ALGORITHMS[usize::from(input.algorithm) % ALGORITHMS.len()];
    // The algorithm's example, with fuzzed numbers where it takes them.
    let Ok(mut fields) = serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(registration.example) else {
        panic!("examples are JSON objects")
    };
    for (name, value) in [
        ("period", format!("{}ms", input.period_ms.max(1)).into()),
        ("burst", u64::from(input.burst.max(1)).into()),
    ] {
        if fields.contains_key(name) {
            fields.insert(name.into(), value);
        }
    }
    let Ok(policy) = registration.build(Params::new("fuzz", u64::from(input.limit.max(1)), fields)) else {
        return;
    };
    let table = Table::new(policy.clone(), registration.tag, u32::from(input.max_keys.max(1)));
    let now = Nanos::from_nanos(input.now);
    let cost = u64::from(input.cost.max(1)).min(policy.capacity());
    if let Step::Write(next, _) = table.decide(input.stored.clone(), input.fingerprint, now, cost) {
        match table.decide(next, input.fingerprint, now, cost) {
            Step::Write(_, Some(Slot { was_corrupt, .. })) | Step::Keep(Some(Slot { was_corrupt, .. })) => {
                assert!(!was_corrupt, "a group written by the table must decode")
            }
            _ => panic!("the key just written must have its bucket"),
        }
    }
    let grant = Grant { cost, at: now };
    let _ = table.release(input.stored.clone(), input.fingerprint, now, grant, Release::Undo);
    let _ = table.release(input.stored.clone(), input.fingerprint, now, grant, Release::Done);
    let mut slot = input.stored.clone();
    let _ = policy.decide(&mut slot, now, cost);
    policy.release(&mut slot, now, grant, Release::Undo);
    let _ = policy.is_idle(&input.stored, now);
});
