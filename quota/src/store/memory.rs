//! The embedded store: bytes under keys in sharded hash maps. Decisions are
//! made by the caller's transaction (see [`super::Store`]) while the shards
//! of its keys are locked, always in ascending shard order, so transactions
//! over several keys are atomic and never deadlock, and requests for keys in
//! other shards go on meanwhile.
//!
//! Forgetting idle entries costs O(log n) per entry and never a scan: each
//! shard keeps an expiry queue of (instant the entry may be idle, key),
//! looked at only from its head. An entry found busier than queued is
//! queued again at its new idle instant; one found idle is dropped.

use std::cmp::Reverse;
use std::collections::hash_map::RandomState;
use std::collections::{BinaryHeap, HashMap};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use floodgate_core::time::{Clock, Nanos};

use super::{StoreFailure, Writes};

/// Shards: enough that unrelated keys rarely share a lock on two cores or
/// twenty, few enough that a sweep visits them all in microseconds.
const SHARDS: usize = 64;

/// Most entries one sweep step drops while holding a shard's lock, so that
/// even a mass expiry (a million windows ending together) never holds a
/// shard for long.
const SWEEP_STEP: usize = 1_024;

#[derive(Debug)]
struct Entry {
    value: Vec<u8>,
    idle_at: Nanos,
}

#[derive(Debug, Default)]
struct Shard {
    map: HashMap<String, Entry>,
    /// One item per entry: (earliest instant it may be idle, key).
    expiry: BinaryHeap<Reverse<(Nanos, String)>>,
}

impl Shard {
    /// Drops idle entries at `now` from the head of the queue, looking at
    /// up to `most`; returns how many it dropped and how many it looked at.
    fn drop_idle(&mut self, now: Nanos, most: usize) -> (usize, usize) {
        let mut dropped = 0;
        let mut looked = 0;
        while looked < most && self.expiry.peek().is_some_and(|Reverse((due, _))| *due <= now) {
            looked += 1;
            let Some(Reverse((_, key))) = self.expiry.pop() else { break };
            match self.map.get(&key).map(|e| e.idle_at) {
                Some(idle_at) if idle_at <= now => {
                    self.map.remove(&key);
                    dropped += 1;
                }
                // Written since it was queued: queue it at its new idle time.
                Some(idle_at) => self.expiry.push(Reverse((idle_at, key))),
                None => {}
            }
        }
        (dropped, looked)
    }
}

/// The memory store (`--store memory`): counters in this process.
#[derive(Debug)]
pub struct LocalStore {
    clock: Arc<dyn Clock>,
    shards: Vec<Mutex<Shard>>,
    hasher: RandomState,
    /// Entries held, over all shards.
    len: AtomicUsize,
    max_entries: usize,
    /// Entries looked at to drop idle ones, ever (see [`LocalStore::examined`]).
    examined: AtomicUsize,
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while holding the lock cannot leave an entry half-written
    // (each is replaced whole), so a poisoned shard is still consistent.
    shard.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl LocalStore {
    /// A store reading time from `clock` and holding at most `max_entries`
    /// buckets and lease records (idle ones are dropped first; see
    /// [`LocalStore::sweep`]).
    pub fn new(clock: Arc<dyn Clock>, max_entries: usize) -> Self {
        Self {
            clock,
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            hasher: RandomState::new(),
            len: AtomicUsize::new(0),
            max_entries: max_entries.max(1),
            examined: AtomicUsize::new(0),
        }
    }

    /// Number of buckets and lease records held.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many entries eviction and sweeping have looked at so far: they
    /// look only at queued entries that may be idle, never scan the store.
    pub fn examined(&self) -> usize {
        self.examined.load(Ordering::Relaxed)
    }

    fn drop_idle(&self, shard: &mut Shard, now: Nanos, most: usize) -> usize {
        let (dropped, looked) = shard.drop_idle(now, most);
        self.examined.fetch_add(looked, Ordering::Relaxed);
        self.len.fetch_sub(dropped, Ordering::Relaxed);
        dropped
    }

    fn shard_of(&self, key: &str) -> usize {
        // The modulo keeps the index below SHARDS whatever the hash.
        (self.hasher.hash_one(key) % SHARDS as u64) as usize
    }

    /// Drops every entry idle now (a bucket indistinguishable from a fresh
    /// one, an expired lease record), a bounded step per shard lock. Costs
    /// what it drops, not what the store holds. Returns how many it dropped.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now();
        let mut total = 0;
        for shard in &self.shards {
            loop {
                let dropped = self.drop_idle(&mut lock(shard), now, SWEEP_STEP);
                total += dropped;
                if dropped < SWEEP_STEP {
                    break;
                }
            }
        }
        total
    }

    /// Room for `new` more entries: reserved from the count, dropping idle
    /// entries first from the shards already locked, then from any shard
    /// free right now (never waiting for one: that could deadlock).
    fn reserve(&self, new: usize, held: &mut [(usize, MutexGuard<'_, Shard>)], now: Nanos) -> Result<(), StoreFailure> {
        let fits = |len: usize| (len + new <= self.max_entries).then_some(len + new);
        if self.len.fetch_update(Ordering::Relaxed, Ordering::Relaxed, fits).is_ok() {
            return Ok(());
        }
        let mut dropped: usize = held.iter_mut().map(|(_, shard)| self.drop_idle(shard, now, new + SWEEP_STEP)).sum();
        if dropped < new {
            for (index, shard) in self.shards.iter().enumerate() {
                if held.iter().any(|(i, _)| *i == index) {
                    continue;
                }
                if let Ok(mut shard) = shard.try_lock() {
                    dropped += self.drop_idle(&mut shard, now, new + SWEEP_STEP);
                }
                if dropped >= new {
                    break;
                }
            }
        }
        self.len.fetch_update(Ordering::Relaxed, Ordering::Relaxed, fits).map(|_| ()).map_err(|_| StoreFailure::Full)
    }

    /// See [`super::Store`]: runs `decide` on the values of `keys` (which
    /// must be distinct) with their shards locked and applies its writes.
    pub fn transact<A>(
        &self,
        keys: &[String],
        mut decide: impl FnMut(&[Option<Vec<u8>>], Nanos) -> (A, Writes),
    ) -> Result<A, StoreFailure> {
        let shard_of: Vec<usize> = keys.iter().map(|k| self.shard_of(k)).collect();
        let mut order = shard_of.clone();
        order.sort_unstable();
        order.dedup();
        // Ascending shard order: two transactions never wait for each other
        // in a cycle.
        let mut held: Vec<(usize, MutexGuard<'_, Shard>)> =
            order.iter().filter_map(|i| self.shards.get(*i).map(|s| (*i, lock(s)))).collect();
        let position = |shard: usize| order.binary_search(&shard).ok();
        let now = self.clock.now();

        let values: Vec<Option<Vec<u8>>> = keys
            .iter()
            .zip(&shard_of)
            .map(|(key, shard)| {
                let (_, guard) = held.get(position(*shard)?)?;
                guard.map.get(key).map(|e| e.value.clone())
            })
            .collect();
        let (answer, writes) = decide(&values, now);

        let new = writes.iter().zip(&values).filter(|(w, v)| w.is_some() && v.is_none()).count();
        if new > 0 {
            self.reserve(new, &mut held, now)?;
        }
        for (at_key, ((key, shard), write)) in keys.iter().zip(&shard_of).zip(writes).enumerate() {
            let (Some(next), Some(at)) = (write, position(*shard)) else { continue };
            let Some((_, guard)) = held.get_mut(at) else { continue };
            match guard.map.get_mut(key) {
                Some(entry) => {
                    entry.value = next.bytes;
                    entry.idle_at = next.idle_at;
                }
                None => {
                    if values.get(at_key).is_some_and(Option::is_some) {
                        // Read, then dropped as idle while making room: not
                        // counted among the new entries reserved above.
                        self.len.fetch_add(1, Ordering::Relaxed);
                    }
                    guard.expiry.push(Reverse((next.idle_at, key.clone())));
                    guard.map.insert(key.clone(), Entry { value: next.bytes, idle_at: next.idle_at });
                }
            }
        }
        Ok(answer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Limit;
    use crate::store::{BucketCheck, QuotaStore};
    use floodgate_core::time::{FakeClock, SECOND};

    const T0: Nanos = Nanos(1_700_002_800 * SECOND.get());

    fn window(limit: u64) -> Limit {
        Limit::new("fixed_window", limit, SECOND, "{}").unwrap()
    }

    fn item(key: &str, cost: u64) -> BucketCheck {
        BucketCheck { key: key.into(), limit: window(2), cost, shadow: false }
    }

    fn store(clock: &Arc<FakeClock>, max: usize) -> QuotaStore {
        QuotaStore::Memory(LocalStore::new(clock.clone(), max))
    }

    fn memory(store: &QuotaStore) -> &LocalStore {
        match store {
            QuotaStore::Memory(m) => m,
            QuotaStore::Redis(_) => unreachable!(),
        }
    }

    #[tokio::test]
    async fn a_full_store_drops_idle_buckets_then_refuses() {
        let clock = Arc::new(FakeClock::new(T0));
        let store = store(&clock, 2);
        assert!(store.check(&[item("a", 1)]).await.unwrap().committed);
        assert!(store.check(&[item("b", 1)]).await.unwrap().committed);
        assert_eq!(store.check(&[item("c", 1)]).await, Err(StoreFailure::Full));
        // A denied check stores nothing, so it needs no room.
        assert!(!store.check(&[item("c", 3)]).await.unwrap().committed);
        // Existing buckets still decide.
        assert!(store.check(&[item("a", 1)]).await.unwrap().committed);
        // Next window: a and b are idle; as much as needed makes room.
        clock.advance(SECOND);
        assert!(store.check(&[item("c", 1)]).await.unwrap().committed);
        assert!(memory(&store).sweep() <= 1);
        assert_eq!(memory(&store).len(), 1);
    }

    #[tokio::test]
    async fn a_clock_step_back_does_not_reopen_a_used_window() {
        let clock = Arc::new(FakeClock::new(T0 + SECOND));
        let store = store(&clock, 100);
        assert!(store.check(&[item("a", 2)]).await.unwrap().committed);
        // The wall clock steps back into the previous window.
        clock.set(T0 + Nanos(SECOND.get() / 2));
        assert!(!store.check(&[item("a", 1)]).await.unwrap().committed);
    }

    #[tokio::test]
    async fn sweep_drops_only_idle_buckets() {
        let clock = Arc::new(FakeClock::new(T0));
        let store = store(&clock, 100);
        let bucket = Limit::new("token_bucket", 1, SECOND, r#"{"burst":2}"#).unwrap();
        store
            .check(&[item("w", 1), BucketCheck { key: "t".into(), limit: bucket, cost: 2, shadow: false }])
            .await
            .unwrap();
        assert_eq!(memory(&store).sweep(), 0);
        clock.advance(SECOND);
        // The window rolled over; the bucket has earned one of two tokens.
        assert_eq!(memory(&store).sweep(), 1);
        clock.advance(SECOND);
        assert_eq!(memory(&store).sweep(), 1);
        assert!(memory(&store).is_empty());
    }

    #[tokio::test]
    async fn a_bucket_used_again_is_queued_again_not_dropped() {
        let clock = Arc::new(FakeClock::new(T0));
        let store = store(&clock, 100);
        let bucket = Limit::new("token_bucket", 1, SECOND, r#"{"burst":2}"#).unwrap();
        let take = |cost| [BucketCheck { key: "t".into(), limit: bucket.clone(), cost, shadow: false }];
        store.check(&take(1)).await.unwrap(); // idle in 1 s
        clock.advance(Nanos(SECOND.get() / 2));
        store.check(&take(1)).await.unwrap(); // empty: now idle at T0 + 2 s
        clock.advance(Nanos(SECOND.get() / 2));
        assert_eq!(memory(&store).sweep(), 0, "busier than queued: kept");
        assert_eq!(store.check(&take(0)).await.unwrap().decisions[0].remaining, 1);
        clock.advance(SECOND.times(2));
        assert_eq!(memory(&store).sweep(), 1);
    }
}
