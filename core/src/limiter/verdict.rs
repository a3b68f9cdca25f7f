//! What a request is told — its [`Verdict`] — and what it holds while it is
//! served: its [`Permit`].

use crate::algorithm::{Admission, Decision, Grant, Quota};
use crate::global::calls::{CheckItem, Refresh};
use crate::time::Nanos;

use super::rule::Bucket;

/// The rule whose numbers a response reports: the one that denied, or else
/// the most restrictive that admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// Index of the rule in [`super::Limiter::rules`].
    pub rule: usize,
    /// Its decision.
    pub decision: Decision,
    /// The limit as the quota service last stated it, for a global rule
    /// (a local rule's is in its configuration).
    pub quota: Option<Quota>,
}

impl Report {
    /// Of `current` and `candidate`, the one with fewer units remaining; on a
    /// tie, the one that takes longer to recover.
    pub(super) fn more_restrictive(current: Option<Report>, candidate: Report) -> Report {
        let key = |r: &Report| (r.decision.remaining, std::cmp::Reverse(r.decision.reset));
        match current {
            Some(current) if key(&current) <= key(&candidate) => current,
            _ => candidate,
        }
    }
}

/// Whether a request may be paused: for a shaper's delay, a refill of its
/// lease pool, or the quota service's answer. The host says; the limiter
/// decides what a request that cannot wait is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CanWait {
    /// It may wait.
    Yes,
    /// It waited for a refill as long as it may: an empty pool now denies
    /// it (or, while the quota service fails, the rule's fall-back decides).
    WaitedOut,
    /// Its worker keeps as many paused requests as it may: a request that
    /// would wait is denied instead, and takes nothing.
    NoRoom,
}

/// The verdict on one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// Go on now, after a delay (the longest any rule asked for), deny, or
    /// pending an answer from the quota service.
    pub admission: Admission,
    /// The first rule in shadow mode that would have denied it, if any.
    pub shadow_limited: Option<usize>,
    /// Some rule could not decide and the failure mode applied.
    pub failed: bool,
    /// The numbers for the rate-limit headers, if any rule decided.
    pub report: Option<Report>,
    /// Refreshes of lease pools this request claimed: the host asks the
    /// quota service for each, whatever the verdict.
    pub refreshes: Vec<Refresh>,
    /// Check-mode rules to ask the quota service about (admission pending).
    pub checks: Vec<CheckItem>,
    /// While checks are pending: the delay the other rules asked for, for
    /// [`super::Limiter::settle`] to restore.
    pub(super) deferred_delay: Nanos,
}

impl Default for Verdict {
    fn default() -> Self {
        Verdict {
            admission: Admission::Now,
            shadow_limited: None,
            failed: false,
            report: None,
            refreshes: Vec::new(),
            checks: Vec::new(),
            deferred_delay: Nanos::ZERO,
        }
    }
}

impl Verdict {
    /// Makes this verdict as [`Verdict::default`] makes one, keeping its
    /// lists' room (and not dropping lists a fresh verdict has empty).
    pub(super) fn reset(&mut self) {
        self.admission = Admission::Now;
        self.shadow_limited = None;
        self.failed = false;
        self.report = None;
        self.refreshes.clear();
        self.checks.clear();
        self.deferred_delay = Nanos::ZERO;
    }

    /// True when admitted, at once or after a delay.
    pub fn allowed(&self) -> bool {
        self.admission.allowed()
    }

    /// The wait before the request goes on: zero unless delayed.
    pub fn delay(&self) -> Nanos {
        self.admission.delay()
    }
}

/// What one rule took for an admitted request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Held {
    /// Index of the rule.
    pub rule: usize,
    /// Which of its tables the units came from.
    pub bucket: Bucket,
    /// The descriptor's fingerprint (its group follows from it).
    pub fingerprint: u64,
    /// What was taken, and when.
    pub grant: Grant,
    /// The rule made the request wait (counted once it goes on).
    pub delayed: bool,
}

/// How many rules' holdings a permit keeps without allocating: a request
/// under more rules than this spills the rest to the heap.
const INLINE_HOLDINGS: usize = 4;

/// What an admitted request took from each rule, to be given back through
/// [`super::Limiter::release`]. Not `Clone`: units are given back once.
/// Kept inline for the common request of a few rules: a permit costs no
/// allocation.
#[derive(Debug, Default, PartialEq, Eq)]
#[must_use = "a permit holds units until it is released"]
pub struct Permit {
    inline: [Option<Held>; INLINE_HOLDINGS],
    spilled: Vec<Held>,
}

impl Permit {
    /// True when it holds nothing to give back (rules the quota service
    /// decided hold nothing here).
    pub fn is_empty(&self) -> bool {
        self.held().all(|held| held.bucket == Bucket::Service)
    }

    /// What each rule took, in the order the rules decided.
    pub(super) fn held(&self) -> impl DoubleEndedIterator<Item = &Held> {
        self.inline.iter().flatten().chain(&self.spilled)
    }

    /// Makes this permit hold nothing, as [`Permit::default`] makes one.
    pub(super) fn reset(&mut self) {
        self.inline = [None; INLINE_HOLDINGS];
        self.spilled.clear();
    }

    pub(super) fn push(&mut self, held: Held) {
        match self.inline.iter_mut().find(|slot| slot.is_none()) {
            Some(slot) => *slot = Some(held),
            None => self.spilled.push(held),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// A verdict and permit reset for the next request are the ones a
    /// default makes, whatever they held.
    #[test]
    fn a_reset_verdict_and_permit_are_new_ones() {
        let mut verdict = Verdict {
            admission: Admission::Delayed(Nanos::from_secs(1)),
            shadow_limited: Some(2),
            failed: true,
            report: Some(Report { rule: 1, decision: Decision::deny(0, Nanos::ZERO, Nanos::ZERO), quota: None }),
            deferred_delay: Nanos::from_secs(3),
            ..Verdict::default()
        };
        verdict.reset();
        assert_eq!(verdict, Verdict::default());
        let mut permit = Permit::default();
        let held = Held {
            rule: 0,
            bucket: Bucket::Main,
            fingerprint: 9,
            grant: Grant { cost: 1, at: Nanos::ZERO },
            delayed: false,
        };
        for _ in 0..INLINE_HOLDINGS + 2 {
            permit.push(held);
        }
        assert!(!permit.spilled.is_empty());
        permit.reset();
        assert_eq!(permit, Permit::default());
    }
}
