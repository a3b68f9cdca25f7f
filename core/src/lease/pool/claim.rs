//! When a pool asks the service for more, for which window, how much, and
//! by when its call must leave: the claim a request makes in the same
//! compare-and-swap as its spend (single flight across workers).

use super::state::PoolState;
use super::LeasePool;
use crate::lease::allowance::low_count;
use crate::lease::refresh::{Life, RateSeen, RefreshPolicy, RATE_FLOOR};
use crate::time::Nanos;

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
    /// A cold pair's wait: the request that made the claim waits at a pool
    /// that holds nothing, and nothing else has been spent since the pool's
    /// rate observation began (a pair that saw no request for a whole
    /// horizon, or a new one) or, at a key [`SHORT`] of tokens, the pool's
    /// count does not vouch for a request every lease lifetime, so a lease
    /// would likely expire unspent. The service decides `wanted` (this
    /// request's cost) as a check: taken or refused, with no lease record
    /// and nothing to return.
    pub check: bool,
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

/// A pool whose last lease (or check) is at least this many lease horizons
/// old when a request waits at it, and has seen no other request since its
/// rate observation began, is a cold pair's: the request is decided as a
/// check ([`Claim::check`]). A pair seen again sooner leases at its pace:
/// at three Envoys, a key of a request a second each is one (its pairs
/// meet again within four seconds all but a few times in a hundred, and
/// their requests' waits stay as they were before checks); at ten Envoys,
/// keys of a request every few seconds are not (a lease record and its
/// return for the one token such a pair spends wrote more than check mode
/// does for the same requests).
pub const THIN_HORIZONS: u64 = 4;

/// A key is short of tokens when the pool's last answer refused it, or left
/// less than this share of its limit unleased (it has used more than the
/// three quarters up to which it may still hold allowances): then a pool
/// whose count does not vouch for a request every lease lifetime is cold
/// too (see [`Claim::check`]), as what its lease held beyond its waiter
/// would be refused to the key's demand at other Envoys.
pub const SHORT: (u64, u64) = (1, 4);

/// The longest an allowance's renewal is held back from the start of the
/// allowance's last window (or from its claim, when that comes later), to
/// share a call with other pools' renewals (one call per worker per round):
/// at most half of the time left until it is needed.
pub const RENEWAL_ROUND: Nanos = Nanos::from_secs(1);

impl LeasePool {
    /// Whether the pool's requests come often enough that a lease lifetime
    /// sees at least one even at the low end of what its count seen so far
    /// could come from ([`low_count`], over at least
    /// [`RATE_FLOOR`]): not one request a second or so, whose observed
    /// rate is mostly chance.
    fn busy(&self, state: &PoolState, now: Nanos) -> bool {
        let span = (now - state.rate.since).max(self.refresh.horizon.min(RATE_FLOOR)).max(Nanos::ONE);
        low_count(state.rate.spent as f64) * self.refresh.horizon.get() as f64 >= span.get() as f64
    }

    /// Claims a refresh into `state` if one is due at `now` and none is in
    /// flight (or the one in flight outlived its claim); `unmet` units of
    /// this request found no tokens.
    pub(super) fn claim(&self, state: &mut PoolState, now: Nanos, cost: u64, unmet: u64) -> Option<Claim> {
        let renewing = state.renewable() && now >= state.claims.renewal_until;
        if now < state.claims.refresh_until && !renewing {
            return None;
        }
        let seen = state.rate;
        let rate = self.refresh.rate(RateSeen { spent: seen.spent.saturating_add(unmet), ..seen }, now);
        let first = unmet == 0 && seen.spent <= cost && state.without_lease.unreported == 0;
        let quote = &state.quote;
        let plenty = quote.unleased.saturating_mul(PLENTY.1) >= quote.limit.saturating_mul(PLENTY.0);
        let short = quote.unleased.saturating_mul(SHORT.1) < quote.limit.saturating_mul(SHORT.0)
            || quote.denied_until > Nanos::ZERO;
        if first && (!plenty || state.lease.checked()) && state.usable(now) == 0 && !state.windows_left() {
            // The request that spent the pool's last token is the only one
            // its rate observation has seen (a cold pair's, whose lease or
            // check it waited for), and the key's tokens are no longer
            // plentiful, or its pool was cold enough to be checked: a lease
            // now would likely expire unspent, taken from what other
            // Envoys could use (at fleet scale a quarter to a third of a
            // limit under excess demand went so). The next request claims,
            // if one comes.
            return None;
        }
        let unreported = state.without_lease.unreported > 0;
        let allowance = state.windows_left() || state.renewable();
        if unmet == 0 && !unreported && !allowance && short && !self.busy(state, now) {
            // Nobody waits, the key is short of tokens, and the pool's count
            // does not vouch for a request every lease lifetime: a lease now
            // would likely expire unspent while the key's demand at other
            // Envoys is refused (under excess demand behind a uniform
            // balancer, per-second keys used 84–87 % of what their windows'
            // arrivals could, 86–88 % without such leases). Its next
            // request, if one comes, waits for a check.
            return None;
        }
        let (window, needed_at) = self.due(state, now, rate, unmet > 0)?;
        let renewal = window.is_some() && state.renewable();
        if !renewal && now < state.claims.refresh_until {
            return None;
        }
        if window.is_some() && now < state.claims.renewal_until {
            // The allowance's renewal is on its way: in its last window the
            // lease in place no longer tells, so no second ask ahead.
            return None;
        }
        // What the pool holds now is spent first, unless the ask is for the
        // next window, where none of it counts.
        let usable = if window.is_some() { 0 } else { state.usable(now) };
        let latest = needed_at - self.refresh.turnaround(state.claims.latency);
        let (not_before, send_by) = match renewal {
            // An allowance's renewal leaves in its last window, within a
            // round of its start or of the claim, if that comes later (an
            // allowance of one window is in its last from the start).
            true => {
                let last_starts = state.lease_end() - state.allowance.slice + state.allowance.lag;
                let from = last_starts.max(now);
                (from, (from + RENEWAL_ROUND).min(from + (needed_at - from).halved()))
            }
            false => (now, latest.clamp(now, now + MAX_BATCH_DELAY)),
        };
        // Taken over only once its call, held back until `send_by`, has had
        // its time.
        match renewal {
            true => state.claims.renewal_until = send_by + self.claim_ttl,
            false => state.claims.refresh_until = now + self.claim_ttl,
        }
        let lease = &state.lease;
        let wants_notices = self.overshoot.is_some();
        // A cold pair: only the request that waits has come since the
        // observation began, and the pool's last lease (or check) is a
        // while ago or never was: its requests come less than about once in
        // THIN_HORIZONS lease lifetimes. At a key SHORT of tokens, any pair
        // whose count does not vouch for a request in every lease lifetime
        // (`busy`): what its lease held beyond its waiter would sit unspent
        // where the key's demand at other Envoys is refused (under excess
        // demand spread over a thousand Envoys, a tenth to a quarter of
        // per-second limits went so). Asking for the pool's pace would
        // lease tokens that expire unspent (and cost a record and a
        // return); asking for an allowance would reserve them in every
        // window of a term.
        let long_ago =
            lease.leased_at == Nanos::ZERO || now - lease.leased_at >= self.refresh.horizon.times(THIN_HORIZONS);
        let thin = if short { !self.busy(state, now) } else { seen.spent == 0 && long_ago };
        let cold = unmet > 0 && thin && usable == 0 && window.is_none() && !lease.pending(now);
        // A cold pair asks for the waiting request's cost alone, as a check;
        // any other claim leases at its pace.
        let check = cold && !state.windows_left();
        let (wanted, per_window) = if check {
            (cost, false)
        } else {
            // A check counts as a lease here: the pair has been seen that long.
            let known = now - seen.since >= RATE_FLOOR
                || (lease.leased_at > Nanos::ZERO && now - lease.leased_at >= RATE_FLOOR);
            (self.refresh.wanted(rate, usable).max(cost), state.allowance.per_window > 0 || known)
        };
        Some(Claim {
            started: now,
            wanted,
            rate,
            window,
            send_by,
            not_before,
            per_window,
            reported: 0,
            wants_notices,
            check,
        })
    }

    /// Whether a refresh is due at `now` at `rate`, for which window
    /// (`None` for the one that counts now, `Some(w)` for the next one, `w`,
    /// ahead of its start), and when the pool will need its answer: when
    /// what it holds runs out at that rate, or its lease ends.
    fn due(&self, state: &PoolState, now: Nanos, rate: f64, short: bool) -> Option<(Option<u64>, Nanos)> {
        let per_second = |span: Nanos| span.events_at(rate);
        // `as` saturates: no rate means the tokens never run out.
        let runs_out = |tokens: u64| if tokens == 0 { now } else { now + Nanos::from_secs_f64(tokens as f64 / rate) };
        let (lease, latency) = (&state.lease, state.claims.latency);
        let start = lease.leased_at.max(lease.starts_at);
        let life = Life { from: start, until: lease.expires_at };
        // A pool denied until its lease ends because that lease took all a
        // key without windows had (a bucket's leader) asks as that end
        // nears, as any pool whose lease expires soon: its next lease then
        // comes as the bucket is full again, none of it lost at the brim.
        let refilling = lease.window_index == 0
            && state.quote.denied_until == lease.expires_at
            && self.refresh.expires_soon(life, rate, latency, now);
        let denied = now < state.quote.denied_until && !refilling;
        if lease.pending(now) {
            // The next window's lease is in place: only a gap before its
            // start may need tokens of this window, when the held ones run
            // dry longer than a refresh takes before it. Asked for while a
            // refresh or a few requests' time is still held, as any refresh.
            let turnaround = self.refresh.turnaround(latency);
            let held = state.held.usable(now);
            let dry = held as f64 <= per_second(turnaround.max(RefreshPolicy::few_requests(rate)));
            let dry_at = runs_out(held);
            return (dry && !denied && lease.starts_at - dry_at > turnaround).then_some((None, dry_at));
        }
        let usable = state.usable(now);
        // An allowance: the next term's from its last half on (for one of
        // a single window too: asked only as its window ends, as a lease
        // ahead is, a thin pair's renewal would often find no request to
        // ask it in time).
        let end = state.lease_end();
        let renewal_due = now - lease.leased_at >= (end - lease.leased_at).halved();
        if state.renewable() && renewal_due && now >= state.claims.renewal_until {
            return Some((Some(state.allowance.final_index.saturating_add(1)), end));
        }
        if state.windows_left() {
            // A lease of this window when a request found it short, or when
            // its tokens run out within a refresh's time while more
            // requests are expected before it ends; not when the next
            // window's tokens come sooner. A waiting request has those from
            // the next window's latest start, `lag` after this one's
            // earliest end: an allowance granted by a slow call (150 ms
            // once in the end-to-end long tail) leaves that long a gap
            // between its windows, which a request that found this window
            // spent would otherwise wait out past `max_wait`. A pool that
            // only runs dry has nothing to bridge until then.
            let turnaround = self.refresh.turnaround(latency);
            let expected = per_second(lease.expires_at - now);
            let runs_dry = usable as f64 + 1.0 <= expected && usable as f64 <= per_second(turnaround);
            let next_tokens = if short { lease.expires_at + state.allowance.lag } else { lease.expires_at };
            let next_sooner = next_tokens - now <= turnaround;
            return ((short || runs_dry) && !denied && !next_sooner).then_some((None, runs_out(usable)));
        }
        // A lease that ends with its window, and whose tokens last until
        // then (or that got nothing in it): what is needed next is the next
        // window's.
        // Denied (the key's window is spent), only a pool sure to spend
        // it soon asks for the next window's tokens ahead: a thin pair's
        // lease ahead would hold tokens of that window, which the key's
        // demand elsewhere needs, likely past its lifetime unspent.
        let lasts = usable as f64 >= per_second(lease.expires_at - now) || (denied && self.busy(state, now));
        // The next window starts within this lease's life: a lease of a
        // window that outlasts its leases (a per-minute window's lease of
        // a second) ends long before it, and is followed by another lease
        // of the same window, not by a lease ahead sized to a second's rate
        // that would hold the next window's tokens from now on. (Windows
        // are aligned on the epoch: window `i` ends at `(i + 1) × window`.
        // An index that puts that end more than a window away counts
        // something shorter, a sliding window's sub-window, whose leases
        // end with it as before.)
        let to_next = state.quote.window.times(lease.window_index.saturating_add(1)) - now;
        let ends_with_window = to_next > state.quote.window || to_next <= lease.expires_at - start;
        let ahead = lease.window_index != 0
            && lease.id != 0
            && now < lease.expires_at
            && lasts
            && ends_with_window
            && self.refresh.next_due(life, rate, latency, now);
        if ahead {
            return Some((Some(lease.window_index.saturating_add(1)), lease.expires_at));
        }
        let due = !denied && self.refresh.due(usable, life, rate, latency, now);
        due.then_some((None, runs_out(usable).min(lease.expires_at)))
    }
}
