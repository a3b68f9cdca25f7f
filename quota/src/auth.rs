//! The bearer tokens the APIs may require: the service's (`--auth-token`),
//! one check for the HTTP `Authorization` header and the gRPC
//! `authorization` metadata; and on the JSON API, a domain's own
//! (`--domain-token`), which admits calls of that domain only and makes
//! its bearer a caller *of* the domain, the only one that reads (and posts
//! to) the domain's near-limit notices (see [`Tokens`]).

use std::collections::HashMap;
use std::sync::Arc;

use axum::http::{header, HeaderMap};

/// Why a call was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// No `authorization` header.
    Missing,
    /// Not `Bearer` with the expected token.
    Wrong,
    /// A domain's token, on a call of another domain.
    OtherDomain,
}

impl Refused {
    /// What the caller is told.
    pub fn message(self) -> &'static str {
        match self {
            Refused::Missing => "missing Authorization: Bearer token",
            Refused::Wrong => "wrong bearer token",
            Refused::OtherDomain => "this bearer token is another domain's",
        }
    }
}

/// Admits a call whose `authorization` header is `Bearer <expected>` (any
/// case of the scheme, RFC 9110 section 11.1; the token exactly), or any
/// call when no token is expected.
pub fn authorize(expected: Option<&str>, headers: &HeaderMap) -> Result<(), Refused> {
    let Some(expected) = expected else { return Ok(()) };
    let given = headers.get(header::AUTHORIZATION).ok_or(Refused::Missing)?.as_bytes();
    match given.split_at_checked(BEARER.len()) {
        Some((scheme, token)) if scheme.eq_ignore_ascii_case(BEARER) && same(token, expected.as_bytes()) => Ok(()),
        _ => Err(Refused::Wrong),
    }
}

const BEARER: &[u8] = b"Bearer ";

/// Compares without an early exit, so response times do not reveal how much
/// of a guessed token was right.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Who a JSON API call is, as its bearer token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bearer {
    /// No token given.
    Anonymous,
    /// The service's token (`--auth-token`): any domain's calls.
    Service,
    /// The named domain's token (`--domain-token`): that domain's calls.
    Domain(String),
}

/// The tokens of the JSON API: the service's, admitting calls of every
/// domain, and each domain's own, admitting that domain's calls. A domain
/// with neither (no `--auth-token`, no token of its own) is open. A
/// domain's near-limit notices name its keys (a user, an address), so only
/// a caller *of* that domain reads them or posts to them: one with the
/// domain's token, or anyone on an open domain. With one token for every
/// domain the service cannot tell which domain a caller is of, so the
/// service's token reads no domain's notices.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    service: Option<Arc<str>>,
    domains: HashMap<String, Arc<str>>,
}

impl Tokens {
    /// The service's token, if any, and each domain's.
    pub fn new(service: Option<Arc<str>>, domains: HashMap<String, Arc<str>>) -> Self {
        Tokens { service, domains }
    }

    /// Only the service's token (or none: every domain open).
    pub fn service(service: Option<Arc<str>>) -> Self {
        Tokens { service, domains: HashMap::new() }
    }

    /// Whether any token is required at all.
    pub fn any(&self) -> bool {
        self.service.is_some() || !self.domains.is_empty()
    }

    /// Who the `authorization` header of `headers` says the caller is: a
    /// token given must be one of the service's tokens. Anonymous is
    /// refused at once when the service has its own token (no domain is
    /// open).
    pub fn bearer(&self, headers: &HeaderMap) -> Result<Bearer, Refused> {
        if !self.any() {
            return Ok(Bearer::Anonymous);
        }
        let Some(given) = headers.get(header::AUTHORIZATION) else {
            return match self.service {
                Some(_) => Err(Refused::Missing),
                None => Ok(Bearer::Anonymous),
            };
        };
        let token = match given.as_bytes().split_at_checked(BEARER.len()) {
            Some((scheme, token)) if scheme.eq_ignore_ascii_case(BEARER) => token,
            _ => return Err(Refused::Wrong),
        };
        // Every token is compared, so the time taken says nothing of which
        // (or how much of one) matched.
        let mut found = None;
        if self.service.as_deref().is_some_and(|t| same(token, t.as_bytes())) {
            found = Some(Bearer::Service);
        }
        for (domain, expected) in &self.domains {
            if same(token, expected.as_bytes()) && found.is_none() {
                found = Some(Bearer::Domain(domain.clone()));
            }
        }
        found.ok_or(Refused::Wrong)
    }

    /// Admits `bearer`'s call of `domain`, or says why not.
    pub fn admit(&self, bearer: &Bearer, domain: &str) -> Result<(), Refused> {
        match bearer {
            Bearer::Service => Ok(()),
            Bearer::Domain(own) if own == domain => Ok(()),
            Bearer::Domain(_) => Err(Refused::OtherDomain),
            Bearer::Anonymous if self.open(domain) => Ok(()),
            Bearer::Anonymous => Err(Refused::Missing),
        }
    }

    /// Whether `bearer` (admitted for `domain`) is a caller of `domain`:
    /// may read its near-limit notices and post to them.
    pub fn of_domain(&self, bearer: &Bearer, domain: &str) -> bool {
        match bearer {
            Bearer::Domain(own) => own == domain,
            Bearer::Anonymous => self.open(domain),
            Bearer::Service => false,
        }
    }

    fn open(&self, domain: &str) -> bool {
        self.service.is_none() && !self.domains.contains_key(domain)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bearing(token: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Some(token) = token {
            if let Ok(value) = format!("Bearer {token}").parse() {
                headers.insert(header::AUTHORIZATION, value);
            }
        }
        headers
    }

    #[test]
    fn a_domains_token_admits_its_domain_only_and_makes_its_bearer_a_caller_of_it() {
        let domains = HashMap::from([("edge".to_string(), Arc::from("e-secret")), ("api".to_string(), Arc::from("a"))]);
        let tokens = Tokens::new(Some(Arc::from("s-secret")), domains);
        let edge = tokens.bearer(&bearing(Some("e-secret")));
        assert_eq!(edge, Ok(Bearer::Domain("edge".into())));
        let edge = edge.unwrap_or(Bearer::Anonymous);
        assert_eq!(tokens.admit(&edge, "edge"), Ok(()));
        assert_eq!(tokens.admit(&edge, "api"), Err(Refused::OtherDomain));
        assert!(tokens.of_domain(&edge, "edge") && !tokens.of_domain(&edge, "api"));
        let service = tokens.bearer(&bearing(Some("s-secret"))).unwrap_or(Bearer::Anonymous);
        assert_eq!((tokens.admit(&service, "edge"), tokens.admit(&service, "api")), (Ok(()), Ok(())));
        assert!(!tokens.of_domain(&service, "edge"), "one token for every domain reads no domain's notices");
        assert_eq!(tokens.bearer(&bearing(Some("guess"))), Err(Refused::Wrong));
        assert_eq!(tokens.bearer(&bearing(None)), Err(Refused::Missing));
    }

    #[test]
    fn a_domain_without_a_token_is_open_only_when_the_service_has_none() {
        let domains = HashMap::from([("edge".to_string(), Arc::from("e-secret"))]);
        let tokens = Tokens::new(None, domains);
        let anonymous = tokens.bearer(&bearing(None)).unwrap_or(Bearer::Service);
        assert_eq!(anonymous, Bearer::Anonymous);
        assert_eq!(tokens.admit(&anonymous, "open"), Ok(()));
        assert!(tokens.of_domain(&anonymous, "open"), "anyone is a caller of an open domain");
        assert_eq!(tokens.admit(&anonymous, "edge"), Err(Refused::Missing));
        let none = Tokens::default();
        assert_eq!(none.bearer(&bearing(Some("anything"))), Ok(Bearer::Anonymous));
        assert!(none.of_domain(&Bearer::Anonymous, "edge"));
    }
}
