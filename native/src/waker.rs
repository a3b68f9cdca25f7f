//! The clock that ends a paused request's wait, and that runs a global
//! configuration's timer: Envoy's dynamic module ABI has schedulers (a
//! stream's event, run on its worker; a configuration's, run on Envoy's
//! main thread; both posted from any thread) but no timers, so one thread
//! of the module's own sleeps until the next wake-up is due and posts it
//! through its scheduler ([`Wakeable`]). The stream's scheduled hook then
//! looks at its request on its worker (`crate::stream`), the
//! configuration's at its calls to the quota service (`crate::client`).
//!
//! A wake-up is cancelled when its stream goes away, under the same lock
//! the thread holds while it wakes streams, so no stream is woken after it
//! is gone; and the thread is stopped and joined when Envoy destroys the
//! last configuration, so no code of the module runs once Envoy may unload
//! it. It starts at the first pause, so `envoy --mode validate` starts none.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use floodgate_core::time::Nanos;

use crate::abi::Scheduler;

/// The event a stream is woken with: its wait may be over (its time came,
/// or the quota service answered).
pub const WAKE: u64 = 1;

/// What a wake-up wakes: it posts an event through a scheduler, from the
/// waker's thread.
pub trait Wakeable: Send + Sync {
    /// Posts the wake-up.
    fn wake_up(&self);
}

impl Wakeable for Scheduler {
    fn wake_up(&self) {
        self.wake(WAKE);
    }
}

#[derive(Default)]
struct State {
    /// When each wake-up is due, earliest first (cancelled ones stay until due).
    due: BinaryHeap<Reverse<(Nanos, u64)>>,
    /// Wake-ups not yet done, by token.
    pending: HashMap<u64, Arc<dyn Wakeable>>,
    next_token: u64,
    thread: Option<JoinHandle<()>>,
    configurations: usize,
    stopping: bool,
}

struct Waker {
    state: Mutex<State>,
    changed: Condvar,
}

fn waker() -> &'static Waker {
    static WAKER: OnceLock<Waker> = OnceLock::new();
    WAKER.get_or_init(|| Waker { state: Mutex::default(), changed: Condvar::new() })
}

fn lock() -> MutexGuard<'static, State> {
    waker().state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Wakes `target` at `at`; a token to cancel it with, or `None` when no
/// thread could be started (the caller then does not wait).
pub fn wake_at(at: Nanos, target: Arc<dyn Wakeable>) -> Option<u64> {
    let mut state = lock();
    // None yet, or it ended (it cannot panic, but if it did, a new one takes over).
    if state.thread.as_ref().is_none_or(JoinHandle::is_finished) {
        state.stopping = false;
        let thread = std::thread::Builder::new().name("floodgate-waker".into()).spawn(run);
        match thread {
            Ok(thread) => state.thread = Some(thread),
            Err(error) => {
                log::error!("floodgate: cannot start the thread that ends delays: {error}");
                return None;
            }
        }
    }
    state.next_token += 1;
    let token = state.next_token;
    state.pending.insert(token, target);
    state.due.push(Reverse((at, token)));
    waker().changed.notify_one();
    Some(token)
}

/// Cancels wake-up `token`: once this returns, it will not happen.
pub fn cancel(token: u64) {
    lock().pending.remove(&token);
}

/// Envoy created a configuration.
pub fn configuration_created() {
    lock().configurations += 1;
}

/// Envoy destroyed a configuration: after the last, the thread is stopped.
pub fn configuration_destroyed() {
    let thread = {
        let mut state = lock();
        state.configurations = state.configurations.saturating_sub(1);
        if state.configurations > 0 {
            return;
        }
        state.stopping = true;
        state.thread.take()
    };
    waker().changed.notify_one();
    if let Some(thread) = thread {
        let _ = thread.join();
    }
}

fn run() {
    let waker = waker();
    let mut state = lock();
    while !state.stopping {
        let now = crate::now();
        while let Some(&Reverse((at, token))) = state.due.peek() {
            if at > now {
                break;
            }
            state.due.pop();
            // Woken under the lock: a stream that cancels waits for this.
            if let Some(target) = state.pending.remove(&token) {
                target.wake_up();
            }
        }
        state = match state.due.peek() {
            Some(&Reverse((at, _))) => {
                let wait = Duration::from_nanos(at.get().saturating_sub(now.get()));
                waker.changed.wait_timeout(state, wait).map(|(state, _)| state).unwrap_or_else(|e| e.into_inner().0)
            }
            None => waker.changed.wait(state).unwrap_or_else(PoisonError::into_inner),
        };
    }
}
