//! What one caller holds of a key in allowances, and the bound on it.
//!
//! An allowance holds at most a quarter of a fixed window's limit in every
//! window of its term (a token or leaky bucket's: half of what the key's
//! allowances may hold together; the key's main user's, or a bucket's sole
//! user's, as much as all),
//! and a key's allowances together at most three quarters; but nothing in the key's bucket says whose they are, so
//! one caller asking under several ids could hold them all, renewably (one
//! that spent nothing held 72 of 100 a window for 38 s, leaving 28 to the
//! rest of the fleet). A *holding* is a caller's own record of a key: its
//! allowances' units per window of the key's current term and the next
//! ([`Reservations`], on the key's own [`Terms`]). With it, one caller's
//! allowances of a key together hold at most what one allowance may
//! ([`caller_cap`]); an ask beyond gets a lease of one window instead, as
//! any ask an allowance does not fit ([`grant_held`]). A holding counts an
//! allowance until its last window, returned or not: a return names a
//! lease, not its caller, so it takes nothing off (a caller that returns an
//! allowance and asks again within its term may get leases of one window).

use super::allowance::{bucket_earned, bucket_reservable, one_share, Reservations, Terms};
use super::bucket::{KeyLimit, ServiceBucket};
use super::grant::{asks_as_main_user, grant, Allotment, Ask};
use crate::time::Nanos;

/// The first byte of a holding's bytes: no algorithm's tag, nor the
/// service's lease records' (255).
pub const HOLDING_TAG: u8 = 254;

/// Words after the tag: the terms (windows, phase) and the reservations
/// (term, current, next, settled, at start).
const WORDS: usize = 7;

/// One caller's allowances of one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holding {
    /// The key's terms.
    pub terms: Terms,
    /// The caller's units per window of the current term and the next.
    pub held: Reservations,
}

/// The most one caller's allowances of a key of `limit` hold per window
/// together: what one allowance may hold, a quarter of a fixed window's
/// limit (`renews`: a window whose counts end with it), half of what a
/// token or leaky bucket's allowances may hold together in a slot for
/// leases living `ttl` — or for the key's main user (a bucket's sole
/// user), the one allowance it asks for (`main_units`, within what the
/// key's allowances may hold together), not several of that size under
/// other ids.
pub fn caller_cap(limit: &KeyLimit<'_>, renews: bool, main_units: Option<u64>, ttl: Nanos) -> u64 {
    let (one, all) = match renews {
        true => (one_share(limit.limit, false), one_share(limit.limit, true)),
        false => {
            let all = bucket_reservable(limit.policy.capacity(), bucket_earned(limit.limit, limit.window(), ttl));
            (all / 2, all)
        }
    };
    main_units.map_or(one, |units| units.max(one).min(all))
}

impl Holding {
    /// The holding in `stored` (`None`: none, or bytes of another kind).
    pub fn decode(stored: Option<&[u8]>) -> Option<Self> {
        let (&tag, rest) = stored?.split_first()?;
        if tag != HOLDING_TAG || rest.len() != WORDS * 8 {
            return None;
        }
        let word = |i: usize| -> Option<u64> { Some(u64::from_le_bytes(rest.get(i * 8..i * 8 + 8)?.try_into().ok()?)) };
        let terms = Terms::from_parts(word(0)?, word(1)?);
        let held =
            Reservations { term: word(2)?, current: word(3)?, next: word(4)?, settled: word(5)?, at_start: word(6)? };
        Some(Holding { terms, held })
    }

    /// Its bytes: [`HOLDING_TAG`], then the words of [`Holding::decode`],
    /// little-endian.
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(1 + WORDS * 8);
        bytes.push(HOLDING_TAG);
        let held = &self.held;
        let words =
            [self.terms.windows(), self.terms.phase(), held.term, held.current, held.next, held.settled, held.at_start];
        for word in words {
            bytes.extend_from_slice(&word.to_le_bytes());
        }
        bytes
    }

    /// When it holds nothing any more: the end of the last window of
    /// `window`s its allowances cover (`None`: it holds nothing now).
    pub fn idle_at(&self, window: Nanos) -> Option<Nanos> {
        self.held.last_window(&self.terms).map(|last| window.times(last.saturating_add(1)))
    }
}

/// [`grant`], with what one caller may hold of the key's allowances
/// bounded: `holding` is the caller's holding of the key as stored (`None`:
/// it holds none). An allowance that would take the caller's allowances of
/// the key past [`caller_cap`] in any window it covers is not granted: the
/// ask is decided again as one that cannot hold an allowance (a lease of
/// one window, or ahead). Returns the allotment, and the caller's holding
/// after it when it changed (an allowance was granted).
pub fn grant_held(
    limit: &KeyLimit<'_>,
    key: &str,
    bucket: ServiceBucket,
    ask: Ask,
    holding: Option<Holding>,
    now: Nanos,
    ttl: Nanos,
) -> (Allotment, Option<Holding>) {
    let main = asks_as_main_user(limit, &bucket, ask.rate, now);
    let allotted = grant(limit, key, bucket.clone(), ask, now, ttl);
    let (Some((terms, _)), true) = (allotted.bucket.allowances, allotted.windows > 0) else {
        return (allotted, None);
    };
    let Some(counted) = limit.policy.allowance_slot(&allotted.bucket.state, now) else { return (allotted, None) };
    let (first, last) = (allotted.window, allotted.window.saturating_add(allotted.windows - 1));
    let mut held = holding.filter(|h| h.terms == terms).map_or_else(Reservations::default, |h| h.held);
    held = held.as_of(&terms, counted.index);
    // A bucket's allowance past one caller's share is its sole user's,
    // granted only where no other allowance of the key is.
    let main = main || !counted.renews;
    let cap = caller_cap(limit, counted.renews, main.then_some(allotted.granted), ttl);
    if allotted.granted > held.room(&terms, first, last, cap) {
        // Beyond the caller's share: a lease of one window, as any ask
        // that no allowance fits.
        let again = grant(limit, key, bucket, Ask { per_window: false, ..ask }, now, ttl);
        return (again, None);
    }
    held.reserve(&terms, counted.index, first, last, allotted.granted);
    (allotted, Some(Holding { terms, held }))
}

#[cfg(test)]
mod tests {
    use super::super::testing::policy;
    use super::*;
    use crate::time::SECOND;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const T0: Nanos = Nanos::from_secs(1_700_000_000);
    const KEY: &str = "fg:{edge}:fw:[[\"user\",\"alice\"]]";

    fn ask(rate: f64) -> Ask {
        Ask { wanted: 100, rate: Some(rate), window: None, per_window: true, reported: 0, check: false }
    }

    /// A caller asking under two ids for allowances of 13 a window of a key
    /// of 100 a second (each within the bound of one allowance, 25) holds
    /// at most 25 a window in all: the first is an allowance, the second a
    /// lease of one window; another caller gets its own allowance; the
    /// holding lasts until the allowance's last window.
    #[test]
    fn one_caller_holds_at_most_what_one_allowance_may_of_a_key() {
        let window = policy("fixed_window", 100, r#"{"period": "1s"}"#);
        let limit = KeyLimit { policy: window.as_ref(), tag: 1, limit: 100, period: SECOND };
        // Late enough in the window for its pace to tell (a quarter).
        let now = T0 + Nanos::from_millis(300);
        let bucket = ServiceBucket::load(&limit, None, now);
        // rate 6.5/s: 6.5 + 2 x 2.55 + 1, rounded up: 13 a window.
        let (first, holding) = grant_held(&limit, KEY, bucket, ask(6.5), None, now, SECOND);
        assert_eq!((first.granted, first.windows > 1), (13, true), "an allowance");
        let held = holding.unwrap_or_else(|| panic!("a holding"));
        assert_eq!(held.held.current, 13);
        assert_eq!(Holding::decode(Some(&held.encode())), Some(held), "its bytes read back");
        let (second, unchanged) = grant_held(&limit, KEY, first.bucket.clone(), ask(6.5), Some(held), now, SECOND);
        assert_eq!((second.windows, unchanged), (0, None), "13 + 13 > 25: a lease of one window");
        assert!(second.granted > 0);
        // Without the holding, the key would have granted it as an allowance.
        let (unbounded, _) = grant_held(&limit, KEY, first.bucket.clone(), ask(6.5), None, now, SECOND);
        assert!(unbounded.windows > 1, "the key's own rules admit a second allowance");
        let (other, theirs) = grant_held(&limit, KEY, second.bucket, ask(6.5), None, now, SECOND);
        assert!(other.windows > 1 && theirs.is_some(), "another caller holds its own");
        assert!(held.idle_at(SECOND).is_some_and(|at| at > now));
    }

    /// Behind a key-affine balancer one proxy sees all of a key: 30 a
    /// second against a limit of 100, whose window counted its 15 in the
    /// first half, gets an allowance of 42 a window (30 + 2 x 5.48 + 1,
    /// rounded up), past a quarter of the limit. Asked again, under another
    /// id or by another caller, at the same rate beside it, it is not the
    /// key's main user: a lease of one window.
    #[test]
    fn a_keys_main_user_holds_one_allowance_past_a_quarter() {
        let window = policy("fixed_window", 100, r#"{"period": "1s"}"#);
        let limit = KeyLimit { policy: window.as_ref(), tag: 1, limit: 100, period: SECOND };
        let now = T0 + Nanos::from_millis(500);
        let mut seen = ServiceBucket::load(&limit, None, now);
        assert!(seen.decide(&limit, now, 15).allowed());
        let (main, holding) = grant_held(&limit, KEY, seen.clone(), ask(30.0), None, now, SECOND);
        assert_eq!((main.granted, main.windows > 1), (42, true), "an allowance past a quarter");
        assert_eq!(holding.map(|h| h.held.current), Some(42));
        let (again, none) = grant_held(&limit, KEY, main.bucket.clone(), ask(30.0), holding, now, SECOND);
        assert_eq!((again.windows, none), (0, None), "one allowance past a quarter, not two");
        let (other, none) = grant_held(&limit, KEY, main.bucket, ask(30.0), None, now, SECOND);
        assert_eq!((other.windows, none), (0, None), "another caller beside it");
        // 17 a second beside a window paced at 40 (30 counted in its first
        // half): not most of it, so not the 27 a window past a quarter.
        let mut busier = ServiceBucket::load(&limit, None, now);
        assert!(busier.decide(&limit, now, 30).allowed());
        let (some, none) = grant_held(&limit, KEY, busier, ask(17.0), None, now, SECOND);
        assert_eq!((some.windows, none), (0, None), "a share of the key's pace: a lease of one window");
    }

    /// A token bucket's sole user (no other allowance of the key) holds one
    /// allowance past one caller's share, up to what the key's allowances
    /// may hold together: 12 a second against 30 a second (burst 30) gets
    /// 15 a slot, and the holding says so; asked again beside it, under
    /// another id, a lease.
    #[test]
    fn a_buckets_sole_user_holds_one_allowance_past_a_callers_share() {
        let tokens = policy("token_bucket", 30, r#"{"period": "1s", "burst": 30}"#);
        let limit = KeyLimit { policy: tokens.as_ref(), tag: 2, limit: 30, period: SECOND };
        let now = T0 + Nanos::from_millis(300);
        let bucket = ServiceBucket::load(&limit, None, now);
        let (sole, holding) = grant_held(&limit, KEY, bucket, ask(12.0), None, now, SECOND);
        assert_eq!((sole.granted, sole.windows > 1), (15, true), "{sole:?}");
        assert_eq!(holding.map(|h| h.held.current), Some(15));
        let (again, none) = grant_held(&limit, KEY, sole.bucket, ask(12.0), holding, now, SECOND);
        assert_eq!((again.windows, none), (0, None), "one allowance past a caller's share, not two");
    }

    #[test]
    fn a_callers_cap_is_what_one_allowance_may_hold() {
        let window = policy("fixed_window", 100, r#"{"period": "1s"}"#);
        let fixed = KeyLimit { policy: window.as_ref(), tag: 1, limit: 100, period: SECOND };
        assert_eq!(caller_cap(&fixed, true, None, SECOND), 25);
        assert_eq!(caller_cap(&fixed, true, Some(42), SECOND), 42, "the key's main user's one allowance");
        assert_eq!(caller_cap(&fixed, true, Some(10), SECOND), 25);
        assert_eq!(caller_cap(&fixed, true, Some(90), SECOND), 75);
        let tokens = policy("token_bucket", 100, r#"{"period": "1s", "burst": 40}"#);
        let bucket = KeyLimit { policy: tokens.as_ref(), tag: 2, limit: 100, period: SECOND };
        // Half the least of the burst and a lifetime's earnings (40, 100), halved again.
        assert_eq!(caller_cap(&bucket, false, None, SECOND), 10);
        assert_eq!(caller_cap(&bucket, false, Some(42), SECOND), 20, "a bucket's sole user's, within all 20");
        assert_eq!(caller_cap(&bucket, false, Some(15), SECOND), 15, "a bucket's sole user's one allowance");
        assert_eq!(caller_cap(&bucket, false, Some(4), SECOND), 10);
    }

    #[test]
    fn other_bytes_are_no_holding() {
        assert_eq!(Holding::decode(None), None);
        assert_eq!(Holding::decode(Some(&[HOLDING_TAG, 1, 2])), None);
        assert_eq!(Holding::decode(Some(&[255; 57])), None);
    }
}
