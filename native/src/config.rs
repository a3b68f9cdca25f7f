//! A configuration of the filter, as Envoy creates it on its main thread:
//! parsed by the core's parser (the wasm build's messages for a bad one),
//! checked for what the native build serves, its metrics defined and its
//! buckets created in the memory of its `filter_name` before any worker
//! sees it, and the relay its workers reach its main thread through
//! (`crate::relay`). A configuration with global rules also gets its quota
//! client (`crate::client`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};

use floodgate_core::config::Config;
use floodgate_core::limiter::Limiter;

use crate::abi::{CalloutAnswer, ConfigEnvoy, Definer};
use crate::client::{Client, Courier};
use crate::memory::Memory;
use crate::metrics::MetricIds;
use crate::relay::Relay;
use crate::waker;

/// What every worker's view of a configuration starts from.
pub struct Shared {
    /// The configuration as parsed (each worker builds its limiter from it).
    pub config: Config,
    /// Its metrics.
    pub metrics: MetricIds,
    /// The dynamic module filter's `filter_name`: configurations under one
    /// name share their buckets (as wasm plugins with one `vm_id` do).
    pub name: String,
    /// The buckets of every configuration under that name.
    pub memory: Arc<Memory>,
    /// How its workers and its main thread reach each other (and other
    /// configurations its main thread).
    pub relay: Arc<Relay>,
    /// False once Envoy has destroyed the configuration: workers then drop
    /// their view of it.
    alive: AtomicBool,
}

impl Shared {
    /// Whether Envoy still has this configuration.
    pub fn alive(&self) -> bool {
        self.alive.load(Ordering::Relaxed)
    }

    /// Whether this configuration has every global rule of `other` (by
    /// name): under the same name, it spends from the same pools.
    fn spends_pools_of(&self, other: &Shared) -> bool {
        let global =
            |shared: &Shared, name: &str| shared.config.rules.iter().any(|r| r.global.is_some() && r.name == name);
        other.config.rules.iter().filter(|rule| rule.global.is_some()).all(|rule| global(self, &rule.name))
    }
}

/// A configuration, as handed to Envoy.
pub struct FilterConfig {
    /// What its workers share.
    pub shared: Arc<Shared>,
    /// Its quota client (global rules only): used on the main thread, and
    /// by the destruction, which runs where Envoy lets the configuration go.
    client: Mutex<Option<Client>>,
    /// Sends the returns configurations that went away left to it.
    courier: Mutex<Courier>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Every configuration Envoy holds: a configuration that goes away finds
/// whether another shares its buckets, and which can send its returns.
fn live() -> MutexGuard<'static, Vec<Weak<Shared>>> {
    static LIVE: OnceLock<Mutex<Vec<Weak<Shared>>>> = OnceLock::new();
    lock(LIVE.get_or_init(Mutex::default))
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
        let name = String::from_utf8_lossy(name).into_owned();
        let memory = Memory::named(&name);
        let metrics = MetricIds::define(definer, &config);
        // The groups of every rule, created here on the main thread, before
        // any worker sees the configuration (its stores are made after).
        let store = memory.store();
        let mut rule = 0;
        let ids = |_: &floodgate_core::config::Rule| {
            rule += 1;
            metrics.rule(rule - 1)
        };
        let limiter = match Limiter::prepare(config.clone(), &store, crate::entropy(), ids) {
            Ok(limiter) => limiter,
            Err(error) => {
                log::error!("floodgate: cannot prepare the buckets in memory: {error}");
                return None;
            }
        };
        for rule in &config.rules {
            log::debug!(
                "floodgate ({name}): rule {} ({}, {} buckets)",
                rule.name,
                rule.algorithm.name,
                rule.table.capacity()
            );
        }
        let Some(scheduler) = definer.scheduler() else {
            log::error!("floodgate: Envoy gave no scheduler for the configuration's main thread");
            return None;
        };
        let relay = Arc::new(Relay::new(scheduler));
        let client = limiter.quota_service().is_some().then(|| {
            // The first run (its first call checks the cluster) comes once
            // Envoy's main thread runs: never under `--mode validate`.
            relay.post();
            Client::new(limiter, store)
        });
        waker::configuration_created();
        let shared = Arc::new(Shared { config, metrics, name, memory, relay, alive: AtomicBool::new(true) });
        let mut live = live();
        live.retain(|shared| shared.strong_count() > 0);
        live.push(Arc::downgrade(&shared));
        Some(FilterConfig { shared, client: Mutex::new(client), courier: Mutex::default() })
    }

    /// The configuration's scheduled event (main thread): its quota
    /// client's run, and the returns others left to it.
    pub fn on_scheduled(&self, config: &ConfigEnvoy<'_>, _event: u64) {
        let Shared { relay, metrics, .. } = &*self.shared;
        let handed = relay.take_outbox();
        if let Some(client) = lock(&self.client).as_ref() {
            client.run(relay, metrics, config, handed.refreshes);
        }
        if !handed.orphans.is_empty() {
            lock(&self.courier).send(handed.orphans, metrics, config);
        }
    }

    /// The answer to one of the configuration's calls (main thread).
    pub fn on_answer(&self, config: &ConfigEnvoy<'_>, id: u64, answer: &CalloutAnswer<'_>) {
        let Shared { relay, metrics, .. } = &*self.shared;
        if lock(&self.courier).answer(id, answer, metrics, config) {
            return;
        }
        if let Some(client) = lock(&self.client).as_ref() {
            client.answer(relay, metrics, config, id, answer);
        }
    }

    /// A global configuration goes away: its unanswered claims end, and what
    /// it has to give back goes to another configuration, which sends it
    /// (its own calls die with it; one under the same name first). The
    /// pools' unspent tokens go back too, unless another configuration under
    /// the same name has the same global rules and keeps spending them (a
    /// listener update: the new configuration is created before the old one
    /// goes).
    fn close(&self) {
        let client = lock(&self.client).take();
        self.shared.relay.close();
        let Some(client) = client else { return };
        let others: Vec<Arc<Shared>> = live()
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|other| !Arc::ptr_eq(other, &self.shared) && other.alive())
            .collect();
        let same_name = |other: &&Arc<Shared>| other.name == self.shared.name;
        let keep_pools = others.iter().filter(same_name).any(|other| other.spends_pools_of(&self.shared));
        let returns = client.close(&self.shared.relay, &self.shared.metrics, keep_pools);
        let Some(service) = client.service().filter(|_| !returns.is_empty()) else { return };
        match others.iter().find(same_name).or(others.first()) {
            Some(heir) => heir.relay.hand_orphans(service.clone(), returns),
            None => log::info!(
                "floodgate: {} leases' unspent tokens cannot be given back (no configuration is left to call the quota service); the service counts them until their leases end",
                returns.len()
            ),
        }
    }
}

impl Drop for FilterConfig {
    fn drop(&mut self) {
        self.shared.alive.store(false, Ordering::Relaxed);
        self.close();
        live().retain(|shared| shared.strong_count() > 0 && !std::ptr::eq(shared.as_ptr(), Arc::as_ptr(&self.shared)));
        waker::configuration_destroyed();
    }
}
