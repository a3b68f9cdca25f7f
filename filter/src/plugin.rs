//! What every request of one configuration on one worker shares, and the
//! request's path through it: deciding, acting on what becomes of it (as
//! [`crate::outcome`] decides: going on, answering, pausing, resuming,
//! giving back), giving a permit back when it ends, counting. The quota
//! service's side of it is in [`crate::quota`].

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use floodgate_core::algorithm::Release;
use floodgate_core::limiter::{CanWait, Limiter, Permit, Verdict};
use floodgate_core::time::Nanos;

use crate::host::{HeaderReads, Host, HostRequest, SharedData};
use crate::metrics::{self, Counter, Metrics, RuleMetrics};
use crate::outcome::{self, Event, Outcome, Site};
use crate::quota::Callouts;
use crate::waiting::{Shared, Stage, Wait, Waiter, Waiting};
use floodgate_filter_common::log::RateLimitedLog;

/// How often a worker with global rules looks at their mode and probes a
/// failing service, when nothing else needs a tick.
pub(crate) const GLOBAL_TICK: Duration = Duration::from_millis(50);

/// What every request of a plugin on one worker shares: built once per
/// configuration.
pub(crate) struct Plugin<H> {
    /// The host every call goes to.
    pub(crate) host: H,
    pub(crate) limiter: Limiter<RuleMetrics>,
    /// The root's shared queue (see [`Plugin::post`]).
    pub(crate) queue: Option<u32>,
    /// A post to the root is on its way: later requests need not post again.
    pub(crate) posted: Cell<bool>,
    /// Counts were added since the metrics were last flushed (a flush tick
    /// is scheduled).
    pub(crate) unflushed: Cell<bool>,
    /// The header values a request read, kept between requests so that
    /// reading them allocates nothing.
    pub(crate) header_reads: RefCell<HeaderReads>,
    pub(crate) metrics: Metrics,
    pub(crate) shadow_log: RateLimitedLog,
    pub(crate) callout_log: RateLimitedLog,
    /// Requests this worker paused.
    pub(crate) waiting: RefCell<Waiting>,
    /// This worker's calls to the quota service.
    pub(crate) callouts: RefCell<Callouts>,
    /// While this configuration goes away: returns not answered yet.
    pub(crate) closing: Cell<Option<usize>>,
}

impl<H: Host> Plugin<H> {
    /// A plugin for `limiter` on one worker, over `host`: `queue` is the
    /// root's shared queue, and `metrics` were defined with `host`.
    pub(crate) fn new(host: H, limiter: Limiter<RuleMetrics>, metrics: Metrics, queue: Option<u32>) -> Self {
        let waiting = RefCell::new(Waiting::new(limiter.max_delayed_per_worker()));
        Plugin {
            host,
            limiter,
            queue,
            posted: Cell::new(false),
            unflushed: Cell::new(false),
            header_reads: RefCell::default(),
            metrics,
            shadow_log: RateLimitedLog::default(),
            callout_log: RateLimitedLog::default(),
            waiting,
            callouts: RefCell::new(Callouts::default()),
            closing: Cell::new(None),
        }
    }

    /// Shared data, as the core's store.
    pub(crate) fn store(&self) -> SharedData<'_, H> {
        SharedData(&self.host)
    }

    /// Gives back a permit's units for `why`; true when it had any to give
    /// back (the clock is read only then).
    pub(crate) fn release(&self, permit: Permit, why: Release) -> bool {
        if !self.limiter.needs_release(&permit, why) {
            return false;
        }
        self.limiter.release(&self.store(), self.host.now(), permit, why, &mut self.metrics.counters());
        true
    }

    /// Decides the request of context `context_id` and acts on the verdict.
    /// Called at [`Site::Handler`] by the request's own handler, and at
    /// [`Site::Root`] by the worker's root for a request that waits for a
    /// refill (with the effective context set to it; `waited_out` once its
    /// wait is over).
    pub(crate) fn decide(&self, site: Site, request: RequestRef<'_>, now: Nanos, waited_out: bool) -> Outcome {
        let limiter = &self.limiter;
        let reads = std::mem::take(&mut *self.header_reads.borrow_mut());
        let mut read = HostRequest::new(&self.host, limiter.header_names(), reads);
        let can_wait = if waited_out {
            CanWait::WaitedOut
        } else if self.waiting.borrow().is_full() {
            CanWait::NoRoom
        } else {
            CanWait::Yes
        };
        let (mut verdict, permit) =
            limiter.check_waited(&self.store(), now, &mut read, can_wait, &mut self.metrics.counters());
        *self.header_reads.borrow_mut() = read.into_reads();
        if !verdict.refreshes.is_empty() {
            self.metrics.count(Counter::Refreshes, verdict.refreshes.len() as u64);
            self.callouts.borrow_mut().refresh(std::mem::take(&mut verdict.refreshes), now);
        }
        let max_wait = limiter.quota_service().map_or(Nanos::ZERO, |s| s.max_wait);
        let outcome = outcome::next(site, Event::Decided { verdict: &verdict, since: request.since, now, max_wait });
        self.act(request, outcome, Some(verdict), permit, now);
        outcome
    }

    /// Carries out `outcome` for `request` (the effective context): the
    /// only code that pauses, resumes, answers or gives back a request.
    /// `verdict` is the verdict on it and `permit` what it took, if it was
    /// just decided; a request decided earlier (its shaper's delay over)
    /// holds its permit and headers in its state already, and one whose
    /// client has gone hands over only what the filter holds for it outside
    /// its state. Returns false when the host refused to resume it.
    fn act(
        &self,
        request: RequestRef<'_>,
        outcome: Outcome,
        verdict: Option<Verdict>,
        permit: Permit,
        now: Nanos,
    ) -> bool {
        let RequestRef { context_id, state, since } = request;
        match (outcome, verdict) {
            (Outcome::Pause(wait), Some(verdict)) => {
                // The limiter was told whether there is room: a request it lets wait has it.
                self.waiting.borrow_mut().add(Waiter { context_id, since, wait, request: Rc::clone(state) });
                if let Wait::Answer = wait {
                    self.callouts.borrow_mut().check(context_id, verdict, permit);
                } else {
                    if let Wait::Delay { .. } = wait {
                        self.limiter.render_headers(&verdict, &mut state.borrow_mut().headers);
                    }
                    state.borrow_mut().permit = permit;
                }
                state.borrow_mut().stage = Stage::Waiting;
            }
            (Outcome::Continue | Outcome::Resume | Outcome::Reply, Some(verdict)) => {
                self.finish(state, outcome, verdict, permit, now);
                if let Outcome::Resume = outcome {
                    return self.resume();
                }
            }
            // A paused request decided before: it goes on as it was told.
            (Outcome::Resume, None) => {
                if !self.resume() {
                    return false;
                }
                state.borrow_mut().stage = Stage::Passed;
            }
            // What its client took goes back undone; a permit still in its
            // state goes back when its stream ends.
            (Outcome::GiveBack, _) => self.give_back(permit),
            // Not reached: a verdict that pauses or finishes a request comes with it.
            (Outcome::Continue | Outcome::Reply | Outcome::Pause(_), None) => {}
        }
        true
    }

    /// Records a final verdict in a request's state, and answers it with a
    /// local reply if it is limited.
    fn finish(&self, state: &Shared, outcome: Outcome, verdict: Verdict, permit: Permit, now: Nanos) {
        let limiter = &self.limiter;
        floodgate_filter_common::log::shadow_limited(&self.shadow_log, limiter, &verdict, now);
        let mut state = state.borrow_mut();
        limiter.render_headers(&verdict, &mut state.headers);
        state.permit = permit;
        if outcome != Outcome::Reply {
            state.stage = Stage::Passed;
            return;
        }
        state.stage = Stage::Limited;
        let response = limiter.response();
        if let Err(status) = self.host.send_local_reply(response.status, &state.headers, response.body.as_bytes()) {
            log::warn!("floodgate: could not send the limited response: {status:?}");
        }
    }

    /// Resumes the effective (paused) request; false when the host refused.
    fn resume(&self) -> bool {
        match self.host.resume_request() {
            Ok(()) => true,
            Err(status) => {
                log::warn!("floodgate: could not resume a request: {status:?}");
                false
            }
        }
    }

    /// Makes paused request `context_id` the effective context, from the
    /// root: only this worker can resume its own requests, and a client
    /// that has gone makes this fail ([`Event::Gone`]).
    fn switch_to(&self, context_id: u32) -> bool {
        self.host.set_effective_context(context_id).is_ok()
    }

    /// Finishes a paused request from the root context with the verdict
    /// settled from its check's answer: switches to it (`waiter`, if it
    /// still waits), and resumes it or answers it as limited; gives its
    /// permit back if its client has gone.
    pub(crate) fn finish_paused(&self, waiter: Option<&Waiter>, verdict: Verdict, permit: Permit, now: Nanos) {
        let event = match waiter {
            Some(waiter) if self.switch_to(waiter.context_id) => {
                Event::Answered { verdict: &verdict, since: waiter.since, now }
            }
            _ => Event::Gone,
        };
        match (outcome::next(Site::Root, event), waiter) {
            (outcome, Some(waiter)) => {
                self.act(RequestRef::of(waiter), outcome, Some(verdict), permit, now);
            }
            (_, None) => self.give_back(permit),
        }
    }

    /// What a request whose client has gone took goes back, undone: it was
    /// never served.
    fn give_back(&self, permit: Permit) {
        self.release(permit, Release::Undo);
    }

    /// A request's stream ended (completed, reset or failed): its permit
    /// goes back. One still waiting was never served: its client has gone,
    /// and what it took (and what its check holds) is undone; a served one
    /// releases what it held while in flight.
    pub(crate) fn ended(&self, context_id: u32, state: &Shared) {
        let waiting = state.borrow().stage == Stage::Waiting;
        let permit = std::mem::take(&mut state.borrow_mut().permit);
        let counted = if waiting && self.waiting.borrow_mut().remove(context_id).is_some() {
            self.metrics.count(Counter::DelayAbandoned, 1);
            let outcome = outcome::next(Site::Handler, Event::Gone);
            let checked = self.callouts.borrow_mut().forget(context_id);
            // Giving back reads neither when it arrived nor the time.
            let request = RequestRef { context_id, state, since: Nanos::ZERO };
            for permit in checked.into_iter().chain([permit]) {
                self.act(request, outcome, None, permit, Nanos::ZERO);
            }
            true
        } else {
            self.release(permit, Release::Done)
        };
        if counted {
            self.counted(self.host.now());
        }
    }

    /// Counts were added on a request's path: the first since the last flush
    /// schedules the tick that flushes them.
    pub(crate) fn counted(&self, now: Nanos) {
        if !self.unflushed.replace(true) {
            schedule_ticks(self, now);
        }
    }

    /// The end of a root-context callback: counts reach Envoy, and the tick
    /// is set for what remains to do.
    pub(crate) fn settle_root(&self, now: Nanos) {
        self.metrics.flush(&self.host, &self.limiter);
        self.unflushed.set(false);
        schedule_ticks(self, now);
    }

    /// Has the root send what is queued for the quota service at once: a
    /// request's handler posts to the root's shared queue (once, until the
    /// root has run), and the root dispatches in `on_queue_ready`. Without a
    /// queue, the root's next tick (1 ms) sends them.
    pub(crate) fn post(&self, now: Nanos) {
        if self.posted.get() || !self.callouts.borrow().has_outgoing(now) {
            return;
        }
        let Some(queue) = self.queue else { return };
        match self.host.enqueue(queue) {
            Ok(()) => self.posted.set(true),
            Err(status) => log::warn!("floodgate: cannot post calls to the root context: {status:?}"),
        }
    }

    /// Finishes the paused requests that are due at `now`: a shaper's delay
    /// that is over, and every request waiting for a refill (decided again
    /// on its pool; `waited_out` once its wait is over). Called from the
    /// tick, and from the answer to a lease call, which may have refilled
    /// their pools. Leaves the effective context on the last request
    /// looked at: the caller switches back to its own.
    pub(crate) fn finish_due(&self, now: Nanos, refills_only: bool) {
        let due = self.waiting.borrow_mut().take_due(now, refills_only);
        for waiter in due {
            let request = RequestRef::of(&waiter);
            if !self.switch_to(waiter.context_id) {
                // Its client has gone: on_done gave back what its state held.
                self.act(request, outcome::next(Site::Root, Event::Gone), None, Permit::default(), now);
                if let Wait::Delay { .. } = waiter.wait {
                    self.metrics.count(Counter::DelayAbandoned, 1);
                }
                continue;
            }
            match waiter.wait {
                Wait::Delay { resume_at } => {
                    let outcome = outcome::next(Site::Root, Event::DelayOver);
                    if self.act(request, outcome, None, Permit::default(), now) {
                        self.metrics.count(Counter::Delayed, 1);
                        self.metrics.count(Counter::DelayRequestedMs, (resume_at - waiter.since).ceil_millis());
                        self.metrics.count(Counter::DelayActualMs, (now - waiter.since).ceil_millis());
                    } else {
                        self.metrics.count(Counter::DelayAbandoned, 1);
                    }
                }
                Wait::Refill { deadline } => {
                    let outcome = self.decide(Site::Root, request, now, now >= deadline);
                    if !matches!(outcome, Outcome::Pause(_)) {
                        self.metrics.count(Counter::RefillWaits, 1);
                        self.metrics.count(Counter::RefillWaitMs, (now - waiter.since).ceil_millis());
                    }
                }
                Wait::Answer => {}
            }
        }
    }
}

/// The request the filter acts on: its context, the state its handlers
/// share with the root, and when it arrived.
#[derive(Clone, Copy)]
pub(crate) struct RequestRef<'s> {
    /// Envoy's id of its context.
    pub(crate) context_id: u32,
    /// Its state.
    pub(crate) state: &'s Shared,
    /// When it arrived.
    pub(crate) since: Nanos,
}

impl<'s> RequestRef<'s> {
    /// A paused request.
    pub(crate) fn of(waiter: &'s Waiter) -> Self {
        RequestRef { context_id: waiter.context_id, state: &waiter.request, since: waiter.since }
    }
}

/// Sets this worker's tick: soon when calls are queued and not posted, or a
/// paused request is due, or calls held back must leave; every
/// [`GLOBAL_TICK`] while global rules exist;
/// within [`metrics::FLUSH_PERIOD`] while counts wait to be flushed or the
/// worker holds units taken ahead; else not at all.
pub(crate) fn schedule_ticks<H: Host>(plugin: &Plugin<H>, now: Nanos) {
    let callouts = plugin.callouts.borrow();
    let period = if callouts.has_outgoing(now) && !plugin.posted.get() {
        Some(Duration::from_millis(1))
    } else {
        // What is held back for a shared call leaves on the tick when its time comes.
        let held = callouts.hold_until().map(|until| Duration::from(until - now).max(Duration::from_millis(1)));
        [plugin.waiting.borrow().next_tick(now), held].into_iter().flatten().min()
    };
    drop(callouts);
    let global = plugin.limiter.quota_service().map(|_| GLOBAL_TICK);
    // Counts to flush, or units taken ahead to give back when they end.
    let flush = (plugin.unflushed.get() || plugin.limiter.holds_reserves()).then_some(metrics::FLUSH_PERIOD);
    let period = [period, global, flush].into_iter().flatten().min().unwrap_or(Duration::ZERO);
    if let Err(status) = plugin.host.set_tick_period(period) {
        log::warn!("floodgate: cannot schedule the tick that resumes paused requests: {status:?}");
    }
}
