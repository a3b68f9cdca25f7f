//! The `response` section: what a limited request is answered with, and
//! which rate-limit headers responses carry.

use serde::Deserialize;

use super::checks::{check_range, default_true, error};
use crate::error::ConfigError;

/// The longest body of a limited response.
const MAX_BODY: usize = 4096;

/// The `response` section as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawResponse {
    #[serde(default = "default_status")]
    status: u32,
    #[serde(default = "default_body")]
    body: String,
    #[serde(default)]
    headers: HeaderStyle,
    #[serde(default = "default_true")]
    headers_on_allowed: bool,
}

impl Default for RawResponse {
    fn default() -> Self {
        Self {
            status: default_status(),
            body: default_body(),
            headers: HeaderStyle::default(),
            headers_on_allowed: true,
        }
    }
}

fn default_status() -> u32 {
    429
}

fn default_body() -> String {
    "Too Many Requests\n".into()
}

/// Which rate-limit headers responses carry.
#[derive(Deserialize, Default, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum HeaderStyle {
    /// IETF `RateLimit` and `RateLimit-Policy` (draft-ietf-httpapi-ratelimit-headers-10).
    #[default]
    Ietf,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`.
    #[serde(rename = "x-ratelimit")]
    XRateLimit,
    /// None (a limited response still carries `Retry-After`).
    None,
}

/// The limited response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// HTTP status of a limited response (400–599).
    pub status: u32,
    /// Body of a limited response.
    pub body: String,
    /// Which rate-limit headers to send.
    pub headers: HeaderStyle,
    /// Whether allowed responses carry the rate-limit headers too.
    pub headers_on_allowed: bool,
}

impl RawResponse {
    /// The validated `response` section.
    pub(super) fn validate(self) -> Result<Response, ConfigError> {
        check_range("response.status", u64::from(self.status), 400, 599)?;
        if self.body.len() > MAX_BODY {
            return Err(error("response.body", format!("at most {MAX_BODY} bytes, got {}", self.body.len())));
        }
        Ok(Response {
            status: self.status,
            body: self.body,
            headers: self.headers,
            headers_on_allowed: self.headers_on_allowed,
        })
    }
}
