//! What every request of one configuration on one worker shares, and the
//! request's path through it: deciding, answering or pausing, finishing a
//! paused request, giving a permit back, counting. The quota service's side
//! of it is in [`crate::quota`].

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use floodgate_core::algorithm::{Admission, Release};
use floodgate_core::limiter::{CanWait, Limiter, Permit, Verdict};
use floodgate_core::time::{Nanos, SECOND};
use proxy_wasm::hostcalls;
use proxy_wasm::types::Action;

use crate::host::{self, HeaderReads, HostRequest, SharedData};
use crate::metrics::{self, increment, Metrics, RuleMetrics};
use crate::quota::Callouts;
use crate::waiting::{Shared, Stage, Wait, Waiter, Waiting};

/// How often a worker with global rules looks at their mode and probes a
/// failing service, when nothing else needs a tick.
pub(crate) const GLOBAL_TICK: Duration = Duration::from_millis(50);

/// What every request of a plugin on one worker shares: built once per
/// configuration.
pub(crate) struct Plugin {
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
    /// A limited reply's serialized headers, kept between replies.
    pub(crate) reply_buffer: RefCell<Vec<u8>>,
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

impl Plugin {
    /// Gives back a permit's units for `why`; true when it had any to give
    /// back (the clock is read only then).
    pub(crate) fn release(&self, permit: Permit, why: Release) -> bool {
        if !self.limiter.needs_release(&permit, why) {
            return false;
        }
        self.limiter.release(&SharedData, host::now(), permit, why, &mut self.metrics.counters());
        true
    }

    /// Decides the request of context `context_id` and acts on the verdict.
    /// Called by the request's own handler, and by the worker's tick for a
    /// request that waits for a refill (with the effective context set to
    /// it; `waited_out` once its wait is over).
    pub(crate) fn decide(&self, context_id: u32, state: &Shared, since: Nanos, now: Nanos, waited_out: bool) -> Action {
        let limiter = &self.limiter;
        let reads = std::mem::take(&mut *self.header_reads.borrow_mut());
        let mut request = HostRequest::new(limiter.header_names(), reads);
        let can_wait = if waited_out {
            CanWait::WaitedOut
        } else if self.waiting.borrow().is_full() {
            CanWait::NoRoom
        } else {
            CanWait::Yes
        };
        let (mut verdict, permit) =
            limiter.check_waited(&SharedData, now, &mut request, can_wait, &mut self.metrics.counters());
        *self.header_reads.borrow_mut() = request.into_reads();
        if !verdict.refreshes.is_empty() {
            increment(&self.metrics.refreshes, verdict.refreshes.len() as u64);
            self.callouts.borrow_mut().refresh(std::mem::take(&mut verdict.refreshes), now);
        }
        let wait = match verdict.admission {
            Admission::Delayed(delay) => Wait::Delay { resume_at: now + delay },
            Admission::Pending if !verdict.checks.is_empty() => Wait::Answer,
            Admission::Pending => {
                Wait::Refill { deadline: since + limiter.quota_service().map_or(Nanos::ZERO, |s| s.max_wait) }
            }
            Admission::Now | Admission::Denied { .. } => return self.finish(state, verdict, permit, now),
        };
        // The limiter was told whether there is room: a request it lets wait has it.
        self.waiting.borrow_mut().add(Waiter { context_id, since, wait, request: Rc::clone(state) });
        if let Wait::Answer = wait {
            self.callouts.borrow_mut().check(context_id, verdict, permit);
        } else {
            if let Wait::Delay { .. } = wait {
                limiter.render_headers(&verdict, &mut state.borrow_mut().headers);
            }
            state.borrow_mut().permit = permit;
        }
        state.borrow_mut().stage = Stage::Waiting;
        Action::Pause
    }

    /// Acts on a final verdict for a request: lets it through or answers it
    /// as limited. Returns what its handler returns to Envoy.
    pub(crate) fn finish(&self, state: &Shared, verdict: Verdict, permit: Permit, now: Nanos) -> Action {
        let limiter = &self.limiter;
        if let Some(rule) = verdict.shadow_limited.and_then(|index| limiter.rules().get(index)) {
            self.shadow_log.record(now, log::Level::Info, || {
                format!("shadow mode: rule {} would have limited a request; let through", rule.rule.name)
            });
        }
        let mut state = state.borrow_mut();
        limiter.render_headers(&verdict, &mut state.headers);
        state.permit = permit;
        if verdict.allowed() {
            state.stage = Stage::Passed;
            return Action::Continue;
        }
        state.stage = Stage::Limited;
        let response = limiter.response();
        let buffer = &mut self.reply_buffer.borrow_mut();
        if let Err(status) =
            host::send_local_reply(response.status, state.headers.iter(), response.body.as_bytes(), buffer)
        {
            log::warn!("floodgate: could not send the limited response: {status:?}");
        }
        Action::Pause
    }

    /// Finishes a paused request from the root context: switches to it and
    /// resumes it or answers it as limited.
    pub(crate) fn finish_paused(&self, context_id: u32, state: &Shared, verdict: Verdict, permit: Permit, now: Nanos) {
        if hostcalls::set_effective_context(context_id).is_err() {
            // The client left: what it took goes back.
            self.release(permit, Release::Undo);
            return;
        }
        if let Action::Continue = self.finish(state, verdict, permit, now) {
            if let Err(status) = hostcalls::resume_http_request() {
                log::warn!("floodgate: could not resume a request: {status:?}");
            }
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
        self.metrics.flush(&self.limiter);
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
        match hostcalls::enqueue_shared_queue(queue, None) {
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
            match waiter.wait {
                Wait::Delay { resume_at } => {
                    // Only this worker can resume its own requests; a client
                    // that has gone makes this fail, and its units were given
                    // back in on_done.
                    let resumed = hostcalls::set_effective_context(waiter.context_id)
                        .and_then(|()| hostcalls::resume_http_request())
                        .is_ok();
                    if resumed {
                        waiter.request.borrow_mut().stage = Stage::Passed;
                        increment(&self.metrics.delayed, 1);
                        increment(&self.metrics.delay_requested_ms, (resume_at - waiter.since).ceil_millis());
                        increment(&self.metrics.delay_actual_ms, (now - waiter.since).ceil_millis());
                    } else {
                        increment(&self.metrics.delay_abandoned, 1);
                    }
                }
                Wait::Refill { deadline } => {
                    if hostcalls::set_effective_context(waiter.context_id).is_err() {
                        continue;
                    }
                    let waited_out = now >= deadline;
                    let action = self.decide(waiter.context_id, &waiter.request, waiter.since, now, waited_out);
                    if !matches!(waiter.request.borrow().stage, Stage::Waiting) {
                        increment(&self.metrics.refill_waits, 1);
                        increment(&self.metrics.refill_wait_ms, (now - waiter.since).ceil_millis());
                        if let Action::Continue = action {
                            if let Err(status) = hostcalls::resume_http_request() {
                                log::warn!("floodgate: could not resume a request: {status:?}");
                            }
                        }
                    }
                }
                Wait::Answer => {}
            }
        }
    }
}

/// Sets this worker's tick: soon when calls are queued and not posted, or a
/// paused request is due, or calls held back must leave; every
/// [`GLOBAL_TICK`] while global rules exist;
/// within [`metrics::FLUSH_PERIOD`] while counts wait to be flushed or the
/// worker holds units taken ahead; else not at all.
pub(crate) fn schedule_ticks(plugin: &Plugin, now: Nanos) {
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
    if let Err(status) = hostcalls::set_tick_period(period) {
        log::warn!("floodgate: cannot schedule the tick that resumes paused requests: {status:?}");
    }
}

/// Logs a kind of event at most once a second per VM, with the number of
/// events left out since the previous line: on a busy listener one line per
/// request would flood Envoy's log, and the counters have the totals.
#[derive(Default)]
pub(crate) struct RateLimitedLog {
    last: Cell<Nanos>,
    suppressed: Cell<u64>,
}

impl RateLimitedLog {
    pub(crate) fn record(&self, now: Nanos, level: log::Level, line: impl FnOnce() -> String) {
        if now - self.last.get() < SECOND {
            self.suppressed.set(self.suppressed.get() + 1);
            return;
        }
        let suppressed = self.suppressed.replace(0);
        self.last.set(now);
        log::log!(level, "floodgate: {} ({suppressed} more since the last line)", line());
    }
}
