//! One simulated fleet: `envoys` Envoys of two workers each, the keys'
//! requests spread over them by a uniform load balancer, every (Envoy, key)
//! pair a real `LeasePool` (state kept only while it is not idle), every
//! worker batching its calls as `filter/src/global.rs::Callouts` does, and
//! the real service decisions behind a network of random delays; all on a
//! virtual clock, driven by one event queue.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use floodgate_core::algorithm::Algorithm;
use floodgate_core::global::calls::{read_leases, Refresh, MAX_ITEMS};
use floodgate_core::global::settings::QuotaService;
use floodgate_core::lease::overshoot::{notice_key, worst_case_over, NearSet, Overshoot};
use floodgate_core::lease::pool::{Applied, Claim, LeasePool, PoolState, Spend, MAX_BATCH_DELAY};
use floodgate_core::rng::Rng;
use floodgate_core::time::{Nanos, SECOND};
use floodgate_protocol::LeaseResponse;

use crate::keys::{Key, Shape, DOMAIN};
use crate::rng::{self, Traffic};
use crate::service::SimulatedService;

/// When the measured minute starts: a whole minute since the epoch, so that
/// it is exactly one per-minute window.
const MEASURE_FROM: Nanos = Nanos::from_secs(1_700_000_040);

/// The service's lease lifetime (`--lease-ttl`'s default).
pub const LEASE_TTL: Nanos = SECOND;

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
}

/// How long after an answer is applied the requests waiting for it are
/// decided again (the filter reads the clock again for them).
const RESUME_AFTER: Nanos = Nanos::from_nanos(1_000);

/// How long a worker holds returns back to share a call.
pub const RETURN_HOLD: Nanos = MAX_BATCH_DELAY;

/// Most leases (or returns) one call carries.
pub const MAX_LEASES_PER_CALL: f64 = MAX_ITEMS as f64;

/// Workers per Envoy (`--concurrency 2`).
pub const WORKERS: u32 = 2;

/// What a fleet did. Sums marked *weighted* count each simulated key as the
/// `weight` keys it stands for; the others are as simulated.
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
    /// Whether every key was simulated (no sampling).
    pub exact: bool,
    /// Seconds measured.
    pub secs: f64,
    /// Requests, weighted.
    pub requests: f64,
    /// Requests that found their pool empty and waited, weighted.
    pub waited: f64,
    /// Of those, the ones whose pool held no live lease at all (a cold pair), weighted.
    pub waited_cold: f64,
    /// Waits at a warm pair (a live lease that ran dry, or one ahead not
    /// started yet) of keys whose demand is below their limit, other than
    /// the next, weighted.
    pub waited_warm_under: f64,
    /// Waits of keys below their limit at a pair whose allowance's window
    /// ran dry, weighted.
    pub waited_dry_allowance: f64,
    /// Waits of keys below their limit at a pair whose live lease went to
    /// the one request it had seen (no second lease is claimed then unless
    /// the key's tokens are plentiful), weighted.
    pub waited_after_one: f64,
    /// Requests that waited out `max_wait` and were denied, weighted.
    pub waited_out: f64,
    /// Requests denied, weighted.
    pub denied: f64,
    /// How long each wait lasted (as simulated), milliseconds.
    pub wait_ms: Vec<f64>,
    /// Leases asked for, weighted: ones a request waits for (sent at
    /// once), held ones (sent by their `send_by`), and the held ones' total hold.
    pub urgent: f64,
    /// See [`FleetOutcome::urgent`].
    pub held: f64,
    /// See [`FleetOutcome::urgent`], seconds.
    pub hold_secs: f64,
    /// Return items, weighted.
    pub return_items: f64,
    /// Lease calls, return calls, lease items and return items, as simulated.
    pub sim_lease_calls: u64,
    /// See [`FleetOutcome::sim_lease_calls`].
    pub sim_return_calls: u64,
    /// See [`FleetOutcome::sim_lease_calls`].
    pub sim_leases: u64,
    /// See [`FleetOutcome::sim_lease_calls`].
    pub sim_returns: u64,
    /// Body bytes of the items (requests and answers), weighted.
    pub item_bytes: f64,
    /// Body bytes of the items, as simulated.
    pub sim_item_bytes: u64,
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
    /// Key windows checked, and over their limit, before and after the restart (as simulated).
    pub windows_checked: u64,
    /// See [`FleetOutcome::windows_checked`].
    pub over_before: u64,
    /// See [`FleetOutcome::windows_checked`].
    pub over_after: u64,
    /// Windows over their limit after the restart, by when they started:
    /// spanning it or within 1 s of it, within 5, 10, 20 s, later.
    pub over_after_by: [u64; 5],
    /// Keys limited below their demand, per shape (per-second, per-minute,
    /// bucket): admitted, and what each window's arrivals could use of the
    /// limit, over the measured windows, weighted.
    pub excess_by_shape: [(f64, f64); 3],
    /// Largest admitted ÷ limit of a token bucket's one-second window (before the restart).
    pub bucket_peak: f64,
    /// Keys limited below their demand: admitted and limit over the
    /// measured windows, weighted.
    pub excess_admitted: f64,
    /// See [`FleetOutcome::excess_admitted`]: the limits, and what of them
    /// each window's arrivals could use (`min(arrivals, limit)`).
    pub excess_limit: f64,
    /// See [`FleetOutcome::excess_limit`].
    pub excess_usable: f64,
    /// Per simulated key: rate, shape, requests and leases asked for (measured).
    pub per_key: Vec<(f64, Shape, u64, u64)>,
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
    /// The store is emptied.
    Restart,
    /// Once a second: expire the store, forget idle pools, sample the state.
    Tick,
}

/// A refresh on its way: the filter's `Refresh`, and whose pool it is.
#[derive(Debug, Clone)]
struct Pending {
    envoy: u32,
    key: u32,
    refresh: Refresh,
}

/// One worker's `Callouts`: refreshes to send now, held ones, returns.
#[derive(Debug, Default)]
struct Worker {
    now: Vec<Pending>,
    held: Vec<Pending>,
    returns: Vec<(u64, u64, u32)>,
    hold_until: Option<Nanos>,
}

impl Worker {
    fn has_outgoing(&self, now: Nanos) -> bool {
        !self.now.is_empty()
            || self.hold_until.is_some_and(|until| until <= now)
            || self.held.iter().filter(|p| p.refresh.claim.not_before <= now).count() >= MAX_ITEMS
            || self.returns.len() >= MAX_ITEMS
    }

    fn hold(&mut self, until: Nanos) {
        self.hold_until = Some(self.hold_until.map_or(until, |held| held.min(until)));
    }
}

#[derive(Debug, Clone, Copy)]
struct Waiter {
    envoy: u32,
    key: u32,
    worker: u32,
    since: Nanos,
    deadline: Nanos,
}

#[derive(Debug)]
enum InFlight {
    Leases { worker: u32, pending: Vec<Pending>, answer: Vec<u8> },
    Returns { body: Vec<u8>, weight: f64 },
}

#[derive(Debug, Default, Clone)]
struct PoolEntry {
    state: PoolState,
    waiters: Vec<u64>,
}

struct Fleet<'a> {
    config: &'a FleetConfig,
    quota: QuotaService,
    pool: LeasePool,
    service: SimulatedService,
    rng: Rng,
    queue: BinaryHeap<Reverse<(Nanos, u64, Event)>>,
    seq: u64,
    pools: HashMap<(u32, u32), PoolEntry>,
    workers: Vec<Worker>,
    waiters: HashMap<u64, Waiter>,
    calls: HashMap<u64, InFlight>,
    next_id: u64,
    /// Per key: admitted units per window (a fixed window's, a bucket's second).
    admitted: Vec<HashMap<u64, u64>>,
    /// Per key: requests that arrived per window (its demand there).
    arrived: Vec<HashMap<u64, u64>>,
    /// Per Envoy: the near-limit notices it heard.
    near: Vec<NearSet>,
    /// Per key and window: the Envoys that admitted it without a lease.
    unleased_by: Vec<HashMap<u64, Vec<u32>>>,
    /// Per key: requests and leases asked for, measured.
    counts: Vec<(u64, u64)>,
    from: Nanos,
    until: Nanos,
    restart: Option<Nanos>,
    out: FleetOutcome,
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

    fn weight(&self, key: u32) -> f64 {
        self.config.keys.get(key as usize).map_or(1.0, |k| k.weight)
    }

    fn admit(&mut self, key: u32, now: Nanos) {
        let Some(k) = self.config.keys.get(key as usize) else { return };
        let window = now / k.shape.period();
        if let Some(windows) = self.admitted.get_mut(key as usize) {
            *windows.entry(window).or_default() += 1;
        }
    }

    /// Until when `envoy` heard `key` is near its limit (as the limiter's
    /// `near_until`).
    fn near_until(&self, envoy: u32, key: u32, now: Nanos) -> Option<Nanos> {
        let near = self.near.get(envoy as usize).filter(|n| !n.is_quiet(now))?;
        near.until(notice_key(&self.config.keys.get(key as usize)?.descriptor), now)
    }

    /// A request admitted without a lease by `envoy`.
    fn admit_unleased(&mut self, envoy: u32, key: u32, now: Nanos) {
        self.admit(key, now);
        let Some(k) = self.config.keys.get(key as usize) else { return };
        let window = now / k.shape.period();
        if let Some(windows) = self.unleased_by.get_mut(key as usize) {
            let envoys = windows.entry(window).or_default();
            if !envoys.contains(&envoy) {
                envoys.push(envoy);
            }
        }
    }

    fn request(&mut self, key: u32, now: Nanos) {
        let end = self.until + self.config.after;
        let Some(k) = self.config.keys.get(key as usize) else { return };
        let next = now + self.rng.gap(k.rate);
        if next < end {
            self.at(next, Event::Request(key));
        }
        if let Some(windows) = self.arrived.get_mut(key as usize) {
            *windows.entry(now / k.shape.period()).or_default() += 1;
        }
        let envoy = self.rng.below(u64::from(self.config.envoys)) as u32;
        let worker = envoy * WORKERS + self.rng.below(u64::from(WORKERS)) as u32;
        let measuring = self.measuring(now);
        let w = self.weight(key);
        let under = !k.over;
        if measuring {
            self.out.requests += w;
            if under {
                self.out.requests_under += w;
            }
            if let Some(c) = self.counts.get_mut(key as usize) {
                c.0 += 1;
            }
        }
        let near_until = self.near_until(envoy, key, now);
        let entry = self
            .pools
            .entry((envoy, key))
            .or_insert_with(|| PoolEntry { state: self.pool.fresh(now), waiters: Vec::new() });
        let mut before = entry.state;
        if let Some(until) = near_until {
            before.without_lease.strict_until = before.without_lease.strict_until.max(until);
        }
        let (spend, claim, after) = self.pool.spend(before, now, 1);
        entry.state = after;
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
                let cold = before.lease.id == 0 || (now >= before.lease_end() && now >= before.held.until);
                if measuring {
                    self.out.waited += w;
                    if under {
                        self.out.waited_under += w;
                    }
                    if cold {
                        self.out.waited_cold += w;
                    } else if self.config.keys.get(key as usize).is_some_and(|k| k.over) {
                        // Demand above the limit: pools run dry by design.
                    } else if before.allowance.per_window > 0 {
                        self.out.waited_dry_allowance += w;
                    } else if before.rate.spent <= 1 {
                        // Its lease went to the one request the pool had
                        // seen, and no second was claimed (`PLENTY`).
                        self.out.waited_after_one += w;
                    } else {
                        self.out.waited_warm_under += w;
                    }
                }
                let deadline = now + self.quota.max_wait;
                let id = self.next_id;
                self.next_id += 1;
                self.waiters.insert(id, Waiter { envoy, key, worker, since: now, deadline });
                if let Some(entry) = self.pools.get_mut(&(envoy, key)) {
                    entry.waiters.push(id);
                }
                self.at(deadline, Event::Retry(id));
                if after.lease.starts_at > now && after.lease.starts_at < deadline {
                    // A lease ahead in place: it counts from its start.
                    self.at(after.lease.starts_at, Event::Retry(id));
                }
            }
        }
        if let Some(claim) = claim {
            self.claimed(envoy, key, worker, claim, now);
        }
        self.maybe_send(worker, now);
    }

    fn claimed(&mut self, envoy: u32, key: u32, worker: u32, claim: Claim, now: Nanos) {
        let lease = self.next_id;
        self.next_id += 1;
        if self.measuring(now) {
            let w = self.weight(key);
            if claim.send_by <= now {
                self.out.urgent += w;
            } else {
                self.out.held += w;
                self.out.hold_secs += (claim.send_by - now).events_at(w);
            }
            if let Some(c) = self.counts.get_mut(key as usize) {
                c.1 += 1;
            }
        }
        let descriptor = self.config.keys.get(key as usize).map(|k| k.descriptor.clone()).unwrap_or_default();
        let refresh =
            Refresh { rule: 0, group: 0, fingerprint: u64::from(key), claim, sent: claim.started, lease, descriptor };
        let pending = Pending { envoy, key, refresh };
        let Some(w) = self.workers.get_mut(worker as usize) else { return };
        if claim.send_by <= now {
            w.now.push(pending);
        } else {
            let earlier = w.hold_until.is_none_or(|until| claim.send_by < until);
            w.hold(claim.send_by);
            w.held.push(pending);
            if earlier {
                self.at(claim.send_by, Event::Flush(worker));
            }
        }
    }

    /// Queues a return as `Callouts::give_back` does (`lease` 0: nothing;
    /// no tokens: an allowance's later windows are freed).
    fn give_back(&mut self, worker: u32, key: u32, lease: u64, tokens: u64, now: Nanos) {
        if lease == 0 {
            return;
        }
        let Some(w) = self.workers.get_mut(worker as usize) else { return };
        let until = now + RETURN_HOLD;
        let earlier = w.hold_until.is_none_or(|held| until < held);
        w.returns.push((lease, tokens, key));
        w.hold(until);
        if earlier {
            self.at(until, Event::Flush(worker));
        }
        if self.measuring(now) {
            self.out.return_items += self.weight(key);
        }
    }

    /// Sends what the worker must send at `now`, as `Callouts::take_outgoing`.
    fn maybe_send(&mut self, worker: u32, now: Nanos) {
        let Some(w) = self.workers.get_mut(worker as usize) else { return };
        if !w.has_outgoing(now) {
            return;
        }
        let mut leases = std::mem::take(&mut w.now);
        let (go, stay): (Vec<Pending>, Vec<Pending>) =
            std::mem::take(&mut w.held).into_iter().partition(|p| p.refresh.claim.not_before <= now);
        leases.extend(go);
        w.held = stay;
        w.hold_until = w.held.iter().map(|p| p.refresh.claim.send_by).min();
        let returns = std::mem::take(&mut w.returns);
        if let Some(until) = w.hold_until {
            self.at(until, Event::Flush(worker));
        }
        let measuring = self.measuring(now);
        let mut leases = leases.into_iter().peekable();
        while leases.peek().is_some() {
            let mut pending: Vec<Pending> = leases.by_ref().take(MAX_ITEMS).collect();
            pending.iter_mut().for_each(|p| p.refresh.sent = now);
            let refreshes: Vec<Refresh> = pending.iter().map(|p| p.refresh.clone()).collect();
            let body = self.quota.lease_call(&refreshes).body;
            if measuring {
                self.out.sim_lease_calls += 1;
                self.out.sim_leases += pending.len() as u64;
                let mean_w = pending.iter().map(|p| self.weight(p.key)).sum::<f64>() / pending.len() as f64;
                let items = body.len().saturating_sub(self.empty_lease.0);
                self.out.item_bytes += items as f64 * mean_w;
                self.out.sim_item_bytes += items as u64;
            }
            let id = self.next_id;
            self.next_id += 1;
            self.calls.insert(id, InFlight::Leases { worker, pending, answer: body });
            let delay = self.rng.delay();
            self.at(now + delay, Event::AtService(id));
        }
        for chunk in returns.chunks(MAX_ITEMS) {
            let items: Vec<(u64, u64)> = chunk.iter().map(|&(l, t, _)| (l, t)).collect();
            let body = self.quota.return_call(&items).body;
            let weight = chunk.iter().map(|&(_, _, k)| self.weight(k)).sum::<f64>() / chunk.len() as f64;
            if measuring {
                self.out.sim_return_calls += 1;
                self.out.sim_returns += chunk.len() as u64;
                let items = body.len().saturating_sub(self.empty_return.0);
                self.out.item_bytes += items as f64 * weight;
                self.out.sim_item_bytes += items as u64;
            }
            let id = self.next_id;
            self.next_id += 1;
            self.calls.insert(id, InFlight::Returns { body, weight });
            let delay = self.rng.delay();
            self.at(now + delay, Event::AtService(id));
        }
    }

    fn at_service(&mut self, id: u64, now: Nanos) -> Result<(), String> {
        let measuring = self.measuring(now);
        match self.calls.get_mut(&id) {
            Some(InFlight::Leases { pending, answer, .. }) => {
                let body = self.service.lease(&self.config.keys, answer, now)?;
                if measuring {
                    let mean_w = pending
                        .iter()
                        .map(|p| self.config.keys.get(p.key as usize).map_or(1.0, |k| k.weight))
                        .sum::<f64>()
                        / pending.len().max(1) as f64;
                    let items = body.len().saturating_sub(self.empty_lease.1);
                    self.out.item_bytes += items as f64 * mean_w;
                    self.out.sim_item_bytes += items as u64;
                }
                *answer = body;
                let delay = self.rng.delay();
                self.at(now + delay, Event::Answered(id));
            }
            Some(InFlight::Returns { body, weight }) => {
                let (answer, returned) = self.service.give_back(body, now)?;
                if measuring {
                    let items = answer.len().saturating_sub(self.empty_return.1);
                    self.out.item_bytes += items as f64 * *weight;
                    self.out.sim_item_bytes += items as u64;
                    self.out.returned_tokens += returned as f64 * *weight;
                }
                self.calls.remove(&id);
            }
            None => {}
        }
        Ok(())
    }

    fn answered(&mut self, id: u64, now: Nanos) -> Result<(), String> {
        let Some(InFlight::Leases { worker, pending, answer }) = self.calls.remove(&id) else { return Ok(()) };
        let refreshes: Vec<Refresh> = pending.iter().map(|p| p.refresh.clone()).collect();
        let answer = read_leases(Some(200), &answer, &refreshes).map_err(|e| e.to_string())?;
        let grants = answer.grants;
        // The Envoy's near set, as `Limiter::heard_near` keeps it.
        if let Some(envoy) = pending.first().map(|p| p.envoy) {
            if let Some(near) = self.near.get_mut(envoy as usize) {
                for &(key, span) in &answer.near {
                    near.heard(key, now + span, now);
                }
            }
        }
        let measuring = self.measuring(now);
        for (p, grant) in pending.iter().zip(grants) {
            // The simulated service has no share of records to refuse for.
            let grant = grant.map_err(|why| format!("the service refused a lease: {why}"))?;
            let entry = self.pools.entry((p.envoy, p.key)).or_default();
            let (applied, after) = self.pool.apply(entry.state, now, (p.refresh.claim.started, p.refresh.sent), &grant);
            entry.state = after;
            let waiting = std::mem::take(&mut entry.waiters);
            match applied {
                Applied::Replaced(left) => {
                    if measuring {
                        self.out.expired_tokens += left.expired as f64 * self.weight(p.key);
                    }
                    for (lease, tokens) in left.returns {
                        self.give_back(worker, p.key, lease, tokens, now);
                    }
                }
                Applied::Stale if grant.granted > 0 => self.give_back(worker, p.key, grant.lease, grant.granted, now),
                Applied::Stale => {}
                Applied::Duplicate | Applied::Reported => {}
            }
            // The waiting requests go on just after the answer is applied
            // (`finish_due`, with its own reading of the clock).
            for waiter in waiting {
                self.at(now + RESUME_AFTER, Event::Retry(waiter));
            }
        }
        self.maybe_send(worker, now);
        Ok(())
    }

    /// A waiting request decided again: when its pool got an answer, when
    /// a lease ahead starts, or when its wait is over.
    fn retry(&mut self, id: u64, now: Nanos) {
        let Some(waiter) = self.waiters.get(&id).copied() else { return };
        let near_until = self.near_until(waiter.envoy, waiter.key, now);
        let Some(entry) = self.pools.get_mut(&(waiter.envoy, waiter.key)) else {
            self.waiters.remove(&id);
            return;
        };
        let mut before = entry.state;
        if let Some(until) = near_until {
            before.without_lease.strict_until = before.without_lease.strict_until.max(until);
        }
        let (spend, claim, after) = self.pool.spend(before, now, 1);
        entry.state = after;
        let over = now >= waiter.deadline;
        let measuring = self.measuring(waiter.since);
        let w = self.weight(waiter.key);
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
                if let Some(entry) = self.pools.get_mut(&(waiter.envoy, waiter.key)) {
                    if !entry.waiters.contains(&id) {
                        entry.waiters.push(id);
                    }
                }
                false
            }
        };
        if done {
            self.waiters.remove(&id);
            if let Some(entry) = self.pools.get_mut(&(waiter.envoy, waiter.key)) {
                entry.waiters.retain(|w| *w != id);
            }
            if measuring {
                self.out.wait_ms.push((now - waiter.since).as_millis_f64());
            }
        }
        if let Some(claim) = claim {
            self.claimed(waiter.envoy, waiter.key, waiter.worker, claim, now);
        }
        self.maybe_send(waiter.worker, now);
    }

    fn tick(&mut self, now: Nanos) {
        self.service.expire(now);
        let pool = self.pool;
        // Only a pool the filter's table could give away loses its state:
        // idle by `idle_at` too, which (unlike `is_idle`) counts an
        // allowance's windows still to come.
        self.pools
            .retain(|_, e| !(e.waiters.is_empty() && pool.is_idle(e.state, now) && pool.idle_at(e.state, now) <= now));
        if self.measuring(now) {
            let (weighted, _) = self.service.size(&self.config.keys, now);
            self.out.state_mean += weighted;
            self.out.state_peak = self.out.state_peak.max(weighted);
            self.out.state_records_mean += self.service.records_size(&self.config.keys, now);
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
            let first = start + self.rng.gap(rate);
            self.at(first, Event::Request(key as u32));
        }
        self.at(self.from, Event::Tick);
        if let Some(at) = self.restart {
            self.at(at, Event::Restart);
        }
        while let Some(Reverse((now, _, event))) = self.queue.pop() {
            match event {
                Event::Request(key) => self.request(key, now),
                Event::Flush(worker) => self.maybe_send(worker, now),
                Event::AtService(id) => self.at_service(id, now)?,
                Event::Answered(id) => self.answered(id, now)?,
                Event::Retry(id) => self.retry(id, now),
                Event::Restart => self.service.restart(),
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
        for (index, key) in self.config.keys.iter().enumerate() {
            let period = key.shape.period();
            // A leased bucket's tokens are taken at the service and spent
            // up to a lease lifetime later: a second may see its burst
            // plus its refill over the second and the lifetime.
            let bound = match key.shape {
                Shape::Bucket => key.limit + key.limit * ((SECOND + LEASE_TTL) / SECOND),
                Shape::PerSecond | Shape::PerMinute => key.limit,
            };
            let Some(windows) = self.admitted.get(index) else { continue };
            for (&window, &units) in windows {
                let (starts, ends) = (period.times(window), period.times(window + 1));
                out.windows_checked += 1;
                let after = self.restart.is_some_and(|r| ends > r);
                out.max_over = out.max_over.max(units.saturating_sub(key.limit));
                let unleased_envoys = self.unleased_by.get(index).and_then(|w| w.get(&window)).map_or(0, Vec::len);
                let worst = self.config.overshoot.map_or(0, |o| worst_case_over(unleased_envoys as u64, &o, period));
                if units > bound + worst {
                    out.over_worst_case += 1;
                }
                if units > bound {
                    if let Some(restart) = self.restart.filter(|_| after) {
                        // By when the window started (one spanning the restart: 0).
                        let since = (starts - restart).as_secs_f64();
                        let slot = [1.0, 5.0, 10.0, 20.0, f64::MAX].iter().position(|s| since <= *s).unwrap_or(4);
                        if let Some(n) = out.over_after_by.get_mut(slot) {
                            *n += 1;
                        }
                    }
                    if after {
                        out.over_after += 1;
                    } else {
                        out.over_before += 1;
                    }
                }
                if key.shape == Shape::Bucket && !after {
                    out.bucket_peak = out.bucket_peak.max(units as f64 / key.limit as f64);
                }
            }
            // Utilisation under excess: every measured window of a key
            // whose demand is above its limit by design, against what that
            // window's arrivals could use of the limit (a thin key's
            // arrivals fall below its limit in some windows by chance).
            if key.over {
                let arrived = self.arrived.get(index);
                for window in self.from / period..self.until / period {
                    let units = windows.get(&window).copied().unwrap_or(0) as f64 * key.weight;
                    let demand = arrived.and_then(|a| a.get(&window)).copied().unwrap_or(0);
                    let usable = demand.min(key.limit) as f64 * key.weight;
                    let limit = key.limit as f64 * key.weight;
                    out.excess_admitted += units;
                    out.excess_usable += usable;
                    out.excess_limit += limit;
                    if let Some(slot) = out.excess_by_shape.get_mut(key.shape as usize) {
                        *slot = (slot.0 + units, slot.1 + usable);
                    }
                }
            }
        }
        out.per_key = self
            .config
            .keys
            .iter()
            .zip(&self.counts)
            .map(|(k, &(requests, leases))| (k.rate, k.shape, requests, leases))
            .collect();
        out
    }
}

/// Runs one configuration.
pub fn simulate(config: &FleetConfig) -> Result<FleetOutcome, String> {
    let quota = QuotaService {
        cluster: "quota".into(),
        authority: "quota".into(),
        domain: DOMAIN.into(),
        timeout: Nanos::from_millis(300),
        token: None,
        max_wait: Nanos::from_millis(200),
        lease_horizon: SECOND,
    };
    let empty_answer =
        serde_json::to_vec(&LeaseResponse { leases: Vec::new(), near: Vec::new() }).map_err(|e| e.to_string())?;
    let empty_returned =
        serde_json::to_vec(&floodgate_protocol::ReturnResponse { returned: Vec::new(), replayed: Vec::new() })
            .map_err(|e| e.to_string())?;
    let empty_lease = (quota.lease_call(&[]).body.len(), empty_answer.len());
    let empty_return = (quota.return_call(&[]).body.len(), empty_returned.len());
    let until = MEASURE_FROM + config.measure;
    let exact = config.keys.iter().all(|k| k.weight == 1.0) && config.keys.len() as u64 == config.total_keys;
    let out = FleetOutcome {
        name: config.name.clone(),
        envoys: config.envoys,
        total_keys: config.total_keys,
        simulated_keys: config.keys.len(),
        exact,
        secs: config.measure.as_secs_f64(),
        lease_call_bytes: (empty_lease.0 + empty_lease.1) as f64,
        return_call_bytes: (empty_return.0 + empty_return.1) as f64,
        ..FleetOutcome::default()
    };
    let fleet = Fleet {
        config,
        pool: LeasePool { overshoot: config.overshoot, ..quota.pool() },
        quota,
        service: SimulatedService::new(LEASE_TTL, config.allowances),
        rng: rng::seeded(config.seed),
        queue: BinaryHeap::new(),
        seq: 0,
        pools: HashMap::new(),
        workers: (0..config.envoys * WORKERS).map(|_| Worker::default()).collect(),
        waiters: HashMap::new(),
        calls: HashMap::new(),
        next_id: 1,
        admitted: vec![HashMap::new(); config.keys.len()],
        arrived: vec![HashMap::new(); config.keys.len()],
        unleased_by: vec![HashMap::new(); config.keys.len()],
        near: vec![NearSet::default(); config.envoys as usize],
        counts: vec![(0, 0); config.keys.len()],
        from: MEASURE_FROM,
        until,
        restart: config.restart_at.map(|at| until + at),
        out,
        state_samples: 0,
        empty_lease,
        empty_return,
    };
    fleet.run()
}
