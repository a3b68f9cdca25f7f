//! Near-limit notices (see `docs/protocol.md`, "Reports of units admitted
//! without a lease"): the keys of each domain that the service found near
//! their limit while deciding a lease that reported units admitted without
//! one. A caller that admits keys without a lease (an overshoot budget)
//! asks for them with its leases and stops admitting those keys without
//! one: so the fleet hears that a key is near its limit from any call,
//! not only from a call about that key. Each instance keeps its own board,
//! in memory; a notice is a hint that makes callers stricter, never one
//! that lets more through, so a restart that forgets them loses nothing
//! but the hint.
//!
//! A board's room is shared fairly among the callers that post to it (see
//! [`NoticeBoard::post_by`]): one caller's reports (bogus ones: 32 keys in
//! one call) cannot push the others' notices off the board. Who may read
//! and post a domain's notices is the caller's business (`crate::auth`).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use floodgate_core::time::Nanos;
use floodgate_protocol::{Descriptor, NearNotice, MAX_NOTICES};

use crate::store::Caller;

/// One posted notice, and who posted it (`None`: callers not told apart).
#[derive(Debug, Clone)]
struct Posted {
    descriptor: Descriptor,
    until: Nanos,
    by: Option<Caller>,
}

/// Every domain's recent notices, at most [`MAX_NOTICES`] each, the most
/// recent first; times on any monotonic clock the caller keeps to.
#[derive(Debug, Default)]
pub struct NoticeBoard {
    domains: Mutex<HashMap<String, VecDeque<Posted>>>,
}

impl NoticeBoard {
    /// Posts that `descriptor` of `domain` is near its limit until `until`
    /// (a later post of the same key moves it to the front), the oldest
    /// notice making room (callers not told apart).
    pub fn post(&self, domain: &str, descriptor: &Descriptor, until: Nanos) {
        let Ok(mut domains) = self.domains.lock() else { return };
        let board = domains.entry(domain.to_string()).or_default();
        board.retain(|p| p.descriptor != *descriptor);
        board.push_front(Posted { descriptor: descriptor.clone(), until, by: None });
        board.truncate(MAX_NOTICES);
    }

    /// Posts, as [`NoticeBoard::post`] does, that `descriptor` of `domain`
    /// is near its limit until `until`, posted by `by` at `now`. A full
    /// board (of notices that still hold) makes room fairly: the oldest
    /// notice of the caller holding the most goes, if it holds at least two
    /// more than `by`; else `by`'s own oldest, if it holds any; else the
    /// post is not made (the notices there are as many others' as it would
    /// hold). So one caller holds no more of the board than any other that
    /// posts to it, and whatever it reports, the others' notices stay.
    pub fn post_by(&self, domain: &str, descriptor: &Descriptor, until: Nanos, by: Option<Caller>, now: Nanos) {
        let Ok(mut domains) = self.domains.lock() else { return };
        let board = domains.entry(domain.to_string()).or_default();
        board.retain(|p| p.until > now);
        if let Some(at) = board.iter().position(|p| p.descriptor == *descriptor) {
            // The same key again: moved to the front, charged to its poster.
            board.remove(at);
        } else if board.len() >= MAX_NOTICES {
            let held = |who: Option<Caller>| board.iter().filter(|p| p.by == who).count();
            let mine = held(by);
            let (most, whose) = board.iter().map(|p| (held(p.by), p.by)).max_by_key(|(n, _)| *n).unwrap_or((0, by));
            let from = if most >= mine + 2 { whose } else { by };
            if from == by && mine == 0 {
                return;
            }
            // The oldest is the last of the most recent first.
            if let Some(at) = board.iter().rposition(|p| p.by == from) {
                board.remove(at);
            }
        }
        board.push_front(Posted { descriptor: descriptor.clone(), until, by });
        board.truncate(MAX_NOTICES);
    }

    /// The notices of `domain` that still hold at `now`, the most recent
    /// first, each with the time it still holds.
    pub fn current(&self, domain: &str, now: Nanos) -> Vec<NearNotice> {
        let Ok(mut domains) = self.domains.lock() else { return Vec::new() };
        let Some(board) = domains.get_mut(domain) else { return Vec::new() };
        board.retain(|p| p.until > now);
        board
            .iter()
            .map(|p| NearNotice { descriptor: p.descriptor.clone(), for_ms: (p.until - now).ceil_millis() })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use floodgate_core::time::SECOND;

    fn key(value: &str) -> Descriptor {
        vec![("user".to_string(), value.to_string())]
    }

    #[test]
    fn a_board_keeps_the_latest_notices_of_each_domain_until_they_end() {
        let board = NoticeBoard::default();
        let t0 = SECOND.times(100);
        board.post("edge", &key("a"), t0 + SECOND);
        board.post("edge", &key("b"), t0 + SECOND.times(2));
        board.post("other", &key("c"), t0 + SECOND);
        board.post("edge", &key("a"), t0 + SECOND.times(3));
        let now = board.current("edge", t0);
        assert_eq!(
            now.iter().map(|n| (n.descriptor[0].1.as_str(), n.for_ms)).collect::<Vec<_>>(),
            [("a", 3000), ("b", 2000)]
        );
        assert_eq!(board.current("edge", t0 + SECOND.times(2)).len(), 1, "b has ended");
        assert!(board.current("nosuch", t0).is_empty());
        for i in 0..100 {
            board.post("edge", &key(&format!("k{i}")), t0 + SECOND);
        }
        assert_eq!(board.current("edge", t0).len(), MAX_NOTICES, "bounded");
        assert_eq!(board.current("edge", t0)[0].descriptor, key("k99"), "the latest first");
    }

    fn caller(last: u8) -> Option<Caller> {
        Some(Caller(std::net::IpAddr::from([10, 0, 0, last])))
    }

    /// One caller's reports cannot push the others' notices off the board:
    /// twenty callers post one real notice each, then one caller posts 32
    /// bogus ones (a call of 32 reports evicted every real notice before):
    /// it takes the twelve free places, then only its own; every real
    /// notice stays. A caller holding the most loses its oldest to one that
    /// holds two fewer.
    #[test]
    fn a_callers_reports_cannot_evict_the_others_notices() {
        let board = NoticeBoard::default();
        let t0 = SECOND.times(100);
        for i in 0..20u8 {
            board.post_by("edge", &key(&format!("real{i}")), t0 + SECOND.times(5), caller(i), t0);
        }
        for i in 0..32 {
            board.post_by("edge", &key(&format!("bogus{i}")), t0 + SECOND.times(5), caller(200), t0);
        }
        let now = board.current("edge", t0);
        assert_eq!(now.len(), MAX_NOTICES);
        let real = now.iter().filter(|n| n.descriptor[0].1.starts_with("real")).count();
        assert_eq!(real, 20, "every real notice stays: {now:?}");
        assert_eq!(now[0].descriptor, key("bogus31"), "the bogus caller's latest replaced its own oldest");
        // A newcomer takes a place from the caller holding the most (twelve).
        board.post_by("edge", &key("late"), t0 + SECOND.times(5), caller(100), t0);
        let now = board.current("edge", t0);
        assert!(now.iter().any(|n| n.descriptor == key("late")));
        assert_eq!(now.iter().filter(|n| n.descriptor[0].1.starts_with("bogus")).count(), 11);
        // A board of as many callers as places: a newcomer's post is not
        // made (every caller holds as many as it would).
        let full = NoticeBoard::default();
        for i in 0..32u8 {
            full.post_by("edge", &key(&format!("real{i}")), t0 + SECOND.times(5), caller(i), t0);
        }
        full.post_by("edge", &key("bogus"), t0 + SECOND.times(5), caller(200), t0);
        assert!(full.current("edge", t0).iter().all(|n| n.descriptor != key("bogus")));
        // Notices that ended make room for anyone.
        board.post_by("edge", &key("later"), t0 + SECOND.times(9), caller(102), t0 + SECOND.times(6));
        assert_eq!(board.current("edge", t0 + SECOND.times(6)).len(), 1);
    }
}
