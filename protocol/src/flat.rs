//! How a check's status and a lease's grant are read: their limit's numbers
//! ([`crate::LimitReport`]) among their own fields, in one pass over the
//! object. (They are written with serde's `flatten`; read with it, every
//! field of the object would go into a buffer first and be read again from
//! there, which made a check answer's parse about a third dearer, in the
//! filter's request path.) A field added to [`crate::CheckStatus`] or
//! [`crate::LeaseGrant`] must be added here: the conversions do not compile
//! without it.

use serde::Deserialize;

use super::{present_retry, Code, LimitReport, Retry};

/// [`crate::CheckStatus`]'s fields.
#[derive(Deserialize)]
pub(super) struct CheckStatus {
    code: Code,
    #[serde(default)]
    limit: Option<u64>,
    #[serde(default)]
    window_ms: Option<u64>,
    #[serde(default)]
    remaining: Option<u64>,
    #[serde(default)]
    reset_ms: Option<u64>,
    #[serde(default, deserialize_with = "present_retry")]
    retry_after_ms: Option<Retry>,
    #[serde(default)]
    shadow_over_limit: bool,
}

impl From<CheckStatus> for super::CheckStatus {
    fn from(s: CheckStatus) -> Self {
        let report =
            LimitReport { limit: s.limit, window_ms: s.window_ms, remaining: s.remaining, reset_ms: s.reset_ms };
        super::CheckStatus {
            code: s.code,
            report,
            retry_after_ms: s.retry_after_ms,
            shadow_over_limit: s.shadow_over_limit,
        }
    }
}

/// [`crate::LeaseGrant`]'s fields.
#[derive(Deserialize)]
pub(super) struct LeaseGrant {
    code: Code,
    granted: u64,
    valid_ms: u64,
    #[serde(default)]
    starts_ms: u64,
    #[serde(default)]
    limit: Option<u64>,
    #[serde(default)]
    window_ms: Option<u64>,
    #[serde(default)]
    remaining: Option<u64>,
    #[serde(default)]
    reset_ms: Option<u64>,
    #[serde(default)]
    window: Option<u64>,
    #[serde(default)]
    windows: u64,
    #[serde(default)]
    shadow: bool,
    #[serde(default)]
    replayed: bool,
    #[serde(default)]
    near_limit: bool,
    #[serde(default)]
    checked: bool,
    #[serde(default)]
    refused: Option<String>,
}

impl From<LeaseGrant> for super::LeaseGrant {
    fn from(g: LeaseGrant) -> Self {
        let report =
            LimitReport { limit: g.limit, window_ms: g.window_ms, remaining: g.remaining, reset_ms: g.reset_ms };
        super::LeaseGrant {
            code: g.code,
            granted: g.granted,
            valid_ms: g.valid_ms,
            starts_ms: g.starts_ms,
            report,
            window: g.window,
            windows: g.windows,
            shadow: g.shadow,
            replayed: g.replayed,
            near_limit: g.near_limit,
            checked: g.checked,
            refused: g.refused,
        }
    }
}
