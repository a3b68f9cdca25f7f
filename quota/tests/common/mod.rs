//! Test harness shared by the integration suites: a real `redis-server` on a
//! free loopback port (started and killed here), and the service's router
//! served in-process on another free loopback port.

#![allow(dead_code)] // each suite uses a different part of the harness

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate_quota::clock::{Clock, ManualClock, SECOND_US};
use floodgate_quota::config::Config;
use floodgate_quota::http::{router, AppState};
use floodgate_quota::metrics::Metrics;
use floodgate_quota::server::{serve, Limits};
use floodgate_quota::service::{Service, Settings};
use floodgate_quota::store::{MemoryStore, RedisOptions, RedisStore, Store};
use serde_json::Value;

/// An instant on every period boundary a test uses (a multiple of one hour).
pub const T0: u64 = 1_700_002_800 * SECOND_US;

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local address").port()
}

/// A `redis-server` of our own on 127.0.0.1; killed when dropped.
pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
    /// With persistence: the data directory, kept across restarts.
    data: Option<tempfile::TempDir>,
}

impl RedisServer {
    pub fn start() -> Self {
        let mut server = RedisServer { port: free_port(), child: None, data: None };
        server.restart();
        server
    }

    /// A server run with the shipped `quota/redis.conf` (append-only file)
    /// in a data directory of its own, which restarts reuse.
    pub fn start_persistent() -> Self {
        let data = tempfile::tempdir().expect("a data directory");
        let mut server = RedisServer { port: free_port(), child: None, data: Some(data) };
        server.restart();
        server
    }

    /// A server not yet started, to be started later on `port`.
    pub fn stopped_on(port: u16) -> Self {
        RedisServer { port, child: None, data: None }
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let child = self.child.as_ref().expect("running");
        let status = Command::new("kill").arg(signal).arg(child.id().to_string()).status().expect("kill");
        assert!(status.success());
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Starts (again) on the same port and waits until it answers PING.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "already running");
        let mut command = Command::new("redis-server");
        match &self.data {
            Some(dir) => {
                let config = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("redis.conf");
                command.arg(config).arg("--dir").arg(dir.path()).args(["--save", ""]);
            }
            None => {
                command.args(["--save", "", "--appendonly", "no"]);
            }
        }
        let child = command
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be on PATH (apt-get install redis-server)");
        self.child = Some(child);
        let client = redis::Client::open(self.url()).expect("redis url");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut conn) = client.get_connection() {
                if redis::cmd("PING").query::<String>(&mut conn).is_ok() {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "redis-server did not come up on port {}", self.port);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the server (SIGKILL: an abrupt loss, as in a crash).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // A paused server must be thawed to die promptly.
            let _ = Command::new("kill").arg("-CONT").arg(child.id().to_string()).status();
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// A direct connection, to look at keys.
    pub fn connection(&self) -> redis::Connection {
        redis::Client::open(self.url()).expect("redis url").get_connection().expect("connect to test redis")
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Memory,
    Redis,
}

/// A service served on loopback, with its clock and (for Redis) its server.
pub struct Fixture {
    pub base: String,
    pub clock: Arc<ManualClock>,
    pub service: Arc<Service>,
    pub redis: Option<RedisServer>,
    pub client: reqwest::Client,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.server.abort();
    }
}

pub fn config(yaml: &str) -> Config {
    Config::from_domains([Config::parse_one("test", yaml).expect("test config parses")])
}

pub struct Options {
    pub auth_token: Option<&'static str>,
    pub lease_ttl: u64,
    pub store_timeout: Duration,
    /// Use Redis's own clock instead of the manual one.
    pub redis_time: bool,
    pub max_buckets: usize,
    /// The server loop's timeouts and connection cap.
    pub limits: Limits,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            auth_token: None,
            lease_ttl: SECOND_US,
            store_timeout: Duration::from_millis(500),
            redis_time: false,
            max_buckets: 100_000,
            limits: Limits::default(),
        }
    }
}

impl Fixture {
    pub async fn new(backend: Backend, yaml: &str) -> Fixture {
        Self::with(backend, yaml, Options::default()).await
    }

    pub async fn with(backend: Backend, yaml: &str, options: Options) -> Fixture {
        let redis = (backend == Backend::Redis).then(RedisServer::start);
        let url = redis.as_ref().map(|r| r.url());
        Self::serve(url, redis, yaml, options).await
    }

    /// A service using the Redis at `url` (which may be down).
    pub async fn serve(url: Option<String>, redis: Option<RedisServer>, yaml: &str, options: Options) -> Fixture {
        let clock = Arc::new(ManualClock::new(T0));
        let shared: Arc<dyn Clock> = clock.clone();
        let store = match url {
            None => Store::Memory(MemoryStore::new(shared, options.max_buckets)),
            Some(url) => {
                let redis_options = RedisOptions {
                    timeout: options.store_timeout,
                    clock: if options.redis_time { None } else { Some(shared) },
                };
                Store::Redis(Box::new(RedisStore::new(&url, redis_options).expect("redis store")))
            }
        };
        let metrics = Metrics::new().expect("metrics");
        let service = Arc::new(Service::new(config(yaml), store, metrics, Settings { lease_ttl: options.lease_ttl }));
        let state = AppState { service: service.clone(), auth_token: options.auth_token.map(Arc::from) };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let app = router(state);
        let server = tokio::spawn(serve(listener, app, options.limits, std::future::pending()));
        let client = reqwest::Client::builder()
            // A safety net against a hang, not a speed assertion.
            .timeout(Duration::from_secs(10))
            .no_proxy()
            .build()
            .expect("client");
        Fixture { base, clock, service, redis, client, server }
    }

    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let response = self.client.post(format!("{}{path}", self.base)).json(body).send().await.expect("request");
        let status = response.status().as_u16();
        let text = response.text().await.expect("body");
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    /// POST /v1/check, expecting 200.
    pub async fn check(&self, body: Value) -> Value {
        let (status, value) = self.post("/v1/check", &body).await;
        assert_eq!(status, 200, "{value}");
        value
    }

    /// POST /v1/lease, expecting 200.
    pub async fn lease(&self, body: Value) -> Value {
        let (status, value) = self.post("/v1/lease", &body).await;
        assert_eq!(status, 200, "{value}");
        value
    }

    /// POST /v1/return, expecting 200.
    pub async fn give_back(&self, body: Value) -> Value {
        let (status, value) = self.post("/v1/return", &body).await;
        assert_eq!(status, 200, "{value}");
        value
    }

    pub async fn metrics(&self) -> String {
        self.client.get(format!("{}/metrics", self.base)).send().await.expect("metrics").text().await.expect("text")
    }
}
