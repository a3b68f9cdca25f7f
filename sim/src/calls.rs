//! One worker's calls to the quota service, batched by the filter's rule
//! (`Callouts` in the filter: `has_outgoing`, `refresh`, `give_back`,
//! `take_outgoing`), over any item type: the fleet simulation queues its
//! pools' real refreshes and returns here, the calls model
//! ([`crate::replay`]) queues weightless stand-ins of them. Its constants
//! are the core's, the same ones the filter uses: a refresh no request
//! waits for is held until its claim's `send_by` (the core caps that at
//! `MAX_BATCH_DELAY`, or a `RENEWAL_ROUND` for an allowance's renewal, and
//! never before its `not_before`), a return a `RENEWAL_ROUND`, and a call
//! carries at most `MAX_ITEMS`.

use floodgate_core::global::calls::MAX_ITEMS;
use floodgate_core::lease::pool::RENEWAL_ROUND;
use floodgate_core::time::Nanos;

/// When a refresh may and must leave (its claim's `not_before` and `send_by`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// The earliest instant its call may leave.
    pub not_before: Nanos,
    /// The latest: a refresh a request waits for has it at its claim.
    pub send_by: Nanos,
}

/// What one worker holds to send.
#[derive(Debug, Clone)]
pub struct Batcher<L, R> {
    now: Vec<L>,
    held: Vec<(Timing, L)>,
    returns: Vec<R>,
    hold_until: Option<Nanos>,
}

impl<L, R> Default for Batcher<L, R> {
    fn default() -> Self {
        Batcher { now: Vec::new(), held: Vec::new(), returns: Vec::new(), hold_until: None }
    }
}

/// The calls that leave together: lease calls of at most [`MAX_ITEMS`]
/// refreshes, then return calls of at most [`MAX_ITEMS`] returns.
#[derive(Debug)]
pub struct Outgoing<L, R> {
    /// Each lease call's refreshes.
    pub leases: Vec<Vec<L>>,
    /// Each return call's returns.
    pub returns: Vec<Vec<R>>,
}

impl<L, R> Batcher<L, R> {
    fn hold(&mut self, until: Nanos) {
        self.hold_until = Some(self.hold_until.map_or(until, |held| held.min(until)));
    }

    /// When what is held back must leave, if anything is.
    pub fn hold_until(&self) -> Option<Nanos> {
        self.hold_until
    }

    /// Queues a refresh claimed at `now`: at once, or held back until its
    /// `send_by`.
    pub fn refresh(&mut self, timing: Timing, item: L, now: Nanos) {
        if timing.send_by <= now {
            self.now.push(item);
        } else {
            self.hold(timing.send_by);
            self.held.push((timing, item));
        }
    }

    /// Queues a return, to leave within a renewal round of `now`.
    pub fn give_back(&mut self, item: R, now: Nanos) {
        self.returns.push(item);
        self.hold(now + RENEWAL_ROUND);
    }

    /// True when something must be sent at `now`: what a request waits for,
    /// what was held back as long as it may be, or a call's worth of it.
    pub fn has_outgoing(&self, now: Nanos) -> bool {
        !self.now.is_empty()
            || self.hold_until.is_some_and(|until| until <= now)
            || (self.held.len() >= MAX_ITEMS
                && self.held.iter().filter(|(t, _)| t.not_before <= now).count() >= MAX_ITEMS)
            || self.returns.len() >= MAX_ITEMS
    }

    /// Takes what must leave at `now` as calls, if anything must: every
    /// refresh whose `not_before` has come goes along, and every return.
    pub fn take_outgoing(&mut self, now: Nanos) -> Outgoing<L, R> {
        let mut out = Outgoing { leases: Vec::new(), returns: Vec::new() };
        if !self.has_outgoing(now) {
            return out;
        }
        let mut refreshes = std::mem::take(&mut self.now);
        let (ready, later): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.held).into_iter().partition(|(t, _)| t.not_before <= now);
        self.held = later;
        self.hold_until = self.held.iter().map(|(t, _)| t.send_by).min();
        refreshes.extend(ready.into_iter().map(|(_, item)| item));
        let mut chunks = refreshes.into_iter().peekable();
        while chunks.peek().is_some() {
            out.leases.push(chunks.by_ref().take(MAX_ITEMS).collect());
        }
        let mut returns = std::mem::take(&mut self.returns).into_iter().peekable();
        while returns.peek().is_some() {
            out.returns.push(returns.by_ref().take(MAX_ITEMS).collect());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use floodgate_core::lease::pool::MAX_BATCH_DELAY;
    use floodgate_core::time::SECOND;

    const T0: Nanos = Nanos::from_secs(1_700_000_000);

    fn at(t: Nanos) -> Timing {
        Timing { not_before: T0, send_by: t }
    }

    #[test]
    fn what_a_request_waits_for_leaves_at_once_with_whatever_is_held_and_due() {
        let mut b: Batcher<u32, u32> = Batcher::default();
        b.refresh(at(T0 + MAX_BATCH_DELAY), 1, T0);
        b.refresh(Timing { not_before: T0 + SECOND, send_by: T0 + SECOND.times(2) }, 2, T0);
        b.give_back(9, T0);
        assert!(!b.has_outgoing(T0));
        assert_eq!(b.hold_until(), Some(T0 + MAX_BATCH_DELAY));
        b.refresh(at(T0), 3, T0 + Nanos::from_millis(1));
        let out = b.take_outgoing(T0 + Nanos::from_millis(1));
        assert_eq!(out.leases, vec![vec![3, 1]], "the renewal waits for its not_before");
        assert_eq!(out.returns, vec![vec![9]]);
        assert_eq!(b.hold_until(), Some(T0 + SECOND.times(2)));
    }

    #[test]
    fn returns_alone_leave_within_a_round() {
        let mut b: Batcher<u32, u32> = Batcher::default();
        b.give_back(1, T0);
        b.give_back(2, T0 + Nanos::from_millis(300));
        assert!(!b.has_outgoing(T0 + RENEWAL_ROUND - Nanos::ONE));
        let out = b.take_outgoing(T0 + RENEWAL_ROUND);
        assert_eq!(out.returns, vec![vec![1, 2]]);
        assert!(out.leases.is_empty());
        assert_eq!(b.hold_until(), None);
    }

    #[test]
    fn a_call_carries_at_most_max_items() {
        let mut b: Batcher<usize, u32> = Batcher::default();
        for i in 0..MAX_ITEMS + 1 {
            b.refresh(at(T0), i, T0);
        }
        let out = b.take_outgoing(T0);
        assert_eq!(out.leases.iter().map(Vec::len).collect::<Vec<_>>(), vec![MAX_ITEMS, 1]);
    }
}
