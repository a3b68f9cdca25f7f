//! Time as the limiter sees it: nanoseconds on one epoch shared by every worker.

use std::cell::Cell;
use std::fmt;

/// Nanoseconds. Absolute instants are nanoseconds since the Unix epoch (the
/// host's wall clock, the one epoch all Envoy workers share); spans are plain
/// differences.
pub type Nanos = u64;

/// One second in [`Nanos`].
pub const SECOND: Nanos = 1_000_000_000;

/// Where the current time comes from. The host layer reads Envoy's clock; unit
/// tests use [`FakeClock`].
pub trait Clock {
    /// The current instant, nanoseconds since the Unix epoch.
    fn now(&self) -> Nanos;
}

/// A clock that only moves when told to, for tests of time-dependent logic.
#[derive(Debug, Default)]
pub struct FakeClock {
    now: Cell<Nanos>,
}

impl FakeClock {
    /// A clock standing at `start`.
    pub fn new(start: Nanos) -> Self {
        Self { now: Cell::new(start) }
    }

    /// Moves the clock forward by `span`.
    pub fn advance(&self, span: Nanos) {
        self.now.set(self.now.get().saturating_add(span));
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Nanos {
        self.now.get()
    }
}

/// A duration that failed to parse, with the text that was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurationError(pub String);

impl fmt::Display for DurationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} is not a duration: use a positive whole number with one of the units ms, s, m, h, d (e.g. \"500ms\", \"1s\", \"1m\", \"1h\", \"1d\")",
            self.0
        )
    }
}

/// Parses durations the way operators write them: `500ms`, `1s`, `10s`, `1m`,
/// `1h`, `1d`. A bare number, a zero, a fraction or an unknown unit is an error.
///
/// ```
/// use floodgate_core::time::{parse_duration, SECOND};
/// assert_eq!(parse_duration("1m").unwrap(), 60 * SECOND);
/// assert_eq!(parse_duration("500ms").unwrap(), SECOND / 2);
/// assert!(parse_duration("0s").is_err());
/// ```
pub fn parse_duration(text: &str) -> Result<Nanos, DurationError> {
    let err = || DurationError(text.to_string());
    let digits_end = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(digits_end);
    if digits.is_empty() || digits.len() > 12 {
        return Err(err());
    }
    let amount: u64 = digits.parse().map_err(|_| err())?;
    let unit_nanos: Nanos = match unit {
        "ms" => 1_000_000,
        "s" => SECOND,
        "m" => 60 * SECOND,
        "h" => 3_600 * SECOND,
        "d" => 86_400 * SECOND,
        _ => return Err(err()),
    };
    match amount.checked_mul(unit_nanos) {
        Some(0) | None => Err(err()),
        Some(nanos) => Ok(nanos),
    }
}

/// Whole seconds, rounded up, as used by `Retry-After` and the `RateLimit`
/// fields: a client that waits this long is never early.
pub fn ceil_seconds(span: Nanos) -> u64 {
    span.div_ceil(SECOND)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_documented_unit() {
        assert_eq!(parse_duration("500ms"), Ok(500_000_000));
        assert_eq!(parse_duration("1s"), Ok(SECOND));
        assert_eq!(parse_duration("10s"), Ok(10 * SECOND));
        assert_eq!(parse_duration("1m"), Ok(60 * SECOND));
        assert_eq!(parse_duration("1h"), Ok(3_600 * SECOND));
        assert_eq!(parse_duration("1d"), Ok(86_400 * SECOND));
    }

    #[test]
    fn rejects_what_is_not_a_duration() {
        for bad in ["", "s", "1", "0s", "0ms", "1.5s", "-1s", "1 s", "1sec", "1w", "s1", "999999999999999d"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should be rejected");
        }
        let message = parse_duration("5x").unwrap_err().to_string();
        assert!(message.contains("\"5x\""), "{message}");
    }

    #[test]
    fn ceil_seconds_never_rounds_down() {
        assert_eq!(ceil_seconds(0), 0);
        assert_eq!(ceil_seconds(1), 1);
        assert_eq!(ceil_seconds(SECOND), 1);
        assert_eq!(ceil_seconds(SECOND + 1), 2);
    }

    #[test]
    fn fake_clock_moves_only_when_told() {
        let clock = FakeClock::new(5);
        assert_eq!(clock.now(), 5);
        clock.advance(10);
        assert_eq!(clock.now(), 15);
    }
}
