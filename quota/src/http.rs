//! The HTTP layer: routes, bearer-token check, body limits, and the mapping
//! of every failure to a 4xx/5xx with a JSON `{"error": ...}` body.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Extension;
use axum::Router;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::auth::{Bearer, Tokens};
use crate::server::BodyTimeout;
use crate::service::{ApiError, Origin, Service};
use crate::store::Caller;
use floodgate_protocol::{CheckRequest, ErrorBody, LeaseRequest, ReturnRequest, MAX_BODY_BYTES};

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct AppState {
    /// The service.
    pub service: Arc<Service>,
    /// The bearer tokens API calls need (none: every domain open).
    pub tokens: Arc<Tokens>,
}

/// A call of one domain.
trait OfDomain {
    fn domain(&self) -> &str;
}

impl OfDomain for CheckRequest {
    fn domain(&self) -> &str {
        &self.domain
    }
}

impl OfDomain for LeaseRequest {
    fn domain(&self) -> &str {
        &self.domain
    }
}

impl OfDomain for ReturnRequest {
    fn domain(&self) -> &str {
        &self.domain
    }
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

/// A refusal before the service is asked: status and message.
type Refusal = (StatusCode, String);

/// The call in `body`, admitted by the token in `headers` (a token that is
/// none of the service's is refused before the body is read), and who its
/// bearer is.
fn admitted<T: DeserializeOwned + OfDomain>(
    state: &AppState,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(T, Bearer), Refusal> {
    let unauthorized = |refused: crate::auth::Refused| (StatusCode::UNAUTHORIZED, refused.message().to_string());
    let bearer = state.tokens.bearer(headers).map_err(unauthorized)?;
    let call: T = parse(body)?;
    state.tokens.admit(&bearer, call.domain()).map_err(unauthorized)?;
    Ok((call, bearer))
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
    // A body that reads is read once, at full speed; only one that does not
    // is read again, tracking where it goes wrong, so that the answer can
    // name the field (the tracking is about 2 % of the service's work on a
    // check: 45.2 k → 44.4 k instructions under callgrind).
    if let Ok(value) = serde_json::from_slice(&bytes) {
        return Ok(value);
    }
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
    let response = match admitted::<CheckRequest>(&state, &headers, body) {
        Ok((req, _)) => outcome(state.service.check(req).await),
        Err((status, message)) => error(status, message),
    };
    record(&state, "check", response)
}

/// A lease's records are charged to its caller (set by the server loop,
/// absent where addresses do not tell callers apart); a caller of the
/// domain (see [`Tokens`]) reads and posts its notices.
async fn lease(
    State(state): State<AppState>,
    caller: Option<Extension<Caller>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let caller = caller.map(|Extension(caller)| caller);
    let response = match admitted::<LeaseRequest>(&state, &headers, body) {
        Ok((req, bearer)) => {
            let origin = Origin { caller, of_domain: state.tokens.of_domain(&bearer, &req.domain) };
            outcome(state.service.lease(req, origin).await)
        }
        Err((status, message)) => error(status, message),
    };
    record(&state, "lease", response)
}

async fn give_back(State(state): State<AppState>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    let response = match admitted::<ReturnRequest>(&state, &headers, body) {
        Ok((req, _)) => outcome(state.service.give_back(req).await),
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
