//! What the service's answer does to a pool: the grant becomes its lease
//! (the replaced lease's tokens held, as many as the pool will spend before
//! they expire, the rest handed back), bridges a gap before a lease ahead
//! or an allowance's next window, or goes back whole when a newer lease is
//! in place; a claim that got no answer is abandoned.

use super::claim::Claim;
use super::state::{Allowance, Claims, Held, Lease, PoolState, Quote, RateSeen};
use super::LeasePool;
use crate::lease::refresh::THIN_REQUESTS;
use crate::time::Nanos;

/// The protocol's rounding of times: a window's start learnt from a whole
/// number of milliseconds is counted this much later, never earlier.
const ROUNDING: Nanos = Nanos::from_millis(1);

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
    /// `granted` tokens in (1 or more); 0 for a lease of one window.
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
    /// The service decided the claim's tokens as a check ([`Claim::check`]):
    /// no lease was recorded, so what the waiting request does not spend
    /// is not returned.
    pub checked: bool,
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

impl LeasePool {
    /// Applies the service's answer to the claim made at `claim_started`,
    /// whose call left at `sent`.
    pub fn apply(
        &self,
        state: PoolState,
        now: Nanos,
        (claim_started, sent): (Nanos, Nanos),
        grant: &GrantedLease,
    ) -> (Applied, PoolState) {
        let mut state = state.rolled(now);
        if grant.lease != 0 && (state.lease.id == grant.lease || state.held.lease == grant.lease) {
            return (Applied::Duplicate, state);
        }
        if grant.near_limit {
            // Strict through the window after the one the answer speaks of.
            let strict_until = now + grant.reset + grant.window;
            state.without_lease.strict_until = state.without_lease.strict_until.max(strict_until);
        }
        let ours = state.claims.refresh_until == claim_started + self.claim_ttl;
        if grant.report_only {
            if ours {
                state.claims.refresh_until = Nanos::ZERO;
            }
            return (Applied::Reported, state);
        }
        if state.lease.id != 0 && state.lease.leased_at > claim_started {
            // A newer lease is in place; this claim is over all the same.
            if ours {
                state.claims.refresh_until = Nanos::ZERO;
            }
            return (Applied::Stale, state);
        }
        // The service's times count from its decision, which came after the
        // call left and before the answer: the tokens start no earlier, and
        // end no later, than it meant.
        let starts_at = now + grant.starts;
        // An allowance holds `windows` windows (one, as a per-minute
        // window's may: it is renewed as any allowance is), a lease one; an
        // allowance's first window ends where its later windows' length
        // before the end of the last one says.
        let allowance = grant.windows > 0;
        let windows = grant.windows.max(1);
        let slice = if allowance { grant.window } else { Nanos::ZERO };
        let expires_at = sent + grant.valid.checked_sub(slice.times(windows - 1)).unwrap_or(Nanos::ZERO);
        let rate = self.refresh.carry(state.rate, now);
        let latency = now - sent;
        let bridges = state.lease.pending(now) || state.windows_left();
        if starts_at <= now && windows == 1 && bridges {
            return self.bridge(state, now, grant, expires_at, (rate, latency));
        }
        if state.windows_left() && starts_at > state.lease.expires_at + state.allowance.slice {
            // Not the window after this one (a renewal sent too early): the
            // allowance goes on, and the grant goes back whole.
            return (Applied::Stale, state);
        }
        let (leftover, held) = self.keep(&state, now, starts_at > now);
        let denied_until = if starts_at > now {
            if grant.unleased == 0 && grant.granted > 0 && now < state.quote.denied_until {
                // Denied in this window, and all of the next one taken
                // here: denied through it too, once its tokens are spent.
                expires_at
            } else {
                // The current window's denial lasts no longer than its
                // lease: from then on, a request waits the moment until
                // this one starts.
                state.quote.denied_until.min(state.lease.expires_at.max(now))
            }
        } else if grant.granted == 0 {
            now + grant.reset.max(self.refresh.lead)
        } else if grant.unleased == 0 && windows == 1 {
            // It took all the key had: once spent, a call would be refused
            // until the answer's reset (the window's end; a bucket's leader:
            // when the bucket is full again), at most its lease's end.
            (now + grant.reset.max(self.refresh.lead)).min(expires_at)
        } else {
            Nanos::ZERO
        };
        let after = PoolState {
            lease: Lease {
                // Tokens taken as a check have no record to return them to.
                id: if grant.checked { 0 } else { grant.lease },
                tokens: grant.granted,
                leased_at: now,
                starts_at,
                expires_at,
                window_index: grant.index,
            },
            held,
            allowance: Allowance {
                per_window: if allowance { grant.granted } else { 0 },
                slice,
                final_index: grant.index.saturating_add(windows - 1),
                lag: latency + ROUNDING,
            },
            rate,
            quote: Quote {
                limit: grant.limit,
                window: grant.window,
                unleased: grant.unleased,
                reset_at: now + grant.reset,
                denied_until,
            },
            claims: Claims {
                refresh_until: Nanos::ZERO,
                // A lease ahead answers the renewal; another one leaves a
                // renewal in flight to its answer.
                renewal_until: if starts_at > now { Nanos::ZERO } else { state.claims.renewal_until },
                latency,
            },
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
        (rate, latency): (RateSeen, Nanos),
    ) -> (Applied, PoolState) {
        let mut leftover = Leftover::default();
        let held = state.held.usable(now);
        if held > 0 {
            leftover.returns[0] = (state.held.lease, held);
        } else if now >= state.held.until && state.held.lease != state.lease.id {
            // (What an allowance's window before left is its own: not a
            // lease that expired.)
            leftover.expired = state.held.tokens;
        }
        // Nothing more in this window: denied here until the lease in place
        // counts again (a lease ahead's start, an allowance's next window).
        let next_counts = if state.lease.pending(now) { state.lease.starts_at } else { state.lease.expires_at };
        let denied_until =
            if grant.granted == 0 { (now + grant.reset.max(self.refresh.lead)).min(next_counts) } else { Nanos::ZERO };
        let mut after = state;
        after.held = Held { lease: grant.lease, tokens: grant.granted, until: expires_at };
        after.claims.refresh_until = Nanos::ZERO;
        after.claims.latency = latency;
        after.rate = rate;
        after.quote.denied_until = denied_until;
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
    /// Returns what is handed back and what the pool holds then.
    fn keep(&self, state: &PoolState, now: Nanos, ahead: bool) -> (Leftover, Held) {
        let mut leftover = Leftover::default();
        // Expired tokens still count in their window until it ends: given
        // back then too, the window has them again (a per-minute window's
        // leases of a second would otherwise take from it whatever they did
        // not spend).
        let returnable_until = |until: Nanos| until.max(state.quote.reset_at);
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
        let (lease, was_held) = (&state.lease, &state.held);
        if was_held.lease != 0 && was_held.lease != lease.id {
            hand_back(0, was_held.lease, was_held.tokens, returnable_until(was_held.until));
        }
        let mut held = Held::default();
        // An allowance replaced before its last window is given back even
        // with no tokens left, so that the service frees its later windows.
        let windows_left = state.windows_left();
        if lease.id != 0 && (lease.tokens > 0 || windows_left) {
            let rate = self.refresh.rate(state.rate, now);
            let until = lease.expires_at;
            let mut spendable = (until - now).events_at(rate).ceil();
            if ahead {
                spendable = 2.0 * spendable + THIN_REQUESTS;
            }
            // `as` saturates, and NaN becomes 0. Tokens that do not count
            // yet are never held (held tokens are spent at once): a lease
            // ahead being replaced goes back whole.
            let started = lease.starts_at <= now;
            let kept = if now < until && started { lease.tokens.min(spendable as u64) } else { 0 };
            if windows_left {
                leftover.returns[1] = (lease.id, lease.tokens - kept);
            } else {
                hand_back(1, lease.id, lease.tokens - kept, returnable_until(until));
            }
            if kept > 0 {
                held = Held { lease: lease.id, tokens: kept, until };
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
        if state.claims.renewal_until == claim.send_by + self.claim_ttl {
            after.claims.renewal_until = Nanos::ZERO;
        } else if state.claims.refresh_until == claim.started + self.claim_ttl {
            after.claims.refresh_until = Nanos::ZERO;
        }
        (after != state).then_some(after)
    }
}
