//! Pausing and resuming, against a fake host ([`crate::fake_host`]): the
//! plugin's real path — the limiter's verdict, [`crate::outcome::next`],
//! the plugin acting on it — with every switch, resume and local reply
//! recorded and time on a fake clock. Plain native tests: no SDK, no ABI.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use floodgate_core::config::Config;
use floodgate_core::limiter::Limiter;
use floodgate_core::time::Nanos;

use crate::fake_host::{FakeHost, Reply};
use crate::host::{Host, SharedData};
use crate::metrics::{Metrics, RuleMetrics};
use crate::outcome::{Outcome, Site};
use crate::plugin::{Plugin, RequestRef};
use crate::waiting::{Shared, Stage, Wait};

const T0: Nanos = Nanos::from_secs(1_700_000_000);
const ROOT: u32 = 1;

/// A plugin for `config` over a fake host at [`T0`].
fn plugin(config: &str) -> Plugin<FakeHost> {
    let host = FakeHost::new(T0);
    let config = Config::parse(config.as_bytes()).unwrap();
    let limiter =
        Limiter::prepare(config, &SharedData(&host), [7; 16], |rule| RuleMetrics::define(&host, rule)).unwrap();
    let metrics = Metrics::define(&host);
    Plugin::new(host, limiter, metrics, None)
}

/// Request `context_id` arrives and its handler decides it; its state and
/// what became of it.
fn arrive(plugin: &Plugin<FakeHost>, context_id: u32) -> (Shared, Outcome) {
    plugin.host.arrive(context_id);
    let state = Shared::default();
    let now = plugin.host.now();
    let outcome = plugin.decide(Site::Handler, RequestRef { context_id, state: &state, since: now }, now, false);
    (state, outcome)
}

/// The root sends what requests queued for the quota service; the tokens
/// of the calls, by path.
fn send(plugin: &Plugin<FakeHost>) -> Vec<(String, u32)> {
    plugin.host.effective.set(ROOT);
    let before = plugin.host.calls.borrow().len();
    plugin.send_queued();
    plugin.host.calls.borrow()[before..].iter().map(|call| (call.path.clone(), call.token)).collect()
}

/// The answer to call `token` reaches the root, which acts on it as
/// `on_http_call_response` does: a lease's answer looks at the requests
/// that wait for a refill.
fn answer(plugin: &Plugin<FakeHost>, token: u32, body: &str) {
    plugin.host.effective.set(ROOT);
    let callout = plugin.callouts.borrow_mut().answered(token).unwrap();
    let refilled = matches!(callout, crate::quota::Callout::Leases(_));
    plugin.answered(callout, || Some(200), Ok(body.as_bytes().to_vec()));
    if refilled {
        plugin.finish_due(plugin.host.now(), true);
    }
}

/// The worker's tick looks at the paused requests.
fn tick(plugin: &Plugin<FakeHost>) {
    plugin.host.effective.set(ROOT);
    plugin.finish_due(plugin.host.now(), false);
}

const ALLOWED: &str = r#"{"allowed": true, "results": [{"code": "ok", "limit": 5, "window_ms": 60000, "remaining": 4, "reset_ms": 1000}]}"#;
const DENIED: &str = r#"{"allowed": false, "retry_after_ms": 4500, "results": [{"code": "over_limit", "limit": 5,
    "window_ms": 60000, "remaining": 0, "reset_ms": 4500, "retry_after_ms": 4500}]}"#;

/// A global rule asking cluster `quota` (`extra` adds fields to it), after
/// the local rules `local`.
fn global(local: &str, extra: &str) -> String {
    format!(
        r#"{{"global": {{"cluster": "quota", "domain": "edge", "timeout": "300ms", "max_wait": "200ms"}},
            "rules": [{local} {{"name": "fleet", "scope": "global", {extra}
                        "descriptors": [{{"generic_key": {{"descriptor_key": "path", "descriptor_value": "/login"}}}}],
                        "fallback": {{"limit": 2, "period": "1m"}}}}]}}"#
    )
}

/// One a minute, for every request.
const ONE_A_MINUTE: &str = r#"{"name": "local", "algorithm": "fixed_window", "limit": 1, "period": "1m"},"#;

/// A denied request is answered with a local reply in its own context,
/// carrying its headers, and is never resumed or paused.
#[test]
fn a_denied_request_gets_a_local_reply_and_no_resume() {
    let plugin = plugin(&format!(r#"{{"rules": [{}]}}"#, ONE_A_MINUTE.trim_end_matches(',')));
    let (_, first) = arrive(&plugin, 2);
    assert_eq!(first, Outcome::Continue);
    let (state, second) = arrive(&plugin, 3);
    assert_eq!(second, Outcome::Reply);
    let replies = plugin.host.take_replies();
    assert_eq!(replies.len(), 1);
    let Reply { context_id, status, headers } = &replies[0];
    assert_eq!((*context_id, *status), (3, 429));
    assert!(headers.iter().any(|(n, _)| n == "retry-after"), "{headers:?}");
    assert_eq!(state.borrow().stage, Stage::Limited);
    tick(&plugin);
    assert!(plugin.host.take_resumed().is_empty());
    assert!(plugin.host.switched.borrow().is_empty(), "nothing to switch to");
}

/// A shaper's delayed request pauses with its delay and is resumed by the
/// tick, switched to first, once its time has come — not before; one whose
/// client has gone is not resumed, and counted abandoned.
#[test]
fn a_delayed_request_pauses_and_is_resumed_from_the_tick_when_due() {
    let plugin = plugin(
        r#"{"rules": [{"name": "paced", "algorithm": "shaper", "limit": 10, "period": "10s", "max_delay": "5s"}]}"#,
    );
    assert_eq!(arrive(&plugin, 2).1, Outcome::Continue);
    let (state, outcome) = arrive(&plugin, 3);
    assert_eq!(outcome, Outcome::Pause(Wait::Delay { resume_at: T0 + Nanos::from_secs(1) }));
    assert_eq!(state.borrow().stage, Stage::Waiting);
    plugin.host.advance_ms(999);
    tick(&plugin);
    assert!(plugin.host.take_resumed().is_empty(), "not before its time");
    plugin.host.advance_ms(1);
    tick(&plugin);
    assert_eq!(*plugin.host.switched.borrow(), [3]);
    assert_eq!(plugin.host.take_resumed(), [3]);
    assert_eq!(state.borrow().stage, Stage::Passed);
    assert!(plugin.host.take_replies().is_empty());

    let (_, outcome) = arrive(&plugin, 4);
    let Outcome::Pause(Wait::Delay { resume_at }) = outcome else { panic!("{outcome:?}") };
    plugin.host.leave(4);
    plugin.host.clock.set(resume_at);
    tick(&plugin);
    assert!(plugin.host.take_resumed().is_empty(), "its client has gone");
    plugin.settle_root(plugin.host.now());
    assert_eq!(plugin.host.metric("floodgate.delayed"), 1);
    assert_eq!(plugin.host.metric("floodgate.delay_abandoned"), 1);
}

/// A request that finds its lease pool empty waits for the refill: the
/// lease's answer resumes it; another that waits out its `max_wait` with
/// no tokens is denied with a local reply, and not resumed.
#[test]
fn a_refill_wait_resumes_with_tokens_and_is_denied_when_it_waits_out() {
    let grant = r#"{"leases": [{"code": "ok", "granted": 1, "valid_ms": 1000, "limit": 100,
        "window_ms": 60000, "remaining": 50, "reset_ms": 30000, "window": 0}]}"#;
    let plugin = plugin(&global("", ""));
    let (state, outcome) = arrive(&plugin, 2);
    assert_eq!(outcome, Outcome::Pause(Wait::Refill { deadline: T0 + Nanos::from_millis(200) }));
    let calls = send(&plugin);
    assert_eq!(calls.len(), 1);
    assert_eq!((calls[0].0.as_str(), plugin.host.calls.borrow()[0].context), ("/v1/lease", ROOT));
    plugin.host.advance_ms(5);
    answer(&plugin, calls[0].1, grant);
    assert_eq!(plugin.host.take_resumed(), [2], "the lease's answer resumes it");
    assert_eq!(state.borrow().stage, Stage::Passed);

    // The one token is spent: the next waits, and its lease never comes.
    let (state, outcome) = arrive(&plugin, 3);
    assert!(matches!(outcome, Outcome::Pause(Wait::Refill { .. })), "{outcome:?}");
    send(&plugin);
    plugin.host.advance_ms(100);
    tick(&plugin);
    assert_eq!(state.borrow().stage, Stage::Waiting, "still within its wait");
    assert!(plugin.host.take_replies().is_empty());
    plugin.host.advance_ms(100);
    tick(&plugin);
    let replies = plugin.host.take_replies();
    assert_eq!((replies.len(), replies[0].context_id, replies[0].status), (1, 3, 429));
    assert!(plugin.host.take_resumed().is_empty());
    assert_eq!(state.borrow().stage, Stage::Limited);
    plugin.settle_root(plugin.host.now());
    assert_eq!(plugin.host.metric("floodgate.global.refill_waits"), 2);
}

/// A request whose client leaves while its check is out gives back what
/// its local rule took (undone: the next request is admitted by it), and
/// the answer resumes nothing: a stream that ended first forgot its call
/// (Envoy cancels the calls of a context that goes away), and an answer
/// that finds its client gone when switching to it finishes nothing.
#[test]
fn a_client_gone_before_its_answer_gives_its_permit_back_and_is_not_resumed() {
    for stream_ended in [true, false] {
        let plugin = plugin(&global(ONE_A_MINUTE, r#""mode": "check","#));
        let (state, outcome) = arrive(&plugin, 2);
        assert_eq!(outcome, Outcome::Pause(Wait::Answer));
        let calls = send(&plugin);
        assert_eq!(calls[0].0, "/v1/check");
        plugin.host.leave(2);
        if stream_ended {
            plugin.ended(2, &state);
            assert!(plugin.callouts.borrow_mut().answered(calls[0].1).is_none(), "its call is forgotten with it");
        } else {
            answer(&plugin, calls[0].1, ALLOWED);
        }
        assert!(plugin.host.take_resumed().is_empty(), "stream ended first: {stream_ended}");
        assert!(plugin.host.take_replies().is_empty());
        let (_, outcome) = arrive(&plugin, 3);
        assert_eq!(outcome, Outcome::Pause(Wait::Answer), "the local rule's unit came back: {stream_ended}");
    }
}

/// Check answers finish the request they belong to, in whatever order they
/// come: a yes resumes its request, switched to; a no answers its own
/// request 429, with the service's `Retry-After`.
#[test]
fn a_check_answer_resumes_the_right_context() {
    let plugin = plugin(&global("", r#""mode": "check","#));
    let (first, _) = arrive(&plugin, 2);
    let (second, _) = arrive(&plugin, 3);
    // One call per request, in the order they were queued.
    let calls = send(&plugin);
    assert_eq!(calls.len(), 2, "{calls:?}");
    let (to_first, to_second) = (calls[0].1, calls[1].1);
    answer(&plugin, to_second, ALLOWED);
    assert_eq!(plugin.host.take_resumed(), [3]);
    assert_eq!(plugin.host.switched.borrow().last(), Some(&3));
    assert_eq!(second.borrow().stage, Stage::Passed);
    answer(&plugin, to_first, DENIED);
    assert!(plugin.host.take_resumed().is_empty());
    let replies = plugin.host.take_replies();
    assert_eq!((replies.len(), replies[0].context_id, replies[0].status), (1, 2, 429));
    assert!(replies[0].headers.contains(&("retry-after".to_string(), "5".to_string())), "{:?}", replies[0].headers);
    assert_eq!(first.borrow().stage, Stage::Limited);
}

/// A shaper's delay and a check on one request: the check's answer does
/// not skip the delay. The request waits until the time the shaper gave it
/// on arrival, then goes on.
#[test]
fn a_check_answer_keeps_a_shapers_delay() {
    let shaper = r#"{"name": "paced", "algorithm": "shaper", "limit": 10, "period": "10s", "max_delay": "5s"},"#;
    let plugin = plugin(&global(shaper, r#""mode": "check","#));
    let (first, _) = arrive(&plugin, 2);
    let (second, _) = arrive(&plugin, 3);
    let calls = send(&plugin);
    assert_eq!(calls.len(), 2, "{calls:?}");
    answer(&plugin, calls[0].1, ALLOWED);
    assert_eq!(plugin.host.take_resumed(), [2], "no delay: on at once");
    assert_eq!(first.borrow().stage, Stage::Passed);
    plugin.host.advance_ms(10);
    answer(&plugin, calls[1].1, ALLOWED);
    assert!(plugin.host.take_resumed().is_empty(), "its shaper gave it a second");
    assert_eq!(second.borrow().stage, Stage::Waiting);
    plugin.host.advance_ms(989);
    tick(&plugin);
    assert!(plugin.host.take_resumed().is_empty(), "not before its time");
    plugin.host.advance_ms(1);
    tick(&plugin);
    assert_eq!(plugin.host.take_resumed(), [3]);
    assert_eq!(second.borrow().stage, Stage::Passed);
}
