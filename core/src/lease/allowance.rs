//! Allowances: one lease of a fixed window's tokens for many windows (or
//! of a token or leaky bucket's, for many one-period slots).
//!
//! A lease of one window ends with that window, so under per-second windows
//! every (key, proxy) pair would need a lease a second. An *allowance* is
//! `units` tokens in **each** window of a span instead: the proxy spends up to
//! `units` in every window of the span without asking again, and asks once
//! per span. The service books the allowance in every one of those windows'
//! budgets, so everything granted and checked in a window still never
//! exceeds its limit, whatever the number of proxies.
//!
//! **Terms.** A key's windows are grouped into *terms* of
//! [`Terms::windows`] windows (a term lasts [`DEFAULT_TERM`], at least one
//! window), and every allowance ends with a term: a renewal is the next
//! term's allowance, asked for in the last window of the current one. So a
//! bucket keeps its reservations as two numbers, the units reserved in each
//! remaining window of the current term and in each window of the next
//! ([`Reservations`]), and a return takes a lease's units off the terms it
//! still covers. Each key's terms start at a phase of its own (a hash of its
//! bucket key), so the fleet's renewals of many keys spread over the term
//! instead of all coming in one window.
//!
//! **Far below the limit only.** Reservations may take at most
//! [`RESERVED_SHARE`] of the limit in any window; a key whose demand comes
//! nearer gets leases of one window, which follow demand window by window
//! (long lifetimes while a key is far below its limit, short ones as the
//! fleet nears it). Algorithms whose window renews (a fixed window) take
//! allowances by window: a sliding window's counts weigh on the windows
//! after, and it takes none.
//!
//! **Buckets.** A token or leaky bucket names slots of one period
//! (`Algorithm::allowance_slot`); an allowance of it is a share of its rate:
//! its units in each slot are counted at the slot's start (owed when the
//! bucket lacks them) and spent within the slot. Their reservations are
//! bounded by [`bucket_reservable`], which keeps the fleet within the bound
//! of the bucket's leases; the key's sole user may hold all of that
//! ([`bucket_allowance`]).

use crate::algorithm::Policy;
use crate::hash::SipHasher;
use crate::time::Nanos;

/// How long an allowance's term lasts: long enough that a key far below its
/// limit costs a lease every half minute, short enough that an allowance
/// sized to an old rate is not held for long.
pub const DEFAULT_TERM: Nanos = Nanos::from_secs(30);

/// The most of a window's limit that allowances may reserve, as a fraction
/// (numerator, denominator): the rest is left to leases of one window and to
/// checks, so a proxy whose burst outgrows its allowance can still get more.
/// An allowance is granted only while the window that counts now has used
/// no more than this share either: a key whose fleet-wide demand comes near
/// its limit gets no new allowance.
pub const RESERVED_SHARE: (u64, u64) = (3, 4);

/// At a fixed window's key that ran short lately (its tail handed out in
/// this window or the one before), the fewest units a window a caller
/// must spend on average to be given an allowance of a term: `ln 5`,
/// below which steady random arrivals leave a window without a request
/// (its allowance's unit unspent) more than one time in five. A caller
/// below it leases window by window instead; one at or above it gets an
/// allowance sized to the low end of its mean ([`low_count`], a unit at
/// least), not above it.
pub const MIN_MEAN_WHEN_SHORT: f64 = 1.609_437_912_434_100_3;

/// The largest part of the limit one allowance may hold: one proxy's share
/// of a key far below its limit is small; a proxy that needs more is better
/// served by leases of one window, which follow its demand. The key's main
/// user is the exception ([`main_user`]).
pub const ALLOWANCE_SHARE_DIVISOR: u64 = 4;

/// The share of a key's pace (numerator, denominator) a caller must bring
/// to be its main user ([`main_user`]): more than any other caller can
/// bring beside it.
pub const MAIN_USER_SHARE: (u64, u64) = (2, 3);

/// Whether a caller spending `mean` units a window is the main user of a
/// fixed window's key: its mean vouches for at least one unit a window at
/// its low end ([`low_count`]: not the rate one request shows over the
/// second it is averaged over), and it brings at least
/// [`MAIN_USER_SHARE`] of what the window that counts now is paced to use
/// beyond the allowances it began with (`unreserved`, see [`paced_use`]: a
/// renewing holder's own allowance covers its own pace). Behind a
/// key-affine balancer (ring hash, Maglev) each key busy enough has one;
/// behind a uniform one, a key has none once more than one proxy sees it.
pub fn main_user(mean: f64, unreserved: u64) -> bool {
    let (part, whole) = MAIN_USER_SHARE;
    low_count(mean) >= 1.0 && mean * whole as f64 >= unreserved as f64 * part as f64
}

/// The most one allowance of a fixed window's key of `limit` holds per
/// window (and one caller's allowances of it together): a quarter of the
/// limit ([`ALLOWANCE_SHARE_DIVISOR`]); for the key's [`main_user`], what
/// the key's allowances may reserve together ([`share_of`]), since no other
/// proxy needs the rest.
pub fn one_share(limit: u64, main: bool) -> u64 {
    match main {
        true => share_of(limit),
        false => limit / ALLOWANCE_SHARE_DIVISOR,
    }
}

/// The units a window an allowance aimed at `target` holds for a caller
/// spending `mean` units a window at a fixed window's key of `limit`: the
/// target; or for the key's sole user (`sole`: its [`main_user`], whose
/// rate the window's pace [`vouches`] for, with no other caller's
/// allowance beside it) whose target is past the main user's share
/// ([`one_share`]) while that share still covers its mean, that share. Its
/// windows that need more lease the rest (one window each) from what the
/// allowances leave: fewer leases than one in every window.
pub fn main_allowance(target: u64, mean: f64, limit: u64, sole: bool) -> u64 {
    let share = one_share(limit, true);
    match sole && target > share && share as f64 >= mean.ceil() {
        true => share,
        false => target,
    }
}

/// Whether a fixed window's key vouches for a caller spending `mean` units
/// a window: the low end of that mean ([`low_count`]) within `paced`, what
/// the window is paced to use ([`paced_use`]). A rate of one request seen
/// over a second, scaled to a long window, is not vouched for.
pub fn vouches(paced: u64, mean: f64) -> bool {
    low_count(mean) <= paced as f64
}

/// Whether an allowance of `units` per window fits a key of `limit` of
/// which `used` is counted in the window that counts now, with the
/// allowance: at most [`one_share`] of the limit (`main`: asked by the
/// key's [`main_user`]), and the window within [`RESERVED_SHARE`] of it.
pub fn far_below(units: u64, used: u64, limit: u64, main: bool) -> bool {
    units <= one_share(limit, main) && used <= share_of(limit)
}

/// The low end of the mean that a count of `n` steady random arrivals could
/// come from, `(√n − 1)²` (about two standard deviations below `n`; 0 for
/// one arrival or none): what a short observation vouches for.
pub fn low_count(n: f64) -> f64 {
    (n.max(0.0).sqrt() - 1.0).max(0.0).powi(2)
}

/// The part of a window, as a divisor of its length, that must have passed
/// before an allowance may start in it ([`paced_use`] judges the key by
/// it): a window's first moments say nothing of its key's demand, and an
/// allowance holds its units in every window of a term. A window of a
/// large limit says enough sooner: see [`PACE_SEEN_UNITS`].
pub const PACE_SEEN_DIVISOR: u64 = 4;

/// Or the time in which a pace of the whole limit counts this many units
/// (whose low end, `(√16 − 1)² = 9`, is well above nothing).
pub const PACE_SEEN_UNITS: u64 = 16;

/// Whether `elapsed` of a fixed window of `limit` per `period` tells its
/// key's pace well enough to judge an allowance by it (see
/// [`PACE_SEEN_DIVISOR`], [`PACE_SEEN_UNITS`]).
pub fn pace_seen(elapsed: Nanos, limit: u64, period: Nanos) -> bool {
    let quarter = u128::from(elapsed.get()) * u128::from(PACE_SEEN_DIVISOR) >= u128::from(period.get());
    let units = u128::from(elapsed.get()) * u128::from(limit) >= u128::from(PACE_SEEN_UNITS) * u128::from(period.get());
    quarter || units
}

/// What a fixed window of length `period` will have used by its end at the
/// pace seen over its first `elapsed`: the `reserved` units it was counted
/// at its start (the allowances' reservations, spent by their holders over
/// it; in a window as long as a term, also the allowances granted in it,
/// each sized to the window's rest) and the rest of its count,
/// `used - reserved` (leases of one window, checks, allowances granted in
/// a shorter window: every one a sign of demand), projected to the whole
/// window. The rest is taken at the low end of what
/// steady random arrivals would give ([`low_count`]), so
/// a few requests early in a window are not a flood. A key whose
/// fleet-wide demand is near or over its limit paces near or over it long
/// before its count is, so it gets no allowance that would strand
/// reservations.
pub fn paced_use(used: u64, reserved: u64, elapsed: Nanos, period: Nanos) -> u64 {
    let low = low_count(used.saturating_sub(reserved) as f64);
    // `as` saturates: an absurd pace is just "a lot".
    let projected = (low * period.get() as f64 / elapsed.get().max(1) as f64) as u64;
    reserved.min(used).saturating_add(projected).max(used)
}

/// [`RESERVED_SHARE`] of `limit`: the most a fixed window's allowances
/// reserve in one window together.
pub fn share_of(limit: u64) -> u64 {
    u64::try_from(u128::from(limit) * u128::from(RESERVED_SHARE.0) / u128::from(RESERVED_SHARE.1)).unwrap_or(u64::MAX)
}

/// The most a token or leaky bucket's allowances hold in one slot (one period)
/// together: half of the least of its burst (`capacity`) and what it earns
/// in a lease lifetime (`earned`, at most a period's `limit`). The bucket
/// counts each slot's units at the slot's start, owing what it lacks, and
/// its holders spend them within the slot; so over any span `T` the fleet
/// admits at most `burst + rate × (T + lease lifetime)`, the bound of a
/// token bucket's leases (README, "Global mode"): the bucket's own bound,
/// plus the units of the slot in progress when the span starts and the
/// debt at its end, each at most this.
pub fn bucket_reservable(capacity: u64, earned: u64) -> u64 {
    capacity.min(earned) / 2
}

/// What a token or leaky bucket of `limit` per `period` earns in a lease
/// lifetime `ttl` (at most a period's `limit`): the `earned` of
/// [`bucket_reservable`].
pub fn bucket_earned(limit: u64, period: Nanos, ttl: Nanos) -> u64 {
    let earned = u128::from(limit) * u128::from(ttl.min(period).get()) / u128::from(period.get().max(1));
    u64::try_from(earned).unwrap_or(u64::MAX)
}

/// The units a slot an allowance aimed at `target` holds at a token or
/// leaky bucket of `reservable` (see [`bucket_reservable`]) for a caller
/// spending `mean` units a slot: the target; or for the key's sole user
/// (`sole`: no other caller's allowance in the slots it would cover, and
/// a mean whose low end ([`low_count`]) is a unit a slot or more) whose
/// target is past all of `reservable` while that still covers its mean,
/// all of it. Its slots that need more lease the rest (one lifetime each).
pub fn bucket_allowance(target: u64, mean: f64, reservable: u64, sole: bool) -> u64 {
    match sole && target > reservable && reservable as f64 >= mean.ceil() {
        true => reservable,
        false => target,
    }
}

/// Whether an allowance of `units` a slot fits a token bucket of which
/// `used` is taken now, under `reservable` (see [`bucket_reservable`]): at
/// most half of it (all of it for the key's sole user, `sole`, as
/// [`bucket_allowance`] judges it: no other caller needs the rest), and
/// the bucket at least half full.
pub fn bucket_far_below(units: u64, used: u64, capacity: u64, reservable: u64, sole: bool) -> bool {
    let share = if sole { reservable } else { reservable / 2 };
    units <= share && used.saturating_mul(2) <= capacity
}

/// How a key's fixed windows group into terms (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Terms {
    windows: u64,
    phase: u64,
}

impl Terms {
    /// The terms of the key whose bucket is `key`, for windows of `window`
    /// and terms of about `term` (at least one window).
    pub fn new(window: Nanos, term: Nanos, key: &str) -> Self {
        let windows = (term / window).max(1);
        // A fixed key: every instance of the service must find the same phase.
        let mut hasher = SipHasher::new(0x616c_6c6f_7761_6e63, 0x6520_7465_726d_7321);
        hasher.write(key.as_bytes());
        Terms { windows, phase: hasher.finish() % windows }
    }

    /// Terms as stored: `windows` windows each, starting at `phase`
    /// (both as [`Terms::windows`] and [`Terms::phase`] gave them).
    pub fn from_parts(windows: u64, phase: u64) -> Self {
        let windows = windows.max(1);
        Terms { windows, phase: phase % windows }
    }

    /// Windows in a term.
    pub fn windows(&self) -> u64 {
        self.windows
    }

    /// Where the key's terms start: window `w` is the `(w + phase) % windows`th
    /// of its term.
    pub fn phase(&self) -> u64 {
        self.phase
    }

    /// The term of window `window`.
    pub fn of(&self, window: u64) -> u64 {
        window.saturating_add(self.phase) / self.windows
    }

    /// The last window of term `term`.
    pub fn last(&self, term: u64) -> u64 {
        term.saturating_add(1).saturating_mul(self.windows).saturating_sub(1).saturating_sub(self.phase)
    }

    /// The windows an allowance starting with window `first` covers, first
    /// and last: to the end of its term, or, when less than half a term is
    /// left there, to the end of the next one (so no allowance is short).
    pub fn span(&self, first: u64) -> (u64, u64) {
        let end = self.last(self.of(first));
        let left = end.saturating_sub(first).saturating_add(1);
        if left.saturating_mul(2) < self.windows {
            (first, end.saturating_add(self.windows))
        } else {
            (first, end)
        }
    }
}

/// The units allowances hold in a bucket's windows: per window of the
/// current term from the window after `settled` on, and per window of the
/// next term. A window's count starts at its reservation
/// ([`Reservations::settle`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reservations {
    /// The term `current` is of.
    pub term: u64,
    /// Units reserved in each window of that term not yet settled.
    pub current: u64,
    /// Units reserved in each window of the term after it.
    pub next: u64,
    /// The last window whose count includes its reservation (or that an
    /// allowance was counted in directly, when granted in it).
    pub settled: u64,
    /// What window `settled` was counted at its start: the reservations it
    /// began with (not what allowances granted in it since counted; see
    /// [`paced_use`]).
    pub at_start: u64,
}

impl Reservations {
    /// Nothing is reserved.
    pub fn is_empty(&self) -> bool {
        self.current == 0 && self.next == 0
    }

    /// As of term `term`: the reservations of terms that ended are gone. A
    /// term before `self.term` (a clock that stepped back) changes nothing.
    fn rolled(self, term: u64) -> Self {
        match term.checked_sub(self.term) {
            None | Some(0) => self,
            Some(1) => Reservations { term, current: self.next, next: 0, ..self },
            Some(_) => Reservations { term, current: 0, next: 0, ..self },
        }
    }

    /// Units reserved in window `window` (of the current or the next term).
    pub fn reserved(&self, terms: &Terms, window: u64) -> u64 {
        match terms.of(window).checked_sub(self.term) {
            Some(0) => self.current,
            Some(1) => self.next,
            _ => 0,
        }
    }

    /// The reservations as of `now`, after counting into `state` the
    /// reservation of every slot that has started since the last one
    /// counted, at its start (a fixed window keeps only the last: its
    /// counts end with each window; a token bucket owes them all, and has
    /// earned back what it could since). Call it before anything else on a
    /// bucket read from storage; algorithms without allowance slots keep no
    /// reservations.
    pub fn settle(self, policy: &dyn Policy, terms: &Terms, state: &mut [u8], now: Nanos) -> Self {
        let (Some(slot), Some(length)) = (policy.allowance_slot(state, now), policy.quota().window) else {
            return Reservations::default();
        };
        // Reservations cover this term and the next: slots before the last
        // two terms hold none.
        let first = self.settled.saturating_add(1).max(slot.index.saturating_sub(terms.windows().saturating_mul(2)));
        let mut at_start = if first > slot.index { self.at_start } else { 0 };
        for index in first..=slot.index {
            let units = self.reserved(terms, index);
            at_start = units;
            if units > 0 {
                // Even over a limit a reload has lowered since: these units
                // were granted, and spent or to be spent in their slot.
                let starts = slot.end - length.times(slot.index - index + 1);
                policy.count(state, starts, units);
            }
        }
        let mut after = self.rolled(terms.of(slot.index));
        after.settled = after.settled.max(slot.index);
        after.at_start = at_start;
        after
    }

    /// What window `window` was counted at its start (see
    /// [`Reservations::at_start`]).
    pub fn counted_at_start(&self, window: u64) -> u64 {
        if self.settled == window {
            self.at_start
        } else {
            0
        }
    }

    /// The most units per window a new allowance over windows `first` to
    /// `last` may reserve when allowances may hold `reservable` in each
    /// window together ([`share_of`] the limit for a fixed window,
    /// [`bucket_reservable`] for a token bucket), with the reservations
    /// settled as of now.
    pub fn room(&self, terms: &Terms, first: u64, last: u64, reservable: u64) -> u64 {
        (terms.of(first)..=terms.of(last)).map(|term| reservable.saturating_sub(self.of_term(term))).min().unwrap_or(0)
    }

    fn of_term(&self, term: u64) -> u64 {
        match term.checked_sub(self.term) {
            Some(0) => self.current,
            Some(1) => self.next,
            _ => 0,
        }
    }

    /// The reservations as of window `window`: those of terms that ended
    /// are gone (a window before the current term changes nothing).
    pub fn as_of(self, terms: &Terms, window: u64) -> Self {
        self.rolled(terms.of(window))
    }

    /// Reserves `units` in each window of `first` to `last` after
    /// `now_window` (the window that counts now: an allowance starting there
    /// is counted in it directly, by the algorithm's decision).
    pub fn reserve(&mut self, terms: &Terms, now_window: u64, first: u64, last: u64, units: u64) {
        *self = self.rolled(terms.of(now_window));
        self.settled = self.settled.max(now_window);
        for term in terms.of(first)..=terms.of(last) {
            match term.checked_sub(self.term) {
                Some(0) => self.current = self.current.saturating_add(units),
                Some(1) => self.next = self.next.saturating_add(units),
                _ => {}
            }
        }
    }

    /// Takes `units` per window of an allowance ending with window `last`
    /// off every window after `now_window` (those it still covers).
    pub fn release(&mut self, terms: &Terms, now_window: u64, last: u64, units: u64) {
        *self = self.rolled(terms.of(now_window));
        let from = now_window.saturating_add(1);
        if from > last {
            return;
        }
        for term in terms.of(from)..=terms.of(last) {
            match term.checked_sub(self.term) {
                Some(0) => self.current = self.current.saturating_sub(units),
                Some(1) => self.next = self.next.saturating_sub(units),
                _ => {}
            }
        }
    }

    /// The last window any reservation covers (`None`: none): the bucket
    /// must be kept until it ends.
    pub fn last_window(&self, terms: &Terms) -> Option<u64> {
        if self.next > 0 {
            Some(terms.last(self.term.saturating_add(1)))
        } else if self.current > 0 {
            Some(terms.last(self.term))
        } else {
            None
        }
    }
}

/// Units a `window` at `rate` tokens a second holds on average (none
/// without a rate).
pub fn mean_per(rate: Option<f64>, window: Nanos) -> f64 {
    rate.filter(|rate| rate.is_finite() && *rate > 0.0).map_or(0.0, |rate| window.events_at(rate))
}

/// Tokens per window an allowance aims for when its holder spends `rate`
/// tokens a second and windows last `window`: the mean per window, `λ`, with
/// room for its ups and downs (`λ + 2√λ + 1`, rounded up: under steady
/// random arrivals a window needs more one time in a few hundred or fewer,
/// and then asks for a lease of that window), at least 1 and at most
/// `capacity`.
pub fn allowance_target(rate: Option<f64>, window: Nanos, capacity: u64) -> u64 {
    let mean = mean_per(rate, window);
    // `as` saturates, so an absurd rate is just "a lot".
    let aim = (mean + 2.0 * mean.sqrt() + 1.0).ceil() as u64;
    aim.clamp(1, capacity.max(1))
}

#[cfg(test)]
mod tests {
    use super::super::testing::{fresh, policy};
    use super::*;
    use crate::time::SECOND;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const T0: Nanos = Nanos::from_secs(1_700_000_000);

    #[test]
    fn terms_group_windows_from_a_phase_of_the_keys_own() {
        let terms = Terms::new(SECOND, DEFAULT_TERM, "fg:{edge}:fw:[[\"user\",\"alice\"]]");
        assert_eq!(terms.windows(), 30);
        let first = 1_700_000_000;
        let term = terms.of(first);
        let last = terms.last(term);
        assert_eq!(terms.of(last), term);
        assert_eq!(terms.of(last + 1), term + 1);
        assert_eq!(terms.last(term + 1), last + 30);
        // Phases differ between keys, so renewals spread over the term.
        let phases: std::collections::HashSet<u64> =
            (0..100).map(|i| Terms::new(SECOND, DEFAULT_TERM, &format!("key{i}")).last(term) % 30).collect();
        assert!(phases.len() > 10, "{phases:?}");
        // A window longer than the term: a term is one window.
        let minute = Terms::new(SECOND.times(60), DEFAULT_TERM, "k");
        assert_eq!((minute.windows(), minute.span(77)), (1, (77, 77)));
    }

    #[test]
    fn an_allowance_spans_to_its_terms_end_and_is_never_short() {
        let terms = Terms::new(SECOND, DEFAULT_TERM, "k");
        let term = terms.of(1_700_000_000);
        let start = terms.last(term - 1) + 1;
        assert_eq!(terms.span(start), (start, start + 29), "a whole term");
        assert_eq!(terms.span(start + 15), (start + 15, start + 29), "half a term left: to its end");
        assert_eq!(terms.span(start + 16), (start + 16, start + 59), "less: through the next term too");
    }

    #[test]
    fn a_windows_count_starts_at_its_reservation() {
        let window = policy("fixed_window", 10, r#"{"period": "1s"}"#);
        let terms = Terms::new(SECOND, DEFAULT_TERM, "k");
        let now = T0;
        let index = T0 / SECOND;
        let mut state = fresh(window.as_ref(), now);
        let mut held = Reservations::default().settle(window.as_ref(), &terms, &mut state, now);
        let (first, last) = terms.span(index);
        // Granted now: counted in this window by the decision, reserved after it.
        assert!(window.decide(&mut state, now, 3).allowed());
        held.reserve(&terms, index, first, last, 3);
        assert_eq!(held.reserved(&terms, index + 1), 3);
        // The same window settles once.
        let again = held.settle(window.as_ref(), &terms, &mut state, now);
        assert_eq!(window.decide(&mut state.clone(), now, 0).remaining, 7);
        // Every later window of the span starts at 3 counted.
        let mut later = again;
        for step in 1..=(last - index) {
            let at = now + SECOND.times(step);
            later = later.settle(window.as_ref(), &terms, &mut state, at);
            assert_eq!(window.decide(&mut state.clone(), at, 0).remaining, 7, "window {step}");
        }
        // After the span: nothing reserved.
        let after = now + SECOND.times(last - index + 1);
        later = later.settle(window.as_ref(), &terms, &mut state, after);
        assert_eq!(window.decide(&mut state.clone(), after, 0).remaining, 10);
        assert!(later.is_empty());
    }

    #[test]
    fn a_release_frees_the_windows_after_now_and_no_others() {
        let terms = Terms::new(SECOND, DEFAULT_TERM, "k");
        let index = T0 / SECOND;
        let term_end = terms.last(terms.of(index));
        let mut held = Reservations::default();
        // One allowance through the next term, one ahead of it only.
        held.reserve(&terms, index, index, term_end + 30, 4);
        held.reserve(&terms, index, term_end + 1, term_end + 30, 2);
        assert_eq!((held.current, held.next), (4, 6));
        assert_eq!(held.room(&terms, index, term_end + 30, share_of(10)), 1, "3/4 of 10 is 7; the next term holds 6");
        held.release(&terms, index, term_end + 30, 4);
        assert_eq!((held.current, held.next), (0, 2));
        // Released in the last window of the term: only the next term had it.
        let mut held = Reservations::default();
        held.reserve(&terms, index, term_end + 1, term_end + 30, 2);
        held.release(&terms, term_end, term_end + 30, 2);
        assert!(held.is_empty());
        // An allowance that ended frees nothing.
        let mut held = Reservations { term: terms.of(index), current: 5, next: 0, settled: index, at_start: 5 };
        held.release(&terms, index, index, 5);
        assert_eq!(held.current, 5);
    }

    #[test]
    fn an_allowance_is_a_small_share_of_a_key_far_below_its_limit() {
        assert!(far_below(25, 40, 100, false));
        assert!(!far_below(26, 40, 100, false), "more than a quarter");
        assert!(far_below(25, 75, 100, false));
        assert!(!far_below(25, 76, 100, false), "the window is near its limit");
        assert!(!far_below(1, 0, 3, false), "a limit under 4 takes none");
        // The key's main user: up to what all allowances may reserve.
        assert!(far_below(40, 75, 100, true));
        assert!(far_below(75, 75, 100, true));
        assert!(!far_below(76, 75, 100, true), "more than three quarters");
        assert!(!far_below(40, 76, 100, true), "the window is near its limit");
        assert!(far_below(2, 2, 3, true), "a small limit's one user");
    }

    #[test]
    fn a_sole_users_allowance_past_its_share_is_clipped_to_it_when_that_covers_its_mean() {
        // 9 a second against 20: aims at 16, three quarters of 20 is 15.
        assert_eq!(main_allowance(16, 9.0, 20, true), 15);
        assert_eq!(main_allowance(16, 9.0, 20, false), 16, "not the key's sole user: as aimed (and refused)");
        assert_eq!(main_allowance(14, 9.0, 20, true), 14, "within the share: as aimed");
        // 16 a second against 20: the share would not cover the mean.
        assert_eq!(main_allowance(25, 16.0, 20, true), 25);
        assert_eq!(main_allowance(25, 15.0, 20, true), 15);
    }

    #[test]
    fn a_buckets_sole_user_may_hold_all_its_allowances_reserve() {
        // 12 a second against a bucket of 30 a second: aims at 20, the
        // allowances may reserve 15 a slot, a quarter of its lifetime's 30
        // for one of several callers.
        assert_eq!(bucket_allowance(20, 12.0, 15, true), 15);
        assert!(bucket_far_below(15, 0, 30, 15, true));
        assert_eq!(bucket_allowance(20, 12.0, 15, false), 20, "not alone: as aimed");
        assert!(!bucket_far_below(20, 0, 30, 15, false));
        assert!(!bucket_far_below(8, 0, 30, 15, false), "more than a quarter");
        assert!(bucket_far_below(7, 0, 30, 15, false));
        assert_eq!(bucket_allowance(25, 16.0, 15, true), 25, "15 would not cover 16 a slot");
        assert!(!bucket_far_below(25, 0, 30, 15, true));
        assert!(!bucket_far_below(15, 16, 30, 15, true), "the bucket less than half full");
    }

    #[test]
    fn a_keys_pace_vouches_for_the_low_end_of_a_callers_mean() {
        assert!(vouches(4, 9.0), "(√9 − 1)² = 4");
        assert!(!vouches(3, 9.0));
        // One request a second, scaled to a minute, against 8 paced.
        assert!(!vouches(8, 60.0));
        assert!(vouches(0, 1.0));
    }

    #[test]
    fn a_main_user_brings_most_of_a_keys_pace() {
        // Key-affine: one proxy's 10 a second are the key's 10 a second.
        assert!(main_user(10.0, 10));
        assert!(main_user(10.0, 15), "two thirds of it");
        // Uniform over three: a third of the pace is not most of it.
        assert!(!main_user(10.0, 30));
        assert!(main_user(4.0, 0), "nothing else paced");
        // One request seen over a second: a rate of 1, whose low end is none.
        assert!(!main_user(1.0, 0));
        assert!(!main_user(3.9, 0));
    }

    #[test]
    fn a_windows_pace_is_seen_after_a_quarter_of_it_or_sixteen_units_of_its_limit() {
        let minute = SECOND.times(60);
        assert!(!pace_seen(SECOND.times(14), 40, minute));
        assert!(pace_seen(SECOND.times(15), 40, minute), "a quarter");
        assert!(!pace_seen(Nanos::from_millis(1_500), 600, minute));
        assert!(pace_seen(Nanos::from_millis(1_600), 600, minute), "16 of 600 a minute");
        assert!(pace_seen(Nanos::from_nanos(1_000), 1_000_000_000, minute));
        assert!(!pace_seen(Nanos::ZERO, u64::MAX, minute));
    }

    #[test]
    fn the_target_covers_the_ups_and_downs_of_a_thin_key() {
        assert_eq!(allowance_target(Some(1.0), SECOND, 100), 4);
        assert_eq!(allowance_target(Some(0.3), SECOND, 100), 3);
        assert_eq!(allowance_target(Some(100.0), SECOND, 1_000), 121);
        assert_eq!(allowance_target(None, SECOND, 100), 1);
        assert_eq!(allowance_target(Some(f64::INFINITY), SECOND, 100), 1);
        assert_eq!(allowance_target(Some(1e30), SECOND, 100), 100);
    }

    #[test]
    fn only_a_window_that_renews_keeps_reservations() {
        let sliding = policy("sliding_window", 10, r#"{"period": "1s"}"#);
        let terms = Terms::new(SECOND, DEFAULT_TERM, "k");
        let mut state = fresh(sliding.as_ref(), T0);
        let held = Reservations { term: 1, current: 3, next: 3, settled: 0, at_start: 0 };
        assert!(held.settle(sliding.as_ref(), &terms, &mut state, T0).is_empty());
    }
}
