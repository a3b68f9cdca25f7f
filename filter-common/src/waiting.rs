//! The requests one worker keeps paused, and when to wake up.
//!
//! A request waits for a shaper's delay, for its lease pool to be refilled,
//! or for the quota service's answer to a check. Envoy lets only the worker
//! that paused a request resume it, so every worker keeps its own list (the
//! wasm build: one per VM, finished from its root context on its tick; the
//! native build: one per worker thread, each request woken by its own
//! scheduled event, at its time or when the quota service answered). The
//! list is bounded.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use floodgate_core::headers::HeaderBlock;
use floodgate_core::limiter::Permit;
use floodgate_core::time::Nanos;

/// The longest tick period while requests wait for a delay: a resume is never later than this.
const MAX_TICK: Duration = Duration::from_millis(10);
/// How often a request waiting for a refill looks at its pool again.
const REFILL_TICK: Duration = Duration::from_millis(2);

/// Where a request is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Stage {
    /// Not decided yet.
    #[default]
    Deciding,
    /// Let through (at once, or after waiting).
    Passed,
    /// Paused: in this worker's waiting list.
    Waiting,
    /// Answered as limited.
    Limited,
}

/// What a request's handlers share with its worker's root context, which
/// finishes a paused request: where it is, what it holds, its headers.
#[derive(Debug, Default)]
pub struct RequestState {
    /// Where the request is.
    pub stage: Stage,
    /// What it took from each rule, given back when it ends.
    pub permit: Permit,
    /// Rate-limit headers: added to the upstream's response, or sent with the limited one.
    pub headers: HeaderBlock,
}

/// A request's shared state.
pub type Shared = Rc<RefCell<RequestState>>;

/// What a paused request waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// A shaper's delay, until `resume_at`.
    Delay {
        /// When it may go on.
        resume_at: Nanos,
    },
    /// Tokens in its lease pool; after `deadline` it is decided without them.
    Refill {
        /// The end of its wait.
        deadline: Nanos,
    },
    /// The quota service's answer to its check (bounded by the callout timeout).
    Answer,
}

impl Wait {
    /// Whether a request waiting for this is to be looked at at `now`: a
    /// delay that is over (unless `refills_only`), a refill always (its
    /// pool may have been refilled), an answer never (the answer finishes
    /// it).
    pub fn is_due(&self, now: Nanos, refills_only: bool) -> bool {
        match *self {
            Wait::Delay { resume_at } => !refills_only && resume_at <= now,
            Wait::Refill { .. } => true,
            Wait::Answer => false,
        }
    }
}

/// A paused request.
#[derive(Debug)]
pub struct Waiter {
    /// The request's id on its worker: Envoy's id of its context in the wasm
    /// build, the worker's own number for its stream in the native build.
    pub context_id: u32,
    /// When it was paused.
    pub since: Nanos,
    /// What for.
    pub wait: Wait,
    /// Its state.
    pub request: Shared,
}

/// This worker's paused requests.
#[derive(Debug)]
pub struct Waiting {
    waiters: Vec<Waiter>,
    capacity: usize,
}

impl Waiting {
    /// Room for `capacity` waiting requests.
    pub fn new(capacity: u32) -> Self {
        Self { waiters: Vec::new(), capacity: capacity as usize }
    }

    /// True when another request cannot wait.
    pub fn is_full(&self) -> bool {
        self.waiters.len() >= self.capacity
    }

    /// Adds a request. Whoever pauses one asked [`Waiting::is_full`] first
    /// and told the limiter, which denies a request that cannot wait
    /// (`CanWait::NoRoom`), so the list stays within its capacity.
    pub fn add(&mut self, waiter: Waiter) {
        self.waiters.push(waiter);
    }

    /// Removes a request (its client left, or it was finished); `None` when
    /// it was not waiting.
    pub fn remove(&mut self, context_id: u32) -> Option<Waiter> {
        let at = self.waiters.iter().position(|w| w.context_id == context_id)?;
        Some(self.waiters.swap_remove(at))
    }

    /// Takes every request to look at now: delays that are over, earliest
    /// first (unless `refills_only`), then every request waiting for a refill.
    pub fn take_due(&mut self, now: Nanos, refills_only: bool) -> Vec<Waiter> {
        let due = |w: &Waiter| w.wait.is_due(now, refills_only);
        let (mut taken, kept): (Vec<Waiter>, Vec<Waiter>) = self.waiters.drain(..).partition(due);
        self.waiters = kept;
        taken.sort_by_key(|w| match w.wait {
            Wait::Delay { resume_at } => resume_at,
            Wait::Refill { .. } | Wait::Answer => Nanos::NEVER,
        });
        taken
    }

    /// The tick period that wakes this worker in time for the next waiting
    /// request (whole milliseconds, rounded up); `None` when no waiting
    /// request needs a tick.
    pub fn next_tick(&self, now: Nanos) -> Option<Duration> {
        self.waiters
            .iter()
            .filter_map(|w| match w.wait {
                Wait::Delay { resume_at } => {
                    Some(Duration::from_millis((resume_at - now).ceil_millis().max(1)).min(MAX_TICK))
                }
                Wait::Refill { .. } => Some(REFILL_TICK),
                Wait::Answer => None,
            })
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = Nanos::from_nanos(1_000_000);

    fn waiter(context_id: u32, wait: Wait) -> Waiter {
        Waiter { context_id, since: Nanos::ZERO, wait, request: Shared::default() }
    }

    #[test]
    fn bounded_and_resumed_in_order() {
        let mut waiting = Waiting::new(2);
        waiting.add(waiter(1, Wait::Delay { resume_at: MS.times(30) }));
        assert!(!waiting.is_full());
        waiting.add(waiter(2, Wait::Delay { resume_at: MS.times(5) }));
        assert!(waiting.is_full());
        assert_eq!(waiting.next_tick(Nanos::ZERO), Some(Duration::from_millis(5)));
        assert!(waiting.take_due(MS.times(4), false).is_empty());
        let due: Vec<u32> = waiting.take_due(MS.times(40), false).iter().map(|w| w.context_id).collect();
        assert_eq!(due, vec![2, 1]);
        assert_eq!(waiting.next_tick(MS.times(40)), None, "nothing waits: no ticks");
    }

    #[test]
    fn refills_are_looked_at_every_tick_and_answers_need_none() {
        let mut waiting = Waiting::new(4);
        waiting.add(waiter(1, Wait::Answer));
        assert_eq!(waiting.next_tick(Nanos::ZERO), None, "the callout's answer wakes it");
        waiting.add(waiter(2, Wait::Refill { deadline: MS.times(200) }));
        assert_eq!(waiting.next_tick(Nanos::ZERO), Some(REFILL_TICK));
        let due: Vec<u32> = waiting.take_due(Nanos::ZERO, false).iter().map(|w| w.context_id).collect();
        assert_eq!(due, vec![2]);
        assert_eq!(waiting.remove(1).map(|w| w.context_id), Some(1));
        assert!(waiting.remove(1).is_none());
    }

    #[test]
    fn a_client_that_leaves_frees_its_place_and_ticks_stay_coarse() {
        let mut waiting = Waiting::new(1);
        waiting.add(waiter(7, Wait::Delay { resume_at: MS.times(500) }));
        assert_eq!(waiting.next_tick(Nanos::ZERO), Some(MAX_TICK));
        assert!(waiting.remove(7).is_some());
        waiting.add(waiter(8, Wait::Delay { resume_at: Nanos::from_nanos(1) }));
        assert_eq!(waiting.next_tick(Nanos::ZERO), Some(Duration::from_millis(1)));
    }
}
