//! A real Envoy (`$ENVOY_BIN`) with its own global rate limit filter
//! (`envoy.filters.http.ratelimit`) asking the real `floodgate-quota` binary
//! over gRPC, configured by the example the README shows
//! (`examples/envoy-ratelimit.yaml`, ports swapped for free ones): exact
//! counts, the statuses and headers Envoy turns them into, shadow mode, and
//! the filter's failure mode once the service is gone.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader, Lines};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, Command, Stdio};
use std::time::{Duration, Instant};

use floodgate_e2e::{Envoy, HttpResponse};
use serde_json::Value;

fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples").join(name)
}

/// The example bootstrap with its ports replaced; each must occur once.
fn bootstrap(listener: u16, admin: u16, grpc: u16, backend: u16, deny: bool) -> String {
    let mut text = std::fs::read_to_string(example("envoy-ratelimit.yaml")).unwrap();
    let swaps = [
        ("port_value: 10000}", listener),
        ("port_value: 9901}", admin),
        ("port_value: 8082}", grpc),
        ("port_value: 8080}", backend),
    ];
    for (from, port) in swaps {
        assert_eq!(text.matches(from).count(), 1, "{from} in the example");
        text = text.replace(from, &format!("port_value: {port}}}"));
    }
    if deny {
        assert_eq!(text.matches("failure_mode_deny: false").count(), 1);
        text = text.replace("failure_mode_deny: false", "failure_mode_deny: true");
    }
    text
}

/// The real binary with the example limits, gRPC on; killed on drop.
struct Quota {
    child: Child,
    http: String,
    grpc: u16,
    logs: Lines<BufReader<ChildStderr>>,
}

impl Quota {
    fn start() -> Quota {
        let mut child = Command::new(env!("CARGO_BIN_EXE_floodgate-quota"))
            .arg("--config")
            .arg(example("rls-limits.yaml"))
            .args(["--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0", "--grpc-response-headers"])
            .args(["--log-format", "json"])
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut logs = BufReader::new(child.stderr.take().unwrap()).lines();
        let (mut http, mut grpc) = (None, None);
        while http.is_none() || grpc.is_none() {
            let line = logs.next().expect("the binary logged both addresses").unwrap();
            let entry: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
            let address = entry["fields"]["address"].as_str().map(str::to_string);
            match entry["fields"]["message"].as_str() {
                Some("listening") => http = address,
                Some("gRPC rate limit service listening") => grpc = address,
                _ => {}
            }
        }
        let grpc = grpc.unwrap().rsplit_once(':').unwrap().1.parse().unwrap();
        Quota { child, http: http.unwrap(), grpc, logs }
    }

    fn metrics(&self) -> String {
        let port = self.http.rsplit_once(':').unwrap().1.parse().unwrap();
        let body = floodgate_e2e::Conn::open(port).unwrap().get("/metrics", &[]).body;
        String::from_utf8(body).unwrap()
    }

    /// SIGTERM, then the exit status (bounded wait).
    fn terminate(&mut self) -> std::process::ExitStatus {
        let status = Command::new("kill").arg("-TERM").arg(self.child.id().to_string()).status().unwrap();
        assert!(status.success());
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(exit) = self.child.try_wait().unwrap() {
                return exit;
            }
            assert!(Instant::now() < deadline, "did not stop on SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Quota {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A plain HTTP backend answering 200 "backend" to everything, on its own
/// runtime; stops with the runtime.
fn backend() -> (tokio::runtime::Runtime, u16) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let port = listener.local_addr().unwrap().port();
    let app = axum::Router::new().fallback(|| async { "backend" });
    runtime.spawn(async move { axum::serve(listener, app).await });
    (runtime, port)
}

fn get(envoy: &Envoy, path: &str, key: Option<&str>) -> HttpResponse {
    let headers: Vec<(&str, &[u8])> = key.map(|k| ("x-api-key", k.as_bytes())).into_iter().collect();
    envoy.connect().get(path, &headers)
}

fn header<'a>(response: &'a HttpResponse, name: &str) -> &'a str {
    response.header(name).unwrap_or_else(|| panic!("no {name} in {response:?}"))
}

#[test]
fn envoys_ratelimit_filter_uses_the_grpc_api() {
    let (_runtime, backend_port) = backend();
    let mut quota = Quota::start();
    let grpc = quota.grpc;
    let open = Envoy::start_bootstrap(move |port, admin| bootstrap(port, admin, grpc, backend_port, false));
    let deny = Envoy::start_bootstrap(move |port, admin| bootstrap(port, admin, grpc, backend_port, true));

    // Exactly 3 for alice (a bucket of 3 per hour), then 429s.
    let answers: Vec<HttpResponse> = (0..5).map(|_| get(&open, "/items", Some("alice"))).collect();
    let statuses: Vec<u16> = answers.iter().map(|r| r.status).collect();
    assert_eq!(statuses, [200, 200, 200, 429, 429], "{answers:?}");
    assert_eq!(answers[0].body, b"backend");
    for (i, answer) in answers.iter().enumerate() {
        let remaining = 2u32.saturating_sub(i as u32).to_string();
        // Envoy's draft-03 headers, from the descriptor status.
        assert_eq!(header(answer, "x-ratelimit-limit"), "3, 3;w=3600", "{answer:?}");
        assert_eq!(header(answer, "x-ratelimit-remaining"), remaining, "{answer:?}");
        // The token bucket earns its next token within 20 minutes.
        let reset: u64 = header(answer, "x-ratelimit-reset").parse().unwrap();
        assert!(reset > 0 && reset <= 1_200, "{answer:?}");
        // The service's own headers (--grpc-response-headers).
        assert_eq!(header(answer, "ratelimit-limit"), "3", "{answer:?}");
        assert_eq!(header(answer, "ratelimit-remaining"), remaining, "{answer:?}");
        // Rounded up here, down by Envoy.
        let own_reset: u64 = header(answer, "ratelimit-reset").parse().unwrap();
        assert!(own_reset == reset || own_reset == reset + 1, "{answer:?}");
        assert_eq!(answer.header("x-envoy-ratelimited").is_some(), answer.status == 429, "{answer:?}");
    }
    // The other Envoy shares the same counters: alice is out there too.
    assert_eq!(get(&deny, "/items", Some("alice")).status, 429);
    // Bob has his own bucket; no key means no api_key descriptor.
    assert_eq!(get(&open, "/items", Some("bob")).status, 200);
    for _ in 0..5 {
        assert_eq!(get(&open, "/items", None).status, 200);
    }

    // Shadow mode: /beta's limit of 1 is counted, reported, never enforced.
    let beta: Vec<HttpResponse> = (0..3).map(|_| get(&open, "/beta", None)).collect();
    assert!(beta.iter().all(|r| r.status == 200 && r.header("x-envoy-ratelimited").is_none()), "{beta:?}");
    assert_eq!(header(&beta[2], "x-ratelimit-remaining"), "0");
    let metrics = quota.metrics();
    let decided = |result: &str, n: u64| {
        let line = format!(r#"floodgate_quota_decisions_total{{domain="envoy",kind="check",result="{result}"}} {n}"#);
        assert!(metrics.contains(&line), "{line} in\n{metrics}");
    };
    decided("denied", 3);
    decided("shadow_denied", 2);
    assert_eq!(open.stat("cluster.backend.ratelimit.over_limit"), 2);
    assert_eq!(open.stat("cluster.backend.ratelimit.error"), 0);

    // The service stops cleanly on SIGTERM, gRPC server included...
    let exit = quota.terminate();
    assert!(exit.success(), "{exit:?}");
    let rest: Vec<String> = quota.logs.by_ref().map_while(Result::ok).collect();
    assert!(rest.iter().any(|l| l.contains("\"stopped\"")), "{rest:?}");
    assert!(!rest.iter().any(|l| l.contains("shutdown deadline passed")), "drained, not cut off: {rest:?}");
    // ...and then Envoy's failure mode decides: open lets alice through,
    // deny answers 500.
    assert_eq!(get(&open, "/items", Some("alice")).status, 200, "{}", open.log_tail());
    assert_eq!(get(&deny, "/items", Some("bob")).status, 500, "{}", deny.log_tail());
    assert!(open.stat("cluster.backend.ratelimit.error") >= 1);
    assert!(open.stat("cluster.backend.ratelimit.failure_mode_allowed") >= 1);
}

/// The README's snippet is the example this suite runs, and Envoy accepts it
/// as it stands.
#[test]
fn readme_shows_the_tested_example() {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    for name in ["envoy-ratelimit.yaml", "rls-limits.yaml"] {
        let text = std::fs::read_to_string(example(name)).unwrap();
        assert!(readme.contains(&text), "quota/README.md must show examples/{name} verbatim");
    }
    let output = floodgate_e2e::validate(&example("envoy-ratelimit.yaml"));
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
}
