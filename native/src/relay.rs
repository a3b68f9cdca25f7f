//! What a configuration's workers and its main thread pass each other.
//! Lease refreshes and returns outlive any one request, so they are the
//! configuration's calls, made on Envoy's main thread (`crate::client`); a
//! worker whose request claimed a refresh hands it over here and posts the
//! configuration's scheduler. The other way, the main thread, having
//! applied a lease's answer, wakes every stream waiting for a refill
//! through its scheduler, and tells the workers when a rule switched into
//! or out of its fall-back (they read the modes from memory at their next
//! request). A configuration that goes away hands what it has to give back
//! to the quota service to another's relay, whose main thread sends it (a
//! configuration's own calls die with it).
//!
//! Every field is behind a lock or an atomic: workers, the main thread and
//! the waker's thread all reach it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use floodgate_core::global::calls::Refresh;
use floodgate_core::global::settings::QuotaService;
use floodgate_core::time::Nanos;

use crate::abi::{ConfigScheduler, Scheduler};
use crate::waker::{self, Wakeable, WAKE};

/// How often a global configuration's main-thread work runs when nothing
/// else calls for it: probes of a failing service, its rules' gauges, calls
/// held back (as the wasm build's worker tick).
pub const GLOBAL_TICK: Duration = Duration::from_millis(50);

/// The event a configuration's scheduler posts.
pub const RUN: u64 = 1;

/// What the main thread is handed to send.
#[derive(Debug, Default)]
pub struct Outbox {
    /// Lease refreshes this configuration's requests claimed.
    pub refreshes: Vec<Refresh>,
    /// Unspent tokens configurations that went away leave to give back to
    /// their quota service, `(lease, tokens)`.
    pub orphans: Vec<(QuotaService, Vec<(u64, u64)>)>,
}

/// The workers' and the main thread's meeting place (see the module docs).
#[derive(Default)]
pub struct Relay {
    outbox: Mutex<Outbox>,
    /// The main thread was posted and has not taken the outbox yet.
    posted: AtomicBool,
    /// Posts to the main thread; taken out when the configuration goes.
    scheduler: Mutex<Option<ConfigScheduler>>,
    /// Streams waiting for a refill, by registration.
    refill_waiters: Mutex<HashMap<u64, Arc<Scheduler>>>,
    next_waiter: AtomicU64,
    /// Lease answers applied so far.
    refills: AtomicU64,
    /// Mode switches (and notices) so far.
    modes: AtomicU64,
    /// The main thread's next wake-up, and its waker token.
    timer: Mutex<Option<(Nanos, u64)>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Relay {
    /// A relay posting to the main thread through `scheduler`.
    pub fn new(scheduler: ConfigScheduler) -> Self {
        Relay { scheduler: Mutex::new(Some(scheduler)), ..Relay::default() }
    }

    /// Posts the main thread (a no-op once the configuration has gone).
    pub fn post(&self) {
        if let Some(scheduler) = lock(&self.scheduler).as_ref() {
            scheduler.commit(RUN);
        }
    }

    /// Hands refreshes a request claimed to the main thread.
    pub fn hand_refreshes(&self, refreshes: Vec<Refresh>) {
        lock(&self.outbox).refreshes.extend(refreshes);
        self.posted();
    }

    /// Hands the main thread unspent tokens a configuration that went away
    /// leaves to give back to `service`.
    pub fn hand_orphans(&self, service: QuotaService, returns: Vec<(u64, u64)>) {
        lock(&self.outbox).orphans.push((service, returns));
        self.posted();
    }

    /// Posts the main thread unless a post is on its way already.
    fn posted(&self) {
        if !self.posted.swap(true, Ordering::AcqRel) {
            self.post();
        }
    }

    /// Takes what workers handed over (the main thread).
    pub fn take_outbox(&self) -> Outbox {
        // Cleared first: whatever is handed over after this posts again.
        self.posted.store(false, Ordering::Release);
        std::mem::take(&mut *lock(&self.outbox))
    }

    /// Registers a stream waiting for a refill, woken through `scheduler`
    /// after every lease answer; its registration.
    pub fn wait_for_refill(&self, scheduler: &Arc<Scheduler>) -> u64 {
        let key = self.next_waiter.fetch_add(1, Ordering::Relaxed);
        lock(&self.refill_waiters).insert(key, Arc::clone(scheduler));
        key
    }

    /// Ends a registration: once this returns, that stream is not woken.
    pub fn stop_waiting(&self, key: u64) {
        lock(&self.refill_waiters).remove(&key);
    }

    /// How many lease answers were applied: a request that finds its pool
    /// empty reads it before deciding, and wakes itself if it changed
    /// before it was registered.
    pub fn refills(&self) -> u64 {
        self.refills.load(Ordering::Acquire)
    }

    /// A lease answer was applied: every stream waiting for a refill looks
    /// at its pool again, on its worker.
    pub fn refilled(&self) {
        self.refills.fetch_add(1, Ordering::AcqRel);
        // Woken under the lock: a stream that stops waiting waits for this.
        for scheduler in lock(&self.refill_waiters).values() {
            scheduler.wake(WAKE);
        }
    }

    /// How many times rules switched mode or notices arrived.
    pub fn modes(&self) -> u64 {
        self.modes.load(Ordering::Acquire)
    }

    /// A rule switched mode, or notices arrived: workers read the modes
    /// from memory at their next request.
    pub fn modes_changed(&self) {
        self.modes.fetch_add(1, Ordering::AcqRel);
    }

    /// Has the main thread run at `at` (or at its wake-up already due
    /// earlier).
    pub fn run_at(self: &Arc<Self>, at: Nanos, now: Nanos) {
        let mut timer = lock(&self.timer);
        match *timer {
            Some((due, _)) if due > now && due <= at => return,
            Some((_, token)) => waker::cancel(token),
            None => {}
        }
        let target: Arc<dyn Wakeable> = Arc::clone(self) as Arc<dyn Wakeable>;
        *timer = waker::wake_at(at, target).map(|token| (at, token));
    }

    /// The configuration goes: nothing posts to it any more, its timer is
    /// cancelled and no stream is woken through it.
    pub fn close(&self) {
        drop(lock(&self.scheduler).take());
        if let Some((_, token)) = lock(&self.timer).take() {
            waker::cancel(token);
        }
        lock(&self.refill_waiters).clear();
    }
}

impl Wakeable for Relay {
    fn wake_up(&self) {
        self.post();
    }
}
