//! Where counters live: in this process ([`LocalStore`]) or in Redis
//! ([`RedisStore`]). The stores only keep bytes under keys; every decision
//! is made here, by one Rust code path ([`decide`], the core's algorithms),
//! inside a store transaction: the memory store runs it under its shard
//! locks, the Redis store between one read and one compare-and-swap write
//! (retried when a key changed meanwhile). So both stores decide identically.

pub mod decide;
mod lanes;
mod memory;
mod redis;

use self::decide::LeaseRecord;
pub use self::decide::{Kind, Next};
pub use self::memory::LocalStore;
pub use self::redis::{RedisOptions, RedisStore, CLUSTER_SCHEME};

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use floodgate_core::algorithm::Decision;
use floodgate_core::time::Nanos;

use crate::config::Limit;

/// The store key of a bucket: the domain as a Redis Cluster hash tag (every
/// bucket one call touches must sit in one slot for the script to be atomic),
/// the algorithm's key (buckets of different algorithms hold different
/// state; see `Registration::key`), and the descriptor's entries as JSON
/// (unambiguous whatever the values contain).
pub fn bucket_key(domain: &str, limit: &Limit, entries: &[(String, String)]) -> String {
    let entries = serde_json::to_string(entries).unwrap_or_default();
    format!("fg:{{{domain}}}:{}:{entries}", limit.algorithm().key)
}

/// How long a lease's record outlives the lease: a caller may retry an
/// ambiguous lease, or return its unused tokens, until then.
pub const LEASE_RECORD_MARGIN: Nanos = Nanos::from_secs(30);

/// The store key of a lease's record: in the domain's hash tag (beside the
/// buckets it names), then the caller's id (`A-Za-z0-9_-`, so it cannot
/// look like a bucket key).
pub fn lease_key(domain: &str, id: &str) -> String {
    format!("fg:{{{domain}}}:lease:{id}")
}

/// One bucket of a check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketCheck {
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
pub struct BucketLease {
    /// See [`bucket_key`].
    pub key: String,
    /// The rule's limit.
    pub limit: Limit,
    /// The most tokens the caller wants.
    pub wanted: u64,
    /// The caller's observed consumption, tokens per second.
    pub rate: Option<f64>,
    /// The window the caller wants tokens of: the next one is leased ahead
    /// (see `decide::lease`); `None` for the window that counts now.
    pub window: Option<u64>,
    /// The caller can hold an allowance (see `decide::lease`).
    pub per_window: bool,
    /// See [`lease_key`]: where the grant is recorded, atomically with it. A
    /// lease whose record exists is not granted again but answered from it.
    pub record: String,
}

/// What one lease got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseOutcome {
    /// Tokens granted (0 when nothing is left).
    pub granted: u64,
    /// Tokens left in the bucket after the grant.
    pub remaining: u64,
    /// Time until more quota becomes available.
    pub reset: Nanos,
    /// The algorithm's window the tokens are counted in (0 for algorithms
    /// without windows).
    pub window: u64,
    /// For an allowance, how many windows from `window` on it holds
    /// `granted` tokens in (0: a lease of one window).
    pub windows: u64,
    /// How long (from now) the caller may use the tokens.
    pub valid: Nanos,
    /// How long until they may be used: zero, or for a lease ahead, the
    /// time until the window they are for starts.
    pub starts: Nanos,
    /// The lease was already recorded: this repeats its grant, nothing was taken.
    pub replayed: bool,
}

/// What a lease call got: every lease's outcome, or, when a lease's id is
/// that of a recorded lease of another bucket, which lease that is (and
/// nothing was taken).
pub type LeaseAnswer = Result<Vec<LeaseOutcome>, IdInUse>;

/// A lease whose id names a lease recorded for another bucket (another
/// descriptor, or another rule's algorithm): not a retry of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdInUse {
    /// Which lease of the call.
    pub index: usize,
    /// The bucket the recorded lease is of.
    pub bucket: String,
}

/// What one return took back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReturnOutcome {
    /// Tokens taken back.
    pub returned: u64,
    /// The lease had been returned already (by this return's first
    /// attempt, say): this one took back nothing more.
    pub replayed: bool,
}

/// Unused leased tokens to give back: once per lease, at most what it
/// granted, and only where the tokens still count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseReturn {
    /// The lease's record (see [`lease_key`]).
    pub record: String,
    /// Tokens to give back.
    pub tokens: u64,
}

/// The result of a check: whether the costs were taken, and each bucket's
/// decision (the core's: `retry_after` is `Nanos::MAX` for never).
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
pub enum StoreFailure {
    /// The store did not answer within the configured time.
    Timeout,
    /// The store answered with an error or could not be reached.
    Unavailable(String),
    /// The memory store holds its maximum number of buckets, none idle.
    Full,
    /// Every attempt lost a race: another writer changed a key in between.
    Contended,
}

impl fmt::Display for StoreFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreFailure::Timeout => write!(f, "the store did not answer in time"),
            StoreFailure::Unavailable(why) => write!(f, "the store is unavailable: {why}"),
            StoreFailure::Full => write!(f, "the memory store is full (every bucket is in use)"),
            StoreFailure::Contended => write!(f, "the store is busy: the buckets kept changing under every attempt"),
        }
    }
}

impl std::error::Error for StoreFailure {}

impl StoreFailure {
    /// A short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreFailure::Timeout => "timeout",
            StoreFailure::Unavailable(_) => "unavailable",
            StoreFailure::Full => "full",
            StoreFailure::Contended => "contended",
        }
    }
}

/// The configured store.
#[derive(Debug)]
pub enum QuotaStore {
    /// Counters in this process.
    Memory(LocalStore),
    /// Counters in Redis, shared by every service instance using it.
    Redis(Arc<RedisStore>),
}

impl QuotaStore {
    /// The kinds of [`StoreFailure`] this store can meet, as metric labels.
    pub fn failure_kinds(&self) -> &'static [&'static str] {
        match self {
            QuotaStore::Memory(_) => &["full"],
            QuotaStore::Redis(_) => &["timeout", "unavailable", "contended"],
        }
    }

    /// `memory` or `redis`, for metrics and logs.
    pub fn name(&self) -> &'static str {
        match self {
            QuotaStore::Memory(_) => "memory",
            QuotaStore::Redis(_) => "redis",
        }
    }

    /// Reads `keys`, lets `decide` (given their bytes, `None` when absent,
    /// and now) answer and say what to write (one slot per key, `None`:
    /// unchanged), and writes it, all or nothing, as if alone. Transactions
    /// on a hot key share one store transaction (see [`lanes`]).
    async fn transact<A: Send + 'static>(
        &self,
        keys: Vec<String>,
        decide: impl FnMut(&[Option<Vec<u8>>], Nanos) -> (A, Writes) + Send + 'static,
    ) -> Result<A, StoreFailure> {
        // A Redis call ends by `--store-timeout`, its turn on a hot key
        // included; memory decisions take microseconds.
        let deadline = match self {
            QuotaStore::Memory(_) => None,
            QuotaStore::Redis(r) => Some(r.deadline()),
        };
        let (job, outcome, answer) = lanes::job(keys, deadline, decide);
        match self {
            QuotaStore::Memory(m) => m.run(job),
            QuotaStore::Redis(r) => r.run(job),
        }
        outcome.await.map_err(|_| StoreFailure::Unavailable("the store dropped the transaction".into()))??;
        lanes::answer(&answer)
    }

    /// Takes each item's cost from its bucket if all non-shadow buckets
    /// admit. Items must name distinct buckets.
    pub async fn check(&self, items: &[BucketCheck]) -> Result<CheckOutcome, StoreFailure> {
        let keys: Vec<String> = items.iter().map(|i| i.key.clone()).collect();
        let items = items.to_vec();
        self.transact(keys, move |values, now| check(&items, values, now)).await
    }

    /// Takes a batch of tokens from each bucket and records each grant under
    /// its lease's record key; a lease already recorded is answered from its
    /// record (a returned one as holding nothing), unless it is of another
    /// bucket. Leases are taken in order: two of one bucket both see what
    /// the first took.
    pub async fn lease(&self, items: &[BucketLease], ttl: Nanos) -> Result<LeaseAnswer, StoreFailure> {
        let mut keys = Keys::default();
        let slots: Vec<(usize, usize)> = items.iter().map(|i| (keys.add(&i.key), keys.add(&i.record))).collect();
        let items = items.to_vec();
        self.transact(keys.list, move |values, now| lease(&items, &slots, values, now, ttl)).await
    }

    /// Gives back unused tokens of recorded leases; returns how many each
    /// took back.
    pub async fn give_back(&self, items: &[LeaseReturn]) -> Result<Vec<ReturnOutcome>, StoreFailure> {
        let mut records = Keys::default();
        let at: Vec<usize> = items.iter().map(|i| records.add(&i.record)).collect();
        for _ in 0..RETURN_ATTEMPTS {
            // Which bucket each lease came from; the decision below checks
            // that the records still say so.
            let buckets: Vec<Option<String>> = self
                .transact(records.list.clone(), |values, now| {
                    let named = values.iter().map(|v| LeaseRecord::live(v.as_deref(), now).map(|r| r.bucket)).collect();
                    (named, vec![None; values.len()])
                })
                .await?;
            let mut keys = records.clone();
            let slots: Vec<(usize, Option<usize>)> =
                at.iter().map(|r| (*r, buckets.get(*r).cloned().flatten().map(|b| keys.add(&b)))).collect();
            let (list, items) = (keys.list.clone(), items.to_vec());
            let outcome =
                self.transact(keys.list, move |values, now| give_back(&items, &slots, &list, values, now)).await?;
            if let Some(taken) = outcome {
                return Ok(taken);
            }
        }
        Err(StoreFailure::Contended)
    }

    /// Whether the store answers now.
    pub async fn ping(&self) -> Result<(), StoreFailure> {
        match self {
            QuotaStore::Memory(_) => Ok(()),
            QuotaStore::Redis(r) => r.ping().await,
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

fn check(items: &[BucketCheck], values: &[Option<Vec<u8>>], now: Nanos) -> (CheckOutcome, Writes) {
    let mut decisions = Vec::with_capacity(items.len());
    let mut writes: Writes = vec![None; values.len()];
    let mut committed = true;
    for (at, item) in items.iter().enumerate() {
        let (d, next) = decide::check(&item.limit, stored(values, at), now, item.cost);
        committed &= d.allowed() || item.shadow;
        if d.allowed() && stored(values, at) != Some(next.bytes.as_slice()) {
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
            if d.allowed() {
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
    items: &[BucketLease],
    slots: &[(usize, usize)],
    values: &[Option<Vec<u8>>],
    now: Nanos,
    ttl: Nanos,
) -> (LeaseAnswer, Writes) {
    let mut values = values.to_vec();
    let mut writes: Writes = vec![None; values.len()];
    let mut grants = Vec::with_capacity(items.len());
    for (index, (item, &(bucket, record))) in items.iter().zip(slots).enumerate() {
        if let Some(done) = LeaseRecord::live(stored(&values, record), now) {
            if done.bucket != item.key {
                return (Err(IdInUse { index, bucket: done.bucket }), vec![None; values.len()]);
            }
            let d = decide::peek(&item.limit, stored(&values, bucket), now);
            // A returned lease holds nothing any more.
            let (granted, valid) =
                if done.returned { (0, Nanos::ZERO) } else { (done.granted, done.valid_until - now) };
            grants.push(LeaseOutcome {
                granted,
                remaining: d.remaining,
                reset: d.reset,
                window: done.window,
                windows: done.windows,
                valid,
                starts: done.granted_at - now,
                replayed: true,
            });
            continue;
        }
        let ask = (item.wanted, item.rate, item.window, item.per_window);
        let leased = decide::lease(&item.limit, &item.key, stored(&values, bucket), now, ask, ttl);
        if leased.granted > 0 {
            let valid_until = now + leased.valid;
            let done = LeaseRecord {
                bucket: item.key.clone(),
                limit: item.limit.clone(),
                window: leased.window,
                windows: leased.windows,
                granted: leased.granted,
                granted_at: leased.starts_at,
                returned: false,
                valid_until,
                expires_at: valid_until + LEASE_RECORD_MARGIN,
            };
            put(&mut values, &mut writes, bucket, leased.next);
            put(&mut values, &mut writes, record, done.to_next());
        }
        grants.push(LeaseOutcome {
            granted: leased.granted,
            remaining: leased.decision.remaining,
            reset: leased.decision.reset,
            window: leased.window,
            windows: leased.windows,
            valid: leased.valid,
            starts: leased.starts_at - now,
            replayed: false,
        });
    }
    (Ok(grants), writes)
}

/// `None` when a record no longer names the bucket read for it: start over.
fn give_back(
    items: &[LeaseReturn],
    slots: &[(usize, Option<usize>)],
    keys: &[String],
    values: &[Option<Vec<u8>>],
    now: Nanos,
) -> (Option<Vec<ReturnOutcome>>, Writes) {
    let mut values = values.to_vec();
    let mut writes: Writes = vec![None; values.len()];
    let mut taken = Vec::with_capacity(items.len());
    for (item, &(record, bucket)) in items.iter().zip(slots) {
        let Some(mut done) = LeaseRecord::live(stored(&values, record), now) else {
            taken.push(ReturnOutcome { returned: 0, replayed: false });
            continue;
        };
        let Some(bucket) = bucket.filter(|b| keys.get(*b) == Some(&done.bucket)) else {
            return (None, vec![None; values.len()]);
        };
        let (back, next) = decide::give_back(&done, stored(&values, bucket), now, item.tokens);
        let replayed = done.returned;
        if !replayed {
            done.returned = true;
            put(&mut values, &mut writes, record, done.to_next());
        }
        if let Some(next) = next {
            put(&mut values, &mut writes, bucket, next);
        }
        taken.push(ReturnOutcome { returned: back, replayed });
    }
    (Some(taken), writes)
}
