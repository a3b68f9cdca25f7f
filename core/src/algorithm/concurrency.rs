//! Concurrency: at most `limit` units in flight per descriptor at once, across
//! every worker (ShenYu's concurrent limiter). A request takes `cost` slots when admitted and
//! gives them back when its stream ends ([`Release::Done`]) or when it is
//! not served after all ([`Release::Undo`]).
//!
//! A release can be lost: the VM crashes or is reloaded mid-request, a
//! callback never comes. So that lost releases never leak slots forever,
//! every slot has a deadline after which it is reclaimed. Keeping one
//! deadline per slot would make the state grow with `limit`; instead time is
//! cut into epochs of `slot_ttl / 3` (rounded up, so three epochs cover
//! `slot_ttl`) and the state is a ring of the [`EPOCHS`] latest epochs, each
//! with the number of slots taken in it. Slots taken in epoch `e` are
//! reclaimed when epoch `e + 4` begins, that is at `(e + 4) × epoch`: a slot
//! is held for more than `slot_ttl` and at most four epochs, about
//! `slot_ttl × 4/3` (see [`Concurrency::longest_hold`]). A stream that lasts longer than that stops
//! counting: `slot_ttl` trades how long a lost release blocks a slot against
//! how long a legitimate stream is guaranteed to count.
//!
//! A release frees the slots in the epoch its grant was taken in (the grant
//! remembers when), if that epoch is still in the ring; a grant whose epoch
//! was reclaimed frees nothing, so no slot is ever freed twice.

use super::{Algorithm, Decision, FromParams, Grant, Params, Quota, Release};
use crate::error::ConfigError;
use crate::time::Nanos;

/// Epochs in the ring: three cover `slot_ttl`, the fourth is the one being
/// filled. More epochs would reclaim closer to `slot_ttl` at 4 bytes each.
pub const EPOCHS: usize = 4;

/// `slot_ttl` when none is configured.
pub const DEFAULT_SLOT_TTL: Nanos = Nanos::from_secs(300);

/// Concurrency parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Concurrency {
    limit: u64,
    slot_ttl: Nanos,
    epoch: Nanos,
}

/// A bucket's state: slots taken in each of the latest [`EPOCHS`] epochs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotState {
    /// Index (`instant / epoch`) of the epoch `held[0]` counts.
    pub newest: u64,
    /// `held[j]`: slots taken in epoch `newest - j` and not yet given back.
    pub held: [u32; EPOCHS],
}

impl Concurrency {
    /// At most `limit` slots in flight, each reclaimed after about `slot_ttl`.
    pub fn new(limit: u64, slot_ttl: Nanos) -> Self {
        let slot_ttl = slot_ttl.max(Nanos::ONE);
        let epoch = slot_ttl.div_ceil(EPOCHS as u64 - 1);
        Self { limit: limit.max(1), slot_ttl, epoch }
    }

    /// The longest a slot is held without a release: four epochs. Every slot
    /// is held longer than `slot_ttl` (three epochs cover it).
    pub fn longest_hold(&self) -> Nanos {
        self.epoch.times(EPOCHS as u64)
    }

    fn epoch_of(&self, instant: Nanos) -> u64 {
        instant / self.epoch
    }

    /// When the slots taken in epoch `index` are reclaimed.
    fn deadline(&self, index: u64) -> Nanos {
        self.epoch.times(index.saturating_add(EPOCHS as u64))
    }

    /// The state at `now`: epochs whose deadline has passed are dropped.
    pub fn advance(&self, state: SlotState, now: Nanos) -> SlotState {
        let current = self.epoch_of(now);
        if current > state.newest {
            let shift = usize::try_from(current - state.newest).unwrap_or(usize::MAX);
            let mut held = [0; EPOCHS];
            for (j, slot) in held.iter_mut().enumerate().skip(shift) {
                *slot = state.held[j - shift];
            }
            SlotState { newest: current, held }
        } else if current < state.newest && total(&state) == 0 {
            // The clock stepped back with nothing held: start from now, as a
            // fresh bucket would.
            self.fresh(now)
        } else {
            // Same epoch, or the clock stepped back: every stored epoch is
            // still live, nothing is reclaimed until the clock catches up.
            state
        }
    }

    /// Where in the ring a grant taken at `at` is counted, if it still is.
    fn index_of(&self, state: &SlotState, at: Nanos) -> Option<usize> {
        let age = state.newest.checked_sub(self.epoch_of(at))?;
        usize::try_from(age).ok().filter(|&j| j < EPOCHS)
    }

    /// Time from `now` until the oldest epochs have given back `needed` slots.
    fn time_to_reclaim(&self, state: &SlotState, now: Nanos, needed: u64) -> Nanos {
        let mut freed = 0u64;
        for j in (0..EPOCHS).rev() {
            freed += u64::from(state.held[j]);
            if freed >= needed {
                return self.deadline(state.newest.saturating_sub(j as u64)) - now;
            }
        }
        Nanos::NEVER
    }

    /// Remaining slots, and the time until the oldest held slots are reclaimed.
    fn report(&self, state: &SlotState, now: Nanos) -> (u64, Nanos) {
        let held = total(state);
        let reset = if held == 0 { Nanos::ZERO } else { self.time_to_reclaim(state, now, 1) };
        (self.limit.saturating_sub(held), reset)
    }
}

/// Slots a state counts.
fn total(state: &SlotState) -> u64 {
    state.held.iter().map(|&n| u64::from(n)).sum()
}

fn get_u32(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

impl Algorithm for Concurrency {
    type State = SlotState;

    fn state_len(&self) -> usize {
        8 + 4 * EPOCHS
    }

    fn decode(&self, bytes: &[u8]) -> Option<SlotState> {
        let newest = super::get_u64(bytes, 0)?;
        let mut held = [0; EPOCHS];
        for (j, slot) in held.iter_mut().enumerate() {
            *slot = get_u32(bytes, 8 + 4 * j)?;
        }
        Some(SlotState { newest, held })
    }

    fn encode(&self, state: &SlotState, out: &mut [u8]) {
        super::put_u64(out, 0, state.newest);
        for (j, n) in state.held.iter().enumerate() {
            if let Some(dst) = out.get_mut(8 + 4 * j..12 + 4 * j) {
                dst.copy_from_slice(&n.to_le_bytes());
            }
        }
    }

    fn capacity(&self) -> u64 {
        self.limit
    }

    /// `limit` at once, no window.
    fn quota(&self) -> Quota {
        Quota { limit: self.limit, window: None }
    }

    /// Nothing held.
    fn fresh(&self, now: Nanos) -> SlotState {
        SlotState { newest: self.epoch_of(now), held: [0; EPOCHS] }
    }

    /// Admits `cost` slots if that many are free. A denial's `retry_after` is
    /// exactly when enough held slots will have been reclaimed; a release may
    /// free them sooner, which the client cannot know.
    fn decide(&self, state: SlotState, now: Nanos, cost: u64) -> (Decision, SlotState) {
        let current = self.advance(state, now);
        let held = total(&current);
        match held.checked_add(cost).filter(|&after| after <= self.limit) {
            Some(_) => {
                // After a clock step back the grant's epoch may be older than
                // the ring: it is counted in the oldest epoch, and its release
                // (whose epoch is not in the ring) frees nothing, so its slots
                // come back when that epoch is reclaimed.
                let age = current.newest.saturating_sub(self.epoch_of(now));
                let index = usize::try_from(age).unwrap_or(usize::MAX).min(EPOCHS - 1);
                let mut after = current;
                // `held + cost <= limit <= 10^9` fits in a u32.
                after.held[index] = u32::try_from(u64::from(after.held[index]) + cost).unwrap_or(u32::MAX);
                let (remaining, reset) = self.report(&after, now);
                (Decision::admit(remaining, reset), after)
            }
            None => {
                let retry_after = if cost > self.limit {
                    Nanos::NEVER
                } else {
                    self.time_to_reclaim(&current, now, held + cost - self.limit)
                };
                let (remaining, reset) = self.report(&current, now);
                (Decision::deny(remaining, reset, retry_after), state)
            }
        }
    }

    /// Done and Undo both free the grant's slots, if its epoch is still held.
    fn release(&self, state: SlotState, now: Nanos, grant: Grant, _why: Release) -> Option<SlotState> {
        let mut after = self.advance(state, now);
        if let Some(index) = self.index_of(&after, grant.at) {
            let freed = u32::try_from(grant.cost).unwrap_or(u32::MAX).min(after.held[index]);
            after.held[index] -= freed;
        }
        // Reclaiming expired epochs on the way is a change worth writing.
        (after != state).then_some(after)
    }

    /// Nothing held at `now`.
    fn is_idle(&self, state: SlotState, now: Nanos) -> bool {
        total(&self.advance(state, now)) == 0
    }

    /// The deadline of the newest epoch still holding slots.
    fn idle_at(&self, state: SlotState, now: Nanos) -> Nanos {
        let state = self.advance(state, now);
        match state.held.iter().position(|&n| n > 0) {
            Some(j) => self.deadline(state.newest.saturating_sub(j as u64)).max(now),
            None => now,
        }
    }

    fn holds_until_done(&self) -> bool {
        true
    }

    /// Every slot recorded, including those past their deadline that no
    /// decision has dropped yet.
    fn held(&self, state: &SlotState) -> u64 {
        total(state)
    }

    /// Without releases, the slots taken in any [`EPOCHS`] consecutive epochs
    /// are all held just before the first of them expires, so together they
    /// are at most `limit`. An interval of `span` (both ends included)
    /// touches at most `⌈span / epoch⌉ + 1` epochs, hence at most that many
    /// ÷ 4 (rounded up) such groups of epochs.
    fn admitted_bound(&self, span: Nanos) -> u64 {
        let epochs = span.get().div_ceil(self.epoch.get()).saturating_add(1);
        self.limit.saturating_mul(epochs.div_ceil(EPOCHS as u64))
    }
}

impl FromParams for Concurrency {
    const FIELDS: &'static [&'static str] = &["slot_ttl"];

    const LOCAL_ONLY: Option<&'static str> = Some(
        "it counts requests in flight and needs each request's end, which a check or lease cannot report; keep \
         concurrency limits in the filter",
    );

    /// `slot_ttl` (default 5 minutes).
    fn from_params(params: &mut Params) -> Result<Self, ConfigError> {
        let slot_ttl = params.duration("slot_ttl")?.unwrap_or(DEFAULT_SLOT_TTL);
        Ok(Self::new(params.limit(), slot_ttl))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::SECOND;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// A multiple of every epoch used below, so epochs start at T0.
    const T0: Nanos = Nanos::from_secs(1_700_000_000).floor_to(Nanos::from_secs(30));

    fn take(limiter: &Concurrency, state: SlotState, now: Nanos, cost: u64) -> (bool, SlotState) {
        let (decision, after) = limiter.decide(state, now, cost);
        (decision.allowed(), after)
    }

    /// `slot_ttl` 30 s: epochs of 10 s, slots held 30 to 40 s.
    fn limiter(limit: u64) -> Concurrency {
        Concurrency::new(limit, SECOND.times(30))
    }

    #[test]
    fn admits_the_limit_in_flight_and_frees_on_release() {
        let limiter = limiter(3);
        let mut state = limiter.fresh(T0);
        for expected_remaining in [2, 1, 0] {
            let (decision, after) = limiter.decide(state, T0, 1);
            assert!(decision.allowed());
            assert_eq!(decision.remaining, expected_remaining);
            assert_eq!(decision.reset, SECOND.times(40), "the slots of epoch T0 are reclaimed 4 epochs on");
            state = after;
        }
        let (denied, same) = limiter.decide(state, T0 + SECOND, 1);
        assert!(!denied.allowed());
        assert_eq!(same, state);
        assert_eq!(denied.retry_after(), SECOND.times(39));
        for why in [Release::Done, Release::Undo] {
            let freed = limiter.release(state, T0 + SECOND, Grant { cost: 1, at: T0 }, why).unwrap();
            assert_eq!(total(&freed), 2, "{why:?}");
            assert!(take(&limiter, freed, T0 + SECOND, 1).0);
        }
    }

    #[test]
    fn a_cost_takes_that_many_slots() {
        let limiter = limiter(5);
        let (ok, state) = take(&limiter, limiter.fresh(T0), T0, 4);
        assert!(ok);
        assert!(!take(&limiter, state, T0, 2).0);
        assert!(take(&limiter, state, T0, 1).0);
        assert_eq!(limiter.decide(state, T0, 6).0.retry_after(), Nanos::NEVER, "more than the limit: never");
    }

    #[test]
    fn lost_releases_are_reclaimed_exactly_at_the_deadline() {
        let limiter = limiter(2);
        // One slot at T0 + 5 s (epoch 0), one at T0 + 25 s (epoch 2); neither is released.
        let (_, state) = take(&limiter, limiter.fresh(T0), T0 + SECOND.times(5), 1);
        let (_, state) = take(&limiter, state, T0 + SECOND.times(25), 1);
        let (denied, _) = limiter.decide(state, T0 + SECOND.times(30), 1);
        assert_eq!(denied.retry_after(), SECOND.times(10), "epoch 0 is reclaimed at T0 + 40 s");
        assert!(!take(&limiter, state, T0 + SECOND.times(40) - Nanos::from_nanos(1), 1).0);
        assert!(take(&limiter, state, T0 + SECOND.times(40), 1).0);
        // Two slots at once: wait for epoch 2 too, at T0 + 60 s.
        assert_eq!(limiter.decide(state, T0 + SECOND.times(30), 2).0.retry_after(), SECOND.times(30));
        assert!(limiter.is_idle(state, T0 + SECOND.times(60)));
        assert!(!limiter.is_idle(state, T0 + SECOND.times(60) - Nanos::from_nanos(1)));
    }

    #[test]
    fn every_slot_is_held_longer_than_slot_ttl_and_at_most_the_longest_hold() {
        let limiter = limiter(1);
        assert_eq!(limiter.longest_hold(), SECOND.times(40));
        for offset in [Nanos::ZERO, Nanos::from_nanos(1), SECOND.times(5), SECOND.times(10) - Nanos::from_nanos(1)] {
            let at = T0 + offset;
            let (_, state) = take(&limiter, limiter.fresh(at), at, 1);
            assert!(!limiter.is_idle(state, at + SECOND.times(30)), "held at slot_ttl (taken at +{offset})");
            assert!(limiter.is_idle(state, at + limiter.longest_hold()));
        }
    }

    #[test]
    fn a_release_after_the_reclaim_frees_nothing_twice() {
        let limiter = limiter(2);
        let (_, state) = take(&limiter, limiter.fresh(T0), T0, 1);
        // 45 s later the slot was reclaimed; a newer one is taken.
        let later = T0 + SECOND.times(45);
        let (_, state) = take(&limiter, state, later, 1);
        assert_eq!(total(&state), 1);
        let released = limiter.release(state, later, Grant { cost: 1, at: T0 }, Release::Done);
        assert_eq!(released, None, "the old grant's epoch is gone: the newer slot stays held");
        // A release that finds its epoch reclaimed still writes the reclaim.
        let (_, old) = take(&limiter, limiter.fresh(T0), T0, 1);
        let reclaimed = limiter.release(old, later, Grant { cost: 1, at: T0 }, Release::Done).unwrap();
        assert_eq!(total(&reclaimed), 0);
    }

    #[test]
    fn a_clock_step_back_keeps_every_slot() {
        let limiter = limiter(1);
        let (_, state) = take(&limiter, limiter.fresh(T0 + SECOND.times(20)), T0 + SECOND.times(20), 1);
        assert!(!take(&limiter, state, T0, 1).0, "the clock went back 20 s: the slot is still held");
        let freed = limiter.release(state, T0, Grant { cost: 1, at: T0 + SECOND.times(20) }, Release::Done).unwrap();
        assert!(limiter.is_idle(freed, T0));
        // Idle after a step back decides like a fresh bucket.
        assert_eq!(limiter.decide(freed, T0, 1), limiter.decide(limiter.fresh(T0), T0, 1));
    }

    #[test]
    fn the_bound_holds_for_takes_spread_over_four_epochs() {
        let limiter = limiter(4);
        // One slot at the start of each epoch: all four live at T0 + 40 s - 1.
        let mut state = limiter.fresh(T0);
        for k in 0..4u64 {
            let (ok, next) = take(&limiter, state, T0 + SECOND.times(10 * k), 1);
            assert!(ok);
            state = next;
        }
        assert!(!take(&limiter, state, T0 + SECOND.times(40) - Nanos::from_nanos(1), 1).0);
        // 40 s touch 5 epochs: four slots taken at T0 + 9 s are reclaimed at
        // T0 + 40 s and four more fit before T0 + 49 s.
        assert_eq!(limiter.admitted_bound(SECOND.times(40) - Nanos::from_nanos(1)), 8);
        assert_eq!(limiter.admitted_bound(SECOND.times(30)), 4, "30 s touch at most 4 epochs");
        assert_eq!(limiter.admitted_bound(SECOND.times(30) + Nanos::from_nanos(1)), 8);
    }

    #[test]
    fn state_round_trips_and_reports_what_it_holds() {
        let limiter = limiter(10);
        let state = SlotState { newest: 42, held: [1, 2, 3, u32::MAX] };
        let mut bytes = [0u8; 24];
        limiter.encode(&state, &mut bytes);
        assert_eq!(limiter.decode(&bytes), Some(state));
        assert_eq!(limiter.decode(&bytes[..23]), None);
        assert_eq!(limiter.held(&state), 6 + u64::from(u32::MAX));
        assert_eq!(limiter.quota(), Quota { limit: 10, window: None });
    }

    #[test]
    fn slot_ttl_defaults_to_five_minutes() {
        let mut params = Params::new("rules[0]", 5, serde_json::Map::new());
        let limiter = Concurrency::from_params(&mut params).unwrap();
        assert_eq!(limiter.slot_ttl, DEFAULT_SLOT_TTL);
        assert_eq!(limiter.epoch, SECOND.times(100));
    }
}
