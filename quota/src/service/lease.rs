//! `POST /v1/lease` (and its gRPC twin's leases): a call checked, planned
//! lease by lease against the limits, asked of the store in one call, and
//! each outcome turned into its wire answer.

use std::collections::HashMap;

use floodgate_core::time::Nanos;
use floodgate_protocol::MAX_LEASES;
use floodgate_protocol::{
    check_descriptors, check_lease_id, Code, LeaseGrant, LeaseRequest, LeaseResponse, LimitReport,
};

use super::{bad, between_stages, check_units, ApiError, Service};
use crate::config::{DescriptorRule, Domain, Limit};
use crate::store::{bucket_key, lease_key, BucketLease, Caller, IdInUse, LeaseOutcome, StoreFailure};

/// What becomes of one lease of a call before the store is asked.
enum Step {
    /// Answered without the store: no rule matches, or the rule is unlimited.
    Answered(Code),
    /// Asked of the store (the next of the plan's `asks`), under `limit`.
    Asked { limit: Limit, shadow: bool },
}

/// A lease call planned against the limits: one step per lease, in order,
/// and what the store is asked, in the order of the `Asked` steps.
struct Plan {
    steps: Vec<Step>,
    asks: Vec<BucketLease>,
}

impl Plan {
    /// The plan of `req` in `domain`, its records charged to `caller`.
    fn of(domain: &Domain, req: &LeaseRequest, caller: Option<Caller>) -> Self {
        let mut plan = Plan { steps: Vec::with_capacity(req.leases.len()), asks: Vec::new() };
        for lease in &req.leases {
            let step = match domain.rule_for(&lease.descriptor) {
                None => Step::Answered(Code::NoRule),
                Some(DescriptorRule::Unlimited) => Step::Answered(Code::Unlimited),
                // Shadow rules lease like any other: the tokens a lease hands
                // out must exist, or the total could pass the limit.
                Some(DescriptorRule::Limited { limit, shadow }) => {
                    plan.asks.push(BucketLease {
                        key: bucket_key(&domain.name, limit, &lease.descriptor),
                        limit: limit.clone(),
                        wanted: lease.wanted,
                        rate: lease.rate,
                        window: lease.window,
                        per_window: lease.per_window,
                        reported: lease.reported,
                        check: lease.check,
                        record: lease_key(&domain.name, &lease.id),
                        caller,
                    });
                    Step::Asked { limit: limit.clone(), shadow: *shadow }
                }
            };
            plan.steps.push(step);
        }
        plan
    }

    /// Which lease of the call the store's `ask`-th item is.
    fn lease_of_ask(&self, ask: usize) -> usize {
        let mut asked = self.steps.iter().enumerate().filter(|(_, step)| matches!(step, Step::Asked { .. }));
        asked.nth(ask).map_or(0, |(at, _)| at)
    }
}

/// Refuses a call the service cannot plan: too many leases, a bad
/// descriptor, id, count or rate, or an id given twice.
fn validate(req: &LeaseRequest) -> Result<(), ApiError> {
    check_descriptors("leases", MAX_LEASES, req.leases.iter().map(|l| &l.descriptor)).map_err(bad)?;
    // Each id's first place: a set, not a look back at every lease before
    // (that was 130,000 comparisons for a call of 512, a stretch of the
    // event loop every other call waited behind).
    let mut first_of: HashMap<&str, usize> = HashMap::with_capacity(req.leases.len());
    for (i, lease) in req.leases.iter().enumerate() {
        check_lease_id(&format!("leases[{i}].id"), &lease.id).map_err(bad)?;
        if let Some(first) = first_of.insert(lease.id.as_str(), i) {
            return Err(bad(format!("leases[{i}].id repeats leases[{first}].id: each lease needs its own id")));
        }
        check_units(&format!("leases[{i}].wanted"), lease.wanted)?;
        check_units(&format!("leases[{i}].reported"), lease.reported)?;
        if let Some(rate) = lease.rate {
            if !rate.is_finite() || rate < 0.0 {
                return Err(bad(format!("leases[{i}].rate must be a non-negative number of tokens per second")));
            }
        }
    }
    Ok(())
}

/// The wire answer of a lease the store was not asked about: all it asked
/// for, good for a lease lifetime `ttl` (nothing limits it).
fn answered(code: Code, wanted: u64, ttl: Nanos) -> LeaseGrant {
    LeaseGrant {
        code,
        granted: wanted,
        valid_ms: ttl.ceil_millis(),
        starts_ms: 0,
        report: LimitReport::default(),
        window: None,
        windows: 0,
        shadow: false,
        replayed: false,
        near_limit: false,
        checked: false,
        refused: None,
    }
}

/// The wire answer of a lease under `limit` that the store refused without
/// deciding it (`why`: its caller holds its share of the lease records):
/// nothing granted, the rule's numbers without the bucket's state, and a
/// lease lifetime `ttl` before asking again.
fn refused(limit: &Limit, shadow: bool, ttl: Nanos, why: &StoreFailure) -> LeaseGrant {
    LeaseGrant {
        code: Code::Ok,
        granted: 0,
        valid_ms: 0,
        starts_ms: 0,
        report: LimitReport {
            limit: Some(limit.limit()),
            window_ms: Some(limit.period().ceil_millis()),
            remaining: None,
            reset_ms: Some(ttl.ceil_millis()),
        },
        window: None,
        windows: 0,
        shadow,
        replayed: false,
        near_limit: false,
        checked: false,
        refused: Some(why.to_string()),
    }
}

impl LeaseOutcome {
    /// The wire answer of this outcome of a lease under `limit`.
    pub fn to_wire(&self, limit: &Limit, shadow: bool) -> LeaseGrant {
        LeaseGrant {
            code: Code::Ok,
            granted: self.granted,
            // Rounded down: a caller must stop using tokens no later than
            // the window they belong to ends.
            valid_ms: self.valid.floor_millis(),
            // Rounded up: never before the window they belong to starts.
            starts_ms: self.starts.ceil_millis(),
            report: LimitReport {
                limit: Some(limit.limit()),
                window_ms: Some(limit.period().ceil_millis()),
                remaining: Some(self.remaining),
                reset_ms: Some(self.reset.ceil_millis()),
            },
            window: Some(self.window),
            windows: self.windows,
            shadow,
            replayed: self.replayed,
            near_limit: self.near_limit,
            checked: self.checked,
            refused: None,
        }
    }
}

/// Until when a key is posted on the notice board after a lease that
/// `reported` units admitted without a lease got `outcome` under `limit`
/// at `now`: while it is near its limit, strict until the window after
/// this one has ended, as the caller is (`None`: not posted).
pub fn notice_until(outcome: &LeaseOutcome, reported: u64, limit: &Limit, now: Nanos) -> Option<Nanos> {
    (outcome.near_limit && reported > 0).then(|| now + outcome.reset + limit.period())
}

/// Where a lease call comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Origin {
    /// Its caller, where peers tell callers apart (see [`Caller`]): its
    /// records and notices are charged to it.
    pub caller: Option<Caller>,
    /// It is a caller of the call's domain (its domain's token, or an open
    /// domain; see `crate::auth::Tokens`): it reads the domain's near-limit
    /// notices and what it reports posts to them.
    pub of_domain: bool,
}

impl Service {
    /// `POST /v1/lease`: grant batches of tokens, sized to each caller's
    /// rate; their records are charged to the caller `from` (see [`Origin`]).
    pub async fn lease(&self, req: LeaseRequest, from: Origin) -> Result<LeaseResponse, ApiError> {
        validate(&req)?;
        let count = req.leases.len();
        let _turn = self.large_call(count).await;
        between_stages(count).await;
        let domains = self.domains();
        let domain = self.domain(&domains, &req.domain)?;
        let ttl = self.settings.lease_ttl;
        let plan = Plan::of(domain, &req, from.caller);
        between_stages(count).await;
        let outcomes = match plan.asks.is_empty() {
            true => Vec::new(),
            false => self
                .timed("lease", self.store.lease(&plan.asks, ttl))
                .await?
                .map_err(|in_use| id_in_use(&plan, &req, in_use))?,
        };
        if outcomes.len() != plan.asks.len() {
            return Err(ApiError::Store(StoreFailure::Unavailable("store answered for fewer buckets".into())));
        }
        between_stages(count).await;

        let mut outcomes = outcomes.into_iter();
        let mut leases = Vec::with_capacity(plan.steps.len());
        let mut granted_total = 0u64;
        // The notice board's clock: monotonic, from this instance's start.
        let since_start = Nanos::from(self.started.elapsed());
        for (step, lease) in plan.steps.iter().zip(&req.leases) {
            let grant = match step {
                Step::Answered(code) => {
                    let result = if *code == Code::Unlimited { "unlimited" } else { "no_rule" };
                    self.count(&domain.name, "lease", result);
                    answered(*code, lease.wanted, ttl)
                }
                Step::Asked { limit, shadow } => {
                    let outcome = outcomes.next().ok_or_else(|| {
                        ApiError::Store(StoreFailure::Unavailable("store answered for fewer buckets".into()))
                    })?;
                    let outcome = match outcome {
                        Ok(outcome) => outcome,
                        Err(why) => {
                            // Refused on its own (the caller's share of the
                            // records): the call's other leases stand.
                            let store = self.store().name();
                            self.metrics().store_errors.with_label_values(&[store, why.kind()]).inc();
                            leases.push(refused(limit, *shadow, ttl, &why));
                            continue;
                        }
                    };
                    self.count(&domain.name, "lease", if outcome.granted > 0 { "allowed" } else { "denied" });
                    if !outcome.replayed {
                        granted_total += outcome.granted;
                    }
                    if let Some(until) = notice_until(&outcome, lease.reported, limit, since_start) {
                        if from.of_domain {
                            self.notices.post_by(&domain.name, &lease.descriptor, until, from.caller, since_start);
                        }
                    }
                    outcome.to_wire(limit, *shadow)
                }
            };
            leases.push(grant);
        }
        // Every ask beside its answer, at `trace` level
        // (`RUST_LOG=floodgate_quota::service::lease=trace`): how one key's
        // pools are served, asked for and answered, call by call.
        if tracing::enabled!(tracing::Level::TRACE) {
            for (want, grant) in req.leases.iter().zip(&leases) {
                tracing::trace!(caller = ?from.caller, ?want, ?grant, "lease decided");
            }
        }
        self.metrics.tokens_granted.with_label_values(&[&domain.name]).inc_by(granted_total);
        let near = match req.notices && from.of_domain {
            true => self.notices.current(&domain.name, since_start),
            false => Vec::new(),
        };
        // The answer is written out next (as JSON): a stage of its own.
        between_stages(count).await;
        Ok(LeaseResponse { leases, near })
    }
}

/// The error of a call one of whose leases names, by its id, a lease
/// recorded for another descriptor: only the id is said, since the lease it
/// names may be another caller's, its descriptor values an address or a user.
fn id_in_use(plan: &Plan, req: &LeaseRequest, in_use: IdInUse) -> ApiError {
    let at = plan.lease_of_ask(in_use.index);
    let id = req.leases.get(at).map_or("", |l| l.id.as_str());
    ApiError::IdInUse(format!(
        "leases[{at}].id {id:?} is the id of a lease granted for another descriptor: a retry must \
         repeat the lease it retries, and a new lease needs an id of its own"
    ))
}
