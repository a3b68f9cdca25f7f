//! The quota service's calls as global mode makes them: request bodies built
//! from claims and check items, answers read back into the pool's and the
//! limiter's terms. Any answer that is not exactly what was asked for — a
//! body that does not parse, a wrong number of items, a grant for another
//! lease — is a failed callout, never a panic.

use std::borrow::Cow;

use floodgate_protocol::{
    CheckRequest, CheckResponse, Code, LeaseRequest, LeaseResponse, LeaseWant, ReturnRequest, ReturnTokens,
    MAX_DESCRIPTORS, MAX_LEASES, MAX_NOTICES,
};

use super::settings::QuotaService;
use crate::algorithm::{Decision, Quota};
use crate::lease::overshoot::notice_key;
use crate::lease::pool::{Claim, GrantedLease};
use crate::time::Nanos;

/// Most leases (or returns) one call carries (the protocol's limit).
pub const MAX_ITEMS: usize = MAX_LEASES;

/// Most check items one call carries (the protocol's limit).
pub const MAX_CHECK_ITEMS: usize = MAX_DESCRIPTORS;

/// Largest answer body read; a larger one is a failure.
pub const MAX_ANSWER_BYTES: usize = 256 * 1024;

/// A refresh of one lease pool, claimed by a request: what to ask the quota
/// service for, and where the answer goes.
#[derive(Debug, Clone, PartialEq)]
pub struct Refresh {
    /// Index of the global rule in the limiter's rules.
    pub rule: usize,
    /// The pool's group in the rule's table.
    pub group: u32,
    /// The descriptor's fingerprint.
    pub fingerprint: u64,
    /// The claim (when, how much, at what rate, and by when to send it).
    pub claim: Claim,
    /// When the call carrying it left: the host sets it as it sends it
    /// (the claim's instant until then). The grant counts from there.
    pub sent: Nanos,
    /// The id to lease with (unique per claim; the service deduplicates by it).
    pub lease: u64,
    /// The descriptor's `[key, value]` pairs.
    pub descriptor: Vec<(String, String)>,
}

/// A check-mode rule's question for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckItem {
    /// Index of the global rule in the limiter's rules.
    pub rule: usize,
    /// The descriptor's `[key, value]` pairs.
    pub descriptor: Vec<(String, String)>,
    /// Units the request costs.
    pub hits: u64,
    /// The descriptor's fingerprint: where its local fall-back bucket is,
    /// should the service fail.
    pub(crate) fingerprint: u64,
}

/// The quota service's answer about one check item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckAnswer {
    /// Admitted (or over the limit in shadow mode) or denied, with the
    /// numbers to report.
    pub decision: Decision,
    /// The limit the service applied, if it said.
    pub quota: Option<Quota>,
}

/// One HTTP call to the quota service, sent as it is made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call<'s> {
    /// Request headers, pseudo-headers first; values the service's settings
    /// hold are borrowed from them (a check is a call per request).
    pub headers: Vec<(&'static str, Cow<'s, str>)>,
    /// The JSON body (empty for a GET).
    pub body: Vec<u8>,
}

/// Why a callout's answer is not usable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallError {
    /// Envoy refused to send it (e.g. no such cluster).
    NotSent(String),
    /// Not a 2xx (Envoy reports a refused connection as 503, a timeout as
    /// 504, a reset stream as no status at all).
    Status(Option<u16>),
    /// The body is not the expected JSON (named in the message).
    Body(String),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::NotSent(why) => write!(f, "the call was not sent: {why}"),
            CallError::Status(Some(status)) => write!(f, "the quota service answered {status}"),
            CallError::Status(None) => write!(f, "the quota service's stream was reset"),
            CallError::Body(why) => write!(f, "the quota service's answer is not usable: {why}"),
        }
    }
}

impl QuotaService {
    fn call(&self, method: &'static str, path: &'static str, body: Vec<u8>) -> Call<'_> {
        let mut headers = Vec::with_capacity(5);
        headers.extend([
            (":method", method.into()),
            (":path", path.into()),
            (":authority", self.authority.as_str().into()),
        ]);
        if !body.is_empty() {
            headers.push(("content-type", "application/json".into()));
        }
        if let Some(token) = &self.token {
            headers.push(("authorization", format!("Bearer {token}").into()));
        }
        Call { headers, body }
    }

    /// `POST /v1/lease` for up to [`MAX_ITEMS`] refreshes.
    pub fn lease_call(&self, refreshes: &[Refresh]) -> Call<'_> {
        let request = LeaseRequest {
            domain: self.domain.clone(),
            leases: refreshes
                .iter()
                .map(|r| LeaseWant {
                    id: lease_text(r.lease),
                    descriptor: r.descriptor.clone(),
                    wanted: r.claim.wanted,
                    rate: Some(r.claim.rate),
                    window: r.claim.window,
                    per_window: r.claim.per_window,
                    reported: r.claim.reported,
                    check: r.claim.check,
                })
                .collect(),
            notices: refreshes.iter().any(|r| r.claim.wants_notices),
        };
        self.call("POST", "/v1/lease", serde_json::to_vec(&request).unwrap_or_default())
    }

    /// `POST /v1/return` of unspent tokens, by lease.
    pub fn return_call(&self, returns: &[(u64, u64)]) -> Call<'_> {
        let request = ReturnRequest {
            domain: self.domain.clone(),
            returns: returns.iter().map(|&(lease, tokens)| ReturnTokens { id: lease_text(lease), tokens }).collect(),
        };
        self.call("POST", "/v1/return", serde_json::to_vec(&request).unwrap_or_default())
    }

    /// `POST /v1/check` of check items that cost the same `hits`.
    pub fn check_call(&self, items: &[&CheckItem], hits: u64) -> Call<'_> {
        let request = CheckRequest {
            domain: self.domain.clone(),
            descriptors: items.iter().map(|item| &item.descriptor).collect(),
            hits,
        };
        self.call("POST", "/v1/check", serde_json::to_vec(&request).unwrap_or_default())
    }

    /// `GET /readyz`: is the service there, with its store?
    pub fn probe_call(&self) -> Call<'_> {
        self.call("GET", "/readyz", Vec::new())
    }
}

/// A lease id as the protocol carries it: 16 hex digits.
pub fn lease_text(lease: u64) -> String {
    format!("{lease:016x}")
}

/// An answer's status, read only if its body does not read as an answer:
/// the service sends an answer's body only with a 2xx, and in the wasm
/// build every value read is a call into the VM and a copy (about 10 k
/// instructions), paid on every answer when the status was read first. An
/// answer that does not read fails with its status when that is not a
/// 2xx (Envoy's 503 or 504 for a failed call, the service's 4xx), and with
/// what is wrong with its body when it is.
fn or_status<T>(read: Result<T, CallError>, status: impl FnOnce() -> Option<u16>) -> Result<T, CallError> {
    read.or_else(|why| {
        usable_status(status())?;
        Err(why)
    })
}

fn usable_status(status: Option<u16>) -> Result<(), CallError> {
    match status {
        Some(200..=299) => Ok(()),
        other => Err(CallError::Status(other)),
    }
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, CallError> {
    if body.len() > MAX_ANSWER_BYTES {
        return Err(CallError::Body(format!("{} bytes is more than {MAX_ANSWER_BYTES}", body.len())));
    }
    // UTF-8 checked once, over the whole body: serde_json then reads each
    // string in place, where from bytes it checks every one again.
    let text = std::str::from_utf8(body).map_err(|e| CallError::Body(format!("not UTF-8: {e}")))?;
    serde_json::from_str(text).map_err(|e| CallError::Body(e.to_string()))
}

/// A lease call's answer, read.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseAnswer {
    /// One grant per refresh, in order; `Err` carries why the service
    /// refused that lease without deciding it (`LeaseGrant::refused`: its
    /// caller holds its share of the service's lease records), which is
    /// not a limit: the rule falls back as it would on a failed call.
    pub grants: Vec<Result<GrantedLease, String>>,
    /// The near-limit notices it brought: each key
    /// ([`crate::lease::overshoot::notice_key`]) and for how long from now.
    pub near: Vec<(u64, Nanos)>,
}

/// Reads a lease answer for `refreshes` (in order): one grant each, and
/// the notices; `status` is read only if the body is not one.
pub fn read_leases(
    status: impl FnOnce() -> Option<u16>,
    body: &[u8],
    refreshes: &[Refresh],
) -> Result<LeaseAnswer, CallError> {
    or_status(leases_of(body, refreshes), status)
}

fn leases_of(body: &[u8], refreshes: &[Refresh]) -> Result<LeaseAnswer, CallError> {
    let answer: LeaseResponse = parse(body)?;
    if answer.leases.len() != refreshes.len() {
        return Err(CallError::Body(format!("{} leases for {} asked", answer.leases.len(), refreshes.len())));
    }
    let near = answer
        .near
        .iter()
        .take(MAX_NOTICES)
        .map(|notice| (notice_key(&notice.descriptor), Nanos::from_millis(notice.for_ms)))
        .collect();
    let grants = answer
        .leases
        .iter()
        .zip(refreshes)
        .map(|(grant, refresh)| {
            if let Some(why) = &grant.refused {
                return Err(why.clone());
            }
            let window = Nanos::from_millis(grant.report.window_ms.unwrap_or(0));
            let (granted, unleased) = match grant.code {
                // Not limited: as much as was asked, for as long as granted.
                Code::Unlimited | Code::NoRule => (refresh.claim.wanted, 0),
                Code::Ok | Code::OverLimit => (grant.granted, grant.report.remaining.unwrap_or(0)),
            };
            Ok(GrantedLease {
                lease: refresh.lease,
                granted,
                valid: Nanos::from_millis(grant.valid_ms),
                starts: Nanos::from_millis(grant.starts_ms),
                index: grant.window.unwrap_or(0),
                windows: grant.windows,
                limit: grant.report.limit.unwrap_or(0),
                window,
                unleased,
                reset: Nanos::from_millis(grant.report.reset_ms.unwrap_or(0)),
                near_limit: grant.near_limit,
                report_only: refresh.claim.wanted == 0,
                // Only a check asked for is taken for one: an answer that
                // says so of a lease still returns what it leaves.
                checked: grant.checked && refresh.claim.check,
            })
        })
        .collect();
    Ok(LeaseAnswer { grants, near })
}

/// Reads a check answer for `items` (in order); `status` is read only if
/// the body is not one.
pub fn read_checks(
    status: impl FnOnce() -> Option<u16>,
    body: &[u8],
    items: usize,
) -> Result<Vec<CheckAnswer>, CallError> {
    or_status(checks_of(body, items), status)
}

fn checks_of(body: &[u8], items: usize) -> Result<Vec<CheckAnswer>, CallError> {
    let answer: CheckResponse = parse(body)?;
    if answer.results.len() != items {
        return Err(CallError::Body(format!("{} results for {items} descriptors", answer.results.len())));
    }
    Ok(answer
        .results
        .iter()
        .map(|result| {
            let remaining = result.report.remaining.unwrap_or(0);
            let reset = Nanos::from_millis(result.report.reset_ms.unwrap_or(0));
            let quota = result
                .report
                .limit
                .map(|limit| Quota { limit, window: result.report.window_ms.map(Nanos::from_millis) });
            let decision = match (result.code, result.retry_after_ms) {
                (Code::OverLimit, retry) => {
                    let retry_after = match retry {
                        Some(floodgate_protocol::Retry::After(ms)) => Nanos::from_millis(ms),
                        Some(floodgate_protocol::Retry::Never) => Nanos::NEVER,
                        None => reset,
                    };
                    Decision::deny(remaining, reset, retry_after)
                }
                _ => Decision::admit(remaining, reset),
            };
            CheckAnswer { decision, quota }
        })
        .collect())
}

/// Reads a probe's answer: any 2xx means the service is back.
pub fn read_probe(status: Option<u16>) -> Result<(), CallError> {
    usable_status(status)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::SECOND;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn service() -> QuotaService {
        QuotaService {
            cluster: "quota".into(),
            authority: "quota.local".into(),
            domain: "edge".into(),
            timeout: Nanos::from_millis(300),
            token: Some("s3cret".into()),
            max_wait: Nanos::from_millis(200),
            lease_horizon: SECOND,
        }
    }

    fn refresh(lease: u64) -> Refresh {
        Refresh {
            rule: 0,
            group: 0,
            fingerprint: 7,
            claim: Claim {
                started: Nanos::ZERO,
                wanted: 40,
                rate: 20.0,
                window: None,
                send_by: Nanos::ZERO,
                not_before: Nanos::ZERO,
                per_window: true,
                reported: 2,
                wants_notices: true,
                check: false,
            },
            sent: Nanos::ZERO,
            lease,
            descriptor: vec![("api_key".into(), "alice".into())],
        }
    }

    #[test]
    fn a_lease_call_says_who_asks_for_what() {
        let service = service();
        let call = service.lease_call(&[refresh(0xab)]);
        assert_eq!(call.headers[0], (":method", "POST".into()));
        assert_eq!(call.headers[1], (":path", "/v1/lease".into()));
        assert_eq!(call.headers[2], (":authority", "quota.local".into()));
        assert!(call.headers.contains(&("authorization", "Bearer s3cret".into())));
        let body: serde_json::Value = serde_json::from_slice(&call.body).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"domain": "edge", "leases": [{"id": "00000000000000ab",
                "descriptor": [["api_key", "alice"]], "wanted": 40, "rate": 20.0, "per_window": true,
                "reported": 2}], "notices": true})
        );
    }

    #[test]
    fn a_grant_is_read_into_the_pools_terms() {
        let body = br#"{"leases": [{"code": "ok", "granted": 30, "valid_ms": 1000, "limit": 100,
            "window_ms": 60000, "remaining": 20, "reset_ms": 5000, "window": 3, "windows": 2,
            "near_limit": true}], "near": [{"descriptor": [["user", "bob"]], "for_ms": 1500}]}"#;
        let answer = read_leases(|| Some(200), body, &[refresh(9)]).unwrap();
        let bob = notice_key(&[("user".into(), "bob".into())]);
        assert_eq!(answer.near, vec![(bob, Nanos::from_millis(1500))]);
        assert_eq!(
            answer.grants,
            vec![Ok(GrantedLease {
                lease: 9,
                granted: 30,
                valid: SECOND,
                starts: Nanos::ZERO,
                index: 3,
                windows: 2,
                limit: 100,
                window: SECOND.times(60),
                unleased: 20,
                reset: SECOND.times(5),
                near_limit: true,
                report_only: false,
                checked: false,
            })]
        );
    }

    #[test]
    fn a_refused_lease_is_read_as_refused_beside_the_calls_other_grants() {
        let body = br#"{"leases": [
            {"code": "ok", "granted": 0, "valid_ms": 0, "limit": 100, "window_ms": 1000, "reset_ms": 1000,
             "refused": "the caller holds its share of the lease records"},
            {"code": "ok", "granted": 7, "valid_ms": 1000, "limit": 100, "window_ms": 1000, "remaining": 50}]}"#;
        let answer = read_leases(|| Some(200), body, &[refresh(1), refresh(2)]).unwrap();
        assert_eq!(answer.grants[0], Err("the caller holds its share of the lease records".to_string()));
        let second = answer.grants[1].clone().unwrap();
        assert_eq!((second.lease, second.granted, second.unleased), (2, 7, 50));
    }

    #[test]
    fn anything_but_the_expected_answer_is_a_failure_not_a_panic() {
        let one = [refresh(1)];
        assert_eq!(read_leases(|| Some(503), b"", &one), Err(CallError::Status(Some(503))));
        assert_eq!(read_leases(|| Some(504), b"", &one), Err(CallError::Status(Some(504))));
        assert_eq!(read_leases(|| None, b"", &one), Err(CallError::Status(None)));
        assert!(matches!(read_leases(|| Some(200), b"not json", &one), Err(CallError::Body(_))));
        assert!(matches!(read_leases(|| Some(200), br#"{"leases": []}"#, &one), Err(CallError::Body(_))));
        assert!(matches!(read_leases(|| Some(200), br#"{"leases": [{"granted": 3}]}"#, &one), Err(CallError::Body(_))));
        assert!(matches!(read_leases(|| Some(200), br#"{"wrong": 1}"#, &one), Err(CallError::Body(_))));
        let huge = vec![b' '; MAX_ANSWER_BYTES + 1];
        assert!(matches!(read_leases(|| Some(200), &huge, &one), Err(CallError::Body(_))));
        assert!(matches!(
            read_checks(|| Some(200), br#"{"allowed": true, "results": []}"#, 1),
            Err(CallError::Body(_))
        ));
    }

    /// The status is read only for an answer whose body does not read:
    /// then a status other than 2xx is what failed the call.
    #[test]
    fn the_status_is_read_only_when_the_body_is_no_answer() {
        let body = br#"{"allowed": true, "results": [{"code": "ok"}]}"#;
        let unread = || -> Option<u16> { panic!("the status of an answer that reads was read") };
        assert!(read_checks(unread, body, 1).is_ok());
        let error = br#"{"error": "missing or malformed bearer token"}"#;
        assert_eq!(read_checks(|| Some(401), error, 1), Err(CallError::Status(Some(401))));
        assert_eq!(read_leases(|| Some(401), error, &[refresh(1)]), Err(CallError::Status(Some(401))));
        let wrong_count = br#"{"allowed": true, "results": []}"#;
        assert_eq!(read_checks(|| Some(503), wrong_count, 1), Err(CallError::Status(Some(503))));
        assert!(matches!(read_checks(|| Some(200), error, 1), Err(CallError::Body(_))));
    }

    #[test]
    fn check_answers_carry_the_services_numbers() {
        let body = br#"{"allowed": false, "retry_after_ms": 1500, "results": [
            {"code": "ok", "limit": 5, "window_ms": 60000, "remaining": 4, "reset_ms": 100},
            {"code": "over_limit", "limit": 1, "window_ms": 1000, "remaining": 0, "reset_ms": 900, "retry_after_ms": 1500},
            {"code": "no_rule"}]}"#;
        let answers = read_checks(|| Some(200), body, 3).unwrap();
        let minute = Some(Quota { limit: 5, window: Some(SECOND.times(60)) });
        assert_eq!(answers[0], CheckAnswer { decision: Decision::admit(4, Nanos::from_millis(100)), quota: minute });
        let denied = Decision::deny(0, Nanos::from_millis(900), Nanos::from_millis(1500));
        assert_eq!(answers[1], CheckAnswer { decision: denied, quota: Some(Quota { limit: 1, window: Some(SECOND) }) });
        assert_eq!(answers[2], CheckAnswer { decision: Decision::admit(0, Nanos::ZERO), quota: None });
    }
}
