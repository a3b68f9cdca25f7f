//! The tests of `decide.rs` (a child module of it, in a file of its own so
//! that the module's code reads without them).

use super::*;
use floodgate_core::algorithm::ALGORITHMS;
use floodgate_core::time::SECOND;

const NOW: Nanos = Nanos::from_secs(1_700_002_800);

fn ask(wanted: u64, rate: Option<f64>, window: Option<u64>, per_window: bool) -> Ask {
    Ask { wanted, rate, window, per_window, reported: 0, check: false }
}

fn ms(n: u64) -> Nanos {
    Nanos::from_millis(n)
}

fn limit(algorithm: &str, limit: u64, period: Nanos, fields: &str) -> Limit {
    Limit::new(algorithm, limit, period, fields).unwrap()
}

#[test]
fn a_record_round_trips_and_garbage_is_no_record() {
    for limit in [
        limit("fixed_window", 7, SECOND.times(60), "{}"),
        limit("sliding_window", 7, SECOND.times(60), r#"{"sub_windows":6}"#),
        limit("warm_up", 7, SECOND, r#"{"burst":3,"cold_factor":4,"warmup":"20s"}"#),
    ] {
        let record = LeaseRecord {
            bucket: r#"fg:{edge}:fw:[["k","v"]]"#.into(),
            limit,
            window: 42,
            windows: 30,
            granted: 3,
            granted_at: NOW - Nanos::from_nanos(5),
            returned: true,
            given_back: 2,
            valid_until: NOW + Nanos::from_nanos(1),
            expires_at: NOW + Nanos::from_nanos(2),
        };
        assert_eq!(LeaseRecord::decode(&record.encode()), Some(record.clone()));
        assert_eq!(LeaseRecord::live(Some(&record.encode()), NOW + Nanos::from_nanos(2)), None, "expired");
        assert_eq!(LeaseRecord::decode(&record.encode()[..20]), None);
        let mut untagged = record.encode();
        untagged[0] = UNTAGGED;
        assert_eq!(LeaseRecord::decode(&untagged), Some(record.clone()), "stored before values carried a tag");
        // Format 3 (before records kept allowances' windows and what
        // their return gave back): the same without the head's last two
        // words, read as a lease of one window that gave back nothing.
        let mut format_3 = record.encode();
        format_3[1] = 3;
        format_3.drain(3 + 7 * 8..3 + 9 * 8);
        let read = LeaseRecord::decode(&format_3);
        assert_eq!(read, Some(LeaseRecord { given_back: 0, windows: 0, ..record.clone() }), "format 3");
    }
    assert_eq!(LeaseRecord::decode(&[9; 80]), None);
}

#[test]
fn idle_at_is_when_the_bucket_is_fresh_again() {
    let bucket = limit("token_bucket", 7, SECOND.times(3), r#"{"burst":10}"#);
    let (_, next) = check(&bucket, None, NOW, 4);
    assert!(next.idle_at > NOW);
    assert_eq!(next.bytes.len(), 1 + 16 + 8, "the tag, the state, then the pace");
    assert!(check(&bucket, Some(&next.bytes), next.idle_at - Nanos::from_nanos(1), 0).0.remaining < 10);
    assert_eq!(check(&bucket, Some(&next.bytes), next.idle_at, 0).0.remaining, 10);
    let window = limit("fixed_window", 7, SECOND.times(60), "{}");
    let (_, next) = check(&window, None, NOW + Nanos::from_nanos(5), 1);
    assert_eq!(next.idle_at, NOW + SECOND.times(60));
    assert_eq!(check(&window, None, NOW, 0).1.idle_at, NOW, "an unused window is idle now");
    // Weighted sliding window: the count weighs until the next window ends.
    let sliding = limit("sliding_window", 7, SECOND.times(60), "{}");
    let (_, next) = check(&sliding, None, NOW + Nanos::from_nanos(5), 1);
    assert_eq!(next.idle_at, NOW + SECOND.times(120));
}

#[test]
fn every_offered_algorithm_keeps_a_used_bucket_until_it_is_idle() {
    for registration in ALGORITHMS.iter().filter(|r| r.local_only.is_none()) {
        let mut fields: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(registration.example).unwrap();
        fields.remove("period");
        let limit = limit(registration.name, 5, SECOND.times(60), &serde_json::Value::Object(fields).to_string());
        let (_, next) = check(&limit, None, NOW + Nanos::from_nanos(5), 1);
        let state = &next.bytes[1..=limit.policy().state_len()];
        let name = registration.name;
        assert!(next.idle_at > NOW + Nanos::from_nanos(5), "{name}");
        assert!(!limit.policy().is_idle(state, next.idle_at - Nanos::from_nanos(1)), "{name}");
        assert!(limit.policy().is_idle(state, next.idle_at), "{name}");
    }
}

#[test]
fn a_state_of_another_layout_is_never_misread() {
    let bucket = limit("token_bucket", 7, SECOND.times(3), r#"{"burst":10}"#);
    let (_, next) = check(&bucket, None, NOW, 10);
    assert_eq!(check(&bucket, Some(&next.bytes), NOW, 0).0.remaining, 0);
    // The same bytes under another tag (a layout change gets a new one)
    // are not this bucket's: read as fresh.
    let mut other = next.bytes.clone();
    other[0] = 200;
    assert_eq!(check(&bucket, Some(&other), NOW, 0).0.remaining, 10);
    // A state stored before states carried their tag is of the layout
    // its algorithm had then, which every registered tag still is.
    let mut untagged = next.bytes.clone();
    untagged[0] = UNTAGGED;
    assert_eq!(check(&bucket, Some(&untagged), NOW, 0).0.remaining, 0);
}

/// A caller's allowance as a test follows it.
struct Held {
    record: LeaseRecord,
    /// Units spent per window index.
    spent: std::collections::HashMap<u64, u64>,
}

fn record_of(key: &str, limit: &Limit, leased: &Leased, now: Nanos) -> LeaseRecord {
    LeaseRecord::of(key, limit, &leased.allotment, now, crate::store::LEASE_RECORD_MARGIN)
}

/// Units a caller admitted without a lease (an overshoot budget) are
/// counted before its lease is decided: in full by a window, past its
/// limit if need be; by a bucket as far as it holds them. The answer
/// says when the key has used more than three quarters of its limit.
#[test]
fn reported_units_count_first_and_the_answer_says_when_the_key_is_near() {
    let window = limit("fixed_window", 10, SECOND, "{}");
    let reporting = |reported| Ask { reported, ..ask(5, Some(1.0), None, false) };
    let far = lease(&window, "k", None, NOW, reporting(2), SECOND);
    assert!(!far.allotment.near_limit);
    assert_eq!(peek(&window, Some(&far.next.bytes), NOW).remaining, 10 - 2 - far.allotment.granted);
    let near = lease(&window, "k", None, NOW, reporting(8), SECOND);
    assert!(near.allotment.near_limit);
    assert_eq!(near.allotment.granted, 1, "half of the two left");
    let full = lease(&window, "k", Some(&near.next.bytes), NOW, reporting(5), SECOND);
    assert_eq!((full.allotment.granted, full.allotment.near_limit), (0, true));
    let next = lease(&window, "k", Some(&full.next.bytes), NOW, ask(1, Some(1.0), None, false), SECOND);
    assert_eq!(next.allotment.granted, 0, "admitted past the limit: counted all the same");

    let bucket = limit("token_bucket", 10, SECOND, "{}");
    let drained = lease(&bucket, "k", None, NOW, reporting(25), SECOND);
    assert_eq!((drained.allotment.granted, drained.allotment.near_limit), (0, true));
    assert_eq!(peek(&bucket, Some(&drained.next.bytes), NOW).remaining, 0, "what it held, no more");
}

#[test]
fn an_allowance_covers_its_windows_to_its_terms_end_and_renews_ahead() {
    let window = limit("fixed_window", 100, SECOND, "{}");
    let key = "fg:{edge}:fw:[[\"user\",\"alice\"]]";
    // Nothing is known of the key at its window's start: no allowance yet.
    assert_eq!(lease(&window, key, None, NOW, ask(10, Some(2.0), None, true), SECOND).allotment.windows, 0);
    // A quarter of the window on, at its pace, one.
    let now = NOW + ms(250);
    let leased = lease(&window, key, None, now, ask(10, Some(2.0), None, true), SECOND);
    let index = NOW / SECOND;
    assert_eq!(leased.allotment.window, index);
    assert!(leased.allotment.windows >= 15 && leased.allotment.windows <= 45, "{} windows", leased.allotment.windows);
    assert_eq!(leased.allotment.granted, 6, "2 a second and room for their ups and downs");
    assert_eq!(leased.allotment.starts_at, now);
    assert_eq!(leased.allotment.valid, SECOND.times(leased.allotment.windows) - ms(250));
    let last = index + leased.allotment.windows - 1;
    // Every window of it starts with the allowance counted; the one after it does not.
    for w in [index + 1, last] {
        assert_eq!(peek(&window, Some(&leased.next.bytes), SECOND.times(w)).remaining, 94, "window {w}");
    }
    assert_eq!(peek(&window, Some(&leased.next.bytes), SECOND.times(last + 1)).remaining, 100);
    assert!(leased.next.idle_at >= SECOND.times(last + 1), "kept while reserved");
    // Renewed from its last window: the next term, ahead.
    let at = SECOND.times(last) + Nanos::from_nanos(500_000_000);
    let renewed = lease(&window, key, Some(&leased.next.bytes), at, ask(10, Some(2.0), Some(last + 1), true), SECOND);
    assert_eq!((renewed.allotment.window, renewed.allotment.starts_at), (last + 1, SECOND.times(last + 1)));
    assert!(renewed.allotment.windows >= 15);
    assert_eq!(peek(&window, Some(&renewed.next.bytes), at).remaining, 94, "this window keeps its own");
    assert_eq!(peek(&window, Some(&renewed.next.bytes), SECOND.times(last + 1)).remaining, 94);
    // A caller that cannot hold one gets a lease of one window, as before.
    let single = lease(&window, key, None, NOW, ask(10, Some(2.0), None, false), SECOND);
    assert_eq!((single.allotment.windows, single.allotment.granted), (0, 2));
}

#[test]
fn allowances_stop_at_their_share_of_the_limit_and_sliding_windows_take_none() {
    let window = limit("fixed_window", 40, SECOND, "{}");
    let key = "k";
    let mut stored: Option<Vec<u8>> = None;
    let mut allowances = 0;
    let late = NOW + ms(900);
    for _ in 0..10 {
        let leased = lease(&window, key, stored.as_deref(), late, ask(10, Some(1.0), None, true), SECOND);
        if leased.allotment.windows > 0 {
            allowances += 1;
        } else {
            assert!(leased.allotment.granted <= 10);
        }
        stored = Some(leased.next.bytes);
    }
    assert_eq!(allowances, 7, "4 each, and 3/4 of 40 is 30");
    // The same asks early in the window: each allowance granted in it is
    // demand, and at that pace the window heads for its limit sooner.
    let early = NOW + ms(300);
    let mut stored: Option<Vec<u8>> = None;
    let mut allowances = 0;
    for _ in 0..10 {
        let leased = lease(&window, key, stored.as_deref(), early, ask(10, Some(1.0), None, true), SECOND);
        allowances += usize::from(leased.allotment.windows > 0);
        stored = Some(leased.next.bytes);
    }
    assert_eq!(allowances, 4, "16 in 0.3 s paces 30 a second at the least");
    // A holder's share stays small: 5 a second wants 11 a window, more
    // than a quarter of 40.
    assert_eq!(lease(&window, "other", None, NOW, ask(10, Some(5.0), None, true), SECOND).allotment.windows, 0);
    // A window already near its limit takes no new allowance.
    let (_, busy) = check(&window, None, late, 27);
    assert_eq!(
        lease(&window, "k", Some(&busy.bytes), late, ask(10, Some(1.0), None, true), SECOND).allotment.windows,
        0
    );
    let sliding = limit("sliding_window", 100, SECOND, "{}");
    assert_eq!(lease(&sliding, key, None, NOW, ask(10, Some(1.0), None, true), SECOND).allotment.windows, 0);
    // Token and leaky buckets hold allowances of one-second slots,
    // within half of what they earn in a lease lifetime: 50 of 100 a
    // second, a quarter of it for one of several callers (the key's sole
    // user may hold all 50: see below).
    for algorithm in ["token_bucket", "leaky_bucket"] {
        let bucket = limit(algorithm, 100, SECOND, r#"{"burst": 100}"#);
        let leased = lease(&bucket, key, None, NOW, ask(10, Some(1.0), None, true), SECOND);
        assert!(leased.allotment.windows > 1, "{algorithm}: {leased:?}");
        let far = ask(10, Some(20.0), None, true);
        let beside = lease(&bucket, key, Some(&leased.next.bytes), NOW, far, SECOND);
        assert_eq!(beside.allotment.windows, 0, "{algorithm}: 30 > 25");
    }
}

/// A per-minute window is a term of its own: an allowance of it asked in
/// it covers what is left of it, sized to that (its rate, seen over a
/// second or two, is too rough to hold beyond it), and at most one
/// caller's share; the renewal, asked ahead, covers the next window
/// whole. Three callers far below the limit each get one, asked a sixth of
/// the way in: the allowances granted in the window count at their units,
/// not as a pace that would fill it.
#[test]
fn a_minute_windows_allowance_covers_its_rest_sized_to_it_and_three_callers_each_get_one() {
    let window = limit("fixed_window", 600, SECOND.times(60), "{}");
    let key = "k";
    let minute = NOW / SECOND.times(60);
    assert_eq!(SECOND.times(60).times(minute), NOW, "NOW starts a minute");
    // Two thirds of the way in, at a second: 20 s left, `⌈20 + 2√20 + 1⌉`.
    let late = NOW + SECOND.times(40);
    let rest = lease(&window, key, None, late, ask(2, Some(1.0), None, true), SECOND);
    assert_eq!((rest.allotment.window, rest.allotment.windows), (minute, 1), "{rest:?}");
    assert_eq!((rest.allotment.granted, rest.allotment.valid), (30, SECOND.times(20)));
    // Its renewal, ahead: the next window whole, `⌈60 + 2√60 + 1⌉`.
    let ahead = ask(2, Some(1.0), Some(minute + 1), true);
    let renewed = lease(&window, key, Some(&rest.next.bytes), late + SECOND.times(10), ahead, SECOND);
    assert_eq!((renewed.allotment.window, renewed.allotment.windows), (minute + 1, 1), "{renewed:?}");
    assert_eq!(renewed.allotment.granted, 77);
    // Early in a window, a rough 4 a second aims at 251 of the 55 s left:
    // held to a quarter of the limit.
    let early = NOW + SECOND.times(5);
    let rough = lease(&window, key, None, early, ask(2, Some(4.0), None, true), SECOND);
    assert_eq!((rough.allotment.windows, rough.allotment.granted), (1, 150), "{rough:?}");
    // Three callers at 2.5 a second, 10 s in: 149 each, all three.
    let mut stored: Option<Vec<u8>> = None;
    for caller in 0..3 {
        let at = NOW + SECOND.times(10);
        let leased = lease(&window, key, stored.as_deref(), at, ask(2, Some(2.5), None, true), SECOND);
        assert_eq!((leased.allotment.windows, leased.allotment.granted), (1, 149), "caller {caller}: {leased:?}");
        stored = Some(leased.next.bytes);
    }
}

/// A minute window's allowance that does not fit whole beside the others
/// (rough early rates of 3 a second, each held to a quarter of the limit)
/// holds what fits within the 3/4 the key's allowances and pace may take,
/// when that is more than a lease of a lifetime would hold, and the
/// demand beyond the allowances stays within the quarter they leave; any
/// other caller leases for a lifetime.
#[test]
fn a_minute_windows_allowance_that_does_not_fit_whole_holds_what_fits() {
    let window = limit("fixed_window", 600, SECOND.times(60), "{}");
    let at = NOW + ms(2_500);
    let callers = |leased_first: u64| {
        let first = lease(&window, "k", None, at, ask(leased_first, Some(100.0), None, false), SECOND);
        assert_eq!((first.allotment.windows, first.allotment.granted), (0, leased_first), "{first:?}");
        let mut stored = first.next.bytes;
        let mut got = Vec::new();
        for _ in 0..4 {
            let leased = lease(&window, "k", Some(&stored), at, ask(3, Some(3.0), None, true), SECOND);
            got.push((leased.allotment.windows, leased.allotment.granted));
            stored = leased.next.bytes;
        }
        got
    };
    // Ten units leased first, a pace of `(√10 − 1)² × 60 / 2.5` = 112
    // beyond the allowances: 112 + 150 + 150 leaves 38 of the 450 to the
    // third; the fourth leases its three.
    assert_eq!(callers(10), vec![(1, 150), (1, 150), (1, 38), (0, 3)]);
    // Twenty, a pace of 267 beyond them, past the quarter they leave: the
    // second's 33 that would fit go to leases (and the key, heading past
    // 3/4, leases the next ones at the low end of their rate).
    assert_eq!(callers(20), vec![(1, 150), (0, 3), (0, 1), (0, 1)]);
}

/// Behind a key-affine balancer one proxy sees all of a key, and a limit
/// under about 2.4 times its rate leaves its allowance (`⌈λ + 2√λ + 1⌉`)
/// past the 3/4 a key's allowances may reserve: 9 a second against 20 a
/// second wants 16 a window. Asked ahead of the next window by the key's
/// main user, with no other allowance of the key, it gets those 3/4, 15 a
/// window, for the term; the windows that need more lease the rest. Beside
/// another caller's allowance, or at a rate the window's pace does not
/// vouch for (9 claimed where 1 was counted), it gets no allowance.
#[test]
fn a_keys_sole_user_gets_three_quarters_when_its_aim_is_past_them() {
    let window = limit("fixed_window", 20, SECOND, "{}");
    let key = "k";
    let late = NOW + ms(900);
    let next = NOW / SECOND + 1;
    let (_, seen) = check(&window, None, late, 9);
    let sole = lease(&window, key, Some(&seen.bytes), late, ask(16, Some(9.0), Some(next), true), SECOND);
    assert_eq!((sole.allotment.granted, sole.allotment.window), (15, next), "{sole:?}");
    assert!(sole.allotment.windows > 1, "{sole:?}");
    assert_eq!(peek(&window, Some(&sole.next.bytes), SECOND.times(next)).remaining, 5);
    // Another caller's allowance of 3 a window there first: not alone.
    let other = lease(&window, key, Some(&seen.bytes), late, ask(3, Some(0.2), None, true), SECOND);
    assert!(other.allotment.windows > 1, "{other:?}");
    let beside = lease(&window, key, Some(&other.next.bytes), late, ask(16, Some(9.0), Some(next), true), SECOND);
    assert_eq!(beside.allotment.windows, 0, "{beside:?}");
    // A window that counted 1: 9 a second is a claim its pace does not back.
    let (_, thin) = check(&window, None, late, 1);
    let claimed = lease(&window, key, Some(&thin.bytes), late, ask(16, Some(9.0), Some(next), true), SECOND);
    assert_eq!(claimed.allotment.windows, 0, "{claimed:?}");
}

/// A token or leaky bucket's allowances hold at most half of what it earns
/// in a lease lifetime, and one caller's a quarter. Its sole user (no other
/// caller's allowance of the key, a rate vouched for beyond a unit a slot)
/// whose aim is past the half holds all of it while that covers its mean:
/// 12 a second against a bucket of 30 a second aims at 20 a slot, and gets
/// 15. Beside another caller's allowance, or at a mean past those 15, it
/// gets a lease.
#[test]
fn a_buckets_sole_user_holds_all_its_allowances_may_reserve() {
    for algorithm in ["token_bucket", "leaky_bucket"] {
        let bucket = limit(algorithm, 30, SECOND, r#"{"burst": 30}"#);
        let key = "k";
        let sole = lease(&bucket, key, None, NOW, ask(20, Some(12.0), None, true), SECOND);
        assert_eq!(sole.allotment.granted, 15, "{algorithm}: {sole:?}");
        assert!(sole.allotment.windows > 1, "{algorithm}: {sole:?}");
        let other = lease(&bucket, key, None, NOW, ask(3, Some(0.3), None, true), SECOND);
        assert!(other.allotment.windows > 1, "{algorithm}: {other:?}");
        let beside = lease(&bucket, key, Some(&other.next.bytes), NOW, ask(20, Some(12.0), None, true), SECOND);
        assert_eq!(beside.allotment.windows, 0, "{algorithm}: {beside:?}");
        let past = lease(&bucket, key, None, NOW, ask(25, Some(16.0), None, true), SECOND);
        assert_eq!(past.allotment.windows, 0, "{algorithm}: {past:?}");
    }
}

/// A token bucket's allowances that do not fit whole beside the others
/// (sized to rough early rates, as three Envoys' first asks of a key of
/// a request a second each are) hold what fits of the half the bucket's
/// allowances may reserve, when that is at least what a lease of a
/// lifetime would hold; refused, a thin pair would lease a second at a
/// time, each lease a wait.
#[test]
fn a_buckets_allowance_that_does_not_fit_whole_holds_what_fits() {
    for algorithm in ["token_bucket", "leaky_bucket"] {
        // 40 a second, burst 40: the key's allowances hold 20 a slot.
        let bucket = limit(algorithm, 40, SECOND, r#"{"burst": 40}"#);
        let mut stored: Option<Vec<u8>> = None;
        let mut got = Vec::new();
        // `⌈λ + 2√λ + 1⌉`: 10 at 4.33, 8 at 3.18; then 2 are left, what
        // a lease of a second holds at 2 a second, less than at 3. One ask
        // a slot: the bucket, full again, counts the allowances' units at
        // each slot's start.
        for (slot, rate) in [4.33, 3.18, 3.0, 2.0, 1.0].into_iter().enumerate() {
            let at = NOW + SECOND.times(slot as u64) + ms(100);
            let leased = lease(&bucket, "k", stored.as_deref(), at, ask(1, Some(rate), None, true), SECOND);
            got.push((leased.allotment.windows > 1, leased.allotment.granted));
            stored = Some(leased.next.bytes);
        }
        assert_eq!(got, vec![(true, 10), (true, 8), (false, 1), (true, 2), (false, 1)], "{algorithm}");
    }
}

/// A bucket keeps no pace to share its tail by: a caller whose own rate is
/// two thirds of its limit or more leads it, and gets all it holds at once
/// (another gets the paced half), valid, with the answer's reset, until
/// the bucket is full again (at 10 a second, 5 take half a second): told
/// nothing is left, its holder asks again then and finds all of a burst.
/// Another's grant that leaves it empty says when its next unit comes.
#[test]
fn a_buckets_leader_gets_all_it_holds_until_it_is_full_again() {
    let bucket = limit("token_bucket", 10, SECOND, r#"{"burst": 5}"#);
    let led = lease(&bucket, "k", None, NOW, ask(12, Some(12.0), None, false), SECOND);
    let a = &led.allotment;
    assert_eq!((a.granted, a.decision.remaining, a.valid, a.decision.reset), (5, 0, ms(500), ms(500)), "{led:?}");
    let shared = lease(&bucket, "k", None, NOW, ask(12, Some(6.0), None, false), SECOND);
    assert_eq!((shared.allotment.granted, shared.allotment.valid), (3, SECOND), "{shared:?}");
    let (_, drained) = check(&bucket, None, NOW, 4);
    let last = lease(&bucket, "k", Some(&drained.bytes), NOW, ask(12, Some(6.0), None, false), SECOND);
    let a = &last.allotment;
    assert_eq!((a.granted, a.decision.remaining, a.valid, a.decision.reset), (1, 0, SECOND, ms(100)), "{last:?}");
}

/// A window's tail is handed out paced (half of what is left at most, and
/// in its last tenth evenly over its time) so that its callers share it.
/// The key's leader, its main user at a key no allowance holds a unit of
/// (the one proxy behind a key-affine balancer), gets what it asks for of
/// it at once, and a lease ahead of all of the next window: a key over
/// its limit costs it two leases a window, not one for every few units.
#[test]
fn a_keys_leader_gets_the_tail_unpaced() {
    let window = limit("fixed_window", 100, SECOND, "{}");
    let key = "k";
    let late = NOW + ms(900);
    let (_, busy) = check(&window, None, late, 95);
    let led = lease(&window, key, Some(&busy.bytes), late, ask(20, Some(100.0), None, false), SECOND);
    assert_eq!(led.allotment.granted, 5, "all that is left: {led:?}");
    // 60 a second is less than two thirds of the window's pace: a share.
    let shared = lease(&window, key, Some(&busy.bytes), late, ask(20, Some(60.0), None, false), SECOND);
    assert_eq!(shared.allotment.granted, 3, "the paced share of the tail: {shared:?}");
    let next = NOW / SECOND + 1;
    let ahead = lease(&window, key, Some(&busy.bytes), late, ask(100, Some(100.0), Some(next), false), SECOND);
    assert_eq!((ahead.allotment.granted, ahead.allotment.window), (100, next), "{ahead:?}");
    let half = lease(&window, key, Some(&busy.bytes), late, ask(100, Some(60.0), Some(next), false), SECOND);
    assert_eq!(half.allotment.granted, 50, "half of the next window: {half:?}");
}

/// A lease the pace refuses (the window's last tenth is handed out evenly
/// over its time) is told when the pace gives again, not the window's end:
/// the caller, denied until then, asks again in time for the tail.
#[test]
fn a_lease_refused_by_the_pace_is_told_when_it_gives_again() {
    let window = limit("fixed_window", 1_000, SECOND.times(60), "{}");
    let now = NOW + SECOND.times(10);
    let (_, drained) = check(&window, None, now, 950);
    let first = lease(&window, "k", Some(&drained.bytes), now, ask(10, Some(5.0), None, false), SECOND);
    assert!(first.allotment.granted > 0);
    let refused = lease(&window, "k", Some(&first.next.bytes), now, ask(10, Some(5.0), None, false), SECOND);
    assert_eq!(refused.allotment.granted, 0);
    assert!(refused.allotment.decision.remaining > 0);
    assert!(
        refused.allotment.decision.reset <= SECOND,
        "within a lease lifetime, not in 50 s: {:?}",
        refused.allotment.decision.reset
    );
    let again = now + refused.allotment.decision.reset;
    assert!(
        lease(&window, "k", Some(&refused.next.bytes), again, ask(10, Some(5.0), None, false), SECOND)
            .allotment
            .granted
            > 0
    );
}

/// A key heading for its limit at its window's pace: a lease of a window
/// that outlasts it (a per-minute window's lease of a second) aims at the
/// low end of the caller's second of observation, since what it does not
/// spend stays counted there. Far from its limit, or in a window no longer
/// than two lease lifetimes, a lease aims at the rate itself.
#[test]
fn heading_for_its_limit_a_lease_in_a_window_that_outlasts_it_aims_at_the_low_end_of_the_rate() {
    let minute = limit("fixed_window", 100_000, SECOND.times(60), "{}");
    let short = limit("fixed_window", 100_000, SECOND.times(2), "{}");
    let now = NOW + ms(500);
    for (window, near_rates) in [(&minute, [1, 81]), (&short, [2, 100])] {
        let (_, near) = check(window, None, now, 80_000);
        let granted = |stored: Option<&[u8]>, rate: f64| {
            lease(window, "k", stored, now, ask(1_000, Some(rate), None, false), SECOND).allotment.granted
        };
        assert_eq!(granted(None, 100.0), 100, "far from the limit: the rate");
        // Two requests seen vouch for (√2 − 1)² ≈ 0.17 a second; a hundred for (10 − 1)².
        assert_eq!([granted(Some(&near.bytes), 2.0), granted(Some(&near.bytes), 100.0)], near_rates);
    }
}

/// Early in a window (its first quarter) an allowance goes only to a key
/// that began the window with allowances and whose windows have not come
/// near their limit of late; later in it, by its pace.
#[test]
fn early_in_a_window_only_a_key_known_quiet_gets_an_allowance() {
    let window = limit("fixed_window", 100, SECOND, "{}");
    let key = "k";
    let first = lease(&window, key, None, NOW + ms(500), ask(10, Some(2.0), None, true), SECOND);
    assert!(first.allotment.windows > 1);
    // The next window began with that allowance's units: quiet.
    let early = NOW + SECOND + ms(10);
    let second = lease(&window, key, Some(&first.next.bytes), early, ask(10, Some(2.0), None, true), SECOND);
    assert!(second.allotment.windows > 1, "{second:?}");
    // A window driven into its last tenth (its tail paced) ...
    let mut stored = second.next.bytes.clone();
    let busy = NOW + SECOND + ms(600);
    for _ in 0..40 {
        stored = lease(&window, key, Some(&stored), busy, ask(100, Some(1_000.0), None, false), SECOND).next.bytes;
    }
    assert!(peek(&window, Some(&stored), busy).remaining * 10 < 100, "in its tail");
    // ... and the next one, early: not quiet, whatever it began with.
    let after = NOW + SECOND.times(2) + ms(10);
    let third = lease(&window, key, Some(&stored), after, ask(10, Some(2.0), None, true), SECOND);
    assert_eq!(third.allotment.windows, 0, "{third:?}");
    // Later in it, however calm its pace, its key ran short lately (see
    // `a_per_second_key_that_ran_short_lately_…`): one unit a window, the
    // low end of two a second. Two windows on, its pace decides again:
    // calm, its rate with room (2 + 2√2 + 1).
    let later = NOW + SECOND.times(2) + ms(300);
    let fourth = lease(&window, key, Some(&third.next.bytes), later, ask(10, Some(2.0), None, true), SECOND);
    assert_eq!((fourth.allotment.windows > 1, fourth.allotment.granted), (true, 1), "{fourth:?}");
    let calm = NOW + SECOND.times(5) + ms(300);
    let fifth = lease(&window, key, Some(&fourth.next.bytes), calm, ask(10, Some(2.0), None, true), SECOND);
    assert_eq!((fifth.allotment.windows > 1, fifth.allotment.granted), (true, 6), "{fifth:?}");
}

/// A per-second key whose window's tail was handed out (its demand met its
/// limit) ran short lately until two windows after that tail: there a
/// lease is sized at the low end of the caller's rate, as a per-minute
/// key's heading for its limit is, and an allowance of a term holds the
/// low end of its caller's mean, none for a caller under `ln 5` a window.
/// Under excess demand spread over a fleet, thin pairs' leases sized to
/// their rate and their allowances held a third of such a key's limit
/// where requests seldom came. The bucket is kept (not idle) until then,
/// so a store that forgets idle buckets forgets it only after.
#[test]
fn a_per_second_key_that_ran_short_lately_leases_and_reserves_at_the_low_end() {
    let window = limit("fixed_window", 20, SECOND, "{}");
    let key = "k";
    let thin = |wanted| ask(wanted, Some(1.0), None, true);
    // Calm: a thin caller gets an allowance of a term, or a lease at its rate.
    let calm = NOW + ms(400);
    assert!(lease(&window, key, None, calm, thin(10), SECOND).allotment.windows > 1);
    assert_eq!(lease(&window, key, None, NOW + ms(100), ask(10, Some(2.0), None, false), SECOND).allotment.granted, 2);
    // The window's tail handed out, to the last unit.
    let tail = NOW + ms(700);
    let (_, drained) = check(&window, None, tail, 19);
    let last = lease(&window, key, Some(&drained.bytes), tail, ask(1, Some(2.0), None, false), SECOND);
    assert_eq!((last.allotment.granted, last.allotment.decision.remaining), (1, 0));
    assert!(last.next.idle_at >= NOW + SECOND.times(3), "kept while it tells: {:?}", last.next.idle_at - NOW);
    // The next window and the one after: leases of one, no allowance.
    for at in [NOW + SECOND + ms(400), NOW + SECOND.times(2) + ms(400)] {
        let leased = lease(&window, key, Some(&last.next.bytes), at, ask(10, Some(2.0), None, false), SECOND);
        assert_eq!(leased.allotment.granted, 1, "(√2 − 1)² a second vouches for less than one");
        let asked = lease(&window, key, Some(&last.next.bytes), at, thin(10), SECOND);
        assert_eq!(asked.allotment.windows, 0, "{asked:?}");
        let busier = lease(&window, key, Some(&last.next.bytes), at, ask(10, Some(4.0), None, true), SECOND);
        assert_eq!((busier.allotment.windows > 1, busier.allotment.granted), (true, 1), "(√4 − 1)²: {busier:?}");
        let ahead = at + ms(500);
        let next = (ahead + SECOND).get() / SECOND.get();
        let booked = lease(&window, key, Some(&last.next.bytes), ahead, ask(10, Some(2.0), Some(next), false), SECOND);
        assert_eq!((booked.allotment.granted, booked.allotment.starts_at > ahead), (1, true), "{booked:?}");
    }
    // Past them: as calm as before.
    let later = NOW + SECOND.times(3) + ms(400);
    assert!(lease(&window, key, Some(&last.next.bytes), later, thin(10), SECOND).allotment.windows > 1);
    // A minute's window keeps its own rule (`heading`), whatever its tail did.
    let minute = limit("fixed_window", 20, SECOND.times(60), "{}");
    let (_, drained) = check(&minute, None, tail, 19);
    let last = lease(&minute, key, Some(&drained.bytes), tail, ask(1, Some(2.0), None, false), SECOND);
    let next_minute = NOW + SECOND.times(60) + ms(100);
    let leased = lease(&minute, key, Some(&last.next.bytes), next_minute, ask(10, Some(2.0), None, false), SECOND);
    assert_eq!(leased.allotment.granted, 2);
}

/// Checks count in a window's pace as leases do: a window whose tail went
/// to cold pairs' checks (a key under excess demand spread over a fleet)
/// is not quiet in the next one, so a thin caller's ask there gets no
/// allowance that would hold units it will not spend.
#[test]
fn a_window_whose_tail_went_to_checks_is_not_quiet_after_it() {
    let window = limit("fixed_window", 100, SECOND, "{}");
    let key = "k";
    let first = lease(&window, key, None, NOW + ms(500), ask(10, Some(2.0), None, true), SECOND);
    assert!(first.allotment.windows > 1);
    let check = Ask { check: true, ..ask(1, Some(1.0), None, false) };
    let mut stored = first.next.bytes.clone();
    let busy = NOW + SECOND + ms(600);
    for _ in 0..95 {
        stored = lease(&window, key, Some(&stored), busy, check, SECOND).next.bytes;
    }
    assert!(peek(&window, Some(&stored), busy).remaining * 10 < 100, "in its tail");
    let after = NOW + SECOND.times(2) + ms(10);
    let next = lease(&window, key, Some(&stored), after, ask(10, Some(2.0), None, true), SECOND);
    assert_eq!(next.allotment.windows, 0, "{next:?}");
}

/// A bucket whose allowances were written before they kept what their
/// window was counted at its start (48 bytes, not 56) is read, not taken
/// for a fresh one: that count is taken to be all of its reservations.
#[test]
fn allowances_written_before_the_pace_are_still_read() {
    let window = limit("fixed_window", 100, SECOND, "{}");
    let now = NOW + ms(500);
    let leased = lease(&window, "k", None, now, ask(10, Some(2.0), None, true), SECOND);
    assert!(leased.allotment.windows > 1);
    let mut old = leased.next.bytes.clone();
    old.truncate(old.len() - 8);
    for at in [now, NOW + SECOND.times(2)] {
        assert_eq!(peek(&window, Some(&old), at), peek(&window, Some(&leased.next.bytes), at), "at {at:?}");
        assert_eq!(peek(&window, Some(&old), at).remaining, 94);
    }
}

/// Token and leaky bucket allowances: a slot's units are counted at its start
/// (owed when the bucket lacks them) and spent within it, at its start
/// or at its very end, by holders that ask at random; checks take what
/// is left, now and then, and all they can in storms. Over every span `T` the fleet admits at most `burst + rate
/// × (T + lease lifetime)`, the bound of a token bucket's leases. Holders
/// are thin callers at a tenth of a unit to three a second, or the key's
/// one main user at 11 to 30 a second (whose allowances may hold all that
/// allowances may reserve, and whose leases, as its leader, all the bucket
/// holds).
#[test]
fn a_buckets_allowances_keep_the_fleet_within_its_lease_bound() {
    for algorithm in ["token_bucket", "leaky_bucket"] {
        the_fleet_stays_within_the_lease_bound(algorithm, false);
        the_fleet_stays_within_the_lease_bound(algorithm, true);
    }
}

fn the_fleet_stays_within_the_lease_bound(algorithm: &str, main_user: bool) {
    let bucket = limit(algorithm, 40, SECOND, r#"{"burst": 40}"#);
    let key = "fg:{edge}:tb:[[\"user\",\"x\"]]";
    let mut rng = floodgate_core::rng::Rng::new(0x9e37_79b9_7f4a_7c15);
    let mut random = move |n: u64| rng.below(n);
    let mut stored: Option<Vec<u8>> = None;
    let mut admitted: Vec<(Nanos, u64)> = Vec::new();
    let mut now = NOW;
    let end = NOW + SECOND.times(90);
    let (mut allowances, mut sole, mut led) = (0, 0, 0);
    while now < end {
        now += Nanos::from_nanos((random(60) + 1) * 1_000_000);
        // Ten calm seconds (allowances are granted), then five of checks
        // that take all they can.
        let storm = (now - NOW) / SECOND % 15 >= 10;
        if !storm && random(3) == 0 {
            let slot = now / SECOND;
            let named = (random(3) == 0).then_some(slot + 1);
            // Thin callers, and now and then the key's main user or leader.
            let rate = match main_user {
                true => (random(20) + 11) as f64,
                false => (random(30) + 1) as f64 / 10.0,
            };
            let wanted = (rate as u64).max(10);
            let leased = lease(&bucket, key, stored.as_deref(), now, ask(wanted, Some(rate), named, true), SECOND);
            stored = Some(leased.next.bytes.clone());
            if leased.allotment.windows == 0 {
                // A lease of a lifetime: spent at once (its bound is the lease's).
                admitted.push((now, leased.allotment.granted));
                let all = leased.allotment.granted > 1 && leased.allotment.decision.remaining == 0;
                led += u64::from(rate >= 27.0 && all);
                continue;
            }
            allowances += 1;
            sole += u64::from(leased.allotment.granted > 10);
            let at_end = random(2) == 0;
            for s in leased.allotment.window..leased.allotment.window + leased.allotment.windows {
                let (starts, ends) = (SECOND.times(s), SECOND.times(s + 1));
                let at = if at_end { ends - Nanos::from_nanos(1) } else { starts.max(now) };
                admitted.push((at, leased.allotment.granted));
            }
        } else if storm || random(4) == 0 {
            let cost = random(4) + 1;
            let (d, next) = check(&bucket, stored.as_deref(), now, cost);
            if d.allowed() {
                admitted.push((now, cost));
                stored = Some(next.bytes);
            }
        }
    }
    match main_user {
        false => assert!(allowances >= 8, "{algorithm}: allowances were granted: {allowances}"),
        true => assert!(sole >= 2 && led >= 2, "{algorithm}: a sole user's allowances {sole}, a leader's leases {led}"),
    }
    admitted.retain(|(at, _)| *at < end);
    admitted.sort();
    // Every span from one admission to another: burst + rate × (T + 1 s).
    let (burst, rate, lifetime) = (40u128, 40u128, SECOND.get() as u128);
    let mut most = 0u128;
    for (i, &(from, _)) in admitted.iter().enumerate() {
        let mut sum = 0u128;
        for &(to, units) in &admitted[i..] {
            sum += u128::from(units);
            let bound = burst * SECOND.get() as u128 + rate * ((to - from).get() as u128 + lifetime);
            assert!(sum * SECOND.get() as u128 <= bound, "{algorithm}: {sum} admitted from {from} to {to}");
            most = most.max(sum * SECOND.get() as u128 * 100 / bound);
        }
    }
    assert!(most >= 80, "{algorithm}: the bound was approached: {most} %");
}

#[test]
fn a_returned_allowance_gives_back_this_windows_rest_and_frees_the_windows_after() {
    let window = limit("fixed_window", 100, SECOND, "{}");
    let key = "k";
    let now = NOW + ms(250);
    let leased = lease(&window, key, None, now, ask(10, Some(2.0), None, true), SECOND);
    let record = record_of(key, &window, &leased, now);
    let later = NOW + SECOND.times(3);
    let (back, next) = give_back(&record, Some(&leased.next.bytes), later, 4);
    let next = next.unwrap();
    assert_eq!(back, 4);
    assert_eq!(peek(&window, Some(&next.bytes), later).remaining, 98, "6 counted, 4 back");
    assert_eq!(peek(&window, Some(&next.bytes), later + SECOND).remaining, 100, "nothing reserved after");
    // An allowance ahead, returned before it starts: all of it.
    let index = NOW / SECOND;
    let ahead = lease(&window, key, None, now, ask(10, Some(2.0), Some(index + 1), true), SECOND);
    assert_eq!(ahead.allotment.starts_at, NOW + SECOND);
    let record = record_of(key, &window, &ahead, now);
    let (back, next) = give_back(&record, Some(&ahead.next.bytes), now, 6);
    assert_eq!(back, 6);
    assert_eq!(peek(&window, Some(&next.unwrap().bytes), NOW + SECOND).remaining, 100);
    // After its last window: nothing.
    let end = now + leased.allotment.valid;
    assert_eq!(give_back(&record_of(key, &window, &leased, now), Some(&leased.next.bytes), end, 6).0, 0);
}

#[test]
fn an_allowance_fits_the_next_window_beside_what_leases_ahead_booked_there() {
    let window = limit("fixed_window", 80, SECOND, "{}");
    let key = "k";
    let late = NOW + Nanos::from_nanos(900_000_000);
    let next = NOW / SECOND + 1;
    // Leases ahead book most of the next window.
    let mut stored: Option<Vec<u8>> = None;
    let mut booked = 0;
    for _ in 0..4 {
        let ahead = lease(&window, key, stored.as_deref(), late, ask(80, Some(500.0), Some(next), false), SECOND);
        booked += ahead.allotment.granted;
        stored = Some(ahead.next.bytes);
    }
    assert!(booked > 70, "{booked} booked");
    // An allowance from this window on covers the next one too: it must
    // fit there beside them, or be no allowance.
    let leased = lease(&window, key, stored.as_deref(), late, ask(10, Some(5.0), None, true), SECOND);
    let in_next = booked + if leased.allotment.windows > 1 { leased.allotment.granted } else { 0 };
    assert!(in_next <= 80, "the next window holds {in_next} of 80");
    let counted = peek(&window, Some(&leased.next.bytes), NOW + SECOND);
    assert_eq!(counted.remaining, 80 - in_next);
}

/// Several callers take allowances and leases of one window and return
/// them at random, checks come in between: counted window by window,
/// everything usable in a window (each allowance spent in full in every
/// window it holds, less what went back) never passes the limit.
#[test]
fn no_window_ever_passes_its_limit_under_allowances_leases_checks_and_returns() {
    let window = limit("fixed_window", 80, SECOND, "{}");
    let key = "fg:{edge}:fw:[[\"user\",\"x\"]]";
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut random = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut stored: Option<Vec<u8>> = None;
    let mut usable: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
    let mut held: Vec<Held> = Vec::new();
    let mut now = NOW;
    let mut allowances = 0;
    for _ in 0..20_000 {
        now += Nanos::from_nanos(random(40) * 1_000_000);
        let index = now / SECOND;
        // Seven calm seconds in ten (thin callers, few checks: the key far
        // below its limit takes allowances), then three busy ones.
        let calm = (now - NOW) / SECOND % 10 < 7;
        match random(10) {
            0..=2 => {
                let named = (random(2) == 0).then_some(index + 1);
                let rate = Some(if calm { random(4) + 1 } else { random(30) } as f64);
                let leased =
                    lease(&window, key, stored.as_deref(), now, ask(random(20) + 1, rate, named, true), SECOND);
                stored = Some(leased.next.bytes.clone());
                if leased.allotment.granted == 0 {
                    continue;
                }
                allowances += usize::from(leased.allotment.windows > 0);
                let first = leased.allotment.window;
                let windows = leased.allotment.windows.max(1);
                for w in first..first + windows {
                    *usable.entry(w).or_default() += leased.allotment.granted;
                }
                held.push(Held { record: record_of(key, &window, &leased, now), spent: Default::default() });
            }
            event @ 3..=5 if !calm || event == 3 => {
                let (d, next) = check(&window, stored.as_deref(), now, 1);
                if d.allowed() {
                    *usable.entry(index).or_default() += 1;
                    stored = Some(next.bytes);
                }
            }
            _ if !held.is_empty() => {
                let mut one = held.swap_remove(random(held.len() as u64) as usize);
                if one.record.windows == 0 {
                    continue; // leases of one window are covered by the existing tests
                }
                let spent = random(one.record.granted + 1);
                one.spent.insert(index, spent);
                let (_, next) = give_back(&one.record, stored.as_deref(), now, one.record.granted - spent);
                if let Some(next) = next {
                    stored = Some(next.bytes);
                }
                // What it gave back is usable by others, not by it: its
                // own use is what it spent here, and nothing after.
                let last = one.record.window + one.record.windows - 1;
                let started = one.record.granted_at <= now;
                for w in index..=last {
                    if w < one.record.window {
                        continue;
                    }
                    let own = if w == index && started { spent } else { 0 };
                    let entry = usable.entry(w).or_default();
                    *entry = *entry - one.record.granted + own;
                }
            }
            _ => {}
        }
        // Count what is now committed in this window: it must fit.
        let committed = usable.get(&index).copied().unwrap_or(0);
        assert!(committed <= 80, "window {index}: {committed} usable of 80");
    }
    assert!(usable.values().any(|&u| u >= 60), "the limit was approached: {:?}", usable.values().max());
    assert!(allowances > 100, "allowances were granted: {allowances}");
}

/// A cold pair's wait is decided as a check: its cost taken from the
/// bucket (one write), no lease record, no allowance even if asked, and
/// refused as a check is once the window is spent.
#[test]
fn a_check_ask_takes_its_cost_and_records_nothing() {
    let window = limit("fixed_window", 2, SECOND, "{}");
    let item = |id: &str| crate::store::BucketLease {
        key: "fg:{edge}:fw:[[\"k\",\"v\"]]".into(),
        limit: window.clone(),
        wanted: 1,
        rate: Some(1.0),
        window: None,
        per_window: true,
        reported: 0,
        record: format!("fg:{{edge}}:lease:{id}"),
        caller: None,
        check: true,
    };
    let mut bucket: Option<Vec<u8>> = None;
    for (id, admitted) in [("a", true), ("b", true), ("c", false)] {
        let (outcome, writes) = crate::store::lease_on(&item(id), &[bucket.clone(), None], NOW, SECOND);
        let outcome = outcome.unwrap();
        assert!(outcome.checked, "{id}");
        assert_eq!((outcome.granted > 0, outcome.windows), (admitted, 0), "{id}: a check, not an allowance");
        assert_eq!(writes.get(1), Some(&None), "{id}: no lease record");
        if let Some(Some(next)) = writes.first() {
            bucket = Some(next.bytes.clone());
        }
        assert!(outcome.valid <= SECOND, "{id}: good until the window ends at the latest");
    }
    assert_eq!(peek(&window, bucket.as_deref(), NOW).remaining, 0, "two checks counted, the third refused");
}
