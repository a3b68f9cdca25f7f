//! Global mode's bookkeeping of calls: what a host has to send to the quota
//! service, and what it is waiting to hear back. Every decision about the
//! calls (when to refresh, how much, what an answer means) is in
//! `floodgate_core::global`; here calls are queued, batched and matched with
//! their answers.
//!
//! The wasm build keeps one per worker (a check leaves as a call of its
//! request, every other call from the worker's root context); the native
//! build one per configuration on Envoy's main thread (leases, returns,
//! probes) and one per request for its check.

use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::{BuildHasherDefault, Hash, Hasher};

use floodgate_core::global::calls::{CheckAnswer, Refresh};
use floodgate_core::global::calls::{MAX_CHECK_ITEMS, MAX_ITEMS};
use floodgate_core::lease::pool::RENEWAL_ROUND;
use floodgate_core::limiter::{Permit, Verdict};
use floodgate_core::time::Nanos;

/// A request whose check-mode rules are being asked about.
#[derive(Debug)]
pub struct CheckJob {
    /// The request's context.
    pub context_id: u32,
    /// Its verdict so far (with the items to ask about).
    pub verdict: Verdict,
    /// What its other rules took.
    pub permit: Permit,
    /// One answer per item, as they arrive.
    answers: Vec<Option<CheckAnswer>>,
    /// Calls not answered yet.
    outstanding: usize,
    /// Some call failed: the fall-back decides.
    failed: bool,
}

/// A call a host has made and not heard back from.
#[derive(Debug)]
pub enum Callout {
    /// Refreshes of lease pools, in the order asked.
    Leases(Vec<Refresh>),
    /// A call whose status alone is its answer.
    Status(StatusCall),
    /// Items `indices` of the check of request `context_id`.
    Check {
        /// The request.
        context_id: u32,
        /// Which of its check items this call asked about.
        indices: Vec<usize>,
    },
}

/// A call whose answer is its status: any 2xx is a success.
#[derive(Debug)]
pub enum StatusCall {
    /// Unspent tokens given back.
    Returns(u64),
    /// A probe of the service for global rule `rule`, in fall-back.
    Probe(usize),
    /// A worker's first call: Envoy has the cluster (its answer is not needed).
    Hello,
}

/// One host's traffic with the quota service (see the module docs), its
/// calls known by tokens of type `T` (the host's id for a call). What a request waits for
/// leaves at once; refreshes no request waits for yet (a lease ahead of its
/// window, a pool that still holds tokens for a while, an allowance's
/// renewal) and returns are held back until their claim's `send_by` (at most
/// `MAX_BATCH_DELAY`, or a renewal round; returns a round), so that many pools' leases share
/// one call; anything that leaves takes along every held refresh whose
/// `not_before` has come (an allowance's renewal waits for its last window).
#[derive(Debug)]
pub struct Callouts<T = u32> {
    refreshes: Vec<Refresh>,
    held: Vec<Refresh>,
    returns: Vec<(u64, u64)>,
    /// When what is held back must leave.
    hold_until: Option<Nanos>,
    checks: Vec<u32>,
    jobs: IdMap<u32, CheckJob>,
    in_flight: IdMap<T, Callout>,
}

/// A map keyed by ids Envoy hands out (request contexts, call tokens).
type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// Hashes an id with one multiply. No client picks these ids, so std's
/// keyed SipHash, about a hundred instructions a lookup, buys nothing here;
/// a check-mode request looks its job and its call up four times.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        bytes.iter().for_each(|&byte| self.write_u64(u64::from(byte)));
    }

    fn write_u32(&mut self, id: u32) {
        self.write_u64(u64::from(id));
    }

    fn write_u64(&mut self, id: u64) {
        // Fibonacci hashing: an odd multiplier is a bijection on the low
        // bits (the table's index) and mixes every bit into the high ones.
        self.0 = (self.0.rotate_left(5) ^ id).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

impl<T> Default for Callouts<T> {
    fn default() -> Self {
        Callouts {
            refreshes: Vec::new(),
            held: Vec::new(),
            returns: Vec::new(),
            hold_until: None,
            checks: Vec::new(),
            jobs: IdMap::default(),
            in_flight: IdMap::default(),
        }
    }
}

/// What a host that goes away leaves undone ([`Callouts::take_all`]).
#[derive(Debug, Default)]
pub struct Unfinished {
    /// Refreshes queued or held back, never sent.
    pub refreshes: Vec<Refresh>,
    /// Unspent tokens queued to give back, `(lease, tokens)`.
    pub returns: Vec<(u64, u64)>,
    /// Calls sent and not answered.
    pub in_flight: Vec<Callout>,
}

/// A call to dispatch, and what to remember about it.
#[derive(Debug)]
pub enum Outgoing {
    /// Ask for these leases.
    Leases(Vec<Refresh>),
    /// Give back `(lease, tokens)`.
    Returns(Vec<(u64, u64)>),
    /// Ask about items `indices` of request `context_id`'s check, all of `hits` units.
    Check {
        /// The request.
        context_id: u32,
        /// Which of its items.
        indices: Vec<usize>,
        /// Units each costs.
        hits: u64,
    },
}

impl<T: Copy + Eq + Hash + Debug> Callouts<T> {
    /// True when something must be sent at `now`: what a request waits for,
    /// what was held back as long as it may be, or a call's worth of it.
    pub fn has_outgoing(&self, now: Nanos) -> bool {
        !self.refreshes.is_empty()
            || !self.checks.is_empty()
            || self.hold_until.is_some_and(|until| until <= now)
            // Counted only when there could be a call's worth: this runs
            // on every request, and renewals wait here for seconds.
            || (self.held.len() >= MAX_ITEMS
                && self.held.iter().filter(|r| r.claim.not_before <= now).count() >= MAX_ITEMS)
            || self.returns.len() >= MAX_ITEMS
    }

    /// When what is held back must leave, if anything is.
    pub fn hold_until(&self) -> Option<Nanos> {
        self.hold_until
    }

    fn hold(&mut self, until: Nanos) {
        self.hold_until = Some(self.hold_until.map_or(until, |held| held.min(until)));
    }

    /// Queues the refreshes a request claimed at `now`: at once, or held
    /// back until their `send_by`.
    pub fn refresh(&mut self, refreshes: impl IntoIterator<Item = Refresh>, now: Nanos) {
        for refresh in refreshes {
            if refresh.claim.send_by <= now {
                self.refreshes.push(refresh);
            } else {
                self.hold(refresh.claim.send_by);
                self.held.push(refresh);
            }
        }
    }

    /// Queues unspent tokens to give back, within a renewal round of `now`
    /// (`lease` 0: nothing; no tokens: an allowance's later windows): they
    /// ride along with the next call that leaves, and leave on their own
    /// at most once a round, not once per replaced lease.
    pub fn give_back(&mut self, lease: u64, tokens: u64, now: Nanos) {
        if lease != 0 {
            self.returns.push((lease, tokens));
            self.hold(now + RENEWAL_ROUND);
        }
    }

    /// Queues a request's check.
    pub fn check(&mut self, context_id: u32, verdict: Verdict, permit: Permit) {
        let items = verdict.checks.len();
        let job = CheckJob { context_id, verdict, permit, answers: vec![None; items], outstanding: 0, failed: false };
        self.jobs.insert(context_id, job);
        self.checks.push(context_id);
    }

    /// Takes everything queued as calls, if anything must be sent at `now`
    /// (what is held back goes along): at most [`MAX_ITEMS`] items each; a
    /// check's items that cost the same go in one call.
    pub fn take_outgoing(&mut self, now: Nanos) -> Vec<Outgoing> {
        let mut out = Vec::new();
        if !self.has_outgoing(now) {
            return out;
        }
        let mut refreshes = std::mem::take(&mut self.refreshes);
        let (ready, later) = std::mem::take(&mut self.held).into_iter().partition(|r| r.claim.not_before <= now);
        self.held = later;
        self.hold_until = self.held.iter().map(|r| r.claim.send_by).min();
        refreshes.extend::<Vec<Refresh>>(ready);
        let mut chunks = refreshes.into_iter().peekable();
        while chunks.peek().is_some() {
            out.push(Outgoing::Leases(chunks.by_ref().take(MAX_ITEMS).collect()));
        }
        for chunk in std::mem::take(&mut self.returns).chunks(MAX_ITEMS) {
            out.push(Outgoing::Returns(chunk.to_vec()));
        }
        for context_id in std::mem::take(&mut self.checks) {
            self.check_calls(context_id, &mut out);
        }
        out
    }

    /// Takes request `context_id`'s queued check alone as calls (nothing
    /// else leaves with it): for a host that sends a check as a call of its
    /// request, whose answer goes to that request.
    pub fn take_check(&mut self, context_id: u32) -> Vec<Outgoing> {
        let mut out = Vec::new();
        let queued = self.checks.len();
        self.checks.retain(|c| *c != context_id);
        if self.checks.len() < queued {
            self.check_calls(context_id, &mut out);
        }
        out
    }

    /// Request `context_id`'s check as calls: its items that cost the same
    /// in one call each, at most [`MAX_CHECK_ITEMS`] a call.
    fn check_calls(&mut self, context_id: u32, out: &mut Vec<Outgoing>) {
        let Some(job) = self.jobs.get_mut(&context_id) else { return };
        let mut by_hits: Vec<(u64, Vec<usize>)> = Vec::new();
        for (index, item) in job.verdict.checks.iter().enumerate() {
            match by_hits.iter_mut().find(|(hits, indices)| *hits == item.hits && indices.len() < MAX_CHECK_ITEMS) {
                Some((_, indices)) => indices.push(index),
                None => by_hits.push((item.hits, vec![index])),
            }
        }
        job.outstanding = by_hits.len();
        out.extend(by_hits.into_iter().map(|(hits, indices)| Outgoing::Check { context_id, indices, hits }));
    }

    /// Remembers a dispatched call under its token.
    pub fn sent(&mut self, token: T, callout: Callout) {
        self.in_flight.insert(token, callout);
    }

    /// The call a token belongs to.
    pub fn answered(&mut self, token: T) -> Option<Callout> {
        self.in_flight.remove(&token)
    }

    /// A check job, to read its items.
    pub fn job(&self, context_id: u32) -> Option<&CheckJob> {
        self.jobs.get(&context_id)
    }

    /// Records answers (`None`: the call failed) for items `indices` of a
    /// request's check; the job, once every call has answered.
    pub fn record_check(
        &mut self,
        context_id: u32,
        indices: &[usize],
        answers: Option<Vec<CheckAnswer>>,
    ) -> Option<(CheckJob, Option<Vec<CheckAnswer>>)> {
        let job = self.jobs.get_mut(&context_id)?;
        match answers {
            Some(answers) => {
                for (index, answer) in indices.iter().zip(answers) {
                    if let Some(slot) = job.answers.get_mut(*index) {
                        *slot = Some(answer);
                    }
                }
            }
            None => job.failed = true,
        }
        job.outstanding = job.outstanding.saturating_sub(1);
        if job.outstanding > 0 {
            return None;
        }
        let job = self.jobs.remove(&context_id)?;
        let answers = if job.failed { None } else { job.answers.iter().copied().collect::<Option<Vec<_>>>() };
        Some((job, answers))
    }

    /// Forgets a request's check (its client left); its permit, to release.
    /// Its calls in flight are forgotten too: a call the request made
    /// itself is cancelled with it, and an answer to one the host made
    /// would find no job to finish.
    pub fn forget(&mut self, context_id: u32) -> Option<Permit> {
        self.checks.retain(|c| *c != context_id);
        let job = self.jobs.remove(&context_id)?;
        self.in_flight.retain(|_, call| !matches!(call, Callout::Check { context_id: c, .. } if *c == context_id));
        Some(job.permit)
    }

    /// Takes everything left to do or to hear back (a host that goes away
    /// hands it on or ends it); checks are not taken (their requests are
    /// gone by then, and so are their jobs).
    pub fn take_all(&mut self) -> Unfinished {
        let mut refreshes = std::mem::take(&mut self.refreshes);
        refreshes.append(&mut self.held);
        self.hold_until = None;
        let in_flight = self.in_flight.drain().map(|(_, callout)| callout).collect();
        Unfinished { refreshes, returns: std::mem::take(&mut self.returns), in_flight }
    }
}

impl CheckJob {
    /// Takes the job apart.
    pub fn into_parts(self) -> (u32, Verdict, Permit) {
        (self.context_id, self.verdict, self.permit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use floodgate_core::lease::pool::{Claim, MAX_BATCH_DELAY};
    use floodgate_core::time::SECOND;

    const T0: Nanos = Nanos::from_nanos(1_700_000_000_000_000_000);

    #[test]
    fn returns_are_batched_and_nothing_is_sent_twice() {
        let mut callouts = Callouts::<u32>::default();
        for lease in 0..(MAX_ITEMS as u64 + 3) {
            callouts.give_back(lease + 1, 5, T0);
        }
        callouts.give_back(0, 0, T0);
        assert!(callouts.has_outgoing(T0), "a call's worth leaves at once");
        let out = callouts.take_outgoing(T0);
        let sizes: Vec<usize> = out
            .iter()
            .map(|o| match o {
                Outgoing::Returns(r) => r.len(),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(sizes, vec![MAX_ITEMS, 3]);
        assert!(!callouts.has_outgoing(T0));
        assert!(callouts.take_outgoing(T0).is_empty());
    }

    fn refresh(lease: u64, send_by: Nanos) -> Refresh {
        let claim = Claim {
            started: T0,
            wanted: 1,
            rate: 1.0,
            window: None,
            send_by,
            not_before: T0,
            per_window: true,
            reported: 0,
            wants_notices: false,
            check: false,
        };
        Refresh { rule: 0, group: 0, fingerprint: lease, claim, sent: T0, lease, descriptor: Vec::new() }
    }

    #[test]
    fn refreshes_no_request_waits_for_are_held_back_to_share_a_call() {
        let mut callouts = Callouts::<u32>::default();
        let later = T0 + MAX_BATCH_DELAY;
        callouts.refresh([refresh(1, later), refresh(2, T0 + Nanos::from_nanos(5))], T0);
        callouts.give_back(9, 3, T0);
        assert!(!callouts.has_outgoing(T0), "nothing waits for them yet");
        assert!(callouts.take_outgoing(T0).is_empty());
        assert_eq!(callouts.hold_until(), Some(T0 + Nanos::from_nanos(5)));
        assert!(callouts.has_outgoing(T0 + Nanos::from_nanos(5)), "the first one's time has come");
        // A refresh a request waits for leaves at once, and takes the others along.
        callouts.refresh([refresh(3, T0)], T0);
        assert!(callouts.has_outgoing(T0));
        let out = callouts.take_outgoing(T0);
        let Outgoing::Leases(leases) = &out[0] else { panic!("{out:?}") };
        assert_eq!(leases.iter().map(|r| r.lease).collect::<Vec<_>>(), vec![3, 1, 2]);
        assert!(matches!(&out[1], Outgoing::Returns(r) if r == &[(9, 3)]));
        assert_eq!((out.len(), callouts.hold_until()), (2, None));
    }

    #[test]
    fn an_answer_is_matched_by_its_token_once() {
        let mut callouts = Callouts::<u32>::default();
        callouts.sent(7, Callout::Status(StatusCall::Probe(2)));
        assert!(matches!(callouts.answered(7), Some(Callout::Status(StatusCall::Probe(2)))));
        assert!(callouts.answered(7).is_none());
    }

    #[test]
    fn a_renewal_leaves_in_its_round_and_not_before_its_time() {
        let mut callouts = Callouts::<u32>::default();
        let round = T0 + SECOND;
        let renewal = |lease, not_before| {
            let early = refresh(lease, not_before + SECOND.halved());
            Refresh { claim: Claim { not_before, ..early.claim }, ..early }
        };
        callouts.refresh([renewal(1, T0 + Nanos::from_nanos(5)), renewal(2, round), renewal(3, T0)], T0);
        assert_eq!(callouts.hold_until(), Some(T0 + SECOND.halved()));
        // A refresh a request waits for leaves at once with the renewals
        // whose time has come; the others stay for their round.
        callouts.refresh([refresh(4, T0)], T0 + Nanos::from_nanos(10));
        let out = callouts.take_outgoing(T0 + Nanos::from_nanos(10));
        let Outgoing::Leases(leases) = &out[0] else { panic!("{out:?}") };
        assert_eq!(leases.iter().map(|r| r.lease).collect::<Vec<_>>(), vec![4, 1, 3]);
        assert_eq!(callouts.hold_until(), Some(round + SECOND.halved()));
        assert!(!callouts.has_outgoing(round));
        let out = callouts.take_outgoing(round + SECOND.halved());
        assert!(matches!(&out[0], Outgoing::Leases(l) if l.len() == 1 && l[0].lease == 2));
        assert_eq!(callouts.hold_until(), None);
    }
}
