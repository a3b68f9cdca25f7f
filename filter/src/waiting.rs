//! The requests one worker keeps paused for a shaper, and when to wake up.
//!
//! Envoy lets only the worker that paused a request resume it, so every
//! worker (every VM) keeps its own list and resumes from its own tick. The
//! list is bounded; ticks run only while something waits.

use std::time::Duration;

use floodgate_core::time::Nanos;

/// The longest tick period while requests wait: a resume is never later than this.
const MAX_TICK: Duration = Duration::from_millis(10);

/// A paused request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiter {
    /// Envoy's id of the request's context.
    pub context_id: u32,
    /// When it was paused.
    pub since: Nanos,
    /// When it may go on.
    pub resume_at: Nanos,
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

    /// Adds a request; false when the list is full.
    pub fn add(&mut self, context_id: u32, since: Nanos, resume_at: Nanos) -> bool {
        if self.waiters.len() >= self.capacity {
            return false;
        }
        self.waiters.push(Waiter { context_id, since, resume_at });
        true
    }

    /// Removes a request (its client left); false when it was not waiting.
    pub fn remove(&mut self, context_id: u32) -> bool {
        let before = self.waiters.len();
        self.waiters.retain(|w| w.context_id != context_id);
        self.waiters.len() != before
    }

    /// Takes every request due at `now`, earliest first.
    pub fn take_due(&mut self, now: Nanos) -> Vec<Waiter> {
        let (mut due, waiting): (Vec<Waiter>, Vec<Waiter>) = self.waiters.drain(..).partition(|w| w.resume_at <= now);
        self.waiters = waiting;
        due.sort_by_key(|w| w.resume_at);
        due
    }

    /// The tick period that wakes this worker when the next request is due
    /// (whole milliseconds, rounded up, at most [`MAX_TICK`]); zero (no
    /// ticks) when nothing waits.
    pub fn next_tick(&self, now: Nanos) -> Duration {
        match self.waiters.iter().map(|w| w.resume_at).min() {
            None => Duration::ZERO,
            Some(next) => Duration::from_millis((next - now).ceil_millis().max(1)).min(MAX_TICK),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = Nanos(1_000_000);

    #[test]
    fn bounded_and_resumed_in_order() {
        let mut waiting = Waiting::new(2);
        assert!(waiting.add(1, Nanos::ZERO, MS.times(30)));
        assert!(waiting.add(2, Nanos::ZERO, MS.times(5)));
        assert!(!waiting.add(3, Nanos::ZERO, MS), "full");
        assert_eq!(waiting.next_tick(Nanos::ZERO), Duration::from_millis(5));
        assert!(waiting.take_due(MS.times(4)).is_empty());
        let due: Vec<u32> = waiting.take_due(MS.times(40)).iter().map(|w| w.context_id).collect();
        assert_eq!(due, vec![2, 1]);
        assert_eq!(waiting.next_tick(MS.times(40)), Duration::ZERO, "nothing waits: no ticks");
    }

    #[test]
    fn a_client_that_leaves_frees_its_place_and_ticks_stay_coarse() {
        let mut waiting = Waiting::new(1);
        assert!(waiting.add(7, Nanos::ZERO, MS.times(500)));
        assert_eq!(waiting.next_tick(Nanos::ZERO), MAX_TICK);
        assert!(waiting.remove(7));
        assert!(!waiting.remove(7));
        assert!(waiting.add(8, Nanos::ZERO, Nanos(1)));
        assert_eq!(waiting.next_tick(Nanos::ZERO), Duration::from_millis(1));
    }
}
