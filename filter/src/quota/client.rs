//! The quota client in this build: the worker's plugin is the host of the
//! shared client (`floodgate_filter_common::quota`), its calls dispatched
//! from the worker's root context, so their answers reach the root whatever
//! becomes of the request that caused them; a request's check alone is
//! dispatched from the request's context, its answer that request's. Every
//! decision about the calls is in `floodgate_core::global`; how they are
//! queued, sent and answered is the common client's.

use std::cell::RefCell;
use std::time::Duration;

use floodgate_core::global::calls::{Call, CallError, MAX_ANSWER_BYTES};
use floodgate_core::global::settings::QuotaService;
use floodgate_core::limiter::{Counters, Limiter, Permit, Verdict};
use floodgate_core::store::Store;
use floodgate_core::time::Nanos;
use floodgate_filter_common::log::RateLimitedLog;
use floodgate_filter_common::quota::client;
use floodgate_filter_common::quota::{Callout, Callouts, QuotaHost};
use floodgate_filter_common::requests;

use crate::host::Host;
use crate::metrics::{Counter, RuleMetrics};
use crate::plugin::Plugin;

impl<H: Host> QuotaHost for Plugin<H> {
    type Token = u32;
    type Rule = RuleMetrics;

    fn limiter(&self) -> &Limiter<RuleMetrics> {
        &self.limiter
    }

    fn store(&self) -> impl Store + '_ {
        Plugin::store(self)
    }

    fn counters(&self) -> impl Counters<RuleMetrics> + '_ {
        self.metrics.counters()
    }

    fn now(&self) -> Nanos {
        self.callback_now.get().unwrap_or_else(|| self.host.now())
    }

    fn callouts(&self) -> &RefCell<Callouts> {
        &self.callouts
    }

    fn callout_log(&self) -> &RateLimitedLog {
        &self.callout_log
    }

    fn count(&self, counter: Counter, by: u64) {
        self.metrics.count(counter, by);
    }

    fn count_failed_callout(&self, why: &CallError) {
        self.metrics.count_failed_callout(why);
    }

    /// Dispatches `call` from the current context: the root's, or a
    /// request's for its check.
    fn dispatch(&self, cluster: &str, call: &Call, timeout: Nanos) -> Result<u32, String> {
        let headers: Vec<(&str, &str)> = call.headers.iter().map(|(n, v)| (*n, v.as_ref())).collect();
        let body = (!call.body.is_empty()).then_some(call.body.as_slice());
        let timeout = Duration::from(timeout).max(Duration::from_millis(1));
        self.host
            .dispatch_call(cluster, headers, body, timeout)
            .map_err(|status| format!("Envoy refused the call to cluster {cluster:?} ({status:?})"))
    }

    fn checked(&self, context_id: u32, verdict: Verdict, permit: Permit, now: Nanos) {
        requests::finish_checked(self, context_id, verdict, permit, now);
    }

    /// Noted, so that an answer sets the fall-back gauges only when they
    /// change (the tick sets them whatever happened).
    fn modes_changed(&self) {
        self.modes_changed.set(true);
    }

    /// A return was answered (or failed): once the last of a closing
    /// configuration's is, Envoy may tear the context down.
    fn return_settled(&self) {
        if let Some(left) = self.closing.get() {
            let left = left.saturating_sub(1);
            self.closing.set(Some(left));
            if left == 0 {
                let _ = self.host.done();
            }
        }
    }
}

impl<H: Host> Plugin<H> {
    /// Probes the quota service once, first thing (a misspelt
    /// `global.cluster` is said plainly).
    pub(crate) fn check_cluster(&self, service: &QuotaService) {
        client::check_cluster(self, service);
    }

    /// Probes the quota service for each rule in fall-back whose probe is due.
    pub(crate) fn send_due_probes(&self, service: &QuotaService, now: Nanos) {
        client::send_due_probes(self, service, now);
    }

    /// Gives back every pool's unspent tokens as this configuration goes
    /// away; the number of calls made.
    pub(crate) fn give_back_all(&self) -> usize {
        client::give_back_all(self)
    }

    /// Sends everything queued for the quota service.
    pub(crate) fn send_queued(&self) {
        client::send_queued(self);
    }

    /// Sends request `context_id`'s check as a call of its own, from its
    /// own context: the answer comes back to the request (no hop through
    /// the root), and Envoy cancels the call if the request goes first.
    pub(crate) fn send_check(&self, context_id: u32) {
        client::send_check(self, context_id);
    }

    /// Handles the answer to one of this worker's calls.
    pub(crate) fn answered(
        &self,
        callout: Callout,
        status: impl FnOnce() -> Option<u16>,
        body: Result<Vec<u8>, CallError>,
    ) {
        client::answered(self, callout, status, body.as_deref().map_err(CallError::clone));
    }
}

/// The body of a call's answer of `body_size` bytes, as the host reports
/// it. A reset stream has none: the SDK's getters panic when asked for a
/// map or buffer the host does not have, so they are asked only for what
/// the host said is there.
pub(crate) fn answer_body(host: &impl Host, body_size: usize) -> Result<Vec<u8>, CallError> {
    if body_size > MAX_ANSWER_BYTES {
        Err(CallError::Body(format!("{body_size} bytes is more than {MAX_ANSWER_BYTES}")))
    } else if body_size == 0 {
        Ok(Vec::new())
    } else {
        Ok(host.call_answer_body(body_size).ok().flatten().unwrap_or_default())
    }
}

/// The status of a call's answer of `num_headers` headers (none for a reset
/// stream): read from the host only when asked, as the shared client asks
/// only for an answer whose body does not settle the call.
pub(crate) fn answer_status(host: &impl Host, num_headers: usize) -> Option<u16> {
    if num_headers == 0 {
        return None;
    }
    host.call_answer_header(":status")
        .ok()
        .flatten()
        .and_then(|s| std::str::from_utf8(&s).ok().and_then(|s| s.parse::<u16>().ok()))
}
