//! One configuration's root context on one VM (Envoy's main thread or a
//! worker): it builds the plugin from the configuration, runs the worker's
//! tick, sends what requests posted, receives the answers of the quota
//! service to its calls (all but checks, which are their requests' calls),
//! and creates each request's context.

use std::rc::Rc;

use floodgate_core::config::Config;
use floodgate_core::limiter::Limiter;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;

use crate::envoy::EnvoyHost;
use crate::host::{self, Host, SharedData};
use crate::http::{FloodgateHttp, PassThrough};
use crate::metrics::{Metrics, RuleMetrics};
use crate::plugin::{schedule_ticks, Plugin};
use crate::quota::{self, Callout};
use crate::waiting::Shared;

/// One plugin configuration on one VM (Envoy's main thread or a worker).
/// Per-plugin state lives here, not in statics: plugins with the same code
/// and `vm_id` share a VM.
pub(crate) struct FloodgateRoot {
    context_id: u32,
    /// The host, for what the root does before it has a plugin.
    host: EnvoyHost,
    plugin: Option<Rc<Plugin<EnvoyHost>>>,
    /// Whether this VM has checked that Envoy has the quota service's cluster.
    cluster_checked: bool,
    /// This root's shared queue, through which its requests post calls to it
    /// (see the module docs); `None` until configured, or if Envoy refused it.
    queue: Option<u32>,
}

impl FloodgateRoot {
    pub(crate) fn new(context_id: u32) -> Self {
        FloodgateRoot { context_id, host: EnvoyHost::default(), plugin: None, cluster_checked: false, queue: None }
    }
}

impl Context for FloodgateRoot {
    /// The configuration goes away (a rule removed or changed, or Envoy
    /// stopping): unspent leased tokens go back to the service, and the
    /// context stays until the service has answered (as far as Envoy waits).
    fn on_done(&mut self) -> bool {
        let Some(plugin) = self.plugin.clone() else { return true };
        plugin.limiter.return_reserves(&plugin.store(), plugin.host.now(), true, &mut plugin.metrics.counters());
        plugin.metrics.flush(&plugin.host, &plugin.limiter);
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
        let body = quota::answer_body(&plugin.host, body_size);
        let Some(callout) = plugin.callouts.borrow_mut().answered(token_id) else { return };
        let refilled = matches!(callout, Callout::Leases(_));
        plugin.answered(callout, || quota::answer_status(&plugin.host, num_headers), body);
        plugin.metrics.set_modes(&plugin.host, &plugin.limiter);
        let now = plugin.host.now();
        if refilled {
            // The requests that waited for these pools go on now.
            plugin.finish_due(now, true);
        }
        let _ = plugin.host.set_effective_context(self.context_id);
        plugin.send_queued();
        if plugin.closing.get().is_some() {
            // A configuration going away has no tick left to flush on.
            plugin.settle_root(now);
        } else {
            plugin.settle_calls(now);
        }
    }
}

impl RootContext for FloodgateRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let raw = match self.host.plugin_configuration() {
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
        // The plugin's own handle on Envoy (with the buffer its local
        // replies are serialized into).
        let host = EnvoyHost::default();
        let define = |rule: &_| RuleMetrics::define(&host, rule);
        let limiter = match Limiter::prepare(config, &SharedData(&host), host::entropy(&host), define) {
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
        if self.queue.is_none() {
            self.queue = register_queue(&self.host, self.context_id);
        }
        let metrics = Metrics::define(&host);
        let plugin = Rc::new(Plugin::new(host, limiter, metrics, self.queue));
        schedule_ticks(&plugin, plugin.host.now());
        self.plugin = Some(plugin);
        true
    }

    /// Sends what is queued for the quota service, probes it for rules in
    /// fall-back, refreshes this worker's view of their modes, and finishes
    /// the paused requests whose time has come.
    fn on_tick(&mut self) {
        let Some(plugin) = self.plugin.clone() else { return };
        let now = plugin.host.now();
        plugin.ticked(now);
        if let Some(service) = plugin.limiter.quota_service() {
            if !self.cluster_checked {
                self.cluster_checked = true;
                plugin.check_cluster(service);
            }
            plugin.limiter.read_modes(&plugin.store());
            plugin.metrics.set_modes(&plugin.host, &plugin.limiter);
            plugin.send_due_probes(service, now);
            plugin.send_queued();
        }
        plugin.finish_due(now, false);
        let _ = plugin.host.set_effective_context(self.context_id);
        plugin.send_queued();
        plugin.limiter.return_reserves(&plugin.store(), now, false, &mut plugin.metrics.counters());
        plugin.settle_root(now);
    }

    /// A request posted calls: send them now.
    fn on_queue_ready(&mut self, queue_id: u32) {
        while let Ok(Some(_)) = self.host.dequeue(queue_id) {}
        let Some(plugin) = self.plugin.clone() else { return };
        plugin.posted.set(false);
        plugin.send_queued();
        plugin.settle_calls(plugin.host.now());
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
fn register_queue(host: &impl Host, root_id: u32) -> Option<u32> {
    let [a, b, c, d, e, f, g, h, ..] = host::entropy(host);
    let name = format!("floodgate:{root_id}:{:016x}", u64::from_le_bytes([a, b, c, d, e, f, g, h]));
    host.register_queue(&name)
        .map_err(|status| log::warn!("floodgate: no shared queue ({status:?}): calls leave on the next tick"))
        .ok()
}
