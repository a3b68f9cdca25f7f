//! The host layer against a mock host ([`crate::mock_host`]): the filter's
//! real code, through the SDK's real dispatcher, driven as Envoy drives it.
//! What Envoy itself does is the end-to-end tests' part (`tests/`); these
//! pin down what this crate does with each host event — which calls it
//! dispatches, which requests it resumes or answers from the root context,
//! what it counts — including the host failures a test Envoy cannot be made
//! to produce at will.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Once;

use proxy_wasm::types::Action;
use serde_json::Value;

use crate::mock_host::{self, HttpCall, SharedMap};

extern "C" {
    fn proxy_on_context_create(context_id: u32, root_context_id: u32);
    fn proxy_on_configure(context_id: u32, plugin_configuration_size: usize) -> bool;
    fn proxy_on_request_headers(context_id: u32, num_headers: usize, end_of_stream: bool) -> Action;
    fn proxy_on_response_headers(context_id: u32, num_headers: usize, end_of_stream: bool) -> Action;
    fn proxy_on_tick(context_id: u32);
    fn proxy_on_http_call_response(
        context_id: u32,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        num_trailers: usize,
    );
    fn proxy_on_done(context_id: u32) -> bool;
    fn proxy_on_queue_ready(context_id: u32, queue_id: u32);
    fn proxy_on_delete(context_id: u32);
}

const T0: u64 = 1_700_000_000_000_000_000;
const ROOT: u32 = 1;
const MS: u64 = 1_000_000;
/// The service's answer admitting a check of one descriptor.
const CHECK_ALLOWED: &[u8] =
    br#"{"allowed": true, "results": [{"code": "ok", "limit": 5, "window_ms": 60000, "remaining": 4, "reset_ms": 1000}]}"#;

/// One global rule on `/login`, asking cluster `quota`; a local fall-back of
/// 2 a minute. `extra` adds fields to the rule.
fn global_config(extra: &str) -> String {
    format!(
        r#"{{"global": {{"cluster": "quota", "domain": "edge", "timeout": "300ms", "max_wait": "200ms"}},
            "rules": [{{"name": "fleet", "scope": "global", {extra}
                        "descriptors": [{{"generic_key": {{"descriptor_key": "path", "descriptor_value": "/login"}}}}],
                        "fallback": {{"limit": 2, "period": "1m"}}}}]}}"#
    )
}

/// Runs `test` on a thread of its own: the SDK's dispatcher and the mock
/// host are per thread, as each Envoy worker has its own VM.
fn on_a_worker(test: impl FnOnce() + Send + 'static) {
    if let Err(panic) = std::thread::spawn(test).join() {
        std::panic::resume_unwind(panic);
    }
}

/// One worker of an Envoy, from its VM's start.
struct Worker {
    next_context: u32,
    /// Calls already looked at.
    seen: usize,
}

impl Worker {
    /// Starts a worker with `config`, sharing `shared` with others; Envoy
    /// has the cluster `quota` when `with_cluster`.
    fn start(config: &str, shared: SharedMap, with_cluster: bool) -> (Self, bool) {
        static LOGGER: Once = Once::new();
        // The SDK installs its logger once per process, unguarded against
        // threads racing to do it.
        LOGGER.call_once(|| crate::_initialize());
        crate::_initialize();
        mock_host::with(|host| {
            host.shared = shared;
            host.now = T0;
            host.configuration = config.as_bytes().to_vec();
            if with_cluster {
                host.clusters.insert("quota".to_string());
            }
            host.live.insert(ROOT);
            host.effective = ROOT;
            host.handler = "on_configure";
        });
        unsafe { proxy_on_context_create(ROOT, 0) };
        let configured = unsafe { proxy_on_configure(ROOT, config.len()) };
        (Self { next_context: ROOT + 1, seen: 0 }, configured)
    }

    /// Starts a worker that must accept `config`, and answers its first call
    /// (the check that the cluster exists) with 200.
    fn ready(config: &str) -> Self {
        let (mut worker, configured) = Self::start(config, SharedMap::default(), true);
        assert!(configured, "{config}");
        worker.tick();
        let hello = worker.take_call("/readyz");
        worker.answer(&hello, Some(200), b"");
        worker
    }

    /// Starts a worker with local rules only: it makes no call.
    fn local(config: &str) -> Self {
        let (mut worker, configured) = Self::start(config, SharedMap::default(), false);
        assert!(configured, "{config}");
        worker.tick();
        assert!(worker.new_calls().is_empty());
        worker
    }

    /// A request to `/login` arrives; its context and what the filter returned.
    fn request(&mut self) -> (u32, Action) {
        let (context, action, _) = self.request_with(&[]);
        (context, action)
    }

    /// A request to `/login` with `extra` headers arrives; its context, what
    /// the filter returned, and the heap allocations the filter made in its
    /// request handler (and the event-loop turn after it). The context's own
    /// creation is not counted: the SDK boxes every context, as for any filter.
    fn request_with(&mut self, extra: &[(&str, &str)]) -> (u32, Action, u64) {
        let context = self.next_context;
        self.next_context += 1;
        mock_host::with(|host| {
            host.live.insert(context);
            host.effective = context;
            host.handler = "on_request_headers";
            let headers = [(":method", "POST"), (":path", "/login"), (":authority", "example")];
            let headers = headers.iter().chain(extra).map(|(n, v)| (n.to_string(), v.to_string())).collect();
            host.request_headers.insert(context, headers);
        });
        unsafe { proxy_on_context_create(context, ROOT) };
        let before = mock_host::allocations();
        let action = unsafe { proxy_on_request_headers(context, 3, true) };
        self.turn();
        (context, action, mock_host::allocations() - before)
    }

    /// The worker's event loop turns: what handlers posted to shared queues
    /// runs now, in the context that registered each queue (Envoy posts
    /// `on_queue_ready` to the registering worker).
    fn turn(&self) {
        while let Some((context, queue)) = mock_host::with(|host| {
            let queue = (!host.posted.is_empty()).then(|| host.posted.remove(0))?;
            let context = host.queues[&queue].0;
            (host.effective, host.handler) = (context, "on_queue_ready");
            Some((context, queue))
        }) {
            unsafe { proxy_on_queue_ready(context, queue) };
        }
    }

    /// A request waits for its pool's first lease, which grants `granted`
    /// tokens, and is served from it; the lease's id.
    fn serve_on_a_new_lease(&mut self, granted: u64) -> String {
        let (context, _) = self.request();
        let lease = self.take_call("/v1/lease");
        self.answer(&lease, Some(200), &grant(granted));
        assert_eq!(self.resumed(), vec![context]);
        self.end(context);
        json(&lease)["leases"][0]["id"].as_str().unwrap().to_string()
    }

    /// The upstream answered request `context`: the filter adds its headers.
    fn respond(&self, context: u32) -> Vec<(String, String)> {
        mock_host::with(|host| (host.effective, host.handler) = (context, "on_response_headers"));
        assert_eq!(unsafe { proxy_on_response_headers(context, 0, true) }, Action::Continue);
        mock_host::with(|host| host.response_headers.remove(&context).unwrap_or_default())
    }

    /// Request `context`'s stream ends (served, reset or the client gone).
    fn end(&self, context: u32) {
        mock_host::with(|host| (host.effective, host.handler) = (context, "on_done"));
        assert!(unsafe { proxy_on_done(context) });
        unsafe { proxy_on_delete(context) };
        mock_host::with(|host| {
            host.live.remove(&context);
        });
    }

    fn tick(&self) {
        mock_host::with(|host| (host.effective, host.handler) = (ROOT, "on_tick"));
        unsafe { proxy_on_tick(ROOT) };
    }

    fn advance(&self, ms: u64) {
        mock_host::with(|host| host.now += ms * MS);
    }

    /// The calls dispatched since the last look.
    fn new_calls(&mut self) -> Vec<HttpCall> {
        let calls = mock_host::with(|host| host.calls[self.seen..].to_vec());
        self.seen += calls.len();
        calls
    }

    /// The one new call, which must be to `path`.
    fn take_call(&mut self, path: &str) -> HttpCall {
        let calls = self.new_calls();
        assert_eq!(calls.len(), 1, "one call expected: {calls:#?}");
        let call = calls.into_iter().next().unwrap();
        assert_eq!(call.header(":path"), Some(path), "{call:#?}");
        assert_eq!(call.cluster, "quota");
        call
    }

    /// Delivers an answer to `call`: `status` `None` is a reset stream
    /// (no headers, no body), as Envoy reports a failed connection.
    fn answer(&self, call: &HttpCall, status: Option<u16>, body: &[u8]) {
        self.answer_sized(call, status, body, body.len());
    }

    /// As [`Worker::answer`], with the body size the host reports. The
    /// answer goes to the context the call was dispatched as: the root's,
    /// so that it outlives any request, but for a check, its request's
    /// (whose end cancels it, as Envoy cancels the calls of a context that
    /// goes away).
    fn answer_sized(&self, call: &HttpCall, status: Option<u16>, body: &[u8], body_size: usize) {
        match call.header(":path") {
            Some("/v1/check") => assert_ne!(call.context, ROOT, "a check is its request's call: {call:#?}"),
            _ => {
                assert_eq!(call.context, ROOT, "calls are the root's, so their answers outlive any request: {call:#?}")
            }
        }
        assert!(
            call.context == ROOT || mock_host::with(|host| host.live.contains(&call.context)),
            "the call of a context that ended was cancelled: {call:#?}"
        );
        let headers = status.map(|s| vec![(":status".to_string(), s.to_string())]);
        let num_headers = headers.as_ref().map_or(0, Vec::len);
        mock_host::with(|host| {
            host.answer = Some((headers, body.to_vec()));
            host.effective = call.context;
            host.handler = "on_http_call_response";
        });
        unsafe { proxy_on_http_call_response(call.context, call.token, num_headers, body_size, 0) };
        mock_host::with(|host| host.answer = None);
        self.turn();
    }

    /// Metric `name` as Envoy shows it once the worker has flushed its
    /// counts (on its tick: the flush period is the lag).
    fn metric(&self, name: &str) -> i64 {
        self.tick();
        mock_host::with(|host| host.metric(name))
    }

    fn resumed(&self) -> Vec<u32> {
        self.resumed_in().into_iter().map(|(context, _)| context).collect()
    }

    /// The requests resumed since the last look, with the callback each
    /// was resumed from.
    fn resumed_in(&self) -> Vec<(u32, &'static str)> {
        mock_host::with(|host| std::mem::take(&mut host.resumed).into_iter().zip(host.resumed_in.drain(..)).collect())
    }

    fn responses(&self) -> Vec<mock_host::LocalResponse> {
        mock_host::with(|host| std::mem::take(&mut host.responses))
    }

    fn tick_ms(&self) -> u32 {
        mock_host::with(|host| host.tick_ms)
    }
}

fn json(call: &HttpCall) -> Value {
    serde_json::from_slice(&call.body).unwrap()
}

/// The service's answer to a lease call: `granted` tokens for 1 s, of 100 a minute.
fn grant(granted: u64) -> Vec<u8> {
    format!(
        r#"{{"leases": [{{"code": "ok", "granted": {granted}, "valid_ms": 1000, "limit": 100,
             "window_ms": 60000, "remaining": 50, "reset_ms": 30000, "window": 0}}]}}"#
    )
    .into_bytes()
}

/// A request finds its pool empty and waits; one lease call with the rule's
/// descriptor leaves at once from the request's own handler (as the root's
/// call), and the handler of its answer resumes the request, with no tick
/// in between; later requests spend the leased tokens with no call.
#[test]
fn an_empty_pool_pauses_the_request_until_the_lease_arrives() {
    on_a_worker(|| {
        let mut worker = Worker::ready(&global_config(""));
        assert_eq!(worker.tick_ms(), 50, "global rules keep a tick to watch their mode");

        let (first, action) = worker.request();
        assert_eq!(action, Action::Pause, "nothing leased yet");
        let lease = worker.take_call("/v1/lease");
        assert_eq!(lease.handler, "on_queue_ready", "posted by the request's handler, sent at the loop's next turn");
        assert_eq!(worker.tick_ms(), 2, "a waiting request still looks for a refill another worker asked for");
        assert_eq!(lease.header(":method"), Some("POST"));
        assert_eq!(lease.timeout_ms, 300);
        let body = json(&lease);
        assert_eq!(body["domain"], "edge");
        assert_eq!(body["leases"][0]["descriptor"], serde_json::json!([["path", "/login"]]));
        assert!(body["leases"][0]["wanted"].as_u64().unwrap() >= 1);
        assert_eq!(worker.metric("floodgate.global.refreshes"), 1);

        worker.advance(5);
        worker.answer(&lease, Some(200), &grant(10));
        assert_eq!(worker.metric("floodgate.global.tokens_leased"), 10);
        assert_eq!(worker.metric("floodgate.global.callouts_ok"), 2, "the cluster check and the lease");
        assert_eq!(
            worker.resumed_in(),
            vec![(first, "on_http_call_response")],
            "resumed by its answer, in its context"
        );
        assert_eq!(worker.metric("floodgate.global.refill_waits"), 1);
        assert_eq!(worker.metric("floodgate.global.refill_wait_ms"), 5);
        assert_eq!(worker.metric("floodgate.allowed"), 1);
        let headers = worker.respond(first);
        assert!(headers.iter().any(|(n, v)| n == "ratelimit-policy" && v.contains("q=100")), "{headers:?}");
        worker.end(first);

        for _ in 0..5 {
            let (context, action) = worker.request();
            assert_eq!(action, Action::Continue, "spent from the pool");
            worker.end(context);
        }
        worker.tick();
        assert!(worker.new_calls().is_empty(), "no call while the pool has tokens");
        assert_eq!(worker.metric("floodgate.allowed"), 6);
        assert_eq!(worker.metric("floodgate.global.callouts_sent"), 2);
    });
}

/// A failed lease call puts the rule in its fall-back at once: the waiting
/// request is decided by the local limit (2 a minute), beyond it requests
/// are answered 429; a probe after the backoff finds the service again.
#[test]
fn a_failed_lease_falls_back_to_the_local_limit_and_a_probe_brings_global_mode_back() {
    on_a_worker(|| {
        let mut worker = Worker::ready(&global_config(""));
        let (first, action) = worker.request();
        assert_eq!(action, Action::Pause);
        let lease = worker.take_call("/v1/lease");
        worker.answer(&lease, Some(503), b"no healthy upstream");
        assert_eq!(worker.metric("floodgate.global.callouts_refused"), 1);
        assert_eq!(worker.resumed_in(), vec![(first, "on_http_call_response")], "the fall-back admitted it at once");
        assert_eq!(worker.metric("floodgate.rule.fleet.fallback_active"), 1);
        assert_eq!(worker.metric("floodgate.rule.fleet.fallback"), 1);
        assert!(
            mock_host::with(|host| host.logs.iter().any(|(_, line)| line.contains("rules fall back"))),
            "the failure is logged"
        );

        let (second, action) = worker.request();
        assert_eq!(action, Action::Continue, "second of the fall-back's 2");
        let (third, action) = worker.request();
        assert_eq!(action, Action::Pause, "answered by the filter");
        let responses = worker.responses();
        assert_eq!(responses.len(), 1);
        assert_eq!((responses[0].context_id, responses[0].status), (third, 429));
        assert!(responses[0].header("retry-after").is_some(), "{:?}", responses[0].headers);
        for context in [first, second, third] {
            worker.end(context);
        }
        assert!(worker.new_calls().is_empty(), "no lease asked in fall-back");

        worker.advance(150);
        worker.tick();
        let probe = worker.take_call("/readyz");
        assert_eq!(probe.header(":method"), Some("GET"));
        worker.answer(&probe, Some(200), b"ready");
        worker.tick();
        assert_eq!(worker.metric("floodgate.rule.fleet.fallback_active"), 0, "global again");
        let (back, action) = worker.request();
        assert_eq!(action, Action::Pause, "global mode leases again");
        worker.take_call("/v1/lease");
        worker.end(back);
    });
}

/// Whatever the service (or Envoy) delivers — a reset stream, a body that
/// is not the protocol, an answer too large to read — is a counted failure
/// and a fall-back, never a panic.
#[test]
fn broken_answers_are_counted_failures_not_panics() {
    let cases: [(&str, Option<u16>, &[u8], usize); 5] = [
        ("callouts_bad_status", None, b"", 0),
        ("callouts_timeout", Some(504), b"upstream request timeout", 24),
        ("callouts_bad_answer", Some(200), b"{\"leases\": 7}", 13),
        ("callouts_bad_answer", Some(200), b"{\"leases\": []}", 14),
        ("callouts_bad_answer", Some(200), b"", 10 * 1024 * 1024),
    ];
    for (counter, status, body, body_size) in cases {
        on_a_worker(move || {
            let mut worker = Worker::ready(&global_config(""));
            let (first, _) = worker.request();
            let lease = worker.take_call("/v1/lease");
            worker.answer_sized(&lease, status, body, body_size);
            assert_eq!(worker.metric(&format!("floodgate.global.{counter}")), 1, "{status:?} {body:?}");
            assert_eq!(worker.metric("floodgate.global.tokens_leased"), 0);
            if body_size > body.len() {
                assert_eq!(mock_host::with(|host| host.body_reads), 0, "a body that large is not read");
            }
            assert_eq!(worker.resumed(), vec![first], "decided by the fall-back");
            assert_eq!(worker.metric("floodgate.rule.fleet.fallback_active"), 1);
        });
    }
}

/// A client that leaves while its request waits for a refill frees its
/// place; the lease still fills the pool, and the next request spends it.
#[test]
fn a_client_gone_while_waiting_is_not_resumed_and_its_lease_is_kept() {
    on_a_worker(|| {
        let mut worker = Worker::ready(&global_config(""));
        let (gone, _) = worker.request();
        let lease = worker.take_call("/v1/lease");
        worker.end(gone);
        assert_eq!(worker.metric("floodgate.delay_abandoned"), 1);
        worker.answer(&lease, Some(200), &grant(3));
        worker.tick();
        assert!(worker.resumed().is_empty(), "nothing to resume");
        let (next, action) = worker.request();
        assert_eq!(action, Action::Continue, "the lease the gone client caused serves the next");
        worker.end(next);
        assert!(worker.new_calls().is_empty());
    });
}

/// Envoy refuses a call to a cluster it does not have: the error names the
/// cluster, and global rules use their fall-back from the first request.
#[test]
fn a_missing_cluster_is_said_plainly_and_rules_fall_back() {
    on_a_worker(|| {
        let (mut worker, configured) = Worker::start(&global_config(""), SharedMap::default(), false);
        assert!(configured, "the cluster is Envoy's business, checked at the first tick");
        worker.tick();
        assert!(worker.new_calls().is_empty());
        let logged = mock_host::with(|host| host.logs.clone());
        assert!(
            logged.iter().any(|(_, line)| line.contains("global.cluster \"quota\" cannot be called")),
            "{logged:?}"
        );
        assert_eq!(worker.metric("floodgate.global.callouts_not_sent"), 1);
        let (context, action) = worker.request();
        assert_eq!(action, Action::Continue, "decided at once by the local fall-back");
        assert_eq!(worker.metric("floodgate.rule.fleet.fallback"), 1);
        worker.end(context);
    });
}

/// In check mode a request waits for one `/v1/check`, which leaves from
/// its own handler as its own call; the answer comes back to the request,
/// which is resumed, or answered a denial 429 with the service's
/// `Retry-After`.
#[test]
fn check_mode_asks_per_request_and_answers_a_denial_in_the_request() {
    on_a_worker(|| {
        let mut worker = Worker::ready(&global_config(r#""mode": "check","#));
        let (admitted, action) = worker.request();
        assert_eq!(action, Action::Pause);
        let check = worker.take_call("/v1/check");
        assert_eq!(
            (check.handler, check.context),
            ("on_request_headers", admitted),
            "sent by the request's handler, as its own call"
        );
        let body = json(&check);
        assert_eq!(body["descriptors"], serde_json::json!([[["path", "/login"]]]));
        assert_eq!(body["hits"], 1);
        worker.answer(&check, Some(200), CHECK_ALLOWED);
        assert_eq!(worker.resumed_in(), vec![(admitted, "on_http_call_response")], "resumed on the answer");

        let (denied, _) = worker.request();
        let check = worker.take_call("/v1/check");
        worker.answer(
            &check,
            Some(200),
            br#"{"allowed": false, "retry_after_ms": 4500, "results": [{"code": "over_limit", "limit": 5,
                 "window_ms": 60000, "remaining": 0, "reset_ms": 4500, "retry_after_ms": 4500}]}"#,
        );
        assert!(worker.resumed().is_empty());
        let responses = worker.responses();
        assert_eq!(responses.len(), 1);
        assert_eq!((responses[0].context_id, responses[0].status), (denied, 429));
        assert_eq!(responses[0].header("retry-after"), Some("5"), "4.5 s, rounded up");
        assert_eq!(worker.metric("floodgate.limited"), 1);
        assert_eq!(worker.metric("floodgate.allowed"), 1);
        worker.end(admitted);
        worker.end(denied);
    });
}

/// When the configuration goes away, unspent leased tokens go back in one
/// `/v1/return` naming the lease, and the root context stays until it is
/// answered.
#[test]
fn a_configuration_going_away_returns_its_unspent_tokens_then_is_done() {
    on_a_worker(|| {
        let mut worker = Worker::ready(&global_config(""));
        let lease_id = worker.serve_on_a_new_lease(10);

        mock_host::with(|host| (host.effective, host.handler) = (ROOT, "on_done"));
        assert!(!unsafe { proxy_on_done(ROOT) }, "not done before the return is answered");
        let give_back = worker.take_call("/v1/return");
        let body = json(&give_back);
        assert_eq!(body["returns"], serde_json::json!([{"id": lease_id, "tokens": 9}]));
        assert!(!mock_host::with(|host| host.done));
        worker.answer(&give_back, Some(200), br#"{"returned": [9]}"#);
        assert!(mock_host::with(|host| host.done), "proxy_done once the service answered");
        assert_eq!(worker.metric("floodgate.global.tokens_returned"), 9);
    });
}

/// Two workers of one Envoy share the pool: while one worker's refresh is in
/// flight, the other's request waits for it instead of asking again, and is
/// served from it by its own worker's tick (only the worker that paused a
/// request may resume it).
#[test]
fn two_workers_share_one_refresh() {
    use std::sync::mpsc;
    let shared = SharedMap::default();
    let config = global_config("");
    // Worker A asks and hands its call over; worker B then finds the claim.
    let (to_b, from_a) = mpsc::channel::<()>();
    let (to_a, from_b) = mpsc::channel::<()>();
    let a = {
        let (shared, config) = (shared.clone(), config.clone());
        std::thread::spawn(move || {
            let (mut worker, _) = Worker::start(&config, shared, true);
            let (first, _) = worker.request();
            let calls = worker.new_calls();
            let lease = calls.iter().find(|c| c.header(":path") == Some("/v1/lease")).unwrap().clone();
            to_b.send(()).unwrap();
            from_b.recv().unwrap();
            worker.answer(&lease, Some(200), &grant(10));
            assert_eq!(worker.resumed(), vec![first]);
            to_b.send(()).unwrap();
            worker.end(first);
        })
    };
    let b = std::thread::spawn(move || {
        from_a.recv().unwrap();
        let (mut worker, _) = Worker::start(&config, shared, true);
        let (waiting, action) = worker.request();
        assert_eq!(action, Action::Pause, "the pool is empty here too");
        worker.tick();
        let leases = worker.new_calls().into_iter().filter(|c| c.header(":path") == Some("/v1/lease")).count();
        assert_eq!(leases, 0, "the other worker's refresh is in flight: single flight");
        to_a.send(()).unwrap();
        from_a.recv().unwrap();
        worker.tick();
        assert_eq!(worker.resumed(), vec![waiting], "served by its own worker from the shared pool");
        worker.end(waiting);
    });
    for worker in [a, b] {
        if let Err(panic) = worker.join() {
            std::panic::resume_unwind(panic);
        }
    }
}

/// A local limit answers the request over it with 429 and `Retry-After`
/// from the request's own handler, and adds `RateLimit` headers to the
/// response of the one it admits; a configuration the core refuses is
/// refused to Envoy, with the reason logged.
#[test]
fn a_local_limit_answers_429_and_adds_headers_to_what_it_admits() {
    on_a_worker(|| {
        let mut worker =
            Worker::local(r#"{"rules": [{"name": "login", "algorithm": "fixed_window", "limit": 1, "period": "1m"}]}"#);
        assert_eq!(worker.tick_ms(), 0, "no tick without global rules or waiting requests");
        let (admitted, action) = worker.request();
        assert_eq!(action, Action::Continue);
        let headers = worker.respond(admitted);
        assert!(headers.iter().any(|(n, v)| n == "ratelimit" && v.contains("r=0")), "{headers:?}");
        let (limited, action) = worker.request();
        assert_eq!(action, Action::Pause, "the local reply ends it");
        let responses = worker.responses();
        assert_eq!((responses.len(), responses[0].context_id, responses[0].status), (1, limited, 429));
        // Fixed windows are aligned to the epoch: T0 is 20 s into its minute.
        assert_eq!(responses[0].header("retry-after"), Some("40"));
        assert!(worker.respond(limited).is_empty(), "the local reply carried its headers already");
        assert_eq!((worker.metric("floodgate.allowed"), worker.metric("floodgate.limited")), (1, 1));
        assert_eq!(worker.metric("floodgate.rule.login.limited"), 1);
        worker.end(admitted);
        worker.end(limited);
    });
    on_a_worker(|| {
        let (_, configured) = Worker::start(r#"{"rules": [{"name": "x", "limit": 0}]}"#, SharedMap::default(), false);
        assert!(!configured);
        let logged = mock_host::with(|host| host.logs.clone());
        assert!(logged.iter().any(|(_, line)| line.contains("limit")), "the reason is logged: {logged:?}");
    });
}

/// The shaper's delayed request waits on the worker's tick and is resumed,
/// in its own context, once its time has come: not before.
#[test]
fn a_shaped_request_is_resumed_by_the_tick_when_its_delay_is_over() {
    on_a_worker(|| {
        let mut worker = Worker::local(
            r#"{"rules": [{"name": "paced", "algorithm": "shaper", "limit": 10, "period": "10s", "max_delay": "5s"}]}"#,
        );
        let (first, action) = worker.request();
        assert_eq!(action, Action::Continue, "the first goes at once");
        let (second, action) = worker.request();
        assert_eq!(action, Action::Pause, "the second waits a second");
        assert_eq!(worker.tick_ms(), 10, "the tick comes often enough to resume it on time");
        worker.advance(999);
        worker.tick();
        assert!(worker.resumed().is_empty(), "not before its time");
        worker.advance(1);
        worker.tick();
        assert_eq!(worker.resumed(), vec![second]);
        assert_eq!(worker.metric("floodgate.delayed"), 1);
        assert_eq!(worker.metric("floodgate.delay_requested_ms"), 1000);
        assert_eq!(worker.metric("floodgate.delay_actual_ms"), 1000);
        assert_eq!(worker.tick_ms(), 0, "nothing left to wait for");
        worker.end(first);
        worker.end(second);
    });
}

/// A new lease replacing one whose tokens expired while their window still
/// counts them gives them back (counted as expired only once the window has
/// ended); replacing one that still counts keeps what the rate will spend
/// of it and returns the rest. Calls no request waits for are held back, at
/// most 20 ms (returns up to a round), to share one with others, and leave
/// on the tick set for then.
#[test]
fn a_replaced_lease_returns_its_expired_tokens_while_its_window_counts_and_what_the_pool_does_not_keep() {
    on_a_worker(|| {
        let mut worker = Worker::ready(&global_config(""));
        let first_lease = worker.serve_on_a_new_lease(10);

        // The lease (of 1 s, in a window of a minute with 30 s to go) ends
        // with 9 unspent: the next request waits for another.
        worker.advance(1_100);
        let (second, action) = worker.request();
        assert_eq!(action, Action::Pause, "expired tokens do not count");
        let lease = worker.take_call("/v1/lease");
        let second_lease = json(&lease)["leases"][0]["id"].as_str().unwrap().to_string();
        worker.answer(&lease, Some(200), &grant(100));
        assert_eq!(worker.metric("floodgate.global.tokens_expired"), 0, "their window still counts them");
        assert_eq!(worker.resumed(), vec![second]);
        assert!(worker.new_calls().is_empty(), "the return of the expired 9 may wait for company");
        worker.end(second);

        // In the lease's last quarter a request claims a refresh; at about a
        // request a second the pool keeps a token or two of the 98 left.
        worker.advance(800);
        let (third, action) = worker.request();
        assert_eq!(action, Action::Continue);
        assert!(worker.new_calls().is_empty(), "tokens are left: the refresh may wait for company");
        assert_eq!(worker.tick_ms(), 20, "until the latest it may leave");
        worker.advance(20);
        worker.tick();
        // The refresh leaves, and the expired lease's 9 go with it (the
        // service takes them off the window); what the pool does not keep
        // of the second lease goes back later.
        let mut calls = worker.new_calls();
        let at = calls.iter().position(|call| call.header(":path") == Some("/v1/lease")).unwrap();
        let lease = calls.remove(at);
        let returns = |calls: &[HttpCall]| -> Vec<(String, u64)> {
            calls
                .iter()
                .inspect(|call| assert_eq!(call.header(":path"), Some("/v1/return"), "{call:#?}"))
                .flat_map(|call| json(call)["returns"].as_array().unwrap().clone())
                .map(|item| (item["id"].as_str().unwrap().to_string(), item["tokens"].as_u64().unwrap()))
                .collect()
        };
        let mut given_back = returns(&calls);
        worker.answer(&lease, Some(200), &grant(50));
        worker.advance(1_000);
        worker.tick();
        given_back.extend(returns(&worker.new_calls()));
        assert_eq!(given_back.len(), 2, "{given_back:?}");
        assert_eq!(given_back[0], (first_lease, 9));
        assert_eq!(given_back[1].0, second_lease);
        assert!((90..98).contains(&given_back[1].1), "98 left, a few kept: {given_back:?}");
        worker.end(third);
    });
}

/// One request of an API key through `config`, served to its end: the host
/// calls it made by kind, and the heap allocations of its handlers.
fn one_request(worker: &mut Worker, key: &str) -> (std::collections::BTreeMap<&'static str, u32>, u64) {
    mock_host::with(|host| host.host_calls.clear());
    let (context, _, mut allocations) = worker.request_with(&[("x-api-key", key)]);
    let before = mock_host::allocations();
    worker.respond(context);
    worker.end(context);
    allocations += mock_host::allocations() - before;
    (mock_host::with(|host| std::mem::take(&mut host.host_calls)), allocations)
}

/// Asserts `calls` are `budget`, naming every call that is new or more
/// frequent than budgeted.
fn assert_host_calls(calls: &std::collections::BTreeMap<&'static str, u32>, budget: &[(&str, u32)], path: &str) {
    let over: Vec<String> = calls
        .iter()
        .filter(|(kind, n)| budget.iter().find(|(b, _)| b == *kind).is_none_or(|(_, allowed)| *n > allowed))
        .map(|(kind, n)| format!("{kind} ×{n}"))
        .collect();
    assert!(over.is_empty(), "the {path} path makes host calls beyond its budget {budget:?}: {}", over.join(", "));
    let under: Vec<&str> =
        budget.iter().filter(|(kind, n)| calls.get(kind) != Some(n)).map(|(kind, _)| *kind).collect();
    assert!(under.is_empty(), "the {path} path no longer makes {under:?} as budgeted: {calls:?}");
}

const PER_KEY: &str = r#"{"name": "per-api-key", "limit": 1000000000, "period": "1s",
    "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "api_key"}}]}"#;

/// A request one local rule admits makes the host calls it cannot do
/// without — the key header, the clock, one shared-data read and one
/// compare-and-swap — and, when allowed responses carry rate-limit headers,
/// one call per header; a limited one, the read and the local reply. Counts
/// reach Envoy on the worker's tick, not per request.
#[test]
fn a_local_request_makes_only_the_host_calls_it_needs() {
    const DECISION: [(&str, u32); 3] =
        [("get_header_map_value", 1), ("get_current_time_nanoseconds", 1), ("get_shared_data", 1)];
    on_a_worker(|| {
        let mut worker = Worker::local(&format!(r#"{{"rules": [{PER_KEY}]}}"#));
        one_request(&mut worker, "warm-up");
        let (calls, _) = one_request(&mut worker, "alice");
        let budget = [&DECISION[..], &[("set_shared_data", 1), ("add_header_map_value", 2)]].concat();
        assert_host_calls(&calls, &budget, "allowed");
    });
    on_a_worker(|| {
        let quiet = format!(r#"{{"rules": [{PER_KEY}], "response": {{"headers_on_allowed": false}}}}"#);
        let mut worker = Worker::local(&quiet);
        one_request(&mut worker, "warm-up");
        let (calls, _) = one_request(&mut worker, "alice");
        assert_host_calls(&calls, &[&DECISION[..], &[("set_shared_data", 1)]].concat(), "allowed, no headers");
    });
    on_a_worker(|| {
        let limited = PER_KEY.replace("1000000000", "1");
        let mut worker = Worker::local(&format!(r#"{{"rules": [{limited}]}}"#));
        one_request(&mut worker, "alice");
        let (calls, _) = one_request(&mut worker, "alice");
        assert_host_calls(&calls, &[&DECISION[..], &[("send_local_response", 1)]].concat(), "limited");
        assert_eq!(worker.tick_ms(), 100, "the counts are flushed within 100 ms");
        assert_eq!(mock_host::with(|host| host.metric("floodgate.limited")), 0, "not per request");
        assert_eq!(worker.metric("floodgate.limited"), 1, "on the tick");
    });
}

/// With `worker_batch`, a request served from the worker's reserve makes no
/// shared-data call at all: the key header and the clock (and the response
/// headers); one in a batch goes to the shared bucket.
#[test]
fn a_request_served_from_a_worker_batch_makes_no_shared_data_call() {
    on_a_worker(|| {
        let batched = PER_KEY.replace(r#""period": "1s""#, r#""period": "1s", "worker_batch": 4"#);
        let mut worker = Worker::local(&format!(r#"{{"rules": [{batched}]}}"#));
        let (calls, _) = one_request(&mut worker, "alice");
        assert_eq!((calls.get("get_shared_data"), calls.get("set_shared_data")), (Some(&1), Some(&1)), "{calls:?}");
        let decision = [("get_header_map_value", 1), ("get_current_time_nanoseconds", 1), ("add_header_map_value", 2)];
        for _ in 0..3 {
            let (calls, allocations) = one_request(&mut worker, "alice");
            assert_host_calls(&calls, &decision, "batched");
            assert_eq!(allocations, 0);
        }
        let (calls, _) = one_request(&mut worker, "alice");
        assert_eq!(calls.get("set_shared_data"), Some(&1), "the batch is spent: the next is taken");
    });
}

/// Once a worker and its keys are warm, a request of one to three local
/// rules allocates nothing on the heap, allowed or limited: keys, permits,
/// verdicts and header values live in fixed or reused buffers. (The buffers
/// the host hands over, and the context the SDK boxes per request, are not
/// the filter's allocations.)
#[test]
fn a_warm_worker_allocates_nothing_per_request() {
    let three = format!(
        r#"{PER_KEY}, {{"name": "per-key-and-path", "limit": 1000000000, "period": "1s",
            "descriptors": [{{"request_headers": {{"header_name": "x-api-key", "descriptor_key": "k"}}}},
                            {{"request_headers": {{"header_name": ":path", "descriptor_key": "p"}}}}]}},
           {{"name": "whole-site", "limit": 1000000000, "period": "1s",
            "descriptors": [{{"generic_key": {{"descriptor_value": "all"}}}}]}}"#
    );
    let limited = PER_KEY.replace("1000000000", "1");
    let address_and_route = r#"{"name": "per-address", "match": {"route_name": "api"}, "limit": 1000000000,
        "period": "1s", "descriptors": [{"remote_address": {}}, {"destination_cluster": {}}]}"#;
    let cases = [
        ("one rule", PER_KEY.to_string()),
        ("three rules", three),
        ("limited", limited),
        ("address and route", address_and_route.to_string()),
    ];
    for (name, rules) in cases {
        on_a_worker(move || {
            let mut worker = Worker::local(&format!(r#"{{"rules": [{rules}]}}"#));
            mock_host::with(|host| {
                host.properties.insert("xds.route_name".into(), b"api".to_vec());
                host.properties.insert("xds.cluster_name".into(), b"backend".to_vec());
            });
            // Warm: the keys have their buckets. (A new key's group grows by
            // an entry, at most three times in the table's life; after that
            // new keys take idle entries in place.)
            for key in ["alice", "bob", "alice"] {
                one_request(&mut worker, key);
            }
            for key in ["alice", "alice", "bob"] {
                let (_, allocations) = one_request(&mut worker, key);
                assert_eq!(allocations, 0, "{name}: a warm request of {key} allocated");
            }
        });
    }
}

/// Envoy's attributes come from its properties (the whole metadata message,
/// the route's name and cluster), each read at most once per request, and
/// only once a rule needs it: a request on another route reads the route's
/// name and nothing else, however many rules ask.
#[test]
fn attributes_are_read_once_per_request_and_only_when_a_rule_asks() {
    use floodgate_core::metadata::build::{metadata, ProtoValue as Value};
    on_a_worker(|| {
        let user =
            r#"{"metadata": {"descriptor_key": "user", "metadata_key": {"key": "jwt", "path": [{"key": "sub"}]}}}"#;
        let mut worker = Worker::local(&format!(
            r#"{{"rules": [
                {{"name": "per-user", "match": {{"route_name": "api"}}, "limit": 2, "period": "1m",
                  "descriptors": [{user}, {{"destination_cluster": {{}}}}]}},
                {{"name": "per-user-hourly", "match": {{"route_name": "api"}}, "limit": 100, "period": "1h",
                  "descriptors": [{user}]}}]}}"#
        ));
        let reads = || mock_host::with(|host| std::mem::take(&mut host.property_reads));
        let set = |path: &str, value: &[u8]| {
            mock_host::with(|host| host.properties.insert(path.to_string(), value.to_vec()));
        };
        set("xds.route_name", b"other");
        let (context, action) = worker.request();
        assert_eq!(action, Action::Continue);
        assert_eq!(reads(), ["xds.route_name"]);
        worker.end(context);

        set("xds.route_name", b"api");
        set("xds.cluster_name", b"svc-a");
        set("metadata", &metadata(&[(b"jwt", vec![(b"sub".to_vec(), Value::String(b"alice".to_vec()))])]));
        let mut actions = Vec::new();
        for _ in 0..3 {
            let (context, action) = worker.request();
            actions.push(action);
            let mut read = reads();
            read.sort();
            assert_eq!(read, ["metadata", "xds.cluster_name", "xds.route_name"]);
            worker.end(context);
        }
        assert_eq!(actions, [Action::Continue, Action::Continue, Action::Pause], "alice's third is limited");
        // Another user has a bucket of her own.
        set("metadata", &metadata(&[(b"jwt", vec![(b"sub".to_vec(), Value::String(b"bob".to_vec()))])]));
        assert_eq!(worker.request().1, Action::Continue);
        assert_eq!(worker.metric("floodgate.rule.per-user.limited"), 1);
    });
}

/// A check-mode request's check is its own call: it leaves from its
/// handler and its answer comes back to it, so the request makes no hop
/// through the root (no shared queue, no switch back and forth), counts
/// reach Envoy on the tick, an unchanged tick is not set again, and the
/// clock is read once a callback. What is left: the clock twice, the call,
/// the answer's body (its status is read only when the body is no answer),
/// the switch into the request that the SDK makes to deliver it, the
/// resume, and the response's two headers.
#[test]
fn a_check_mode_request_makes_only_the_host_calls_it_needs() {
    on_a_worker(|| {
        let mut worker = Worker::ready(&global_config(r#""mode": "check","#));
        for round in 0..3 {
            mock_host::with(|host| host.host_calls.clear());
            let (context, action) = worker.request();
            assert_eq!(action, Action::Pause);
            let check = worker.take_call("/v1/check");
            worker.answer(&check, Some(200), CHECK_ALLOWED);
            assert_eq!(worker.resumed_in(), vec![(context, "on_http_call_response")]);
            worker.respond(context);
            worker.end(context);
            let calls = mock_host::with(|host| std::mem::take(&mut host.host_calls));
            if round > 0 {
                let budget = [
                    ("get_current_time_nanoseconds", 2),
                    ("http_call", 1),
                    ("get_buffer_bytes", 1),
                    ("set_effective_context", 1),
                    ("continue_stream", 1),
                    ("add_header_map_value", 2),
                ];
                assert_host_calls(&calls, &budget, "check mode");
            }
        }
        assert_eq!(worker.metric("floodgate.allowed"), 3, "counted on the tick");
    });
}

/// A check the host will not send (Envoy lost the cluster) is decided by
/// the rule's fall-back in the request's own handler: the request goes on
/// as the handler returns, with no resume.
#[test]
fn a_check_the_host_will_not_send_is_decided_in_its_handler() {
    on_a_worker(|| {
        let mut worker = Worker::ready(&global_config(r#""mode": "check","#));
        mock_host::with(|host| host.clusters.clear());
        let (context, action) = worker.request();
        assert_eq!(action, Action::Continue, "the fall-back's 2 a minute admits it");
        assert!(worker.new_calls().is_empty());
        assert!(worker.resumed().is_empty(), "let through by its handler's return");
        assert_eq!(worker.metric("floodgate.global.callouts_not_sent"), 1);
        worker.end(context);
    });
}

/// An unchanged tick is not set again while it runs; one the host has not
/// fired for two periods is set again (should Envoy have dropped it).
#[test]
fn an_unchanged_tick_is_set_again_only_when_it_stopped() {
    on_a_worker(|| {
        let mut worker = Worker::ready(&global_config(r#""mode": "check","#));
        let serve = |worker: &mut Worker| {
            mock_host::with(|host| host.host_calls.clear());
            let (context, _) = worker.request();
            let check = worker.take_call("/v1/check");
            worker.answer(&check, Some(200), CHECK_ALLOWED);
            worker.end(context);
            mock_host::with(|host| host.host_calls.get("set_tick_period_milliseconds").copied().unwrap_or(0))
        };
        serve(&mut worker);
        assert_eq!(worker.tick_ms(), 50);
        worker.advance(40);
        worker.tick();
        worker.advance(90);
        assert_eq!(serve(&mut worker), 0, "it fired 90 ms ago: it runs");
        worker.advance(20);
        assert_eq!(serve(&mut worker), 1, "not seen for 110 ms: set again");
        assert_eq!(serve(&mut worker), 0);
        assert_eq!(worker.tick_ms(), 50);
    });
}
