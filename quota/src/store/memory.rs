//! The embedded store: buckets in a hash map behind one mutex, decided by
//! `floodgate_core::algorithm` (the filter's own code) on microseconds.
//!
//! One mutex, not shards: a check over several buckets must be atomic, the
//! critical section is a few hundred nanoseconds, and the service is I/O
//! bound long before this lock is contended.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use floodgate_core::algorithm::{Decision, FixedWindow, TokenBucket, TokenState, WindowState};

use super::LEASE_RECORD_MARGIN;
use super::{CheckItem, CheckOutcome, Grant, LeaseItem, ReturnItem, StoreError};
use crate::clock::{Clock, Micros};
use crate::config::{Algorithm, Limit};
use crate::grant::grant_cap;

#[derive(Debug, Clone, Copy)]
enum State {
    Token(TokenState),
    Window(WindowState),
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// The limit last applied, so the sweeper can tell an idle bucket.
    limit: Limit,
    state: State,
}

/// What a granted lease was, so that a retry is answered from it and a
/// return gives back at most what it granted.
#[derive(Debug, Clone)]
struct LeaseRecord {
    bucket: String,
    limit: Limit,
    window: u64,
    granted: u64,
    /// Given back once already: later returns give back nothing, so that
    /// retrying a return is harmless.
    returned: bool,
    valid_until: Micros,
    expires_at: Micros,
}

#[derive(Debug, Default)]
struct Maps {
    buckets: HashMap<String, Bucket>,
    leases: HashMap<String, LeaseRecord>,
}

/// Counters in this process.
#[derive(Debug)]
pub struct MemoryStore {
    clock: Arc<dyn Clock>,
    maps: Mutex<Maps>,
    max_buckets: usize,
}

fn token_bucket(limit: &Limit) -> TokenBucket {
    TokenBucket::new(limit.limit, limit.period, limit.capacity)
}

fn fixed_window(limit: &Limit) -> FixedWindow {
    FixedWindow::new(limit.limit, limit.period)
}

/// The bucket's state as `limit`'s algorithm reads it; a missing bucket, or
/// one of another algorithm, is fresh.
fn token_state(limit: &Limit, bucket: Option<&Bucket>, now: Micros) -> TokenState {
    match bucket.map(|b| b.state) {
        Some(State::Token(s)) => s,
        _ => token_bucket(limit).fresh(now),
    }
}

fn window_state(limit: &Limit, bucket: Option<&Bucket>, now: Micros) -> WindowState {
    let window = fixed_window(limit);
    match bucket.map(|b| b.state) {
        // The core decides which stored window still counts (as the Redis
        // script does), so both stores agree even after a clock step back.
        Some(State::Window(s)) => window.current(s, now),
        _ => window.fresh(now),
    }
}

fn decide(limit: &Limit, bucket: Option<&Bucket>, now: Micros, cost: u64) -> (Decision, State) {
    match limit.algorithm {
        Algorithm::TokenBucket => {
            let (d, after) = token_bucket(limit).decide(token_state(limit, bucket, now), now, cost);
            (d, State::Token(after))
        }
        Algorithm::FixedWindow => {
            let (d, after) = fixed_window(limit).decide(window_state(limit, bucket, now), now, cost);
            (d, State::Window(after))
        }
    }
}

/// Updates in place when the bucket exists: no key copy on the hot path.
fn put(map: &mut HashMap<String, Bucket>, key: &str, bucket: Bucket) {
    match map.get_mut(key) {
        Some(slot) => *slot = bucket,
        None => {
            map.insert(key.to_string(), bucket);
        }
    }
}

fn is_idle(bucket: &Bucket, now: Micros) -> bool {
    match bucket.state {
        State::Token(s) => token_bucket(&bucket.limit).is_idle(s, now),
        State::Window(s) => fixed_window(&bucket.limit).is_idle(s, now),
    }
}

impl MemoryStore {
    /// A store reading time from `clock` and holding at most `max_buckets`
    /// buckets (idle ones are evicted first; see [`MemoryStore::sweep`]).
    pub fn new(clock: Arc<dyn Clock>, max_buckets: usize) -> Self {
        Self { clock, maps: Mutex::new(Maps::default()), max_buckets: max_buckets.max(1) }
    }

    fn lock(&self) -> MutexGuard<'_, Maps> {
        // A panic while holding the lock cannot leave a bucket half-written
        // (each is replaced whole), so a poisoned map is still consistent.
        self.maps.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Number of buckets and lease records held.
    pub fn len(&self) -> usize {
        let maps = self.lock();
        maps.buckets.len() + maps.leases.len()
    }

    /// True when no bucket is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every idle bucket (one indistinguishable from a fresh one, so
    /// dropping it changes no decision) and every expired lease record.
    /// Returns how many were dropped.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now_us();
        let mut maps = self.lock();
        Self::drop_idle(&mut maps, now)
    }

    fn drop_idle(maps: &mut Maps, now: Micros) -> usize {
        let before = maps.buckets.len() + maps.leases.len();
        maps.buckets.retain(|_, b| !is_idle(b, now));
        maps.leases.retain(|_, r| r.expires_at > now);
        before - maps.buckets.len() - maps.leases.len()
    }

    /// Makes room for `new` more entries (buckets and lease records).
    fn make_room(maps: &mut Maps, new: usize, max: usize, now: Micros) -> Result<(), StoreError> {
        if maps.buckets.len() + maps.leases.len() + new <= max {
            return Ok(());
        }
        Self::drop_idle(maps, now);
        if maps.buckets.len() + maps.leases.len() + new <= max {
            Ok(())
        } else {
            Err(StoreError::Full)
        }
    }

    /// See [`super::Store::check`].
    pub fn check(&self, items: &[CheckItem]) -> Result<CheckOutcome, StoreError> {
        let now = self.clock.now_us();
        let mut maps = self.lock();
        let map = &mut maps.buckets;
        let mut decisions = Vec::with_capacity(items.len());
        let mut afters = Vec::with_capacity(items.len());
        let mut committed = true;
        for item in items {
            let (d, after) = decide(&item.limit, map.get(&item.key), now, item.cost);
            if !d.allowed && !item.shadow {
                committed = false;
            }
            decisions.push(d);
            afters.push(after);
        }
        if committed {
            let new = items.iter().zip(&decisions).filter(|(i, d)| d.allowed && !map.contains_key(&i.key)).count();
            Self::make_room(&mut maps, new, self.max_buckets, now)?;
            for ((item, d), after) in items.iter().zip(&decisions).zip(afters) {
                if d.allowed {
                    put(&mut maps.buckets, &item.key, Bucket { limit: item.limit, state: after });
                }
            }
        } else {
            for (item, d) in items.iter().zip(decisions.iter_mut()) {
                if d.allowed {
                    *d = decide(&item.limit, maps.buckets.get(&item.key), now, 0).0;
                }
            }
        }
        Ok(CheckOutcome { committed, decisions })
    }

    /// See [`super::Store::lease`].
    pub fn lease(&self, items: &[LeaseItem], ttl: Micros) -> Result<Vec<Grant>, StoreError> {
        let now = self.clock.now_us();
        let mut maps = self.lock();
        // Room for every bucket and record this call may add.
        let new = items.iter().filter(|i| !maps.buckets.contains_key(&i.key)).count() + items.len();
        Self::make_room(&mut maps, new, self.max_buckets, now)?;
        let mut grants = Vec::with_capacity(items.len());
        for item in items {
            let limit = &item.limit;
            let bucket = maps.buckets.get(&item.key);
            if let Some(record) = maps.leases.get(&item.record).filter(|r| r.expires_at > now) {
                let d = decide(limit, bucket, now, 0).0;
                grants.push(Grant {
                    granted: record.granted,
                    remaining: d.remaining,
                    reset: d.reset,
                    window: record.window,
                    valid: record.valid_until.saturating_sub(now),
                    replayed: true,
                });
                continue;
            }
            let (remaining, horizon, window, valid) = match limit.algorithm {
                Algorithm::TokenBucket => {
                    let s = token_bucket(limit).refill(token_state(limit, bucket, now), now);
                    (s.tokens, limit.period, 0, ttl)
                }
                Algorithm::FixedWindow => {
                    let s = window_state(limit, bucket, now);
                    let horizon = s.window.saturating_add(1).saturating_mul(limit.period).saturating_sub(now);
                    (limit.limit.saturating_sub(s.used), horizon, s.window, ttl.min(horizon))
                }
            };
            let granted = item.want.min(grant_cap(remaining, limit.capacity, horizon, ttl));
            let (d, after) = decide(limit, bucket, now, granted);
            if granted > 0 {
                put(&mut maps.buckets, &item.key, Bucket { limit: *limit, state: after });
                let valid_until = now.saturating_add(valid);
                let record = LeaseRecord {
                    bucket: item.key.clone(),
                    limit: *limit,
                    window,
                    granted,
                    returned: false,
                    valid_until,
                    expires_at: valid_until.saturating_add(LEASE_RECORD_MARGIN),
                };
                maps.leases.insert(item.record.clone(), record);
            }
            grants.push(Grant { granted, remaining: d.remaining, reset: d.reset, window, valid, replayed: false });
        }
        Ok(grants)
    }

    /// See [`super::Store::give_back`].
    pub fn give_back(&self, items: &[ReturnItem]) -> Result<Vec<u64>, StoreError> {
        let now = self.clock.now_us();
        let mut maps = self.lock();
        let Maps { buckets, leases } = &mut *maps;
        let mut taken = Vec::with_capacity(items.len());
        for item in items {
            let Some(record) = leases.get_mut(&item.record).filter(|r| r.expires_at > now) else {
                taken.push(0);
                continue;
            };
            if record.returned {
                taken.push(0);
                continue;
            }
            record.returned = true;
            let tokens = item.tokens.min(record.granted);
            let limit = &record.limit;
            // No bucket: it is full (or its window unused); nothing to return into.
            let back = match buckets.get_mut(&record.bucket).map(|b| (b.state, b)) {
                Some((State::Token(s), bucket)) => {
                    let tb = token_bucket(limit);
                    let before = tb.refill(s, now);
                    let back = tokens.min(limit.capacity.saturating_sub(before.tokens));
                    if back > 0 {
                        bucket.state = State::Token(tb.refund(s, now, back));
                    }
                    back
                }
                Some((State::Window(s), bucket)) if s.window == now / limit.period && s.window == record.window => {
                    let back = tokens.min(s.used);
                    if back > 0 {
                        bucket.state = State::Window(fixed_window(limit).refund(s, now, back));
                    }
                    back
                }
                _ => 0,
            };
            taken.push(back);
        }
        Ok(taken)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{ManualClock, SECOND_US};

    const T0: Micros = 1_700_002_800 * SECOND_US;

    fn window(limit: u64) -> Limit {
        Limit { algorithm: Algorithm::FixedWindow, limit, period: SECOND_US, capacity: limit }
    }

    fn item(key: &str, cost: u64) -> CheckItem {
        CheckItem { key: key.into(), limit: window(2), cost, shadow: false }
    }

    #[test]
    fn a_full_store_drops_idle_buckets_then_refuses() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = MemoryStore::new(clock.clone(), 2);
        assert!(store.check(&[item("a", 1)]).unwrap().committed);
        assert!(store.check(&[item("b", 1)]).unwrap().committed);
        assert_eq!(store.check(&[item("c", 1)]), Err(StoreError::Full));
        // A denied check stores nothing, so it needs no room.
        assert!(!store.check(&[item("c", 3)]).unwrap().committed);
        // Next window: a and b are idle and make room.
        clock.advance(SECOND_US);
        assert!(store.check(&[item("c", 1)]).unwrap().committed);
        assert_eq!(store.len(), 1);
    }

    #[test]
    fn a_clock_step_back_does_not_reopen_a_used_window() {
        let clock = Arc::new(ManualClock::new(T0 + SECOND_US));
        let store = MemoryStore::new(clock.clone(), 100);
        assert!(store.check(&[item("a", 2)]).unwrap().committed);
        // The wall clock steps back into the previous window.
        clock.set(T0 + SECOND_US / 2);
        assert!(!store.check(&[item("a", 1)]).unwrap().committed);
    }

    #[test]
    fn sweep_drops_only_idle_buckets() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = MemoryStore::new(clock.clone(), 100);
        let bucket = Limit { algorithm: Algorithm::TokenBucket, limit: 1, period: SECOND_US, capacity: 2 };
        store.check(&[item("w", 1), CheckItem { key: "t".into(), limit: bucket, cost: 2, shadow: false }]).unwrap();
        assert_eq!(store.sweep(), 0);
        clock.advance(SECOND_US);
        // The window rolled over; the bucket has earned one of two tokens.
        assert_eq!(store.sweep(), 1);
        clock.advance(SECOND_US);
        assert_eq!(store.sweep(), 1);
        assert!(store.is_empty());
    }
}
