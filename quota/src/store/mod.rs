//! Where counters live: in this process ([`MemoryStore`]) or in Redis
//! ([`RedisStore`]). The stores only keep bytes under keys; every decision
//! is made here, by one Rust code path ([`decide`], the core's algorithms),
//! inside a store transaction: the memory store runs it under its shard
//! locks, the Redis store between one read and one compare-and-swap write
//! (retried when a key changed meanwhile). So both stores decide identically.

mod decide;
mod memory;
mod redis;

use self::decide::LeaseRecord;
pub use self::decide::{Nanos, Next};
pub use self::memory::MemoryStore;
pub use self::redis::{RedisOptions, RedisStore, CLUSTER_SCHEME};

use std::collections::HashMap;
use std::fmt;

use crate::clock::Micros;
use crate::config::Limit;

/// A retry-after that never comes (a cost above the capacity).
pub const NEVER: Micros = Micros::MAX;

/// The store key of a bucket: the domain as a Redis Cluster hash tag (every
/// bucket one call touches must sit in one slot for the script to be atomic),
/// the algorithm's tag (buckets of different algorithms hold different
/// state; see [`crate::config::ALGORITHMS`]), and the descriptor's entries as
/// JSON (unambiguous whatever the values contain).
pub fn bucket_key(domain: &str, limit: &Limit, entries: &[(String, String)]) -> String {
    let entries = serde_json::to_string(entries).unwrap_or_default();
    format!("fg:{{{domain}}}:{}:{entries}", limit.tag())
}

/// How long a lease's record outlives the lease: a caller may retry an
/// ambiguous lease, or return its unused tokens, until then.
pub const LEASE_RECORD_MARGIN: Micros = 30 * crate::clock::SECOND_US;

/// The store key of a lease's record: in the domain's hash tag (beside the
/// buckets it names), then the caller's id (`A-Za-z0-9_-`, so it cannot
/// look like a bucket key).
pub fn lease_key(domain: &str, id: &str) -> String {
    format!("fg:{{{domain}}}:lease:{id}")
}

/// One bucket of a check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckItem {
    /// See [`bucket_key`].
    pub key: String,
    /// The rule's limit.
    pub limit: Limit,
    /// Units to take.
    pub cost: u64,
    /// Shadow mode: a denial here does not block the others.
    pub shadow: bool,
}

/// One bucket of a lease.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseItem {
    /// See [`bucket_key`].
    pub key: String,
    /// The rule's limit.
    pub limit: Limit,
    /// The most tokens the caller wants.
    pub wanted: u64,
    /// The caller's observed consumption, tokens per second.
    pub rate: Option<f64>,
    /// See [`lease_key`]: where the grant is recorded, atomically with it. A
    /// lease whose record exists is not granted again but answered from it.
    pub record: String,
}

/// What one lease got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// Tokens granted (0 when nothing is left).
    pub granted: u64,
    /// Tokens left in the bucket after the grant.
    pub remaining: u64,
    /// Time until more quota becomes available.
    pub reset: Micros,
    /// The fixed window the tokens belong to (0 for the other algorithms).
    pub window: u64,
    /// How long the caller may use the tokens.
    pub valid: Micros,
    /// The lease was already recorded: this repeats its grant, nothing was taken.
    pub replayed: bool,
}

/// Unused leased tokens to give back: once per lease, at most what it
/// granted, and only where the tokens still count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReturnItem {
    /// The lease's record (see [`lease_key`]).
    pub record: String,
    /// Tokens to give back.
    pub tokens: u64,
}

/// What was decided for one bucket (times in microseconds, rounded up).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Whether the cost was admitted.
    pub allowed: bool,
    /// Units left after the decision.
    pub remaining: u64,
    /// Time until more quota becomes available (0 when the bucket is full).
    pub reset: Micros,
    /// When denied, when the same cost would be admitted ([`NEVER`]: never).
    pub retry_after: Micros,
}

/// The result of a check: whether the costs were taken, and each bucket's
/// decision (times in microseconds; `retry_after` [`NEVER`] for never).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckOutcome {
    /// True when every non-shadow bucket admitted and the costs were taken.
    pub committed: bool,
    /// One per item, in order. When not committed, buckets that would have
    /// admitted report their untouched state.
    pub decisions: Vec<Decision>,
}

/// Why the store could not decide. Every variant maps to 503: the caller
/// falls back to its local limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// The store did not answer within the configured time.
    Timeout,
    /// The store answered with an error or could not be reached.
    Unavailable(String),
    /// The memory store holds its maximum number of buckets, none idle.
    Full,
    /// Every attempt lost a race: another writer changed a key in between.
    Contended,
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Timeout => write!(f, "the store did not answer in time"),
            StoreError::Unavailable(why) => write!(f, "the store is unavailable: {why}"),
            StoreError::Full => write!(f, "the memory store is full (every bucket is in use)"),
            StoreError::Contended => write!(f, "the store is busy: the buckets kept changing under every attempt"),
        }
    }
}

impl std::error::Error for StoreError {}

impl StoreError {
    /// A short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Timeout => "timeout",
            StoreError::Unavailable(_) => "unavailable",
            StoreError::Full => "full",
            StoreError::Contended => "contended",
        }
    }
}

/// The configured store.
#[derive(Debug)]
pub enum Store {
    /// Counters in this process.
    Memory(MemoryStore),
    /// Counters in Redis, shared by every service instance using it.
    Redis(Box<RedisStore>),
}

impl Store {
    /// `memory` or `redis`, for metrics and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Store::Memory(_) => "memory",
            Store::Redis(_) => "redis",
        }
    }

    /// Reads `keys`, lets `decide` (given their bytes, `None` when absent,
    /// and now) answer and say what to write (one slot per key, `None`:
    /// unchanged), and writes it, all or nothing, as if alone.
    async fn transact<A>(
        &self,
        keys: &[String],
        decide: impl FnMut(&[Option<Vec<u8>>], Nanos) -> (A, Writes),
    ) -> Result<A, StoreError> {
        match self {
            Store::Memory(m) => m.transact(keys, decide),
            Store::Redis(r) => r.transact(keys, decide).await,
        }
    }

    /// Takes each item's cost from its bucket if all non-shadow buckets
    /// admit. Items must name distinct buckets.
    pub async fn check(&self, items: &[CheckItem]) -> Result<CheckOutcome, StoreError> {
        let keys: Vec<String> = items.iter().map(|i| i.key.clone()).collect();
        self.transact(&keys, |values, now| check(items, values, now)).await
    }

    /// Takes a batch of tokens from each bucket and records each grant under
    /// its lease's record key; a lease already recorded is answered from its
    /// record. Leases are taken in order: two of one bucket both see what
    /// the first took.
    pub async fn lease(&self, items: &[LeaseItem], ttl: Micros) -> Result<Vec<Grant>, StoreError> {
        let mut keys = Keys::default();
        let slots: Vec<(usize, usize)> = items.iter().map(|i| (keys.add(&i.key), keys.add(&i.record))).collect();
        let ttl = decide::nanos(ttl);
        self.transact(&keys.list, |values, now| lease(items, &slots, values, now, ttl)).await
    }

    /// Gives back unused tokens of recorded leases; returns how many each
    /// took back.
    pub async fn give_back(&self, items: &[ReturnItem]) -> Result<Vec<u64>, StoreError> {
        let mut records = Keys::default();
        let at: Vec<usize> = items.iter().map(|i| records.add(&i.record)).collect();
        for _ in 0..RETURN_ATTEMPTS {
            // Which bucket each lease came from; the decision below checks
            // that the records still say so.
            let buckets: Vec<Option<String>> = self
                .transact(&records.list, |values, now| {
                    let named = values.iter().map(|v| LeaseRecord::live(v.as_deref(), now).map(|r| r.bucket)).collect();
                    (named, vec![None; values.len()])
                })
                .await?;
            let mut keys = records.clone();
            let slots: Vec<(usize, Option<usize>)> =
                at.iter().map(|r| (*r, buckets.get(*r).cloned().flatten().map(|b| keys.add(&b)))).collect();
            let list = keys.list.clone();
            let outcome = self.transact(&list, |values, now| give_back(items, &slots, &list, values, now)).await?;
            if let Some(taken) = outcome {
                return Ok(taken);
            }
        }
        Err(StoreError::Contended)
    }

    /// Whether the store answers now.
    pub async fn ping(&self) -> Result<(), StoreError> {
        match self {
            Store::Memory(_) => Ok(()),
            Store::Redis(r) => r.ping().await,
        }
    }
}

/// What a transaction writes: per key, the new bytes and when they become
/// idle (`None`: leave the key as it is).
pub type Writes = Vec<Option<Next>>;

/// How often a return starts over because a lease record changed between
/// reading it and deciding (a lease id reused after its record expired).
const RETURN_ATTEMPTS: usize = 4;

/// A list of distinct keys, each with its position.
#[derive(Debug, Default, Clone)]
struct Keys {
    list: Vec<String>,
    at: HashMap<String, usize>,
}

impl Keys {
    fn add(&mut self, key: &str) -> usize {
        if let Some(at) = self.at.get(key) {
            return *at;
        }
        self.list.push(key.to_string());
        self.at.insert(key.to_string(), self.list.len() - 1);
        self.list.len() - 1
    }
}

fn stored(values: &[Option<Vec<u8>>], at: usize) -> Option<&[u8]> {
    values.get(at).and_then(|v| v.as_deref())
}

fn check(items: &[CheckItem], values: &[Option<Vec<u8>>], now: Nanos) -> (CheckOutcome, Writes) {
    let mut decisions = Vec::with_capacity(items.len());
    let mut writes: Writes = vec![None; values.len()];
    let mut committed = true;
    for (at, item) in items.iter().enumerate() {
        let (d, next) = decide::check(&item.limit, stored(values, at), now, item.cost);
        committed &= d.allowed || item.shadow;
        if d.allowed && stored(values, at) != Some(next.bytes.as_slice()) {
            if let Some(slot) = writes.get_mut(at) {
                *slot = Some(next);
            }
        }
        decisions.push(d);
    }
    if !committed {
        // Nothing is taken anywhere; admitting buckets report their
        // untouched state.
        writes.iter_mut().for_each(|w| *w = None);
        for (at, (item, d)) in items.iter().zip(decisions.iter_mut()).enumerate() {
            if d.allowed {
                *d = decide::peek(&item.limit, stored(values, at), now);
            }
        }
    }
    (CheckOutcome { committed, decisions }, writes)
}

/// Sets key `at` to `next` in both the working values and the writes.
fn put(values: &mut [Option<Vec<u8>>], writes: &mut Writes, at: usize, next: Next) {
    if let Some(value) = values.get_mut(at) {
        *value = Some(next.bytes.clone());
    }
    if let Some(write) = writes.get_mut(at) {
        *write = Some(next);
    }
}

fn lease(
    items: &[LeaseItem],
    slots: &[(usize, usize)],
    values: &[Option<Vec<u8>>],
    now: Nanos,
    ttl: Nanos,
) -> (Vec<Grant>, Writes) {
    let mut values = values.to_vec();
    let mut writes: Writes = vec![None; values.len()];
    let mut grants = Vec::with_capacity(items.len());
    for (item, &(bucket, record)) in items.iter().zip(slots) {
        if let Some(done) = LeaseRecord::live(stored(&values, record), now) {
            let d = decide::peek(&item.limit, stored(&values, bucket), now);
            grants.push(Grant {
                granted: done.granted,
                remaining: d.remaining,
                reset: d.reset,
                window: done.window,
                valid: done.valid_until.saturating_sub(now) / 1_000,
                replayed: true,
            });
            continue;
        }
        let leased = decide::lease(&item.limit, stored(&values, bucket), now, item.wanted, item.rate, ttl);
        if leased.granted > 0 {
            let valid_until = now.saturating_add(leased.valid);
            let done = LeaseRecord {
                bucket: item.key.clone(),
                limit: item.limit.clone(),
                window: leased.window,
                granted: leased.granted,
                granted_at: now,
                returned: false,
                valid_until,
                expires_at: valid_until.saturating_add(decide::nanos(LEASE_RECORD_MARGIN)),
            };
            let idle_at = done.expires_at;
            put(&mut values, &mut writes, bucket, leased.next);
            put(&mut values, &mut writes, record, Next { bytes: done.encode(), idle_at });
        }
        grants.push(Grant {
            granted: leased.granted,
            remaining: leased.decision.remaining,
            reset: leased.decision.reset,
            window: leased.window,
            valid: leased.valid / 1_000,
            replayed: false,
        });
    }
    (grants, writes)
}

/// `None` when a record no longer names the bucket read for it: start over.
fn give_back(
    items: &[ReturnItem],
    slots: &[(usize, Option<usize>)],
    keys: &[String],
    values: &[Option<Vec<u8>>],
    now: Nanos,
) -> (Option<Vec<u64>>, Writes) {
    let mut values = values.to_vec();
    let mut writes: Writes = vec![None; values.len()];
    let mut taken = Vec::with_capacity(items.len());
    for (item, &(record, bucket)) in items.iter().zip(slots) {
        let Some(mut done) = LeaseRecord::live(stored(&values, record), now) else {
            taken.push(0);
            continue;
        };
        let Some(bucket) = bucket.filter(|b| keys.get(*b) == Some(&done.bucket)) else {
            return (None, vec![None; values.len()]);
        };
        let (back, next) = decide::give_back(&done, stored(&values, bucket), now, item.tokens);
        if !done.returned {
            done.returned = true;
            let idle_at = done.expires_at;
            put(&mut values, &mut writes, record, Next { bytes: done.encode(), idle_at });
        }
        if let Some(next) = next {
            put(&mut values, &mut writes, bucket, next);
        }
        taken.push(back);
    }
    (Some(taken), writes)
}
