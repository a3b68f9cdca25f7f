//! What becomes of a request: the one place that decides whether it goes
//! on, is answered as limited, pauses (for a shaper's delay, a refill of
//! its lease pool, or the quota service's answer), is resumed, or gives
//! back what it took because its client has gone. Pure: each build's host
//! layer carries an [`Outcome`] out (the wasm filter's `Plugin::act`, the
//! native module's stream).

use floodgate_core::algorithm::Admission;
use floodgate_core::limiter::Verdict;
use floodgate_core::time::Nanos;

use crate::waiting::Wait;

/// Where the filter acts on a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Site {
    /// The request's own headers handler: it goes on by returning `Continue`.
    Handler,
    /// A later event on its worker — in the wasm build the worker's root
    /// context (a tick, an answer) switched to the request, in the native
    /// build the stream's scheduled event: a paused request goes on only by
    /// being resumed, and only on the worker that paused it.
    Root,
}

/// What the filter has learnt about a request.
#[derive(Debug, Clone, Copy)]
pub enum Event<'v> {
    /// The limiter's verdict at `now`: on the request's arrival, or again
    /// when its lease pool may have been refilled. It has waited since
    /// `since`, and may wait for a refill `max_wait` from then.
    Decided {
        /// The verdict.
        verdict: &'v Verdict,
        /// When the request arrived.
        since: Nanos,
        /// Now.
        now: Nanos,
        /// How long a request may wait for a refill.
        max_wait: Nanos,
    },
    /// The quota service answered its check: the verdict settled from the
    /// answer (or the fall-back), final. A shaper's delay deferred behind
    /// the check still holds: from `since`, when the request arrived and
    /// the shaper gave it its time; it goes on once that is over.
    Answered {
        /// The verdict.
        verdict: &'v Verdict,
        /// When the request arrived.
        since: Nanos,
        /// Now.
        now: Nanos,
    },
    /// Its shaper's delay is over.
    DelayOver,
    /// The root could not switch to it: its client has gone.
    Gone,
}

/// What becomes of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// It goes on: its handler returns `Continue`.
    Continue,
    /// A paused request goes on: resumed from the root, in its context.
    Resume,
    /// It is answered as limited by a local reply, and never resumed.
    Reply,
    /// It pauses (or stays paused), in its worker's waiting list.
    Pause(Wait),
    /// Its client has gone: what the filter holds for it goes back, undone
    /// (it was never served), and nothing is resumed.
    GiveBack,
}

/// The one decision: what becomes of a request, at `site`, on `event`.
pub fn next(site: Site, event: Event<'_>) -> Outcome {
    match event {
        Event::Gone => Outcome::GiveBack,
        Event::DelayOver => Outcome::Resume,
        Event::Answered { verdict, since, now } => match verdict.admission {
            Admission::Delayed(delay) if now < since + delay => {
                Outcome::Pause(Wait::Delay { resume_at: since + delay })
            }
            _ => finish(site, verdict),
        },
        Event::Decided { verdict, since, now, max_wait } => match verdict.admission {
            Admission::Delayed(delay) => Outcome::Pause(Wait::Delay { resume_at: now + delay }),
            Admission::Pending if !verdict.checks.is_empty() => Outcome::Pause(Wait::Answer),
            Admission::Pending => Outcome::Pause(Wait::Refill { deadline: since + max_wait }),
            Admission::Now | Admission::Denied { .. } => finish(site, verdict),
        },
    }
}

/// A final verdict: a request goes on, or is answered as limited.
fn finish(site: Site, verdict: &Verdict) -> Outcome {
    match (verdict.allowed(), site) {
        (false, _) => Outcome::Reply,
        (true, Site::Handler) => Outcome::Continue,
        (true, Site::Root) => Outcome::Resume,
    }
}

impl Outcome {
    /// Whether the request's handler lets it go on by returning: only
    /// [`Outcome::Continue`]. Anything else stops it there (a local reply
    /// ends it; a paused request waits to be resumed).
    pub fn goes_on(self) -> bool {
        self == Outcome::Continue
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = Nanos::from_millis(1);

    fn verdict(admission: Admission) -> Verdict {
        let mut verdict = Verdict::default();
        verdict.admission = admission;
        verdict
    }

    fn decided(site: Site, verdict: &Verdict) -> Outcome {
        next(site, Event::Decided { verdict, since: MS, now: MS.times(3), max_wait: MS.times(200) })
    }

    /// An admission goes on as its site lets it; a denial is answered; a
    /// delay and a refill pause until when they end.
    #[test]
    fn a_verdict_decides_continue_reply_or_pause() {
        let now = verdict(Admission::Now);
        assert_eq!((decided(Site::Handler, &now), decided(Site::Root, &now)), (Outcome::Continue, Outcome::Resume));
        let denied = verdict(Admission::Denied { retry_after: MS });
        assert_eq!((decided(Site::Handler, &denied), decided(Site::Root, &denied)), (Outcome::Reply, Outcome::Reply));
        let delayed = verdict(Admission::Delayed(MS.times(5)));
        assert_eq!(decided(Site::Handler, &delayed), Outcome::Pause(Wait::Delay { resume_at: MS.times(8) }));
        let pending = verdict(Admission::Pending);
        assert_eq!(decided(Site::Root, &pending), Outcome::Pause(Wait::Refill { deadline: MS.times(201) }));
        assert!(Outcome::Continue.goes_on());
        assert!(!Outcome::Reply.goes_on() && !Outcome::Resume.goes_on() && !Outcome::GiveBack.goes_on());
    }

    /// A paused request is resumed when its delay is over or its check is
    /// answered yes, answered as limited on a no, and given back when its
    /// client has gone, whatever it waited for.
    #[test]
    fn a_paused_request_is_resumed_answered_or_given_back() {
        assert_eq!(next(Site::Root, Event::DelayOver), Outcome::Resume);
        fn answered(verdict: &Verdict) -> Event<'_> {
            Event::Answered { verdict, since: MS, now: MS.times(3) }
        }
        assert_eq!(next(Site::Root, answered(&verdict(Admission::Now))), Outcome::Resume);
        let no = verdict(Admission::Denied { retry_after: MS });
        assert_eq!(next(Site::Root, answered(&no)), Outcome::Reply);
        // A shaper's delay behind the check: until its time, from arrival.
        let delayed = verdict(Admission::Delayed(MS.times(5)));
        assert_eq!(next(Site::Root, answered(&delayed)), Outcome::Pause(Wait::Delay { resume_at: MS.times(6) }));
        let over = verdict(Admission::Delayed(MS));
        assert_eq!(next(Site::Root, answered(&over)), Outcome::Resume, "its time is over: on at once");
        assert_eq!(next(Site::Root, Event::Gone), Outcome::GiveBack);
    }
}
