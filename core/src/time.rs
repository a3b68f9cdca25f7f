//! Time as the limiter sees it: nanoseconds on one epoch shared by every worker.

use std::fmt;
use std::ops::{Add, AddAssign, Div, Rem, Sub, SubAssign};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Nanoseconds: an instant (since the Unix epoch, the host's wall clock, the
/// one epoch all Envoy workers share) or a span between two instants.
///
/// Arithmetic saturates: [`Nanos::NEVER`] is later than every instant and
/// longer than every span, and no sum or difference of times can wrap
/// around into a small, early-looking value (the release wasm would wrap
/// silently instead of panicking). The count is private: a time is built by
/// a named constructor or from a [`Duration`] (saturating), never by hand.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Nanos(u64);

impl Nanos {
    /// No time at all; also the Unix epoch.
    pub const ZERO: Nanos = Nanos(0);
    /// Never: later than every instant, longer than every span (what a
    /// request that can never be admitted is told to wait).
    pub const NEVER: Nanos = Nanos(u64::MAX);

    /// `n` nanoseconds.
    pub const fn from_nanos(n: u64) -> Nanos {
        Nanos(n)
    }

    /// One nanosecond: the shortest span that is not none (a divisor that
    /// must not be zero is at least this).
    pub const ONE: Nanos = Nanos(1);

    /// True for [`Nanos::NEVER`].
    pub const fn is_never(self) -> bool {
        self.0 == u64::MAX
    }

    /// `n` seconds.
    pub const fn from_secs(n: u64) -> Nanos {
        Nanos(n.saturating_mul(SECOND.0))
    }

    /// `n` milliseconds.
    pub const fn from_millis(n: u64) -> Nanos {
        Nanos(n.saturating_mul(1_000_000))
    }

    /// `n` microseconds.
    pub const fn from_micros(n: u64) -> Nanos {
        Nanos(n.saturating_mul(1_000))
    }

    /// The number of nanoseconds.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// `self - earlier`, or `None` when `earlier` is later (a clock step back).
    pub fn checked_sub(self, earlier: Nanos) -> Option<Nanos> {
        self.0.checked_sub(earlier.0).map(Nanos::from_nanos)
    }

    /// This span `parts` times over, rounded up (a zero divisor counts as one).
    pub const fn div_ceil(self, parts: u64) -> Nanos {
        Nanos(self.0.div_ceil(if parts == 0 { 1 } else { parts }))
    }

    /// The start of the period of length `period` (counted from the epoch)
    /// that this instant falls in.
    pub const fn floor_to(self, period: Nanos) -> Nanos {
        Nanos(self.0 - self.0 % if period.0 == 0 { 1 } else { period.0 })
    }

    /// How many events a steady `rate` per second makes in this span
    /// (`rate × nanoseconds ÷ 10⁹`, in that order).
    pub fn events_at(self, rate: f64) -> f64 {
        rate * self.0 as f64 / SECOND.0 as f64
    }

    /// The rate per second of `count` events over this span
    /// (`count × 10⁹ ÷ nanoseconds`, in that order).
    pub fn per_second(self, count: f64) -> f64 {
        count * SECOND.0 as f64 / self.0 as f64
    }

    /// This span in seconds.
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / SECOND.0 as f64
    }

    /// This span in milliseconds.
    pub fn as_millis_f64(self) -> f64 {
        self.0 as f64 / 1e6
    }

    /// `seconds` as a span: `as` saturates, so a negative or NaN count is
    /// none and an absurd one is "never".
    pub fn from_secs_f64(seconds: f64) -> Nanos {
        Nanos((seconds * SECOND.0 as f64) as u64)
    }

    /// Half of this span, rounded down.
    pub const fn halved(self) -> Nanos {
        Nanos(self.0 / 2)
    }

    /// This span `times` times over, saturating.
    pub fn times(self, times: u64) -> Nanos {
        Nanos(self.0.saturating_mul(times))
    }

    /// Whole seconds, rounded up, as `Retry-After` and the `RateLimit` fields
    /// use them: a client that waits this long is never early.
    pub fn ceil_seconds(self) -> u64 {
        self.0.div_ceil(SECOND.0)
    }

    /// Whole milliseconds, rounded up (the quota protocol's unit).
    pub fn ceil_millis(self) -> u64 {
        self.0.div_ceil(1_000_000)
    }

    /// Whole milliseconds, rounded down.
    pub fn floor_millis(self) -> u64 {
        self.0 / 1_000_000
    }
}

impl Add for Nanos {
    type Output = Nanos;
    /// Saturating: a time past the end of representable time is "never".
    fn add(self, other: Nanos) -> Nanos {
        Nanos(self.0.saturating_add(other.0))
    }
}

impl Sub for Nanos {
    type Output = Nanos;
    /// Saturating at zero: the time left until an instant already past is none.
    fn sub(self, other: Nanos) -> Nanos {
        Nanos(self.0.saturating_sub(other.0))
    }
}

impl AddAssign for Nanos {
    /// Saturating, as [`Add`].
    fn add_assign(&mut self, other: Nanos) {
        *self = *self + other;
    }
}

impl SubAssign for Nanos {
    /// Saturating at zero, as [`Sub`].
    fn sub_assign(&mut self, other: Nanos) {
        *self = *self - other;
    }
}

impl Div<u64> for Nanos {
    type Output = Nanos;
    /// This span in `parts` equal parts, rounded down (a zero divisor counts as one).
    fn div(self, parts: u64) -> Nanos {
        Nanos(self.0 / parts.max(1))
    }
}

impl Div for Nanos {
    type Output = u64;
    /// How many whole spans of `other` fit in this one (a zero span counts as one nanosecond).
    fn div(self, other: Nanos) -> u64 {
        self.0 / other.0.max(1)
    }
}

impl Rem for Nanos {
    type Output = Nanos;
    /// What is left of this span after whole spans of `other` (a zero span counts as one nanosecond).
    fn rem(self, other: Nanos) -> Nanos {
        Nanos(self.0 % other.0.max(1))
    }
}

/// Saturating: a span longer than 584 years is "never".
impl From<Duration> for Nanos {
    fn from(duration: Duration) -> Nanos {
        Nanos(u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX))
    }
}

impl From<Nanos> for Duration {
    fn from(nanos: Nanos) -> Duration {
        Duration::from_nanos(nanos.0)
    }
}

impl fmt::Display for Nanos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ns", self.0)
    }
}

/// One second.
pub const SECOND: Nanos = Nanos(1_000_000_000);

/// Where the current time comes from: the quota service reads the system's
/// clock (or Redis's); tests of time-dependent logic use [`FakeClock`]. Shared
/// between threads, so one clock can drive a service, its stores and a test.
pub trait Clock: Send + Sync + fmt::Debug {
    /// The current instant, nanoseconds since the Unix epoch.
    fn now(&self) -> Nanos;
}

/// A clock that only moves when told to, for tests of time-dependent logic.
#[derive(Debug, Default)]
pub struct FakeClock {
    now: AtomicU64,
}

impl FakeClock {
    /// A clock standing at `start`.
    pub fn new(start: Nanos) -> Self {
        Self { now: AtomicU64::new(start.0) }
    }

    /// Moves the clock forward by `span` (saturating: "never" stays never).
    pub fn advance(&self, span: Nanos) {
        let _ = self.now.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| Some(now.saturating_add(span.0)));
    }

    /// Sets the clock to `instant`, forward or back.
    pub fn set(&self, instant: Nanos) {
        self.now.store(instant.0, Ordering::SeqCst);
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Nanos {
        Nanos(self.now.load(Ordering::SeqCst))
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
/// use floodgate_core::time::{parse_duration, Nanos, SECOND};
/// assert_eq!(parse_duration("1m").unwrap(), SECOND.times(60));
/// assert_eq!(parse_duration("500ms").unwrap(), Nanos::from_millis(500));
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
    let unit_nanos: u64 = match unit {
        "ms" => 1_000_000,
        "s" => SECOND.0,
        "m" => 60 * SECOND.0,
        "h" => 3_600 * SECOND.0,
        "d" => 86_400 * SECOND.0,
        _ => return Err(err()),
    };
    match amount.checked_mul(unit_nanos) {
        Some(0) | None => Err(err()),
        Some(nanos) => Ok(Nanos(nanos)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn durations_convert_both_ways_and_saturate_into_never() {
        assert_eq!(Nanos::from(std::time::Duration::from_millis(1500)), Nanos::from_millis(1500));
        assert_eq!(std::time::Duration::from(SECOND.times(3)), std::time::Duration::from_secs(3));
        let ages = std::time::Duration::from_secs(u64::MAX);
        assert_eq!(Nanos::from(ages), Nanos::NEVER, "longer than u64 nanoseconds: never");
        assert!(Nanos::NEVER.is_never() && !SECOND.is_never());
    }

    #[test]
    fn parses_every_documented_unit() {
        assert_eq!(parse_duration("500ms"), Ok(Nanos(500_000_000)));
        assert_eq!(parse_duration("1s"), Ok(SECOND));
        assert_eq!(parse_duration("10s"), Ok(SECOND.times(10)));
        assert_eq!(parse_duration("1m"), Ok(SECOND.times(60)));
        assert_eq!(parse_duration("1h"), Ok(SECOND.times(3_600)));
        assert_eq!(parse_duration("1d"), Ok(SECOND.times(86_400)));
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
    fn rounding_never_makes_a_client_early() {
        assert_eq!(Nanos(0).ceil_seconds(), 0);
        assert_eq!(Nanos(1).ceil_seconds(), 1);
        assert_eq!(SECOND.ceil_seconds(), 1);
        assert_eq!((SECOND + Nanos(1)).ceil_seconds(), 2);
        assert_eq!(Nanos(1).ceil_millis(), 1);
        assert_eq!(Nanos(1_999_999).floor_millis(), 1);
    }

    #[test]
    fn arithmetic_saturates_instead_of_wrapping() {
        assert_eq!(Nanos::NEVER + SECOND, Nanos::NEVER);
        assert_eq!(SECOND - Nanos::NEVER, Nanos::ZERO);
        assert_eq!(SECOND.checked_sub(SECOND + Nanos(1)), None);
        assert_eq!(Nanos::NEVER.times(2), Nanos::NEVER);
    }

    #[test]
    fn division_and_remainder_never_divide_by_zero() {
        assert_eq!(SECOND / 4, Nanos::from_millis(250));
        assert_eq!(SECOND / 0, SECOND);
        assert_eq!(SECOND.times(7) / SECOND, 7);
        assert_eq!(SECOND / Nanos::ZERO, SECOND.get());
        assert_eq!(Nanos(10).div_ceil(3), Nanos(4));
        assert_eq!(Nanos(10) % Nanos(4), Nanos(2));
        assert_eq!(Nanos(10) % Nanos::ZERO, Nanos::ZERO);
        assert_eq!(Nanos(10_500).floor_to(Nanos(1_000)), Nanos(10_000));
        let mut t = SECOND;
        t += SECOND;
        t -= Nanos::NEVER;
        assert_eq!(t, Nanos::ZERO);
    }

    #[test]
    fn spans_convert_to_and_from_seconds_and_count_events() {
        assert_eq!(Nanos::from_millis(1500).as_secs_f64(), 1.5);
        assert_eq!(Nanos::from_secs_f64(0.25), Nanos::from_millis(250));
        assert_eq!(Nanos::from_secs_f64(-1.0), Nanos::ZERO);
        assert_eq!(Nanos::from_secs_f64(f64::NAN), Nanos::ZERO);
        assert_eq!(Nanos::from_secs_f64(1e30), Nanos::NEVER);
        assert_eq!(Nanos::from_millis(500).events_at(10.0), 5.0);
    }

    #[test]
    fn fake_clock_moves_only_when_told() {
        let clock = FakeClock::new(Nanos(5));
        assert_eq!(clock.now(), Nanos(5));
        clock.advance(Nanos(10));
        assert_eq!(clock.now(), Nanos(15));
        clock.set(Nanos(2));
        assert_eq!(clock.now(), Nanos(2));
        clock.advance(Nanos::NEVER);
        assert_eq!(clock.now(), Nanos::NEVER);
    }
}
