//! A key's bucket as the quota service keeps it: the algorithm's state and,
//! beside it, what leases hold of it — the pace of its window's tail, the
//! units booked in the next window by leases ahead, and the allowances'
//! reservations. Both of the service's stores (and the fleet simulation)
//! keep it as the bytes [`ServiceBucket::encode`] writes, and decide on it
//! only through this type.

use super::allowance::{Reservations, Terms};
use super::booking::{self, Booking};
use super::restart;
use crate::algorithm::{Decision, Policy};
use crate::time::Nanos;

/// A key's limit, as the lease rules see it: the algorithm that decides
/// its bucket (with the tag its stored states carry), and the count and
/// period the limits file gives it.
#[derive(Clone, Copy)]
pub struct KeyLimit<'a> {
    /// The algorithm, ready to decide on a state's bytes.
    pub policy: &'a dyn Policy,
    /// The algorithm's registration tag (`Registration::tag`).
    pub tag: u8,
    /// Units per period.
    pub limit: u64,
    /// The period.
    pub period: Nanos,
}

impl KeyLimit<'_> {
    /// The limit's window: the algorithm's (a fixed window's period), else
    /// the period.
    pub fn window(&self) -> Nanos {
        self.policy.quota().window.unwrap_or(self.period)
    }
}

/// Every stored value starts with a tag byte: a bucket's is its algorithm's
/// (`Registration::tag`); the service's lease records have one of their
/// own. A value stored before values carried one reads with this tag (the
/// Redis store keeps the tag in a field of its own, beside the value as it
/// was laid out before).
pub const UNTAGGED: u8 = 0;

/// Untagged states were written by the layouts of the tags registered then
/// (1 to 8): one is read only while its algorithm still has such a tag.
const LAST_UNTAGGED_LAYOUT: u8 = 8;

/// Bytes of a booking, and of the allowances' terms and reservations, after the pace.
const BOOKING_LEN: usize = 16;
const ALLOWANCES_LEN: usize = 56;
/// The allowances' bytes as written before they kept what their window was
/// counted at its start (read as all of its reservations).
const ALLOWANCES_LEN_BEFORE_PACE: usize = 48;

/// A bucket as stored: the algorithm's tag (its registration's, so a state
/// of another layout is never misread), the algorithm's state
/// (`Policy::state_len` bytes, as the core lays them out), then the lease
/// pace's "paced until" instant (8 bytes, little-endian; see
/// [`super::sizing::Pace`]), then, only while leases ahead have booked
/// units of the next window, that window's start and the units (8 bytes
/// each, little-endian; see [`super::booking`]), then, only while
/// allowances hold units of its windows, the key's terms (windows per term,
/// phase) and its reservations (term, current, next, settled, at start: 8
/// bytes each, little-endian; see [`super::allowance`]).
#[derive(Clone, Debug)]
pub struct ServiceBucket {
    /// The algorithm's state.
    pub state: Vec<u8>,
    /// How far the even schedule of the window's tail has been handed out.
    pub paced_until: Nanos,
    /// Units of the next window booked by leases ahead. Pending: a booking
    /// whose window has started is counted in `state` on load.
    pub booking: Option<Booking>,
    /// Allowances' reservations, settled on load (the window that counts
    /// now has its reservation counted in `state`).
    pub allowances: Option<(Terms, Reservations)>,
}

fn word(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

/// How many windows a fixed window's bucket remembers that its tail was
/// handed out, paced ([`ServiceBucket::paced_until`]): the window that
/// counts now and the one before it.
pub const TAIL_MEMORY_WINDOWS: u64 = 2;

impl ServiceBucket {
    /// Whether a fixed window's key ran short lately: the tail of its
    /// window that counts now, or of the one before, was handed out, paced
    /// (`paced_until`). Under excess demand spread over many Envoys, a
    /// per-second key's leases sized to thin pairs' rates, and allowances
    /// reserving a caller's rate with room in every window of a term, held
    /// a third of its limit where requests seldom came while its other
    /// Envoys were refused (74 % of what its windows' arrivals could use,
    /// at 100 Envoys × 10³ keys): the lease rules size both at the low end
    /// there. Never for other algorithms: a token bucket's tail is earned
    /// again as it goes.
    pub fn ran_short_lately(&self, limit: &KeyLimit<'_>, now: Nanos) -> bool {
        self.tail_remembered_until(limit, now).is_some_and(|until| until > now)
    }

    /// Until when a fixed window remembers its last paced tail (see
    /// [`ServiceBucket::ran_short_lately`]).
    fn tail_remembered_until(&self, limit: &KeyLimit<'_>, now: Nanos) -> Option<Nanos> {
        let renews = limit.policy.counting_window(&self.state, now).is_some_and(|counted| counted.renews);
        (renews && self.paced_until > Nanos::ZERO).then(|| self.paced_until + limit.window().times(TAIL_MEMORY_WINDOWS))
    }

    /// The stored bucket at `now` when it is of the limit's algorithm and
    /// shape; a bucket a store forgot (a [`restart::marker`]) owing
    /// what allowances granted before it forgot may still spend; else
    /// (never stored, expired, another layout, or another shape: a state
    /// whose size depends on fields that a reload changed) a fresh bucket.
    pub fn load(limit: &KeyLimit<'_>, stored: Option<&[u8]>, now: Nanos) -> Self {
        if let Some((started_at, key)) = restart::forgotten(stored) {
            // Fresh as the store started (or now, if earlier), owing what
            // the allowances granted before may still spend.
            let started_at = started_at.min(now);
            let mut bucket = Self::load(limit, None, started_at);
            let owed =
                restart::owed(limit.policy, (limit.limit, limit.window()), key, &mut bucket.state, started_at, now);
            return match owed {
                Some(allowances) => ServiceBucket { allowances: Some(allowances), ..bucket },
                None => Self::load(limit, None, now),
            };
        }
        let (policy, tag) = (limit.policy, limit.tag);
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
            readable(first).then(|| ServiceBucket { state: rest[..len].to_vec(), paced_until, booking, allowances })
        });
        let mut bucket = found.unwrap_or_else(|| {
            let mut state = vec![0; len];
            policy.write_fresh(&mut state, now);
            ServiceBucket { state, paced_until: Nanos::ZERO, booking: None, allowances: None }
        });
        bucket.booking = booking::settle(policy, &mut bucket.state, bucket.booking, now);
        bucket.allowances = bucket
            .allowances
            .map(|(terms, held)| (terms, held.settle(policy, &terms, &mut bucket.state, now)))
            .filter(|(_, held)| !held.is_empty());
        bucket
    }

    /// Decides `cost` units at `now` (see [`booking::decide`]).
    pub fn decide(&mut self, limit: &KeyLimit<'_>, now: Nanos, cost: u64) -> Decision {
        booking::decide(limit.policy, &mut self.state, self.booking, now, cost)
    }

    /// What a zero-cost decision at `now` says, leaving the bucket as it is.
    pub fn peek(&self, limit: &KeyLimit<'_>, now: Nanos) -> Decision {
        booking::decide(limit.policy, &mut self.state.clone(), self.booking, now, 0)
    }

    /// What the next window holds before it starts: units leases ahead
    /// booked there and allowances reserved there, as one booking (`None`:
    /// nothing).
    pub fn next_held(&self, policy: &dyn Policy, now: Nanos) -> Option<Booking> {
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

    /// The bytes to store, and when the bucket is idle: from then on, left
    /// alone, it is indistinguishable from a fresh one (and stays so), so a
    /// store may forget it without losing a count.
    pub fn encode(&self, limit: &KeyLimit<'_>, now: Nanos) -> (Vec<u8>, Nanos) {
        // The core's `idle_at` is exact and property-tested. Every write
        // sets the time again, so a bucket written later lives longer.
        let mut idle_at = booking::idle_at(limit.policy, &self.state, self.booking, now);
        // Until then a fixed window differs from a fresh one in what it
        // remembers of its tail (`ran_short_lately`), even once it is over.
        if let Some(until) = self.tail_remembered_until(limit, now) {
            idle_at = idle_at.max(until);
        }
        let mut bytes = Vec::with_capacity(1 + self.state.len() + 8 + BOOKING_LEN + ALLOWANCES_LEN);
        bytes.push(limit.tag);
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
                idle_at = idle_at.max(limit.window().times(last.saturating_add(1)));
            }
        }
        (bytes, idle_at)
    }
}
