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

/// Where a backend hands back each batch it ran: the batch's callers learn
/// its outcome and its lanes are released; the batches that can start then
/// run as one round once the backend flushes (see [`Finisher::flush`]), or
/// when its round ends.
pub struct Finisher {
    backend: Arc<dyn Backend>,
    lanes: Arc<Lanes>,
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
        let ready = self.lanes.release(&lanes);
        if !ready.is_empty() {
            self.later.lock().unwrap_or_else(|p| p.into_inner()).extend(ready);
        }
    }

    /// Starts what the batches ended so far let start, as one round on a
    /// task of its own, without waiting for the rest of this round (a
    /// backend calls it after each answer that ended batches; an inline
    /// store's rounds end at once, and start the next themselves).
    pub fn flush(&self) {
        if self.backend.inline() {
            return;
        }
        let ready = self.take_later();
        if !ready.is_empty() {
            tokio::spawn(drive(Arc::clone(&self.backend), Arc::clone(&self.lanes), ready));
        }
    }

    fn take_later(&self) -> Vec<Batch> {
        std::mem::take(&mut *self.later.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// Runs `ready` and, for an inline store, whatever becomes ready meanwhile.
pub async fn drive(backend: Arc<dyn Backend>, lanes: Arc<Lanes>, ready: Vec<Batch>) {
    let done = Arc::new(Finisher { backend: Arc::clone(&backend), lanes, later: Mutex::new(Vec::new()) });
    let mut round = ready;
    while !round.is_empty() {
        Arc::clone(&backend).run(round, Arc::clone(&done)).await;
        round = done.take_later();
    }
}
