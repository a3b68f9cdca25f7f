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

use crate::algorithm::{Decision, Quota};
use crate::config::{HeaderStyle, Response, Rule};
use crate::text::InlineText;

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
    /// Removes every field.
    pub fn clear(&mut self) {
        self.text.clear();
        self.len = 0;
    }

    /// True when there is no field.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The fields, in order, as (name, value).
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &str)> + Clone {
        self.fields[..self.len].iter().map(|&(name, start, end)| (name, self.text.slice(start, end)))
    }

    /// The fields, in order, as (name, value bytes): for a host that takes
    /// bytes, without checking again that the values are text.
    pub fn fields(&self) -> impl Iterator<Item = (&'static str, &[u8])> {
        self.fields[..self.len].iter().map(|&(name, start, end)| (name, self.text.slice_bytes(start, end)))
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

/// The parts of a rule's headers that never change: rendered once per
/// configuration, kept in the rule's [`crate::limiter::CompiledRule`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleHeaders {
    /// `"<name>";q=<limit>;w=<seconds>` (ietf; no `w` without a window) or
    /// `<limit>` (x-ratelimit).
    policy: String,
    /// `"<name>";q=` (ietf): a global rule's policy is rendered per response
    /// from what the quota service last said.
    policy_prefix: String,
    /// `"<name>";r=` (ietf).
    prefix: String,
}

impl RuleHeaders {
    /// Renders `rule`'s constant parts in `style`.
    pub fn new(style: HeaderStyle, rule: &Rule) -> Self {
        let quota = rule.quota();
        match style {
            HeaderStyle::Ietf => {
                let window = quota.window.map(|w| format!(";w={}", w.ceil_seconds())).unwrap_or_default();
                Self {
                    policy: format!("\"{}\";q={}{window}", rule.name, quota.limit),
                    policy_prefix: format!("\"{}\";q=", rule.name),
                    prefix: format!("\"{}\";r=", rule.name),
                }
            }
            HeaderStyle::XRateLimit | HeaderStyle::None => {
                Self { policy: quota.limit.to_string(), policy_prefix: String::new(), prefix: String::new() }
            }
        }
    }
}

/// Writes into `out` the headers of a response: for a limited one (`allowed`
/// false), or an allowed one when `response.headers_on_allowed`. `report` is
/// the rule whose numbers to show, if any rule decided, with the limit the
/// quota service stated for a global rule.
pub fn render(
    response: &Response,
    allowed: bool,
    report: Option<(&RuleHeaders, Decision, Option<Quota>)>,
    out: &mut HeaderBlock,
) {
    out.clear();
    if !allowed {
        if let Some((_, decision, _)) = report {
            out.push("retry-after", |s| s.push_u64(decision.retry_after().ceil_seconds().max(1)));
        }
        out.push("x-envoy-ratelimited", |s| s.push_str("true"));
    } else if !response.headers_on_allowed {
        return;
    }
    let Some((rule, decision, stated)) = report else { return };
    let (remaining, reset) = (decision.remaining, decision.reset.ceil_seconds());
    match response.headers {
        HeaderStyle::Ietf => {
            out.push("ratelimit-policy", |s| match stated {
                None => s.push_str(&rule.policy),
                Some(Quota { limit, window }) => {
                    s.push_str(&rule.policy_prefix)
                        && s.push_u64(limit)
                        && window.is_none_or(|w| s.push_str(";w=") && s.push_u64(w.ceil_seconds()))
                }
            });
            out.push("ratelimit", |s| {
                s.push_str(&rule.prefix) && s.push_u64(remaining) && s.push_str(";t=") && s.push_u64(reset)
            });
        }
        HeaderStyle::XRateLimit => {
            out.push("x-ratelimit-limit", |s| match stated {
                None => s.push_str(&rule.policy),
                Some(quota) => s.push_u64(quota.limit),
            });
            out.push("x-ratelimit-remaining", |s| s.push_u64(remaining));
            out.push("x-ratelimit-reset", |s| s.push_u64(reset));
        }
        HeaderStyle::None => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::time::{Nanos, SECOND};
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn config(response: &str) -> Config {
        let json =
            format!(r#"{{"rules": [{{"name": "per-key", "limit": 100, "period": "1m"}}], "response": {response}}}"#);
        Config::parse(json.as_bytes()).unwrap()
    }

    fn decision(allowed: bool, remaining: u64, reset: u64, retry_after: u64) -> Decision {
        if allowed {
            Decision::admit(remaining, Nanos::from_nanos(reset))
        } else {
            Decision::deny(remaining, Nanos::from_nanos(reset), Nanos::from_nanos(retry_after))
        }
    }

    fn headers(config: &Config, allowed: bool, decision: Decision) -> Vec<(&'static str, String)> {
        let rule = RuleHeaders::new(config.settings.response.headers, &config.rules[0]);
        let mut out = HeaderBlock::default();
        render(&config.settings.response, allowed, Some((&rule, decision, None)), &mut out);
        out.iter().map(|(n, v)| (n, v.to_string())).collect()
    }

    #[test]
    fn fields_are_the_same_as_the_text_fields() {
        let mut block = HeaderBlock::default();
        block.push("ratelimit", |text| text.push_str("\"r\";r=9;t=1"));
        block.push("retry-after", |text| text.push_u64(12));
        let text: Vec<(&str, &[u8])> = block.iter().map(|(name, value)| (name, value.as_bytes())).collect();
        let bytes: Vec<(&str, &[u8])> = block.fields().collect();
        assert_eq!(bytes, text);
        assert_eq!(bytes.len(), 2);
    }

    #[test]
    fn ietf_fields_on_a_limited_response() {
        let out = headers(&config("{}"), false, decision(false, 0, 600_000_000, 1_200_000_000));
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
        let out = headers(&config("{}"), true, decision(true, 41, 0, 0));
        assert_eq!(out[1], ("ratelimit", "\"per-key\";r=41;t=0".to_string()));
        assert!(headers(&config(r#"{"headers_on_allowed": false}"#), true, decision(true, 41, 0, 0)).is_empty());
    }

    #[test]
    fn x_ratelimit_style() {
        let out = headers(&config(r#"{"headers": "x-ratelimit"}"#), true, decision(true, 7, 3 * SECOND.get() + 1, 0));
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
        let out = headers(&config(r#"{"headers": "none"}"#), false, decision(false, 0, 0, 10));
        assert_eq!(out, vec![("retry-after", "1".to_string()), ("x-envoy-ratelimited", "true".to_string())]);
    }

    #[test]
    fn a_failure_denial_has_no_numbers_to_report() {
        let config = config("{}");
        let mut out = HeaderBlock::default();
        render(&config.settings.response, false, None, &mut out);
        assert_eq!(out.iter().collect::<Vec<_>>(), vec![("x-envoy-ratelimited", "true")]);
    }

    #[test]
    fn a_block_is_reused_cleanly() {
        let config = config("{}");
        let rule = RuleHeaders::new(config.settings.response.headers, &config.rules[0]);
        let mut block = HeaderBlock::default();
        render(
            &config.settings.response,
            false,
            Some((&rule, decision(false, 0, SECOND.get(), SECOND.get()), None)),
            &mut block,
        );
        assert_eq!(block.iter().count(), 4);
        render(&config.settings.response, true, Some((&rule, decision(true, 5, 0, 0), None)), &mut block);
        let fields: Vec<_> = block.iter().collect();
        assert_eq!(fields, vec![("ratelimit-policy", "\"per-key\";q=100;w=60"), ("ratelimit", "\"per-key\";r=5;t=0")]);
    }
}
