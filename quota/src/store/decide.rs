//! Every decision the quota service makes on a bucket, as pure functions of
//! (the limit, the stored bytes, now): the one place that calls
//! `floodgate_core::algorithm` and `floodgate_core::lease`. Both stores run
//! these same functions (the memory store under its shard locks, the Redis
//! store between a read and a compare-and-swap write), so they cannot
//! disagree.
//!
//! Time at this boundary is nanoseconds since the Unix epoch, the core's
//! unit; the rest of the service counts microseconds ([`nanos`] converts) and
//! answers in microseconds rounded up (never early).

use std::sync::Arc;

use floodgate_core::algorithm::{self, Algorithm as _, FixedWindow, Grant, Policy, Release, TokenBucket};
use floodgate_core::lease::{grant_cap, lease_target, paced_until};
use floodgate_core::time::Nanos as CoreNanos;

use super::{Decision, NEVER};
use crate::clock::Micros;
use crate::config::{Algorithm, Limit};

/// Nanoseconds since the Unix epoch (instants) or plain spans.
pub type Nanos = u64;

/// Microseconds as nanoseconds.
pub fn nanos(us: Micros) -> Nanos {
    us.saturating_mul(1_000)
}

/// Nanoseconds as microseconds, rounded up; "never" stays [`NEVER`].
fn micros_up(ns: Nanos) -> Micros {
    if ns == Nanos::MAX {
        NEVER
    } else {
        ns.div_ceil(1_000)
    }
}

fn token_bucket(limit: &Limit) -> TokenBucket {
    TokenBucket::new(limit.limit, CoreNanos(nanos(limit.period)), limit.capacity)
}

fn fixed_window(limit: &Limit) -> FixedWindow {
    FixedWindow::new(limit.limit, CoreNanos(nanos(limit.period)))
}

fn policy(limit: &Limit) -> Arc<dyn Policy> {
    match limit.algorithm {
        Algorithm::TokenBucket => Arc::new(token_bucket(limit)),
        Algorithm::FixedWindow => Arc::new(fixed_window(limit)),
    }
}

fn decision(d: algorithm::Decision) -> Decision {
    Decision {
        allowed: d.allowed(),
        remaining: d.remaining,
        reset: micros_up(d.reset.get()),
        retry_after: micros_up(d.retry_after().get()),
    }
}

/// A bucket as stored: the algorithm's state (`Policy::state_len` bytes,
/// as the core lays them out), then the lease pace's "paced until" instant
/// (8 bytes, little-endian; see `floodgate_core::lease::paced_until`).
struct Stored {
    state: Vec<u8>,
    paced_until: Nanos,
}

impl Stored {
    /// The stored bucket when it fits the policy, else (never stored,
    /// expired, or of another shape) a fresh bucket.
    fn load(policy: &dyn Policy, stored: Option<&[u8]>, now: Nanos) -> Self {
        let len = policy.state_len();
        let paced = |bytes: &[u8]| bytes.get(len..len + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
        match stored {
            Some(bytes) if bytes.len() == len + 8 => {
                Stored { state: bytes[..len].to_vec(), paced_until: paced(bytes).unwrap_or(0) }
            }
            _ => {
                let mut state = vec![0; len];
                policy.write_fresh(&mut state, CoreNanos(now));
                Stored { state, paced_until: 0 }
            }
        }
    }

    fn into_next(self, limit: &Limit, now: Nanos) -> Next {
        let idle_at = idle_at(limit, &self.state, now);
        let mut bytes = self.state;
        bytes.extend_from_slice(&self.paced_until.to_le_bytes());
        Next { bytes, idle_at }
    }
}

/// When the bucket whose state is `bytes` becomes idle (indistinguishable
/// from a fresh one): a store may forget it from then on.
fn idle_at(limit: &Limit, bytes: &[u8], now: Nanos) -> Nanos {
    let period = u128::from(nanos(limit.period));
    match limit.algorithm {
        Algorithm::TokenBucket => match token_bucket(limit).decode(bytes) {
            Some(s) if s.tokens < limit.capacity => {
                let missing = u128::from(limit.capacity - s.tokens);
                let span = (missing * period).div_ceil(u128::from(limit.limit.max(1)));
                s.credited_until.get().saturating_add(u64::try_from(span).unwrap_or(u64::MAX))
            }
            _ => now,
        },
        Algorithm::FixedWindow => match fixed_window(limit).decode(bytes) {
            Some(s) if s.used > 0 => u64::try_from((u128::from(s.window) + 1) * period.max(1)).unwrap_or(u64::MAX),
            _ => now,
        },
    }
}

/// A bucket after a decision: the new bytes and when they become idle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Next {
    /// The state to store.
    pub bytes: Vec<u8>,
    /// See [`idle_at`].
    pub idle_at: Nanos,
}

/// Takes `cost` units if the bucket has them. Returns the decision and the
/// bucket after it (to store only if the whole check commits).
pub fn check(limit: &Limit, stored: Option<&[u8]>, now: Nanos, cost: u64) -> (Decision, Next) {
    let policy = policy(limit);
    let mut bucket = Stored::load(policy.as_ref(), stored, now);
    let d = policy.decide(&mut bucket.state, CoreNanos(now), cost);
    (decision(d), bucket.into_next(limit, now))
}

/// What a lease got, and the bucket after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leased {
    /// Tokens granted.
    pub granted: u64,
    /// The bucket's state after the grant.
    pub decision: Decision,
    /// The fixed window the tokens belong to (0 for a token bucket).
    pub window: u64,
    /// How long the tokens may be used.
    pub valid: Nanos,
    /// The bucket after the grant (store it when `granted > 0`).
    pub next: Next,
}

/// Takes a batch of tokens for a caller that wants at most `wanted` and
/// consumes `rate` per second, for leases living `ttl`: sized by the core's
/// [`lease_target`] and [`grant_cap`], paced per bucket by [`paced_until`].
pub fn lease(limit: &Limit, stored: Option<&[u8]>, now: Nanos, wanted: u64, rate: Option<f64>, ttl: Nanos) -> Leased {
    let policy = policy(limit);
    let mut bucket = Stored::load(policy.as_ref(), stored, now);
    // A zero-cost decision on a copy: what the bucket holds now.
    let mut probe = bucket.state.clone();
    let remaining = policy.decide(&mut probe, CoreNanos(now), 0).remaining;
    let (horizon, window, valid) = match limit.algorithm {
        Algorithm::TokenBucket => (nanos(limit.period), 0, ttl),
        Algorithm::FixedWindow => {
            let window = fixed_window(limit).decode(&probe).map_or(0, |s| s.window);
            let end = u64::try_from((u128::from(window) + 1) * u128::from(nanos(limit.period))).unwrap_or(u64::MAX);
            let horizon = end.saturating_sub(now);
            (horizon, window, ttl.min(horizon))
        }
    };
    let target = lease_target(wanted, rate, ttl, limit.capacity);
    let cap = grant_cap(remaining, limit.capacity, horizon, ttl, bucket.paced_until, now);
    let granted = target.min(cap);
    let d = policy.decide(&mut bucket.state, CoreNanos(now), granted);
    bucket.paced_until = paced_until(granted, remaining, limit.capacity, horizon, bucket.paced_until, now);
    Leased { granted, decision: decision(d), window, valid, next: bucket.into_next(limit, now) }
}

/// The bucket as it stands, without taking anything.
pub fn peek(limit: &Limit, stored: Option<&[u8]>, now: Nanos) -> Decision {
    check(limit, stored, now, 0).0
}

/// What a granted lease was, stored under its id so that a retry is answered
/// from it and a return gives back at most what it granted, once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRecord {
    /// The bucket the tokens came from.
    pub bucket: String,
    /// The limit they were leased under.
    pub limit: Limit,
    /// [`Leased::window`].
    pub window: u64,
    /// Tokens granted.
    pub granted: u64,
    /// Given back already: later returns give back nothing.
    pub returned: bool,
    /// When the tokens stop being usable.
    pub valid_until: Nanos,
    /// When the record stops counting (and may be forgotten).
    pub expires_at: Nanos,
}

const RECORD_HEAD: usize = 2 + 7 * 8;

impl LeaseRecord {
    /// Bytes: algorithm, returned flag, then limit, period (µs), capacity,
    /// window, granted, valid_until, expires_at as little-endian u64, then
    /// the bucket key.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(RECORD_HEAD + self.bucket.len());
        out.push(match self.limit.algorithm {
            Algorithm::TokenBucket => 1,
            Algorithm::FixedWindow => 2,
        });
        out.push(u8::from(self.returned));
        for v in [
            self.limit.limit,
            self.limit.period,
            self.limit.capacity,
            self.window,
            self.granted,
            self.valid_until,
            self.expires_at,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(self.bucket.as_bytes());
        out
    }

    /// Reads [`LeaseRecord::encode`]'s bytes; `None` for anything else.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let algorithm = match bytes.first()? {
            1 => Algorithm::TokenBucket,
            2 => Algorithm::FixedWindow,
            _ => return None,
        };
        let returned = *bytes.get(1)? == 1;
        let word = |i: usize| -> Option<u64> {
            let raw: [u8; 8] = bytes.get(2 + i * 8..2 + i * 8 + 8)?.try_into().ok()?;
            Some(u64::from_le_bytes(raw))
        };
        Some(LeaseRecord {
            limit: Limit { algorithm, limit: word(0)?, period: word(1)?, capacity: word(2)? },
            window: word(3)?,
            granted: word(4)?,
            valid_until: word(5)?,
            expires_at: word(6)?,
            returned,
            bucket: String::from_utf8(bytes.get(RECORD_HEAD..)?.to_vec()).ok()?,
        })
    }

    /// The record in `stored`, if there is one still counting at `now`.
    pub fn live(stored: Option<&[u8]>, now: Nanos) -> Option<Self> {
        stored.and_then(Self::decode).filter(|r| r.expires_at > now)
    }
}

/// Gives back up to `tokens` of the lease in `record` to its bucket: once,
/// at most what it granted, only into the window it came from (fixed
/// window) and never beyond full (token bucket). Returns the tokens taken
/// back and the bucket after it (`None`: nothing to write).
pub fn give_back(record: &LeaseRecord, stored: Option<&[u8]>, now: Nanos, tokens: u64) -> (u64, Option<Next>) {
    // No bucket: it is full (or its window unused); nothing to return into.
    let Some(stored) = stored.filter(|_| !record.returned) else { return (0, None) };
    let limit = &record.limit;
    let policy = policy(limit);
    let tokens = tokens.min(record.granted);
    let room = match limit.algorithm {
        Algorithm::TokenBucket => limit.capacity.saturating_sub(peek(limit, Some(stored), now).remaining),
        Algorithm::FixedWindow => {
            match fixed_window(limit).decode(&Stored::load(policy.as_ref(), Some(stored), now).state) {
                Some(s) if s.window == now / nanos(limit.period).max(1) && s.window == record.window => s.used,
                _ => 0,
            }
        }
    };
    let back = tokens.min(room);
    if back == 0 {
        return (0, None);
    }
    let mut bucket = Stored::load(policy.as_ref(), Some(stored), now);
    policy.release(&mut bucket.state, CoreNanos(now), Grant { cost: back, at: CoreNanos(now) }, Release::Undo);
    (back, Some(bucket.into_next(limit, now)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SECOND_US;

    const NOW: Nanos = 1_700_002_800 * 1_000_000_000;

    #[test]
    fn a_record_round_trips_and_garbage_is_no_record() {
        let record = LeaseRecord {
            bucket: r#"fg:{edge}:fw:[["k","v"]]"#.into(),
            limit: Limit { algorithm: Algorithm::FixedWindow, limit: 7, period: 60 * SECOND_US, capacity: 7 },
            window: 42,
            granted: 3,
            returned: true,
            valid_until: NOW + 1,
            expires_at: NOW + 2,
        };
        assert_eq!(LeaseRecord::decode(&record.encode()), Some(record.clone()));
        assert_eq!(LeaseRecord::live(Some(&record.encode()), NOW + 2), None, "expired");
        assert_eq!(LeaseRecord::decode(&[9; 80]), None);
        assert_eq!(LeaseRecord::decode(&record.encode()[..20]), None);
    }

    #[test]
    fn idle_at_is_when_the_bucket_is_fresh_again() {
        let bucket = Limit { algorithm: Algorithm::TokenBucket, limit: 7, period: 3 * SECOND_US, capacity: 10 };
        let (_, next) = check(&bucket, None, NOW, 4);
        assert!(next.idle_at > NOW);
        assert_eq!(next.bytes.len(), 16 + 8, "the state, then the pace");
        assert!(check(&bucket, Some(&next.bytes), next.idle_at - 1, 0).0.remaining < 10);
        assert_eq!(check(&bucket, Some(&next.bytes), next.idle_at, 0).0.remaining, 10);
        let window = Limit { algorithm: Algorithm::FixedWindow, limit: 7, period: 60 * SECOND_US, capacity: 7 };
        let (_, next) = check(&window, None, NOW + 5, 1);
        assert_eq!(next.idle_at, NOW + 60 * 1_000_000_000);
        assert_eq!(check(&window, None, NOW, 0).1.idle_at, NOW, "an unused window is idle now");
    }
}
