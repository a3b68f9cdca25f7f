//! One simulated fleet: Envoys of two workers each, every key's requests
//! spread over them by its balancer, every (Envoy, key) pair a real
//! `LeasePool` kept in the Envoy's real bucket table (`core::table::Table`,
//! `max_keys` pools, an idle pool's slot reused when another key needs it),
//! every worker batching its calls by the filter's rule ([`Batcher`]), and
//! the real service decisions behind a network of random delays; beside it,
//! the same requests decided in check mode (one call each) by the same
//! service code on a store of its own. All on a virtual clock, driven by
//! one event queue.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;

use floodgate_core::algorithm::Algorithm;
use floodgate_core::global::calls::{read_leases, Refresh};
use floodgate_core::global::settings::{QuotaService, POOL_TAG};
use floodgate_core::global::REFILL_TICK;
use floodgate_core::lease::overshoot::{notice_key, worst_case_over, NearSet, Overshoot};
use floodgate_core::lease::pool::{Applied, Claim, LeasePool, PoolState, Spend};
use floodgate_core::rng::Rng;
use floodgate_core::store::Step;
use floodgate_core::table::{Table, WAYS};
use floodgate_core::time::{Nanos, SECOND};
use floodgate_protocol::LeaseResponse;

use crate::calls::{Batcher, Timing};
use crate::keys::{Envoys, Key, Shape, DOMAIN};
use crate::rng::{self, Map, Network, Traffic};
use crate::service::SimulatedService;
use crate::stats::Tally;

/// When the measured span starts: a whole minute since the epoch, so that
/// a measured minute is exactly one per-minute window.
const MEASURE_FROM: Nanos = Nanos::from_secs(1_700_000_040);

/// When every run's measured span starts.
pub fn measure_from() -> Nanos {
    MEASURE_FROM
}

/// The service's lease lifetime (`--lease-ttl`'s default).
pub const LEASE_TTL: Nanos = SECOND;

/// Workers per Envoy (`--concurrency 2`).
pub const WORKERS: u32 = 2;

/// How long after an answer is applied the requests waiting for it on the
/// worker that got it are decided again (the filter reads the clock again
/// for them).
const RESUME_AFTER: Nanos = Nanos::from_nanos(1_000);

/// The filter's default table size per rule (`max_keys`).
pub const MAX_KEYS: u32 = floodgate_core::config::DEFAULT_MAX_KEYS;

/// What to simulate.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// A label for the report.
    pub name: String,
    /// Envoys in the fleet.
    pub envoys: u32,
    /// Keys the fleet has (what the sampled `keys` stand for).
    pub total_keys: u64,
    /// The simulated keys.
    pub keys: Vec<Key>,
    /// Whether every request of every key is simulated (no weights, no stand-ins).
    pub exact: bool,
    /// Groups of each Envoy's table: `MAX_KEYS / WAYS`, scaled by the
    /// share of the fleet's pairs simulated when keys are sampled.
    pub table_groups: u32,
    /// Traffic before the measurement starts.
    pub warmup: Nanos,
    /// The measured span.
    pub measure: Nanos,
    /// Traffic after it, in which the service restarts.
    pub after: Nanos,
    /// When (from the end of the measured span) the store is emptied.
    pub restart_at: Option<Nanos>,
    /// Everything random is drawn from it.
    pub seed: u64,
    /// Whether the service grants allowances to the leases that ask for
    /// them (as the filter does); false only to compare.
    pub allowances: bool,
    /// The rule's overshoot budget (`None`: strict, the default).
    pub overshoot: Option<Overshoot>,
    /// Also decide every request in check mode (the baseline).
    pub check_baseline: bool,
    /// Keep every claim and return for the calls model.
    pub record_items: bool,
    /// The network's delays.
    pub network: Network,
    /// The pools' settings (the filter's defaults unless a shape says otherwise).
    pub quota: QuotaService,
}

/// The filter's defaults for the quota service (timeout 300 ms, `max_wait`
/// 200 ms, `lease_horizon` 1 s).
pub fn default_quota() -> QuotaService {
    QuotaService {
        cluster: "quota".into(),
        authority: "quota".into(),
        domain: DOMAIN.into(),
        timeout: Nanos::from_millis(300),
        token: None,
        max_wait: Nanos::from_millis(200),
        lease_horizon: SECOND,
    }
}

/// A claim or a return as a worker queued it, for the calls model: when,
/// its timing (a return leaves within a round), and the real items it
/// stands for.
#[derive(Debug, Clone, Copy)]
pub struct Item {
    /// When it was queued.
    pub at: Nanos,
    /// When its call may and must leave (a return: `None`).
    pub timing: Option<Timing>,
    /// Real items it stands for (its key's `pair_weight`).
    pub weight: f64,
    /// The (Envoy, key) pair whose item it is: a pair's items stay
    /// together in the model (a return follows its own lease's answer).
    pub pair: u64,
}

/// The pair `(envoy, key)` as one number.
fn pair_id(envoy: u32, key: u32) -> u64 {
    (u64::from(envoy) << 32) | u64::from(key)
}

/// The calls a fleet made in its measured span, by size: `(leases or
/// returns carried, calls)`.
#[derive(Debug, Clone, Default)]
pub struct CallSizes {
    /// Lease calls by the leases they carried.
    pub lease: Map<usize, f64>,
    /// Return calls by the returns they carried.
    pub returns: Map<usize, f64>,
}

impl CallSizes {
    /// Lease calls and return calls.
    pub fn counts(&self) -> (f64, f64) {
        (self.lease.values().sum(), self.returns.values().sum())
    }

    /// Counts a call of `leases` (or of `returns`) `weight` times.
    pub fn add(&mut self, leases: usize, returns: usize, weight: f64) {
        if leases > 0 {
            *self.lease.entry(leases).or_default() += weight;
        }
        if returns > 0 {
            *self.returns.entry(returns).or_default() += weight;
        }
    }
}

/// What one simulated key did in the measured span (weighted).
#[derive(Debug, Clone, Copy)]
pub struct KeyCounts {
    /// Its real rate (requests a second, fleet-wide).
    pub rate: f64,
    /// How it is limited.
    pub shape: Shape,
    /// Requests.
    pub requests: f64,
    /// Leases its pools asked for.
    pub leases: f64,
    /// Units admitted in the windows that lie in the measured span.
    pub admitted: f64,
}

/// Requests decided in check mode beside the leases: the same arrivals,
/// one call each. Weighted by what each request stands for.
#[derive(Debug, Clone, Default)]
pub struct CheckOutcome {
    /// Requests, and those admitted.
    pub requests: f64,
    /// See [`CheckOutcome::requests`].
    pub admitted: f64,
    /// Store values written (an admitting bucket that changed).
    pub writes: f64,
    /// Each request's wait for its answer (every request waits), ms.
    pub waits: Tally,
    /// Fixed windows checked and over their limit (as simulated).
    pub windows_checked: u64,
    /// See [`CheckOutcome::windows_checked`].
    pub over: u64,
    /// Token buckets' spans over their own bound (`burst + rate × span`).
    pub over_bucket: u64,
    /// Keys limited below their demand: admitted, and what each window's
    /// arrivals could use.
    pub excess: (f64, f64),
}

/// A token bucket judged over spans: the most any span of each length
/// admitted, against the bucket's own bound (`burst + rate × span`) and
/// the bound of leased tokens (`burst + rate × (span + lease lifetime)`).
#[derive(Debug, Clone, Copy, Default)]
pub struct BucketSpans {
    /// Spans checked (one per bucket key and length).
    pub checked: u64,
    /// Of them, over the bucket's own bound.
    pub over_own: u64,
    /// Over the leased bound.
    pub over_leased: u64,
    /// The largest admitted ÷ own bound.
    pub worst_ratio: f64,
}

/// What a fleet did. Sums marked *weighted* count each simulated request
/// as its key's `request_weight` and each simulated pair's event as its
/// `pair_weight`; the others are as simulated.
#[derive(Debug, Clone, Default)]
pub struct FleetOutcome {
    /// The configuration's label.
    pub name: String,
    /// Envoys, and keys the fleet stands for.
    pub envoys: u32,
    /// See [`FleetConfig::total_keys`].
    pub total_keys: u64,
    /// Keys simulated.
    pub simulated_keys: usize,
    /// Whether every request of every key was simulated.
    pub exact: bool,
    /// Seconds measured.
    pub secs: f64,
    /// Requests, weighted.
    pub requests: f64,
    /// Requests simulated (unweighted), measured.
    pub sim_requests: u64,
    /// Requests that found their pool empty and waited, weighted.
    pub waited: f64,
    /// Of those, the ones whose pool held no live lease at all (a cold pair), weighted.
    pub waited_cold: f64,
    /// Waits of keys below their limit at a warm pair whose lease ran dry
    /// (not a cold pair, not an allowance's dry window, not a lease that
    /// went to the one request its pool had seen), weighted.
    pub waited_warm_under: f64,
    /// Waits of keys below their limit at a pair whose allowance's window
    /// ran dry, weighted.
    pub waited_dry_allowance: f64,
    /// Waits of keys below their limit at a pair whose live lease went to
    /// the one request it had seen, weighted.
    pub waited_after_one: f64,
    /// Requests that waited out `max_wait` and were denied, weighted.
    pub waited_out: f64,
    /// Requests denied, weighted.
    pub denied: f64,
    /// Requests admitted without a pool: the Envoy's table had no room for
    /// it (the rule's failure mode, `allow` by default, admits), weighted.
    pub table_full: f64,
    /// Pools whose slot went to another key while idle, weighted.
    pub evictions: f64,
    /// How long each wait lasted, ms, weighted.
    pub waits: Tally,
    /// Leases asked for (claims sent), weighted.
    pub leases: f64,
    /// Return items, weighted.
    pub return_items: f64,
    /// Lease calls and return calls by size, as simulated.
    pub sim_calls: CallSizes,
    /// Lease calls, return calls, lease items and return items, as simulated.
    pub sim_lease_calls: u64,
    /// See [`FleetOutcome::sim_lease_calls`].
    pub sim_return_calls: u64,
    /// See [`FleetOutcome::sim_lease_calls`].
    pub sim_leases: u64,
    /// See [`FleetOutcome::sim_lease_calls`].
    pub sim_returns: u64,
    /// Store values written by leases and returns, weighted.
    pub writes: f64,
    /// Body bytes of the items (requests and answers), weighted.
    pub item_bytes: f64,
    /// Body bytes of a lease call with no items, request and answer.
    pub lease_call_bytes: f64,
    /// Body bytes of a return call with no items, request and answer.
    pub return_call_bytes: f64,
    /// The store's keys and values, bytes, weighted: mean and peak over the measured seconds.
    pub state_mean: f64,
    /// See [`FleetOutcome::state_mean`].
    pub state_peak: f64,
    /// Of its entries, lease records, weighted mean.
    pub state_records_mean: f64,
    /// Fixed windows checked, and over their limit, before and after the restart (as simulated).
    pub windows_checked: u64,
    /// See [`FleetOutcome::windows_checked`].
    pub over_before: u64,
    /// See [`FleetOutcome::windows_checked`].
    pub over_after: u64,
    /// Windows over their limit after the restart, by when they started:
    /// spanning it or within 1 s of it, within 5, 10, 20 s, later.
    pub over_after_by: [u64; 5],
    /// Token buckets over spans of 1 s and 10 s before the restart.
    pub bucket_spans: [BucketSpans; 2],
    /// Keys limited below their demand, per shape (per-second, per-minute,
    /// bucket): admitted, and what each window's arrivals could use of the
    /// limit, over the measured windows, weighted.
    pub excess_by_shape: [(f64, f64); 3],
    /// Keys limited below their demand: admitted and limit over the
    /// measured windows, weighted.
    pub excess_admitted: f64,
    /// See [`FleetOutcome::excess_admitted`]: the limits, and what of them
    /// each window's arrivals could use (`min(arrivals, limit)`).
    pub excess_limit: f64,
    /// See [`FleetOutcome::excess_limit`].
    pub excess_usable: f64,
    /// Per simulated key, in its order: what it did in the measured span.
    pub per_key: Vec<KeyCounts>,
    /// Requests admitted without a lease (an overshoot budget), weighted.
    pub unleased: f64,
    /// Requests of keys whose demand is below their limit, and those of
    /// them that waited, weighted.
    pub requests_under: f64,
    /// See [`FleetOutcome::requests_under`].
    pub waited_under: f64,
    /// The most any window admitted over its limit (as simulated).
    pub max_over: u64,
    /// Windows that admitted more over their limit than the overshoot
    /// budget's worst case for the Envoys that admitted without a lease in
    /// them (`floodgate_core::lease::overshoot::worst_case_over`): must be 0.
    pub over_worst_case: u64,
    /// Tokens returned to the service, and tokens lost to expiry in pools, weighted.
    pub returned_tokens: f64,
    /// See [`FleetOutcome::returned_tokens`].
    pub expired_tokens: f64,
    /// Every claim and return queued (all spans), for the calls model.
    pub items: Vec<Item>,
    /// The check-mode baseline, if asked for.
    pub check: Option<CheckOutcome>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// The key's next request reaches the fleet.
    Request(u32),
    /// A worker's held calls may be due.
    Flush(u32),
    /// A call reaches the service.
    AtService(u64),
    /// Its answer reaches the worker.
    Answered(u64),
    /// A waiting request is looked at again.
    Retry(u64),
    /// A request's check reaches the service (check mode).
    Check(u32),
    /// The store is emptied.
    Restart,
    /// Once a second: expire the store, sample the state.
    Tick,
}

/// A refresh on its way: the filter's `Refresh`, and whose pool it is.
#[derive(Debug, Clone)]
struct Pending {
    envoy: u32,
    key: u32,
    refresh: Refresh,
}

/// Whose pool a refresh of a call in flight is: `(envoy, key)`.
type Owner = (u32, u32);

/// A return on its way: `(lease, tokens)` and the key it is of.
type Return = (u64, u64, u32);

#[derive(Debug, Clone, Copy)]
struct Waiter {
    envoy: u32,
    key: u32,
    worker: u32,
    since: Nanos,
    deadline: Nanos,
    /// Its worker's next refill tick, when it is looked at again.
    tick_at: Nanos,
}

#[derive(Debug)]
enum InFlight {
    Leases { worker: u32, owners: Vec<Owner>, refreshes: Vec<Refresh>, answer: Vec<u8> },
    Returns { body: Vec<u8>, weight: f64 },
}

/// What a spend on a pool found: the outcome, the claim it made, and the
/// pool before it.
type Spent = (Spend, Option<Claim>, PoolState);

struct Fleet<'a> {
    config: &'a FleetConfig,
    quota: QuotaService,
    pool: LeasePool,
    table: Table,
    service: SimulatedService,
    checks: SimulatedService,
    rng: Rng,
    /// Per key: its arrivals' own generator, so that every mode and
    /// balancer sees the same requests.
    arrivals: Vec<Rng>,
    queue: BinaryHeap<Reverse<(Nanos, u64, Event)>>,
    seq: u64,
    /// Per Envoy: its table's groups (absent: empty).
    tables: Vec<Map<u32, Vec<u8>>>,
    /// A group's bytes, reused from one update to the next.
    scratch: Vec<u8>,
    /// Per (Envoy, key): the waiting requests.
    pool_waiters: Map<(u32, u32), Vec<u64>>,
    workers: Vec<Batcher<Pending, Return>>,
    next_flush: Vec<Option<Nanos>>,
    waiters: Map<u64, Waiter>,
    calls: Map<u64, InFlight>,
    next_id: u64,
    /// Per key: admitted units per window (a fixed window's, a bucket's second).
    admitted: Vec<Map<u64, u64>>,
    /// Per bucket key: when each request was admitted (before the restart).
    bucket_times: Vec<Vec<Nanos>>,
    /// Per key: requests that arrived per window (its demand there).
    arrived: Vec<Map<u64, u64>>,
    /// Check mode: per key, admitted per window, and a bucket's admissions.
    check_admitted: Vec<Map<u64, u64>>,
    check_bucket_times: Vec<Vec<Nanos>>,
    /// Per Envoy: the near-limit notices it heard.
    near: Vec<NearSet>,
    /// Per key and window: the Envoys that admitted it without a lease.
    unleased_by: Vec<Map<u64, Vec<u32>>>,
    /// Per key: requests and leases asked for, measured, weighted.
    counts: Vec<(f64, f64)>,
    from: Nanos,
    until: Nanos,
    restart: Option<Nanos>,
    out: FleetOutcome,
    check: CheckOutcome,
    state_samples: u64,
    empty_lease: (usize, usize),
    empty_return: (usize, usize),
}

impl Fleet<'_> {
    fn at(&mut self, when: Nanos, event: Event) {
        self.seq += 1;
        self.queue.push(Reverse((when, self.seq, event)));
    }

    fn measuring(&self, now: Nanos) -> bool {
        self.from <= now && now < self.until
    }

    fn key(&self, key: u32) -> Option<&Key> {
        self.config.keys.get(key as usize)
    }

    fn request_weight(&self, key: u32) -> f64 {
        self.key(key).map_or(1.0, |k| k.request_weight)
    }

    fn pair_weight(&self, key: u32) -> f64 {
        self.key(key).map_or(1.0, |k| k.pair_weight)
    }

    fn delay(&mut self) -> Nanos {
        let network = self.config.network;
        self.rng.delay(network)
    }

    /// Runs `op` on the pool of `key` in `envoy`'s table as the filter's
    /// `spend_pool` and `apply_lease` do: its own entry, or a fresh one in
    /// a free or idle slot of its group, written back only if it changed.
    /// `None` when the group has no room (every entry live).
    fn on_pool<T>(
        &mut self,
        envoy: u32,
        key: u32,
        now: Nanos,
        op: impl FnOnce(PoolState) -> (T, PoolState),
    ) -> Option<T> {
        let fingerprint = self.key(key)?.fingerprint();
        let group = self.table.group_of(fingerprint);
        let pool = self.pool;
        let tables = self.tables.get_mut(envoy as usize)?;
        let mut stored = std::mem::take(&mut self.scratch);
        stored.clear();
        match tables.get(&group) {
            Some(bytes) => stored.extend_from_slice(bytes),
            None => stored.extend_from_slice(&self.table.empty_group()),
        }
        let step = self.table.update(stored, fingerprint, now, |slot| {
            let state = pool.decode(slot).unwrap_or_else(|| pool.fresh(now));
            let (value, after) = op(state);
            pool.encode(&after, slot);
            (value, after != state)
        });
        let slot = match step {
            Step::Write(mut bytes, slot) => {
                match tables.get_mut(&group) {
                    // The old bytes become the next update's scratch.
                    Some(old) => {
                        std::mem::swap(old, &mut bytes);
                        self.scratch = bytes;
                    }
                    None => {
                        tables.insert(group, bytes);
                    }
                }
                slot
            }
            Step::Keep(slot) => slot,
        }?;
        if slot.reused_idle && self.measuring(now) {
            self.out.evictions += self.pair_weight(key);
        }
        Some(slot.value)
    }

    /// Spends one unit of `key`'s pool at `envoy` (with the notices the
    /// Envoy heard), claiming a refresh if one is due.
    fn spend(&mut self, envoy: u32, key: u32, now: Nanos) -> Option<Spent> {
        let near_until = self.near_until(envoy, key, now);
        let pool = self.pool;
        self.on_pool(envoy, key, now, |state| {
            let mut before = state;
            if let Some(until) = near_until {
                before.without_lease.strict_until = before.without_lease.strict_until.max(until);
            }
            let (spend, claim, after) = pool.spend(before, now, 1);
            ((spend, claim, before), after)
        })
    }

    fn admit(&mut self, key: u32, now: Nanos) {
        let restart = self.restart;
        let Some(k) = self.key(key) else { return };
        let (period, bucket) = (k.shape.period(), k.shape == Shape::Bucket);
        if let Some(windows) = self.admitted.get_mut(key as usize) {
            *windows.entry(now / period).or_default() += 1;
        }
        if bucket && restart.is_none_or(|r| now < r) && now >= self.from {
            if let Some(times) = self.bucket_times.get_mut(key as usize) {
                times.push(now);
            }
        }
    }

    /// Until when `envoy` heard `key` is near its limit (as the limiter's
    /// `near_until`).
    fn near_until(&self, envoy: u32, key: u32, now: Nanos) -> Option<Nanos> {
        let near = self.near.get(envoy as usize).filter(|n| !n.is_quiet(now))?;
        near.until(notice_key(&self.key(key)?.descriptor), now)
    }

    /// A request admitted without a lease by `envoy`.
    fn admit_unleased(&mut self, envoy: u32, key: u32, now: Nanos) {
        self.admit(key, now);
        let Some(k) = self.key(key) else { return };
        let window = now / k.shape.period();
        if let Some(windows) = self.unleased_by.get_mut(key as usize) {
            let envoys = windows.entry(window).or_default();
            if !envoys.contains(&envoy) {
                envoys.push(envoy);
            }
        }
    }

    /// The Envoy a request of `key` goes to.
    fn envoy_for(&mut self, key: u32) -> u32 {
        let n = self.config.envoys;
        match self.key(key).map(|k| k.envoys) {
            Some(Envoys::One(envoy)) => envoy,
            Some(Envoys::Some { first, step, count }) => {
                let i = self.rng.below(u64::from(count)) as u32;
                ((u64::from(first) + u64::from(i) * u64::from(step)) % u64::from(n)) as u32
            }
            Some(Envoys::All) | None => self.rng.below(u64::from(n)) as u32,
        }
    }

    fn request(&mut self, key: u32, now: Nanos) {
        let end = self.until + self.config.after;
        let Some(k) = self.key(key) else { return };
        let (rate, period, under) = (k.rate, k.shape.period(), !k.over);
        if let Some(arrivals) = self.arrivals.get_mut(key as usize) {
            let next = now + arrivals.gap(rate);
            if next < end {
                self.at(next, Event::Request(key));
            }
        }
        if let Some(windows) = self.arrived.get_mut(key as usize) {
            *windows.entry(now / period).or_default() += 1;
        }
        let envoy = self.envoy_for(key);
        let worker = envoy * WORKERS + self.rng.below(u64::from(WORKERS)) as u32;
        let measuring = self.measuring(now);
        let w = self.request_weight(key);
        if measuring {
            self.out.requests += w;
            self.out.sim_requests += 1;
            if under {
                self.out.requests_under += w;
            }
            if let Some(c) = self.counts.get_mut(key as usize) {
                c.0 += w;
            }
        }
        if self.config.check_baseline {
            let (there, back) = (self.delay(), self.delay());
            self.at(now + there, Event::Check(key));
            if measuring {
                self.check.requests += w;
                self.check.waits.add((there + back).as_millis_f64(), w);
            }
        }
        let Some((spend, claim, before)) = self.spend(envoy, key, now) else {
            // No room in the Envoy's table: the rule's failure mode (allow).
            if measuring {
                self.out.table_full += w;
            }
            self.admit(key, now);
            return;
        };
        match spend {
            Spend::Taken(_) => self.admit(key, now),
            Spend::Unleased(_) => {
                self.admit_unleased(envoy, key, now);
                if measuring {
                    self.out.unleased += w;
                }
            }
            Spend::Denied(_) => {
                if measuring {
                    self.out.denied += w;
                }
            }
            Spend::Empty => {
                if measuring {
                    self.classify_wait(key, &before, now, w);
                }
                // Decided again on every refill tick of its worker (a
                // lease ahead that starts, an allowance's next window,
                // another worker's answer; its wait's end), and at once
                // when its own worker applies an answer for its pool.
                let deadline = now + self.quota.max_wait;
                let id = self.next_id;
                self.next_id += 1;
                let tick_at = next_tick(worker, now);
                self.waiters.insert(id, Waiter { envoy, key, worker, since: now, deadline, tick_at });
                self.pool_waiters.entry((envoy, key)).or_default().push(id);
                self.at(tick_at, Event::Retry(id));
            }
        }
        if let Some(claim) = claim {
            self.claimed(envoy, key, worker, claim, now);
        }
        self.maybe_send(worker, now);
    }

    /// Counts a wait by why the pool was empty.
    fn classify_wait(&mut self, key: u32, before: &PoolState, now: Nanos, w: f64) {
        let over = self.key(key).is_some_and(|k| k.over);
        self.out.waited += w;
        if !over {
            self.out.waited_under += w;
        }
        // No lease yet, or its last one (and what it held) is over.
        let cold = before.lease.id == 0 || (now >= before.lease_end() && now >= before.held.until);
        if cold {
            self.out.waited_cold += w;
        } else if over {
            // Demand above the limit: pools run dry by design.
        } else if before.allowance.per_window > 0 {
            self.out.waited_dry_allowance += w;
        } else if before.rate.spent <= 1 {
            // Its lease went to the one request the pool had seen, and no
            // second was claimed (`PLENTY`).
            self.out.waited_after_one += w;
        } else {
            self.out.waited_warm_under += w;
        }
    }

    fn claimed(&mut self, envoy: u32, key: u32, worker: u32, claim: Claim, now: Nanos) {
        let lease = self.next_id;
        self.next_id += 1;
        let weight = self.pair_weight(key);
        if self.measuring(now) {
            self.out.leases += weight;
            if let Some(c) = self.counts.get_mut(key as usize) {
                c.1 += weight;
            }
        }
        let timing = Timing { not_before: claim.not_before, send_by: claim.send_by };
        if self.config.record_items {
            self.out.items.push(Item { at: now, timing: Some(timing), weight, pair: pair_id(envoy, key) });
        }
        let descriptor = self.key(key).map(|k| k.descriptor.clone()).unwrap_or_default();
        let fingerprint = self.key(key).map_or(0, Key::fingerprint);
        let group = self.table.group_of(fingerprint);
        let refresh = Refresh { rule: 0, group, fingerprint, claim, sent: claim.started, lease, descriptor };
        if let Some(w) = self.workers.get_mut(worker as usize) {
            w.refresh(timing, Pending { envoy, key, refresh }, now);
        }
        self.schedule_flush(worker);
    }

    /// Queues a return as `Callouts::give_back` does (`lease` 0: nothing;
    /// no tokens: an allowance's later windows are freed).
    fn give_back(&mut self, worker: u32, envoy: u32, key: u32, lease: u64, tokens: u64, now: Nanos) {
        if lease == 0 {
            return;
        }
        let weight = self.pair_weight(key);
        if self.measuring(now) {
            self.out.return_items += weight;
        }
        if self.config.record_items {
            self.out.items.push(Item { at: now, timing: None, weight, pair: pair_id(envoy, key) });
        }
        if let Some(w) = self.workers.get_mut(worker as usize) {
            w.give_back((lease, tokens, key), now);
        }
        self.schedule_flush(worker);
    }

    /// A flush at the worker's `hold_until`, unless one comes sooner.
    fn schedule_flush(&mut self, worker: u32) {
        let Some(until) = self.workers.get(worker as usize).and_then(Batcher::hold_until) else { return };
        let Some(next) = self.next_flush.get_mut(worker as usize) else { return };
        if next.is_none_or(|at| until < at) {
            *next = Some(until);
            self.at(until, Event::Flush(worker));
        }
    }

    fn flush(&mut self, worker: u32, now: Nanos) {
        if let Some(next) = self.next_flush.get_mut(worker as usize) {
            if *next == Some(now) {
                *next = None;
            }
        }
        self.maybe_send(worker, now);
    }

    /// Sends what the worker must send at `now`, as `Callouts::take_outgoing`.
    fn maybe_send(&mut self, worker: u32, now: Nanos) {
        let Some(w) = self.workers.get_mut(worker as usize) else { return };
        let out = w.take_outgoing(now);
        self.schedule_flush(worker);
        let measuring = self.measuring(now);
        for pending in out.leases {
            let owners: Vec<Owner> = pending.iter().map(|p| (p.envoy, p.key)).collect();
            let refreshes: Vec<Refresh> = pending.into_iter().map(|p| Refresh { sent: now, ..p.refresh }).collect();
            let body = self.quota.lease_call(&refreshes).body;
            if measuring {
                self.out.sim_lease_calls += 1;
                self.out.sim_leases += owners.len() as u64;
                self.out.sim_calls.add(owners.len(), 0, 1.0);
                let mean_w = owners.iter().map(|&(_, k)| self.pair_weight(k)).sum::<f64>() / owners.len() as f64;
                let items = body.len().saturating_sub(self.empty_lease.0);
                self.out.item_bytes += items as f64 * mean_w;
            }
            let id = self.next_id;
            self.next_id += 1;
            self.calls.insert(id, InFlight::Leases { worker, owners, refreshes, answer: body });
            let delay = self.delay();
            self.at(now + delay, Event::AtService(id));
        }
        for chunk in out.returns {
            let items: Vec<(u64, u64)> = chunk.iter().map(|&(l, t, _)| (l, t)).collect();
            let body = self.quota.return_call(&items).body;
            let weight = chunk.iter().map(|&(_, _, k)| self.pair_weight(k)).sum::<f64>() / chunk.len() as f64;
            if measuring {
                self.out.sim_return_calls += 1;
                self.out.sim_returns += chunk.len() as u64;
                self.out.sim_calls.add(0, chunk.len(), 1.0);
                let items = body.len().saturating_sub(self.empty_return.0);
                self.out.item_bytes += items as f64 * weight;
            }
            let id = self.next_id;
            self.next_id += 1;
            self.calls.insert(id, InFlight::Returns { body, weight });
            let delay = self.delay();
            self.at(now + delay, Event::AtService(id));
        }
    }

    fn at_service(&mut self, id: u64, now: Nanos) -> Result<(), String> {
        let measuring = self.measuring(now);
        let keys = &self.config.keys;
        match self.calls.get_mut(&id) {
            Some(InFlight::Leases { owners, answer, .. }) => {
                let (body, writes) = self.service.lease(keys, answer, now)?;
                if measuring {
                    let weight = |k: u32| keys.get(k as usize).map_or(1.0, |k| k.pair_weight);
                    let mean_w = owners.iter().map(|&(_, k)| weight(k)).sum::<f64>() / owners.len().max(1) as f64;
                    let items = body.len().saturating_sub(self.empty_lease.1);
                    self.out.item_bytes += items as f64 * mean_w;
                    self.out.writes += writes.values as f64 * mean_w;
                }
                if let Some(InFlight::Leases { answer, .. }) = self.calls.get_mut(&id) {
                    *answer = body;
                }
                let delay = self.delay();
                self.at(now + delay, Event::Answered(id));
            }
            Some(InFlight::Returns { body, weight }) => {
                let weight = *weight;
                let (answer, returned, writes) = self.service.give_back(body, now)?;
                if measuring {
                    let items = answer.len().saturating_sub(self.empty_return.1);
                    self.out.item_bytes += items as f64 * weight;
                    self.out.returned_tokens += returned as f64 * weight;
                    self.out.writes += writes.values as f64 * weight;
                }
                self.calls.remove(&id);
            }
            None => {}
        }
        Ok(())
    }

    fn answered(&mut self, id: u64, now: Nanos) -> Result<(), String> {
        let Some(InFlight::Leases { worker, owners, refreshes, answer }) = self.calls.remove(&id) else {
            return Ok(());
        };
        let answer = read_leases(|| Some(200), &answer, &refreshes).map_err(|e| e.to_string())?;
        // The Envoy's near set, as `Limiter::heard_near` keeps it.
        if let Some(&(envoy, _)) = owners.first() {
            if let Some(near) = self.near.get_mut(envoy as usize) {
                for &(key, span) in &answer.near {
                    near.heard(key, now + span, now);
                }
            }
        }
        let measuring = self.measuring(now);
        let pool = self.pool;
        for ((&(envoy, key), refresh), grant) in owners.iter().zip(&refreshes).zip(answer.grants) {
            // The simulated service has no share of records to refuse for.
            let grant = grant.map_err(|why| format!("the service refused a lease: {why}"))?;
            let claim = (refresh.claim.started, refresh.sent);
            let applied =
                self.on_pool(envoy, key, now, |state| pool.apply(state, now, claim, &grant)).unwrap_or(Applied::Stale);
            match applied {
                Applied::Replaced(left) => {
                    if measuring {
                        self.out.expired_tokens += left.expired as f64 * self.pair_weight(key);
                    }
                    for (lease, tokens) in left.returns {
                        self.give_back(worker, envoy, key, lease, tokens, now);
                    }
                }
                // Tokens taken as a check have no record to go back to.
                Applied::Stale if grant.granted > 0 && !grant.checked => {
                    self.give_back(worker, envoy, key, grant.lease, grant.granted, now)
                }
                Applied::Stale | Applied::Duplicate | Applied::Reported => {}
            }
            // The waiting requests of the worker that got the answer go on
            // just after it is applied (`finish_due`); the other worker's
            // on its next refill tick.
            let waiting = self.pool_waiters.remove(&(envoy, key)).unwrap_or_default();
            for waiter in waiting {
                if self.waiters.get(&waiter).is_some_and(|w| w.worker == worker) {
                    self.at(now + RESUME_AFTER, Event::Retry(waiter));
                }
            }
        }
        self.maybe_send(worker, now);
        Ok(())
    }

    /// A waiting request decided again: on its worker's refill tick (past
    /// its deadline: waited out), or when its worker applied an answer for
    /// its pool.
    fn retry(&mut self, id: u64, now: Nanos) {
        let Some(waiter) = self.waiters.get(&id).copied() else { return };
        if now == waiter.tick_at {
            let tick_at = next_tick(waiter.worker, now);
            if let Some(w) = self.waiters.get_mut(&id) {
                w.tick_at = tick_at;
            }
            self.at(tick_at, Event::Retry(id));
        }
        let over = now >= waiter.deadline;
        let measuring = self.measuring(waiter.since);
        let w = self.request_weight(waiter.key);
        let spent = self.spend(waiter.envoy, waiter.key, now);
        let (done, claim) = match spent {
            None => {
                if measuring {
                    self.out.table_full += w;
                }
                self.admit(waiter.key, now);
                (true, None)
            }
            Some((spend, claim, _)) => {
                let done = match spend {
                    Spend::Taken(_) => {
                        self.admit(waiter.key, now);
                        true
                    }
                    Spend::Unleased(_) => {
                        self.admit_unleased(waiter.envoy, waiter.key, now);
                        if measuring {
                            self.out.unleased += w;
                        }
                        true
                    }
                    Spend::Denied(_) => {
                        if measuring {
                            self.out.denied += w;
                        }
                        true
                    }
                    Spend::Empty if over => {
                        if measuring {
                            self.out.denied += w;
                            self.out.waited_out += w;
                        }
                        true
                    }
                    Spend::Empty => {
                        let list = self.pool_waiters.entry((waiter.envoy, waiter.key)).or_default();
                        if !list.contains(&id) {
                            list.push(id);
                        }
                        false
                    }
                };
                (done, claim)
            }
        };
        if done {
            self.waiters.remove(&id);
            if let Some(list) = self.pool_waiters.get_mut(&(waiter.envoy, waiter.key)) {
                list.retain(|w| *w != id);
            }
            if measuring {
                self.out.waits.add((now - waiter.since).as_millis_f64(), w);
            }
        }
        if let Some(claim) = claim {
            self.claimed(waiter.envoy, waiter.key, waiter.worker, claim, now);
        }
        self.maybe_send(waiter.worker, now);
    }

    /// A request's check at the service (check mode): admitted or not, in
    /// the window of the service's clock.
    fn check(&mut self, key: u32, now: Nanos) {
        let (admitted, writes) = self.checks.check(&self.config.keys, key as usize, now);
        let w = self.request_weight(key);
        if self.measuring(now) {
            self.check.writes += writes.values as f64 * w;
            if admitted {
                self.check.admitted += w;
            }
        }
        if !admitted {
            return;
        }
        let restart = self.restart;
        let Some(k) = self.key(key) else { return };
        let (period, bucket) = (k.shape.period(), k.shape == Shape::Bucket);
        if let Some(windows) = self.check_admitted.get_mut(key as usize) {
            *windows.entry(now / period).or_default() += 1;
        }
        if bucket && restart.is_none_or(|r| now < r) && now >= self.from {
            if let Some(times) = self.check_bucket_times.get_mut(key as usize) {
                times.push(now);
            }
        }
    }

    fn tick(&mut self, now: Nanos) {
        self.service.expire(now);
        self.checks.expire(now);
        if self.measuring(now) {
            let (all, records) = self.service.size(&self.config.keys, now);
            self.out.state_mean += all;
            self.out.state_peak = self.out.state_peak.max(all);
            self.out.state_records_mean += records;
            self.state_samples += 1;
        }
        let next = now + SECOND;
        if next < self.until + self.config.after {
            self.at(next, Event::Tick);
        }
    }

    fn run(mut self) -> Result<FleetOutcome, String> {
        let start = self.from - self.config.warmup;
        for key in 0..self.config.keys.len() {
            let rate = self.config.keys.get(key).map_or(1.0, |k| k.rate);
            let Some(arrivals) = self.arrivals.get_mut(key) else { continue };
            let first = start + arrivals.gap(rate);
            self.at(first, Event::Request(key as u32));
        }
        self.at(self.from, Event::Tick);
        if let Some(at) = self.restart {
            self.at(at, Event::Restart);
        }
        while let Some(Reverse((now, _, event))) = self.queue.pop() {
            match event {
                Event::Request(key) => self.request(key, now),
                Event::Flush(worker) => self.flush(worker, now),
                Event::AtService(id) => self.at_service(id, now)?,
                Event::Answered(id) => self.answered(id, now)?,
                Event::Retry(id) => self.retry(id, now),
                Event::Check(key) => self.check(key, now),
                Event::Restart => {
                    self.service.restart();
                    self.checks.restart();
                }
                Event::Tick => self.tick(now),
            }
        }
        Ok(self.finish())
    }

    fn finish(mut self) -> FleetOutcome {
        let mut out = std::mem::take(&mut self.out);
        let samples = self.state_samples.max(1) as f64;
        out.state_mean /= samples;
        out.state_records_mean /= samples;
        let mut check = std::mem::take(&mut self.check);
        for (index, key) in self.config.keys.iter().enumerate() {
            let period = key.shape.period();
            let Some(windows) = self.admitted.get(index) else { continue };
            if key.shape != Shape::Bucket {
                for (&window, &units) in windows {
                    let starts = period.times(window);
                    out.windows_checked += 1;
                    let after = self.restart.is_some_and(|r| period.times(window + 1) > r);
                    out.max_over = out.max_over.max(units.saturating_sub(key.limit));
                    let unleased = self.unleased_by.get(index).and_then(|w| w.get(&window)).map_or(0, Vec::len);
                    let worst = self.config.overshoot.map_or(0, |o| worst_case_over(unleased as u64, &o, period));
                    if units > key.limit + worst {
                        out.over_worst_case += 1;
                    }
                    if units <= key.limit {
                        continue;
                    }
                    if let Some(restart) = self.restart.filter(|_| after) {
                        // By when the window started (one spanning the restart: 0).
                        let since = starts.checked_sub(restart).map_or(0.0, Nanos::as_secs_f64);
                        let slot = [1.0, 5.0, 10.0, 20.0, f64::MAX].iter().position(|s| since <= *s).unwrap_or(4);
                        if let Some(n) = out.over_after_by.get_mut(slot) {
                            *n += 1;
                        }
                        out.over_after += 1;
                    } else {
                        out.over_before += 1;
                    }
                }
                if let Some(windows) = self.check_admitted.get(index) {
                    let before = windows.iter().filter(|(&w, _)| self.restart.is_none_or(|r| period.times(w + 1) <= r));
                    for (_, &units) in before {
                        check.windows_checked += 1;
                        if units > key.limit {
                            check.over += 1;
                        }
                    }
                }
            } else {
                if let Some(times) = self.bucket_times.get_mut(index) {
                    judge_bucket(times, key.limit, &mut out.bucket_spans);
                }
                let mut check_spans = [BucketSpans::default(); 2];
                if let Some(times) = self.check_bucket_times.get_mut(index) {
                    judge_bucket(times, key.limit, &mut check_spans);
                }
                check.over_bucket += check_spans.iter().map(|s| s.over_own).sum::<u64>();
            }
            // Utilisation under excess: every measured window of a key
            // whose demand is above its limit by design, against what that
            // window's arrivals could use of the limit (a thin key's
            // arrivals fall below its limit in some windows by chance).
            if key.over {
                let arrived = self.arrived.get(index);
                let checked = self.check_admitted.get(index);
                let w = key.request_weight;
                for window in self.from / period..self.until / period {
                    let units = windows.get(&window).copied().unwrap_or(0) as f64 * w;
                    let demand = arrived.and_then(|a| a.get(&window)).copied().unwrap_or(0);
                    let usable = demand.min(key.limit) as f64 * w;
                    out.excess_admitted += units;
                    out.excess_usable += usable;
                    out.excess_limit += key.limit as f64 * w;
                    if let Some(slot) = out.excess_by_shape.get_mut(key.shape.index()) {
                        *slot = (slot.0 + units, slot.1 + usable);
                    }
                    let by_check = checked.and_then(|c| c.get(&window)).copied().unwrap_or(0) as f64 * w;
                    check.excess = (check.excess.0 + by_check, check.excess.1 + usable);
                }
            }
        }
        out.per_key = self
            .config
            .keys
            .iter()
            .zip(&self.counts)
            .zip(&self.admitted)
            .map(|((k, &(requests, leases)), windows)| {
                let period = k.shape.period();
                let measured = (self.from / period..self.until / period).filter_map(|w| windows.get(&w)).sum::<u64>();
                KeyCounts {
                    rate: k.rate / k.scale,
                    shape: k.shape,
                    requests,
                    leases,
                    admitted: measured as f64 * k.request_weight,
                }
            })
            .collect();
        if self.config.check_baseline {
            out.check = Some(check);
        }
        out
    }
}

/// When `worker` next looks at its waiting requests after `now`: its refill
/// tick, every [`REFILL_TICK`] at a phase of its own.
fn next_tick(worker: u32, now: Nanos) -> Nanos {
    let period = REFILL_TICK.get();
    let phase = rng::mix(u64::from(worker)) % period;
    let since = (now.get() + period - phase) % period;
    now + Nanos::from_nanos(period - since)
}

/// Judges a token bucket of `limit` a second (burst `limit`) by the
/// instants it admitted at (sorted here): the most any span of 1 s and
/// 10 s admitted, against `burst + rate × span` and `burst + rate × (span
/// + lease lifetime)`.
fn judge_bucket(times: &mut [Nanos], limit: u64, spans: &mut [BucketSpans; 2]) {
    times.sort_unstable();
    for (span, judged) in [SECOND, SECOND.times(10)].into_iter().zip(spans.iter_mut()) {
        let mut most = 0usize;
        let mut first = 0usize;
        for (last, &t) in times.iter().enumerate() {
            while times.get(first).is_some_and(|&f| t - f >= span) {
                first += 1;
            }
            most = most.max(last + 1 - first);
        }
        let own = limit as f64 + limit as f64 * span.as_secs_f64();
        let leased = own + limit as f64 * LEASE_TTL.as_secs_f64();
        judged.checked += 1;
        if most as f64 > own {
            judged.over_own += 1;
        }
        if most as f64 > leased {
            judged.over_leased += 1;
        }
        judged.worst_ratio = judged.worst_ratio.max(most as f64 / own);
    }
}

/// Runs one configuration.
pub fn simulate(config: &FleetConfig) -> Result<FleetOutcome, String> {
    let quota = config.quota.clone();
    let empty_answer =
        serde_json::to_vec(&LeaseResponse { leases: Vec::new(), near: Vec::new() }).map_err(|e| e.to_string())?;
    let empty_returned =
        serde_json::to_vec(&floodgate_protocol::ReturnResponse { returned: Vec::new(), replayed: Vec::new() })
            .map_err(|e| e.to_string())?;
    let empty_lease = (quota.lease_call(&[]).body.len(), empty_answer.len());
    let empty_return = (quota.return_call(&[]).body.len(), empty_returned.len());
    let until = MEASURE_FROM + config.measure;
    let out = FleetOutcome {
        name: config.name.clone(),
        envoys: config.envoys,
        total_keys: config.total_keys,
        simulated_keys: config.keys.len(),
        exact: config.exact,
        secs: config.measure.as_secs_f64(),
        lease_call_bytes: (empty_lease.0 + empty_lease.1) as f64,
        return_call_bytes: (empty_return.0 + empty_return.1) as f64,
        ..FleetOutcome::default()
    };
    let pool = LeasePool { overshoot: config.overshoot, ..quota.pool() };
    let keys = config.keys.len();
    let envoys = config.envoys as usize;
    let workers = envoys * WORKERS as usize;
    let fleet = Fleet {
        config,
        pool,
        table: Table::new(Arc::new(pool), POOL_TAG, config.table_groups.saturating_mul(WAYS as u32).max(1)),
        quota,
        service: SimulatedService::new(LEASE_TTL, config.allowances),
        checks: SimulatedService::new(LEASE_TTL, config.allowances),
        rng: rng::seeded(config.seed),
        // By rank: a key sampled or not draws the same arrivals.
        arrivals: config.keys.iter().map(|k| rng::seeded(config.seed ^ rng::mix(k.rank ^ 0x6172_7269))).collect(),
        queue: BinaryHeap::new(),
        seq: 0,
        tables: vec![Map::default(); envoys],
        scratch: Vec::new(),
        pool_waiters: Map::default(),
        workers: (0..workers).map(|_| Batcher::default()).collect(),
        next_flush: vec![None; workers],
        waiters: Map::default(),
        calls: Map::default(),
        next_id: 1,
        admitted: vec![Map::default(); keys],
        bucket_times: vec![Vec::new(); keys],
        arrived: vec![Map::default(); keys],
        check_admitted: vec![Map::default(); keys],
        check_bucket_times: vec![Vec::new(); keys],
        unleased_by: vec![Map::default(); keys],
        near: if config.overshoot.is_some() { vec![NearSet::default(); envoys] } else { Vec::new() },
        counts: vec![(0.0, 0.0); keys],
        from: MEASURE_FROM,
        until,
        restart: config.restart_at.map(|at| until + at),
        out,
        check: CheckOutcome::default(),
        state_samples: 0,
        empty_lease,
        empty_return,
    };
    fleet.run()
}

/// The table groups per Envoy for a fleet whose simulated requests are
/// `share` of the real ones: the filter's `MAX_KEYS / WAYS`, scaled so that
/// the simulated pools meet as many others in their group as the real
/// ones would (at least one group).
pub fn table_groups(share: f64) -> u32 {
    let full = f64::from(MAX_KEYS) / WAYS as f64;
    ((full * share.min(1.0)).ceil() as u32).max(1)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[test]
    fn a_worker_looks_again_on_its_own_tick() {
        let now = Nanos::from_secs(5) + Nanos::from_micros(300);
        let at = next_tick(3, now);
        assert!(at > now && at - now <= REFILL_TICK);
        assert_eq!(next_tick(3, at + Nanos::ONE), at + REFILL_TICK);
    }

    #[test]
    fn a_bucket_is_judged_over_every_span() {
        let mut spans = [BucketSpans::default(); 2];
        // 25 admissions within 0.5 s of a bucket of 10 a second (burst 10):
        // over its own bound for 1 s (20), not over the leased one (30).
        let mut times: Vec<Nanos> = (0..25).map(|i| Nanos::from_millis(1_000 + 20 * i)).collect();
        judge_bucket(&mut times, 10, &mut spans);
        assert_eq!((spans[0].over_own, spans[0].over_leased), (1, 0));
        assert_eq!((spans[1].over_own, spans[1].over_leased), (0, 0));
        assert!((spans[0].worst_ratio - 1.25).abs() < 1e-9);
    }
}
