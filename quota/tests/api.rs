//! The HTTP surface: bad requests and wrong or missing tokens get a 4xx with
//! a message naming what is wrong, nothing crashes, and the real binary
//! starts, serves and stops cleanly on SIGTERM.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Backend, Fixture, Options};
use serde_json::{json, Value};

const LIMITS: &str = "domain: test\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1000}\n";

async fn raw(
    f: &Fixture,
    method: reqwest::Method,
    path: &str,
    body: Vec<u8>,
    token: Option<&str>,
) -> (u16, Value, reqwest::header::HeaderMap) {
    let mut request = f.client.request(method, format!("{}{path}", f.base)).body(body);
    if let Some(token) = token {
        request = request.header("authorization", token);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let text = response.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)), headers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_a_4xx_naming_the_problem_and_nothing_crashes() {
    let f = Fixture::new(Backend::Memory, LIMITS).await;
    let long = "x".repeat(300);
    let many: Vec<Value> = (0..33).map(|i| json!([["k", i.to_string()]])).collect();
    let wide: Vec<Value> = (0..17).map(|i| json!([format!("k{i}"), "v"])).collect();
    let deep = format!("{}{}", "[".repeat(5_000), "]".repeat(5_000));
    let cases: Vec<(&str, Vec<u8>, u16, String)> = vec![
        ("/v1/check", b"not json".to_vec(), 400, "malformed request".into()),
        ("/v1/check", b"{}".to_vec(), 400, "missing field `domain`".into()),
        ("/v1/check", br#"{"domain":"test"}"#.to_vec(), 400, "missing field `descriptors`".into()),
        ("/v1/check", br#"{"domain":"test","descriptors":"k"}"#.to_vec(), 400, "at descriptors".into()),
        ("/v1/check", br#"{"domain":"test","descriptors":[["k","v"]]}"#.to_vec(), 400, "at descriptors[0][0]".into()),
        ("/v1/check", br#"{"domain":"test","descriptors":[]}"#.to_vec(), 400, "descriptors must not be empty".into()),
        ("/v1/check", br#"{"domain":"test","descriptors":[[]]}"#.to_vec(), 400, "descriptors[0] has no entries".into()),
        (
            "/v1/check",
            json!({"domain": "test", "descriptors": many}).to_string().into_bytes(),
            400,
            "descriptors has 33 items; at most 32".into(),
        ),
        (
            "/v1/check",
            json!({"domain": "test", "descriptors": [wide]}).to_string().into_bytes(),
            400,
            "descriptors[0] has 17 entries; at most 16".into(),
        ),
        (
            "/v1/check",
            br#"{"domain":"test","descriptors":[[["","v"]]]}"#.to_vec(),
            400,
            "descriptors[0][0] has an empty key".into(),
        ),
        (
            "/v1/check",
            json!({"domain": "test", "descriptors": [[["k", long]]]}).to_string().into_bytes(),
            400,
            "too long".into(),
        ),
        ("/v1/check", br#"{"domain":"test","descriptors":[[["k","v"]]],"hits":-1}"#.to_vec(), 400, "at hits".into()),
        ("/v1/check", br#"{"domain":"test","descriptors":[[["k","v"]]],"hits":1.5}"#.to_vec(), 400, "at hits".into()),
        (
            "/v1/check",
            br#"{"domain":"test","descriptors":[[["k","v"]]],"hits":2000000000}"#.to_vec(),
            400,
            "hits is 2000000000".into(),
        ),
        (
            "/v1/check",
            br#"{"domain":"test","descriptors":[[["k","v"]]]} trailing"#.to_vec(),
            400,
            "trailing characters".into(),
        ),
        ("/v1/check", deep.into_bytes(), 400, "malformed request".into()),
        ("/v1/check", vec![0xff, 0xfe, 0x00], 400, "malformed request".into()),
        (
            "/v1/check",
            br#"{"domain":"nope","descriptors":[[["k","v"]]]}"#.to_vec(),
            404,
            "unknown domain \"nope\"".into(),
        ),
        ("/v1/lease", br#"{"domain":"test","leases":[]}"#.to_vec(), 400, "leases must not be empty".into()),
        (
            "/v1/lease",
            br#"{"domain":"test","leases":[{"id":"a","descriptor":[["k","v"]],"wanted":5,"rate":-1}]}"#.to_vec(),
            400,
            "leases[0].rate must be a non-negative".into(),
        ),
        (
            "/v1/lease",
            br#"{"domain":"test","leases":[{"id":"a","descriptor":[["k","v"]],"wanted":5,"rate":"fast"}]}"#.to_vec(),
            400,
            "at leases[0].rate".into(),
        ),
        (
            "/v1/lease",
            br#"{"domain":"test","leases":[{"id":"a","descriptor":[["k","v"]]}]}"#.to_vec(),
            400,
            "missing field `wanted`".into(),
        ),
        (
            "/v1/lease",
            br#"{"domain":"test","leases":[{"id":"a","descriptor":[["k","v"]],"wanted":99999999999}]}"#.to_vec(),
            400,
            "leases[0].wanted is 99999999999".into(),
        ),
        (
            "/v1/lease",
            br#"{"domain":"nope","leases":[{"id":"a","descriptor":[["k","v"]],"wanted":1}]}"#.to_vec(),
            404,
            "unknown domain".into(),
        ),
        (
            "/v1/return",
            br#"{"domain":"test","returns":[{"id":"a","tokens":-3}]}"#.to_vec(),
            400,
            "at returns[0].tokens".into(),
        ),
        (
            "/v1/return",
            br#"{"domain":"test","returns":[{"id":"a","tokens":5000000000}]}"#.to_vec(),
            400,
            "returns[0].tokens is 5000000000".into(),
        ),
        (
            "/v1/lease",
            br#"{"domain":"test","leases":[{"descriptor":[["k","v"]],"wanted":1}]}"#.to_vec(),
            400,
            "missing field `id`".into(),
        ),
        (
            "/v1/lease",
            br#"{"domain":"test","leases":[{"id":"a b","descriptor":[["k","v"]],"wanted":1}]}"#.to_vec(),
            400,
            "leases[0].id contains ' '".into(),
        ),
        (
            "/v1/lease",
            br#"{"domain":"test","leases":[{"id":"a","descriptor":[["k","v"]],"wanted":1},{"id":"a","descriptor":[["k","w"]],"wanted":1}]}"#.to_vec(),
            400,
            "leases[1].id repeats leases[0].id".into(),
        ),
        (
            "/v1/return",
            br#"{"domain":"test","returns":[{"id":"","tokens":1}]}"#.to_vec(),
            400,
            "returns[0].id must be 1 to 64 bytes".into(),
        ),
        (
            "/v1/return",
            br#"{"domain":"test","returns":[{"descriptor":[["k","v"]],"tokens":1,"window":0}]}"#.to_vec(),
            400,
            "missing field `id`".into(),
        ),
        ("/v1/return", br#"{"domain":"test","returns":[]}"#.to_vec(), 400, "returns must not be empty".into()),
        ("/v1/check", vec![b' '; 270_000], 413, "larger than 262144 bytes".into()),
        (
            "/v1/lease",
            json!({"domain": "test", "leases": (0..513).map(|i| json!({"id": format!("l{i}"), "descriptor": [["k", "v"]], "wanted": 1})).collect::<Vec<_>>()}).to_string().into_bytes(),
            400,
            "leases has 513 items; at most 512".into(),
        ),
        ("/nope", b"{}".to_vec(), 404, "no such endpoint".into()),
    ];
    for (path, body, status, message) in cases {
        let shown = String::from_utf8_lossy(&body[..body.len().min(80)]).to_string();
        let (got, reply, headers) = raw(&f, reqwest::Method::POST, path, body, None).await;
        assert_eq!(got, status, "{path} {shown}: {reply}");
        let error = reply["error"].as_str().unwrap_or_else(|| panic!("{path} {shown}: no error message: {reply}"));
        assert!(error.contains(&message), "{path} {shown}:\n  error: {error}\n  lacks: {message}");
        assert_eq!(headers["content-type"], "application/json");
    }
    let (got, reply, _) = raw(&f, reqwest::Method::GET, "/v1/check", Vec::new(), None).await;
    assert_eq!(got, 405, "{reply}");
    assert!(reply["error"].as_str().unwrap().contains("POST"));
    // Still serving.
    let r = f.check(json!({"domain": "test", "descriptors": [[["k", "v"]]]})).await;
    assert_eq!(r["allowed"], true);
    assert!(f.metrics().await.contains(r#"floodgate_quota_requests_total{endpoint="check",status="400"}"#));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_calls_need_the_right_bearer_token() {
    let f = Fixture::with(Backend::Memory, LIMITS, Options { auth_token: Some("s3cret"), ..Options::default() }).await;
    let body = json!({"domain": "test", "descriptors": [[["k", "v"]]]}).to_string().into_bytes();
    for path in ["/v1/check", "/v1/lease", "/v1/return"] {
        for (token, message) in [
            (None, "missing Authorization: Bearer token"),
            (Some("Bearer wrong"), "wrong bearer token"),
            (Some("Bearer s3cre"), "wrong bearer token"),
            (Some("Bearer s3cret2"), "wrong bearer token"),
            (Some("Basic s3cret"), "wrong bearer token"),
            (Some("s3cret"), "wrong bearer token"),
        ] {
            let (status, reply, headers) = raw(&f, reqwest::Method::POST, path, body.clone(), token).await;
            assert_eq!(status, 401, "{path} {token:?}: {reply}");
            assert_eq!(reply["error"], message, "{path} {token:?}");
            assert_eq!(headers["www-authenticate"], "Bearer");
        }
    }
    // The scheme is case-insensitive (RFC 9110 section 11.1); the token is not.
    for token in ["Bearer s3cret", "bearer s3cret", "BEARER s3cret", "bEaReR s3cret"] {
        let (status, reply, _) = raw(&f, reqwest::Method::POST, "/v1/check", body.clone(), Some(token)).await;
        assert_eq!(status, 200, "{token}: {reply}");
        assert_eq!(reply["allowed"], true);
    }
    let (status, _, _) = raw(&f, reqwest::Method::POST, "/v1/check", body.clone(), Some("bearer S3CRET")).await;
    assert_eq!(status, 401, "the token itself is compared exactly");
    // Probes and scrapes need no token.
    for path in ["/healthz", "/readyz", "/metrics"] {
        let (status, _, _) = raw(&f, reqwest::Method::GET, path, Vec::new(), None).await;
        assert_eq!(status, 200, "{path}");
    }
}

/// What is not HTTP/1.1 is answered by hyper's parser before the router
/// runs: the status, an empty body and a closed connection, as
/// docs/protocol.md says; the service keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_http_gets_the_parsers_status_and_a_closed_connection() {
    use std::io::{Read, Write};
    let f = Fixture::new(Backend::Memory, LIMITS).await;
    let address = f.base.trim_start_matches("http://").to_string();
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (b"GARBAGE\r\n\r\n".to_vec(), "400 Bad Request"),
        (b"POST /v1/check HTTP/1.1\r\nhost: q\r\ncontent-length: abc\r\n\r\n".to_vec(), "400 Bad Request"),
        (
            b"POST /v1/check HTTP/1.1\r\nhost: q\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n".to_vec(),
            "400 Bad Request",
        ),
    ];
    let replies = tokio::task::spawn_blocking(move || {
        cases
            .into_iter()
            .map(|(request, status)| {
                let mut stream = std::net::TcpStream::connect(&address).unwrap();
                stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                stream.write_all(&request).unwrap();
                let mut reply = Vec::new();
                let _ = stream.read_to_end(&mut reply);
                (String::from_utf8_lossy(&reply).into_owned(), status)
            })
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    for (reply, status) in replies {
        assert!(reply.starts_with(&format!("HTTP/1.1 {status}\r\n")), "{reply}");
        assert!(reply.contains("connection: close\r\n") && reply.contains("content-length: 0\r\n"), "{reply}");
    }
    let r = f.check(json!({"domain": "test", "descriptors": [[["k", "v"]]]})).await;
    assert_eq!(r["allowed"], true);
}

/// The shipped binary: listens where told, requires its token, and on
/// SIGTERM finishes and exits 0.
#[test]
fn the_binary_serves_and_stops_on_sigterm() {
    let config = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/quota.yaml");
    let mut child = Command::new(env!("CARGO_BIN_EXE_floodgate-quota"))
        .arg("--config")
        .arg(&config)
        .args(["--listen", "127.0.0.1:0", "--log-format", "json"])
        .env("FLOODGATE_QUOTA_TOKEN", "t0ken")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let address = loop {
        let line = lines.next().expect("the binary logged its address").unwrap();
        let entry: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
        if entry["fields"]["message"] == "listening" {
            break entry["fields"]["address"].as_str().unwrap().to_string();
        }
    };
    assert!(address.starts_with("127.0.0.1:"), "{address}");

    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let client = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build().unwrap();
        let body = json!({"domain": "edge", "descriptors": [[["remote_address", "10.0.0.1"]]]});
        let denied = client.post(format!("http://{address}/v1/check")).json(&body).send().await.unwrap();
        assert_eq!(denied.status().as_u16(), 401);
        let ok =
            client.post(format!("http://{address}/v1/check")).bearer_auth("t0ken").json(&body).send().await.unwrap();
        assert_eq!(ok.status().as_u16(), 200);
        let reply: Value = ok.json().await.unwrap();
        assert_eq!(reply["results"][0]["remaining"], 99);
    });

    let status = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status().unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(20);
    let exit = loop {
        if let Some(exit) = child.try_wait().unwrap() {
            break exit;
        }
        assert!(Instant::now() < deadline, "did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(exit.success(), "{exit:?}");
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert!(rest.iter().any(|l| l.contains("\"stopped\"")), "{rest:?}");
}

/// A fresh instance's first scrape already lists every counter and histogram
/// family at 0 (per configured domain where it has a domain label), so
/// dashboards and alerts on rates or absent series work from a restart on (an
/// empty page until the first request left them blank); a domain added by a
/// reload gets its series too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_is_exported_at_zero_from_the_first_scrape() {
    for (backend, store, failures) in [
        (Backend::Memory, "memory", &["full"][..]),
        (Backend::Redis, "redis", &["timeout", "unavailable", "contended"][..]),
    ] {
        let f = Fixture::new(backend, LIMITS).await;
        let metrics = f.metrics().await;
        let mut expected = vec![
            r#"floodgate_quota_requests_total{endpoint="check",status="200"} 0"#.to_string(),
            r#"floodgate_quota_requests_total{endpoint="lease",status="503"} 0"#.to_string(),
            r#"floodgate_quota_requests_total{endpoint="return",status="400"} 0"#.to_string(),
            r#"floodgate_quota_requests_total{endpoint="rls",status="INVALID_ARGUMENT"} 0"#.to_string(),
            r#"floodgate_quota_decisions_total{domain="test",kind="check",result="denied"} 0"#.to_string(),
            r#"floodgate_quota_decisions_total{domain="test",kind="lease",result="allowed"} 0"#.to_string(),
            r#"floodgate_quota_tokens_granted_total{domain="test"} 0"#.to_string(),
            r#"floodgate_quota_tokens_returned_total{domain="test"} 0"#.to_string(),
            format!(r#"floodgate_quota_store_latency_seconds_count{{op="check",store="{store}"}} 0"#),
            r#"floodgate_quota_config_reloads_total{result="error"} 0"#.to_string(),
            r#"floodgate_quota_config_reloads_total{result="refused"} 0"#.to_string(),
        ];
        expected.extend(
            failures
                .iter()
                .map(|kind| format!(r#"floodgate_quota_store_errors_total{{kind="{kind}",store="{store}"}} 0"#)),
        );
        for series in &expected {
            assert!(metrics.lines().any(|l| l == series), "{store}: no {series} in\n{metrics}");
        }
        f.service.set_domains(common::domains("domain: added\ndescriptors: []\n"));
        let metrics = f.metrics().await;
        assert!(metrics.contains(r#"floodgate_quota_tokens_granted_total{domain="added"} 0"#), "{metrics}");
    }
}

const NOTICED: &str = "domain: edge\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 10}\n---\ndomain: other\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 10}\n";

/// A lease call of `domain` through `client` with `token`: its status and body.
async fn lease_with(f: &Fixture, client: &reqwest::Client, token: &str, body: &Value) -> (u16, Value) {
    let response =
        client.post(format!("{}/v1/lease", f.base)).bearer_auth(token).json(body).send().await.expect("request");
    (response.status().as_u16(), response.json().await.unwrap_or(Value::Null))
}

/// A lease of `user` in `domain` reporting `reported` units admitted
/// without one, asking for the domain's notices.
fn reporting(domain: &str, id: &str, user: &str, reported: u64) -> Value {
    json!({"domain": domain, "notices": true,
           "leases": [{"id": id, "descriptor": [["user", user]], "wanted": 0, "reported": reported}]})
}

fn noticed(body: &Value) -> Vec<String> {
    body["near"].as_array().map_or(Vec::new(), |near| {
        near.iter().map(|n| n["descriptor"][0][1].as_str().unwrap_or_default().to_string()).collect()
    })
}

/// Near-limit notices name a domain's keys (a user's e-mail): only callers of
/// that domain read them, those bearing the domain's own token
/// (`--domain-token`). The service's one token still admits every domain's
/// calls but reads (and posts) no domain's notices (before, any holder of it
/// read every domain's), another domain's token is refused on this domain's
/// calls, and one caller's bogus reports (32 keys in one call) do not push the
/// others' notices off the board.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn near_limit_notices_are_only_for_callers_of_their_domain() {
    let options = Options {
        auth_token: Some("service-secret"),
        domain_tokens: vec![("edge", "edge-secret"), ("other", "other-secret")],
        ..Options::default()
    };
    let f = Fixture::with(Backend::Memory, NOTICED, options).await;
    f.clock.set(common::T0 + floodgate_core::time::SECOND.times(20));
    // A caller of edge reports alice near her limit: posted.
    let (status, body) =
        lease_with(&f, &f.client, "edge-secret", &reporting("edge", "a1", "alice@example.com", 9)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["leases"][0]["near_limit"], true);
    let (_, body) = lease_with(&f, &f.client, "edge-secret", &reporting("edge", "a2", "carol", 0)).await;
    assert_eq!(noticed(&body), ["alice@example.com"], "a caller of edge reads edge's notices");
    // The service's token: admitted, but reads no domain's notices, and
    // what it reports is counted (and answered near) but posts nothing.
    let (status, body) = lease_with(&f, &f.client, "service-secret", &reporting("edge", "s1", "bob", 9)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["leases"][0]["near_limit"], true, "its own key's state is its business");
    assert_eq!(body.get("near"), None, "the service's token reads no domain's notices: {body}");
    let (_, body) = lease_with(&f, &f.client, "edge-secret", &reporting("edge", "a3", "carol", 0)).await;
    assert_eq!(noticed(&body), ["alice@example.com"], "bob was not posted: {body}");
    // Another domain's token: refused on edge's calls; its own board is its own.
    let (status, body) = lease_with(&f, &f.client, "other-secret", &reporting("edge", "o1", "carol", 0)).await;
    assert_eq!((status, body["error"].as_str()), (401, Some("this bearer token is another domain's")));
    let (status, body) = lease_with(&f, &f.client, "other-secret", &reporting("other", "o2", "carol", 0)).await;
    assert_eq!((status, noticed(&body)), (200, Vec::<String>::new()));
    // A caller of edge from another address reports 32 bogus keys in one
    // call: it takes the free places and then only its own; alice stays.
    let bogus = Fixture::client_from("127.0.0.2");
    let leases: Vec<Value> = (0..32)
        .map(|i| json!({"id": format!("b{i}"), "descriptor": [["user", format!("bogus{i}")]], "wanted": 0, "reported": 10}))
        .collect();
    let (status, _) = lease_with(&f, &bogus, "edge-secret", &json!({"domain": "edge", "leases": leases})).await;
    assert_eq!(status, 200);
    let (_, body) = lease_with(&f, &f.client, "edge-secret", &reporting("edge", "a4", "carol", 0)).await;
    let seen = noticed(&body);
    assert_eq!(seen.len(), 32, "{seen:?}");
    assert!(seen.contains(&"alice@example.com".to_string()), "the real notice stays: {seen:?}");
}
