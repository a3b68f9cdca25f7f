//! One request's stream: decided on at its headers, answered, paused or let
//! through as `floodgate_filter_common::outcome` says, given its rate-limit
//! headers on the way back, and its permit given back when it ends.
//!
//! Hooks of one stream run on its worker one at a time, but one may run
//! inside another (a local reply completes the stream inline; a resumed
//! request may be answered inline), so the stream is only ever borrowed
//! shared and no borrow of its state is held across a call into Envoy.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

use floodgate_core::algorithm::Release;
use floodgate_core::limiter::{CanWait, Permit, Verdict};
use floodgate_core::time::Nanos;
use floodgate_filter_common::log::shadow_limited;
use floodgate_filter_common::metrics::Counter;
use floodgate_filter_common::outcome::{self, Event, Outcome, Site};
use floodgate_filter_common::waiting::{Shared, Stage, Wait, Waiter};

use crate::abi::{Filter, Scheduler};
use crate::config::FilterConfig;
use crate::metrics::StreamCounters;
use crate::request::StreamRequest;
use crate::waker;
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

/// A pending wake-up of a paused stream.
struct Wake {
    token: u64,
    /// Its scheduler: kept until the stream goes, so that it is deleted on
    /// the stream's own worker.
    _scheduler: Arc<Scheduler>,
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
    /// Its wake-up, while it waits.
    wake: RefCell<Option<Wake>>,
}

impl Stream {
    /// A new stream of `config`, on the calling worker.
    pub fn new(config: &FilterConfig) -> Stream {
        let worker = worker::of(&config.shared);
        let id = worker.as_ref().map_or(0, |w| w.stream_id());
        Stream { worker, id, state: Shared::default(), since: Cell::new(Nanos::ZERO), wake: RefCell::new(None) }
    }

    /// The request's headers: decide, and act on what becomes of it.
    pub fn on_request_headers(&self, filter: &mut Filter<'_>) -> HeadersStatus {
        let Some(worker) = self.worker.as_deref() else { return HeadersStatus::Continue };
        if self.state.borrow().stage != Stage::Deciding {
            return HeadersStatus::Continue;
        }
        let now = crate::now();
        self.since.set(now);
        let limiter = &worker.limiter;
        let can_wait = if worker.waiting.borrow().is_full() { CanWait::NoRoom } else { CanWait::Yes };
        let (verdict, permit) = {
            let mut request = StreamRequest::new(filter, limiter.header_names());
            let mut counters = worker.shared.metrics.on(filter);
            limiter.check_waited(&worker.store, now, &mut request, can_wait, &mut counters)
        };
        let event = Event::Decided { verdict: &verdict, since: now, now, max_wait: Nanos::ZERO };
        let outcome = outcome::next(Site::Handler, event);
        if matches!(outcome, Outcome::Continue | Outcome::Reply) {
            shadow_limited(&worker.shadow_log, limiter, &verdict, now);
        }
        match outcome {
            Outcome::Continue => {
                self.finish(worker, &verdict, permit, Stage::Passed);
                HeadersStatus::Continue
            }
            Outcome::Reply => {
                self.finish(worker, &verdict, permit, Stage::Limited);
                self.reply(worker, filter);
                HeadersStatus::Replied
            }
            Outcome::Pause(Wait::Delay { resume_at }) => self.pause(worker, filter, &verdict, permit, resume_at),
            // Global rules, which alone wait for a refill or an answer, are
            // refused with the configuration; a handler neither resumes nor
            // gives back. Were one reached, the request goes on with what it took.
            Outcome::Pause(Wait::Refill { .. } | Wait::Answer) | Outcome::Resume | Outcome::GiveBack => {
                self.finish(worker, &verdict, permit, Stage::Passed);
                HeadersStatus::Continue
            }
        }
    }

    /// Keeps a final verdict's headers and permit in the stream's state.
    fn finish(&self, worker: &Worker, verdict: &Verdict, permit: Permit, stage: Stage) {
        let mut state = self.state.borrow_mut();
        worker.limiter.render_headers(verdict, &mut state.headers);
        state.permit = permit;
        state.stage = stage;
    }

    /// Answers the request as limited, with the headers its verdict gave.
    fn reply(&self, worker: &Worker, filter: &mut Filter<'_>) {
        let response = worker.limiter.response();
        // Copied out: Envoy may complete the stream inside `send_response`,
        // and that reads the state.
        let headers = self.state.borrow().headers.clone();
        filter.send_response(response.status, headers.iter(), response.body.as_bytes(), DETAILS);
    }

    /// Pauses a delayed request until `resume_at`, or lets it go on at once
    /// if it cannot be woken.
    fn pause(
        &self,
        worker: &Worker,
        filter: &mut Filter<'_>,
        verdict: &Verdict,
        permit: Permit,
        resume_at: Nanos,
    ) -> HeadersStatus {
        let wake = filter.scheduler().map(Arc::new).and_then(|scheduler| {
            let token = waker::wake_at(resume_at, Arc::clone(&scheduler))?;
            Some(Wake { token, _scheduler: scheduler })
        });
        let Some(wake) = wake else {
            log::warn!("floodgate: a delayed request cannot be paused; it goes on at once");
            self.finish(worker, verdict, permit, Stage::Passed);
            return HeadersStatus::Continue;
        };
        *self.wake.borrow_mut() = Some(wake);
        // The limiter was told whether there is room: a request it lets wait has it.
        let waiter = Waiter {
            context_id: self.id,
            since: self.since.get(),
            wait: Wait::Delay { resume_at },
            request: Rc::clone(&self.state),
        };
        worker.waiting.borrow_mut().add(waiter);
        self.finish(worker, verdict, permit, Stage::Waiting);
        HeadersStatus::Paused
    }

    /// The stream's scheduler woke it: a paused request's wait is over.
    pub fn on_scheduled(&self, filter: &mut Filter<'_>, event: u64) {
        let Some(worker) = self.worker.as_deref() else { return };
        if event != waker::WAIT_OVER || self.state.borrow().stage != Stage::Waiting {
            return;
        }
        let Some(waiter) = worker.waiting.borrow_mut().remove(self.id) else { return };
        let Wait::Delay { resume_at } = waiter.wait else { return };
        if let Some(wake) = self.wake.borrow_mut().take() {
            waker::cancel(wake.token);
        }
        if outcome::next(Site::Root, Event::DelayOver) != Outcome::Resume {
            return;
        }
        let now = crate::now();
        {
            let mut counters = worker.shared.metrics.on(filter);
            count_delay(&mut counters, waiter.since, resume_at, now);
        }
        self.state.borrow_mut().stage = Stage::Passed;
        filter.continue_decoding();
    }

    /// The response's headers: the rate-limit headers of a request let
    /// through are added (a limited one's went with its local reply).
    pub fn on_response_headers(&self, filter: &mut Filter<'_>) {
        let headers = {
            let state = self.state.borrow();
            if state.stage == Stage::Limited || state.headers.iter().next().is_none() {
                return;
            }
            state.headers.clone()
        };
        for (name, value) in headers.iter() {
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
        let mut counters = worker.shared.metrics.on(filter);
        self.end(worker, &mut counters);
    }

    fn end(&self, worker: &Worker, counters: &mut StreamCounters<'_>) {
        let waiting = self.state.borrow().stage == Stage::Waiting;
        let permit = std::mem::take(&mut self.state.borrow_mut().permit);
        let why = if waiting && worker.waiting.borrow_mut().remove(self.id).is_some() {
            if let Some(wake) = self.wake.borrow_mut().take() {
                waker::cancel(wake.token);
            }
            counters.count(Counter::DelayAbandoned, 1);
            match outcome::next(Site::Handler, Event::Gone) {
                Outcome::GiveBack => Release::Undo,
                _ => Release::Done,
            }
        } else {
            Release::Done
        };
        if worker.limiter.needs_release(&permit, why) {
            worker.limiter.release(&worker.store, crate::now(), permit, why, counters);
        }
        self.state.borrow_mut().stage = Stage::Passed;
    }
}

/// A delayed request went on: counted as the wasm build counts it.
fn count_delay(counters: &mut StreamCounters<'_>, since: Nanos, resume_at: Nanos, now: Nanos) {
    counters.count(Counter::Delayed, 1);
    counters.count(Counter::DelayRequestedMs, (resume_at - since).ceil_millis());
    counters.count(Counter::DelayActualMs, (now - since).ceil_millis());
}

impl Drop for Stream {
    /// Envoy completes every stream before it destroys it; should one be
    /// destroyed without, its wake-up is cancelled and its permit still
    /// goes back (uncounted: no stream is left to count through).
    fn drop(&mut self) {
        if let Some(wake) = self.wake.borrow_mut().take() {
            waker::cancel(wake.token);
        }
        let Some(worker) = self.worker.as_deref() else { return };
        let unfinished = {
            let state = self.state.borrow();
            state.stage == Stage::Waiting || !state.permit.is_empty()
        };
        if unfinished {
            self.end(worker, &mut worker.shared.metrics.nowhere());
        }
    }
}
