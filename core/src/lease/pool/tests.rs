//! The tests of the pool (a child module of `pool/mod.rs`, in a file of its own so
//! that the module's code reads without them).

use super::*;
use crate::time::SECOND;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

const T0: Nanos = Nanos::from_secs(1_700_000_000);
const MS: Nanos = Nanos::from_nanos(1_000_000);

/// `state` after `change`.
fn with(mut state: PoolState, change: impl FnOnce(&mut PoolState)) -> PoolState {
    change(&mut state);
    state
}

/// A claim made at `at` whose call left at once.
fn sent(at: Nanos) -> (Nanos, Nanos) {
    (at, at)
}

fn pool() -> LeasePool {
    LeasePool {
        refresh: RefreshPolicy { lead: MS.times(300), horizon: SECOND },
        claim_ttl: MS.times(600),
        overshoot: None,
    }
}

fn grant(lease: u64, granted: u64) -> GrantedLease {
    GrantedLease {
        lease,
        granted,
        valid: SECOND,
        starts: Nanos::ZERO,
        index: 0,
        windows: 0,
        limit: 1000,
        window: SECOND.times(60),
        unleased: 500,
        reset: SECOND.times(30),
        near_limit: false,
        report_only: false,
        checked: false,
    }
}

/// A pool holding a fresh lease of `tokens`, applied at `T0`.
fn leased(tokens: u64) -> PoolState {
    let p = pool();
    let (_, claim, claimed) = p.spend(p.fresh(T0), T0, 1);
    let (applied, state) = p.apply(claimed, T0, sent(claim.unwrap().started), &grant(1, tokens));
    assert_eq!(applied, Applied::Replaced(Leftover::default()));
    state
}

/// The per-second window starting at `T0`, as the service numbers it.
const K: u64 = 1_700_000_000;

/// A grant of window `index` (a per-second fixed window) made at `at`:
/// valid until that window ends, and for a window after `at`'s, starting
/// with it.
fn windowed_grant(lease: u64, granted: u64, index: u64, at: Nanos) -> GrantedLease {
    let (start, end) = (SECOND.times(index), SECOND.times(index + 1));
    let grant = grant(lease, granted);
    GrantedLease { valid: end - at, starts: start - at, index, window: SECOND, reset: end - at, ..grant }
}

/// A pool that spent 100/s over the last second and holds a lease of
/// `tokens` of window `K`, claimed and answered at `at`.
fn windowed(tokens: u64, at: Nanos) -> PoolState {
    let p = pool();
    let claimed = with(p.fresh(at), |s| {
        s.rate.spent = 100;
        s.rate.since = at - SECOND;
        s.claims.refresh_until = at + MS;
    });
    let (_, state) = p.apply(claimed, at, sent(at), &windowed_grant(1, tokens, K, at));
    state
}

/// Spends `windowed(100, T0)` at 100/s until it claims a refresh: the
/// claim and the state then.
fn until_claimed() -> (Claim, PoolState) {
    let p = pool();
    let mut state = windowed(100, T0);
    let mut now = T0;
    loop {
        now += MS.times(10);
        let (spend, claim, after) = p.spend(state, now, 1);
        assert!(matches!(spend, Spend::Taken(_)), "at {now}");
        state = after;
        if let Some(claim) = claim {
            return (claim, state);
        }
    }
}

#[test]
fn a_lease_that_ends_with_its_window_asks_for_the_next_one_before_the_end() {
    let (claim, _) = until_claimed();
    let now = claim.started;
    // The callout timeout before the window ends (300 ms, within the
    // last half of the lease's life).
    assert_eq!(now, T0 + MS.times(700));
    assert_eq!(claim.window, Some(K + 1), "the next window, by the index the service gave");
    // A whole horizon at the observed rate: none of what is held now counts then.
    assert_eq!(claim.wanted, 100);
    // Needed in 300 ms: it may wait to share a call with others.
    assert_eq!(claim.send_by, now + MAX_BATCH_DELAY);
}

#[test]
fn the_ahead_claim_comes_early_enough_for_the_observed_refresh_latency() {
    let p = pool();
    // Refreshes have been taking 400 ms: the last quarter (250 ms) is too late.
    let state = with(windowed(100, T0), |s| s.claims.latency = MS.times(400));
    let (_, early, _) = p.spend(state, T0 + MS.times(199), 1);
    assert_eq!(early, None);
    let (_, claim, _) = p.spend(state, T0 + MS.times(200), 1);
    assert_eq!(claim.unwrap().window, Some(K + 1), "800 ms ahead: twice the latency");
}

#[test]
fn at_the_boundary_the_pool_switches_to_the_next_windows_lease_without_waiting() {
    let p = pool();
    let (claim, claimed) = until_claimed();
    let at = claim.started;
    // The service grants 100 of the next window, 5 ms later.
    let answered = at + MS.times(5);
    let grant = windowed_grant(2, 100, K + 1, at + MS.times(2));
    let (applied, mut state) = p.apply(claimed, answered, sent(claim.started), &grant);
    assert_eq!(applied, Applied::Replaced(Leftover::default()), "what is left of this window is kept");
    assert_eq!((state.held.lease, state.held.tokens, state.held.until), (1, 30, T0 + SECOND));
    // It counts from the window's start as the answer saw it: the 3 ms
    // it took after the service decided are not the next window's.
    assert_eq!((state.lease.id, state.lease.tokens, state.lease.starts_at), (2, 100, T0 + SECOND + MS.times(3)));
    // Before the boundary only this window's tokens count; the next
    // window's never do, even once these run out.
    assert_eq!(p.usable(&state, T0 + SECOND - Nanos::from_nanos(1)), 30);
    let (mut now, mut taken) = (answered, 0);
    while now < T0 + SECOND {
        let (spend, claim, after) = p.spend(state, now, 1);
        assert_eq!(claim, None, "no refresh while the next window's lease waits");
        taken += u64::from(matches!(spend, Spend::Taken(_)));
        state = after;
        now += MS.times(10);
    }
    assert_eq!((taken, state.lease.tokens), (30, 100), "30 of this window's, none of the next's");
    // At the boundary: the next window's tokens, as soon as they surely count.
    let (spend, claim, _) = p.spend(state, T0 + SECOND, 1);
    assert_eq!((spend, claim), (Spend::Empty, None), "no refresh for those 3 ms: the request waits");
    let (spend, claim, after) = p.spend(state, T0 + SECOND + MS.times(3), 1);
    assert!(matches!(spend, Spend::Taken(_)));
    assert_eq!((claim, after.lease.tokens, after.held.tokens), (None, 99, 0));
    assert_eq!(p.usable(&after, T0 + SECOND + MS.times(3)), 99, "the old window's leftovers count no longer");
    // And the next window's tokens end with it.
    assert_eq!(p.usable(&after, T0 + SECOND.times(2)), 0);
}

#[test]
fn a_lease_counts_from_the_answer_plus_its_start_until_its_call_plus_its_validity() {
    let p = pool();
    let (_, claim, claimed) = p.spend(p.fresh(T0), T0 + MS.times(900), 1);
    let claim = claim.unwrap();
    // The call left 10 ms after the claim, the service decided 30 ms
    // later, and the answer took 60 ms more.
    let (left, decided) = (claim.started + MS.times(10), T0 + MS.times(940));
    let grant = windowed_grant(1, 10, K + 1, decided);
    let (_, state) = p.apply(claimed, decided + MS.times(60), (claim.started, left), &grant);
    // The service meant [T0 + 1 s, T0 + 2 s): the pool's view lies inside it.
    assert_eq!(state.lease.starts_at, T0 + SECOND + MS.times(60));
    assert_eq!(state.lease.expires_at, T0 + SECOND.times(2) - MS.times(30));
    assert_eq!(state.claims.latency, MS.times(90), "what the call took, not the claim");
}

#[test]
fn a_pool_denied_for_the_rest_of_its_window_asks_ahead_and_is_served_at_the_boundary() {
    let p = pool();
    let at = T0 + MS.times(300);
    let (_, claim, claimed) = p.spend(
        with(p.fresh(at), |s| {
            s.rate.spent = 100;
            s.rate.since = at - SECOND;
        }),
        at,
        1,
    );
    // The window is used up: nothing, until it ends.
    let (_, state) = p.apply(claimed, at, sent(claim.unwrap().started), &windowed_grant(1, 0, K, at));
    let (spend, claim, _) = p.spend(state, T0 + MS.times(650), 1);
    assert!(matches!(spend, Spend::Denied(_)));
    assert_eq!(claim, None, "denied, and not yet near the end");
    // The callout timeout before the window ends.
    let near = T0 + MS.times(700);
    let (spend, claim, claimed) = p.spend(state, near, 1);
    let Spend::Denied(denied) = spend else { panic!("{spend:?}") };
    assert_eq!(denied.retry_after(), MS.times(300));
    assert_eq!(claim.unwrap().window, Some(K + 1));
    // The answer arrives 1 ms after the service decided: the lease
    // counts from 1 ms after the window's start.
    let (_, state) = p.apply(claimed, near + MS, sent(near), &windowed_grant(2, 50, K + 1, near));
    assert!(
        matches!(p.spend(state, T0 + SECOND - Nanos::from_nanos(1), 1).0, Spend::Denied(_)),
        "still this window's denial"
    );
    // Past the denied window's end a request waits that moment, not denied.
    assert_eq!(p.spend(state, T0 + SECOND, 1).0, Spend::Empty);
    assert!(matches!(p.spend(state, T0 + SECOND + MS, 1).0, Spend::Taken(_)), "served at once");
}

#[test]
fn a_thin_pool_denied_for_the_rest_of_its_window_does_not_ask_ahead() {
    let p = pool();
    // Its one request, the one that asked: a second's rate of 1, mostly chance.
    let at = T0 + MS.times(300);
    let (_, claim, claimed) = p.spend(p.fresh(at), at, 1);
    let (_, state) = p.apply(claimed, at, sent(claim.unwrap().started), &windowed_grant(1, 0, K, at));
    // Where a busy pool asks for the next window's tokens (see above), it
    // does not: a lease ahead would hold them, likely past its lifetime
    // unspent, from the key's demand elsewhere. Its next request in the
    // next window asks then.
    let near = T0 + MS.times(700);
    let (spend, claim, _) = p.spend(state, near, 1);
    assert!(matches!(spend, Spend::Denied(_)));
    assert_eq!(claim, None);
    assert_eq!(p.spend(state, T0 + SECOND + MS, 1).1.map(|c| c.window), Some(None), "asked in the next window");
}

#[test]
fn held_tokens_that_run_dry_well_before_the_next_window_are_bridged_with_this_windows() {
    let p = pool();
    let (claim, claimed) = until_claimed();
    let ahead = windowed_grant(2, 100, K + 1, claim.started);
    let (_, state) = p.apply(claimed, claim.started, sent(claim.started), &ahead);
    // A burst spends the held tokens 200 ms before the next window: a
    // refresh of this window is due, not of the next.
    let (spend, claim, claimed) = p.spend(with(state, |s| s.held.tokens = 0), T0 + MS.times(800), 1);
    assert_eq!(spend, Spend::Empty);
    let claim = claim.unwrap();
    assert_eq!((claim.window, claim.send_by), (None, claim.started), "nothing held: sent at once");
    let now = T0 + MS.times(805);
    let (applied, after) = p.apply(claimed, now, sent(claim.started), &windowed_grant(3, 40, K, claim.started));
    assert_eq!(applied, Applied::Replaced(Leftover::default()));
    assert_eq!((after.held.lease, after.held.tokens, after.held.until), (3, 40, T0 + SECOND));
    assert_eq!(
        (after.lease.id, after.lease.tokens, after.lease.starts_at),
        (2, 100, T0 + SECOND),
        "the lease ahead stays"
    );
    assert_eq!(p.usable(&after, now), 40);
    // Just before the next window starts, an empty pool waits for it instead.
    let (spend, claim, _) = p.spend(with(after, |s| s.held.tokens = 0), T0 + SECOND - MS.times(5), 1);
    assert_eq!((spend, claim), (Spend::Empty, None));
}

#[test]
fn a_lease_ahead_given_back_before_its_start_goes_back_whole() {
    let p = pool();
    let at = T0 + MS.times(800);
    let (_, claim, claimed) = p.spend(windowed(100, T0), at, 1);
    let (applied, state) = p.apply(claimed, at, sent(claim.unwrap().started), &windowed_grant(2, 70, K + 1, at));
    // 101 spent in 1.8 s: 12 spent in the 200 ms left; twice that and 3
    // more kept, the other 72 returned.
    assert_eq!(applied, Applied::Replaced(Leftover { returns: [(0, 0), (1, 72)], expired: 0 }));
    assert_eq!(p.unspent(&state, at), [(1, 27), (2, 70)], "a configuration going away returns both");
    assert!(!p.is_idle(state, T0 + SECOND - Nanos::from_nanos(1)), "tokens ahead are not nothing");
    // An undo of a unit taken before the next window started goes back
    // to the held tokens it came from, never to the lease ahead.
    let (_, _, spent) = p.spend(state, at + MS, 1);
    let back = p.release(spent, at + MS, Grant { cost: 1, at: at + MS }, Release::Undo).unwrap();
    assert_eq!((back.held.tokens, back.lease.tokens), (27, 70));
    assert_eq!(p.release(spent, T0 + SECOND, Grant { cost: 1, at: at + MS }, Release::Undo), None);
}

#[test]
fn an_empty_pool_claims_one_refresh_and_a_second_worker_waits() {
    let p = pool();
    let (spend, claim, state) = p.spend(p.fresh(T0), T0, 1);
    assert_eq!(spend, Spend::Empty);
    let claim = claim.unwrap();
    assert_eq!(claim.started, T0);
    assert_eq!(claim.send_by, T0, "a request waits for it: sent at once");
    assert_eq!(state.claims.refresh_until, T0 + MS.times(600));
    // Another worker, 1 ms later, sees the claim: it waits, no second callout.
    let (spend, second, _) = p.spend(state, T0 + MS, 1);
    assert_eq!((spend, second), (Spend::Empty, None));
}

/// A cold pair's request that waited for a lease of one token spends
/// it and claims no second lease while the key's tokens are not
/// plentiful: one request is no evidence of another (a lease claimed
/// then would usually expire unspent, taken from the limit all the
/// same). A second request claims, and one of a pool that has seen
/// more, or of a key with tokens to spare, claims at once.
#[test]
fn the_only_request_a_pool_has_seen_claims_no_second_lease() {
    let p = pool();
    let (_, claim, state) = p.spend(p.fresh(T0), T0, 1);
    let (_, state) = p.apply(state, T0 + MS, sent(claim.unwrap().started), &grant(1, 1));
    let (spend, again, state) = p.spend(state, T0 + MS.times(2), 1);
    assert!(matches!(spend, Spend::Taken(_)));
    assert_eq!(again, None, "no evidence of another request");
    let (spend, next, _) = p.spend(state, T0 + MS.times(500), 1);
    assert_eq!(spend, Spend::Empty);
    assert!(next.is_some(), "the next request claims");
    // A key with tokens to spare: the second lease is claimed at once.
    let (_, claim, fresh) = p.spend(p.fresh(T0), T0, 1);
    let plenty = GrantedLease { unleased: 950, ..grant(1, 1) };
    let (_, fresh) = p.apply(fresh, T0 + MS, sent(claim.unwrap().started), &plenty);
    assert!(p.spend(fresh, T0 + MS.times(2), 1).1.is_some(), "plentiful: claimed");
    let seen_more = with(state, |s| {
        s.rate.spent = 3;
        s.rate.since = T0 - SECOND;
    });
    let (spend, prefetch, _) = p.spend(with(seen_more, |s| s.lease.tokens = 1), T0 + MS.times(2), 1);
    assert!(matches!(spend, Spend::Taken(_)));
    assert!(prefetch.is_some(), "a pool that has seen more refreshes before it runs dry");
}

#[test]
fn steady_traffic_spends_locally_and_refreshes_early() {
    let p = pool();
    let mut state = leased(100);
    let mut claims = 0;
    let mut taken = 0;
    // 100/s for 900 ms: one request every 10 ms.
    for i in 0..90 {
        let (spend, claim, after) = p.spend(state, T0 + MS.times(10 * i), 1);
        taken += u64::from(matches!(spend, Spend::Taken(_)));
        claims += u64::from(claim.is_some());
        state = after;
    }
    assert_eq!(taken, 90, "never waited");
    assert_eq!(claims, 1, "one early refresh, while tokens remained");
    assert!(state.lease.tokens > 0);
}

#[test]
fn a_claim_that_is_never_answered_is_taken_over_after_its_ttl() {
    let p = pool();
    let (_, first, state) = p.spend(p.fresh(T0), T0, 1);
    assert!(first.is_some());
    let (_, early, _) = p.spend(state, T0 + MS.times(599), 1);
    assert_eq!(early, None);
    let (_, late, taken_over) = p.spend(state, T0 + MS.times(600), 1);
    assert_eq!(late.unwrap().started, T0 + MS.times(600));
    // The first refresher's answer then arrives: the newer claim's lease is
    // not yet in place, so it applies; the second answer is then stale.
    let (applied, state) = p.apply(taken_over, T0 + MS.times(700), sent(T0), &grant(1, 50));
    assert_eq!(applied, Applied::Replaced(Leftover::default()));
    let (applied, after) = p.apply(state, T0 + MS.times(800), sent(T0 + MS.times(600)), &grant(2, 70));
    assert_eq!(applied, Applied::Stale, "a newer lease is in place: return all 70");
    assert_eq!(after, state);
}

#[test]
fn a_new_lease_keeps_what_the_rate_spends_of_the_old_one_and_hands_back_the_rest() {
    let p = pool();
    // 60 spent in the 800 ms since the first lease: 60/s observed.
    let state = with(leased(100), |s| {
        s.lease.tokens = 40;
        s.rate.spent = 60;
    });
    // In the lease's last quarter: due although 39 tokens remain.
    let (_, claim, claimed) = p.spend(state, T0 + MS.times(800), 1);
    let claim = claim.unwrap();
    assert_eq!(claim.wanted, 22, "61/s for a second, less the 39 held");
    assert_eq!(claim.send_by, claim.started + MAX_BATCH_DELAY, "39 held: time to share a call");
    let (applied, after) = p.apply(claimed, T0 + MS.times(820), sent(claim.started), &grant(2, 80));
    // 61/s spends 11 in the 180 ms the old lease still counts: those
    // stay, held; 28 go back to the service.
    let back = Leftover { returns: [(0, 0), (1, 28)], expired: 0 };
    assert_eq!(applied, Applied::Replaced(back));
    assert_eq!((after.lease.id, after.lease.tokens, after.claims.refresh_until), (2, 80, Nanos::ZERO));
    assert_eq!((after.held.lease, after.held.tokens, after.held.until), (1, 11, T0 + SECOND));
    // The same answer again (a replay) changes nothing and returns nothing.
    assert_eq!(after.claims.latency, MS.times(20), "what the refresh took, for the next one's timing");
    assert_eq!(p.apply(after, T0 + MS.times(830), sent(claim.started), &grant(2, 80)).0, Applied::Duplicate);
    // So does a replay of the held lease's: its tokens are in use, not to be returned.
    assert_eq!(p.apply(after, T0 + MS.times(830), sent(T0), &grant(1, 100)).0, Applied::Duplicate);
}

#[test]
fn held_tokens_are_spent_first_and_only_until_their_lease_expires() {
    let p = pool();
    let state = with(leased(50), |s| {
        s.held.lease = 1;
        s.held.tokens = 2;
        s.held.until = T0 + MS.times(100);
    });
    assert_eq!(p.usable(&state, T0 + MS), 52);
    let (spend, _, after) = p.spend(state, T0 + MS, 3);
    assert!(matches!(spend, Spend::Taken(_)));
    assert_eq!((after.held.tokens, after.lease.tokens), (0, 49), "both held first, then one of the lease's");
    let (_, _, after) = p.spend(state, T0 + MS.times(100), 1);
    assert_eq!((after.held.tokens, after.lease.tokens), (2, 49), "held tokens past their lease's expiry do not count");
    assert_eq!(p.usable(&state, T0 + MS.times(100)), 50);
}

#[test]
fn a_refresh_that_comes_early_gives_back_no_more_than_its_rounding_at_a_steady_rate() {
    // 100/s, one request every 10 ms, for 5 s: every lease is replaced
    // while it still holds tokens, none of them goes back then, and no
    // request finds the pool empty. (The held share is rounded up: a lease
    // may leave one token unspent, given back once it has expired, as its
    // per-minute window still counts.)
    let p = pool();
    let mut state = with(leased(100), |s| {
        s.rate.spent = 100;
        s.rate.since = T0 - SECOND;
    });
    let (mut returned, mut expired, mut waited, mut claims) = (0, 0, 0, 0);
    let mut pending: Option<Claim> = None;
    for i in 1..500 {
        let now = T0 + MS.times(10 * i);
        if let Some(claim) = pending.take() {
            // The answer comes 5 ms after the claim: what the service grants.
            let (applied, after) = p.apply(state, now - MS.times(5), sent(claim.started), &grant(i, claim.wanted));
            let Applied::Replaced(left) = applied else { panic!("{applied:?}") };
            returned += left.returns.iter().map(|(_, t)| t).sum::<u64>();
            expired += left.expired;
            state = after;
        }
        let (spend, claim, after) = p.spend(state, now, 1);
        waited += u64::from(!matches!(spend, Spend::Taken(_)));
        claims += u64::from(claim.is_some());
        pending = claim;
        state = after;
    }
    assert_eq!(waited, 0);
    assert!(returned + expired <= claims, "{returned} returned and {expired} expired in {claims} leases");
    assert!(claims <= 7, "about one lease a second: {claims}");
}

#[test]
fn a_revived_pool_observes_its_rate_afresh() {
    let p = pool();
    // Spent 1000 over its first 10 s, then idle for a minute.
    let state = with(leased(100), |s| {
        s.rate.spent = 1_000;
        s.rate.since = T0 - SECOND.times(10);
    });
    let later = T0 + SECOND.times(60);
    let (spend, claim, after) = p.spend(state, later, 1);
    assert_eq!(spend, Spend::Empty);
    assert_eq!((after.rate.spent, after.rate.since), (0, later));
    assert_eq!(claim.unwrap().rate, 1.0, "the waiting request itself, over a second; not 1000 over 70 s");
}

#[test]
fn an_expired_leases_tokens_go_back_while_its_window_counts_and_are_lost_after() {
    let p = pool();
    // A lease of 1 s in a window that ends 30 s after it was granted, and 3
    // held from the lease before it.
    let state = with(leased(100), |s| {
        s.held.lease = 7;
        s.held.tokens = 3;
        s.held.until = T0 + MS;
    });
    for (later, returns, expired) in [
        // Expired, their window still counting: they go back (the service
        // takes them off its count).
        (T0 + SECOND, [(7, 3), (1, 100)], 0),
        // Its window over: nothing left to give them back to.
        (T0 + SECOND.times(31), [(0, 0); 2], 103),
    ] {
        assert_eq!(p.usable(&state, later), 0);
        let (spend, claim, claimed) = p.spend(state, later, 1);
        assert_eq!(spend, Spend::Empty);
        let (applied, after) = p.apply(claimed, later, sent(claim.unwrap().started), &grant(2, 10));
        assert_eq!(applied, Applied::Replaced(Leftover { returns, expired }), "at {later:?}");
        assert_eq!((after.held.lease, after.held.tokens), (0, 0));
    }
}

/// A grant that leaves its key nothing unleased (its holder took all the
/// key had) denies here once its tokens are spent, until the answer's
/// reset (a window's end; a bucket's leader's: when the bucket is full
/// again), at least the callout timeout, at most the lease's end: a call
/// before then would be refused. A pool denied until its lease ends asks
/// as that end nears (its next lease comes as the bucket is full again).
/// With some left, a spent pool asks at once.
#[test]
fn a_grant_that_took_all_the_key_had_denies_once_spent_until_its_reset() {
    let p = pool();
    for (unleased, reset) in [(0, SECOND), (0, MS.times(100)), (1, SECOND)] {
        let (_, claim, claimed) = p.spend(p.fresh(T0), T0, 1);
        let all = GrantedLease { unleased, reset, ..grant(1, 2) };
        let (_, state) = p.apply(claimed, T0, sent(claim.unwrap().started), &all);
        let (spend, _, state) = p.spend(state, T0 + MS, 2);
        assert!(matches!(spend, Spend::Taken(_)), "{spend:?}");
        let (spend, again, _) = p.spend(state, T0 + MS.times(3), 1);
        if unleased > 0 {
            assert_eq!((spend, again.is_some()), (Spend::Empty, true), "asks at once");
            continue;
        }
        let Spend::Denied(decision) = spend else { panic!("{spend:?}") };
        assert_eq!(again, None, "no call while the key has nothing");
        if reset < SECOND {
            assert_eq!(decision.retry_after(), MS.times(297), "the callout timeout, not the reset's 100 ms");
            let (spend, again, _) = p.spend(state, T0 + MS.times(300), 1);
            assert_eq!((spend, again.is_some()), (Spend::Empty, true), "asks again then");
            continue;
        }
        assert_eq!(decision.retry_after(), SECOND - MS.times(3));
        let (spend, again, _) = p.spend(state, T0 + MS.times(500), 1);
        assert_eq!((matches!(spend, Spend::Denied(_)), again), (true, None), "not yet");
        let (spend, again, _) = p.spend(state, T0 + MS.times(800), 1);
        assert!(matches!(spend, Spend::Denied(_)), "{spend:?}");
        assert_eq!(again.map(|c| c.window), Some(None), "asks as the lease's end nears");
    }
}

/// A busy pool refused in its window that takes all of the next window
/// ahead (a key's leader over its limit) is denied through that window
/// too once it has spent it, and asks ahead of the one after, not for
/// more of it: one call a window.
#[test]
fn a_pool_denied_in_its_window_that_takes_all_of_the_next_is_denied_through_it_once_spent() {
    let p = pool();
    let at = T0 + MS.times(300);
    let busy = with(p.fresh(at), |s| {
        s.rate.spent = 10;
        s.rate.since = at - SECOND;
    });
    let (_, claim, claimed) = p.spend(busy, at, 1);
    let (_, state) = p.apply(claimed, at, sent(claim.unwrap().started), &windowed_grant(1, 0, K, at));
    let near = T0 + MS.times(700);
    let (_, claim, claimed) = p.spend(state, near, 1);
    assert_eq!(claim.map(|c| c.window), Some(Some(K + 1)));
    let all = GrantedLease { unleased: 0, ..windowed_grant(2, 3, K + 1, near) };
    let (_, mut state) = p.apply(claimed, near + MS, sent(near), &all);
    for at in 1..=3 {
        let (spend, _, after) = p.spend(state, T0 + SECOND + MS.times(at), 1);
        assert!(matches!(spend, Spend::Taken(_)), "{spend:?}");
        state = after;
    }
    let (spend, claim, _) = p.spend(state, T0 + SECOND + MS.times(100), 1);
    let Spend::Denied(decision) = spend else { panic!("{spend:?}") };
    assert_eq!(decision.retry_after(), SECOND - MS.times(100));
    assert_eq!(claim, None, "nothing to ask of this window");
    let (_, claim, _) = p.spend(state, T0 + MS.times(1_700), 1);
    assert_eq!(claim.map(|c| c.window), Some(Some(K + 2)), "the next one's, ahead");
}

#[test]
fn a_grant_of_zero_denies_locally_until_the_reset_without_asking_again() {
    let p = pool();
    let (_, claim, claimed) = p.spend(p.fresh(T0), T0, 1);
    let none = GrantedLease { reset: SECOND.times(2), ..grant(1, 0) };
    let (_, state) = p.apply(claimed, T0 + MS, sent(claim.unwrap().started), &none);
    let (spend, again, _) = p.spend(state, T0 + SECOND, 1);
    let Spend::Denied(decision) = spend else { panic!("{spend:?}") };
    assert_eq!(decision.retry_after(), SECOND + MS);
    assert_eq!(again, None, "no callout until the reset");
    let (spend, again, _) = p.spend(state, T0 + MS + SECOND.times(2), 1);
    assert_eq!(spend, Spend::Empty);
    assert!(again.is_some(), "at the reset it asks again");
}

#[test]
fn a_failed_refresh_frees_the_claim_only_if_it_is_still_ours() {
    let p = pool();
    let (_, claim, state) = p.spend(p.fresh(T0), T0, 1);
    let claim = claim.unwrap();
    let freed = p.abandon(state, &claim).unwrap();
    assert_eq!(freed.claims.refresh_until, Nanos::ZERO);
    assert!(p.spend(freed, T0 + MS, 1).1.is_some(), "the next request claims again");
    let other = Claim { started: T0 + MS, ..claim };
    assert_eq!(p.abandon(state, &other), None, "another worker's claim is left alone");
}

#[test]
fn undo_returns_tokens_only_to_the_lease_they_came_from() {
    let p = pool();
    let state = leased(10);
    let (_, _, spent) = p.spend(state, T0 + MS, 3);
    let undo = |s, at| p.release(s, T0 + MS, Grant { cost: 3, at }, Release::Undo);
    assert_eq!(undo(spent, T0 + MS).unwrap().lease.tokens, 10);
    assert_eq!(undo(spent, T0 - MS), None, "taken from an older lease");
    assert_eq!(p.release(spent, T0 + MS, Grant { cost: 3, at: T0 + MS }, Release::Done), None);
}

#[test]
fn undo_with_held_tokens_goes_to_whichever_could_have_given_them_and_expires_first() {
    let p = pool();
    let held = with(leased(10), |s| {
        s.held.lease = 1;
        s.held.tokens = 0;
        s.held.until = T0 + MS.times(100);
    });
    let undo = |s, at, now| p.release(s, now, Grant { cost: 2, at }, Release::Undo);
    // Taken while held tokens counted: maybe theirs, back to them.
    let back = undo(held, T0 + MS, T0 + MS.times(2)).unwrap();
    assert_eq!((back.held.tokens, back.lease.tokens), (2, 10));
    // Too late for the held lease: they may have been its, so they are dropped.
    assert_eq!(undo(held, T0 + MS, T0 + MS.times(100)), None);
    // Taken after the held tokens stopped counting: the current lease's.
    let back = undo(held, T0 + MS.times(100), T0 + MS.times(101)).unwrap();
    assert_eq!((back.held.tokens, back.lease.tokens), (0, 12));
}

#[test]
fn idle_means_nothing_to_lose_and_state_round_trips() {
    let p = pool();
    let state = leased(10);
    assert!(!p.is_idle(state, T0));
    assert!(p.is_idle(state, T0 + SECOND));
    let mut bytes = [0u8; STATE_LEN];
    p.encode(&state, &mut bytes);
    assert_eq!(p.decode(&bytes), Some(state));
    assert_eq!(p.decode(&bytes[..STATE_LEN - 1]), None);
}

/// An allowance of `per_window` tokens in 30 per-second windows from
/// window `K` (the one counting at `T0`), granted by a call sent at `T0`
/// and answered 2 ms later.
fn allowance(per_window: u64) -> (LeasePool, PoolState) {
    allowance_answered_after(per_window, MS.times(2))
}

/// As [`allowance`], its call answered `latency` after it left.
fn allowance_answered_after(per_window: u64, latency: Nanos) -> (LeasePool, PoolState) {
    let p = pool();
    let claimed = with(p.fresh(T0), |s| {
        s.rate.spent = 3;
        s.rate.since = T0 - SECOND;
        s.claims.refresh_until = T0 + MS;
    });
    let grant = GrantedLease { windows: 30, ..windowed_grant(1, per_window, K, T0) };
    let grant = GrantedLease { valid: SECOND.times(30), ..grant };
    let (applied, state) = p.apply(claimed, T0 + latency, (T0, T0), &grant);
    assert_eq!(applied, Applied::Replaced(Leftover::default()));
    (p, state)
}

/// An allowance granted by a slow call (150 ms) counts each window's
/// tokens from 151 ms after its start: a request that finds its window
/// spent with too little of it left for a refresh (twice 150 ms) still
/// asks for a lease of it when the next window's tokens come later than
/// that, rather than wait for them past its `max_wait` (the end-to-end
/// long tail's one 429 below the limit, once in about four runs).
#[test]
fn a_spent_window_asks_for_more_unless_the_next_windows_tokens_come_sooner() {
    let (p, state) = allowance_answered_after(2, MS.times(150));
    let window_3 = T0 + SECOND.times(3);
    let (spend, claim, state) = p.spend(state, window_3 + MS.times(750), 2);
    assert!(matches!(spend, Spend::Taken(_)), "{spend:?}");
    assert_eq!(claim, None, "running dry 250 ms before the window's end asks for nothing");
    let (spend, claim, _) = p.spend(state, window_3 + MS.times(760), 1);
    assert_eq!(spend, Spend::Empty);
    let claim = claim.expect("the next window's tokens come in 391 ms: more of this one is asked for");
    assert_eq!((claim.window, claim.send_by), (None, window_3 + MS.times(760)));
    let (spend, claim, _) = p.spend(state, window_3 + MS.times(860), 1);
    assert_eq!((spend, claim), (Spend::Empty, None), "they come in 291 ms, within a refresh's 300");
}

#[test]
fn an_allowance_refills_every_window_of_its_span_without_asking() {
    let (p, mut state) = allowance(3);
    for window in 0..30u64 {
        let start = T0 + SECOND.times(window);
        // Its tokens count from the window's latest possible start (2 ms
        // of latency, 1 ms of rounding) to its end.
        let from = if window == 0 { T0 + MS.times(2) } else { start + MS.times(3) };
        if window > 0 {
            let (spend, claim, _) = p.spend(state, from - Nanos::from_nanos(1), 1);
            assert_eq!(spend, Spend::Empty, "window {window}: not before it surely started");
            assert_eq!(claim, None, "a gap of a few ms waits for the window, it does not ask");
        }
        // Three a window, as its rate says (3 a second).
        for i in 0..3 {
            let (spend, claim, after) = p.spend(state, from + MS.times(50 + 350 * i), 1);
            assert!(matches!(spend, Spend::Taken(_)), "window {window}, request {i}: {spend:?}");
            if window < 15 {
                assert_eq!(claim, None, "window {window}: nothing to ask for yet");
            }
            state = with(after, |s| s.claims.refresh_until = Nanos::ZERO);
        }
        let (spend, _, _) = p.spend(state, from + MS.times(800), 1);
        assert!(!matches!(spend, Spend::Taken(_)), "window {window}: 3 a window");
    }
    // After its last window: nothing.
    let (spend, _, _) = p.spend(state, T0 + SECOND.times(30) + MS.times(5), 1);
    assert!(!matches!(spend, Spend::Taken(_)));
}

#[test]
fn between_two_windows_a_request_takes_a_token_of_each() {
    let (p, state) = allowance(3);
    // One spent in window 4; the moment after its earliest end, before
    // window 5 surely started (3 ms: the call's 2 ms and the rounding).
    let (_, _, state) = p.spend(state, T0 + SECOND.times(4) + MS.times(500), 1);
    let between = T0 + SECOND.times(5) + MS;
    let (spend, claim, after) = p.spend(state, between, 1);
    assert!(matches!(spend, Spend::Taken(_)), "{spend:?}");
    assert_eq!(claim, None);
    assert_eq!((after.held.tokens, after.lease.tokens), (1, 2), "one of window 4's two left, one of window 5's three");
    let (_, _, after) = p.spend(after, between, 1);
    let (spend, _, _) = p.spend(after, between, 1);
    assert_eq!(spend, Spend::Empty, "window 4 has none left for the moment");
    // Once window 5 surely started: its own, what the moment left of it.
    let (spend, _, after) = p.spend(after, T0 + SECOND.times(5) + MS.times(3), 1);
    assert!(matches!(spend, Spend::Taken(_)));
    assert_eq!(after.lease.tokens, 0);
}

#[test]
fn an_allowance_is_renewed_from_its_last_half_by_a_call_in_its_last_window() {
    let (p, state) = allowance(3);
    let (_, early, _) = p.spend(state, T0 + SECOND.times(14), 1);
    assert_eq!(early, None);
    let now = T0 + SECOND.times(15) + MS.times(3);
    let (spend, claim, after) = p.spend(state, now, 1);
    assert!(matches!(spend, Spend::Taken(_)));
    let claim = claim.unwrap();
    assert_eq!(claim.window, Some(K + 30), "the window after its last");
    let last_starts = T0 + SECOND.times(29) + MS.times(3);
    assert_eq!(claim.not_before, last_starts, "its answer must come in the last window");
    let half_left = (T0 + SECOND.times(30) - last_starts).halved();
    assert_eq!(claim.send_by, last_starts + half_left, "within a round, half the window left");
    assert_eq!(after.claims.renewal_until, claim.send_by + p.claim_ttl, "no other worker claims it meanwhile");
    // A window that runs dry meanwhile still gets a lease of its own.
    let (spend, top_up, _) = p.spend(after, now + MS, 3);
    assert_eq!(spend, Spend::Empty);
    assert_eq!(top_up.map(|c| c.window), Some(None), "a lease of this window beside the renewal");
    // Answered in the last window with the next term's allowance, ahead:
    // the last window's tokens are held until its end, then the new one counts.
    let at = claim.send_by;
    let state = after;
    let ahead = GrantedLease {
        windows: 30,
        valid: T0 + SECOND.times(60) - at,
        starts: T0 + SECOND.times(30) - at,
        index: K + 30,
        ..windowed_grant(2, 4, K + 30, at)
    };
    let (applied, renewed) = p.apply(state, at + MS.times(2), (claim.started, at), &ahead);
    assert!(matches!(applied, Applied::Replaced(_)), "{applied:?}");
    assert_eq!((renewed.lease.id, renewed.allowance.per_window, renewed.allowance.final_index), (2, 4, K + 59));
    assert!(renewed.held.tokens > 0, "the last window's tokens are kept for its rest");
    let (spend, _, _) = p.spend(renewed, T0 + SECOND.times(30) + MS.times(5), 4);
    assert!(matches!(spend, Spend::Taken(_)), "the next term's first window: {spend:?}");
    let (spend, _, _) = p.spend(renewed, T0 + SECOND.times(45) + MS.times(5), 4);
    assert!(matches!(spend, Spend::Taken(_)), "and its later windows");
}

#[test]
fn a_window_that_runs_dry_gets_a_lease_of_its_own_and_the_allowance_goes_on() {
    let (p, state) = allowance(2);
    let now = T0 + SECOND.times(3) + MS.times(100);
    // Spent at once, with most of the window and its requests to come:
    // more of this window is asked for before a request waits.
    let (spend, claim, state) = p.spend(state, now, 2);
    assert!(matches!(spend, Spend::Taken(_)));
    let claim = claim.unwrap();
    assert_eq!((claim.window, claim.not_before, claim.send_by), (None, now, now));
    let (spend, again, _) = p.spend(state, now + MS, 1);
    assert_eq!((spend, again), (Spend::Empty, None), "asked once");
    let top_up = GrantedLease { valid: SECOND - MS.times(105), index: K + 3, ..windowed_grant(3, 5, K + 3, now) };
    let top_up = GrantedLease { starts: Nanos::ZERO, ..top_up };
    let (applied, state) = p.apply(state, now + MS.times(4), (claim.started, now + MS.times(3)), &top_up);
    assert_eq!(applied, Applied::Replaced(Leftover::default()));
    assert_eq!((state.lease.id, state.held.lease, state.held.tokens), (1, 3, 5), "held beside the allowance");
    let (spend, _, state) = p.spend(state, now + MS.times(5), 5);
    assert!(matches!(spend, Spend::Taken(_)));
    // The next window: the allowance's 2 again, from its start as the
    // allowance's own call placed it (the top-up's latency, 1 ms, is not
    // the allowance's 2 ms); the top-up ended with its window.
    let (spend, _, _) = p.spend(state, T0 + SECOND.times(4) + MS.times(3) - Nanos::from_nanos(1), 1);
    assert_eq!(spend, Spend::Empty, "not before the window surely started");
    let (spend, _, _) = p.spend(state, T0 + SECOND.times(4) + MS.times(3), 2);
    assert!(matches!(spend, Spend::Taken(_)), "{spend:?}");
}

#[test]
fn a_window_the_service_has_nothing_more_for_denies_here_until_it_ends() {
    let (p, state) = allowance(2);
    let now = T0 + SECOND.times(3) + MS.times(100);
    let (_, claim, state) = p.spend(state, now, 2);
    let claim = claim.unwrap();
    let nothing =
        GrantedLease { granted: 0, valid: SECOND - MS.times(105), reset: SECOND - MS.times(105), ..grant(3, 0) };
    let (_, state) = p.apply(state, now + MS.times(4), (claim.started, now + MS.times(2)), &nothing);
    let (spend, again, _) = p.spend(state, now + MS.times(5), 1);
    assert!(matches!(spend, Spend::Denied(_)), "{spend:?}");
    assert_eq!(again, None, "without asking again");
    let (spend, _, _) = p.spend(state, T0 + SECOND.times(4) + MS.times(4), 1);
    assert!(matches!(spend, Spend::Taken(_)), "the next window's allowance: {spend:?}");
}

#[test]
fn an_allowance_given_back_returns_this_windows_tokens_and_spends_no_later_window() {
    let (p, state) = allowance(3);
    let now = T0 + SECOND.times(7) + MS.times(10);
    let (_, _, state) = p.spend(state, now, 1);
    let (unspent, emptied) = p.take_unspent(state, now);
    assert_eq!(unspent, [(0, 0), (1, 2)]);
    let (_, _, spent) = p.spend(state, now, 2);
    assert_eq!(p.take_unspent(spent, now).0, [(0, 0), (1, 0)], "its later windows are freed all the same");
    let (spend, _, _) = p.spend(emptied, T0 + SECOND.times(8) + MS.times(10), 1);
    assert!(!matches!(spend, Spend::Taken(_)));
    assert!(p.is_idle(emptied, now));
    // Kept while any of its windows is to come.
    assert_eq!(p.idle_at(state, now), T0 + SECOND.times(30));
}

#[test]
fn a_renewal_answered_too_early_goes_back_and_the_allowance_goes_on() {
    let (p, state) = allowance(3);
    let at = T0 + SECOND.times(16);
    let ahead =
        GrantedLease { windows: 30, starts: SECOND.times(14), index: K + 30, ..windowed_grant(2, 4, K + 30, at) };
    let (applied, after) = p.apply(state, at, (at, at), &ahead);
    assert_eq!(applied, Applied::Stale);
    assert_eq!((after.lease.id, after.allowance.per_window), (1, 3));
}

/// A pool of a rule that may admit 2 units a second without a lease.
fn overshooting() -> LeasePool {
    LeasePool { overshoot: Some(Overshoot { limit: 2, period: SECOND }), ..pool() }
}

#[test]
fn a_cold_pool_with_a_budget_admits_at_once_and_reports_with_its_claim() {
    let p = overshooting();
    let (spend, claim, state) = p.spend(p.fresh(T0), T0, 1);
    assert!(matches!(spend, Spend::Unleased(_)), "{spend:?}");
    let claim = claim.expect("the pool still asks for a lease");
    assert_eq!(claim.reported, 1, "what it admitted goes with the claim");
    assert_eq!(claim.send_by, T0 + MAX_BATCH_DELAY, "nobody waits for it: it may share a call");
    // A second request before the answer: from the budget, no second claim.
    let (spend, again, state) = p.spend(state, T0 + MS, 1);
    assert!(matches!(spend, Spend::Unleased(_)));
    assert_eq!(again, None);
    // The budget is spent: the third waits, as under strict.
    let (spend, _, state) = p.spend(state, T0 + MS.times(2), 1);
    assert_eq!(spend, Spend::Empty);
    assert_eq!(state.without_lease.unreported, 1, "reported with the next claim");
    // A strict pool never admits without a lease.
    assert_eq!(pool().spend(pool().fresh(T0), T0, 1).0, Spend::Empty);
}

/// A pool whose pace the budget covers only reports: a lease of a pair
/// that sees its key so seldom would expire unspent, taken from the
/// limit all the same. Its answer grants nothing and denies nothing.
#[test]
fn a_pool_its_budget_covers_only_reports_and_its_answer_denies_nothing() {
    let p = overshooting();
    let (_, claim, state) = p.spend(p.fresh(T0), T0, 1);
    let claim = claim.unwrap();
    assert_eq!((claim.wanted, claim.reported, claim.per_window, claim.wants_notices), (0, 1, false, true));
    let answer = GrantedLease { granted: 0, report_only: true, ..grant(1, 0) };
    let (applied, state) = p.apply(state, T0 + MS, sent(T0), &answer);
    assert_eq!(applied, Applied::Reported);
    assert_eq!((state.lease.id, state.quote.denied_until, state.claims.refresh_until), (0, Nanos::ZERO, Nanos::ZERO));
    let (spend, _, _) = p.spend(state, T0 + MS.times(2), 1);
    assert!(matches!(spend, Spend::Unleased(_)), "the budget's second unit: {spend:?}");
    // A pool busier than its budget leases as usual.
    let busy = with(p.fresh(T0), |s| {
        s.rate.spent = 50;
        s.rate.since = T0 - SECOND;
    });
    let (spend, claim, _) = p.spend(busy, T0, 1);
    assert!(matches!(spend, Spend::Unleased(_)));
    assert!(claim.unwrap().wanted > 1);
}

#[test]
fn a_pool_that_holds_a_lease_spends_only_its_tokens() {
    let p = overshooting();
    let state = with(leased(1), |s| s.without_lease = Unleased::default());
    let (spend, _, state) = p.spend(state, T0 + MS, 1);
    assert!(matches!(spend, Spend::Taken(_)));
    // Its tokens spent, its lease still counting: strict, it waits.
    let (spend, _, _) = p.spend(state, T0 + MS.times(2), 1);
    assert_eq!(spend, Spend::Empty);
    // Once the lease is over, the budget admits again.
    let (spend, _, _) = p.spend(state, T0 + SECOND.times(11), 1);
    assert!(matches!(spend, Spend::Unleased(_)), "{spend:?}");
}

#[test]
fn a_key_near_its_limit_holds_the_pool_strict_past_its_lease() {
    let p = overshooting();
    let (_, claim, state) = p.spend(p.fresh(T0), T0, 1);
    let claim = claim.unwrap();
    let near = GrantedLease { near_limit: true, valid: SECOND, window: SECOND, reset: MS.times(400), ..grant(1, 1) };
    let (_, state) = p.apply(state, T0 + MS, sent(claim.started), &near);
    assert_eq!(state.without_lease.strict_until, T0 + MS + MS.times(400) + SECOND);
    let after_lease = T0 + SECOND + MS.times(100);
    let (spend, _, _) = p.spend(state, after_lease, 1);
    assert_eq!(spend, Spend::Empty, "strict until the window after the answer's ends");
    let (spend, _, _) = p.spend(state, T0 + SECOND.times(2), 1);
    assert!(matches!(spend, Spend::Unleased(_)));
}

#[test]
fn a_report_whose_call_failed_goes_with_the_next_claim() {
    let p = overshooting();
    let (_, claim, state) = p.spend(p.fresh(T0), T0, 1);
    let claim = claim.unwrap();
    let state = p.abandon(state, &claim).unwrap();
    assert_eq!(state.without_lease.unreported, 1);
    let (_, next, _) = p.spend(state, T0 + MS, 1);
    assert_eq!(next.map(|c| c.reported), Some(2), "the first and this one");
}

#[test]
fn a_pool_whose_budget_is_in_use_is_not_idle() {
    let p = overshooting();
    let (_, claim, state) = p.spend(p.fresh(T0), T0, 1);
    let state = p.abandon(state, &claim.unwrap()).unwrap();
    let state = with(state, |s| s.without_lease.unreported = 0);
    assert!(!p.is_idle(state, T0 + MS), "forgotten, its period's budget would start afresh");
    assert_eq!(p.idle_at(state, T0 + MS), T0 + SECOND);
    assert!(p.is_idle(state, T0 + SECOND));
    let bytes = {
        let mut out = vec![0; STATE_LEN];
        p.encode(&state, &mut out);
        out
    };
    assert_eq!(p.decode(&bytes), Some(state), "the budget's use is stored with the pool");
}

/// A request that waits at a pool that has seen nothing else (a new pair,
/// or one revived after a horizon without requests) asks for its own cost
/// as a check: no allowance, no pace to lease ahead of.
#[test]
fn a_cold_pairs_wait_is_asked_as_a_check_of_its_own_cost() {
    let p = pool();
    let (spend, claim, _) = p.spend(p.fresh(T0), T0, 3);
    assert_eq!(spend, Spend::Empty);
    let claim = claim.unwrap();
    assert!(claim.check, "a new pair: {claim:?}");
    assert_eq!((claim.wanted, claim.per_window, claim.send_by), (3, false, T0));
    // Revived after a minute without requests: cold again.
    let revived = with(leased(0), |s| {
        s.rate.spent = 1_000;
        s.rate.since = T0 - SECOND.times(10);
    });
    let (_, claim, _) = p.spend(revived, T0 + SECOND.times(60), 1);
    assert!(claim.unwrap().check, "revived after a horizon without tokens");
}

/// A pool that has seen a request since its observation began leases at
/// its pace, as before: its requests come often enough for a lease.
#[test]
fn a_pool_that_has_seen_another_request_leases_at_its_pace() {
    let p = pool();
    // Its lease spent, its rate observation has seen five requests.
    let seen = with(leased(5), |s| {
        s.lease.tokens = 0;
        s.rate.spent = 5;
        s.rate.since = T0;
    });
    let (spend, claim, _) = p.spend(seen, T0 + MS.times(500), 1);
    assert_eq!(spend, Spend::Empty);
    let claim = claim.unwrap();
    assert!(!claim.check, "{claim:?}");
    assert!(claim.wanted > 1, "the pace's worth: {}", claim.wanted);
}

/// The tokens of a check go to the request that waits, and never back to
/// the service: there is no lease record to return them to.
#[test]
fn a_checks_tokens_are_spent_by_the_waiter_and_never_returned() {
    let p = pool();
    let (_, claim, state) = p.spend(p.fresh(T0), T0, 1);
    let checked = GrantedLease { checked: true, ..grant(7, 1) };
    let (applied, state) = p.apply(state, T0 + MS, sent(claim.unwrap().started), &checked);
    assert_eq!(applied, Applied::Replaced(Leftover::default()));
    assert_eq!((state.lease.id, state.lease.tokens), (0, 1), "no id: nothing to return to");
    let (spend, again, spent) = p.spend(state, T0 + MS.times(2), 1);
    assert!(matches!(spend, Spend::Taken(_)));
    assert_eq!(again, None, "the waiter alone: no second call");
    // Unspent (the waiter left), it is not handed back, now or when replaced.
    assert_eq!(p.take_unspent(state, T0 + MS.times(2)).0, [(0, 0), (0, 0)]);
    let (_, claim, _) = p.spend(spent, T0 + MS.times(500), 1);
    let claim = claim.unwrap();
    let (applied, _) = p.apply(state, T0 + MS.times(501), sent(claim.started), &grant(8, 5));
    assert_eq!(applied, Applied::Replaced(Leftover::default()), "the check's token is not returned");
    // A refused check denies here until the service's reset, as a lease of none does.
    let (_, claim, state) = p.spend(p.fresh(T0), T0, 1);
    let refused = GrantedLease { checked: true, ..grant(9, 0) };
    let (_, state) = p.apply(state, T0 + MS, sent(claim.unwrap().started), &refused);
    assert!(matches!(p.spend(state, T0 + MS.times(2), 1).0, Spend::Denied(_)));
}

/// A pool whose only request was decided as a check claims no lease after
/// it, however much the key has left: its pair is cold, and a lease would
/// expire unspent (at fleet scale, every request of a thin key costs one
/// item and no more, as in check mode).
#[test]
fn a_checked_request_claims_nothing_after_it_even_with_plenty_left() {
    let p = pool();
    let (_, claim, state) = p.spend(p.fresh(T0), T0, 1);
    let checked = GrantedLease { checked: true, unleased: 990, limit: 1_000, ..grant(7, 1) };
    let (_, state) = p.apply(state, T0 + MS, sent(claim.unwrap().started), &checked);
    let (spend, again, state) = p.spend(state, T0 + MS.times(2), 1);
    assert!(matches!(spend, Spend::Taken(_)));
    assert_eq!(again, None, "plenty left, but a checked pair is cold");
    let (spend, next, _) = p.spend(state, T0 + MS.times(300), 1);
    assert_eq!(spend, Spend::Empty);
    assert!(next.is_some_and(|c| !c.check), "the next request finds a pool that has seen one: a lease");
}

/// A pair seen again within [`THIN_HORIZONS`] lease horizons of its check,
/// at a key not short of tokens, is not cold, even though its pool's
/// observation started afresh: it leases at its pace (and, its pair known
/// that long, may ask for an allowance), so a key of about a request a
/// lease lifetime at an Envoy settles into leases instead of checking
/// request by request.
#[test]
fn a_pair_back_soon_after_its_check_leases() {
    let p = pool();
    let (_, claim, state) = p.spend(p.fresh(T0), T0, 1);
    let checked = GrantedLease { checked: true, unleased: 990, ..grant(7, 1) };
    let (_, state) = p.apply(state, T0 + MS, sent(claim.unwrap().started), &checked);
    let (_, _, state) = p.spend(state, T0 + MS.times(2), 1);
    // Back 3 s later: its observation starts afresh (a horizon without
    // tokens), but its check was under four horizons ago.
    let (spend, claim, _) = p.spend(state, T0 + SECOND.times(3), 1);
    assert_eq!(spend, Spend::Empty);
    let claim = claim.unwrap();
    assert!(!claim.check && claim.per_window, "{claim:?}");
    // Back 5 s later: cold again.
    let (_, claim, _) = p.spend(state, T0 + SECOND.times(5), 1);
    assert!(claim.unwrap().check);
}

/// At a key the service said is short of tokens ([`SHORT`]: less than a
/// quarter of its limit unleased, or refused), a waiting request is
/// checked unless its pair's count vouches for a request in every lease
/// lifetime at its low end: a lease to a pair seen a few times would be
/// spent by its waiter and strand the rest where the key's demand
/// elsewhere is refused (under excess demand spread over a fleet, a tenth
/// to a quarter of per-second limits).
#[test]
fn at_a_key_short_of_tokens_only_a_busy_pair_leases() {
    let p = pool();
    let (_, claim, state) = p.spend(p.fresh(T0), T0, 1);
    let checked = GrantedLease { checked: true, unleased: 200, ..grant(7, 1) };
    let (_, state) = p.apply(state, T0 + MS, sent(claim.unwrap().started), &checked);
    let (_, _, state) = p.spend(state, T0 + MS.times(2), 1);
    // With more than a quarter unleased, a pair back 300 ms later leases.
    let plenty = with(state, |s| s.quote.unleased = 300);
    assert!(p.spend(plenty, T0 + MS.times(300), 1).1.is_some_and(|c| !c.check));
    // Back 300 ms later: seen twice, not a pace.
    let (spend, claim, _) = p.spend(state, T0 + MS.times(300), 1);
    assert_eq!(spend, Spend::Empty);
    assert!(claim.is_some_and(|c| c.check && c.wanted == 1), "a pair seen twice at a key short of tokens");
    // A pair whose count over a second vouches for more than one request a
    // lease lifetime (a horizon of a second) leases at its pace.
    let busy = with(leased(5), |s| {
        s.lease.tokens = 0;
        s.quote.unleased = 200;
        s.rate.spent = 20;
        s.rate.since = T0;
    });
    let (spend, claim, _) = p.spend(busy, T0 + SECOND, 1);
    assert_eq!(spend, Spend::Empty);
    assert!(claim.is_some_and(|c| !c.check && c.wanted > 1), "a busy pair leases: {claim:?}");
}

/// At a key short of tokens, a pool that spends its last token claims no
/// lease that nobody waits for unless its count vouches for a request in
/// every lease lifetime: such a lease would likely expire unspent while the
/// key's demand elsewhere is refused. Its next request waits for a check.
/// Where the key has tokens to spare, the same pool claims ahead as usual.
#[test]
fn at_a_key_short_of_tokens_a_thin_pair_claims_nothing_ahead() {
    let p = pool();
    // Two requests so far, one token left: with the third, a count whose
    // low end, `(√3 − 1)²`, is not a request a second.
    let thin = |unleased: u64| {
        with(leased(5), |s| {
            s.lease.tokens = 1;
            s.quote.unleased = unleased;
            s.rate.spent = 2;
            s.rate.since = T0;
        })
    };
    let at = T0 + MS.times(500);
    let (spend, claim, state) = p.spend(thin(200), at, 1);
    assert!(matches!(spend, Spend::Taken(_)), "{spend:?}");
    assert_eq!(claim, None, "nobody waits, and the key is short");
    let (spend, claim, _) = p.spend(state, at + MS.times(300), 1);
    assert_eq!(spend, Spend::Empty);
    assert!(claim.is_some_and(|c| c.check && c.wanted == 1), "the next request is checked: {claim:?}");
    // More than a quarter unleased: the spent pool claims its next lease.
    let (_, claim, _) = p.spend(thin(300), at, 1);
    assert!(claim.is_some_and(|c| !c.check), "{claim:?}");
}

/// The per-minute window `T0` is in (20 s into it), as the service numbers it.
const M: u64 = 1_700_000_000 / 60;

/// A pool that spent `rate` a second over the last second, holding `grant`
/// (of a per-minute window) answered at `at`.
fn minute_pool(rate: u64, at: Nanos, grant: &GrantedLease) -> PoolState {
    let p = pool();
    let claimed = with(p.fresh(at), |s| {
        s.rate.spent = rate;
        s.rate.since = at - SECOND;
        s.claims.refresh_until = at + MS;
    });
    p.apply(claimed, at, sent(at), grant).1
}

/// A lease of a second in a window of a minute ends 40 s before its window
/// does: what it needs next is more of the same window, not a lease ahead
/// of the next one (sized to a second's rate, it would hold that window's
/// tokens from now on). A lease of the window's last second asks ahead.
#[test]
fn a_lease_of_a_second_in_a_minute_asks_for_more_of_its_window_and_only_its_last_asks_ahead() {
    let p = pool();
    let mid = GrantedLease { index: M, ..grant(1, 100) };
    let mut state = minute_pool(100, T0, &mid);
    let mut now = T0;
    let claim = loop {
        now += MS.times(10);
        let (_, claim, after) = p.spend(state, now, 1);
        state = after;
        if let Some(claim) = claim {
            break claim;
        }
    };
    assert_eq!(claim.window, None, "more of this window, at {now}");
    // The window's last second: its lease ends with it, and asks ahead.
    let end = SECOND.times(60).times(M + 1);
    let last = end - SECOND;
    let tail = GrantedLease { index: M, valid: SECOND, reset: SECOND, ..grant(2, 100) };
    let (_, claim, _) = p.spend(minute_pool(100, last, &tail), last + MS.times(700), 1);
    assert_eq!(claim.map(|c| c.window), Some(Some(M + 1)), "the next window's, ahead");
    // A sliding window of a minute in sub-windows of 10 s names its
    // sub-window: a lease that ends with it asks ahead as before.
    let sub = T0 / SECOND.times(10);
    let ends = SECOND.times(10).times(sub + 1);
    let at = ends - SECOND;
    let sliding = GrantedLease { index: sub, valid: SECOND, reset: SECOND, ..grant(3, 100) };
    let (_, claim, _) = p.spend(minute_pool(100, at, &sliding), at + MS.times(700), 1);
    assert_eq!(claim.map(|c| c.window), Some(Some(sub + 1)), "the next sub-window's, ahead");
}

/// An allowance of one window (a per-minute window's) is renewed as any
/// allowance is: claimed from its last half, by the first request there,
/// and sent within a renewal round (shared with other pools' renewals),
/// not asked for only in the window's last moments, when a thin pair's
/// request rarely comes.
#[test]
fn an_allowance_of_one_window_is_renewed_from_its_last_half_within_a_round() {
    let p = pool();
    let end = SECOND.times(60).times(M + 1);
    let allowance = GrantedLease { index: M, windows: 1, valid: end - T0, reset: end - T0, ..grant(1, 60) };
    let state = minute_pool(1, T0, &allowance);
    assert!(state.renewable(), "{state:?}");
    // Before its last half: nothing to ask.
    let (_, early, state) = p.spend(state, T0 + SECOND.times(10), 1);
    assert_eq!(early, None);
    let at = T0 + SECOND.times(21);
    let (_, claim, state) = p.spend(state, at, 1);
    let claim = claim.expect("the renewal");
    assert_eq!(claim.window, Some(M + 1));
    assert!(claim.per_window);
    assert_eq!((claim.not_before, claim.send_by), (at, at + RENEWAL_ROUND));
    // Claimed once.
    let (_, again, _) = p.spend(state, at + SECOND, 1);
    assert_eq!(again, None);
}
