//! The rate-limiting algorithms, as pure functions of (state, now, cost).
//!
//! Every algorithm can say whether a bucket is *idle*: in a state no different
//! from a never-seen key. Only idle buckets may be reused for another key,
//! so reuse never resets anyone's limit.

mod fixed_window;
mod gcra;
mod token_bucket;

pub use fixed_window::{FixedWindow, WindowState};
pub use gcra::Gcra;
pub use token_bucket::{TokenBucket, TokenState};

use crate::time::Nanos;

/// What an algorithm decided for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Whether the request's cost was admitted.
    pub allowed: bool,
    /// Units still available after this decision.
    pub remaining: u64,
    /// Time until more quota becomes available (0 when the bucket is full):
    /// the `t` of the IETF `RateLimit` field.
    pub reset: Nanos,
    /// When denied, the time after which the same cost would be admitted
    /// (`Nanos::MAX` if it never can be); 0 when allowed.
    pub retry_after: Nanos,
}

/// Which algorithm a rule uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// [`TokenBucket`].
    TokenBucket,
    /// [`Gcra`], the leaky bucket as a meter.
    LeakyBucket,
    /// [`FixedWindow`].
    FixedWindow,
}

impl Kind {
    /// The name used in configuration.
    pub fn name(self) -> &'static str {
        match self {
            Kind::TokenBucket => "token_bucket",
            Kind::LeakyBucket => "leaky_bucket",
            Kind::FixedWindow => "fixed_window",
        }
    }
}

/// One configured algorithm with its parameters, working on a bucket's state
/// as bytes, so that buckets of any algorithm can live in one byte table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// A token bucket.
    TokenBucket(TokenBucket),
    /// A leaky bucket meter (GCRA).
    LeakyBucket(Gcra),
    /// A fixed window.
    FixedWindow(FixedWindow),
}

impl Policy {
    /// Builds the policy for `kind` admitting `limit` units per `period` with
    /// `burst` units at once (ignored by the fixed window).
    pub fn new(kind: Kind, limit: u64, period: Nanos, burst: u64) -> Self {
        match kind {
            Kind::TokenBucket => Policy::TokenBucket(TokenBucket::new(limit, period, burst)),
            Kind::LeakyBucket => Policy::LeakyBucket(Gcra::new(limit, period, burst)),
            Kind::FixedWindow => Policy::FixedWindow(FixedWindow::new(limit, period)),
        }
    }

    /// Bytes one bucket's state takes.
    pub fn state_len(&self) -> usize {
        match self {
            Policy::TokenBucket(_) | Policy::FixedWindow(_) => 16,
            Policy::LeakyBucket(_) => 8,
        }
    }

    /// The most units a single request can ever be admitted for.
    pub fn capacity(&self) -> u64 {
        match self {
            Policy::TokenBucket(b) => b.capacity(),
            Policy::LeakyBucket(m) => m.capacity(),
            Policy::FixedWindow(w) => w.capacity(),
        }
    }

    /// Writes the state of a never-seen bucket into `slot`.
    pub fn write_fresh(&self, slot: &mut [u8], now: Nanos) {
        match self {
            Policy::TokenBucket(b) => TokenBucket::encode(b.fresh(now), slot),
            Policy::LeakyBucket(m) => Gcra::encode(m.fresh(now), slot),
            Policy::FixedWindow(w) => FixedWindow::encode(w.fresh(now), slot),
        }
    }

    /// Decides on the bucket in `slot` and writes its new state back.
    /// A slot of the wrong size is treated as a fresh bucket.
    pub fn decide(&self, slot: &mut [u8], now: Nanos, cost: u64) -> Decision {
        match self {
            Policy::TokenBucket(b) => {
                let state = TokenBucket::decode(slot).unwrap_or_else(|| b.fresh(now));
                let (decision, after) = b.decide(state, now, cost);
                TokenBucket::encode(after, slot);
                decision
            }
            Policy::LeakyBucket(m) => {
                let tat = Gcra::decode(slot).unwrap_or_else(|| m.fresh(now));
                let (decision, after) = m.decide(tat, now, cost);
                Gcra::encode(after, slot);
                decision
            }
            Policy::FixedWindow(w) => {
                let state = FixedWindow::decode(slot).unwrap_or_else(|| w.fresh(now));
                let (decision, after) = w.decide(state, now, cost);
                FixedWindow::encode(after, slot);
                decision
            }
        }
    }

    /// Gives back `cost` units to the bucket in `slot`.
    pub fn refund(&self, slot: &mut [u8], now: Nanos, cost: u64) {
        match self {
            Policy::TokenBucket(b) => {
                if let Some(state) = TokenBucket::decode(slot) {
                    TokenBucket::encode(b.refund(state, now, cost), slot);
                }
            }
            Policy::LeakyBucket(m) => {
                if let Some(tat) = Gcra::decode(slot) {
                    Gcra::encode(m.refund(tat, now, cost), slot);
                }
            }
            Policy::FixedWindow(w) => {
                if let Some(state) = FixedWindow::decode(slot) {
                    FixedWindow::encode(w.refund(state, now, cost), slot);
                }
            }
        }
    }

    /// True when the bucket in `slot` is indistinguishable from a fresh one
    /// (or unreadable), so its slot may be given to another key.
    pub fn is_idle(&self, slot: &[u8], now: Nanos) -> bool {
        match self {
            Policy::TokenBucket(b) => TokenBucket::decode(slot).is_none_or(|s| b.is_idle(s, now)),
            Policy::LeakyBucket(m) => Gcra::decode(slot).is_none_or(|tat| m.is_idle(tat, now)),
            Policy::FixedWindow(w) => FixedWindow::decode(slot).is_none_or(|s| w.is_idle(s, now)),
        }
    }
}

pub(crate) fn div_ceil_u128(numerator: u128, denominator: u128) -> u128 {
    numerator.div_ceil(denominator.max(1))
}

pub(crate) fn put_u64(out: &mut [u8], at: usize, value: u64) {
    if let Some(dst) = out.get_mut(at..at + 8) {
        dst.copy_from_slice(&value.to_le_bytes());
    }
}

pub(crate) fn get_u64(bytes: &[u8], at: usize) -> Option<u64> {
    let raw: [u8; 8] = bytes.get(at..at + 8)?.try_into().ok()?;
    Some(u64::from_le_bytes(raw))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::SECOND;

    #[test]
    fn token_and_leaky_buckets_admit_the_same_burst() {
        for kind in [Kind::TokenBucket, Kind::LeakyBucket] {
            let policy = Policy::new(kind, 5, 10 * SECOND, 5);
            let mut slot = vec![0u8; policy.state_len()];
            policy.write_fresh(&mut slot, SECOND);
            let admitted = (0..8).filter(|_| policy.decide(&mut slot, SECOND, 1).allowed).count();
            assert_eq!(admitted, 5, "{kind:?}");
        }
    }

    #[test]
    fn a_short_slot_is_a_fresh_bucket_not_a_panic() {
        for kind in [Kind::TokenBucket, Kind::LeakyBucket, Kind::FixedWindow] {
            let policy = Policy::new(kind, 5, SECOND, 5);
            let mut short = [1u8; 3];
            assert!(policy.is_idle(&short, 0));
            policy.refund(&mut short, 0, 1);
            let decision = policy.decide(&mut short, 0, 1);
            assert!(decision.allowed, "{kind:?}");
        }
    }
}
