//! The bearer token both APIs may require (`--auth-token`): one check for
//! the HTTP `Authorization` header and the gRPC `authorization` metadata.

use axum::http::{header, HeaderMap};

/// Why a call was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// No `authorization` header.
    Missing,
    /// Not `Bearer` with the expected token.
    Wrong,
}

impl Refused {
    /// What the caller is told.
    pub fn message(self) -> &'static str {
        match self {
            Refused::Missing => "missing Authorization: Bearer token",
            Refused::Wrong => "wrong bearer token",
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
