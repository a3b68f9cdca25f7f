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

use std::cell::Cell;

use crate::algorithm::{Admission, Algorithm, Decision, Grant, Quota, Release};
use crate::config::{Config, Cost, FailureMode, Response, Rule};
use crate::descriptor::{fingerprint, protocol_descriptor, Request};
use crate::global::fallback::{Backoff, ModeState};
use crate::global::pool::{Applied, Claim, LeaseGrant, LeasePool, PoolState, Spend};
use crate::global::settings::{Fallback, GlobalMode, QuotaService};
use crate::hash::SipHasher;
use crate::headers::{HeaderBlock, RuleHeaders};
use crate::store::{self, measure_and_replace, LoopError, Replaced, Store, StoreError};
use crate::table::{Slot, Table, TableOutcome};
use crate::text::InlineText;
use crate::time::{Nanos, SECOND};

/// Shared-data key holding the per-VM secret that keys descriptor hashing.
pub const SEED_KEY: &str = "fg:seed";

/// Room for a group's key, `fg:<rule>:<group>`: a rule name is at most 64
/// bytes and a group number at most 7 digits, 75 bytes in all.
type Key = InlineText<96>;

/// Host memory per shared-data entry beyond its key and value: measured on
/// Envoy 1.40 at about 97 bytes with a million clients (allocator rounding
/// included); 128 leaves a margin, since this is stated as a bound.
pub const SHARED_DATA_ENTRY_OVERHEAD: u64 = 128;

/// A per-rule outcome worth counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleEvent {
    /// The rule admitted a request that was let through.
    Allowed,
    /// The rule admitted a request only after a delay (counted besides `Allowed`).
    Delayed,
    /// The rule denied a request, which was answered as limited.
    Limited,
    /// The rule would have denied, but is in shadow mode.
    ShadowLimited,
    /// A global rule decided by its fall-back: the quota service was failing.
    Fallback,
}

/// A store-level occurrence worth counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreEvent {
    /// Writes that lost a race and were decided again.
    CasRetries,
    /// Decisions abandoned after the last retry; the failure mode applied.
    RetriesExhausted,
    /// Idle buckets of other descriptors reused.
    SlotEvictions,
    /// New descriptors that found every bucket of their group live; the
    /// failure mode applied.
    TableFull,
    /// Shared-data reads or writes that failed; the failure mode applied.
    StoreErrors,
    /// Stored groups that did not decode and were started afresh.
    CorruptState,
}

/// Receives what the limiter counts. The filter maps these to Envoy metrics,
/// whose ids it keeps in each rule's `host` data.
pub trait Counters<H> {
    /// Counts one per-rule outcome.
    fn rule(&mut self, rule: &CompiledRule<H>, event: RuleEvent);
    /// Counts `count` store occurrences.
    fn store(&mut self, event: StoreEvent, count: u64);
    /// Adds `change` to the units `rule` holds in flight, summed over its
    /// buckets and over every worker's writes (algorithms that hold units
    /// until requests are done; holds that expired leave the sum when their
    /// bucket is next written).
    fn in_flight(&mut self, _rule: &CompiledRule<H>, _change: i64) {}
}

/// One rule, prepared once per configuration with everything a request needs:
/// the validated rule, its shared-data key prefix, the constant parts of its
/// headers, and whatever the host keeps per rule (`H`, e.g. metric ids).
#[derive(Debug)]
pub struct CompiledRule<H> {
    /// The rule as configured.
    pub rule: Rule,
    /// The host's data for this rule.
    pub host: H,
    /// `fg:<name>:`: a group's shared-data key is this and its number.
    key_prefix: String,
    /// The constant parts of the rule's response headers.
    pub(crate) headers: RuleHeaders,
    /// A global rule's fall-back is in force, as this worker last saw the
    /// rule's mode in shared data.
    in_fallback: Cell<bool>,
}

impl<H> CompiledRule<H> {
    /// True while this global rule uses its fall-back (as this worker knows).
    pub fn in_fallback(&self) -> bool {
        self.in_fallback.get()
    }
}

/// The rule whose numbers a response reports: the one that denied, or else
/// the most restrictive that admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// Index of the rule in [`Limiter::rules`].
    pub rule: usize,
    /// Its decision.
    pub decision: Decision,
    /// The limit as the quota service last stated it, for a global rule
    /// (a local rule's is in its configuration).
    pub quota: Option<Quota>,
}

/// The verdict on one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// Go on now, after a delay (the longest any rule asked for), deny, or
    /// pending an answer from the quota service.
    pub admission: Admission,
    /// The first rule in shadow mode that would have denied it, if any.
    pub shadow_limited: Option<usize>,
    /// Some rule could not decide and the failure mode applied.
    pub failed: bool,
    /// The numbers for the rate-limit headers, if any rule decided.
    pub report: Option<Report>,
    /// Refreshes of lease pools this request claimed: the host asks the
    /// quota service for each, whatever the verdict.
    pub refreshes: Vec<Refresh>,
    /// Check-mode rules to ask the quota service about (admission pending).
    pub checks: Vec<CheckItem>,
    /// While checks are pending: the delay the other rules asked for, and
    /// the rules that asked, for [`Limiter::settle`] to restore and count.
    deferred: (Nanos, Vec<usize>),
}

impl Verdict {
    fn new() -> Self {
        Verdict {
            admission: Admission::Now,
            shadow_limited: None,
            failed: false,
            report: None,
            refreshes: Vec::new(),
            checks: Vec::new(),
            deferred: (Nanos::ZERO, Vec::new()),
        }
    }

    /// True when admitted, at once or after a delay.
    pub fn allowed(&self) -> bool {
        matches!(self.admission, Admission::Now | Admission::Delayed(_))
    }

    /// The wait before the request goes on: zero unless delayed.
    pub fn delay(&self) -> Nanos {
        match self.admission {
            Admission::Delayed(delay) => delay,
            Admission::Now | Admission::Denied { .. } | Admission::Pending => Nanos::ZERO,
        }
    }
}

/// A refresh of one lease pool, claimed by a request: what to ask the quota
/// service for, and where the answer goes.
#[derive(Debug, Clone, PartialEq)]
pub struct Refresh {
    /// Index of the global rule in [`Limiter::rules`].
    pub rule: usize,
    /// The pool's group and descriptor fingerprint.
    pub group: u32,
    /// The descriptor's fingerprint.
    pub fingerprint: u64,
    /// The claim (when, how much, at what rate).
    pub claim: Claim,
    /// The id to lease with (unique per claim; the service deduplicates by it).
    pub lease: u64,
    /// The descriptor's `[key, value]` pairs.
    pub descriptor: Vec<(String, String)>,
}

/// A check-mode rule's question for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckItem {
    /// Index of the global rule in [`Limiter::rules`].
    pub rule: usize,
    /// The descriptor's `[key, value]` pairs.
    pub descriptor: Vec<(String, String)>,
    /// Units the request costs.
    pub hits: u64,
    /// Where its local fall-back bucket is, should the service fail.
    group: u32,
    fingerprint: u64,
}

/// The quota service's answer about one check item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckAnswer {
    /// Admitted (or over the limit in shadow mode) or denied, with the
    /// numbers to report.
    pub decision: Decision,
    /// The limit the service applied, if it said.
    pub quota: Option<Quota>,
}

/// Which of a rule's tables units came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bucket {
    /// The rule's own table (a global rule's: its lease pools).
    Main,
    /// A global rule's local fall-back table.
    Fallback,
}

/// What one rule took for an admitted request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Held {
    rule: usize,
    bucket: Bucket,
    group: u32,
    fingerprint: u64,
    grant: Grant,
}

/// What an admitted request took from each rule, to be given back through
/// [`Limiter::release`]. Not `Clone`: units are given back once.
#[derive(Debug, Default, PartialEq, Eq)]
#[must_use = "a permit holds units until it is released"]
pub struct Permit {
    held: Vec<Held>,
}

impl Permit {
    /// True when nothing was taken.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

/// Backoff between probes of a failing quota service: the first after 100 ms,
/// doubling to at most 2 s, so global mode is back within about 2 s of the
/// service's return.
const PROBE_BACKOFF: Backoff =
    Backoff { first: Nanos(100_000_000), max: Nanos(2 * SECOND.0), probe_ttl: Nanos(SECOND.0) };

/// A configured limiter: built once per configuration, asked once per request.
#[derive(Debug)]
pub struct Limiter<H = ()> {
    rules: Vec<CompiledRule<H>>,
    response: Response,
    shadow_mode: bool,
    failure_mode: FailureMode,
    max_cas_retries: u32,
    max_delayed_per_worker: u32,
    header_names: Vec<String>,
    hash_key: (u64, u64),
    service: Option<QuotaService>,
}

/// How one rule decided.
enum Step {
    /// It decided (`None`: it could not, and the failure mode applies).
    Decided(Option<Decision>, Bucket),
    /// Its pool is empty: ask again after the refresh.
    Pending,
    /// It does not count for this request.
    Skip,
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
        mut host_data: impl FnMut(&Rule) -> H,
    ) -> Result<Limiter<H>, StoreError> {
        store.create_if_absent(SEED_KEY, &entropy)?;
        let seed = store.get(SEED_KEY)?.map(|(v, _)| v).unwrap_or_default();
        let word = |at: usize| crate::algorithm::get_u64(&seed, at).unwrap_or(0);
        let Config {
            rules,
            response,
            shadow_mode,
            failure_mode,
            max_cas_retries,
            max_delayed_per_worker,
            global: service,
            header_names,
        } = config;
        let rules = rules
            .into_iter()
            .map(|rule| CompiledRule {
                host: host_data(&rule),
                key_prefix: format!("fg:{}:", rule.name),
                headers: RuleHeaders::new(response.headers, &rule),
                in_fallback: Cell::new(false),
                rule,
            })
            .collect();
        let limiter = Limiter {
            rules,
            response,
            shadow_mode,
            failure_mode,
            max_cas_retries,
            max_delayed_per_worker,
            header_names,
            hash_key: (word(0), word(8)),
            service,
        };
        let mut key = Key::default();
        for compiled in &limiter.rules {
            let mut tables = vec![(Bucket::Main, &compiled.rule.table)];
            if let Some(Fallback::Local(table)) = compiled.rule.global.as_ref().map(|g| &g.fallback) {
                tables.push((Bucket::Fallback, table));
            }
            for (bucket, table) in tables {
                // Groups are created in order, so the last one existing means all do.
                compiled.write_key(bucket, table.groups() - 1, &mut key)?;
                if store.get(key.as_str())?.is_some() {
                    continue;
                }
                let empty = table.empty_group();
                for group in 0..table.groups() {
                    compiled.write_key(bucket, group, &mut key)?;
                    store.create_if_absent(key.as_str(), &empty)?;
                }
            }
            if compiled.rule.global.is_some() {
                compiled.write_mode_key(&mut key)?;
                store.create_if_absent(key.as_str(), &ModeState::default().encode())?;
            }
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
        &self.response
    }

    /// The quota service global rules ask, if any rule is global.
    pub fn quota_service(&self) -> Option<&QuotaService> {
        self.service.as_ref()
    }

    /// Most requests one worker keeps waiting for a shaper at once.
    pub fn max_delayed_per_worker(&self) -> u32 {
        self.max_delayed_per_worker
    }

    /// The request headers rules read, indexed by
    /// [`crate::descriptor::HeaderId`]; lower case.
    pub fn header_names(&self) -> &[String] {
        &self.header_names
    }

    /// The most host memory a rule's buckets can take, in bytes.
    pub fn shared_data_bytes(&self, rule: usize) -> u64 {
        let Some(compiled) = self.rules.get(rule) else { return 0 };
        let mut tables = vec![(Bucket::Main, &compiled.rule.table)];
        if let Some(Fallback::Local(table)) = compiled.rule.global.as_ref().map(|g| &g.fallback) {
            tables.push((Bucket::Fallback, table));
        }
        let mut key = Key::default();
        tables
            .into_iter()
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
            &self.response,
            verdict.allowed(),
            rule.map(|(r, report)| (&r.headers, report.decision, report.quota)),
            out,
        );
    }

    /// Decides on `request` at `now`. An admitted request's permit holds what
    /// each rule took; a denied or pending request's permit is empty (its
    /// units were already given back), except when check-mode rules are to
    /// be asked: then the permit holds the other rules' units until
    /// [`Limiter::settle`].
    pub fn check(
        &self,
        store: &dyn Store,
        now: Nanos,
        request: &mut dyn Request,
        counters: &mut dyn Counters<H>,
    ) -> (Verdict, Permit) {
        self.check_waited(store, now, request, false, counters)
    }

    /// [`Limiter::check`] for a request that waited for a refresh as long as
    /// it may (`waited_out`): an empty pool then denies it (or, while the
    /// service fails, follows the rule's fall-back) instead of pending again.
    pub fn check_waited(
        &self,
        store: &dyn Store,
        now: Nanos,
        request: &mut dyn Request,
        waited_out: bool,
        counters: &mut dyn Counters<H>,
    ) -> (Verdict, Permit) {
        let mut permit = Permit::default();
        let mut verdict = Verdict::new();
        let mut shadowed: Vec<usize> = Vec::new();
        let mut delayed: Vec<usize> = Vec::new();
        for (index, compiled) in self.rules.iter().enumerate() {
            let rule = &compiled.rule;
            if !rule.request_match.matches(request) {
                continue;
            }
            let Some(fp) = fingerprint(self.hash_key, &rule.name, &rule.descriptors, request) else {
                continue;
            };
            let cost = request_cost(rule, request);
            let group = rule.table.group_of(fp);
            let shadow = rule.shadow_mode || self.shadow_mode;
            let mut pool_quota = None;
            let step = match &rule.global {
                None => Step::Decided(
                    self.decide_on(store, compiled, Bucket::Main, &rule.table, group, fp, now, cost, counters),
                    Bucket::Main,
                ),
                Some(global) if compiled.in_fallback() => {
                    self.fall_back(store, compiled, &global.fallback, fp, now, cost, counters)
                }
                Some(global) if global.mode == GlobalMode::Check => {
                    if let Some(descriptor) = protocol_descriptor(&rule.descriptors, request) {
                        verdict.checks.push(CheckItem { rule: index, descriptor, hits: cost, group, fingerprint: fp });
                    }
                    Step::Skip
                }
                Some(global) => {
                    match self.spend_pool(
                        store,
                        compiled,
                        index,
                        group,
                        fp,
                        now,
                        cost,
                        request,
                        &mut verdict,
                        &mut pool_quota,
                        counters,
                    ) {
                        // Waited as long as it may and still no tokens: while
                        // the service answers, that is a denial (its grants are
                        // what the fleet may admit); only a failing service
                        // brings the fall-back in.
                        Step::Pending if waited_out && compiled.in_fallback() => {
                            self.fall_back(store, compiled, &global.fallback, fp, now, cost, counters)
                        }
                        Step::Pending if waited_out => {
                            Step::Decided(Some(Decision::deny(0, Nanos::ZERO, self.refill_retry())), Bucket::Main)
                        }
                        step => step,
                    }
                }
            };
            let (decided, bucket) = match step {
                Step::Skip => continue,
                // A shadow rule never holds a request back.
                Step::Pending if shadow => continue,
                Step::Pending => {
                    self.release(store, now, permit, Release::Undo, counters);
                    self.count_shadowed(&shadowed, counters);
                    verdict.admission = Admission::Pending;
                    verdict.checks.clear();
                    return (verdict, Permit::default());
                }
                Step::Decided(decided, bucket) => (decided, bucket),
            };
            match decided {
                Some(decision) if decision.allowed() => {
                    permit.held.push(Held {
                        rule: index,
                        bucket,
                        group: self.group_in(compiled, bucket, fp),
                        fingerprint: fp,
                        grant: Grant { cost, at: now },
                    });
                    if !shadow && decision.delay() > Nanos::ZERO {
                        delayed.push(index);
                        if decision.delay() > verdict.delay() {
                            verdict.admission = Admission::Delayed(decision.delay());
                        }
                    }
                    verdict.report =
                        Some(more_restrictive(verdict.report, Report { rule: index, decision, quota: pool_quota }));
                }
                Some(_) if shadow => {
                    verdict.shadow_limited = verdict.shadow_limited.or(Some(index));
                    shadowed.push(index);
                }
                Some(decision) => {
                    self.release(store, now, permit, Release::Undo, counters);
                    counters.rule(compiled, RuleEvent::Limited);
                    self.count_shadowed(&shadowed, counters);
                    verdict.admission = Admission::Denied { retry_after: decision.retry_after() };
                    verdict.report = Some(Report { rule: index, decision, quota: pool_quota });
                    verdict.checks.clear();
                    return (verdict, Permit::default());
                }
                None => {
                    verdict.failed = true;
                    if self.failure_mode == FailureMode::Deny && !shadow {
                        self.release(store, now, permit, Release::Undo, counters);
                        self.count_shadowed(&shadowed, counters);
                        verdict.admission = Admission::Denied { retry_after: Nanos::ZERO };
                        verdict.report = None;
                        verdict.checks.clear();
                        return (verdict, Permit::default());
                    }
                }
            }
        }
        self.count_shadowed(&shadowed, counters);
        if !verdict.checks.is_empty() {
            // Admissions are counted, and the delay applied, once the
            // service has answered, in `settle`.
            verdict.deferred = (verdict.delay(), delayed);
            verdict.admission = Admission::Pending;
            return (verdict, permit);
        }
        self.count_admitted(&permit, &delayed, counters);
        (verdict, permit)
    }

    /// Finishes a request whose check-mode rules were asked: `answers` holds
    /// one answer per item of `verdict.checks`, or `None` when the call
    /// failed (then each rule follows its fall-back). Returns the final
    /// verdict and permit.
    pub fn settle(
        &self,
        store: &dyn Store,
        now: Nanos,
        mut verdict: Verdict,
        mut permit: Permit,
        answers: Option<&[CheckAnswer]>,
        counters: &mut dyn Counters<H>,
    ) -> (Verdict, Permit) {
        let checks = std::mem::take(&mut verdict.checks);
        let (delay, delayed) = std::mem::take(&mut verdict.deferred);
        verdict.admission = if delay > Nanos::ZERO { Admission::Delayed(delay) } else { Admission::Now };
        for (at, item) in checks.iter().enumerate() {
            let Some(compiled) = self.rules.get(item.rule) else { continue };
            let shadow = compiled.rule.shadow_mode || self.shadow_mode;
            let answer = answers.and_then(|a| a.get(at));
            let quota = answer.and_then(|a| a.quota);
            let step = match (answer, &compiled.rule.global) {
                (Some(answer), _) => Step::Decided(Some(answer.decision), Bucket::Main),
                (None, Some(global)) => {
                    self.fall_back(store, compiled, &global.fallback, item.fingerprint, now, item.hits, counters)
                }
                (None, None) => Step::Skip,
            };
            match step {
                Step::Decided(Some(decision), bucket) if decision.allowed() => {
                    if bucket == Bucket::Fallback {
                        // Held, so counted with the permit below.
                        let group = self.group_in(compiled, bucket, item.fingerprint);
                        let grant = Grant { cost: item.hits, at: now };
                        permit.held.push(Held { rule: item.rule, bucket, group, fingerprint: item.fingerprint, grant });
                    } else {
                        counters.rule(compiled, RuleEvent::Allowed);
                    }
                    verdict.report =
                        Some(more_restrictive(verdict.report, Report { rule: item.rule, decision, quota }));
                }
                Step::Decided(Some(_), _) if shadow => {
                    counters.rule(compiled, RuleEvent::ShadowLimited);
                    verdict.shadow_limited = verdict.shadow_limited.or(Some(item.rule));
                }
                Step::Decided(Some(decision), _) => {
                    self.release(store, now, permit, Release::Undo, counters);
                    counters.rule(compiled, RuleEvent::Limited);
                    verdict.admission = Admission::Denied { retry_after: decision.retry_after() };
                    verdict.report = Some(Report { rule: item.rule, decision, quota });
                    return (verdict, Permit::default());
                }
                Step::Decided(None, _) => {
                    verdict.failed = true;
                    if self.failure_mode == FailureMode::Deny && !shadow {
                        self.release(store, now, permit, Release::Undo, counters);
                        verdict.admission = Admission::Denied { retry_after: Nanos::ZERO };
                        verdict.report = None;
                        return (verdict, Permit::default());
                    }
                }
                Step::Pending | Step::Skip => {}
            }
        }
        self.count_admitted(&permit, &delayed, counters);
        (verdict, permit)
    }

    /// Gives back what `permit` holds, for `why`: the one way units return,
    /// whether a request ended ([`Release::Done`]: only rules that hold units
    /// in flight are touched) or was not served after all ([`Release::Undo`]).
    pub fn release(&self, store: &dyn Store, now: Nanos, permit: Permit, why: Release, counters: &mut dyn Counters<H>) {
        let mut key = Key::default();
        for held in permit.held.iter().rev() {
            let Some(compiled) = self.rules.get(held.rule) else { continue };
            let Some(table) = compiled.table(held.bucket) else { continue };
            if why == Release::Done && !table.policy().holds_until_done() {
                continue;
            }
            let result =
                compiled.write_key(held.bucket, held.group, &mut key).map_err(LoopError::Store).and_then(|()| {
                    measure_and_replace(store, key.as_str(), self.max_cas_retries, |group| {
                        table.release(group, held.fingerprint, now, held.grant, why)
                    })
                });
            if let Some(held_change) = self.count_loop(result, counters).filter(|change| *change != 0) {
                counters.in_flight(compiled, held_change);
            }
        }
    }

    /// Applies the quota service's answer to a refresh: the grant becomes the
    /// pool's lease unless a newer one is in place. Returns what happened
    /// (the caller returns leftover or stale tokens to the service), or
    /// `None` when the pool could not be updated.
    pub fn apply_lease(
        &self,
        store: &dyn Store,
        now: Nanos,
        refresh: &Refresh,
        grant: &LeaseGrant,
        counters: &mut dyn Counters<H>,
    ) -> Option<Applied> {
        let (compiled, pool) = self.pool_of(refresh.rule)?;
        let mut key = Key::default();
        let result =
            compiled.write_key(Bucket::Main, refresh.group, &mut key).map_err(LoopError::Store).and_then(|()| {
                measure_and_replace(store, key.as_str(), self.max_cas_retries, |group| {
                    compiled.rule.table.update(group, refresh.fingerprint, now, |slot| {
                        let state = pool.decode(slot).unwrap_or_else(|| pool.fresh(now));
                        let (applied, after) = pool.apply(state, now, refresh.claim.started, grant);
                        let changed = after != state;
                        pool.encode(&after, slot);
                        (applied, changed)
                    })
                })
            });
        self.slot_of(compiled, result, counters)
    }

    /// Takes the unspent tokens out of every lease pool of every global rule,
    /// to give them back to the service: when this configuration goes away
    /// (a rule removed or changed, or Envoy shutting down). Each pool is
    /// emptied by compare-and-swap, so when every worker does this at once,
    /// each lease's tokens are taken once. Returns `(lease, tokens)`.
    pub fn take_unspent(&self, store: &dyn Store, now: Nanos) -> Vec<(u64, u64)> {
        let mut taken = Vec::new();
        let mut key = Key::default();
        for (index, compiled) in self.rules.iter().enumerate() {
            let Some((_, pool)) = self.pool_of(index) else { continue };
            let table = &compiled.rule.table;
            for group in 0..table.groups() {
                if compiled.write_key(Bucket::Main, group, &mut key).is_err() {
                    continue;
                }
                let mut here = Vec::new();
                let result = measure_and_replace(store, key.as_str(), self.max_cas_retries, |stored| {
                    // Decided again after a lost race: start the list over.
                    here.clear();
                    table.update_every(stored, |slot| {
                        let Some(state) = pool.decode(slot) else { return false };
                        let unspent = pool.unspent(&state, now);
                        if unspent.iter().all(|(_, tokens)| *tokens == 0) {
                            return false;
                        }
                        here.extend(unspent.into_iter().filter(|(_, tokens)| *tokens > 0));
                        pool.encode(&PoolState { tokens: 0, held_tokens: 0, ..state }, slot);
                        true
                    })
                });
                if result.is_ok() {
                    taken.append(&mut here);
                }
            }
        }
        taken
    }

    /// Ends a refresh that got no answer, so the next request may claim again.
    pub fn abandon_lease(&self, store: &dyn Store, now: Nanos, refresh: &Refresh, counters: &mut dyn Counters<H>) {
        let Some((compiled, pool)) = self.pool_of(refresh.rule) else { return };
        let mut key = Key::default();
        let result =
            compiled.write_key(Bucket::Main, refresh.group, &mut key).map_err(LoopError::Store).and_then(|()| {
                measure_and_replace(store, key.as_str(), self.max_cas_retries, |group| {
                    compiled.rule.table.update(group, refresh.fingerprint, now, |slot| {
                        let Some(after) =
                            pool.decode(slot).and_then(|state| pool.abandon(state, refresh.claim.started))
                        else {
                            return ((), false);
                        };
                        pool.encode(&after, slot);
                        ((), true)
                    })
                })
            });
        let _ = self.slot_of(compiled, result, counters);
    }

    /// Records the outcome of a callout for global rule `rule` in its shared
    /// mode: a failure switches it to its fall-back (every worker follows at
    /// its next [`Limiter::read_modes`]), a success back to global mode.
    pub fn record_callout(&self, store: &dyn Store, now: Nanos, rule: usize, succeeded: bool) {
        self.update_mode(store, rule, |mode| {
            let next = if succeeded { mode.succeeded() } else { mode.failed(now, &PROBE_BACKOFF) };
            (next != mode).then_some(next)
        });
    }

    /// Claims the probes due at `now`: the global rules in fall-back whose
    /// next probe may start, one worker at a time. The host probes the
    /// service for each and reports with [`Limiter::record_callout`].
    pub fn due_probes(&self, store: &dyn Store, now: Nanos) -> Vec<usize> {
        (0..self.rules.len())
            .filter(|&rule| {
                self.rules.get(rule).is_some_and(CompiledRule::in_fallback)
                    && self.update_mode(store, rule, |mode| mode.claim_probe(now, &PROBE_BACKOFF))
            })
            .collect()
    }

    /// Reads every global rule's mode from shared data into this worker's
    /// view (the host calls it on its tick).
    pub fn read_modes(&self, store: &dyn Store) {
        let mut key = Key::default();
        for compiled in self.rules.iter().filter(|c| c.rule.global.is_some()) {
            if compiled.write_mode_key(&mut key).is_ok() {
                if let Ok(Some((bytes, _))) = store.get(key.as_str()) {
                    compiled.in_fallback.set(ModeState::decode(&bytes).in_fallback());
                }
            }
        }
    }

    /// Compare-and-swaps rule `rule`'s mode with `change`; true when written.
    fn update_mode(&self, store: &dyn Store, rule: usize, change: impl Fn(ModeState) -> Option<ModeState>) -> bool {
        let Some(compiled) = self.rules.get(rule).filter(|c| c.rule.global.is_some()) else { return false };
        let mut key = Key::default();
        if compiled.write_mode_key(&mut key).is_err() {
            return false;
        }
        let result = measure_and_replace(store, key.as_str(), self.max_cas_retries, |bytes| {
            let mode = ModeState::decode(&bytes);
            match change(mode) {
                Some(next) => store::Step::Write(next.encode().to_vec(), Some(next)),
                None => store::Step::Keep(None),
            }
        });
        match result {
            Ok(Replaced { outcome: Some(next), .. }) => {
                compiled.in_fallback.set(next.in_fallback());
                true
            }
            _ => false,
        }
    }

    /// What a request that waited out an empty pool is told: try again once
    /// a refresh could have answered.
    fn refill_retry(&self) -> Nanos {
        self.service.as_ref().map_or(SECOND, |s| s.timeout.max(Nanos::from_millis(1)))
    }

    /// The global rule at `rule` and its pools' arithmetic.
    fn pool_of(&self, rule: usize) -> Option<(&CompiledRule<H>, LeasePool)> {
        let compiled = self.rules.get(rule).filter(|c| c.rule.global.is_some())?;
        Some((compiled, self.service.as_ref()?.pool()))
    }

    /// Spends from the request's pool, claiming a refresh if one is due.
    #[allow(clippy::too_many_arguments)]
    fn spend_pool(
        &self,
        store: &dyn Store,
        compiled: &CompiledRule<H>,
        index: usize,
        group: u32,
        fp: u64,
        now: Nanos,
        cost: u64,
        request: &mut dyn Request,
        verdict: &mut Verdict,
        quota: &mut Option<Quota>,
        counters: &mut dyn Counters<H>,
    ) -> Step {
        let Some((_, pool)) = self.pool_of(index) else { return Step::Decided(None, Bucket::Main) };
        let mut key = Key::default();
        let result = compiled.write_key(Bucket::Main, group, &mut key).map_err(LoopError::Store).and_then(|()| {
            measure_and_replace(store, key.as_str(), self.max_cas_retries, |stored| {
                compiled.rule.table.update(stored, fp, now, |slot| {
                    let state: PoolState = pool.decode(slot).unwrap_or_else(|| pool.fresh(now));
                    let (spend, claim, after) = pool.spend(state, now, cost);
                    let changed = after != state;
                    pool.encode(&after, slot);
                    let quota = (after.limit > 0).then_some(Quota { limit: after.limit, window: Some(after.window) });
                    ((spend, claim, quota), changed)
                })
            })
        });
        let Some((spend, claim, stated)) = self.slot_of(compiled, result, counters) else {
            return Step::Decided(None, Bucket::Main);
        };
        if let Some(claim) = claim {
            if let Some(descriptor) = protocol_descriptor(&compiled.rule.descriptors, request) {
                let lease = self.lease_id(&compiled.rule.name, fp, claim.started);
                verdict.refreshes.push(Refresh { rule: index, group, fingerprint: fp, claim, lease, descriptor });
            }
        }
        *quota = stated;
        match spend {
            Spend::Taken(decision) | Spend::Denied(decision) => Step::Decided(Some(decision), Bucket::Main),
            Spend::Empty => Step::Pending,
        }
    }

    /// Decides by a global rule's fall-back while the service fails.
    #[allow(clippy::too_many_arguments)]
    fn fall_back(
        &self,
        store: &dyn Store,
        compiled: &CompiledRule<H>,
        fallback: &Fallback,
        fp: u64,
        now: Nanos,
        cost: u64,
        counters: &mut dyn Counters<H>,
    ) -> Step {
        counters.rule(compiled, RuleEvent::Fallback);
        match fallback {
            Fallback::Allow => Step::Skip,
            Fallback::Deny => Step::Decided(Some(Decision::deny(0, Nanos::ZERO, Nanos::ZERO)), Bucket::Fallback),
            Fallback::Local(table) => {
                let group = table.group_of(fp);
                Step::Decided(
                    self.decide_on(store, compiled, Bucket::Fallback, table, group, fp, now, cost, counters),
                    Bucket::Fallback,
                )
            }
        }
    }

    /// Decides `cost` on the descriptor's bucket in one of a rule's tables.
    #[allow(clippy::too_many_arguments)]
    fn decide_on(
        &self,
        store: &dyn Store,
        compiled: &CompiledRule<H>,
        bucket: Bucket,
        table: &Table,
        group: u32,
        fp: u64,
        now: Nanos,
        cost: u64,
        counters: &mut dyn Counters<H>,
    ) -> Option<Decision> {
        let mut key = Key::default();
        let result = compiled.write_key(bucket, group, &mut key).map_err(LoopError::Store).and_then(|()| {
            measure_and_replace(store, key.as_str(), self.max_cas_retries, |stored| table.decide(stored, fp, now, cost))
        });
        let outcome = self.count_loop(result, counters)?;
        match outcome {
            TableOutcome::Decided { decision, reused_idle, was_corrupt, held_change } => {
                self.count_slot(compiled, reused_idle, was_corrupt, held_change, counters);
                Some(decision)
            }
            TableOutcome::Full => {
                counters.store(StoreEvent::TableFull, 1);
                None
            }
        }
    }

    /// Counts a table operation's slot and unwraps its value (`None`: the
    /// loop failed or the group was full, both counted).
    fn slot_of<T>(
        &self,
        compiled: &CompiledRule<H>,
        result: Result<Replaced<Option<Slot<T>>>, LoopError>,
        counters: &mut dyn Counters<H>,
    ) -> Option<T> {
        match self.count_loop(result, counters)? {
            Some(Slot { value, reused_idle, was_corrupt, held_change }) => {
                self.count_slot(compiled, reused_idle, was_corrupt, held_change, counters);
                Some(value)
            }
            None => {
                counters.store(StoreEvent::TableFull, 1);
                None
            }
        }
    }

    fn count_slot(
        &self,
        compiled: &CompiledRule<H>,
        reused_idle: bool,
        was_corrupt: bool,
        held_change: i64,
        counters: &mut dyn Counters<H>,
    ) {
        if held_change != 0 {
            counters.in_flight(compiled, held_change);
        }
        if reused_idle {
            counters.store(StoreEvent::SlotEvictions, 1);
        }
        if was_corrupt {
            counters.store(StoreEvent::CorruptState, 1);
        }
    }

    /// Counts how a measure-and-replace loop went; its outcome if it succeeded.
    fn count_loop<T>(&self, result: Result<Replaced<T>, LoopError>, counters: &mut dyn Counters<H>) -> Option<T> {
        match result {
            Ok(Replaced { outcome, retries }) => {
                if retries > 0 {
                    counters.store(StoreEvent::CasRetries, u64::from(retries));
                }
                Some(outcome)
            }
            Err(LoopError::RetriesExhausted) => {
                if self.max_cas_retries > 0 {
                    counters.store(StoreEvent::CasRetries, u64::from(self.max_cas_retries));
                }
                counters.store(StoreEvent::RetriesExhausted, 1);
                None
            }
            Err(LoopError::Store(_)) => {
                counters.store(StoreEvent::StoreErrors, 1);
                None
            }
        }
    }

    /// The group of descriptor `fp` in one of a rule's tables.
    fn group_in(&self, compiled: &CompiledRule<H>, bucket: Bucket, fp: u64) -> u32 {
        compiled.table(bucket).map_or(0, |table| table.group_of(fp))
    }

    /// A lease id unique to this claim: the pool, the claim's instant, keyed
    /// by this Envoy's secret (so two Envoys never pick the same id). Never 0.
    fn lease_id(&self, rule: &str, fp: u64, started: Nanos) -> u64 {
        let mut hasher = SipHasher::new(self.hash_key.0 ^ 0x6c65_6173_6521, self.hash_key.1);
        hasher.write_field(rule.as_bytes());
        hasher.write(&fp.to_le_bytes());
        hasher.write(&started.get().to_le_bytes());
        hasher.finish().max(1)
    }

    /// Counts what an admitted request's rules did. A rule holds at most one
    /// entry of a permit: `check` decides each rule once, and `settle` adds
    /// only check-mode rules, which `check` left to it.
    fn count_admitted(&self, permit: &Permit, delayed: &[usize], counters: &mut dyn Counters<H>) {
        for compiled in permit.held.iter().filter_map(|held| self.rules.get(held.rule)) {
            counters.rule(compiled, RuleEvent::Allowed);
        }
        for compiled in delayed.iter().filter_map(|&i| self.rules.get(i)) {
            counters.rule(compiled, RuleEvent::Delayed);
        }
    }

    fn count_shadowed(&self, shadowed: &[usize], counters: &mut dyn Counters<H>) {
        for compiled in shadowed.iter().filter_map(|&i| self.rules.get(i)) {
            counters.rule(compiled, RuleEvent::ShadowLimited);
        }
    }
}

impl<H> CompiledRule<H> {
    /// One of the rule's tables.
    fn table(&self, bucket: Bucket) -> Option<&Table> {
        match bucket {
            Bucket::Main => Some(&self.rule.table),
            Bucket::Fallback => match self.rule.global.as_ref().map(|g| &g.fallback) {
                Some(Fallback::Local(table)) => Some(table),
                _ => None,
            },
        }
    }

    /// Writes the shared-data key of a bucket group into `key`:
    /// `fg:<rule>:<group>`, or `fg:<rule>:fb:<group>` for a global rule's
    /// local fall-back. It always fits (see [`Key`]); if it did not, that
    /// would be a store error rather than a wrong key.
    fn write_key(&self, bucket: Bucket, group: u32, key: &mut Key) -> Result<(), StoreError> {
        key.clear();
        let kind = if bucket == Bucket::Fallback { "fb:" } else { "" };
        if key.push_str(&self.key_prefix) && key.push_str(kind) && key.push_u64(u64::from(group)) {
            Ok(())
        } else {
            Err(StoreError::Host)
        }
    }

    /// Writes the key of a global rule's mode, `fg:<rule>:mode`.
    fn write_mode_key(&self, key: &mut Key) -> Result<(), StoreError> {
        key.clear();
        if key.push_str(&self.key_prefix) && key.push_str("mode") {
            Ok(())
        } else {
            Err(StoreError::Host)
        }
    }
}

/// The cost of `request` under `rule`.
fn request_cost(rule: &Rule, request: &mut dyn Request) -> u64 {
    match &rule.cost {
        Cost::Fixed(cost) => *cost,
        Cost::FromHeader { header, default, max } => {
            request.header(*header).and_then(parse_decimal).map_or(*default, |cost| cost.clamp(1, *max))
        }
    }
}

/// A plain decimal number; one too large for a u64 reads as `u64::MAX`, so
/// a huge cost header costs the configured maximum, not the default.
fn parse_decimal(bytes: &[u8]) -> Option<u64> {
    if bytes.is_empty() || !bytes.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(bytes.iter().fold(0u64, |n, d| n.saturating_mul(10).saturating_add(u64::from(d - b'0'))))
}

/// The report with fewer units remaining; on a tie, the one that takes
/// longer to recover.
fn more_restrictive(current: Option<Report>, candidate: Report) -> Report {
    match current {
        Some(current)
            if (current.decision.remaining, std::cmp::Reverse(current.decision.reset))
                <= (candidate.decision.remaining, std::cmp::Reverse(candidate.decision.reset)) =>
        {
            current
        }
        _ => candidate,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::descriptor::StaticRequest;
    use crate::global::pool::Leftover;
    use crate::store::{MemoryStore, Step};
    use crate::time::SECOND;
    use std::cell::Cell;
    use std::collections::HashMap;
    use std::rc::Rc;

    const T0: Nanos = Nanos(1_700_000_000 * SECOND.0);

    #[derive(Default)]
    struct Tally {
        rules: HashMap<(usize, &'static str), u64>,
        store: HashMap<&'static str, u64>,
        in_flight: HashMap<usize, i64>,
    }

    /// Rules carry their index as host data, so counts are kept per index.
    impl Counters<usize> for Tally {
        fn rule(&mut self, rule: &CompiledRule<usize>, event: RuleEvent) {
            let name = match event {
                RuleEvent::Allowed => "allowed",
                RuleEvent::Delayed => "delayed",
                RuleEvent::Limited => "limited",
                RuleEvent::ShadowLimited => "shadow_limited",
                RuleEvent::Fallback => "fallback",
            };
            *self.rules.entry((rule.host, name)).or_default() += 1;
        }
        fn store(&mut self, event: StoreEvent, count: u64) {
            *self.store.entry(format!("{event:?}").leak()).or_default() += count;
        }
        fn in_flight(&mut self, rule: &CompiledRule<usize>, change: i64) {
            *self.in_flight.entry(rule.host).or_default() += change;
        }
    }

    fn build(json: &str, store: &MemoryStore) -> Limiter<usize> {
        build_with(json, store, [7; 16])
    }

    fn build_with(json: &str, store: &MemoryStore, entropy: [u8; 16]) -> Limiter<usize> {
        let mut next = 0;
        Limiter::prepare(Config::parse(json.as_bytes()).unwrap(), store, entropy, |_| {
            next += 1;
            next - 1
        })
        .unwrap()
    }

    /// A request whose headers are given by name.
    fn request(limiter: &Limiter<usize>, headers: &[(&str, &str)]) -> StaticRequest {
        let values = limiter
            .header_names()
            .iter()
            .map(|name| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_bytes().to_vec()))
            .collect();
        StaticRequest { headers: values, remote_address: Some(b"10.0.0.1:5555".to_vec()), ..Default::default() }
    }

    fn admitted(
        limiter: &Limiter<usize>,
        store: &MemoryStore,
        now: Nanos,
        headers: &[(&str, &str)],
        tally: &mut Tally,
    ) -> bool {
        limiter.check(store, now, &mut request(limiter, headers), tally).0.allowed()
    }

    const PER_KEY: &str = r#"{"rules": [{"name": "per-key", "limit": 3, "period": "1h",
        "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "k"}}]}], "max_keys": 64}"#;

    #[test]
    fn each_key_gets_exactly_its_limit() {
        let store = MemoryStore::default();
        let limiter = build(PER_KEY, &store);
        let mut tally = Tally::default();
        for key in ["a", "b", "c"] {
            let ok = (0..10).filter(|_| admitted(&limiter, &store, T0, &[("x-api-key", key)], &mut tally)).count();
            assert_eq!(ok, 3, "key {key}");
        }
        assert_eq!(tally.rules[&(0, "allowed")], 9);
        assert_eq!(tally.rules[&(0, "limited")], 21);
    }

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

    #[test]
    fn the_longest_key_fits() {
        let name = "n".repeat(64);
        let json = format!(r#"{{"rules": [{{"name": "{name}", "limit": 1, "period": "1s", "max_keys": 4}}]}}"#);
        let store = MemoryStore::default();
        let limiter = build(&json, &store);
        let mut key = Key::default();
        let most_groups = (crate::config::MAX_MAX_KEYS / 4 - 1) as u32;
        assert_eq!(limiter.rules()[0].write_key(Bucket::Main, most_groups, &mut key), Ok(()));
        assert_eq!(key.as_str(), format!("fg:{name}:{most_groups}"));
    }

    #[test]
    fn a_request_without_the_header_skips_the_rule() {
        let store = MemoryStore::default();
        let limiter = build(PER_KEY, &store);
        let mut tally = Tally::default();
        for _ in 0..10 {
            let verdict = limiter.check(&store, T0, &mut request(&limiter, &[]), &mut tally).0;
            assert!(verdict.allowed());
            assert_eq!(verdict.report, None);
        }
    }

    const TWO_RULES: &str = r#"{"rules": [
        {"name": "global", "limit": 10, "period": "1h"},
        {"name": "per-key", "limit": 2, "period": "1h",
         "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "k"}}]}]}"#;

    #[test]
    fn a_request_denied_by_a_later_rule_does_not_consume_from_earlier_ones() {
        let store = MemoryStore::default();
        let limiter = build(TWO_RULES, &store);
        let mut tally = Tally::default();
        // Key "a" may pass twice; its 8 denied requests must not drain "global".
        let a = (0..10).filter(|_| admitted(&limiter, &store, T0, &[("x-api-key", "a")], &mut tally)).count();
        assert_eq!(a, 2);
        // So 8 more units of the global 10 are left for other keys.
        let others =
            (0..20).filter(|i| admitted(&limiter, &store, T0, &[("x-api-key", &format!("k{i}"))], &mut tally)).count();
        assert_eq!(others, 8);
        assert_eq!(tally.rules[&(1, "limited")], 8);
        assert_eq!(tally.rules[&(0, "limited")], 12);
    }

    #[test]
    fn the_report_is_the_most_restrictive_rule() {
        let store = MemoryStore::default();
        let limiter = build(TWO_RULES, &store);
        let mut tally = Tally::default();
        let verdict = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally).0;
        let report = verdict.report.unwrap();
        assert_eq!(report.rule, 1);
        assert_eq!(report.decision.remaining, 1);
        let verdict = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally).0;
        verdict.report.unwrap();
        let denied = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally).0;
        assert!(!denied.allowed());
        let report = denied.report.unwrap();
        assert_eq!(report.rule, 1);
        assert_eq!(report.decision.retry_after(), SECOND.times(1800), "2 per hour: one every 30 minutes");
    }

    #[test]
    fn shadow_mode_lets_everything_through_and_counts() {
        let json = PER_KEY.replace(r#""limit": 3"#, r#""limit": 3, "shadow_mode": true"#);
        let store = MemoryStore::default();
        let limiter = build(&json, &store);
        let mut tally = Tally::default();
        for _ in 0..10 {
            let verdict = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally).0;
            assert!(verdict.allowed());
        }
        assert_eq!(tally.rules[&(0, "allowed")], 3);
        assert_eq!(tally.rules[&(0, "shadow_limited")], 7);
        let verdict = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally).0;
        assert_eq!(verdict.shadow_limited, Some(0), "the verdict names the rule");
        // Global shadow mode does the same.
        let json = PER_KEY.replace(r#""max_keys": 64"#, r#""max_keys": 64, "shadow_mode": true"#);
        let store = MemoryStore::default();
        let limiter = build(&json, &store);
        let all = (0..10).filter(|_| admitted(&limiter, &store, T0, &[("x-api-key", "a")], &mut tally)).count();
        assert_eq!(all, 10);
    }

    #[test]
    fn a_shadow_denial_is_counted_even_when_a_later_rule_denies() {
        let json = r#"{"rules": [
            {"name": "watch", "limit": 1, "period": "1h", "shadow_mode": true},
            {"name": "enforce", "limit": 1, "period": "1h"}]}"#;
        let store = MemoryStore::default();
        let limiter = build(json, &store);
        let mut tally = Tally::default();
        assert!(admitted(&limiter, &store, T0, &[], &mut tally));
        let verdict = limiter.check(&store, T0, &mut request(&limiter, &[]), &mut tally).0;
        assert!(!verdict.allowed());
        assert_eq!(verdict.shadow_limited, Some(0));
        assert_eq!(tally.rules[&(0, "shadow_limited")], 1);
        assert_eq!(tally.rules[&(1, "limited")], 1);
    }

    #[test]
    fn refill_over_time() {
        let json = PER_KEY.replace(r#""period": "1h""#, r#""period": "3s""#);
        let store = MemoryStore::default();
        let limiter = build(&json, &store);
        let mut tally = Tally::default();
        let burst = (0..5).filter(|_| admitted(&limiter, &store, T0, &[("x-api-key", "a")], &mut tally)).count();
        assert_eq!(burst, 3);
        assert!(!admitted(&limiter, &store, T0 + SECOND - Nanos(1), &[("x-api-key", "a")], &mut tally));
        assert!(admitted(&limiter, &store, T0 + SECOND, &[("x-api-key", "a")], &mut tally));
        assert!(!admitted(&limiter, &store, T0 + SECOND, &[("x-api-key", "a")], &mut tally));
    }

    #[test]
    fn cost_from_header_is_bounded() {
        let json = r#"{"rules": [{"name": "tokens", "limit": 100, "period": "1h", "cost": 2,
            "cost_from_header": {"header_name": "x-cost", "max": 40}}]}"#;
        let store = MemoryStore::default();
        let limiter = build(json, &store);
        let mut tally = Tally::default();
        let mut remaining = |headers: &[(&str, &str)]| {
            limiter.check(&store, T0, &mut request(&limiter, headers), &mut tally).0.report.unwrap().decision.remaining
        };
        assert_eq!(remaining(&[("x-cost", "10")]), 90);
        assert_eq!(remaining(&[("x-cost", "1000000")]), 50, "clamped to max 40");
        assert_eq!(remaining(&[("x-cost", "0")]), 49, "at least 1");
        assert_eq!(remaining(&[("x-cost", "ten")]), 47, "unreadable: the default cost");
        assert_eq!(remaining(&[("x-cost", "99999999999999999999999")]), 7, "too large for a number: the max");
        assert_eq!(remaining(&[]), 5, "absent: the default cost");
    }

    /// Rivals on other workers take units between our read and our write; the
    /// loop must re-decide on what they left, so the total admitted by us and
    /// them together never exceeds the limit.
    #[test]
    fn conflicting_writers_never_over_admit() {
        let json = r#"{"rules": [{"name": "hot", "limit": 5, "period": "1h"}]}"#;
        let store = MemoryStore::default();
        let limiter = build(json, &store);
        let rule = &limiter.rules()[0].rule;
        let fp = fingerprint(limiter.hash_key, "hot", &rule.descriptors, &mut request(&limiter, &[])).unwrap();
        let table = rule.table.clone();
        let rival_admitted = Rc::new(Cell::new(0));
        let counted = Rc::clone(&rival_admitted);
        store.interfere(100, move |_, group: &[u8]| match table.decide(group.to_vec(), fp, T0, 1) {
            Step::Write(next, _) => {
                counted.set(counted.get() + 1);
                Some(next)
            }
            Step::Keep(_) => None,
        });
        let mut tally = Tally::default();
        let ours = (0..20).filter(|_| admitted(&limiter, &store, T0, &[], &mut tally)).count();
        assert_eq!(ours + rival_admitted.get(), 5, "ours {ours}, rivals {}", rival_admitted.get());
        assert!(tally.store["CasRetries"] > 0);
    }

    #[test]
    fn exhausted_retries_follow_the_failure_mode() {
        for (mode, expect_allowed) in [("allow", true), ("deny", false)] {
            let json = format!(
                r#"{{"rules": [{{"name": "hot", "limit": 5, "period": "1h"}}], "max_cas_retries": 2, "failure_mode": "{mode}"}}"#
            );
            let store = MemoryStore::default();
            let limiter = build(&json, &store);
            store.interfere(3, |_, _: &[u8]| None);
            let mut tally = Tally::default();
            let verdict = limiter.check(&store, T0, &mut request(&limiter, &[]), &mut tally).0;
            assert_eq!(verdict.allowed(), expect_allowed, "{mode}");
            assert!(verdict.failed);
            assert_eq!(tally.store["RetriesExhausted"], 1);
            assert_eq!(tally.store["CasRetries"], 2);
        }
    }

    #[test]
    fn a_full_table_follows_the_failure_mode_and_never_evicts_live_buckets() {
        let json = r#"{"rules": [{"name": "r", "limit": 1, "period": "1h", "max_keys": 4,
            "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "k"}}]}],
            "failure_mode": "deny"}"#;
        let store = MemoryStore::default();
        let limiter = build(json, &store);
        let mut tally = Tally::default();
        for key in ["a", "b", "c", "d"] {
            assert!(admitted(&limiter, &store, T0, &[("x-api-key", key)], &mut tally));
        }
        assert!(!admitted(&limiter, &store, T0, &[("x-api-key", "e")], &mut tally));
        assert_eq!(tally.store["TableFull"], 1);
        // "a" is still limited: its bucket was not handed to "e".
        assert!(!admitted(&limiter, &store, T0, &[("x-api-key", "a")], &mut tally));
    }

    #[test]
    fn a_missing_group_is_a_store_error_not_a_racy_create() {
        let store = MemoryStore::default();
        let limiter = build(PER_KEY, &store);
        let empty = MemoryStore::default();
        let mut tally = Tally::default();
        let verdict = limiter.check(&empty, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally).0;
        assert!(verdict.allowed() && verdict.failed);
        assert_eq!(tally.store["StoreErrors"], 1);
        assert!(empty.is_empty(), "nothing was created on the request path");
    }

    const SHAPED: &str = r#"{"rules": [
        {"name": "paced", "algorithm": "shaper", "limit": 1, "period": "1s", "max_delay": "2s"},
        {"name": "per-key", "limit": 1, "period": "1h",
         "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "k"}}]}]}"#;

    #[test]
    fn a_shaper_delays_and_a_later_denial_gives_its_place_back() {
        let store = MemoryStore::default();
        let limiter = build(SHAPED, &store);
        let mut tally = Tally::default();
        let mut check =
            |key: &str| limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", key)]), &mut tally);
        assert_eq!(check("a").0.admission, Admission::Now);
        let (second, permit) = check("b");
        assert_eq!(second.admission, Admission::Delayed(SECOND));
        assert!(!permit.is_empty());
        // "a" is denied by the per-key rule: its place in the pacer is freed,
        // so "c" waits 2 s (behind "b"), not 3 s.
        assert!(!check("a").0.allowed());
        assert_eq!(check("c").0.admission, Admission::Delayed(SECOND.times(2)));
        assert!(!check("d").0.allowed(), "3 s would exceed max_delay");
        assert_eq!(tally.rules[&(0, "delayed")], 2);
    }

    #[test]
    fn undoing_a_permit_frees_its_units_and_done_touches_only_rules_that_hold() {
        let store = MemoryStore::default();
        let limiter = build(PER_KEY, &store);
        let mut tally = Tally::default();
        let key = "fg:per-key:".to_string();
        let (verdict, permit) = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally);
        assert!(verdict.allowed());
        let Some(held) = permit.held.first().copied() else { panic!("the permit holds the rule's units") };
        let group = format!("{key}{}", held.group);
        let before = store.get(&group).unwrap();
        limiter.release(&store, T0, permit, Release::Done, &mut tally);
        assert_eq!(store.get(&group).unwrap(), before, "a token bucket keeps its units when a request ends");
        let (_, permit) = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally);
        limiter.release(&store, T0, permit, Release::Undo, &mut tally);
        let ok = (0..5).filter(|_| admitted(&limiter, &store, T0, &[("x-api-key", "a")], &mut tally)).count();
        assert_eq!(ok, 2, "3 per hour: one kept by the ended request, one given back by the undo");
    }

    const GLOBAL: &str = r#"{"rules": [{"name": "fleet", "scope": "global",
        "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "api_key"}}],
        "fallback": {"limit": 2, "period": "1h"}}],
        "global": {"cluster": "quota", "domain": "edge"}, "max_keys": 64}"#;

    fn lease(id: u64, granted: u64) -> LeaseGrant {
        LeaseGrant {
            lease: id,
            granted,
            valid: SECOND.times(10),
            limit: 100,
            window: SECOND.times(60),
            unleased: 50,
            reset: SECOND.times(30),
        }
    }

    #[test]
    fn an_empty_pool_is_pending_and_claims_one_refresh_then_spends_the_grant() {
        let store = MemoryStore::default();
        let limiter = build(GLOBAL, &store);
        let mut tally = Tally::default();
        let alice = &[("x-api-key", "alice")];
        let (verdict, permit) = limiter.check(&store, T0, &mut request(&limiter, alice), &mut tally);
        assert_eq!(verdict.admission, Admission::Pending);
        assert!(permit.is_empty());
        let [refresh] = verdict.refreshes.as_slice() else { panic!("one claim: {:?}", verdict.refreshes) };
        assert_eq!(refresh.descriptor, vec![("api_key".to_string(), "alice".to_string())]);
        // A second request before the answer waits too, without a second claim.
        let (again, _) = limiter.check(&store, T0 + Nanos(1), &mut request(&limiter, alice), &mut tally);
        assert_eq!((again.admission, again.refreshes.len()), (Admission::Pending, 0));
        assert_eq!(
            limiter.apply_lease(&store, T0, refresh, &lease(refresh.lease, 3), &mut tally),
            Some(Applied::Replaced(Leftover::default()))
        );
        let ok = (0..5).filter(|_| admitted(&limiter, &store, T0 + Nanos(2), alice, &mut tally)).count();
        assert_eq!(ok, 3, "exactly the granted tokens, then pending again");
        assert_eq!(tally.rules[&(0, "allowed")], 3);
    }

    #[test]
    fn a_failing_service_switches_the_rule_to_its_local_fallback_and_back() {
        let store = MemoryStore::default();
        let limiter = build(GLOBAL, &store);
        let mut tally = Tally::default();
        let alice = &[("x-api-key", "alice")];
        limiter.record_callout(&store, T0, 0, false);
        assert!(limiter.rules()[0].in_fallback());
        // Another worker's limiter learns it from shared data.
        let other = build(GLOBAL, &store);
        assert!(other.rules()[0].in_fallback());
        let ok = (0..5).filter(|_| admitted(&other, &store, T0, alice, &mut tally)).count();
        assert_eq!(ok, 2, "the local fall-back limit");
        assert_eq!(tally.rules[&(0, "fallback")], 5);
        // One worker probes after the backoff; a success returns to global mode.
        assert!(limiter.due_probes(&store, T0).is_empty());
        assert_eq!(limiter.due_probes(&store, T0 + SECOND), vec![0]);
        assert!(other.due_probes(&store, T0 + SECOND).is_empty(), "one probe at a time");
        limiter.record_callout(&store, T0 + SECOND, 0, true);
        other.read_modes(&store);
        assert!(!other.rules()[0].in_fallback());
    }

    #[test]
    fn a_request_that_waited_out_its_refresh_is_denied_unless_the_service_fails() {
        let store = MemoryStore::default();
        let limiter = build(GLOBAL, &store);
        let mut tally = Tally::default();
        let waited_out = |tally: &mut Tally| {
            limiter.check_waited(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), true, tally).0
        };
        let verdict = waited_out(&mut tally);
        assert_eq!(verdict.admission, Admission::Denied { retry_after: Nanos::from_millis(300) });
        limiter.record_callout(&store, T0, 0, false);
        let verdict = waited_out(&mut tally);
        assert!(verdict.allowed(), "the local fall-back decides: {verdict:?}");
        assert_eq!(tally.rules[&(0, "fallback")], 1);
    }

    #[test]
    fn check_mode_asks_once_for_every_descriptor_and_settles_on_the_answer() {
        let json = GLOBAL.replace(r#""scope": "global","#, r#""scope": "global", "mode": "check","#);
        let store = MemoryStore::default();
        let limiter = build(&json, &store);
        let mut tally = Tally::default();
        let (verdict, permit) = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", "a")]), &mut tally);
        assert_eq!(verdict.admission, Admission::Pending);
        assert_eq!(verdict.checks.len(), 1);
        let denied = [CheckAnswer { decision: Decision::deny(0, SECOND, SECOND.times(5)), quota: None }];
        let (settled, _) = limiter.settle(&store, T0, verdict.clone(), permit, Some(&denied), &mut tally);
        assert_eq!(settled.admission, Admission::Denied { retry_after: SECOND.times(5) });
        let (settled, _) = limiter.settle(&store, T0, verdict, Permit::default(), None, &mut tally);
        assert!(settled.allowed(), "no answer: the local fall-back decides");
        assert_eq!(tally.rules[&(0, "fallback")], 1);
    }

    #[test]
    fn concurrency_holds_until_done_and_reports_what_is_in_flight() {
        let json = r#"{"rules": [
            {"name": "rate", "limit": 100, "period": "1h"},
            {"name": "slots", "algorithm": "concurrency", "limit": 2, "slot_ttl": "30s"}],
            "response": {"status": 503}}"#;
        let store = MemoryStore::default();
        let limiter = build(json, &store);
        assert_eq!(limiter.response().status, 503);
        let mut tally = Tally::default();
        let check = |now: Nanos, tally: &mut Tally| limiter.check(&store, now, &mut request(&limiter, &[]), tally);
        let (first, a) = check(T0, &mut tally);
        let (_, b) = check(T0, &mut tally);
        let (denied, empty) = check(T0, &mut tally);
        assert!(first.allowed() && !denied.allowed() && empty.is_empty());
        let report = denied.report.unwrap();
        assert_eq!(report.rule, 1);
        assert_eq!(report.decision.retry_after(), SECOND.times(40), "until the slots' epoch is reclaimed");
        assert_eq!(tally.in_flight.get(&1), Some(&2));
        assert_eq!(tally.in_flight.get(&0), None, "a token bucket holds nothing in flight");
        // A request that ends frees its slot; the token bucket keeps its token.
        limiter.release(&store, T0, a, Release::Done, &mut tally);
        assert_eq!(tally.in_flight[&1], 1);
        let (again, c) = check(T0 + SECOND, &mut tally);
        assert!(again.allowed());
        assert_eq!(again.report.unwrap().decision.remaining, 0);
        // b and c are never released (their VM crashed): both are reclaimed
        // 40 s after their epoch began, and leave the gauge then.
        drop((b, c));
        assert!(!check(T0 + SECOND.times(40) - Nanos(1), &mut tally).0.allowed());
        let (reclaimed, _) = check(T0 + SECOND.times(40), &mut tally);
        assert!(reclaimed.allowed());
        assert_eq!(tally.in_flight[&1], 1, "two reclaimed, one taken");
        assert_eq!(tally.rules[&(0, "allowed")], 4);
        assert_eq!(tally.rules[&(1, "limited")], 2);
    }

    #[test]
    fn unspent_tokens_are_taken_once_when_a_configuration_goes_away() {
        let store = MemoryStore::default();
        let limiter = build(GLOBAL, &store);
        let mut tally = Tally::default();
        for key in ["alice", "bob"] {
            let (verdict, _) = limiter.check(&store, T0, &mut request(&limiter, &[("x-api-key", key)]), &mut tally);
            let refresh = &verdict.refreshes[0];
            limiter.apply_lease(&store, T0, refresh, &lease(refresh.lease, 10), &mut tally);
        }
        assert!(admitted(&limiter, &store, T0, &[("x-api-key", "alice")], &mut tally));
        let mut unspent = limiter.take_unspent(&store, T0);
        unspent.sort_by_key(|(_, tokens)| *tokens);
        assert_eq!(unspent.iter().map(|(_, t)| *t).collect::<Vec<_>>(), vec![9, 10]);
        let other_worker = build(GLOBAL, &store);
        assert!(other_worker.take_unspent(&store, T0).is_empty(), "taken once");
        assert!(limiter.take_unspent(&store, T0 + SECOND.times(11)).is_empty());
    }

    #[test]
    fn held_tokens_of_a_replaced_lease_are_given_back_with_the_current_ones() {
        let store = MemoryStore::default();
        let limiter = build(GLOBAL, &store);
        let mut tally = Tally::default();
        let alice = [("x-api-key", "alice")];
        let (verdict, _) = limiter.check(&store, T0, &mut request(&limiter, &alice), &mut tally);
        let first = verdict.refreshes[0].clone();
        limiter.apply_lease(&store, T0, &first, &lease(first.lease, 10), &mut tally);
        // Spend until the pool is due (a few tokens before it runs dry), and
        // replace the lease while it still holds some.
        let mut now = T0;
        let second = loop {
            now = now + Nanos::from_millis(100);
            let (verdict, _) = limiter.check(&store, now, &mut request(&limiter, &alice), &mut tally);
            assert!(verdict.allowed());
            if let Some(refresh) = verdict.refreshes.first() {
                break refresh.clone();
            }
        };
        let applied = limiter.apply_lease(&store, now, &second, &lease(second.lease, 10), &mut tally);
        assert_eq!(applied, Some(Applied::Replaced(Leftover::default())), "the old lease's tokens are kept");
        let mut unspent = limiter.take_unspent(&store, now);
        unspent.sort_by_key(|(_, tokens)| *tokens);
        let [(held, kept), (current, 10)] = unspent.as_slice() else { panic!("{unspent:?}") };
        assert_eq!((*held, *current), (first.lease, second.lease));
        assert!((1..10).contains(kept), "{kept}");
        assert!(limiter.take_unspent(&store, now).is_empty(), "taken once");
    }

    /// A shaper's delay and a check-mode rule on one request: the delay
    /// survives the wait for the service's answer, and every rule is counted
    /// once.
    #[test]
    fn a_delay_and_a_check_on_one_request_settle_into_a_delay() {
        let json = r#"{"rules": [
            {"name": "paced", "algorithm": "shaper", "limit": 1, "period": "1s", "max_delay": "2s"},
            {"name": "fleet", "scope": "global", "mode": "check",
             "descriptors": [{"generic_key": {"descriptor_value": "all"}}],
             "fallback": {"limit": 5, "period": "1h"}}],
            "global": {"cluster": "quota", "domain": "edge"}}"#;
        let store = MemoryStore::default();
        let limiter = build(json, &store);
        let mut tally = Tally::default();
        let allowed = [CheckAnswer { decision: Decision::admit(9, Nanos::ZERO), quota: None }];
        let ask = |tally: &mut Tally, answers: Option<&[CheckAnswer]>| {
            let (verdict, permit) = limiter.check(&store, T0, &mut request(&limiter, &[]), tally);
            assert_eq!(verdict.admission, Admission::Pending);
            limiter.settle(&store, T0, verdict, permit, answers, tally).0.admission
        };
        assert_eq!(ask(&mut tally, Some(&allowed)), Admission::Now);
        assert_eq!(ask(&mut tally, Some(&allowed)), Admission::Delayed(SECOND));
        // No answer: the local fall-back decides, and is counted once.
        assert_eq!(ask(&mut tally, None), Admission::Delayed(SECOND.times(2)));
        assert_eq!(tally.rules[&(0, "allowed")], 3);
        assert_eq!(tally.rules[&(0, "delayed")], 2);
        assert_eq!(tally.rules[&(1, "allowed")], 3);
        assert_eq!(tally.rules[&(1, "fallback")], 1);
    }
}
