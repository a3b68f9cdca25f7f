//! The quota service's logic, independent of HTTP: validate a request,
//! match its descriptors against the current limits, ask the store, and
//! build the wire response. A lease call has a file of its own (`lease`).

mod lease;

pub use lease::{notice_until, Origin};

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use floodgate_core::time::Nanos;
use floodgate_protocol::{
    check_descriptors, check_lease_id, CheckRequest, CheckResponse, CheckStatus, Code, LimitReport, Retry,
    ReturnRequest, ReturnResponse, MAX_DESCRIPTORS, MAX_LEASES, MAX_UNITS,
};

use crate::config::{DescriptorRule, Domain, Domains, Limit};
use crate::metrics::ServiceMetrics;
use crate::notices::NoticeBoard;
use crate::store::{bucket_key, lease_key, BucketCheck, LeaseReturn, QuotaStore, StoreFailure};

/// An error for the caller, with the HTTP status it maps to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApiError {
    /// 400: the request is malformed or out of bounds.
    BadRequest(String),
    /// 404: the domain is not configured.
    UnknownDomain(String),
    /// 422: a lease id names a recorded lease of another descriptor.
    IdInUse(String),
    /// 503: the store could not decide; the caller falls back.
    Store(StoreFailure),
}

impl ApiError {
    /// The HTTP status code.
    pub fn status(&self) -> u16 {
        match self {
            ApiError::BadRequest(_) => 400,
            ApiError::UnknownDomain(_) => 404,
            ApiError::IdInUse(_) => 422,
            ApiError::Store(_) => 503,
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ApiError::BadRequest(why) | ApiError::IdInUse(why) => write!(f, "{why}"),
            ApiError::UnknownDomain(name) => write!(f, "unknown domain {name:?}"),
            ApiError::Store(e) => write!(f, "{e}"),
        }
    }
}

/// Settings of the service.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// How long leased tokens stay valid (at most 60 s).
    pub lease_ttl: Nanos,
}

/// The longest lease lifetime: tokens should not outlive a proxy's view of
/// the limit for long. (What a restarted memory store owes a token bucket
/// is bounded by it: the core's own copy of the bound.)
pub const MAX_LEASE_TTL: Nanos = floodgate_core::lease::restart::LONGEST_LEASE_LIFETIME;

/// The service: current limits, a store, metrics.
#[derive(Debug)]
pub struct Service {
    domains: RwLock<Arc<Domains>>,
    store: QuotaStore,
    metrics: ServiceMetrics,
    settings: Settings,
    /// When a store failure was last logged (seconds since start): during an
    /// outage every request fails, and one line a second is enough.
    last_store_log: std::sync::atomic::AtomicU64,
    started: Instant,
    /// Keys found near their limit, for callers that admit keys without a lease.
    notices: NoticeBoard,
    /// Turns of the calls of more than a round's items (see [`LargeCall`]).
    large_calls: tokio::sync::Semaphore,
}

/// How many calls of more than a round's items ([`crate::store::ROUND_JOBS`])
/// are decided at once; the others wait, in order, doing nothing (parsed
/// already). A call of one lease then waits, at each of its turns on the
/// event loop, behind a stage of two such calls, not of every one a flood
/// has under way (eight connections sending calls of 512 leases kept the
/// event loop's queue eight stages long). Two: one decided while the other
/// has its round out at Redis.
const LARGE_CALLS: usize = 2;

/// A call of more than a round's items, holding one of the turns of
/// [`LARGE_CALLS`] while it is decided (`None`: a small call needs none).
pub(crate) type LargeCall<'a> = Option<tokio::sync::SemaphorePermit<'a>>;

/// Lets the other tasks run before the next stage of a call of more than a
/// round's items ([`crate::store::ROUND_JOBS`]): its reading, planning and
/// answering are each a stretch of work the event loop cannot interrupt
/// (hundreds of microseconds for 512 leases), and a call of one lease on
/// another connection should wait for one such stretch of each call under
/// way, not for all of them. A small call goes on without yielding.
pub(crate) async fn between_stages(items: usize) {
    if items > crate::store::ROUND_JOBS {
        tokio::task::yield_now().await;
    }
}

pub(crate) fn bad(message: impl Into<String>) -> ApiError {
    ApiError::BadRequest(message.into())
}

pub(crate) fn check_units(field: &str, value: u64) -> Result<(), ApiError> {
    if value > MAX_UNITS {
        return Err(bad(format!("{field} is {value}; at most {MAX_UNITS} is allowed")));
    }
    Ok(())
}

impl Service {
    /// A service over `store` with the limits of `domains`.
    pub fn new(domains: Domains, store: QuotaStore, metrics: ServiceMetrics, settings: Settings) -> Self {
        let settings = Settings { lease_ttl: settings.lease_ttl.clamp(Nanos::from_nanos(1), MAX_LEASE_TTL) };
        metrics.start(store.name(), store.failure_kinds());
        domains.names().for_each(|name| metrics.add_domain(name));
        Self {
            domains: RwLock::new(Arc::new(domains)),
            store,
            metrics,
            settings,
            last_store_log: std::sync::atomic::AtomicU64::new(u64::MAX),
            started: Instant::now(),
            notices: NoticeBoard::default(),
            large_calls: tokio::sync::Semaphore::new(LARGE_CALLS),
        }
    }

    /// A turn for a call of `items` if it is a large one (see [`LargeCall`]),
    /// once its turn comes.
    pub(crate) async fn large_call(&self, items: usize) -> LargeCall<'_> {
        if items <= crate::store::ROUND_JOBS {
            return None;
        }
        self.large_calls.acquire().await.ok()
    }

    /// The limits now in force.
    pub fn domains(&self) -> Arc<Domains> {
        self.domains.read().map_or_else(|p| p.into_inner().clone(), |c| c.clone())
    }

    /// Replaces the limits; counters are kept (they live in the store).
    pub fn set_domains(&self, domains: Domains) {
        domains.names().for_each(|name| self.metrics.add_domain(name));
        let mut slot = self.domains.write().unwrap_or_else(|p| p.into_inner());
        *slot = Arc::new(domains);
    }

    /// The metrics.
    pub fn metrics(&self) -> &ServiceMetrics {
        &self.metrics
    }

    /// The store.
    pub fn store(&self) -> &QuotaStore {
        &self.store
    }

    pub(crate) fn domain<'a>(&self, domains: &'a Domains, name: &str) -> Result<&'a Domain, ApiError> {
        domains.domain(name).ok_or_else(|| ApiError::UnknownDomain(name.to_string()))
    }

    pub(crate) fn count(&self, domain: &str, kind: &str, result: &str) {
        self.metrics.decisions.with_label_values(&[domain, kind, result]).inc();
    }

    pub(crate) async fn timed<T>(
        &self,
        op: &str,
        call: impl std::future::Future<Output = Result<T, StoreFailure>>,
    ) -> Result<T, ApiError> {
        let started = Instant::now();
        let result = call.await;
        let store = self.store.name();
        self.metrics.store_latency.with_label_values(&[store, op]).observe(started.elapsed().as_secs_f64());
        result.map_err(|e| {
            self.metrics.store_errors.with_label_values(&[store, e.kind()]).inc();
            let second = self.started.elapsed().as_secs();
            if self.last_store_log.swap(second, std::sync::atomic::Ordering::Relaxed) != second {
                tracing::warn!(store, op, error = %e, "store call failed (answering 503; logged at most once a second)");
            }
            ApiError::Store(e)
        })
    }

    /// `POST /v1/check`: admit the request only if every descriptor admits.
    pub async fn check(&self, req: CheckRequest) -> Result<CheckResponse, ApiError> {
        check_descriptors("descriptors", MAX_DESCRIPTORS, req.descriptors.iter()).map_err(bad)?;
        check_units("hits", req.hits)?;
        let domains = self.domains();
        let domain = self.domain(&domains, &req.domain)?;

        // One store item per distinct bucket: a descriptor listed twice costs
        // twice, in one decision (two separate decisions on the same state
        // would both see the same room and over-admit).
        let mut items: Vec<BucketCheck> = Vec::new();
        let mut index_of: HashMap<String, usize> = HashMap::new();
        let mut slots: Vec<Result<usize, Code>> = Vec::with_capacity(req.descriptors.len());
        for descriptor in &req.descriptors {
            match domain.rule_for(descriptor) {
                None => slots.push(Err(Code::NoRule)),
                Some(DescriptorRule::Unlimited) => slots.push(Err(Code::Unlimited)),
                Some(DescriptorRule::Limited { limit, shadow }) => {
                    let key = bucket_key(&domain.name, limit, descriptor);
                    let at = *index_of.entry(key.clone()).or_insert_with(|| {
                        items.push(BucketCheck { key, limit: limit.clone(), cost: 0, shadow: *shadow });
                        items.len() - 1
                    });
                    if let Some(item) = items.get_mut(at) {
                        item.cost += req.hits;
                    }
                    slots.push(Ok(at));
                }
            }
        }
        let outcome = if items.is_empty() { None } else { Some(self.timed("check", self.store.check(&items)).await?) };

        let mut results = Vec::with_capacity(slots.len());
        let mut wait: Option<Retry> = None;
        for slot in slots {
            let at = match slot {
                Err(code) => {
                    self.count(&domain.name, "check", if code == Code::Unlimited { "unlimited" } else { "no_rule" });
                    results.push(CheckStatus {
                        code,
                        report: LimitReport::default(),
                        retry_after_ms: None,
                        shadow_over_limit: false,
                    });
                    continue;
                }
                Ok(at) => at,
            };
            let (Some(item), Some(decision)) = (items.get(at), outcome.as_ref().and_then(|o| o.decisions.get(at)))
            else {
                return Err(ApiError::Store(StoreFailure::Unavailable("store answered for fewer buckets".into())));
            };
            let denied = !decision.allowed();
            let retry = match decision.retry_after() {
                Nanos::NEVER => Retry::Never,
                wait => Retry::After(wait.ceil_millis()),
            };
            let (code, retry_after_ms, shadow_over_limit) = match (denied, item.shadow) {
                (false, _) => (Code::Ok, None, false),
                (true, true) => (Code::Ok, None, true),
                (true, false) => {
                    wait = Some(match (wait, retry) {
                        (Some(Retry::Never), _) | (_, Retry::Never) => Retry::Never,
                        (Some(Retry::After(a)), Retry::After(b)) => Retry::After(a.max(b)),
                        (None, r) => r,
                    });
                    (Code::OverLimit, Some(retry), false)
                }
            };
            self.count(
                &domain.name,
                "check",
                match (code, shadow_over_limit) {
                    (Code::OverLimit, _) => "denied",
                    (_, true) => "shadow_denied",
                    _ => "allowed",
                },
            );
            results.push(CheckStatus {
                code,
                report: LimitReport {
                    limit: Some(item.limit.limit()),
                    window_ms: Some(item.limit.period().ceil_millis()),
                    remaining: Some(decision.remaining),
                    reset_ms: Some(decision.reset.ceil_millis()),
                },
                retry_after_ms,
                shadow_over_limit,
            });
        }
        let allowed = outcome.as_ref().is_none_or(|o| o.committed);
        Ok(CheckResponse { allowed, retry_after_ms: if allowed { None } else { wait }, results })
    }

    /// `POST /v1/return`: take back unused tokens of leases, named by id.
    pub async fn give_back(&self, req: ReturnRequest) -> Result<ReturnResponse, ApiError> {
        if req.returns.is_empty() {
            return Err(bad("returns must not be empty"));
        }
        if req.returns.len() > MAX_LEASES {
            return Err(bad(format!("returns has {} items; at most {MAX_LEASES} are allowed", req.returns.len())));
        }
        for (i, item) in req.returns.iter().enumerate() {
            check_lease_id(&format!("returns[{i}].id"), &item.id).map_err(bad)?;
            check_units(&format!("returns[{i}].tokens"), item.tokens)?;
        }
        let _turn = self.large_call(req.returns.len()).await;
        between_stages(req.returns.len()).await;
        let domains = self.domains();
        let domain = self.domain(&domains, &req.domain)?;
        let items: Vec<LeaseReturn> = req
            .returns
            .iter()
            .map(|r| LeaseReturn { record: lease_key(&domain.name, &r.id), tokens: r.tokens })
            .collect();
        let limit_now = |bucket: &str| limit_of_bucket(domain, bucket);
        let outcomes = self.timed("return", self.store.give_back(&items, &limit_now)).await?;
        if outcomes.len() != items.len() {
            return Err(ApiError::Store(StoreFailure::Unavailable("store answered for fewer leases".into())));
        }
        between_stages(items.len()).await;
        let returned: Vec<u64> = outcomes.iter().map(|o| o.returned).collect();
        // A replay repeats what its return gave back: counted once, then.
        let new: u64 = outcomes.iter().filter(|o| !o.replayed).map(|o| o.returned).sum();
        self.metrics.tokens_returned.with_label_values(&[&domain.name]).inc_by(new);
        Ok(ReturnResponse { returned, replayed: outcomes.iter().map(|o| o.replayed).collect() })
    }
}

/// The limit in force now for the bucket stored under `key` in `domain`
/// (see [`bucket_key`]): the rule its descriptor matches, if it is still of
/// the bucket's algorithm.
fn limit_of_bucket(domain: &Domain, key: &str) -> Option<Limit> {
    let rest = key.strip_prefix("fg:{")?.strip_prefix(domain.name.as_str())?.strip_prefix("}:")?;
    let (_, entries) = rest.split_once(':')?;
    let descriptor: Vec<(String, String)> = serde_json::from_str(entries).ok()?;
    match domain.rule_for(&descriptor)? {
        DescriptorRule::Limited { limit, .. } if bucket_key(&domain.name, limit, &descriptor) == key => {
            Some(limit.clone())
        }
        _ => None,
    }
}
