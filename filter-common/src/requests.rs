//! A request's path through a worker, the same in both builds: it is
//! decided, and what becomes of it (as [`crate::outcome`] decides) is
//! carried out — it goes on, is answered as limited, pauses (for a
//! shaper's delay, a refill of its lease pool or the quota service's
//! answer), is resumed, or gives back what it took because its client has
//! gone; and its permit goes back when it ends. A build's host only reads
//! the request, answers it, resumes it and wakes it up ([`RequestHost`]).

use std::cell::RefCell;
use std::rc::Rc;

use floodgate_core::algorithm::Release;
use floodgate_core::global::calls::Refresh;
use floodgate_core::limiter::{CanWait, Permit, Verdict};
use floodgate_core::time::Nanos;

use crate::log::{shadow_limited, RateLimitedLog};
use crate::metrics::Counter;
use crate::outcome::{self, Event, Outcome, Site};
use crate::quota::QuotaHost;
use crate::waiting::{Shared, Stage, Wait, Waiter, Waiting};

/// What the request path asks of a build's worker, beyond the quota client
/// ([`QuotaHost`]: the limiter, the store, the counters). The request acted
/// on is the host's current one: in the wasm build the effective context
/// (a root switches to a paused request first, [`RequestHost::switch_to`]),
/// in the native build the stream whose hook runs.
pub trait RequestHost: QuotaHost {
    /// Decides the current request at `now`, reading it through the host,
    /// into `decided` ([`floodgate_core::limiter::Limiter::check_into`]).
    fn check(&self, now: Nanos, can_wait: CanWait, decided: (&mut Verdict, &mut Permit));

    /// This worker's paused requests.
    fn waiting(&self) -> &RefCell<Waiting>;

    /// Shadow-mode denials, logged at most once a second.
    fn shadow_log(&self) -> &RateLimitedLog;

    /// Refreshes of lease pools a request claimed at `now`: to be sent to
    /// the quota service (whoever sends them).
    fn refreshes(&self, refreshes: Vec<Refresh>, now: Nanos);

    /// Makes paused request `context_id` the current one, from a later
    /// event on its worker; false when its client has gone.
    fn switch_to(&self, context_id: u32) -> bool;

    /// The current request pauses for a delay or a refill: the host
    /// arranges to look at it again (the wasm build's tick does without
    /// being told). False when it cannot, and the request is then decided
    /// as one that could not wait. (A request waiting for a check is woken
    /// by the check's answer.)
    fn paused(&self, _request: &RequestRef<'_>, _wait: Wait) -> bool {
        true
    }

    /// Answers the current request as limited, with `status`, `body` and
    /// the headers in `state`. (The native build's Envoy may end the stream
    /// before this returns: nothing of the request is borrowed across it.)
    fn reply(&self, state: &Shared, status: u32, body: &[u8]);

    /// Resumes the current (paused) request; false when the host refused.
    fn resume(&self) -> bool;
}

/// The request the path acts on: its id on the worker, the state its
/// events share, and when it arrived.
#[derive(Clone, Copy)]
pub struct RequestRef<'s> {
    /// Its id on its worker (the wasm build: Envoy's context id).
    pub context_id: u32,
    /// Its state.
    pub state: &'s Shared,
    /// When it arrived.
    pub since: Nanos,
}

impl<'s> RequestRef<'s> {
    /// A paused request.
    pub fn of(waiter: &'s Waiter) -> Self {
        RequestRef { context_id: waiter.context_id, state: &waiter.request, since: waiter.since }
    }
}

/// Decides `request` (the host's current one) at `site` and acts on the
/// verdict: at [`Site::Handler`] on its arrival, at [`Site::Root`] again
/// for a request that waited for a refill (`waited_out` once its wait is
/// over). What became of it.
pub fn decide<H: RequestHost>(host: &H, site: Site, request: RequestRef<'_>, now: Nanos, waited_out: bool) -> Outcome {
    let can_wait = if waited_out {
        CanWait::WaitedOut
    } else if host.waiting().borrow().is_full() {
        CanWait::NoRoom
    } else {
        CanWait::Yes
    };
    let (mut verdict, mut permit) = (Verdict::default(), Permit::default());
    host.check(now, can_wait, (&mut verdict, &mut permit));
    if !verdict.refreshes.is_empty() {
        host.count(Counter::Refreshes, verdict.refreshes.len() as u64);
        host.refreshes(std::mem::take(&mut verdict.refreshes), now);
    }
    let max_wait = host.limiter().quota_service().map_or(Nanos::ZERO, |s| s.max_wait);
    let outcome = outcome::next(site, Event::Decided { verdict: &verdict, since: request.since, now, max_wait });
    act(host, site, request, outcome, Some(&mut verdict), &mut permit, now).unwrap_or(outcome)
}

/// Carries out `outcome` for `request` at `site`: the only code that
/// pauses, resumes, answers or gives back a request. `verdict` is the
/// verdict on it and `permit` what it took, if it was just decided; a
/// request decided earlier (its shaper's delay over) holds its permit and
/// headers in its state already, and one whose client has gone hands over
/// only what the filter holds for it outside its state. What was done
/// (`outcome`, unless a pause could not be arranged), or `None` when the
/// host refused to resume it. Both are lent, and taken only where they are
/// kept (a request decided on every request, so they are moved once).
pub fn act<H: RequestHost>(
    host: &H,
    site: Site,
    request: RequestRef<'_>,
    outcome: Outcome,
    verdict: Option<&mut Verdict>,
    permit: &mut Permit,
    now: Nanos,
) -> Option<Outcome> {
    let RequestRef { context_id, state, since } = request;
    match (outcome, verdict) {
        (Outcome::Pause(wait), Some(verdict)) => {
            if wait != Wait::Answer && !host.paused(&request, wait) {
                let (verdict, permit) = (std::mem::take(verdict), std::mem::take(permit));
                return Some(cannot_pause(host, site, request, wait, verdict, permit, now));
            }
            // The limiter was told whether there is room: a request it lets wait has it.
            host.waiting().borrow_mut().add(Waiter { context_id, since, wait, request: Rc::clone(state) });
            if let Wait::Answer = wait {
                host.callouts().borrow_mut().check(context_id, std::mem::take(verdict), std::mem::take(permit));
            } else {
                if let Wait::Delay { .. } = wait {
                    host.limiter().render_headers(verdict, &mut state.borrow_mut().headers);
                }
                state.borrow_mut().permit = std::mem::take(permit);
            }
            state.borrow_mut().stage = Stage::Waiting;
        }
        (Outcome::Continue | Outcome::Resume | Outcome::Reply, Some(verdict)) => {
            finish(host, state, outcome, verdict, permit, now);
            if let Outcome::Resume = outcome {
                return host.resume().then_some(outcome);
            }
        }
        // A paused request decided before: it goes on as it was told.
        (Outcome::Resume, None) => {
            if !host.resume() {
                return None;
            }
            state.borrow_mut().stage = Stage::Passed;
        }
        // What its client took goes back undone; a permit still in its
        // state goes back when its stream ends.
        (Outcome::GiveBack, _) => give_back(host, std::mem::take(permit)),
        // Not reached: a verdict that pauses or finishes a request comes with it.
        (Outcome::Continue | Outcome::Reply | Outcome::Pause(_), None) => {}
    }
    Some(outcome)
}

/// A request the host could not pause: a delayed one goes on at once with
/// what it took; one that would wait for a refill is decided as one that
/// waited out its wait.
fn cannot_pause<H: RequestHost>(
    host: &H,
    site: Site,
    request: RequestRef<'_>,
    wait: Wait,
    verdict: Verdict,
    permit: Permit,
    now: Nanos,
) -> Outcome {
    log::warn!("floodgate: a request cannot be paused; it is decided as one that cannot wait");
    match wait {
        Wait::Delay { .. } => {
            let go_on = match site {
                Site::Handler => Outcome::Continue,
                Site::Root => Outcome::Resume,
            };
            let (mut verdict, mut permit) = (verdict, permit);
            act(host, site, request, go_on, Some(&mut verdict), &mut permit, now).unwrap_or(go_on)
        }
        Wait::Refill { .. } | Wait::Answer => {
            give_back(host, permit);
            decide(host, site, request, now, true)
        }
    }
}

/// Records a final verdict in a request's state, and answers it with a
/// local reply if it is limited.
fn finish<H: RequestHost>(
    host: &H,
    state: &Shared,
    outcome: Outcome,
    verdict: &Verdict,
    permit: &mut Permit,
    now: Nanos,
) {
    let limiter = host.limiter();
    shadow_limited(host.shadow_log(), limiter, verdict, now);
    {
        let mut state = state.borrow_mut();
        limiter.render_headers(verdict, &mut state.headers);
        state.permit = std::mem::take(permit);
        if outcome != Outcome::Reply {
            state.stage = Stage::Passed;
            return;
        }
        state.stage = Stage::Limited;
    }
    let response = limiter.response();
    host.reply(state, response.status, response.body.as_bytes());
}

/// Finishes a paused request with the verdict settled from its check's
/// answer: switches to it (`waiter`, if it still waits), and resumes it or
/// answers it as limited; gives its permit back if its client has gone.
pub fn finish_paused<H: RequestHost>(host: &H, waiter: Option<&Waiter>, verdict: Verdict, permit: Permit, now: Nanos) {
    let event = match waiter {
        Some(waiter) if host.switch_to(waiter.context_id) => {
            Event::Answered { verdict: &verdict, since: waiter.since, now }
        }
        _ => Event::Gone,
    };
    match (outcome::next(Site::Root, event), waiter) {
        (outcome, Some(waiter)) => {
            let (mut verdict, mut permit) = (verdict, permit);
            act(host, Site::Root, RequestRef::of(waiter), outcome, Some(&mut verdict), &mut permit, now);
        }
        (_, None) => give_back(host, permit),
    }
}

/// [`QuotaHost::checked`] for a host that keeps paused requests: request
/// `context_id`'s check is settled, and it is finished.
pub fn finish_checked<H: RequestHost>(host: &H, context_id: u32, verdict: Verdict, permit: Permit, now: Nanos) {
    let waiter = host.waiting().borrow_mut().remove(context_id);
    finish_paused(host, waiter.as_ref(), verdict, permit, now);
}

/// Looks at a paused request taken from the waiting list because it is due
/// ([`Wait::is_due`]): switched to, a delay that is over goes on, a request
/// waiting for a refill is decided again on its pool (`waited_out` once its
/// wait is over), and one whose client has gone is counted abandoned.
pub fn finish_waiter<H: RequestHost>(host: &H, waiter: Waiter, now: Nanos) {
    let request = RequestRef::of(&waiter);
    if !host.switch_to(waiter.context_id) {
        // Its client has gone: its stream's end gave back what its state held.
        act(host, Site::Root, request, outcome::next(Site::Root, Event::Gone), None, &mut Permit::default(), now);
        if let Wait::Delay { .. } = waiter.wait {
            host.count(Counter::DelayAbandoned, 1);
        }
        return;
    }
    match waiter.wait {
        Wait::Delay { resume_at } => {
            let outcome = outcome::next(Site::Root, Event::DelayOver);
            if act(host, Site::Root, request, outcome, None, &mut Permit::default(), now).is_some() {
                host.count(Counter::Delayed, 1);
                host.count(Counter::DelayRequestedMs, (resume_at - waiter.since).ceil_millis());
                host.count(Counter::DelayActualMs, (now - waiter.since).ceil_millis());
            } else {
                host.count(Counter::DelayAbandoned, 1);
            }
        }
        Wait::Refill { deadline } => {
            let waited_out = now >= deadline;
            let outcome = decide(host, Site::Root, request, now, waited_out);
            if !matches!(outcome, Outcome::Pause(_)) {
                host.count(Counter::RefillWaits, 1);
                host.count(Counter::RefillWaitMs, (now - waiter.since).ceil_millis());
            }
            if waited_out && outcome == Outcome::Reply {
                host.count(Counter::RefillWaitedOut, 1);
            }
        }
        Wait::Answer => {}
    }
}

/// A request's stream ended (completed, reset or failed): its permit goes
/// back. One still waiting was never served: its client has gone, and what
/// it took (and what its check holds) is undone; a served one releases what
/// it held while in flight. True when anything was counted or given back.
pub fn ended<H: RequestHost>(host: &H, context_id: u32, state: &Shared) -> bool {
    let waiting = state.borrow().stage == Stage::Waiting;
    if waiting && host.waiting().borrow_mut().remove(context_id).is_some() {
        let permit = std::mem::take(&mut state.borrow_mut().permit);
        host.count(Counter::DelayAbandoned, 1);
        let outcome = outcome::next(Site::Handler, Event::Gone);
        let checked = host.callouts().borrow_mut().forget(context_id);
        // Giving back reads neither when it arrived nor the time.
        let request = RequestRef { context_id, state, since: Nanos::ZERO };
        for mut permit in checked.into_iter().chain([permit]) {
            act(host, Site::Handler, request, outcome, None, &mut permit, Nanos::ZERO);
        }
        true
    } else {
        // Most served requests hold nothing in flight: their permit is left
        // as it is (nothing reads it once the stream ended), not moved out.
        if !host.limiter().needs_release(&state.borrow().permit, Release::Done) {
            return false;
        }
        let permit = std::mem::take(&mut state.borrow_mut().permit);
        release(host, permit, Release::Done)
    }
}

/// What a request whose client has gone took goes back, undone: it was
/// never served.
pub fn give_back<H: QuotaHost>(host: &H, permit: Permit) {
    release(host, permit, Release::Undo);
}

/// Gives back a permit's units for `why`; true when it had any to give
/// back (the clock is read only then).
pub fn release<H: QuotaHost>(host: &H, permit: Permit, why: Release) -> bool {
    let limiter = host.limiter();
    if !limiter.needs_release(&permit, why) {
        return false;
    }
    limiter.release(&host.store(), host.now(), permit, why, &mut host.counters());
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::client;
    use crate::testing::{FakeWorker, ONE_TOKEN, T0};

    /// A global rule per API key, leasing (`mode` may make it check), with
    /// a local fall-back of 2 a minute.
    fn global(mode: &str) -> String {
        format!(
            r#"{{"global": {{"cluster": "quota", "domain": "edge", "timeout": "300ms", "max_wait": "200ms"}},
                "rules": [{{"name": "fleet", "scope": "global", "mode": "{mode}",
                    "descriptors": [{{"request_headers": {{"header_name": "x-api-key", "descriptor_key": "api_key"}}}}],
                    "fallback": {{"limit": 2, "period": "1m"}}}}]}}"#
        )
    }

    /// One request a second, each later one delayed up to 5 s.
    const SHAPER: &str =
        r#"{"rules": [{"name": "paced", "algorithm": "shaper", "limit": 10, "period": "10s", "max_delay": "5s"}]}"#;

    /// The host arranges a wake-up for a delay and for a refill; a request
    /// waiting for its check is woken by the answer, so none is asked for.
    #[test]
    fn the_host_is_told_of_delays_and_refills_not_of_checks() {
        let worker = FakeWorker::new(SHAPER);
        assert_eq!(worker.arrive(1, "a").1, Outcome::Continue);
        let delay = Wait::Delay { resume_at: T0 + Nanos::from_secs(1) };
        assert_eq!(worker.arrive(2, "a").1, Outcome::Pause(delay));
        assert_eq!(*worker.paused.borrow(), [delay]);

        let worker = FakeWorker::new(&global("lease"));
        let refill = Wait::Refill { deadline: T0 + Nanos::from_millis(200) };
        assert_eq!(worker.arrive(1, "a").1, Outcome::Pause(refill));
        assert_eq!(*worker.paused.borrow(), [refill]);

        let worker = FakeWorker::new(&global("check"));
        assert_eq!(worker.arrive(1, "a").1, Outcome::Pause(Wait::Answer));
        assert!(worker.paused.borrow().is_empty());
        assert_eq!(worker.waiting.borrow_mut().take_due(T0, false).len(), 0, "an answer is never due on a timer");
    }

    /// A delayed request the host cannot pause goes on at once, with what it
    /// took: never left paused with nothing to wake it.
    #[test]
    fn a_delay_the_host_cannot_wait_out_goes_on_at_once() {
        let worker = FakeWorker::new(SHAPER);
        worker.can_pause.set(false);
        assert_eq!(worker.arrive(1, "a").1, Outcome::Continue);
        let (state, outcome) = worker.arrive(2, "a");
        assert_eq!(outcome, Outcome::Continue);
        assert_eq!(state.borrow().stage, Stage::Passed);
        assert!(worker.waiting.borrow_mut().remove(2).is_none(), "not left in the waiting list");
    }

    /// A request the host cannot pause for a refill is decided as one that
    /// waited out its wait: denied while the service answers (its refresh
    /// still claimed and handed over), the fall-back's while it fails.
    #[test]
    fn a_refill_the_host_cannot_wait_for_is_decided_as_waited_out() {
        let worker = FakeWorker::new(&global("lease"));
        worker.can_pause.set(false);
        let (state, outcome) = worker.arrive(1, "a");
        assert_eq!(outcome, Outcome::Reply);
        assert_eq!((worker.replies.borrow().clone(), state.borrow().stage), (vec![429], Stage::Limited));
        assert_eq!(worker.handed.borrow().len(), 1, "the refresh it claimed leaves all the same");
        assert!(worker.waiting.borrow_mut().remove(1).is_none());

        worker.limiter.record_callout(&worker.store, T0, 0, false);
        assert_eq!(worker.arrive(2, "b").1, Outcome::Continue, "the fall-back's 2 a minute decides");
    }

    /// A request waiting for a refill: its refresh is handed over and
    /// counted, and once the lease's answer is applied it is looked at
    /// again and resumed, its wait counted.
    #[test]
    fn a_refill_waiter_goes_on_once_its_lease_is_applied() {
        let worker = FakeWorker::new(&global("lease"));
        let (state, _) = worker.arrive(1, "a");
        assert_eq!(worker.count_of(Counter::Refreshes), 1);
        let handed = std::mem::take(&mut *worker.handed.borrow_mut());
        worker.callouts.borrow_mut().refresh(handed, T0);
        client::send_queued(&worker);
        assert_eq!(*worker.calls.borrow(), [(1, "/v1/lease".to_string())]);
        worker.clock.advance(Nanos::from_millis(5));
        assert!(client::answer(&worker, 1, || Some(200), Ok(ONE_TOKEN)), "a lease's answer may refill pools");
        let due = worker.waiting.borrow_mut().take_due(worker.now(), true);
        for waiter in due {
            finish_waiter(&worker, waiter, worker.now());
        }
        assert_eq!((worker.resumed.get(), state.borrow().stage), (1, Stage::Passed));
        assert_eq!((worker.count_of(Counter::RefillWaits), worker.count_of(Counter::RefillWaitMs)), (1, 5));
        assert_eq!(worker.count_of(Counter::RefillWaitedOut), 0);
    }

    /// A request whose lease's answer has not come by the end of its wait
    /// is answered as limited, and counted apart from the limits reached:
    /// the one 429 a slow quota service causes below every limit.
    #[test]
    fn a_refill_waiter_whose_wait_runs_out_is_limited_and_counted_as_waited_out() {
        let worker = FakeWorker::new(&global("lease"));
        let (state, _) = worker.arrive(1, "a");
        let look_again = |after_ms| {
            worker.clock.advance(Nanos::from_millis(after_ms));
            let due = worker.waiting.borrow_mut().take_due(worker.now(), false);
            for waiter in due {
                finish_waiter(&worker, waiter, worker.now());
            }
        };
        look_again(199);
        assert_eq!((worker.replies.borrow().len(), state.borrow().stage), (0, Stage::Waiting), "it waits on");
        look_again(1);
        assert_eq!((worker.replies.borrow().clone(), state.borrow().stage), (vec![429], Stage::Limited));
        assert_eq!((worker.count_of(Counter::RefillWaits), worker.count_of(Counter::RefillWaitedOut)), (1, 1));
    }

    /// A request's check sent as its own call leaves alone (another
    /// request's stays queued), once; when the request ends before its
    /// answer, the call is forgotten with it (the host cancels it).
    #[test]
    fn a_check_sent_as_its_requests_call_leaves_alone_and_is_forgotten_with_it() {
        let worker = FakeWorker::new(&global("check"));
        let (first, _) = worker.arrive(1, "a");
        worker.arrive(2, "b");
        client::send_check(&worker, 1);
        assert_eq!(*worker.calls.borrow(), [(1, "/v1/check".to_string())]);
        client::send_check(&worker, 1);
        assert_eq!(worker.calls.borrow().len(), 1, "sent once");
        assert!(worker.callouts.borrow().has_outgoing(T0), "the other request's check is still queued");
        worker.live.borrow_mut().remove(&1);
        assert!(ended(&worker, 1, &first), "ended while waiting: counted");
        assert!(worker.callouts.borrow_mut().answered(1).is_none(), "its call is forgotten");
        client::send_queued(&worker);
        assert_eq!(worker.calls.borrow().last(), Some(&(2, "/v1/check".to_string())));
    }

    /// A check the host cannot send settles at once by the rule's
    /// fall-back, which switches the rule: the request goes on.
    #[test]
    fn a_check_that_cannot_be_sent_is_decided_by_the_fallback_at_once() {
        let worker = FakeWorker::new(&global("check"));
        worker.can_send.set(false);
        let (state, outcome) = worker.arrive(1, "a");
        assert_eq!(outcome, Outcome::Pause(Wait::Answer));
        client::send_queued(&worker);
        assert_eq!((worker.failed.get(), worker.modes_changed.get()), (1, 1));
        assert!(worker.checked.borrow()[0].allowed());
        assert_eq!((worker.resumed.get(), state.borrow().stage), (1, Stage::Passed));
    }
}
