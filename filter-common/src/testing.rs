//! A fake worker for the tests of the request path and the quota client:
//! both hosts' traits over the core's in-memory store, on a fake clock,
//! recording what it is asked (pauses, resumes, replies, calls, refreshes
//! handed over, counts).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::cell::{Cell, RefCell};
use std::collections::HashSet;

use floodgate_core::config::Config;
use floodgate_core::descriptor::StaticRequest;
use floodgate_core::global::calls::{Call, CallError, Refresh};
use floodgate_core::limiter::Verdict;
use floodgate_core::limiter::{CanWait, CompiledRule, Counters, Limiter, Permit, RequestEvent, RuleEvent, StoreEvent};
use floodgate_core::store::{MemoryStore, Store};
use floodgate_core::time::{Clock, FakeClock, Nanos};

use crate::log::RateLimitedLog;
use crate::metrics::{Counter, COUNTERS};
use crate::quota::{Callouts, QuotaHost};
use crate::requests::{self, RequestHost, RequestRef};
use crate::waiting::{Shared, Wait, Waiting};

/// The fake clock's start.
pub const T0: Nanos = Nanos::from_secs(1_700_000_000);

/// The quota service's grant of one token, as a lease call's answer.
pub const ONE_TOKEN: &[u8] = br#"{"leases": [{"code": "ok", "granted": 1, "valid_ms": 1000, "limit": 100,
    "window_ms": 60000, "remaining": 50, "reset_ms": 30000, "window": 0}]}"#;

/// Counts nothing.
pub struct NoCounts;

impl Counters<()> for NoCounts {
    fn request(&mut self, _: RequestEvent) {}
    fn rule(&mut self, _: &CompiledRule<()>, _: RuleEvent) {}
    fn store(&mut self, _: StoreEvent, _: u64) {}
}

/// One worker, faked.
pub struct FakeWorker {
    pub limiter: Limiter<()>,
    pub store: MemoryStore,
    pub clock: FakeClock,
    pub callouts: RefCell<Callouts<u32>>,
    pub waiting: RefCell<Waiting>,
    pub log: RateLimitedLog,
    /// The current request's headers, by the limiter's header ids.
    pub request: RefCell<StaticRequest>,
    /// Requests whose client is still there.
    pub live: RefCell<HashSet<u32>>,
    /// Whether the host can arrange a paused request's wake-up.
    pub can_pause: Cell<bool>,
    /// Whether the host sends calls.
    pub can_send: Cell<bool>,
    pub paused: RefCell<Vec<Wait>>,
    pub resumed: Cell<u32>,
    /// Statuses of local replies.
    pub replies: RefCell<Vec<u32>>,
    pub handed: RefCell<Vec<Refresh>>,
    /// Calls sent: token and `:path`.
    pub calls: RefCell<Vec<(u32, String)>>,
    /// Check verdicts settled (for a host that keeps no paused requests).
    pub checked: RefCell<Vec<Verdict>>,
    pub counts: RefCell<[u64; COUNTERS.len()]>,
    pub failed: Cell<u64>,
    pub modes_changed: Cell<u32>,
}

impl FakeWorker {
    /// A worker for `config`, on a store of its own.
    pub fn new(config: &str) -> Self {
        let store = MemoryStore::default();
        let limiter = Limiter::prepare(Config::parse(config.as_bytes()).unwrap(), &store, [7; 16], |_| ()).unwrap();
        let waiting = RefCell::new(Waiting::new(limiter.max_delayed_per_worker()));
        FakeWorker {
            limiter,
            store,
            clock: FakeClock::new(T0),
            callouts: RefCell::default(),
            waiting,
            log: RateLimitedLog::default(),
            request: RefCell::default(),
            live: RefCell::default(),
            can_pause: Cell::new(true),
            can_send: Cell::new(true),
            paused: RefCell::default(),
            resumed: Cell::new(0),
            replies: RefCell::default(),
            handed: RefCell::default(),
            calls: RefCell::default(),
            checked: RefCell::default(),
            counts: RefCell::new([0; COUNTERS.len()]),
            failed: Cell::new(0),
            modes_changed: Cell::new(0),
        }
    }

    /// Request `id` with header `x-api-key: key` arrives and is decided.
    pub fn arrive(&self, id: u32, key: &str) -> (Shared, crate::outcome::Outcome) {
        let names = self.limiter.header_names();
        let headers = names.iter().map(|name| (name == "x-api-key").then(|| key.as_bytes().to_vec())).collect();
        *self.request.borrow_mut() = StaticRequest { headers, ..StaticRequest::default() };
        self.live.borrow_mut().insert(id);
        let state = Shared::default();
        let now = self.now();
        let request = RequestRef { context_id: id, state: &state, since: now };
        let outcome = requests::decide(self, crate::outcome::Site::Handler, request, now, false);
        (state, outcome)
    }

    /// What `counter` counted.
    pub fn count_of(&self, counter: Counter) -> u64 {
        self.counts.borrow()[counter as usize]
    }
}

impl QuotaHost for FakeWorker {
    type Token = u32;
    type Rule = ();

    fn limiter(&self) -> &Limiter<()> {
        &self.limiter
    }

    fn store(&self) -> impl Store + '_ {
        Borrowed(&self.store)
    }

    fn counters(&self) -> impl Counters<()> + '_ {
        NoCounts
    }

    fn now(&self) -> Nanos {
        self.clock.now()
    }

    fn callouts(&self) -> &RefCell<Callouts<u32>> {
        &self.callouts
    }

    fn callout_log(&self) -> &RateLimitedLog {
        &self.log
    }

    fn count(&self, counter: Counter, by: u64) {
        self.counts.borrow_mut()[counter as usize] += by;
    }

    fn count_failed_callout(&self, _why: &CallError) {
        self.failed.set(self.failed.get() + 1);
    }

    fn dispatch(&self, _cluster: &str, call: &Call, _timeout: Nanos) -> Result<u32, String> {
        if !self.can_send.get() {
            return Err("refused".into());
        }
        let path =
            call.headers.iter().find(|(name, _)| *name == ":path").map(|(_, v)| v.to_string()).unwrap_or_default();
        let token = self.calls.borrow().len() as u32 + 1;
        self.calls.borrow_mut().push((token, path));
        Ok(token)
    }

    fn checked(&self, context_id: u32, verdict: Verdict, permit: Permit, now: Nanos) {
        self.checked.borrow_mut().push(verdict.clone());
        requests::finish_checked(self, context_id, verdict, permit, now);
    }

    fn modes_changed(&self) {
        self.modes_changed.set(self.modes_changed.get() + 1);
    }
}

impl RequestHost for FakeWorker {
    fn check(&self, now: Nanos, can_wait: CanWait, decided: (&mut Verdict, &mut Permit)) {
        let mut request = self.request.borrow().clone();
        self.limiter.check_into(&self.store, now, &mut request, can_wait, &mut NoCounts, decided);
    }

    fn waiting(&self) -> &RefCell<Waiting> {
        &self.waiting
    }

    fn shadow_log(&self) -> &RateLimitedLog {
        &self.log
    }

    fn refreshes(&self, refreshes: Vec<Refresh>, _now: Nanos) {
        self.handed.borrow_mut().extend(refreshes);
    }

    fn switch_to(&self, context_id: u32) -> bool {
        self.live.borrow().contains(&context_id)
    }

    fn paused(&self, _request: &RequestRef<'_>, wait: Wait) -> bool {
        self.paused.borrow_mut().push(wait);
        self.can_pause.get()
    }

    fn reply(&self, _state: &Shared, status: u32, _body: &[u8]) {
        self.replies.borrow_mut().push(status);
    }

    fn resume(&self) -> bool {
        self.resumed.set(self.resumed.get() + 1);
        true
    }
}

/// The core's store, lent.
struct Borrowed<'a>(&'a MemoryStore);

impl Store for Borrowed<'_> {
    fn get(
        &self,
        key: &str,
    ) -> Result<Option<(Vec<u8>, floodgate_core::store::Cas)>, floodgate_core::store::StoreError> {
        self.0.get(key)
    }

    fn set(
        &self,
        key: &str,
        value: &[u8],
        cas: Option<floodgate_core::store::Cas>,
    ) -> Result<(), floodgate_core::store::StoreError> {
        self.0.set(key, value, cas)
    }
}
