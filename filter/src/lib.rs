//! Floodgate's Envoy HTTP filter.
//!
//! This crate is the only code that talks to the proxy: it reads the plugin
//! configuration, adapts Envoy's shared data, headers, clock and metrics to
//! the traits of `floodgate-core`, and turns verdicts into responses. Every
//! decision is made in the core.
//!
//! Host calls go through `proxy_wasm::hostcalls`, which return `Result`s,
//! rather than the SDK's trait helpers, several of which unwrap; header values
//! are read as bytes only, because the SDK's `String` getters panic on
//! non-UTF-8 input.

mod host;
mod metrics;

use std::cell::Cell;
use std::rc::Rc;

use floodgate_core::config::Config;
use floodgate_core::headers::{HeaderBlock, Renderer};
use floodgate_core::limiter::Limiter;
use floodgate_core::time::{Nanos, SECOND};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

use host::{HostRequest, SharedData};
use metrics::Metrics;

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

/// What every request of a plugin shares: built once per configuration.
struct Plugin {
    limiter: Limiter,
    metrics: Metrics,
    headers: Renderer,
    shadow_log: ShadowLog,
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
        if now.saturating_sub(self.last.get()) < SECOND {
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
        let limiter = match Limiter::prepare(config, &SharedData, host::entropy()) {
            Ok(limiter) => limiter,
            Err(error) => {
                log::error!("floodgate: cannot prepare shared data: {error}");
                return false;
            }
        };
        for (index, rule) in limiter.config().rules.iter().enumerate() {
            log::debug!(
                "floodgate: rule {} ({}, {} buckets, at most {} bytes of shared data)",
                rule.name,
                rule.kind.name(),
                rule.table.capacity(),
                limiter.shared_data_bytes(index)
            );
        }
        let metrics = Metrics::define(limiter.config());
        let headers = Renderer::new(limiter.config());
        self.plugin = Some(Rc::new(Plugin { limiter, metrics, headers, shadow_log: ShadowLog::default() }));
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(match &self.plugin {
            Some(plugin) => Box::new(FloodgateHttp {
                plugin: Rc::clone(plugin),
                allowed: false,
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

/// A request while no configuration is in force: let through.
struct PassThrough;

impl Context for PassThrough {}

impl HttpContext for PassThrough {}

/// One request.
struct FloodgateHttp {
    plugin: Rc<Plugin>,
    /// Whether the request was let through.
    allowed: bool,
    /// Rate-limit headers: added to the upstream's response, or sent with the limited one.
    response_headers: HeaderBlock,
}

impl Context for FloodgateHttp {}

impl HttpContext for FloodgateHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let plugin = &self.plugin;
        let config = plugin.limiter.config();
        let mut request = HostRequest::new(&config.header_names);
        let mut counters = plugin.metrics.counters();
        let now = host::now();
        let verdict = plugin.limiter.check(&SharedData, now, &mut request, &mut counters);
        plugin.metrics.count_verdict(&verdict);
        if let Some(rule) = verdict.shadow_limited.and_then(|index| config.rules.get(index)) {
            plugin.shadow_log.record(&rule.name, now);
        }
        plugin.headers.render(&verdict, &mut self.response_headers);
        self.allowed = verdict.allowed;
        if verdict.allowed {
            return Action::Continue;
        }
        let pairs: Vec<(&str, &str)> = self.response_headers.iter().collect();
        if let Err(status) =
            hostcalls::send_http_response(config.response.status, pairs, Some(config.response.body.as_bytes()))
        {
            log::warn!("floodgate: could not send the limited response: {status:?}");
        }
        Action::Pause
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        // A limited request's local reply passes here too: its headers were
        // sent with it, so only an allowed request's are added.
        if self.allowed {
            for (name, value) in self.response_headers.iter() {
                if let Err(status) = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value) {
                    log::warn!("floodgate: could not add response header {name}: {status:?}");
                }
            }
        }
        Action::Continue
    }
}
