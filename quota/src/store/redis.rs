//! The Redis store: each operation is one Lua script (see the `.lua` files
//! beside this one for KEYS and ARGV), so it is atomic across every bucket it
//! touches and across every service instance sharing the Redis.
//!
//! Failure handling: every call is bounded by a timeout; the connection is
//! made lazily and re-made by redis-rs's connection manager, so a service
//! started before Redis, or outliving a Redis restart, serves again on its
//! own as soon as Redis answers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate_core::algorithm::Decision;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Script;
use tokio::sync::Mutex;

use super::{CheckItem, CheckOutcome, Grant, LeaseItem, ReturnItem, StoreError, LEASE_RECORD_MARGIN, NEVER};
use crate::clock::{Clock, Micros};
use crate::config::{Algorithm, Limit};

const COMMON: &str = include_str!("common.lua");

/// How the Redis store is set up.
#[derive(Debug, Clone)]
pub struct RedisOptions {
    /// Longest wait for any one Redis call, connecting included.
    pub timeout: Duration,
    /// `None`: decisions use Redis's clock (`TIME`), so that every instance
    /// agrees. `Some`: the service's clock is passed in instead.
    pub clock: Option<Arc<dyn Clock>>,
}

/// Counters in Redis.
pub struct RedisStore {
    client: redis::Client,
    options: RedisOptions,
    /// The live connection (cloned per call: it multiplexes).
    connection: std::sync::RwLock<Option<ConnectionManager>>,
    /// Held while connecting, so that one caller connects and the others wait.
    connecting: Mutex<()>,
    /// When the last connection attempt failed: attempts are spaced so that a
    /// dead Redis costs callers a refused connect, not a pile of them.
    last_failure: std::sync::Mutex<Option<Instant>>,
    check: Script,
    lease: Script,
    give_back: Script,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore").field("options", &self.options).finish_non_exhaustive()
    }
}

fn algorithm_code(algorithm: Algorithm) -> u8 {
    match algorithm {
        Algorithm::TokenBucket => 1,
        Algorithm::FixedWindow => 2,
    }
}

fn limit_args(limit: &Limit) -> [u64; 4] {
    [u64::from(algorithm_code(limit.algorithm)), limit.limit, limit.period, limit.capacity]
}

fn bad_reply(what: &str) -> StoreError {
    StoreError::Unavailable(format!("unexpected reply from the {what} script"))
}

fn micros(value: i64) -> Micros {
    u64::try_from(value).unwrap_or(NEVER)
}

/// Retry-after from a script: -1 means never.
fn retry(value: i64) -> Micros {
    if value < 0 {
        NEVER
    } else {
        micros(value)
    }
}

impl RedisStore {
    /// A store for the Redis at `url` (`redis://host:port/db`). Connects on
    /// first use, so a service may start before its Redis.
    pub fn new(url: &str, options: RedisOptions) -> Result<Self, String> {
        let client = redis::Client::open(url).map_err(|e| format!("invalid Redis URL {url:?}: {e}"))?;
        let script = |body: &str| Script::new(&format!("{COMMON}\n{body}"));
        Ok(Self {
            client,
            options,
            connection: std::sync::RwLock::new(None),
            connecting: Mutex::new(()),
            last_failure: std::sync::Mutex::new(None),
            check: script(include_str!("check.lua")),
            lease: script(include_str!("lease.lua")),
            give_back: script(include_str!("return.lua")),
        })
    }

    fn now_arg(&self) -> String {
        self.options.clock.as_ref().map(|c| c.now_us().to_string()).unwrap_or_default()
    }

    fn current(&self) -> Option<ConnectionManager> {
        self.connection.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    async fn connection(&self) -> Result<ConnectionManager, StoreError> {
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let _connecting = self.connecting.lock().await;
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        {
            let last = self.last_failure.lock().unwrap_or_else(|p| p.into_inner());
            if last.is_some_and(|at| at.elapsed() < self.options.timeout) {
                return Err(StoreError::Unavailable("cannot connect to Redis (retrying shortly)".into()));
            }
        }
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(self.options.timeout)
            .set_response_timeout(self.options.timeout)
            // Reconnect quickly and keep trying: a restarted Redis is picked
            // up within about a second.
            .set_number_of_retries(2)
            .set_factor(50)
            .set_max_delay(1_000);
        match tokio::time::timeout(
            self.options.timeout,
            ConnectionManager::new_with_config(self.client.clone(), config),
        )
        .await
        {
            Ok(Ok(conn)) => {
                *self.connection.write().unwrap_or_else(|p| p.into_inner()) = Some(conn.clone());
                Ok(conn)
            }
            Ok(Err(e)) => {
                *self.last_failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
                Err(StoreError::Unavailable(format!("cannot connect to Redis: {e}")))
            }
            Err(_) => {
                *self.last_failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
                Err(StoreError::Timeout)
            }
        }
    }

    async fn run(&self, invocation: redis::ScriptInvocation<'_>) -> Result<Vec<i64>, StoreError> {
        let call = async {
            let mut conn = self.connection().await?;
            invocation.invoke_async::<Vec<i64>>(&mut conn).await.map_err(|e| StoreError::Unavailable(e.to_string()))
        };
        tokio::time::timeout(self.options.timeout, call).await.map_err(|_| StoreError::Timeout)?
    }

    /// See [`super::Store::check`].
    pub async fn check(&self, items: &[CheckItem]) -> Result<CheckOutcome, StoreError> {
        let mut inv = self.check.prepare_invoke();
        inv.arg(self.now_arg());
        for item in items {
            inv.key(&item.key);
            for a in limit_args(&item.limit) {
                inv.arg(a);
            }
            inv.arg(item.cost).arg(u8::from(item.shadow));
        }
        let reply = self.run(inv).await?;
        let (head, rest) = reply.split_at_checked(2).ok_or_else(|| bad_reply("check"))?;
        if rest.len() != items.len() * 4 {
            return Err(bad_reply("check"));
        }
        let decisions = rest
            .chunks_exact(4)
            .map(|c| Decision {
                allowed: c[0] == 1,
                remaining: micros(c[1]),
                reset: micros(c[2]),
                retry_after: retry(c[3]),
            })
            .collect();
        Ok(CheckOutcome { committed: head[1] == 1, decisions })
    }

    /// See [`super::Store::lease`].
    pub async fn lease(&self, items: &[LeaseItem], ttl: Micros) -> Result<Vec<Grant>, StoreError> {
        let mut inv = self.lease.prepare_invoke();
        inv.arg(self.now_arg()).arg(ttl).arg(LEASE_RECORD_MARGIN);
        for item in items {
            inv.key(&item.key).key(&item.record);
            for a in limit_args(&item.limit) {
                inv.arg(a);
            }
            inv.arg(item.want);
        }
        let reply = self.run(inv).await?;
        let rest = reply.get(1..).ok_or_else(|| bad_reply("lease"))?;
        if rest.len() != items.len() * 6 {
            return Err(bad_reply("lease"));
        }
        Ok(rest
            .chunks_exact(6)
            .map(|c| Grant {
                granted: micros(c[0]),
                remaining: micros(c[1]),
                reset: micros(c[2]),
                window: micros(c[3]),
                valid: micros(c[4]),
                replayed: c[5] == 1,
            })
            .collect())
    }

    /// See [`super::Store::give_back`].
    pub async fn give_back(&self, items: &[ReturnItem]) -> Result<Vec<u64>, StoreError> {
        let mut inv = self.give_back.prepare_invoke();
        inv.arg(self.now_arg());
        for item in items {
            inv.key(&item.record).arg(item.tokens);
        }
        let reply = self.run(inv).await?;
        let rest = reply.get(1..).ok_or_else(|| bad_reply("return"))?;
        if rest.len() != items.len() {
            return Err(bad_reply("return"));
        }
        Ok(rest.iter().map(|v| micros(*v)).collect())
    }

    /// Sends `PING`.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let call = async {
            let mut conn = self.connection().await?;
            redis::cmd("PING")
                .query_async::<String>(&mut conn)
                .await
                .map_err(|e| StoreError::Unavailable(e.to_string()))
        };
        tokio::time::timeout(self.options.timeout, call).await.map_err(|_| StoreError::Timeout)?.map(|_| ())
    }
}
