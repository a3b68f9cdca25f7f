//! Limits files: every invalid fixture is refused with its message (line,
//! field and what is wrong), and hot reload applies new limits while keeping
//! counters, and keeps the old limits when the new file is bad.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Backend, Fixture};
use floodgate_quota::config::Domains;
use floodgate_quota::reload::spawn_reloader;
use serde_json::json;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/invalid")
}

#[test]
fn every_invalid_fixture_is_refused_with_its_message() {
    let mut seen = 0;
    for entry in std::fs::read_dir(fixtures()).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let expected: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("# expect: ")).collect();
        assert!(!expected.is_empty(), "{} has no `# expect:` line", path.display());
        let error =
            Domains::load(std::slice::from_ref(&path)).expect_err(&format!("{} must be refused", path.display()));
        let message = error.to_string();
        assert!(message.starts_with(&path.display().to_string()), "the message names the file: {message}");
        for want in expected {
            assert!(message.contains(want), "{}:\n  message: {message}\n  lacks:   {want}", path.display());
        }
        seen += 1;
    }
    assert!(seen >= 15, "only {seen} fixtures found");
}

#[test]
fn the_sample_config_loads() {
    let sample = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/quota.yaml");
    let config = Domains::load(&[sample]).unwrap();
    assert!(config.domain("edge").is_some());
}

#[test]
fn a_domain_defined_twice_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.yaml");
    let b = dir.path().join("b.yaml");
    std::fs::write(&a, "domain: edge\ndescriptors: []\n").unwrap();
    std::fs::write(&b, "domain: edge\ndescriptors: []\n").unwrap();
    let message = Domains::load(&[a, b.clone()]).unwrap_err().to_string();
    assert!(message.contains("domain \"edge\" is defined in more than one file"), "{message}");
    assert!(message.starts_with(&b.display().to_string()), "{message}");
}

#[test]
fn the_binary_refuses_to_start_on_a_bad_file() {
    let output = Command::new(env!("CARGO_BIN_EXE_floodgate-quota"))
        .args(["--config"])
        .arg(fixtures().join("unknown_unit.yaml"))
        .args(["--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("unknown unit \"fortnight\""), "{stderr}");
}

const V1: &str = "domain: test\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 5}\n";
const V2: &str = "domain: test\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 10}\n";
const BAD: &str = "domain: test\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: ten}\n";

/// Polls `/v1/check` until `limit` is in force (bounded: a wait, not a timed assertion).
async fn wait_for_limit(f: &Fixture, limit: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = f.check(json!({"domain": "test", "descriptors": [[["k", "v"]]], "hits": 0})).await;
        if r["results"][0]["limit"] == limit {
            return;
        }
        assert!(Instant::now() < deadline, "limit {limit} never applied: {r}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn hot_reload_keeps_state_and_applies_new_limits(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.yaml");
    std::fs::write(&path, V1).unwrap();
    let f = Fixture::new(backend, V1).await;
    let reloader = spawn_reloader(f.service.clone(), vec![path.clone()], Duration::from_millis(50));

    let r = f.check(json!({"domain": "test", "descriptors": [[["k", "v"]]], "hits": 3})).await;
    assert_eq!(r["results"][0]["remaining"], 2);

    std::fs::write(&path, V2).unwrap();
    wait_for_limit(&f, 10).await;
    let r = f.check(json!({"domain": "test", "descriptors": [[["k", "v"]]], "hits": 1})).await;
    assert_eq!(r["results"][0]["remaining"], 6, "the 3 used before the reload still count: {r}");

    std::fs::write(&path, BAD).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f.metrics().await.contains(r#"floodgate_quota_config_reloads_total{result="error"} 1"#) {
        assert!(Instant::now() < deadline, "the bad file was never noticed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = f.check(json!({"domain": "test", "descriptors": [[["k", "v"]]], "hits": 1})).await;
    assert_eq!(r["results"][0]["limit"], 10, "the previous limits keep serving");
    assert_eq!(r["results"][0]["remaining"], 5);
    reloader.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_hot_reload_keeps_state_and_applies_new_limits() {
    hot_reload_keeps_state_and_applies_new_limits(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_hot_reload_keeps_state_and_applies_new_limits() {
    hot_reload_keeps_state_and_applies_new_limits(Backend::Redis).await;
}

/// Writes `yaml` and waits until it is the `count`th reload applied.
async fn reload_to(f: &Fixture, path: &Path, yaml: &str, count: u32) {
    std::fs::write(path, yaml).unwrap();
    let applied = format!("floodgate_quota_config_reloads_total{{result=\"ok\"}} {count}\n");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f.metrics().await.contains(&applied) {
        assert!(Instant::now() < deadline, "reload {count} never applied");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn rule(unit: &str, algorithm: &str) -> String {
    format!(
        "domain: test\ndescriptors:\n  - key: k\n    rate_limit: {{unit: {unit}, requests_per_unit: 5, algorithm: {algorithm}}}\n"
    )
}

/// Remaining after taking `hits`.
async fn take(f: &Fixture, hits: u64) -> serde_json::Value {
    let r = f.check(json!({"domain": "test", "descriptors": [[["k", "v"]]], "hits": hits})).await;
    r["results"][0]["remaining"].clone()
}

/// What the README's hot-reload paragraph says: changing a fixed window's
/// `unit` forgets its count; a token bucket keeps its tokens across a `unit`
/// change; each algorithm has buckets of its own, so changing `algorithm`
/// starts afresh, and changing it back finds the old bucket if still live.
async fn a_reload_changing_unit_or_algorithm(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.yaml");
    std::fs::write(&path, rule("hour", "fixed_window")).unwrap();
    let f = Fixture::new(backend, &rule("hour", "fixed_window")).await;
    let reloader = spawn_reloader(f.service.clone(), vec![path.clone()], Duration::from_millis(50));

    assert_eq!(take(&f, 3).await, 2);
    reload_to(&f, &path, &rule("day", "fixed_window"), 1).await;
    assert_eq!(take(&f, 1).await, 4, "a fixed window's unit changed: the 3 used are forgotten");

    assert_eq!(take(&f, 2).await, 2);
    reload_to(&f, &path, &rule("hour", "token_bucket"), 2).await;
    assert_eq!(take(&f, 1).await, 4, "the algorithm changed: a fresh, full bucket");

    assert_eq!(take(&f, 2).await, 2);
    reload_to(&f, &path, &rule("day", "token_bucket"), 3).await;
    assert_eq!(take(&f, 1).await, 1, "a token bucket's unit changed: its tokens are kept");

    reload_to(&f, &path, &rule("day", "fixed_window"), 4).await;
    assert_eq!(take(&f, 0).await, 2, "back to the fixed window: its bucket of this day, 3 used, is still there");

    reload_to(&f, &path, &rule("day", "sliding_window"), 5).await;
    assert_eq!(take(&f, 1).await, 4, "a sliding window has buckets of its own: fresh");
    reload_to(&f, &path, &rule("day", "leaky_bucket"), 6).await;
    assert_eq!(take(&f, 0).await, 1, "a leaky bucket too (its burst is 1)");
    reloader.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_reload_changing_unit_or_algorithm_behaves_as_documented() {
    a_reload_changing_unit_or_algorithm(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_reload_changing_unit_or_algorithm_behaves_as_documented() {
    a_reload_changing_unit_or_algorithm(Backend::Redis).await;
}

const TWO_KEYS: &str = "domain: test\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 5}\n  - key: path\n    value: /login\n    rate_limit: {unit: hour, requests_per_unit: 3}\n";
/// `TWO_KEYS` cut after its first descriptor: a prefix that parses.
const FIRST_KEY: &str = "domain: test\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 5}\n";

/// How `/login` is answered now.
async fn login_code(f: &Fixture) -> String {
    let r = f.check(json!({"domain": "test", "descriptors": [[["path", "/login"]]], "hits": 0})).await;
    r["results"][0]["code"].as_str().unwrap().to_string()
}

/// Waits until `metric` shows (bounded: a wait, not a timed assertion).
async fn wait_for_metric(f: &Fixture, metric: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f.metrics().await.contains(metric) {
        assert!(Instant::now() < deadline, "{metric} never showed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A limits file cut short (written in two steps and read between them: a
/// prefix that still parses) never leaves a limited key unlimited: the reload
/// is refused (counted as `refused`, logged naming the descriptors) and the
/// previous limits keep serving (before, the prefix was loaded and `/login`
/// became `no_rule`: 175 leases and 128 checks passed in 400 ms). The operator
/// says so by marking the key `unlimited: true` (applied), or with `SIGHUP`
/// (`apply_as_is`), which applies the files as they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_drops_limits_is_refused_unless_the_operator_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.yaml");
    std::fs::write(&path, TWO_KEYS).unwrap();
    let f = Fixture::new(Backend::Memory, TWO_KEYS).await;
    let reloader = spawn_reloader(f.service.clone(), vec![path.clone()], Duration::from_millis(50));
    std::fs::write(&path, FIRST_KEY).unwrap();
    let deadline = Instant::now() + Duration::from_millis(500);
    while Instant::now() < deadline {
        assert_eq!(login_code(&f).await, "ok", "/login stays limited while the file is cut short");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    wait_for_metric(&f, "floodgate_quota_config_reloads_total{result=\"refused\"} 1\n").await;
    assert_eq!(login_code(&f).await, "ok");
    // The rest written: nothing is dropped, it applies.
    std::fs::write(&path, TWO_KEYS.replace("requests_per_unit: 3", "requests_per_unit: 4")).unwrap();
    wait_for_metric(&f, "floodgate_quota_config_reloads_total{result=\"ok\"} 1\n").await;
    // Said in the file: unlimited.
    std::fs::write(
        &path,
        TWO_KEYS.replace("rate_limit: {unit: hour, requests_per_unit: 3}", "rate_limit: {unlimited: true}"),
    )
    .unwrap();
    wait_for_metric(&f, "floodgate_quota_config_reloads_total{result=\"ok\"} 2\n").await;
    assert_eq!(login_code(&f).await, "unlimited");
    // Limited again, then dropped by SIGHUP's word.
    std::fs::write(&path, TWO_KEYS).unwrap();
    wait_for_metric(&f, "floodgate_quota_config_reloads_total{result=\"ok\"} 3\n").await;
    std::fs::write(&path, FIRST_KEY).unwrap();
    wait_for_metric(&f, "floodgate_quota_config_reloads_total{result=\"refused\"} 2\n").await;
    assert_eq!(login_code(&f).await, "ok");
    reloader.apply_as_is();
    wait_for_metric(&f, "floodgate_quota_config_reloads_total{result=\"ok\"} 4\n").await;
    assert_eq!(login_code(&f).await, "no_rule", "applied as it is");
    reloader.abort();
}
