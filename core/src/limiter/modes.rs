//! A global rule's mode, shared by every worker in shared data: a failed
//! callout switches the rule to its fall-back, one worker at a time probes
//! the service with backoff, and a success switches it back. Each worker
//! keeps its own view, refreshed on its tick. The state machine itself is
//! [`crate::global::fallback`].

use std::cell::Cell;

use crate::global::fallback::{Backoff, ModeState};
use crate::store::{measure_and_replace, Replaced, Step, Store};
use crate::time::{Nanos, SECOND};

use super::rule::Key;
use super::{CompiledRule, Limiter};

/// Backoff between probes of a failing quota service: the first after 100 ms,
/// doubling to at most 2 s, so global mode is back within about 2 s of the
/// service's return.
const PROBE_BACKOFF: Backoff =
    Backoff { first: Nanos::from_nanos(100_000_000), max: Nanos::from_secs(2), probe_ttl: SECOND };

impl<H> Limiter<H> {
    /// Records the outcome of a callout for global rule `rule` in its shared
    /// mode: a failure switches it to its fall-back (every worker follows at
    /// its next [`Limiter::read_modes`]), a success back to global mode.
    /// True when this switched the rule into or out of its fall-back (a
    /// host whose workers do not read modes on a tick tells them then).
    pub fn record_callout(&self, store: &dyn Store, now: Nanos, rule: usize, succeeded: bool) -> bool {
        let switched = Cell::new(false);
        let written = self.update_mode(store, rule, |mode| {
            let next = if succeeded { mode.succeeded() } else { mode.failed(now, &PROBE_BACKOFF) };
            switched.set(next.in_fallback() != mode.in_fallback());
            (next != mode).then_some(next)
        });
        written && switched.get()
    }

    /// Claims the probes due at `now`: the global rules in fall-back whose
    /// next probe may start, one worker at a time. The host probes the
    /// service for each and reports with [`Limiter::record_callout`].
    pub fn due_probes(&self, store: &dyn Store, now: Nanos) -> Vec<usize> {
        (0..self.rules.len())
            .filter(|&rule| {
                self.rules.get(rule).is_some_and(CompiledRule::in_fallback)
                    && self.update_mode(store, rule, |mode| mode.claim_probe(now, &PROBE_BACKOFF))
            })
            .collect()
    }

    /// Reads every global rule's mode, and the near-limit notices, from
    /// shared data into this worker's view (the host calls it on its tick).
    pub fn read_modes(&self, store: &dyn Store) {
        self.read_near(store);
        let mut key = Key::default();
        for compiled in self.rules.iter().filter(|c| c.rule.global.is_some()) {
            if compiled.write_mode_key(&mut key).is_ok() {
                if let Ok(Some((bytes, _))) = store.get(key.as_str()) {
                    compiled.set_in_fallback(ModeState::decode(&bytes).in_fallback());
                }
            }
        }
    }

    /// Compare-and-swaps rule `rule`'s mode with `change`; true when written.
    fn update_mode(&self, store: &dyn Store, rule: usize, change: impl Fn(ModeState) -> Option<ModeState>) -> bool {
        let Some(compiled) = self.rules.get(rule).filter(|c| c.rule.global.is_some()) else { return false };
        let mut key = Key::default();
        if compiled.write_mode_key(&mut key).is_err() {
            return false;
        }
        let result = measure_and_replace(store, key.as_str(), self.settings.max_cas_retries, |bytes| {
            let mode = ModeState::decode(&bytes);
            match change(mode) {
                Some(next) => Step::Write(next.encode().to_vec(), Some(next)),
                None => Step::Keep(None),
            }
        });
        match result {
            Ok(Replaced { outcome: Some(next), .. }) => {
                compiled.set_in_fallback(next.in_fallback());
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn a_failing_service_switches_the_rule_to_its_local_fallback_and_back() {
        let store = MemoryStore::default();
        let limiter = build(GLOBAL, &store);
        let mut tally = Tally::default();
        let alice = &[("x-api-key", "alice")];
        assert!(limiter.record_callout(&store, T0, 0, false), "the mode changed");
        assert!(!limiter.record_callout(&store, T0, 0, false), "deeper in fall-back, not switched");
        assert!(limiter.rules()[0].in_fallback());
        // Another worker's limiter learns it from shared data.
        let other = build(GLOBAL, &store);
        assert!(other.rules()[0].in_fallback());
        let ok = (0..5).filter(|_| admitted(&other, &store, T0, alice, &mut tally)).count();
        assert_eq!(ok, 2, "the local fall-back limit");
        assert_eq!(tally.rules[&(0, "fallback")], 5);
        // One worker probes after the backoff; a success returns to global mode.
        assert!(limiter.due_probes(&store, T0).is_empty());
        assert_eq!(limiter.due_probes(&store, T0 + SECOND), vec![0]);
        assert!(other.due_probes(&store, T0 + SECOND).is_empty(), "one probe at a time");
        assert!(limiter.record_callout(&store, T0 + SECOND, 0, true), "back to global mode");
        other.read_modes(&store);
        assert!(!other.rules()[0].in_fallback());
    }
}
