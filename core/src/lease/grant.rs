//! The service's side of a lease, in one place: what one caller's ask gets
//! of a key's bucket ([`grant`]) — a lease of the window that counts now,
//! a lease ahead of the next window, or an allowance of many windows — and
//! what a return gives back to it ([`give_back`]). Pure functions of the
//! key's limit, its [`ServiceBucket`] and the time; both of the service's
//! stores and the fleet simulation call them, and only them.
//!
//! The rules they combine live beside them: a lease's size in
//! [`super::sizing`], allowances in [`super::allowance`], bookings of the
//! next window in [`super::booking`].

use super::allowance::{
    allowance_target, bucket_allowance, bucket_earned, bucket_far_below, bucket_reservable, far_below, low_count,
    main_allowance, main_user, mean_per, one_share, pace_seen, paced_use, share_of, vouches, Reservations, Terms,
    DEFAULT_TERM, MAIN_USER_SHARE, MIN_MEAN_WHEN_SHORT,
};
use super::booking::{self, Ahead, Booking};
use super::bucket::{KeyLimit, ServiceBucket};
use super::overshoot::near_limit;
use super::sizing::{ahead_cap, lease_target, low_rate, Pace};
use crate::algorithm::{CountingWindow, Decision, Grant, Release};
use crate::time::Nanos;

/// What a caller asks of one key.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ask {
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
    /// A request waits for `wanted` at a cold pool: decide them as a check
    /// (see [`grant`]).
    pub check: bool,
}

/// What an ask got, and the bucket after it.
#[derive(Debug, Clone)]
pub struct Allotment {
    /// Tokens granted (per window, for an allowance).
    pub granted: u64,
    /// The bucket's state after the grant.
    pub decision: Decision,
    /// The algorithm's window the tokens are counted in (see
    /// `CountingWindow`; 0 for algorithms without one); for an allowance,
    /// its first window.
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
    /// The key has used most of its limit (see [`near_limit`]), in the
    /// window that counts now or the one the tokens are for.
    pub near_limit: bool,
    /// The bucket after the grant and the report (store it when either
    /// took something).
    pub bucket: ServiceBucket,
    /// The ask was decided as a check: nothing to record, nothing to return.
    pub checked: bool,
}

/// Decides `ask` on `bucket`, the bucket of `key` under `limit`, at `now`,
/// for leases living `ttl`.
///
/// Units the caller `reported` (admitted without a lease, under a rule's
/// overshoot budget) are counted first: in full by an algorithm that
/// counts in windows, whatever its limit says (they were admitted); by any
/// other as far as the bucket holds them. The answer says whether the key
/// is then near its limit.
///
/// A cold pair's wait (`check`) is decided as check mode decides a request:
/// `wanted` taken now or refused, valid as a lease of the window that counts
/// now would be; the store keeps no record of it, so it costs one bucket
/// write and nothing to return.
///
/// A caller that can hold one (`per_window`) gets an allowance when the
/// bucket is a fixed window (or a token bucket's slot) far enough below
/// its limit (`allowance`). A caller that names the next window, when it
/// starts within `ttl`, gets a lease ahead (`ahead`). Any other ask gets
/// a lease of the window that counts now (`of_window`).
pub fn grant(
    limit: &KeyLimit<'_>,
    key: &str,
    mut bucket: ServiceBucket,
    ask: Ask,
    now: Nanos,
    ttl: Nanos,
) -> Allotment {
    count_reported(limit, &mut bucket, now, ask.reported);
    let capacity = limit.policy.capacity();
    let near_now = near_limit(bucket.peek(limit, now).remaining, capacity);
    let mut allotted = decide(limit, key, bucket, now, ask, ttl);
    allotted.near_limit = near_now || near_limit(allotted.decision.remaining, capacity);
    allotted
}

/// Counts `reported` units at `now` (see [`grant`]).
fn count_reported(limit: &KeyLimit<'_>, bucket: &mut ServiceBucket, now: Nanos, reported: u64) {
    let policy = limit.policy;
    if reported == 0 {
        return;
    }
    if policy.counting_window(&bucket.state, now).is_some() {
        policy.count(&mut bucket.state, now, reported);
    } else {
        let fits = bucket.peek(limit, now).remaining.min(reported);
        if fits > 0 {
            bucket.decide(limit, now, fits);
        }
    }
}

/// An allowance, a lease ahead or a lease of this window, once reports are
/// counted (see [`grant`]).
fn decide(limit: &KeyLimit<'_>, key: &str, bucket: ServiceBucket, now: Nanos, ask: Ask, ttl: Nanos) -> Allotment {
    if ask.check {
        return check(limit, bucket, now, ask.wanted, ttl);
    }
    if ask.per_window {
        if let Some(allotted) = allowance(limit, key, &bucket, now, (ask.rate, ask.window), ttl) {
            return allotted;
        }
    }
    if let Some(named) = ask.window {
        let held = bucket.next_held(limit.policy, now);
        let next = booking::ahead(limit.policy, &bucket.state, held, now);
        if let Some(next) = next.filter(|a| a.window.index == named && a.starts - now <= ttl) {
            return ahead(limit, bucket, now, (ask.wanted, ask.rate), ttl, &next);
        }
    }
    of_window(limit, bucket, now, (ask.wanted, ask.rate), ttl)
}

/// `cost` units decided as a check, for a request that waits (see [`grant`]).
fn check(limit: &KeyLimit<'_>, mut bucket: ServiceBucket, now: Nanos, cost: u64, ttl: Nanos) -> Allotment {
    let (horizon, window, valid) = counting(limit, &bucket, now, ttl);
    let remaining = bucket.peek(limit, now).remaining;
    let pace = Pace { remaining, capacity: limit.policy.capacity(), horizon, ttl, paced_until: bucket.paced_until };
    let decision = bucket.decide(limit, now, cost);
    let granted = if decision.allowed() { cost } else { 0 };
    // Taken from a window's tail, it moves the window's pace as a lease of
    // it would: a key whose tail went to checks is not quiet after it.
    bucket.paced_until = pace.after(granted, now);
    Allotment { granted, decision, window, windows: 0, starts_at: now, valid, near_limit: false, bucket, checked: true }
}

/// What a grant at `now` counts in: the time over which what remains of
/// the bucket must last (the rest of a fixed window; otherwise the
/// algorithm's period), the window's index (0 without windows), and how
/// long its units stay valid (until that window ends, at most `ttl`).
fn counting(limit: &KeyLimit<'_>, bucket: &ServiceBucket, now: Nanos, ttl: Nanos) -> (Nanos, u64, Nanos) {
    let period = limit.window();
    match limit.policy.counting_window(&bucket.state, now) {
        Some(counted) => {
            let left = counted.end - now;
            (if counted.renews { left } else { period }, counted.index, ttl.min(left))
        }
        None => (period, 0, ttl),
    }
}

/// A lease of the window that counts now: sized by [`lease_target`] to the
/// caller's rate over the time the tokens may be used, capped by the
/// bucket's [`Pace`].
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
fn of_window(
    limit: &KeyLimit<'_>,
    mut bucket: ServiceBucket,
    now: Nanos,
    (wanted, rate): (u64, Option<f64>),
    ttl: Nanos,
) -> Allotment {
    let policy = limit.policy;
    let capacity = policy.capacity();
    // A zero-cost decision on a copy: what the bucket holds now.
    let remaining = bucket.peek(limit, now).remaining;
    let (horizon, window, valid) = counting(limit, &bucket, now, ttl);
    // A key heading past three quarters of its limit at its window's pace
    // (`heading`), in a window that outlasts its leases (a per-minute
    // window's leases of a second): what a lease does not spend stays
    // counted there until its holder claims again, out of other callers'
    // reach. Such a lease aims at the low end of what the caller's rate, a
    // second's observation, vouches for (the callers that ask are the ones
    // that just saw requests); one that needs more asks again sooner. In a
    // window as short as its leases (a per-second window) a pace of a
    // fraction of it tells little; the sign there is that its key ran
    // short lately (`ServiceBucket::ran_short_lately`).
    let leader = leads(limit, &bucket, rate, now);
    let heads = match limit.window() > ttl.times(2) {
        true => heading(limit, &bucket, now, capacity.saturating_sub(remaining)),
        false => bucket.ran_short_lately(limit, now) && !leader,
    };
    let rate = if heads { rate.map(low_rate) } else { rate };
    let target = lease_target(wanted, rate, valid, capacity);
    let pace = Pace { remaining, capacity, horizon, ttl, paced_until: bucket.paced_until };
    // The tail is paced to share it among callers; the key's leader (one
    // proxy behind a key-affine balancer) has none to share it with.
    let cap = if leader { remaining } else { pace.cap(now) };
    let granted = target.min(cap);
    let mut d = bucket.decide(limit, now, granted);
    if granted == 0 && target > 0 && remaining > 0 && d.allowed() {
        // Refused by the pace, not by the limit: back when it gives again.
        d.reset = d.reset.min(pace.retry(now));
    }
    // A denied grant (an algorithm that admits fewer than `remaining` at
    // once, such as a cold warm_up bucket) takes nothing.
    let granted = if d.allowed() { granted } else { 0 };
    bucket.paced_until = pace.after(granted, now);
    // A bucket's leader that took all of it (nothing remains): its lease,
    // and its answer's reset, last until the bucket is full again.
    let valid = match leader && window == 0 && granted > 0 && d.remaining == 0 {
        true => {
            let full = valid.min(earned_in(capacity, limit));
            d.reset = full;
            full
        }
        false => valid,
    };
    Allotment {
        granted,
        decision: d,
        window,
        windows: 0,
        starts_at: now,
        valid,
        near_limit: false,
        bucket,
        checked: false,
    }
}

/// The time in which `limit` earns `units` back.
fn earned_in(units: u64, limit: &KeyLimit<'_>) -> Nanos {
    let nanos = u128::from(units) * u128::from(limit.period.get()) / u128::from(limit.limit.max(1));
    Nanos::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
}

/// Whether the fixed window that counts now, `used` of its limit so far, is
/// on its way past [`share_of`] its limit at its pace (`paced_use`), once
/// enough of it has passed to tell (`pace_seen`); before that, and for
/// other algorithms, whether it is near its limit now.
fn heading(limit: &KeyLimit<'_>, bucket: &ServiceBucket, now: Nanos, used: u64) -> bool {
    let policy = limit.policy;
    let period = limit.window();
    let counted = policy.counting_window(&bucket.state, now).filter(|counted| counted.renews);
    match counted.map(|counted| WindowPace::of(bucket, counted, period, used, now)) {
        Some(pace) if pace_seen(pace.elapsed, limit.limit, period) => pace.paced > share_of(limit.limit),
        _ => near_limit(policy.capacity().saturating_sub(used), policy.capacity()),
    }
}

/// Whether a caller asking at `rate` is the [`main_user`] of `bucket`, a
/// fixed window's, at `now` (never for other algorithms).
pub(super) fn asks_as_main_user(limit: &KeyLimit<'_>, bucket: &ServiceBucket, rate: Option<f64>, now: Nanos) -> bool {
    let policy = limit.policy;
    let Some(counted) = policy.allowance_slot(&bucket.state, now).filter(|counted| counted.renews) else {
        return false;
    };
    let period = limit.window();
    let used = policy.capacity().saturating_sub(bucket.peek(limit, now).remaining);
    WindowPace::of(bucket, counted, period, used, now).has_main_user(mean_per(rate, period))
}

/// Whether a caller asking at `rate` leads `bucket`'s key at `now`: its
/// [`main_user`] by a pace the window that counts now has run long enough
/// to tell ([`pace_seen`]) and that [`vouches`] for the caller's rate, at a
/// key no allowance holds a unit of (where allowances cover most of a
/// key's pace, what is left of it says little of who leads). Behind a
/// key-affine balancer: the one proxy that sees the key. A token or leaky
/// bucket keeps no pace: its leader is a caller whose own mean (a unit a
/// period or more at its low end, [`low_count`]) is the bucket's whole
/// limit, which it would spend alone. Other algorithms have none.
fn leads(limit: &KeyLimit<'_>, bucket: &ServiceBucket, rate: Option<f64>, now: Nanos) -> bool {
    let policy = limit.policy;
    let Some(counted) = policy.allowance_slot(&bucket.state, now) else {
        return false;
    };
    if bucket.allowances.is_some_and(|(terms, held)| !held.as_of(&terms, counted.index).is_empty()) {
        return false;
    }
    let period = limit.window();
    let mean = mean_per(rate, period);
    if !counted.renews {
        let (part, whole) = MAIN_USER_SHARE;
        return low_count(mean) >= 1.0 && mean * whole as f64 >= limit.limit as f64 * part as f64;
    }
    let used = policy.capacity().saturating_sub(bucket.peek(limit, now).remaining);
    let pace = WindowPace::of(bucket, counted, period, used, now);
    pace_seen(pace.elapsed, limit.limit, period) && vouches(pace.paced, mean) && pace.has_main_user(mean)
}

/// How a fixed window that counts now is going: how long it has run, what
/// the key's allowances reserved in it when it began, what of its count
/// is allowances' (`reserved`, see `of`), its count so far (`used`), and
/// that count projected to its end by `paced_use`.
struct WindowPace {
    elapsed: Nanos,
    at_start: u64,
    reserved: u64,
    used: u64,
    paced: u64,
}

impl WindowPace {
    fn of(bucket: &ServiceBucket, counted: CountingWindow, period: Nanos, used: u64, now: Nanos) -> Self {
        let elapsed = now - (counted.end - period);
        let at_start = bucket.allowances.map_or(0, |(_, held)| held.counted_at_start(counted.index));
        // Allowances count at their units, not at the window's pace: those
        // it began with and, in a window as long as a term (a per-minute
        // window), those granted in it too, each sized to what is left of
        // it (see `allowance`): its holder's demand there, not a sign of
        // how fast the window fills. Within a shorter window's term, many
        // callers taking allowances in one window is that sign.
        let reserved = match bucket.allowances {
            Some((terms, held)) if terms.windows() == 1 => {
                held.as_of(&terms, counted.index).reserved(&terms, counted.index).max(at_start)
            }
            _ => at_start,
        };
        WindowPace { elapsed, at_start, reserved, used, paced: paced_use(used, reserved, elapsed, period) }
    }

    /// What the window is paced to use beyond its allowances' units: the
    /// demand of the callers that hold none.
    fn beyond_allowances(&self) -> u64 {
        self.paced.saturating_sub(self.reserved.min(self.used))
    }

    /// Whether a caller spending `mean` units a window is the key's
    /// [`main_user`], judged by what the window is paced to use beyond the
    /// allowances it began with (a renewing holder's own allowance covers
    /// its own pace).
    fn has_main_user(&self, mean: f64) -> bool {
        main_user(mean, self.paced.saturating_sub(self.at_start.min(self.used)))
    }
}

/// An allowance (see [`super::allowance`]): tokens in each window of a fixed
/// window (each one-period slot of a token bucket) from the one that counts
/// now (or the next one, when `window` names it) to the end of the key's
/// term, sized to the caller's `rate` by `allowance_target`. Granted only
/// when the key is far below its limit (`far_below`: a small share of the
/// limit, and the window that counts now not near it; a token bucket's
/// `bucket_far_below`), it fits in every one of those windows with what the
/// others reserved there staying within `RESERVED_SHARE` of the limit (a
/// token bucket's `bucket_reservable`), and in its first window with what
/// is counted (or booked ahead) there, and in the next window, when it
/// covers it, with what leases ahead booked there; `None` otherwise: the
/// caller gets a lease of one window, which follows demand more closely.
fn allowance(
    limit: &KeyLimit<'_>,
    key: &str,
    bucket: &ServiceBucket,
    now: Nanos,
    (rate, window): (Option<f64>, Option<u64>),
    ttl: Nanos,
) -> Option<Allotment> {
    let policy = limit.policy;
    let counted = policy.allowance_slot(&bucket.state, now)?;
    let period = limit.window();
    let (terms, mut held) =
        bucket.allowances.unwrap_or((Terms::new(period, DEFAULT_TERM, key), Reservations::default()));
    let ahead = window == Some(counted.index.saturating_add(1));
    let (first, last) = terms.span(if ahead { counted.index + 1 } else { counted.index });
    let rest_only = last == first && !ahead;
    // A term of several windows reserves its units in each of them. At a
    // key that ran short lately (`ServiceBucket::ran_short_lately`), whose
    // window's first quarter, paced at its low end, may still look far
    // below its limit, it reserves only what the caller's rate vouches for
    // at its low end (a unit at least), and nothing for a caller whose
    // windows would leave that unit unspent more than one time in five
    // ([`MIN_MEAN_WHEN_SHORT`]): the key's demand elsewhere is refused
    // meanwhile. (A window as long as a term is judged again at each
    // renewal, sized to what is left of it.)
    let scarce = terms.windows() > 1 && bucket.ran_short_lately(limit, now);
    let mean = mean_per(rate, period);
    if scarce && mean < MIN_MEAN_WHEN_SHORT {
        return None;
    }
    // An allowance of the window that counts now alone (a window as long as
    // a term: a per-minute window) is sized to what is left of it: its
    // caller's rate, seen over a second or two, is too rough to hold
    // beyond it, and the renewal, asked ahead in its last half, sizes the
    // next window by what the caller spent meanwhile.
    let target = match scarce {
        true => (low_count(mean).ceil() as u64).clamp(1, policy.capacity().max(1)),
        false => allowance_target(rate, if rest_only { counted.end - now } else { period }, policy.capacity()),
    };
    let counted_now = policy.capacity().saturating_sub(bucket.peek(limit, now).remaining);
    // What a lease of a lifetime would hold at the caller's rate: the least
    // an allowance that does not fit whole may hold instead of its aim.
    let a_lease = lease_target(u64::MAX, rate, ttl, policy.capacity());
    let (units, far, reservable) = if counted.renews {
        // Judged by the pace of the window that counts now, not its count
        // alone (see `paced_use`).
        let pace = WindowPace::of(bucket, counted, period, counted_now, now);
        // Early in a window its pace says little: enough only for a key
        // whose allowances it began with, and whose windows have not come
        // near their limit of late (the pace is kept only in a window's
        // last tenth: `paced_until`).
        let quiet = pace.at_start > 0 && bucket.paced_until <= counted.end - period.times(2);
        let seen = quiet || pace_seen(pace.elapsed, limit.limit, period);
        let main = pace.has_main_user(mean);
        // Clipped to the main user's share only where no other caller's
        // allowances reserve a unit in the windows it would cover.
        let alone = held.room(&terms, first, last, share_of(limit.limit)) == share_of(limit.limit);
        let sole = seen && main && alone && vouches(pace.paced, mean);
        // Of the window's rest alone, at a rate that rough: at most one
        // caller's share, held where a refusal would leave the caller to
        // leases of a second (its renewal, sized by what it spent, may hold
        // the main user's). Where that does not fit whole beside the
        // window's pace, and what stops it is other callers' allowances
        // (sized to rough rates of their own, they count at their units)
        // while the demand beyond them stays within the quarter they leave,
        // it holds what does fit, when that is at least what a lease of a
        // lifetime would hold.
        let units = main_allowance(target, mean, limit.limit, sole);
        let units = match rest_only {
            true => {
                let fits = share_of(limit.limit).saturating_sub(pace.paced);
                let unreserved = limit.limit.saturating_sub(share_of(limit.limit));
                let units = units.min(one_share(limit.limit, false));
                if units > fits && fits >= a_lease && pace.beyond_allowances() <= unreserved {
                    fits
                } else {
                    units
                }
            }
            false => units,
        };
        let own = if ahead { 0 } else { units };
        (units, seen && far_below(units, pace.paced.saturating_add(own), limit.limit, main), share_of(limit.limit))
    } else {
        // A token bucket: see `bucket_reservable`. Its sole user (no other
        // caller's allowance in the slots it would cover) may hold all of
        // it; what it takes now is its own pace, so the bucket is judged
        // by what was taken before.
        let reservable = bucket_reservable(policy.capacity(), bucket_earned(limit.limit, period, ttl));
        let room = held.room(&terms, first, last, reservable);
        let sole = low_count(mean) >= 1.0 && room == reservable;
        // Where the other callers' allowances (sized to rough early rates
        // of their own) leave less room than its aim, it holds what fits,
        // when that is at least a lease of a lifetime: refused, its caller
        // would lease a lifetime at a time, each lease a wait at a thin
        // pair, until their renewals. A bucket less than half full (excess
        // demand) grants no allowance at all (`bucket_far_below`).
        let units = bucket_allowance(target, mean, reservable, sole);
        let units = if units > room && room >= a_lease { room } else { units };
        let own = if ahead || sole { 0 } else { units };
        (
            units,
            bucket_far_below(units, counted_now.saturating_add(own), policy.capacity(), reservable, sole),
            reservable,
        )
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
    Some(Allotment {
        granted: units,
        decision,
        window: first,
        windows,
        starts_at,
        valid,
        near_limit: false,
        bucket,
        checked: false,
    })
}

/// A lease ahead: tokens of the window starting at `next.starts` (within a
/// lease lifetime), booked now in that window's budget (the `booking`
/// rule: what the bucket admits at that start, and for a sliding window
/// what the current window's counts leave there). Sized as any lease to
/// the caller's rate over the time they may be used, a lease lifetime from
/// the window's start and never past its end; at most half of what that
/// window has left, and nothing once it is below the low-water mark
/// ([`ahead_cap`]: its tail is handed out in it, paced).
fn ahead(
    limit: &KeyLimit<'_>,
    mut bucket: ServiceBucket,
    now: Nanos,
    (wanted, rate): (u64, Option<f64>),
    ttl: Nanos,
    next: &Ahead,
) -> Allotment {
    let policy = limit.policy;
    let usable = ttl.min(next.window.end - next.starts);
    let leader = leads(limit, &bucket, rate, now);
    // Sized at the low end of the caller's rate where the key ran short
    // lately in windows as short as their leases (see `of_window`).
    let short_window = limit.window() <= ttl.times(2);
    let rate = if short_window && bucket.ran_short_lately(limit, now) && !leader { rate.map(low_rate) } else { rate };
    let target = lease_target(wanted, rate, usable, policy.capacity());
    // Half of what the window has left, its tail paced in it; all of it to
    // the key's leader (see `of_window`).
    let cap = if leader { next.room } else { ahead_cap(next.room, policy.capacity()) };
    let mut granted = target.min(cap);
    // Booked beside what allowances reserve there, which the booking leaves out.
    let held = bucket.next_held(policy, now);
    let reserved = held.map_or(0, |h| h.units).saturating_sub(bucket.booking.map_or(0, |b| b.units));
    let booked = match booking::book(policy, &bucket.state, held, next, granted) {
        Some(after) if granted > 0 => after,
        _ => {
            granted = 0;
            held.unwrap_or(Booking { starts: next.starts, units: reserved })
        }
    };
    let units = booked.units.saturating_sub(reserved);
    bucket.booking = (units > 0).then_some(Booking { units, ..booked });
    // What the next window has left, and when it frees more, as seen from its start.
    let mut settled = bucket.state.clone();
    let pending = booking::settle(policy, &mut settled, Some(booked), next.starts);
    let then = booking::decide(policy, &mut settled, pending, next.starts, 0);
    let decision = Decision::admit(then.remaining, (next.starts - now) + then.reset);
    let (starts_at, valid) = (next.starts, (next.starts - now) + usable);
    let window = next.window.index;
    Allotment { granted, decision, window, windows: 0, starts_at, valid, near_limit: false, bucket, checked: false }
}

/// A lease as its record keeps it, for [`give_back`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Granted {
    /// Tokens granted (per window, for an allowance).
    pub granted: u64,
    /// When they count as taken (when granted; for a lease ahead, when its
    /// window starts, and until then a return takes them off the booking).
    pub granted_at: Nanos,
    /// The window they count in ([`Allotment::window`]).
    pub window: u64,
    /// [`Allotment::windows`]: 0 for a lease of one window, else an
    /// allowance of `granted` tokens in each of this many windows from
    /// `window` on.
    pub windows: u64,
}

/// Gives back up to `tokens` of the lease `lease` to `bucket`, at most what
/// it granted, as the core's `Release::Return` of that part of the grant:
/// each algorithm decides where the units may go (a fixed window only into
/// the window they came from, a token bucket never beyond full nor more
/// than the lease has not earned again, a sliding log drops the entries the
/// lease logged…). Returns the units the bucket has available again at once
/// because of it, and the bucket after it (`None`: nothing to write).
pub fn give_back(
    limit: &KeyLimit<'_>,
    mut bucket: ServiceBucket,
    lease: &Granted,
    now: Nanos,
    tokens: u64,
) -> (u64, Option<ServiceBucket>) {
    let grant = Grant { cost: tokens.min(lease.granted), at: lease.granted_at };
    if lease.windows > 0 {
        return give_back_allowance(limit, bucket, lease, now, grant.cost);
    }
    if now < grant.at {
        // A lease ahead whose window has not started: its units come off
        // the booking, and that window has them again.
        let (booking, back) = booking::unbook(bucket.booking, grant.at, grant.cost);
        if back == 0 {
            return (0, None);
        }
        bucket.booking = booking;
        return (back, Some(bucket));
    }
    let before = bucket.peek(limit, now).remaining;
    let why = Release::Return { granted: lease.granted };
    if grant.cost == 0 || !limit.policy.release(&mut bucket.state, now, grant, why) {
        return (0, None);
    }
    let back = remaining_as_stored(limit, &bucket, now).saturating_sub(before);
    (back, Some(bucket))
}

/// Gives back an allowance: before its first window starts, its units come
/// off every window it reserved (`returned` is the units per window taken
/// off); while one of its windows counts, that window gets back `tokens`
/// (its unused part of this window's units, as any lease's return) and the
/// windows after it are no longer reserved; after its last window, nothing.
fn give_back_allowance(
    limit: &KeyLimit<'_>,
    mut bucket: ServiceBucket,
    lease: &Granted,
    now: Nanos,
    tokens: u64,
) -> (u64, Option<ServiceBucket>) {
    let policy = limit.policy;
    let last = lease.window.saturating_add(lease.windows - 1);
    let Some(counted) = policy.allowance_slot(&bucket.state, now).filter(|c| c.index <= last) else {
        return (0, None);
    };
    let before = bucket.peek(limit, now).remaining;
    let started = lease.granted_at <= now;
    if started && tokens > 0 {
        let grant = Grant { cost: tokens, at: now };
        policy.release(&mut bucket.state, now, grant, Release::Return { granted: lease.granted });
    }
    if let Some((terms, held)) = bucket.allowances.as_mut() {
        held.release(terms, counted.index, last, lease.granted);
    }
    let back = match started {
        true => remaining_as_stored(limit, &bucket, now).saturating_sub(before),
        false => lease.granted,
    };
    (back, Some(bucket))
}

/// What `bucket` has left at `now` as a store reads it back: loading
/// settles bookings and reservations whose time has come, as the next
/// caller will see them.
fn remaining_as_stored(limit: &KeyLimit<'_>, bucket: &ServiceBucket, now: Nanos) -> u64 {
    let (bytes, _) = bucket.encode(limit, now);
    ServiceBucket::load(limit, Some(&bytes), now).peek(limit, now).remaining
}
