//! Every decision the quota service makes on a bucket, as pure functions of
//! (the limit, the stored bytes, now): the one place that calls
//! `floodgate_core::algorithm` and `floodgate_core::lease`. Both stores run
//! these same functions (the memory store under its shard locks, the Redis
//! store between a read and a compare-and-swap write), so they cannot
//! disagree. Times are the core's nanoseconds since the Unix epoch.

use floodgate_core::algorithm::{CountingWindow, Decision, Grant, Release};
use floodgate_core::lease::allowance::{
    allowance_target, bucket_far_below, bucket_reservable, far_below, pace_seen, paced_use, share_of, Reservations,
    Terms, DEFAULT_TERM,
};
use floodgate_core::lease::booking::{self, Booking};
use floodgate_core::lease::overshoot::near_limit;
use floodgate_core::lease::{ahead_cap, grant_cap, lease_target, low_rate, paced_retry, paced_until};
use floodgate_core::time::Nanos;

use crate::config::Limit;
use crate::store::Caller;

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
/// (8 bytes each, little-endian; see `floodgate_core::lease::booking`), then, only
/// while allowances hold units of its windows, the key's terms (windows per
/// term, phase) and its reservations (term, current, next, settled: 8 bytes
/// each, little-endian; see `floodgate_core::lease::allowance`).
#[derive(Clone)]
struct Stored {
    state: Vec<u8>,
    paced_until: Nanos,
    /// Pending: a booking whose window has started is counted in `state`
    /// on load.
    booking: Option<Booking>,
    /// Allowances' reservations, settled on load (the window that counts
    /// now has its reservation counted in `state`).
    allowances: Option<(Terms, Reservations)>,
}

/// Bytes of a booking, and of the allowances' terms and reservations, after the pace.
const BOOKING_LEN: usize = 16;
const ALLOWANCES_LEN: usize = 56;
/// The allowances' bytes as written before they kept what their window was
/// counted at its start (read as all of its reservations).
const ALLOWANCES_LEN_BEFORE_PACE: usize = 48;

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
            let extra = rest.len().checked_sub(len + 8)?;
            let (has_booking, allowances_len) = match extra {
                0 => (false, 0),
                BOOKING_LEN => (true, 0),
                ALLOWANCES_LEN | ALLOWANCES_LEN_BEFORE_PACE => (false, extra),
                _ => match extra.checked_sub(BOOKING_LEN) {
                    Some(n @ (ALLOWANCES_LEN | ALLOWANCES_LEN_BEFORE_PACE)) => (true, n),
                    _ => return None,
                },
            };
            let booking = match has_booking {
                true => Some(Booking { starts: Nanos::from_nanos(word(rest, len + 8)?), units: word(rest, len + 16)? }),
                false => None,
            };
            let allowances = match allowances_len {
                0 => None,
                _ => {
                    let at = len + 8 + if has_booking { BOOKING_LEN } else { 0 };
                    let terms = Terms::from_parts(word(rest, at)?, word(rest, at + 8)?);
                    let (term, current) = (word(rest, at + 16)?, word(rest, at + 24)?);
                    let (next, settled) = (word(rest, at + 32)?, word(rest, at + 40)?);
                    let at_start = if allowances_len == ALLOWANCES_LEN { word(rest, at + 48)? } else { current };
                    Some((terms, Reservations { term, current, next, settled, at_start }))
                }
            };
            let paced_until = Nanos::from_nanos(word(rest, len)?);
            readable(first).then(|| Stored { state: rest[..len].to_vec(), paced_until, booking, allowances })
        });
        let mut bucket = found.unwrap_or_else(|| {
            let mut state = vec![0; len];
            policy.write_fresh(&mut state, now);
            Stored { state, paced_until: Nanos::ZERO, booking: None, allowances: None }
        });
        bucket.booking = booking::settle(policy, &mut bucket.state, bucket.booking, now);
        bucket.allowances = bucket
            .allowances
            .map(|(terms, held)| (terms, held.settle(policy, &terms, &mut bucket.state, now)))
            .filter(|(_, held)| !held.is_empty());
        bucket
    }

    /// Decides `cost` units at `now` (see `floodgate_core::lease::booking::decide`).
    fn decide(&mut self, limit: &Limit, now: Nanos, cost: u64) -> Decision {
        booking::decide(limit.policy(), &mut self.state, self.booking, now, cost)
    }

    /// What the next window holds before it starts: units leases ahead
    /// booked there and allowances reserved there, as one booking (`None`:
    /// nothing).
    fn next_held(&self, policy: &dyn floodgate_core::algorithm::Policy, now: Nanos) -> Option<Booking> {
        let reserved = match (self.allowances, policy.counting_window(&self.state, now)) {
            (Some((terms, held)), Some(counted)) => {
                Some(Booking { starts: counted.end, units: held.reserved(&terms, counted.index.saturating_add(1)) })
            }
            _ => None,
        };
        match (self.booking, reserved.filter(|r| r.units > 0)) {
            (Some(booked), Some(reserved)) if booked.starts == reserved.starts => {
                Some(Booking { units: booked.units.saturating_add(reserved.units), ..booked })
            }
            (booked, reserved) => booked.or(reserved),
        }
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
        let mut idle_at = booking::idle_at(policy, &self.state, self.booking, now);
        let mut bytes = Vec::with_capacity(1 + self.state.len() + 8 + BOOKING_LEN + ALLOWANCES_LEN);
        bytes.push(limit.algorithm().tag);
        bytes.extend_from_slice(&self.state);
        bytes.extend_from_slice(&self.paced_until.get().to_le_bytes());
        if let Some(booking) = self.booking {
            bytes.extend_from_slice(&booking.starts.get().to_le_bytes());
            bytes.extend_from_slice(&booking.units.to_le_bytes());
        }
        if let Some((terms, held)) = self.allowances.filter(|(_, held)| !held.is_empty()) {
            for word in
                [terms.windows(), terms.phase(), held.term, held.current, held.next, held.settled, held.at_start]
            {
                bytes.extend_from_slice(&word.to_le_bytes());
            }
            // Reserved units count until the last window they are reserved in ends.
            if let Some(last) = held.last_window(&terms) {
                idle_at = idle_at.max(window_len(limit).times(last.saturating_add(1)));
            }
        }
        // A key in use keeps its place for a window after its last use,
        // even once idle: between its windows it is still a live key.
        Next { bytes, idle_at, keep_until: idle_at.max(now + window_len(limit)), kind: Kind::Bucket, owner: None }
    }
}

/// The limit's window: the algorithm's (a fixed window's period), else the
/// rule's period.
fn window_len(limit: &Limit) -> Nanos {
    limit.policy().quota().window.unwrap_or(limit.period())
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
    /// How many consecutive windows, from `window` on, the lease holds
    /// `granted` tokens in: 0 for a lease of one window's (or one
    /// lifetime's) tokens, 1 or more for an allowance.
    pub windows: u64,
    /// When the tokens start counting: now, or for a lease ahead the start
    /// of the window they are for.
    pub starts_at: Nanos,
    /// How long (from now) the tokens may be used.
    pub valid: Nanos,
    /// The key has used most of its limit (see
    /// `floodgate_core::lease::overshoot::near_limit`), in the window that
    /// counts now or the one the tokens are for.
    pub near_limit: bool,
    /// The bucket after the grant and the report (store it when either
    /// took something).
    pub next: Next,
}

/// What a caller asks of one lease (see [`lease`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeaseAsk {
    /// The most tokens it wants.
    pub wanted: u64,
    /// Its observed consumption, tokens per second.
    pub rate: Option<f64>,
    /// The window it wants tokens of (`None`: the one that counts now).
    pub window: Option<u64>,
    /// It can hold an allowance.
    pub per_window: bool,
    /// Units it admitted without a lease, to count first.
    pub reported: u64,
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
///
/// A caller that can hold one (`per_window`) gets an allowance when the
/// bucket `key` is a fixed window far enough below its limit
/// ([`lease_allowance`]); otherwise a lease as above.
///
/// Units the caller `reported` (admitted without a lease, under a rule's
/// overshoot budget) are counted first, at `now`: in full by an algorithm
/// that counts in windows, whatever its limit says (they were admitted);
/// by any other as far as the bucket holds them. The answer says whether
/// the key is then near its limit.
pub fn lease(limit: &Limit, key: &str, stored: Option<&[u8]>, now: Nanos, ask: LeaseAsk, ttl: Nanos) -> Leased {
    let mut bucket = Stored::load(limit, stored, now);
    count_reported(limit, &mut bucket, now, ask.reported);
    let capacity = limit.policy().capacity();
    let near_now = near_limit(bucket.decide_copy(limit, now).remaining, capacity);
    let mut leased = lease_counted(limit, key, bucket, now, ask, ttl);
    leased.near_limit = near_now || near_limit(leased.decision.remaining, capacity);
    leased
}

/// Counts `reported` units at `now` (see [`lease`]).
fn count_reported(limit: &Limit, bucket: &mut Stored, now: Nanos, reported: u64) {
    let policy = limit.policy();
    if reported == 0 {
        return;
    }
    if policy.counting_window(&bucket.state, now).is_some() {
        policy.count(&mut bucket.state, now, reported);
    } else {
        let fits = bucket.decide_copy(limit, now).remaining.min(reported);
        if fits > 0 {
            bucket.decide(limit, now, fits);
        }
    }
}

/// A lease decided on `bucket` once reports are counted (see [`lease`]).
fn lease_counted(limit: &Limit, key: &str, mut bucket: Stored, now: Nanos, ask: LeaseAsk, ttl: Nanos) -> Leased {
    let LeaseAsk { wanted, rate, window, per_window, .. } = ask;
    let policy = limit.policy();
    let capacity = policy.capacity();
    if per_window {
        if let Some(leased) = lease_allowance(limit, key, &bucket, now, (rate, window), ttl) {
            return leased;
        }
    }
    if let Some(named) = window {
        let held = bucket.next_held(policy, now);
        let ahead = booking::ahead(policy, &bucket.state, held, now);
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
    // A key heading past three quarters of its limit at its window's pace
    // (`heading`), in a window that outlasts its leases (a per-minute
    // window's leases of a second): what a lease does not spend stays
    // counted there until its holder claims again, out of other callers'
    // reach. Such a lease aims at the low end of what the caller's rate, a
    // second's observation, vouches for (the callers that ask are the ones
    // that just saw requests); one that needs more asks again sooner.
    let heads = heading(limit, &bucket, now, capacity.saturating_sub(remaining)) && window_len(limit) > ttl.times(2);
    let rate = if heads { rate.map(low_rate) } else { rate };
    let target = lease_target(wanted, rate, valid, capacity);
    let cap = grant_cap(remaining, capacity, horizon, ttl, bucket.paced_until, now);
    let granted = target.min(cap);
    let mut d = bucket.decide(limit, now, granted);
    if granted == 0 && target > 0 && remaining > 0 && d.allowed() {
        // Refused by the pace, not by the limit: back when it gives again.
        d.reset = d.reset.min(paced_retry(remaining, horizon, ttl, bucket.paced_until, now));
    }
    // A denied grant (an algorithm that admits fewer than `remaining` at
    // once, such as a cold warm_up bucket) takes nothing.
    let granted = if d.allowed() { granted } else { 0 };
    bucket.paced_until = paced_until(granted, remaining, capacity, horizon, bucket.paced_until, now);
    let next = bucket.into_next(limit, now);
    Leased { granted, decision: d, window, windows: 0, starts_at: now, valid, near_limit: false, next }
}

/// Whether the fixed window that counts now, `used` of its limit so far, is
/// on its way past [`share_of`] its limit at its pace (`paced_use`), once
/// enough of it has passed to tell (`pace_seen`); before that, and for
/// other algorithms, whether it is near its limit now.
fn heading(limit: &Limit, bucket: &Stored, now: Nanos, used: u64) -> bool {
    let policy = limit.policy();
    let period = window_len(limit);
    let counted = policy.counting_window(&bucket.state, now).filter(|counted| counted.renews);
    match counted.map(|counted| WindowPace::of(bucket, counted, period, used, now)) {
        Some(pace) if pace_seen(pace.elapsed, limit.limit(), period) => pace.paced > share_of(limit.limit()),
        _ => near_limit(policy.capacity().saturating_sub(used), policy.capacity()),
    }
}

/// How a fixed window that counts now is going: how long it has run, what
/// the key's allowances reserved in it when it began, and its count (`used`
/// so far) projected to its end by `paced_use`.
struct WindowPace {
    elapsed: Nanos,
    at_start: u64,
    paced: u64,
}

impl WindowPace {
    fn of(bucket: &Stored, counted: CountingWindow, period: Nanos, used: u64, now: Nanos) -> Self {
        let elapsed = now - (counted.end - period);
        let at_start = bucket.allowances.map_or(0, |(_, held)| held.counted_at_start(counted.index));
        WindowPace { elapsed, at_start, paced: paced_use(used, at_start, elapsed, period) }
    }
}

/// An allowance (see `floodgate_core::lease::allowance`): tokens in each
/// window of a fixed window (each one-period slot of a token bucket) from
/// the one that counts now (or the next one, when `window` names it) to the
/// end of the key's term, sized to the caller's `rate` by
/// `allowance_target`. Granted only when the key is far below its limit
/// (`far_below`: a small share of the limit, and the window that counts now
/// not near it; a token bucket's `bucket_far_below`), it fits in every one
/// of those windows with what the others reserved there staying within
/// `RESERVED_SHARE` of the limit (a token bucket's `bucket_reservable`),
/// and in its first window with what is counted (or booked ahead)
/// there, and in the next window, when it covers it, with what leases
/// ahead booked there; `None` otherwise: the caller gets a lease of one
/// window, which follows demand more closely. A window as long as a term
/// (a per-minute window), more than half over, is covered with the next.
fn lease_allowance(
    limit: &Limit,
    key: &str,
    bucket: &Stored,
    now: Nanos,
    (rate, window): (Option<f64>, Option<u64>),
    ttl: Nanos,
) -> Option<Leased> {
    let policy = limit.policy();
    let counted = policy.allowance_slot(&bucket.state, now)?;
    let period = window_len(limit);
    let (terms, mut held) =
        bucket.allowances.unwrap_or((Terms::new(period, DEFAULT_TERM, key), Reservations::default()));
    let ahead = window == Some(counted.index.saturating_add(1));
    let (first, mut last) = terms.span(if ahead { counted.index + 1 } else { counted.index });
    if last == first && !ahead && counted.end - now < period.halved() {
        // A window as long as a term, more than half over: through the next
        // one too, as a term more than half over is (no allowance is short).
        last = first + 1;
    }
    let units = allowance_target(rate, period, policy.capacity());
    let counted_now = policy.capacity().saturating_sub(bucket.decide_copy(limit, now).remaining);
    let own = if ahead { 0 } else { units };
    let (far, reservable) = if counted.renews {
        // Judged by the pace of the window that counts now, not its count
        // alone (see `paced_use`).
        let pace = WindowPace::of(bucket, counted, period, counted_now, now);
        // Early in a window its pace says little: enough only for a key
        // whose allowances it began with, and whose windows have not come
        // near their limit of late (the pace is kept only in a window's
        // last tenth: `paced_until`).
        let quiet = pace.at_start > 0 && bucket.paced_until <= counted.end - period.times(2);
        let seen = quiet || pace_seen(pace.elapsed, limit.limit(), period);
        (seen && far_below(units, pace.paced.saturating_add(own), limit.limit()), share_of(limit.limit()))
    } else {
        // A token bucket: see `bucket_reservable`.
        let earned = u128::from(limit.limit()) * u128::from(ttl.min(period).get()) / u128::from(period.get().max(1));
        let reservable = bucket_reservable(policy.capacity(), u64::try_from(earned).unwrap_or(u64::MAX));
        (bucket_far_below(units, counted_now.saturating_add(own), policy.capacity(), reservable), reservable)
    };
    if !far || units > held.room(&terms, first, last, reservable) {
        return None;
    }
    let mut bucket = bucket.clone();
    // The next window, when it covers it, must hold it beside what leases
    // ahead booked and allowances reserved there (the later windows hold
    // only reservations, which `room` bounded).
    let next = counted.index.saturating_add(1);
    let booked = bucket.booking.filter(|b| b.starts == counted.end).map_or(0, |b| b.units);
    let taken = booked.saturating_add(held.reserved(&terms, next)).saturating_add(units);
    let next_left = if last >= next { policy.capacity().checked_sub(taken)? } else { 0 };
    let decision = if ahead {
        Decision::admit(next_left, (counted.end - now) + period)
    } else {
        Some(bucket.decide(limit, now, units)).filter(Decision::allowed)?
    };
    held.reserve(&terms, counted.index, first, last, units);
    bucket.allowances = Some((terms, held));
    let starts_at = if ahead { counted.end } else { now };
    let valid = (counted.end + period.times(last - counted.index)) - now;
    let windows = last - first + 1;
    Some(Leased {
        granted: units,
        decision,
        window: first,
        windows,
        starts_at,
        valid,
        near_limit: false,
        next: bucket.into_next(limit, now),
    })
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
    // Booked beside what allowances reserve there, which the booking leaves out.
    let held = bucket.next_held(policy, now);
    let reserved = held.map_or(0, |h| h.units).saturating_sub(bucket.booking.map_or(0, |b| b.units));
    let booked = match booking::book(policy, &bucket.state, held, ahead, granted) {
        Some(after) if granted > 0 => after,
        _ => {
            granted = 0;
            held.unwrap_or(Booking { starts: ahead.starts, units: reserved })
        }
    };
    let units = booked.units.saturating_sub(reserved);
    bucket.booking = (units > 0).then_some(Booking { units, ..booked });
    // What the next window has left, and when it frees more, as seen from its start.
    let mut settled = bucket.state.clone();
    let pending = booking::settle(policy, &mut settled, Some(booked), ahead.starts);
    let then = booking::decide(policy, &mut settled, pending, ahead.starts, 0);
    let decision = Decision::admit(then.remaining, (ahead.starts - now) + then.reset);
    let (starts_at, valid) = (ahead.starts, (ahead.starts - now) + usable);
    let window = ahead.window.index;
    let next = bucket.into_next(limit, now);
    Leased { granted, decision, window, windows: 0, starts_at, valid, near_limit: false, next }
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
    /// [`Leased::windows`]: 0 for a lease of one window, else an allowance
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
    pub fn of(key: &str, limit: &Limit, leased: &Leased, now: Nanos, margin: Nanos) -> Self {
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
    if record.windows > 0 {
        return give_back_allowance(record, bucket, now, grant.cost);
    }
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

/// Gives back an allowance: before its first window starts, its units come
/// off every window it reserved (`returned` is the units per window taken
/// off); while one of its windows counts, that window gets back `tokens`
/// (its unused part of this window's units, as any lease's return) and the
/// windows after it are no longer reserved; after its last window, nothing.
fn give_back_allowance(record: &LeaseRecord, mut bucket: Stored, now: Nanos, tokens: u64) -> (u64, Option<Next>) {
    let limit = &record.limit;
    let policy = limit.policy();
    let last = record.window.saturating_add(record.windows - 1);
    let Some(counted) = policy.allowance_slot(&bucket.state, now).filter(|c| c.index <= last) else {
        return (0, None);
    };
    let before = bucket.decide_copy(limit, now).remaining;
    let started = record.granted_at <= now;
    if started && tokens > 0 {
        let grant = Grant { cost: tokens, at: now };
        policy.release(&mut bucket.state, now, grant, Release::Return { granted: record.granted });
    }
    if let Some((terms, held)) = bucket.allowances.as_mut() {
        held.release(terms, counted.index, last, record.granted);
    }
    let next = bucket.into_next(limit, now);
    let back = match started {
        true => peek(limit, Some(&next.bytes), now).remaining.saturating_sub(before),
        false => record.granted,
    };
    (back, Some(next))
}

#[cfg(test)]
#[path = "decide_tests.rs"]
mod tests;
