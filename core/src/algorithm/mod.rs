//! The rate-limiting algorithms, one file each, behind one trait.
//!
//! An algorithm is a pure function of (state, now, cost): [`Algorithm`] gives
//! its state type, how that state is stored as bytes, what a never-seen key
//! starts with, how a request is decided and how units are given back. Every
//! algorithm can also say whether a bucket is *idle*: in a state no different
//! from a never-seen key. Only idle buckets may be reused for another key, so
//! reuse never resets anyone's limit.
//!
//! The bucket table and the limiter see algorithms only as [`Policy`]: the
//! same operations on stored bytes, so buckets of any algorithm live in one
//! byte table. Adding an algorithm is one new file that implements
//! [`Algorithm`] and [`FromParams`], plus one line in [`ALGORITHMS`]: the
//! filter and the quota service both take algorithms only from there.

mod concurrency;
mod fixed_window;
mod gcra;
mod params;
mod shaper;
mod sliding_log;
mod sliding_window;
mod token_bucket;
mod warm_up;

use std::fmt;
use std::sync::Arc;

pub use concurrency::{Concurrency, SlotState};
pub use fixed_window::{FixedWindow, WindowState};
pub use gcra::Gcra;
pub use params::Params;
pub use shaper::Shaper;
pub use token_bucket::{TokenBucket, TokenState};
pub use warm_up::{WarmState, WarmUp};

use crate::error::ConfigError;
use crate::time::Nanos;

/// Every algorithm a rule can name, in the order the README lists them:
/// name, stored tag, key in the quota service's store, and a small example.
pub const ALGORITHMS: &[Registration] = &[
    registration::<TokenBucket>("token_bucket", 1, "tb", r#"{"period": "10s", "burst": 4}"#),
    registration::<Gcra>("leaky_bucket", 2, "lb", r#"{"period": "10s", "burst": 3}"#),
    registration::<FixedWindow>("fixed_window", 3, "fw", r#"{"period": "10s"}"#),
    registration::<Shaper>("shaper", 4, "sh", r#"{"period": "10s", "burst": 2, "max_delay": "5s"}"#),
    registration::<sliding_window::SlidingWindow>("sliding_window", 5, "sw", r#"{"period": "10s"}"#),
    registration::<sliding_log::SlidingLog>("sliding_log", 6, "sl", r#"{"period": "10s"}"#),
    registration::<WarmUp>("warm_up", 7, "wu", r#"{"period": "10s", "burst": 6, "warmup": "20s"}"#),
    registration::<Concurrency>("concurrency", 8, "cc", r#"{"slot_ttl": "10s"}"#),
];

/// Whether and when a request may go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Admitted: it may go on at once.
    Now,
    /// Admitted, but it must wait this long first (a shaper paces it).
    Delayed(Nanos),
    /// Denied: the same cost would be admitted after `retry_after`
    /// (`Nanos::NEVER` if it never can be).
    Denied {
        /// When the same request would be admitted.
        retry_after: Nanos,
    },
    /// Not decided yet: the answer depends on the quota service (a global
    /// rule's pool is being refilled, or a check-mode rule asks). Never
    /// returned by a local algorithm.
    Pending,
}

impl Admission {
    /// True when admitted, at once or after a delay.
    pub fn allowed(self) -> bool {
        matches!(self, Admission::Now | Admission::Delayed(_))
    }

    /// The wait before the request would be admitted: zero unless denied.
    pub fn retry_after(self) -> Nanos {
        match self {
            Admission::Denied { retry_after } => retry_after,
            Admission::Now | Admission::Delayed(_) | Admission::Pending => Nanos::ZERO,
        }
    }

    /// The wait before an admitted request goes on: zero unless delayed.
    pub fn delay(self) -> Nanos {
        match self {
            Admission::Delayed(delay) => delay,
            Admission::Now | Admission::Denied { .. } | Admission::Pending => Nanos::ZERO,
        }
    }
}

/// What an algorithm decided for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Admit now, admit after a delay, or deny.
    pub admission: Admission,
    /// Units still available after this decision.
    pub remaining: u64,
    /// Time until more quota becomes available (zero when the bucket is
    /// full): the `t` of the IETF `RateLimit` field.
    pub reset: Nanos,
}

impl Decision {
    /// An admission with these numbers.
    pub fn admit(remaining: u64, reset: Nanos) -> Self {
        Self { admission: Admission::Now, remaining, reset }
    }

    /// A denial with these numbers.
    pub fn deny(remaining: u64, reset: Nanos, retry_after: Nanos) -> Self {
        Self { admission: Admission::Denied { retry_after }, remaining, reset }
    }

    /// True when admitted, at once or after a delay.
    pub fn allowed(&self) -> bool {
        self.admission.allowed()
    }

    /// The wait before the request would be admitted: zero when admitted.
    pub fn retry_after(&self) -> Nanos {
        self.admission.retry_after()
    }

    /// The wait before an admitted request goes on: zero unless delayed.
    pub fn delay(&self) -> Nanos {
        self.admission.delay()
    }
}

/// Units an admitted request took: what a permit gives back later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// Units taken.
    pub cost: u64,
    /// When they were taken (window algorithms give back only into the
    /// window the units came from).
    pub at: Nanos,
}

/// Why units are given back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// The request was not served after all (a later rule denied it, or it
    /// could not wait): every algorithm gives its units back.
    Undo,
    /// The unused part of a larger grant comes back (a lease's return to the
    /// quota service): the grant given to `release` is that part, taken
    /// with the rest of the `granted` units at the grant's instant. Like
    /// [`Release::Undo`] of the part, except that an algorithm that earns
    /// units back over time counts what it has earned since against the
    /// units used, not against the part returned.
    Return {
        /// The whole grant the part was taken with.
        granted: u64,
    },
    /// The request finished: only algorithms that hold units while a request
    /// is in flight (concurrency) give them back.
    Done,
}

impl Release {
    /// Whether units are given back for this reason ([`Release::Undo`] and
    /// [`Release::Return`]).
    pub fn gives_back(self) -> bool {
        self != Release::Done
    }

    /// The whole grant `grant` was taken with: itself, or the larger grant
    /// it is the unused part of.
    pub fn granted(self, grant: Grant) -> u64 {
        match self {
            Release::Return { granted } => granted.max(grant.cost),
            Release::Undo | Release::Done => grant.cost,
        }
    }
}

/// The window an algorithm counts units in, for algorithms that count in
/// windows aligned to the epoch: units taken at one instant are counted in
/// it and only until it ends, so units leased then and used after its end
/// would be counted nowhere (a lease of them must end with it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CountingWindow {
    /// Which window: its start divided by its length (the same for every
    /// instance that shares the clock).
    pub index: u64,
    /// When it ends.
    pub end: Nanos,
    /// True when everything counted in it stops counting at its end, so
    /// what remains is all there is until then (a fixed window); false
    /// when its counts fade out over the windows that follow, so what
    /// remains grows back gradually (a sliding window).
    pub renews: bool,
}

/// What a rule's limit looks like to a client: `q` and `w` of the IETF
/// `RateLimit-Policy` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    /// Units per window (or in flight at once).
    pub limit: u64,
    /// The window, if the algorithm has one.
    pub window: Option<Nanos>,
}

/// One algorithm with its parameters, deciding on a typed state. Implement
/// this (and [`FromParams`]) in one file; [`Policy`] comes for free.
pub trait Algorithm: fmt::Debug + Send + Sync + 'static {
    /// A bucket's state.
    type State: Copy;

    /// Bytes [`Algorithm::encode`] writes; [`Algorithm::decode`] reads exactly this many.
    fn state_len(&self) -> usize;

    /// Reads a state written by [`Algorithm::encode`]; `None` when the bytes
    /// are not one (too short, or values no state can hold).
    fn decode(&self, bytes: &[u8]) -> Option<Self::State>;

    /// Writes `state` into `out` (of [`Algorithm::state_len`] bytes).
    fn encode(&self, state: &Self::State, out: &mut [u8]);

    /// The most units a single request can ever be admitted for.
    fn capacity(&self) -> u64;

    /// What the limit looks like to a client.
    fn quota(&self) -> Quota;

    /// The state of a never-seen key at `now`.
    fn fresh(&self, now: Nanos) -> Self::State;

    /// Decides a request of `cost` units; returns the decision and the state
    /// after it (unchanged when denied).
    fn decide(&self, state: Self::State, now: Nanos, cost: u64) -> (Decision, Self::State);

    /// Gives back a grant for `why`; `None` when nothing changes.
    fn release(&self, state: Self::State, now: Nanos, grant: Grant, why: Release) -> Option<Self::State>;

    /// True when the state is indistinguishable from [`Algorithm::fresh`] at `now`.
    fn is_idle(&self, state: Self::State, now: Nanos) -> bool;

    /// The earliest instant at or after `now` from which `state`, left
    /// alone, is idle: `now` if it is idle at `now`, else the first instant
    /// [`Algorithm::is_idle`] holds, which it then holds at every later
    /// instant. A store that expires keys may forget the bucket from then on
    /// without losing a count (the quota service sets its Redis TTLs so).
    fn idle_at(&self, state: Self::State, now: Nanos) -> Nanos;

    /// True when admitted requests hold their units until they finish, so
    /// their permits must be released with [`Release::Done`].
    fn holds_until_done(&self) -> bool {
        false
    }

    /// Units `state` records as held by requests in flight, including holds
    /// past their deadline that no decision has dropped yet: what the
    /// in-flight gauge adds up. Zero for algorithms that do not hold.
    fn held(&self, _state: &Self::State) -> u64 {
        0
    }

    /// The most units any interval of length `span` can admit, whatever the
    /// arrivals: the guarantee the README states. Property tests hold every
    /// algorithm to it.
    fn admitted_bound(&self, span: Nanos) -> u64;

    /// The window units taken at `now` on `state` are counted in, for
    /// algorithms that count in windows; `None` (the default) when units
    /// count from the instant they are taken, wherever they are spent
    /// (buckets, logs).
    fn counting_window(&self, _state: &Self::State, _now: Nanos) -> Option<CountingWindow> {
        None
    }

    /// The slot allowances count in at `now` (see `crate::lease::allowance`):
    /// units reserved in each slot of a term are counted at the slot's
    /// start, and an allowance's holder spends them within it. By default
    /// the counting window of an algorithm whose counts all end with it (a
    /// fixed window); `None` (no allowances) for the others, unless they say.
    fn allowance_slot(&self, state: &Self::State, now: Nanos) -> Option<CountingWindow> {
        self.counting_window(state, now).filter(|w| w.renews)
    }

    /// The state with `units` counted as taken at `at`, whatever the limit
    /// says: units granted earlier that count there all the same (units a
    /// lease ahead took for a window before it started, counted once it
    /// has, even if a reload has lowered the limit since; see
    /// [`crate::lease::booking`]; an allowance's units in a later slot, see
    /// [`Algorithm::allowance_slot`]). Only algorithms with a counting window
    /// or allowance slots are asked; the default decides, so it counts
    /// nothing the limit refuses.
    fn count(&self, state: Self::State, at: Nanos, units: u64) -> Self::State {
        self.decide(state, at, units).1
    }

    /// True when units taken now may be spent a little later by one worker
    /// (`worker_batch`): what is admitted is still what was taken. A window
    /// algorithm stays within its stated bound as long as they are spent in
    /// their counting window; a bucket's burst may grow by the units workers
    /// hold. False (the default) where a unit's instant is the limit itself
    /// (a log, a shaper's schedule) or units are held until requests end.
    fn batchable(&self) -> bool {
        false
    }
}

/// Builds an algorithm from a rule's configuration.
pub trait FromParams: Algorithm + Sized {
    /// The fields this algorithm takes besides `limit` (for error messages).
    const FIELDS: &'static [&'static str];

    /// Why the quota service cannot offer this algorithm (a check or a lease
    /// can only admit or deny, now); `None` when it can.
    const LOCAL_ONLY: Option<&'static str> = None;

    /// Takes this algorithm's fields from `params` and validates them.
    fn from_params(params: &mut Params) -> Result<Self, ConfigError>;
}

/// A configured algorithm working on a bucket's state as bytes: what the
/// bucket table and the limiter use. Bytes that do not decode are read as a
/// fresh bucket, never a panic.
pub trait Policy: fmt::Debug + Send + Sync {
    /// Bytes one bucket's state takes.
    fn state_len(&self) -> usize;
    /// The most units a single request can ever be admitted for.
    fn capacity(&self) -> u64;
    /// What the limit looks like to a client.
    fn quota(&self) -> Quota;
    /// Writes the state of a never-seen bucket into `slot`.
    fn write_fresh(&self, slot: &mut [u8], now: Nanos);
    /// Decides on the bucket in `slot` and writes its new state back.
    fn decide(&self, slot: &mut [u8], now: Nanos, cost: u64) -> Decision;
    /// Gives back a grant; returns false when the bucket did not change.
    fn release(&self, slot: &mut [u8], now: Nanos, grant: Grant, why: Release) -> bool;
    /// True when the bucket in `slot` is indistinguishable from a fresh one
    /// (or unreadable), so its slot may be given to another key.
    fn is_idle(&self, slot: &[u8], now: Nanos) -> bool;
    /// See [`Algorithm::idle_at`]; `now` for bytes that do not decode.
    fn idle_at(&self, slot: &[u8], now: Nanos) -> Nanos;
    /// See [`Algorithm::holds_until_done`].
    fn holds_until_done(&self) -> bool;
    /// See [`Algorithm::held`]; zero for bytes that do not decode.
    fn held(&self, slot: &[u8]) -> u64;
    /// See [`Algorithm::admitted_bound`].
    fn admitted_bound(&self, span: Nanos) -> u64;
    /// See [`Algorithm::counting_window`]; a fresh bucket's for bytes that
    /// do not decode.
    fn counting_window(&self, slot: &[u8], now: Nanos) -> Option<CountingWindow>;
    /// See [`Algorithm::allowance_slot`].
    fn allowance_slot(&self, slot: &[u8], now: Nanos) -> Option<CountingWindow>;
    /// See [`Algorithm::count`]; bytes that do not decode are a fresh bucket.
    fn count(&self, slot: &mut [u8], at: Nanos, units: u64);
    /// See [`Algorithm::batchable`].
    fn batchable(&self) -> bool;
}

impl<A: Algorithm> Policy for A {
    fn state_len(&self) -> usize {
        Algorithm::state_len(self)
    }

    fn capacity(&self) -> u64 {
        Algorithm::capacity(self)
    }

    fn quota(&self) -> Quota {
        Algorithm::quota(self)
    }

    fn write_fresh(&self, slot: &mut [u8], now: Nanos) {
        self.encode(&self.fresh(now), slot);
    }

    fn decide(&self, slot: &mut [u8], now: Nanos, cost: u64) -> Decision {
        let state = self.decode(slot).unwrap_or_else(|| self.fresh(now));
        let (decision, after) = Algorithm::decide(self, state, now, cost);
        self.encode(&after, slot);
        decision
    }

    fn release(&self, slot: &mut [u8], now: Nanos, grant: Grant, why: Release) -> bool {
        let Some(state) = self.decode(slot) else { return false };
        match Algorithm::release(self, state, now, grant, why) {
            Some(after) => {
                self.encode(&after, slot);
                true
            }
            None => false,
        }
    }

    fn is_idle(&self, slot: &[u8], now: Nanos) -> bool {
        self.decode(slot).is_none_or(|state| Algorithm::is_idle(self, state, now))
    }

    fn idle_at(&self, slot: &[u8], now: Nanos) -> Nanos {
        self.decode(slot).map_or(now, |state| Algorithm::idle_at(self, state, now))
    }

    fn holds_until_done(&self) -> bool {
        Algorithm::holds_until_done(self)
    }

    fn held(&self, slot: &[u8]) -> u64 {
        self.decode(slot).map_or(0, |state| Algorithm::held(self, &state))
    }

    fn admitted_bound(&self, span: Nanos) -> u64 {
        Algorithm::admitted_bound(self, span)
    }

    fn counting_window(&self, slot: &[u8], now: Nanos) -> Option<CountingWindow> {
        let state = self.decode(slot).unwrap_or_else(|| self.fresh(now));
        Algorithm::counting_window(self, &state, now)
    }

    fn allowance_slot(&self, slot: &[u8], now: Nanos) -> Option<CountingWindow> {
        let state = self.decode(slot).unwrap_or_else(|| self.fresh(now));
        Algorithm::allowance_slot(self, &state, now)
    }

    fn count(&self, slot: &mut [u8], at: Nanos, units: u64) {
        let state = self.decode(slot).unwrap_or_else(|| self.fresh(at));
        let after = Algorithm::count(self, state, at, units);
        self.encode(&after, slot);
    }

    fn batchable(&self) -> bool {
        Algorithm::batchable(self)
    }
}

/// An algorithm's entry in [`ALGORITHMS`].
#[derive(Clone, Copy)]
pub struct Registration {
    /// The name rules use (`"algorithm": "token_bucket"`).
    pub name: &'static str,
    /// Tags stored state (the filter's bucket groups, the quota service's
    /// buckets), so state of another algorithm, or of another layout, is
    /// never read as this one's. Unique; change it when the state layout
    /// changes.
    pub tag: u8,
    /// The algorithm's part of the quota service's store keys
    /// (`fg:{edge}:tb:…`), so buckets of different algorithms never share a
    /// key. Unique, and kept when the layout changes: the tag tells layouts
    /// apart.
    pub key: &'static str,
    /// The fields the algorithm takes besides `limit`.
    pub fields: &'static [&'static str],
    /// A small valid instance's fields (JSON, without `limit`): what tests
    /// and fuzzing build every algorithm from.
    pub example: &'static str,
    /// See [`FromParams::LOCAL_ONLY`].
    pub local_only: Option<&'static str>,
    build: fn(&mut Params) -> Result<Arc<dyn Policy>, ConfigError>,
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration").field("name", &self.name).field("tag", &self.tag).finish_non_exhaustive()
    }
}

const fn registration<A: FromParams>(
    name: &'static str,
    tag: u8,
    key: &'static str,
    example: &'static str,
) -> Registration {
    Registration { name, tag, key, fields: A::FIELDS, example, local_only: A::LOCAL_ONLY, build: build::<A> }
}

fn build<A: FromParams>(params: &mut Params) -> Result<Arc<dyn Policy>, ConfigError> {
    Ok(Arc::new(A::from_params(params)?))
}

/// A registration outside [`ALGORITHMS`], for buckets no rule names by
/// algorithm (a global rule's lease pools): it tags stored groups but
/// cannot be built from a rule's fields.
pub(crate) const fn unlisted(name: &'static str, tag: u8) -> Registration {
    Registration {
        name,
        tag,
        key: name,
        fields: &[],
        example: "{}",
        local_only: Some("it is not an algorithm a rule can name"),
        build: not_buildable,
    }
}

fn not_buildable(params: &mut Params) -> Result<Arc<dyn Policy>, ConfigError> {
    Err(params.error("algorithm", "is not an algorithm a rule can name"))
}

impl Registration {
    /// The registered algorithm named `name`.
    pub fn find(name: &str) -> Option<&'static Registration> {
        ALGORITHMS.iter().find(|r| r.name == name)
    }

    /// Builds the algorithm from `params`; every field must be used.
    pub fn build(&self, mut params: Params) -> Result<Arc<dyn Policy>, ConfigError> {
        let policy = (self.build)(&mut params)?;
        params.finish(self)?;
        Ok(policy)
    }

    /// Builds [`Registration::example`] with `limit`.
    pub fn build_example(&self, limit: u64) -> Result<Arc<dyn Policy>, ConfigError> {
        let fields = serde_json::from_str(self.example)
            .map_err(|e| ConfigError { field: self.name.to_string(), message: e.to_string() })?;
        self.build(Params::new("example", limit, fields))
    }
}

/// `numerator / denominator` rounded up (a zero denominator counts as one).
pub(crate) fn div_ceil_u128(numerator: u128, denominator: u128) -> u128 {
    numerator.div_ceil(denominator.max(1))
}

/// A u128 result clamped into [`Nanos`] (too large means "never").
pub(crate) fn nanos_u128(value: u128) -> Nanos {
    Nanos::from_nanos(u64::try_from(value).unwrap_or(u64::MAX))
}

/// Writes `value` little-endian at byte `at` (nothing if it does not fit).
pub(crate) fn put_u64(out: &mut [u8], at: usize, value: u64) {
    if let Some(dst) = out.get_mut(at..at + 8) {
        dst.copy_from_slice(&value.to_le_bytes());
    }
}

/// Reads a little-endian u64 at byte `at`.
pub(crate) fn get_u64(bytes: &[u8], at: usize) -> Option<u64> {
    let raw: [u8; 8] = bytes.get(at..at + 8)?.try_into().ok()?;
    Some(u64::from_le_bytes(raw))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::SECOND;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    pub(crate) fn policy(json: &str) -> Arc<dyn Policy> {
        let fields: serde_json::Map<String, serde_json::Value> = serde_json::from_str(json).unwrap();
        let name = fields.get("algorithm").and_then(|v| v.as_str()).unwrap_or("token_bucket").to_string();
        let limit = fields.get("limit").and_then(serde_json::Value::as_u64).unwrap();
        let mut rest = fields.clone();
        rest.remove("algorithm");
        rest.remove("limit");
        Registration::find(&name).unwrap().build(Params::new("rule", limit, rest)).unwrap()
    }

    #[test]
    fn names_tags_and_keys_are_unique() {
        for (i, a) in ALGORITHMS.iter().enumerate() {
            for b in &ALGORITHMS[i + 1..] {
                assert_ne!(a.name, b.name);
                assert_ne!(a.tag, b.tag, "{} and {}", a.name, b.name);
                assert_ne!(a.key, b.key, "{} and {}", a.name, b.name);
            }
        }
    }

    #[test]
    fn token_and_leaky_buckets_admit_the_same_burst() {
        for name in ["token_bucket", "leaky_bucket"] {
            let policy = policy(&format!(r#"{{"algorithm": "{name}", "limit": 5, "period": "10s", "burst": 5}}"#));
            let mut slot = vec![0u8; policy.state_len()];
            policy.write_fresh(&mut slot, SECOND);
            let admitted = (0..8).filter(|_| policy.decide(&mut slot, SECOND, 1).allowed()).count();
            assert_eq!(admitted, 5, "{name}");
        }
    }

    #[test]
    fn a_short_slot_is_a_fresh_bucket_not_a_panic() {
        for registration in ALGORITHMS {
            let policy = registration.build_example(5).unwrap();
            let mut short = [1u8; 3];
            assert!(policy.is_idle(&short, Nanos::ZERO));
            assert!(!policy.release(&mut short, Nanos::ZERO, Grant { cost: 1, at: Nanos::ZERO }, Release::Undo));
            let decision = policy.decide(&mut short, Nanos::ZERO, 1);
            assert!(decision.allowed(), "{}", registration.name);
        }
    }
}
