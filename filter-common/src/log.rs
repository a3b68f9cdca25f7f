//! Log lines a busy listener would otherwise repeat once per request.

use std::cell::Cell;

use floodgate_core::limiter::{Limiter, Verdict};
use floodgate_core::time::{Nanos, SECOND};

/// Logs a kind of event at most once a second per worker, with the number
/// of events left out since the previous line: on a busy listener one line
/// per request would flood Envoy's log, and the counters have the totals.
#[derive(Debug, Default)]
pub struct RateLimitedLog {
    last: Cell<Nanos>,
    suppressed: Cell<u64>,
}

impl RateLimitedLog {
    /// Logs `line()` at `level`, unless a line was logged less than a
    /// second before `now` (then it is only counted).
    pub fn record(&self, now: Nanos, level: log::Level, line: impl FnOnce() -> String) {
        if now - self.last.get() < SECOND {
            self.suppressed.set(self.suppressed.get() + 1);
            return;
        }
        let suppressed = self.suppressed.replace(0);
        self.last.set(now);
        log::log!(level, "floodgate: {} ({suppressed} more since the last line)", line());
    }
}

/// Logs, through `log`, that a shadow-mode rule would have limited the
/// request `verdict` lets through, naming the rule.
pub fn shadow_limited<H>(log: &RateLimitedLog, limiter: &Limiter<H>, verdict: &Verdict, now: Nanos) {
    if let Some(rule) = verdict.shadow_limited.and_then(|index| limiter.rules().get(index)) {
        log.record(now, log::Level::Info, || {
            format!("shadow mode: rule {} would have limited a request; let through", rule.rule.name)
        });
    }
}
