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

use crate::config::{Config, HeaderStyle};
use crate::limiter::Verdict;
use crate::time::ceil_seconds;

/// Appends the headers `verdict` calls for to `out`: for a limited response,
/// or for an allowed one when `response.headers_on_allowed` is set.
pub fn append(config: &Config, verdict: &Verdict, out: &mut Vec<(&'static str, String)>) {
    let report = verdict.report.and_then(|r| Some((config.rules.get(r.rule)?, r.decision)));
    if !verdict.allowed {
        if let Some((_, decision)) = report {
            out.push(("retry-after", ceil_seconds(decision.retry_after).max(1).to_string()));
        }
        out.push(("x-envoy-ratelimited", "true".to_string()));
    } else if !config.response.headers_on_allowed {
        return;
    }
    let Some((rule, decision)) = report else { return };
    let window = ceil_seconds(rule.period);
    let reset = ceil_seconds(decision.reset);
    match config.response.headers {
        HeaderStyle::Ietf => {
            out.push(("ratelimit-policy", format!("\"{}\";q={};w={}", rule.name, rule.limit, window)));
            out.push(("ratelimit", format!("\"{}\";r={};t={}", rule.name, decision.remaining, reset)));
        }
        HeaderStyle::XRateLimit => {
            out.push(("x-ratelimit-limit", rule.limit.to_string()));
            out.push(("x-ratelimit-remaining", decision.remaining.to_string()));
            out.push(("x-ratelimit-reset", reset.to_string()));
        }
        HeaderStyle::None => {}
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
            shadow_limited: false,
            failed: false,
            report: Some(Report { rule: 0, decision: Decision { allowed, remaining, reset, retry_after } }),
        }
    }

    fn headers(config: &Config, verdict: &Verdict) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        append(config, verdict, &mut out);
        out
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
        let failed = Verdict { allowed: false, shadow_limited: false, failed: true, report: None };
        assert_eq!(headers(&config("{}"), &failed), vec![("x-envoy-ratelimited", "true".to_string())]);
    }
}
