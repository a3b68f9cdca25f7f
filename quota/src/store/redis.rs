//! The Redis store: Redis keeps versioned bytes, the service decides. A
//! transaction reads its keys' values and versions (and Redis's clock) in
//! one atomic round trip, decides in Rust (the same code as the memory
//! store), and writes with one small script (`cas.lua`) that writes several
//! keys only if none of their versions changed meanwhile; a lost race reads
//! again, a bounded number of times within the store timeout. Keys share
//! the domain's hash tag, so a transaction's keys sit in one Redis Cluster
//! slot.
//!
//! Failure handling: every transaction is bounded by a timeout; the
//! connection is made lazily and re-made by redis-rs's connection manager,
//! so a service started before Redis, or outliving a Redis restart, serves
//! again on its own as soon as Redis answers.
//!
//! Redis Cluster (`redis+cluster://host:port,host:port…`) runs the same
//! transactions through redis-rs's cluster client: the read (a `MULTI`
//! pipeline) and the script are routed by their keys, so both, `TIME`
//! included, run on the master owning the domain's slot, and `MOVED`/`ASK`
//! redirections and topology changes are followed by the client.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Script, Value};
use tokio::sync::Mutex;

use floodgate_core::time::{Clock, Nanos};

use super::decide::UNTAGGED;
use super::{StoreFailure, Writes};

/// Most reads and writes one transaction makes before giving up on a key
/// that keeps changing (each lost race means another writer won).
const ATTEMPTS: usize = 64;

/// Key stripes whose transactions take turns within this process.
const STRIPES: usize = 256;

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
    Single(ConnectionManager),
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

/// Counters in Redis.
pub struct RedisStore {
    client: Client,
    options: RedisOptions,
    /// The live connection (cloned per call: it multiplexes).
    connection: std::sync::RwLock<Option<Connection>>,
    /// Held while connecting, so that one caller connects and the others wait.
    connecting: Mutex<()>,
    /// When and how the last connection attempt failed: attempts are spaced
    /// so that a dead Redis costs callers a refused connect, not a pile of
    /// them, and the callers in between get the same error.
    last_failure: std::sync::Mutex<Option<(Instant, StoreFailure)>>,
    cas: Script,
    /// Versions are `seed-counter`: unique to this process and write, so a
    /// key deleted and written again never matches a stale read.
    seed: u64,
    writes: AtomicU64,
    /// Turns per key stripe (see [`RedisStore::transact`]).
    stripes: Vec<Mutex<()>>,
    hasher: RandomState,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore").field("options", &self.options).finish_non_exhaustive()
    }
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

fn bad_reply(what: &str) -> StoreFailure {
    StoreFailure::Unavailable(format!("unexpected reply to {what}"))
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
            connection: std::sync::RwLock::new(None),
            connecting: Mutex::new(()),
            last_failure: std::sync::Mutex::new(None),
            cas: Script::new(include_str!("cas.lua")),
            seed: RandomState::new().hash_one(Instant::now()),
            writes: AtomicU64::new(0),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            hasher: RandomState::new(),
        })
    }

    fn stripe_of(&self, key: &str) -> usize {
        // The modulo keeps the index below STRIPES whatever the hash.
        (self.hasher.hash_one(key) % STRIPES as u64) as usize
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
        {
            let last = self.last_failure.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((at, error)) = last.as_ref() {
                if at.elapsed() < self.options.timeout {
                    return Err(error.clone());
                }
            }
        }
        let connect = async {
            match &self.client {
                Client::Single(client) => {
                    let config = ConnectionManagerConfig::new()
                        .set_connection_timeout(self.options.timeout)
                        .set_response_timeout(self.options.timeout)
                        // Reconnect quickly and keep trying: a restarted Redis is picked
                        // up within about a second.
                        .set_number_of_retries(2)
                        .set_factor(50)
                        .set_max_delay(1_000);
                    ConnectionManager::new_with_config(client.clone(), config).await.map(Connection::Single)
                }
                Client::Cluster(client) => client.get_async_connection().await.map(Connection::Cluster),
            }
        };
        match tokio::time::timeout(self.options.timeout, connect).await {
            Ok(Ok(conn)) => {
                *self.connection.write().unwrap_or_else(|p| p.into_inner()) = Some(conn.clone());
                Ok(conn)
            }
            Ok(Err(e)) => Err(self.failed_to_connect(match unavailable(e) {
                StoreFailure::Unavailable(why) => StoreFailure::Unavailable(format!("cannot connect to Redis: {why}")),
                other => other,
            })),
            Err(_) => Err(self.failed_to_connect(StoreFailure::Timeout)),
        }
    }

    fn failed_to_connect(&self, error: StoreFailure) -> StoreFailure {
        *self.last_failure.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), error.clone()));
        error
    }

    /// See [`super::Store`]: reads, decides, writes if nothing changed, and
    /// starts over when something did.
    pub async fn transact<A>(
        &self,
        keys: &[String],
        mut decide: impl FnMut(&[Option<Vec<u8>>], Nanos) -> (A, Writes),
    ) -> Result<A, StoreFailure> {
        if matches!(self.client, Client::Cluster(_)) {
            same_slot(keys)?;
        }
        let attempts = async {
            // Transactions of this process on the same keys take turns, so
            // races are lost only to other service instances.
            let mut stripes: Vec<usize> = keys.iter().map(|k| self.stripe_of(k)).collect();
            stripes.sort_unstable();
            stripes.dedup();
            let mut turns = Vec::with_capacity(stripes.len());
            for stripe in stripes {
                if let Some(lock) = self.stripes.get(stripe) {
                    turns.push(lock.lock().await);
                }
            }
            let mut conn = self.connection().await?;
            for attempt in 0..ATTEMPTS {
                let (now, values, versions) = self.read(&mut conn, keys).await?;
                let (answer, writes) = decide(&values, now);
                if writes.iter().all(Option::is_none) || self.write(&mut conn, keys, &versions, &writes, now).await? {
                    return Ok(answer);
                }
                // Lost to another instance: back off a random while, longer
                // after each loss, so that the racers spread out.
                let most = 100u64 << attempt.min(6);
                let wait = RandomState::new().hash_one(attempt) % most;
                tokio::time::sleep(Duration::from_micros(wait)).await;
            }
            Err(StoreFailure::Contended)
        };
        tokio::time::timeout(self.options.timeout, attempts).await.map_err(|_| StoreFailure::Timeout)?
    }

    /// One atomic round trip: the clock (Redis's `TIME` unless a local clock
    /// was given) and each key's value and version.
    async fn read(
        &self,
        conn: &mut Connection,
        keys: &[String],
    ) -> Result<(Nanos, Vec<Option<Vec<u8>>>, Vec<Option<Vec<u8>>>), StoreFailure> {
        let local = self.options.clock.as_ref().map(|c| c.now());
        let mut pipe = redis::pipe();
        pipe.atomic();
        if local.is_none() {
            pipe.cmd("TIME");
        }
        for key in keys {
            pipe.cmd("HMGET").arg(key).arg("v").arg("n").arg("t");
        }
        // A connection dropped while this instance was idle (a Redis
        // restart) fails the first command with a broken pipe: it is sent
        // once more, on the connection the manager re-makes at that error.
        // The read changes nothing, so sending it twice is harmless.
        let replies: Vec<Value> = match pipe.query_async(conn).await {
            Err(e) if e.is_connection_dropped() => pipe.query_async(conn).await,
            result => result,
        }
        .map_err(unavailable)?;
        let (now, rest) = match local {
            Some(now) => (now, replies.as_slice()),
            None => {
                let (time, rest) = replies.split_first().ok_or_else(|| bad_reply("TIME"))?;
                let (secs, micros): (u64, u64) = redis::from_redis_value(time).map_err(unavailable)?;
                (Nanos::from_secs(secs) + Nanos::from_micros(micros), rest)
            }
        };
        if rest.len() != keys.len() {
            return Err(bad_reply("HMGET"));
        }
        let mut values = Vec::with_capacity(keys.len());
        let mut versions = Vec::with_capacity(keys.len());
        for reply in rest {
            let (value, version, tag): (Option<Vec<u8>>, Option<Vec<u8>>, Option<u8>) =
                redis::from_redis_value(reply).map_err(unavailable)?;
            // A value without a version is not ours (an older layout): absent.
            values.push(value.filter(|_| version.is_some()).map(|value| tagged(tag, value)));
            versions.push(version);
        }
        Ok((now, values, versions))
    }

    /// Writes `writes` if no key's version changed since `versions` were
    /// read; false when one did.
    async fn write(
        &self,
        conn: &mut Connection,
        keys: &[String],
        versions: &[Option<Vec<u8>>],
        writes: &Writes,
        now: Nanos,
    ) -> Result<bool, StoreFailure> {
        let mut invocation = self.cas.prepare_invoke();
        for ((key, version), write) in keys.iter().zip(versions).zip(writes) {
            invocation.key(key).arg(version.as_deref().unwrap_or_default());
            match write {
                Some(next) => {
                    let n = self.writes.fetch_add(1, Ordering::Relaxed);
                    let ttl_ms = (next.idle_at - now).ceil_millis().saturating_add(TTL_SLACK_MS);
                    let (tag, value) = next.bytes.split_first().map_or((UNTAGGED, &[][..]), |(t, v)| (*t, v));
                    invocation.arg(format!("{:x}-{n:x}", self.seed)).arg(value).arg(ttl_ms).arg(tag);
                }
                None => {
                    invocation.arg("").arg("").arg(0).arg(0);
                }
            }
        }
        let written: i64 = invocation.invoke_async(conn).await.map_err(unavailable)?;
        Ok(written == 1)
    }

    /// Sends `PING` (once more after a dropped connection, as [`Self::read`]).
    pub async fn ping(&self) -> Result<(), StoreFailure> {
        let call = async {
            let mut conn = self.connection().await?;
            let ping = redis::cmd("PING");
            match ping.query_async::<String>(&mut conn).await {
                Err(e) if e.is_connection_dropped() => ping.query_async::<String>(&mut conn).await,
                result => result,
            }
            .map_err(unavailable)
        };
        tokio::time::timeout(self.options.timeout, call).await.map_err(|_| StoreFailure::Timeout)?.map(|_| ())
    }
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
}
