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
//! **Leases ahead.** A lease of an algorithm that counts in windows ends with
//! its window (the service names the window, `index`). Before that end, while
//! its tokens last, and when the next window starts within the lease's life
//! (not so a per-minute window's lease of a second), the pool asks for the
//! *next* window's tokens (the claim names that window): the service grants
//! them from the next window's budget, usable from its start (`starts`). Such a
//! grant becomes the pool's lease at once, but counts only from its start; the
//! lease it replaces is held until its own end, which is that start. So at the
//! boundary the pool switches from one window's tokens to the next without
//! asking, and a token is never spent outside the window it was granted for: a
//! lease counts from the answer's arrival plus `starts` (never earlier than the
//! service meant) until its call's departure plus `valid` (never later, however
//! long the answer took). Should the held tokens run out before the next window
//! starts, the pool asks for more of the current window, and those go where the
//! held ones were.
//!
//! **Allowances.** A grant that covers several windows (`windows`, see
//! `crate::lease::allowance`) holds `granted` tokens in each of them: when one
//! window ends the pool moves to the next with a fresh allowance, without
//! asking. Each window's tokens count from the window's start as the answer
//! could have meant it at the latest (its call's departure plus the first
//! window's end, plus the answer's latency and the protocol's rounding) until
//! its end at the earliest, so a token is never spent outside its window. A
//! pool whose window runs dry asks for a lease of that window, which bridges it
//! as held tokens; the allowance goes on. The renewal, the next term's
//! allowance, is claimed from the lease's last half (an allowance of one
//! window's too), but its call leaves only in the allowance's last window
//! ([`Claim::not_before`]): the answer is then a lease ahead of the next
//! window, as above.
//!
//! **Denials.** A grant of nothing denies here until the answer's reset
//! (at least the callout timeout): no call is made meanwhile. A grant that
//! took all the key had (nothing left unleased: a key's leader over its
//! limit) denies so once its tokens are spent, until the answer's reset at
//! most its lease's end (a lease ahead taken while the pool was denied:
//! through its window), when asking again can find more; a pool denied
//! until its lease ends asks as that end nears.
//!
//! **Overshoot.** A pool of a rule with an overshoot budget
//! ([`crate::lease::overshoot`]) that holds no lease admits a request from
//! the budget instead of making it wait ([`Spend::Unleased`]); the claim it
//! makes carries what was so admitted to the service ([`Claim::reported`]),
//! and a grant that says the key is near its limit holds the pool strict.
//!
//! The module by concern: this file (the pool's rules of spending, and its
//! face to the bucket table), `state` (what a pool holds, part by part,
//! and its encoding), `claim` (when a pool asks for more, and how much),
//! `apply` (what an answer does to it).

mod apply;
mod claim;
mod state;

pub use apply::{Applied, GrantedLease, Leftover};
pub use claim::{Claim, MAX_BATCH_DELAY, PLENTY, RENEWAL_ROUND, THIN_HORIZONS};
pub use state::{Allowance, Claims, Held, Lease, PoolState, Quote, RateSeen, STATE_LEN};

use super::overshoot::{Overshoot, Unleased};
use super::refresh::RefreshPolicy;
use crate::algorithm::{Algorithm, Decision, Grant, Quota, Release};
use crate::time::Nanos;

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
        state.usable(now)
    }

    /// The `(lease, tokens)` not spent and not expired at `now` (see
    /// [`PoolState::unspent`]).
    pub fn unspent(&self, state: &PoolState, now: Nanos) -> [(u64, u64); 2] {
        state.unspent(now)
    }

    /// Takes every unspent token out of the pool at `now` (the
    /// configuration goes away): the `(lease, tokens)` to give back (`lease`
    /// 0: none; a return of an allowance, even of no tokens, frees its
    /// later windows too), and the pool
    /// after, which holds nothing and spends no later window of an
    /// allowance.
    pub fn take_unspent(&self, state: PoolState, now: Nanos) -> ([(u64, u64); 2], PoolState) {
        let [held, current] = state.unspent(now);
        let state = state.rolled(now);
        // Lease 0 has no record to give back to (tokens taken as a check).
        let held = if held.1 > 0 && held.0 != 0 { held } else { (0, 0) };
        let allowance = current.0 != 0 && state.windows_left();
        let current = if (current.1 > 0 && current.0 != 0) || allowance { current } else { (0, 0) };
        let unspent = [held, current];
        let mut emptied = state;
        emptied.lease.tokens = 0;
        emptied.held.tokens = 0;
        emptied.allowance.per_window = 0;
        emptied.allowance.final_index = state.lease.window_index;
        (unspent, emptied)
    }

    /// Spends `cost` on the pool and claims a refresh when one is due and
    /// none is in flight. Returns the outcome, the claim if this request made
    /// it, and the state after (write it back if either changed it).
    pub fn spend(&self, state: PoolState, now: Nanos, cost: u64) -> (Spend, Option<Claim>, PoolState) {
        let (spend, mut after) = self.take(state.rolled(now), now, cost);
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
        let idle_since = state.lease.expires_at.max(state.held.until);
        after.rate = self.refresh.revive(state.rate, idle_since, now);
        let (held, current) = (state.held.usable(now), state.lease.counting(now));
        let spend = if held.saturating_add(current) >= cost {
            let from_held = held.min(cost);
            after.held.tokens = state.held.tokens - from_held;
            // Taken from the current lease only if it counts now (then
            // `current` is all of its tokens): a lease ahead keeps its own.
            after.lease.tokens = state.lease.tokens - (cost - from_held).min(current);
            after.rate.spent = after.rate.spent.saturating_add(cost);
            Spend::Taken(self.report(&after, now))
        } else if state.gap(now).is_some_and(|gap| gap >= cost && state.lease.tokens >= cost) {
            after.held.tokens = state.held.tokens - cost;
            after.lease.tokens = state.lease.tokens - cost;
            after.rate.spent = after.rate.spent.saturating_add(cost);
            Spend::Taken(self.report(&after, now))
        } else if now < state.quote.denied_until {
            let report = self.report(&after, now);
            Spend::Denied(Decision::deny(report.remaining, report.reset, state.quote.denied_until - now))
        } else if let Some(budget) = self.unleased(&state, now, cost) {
            after.without_lease = budget;
            after.rate.spent = after.rate.spent.saturating_add(cost);
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
            state.lease.pending(now) || state.held.usable(now) > 0 || (state.lease.id != 0 && now < state.lease_end());
        if holds {
            return None;
        }
        overshoot.admit(state.without_lease, now, cost)
    }

    /// What a response reports: this Envoy's tokens plus what the service
    /// had not leased at the last grant (a fleet-wide upper estimate), and
    /// when it expected more, while the lease counts.
    fn report(&self, state: &PoolState, now: Nanos) -> Decision {
        if state.lease.pending(now) {
            // Before the next window starts: what is held here, until then.
            return Decision::admit(state.held.usable(now), state.lease.starts_at - now);
        }
        if now >= state.lease.expires_at {
            return Decision::admit(state.held.usable(now), Nanos::ZERO);
        }
        Decision::admit(state.usable(now).saturating_add(state.quote.unleased), state.quote.reset_at - now)
    }
}

impl Algorithm for LeasePool {
    type State = PoolState;

    fn state_len(&self) -> usize {
        STATE_LEN
    }

    fn decode(&self, bytes: &[u8]) -> Option<PoolState> {
        PoolState::decode(bytes)
    }

    fn encode(&self, state: &PoolState, out: &mut [u8]) {
        state.encode(out);
    }

    /// The service decides what one request may cost.
    fn capacity(&self) -> u64 {
        crate::bounds::MAX_AMOUNT
    }

    /// Known only from the service's answers (see [`Quote::limit`]).
    fn quota(&self) -> Quota {
        Quota { limit: 0, window: None }
    }

    fn fresh(&self, now: Nanos) -> PoolState {
        PoolState { rate: RateSeen { spent: 0, since: now }, ..PoolState::default() }
    }

    /// Spends without claiming (see [`LeasePool::spend`]); an empty pool
    /// denies with a zero `retry_after`: "ask the service".
    fn decide(&self, state: PoolState, now: Nanos, cost: u64) -> (Decision, PoolState) {
        let state = state.rolled(now);
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
        let state = state.rolled(now);
        if !why.gives_back() || grant.at < state.lease.leased_at {
            return None;
        }
        let spent = state.rate.spent.saturating_sub(grant.cost);
        // Taken before the current lease started counting (a lease ahead),
        // they can only have been held tokens.
        let maybe_current = grant.at >= state.lease.starts_at;
        let maybe_held = state.held.lease != 0 && grant.at < state.held.until;
        let mut after = state;
        after.rate.spent = spent;
        if maybe_held && (!maybe_current || state.held.until <= state.lease.expires_at) {
            after.held.tokens = state.held.tokens.saturating_add(grant.cost);
            return (now < state.held.until).then_some(after);
        }
        after.lease.tokens = state.lease.tokens.saturating_add(grant.cost);
        (maybe_current && now < state.lease.expires_at).then_some(after)
    }

    /// Nothing unspent (now or ahead), nothing in flight, nothing denied,
    /// no overshoot budget in use: losing it loses nothing. (Units admitted
    /// without a lease and not reported yet are not kept for: losing their
    /// report lets no more through than the budget's bound.)
    fn is_idle(&self, state: PoolState, now: Nanos) -> bool {
        let unspent = state.unspent(now).iter().all(|(_, tokens)| *tokens == 0);
        let budget = self.overshoot.is_some_and(|o| o.in_use(&state.without_lease, now));
        let claims = &state.claims;
        unspent
            && !budget
            && now >= claims.refresh_until
            && now >= claims.renewal_until
            && now >= state.quote.denied_until
    }

    /// When the tokens expire and any claim, denial or overshoot budget in
    /// use has run out.
    fn idle_at(&self, state: PoolState, now: Nanos) -> Nanos {
        let tokens_until = if state.lease.tokens > 0 || state.windows_left() { state.lease_end() } else { now };
        let held_until = if state.held.tokens > 0 { state.held.until } else { now };
        let budget_until = self.overshoot.map_or(now, |o| o.in_use_until(&state.without_lease));
        now.max(tokens_until)
            .max(held_until)
            .max(state.claims.refresh_until)
            .max(state.claims.renewal_until)
            .max(state.quote.denied_until)
            .max(budget_until)
    }

    /// Whatever the leases applied to it held: not bounded here.
    fn admitted_bound(&self, _span: Nanos) -> u64 {
        u64::MAX
    }
}

#[cfg(test)]
mod tests;
