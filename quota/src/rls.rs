//! Envoy's rate limit service API (`envoy.service.ratelimit.v3`,
//! `RateLimitService.ShouldRateLimit`) over gRPC, so that Envoy's own
//! `envoy.filters.http.ratelimit` filter can use this service in place of
//! envoyproxy/ratelimit. Every call is one [`Service::check`]: the same
//! limits, store, all-or-nothing decision and metrics as `POST /v1/check`.
//! `quota/README.md` ("Envoy's rate limit service API") documents the mapping.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code as RlsCode, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

use crate::http::{bearer_token, same};
use crate::service::{ApiError, Service};
use floodgate_protocol::{CheckRequest, CheckResponse, CheckStatus, Code, MAX_BODY_BYTES};

/// Command-line flags of the gRPC API (flattened into the binary's own).
#[derive(Debug, Clone, clap::Args)]
pub struct GrpcArgs {
    /// Also serve Envoy's rate limit service API (gRPC,
    /// envoy.service.ratelimit.v3) on this address. Off unless given.
    #[arg(long, value_name = "ADDR")]
    pub grpc_listen: Option<SocketAddr>,

    /// Ask Envoy to add `RateLimit-Limit`, `RateLimit-Remaining` and
    /// `RateLimit-Reset` to responses (as envoyproxy/ratelimit's
    /// LIMIT_RESPONSE_HEADERS_ENABLED does).
    #[arg(long)]
    pub grpc_response_headers: bool,
}

/// How the gRPC API behaves.
#[derive(Debug, Clone, Default)]
pub struct RlsOptions {
    /// Return `RateLimit-*` headers for Envoy to add to the response.
    pub response_headers: bool,
    /// With `Some`, calls need the metadata `authorization: Bearer <token>`.
    pub auth_token: Option<Arc<str>>,
}

/// The `RateLimitService` implementation over a [`Service`].
#[derive(Debug)]
pub struct RateLimiter {
    service: Arc<Service>,
    response_headers: bool,
    /// When an unknown domain was last logged (seconds since start): a
    /// misconfigured Envoy sends one per request.
    last_unknown_log: AtomicU64,
    started: Instant,
}

impl RateLimiter {
    /// A rate limit service answering from `service`.
    pub fn new(service: Arc<Service>, response_headers: bool) -> Self {
        Self { service, response_headers, last_unknown_log: AtomicU64::new(u64::MAX), started: Instant::now() }
    }

    async fn decide(&self, request: RateLimitRequest) -> Result<RateLimitResponse, Status> {
        let check = to_check_request(request)?;
        let count = check.descriptors.len();
        match self.service.check(check).await {
            Ok(answer) => Ok(to_response(&answer, self.response_headers)),
            // envoyproxy/ratelimit answers OK for a domain it does not know
            // (nothing matches); a drop-in does the same, and says so in the log.
            Err(ApiError::UnknownDomain(domain)) => {
                let second = self.started.elapsed().as_secs();
                if self.last_unknown_log.swap(second, Ordering::Relaxed) != second {
                    tracing::warn!(
                        domain,
                        "ShouldRateLimit for an unknown domain: answering OK (logged at most once a second)"
                    );
                }
                Ok(RateLimitResponse {
                    overall_code: RlsCode::Ok as i32,
                    statuses: vec![DescriptorStatus { code: RlsCode::Ok as i32, ..Default::default() }; count],
                    ..Default::default()
                })
            }
            Err(ApiError::BadRequest(why)) => Err(Status::invalid_argument(why)),
            // Envoy's filter treats an error as its `failure_mode_deny` says.
            Err(e @ ApiError::Store(_)) => Err(Status::unavailable(e.to_string())),
        }
    }
}

#[tonic::async_trait]
impl RateLimitService for RateLimiter {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let result = self.decide(request.into_inner()).await;
        let code = match &result {
            Ok(_) => tonic::Code::Ok,
            Err(status) => status.code(),
        };
        self.service.metrics().requests.with_label_values(&["rls", grpc_code_name(code)]).inc();
        result.map(Response::new)
    }
}

/// The canonical name of a gRPC status code, as a metric label.
fn grpc_code_name(code: tonic::Code) -> &'static str {
    match code {
        tonic::Code::Ok => "OK",
        tonic::Code::InvalidArgument => "INVALID_ARGUMENT",
        tonic::Code::Unimplemented => "UNIMPLEMENTED",
        tonic::Code::Unavailable => "UNAVAILABLE",
        tonic::Code::Unauthenticated => "UNAUTHENTICATED",
        _ => "OTHER",
    }
}

/// The cost of each descriptor: its own `hits_addend` when set, else the
/// request's (0 there means 1, as the proto says).
fn descriptor_hits(request_hits: u32, descriptor: &RateLimitDescriptor) -> u64 {
    descriptor.hits_addend.map_or(u64::from(request_hits.max(1)), |v| v.value)
}

/// Maps a `RateLimitRequest` onto a check. One check decides every
/// descriptor at once with one cost, so descriptors whose `hits_addend`
/// differ are refused rather than decided separately (which would give up
/// all-or-nothing) or at a cost they did not ask for.
fn to_check_request(request: RateLimitRequest) -> Result<CheckRequest, Status> {
    let mut hits: Option<(usize, u64)> = None;
    let mut descriptors = Vec::with_capacity(request.descriptors.len());
    for (i, descriptor) in request.descriptors.into_iter().enumerate() {
        if descriptor.limit.is_some() {
            return Err(Status::unimplemented(format!(
                "descriptors[{i}].limit: per-request limit overrides are not supported; put the limit in the limits file"
            )));
        }
        let cost = descriptor_hits(request.hits_addend, &descriptor);
        match hits {
            None => hits = Some((i, cost)),
            Some((first, first_cost)) if first_cost != cost => {
                return Err(Status::invalid_argument(format!(
                    "descriptors[{i}] costs {cost} hits but descriptors[{first}] costs {first_cost}: every descriptor of a \
                     request must have the same hits_addend, as they are decided together"
                )));
            }
            Some(_) => {}
        }
        descriptors.push(descriptor.entries.into_iter().map(|e| (e.key, e.value)).collect());
    }
    Ok(CheckRequest {
        domain: request.domain,
        descriptors,
        hits: hits.map_or(u64::from(request.hits_addend.max(1)), |(_, h)| h),
    })
}

/// The RLS unit of a period, when it is one. The limits file only has RLS
/// units, so today every period maps; anything else would be `UNKNOWN`.
fn unit_of(window_ms: u64) -> Unit {
    const DAY: u64 = 86_400_000;
    match window_ms {
        1_000 => Unit::Second,
        60_000 => Unit::Minute,
        3_600_000 => Unit::Hour,
        DAY => Unit::Day,
        w if w == 7 * DAY => Unit::Week,
        w if w == 30 * DAY => Unit::Month,
        w if w == 365 * DAY => Unit::Year,
        _ => Unit::Unknown,
    }
}

fn saturate(value: u64) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}

fn to_status(result: &CheckStatus) -> DescriptorStatus {
    match (result.code, result.limit) {
        // As envoyproxy/ratelimit: unlimited reports everything remaining,
        // no rule reports nothing; neither has a current limit.
        (Code::Unlimited, _) => {
            DescriptorStatus { code: RlsCode::Ok as i32, limit_remaining: u32::MAX, ..Default::default() }
        }
        (Code::NoRule, _) | (_, None) => DescriptorStatus { code: RlsCode::Ok as i32, ..Default::default() },
        (code, Some(limit)) => DescriptorStatus {
            // Shadow rules come back `ok` with `shadow_over_limit`: OK here too.
            code: if code == Code::OverLimit { RlsCode::OverLimit } else { RlsCode::Ok } as i32,
            current_limit: Some(RateLimit {
                name: String::new(),
                requests_per_unit: saturate(limit),
                unit: unit_of(result.window_ms.unwrap_or(0)) as i32,
            }),
            limit_remaining: saturate(result.remaining.unwrap_or(0)),
            duration_until_reset: result.reset_ms.map(|ms| ProtoDuration {
                seconds: i64::try_from(ms / 1_000).unwrap_or(i64::MAX),
                // Below 10⁹ by construction.
                nanos: i32::try_from((ms % 1_000) * 1_000_000).unwrap_or(0),
            }),
            quota: None,
        },
    }
}

/// Maps a check's answer onto the RLS response; with `headers`, adds the
/// `RateLimit-*` headers of the descriptor with the least remaining, as
/// envoyproxy/ratelimit does.
fn to_response(answer: &CheckResponse, headers: bool) -> RateLimitResponse {
    let statuses: Vec<DescriptorStatus> = answer.results.iter().map(to_status).collect();
    let tightest = statuses
        .iter()
        .filter_map(|s| s.current_limit.as_ref().map(|limit| (s, limit)))
        .min_by_key(|(s, _)| s.limit_remaining);
    let response_headers_to_add = match tightest {
        Some((status, limit)) if headers => {
            let reset = status.duration_until_reset.map_or(0, |d| d.seconds + i64::from(d.nanos > 0));
            vec![
                header("RateLimit-Limit", limit.requests_per_unit.to_string()),
                header("RateLimit-Remaining", status.limit_remaining.to_string()),
                header("RateLimit-Reset", reset.to_string()),
            ]
        }
        _ => Vec::new(),
    };
    RateLimitResponse {
        overall_code: if answer.allowed { RlsCode::Ok } else { RlsCode::OverLimit } as i32,
        statuses,
        response_headers_to_add,
        ..Default::default()
    }
}

fn header(key: &str, value: String) -> HeaderValue {
    HeaderValue { key: key.to_string(), value, ..Default::default() }
}

/// Serves the API on `listener` until `shutdown` completes, then finishes
/// calls in flight.
pub async fn serve(
    listener: tokio::net::TcpListener,
    service: Arc<Service>,
    options: RlsOptions,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), String> {
    let server = RateLimitServiceServer::new(RateLimiter::new(service, options.response_headers))
        .max_decoding_message_size(MAX_BODY_BYTES);
    let token = options.auth_token;
    let authorize = move |request: Request<()>| -> Result<Request<()>, Status> {
        let Some(expected) = &token else { return Ok(request) };
        let given = request.metadata().get("authorization").map(|v| v.as_bytes());
        match given.and_then(bearer_token) {
            Some(token) if same(token, expected.as_bytes()) => Ok(request),
            _ if given.is_none() => Err(Status::unauthenticated("missing authorization: Bearer token")),
            _ => Err(Status::unauthenticated("wrong bearer token")),
        }
    };
    tonic::transport::Server::builder()
        .add_service(InterceptedService::new(server, authorize))
        .serve_with_incoming_shutdown(TcpIncoming::from(listener).with_nodelay(Some(true)), shutdown)
        .await
        .map_err(|e| format!("gRPC server failed: {e}"))
}
