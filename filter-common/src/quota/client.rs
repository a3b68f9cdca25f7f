//! The quota service, as a host calls it: what is queued is sent, answers
//! are read by the kind of call they answer, grants become leases, check
//! answers finish their request, and a call that fails brings the rules'
//! fall-back in. Every decision about the calls is in
//! `floodgate_core::global`; a build's host only sends a call and counts
//! ([`QuotaHost`]).

use std::cell::RefCell;
use std::fmt::Debug;
use std::hash::Hash;

use floodgate_core::global::calls::{self, Call, CallError, CheckAnswer, Refresh};
use floodgate_core::global::settings::QuotaService;
use floodgate_core::lease::pool::{Applied, GrantedLease};
use floodgate_core::limiter::{Counters, Limiter, Permit, Verdict};
use floodgate_core::store::Store;
use floodgate_core::time::Nanos;

use super::callouts::{Callout, Callouts, Outgoing, StatusCall};
use crate::log::RateLimitedLog;
use crate::metrics::Counter;

/// What the quota client asks of the host it runs in: the wasm build's
/// worker (its calls leave from the worker's root context), the native
/// build's configuration on Envoy's main thread (leases, returns, probes)
/// or one request's stream (its check).
pub trait QuotaHost {
    /// The host's id for a call in flight.
    type Token: Copy + Eq + Hash + Debug;
    /// The host data of the limiter's rules (their metrics).
    type Rule;

    /// The limiter, as this host holds it.
    fn limiter(&self) -> &Limiter<Self::Rule>;

    /// The buckets, as the limiter's store.
    fn store(&self) -> impl Store + '_;

    /// Where the limiter counts what happens.
    fn counters(&self) -> impl Counters<Self::Rule> + '_;

    /// The wall clock.
    fn now(&self) -> Nanos;

    /// The calls queued and in flight.
    fn callouts(&self) -> &RefCell<Callouts<Self::Token>>;

    /// Failed calls, logged at most once a second.
    fn callout_log(&self) -> &RateLimitedLog;

    /// Adds `by` to `counter`.
    fn count(&self, counter: Counter, by: u64);

    /// Counts a failed call by its kind.
    fn count_failed_callout(&self, why: &CallError);

    /// Sends `call` to `cluster`, to be answered within `timeout`; its
    /// token, or why the host did not send it.
    fn dispatch(&self, cluster: &str, call: &Call, timeout: Nanos) -> Result<Self::Token, String>;

    /// The check-mode rules of request `context_id` have their final
    /// verdict (`permit`: what its rules hold): the request goes on, or is
    /// answered, or gives `permit` back if its client has gone.
    fn checked(&self, context_id: u32, verdict: Verdict, permit: Permit, now: Nanos);

    /// A return of unspent tokens was answered (or failed).
    fn return_settled(&self) {}

    /// A rule switched into or out of its fall-back, or notices of keys
    /// near their limit arrived: what every worker reads from the store.
    /// (The wasm build's workers read them on their tick.)
    fn modes_changed(&self) {}
}

/// Records the outcome of a call for global rule `rule`; tells the host
/// when the rule switched mode.
fn record<H: QuotaHost>(host: &H, now: Nanos, rule: usize, succeeded: bool) {
    if host.limiter().record_callout(&host.store(), now, rule, succeeded) {
        host.modes_changed();
    }
}

/// Sends `call`, remembering it as `callout`; a call the host would not
/// send fails at once.
fn send<H: QuotaHost>(host: &H, service: &QuotaService, call: &Call, callout: Callout) {
    match host.dispatch(&service.cluster, call, service.timeout) {
        Ok(token) => {
            host.count(Counter::CalloutsSent, 1);
            host.callouts().borrow_mut().sent(token, callout);
        }
        Err(why) => callout_failed(host, callout, &CallError::NotSent(why)),
    }
}

/// Probes the quota service once, first thing: Envoy refuses at once a call
/// to a cluster it does not have, and a misspelt `global.cluster` must be
/// said plainly, not only counted. (`envoy --mode validate` makes no call,
/// so this cannot be a configuration check.)
pub fn check_cluster<H: QuotaHost>(host: &H, service: &QuotaService) {
    match host.dispatch(&service.cluster, &service.probe_call(), service.timeout) {
        Ok(token) => {
            host.count(Counter::CalloutsSent, 1);
            host.callouts().borrow_mut().sent(token, Callout::Status(StatusCall::Hello));
        }
        Err(why) => {
            log::error!(
                "floodgate: global.cluster {:?} cannot be called ({why}): is it a cluster of Envoy's configuration? Global rules use their fall-back",
                service.cluster
            );
            let now = host.now();
            for rule in 0..host.limiter().rules().len() {
                record(host, now, rule, false);
            }
            host.count_failed_callout(&CallError::NotSent(why));
        }
    }
}

/// Probes the quota service once for each rule in fall-back whose next
/// probe is due (one host at a time claims each, see
/// `Limiter::due_probes`); the answer switches the rule back.
pub fn send_due_probes<H: QuotaHost>(host: &H, service: &QuotaService, now: Nanos) {
    let due = host.limiter().due_probes(&host.store(), now);
    for rule in due {
        send(host, service, &service.probe_call(), Callout::Status(StatusCall::Probe(rule)));
    }
}

/// Gives back every pool's unspent tokens as a configuration goes away;
/// the number of calls made.
pub fn give_back_all<H: QuotaHost>(host: &H) -> usize {
    let limiter = host.limiter();
    let Some(service) = limiter.quota_service() else { return 0 };
    let unspent = limiter.take_unspent(&host.store(), host.now());
    let mut sent = 0;
    for chunk in unspent.chunks(calls::MAX_ITEMS) {
        let tokens = chunk.iter().map(|(_, t)| t).sum();
        if let Ok(token) = host.dispatch(&service.cluster, &service.return_call(chunk), service.timeout) {
            host.count(Counter::CalloutsSent, 1);
            host.callouts().borrow_mut().sent(token, Callout::Status(StatusCall::Returns(tokens)));
            sent += 1;
        }
    }
    sent
}

/// Sends everything queued for the quota service that must leave now.
pub fn send_queued<H: QuotaHost>(host: &H) {
    let Some(service) = host.limiter().quota_service() else { return };
    let now = host.now();
    let outgoing = host.callouts().borrow_mut().take_outgoing(now);
    send_outgoing(host, service, outgoing, now);
}

/// Sends request `context_id`'s queued check, and nothing else: from a
/// host whose calls are its current request's, so that the answer comes
/// back to that request (and is cancelled with it).
pub fn send_check<H: QuotaHost>(host: &H, context_id: u32) {
    let Some(service) = host.limiter().quota_service() else { return };
    let outgoing = host.callouts().borrow_mut().take_check(context_id);
    send_outgoing(host, service, outgoing, host.now());
}

/// Sends each of `outgoing` as its call.
fn send_outgoing<H: QuotaHost>(host: &H, service: &QuotaService, outgoing: Vec<Outgoing>, now: Nanos) {
    for call in outgoing {
        let (request, callout) = match call {
            Outgoing::Leases(mut refreshes) => {
                // The grants count from here (see `Refresh::sent`).
                refreshes.iter_mut().for_each(|refresh| refresh.sent = now);
                (service.lease_call(&refreshes), Callout::Leases(refreshes))
            }
            Outgoing::Returns(returns) => {
                let tokens = returns.iter().map(|(_, t)| t).sum();
                (service.return_call(&returns), Callout::Status(StatusCall::Returns(tokens)))
            }
            Outgoing::Check { context_id, indices, hits } => {
                let callouts = host.callouts().borrow();
                let Some(job) = callouts.job(context_id) else { continue };
                let items: Vec<_> = indices.iter().filter_map(|&i| job.verdict.checks.get(i)).collect();
                (service.check_call(&items, hits), Callout::Check { context_id, indices })
            }
        };
        send(host, service, &request, callout);
    }
}

/// Handles the answer to call `token`, if it is one of this host's; true
/// when it answered a lease call (requests waiting for a refill may go on).
/// `status` reads the answer's status (`None` for a reset stream); it is
/// called only when the body alone does not settle the call.
pub fn answer<H: QuotaHost>(
    host: &H,
    token: H::Token,
    status: impl FnOnce() -> Option<u16>,
    body: Result<&[u8], CallError>,
) -> bool {
    let Some(callout) = host.callouts().borrow_mut().answered(token) else { return false };
    let refilled = matches!(callout, Callout::Leases(_));
    answered(host, callout, status, body);
    refilled
}

/// Handles the answer to `callout`: each kind of call reads its own
/// answer; one that is not usable fails the call. `status` is called only
/// when the body alone does not settle the call (see [`calls::read_checks`]).
pub fn answered<H: QuotaHost>(
    host: &H,
    callout: Callout,
    status: impl FnOnce() -> Option<u16>,
    body: Result<&[u8], CallError>,
) {
    let now = host.now();
    let failed = match callout {
        Callout::Leases(refreshes) => match body.and_then(|body| calls::read_leases(status, body, &refreshes)) {
            Ok(answer) => {
                if !answer.near.is_empty() {
                    host.limiter().heard_near(&host.store(), now, &answer.near);
                    host.modes_changed();
                }
                leases_granted(host, &refreshes, answer.grants, now);
                None
            }
            Err(why) => Some((Callout::Leases(refreshes), why)),
        },
        Callout::Check { context_id, indices } => {
            match body.and_then(|body| calls::read_checks(status, body, indices.len())) {
                Ok(answers) => {
                    settle(host, context_id, &indices, Some(answers), now);
                    None
                }
                Err(why) => Some((Callout::Check { context_id, indices }, why)),
            }
        }
        Callout::Status(call) => match calls::read_probe(status()) {
            Ok(()) => {
                acknowledged(host, call, now);
                None
            }
            Err(why) => Some((Callout::Status(call), why)),
        },
    };
    match failed {
        None => host.count(Counter::CalloutsOk, 1),
        Some((callout, why)) => callout_failed(host, callout, &why),
    }
}

/// Applies the grants of a lease call. A lease the service refused
/// without deciding it ends its pool's claim and counts as a failed call
/// for its rule (which falls back after enough of them), not as a limit.
pub fn leases_granted<H: QuotaHost>(
    host: &H,
    refreshes: &[Refresh],
    grants: Vec<Result<GrantedLease, String>>,
    now: Nanos,
) {
    let limiter = host.limiter();
    for (refresh, grant) in refreshes.iter().zip(grants) {
        let grant = match grant {
            Ok(grant) => grant,
            Err(why) => {
                host.callout_log().record(now, log::Level::Warn, || {
                    format!("quota service refused a lease, its rule falls back: {why}")
                });
                limiter.abandon_lease(&host.store(), now, refresh, &mut host.counters());
                record(host, now, refresh.rule, false);
                continue;
            }
        };
        record(host, now, refresh.rule, true);
        host.count(Counter::TokensLeased, grant.granted);
        let applied = limiter.apply_lease(&host.store(), now, refresh, &grant, &mut host.counters());
        let mut callouts = host.callouts().borrow_mut();
        match applied {
            // What the pool does not keep of the replaced leases.
            Some(Applied::Replaced(left)) => {
                host.count(Counter::TokensExpired, left.expired);
                for (lease, tokens) in left.returns {
                    callouts.give_back(lease, tokens, now);
                }
            }
            // A newer lease is in place, or the pool could not take it: the
            // grant goes back whole.
            Some(Applied::Stale) | None if grant.granted > 0 => callouts.give_back(grant.lease, grant.granted, now),
            Some(Applied::Stale) | None => {}
            Some(Applied::Duplicate | Applied::Reported) => {}
        }
    }
}

/// A call answered by its status alone succeeded.
pub fn acknowledged<H: QuotaHost>(host: &H, call: StatusCall, now: Nanos) {
    match call {
        StatusCall::Returns(tokens) => {
            host.count(Counter::TokensReturned, tokens);
            host.return_settled();
        }
        StatusCall::Probe(rule) => record(host, now, rule, true),
        StatusCall::Hello => {}
    }
}

/// Records a check call's answers and, once all its calls have answered,
/// finishes the request with the verdict they settle.
pub fn settle<H: QuotaHost>(
    host: &H,
    context_id: u32,
    indices: &[usize],
    answers: Option<Vec<CheckAnswer>>,
    now: Nanos,
) {
    let done = host.callouts().borrow_mut().record_check(context_id, indices, answers);
    let Some((job, answers)) = done else { return };
    let (context_id, verdict, permit) = job.into_parts();
    let limiter = host.limiter();
    let (verdict, permit) =
        limiter.settle(&host.store(), now, verdict, permit, answers.as_deref(), &mut host.counters());
    host.checked(context_id, verdict, permit, now);
}

/// A call got no usable answer: pools' claims end, rules fall back.
pub fn callout_failed<H: QuotaHost>(host: &H, callout: Callout, why: &CallError) {
    let now = host.now();
    host.count_failed_callout(why);
    host.callout_log().record(now, log::Level::Warn, || format!("quota service call failed, rules fall back: {why}"));
    match callout {
        Callout::Leases(refreshes) => {
            for refresh in &refreshes {
                host.limiter().abandon_lease(&host.store(), now, refresh, &mut host.counters());
                record(host, now, refresh.rule, false);
            }
        }
        // Tokens not given back are lost to this window: never more admitted.
        Callout::Status(StatusCall::Returns(_)) => host.return_settled(),
        // A failed first call says nothing the next calls will not.
        Callout::Status(StatusCall::Hello) => {}
        Callout::Status(StatusCall::Probe(rule)) => record(host, now, rule, false),
        Callout::Check { context_id, indices } => {
            let rules: Vec<usize> = host
                .callouts()
                .borrow()
                .job(context_id)
                .map(|job| indices.iter().filter_map(|&i| job.verdict.checks.get(i).map(|c| c.rule)).collect())
                .unwrap_or_default();
            for rule in rules {
                record(host, now, rule, false);
            }
            settle(host, context_id, &indices, None, now);
        }
    }
}

/// Ends what a host that goes away left unanswered or unsent: every claim
/// it carried ends (so another request may claim the refresh at once),
/// and its queued returns are handed back for another host to send.
pub fn abandon_unfinished<H: QuotaHost>(host: &H) -> Vec<(u64, u64)> {
    let unfinished = host.callouts().borrow_mut().take_all();
    let now = host.now();
    let in_flight = unfinished.in_flight.into_iter().flat_map(|callout| match callout {
        Callout::Leases(refreshes) => refreshes,
        Callout::Status(_) | Callout::Check { .. } => Vec::new(),
    });
    for refresh in unfinished.refreshes.iter().cloned().chain(in_flight) {
        host.limiter().abandon_lease(&host.store(), now, &refresh, &mut host.counters());
    }
    unfinished.returns
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{FakeWorker, ONE_TOKEN, T0};

    const GLOBAL: &str = r#"{"global": {"cluster": "quota", "domain": "edge", "timeout": "300ms", "max_wait": "200ms"},
        "rules": [{"name": "fleet", "scope": "global",
            "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "api_key"}}],
            "fallback": "allow"}]}"#;

    /// The host hears of a rule switching into its fall-back and back, not
    /// of each failure in between.
    #[test]
    fn a_rule_that_switches_mode_tells_the_host_once_each_way() {
        let worker = FakeWorker::new(GLOBAL);
        let service = worker.limiter.quota_service().unwrap().clone();
        worker.can_send.set(false);
        check_cluster(&worker, &service);
        assert_eq!((worker.failed.get(), worker.modes_changed.get()), (1, 1));
        assert!(worker.limiter.rules()[0].in_fallback());
        worker.can_send.set(true);
        worker.clock.advance(Nanos::from_secs(1));
        send_due_probes(&worker, &service, worker.now());
        assert!(!answer(&worker, 1, || Some(503), Ok(b"")), "a probe refills nothing");
        assert_eq!(worker.modes_changed.get(), 1, "deeper in its fall-back, not switched");
        worker.clock.advance(Nanos::from_secs(2));
        send_due_probes(&worker, &service, worker.now());
        assert_eq!(worker.calls.borrow().len(), 2);
        answer(&worker, 2, || Some(200), Ok(b""));
        assert_eq!(worker.modes_changed.get(), 2);
        assert!(!worker.limiter.rules()[0].in_fallback());
    }

    /// A host that goes away with a lease call unanswered and a return
    /// queued: the claim ends (the next request claims again at once), the
    /// return is handed back for another host to send, and the call's
    /// answer is no longer its.
    #[test]
    fn what_a_host_leaves_undone_ends_its_claims_and_hands_back_its_returns() {
        let worker = FakeWorker::new(GLOBAL);
        let _waiting = worker.arrive(1, "a");
        let handed = std::mem::take(&mut *worker.handed.borrow_mut());
        worker.callouts.borrow_mut().refresh(handed, T0);
        send_queued(&worker);
        worker.callouts.borrow_mut().give_back(9, 3, T0);
        let _also_waiting = worker.arrive(2, "a");
        assert!(worker.handed.borrow().is_empty(), "one refresh in flight at a time");
        assert_eq!(abandon_unfinished(&worker), [(9, 3)]);
        let _claims_again = worker.arrive(3, "a");
        assert_eq!(worker.handed.borrow().len(), 1, "the claim ended: the next request claims");
        assert!(!answer(&worker, 1, || Some(200), Ok(ONE_TOKEN)), "the call was forgotten");
    }

    /// A lease the service refused without deciding it (its caller's share
    /// of the lease records) is not a limit: the claim ends, so the next
    /// request claims again, and the rule counts a failed call, falling
    /// back as it would if the calls failed.
    #[test]
    fn a_refused_lease_ends_its_claim_and_counts_as_a_failed_call() {
        const REFUSED: &[u8] = br#"{"leases": [{"code": "ok", "granted": 0, "valid_ms": 0, "limit": 100,
            "window_ms": 60000, "reset_ms": 1000, "refused": "the caller holds its share of the lease records"}]}"#;
        let worker = FakeWorker::new(GLOBAL);
        let mut token = 0;
        for request in 1..=10 {
            let _waiting = worker.arrive(request, "a");
            if worker.limiter.rules()[0].in_fallback() {
                break;
            }
            let handed = std::mem::take(&mut *worker.handed.borrow_mut());
            assert_eq!(handed.len(), 1, "request {request} claims: the last claim ended");
            worker.callouts.borrow_mut().refresh(handed, worker.now());
            send_queued(&worker);
            token += 1;
            assert!(answer(&worker, token, || Some(200), Ok(REFUSED)));
            worker.clock.advance(Nanos::from_millis(10));
        }
        assert!(worker.limiter.rules()[0].in_fallback(), "refused leases put the rule in its fall-back");
        assert!(worker.modes_changed.get() >= 1);
    }
}
