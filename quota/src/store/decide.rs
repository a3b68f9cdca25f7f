//! Every decision the quota service makes on a bucket, as pure functions of
//! (the limit, the stored bytes, now): the one place that calls
//! `floodgate_core::algorithm` and `floodgate_core::lease`. Both stores run
//! these same functions (the memory store under its shard locks, the Redis
//! store between a read and a compare-and-swap write), so they cannot
//! disagree. Times are the core's nanoseconds since the Unix epoch.

use floodgate_core::algorithm::Decision;
use floodgate_core::lease;
use floodgate_core::lease::bucket::ServiceBucket;
pub use floodgate_core::lease::bucket::UNTAGGED;
use floodgate_core::lease::grant::{grant, Allotment, Ask, Granted};
use floodgate_core::lease::holding::{grant_held, Holding};
use floodgate_core::time::Nanos;

use crate::config::Limit;
use crate::store::Caller;

/// The tag of a lease record (no algorithm has it; see [`UNTAGGED`]).
const RECORD_TAG: u8 = u8::MAX;

/// An entry after a decision: the new bytes and how long they matter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Next {
    /// The value to store.
    pub bytes: Vec<u8>,
    /// When the entry becomes idle (a bucket indistinguishable from a fresh
    /// one, a record past counting): a store may forget it from then on
    /// without losing a count (Redis sets its time to live so).
    pub idle_at: Nanos,
    /// Until when a store that holds a bounded number of entries must keep
    /// it against new keys (at least `idle_at`): a bucket one window past
    /// its last use, so a key in use keeps its place between its windows.
    pub keep_until: Nanos,
    /// A bucket or a lease record (each has its own room in the memory store).
    pub kind: Kind,
    /// For a new lease record, the caller whose share of the records' room
    /// it takes in a store of bounded room (see [`Caller`]); `None` for
    /// buckets, and for records of callers not told apart.
    pub owner: Option<Caller>,
}

/// What an entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A bucket's state.
    Bucket = 0,
    /// A lease record.
    Record = 1,
}

/// The bucket's entry after a decision at `now`.
fn bucket_next(limit: &Limit, bucket: &ServiceBucket, now: Nanos) -> Next {
    let key_limit = limit.key_limit();
    let (bytes, idle_at) = bucket.encode(&key_limit, now);
    // A key in use keeps its place for a window after its last use, even
    // once idle: between its windows it is still a live key.
    Next { bytes, idle_at, keep_until: idle_at.max(now + key_limit.window()), kind: Kind::Bucket, owner: None }
}

/// Takes `cost` units if the bucket has them. Returns the decision and the
/// bucket after it (to store only if the whole check commits).
pub fn check(limit: &Limit, stored: Option<&[u8]>, now: Nanos, cost: u64) -> (Decision, Next) {
    let key_limit = limit.key_limit();
    let mut bucket = ServiceBucket::load(&key_limit, stored, now);
    let d = bucket.decide(&key_limit, now, cost);
    (d, bucket_next(limit, &bucket, now))
}

/// The bucket as it stands, without taking anything.
pub fn peek(limit: &Limit, stored: Option<&[u8]>, now: Nanos) -> Decision {
    check(limit, stored, now, 0).0
}

/// What a lease got, and the bucket's entry after it.
#[derive(Debug, Clone)]
pub struct Leased {
    /// What the core's lease rules granted.
    pub allotment: Allotment,
    /// The bucket after the grant and the report (store it when either
    /// took something).
    pub next: Next,
}

/// Decides `ask` on the bucket `key` of `limit`, stored as `stored`, at
/// `now`, for leases living `ttl`: the core's [`grant`] (every lease rule is
/// there), on the bucket as this store keeps it.
pub fn lease(limit: &Limit, key: &str, stored: Option<&[u8]>, now: Nanos, ask: Ask, ttl: Nanos) -> Leased {
    let key_limit = limit.key_limit();
    let allotment = grant(&key_limit, key, ServiceBucket::load(&key_limit, stored, now), ask, now, ttl);
    let next = bucket_next(limit, &allotment.bucket, now);
    Leased { allotment, next }
}

/// A caller's holding of a key as stored (see
/// `floodgate_core::lease::holding`), and the caller it is charged to.
pub type HoldingOf<'a> = (Option<&'a [u8]>, Caller);

/// Decides `ask` as [`lease`] does, for a caller whose holding of the key
/// (its allowances of it) is `holding`: an allowance that would take the
/// caller past its share of the key is not granted (a lease of one window
/// instead). Also returns the holding's entry after it, when it changed.
pub fn lease_held(
    limit: &Limit,
    key: &str,
    stored: Option<&[u8]>,
    (holding, owner): HoldingOf<'_>,
    now: Nanos,
    ask: Ask,
    ttl: Nanos,
) -> (Leased, Option<Next>) {
    let key_limit = limit.key_limit();
    let bucket = ServiceBucket::load(&key_limit, stored, now);
    let (allotment, held) = grant_held(&key_limit, key, bucket, ask, Holding::decode(holding), now, ttl);
    let next = bucket_next(limit, &allotment.bucket, now);
    let held = held.and_then(|held| {
        let idle_at = held.idle_at(key_limit.window())?;
        Some(Next { bytes: held.encode(), idle_at, keep_until: idle_at, kind: Kind::Record, owner: Some(owner) })
    });
    (Leased { allotment, next }, held)
}

/// What a granted lease was, stored under its id so that a retry is answered
/// from it and a return gives back at most what it granted, once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRecord {
    /// The bucket the tokens came from.
    pub bucket: String,
    /// The limit they were leased under.
    pub limit: Limit,
    /// [`Allotment::window`].
    pub window: u64,
    /// [`Allotment::windows`]: 0 for a lease of one window, else an allowance
    /// of `granted` tokens in each of this many windows from `window` on.
    pub windows: u64,
    /// Tokens granted (per window, for an allowance).
    pub granted: u64,
    /// When they count as taken (when granted; for a lease ahead, when its
    /// window starts, and until then a return takes them off the booking):
    /// a return hands the core this grant, and each algorithm decides where
    /// it may go back (a fixed window only into this window, a sliding log
    /// removes the entries logged then…).
    pub granted_at: Nanos,
    /// Given back already: later returns give back nothing.
    pub returned: bool,
    /// What its return gave back (a replay of the return repeats it).
    pub given_back: u64,
    /// When the tokens stop being usable.
    pub valid_until: Nanos,
    /// When the record stops counting (and may be forgotten).
    pub expires_at: Nanos,
}

/// First byte of a record in the current layout; records of the layout
/// before it (no `windows` and `given_back` words) read as leases of one
/// window that gave back nothing.
const RECORD_FORMAT: u8 = 4;
const RECORD_FORMAT_BEFORE: u8 = 3;
/// The record keeps the period in microseconds, as its layout did from the start.
const MICROSECOND: u64 = 1_000;

impl LeaseRecord {
    /// The record of `leased`, granted at `now` on bucket `key` under
    /// `limit`: kept until its tokens stop being usable plus `margin`.
    pub fn of(key: &str, limit: &Limit, leased: &Allotment, now: Nanos, margin: Nanos) -> Self {
        let valid_until = now + leased.valid;
        LeaseRecord {
            bucket: key.to_string(),
            limit: limit.clone(),
            window: leased.window,
            windows: leased.windows,
            granted: leased.granted,
            granted_at: leased.starts_at,
            returned: false,
            given_back: 0,
            valid_until,
            expires_at: valid_until + margin,
        }
    }

    /// Bytes: [`RECORD_TAG`], [`RECORD_FORMAT`], returned flag, then limit, period (µs),
    /// window, granted, granted_at, valid_until, expires_at, windows, given_back as little-endian
    /// u64, the algorithm's name (a length byte, then the name), its fields
    /// (a little-endian u16 length, then the JSON), then the bucket key.
    pub fn encode(&self) -> Vec<u8> {
        let (name, fields) = (self.limit.algorithm().name.as_bytes(), self.limit.fields().as_bytes());
        let mut out = Vec::with_capacity(1 + 2 + 8 * 8 + 3 + name.len() + fields.len() + self.bucket.len());
        out.push(RECORD_TAG);
        out.push(RECORD_FORMAT);
        out.push(u8::from(self.returned));
        for v in [
            self.limit.limit(),
            self.limit.period().get() / MICROSECOND,
            self.window,
            self.granted,
            self.granted_at.get(),
            self.valid_until.get(),
            self.expires_at.get(),
            self.windows,
            self.given_back,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        // Registry names are short and the fields few: both lengths fit.
        out.push(u8::try_from(name.len()).unwrap_or(u8::MAX));
        out.extend_from_slice(name);
        out.extend_from_slice(&u16::try_from(fields.len()).unwrap_or(u16::MAX).to_le_bytes());
        out.extend_from_slice(fields);
        out.extend_from_slice(self.bucket.as_bytes());
        out
    }

    /// Reads [`LeaseRecord::encode`]'s bytes; `None` for anything else.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let (&tag, bytes) = bytes.split_first()?;
        let words = match *bytes.first()? {
            RECORD_FORMAT => 9,
            RECORD_FORMAT_BEFORE => 7,
            _ => return None,
        };
        if !matches!(tag, RECORD_TAG | UNTAGGED) {
            return None;
        }
        let record_head = 2 + words * 8;
        let returned = *bytes.get(1)? == 1;
        let word = |i: usize| -> Option<u64> {
            let raw: [u8; 8] = bytes.get(2 + i * 8..2 + i * 8 + 8)?.try_into().ok()?;
            Some(u64::from_le_bytes(raw))
        };
        let text = |range: std::ops::Range<usize>| std::str::from_utf8(bytes.get(range)?).ok();
        let name_len = usize::from(*bytes.get(record_head)?);
        let name_end = record_head + 1 + name_len;
        let fields_len = usize::from(u16::from_le_bytes(bytes.get(name_end..name_end + 2)?.try_into().ok()?));
        let fields_end = name_end + 2 + fields_len;
        let period = Nanos::from_micros(word(1)?);
        let limit = Limit::new(text(record_head + 1..name_end)?, word(0)?, period, text(name_end + 2..fields_end)?);
        Some(LeaseRecord {
            limit: limit.ok()?,
            window: word(2)?,
            granted: word(3)?,
            granted_at: Nanos::from_nanos(word(4)?),
            valid_until: Nanos::from_nanos(word(5)?),
            expires_at: Nanos::from_nanos(word(6)?),
            windows: if words == 9 { word(7)? } else { 0 },
            returned,
            given_back: if words == 9 { word(8)? } else { 0 },
            bucket: text(fields_end..bytes.len())?.to_string(),
        })
    }

    /// The record as an entry to store, charged to `owner` (see [`Next::owner`]).
    pub fn to_next(&self, owner: Option<Caller>) -> Next {
        Next { bytes: self.encode(), idle_at: self.expires_at, keep_until: self.expires_at, kind: Kind::Record, owner }
    }

    /// The record in `stored`, if there is one still counting at `now`.
    pub fn live(stored: Option<&[u8]>, now: Nanos) -> Option<Self> {
        stored.and_then(Self::decode).filter(|r| r.expires_at > now)
    }
}

/// Gives back up to `tokens` of the lease in `record` to its bucket, once
/// and at most what it granted (the core's [`lease::grant::give_back`]).
/// Returns the units the bucket has available again at once because of
/// it, and the bucket after it (`None`: nothing to write).
pub fn give_back(record: &LeaseRecord, stored: Option<&[u8]>, now: Nanos, tokens: u64) -> (u64, Option<Next>) {
    // No bucket: it is idle (fresh); nothing to return into.
    let Some(stored) = stored.filter(|_| !record.returned) else { return (0, None) };
    let key_limit = record.limit.key_limit();
    let bucket = ServiceBucket::load(&key_limit, Some(stored), now);
    let granted = Granted {
        granted: record.granted,
        granted_at: record.granted_at,
        window: record.window,
        windows: record.windows,
    };
    let (back, after) = lease::grant::give_back(&key_limit, bucket, &granted, now, tokens);
    (back, after.map(|bucket| bucket_next(&record.limit, &bucket, now)))
}

#[cfg(test)]
#[path = "decide_tests.rs"]
mod tests;
