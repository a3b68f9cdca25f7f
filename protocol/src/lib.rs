//! The wire format of Floodgate's quota service (see `docs/protocol.md`):
//! small JSON bodies, numbers as numbers, times in whole milliseconds rounded
//! up. One crate, depending on serde only, so that the filter (on
//! `wasm32-wasip1`) and the service (`floodgate-quota`) share the same types.
//!
//! Unknown request fields are ignored, so a newer filter can talk to an
//! older service.

use serde::{Deserialize, Serialize};

mod flat;

/// One descriptor: ordered `[key, value]` pairs, e.g.
/// `[["path","/login"],["method","POST"]]`.
pub type Descriptor = Vec<(String, String)>;

/// Largest request body, in bytes: room for [`MAX_LEASES`] leases of long
/// descriptors.
pub const MAX_BODY_BYTES: usize = 256 * 1024;
/// Most descriptors in one check.
pub const MAX_DESCRIPTORS: usize = 32;
/// Most leases (or returns) in one call: a proxy renews every pool that is
/// due in one call per renewal round, hundreds of keys at a time.
pub const MAX_LEASES: usize = 512;
/// Most entries in one descriptor.
pub const MAX_ENTRIES: usize = 16;
/// Largest `hits`, `wanted`, `reported` or `tokens`.
pub const MAX_UNITS: u64 = 1_000_000_000;
/// Longest descriptor key or value, in bytes.
pub const MAX_ENTRY_LEN: usize = 256;
/// Longest lease `id`, in bytes.
pub const MAX_LEASE_ID_LEN: usize = 64;

fn one() -> u64 {
    1
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

/// `POST /v1/check`. `D` is how a descriptor is held: the service reads
/// [`Descriptor`]s; the filter writes references to the ones its request
/// keeps (`CheckRequest<&Descriptor>`), so that a check copies none.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct CheckRequest<D = Descriptor> {
    /// The limits domain.
    pub domain: String,
    /// Every descriptor the request matched; admitted only if all admit.
    pub descriptors: Vec<D>,
    /// Units the request costs in each descriptor (default 1; 0 only reads).
    #[serde(default = "one")]
    pub hits: u64,
}

/// How one descriptor fared.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Code {
    /// Within the limit (or over it in shadow mode).
    Ok,
    /// Over the limit.
    OverLimit,
    /// The matching rule is `unlimited`.
    Unlimited,
    /// No rule matches the descriptor: not limited.
    NoRule,
}

/// A limit's numbers, as a check's status and a lease's grant report them
/// (each field absent for `unlimited` and `no_rule`). On the wire they are
/// fields of the status or grant itself.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct LimitReport {
    /// Units per window.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub limit: Option<u64>,
    /// The rule's period in ms (the `w` of `RateLimit-Policy`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub window_ms: Option<u64>,
    /// Units left.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub remaining: Option<u64>,
    /// Milliseconds until more quota is available (0 when full).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub reset_ms: Option<u64>,
}

/// The answer for one descriptor of a check.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(from = "flat::CheckStatus")]
pub struct CheckStatus {
    /// The outcome.
    pub code: Code,
    /// The limit's numbers after this request.
    #[serde(flatten)]
    pub report: LimitReport,
    /// With `over_limit`: milliseconds after which the same request would be
    /// admitted; `null` when it never can be (hits above the capacity).
    #[serde(skip_serializing_if = "Option::is_none", default, deserialize_with = "present_retry")]
    pub retry_after_ms: Option<Retry>,
    /// In shadow mode, true when the rule would have denied.
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub shadow_over_limit: bool,
}

/// A retry-after: a wait in milliseconds, or never (`null` on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// A wait in ms.
    After(u64),
    /// The request can never be admitted (its hits exceed the capacity).
    Never,
}

impl Serialize for Retry {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Retry::After(ms) => s.serialize_u64(*ms),
            Retry::Never => s.serialize_none(),
        }
    }
}

/// A present field is a retry-after even when it is `null` (never); only an
/// absent field (serde's `default`) is `None`.
fn present_retry<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Retry>, D::Error> {
    Ok(Some(Option::<u64>::deserialize(d)?.map_or(Retry::Never, Retry::After)))
}

/// Response of `POST /v1/check`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct CheckResponse {
    /// True when the request is admitted (its hits were taken everywhere).
    pub allowed: bool,
    /// When denied: the longest wait among the denying descriptors, or `null`
    /// if one of them can never admit.
    #[serde(skip_serializing_if = "Option::is_none", default, deserialize_with = "present_retry")]
    pub retry_after_ms: Option<Retry>,
    /// One per request descriptor, in order.
    pub results: Vec<CheckStatus>,
}

/// One lease of `POST /v1/lease`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct LeaseWant {
    /// The caller's idempotency key for this lease (see [`check_lease_id`]):
    /// a lease whose id is already recorded is answered again, not granted
    /// again, and returns name it.
    pub id: String,
    /// The descriptor to lease tokens of.
    pub descriptor: Descriptor,
    /// The most tokens the caller wants.
    pub wanted: u64,
    /// The caller's observed consumption, tokens per second (optional).
    #[serde(default)]
    pub rate: Option<f64>,
    /// The window the tokens are for, as grants name it ([`LeaseGrant::window`]):
    /// the next window asks for tokens of that window before it starts (a
    /// lease ahead). Absent: the window that counts now, as before this
    /// field existed.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub window: Option<u64>,
    /// The caller can hold an allowance: `granted` tokens in each of several
    /// consecutive windows (see [`LeaseGrant::windows`]). Absent (false):
    /// tokens of one window, as before this field existed.
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub per_window: bool,
    /// Units the caller admitted of this descriptor without a lease since
    /// its last report (a rule's overshoot budget): the service counts them
    /// in the bucket, whatever its limit says, before it decides this
    /// lease. Absent (0): nothing to report.
    #[serde(skip_serializing_if = "is_zero", default)]
    pub reported: u64,
    /// A request waits for these tokens at a pool that holds none, and the
    /// pool's pace says a lease would expire unspent (a thin pair): decide
    /// `wanted` as a check does — taken now or refused, with no lease record
    /// and nothing to return ([`LeaseGrant::checked`]). Absent (false): a
    /// lease, as before this field existed (a service that predates it
    /// leases `wanted` tokens, which the waiting request spends).
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub check: bool,
}

/// `POST /v1/lease`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct LeaseRequest {
    /// The limits domain.
    pub domain: String,
    /// Independent leases, taken in order.
    pub leases: Vec<LeaseWant>,
    /// The caller admits keys without a lease (an overshoot budget): answer
    /// with the domain's recent [`NearNotice`]s. Absent (false): none.
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub notices: bool,
}

/// A key of the domain that the service found near its limit while
/// deciding a lease that reported units admitted without one: callers
/// that admit keys without a lease should stop for this one.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct NearNotice {
    /// The key's descriptor, as it was reported.
    pub descriptor: Descriptor,
    /// For how long from now (ms): until the window after the one it was
    /// found near in has ended.
    pub for_ms: u64,
}

/// Most notices one answer carries, the most recent first.
pub const MAX_NOTICES: usize = 32;

/// One granted lease.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(from = "flat::LeaseGrant")]
pub struct LeaseGrant {
    /// `ok` (granted may still be 0 when nothing is left), `unlimited` or
    /// `no_rule` (granted = wanted: the caller need not count).
    pub code: Code,
    /// Tokens granted.
    pub granted: u64,
    /// Milliseconds (from now) until the tokens stop being usable.
    pub valid_ms: u64,
    /// Milliseconds until the tokens may be used, for a lease ahead: they
    /// count in a window that starts then. 0 (absent) for tokens usable now.
    #[serde(skip_serializing_if = "is_zero", default)]
    pub starts_ms: u64,
    /// The limit's numbers after this grant (`remaining`: left unleased
    /// for everyone).
    #[serde(flatten)]
    pub report: LimitReport,
    /// Identifies the window the tokens belong to (0 for a token bucket).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub window: Option<u64>,
    /// An allowance (asked for with [`LeaseWant::per_window`]): `granted`
    /// tokens in each of this many consecutive windows, the first being
    /// `window`; `valid_ms` reaches the end of the last. Absent (0) or 1:
    /// tokens of one window.
    #[serde(skip_serializing_if = "is_zero", default)]
    pub windows: u64,
    /// The rule is in shadow mode: running out must not deny requests.
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub shadow: bool,
    /// This lease's id was already recorded: the grant made then is repeated
    /// and nothing more was taken.
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub replayed: bool,
    /// The key has used more than three quarters of its limit: a caller
    /// admitting it without a lease (an overshoot budget) should stop.
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub near_limit: bool,
    /// Decided as a check ([`LeaseWant::check`]): `granted` tokens were
    /// taken for the request that waits, no lease was recorded, and there
    /// is nothing to return. Absent (false): a lease.
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub checked: bool,
    /// Present when the service refused this lease without deciding it
    /// (its caller holds its share of the service's lease records): why.
    /// `granted` is 0 and `remaining` absent; ask again after `reset_ms`.
    /// The call's other leases are answered as usual.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub refused: Option<String>,
}

/// Response of `POST /v1/lease`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct LeaseResponse {
    /// One per requested lease, in order.
    pub leases: Vec<LeaseGrant>,
    /// Only when asked for ([`LeaseRequest::notices`]): keys of the domain
    /// recently found near their limit, at most [`MAX_NOTICES`].
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub near: Vec<NearNotice>,
}

/// One item of `POST /v1/return`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct ReturnTokens {
    /// The `id` of the lease the tokens came from.
    pub id: String,
    /// Unused tokens of that lease.
    pub tokens: u64,
}

/// `POST /v1/return`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct ReturnRequest {
    /// The limits domain.
    pub domain: String,
    /// What to give back.
    pub returns: Vec<ReturnTokens>,
}

/// Response of `POST /v1/return`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct ReturnResponse {
    /// Tokens taken back, per item (0 when the lease is unknown, expired or
    /// already returned, its window is over, or the bucket is full).
    pub returned: Vec<u64>,
    /// Per item, whether the lease had been returned already (by an
    /// earlier attempt of this return, say): this one took back nothing
    /// more. Absent when none had.
    #[serde(default, skip_serializing_if = "none_replayed")]
    pub replayed: Vec<bool>,
}

fn none_replayed(replayed: &[bool]) -> bool {
    !replayed.contains(&true)
}

/// Every error body: `{"error": "..."}`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct ErrorBody {
    /// What went wrong, for a human.
    pub error: String,
}

/// Checks a lease id: 1 to [`MAX_LEASE_ID_LEN`] bytes of `A-Za-z0-9_-`.
/// The message names `field`.
pub fn check_lease_id(field: &str, id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > MAX_LEASE_ID_LEN {
        return Err(format!("{field} must be 1 to {MAX_LEASE_ID_LEN} bytes long, not {}", id.len()));
    }
    if let Some(bad) = id.chars().find(|c| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-')) {
        return Err(format!("{field} contains {bad:?}; use only A-Z, a-z, 0-9, '_' and '-'"));
    }
    Ok(())
}

/// Checks the size limits shared by every call: at most `most` descriptors
/// ([`MAX_DESCRIPTORS`] in a check, [`MAX_LEASES`] in a lease call), each
/// within [`MAX_ENTRIES`] and [`MAX_ENTRY_LEN`]; the message names the field.
pub fn check_descriptors<'a>(
    field: &str,
    most: usize,
    list: impl ExactSizeIterator<Item = &'a Descriptor>,
) -> Result<(), String> {
    if list.len() == 0 {
        return Err(format!("{field} must not be empty"));
    }
    if list.len() > most {
        return Err(format!("{field} has {} items; at most {most} are allowed", list.len()));
    }
    for (i, descriptor) in list.enumerate() {
        if descriptor.is_empty() {
            return Err(format!("{field}[{i}] has no entries"));
        }
        if descriptor.len() > MAX_ENTRIES {
            return Err(format!("{field}[{i}] has {} entries; at most {MAX_ENTRIES} are allowed", descriptor.len()));
        }
        for (j, (key, value)) in descriptor.iter().enumerate() {
            if key.is_empty() {
                return Err(format!("{field}[{i}][{j}] has an empty key"));
            }
            if key.len() > MAX_ENTRY_LEN || value.len() > MAX_ENTRY_LEN {
                return Err(format!(
                    "{field}[{i}][{j}] is too long; keys and values are at most {MAX_ENTRY_LEN} bytes"
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_check_is_asked_and_answered_only_when_set() {
        let want: LeaseWant = serde_json::from_str(r#"{"id": "a", "descriptor": [["k", "v"]], "wanted": 1}"#).unwrap();
        assert!(!want.check, "absent: a lease");
        assert!(!serde_json::to_string(&want).unwrap().contains("check"), "not written when false");
        let asked = LeaseWant { check: true, ..want };
        assert!(serde_json::to_string(&asked).unwrap().contains(r#""check":true"#));
        let grant: LeaseGrant = serde_json::from_str(r#"{"code": "ok", "granted": 1, "valid_ms": 5}"#).unwrap();
        assert!(!grant.checked, "absent: a lease, as an older service answers");
    }

    #[test]
    fn never_is_an_explicit_null_and_reads_back_as_never() {
        let denied = CheckResponse { allowed: false, retry_after_ms: Some(Retry::Never), results: Vec::new() };
        let text = serde_json::to_string(&denied).unwrap();
        assert_eq!(text, r#"{"allowed":false,"retry_after_ms":null,"results":[]}"#);
        assert_eq!(serde_json::from_str::<CheckResponse>(&text).unwrap(), denied);
        let allowed: CheckResponse = serde_json::from_str(r#"{"allowed":true,"results":[]}"#).unwrap();
        assert_eq!(allowed.retry_after_ms, None);
    }

    /// A status's and a grant's numbers are their own fields on the wire
    /// ([`LimitReport`] is flattened into each), absent when unknown; a
    /// status's `null` retry still reads as never.
    #[test]
    fn a_limits_numbers_are_fields_of_the_status_and_the_grant() {
        let text =
            r#"{"code":"over_limit","limit":10,"window_ms":1000,"remaining":0,"reset_ms":250,"retry_after_ms":null}"#;
        let status: CheckStatus = serde_json::from_str(text).unwrap();
        let report = LimitReport { limit: Some(10), window_ms: Some(1000), remaining: Some(0), reset_ms: Some(250) };
        assert_eq!(status.report, report);
        assert_eq!(status.retry_after_ms, Some(Retry::Never));
        let back: serde_json::Value = serde_json::from_str(&serde_json::to_string(&status).unwrap()).unwrap();
        assert_eq!(back, serde_json::from_str::<serde_json::Value>(text).unwrap());

        let grant: LeaseGrant = serde_json::from_str(r#"{"code":"no_rule","granted":5,"valid_ms":1000}"#).unwrap();
        assert_eq!(grant.report, LimitReport::default());
        assert_eq!(serde_json::to_string(&grant).unwrap(), r#"{"code":"no_rule","granted":5,"valid_ms":1000}"#);
    }

    /// Every field of a status and a grant reads back as it was written,
    /// each one set away from its default: the wire's reading of them
    /// ([`flat`]) misses none.
    #[test]
    fn a_status_and_a_grant_with_every_field_set_read_back_whole() {
        let report = LimitReport { limit: Some(10), window_ms: Some(1000), remaining: Some(3), reset_ms: Some(250) };
        let status = CheckStatus {
            code: Code::OverLimit,
            report,
            retry_after_ms: Some(Retry::After(40)),
            shadow_over_limit: true,
        };
        let text = serde_json::to_string(&status).unwrap();
        assert_eq!(serde_json::from_str::<CheckStatus>(&text).unwrap(), status, "{text}");
        let grant = LeaseGrant {
            code: Code::Ok,
            granted: 5,
            valid_ms: 900,
            starts_ms: 100,
            report,
            window: Some(7),
            windows: 3,
            shadow: true,
            replayed: true,
            near_limit: true,
            checked: true,
            refused: Some("records".into()),
        };
        let text = serde_json::to_string(&grant).unwrap();
        assert_eq!(serde_json::from_str::<LeaseGrant>(&text).unwrap(), grant, "{text}");
        // The descriptors of a check are written the same whether held or lent.
        let held: CheckRequest =
            CheckRequest { domain: "d".into(), descriptors: vec![vec![("k".into(), "v".into())]], hits: 2 };
        let lent = CheckRequest { domain: "d".into(), descriptors: held.descriptors.iter().collect(), hits: 2 };
        assert_eq!(serde_json::to_string(&lent).unwrap(), serde_json::to_string(&held).unwrap());
    }

    #[test]
    fn lease_ids_are_short_and_plain() {
        assert!(check_lease_id("id", "a").is_ok());
        assert!(check_lease_id("id", "Envoy-7_lease-0042").is_ok());
        assert!(check_lease_id("id", &"x".repeat(MAX_LEASE_ID_LEN)).is_ok());
        assert!(check_lease_id("leases[0].id", "").unwrap_err().starts_with("leases[0].id must be 1 to 64"));
        assert!(check_lease_id("id", &"x".repeat(MAX_LEASE_ID_LEN + 1)).is_err());
        assert!(check_lease_id("id", "a b").unwrap_err().contains("' '"));
        assert!(check_lease_id("id", "a:b").is_err());
        assert!(check_lease_id("id", "é").is_err());
    }
}
