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

use floodgate_core::algorithm::{self, Algorithm as _, FixedWindow, Grant, Policy, Release};
use floodgate_core::lease::{grant_cap, lease_target, paced_until};
use floodgate_core::time::Nanos as CoreNanos;

use super::{Decision, NEVER};
use crate::clock::Micros;
use crate::config::Limit;

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

/// The one algorithm whose leased tokens belong to a window: a fixed
/// window's tokens count only in the window they were taken in, so its
/// leases end with the window and report which window it is. Every other
/// algorithm's tokens are just units taken now.
fn fixed_window(limit: &Limit) -> Option<FixedWindow> {
    (limit.algorithm() == "fixed_window").then(|| FixedWindow::new(limit.limit(), CoreNanos(nanos(limit.period()))))
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
    /// expired, or of another shape: a `sliding_log` whose
    /// `requests_per_unit` or `unit` changed, a `sliding_window` whose
    /// `sub_windows` changed) a fresh bucket.
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
        // The core's `idle_at` is exact and property-tested: from then on the
        // bucket, left alone, is indistinguishable from a fresh one (and
        // stays so), so a key expiring then forgets no count. Every write
        // sets the time again, so a bucket written later lives longer.
        let idle_at = limit.policy().idle_at(&self.state, CoreNanos(now)).get();
        let mut bytes = self.state;
        bytes.extend_from_slice(&self.paced_until.to_le_bytes());
        Next { bytes, idle_at }
    }
}

/// A bucket after a decision: the new bytes and when they become idle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Next {
    /// The state to store.
    pub bytes: Vec<u8>,
    /// When the bucket becomes idle (indistinguishable from a fresh one): a
    /// store may forget it from then on.
    pub idle_at: Nanos,
}

/// Takes `cost` units if the bucket has them. Returns the decision and the
/// bucket after it (to store only if the whole check commits).
pub fn check(limit: &Limit, stored: Option<&[u8]>, now: Nanos, cost: u64) -> (Decision, Next) {
    let policy = limit.policy();
    let mut bucket = Stored::load(policy, stored, now);
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
    /// The fixed window the tokens belong to (0 for the other algorithms).
    pub window: u64,
    /// How long the tokens may be used.
    pub valid: Nanos,
    /// The bucket after the grant (store it when `granted > 0`).
    pub next: Next,
}

/// Takes a batch of tokens for a caller that wants at most `wanted` and
/// consumes `rate` per second, for leases living `ttl`: sized by the core's
/// [`lease_target`] and [`grant_cap`], paced per bucket by [`paced_until`].
///
/// Validity and pacing horizon: a fixed window's tokens are valid until its
/// window ends (at most `ttl`) and its tail is paced over the rest of the
/// window. Every other algorithm's tokens are units taken now: valid for
/// `ttl`, and the tail is paced over the algorithm's window (its period, the
/// time in which it earns or frees `requests_per_unit`). The target is the
/// caller's rate over the validity, not the whole `ttl`: tokens a lease cut
/// short by its window's end could not spend would be stranded in one proxy
/// until they expire, counted against the window all the same.
pub fn lease(limit: &Limit, stored: Option<&[u8]>, now: Nanos, wanted: u64, rate: Option<f64>, ttl: Nanos) -> Leased {
    let policy = limit.policy();
    let capacity = policy.capacity();
    let mut bucket = Stored::load(policy, stored, now);
    // A zero-cost decision on a copy: what the bucket holds now.
    let mut probe = bucket.state.clone();
    let remaining = policy.decide(&mut probe, CoreNanos(now), 0).remaining;
    let (horizon, window, valid) = match fixed_window(limit) {
        Some(fw) => {
            let window = fw.decode(&probe).map_or(0, |s| s.window);
            let end = u64::try_from((u128::from(window) + 1) * u128::from(nanos(limit.period()))).unwrap_or(u64::MAX);
            let horizon = end.saturating_sub(now);
            (horizon, window, ttl.min(horizon))
        }
        None => (policy.quota().window.map_or(nanos(limit.period()), CoreNanos::get), 0, ttl),
    };
    let target = lease_target(wanted, rate, valid, capacity);
    let cap = grant_cap(remaining, capacity, horizon, ttl, bucket.paced_until, now);
    let granted = target.min(cap);
    let d = policy.decide(&mut bucket.state, CoreNanos(now), granted);
    // A denied grant (an algorithm that admits fewer than `remaining` at
    // once, such as a cold warm_up bucket) takes nothing.
    let granted = if d.allowed() { granted } else { 0 };
    bucket.paced_until = paced_until(granted, remaining, capacity, horizon, bucket.paced_until, now);
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
    /// When they were taken: a return hands the core this grant, and each
    /// algorithm decides where it may go back (a fixed window only into
    /// this window, a sliding log removes the entries logged then…).
    pub granted_at: Nanos,
    /// Given back already: later returns give back nothing.
    pub returned: bool,
    /// When the tokens stop being usable.
    pub valid_until: Nanos,
    /// When the record stops counting (and may be forgotten).
    pub expires_at: Nanos,
}

/// First byte of a record in the current layout. Records of the first
/// release start with 1 (token bucket) or 2 (fixed window) and are still
/// read, so a lease retried across an upgrade is not granted twice.
const RECORD_FORMAT: u8 = 3;
const RECORD_HEAD: usize = 2 + 7 * 8;

impl LeaseRecord {
    /// Bytes: [`RECORD_FORMAT`], returned flag, then limit, period (µs),
    /// window, granted, granted_at, valid_until, expires_at as little-endian
    /// u64, the algorithm's name (a length byte, then the name), its fields
    /// (a little-endian u16 length, then the JSON), then the bucket key.
    pub fn encode(&self) -> Vec<u8> {
        let (name, fields) = (self.limit.algorithm().as_bytes(), self.limit.fields().as_bytes());
        let mut out = Vec::with_capacity(RECORD_HEAD + 3 + name.len() + fields.len() + self.bucket.len());
        out.push(RECORD_FORMAT);
        out.push(u8::from(self.returned));
        for v in [
            self.limit.limit(),
            self.limit.period(),
            self.window,
            self.granted,
            self.granted_at,
            self.valid_until,
            self.expires_at,
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

    /// Reads [`LeaseRecord::encode`]'s bytes (or a first release's); `None`
    /// for anything else.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let returned = *bytes.get(1)? == 1;
        let word = |i: usize| -> Option<u64> {
            let raw: [u8; 8] = bytes.get(2 + i * 8..2 + i * 8 + 8)?.try_into().ok()?;
            Some(u64::from_le_bytes(raw))
        };
        let text = |range: std::ops::Range<usize>| std::str::from_utf8(bytes.get(range)?).ok();
        let first_release = |algorithm: &str| -> Option<Self> {
            // limit, period, capacity, window, granted, valid_until, expires_at.
            let (limit, period, window) = (word(0)?, word(1)?, word(3)?);
            let (fields, granted_at) = if algorithm == "token_bucket" {
                (format!(r#"{{"burst":{}}}"#, word(2)?), word(5)?)
            } else {
                ("{}".to_string(), u64::try_from(u128::from(window) * u128::from(nanos(period))).ok()?)
            };
            Some(LeaseRecord {
                limit: Limit::new(algorithm, limit, period, &fields).ok()?,
                window,
                granted: word(4)?,
                granted_at,
                valid_until: word(5)?,
                expires_at: word(6)?,
                returned,
                bucket: text(RECORD_HEAD..bytes.len())?.to_string(),
            })
        };
        match *bytes.first()? {
            1 => return first_release("token_bucket"),
            2 => return first_release("fixed_window"),
            RECORD_FORMAT => {}
            _ => return None,
        }
        let name_len = usize::from(*bytes.get(RECORD_HEAD)?);
        let name_end = RECORD_HEAD + 1 + name_len;
        let fields_len = usize::from(u16::from_le_bytes(bytes.get(name_end..name_end + 2)?.try_into().ok()?));
        let fields_end = name_end + 2 + fields_len;
        let limit = Limit::new(text(RECORD_HEAD + 1..name_end)?, word(0)?, word(1)?, text(name_end + 2..fields_end)?);
        Some(LeaseRecord {
            limit: limit.ok()?,
            window: word(2)?,
            granted: word(3)?,
            granted_at: word(4)?,
            valid_until: word(5)?,
            expires_at: word(6)?,
            returned,
            bucket: text(fields_end..bytes.len())?.to_string(),
        })
    }

    /// The record in `stored`, if there is one still counting at `now`.
    pub fn live(stored: Option<&[u8]>, now: Nanos) -> Option<Self> {
        stored.and_then(Self::decode).filter(|r| r.expires_at > now)
    }
}

/// Gives back up to `tokens` of the lease in `record` to its bucket, once and
/// at most what it granted, as the core's `Release::Undo` of the grant: each
/// algorithm decides where the units may go (a fixed window only into the
/// window they came from, a token bucket never beyond full, a sliding log
/// drops the entries the lease logged…). Returns the units the bucket has
/// available again at once because of it, and the bucket after it (`None`:
/// nothing to write).
pub fn give_back(record: &LeaseRecord, stored: Option<&[u8]>, now: Nanos, tokens: u64) -> (u64, Option<Next>) {
    // No bucket: it is idle (fresh); nothing to return into.
    let Some(stored) = stored.filter(|_| !record.returned) else { return (0, None) };
    let limit = &record.limit;
    let policy = limit.policy();
    let grant = Grant { cost: tokens.min(record.granted), at: CoreNanos(record.granted_at) };
    let before = peek(limit, Some(stored), now).remaining;
    let mut bucket = Stored::load(policy, Some(stored), now);
    if grant.cost == 0 || !policy.release(&mut bucket.state, CoreNanos(now), grant, Release::Undo) {
        return (0, None);
    }
    let next = bucket.into_next(limit, now);
    let back = peek(limit, Some(&next.bytes), now).remaining.saturating_sub(before);
    (back, Some(next))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SECOND_US;

    const NOW: Nanos = 1_700_002_800 * 1_000_000_000;

    fn limit(algorithm: &str, limit: u64, period: Micros, fields: &str) -> Limit {
        Limit::new(algorithm, limit, period, fields).unwrap()
    }

    #[test]
    fn a_record_round_trips_and_garbage_is_no_record() {
        for limit in [
            limit("fixed_window", 7, 60 * SECOND_US, "{}"),
            limit("sliding_window", 7, 60 * SECOND_US, r#"{"sub_windows":6}"#),
            limit("warm_up", 7, SECOND_US, r#"{"burst":3,"cold_factor":4,"warmup":"20s"}"#),
        ] {
            let record = LeaseRecord {
                bucket: r#"fg:{edge}:fw:[["k","v"]]"#.into(),
                limit,
                window: 42,
                granted: 3,
                granted_at: NOW - 5,
                returned: true,
                valid_until: NOW + 1,
                expires_at: NOW + 2,
            };
            assert_eq!(LeaseRecord::decode(&record.encode()), Some(record.clone()));
            assert_eq!(LeaseRecord::live(Some(&record.encode()), NOW + 2), None, "expired");
            assert_eq!(LeaseRecord::decode(&record.encode()[..20]), None);
        }
        assert_eq!(LeaseRecord::decode(&[9; 80]), None);
    }

    #[test]
    fn a_first_release_record_still_reads() {
        // Token bucket (1), not returned: limit, period, capacity, window,
        // granted, valid_until, expires_at, then the bucket.
        let mut bytes = vec![1, 0];
        for v in [5, SECOND_US, 9, 0, 4, NOW + 1, NOW + 2] {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        bytes.extend_from_slice(b"fg:{t}:tb:x");
        let record = LeaseRecord::decode(&bytes).unwrap();
        assert_eq!(record.limit, limit("token_bucket", 5, SECOND_US, r#"{"burst":9}"#));
        assert_eq!((record.granted, record.valid_until, record.bucket.as_str()), (4, NOW + 1, "fg:{t}:tb:x"));
    }

    #[test]
    fn idle_at_is_when_the_bucket_is_fresh_again() {
        let bucket = limit("token_bucket", 7, 3 * SECOND_US, r#"{"burst":10}"#);
        let (_, next) = check(&bucket, None, NOW, 4);
        assert!(next.idle_at > NOW);
        assert_eq!(next.bytes.len(), 16 + 8, "the state, then the pace");
        assert!(check(&bucket, Some(&next.bytes), next.idle_at - 1, 0).0.remaining < 10);
        assert_eq!(check(&bucket, Some(&next.bytes), next.idle_at, 0).0.remaining, 10);
        let window = limit("fixed_window", 7, 60 * SECOND_US, "{}");
        let (_, next) = check(&window, None, NOW + 5, 1);
        assert_eq!(next.idle_at, NOW + 60 * 1_000_000_000);
        assert_eq!(check(&window, None, NOW, 0).1.idle_at, NOW, "an unused window is idle now");
        // Weighted sliding window: the count weighs until the next window ends.
        let sliding = limit("sliding_window", 7, 60 * SECOND_US, "{}");
        let (_, next) = check(&sliding, None, NOW + 5, 1);
        assert_eq!(next.idle_at, NOW + 120 * 1_000_000_000);
    }

    #[test]
    fn every_offered_algorithm_keeps_a_used_bucket_until_it_is_idle() {
        let fields = [("token_bucket", "{}"), ("leaky_bucket", r#"{"burst":3}"#), ("warm_up", r#"{"warmup":"5s"}"#)];
        for (name, _) in crate::config::ALGORITHMS {
            let extra = fields.iter().find(|(n, _)| n == name).map_or("{}", |(_, f)| f);
            let limit = limit(name, 5, 60 * SECOND_US, extra);
            let (_, next) = check(&limit, None, NOW + 5, 1);
            let state = &next.bytes[..limit.policy().state_len()];
            assert!(next.idle_at > NOW + 5, "{name}");
            assert!(!limit.policy().is_idle(state, CoreNanos(next.idle_at - 1)), "{name}");
            assert!(limit.policy().is_idle(state, CoreNanos(next.idle_at)), "{name}");
        }
    }
}
