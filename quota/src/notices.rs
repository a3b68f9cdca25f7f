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

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use floodgate_core::time::Nanos;
use floodgate_protocol::{Descriptor, NearNotice, MAX_NOTICES};

/// One posted notice.
#[derive(Debug, Clone)]
struct Posted {
    descriptor: Descriptor,
    until: Nanos,
}

/// Every domain's recent notices, at most [`MAX_NOTICES`] each, the most
/// recent first; times on any monotonic clock the caller keeps to.
#[derive(Debug, Default)]
pub struct NoticeBoard {
    domains: Mutex<HashMap<String, VecDeque<Posted>>>,
}

impl NoticeBoard {
    /// Posts that `descriptor` of `domain` is near its limit until `until`
    /// (a later post of the same key moves it to the front).
    pub fn post(&self, domain: &str, descriptor: &Descriptor, until: Nanos) {
        let Ok(mut domains) = self.domains.lock() else { return };
        let board = domains.entry(domain.to_string()).or_default();
        board.retain(|p| p.descriptor != *descriptor);
        board.push_front(Posted { descriptor: descriptor.clone(), until });
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
}
