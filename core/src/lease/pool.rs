//! A pool of leased tokens: what this Envoy holds of one descriptor's
//! fleet-wide limit, in one entry of the rule's bucket table.
//!
//! A pool holds one lease at a time. Requests spend its tokens; the request
//! that finds the pool due for a refresh claims it (single flight: the claim
//! is written in the same compare-and-swap as the spend, and another worker
//! sees it) and its worker asks the service. The answer replaces the lease.
//! The replaced lease's unspent tokens stay in the pool, *held*, and are
//! spent first, each only until its own lease expires, as many as the pool
//! is expected to spend by then; the rest is handed back to be returned to
//! the service (or counted as expired). So a refresh that comes early, as it
//! should, costs no second call to return what was left. An answer that
//! arrives after a newer lease is in place is not applied: its tokens are
//! returned whole. So the tokens a pool lets through never exceed those of
//! the leases applied to it, nor does a token count past its lease's expiry.
//!
//! **Leases ahead.** A lease of an algorithm that counts in windows ends
//! with its window (the service names the window, `index`). Before that
//! end, while its tokens last, the pool asks for the *next* window's tokens
//! (the claim names that window): the service grants them from the next
//! window's budget, usable from its start (`starts`). Such a grant becomes
//! the pool's lease at once, but counts only from its start; the lease it
//! replaces is held until its own end, which is that start. So at the
//! boundary the pool switches from one window's tokens to the next without
//! asking, and a token is never spent outside the window it was granted
//! for: a lease counts from the answer's arrival plus `starts` (never
//! earlier than the service meant) until its call's departure plus `valid`
//! (never later, however long the answer took). Should the held tokens run
//! out before the next window starts, the pool asks for more of the current
//! window, and those go where the held ones were.
//!
//! **Allowances.** A grant that covers several windows (`windows`, see
//! `crate::lease::allowance`) holds `granted` tokens in each of them: when
//! one window ends the pool moves to the next with a fresh allowance,
//! without asking. Each window's tokens count from the window's start as
//! the answer could have meant it at the latest (its call's departure plus
//! the first window's end, plus the answer's latency and the protocol's
//! rounding) until its end at the earliest, so a token is never spent
//! outside its window. A pool whose window runs dry asks for a lease of
//! that window, which bridges it as held tokens; the allowance goes on. The
//! renewal, the next term's allowance, is claimed from the lease's last
//! half, but its call leaves only in the allowance's last window
//! ([`Claim::not_before`]): the answer is then a lease ahead of the next
//! window, as above.
//!
//! **Overshoot.** A pool of a rule with an overshoot budget
//! ([`crate::lease::overshoot`]) that holds no lease admits a request from
//! the budget instead of making it wait ([`Spend::Unleased`]); the claim it
//! makes carries what was so admitted to the service ([`Claim::reported`]),
//! and a grant that says the key is near its limit holds the pool strict.

use super::allowance::low_count;
use super::overshoot::{Overshoot, Unleased};
use super::refresh::{RefreshPolicy, RATE_FLOOR, THIN_REQUESTS};
use crate::algorithm::{get_u64, put_u64, Algorithm, Decision, Grant, Quota, Release};
use crate::time::{Nanos, SECOND};

/// Bytes of a pool's state.
pub const STATE_LEN: usize = 27 * 8;

/// The protocol's rounding of times: a window's start learnt from a whole
/// number of milliseconds is counted this much later, never earlier.
const ROUNDING: Nanos = Nanos::from_millis(1);

/// The longest an allowance's renewal is held back from the start of the
/// allowance's last window, to share a call with other pools' renewals (one
/// call per worker per round): at most half of that window.
pub const RENEWAL_ROUND: Nanos = Nanos::from_secs(1);

/// One pool: the current lease and what the service said with it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolState {
    /// The current lease's id (0: none yet).
    pub lease: u64,
    /// Its unspent tokens.
    pub tokens: u64,
    /// When it was applied (units taken earlier came from another lease).
    pub leased_at: Nanos,
    /// When its tokens stop counting.
    pub expires_at: Nanos,
    /// A refresh is in flight until this instant (single flight).
    pub refresh_until: Nanos,
    /// An allowance's renewal is claimed (held back, or in flight) until
    /// this instant: apart from `refresh_until`, so that a window that runs
    /// dry meanwhile can still get a lease of its own.
    pub renewal_until: Nanos,
    /// Tokens spent since `rate_since`: the observed rate.
    pub spent: u64,
    /// Start of the rate observation.
    pub rate_since: Nanos,
    /// The service's limit (for `RateLimit-Policy`), as of the last grant.
    pub limit: u64,
    /// The service's window, as of the last grant.
    pub window: Nanos,
    /// What the service had not leased to anyone after the last grant.
    pub unleased: u64,
    /// When the service expected more quota, as of the last grant.
    pub reset_at: Nanos,
    /// The service had nothing to grant: deny here until then, without asking.
    pub denied_until: Nanos,
    /// How long the last refresh took, claim to answer.
    pub latency: Nanos,
    /// The replaced lease whose unspent tokens are still held (0: none).
    pub held_lease: u64,
    /// Its tokens: spent before the current lease's.
    pub held_tokens: u64,
    /// When they stop counting (that lease's expiry).
    pub held_until: Nanos,
    /// When the current lease's tokens start counting: when it was applied,
    /// or for a lease ahead, when the window it is for starts.
    pub starts_at: Nanos,
    /// The window the current lease's tokens count in, as the service names
    /// it (0: an algorithm without windows, or no lease yet).
    pub window_index: u64,
    /// For an allowance, the tokens it holds in each window (0: a lease of
    /// one window, or of one lifetime).
    pub allowance: u64,
    /// For an allowance, how long its windows are.
    pub slice: Nanos,
    /// For an allowance, its last window (`window_index` counts now).
    pub final_index: u64,
    /// For an allowance, how much later than its earliest start each of
    /// its windows surely started: its call's latency (answer's arrival
    /// less the call's departure) and the protocol's rounding.
    pub lag: Nanos,
    /// What the pool admitted without a lease, under the rule's overshoot
    /// budget (all zero without one).
    pub without_lease: Unleased,
}

/// What the service granted for one pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantedLease {
    /// The lease's id (the one the claim asked with).
    pub lease: u64,
    /// Tokens granted (may be 0 when nothing is left).
    pub granted: u64,
    /// Until when they may be used, from the service's decision.
    pub valid: Nanos,
    /// When they start counting, from the answer (zero: at once; a lease
    /// ahead: when the window it is for starts).
    pub starts: Nanos,
    /// The window they count in (0: an algorithm without windows); for an
    /// allowance, its first window.
    pub index: u64,
    /// For an allowance, how many windows from `index` on it holds
    /// `granted` tokens in (0 or 1: the tokens of one window).
    pub windows: u64,
    /// The limit, per `window`.
    pub limit: u64,
    /// The window of the limit.
    pub window: Nanos,
    /// Left unleased for everyone after this grant.
    pub unleased: u64,
    /// Time until more quota becomes available.
    pub reset: Nanos,
    /// The key has used most of its limit: admit nothing of it without a
    /// lease for a while (see [`crate::lease::overshoot`]).
    pub near_limit: bool,
    /// The claim only reported units admitted without a lease and asked
    /// for none (`wanted` 0): its `granted` 0 denies nothing.
    pub report_only: bool,
}

/// A claimed refresh: the worker that made it asks the service.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Claim {
    /// When the claim was made: the answer applies only if no lease newer
    /// than this is in place.
    pub started: Nanos,
    /// Tokens to ask for.
    pub wanted: u64,
    /// The observed rate, tokens per second, to report.
    pub rate: f64,
    /// The window asked for: the next one, ahead of its start; `None` for
    /// the window that counts now.
    pub window: Option<u64>,
    /// The latest instant its call should leave, for the answer to come
    /// before the pool needs it (at twice the latency refreshes have been
    /// taking): `started` when a request waits for it, at most
    /// [`MAX_BATCH_DELAY`] later otherwise. Until then a host may hold it
    /// back, to send it with others in one call.
    pub send_by: Nanos,
    /// The earliest instant its call may leave: `started`, or for an
    /// allowance's renewal, the start of the allowance's last window (its
    /// answer, a lease ahead of the next window, must come in that one).
    pub not_before: Nanos,
    /// Whether to ask for an allowance: once the pool's rate has been
    /// observed for a whole [`RATE_FLOOR`], or its last lease is that old
    /// (a thin key's observation starts afresh after a pause), or it holds
    /// one, to renew: so that a hot key's first requests, which look thin,
    /// do not take allowances it would hold for a term wherever its demand
    /// goes.
    pub per_window: bool,
    /// Units the pool admitted without a lease since its last report, for
    /// the service to count (taken out of the pool with the claim).
    pub reported: u64,
    /// The pool's rule admits keys without a lease (an overshoot budget):
    /// its call asks for the service's near-limit notices.
    pub wants_notices: bool,
}

/// A key whose service had at least this share of its limit left unleased
/// at the pool's last grant has tokens to spare: a pool whose only request
/// spent its lease still claims the next one at once (a new key's second
/// request does not wait). Below it, tokens a cold pair would strand cost
/// other Envoys: under excess demand spread thin, at most a tenth of the
/// limit goes to such second leases.
pub const PLENTY: (u64, u64) = (9, 10);

/// The longest a claim that no request waits for is held back to share a
/// call with others (see [`Claim::send_by`]): a small fraction of any
/// lease's life, and far below any claim's time to live.
pub const MAX_BATCH_DELAY: Nanos = Nanos::from_nanos(20_000_000);

/// How a request fared on a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spend {
    /// The pool had the tokens: admitted.
    Taken(Decision),
    /// The service has nothing left until `retry_after`: denied here.
    Denied(Decision),
    /// No lease here, and the rule's overshoot budget held the cost:
    /// admitted, to be reported to the service.
    Unleased(Decision),
    /// No tokens here now; a refresh is claimed or in flight: ask again.
    Empty,
}

/// Unspent tokens of replaced leases that the pool does not keep.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Leftover {
    /// `(lease, tokens)` to return to the service, at most one per lease
    /// (`lease` 0: nothing; `tokens` 0 only for an allowance, whose later
    /// windows the return frees).
    pub returns: [(u64, u64); 2],
    /// Tokens of leases that had expired and whose window had ended too:
    /// lost, not returnable.
    pub expired: u64,
}

/// What applying an answer did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// The grant is the pool's lease now; what of the replaced leases'
    /// tokens the pool did not keep.
    Replaced(Leftover),
    /// A newer lease was already in place: return the whole grant.
    Stale,
    /// This lease was applied already (a replayed answer): nothing to do.
    Duplicate,
    /// The answer to a report that asked for no tokens
    /// ([`GrantedLease::report_only`]): the pool took note of what it said.
    Reported,
}

/// The pools of one global rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeasePool {
    /// When to refresh and how much to ask for.
    pub refresh: RefreshPolicy,
    /// How long a claim holds before another worker may take it over: a
    /// refresher that crashed or hung is replaced after this.
    pub claim_ttl: Nanos,
    /// The rule's overshoot budget, if it has one (strict without).
    pub overshoot: Option<Overshoot>,
}

impl LeasePool {
    /// Tokens that still count at `now`: the held ones and the current lease's.
    pub fn usable(&self, state: &PoolState, now: Nanos) -> u64 {
        self.held(state, now).saturating_add(self.current(state, now))
    }

    /// The `(lease, tokens)` not spent and not expired at `now`: the held
    /// lease's and the current one's (a lease ahead's too, before its start;
    /// an allowance's in the window that counts).
    pub fn unspent(&self, state: &PoolState, now: Nanos) -> [(u64, u64); 2] {
        let state = self.rolled(*state, now);
        let current = if now < state.expires_at { state.tokens } else { 0 };
        [(state.held_lease, self.held(&state, now)), (state.lease, current)]
    }

    /// Takes every unspent token out of the pool at `now` (the
    /// configuration goes away): the `(lease, tokens)` to give back (`lease`
    /// 0: none; a return of an allowance, even of no tokens, frees its
    /// later windows too), and the pool
    /// after, which holds nothing and spends no later window of an
    /// allowance.
    pub fn take_unspent(&self, state: PoolState, now: Nanos) -> ([(u64, u64); 2], PoolState) {
        let [held, current] = self.unspent(&state, now);
        let state = self.rolled(state, now);
        let held = if held.1 > 0 { held } else { (0, 0) };
        let allowance = current.0 != 0 && self.windows_left(&state);
        let current = if current.1 > 0 || allowance { current } else { (0, 0) };
        let unspent = [held, current];
        let emptied = PoolState { tokens: 0, held_tokens: 0, allowance: 0, final_index: state.window_index, ..state };
        (unspent, emptied)
    }

    /// Whether the current lease is an allowance with windows after the one
    /// that counts.
    fn windows_left(&self, state: &PoolState) -> bool {
        state.allowance > 0 && state.window_index < state.final_index && state.slice > Nanos::ZERO
    }

    /// When the current lease ends: its window's end, or its last window's
    /// for an allowance.
    fn lease_end(&self, state: &PoolState) -> Nanos {
        match self.windows_left(state) {
            true => state.expires_at + state.slice.times(state.final_index - state.window_index),
            false => state.expires_at,
        }
    }

    /// An allowance moved on to the window that counts at `now` (or the
    /// first gap before it): that window's tokens, counted from its start
    /// at the latest (the answer's latency and the protocol's rounding
    /// after the earliest) to its end at the earliest. Anything else as it is.
    fn rolled(&self, state: PoolState, now: Nanos) -> PoolState {
        if !self.windows_left(&state) || now < state.expires_at {
            return state;
        }
        let behind = (now - state.expires_at).get() / state.slice.get().max(1);
        let steps = behind.saturating_add(1).min(state.final_index - state.window_index);
        let earliest_start = state.expires_at + state.slice.times(steps - 1);
        // The window before keeps what it had left, held until its earliest
        // end: usable only in the moment the two windows' spans leave
        // between them, together with the new window's (see `gap`).
        let left = if steps == 1 { state.tokens } else { state.allowance };
        PoolState {
            window_index: state.window_index + steps,
            tokens: state.allowance,
            starts_at: earliest_start + state.lag,
            expires_at: earliest_start + state.slice,
            held_lease: state.lease,
            held_tokens: left,
            held_until: earliest_start,
            ..state
        }
    }

    /// Tokens of the window just before the current lease's usable at `now`
    /// in the moment between that window's earliest end and the current
    /// window's latest start (an answer's latency and the protocol's
    /// rounding), when the pool cannot know which of the two counts: a
    /// request then takes a token of each, so whichever window it falls in
    /// has it counted. Only when the held tokens' window is the one just
    /// before: the moment is shorter than a window.
    fn gap(&self, state: &PoolState, now: Nanos) -> Option<u64> {
        let between = self.pending(state, now) && state.held_lease != 0 && state.held_until <= now;
        (between && state.starts_at - state.held_until < state.window).then_some(state.held_tokens)
    }

    /// Tokens of the current lease that count at `now`.
    fn current(&self, state: &PoolState, now: Nanos) -> u64 {
        if state.starts_at <= now && now < state.expires_at {
            state.tokens
        } else {
            0
        }
    }

    /// Whether the pool's requests come often enough that a lease lifetime
    /// sees at least one even at the low end of what its count seen so far
    /// could come from ([`low_count`], over at least
    /// [`RATE_FLOOR`]): not one request a second or so, whose observed
    /// rate is mostly chance.
    fn busy(&self, state: &PoolState, now: Nanos) -> bool {
        let span = (now - state.rate_since).max(self.refresh.horizon.min(RATE_FLOOR)).max(Nanos::from_nanos(1));
        low_count(state.spent as f64) * self.refresh.horizon.get() as f64 >= span.get() as f64
    }

    /// Whether the current lease is one ahead, waiting for its window to start.
    fn pending(&self, state: &PoolState, now: Nanos) -> bool {
        state.lease != 0 && now < state.starts_at
    }

    /// Held tokens of the replaced lease that still count at `now`.
    fn held(&self, state: &PoolState, now: Nanos) -> u64 {
        if now < state.held_until {
            state.held_tokens
        } else {
            0
        }
    }

    /// Spends `cost` on the pool and claims a refresh when one is due and
    /// none is in flight. Returns the outcome, the claim if this request made
    /// it, and the state after (write it back if either changed it).
    pub fn spend(&self, state: PoolState, now: Nanos, cost: u64) -> (Spend, Option<Claim>, PoolState) {
        let (spend, mut after) = self.take(self.rolled(state, now), now, cost);
        // A request that found the pool short is demand too: counted in
        // the rate the refresh is sized by, so a revived pool asks for more
        // than one token.
        let unmet = if matches!(spend, Spend::Taken(_) | Spend::Unleased(_)) { 0 } else { cost };
        let mut claim = self.claim(&mut after, now, cost, unmet);
        if let Some(claim) = claim.as_mut() {
            claim.reported = std::mem::take(&mut after.without_lease.unreported);
            if matches!(spend, Spend::Unleased(_)) {
                // Nobody waits for it: it may share a call with others.
                claim.send_by = claim.send_by.max(now + MAX_BATCH_DELAY);
                if self.overshoot.is_some_and(|o| o.covers(claim.rate)) {
                    // The budget alone covers the pool's pace (a thin pair):
                    // tokens leased now would likely expire unspent, taken
                    // from the limit all the same. Report only.
                    *claim = Claim { wanted: 0, window: None, per_window: false, ..*claim };
                }
            }
        }
        (spend, claim, after)
    }

    /// Takes `cost` from the pool if it holds that much, the held tokens
    /// first (they expire first).
    fn take(&self, state: PoolState, now: Nanos, cost: u64) -> (Spend, PoolState) {
        let mut after = state;
        let idle_since = state.expires_at.max(state.held_until);
        (after.spent, after.rate_since) = self.refresh.revive(state.spent, state.rate_since, idle_since, now);
        let (held, current) = (self.held(&state, now), self.current(&state, now));
        let spend = if held.saturating_add(current) >= cost {
            let from_held = held.min(cost);
            after.held_tokens = state.held_tokens - from_held;
            // Taken from the current lease only if it counts now (then
            // `current` is all of its tokens): a lease ahead keeps its own.
            after.tokens = state.tokens - (cost - from_held).min(current);
            after.spent = after.spent.saturating_add(cost);
            Spend::Taken(self.report(&after, now))
        } else if self.gap(&state, now).is_some_and(|gap| gap >= cost && state.tokens >= cost) {
            after.held_tokens = state.held_tokens - cost;
            after.tokens = state.tokens - cost;
            after.spent = after.spent.saturating_add(cost);
            Spend::Taken(self.report(&after, now))
        } else if now < state.denied_until {
            let report = self.report(&after, now);
            Spend::Denied(Decision::deny(report.remaining, report.reset, state.denied_until - now))
        } else if let Some(budget) = self.unleased(&state, now, cost) {
            after.without_lease = budget;
            after.spent = after.spent.saturating_add(cost);
            Spend::Unleased(self.report(&after, now))
        } else {
            Spend::Empty
        };
        (spend, after)
    }

    /// The overshoot budget after admitting `cost` without a lease at
    /// `now`, when the rule has one, the pool holds no lease (none yet, or
    /// its last one over; a lease whose tokens ran out still holds the key
    /// strict), and the budget holds the cost.
    fn unleased(&self, state: &PoolState, now: Nanos, cost: u64) -> Option<Unleased> {
        let overshoot = self.overshoot?;
        let holds =
            self.pending(state, now) || self.held(state, now) > 0 || (state.lease != 0 && now < self.lease_end(state));
        if holds {
            return None;
        }
        overshoot.admit(state.without_lease, now, cost)
    }

    /// Claims a refresh into `state` if one is due at `now` and none is in
    /// flight (or the one in flight outlived its claim); `unmet` units of
    /// this request found no tokens.
    fn claim(&self, state: &mut PoolState, now: Nanos, cost: u64, unmet: u64) -> Option<Claim> {
        let renewing = self.windows_left(state) && now >= state.renewal_until;
        if now < state.refresh_until && !renewing {
            return None;
        }
        let rate = self.refresh.rate(state.spent.saturating_add(unmet), state.rate_since, now);
        let first = unmet == 0 && state.spent <= cost && state.without_lease.unreported == 0;
        let plenty = state.unleased.saturating_mul(PLENTY.1) >= state.limit.saturating_mul(PLENTY.0);
        if first && !plenty && self.usable(state, now) == 0 && !self.windows_left(state) {
            // The request that spent the pool's last token is the only one
            // its rate observation has seen (a cold pair's, whose lease it
            // waited for), and the key's tokens are no longer plentiful: a
            // lease now would likely expire unspent, taken from what other
            // Envoys could use (at fleet scale a quarter to a third of a
            // limit under excess demand went so). The next request claims,
            // if one comes.
            return None;
        }
        let (window, needed_at) = self.due(state, now, rate, unmet > 0)?;
        let renewal = window.is_some() && self.windows_left(state);
        if !renewal && now < state.refresh_until {
            return None;
        }
        if window.is_some() && now < state.renewal_until {
            // The allowance's renewal is on its way: in its last window the
            // lease in place no longer tells, so no second ask ahead.
            return None;
        }
        // What the pool holds now is spent first, unless the ask is for the
        // next window, where none of it counts.
        let usable = if window.is_some() { 0 } else { self.usable(state, now) };
        let latest = needed_at - self.refresh.turnaround(state.latency);
        let (not_before, send_by) = match renewal {
            // An allowance's renewal leaves in its last window, within a round.
            true => {
                let last_starts = self.lease_end(state) - state.slice + state.lag;
                let send_by = (last_starts + RENEWAL_ROUND).min(last_starts + (needed_at - last_starts).halved());
                (last_starts.max(now), send_by.max(last_starts).max(now))
            }
            false => (now, latest.clamp(now, now + MAX_BATCH_DELAY)),
        };
        // Taken over only once its call, held back until `send_by`, has had
        // its time.
        match renewal {
            true => state.renewal_until = send_by + self.claim_ttl,
            false => state.refresh_until = now + self.claim_ttl,
        }
        let wanted = self.refresh.wanted(rate, usable).max(cost);
        let known = now - state.rate_since >= RATE_FLOOR || (state.lease != 0 && now - state.leased_at >= RATE_FLOOR);
        let per_window = state.allowance > 0 || known;
        let wants_notices = self.overshoot.is_some();
        Some(Claim { started: now, wanted, rate, window, send_by, not_before, per_window, reported: 0, wants_notices })
    }

    /// Whether a refresh is due at `now` at `rate`, for which window
    /// (`None` for the one that counts now, `Some(w)` for the next one, `w`,
    /// ahead of its start), and when the pool will need its answer: when
    /// what it holds runs out at that rate, or its lease ends.
    fn due(&self, state: &PoolState, now: Nanos, rate: f64, short: bool) -> Option<(Option<u64>, Nanos)> {
        let per_second = |span: Nanos| rate * span.get() as f64 / SECOND.get() as f64;
        // `as` saturates: no rate means the tokens never run out.
        let runs_out =
            |tokens: u64| if tokens == 0 { now } else { now + Nanos::from_nanos((tokens as f64 / rate * 1e9) as u64) };
        let denied = now < state.denied_until;
        if self.pending(state, now) {
            // The next window's lease is in place: only a gap before its
            // start may need tokens of this window, when the held ones run
            // dry longer than a refresh takes before it. Asked for while a
            // refresh or a few requests' time is still held, as any refresh.
            let turnaround = self.refresh.turnaround(state.latency);
            let held = self.held(state, now);
            let dry = held as f64 <= per_second(turnaround.max(RefreshPolicy::few_requests(rate)));
            let dry_at = runs_out(held);
            return (dry && !denied && state.starts_at - dry_at > turnaround).then_some((None, dry_at));
        }
        let start = state.leased_at.max(state.starts_at);
        let usable = self.usable(state, now);
        if self.windows_left(state) {
            // An allowance: the next term's from its last half on. A lease
            // of this window when a request found it short, or when its
            // tokens run out within a refresh's time while more requests
            // are expected before it ends; not when it ends within a
            // refresh's time (the next window's tokens come sooner).
            let end = self.lease_end(state);
            let renewal_due = now - state.leased_at >= (end - state.leased_at).halved();
            if renewal_due && now >= state.renewal_until {
                return Some((Some(state.final_index.saturating_add(1)), end));
            }
            let turnaround = self.refresh.turnaround(state.latency);
            let expected = per_second(state.expires_at - now);
            let runs_dry = usable as f64 + 1.0 <= expected && usable as f64 <= per_second(turnaround);
            let ends_soon = state.expires_at - now <= turnaround;
            return ((short || runs_dry) && !denied && !ends_soon).then_some((None, runs_out(usable)));
        }
        // A lease that ends with its window, and whose tokens last until
        // then (or that got nothing in it): what is needed next is the next
        // window's.
        // Denied (the key's window is spent), only a pool sure to spend
        // it soon asks for the next window's tokens ahead: a thin pair's
        // lease ahead would hold tokens of that window, which the key's
        // demand elsewhere needs, likely past its lifetime unspent.
        let lasts = usable as f64 >= per_second(state.expires_at - now) || (denied && self.busy(state, now));
        let ahead = state.window_index != 0
            && state.lease != 0
            && now < state.expires_at
            && lasts
            && self.refresh.next_due(start, state.expires_at, rate, state.latency, now);
        if ahead {
            return Some((Some(state.window_index.saturating_add(1)), state.expires_at));
        }
        let due = !denied && self.refresh.due(usable, start, state.expires_at, rate, state.latency, now);
        due.then_some((None, runs_out(usable).min(state.expires_at)))
    }

    /// Applies the service's answer to the claim made at `claim_started`,
    /// whose call left at `sent`.
    pub fn apply(
        &self,
        state: PoolState,
        now: Nanos,
        (claim_started, sent): (Nanos, Nanos),
        grant: &GrantedLease,
    ) -> (Applied, PoolState) {
        let mut state = self.rolled(state, now);
        if grant.lease != 0 && (state.lease == grant.lease || state.held_lease == grant.lease) {
            return (Applied::Duplicate, state);
        }
        if grant.near_limit {
            // Strict through the window after the one the answer speaks of.
            let strict_until = now + grant.reset + grant.window;
            state.without_lease.strict_until = state.without_lease.strict_until.max(strict_until);
        }
        if grant.report_only {
            let ours = state.refresh_until == claim_started + self.claim_ttl;
            let refresh_until = if ours { Nanos::ZERO } else { state.refresh_until };
            return (Applied::Reported, PoolState { refresh_until, ..state });
        }
        if state.lease != 0 && state.leased_at > claim_started {
            // A newer lease is in place; this claim is over all the same.
            let ours = state.refresh_until == claim_started + self.claim_ttl;
            let refresh_until = if ours { Nanos::ZERO } else { state.refresh_until };
            return (Applied::Stale, PoolState { refresh_until, ..state });
        }
        // The service's times count from its decision, which came after the
        // call left and before the answer: the tokens start no earlier, and
        // end no later, than it meant.
        let starts_at = now + grant.starts;
        // An allowance's first window ends where its later windows' length
        // before the end of the last one says.
        let windows = grant.windows.max(1);
        let slice = if windows > 1 { grant.window } else { Nanos::ZERO };
        let expires_at = sent + grant.valid.checked_sub(slice.times(windows - 1)).unwrap_or(Nanos::ZERO);
        let (spent, rate_since) = self.refresh.carry(state.spent, state.rate_since, now);
        let latency = now - sent;
        let bridges = self.pending(&state, now) || self.windows_left(&state);
        if starts_at <= now && windows == 1 && bridges {
            return self.bridge(state, now, grant, expires_at, (spent, rate_since, latency));
        }
        if self.windows_left(&state) && starts_at > state.expires_at + state.slice {
            // Not the window after this one (a renewal sent too early): the
            // allowance goes on, and the grant goes back whole.
            return (Applied::Stale, state);
        }
        let (leftover, held) = self.keep(&state, now, starts_at > now);
        let denied_until = if starts_at > now {
            // The current window's denial lasts no longer than its lease:
            // from then on, a request waits the moment until this one starts.
            state.denied_until.min(state.expires_at.max(now))
        } else if grant.granted == 0 {
            now + grant.reset.max(self.refresh.lead)
        } else {
            Nanos::ZERO
        };
        let after = PoolState {
            lease: grant.lease,
            tokens: grant.granted,
            leased_at: now,
            expires_at,
            refresh_until: Nanos::ZERO,
            // A lease ahead answers the renewal; another one leaves a
            // renewal in flight to its answer.
            renewal_until: if starts_at > now { Nanos::ZERO } else { state.renewal_until },
            spent,
            rate_since,
            limit: grant.limit,
            window: grant.window,
            unleased: grant.unleased,
            reset_at: now + grant.reset,
            denied_until,
            latency,
            held_lease: held.0,
            held_tokens: held.1,
            held_until: held.2,
            starts_at,
            window_index: grant.index,
            allowance: if windows > 1 { grant.granted } else { 0 },
            slice,
            final_index: grant.index.saturating_add(windows - 1),
            lag: latency + ROUNDING,
            without_lease: state.without_lease,
        };
        (Applied::Replaced(leftover), after)
    }

    /// Applies a grant of the window that counts now while the next
    /// window's lease waits for its start, or while an allowance has windows
    /// to come: it bridges the gap (or tops this window up), in place of the
    /// held tokens (handed back), and the lease in place stays.
    fn bridge(
        &self,
        state: PoolState,
        now: Nanos,
        grant: &GrantedLease,
        expires_at: Nanos,
        (spent, rate_since, latency): (u64, Nanos, Nanos),
    ) -> (Applied, PoolState) {
        let mut leftover = Leftover::default();
        let held = self.held(&state, now);
        if held > 0 {
            leftover.returns[0] = (state.held_lease, held);
        } else if now >= state.held_until && state.held_lease != state.lease {
            // (What an allowance's window before left is its own: not a
            // lease that expired.)
            leftover.expired = state.held_tokens;
        }
        // Nothing more in this window: denied here until the lease in place
        // counts again (a lease ahead's start, an allowance's next window).
        let next_counts = if self.pending(&state, now) { state.starts_at } else { state.expires_at };
        let denied_until =
            if grant.granted == 0 { (now + grant.reset.max(self.refresh.lead)).min(next_counts) } else { Nanos::ZERO };
        let after = PoolState {
            held_lease: grant.lease,
            held_tokens: grant.granted,
            held_until: expires_at,
            refresh_until: Nanos::ZERO,
            spent,
            rate_since,
            latency,
            denied_until,
            ..state
        };
        (Applied::Replaced(leftover), after)
    }

    /// What of the tokens of `state`'s leases a pool replacing its lease at
    /// `now` keeps, held: the current lease's, as many as the observed rate
    /// spends before that lease expires; the rest, and what was held
    /// already, is handed back. When the new lease is one `ahead`, the held
    /// tokens are all the pool has until that lease starts, so it keeps a
    /// margin against the ups and downs of traffic: twice what the rate
    /// spends, and a thin key's few requests more (with steady random
    /// arrivals, more than that comes one window in a thousand or less).
    /// Returns what is handed back and the held `(lease, tokens, until)`.
    fn keep(&self, state: &PoolState, now: Nanos, ahead: bool) -> (Leftover, (u64, u64, Nanos)) {
        let mut leftover = Leftover::default();
        // Expired tokens still count in their window until it ends: given
        // back then too, the window has them again (a per-minute window's
        // leases of a second would otherwise take from it whatever they did
        // not spend).
        let returnable_until = |until: Nanos| until.max(state.reset_at);
        let mut hand_back = |slot: usize, lease: u64, tokens: u64, until: Nanos| {
            if tokens == 0 {
                return;
            }
            if now >= until {
                leftover.expired = leftover.expired.saturating_add(tokens);
            } else if let Some(entry) = leftover.returns.get_mut(slot) {
                *entry = (lease, tokens);
            }
        };
        if state.held_lease != 0 && state.held_lease != state.lease {
            hand_back(0, state.held_lease, state.held_tokens, returnable_until(state.held_until));
        }
        let mut held = (0, 0, Nanos::ZERO);
        // An allowance replaced before its last window is given back even
        // with no tokens left, so that the service frees its later windows.
        let windows_left = self.windows_left(state);
        if state.lease != 0 && (state.tokens > 0 || windows_left) {
            let rate = self.refresh.rate(state.spent, state.rate_since, now);
            let until = state.expires_at;
            let mut spendable = (rate * (until - now).get() as f64 / SECOND.get() as f64).ceil();
            if ahead {
                spendable = 2.0 * spendable + THIN_REQUESTS;
            }
            // `as` saturates, and NaN becomes 0. Tokens that do not count
            // yet are never held (held tokens are spent at once): a lease
            // ahead being replaced goes back whole.
            let started = state.starts_at <= now;
            let kept = if now < until && started { state.tokens.min(spendable as u64) } else { 0 };
            if windows_left {
                leftover.returns[1] = (state.lease, state.tokens - kept);
            } else {
                hand_back(1, state.lease, state.tokens - kept, returnable_until(until));
            }
            if kept > 0 {
                held = (state.lease, kept, until);
            }
        }
        (leftover, held)
    }

    /// Ends `claim` without an answer (the callout failed), so the next
    /// request may claim again; `None` when the claim is no longer this one.
    /// What it was to report stays to be reported with the next claim.
    pub fn abandon(&self, state: PoolState, claim: &Claim) -> Option<PoolState> {
        let mut after = state;
        after.without_lease.unreported = after.without_lease.unreported.saturating_add(claim.reported);
        if state.renewal_until == claim.send_by + self.claim_ttl {
            after.renewal_until = Nanos::ZERO;
        } else if state.refresh_until == claim.started + self.claim_ttl {
            after.refresh_until = Nanos::ZERO;
        }
        (after != state).then_some(after)
    }

    /// What a response reports: this Envoy's tokens plus what the service
    /// had not leased at the last grant (a fleet-wide upper estimate), and
    /// when it expected more, while the lease counts.
    fn report(&self, state: &PoolState, now: Nanos) -> Decision {
        if self.pending(state, now) {
            // Before the next window starts: what is held here, until then.
            return Decision::admit(self.held(state, now), state.starts_at - now);
        }
        if now >= state.expires_at {
            return Decision::admit(self.held(state, now), Nanos::ZERO);
        }
        Decision::admit(self.usable(state, now).saturating_add(state.unleased), state.reset_at - now)
    }
}

impl Algorithm for LeasePool {
    type State = PoolState;

    fn state_len(&self) -> usize {
        STATE_LEN
    }

    fn decode(&self, bytes: &[u8]) -> Option<PoolState> {
        let word = |i: usize| get_u64(bytes, i * 8);
        Some(PoolState {
            lease: word(0)?,
            tokens: word(1)?,
            leased_at: Nanos::from_nanos(word(2)?),
            expires_at: Nanos::from_nanos(word(3)?),
            refresh_until: Nanos::from_nanos(word(4)?),
            spent: word(5)?,
            rate_since: Nanos::from_nanos(word(6)?),
            limit: word(7)?,
            window: Nanos::from_nanos(word(8)?),
            unleased: word(9)?,
            reset_at: Nanos::from_nanos(word(10)?),
            denied_until: Nanos::from_nanos(word(11)?),
            latency: Nanos::from_nanos(word(12)?),
            held_lease: word(13)?,
            held_tokens: word(14)?,
            held_until: Nanos::from_nanos(word(15)?),
            starts_at: Nanos::from_nanos(word(16)?),
            window_index: word(17)?,
            allowance: word(18)?,
            slice: Nanos::from_nanos(word(19)?),
            final_index: word(20)?,
            lag: Nanos::from_nanos(word(21)?),
            renewal_until: Nanos::from_nanos(word(22)?),
            without_lease: Unleased {
                period_start: Nanos::from_nanos(word(23)?),
                used: word(24)?,
                unreported: word(25)?,
                strict_until: Nanos::from_nanos(word(26)?),
            },
        })
    }

    fn encode(&self, s: &PoolState, out: &mut [u8]) {
        let words = [
            s.lease,
            s.tokens,
            s.leased_at.get(),
            s.expires_at.get(),
            s.refresh_until.get(),
            s.spent,
            s.rate_since.get(),
            s.limit,
            s.window.get(),
            s.unleased,
            s.reset_at.get(),
            s.denied_until.get(),
            s.latency.get(),
            s.held_lease,
            s.held_tokens,
            s.held_until.get(),
            s.starts_at.get(),
            s.window_index,
            s.allowance,
            s.slice.get(),
            s.final_index,
            s.lag.get(),
            s.renewal_until.get(),
            s.without_lease.period_start.get(),
            s.without_lease.used,
            s.without_lease.unreported,
            s.without_lease.strict_until.get(),
        ];
        for (i, word) in words.into_iter().enumerate() {
            put_u64(out, i * 8, word);
        }
    }

    /// The service decides what one request may cost.
    fn capacity(&self) -> u64 {
        crate::bounds::MAX_AMOUNT
    }

    /// Known only from the service's answers (see [`PoolState::limit`]).
    fn quota(&self) -> Quota {
        Quota { limit: 0, window: None }
    }

    fn fresh(&self, now: Nanos) -> PoolState {
        PoolState { rate_since: now, ..PoolState::default() }
    }

    /// Spends without claiming (see [`LeasePool::spend`]); an empty pool
    /// denies with a zero `retry_after`: "ask the service".
    fn decide(&self, state: PoolState, now: Nanos, cost: u64) -> (Decision, PoolState) {
        let state = self.rolled(state, now);
        match self.take(state, now, cost) {
            (Spend::Taken(decision) | Spend::Unleased(decision), after) => (decision, after),
            (Spend::Denied(decision), _) => (decision, state),
            (Spend::Empty, _) => (Decision::deny(0, Nanos::ZERO, Nanos::ZERO), state),
        }
    }

    /// Undo puts tokens back only into a lease that was in place when they
    /// were taken and counts no longer than the one they came from: taken
    /// since the current lease was applied, they came from it or from the
    /// held tokens, so they go back to whichever of the two expires first.
    fn release(&self, state: PoolState, now: Nanos, grant: Grant, why: Release) -> Option<PoolState> {
        let state = self.rolled(state, now);
        if !why.gives_back() || grant.at < state.leased_at {
            return None;
        }
        let spent = state.spent.saturating_sub(grant.cost);
        // Taken before the current lease started counting (a lease ahead),
        // they can only have been held tokens.
        let maybe_current = grant.at >= state.starts_at;
        let maybe_held = state.held_lease != 0 && grant.at < state.held_until;
        if maybe_held && (!maybe_current || state.held_until <= state.expires_at) {
            return (now < state.held_until).then(|| PoolState {
                held_tokens: state.held_tokens.saturating_add(grant.cost),
                spent,
                ..state
            });
        }
        (maybe_current && now < state.expires_at).then(|| PoolState {
            tokens: state.tokens.saturating_add(grant.cost),
            spent,
            ..state
        })
    }

    /// Nothing unspent (now or ahead), nothing in flight, nothing denied,
    /// no overshoot budget in use: losing it loses nothing. (Units admitted
    /// without a lease and not reported yet are not kept for: losing their
    /// report lets no more through than the budget's bound.)
    fn is_idle(&self, state: PoolState, now: Nanos) -> bool {
        let unspent = self.unspent(&state, now).iter().all(|(_, tokens)| *tokens == 0);
        let budget = self.overshoot.is_some_and(|o| o.in_use(&state.without_lease, now));
        unspent && !budget && now >= state.refresh_until && now >= state.renewal_until && now >= state.denied_until
    }

    /// When the tokens expire and any claim, denial or overshoot budget in
    /// use has run out.
    fn idle_at(&self, state: PoolState, now: Nanos) -> Nanos {
        let tokens_until = if state.tokens > 0 || self.windows_left(&state) { self.lease_end(&state) } else { now };
        let held_until = if state.held_tokens > 0 { state.held_until } else { now };
        let budget_until = self.overshoot.map_or(now, |o| o.in_use_until(&state.without_lease));
        now.max(tokens_until)
            .max(held_until)
            .max(state.refresh_until)
            .max(state.renewal_until)
            .max(state.denied_until)
            .max(budget_until)
    }

    /// Whatever the leases applied to it held: not bounded here.
    fn admitted_bound(&self, _span: Nanos) -> u64 {
        u64::MAX
    }
}

#[cfg(test)]
#[path = "pool_tests.rs"]
mod tests;
