//! The overshoot budget: an opt-in, per global rule, for keys whose
//! requests spread so thin over a fleet that a (key, Envoy) pair rarely
//! holds a lease when its next request comes (see README, "Thin pairs").
//! Strict, the default, makes such a request wait for a call to the quota
//! service; with a budget the Envoy admits it at once, up to `limit` units
//! per `period` of each key it holds no lease for, and reports what it so
//! admitted with the key's next lease call (`reported`), which the service
//! counts in the key's bucket before it decides that lease. The service
//! answers `near_limit` once a key has used more than three quarters of
//! its limit; the Envoy then stops admitting the key without a lease until
//! the window after the one the answer came in has ended. The service also
//! posts such a key on its notice board, and every lease call of an Envoy
//! whose rules admit without a lease brings the board back: the Envoy keeps
//! the notices in a [`NearSet`] in shared data, and its pools admit none
//! of those keys without a lease either. So the fleet hears that a key is
//! near from any call, not only from a call about that key.
//!
//! **The bound.** Units admitted with leases (and checks) stay within the
//! limit, as always; units admitted without one are at most the budget per
//! period and Envoy, whatever the service says. A window of length `W`
//! overlaps at most `⌈W / period⌉ + 1` of an Envoy's budget periods (they
//! are aligned to the Envoy's clock, not to the window), so the most a
//! window can admit over its limit, fleet-wide, is
//! `E × limit × (⌈W / period⌉ + 1)` for `E` Envoys that admit the key
//! without a lease in it ([`worst_case_over`]). Reports count those units in
//! the service, so the leases that follow shrink by them: the bound is
//! reached only when every Envoy spends its budget after the key's window
//! is already full and before any has heard that it is near.

use super::allowance::share_of;
use crate::algorithm::{get_u64, put_u64};
use crate::hash::SipHasher;
use crate::time::Nanos;

/// The largest budget a rule may state per period: a few requests, not a
/// second limit.
pub const MAX_OVERSHOOT: u64 = 1_000;

/// A global rule's overshoot budget (`"overshoot": {"limit": 2, "period": "1s"}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overshoot {
    /// Units one Envoy may admit of one key without a lease, per period.
    pub limit: u64,
    /// The budget's period; its periods start at multiples of it on the
    /// Envoy's clock.
    pub period: Nanos,
}

/// What a pool keeps of its budget: the period that counts and what it
/// admitted in it, and what it admitted without a lease that the service
/// has not been told of yet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Unleased {
    /// Start of the budget period the count is of.
    pub period_start: Nanos,
    /// Units admitted without a lease in that period.
    pub used: u64,
    /// Units admitted without a lease and not yet reported.
    pub unreported: u64,
    /// The service said the key is near its limit: nothing admitted
    /// without a lease until this instant.
    pub strict_until: Nanos,
}

impl Overshoot {
    /// Admits `cost` units without a lease at `now` if the period's budget
    /// holds them and the key is not near its limit: the budget after, or
    /// `None` (the request waits for a lease, as under strict).
    pub fn admit(&self, budget: Unleased, now: Nanos, cost: u64) -> Option<Unleased> {
        if now < budget.strict_until || self.period == Nanos::ZERO {
            return None;
        }
        let period_start = now.floor_to(self.period);
        let used = if budget.period_start == period_start { budget.used } else { 0 };
        let used = used.checked_add(cost).filter(|&used| used <= self.limit)?;
        Some(Unleased { period_start, used, unreported: budget.unreported.saturating_add(cost), ..budget })
    }

    /// Whether the budget alone covers a pool spending `rate` units a
    /// second: then its claims only report (see `LeasePool::spend`).
    pub fn covers(&self, rate: f64) -> bool {
        self.period.events_at(rate) <= self.limit as f64
    }

    /// Whether forgetting `budget` at `now` would let the Envoy admit more
    /// than the bound: while its period counts, or the key is held strict.
    pub fn in_use(&self, budget: &Unleased, now: Nanos) -> bool {
        now < self.in_use_until(budget)
    }

    /// Until when `budget` is in use (see [`Overshoot::in_use`]).
    pub fn in_use_until(&self, budget: &Unleased) -> Nanos {
        let period_end = if budget.used > 0 { budget.period_start + self.period } else { Nanos::ZERO };
        period_end.max(budget.strict_until)
    }
}

/// Whether a key with `remaining` of `capacity` left is near its limit: it
/// has used more than three quarters of it (the share up to which it may
/// still hold allowances), so units admitted without a lease could soon
/// pass it.
pub fn near_limit(remaining: u64, capacity: u64) -> bool {
    capacity.saturating_sub(remaining) > share_of(capacity)
}

/// The most a window of length `window` admits over its limit, fleet-wide,
/// when `envoys` Envoys each admit the key without a lease under `budget`:
/// `envoys × limit × (⌈window / period⌉ + 1)`.
pub fn worst_case_over(envoys: u64, budget: &Overshoot, window: Nanos) -> u64 {
    let periods = window.get().div_ceil(budget.period.get().max(1)).saturating_add(1);
    envoys.saturating_mul(budget.limit).saturating_mul(periods)
}

/// Most notices an Envoy keeps (the service sends at most 32 a call).
pub const NEAR_SLOTS: usize = 64;

/// The keys an Envoy heard are near their limit, each until when: a fixed
/// number of slots, the one ending soonest given up for a new one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NearSet {
    slots: Vec<(u64, Nanos)>,
}

/// A notice's key: a hash of the descriptor as the protocol carries it
/// (the same on every worker and Envoy; a collision only makes a key strict).
pub fn notice_key(descriptor: &[(String, String)]) -> u64 {
    let mut hasher = SipHasher::new(0x6e65_6172, 0x006c_696d_6974);
    for (key, value) in descriptor {
        hasher.write_field(key.as_bytes());
        hasher.write_field(value.as_bytes());
    }
    hasher.finish()
}

impl NearSet {
    /// Until when `key` is near its limit, if it still is at `now`.
    pub fn until(&self, key: u64, now: Nanos) -> Option<Nanos> {
        self.slots.iter().find(|(k, until)| *k == key && *until > now).map(|(_, until)| *until)
    }

    /// Whether no notice holds at `now` (nothing to look up).
    pub fn is_quiet(&self, now: Nanos) -> bool {
        self.slots.iter().all(|(_, until)| *until <= now)
    }

    /// Records that `key` is near until `until`; true when that changed the set.
    pub fn heard(&mut self, key: u64, until: Nanos, now: Nanos) -> bool {
        self.slots.retain(|(_, end)| *end > now);
        if until <= now {
            return false;
        }
        if let Some(slot) = self.slots.iter_mut().find(|(k, _)| *k == key) {
            let later = until > slot.1;
            slot.1 = slot.1.max(until);
            return later;
        }
        if self.slots.len() < NEAR_SLOTS {
            self.slots.push((key, until));
            return true;
        }
        match self.slots.iter_mut().min_by_key(|(_, end)| *end) {
            Some(soonest) if soonest.1 < until => {
                *soonest = (key, until);
                true
            }
            _ => false,
        }
    }

    /// Records every notice of `other`; true when that changed the set.
    pub fn merge(&mut self, other: &NearSet, now: Nanos) -> bool {
        other.slots.iter().fold(false, |changed, &(key, until)| self.heard(key, until, now) || changed)
    }

    /// The set as stored: 16 bytes a notice.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0; self.slots.len() * 16];
        for (i, (key, until)) in self.slots.iter().enumerate() {
            put_u64(&mut out, i * 16, *key);
            put_u64(&mut out, i * 16 + 8, until.get());
        }
        out
    }

    /// A stored set (what does not read as one: empty, which only makes
    /// the pools less strict than the notices asked, never lets a lease's
    /// tokens count twice).
    pub fn decode(bytes: &[u8]) -> NearSet {
        let slots = (0..(bytes.len() / 16).min(NEAR_SLOTS))
            .map_while(|i| Some((get_u64(bytes, i * 16)?, Nanos::from_nanos(get_u64(bytes, i * 16 + 8)?))))
            .collect();
        NearSet { slots }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::SECOND;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const T0: Nanos = Nanos::from_secs(1_700_000_000);
    const BUDGET: Overshoot = Overshoot { limit: 2, period: SECOND };

    #[test]
    fn a_period_admits_its_budget_and_the_next_period_starts_afresh() {
        let mut budget = Unleased::default();
        let mut admitted = 0;
        for ms in (0..2_000).step_by(100) {
            if let Some(after) = BUDGET.admit(budget, T0 + Nanos::from_millis(ms), 1) {
                budget = after;
                admitted += 1;
            }
        }
        assert_eq!(admitted, 4, "two in each of two periods");
        assert_eq!(budget.unreported, 4);
        assert!(BUDGET.admit(Unleased::default(), T0, 3).is_none(), "a request above the budget waits");
    }

    #[test]
    fn a_key_near_its_limit_is_admitted_only_with_a_lease() {
        let strict = Unleased { strict_until: T0 + SECOND, ..Unleased::default() };
        assert!(BUDGET.admit(strict, T0, 1).is_none());
        assert!(BUDGET.admit(strict, T0 + SECOND, 1).is_some());
        assert!(BUDGET.in_use(&strict, T0) && !BUDGET.in_use(&strict, T0 + SECOND));
        assert!(near_limit(24, 100) && !near_limit(25, 100));
    }

    #[test]
    fn a_budget_is_in_use_while_its_period_counts() {
        let Some(used) = BUDGET.admit(Unleased::default(), T0, 1) else { panic!("admitted") };
        assert!(BUDGET.in_use(&used, T0 + SECOND - Nanos::from_nanos(1)));
        assert!(!BUDGET.in_use(&used, T0 + SECOND));
        assert_eq!(BUDGET.in_use_until(&used), T0 + SECOND);
        assert!(!BUDGET.in_use(&Unleased::default(), T0));
    }

    #[test]
    fn the_worst_case_counts_every_period_a_window_can_overlap() {
        assert_eq!(worst_case_over(3, &BUDGET, SECOND), 3 * 2 * 2);
        assert_eq!(worst_case_over(10, &Overshoot { limit: 1, period: SECOND }, SECOND.times(60)), 10 * 61);
    }

    #[test]
    fn a_near_set_keeps_the_latest_notices_in_a_fixed_room() {
        let mut set = NearSet::default();
        let alice = notice_key(&[("user".into(), "alice".into())]);
        assert_ne!(alice, notice_key(&[("user".into(), "bob".into())]));
        assert!(set.is_quiet(T0));
        assert!(set.heard(alice, T0 + SECOND, T0));
        assert!(!set.heard(alice, T0 + Nanos::from_millis(500), T0), "an earlier end changes nothing");
        assert_eq!(set.until(alice, T0), Some(T0 + SECOND));
        assert_eq!(set.until(alice, T0 + SECOND), None, "over");
        for key in 1..=NEAR_SLOTS as u64 + 10 {
            set.heard(key, T0 + SECOND.times(2 + key), T0);
        }
        assert_eq!(set.slots.len(), NEAR_SLOTS);
        assert_eq!(set.until(alice, T0), None, "the one ending soonest made room");
        assert_eq!(NearSet::decode(&set.encode()), set);
        assert_eq!(NearSet::decode(b"garbage"), NearSet::default());
        let mut other = NearSet::default();
        assert!(other.merge(&set, T0) && !other.merge(&set, T0));
        assert!(set.is_quiet(T0 + SECOND.times(100)));
    }
}
