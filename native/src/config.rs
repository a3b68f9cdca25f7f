//! A configuration of the filter, as Envoy creates it on its main thread:
//! parsed by the core's parser (the wasm build's messages for a bad one),
//! checked for what the native build serves, its metrics defined and its
//! buckets created in process memory before any worker sees it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use floodgate_core::config::Config;
use floodgate_core::limiter::Limiter;

use crate::abi::Definer;
use crate::memory::Memory;
use crate::metrics::MetricIds;
use crate::waker;

/// What every worker's view of a configuration starts from.
#[derive(Debug)]
pub struct Shared {
    /// The configuration as parsed (each worker builds its limiter from it).
    pub config: Config,
    /// Its metrics.
    pub metrics: MetricIds,
    /// False once Envoy has destroyed the configuration: workers then drop
    /// their view of it.
    alive: AtomicBool,
}

impl Shared {
    /// Whether Envoy still has this configuration.
    pub fn alive(&self) -> bool {
        self.alive.load(Ordering::Relaxed)
    }
}

/// A configuration, as handed to Envoy.
#[derive(Debug)]
pub struct FilterConfig {
    /// What its workers share.
    pub shared: Arc<Shared>,
}

impl FilterConfig {
    /// Parses, checks and prepares the configuration `json` of filter
    /// `name`; `None` (Envoy refuses it) with the reason logged.
    pub fn new(definer: &Definer<'_>, name: &[u8], json: &[u8]) -> Option<FilterConfig> {
        let config = match Config::parse(json).and_then(|config| crate::support::check(&config).map(|()| config)) {
            Ok(config) => config,
            Err(error) => {
                log::error!("{error}");
                return None;
            }
        };
        let memory = Memory::process();
        // The groups of every rule, created here on the main thread, before
        // any worker sees the configuration (its stores are made after).
        if let Err(error) = Limiter::prepare(config.clone(), &memory.store(), crate::entropy(), |_| ()) {
            log::error!("floodgate: cannot prepare the buckets in memory: {error}");
            return None;
        }
        for rule in &config.rules {
            log::debug!(
                "floodgate ({}): rule {} ({}, {} buckets)",
                String::from_utf8_lossy(name),
                rule.name,
                rule.algorithm.name,
                rule.table.capacity()
            );
        }
        let metrics = MetricIds::define(definer, &config);
        waker::configuration_created();
        Some(FilterConfig { shared: Arc::new(Shared { config, metrics, alive: AtomicBool::new(true) }) })
    }
}

impl Drop for FilterConfig {
    fn drop(&mut self) {
        self.shared.alive.store(false, Ordering::Relaxed);
        waker::configuration_destroyed();
    }
}
