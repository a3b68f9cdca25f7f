//! The shared-state store and the measure-and-replace loop over it.
//!
//! Envoy's shared data is a map of byte values, each with a version (`cas`);
//! a write names the version it read and fails if another worker wrote since.
//! [`measure_and_replace`] hands the value read to a closure that *decides*
//! and returns the new value; after a conflict it runs the closure again on the
//! fresh value, so a decision is never applied to state it did not see.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::fmt;

use crate::text::InlineText;

/// A value's version, as the host hands it out. Never zero for a stored key.
pub type Cas = u32;

/// Why a store operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreError {
    /// The key does not exist. Floodgate creates every key before traffic,
    /// because the host cannot create a key atomically.
    Missing,
    /// The write lost a race: the value changed since it was read.
    CasMismatch,
    /// The host refused the operation.
    Host,
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StoreError::Missing => "key missing from shared data",
            StoreError::CasMismatch => "value changed since it was read",
            StoreError::Host => "host refused the shared-data operation",
        })
    }
}

/// Room for a group's key, `fg:<rule>:fb:<group>`: a rule name is at most 64
/// bytes and a group number at most 7 digits, 78 bytes in all.
pub type KeyText = InlineText<96>;

/// A bucket group's address: its table's key prefix and its number. Its
/// text ([`GroupKey::write`]) is the group's key in the store — on Envoy's
/// shared data the very bytes that outlive a module upgrade, so they are
/// written in this one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupKey<'a> {
    /// The table's place among the caller's tables: the same for the same
    /// `prefix` for as long as the caller uses one store, so a store may
    /// keep its groups by it (checking `prefix` still).
    pub table: usize,
    /// `fg:<rule>:`, or `fg:<rule>:fb:` for a global rule's local fall-back.
    pub prefix: &'a str,
    /// The group's number in its table.
    pub group: u32,
}

impl GroupKey<'_> {
    /// Writes the group's key, `<prefix><group>`, into `key`; false if it
    /// does not fit (it always does: see [`KeyText`]).
    pub fn write<const N: usize>(&self, key: &mut InlineText<N>) -> bool {
        key.clear();
        key.push_str(self.prefix) && key.push_u64(u64::from(self.group))
    }
}

/// A versioned byte store: Envoy shared data in the filter, [`MemoryStore`]
/// in tests.
pub trait Store {
    /// Reads `key`: its value and version, or `Ok(None)` when it does not exist.
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, Cas)>, StoreError>;

    /// Writes `value` if `key` is still at version `cas` (`None`: unconditionally).
    fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError>;

    /// Creates `key` with `value` unless it exists. Not atomic on Envoy (two
    /// creators can both win), so call it only where one thread runs, before
    /// traffic: the filter does it while configuring on Envoy's main thread.
    fn create_if_absent(&self, key: &str, value: &[u8]) -> Result<bool, StoreError> {
        match self.get(key)? {
            Some(_) => Ok(false),
            None => self.set(key, value, None).map(|()| true),
        }
    }

    /// Decides on `key`'s value while the store holds it still: hands the
    /// value to `decide` and keeps what it returns (`None`: the value as it
    /// was). A store in the filter's own memory (the native build's) does
    /// this under a lock on the one value, so a decision never loses a race
    /// and the value is never copied out and back. `None` (the default):
    /// this store cannot, and [`measure_and_replace`] reads and
    /// compares-and-sets instead.
    fn decide_in_place(
        &self,
        _key: &str,
        _decide: &mut dyn FnMut(Vec<u8>) -> Option<Vec<u8>>,
    ) -> Option<Result<(), StoreError>> {
        None
    }

    /// [`Store::decide_in_place`] on the group `key` addresses, found by its
    /// numbers rather than by its key's text where the store can (the
    /// native build's keeps its groups by number). `None` (the default):
    /// this store cannot, and the caller goes by the key's text.
    fn decide_on_group(
        &self,
        _key: GroupKey<'_>,
        _decide: &mut dyn FnMut(Vec<u8>) -> Option<Vec<u8>>,
    ) -> Option<Result<(), StoreError>> {
        None
    }
}

/// What a decision closure wants done with the value it was shown.
#[derive(Debug, PartialEq, Eq)]
pub enum Step<T> {
    /// Write this value (if the version is unchanged) and return `T`.
    Write(Vec<u8>, T),
    /// Nothing to write: return `T` as decided.
    Keep(T),
}

/// How a measure-and-replace loop ended.
#[derive(Debug, PartialEq, Eq)]
pub struct Replaced<T> {
    /// What the closure decided on the value that was finally written or kept.
    pub outcome: T,
    /// How many writes lost a race before this one.
    pub retries: u32,
}

/// Why a measure-and-replace loop gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoopError {
    /// Every attempt lost a race: the bound on retries was reached.
    RetriesExhausted,
    /// The store failed (not a race).
    Store(StoreError),
}

/// Reads `key`, lets `decide` choose the new value, and writes it if nobody
/// wrote in between; on a conflict, reads again and decides again — at most
/// `max_retries` times after the first attempt. A store that can decide in
/// place ([`Store::decide_in_place`]) runs `decide` once, on the value it
/// holds still: no race to lose.
///
/// ```
/// use floodgate_core::store::{measure_and_replace, MemoryStore, Step, Store};
/// let store = MemoryStore::default();
/// store.set("hits", &[0], None).unwrap();
/// let done = measure_and_replace(&store, "hits", 3, |value| {
///     let next = value[0] + 1;
///     Step::Write(vec![next], next)
/// }).unwrap();
/// assert_eq!(done.outcome, 1);
/// ```
pub fn measure_and_replace<S, T, F>(
    store: &S,
    key: &str,
    max_retries: u32,
    mut decide: F,
) -> Result<Replaced<T>, LoopError>
where
    S: Store + ?Sized,
    F: FnMut(Vec<u8>) -> Step<T>,
{
    if let Some(done) = in_place(&mut decide, |in_place| store.decide_in_place(key, in_place)) {
        return done;
    }
    let mut retries = 0;
    loop {
        let (value, cas) = store.get(key).map_err(LoopError::Store)?.ok_or(LoopError::Store(StoreError::Missing))?;
        // The closure owns what was read: it can decide in that buffer and
        // hand it back to be written, without a copy.
        match decide(value) {
            Step::Keep(outcome) => return Ok(Replaced { outcome, retries }),
            Step::Write(next, outcome) => match store.set(key, &next, Some(cas)) {
                Ok(()) => return Ok(Replaced { outcome, retries }),
                Err(StoreError::CasMismatch) if retries < max_retries => retries += 1,
                Err(StoreError::CasMismatch) => return Err(LoopError::RetriesExhausted),
                Err(other) => return Err(LoopError::Store(other)),
            },
        }
    }
}

/// [`measure_and_replace`] on the group `key` addresses: decided in place on
/// the group found by its numbers where the store can
/// ([`Store::decide_on_group`]), else by its key's text.
pub fn measure_and_replace_group<S, T, F>(
    store: &S,
    key: GroupKey<'_>,
    max_retries: u32,
    mut decide: F,
) -> Result<Replaced<T>, LoopError>
where
    S: Store + ?Sized,
    F: FnMut(Vec<u8>) -> Step<T>,
{
    if let Some(done) = in_place(&mut decide, |in_place| store.decide_on_group(key, in_place)) {
        return done;
    }
    let mut text = KeyText::default();
    if !key.write(&mut text) {
        return Err(LoopError::Store(StoreError::Host));
    }
    measure_and_replace(store, text.as_str(), max_retries, decide)
}

/// Runs `decide` through a store's way of deciding in place (`run`), if it
/// has one: `None` when it has not.
fn in_place<T, F>(
    decide: &mut F,
    run: impl FnOnce(&mut dyn FnMut(Vec<u8>) -> Option<Vec<u8>>) -> Option<Result<(), StoreError>>,
) -> Option<Result<Replaced<T>, LoopError>>
where
    F: FnMut(Vec<u8>) -> Step<T>,
{
    let mut outcome = None;
    let mut in_place = |value: Vec<u8>| match decide(value) {
        Step::Write(next, decided) => {
            outcome = Some(decided);
            Some(next)
        }
        Step::Keep(decided) => {
            outcome = Some(decided);
            None
        }
    };
    let done = run(&mut in_place)?;
    Some(done.map_err(LoopError::Store).and_then(|()| {
        // A store that decided in place ran `decide`; one that did not is at fault.
        outcome.map(|outcome| Replaced { outcome, retries: 0 }).ok_or(LoopError::Store(StoreError::Host))
    }))
}

/// An in-memory [`Store`] with Envoy's semantics, for tests: one global
/// version counter, and writes with a stale version fail. It can be told to
/// make the next writes lose a race, with another writer's value slipped in
/// first, to exercise the retry path.
#[derive(Default)]
pub struct MemoryStore {
    entries: RefCell<HashMap<String, (Vec<u8>, Cas)>>,
    version: Cell<Cas>,
    interference: RefCell<Vec<Interference>>,
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore").field("keys", &self.len()).finish_non_exhaustive()
    }
}

/// A write that [`MemoryStore`] slips in just before a caller's write.
type Interference = Box<dyn FnMut(&str, &[u8]) -> Option<Vec<u8>>>;

impl MemoryStore {
    /// Before each of the next `times` conditional writes, lets `rival` rewrite
    /// the stored value (given the key and current value; `None` leaves it but
    /// still bumps its version), so that write fails with a CAS mismatch.
    pub fn interfere(&self, times: usize, rival: impl FnMut(&str, &[u8]) -> Option<Vec<u8>> + Clone + 'static) {
        let mut queue = self.interference.borrow_mut();
        for _ in 0..times {
            queue.push(Box::new(rival.clone()));
        }
    }

    /// Number of keys held (for memory-bound tests).
    pub fn len(&self) -> usize {
        self.entries.borrow().len()
    }

    /// True when no key exists.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn next_version(&self) -> Cas {
        let next = self.version.get().wrapping_add(1).max(1);
        self.version.set(next);
        next
    }
}

impl Store for MemoryStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, Cas)>, StoreError> {
        Ok(self.entries.borrow().get(key).cloned())
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
        if cas.is_some() {
            let rival = {
                let mut queue = self.interference.borrow_mut();
                if queue.is_empty() {
                    None
                } else {
                    Some(queue.remove(0))
                }
            };
            if let Some(mut rival) = rival {
                let current = self.entries.borrow().get(key).map(|(v, _)| v.clone()).unwrap_or_default();
                let written = rival(key, &current).unwrap_or(current);
                let version = self.next_version();
                self.entries.borrow_mut().insert(key.to_string(), (written, version));
            }
        }
        let mut entries = self.entries.borrow_mut();
        // Like Envoy: a versioned write to a missing key creates it.
        if let (Some(expected), Some((_, current))) = (cas, entries.get(key)) {
            if *current != expected {
                return Err(StoreError::CasMismatch);
            }
        }
        let version = self.next_version();
        entries.insert(key.to_string(), (value.to_vec(), version));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn counter(store: &dyn Store, limit: u8, max_retries: u32) -> Result<Replaced<bool>, LoopError> {
        measure_and_replace(store, "k", max_retries, |value| {
            let used = value.first().copied().unwrap_or(0);
            if used < limit {
                Step::Write(vec![used + 1], true)
            } else {
                Step::Keep(false)
            }
        })
    }

    #[test]
    fn a_conflict_is_decided_again_on_the_fresh_value() {
        let store = MemoryStore::default();
        store.set("k", &[2], None).unwrap();
        // A rival takes the last unit between our read and our write.
        store.interfere(1, |_, v: &[u8]| Some(vec![v[0] + 1]));
        let result = counter(&store, 3, 5).unwrap();
        assert!(!result.outcome, "re-decided on the fresh value, the limit is reached");
        assert_eq!(result.retries, 1);
        assert_eq!(store.get("k").unwrap().unwrap().0, vec![3]);
    }

    #[test]
    fn retries_are_bounded_and_exhaustion_is_explicit() {
        let store = MemoryStore::default();
        store.set("k", &[0], None).unwrap();
        store.interfere(4, |_, _: &[u8]| None);
        assert_eq!(counter(&store, 10, 3), Err(LoopError::RetriesExhausted));
        // With the rival gone the next call succeeds.
        assert!(counter(&store, 10, 3).unwrap().outcome);
    }

    #[test]
    fn a_missing_key_is_an_error_not_a_racy_create() {
        let store = MemoryStore::default();
        assert_eq!(counter(&store, 1, 3), Err(LoopError::Store(StoreError::Missing)));
        assert!(store.create_if_absent("k", &[0]).unwrap());
        assert!(!store.create_if_absent("k", &[9]).unwrap());
        assert!(counter(&store, 1, 3).unwrap().outcome);
    }

    /// A store that decides in place, as the native build's process memory
    /// does: the loop hands it the decision instead of reading and writing.
    #[derive(Default)]
    struct InPlace {
        values: RefCell<HashMap<String, Vec<u8>>>,
        decided: Cell<u32>,
    }

    impl Store for InPlace {
        fn get(&self, key: &str) -> Result<Option<(Vec<u8>, Cas)>, StoreError> {
            Ok(self.values.borrow().get(key).map(|v| (v.clone(), 1)))
        }

        fn set(&self, _: &str, _: &[u8], _: Option<Cas>) -> Result<(), StoreError> {
            panic!("a store that decides in place is never written through set by the loop");
        }

        fn decide_in_place(
            &self,
            key: &str,
            decide: &mut dyn FnMut(Vec<u8>) -> Option<Vec<u8>>,
        ) -> Option<Result<(), StoreError>> {
            self.decided.set(self.decided.get() + 1);
            let mut values = self.values.borrow_mut();
            let Some(value) = values.get_mut(key) else { return Some(Err(StoreError::Missing)) };
            if let Some(next) = decide(value.clone()) {
                *value = next;
            }
            Some(Ok(()))
        }
    }

    #[test]
    fn a_store_that_decides_in_place_is_handed_the_decision() {
        let store = InPlace::default();
        assert_eq!(counter(&store, 2, 3), Err(LoopError::Store(StoreError::Missing)));
        store.values.borrow_mut().insert("k".into(), vec![0]);
        for expected in [true, true, false, false] {
            let done = counter(&store, 2, 3).unwrap();
            assert_eq!((done.outcome, done.retries), (expected, 0));
        }
        assert_eq!(store.values.borrow()["k"], vec![2], "a denial keeps the value");
        assert_eq!(store.decided.get(), 5);
    }

    #[test]
    fn versions_are_global_and_stale_writes_fail() {
        let store = MemoryStore::default();
        store.set("a", &[1], None).unwrap();
        let (_, cas) = store.get("a").unwrap().unwrap();
        store.set("b", &[1], None).unwrap();
        store.set("a", &[2], Some(cas)).unwrap();
        assert_eq!(store.set("a", &[3], Some(cas)), Err(StoreError::CasMismatch));
    }
}
