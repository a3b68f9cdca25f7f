//! Shares of one limit among the Envoys that report it: the lease-sizing
//! rule of Envoy's rate limit quota protocol (RLQS), where each Envoy
//! reports, every report interval, how many requests of a bucket it allowed
//! and denied, and gets back an assignment it enforces alone until the
//! next one: a token bucket, allow-all, deny-all or abandon. Pure: the quota
//! service keeps a bucket's [`ShareTable`] in its store (so every service
//! instance on one Redis sees the same table) and calls [`Shares::report`]
//! inside the store's atomic step; the fleet simulation can call it as is.
//!
//! The rule, for a limit of `L` units a second (`requests_per_unit` over its
//! `unit`):
//!
//! * **Demand** of an Envoy: `(allowed + denied) / elapsed` of its last
//!   report (elapsed at least a second: Envoy counts whole seconds).
//! * **A bucket's first report** from an Envoy (Envoy sends it at once, over
//!   no time) says nothing of its demand: it gets **no answer**, and the
//!   Envoy stays on its own `no_assignment_behavior` until its next report,
//!   one interval later. Until then its demand counts as an equal share
//!   `L / n` in the others' targets. (Answered at once, the first Envoy of a
//!   fleet would take the whole limit, and the others, arriving
//!   milliseconds later, only floors below their demand.)
//! * **Targets**: when the Envoys' demands add up to `D ≤ L`, each gets its
//!   demand plus an equal part of the spare `(L − D) / n`; above `L`, each
//!   gets `L × demand / D`. Targets add up to `L`.
//! * **What the others hold**: an Envoy gets its target only as far as the
//!   others' assignments still in force leave room (`L` minus them), or as
//!   far as it holds already (keeping its own assignment adds nothing to
//!   what is held): a share taken from one Envoy is given to another only
//!   once the first has reported and been given its smaller share, so the
//!   assignments in force never add up to more than `L`, except for:
//! * **A newcomer's floor**: an Envoy holding nothing (new to the bucket,
//!   or squeezed to nothing) gets at least `min(target, L / (4n))` even when
//!   the others hold all of `L`, as long as the assignments in force stay
//!   within `5/4 L` ([`NEWCOMER_FLOOR_DIVISOR`], [`NEWCOMER_EXCESS_DIVISOR`]);
//!   the others make room at their next reports, within one interval.
//! * **Token buckets**: a share of `r ≥ 1` a second is `⌊r⌋` tokens per
//!   one-second fill interval; under one a second, one token per `⌈1/r⌉`
//!   seconds (Envoy 1.40 honours only whole seconds of a fill interval). Its
//!   `max_tokens`, the burst an idle Envoy may spend at once, is half a
//!   second of its rate (at least one token). What is recorded as the
//!   Envoy's assignment is the rate of that token bucket, after rounding.
//! * **Time to live**: every assignment lasts [`Shares::ttl`] (whole
//!   seconds, several report intervals): an Envoy that stops hearing from
//!   the service keeps it that long, then falls back to its own
//!   configuration. An Envoy's entry is kept (and its assignment counted)
//!   until its assignment expires, whether or not its stream is still open.
//! * **Counted windows**: for a fixed window much longer than the report
//!   interval (a minute and longer), the units the Envoys report allowed are
//!   counted in the window they fall in (the part of a report's span inside
//!   the window), the rate split is what remains over the time left, and a
//!   window spent gets **deny-all** until it ends. A window of a few report
//!   intervals or less is split as a rate (its counts arrive after it ended).
//! * **Abandon**: a bucket an Envoy reported idle (no request) for
//!   [`Shares::abandon_after`] is abandoned: the Envoy forgets it and its
//!   entry is dropped, until a new request brings it back.
//!
//! **Bound.** Let `I` be the report interval and `B = Σ max_tokens ≤ L/2 +
//! n` (n Envoys, one token of rounding each). Over any span `T`, what the
//! fleet admits on its assignments is at most `L × T + B` while no newcomer
//! took its floor within `I` before or during the span, and at most
//! `L × T + B + (L/4) × I` in all (the newcomers' floors, at most `L/4`
//! together, last until the others report, within `I`). On top of it comes
//! what Envoys admit on their own `no_assignment_behavior` in their first
//! interval of a bucket (nothing with a deny-all blanket rule; their demand
//! with allow-all). Assignments an Envoy did not receive (a broken stream)
//! only lower what is admitted. The tests `the_fleet_stays_within_the_bound`
//! (Envoy's token buckets on a fake clock, random arrivals, demand moving, a
//! newcomer) and
//! `a_tenant_below_its_limit_is_never_denied_whatever_order_its_envoys_come_in`
//! check it, and `docs/protocol.md` ("Envoy's rate limit quota service")
//! states it.

use crate::algorithm::{CountingWindow, Policy};
use crate::time::{Nanos, SECOND};

/// Rates are kept in millionths of a unit a second: exact integers over the
/// whole range of limits (10⁹ a second is 10¹⁵ of them) and fine enough for
/// a limit of one a year (about 31.7 of them).
pub const MICROS: u64 = 1_000_000;

/// A newcomer's floor is at most `L / (NEWCOMER_FLOOR_DIVISOR × n)`.
pub const NEWCOMER_FLOOR_DIVISOR: u64 = 4;

/// Newcomers' floors may take the assignments in force to at most
/// `L + L / NEWCOMER_EXCESS_DIVISOR`.
pub const NEWCOMER_EXCESS_DIVISOR: u64 = 4;

/// A token bucket holds at most this part of a second of its rate
/// (`max_tokens`), as a divisor of a second: an idle Envoy's burst.
pub const BURST_DIVISOR: u64 = 2;

/// A fixed window is counted (and denied when spent) only when it lasts at
/// least this many report intervals; shorter ones are split as a rate.
pub const COUNTED_WINDOW_REPORTS: u64 = 4;

/// Most Envoys one bucket's table holds: a newcomer beyond them gets
/// deny-all until one of them leaves (a table is read and written whole on
/// every report; 512 entries are 20 KiB).
pub const MAX_ENVOYS: usize = 512;

/// The demand of an Envoy whose first report of a bucket came (over no
/// time), before its second: not known yet.
pub const UNKNOWN: u64 = u64::MAX;

/// Bytes of one Envoy's entry in an encoded table.
const ENTRY_LEN: usize = 40;
/// Bytes before the entries: a format byte, the window and its count.
const HEADER_LEN: usize = 17;
/// The encoding's format.
const FORMAT: u8 = 1;

/// One Envoy's part of a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Who: the quota service's id of the Envoy's stream.
    pub envoy: u64,
    /// Its demand, millionths of a unit a second ([`UNKNOWN`] until its
    /// second report).
    pub demand: u64,
    /// The rate of the assignment it was last given, millionths of a unit
    /// a second (0 for deny-all).
    pub assigned: u64,
    /// When that assignment expires.
    pub until: Nanos,
    /// Since when it has reported the bucket idle ([`Nanos::ZERO`]: it has
    /// not).
    pub idle_since: Nanos,
}

/// A bucket's shares: every Envoy reporting it, and, for a counted window,
/// what was counted in it. Kept by the store as bytes ([`ShareTable::encode`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShareTable {
    /// The counted window (see [`CountingWindow::index`]) its count is of.
    pub window: u64,
    /// Units reported allowed in that window.
    pub counted: u64,
    /// The Envoys, in the order they came.
    pub envoys: Vec<Entry>,
}

impl ShareTable {
    /// The table's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + self.envoys.len() * ENTRY_LEN);
        out.push(FORMAT);
        out.extend_from_slice(&self.window.to_le_bytes());
        out.extend_from_slice(&self.counted.to_le_bytes());
        for e in &self.envoys {
            for word in [e.envoy, e.demand, e.assigned, e.until.get(), e.idle_since.get()] {
                out.extend_from_slice(&word.to_le_bytes());
            }
        }
        out
    }

    /// A table from its bytes; anything else (absent, another format,
    /// truncated) is an empty table: the shares start over, which the rule
    /// makes safe (every Envoy is then a newcomer at its next report).
    pub fn decode(bytes: Option<&[u8]>) -> ShareTable {
        let Some(bytes) = bytes else { return ShareTable::default() };
        let (Some((&FORMAT, rest)), true) = (bytes.split_first(), bytes.len() >= HEADER_LEN) else {
            return ShareTable::default();
        };
        let mut words = rest.chunks_exact(8).map(|c| {
            let mut word = [0u8; 8];
            word.copy_from_slice(c);
            u64::from_le_bytes(word)
        });
        let (Some(window), Some(counted)) = (words.next(), words.next()) else { return ShareTable::default() };
        let mut envoys = Vec::new();
        while let (Some(envoy), Some(demand), Some(assigned), Some(until), Some(idle)) =
            (words.next(), words.next(), words.next(), words.next(), words.next())
        {
            if envoys.len() == MAX_ENVOYS {
                break;
            }
            envoys.push(Entry {
                envoy,
                demand,
                assigned,
                until: Nanos::from_nanos(until),
                idle_since: Nanos::from_nanos(idle),
            });
        }
        ShareTable { window, counted, envoys }
    }

    /// When the table says nothing any more: every assignment it counts has
    /// expired, and a counted window's count has ended with its window.
    pub fn idle_at(&self, window_end: Option<Nanos>) -> Nanos {
        let held = self.envoys.iter().map(|e| e.until).max().unwrap_or(Nanos::ZERO);
        match window_end {
            Some(end) if self.counted > 0 => held.max(end),
            _ => held,
        }
    }

    /// The sum of the assignments in force at `now`, but `envoy`'s.
    fn held_by_others(&self, envoy: u64) -> u64 {
        self.envoys.iter().filter(|e| e.envoy != envoy).fold(0u64, |sum, e| sum.saturating_add(e.assigned))
    }
}

/// One Envoy's report of one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// The Envoy (its stream's id).
    pub envoy: u64,
    /// Requests it allowed since its last report.
    pub allowed: u64,
    /// Requests it denied since its last report.
    pub denied: u64,
    /// The time those were counted over.
    pub elapsed: Nanos,
}

/// A token bucket as Envoy's `envoy.type.v3.TokenBucket` has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBucket {
    /// The most tokens it holds (and starts with).
    pub max_tokens: u32,
    /// Tokens added per fill interval.
    pub tokens_per_fill: u32,
    /// The fill interval, whole seconds.
    pub fill_interval: Nanos,
}

impl TokenBucket {
    /// Its rate, millionths of a token a second (rounded down).
    pub fn rate(&self) -> u64 {
        let per_second = u128::from(self.tokens_per_fill) * u128::from(MICROS) * u128::from(SECOND.get());
        u64::try_from(per_second / u128::from(self.fill_interval.get().max(1))).unwrap_or(u64::MAX)
    }

    /// The token bucket of a share of `rate` (millionths of a unit a
    /// second, above 0): whole seconds of fill interval, a share under one
    /// a second as one token per `⌈1/share⌉` seconds, never faster than the
    /// share.
    pub fn for_rate(rate: u64) -> TokenBucket {
        if rate >= MICROS {
            let per_second = u32::try_from(rate / MICROS).unwrap_or(u32::MAX);
            let burst = u64::from(per_second).div_ceil(BURST_DIVISOR).max(1);
            TokenBucket {
                max_tokens: u32::try_from(burst).unwrap_or(u32::MAX),
                tokens_per_fill: per_second,
                fill_interval: SECOND,
            }
        } else {
            let seconds = MICROS.div_ceil(rate.max(1));
            TokenBucket { max_tokens: 1, tokens_per_fill: 1, fill_interval: Nanos::from_secs(seconds) }
        }
    }
}

/// What an Envoy is told to do with a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Assignment {
    /// Admit what this token bucket admits.
    TokenBucket(TokenBucket),
    /// Admit everything (the bucket has no limit).
    AllowAll,
    /// Deny everything (a counted window is spent, or there is no room).
    DenyAll,
    /// Forget the bucket (it has been idle).
    Abandon,
}

impl Assignment {
    /// Its kind as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Assignment::TokenBucket(_) => "token_bucket",
            Assignment::AllowAll => "allow_all",
            Assignment::DenyAll => "deny_all",
            Assignment::Abandon => "abandon",
        }
    }

    /// Every kind, as metric labels.
    pub const KINDS: [&'static str; 4] = ["token_bucket", "allow_all", "deny_all", "abandon"];
}

/// An assignment and how long it lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Assigned {
    /// What to do.
    pub assignment: Assignment,
    /// For how long (whole seconds; nothing for abandon).
    pub ttl: Nanos,
}

/// One bucket's rule: its limit and the protocol's timings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shares {
    /// Units per period (`requests_per_unit`).
    pub limit: u64,
    /// The period (the `unit`).
    pub period: Nanos,
    /// The window the rule counts in now, for a fixed window (see
    /// [`counting_window`]); counted only when it lasts at least
    /// [`COUNTED_WINDOW_REPORTS`] report intervals.
    pub window: Option<CountingWindow>,
    /// How often Envoys report (5 s for Envoy 1.40, whatever its
    /// configuration says).
    pub report_interval: Nanos,
    /// How long an assignment lasts (whole seconds).
    pub ttl: Nanos,
    /// How long a bucket reported idle is kept before it is abandoned.
    pub abandon_after: Nanos,
}

/// The window `policy` counts in at `now` when it renews whole (a fixed
/// window), from a fresh bucket: the algorithm's own windows, aligned to
/// the epoch, so every service instance agrees.
pub fn counting_window(policy: &dyn Policy, now: Nanos) -> Option<CountingWindow> {
    let mut state = vec![0; policy.state_len()];
    policy.write_fresh(&mut state, now);
    policy.counting_window(&state, now).filter(|w| w.renews)
}

/// `units × MICROS / span`, per second, rounded down, saturating.
fn per_second(units: u64, span: Nanos) -> u64 {
    let scaled = u128::from(units) * u128::from(MICROS) * u128::from(SECOND.get());
    u64::try_from(scaled / u128::from(span.get().max(1))).unwrap_or(u64::MAX)
}

/// `value × part / whole`, rounded down (`whole` above 0).
fn scale(value: u64, part: u64, whole: u64) -> u64 {
    u64::try_from(u128::from(value) * u128::from(part) / u128::from(whole.max(1))).unwrap_or(u64::MAX)
}

impl Shares {
    /// The limit as a rate, millionths of a unit a second.
    pub fn rate(&self) -> u64 {
        per_second(self.limit, self.period)
    }

    /// The counted window, if this rule counts one.
    fn counted_window(&self) -> Option<CountingWindow> {
        self.window.filter(|_| self.period >= self.report_interval.times(COUNTED_WINDOW_REPORTS))
    }

    /// Records `report` in `table` at `now` and answers the Envoy's
    /// assignment (see the module's rule): `None` for a bucket's first
    /// report, which gets no answer yet. The table is changed in place;
    /// the caller stores it (see [`ShareTable::idle_at`] for how long).
    pub fn report(&self, table: &mut ShareTable, report: Report, now: Nanos) -> Option<Assigned> {
        let ttl = Nanos::from_secs(self.ttl.ceil_seconds().max(1));
        // Assignments expired: no longer held, no longer counted.
        table.envoys.retain(|e| e.until > now || e.envoy == report.envoy);
        let known = table.envoys.iter().position(|e| e.envoy == report.envoy);

        // Abandon a bucket reported idle for long enough.
        let requests = report.allowed.saturating_add(report.denied);
        let idle_since = match (requests, known.and_then(|i| table.envoys.get(i))) {
            (0, Some(e)) if e.idle_since != Nanos::ZERO => e.idle_since,
            (0, _) => now,
            _ => Nanos::ZERO,
        };
        if requests == 0 && now - idle_since >= self.abandon_after {
            table.envoys.retain(|e| e.envoy != report.envoy);
            return Some(Assigned { assignment: Assignment::Abandon, ttl: Nanos::ZERO });
        }

        // What the fleet may be given: the limit's rate, or for a counted
        // window what remains of it over the time left.
        let mut fleet = self.rate();
        if let Some(window) = self.counted_window() {
            if table.window != window.index {
                table.window = window.index;
                table.counted = 0;
            }
            let start = window.end - self.period;
            let inside = (now - start).min(report.elapsed);
            let counted = if report.elapsed == Nanos::ZERO {
                report.allowed
            } else {
                scale(report.allowed, inside.get(), report.elapsed.get())
            };
            table.counted = table.counted.saturating_add(counted);
            let left = window.end - now;
            if table.counted >= self.limit {
                // Spent: nothing more until the window ends.
                let until_end = Nanos::from_secs(left.ceil_seconds().max(1));
                enter(
                    table,
                    known,
                    Entry { envoy: report.envoy, demand: 0, assigned: 0, until: now + until_end, idle_since },
                );
                return Some(Assigned { assignment: Assignment::DenyAll, ttl: until_end });
            }
            fleet = per_second(self.limit - table.counted, left.max(self.report_interval));
        }

        if known.is_none() && table.envoys.len() >= MAX_ENVOYS {
            return Some(Assigned { assignment: Assignment::DenyAll, ttl });
        }
        // A bucket's first report (Envoy sends it at once, over no time)
        // says nothing of the Envoy's demand: it gets no answer yet and
        // stays on its own no-assignment behaviour until its next report,
        // one interval later, with its demand. Answered now, the first of
        // a fleet would take the whole limit and leave the others, below
        // their demand, only floors.
        if known.is_none() && report.elapsed < SECOND {
            let entry = Entry { envoy: report.envoy, demand: UNKNOWN, assigned: 0, until: now + ttl, idle_since };
            enter(table, known, entry);
            return None;
        }

        // This Envoy's demand, and the others'.
        let demand = per_second(requests, report.elapsed.max(SECOND));
        let holds = known.and_then(|i| table.envoys.get(i)).map_or(0, |e| e.assigned);
        enter(table, known, Entry { envoy: report.envoy, demand, assigned: 0, until: now + ttl, idle_since });
        let n = u64::try_from(table.envoys.len()).unwrap_or(u64::MAX).max(1);
        // An Envoy whose demand is not known yet counts as an equal share.
        let equal = fleet / n;
        let total = table
            .envoys
            .iter()
            .fold(0u64, |sum, e| sum.saturating_add(if e.demand == UNKNOWN { equal } else { e.demand }));
        let target =
            if total <= fleet { demand.saturating_add((fleet - total) / n) } else { scale(fleet, demand, total) };
        let others = table.held_by_others(report.envoy);
        let room = fleet.saturating_sub(others);
        // A newcomer (an Envoy holding nothing yet) gets its floor; one
        // holding a share keeps it while the others make room (replacing
        // its own assignment adds nothing to what is held).
        let floor = if holds == 0 {
            let excess_room = fleet.saturating_add(fleet / NEWCOMER_EXCESS_DIVISOR).saturating_sub(others);
            target.min(fleet / NEWCOMER_FLOOR_DIVISOR / n).min(excess_room)
        } else {
            holds
        };
        let share = target.min(room.max(floor));
        let (assignment, rate) = if share == 0 {
            (Assignment::DenyAll, 0)
        } else {
            let bucket = TokenBucket::for_rate(share);
            (Assignment::TokenBucket(bucket), bucket.rate().min(share))
        };
        if let Some(entry) = table.envoys.iter_mut().find(|e| e.envoy == report.envoy) {
            entry.assigned = rate;
        }
        Some(Assigned { assignment, ttl })
    }
}

/// Puts the reporting Envoy's entry in the table: in its place when it is
/// known, else at the end while there is room.
fn enter(table: &mut ShareTable, known: Option<usize>, entry: Entry) {
    if let Some(slot) = known.and_then(|i| table.envoys.get_mut(i)) {
        *slot = entry;
    } else if table.envoys.len() < MAX_ENVOYS {
        table.envoys.push(entry);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::lease::testing::policy;
    use crate::rng::Rng;

    const I: Nanos = Nanos::from_secs(5);

    fn rule(limit: u64, period: Nanos) -> Shares {
        Shares {
            limit,
            period,
            window: None,
            report_interval: I,
            ttl: Nanos::from_secs(15),
            abandon_after: Nanos::from_secs(30),
        }
    }

    fn report(envoy: u64, allowed: u64, denied: u64) -> Report {
        Report { envoy, allowed, denied, elapsed: I }
    }

    /// The assignment of a report that gets one.
    fn answer(shares: &Shares, table: &mut ShareTable, report: Report, now: Nanos) -> Assigned {
        shares.report(table, report, now).unwrap()
    }

    fn per_second_of(assigned: Assigned) -> f64 {
        match assigned.assignment {
            Assignment::TokenBucket(b) => b.rate() as f64 / MICROS as f64,
            _ => 0.0,
        }
    }

    fn at(seconds: u64) -> Nanos {
        Nanos::from_secs(1_700_000_000 + seconds)
    }

    #[test]
    fn token_buckets_have_whole_second_intervals_and_never_exceed_the_share() {
        assert_eq!(
            TokenBucket::for_rate(35 * MICROS),
            TokenBucket { max_tokens: 18, tokens_per_fill: 35, fill_interval: SECOND }
        );
        // 2.7 a second: 2 a second, never more than the share.
        assert_eq!(
            TokenBucket::for_rate(2_700_000),
            TokenBucket { max_tokens: 1, tokens_per_fill: 2, fill_interval: SECOND }
        );
        // 0.3 a second: one token per ⌈1/0.3⌉ = 4 s.
        let slow = TokenBucket::for_rate(300_000);
        assert_eq!(slow, TokenBucket { max_tokens: 1, tokens_per_fill: 1, fill_interval: Nanos::from_secs(4) });
        assert_eq!(slow.rate(), 250_000);
        // The least share: one token per 10⁶ s, not a division by zero.
        assert_eq!(TokenBucket::for_rate(1).fill_interval, Nanos::from_secs(MICROS));
        assert_eq!(TokenBucket::for_rate(u64::MAX).tokens_per_fill, u32::MAX);
    }

    #[test]
    fn demand_above_the_limit_is_split_in_proportion_once_every_envoy_has_reported() {
        let shares = rule(50, SECOND);
        let mut table = ShareTable::default();
        // 3× demand, 70/20/10: 105, 30 and 15 a second over 5 s.
        let demand = [(1, 525), (2, 150), (3, 75)];
        let mut last = [0.0; 3];
        for round in 0..3 {
            for (i, (envoy, count)) in demand.iter().enumerate() {
                let now = at(round * 5 + i as u64);
                last[i] =
                    per_second_of(answer(&shares, &mut table, report(*envoy, *count / 3, count - count / 3), now));
            }
        }
        assert_eq!(last, [35.0, 10.0, 5.0]);
        let held: u64 = table.envoys.iter().map(|e| e.assigned).sum();
        assert_eq!(held, 50 * MICROS);
    }

    #[test]
    fn demand_below_the_limit_gets_its_demand_and_an_equal_part_of_the_spare() {
        let shares = rule(50, SECOND);
        let mut table = ShareTable::default();
        let mut last = [0.0; 2];
        for round in 0..3 {
            last[0] = per_second_of(answer(&shares, &mut table, report(1, 100, 0), at(round * 5)));
            last[1] = per_second_of(answer(&shares, &mut table, report(2, 25, 0), at(round * 5 + 1)));
        }
        // Demands 20 and 5 a second, 25 spare: 32.5 → 32 and 17.5 → 17.
        assert_eq!(last, [32.0, 17.0]);
    }

    #[test]
    fn a_share_moves_only_once_its_holder_has_reported() {
        let shares = rule(50, SECOND);
        let mut table = ShareTable::default();
        for round in 0..3 {
            answer(&shares, &mut table, report(1, 500, 0), at(round * 5));
            answer(&shares, &mut table, report(2, 10, 0), at(round * 5 + 2));
        }
        // Demand moves from 1 to 2: 2 reports first and gets only the room
        // left by 1's assignment in force.
        let first = per_second_of(answer(&shares, &mut table, report(2, 500, 0), at(17)));
        let held_by_1 = table.envoys.iter().find(|e| e.envoy == 1).unwrap().assigned;
        assert!(first * MICROS as f64 <= (50 * MICROS - held_by_1) as f64, "{first}");
        assert!(first < 10.0, "{first}");
        // 1 reports its drop, then 2 gets the rest: within two intervals.
        answer(&shares, &mut table, report(1, 10, 0), at(20));
        let second = per_second_of(answer(&shares, &mut table, report(2, 500, 0), at(22)));
        assert!(second >= 45.0, "{second}");
        let held: u64 = table.envoys.iter().map(|e| e.assigned).sum();
        assert!(held <= 50 * MICROS);
    }

    #[test]
    fn a_newcomer_gets_its_floor_within_five_quarters_of_the_limit() {
        let shares = rule(100, SECOND);
        let mut table = ShareTable::default();
        // One Envoy alone holds the whole limit.
        assert_eq!(per_second_of(answer(&shares, &mut table, report(1, 1_000, 0), at(0))), 100.0);
        // A newcomer: a floor of L / (4 × 2) = 12.5, though 1 holds all.
        assert_eq!(per_second_of(answer(&shares, &mut table, report(2, 1_000, 0), at(1))), 12.0);
        // A third: L / 12 = 8.33 → 8.
        assert_eq!(per_second_of(answer(&shares, &mut table, report(3, 1_000, 0), at(2))), 8.0);
        let held: u64 = table.envoys.iter().map(|e| e.assigned).sum();
        assert!(held <= 125 * MICROS, "{held}");
        // More newcomers: never past 5/4 of the limit.
        for envoy in 4..40 {
            answer(&shares, &mut table, report(envoy, 1_000, 0), at(3));
            let held: u64 = table.envoys.iter().map(|e| e.assigned).sum();
            assert!(held <= 125 * MICROS, "{held}");
        }
        // An Envoy that is no newcomer gets no floor: its target (a 39th of
        // the limit, 2.56 → 2) as far as the room left, or what it holds
        // already, allows.
        let squeezed = answer(&shares, &mut table, report(2, 1_000, 0), at(4));
        assert_eq!(per_second_of(squeezed), 2.0);
        let held: u64 = table.envoys.iter().map(|e| e.assigned).sum();
        assert!(held <= 125 * MICROS, "{held}");
    }

    #[test]
    fn assignments_expire_with_their_time_to_live_and_free_their_share() {
        let shares = rule(10, SECOND);
        let mut table = ShareTable::default();
        answer(&shares, &mut table, report(1, 100, 0), at(0));
        // 1 is gone (no report for longer than the TTL): 2 gets everything.
        let alone = answer(&shares, &mut table, report(2, 100, 0), at(16));
        assert_eq!(per_second_of(alone), 10.0);
        assert_eq!(table.envoys.len(), 1);
        assert_eq!(alone.ttl, Nanos::from_secs(15));
        assert_eq!(table.idle_at(None), at(31));
    }

    #[test]
    fn a_spent_fixed_window_is_denied_until_it_ends() {
        let policy = policy("fixed_window", 100, r#"{"period": "1m"}"#);
        let start = Nanos::from_secs(60 * 28_333_334);
        let mut shares = rule(100, Nanos::from_secs(60));
        let mut table = ShareTable::default();
        shares.window = counting_window(policy.as_ref(), start + Nanos::from_secs(10));
        let first = answer(&shares, &mut table, report(1, 60, 0), start + Nanos::from_secs(10));
        // 60 counted, 40 left over 50 s: 0.8 a second, one token per 2 s.
        assert_eq!(table.counted, 60);
        assert_eq!(
            first.assignment,
            Assignment::TokenBucket(TokenBucket {
                max_tokens: 1,
                tokens_per_fill: 1,
                fill_interval: Nanos::from_secs(2)
            })
        );
        shares.window = counting_window(policy.as_ref(), start + Nanos::from_secs(15));
        let spent = answer(&shares, &mut table, report(2, 45, 0), start + Nanos::from_secs(15));
        assert_eq!(spent, Assigned { assignment: Assignment::DenyAll, ttl: Nanos::from_secs(45) });
        assert_eq!(table.idle_at(Some(start + Nanos::from_secs(60))), start + Nanos::from_secs(60));
        // The next window starts over; a report straddling the boundary
        // counts only its part inside the new window (1 s of 5: 10 of 50).
        let next = start + Nanos::from_secs(61);
        shares.window = counting_window(policy.as_ref(), next);
        let fresh = answer(&shares, &mut table, report(2, 50, 0), next);
        assert_eq!(table.counted, 10);
        assert!(matches!(fresh.assignment, Assignment::TokenBucket(_)));
    }

    #[test]
    fn a_short_window_is_split_as_a_rate() {
        let policy = policy("fixed_window", 50, r#"{"period": "1s"}"#);
        let mut shares = rule(50, SECOND);
        shares.window = counting_window(policy.as_ref(), at(0));
        assert!(shares.window.is_some());
        let mut table = ShareTable::default();
        // 250 allowed in 5 s is the limit's rate, not 5 windows spent.
        let assigned = answer(&shares, &mut table, report(1, 250, 0), at(0));
        assert_eq!(per_second_of(assigned), 50.0);
        assert_eq!(table.counted, 0);
    }

    #[test]
    fn an_idle_bucket_is_abandoned() {
        let shares = rule(10, SECOND);
        let mut table = ShareTable::default();
        answer(&shares, &mut table, report(1, 10, 0), at(0));
        for second in (5..35).step_by(5) {
            let idle = answer(&shares, &mut table, report(1, 0, 0), at(second));
            assert!(matches!(idle.assignment, Assignment::TokenBucket(_)), "{second}");
        }
        assert_eq!(answer(&shares, &mut table, report(1, 0, 0), at(35)).assignment, Assignment::Abandon);
        assert!(table.envoys.is_empty());
        // A request brings it back, as a newcomer.
        assert_eq!(per_second_of(answer(&shares, &mut table, report(1, 3, 0), at(36))), 10.0);
    }

    #[test]
    fn a_table_is_read_back_as_written_and_anything_else_is_empty() {
        let shares = rule(10, SECOND);
        let mut table = ShareTable::default();
        for envoy in 0..5 {
            answer(&shares, &mut table, report(envoy, envoy * 7, 1), at(envoy));
        }
        assert_eq!(ShareTable::decode(Some(&table.encode())), table);
        for bytes in [&b""[..], b"\x02", b"\x01\x00", &[0u8; 57][..]] {
            assert_eq!(ShareTable::decode(Some(bytes)), ShareTable::default(), "{bytes:?}");
        }
        // A truncated entry is left out.
        let bytes = table.encode();
        assert_eq!(ShareTable::decode(Some(&bytes[..bytes.len() - 1])).envoys.len(), 4);
    }

    #[test]
    fn hostile_reports_saturate_and_the_table_stays_bounded() {
        let shares = rule(1_000_000_000, SECOND);
        let mut table = ShareTable::default();
        let huge = Report { envoy: 1, allowed: u64::MAX, denied: u64::MAX, elapsed: SECOND };
        assert!(matches!(answer(&shares, &mut table, huge, at(0)).assignment, Assignment::TokenBucket(_)));
        let forever = Report { envoy: 2, allowed: 1, denied: 0, elapsed: Nanos::NEVER };
        answer(&shares, &mut table, forever, at(0));
        for envoy in 3..(MAX_ENVOYS as u64 + 10) {
            answer(&shares, &mut table, report(envoy, 1, 0), at(1));
        }
        assert_eq!(table.envoys.len(), MAX_ENVOYS);
        let beyond = answer(&shares, &mut table, report(u64::MAX, 1, 0), at(2));
        assert_eq!(beyond.assignment, Assignment::DenyAll);
    }

    /// A tenant below its limit, its Envoys coming in every order within a
    /// few milliseconds (as a fleet's first requests do) with steady
    /// demands of 70/20/10 of half the limit: never denied.
    #[test]
    fn a_tenant_below_its_limit_is_never_denied_whatever_order_its_envoys_come_in() {
        let shares = rule(50, SECOND);
        let orders = [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]];
        for order in orders {
            let mut table = ShareTable::default();
            let mut envoys: Vec<Envoy> = [17.5, 5.0, 2.5]
                .iter()
                .enumerate()
                .map(|(id, demand)| Envoy {
                    id: id as u64,
                    demand: *demand,
                    next_report: None,
                    last_report: Nanos::ZERO,
                    assignment: None,
                    bucket: None,
                    allowed: 0,
                    denied: 0,
                })
                .collect();
            let start = at(0);
            for e in &mut envoys {
                let k = order.iter().position(|o| *o == e.id as usize).unwrap() as u64;
                // Its first request k ms in; then evenly spaced.
                e.next_report = Some(start + Nanos::from_millis(k));
            }
            let mut next_request: Vec<Nanos> = envoys.iter().map(|e| e.next_report.unwrap()).collect();
            let mut reported = [false; 3];
            let mut now = start;
            while now < start + Nanos::from_secs(40) {
                for (i, e) in envoys.iter_mut().enumerate() {
                    if next_request[i] <= now {
                        if !reported[i] {
                            reported[i] = true;
                            let first = Report { envoy: e.id, allowed: 0, denied: 0, elapsed: Nanos::ZERO };
                            e.assign(shares.report(&mut table, first, now), now);
                            e.last_report = now;
                            e.next_report = Some(now + I);
                        }
                        assert!(e.admit(now), "order {order:?}: Envoy {} denied at {:?}", e.id, now - start);
                        next_request[i] += Nanos::from_nanos((1e9 / e.demand) as u64);
                    }
                    if reported[i] && e.next_report.is_some_and(|r| r <= now) {
                        let report =
                            Report { envoy: e.id, allowed: e.allowed, denied: e.denied, elapsed: now - e.last_report };
                        e.allowed = 0;
                        e.denied = 0;
                        e.assign(shares.report(&mut table, report, now), now);
                        e.last_report = now;
                        e.next_report = Some(now + I);
                    }
                }
                now += Nanos::from_millis(1);
            }
        }
    }

    /// Envoy's token bucket as Envoy 1.40 runs it: refilled continuously at
    /// `tokens_per_fill / fill_interval`, full when new, and a replacement
    /// (any change of configuration) starting at the old one's fill ratio.
    #[derive(Debug, Clone, Copy)]
    struct EnvoyBucket {
        config: TokenBucket,
        tokens: f64,
        at: Nanos,
    }

    impl EnvoyBucket {
        fn rate(&self) -> f64 {
            f64::from(self.config.tokens_per_fill) / (self.config.fill_interval.get() as f64 / 1e9)
        }

        fn refill(&mut self, now: Nanos) {
            let elapsed = (now - self.at).get() as f64 / 1e9;
            self.tokens = (self.tokens + elapsed * self.rate()).min(f64::from(self.config.max_tokens));
            self.at = now;
        }
    }

    /// One simulated Envoy of the fleet.
    struct Envoy {
        id: u64,
        /// Requests offered a second.
        demand: f64,
        /// Its next report, once it has reported.
        next_report: Option<Nanos>,
        last_report: Nanos,
        assignment: Option<Assignment>,
        bucket: Option<EnvoyBucket>,
        allowed: u64,
        denied: u64,
    }

    impl Envoy {
        fn admit(&mut self, now: Nanos) -> bool {
            let ok = match self.assignment {
                Some(Assignment::TokenBucket(_)) => match self.bucket.as_mut() {
                    Some(b) => {
                        b.refill(now);
                        let ok = b.tokens >= 1.0;
                        if ok {
                            b.tokens -= 1.0;
                        }
                        ok
                    }
                    None => false,
                },
                Some(Assignment::DenyAll) => false,
                _ => true,
            };
            if ok {
                self.allowed += 1;
            } else {
                self.denied += 1;
            }
            ok
        }

        /// Takes an answer; none (a first report) leaves the Envoy on its
        /// no-assignment behaviour (allow-all here).
        fn assign(&mut self, assigned: Option<Assigned>, now: Nanos) {
            let Some(assigned) = assigned else { return };
            self.assignment = Some(assigned.assignment);
            match assigned.assignment {
                Assignment::TokenBucket(config) => {
                    let bucket = match self.bucket {
                        Some(mut old) if old.config == config => {
                            old.refill(now);
                            old
                        }
                        Some(mut old) => {
                            old.refill(now);
                            let ratio = old.tokens / f64::from(old.config.max_tokens);
                            EnvoyBucket { config, tokens: f64::from(config.max_tokens) * ratio, at: now }
                        }
                        None => EnvoyBucket { config, tokens: f64::from(config.max_tokens), at: now },
                    };
                    self.bucket = Some(bucket);
                }
                _ => self.bucket = None,
            }
        }
    }

    /// A fleet of Envoys on a fake clock, with random arrivals, random
    /// report phases, newcomers and demand moving between them: every 5 s
    /// span admits at most `L × T + B` without a newcomer in the interval
    /// before it or during it, and `L × T + B + L/4 × I` with one, where
    /// `B = L/2 + n`; after two intervals of saturating demand, at least
    /// 0.85 of `L × T`.
    #[test]
    fn the_fleet_stays_within_the_bound() {
        const STEP: Nanos = Nanos::from_millis(5);
        for seed in 1..=6u64 {
            let limit = [50, 50, 200, 7, 1000, 50][usize::try_from(seed - 1).unwrap()];
            let shares = rule(limit, SECOND);
            let l = limit as f64;
            let mut rng = Rng::new(seed);
            let mut table = ShareTable::default();
            let mut envoys: Vec<Envoy> = (0..3)
                .map(|id| Envoy {
                    id,
                    demand: 3.0 * l * [0.7, 0.2, 0.1][usize::try_from(id).unwrap()],
                    next_report: None,
                    last_report: Nanos::ZERO,
                    assignment: None,
                    bucket: None,
                    allowed: 0,
                    denied: 0,
                })
                .collect();
            let start = at(0);
            let span = Nanos::from_secs(5);
            let mut admitted: Vec<(Nanos, u64)> = Vec::new();
            let mut newcomers: Vec<Nanos> = Vec::new();
            let mut now = start;
            let end = start + Nanos::from_secs(120);
            while now < end {
                let t = (now - start) / SECOND;
                // At 40 s demand moves from Envoy 0 to Envoy 2; at 70 s a
                // newcomer joins; at 90 s demand drops below the limit.
                if t == 40 {
                    envoys.iter_mut().for_each(|e| e.demand = if e.id == 0 { 0.1 * 3.0 * l } else { e.demand });
                    if let Some(e) = envoys.get_mut(2) {
                        e.demand = 0.7 * 3.0 * l;
                    }
                }
                if t == 70 && envoys.len() == 3 {
                    envoys.push(Envoy {
                        id: 3,
                        demand: l,
                        next_report: None,
                        last_report: Nanos::ZERO,
                        assignment: None,
                        bucket: None,
                        allowed: 0,
                        denied: 0,
                    });
                }
                if t == 90 {
                    envoys.iter_mut().for_each(|e| e.demand = 0.1 * l);
                }
                for e in &mut envoys {
                    let p = e.demand * STEP.get() as f64 / 1e9;
                    let mut arrivals = 0;
                    let mut left = p;
                    while left > 0.0 {
                        if rng.uniform() < left.min(1.0) {
                            arrivals += 1;
                        }
                        left -= 1.0;
                    }
                    for _ in 0..arrivals {
                        if e.next_report.is_none() {
                            // A new bucket is reported at once.
                            newcomers.push(now);
                            let got = shares.report(
                                &mut table,
                                Report { envoy: e.id, allowed: 0, denied: 0, elapsed: Nanos::ZERO },
                                now,
                            );
                            e.assign(got, now);
                            // Its report timer runs since the Envoy started.
                            e.next_report = Some(now + Nanos::from_millis(1 + rng.below(5_000)));
                            e.last_report = now;
                        }
                        // What an Envoy admits on its own no-assignment
                        // behaviour is its configuration's, not the shares'.
                        let assigned = e.assignment.is_some();
                        if e.admit(now) && assigned {
                            admitted.push((now, 1));
                        }
                    }
                    if e.next_report.is_some_and(|r| r <= now) {
                        let got = shares.report(
                            &mut table,
                            Report {
                                envoy: e.id,
                                allowed: e.allowed,
                                denied: e.denied,
                                // Whole seconds, as Envoy counts them.
                                elapsed: Nanos::from_secs((now - e.last_report) / SECOND),
                            },
                            now,
                        );
                        e.last_report = now;
                        e.allowed = 0;
                        e.denied = 0;
                        e.assign(got, now);
                        e.next_report = Some(now + span);
                    }
                }
                now += STEP;
            }
            let n = envoys.len() as f64;
            let burst = l / 2.0 + n;
            for from_s in 0..115u64 {
                let from = start + Nanos::from_secs(from_s);
                let to = from + span;
                let count = admitted.iter().filter(|(at, _)| *at >= from && *at < to).count() as f64;
                // The first requests of a bucket pass before any assignment
                // (Envoy's no-assignment behaviour): the bound starts after.
                if from_s < 1 {
                    continue;
                }
                let newcomer_near = newcomers.iter().any(|at| *at + I >= from && *at < to);
                let bound = l * 5.0 + burst + if newcomer_near { l / 4.0 * 5.0 } else { 0.0 };
                assert!(
                    count <= bound,
                    "seed {seed}, limit {limit}: {count} admitted in [{from_s}, {from_s}+5) s > {bound}"
                );
                // Saturating demand, two intervals after each change.
                let saturated = (10..35).contains(&from_s) || (50..65).contains(&from_s) || (80..85).contains(&from_s);
                if saturated && limit >= 50 {
                    assert!(count >= 0.85 * l * 5.0, "seed {seed}: only {count} admitted in [{from_s}, {from_s}+5) s");
                }
            }
        }
    }
}
