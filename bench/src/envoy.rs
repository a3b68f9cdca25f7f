//! The Envoys under test: one bootstrap per variant (only the HTTP filters
//! differ), processes on free loopback ports, and their admin endpoints.

use std::collections::HashMap;
use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use floodgate_e2e::bootstrap::{self, admin, wasm_filter, Listener};
use floodgate_e2e::Conn;

/// Where the binaries and modules are.
#[derive(Clone, Debug)]
pub struct Paths {
    /// The Envoy binary.
    pub envoy: String,
    /// Floodgate's wasm module.
    pub floodgate_wasm: PathBuf,
    /// The no-op wasm module.
    pub noop_wasm: PathBuf,
    /// The host-call probe wasm module.
    pub probe_wasm: PathBuf,
    /// The floodgate-quota binary (for the global-filter and global-mode variants).
    pub quota_bin: PathBuf,
    /// A scratch directory for bootstraps and logs.
    pub scratch: PathBuf,
    /// The `unit` of the quota service's never-limiting fixed windows
    /// (`second`, `minute`, `hour`): a lease never outlives its window.
    pub quota_unit: String,
}

/// A token bucket of Envoy's `local_ratelimit` (max tokens, tokens per fill, fill interval).
#[derive(Clone, Copy, Debug)]
pub struct EnvoyBucket {
    /// `max_tokens` (also the initial content).
    pub max_tokens: u32,
    /// `tokens_per_fill`.
    pub tokens_per_fill: u32,
    /// `fill_interval`, e.g. `"10s"`.
    pub fill_interval: &'static str,
}

/// The HTTP filters in front of the router.
#[derive(Clone, Debug)]
pub enum Filters {
    /// No filter but the router.
    None,
    /// Envoy's `local_ratelimit` with one dynamic bucket per `x-api-key` value.
    EnvoyLocal(EnvoyBucket),
    /// The no-op wasm filter.
    Noop,
    /// Floodgate with this plugin configuration (JSON).
    Floodgate(String),
    /// Floodgate in global mode: this plugin configuration (JSON), and the
    /// cluster `floodgate-quota` its callouts go to, floodgate-quota's HTTP
    /// API on this loopback port.
    FloodgateGlobal {
        /// The plugin configuration.
        config: String,
        /// floodgate-quota's `--listen` port.
        quota: u16,
    },
    /// The host-call probe with this configuration (`<call>=<repeats>`).
    Probe(String),
    /// No filter, but proxied to an upstream (another Envoy's
    /// `direct_response`) on this loopback port: the ceiling of [`Filters::EnvoyGlobal`].
    Routed {
        /// The upstream's port.
        upstream: u16,
    },
    /// Envoy's global `ratelimit` filter, one descriptor per `x-api-key`
    /// value, asking floodgate-quota's gRPC API; proxied like [`Filters::Routed`]
    /// because the filter only acts on routes with a route entry.
    EnvoyGlobal {
        /// The upstream's port.
        upstream: u16,
        /// floodgate-quota's `--grpc-listen` port.
        grpc: u16,
    },
}

impl Filters {
    /// The `http_filters` entries before the router, as YAML indented for the
    /// connection manager.
    fn yaml(&self, paths: &Paths) -> String {
        match self {
            Filters::None => String::new(),
            // A descriptor entry with an empty value is a wildcard: each
            // distinct `api_key` value gets its own bucket (Envoy's "dynamic
            // descriptors", kept in an LRU of `max_dynamic_descriptors`). The
            // descriptor comes from the filter-level `rate_limits`, so no route
            // configuration is needed. `always_consume_default_token_bucket:
            // false` keeps the (never-limiting) default bucket out of requests
            // a descriptor matched, so only the per-key bucket decides.
            Filters::EnvoyLocal(b) => format!(
                r#"          - name: envoy.filters.http.local_ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit
              stat_prefix: per_api_key
              token_bucket: {{max_tokens: 1000000000, tokens_per_fill: 1000000000, fill_interval: 1s}}
              filter_enabled: {{default_value: {{numerator: 100, denominator: HUNDRED}}}}
              filter_enforced: {{default_value: {{numerator: 100, denominator: HUNDRED}}}}
              always_consume_default_token_bucket: false
              max_dynamic_descriptors: 65536
              rate_limits:
              - actions:
                - request_headers: {{header_name: x-api-key, descriptor_key: api_key}}
              descriptors:
              - entries: [{{key: api_key, value: ""}}]
                token_bucket: {{max_tokens: {}, tokens_per_fill: {}, fill_interval: {}}}
"#,
                b.max_tokens, b.tokens_per_fill, b.fill_interval
            ),
            Filters::Routed { .. } => String::new(),
            // failure_mode_deny: an unanswered call shows as a 500 (a
            // non-2xx in the table) rather than as a cheap pass.
            Filters::EnvoyGlobal { .. } => r#"          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: bench
              timeout: 1s
              failure_mode_deny: true
              rate_limit_service:
                transport_api_version: V3
                grpc_service: {envoy_grpc: {cluster_name: floodgate_quota}}
"#
            .to_string(),
            Filters::Noop => wasm_filter("noop", &paths.noop_wasm, "{}"),
            Filters::Floodgate(config) | Filters::FloodgateGlobal { config, .. } => {
                wasm_filter("floodgate", &paths.floodgate_wasm, config)
            }
            Filters::Probe(config) => wasm_filter("probe", &paths.probe_wasm, config),
        }
    }
}

/// Renders a complete bootstrap: the same listener and connection manager
/// for every variant, a `direct_response` route unless the variant proxies
/// to an upstream; only `filters` differ.
pub fn bootstrap(filters: &Filters, paths: &Paths, port: u16, admin_port: u16) -> String {
    let listener = Listener {
        port,
        stat_prefix: "bench",
        manager: "          use_remote_address: true\n",
        virtual_host: &routes(filters),
        http_filters: &filters.yaml(paths),
        balanced: false,
    };
    format!("static_resources:\n  listeners:\n{}{}{}", listener.item("bench"), clusters(filters), admin(admin_port))
}

/// The virtual host's routes: a `direct_response`, or a route to the
/// upstream (with the per-key rate limit action for the global filter), as
/// YAML lines indented for the virtual host.
fn routes(filters: &Filters) -> String {
    const TO_UPSTREAM: &str = r#"              routes:
              - match: {prefix: "/"}
                route: {cluster: upstream}
"#;
    match filters {
        Filters::Routed { .. } => TO_UPSTREAM.to_string(),
        Filters::EnvoyGlobal { .. } => format!(
            r#"              rate_limits:
              - actions:
                - request_headers: {{header_name: x-api-key, descriptor_key: api_key}}
{TO_UPSTREAM}"#
        ),
        _ => format!("              routes:\n{}", bootstrap::DIRECT_RESPONSE_ROUTE),
    }
}

/// The clusters a variant needs, as YAML under `static_resources`.
fn clusters(filters: &Filters) -> String {
    let cluster = |name: &str, port: u16, http2: bool| bootstrap::cluster(name, &[port], "1s", http2);
    bootstrap::clusters(&match filters {
        Filters::Routed { upstream } => vec![cluster("upstream", *upstream, false)],
        Filters::EnvoyGlobal { upstream, grpc } => {
            vec![cluster("upstream", *upstream, false), cluster("floodgate_quota", *grpc, true)]
        }
        // The filter's callouts are HTTP/1.1, as in the end-to-end tests.
        Filters::FloodgateGlobal { quota, .. } => vec![cluster("floodgate-quota", *quota, false)],
        _ => Vec::new(),
    })
}

/// A loopback port that was free a moment ago and that this process has not
/// handed out before. Another process may still take it before Envoy binds
/// it (the machine is shared); [`Envoy::wait_ready`] starts again on new
/// ports when that happens.
fn free_port() -> u16 {
    static USED: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let mut used = USED.lock().unwrap();
    loop {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        if !used.contains(&port) {
            used.push(port);
            return port;
        }
    }
}

/// A running Envoy, killed on drop.
pub struct Envoy {
    /// A short name (the variant), for messages.
    pub name: String,
    child: Child,
    /// The HTTP listener's port.
    pub port: u16,
    /// The admin port.
    pub admin_port: u16,
    log: PathBuf,
    config: PathBuf,
    filters: Filters,
    paths: Paths,
    attempts: u32,
}

impl Envoy {
    /// Writes the bootstrap, checks it with `envoy --mode validate`, and
    /// spawns Envoy without waiting for it to be ready (several start in
    /// parallel; call [`Envoy::wait_ready`]).
    pub fn spawn(name: &str, filters: &Filters, paths: &Paths) -> Envoy {
        let (port, admin_port) = (free_port(), free_port());
        let config = paths.scratch.join(format!("{name}.yaml"));
        fs::write(&config, bootstrap(filters, paths, port, admin_port)).unwrap();
        Self::validate(&config, paths);
        let log = paths.scratch.join(format!("{name}.log"));
        let child = Self::run(&config, &log, paths);
        Envoy {
            name: name.to_string(),
            child,
            port,
            admin_port,
            log,
            config,
            filters: filters.clone(),
            paths: paths.clone(),
            attempts: 1,
        }
    }

    fn validate(config: &Path, paths: &Paths) {
        let check = Command::new(&paths.envoy)
            .args(["--mode", "validate", "--log-level", "error", "-c"])
            .arg(config)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", paths.envoy));
        assert!(
            check.status.success(),
            "envoy --mode validate refused {}:\n{}{}",
            config.display(),
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        );
    }

    fn run(config: &Path, log: &Path, paths: &Paths) -> Child {
        let child = Command::new(&paths.envoy)
            // No hot restart: several Envoys run side by side.
            .args(["--concurrency", "2", "--disable-hot-restart", "--log-level", "warn", "-c"])
            .arg(config)
            .stdout(Stdio::null())
            .stderr(fs::File::create(log).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", paths.envoy));
        RUNNING.lock().unwrap().push(child.id());
        child
    }

    /// Starts Envoy and waits until it is ready.
    pub fn start(name: &str, filters: &Filters, paths: &Paths) -> Envoy {
        let mut envoy = Envoy::spawn(name, filters, paths);
        envoy.wait_ready();
        envoy
    }

    /// Waits (up to 60 s) until the admin `/ready` answers 200.
    pub fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                let id = self.child.id();
                RUNNING.lock().unwrap().retain(|&pid| pid != id);
                if self.attempts < 5 && self.log_tail().contains("Address already in use") {
                    // Someone else took a port between our probe and Envoy's bind.
                    self.attempts += 1;
                    self.port = free_port();
                    self.admin_port = free_port();
                    fs::write(&self.config, bootstrap(&self.filters, &self.paths, self.port, self.admin_port)).unwrap();
                    self.child = Self::run(&self.config, &self.log, &self.paths);
                    continue;
                }
                panic!("envoy {} exited with {status} before it was ready:\n{}", self.name, self.log_tail());
            }
            if self.admin("/ready").is_some_and(|(status, _)| status == 200) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("envoy {} was not ready within 60 s:\n{}", self.name, self.log_tail());
    }

    /// The last lines Envoy logged.
    pub fn log_tail(&self) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// `GET path` on the admin port: status and body.
    pub fn admin(&self, path: &str) -> Option<(u16, String)> {
        let response = Conn::open(self.admin_port).ok()?.try_request("GET", path, &[]).ok()?;
        Some((response.status, String::from_utf8_lossy(&response.body).into_owned()))
    }

    /// Every counter and gauge in `/stats`, once Floodgate's workers have
    /// flushed their counts (within 100 ms of counting, on their tick).
    pub fn stats(&self) -> HashMap<String, u64> {
        std::thread::sleep(std::time::Duration::from_millis(250));
        let (_, body) = self.admin("/stats").unwrap_or_default();
        body.lines()
            .filter_map(|line| {
                let (name, value) = line.split_once(": ")?;
                Some((name.to_string(), value.trim().parse().ok()?))
            })
            .collect()
    }

    /// Connections each worker accepted on the bench listener so far
    /// (`listener.<addr>.worker_<n>.downstream_cx_total`), by worker.
    pub fn worker_connections(&self) -> Vec<u64> {
        let stats = self.stats();
        (0..)
            .map_while(|n| stats.get(&format!("listener.127.0.0.1_{}.worker_{n}.downstream_cx_total", self.port)))
            .copied()
            .collect()
    }

    /// `allocated` and `heap_size` from the admin `/memory`, in bytes.
    pub fn memory(&self) -> (u64, u64) {
        let (_, body) = self.admin("/memory").unwrap_or_default();
        let json: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        // The admin endpoint renders the numbers as strings.
        let field = |name: &str| -> u64 {
            match &json[name] {
                serde_json::Value::String(s) => s.parse().unwrap_or(0),
                value => value.as_u64().unwrap_or(0),
            }
        };
        (field("allocated"), field("heap_size"))
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let id = self.child.id();
        RUNNING.lock().unwrap_or_else(|e| e.into_inner()).retain(|&pid| pid != id);
    }
}

/// floodgate-quota with the memory store and its gRPC API on, for the
/// global-filter variant and Floodgate's global mode; killed on drop.
pub struct QuotaProcess {
    child: Child,
    /// The `--listen` port (the HTTP API Floodgate's global mode calls, and `/metrics`).
    pub http_port: u16,
    /// The `--grpc-listen` port.
    pub grpc_port: u16,
}

impl QuotaProcess {
    /// Starts the service (domain `bench`) with never-limiting rules: one per
    /// `api_key` value (fixed windows of `BENCH_QUOTA_UNIT`), one per
    /// [`PER_MINUTE_KEY`] value (fixed windows of a minute, whatever
    /// `BENCH_QUOTA_UNIT` says), and [`HOT_KEY`] for a single hot key; waits until its
    /// HTTP and gRPC ports accept connections. `extra` goes on its command
    /// line (e.g. `--lease-ttl 10s`); `name` tells its files from others'.
    pub fn start(paths: &Paths, name: &str, extra: &[&str]) -> QuotaProcess {
        assert!(
            paths.quota_bin.exists(),
            "{} is missing: build it (make -f bench/bench.mk filter-bench builds it)",
            paths.quota_bin.display()
        );
        let limits = paths.scratch.join(format!("{name}-limits.yaml"));
        fs::write(
            &limits,
            format!(
                "domain: bench\ndescriptors:\n  - key: api_key\n    rate_limit: {{unit: {unit}, requests_per_unit: 1000000000}}\n  \
                 - key: {PER_MINUTE_KEY}\n    rate_limit: {{unit: minute, requests_per_unit: 1000000000}}\n  \
                 - key: {}\n    value: {}\n    rate_limit: {{unit: {unit}, requests_per_unit: 1000000000}}\n",
                HOT_KEY.0,
                HOT_KEY.1,
                unit = paths.quota_unit
            ),
        )
        .unwrap();
        let (http_port, grpc_port) = (free_port(), free_port());
        let child = Command::new(&paths.quota_bin)
            .arg("--config")
            .arg(&limits)
            .args(["--listen", &format!("127.0.0.1:{http_port}"), "--grpc-listen", &format!("127.0.0.1:{grpc_port}")])
            .args(["--store", "memory"])
            // Every variant's Envoy calls from 127.0.0.1: one address standing
            // for many Envoys, as behind a proxy. With a share of the lease
            // records per address, the variants run before it (10,000 keys'
            // leases, each record kept its lease plus 30 s) filled the share,
            // and the next global variant's first round was refused (503) and
            // decided by its fall-back (docs/benchmarks.md, 06:37).
            .args(["--max-connections-per-peer", "0"])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(fs::File::create(paths.scratch.join(format!("{name}.log"))).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", paths.quota_bin.display()));
        RUNNING.lock().unwrap().push(child.id());
        let mut quota = QuotaProcess { child, http_port, grpc_port };
        let deadline = Instant::now() + Duration::from_secs(30);
        let listening = |port: u16| std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
        while !(listening(http_port) && listening(grpc_port)) {
            if let Ok(Some(status)) = quota.child.try_wait() {
                let log = fs::read_to_string(paths.scratch.join(format!("{name}.log"))).unwrap_or_default();
                panic!("floodgate-quota exited with {status}:\n{log}");
            }
            assert!(Instant::now() < deadline, "floodgate-quota did not listen within 30 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        quota
    }

    /// The calls the service has answered on one endpoint (`lease`, `check`,
    /// `return`, `rls`), whatever their status: `floodgate_quota_requests_total`
    /// summed over its `status` label.
    pub fn requests(&self, endpoint: &str) -> u64 {
        let body = Conn::open(self.http_port)
            .ok()
            .and_then(|mut c| c.try_request("GET", "/metrics", &[]).ok())
            .map(|r| String::from_utf8_lossy(&r.body).into_owned())
            .unwrap_or_default();
        let label = format!("endpoint=\"{endpoint}\"");
        body.lines()
            .filter(|line| line.starts_with("floodgate_quota_requests_total{") && line.contains(&label))
            .filter_map(|line| line.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum::<f64>() as u64
    }
}

/// The descriptor entry (key, value) of the hot-key limit in the service's
/// limits file, which Floodgate's hot-key global rules send.
pub const HOT_KEY: (&str, &str) = ("route", "hot");

/// The descriptor key of the service's key-only per-minute entry (fixed
/// windows of a minute, 10⁹ each), which the per-minute global rules send.
pub const PER_MINUTE_KEY: &str = "api_key_m";

impl Drop for QuotaProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let id = self.child.id();
        RUNNING.lock().unwrap_or_else(|e| e.into_inner()).retain(|&pid| pid != id);
    }
}

/// The processes (Envoys, floodgate-quota) this process started and has not stopped yet.
static RUNNING: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// Makes a panic stop the processes this process started. The workspace's
/// release profile aborts on panic, so `Drop` never runs then; without this
/// a failed run would leave its Envoys serving.
pub fn stop_envoys_on_panic() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default_hook(info);
        let pids = RUNNING.lock().map(|p| p.clone()).unwrap_or_default();
        for pid in pids {
            let _ = Command::new("kill").arg(pid.to_string()).status();
        }
    }));
}
