//! Envoy's rate limit quota service (RLQS) against the service in-process,
//! through a tonic client, on the memory store and on Redis: shares by
//! demand, two instances on one Redis sharing one table, what buckets
//! without a limit get, the statuses of what is refused, the bounds on
//! streams, buckets and messages, hostile input and the metrics. The same
//! path with real Envoys in front is `rlqs_envoy.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use common::{Backend, Fixture, Options};
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use floodgate_core::time::{Nanos, SECOND};
use floodgate_quota::rlqs::{RlqsOptions, RlqsService, StreamLimits};
use floodgate_quota::rls::{RlsOptions, RlsService};
use floodgate_quota::server::{serve, App, Limits};
use floodgate_quota::service::Service;
use tokio::sync::mpsc;
use tonic::codec::Streaming;
use tonic::transport::Channel;
use tonic::{Code, Status};

const LIMITS: &str = "domain: test
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 50}
  - key: tenant
    value: free
    rate_limit: {unlimited: true}
  - key: path
    descriptors:
      - key: method
        rate_limit: {unit: second, requests_per_unit: 10}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: hourly
    rate_limit: {unit: minute, requests_per_unit: 100}
";

/// The gRPC listener (RLS and RLQS) over a service; stopped when dropped.
struct Server {
    address: SocketAddr,
    rlqs: RlqsService,
    server: tokio::task::JoinHandle<()>,
}

impl Server {
    async fn start(service: Arc<Service>, options: RlqsOptions) -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("addr");
        let rlqs = RlqsService::new(Arc::clone(&service), options);
        let app = App::Grpc(RlsService::new(service, RlsOptions::default()).with_rlqs(rlqs.clone()));
        let server = tokio::spawn(serve(listener, app, Limits::default(), std::future::pending()));
        Server { address, rlqs, server }
    }

    async fn envoy(&self) -> Envoy {
        Envoy::open(self.address, None).await.expect("stream opened")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// A stream's outgoing reports.
struct Outgoing(mpsc::Receiver<RateLimitQuotaUsageReports>);

impl futures_core::Stream for Outgoing {
    type Item = RateLimitQuotaUsageReports;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx)
    }
}

/// One Envoy's stream, as a test drives it.
struct Envoy {
    reports: mpsc::Sender<RateLimitQuotaUsageReports>,
    answers: Streaming<RateLimitQuotaResponse>,
}

impl Envoy {
    async fn open(address: SocketAddr, token: Option<&str>) -> Result<Envoy, Status> {
        let channel = Channel::from_shared(format!("http://{address}")).unwrap().connect().await.unwrap();
        let mut client = RateLimitQuotaServiceClient::new(channel).max_decoding_message_size(16 << 20);
        let (reports, receiver) = mpsc::channel(4);
        let mut request = tonic::Request::new(Outgoing(receiver));
        if let Some(token) = token {
            request.metadata_mut().insert("authorization", token.parse().unwrap());
        }
        let answers = client.stream_rate_limit_quotas(request).await?.into_inner();
        Ok(Envoy { reports, answers })
    }

    /// Sends a report that gets no answer (a bucket's first, over no time).
    async fn send(&mut self, domain: &str, usages: Vec<BucketQuotaUsage>) {
        self.reports
            .send(RateLimitQuotaUsageReports { domain: domain.into(), bucket_quota_usages: usages })
            .await
            .unwrap();
    }

    /// Sends a report and waits for its answer (or the stream's end).
    async fn report(&mut self, domain: &str, usages: Vec<BucketQuotaUsage>) -> Result<RateLimitQuotaResponse, Status> {
        let _ =
            self.reports.send(RateLimitQuotaUsageReports { domain: domain.into(), bucket_quota_usages: usages }).await;
        match tokio::time::timeout(Duration::from_secs(10), self.answers.message()).await.expect("an answer in time") {
            Ok(Some(answer)) => Ok(answer),
            Ok(None) => Err(Status::ok("the stream ended")),
            Err(status) => Err(status),
        }
    }
}

fn bucket(entries: &[(&str, &str)]) -> BucketId {
    BucketId { bucket: entries.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<HashMap<_, _>>() }
}

fn usage(entries: &[(&str, &str)], allowed: u64, denied: u64, seconds: i64) -> BucketQuotaUsage {
    BucketQuotaUsage {
        bucket_id: Some(bucket(entries)),
        time_elapsed: Some(ProtoDuration { seconds, nanos: 0 }),
        num_requests_allowed: allowed,
        num_requests_denied: denied,
    }
}

/// What an answer assigns each bucket: tokens a second (a token bucket's
/// rate), or the blanket rule / abandon by name.
fn assigned(answer: &RateLimitQuotaResponse) -> Vec<String> {
    answer
        .bucket_action
        .iter()
        .map(|action| match action.bucket_action.as_ref().unwrap() {
            Action::AbandonAction(_) => "abandon".to_string(),
            Action::QuotaAssignmentAction(a) => {
                assert!(a.assignment_time_to_live.unwrap().seconds > 0);
                match a.rate_limit_strategy.unwrap().strategy.unwrap() {
                    Strategy::TokenBucket(b) => {
                        let interval = b.fill_interval.unwrap();
                        assert_eq!(i64::from(interval.nanos), interval.seconds, "whole seconds, twice");
                        format!("{}/{}s", b.tokens_per_fill.unwrap().value, interval.seconds)
                    }
                    Strategy::BlanketRule(r) if r == BlanketRule::AllowAll as i32 => "allow_all".to_string(),
                    Strategy::BlanketRule(_) => "deny_all".to_string(),
                    Strategy::RequestsPerTimeUnit(_) => "requests_per_time_unit".to_string(),
                }
            }
        })
        .collect()
}

/// Waits until the service has decided `count` report messages of limited
/// buckets in its store (reports that get no answer give no other sign).
async fn taken(fixture: &Fixture, count: u64) {
    let store = fixture.service.store().name();
    for _ in 0..500 {
        if fixture.service.metrics().store_latency.with_label_values(&[store, "rlqs"]).get_sample_count() >= count {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the service decided fewer than {count} reports");
}

fn options() -> RlqsOptions {
    RlqsOptions::default()
}

async fn shares_follow_demand(backend: Backend, options: RlqsOptions) {
    let fixture = Fixture::new(backend, LIMITS).await;
    let server = Server::start(fixture.service.clone(), options).await;
    let (mut a, mut b) = (server.envoy().await, server.envoy().await);
    let tenant = [("tenant", "acme")];
    // A bucket's first report (at once, over no time) gets no answer: the
    // Envoy stays on its no-assignment behaviour for one interval.
    a.send("test", vec![usage(&tenant, 1, 0, 0)]).await;
    b.send("test", vec![usage(&tenant, 1, 0, 0)]).await;
    taken(&fixture, 2).await;
    // Demand 100:34 a second, above the limit: first A (B's demand unknown
    // yet counts as half: 40 of 50), then B (the 10 left), then each its
    // part of the demand (37:12).
    let mut shares = Vec::new();
    for _ in 0..2 {
        fixture.clock.advance(Nanos::from_secs(5));
        shares.extend(assigned(&a.report("test", vec![usage(&tenant, 300, 200, 5)]).await.unwrap()));
        shares.extend(assigned(&b.report("test", vec![usage(&tenant, 100, 70, 5)]).await.unwrap()));
    }
    assert_eq!(shares, ["40/1s", "10/1s", "37/1s", "12/1s"]);
    // Demand moves to B: A reports its drop first (4 of 38 a second in
    // all: 4 + 12/2), B then takes the room A left (40); in the next
    // interval each has its part of the demand (4:92 of 50).
    let mut moved = Vec::new();
    for _ in 0..2 {
        fixture.clock.advance(Nanos::from_secs(5));
        moved.extend(assigned(&a.report("test", vec![usage(&tenant, 20, 0, 5)]).await.unwrap()));
        moved.extend(assigned(&b.report("test", vec![usage(&tenant, 60, 400, 5)]).await.unwrap()));
    }
    assert_eq!(moved, ["10/1s", "40/1s", "2/1s", "47/1s"]);
}

#[tokio::test]
async fn shares_follow_demand_in_memory() {
    shares_follow_demand(Backend::Memory, options()).await;
}

#[tokio::test]
async fn shares_follow_demand_on_redis() {
    shares_follow_demand(Backend::Redis, options()).await;
}

/// With room for one bucket report in the store at a time, a report of
/// more goes alone, and is decided as any other.
#[tokio::test]
async fn shares_follow_demand_on_redis_one_report_in_flight() {
    shares_follow_demand(Backend::Redis, RlqsOptions { reports_in_flight: 1, ..options() }).await;
}

/// Two service instances on one Redis read and write one table: an Envoy
/// on the second is a newcomer to a bucket an Envoy on the first holds
/// whole, and the two together stay within the limit once both reported.
#[tokio::test]
async fn two_instances_on_one_redis_share_one_table() {
    let first = Fixture::new(Backend::Redis, LIMITS).await;
    let url = first.redis.as_ref().unwrap().url();
    let second = Fixture::serve(Some(url), None, LIMITS, Options::default()).await;
    let (one, two) =
        (Server::start(first.service.clone(), options()).await, Server::start(second.service.clone(), options()).await);
    let (mut a, mut b) = (one.envoy().await, two.envoy().await);
    let tenant = [("tenant", "acme")];
    a.send("test", vec![usage(&tenant, 1, 0, 0)]).await;
    b.send("test", vec![usage(&tenant, 1, 0, 0)]).await;
    taken(&first, 1).await;
    taken(&second, 1).await;
    // A first: B's demand, unknown yet, counts as half; B then gets the room
    // A left (the instances read one table); then half each.
    let mut shares = Vec::new();
    for _ in 0..2 {
        first.clock.advance(Nanos::from_secs(5));
        second.clock.advance(Nanos::from_secs(5));
        shares.extend(assigned(&a.report("test", vec![usage(&tenant, 250, 250, 5)]).await.unwrap()));
        shares.extend(assigned(&b.report("test", vec![usage(&tenant, 250, 250, 5)]).await.unwrap()));
    }
    assert_eq!(shares, ["40/1s", "10/1s", "25/1s", "25/1s"]);
    first.clock.advance(Nanos::from_secs(5));
    second.clock.advance(Nanos::from_secs(5));
    let from_a = assigned(&a.report("test", vec![usage(&tenant, 250, 250, 5)]).await.unwrap());
    let from_b = assigned(&b.report("test", vec![usage(&tenant, 250, 250, 5)]).await.unwrap());
    assert_eq!([from_a, from_b].concat(), ["25/1s", "25/1s"]);
}

/// What a bucket without a limit gets (no rule, `unlimited`, a shadow rule),
/// a bucket id given in any order, and a counted window spent.
#[tokio::test]
async fn buckets_without_a_limit_are_allowed_and_windows_spent_denied() {
    let fixture = Fixture::new(Backend::Memory, LIMITS).await;
    let server = Server::start(fixture.service.clone(), options()).await;
    let mut envoy = server.envoy().await;
    // Two seconds into the minute: the minute's window counts what came
    // in its part of a report's span.
    fixture.clock.advance(Nanos::from_secs(2));
    let answer = envoy
        .report(
            "test",
            vec![
                usage(&[("nothing", "matches")], 1, 0, 0),
                usage(&[("tenant", "free")], 1, 0, 0),
                usage(&[("shadow", "x")], 1, 0, 0),
                // {method, path} is matched as the file nests it: [path, method]; the
                // minute window has 1 left over its 60 s: one per 61 s (never faster).
                usage(&[("method", "GET"), ("path", "/a")], 1, 0, 1),
                usage(&[("hourly", "h")], 99, 0, 1),
            ],
        )
        .await
        .unwrap();
    assert_eq!(assigned(&answer), ["allow_all", "allow_all", "allow_all", "10/1s", "1/59s"]);
    fixture.clock.advance(SECOND);
    let spent = envoy.report("test", vec![usage(&[("hourly", "h")], 1, 0, 1)]).await.unwrap();
    assert_eq!(assigned(&spent), ["deny_all"]);
}

/// A bucket reported idle long enough is abandoned, and comes back as new.
#[tokio::test]
async fn an_idle_bucket_is_abandoned() {
    let fixture = Fixture::new(Backend::Memory, LIMITS).await;
    let mut options = options();
    options.timings.abandon_after = Nanos::from_secs(10);
    let server = Server::start(fixture.service.clone(), options).await;
    let mut envoy = server.envoy().await;
    let tenant = [("tenant", "idle")];
    envoy.report("test", vec![usage(&tenant, 5, 0, 5)]).await.unwrap();
    let mut kinds = Vec::new();
    for _ in 0..3 {
        fixture.clock.advance(Nanos::from_secs(5));
        kinds.extend(assigned(&envoy.report("test", vec![usage(&tenant, 0, 0, 5)]).await.unwrap()));
    }
    assert_eq!(kinds, ["50/1s", "50/1s", "abandon"]);
    assert!(fixture
        .metrics()
        .await
        .contains(r#"floodgate_quota_rlqs_assignments_total{domain="test",kind="abandon"} 1"#));
    assert!(fixture.metrics().await.contains("floodgate_quota_rlqs_buckets 0"));
}

/// What is refused ends the stream with a status naming why.
#[tokio::test]
async fn refusals_end_the_stream_with_a_clear_status() {
    let fixture = Fixture::new(Backend::Memory, LIMITS).await;
    let server = Server::start(fixture.service.clone(), options()).await;
    let cases: Vec<(&str, RateLimitQuotaUsageReports, Code, &str)> = vec![
        (
            "unknown domain",
            reports("nope", vec![usage(&[("tenant", "a")], 1, 0, 0)]),
            Code::NotFound,
            "unknown domain \"nope\"",
        ),
        ("no domain", reports("", vec![usage(&[("tenant", "a")], 1, 0, 0)]), Code::InvalidArgument, "names no domain"),
        (
            "empty bucket id",
            reports("test", vec![BucketQuotaUsage { bucket_id: None, ..Default::default() }]),
            Code::InvalidArgument,
            "malformed RateLimitQuotaUsageReports: bucket_quota_usages[0].bucket_id is empty",
        ),
        (
            "negative time",
            reports("test", vec![usage(&[("tenant", "a")], 1, 0, -5)]),
            Code::InvalidArgument,
            "bucket_quota_usages[0].time_elapsed is not a duration",
        ),
    ];
    for (what, message, code, text) in cases {
        let mut envoy = server.envoy().await;
        let _ = envoy.reports.send(message).await;
        let end = envoy.answers.message().await.expect_err(what);
        assert_eq!(end.code(), code, "{what}: {end:?}");
        assert!(end.message().contains(text), "{what}: {}", end.message());
    }
    // A stream that changes its domain.
    let mut envoy = server.envoy().await;
    envoy.report("test", vec![usage(&[("tenant", "a")], 1, 0, 1)]).await.unwrap();
    let end = envoy.report("other", vec![usage(&[("tenant", "a")], 1, 0, 1)]).await.unwrap_err();
    assert_eq!(end.code(), Code::InvalidArgument, "{end:?}");
    // Bytes that do not decode.
    let channel = Channel::from_shared(format!("http://{}", server.address)).unwrap().connect().await.unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(
        "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas",
    );
    let bytes: Vec<u8> = vec![0x0a, 0x02, 0xff, 0xfe];
    let request = tonic::Request::new(futures_once(bytes));
    let mut answers = grpc.streaming(request, path, common::RawCodec).await.unwrap().into_inner();
    let end = answers.message().await.expect_err("malformed");
    assert_eq!(end.code(), Code::InvalidArgument, "{end:?}");
    assert!(end.message().starts_with("malformed RateLimitQuotaUsageReports"), "{}", end.message());
    let metrics = fixture.metrics().await;
    for series in [
        r#"floodgate_quota_requests_total{endpoint="rlqs",status="NOT_FOUND"} 1"#,
        r#"floodgate_quota_requests_total{endpoint="rlqs",status="INVALID_ARGUMENT"} 5"#,
    ] {
        assert!(metrics.contains(series), "no {series} in\n{metrics}");
    }
}

fn reports(domain: &str, usages: Vec<BucketQuotaUsage>) -> RateLimitQuotaUsageReports {
    RateLimitQuotaUsageReports { domain: domain.into(), bucket_quota_usages: usages }
}

/// A stream of one message that stays open (as an Envoy's would).
fn futures_once(bytes: Vec<u8>) -> OnceThenOpen {
    OnceThenOpen(Some(bytes))
}

struct OnceThenOpen(Option<Vec<u8>>);

impl futures_core::Stream for OnceThenOpen {
    type Item = Vec<u8>;

    fn poll_next(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Vec<u8>>> {
        match self.0.take() {
            Some(bytes) => Poll::Ready(Some(bytes)),
            None => Poll::Pending,
        }
    }
}

/// Streams, buckets per stream and in all, and message sizes are bounded;
/// past them the stream is refused with `RESOURCE_EXHAUSTED`, and the
/// service goes on serving the others.
#[tokio::test]
async fn streams_buckets_and_messages_are_bounded() {
    let fixture = Fixture::new(Backend::Memory, LIMITS).await;
    let mut options = options();
    options.limits = StreamLimits { max_streams: 3, max_buckets: 160 };
    let server = Server::start(fixture.service.clone(), options).await;
    let mut first = server.envoy().await;
    first.report("test", vec![usage(&[("tenant", "a")], 1, 0, 1)]).await.unwrap();
    let (_second, _third) = (server.envoy().await, server.envoy().await);
    let fourth = match Envoy::open(server.address, None).await {
        Ok(mut envoy) => envoy.report("test", vec![usage(&[("tenant", "a")], 1, 0, 0)]).await.unwrap_err(),
        Err(status) => status,
    };
    assert_eq!(fourth.code(), Code::ResourceExhausted, "{fourth:?}");
    assert!(fourth.message().contains("--rlqs-max-streams"), "{}", fourth.message());
    // One stream holds at most a sixteenth of the buckets: 10 of 160.
    let many: Vec<BucketQuotaUsage> = (0..11).map(|i| usage(&[("tenant", &format!("t{i}"))], 1, 0, 0)).collect();
    let end = first.report("test", many).await.unwrap_err();
    assert_eq!(end.code(), Code::ResourceExhausted, "{end:?}");
    assert!(end.message().contains("at most 10"), "{}", end.message());
    // A message past 4 MiB is not decoded.
    drop(first);
    let mut envoy = server.envoy().await;
    let huge = usage(&[("tenant", &"x".repeat(5 << 20))], 1, 0, 0);
    let end = envoy.report("test", vec![huge]).await.unwrap_err();
    assert_eq!(end.code(), Code::OutOfRange, "{end:?}");
    // The service still serves a well-behaved Envoy.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut fine = server.envoy().await;
    assert_eq!(assigned(&fine.report("test", vec![usage(&[("tenant", "b")], 1, 0, 1)]).await.unwrap()), ["50/1s"]);
}

/// Hostile input (absurd counts and times, many streams reporting many
/// buckets at once) panics nothing; the answers stay token buckets within
/// the limit, and the gauges come back to 0 when the streams close.
#[tokio::test]
async fn hostile_reports_panic_nothing() {
    let fixture = Fixture::new(Backend::Memory, LIMITS).await;
    let server = Server::start(fixture.service.clone(), options()).await;
    let mut absurd = server.envoy().await;
    let answer = absurd
        .report(
            "test",
            vec![
                BucketQuotaUsage {
                    bucket_id: Some(bucket(&[("tenant", "t")])),
                    time_elapsed: Some(ProtoDuration { seconds: i64::MAX, nanos: 999_999_999 }),
                    num_requests_allowed: u64::MAX,
                    num_requests_denied: u64::MAX,
                },
                BucketQuotaUsage {
                    bucket_id: Some(bucket(&[("tenant", "u")])),
                    time_elapsed: None,
                    num_requests_allowed: u64::MAX,
                    num_requests_denied: 0,
                },
            ],
        )
        .await
        .unwrap();
    // The second, over no time, is a first report: no answer yet.
    assert_eq!(assigned(&answer), ["50/1s"]);
    let mut tasks = Vec::new();
    for stream in 0..20 {
        let address = server.address;
        tasks.push(tokio::spawn(async move {
            let mut envoy = Envoy::open(address, None).await.unwrap();
            for round in 0..5 {
                let usages = (0..100).map(|i| usage(&[("tenant", &format!("b{i}"))], round * 7, stream, 5)).collect();
                let answer = envoy.report("test", usages).await.unwrap();
                assert_eq!(answer.bucket_action.len(), 100);
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    drop(absurd);
    let metrics = fixture.metrics().await;
    assert!(metrics.contains(r#"floodgate_quota_rlqs_reports_total{domain="test"} 10002"#), "{metrics}");
    // The streams' tasks end once their clients are gone.
    for _ in 0..100 {
        let metrics = fixture.metrics().await;
        if metrics.contains("floodgate_quota_rlqs_streams 0") && metrics.contains("floodgate_quota_rlqs_buckets 0") {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("streams or buckets left open:\n{}", fixture.metrics().await);
}

/// A store that fails refuses nothing: the buckets it could not decide get
/// no answer (the Envoy keeps its last assignment until it expires), the
/// others theirs, the failure is counted, and once the store is back the
/// shares are answered again.
#[tokio::test]
async fn a_store_failure_leaves_buckets_unanswered_and_the_stream_open() {
    let mut fixture = Fixture::new(Backend::Redis, LIMITS).await;
    let server = Server::start(fixture.service.clone(), options()).await;
    let mut envoy = server.envoy().await;
    let limited = [("tenant", "acme")];
    assert_eq!(assigned(&envoy.report("test", vec![usage(&limited, 5, 0, 5)]).await.unwrap()), ["50/1s"]);
    fixture.redis.as_mut().unwrap().stop();
    let answer = envoy.report("test", vec![usage(&limited, 5, 0, 5), usage(&[("tenant", "free")], 1, 0, 5)]).await;
    assert_eq!(assigned(&answer.unwrap()), ["allow_all"]);
    let metrics = fixture.metrics().await;
    assert!(metrics.contains(r#"floodgate_quota_store_errors_total{kind="unavailable",store="redis"} 1"#), "{metrics}");
    fixture.redis.as_mut().unwrap().restart();
    fixture.clock.advance(Nanos::from_secs(5));
    // The restarted Redis forgot the table: the Envoy is new to it again,
    // and alone.
    // (The store reconnects a --store-timeout after refusals: 2 s here.)
    let mut back = Vec::new();
    for _ in 0..100 {
        match envoy.report("test", vec![usage(&limited, 5, 0, 5), usage(&[("tenant", "free")], 1, 0, 5)]).await {
            Ok(answer) if answer.bucket_action.len() == 2 => {
                back = assigned(&answer);
                break;
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(status) => panic!("{status:?}"),
        }
    }
    assert_eq!(back, ["50/1s", "allow_all"]);
}

/// With `--auth-token`, a stream needs the token.
#[tokio::test]
async fn streams_need_the_token() {
    let fixture = Fixture::new(Backend::Memory, LIMITS).await;
    let mut options = options();
    options.auth_token = Some(Arc::from("s3cret"));
    let server = Server::start(fixture.service.clone(), options).await;
    let refused = match Envoy::open(server.address, None).await {
        Ok(mut envoy) => envoy.report("test", vec![usage(&[("tenant", "a")], 1, 0, 0)]).await.unwrap_err(),
        Err(status) => status,
    };
    assert_eq!(refused.code(), Code::Unauthenticated);
    let mut envoy = Envoy::open(server.address, Some("Bearer s3cret")).await.unwrap();
    assert_eq!(assigned(&envoy.report("test", vec![usage(&[("tenant", "a")], 1, 0, 1)]).await.unwrap()), ["50/1s"]);
    // Stopping the service ends the stream: Envoy opens one elsewhere.
    server.rlqs.stop();
    let end = envoy.answers.message().await.expect_err("stopped");
    assert_eq!(end.code(), Code::Unavailable, "{end:?}");
}
