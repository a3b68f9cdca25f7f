//! Test harness shared by the integration suites: a real `redis-server` on a
//! free loopback port, or a real three-master Redis Cluster (started and
//! killed here), and the service's router served in-process on another free
//! loopback port.

#![allow(dead_code)] // each suite uses a different part of the harness

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate_core::time::{Clock, FakeClock, Nanos, SECOND};
use floodgate_quota::auth::Tokens;
use floodgate_quota::config::Domains;
use floodgate_quota::http::{router, AppState};
use floodgate_quota::metrics::ServiceMetrics;
use floodgate_quota::server::{serve, App, Limits};
use floodgate_quota::service::{Service, Settings};
use floodgate_quota::store::{LocalStore, QuotaStore, RedisOptions, RedisStore};
use serde_json::Value;

/// An instant on every period boundary a test uses (a multiple of one hour).
pub const T0: Nanos = Nanos::from_secs(1_700_002_800);

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

/// A Redis Cluster of our own: three masters, no replicas, on free loopback
/// ports (client and bus), each with its node file in a temporary
/// directory, so a stopped node started again rejoins as itself. Every node
/// is killed (by PID) when dropped.
pub struct RedisCluster {
    nodes: Vec<ClusterNode>,
    dir: tempfile::TempDir,
}

struct ClusterNode {
    port: u16,
    bus_port: u16,
    child: Option<Child>,
}

/// First slot, last slot, owner's port.
type SlotRange = (u16, u16, u16);

/// Redis Cluster marks an unreachable node failed after this long (ms).
pub const CLUSTER_NODE_TIMEOUT_MS: u64 = 2_000;

/// A bound for waits on the cluster's own convergence (not a speed target).
const CLUSTER_WAIT: Duration = Duration::from_secs(30);

impl RedisCluster {
    pub fn start() -> Self {
        // `redis-cli --cluster create` waits for the nodes to meet on their
        // bus ports for as long as it takes; a bus port another test took
        // meanwhile (`free_port` only finds one free for a moment) means
        // forever. Such a cluster is given up and another one made.
        for _attempt in 0..3 {
            let dir = tempfile::tempdir().expect("a cluster directory");
            let nodes = (0..3).map(|_| ClusterNode { port: free_port(), bus_port: free_port(), child: None }).collect();
            let mut cluster = RedisCluster { nodes, dir };
            for node in 0..3 {
                cluster.start_node(node);
            }
            if cluster.create() {
                cluster.wait_until_ok();
                return cluster;
            }
        }
        panic!("redis-cli --cluster create never completed (three clusters tried)");
    }

    /// Joins the nodes into a cluster; false when that did not complete
    /// within `CLUSTER_WAIT`.
    fn create(&self) -> bool {
        let addresses: Vec<String> = self.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let mut child = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-cli must be on PATH (apt-get install redis-tools)");
        let deadline = Instant::now() + CLUSTER_WAIT;
        loop {
            if let Some(status) = child.try_wait().expect("redis-cli") {
                assert!(status.success(), "redis-cli --cluster create failed: {status}");
                return true;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `redis+cluster://` with every node as a seed.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        format!("redis+cluster://{}", nodes.join(","))
    }

    pub fn port(&self, node: usize) -> u16 {
        self.nodes[node].port
    }

    /// (Re)starts node `node` on its ports and waits until it answers PING.
    /// A first start whose ports were taken meanwhile (`free_port` only
    /// finds a port free for a moment; parallel tests race for them) moves
    /// to new ports; a restart must keep its own.
    pub fn start_node(&mut self, node: usize) {
        let config = self.dir.path().join(format!("nodes-{node}.conf"));
        let first_start = !config.exists();
        assert!(self.nodes[node].child.is_none(), "node {node} already running");
        for _attempt in 0..5 {
            let n = &mut self.nodes[node];
            let child = Command::new("redis-server")
                .args(["--port", &n.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .args(["--cluster-enabled", "yes", "--cluster-port", &n.bus_port.to_string()])
                .arg("--cluster-config-file")
                .arg(&config)
                .args(["--cluster-node-timeout", &CLUSTER_NODE_TIMEOUT_MS.to_string()])
                .arg("--dir")
                .arg(self.dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server must be on PATH (apt-get install redis-server)");
            n.child = Some(child);
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if self.try_connection(node).and_then(|mut c| redis::cmd("PING").query::<String>(&mut c).ok()).is_some()
                {
                    return;
                }
                let n = &mut self.nodes[node];
                let exited = n.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
                if let Some(status) = exited {
                    n.child = None;
                    assert!(first_start, "redis-server on port {} exited on restart: {status}", n.port);
                    (n.port, n.bus_port) = (free_port(), free_port());
                    break;
                }
                assert!(Instant::now() < deadline, "redis-server did not come up on port {}", n.port);
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        panic!("redis-server for node {node} exited at start five times: are ports being taken?");
    }

    /// Kills node `node` (SIGKILL, as in a crash).
    pub fn stop_node(&mut self, node: usize) {
        if let Some(mut child) = self.nodes[node].child.take() {
            let _ = Command::new("kill").arg("-CONT").arg(child.id().to_string()).status();
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freezes node `node` (SIGSTOP) or thaws it (SIGCONT).
    pub fn freeze_node(&self, node: usize, frozen: bool) {
        let child = self.nodes[node].child.as_ref().expect("running");
        let signal = if frozen { "-STOP" } else { "-CONT" };
        assert!(Command::new("kill").arg(signal).arg(child.id().to_string()).status().expect("kill").success());
    }

    fn try_connection(&self, node: usize) -> Option<redis::Connection> {
        let url = format!("redis://127.0.0.1:{}/", self.nodes[node].port);
        redis::Client::open(url).ok()?.get_connection_with_timeout(Duration::from_secs(1)).ok()
    }

    /// A direct (non-cluster) connection to one node.
    pub fn connection(&self, node: usize) -> redis::Connection {
        self.try_connection(node).expect("connect to a cluster node")
    }

    /// Waits until every running node says the cluster is ok and agrees on
    /// who owns every slot.
    pub fn wait_until_ok(&self) {
        let deadline = Instant::now() + CLUSTER_WAIT;
        loop {
            let running: Vec<usize> = (0..self.nodes.len()).filter(|n| self.nodes[*n].child.is_some()).collect();
            let views: Vec<Option<(String, Vec<SlotRange>)>> = running
                .iter()
                .map(|n| {
                    let mut c = self.try_connection(*n)?;
                    let info: String = redis::cmd("CLUSTER").arg("INFO").query(&mut c).ok()?;
                    Some((info, self.slot_ranges_seen_by(&mut c)?))
                })
                .collect();
            let ok = views.iter().all(|v| v.as_ref().is_some_and(|(info, _)| info.contains("cluster_state:ok")));
            let agree = views.windows(2).all(|w| w[0].as_ref().map(|v| &v.1) == w[1].as_ref().map(|v| &v.1));
            if ok && agree {
                return;
            }
            assert!(Instant::now() < deadline, "the cluster did not converge: {views:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// (first slot, last slot, owner's port) for every range, from
    /// `CLUSTER NODES` as one node sees it.
    fn slot_ranges_seen_by(&self, conn: &mut redis::Connection) -> Option<Vec<SlotRange>> {
        let text: String = redis::cmd("CLUSTER").arg("NODES").query(conn).ok()?;
        let mut ranges = Vec::new();
        for line in text.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            if fields.len() < 8 || !fields[2].contains("master") {
                continue;
            }
            let port: u16 = fields[1].split(['@', ',']).next()?.rsplit(':').next()?.parse().ok()?;
            for range in &fields[8..] {
                // Migration markers ("[slot->-id]") are not ownership.
                if range.starts_with('[') {
                    continue;
                }
                let (first, last) = range.split_once('-').unwrap_or((range, range));
                ranges.push((first.parse().ok()?, last.parse().ok()?, port));
            }
        }
        ranges.sort_unstable();
        Some(ranges)
    }

    /// The slot of `key`.
    pub fn slot_of(&self, key: &str) -> u16 {
        redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query(&mut self.any_connection()).expect("CLUSTER KEYSLOT")
    }

    fn any_connection(&self) -> redis::Connection {
        (0..self.nodes.len())
            .filter(|n| self.nodes[*n].child.is_some())
            .find_map(|n| self.try_connection(n))
            .expect("a running cluster node")
    }

    /// The node (index) owning `slot`, as a running node sees it.
    pub fn owner_of_slot(&self, slot: u16) -> usize {
        let ranges = self.slot_ranges_seen_by(&mut self.any_connection()).expect("CLUSTER NODES");
        let (_, _, port) = ranges.iter().find(|(first, last, _)| (*first..=*last).contains(&slot)).expect("slot owned");
        self.nodes.iter().position(|n| n.port == *port).expect("owner is one of ours")
    }

    /// The node (index) owning `key`.
    pub fn owner_of(&self, key: &str) -> usize {
        self.owner_of_slot(self.slot_of(key))
    }

    /// How many times node `node` ran `command` (from `INFO commandstats`).
    pub fn calls(&self, node: usize, command: &str) -> u64 {
        let info: String = redis::cmd("INFO").arg("commandstats").query(&mut self.connection(node)).expect("INFO");
        let prefix = format!("cmdstat_{command}:calls=");
        info.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .map(|rest| rest.split(',').next().expect("calls").parse().expect("a count"))
            .unwrap_or(0)
    }

    /// How many errors of `kind` (e.g. `MOVED`) node `node` replied (from
    /// `INFO errorstats`).
    pub fn errors(&self, node: usize, kind: &str) -> u64 {
        let info: String = redis::cmd("INFO").arg("errorstats").query(&mut self.connection(node)).expect("INFO");
        let prefix = format!("errorstat_{kind}:count=");
        info.lines().find_map(|l| l.strip_prefix(&prefix)).map_or(0, |n| n.trim().parse().expect("a count"))
    }

    /// Moves `slot`, with its keys, to node `to`, the way `redis-cli
    /// --cluster reshard` does: importing/migrating, `MIGRATE` of every key,
    /// then `SETSLOT … NODE` on every node. Clients holding the old map get
    /// `MOVED` afterwards.
    pub fn move_slot(&self, slot: u16, to: usize) {
        let from = self.owner_of_slot(slot);
        assert_ne!(from, to, "slot {slot} is already on node {to}");
        let id = |node: usize| -> String {
            redis::cmd("CLUSTER").arg("MYID").query(&mut self.connection(node)).expect("CLUSTER MYID")
        };
        let (from_id, to_id) = (id(from), id(to));
        let mut source = self.connection(from);
        let mut target = self.connection(to);
        let _: () = redis::cmd("CLUSTER")
            .arg(&["SETSLOT", &slot.to_string(), "IMPORTING", &from_id])
            .query(&mut target)
            .expect("IMPORTING");
        let _: () = redis::cmd("CLUSTER")
            .arg(&["SETSLOT", &slot.to_string(), "MIGRATING", &to_id])
            .query(&mut source)
            .expect("MIGRATING");
        loop {
            let keys: Vec<String> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(100)
                .query(&mut source)
                .expect("GETKEYSINSLOT");
            if keys.is_empty() {
                break;
            }
            let _: () = redis::cmd("MIGRATE")
                .arg(&["127.0.0.1", &self.nodes[to].port.to_string(), "", "0", "5000", "KEYS"])
                .arg(&keys)
                .query(&mut source)
                .expect("MIGRATE");
        }
        // The new owner first, then the old one, then the rest.
        for node in [to, from, 3 - from - to] {
            let _: () = redis::cmd("CLUSTER")
                .arg(&["SETSLOT", &slot.to_string(), "NODE", &to_id])
                .query(&mut self.connection(node))
                .expect("SETSLOT NODE");
        }
        self.wait_until_ok();
        assert_eq!(self.owner_of_slot(slot), to);
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in 0..self.nodes.len() {
            self.stop_node(node);
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Memory,
    Redis,
    /// A three-master Redis Cluster of its own.
    RedisCluster,
}

/// A service served on loopback, with its clock and (for Redis) its server.
pub struct Fixture {
    pub base: String,
    pub clock: Arc<FakeClock>,
    pub service: Arc<Service>,
    pub redis: Option<RedisServer>,
    pub cluster: Option<RedisCluster>,
    pub client: reqwest::Client,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// One domain per YAML document (documents separated by `---` lines).
pub fn domains(yaml: &str) -> Domains {
    Domains::from_domains(yaml.split("\n---\n").map(|doc| Domains::parse_one("test", doc).expect("test config parses")))
}

pub struct Options {
    pub auth_token: Option<&'static str>,
    /// Domains' own tokens (`--domain-token`).
    pub domain_tokens: Vec<(&'static str, &'static str)>,
    pub lease_ttl: Nanos,
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
            domain_tokens: Vec::new(),
            lease_ttl: SECOND,
            // Ample for a loaded two-core CI machine: the functional tests
            // must not turn a slow moment into a 503. The outage tests,
            // which are about the timeout, set a short one of their own.
            store_timeout: Duration::from_secs(2),
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
        if backend == Backend::RedisCluster {
            let cluster = tokio::task::spawn_blocking(RedisCluster::start).await.expect("cluster started");
            let mut fixture = Self::serve(Some(cluster.url()), None, yaml, options).await;
            fixture.cluster = Some(cluster);
            return fixture;
        }
        let redis = (backend == Backend::Redis).then(RedisServer::start);
        let url = redis.as_ref().map(|r| r.url());
        Self::serve(url, redis, yaml, options).await
    }

    /// A service using the Redis at `url` (which may be down).
    pub async fn serve(url: Option<String>, redis: Option<RedisServer>, yaml: &str, options: Options) -> Fixture {
        let clock = Arc::new(FakeClock::new(T0));
        let shared: Arc<dyn Clock> = clock.clone();
        let store = match url {
            None => QuotaStore::new(Arc::new(LocalStore::new(shared, options.max_buckets))),
            Some(url) => {
                // A manual clock is years from Redis's: its offset is not looked at.
                let redis_options = RedisOptions {
                    timeout: options.store_timeout,
                    clock: if options.redis_time { None } else { Some(shared) },
                    clock_bound: None,
                };
                QuotaStore::new(Arc::new(RedisStore::new(&url, redis_options).expect("redis store")))
            }
        };
        let metrics = ServiceMetrics::new().expect("metrics");
        let service = Arc::new(Service::new(domains(yaml), store, metrics, Settings { lease_ttl: options.lease_ttl }));
        let domain_tokens = options.domain_tokens.iter().map(|(d, t)| (d.to_string(), Arc::from(*t))).collect();
        let tokens = Tokens::new(options.auth_token.map(Arc::from), domain_tokens);
        let state = AppState { service: service.clone(), tokens: Arc::new(tokens) };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let app = router(state);
        let server = tokio::spawn(serve(listener, App::Http(app), options.limits, std::future::pending()));
        let client = reqwest::Client::builder()
            // A safety net against a hang, not a speed assertion.
            .timeout(Duration::from_secs(10))
            .no_proxy()
            .build()
            .expect("client");
        Fixture { base, clock, service, redis, cluster: None, client, server }
    }

    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        Self::post_with(&self.client, &self.base, path, body).await
    }

    /// A client whose connections come from `address` (a loopback address
    /// other than 127.0.0.1: another peer, another caller).
    pub fn client_from(address: &str) -> reqwest::Client {
        reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .no_proxy()
            .local_address(Some(address.parse().expect("an address")))
            .build()
            .expect("client")
    }

    /// POST through `client` (see [`Fixture::client_from`]).
    pub async fn post_from(&self, client: &reqwest::Client, path: &str, body: &Value) -> (u16, Value) {
        Self::post_with(client, &self.base, path, body).await
    }

    async fn post_with(client: &reqwest::Client, base: &str, path: &str, body: &Value) -> (u16, Value) {
        let response = client.post(format!("{base}{path}")).json(body).send().await.expect("request");
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

/// The bytes of a message, sent as they are: what a broken or hostile
/// client sends.
#[derive(Clone, Copy)]
pub struct RawCodec;

pub struct RawBytes;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = ();
    type Encoder = RawBytes;
    type Decoder = RawBytes;

    fn encoder(&mut self) -> RawBytes {
        RawBytes
    }

    fn decoder(&mut self) -> RawBytes {
        RawBytes
    }
}

impl tonic::codec::Encoder for RawBytes {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn encode(&mut self, item: Vec<u8>, dst: &mut tonic::codec::EncodeBuf<'_>) -> Result<(), tonic::Status> {
        tonic_prost::prost::bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawBytes {
    type Item = ();
    type Error = tonic::Status;

    fn decode(&mut self, src: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<()>, tonic::Status> {
        let rest = tonic_prost::prost::bytes::Buf::remaining(src);
        tonic_prost::prost::bytes::Buf::advance(src, rest);
        Ok(Some(()))
    }
}
