//! One request's stream: its path is the common one
//! (`floodgate_filter_common::requests`: decided at its headers, answered,
//! paused or let through, finished when its wait is over, its permit given
//! back when it ends), with the stream as its host. Its rate-limit headers
//! go on the response on the way back.
//!
//! A paused request is looked at again in its stream's scheduled hook, on
//! its worker: the waker's thread posts it when its delay or its wait for a
//! refill is over, and the configuration's main thread when a lease answer
//! may have refilled its pool (`crate::relay`). A request waiting for a
//! check sent the check itself, as a call of its stream: the answer comes
//! to the stream's callout hook, on its worker, and Envoy cancels the call
//! if the stream goes first.
//!
//! Hooks of one stream run on its worker one at a time, but one may run
//! inside another (a local reply completes the stream inline; a resumed
//! request may be answered inline), so the stream is only ever borrowed
//! shared and no borrow of its state is held across a call into Envoy that
//! can run a hook (adding a response header runs none).

use std::cell::{Cell, OnceCell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

use floodgate_core::algorithm::Release;
use floodgate_core::global::calls::{Call, CallError, Refresh};
use floodgate_core::limiter::{CanWait, Counters, Limiter, Permit, Verdict};
use floodgate_core::store::Store;
use floodgate_core::time::Nanos;
use floodgate_filter_common::log::RateLimitedLog;
use floodgate_filter_common::metrics::Counter;
use floodgate_filter_common::outcome::{Outcome, Site};
use floodgate_filter_common::quota::{client, Callouts, QuotaHost};
use floodgate_filter_common::requests::{self, RequestHost, RequestRef};
use floodgate_filter_common::waiting::{Shared, Stage, Wait, Waiting};

use crate::abi::{CalloutAnswer, Filter, Scheduler};
use crate::client::{borrowed, read_answer, timeout_ms};
use crate::config::FilterConfig;
use crate::metrics::{MetricIds, RuleIds};
use crate::request::StreamRequest;
use crate::waker::{self, Wakeable};
use crate::worker::{self, Worker};

/// The response details of a limited request's local reply (in access logs
/// as `%RESPONSE_CODE_DETAILS%`).
const DETAILS: &str = "floodgate_rate_limited";

/// What the request headers hook tells Envoy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadersStatus {
    /// Go on.
    Continue,
    /// Answered by a local reply: stop.
    Replied,
    /// Paused until the module resumes it: stop everything.
    Paused,
}

/// How a paused stream is woken.
#[derive(Default)]
struct Wake {
    /// Its scheduler, made at its first pause: kept until the stream goes,
    /// so that it is deleted on the stream's own worker.
    scheduler: Option<Arc<Scheduler>>,
    /// Its wake-up at the end of its delay or of its wait for a refill.
    timer: Option<u64>,
    /// Its registration with the relay while it waits for a refill.
    refill: Option<u64>,
}

impl Wake {
    /// No wake-up is set for the stream.
    fn is_idle(&self) -> bool {
        self.timer.is_none() && self.refill.is_none()
    }
}

/// One stream's module object.
pub struct Stream {
    /// Its configuration on this worker; `None`: requests pass unlimited
    /// (the worker could not set it up, as logged).
    worker: Option<Rc<Worker>>,
    /// Its number on the worker, for the waiting list.
    id: u32,
    /// Where it is, what it holds, its rate-limit headers.
    state: Shared,
    /// When it was decided (a paused request's wait starts there).
    since: Cell<Nanos>,
    /// How it is woken while it waits.
    wake: RefCell<Wake>,
    /// Its check's calls (check-mode rules), made when it needs them.
    checks: OnceCell<RefCell<Callouts<u64>>>,
    /// Envoy completed the stream.
    completed: Cell<bool>,
}

/// Most stream objects an idle worker keeps for its next streams.
const MAX_SPARE: usize = 256;

thread_local! {
    /// Stream objects of streams that ended on this thread, each as a new
    /// stream's (no worker, nothing held): a stream takes one and puts it
    /// back, instead of its object and its state being allocated and freed.
    // Boxed: each is the very allocation whose address Envoy is handed.
    #[allow(clippy::vec_box)]
    static SPARE: RefCell<Vec<Box<Stream>>> = const { RefCell::new(Vec::new()) };
}

impl Stream {
    /// A new stream of `config`, on the calling worker.
    pub fn new(config: &FilterConfig) -> Stream {
        let mut stream = Stream::blank();
        stream.start(config);
        stream
    }

    /// A new stream of `config`, on the calling worker, in an object an
    /// ended stream of this thread left, if one is spare.
    pub fn boxed(config: &FilterConfig) -> Box<Stream> {
        match SPARE.with(|spare| spare.borrow_mut().pop()) {
            Some(mut stream) => {
                stream.start(config);
                stream
            }
            None => Stream::first_boxed(config),
        }
    }

    /// A stream in a new object: only until this thread has ended as many
    /// streams as run at once, so kept out of every stream's path.
    #[cold]
    #[inline(never)]
    fn first_boxed(config: &FilterConfig) -> Box<Stream> {
        Box::new(Stream::new(config))
    }

    /// Ends `stream` (as dropping it does) and keeps its object for a next
    /// stream of this thread.
    pub fn recycle(mut stream: Box<Stream>) {
        stream.end();
        if !stream.clear() {
            return;
        }
        SPARE.with(|spare| {
            let mut spare = spare.borrow_mut();
            if spare.len() < MAX_SPARE {
                spare.push(stream);
            }
        });
    }

    /// A stream of no configuration, holding nothing.
    fn blank() -> Stream {
        Stream {
            worker: None,
            id: 0,
            state: Shared::default(),
            since: Cell::new(Nanos::ZERO),
            wake: RefCell::default(),
            checks: OnceCell::new(),
            completed: Cell::new(false),
        }
    }

    /// Makes a blank stream one of `config`'s on the calling worker.
    fn start(&mut self, config: &FilterConfig) {
        self.worker = worker::of(&config.shared);
        self.id = self.worker.as_ref().map_or(0, |w| w.stream_id());
    }

    /// Makes an ended stream blank again; false when its state is still
    /// shared (then it is not reused).
    fn clear(&mut self) -> bool {
        self.worker = None;
        self.id = 0;
        self.since.set(Nanos::ZERO);
        *self.wake.get_mut() = Wake::default();
        self.checks = OnceCell::new();
        self.completed.set(false);
        let Some(state) = Rc::get_mut(&mut self.state) else { return false };
        let state = state.get_mut();
        state.stage = Stage::Deciding;
        state.permit = Permit::default();
        state.headers.clear();
        true
    }

    /// The request's headers: decide, and act on what becomes of it.
    pub fn on_request_headers(&self, filter: &mut Filter<'_>) -> HeadersStatus {
        let Some(worker) = self.worker.as_deref() else { return HeadersStatus::Continue };
        if self.state.borrow().stage != Stage::Deciding {
            return HeadersStatus::Continue;
        }
        worker.sync_modes();
        let now = crate::now();
        self.since.set(now);
        let host = StreamHost::new(self, worker, filter, true);
        let request = RequestRef { context_id: self.id, state: &self.state, since: now };
        if let Outcome::Pause(Wait::Answer) = requests::decide(&host, Site::Handler, request, now, false) {
            // Its check leaves now, as a call of its own.
            client::send_queued(&host);
        }
        self.settle_wake();
        match self.state.borrow().stage {
            Stage::Limited => HeadersStatus::Replied,
            Stage::Waiting => HeadersStatus::Paused,
            Stage::Deciding | Stage::Passed => HeadersStatus::Continue,
        }
    }

    /// The stream's scheduler woke it: a paused request's wait may be over
    /// (its time came, or its pool may have been refilled).
    pub fn on_scheduled(&self, filter: &mut Filter<'_>, event: u64) {
        let Some(worker) = self.worker.as_deref() else { return };
        if event != waker::WAKE || self.state.borrow().stage != Stage::Waiting || self.completed.get() {
            return;
        }
        let Some(waiter) = worker.waiting.borrow_mut().remove(self.id) else { return };
        let now = crate::now();
        if !waiter.wait.is_due(now, false) {
            worker.waiting.borrow_mut().add(waiter);
            return;
        }
        worker.sync_modes();
        let host = StreamHost::new(self, worker, filter, false);
        requests::finish_waiter(&host, waiter, now);
        self.settle_wake();
    }

    /// The answer to one of the stream's calls: its check.
    pub fn on_answer(&self, filter: &mut Filter<'_>, id: u64, answer: &CalloutAnswer<'_>) {
        let Some(worker) = self.worker.as_deref() else { return };
        if self.completed.get() {
            return;
        }
        worker.sync_modes();
        let answered = answer.read();
        let (status, body) = read_answer(&answered);
        let host = StreamHost::new(self, worker, filter, false);
        client::answer(&host, id, || status, borrowed(&body));
        self.settle_wake();
    }

    /// The response's headers: the rate-limit headers of a request let
    /// through are added (a limited one's went with its local reply).
    pub fn on_response_headers(&self, filter: &mut Filter<'_>) {
        // The one borrow held across calls into Envoy (not a copy of the
        // headers' 500 bytes): Envoy adds a header to its map and calls no
        // hook back, and the borrow is shared, so even a hook run inside
        // could read the state.
        let state = self.state.borrow();
        if state.stage == Stage::Limited || state.headers.is_empty() {
            return;
        }
        for (name, value) in state.headers.fields() {
            if !filter.add_response_header(name, value) {
                log::warn!("floodgate: could not add response header {name}");
            }
        }
    }

    /// The stream ended (completed, reset or failed): its permit goes back.
    /// One still waiting was never served (its client left): what it took
    /// is undone; a served one releases what it held while in flight.
    pub fn on_complete(&self, filter: &mut Filter<'_>) {
        let Some(worker) = self.worker.as_deref() else { return };
        if self.completed.replace(true) {
            return;
        }
        let host = StreamHost::new(self, worker, filter, false);
        requests::ended(&host, self.id, &self.state);
        self.settle_wake();
    }

    /// Stops the wake-ups of a request that no longer waits: once this
    /// returns, neither the waker nor the main thread wakes it.
    fn settle_wake(&self) {
        // Nothing to stop for a request that never waited (nearly every
        // one): told from the stream's own fields, without its state.
        if self.wake.borrow().is_idle() {
            return;
        }
        if self.state.borrow().stage == Stage::Waiting && !self.completed.get() {
            return;
        }
        let mut wake = self.wake.borrow_mut();
        if let Some(token) = wake.timer.take() {
            waker::cancel(token);
        }
        if let (Some(key), Some(worker)) = (wake.refill.take(), self.worker.as_deref()) {
            worker.shared.relay.stop_waiting(key);
        }
    }
}

impl Stream {
    /// Envoy completes every stream before it destroys it; should one be
    /// destroyed without, its wake-ups stop and its permits still go back
    /// (uncounted: no stream is left to count through). Ending it again
    /// does nothing more.
    fn end(&mut self) {
        let completed = self.completed.replace(true);
        self.settle_wake();
        // A completed stream gave back all it held then (`on_complete`: its
        // permit, and a waiting one's check), and none of its hooks has
        // taken anything since (each returns once it is completed).
        if completed {
            return;
        }
        let Some(worker) = self.worker.as_deref() else { return };
        let waiting =
            self.state.borrow().stage == Stage::Waiting && worker.waiting.borrow_mut().remove(self.id).is_some();
        let why = if waiting { Release::Undo } else { Release::Done };
        let checked = self.checks.get().and_then(|checks| checks.borrow_mut().forget(self.id));
        let permit = std::mem::take(&mut self.state.borrow_mut().permit);
        for permit in checked.into_iter().chain([permit]) {
            if worker.limiter.needs_release(&permit, why) {
                worker.limiter.release(&worker.store, crate::now(), permit, why, &mut worker.shared.metrics.nowhere());
            }
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.end();
    }
}

/// A stream during one of its hooks, as the common request path's host.
struct StreamHost<'a, 'h> {
    stream: &'a Stream,
    worker: &'a Worker,
    filter: RefCell<&'a mut Filter<'h>>,
    /// In the request headers hook: a request let through there goes on by
    /// the hook's return, not by being resumed.
    in_headers: bool,
    /// The relay's count of lease answers before the request was decided.
    refills_seen: u64,
}

impl<'a, 'h> StreamHost<'a, 'h> {
    fn new(stream: &'a Stream, worker: &'a Worker, filter: &'a mut Filter<'h>, in_headers: bool) -> Self {
        let refills_seen = worker.shared.relay.refills();
        StreamHost { stream, worker, filter: RefCell::new(filter), in_headers, refills_seen }
    }

    fn metrics(&self) -> &MetricIds {
        &self.worker.shared.metrics
    }

    /// The stream's scheduler, made at its first pause.
    fn scheduler(&self) -> Option<Arc<Scheduler>> {
        let mut wake = self.stream.wake.borrow_mut();
        if wake.scheduler.is_none() {
            wake.scheduler = self.filter.borrow_mut().scheduler().map(Arc::new);
        }
        wake.scheduler.clone()
    }
}

/// Moves the metrics through the stream while the counts are made.
struct Through<'a, 'h> {
    metrics: &'a MetricIds,
    filter: std::cell::Ref<'a, &'a mut Filter<'h>>,
}

impl Counters<RuleIds> for Through<'_, '_> {
    fn request(&mut self, event: floodgate_core::limiter::RequestEvent) {
        self.metrics.on(&self.filter).request(event);
    }

    fn rule(
        &mut self,
        rule: &floodgate_core::limiter::CompiledRule<RuleIds>,
        event: floodgate_core::limiter::RuleEvent,
    ) {
        self.metrics.on(&self.filter).rule(rule, event);
    }

    fn store(&mut self, event: floodgate_core::limiter::StoreEvent, count: u64) {
        self.metrics.on(&self.filter).store(event, count);
    }

    fn in_flight(&mut self, rule: &floodgate_core::limiter::CompiledRule<RuleIds>, change: i64) {
        self.metrics.on(&self.filter).in_flight(rule, change);
    }
}

impl QuotaHost for StreamHost<'_, '_> {
    type Token = u64;
    type Rule = RuleIds;

    fn limiter(&self) -> &Limiter<RuleIds> {
        &self.worker.limiter
    }

    fn store(&self) -> impl Store + '_ {
        &self.worker.store
    }

    fn counters(&self) -> impl Counters<RuleIds> + '_ {
        Through { metrics: self.metrics(), filter: self.filter.borrow() }
    }

    fn now(&self) -> Nanos {
        crate::now()
    }

    fn callouts(&self) -> &RefCell<Callouts<u64>> {
        self.stream.checks.get_or_init(RefCell::default)
    }

    fn callout_log(&self) -> &RateLimitedLog {
        &self.worker.callout_log
    }

    fn count(&self, counter: Counter, by: u64) {
        self.metrics().on(&self.filter.borrow()).count(counter, by);
    }

    fn count_failed_callout(&self, why: &CallError) {
        self.metrics().on(&self.filter.borrow()).count_failed(why);
    }

    /// A call of the stream's own: its answer comes to this stream.
    fn dispatch(&self, cluster: &str, call: &Call, timeout: Nanos) -> Result<u64, String> {
        let headers: Vec<(&str, &str)> = call.headers.iter().map(|(n, v)| (*n, v.as_ref())).collect();
        self.filter
            .borrow_mut()
            .http_callout(cluster, &headers, &call.body, timeout_ms(timeout))
            .map_err(|why| format!("the call to cluster {cluster:?} was not sent: {why}"))
    }

    fn checked(&self, context_id: u32, verdict: Verdict, permit: Permit, now: Nanos) {
        requests::finish_checked(self, context_id, verdict, permit, now);
    }

    fn modes_changed(&self) {
        self.worker.shared.relay.modes_changed();
    }
}

impl RequestHost for StreamHost<'_, '_> {
    fn check(&self, now: Nanos, can_wait: CanWait, decided: (&mut Verdict, &mut Permit)) {
        let limiter = &self.worker.limiter;
        let filter = self.filter.borrow();
        let mut request = StreamRequest::new(&filter, limiter.header_names());
        let mut counters = self.metrics().on(&filter);
        limiter.check_into(&self.worker.store, now, &mut request, can_wait, &mut counters, decided);
    }

    fn waiting(&self) -> &RefCell<Waiting> {
        &self.worker.waiting
    }

    fn shadow_log(&self) -> &RateLimitedLog {
        &self.worker.shadow_log
    }

    /// Handed to the configuration's main thread, which sends them.
    fn refreshes(&self, refreshes: Vec<Refresh>, _now: Nanos) {
        self.worker.shared.relay.hand_refreshes(refreshes);
    }

    /// A stream's hooks are its own: only its own request is current.
    fn switch_to(&self, context_id: u32) -> bool {
        context_id == self.stream.id
    }

    /// Arranges the wake-ups: at the end of a delay, or of a wait for a
    /// refill (and after every lease answer until then).
    fn paused(&self, _request: &RequestRef<'_>, wait: Wait) -> bool {
        let Some(scheduler) = self.scheduler() else { return false };
        let mut wake = self.stream.wake.borrow_mut();
        let at = match wait {
            Wait::Delay { resume_at } => {
                if let Some(token) = wake.timer.take() {
                    waker::cancel(token);
                }
                if let Some(key) = wake.refill.take() {
                    self.worker.shared.relay.stop_waiting(key);
                }
                resume_at
            }
            Wait::Refill { deadline } => {
                let relay = &self.worker.shared.relay;
                if wake.refill.is_none() {
                    wake.refill = Some(relay.wait_for_refill(&scheduler));
                }
                // An answer applied while this request was being decided
                // woke nobody for it: it looks again at once.
                if relay.refills() != self.refills_seen {
                    scheduler.wake(waker::WAKE);
                }
                // Its wake-up at the end of its wait is set already if it
                // waited before.
                if wake.timer.is_some() {
                    return true;
                }
                deadline
            }
            Wait::Answer => return true,
        };
        let target: Arc<dyn Wakeable> = scheduler;
        wake.timer = waker::wake_at(at, target);
        wake.timer.is_some()
    }

    fn reply(&self, state: &Shared, status: u32, body: &[u8]) {
        // Copied out: Envoy may complete the stream inside `send_response`,
        // and that reads the state.
        let headers = state.borrow().headers.clone();
        self.filter.borrow_mut().send_response(status, headers.iter(), body, DETAILS);
    }

    fn resume(&self) -> bool {
        if !self.in_headers {
            self.filter.borrow_mut().continue_decoding();
        }
        true
    }
}
