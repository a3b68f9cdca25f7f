//! What a store backend is: the one interface every store implements (as
//! limitador's `CounterStorage` or envoyproxy/ratelimit's `RateLimitCache`),
//! and how one is registered. A backend only keeps bytes under keys and
//! runs batches of decisions on them atomically; ordering ([`super::lanes`]),
//! the calls' orchestration (`calls.rs`) and every decision (`decide.rs`)
//! are shared. Adding a backend is its own file, one line in
//! [`super::BACKENDS`] and its docs.

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use floodgate_core::time::Clock;
use tokio::time::Instant;

use super::lanes::{Batch, Lanes};
use super::StoreFailure;

/// A boxed future, as trait methods return them.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A store backend.
pub trait Backend: std::fmt::Debug + Send + Sync + 'static {
    /// Its name for metrics and logs (`memory`, `redis`).
    fn name(&self) -> &'static str;

    /// The kinds of [`StoreFailure`] it can meet, as metric labels.
    fn failure_kinds(&self) -> &'static [&'static str];

    /// When a call starting now must have its answer (`None`: it waits as
    /// long as its decision takes, microseconds in memory).
    fn deadline(&self) -> Option<Instant>;

    /// Runs a round of batches: each one store transaction, atomic, decided
    /// by [`Batch::decide`] on its keys' bytes; the batches are independent
    /// (one's failure or contention is not the others'). Each batch is
    /// handed to `done` as soon as it has ended, with its outcome.
    fn run(self: Arc<Self>, round: Vec<Batch>, done: Arc<Finisher>) -> BoxFuture<'static, ()>;

    /// Whether it answers now.
    fn ping(&self) -> BoxFuture<'_, Result<(), StoreFailure>>;

    /// Drops some of what is no longer needed, one bounded step (a store
    /// that expires entries itself has nothing to do): returns how many
    /// entries the step dropped, and whether more may be due. The caller
    /// lets other tasks run between steps, so that a mass expiry never
    /// holds the thread that serves requests.
    fn sweep_step(&self) -> (usize, bool) {
        (0, false)
    }

    /// Whether its rounds end without waiting (no I/O): they then run on
    /// the caller's task instead of one of their own.
    fn inline(&self) -> bool {
        false
    }

    /// For tests and tools that look at one backend's own figures.
    fn as_any(&self) -> &dyn Any;
}

/// What opening a store may use, from the command line.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// The service's clock.
    pub clock: Arc<dyn Clock>,
    /// `--store-timeout`.
    pub timeout: Duration,
    /// `--redis-clock local`: decide on the service's clock, not Redis's.
    pub local_clock: bool,
    /// `--memory-max-buckets`.
    pub max_entries: usize,
    /// `--memory-restart reserve`: a memory store that starts counts what
    /// grants made before it may still spend (see `LocalStore::after_restart`);
    /// else it starts afresh.
    pub owe_earlier_grants: bool,
}

/// How a backend is opened: at the address `--store` gave, with the options.
pub type Open = fn(&str, &StoreOptions) -> Result<Arc<dyn Backend>, String>;

/// A backend as `--store` names it.
#[derive(Debug)]
pub struct BackendRegistration {
    /// Its name, as metrics label it.
    pub name: &'static str,
    /// How `--store` writes it, for messages.
    pub usage: &'static str,
    /// Whether a `--store` value is for it.
    pub accepts: fn(&str) -> bool,
    /// Opens it at the address `--store` gave.
    pub open: Open,
}

/// How many rounds of one group (one Redis Cluster slot) may be sent and
/// not yet answered. A batch made ready while its group has fewer out is
/// sent at once; the batches made ready while this many are out wait for
/// one's answer and then go together (group commit), so a quiet store
/// answers in one round trip and a busy one in few, large rounds. Two, not
/// one: with one, the service's building of a round and Redis's running of
/// the last never overlap (the A/B is in docs/benchmarks.md, "Quota
/// service"), and a hot key's probe is no slower with two. While small
/// calls have come lately and none waits, large calls' rounds take one of
/// the two (see [`Gathering::may_send`]).
const IN_FLIGHT: usize = 2;

/// Most calls (jobs) one round decides: a bound on the work of one script
/// (in memory, see [`INLINE_SLICE_JOBS`]), so that a call of
/// hundreds of leases is decided in rounds that take turns with other
/// calls' instead of in one script every other call of its slot waits
/// behind. A call of one lease then waits for at most the rounds out and
/// one more, whatever the size of the other calls (a flood of calls of 512
/// leases had a one-lease probe wait for scripts of thousands: p99 276 ms
/// on Redis, 49 ms in memory).
pub const ROUND_JOBS: usize = 64;

/// The batches ready to run, gathered into rounds by group commit: per
/// group (a hash tag: one Redis slot; each round is one script), a batch
/// made ready while fewer than [`IN_FLIGHT`] rounds of its group are out is
/// sent at once, on a task of its own that takes what is ready by the time
/// it runs; a batch made ready while that many are out joins the next
/// round, sent when one answers (when the backend first calls
/// [`Finisher::flush`]). A round holds at most [`ROUND_JOBS`] calls' jobs,
/// taken in turns from the calls waiting (one batch of each call in turn,
/// the small calls' turns first; see [`LARGE_BESIDE_SMALL`]), so a call's
/// place in the next round does not depend on how many leases the other
/// calls carry. A lone call so never waits for the event loop's
/// turn to end (the flood's calls of that turn gathered with it, which cost
/// the hot-key fairness probe ×5 its p99), and a busy store still sends one
/// script per answer, not one per call. A store whose rounds end at once
/// (the memory store's) runs them on the caller's task instead, a slice of
/// at most [`INLINE_SLICE_JOBS`] at a time, letting other tasks run between
/// slices.
pub struct Rounds {
    backend: Arc<dyn Backend>,
    lanes: Arc<Lanes>,
    /// Per group: the batches waiting for the next round, and how many of
    /// its rounds are out.
    groups: Mutex<HashMap<String, Gathering>>,
}

/// Most jobs of large calls (of more than [`ROUND_JOBS`] jobs) in a round
/// that carries a small call's: the small call's script (or, in memory, the
/// slice it waits behind) is then an eighth of a full round, and the large
/// calls still have these many jobs of every round, however many small
/// calls wait (their starvation bound: small calls take at most
/// `ROUND_JOBS - LARGE_BESIDE_SMALL` jobs of a round while large ones wait).
/// With 16, a one-lease probe's p99 beside calls of 512 on Redis was 3.0×
/// its p99 alone; with 8, 2.1–2.6× (docs/benchmarks.md).
pub const LARGE_BESIDE_SMALL: usize = 8;

/// How many rounds after one that carried a small call's batch the large
/// calls' rounds stay at [`LARGE_BESIDE_SMALL`] jobs. A small call that
/// arrives while rounds are out waits behind them (on Redis, in the same
/// connection's queue): while small calls keep coming, the rounds they
/// find out are short ones, not full rounds of [`ROUND_JOBS`] sent in the
/// instant between two of them (a one-lease probe beside calls of 512:
/// its p50 2.6 → 1.0 ms, docs/benchmarks.md). A group with no small calls
/// lately keeps full rounds, which carry large calls a quarter faster.
pub const SMALL_CALL_ROUNDS: usize = 32;

/// Most jobs a store whose rounds run on the caller's task (the memory
/// store's) decides before letting the other tasks run: a slice of a call
/// of 512 leases is then a stretch of tens of microseconds, not the
/// hundreds a slice of [`ROUND_JOBS`] took (on one core, a call of one
/// lease waits behind a slice of each large call under way).
pub const INLINE_SLICE_JOBS: usize = 16;

/// Whether a call of `jobs` jobs is large: it takes its turns after the
/// small calls' (see [`Waiting::round`]).
fn large(jobs: usize) -> bool {
    jobs > ROUND_JOBS
}

/// Batches waiting for a round, by call, and the order the calls take
/// their turns in: small calls' turns first, then large calls'.
#[derive(Default)]
struct Waiting {
    /// Each waiting call's batches, in order.
    calls: HashMap<u64, VecDeque<Batch>>,
    /// The waiting small calls (at most [`ROUND_JOBS`] jobs), in the order
    /// they take their turns.
    small: VecDeque<u64>,
    /// The waiting large calls, in the order they take their turns.
    large: VecDeque<u64>,
    /// Rounds left during which large calls take at most
    /// [`LARGE_BESIDE_SMALL`] jobs of a round (see [`SMALL_CALL_ROUNDS`]).
    small_lately: usize,
}

impl Waiting {
    fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    fn push(&mut self, batch: Batch) {
        let (call, is_large) = (batch.call, large(batch.call_jobs));
        match self.calls.get_mut(&call) {
            Some(queue) => queue.push_back(batch),
            None => {
                self.calls.insert(call, VecDeque::from([batch]));
                match is_large {
                    true => self.large.push_back(call),
                    false => self.small.push_back(call),
                }
            }
        }
    }

    /// The next round of at most `most` jobs (at least one batch, if any
    /// waits): one batch of each waiting small call in turn (a call with
    /// more goes to the back), then of each large call in turn. Beside a
    /// small call's batch, and for [`SMALL_CALL_ROUNDS`] rounds after one,
    /// the large calls take at most [`LARGE_BESIDE_SMALL`] jobs, and while
    /// large calls wait the small ones leave them that many: a call of one
    /// lease waits behind short rounds, and large calls are never starved.
    fn round(&mut self, most: usize) -> Vec<Batch> {
        let mut round = Vec::new();
        let beside = LARGE_BESIDE_SMALL.min(most);
        let small_most = if self.large.is_empty() { most } else { most - beside };
        Self::take_turns(&mut self.calls, &mut self.small, small_most, &mut round);
        let carries_small = !round.is_empty();
        let large_most = if carries_small || self.small_lately > 0 { beside } else { most };
        self.small_lately = match carries_small {
            true => SMALL_CALL_ROUNDS,
            false => self.small_lately.saturating_sub(1),
        };
        Self::take_turns(&mut self.calls, &mut self.large, large_most, &mut round);
        round
    }

    /// Adds to `round` one batch of each call of `turns` in turn until it
    /// holds `most` jobs of them (at least one batch, if any waits).
    fn take_turns(
        calls: &mut HashMap<u64, VecDeque<Batch>>,
        turns: &mut VecDeque<u64>,
        most: usize,
        round: &mut Vec<Batch>,
    ) {
        let mut jobs = 0;
        while jobs < most.max(1) {
            let Some(call) = turns.pop_front() else { break };
            let Some(queue) = calls.get_mut(&call) else { continue };
            let Some(batch) = queue.pop_front() else {
                calls.remove(&call);
                continue;
            };
            jobs += batch.len().max(1);
            round.push(batch);
            if queue.is_empty() {
                calls.remove(&call);
            } else {
                turns.push_back(call);
            }
        }
    }
}

/// One group's batches waiting for a round, and its rounds out.
#[derive(Default)]
struct Gathering {
    waiting: Waiting,
    in_flight: usize,
    /// A round is on its way (counted in `in_flight`, its task not yet run):
    /// what is made ready meanwhile goes with it.
    pending: bool,
}

impl Gathering {
    /// Whether one more round may go now: fewer than [`IN_FLIGHT`] out, and
    /// while small calls have come lately but none waits, one round of the
    /// large calls' at a time — the other is kept for the next small call,
    /// which then goes at once and finds Redis behind one short round, not
    /// two (and Redis, less busy, more often idle: a one-lease probe's p99
    /// beside calls of 512, 6.4–9.5 → 4.0–4.6 ms).
    fn may_send(&self) -> bool {
        let most = match self.waiting.small.is_empty() && self.waiting.small_lately > 0 {
            true => 1,
            false => IN_FLIGHT,
        };
        !self.pending && !self.waiting.is_empty() && self.in_flight < most
    }

    /// Counts a round about to be sent, if one may go now.
    fn start_round(&mut self) -> bool {
        let send = self.may_send();
        if send {
            self.in_flight += 1;
            self.pending = true;
        }
        send
    }
}

impl std::fmt::Debug for Rounds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rounds").finish_non_exhaustive()
    }
}

impl Rounds {
    /// The rounds of `backend`'s batches, ordered by `lanes`.
    pub fn new(backend: Arc<dyn Backend>, lanes: Arc<Lanes>) -> Arc<Self> {
        Arc::new(Rounds { backend, lanes, groups: Mutex::new(HashMap::new()) })
    }

    /// Runs `ready`: on this task for a store whose rounds end at once (with
    /// whatever they make ready), in slices, else by group commit (see
    /// [`Rounds`]).
    pub async fn start(self: &Arc<Self>, ready: Vec<Batch>) {
        if ready.is_empty() {
            return;
        }
        if self.backend.inline() {
            drive(Arc::clone(self), None, ready).await;
        } else {
            self.gather(ready);
        }
    }

    fn groups(&self) -> std::sync::MutexGuard<'_, HashMap<String, Gathering>> {
        // Each field is replaced whole: a poisoned lock is still consistent.
        self.groups.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds `ready` to its groups' waiting batches, and sends a round of
    /// each group that has room for one more out and none on its way.
    fn gather(self: &Arc<Self>, ready: Vec<Batch>) {
        let mut send = Vec::new();
        {
            let mut groups = self.groups();
            for batch in ready {
                let gathering = match groups.get_mut(&batch.group) {
                    Some(gathering) => gathering,
                    None => groups.entry(batch.group.clone()).or_default(),
                };
                let group = batch.group.clone();
                gathering.waiting.push(batch);
                if gathering.start_round() {
                    send.push(group);
                }
            }
        }
        for group in send {
            self.send(group);
        }
    }

    /// Sends `group`'s next round (one of its rounds out is counted for
    /// it already) on a task of its own: a caller that leaves cannot strand
    /// the others. The task takes the round when it runs, so that what is
    /// made ready before then goes along; what does not fit goes in the
    /// next round, sent at once if the group has room for one more out.
    fn send(self: &Arc<Self>, group: String) {
        let rounds = Arc::clone(self);
        tokio::spawn(async move {
            let (round, more) = match rounds.groups().get_mut(&group) {
                Some(gathering) => {
                    let round = gathering.waiting.round(ROUND_JOBS);
                    gathering.pending = false;
                    (round, gathering.start_round())
                }
                None => (Vec::new(), false),
            };
            if more {
                rounds.send(group.clone());
            }
            drive(rounds, Some(group), round).await;
        });
    }

    /// One of `group`'s rounds has answered: the next one goes now, if any
    /// batch waits for it.
    fn answered(self: &Arc<Self>, group: &str) {
        let send = {
            let mut groups = self.groups();
            let Some(gathering) = groups.get_mut(group) else { return };
            gathering.in_flight = gathering.in_flight.saturating_sub(1);
            if gathering.start_round() {
                true
            } else {
                if gathering.waiting.is_empty() && gathering.in_flight == 0 {
                    // An idle group holds no entry (the domains' tags are few,
                    // but nothing bounds them).
                    groups.remove(group);
                }
                false
            }
        };
        if send {
            self.send(group.to_string());
        }
    }
}

/// Where a backend hands back each batch it ran: the batch's callers learn
/// its outcome and its lanes are released; the batches that can start then
/// join the next round once the backend flushes (see [`Finisher::flush`]),
/// or run when its round ends.
pub struct Finisher {
    rounds: Arc<Rounds>,
    /// The group whose round this is (`None`: an inline store's).
    group: Option<String>,
    /// Whether the round has answered (counted off its group's rounds out).
    answered: AtomicBool,
    later: Mutex<Vec<Batch>>,
}

impl std::fmt::Debug for Finisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Finisher").finish_non_exhaustive()
    }
}

impl Finisher {
    /// Ends `batch` with `outcome`.
    pub fn finish(&self, batch: Batch, outcome: &Result<(), StoreFailure>) {
        let lanes = batch.finish(outcome);
        let ready = self.rounds.lanes.release(&lanes);
        if !ready.is_empty() {
            self.later.lock().unwrap_or_else(|p| p.into_inner()).extend(ready);
        }
    }

    /// Starts what the batches ended so far let start, without waiting for
    /// the rest of this round, and, the first time, counts the round as
    /// answered: its group's next round goes now (a backend calls it after
    /// each answer; an inline store's rounds end at once, and start the
    /// next themselves). Batches of the round still open (a lost race,
    /// tried again) no longer hold the group's other calls.
    pub fn flush(&self) {
        if self.rounds.backend.inline() {
            return;
        }
        let ready = self.take_later();
        if !ready.is_empty() {
            self.rounds.gather(ready);
        }
        self.answer();
    }

    fn answer(&self) {
        if let Some(group) = &self.group {
            if !self.answered.swap(true, Ordering::AcqRel) {
                self.rounds.answered(group);
            }
        }
    }

    fn take_later(&self) -> Vec<Batch> {
        std::mem::take(&mut *self.later.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// Runs `ready` as one round and then whatever it made ready and did not
/// hand on (an inline store's rounds: everything they make ready, in slices
/// of at most [`INLINE_SLICE_JOBS`] jobs taken in turns between calls, with the
/// task yielding between slices, so that a call of hundreds of leases
/// holds the thread no longer than a slice at a time; a group's rounds:
/// into the group's next round); a group's round that ended without
/// answering (no flush) is counted as answered at its end.
async fn drive(rounds: Arc<Rounds>, group: Option<String>, ready: Vec<Batch>) {
    let backend = Arc::clone(&rounds.backend);
    let inline = group.is_none();
    let done = Arc::new(Finisher {
        rounds: Arc::clone(&rounds),
        group,
        answered: AtomicBool::new(false),
        later: Mutex::new(Vec::new()),
    });
    if !inline {
        Arc::clone(&backend).run(ready, Arc::clone(&done)).await;
        let later = done.take_later();
        if !later.is_empty() {
            rounds.gather(later);
        }
        done.answer();
        return;
    }
    let mut waiting = Waiting::default();
    if slice(&backend, &done, &mut waiting, ready).await {
        // Other tasks (another connection's call of one lease) run before
        // the next slice. The caller may leave while they do (its client
        // hung up): the slices left run on a task of their own, so that
        // what it leaves is still decided and its keys' lanes released (a
        // lane held by a batch dropped undecided would hold every later
        // call of its key, forever).
        let rest = tokio::spawn(async move {
            loop {
                tokio::task::yield_now().await;
                if !slice(&backend, &done, &mut waiting, Vec::new()).await {
                    break;
                }
            }
        });
        // Its outcome is the batches' own, handed to their callers.
        let _ = rest.await;
    }
}

/// Decides an inline store's next slice of `waiting` (with `ready` joining
/// it first): at most [`INLINE_SLICE_JOBS`] jobs taken in turns between
/// calls; what they make ready joins `waiting`. Returns whether any waits.
async fn slice(backend: &Arc<dyn Backend>, done: &Arc<Finisher>, waiting: &mut Waiting, ready: Vec<Batch>) -> bool {
    ready.into_iter().for_each(|batch| waiting.push(batch));
    let slice = waiting.round(INLINE_SLICE_JOBS);
    if slice.is_empty() {
        return false;
    }
    Arc::clone(backend).run(slice, Arc::clone(done)).await;
    done.take_later().into_iter().for_each(|batch| waiting.push(batch));
    !waiting.is_empty()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::store::lanes::job;

    /// A backend that records each round's keys and answers a round only
    /// when the test lets it (one permit per round).
    #[derive(Debug)]
    struct Gated {
        rounds: Mutex<Vec<Vec<String>>>,
        gate: tokio::sync::Semaphore,
    }

    impl Gated {
        fn sent(&self) -> Vec<Vec<String>> {
            self.rounds.lock().unwrap().clone()
        }
    }

    impl Backend for Gated {
        fn name(&self) -> &'static str {
            "gated"
        }
        fn failure_kinds(&self) -> &'static [&'static str] {
            &[]
        }
        fn deadline(&self) -> Option<Instant> {
            None
        }
        fn run(self: Arc<Self>, round: Vec<Batch>, done: Arc<Finisher>) -> BoxFuture<'static, ()> {
            Box::pin(async move {
                self.rounds.lock().unwrap().push(round.iter().flat_map(|b| b.keys.clone()).collect());
                self.gate.acquire().await.unwrap().forget();
                for batch in round {
                    done.finish(batch, &Ok(()));
                }
                done.flush();
            })
        }
        fn ping(&self) -> BoxFuture<'_, Result<(), StoreFailure>> {
            Box::pin(async { Ok(()) })
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    fn store() -> (Arc<Gated>, Arc<Lanes>, Arc<Rounds>) {
        let gated = Arc::new(Gated { rounds: Mutex::new(Vec::new()), gate: tokio::sync::Semaphore::new(0) });
        let lanes = Arc::new(Lanes::default());
        let backend: Arc<dyn Backend> = Arc::clone(&gated) as Arc<dyn Backend>;
        let rounds = Rounds::new(backend, Arc::clone(&lanes));
        (gated, lanes, rounds)
    }

    /// Submits a call on `key` (group `g`) and starts what is ready.
    async fn call(lanes: &Lanes, rounds: &Arc<Rounds>, key: &str) -> Settled {
        let (job, settled, _) = job(vec![key.to_string()], "g".into(), None, |_, _| ((), vec![None]));
        rounds.start(lanes.submit(vec![job])).await;
        settled
    }

    use crate::store::lanes::Settled;

    /// A lone call's round is sent as soon as its task runs, not after the
    /// event loop's turn: a task spawned after the call already finds it
    /// sent (the rounds of the last pass yielded to the turn's end first,
    /// so the flood's calls of that turn went with the probe's).
    #[tokio::test(flavor = "current_thread")]
    async fn a_lone_batch_is_sent_without_waiting_for_the_turn() {
        let (gated, lanes, rounds) = store();
        let _a = call(&lanes, &rounds, "a").await;
        let seen = Arc::clone(&gated);
        let observer = tokio::spawn(async move { seen.sent() });
        assert_eq!(observer.await.unwrap(), [vec!["a".to_string()]], "sent before a task spawned after it ran");
    }

    /// Group commit: while a group has its most rounds out, the batches
    /// made ready are not sent (the last pass sent a round per turn,
    /// however many were out); when one answers they go together, as one
    /// round.
    #[tokio::test(flavor = "current_thread")]
    async fn batches_made_ready_while_rounds_are_out_go_together_when_one_answers() {
        let (gated, lanes, rounds) = store();
        let mut out = Vec::new();
        let mut sent = Vec::new();
        for i in 0..IN_FLIGHT {
            out.push(call(&lanes, &rounds, &format!("a{i}")).await);
            settle().await;
            sent.push(vec![format!("a{i}")]);
            assert_eq!(gated.sent(), sent, "a call goes at once while fewer than IN_FLIGHT rounds are out");
        }
        let b = call(&lanes, &rounds, "b").await;
        settle().await;
        let c = call(&lanes, &rounds, "c").await;
        settle().await;
        assert_eq!(gated.sent(), sent, "nothing more is sent while IN_FLIGHT rounds are out");
        gated.gate.add_permits(1);
        out.remove(0).await.unwrap().unwrap();
        settle().await;
        sent.push(vec!["b".into(), "c".into()]);
        assert_eq!(gated.sent(), sent, "b and c in one round once one round answered");
        gated.gate.add_permits(IN_FLIGHT);
        for call in out {
            call.await.unwrap().unwrap();
        }
        b.await.unwrap().unwrap();
        c.await.unwrap().unwrap();
        settle().await;
        // Idle again: the next call goes at once, alone.
        let d = call(&lanes, &rounds, "d").await;
        settle().await;
        assert_eq!(gated.sent().last().unwrap(), &["d"]);
        gated.gate.add_permits(1);
        d.await.unwrap().unwrap();
        settle().await;
        assert!(rounds.groups().is_empty(), "an idle group holds no entry");
    }

    /// Rounds are out per group (one Redis slot each): a slot's rounds out
    /// hold none of another slot's calls.
    #[tokio::test(flavor = "current_thread")]
    async fn a_round_out_holds_no_other_group() {
        let (gated, lanes, rounds) = store();
        let out: Vec<Settled> = {
            let mut out = Vec::new();
            for i in 0..IN_FLIGHT {
                out.push(call(&lanes, &rounds, &format!("a{i}")).await);
            }
            out
        };
        settle().await;
        let (job, other, _) = job(vec!["b".to_string()], "h".into(), None, |_, _| ((), vec![None]));
        rounds.start(lanes.submit(vec![job])).await;
        settle().await;
        assert_eq!(gated.sent().last().unwrap(), &["b"], "group h's call is sent while g's rounds are out");
        gated.gate.add_permits(IN_FLIGHT + 1);
        for call in out {
            call.await.unwrap().unwrap();
        }
        other.await.unwrap().unwrap();
    }

    /// Submits one call of `count` jobs, each on a key of its own
    /// (`{name}{i}`), and starts what is ready.
    async fn big_call(lanes: &Lanes, rounds: &Arc<Rounds>, name: &str, count: usize) -> Vec<Settled> {
        let mut jobs = Vec::with_capacity(count);
        let mut settled = Vec::with_capacity(count);
        for i in 0..count {
            let (job, done, _) = job(vec![format!("{name}{i}")], "g".into(), None, |_, _| ((), vec![None]));
            jobs.push(job);
            settled.push(done);
        }
        rounds.start(lanes.submit(jobs)).await;
        settled
    }

    /// A call of many leases is decided in rounds of at most `ROUND_JOBS`
    /// jobs, taken in turns between the calls waiting: a call of one lease
    /// made while calls of 192 wait goes in the next round sent, with a
    /// turn of each of them (the last pass put every batch ready in one
    /// round: rounds of 192, 192 and 193 jobs, the call of one lease in the
    /// last).
    #[tokio::test(flavor = "current_thread")]
    async fn rounds_are_bounded_and_take_turns_between_calls() {
        let (gated, lanes, rounds) = store();
        let mut flood = Vec::new();
        for name in ["a", "b", "c"] {
            flood.extend(big_call(&lanes, &rounds, name, 3 * ROUND_JOBS).await);
            settle().await;
        }
        assert_eq!(gated.sent().len(), IN_FLIGHT, "rounds out: as many as may be");
        let probe = call(&lanes, &rounds, "probe").await;
        settle().await;
        gated.gate.add_permits(1);
        settle().await;
        let sent = gated.sent();
        let sizes: Vec<usize> = sent.iter().map(Vec::len).collect();
        assert!(sizes.iter().all(|jobs| *jobs <= ROUND_JOBS), "rounds of {sizes:?} jobs");
        let probe_round = sent.iter().position(|round| round.contains(&"probe".to_string()));
        assert_eq!(probe_round, Some(IN_FLIGHT), "the probe goes in the round sent after one answers: {sizes:?}");
        // The flood's calls took turns in it too.
        let round = &sent[IN_FLIGHT];
        for name in ["a", "b", "c"] {
            assert!(round.iter().any(|key| key.starts_with(name)), "call {name} has its turn in {round:?}");
        }
        gated.gate.add_permits(1_000);
        probe.await.unwrap().unwrap();
        for call in flood {
            call.await.unwrap().unwrap();
        }
    }

    /// Small calls first, large ones beside them held short: a call of one lease made while calls of 320 wait goes first
    /// in the next round sent, with at most `LARGE_BESIDE_SMALL` of their
    /// jobs (the last pass filled its round to `ROUND_JOBS` with them, and
    /// the probe's script was a full round's); the large calls' rounds stay
    /// that short for `SMALL_CALL_ROUNDS` rounds, then fill again.
    #[tokio::test(flavor = "current_thread")]
    async fn a_small_call_goes_first_and_large_calls_beside_it_are_held_short() {
        let (gated, lanes, rounds) = store();
        let mut flood = Vec::new();
        for name in ["a", "b", "c"] {
            flood.extend(big_call(&lanes, &rounds, name, 5 * ROUND_JOBS).await);
            settle().await;
        }
        let probe = call(&lanes, &rounds, "probe").await;
        settle().await;
        gated.gate.add_permits(1);
        settle().await;
        let sent = gated.sent();
        let round = &sent[IN_FLIGHT];
        assert_eq!(round.first().map(String::as_str), Some("probe"), "the small call goes first: {round:?}");
        assert_eq!(round.len(), 1 + LARGE_BESIDE_SMALL, "large calls' jobs beside it: {round:?}");
        // The next rounds stay short while a small call may follow; then
        // the large calls fill their rounds again.
        for _ in 0..=SMALL_CALL_ROUNDS {
            gated.gate.add_permits(1);
            settle().await;
        }
        let sizes: Vec<usize> = gated.sent().iter().map(Vec::len).collect();
        let after = &sizes[IN_FLIGHT + 1..];
        assert_eq!(after.len(), SMALL_CALL_ROUNDS + 1, "rounds of {sizes:?} jobs");
        assert!(after[..SMALL_CALL_ROUNDS].iter().all(|jobs| *jobs == LARGE_BESIDE_SMALL), "{sizes:?}");
        assert_eq!(after[SMALL_CALL_ROUNDS], ROUND_JOBS, "rounds of {sizes:?} jobs");
        gated.gate.add_permits(1_000);
        probe.await.unwrap().unwrap();
        for call in flood {
            call.await.unwrap().unwrap();
        }
    }

    /// While small calls come and none waits, the large calls keep one
    /// round out, not two: the other is the next small call's, sent at once
    /// (before, it waited for one of the large calls' rounds to answer and
    /// then queued behind the other in Redis).
    #[tokio::test(flavor = "current_thread")]
    async fn while_small_calls_come_large_calls_keep_one_round_out() {
        let (gated, lanes, rounds) = store();
        let flood = big_call(&lanes, &rounds, "a", 6 * ROUND_JOBS).await;
        settle().await;
        assert_eq!(gated.sent().len(), IN_FLIGHT, "no small call lately: the large call's rounds fill both");
        let first = call(&lanes, &rounds, "probe0").await;
        settle().await;
        gated.gate.add_permits(1);
        settle().await;
        assert!(gated.sent()[IN_FLIGHT].contains(&"probe0".to_string()), "the probe goes when one answers");
        // The other full round and the probe's answer: one large round goes.
        gated.gate.add_permits(2);
        settle().await;
        first.await.unwrap().unwrap();
        let out = gated.sent().len();
        let second = call(&lanes, &rounds, "probe1").await;
        settle().await;
        let sent = gated.sent();
        assert_eq!(sent.len(), out + 1, "the next small call's round goes at once");
        assert!(sent[out].contains(&"probe1".to_string()), "{:?}", sent[out]);
        gated.gate.add_permits(10_000);
        second.await.unwrap().unwrap();
        for call in flood {
            call.await.unwrap().unwrap();
        }
    }

    /// Small calls never starve large ones: however many wait, a round
    /// leaves `LARGE_BESIDE_SMALL` of its jobs to the large calls waiting.
    #[tokio::test(flavor = "current_thread")]
    async fn many_small_calls_leave_large_calls_their_share_of_a_round() {
        let (gated, lanes, rounds) = store();
        let mut out = Vec::new();
        for i in 0..IN_FLIGHT {
            out.push(call(&lanes, &rounds, &format!("first{i}")).await);
            settle().await;
        }
        let big = big_call(&lanes, &rounds, "big", 2 * ROUND_JOBS).await;
        let mut small = Vec::new();
        for i in 0..2 * ROUND_JOBS {
            small.push(call(&lanes, &rounds, &format!("s{i}")).await);
        }
        settle().await;
        gated.gate.add_permits(1);
        settle().await;
        let sent = gated.sent();
        let round = &sent[IN_FLIGHT];
        let large = round.iter().filter(|key| key.starts_with("big")).count();
        assert_eq!(large, LARGE_BESIDE_SMALL, "the large call's share: {round:?}");
        assert_eq!(round.len(), ROUND_JOBS, "a round stays bounded: {round:?}");
        gated.gate.add_permits(1_000);
        for call in out.into_iter().chain(big).chain(small) {
            call.await.unwrap().unwrap();
        }
    }

    /// A store whose rounds end at once, recording each slice's size.
    #[derive(Debug, Default)]
    struct Inline {
        slices: Mutex<Vec<usize>>,
    }

    impl Backend for Inline {
        fn name(&self) -> &'static str {
            "inline"
        }
        fn failure_kinds(&self) -> &'static [&'static str] {
            &[]
        }
        fn deadline(&self) -> Option<Instant> {
            None
        }
        fn run(self: Arc<Self>, round: Vec<Batch>, done: Arc<Finisher>) -> BoxFuture<'static, ()> {
            self.slices.lock().unwrap().push(round.iter().map(Batch::len).sum());
            for batch in round {
                done.finish(batch, &Ok(()));
            }
            Box::pin(std::future::ready(()))
        }
        fn ping(&self) -> BoxFuture<'_, Result<(), StoreFailure>> {
            Box::pin(async { Ok(()) })
        }
        fn inline(&self) -> bool {
            true
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    /// A store whose rounds run on the caller's task decides a large call
    /// in slices of at most `INLINE_SLICE_JOBS` jobs, yielding between them:
    /// a task spawned before the call runs before its last slice (the last
    /// pass ran slices of `ROUND_JOBS`).
    #[tokio::test(flavor = "current_thread")]
    async fn an_inline_store_decides_a_large_call_in_short_slices() {
        let inline = Arc::new(Inline::default());
        let lanes = Arc::new(Lanes::default());
        let rounds = Rounds::new(Arc::clone(&inline) as Arc<dyn Backend>, Arc::clone(&lanes));
        let seen = Arc::clone(&inline);
        let other = tokio::spawn(async move { seen.slices.lock().unwrap().len() });
        let settled = big_call(&lanes, &rounds, "k", 8 * ROUND_JOBS).await;
        let slices = inline.slices.lock().unwrap().clone();
        assert!(slices.iter().all(|jobs| *jobs <= INLINE_SLICE_JOBS), "slices of {slices:?} jobs");
        assert_eq!(slices.iter().sum::<usize>(), 8 * ROUND_JOBS);
        let before_it_ran = other.await.unwrap();
        assert!(before_it_ran < slices.len(), "another task ran after {before_it_ran} of {} slices", slices.len());
        for call in settled {
            call.await.unwrap().unwrap();
        }
    }

    /// Lets every task that can run, run (several turns of the event loop).
    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }
}
