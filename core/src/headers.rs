//! Rate-limit response headers, a pure function of the verdict.
//!
//! - `ietf` (default): `RateLimit-Policy: "<rule>";q=<limit>;w=<seconds>` and
//!   `RateLimit: "<rule>";r=<remaining>;t=<seconds>`, as in
//!   draft-ietf-httpapi-ratelimit-headers-10, where `t` is the time until more
//!   quota becomes available.
//! - `x-ratelimit`: `X-RateLimit-Limit`, `X-RateLimit-Remaining`,
//!   `X-RateLimit-Reset` (seconds), the names Envoy's and Kong's users know.
//! - `none`.
//!
//! A limited response always carries `Retry-After` (whole seconds, rounded up
//! so a client that waits is never early) and `x-envoy-ratelimited: true`.
//!
//! This runs on every request, so what does not change per request (the
//! policy field, the limit) is rendered once per configuration, and the
//! numbers are written into one buffer without the formatting machinery.

use crate::config::{Config, HeaderStyle};
use crate::limiter::Verdict;
use crate::text::InlineText;
use crate::time::ceil_seconds;

/// The most fields one response gets: retry-after, x-envoy-ratelimited and
/// three x-ratelimit fields.
const MAX_FIELDS: usize = 5;

/// Room for the values of one response: a rule name is at most 64 bytes, so
/// the longest set (retry-after, `true`, `RateLimit-Policy` and `RateLimit`)
/// takes under 250.
const TEXT_CAPACITY: usize = 320;

/// The rate-limit headers of one response: names, and values kept in one
/// inline buffer (no allocation per request).
#[derive(Debug, Clone, Default)]
pub struct HeaderBlock {
    text: InlineText<TEXT_CAPACITY>,
    fields: [(&'static str, usize, usize); MAX_FIELDS],
    len: usize,
}

impl HeaderBlock {
    /// The fields, in order, as (name, value).
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &str)> {
        self.fields[..self.len].iter().map(|&(name, start, end)| (name, self.text.slice(start, end)))
    }

    /// Appends a field whose value `write` appends to the buffer; a value
    /// that does not fit is left out whole.
    fn push(&mut self, name: &'static str, write: impl FnOnce(&mut InlineText<TEXT_CAPACITY>) -> bool) {
        if self.len < MAX_FIELDS {
            let start = self.text.len();
            if write(&mut self.text) {
                self.fields[self.len] = (name, start, self.text.len());
                self.len += 1;
            }
        }
    }
}

/// Renders the headers of a configuration's verdicts.
#[derive(Debug, Clone)]
pub struct Renderer {
    style: HeaderStyle,
    on_allowed: bool,
    /// Per rule: `"<name>";q=<limit>;w=<seconds>` (ietf) or `<limit>` (x-ratelimit).
    policy: Vec<String>,
    /// Per rule: `"<name>";r=` (ietf).
    prefix: Vec<String>,
}

impl Renderer {
    /// Prepares the per-rule constant parts of `config`'s headers.
    pub fn new(config: &Config) -> Self {
        let (policy, prefix) = config
            .rules
            .iter()
            .map(|rule| match config.response.headers {
                HeaderStyle::Ietf => (
                    format!("\"{}\";q={};w={}", rule.name, rule.limit, ceil_seconds(rule.period)),
                    format!("\"{}\";r=", rule.name),
                ),
                HeaderStyle::XRateLimit | HeaderStyle::None => (rule.limit.to_string(), String::new()),
            })
            .unzip();
        Self { style: config.response.headers, on_allowed: config.response.headers_on_allowed, policy, prefix }
    }

    /// Writes the headers `verdict` calls for into `out`: for a limited
    /// response, or for an allowed one when `response.headers_on_allowed`.
    pub fn render(&self, verdict: &Verdict, out: &mut HeaderBlock) {
        out.text.clear();
        out.len = 0;
        let report = verdict.report.filter(|r| r.rule < self.policy.len());
        if !verdict.allowed {
            if let Some(report) = report {
                out.push("retry-after", |s| s.push_u64(ceil_seconds(report.decision.retry_after).max(1)));
            }
            out.push("x-envoy-ratelimited", |s| s.push_str("true"));
        } else if !self.on_allowed {
            return;
        }
        let Some(report) = report else { return };
        let (policy, prefix) = (&self.policy[report.rule], &self.prefix[report.rule]);
        let (remaining, reset) = (report.decision.remaining, ceil_seconds(report.decision.reset));
        match self.style {
            HeaderStyle::Ietf => {
                out.push("ratelimit-policy", |s| s.push_str(policy));
                out.push("ratelimit", |s| {
                    s.push_str(prefix) && s.push_u64(remaining) && s.push_str(";t=") && s.push_u64(reset)
                });
            }
            HeaderStyle::XRateLimit => {
                out.push("x-ratelimit-limit", |s| s.push_str(policy));
                out.push("x-ratelimit-remaining", |s| s.push_u64(remaining));
                out.push("x-ratelimit-reset", |s| s.push_u64(reset));
            }
            HeaderStyle::None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Decision;
    use crate::limiter::Report;
    use crate::time::SECOND;

    fn config(response: &str) -> Config {
        let json =
            format!(r#"{{"rules": [{{"name": "per-key", "limit": 100, "period": "1m"}}], "response": {response}}}"#);
        Config::parse(json.as_bytes()).unwrap()
    }

    fn verdict(allowed: bool, remaining: u64, reset: u64, retry_after: u64) -> Verdict {
        Verdict {
            allowed,
            shadow_limited: None,
            failed: false,
            report: Some(Report { rule: 0, decision: Decision { allowed, remaining, reset, retry_after } }),
        }
    }

    fn headers(config: &Config, verdict: &Verdict) -> Vec<(&'static str, String)> {
        let mut out = HeaderBlock::default();
        Renderer::new(config).render(verdict, &mut out);
        out.iter().map(|(n, v)| (n, v.to_string())).collect()
    }

    #[test]
    fn ietf_fields_on_a_limited_response() {
        let out = headers(&config("{}"), &verdict(false, 0, 600_000_000, 1_200_000_000));
        assert_eq!(
            out,
            vec![
                ("retry-after", "2".to_string()),
                ("x-envoy-ratelimited", "true".to_string()),
                ("ratelimit-policy", "\"per-key\";q=100;w=60".to_string()),
                ("ratelimit", "\"per-key\";r=0;t=1".to_string()),
            ]
        );
    }

    #[test]
    fn allowed_responses_carry_them_unless_told_not_to() {
        let out = headers(&config("{}"), &verdict(true, 41, 0, 0));
        assert_eq!(out[1], ("ratelimit", "\"per-key\";r=41;t=0".to_string()));
        assert!(headers(&config(r#"{"headers_on_allowed": false}"#), &verdict(true, 41, 0, 0)).is_empty());
    }

    #[test]
    fn x_ratelimit_style() {
        let out = headers(&config(r#"{"headers": "x-ratelimit"}"#), &verdict(true, 7, 3 * SECOND + 1, 0));
        assert_eq!(
            out,
            vec![
                ("x-ratelimit-limit", "100".to_string()),
                ("x-ratelimit-remaining", "7".to_string()),
                ("x-ratelimit-reset", "4".to_string()),
            ]
        );
    }

    #[test]
    fn none_still_says_when_to_retry() {
        let out = headers(&config(r#"{"headers": "none"}"#), &verdict(false, 0, 0, 10));
        assert_eq!(out, vec![("retry-after", "1".to_string()), ("x-envoy-ratelimited", "true".to_string())]);
    }

    #[test]
    fn a_failure_denial_has_no_numbers_to_report() {
        let failed = Verdict { allowed: false, shadow_limited: None, failed: true, report: None };
        assert_eq!(headers(&config("{}"), &failed), vec![("x-envoy-ratelimited", "true".to_string())]);
    }

    #[test]
    fn a_block_is_reused_cleanly() {
        let config = config("{}");
        let renderer = Renderer::new(&config);
        let mut block = HeaderBlock::default();
        renderer.render(&verdict(false, 0, SECOND, SECOND), &mut block);
        assert_eq!(block.iter().count(), 4);
        renderer.render(&verdict(true, 5, 0, 0), &mut block);
        let fields: Vec<_> = block.iter().collect();
        assert_eq!(fields, vec![("ratelimit-policy", "\"per-key\";q=100;w=60"), ("ratelimit", "\"per-key\";r=5;t=0")]);
    }
}
