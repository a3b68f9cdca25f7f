//! The limiter: every rule that applies to a request decides on its bucket in
//! the shared store; the request passes only if all admit.
//!
//! Rules decide in order. A rule that denies stops the check, and the units
//! already taken by earlier rules for this request are given back, so a
//! request denied by a later rule does not consume from earlier ones. (In a
//! race, that refund can make another request see a bucket emptier than it
//! will end up: the limiter may under-admit for an instant, never over-admit.)
//!
//! An admitted request gets a [`Permit`]: what each rule took. The host gives
//! it back through [`Limiter::release`] — with [`Release::Done`] when the
//! request ends (concurrency limits free their slots), or [`Release::Undo`]
//! when the request is not served after all (it could not wait).
//!
//! A global rule (see [`crate::global`]) spends its pool of leased tokens
//! like a local bucket. When the pool is empty the verdict is
//! [`Admission::Pending`]: the host asks again once the refresh this request
//! may have claimed ([`Verdict::refreshes`]) has answered. A check-mode rule
//! is decided by the service: the verdict lists what to ask
//! ([`Verdict::checks`]) and [`Limiter::settle`] finishes the request with
//! the answer.
//!
//! The module by concern:
//! - this file: the limiter, prepared once per configuration;
//! - [`rule`]: a rule compiled for requests, its tables and shared-data keys;
//! - [`verdict`]: what a request is told, and the permit it holds;
//! - `pass`: one request's decision in progress, and the one exit for a
//!   denial or a wait;
//! - `decide`: the decision path — check, settle, release;
//! - `pools`: a global rule's lease pools — spending, grants, returns;
//! - `modes`: a global rule's mode — fall-back and probes;
//! - `reserves` and `batches`: per-worker batches of a rule's units
//!   (`worker_batch`): the worker's store of them, and their decisions;
//! - [`counting`]: what the limiter counts, and the host's counters.
//!
//! [`Admission::Pending`]: crate::algorithm::Admission::Pending
//! [`Release::Done`]: crate::algorithm::Release::Done
//! [`Release::Undo`]: crate::algorithm::Release::Undo

mod batches;
pub mod counting;
mod decide;
mod modes;
mod pass;
mod pools;
mod reserves;
pub mod rule;
#[cfg(test)]
mod testing;
pub mod verdict;

pub use counting::{Counters, RequestEvent, RuleEvent, StoreEvent};
pub use rule::CompiledRule;
pub use verdict::{CanWait, Permit, Report, Verdict};

use crate::config::{Config, PluginSettings, Response};
use crate::global::fallback::ModeState;
use crate::global::settings::QuotaService;
use crate::headers::{HeaderBlock, RuleHeaders};
use crate::lease::overshoot::NearSet;
use crate::store::{Store, StoreError};

use std::cell::RefCell;

use rule::Key;

/// Shared-data key holding the per-VM secret that keys descriptor hashing.
pub const SEED_KEY: &str = "fg:seed";

/// Shared-data key holding the near-limit notices this Envoy heard
/// ([`crate::lease::overshoot::NearSet`]), for rules with an overshoot budget.
pub const NEAR_KEY: &str = "fg:near";

/// Host memory per shared-data entry beyond its key and value: measured on
/// Envoy 1.40 at about 97 bytes with a million clients (allocator rounding
/// included); 128 leaves a margin, since this is stated as a bound.
pub const SHARED_DATA_ENTRY_OVERHEAD: u64 = 128;

/// A configured limiter: built once per configuration, asked once per request.
#[derive(Debug)]
pub struct Limiter<H = ()> {
    rules: Vec<CompiledRule<H>>,
    settings: PluginSettings,
    hash_key: (u64, u64),
    /// This worker's copy of the near-limit notices (see `pools`).
    near: RefCell<NearSet>,
    /// Some table of some rule holds units until requests are done: else a
    /// request that ends gives nothing back (see [`Limiter::needs_release`]).
    holds_until_done: bool,
}

impl<H> Limiter<H> {
    /// Prepares `config` on `store`: reads the per-VM hashing secret (creating
    /// it from `entropy` if this is the first configuration), creates every
    /// bucket group of every rule that does not exist yet, and gives each
    /// rule the host's data from `host_data`.
    ///
    /// Creation is not atomic on Envoy, so this must run before traffic on a
    /// single thread: the filter calls it from `on_configure`, which Envoy
    /// runs on its main thread before the workers'.
    pub fn prepare(
        config: Config,
        store: &dyn Store,
        entropy: [u8; 16],
        mut host_data: impl FnMut(&crate::config::Rule) -> H,
    ) -> Result<Limiter<H>, StoreError> {
        store.create_if_absent(SEED_KEY, &entropy)?;
        let seed = store.get(SEED_KEY)?.map(|(v, _)| v).unwrap_or_default();
        let word = |at: usize| crate::algorithm::get_u64(&seed, at).unwrap_or(0);
        let Config { rules, settings } = config;
        let hash_key = (word(0), word(8));
        let rules: Vec<CompiledRule<H>> = rules
            .into_iter()
            .enumerate()
            .map(|(index, rule)| {
                let headers = RuleHeaders::new(settings.response.headers, &rule);
                let host = host_data(&rule);
                CompiledRule::new(index, rule, host, headers, hash_key)
            })
            .collect();
        let near = RefCell::new(NearSet::default());
        let holds_until_done =
            rules.iter().any(|compiled| compiled.tables().any(|(_, table)| table.holds_until_done()));
        let limiter = Limiter { rules, settings, hash_key, near, holds_until_done };
        for compiled in &limiter.rules {
            compiled.create_tables(store)?;
            if compiled.rule.global.is_some() {
                let mut key = Key::default();
                compiled.write_mode_key(&mut key)?;
                store.create_if_absent(key.as_str(), &ModeState::default().encode())?;
            }
        }
        if limiter.rules.iter().any(|c| c.rule.global.as_ref().is_some_and(|g| g.pool.overshoot.is_some())) {
            store.create_if_absent(NEAR_KEY, &[])?;
        }
        limiter.read_modes(store);
        Ok(limiter)
    }

    /// The rules, in order.
    pub fn rules(&self) -> &[CompiledRule<H>] {
        &self.rules
    }

    /// The limited response.
    pub fn response(&self) -> &Response {
        &self.settings.response
    }

    /// The quota service global rules ask, if any rule is global.
    pub fn quota_service(&self) -> Option<&QuotaService> {
        self.settings.global.as_ref()
    }

    /// Most requests one worker keeps waiting for a shaper at once.
    pub fn max_delayed_per_worker(&self) -> u32 {
        self.settings.max_delayed_per_worker
    }

    /// The request headers rules read, indexed by
    /// [`crate::descriptor::HeaderId`]; lower case.
    pub fn header_names(&self) -> &[String] {
        &self.settings.header_names
    }

    /// The most host memory a rule's buckets can take, in bytes.
    pub fn shared_data_bytes(&self, rule: usize) -> u64 {
        let Some(compiled) = self.rules.get(rule) else { return 0 };
        let mut key = Key::default();
        compiled
            .tables()
            .map(|(bucket, table)| {
                // The longest key is the last group's.
                let key_len = compiled.write_key(bucket, table.groups() - 1, &mut key).map_or(0, |()| key.len()) as u64;
                u64::from(table.groups()) * (SHARED_DATA_ENTRY_OVERHEAD + key_len + table.max_group_len() as u64)
            })
            .sum()
    }

    /// Writes the rate-limit headers `verdict` calls for into `out`.
    pub fn render_headers(&self, verdict: &Verdict, out: &mut HeaderBlock) {
        let rule = verdict.report.and_then(|report| Some((self.rules.get(report.rule)?, report)));
        crate::headers::render(
            &self.settings.response,
            verdict.allowed(),
            rule.map(|(r, report)| (&r.headers, report.decision, report.quota)),
            out,
        );
    }

    /// Whether rule `compiled` counts but never enforces.
    fn in_shadow(&self, compiled: &CompiledRule<H>) -> bool {
        compiled.rule.shadow_mode || self.settings.shadow_mode
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn prepare_creates_every_group_once_and_keeps_the_seed() {
        let store = MemoryStore::default();
        let first = build(PER_KEY, &store);
        assert_eq!(store.len(), 1 + 16, "seed + 64 keys / 4 ways");
        let again = build_with(PER_KEY, &store, [9; 16]);
        assert_eq!(first.hash_key, again.hash_key, "a later configuration keeps the first secret");
        assert_eq!(store.len(), 17);
        assert_eq!(
            first.shared_data_bytes(0),
            16 * (SHARED_DATA_ENTRY_OVERHEAD + "fg:per-key:15".len() as u64 + 2 + 4 * 24)
        );
    }
}
