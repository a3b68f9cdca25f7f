//! What `make fleet-sim` runs: the grid of fleet sizes, key counts, rates
//! per Envoy and balancers, each sampled within a budget of simulated
//! requests; the checks of the sampling and of the calls model against
//! fleets simulated whole; the end-to-end shape; the overshoot table. Each
//! configuration becomes a [`Run`]: its outcome and the fleet's calls.

use floodgate_core::lease::overshoot::Overshoot;
use floodgate_core::time::{Nanos, SECOND};

use crate::fleet::{self, default_quota, simulate, CallSizes, FleetConfig, FleetOutcome, WORKERS};
use crate::keys::{self, Balancer, Key, Plan, Traffic};
use crate::replay::{self, Modelled};
use crate::rng::Network;

/// The fixed seed: the same run gives the same numbers.
pub const SEED: u64 = 21;

/// Fleet sizes and key counts of the grid.
pub const FLEETS: [u32; 4] = [10, 100, 1_000, 10_000];
/// See [`FLEETS`].
pub const KEY_COUNTS: [u64; 4] = [1_000, 10_000, 100_000, 1_000_000];
/// Requests a second per Envoy.
pub const PER_ENVOY: [f64; 2] = [100.0, 1_000.0];
/// The balancers compared.
pub const BALANCERS: [Balancer; 2] = [Balancer::Uniform, Balancer::KeyAffine];

/// Virtual time: warm-up (so that a per-minute key's measured window is
/// its second whole one), measured span (exactly one per-minute window),
/// then the span in which the store is emptied (a restart) `RESTART_AT` in.
pub const WARMUP: Nanos = Nanos::from_secs(70);
/// See [`WARMUP`].
pub const MEASURE: Nanos = Nanos::from_secs(60);
/// See [`WARMUP`].
pub const AFTER: Nanos = Nanos::from_secs(20);
/// See [`WARMUP`].
pub const RESTART_AT: Nanos = Nanos::from_nanos(2_500_000_000);

/// Simulated requests a second a configuration may have (the budget that
/// keeps `make fleet-sim` within minutes); `FLEET_SIM_BUDGET` overrides it.
pub const BUDGET: f64 = 10_000.0;

/// One configuration's outcome with what the report needs beside it.
#[derive(Debug, Clone)]
pub struct Run {
    /// Whether it is one of the grid's runs.
    pub in_grid: bool,
    /// Its traffic, if it is of the grid's kind.
    pub traffic: Option<Traffic>,
    /// How it was sampled.
    pub plan: Plan,
    /// Simulated requests a second.
    pub simulated_rate: f64,
    /// Groups of each Envoy's table.
    pub table_groups: u32,
    /// What the simulation measured.
    pub outcome: FleetOutcome,
    /// The calls model's view, for a sampled fleet (or to check it).
    pub modelled: Option<Modelled>,
}

impl Run {
    /// The fleet's calls in the measured span: as simulated when every
    /// request was, else the model's.
    pub fn calls(&self) -> &CallSizes {
        match (&self.modelled, self.outcome.exact) {
            (Some(m), false) => &m.calls,
            _ => &self.outcome.sim_calls,
        }
    }
}

/// A configuration to run, and how to finish it into a [`Run`].
#[derive(Debug, Clone)]
pub struct Job {
    /// The simulation's configuration (a grid run's keys are drawn when it
    /// runs: a million keys take hundreds of megabytes).
    pub config: FleetConfig,
    /// See [`Run::traffic`]; a grid run's keys are `traffic` sampled by
    /// `plan` from `seed`.
    pub traffic: Option<Traffic>,
    /// See [`Run::plan`].
    pub plan: Plan,
    /// The keys' seed.
    pub seed: u64,
    /// Replay the calls model (always for a sampled fleet).
    pub model: bool,
    /// Simulated requests a second.
    pub simulated_rate: f64,
    /// One of the grid's runs.
    pub in_grid: bool,
}

impl Job {
    /// Simulates, then models the calls if asked.
    pub fn run(&self) -> Result<Run, String> {
        let drawn;
        let config = match (&self.traffic, self.config.keys.is_empty()) {
            (Some(traffic), true) => {
                drawn = FleetConfig { keys: keys::fleet(traffic, &self.plan, self.seed)?, ..self.config.clone() };
                &drawn
            }
            _ => &self.config,
        };
        let outcome = simulate(config)?;
        let from = fleet::measure_from();
        let modelled = self.model.then(|| {
            let workers = self.config.envoys * WORKERS;
            replay::calls(&outcome.items, workers, from, from + self.config.measure, self.config.seed)
        });
        let mut outcome = outcome;
        outcome.items = Vec::new();
        Ok(Run {
            in_grid: self.in_grid,
            traffic: self.traffic,
            plan: self.plan,
            simulated_rate: self.simulated_rate,
            table_groups: self.config.table_groups,
            outcome,
            modelled,
        })
    }

    /// A rough cost, to start the longest first.
    pub fn cost(&self) -> f64 {
        let secs = (self.config.warmup + self.config.measure + self.config.after).as_secs_f64();
        self.simulated_rate * secs
    }

    /// A job of `config`'s own keys.
    fn of(config: FleetConfig, model: bool) -> Job {
        let simulated_rate = keys::simulated_rate(&config.keys);
        Job { config, traffic: None, plan: Plan::EXACT, seed: 0, model, simulated_rate, in_grid: false }
    }
}

/// A grid configuration: `traffic` sampled by `plan`.
pub fn job(name: String, traffic: Traffic, plan: Plan, seed: u64) -> Result<Job, String> {
    let sample = keys::sample(&traffic, &plan, seed);
    let exact = plan.is_exact(&traffic);
    let config = FleetConfig {
        name,
        envoys: traffic.envoys,
        total_keys: traffic.keys,
        table_groups: fleet::table_groups(sample.pair_share),
        keys: Vec::new(),
        exact,
        warmup: WARMUP,
        measure: MEASURE,
        after: AFTER,
        restart_at: Some(RESTART_AT),
        seed: seed ^ u64::from(traffic.envoys).wrapping_shl(32) ^ traffic.per_envoy as u64,
        allowances: true,
        overshoot: None,
        check_baseline: traffic.balancer == Balancer::Uniform,
        record_items: !exact,
        network: Network::Datacenter,
        quota: default_quota(),
    };
    Ok(Job { config, traffic: Some(traffic), plan, seed, model: !exact, simulated_rate: sample.rate, in_grid: false })
}

/// The name of a grid configuration.
pub fn name_of(traffic: &Traffic) -> String {
    format!("{}x{}@{}-{}", traffic.envoys, traffic.keys, traffic.per_envoy, traffic.balancer.label())
}

/// The grid, each configuration sampled within `budget` requests a second.
pub fn grid(budget: f64) -> Result<Vec<Job>, String> {
    let mut jobs = Vec::new();
    for &per_envoy in &PER_ENVOY {
        for &keys in &KEY_COUNTS {
            for &envoys in &FLEETS {
                for &balancer in &BALANCERS {
                    let traffic = Traffic { envoys, per_envoy, keys, balancer };
                    let seed = SEED ^ keys;
                    let plan = keys::plan_for(&traffic, budget, seed)?;
                    jobs.push(Job { in_grid: true, ..job(name_of(&traffic), traffic, plan, seed)? });
                }
            }
        }
    }
    Ok(jobs)
}

/// The sampling checked: a fleet small enough to simulate whole, simulated
/// whole and as the grid samples a large one (a budget of an eighth of its
/// traffic), under both balancers.
pub const SAMPLING_CHECK: (u32, u64, f64) = (100, 10_000, 100.0);

/// The sampling check's jobs: for each balancer, whole then sampled.
pub fn sampling_check() -> Result<Vec<Job>, String> {
    let (envoys, keys, per_envoy) = SAMPLING_CHECK;
    let mut jobs = Vec::new();
    for &balancer in &BALANCERS {
        let traffic = Traffic { envoys, per_envoy, keys, balancer };
        let seed = SEED ^ keys ^ 0x636b;
        let whole = job(format!("check-whole-{}", balancer.label()), traffic, Plan::EXACT, seed)?;
        let plan = keys::plan_for(&traffic, traffic.fleet_rate() / 8.0, seed)?;
        let sampled = job(format!("check-sampled-{}", balancer.label()), traffic, plan, seed)?;
        jobs.push(whole);
        jobs.push(sampled);
    }
    Ok(jobs)
}

/// The end-to-end shape (`tests/tests/long_tail.rs`): 3 Envoys, 300 keys at
/// 3 requests a second, per-second windows of 40 — simulated whole, and
/// with one key in ten standing for ten (the calls model where a call
/// carries several leases).
pub fn e2e() -> Result<Vec<Job>, String> {
    let keys = keys::flat(300, 3.0, 40)?;
    let sampled = keys::every_nth(&keys, 10)?;
    let config = |name: &str, keys: Vec<Key>, exact: bool| FleetConfig {
        name: name.into(),
        envoys: 3,
        total_keys: 300,
        table_groups: fleet::table_groups(1.0),
        keys,
        exact,
        warmup: WARMUP,
        measure: MEASURE,
        after: Nanos::ZERO,
        restart_at: None,
        seed: SEED,
        allowances: true,
        overshoot: None,
        check_baseline: false,
        record_items: true,
        network: Network::Datacenter,
        quota: default_quota(),
    };
    Ok(vec![Job::of(config("e2e-whole", keys, true), true), Job::of(config("e2e-sampled", sampled, false), true)])
}

/// Fleet sizes of the overshoot table (3: the end-to-end test's).
pub const OVERSHOOT_FLEETS: [u32; 4] = [3, 100, 1_000, 10_000];

/// The overshoot table's budget: 1 unit a second per key and Envoy.
pub const OVERSHOOT: Overshoot = Overshoot { limit: 1, period: SECOND };

/// The overshoot table: thin keys (`keys::thin`) over fleets of
/// [`OVERSHOOT_FLEETS`], strict and with a budget of 1 a second.
pub fn overshoot() -> Result<Vec<Job>, String> {
    let keys = keys::thin(200)?;
    let mut jobs = Vec::new();
    for &envoys in &OVERSHOOT_FLEETS {
        for overshoot in [None, Some(OVERSHOOT)] {
            let label = if overshoot.is_some() { "overshoot" } else { "strict" };
            let config = FleetConfig {
                name: format!("{envoys}x200-{label}"),
                envoys,
                total_keys: 200,
                table_groups: fleet::table_groups(1.0),
                keys: keys.clone(),
                exact: true,
                warmup: WARMUP,
                measure: Nanos::from_secs(30),
                after: Nanos::ZERO,
                restart_at: None,
                seed: SEED ^ u64::from(envoys),
                allowances: true,
                overshoot,
                check_baseline: false,
                record_items: false,
                network: Network::Datacenter,
                quota: default_quota(),
            };
            jobs.push(Job::of(config, false));
        }
    }
    Ok(jobs)
}
