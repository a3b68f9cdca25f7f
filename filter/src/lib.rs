//! Floodgate's Envoy HTTP filter.
//!
//! This crate is the only code that talks to the proxy: it reads the plugin
//! configuration, adapts Envoy's shared data, headers, clock and metrics to
//! the traits of `floodgate-core`, and turns verdicts into responses. Every
//! decision is made in the core; here a verdict becomes "go on", "answer
//! limited", or "pause, and resume from this worker's tick when the delay is
//! over", and a request's permit is given back when its stream ends.
//!
//! Host calls go through `proxy_wasm::hostcalls`, which return `Result`s,
//! rather than the SDK's trait helpers, several of which unwrap; header values
//! are read as bytes only, because the SDK's `String` getters panic on
//! non-UTF-8 input.

mod host;
mod metrics;
mod waiting;

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use floodgate_core::algorithm::{Admission, Release};
use floodgate_core::config::Config;
use floodgate_core::headers::HeaderBlock;
use floodgate_core::limiter::{Limiter, Permit, Verdict};
use floodgate_core::time::{Nanos, SECOND};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

use host::{HostRequest, SharedData};
use metrics::{increment, Metrics, RuleMetrics};
use waiting::Waiting;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(FloodgateRoot::default()) });
}}

/// One plugin configuration on one VM (Envoy's main thread or a worker).
/// Per-plugin state lives here, not in statics: plugins with the same code
/// and `vm_id` share a VM.
#[derive(Default)]
struct FloodgateRoot {
    plugin: Option<Rc<Plugin>>,
}

/// What every request of a plugin on one worker shares: built once per
/// configuration.
struct Plugin {
    limiter: Limiter<RuleMetrics>,
    metrics: Metrics,
    shadow_log: ShadowLog,
    /// Requests of this worker paused by a shaper, resumed from its tick.
    waiting: RefCell<Waiting>,
}

impl Plugin {
    /// Gives back a permit's units for `why`.
    fn release(&self, permit: Permit, why: Release) {
        if !permit.is_empty() {
            self.limiter.release(&SharedData, host::now(), permit, why, &mut self.metrics.counters());
        }
    }
}

/// Logs shadow-mode denials at most once a second per VM: on a busy listener
/// one line per request would flood Envoy's log, and the counters have the
/// totals.
#[derive(Default)]
struct ShadowLog {
    last: Cell<Nanos>,
    suppressed: Cell<u64>,
}

impl ShadowLog {
    fn record(&self, rule: &str, now: Nanos) {
        if now - self.last.get() < SECOND {
            self.suppressed.set(self.suppressed.get() + 1);
            return;
        }
        let suppressed = self.suppressed.replace(0);
        self.last.set(now);
        log::info!("floodgate: shadow mode: rule {rule} would have limited a request; let through ({suppressed} more since the last line)");
    }
}

impl Context for FloodgateRoot {}

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
        self.plugin =
            Some(Rc::new(Plugin { limiter, metrics: Metrics::define(), shadow_log: ShadowLog::default(), waiting }));
        true
    }

    /// Resumes this worker's delayed requests whose time has come. Ticks run
    /// only while some request waits (see [`Waiting::next_tick`]).
    fn on_tick(&mut self) {
        let Some(plugin) = &self.plugin else { return };
        let now = host::now();
        let due = plugin.waiting.borrow_mut().take_due(now);
        for waiter in due {
            // Only this worker can resume its own requests; a client that has
            // gone makes this fail, and its units were given back in on_done.
            let resumed = hostcalls::set_effective_context(waiter.context_id)
                .and_then(|()| hostcalls::resume_http_request())
                .is_ok();
            if resumed {
                increment(plugin.metrics.delayed, 1);
                increment(plugin.metrics.delay_requested_ms, (waiter.resume_at - waiter.since).ceil_millis());
                increment(plugin.metrics.delay_actual_ms, (now - waiter.since).ceil_millis());
            } else {
                increment(plugin.metrics.delay_abandoned, 1);
            }
        }
        schedule_ticks(&plugin.waiting.borrow(), now);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(match &self.plugin {
            Some(plugin) => Box::new(FloodgateHttp {
                plugin: Rc::clone(plugin),
                context_id,
                stage: Stage::Deciding,
                permit: Permit::default(),
                response_headers: HeaderBlock::default(),
            }),
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

/// Sets this worker's tick to fire when the next waiting request is due
/// (at most every 10 ms, so the period stays coarse-grained), or stops it.
fn schedule_ticks(waiting: &Waiting, now: Nanos) {
    let period = waiting.next_tick(now);
    if let Err(status) = hostcalls::set_tick_period(period) {
        log::warn!("floodgate: cannot schedule the tick that resumes delayed requests: {status:?}");
    }
}

/// A request while no configuration is in force: let through.
struct PassThrough;

impl Context for PassThrough {}

impl HttpContext for PassThrough {}

/// Where a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Not decided yet.
    Deciding,
    /// Let through (at once, or after waiting).
    Passed,
    /// Paused by a shaper until this worker's tick resumes it.
    Waiting,
    /// Answered as limited.
    Limited,
}

/// One request.
struct FloodgateHttp {
    plugin: Rc<Plugin>,
    context_id: u32,
    stage: Stage,
    /// What the request took from each rule, given back when it ends.
    permit: Permit,
    /// Rate-limit headers: added to the upstream's response, or sent with the limited one.
    response_headers: HeaderBlock,
}

impl FloodgateHttp {
    fn send_limited(&mut self, verdict: &Verdict) -> Action {
        let plugin = Rc::clone(&self.plugin);
        plugin.limiter.render_headers(verdict, &mut self.response_headers);
        let response = plugin.limiter.response();
        let pairs: Vec<(&str, &str)> = self.response_headers.iter().collect();
        if let Err(status) = hostcalls::send_http_response(response.status, pairs, Some(response.body.as_bytes())) {
            log::warn!("floodgate: could not send the limited response: {status:?}");
        }
        self.stage = Stage::Limited;
        Action::Pause
    }
}

impl Context for FloodgateHttp {
    /// The stream ended (completed, reset or failed): give the permit back.
    /// A request that was still waiting was never served, so its units are
    /// undone; a served one releases what it held while in flight.
    fn on_done(&mut self) -> bool {
        let plugin = Rc::clone(&self.plugin);
        let permit = std::mem::take(&mut self.permit);
        if self.stage == Stage::Waiting && plugin.waiting.borrow_mut().remove(self.context_id) {
            increment(plugin.metrics.delay_abandoned, 1);
            plugin.release(permit, Release::Undo);
        } else {
            plugin.release(permit, Release::Done);
        }
        true
    }
}

impl HttpContext for FloodgateHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if self.stage != Stage::Deciding {
            return Action::Continue;
        }
        let plugin = Rc::clone(&self.plugin);
        let limiter = &plugin.limiter;
        let mut request = HostRequest::new(limiter.header_names());
        let now = host::now();
        let (mut verdict, permit) = limiter.check(&SharedData, now, &mut request, &mut plugin.metrics.counters());
        if let Admission::Delayed(delay) = verdict.admission {
            if !plugin.waiting.borrow_mut().add(self.context_id, now, now + delay) {
                // This worker has as many waiting as allowed: the request
                // cannot wait here, so it is not served and takes nothing.
                increment(plugin.metrics.delay_queue_full, 1);
                plugin.release(permit, Release::Undo);
                verdict.admission = Admission::Denied { retry_after: delay };
                plugin.metrics.count_verdict(&verdict);
                return self.send_limited(&verdict);
            }
        }
        plugin.metrics.count_verdict(&verdict);
        if let Some(rule) = verdict.shadow_limited.and_then(|index| limiter.rules().get(index)) {
            plugin.shadow_log.record(&rule.rule.name, now);
        }
        match verdict.admission {
            Admission::Denied { .. } => self.send_limited(&verdict),
            Admission::Now => {
                limiter.render_headers(&verdict, &mut self.response_headers);
                self.permit = permit;
                self.stage = Stage::Passed;
                Action::Continue
            }
            Admission::Delayed(_) => {
                limiter.render_headers(&verdict, &mut self.response_headers);
                self.permit = permit;
                self.stage = Stage::Waiting;
                schedule_ticks(&plugin.waiting.borrow(), now);
                Action::Pause
            }
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        // A limited request's local reply passes here too: its headers were
        // sent with it, so only a served request's are added.
        if self.stage != Stage::Limited {
            for (name, value) in self.response_headers.iter() {
                if let Err(status) = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value) {
                    log::warn!("floodgate: could not add response header {name}: {status:?}");
                }
            }
        }
        Action::Continue
    }
}
