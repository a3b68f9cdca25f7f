//! Where the service's time comes from: the machine's wall clock, behind the
//! core's [`Clock`] (tests drive the service with the core's `FakeClock`).
//! Callers' clocks are never used: every decision reads the service's (or
//! Redis's) clock.

use std::time::{SystemTime, UNIX_EPOCH};

use floodgate_core::time::{Clock, Nanos};

/// The machine's wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Nanos {
        // A clock before 1970 is a broken host; treat it as the epoch rather
        // than failing every request.
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(Nanos::ZERO, Nanos::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use floodgate_core::time::SECOND;

    #[test]
    fn system_clock_is_after_2020() {
        assert!(SystemClock.now() > SECOND.times(1_577_836_800));
    }
}
