//! A fixed-size table of buckets, so per-client keys cannot grow memory.
//!
//! A rule's buckets live in `groups` shared-data values, each holding up to
//! [`WAYS`] entries of (fingerprint, bucket state). A descriptor's keyed hash
//! picks its group; within the group it finds its own entry, or claims an
//! empty or *idle* one. Because a whole group is one value, claiming a slot
//! and deciding on it is a single compare-and-swap: two workers can never give
//! one client two buckets.
//!
//! Only idle buckets are reused, and an idle bucket is by definition in the
//! same state as a fresh one, so reuse never resets anybody's limit: a client
//! cannot evict another's live bucket (nor its own, to start over). When all
//! entries of a group are live, a new descriptor has no bucket and the rule's
//! failure mode decides.
//!
//! Layout of a group value: `[FORMAT, algorithm tag, entries…]`, each entry
//! `fingerprint (u64 LE) ++ state`. Anything else is treated as an empty group.

use std::sync::Arc;

use crate::algorithm::{Decision, Grant, Policy, Release};
use crate::store::Step;
use crate::time::Nanos;

/// Entries per group. Four keeps a group small to copy and makes a full group
/// rare: with the table a quarter full, about 2% of groups are full.
pub const WAYS: usize = 4;

const FORMAT: u8 = 1;
const HEADER: usize = 2;

/// One rule's bucket table.
#[derive(Debug, Clone)]
pub struct Table {
    policy: Arc<dyn Policy>,
    tag: u8,
    groups: u32,
    /// `policy.holds_until_done()`, asked once: every request's end asks it.
    holds_until_done: bool,
    /// `policy.state_len()`, asked once: every decision needs it a few times.
    state_len: usize,
}

/// What an operation on a descriptor's bucket found (see [`Table::update`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot<T> {
    /// The operation's result.
    pub value: T,
    /// An idle entry of another descriptor was reused for this one.
    pub reused_idle: bool,
    /// The stored group did not decode and was started afresh.
    pub was_corrupt: bool,
    /// How the units the group holds in flight changed (see [`Table::held_in`]).
    pub held_change: i64,
}

impl Table {
    /// A table of `max_keys` buckets (rounded up to whole groups) decided by
    /// `policy`, whose stored groups carry `tag` (the algorithm's
    /// [`crate::algorithm::Registration::tag`]).
    pub fn new(policy: Arc<dyn Policy>, tag: u8, max_keys: u32) -> Self {
        let groups = max_keys.div_ceil(WAYS as u32).max(1);
        let (holds_until_done, state_len) = (policy.holds_until_done(), policy.state_len());
        Self { policy, tag, groups, holds_until_done, state_len }
    }

    /// Whether the table's algorithm holds a request's units until it is
    /// done ([`Policy::holds_until_done`]).
    pub fn holds_until_done(&self) -> bool {
        self.holds_until_done
    }

    /// The algorithm deciding every bucket.
    pub fn policy(&self) -> &dyn Policy {
        self.policy.as_ref()
    }

    /// Number of groups, hence of shared-data keys.
    pub fn groups(&self) -> u32 {
        self.groups
    }

    /// Buckets the table can hold.
    pub fn capacity(&self) -> u64 {
        u64::from(self.groups) * WAYS as u64
    }

    fn entry_len(&self) -> usize {
        8 + self.state_len
    }

    /// Bytes of a full group value.
    pub fn max_group_len(&self) -> usize {
        HEADER + WAYS * self.entry_len()
    }

    /// The value a group starts with: no entries.
    pub fn empty_group(&self) -> Vec<u8> {
        vec![FORMAT, self.tag]
    }

    /// The group a fingerprint belongs to.
    pub fn group_of(&self, fingerprint: u64) -> u32 {
        // The high half picks the group; all 64 bits are stored, so two
        // descriptors in one group are still told apart.
        ((fingerprint >> 32) % u64::from(self.groups)) as u32
    }

    /// Returns the stored group, or an empty group when the bytes are not a
    /// group of this table (`true` in the second place).
    fn load(&self, stored: Vec<u8>) -> (Vec<u8>, bool) {
        let valid = stored.len() >= HEADER
            && stored[0] == FORMAT
            && stored[1] == self.tag
            && (stored.len() - HEADER) % self.entry_len() == 0
            && (stored.len() - HEADER) / self.entry_len() <= WAYS;
        if valid {
            (stored, false)
        } else {
            (self.empty_group(), true)
        }
    }

    fn entries(&self, group: &[u8]) -> usize {
        (group.len() - HEADER) / self.entry_len()
    }

    fn fingerprint_at(&self, group: &[u8], index: usize) -> Option<u64> {
        crate::algorithm::get_u64(group, HEADER + index * self.entry_len())
    }

    fn state_range(&self, index: usize) -> std::ops::Range<usize> {
        let start = HEADER + index * self.entry_len() + 8;
        start..start + self.state_len
    }

    /// Units the group's buckets record as held in flight (zero unless the
    /// algorithm holds units until requests are done). The sum over every
    /// group is what an in-flight gauge shows; comparing a group before and
    /// after a write also counts holds dropped because they expired, or
    /// because an idle bucket's entry was given to another descriptor.
    fn held_in(&self, group: &[u8]) -> u64 {
        if !self.holds_until_done {
            return 0;
        }
        (0..self.entries(group)).filter_map(|i| group.get(self.state_range(i))).map(|s| self.policy.held(s)).sum()
    }

    /// `after - before`, of [`Table::held_in`].
    fn held_change(&self, before: u64, after: &[u8]) -> i64 {
        let change = i128::from(self.held_in(after)) - i128::from(before);
        i64::try_from(change).unwrap_or(if change < 0 { i64::MIN } else { i64::MAX })
    }

    fn find(&self, group: &[u8], fingerprint: u64) -> Option<usize> {
        (0..self.entries(group)).find(|&i| self.fingerprint_at(group, i) == Some(fingerprint))
    }

    /// Runs `op` on the state of descriptor `fingerprint`'s bucket in the
    /// stored group value: its own bucket, or else a new one (in an empty or
    /// idle entry) holding a fresh state. `op` returns its result and whether
    /// it changed the state; a write is asked for only then, so an operation
    /// that changes nothing (a denial) is read-only and claims no entry.
    /// `None` when the descriptor has no bucket and every entry is live.
    pub fn update<T>(
        &self,
        stored: Vec<u8>,
        fingerprint: u64,
        now: Nanos,
        op: impl FnOnce(&mut [u8]) -> (T, bool),
    ) -> Step<Option<Slot<T>>> {
        let (mut group, was_corrupt) = self.load(stored);
        let held_before = self.held_in(&group);
        let (index, reused_idle) = match self.find(&group, fingerprint) {
            Some(index) => (index, false),
            None => {
                let idle = (0..self.entries(&group))
                    .find(|&i| group.get(self.state_range(i)).is_none_or(|state| self.policy.is_idle(state, now)));
                let (index, reused) = match idle {
                    Some(index) => (index, true),
                    None if self.entries(&group) < WAYS => {
                        let index = self.entries(&group);
                        group.resize(group.len() + self.entry_len(), 0);
                        (index, false)
                    }
                    None => return Step::Keep(None),
                };
                crate::algorithm::put_u64(&mut group, HEADER + index * self.entry_len(), fingerprint);
                if let Some(state) = group.get_mut(self.state_range(index)) {
                    self.policy.write_fresh(state, now);
                }
                (index, reused)
            }
        };
        let Some(state) = group.get_mut(self.state_range(index)) else {
            return Step::Keep(None);
        };
        let (value, changed) = op(state);
        if changed {
            let held_change = self.held_change(held_before, &group);
            Step::Write(group, Some(Slot { value, reused_idle, was_corrupt, held_change }))
        } else {
            Step::Keep(Some(Slot { value, reused_idle, was_corrupt, held_change: 0 }))
        }
    }

    /// Runs `op` on every bucket of the stored group (none if the group does
    /// not decode); asks for a write when any changed.
    pub fn update_every(&self, stored: Vec<u8>, mut op: impl FnMut(&mut [u8]) -> bool) -> Step<()> {
        let (mut group, was_corrupt) = self.load(stored);
        let mut changed = false;
        if !was_corrupt {
            for index in 0..self.entries(&group) {
                if let Some(state) = group.get_mut(self.state_range(index)) {
                    changed |= op(state);
                }
            }
        }
        if changed {
            Step::Write(group, ())
        } else {
            Step::Keep(())
        }
    }

    /// Decides a request of `cost` for the descriptor `fingerprint` on the
    /// stored group value. Asks for a write only when state changed: a denial
    /// is read-only. `None` when the group is full (see [`Table::update`]).
    pub fn decide(&self, stored: Vec<u8>, fingerprint: u64, now: Nanos, cost: u64) -> Step<Option<Slot<Decision>>> {
        self.update(stored, fingerprint, now, |state| {
            let decision = self.policy.decide(state, now, cost);
            (decision, decision.allowed())
        })
    }

    /// Gives a grant back to the descriptor's bucket, if it still has one;
    /// writes only when the bucket changed, and returns how the units held
    /// in flight changed.
    pub fn release(&self, stored: Vec<u8>, fingerprint: u64, now: Nanos, grant: Grant, why: Release) -> Step<i64> {
        let (mut group, _) = self.load(stored);
        let Some(index) = self.find(&group, fingerprint) else {
            return Step::Keep(0);
        };
        let held_before = self.held_in(&group);
        let changed =
            group.get_mut(self.state_range(index)).is_some_and(|state| self.policy.release(state, now, grant, why));
        if changed {
            let held_change = self.held_change(held_before, &group);
            Step::Write(group, held_change)
        } else {
            Step::Keep(0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{Concurrency, Gcra, TokenBucket};
    use crate::time::SECOND;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const T0: Nanos = Nanos::from_secs(1_700_000_000);

    fn table(max_keys: u32) -> Table {
        Table::new(Arc::new(TokenBucket::new(2, SECOND.times(60), 2)), 1, max_keys)
    }

    /// Applies a step to a stored value, as the store loop would.
    fn apply<T>(stored: &mut Vec<u8>, step: impl FnOnce(Vec<u8>) -> Step<T>) -> T {
        match step(stored.clone()) {
            Step::Write(next, outcome) => {
                *stored = next;
                outcome
            }
            Step::Keep(outcome) => outcome,
        }
    }

    fn allowed(outcome: Option<Slot<Decision>>) -> bool {
        outcome.is_some_and(|slot| slot.value.allowed())
    }

    #[test]
    fn each_descriptor_gets_its_own_bucket_in_a_group() {
        let table = table(4);
        assert_eq!(table.groups(), 1);
        let mut group = table.empty_group();
        for fingerprint in 1..=4u64 {
            for _ in 0..2 {
                assert!(allowed(apply(&mut group, |g| table.decide(g, fingerprint, T0, 1))));
            }
            assert!(!allowed(apply(&mut group, |g| table.decide(g, fingerprint, T0, 1))));
        }
        assert_eq!(group.len(), table.max_group_len());
    }

    #[test]
    fn live_buckets_are_never_evicted() {
        let table = table(4);
        let mut group = table.empty_group();
        for fingerprint in 1..=4u64 {
            apply(&mut group, |g| table.decide(g, fingerprint, T0, 1));
        }
        // A fifth descriptor finds every entry live.
        assert_eq!(apply(&mut group, |g| table.decide(g, 5, T0, 1)), None, "the group is full");
        // And descriptor 1 still has its half-used bucket.
        let Some(Slot { value: decision, .. }) = apply(&mut group, |g| table.decide(g, 1, T0, 1)) else {
            panic!("descriptor 1 lost its bucket");
        };
        assert!(decision.allowed());
        assert_eq!(decision.remaining, 0);
    }

    #[test]
    fn idle_buckets_are_reused_and_counted() {
        let table = table(4);
        let mut group = table.empty_group();
        for fingerprint in 1..=4u64 {
            apply(&mut group, |g| table.decide(g, fingerprint, T0, 1));
        }
        // 30 s later every bucket has refilled (2 per minute): all idle.
        let later = T0 + SECOND.times(30);
        let outcome = apply(&mut group, |g| table.decide(g, 5, later, 1));
        assert!(matches!(outcome, Some(Slot { reused_idle: true, .. })));
        assert_eq!(group.len(), table.max_group_len(), "reuse does not grow the group");
    }

    #[test]
    fn a_denial_writes_nothing() {
        let table = table(4);
        let mut group = table.empty_group();
        apply(&mut group, |g| table.decide(g, 1, T0, 2));
        assert!(matches!(table.decide(group.clone(), 1, T0, 1), Step::Keep(Some(Slot { .. }))));
    }

    #[test]
    fn undo_restores_the_bucket() {
        let table = table(4);
        let mut group = table.empty_group();
        apply(&mut group, |g| table.decide(g, 7, T0, 2));
        let grant = Grant { cost: 1, at: T0 };
        assert!(matches!(table.release(group.clone(), 7, T0, grant, Release::Done), Step::Keep(0)));
        apply(&mut group, |g| table.release(g, 7, T0, grant, Release::Undo));
        assert!(allowed(apply(&mut group, |g| table.decide(g, 7, T0, 1))));
        assert!(matches!(table.release(group.clone(), 99, T0, grant, Release::Undo), Step::Keep(0)));
    }

    fn held_change(outcome: Option<Slot<Decision>>) -> i64 {
        outcome.expect("the group is full").held_change
    }

    #[test]
    fn held_units_are_reported_as_they_change_even_when_an_entry_is_reused() {
        // Slots held 30 to 40 s.
        let table = Table::new(Arc::new(Concurrency::new(2, SECOND.times(30))), 8, 4);
        let mut group = table.empty_group();
        for fingerprint in 1..=4u64 {
            assert_eq!(held_change(apply(&mut group, |g| table.decide(g, fingerprint, T0, 2))), 2);
        }
        assert_eq!(held_change(apply(&mut group, |g| table.decide(g, 1, T0, 1))), 0, "a denial holds nothing");
        let grant = Grant { cost: 2, at: T0 };
        assert_eq!(apply(&mut group, |g| table.release(g, 1, T0, grant, Release::Done)), -2);
        // The other three releases are lost. A minute later a new descriptor
        // takes an expired entry: its 2 stale slots leave the sum as 1 comes in.
        let later = T0 + SECOND.times(60);
        assert_eq!(held_change(apply(&mut group, |g| table.decide(g, 5, later, 1))), 1, "reuses 1's empty entry");
        assert_eq!(held_change(apply(&mut group, |g| table.decide(g, 6, later, 1))), 1 - 2);
        // A descriptor's own expired slots leave when it is next decided.
        assert_eq!(held_change(apply(&mut group, |g| table.decide(g, 3, later, 1))), 1 - 2);
        // And a late release of a reclaimed grant writes the reclaim, never twice.
        assert_eq!(apply(&mut group, |g| table.release(g, 4, later, grant, Release::Done)), -2);
        assert_eq!(apply(&mut group, |g| table.release(g, 4, later, grant, Release::Done)), 0);
        assert_eq!(table.held_in(&group), 3);
    }

    #[test]
    fn garbage_and_other_algorithms_read_as_an_empty_group() {
        let table = table(4);
        let leaky = Table::new(Arc::new(Gcra::new(2, SECOND, 2)), 2, 4);
        let mut other = leaky.empty_group();
        apply(&mut other, |g| leaky.decide(g, 1, T0, 1));
        for stored in [vec![], vec![9, 9, 9], vec![FORMAT, 1, 0, 0, 0], other] {
            let outcome = table.decide(stored.clone(), 1, T0, 1);
            assert!(matches!(outcome, Step::Write(_, Some(Slot { was_corrupt: true, .. }))), "{stored:?}");
        }
    }

    /// The README's claim: with a quarter of the buckets live, about 2% of
    /// groups are full (Poisson with mean 1: P(4 or more) = 1.9%).
    #[test]
    fn few_groups_are_full_at_a_quarter_occupancy() {
        let table = table(65_536);
        let mut groups = vec![table.empty_group(); table.groups() as usize];
        let live = table.capacity() / 4;
        for i in 0..live {
            let mut hasher = crate::hash::SipHasher::new(3, 4);
            hasher.write(&i.to_le_bytes());
            let fingerprint = hasher.finish();
            let group = &mut groups[table.group_of(fingerprint) as usize];
            apply(group, |g| table.decide(g, fingerprint, T0, 1));
        }
        let full = groups.iter().filter(|g| g.len() == table.max_group_len()).count();
        let share = full as f64 / groups.len() as f64;
        assert!(share < 0.025, "{:.2}% of groups are full", share * 100.0);
        assert!(share > 0.005, "{:.2}%: suspiciously even, is the hash used?", share * 100.0);
    }

    #[test]
    fn fingerprints_spread_over_groups() {
        let table = table(65_536);
        assert_eq!(table.groups(), 16_384);
        assert_eq!(table.capacity(), 65_536);
        let mut hit = vec![false; table.groups() as usize];
        for i in 0..200_000u64 {
            let mut hasher = crate::hash::SipHasher::new(1, 2);
            hasher.write(&i.to_le_bytes());
            hit[table.group_of(hasher.finish()) as usize] = true;
        }
        assert!(hit.iter().all(|h| *h), "every group is reachable");
    }
}
