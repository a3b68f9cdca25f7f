//! One rule of `rules[]`: its name, match, descriptor entries, algorithm and
//! limit (or, for a global rule, the quota service's), bucket table, cost and
//! per-worker batch.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::checks::{check_range, error, Headers};
use super::descriptors::RawDescriptor;
use super::request_match::RawMatch;
use crate::algorithm::{Params, Policy, Quota, Registration, ALGORITHMS};
use crate::bounds::MAX_AMOUNT;
use crate::descriptor::{Cost, DescriptorEntry, RequestMatch};
use crate::error::ConfigError;
use crate::global::settings::{global_rule, GlobalRule, QuotaService, GLOBAL};
use crate::table::Table;

/// Buckets per rule when neither the rule nor the plugin sets `max_keys`.
pub const DEFAULT_MAX_KEYS: u32 = 65_536;
/// The most buckets one rule may have.
pub const MAX_MAX_KEYS: u64 = 1 << 20;
/// The most units a worker may take ahead at once.
const MAX_WORKER_BATCH: u64 = 1_000_000;
/// The most descriptor entries of one rule.
const MAX_DESCRIPTORS: usize = 16;

/// A rule as written. Fields not named here belong to the rule's algorithm,
/// which takes them from `params` and refuses any it does not know (so a
/// rule still has no unknown fields).
#[derive(Deserialize)]
pub(super) struct RawRule {
    name: String,
    #[serde(default, rename = "match")]
    request_match: RawMatch,
    #[serde(default)]
    descriptors: Vec<RawDescriptor>,
    algorithm: Option<String>,
    limit: Option<u64>,
    cost: Option<u64>,
    cost_from_header: Option<RawCostHeader>,
    #[serde(default)]
    shadow_mode: bool,
    max_keys: Option<u64>,
    worker_batch: Option<u64>,
    #[serde(default)]
    scope: Scope,
    #[serde(flatten)]
    params: Map<String, Value>,
}

/// Where a rule's limit is kept.
#[derive(Deserialize, Default, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// In this Envoy's shared data, exact across its workers.
    #[default]
    Local,
    /// In the central quota service, for the whole fleet (see [`crate::global`]).
    Global,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCostHeader {
    header_name: String,
    max: u64,
}

/// One validated rule.
#[derive(Debug, Clone)]
pub struct Rule {
    /// The rule's name: in metrics, logs, shared-data keys and headers.
    pub name: String,
    /// Which requests the rule applies to.
    pub request_match: RequestMatch,
    /// What identifies a bucket.
    pub descriptors: Vec<DescriptorEntry>,
    /// The algorithm.
    pub algorithm: &'static Registration,
    /// Cost per request.
    pub cost: Cost,
    /// Count and log, but do not enforce.
    pub shadow_mode: bool,
    /// The rule's bucket table, decided by its algorithm (for a global
    /// rule: its lease pools).
    pub table: Table,
    /// For a global rule, how it asks the quota service and falls back.
    pub global: Option<GlobalRule>,
    /// Units a worker takes from a bucket at once and spends from its own
    /// memory (`worker_batch`), if set.
    pub worker_batch: Option<u64>,
}

impl Rule {
    /// The configured algorithm.
    pub fn policy(&self) -> &dyn Policy {
        self.table.policy()
    }

    /// What the limit looks like to a client (`limit` and window).
    pub fn quota(&self) -> Quota {
        self.policy().quota()
    }
}

/// `max_keys` at `field`: `default` when absent, else 1 to [`MAX_MAX_KEYS`].
pub(super) fn max_keys(field: &str, raw: Option<u64>, default: u64) -> Result<u64, ConfigError> {
    match raw {
        None => Ok(default),
        Some(n) => check_range(field, n, 1, MAX_MAX_KEYS),
    }
}

impl RawRule {
    /// The validated rule at `at` (`rules[i]`). Checked in the order the
    /// fields are read, so the first error is the one reported.
    pub(super) fn validate(
        self,
        at: &str,
        default_max_keys: u64,
        service: Option<&QuotaService>,
        headers: &mut Headers,
    ) -> Result<Rule, ConfigError> {
        check_name(at, &self.name)?;
        let request_match = self.request_match.validate(&format!("{at}.match"), headers)?;
        let descriptors = descriptors(at, self.descriptors, headers)?;
        let max_keys = max_keys(&format!("{at}.max_keys"), self.max_keys, default_max_keys)?;
        // A rule whose descriptor is all constants has exactly one bucket.
        let max_keys = if crate::descriptor::is_constant(&descriptors) { 1 } else { max_keys as u32 };
        let (algorithm, table, global) = if self.scope == Scope::Global {
            let (table, global) = global_rule(at, service, self.limit, self.algorithm, self.params, max_keys)?;
            (&GLOBAL, table, Some(global))
        } else {
            let (algorithm, table) = local_table(at, self.limit, self.algorithm, self.params, max_keys)?;
            (algorithm, table, None)
        };
        let capacity = table.policy().capacity();
        let cost = cost(at, self.cost, self.cost_from_header, capacity, headers)?;
        let worker_batch = match self.worker_batch {
            None => None,
            Some(n) => Some(worker_batch(at, n, global.is_some(), algorithm, &table)?),
        };
        if global.is_some() && descriptors.is_empty() {
            // The protocol refuses a descriptor without entries, and with it
            // the whole call, which carries other rules' leases too.
            return Err(error(
                format!("{at}.descriptors"),
                "a global rule needs at least one entry: the quota service limits descriptors by their entries (for one limit over the fleet, a generic_key)",
            ));
        }
        Ok(Rule {
            table,
            name: self.name,
            request_match,
            descriptors,
            algorithm,
            cost,
            shadow_mode: self.shadow_mode,
            global,
            worker_batch,
        })
    }
}

/// A rule's name goes into metric names, shared-data keys and headers, so
/// it is kept to a safe alphabet.
fn check_name(at: &str, name: &str) -> Result<(), ConfigError> {
    let name_ok = !name.is_empty()
        && name.len() <= 64
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !name_ok {
        return Err(error(
            format!("{at}.name"),
            format!("{name:?} is not a rule name: use 1 to 64 letters, digits, '_' or '-'"),
        ));
    }
    Ok(())
}

/// The rule's `descriptors[]`, at most [`MAX_DESCRIPTORS`] of them.
fn descriptors(at: &str, raw: Vec<RawDescriptor>, headers: &mut Headers) -> Result<Vec<DescriptorEntry>, ConfigError> {
    if raw.len() > MAX_DESCRIPTORS {
        return Err(error(
            format!("{at}.descriptors"),
            format!("at most {MAX_DESCRIPTORS} entries, got {}", raw.len()),
        ));
    }
    raw.into_iter().enumerate().map(|(i, d)| d.validate(&format!("{at}.descriptors[{i}]"), headers)).collect()
}

/// A local rule's algorithm (by default `token_bucket`) built from its
/// `limit` and its own fields, and the table of `max_keys` buckets it decides.
fn local_table(
    at: &str,
    limit: Option<u64>,
    algorithm: Option<String>,
    params: Map<String, Value>,
    max_keys: u32,
) -> Result<(&'static Registration, Table), ConfigError> {
    for only_global in ["mode", "fallback", "overshoot"] {
        if params.contains_key(only_global) {
            return Err(error(format!("{at}.{only_global}"), "applies only to a rule with \"scope\": \"global\""));
        }
    }
    let Some(limit) = limit else { return Err(error(at, "missing field `limit`")) };
    let limit = check_range(&format!("{at}.limit"), limit, 1, MAX_AMOUNT)?;
    let name_of_algorithm = algorithm.as_deref().unwrap_or("token_bucket");
    let Some(algorithm) = Registration::find(name_of_algorithm) else {
        let known: Vec<&str> = ALGORITHMS.iter().map(|a| a.name).collect();
        return Err(error(
            format!("{at}.algorithm"),
            format!("unknown algorithm {name_of_algorithm:?}: use one of {}", known.join(", ")),
        ));
    };
    let policy = algorithm.build(Params::new(at, limit, params))?;
    Ok((algorithm, Table::new(policy, algorithm.tag, max_keys)))
}

/// `cost` (default 1) and `cost_from_header`: no request may cost more than
/// the bucket holds.
fn cost(
    at: &str,
    cost: Option<u64>,
    from_header: Option<RawCostHeader>,
    capacity: u64,
    headers: &mut Headers,
) -> Result<Cost, ConfigError> {
    let fixed_cost = check_range(&format!("{at}.cost"), cost.unwrap_or(1), 1, capacity)?;
    let Some(from) = from_header else { return Ok(Cost::Fixed(fixed_cost)) };
    let header = headers.id(&format!("{at}.cost_from_header.header_name"), &from.header_name)?;
    let max = check_range(&format!("{at}.cost_from_header.max"), from.max, 1, capacity)?;
    if fixed_cost > max {
        return Err(error(
            format!("{at}.cost"),
            format!("the default cost {fixed_cost} exceeds cost_from_header.max {max}"),
        ));
    }
    Ok(Cost::FromHeader { header, default: fixed_cost, max })
}

/// `worker_batch` (`n`): only a local rule whose algorithm's units can be
/// taken ahead, 2 up to the bucket's capacity.
fn worker_batch(at: &str, n: u64, global: bool, algorithm: &Registration, table: &Table) -> Result<u64, ConfigError> {
    if global {
        return Err(error(
            format!("{at}.worker_batch"),
            "applies only to local rules (a global rule's pools are its batches)",
        ));
    }
    if !table.policy().batchable() {
        return Err(error(
            format!("{at}.worker_batch"),
            format!(
                "does not apply to {}: its units cannot be taken ahead and spent later without breaking its limit",
                algorithm.name
            ),
        ));
    }
    let capacity = table.policy().capacity();
    check_range(&format!("{at}.worker_batch"), n, 2, capacity.min(MAX_WORKER_BATCH))
}
