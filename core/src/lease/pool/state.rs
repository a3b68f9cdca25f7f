//! What a pool holds, as typed parts: the lease in place, the tokens held
//! from the lease it replaced, an allowance's windows, the observed rate,
//! what the service said with its last grant, the claims in flight, and
//! what the overshoot budget admitted without a lease. Each part knows its
//! own encoding (a run of little-endian words) and what it alone can
//! answer; the pool's rules, which combine them, are in the parent module.

use super::super::overshoot::Unleased;
pub use super::super::refresh::RateSeen;
use crate::algorithm::{get_u64, put_u64, Quota};
use crate::time::Nanos;

/// The lease in place.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lease {
    /// Its id (0: none yet, or tokens the service decided as a check,
    /// which have no record to return them to).
    pub id: u64,
    /// Its unspent tokens.
    pub tokens: u64,
    /// When it was applied (units taken earlier came from another lease).
    pub leased_at: Nanos,
    /// When its tokens start counting: when it was applied, or for a lease
    /// ahead, when the window it is for starts.
    pub starts_at: Nanos,
    /// When its tokens stop counting.
    pub expires_at: Nanos,
    /// The window its tokens count in, as the service names it (0: an
    /// algorithm without windows, or no lease yet).
    pub window_index: u64,
}

impl Lease {
    /// Whether there is one and it waits for its window to start (a lease ahead).
    pub fn pending(&self, now: Nanos) -> bool {
        self.id != 0 && now < self.starts_at
    }

    /// Whether its tokens were decided as a check (no id: no record), the
    /// answer to a cold pair's wait.
    pub fn checked(&self) -> bool {
        self.id == 0 && self.leased_at > Nanos::ZERO
    }

    /// Its tokens that count at `now`.
    pub fn counting(&self, now: Nanos) -> u64 {
        if self.starts_at <= now && now < self.expires_at {
            self.tokens
        } else {
            0
        }
    }
}

/// The unspent tokens of the lease the current one replaced, spent first.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    /// That lease's id (0: none).
    pub lease: u64,
    /// Its tokens.
    pub tokens: u64,
    /// When they stop counting (that lease's expiry).
    pub until: Nanos,
}

impl Held {
    /// The held tokens that still count at `now`.
    pub fn usable(&self, now: Nanos) -> u64 {
        if now < self.until {
            self.tokens
        } else {
            0
        }
    }
}

/// An allowance: the same tokens in each window of a span (all zero for a
/// lease of one window, or of one lifetime).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Allowance {
    /// The tokens it holds in each window (0: not an allowance).
    pub per_window: u64,
    /// How long its windows are.
    pub slice: Nanos,
    /// Its last window (the lease's `window_index` counts now).
    pub final_index: u64,
    /// How much later than its earliest start each of its windows surely
    /// started: its call's latency (answer's arrival less the call's
    /// departure) and the protocol's rounding.
    pub lag: Nanos,
}

/// What the service said with the last grant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Quote {
    /// The limit (for `RateLimit-Policy`).
    pub limit: u64,
    /// The limit's window.
    pub window: Nanos,
    /// What it had not leased to anyone after the grant.
    pub unleased: u64,
    /// When it expected more quota.
    pub reset_at: Nanos,
    /// It had nothing to grant: deny here until then, without asking.
    pub denied_until: Nanos,
}

impl Quote {
    /// The limit the service stated, once it has (for `RateLimit-Policy`).
    pub fn quota(&self) -> Option<Quota> {
        (self.limit > 0).then_some(Quota { limit: self.limit, window: Some(self.window) })
    }
}

/// The pool's claims on the service, and how long they take.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Claims {
    /// A refresh is in flight until this instant (single flight).
    pub refresh_until: Nanos,
    /// An allowance's renewal is claimed (held back, or in flight) until
    /// this instant: apart from `refresh_until`, so that a window that runs
    /// dry meanwhile can still get a lease of its own.
    pub renewal_until: Nanos,
    /// How long the last refresh took, claim to answer.
    pub latency: Nanos,
}

/// One pool: what this Envoy holds of one descriptor's limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolState {
    /// The lease in place.
    pub lease: Lease,
    /// What the lease it replaced left, held.
    pub held: Held,
    /// For an allowance, its windows.
    pub allowance: Allowance,
    /// The observed rate.
    pub rate: RateSeen,
    /// What the service said with the last grant.
    pub quote: Quote,
    /// Claims in flight.
    pub claims: Claims,
    /// What the pool admitted without a lease, under the rule's overshoot
    /// budget (all zero without one).
    pub without_lease: Unleased,
}

impl PoolState {
    /// Whether the lease in place is an allowance with windows after the
    /// one that counts.
    pub fn windows_left(&self) -> bool {
        let a = &self.allowance;
        a.per_window > 0 && self.lease.window_index < a.final_index && a.slice > Nanos::ZERO
    }

    /// Whether the lease in place is an allowance whose renewal, the next
    /// term's allowance, is still to be claimed: one with windows after
    /// the one that counts, or, in its last window, one whose renewal has
    /// not been claimed since it was applied (an allowance of one window,
    /// as a per-minute window's are, is in its last window from the start).
    pub fn renewable(&self) -> bool {
        let a = &self.allowance;
        let allowance = a.per_window > 0 && a.slice > Nanos::ZERO && self.lease.id != 0;
        self.windows_left() || (allowance && self.claims.renewal_until <= self.lease.leased_at)
    }

    /// When the lease in place ends: its window's end, or its last window's
    /// for an allowance.
    pub fn lease_end(&self) -> Nanos {
        match self.windows_left() {
            true => {
                self.lease.expires_at + self.allowance.slice.times(self.allowance.final_index - self.lease.window_index)
            }
            false => self.lease.expires_at,
        }
    }

    /// Tokens that count at `now`: the held ones and the current lease's.
    pub fn usable(&self, now: Nanos) -> u64 {
        self.held.usable(now).saturating_add(self.lease.counting(now))
    }

    /// An allowance moved on to the window that counts at `now` (or the
    /// first gap before it): that window's tokens, counted from its start
    /// at the latest (the answer's latency and the protocol's rounding
    /// after the earliest) to its end at the earliest. Anything else as it is.
    pub fn rolled(self, now: Nanos) -> PoolState {
        if !self.windows_left() || now < self.lease.expires_at {
            return self;
        }
        let (lease, allowance) = (self.lease, self.allowance);
        let behind = (now - lease.expires_at) / allowance.slice;
        let steps = behind.saturating_add(1).min(allowance.final_index - lease.window_index);
        let earliest_start = lease.expires_at + allowance.slice.times(steps - 1);
        // The window before keeps what it had left, held until its earliest
        // end: usable only in the moment the two windows' spans leave
        // between them, together with the new window's (see `gap`).
        let left = if steps == 1 { lease.tokens } else { allowance.per_window };
        PoolState {
            lease: Lease {
                window_index: lease.window_index + steps,
                tokens: allowance.per_window,
                starts_at: earliest_start + allowance.lag,
                expires_at: earliest_start + allowance.slice,
                ..lease
            },
            held: Held { lease: lease.id, tokens: left, until: earliest_start },
            ..self
        }
    }

    /// Tokens of the window just before the current lease's usable at `now`
    /// in the moment between that window's earliest end and the current
    /// window's latest start (an answer's latency and the protocol's
    /// rounding), when the pool cannot know which of the two counts: a
    /// request then takes a token of each, so whichever window it falls in
    /// has it counted. Only when the held tokens' window is the one just
    /// before: the moment is shorter than a window.
    pub fn gap(&self, now: Nanos) -> Option<u64> {
        let between = self.lease.pending(now) && self.held.lease != 0 && self.held.until <= now;
        (between && self.lease.starts_at - self.held.until < self.quote.window).then_some(self.held.tokens)
    }

    /// The `(lease, tokens)` not spent and not expired at `now`: the held
    /// lease's and the current one's (a lease ahead's too, before its start;
    /// an allowance's in the window that counts).
    pub fn unspent(&self, now: Nanos) -> [(u64, u64); 2] {
        let state = self.rolled(now);
        let current = if now < state.lease.expires_at { state.lease.tokens } else { 0 };
        [(state.held.lease, state.held.usable(now)), (state.lease.id, current)]
    }
}

/// A part of a pool's stored state: a fixed run of little-endian words.
trait Part: Sized {
    /// How many words it takes.
    const WORDS: usize;
    /// Writes its words in order.
    fn write(&self, out: &mut Writer<'_>);
    /// Reads its words in the order written; `None` when the bytes end.
    fn read(bytes: &mut Reader<'_>) -> Option<Self>;
}

/// Reads stored words one after the other.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn word(&mut self) -> Option<u64> {
        let word = get_u64(self.bytes, self.at)?;
        self.at += 8;
        Some(word)
    }

    fn time(&mut self) -> Option<Nanos> {
        self.word().map(Nanos::from_nanos)
    }
}

/// Writes words one after the other.
struct Writer<'a> {
    out: &'a mut [u8],
    at: usize,
}

impl Writer<'_> {
    fn word(&mut self, word: u64) {
        put_u64(self.out, self.at, word);
        self.at += 8;
    }

    fn time(&mut self, time: Nanos) {
        self.word(time.get());
    }
}

impl Part for Lease {
    const WORDS: usize = 6;
    fn write(&self, out: &mut Writer<'_>) {
        out.word(self.id);
        out.word(self.tokens);
        out.time(self.leased_at);
        out.time(self.starts_at);
        out.time(self.expires_at);
        out.word(self.window_index);
    }
    fn read(r: &mut Reader<'_>) -> Option<Self> {
        Some(Lease {
            id: r.word()?,
            tokens: r.word()?,
            leased_at: r.time()?,
            starts_at: r.time()?,
            expires_at: r.time()?,
            window_index: r.word()?,
        })
    }
}

impl Part for Held {
    const WORDS: usize = 3;
    fn write(&self, out: &mut Writer<'_>) {
        out.word(self.lease);
        out.word(self.tokens);
        out.time(self.until);
    }
    fn read(r: &mut Reader<'_>) -> Option<Self> {
        Some(Held { lease: r.word()?, tokens: r.word()?, until: r.time()? })
    }
}

impl Part for Allowance {
    const WORDS: usize = 4;
    fn write(&self, out: &mut Writer<'_>) {
        out.word(self.per_window);
        out.time(self.slice);
        out.word(self.final_index);
        out.time(self.lag);
    }
    fn read(r: &mut Reader<'_>) -> Option<Self> {
        Some(Allowance { per_window: r.word()?, slice: r.time()?, final_index: r.word()?, lag: r.time()? })
    }
}

impl Part for RateSeen {
    const WORDS: usize = 2;
    fn write(&self, out: &mut Writer<'_>) {
        out.word(self.spent);
        out.time(self.since);
    }
    fn read(r: &mut Reader<'_>) -> Option<Self> {
        Some(RateSeen { spent: r.word()?, since: r.time()? })
    }
}

impl Part for Quote {
    const WORDS: usize = 5;
    fn write(&self, out: &mut Writer<'_>) {
        out.word(self.limit);
        out.time(self.window);
        out.word(self.unleased);
        out.time(self.reset_at);
        out.time(self.denied_until);
    }
    fn read(r: &mut Reader<'_>) -> Option<Self> {
        Some(Quote {
            limit: r.word()?,
            window: r.time()?,
            unleased: r.word()?,
            reset_at: r.time()?,
            denied_until: r.time()?,
        })
    }
}

impl Part for Claims {
    const WORDS: usize = 3;
    fn write(&self, out: &mut Writer<'_>) {
        out.time(self.refresh_until);
        out.time(self.renewal_until);
        out.time(self.latency);
    }
    fn read(r: &mut Reader<'_>) -> Option<Self> {
        Some(Claims { refresh_until: r.time()?, renewal_until: r.time()?, latency: r.time()? })
    }
}

impl Part for Unleased {
    const WORDS: usize = 4;
    fn write(&self, out: &mut Writer<'_>) {
        out.time(self.period_start);
        out.word(self.used);
        out.word(self.unreported);
        out.time(self.strict_until);
    }
    fn read(r: &mut Reader<'_>) -> Option<Self> {
        Some(Unleased { period_start: r.time()?, used: r.word()?, unreported: r.word()?, strict_until: r.time()? })
    }
}

/// Bytes of a pool's state: its parts' words, in the order
/// [`PoolState::encode`] writes them.
pub const STATE_LEN: usize = 8
    * (Lease::WORDS
        + Held::WORDS
        + Allowance::WORDS
        + RateSeen::WORDS
        + Quote::WORDS
        + Claims::WORDS
        + Unleased::WORDS);

impl PoolState {
    /// Writes the state into `out` (at least [`STATE_LEN`] bytes), part after part.
    pub fn encode(&self, out: &mut [u8]) {
        let mut w = Writer { out, at: 0 };
        self.lease.write(&mut w);
        self.held.write(&mut w);
        self.allowance.write(&mut w);
        self.rate.write(&mut w);
        self.quote.write(&mut w);
        self.claims.write(&mut w);
        self.without_lease.write(&mut w);
    }

    /// Reads [`PoolState::encode`]'s bytes; `None` when they are too short.
    pub fn decode(bytes: &[u8]) -> Option<PoolState> {
        let mut r = Reader { bytes, at: 0 };
        Some(PoolState {
            lease: Lease::read(&mut r)?,
            held: Held::read(&mut r)?,
            allowance: Allowance::read(&mut r)?,
            rate: RateSeen::read(&mut r)?,
            quote: Quote::read(&mut r)?,
            claims: Claims::read(&mut r)?,
            without_lease: Unleased::read(&mut r)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// A state whose every word differs from every other.
    fn distinct() -> PoolState {
        let mut next = 0u64;
        let mut n = || {
            next += 1;
            next
        };
        let mut t = || Nanos::from_nanos(n() * 1_000);
        PoolState {
            lease: Lease { id: 101, tokens: 102, leased_at: t(), starts_at: t(), expires_at: t(), window_index: 103 },
            held: Held { lease: 104, tokens: 105, until: t() },
            allowance: Allowance { per_window: 106, slice: t(), final_index: 107, lag: t() },
            rate: RateSeen { spent: 108, since: t() },
            quote: Quote { limit: 109, window: t(), unleased: 110, reset_at: t(), denied_until: t() },
            claims: Claims { refresh_until: t(), renewal_until: t(), latency: t() },
            without_lease: Unleased { period_start: t(), used: 111, unreported: 112, strict_until: t() },
        }
    }

    #[test]
    fn every_part_reads_back_what_it_wrote_in_exactly_its_words() {
        let state = distinct();
        let mut bytes = vec![0xAA; STATE_LEN + 8];
        state.encode(&mut bytes);
        assert_eq!(PoolState::decode(&bytes), Some(state));
        assert_eq!(&bytes[STATE_LEN..], &[0xAA; 8], "nothing written past STATE_LEN: each part's WORDS is right");
        assert!(bytes[..STATE_LEN].chunks(8).all(|w| w != [0xAA; 8]), "every word of STATE_LEN written");
        assert_eq!(PoolState::decode(&bytes[..STATE_LEN - 1]), None, "short bytes do not decode");
    }
}
