//! Configuration of global mode: the top-level `global` section (which
//! quota service to ask, and how) and a global rule's own fields (`mode`,
//! `fallback`). Parsed strictly, like the rest of the configuration; every
//! error names the field and the value.

use std::sync::Arc;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::algorithm::{Params, Registration, ALGORITHMS};
use crate::error::ConfigError;
use crate::lease::overshoot::{Overshoot, MAX_OVERSHOOT};
use crate::lease::pool::LeasePool;
use crate::lease::refresh::RefreshPolicy;
use crate::table::Table;
use crate::time::{parse_duration, Nanos, SECOND};

/// Stored groups of lease pools carry this tag (never a registered
/// algorithm's); it changes with the pool's state layout (203: the state's
/// parts each in a run of words of their own; 202: what the overshoot
/// budget admitted; 201: a lease's start and window), so a layout of
/// another release is never misread: its pools start afresh.
pub const POOL_TAG: u8 = 203;

/// The top-level `global` section as written.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawService {
    cluster: String,
    authority: Option<String>,
    domain: String,
    timeout: Option<String>,
    token: Option<String>,
    max_wait: Option<String>,
    lease_horizon: Option<String>,
}

/// The quota service every global rule asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaService {
    /// The Envoy cluster the callouts go to.
    pub cluster: String,
    /// The callouts' `:authority`.
    pub authority: String,
    /// The limits domain (the service's limits file).
    pub domain: String,
    /// The longest a callout may take; a slower one is a failure.
    pub timeout: Nanos,
    /// Sent as `Authorization: Bearer <token>` when set.
    pub token: Option<String>,
    /// How long a request that finds its pool empty waits for the refresh.
    pub max_wait: Nanos,
    /// How long one grant should last at the observed rate.
    pub lease_horizon: Nanos,
}

impl QuotaService {
    /// The pools of a global rule asking this service.
    pub fn pool(&self) -> LeasePool {
        LeasePool {
            refresh: RefreshPolicy { lead: self.timeout, horizon: self.lease_horizon },
            // A refresher that neither answered nor failed within twice the
            // timeout crashed or hung: another worker takes over.
            claim_ttl: self.timeout.times(2),
            overshoot: None,
        }
    }
}

fn span(field: &str, text: Option<String>, default: Nanos, max: Nanos) -> Result<Nanos, ConfigError> {
    let Some(text) = text else { return Ok(default) };
    let value = parse_duration(&text).map_err(|e| ConfigError { field: field.into(), message: e.to_string() })?;
    if value > max {
        return Err(ConfigError {
            field: field.into(),
            message: format!("{text:?} is longer than {max_text}", max_text = describe(max)),
        });
    }
    Ok(value)
}

fn describe(span: Nanos) -> String {
    if span % SECOND == Nanos::ZERO {
        format!("{}s", span / SECOND)
    } else {
        format!("{}ms", span.floor_millis())
    }
}

fn text(field: &str, value: String, what: &str) -> Result<String, ConfigError> {
    let fine = !value.is_empty() && value.len() <= 256 && value.bytes().all(|b| b.is_ascii_graphic());
    if fine {
        Ok(value)
    } else {
        Err(ConfigError {
            field: field.into(),
            message: format!("{value:?} is not {what}: 1 to 256 visible ASCII characters"),
        })
    }
}

impl RawService {
    pub(crate) fn validate(self) -> Result<QuotaService, ConfigError> {
        let cluster = text("global.cluster", self.cluster, "an Envoy cluster name")?;
        let authority = match self.authority {
            Some(authority) => text("global.authority", authority, "an authority")?,
            None => cluster.clone(),
        };
        let domain = text("global.domain", self.domain, "a limits domain")?;
        let token = self.token.map(|t| text("global.token", t, "a bearer token")).transpose()?;
        let timeout = span("global.timeout", self.timeout, Nanos::from_millis(300), SECOND.times(10))?;
        let max_wait = span("global.max_wait", self.max_wait, Nanos::from_millis(200), SECOND.times(5))?;
        let lease_horizon = span("global.lease_horizon", self.lease_horizon, SECOND, SECOND.times(60))?;
        Ok(QuotaService { cluster, authority, domain, timeout, token, max_wait, lease_horizon })
    }
}

/// How a global rule asks the quota service.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GlobalMode {
    /// Spend leased tokens locally; refresh in the background (the default).
    #[default]
    Lease,
    /// One `/v1/check` per request, every descriptor of the request's
    /// check-mode rules in one call: for low-rate, high-value limits.
    Check,
}

/// What a global rule does while the quota service cannot be reached.
#[derive(Debug, Clone)]
pub enum Fallback {
    /// Let requests through (the default, like Envoy's global limiter).
    Allow,
    /// Answer them as limited.
    Deny,
    /// Enforce this local limit, in this Envoy alone.
    Local(Table),
}

/// A global rule's settings.
#[derive(Debug, Clone)]
pub struct GlobalRule {
    /// Lease or check.
    pub mode: GlobalMode,
    /// While the service fails.
    pub fallback: Fallback,
    /// Its pools (in lease mode): the service's refresh policy and the
    /// rule's overshoot budget, if any.
    pub pool: LeasePool,
}

/// The registration global rules carry in place of an algorithm: their
/// pools are built from the `global` section, never named by a rule.
pub static GLOBAL: Registration = crate::algorithm::unlisted("global", POOL_TAG);

/// Builds a global rule's pool table, mode and fall-back from the fields it
/// was given (`fields`: whatever the rule had besides the common ones; only
/// `mode` and `fallback` belong to a global rule).
pub(crate) fn global_rule(
    at: &str,
    service: Option<&QuotaService>,
    limit: Option<u64>,
    algorithm: Option<String>,
    mut fields: Map<String, Value>,
    max_keys: u32,
) -> Result<(Table, GlobalRule), ConfigError> {
    let err = |field: &str, message: String| ConfigError { field: format!("{at}.{field}"), message };
    let Some(service) = service else {
        return Err(err(
            "scope",
            "\"global\" needs the top-level `global` section naming the quota service (cluster, domain)".into(),
        ));
    };
    let lives_in_service = "a global rule's limit lives in the quota service's limits file";
    if limit.is_some() {
        return Err(err(
            "limit",
            format!("{lives_in_service}; remove it (a local fall-back limit goes in `fallback`)"),
        ));
    }
    if let Some(algorithm) = algorithm {
        return Err(err("algorithm", format!("{algorithm:?}: {lives_in_service}; remove it")));
    }
    let mode = match fields.remove("mode") {
        None => GlobalMode::Lease,
        Some(value) => serde_json::from_value(value.clone())
            .map_err(|_| err("mode", format!("{value} is not a mode: use \"lease\" or \"check\"")))?,
    };
    let overshoot = match fields.remove("overshoot") {
        None => None,
        Some(_) if mode == GlobalMode::Check => {
            return Err(err(
                "overshoot",
                "applies only to lease mode (a check-mode rule asks the service for every request)".into(),
            ))
        }
        Some(Value::Object(budget)) => Some(overshoot_budget(&format!("{at}.overshoot"), budget)?),
        Some(other) => {
            return Err(err("overshoot", format!("{other} is not a budget: use {{\"limit\": …, \"period\": …}}")))
        }
    };
    let fallback = match fields.remove("fallback") {
        None => Fallback::Allow,
        Some(Value::String(s)) if s == "allow" => Fallback::Allow,
        Some(Value::String(s)) if s == "deny" => Fallback::Deny,
        Some(Value::Object(local)) => Fallback::Local(local_fallback(&format!("{at}.fallback"), local, max_keys)?),
        Some(other) => {
            return Err(err(
                "fallback",
                format!(
                "{other} is not a fall-back: use \"allow\", \"deny\" or a local limit {{\"limit\": …, \"period\": …}}"
            ),
            ))
        }
    };
    if let Some(name) = fields.keys().next() {
        let message = if ALGORITHMS.iter().any(|a| a.fields.contains(&name.as_str())) {
            format!("does not apply to a global rule ({lives_in_service}); remove it")
        } else {
            format!("unknown field `{name}` (a global rule takes mode, fallback and overshoot)")
        };
        return Err(err(name, message));
    }
    let pool = LeasePool { overshoot, ..service.pool() };
    let table = Table::new(Arc::new(pool), POOL_TAG, max_keys);
    Ok((table, GlobalRule { mode, fallback, pool }))
}

/// An overshoot budget: `limit` units per `period`, both required.
fn overshoot_budget(at: &str, mut fields: Map<String, Value>) -> Result<Overshoot, ConfigError> {
    let field = |name: &str| format!("{at}.{name}");
    let limit = match fields.remove("limit") {
        Some(value) => value.as_u64().filter(|n| (1..=MAX_OVERSHOOT).contains(n)).ok_or_else(|| ConfigError {
            field: field("limit"),
            message: format!("must be between 1 and {MAX_OVERSHOOT}, got {value}"),
        })?,
        None => return Err(ConfigError { field: at.into(), message: "missing field `limit`".into() }),
    };
    let period = match fields.remove("period") {
        Some(Value::String(text)) => {
            let period = span(&field("period"), Some(text.clone()), SECOND, SECOND.times(3600))?;
            if period < Nanos::from_millis(1) {
                return Err(ConfigError { field: field("period"), message: format!("{text:?} is shorter than 1ms") });
            }
            period
        }
        Some(other) => {
            return Err(ConfigError {
                field: field("period"),
                message: format!("{other} is not a duration like \"1s\""),
            })
        }
        None => return Err(ConfigError { field: at.into(), message: "missing field `period`".into() }),
    };
    if let Some(name) = fields.keys().next() {
        return Err(ConfigError {
            field: field(name),
            message: "unknown field (a budget takes limit and period)".into(),
        });
    }
    Ok(Overshoot { limit, period })
}

/// A local fall-back limit: `limit`, optional `algorithm` and its fields.
fn local_fallback(at: &str, mut fields: Map<String, Value>, max_keys: u32) -> Result<Table, ConfigError> {
    let field = |name: &str| format!("{at}.{name}");
    let limit = match fields.remove("limit") {
        Some(value) => {
            value.as_u64().filter(|n| (1..=crate::bounds::MAX_AMOUNT).contains(n)).ok_or_else(|| ConfigError {
                field: field("limit"),
                message: format!("must be between 1 and {}, got {value}", crate::bounds::MAX_AMOUNT),
            })?
        }
        None => return Err(ConfigError { field: at.into(), message: "missing field `limit`".into() }),
    };
    let name = match fields.remove("algorithm") {
        None => "token_bucket".to_string(),
        Some(Value::String(name)) => name,
        Some(other) => {
            return Err(ConfigError { field: field("algorithm"), message: format!("{other} is not an algorithm name") })
        }
    };
    let Some(registration) = Registration::find(&name) else {
        return Err(ConfigError { field: field("algorithm"), message: format!("unknown algorithm {name:?}") });
    };
    let policy = registration.build(Params::new(at, limit, fields))?;
    Ok(Table::new(policy, registration.tag, max_keys))
}
