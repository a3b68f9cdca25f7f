//! What a store backend is: the one interface every store implements (as
//! limitador's `CounterStorage` or envoyproxy/ratelimit's `RateLimitCache`),
//! and how one is registered. A backend only keeps bytes under keys and
//! runs batches of decisions on them atomically; ordering ([`super::lanes`]),
//! the calls' orchestration (`calls.rs`) and every decision (`decide.rs`)
//! are shared. Adding a backend is its own file, one line in
//! [`super::BACKENDS`] and its docs.

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
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

/// The batches ready to run, gathered into rounds. A store whose rounds
/// wait for I/O runs on its own task the batches made ready within one turn
/// of the event loop, by every call of that turn, as one round (on Redis:
/// one script per slot, not one per call; a flood of checks on distinct
/// keys from 32 connections cost a script each). The first batch made ready
/// schedules the round's task, which lets the other tasks ready in this
/// turn run first ([`tokio::task::yield_now`] is deferred past the next
/// look for I/O), then takes every batch made ready meanwhile. A store
/// whose rounds end at once (the memory store's) runs them on the caller's
/// task instead.
pub struct Rounds {
    backend: Arc<dyn Backend>,
    lanes: Arc<Lanes>,
    /// Made ready since the scheduled round took its batches; not empty
    /// only while a round's task is scheduled to take them.
    pending: Mutex<Vec<Batch>>,
}

impl std::fmt::Debug for Rounds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rounds").finish_non_exhaustive()
    }
}

impl Rounds {
    /// The rounds of `backend`'s batches, ordered by `lanes`.
    pub fn new(backend: Arc<dyn Backend>, lanes: Arc<Lanes>) -> Arc<Self> {
        Arc::new(Rounds { backend, lanes, pending: Mutex::new(Vec::new()) })
    }

    /// Runs `ready`: on this task for a store whose rounds end at once (with
    /// whatever they make ready), else in the next round (see [`Rounds`]).
    pub async fn start(self: &Arc<Self>, ready: Vec<Batch>) {
        if ready.is_empty() {
            return;
        }
        if self.backend.inline() {
            drive(Arc::clone(self), ready).await;
        } else {
            self.gather(ready);
        }
    }

    /// Adds `ready` to the next round, scheduling its task if none is.
    fn gather(self: &Arc<Self>, ready: Vec<Batch>) {
        let schedule = {
            let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            let schedule = pending.is_empty();
            pending.extend(ready);
            schedule
        };
        if schedule {
            // A task of its own: a caller that leaves cannot strand the others.
            let rounds = Arc::clone(self);
            tokio::spawn(async move {
                tokio::task::yield_now().await;
                let round = std::mem::take(&mut *rounds.pending.lock().unwrap_or_else(|p| p.into_inner()));
                drive(rounds, round).await;
            });
        }
    }
}

/// Where a backend hands back each batch it ran: the batch's callers learn
/// its outcome and its lanes are released; the batches that can start then
/// join the next round once the backend flushes (see [`Finisher::flush`]),
/// or run when its round ends.
pub struct Finisher {
    rounds: Arc<Rounds>,
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

    /// Starts what the batches ended so far let start, in the next round,
    /// without waiting for the rest of this one (a backend calls it after
    /// each answer that ended batches; an inline store's rounds end at once,
    /// and start the next themselves).
    pub fn flush(&self) {
        if self.rounds.backend.inline() {
            return;
        }
        let ready = self.take_later();
        if !ready.is_empty() {
            self.rounds.gather(ready);
        }
    }

    fn take_later(&self) -> Vec<Batch> {
        std::mem::take(&mut *self.later.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// Runs `ready` as one round and then whatever it made ready and did not
/// hand on (an inline store's rounds: everything they make ready).
async fn drive(rounds: Arc<Rounds>, ready: Vec<Batch>) {
    let backend = Arc::clone(&rounds.backend);
    let done = Arc::new(Finisher { rounds, later: Mutex::new(Vec::new()) });
    let mut round = ready;
    while !round.is_empty() {
        Arc::clone(&backend).run(round, Arc::clone(&done)).await;
        round = done.take_later();
    }
}
