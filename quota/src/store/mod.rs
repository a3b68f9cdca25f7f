//! Where counters live: in this process ([`MemoryStore`]) or in Redis
//! ([`RedisStore`]), with identical decisions. Every operation over several
//! buckets is atomic: a mutex in memory, one Lua script in Redis.

mod memory;
mod redis;

pub use self::memory::MemoryStore;
pub use self::redis::{RedisOptions, RedisStore};

use std::fmt;

use floodgate_core::algorithm::Decision;

use crate::clock::Micros;
use crate::config::{Algorithm, Limit};

/// A retry-after that never comes (a cost above the capacity).
pub const NEVER: Micros = Micros::MAX;

/// The store key of a bucket: the domain as a Redis Cluster hash tag (every
/// bucket one call touches must sit in one slot for the script to be atomic),
/// the algorithm (buckets of different algorithms hold different state), and
/// the descriptor's entries as JSON (unambiguous whatever the values contain).
pub fn bucket_key(domain: &str, algorithm: Algorithm, entries: &[(String, String)]) -> String {
    let entries = serde_json::to_string(entries).unwrap_or_default();
    format!("fg:{{{domain}}}:{}:{entries}", algorithm.tag())
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseItem {
    /// See [`bucket_key`].
    pub key: String,
    /// The rule's limit.
    pub limit: Limit,
    /// Tokens the service aims to grant (see [`crate::grant::lease_target`]).
    pub want: u64,
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
    /// The fixed window the tokens belong to (0 for a token bucket); a
    /// return must name it.
    pub window: u64,
    /// How long the caller may use the tokens.
    pub valid: Micros,
    /// The lease was already recorded: this repeats its grant, nothing was taken.
    pub replayed: bool,
}

/// Unused leased tokens to give back. At most what the lease granted and
/// was not yet returned goes back, and only where it still counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReturnItem {
    /// The lease's record (see [`lease_key`]).
    pub record: String,
    /// Tokens to give back.
    pub tokens: u64,
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
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Timeout => write!(f, "the store did not answer in time"),
            StoreError::Unavailable(why) => write!(f, "the store is unavailable: {why}"),
            StoreError::Full => write!(f, "the memory store is full (every bucket is in use)"),
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

    /// Takes each item's cost from its bucket if all non-shadow buckets admit.
    pub async fn check(&self, items: &[CheckItem]) -> Result<CheckOutcome, StoreError> {
        match self {
            Store::Memory(m) => m.check(items),
            Store::Redis(r) => r.check(items).await,
        }
    }

    /// Takes a batch of tokens from each bucket.
    pub async fn lease(&self, items: &[LeaseItem], ttl: Micros) -> Result<Vec<Grant>, StoreError> {
        match self {
            Store::Memory(m) => m.lease(items, ttl),
            Store::Redis(r) => r.lease(items, ttl).await,
        }
    }

    /// Gives back unused tokens; returns how many each bucket took back.
    pub async fn give_back(&self, items: &[ReturnItem]) -> Result<Vec<u64>, StoreError> {
        match self {
            Store::Memory(m) => m.give_back(items),
            Store::Redis(r) => r.give_back(items).await,
        }
    }

    /// Whether the store answers now.
    pub async fn ping(&self) -> Result<(), StoreError> {
        match self {
            Store::Memory(_) => Ok(()),
            Store::Redis(r) => r.ping().await,
        }
    }
}
