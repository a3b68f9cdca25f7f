//! The Redis store: Redis keeps versioned bytes, the service decides. In the
//! common case a transaction is **one round trip**: the instance keeps the
//! last value and version it read or wrote for each key (and an estimate of
//! Redis's clock), decides on them in Rust (the same code as the memory
//! store), and sends one small script (`cas.lua`) that writes the keys only
//! if none of their versions changed and the decision's time is Redis's. A
//! key this instance does not know is taken to be absent. When a version
//! changed (another instance wrote, a key expired, a guess was wrong) or the
//! time was off, the script writes nothing and answers with the keys'
//! current values, versions and Redis's time: the instance decides again on
//! those and sends again. So a decision costs two round trips only when it
//! meets another instance's write (or a key it has not seen), never more
//! unless it keeps losing races (then it backs off, within the store
//! timeout). Keys share the domain's hash tag, so a transaction's keys sit in
//! one Redis Cluster slot.
//!
//! Failure handling: every transaction is bounded by a timeout; the
//! connection is made lazily, and a connection Redis dropped (a restart, a
//! crash) is made anew at once; while it cannot be, calls fail at once as
//! `unavailable` (the connect was refused) instead of waiting out the
//! timeout, and a new connect is tried a timeout later.
//!
//! Redis Cluster (`redis+cluster://host:port,host:port…`) runs the same
//! transactions through redis-rs's cluster client: the script is routed by
//! its keys, so it runs (`TIME` included) on the master owning the domain's
//! slot, and `MOVED`/`ASK` redirections and topology changes are followed by
//! the client.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as SyncMutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{AsyncConnectionConfig, Cmd, Pipeline, RedisFuture, Script, Value};
use tokio::sync::Mutex;

use floodgate_core::time::{Clock, Nanos};

use super::decide::UNTAGGED;
use super::lanes::{Batch, Job, Lanes};
use super::{Kind, StoreFailure, Writes};

/// Most reads and writes one transaction makes before giving up on a key
/// that keeps changing (each lost race means another writer won).
const ATTEMPTS: usize = 64;

/// How far (µs) a decision's time may be from Redis's `TIME` when the
/// instance decides on its estimate of Redis's clock: far more than a
/// round trip, far less than any window.
const CLOCK_TOLERANCE_US: u64 = 100_000;

/// Shards of the cache of known keys, and the most keys each keeps.
const CACHE_SHARDS: usize = 64;
const CACHE_PER_SHARD: usize = 1_024;

/// After this many lost races in a row a decision claims its turn: for
/// `TURN_US` the keys take no other instance's write, so an instance whose
/// rival writes back to back is not starved.
const CLAIM_AFTER: usize = 2;
const TURN_US: u64 = 50_000;

/// A version no key ever has: sent to read keys without deciding.
const NO_VERSION: &[u8] = b"?";

/// Extra time to live on every key: a key outlives its idle instant a little,
/// so instances with slightly different clocks never lose live state.
const TTL_SLACK_MS: u64 = 1_000;

/// How the Redis store is set up.
#[derive(Debug, Clone)]
pub struct RedisOptions {
    /// Longest wait for any one Redis call, connecting included.
    pub timeout: Duration,
    /// `None`: decisions use Redis's clock (`TIME`), so that every instance
    /// agrees. `Some`: the service's clock is passed in instead.
    pub clock: Option<Arc<dyn Clock>>,
}

/// The scheme of a Redis Cluster address: `redis+cluster://` followed by
/// one or more seed nodes, `host:port` separated by commas.
pub const CLUSTER_SCHEME: &str = "redis+cluster://";

/// Where the counters are: one Redis, or a Redis Cluster known by its seeds.
enum Client {
    Single(redis::Client),
    Cluster(ClusterClient),
}

/// A live connection of either kind; both multiplex, so clones share it.
#[derive(Clone)]
enum Connection {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl redis::aio::ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Single(c) => c.req_packed_command(cmd),
            Connection::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Connection::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(c) => c.get_db(),
            Connection::Cluster(c) => c.get_db(),
        }
    }
}

/// The seed nodes of a `redis+cluster://[user:password@]host:port,host:port…`
/// address, as `redis://` URLs (credentials apply to every node).
fn cluster_seeds(url: &str) -> Result<Vec<String>, String> {
    let rest =
        url.strip_prefix(CLUSTER_SCHEME).ok_or_else(|| format!("{url:?} does not start with {CLUSTER_SCHEME}"))?;
    let (credentials, nodes) = match rest.rsplit_once('@') {
        Some((credentials, nodes)) => (format!("{credentials}@"), nodes),
        None => (String::new(), rest),
    };
    let nodes = nodes.strip_suffix('/').unwrap_or(nodes);
    if nodes.contains('/') {
        return Err(format!(
            "invalid Redis Cluster address {url:?}: a cluster has only database 0, so no /db may follow the nodes"
        ));
    }
    nodes
        .split(',')
        .map(|node| {
            if node.is_empty() || node.contains(['?', '#']) {
                Err(format!("invalid Redis Cluster address {url:?}: expected host:port[,host:port…], found {node:?}"))
            } else {
                Ok(format!("redis://{credentials}{node}"))
            }
        })
        .collect()
}

/// The part of `key` Redis Cluster hashes: what is between the first `{`
/// and the next `}`, if not empty; otherwise the whole key.
fn hash_tag(key: &str) -> &str {
    key.split_once('{')
        .and_then(|(_, rest)| rest.split_once('}'))
        .map(|(tag, _)| tag)
        .filter(|tag| !tag.is_empty())
        .unwrap_or(key)
}

/// Every key of one transaction must be in one cluster slot (the read and
/// the script are atomic only there): by construction they share the
/// domain's hash tag, but a domain starting with `}` leaves its keys with an
/// empty tag, so each would be hashed whole. Refused by name rather than
/// with Redis's bare `CROSSSLOT`.
fn same_slot(keys: &[String]) -> Result<(), StoreFailure> {
    let Some((first, rest)) = keys.split_first() else { return Ok(()) };
    let tag = hash_tag(first);
    match rest.iter().find(|k| hash_tag(k) != tag) {
        None => Ok(()),
        Some(other) => Err(StoreFailure::Unavailable(format!(
            "keys {first:?} and {other:?} have different Redis Cluster hash tags, so they may sit in different \
             slots and cannot be read and written atomically; a domain must not start with '}}'"
        ))),
    }
}

/// What this instance knows of a key: its value (with its tag byte) and
/// version, as last read or written; both `None` for an absent key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Known {
    value: Option<Vec<u8>>,
    version: Option<Vec<u8>>,
}

/// The last known value and version of recently used keys, bounded: a shard
/// that fills up is emptied (its keys cost one more round trip next time).
struct KnownKeys {
    shards: Vec<SyncMutex<HashMap<String, Known>>>,
    hasher: RandomState,
}

impl KnownKeys {
    fn new() -> Self {
        KnownKeys {
            shards: (0..CACHE_SHARDS).map(|_| SyncMutex::new(HashMap::new())).collect(),
            hasher: RandomState::new(),
        }
    }

    fn shard(&self, key: &str) -> MutexGuard<'_, HashMap<String, Known>> {
        // The modulo keeps the index below CACHE_SHARDS whatever the hash.
        let at = (self.hasher.hash_one(key) % CACHE_SHARDS as u64) as usize;
        lock(&self.shards[at])
    }

    /// What is known of `key`; an unknown key is taken to be absent.
    fn get(&self, key: &str) -> Known {
        self.shard(key).get(key).cloned().unwrap_or_default()
    }

    fn set(&self, key: &str, known: Known) {
        let mut shard = self.shard(key);
        if let Some(held) = shard.get_mut(key) {
            *held = known;
            return;
        }
        if shard.len() >= CACHE_PER_SHARD {
            shard.clear();
        }
        shard.insert(key.to_string(), known);
    }
}

fn lock<T>(mutex: &SyncMutex<T>) -> MutexGuard<'_, T> {
    // Each value is replaced whole: a poisoned lock still holds a consistent one.
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Redis's clock as last seen, per hash tag (a cluster's masters each have
/// their own): Redis's time then, and this process's monotonic instant then.
#[derive(Default)]
struct Clocks {
    by_tag: SyncMutex<HashMap<String, (Nanos, Instant)>>,
}

impl Clocks {
    /// Redis's time now, as last seen plus the time passed here since.
    fn estimate(&self, tag: &str) -> Option<Nanos> {
        let (time, at) = *lock(&self.by_tag).get(tag)?;
        Some(time + Nanos(u64::try_from(at.elapsed().as_nanos()).unwrap_or(u64::MAX)))
    }

    fn seen(&self, tag: &str, time: Nanos, at: Instant) {
        let mut by_tag = lock(&self.by_tag);
        match by_tag.get_mut(tag) {
            Some(seen) => *seen = (time, at),
            None => {
                by_tag.insert(tag.to_string(), (time, at));
            }
        }
    }
}

/// What the script answered.
enum Reply {
    /// Written (or, without writes, confirmed unchanged), at Redis's time.
    Written(Nanos),
    /// Nothing written: the keys as they are, at Redis's time.
    Changed(Nanos, Vec<Known>),
}

/// Counters in Redis.
pub struct RedisStore {
    client: Client,
    options: RedisOptions,
    /// The live connection (cloned per call: it multiplexes).
    connection: RwLock<Option<Connection>>,
    /// Held while connecting, so that one caller connects and the others wait.
    connecting: Mutex<()>,
    /// When and how the last connection attempt failed: attempts are spaced
    /// so that a dead Redis costs callers a refused connect, not a pile of
    /// them, and the callers in between get the same error.
    last_failure: SyncMutex<Option<(Instant, StoreFailure)>>,
    cas: Script,
    /// Versions are `seed-counter`: unique to this process and write, so a
    /// key deleted and written again never matches a stale read.
    seed: u64,
    writes: AtomicU64,
    known: KnownKeys,
    clocks: Clocks,
    lanes: Lanes,
    /// Store transactions run (batches of coalesced calls), ever.
    transactions: AtomicU64,
    /// Scripts sent for them, ever.
    round_trips: AtomicU64,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore").field("options", &self.options).finish_non_exhaustive()
    }
}

/// One kind per failure, whichever timer fired first: redis-rs's own
/// response and connection timeouts are the same `--store-timeout` as ours,
/// so a frozen Redis is always a `timeout`.
fn unavailable(e: redis::RedisError) -> StoreFailure {
    if e.is_timeout() {
        StoreFailure::Timeout
    } else {
        StoreFailure::Unavailable(e.to_string())
    }
}

/// An error after which the connection is no good (Redis closed or reset
/// it, or went away).
fn broken(e: &redis::RedisError) -> bool {
    !e.is_timeout() && (e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal())
}

fn bad_reply(what: &str) -> StoreFailure {
    StoreFailure::Unavailable(format!("unexpected reply to {what}"))
}

/// `TIME`'s seconds and microseconds as nanoseconds since the epoch.
fn redis_time(seconds: &Value, micros: &Value) -> Result<Nanos, StoreFailure> {
    let seconds: u64 = redis::from_redis_value(seconds).map_err(unavailable)?;
    let micros: u64 = redis::from_redis_value(micros).map_err(unavailable)?;
    Ok(Nanos::from_secs(seconds) + Nanos::from_micros(micros))
}

impl RedisStore {
    /// A store for the Redis at `url` (`redis://host:port/db`), or for the
    /// Redis Cluster whose seed nodes `url` lists
    /// (`redis+cluster://host:port,host:port…`). Connects on first use, so a
    /// service may start before its Redis.
    pub fn new(url: &str, options: RedisOptions) -> Result<Self, String> {
        let client = if url.starts_with(CLUSTER_SCHEME) {
            let client = ClusterClient::builder(cluster_seeds(url)?)
                .connection_timeout(options.timeout)
                .response_timeout(options.timeout)
                // The client's own retries (after a redirection, a reconnect,
                // `TRYAGAIN` during a slot migration) must fit well within one
                // store timeout, so that a master that refuses connections is
                // reported as such and not as a timeout; ours bounds the total.
                .retries(3)
                .min_retry_wait(5)
                .max_retry_wait(50)
                .build()
                .map_err(|e| format!("invalid Redis Cluster address {url:?}: {e}"))?;
            Client::Cluster(client)
        } else {
            Client::Single(redis::Client::open(url).map_err(|e| format!("invalid Redis URL {url:?}: {e}"))?)
        };
        Ok(Self {
            client,
            options,
            connection: RwLock::new(None),
            connecting: Mutex::new(()),
            last_failure: SyncMutex::new(None),
            cas: Script::new(include_str!("cas.lua")),
            seed: RandomState::new().hash_one(Instant::now()),
            writes: AtomicU64::new(0),
            known: KnownKeys::new(),
            clocks: Clocks::default(),
            lanes: Lanes::default(),
            transactions: AtomicU64::new(0),
            round_trips: AtomicU64::new(0),
        })
    }

    /// Store transactions run so far (a batch of coalesced calls is one),
    /// and the round trips to Redis they took: what the one-round-trip
    /// design is measured by.
    pub fn round_trips(&self) -> (u64, u64) {
        (self.transactions.load(Ordering::Relaxed), self.round_trips.load(Ordering::Relaxed))
    }

    fn current(&self) -> Option<Connection> {
        self.connection.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    async fn connection(&self) -> Result<Connection, StoreFailure> {
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let _connecting = self.connecting.lock().await;
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        if let Some((at, error)) = lock(&self.last_failure).as_ref() {
            if at.elapsed() < self.options.timeout {
                return Err(error.clone());
            }
        }
        self.connect().await
    }

    /// Makes a new connection (the caller holds `connecting`, or found the
    /// old one broken).
    async fn connect(&self) -> Result<Connection, StoreFailure> {
        let connect = async {
            match &self.client {
                Client::Single(client) => {
                    let config = AsyncConnectionConfig::new()
                        .set_connection_timeout(self.options.timeout)
                        .set_response_timeout(self.options.timeout);
                    client.get_multiplexed_async_connection_with_config(&config).await.map(Connection::Single)
                }
                Client::Cluster(client) => client.get_async_connection().await.map(Connection::Cluster),
            }
        };
        match tokio::time::timeout(self.options.timeout, connect).await {
            Ok(Ok(conn)) => {
                *self.connection.write().unwrap_or_else(|p| p.into_inner()) = Some(conn.clone());
                *lock(&self.last_failure) = None;
                Ok(conn)
            }
            Ok(Err(e)) => Err(self.failed(match unavailable(e) {
                StoreFailure::Unavailable(why) => StoreFailure::Unavailable(format!("cannot connect to Redis: {why}")),
                other => other,
            })),
            Err(_) => Err(self.failed(StoreFailure::Timeout)),
        }
    }

    /// Forgets the connection after `error` and remembers it: calls in the
    /// next timeout get it at once, then a new connection is tried.
    fn failed(&self, error: StoreFailure) -> StoreFailure {
        *self.connection.write().unwrap_or_else(|p| p.into_inner()) = None;
        *lock(&self.last_failure) = Some((Instant::now(), error.clone()));
        error
    }

    /// Runs `job` with whatever queues behind it on its lane: a task of its
    /// own drains the lane (a caller that leaves cannot strand the others).
    pub(super) fn run(self: &Arc<Self>, job: Job) {
        let Some((lane, jobs)) = self.lanes.enter(job) else { return };
        let store = Arc::clone(self);
        tokio::spawn(async move {
            let mut jobs = jobs;
            loop {
                let mut batch = Batch::new(jobs);
                if !batch.is_empty() {
                    let keys = batch.keys.clone();
                    let deadline = batch.deadline.unwrap_or_else(|| store.deadline());
                    let outcome = store.transact(&keys, deadline, |values, now| batch.decide(values, now)).await;
                    batch.finish(&outcome);
                }
                match store.lanes.next(lane) {
                    Some(next) => jobs = next,
                    None => return,
                }
            }
        });
    }

    /// When a call made now must have its answer (`--store-timeout`).
    pub(super) fn deadline(&self) -> tokio::time::Instant {
        tokio::time::Instant::now() + self.options.timeout
    }

    /// Decides on what is known of `keys` and writes if nothing changed;
    /// decides again on what the script answers when something did; gives
    /// up at `deadline`.
    async fn transact(
        &self,
        keys: &[String],
        deadline: tokio::time::Instant,
        mut decide: impl FnMut(&[Option<Vec<u8>>], Nanos) -> Writes,
    ) -> Result<(), StoreFailure> {
        let cluster = matches!(self.client, Client::Cluster(_));
        if cluster {
            same_slot(keys)?;
        }
        let tag = keys.first().map_or("", |k| hash_tag(k)).to_string();
        self.transactions.fetch_add(1, Ordering::Relaxed);
        let attempts = async {
            let mut conn = self.connection().await?;
            let mut known: Vec<Known> = keys.iter().map(|k| self.known.get(k)).collect();
            // Redis's clock (estimated, checked by the script) or ours.
            let mut now = match &self.options.clock {
                Some(clock) => Some(clock.now()),
                None => self.clocks.estimate(&tag),
            };
            let mut resent = false;
            let mut attempt = 0;
            while attempt < ATTEMPTS {
                // Without a time yet, the first round trip only reads.
                let writes = now.map(|now| decide(&values_of(&known), now));
                // Only a decision that writes claims the keys' turn.
                let writing = writes.as_ref().is_some_and(|w| w.iter().any(Option::is_some));
                let claim = writing && attempt >= CLAIM_AFTER;
                let invocation = self.invocation(&known, writes.as_ref(), now, claim);
                self.round_trips.fetch_add(1, Ordering::Relaxed);
                let mut sent = self.send(&mut conn, keys, &invocation).await;
                if matches!(&sent, Err(e) if broken(e)) && !cluster && !resent {
                    // Redis dropped the connection (a restart): the same
                    // script once more, on a new connection. If the first
                    // got through, the answer shows its very writes (see
                    // `applied`), and they are not made twice.
                    resent = true;
                    conn = self.connect().await?;
                    self.round_trips.fetch_add(1, Ordering::Relaxed);
                    sent = self.send(&mut conn, keys, &invocation).await;
                }
                let reply = match sent {
                    Err(e) if broken(&e) && !cluster => return Err(self.failed(unavailable(e))),
                    Err(e) => return Err(unavailable(e)),
                    Ok(reply) => parse(reply, keys.len())?,
                };
                match reply {
                    // A read is never written (no key has the version it sends).
                    Reply::Written(_) if writes.is_none() => return Err(bad_reply("cas.lua")),
                    Reply::Written(time) => {
                        self.clock_seen(&tag, time);
                        self.remember(keys, writes.as_ref(), &invocation.versions);
                        return Ok(());
                    }
                    Reply::Changed(time, current) => {
                        self.clock_seen(&tag, time);
                        if applied(&current, &invocation.versions) {
                            self.remember(keys, writes.as_ref(), &invocation.versions);
                            return Ok(());
                        }
                        for (key, known) in keys.iter().zip(&current) {
                            self.known.set(key, known.clone());
                        }
                        known = current;
                        now = Some(self.options.clock.as_ref().map_or(time, |clock| clock.now()));
                    }
                }
                if writes.is_some() {
                    attempt += 1;
                    if attempt > 1 {
                        // Lost to another instance again: back off a random
                        // while, longer after each loss, so the racers spread out.
                        let most = 100u64 << attempt.min(6);
                        let wait = RandomState::new().hash_one(attempt) % most;
                        tokio::time::sleep(Duration::from_micros(wait)).await;
                    }
                }
            }
            Err(StoreFailure::Contended)
        };
        tokio::time::timeout_at(deadline, attempts).await.map_err(|_| StoreFailure::Timeout)?
    }

    fn clock_seen(&self, tag: &str, time: Nanos) {
        if self.options.clock.is_none() {
            self.clocks.seen(tag, time, Instant::now());
        }
    }

    /// Remembers what a successful script left in the keys.
    /// (Keys not written are known already. A lease record is not kept: it
    /// is written once, and read again only by the lease's return.)
    fn remember(&self, keys: &[String], writes: Option<&Writes>, versions: &[Option<Vec<u8>>]) {
        for ((key, write), version) in keys.iter().zip(writes.into_iter().flatten()).zip(versions) {
            if let (Some(next), Some(version)) = (write, version) {
                if next.kind == Kind::Bucket {
                    self.known.set(key, Known { value: Some(next.bytes.clone()), version: Some(version.clone()) });
                }
            }
        }
    }

    /// The script's arguments for deciding `writes` on `known` at `now`
    /// (no writes, no time: a read). With `claim`, a decision that keeps
    /// losing asks for its turn (see `cas.lua`).
    fn invocation(&self, known: &[Known], writes: Option<&Writes>, now: Option<Nanos>, claim: bool) -> Invocation {
        let mut args: Vec<Vec<u8>> = Vec::with_capacity(5 + 5 * known.len());
        let checked = now.filter(|_| self.options.clock.is_none() && writes.is_some());
        args.push(checked.map_or_else(Vec::new, |now| (now.get() / 1_000).to_string().into_bytes()));
        args.push(CLOCK_TOLERANCE_US.to_string().into_bytes());
        args.push(format!("{:x}", self.seed).into_bytes());
        args.push(if claim { b"1".to_vec() } else { Vec::new() });
        args.push(TURN_US.to_string().into_bytes());
        let mut versions = Vec::with_capacity(known.len());
        for (at, known) in known.iter().enumerate() {
            let seen = match writes {
                Some(_) => known.version.clone().unwrap_or_default(),
                None => NO_VERSION.to_vec(),
            };
            args.push(seen);
            match writes.and_then(|w| w.get(at)).and_then(Option::as_ref) {
                Some(next) => {
                    let n = self.writes.fetch_add(1, Ordering::Relaxed);
                    let version = format!("{:x}-{n:x}", self.seed).into_bytes();
                    let ttl_ms = (next.idle_at - now.unwrap_or(Nanos::ZERO)).ceil_millis().saturating_add(TTL_SLACK_MS);
                    let (tag, value) = next.bytes.split_first().map_or((UNTAGGED, &[][..]), |(t, v)| (*t, v));
                    args.push(version.clone());
                    args.push(value.to_vec());
                    args.push(ttl_ms.to_string().into_bytes());
                    args.push(tag.to_string().into_bytes());
                    versions.push(Some(version));
                }
                None => {
                    args.extend([Vec::new(), Vec::new(), b"0".to_vec(), b"0".to_vec()]);
                    versions.push(None);
                }
            }
        }
        Invocation { args, versions }
    }

    /// Runs the script (`EVALSHA`, loading it when Redis does not have it).
    async fn send(&self, conn: &mut Connection, keys: &[String], invocation: &Invocation) -> redis::RedisResult<Value> {
        let mut call = self.cas.prepare_invoke();
        for key in keys {
            call.key(key);
        }
        for arg in &invocation.args {
            call.arg(arg.as_slice());
        }
        call.invoke_async(conn).await
    }

    /// Sends `PING` (on a new connection once, if Redis dropped the old one).
    pub async fn ping(&self) -> Result<(), StoreFailure> {
        let call = async {
            let mut conn = self.connection().await?;
            let ping = redis::cmd("PING");
            let cluster = matches!(self.client, Client::Cluster(_));
            match ping.query_async::<String>(&mut conn).await {
                Err(e) if broken(&e) && !cluster => {
                    let mut conn = self.connect().await?;
                    ping.query_async::<String>(&mut conn).await.map_err(|e| self.failed(unavailable(e)))
                }
                result => result.map_err(unavailable),
            }
        };
        tokio::time::timeout(self.options.timeout, call).await.map_err(|_| StoreFailure::Timeout)?.map(|_| ())
    }
}

/// The script's arguments, and the version each written key gets.
struct Invocation {
    args: Vec<Vec<u8>>,
    versions: Vec<Option<Vec<u8>>>,
}

fn values_of(known: &[Known]) -> Vec<Option<Vec<u8>>> {
    known.iter().map(|k| k.value.clone()).collect()
}

/// True when the keys already hold the versions a script would have
/// written: it was applied (a resend after a dropped connection finds the
/// first send's writes).
fn applied(current: &[Known], versions: &[Option<Vec<u8>>]) -> bool {
    let mut written = current.iter().zip(versions).filter_map(|(known, version)| version.as_ref().map(|v| (known, v)));
    let first = written.next();
    first.is_some() && first.into_iter().chain(written).all(|(known, version)| known.version.as_ref() == Some(version))
}

/// A stored value as the decisions read it: its tag byte (field `t`; absent
/// for a value stored before values carried one), then the value (field `v`,
/// laid out as before tags, so that an instance of the previous release
/// reads it unchanged).
fn tagged(tag: Option<u8>, value: Vec<u8>) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(1 + value.len());
    bytes.push(tag.unwrap_or(UNTAGGED));
    bytes.extend(value);
    bytes
}

/// Reads the script's reply: `{1, seconds, µs}`, or `{0, seconds, µs, v, n,
/// t, …}` with each key's value, version and tag.
fn parse(reply: Value, keys: usize) -> Result<Reply, StoreFailure> {
    let Value::Array(items) = reply else { return Err(bad_reply("cas.lua")) };
    let [written, seconds, micros, rest @ ..] = items.as_slice() else { return Err(bad_reply("cas.lua")) };
    let time = redis_time(seconds, micros)?;
    if redis::from_redis_value::<i64>(written).map_err(unavailable)? == 1 {
        return Ok(Reply::Written(time));
    }
    if rest.len() != 3 * keys {
        return Err(bad_reply("cas.lua"));
    }
    let known = rest
        .chunks(3)
        .map(|key| {
            let [value, version, tag] = key else { return Err(bad_reply("cas.lua")) };
            let value: Option<Vec<u8>> = redis::from_redis_value(value).map_err(unavailable)?;
            let version: Option<Vec<u8>> = redis::from_redis_value(version).map_err(unavailable)?;
            let tag: Option<u8> = redis::from_redis_value(tag).map_err(unavailable)?;
            // A value without a version is not ours (an older layout): absent.
            Ok(Known { value: value.filter(|_| version.is_some()).map(|value| tagged(tag, value)), version })
        })
        .collect::<Result<Vec<Known>, StoreFailure>>()?;
    Ok(Reply::Changed(time, known))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::store::lease_key;

    #[test]
    fn cluster_addresses_list_their_seeds() {
        assert_eq!(
            cluster_seeds("redis+cluster://10.0.0.1:7000,10.0.0.2:7001").unwrap(),
            ["redis://10.0.0.1:7000", "redis://10.0.0.2:7001"]
        );
        assert_eq!(
            cluster_seeds("redis+cluster://u:p%40ss@h:1,k:2/").unwrap(),
            ["redis://u:p%40ss@h:1", "redis://u:p%40ss@k:2"]
        );
        let no_db = cluster_seeds("redis+cluster://h:1/0").unwrap_err();
        assert!(no_db.contains("only database 0"), "{no_db}");
        let empty = cluster_seeds("redis+cluster://h:1,,k:2").unwrap_err();
        assert!(empty.contains(r#"found """#), "{empty}");
        assert!(
            RedisStore::new("redis+cluster://", RedisOptions { timeout: Duration::from_secs(1), clock: None }).is_err()
        );
    }

    #[test]
    fn keys_of_one_domain_share_one_hash_tag() {
        // A bucket key as `bucket_key` writes it, with braces in a value.
        let bucket = r#"fg:{edge}:fw:[["path","/{x}"]]"#.to_string();
        let lease = lease_key("edge", "id-1");
        assert_eq!(hash_tag(&bucket), "edge");
        assert_eq!(hash_tag(&lease), "edge");
        assert!(same_slot(&[bucket, lease]).is_ok());
        assert_eq!(hash_tag("fg:{a{b}:x"), "a{b");
        assert_eq!(hash_tag("no tag"), "no tag");
    }

    #[test]
    fn a_domain_that_empties_the_hash_tag_is_refused_by_name() {
        let keys = [lease_key("}odd", "a"), lease_key("}odd", "b")];
        let Err(StoreFailure::Unavailable(why)) = same_slot(&keys) else { panic!("accepted") };
        assert!(why.contains("must not start with '}'"), "{why}");
        assert!(same_slot(&keys[..1]).is_ok(), "one key is always in one slot");
    }

    #[test]
    fn a_resent_script_whose_first_send_got_through_is_recognised() {
        let held = |version: Option<&str>| Known { value: None, version: version.map(|v| v.as_bytes().to_vec()) };
        let mine = [Some(b"s-1".to_vec()), None, Some(b"s-2".to_vec())];
        // The keys hold the versions this script writes: it was applied.
        assert!(applied(&[held(Some("s-1")), held(Some("o-9")), held(Some("s-2"))], &mine));
        // One of them holds another writer's version: it was not (or was
        // overwritten since), decide again.
        assert!(!applied(&[held(Some("s-1")), held(None), held(Some("o-3"))], &mine));
        // A script that writes nothing is never taken for applied.
        assert!(!applied(&[held(Some("s-1"))], &[None]));
    }
}
