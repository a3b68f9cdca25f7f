//! One request's decision in progress: what every rule's step needs (the
//! store, the clock reading, the counters) and what the steps have built so
//! far (the verdict and the permit). Each rule's ruling is taken in one
//! place, and a request leaves early — denied, or waiting for the quota
//! service — through one exit that gives back what earlier rules took.

use std::ops::ControlFlow;

use crate::algorithm::{Admission, Decision, Grant, Quota, Release};
use crate::config::FailureMode;
use crate::store::Store;
use crate::time::{Nanos, SECOND};

use super::rule::Bucket;
use super::verdict::{Held, Report};
use super::{CanWait, CompiledRule, Counters, Limiter, Permit, RequestEvent, RuleEvent, Verdict};

/// A rule that applies to the request, with what it is asked.
pub(super) struct Target<'a, H> {
    /// Index of the rule in [`Limiter::rules`].
    pub index: usize,
    /// The rule.
    pub compiled: &'a CompiledRule<H>,
    /// The request's descriptor under the rule, hashed.
    pub fingerprint: u64,
    /// Units the request costs under the rule.
    pub cost: u64,
    /// The rule counts but never enforces.
    pub shadow: bool,
}

/// How one rule ruled on a request.
pub(super) enum Ruling {
    /// It decided on the units of `bucket` (`decision` `None`: it could not,
    /// and the failure mode applies); `quota` is the limit the quota service
    /// stated, for a global rule.
    Decided { decision: Option<Decision>, bucket: Bucket, quota: Option<Quota> },
    /// Its pool is empty: ask again after the refresh.
    Pending,
    /// It does not count for this request.
    Skip,
}

impl Ruling {
    /// A decision on a local table.
    pub fn local(decision: Option<Decision>, bucket: Bucket) -> Self {
        Ruling::Decided { decision, bucket, quota: None }
    }
}

/// One request's decision in progress.
pub(super) struct Pass<'a, H> {
    pub limiter: &'a Limiter<H>,
    pub store: &'a dyn Store,
    pub now: Nanos,
    pub counters: &'a mut dyn Counters<H>,
    /// Whether the request may be paused, as the host said.
    pub can_wait: CanWait,
    pub verdict: &'a mut Verdict,
    pub permit: &'a mut Permit,
    /// A rule's pool was empty: the request waits, once every rule has had
    /// its say (so that every empty pool claims its refresh now, and the
    /// claims leave together: one round trip, not one per rule).
    pub pending: bool,
}

impl<'a, H> Pass<'a, H> {
    pub fn new(
        limiter: &'a Limiter<H>,
        store: &'a dyn Store,
        now: Nanos,
        can_wait: CanWait,
        counters: &'a mut dyn Counters<H>,
        (verdict, permit): (&'a mut Verdict, &'a mut Permit),
    ) -> Self {
        Pass { limiter, store, now, counters, can_wait, verdict, permit, pending: false }
    }

    /// Takes `target`'s ruling into the verdict and permit. `Break` when the
    /// request is decided early (denied): the pass is over. A pending rule
    /// lets the others rule too (see [`Pass::pending`]).
    pub fn take(&mut self, target: &Target<H>, ruling: Ruling) -> ControlFlow<()> {
        let (decision, bucket, quota) = match ruling {
            Ruling::Skip => return ControlFlow::Continue(()),
            // A shadow rule never holds a request back.
            Ruling::Pending if target.shadow => return ControlFlow::Continue(()),
            Ruling::Pending if self.can_wait == CanWait::NoRoom => {
                self.counters.rule(target.compiled, RuleEvent::Limited);
                return self.refuse_wait(SECOND);
            }
            Ruling::Pending => {
                self.pending = true;
                return ControlFlow::Continue(());
            }
            Ruling::Decided { decision, bucket, quota } => (decision, bucket, quota),
        };
        let Some(decision) = decision else {
            self.verdict.failed = true;
            if self.limiter.settings.failure_mode == FailureMode::Deny && !target.shadow {
                return self.end(Admission::Denied { retry_after: Nanos::ZERO }, None);
            }
            return ControlFlow::Continue(());
        };
        let report = Report { rule: target.index, decision, quota };
        if decision.allowed() {
            let delayed = !target.shadow && decision.delay() > Nanos::ZERO;
            if delayed && decision.delay() > self.verdict.delay() {
                self.verdict.admission = Admission::Delayed(decision.delay());
            }
            let grant = Grant { cost: target.cost, at: self.now };
            let fingerprint = target.fingerprint;
            self.permit.push(Held { rule: target.index, bucket, fingerprint, grant, delayed });
            self.verdict.report = Some(Report::more_restrictive(self.verdict.report, report));
        } else if target.shadow {
            self.counters.rule(target.compiled, RuleEvent::ShadowLimited);
            self.verdict.shadow_limited = self.verdict.shadow_limited.or(Some(target.index));
        } else {
            self.counters.rule(target.compiled, RuleEvent::Limited);
            return self.end(Admission::Denied { retry_after: decision.retry_after() }, Some(report));
        }
        ControlFlow::Continue(())
    }

    /// The one early exit: what earlier rules took goes back, and the
    /// request is told `admission` with `report`.
    fn end(&mut self, admission: Admission, report: Option<Report>) -> ControlFlow<()> {
        let permit = std::mem::take(self.permit);
        self.limiter.release(self.store, self.now, permit, Release::Undo, self.counters);
        self.verdict.admission = admission;
        self.verdict.report = report;
        self.verdict.checks.clear();
        ControlFlow::Break(())
    }

    /// A request that would wait but cannot (see [`CanWait::NoRoom`]) is
    /// denied, to come back after `retry_after`, and takes nothing.
    fn refuse_wait(&mut self, retry_after: Nanos) -> ControlFlow<()> {
        self.counters.request(RequestEvent::NoRoomToWait);
        self.end(Admission::Denied { retry_after }, self.verdict.report)
    }

    /// Completes the verdict and permit once every rule has ruled: admissions are
    /// counted, unless check-mode rules are still to be asked (then the
    /// request is pending, and [`Limiter::settle`] counts them). A request
    /// that would wait and cannot is denied.
    pub fn finish(mut self) {
        if self.pending {
            // What the other rules took goes back; the request is decided
            // again once the refreshes have answered.
            let _ = self.end(Admission::Pending, self.verdict.report);
            return self.ended();
        }
        if !self.verdict.checks.is_empty() {
            if self.can_wait == CanWait::NoRoom {
                let _ = self.refuse_wait(SECOND);
                return self.ended();
            }
            self.verdict.deferred_delay = self.verdict.delay();
            self.verdict.admission = Admission::Pending;
            return;
        }
        if let (Admission::Delayed(delay), CanWait::NoRoom) = (self.verdict.admission, self.can_wait) {
            for held in self.permit.held().filter(|held| held.delayed) {
                if let Some(compiled) = self.limiter.rules.get(held.rule) {
                    self.counters.rule(compiled, RuleEvent::Limited);
                }
            }
            let _ = self.refuse_wait(delay);
            return self.ended();
        }
        self.limiter.count_admitted(self.permit, self.counters);
        Limiter::count_verdict(self.verdict, self.counters);
    }

    /// Counts the verdict of a pass that ended early (its permit is empty).
    pub fn ended(self) {
        Limiter::count_verdict(self.verdict, self.counters);
    }
}
