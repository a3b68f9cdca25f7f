//! A fake of [`Host`] for plain native tests of the filter's logic: it
//! records what the filter asks — which context it switched to, which
//! requests it resumed, which local replies it sent — keeps shared data as
//! Envoy does, and tells time from a [`FakeClock`]. Unlike the ABI-level
//! mock (`mock_host`), it runs no SDK: a test calls the plugin directly.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::time::Duration;

use floodgate_core::headers::HeaderBlock;
use floodgate_core::store::Cas;
use floodgate_core::time::{Clock, FakeClock, Nanos};
use proxy_wasm::types::{MetricType, Status};

use crate::host::Host;

/// A local reply the filter sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// The context it answered.
    pub context_id: u32,
    /// Its status.
    pub status: u32,
    /// Its headers.
    pub headers: Vec<(String, String)>,
}

/// A call the filter dispatched.
#[derive(Debug, Clone)]
pub struct RecordedCall {
    /// Its token.
    pub token: u32,
    /// Its `:path`.
    pub path: String,
    /// The context it was dispatched as.
    pub context: u32,
}

/// One worker's host, faked.
#[derive(Debug, Default)]
pub struct FakeHost {
    /// The host clock.
    pub clock: FakeClock,
    /// Contexts that exist: switching to any other fails, as to a request
    /// whose client has gone.
    pub live: RefCell<HashSet<u32>>,
    /// The context host calls act on.
    pub effective: Cell<u32>,
    /// Every context switched to, in order.
    pub switched: RefCell<Vec<u32>>,
    /// Requests resumed, in order.
    pub resumed: RefCell<Vec<u32>>,
    /// Local replies sent, in order.
    pub replies: RefCell<Vec<Reply>>,
    /// Calls dispatched, in order.
    pub calls: RefCell<Vec<RecordedCall>>,
    /// Every request's headers.
    pub headers: RefCell<Vec<(String, Vec<u8>)>>,
    /// Shared data: value and version per key.
    pub shared: RefCell<HashMap<String, (Vec<u8>, Cas)>>,
    /// Metric names by id (id = index + 1), and values.
    pub metrics: RefCell<(Vec<String>, HashMap<u32, i64>)>,
    /// The tick period last set.
    pub tick: Cell<Duration>,
}

impl FakeHost {
    /// A host at `now`, with a live root context 1 as the effective one.
    pub fn new(now: Nanos) -> Self {
        let host = FakeHost { clock: FakeClock::new(now), ..FakeHost::default() };
        host.live.borrow_mut().insert(1);
        host.effective.set(1);
        host
    }

    /// Request `context_id` arrives: it exists, and is the effective context.
    pub fn arrive(&self, context_id: u32) {
        self.live.borrow_mut().insert(context_id);
        self.effective.set(context_id);
    }

    /// The client of request `context_id` has gone: switching to it fails.
    pub fn leave(&self, context_id: u32) {
        self.live.borrow_mut().remove(&context_id);
    }

    /// Moves the clock on by `ms` milliseconds.
    pub fn advance_ms(&self, ms: u64) {
        self.clock.advance(Nanos::from_millis(ms));
    }

    /// What the filter resumed since the last look.
    pub fn take_resumed(&self) -> Vec<u32> {
        std::mem::take(&mut self.resumed.borrow_mut())
    }

    /// The local replies sent since the last look.
    pub fn take_replies(&self) -> Vec<Reply> {
        std::mem::take(&mut self.replies.borrow_mut())
    }

    /// The value of metric `name`, as flushed (0 if never).
    pub fn metric(&self, name: &str) -> i64 {
        let (names, values) = &*self.metrics.borrow();
        names.iter().position(|n| n == name).and_then(|i| values.get(&(i as u32 + 1))).copied().unwrap_or(0)
    }
}

impl Host for FakeHost {
    fn request_header(&self, name: &str) -> Result<Option<Vec<u8>>, Status> {
        Ok(self.headers.borrow().iter().find(|(n, _)| n == name).map(|(_, v)| v.clone()))
    }

    fn property(&self, path: &'static [u8]) -> Result<Option<Vec<u8>>, Status> {
        Ok((path == b"source\0address").then(|| b"10.0.0.7:4242".to_vec()))
    }

    fn add_response_header(&self, _name: &str, _value: &str) -> Result<(), Status> {
        Ok(())
    }

    fn send_local_reply(&self, status: u32, headers: &HeaderBlock, _body: &[u8]) -> Result<(), Status> {
        let headers = headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect();
        self.replies.borrow_mut().push(Reply { context_id: self.effective.get(), status, headers });
        Ok(())
    }

    fn set_effective_context(&self, context_id: u32) -> Result<(), Status> {
        if !self.live.borrow().contains(&context_id) {
            return Err(Status::BadArgument);
        }
        self.effective.set(context_id);
        self.switched.borrow_mut().push(context_id);
        Ok(())
    }

    fn resume_request(&self) -> Result<(), Status> {
        self.resumed.borrow_mut().push(self.effective.get());
        Ok(())
    }

    /// As Envoy: a missing key is `(None, None)`.
    fn get_shared_data(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<Cas>), Status> {
        Ok(match self.shared.borrow().get(key) {
            Some((value, cas)) => (Some(value.clone()), Some(*cas)),
            None => (None, None),
        })
    }

    /// As Envoy: a non-zero `cas` on a missing key creates it.
    fn set_shared_data(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), Status> {
        let mut shared = self.shared.borrow_mut();
        let entry = shared.entry(key.to_string()).or_insert_with(|| (Vec::new(), 0));
        if cas.is_some_and(|cas| cas != 0 && cas != entry.1) {
            return Err(Status::CasMismatch);
        }
        *entry = (value.to_vec(), entry.1 + 1);
        Ok(())
    }

    fn register_queue(&self, _name: &str) -> Result<u32, Status> {
        Ok(1)
    }

    fn enqueue(&self, _queue: u32) -> Result<(), Status> {
        Ok(())
    }

    fn dequeue(&self, _queue: u32) -> Result<Option<Vec<u8>>, Status> {
        Ok(None)
    }

    fn dispatch_call(
        &self,
        _cluster: &str,
        headers: Vec<(&str, &str)>,
        _body: Option<&[u8]>,
        _timeout: Duration,
    ) -> Result<u32, Status> {
        let mut calls = self.calls.borrow_mut();
        let token = calls.len() as u32 + 1;
        let path = headers.iter().find(|(n, _)| *n == ":path").map(|(_, v)| v.to_string()).unwrap_or_default();
        calls.push(RecordedCall { token, path, context: self.effective.get() });
        Ok(token)
    }

    fn call_answer_header(&self, _name: &str) -> Result<Option<Vec<u8>>, Status> {
        Err(Status::NotFound)
    }

    fn call_answer_body(&self, _size: usize) -> Result<Option<Vec<u8>>, Status> {
        Err(Status::NotFound)
    }

    fn plugin_configuration(&self) -> Result<Option<Vec<u8>>, Status> {
        Ok(None)
    }

    fn current_time(&self) -> Result<Nanos, Status> {
        Ok(self.clock.now())
    }

    fn set_tick_period(&self, period: Duration) -> Result<(), Status> {
        self.tick.set(period);
        Ok(())
    }

    fn define_metric(&self, _kind: MetricType, name: &str) -> Result<u32, Status> {
        let names = &mut self.metrics.borrow_mut().0;
        let index = names.iter().position(|n| n == name).unwrap_or_else(|| {
            names.push(name.to_string());
            names.len() - 1
        });
        Ok(index as u32 + 1)
    }

    fn increment_metric(&self, id: u32, offset: i64) -> Result<(), Status> {
        *self.metrics.borrow_mut().1.entry(id).or_default() += offset;
        Ok(())
    }

    fn record_metric(&self, id: u32, value: u64) -> Result<(), Status> {
        self.metrics.borrow_mut().1.insert(id, value as i64);
        Ok(())
    }

    fn done(&self) -> Result<(), Status> {
        Ok(())
    }
}
