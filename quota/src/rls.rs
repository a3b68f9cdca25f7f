//! Envoy's rate limit service API (`envoy.service.ratelimit.v3`,
//! `RateLimitService.ShouldRateLimit`) over gRPC, so that Envoy's own
//! `envoy.filters.http.ratelimit` filter can use this service in place of
//! envoyproxy/ratelimit. Every call is one [`Service::check`]: the same
//! limits, store, all-or-nothing decision and metrics as `POST /v1/check`.
//! [`RlsService`] is the tower service [`crate::server`] serves over HTTP/2,
//! with the HTTP listener's protections.
//! `quota/README.md` ("Envoy's rate limit service API") documents the mapping.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Bytes;
use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code as RlsCode, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use floodgate_protocol::{CheckRequest, CheckResponse, CheckStatus, Code, MAX_BODY_BYTES};
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::{Request, Response, Status};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

use crate::auth::authorize;
use crate::metrics::grpc_code;
use crate::rlqs::{RlqsService, STREAM_RATE_LIMIT_QUOTAS};
use crate::service::{ApiError, Service};

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

    /// Most gRPC connections open at once (beyond it a connection is
    /// closed at once); the HTTP listener's other limits apply too.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    pub grpc_max_connections: u32,
}

/// How the gRPC API behaves.
#[derive(Debug, Clone, Default)]
pub struct RlsOptions {
    /// Return `RateLimit-*` headers for Envoy to add to the response.
    pub response_headers: bool,
    /// With `Some`, calls need the metadata `authorization: Bearer <token>`.
    pub auth_token: Option<Arc<str>>,
}

/// `ShouldRateLimit` over a [`Service`]: a call mapped onto a check.
#[derive(Debug)]
struct RateLimiter {
    service: Arc<Service>,
    response_headers: bool,
    /// When an unknown domain was last logged (seconds since start): a
    /// misconfigured Envoy sends one per request.
    last_unknown_log: AtomicU64,
    started: Instant,
}

impl RateLimiter {
    fn new(service: Arc<Service>, response_headers: bool) -> Self {
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
            Err(ApiError::BadRequest(why) | ApiError::IdInUse(why)) => Err(Status::invalid_argument(why)),
            // Envoy's filter treats an error as its `failure_mode_deny` says.
            Err(e @ ApiError::Store(_)) => Err(Status::unavailable(e.to_string())),
        }
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
    match (result.code, result.report.limit) {
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
                unit: unit_of(result.report.window_ms.unwrap_or(0)) as i32,
            }),
            limit_remaining: saturate(result.report.remaining.unwrap_or(0)),
            duration_until_reset: result.report.reset_ms.map(|ms| ProtoDuration {
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

/// The method this service answers.
const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// Envoy's rate limit service API as one tower service over HTTP/2 requests
/// (served by [`crate::server`]): the bearer token checked, the request
/// decoded (a malformed message is `INVALID_ARGUMENT`, naming what is
/// wrong), decided, and every call counted by its gRPC code, whatever
/// stage answered it.
#[derive(Debug, Clone)]
pub struct RlsService {
    limiter: Arc<RateLimiter>,
    auth_token: Option<Arc<str>>,
    /// Envoy's rate limit quota service on the same listener, if served.
    rlqs: Option<RlqsService>,
}

impl RlsService {
    /// The API over `service`.
    pub fn new(service: Arc<Service>, options: RlsOptions) -> Self {
        Self {
            limiter: Arc::new(RateLimiter::new(service, options.response_headers)),
            auth_token: options.auth_token,
            rlqs: None,
        }
    }

    /// Also answers `StreamRateLimitQuotas` with `rlqs`.
    pub fn with_rlqs(mut self, rlqs: RlqsService) -> Self {
        self.rlqs = Some(rlqs);
        self
    }

    /// Counts a call answered `code` (the server counts the calls it cuts
    /// off itself).
    pub(crate) fn count(&self, code: tonic::Code) {
        self.limiter.service.metrics().requests.with_label_values(&["rls", grpc_code(code)]).inc();
    }

    async fn answer<B>(self, request: axum::http::Request<B>) -> axum::http::Response<tonic::body::Body>
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send,
    {
        let path = request.uri().path();
        if path != SHOULD_RATE_LIMIT {
            return Status::unimplemented(format!("no method {path}: this service answers {SHOULD_RATE_LIMIT}"))
                .into_http();
        }
        if let Err(refused) = authorize(self.auth_token.as_deref(), request.headers()) {
            return Status::unauthenticated(refused.message()).into_http();
        }
        let mut grpc =
            tonic::server::Grpc::new(RequestCodec::default()).apply_max_message_size_config(Some(MAX_BODY_BYTES), None);
        grpc.unary(ShouldRateLimit(self.limiter), request).await
    }
}

impl<B> tower::Service<axum::http::Request<B>> for RlsService
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send,
{
    type Response = axum::http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: axum::http::Request<B>) -> Self::Future {
        let this = self.clone();
        if let (Some(rlqs), STREAM_RATE_LIMIT_QUOTAS) = (&self.rlqs, request.uri().path()) {
            // A stream counts itself, by the status it ends with.
            let rlqs = rlqs.clone();
            return Box::pin(async move { Ok(rlqs.answer(request).await) });
        }
        Box::pin(async move {
            let counter = this.clone();
            let response = this.answer(request).await;
            // An error is in the headers (a trailers-only response); an
            // answer's OK comes in the trailers.
            counter.count(Status::from_header_map(response.headers()).map_or(tonic::Code::Ok, |status| status.code()));
            Ok(response)
        })
    }
}

/// The one method, for tonic's unary call handling.
struct ShouldRateLimit(Arc<RateLimiter>);

impl tonic::server::UnaryService<RateLimitRequest> for ShouldRateLimit {
    type Response = RateLimitResponse;
    type Future = Pin<Box<dyn Future<Output = Result<Response<RateLimitResponse>, Status>> + Send>>;

    fn call(&mut self, request: Request<RateLimitRequest>) -> Self::Future {
        let limiter = Arc::clone(&self.0);
        Box::pin(async move { limiter.decide(request.into_inner()).await.map(Response::new) })
    }
}

/// Protobuf, as tonic's own codec, except that a message that does not
/// decode is the caller's mistake (`INVALID_ARGUMENT`), not the service's.
#[derive(Default)]
struct RequestCodec(ProstCodec<RateLimitResponse, RateLimitRequest>);

impl Codec for RequestCodec {
    type Encode = RateLimitResponse;
    type Decode = RateLimitRequest;
    type Encoder = ProstEncoder<RateLimitResponse>;
    type Decoder = RequestDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        self.0.encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        RequestDecoder(self.0.decoder())
    }
}

struct RequestDecoder(ProstDecoder<RateLimitRequest>);

impl Decoder for RequestDecoder {
    type Item = RateLimitRequest;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<RateLimitRequest>, Status> {
        self.0
            .decode(src)
            .map_err(|status| Status::invalid_argument(format!("malformed RateLimitRequest: {}", status.message())))
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}
