//! The filter's metrics, as both builds name them: every counter and gauge
//! the limiter's events and the filter's own doings move, and the one list
//! of their names. Each build defines them with its host (the wasm build
//! as `wasmcustom.<name>`, the native build under its dynamic module's
//! metrics namespace) and moves them its own way.

use floodgate_core::global::calls::CallError;
use floodgate_core::limiter::{RequestEvent, RuleEvent, StoreEvent};

/// The prefix of every name.
pub const PREFIX: &str = "floodgate";

/// Each store event's counter, after `floodgate.`.
pub const STORE_EVENTS: [(StoreEvent, &str); 6] = [
    (StoreEvent::CasRetries, "cas_retries"),
    (StoreEvent::RetriesExhausted, "retries_exhausted"),
    (StoreEvent::SlotEvictions, "slot_evictions"),
    (StoreEvent::TableFull, "table_full"),
    (StoreEvent::StoreErrors, "store_errors"),
    (StoreEvent::CorruptState, "corrupt_state"),
];

/// Each rule event's counter, after `floodgate.rule.<rule>.`.
pub const RULE_EVENTS: [(RuleEvent, &str); 6] = [
    (RuleEvent::Allowed, "allowed"),
    (RuleEvent::Delayed, "delayed"),
    (RuleEvent::Limited, "limited"),
    (RuleEvent::ShadowLimited, "shadow_limited"),
    (RuleEvent::Fallback, "fallback"),
    (RuleEvent::Overshoot, "overshoot"),
];

/// A rule's gauge of units in flight (algorithms that hold units until a
/// request ends), after `floodgate.rule.<rule>.`.
pub const IN_FLIGHT: &str = "in_flight";

/// A global rule's gauge, 1 while its fall-back is in force, after
/// `floodgate.rule.<rule>.`.
pub const FALLBACK_ACTIVE: &str = "fallback_active";

/// The kinds of failed calls to the quota service, in the order of
/// [`failure_index`]; each is counted as `floodgate.global.callouts_<kind>`.
pub const FAILURES: [&str; 5] = ["not_sent", "refused", "timeout", "bad_status", "bad_answer"];

/// A plugin-wide counter (each rule's are named by [`rule_metric`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    /// Requests let through (whether or not a rule applied).
    Allowed,
    /// Requests answered as limited.
    Limited,
    /// Requests a shadow-mode rule would have limited.
    ShadowLimited,
    /// Requests a shaper delayed, and that went on after waiting.
    Delayed,
    /// Milliseconds of delay the shapers asked for, summed.
    DelayRequestedMs,
    /// Milliseconds delayed requests actually waited, summed.
    DelayActualMs,
    /// Paused requests whose client left while they waited.
    DelayAbandoned,
    /// Requests denied because their worker already had
    /// `max_delayed_per_worker` requests paused.
    DelayQueueFull,
    /// Lease-pool refreshes claimed.
    Refreshes,
    /// Calls sent to the quota service.
    CalloutsSent,
    /// Calls answered usably.
    CalloutsOk,
    /// Tokens granted to this Envoy's pools.
    TokensLeased,
    /// Unspent tokens given back to the service.
    TokensReturned,
    /// Tokens whose lease ended before they were spent.
    TokensExpired,
    /// Requests that waited for an empty pool's refill.
    RefillWaits,
    /// Milliseconds they waited, summed.
    RefillWaitMs,
    /// Requests answered as limited once their wait for a refill reached
    /// `max_wait` with no tokens come: mostly a quota service slower than
    /// `max_wait` (or failing, under a `deny` fall-back), not a limit the
    /// service reached, whose answer ends the wait before.
    RefillWaitedOut,
}

/// Each plugin-wide counter's name (after `floodgate.`), in the order of
/// [`Counter`]: the one list that defines them.
pub const COUNTERS: [(Counter, &str); 17] = [
    (Counter::Allowed, "allowed"),
    (Counter::Limited, "limited"),
    (Counter::ShadowLimited, "shadow_limited"),
    (Counter::Delayed, "delayed"),
    (Counter::DelayRequestedMs, "delay_requested_ms"),
    (Counter::DelayActualMs, "delay_actual_ms"),
    (Counter::DelayAbandoned, "delay_abandoned"),
    (Counter::DelayQueueFull, "delay_queue_full"),
    (Counter::Refreshes, "global.refreshes"),
    (Counter::CalloutsSent, "global.callouts_sent"),
    (Counter::CalloutsOk, "global.callouts_ok"),
    (Counter::TokensLeased, "global.tokens_leased"),
    (Counter::TokensReturned, "global.tokens_returned"),
    (Counter::TokensExpired, "global.tokens_expired"),
    (Counter::RefillWaits, "global.refill_waits"),
    (Counter::RefillWaitMs, "global.refill_wait_ms"),
    (Counter::RefillWaitedOut, "global.refill_waited_out"),
];

/// `floodgate.<name>`: a plugin-wide metric's full name.
pub fn plugin_metric(name: &str) -> String {
    format!("{PREFIX}.{name}")
}

/// `floodgate.rule.<rule>.<metric>`: one of a rule's metrics' full name.
pub fn rule_metric(rule: &str, metric: &str) -> String {
    format!("{PREFIX}.rule.{rule}.{metric}")
}

/// `floodgate.global.callouts_<kind>`: a kind of failed call's counter.
pub fn failure_metric(kind: &str) -> String {
    plugin_metric(&format!("global.callouts_{kind}"))
}

/// The counter that counts what became of a request.
pub fn request_counter(event: RequestEvent) -> Counter {
    match event {
        RequestEvent::Allowed => Counter::Allowed,
        RequestEvent::Limited => Counter::Limited,
        RequestEvent::ShadowLimited => Counter::ShadowLimited,
        RequestEvent::NoRoomToWait => Counter::DelayQueueFull,
    }
}

/// Where a rule event's counter is in [`RULE_EVENTS`].
pub fn rule_event_index(event: RuleEvent) -> Option<usize> {
    RULE_EVENTS.iter().position(|(e, _)| *e == event)
}

/// Where a store event's counter is in [`STORE_EVENTS`].
pub fn store_event_index(event: StoreEvent) -> Option<usize> {
    STORE_EVENTS.iter().position(|(e, _)| *e == event)
}

/// A failed call's kind, as an index into [`FAILURES`]: `not_sent` (Envoy
/// refused it, e.g. no such cluster), `refused` (503: no connection),
/// `timeout` (504), `bad_status` (any other non-2xx or a reset stream),
/// `bad_answer`.
pub fn failure_index(why: &CallError) -> usize {
    match why {
        CallError::NotSent(_) => 0,
        CallError::Status(Some(503)) => 1,
        CallError::Status(Some(504)) => 2,
        CallError::Status(_) => 3,
        CallError::Body(_) => 4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A counter is found by its place in [`COUNTERS`].
    #[test]
    fn every_counter_is_named_once_in_its_place() {
        for (place, (counter, name)) in COUNTERS.iter().enumerate() {
            assert_eq!(*counter as usize, place, "{name}");
            assert_eq!(COUNTERS.iter().filter(|(_, other)| other == name).count(), 1, "{name}");
        }
        assert_eq!(rule_metric("per-key", "allowed"), "floodgate.rule.per-key.allowed");
        assert_eq!(
            failure_metric(FAILURES[failure_index(&CallError::Status(Some(504)))]),
            "floodgate.global.callouts_timeout"
        );
    }
}
