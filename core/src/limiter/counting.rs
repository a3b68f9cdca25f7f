//! What the limiter counts, and how: the events the host turns into metrics,
//! and the bookkeeping every store operation shares (retries, exhausted
//! retries, store errors, reused and corrupt slots, full groups).

use crate::store::{LoopError, Replaced};
use crate::table::Slot;

use crate::algorithm::Admission;

use super::{CompiledRule, Limiter, Permit, Verdict};

/// A per-rule outcome worth counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleEvent {
    /// The rule admitted a request that was let through.
    Allowed,
    /// The rule admitted a request only after a delay (counted besides `Allowed`).
    Delayed,
    /// The rule denied a request, which was answered as limited.
    Limited,
    /// The rule would have denied, but is in shadow mode.
    ShadowLimited,
    /// A global rule decided by its fall-back: the quota service was failing.
    Fallback,
    /// A global rule's pool admitted a request's units without a lease,
    /// under the rule's overshoot budget (counted when the budget is
    /// spent, whatever the request's other rules then decide).
    Overshoot,
}

/// What became of a request, counted once when its verdict is final (a
/// request that waits for the quota service is counted when it is settled).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestEvent {
    /// Let through, at once or after a delay.
    Allowed,
    /// Answered as limited.
    Limited,
    /// A rule in shadow mode would have denied it (counted besides the above).
    ShadowLimited,
    /// It would have waited, but its worker keeps as many paused requests
    /// as it may: denied instead (counted besides `Limited`).
    NoRoomToWait,
}

/// A store-level occurrence worth counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreEvent {
    /// Writes that lost a race and were decided again.
    CasRetries,
    /// Decisions abandoned after the last retry; the failure mode applied.
    RetriesExhausted,
    /// Idle buckets of other descriptors reused.
    SlotEvictions,
    /// New descriptors that found every bucket of their group live; the
    /// failure mode applied.
    TableFull,
    /// Shared-data reads or writes that failed; the failure mode applied.
    StoreErrors,
    /// Stored groups that did not decode and were started afresh.
    CorruptState,
}

/// Receives what the limiter counts. The filter maps these to Envoy metrics,
/// whose ids it keeps in each rule's `host` data.
pub trait Counters<H> {
    /// Counts what became of one request.
    fn request(&mut self, event: RequestEvent);
    /// Counts one per-rule outcome.
    fn rule(&mut self, rule: &CompiledRule<H>, event: RuleEvent);
    /// Counts `count` store occurrences.
    fn store(&mut self, event: StoreEvent, count: u64);
    /// Adds `change` to the units `rule` holds in flight, summed over its
    /// buckets and over every worker's writes (algorithms that hold units
    /// until requests are done; holds that expired leave the sum when their
    /// bucket is next written).
    fn in_flight(&mut self, _rule: &CompiledRule<H>, _change: i64) {}
}

impl<H> Limiter<H> {
    /// Counts how a measure-and-replace loop went; its outcome if it succeeded.
    pub(super) fn count_loop<T>(
        &self,
        result: Result<Replaced<T>, LoopError>,
        counters: &mut dyn Counters<H>,
    ) -> Option<T> {
        match result {
            Ok(Replaced { outcome, retries }) => {
                if retries > 0 {
                    counters.store(StoreEvent::CasRetries, u64::from(retries));
                }
                Some(outcome)
            }
            Err(LoopError::RetriesExhausted) => {
                if self.settings.max_cas_retries > 0 {
                    counters.store(StoreEvent::CasRetries, u64::from(self.settings.max_cas_retries));
                }
                counters.store(StoreEvent::RetriesExhausted, 1);
                None
            }
            Err(LoopError::Store(_)) => {
                counters.store(StoreEvent::StoreErrors, 1);
                None
            }
        }
    }

    /// Counts a table operation's loop and slot, and unwraps its value
    /// (`None`: the loop failed or the group was full, both counted).
    pub(super) fn slot_of<T>(
        &self,
        compiled: &CompiledRule<H>,
        result: Result<Replaced<Option<Slot<T>>>, LoopError>,
        counters: &mut dyn Counters<H>,
    ) -> Option<T> {
        match self.count_loop(result, counters)? {
            Some(slot) => {
                if slot.held_change != 0 {
                    counters.in_flight(compiled, slot.held_change);
                }
                if slot.reused_idle {
                    counters.store(StoreEvent::SlotEvictions, 1);
                }
                if slot.was_corrupt {
                    counters.store(StoreEvent::CorruptState, 1);
                }
                Some(slot.value)
            }
            None => {
                counters.store(StoreEvent::TableFull, 1);
                None
            }
        }
    }

    /// Counts what an admitted request's rules did. A rule holds at most one
    /// entry of a permit: `check` decides each rule once, and `settle` adds
    /// only check-mode rules, which `check` left to it.
    pub(super) fn count_admitted(&self, permit: &Permit, counters: &mut dyn Counters<H>) {
        for held in permit.held() {
            let Some(compiled) = self.rules.get(held.rule) else { continue };
            counters.rule(compiled, RuleEvent::Allowed);
            if held.delayed {
                counters.rule(compiled, RuleEvent::Delayed);
            }
        }
    }

    /// Counts a final verdict: what became of the request. A pending one
    /// is counted when it is settled.
    pub(super) fn count_verdict(verdict: &Verdict, counters: &mut dyn Counters<H>) {
        if verdict.admission == Admission::Pending {
            return;
        }
        counters.request(if verdict.allowed() { RequestEvent::Allowed } else { RequestEvent::Limited });
        if verdict.shadow_limited.is_some() {
            counters.request(RequestEvent::ShadowLimited);
        }
    }
}
