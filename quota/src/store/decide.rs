//! Every decision the quota service makes on a bucket, as pure functions of
//! (the limit, the stored bytes, now): the one place that calls
//! `floodgate_core::algorithm` and `floodgate_core::lease`. Both stores run
//! these same functions (the memory store under its shard locks, the Redis
//! store between a read and a compare-and-swap write), so they cannot
//! disagree. Times are the core's nanoseconds since the Unix epoch.

use floodgate_core::algorithm::{Decision, Grant, Release};
use floodgate_core::booking::{self, Booking};
use floodgate_core::lease::{ahead_cap, grant_cap, lease_target, paced_until};
use floodgate_core::time::Nanos;

use crate::config::Limit;

/// Every stored value starts with a tag byte: a bucket's is its algorithm's
/// (`Registration::tag`), a lease record's [`RECORD_TAG`]. A value stored
/// before values carried one reads with this tag (the Redis store keeps the
/// tag in a field of its own, beside the value as it was laid out before).
pub const UNTAGGED: u8 = 0;

/// The tag of a lease record (no algorithm has it).
const RECORD_TAG: u8 = u8::MAX;

/// Untagged states were written by the layouts of the tags registered then
/// (1 to 8): one is read only while its algorithm still has such a tag.
const LAST_UNTAGGED_LAYOUT: u8 = 8;

/// A bucket as stored: the algorithm's tag (its registration's, so a state
/// of another layout is never misread), the algorithm's state
/// (`Policy::state_len` bytes, as the core lays them out), then the lease
/// pace's "paced until" instant (8 bytes, little-endian; see
/// `floodgate_core::lease::paced_until`), then, only while leases ahead
/// have booked units of the next window, that window's start and the units
/// (8 bytes each, little-endian; see `floodgate_core::booking`).
struct Stored {
    state: Vec<u8>,
    paced_until: Nanos,
    /// Pending: a booking whose window has started is counted in `state`
    /// on load.
    booking: Option<Booking>,
}

fn word(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

impl Stored {
    /// The stored bucket at `now` when it is of the limit's algorithm and
    /// shape, else (never stored, expired, another layout, or another
    /// shape: a state whose size depends on fields that a reload changed)
    /// a fresh bucket.
    fn load(limit: &Limit, stored: Option<&[u8]>, now: Nanos) -> Self {
        let (policy, tag) = (limit.policy(), limit.algorithm().tag);
        let len = policy.state_len();
        let readable = |first: u8| first == tag || (first == UNTAGGED && tag <= LAST_UNTAGGED_LAYOUT);
        let found = stored.and_then(|bytes| {
            let (&first, rest) = bytes.split_first()?;
            let booking = match rest.len().checked_sub(len)? {
                8 => None,
                24 => Some(Booking { starts: Nanos(word(rest, len + 8)?), units: word(rest, len + 16)? }),
                _ => return None,
            };
            let paced_until = Nanos(word(rest, len)?);
            readable(first).then(|| Stored { state: rest[..len].to_vec(), paced_until, booking })
        });
        let mut bucket = found.unwrap_or_else(|| {
            let mut state = vec![0; len];
            policy.write_fresh(&mut state, now);
            Stored { state, paced_until: Nanos::ZERO, booking: None }
        });
        bucket.booking = booking::settle(policy, &mut bucket.state, bucket.booking, now);
        bucket
    }

    /// Decides `cost` units at `now` (see `floodgate_core::booking::decide`).
    fn decide(&mut self, limit: &Limit, now: Nanos, cost: u64) -> Decision {
        booking::decide(limit.policy(), &mut self.state, self.booking, now, cost)
    }

    /// What a zero-cost decision at `now` says, leaving the bucket as it is.
    fn decide_copy(&self, limit: &Limit, now: Nanos) -> Decision {
        booking::decide(limit.policy(), &mut self.state.clone(), self.booking, now, 0)
    }

    fn into_next(self, limit: &Limit, now: Nanos) -> Next {
        // The core's `idle_at` is exact and property-tested: from then on the
        // bucket, left alone, is indistinguishable from a fresh one (and
        // stays so), so a key expiring then forgets no count. Every write
        // sets the time again, so a bucket written later lives longer.
        let policy = limit.policy();
        let idle_at = booking::idle_at(policy, &self.state, self.booking, now);
        let mut bytes = Vec::with_capacity(1 + self.state.len() + 24);
        bytes.push(limit.algorithm().tag);
        bytes.extend_from_slice(&self.state);
        bytes.extend_from_slice(&self.paced_until.get().to_le_bytes());
        if let Some(booking) = self.booking {
            bytes.extend_from_slice(&booking.starts.get().to_le_bytes());
            bytes.extend_from_slice(&booking.units.to_le_bytes());
        }
        // A key in use keeps its place for a window after its last use,
        // even once idle: between its windows it is still a live key.
        let window = policy.quota().window.unwrap_or(limit.period());
        Next { bytes, idle_at, keep_until: idle_at.max(now + window), kind: Kind::Bucket }
    }
}

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
}

/// What an entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A bucket's state.
    Bucket = 0,
    /// A lease record.
    Record = 1,
}

/// Takes `cost` units if the bucket has them. Returns the decision and the
/// bucket after it (to store only if the whole check commits).
pub fn check(limit: &Limit, stored: Option<&[u8]>, now: Nanos, cost: u64) -> (Decision, Next) {
    let mut bucket = Stored::load(limit, stored, now);
    let d = bucket.decide(limit, now, cost);
    (d, bucket.into_next(limit, now))
}

/// What a lease got, and the bucket after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leased {
    /// Tokens granted.
    pub granted: u64,
    /// The bucket's state after the grant.
    pub decision: Decision,
    /// The algorithm's window the tokens are counted in (see
    /// `CountingWindow`; 0 for algorithms without one).
    pub window: u64,
    /// When the tokens start counting: now, or for a lease ahead the start
    /// of the window they are for.
    pub starts_at: Nanos,
    /// How long (from now) the tokens may be used.
    pub valid: Nanos,
    /// The bucket after the grant (store it when `granted > 0`).
    pub next: Next,
}

/// Takes a batch of tokens for a caller that wants at most `wanted` and
/// consumes `rate` per second, for leases living `ttl`: sized by the core's
/// [`lease_target`] and [`grant_cap`], paced per bucket by [`paced_until`].
///
/// Validity and pacing horizon: tokens of an algorithm that counts in
/// windows (its `counting_window`) are valid until the window they are
/// counted in ends (at most `ttl`); a window whose counts all end with it (a
/// fixed window) paces its tail over the rest of the window. Every other
/// algorithm's tokens are units taken now, valid for `ttl`, and the tail is
/// paced over the algorithm's window (its period, the time in which it earns
/// or frees `requests_per_unit`). The target is the caller's rate over the
/// validity, not the whole `ttl`: tokens a lease cut short by its window's
/// end could not spend would be stranded in one proxy until they expire,
/// counted against the window all the same.
///
/// `window` names the window the caller wants tokens of. The next window,
/// when it starts within `ttl`, is leased ahead ([`lease_ahead`]); any other
/// (or none) gets tokens of the window that counts now, as above.
pub fn lease(
    limit: &Limit,
    stored: Option<&[u8]>,
    now: Nanos,
    wanted: u64,
    rate: Option<f64>,
    window: Option<u64>,
    ttl: Nanos,
) -> Leased {
    let policy = limit.policy();
    let capacity = policy.capacity();
    let mut bucket = Stored::load(limit, stored, now);
    if let Some(named) = window {
        let ahead = booking::ahead(policy, &bucket.state, bucket.booking, now);
        if let Some(ahead) = ahead.filter(|a| a.window.index == named && a.starts - now <= ttl) {
            return lease_ahead(limit, bucket, now, wanted, rate, ttl, &ahead);
        }
    }
    // A zero-cost decision on a copy: what the bucket holds now.
    let remaining = bucket.decide_copy(limit, now).remaining;
    let period = policy.quota().window.unwrap_or(limit.period());
    let (horizon, window, valid) = match policy.counting_window(&bucket.state, now) {
        Some(counted) => {
            let left = counted.end - now;
            (if counted.renews { left } else { period }, counted.index, ttl.min(left))
        }
        None => (period, 0, ttl),
    };
    let target = lease_target(wanted, rate, valid, capacity);
    let cap = grant_cap(remaining, capacity, horizon, ttl, bucket.paced_until, now);
    let granted = target.min(cap);
    let d = bucket.decide(limit, now, granted);
    // A denied grant (an algorithm that admits fewer than `remaining` at
    // once, such as a cold warm_up bucket) takes nothing.
    let granted = if d.allowed() { granted } else { 0 };
    bucket.paced_until = paced_until(granted, remaining, capacity, horizon, bucket.paced_until, now);
    Leased { granted, decision: d, window, starts_at: now, valid, next: bucket.into_next(limit, now) }
}

/// A lease ahead: tokens of the window starting at `ahead.starts` (within a
/// lease lifetime), booked now in that window's budget (the core's
/// `booking` rule: what the bucket admits at that start, and for a sliding
/// window what the current window's counts leave there). Sized as any lease
/// to the caller's rate over the time they may be used, a lease lifetime
/// from the window's start and never past its end; at most half of what
/// that window has left, and nothing once it is below the low-water mark
/// ([`ahead_cap`]: its tail is handed out in it, paced).
fn lease_ahead(
    limit: &Limit,
    mut bucket: Stored,
    now: Nanos,
    wanted: u64,
    rate: Option<f64>,
    ttl: Nanos,
    ahead: &booking::Ahead,
) -> Leased {
    let policy = limit.policy();
    let usable = ttl.min(ahead.window.end - ahead.starts);
    let target = lease_target(wanted, rate, usable, policy.capacity());
    let mut granted = target.min(ahead_cap(ahead.room, policy.capacity()));
    match booking::book(policy, &bucket.state, bucket.booking, ahead, granted) {
        Some(after) if granted > 0 => bucket.booking = Some(after),
        _ => granted = 0,
    }
    // What the next window has left, and when it frees more, as seen from its start.
    let mut settled = bucket.state.clone();
    let pending = booking::settle(policy, &mut settled, bucket.booking, ahead.starts);
    let then = booking::decide(policy, &mut settled, pending, ahead.starts, 0);
    let decision = Decision::admit(then.remaining, (ahead.starts - now) + then.reset);
    let (starts_at, valid) = (ahead.starts, (ahead.starts - now) + usable);
    Leased { granted, decision, window: ahead.window.index, starts_at, valid, next: bucket.into_next(limit, now) }
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

/// First byte of a record in the current layout (4: format 3 and, last of
/// the head's words, what the return gave back; format 3 is still read, as
/// having given back 0).
const RECORD_FORMAT: u8 = 4;
const RECORD_FORMAT_3: u8 = 3;
/// The record keeps the period in microseconds, as its layout did from the start.
const MICROSECOND: u64 = 1_000;

impl LeaseRecord {
    /// Bytes: [`RECORD_TAG`], [`RECORD_FORMAT`], returned flag, then limit, period (µs),
    /// window, granted, granted_at, valid_until, expires_at, given_back as little-endian
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
            RECORD_FORMAT => 8,
            RECORD_FORMAT_3 => 7,
            _ => return None,
        };
        if !matches!(tag, RECORD_TAG | UNTAGGED) {
            return None;
        }
        let head: usize = 2 + words * 8;
        let returned = *bytes.get(1)? == 1;
        let word = |i: usize| -> Option<u64> {
            let raw: [u8; 8] = bytes.get(2 + i * 8..2 + i * 8 + 8)?.try_into().ok()?;
            Some(u64::from_le_bytes(raw))
        };
        let text = |range: std::ops::Range<usize>| std::str::from_utf8(bytes.get(range)?).ok();
        let name_len = usize::from(*bytes.get(head)?);
        let name_end = head + 1 + name_len;
        let fields_len = usize::from(u16::from_le_bytes(bytes.get(name_end..name_end + 2)?.try_into().ok()?));
        let fields_end = name_end + 2 + fields_len;
        let period = Nanos::from_micros(word(1)?);
        let limit = Limit::new(text(head + 1..name_end)?, word(0)?, period, text(name_end + 2..fields_end)?);
        Some(LeaseRecord {
            limit: limit.ok()?,
            window: word(2)?,
            granted: word(3)?,
            granted_at: Nanos(word(4)?),
            valid_until: Nanos(word(5)?),
            expires_at: Nanos(word(6)?),
            returned,
            given_back: if words == 8 { word(7)? } else { 0 },
            bucket: text(fields_end..bytes.len())?.to_string(),
        })
    }

    /// The record as an entry to store.
    pub fn to_next(&self) -> Next {
        Next { bytes: self.encode(), idle_at: self.expires_at, keep_until: self.expires_at, kind: Kind::Record }
    }

    /// The record in `stored`, if there is one still counting at `now`.
    pub fn live(stored: Option<&[u8]>, now: Nanos) -> Option<Self> {
        stored.and_then(Self::decode).filter(|r| r.expires_at > now)
    }
}

/// Gives back up to `tokens` of the lease in `record` to its bucket, once and
/// at most what it granted, as the core's `Release::Return` of that part of
/// the grant: each algorithm decides where the units may go (a fixed window
/// only into the window they came from, a token bucket never beyond full nor
/// more than the lease has not earned again, a sliding log drops the entries
/// the lease logged…). Returns the units the bucket has
/// available again at once because of it, and the bucket after it (`None`:
/// nothing to write).
pub fn give_back(record: &LeaseRecord, stored: Option<&[u8]>, now: Nanos, tokens: u64) -> (u64, Option<Next>) {
    // No bucket: it is idle (fresh); nothing to return into.
    let Some(stored) = stored.filter(|_| !record.returned) else { return (0, None) };
    let limit = &record.limit;
    let grant = Grant { cost: tokens.min(record.granted), at: record.granted_at };
    let mut bucket = Stored::load(limit, Some(stored), now);
    if now < grant.at {
        // A lease ahead whose window has not started: its units come off
        // the booking, and that window has them again.
        let (booking, back) = booking::unbook(bucket.booking, grant.at, grant.cost);
        if back == 0 {
            return (0, None);
        }
        bucket.booking = booking;
        return (back, Some(bucket.into_next(limit, now)));
    }
    let before = bucket.decide_copy(limit, now).remaining;
    let why = Release::Return { granted: record.granted };
    if grant.cost == 0 || !limit.policy().release(&mut bucket.state, now, grant, why) {
        return (0, None);
    }
    let next = bucket.into_next(limit, now);
    let back = peek(limit, Some(&next.bytes), now).remaining.saturating_sub(before);
    (back, Some(next))
}

#[cfg(test)]
mod tests {
    use super::*;
    use floodgate_core::algorithm::ALGORITHMS;
    use floodgate_core::time::SECOND;

    const NOW: Nanos = Nanos(1_700_002_800 * SECOND.get());

    fn limit(algorithm: &str, limit: u64, period: Nanos, fields: &str) -> Limit {
        Limit::new(algorithm, limit, period, fields).unwrap()
    }

    #[test]
    fn a_record_round_trips_and_garbage_is_no_record() {
        for limit in [
            limit("fixed_window", 7, SECOND.times(60), "{}"),
            limit("sliding_window", 7, SECOND.times(60), r#"{"sub_windows":6}"#),
            limit("warm_up", 7, SECOND, r#"{"burst":3,"cold_factor":4,"warmup":"20s"}"#),
        ] {
            let record = LeaseRecord {
                bucket: r#"fg:{edge}:fw:[["k","v"]]"#.into(),
                limit,
                window: 42,
                granted: 3,
                granted_at: NOW - Nanos(5),
                returned: true,
                given_back: 2,
                valid_until: NOW + Nanos(1),
                expires_at: NOW + Nanos(2),
            };
            assert_eq!(LeaseRecord::decode(&record.encode()), Some(record.clone()));
            assert_eq!(LeaseRecord::live(Some(&record.encode()), NOW + Nanos(2)), None, "expired");
            assert_eq!(LeaseRecord::decode(&record.encode()[..20]), None);
            let mut untagged = record.encode();
            untagged[0] = UNTAGGED;
            assert_eq!(LeaseRecord::decode(&untagged), Some(record.clone()), "stored before values carried a tag");
            // Format 3 (before records kept what their return gave back):
            // the same without the head's last word, read as 0 given back.
            let mut format_3 = record.encode();
            format_3[1] = 3;
            format_3.drain(3 + 7 * 8..3 + 8 * 8);
            let read = LeaseRecord::decode(&format_3);
            assert_eq!(read, Some(LeaseRecord { given_back: 0, ..record.clone() }), "format 3");
        }
        assert_eq!(LeaseRecord::decode(&[9; 80]), None);
    }

    #[test]
    fn idle_at_is_when_the_bucket_is_fresh_again() {
        let bucket = limit("token_bucket", 7, SECOND.times(3), r#"{"burst":10}"#);
        let (_, next) = check(&bucket, None, NOW, 4);
        assert!(next.idle_at > NOW);
        assert_eq!(next.bytes.len(), 1 + 16 + 8, "the tag, the state, then the pace");
        assert!(check(&bucket, Some(&next.bytes), next.idle_at - Nanos(1), 0).0.remaining < 10);
        assert_eq!(check(&bucket, Some(&next.bytes), next.idle_at, 0).0.remaining, 10);
        let window = limit("fixed_window", 7, SECOND.times(60), "{}");
        let (_, next) = check(&window, None, NOW + Nanos(5), 1);
        assert_eq!(next.idle_at, NOW + SECOND.times(60));
        assert_eq!(check(&window, None, NOW, 0).1.idle_at, NOW, "an unused window is idle now");
        // Weighted sliding window: the count weighs until the next window ends.
        let sliding = limit("sliding_window", 7, SECOND.times(60), "{}");
        let (_, next) = check(&sliding, None, NOW + Nanos(5), 1);
        assert_eq!(next.idle_at, NOW + SECOND.times(120));
    }

    #[test]
    fn every_offered_algorithm_keeps_a_used_bucket_until_it_is_idle() {
        for registration in ALGORITHMS.iter().filter(|r| r.local_only.is_none()) {
            let mut fields: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(registration.example).unwrap();
            fields.remove("period");
            let limit = limit(registration.name, 5, SECOND.times(60), &serde_json::Value::Object(fields).to_string());
            let (_, next) = check(&limit, None, NOW + Nanos(5), 1);
            let state = &next.bytes[1..=limit.policy().state_len()];
            let name = registration.name;
            assert!(next.idle_at > NOW + Nanos(5), "{name}");
            assert!(!limit.policy().is_idle(state, next.idle_at - Nanos(1)), "{name}");
            assert!(limit.policy().is_idle(state, next.idle_at), "{name}");
        }
    }

    #[test]
    fn a_state_of_another_layout_is_never_misread() {
        let bucket = limit("token_bucket", 7, SECOND.times(3), r#"{"burst":10}"#);
        let (_, next) = check(&bucket, None, NOW, 10);
        assert_eq!(check(&bucket, Some(&next.bytes), NOW, 0).0.remaining, 0);
        // The same bytes under another tag (a layout change gets a new one)
        // are not this bucket's: read as fresh.
        let mut other = next.bytes.clone();
        other[0] = 200;
        assert_eq!(check(&bucket, Some(&other), NOW, 0).0.remaining, 10);
        // A state stored before states carried their tag is of the layout
        // its algorithm had then, which every registered tag still is.
        let mut untagged = next.bytes.clone();
        untagged[0] = UNTAGGED;
        assert_eq!(check(&bucket, Some(&untagged), NOW, 0).0.remaining, 0);
    }
}
