//! Envoy's rate limit service API (gRPC) against the service in-process,
//! through a tonic client: the mapping of descriptors, hits, statuses,
//! limits, shadow mode, headers, errors and auth onto `Service::check`.
//! The same path with a real Envoy in front is `tests/tests/rls_envoy.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::{Backend, Fixture, Options};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{Entry, RateLimitOverride};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use floodgate_e2e::free_port;
use floodgate_quota::rls::{RlsOptions, RlsService};
use floodgate_quota::server::{serve, App, Limits};
use floodgate_quota::service::Service;
use tonic::transport::Channel;

const LIMITS: &str = "domain: test
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: path
    value: /shadow
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: path
    value: /free
    rate_limit: {unlimited: true}
  - key: bucket
    rate_limit: {unit: second, requests_per_unit: 10, algorithm: token_bucket, burst: 4}
  - key: week
    rate_limit: {unit: week, requests_per_unit: 7}
";

/// The gRPC server over the fixture's service; stopped when dropped.
struct Rls {
    address: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
}

impl Rls {
    async fn start(service: Arc<Service>, options: RlsOptions) -> Rls {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let app = App::Grpc(RlsService::new(service, options));
        let server = tokio::spawn(serve(listener, app, Limits::default(), async {
            let _ = stopped.await;
        }));
        Rls { address, stop: Some(stop), server }
    }

    async fn client(&self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::connect(format!("http://{}", self.address)).await.expect("connect")
    }
}

impl Drop for Rls {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.server.abort();
    }
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries.iter().map(|(k, v)| Entry { key: k.to_string(), value: v.to_string() }).collect(),
        ..Default::default()
    }
}

fn request(descriptors: Vec<RateLimitDescriptor>, hits_addend: u32) -> RateLimitRequest {
    RateLimitRequest { domain: "test".into(), descriptors, hits_addend }
}

async fn ask(client: &mut RateLimitServiceClient<Channel>, req: RateLimitRequest) -> RateLimitResponse {
    client.should_rate_limit(req).await.expect("ShouldRateLimit").into_inner()
}

async fn setup(options: RlsOptions) -> (Fixture, Rls, RateLimitServiceClient<Channel>) {
    let fixture = Fixture::new(Backend::Memory, LIMITS).await;
    let rls = Rls::start(fixture.service.clone(), options).await;
    let client = rls.client().await;
    (fixture, rls, client)
}

#[tokio::test]
async fn counts_exactly_then_denies_with_status_limit_remaining_and_reset() {
    let (fixture, _rls, mut client) = setup(RlsOptions::default()).await;
    let alice = || request(vec![descriptor(&[("user", "alice")])], 0);
    for remaining in [2, 1, 0] {
        let answer = ask(&mut client, alice()).await;
        assert_eq!(answer.overall_code, Code::Ok as i32);
        let status = &answer.statuses[0];
        assert_eq!(status.code, Code::Ok as i32);
        let limit = status.current_limit.as_ref().expect("current_limit");
        assert_eq!((limit.requests_per_unit, limit.unit), (3, Unit::Minute as i32));
        assert_eq!(status.limit_remaining, remaining);
        // T0 is on a minute boundary: the whole window is left.
        let reset = status.duration_until_reset.expect("duration_until_reset");
        assert_eq!((reset.seconds, reset.nanos), (60, 0));
        assert!(answer.response_headers_to_add.is_empty(), "headers only when asked");
    }
    let denied = ask(&mut client, alice()).await;
    assert_eq!(denied.overall_code, Code::OverLimit as i32);
    assert_eq!(denied.statuses[0].code, Code::OverLimit as i32);
    assert_eq!(denied.statuses[0].limit_remaining, 0);

    // Another value of the key has its own bucket.
    let bob = ask(&mut client, request(vec![descriptor(&[("user", "bob")])], 0)).await;
    assert_eq!((bob.overall_code, bob.statuses[0].limit_remaining), (Code::Ok as i32, 2));

    // 1.5 s later the reset has shrunk and is not a whole number of seconds.
    fixture.clock.advance(floodgate_core::time::Nanos::from_millis(1_500));
    let later = ask(&mut client, alice()).await;
    let reset = later.statuses[0].duration_until_reset.unwrap();
    assert_eq!((reset.seconds, reset.nanos), (58, 500_000_000));

    // The same metrics as the HTTP API: decisions and calls.
    let metrics = fixture.metrics().await;
    assert!(
        metrics.contains(r#"floodgate_quota_decisions_total{domain="test",kind="check",result="denied"} 2"#),
        "{metrics}"
    );
    assert!(metrics.contains(r#"floodgate_quota_requests_total{endpoint="rls",status="OK"} 6"#), "{metrics}");
}

#[tokio::test]
async fn all_or_nothing_across_descriptors() {
    let (_fixture, _rls, mut client) = setup(RlsOptions::default()).await;
    // Exhaust carol's bucket, then ask for dave and carol together: denied,
    // and dave's bucket is left untouched.
    ask(&mut client, request(vec![descriptor(&[("user", "carol")])], 3)).await;
    let both =
        ask(&mut client, request(vec![descriptor(&[("user", "dave")]), descriptor(&[("user", "carol")])], 0)).await;
    assert_eq!(both.overall_code, Code::OverLimit as i32);
    assert_eq!(both.statuses[0].code, Code::Ok as i32);
    assert_eq!(both.statuses[1].code, Code::OverLimit as i32);
    let dave = ask(&mut client, request(vec![descriptor(&[("user", "dave")])], 0)).await;
    assert_eq!(dave.statuses[0].limit_remaining, 2, "the denied call took nothing from dave");
}

#[tokio::test]
async fn hits_addend_request_level_and_per_descriptor() {
    let (_fixture, _rls, mut client) = setup(RlsOptions::default()).await;
    // Request level: 2 hits; 0 means 1, as the proto says.
    let two = ask(&mut client, request(vec![descriptor(&[("user", "erin")])], 2)).await;
    assert_eq!(two.statuses[0].limit_remaining, 1);
    let zero = ask(&mut client, request(vec![descriptor(&[("user", "erin")])], 0)).await;
    assert_eq!(zero.statuses[0].limit_remaining, 0);

    // Per descriptor: overrides the request's value (here 1 → 3).
    let mut heavy = descriptor(&[("user", "frank")]);
    heavy.hits_addend = Some(UInt64Value { value: 3 });
    let answer = ask(&mut client, request(vec![heavy.clone()], 1)).await;
    assert_eq!((answer.overall_code, answer.statuses[0].limit_remaining), (Code::Ok as i32, 0));
    // 4 > 3: can never pass.
    heavy.hits_addend = Some(UInt64Value { value: 4 });
    let answer = ask(&mut client, request(vec![descriptor(&[("user", "gina")]), heavy.clone()], 4)).await;
    assert_eq!(answer.overall_code, Code::OverLimit as i32);

    // Different costs in one request are refused, naming the descriptors.
    let error = client
        .should_rate_limit(request(vec![descriptor(&[("user", "hugo")]), heavy], 1))
        .await
        .expect_err("differing hits_addend");
    assert_eq!(error.code(), tonic::Code::InvalidArgument);
    assert!(error.message().contains("descriptors[1] costs 4 hits but descriptors[0] costs 1"), "{}", error.message());
}

#[tokio::test]
async fn shadow_unlimited_no_rule_and_unknown_domain_are_ok() {
    let (_fixture, _rls, mut client) = setup(RlsOptions::default()).await;
    let shadow = || request(vec![descriptor(&[("path", "/shadow")])], 0);
    ask(&mut client, shadow()).await;
    let over = ask(&mut client, shadow()).await;
    assert_eq!(over.overall_code, Code::Ok as i32, "shadow rules never deny");
    assert_eq!(over.statuses[0].code, Code::Ok as i32);
    assert_eq!(over.statuses[0].limit_remaining, 0);
    assert!(over.statuses[0].current_limit.is_some());

    let free =
        ask(&mut client, request(vec![descriptor(&[("path", "/free")]), descriptor(&[("other", "x")])], 0)).await;
    assert_eq!(free.overall_code, Code::Ok as i32);
    assert_eq!(free.statuses[0].limit_remaining, u32::MAX, "unlimited: everything remains");
    assert_eq!(free.statuses[1].limit_remaining, 0, "no rule: as envoyproxy/ratelimit, nothing reported");
    assert!(free.statuses.iter().all(|s| s.current_limit.is_none() && s.code == Code::Ok as i32));

    let mut unknown = request(vec![descriptor(&[("user", "x")]), descriptor(&[("user", "y")])], 0);
    unknown.domain = "nope".into();
    let answer = ask(&mut client, unknown).await;
    assert_eq!(answer.overall_code, Code::Ok as i32);
    assert_eq!(answer.statuses.len(), 2);
}

#[tokio::test]
async fn token_bucket_and_week_units() {
    let (_fixture, _rls, mut client) = setup(RlsOptions::default()).await;
    let bucket = ask(&mut client, request(vec![descriptor(&[("bucket", "b")])], 0)).await;
    let limit = bucket.statuses[0].current_limit.clone().unwrap();
    // The refill rate, and what the bucket holds now (burst 4, one taken).
    assert_eq!((limit.requests_per_unit, limit.unit), (10, Unit::Second as i32));
    assert_eq!(bucket.statuses[0].limit_remaining, 3);
    let week = ask(&mut client, request(vec![descriptor(&[("week", "w")])], 0)).await;
    let limit = week.statuses[0].current_limit.clone().unwrap();
    assert_eq!((limit.requests_per_unit, limit.unit), (7, Unit::Week as i32));
}

#[tokio::test]
async fn response_headers_of_the_tightest_descriptor_when_enabled() {
    let (_fixture, _rls, mut client) = setup(RlsOptions { response_headers: true, ..RlsOptions::default() }).await;
    ask(&mut client, request(vec![descriptor(&[("user", "ivy")])], 2)).await;
    let answer =
        ask(&mut client, request(vec![descriptor(&[("week", "w2")]), descriptor(&[("user", "ivy")])], 0)).await;
    let headers: Vec<(String, String)> =
        answer.response_headers_to_add.iter().map(|h| (h.key.clone(), h.value.clone())).collect();
    let expected = [("RateLimit-Limit", "3"), ("RateLimit-Remaining", "0"), ("RateLimit-Reset", "60")];
    assert_eq!(headers, expected.map(|(k, v)| (k.to_string(), v.to_string())));
}

#[tokio::test]
async fn bad_requests_are_invalid_argument() {
    let (_fixture, _rls, mut client) = setup(RlsOptions::default()).await;
    let empty = client.should_rate_limit(request(vec![], 0)).await.expect_err("no descriptors");
    assert_eq!(empty.code(), tonic::Code::InvalidArgument);
    assert!(empty.message().contains("descriptors must not be empty"), "{}", empty.message());

    let no_key = client.should_rate_limit(request(vec![descriptor(&[("", "v")])], 0)).await.expect_err("empty key");
    assert_eq!(no_key.code(), tonic::Code::InvalidArgument);
    assert!(no_key.message().contains("descriptors[0][0] has an empty key"), "{}", no_key.message());

    let mut with_override = descriptor(&[("user", "x")]);
    with_override.limit = Some(RateLimitOverride { requests_per_unit: 5, unit: 2 });
    let overridden = client.should_rate_limit(request(vec![with_override], 0)).await.expect_err("override");
    assert_eq!(overridden.code(), tonic::Code::Unimplemented);
    assert!(overridden.message().contains("descriptors[0].limit"), "{}", overridden.message());
}

#[tokio::test]
async fn bearer_token_is_required_when_set() {
    let (_fixture, rls, mut client) =
        setup(RlsOptions { auth_token: Some(Arc::from("s3cret")), ..RlsOptions::default() }).await;
    let call = || request(vec![descriptor(&[("user", "jo")])], 0);
    let missing = client.should_rate_limit(call()).await.expect_err("no token");
    assert_eq!(missing.code(), tonic::Code::Unauthenticated);
    // The scheme is case-insensitive, as on the HTTP API.
    for (token, ok) in [("Bearer wrong", false), ("Bearer s3cret", true), ("bearer s3cret", true)] {
        let mut req = tonic::Request::new(call());
        req.metadata_mut().insert("authorization", token.parse().unwrap());
        let mut client = rls.client().await;
        let result = client.should_rate_limit(req).await;
        assert_eq!(result.is_ok(), ok, "{token}: {result:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_failure_is_unavailable() {
    // A Redis URL where nothing listens: every store call fails.
    let url = format!("redis://127.0.0.1:{}/", free_port());
    let options = Options { store_timeout: Duration::from_millis(200), ..Options::default() };
    let fixture = Fixture::serve(Some(url), None, LIMITS, options).await;
    let rls = Rls::start(fixture.service.clone(), RlsOptions::default()).await;
    let mut client = rls.client().await;
    let error = client.should_rate_limit(request(vec![descriptor(&[("user", "kim")])], 0)).await.expect_err("down");
    assert_eq!(error.code(), tonic::Code::Unavailable, "{error:?}");
    assert!(error.message().contains("store"), "{}", error.message());
    let metrics = fixture.metrics().await;
    assert!(metrics.contains(r#"floodgate_quota_requests_total{endpoint="rls",status="UNAVAILABLE"} 1"#), "{metrics}");
}

#[tokio::test]
async fn stops_on_its_shutdown_signal() {
    let (_fixture, mut rls, _client) = setup(RlsOptions::default()).await;
    rls.stop.take().unwrap().send(()).unwrap();
    let result = tokio::time::timeout(Duration::from_secs(10), &mut rls.server).await;
    assert!(matches!(result, Ok(Ok(()))), "{result:?}");
    assert!(tokio::net::TcpStream::connect(rls.address).await.is_err(), "no longer listening");
}

/// A message that does not decode is the caller's mistake, `INVALID_ARGUMENT`
/// naming what is wrong (it was `INTERNAL`), and every call is counted in
/// `requests_total{endpoint="rls"}`, those and `UNAUTHENTICATED` ones
/// included.
#[tokio::test]
async fn malformed_messages_are_invalid_argument_and_every_call_is_counted() {
    let (fixture, rls, _client) =
        setup(RlsOptions { auth_token: Some(Arc::from("s3cret")), ..RlsOptions::default() }).await;
    let channel = Channel::from_shared(format!("http://{}", rls.address)).unwrap().connect().await.unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    let path = || {
        tonic::codegen::http::uri::PathAndQuery::from_static(
            "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        )
    };
    let call = |bytes: Vec<u8>, token: Option<&str>| {
        let mut request = tonic::Request::new(bytes);
        if let Some(token) = token {
            request.metadata_mut().insert("authorization", token.parse().unwrap());
        }
        request
    };
    // Unknown field 15 as groups nested past the decoder's recursion limit.
    let mut deep = vec![0x7b; 120];
    deep.extend(vec![0x7c; 120]);
    let cases = [
        ("bad UTF-8 in the domain", vec![0x0a, 0x02, 0xff, 0xfe]),
        ("a truncated varint", vec![0x18, 0xff]),
        ("groups nested too deep", deep),
    ];
    for (what, bytes) in cases {
        grpc.ready().await.unwrap();
        let error = grpc.unary(call(bytes, Some("Bearer s3cret")), path(), common::RawCodec).await.expect_err(what);
        assert_eq!(error.code(), tonic::Code::InvalidArgument, "{what}: {error:?}");
        assert!(error.message().starts_with("malformed RateLimitRequest: "), "{what}: {}", error.message());
    }
    grpc.ready().await.unwrap();
    let error = grpc.unary(call(vec![], None), path(), common::RawCodec).await.expect_err("no token");
    assert_eq!(error.code(), tonic::Code::Unauthenticated);
    let metrics = fixture.metrics().await;
    for series in [
        r#"floodgate_quota_requests_total{endpoint="rls",status="INVALID_ARGUMENT"} 3"#,
        r#"floodgate_quota_requests_total{endpoint="rls",status="UNAUTHENTICATED"} 1"#,
    ] {
        assert!(metrics.contains(series), "no {series} in\n{metrics}");
    }
}
