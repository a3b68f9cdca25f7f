//! A validated limit: one of the core's algorithms (those the service
//! offers), built by the core from a rule of the limits file.

use std::fmt;
use std::sync::Arc;

use floodgate_core::algorithm::{Params, Policy, Registration, ALGORITHMS};
use floodgate_core::lease::bucket::KeyLimit;
use floodgate_core::time::Nanos;
use serde_json::{Map, Value};

/// The algorithm of a rule without `algorithm`: a fixed window, as
/// envoyproxy/ratelimit counts.
pub const DEFAULT_ALGORITHM: &str = "fixed_window";

/// The algorithms the service offers: the core's, except those that can
/// only run in the proxy (their registration says why).
pub fn offered_algorithms() -> impl Iterator<Item = &'static Registration> {
    ALGORITHMS.iter().filter(|r| r.local_only.is_none())
}

/// The registration of algorithm `name`, or why the service does not offer it.
pub(super) fn offered(name: &str) -> Result<&'static Registration, String> {
    match Registration::find(name) {
        Some(registration) => match registration.local_only {
            None => Ok(registration),
            Some(why) => Err(format!("algorithm {name:?} is not offered by the quota service: {why}")),
        },
        None => Err(format!(
            "unknown algorithm {name:?}: the quota service supports {DEFAULT_ALGORITHM} (the default), {}",
            offered_algorithms().map(|r| r.name).filter(|n| *n != DEFAULT_ALGORITHM).collect::<Vec<_>>().join(", ")
        )),
    }
}

/// The core's name for the field the limits file calls `unit`.
const PERIOD: &str = "period";

/// Every offered algorithm's own fields (`burst`, `warmup`…), once each, in
/// registry order: what a limits file may write beside `unit` and
/// `requests_per_unit`, for the core to validate.
pub(super) fn algorithm_fields() -> Vec<&'static str> {
    let mut fields: Vec<&'static str> = Vec::new();
    for field in offered_algorithms().flat_map(|r| r.fields.iter().copied()) {
        if field != PERIOD && !fields.contains(&field) {
            fields.push(field);
        }
    }
    fields
}

/// A validated limit (cheap to clone): one of the core's algorithms, built by the core from
/// the rule (`requests_per_unit` is its `limit`, `unit` its `period`, the
/// algorithm's own fields as written), and what is needed to build it again
/// (lease records keep it, so a return is decided under the limit its lease
/// was granted under).
#[derive(Clone)]
pub struct Limit {
    algorithm: &'static Registration,
    limit: u64,
    period: Nanos,
    /// The algorithm's own fields (`burst`, `sub_windows`…), as JSON.
    fields: Arc<str>,
    policy: Arc<dyn Policy>,
}

impl Limit {
    /// Builds the offered algorithm named `algorithm` admitting `limit`
    /// units per `period` (whole milliseconds), with its own `fields` (a JSON
    /// object, e.g. `{"burst": 5}`), validated by the core. The error names
    /// the field as the limits file does.
    pub fn new(algorithm: &str, limit: u64, period: Nanos, fields: &str) -> Result<Self, String> {
        let registration = offered(algorithm)?;
        let mut params = own_fields(registration, fields)?;
        let fields: Arc<str> = serde_json::Value::Object(params.clone()).to_string().into();
        params.insert(PERIOD.into(), period_in_millis(period)?.into());
        let policy = registration
            .build(Params::new(RULE, limit, params))
            .map_err(|e| as_in_the_file(registration, &e.field, &e.message))?;
        Ok(Self { algorithm: registration, limit, period, fields, policy })
    }

    /// The algorithm's registration in the core.
    pub fn algorithm(&self) -> &'static Registration {
        self.algorithm
    }

    /// Units per period (`requests_per_unit`).
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The period (the `unit`).
    pub fn period(&self) -> Nanos {
        self.period
    }

    /// The algorithm's own fields as JSON (`{}` when none).
    pub fn fields(&self) -> &str {
        &self.fields
    }

    /// The most units one decision can take (`burst` for the bucket
    /// algorithms, `requests_per_unit` for the window and log algorithms).
    pub fn capacity(&self) -> u64 {
        self.policy.capacity()
    }

    /// The core's algorithm, ready to decide on stored bytes.
    pub fn policy(&self) -> &dyn Policy {
        self.policy.as_ref()
    }

    /// The limit as the core's lease rules see it.
    pub fn key_limit(&self) -> KeyLimit<'_> {
        KeyLimit { policy: self.policy(), tag: self.algorithm.tag, limit: self.limit, period: self.period }
    }
}

/// Where [`Limit::new`] says the core's errors are (stripped again).
const RULE: &str = "rate_limit";

/// The algorithm's own `fields` (a JSON object), each one it takes (the
/// period is the file's `unit`, never one of them).
fn own_fields(registration: &Registration, fields: &str) -> Result<Map<String, Value>, String> {
    let params: Map<String, Value> =
        serde_json::from_str(fields).map_err(|e| format!("algorithm fields {fields:?}: {e}"))?;
    for field in params.keys() {
        if !registration.fields.contains(&field.as_str()) || field == PERIOD {
            let takes: Vec<&str> = registration.fields.iter().copied().filter(|f| *f != PERIOD).collect();
            let takes = if takes.is_empty() { "no other fields".to_string() } else { takes.join(", ") };
            return Err(format!("{field} does not apply to algorithm {} (it takes {takes})", registration.name));
        }
    }
    Ok(params)
}

/// `period` as the core's duration text, in whole milliseconds (the unit
/// the limits file's periods and the wire's both count in).
fn period_in_millis(period: Nanos) -> Result<String, String> {
    let millis = Nanos::from_millis(1);
    if period == Nanos::ZERO || period % millis != Nanos::ZERO {
        return Err(format!("the period must be a positive whole number of milliseconds, not {period}"));
    }
    Ok(format!("{}ms", period / millis))
}

/// A core error on `field` (under [`RULE`]) named as the limits file names
/// the field: `limit` is `requests_per_unit`, `period` is `unit`.
fn as_in_the_file(registration: &Registration, field: &str, message: &str) -> String {
    let field = field.strip_prefix(RULE).unwrap_or(field).trim_start_matches('.');
    match field {
        "" => format!("{message} (algorithm {})", registration.name),
        "limit" => format!("requests_per_unit: {message}"),
        PERIOD => format!("unit: {message}"),
        field => format!("{field}: {message}"),
    }
}

impl PartialEq for Limit {
    /// Same inputs, same algorithm.
    fn eq(&self, other: &Self) -> bool {
        (self.algorithm.name, self.limit, self.period, &*self.fields)
            == (other.algorithm.name, other.limit, other.period, &*other.fields)
    }
}

impl Eq for Limit {}

impl fmt::Debug for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limit")
            .field("algorithm", &self.algorithm.name)
            .field("limit", &self.limit)
            .field("period", &self.period)
            .field("fields", &self.fields)
            .finish()
    }
}
