//! Floodgate's Envoy HTTP filter.
//!
//! This crate is the only code that talks to the proxy: it reads the plugin
//! configuration, adapts Envoy's shared data, headers, clock and metrics to
//! the traits of `floodgate-core`, and turns verdicts into responses. Every
//! decision is made in the core; here a verdict becomes "go on", "answer
//! limited", or "pause" — until a shaper's delay is over, a lease pool is
//! refilled, or the quota service answers a check — and a request's permit
//! is given back when its stream ends.
//!
//! Each worker's root context finishes the requests it paused (Envoy lets
//! only that worker resume them) and owns every call to the quota service,
//! so answers arrive at the root whatever becomes of the request that caused
//! them. The SDK delivers an answer to the context that was *active* when
//! the call was made (switching the effective context does not change
//! that), so a request's handler does not dispatch itself: it posts to its
//! worker's own shared queue, which Envoy runs on the same worker at the
//! event loop's next turn, in the root context, and the root dispatches at
//! once. A paused request is finished from the handler of the answer that
//! frees it. So no tick lies between a request and the network, nor between
//! an answer and the request; ticks are for timers: a shaper's delays, the
//! end of a request's wait, probes of a failing service, and refills another
//! worker asked for.
//!
//! Host calls go through `proxy_wasm::hostcalls`, which return `Result`s,
//! rather than the SDK's trait helpers, several of which unwrap; header values
//! are read as bytes only, because the SDK's `String` getters panic on
//! non-UTF-8 input.

mod global;
mod host;
#[cfg(test)]
mod host_tests;
mod metrics;
#[cfg(test)]
mod mock_host;
mod waiting;

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use floodgate_core::algorithm::{Admission, Release};
use floodgate_core::config::Config;
use floodgate_core::global::calls::{self, Call, CallError, CheckAnswer, Refresh, MAX_ANSWER_BYTES};
use floodgate_core::global::pool::{Applied, LeaseGrant};
use floodgate_core::limiter::{Limiter, Permit, Verdict};
use floodgate_core::time::{Nanos, SECOND};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

use global::{Callout, Callouts, Outgoing, StatusCall};
use host::{HeaderReads, HostRequest, SharedData};
use metrics::{increment, Metrics, RuleMetrics};
use waiting::{Shared, Stage, Wait, Waiter, Waiting};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(FloodgateRoot { context_id, plugin: None, cluster_checked: false, queue: None })
    });
}}

/// How often a worker with global rules looks at their mode and probes a
/// failing service, when nothing else needs a tick.
const GLOBAL_TICK: Duration = Duration::from_millis(50);

/// One plugin configuration on one VM (Envoy's main thread or a worker).
/// Per-plugin state lives here, not in statics: plugins with the same code
/// and `vm_id` share a VM.
struct FloodgateRoot {
    context_id: u32,
    plugin: Option<Rc<Plugin>>,
    /// Whether this VM has checked that Envoy has the quota service's cluster.
    cluster_checked: bool,
    /// This root's shared queue, through which its requests post calls to it
    /// (see the module docs); `None` until configured, or if Envoy refused it.
    queue: Option<u32>,
}

/// What every request of a plugin on one worker shares: built once per
/// configuration.
struct Plugin {
    limiter: Limiter<RuleMetrics>,
    /// The root's shared queue (see [`Plugin::post`]).
    queue: Option<u32>,
    /// A post to the root is on its way: later requests need not post again.
    posted: Cell<bool>,
    /// Counts were added since the metrics were last flushed (a flush tick
    /// is scheduled).
    unflushed: Cell<bool>,
    /// The header values a request read, kept between requests so that
    /// reading them allocates nothing.
    header_reads: RefCell<HeaderReads>,
    /// A limited reply's serialized headers, kept between replies.
    reply_buffer: RefCell<Vec<u8>>,
    metrics: Metrics,
    shadow_log: RateLimitedLog,
    callout_log: RateLimitedLog,
    /// Requests this worker paused.
    waiting: RefCell<Waiting>,
    /// This worker's calls to the quota service.
    callouts: RefCell<Callouts>,
    /// While this configuration goes away: returns not answered yet.
    closing: Cell<Option<usize>>,
}

impl Plugin {
    /// Gives back a permit's units for `why`; true when it had any to give
    /// back (the clock is read only then).
    fn release(&self, permit: Permit, why: Release) -> bool {
        if !self.limiter.needs_release(&permit, why) {
            return false;
        }
        self.limiter.release(&SharedData, host::now(), permit, why, &mut self.metrics.counters());
        true
    }

    /// Decides the request of context `context_id` and acts on the verdict.
    /// Called by the request's own handler, and by the worker's tick for a
    /// request that waits for a refill (with the effective context set to
    /// it; `waited_out` once its wait is over).
    fn decide(&self, context_id: u32, state: &Shared, since: Nanos, now: Nanos, waited_out: bool) -> Action {
        let limiter = &self.limiter;
        let reads = std::mem::take(&mut *self.header_reads.borrow_mut());
        let mut request = HostRequest::new(limiter.header_names(), reads);
        let (mut verdict, permit) =
            limiter.check_waited(&SharedData, now, &mut request, waited_out, &mut self.metrics.counters());
        *self.header_reads.borrow_mut() = request.into_reads();
        if !verdict.refreshes.is_empty() {
            increment(&self.metrics.refreshes, verdict.refreshes.len() as u64);
            self.callouts.borrow_mut().refresh(std::mem::take(&mut verdict.refreshes));
        }
        let wait = match verdict.admission {
            Admission::Delayed(delay) => Some(Wait::Delay { resume_at: now + delay }),
            Admission::Pending if !verdict.checks.is_empty() => Some(Wait::Answer),
            Admission::Pending => {
                Some(Wait::Refill { deadline: since + limiter.quota_service().map_or(Nanos::ZERO, |s| s.max_wait) })
            }
            Admission::Now | Admission::Denied { .. } => None,
        };
        if let Some(wait) = wait {
            let waiter = Waiter { context_id, since, wait, request: Rc::clone(state) };
            if self.waiting.borrow_mut().add(waiter).is_err() {
                // This worker has as many waiting as allowed: the request
                // cannot wait here, so it is not served and takes nothing.
                increment(&self.metrics.delay_queue_full, 1);
                self.release(permit, Release::Undo);
                let retry_after = match wait {
                    Wait::Delay { resume_at } => resume_at - now,
                    Wait::Refill { .. } | Wait::Answer => SECOND,
                };
                verdict.admission = Admission::Denied { retry_after };
                return self.finish(state, verdict, Permit::default(), now);
            }
            if let Wait::Answer = wait {
                self.callouts.borrow_mut().check(context_id, verdict, permit);
                state.borrow_mut().stage = Stage::Waiting;
                return Action::Pause;
            }
            if let Admission::Delayed(_) = verdict.admission {
                self.metrics.count_verdict(&verdict);
                limiter.render_headers(&verdict, &mut state.borrow_mut().headers);
            }
            let mut state = state.borrow_mut();
            state.permit = permit;
            state.stage = Stage::Waiting;
            return Action::Pause;
        }
        self.finish(state, verdict, permit, now)
    }

    /// Acts on a final verdict for a request: lets it through or answers it
    /// as limited. Returns what its handler returns to Envoy.
    fn finish(&self, state: &Shared, verdict: Verdict, permit: Permit, now: Nanos) -> Action {
        let limiter = &self.limiter;
        self.metrics.count_verdict(&verdict);
        if let Some(rule) = verdict.shadow_limited.and_then(|index| limiter.rules().get(index)) {
            self.shadow_log.record(now, log::Level::Info, || {
                format!("shadow mode: rule {} would have limited a request; let through", rule.rule.name)
            });
        }
        let mut state = state.borrow_mut();
        limiter.render_headers(&verdict, &mut state.headers);
        state.permit = permit;
        if verdict.allowed() {
            state.stage = Stage::Passed;
            return Action::Continue;
        }
        state.stage = Stage::Limited;
        let response = limiter.response();
        let buffer = &mut self.reply_buffer.borrow_mut();
        if let Err(status) =
            host::send_local_reply(response.status, state.headers.iter(), response.body.as_bytes(), buffer)
        {
            log::warn!("floodgate: could not send the limited response: {status:?}");
        }
        Action::Pause
    }

    /// Finishes a paused request from the root context: switches to it and
    /// resumes it or answers it as limited.
    fn finish_paused(&self, context_id: u32, state: &Shared, verdict: Verdict, permit: Permit, now: Nanos) {
        if hostcalls::set_effective_context(context_id).is_err() {
            // The client left: what it took goes back.
            self.release(permit, Release::Undo);
            return;
        }
        if let Action::Continue = self.finish(state, verdict, permit, now) {
            if let Err(status) = hostcalls::resume_http_request() {
                log::warn!("floodgate: could not resume a request: {status:?}");
            }
        }
    }

    /// Probes the quota service once, first thing: Envoy refuses at once a
    /// call to a cluster it does not have, and a misspelt `global.cluster`
    /// must be said plainly, not only counted. (`envoy --mode validate`
    /// refuses every call, so this cannot be a configuration check.)
    fn check_cluster(&self, service: &floodgate_core::global::settings::QuotaService) {
        match dispatch(&service.cluster, &service.probe_call(), service.timeout) {
            Ok(token) => {
                increment(&self.metrics.callouts_sent, 1);
                self.callouts.borrow_mut().sent(token, Callout::Status(StatusCall::Hello));
            }
            Err(why) => {
                log::error!(
                    "floodgate: global.cluster {:?} cannot be called ({why}): is it a cluster of Envoy's configuration? Global rules use their fall-back",
                    service.cluster
                );
                let now = host::now();
                for rule in 0..self.limiter.rules().len() {
                    self.limiter.record_callout(&SharedData, now, rule, false);
                }
                self.metrics.count_failed_callout(&CallError::NotSent(why));
            }
        }
    }

    /// Gives back every pool's unspent tokens as this configuration goes
    /// away; the number of calls made.
    fn give_back_all(&self) -> usize {
        let Some(service) = self.limiter.quota_service() else { return 0 };
        let unspent = self.limiter.take_unspent(&SharedData, host::now());
        let mut sent = 0;
        for chunk in unspent.chunks(calls::MAX_ITEMS) {
            let tokens = chunk.iter().map(|(_, t)| t).sum();
            if let Ok(token) = dispatch(&service.cluster, &service.return_call(chunk), service.timeout) {
                increment(&self.metrics.callouts_sent, 1);
                self.callouts.borrow_mut().sent(token, Callout::Status(StatusCall::Returns(tokens)));
                sent += 1;
            }
        }
        sent
    }

    /// A return was answered (or failed): once the last of a closing
    /// configuration's is, Envoy may tear the context down.
    fn return_settled(&self) {
        if let Some(left) = self.closing.get() {
            let left = left.saturating_sub(1);
            self.closing.set(Some(left));
            if left == 0 {
                let _ = hostcalls::done();
            }
        }
    }

    /// Counts were added on a request's path: the first since the last flush
    /// schedules the tick that flushes them.
    fn counted(&self, now: Nanos) {
        if !self.unflushed.replace(true) {
            schedule_ticks(self, now);
        }
    }

    /// The end of a root-context callback: counts reach Envoy, and the tick
    /// is set for what remains to do.
    fn settle_root(&self, now: Nanos) {
        self.metrics.flush(&self.limiter);
        self.unflushed.set(false);
        schedule_ticks(self, now);
    }

    /// Has the root send what is queued for the quota service at once: a
    /// request's handler posts to the root's shared queue (once, until the
    /// root has run), and the root dispatches in `on_queue_ready`. Without a
    /// queue, the root's next tick (1 ms) sends them.
    fn post(&self) {
        if self.posted.get() || !self.callouts.borrow().has_outgoing() {
            return;
        }
        let Some(queue) = self.queue else { return };
        match hostcalls::enqueue_shared_queue(queue, None) {
            Ok(()) => self.posted.set(true),
            Err(status) => log::warn!("floodgate: cannot post calls to the root context: {status:?}"),
        }
    }

    /// Finishes the paused requests that are due at `now`: a shaper's delay
    /// that is over, and every request waiting for a refill (decided again
    /// on its pool; `waited_out` once its wait is over). Called from the
    /// tick, and from the answer to a lease call, which may have refilled
    /// their pools. Leaves the effective context on the last request
    /// looked at: the caller switches back to its own.
    fn finish_due(&self, now: Nanos, refills_only: bool) {
        let due = self.waiting.borrow_mut().take_due(now, refills_only);
        for waiter in due {
            match waiter.wait {
                Wait::Delay { resume_at } => {
                    // Only this worker can resume its own requests; a client
                    // that has gone makes this fail, and its units were given
                    // back in on_done.
                    let resumed = hostcalls::set_effective_context(waiter.context_id)
                        .and_then(|()| hostcalls::resume_http_request())
                        .is_ok();
                    if resumed {
                        waiter.request.borrow_mut().stage = Stage::Passed;
                        increment(&self.metrics.delayed, 1);
                        increment(&self.metrics.delay_requested_ms, (resume_at - waiter.since).ceil_millis());
                        increment(&self.metrics.delay_actual_ms, (now - waiter.since).ceil_millis());
                    } else {
                        increment(&self.metrics.delay_abandoned, 1);
                    }
                }
                Wait::Refill { deadline } => {
                    if hostcalls::set_effective_context(waiter.context_id).is_err() {
                        continue;
                    }
                    let waited_out = now >= deadline;
                    let action = self.decide(waiter.context_id, &waiter.request, waiter.since, now, waited_out);
                    if !matches!(waiter.request.borrow().stage, Stage::Waiting) {
                        increment(&self.metrics.refill_waits, 1);
                        increment(&self.metrics.refill_wait_ms, (now - waiter.since).ceil_millis());
                        if let Action::Continue = action {
                            if let Err(status) = hostcalls::resume_http_request() {
                                log::warn!("floodgate: could not resume a request: {status:?}");
                            }
                        }
                    }
                }
                Wait::Answer => {}
            }
        }
    }

    /// Sends everything queued for the quota service.
    fn send_queued(&self) {
        let Some(service) = self.limiter.quota_service() else { return };
        let outgoing = self.callouts.borrow_mut().take_outgoing();
        for call in outgoing {
            let (request, callout) = match call {
                Outgoing::Leases(refreshes) => (service.lease_call(&refreshes), Callout::Leases(refreshes)),
                Outgoing::Returns(returns) => {
                    let tokens = returns.iter().map(|(_, t)| t).sum();
                    (service.return_call(&returns), Callout::Status(StatusCall::Returns(tokens)))
                }
                Outgoing::Check { context_id, indices, hits } => {
                    let callouts = self.callouts.borrow();
                    let Some(job) = callouts.job(context_id) else { continue };
                    let items: Vec<_> = indices.iter().filter_map(|&i| job.verdict.checks.get(i)).collect();
                    (service.check_call(&items, hits), Callout::Check { context_id, indices })
                }
            };
            match dispatch(&service.cluster, &request, service.timeout) {
                Ok(token) => {
                    increment(&self.metrics.callouts_sent, 1);
                    self.callouts.borrow_mut().sent(token, callout);
                }
                Err(why) => self.callout_failed(callout, &CallError::NotSent(why)),
            }
        }
    }

    /// Handles the answer to one of this worker's calls: each kind of call
    /// reads its own answer; one that is not usable fails the call.
    fn answered(&self, callout: Callout, status: Option<u16>, body: Result<Vec<u8>, CallError>) {
        let now = host::now();
        let failed = match callout {
            Callout::Leases(refreshes) => match body.and_then(|body| calls::read_leases(status, &body, &refreshes)) {
                Ok(grants) => {
                    self.leases_granted(&refreshes, grants, now);
                    None
                }
                Err(why) => Some((Callout::Leases(refreshes), why)),
            },
            Callout::Check { context_id, indices } => {
                match body.and_then(|body| calls::read_checks(status, &body, indices.len())) {
                    Ok(answers) => {
                        self.settle(context_id, &indices, Some(answers), now);
                        None
                    }
                    Err(why) => Some((Callout::Check { context_id, indices }, why)),
                }
            }
            Callout::Status(call) => match calls::read_probe(status) {
                Ok(()) => {
                    self.acknowledged(call, now);
                    None
                }
                Err(why) => Some((Callout::Status(call), why)),
            },
        };
        match failed {
            None => increment(&self.metrics.callouts_ok, 1),
            Some((callout, why)) => self.callout_failed(callout, &why),
        }
    }

    /// Applies the grants of a lease call.
    fn leases_granted(&self, refreshes: &[Refresh], grants: Vec<LeaseGrant>, now: Nanos) {
        let counters = &mut self.metrics.counters();
        for (refresh, grant) in refreshes.iter().zip(grants) {
            self.limiter.record_callout(&SharedData, now, refresh.rule, true);
            increment(&self.metrics.tokens_leased, grant.granted);
            let applied = self.limiter.apply_lease(&SharedData, now, refresh, &grant, counters);
            let mut callouts = self.callouts.borrow_mut();
            match applied {
                // What the pool does not keep of the replaced leases.
                Some(Applied::Replaced(left)) => {
                    increment(&self.metrics.tokens_expired, left.expired);
                    for (lease, tokens) in left.returns {
                        callouts.give_back(lease, tokens);
                    }
                }
                // A newer lease is in place, or the pool could not
                // take it: the grant goes back whole.
                Some(Applied::Stale) | None => callouts.give_back(grant.lease, grant.granted),
                Some(Applied::Duplicate) => {}
            }
        }
    }

    /// A call answered by its status alone succeeded.
    fn acknowledged(&self, call: StatusCall, now: Nanos) {
        match call {
            StatusCall::Returns(tokens) => {
                increment(&self.metrics.tokens_returned, tokens);
                self.return_settled();
            }
            StatusCall::Probe(rule) => self.limiter.record_callout(&SharedData, now, rule, true),
            StatusCall::Hello => {}
        }
    }

    /// Records a check call's answers and finishes the request once all its
    /// calls have answered.
    fn settle(&self, context_id: u32, indices: &[usize], answers: Option<Vec<CheckAnswer>>, now: Nanos) {
        let done = self.callouts.borrow_mut().record_check(context_id, indices, answers);
        let Some((job, answers)) = done else { return };
        let (context_id, verdict, permit) = job.into_parts();
        let counters = &mut self.metrics.counters();
        let (verdict, permit) = self.limiter.settle(&SharedData, now, verdict, permit, answers.as_deref(), counters);
        let waiter = self.waiting.borrow_mut().remove(context_id);
        match waiter {
            Some(waiter) => self.finish_paused(context_id, &waiter.request, verdict, permit, now),
            None => {
                self.release(permit, Release::Undo);
            }
        }
    }

    /// A call got no usable answer: pools' claims end, rules fall back.
    fn callout_failed(&self, callout: Callout, why: &CallError) {
        let now = host::now();
        self.metrics.count_failed_callout(why);
        self.callout_log.record(now, log::Level::Warn, || format!("quota service call failed, rules fall back: {why}"));
        let counters = &mut self.metrics.counters();
        match callout {
            Callout::Leases(refreshes) => {
                for refresh in &refreshes {
                    self.limiter.abandon_lease(&SharedData, now, refresh, counters);
                    self.limiter.record_callout(&SharedData, now, refresh.rule, false);
                }
            }
            // Tokens not given back are lost to this window: never more admitted.
            Callout::Status(StatusCall::Returns(_)) => self.return_settled(),
            // A failed first call says nothing the next calls will not.
            Callout::Status(StatusCall::Hello) => {}
            Callout::Status(StatusCall::Probe(rule)) => self.limiter.record_callout(&SharedData, now, rule, false),
            Callout::Check { context_id, indices } => {
                let rules: Vec<usize> = self
                    .callouts
                    .borrow()
                    .job(context_id)
                    .map(|job| indices.iter().filter_map(|&i| job.verdict.checks.get(i).map(|c| c.rule)).collect())
                    .unwrap_or_default();
                for rule in rules {
                    self.limiter.record_callout(&SharedData, now, rule, false);
                }
                self.settle(context_id, &indices, None, now);
            }
        }
    }
}

/// Dispatches `call` to `cluster` from the current (root) context.
fn dispatch(cluster: &str, call: &Call, timeout: Nanos) -> Result<u32, String> {
    let headers: Vec<(&str, &str)> = call.headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
    let body = (!call.body.is_empty()).then_some(call.body.as_slice());
    let timeout = Duration::from_nanos(timeout.get()).max(Duration::from_millis(1));
    hostcalls::dispatch_http_call(cluster, headers, body, vec![], timeout)
        .map_err(|status| format!("Envoy refused the call to cluster {cluster:?} ({status:?})"))
}

/// Logs a kind of event at most once a second per VM, with the number of
/// events left out since the previous line: on a busy listener one line per
/// request would flood Envoy's log, and the counters have the totals.
#[derive(Default)]
struct RateLimitedLog {
    last: Cell<Nanos>,
    suppressed: Cell<u64>,
}

impl RateLimitedLog {
    fn record(&self, now: Nanos, level: log::Level, line: impl FnOnce() -> String) {
        if now - self.last.get() < SECOND {
            self.suppressed.set(self.suppressed.get() + 1);
            return;
        }
        let suppressed = self.suppressed.replace(0);
        self.last.set(now);
        log::log!(level, "floodgate: {} ({suppressed} more since the last line)", line());
    }
}

impl Context for FloodgateRoot {
    /// The configuration goes away (a rule removed or changed, or Envoy
    /// stopping): unspent leased tokens go back to the service, and the
    /// context stays until the service has answered (as far as Envoy waits).
    fn on_done(&mut self) -> bool {
        let Some(plugin) = self.plugin.clone() else { return true };
        plugin.limiter.return_reserves(&SharedData, host::now(), true, &mut plugin.metrics.counters());
        plugin.metrics.flush(&plugin.limiter);
        match plugin.give_back_all() {
            0 => true,
            calls => {
                plugin.closing.set(Some(calls));
                false
            }
        }
    }

    fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize, _num_trailers: usize) {
        let Some(plugin) = self.plugin.clone() else { return };
        // A reset stream has no headers (and no body): the SDK's getters
        // panic when asked for a map or buffer the host does not have, so
        // they are asked only for what the host said is there.
        let status = if num_headers == 0 {
            None
        } else {
            hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status")
                .ok()
                .flatten()
                .and_then(|s| std::str::from_utf8(&s).ok().and_then(|s| s.parse::<u16>().ok()))
        };
        let body = if body_size > MAX_ANSWER_BYTES {
            Err(CallError::Body(format!("{body_size} bytes is more than {MAX_ANSWER_BYTES}")))
        } else if body_size == 0 {
            Ok(Vec::new())
        } else {
            Ok(hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size).ok().flatten().unwrap_or_default())
        };
        let Some(callout) = plugin.callouts.borrow_mut().answered(token_id) else { return };
        let refilled = matches!(callout, Callout::Leases(_));
        plugin.answered(callout, status, body);
        plugin.metrics.set_modes(&plugin.limiter);
        let now = host::now();
        if refilled {
            // The requests that waited for these pools go on now.
            plugin.finish_due(now, true);
        }
        let _ = hostcalls::set_effective_context(self.context_id);
        plugin.send_queued();
        plugin.settle_root(now);
    }
}

impl RootContext for FloodgateRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let raw = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(Some(bytes)) => bytes,
            Ok(None) => Vec::new(),
            Err(status) => {
                log::error!("floodgate: cannot read the plugin configuration: {status:?}");
                return false;
            }
        };
        let config = match Config::parse(&raw) {
            Ok(config) => config,
            Err(error) => {
                // Returning false makes Envoy refuse the configuration.
                log::error!("{error}");
                return false;
            }
        };
        let limiter = match Limiter::prepare(config, &SharedData, host::entropy(), RuleMetrics::define) {
            Ok(limiter) => limiter,
            Err(error) => {
                log::error!("floodgate: cannot prepare shared data: {error}");
                return false;
            }
        };
        for (index, compiled) in limiter.rules().iter().enumerate() {
            let rule = &compiled.rule;
            log::debug!(
                "floodgate: rule {} ({}, {} buckets, at most {} bytes of shared data)",
                rule.name,
                rule.algorithm.name,
                rule.table.capacity(),
                limiter.shared_data_bytes(index)
            );
        }
        let waiting = RefCell::new(Waiting::new(limiter.max_delayed_per_worker()));
        if self.queue.is_none() {
            self.queue = register_queue(self.context_id);
        }
        let plugin = Rc::new(Plugin {
            limiter,
            queue: self.queue,
            posted: Cell::new(false),
            unflushed: Cell::new(false),
            header_reads: RefCell::default(),
            reply_buffer: RefCell::default(),
            metrics: Metrics::define(),
            shadow_log: RateLimitedLog::default(),
            callout_log: RateLimitedLog::default(),
            waiting,
            callouts: RefCell::new(Callouts::default()),
            closing: Cell::new(None),
        });
        schedule_ticks(&plugin, host::now());
        self.plugin = Some(plugin);
        true
    }

    /// Sends what is queued for the quota service, probes it for rules in
    /// fall-back, refreshes this worker's view of their modes, and finishes
    /// the paused requests whose time has come.
    fn on_tick(&mut self) {
        let Some(plugin) = self.plugin.clone() else { return };
        let now = host::now();
        if let Some(service) = plugin.limiter.quota_service() {
            if !self.cluster_checked {
                self.cluster_checked = true;
                plugin.check_cluster(service);
            }
            plugin.limiter.read_modes(&SharedData);
            plugin.metrics.set_modes(&plugin.limiter);
            for rule in plugin.limiter.due_probes(&SharedData, now) {
                match dispatch(&service.cluster, &service.probe_call(), service.timeout) {
                    Ok(token) => {
                        increment(&plugin.metrics.callouts_sent, 1);
                        plugin.callouts.borrow_mut().sent(token, Callout::Status(StatusCall::Probe(rule)));
                    }
                    Err(why) => {
                        plugin.callout_failed(Callout::Status(StatusCall::Probe(rule)), &CallError::NotSent(why))
                    }
                }
            }
            plugin.send_queued();
        }
        plugin.finish_due(now, false);
        let _ = hostcalls::set_effective_context(self.context_id);
        plugin.send_queued();
        plugin.limiter.return_reserves(&SharedData, now, false, &mut plugin.metrics.counters());
        plugin.settle_root(now);
    }

    /// A request posted calls: send them now.
    fn on_queue_ready(&mut self, queue_id: u32) {
        while let Ok(Some(_)) = hostcalls::dequeue_shared_queue(queue_id) {}
        let Some(plugin) = self.plugin.clone() else { return };
        plugin.posted.set(false);
        plugin.send_queued();
        plugin.settle_root(host::now());
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(match &self.plugin {
            Some(plugin) => Box::new(FloodgateHttp { plugin: Rc::clone(plugin), context_id, state: Shared::default() }),
            // Unreachable in Envoy, which refuses a configuration that
            // on_configure rejected; but the SDK panics on `None`, so a
            // request would rather pass unlimited.
            None => Box::new(PassThrough),
        })
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Registers root context `root_id`'s shared queue under a name no other
/// worker uses: Envoy runs `on_queue_ready` on the registering worker, in
/// the registering context, so a post reaches this root and no other.
fn register_queue(root_id: u32) -> Option<u32> {
    let [a, b, c, d, e, f, g, h, ..] = host::entropy();
    let name = format!("floodgate:{root_id}:{:016x}", u64::from_le_bytes([a, b, c, d, e, f, g, h]));
    hostcalls::register_shared_queue(&name)
        .map_err(|status| log::warn!("floodgate: no shared queue ({status:?}): calls leave on the next tick"))
        .ok()
}

/// Sets this worker's tick: soon when calls are queued and not posted, or a
/// paused request is due; every [`GLOBAL_TICK`] while global rules exist;
/// within [`metrics::FLUSH_PERIOD`] while counts wait to be flushed or the
/// worker holds units taken ahead; else not at all.
fn schedule_ticks(plugin: &Plugin, now: Nanos) {
    let period = if plugin.callouts.borrow().has_outgoing() && !plugin.posted.get() {
        Some(Duration::from_millis(1))
    } else {
        plugin.waiting.borrow().next_tick(now)
    };
    let global = plugin.limiter.quota_service().map(|_| GLOBAL_TICK);
    // Counts to flush, or units taken ahead to give back when they end.
    let flush = (plugin.unflushed.get() || plugin.limiter.holds_reserves()).then_some(metrics::FLUSH_PERIOD);
    let period = [period, global, flush].into_iter().flatten().min().unwrap_or(Duration::ZERO);
    if let Err(status) = hostcalls::set_tick_period(period) {
        log::warn!("floodgate: cannot schedule the tick that resumes paused requests: {status:?}");
    }
}

/// A request while no configuration is in force: let through.
struct PassThrough;

impl Context for PassThrough {}

impl HttpContext for PassThrough {}

/// One request.
struct FloodgateHttp {
    plugin: Rc<Plugin>,
    context_id: u32,
    state: Shared,
}

impl Context for FloodgateHttp {
    /// The stream ended (completed, reset or failed): give the permit back.
    /// A request that was still waiting was never served, so its units are
    /// undone; a served one releases what it held while in flight.
    fn on_done(&mut self) -> bool {
        let plugin = Rc::clone(&self.plugin);
        let waiting = self.state.borrow().stage == Stage::Waiting;
        let permit = std::mem::take(&mut self.state.borrow_mut().permit);
        let counted = if waiting && plugin.waiting.borrow_mut().remove(self.context_id).is_some() {
            increment(&plugin.metrics.delay_abandoned, 1);
            if let Some(checked) = plugin.callouts.borrow_mut().forget(self.context_id) {
                plugin.release(checked, Release::Undo);
            }
            plugin.release(permit, Release::Undo);
            true
        } else {
            plugin.release(permit, Release::Done)
        };
        if counted {
            plugin.counted(host::now());
        }
        true
    }
}

impl HttpContext for FloodgateHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if self.state.borrow().stage != Stage::Deciding {
            return Action::Continue;
        }
        let plugin = Rc::clone(&self.plugin);
        let now = host::now();
        let action = plugin.decide(self.context_id, &self.state, now, now, false);
        plugin.post();
        let first_count = !plugin.unflushed.replace(true);
        if first_count || self.state.borrow().stage == Stage::Waiting || plugin.callouts.borrow().has_outgoing() {
            schedule_ticks(&plugin, now);
        }
        action
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        // A limited request's local reply passes here too: its headers were
        // sent with it, so only a served request's are added.
        let state = self.state.borrow();
        if state.stage != Stage::Limited {
            for (name, value) in state.headers.iter() {
                if let Err(status) = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value) {
                    log::warn!("floodgate: could not add response header {name}: {status:?}");
                }
            }
        }
        Action::Continue
    }
}
