//! Where counters live: in this process ([`LocalStore`]) or in Redis
//! ([`RedisStore`]), each a [`Backend`] registered in [`BACKENDS`]. The
//! stores only keep bytes under keys; every decision is made by one Rust
//! code path ([`decide`], the core's algorithms), inside a store
//! transaction: the memory store runs it under its shard locks, the Redis
//! store between one read and one compare-and-swap write (retried when a key
//! changed meanwhile). So every store decides identically. Transactions are
//! ordered per key by one implementation ([`lanes`]) and the calls (a check
//! of several keys, a call of many leases, returns) are made of them in one
//! place (`calls.rs`).

mod backend;
mod calls;
pub mod decide;
mod lanes;
mod memory;
mod redis;
mod shares;

pub use self::backend::{Backend, BackendRegistration, BoxFuture, Finisher, Rounds, StoreOptions, ROUND_JOBS};
pub use self::calls::lease_on;
pub use self::decide::{Kind, Next};
pub use self::lanes::Batch;
pub use self::memory::LocalStore;
pub use self::redis::{RedisOptions, RedisStore, CLUSTER_SCHEME};
pub use self::shares::{shares_key, ShareAnswer, ShareReport, ShareReports, Timings};

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;
use std::sync::Arc;

use floodgate_core::algorithm::Decision;
use floodgate_core::time::Nanos;

use crate::config::Limit;

/// The store key of a bucket: the domain as a Redis Cluster hash tag (every
/// bucket one call touches must sit in one slot for the script to be atomic),
/// the algorithm's key (buckets of different algorithms hold different
/// state; see `Registration::key`), and the descriptor's entries as JSON
/// (unambiguous whatever the values contain).
pub fn bucket_key(domain: &str, limit: &Limit, entries: &[(String, String)]) -> String {
    let entries = serde_json::to_string(entries).unwrap_or_default();
    format!("fg:{{{domain}}}:{}:{entries}", limit.algorithm().key)
}

/// How long a lease's record outlives the lease: a caller may retry an
/// ambiguous lease, or return its unused tokens, until then.
pub const LEASE_RECORD_MARGIN: Nanos = Nanos::from_secs(30);

/// The store key of a lease's record: in the domain's hash tag (beside the
/// buckets it names), then the caller's id (`A-Za-z0-9_-`, so it cannot
/// look like a bucket key).
pub fn lease_key(domain: &str, id: &str) -> String {
    format!("fg:{{{domain}}}:lease:{id}")
}

/// The store key of what `caller` holds of the bucket `bucket` in
/// allowances (see `floodgate_core::lease::holding`): in the bucket's hash
/// tag, a hash of the caller (no address in a key name), then the bucket
/// key's algorithm and descriptor.
pub fn holding_key(bucket: &str, caller: Caller) -> String {
    let (tag, rest) = bucket.split_once("}:").unwrap_or((bucket, ""));
    let mut hasher = floodgate_core::hash::SipHasher::new(0x686f_6c64_696e_6773, 0x6f66_2063_616c_6c65);
    match caller.0 {
        IpAddr::V4(v4) => hasher.write(&v4.octets()),
        IpAddr::V6(v6) => hasher.write(&v6.octets()),
    }
    format!("{tag}}}:hold:{:016x}:{rest}", hasher.finish())
}

/// One bucket of a check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketCheck {
    /// See [`bucket_key`].
    pub key: String,
    /// The rule's limit.
    pub limit: Limit,
    /// Units to take.
    pub cost: u64,
    /// Shadow mode: a denial here does not block the others.
    pub shadow: bool,
}

/// Who a call comes from, as far as the service can tell callers apart: the
/// peer address of its connection, an IPv6 address by its /64 (a host is
/// given a whole /64, so its addresses are one caller however many it
/// uses). A store of bounded room (the memory store) charges each lease
/// record to its caller, so that one caller cannot take the room from every
/// other one, while a hot key leased by a fleet of Envoys (each its own
/// address) is not bounded as one caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Caller(pub IpAddr);

impl Caller {
    /// The caller a connection from `address` is: an IPv4 address (also
    /// written as an IPv4-mapped IPv6 one), or an IPv6 address's /64.
    pub fn of(address: IpAddr) -> Self {
        match address {
            IpAddr::V4(v4) => Caller(IpAddr::V4(v4)),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Caller(IpAddr::V4(v4)),
                None => {
                    let mut octets = v6.octets();
                    octets[8..].fill(0);
                    Caller(IpAddr::V6(octets.into()))
                }
            },
        }
    }
}

/// One bucket of a lease.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketLease {
    /// See [`bucket_key`].
    pub key: String,
    /// The rule's limit.
    pub limit: Limit,
    /// The most tokens the caller wants.
    pub wanted: u64,
    /// The caller's observed consumption, tokens per second.
    pub rate: Option<f64>,
    /// The window the caller wants tokens of: the next one is leased ahead
    /// (see `decide::lease`); `None` for the window that counts now.
    pub window: Option<u64>,
    /// The caller can hold an allowance (see `decide::lease`).
    pub per_window: bool,
    /// Units the caller admitted without a lease, counted before the lease
    /// is decided (see `decide::lease`).
    pub reported: u64,
    /// A cold pair's wait: `wanted` decided as a check, with no record
    /// (see `floodgate_core::lease::grant::grant`).
    pub check: bool,
    /// See [`lease_key`]: where the grant is recorded, atomically with it. A
    /// lease whose record exists is not granted again but answered from it.
    pub record: String,
    /// Whom the record is charged to (see [`Caller`]); `None` where peer
    /// addresses do not tell callers apart (`--max-connections-per-peer 0`,
    /// behind a proxy): then only the records' room as a whole bounds it.
    pub caller: Option<Caller>,
}

/// What one lease got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseOutcome {
    /// Tokens granted (0 when nothing is left).
    pub granted: u64,
    /// Tokens left in the bucket after the grant.
    pub remaining: u64,
    /// Time until more quota becomes available.
    pub reset: Nanos,
    /// The algorithm's window the tokens are counted in (0 for algorithms
    /// without windows).
    pub window: u64,
    /// For an allowance, how many windows from `window` on it holds
    /// `granted` tokens in (0: a lease of one window).
    pub windows: u64,
    /// How long (from now) the caller may use the tokens.
    pub valid: Nanos,
    /// How long until they may be used: zero, or for a lease ahead, the
    /// time until the window they are for starts.
    pub starts: Nanos,
    /// The lease was already recorded: this repeats its grant, nothing was taken.
    pub replayed: bool,
    /// The key has used most of its limit (see `decide::Leased::near_limit`).
    pub near_limit: bool,
    /// Decided as a check: nothing was recorded, nothing is to be returned.
    pub checked: bool,
}

/// What a lease call got: every lease's outcome (or, for a lease refused
/// for want of room in its caller's share of the lease records, that
/// refusal: nothing was taken for it), or, when a lease's id is that of a
/// recorded lease of another bucket, which lease that is (and nothing was
/// taken).
pub type LeaseAnswer = Result<Vec<Result<LeaseOutcome, StoreFailure>>, IdInUse>;

/// A lease whose id names a lease recorded for another bucket (another
/// descriptor, or another rule's algorithm): not a retry of it. (Which
/// bucket is not said: it is another caller's, its descriptor values an
/// address or a user.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdInUse {
    /// Which lease of the call.
    pub index: usize,
}

/// What one return took back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReturnOutcome {
    /// Tokens taken back.
    pub returned: u64,
    /// The lease had been returned already (by this return's first
    /// attempt, say): this one took back nothing more.
    pub replayed: bool,
}

/// Unused leased tokens to give back: once per lease, at most what it
/// granted, and only where the tokens still count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseReturn {
    /// The lease's record (see [`lease_key`]).
    pub record: String,
    /// Tokens to give back.
    pub tokens: u64,
}

/// The result of a check: whether the costs were taken, and each bucket's
/// decision (the core's: `retry_after` is `Nanos::NEVER` for never).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckOutcome {
    /// True when every non-shadow bucket admitted and the costs were taken.
    pub committed: bool,
    /// One per item, in order. When not committed, buckets that would have
    /// admitted report their untouched state.
    pub decisions: Vec<Decision>,
}

/// Why the store could not decide. Every variant maps to 503: the caller
/// falls back to its local limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreFailure {
    /// The store did not answer within the configured time.
    Timeout,
    /// The store answered with an error or could not be reached.
    Unavailable(String),
    /// The memory store has no room for a new entry of this kind.
    Full(Room),
    /// Every attempt lost a race: another writer changed a key in between.
    Contended,
    /// This instance's clock (`--redis-clock local`) is further from
    /// Redis's than decisions can tolerate: it does not decide.
    ClockOff {
        /// This clock minus Redis's, in milliseconds.
        offset_ms: i64,
        /// The most tolerated, in milliseconds.
        bound_ms: u64,
    },
}

/// Which room of the memory store is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Room {
    /// Buckets (`--memory-max-buckets`).
    Buckets,
    /// Lease records (as many as buckets).
    Records,
    /// One caller's share of the lease records' room.
    CallerRecords,
}

impl fmt::Display for StoreFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreFailure::Timeout => write!(f, "the store did not answer in time"),
            StoreFailure::Unavailable(why) => write!(f, "the store is unavailable: {why}"),
            StoreFailure::Full(Room::Buckets) => {
                write!(f, "the memory store is full: every bucket it has room for is in use")
            }
            StoreFailure::Full(Room::Records) => {
                write!(f, "the memory store's room for lease records is full: every record is of a live lease")
            }
            StoreFailure::Full(Room::CallerRecords) => write!(
                f,
                "the lease records of this caller (its peer address) fill its share of the memory store's room \
                 for them (four times the room left free): its new leases are refused until some expire"
            ),
            StoreFailure::Contended => write!(f, "the store is busy: the buckets kept changing under every attempt"),
            StoreFailure::ClockOff { offset_ms, bound_ms } => write!(
                f,
                "this instance's clock is {offset_ms} ms from Redis's, more than the {bound_ms} ms \
                 --redis-clock local tolerates: it does not decide (fix the clock, or use --redis-clock redis)"
            ),
        }
    }
}

impl std::error::Error for StoreFailure {}

impl StoreFailure {
    /// A short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreFailure::Timeout => "timeout",
            StoreFailure::Unavailable(_) => "unavailable",
            StoreFailure::Full(_) => "full",
            StoreFailure::Contended => "contended",
            StoreFailure::ClockOff { .. } => "clock",
        }
    }
}

/// Every backend `--store` can name: a new one is its own file and one
/// line here.
pub const BACKENDS: &[BackendRegistration] = &[memory::REGISTRATION, redis::REGISTRATION];

/// `--store`, parsed once: which backend, at which address.
#[derive(Debug, Clone)]
pub struct StoreSpec {
    /// The backend.
    pub backend: &'static BackendRegistration,
    address: String,
}

impl FromStr for StoreSpec {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match BACKENDS.iter().find(|b| (b.accepts)(text)) {
            Some(backend) => Ok(StoreSpec { backend, address: text.to_string() }),
            None => {
                let usages: Vec<&str> = BACKENDS.iter().map(|b| b.usage).collect();
                Err(format!("must be {}, not {text:?}", usages.join(" or ")))
            }
        }
    }
}

impl StoreSpec {
    /// Opens the store.
    pub fn open(&self, options: &StoreOptions) -> Result<QuotaStore, String> {
        Ok(QuotaStore::new((self.backend.open)(&self.address, options)?))
    }
}

/// The configured store: a backend, the lanes ordering its transactions,
/// and the rounds gathering the batches ready to run.
#[derive(Debug, Clone)]
pub struct QuotaStore {
    backend: Arc<dyn Backend>,
    lanes: Arc<lanes::Lanes>,
    rounds: Arc<Rounds>,
}

impl QuotaStore {
    /// The store of `backend`.
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        let lanes = Arc::new(lanes::Lanes::default());
        let rounds = Rounds::new(Arc::clone(&backend), Arc::clone(&lanes));
        QuotaStore { backend, lanes, rounds }
    }

    /// The backend.
    pub fn backend(&self) -> &dyn Backend {
        &*self.backend
    }

    /// The backend as its own type, if it is a `B`.
    pub fn backend_as<B: Backend>(&self) -> Option<&B> {
        self.backend.as_any().downcast_ref::<B>()
    }

    /// See [`Backend::failure_kinds`].
    pub fn failure_kinds(&self) -> &'static [&'static str] {
        self.backend.failure_kinds()
    }

    /// See [`Backend::name`].
    pub fn name(&self) -> &'static str {
        self.backend.name()
    }

    /// Whether the store answers now.
    pub async fn ping(&self) -> Result<(), StoreFailure> {
        self.backend.ping().await
    }

    /// Drops what is no longer needed, step by step (see
    /// [`Backend::sweep_step`]), letting the runtime's other tasks run
    /// between steps: a mass expiry (a million lease records ending within
    /// seconds) never holds the thread that serves requests for the whole
    /// sweep. Returns how many entries it dropped.
    pub async fn sweep(&self) -> usize {
        let mut dropped = 0;
        loop {
            let (step, more) = self.backend.sweep_step();
            dropped += step;
            if !more {
                return dropped;
            }
            tokio::task::yield_now().await;
        }
    }

    /// Runs transactions, each: read its keys, let `decide` (given their
    /// bytes, `None` when absent, and now) answer and say what to write (one
    /// slot per key, `None`: unchanged), and write it, all or nothing, as if
    /// alone. Each is ordered on its keys after those before it (see
    /// [`lanes`]); they are independent of each other. Returns each answer.
    async fn transact<A: Send + 'static>(
        &self,
        items: Vec<(Vec<String>, lanes::Decider<A>)>,
    ) -> Vec<Result<A, StoreFailure>> {
        let deadline = self.backend.deadline();
        let call = self.lanes.call(items.len());
        let mut waits = Vec::with_capacity(items.len());
        let mut items = items.into_iter().peekable();
        while items.peek().is_some() {
            let mut jobs = Vec::with_capacity(ROUND_JOBS);
            for (keys, decide) in items.by_ref().take(ROUND_JOBS) {
                let group = keys.first().map(|k| group_of(k).to_string()).unwrap_or_default();
                let (job, outcome, answer) = lanes::job(keys, group, deadline, decide);
                jobs.push(job);
                waits.push((outcome, answer));
            }
            // Each part starts as it is queued: a part's batches hold their
            // lanes, and a caller that leaves at the yield below must not
            // leave them held.
            self.rounds.start(self.lanes.submit_part(call, jobs)).await;
            if items.peek().is_some() {
                // The other tasks run between parts (see `Lanes::submit_part`).
                tokio::task::yield_now().await;
            }
        }
        let mut answers = Vec::with_capacity(waits.len());
        for (outcome, answer) in waits {
            let answered = lanes::answer(outcome, &answer);
            answers.push(match deadline {
                // Answered `timeout` then, decided or not (a 503: maybe applied).
                Some(deadline) => {
                    tokio::time::timeout_at(deadline, answered).await.unwrap_or(Err(StoreFailure::Timeout))
                }
                None => answered.await,
            });
        }
        answers
    }

    /// One transaction (see [`QuotaStore::transact`]).
    async fn transact_one<A: Send + 'static>(
        &self,
        keys: Vec<String>,
        decide: impl FnMut(&[Option<Vec<u8>>], Nanos) -> (A, Writes) + Send + 'static,
    ) -> Result<A, StoreFailure> {
        let mut answers = self.transact(vec![(keys, Box::new(decide) as lanes::Decider<A>)]).await;
        answers.pop().unwrap_or_else(|| Err(StoreFailure::Unavailable("no answer".into())))
    }
}

/// The group of a key: the Redis Cluster hash tag (the domain), the part
/// between the first `{` and the next `}` when not empty, else the whole key.
/// Transactions of different groups never share a store transaction.
pub fn group_of(key: &str) -> &str {
    key.split_once('{')
        .and_then(|(_, rest)| rest.split_once('}'))
        .map(|(tag, _)| tag)
        .filter(|tag| !tag.is_empty())
        .unwrap_or(key)
}

/// What a transaction writes: per key, the new bytes and when they become
/// idle (`None`: leave the key as it is).
pub type Writes = Vec<Option<Next>>;

#[cfg(test)]
mod tests {
    use super::*;

    /// A call of hundreds of transactions is queued in parts of a round's,
    /// the other tasks let run between them: another task never finds more
    /// than a part of it queued and undecided (queueing all 512 at once held
    /// the thread for up to 1.5 ms).
    #[tokio::test(flavor = "current_thread")]
    async fn a_large_call_is_queued_in_parts() {
        let clock = Arc::new(floodgate_core::time::FakeClock::new(Nanos::from_secs(1_700_000_000)));
        let store = Arc::new(QuotaStore::new(Arc::new(memory::LocalStore::new(clock, 10_000))));
        let decided = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let items: Vec<(Vec<String>, lanes::Decider<()>)> = (0..512)
            .map(|n| {
                let decided = Arc::clone(&decided);
                let decide = move |_: &[Option<Vec<u8>>], _| {
                    decided.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    ((), vec![None])
                };
                (vec![format!("key-{n}")], Box::new(decide) as lanes::Decider<()>)
            })
            .collect();
        let call = tokio::spawn({
            let store = Arc::clone(&store);
            async move { store.transact(items).await }
        });
        let mut most_undecided = 0;
        while !call.is_finished() {
            let undecided = store.lanes.queued() - decided.load(std::sync::atomic::Ordering::Relaxed);
            most_undecided = most_undecided.max(undecided);
            tokio::task::yield_now().await;
        }
        assert!(call.await.unwrap().iter().all(Result::is_ok));
        assert_eq!(decided.load(std::sync::atomic::Ordering::Relaxed), 512);
        assert!(
            0 < most_undecided && most_undecided <= ROUND_JOBS as u64,
            "{most_undecided} queued and undecided at once"
        );
    }

    #[test]
    fn store_addresses_name_their_backend_once() {
        let backend = |text: &str| text.parse::<StoreSpec>().map(|spec| spec.backend.name);
        assert_eq!(backend("memory"), Ok("memory"));
        for address in ["redis://127.0.0.1:6379/0", "rediss://h:1/", "redis+unix:///tmp/r.sock", "redis+cluster://h:1"]
        {
            assert_eq!(backend(address), Ok("redis"), "{address}");
        }
        let refused = backend("memcached://h:1").unwrap_err();
        assert!(refused.starts_with("must be `memory` or a redis:// URL"), "{refused}");
        assert!(refused.contains("memcached"), "{refused}");
    }

    #[test]
    fn a_caller_is_an_ipv4_address_or_an_ipv6_slash_64() {
        let of = |text: &str| Caller::of(text.parse().unwrap_or(IpAddr::from([0, 0, 0, 0])));
        assert_eq!(of("10.0.0.7"), of("::ffff:10.0.0.7"), "an IPv4-mapped address is its IPv4 one");
        assert_ne!(of("10.0.0.7"), of("10.0.0.8"));
        assert_eq!(of("2001:db8:1:2::1"), of("2001:db8:1:2:ffff:ffff:ffff:ffff"), "one /64, one caller");
        assert_eq!(of("2001:db8:1:2:3:4:5:6"), Caller("2001:db8:1:2::".parse().unwrap_or(IpAddr::from([0; 16]))));
        assert_ne!(of("2001:db8:1:2::1"), of("2001:db8:1:3::1"), "another /64, another caller");
    }

    #[test]
    fn a_holding_sits_beside_its_bucket_and_names_no_address() {
        let caller = Caller::of(IpAddr::from([10, 0, 0, 7]));
        let key = holding_key(r#"fg:{edge}:fw:[["user","a}:b"]]"#, caller);
        assert!(key.starts_with("fg:{edge}:hold:") && key.ends_with(r#":fw:[["user","a}:b"]]"#), "{key}");
        assert_eq!(group_of(&key), "edge");
        assert!(!key.contains("10.0.0.7"));
        assert_ne!(key, holding_key(r#"fg:{edge}:fw:[["user","a}:b"]]"#, Caller::of(IpAddr::from([10, 0, 0, 8]))));
    }

    #[test]
    fn a_keys_group_is_its_hash_tag() {
        assert_eq!(group_of(r#"fg:{edge}:fw:[["k","{v}"]]"#), "edge");
        assert_eq!(group_of("fg:{}x}:lease:a"), "fg:{}x}:lease:a");
    }
}
