//! What one configuration keeps on one worker thread, as the wasm build
//! keeps it in the worker's VM: the limiter (whose per-worker batches and
//! views of shared state belong to the worker), its store over process
//! memory, and the requests the worker keeps paused. Kept in a thread-local
//! list, built at the configuration's first stream on the thread, and
//! dropped once Envoy has destroyed the configuration.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

use floodgate_core::limiter::Limiter;
use floodgate_filter_common::log::RateLimitedLog;
use floodgate_filter_common::waiting::Waiting;

use crate::config::Shared;
use crate::memory::MemoryStore;
use crate::metrics::RuleIds;

/// One configuration on one worker.
pub struct Worker {
    /// The configuration.
    pub shared: Arc<Shared>,
    /// Its limiter on this worker.
    pub limiter: Limiter<RuleIds>,
    /// Process memory, as this worker reads it.
    pub store: MemoryStore,
    /// The requests this worker keeps paused.
    pub waiting: RefCell<Waiting>,
    /// Shadow-mode denials, logged at most once a second.
    pub shadow_log: RateLimitedLog,
    /// Failed checks, logged at most once a second.
    pub callout_log: RateLimitedLog,
    /// The number the next stream gets.
    next_id: Cell<u32>,
    /// The relay's count of mode switches when this worker last read the
    /// modes.
    modes_seen: Cell<u64>,
}

impl Worker {
    fn new(shared: &Arc<Shared>) -> Option<Worker> {
        // Read before the limiter reads the modes: a switch after it is seen.
        let modes_seen = Cell::new(shared.relay.modes());
        let store = shared.memory.store();
        let mut rule = 0;
        let ids = |_: &floodgate_core::config::Rule| {
            rule += 1;
            shared.metrics.rule(rule - 1)
        };
        // The groups exist (the main thread created them): this only reads
        // the hashing secret and sets the worker's own state up.
        let limiter = match Limiter::prepare(shared.config.clone(), &store, crate::entropy(), ids) {
            Ok(limiter) => limiter,
            Err(error) => {
                log::error!(
                    "floodgate: a worker cannot read the buckets in memory ({error}): its requests pass unlimited"
                );
                return None;
            }
        };
        let waiting = RefCell::new(Waiting::new(limiter.max_delayed_per_worker()));
        Some(Worker {
            shared: Arc::clone(shared),
            limiter,
            store,
            waiting,
            shadow_log: RateLimitedLog::default(),
            callout_log: RateLimitedLog::default(),
            next_id: Cell::new(0),
            modes_seen,
        })
    }

    /// Reads the global rules' modes (and the notices of keys near their
    /// limit) from memory if they changed since this worker last did: the
    /// wasm build's workers read them on their tick, these when told.
    pub fn sync_modes(&self) {
        if self.limiter.quota_service().is_none() {
            return;
        }
        let modes = self.shared.relay.modes();
        if modes != self.modes_seen.get() {
            self.modes_seen.set(modes);
            self.limiter.read_modes(&self.store);
        }
    }

    /// A number for a new stream, unique among this worker's paused ones.
    pub fn stream_id(&self) -> u32 {
        let id = self.next_id.get().wrapping_add(1);
        self.next_id.set(id);
        id
    }
}

thread_local! {
    static WORKERS: RefCell<Vec<Rc<Worker>>> = const { RefCell::new(Vec::new()) };
}

/// This thread's view of configuration `shared`, built at its first stream
/// here; `None` if it cannot be.
pub fn of(shared: &Arc<Shared>) -> Option<Rc<Worker>> {
    WORKERS.with(|workers| {
        if let Some(worker) = workers.borrow().iter().find(|w| Arc::ptr_eq(&w.shared, shared)) {
            return Some(Rc::clone(worker));
        }
        first_on_thread(workers, shared)
    })
}

/// Builds this thread's view of `shared` and keeps it in `workers`. Once a
/// configuration per thread: kept out of every stream's path, so that the
/// code and stack a stream's start touches stay small (each request's
/// module code and stack fall out of the CPU's caches while Envoy runs the
/// rest of the request, and are read back in by the next).
#[cold]
#[inline(never)]
fn first_on_thread(workers: &RefCell<Vec<Rc<Worker>>>, shared: &Arc<Shared>) -> Option<Rc<Worker>> {
    let worker = Rc::new(Worker::new(shared)?);
    let mut workers = workers.borrow_mut();
    // Views of configurations Envoy has destroyed go (streams still
    // holding one keep it until they end).
    workers.retain(|w| w.shared.alive());
    workers.push(Rc::clone(&worker));
    Some(worker)
}
