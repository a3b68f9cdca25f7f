//! Redis for the tests: a `redis-server` of a test's own on a free loopback
//! port, or a three-master Redis Cluster (started and killed here, by PID),
//! to be paused, killed and started again as the outage tests need.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::ports::free_port;
use crate::process::Process;

/// A `redis-server` of a test's own on 127.0.0.1, without persistence
/// unless started with a configuration file; killed when dropped.
pub struct RedisServer {
    /// Its port.
    pub port: u16,
    process: Option<Process>,
    /// With persistence: the configuration file, and the data directory
    /// restarts reuse.
    persistence: Option<(PathBuf, tempfile::TempDir)>,
}

impl RedisServer {
    /// Starts one on a free port and waits until it answers PING.
    pub fn start() -> Self {
        let mut server = RedisServer { port: free_port(), process: None, persistence: None };
        server.restart();
        server
    }

    /// A server run with the configuration file `config` (e.g. the quota
    /// service's `redis.conf`, with its append-only file) in a data
    /// directory of its own, which restarts reuse.
    pub fn start_persistent(config: &Path) -> Self {
        let data = tempfile::tempdir().expect("a data directory");
        let mut server =
            RedisServer { port: free_port(), process: None, persistence: Some((config.to_path_buf(), data)) };
        server.restart();
        server
    }

    /// A server not yet started, to be started later on `port`.
    pub fn stopped_on(port: u16) -> Self {
        RedisServer { port, process: None, persistence: None }
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        assert!(self.running().signal("-STOP"), "cannot freeze redis-server");
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) {
        assert!(self.running().signal("-CONT"), "cannot thaw redis-server");
    }

    fn running(&self) -> &Process {
        self.process.as_ref().expect("redis-server is running")
    }

    /// Its URL, for the quota service's `--store`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Starts (again) on the same port and waits until it answers PING.
    pub fn restart(&mut self) {
        assert!(self.process.is_none(), "already running");
        let mut command = Command::new("redis-server");
        match &self.persistence {
            Some((config, dir)) => {
                command.arg(config).arg("--dir").arg(dir.path()).args(["--save", ""]);
            }
            None => {
                command.args(["--save", "", "--appendonly", "no"]);
            }
        }
        command
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let process = Process::spawn(&mut command).expect("redis-server must be on PATH (make deps-redis)");
        self.process = Some(process);
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
        if let Some(process) = self.process.take() {
            // A paused server must be thawed to die promptly.
            let _ = process.signal("-CONT");
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
    process: Option<Process>,
}

/// First slot, last slot, owner's port.
type SlotRange = (u16, u16, u16);

/// Redis Cluster marks an unreachable node failed after this long (ms).
pub const CLUSTER_NODE_TIMEOUT_MS: u64 = 2_000;

/// A bound for waits on the cluster's own convergence (not a speed target).
const CLUSTER_WAIT: Duration = Duration::from_secs(30);

impl RedisCluster {
    /// Starts three masters, joins them into a cluster and waits until it
    /// is ok.
    pub fn start() -> Self {
        // `redis-cli --cluster create` waits for the nodes to meet on their
        // bus ports for as long as it takes; a bus port another test took
        // meanwhile (`free_port` only finds one free for a moment) means
        // forever. Such a cluster is given up and another one made.
        for _attempt in 0..3 {
            let dir = tempfile::tempdir().expect("a cluster directory");
            let nodes =
                (0..3).map(|_| ClusterNode { port: free_port(), bus_port: free_port(), process: None }).collect();
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

    /// Node `node`'s client port.
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
        assert!(self.nodes[node].process.is_none(), "node {node} already running");
        for _attempt in 0..5 {
            let n = &mut self.nodes[node];
            let mut command = Command::new("redis-server");
            command
                .args(["--port", &n.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .args(["--cluster-enabled", "yes", "--cluster-port", &n.bus_port.to_string()])
                .arg("--cluster-config-file")
                .arg(&config)
                .args(["--cluster-node-timeout", &CLUSTER_NODE_TIMEOUT_MS.to_string()])
                .arg("--dir")
                .arg(self.dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            n.process = Some(Process::spawn(&mut command).expect("redis-server must be on PATH (make deps-redis)"));
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if self.try_connection(node).and_then(|mut c| redis::cmd("PING").query::<String>(&mut c).ok()).is_some()
                {
                    return;
                }
                let n = &mut self.nodes[node];
                let exited = n.process.as_mut().and_then(Process::exited);
                if let Some(status) = exited {
                    n.process = None;
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
        if let Some(process) = self.nodes[node].process.take() {
            // A frozen node must be thawed to die promptly.
            let _ = process.signal("-CONT");
        }
    }

    /// Freezes node `node` (SIGSTOP) or thaws it (SIGCONT).
    pub fn freeze_node(&self, node: usize, frozen: bool) {
        let process = self.nodes[node].process.as_ref().expect("running");
        assert!(process.signal(if frozen { "-STOP" } else { "-CONT" }), "cannot freeze or thaw node {node}");
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
            let running: Vec<usize> = (0..self.nodes.len()).filter(|n| self.nodes[*n].process.is_some()).collect();
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
            .filter(|n| self.nodes[*n].process.is_some())
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
