//! Envoy's rate limit quota service (RLQS,
//! `envoy.service.rate_limit_quota.v3.RateLimitQuotaService.StreamRateLimitQuotas`)
//! on the gRPC listener, beside the rate limit service API ([`crate::rls`]):
//! Envoy's `envoy.filters.http.rate_limit_quota` filter holds one stream per
//! domain, reports each bucket's allowed and denied requests every report
//! interval, and enforces the assignment it gets back alone, with no call on
//! the request path. Each bucket id is matched to the domain's limits file
//! as a descriptor is (its entries in the order the file nests them); a
//! limited bucket's limit is shared among the Envoys reporting it by their
//! demand (`floodgate_core::lease::shares`, the table in the store, so
//! service instances on one Redis share it too).
//!
//! Safe by default: streams, buckets per stream and in all, and message
//! sizes are bounded; what is refused ends the stream with a status naming
//! why (unknown domain `NOT_FOUND`, malformed reports `INVALID_ARGUMENT`,
//! no room `RESOURCE_EXHAUSTED`, a silent stream `DEADLINE_EXCEEDED`).
//! `quota/README.md` ("Envoy's rate limit quota service") documents it.

mod stream;
pub mod wire;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{RateLimitQuotaResponse, RateLimitQuotaUsageReports};
use floodgate_core::time::{Nanos, SECOND};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::{Request, Response, Status, Streaming};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

use self::stream::Stream;
use crate::auth::authorize;
use crate::metrics::rlqs_code;
use crate::service::Service;
use crate::store::{ShareReports, StoreFailure, Timings};

/// The method this service answers.
pub const STREAM_RATE_LIMIT_QUOTAS: &str =
    "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas";

/// The largest report message decoded (a report of 10,000 buckets of a few
/// entries each is about 1 MiB).
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// Command-line flags of RLQS (flattened into the binary's own).
#[derive(Debug, Clone, clap::Args)]
pub struct RlqsArgs {
    /// Most RLQS streams open at once (one per Envoy and domain); one more
    /// is refused with RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    pub rlqs_max_streams: u32,

    /// Most RLQS buckets held at once over all streams, one stream at most
    /// a sixteenth of them; a report past them ends its stream with
    /// RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u32).range(16..))]
    pub rlqs_max_buckets: u32,

    /// How often Envoys report (Envoy 1.40 reports every 5s whatever its
    /// reporting_interval says): sizes the shares' timings.
    #[arg(long, default_value = "5s", value_parser = duration, value_name = "DURATION")]
    pub rlqs_report_interval: Duration,

    /// How long an assignment lasts (whole seconds, at least twice the
    /// report interval): an Envoy that hears nothing more keeps it that
    /// long, then falls back to its own configuration.
    #[arg(long, default_value = "15s", value_parser = duration, value_name = "DURATION")]
    pub rlqs_assignment_ttl: Duration,

    /// How long a bucket an Envoy reports idle is kept before it is
    /// abandoned (the Envoy forgets it until its next request).
    #[arg(long, default_value = "60s", value_parser = duration, value_name = "DURATION")]
    pub rlqs_abandon_after: Duration,

    /// Most bucket reports of all streams in the store at once; the
    /// reports past them wait their turn (first come, first served) before
    /// their --store-timeout starts, so that a backlog is decided in time
    /// a part at a time instead of every report running out of time. A
    /// report of more buckets than this goes alone.
    #[arg(long, default_value_t = 12000, value_parser = clap::value_parser!(u32).range(1..))]
    pub rlqs_reports_in_flight: u32,
}

impl RlqsArgs {
    /// The limits and timings the flags say, checked.
    pub fn options(&self, auth_token: Option<Arc<str>>) -> Result<RlqsOptions, String> {
        let interval = Nanos::from(self.rlqs_report_interval);
        let ttl = Nanos::from(self.rlqs_assignment_ttl);
        if interval < SECOND {
            return Err("--rlqs-report-interval must be at least 1s (Envoy counts whole seconds)".into());
        }
        if ttl.get() % SECOND.get() != 0 || ttl < interval.times(2) {
            return Err("--rlqs-assignment-ttl must be whole seconds and at least twice --rlqs-report-interval \
                 (Envoy 1.40 reads only whole seconds, and an assignment must outlive the next report)"
                .into());
        }
        Ok(RlqsOptions {
            auth_token,
            limits: StreamLimits {
                max_streams: usize::try_from(self.rlqs_max_streams).unwrap_or(usize::MAX),
                max_buckets: usize::try_from(self.rlqs_max_buckets).unwrap_or(usize::MAX),
            },
            timings: Timings { report_interval: interval, ttl, abandon_after: Nanos::from(self.rlqs_abandon_after) },
            reports_in_flight: usize::try_from(self.rlqs_reports_in_flight).unwrap_or(usize::MAX),
        })
    }
}

fn duration(text: &str) -> Result<Duration, String> {
    floodgate_core::time::parse_duration(text).map(Duration::from).map_err(|e| e.to_string())
}

/// How many streams and buckets the service holds at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamLimits {
    /// Streams open at once.
    pub max_streams: usize,
    /// Buckets over all streams.
    pub max_buckets: usize,
}

impl StreamLimits {
    /// Buckets one stream may hold: a sixteenth of all, so one Envoy cannot
    /// take the room from the others.
    pub fn buckets_per_stream(&self) -> usize {
        (self.max_buckets / 16).max(1)
    }
}

/// How RLQS behaves.
#[derive(Debug, Clone)]
pub struct RlqsOptions {
    /// With `Some`, streams need the metadata `authorization: Bearer <token>`.
    pub auth_token: Option<Arc<str>>,
    /// Streams and buckets.
    pub limits: StreamLimits,
    /// The shares' timings.
    pub timings: Timings,
    /// Most bucket reports in the store at once (`--rlqs-reports-in-flight`).
    pub reports_in_flight: usize,
}

impl Default for RlqsOptions {
    fn default() -> Self {
        Self {
            auth_token: None,
            limits: StreamLimits { max_streams: 1024, max_buckets: 1_000_000 },
            timings: Timings {
                report_interval: Nanos::from_secs(5),
                ttl: Nanos::from_secs(15),
                abandon_after: Nanos::from_secs(60),
            },
            reports_in_flight: 12000,
        }
    }
}

/// What every stream of the service shares.
#[derive(Debug)]
pub struct Shared {
    service: Arc<Service>,
    limits: StreamLimits,
    timings: Timings,
    /// Buckets held over all streams.
    buckets: AtomicUsize,
    streams: Arc<Semaphore>,
    /// Makes each stream's Envoy id unique among instances (a random start)
    /// and streams (a counter).
    ids: AtomicU64,
    /// When a store failure was last logged (seconds since start).
    last_log: AtomicU64,
    started: Instant,
    /// Ends every stream (shutdown).
    stop: watch::Sender<bool>,
    /// Coalesces the streams' reports of each bucket into one store
    /// transaction at a time.
    reports: Arc<ShareReports>,
    /// Bucket reports in the store at once: one permit each.
    in_flight: Arc<Semaphore>,
    /// The permits `in_flight` started with.
    in_flight_most: usize,
}

impl Shared {
    fn log_store_failure(&self, failure: &StoreFailure) {
        let second = self.started.elapsed().as_secs();
        if self.last_log.swap(second, Ordering::Relaxed) != second {
            tracing::warn!(error = %failure, "RLQS report not decided: the Envoy keeps its last assignment (logged at most once a second)");
        }
    }

    /// Waits for room for `buckets` bucket reports in the store (all of it
    /// for a report larger than that), first come first served, for at
    /// most a report interval: a report still waiting then is not decided
    /// (the Envoy keeps its assignment, and its next report is on its way).
    /// A store that waits as long as its decisions take (memory: no
    /// `--store-timeout`) has no deadline to meet: nothing is held back.
    async fn turn_in_store(&self, buckets: usize) -> Result<Option<tokio::sync::SemaphorePermit<'_>>, StoreFailure> {
        if self.service.store().backend().deadline().is_none() {
            return Ok(None);
        }
        let wanted = u32::try_from(buckets.clamp(1, self.in_flight_most)).unwrap_or(u32::MAX);
        match tokio::time::timeout(Duration::from(self.timings.report_interval), self.in_flight.acquire_many(wanted))
            .await
        {
            Ok(Ok(permit)) => Ok(Some(permit)),
            Ok(Err(_)) => Err(StoreFailure::Unavailable("the service is shutting down".into())),
            Err(_) => Err(StoreFailure::Timeout),
        }
    }

    /// A stream silent this long is ended: Envoy reports every interval
    /// while it has buckets.
    fn silence(&self) -> Duration {
        Duration::from(self.timings.report_interval.times(12)).max(Duration::from_secs(60))
    }
}

/// `StreamRateLimitQuotas` as a service [`crate::rls::RlsService`] hands
/// its calls to.
#[derive(Debug, Clone)]
pub struct RlqsService {
    shared: Arc<Shared>,
    auth_token: Option<Arc<str>>,
}

impl RlqsService {
    /// RLQS over `service`.
    pub fn new(service: Arc<Service>, options: RlqsOptions) -> Self {
        let start = {
            use std::hash::{BuildHasher, Hasher};
            let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
            hasher.write_u128(
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos(),
            );
            hasher.finish()
        };
        let in_flight_most = options.reports_in_flight.clamp(1, Semaphore::MAX_PERMITS);
        let shared = Arc::new(Shared {
            service,
            limits: options.limits,
            timings: options.timings,
            buckets: AtomicUsize::new(0),
            streams: Arc::new(Semaphore::new(options.limits.max_streams)),
            ids: AtomicU64::new(start),
            last_log: AtomicU64::new(u64::MAX),
            started: Instant::now(),
            stop: watch::channel(false).0,
            reports: Arc::new(ShareReports::default()),
            in_flight: Arc::new(Semaphore::new(in_flight_most)),
            in_flight_most,
        });
        Self { shared, auth_token: options.auth_token }
    }

    /// Ends every open stream (`UNAVAILABLE`: Envoy opens a new one, to
    /// another instance if there is one) and refuses new ones: for shutdown.
    pub fn stop(&self) {
        self.shared.stop.send_replace(true);
    }

    fn count(&self, code: tonic::Code) {
        self.shared.service.metrics().requests.with_label_values(&["rlqs", rlqs_code(code)]).inc();
    }

    /// Answers one call of `StreamRateLimitQuotas`.
    pub async fn answer<B>(self, request: axum::http::Request<B>) -> axum::http::Response<tonic::body::Body>
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send,
    {
        if let Err(refused) = authorize(self.auth_token.as_deref(), request.headers()) {
            self.count(tonic::Code::Unauthenticated);
            return Status::unauthenticated(refused.message()).into_http();
        }
        let permit = match Arc::clone(&self.shared.streams).try_acquire_owned() {
            Ok(permit) if !*self.shared.stop.borrow() => permit,
            Ok(_) => {
                self.count(tonic::Code::Unavailable);
                return Status::unavailable("the service is shutting down").into_http();
            }
            Err(_) => {
                self.count(tonic::Code::ResourceExhausted);
                return Status::resource_exhausted(format!(
                    "{} RLQS streams are open already (--rlqs-max-streams)",
                    self.shared.limits.max_streams
                ))
                .into_http();
            }
        };
        let mut grpc = tonic::server::Grpc::new(ReportCodec::default())
            .apply_max_message_size_config(Some(MAX_MESSAGE_BYTES), None);
        grpc.streaming(Streams { shared: Arc::clone(&self.shared), permit: Some(permit) }, request).await
    }
}

/// The one method, for tonic's streaming call handling.
struct Streams {
    shared: Arc<Shared>,
    permit: Option<OwnedSemaphorePermit>,
}

impl tonic::server::StreamingService<RateLimitQuotaUsageReports> for Streams {
    type Response = RateLimitQuotaResponse;
    type ResponseStream = Outbound;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Outbound>, Status>> + Send>>;

    fn call(&mut self, request: Request<Streaming<RateLimitQuotaUsageReports>>) -> Self::Future {
        let (shared, permit) = (Arc::clone(&self.shared), self.permit.take());
        Box::pin(async move {
            let (sender, receiver) = mpsc::channel(2);
            let envoy = shared.ids.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
            tokio::spawn(run(shared, request.into_inner(), sender, envoy, permit));
            Ok(Response::new(Outbound(receiver)))
        })
    }
}

/// The answers of a stream, as the task running it sends them.
pub struct Outbound(mpsc::Receiver<Result<RateLimitQuotaResponse, Status>>);

impl futures_core::Stream for Outbound {
    type Item = Result<RateLimitQuotaResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx)
    }
}

/// Runs one stream: each report in turn, answered before the next is read
/// (so one Envoy's reports never run ahead of its answers), until the
/// Envoy closes it, a report is refused, it falls silent, the Envoy stops
/// reading answers, or the service stops.
async fn run(
    shared: Arc<Shared>,
    mut inbound: Streaming<RateLimitQuotaUsageReports>,
    out: mpsc::Sender<Result<RateLimitQuotaResponse, Status>>,
    envoy: u64,
    permit: Option<OwnedSemaphorePermit>,
) {
    let metrics = shared.service.metrics().clone();
    metrics.rlqs_streams.inc();
    let silence = shared.silence();
    let mut stopping = shared.stop.subscribe();
    let mut stream = Stream::new(Arc::clone(&shared), envoy);
    let end: Status = loop {
        let next = tokio::select! {
            next = tokio::time::timeout(silence, inbound.message()) => next,
            _ = stopping.wait_for(|stop| *stop) => break Status::unavailable("the service is shutting down"),
        };
        let message = match next {
            Err(_) => break Status::deadline_exceeded(format!("no report for {silence:?}: the stream is closed")),
            Ok(Ok(None)) => break Status::ok(""),
            Ok(Err(status)) => break status,
            Ok(Ok(Some(message))) => message,
        };
        match stream.report(message).await {
            Ok(None) => {}
            Ok(Some(answer)) => match tokio::time::timeout(silence, out.send(Ok(answer))).await {
                Ok(Ok(())) => {}
                // The Envoy is gone, or reads no answers.
                Ok(Err(_)) => break Status::cancelled("the stream was closed"),
                Err(_) => break Status::deadline_exceeded("the Envoy read no answer in time"),
            },
            Err(refused) => break refused,
        }
    };
    metrics.requests.with_label_values(&["rlqs", rlqs_code(end.code())]).inc();
    let buckets = stream.bucket_count();
    // Its room is free before the Envoy learns the stream ended (and opens
    // another).
    drop(stream);
    metrics.rlqs_streams.dec();
    drop(permit);
    if end.code() != tonic::Code::Ok {
        tracing::debug!(code = ?end.code(), message = end.message(), buckets, "RLQS stream ended");
        // Behind answers the Envoy has not read yet, if there is room soon.
        let _ = tokio::time::timeout(Duration::from_secs(1), out.send(Err(end))).await;
    }
}

/// Protobuf, as tonic's own codec, except that a message that does not
/// decode is the caller's mistake (`INVALID_ARGUMENT`), not the service's.
#[derive(Default)]
struct ReportCodec(ProstCodec<RateLimitQuotaResponse, RateLimitQuotaUsageReports>);

impl Codec for ReportCodec {
    type Encode = RateLimitQuotaResponse;
    type Decode = RateLimitQuotaUsageReports;
    type Encoder = ProstEncoder<RateLimitQuotaResponse>;
    type Decoder = ReportDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        self.0.encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        ReportDecoder(self.0.decoder())
    }
}

struct ReportDecoder(ProstDecoder<RateLimitQuotaUsageReports>);

impl Decoder for ReportDecoder {
    type Item = RateLimitQuotaUsageReports;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<RateLimitQuotaUsageReports>, Status> {
        self.0.decode(src).map_err(|status| {
            Status::invalid_argument(format!("malformed RateLimitQuotaUsageReports: {}", status.message()))
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}
