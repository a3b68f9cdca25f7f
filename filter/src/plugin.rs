//! What every request of one configuration on one worker shares, and the
//! request's path through it: deciding, acting on what becomes of it (as
//! [`crate::outcome`] decides: going on, answering, pausing, resuming,
//! giving back), giving a permit back when it ends, counting. The path
//! itself is the same in both builds (`floodgate_filter_common::requests`);
//! here the plugin is its host: the request is the effective context, a
//! paused one is switched to from the root, and the root's tick looks at
//! the paused requests. The quota service's side of it is in
//! [`crate::quota`].

use std::cell::{Cell, RefCell};
use std::time::Duration;

use floodgate_core::global::calls::Refresh;
use floodgate_core::limiter::{CanWait, Limiter, Permit, Verdict};
use floodgate_core::time::Nanos;
use floodgate_filter_common::log::RateLimitedLog;
use floodgate_filter_common::requests::{self, RequestHost};

use crate::host::{HeaderReads, Host, HostRequest, SharedData};
use crate::metrics::{self, Metrics, RuleMetrics};
use crate::outcome::{Outcome, Site};
use crate::quota::Callouts;
use crate::waiting::{Shared, Waiting};

pub(crate) use floodgate_filter_common::requests::RequestRef;

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
    /// The request whose own callback runs (its headers, or its check's
    /// answer), and whether it is its headers': switching to it needs no
    /// host call, and a request let through in its headers' callback goes
    /// on by that callback's return, not by a resume.
    pub(crate) current: Cell<Option<(u32, bool)>>,
    /// The clock as read at the start of the callback that runs, if it
    /// keeps one instant for all it does (a check's answer).
    pub(crate) callback_now: Cell<Option<Nanos>>,
    /// A rule switched into or out of its fall-back since its gauge was
    /// last set from an answer.
    pub(crate) modes_changed: Cell<bool>,
    /// The tick period last set with the host (whole milliseconds, as the
    /// host takes it), and when the tick was last known to run (set, or
    /// fired): an unchanged period is not set again while the tick runs.
    /// Envoy makes a new timer for every call, and one set again never
    /// fires while requests keep coming faster than its period.
    pub(crate) tick: Cell<Option<(u128, Nanos)>>,
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
            tick: Cell::new(None),
            current: Cell::new(None),
            callback_now: Cell::new(None),
            modes_changed: Cell::new(false),
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

    /// Decides the request of context `context_id` and acts on the verdict.
    /// Called at [`Site::Handler`] by the request's own handler, and at
    /// [`Site::Root`] by the worker's root for a request that waits for a
    /// refill (with the effective context set to it; `waited_out` once its
    /// wait is over).
    pub(crate) fn decide(&self, site: Site, request: RequestRef<'_>, now: Nanos, waited_out: bool) -> Outcome {
        requests::decide(self, site, request, now, waited_out)
    }

    /// A request's stream ended (completed, reset or failed): its permit
    /// goes back. One still waiting was never served: its client has gone,
    /// and what it took (and what its check holds) is undone; a served one
    /// releases what it held while in flight.
    pub(crate) fn ended(&self, context_id: u32, state: &Shared) {
        if requests::ended(self, context_id, state) {
            self.counted();
        }
    }

    /// Counts were added on a request's path: the first since the last flush
    /// schedules the tick that flushes them (only then is the clock read).
    pub(crate) fn counted(&self) {
        if !self.unflushed.replace(true) {
            schedule_ticks(self, self.host.now());
        }
    }

    /// The end of a root-context callback that answered or sent calls (run
    /// once a request or more): counts wait for the flush tick, as a
    /// request's own do, and the tick is set for what remains to do.
    pub(crate) fn settle_calls(&self, now: Nanos) {
        self.unflushed.set(true);
        schedule_ticks(self, now);
    }

    /// The tick fired at `now`: it runs.
    pub(crate) fn ticked(&self, now: Nanos) {
        if let Some((period, _)) = self.tick.get() {
            self.tick.set(Some((period, now)));
        }
    }

    /// The end of the root's tick (or of its configuration): counts reach
    /// Envoy, and the tick is set for what remains to do.
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
            requests::finish_waiter(self, waiter, now);
        }
    }
}

impl<H: Host> RequestHost for Plugin<H> {
    /// Reads the effective context's request through the host, keeping the
    /// room for its header values between requests.
    fn check(&self, now: Nanos, can_wait: CanWait, decided: (&mut Verdict, &mut Permit)) {
        let limiter = &self.limiter;
        let reads = std::mem::take(&mut *self.header_reads.borrow_mut());
        let mut read = HostRequest::new(&self.host, limiter.header_names(), reads);
        limiter.check_into(&self.store(), now, &mut read, can_wait, &mut self.metrics.counters(), decided);
        *self.header_reads.borrow_mut() = read.into_reads();
    }

    fn waiting(&self) -> &RefCell<Waiting> {
        &self.waiting
    }

    fn shadow_log(&self) -> &RateLimitedLog {
        &self.shadow_log
    }

    /// Queued in this worker's calls; the root sends them.
    fn refreshes(&self, refreshes: Vec<Refresh>, now: Nanos) {
        self.callouts.borrow_mut().refresh(refreshes, now);
    }

    /// Makes paused request `context_id` the effective context, from the
    /// root: only this worker can resume its own requests, and a client
    /// that has gone makes this fail ([`Event::Gone`]).
    fn switch_to(&self, context_id: u32) -> bool {
        if self.current.get().is_some_and(|(current, _)| current == context_id) {
            return true;
        }
        self.host.set_effective_context(context_id).is_ok()
    }

    fn reply(&self, state: &Shared, status: u32, body: &[u8]) {
        if let Err(status) = self.host.send_local_reply(status, &state.borrow().headers, body) {
            log::warn!("floodgate: could not send the limited response: {status:?}");
        }
    }

    /// Resumes the effective (paused) request; false when the host refused.
    /// In the request's own headers' callback it goes on as that callback
    /// returns.
    fn resume(&self) -> bool {
        if self.current.get().is_some_and(|(_, in_headers)| in_headers) {
            return true;
        }
        match self.host.resume_request() {
            Ok(()) => true,
            Err(status) => {
                log::warn!("floodgate: could not resume a request: {status:?}");
                false
            }
        }
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
    // A periodic tick already set to this period wakes the worker no later
    // than setting it again would; one not seen for two periods is set
    // again, should the host have dropped it.
    let ms = period.as_millis();
    if let Some((set, alive)) = plugin.tick.get() {
        if set == ms && (period.is_zero() || now < alive + Nanos::from(period * 2)) {
            return;
        }
    }
    match plugin.host.set_tick_period(period) {
        Ok(()) => plugin.tick.set(Some((ms, now))),
        Err(status) => log::warn!("floodgate: cannot schedule the tick that resumes paused requests: {status:?}"),
    }
}
