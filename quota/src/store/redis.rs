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
//! A round of independent transactions (up to 64 of the leases of one call,
//! or of several calls', batches freed together) goes in one script per
//! hash tag: each transaction is a group of keys with its own
//! compare-and-swap, written or answered on its own, so 64 leases cost one
//! round trip and one lost race holds no other. A transaction that loses a
//! race claims its keys' turn and goes again at once; one that meets
//! another instance's turn waits a little, alone.
//! With `--redis-clock local` the instance decides only while its clock is
//! within [`LOCAL_CLOCK_BOUND`] of Redis's. A script marks each key it
//! writes, in the write itself (a field of this instance's holding the
//! version written: no key or command of its own), so that a resend after a
//! dropped connection does not decide the groups it wrote again.
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

use std::any::Any;

use floodgate_core::time::{Clock, Nanos};

use super::backend::{Backend, BackendRegistration, BoxFuture, Finisher, StoreOptions};
use super::decide::UNTAGGED;
use super::lanes::Batch;
use super::{Kind, StoreFailure, Writes};

/// `--store redis://…` (`rediss://`, `redis+unix://`) and `redis+cluster://…`.
pub const REGISTRATION: BackendRegistration = BackendRegistration {
    name: "redis",
    usage: "a redis:// URL or redis+cluster://host:port[,host:port…]",
    accepts: |text| ["redis://", "rediss://", "redis+unix://", CLUSTER_SCHEME].iter().any(|s| text.starts_with(s)),
    open: |address, options: &StoreOptions| {
        let redis = if options.local_clock {
            RedisOptions::local_clock(options.timeout, options.clock.clone())
        } else {
            RedisOptions::redis_clock(options.timeout)
        };
        Ok(Arc::new(RedisStore::new(address, redis)?))
    },
};

/// How far this instance's clock may be from Redis's when it decides on its
/// own (`--redis-clock local`). Two such instances are then within twice
/// this of each other, under the shortest window (a second), where the
/// algorithms trust a state of the next window (a clock stepped back) and
/// never take it for a stale one to reset.
pub const LOCAL_CLOCK_BOUND: Nanos = Nanos::from_millis(250);

/// The compare-and-swap script.
const CAS: &str = include_str!("cas.lua");

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

/// A decision that loses a race claims its keys' turn (all of them, or
/// none while another instance holds one): until its next write, and at
/// most `TURN_US`, they take no other instance's write, and its next
/// attempt, sent at once, is written. So an instance whose rival writes back
/// to back is not starved, and instances writing the same keys take turns
/// instead of racing. (Claimed after two losses, instances writing the same
/// keys in rounds of many transactions lost every race to each other, each
/// round writing the keys the others had just read, and backed off until
/// their calls timed out: three instances leasing 512 keys a call in
/// common answered 503, with nothing at fault, for most calls.) Ten
/// milliseconds: the holder writes within a round trip or two; a turn left
/// by a call that timed out (or an instance that died) holds the others
/// no longer than that (they were held 50 ms each time, which under load
/// timed out more calls, which left more turns).
const TURN_US: u64 = 10_000;

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
    /// With `clock`: the most it may be off from Redis's for this instance
    /// to decide ([`LOCAL_CLOCK_BOUND`]); `None` does not look (a test's
    /// manual clock, years from Redis's).
    pub clock_bound: Option<Nanos>,
}

impl RedisOptions {
    /// Decisions on Redis's clock (`--redis-clock redis`).
    pub fn redis_clock(timeout: Duration) -> Self {
        RedisOptions { timeout, clock: None, clock_bound: None }
    }

    /// Decisions on `clock` while it is within [`LOCAL_CLOCK_BOUND`] of
    /// Redis's (`--redis-clock local`).
    pub fn local_clock(timeout: Duration, clock: Arc<dyn Clock>) -> Self {
        RedisOptions { timeout, clock: Some(clock), clock_bound: Some(LOCAL_CLOCK_BOUND) }
    }
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
    super::group_of(key)
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
        Some(time + Nanos::from(at.elapsed()))
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

/// What the script answered: Redis's time, and each group's outcome.
struct Reply {
    time: Nanos,
    groups: Vec<Group>,
}

/// What the script did with one group (one batch).
enum Group {
    /// Written (or, without writes, confirmed unchanged).
    Written,
    /// Nothing written: the keys as they are, and whether another
    /// instance holds the turn of one of them (then this one waits a
    /// little before it tries again; otherwise, its turn claimed, it tries
    /// again at once).
    Changed(Vec<Known>, bool),
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
    /// Versions are `seed-counter` (in hexadecimal): unique to this process
    /// and write, so a key deleted and written again never matches a stale
    /// read. The seed also names this instance in the script's marks.
    seed_hex: String,
    writes: AtomicU64,
    known: KnownKeys,
    clocks: Clocks,
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
            cas: Script::new(CAS),
            seed_hex: format!("{:x}", RandomState::new().hash_one(Instant::now())),
            writes: AtomicU64::new(0),
            known: KnownKeys::new(),
            clocks: Clocks::default(),
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

    /// Runs the batches of one group (one hash tag: one slot) together:
    /// each attempt decides every batch still open on what is known of its
    /// keys and sends them all in one script (one round trip), which writes
    /// each batch whose keys did not change and answers the others' current
    /// values, to decide again on. So a round of independent batches costs
    /// one round trip per slot, and a batch that loses a race holds no other.
    async fn run_group(self: Arc<Self>, tag: String, batches: Vec<Batch>, done: Arc<Finisher>) {
        let cluster = matches!(self.client, Client::Cluster(_));
        let mut open = Vec::with_capacity(batches.len());
        for batch in batches {
            if batch.is_empty() {
                done.finish(batch, &Ok(()));
                continue;
            }
            if cluster {
                if let Err(refused) = same_slot(&batch.keys) {
                    done.finish(batch, &Err(refused));
                    continue;
                }
            }
            let known = batch.keys.iter().map(|k| self.known.get(k)).collect();
            let not_before = Instant::now();
            open.push(Open { batch, known, lost: 0, attempts: 0, not_before, writes: None, versions: Vec::new() });
        }
        if open.is_empty() {
            done.flush();
            return;
        }
        self.transactions.fetch_add(open.len() as u64, Ordering::Relaxed);
        let deadline = open.iter().filter_map(|o| o.batch.deadline).max().unwrap_or_else(|| self.deadline_now());
        let failure = match tokio::time::timeout_at(deadline, self.attempts(&tag, &mut open, &done)).await {
            Ok(Ok(())) => None,
            Ok(Err(failure)) => Some(failure),
            Err(_) => Some(StoreFailure::Timeout),
        };
        if let Some(failure) = failure {
            for o in open {
                done.finish(o.batch, &Err(failure.clone()));
            }
        }
        // Whatever these batches' ends let start goes now, as one round.
        done.flush();
    }

    /// When a call made now must have its answer (`--store-timeout`).
    fn deadline_now(&self) -> tokio::time::Instant {
        tokio::time::Instant::now() + self.options.timeout
    }

    /// See [`RedisStore::run_group`]: the attempts, until every batch of
    /// `open` is written (and handed to `done`), runs out of attempts (then
    /// it alone is answered `contended`), or one failure fails them all.
    /// Each attempt sends the batches due: one that met another instance's
    /// turn waits a little first (and holds no other batch meanwhile).
    async fn attempts(&self, tag: &str, open: &mut Vec<Open>, done: &Finisher) -> Result<(), StoreFailure> {
        let cluster = matches!(self.client, Client::Cluster(_));
        let mut conn = self.connection().await?;
        let mut resent = false;
        loop {
            let Some(wake) = open.iter().map(|o| o.not_before).min() else { return Ok(()) };
            // Only a batch that met another instance's turn has a wake
            // ahead. A deadline already passed is not awaited: tokio's timer
            // rounds it up to its next millisecond tick, which cost every
            // attempt up to a millisecond (a lone probe's p50 went from
            // 0.5 ms to 4.4 ms on Redis).
            if wake > Instant::now() {
                tokio::time::sleep_until(wake.into()).await;
            }
            let at = Instant::now();
            // The batches due first; all of them stay in `open` while the
            // script is out, so that a call that times out meanwhile finds
            // them there to answer.
            open.sort_by_key(|o| o.not_before > at);
            let due = open.iter().take_while(|o| o.not_before <= at).count();
            // Redis's clock (estimated, checked by the script) or ours;
            // without one yet, the first round trip only reads.
            let now = match &self.options.clock {
                Some(clock) => Some(clock.now()),
                None => self.clocks.estimate(tag),
            };
            let sent_now = open.get_mut(..due).unwrap_or_default();
            for o in sent_now.iter_mut() {
                o.writes = now.map(|now| o.batch.decide(&values_of(&o.known), now));
                o.attempts += 1;
            }
            let invocation = self.invocation(sent_now, now, !cluster);
            let sizes: Vec<usize> = sent_now.iter().map(|o| o.batch.keys.len()).collect();
            self.round_trips.fetch_add(1, Ordering::Relaxed);
            let mut sent_at = Instant::now();
            let mut sent = self.send(&mut conn, &invocation, false).await;
            if matches!(&sent, Err(e) if broken(e)) && !cluster && !resent {
                // Redis dropped the connection (a restart): the same script
                // once more, on a new connection. If the first got through,
                // its marks say which batches it wrote: they are not decided
                // again (whoever wrote the keys since).
                resent = true;
                conn = self.connect().await?;
                self.round_trips.fetch_add(1, Ordering::Relaxed);
                sent_at = Instant::now();
                sent = self.send(&mut conn, &invocation, true).await;
            }
            let reply = match sent {
                Err(e) if broken(&e) && !cluster => return Err(self.failed(unavailable(e))),
                Err(e) => return Err(unavailable(e)),
                Ok(reply) => parse(reply, &sizes)?,
            };
            self.clock_seen(tag, reply.time, sent_at);
            if let (Some(clock), Some(bound)) = (&self.options.clock, self.options.clock_bound) {
                // This instance decides on its own clock: only while it is
                // within the bound of Redis's (see `LOCAL_CLOCK_BOUND`).
                let ours = clock.now();
                let offset = ours.get() as i128 - reply.time.get() as i128;
                if offset.unsigned_abs() > u128::from(bound.get()) {
                    return Err(StoreFailure::ClockOff {
                        offset_ms: i64::try_from(offset / 1_000_000).unwrap_or(i64::MAX),
                        bound_ms: bound.get() / 1_000_000,
                    });
                }
            }
            let mut garbled = false;
            let mut still = Vec::with_capacity(due);
            for (mut o, group) in open.drain(..due).zip(reply.groups) {
                let written = match group {
                    // A read is never written (no key has the version it sends).
                    Group::Written if o.writes.is_none() => {
                        garbled = true;
                        false
                    }
                    Group::Written => true,
                    Group::Changed(current, blocked) => {
                        if applied(&current, &o.versions) {
                            true
                        } else {
                            for (key, known) in o.batch.keys.iter().zip(&current) {
                                self.known.set(key, known.clone());
                            }
                            o.known = current;
                            if o.writes.is_some() {
                                o.lost += 1;
                            }
                            // Another instance's turn: wait a random while
                            // (longer after each loss, so the racers spread
                            // out) for its write. Else this instance's turn
                            // is claimed (or it only read): again at once.
                            o.not_before = match blocked {
                                true => {
                                    let most = 100u64 << o.lost.clamp(1, 3);
                                    let wait = RandomState::new().hash_one((o.lost, o.attempts)) % most;
                                    Instant::now() + Duration::from_micros(wait)
                                }
                                false => Instant::now(),
                            };
                            false
                        }
                    }
                };
                if written {
                    self.remember(&o.batch.keys, o.writes.as_ref(), &o.versions);
                    done.finish(o.batch, &Ok(()));
                } else if o.attempts >= ATTEMPTS {
                    done.finish(o.batch, &Err(StoreFailure::Contended));
                } else {
                    still.push(o);
                }
            }
            open.extend(still);
            done.flush();
            if garbled {
                return Err(bad_reply("cas.lua"));
            }
        }
    }

    /// Redis's `time`, read by a script sent at `sent_at`. Redis read it
    /// between the send and the reply's reading; taken as read at the send,
    /// the estimate runs ahead by the way there (a round trip at most), not
    /// behind by the time the reply waited to be read: on a service core
    /// busy for longer than the script's tolerance, estimates that far
    /// behind had every write refused as untimely, until its deadline.
    fn clock_seen(&self, tag: &str, time: Nanos, sent_at: Instant) {
        if self.options.clock.is_none() {
            self.clocks.seen(tag, time, sent_at);
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

    /// The script's call (`EVALSHA`, its keys and arguments) for the
    /// decisions of `open` (each batch one group) at `now` (a batch without
    /// writes, and no time: a read), and each batch's new versions. A batch
    /// that keeps losing asks for its turn (see `cas.lua`). With `mark`, the
    /// script marks the keys it writes, so that a resend knows. Written
    /// straight into the command's buffer: an argument is not an
    /// allocation of its own (a round of many calls has thousands).
    fn invocation(&self, open: &mut [Open], now: Option<Nanos>, mark: bool) -> Invocation {
        let writing = |o: &Open| o.writes.as_ref().is_some_and(|w| w.iter().any(Option::is_some));
        let keys_total: usize = open.iter().map(|o| o.batch.keys.len()).sum();
        let bytes: usize = open.iter().flat_map(|o| &o.batch.keys).map(|k| k.len() + 64).sum();
        let mut command = Cmd::with_capacity(3 + 7 + 2 * open.len() + 6 * keys_total, 128 + 2 * bytes);
        command.arg("EVALSHA").arg(self.cas.get_hash()).arg(keys_total);
        for key in open.iter().flat_map(|o| &o.batch.keys) {
            command.arg(key.as_str());
        }
        let any_writes = open.iter().any(|o| o.writes.is_some());
        let (time, tolerance) = match (&self.options.clock, self.options.clock_bound) {
            (None, _) => (now.filter(|_| any_writes), CLOCK_TOLERANCE_US),
            (Some(_), Some(bound)) => (now.filter(|_| any_writes), bound.get() / 1_000),
            (Some(_), None) => (None, 0),
        };
        match time {
            Some(now) => command.arg(now.get() / 1_000),
            None => command.arg(b"".as_slice()),
        };
        command.arg(tolerance).arg(self.seed_hex.as_str()).arg(TURN_US).arg(open.len());
        // ARGV[6]: set to '1' on a resend, see `Invocation::resent`.
        let resend_at = command.args_iter().len();
        command.arg(b"".as_slice());
        command.arg(if mark { b"1".as_slice() } else { b"0".as_slice() });
        for o in open.iter() {
            command.arg(o.batch.keys.len());
            command.arg(if writing(o) { b"1".as_slice() } else { b"".as_slice() });
        }
        for o in open.iter_mut() {
            o.versions = Vec::with_capacity(o.known.len());
            for (at, known) in o.known.iter().enumerate() {
                match o.writes {
                    Some(_) => command.arg(known.version.as_deref().unwrap_or_default()),
                    None => command.arg(NO_VERSION),
                };
                match o.writes.as_ref().and_then(|w| w.get(at)).and_then(Option::as_ref) {
                    Some(next) => {
                        let n = self.writes.fetch_add(1, Ordering::Relaxed);
                        let version = format!("{}-{n:x}", self.seed_hex).into_bytes();
                        let ttl_ms =
                            (next.idle_at - now.unwrap_or(Nanos::ZERO)).ceil_millis().saturating_add(TTL_SLACK_MS);
                        let (tag, value) = next.bytes.split_first().map_or((UNTAGGED, &[][..]), |(t, v)| (*t, v));
                        command.arg(version.as_slice()).arg(value).arg(ttl_ms).arg(u64::from(tag));
                        o.versions.push(Some(version));
                    }
                    None => {
                        command.arg(b"".as_slice()).arg(b"".as_slice()).arg(0u64).arg(0u64);
                        o.versions.push(None);
                    }
                }
            }
        }
        Invocation { command, resend_at }
    }

    /// Runs the script (`EVALSHA`, loading it when Redis does not have it);
    /// `resend` says it was sent before.
    async fn send(&self, conn: &mut Connection, invocation: &Invocation, resend: bool) -> redis::RedisResult<Value> {
        let resent;
        let command = if resend {
            resent = invocation.resent();
            &resent
        } else {
            &invocation.command
        };
        match command.query_async(conn).await {
            Err(e) if e.kind() == redis::ErrorKind::NoScriptError => {
                redis::cmd("SCRIPT").arg("LOAD").arg(CAS).exec_async(conn).await?;
                command.query_async(conn).await
            }
            result => result,
        }
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

impl Backend for RedisStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn failure_kinds(&self) -> &'static [&'static str] {
        if self.options.clock_bound.is_some() {
            &["timeout", "unavailable", "contended", "clock"]
        } else {
            &["timeout", "unavailable", "contended"]
        }
    }

    fn deadline(&self) -> Option<tokio::time::Instant> {
        // A Redis call ends by `--store-timeout`, its turn on a hot key included.
        Some(self.deadline_now())
    }

    /// One group per hash tag (slot), all at once.
    fn run(self: Arc<Self>, round: Vec<Batch>, done: Arc<Finisher>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let mut groups: Vec<(String, Vec<Batch>)> = Vec::new();
            for batch in round {
                match groups.iter_mut().find(|(tag, _)| *tag == batch.group) {
                    Some((_, batches)) => batches.push(batch),
                    None => groups.push((batch.group.clone(), vec![batch])),
                }
            }
            let last = groups.pop();
            for (tag, batches) in groups {
                tokio::spawn(Arc::clone(&self).run_group(tag, batches, Arc::clone(&done)));
            }
            if let Some((tag, batches)) = last {
                self.run_group(tag, batches, done).await;
            }
        })
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreFailure>> {
        Box::pin(RedisStore::ping(self))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A batch being decided: what is known of its keys, how often it lost,
/// its last decision's writes and the versions they give.
struct Open {
    batch: Batch,
    known: Vec<Known>,
    lost: usize,
    /// Round trips it was sent in.
    attempts: usize,
    /// Not sent again before then (it met another instance's turn).
    not_before: Instant,
    writes: Option<Writes>,
    versions: Vec<Option<Vec<u8>>>,
}

/// The script's call, and where its resend flag (`ARGV[6]`) is among the
/// command's arguments.
struct Invocation {
    command: Cmd,
    resend_at: usize,
}

impl Invocation {
    /// The same call, saying it was sent before.
    fn resent(&self) -> Cmd {
        let mut command = Cmd::with_capacity(self.command.args_iter().len(), 0);
        for (at, arg) in self.command.args_iter().enumerate() {
            match arg {
                _ if at == self.resend_at => command.arg(b"1".as_slice()),
                redis::Arg::Simple(bytes) => command.arg(bytes),
                redis::Arg::Cursor => command.cursor_arg(0),
            };
        }
        command
    }
}

fn values_of(known: &[Known]) -> Vec<Option<Vec<u8>>> {
    known.iter().map(|k| k.value.clone()).collect()
}

/// True when the keys already hold the versions a script would have
/// written: it was applied (a resend finds the first send's writes unless
/// another writer came since; on a Redis Cluster, where no marks are
/// written, the client library's own retries may send a script twice).
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

/// Reads the script's reply: `{seconds, µs, s1, …, sG}`, then for each group
/// whose `s` is 0, each of its keys' value, version and tag.
fn parse(reply: Value, sizes: &[usize]) -> Result<Reply, StoreFailure> {
    let Value::Array(items) = reply else { return Err(bad_reply("cas.lua")) };
    let [seconds, micros, rest @ ..] = items.as_slice() else { return Err(bad_reply("cas.lua")) };
    let time = redis_time(seconds, micros)?;
    let (statuses, mut values) = (rest.get(..sizes.len()), rest.get(sizes.len()..).unwrap_or_default());
    let statuses = statuses.ok_or_else(|| bad_reply("cas.lua"))?;
    let mut groups = Vec::with_capacity(sizes.len());
    for (status, size) in statuses.iter().zip(sizes) {
        let status = redis::from_redis_value::<i64>(status).map_err(unavailable)?;
        if status == 1 {
            groups.push(Group::Written);
            continue;
        }
        let (mine, others) = (values.get(..3 * size), values.get(3 * size..));
        let (Some(mine), Some(others)) = (mine, others) else { return Err(bad_reply("cas.lua")) };
        values = others;
        let known = mine
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
        groups.push(Group::Changed(known, status == 2));
    }
    if !values.is_empty() {
        return Err(bad_reply("cas.lua"));
    }
    Ok(Reply { time, groups })
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
        assert!(RedisStore::new("redis+cluster://", RedisOptions::redis_clock(Duration::from_secs(1))).is_err());
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
