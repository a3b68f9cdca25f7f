//! Harness for the end-to-end tests: starts a real Envoy (`--concurrency 2`)
//! with the Floodgate wasm on free loopback ports, and speaks plain HTTP/1.1
//! to it over keep-alive connections. The client is hand-rolled on purpose:
//! tests must be able to send bytes a well-behaved client library refuses to
//! (non-UTF-8 header values, thousands of headers).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod bootstrap;

use std::collections::HashMap;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The Envoy binary: `$ENVOY_BIN`, or `envoy` on the PATH.
pub fn envoy_bin() -> String {
    std::env::var("ENVOY_BIN").unwrap_or_else(|_| "envoy".to_string())
}

/// The built filter: `$FLOODGATE_WASM`, or the release build in `target/`.
pub fn wasm_path() -> PathBuf {
    let path = std::env::var("FLOODGATE_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|_| repo_root().join("target/wasm32-wasip1/release/floodgate.wasm"));
    assert!(path.exists(), "{} is missing: build it with `make wasm`", path.display());
    path
}

/// A loopback port nothing listens on, never handed out twice in this
/// process: the tests of one file run side by side, and Envoy binds its
/// listeners with `SO_REUSEPORT`, so two Envoys given the same port would
/// both bind it and share each other's connections.
fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut given = GIVEN.lock().unwrap();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

fn scratch_dir() -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "floodgate-e2e-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    fs::create_dir_all(&dir).unwrap();
    dir
}

/// How to set up the Envoy under test.
#[derive(Clone, Debug)]
pub struct Setup {
    /// The plugin configuration (JSON).
    pub plugin_config: String,
    /// Extra `HttpConnectionManager` fields, as YAML lines indented for it.
    pub hcm_extra: String,
    /// The connection manager's `use_remote_address`: whether the client is
    /// the connection's peer (true) or taken from `x-forwarded-for`.
    pub use_remote_address: bool,
    /// Clusters the filter may call (name, loopback ports): e.g. the quota service.
    pub clusters: Vec<(String, Vec<u16>)>,
    /// HTTP filters between Floodgate and the router, as YAML list items
    /// indented for `http_filters` (e.g. [`FAULT_DELAY_FROM_HEADER`]).
    pub extra_http_filters: String,
    /// HTTP filters before Floodgate (e.g. `jwt_authn`), indented the same way.
    pub filters_before: String,
    /// The routes of the listener's one virtual host, as YAML list items
    /// indented for `routes`; `None`: every request answered 200 by Envoy
    /// itself (a direct response, so no cluster).
    pub routes: Option<String>,
    /// The bootstrap's `node.cluster` (Envoy's local service cluster).
    pub node_cluster: Option<String>,
    /// The port of a second listener that answers every request 200
    /// `upstream`, once [`Setup::with_upstream`] named clusters for it.
    upstream_port: Option<u16>,
}

/// Envoy's fault filter, delaying each request by the milliseconds in its
/// `x-envoy-fault-delay-request` header (none without it) before the router:
/// with the harness's direct-response route, an upstream that takes that long.
pub const FAULT_DELAY_FROM_HEADER: &str = r#"          - name: envoy.filters.http.fault
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault
              delay:
                header_delay: {}
                percentage: {numerator: 100, denominator: HUNDRED}
"#;

impl Setup {
    /// Envoy with `plugin_config` and default connection-manager settings.
    pub fn new(plugin_config: &str) -> Self {
        Self {
            plugin_config: plugin_config.to_string(),
            hcm_extra: String::new(),
            use_remote_address: true,
            extra_http_filters: String::new(),
            filters_before: String::new(),
            routes: None,
            node_cluster: None,
            clusters: Vec::new(),
            upstream_port: None,
        }
    }

    /// The same, with clusters `names` that lead to an upstream answering
    /// every request 200 `upstream` (a listener of the same Envoy), for
    /// routes that need a cluster.
    pub fn with_upstream(mut self, names: &[&str]) -> Self {
        let port = *self.upstream_port.get_or_insert_with(free_port);
        for name in names {
            self.clusters.push((name.to_string(), vec![port]));
        }
        self
    }

    /// The same, with a cluster `name` of loopback `ports` for the filter's callouts.
    pub fn with_cluster(mut self, name: &str, ports: &[u16]) -> Self {
        self.clusters.push((name.to_string(), ports.to_vec()));
        self
    }

    /// The static clusters, as YAML under `static_resources`.
    fn clusters_yaml(&self) -> String {
        let items: Vec<String> =
            self.clusters.iter().map(|(name, ports)| bootstrap::cluster(name, ports, "0.25s", false)).collect();
        bootstrap::clusters(&items)
    }

    /// Renders the bootstrap YAML for the given ports.
    pub fn bootstrap(&self, port: u16, admin_port: u16) -> String {
        let node = match &self.node_cluster {
            Some(cluster) => format!("node: {{id: e2e, cluster: {cluster}}}\n"),
            None => String::new(),
        };
        format!(
            "{node}static_resources:\n  listeners:\n  - name: main\n{}{}{}{}",
            self.listener_fields(port),
            self.upstream_listener(),
            self.clusters_yaml(),
            bootstrap::admin(admin_port)
        )
    }

    /// The listener that plays the upstream, if any.
    fn upstream_listener(&self) -> String {
        let Some(port) = self.upstream_port else { return String::new() };
        let virtual_host = format!("              routes:\n{}", bootstrap::DIRECT_RESPONSE_ROUTE);
        bootstrap::Listener {
            port,
            stat_prefix: "upstream",
            manager: "",
            virtual_host: &virtual_host,
            http_filters: "",
            balanced: false,
        }
        .item("upstream")
    }

    /// The listener's fields (address, filter chains), indented for an item
    /// of a list. Its connections are balanced over the workers, so what a
    /// test says of two workers is shown whenever it opens two connections.
    fn listener_fields(&self, port: u16) -> String {
        let manager = format!("          use_remote_address: {}\n{}\n", self.use_remote_address, self.hcm_extra);
        let routes = self.routes.as_deref().unwrap_or(bootstrap::DIRECT_RESPONSE_ROUTE);
        let virtual_host = format!("              routes:\n{routes}");
        let floodgate = bootstrap::wasm_filter("floodgate", &wasm_path(), &self.plugin_config);
        let http_filters = format!("{}{floodgate}{}", self.filters_before, self.extra_http_filters);
        bootstrap::Listener {
            port,
            stat_prefix: "e2e",
            manager: &manager,
            virtual_host: &virtual_host,
            http_filters: &http_filters,
            balanced: true,
        }
        .fields()
    }

    /// The listener as an LDS resource file.
    fn lds_file(&self, port: u16) -> String {
        format!(
            "resources:\n  - \"@type\": type.googleapis.com/envoy.config.listener.v3.Listener\n    name: main\n{}",
            self.listener_fields(port)
        )
    }
}

/// How a listener update ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Update {
    /// Envoy took the new listener.
    Accepted,
    /// Envoy refused it and kept the old one.
    Rejected,
}

/// Runs `envoy --mode validate` on a bootstrap file.
pub fn validate(config: &Path) -> Output {
    Command::new(envoy_bin())
        .args(["--mode", "validate", "--log-level", "error", "-c"])
        .arg(config)
        .current_dir(repo_root())
        .output()
        .expect("run envoy")
}

/// A running Envoy, killed on drop.
pub struct Envoy {
    child: Child,
    /// The HTTP listener's port.
    pub port: u16,
    /// The admin port.
    pub admin_port: u16,
    log: PathBuf,
    /// Where a dynamic listener's LDS file lives.
    dir: PathBuf,
}

impl Envoy {
    /// Starts Envoy with `setup` as a static listener and waits until it is ready.
    pub fn start(setup: &Setup) -> Envoy {
        let dir = scratch_dir();
        let (port, admin_port) = (free_port(), free_port());
        Self::spawn(dir, port, admin_port, setup.bootstrap(port, admin_port))
    }

    /// Starts Envoy with `setup` as a listener served from a file by LDS, so
    /// that [`Envoy::update_listener`] can change it as a control plane would.
    pub fn start_dynamic(setup: &Setup) -> Envoy {
        let dir = scratch_dir();
        let (port, admin_port) = (free_port(), free_port());
        fs::write(dir.join("lds.yaml"), setup.lds_file(port)).unwrap();
        let clusters = setup.clusters_yaml();
        let static_resources =
            if clusters.is_empty() { String::new() } else { format!("static_resources:\n{clusters}") };
        let bootstrap = format!(
            "node: {{id: e2e, cluster: e2e}}\ndynamic_resources:\n  lds_config:\n    resource_api_version: V3\n    \
             path_config_source:\n      path: {lds}\n      watched_directory: {{path: {dir}}}\n{static_resources}{admin}",
            lds = dir.join("lds.yaml").display(),
            dir = dir.display(),
            admin = bootstrap::admin(admin_port),
        );
        Self::spawn(dir, port, admin_port, bootstrap)
    }

    /// Starts Envoy with a bootstrap of the caller's, rendered for the
    /// listener and admin ports it is given, and waits until it is ready.
    pub fn start_bootstrap(render: impl FnOnce(u16, u16) -> String) -> Envoy {
        let (port, admin_port) = (free_port(), free_port());
        Self::spawn(scratch_dir(), port, admin_port, render(port, admin_port))
    }

    fn spawn(dir: PathBuf, port: u16, admin_port: u16, bootstrap: String) -> Envoy {
        let config = dir.join("envoy.yaml");
        fs::write(&config, bootstrap).unwrap();
        let log = dir.join("envoy.log");
        let child = Command::new(envoy_bin())
            // No hot restart: several test Envoys run side by side. Access
            // logs a test configures reach their files within 100 ms.
            .args(["--concurrency", "2", "--log-level", "info", "--disable-hot-restart", "--drain-time-s", "1"])
            .args(["--file-flush-interval-msec", "100", "-c"])
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .expect("start envoy");
        let mut envoy = Envoy { child, port, admin_port, log, dir };
        envoy.wait_ready();
        envoy
    }

    /// Replaces a dynamic listener with `setup`'s (same port), as an LDS
    /// update, and waits until Envoy has accepted or rejected it.
    pub fn update_listener(&self, setup: &Setup) -> Update {
        let count = |name: &str| self.stat(&format!("listener_manager.lds.{name}"));
        let (accepted, rejected) = (count("update_success"), count("update_rejected"));
        let staged = self.dir.join("lds.yaml.next");
        fs::write(&staged, setup.lds_file(self.port)).unwrap();
        // A rename, so Envoy never reads a half-written file.
        fs::rename(&staged, self.dir.join("lds.yaml")).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if count("update_success") > accepted {
                // The new listener serves once it has warmed up.
                while self.stat("listener_manager.total_listeners_warming") > 0 {
                    assert!(Instant::now() < deadline, "the new listener never warmed up");
                    std::thread::sleep(Duration::from_millis(20));
                }
                return Update::Accepted;
            }
            if count("update_rejected") > rejected {
                return Update::Rejected;
            }
            assert!(Instant::now() < deadline, "envoy neither took nor refused the update:\n{}", self.log_tail());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("envoy exited with {status} before it was ready:\n{}", self.log_tail());
            }
            if let Ok(mut conn) = Conn::open(self.admin_port) {
                if conn.get("/ready", &[]).status == 200 {
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("envoy was not ready within 60 s:\n{}", self.log_tail());
    }

    /// The last lines Envoy logged.
    pub fn log_tail(&self) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// A new keep-alive connection to the listener.
    pub fn connect(&self) -> Conn {
        Conn::open(self.port).unwrap()
    }

    /// Every counter and gauge in `/stats`, once the filter's workers have
    /// flushed what they counted: the filter hands its counts to Envoy on
    /// each worker's tick, at most 100 ms after counting, so this waits
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

    /// Every counter and gauge in `/stats` as Envoy has them now.
    pub fn stats_now(&self) -> HashMap<String, u64> {
        let body = Conn::open(self.admin_port).unwrap().get("/stats", &[]).body;
        String::from_utf8_lossy(&body)
            .lines()
            .filter_map(|line| {
                let (name, value) = line.split_once(": ")?;
                Some((name.to_string(), value.trim().parse().ok()?))
            })
            .collect()
    }

    /// One stat, 0 if absent.
    pub fn stat(&self, name: &str) -> u64 {
        self.stats().get(name).copied().unwrap_or(0)
    }

    /// One stat as Envoy has it now (for polling until it reads a value).
    pub fn stat_now(&self, name: &str) -> u64 {
        self.stats_now().get(name).copied().unwrap_or(0)
    }

    /// True while the process runs.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A response.
#[derive(Debug)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Headers, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// Body.
    pub body: Vec<u8>,
}

impl HttpResponse {
    /// The first value of header `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// One HTTP/1.1 keep-alive connection.
pub struct Conn {
    reader: BufReader<TcpStream>,
}

impl Conn {
    /// Connects to 127.0.0.1:`port`.
    pub fn open(port: u16) -> std::io::Result<Conn> {
        let stream = TcpStream::connect(("127.0.0.1", port))?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        stream.set_nodelay(true)?;
        Ok(Conn { reader: BufReader::new(stream) })
    }

    /// Sends `GET path` with `headers` (raw bytes) and reads the response.
    pub fn get(&mut self, path: &str, headers: &[(&str, &[u8])]) -> HttpResponse {
        self.request("GET", path, headers)
    }

    /// Sends a bodiless request and reads the response.
    pub fn request(&mut self, method: &str, path: &str, headers: &[(&str, &[u8])]) -> HttpResponse {
        self.try_request(method, path, headers).unwrap()
    }

    /// Sends a bodiless request without reading the answer (for a client
    /// that gives up).
    pub fn send_only(&mut self, method: &str, path: &str, headers: &[(&str, &[u8])]) -> std::io::Result<()> {
        let mut raw = format!("{method} {path} HTTP/1.1\r\nhost: localhost\r\n").into_bytes();
        for (name, value) in headers {
            raw.extend_from_slice(name.as_bytes());
            raw.extend_from_slice(b": ");
            raw.extend_from_slice(value);
            raw.extend_from_slice(b"\r\n");
        }
        raw.extend_from_slice(b"\r\n");
        self.reader.get_mut().write_all(&raw)
    }

    /// Like [`Conn::request`], but returns I/O errors.
    pub fn try_request(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &[u8])],
    ) -> std::io::Result<HttpResponse> {
        self.send_only(method, path, headers)?;
        self.read_response()
    }

    fn read_response(&mut self) -> std::io::Result<HttpResponse> {
        let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "connection closed"));
        }
        let status = line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| bad(&line))?;
        let mut headers = Vec::new();
        loop {
            line.clear();
            self.reader.read_line(&mut line)?;
            let trimmed = line.trim_end();
            if trimmed.is_empty() {
                break;
            }
            let (name, value) = trimmed.split_once(':').ok_or_else(|| bad(trimmed))?;
            headers.push((name.to_ascii_lowercase(), value.trim().to_string()));
        }
        let chunked = headers.iter().any(|(n, v)| n == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
        let body = if chunked {
            self.read_chunked()?
        } else {
            let length: usize =
                headers.iter().find(|(n, _)| n == "content-length").and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
            let mut body = vec![0; length];
            self.reader.read_exact(&mut body)?;
            body
        };
        Ok(HttpResponse { status, headers, body })
    }

    fn read_chunked(&mut self) -> std::io::Result<Vec<u8>> {
        let mut body = Vec::new();
        let mut line = String::new();
        loop {
            line.clear();
            self.reader.read_line(&mut line)?;
            let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, line.clone()))?;
            let start = body.len();
            body.resize(start + size, 0);
            self.reader.read_exact(&mut body[start..])?;
            line.clear();
            self.reader.read_line(&mut line)?; // CRLF after the chunk (or after the trailers)
            if size == 0 {
                return Ok(body);
            }
        }
    }
}

/// The quota service binary, as `cargo build` (and `cargo test --workspace`) leaves it.
pub fn quota_bin() -> PathBuf {
    let path = std::env::var("FLOODGATE_QUOTA_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|_| repo_root().join("target/debug/floodgate-quota"));
    assert!(path.exists(), "{} is missing: build it with `cargo build -p floodgate-quota`", path.display());
    path
}

/// A running `floodgate-quota` on a loopback port; killed on drop, and can be
/// stopped and started again on the same port.
pub struct QuotaServer {
    child: Option<Child>,
    /// Its HTTP port.
    pub port: u16,
    args: Vec<String>,
    log: PathBuf,
}

impl QuotaServer {
    /// Starts the service with the limits in `limits` (YAML) and `--store store`.
    pub fn start(limits: &str, store: &str) -> QuotaServer {
        Self::start_on(free_port(), limits, store)
    }

    /// Starts the service with these extra command-line arguments.
    pub fn start_with(limits: &str, store: &str, extra: &[&str]) -> QuotaServer {
        let mut service = Self::start(limits, store);
        service.kill();
        service.args.extend(extra.iter().map(|a| a.to_string()));
        service.restart();
        service
    }

    /// Starts the service on `port`.
    pub fn start_on(port: u16, limits: &str, store: &str) -> QuotaServer {
        let dir = scratch_dir();
        let file = dir.join("limits.yaml");
        fs::write(&file, limits).unwrap();
        let args = vec![
            "--config".to_string(),
            file.display().to_string(),
            "--listen".to_string(),
            format!("127.0.0.1:{port}"),
            "--store".to_string(),
            store.to_string(),
        ];
        let mut service = QuotaServer { child: None, port, args, log: dir.join("quota.log") };
        service.restart();
        service
    }

    /// Starts it again (after [`QuotaServer::kill`]) and waits until it answers.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "already running");
        let log = fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let child = Command::new(quota_bin()).args(&self.args).stdout(Stdio::null()).stderr(log).spawn().unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(mut conn) = Conn::open(self.port) {
                if conn.try_request("GET", "/healthz", &[]).is_ok_and(|r| r.status == 200) {
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("the quota service did not answer within 30 s:\n{}", fs::read_to_string(&self.log).unwrap_or_default());
    }

    /// Kills the process (SIGKILL): a crash, as the filter sees it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// A counter of its `/metrics` (summed over label sets whose labels
    /// contain every one of `labels`), 0 if absent.
    pub fn metric(&self, name: &str, labels: &[&str]) -> f64 {
        let body = Conn::open(self.port).unwrap().get("/metrics", &[]).body;
        String::from_utf8_lossy(&body)
            .lines()
            .filter(|line| line.starts_with(name) && labels.iter().all(|l| line.contains(l)))
            .filter_map(|line| line.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum()
    }
}

impl Drop for QuotaServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One request of a load: the label its answers are counted under, its
/// path, and its headers.
#[derive(Debug, Clone)]
pub struct Shot {
    /// What the answers are counted under.
    pub label: String,
    /// The request's path (and query).
    pub path: String,
    /// The request's headers.
    pub headers: Vec<(String, Vec<u8>)>,
}

/// Sends `per_client` requests from each of `clients` concurrent keep-alive
/// connections, started together; `shot(client, i)` says what each request
/// is. Returns, per label, how many answers had each status.
pub fn hammer_with(
    envoy: &Envoy,
    clients: usize,
    per_client: usize,
    shot: impl Fn(usize, usize) -> Shot + Send + Sync + 'static,
) -> HashMap<String, HashMap<u16, usize>> {
    let barrier = Arc::new(Barrier::new(clients));
    let shot = Arc::new(shot);
    let port = envoy.port;
    let handles: Vec<_> = (0..clients)
        .map(|client| {
            let (barrier, shot) = (Arc::clone(&barrier), Arc::clone(&shot));
            thread::spawn(move || {
                let mut conn = Conn::open(port).unwrap();
                barrier.wait();
                let mut seen: HashMap<String, HashMap<u16, usize>> = HashMap::new();
                for i in 0..per_client {
                    let Shot { label, path, headers } = shot(client, i);
                    let headers: Vec<(&str, &[u8])> = headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())).collect();
                    let status = conn.get(&path, &headers).status;
                    *seen.entry(label).or_default().entry(status).or_default() += 1;
                }
                seen
            })
        })
        .collect();
    let mut total: HashMap<String, HashMap<u16, usize>> = HashMap::new();
    for handle in handles {
        for (label, statuses) in handle.join().unwrap() {
            for (status, n) in statuses {
                *total.entry(label.clone()).or_default().entry(status).or_default() += n;
            }
        }
    }
    total
}

/// Sends `per_client` requests to `/api/items` from each of `clients`
/// concurrent keep-alive connections, started together; `key_of(client, i)`
/// picks the x-api-key. Returns the number of 200s per key (keys with none
/// left out), and asserts every answer is 200 or 429.
pub fn hammer(
    envoy: &Envoy,
    clients: usize,
    per_client: usize,
    key_of: fn(usize, usize) -> String,
) -> HashMap<String, usize> {
    let seen = hammer_with(envoy, clients, per_client, move |client, i| {
        let key = key_of(client, i);
        Shot { path: "/api/items".into(), headers: vec![("x-api-key".into(), key.clone().into_bytes())], label: key }
    });
    seen.into_iter()
        .filter_map(|(key, statuses)| {
            for status in statuses.keys() {
                assert!(matches!(status, 200 | 429), "unexpected status {status}");
            }
            statuses.get(&200).map(|&n| (key, n))
        })
        .collect()
}

/// Issues RS256 tokens for Envoy's `jwt_authn`, as an identity provider
/// would: a fresh 2048-bit RSA key made by the `openssl` command (no
/// network), its JWKS, and tokens it signs.
pub struct Issuer {
    key: PathBuf,
    modulus: Vec<u8>,
}

impl Issuer {
    /// The `iss` of every token.
    pub const ISS: &'static str = "https://issuer.test";

    /// A new issuer with a key of its own.
    pub fn generate() -> Issuer {
        let key = scratch_dir().join("key.pem");
        let made = Command::new("openssl")
            .args(["genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out"])
            .arg(&key)
            .output()
            .expect("the openssl command must be on PATH");
        assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
        let out = Command::new("openssl").args(["rsa", "-noout", "-modulus", "-in"]).arg(&key).output().unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        let hex = text.trim().strip_prefix("Modulus=").expect("openssl printed the modulus");
        let modulus = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
        Issuer { key, modulus }
    }

    /// The JWKS with this issuer's public key (one line of JSON).
    pub fn jwks(&self) -> String {
        serde_json::json!({"keys": [{"kty": "RSA", "alg": "RS256", "use": "sig", "kid": "test",
            "n": base64url(&self.modulus), "e": "AQAB"}]})
        .to_string()
    }

    /// A token with these claims, plus `iss` and an `exp` an hour ahead
    /// unless the claims set them.
    pub fn token(&self, claims: serde_json::Value) -> String {
        let mut claims = claims;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        let object = claims.as_object_mut().expect("claims are a JSON object");
        object.entry("iss").or_insert(Self::ISS.into());
        object.entry("exp").or_insert((now + 3600).into());
        let header = serde_json::json!({"alg": "RS256", "typ": "JWT", "kid": "test"});
        let input =
            format!("{}.{}", base64url(header.to_string().as_bytes()), base64url(claims.to_string().as_bytes()));
        let mut signer = Command::new("openssl")
            .args(["dgst", "-sha256", "-sign"])
            .arg(&self.key)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        signer.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
        let signed = signer.wait_with_output().unwrap();
        assert!(signed.status.success());
        format!("{input}.{}", base64url(&signed.stdout))
    }

    /// Envoy's `jwt_authn` filter trusting this issuer, requiring a valid
    /// token for paths under `prefix`, with the verified payload in dynamic
    /// metadata (`envoy.filters.http.jwt_authn`, key `jwt_payload`): a list
    /// item for [`Setup::filters_before`].
    pub fn jwt_authn_filter(&self, prefix: &str) -> String {
        format!(
            r#"          - name: envoy.filters.http.jwt_authn
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication
              providers:
                test:
                  issuer: {iss}
                  local_jwks: {{inline_string: '{jwks}'}}
                  payload_in_metadata: jwt_payload
              rules:
              - match: {{prefix: "{prefix}"}}
                requires: {{provider_name: test}}
"#,
            iss = Self::ISS,
            jwks = self.jwks(),
        )
    }
}

/// Base64url without padding (RFC 7515).
fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let word = chunk.iter().enumerate().fold(0u32, |w, (i, &b)| w | (u32::from(b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[((word >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

/// Asserts both of Envoy's workers accepted connections during the test.
pub fn assert_both_workers_served(envoy: &Envoy) {
    let stats = envoy.stats();
    for worker in ["worker_0", "worker_1"] {
        let name = format!("listener.127.0.0.1_{}.{worker}.downstream_cx_total", envoy.port);
        assert!(stats.get(&name).copied().unwrap_or(0) > 0, "{name} is 0: the load did not reach both workers");
    }
}

/// A `redis-server` of the test's own on a free loopback port; killed on drop.
pub struct RedisServer {
    child: Child,
    /// Its port.
    pub port: u16,
}

impl RedisServer {
    /// Starts one and waits until it answers.
    pub fn start() -> RedisServer {
        let port = free_port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be on PATH (make deps-redis)");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not listen within 10 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        RedisServer { child, port }
    }

    /// Its URL for `--store`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Freezes it (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws it (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill").arg(signal).arg(self.child.id().to_string()).status().unwrap();
        assert!(status.success());
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.resume();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::base64url;

    #[test]
    fn base64url_is_rfc_7515s() {
        assert_eq!(base64url(b""), "");
        assert_eq!(base64url(b"f"), "Zg");
        assert_eq!(base64url(b"fo"), "Zm8");
        assert_eq!(base64url(b"foo"), "Zm9v");
        assert_eq!(base64url(b"foob"), "Zm9vYg");
        assert_eq!(base64url(&[0xfb, 0xff, 0xbf]), "-_-_");
    }
}
