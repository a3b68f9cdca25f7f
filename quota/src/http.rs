//! The HTTP layer: routes, bearer-token check, body limits, and the mapping
//! of every failure to a 4xx/5xx with a JSON `{"error": ...}` body.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::server::BodyTimeout;
use crate::service::{ApiError, Service};
use floodgate_protocol::{ErrorBody, MAX_BODY_BYTES};

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct AppState {
    /// The service.
    pub service: Arc<Service>,
    /// With `Some`, API calls need `Authorization: Bearer <token>`.
    pub auth_token: Option<Arc<str>>,
}

/// The router: `/v1/check`, `/v1/lease`, `/v1/return` (POST, JSON, behind
/// the token when one is set), `/healthz`, `/readyz` and `/metrics` (GET).
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/check", post(check))
        .route("/v1/lease", post(lease))
        .route("/v1/return", post(give_back))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            error(StatusCode::NOT_FOUND, "no such endpoint: use POST /v1/check, /v1/lease or /v1/return".into())
        })
        .method_not_allowed_fallback(|| async {
            error(
                StatusCode::METHOD_NOT_ALLOWED,
                "wrong method: the API takes POST, /healthz, /readyz and /metrics take GET".into(),
            )
        })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

fn json<T: Serialize>(status: StatusCode, body: &T) -> Response {
    match serde_json::to_vec(body) {
        Ok(bytes) => {
            (status, [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], bytes).into_response()
        }
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

fn error(status: StatusCode, message: String) -> Response {
    let mut response = json(status, &ErrorBody { error: message });
    if status == StatusCode::UNAUTHORIZED {
        response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    response
}

/// Compares without an early exit, so response times do not reveal how much
/// of a guessed token was right.
pub(crate) fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A refusal before the service is asked: status and message.
type Refusal = (StatusCode, String);

/// The token of a `Bearer` credential. The scheme is case-insensitive
/// (RFC 9110 section 11.1), so `bearer x` and `BEARER x` are the same credential.
pub(crate) fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let (scheme, token) = value.split_at_checked(b"Bearer ".len())?;
    scheme.eq_ignore_ascii_case(b"Bearer ").then_some(token)
}

fn authorize(state: &AppState, headers: &HeaderMap) -> Result<(), Refusal> {
    let Some(expected) = &state.auth_token else { return Ok(()) };
    let given = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
    let token = given.and_then(bearer_token);
    match (given, token) {
        (None, _) => Err((StatusCode::UNAUTHORIZED, "missing Authorization: Bearer token".into())),
        (Some(_), Some(token)) if same(token, expected.as_bytes()) => Ok(()),
        _ => Err((StatusCode::UNAUTHORIZED, "wrong bearer token".into())),
    }
}

/// The server's body deadline, if that is why the body could not be read.
fn body_timeout(rejection: &BytesRejection) -> Option<BodyTimeout> {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(rejection);
    while let Some(error) = cause {
        if let Some(timeout) = error.downcast_ref::<BodyTimeout>() {
            return Some(*timeout);
        }
        cause = error.source();
    }
    None
}

fn parse<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, Refusal> {
    let bytes = body.map_err(|rejection| {
        let status = rejection.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            (status, format!("request body is larger than {MAX_BODY_BYTES} bytes"))
        } else if let Some(timeout) = body_timeout(&rejection) {
            (StatusCode::REQUEST_TIMEOUT, timeout.to_string())
        } else {
            (StatusCode::BAD_REQUEST, format!("cannot read the request body: {rejection}"))
        }
    })?;
    let mut de = serde_json::Deserializer::from_slice(&bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let at = if path == "." { String::new() } else { format!(" at {path}") };
        (StatusCode::BAD_REQUEST, format!("malformed request{at}: {inner}"))
    })?;
    de.end().map_err(|e| (StatusCode::BAD_REQUEST, format!("malformed request: {e}")))?;
    Ok(value)
}

fn outcome<T: Serialize>(result: Result<T, ApiError>) -> Response {
    match result {
        Ok(body) => json(StatusCode::OK, &body),
        Err(e) => {
            let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            error(status, e.to_string())
        }
    }
}

fn record(state: &AppState, endpoint: &str, response: Response) -> Response {
    state.service.metrics().requests.with_label_values(&[endpoint, response.status().as_str()]).inc();
    response
}

async fn check(State(state): State<AppState>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    let response = match authorize(&state, &headers).and_then(|()| parse(body)) {
        Ok(req) => outcome(state.service.check(req).await),
        Err((status, message)) => error(status, message),
    };
    record(&state, "check", response)
}

async fn lease(State(state): State<AppState>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    let response = match authorize(&state, &headers).and_then(|()| parse(body)) {
        Ok(req) => outcome(state.service.lease(req).await),
        Err((status, message)) => error(status, message),
    };
    record(&state, "lease", response)
}

async fn give_back(State(state): State<AppState>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    let response = match authorize(&state, &headers).and_then(|()| parse(body)) {
        Ok(req) => outcome(state.service.give_back(req).await),
        Err((status, message)) => error(status, message),
    };
    record(&state, "return", response)
}

/// Ready when the store answers: a load balancer can steer away from an
/// instance whose Redis is gone (liveness stays `/healthz`).
async fn ready(State(state): State<AppState>) -> Response {
    match state.service.store().ping().await {
        Ok(()) => "ready\n".into_response(),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

async fn metrics(State(state): State<AppState>) -> Response {
    ([(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"))], state.service.metrics().render())
        .into_response()
}
