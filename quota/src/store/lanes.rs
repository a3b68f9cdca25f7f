//! The order of transactions on keys, one implementation for every store.
//!
//! Every key a transaction touches is a **lane**: a first-in first-out
//! queue of the transactions waiting for it. A transaction runs once it is
//! first in the queue of every key it touches and none of them is held by a
//! running batch, so each key sees this instance's transactions in the order
//! they arrived, whatever their other keys (a check of `[other, hot]` waits
//! its turn on `hot` like any call of `hot`, and is never overtaken by the
//! hot key's later calls). The oldest waiting transaction is always first in
//! all its queues, so one always runs: there is no deadlock.
//!
//! A transaction that starts may take along those queued behind it on its
//! first key, in order, while each is first on all of its own keys and of
//! the same group (the Redis Cluster hash tag: one slot): a **batch**, one
//! store transaction of the union of their keys (one round trip to Redis,
//! one pass under the memory store's locks), decided in the order they
//! arrived, each on what the ones before it left. So a hot key costs a store
//! transaction per batch, not per request. Batches ready at once go to the
//! store in **rounds** (`super::Rounds`: at most 64 jobs, the calls taking
//! turns; Redis: one script per slot), each batch's outcome its own; the
//! transactions one call submits (the leases of one call) are numbered as
//! one call, so that its rounds take turns with other calls'.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard};

use floodgate_core::time::Nanos;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::{StoreFailure, Writes};

/// Most transactions one batch takes: a bound on the work (and the script's
/// keys) of one store transaction.
const BATCH: usize = 64;

/// A transaction's decision: given its keys' bytes and now, what to write.
/// It keeps its own answer (see [`Answer`]); it may run more than once (a
/// store transaction that lost a race runs again), the last run counts.
pub type Decide = Box<dyn FnMut(&[Option<Vec<u8>>], Nanos) -> Writes + Send>;

/// A caller's decision: given its keys' bytes and now, its answer and what
/// to write.
pub type Decider<A> = Box<dyn FnMut(&[Option<Vec<u8>>], Nanos) -> (A, Writes) + Send>;

/// Where a transaction learns how its store transaction ended.
type Done = oneshot::Sender<Result<(), StoreFailure>>;

/// One transaction waiting for its turn.
pub struct Job {
    keys: Vec<String>,
    /// The group its keys are in (the Redis Cluster hash tag): only jobs of
    /// one group share a batch.
    group: String,
    decide: Decide,
    done: Done,
    /// When its caller stops waiting (`None`: it waits as long as it takes).
    deadline: Option<Instant>,
    /// The call it is part of (numbered by [`Lanes::call`]): rounds take
    /// turns between calls (see `Rounds`).
    call: u64,
    /// How many jobs its call submitted: a call of many goes after the
    /// small ones in a round (see `Rounds`).
    call_jobs: usize,
}

/// A call's number and how many jobs it has in all (see [`Lanes::call`]).
#[derive(Debug, Clone, Copy)]
pub struct CallNumber {
    number: u64,
    jobs: usize,
}

/// Where a decision leaves its answer for the caller.
pub type Answer<A> = Arc<Mutex<Option<A>>>;

/// The receiver of a job's outcome.
pub type Settled = oneshot::Receiver<Result<(), StoreFailure>>;

/// A job on `keys` (distinct, all of `group`) deciding with `decide` before
/// `deadline`, the receiver of its outcome, and where its answer will be.
pub fn job<A: Send + 'static>(
    keys: Vec<String>,
    group: String,
    deadline: Option<Instant>,
    mut decide: impl FnMut(&[Option<Vec<u8>>], Nanos) -> (A, Writes) + Send + 'static,
) -> (Job, Settled, Answer<A>) {
    let answer: Answer<A> = Arc::new(Mutex::new(None));
    let slot = Arc::clone(&answer);
    let decide: Decide = Box::new(move |values, now| {
        let (answer, writes) = decide(values, now);
        *lock(&slot) = Some(answer);
        writes
    });
    let (done, outcome) = oneshot::channel();
    (Job { keys, group, decide, done, deadline, call: 0, call_jobs: 1 }, outcome, answer)
}

/// The answer of a job once its outcome has come.
pub async fn answer<A>(outcome: Settled, answer: &Answer<A>) -> Result<A, StoreFailure> {
    outcome.await.map_err(|_| StoreFailure::Unavailable("the store dropped the transaction".into()))??;
    lock(answer).take().ok_or_else(|| StoreFailure::Unavailable("the transaction ended without an answer".into()))
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding it cannot leave the data half-written (each
    // field is replaced whole), so a poisoned mutex is still consistent.
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A lane: whether a running batch holds it, and who waits for it.
#[derive(Default)]
struct Lane {
    held: bool,
    queue: VecDeque<u64>,
}

/// A job queued on its lanes.
struct Waiting {
    job: Job,
    lanes: Vec<u64>,
}

#[derive(Default)]
struct Queues {
    next: u64,
    /// The number the next call submitted gets.
    next_call: u64,
    /// By arrival number.
    waiting: HashMap<u64, Waiting>,
    /// By key hash; a lane neither held nor waited for is removed.
    lanes: HashMap<u64, Lane>,
}

/// The lanes of one store.
pub struct Lanes {
    queues: Mutex<Queues>,
    hasher: RandomState,
}

impl std::fmt::Debug for Lanes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lanes").finish_non_exhaustive()
    }
}

impl Default for Lanes {
    fn default() -> Self {
        Lanes { queues: Mutex::new(Queues::default()), hasher: RandomState::new() }
    }
}

impl Queues {
    /// Whether job `id` is first on every one of `lanes` and each is free
    /// (or, in `mine`, held by the batch being formed).
    fn ready(&self, id: u64, lanes: &[u64], mine: &[u64]) -> bool {
        lanes.iter().all(|lane| {
            self.lanes.get(lane).is_some_and(|l| l.queue.front() == Some(&id) && (!l.held || mine.contains(lane)))
        })
    }

    /// Takes job `id` off the front of its lanes, holding them.
    fn take(&mut self, id: u64) -> Option<Waiting> {
        let waiting = self.waiting.remove(&id)?;
        for lane in &waiting.lanes {
            if let Some(l) = self.lanes.get_mut(lane) {
                l.queue.pop_front();
                l.held = true;
            }
        }
        Some(waiting)
    }

    /// The batch starting with the job first on `lane`, if it can start.
    fn batch_from(&mut self, lane: u64) -> Option<Batch> {
        let first = *self.lanes.get(&lane)?.queue.front()?;
        let lanes = self.waiting.get(&first)?.lanes.clone();
        if !self.ready(first, &lanes, &[]) {
            return None;
        }
        let head = self.take(first)?;
        let group = head.job.group.clone();
        let mut held = head.lanes;
        let mut jobs = vec![head.job];
        // Those behind it on its first key, in order, while each can go.
        let Some(&first_lane) = held.first() else { return Some(Batch::new(jobs, held)) };
        while jobs.len() < BATCH {
            let Some(&next) = self.lanes.get(&first_lane).and_then(|l| l.queue.front()) else { break };
            let Some(waiting) = self.waiting.get(&next) else { break };
            if waiting.job.group != group || !self.ready(next, &waiting.lanes, &held) {
                break;
            }
            let Some(taken) = self.take(next) else { break };
            let more: Vec<u64> = taken.lanes.iter().filter(|l| !held.contains(l)).copied().collect();
            held.extend(more);
            jobs.push(taken.job);
        }
        Some(Batch::new(jobs, held))
    }

    /// Every batch that can start among the jobs first on `lanes`.
    fn ready_batches(&mut self, lanes: impl IntoIterator<Item = u64>) -> Vec<Batch> {
        let mut batches = Vec::new();
        for lane in lanes {
            if let Some(batch) = self.batch_from(lane) {
                batches.push(batch);
            }
        }
        batches
    }
}

impl Lanes {
    fn lane_of(&self, key: &str) -> u64 {
        self.hasher.hash_one(key)
    }

    /// Queues `jobs` (in order), one whole call's, on their keys' lanes;
    /// returns the batches that can start now (their lanes held until
    /// [`Lanes::release`]).
    pub fn submit(&self, jobs: Vec<Job>) -> Vec<Batch> {
        let call = self.call(jobs.len());
        self.submit_part(call, jobs)
    }

    /// How many jobs were ever queued.
    #[cfg(test)]
    pub fn queued(&self) -> u64 {
        lock(&self.queues).next
    }

    /// Numbers a call of `jobs` jobs, to be submitted in parts (see
    /// [`Lanes::submit_part`]).
    pub fn call(&self, jobs: usize) -> CallNumber {
        let mut queues = lock(&self.queues);
        let number = queues.next_call;
        queues.next_call += 1;
        CallNumber { number, jobs }
    }

    /// Queues `jobs` (in order), the next part of `call`, behind its parts
    /// before: a call of hundreds of jobs is queued in parts with the other
    /// tasks let run between them (queueing 512 took up to 1.5 ms), and it
    /// takes its turns in rounds as one call. Returns the batches that can
    /// start now (their lanes held until [`Lanes::release`]).
    pub fn submit_part(&self, call: CallNumber, jobs: Vec<Job>) -> Vec<Batch> {
        let mut queues = lock(&self.queues);
        let CallNumber { number: call, jobs: call_jobs } = call;
        let mut touched = Vec::new();
        let mut keyless = Vec::new();
        for mut job in jobs {
            job.call = call;
            job.call_jobs = call_jobs;
            if job.keys.is_empty() {
                // Nothing to wait for (and no lane that would ever start it).
                keyless.push(Batch::new(vec![job], Vec::new()));
                continue;
            }
            let mut lanes: Vec<u64> = Vec::with_capacity(job.keys.len());
            for key in &job.keys {
                let lane = self.lane_of(key);
                if !lanes.contains(&lane) {
                    lanes.push(lane);
                }
            }
            let id = queues.next;
            queues.next += 1;
            for lane in &lanes {
                queues.lanes.entry(*lane).or_default().queue.push_back(id);
            }
            if let Some(first) = lanes.first() {
                touched.push(*first);
            }
            queues.waiting.insert(id, Waiting { job, lanes });
        }
        keyless.extend(queues.ready_batches(touched));
        keyless
    }

    /// Frees the lanes a finished batch held; returns the batches that can
    /// start now.
    pub fn release(&self, lanes: &[u64]) -> Vec<Batch> {
        let mut queues = lock(&self.queues);
        let mut free = Vec::with_capacity(lanes.len());
        for lane in lanes {
            let Some(l) = queues.lanes.get_mut(lane) else { continue };
            l.held = false;
            if l.queue.is_empty() {
                queues.lanes.remove(lane);
            } else {
                free.push(*lane);
            }
        }
        // A freed lane's first job may be waiting on it as its second key:
        // look from that job's first lane, so it takes its followers along.
        let starts: Vec<u64> = free
            .iter()
            .filter_map(|lane| queues.lanes.get(lane)?.queue.front())
            .filter_map(|id| queues.waiting.get(id)?.lanes.first().copied())
            .collect();
        queues.ready_batches(starts)
    }
}

/// A batch as one transaction: the union of its jobs' keys, and a decision
/// that runs every job in order on what the ones before it wrote.
pub struct Batch {
    /// Every key of the batch, once.
    pub keys: Vec<String>,
    /// The group (Redis Cluster hash tag) of every key.
    pub group: String,
    /// Each job: where its keys are among the batch's, its decision, its
    /// outcome's receiver.
    jobs: Vec<(Vec<usize>, Decide, Done)>,
    /// The lanes it holds.
    lanes: Vec<u64>,
    /// The latest deadline of its jobs: the transaction must end by then.
    /// (Each caller stops waiting at its own: a call that joined a batch
    /// late is not cut short by an older one beside it.)
    pub deadline: Option<Instant>,
    /// The call of its first job: the rounds take turns between calls.
    pub call: u64,
    /// How many jobs that call submitted (see `Rounds`: small calls first).
    pub call_jobs: usize,
}

impl Batch {
    /// The batch of `jobs`, holding `lanes`. A job whose deadline has passed
    /// (its caller has stopped waiting) is answered [`StoreFailure::Timeout`]
    /// and left out: it is never decided.
    fn new(jobs: Vec<Job>, lanes: Vec<u64>) -> Self {
        let now = Instant::now();
        let group = jobs.first().map(|job| job.group.clone()).unwrap_or_default();
        let call = jobs.first().map_or(0, |job| job.call);
        let call_jobs = jobs.first().map_or(1, |job| job.call_jobs);
        let (mut jobs, late): (Vec<Job>, Vec<Job>) =
            jobs.into_iter().partition(|job| job.deadline.is_none_or(|deadline| deadline > now));
        for job in late {
            let _ = job.done.send(Err(StoreFailure::Timeout));
        }
        let deadline = jobs.iter().filter_map(|job| job.deadline).max();
        if jobs.len() == 1 {
            if let Some(job) = jobs.pop() {
                // One job (the usual case): its keys, distinct, are the batch's.
                let at = (0..job.keys.len()).collect();
                return Batch {
                    keys: job.keys,
                    group,
                    jobs: vec![(at, job.decide, job.done)],
                    lanes,
                    deadline,
                    call,
                    call_jobs,
                };
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
        Batch { keys, group, jobs, lanes, deadline, call, call_jobs }
    }

    /// Whether every job of it had timed out already.
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// How many calls it decides.
    pub fn len(&self) -> usize {
        self.jobs.len()
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

    /// The batch as one batch per job, in order (the last holds the lanes):
    /// to decide them alone when together they could not be (a memory
    /// store without room for all their new entries).
    pub fn split(self) -> Vec<Batch> {
        let Batch { keys, group, jobs, lanes, deadline, call, call_jobs } = self;
        let count = jobs.len();
        let mut lanes = Some(lanes);
        jobs.into_iter()
            .enumerate()
            .map(|(i, (at, decide, done))| {
                let mine: Vec<String> = at.iter().filter_map(|k| keys.get(*k).cloned()).collect();
                let held = if i + 1 == count { lanes.take().unwrap_or_default() } else { Vec::new() };
                let at = (0..mine.len()).collect();
                Batch {
                    keys: mine,
                    group: group.clone(),
                    jobs: vec![(at, decide, done)],
                    lanes: held,
                    deadline,
                    call,
                    call_jobs,
                }
            })
            .collect()
    }

    /// Tells every job how the batch ended; returns the lanes to release.
    pub fn finish(self, outcome: &Result<(), StoreFailure>) -> Vec<u64> {
        for (_, _, done) in self.jobs {
            // A caller that left no longer waits for its answer.
            let _ = done.send(outcome.clone());
        }
        self.lanes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on(keys: &[&str]) -> Job {
        job(keys.iter().map(|k| k.to_string()).collect(), "g".into(), None, |_, _| ((), vec![None; 0])).0
    }

    fn first_keys(batch: &Batch) -> Vec<&str> {
        batch.keys.iter().map(String::as_str).collect()
    }

    /// A call whose first key is another one is ordered on the hot key like
    /// the hot key's own calls: it is not overtaken by those that came after
    /// it (else a flood of the hot key's own calls could hold it back for
    /// ever), and once its other key is free it runs,
    /// taking nothing past it.
    #[test]
    fn every_key_of_a_call_is_a_lane_in_arrival_order() {
        let lanes = Lanes::default();
        let first = lanes.submit(vec![on(&["hot"])]);
        assert_eq!(first.len(), 1, "an idle lane runs at once");
        let other = lanes.submit(vec![on(&["other"])]);
        assert_eq!(other.len(), 1);
        // Queued behind the running batches: hot, [other, hot], hot.
        assert!(lanes.submit(vec![on(&["hot"]), on(&["other", "hot"]), on(&["hot"])]).is_empty());
        let mut first = first;
        let next = lanes.release(&first.pop().unwrap().finish(&Ok(())));
        assert_eq!(next.len(), 1, "the next hot call runs");
        assert_eq!(first_keys(&next[0]), ["hot"], "and stops at [other, hot], still waiting for other");
        let mut next = next;
        assert!(lanes.release(&next.pop().unwrap().finish(&Ok(()))).is_empty(), "the third hot call waits");
        let mut other = other;
        let after = lanes.release(&other.pop().unwrap().finish(&Ok(())));
        assert_eq!(after.len(), 1);
        assert_eq!(first_keys(&after[0]), ["other", "hot"], "[other, hot] before the later hot call");
        let mut after = after;
        let last = lanes.release(&after.pop().unwrap().finish(&Ok(())));
        assert_eq!(last.len(), 1);
        assert_eq!(first_keys(&last[0]), ["hot"]);
    }

    /// Calls on one key queued together are one batch; calls on other keys
    /// submitted together are batches of their own, all ready at once (one
    /// round); other groups never share a batch.
    #[test]
    fn a_hot_key_batches_and_independent_keys_run_together() {
        let lanes = Lanes::default();
        let mut running = lanes.submit(vec![on(&["a"])]);
        assert!(lanes.submit(vec![on(&["a"]), on(&["a"]), on(&["a"])]).is_empty());
        let next = lanes.release(&running.pop().unwrap().finish(&Ok(())));
        assert_eq!(next.iter().map(Batch::len).collect::<Vec<_>>(), [3]);
        let round = lanes.submit((0..200).map(|i| on(&[&format!("k{i}"), &format!("r{i}")])).collect());
        assert_eq!(round.len(), 200, "200 independent calls start together");
        let other_group = job(vec!["a".into()], "h".into(), None, |_, _| ((), vec![])).0;
        assert!(lanes.submit(vec![on(&["a"]), other_group]).is_empty());
        let mut next = next;
        let after = lanes.release(&next.pop().unwrap().finish(&Ok(())));
        assert_eq!(after.iter().map(|b| (b.len(), b.group.as_str())).collect::<Vec<_>>(), [(1, "g")]);
    }
}
