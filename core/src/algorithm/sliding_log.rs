//! Sliding log: the time of every admitted unit, so the limit is exact. A
//! unit admitted at `t` counts until `t + period`; a request of cost `c` is
//! admitted while the units still counting plus `c` fit `limit`, and takes `c`
//! entries. No interval of length `period` (half-open, `[s, s + period)`)
//! ever admits more than `limit`, and a denied request learns the exact
//! instant the oldest entry it waits for leaves the period.
//!
//! The log grows with the limit, so `limit` is capped at [`MAX_LOG_LIMIT`]:
//! every decision copies the whole group of four buckets out of shared data
//! and back, under the host's lock, and at the cap a bucket is at most
//! 7 KB (a group 28 KB). Larger limits are what `sliding_window` with
//! `sub_windows` is for: within a sub-window of exact at 248 bytes.
//!
//! # State
//!
//! `10 + limit × w` bytes, where `w` is the fewest bytes that hold
//! `period − 1` in nanoseconds (3 for periods up to 16.7 ms, 4 up to 4.29 s,
//! 5 up to 18.3 min, 6 up to 3.26 days, 7 up to 366 days): bytes `0..8` are
//! the newest entry's time (ns since the epoch, u64 LE), bytes `8..10` the
//! number of entries `n` (u16 LE, at most `limit`), then `n` ages of `w`
//! bytes each (little-endian), newest first: entry `i` was admitted at
//! `newest − age_i`. Ages start at 0 and never decrease, and an entry older
//! than the period is dropped, so every age is below the period and fits in
//! `w` bytes: timestamps are exact to the nanosecond. The rest is unused.
//!
//! # Bound
//!
//! Any interval `[s, s + D]` admits at most `limit × (⌊D/period⌋ + 1)`: it
//! is covered by `⌊D/period⌋ + 1` half-open periods, and each admits at most
//! `limit`: at the last admission in `[s, s + period)`, at `t`, every earlier
//! admission in it is less than a period old, so still in the log (an entry
//! leaves only once it is a period old, or when undone), and the check held
//! with all of them.

use super::{Algorithm, Decision, FromParams, Grant, Params, Quota, Release};
use crate::error::ConfigError;
use crate::time::Nanos;

/// The largest `limit` a sliding log takes.
pub const MAX_LOG_LIMIT: usize = 1000;

const HEADER: usize = 10;

/// Sliding-log parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingLog {
    limit: usize,
    period: Nanos,
    /// Bytes per stored age.
    width: usize,
}

/// A bucket's log: the times of the units admitted, oldest first.
#[derive(Debug, Clone, Copy)]
pub struct LogState {
    len: usize,
    times: [u64; MAX_LOG_LIMIT],
}

impl PartialEq for LogState {
    fn eq(&self, other: &Self) -> bool {
        self.times() == other.times()
    }
}

impl Eq for LogState {}

impl LogState {
    const EMPTY: LogState = LogState { len: 0, times: [0; MAX_LOG_LIMIT] };

    /// The entries, oldest first.
    pub fn times(&self) -> &[u64] {
        self.times.get(..self.len).unwrap_or(&[])
    }

    fn newest(&self) -> Option<u64> {
        self.times().last().copied()
    }

    /// Drops the oldest `count` entries.
    fn drop_oldest(&mut self, count: usize) {
        let count = count.min(self.len);
        self.times.copy_within(count..self.len, 0);
        self.len -= count;
    }
}

impl SlidingLog {
    /// At most `limit` (clamped to 1..=[`MAX_LOG_LIMIT`]) units in any
    /// `period`.
    pub fn new(limit: u64, period: Nanos) -> Self {
        let period = period.max(Nanos::ONE);
        let limit = usize::try_from(limit).unwrap_or(MAX_LOG_LIMIT).clamp(1, MAX_LOG_LIMIT);
        let bits = 64 - (period.get() - 1).leading_zeros() as usize;
        Self { limit, period, width: bits.div_ceil(8).max(1) }
    }

    /// True while an entry admitted at `time` counts at `at`.
    fn counts_at(&self, time: u64, at: Nanos) -> bool {
        Nanos::from_nanos(time) + self.period > at
    }

    /// The log that counts at `now`, and the instant it is read at.
    ///
    /// When the wall clock stepped back, a log whose newest entry is less
    /// than a period ahead is read at that entry's time (its entries must not
    /// reopen); one further ahead is not trusted (a clock once set far ahead
    /// must not lock a key out until then) and starts afresh.
    fn view(&self, mut log: LogState, now: Nanos) -> (LogState, Nanos) {
        let at = match log.newest().map(Nanos::from_nanos) {
            Some(newest) if newest > now && newest - now >= self.period => return (LogState::EMPTY, now),
            Some(newest) => newest.max(now),
            None => now,
        };
        let expired = log.times().iter().take_while(|t| !self.counts_at(**t, at)).count();
        log.drop_oldest(expired);
        (log, if log.len == 0 { now } else { at })
    }

    /// The time from `at` until the `entry`-th oldest entry leaves the period.
    fn until_leaves(&self, log: &LogState, entry: usize, at: Nanos) -> Nanos {
        log.times().get(entry).map_or(Nanos::ZERO, |t| Nanos::from_nanos(*t) + self.period - at)
    }

    fn report(&self, log: &LogState, at: Nanos) -> (u64, Nanos) {
        ((self.limit - log.len) as u64, self.until_leaves(log, 0, at))
    }

    fn age_at(&self, bytes: &[u8], index: usize) -> Option<u64> {
        let start = HEADER + index * self.width;
        let raw = bytes.get(start..start + self.width)?;
        Some(raw.iter().rev().fold(0, |age, byte| (age << 8) | u64::from(*byte)))
    }
}

impl Algorithm for SlidingLog {
    type State = LogState;

    fn state_len(&self) -> usize {
        HEADER + self.limit * self.width
    }

    /// Refuses what [`Algorithm::encode`] never writes: more entries than the
    /// limit, ages out of order, beyond the period or before the epoch.
    fn decode(&self, bytes: &[u8]) -> Option<LogState> {
        if bytes.len() < self.state_len() {
            return None;
        }
        let newest = super::get_u64(bytes, 0)?;
        let len = usize::from(u16::from_le_bytes(bytes.get(8..10)?.try_into().ok()?));
        if len > self.limit {
            return None;
        }
        let mut log = LogState { len, ..LogState::EMPTY };
        let mut previous_age = 0;
        for i in 0..len {
            let age = self.age_at(bytes, i)?;
            if age < previous_age || age >= self.period.get() || age > newest || (i == 0 && age != 0) {
                return None;
            }
            *log.times.get_mut(len - 1 - i)? = newest - age;
            previous_age = age;
        }
        Some(log)
    }

    fn encode(&self, log: &LogState, out: &mut [u8]) {
        let newest = log.newest().unwrap_or(0);
        super::put_u64(out, 0, newest);
        // Entries a period older than the newest can never count again (and
        // would not fit the width): they are not written.
        let ages = log.times().iter().rev().map(|t| newest - t).take_while(|age| *age < self.period.get());
        let mut len: u16 = 0;
        for (i, age) in ages.take(self.limit).enumerate() {
            let start = HEADER + i * self.width;
            if let Some(dst) = out.get_mut(start..start + self.width) {
                dst.copy_from_slice(age.to_le_bytes().get(..self.width).unwrap_or(&[]));
            }
            len += 1; // ≤ 1000
        }
        if let Some(dst) = out.get_mut(8..10) {
            dst.copy_from_slice(&len.to_le_bytes());
        }
    }

    fn capacity(&self) -> u64 {
        self.limit as u64
    }

    fn quota(&self) -> Quota {
        Quota { limit: self.limit as u64, window: Some(self.period) }
    }

    /// An empty log.
    fn fresh(&self, _now: Nanos) -> LogState {
        LogState::EMPTY
    }

    /// Admits `cost` units if the entries still counting leave room for
    /// them; logs `cost` entries.
    fn decide(&self, log: LogState, now: Nanos, cost: u64) -> (Decision, LogState) {
        let (log, at) = self.view(log, now);
        // Nonzero only after a clock step back: the log is read later.
        let ahead = at - now;
        let fits = usize::try_from(cost).ok().filter(|c| *c <= self.limit - log.len);
        match fits {
            Some(cost) => {
                let mut after = log;
                if let Some(new) = after.times.get_mut(log.len..log.len + cost) {
                    new.fill(at.get());
                }
                after.len += cost;
                let (remaining, reset) = self.report(&after, at);
                (Decision::admit(remaining, reset + ahead), after)
            }
            None => {
                // The oldest `len + cost − limit` entries must leave first.
                let retry_after = match usize::try_from(cost) {
                    Ok(cost) if cost <= self.limit => {
                        self.until_leaves(&log, log.len + cost - self.limit - 1, at) + ahead
                    }
                    _ => Nanos::NEVER,
                };
                let (remaining, reset) = self.report(&log, at);
                (Decision::deny(remaining, reset + ahead, retry_after), log)
            }
        }
    }

    /// Undo removes up to `cost` entries logged at the grant's time, if they
    /// are still there.
    fn release(&self, log: LogState, now: Nanos, grant: Grant, why: Release) -> Option<LogState> {
        if why == Release::Done {
            return None;
        }
        let (mut log, _) = self.view(log, now);
        let times = log.times();
        // Entries are in time order, so the grant's are one run.
        let end = times.iter().rposition(|t| *t == grant.at.get())? + 1;
        let run = times.get(..end)?.iter().rev().take_while(|t| **t == grant.at.get()).count();
        let removed = run.min(usize::try_from(grant.cost).unwrap_or(usize::MAX));
        log.times.copy_within(end..log.len, end - removed);
        log.len -= removed;
        Some(log)
    }

    /// No entry inside the period.
    fn is_idle(&self, log: LogState, now: Nanos) -> bool {
        self.view(log, now).0.len == 0
    }

    /// When the newest entry leaves the period.
    fn idle_at(&self, log: LogState, now: Nanos) -> Nanos {
        match self.view(log, now).0.newest() {
            Some(newest) => (Nanos::from_nanos(newest) + self.period).max(now),
            None => now,
        }
    }

    /// `limit` per started period of the span.
    fn admitted_bound(&self, span: Nanos) -> u64 {
        (self.limit as u64).saturating_mul(span / self.period + 1)
    }
}

impl FromParams for SlidingLog {
    const FIELDS: &'static [&'static str] = &["period"];

    /// `period` (required); `limit` at most [`MAX_LOG_LIMIT`].
    fn from_params(params: &mut Params) -> Result<Self, ConfigError> {
        if params.limit() > MAX_LOG_LIMIT as u64 {
            return Err(params.error(
                "limit",
                format!(
                    "{} is more than a sliding_log keeps: at most {MAX_LOG_LIMIT} (it stores every admission); use sliding_window with sub_windows for larger limits",
                    params.limit()
                ),
            ));
        }
        Ok(Self::new(params.limit(), params.required_duration("period")?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::SECOND;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const T0: Nanos = Nanos::from_secs(1_700_000_000);

    fn take(log: &SlidingLog, state: LogState, now: Nanos, cost: u64) -> LogState {
        let (decision, after) = log.decide(state, now, cost);
        assert!(decision.allowed(), "{cost} at {now}");
        after
    }

    fn assert_retry_exact(log: &SlidingLog, state: LogState, now: Nanos, cost: u64, expected: Nanos) {
        let (denied, _) = log.decide(state, now, cost);
        assert!(!denied.allowed());
        assert_eq!(denied.retry_after(), expected);
        assert!(!log.decide(state, now + expected - Nanos::from_nanos(1), cost).0.allowed(), "1 ns early must deny");
        assert!(log.decide(state, now + expected, cost).0.allowed(), "on time must admit");
    }

    #[test]
    fn admits_the_limit_then_each_unit_a_period_after_it_was_taken() {
        let log = SlidingLog::new(3, SECOND.times(10));
        let mut state = log.fresh(T0);
        for (at, expected_remaining) in [(0, 2), (2, 1), (5, 0)] {
            let (decision, next) = log.decide(state, T0 + SECOND.times(at), 1);
            assert!(decision.allowed());
            assert_eq!(decision.remaining, expected_remaining);
            assert_eq!(decision.reset, SECOND.times(10 - at), "the first entry leaves at 10 s");
            state = next;
        }
        let now = T0 + SECOND.times(6);
        assert_retry_exact(&log, state, now, 1, SECOND.times(4));
        assert_retry_exact(&log, state, now, 2, SECOND.times(6));
        assert_retry_exact(&log, state, now, 3, SECOND.times(9));
        assert_eq!(log.decide(state, now, 4).0.retry_after(), Nanos::NEVER);
        assert!(!log.is_idle(state, T0 + SECOND.times(15) - Nanos::from_nanos(1)));
        assert!(log.is_idle(state, T0 + SECOND.times(15)));
    }

    #[test]
    fn a_cost_takes_as_many_entries() {
        let log = SlidingLog::new(5, SECOND);
        let state = take(&log, log.fresh(T0), T0, 4);
        let state = take(&log, state, T0 + Nanos::from_millis(300), 1);
        // A request of 2 must wait for two entries: both of the first four.
        assert_retry_exact(&log, state, T0 + Nanos::from_millis(400), 2, Nanos::from_millis(600));
        assert_retry_exact(&log, state, T0 + Nanos::from_millis(400), 5, Nanos::from_millis(900));
    }

    #[test]
    fn undo_removes_the_grants_entries_only() {
        let log = SlidingLog::new(4, SECOND);
        let state = take(&log, log.fresh(T0), T0, 1);
        let state = take(&log, state, T0 + Nanos::from_nanos(5), 2);
        let grant = Grant { cost: 2, at: T0 + Nanos::from_nanos(5) };
        let undone = log.release(state, T0 + Nanos::from_nanos(5), grant, Release::Undo).unwrap();
        assert_eq!(undone.times(), &[T0.get()]);
        assert_eq!(log.release(state, T0 + Nanos::from_nanos(5), grant, Release::Done), None);
        let elsewhere = Grant { cost: 1, at: T0 + Nanos::from_nanos(3) };
        assert_eq!(log.release(state, T0 + Nanos::from_nanos(5), elsewhere, Release::Undo), None);
        let expired = Grant { cost: 1, at: T0 };
        assert_eq!(log.release(state, T0 + SECOND, expired, Release::Undo), None, "no longer in the log");
        // An older grant's entry is removed from the middle, keeping order.
        let first = Grant { cost: 1, at: T0 };
        assert_eq!(
            log.release(state, T0 + Nanos::from_nanos(5), first, Release::Undo).unwrap().times(),
            &[T0.get() + 5, T0.get() + 5]
        );
    }

    #[test]
    fn a_clock_step_back_keeps_the_entries_and_a_far_future_is_forgotten() {
        let log = SlidingLog::new(1, SECOND.times(10));
        let state = take(&log, log.fresh(T0), T0, 1);
        let (denied, _) = log.decide(state, T0 - SECOND, 1);
        assert_eq!(denied.retry_after(), SECOND.times(11));
        assert!(log.decide(state, T0 - SECOND.times(10), 1).0.allowed());
    }

    #[test]
    fn state_is_exact_and_compact() {
        let log = SlidingLog::new(6, SECOND.times(60)); // ages need 36 bits: 5 bytes
        assert_eq!(log.state_len(), 10 + 6 * 5);
        let mut state = take(&log, log.fresh(T0), T0 + Nanos::from_nanos(1), 2);
        state = take(&log, state, T0 + SECOND.times(59) + Nanos::from_nanos(7), 1);
        let mut bytes = vec![0u8; log.state_len()];
        log.encode(&state, &mut bytes);
        assert_eq!(log.decode(&bytes), Some(state));
        assert_eq!(log.decode(&bytes[..bytes.len() - 1]), None);
        // An entry is gone once it is a period old.
        state = take(&log, state, T0 + SECOND.times(60) + Nanos::from_nanos(1), 1);
        log.encode(&state, &mut bytes);
        assert_eq!(
            log.decode(&bytes).unwrap().times(),
            &[T0.get() + 59 * SECOND.get() + 7, T0.get() + 60 * SECOND.get() + 1]
        );
        assert_eq!(SlidingLog::new(1000, SECOND.times(366 * 86_400)).state_len(), 7010);
        assert_eq!(SlidingLog::new(1, Nanos::from_millis(1)).width, 3);
    }

    #[test]
    fn refuses_what_it_never_writes() {
        let log = SlidingLog::new(2, SECOND);
        let mut bytes = vec![0u8; log.state_len()];
        log.encode(&take(&log, log.fresh(T0), T0, 2), &mut bytes);
        assert!(log.decode(&bytes).is_some());
        let corrupt = |at: usize, value: u8| {
            let mut b = bytes.clone();
            b[at] = value;
            log.decode(&b)
        };
        assert_eq!(corrupt(8, 3), None, "more entries than the limit");
        assert_eq!(corrupt(10, 1), None, "the newest entry's age is not 0");
        assert_eq!(corrupt(17, 0xff), None, "an age beyond the period");
    }

    #[test]
    fn limit_is_capped() {
        let build = |limit| {
            SlidingLog::from_params(&mut Params::new(
                "rules[2]",
                limit,
                serde_json::from_str(r#"{"period": "1s"}"#).unwrap(),
            ))
        };
        assert!(build(1000).is_ok());
        let error = build(1001).unwrap_err();
        assert_eq!(error.field, "rules[2].limit");
        assert!(error.message.starts_with("1001 is more than a sliding_log keeps: at most 1000"), "{}", error.message);
    }
}
