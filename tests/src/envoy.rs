//! The Envoy process: started on free loopback ports from a bootstrap
//! (started again on new ports if another process took one first), its
//! admin endpoint (readiness, stats, memory), listener updates by LDS, and
//! `envoy --mode validate`.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::bootstrap::{stats_prefix_from_env, Build};
use crate::http::Conn;
use crate::ports::{free_port, scratch_dir};
use crate::process::Process;
use crate::setup::Setup;

/// The Envoy binary: `$ENVOY_BIN`, or `envoy` on the PATH.
pub fn envoy_bin() -> String {
    std::env::var("ENVOY_BIN").unwrap_or_else(|_| "envoy".to_string())
}

/// Runs `envoy --mode validate` on a bootstrap file.
pub fn validate(config: &Path) -> Output {
    validate_with(&envoy_bin(), config)
}

/// What Envoy says when it refuses `setup`: its log from `envoy --mode
/// validate` on the set-up's bootstrap, which creates the filter's
/// configuration as a start does. Panics if Envoy accepts it.
pub fn refusal(setup: &Setup) -> String {
    let path = scratch_dir().join("refused.json");
    fs::write(&path, setup.bootstrap(free_port(), free_port()).to_string()).unwrap();
    let output = validate(&path);
    let log = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(!output.status.success(), "envoy accepted the configuration:\n{}\n{log}", setup.plugin_config);
    log
}

fn validate_with(bin: &str, config: &Path) -> Output {
    Command::new(bin)
        .args(["--mode", "validate", "--log-level", "error", "-c"])
        .arg(config)
        .current_dir(crate::ports::repo_root())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {bin}: {e}"))
}

/// How an Envoy runs: always `--concurrency 2` without hot restart
/// (several run side by side), and what differs between the tests and the
/// bench.
#[derive(Clone, Debug)]
pub struct EnvoyOptions {
    /// The binary.
    pub bin: String,
    /// A short name, for its files (`<name>.json`, `<name>.log`) and messages.
    pub name: String,
    /// Where its files go.
    pub dir: PathBuf,
    /// `--log-level`.
    pub log_level: &'static str,
    /// Further command-line flags.
    pub flags: Vec<String>,
    /// Whether the bootstrap is checked with `envoy --mode validate` before
    /// Envoy starts, so that a bad one fails with Envoy's message.
    pub validate_first: bool,
}

impl EnvoyOptions {
    /// The end-to-end tests': `info` logs (tests read what the filter
    /// logs), a listener drained within 1 s of an update, and access logs
    /// a test configures in their files within 100 ms.
    pub fn e2e() -> EnvoyOptions {
        EnvoyOptions {
            bin: envoy_bin(),
            name: "envoy".into(),
            dir: scratch_dir(),
            log_level: "info",
            flags: ["--drain-time-s", "1", "--file-flush-interval-msec", "100"].map(String::from).to_vec(),
            validate_first: false,
        }
    }
}

/// Writes the files an Envoy reads, for its listener and admin ports, into
/// its directory; returns the bootstrap's path.
type WriteConfig = Box<dyn Fn(&EnvoyOptions, u16, u16) -> PathBuf + Send + Sync>;

/// How a listener update ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Update {
    /// Envoy took the new listener.
    Accepted,
    /// Envoy refused it and kept the old one.
    Rejected,
}

/// A running Envoy, killed on drop.
pub struct Envoy {
    process: Process,
    /// The HTTP listener's port.
    pub port: u16,
    /// The admin port.
    pub admin_port: u16,
    options: EnvoyOptions,
    write_config: WriteConfig,
    config: PathBuf,
    attempts: u32,
    /// The prefix of Floodgate's stats in this Envoy (its [`Build`]'s).
    filter_stats: &'static str,
}

/// Writes `bootstrap` (JSON) as `<name>.json` in the options' directory;
/// returns its path.
pub fn write_bootstrap(options: &EnvoyOptions, bootstrap: &Value) -> PathBuf {
    let path = options.dir.join(format!("{}.json", options.name));
    fs::write(&path, bootstrap.to_string()).unwrap();
    path
}

impl Envoy {
    /// Starts Envoy with `setup` as a static listener and waits until it is ready.
    pub fn start(setup: &Setup) -> Envoy {
        let build = setup.build.clone();
        let setup = setup.clone();
        Self::start_with(EnvoyOptions::e2e(), move |options, port, admin_port| {
            write_bootstrap(options, &setup.bootstrap(port, admin_port))
        })
        .loading(&build)
    }

    /// Starts Envoy with `setup` as a listener served from a file by LDS, so
    /// that [`Envoy::update_listener`] can change it as a control plane would.
    pub fn start_dynamic(setup: &Setup) -> Envoy {
        let build = setup.build.clone();
        let setup = setup.clone();
        Self::start_with(EnvoyOptions::e2e(), move |options, port, admin_port| {
            let lds = options.dir.join("lds.json");
            fs::write(&lds, setup.listener(port).to_lds_file().to_string()).unwrap();
            write_bootstrap(options, &setup.dynamic_bootstrap(&lds, admin_port))
        })
        .loading(&build)
    }

    /// The same Envoy, its Floodgate stats read as `build`'s
    /// ([`Envoy::filter_stat`]); an Envoy started from a bootstrap of the
    /// caller's reads them as the build `$FLOODGATE_BUILD` names.
    pub fn loading(mut self, build: &Build) -> Envoy {
        self.filter_stats = build.stats_prefix();
        self
    }

    /// Starts Envoy with a YAML bootstrap of the caller's, rendered for the
    /// listener and admin ports it is given, and waits until it is ready.
    pub fn start_bootstrap(render: impl Fn(u16, u16) -> String + Send + Sync + 'static) -> Envoy {
        Self::start_with(EnvoyOptions::e2e(), move |options, port, admin_port| {
            let path = options.dir.join(format!("{}.yaml", options.name));
            fs::write(&path, render(port, admin_port)).unwrap();
            path
        })
    }

    /// Starts Envoy with `options` and the files `write_config` writes, and
    /// waits until it is ready.
    pub fn start_with(
        options: EnvoyOptions,
        write_config: impl Fn(&EnvoyOptions, u16, u16) -> PathBuf + Send + Sync + 'static,
    ) -> Envoy {
        let mut envoy = Self::spawn(options, write_config);
        envoy.wait_ready();
        envoy
    }

    /// Starts Envoy with `options` and the files `write_config` writes (a
    /// bootstrap for the listener and admin ports it is given, in the
    /// options' directory; it returns the bootstrap's path), without waiting
    /// for it to be ready (several may start at once; then call
    /// [`Envoy::wait_ready`]).
    pub fn spawn(
        options: EnvoyOptions,
        write_config: impl Fn(&EnvoyOptions, u16, u16) -> PathBuf + Send + Sync + 'static,
    ) -> Envoy {
        let (port, admin_port) = (free_port(), free_port());
        let config = write_config(&options, port, admin_port);
        if options.validate_first {
            let check = validate_with(&options.bin, &config);
            assert!(
                check.status.success(),
                "envoy --mode validate refused {}:\n{}{}",
                config.display(),
                String::from_utf8_lossy(&check.stdout),
                String::from_utf8_lossy(&check.stderr)
            );
        }
        let process = Self::run(&options, &config);
        Envoy {
            process,
            port,
            admin_port,
            options,
            write_config: Box::new(write_config),
            config,
            attempts: 1,
            filter_stats: stats_prefix_from_env(),
        }
    }

    fn run(options: &EnvoyOptions, config: &Path) -> Process {
        let log = fs::File::create(Self::log_path(options)).unwrap();
        let mut command = Command::new(&options.bin);
        command
            .args(["--concurrency", "2", "--disable-hot-restart", "--log-level", options.log_level])
            .args(&options.flags)
            .arg("-c")
            .arg(config)
            .stdout(Stdio::null())
            .stderr(log);
        Process::spawn(&mut command).unwrap_or_else(|e| panic!("cannot start {}: {e}", options.bin))
    }

    fn log_path(options: &EnvoyOptions) -> PathBuf {
        options.dir.join(format!("{}.log", options.name))
    }

    /// Its short name.
    pub fn name(&self) -> &str {
        &self.options.name
    }

    /// Waits (up to 60 s) until the admin `/ready` answers 200. If Envoy
    /// exits because a port was taken meanwhile (the machine is shared), it
    /// starts again on new ports, up to five times.
    pub fn wait_ready(&mut self) {
        // Longer only where Envoy runs under a profiler (bench/scripts/callgrind.sh).
        let wait = std::env::var("FLOODGATE_ENVOY_READY_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(60);
        let deadline = Instant::now() + Duration::from_secs(wait);
        while Instant::now() < deadline {
            if let Some(status) = self.process.exited() {
                if self.attempts < 5 && self.log_tail().contains("Address already in use") {
                    self.attempts += 1;
                    (self.port, self.admin_port) = (free_port(), free_port());
                    self.config = (self.write_config)(&self.options, self.port, self.admin_port);
                    self.process = Self::run(&self.options, &self.config);
                    continue;
                }
                panic!("envoy {} exited with {status} before it was ready:\n{}", self.name(), self.log_tail());
            }
            if self.admin("/ready").is_some_and(|(status, _)| status == 200) {
                return;
            }
            thread::sleep(Duration::from_millis(50));
        }
        panic!("envoy {} was not ready within {wait} s:\n{}", self.name(), self.log_tail());
    }

    /// Replaces a dynamic listener with `setup`'s (same port), as an LDS
    /// update, and waits until Envoy has accepted or rejected it.
    pub fn update_listener(&self, setup: &Setup) -> Update {
        let count = |name: &str| self.stat(&format!("listener_manager.lds.{name}"));
        let (accepted, rejected) = (count("update_success"), count("update_rejected"));
        let staged = self.options.dir.join("lds.json.next");
        fs::write(&staged, setup.listener(self.port).to_lds_file().to_string()).unwrap();
        // A rename, so Envoy never reads a half-written file.
        fs::rename(&staged, self.options.dir.join("lds.json")).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if count("update_success") > accepted {
                // The new listener serves once it has warmed up.
                while self.stat("listener_manager.total_listeners_warming") > 0 {
                    assert!(Instant::now() < deadline, "the new listener never warmed up");
                    thread::sleep(Duration::from_millis(20));
                }
                return Update::Accepted;
            }
            if count("update_rejected") > rejected {
                return Update::Rejected;
            }
            assert!(Instant::now() < deadline, "envoy neither took nor refused the update:\n{}", self.log_tail());
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// The last lines Envoy logged.
    pub fn log_tail(&self) -> String {
        let text = self.log();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Everything Envoy logged so far.
    pub fn log(&self) -> String {
        fs::read_to_string(Self::log_path(&self.options)).unwrap_or_default()
    }

    /// A new keep-alive connection to the listener.
    pub fn connect(&self) -> Conn {
        Conn::open(self.port).unwrap()
    }

    /// `GET path` on the admin port: status and body; `None` if it did not answer.
    pub fn admin(&self, path: &str) -> Option<(u16, String)> {
        let response = Conn::open(self.admin_port).ok()?.try_request("GET", path, &[]).ok()?;
        Some((response.status, String::from_utf8_lossy(&response.body).into_owned()))
    }

    /// Every counter and gauge in `/stats`, once the filter's workers have
    /// flushed what they counted: the wasm filter hands its counts to Envoy
    /// on each worker's tick, at most 100 ms after counting (the native one
    /// as it counts), so this waits
    /// until two reads 150 ms apart agree (at most 3 s, for stats that move
    /// under traffic).
    pub fn stats(&self) -> HashMap<String, u64> {
        let mut last = self.stats_now();
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            thread::sleep(Duration::from_millis(150));
            let next = self.stats_now();
            if next == last || Instant::now() > deadline {
                return next;
            }
            last = next;
        }
    }

    /// Every counter and gauge 250 ms from now, time enough for the filter's
    /// workers to flush what they counted (each on its 100 ms tick), without
    /// waiting for the values to settle: for reads while a load runs.
    pub fn stats_flushed(&self) -> HashMap<String, u64> {
        thread::sleep(Duration::from_millis(250));
        self.admin("/stats").map(|(_, body)| parse_stats(&body)).unwrap_or_default()
    }

    /// Every counter and gauge in `/stats` as Envoy has them now.
    pub fn stats_now(&self) -> HashMap<String, u64> {
        let body = Conn::open(self.admin_port).unwrap().get("/stats", &[]).body;
        parse_stats(&String::from_utf8_lossy(&body))
    }

    /// One stat, 0 if absent.
    pub fn stat(&self, name: &str) -> u64 {
        self.stats().get(name).copied().unwrap_or(0)
    }

    /// One stat as Envoy has it now (for polling until it reads a value).
    pub fn stat_now(&self, name: &str) -> u64 {
        self.stats_now().get(name).copied().unwrap_or(0)
    }

    /// The full name of Floodgate's stat `name` (e.g. `rule.per-key.allowed`)
    /// in this Envoy: under `wasmcustom.floodgate.` or
    /// `dynamicmodulescustom.floodgate.`, as its build has them.
    pub fn filter_stat_name(&self, name: &str) -> String {
        format!("{}{name}", self.filter_stats)
    }

    /// Floodgate's stat `name`, as [`Envoy::stat`] reads it, 0 if absent.
    pub fn filter_stat(&self, name: &str) -> u64 {
        self.stat(&self.filter_stat_name(name))
    }

    /// Floodgate's stat `name` as Envoy has it now.
    pub fn filter_stat_now(&self, name: &str) -> u64 {
        self.stat_now(&self.filter_stat_name(name))
    }

    /// Connections each worker accepted on the listener so far
    /// (`listener.<addr>.worker_<n>.downstream_cx_total`), by worker, read
    /// as [`Envoy::stats_flushed`] reads them.
    pub fn worker_connections(&self) -> Vec<u64> {
        let stats = self.stats_flushed();
        (0..)
            .map_while(|n| stats.get(&format!("listener.127.0.0.1_{}.worker_{n}.downstream_cx_total", self.port)))
            .copied()
            .collect()
    }

    /// `allocated` and `heap_size` from the admin `/memory`, in bytes.
    pub fn memory(&self) -> (u64, u64) {
        let (_, body) = self.admin("/memory").unwrap_or_default();
        let json: Value = serde_json::from_str(&body).unwrap_or_default();
        // The admin endpoint renders the numbers as strings.
        let field = |name: &str| -> u64 {
            match &json[name] {
                Value::String(s) => s.parse().unwrap_or(0),
                value => value.as_u64().unwrap_or(0),
            }
        };
        (field("allocated"), field("heap_size"))
    }

    /// True while the process runs.
    pub fn is_running(&mut self) -> bool {
        self.process.exited().is_none()
    }
}

/// `name: value` lines of `/stats` with a whole-number value.
fn parse_stats(body: &str) -> HashMap<String, u64> {
    body.lines()
        .filter_map(|line| {
            let (name, value) = line.split_once(": ")?;
            Some((name.to_string(), value.trim().parse().ok()?))
        })
        .collect()
}

/// Asserts both of Envoy's workers accepted connections during the test.
pub fn assert_both_workers_served(envoy: &Envoy) {
    let stats = envoy.stats();
    for worker in ["worker_0", "worker_1"] {
        let name = format!("listener.127.0.0.1_{}.{worker}.downstream_cx_total", envoy.port);
        assert!(stats.get(&name).copied().unwrap_or(0) > 0, "{name} is 0: the load did not reach both workers");
    }
}
