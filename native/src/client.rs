//! A global configuration's quota client, on Envoy's main thread: the
//! shared client (`floodgate_filter_common::quota`) over the
//! configuration's own calls. Lease refreshes the workers' requests claimed
//! (handed over through the configuration's [`Relay`]), returns of unspent
//! tokens, the first call that checks the cluster and the probes of a
//! failing service all leave from here, and their answers come back here:
//! a grant is applied to the pool in memory, and the streams waiting for a
//! refill are woken on their workers. A check is not sent from here: it
//! belongs to its request, and leaves from its stream (`crate::stream`).
//!
//! Every configuration, global or not, also carries the returns of
//! configurations that went away ([`Courier`]): a configuration's calls die
//! with it, so what it has to give back leaves from one that lives.

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use floodgate_core::global::calls::{self, Call, CallError, Refresh, MAX_ANSWER_BYTES};
use floodgate_core::global::settings::QuotaService;
use floodgate_core::limiter::{Counters, Limiter, Permit, Verdict};
use floodgate_core::store::Store;
use floodgate_core::time::Nanos;
use floodgate_filter_common::log::RateLimitedLog;
use floodgate_filter_common::metrics::Counter;
use floodgate_filter_common::quota::client;
use floodgate_filter_common::quota::{Callouts, QuotaHost};
use floodgate_filter_common::requests;

use crate::abi::{Answered, CalloutAnswer, ConfigEnvoy};
use crate::memory::MemoryStore;
use crate::metrics::{MetricIds, RuleIds};
use crate::relay::{Relay, GLOBAL_TICK};

/// The main thread's side of a global configuration.
pub struct Client {
    /// The limiter as the main thread holds it: it applies grants, ends
    /// claims, records the rules' modes and takes unspent tokens, on the
    /// same memory as the workers'.
    limiter: Limiter<RuleIds>,
    store: MemoryStore,
    callouts: RefCell<Callouts<u64>>,
    callout_log: RateLimitedLog,
    /// The first call (which tells a missing cluster) was made.
    hello: Cell<bool>,
}

/// The client at work in one main-thread hook: the shared client's host.
struct Host<'a> {
    client: &'a Client,
    relay: &'a Relay,
    metrics: &'a MetricIds,
    /// The configuration's Envoy side; `None` while it is being destroyed
    /// (then nothing is sent or counted).
    config: Option<&'a ConfigEnvoy<'a>>,
}

impl Client {
    /// A client over `limiter`, prepared on `store`.
    pub fn new(limiter: Limiter<RuleIds>, store: MemoryStore) -> Self {
        Client {
            limiter,
            store,
            callouts: RefCell::default(),
            callout_log: RateLimitedLog::default(),
            hello: Cell::new(false),
        }
    }

    /// The configuration's scheduled event: queues the refreshes workers
    /// handed over, checks the cluster with the first call, reads the modes,
    /// probes a failing service, sends what must leave, sets the gauges, and
    /// sets the next run.
    pub fn run(&self, relay: &Arc<Relay>, metrics: &MetricIds, config: &ConfigEnvoy<'_>, refreshes: Vec<Refresh>) {
        let host = Host { client: self, relay, metrics, config: Some(config) };
        let Some(service) = self.limiter.quota_service() else { return };
        let now = crate::now();
        self.callouts.borrow_mut().refresh(refreshes, now);
        self.limiter.read_modes(&self.store);
        if !self.hello.replace(true) {
            client::check_cluster(&host, service);
        }
        client::send_due_probes(&host, service, now);
        client::send_queued(&host);
        self.settle(relay, metrics, config, now);
    }

    /// The answer to call `id`: applied, and if it answered a lease call,
    /// the streams waiting for a refill are woken.
    pub fn answer(
        &self,
        relay: &Arc<Relay>,
        metrics: &MetricIds,
        config: &ConfigEnvoy<'_>,
        id: u64,
        answer: &CalloutAnswer<'_>,
    ) {
        let host = Host { client: self, relay, metrics, config: Some(config) };
        let answered = answer.read();
        let (status, body) = read_answer(&answered);
        if client::answer(&host, id, || status, borrowed(&body)) {
            relay.refilled();
        }
        client::send_queued(&host);
        self.settle(relay, metrics, config, crate::now());
    }

    /// The end of a main-thread hook: the gauges follow the modes, and the
    /// next run is set (when held calls must leave, or a tick from now).
    fn settle(&self, relay: &Arc<Relay>, metrics: &MetricIds, config: &ConfigEnvoy<'_>, now: Nanos) {
        metrics.set_modes(config, &self.limiter);
        let callouts = self.callouts.borrow();
        let tick = now + Nanos::from(GLOBAL_TICK);
        let next = if callouts.has_outgoing(now) {
            now + Nanos::from(Duration::from_millis(1))
        } else {
            callouts.hold_until().map_or(tick, |until| until.max(now).min(tick))
        };
        relay.run_at(next, now);
    }

    /// The configuration goes away: the claims of calls it will never see
    /// answered end, so that another request may claim at once. What it had
    /// to give back, and (unless `keep_pools`: another configuration spends
    /// from the same pools) every pool's unspent tokens, are returned.
    pub fn close(&self, relay: &Relay, metrics: &MetricIds, keep_pools: bool) -> Vec<(u64, u64)> {
        let host = Host { client: self, relay, metrics, config: None };
        let mut returns = client::abandon_unfinished(&host);
        if !keep_pools {
            returns.extend(self.limiter.take_unspent(&self.store, crate::now()));
        }
        returns
    }

    /// The quota service this configuration asks.
    pub fn service(&self) -> Option<&QuotaService> {
        self.limiter.quota_service()
    }
}

/// Returns of unspent tokens that configurations which went away left to a
/// configuration (any, global or not): sent from its main thread, each to
/// the quota service it was leased from, and counted as the client counts
/// its own.
#[derive(Default)]
pub struct Courier {
    /// Returns in flight: tokens, by call.
    in_flight: HashMap<u64, u64>,
}

impl Courier {
    /// Sends `orphans`, at most a call's worth of leases per call.
    pub fn send(
        &mut self,
        orphans: Vec<(QuotaService, Vec<(u64, u64)>)>,
        metrics: &MetricIds,
        config: &ConfigEnvoy<'_>,
    ) {
        let mut counts = metrics.on_config(config);
        for (service, returns) in orphans {
            for chunk in returns.chunks(calls::MAX_ITEMS) {
                let call = service.return_call(chunk);
                let headers: Vec<(&str, &str)> = call.headers.iter().map(|(n, v)| (*n, v.as_ref())).collect();
                match config.http_callout(&service.cluster, &headers, &call.body, timeout_ms(service.timeout)) {
                    Ok(id) => {
                        counts.count(Counter::CalloutsSent, 1);
                        self.in_flight.insert(id, chunk.iter().map(|(_, tokens)| tokens).sum());
                    }
                    Err(why) => {
                        counts.count_failed(&CallError::NotSent(why));
                        log::info!("floodgate: unspent tokens could not be given back to {:?}", service.cluster);
                    }
                }
            }
        }
    }

    /// The answer to call `id`, if it is one of the courier's: true when it was.
    pub fn answer(
        &mut self,
        id: u64,
        answer: &CalloutAnswer<'_>,
        metrics: &MetricIds,
        config: &ConfigEnvoy<'_>,
    ) -> bool {
        let Some(tokens) = self.in_flight.remove(&id) else { return false };
        let mut counts = metrics.on_config(config);
        let answered = answer.read();
        let (status, _) = read_answer(&answered);
        match calls::read_probe(status) {
            Ok(()) => {
                counts.count(Counter::CalloutsOk, 1);
                counts.count(Counter::TokensReturned, tokens);
            }
            Err(why) => counts.count_failed(&why),
        }
        true
    }
}

/// A call's answer as the shared client reads it: its status (none for a
/// reset stream) and its body, or why the body is not usable. The body is
/// borrowed from Envoy when it came in one chunk, else copied together; one
/// larger than [`MAX_ANSWER_BYTES`] is an unusable answer, read no further.
pub fn read_answer<'a>(answered: &'a Answered<'_>) -> (Option<u16>, Result<Cow<'a, [u8]>, CallError>) {
    match answered {
        Answered::Response { status, body } => {
            let size: usize = body.iter().map(|chunk| chunk.len()).sum();
            let body = match body.as_slice() {
                _ if size > MAX_ANSWER_BYTES => {
                    Err(CallError::Body(format!("{size} bytes is more than {MAX_ANSWER_BYTES}")))
                }
                [] => Ok(Cow::Borrowed(&[][..])),
                [one] => Ok(Cow::Borrowed(*one)),
                many => Ok(Cow::Owned(many.concat())),
            };
            (*status, body)
        }
        Answered::Reset => (None, Ok(Cow::Borrowed(&[][..]))),
        Answered::TooLarge => (None, Err(CallError::Body("larger than Envoy's buffer for it".into()))),
    }
}

/// The body as the shared client takes it.
pub fn borrowed<'a>(body: &'a Result<Cow<'_, [u8]>, CallError>) -> Result<&'a [u8], CallError> {
    match body {
        Ok(bytes) => Ok(bytes),
        Err(why) => Err(why.clone()),
    }
}

impl QuotaHost for Host<'_> {
    type Token = u64;
    type Rule = RuleIds;

    fn limiter(&self) -> &Limiter<RuleIds> {
        &self.client.limiter
    }

    fn store(&self) -> impl Store + '_ {
        &self.client.store
    }

    fn counters(&self) -> impl Counters<RuleIds> + '_ {
        match self.config {
            Some(config) => self.metrics.on_config(config),
            None => self.metrics.nowhere(),
        }
    }

    fn now(&self) -> Nanos {
        crate::now()
    }

    fn callouts(&self) -> &RefCell<Callouts<u64>> {
        &self.client.callouts
    }

    fn callout_log(&self) -> &RateLimitedLog {
        &self.client.callout_log
    }

    fn count(&self, counter: Counter, by: u64) {
        if let Some(config) = self.config {
            self.metrics.on_config(config).count(counter, by);
        }
    }

    fn count_failed_callout(&self, why: &CallError) {
        if let Some(config) = self.config {
            self.metrics.on_config(config).count_failed(why);
        }
    }

    fn dispatch(&self, cluster: &str, call: &Call, timeout: Nanos) -> Result<u64, String> {
        let Some(config) = self.config else { return Err("the configuration is going away".into()) };
        let headers: Vec<(&str, &str)> = call.headers.iter().map(|(n, v)| (*n, v.as_ref())).collect();
        config
            .http_callout(cluster, &headers, &call.body, timeout_ms(timeout))
            .map_err(|why| format!("the call to cluster {cluster:?} was not sent: {why}"))
    }

    /// Checks are their streams' calls, never the configuration's: were one
    /// answered here, what its request holds goes back.
    fn checked(&self, _context_id: u32, _verdict: Verdict, permit: Permit, _now: Nanos) {
        requests::give_back(self, permit);
    }

    fn modes_changed(&self) {
        self.relay.modes_changed();
    }
}

/// A call's timeout in whole milliseconds, at least one.
pub fn timeout_ms(timeout: Nanos) -> u64 {
    u64::try_from(Duration::from(timeout).as_millis()).unwrap_or(u64::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer's body is read from Envoy's chunks: borrowed when it is
    /// one, joined when it is many, refused (unread) past the bound; a reset
    /// has no status, and an answer too large for Envoy is unusable.
    #[test]
    fn answers_are_read_from_envoys_chunks() {
        let one = Answered::Response { status: Some(200), body: vec![b"{}".as_slice()] };
        let (status, body) = read_answer(&one);
        assert_eq!(status, Some(200));
        assert!(matches!(body, Ok(Cow::Borrowed(b"{}"))));
        let many = Answered::Response { status: Some(200), body: vec![b"{\"a\"".as_slice(), b": 1}"] };
        assert_eq!(borrowed(&read_answer(&many).1), Ok(b"{\"a\": 1}".as_slice()));
        let big = vec![b'x'; MAX_ANSWER_BYTES / 2 + 1];
        let too_big = Answered::Response { status: Some(200), body: vec![big.as_slice(), big.as_slice()] };
        assert!(matches!(read_answer(&too_big).1, Err(CallError::Body(why)) if why.contains("more than")));
        let reset = read_answer(&Answered::Reset);
        assert_eq!((reset.0, borrowed(&reset.1)), (None, Ok(&[][..])));
        assert!(matches!(read_answer(&Answered::TooLarge), (None, Err(CallError::Body(_)))));
        assert_eq!(calls::read_probe(reset.0), Err(CallError::Status(None)), "a reset fails the call");
    }

    #[test]
    fn timeouts_are_whole_milliseconds_never_zero() {
        assert_eq!(timeout_ms(Nanos::from_millis(300)), 300);
        assert_eq!(timeout_ms(Nanos::from_nanos(1)), 1);
    }
}
