//! The quota service, as one worker of a configuration calls it: what is
//! queued is sent, answers are read by the kind of call they answer, grants
//! become leases, check answers finish their request, and a call that fails
//! brings the rules' fall-back in. Every decision about the calls is in
//! `floodgate_core::global`.

use std::time::Duration;

use floodgate_core::global::calls::{self, Call, CallError, CheckAnswer, Refresh};
use floodgate_core::global::settings::QuotaService;
use floodgate_core::lease::pool::{Applied, GrantedLease};
use floodgate_core::time::Nanos;

use super::callouts::{Callout, Outgoing, StatusCall};
use crate::host::Host;
use crate::metrics::Counter;
use crate::plugin::Plugin;

impl<H: Host> Plugin<H> {
    /// Probes the quota service once, first thing: Envoy refuses at once a
    /// call to a cluster it does not have, and a misspelt `global.cluster`
    /// must be said plainly, not only counted. (`envoy --mode validate`
    /// refuses every call, so this cannot be a configuration check.)
    pub(crate) fn check_cluster(&self, service: &QuotaService) {
        match self.dispatch(&service.cluster, &service.probe_call(), service.timeout) {
            Ok(token) => {
                self.metrics.count(Counter::CalloutsSent, 1);
                self.callouts.borrow_mut().sent(token, Callout::Status(StatusCall::Hello));
            }
            Err(why) => {
                log::error!(
                    "floodgate: global.cluster {:?} cannot be called ({why}): is it a cluster of Envoy's configuration? Global rules use their fall-back",
                    service.cluster
                );
                let now = self.host.now();
                for rule in 0..self.limiter.rules().len() {
                    self.limiter.record_callout(&self.store(), now, rule, false);
                }
                self.metrics.count_failed_callout(&CallError::NotSent(why));
            }
        }
    }

    /// Probes the quota service once for each rule in fall-back whose next
    /// probe is due (one worker at a time claims each, see
    /// `Limiter::due_probes`); the answer switches the rule back.
    pub(crate) fn send_due_probes(&self, service: &QuotaService, now: Nanos) {
        for rule in self.limiter.due_probes(&self.store(), now) {
            let callout = Callout::Status(StatusCall::Probe(rule));
            match self.dispatch(&service.cluster, &service.probe_call(), service.timeout) {
                Ok(token) => {
                    self.metrics.count(Counter::CalloutsSent, 1);
                    self.callouts.borrow_mut().sent(token, callout);
                }
                Err(why) => self.callout_failed(callout, &CallError::NotSent(why)),
            }
        }
    }

    /// Gives back every pool's unspent tokens as this configuration goes
    /// away; the number of calls made.
    pub(crate) fn give_back_all(&self) -> usize {
        let Some(service) = self.limiter.quota_service() else { return 0 };
        let unspent = self.limiter.take_unspent(&self.store(), self.host.now());
        let mut sent = 0;
        for chunk in unspent.chunks(calls::MAX_ITEMS) {
            let tokens = chunk.iter().map(|(_, t)| t).sum();
            if let Ok(token) = self.dispatch(&service.cluster, &service.return_call(chunk), service.timeout) {
                self.metrics.count(Counter::CalloutsSent, 1);
                self.callouts.borrow_mut().sent(token, Callout::Status(StatusCall::Returns(tokens)));
                sent += 1;
            }
        }
        sent
    }

    /// A return was answered (or failed): once the last of a closing
    /// configuration's is, Envoy may tear the context down.
    pub(crate) fn return_settled(&self) {
        if let Some(left) = self.closing.get() {
            let left = left.saturating_sub(1);
            self.closing.set(Some(left));
            if left == 0 {
                let _ = self.host.done();
            }
        }
    }

    /// Sends everything queued for the quota service.
    pub(crate) fn send_queued(&self) {
        let Some(service) = self.limiter.quota_service() else { return };
        let now = self.host.now();
        let outgoing = self.callouts.borrow_mut().take_outgoing(now);
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
                    let callouts = self.callouts.borrow();
                    let Some(job) = callouts.job(context_id) else { continue };
                    let items: Vec<_> = indices.iter().filter_map(|&i| job.verdict.checks.get(i)).collect();
                    (service.check_call(&items, hits), Callout::Check { context_id, indices })
                }
            };
            match self.dispatch(&service.cluster, &request, service.timeout) {
                Ok(token) => {
                    self.metrics.count(Counter::CalloutsSent, 1);
                    self.callouts.borrow_mut().sent(token, callout);
                }
                Err(why) => self.callout_failed(callout, &CallError::NotSent(why)),
            }
        }
    }

    /// Handles the answer to one of this worker's calls: each kind of call
    /// reads its own answer; one that is not usable fails the call.
    pub(crate) fn answered(&self, callout: Callout, status: Option<u16>, body: Result<Vec<u8>, CallError>) {
        let now = self.host.now();
        let failed = match callout {
            Callout::Leases(refreshes) => match body.and_then(|body| calls::read_leases(status, &body, &refreshes)) {
                Ok(answer) => {
                    if !answer.near.is_empty() {
                        self.limiter.heard_near(&self.store(), now, &answer.near);
                    }
                    self.leases_granted(&refreshes, answer.grants, now);
                    None
                }
                Err(why) => Some((Callout::Leases(refreshes), why)),
            },
            Callout::Check { context_id, indices } => {
                match body.and_then(|body| calls::read_checks(status, &body, indices.len())) {
                    Ok(answers) => {
                        self.settle(context_id, &indices, Some(answers), now);
                        None
                    }
                    Err(why) => Some((Callout::Check { context_id, indices }, why)),
                }
            }
            Callout::Status(call) => match calls::read_probe(status) {
                Ok(()) => {
                    self.acknowledged(call, now);
                    None
                }
                Err(why) => Some((Callout::Status(call), why)),
            },
        };
        match failed {
            None => self.metrics.count(Counter::CalloutsOk, 1),
            Some((callout, why)) => self.callout_failed(callout, &why),
        }
    }

    /// Applies the grants of a lease call.
    pub(crate) fn leases_granted(&self, refreshes: &[Refresh], grants: Vec<GrantedLease>, now: Nanos) {
        let counters = &mut self.metrics.counters();
        for (refresh, grant) in refreshes.iter().zip(grants) {
            self.limiter.record_callout(&self.store(), now, refresh.rule, true);
            self.metrics.count(Counter::TokensLeased, grant.granted);
            let applied = self.limiter.apply_lease(&self.store(), now, refresh, &grant, counters);
            let mut callouts = self.callouts.borrow_mut();
            match applied {
                // What the pool does not keep of the replaced leases.
                Some(Applied::Replaced(left)) => {
                    self.metrics.count(Counter::TokensExpired, left.expired);
                    for (lease, tokens) in left.returns {
                        callouts.give_back(lease, tokens, now);
                    }
                }
                // A newer lease is in place, or the pool could not
                // take it: the grant goes back whole.
                Some(Applied::Stale) | None if grant.granted > 0 => callouts.give_back(grant.lease, grant.granted, now),
                Some(Applied::Stale) | None => {}
                Some(Applied::Duplicate | Applied::Reported) => {}
            }
        }
    }

    /// A call answered by its status alone succeeded.
    pub(crate) fn acknowledged(&self, call: StatusCall, now: Nanos) {
        match call {
            StatusCall::Returns(tokens) => {
                self.metrics.count(Counter::TokensReturned, tokens);
                self.return_settled();
            }
            StatusCall::Probe(rule) => self.limiter.record_callout(&self.store(), now, rule, true),
            StatusCall::Hello => {}
        }
    }

    /// Records a check call's answers and, once all its calls have
    /// answered, finishes the request with the verdict they settle.
    pub(crate) fn settle(&self, context_id: u32, indices: &[usize], answers: Option<Vec<CheckAnswer>>, now: Nanos) {
        let done = self.callouts.borrow_mut().record_check(context_id, indices, answers);
        let Some((job, answers)) = done else { return };
        let (context_id, verdict, permit) = job.into_parts();
        let counters = &mut self.metrics.counters();
        let (verdict, permit) = self.limiter.settle(&self.store(), now, verdict, permit, answers.as_deref(), counters);
        let waiter = self.waiting.borrow_mut().remove(context_id);
        self.finish_paused(waiter.as_ref(), verdict, permit, now);
    }

    /// A call got no usable answer: pools' claims end, rules fall back.
    pub(crate) fn callout_failed(&self, callout: Callout, why: &CallError) {
        let now = self.host.now();
        self.metrics.count_failed_callout(why);
        self.callout_log.record(now, log::Level::Warn, || format!("quota service call failed, rules fall back: {why}"));
        let counters = &mut self.metrics.counters();
        match callout {
            Callout::Leases(refreshes) => {
                for refresh in &refreshes {
                    self.limiter.abandon_lease(&self.store(), now, refresh, counters);
                    self.limiter.record_callout(&self.store(), now, refresh.rule, false);
                }
            }
            // Tokens not given back are lost to this window: never more admitted.
            Callout::Status(StatusCall::Returns(_)) => self.return_settled(),
            // A failed first call says nothing the next calls will not.
            Callout::Status(StatusCall::Hello) => {}
            Callout::Status(StatusCall::Probe(rule)) => self.limiter.record_callout(&self.store(), now, rule, false),
            Callout::Check { context_id, indices } => {
                let rules: Vec<usize> = self
                    .callouts
                    .borrow()
                    .job(context_id)
                    .map(|job| indices.iter().filter_map(|&i| job.verdict.checks.get(i).map(|c| c.rule)).collect())
                    .unwrap_or_default();
                for rule in rules {
                    self.limiter.record_callout(&self.store(), now, rule, false);
                }
                self.settle(context_id, &indices, None, now);
            }
        }
    }

    /// Dispatches `call` to `cluster` from the current (root) context.
    fn dispatch(&self, cluster: &str, call: &Call, timeout: Nanos) -> Result<u32, String> {
        let headers: Vec<(&str, &str)> = call.headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
        let body = (!call.body.is_empty()).then_some(call.body.as_slice());
        let timeout = Duration::from(timeout).max(Duration::from_millis(1));
        self.host
            .dispatch_call(cluster, headers, body, timeout)
            .map_err(|status| format!("Envoy refused the call to cluster {cluster:?} ({status:?})"))
    }
}
