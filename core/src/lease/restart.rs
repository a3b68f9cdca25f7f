//! What a store that forgot its buckets owes the limit: the allowances
//! granted before it forgot.
//!
//! A store that keeps nothing across a restart (the quota service's memory
//! store) forgets every count, and every reservation of the allowances it
//! granted; their holders keep spending them, window after window, until
//! their terms end (a proxy holding an allowance asks again only then).
//! Started afresh, the store would admit its whole limit in each of those
//! windows beside what they spend (148 a second against a limit of 100, for
//! a term). So a store that restarts gives every key it has no bucket for a
//! *forgotten* bucket instead ([`marker`]: the key and when the store
//! started), which `ServiceBucket::load` reads as a fresh bucket owing
//! the most those allowances can hold ([`owed`]): the key's reservable
//! share of each window (three quarters of a fixed window's limit; half the
//! least of a token or leaky bucket's burst and what it earns in the
//! longest lease lifetime, a minute) in the window in
//! progress at the restart and in every window to the end of the term after
//! it (an allowance granted before reaches no further: to the end of its
//! term, or through the next one when less than half was left, or, asked in
//! a term's last window, through the next). Every window that starts after
//! the restart so admits at most its limit, counting what those allowances
//! may still spend; the window in progress at the restart has forgotten its
//! count (up to one limit more there, as any store that forgets), and
//! leases of one window granted before are spent within a lease lifetime.
//! Algorithms without allowances (sliding windows, sliding logs, warm-up)
//! owe nothing and start fresh.

use super::allowance::{bucket_earned, bucket_reservable, share_of, Reservations, Terms, DEFAULT_TERM};
use crate::algorithm::Policy;
use crate::time::Nanos;

/// The longest lease lifetime the service grants (its `--lease-ttl` is at
/// most this): a token or leaky bucket's allowances hold at most half of
/// what it earns in a lease lifetime, so at most half of what it earns in
/// this long.
pub const LONGEST_LEASE_LIFETIME: Nanos = Nanos::from_secs(60);

/// The first byte of a forgotten bucket's bytes: no algorithm's tag, nor
/// the service's lease records' (255) or holdings' (254).
pub const FORGOTTEN_TAG: u8 = 253;

/// The bytes a store that forgot its buckets at `started_at` gives for the
/// bucket `key` it has not (see the module docs): [`FORGOTTEN_TAG`],
/// `started_at` (nanoseconds, little-endian), then the key.
pub fn marker(key: &str, started_at: Nanos) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(1 + 8 + key.len());
    bytes.push(FORGOTTEN_TAG);
    bytes.extend_from_slice(&started_at.get().to_le_bytes());
    bytes.extend_from_slice(key.as_bytes());
    bytes
}

/// When the store forgot, and the key, if `stored` is a [`marker`].
pub fn forgotten(stored: Option<&[u8]>) -> Option<(Nanos, &str)> {
    let (&tag, rest) = stored?.split_first()?;
    if tag != FORGOTTEN_TAG {
        return None;
    }
    let started: [u8; 8] = rest.get(..8)?.try_into().ok()?;
    let key = std::str::from_utf8(rest.get(8..)?).ok()?;
    Some((Nanos::from_nanos(u64::from_le_bytes(started)), key))
}

/// What the allowances of `key` (under `policy`, `limit` per `window`)
/// granted before a store forgot its buckets at `started_at` may still
/// spend, counted into `state`, a fresh bucket's state as of `started_at`:
/// the most they can hold from the window in progress then to the end of
/// the term after it, each window's part counted at its start (as a bucket
/// counts its allowances' reservations); the reservations left as of `now`
/// (`None`: an algorithm without allowances, or nothing left).
pub fn owed(
    policy: &dyn Policy,
    (limit, window): (u64, Nanos),
    key: &str,
    state: &mut [u8],
    started_at: Nanos,
    now: Nanos,
) -> Option<(Terms, Reservations)> {
    let slot = policy.allowance_slot(state, started_at)?;
    let terms = Terms::new(window, DEFAULT_TERM, key);
    let units = match slot.renews {
        true => share_of(limit),
        false => bucket_reservable(policy.capacity(), bucket_earned(limit, window, LONGEST_LEASE_LIFETIME)),
    };
    let held = Reservations {
        term: terms.of(slot.index),
        current: units,
        next: units,
        settled: slot.index.saturating_sub(1),
        at_start: 0,
    };
    let held = held.settle(policy, &terms, state, now);
    Some((terms, held)).filter(|(_, held)| !held.is_empty())
}

#[cfg(test)]
mod tests {
    use super::super::bucket::{KeyLimit, ServiceBucket};
    use super::super::testing::policy;
    use super::*;
    use crate::time::SECOND;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const T0: Nanos = Nanos::from_secs(1_700_000_000);
    const KEY: &str = "fg:{edge}:fw:[[\"user\",\"alice\"]]";

    #[test]
    fn a_marker_reads_back_and_nothing_else_is_one() {
        let bytes = marker(KEY, T0);
        assert_eq!(forgotten(Some(&bytes)), Some((T0, KEY)));
        assert_eq!(forgotten(None), None);
        assert_eq!(forgotten(Some(&[3, 0, 0])), None);
        assert_eq!(forgotten(Some(&[FORGOTTEN_TAG, 1])), None);
    }

    /// A fixed window of 100 a second forgotten at T0 + 0.5 s: every window
    /// from then to the end of the next term begins with 75 counted (what
    /// the allowances granted before may spend there); then nothing.
    #[test]
    fn a_forgotten_fixed_window_owes_its_reservable_share_until_the_term_after_ends() {
        let window = policy("fixed_window", 100, r#"{"period": "1s"}"#);
        let limit = KeyLimit { policy: window.as_ref(), tag: 3, limit: 100, period: SECOND };
        let started = T0 + Nanos::from_millis(500);
        let remaining = |now: Nanos| {
            let stored = marker(KEY, started);
            ServiceBucket::load(&limit, Some(&stored), now).peek(&limit, now).remaining
        };
        assert_eq!(remaining(started), 25, "the window of the restart");
        assert_eq!(remaining(started + SECOND.times(3)), 25, "a later window");
        let terms = Terms::new(SECOND, DEFAULT_TERM, KEY);
        let last = terms.last(terms.of(T0 / SECOND) + 1);
        assert_eq!(remaining(SECOND.times(last)), 25, "the last window of the term after");
        assert_eq!(remaining(SECOND.times(last + 1)), 100, "owed no more");
        // What is stored after a decision keeps owing.
        let mut bucket = ServiceBucket::load(&limit, Some(&marker(KEY, started)), started);
        assert!(bucket.decide(&limit, started, 25).allowed());
        let (bytes, idle_at) = bucket.encode(&limit, started);
        assert!(idle_at >= SECOND.times(last + 1), "kept while it owes");
        let later = started + SECOND.times(2);
        assert_eq!(ServiceBucket::load(&limit, Some(&bytes), later).peek(&limit, later).remaining, 25);
    }

    #[test]
    fn a_forgotten_sliding_window_starts_fresh() {
        let sliding = policy("sliding_window", 10, r#"{"period": "1s"}"#);
        let limit = KeyLimit { policy: sliding.as_ref(), tag: 5, limit: 10, period: SECOND };
        let now = T0 + SECOND;
        assert_eq!(ServiceBucket::load(&limit, Some(&marker(KEY, T0)), now).peek(&limit, now).remaining, 10);
    }
}
