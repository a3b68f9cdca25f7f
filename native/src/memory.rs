//! Buckets in process memory: the native build's [`Store`].
//!
//! The wasm build keeps each bucket group in Envoy's shared data, a map of
//! byte values behind one host mutex, read out and written back with a
//! compare-and-swap. A native module lives in Envoy's process, so the same
//! keys map to values in its own memory, one lock each, and a decision runs
//! on the value where it lies ([`Store::decide_in_place`]): the group is
//! locked, the core decides on it, and what the core returns is kept — no
//! copy out and back, and no race to lose, so no retries. Everything else
//! the core asks of a store (reading the hashing secret, creating groups) is
//! the same get and set as on Envoy's shared data. A worker's store finds a
//! group by its key's text once, then by its table's place and its number
//! ([`Store::decide_on_group`]): the request path writes no key.
//!
//! Keys are only created while a configuration is prepared, on Envoy's main
//! thread, before any worker serves it; a worker's store keeps the map as it
//! is then, so a worker finds its groups without taking any lock but the
//! group's own. There is one map per name ([`Memory::named`]: the dynamic
//! module filter's `filter_name`), shared by every configuration of the
//! module under that name, as shared data is by every plugin with one
//! `vm_id`: a rule keeps its buckets across a configuration change that
//! keeps its name, algorithm and `max_keys`, and configurations under
//! different names never share a bucket. A map lives while a configuration
//! under its name does.

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};

use floodgate_core::store::{Cas, GroupKey, KeyText, Store, StoreError};

/// A value and its version.
#[derive(Debug, Default)]
struct Entry {
    bytes: Vec<u8>,
    /// Bumped by every write; never zero (a stored key always has a version).
    version: Cas,
}

/// One key's value, behind its own lock.
type Slot = Mutex<Entry>;

/// Keys to their values.
type Map = HashMap<Arc<str>, Arc<Slot>, KeyHasher>;

/// The buckets of every configuration under one name, every worker's.
#[derive(Debug, Default)]
pub struct Memory {
    /// Every key. Keys are created under this lock (so creating one is
    /// atomic, unlike on Envoy's shared data) and only while a configuration
    /// is prepared; a store made afterwards keeps the map as it is then, and
    /// finds its keys there without this lock. Creating a key while stores
    /// hold the map copies the map first (copy on write: its values stay
    /// shared), once per configuration.
    map: Mutex<Arc<Map>>,
}

impl Memory {
    /// The memory of the configurations named `name`: the one they already
    /// share if one of them lives, else a new one.
    pub fn named(name: &str) -> Arc<Memory> {
        static NAMED: OnceLock<Mutex<HashMap<String, Weak<Memory>>>> = OnceLock::new();
        let mut named = lock(NAMED.get_or_init(Mutex::default));
        if let Some(memory) = named.get(name).and_then(Weak::upgrade) {
            return memory;
        }
        // Names no configuration uses any more go (their memory went with it).
        named.retain(|_, memory| memory.strong_count() > 0);
        let memory = Arc::new(Memory::default());
        named.insert(name.to_string(), Arc::downgrade(&memory));
        memory
    }

    /// A store over this memory for the calling thread: the main thread's
    /// while it prepares a configuration (it creates keys), or a worker's,
    /// made once the configuration is prepared (it finds every key of it in
    /// the map as it is now).
    pub fn store(self: &Arc<Self>) -> MemoryStore {
        MemoryStore {
            memory: Arc::clone(self),
            frozen: lock(&self.map).clone(),
            spare: RefCell::default(),
            tables: RefCell::default(),
        }
    }

    /// Number of keys (for tests and the memory bound).
    pub fn len(&self) -> usize {
        lock(&self.map).len()
    }

    /// True when no key exists.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn slot(&self, key: &str) -> Option<Arc<Slot>> {
        lock(&self.map).get(key).cloned()
    }
}

/// Locks `mutex`, poisoned or not: a value a panicking decision left half
/// written (its bytes taken) reads as an empty group, which the core treats
/// as corrupt and starts afresh — so a poisoned lock needs no other care.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The core's [`Store`] over [`Memory`], for one thread.
#[derive(Debug)]
pub struct MemoryStore {
    memory: Arc<Memory>,
    /// The map as it was when this store was made: every key the
    /// configurations prepared by then will ask for.
    frozen: Arc<Map>,
    /// A copy of the value being decided on, kept for when the decision
    /// keeps it as it was (the core consumes the value it is handed);
    /// reused, so deciding allocates nothing once it has grown.
    spare: RefCell<Vec<u8>>,
    /// The groups this store has decided on, by their tables' places and
    /// their numbers ([`GroupKey`]): a request's group is found by two
    /// indexes instead of its key's text being written, hashed and
    /// compared. A group is looked up by its key once, then kept here (one
    /// pointer per group a worker has seen, next to the group's own bytes).
    tables: RefCell<Vec<TableSlots>>,
}

/// One table's groups as a store found them.
#[derive(Debug, Default)]
struct TableSlots {
    /// The table's key prefix: a place reused for another table (it cannot
    /// be while one configuration uses the store) is told by it.
    prefix: Box<str>,
    /// By group number; `None`: not looked up yet.
    slots: Vec<Option<Arc<Slot>>>,
}

impl MemoryStore {
    fn slot(&self, key: &str) -> Option<Arc<Slot>> {
        // Keys created after this store was made (none, on the request path)
        // are found in the memory's current map.
        self.frozen.get(key).cloned().or_else(|| self.memory.slot(key))
    }

    /// The group `key` addresses, if this store has looked it up before.
    fn known<'t>(tables: &'t [TableSlots], key: &GroupKey<'_>) -> Option<&'t Slot> {
        let table = tables.get(key.table).filter(|table| *table.prefix == *key.prefix)?;
        table.slots.get(usize::try_from(key.group).ok()?)?.as_deref()
    }

    /// Keeps `slot` as the group `key` addresses. Skipped if the tables are
    /// in use (a decision that came back to the store: it never does).
    fn remember(&self, key: &GroupKey<'_>, slot: &Arc<Slot>) {
        let (Ok(mut tables), Ok(group)) = (self.tables.try_borrow_mut(), usize::try_from(key.group)) else { return };
        if tables.len() <= key.table {
            tables.resize_with(key.table + 1, TableSlots::default);
        }
        let Some(table) = tables.get_mut(key.table) else { return };
        if *table.prefix != *key.prefix {
            *table = TableSlots { prefix: key.prefix.into(), slots: Vec::new() };
        }
        if table.slots.len() <= group {
            table.slots.resize(group + 1, None);
        }
        if let Some(place) = table.slots.get_mut(group) {
            *place = Some(Arc::clone(slot));
        }
    }

    /// Runs `decide` on the value of `slot`, under its lock, and keeps what
    /// it returns (`None`: the value as it was).
    fn decide_on(&self, slot: &Slot, decide: &mut dyn FnMut(Vec<u8>) -> Option<Vec<u8>>) {
        // A decision does not come back to the store, but if one ever did,
        // it would find the spare taken and use a fresh one.
        let mut fresh = Vec::new();
        let mut spare_guard = self.spare.try_borrow_mut();
        let spare = spare_guard.as_deref_mut().unwrap_or(&mut fresh);
        let mut entry = lock(slot);
        spare.clear();
        spare.extend_from_slice(&entry.bytes);
        let current = std::mem::take(&mut entry.bytes);
        match decide(current) {
            Some(next) => {
                entry.bytes = next;
                entry.version = next_version(entry.version);
            }
            // Kept as it was: the copy goes back in its place.
            None => std::mem::swap(&mut entry.bytes, spare),
        }
    }
}

fn next_version(version: Cas) -> Cas {
    version.wrapping_add(1).max(1)
}

impl Store for MemoryStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, Cas)>, StoreError> {
        Ok(self.slot(key).map(|slot| {
            let entry = lock(&slot);
            (entry.bytes.clone(), entry.version)
        }))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
        let Some(slot) = self.slot(key) else {
            // Like Envoy's shared data: a write to a missing key creates it.
            self.create_if_absent(key, value)?;
            return Ok(());
        };
        let mut entry = lock(&slot);
        if cas.is_some_and(|cas| cas != entry.version) {
            return Err(StoreError::CasMismatch);
        }
        entry.bytes.clear();
        entry.bytes.extend_from_slice(value);
        entry.version = next_version(entry.version);
        Ok(())
    }

    /// Atomic here: keys are created under the map's lock.
    fn create_if_absent(&self, key: &str, value: &[u8]) -> Result<bool, StoreError> {
        let mut map = lock(&self.memory.map);
        if map.contains_key(key) {
            return Ok(false);
        }
        let entry = Entry { bytes: value.to_vec(), version: 1 };
        Arc::make_mut(&mut map).insert(Arc::from(key), Arc::new(Mutex::new(entry)));
        Ok(true)
    }

    fn decide_in_place(
        &self,
        key: &str,
        decide: &mut dyn FnMut(Vec<u8>) -> Option<Vec<u8>>,
    ) -> Option<Result<(), StoreError>> {
        // Borrowed from the frozen map where it is (every key of a request),
        // not counted as one more holder of the value.
        let mut fetched = None;
        let slot: &Slot = match self.frozen.get(key) {
            Some(slot) => slot,
            None => match self.memory.slot(key) {
                Some(slot) => fetched.insert(slot),
                None => return Some(Err(StoreError::Missing)),
            },
        };
        self.decide_on(slot, decide);
        Some(Ok(()))
    }

    /// By the group's numbers once this store has found the group by its
    /// key (every later request of it).
    fn decide_on_group(
        &self,
        key: GroupKey<'_>,
        decide: &mut dyn FnMut(Vec<u8>) -> Option<Vec<u8>>,
    ) -> Option<Result<(), StoreError>> {
        if let Ok(tables) = self.tables.try_borrow() {
            if let Some(slot) = Self::known(&tables, &key) {
                self.decide_on(slot, decide);
                return Some(Ok(()));
            }
        }
        let mut text = KeyText::default();
        if !key.write(&mut text) {
            return Some(Err(StoreError::Host));
        }
        let Some(slot) = self.slot(text.as_str()) else { return Some(Err(StoreError::Missing)) };
        self.remember(&key, &slot);
        self.decide_on(&slot, decide);
        Some(Ok(()))
    }
}

/// A store borrowed is a store: a host lends its own.
impl Store for &MemoryStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, Cas)>, StoreError> {
        (**self).get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
        (**self).set(key, value, cas)
    }

    fn create_if_absent(&self, key: &str, value: &[u8]) -> Result<bool, StoreError> {
        (**self).create_if_absent(key, value)
    }

    fn decide_in_place(
        &self,
        key: &str,
        decide: &mut dyn FnMut(Vec<u8>) -> Option<Vec<u8>>,
    ) -> Option<Result<(), StoreError>> {
        (**self).decide_in_place(key, decide)
    }

    fn decide_on_group(
        &self,
        key: GroupKey<'_>,
        decide: &mut dyn FnMut(Vec<u8>) -> Option<Vec<u8>>,
    ) -> Option<Result<(), StoreError>> {
        (**self).decide_on_group(key, decide)
    }
}

/// Hashes keys (`fg:<rule>:<group>`, written by the configuration, never by
/// a client, so no hash flooding to fear) a word at a time, FxHash's way,
/// then mixes: a lookup costs a few multiplications instead of SipHash's
/// rounds.
#[derive(Debug, Default, Clone, Copy)]
pub struct KeyHasher;

impl BuildHasher for KeyHasher {
    type Hasher = WordHasher;

    fn build_hasher(&self) -> WordHasher {
        WordHasher(0)
    }
}

/// See [`KeyHasher`].
#[derive(Debug)]
pub struct WordHasher(u64);

impl WordHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl Hasher for WordHasher {
    fn write(&mut self, bytes: &[u8]) {
        // Whole words read as such; the last, partial one zero-padded.
        let mut words = bytes.chunks_exact(8);
        for chunk in &mut words {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            self.add(floodgate_core::hash::partial_word(rest));
        }
    }

    /// Mixed (MurmurHash3's finalizer): a product's low bits depend only on
    /// its factors' low bits, and keys differ in their last bytes, so
    /// without it the table's index bits would hardly vary.
    fn finish(&self) -> u64 {
        let mut h = self.0;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use floodgate_core::store::{measure_and_replace, Step};

    fn memory() -> Arc<Memory> {
        Arc::default()
    }

    /// Configurations under one name share one memory while one of them
    /// lives; another name has its own.
    #[test]
    fn a_name_shares_its_memory_while_a_configuration_holds_it() {
        let first = Memory::named("test-shared");
        first.store().create_if_absent("fg:a:0", &[1]).unwrap();
        let second = Memory::named("test-shared");
        assert!(Arc::ptr_eq(&first, &second));
        assert!(Memory::named("test-other").is_empty(), "another name, other buckets");
        drop((first, second));
        assert!(Memory::named("test-shared").is_empty(), "nobody held it: it went");
    }

    #[test]
    fn keys_are_created_once_and_seen_by_stores_made_later() {
        let memory = memory();
        let main = memory.store();
        let early = memory.store();
        assert!(main.create_if_absent("fg:a:0", &[1]).unwrap());
        assert!(!main.create_if_absent("fg:a:0", &[2]).unwrap());
        assert_eq!(early.get("fg:a:0").unwrap(), Some((vec![1], 1)), "a store made before finds it too");
        assert!(early.frozen.is_empty());
        let worker = memory.store();
        assert_eq!(worker.frozen.len(), 1);
        assert_eq!(worker.get("fg:a:0").unwrap(), Some((vec![1], 1)));
        assert_eq!(worker.get("fg:b:0").unwrap(), None);
        assert_eq!(memory.len(), 1);
    }

    /// Group keys differ only in their last digits; they still spread over
    /// the map's slots (the index is the hash's low bits).
    #[test]
    fn group_keys_spread() {
        let low_bits: std::collections::HashSet<u64> =
            (0..16_384).map(|group| KeyHasher.hash_one(format!("fg:per-key:{group}").as_str()) & 0x7fff).collect();
        assert!(low_bits.len() > 10_000, "{} distinct of 16384", low_bits.len());
    }

    #[test]
    fn writes_compare_versions() {
        let store = memory().store();
        store.set("k", &[1], None).unwrap();
        let (_, version) = store.get("k").unwrap().unwrap();
        store.set("k", &[2], Some(version)).unwrap();
        assert_eq!(store.set("k", &[3], Some(version)), Err(StoreError::CasMismatch));
        assert_eq!(store.get("k").unwrap().unwrap().0, vec![2]);
    }

    /// The core's loop decides on the value in place: a write keeps what
    /// the decision returned, a denial keeps the value as it was, and a
    /// missing key is an error, never a racy create.
    #[test]
    fn decisions_run_in_place() {
        let store = memory().store();
        let add = |store: &MemoryStore, limit: u8| {
            measure_and_replace(store, "k", 0, |mut value: Vec<u8>| {
                if value[0] < limit {
                    value[0] += 1;
                    Step::Write(value, true)
                } else {
                    Step::Keep(false)
                }
            })
        };
        assert!(add(&store, 1).is_err());
        store.create_if_absent("k", &[0, 7]).unwrap();
        assert!(add(&store, 2).unwrap().outcome);
        assert!(add(&store, 2).unwrap().outcome);
        assert!(!add(&store, 2).unwrap().outcome);
        assert_eq!(store.get("k").unwrap(), Some((vec![2, 7], 3)), "two writes; the denial wrote nothing");
    }

    /// A group addressed by its numbers is the group its key's text names,
    /// the first time (looked up by the text) and after (kept by number);
    /// a place that names another prefix is looked up again; a group that
    /// does not exist is an error.
    #[test]
    fn groups_are_found_by_number_as_by_their_key() {
        let memory = memory();
        let main = memory.store();
        main.create_if_absent("fg:a:3", &[0]).unwrap();
        main.create_if_absent("fg:b:fb:3", &[10]).unwrap();
        let worker = memory.store();
        let bump = |store: &MemoryStore, table: usize, prefix: &str| {
            let key = GroupKey { table, prefix, group: 3 };
            let result = store.decide_on_group(key, &mut |mut value: Vec<u8>| {
                value[0] += 1;
                Some(value)
            });
            result.unwrap()
        };
        for _ in 0..3 {
            bump(&worker, 0, "fg:a:").unwrap();
        }
        assert_eq!(worker.get("fg:a:3").unwrap(), Some((vec![3], 4)), "one group, three writes");
        assert_eq!(worker.tables.borrow()[0].slots.len(), 4);
        bump(&worker, 0, "fg:b:fb:").unwrap();
        assert_eq!(worker.get("fg:b:fb:3").unwrap().unwrap().0, vec![11], "another prefix at that place");
        assert_eq!(worker.get("fg:a:3").unwrap().unwrap().0, vec![3]);
        assert_eq!(bump(&worker, 1, "fg:c:"), Err(StoreError::Missing));
        assert_eq!(memory.len(), 2, "nothing created");
    }

    /// Every worker decides on the same value: with many threads taking
    /// from one counter, exactly the limit is taken.
    #[test]
    fn threads_take_exactly_the_limit() {
        let memory = &memory();
        memory.store().create_if_absent("hot", &0u32.to_le_bytes()).unwrap();
        let taken: usize = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..4)
                .map(|_| {
                    scope.spawn(|| {
                        let store = memory.store();
                        (0..5_000)
                            .filter(|_| {
                                let done = measure_and_replace(&store, "hot", 0, |value: Vec<u8>| {
                                    let used = u32::from_le_bytes(value[..4].try_into().unwrap());
                                    if used < 10_000 {
                                        Step::Write((used + 1).to_le_bytes().to_vec(), true)
                                    } else {
                                        Step::Keep(false)
                                    }
                                });
                                done.unwrap().outcome
                            })
                            .count()
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).sum()
        });
        assert_eq!(taken, 10_000);
    }
}
