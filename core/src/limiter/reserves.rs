//! Per-worker batches (`worker_batch`), as a worker keeps them: units it
//! took from a shared bucket ahead of the requests that spend them, in its
//! own memory, so a hot key's requests make no shared-data call. How they
//! are taken, spent and given back is [`super::batches`].
//!
//! A reserve is valid for at most [`RESERVE_LIFETIME`], and never past the
//! counting window its units were taken in (a window algorithm's units
//! count only there).

use crate::algorithm::{Decision, Grant, Release};
use crate::time::{Nanos, SECOND};

/// The longest a worker keeps units it took ahead.
pub const RESERVE_LIFETIME: Nanos = SECOND;

/// Keys one rule keeps reserves for in one worker: the hottest keys; a new
/// key beyond this takes the place of the reserve that ends first (whose
/// units are given back).
pub const RESERVES_PER_RULE: usize = 64;

/// Units one worker holds of one key's bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Reserve {
    /// The key's descriptor fingerprint.
    pub fingerprint: u64,
    /// Units not spent yet.
    pub units: u64,
    /// When they were taken (what giving them back names).
    pub taken_at: Nanos,
    /// The whole grant they are the unused part of: the request that took
    /// them, its own cost included.
    pub granted: u64,
    /// When they stop being spent here.
    pub until: Nanos,
    /// The bucket's numbers as of the take, for the response headers.
    pub decision: Decision,
}

impl Reserve {
    /// Spends `cost` units at `now`, if it has them and is still valid: the
    /// decision reported (the bucket as of the take, plus what is left here).
    pub fn spend(&mut self, now: Nanos, cost: u64) -> Option<Decision> {
        if now >= self.until || self.units < cost {
            return None;
        }
        self.units -= cost;
        let remaining = self.decision.remaining.saturating_add(self.units);
        Some(Decision::admit(remaining, self.decision.reset))
    }

    /// What giving the unspent units back hands to the bucket: the unused
    /// part of the grant they were taken with ([`Release::Return`]), so a
    /// bucket that earns units back counts the time since against the
    /// units used, not against these.
    pub fn unspent(&self) -> (Grant, Release) {
        (Grant { cost: self.units, at: self.taken_at }, Release::Return { granted: self.granted })
    }
}

/// One rule's reserves in one worker: a fixed list, so keeping them
/// allocates nothing per request.
#[derive(Debug, Default)]
pub(super) struct Reserves {
    entries: Vec<Reserve>,
}

impl Reserves {
    /// Room for [`RESERVES_PER_RULE`] reserves.
    pub fn with_room() -> Self {
        Reserves { entries: Vec::with_capacity(RESERVES_PER_RULE) }
    }

    /// The reserve of `fingerprint`, if any.
    pub fn get_mut(&mut self, fingerprint: u64) -> Option<&mut Reserve> {
        self.entries.iter_mut().find(|r| r.fingerprint == fingerprint)
    }

    /// Takes the reserve of `fingerprint` out, to give its units back.
    pub fn take(&mut self, fingerprint: u64) -> Option<Reserve> {
        let at = self.entries.iter().position(|r| r.fingerprint == fingerprint)?;
        Some(self.entries.swap_remove(at))
    }

    /// Keeps `reserve` (its key has none); when the list is full, the one
    /// that ends first makes room and is handed back, to be given back.
    pub fn insert(&mut self, reserve: Reserve) -> Option<Reserve> {
        if self.entries.len() < RESERVES_PER_RULE {
            self.entries.push(reserve);
            return None;
        }
        let first = self.entries.iter_mut().min_by_key(|r| r.until)?;
        Some(std::mem::replace(first, reserve))
    }

    /// Takes out every reserve that ends by `now` (every one, if `all`).
    pub fn take_ended(&mut self, now: Nanos, all: bool, out: &mut Vec<Reserve>) {
        let mut at = 0;
        while let Some(reserve) = self.entries.get(at) {
            if all || reserve.until <= now {
                out.push(self.entries.swap_remove(at));
            } else {
                at += 1;
            }
        }
    }

    /// True when no reserve is kept.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    fn reserve(fingerprint: u64, units: u64, until: u64) -> Reserve {
        Reserve {
            fingerprint,
            units,
            taken_at: Nanos::ZERO,
            granted: units + 1,
            until: Nanos::from_nanos(until),
            decision: Decision::admit(10, Nanos::ZERO),
        }
    }

    #[test]
    fn a_reserve_is_spent_while_it_has_units_and_time() {
        let mut r = reserve(1, 3, 100);
        assert_eq!(r.spend(Nanos::from_nanos(10), 2), Some(Decision::admit(11, Nanos::ZERO)));
        assert_eq!(r.spend(Nanos::from_nanos(10), 2), None, "one left");
        assert_eq!(r.spend(Nanos::from_nanos(100), 1), None, "ended");
        assert_eq!(r.spend(Nanos::from_nanos(99), 1), Some(Decision::admit(10, Nanos::ZERO)));
    }

    #[test]
    fn a_full_list_hands_back_the_reserve_that_ends_first() {
        let mut reserves = Reserves::with_room();
        for i in 0..RESERVES_PER_RULE as u64 {
            assert_eq!(reserves.insert(reserve(i, 1, 1000 - i)), None);
        }
        let last = RESERVES_PER_RULE as u64 - 1;
        assert_eq!(reserves.insert(reserve(999, 1, 5000)).map(|r| r.fingerprint), Some(last));
        assert!(reserves.get_mut(999).is_some() && reserves.get_mut(last).is_none());
        let mut ended = Vec::new();
        reserves.take_ended(Nanos::from_nanos(1000 - 3), false, &mut ended);
        assert_eq!(ended.len(), RESERVES_PER_RULE - 4, "those ending by then");
        reserves.take_ended(Nanos::ZERO, true, &mut ended);
        assert!(reserves.is_empty());
    }
}
