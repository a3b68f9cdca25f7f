//! Whether a global rule asks the quota service or uses its local fall-back.
//!
//! One state per rule, in shared data, so every worker of the Envoy switches
//! together. A failed callout (refused, timed out, non-2xx, a body that does
//! not parse) switches the rule to its fall-back at once. While it is there,
//! one worker at a time probes the service, with exponential backoff; the
//! first probe that succeeds switches the rule back.

use crate::algorithm::{get_u64, put_u64};
use crate::time::Nanos;

/// Bytes of the stored state.
pub const STATE_LEN: usize = 4 * 8;

/// A rule's mode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModeState {
    /// Since when the service has been failing; zero in global mode.
    pub failing_since: Nanos,
    /// Failures in a row.
    pub failures: u64,
    /// The next probe may start then.
    pub next_probe: Nanos,
    /// A probe is in flight until then (single flight).
    pub probe_until: Nanos,
}

/// Backoff between probes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Wait after the first failure.
    pub first: Nanos,
    /// The longest wait.
    pub max: Nanos,
    /// How long a probe may take before another worker may probe.
    pub probe_ttl: Nanos,
}

impl ModeState {
    /// True while the rule uses its fall-back.
    pub fn in_fallback(&self) -> bool {
        self.failing_since != Nanos::ZERO
    }

    /// After a failed callout at `now`: into (or deeper into) fall-back.
    pub fn failed(self, now: Nanos, backoff: &Backoff) -> ModeState {
        let failures = self.failures.saturating_add(1);
        let shift = u32::try_from(failures - 1).unwrap_or(u32::MAX).min(32);
        let wait = backoff.first.times(1u64 << shift).min(backoff.max);
        ModeState {
            failing_since: if self.in_fallback() { self.failing_since } else { now.max(Nanos::from_nanos(1)) },
            failures,
            next_probe: now + wait,
            probe_until: Nanos::ZERO,
        }
    }

    /// After a callout that succeeded: global mode.
    pub fn succeeded(self) -> ModeState {
        ModeState::default()
    }

    /// Claims the next probe if one may start at `now`; the state with the
    /// claim written, to be stored by compare-and-swap.
    pub fn claim_probe(self, now: Nanos, backoff: &Backoff) -> Option<ModeState> {
        (self.in_fallback() && now >= self.next_probe && now >= self.probe_until)
            .then_some(ModeState { probe_until: now + backoff.probe_ttl, ..self })
    }

    /// Reads a stored state; anything unreadable is global mode.
    pub fn decode(bytes: &[u8]) -> ModeState {
        let word = |i: usize| get_u64(bytes, i * 8);
        match (word(0), word(1), word(2), word(3)) {
            (Some(since), Some(failures), Some(next), Some(probe)) => ModeState {
                failing_since: Nanos::from_nanos(since),
                failures,
                next_probe: Nanos::from_nanos(next),
                probe_until: Nanos::from_nanos(probe),
            },
            _ => ModeState::default(),
        }
    }

    /// The stored form.
    pub fn encode(&self) -> [u8; STATE_LEN] {
        let mut out = [0u8; STATE_LEN];
        let words = [self.failing_since.get(), self.failures, self.next_probe.get(), self.probe_until.get()];
        for (i, word) in words.into_iter().enumerate() {
            put_u64(&mut out, i * 8, word);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::SECOND;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const T0: Nanos = Nanos::from_secs(1_700_000_000);
    const MS: Nanos = Nanos::from_nanos(1_000_000);

    fn backoff() -> Backoff {
        Backoff { first: MS.times(100), max: SECOND.times(2), probe_ttl: MS.times(500) }
    }

    #[test]
    fn a_failure_switches_at_once_and_probes_back_off() {
        let b = backoff();
        let global = ModeState::default();
        assert!(!global.in_fallback());
        let once = global.failed(T0, &b);
        assert!(once.in_fallback());
        assert_eq!(once.next_probe, T0 + MS.times(100));
        let waits: Vec<Nanos> = (0..6)
            .scan(once, |state, _| {
                *state = state.failed(T0, &b);
                Some(state.next_probe - T0)
            })
            .collect();
        assert_eq!(waits, [200, 400, 800, 1600, 2000, 2000].map(|ms| MS.times(ms)));
        assert_eq!(once.failed(T0 + SECOND, &b).failing_since, T0, "still failing since the first failure");
    }

    #[test]
    fn one_worker_probes_at_a_time_and_a_hung_probe_is_taken_over() {
        let b = backoff();
        let state = ModeState::default().failed(T0, &b);
        assert_eq!(state.claim_probe(T0 + MS.times(99), &b), None, "backing off");
        let probing = state.claim_probe(T0 + MS.times(100), &b).unwrap();
        assert_eq!(probing.claim_probe(T0 + MS.times(101), &b), None, "another worker must not probe too");
        assert!(probing.claim_probe(T0 + MS.times(600), &b).is_some(), "the probe hung: take over");
        assert_eq!(ModeState::default().claim_probe(T0, &b), None, "no probes in global mode");
    }

    #[test]
    fn success_returns_to_global_mode_and_state_round_trips() {
        let b = backoff();
        let state = ModeState::default().failed(T0, &b).failed(T0, &b);
        assert_eq!(ModeState::decode(&state.encode()), state);
        assert_eq!(ModeState::decode(b"junk"), ModeState::default());
        assert!(!state.succeeded().in_fallback());
    }
}
