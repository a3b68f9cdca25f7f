//! Where the service's time comes from. The quota service counts in
//! microseconds since the Unix epoch: fine enough for any rate a rule can
//! express, and small enough that Redis's Lua (whose numbers are doubles,
//! exact only up to 2^53) computes with it exactly.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Microseconds. Instants are microseconds since the Unix epoch.
pub type Micros = u64;

/// One second in [`Micros`].
pub const SECOND_US: Micros = 1_000_000;

/// A source of the current time. Callers' clocks are never used: every
/// decision reads the service's (or Redis's) clock.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// The current instant in microseconds since the Unix epoch.
    fn now_us(&self) -> Micros;
}

/// The machine's wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_us(&self) -> Micros {
        // A clock before 1970 is a broken host; treat it as the epoch rather
        // than failing every request.
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
    }
}

/// A clock that moves only when told to. Shared between threads, so one
/// manual clock can drive the service, the memory store and the Redis
/// scripts (which then take the time as an argument) in the same test.
#[derive(Debug, Default)]
pub struct ManualClock {
    now: AtomicU64,
}

impl ManualClock {
    /// A clock standing at `start`.
    pub fn new(start: Micros) -> Self {
        Self { now: AtomicU64::new(start) }
    }

    /// Moves the clock forward by `span`.
    pub fn advance(&self, span: Micros) {
        self.now.fetch_add(span, Ordering::SeqCst);
    }

    /// Sets the clock to `instant`.
    pub fn set(&self, instant: Micros) {
        self.now.store(instant, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_us(&self) -> Micros {
        self.now.load(Ordering::SeqCst)
    }
}

/// Microseconds rounded up to whole milliseconds, as the protocol reports
/// them: a caller that waits this long is never early.
pub fn ceil_ms(span: Micros) -> u64 {
    span.div_ceil(1_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told() {
        let clock = ManualClock::new(7);
        assert_eq!(clock.now_us(), 7);
        clock.advance(3);
        assert_eq!(clock.now_us(), 10);
        clock.set(2);
        assert_eq!(clock.now_us(), 2);
    }

    #[test]
    fn system_clock_is_after_2020() {
        assert!(SystemClock.now_us() > 1_577_836_800 * SECOND_US);
    }

    #[test]
    fn ceil_ms_never_rounds_down() {
        assert_eq!(ceil_ms(0), 0);
        assert_eq!(ceil_ms(1), 1);
        assert_eq!(ceil_ms(1_000), 1);
        assert_eq!(ceil_ms(1_001), 2);
    }
}
