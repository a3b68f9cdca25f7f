//! Hot keys coalesced: transactions of one instance on the same key share
//! one store transaction. Each transaction waits on the lane of its first
//! key; while a lane's transaction runs, the ones arriving on it queue, and
//! the next run takes those with the oldest one's first key as one batch:
//! one read and one write of the union of their keys (one round trip to
//! Redis, one pass under the memory store's locks), decided in the order
//! they arrived, each on what the ones before it left. So a hot key costs a
//! store transaction per batch, not per request.
//!
//! A lane is an optimisation, not a lock: transactions whose keys overlap
//! but whose first keys differ may run at the same time, and the store's own
//! atomicity (shard locks, compare-and-swap) keeps them exact.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard};

use floodgate_core::time::Nanos;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::{StoreFailure, Writes};

/// Lanes: enough that unrelated keys rarely share one.
const LANES: usize = 1_024;

/// Most transactions one batch takes: a bound on the work (and the script's
/// keys) of one round trip.
const BATCH: usize = 64;

/// A transaction's decision: given its keys' bytes and now, what to write.
/// It keeps its own answer (see [`Answer`]); it may run more than once (a
/// store transaction that lost a race runs again), the last run counts.
pub type Decide = Box<dyn FnMut(&[Option<Vec<u8>>], Nanos) -> Writes + Send>;

/// Where a transaction learns how its store transaction ended.
type Done = oneshot::Sender<Result<(), StoreFailure>>;

/// One transaction waiting for its turn.
pub struct Job {
    keys: Vec<String>,
    decide: Decide,
    done: Done,
    /// When its caller stops waiting (`None`: it waits as long as it takes).
    deadline: Option<Instant>,
}

/// Where a decision leaves its answer for the caller.
pub type Answer<A> = Arc<Mutex<Option<A>>>;

/// A job deciding with `decide` before `deadline`, the receiver of its
/// outcome, and where its answer will be.
pub fn job<A: Send + 'static>(
    keys: Vec<String>,
    deadline: Option<Instant>,
    mut decide: impl FnMut(&[Option<Vec<u8>>], Nanos) -> (A, Writes) + Send + 'static,
) -> (Job, oneshot::Receiver<Result<(), StoreFailure>>, Answer<A>) {
    let answer: Answer<A> = Arc::new(Mutex::new(None));
    let slot = Arc::clone(&answer);
    let decide: Decide = Box::new(move |values, now| {
        let (answer, writes) = decide(values, now);
        *lock(&slot) = Some(answer);
        writes
    });
    let (done, outcome) = oneshot::channel();
    (Job { keys, decide, done, deadline }, outcome, answer)
}

/// The answer of a job whose outcome was `Ok`.
pub fn answer<A>(answer: &Answer<A>) -> Result<A, StoreFailure> {
    lock(answer).take().ok_or_else(|| StoreFailure::Unavailable("the transaction ended without an answer".into()))
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding it cannot leave the data half-written (each
    // field is replaced whole), so a poisoned mutex is still consistent.
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[derive(Default)]
struct Lane {
    busy: bool,
    waiting: Vec<Job>,
}

/// The lanes of one store.
pub struct Lanes {
    lanes: Vec<Mutex<Lane>>,
    hasher: RandomState,
}

impl std::fmt::Debug for Lanes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lanes").field("lanes", &self.lanes.len()).finish_non_exhaustive()
    }
}

impl Default for Lanes {
    fn default() -> Self {
        Lanes { lanes: (0..LANES).map(|_| Mutex::new(Lane::default())).collect(), hasher: RandomState::new() }
    }
}

impl Lanes {
    /// Queues `job` on its lane. When the lane was idle, the caller runs it:
    /// returns the lane and the first batch, and the caller runs batches
    /// until [`Lanes::next`] says the lane is idle again.
    pub fn enter(&self, job: Job) -> Option<(usize, Vec<Job>)> {
        let count = self.lanes.len().max(1) as u64;
        let at = job.keys.first().map_or(0, |key| (self.hasher.hash_one(key) % count) as usize);
        let lane = self.lanes.get(at)?;
        let mut lane = lock(lane);
        if lane.busy {
            lane.waiting.push(job);
            return None;
        }
        lane.busy = true;
        Some((at, vec![job]))
    }

    /// The next batch of lane `at`, or `None`: the lane is idle again. The
    /// batch is the oldest waiting transaction and those behind it on the
    /// same first key, in order: unrelated keys that share the lane are
    /// never one transaction (on a Redis Cluster, another domain's keys are
    /// in another slot).
    pub fn next(&self, at: usize) -> Option<Vec<Job>> {
        let mut lane = lock(self.lanes.get(at)?);
        let Some(first) = lane.waiting.first().map(|job| job.keys.first().cloned()) else {
            lane.busy = false;
            return None;
        };
        let (mut batch, mut others) = (Vec::new(), Vec::new());
        for job in lane.waiting.drain(..) {
            if batch.len() < BATCH && job.keys.first() == first.as_ref() {
                batch.push(job);
            } else {
                others.push(job);
            }
        }
        lane.waiting = others;
        Some(batch)
    }
}

/// A batch as one transaction: the union of its jobs' keys, and a decision
/// that runs every job in order on what the ones before it wrote.
pub struct Batch {
    /// Every key of the batch, once.
    pub keys: Vec<String>,
    /// Each job: where its keys are among the batch's, its decision, its
    /// outcome's receiver.
    jobs: Vec<(Vec<usize>, Decide, Done)>,
    /// The earliest deadline of its jobs: the transaction must end by then.
    pub deadline: Option<Instant>,
}

impl Batch {
    /// The batch of `jobs`. A job whose deadline has passed (its caller has
    /// stopped waiting) is answered [`StoreFailure::Timeout`] and left out:
    /// it is never decided.
    pub fn new(jobs: Vec<Job>) -> Self {
        let now = Instant::now();
        let (mut jobs, late): (Vec<Job>, Vec<Job>) =
            jobs.into_iter().partition(|job| job.deadline.is_none_or(|deadline| deadline > now));
        for job in late {
            let _ = job.done.send(Err(StoreFailure::Timeout));
        }
        let deadline = jobs.iter().filter_map(|job| job.deadline).min();
        if jobs.len() == 1 {
            if let Some(job) = jobs.pop() {
                // One job (the usual case): its keys, distinct, are the batch's.
                let at = (0..job.keys.len()).collect();
                return Batch { keys: job.keys, jobs: vec![(at, job.decide, job.done)], deadline };
            }
        }
        let mut keys: Vec<String> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        let jobs = jobs
            .into_iter()
            .map(|job| {
                let at = job
                    .keys
                    .into_iter()
                    .map(|key| {
                        *index.entry(key).or_insert_with_key(|key| {
                            keys.push(key.clone());
                            keys.len() - 1
                        })
                    })
                    .collect();
                (at, job.decide, job.done)
            })
            .collect();
        Batch { keys, jobs, deadline }
    }

    /// Whether every job of it had timed out already.
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// Runs every job on `values` (one per key of the batch) at `now`;
    /// returns what the batch writes: per key, the last write of any job.
    pub fn decide(&mut self, values: &[Option<Vec<u8>>], now: Nanos) -> Writes {
        if let [(_, decide, _)] = self.jobs.as_mut_slice() {
            // One job (the usual case): its keys are the batch's.
            return decide(values, now);
        }
        let mut values = values.to_vec();
        let mut writes: Writes = vec![None; values.len()];
        for (at, decide, _) in &mut self.jobs {
            let mine: Vec<Option<Vec<u8>>> = at.iter().map(|i| values.get(*i).cloned().flatten()).collect();
            for (i, write) in at.iter().zip(decide(&mine, now)) {
                let Some(next) = write else { continue };
                if let Some(value) = values.get_mut(*i) {
                    *value = Some(next.bytes.clone());
                }
                if let Some(slot) = writes.get_mut(*i) {
                    *slot = Some(next);
                }
            }
        }
        writes
    }

    /// Tells every job how the batch ended.
    pub fn finish(self, outcome: &Result<(), StoreFailure>) {
        for (_, _, done) in self.jobs {
            // A caller that left no longer waits for its answer.
            let _ = done.send(outcome.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on(key: &str) -> Job {
        job(vec![key.to_string()], None, |_, _| ((), vec![None])).0
    }

    fn first_keys(jobs: &[Job]) -> Vec<&str> {
        jobs.iter().filter_map(|job| job.keys.first()).map(String::as_str).collect()
    }

    /// Unrelated keys that share a lane are never one transaction (on a
    /// Redis Cluster, two domains' keys are in different slots): a batch is
    /// the oldest waiting key and those behind it on the same key.
    #[test]
    fn a_batch_is_the_oldest_waiting_key_only() {
        let lanes = Lanes { lanes: vec![Mutex::new(Lane::default())], hasher: RandomState::new() };
        let (at, running) = lanes.enter(on("a")).expect("an idle lane runs the first job");
        assert_eq!(first_keys(&running), ["a"]);
        for key in ["b", "a", "b", "a"] {
            assert!(lanes.enter(on(key)).is_none(), "a busy lane queues");
        }
        assert_eq!(first_keys(&lanes.next(at).expect("b waits")), ["b", "b"]);
        assert_eq!(first_keys(&lanes.next(at).expect("a waits")), ["a", "a"]);
        assert!(lanes.next(at).is_none(), "the lane is idle again");
        assert!(lanes.enter(on("c")).is_some(), "an idle lane runs the next job at once");
    }
}
