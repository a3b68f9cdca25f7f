//! End-to-end: a real Envoy 1.40 with two workers loads the filter.
//! Counts are asserted, never log text or timings.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::fs;

use floodgate_e2e::bootstrap::{Bootstrap, Listener};
use floodgate_e2e::envoy::write_bootstrap;
use floodgate_e2e::{
    assert_both_workers_served, free_port, hammer, repo_root, validate, Build, Conn, Envoy, EnvoyOptions, Setup, Update,
};
use serde_json::json;

const PER_KEY_TOKEN: &str = r#"{"rules": [{"name": "per-key", "match": {"path_prefix": "/api"},
    "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "api_key"}}],
    "algorithm": "token_bucket", "limit": 20, "period": "1h"}], "max_keys": 1024}"#;

#[test]
fn token_bucket_is_exact_per_key_across_both_workers() {
    let envoy = Envoy::start(&Setup::new(PER_KEY_TOKEN));
    // 24 clients x 40 requests over 10 keys: 96 requests per key, 20 may pass.
    let ok = hammer(&envoy, 24, 40, |client, i| format!("key-{}", (client + i) % 10));
    assert_eq!(ok.len(), 10, "{ok:?}");
    for (key, n) in &ok {
        assert_eq!(*n, 20, "key {key} got {n} through");
    }
    assert_both_workers_served(&envoy);
    assert_eq!(envoy.filter_stat("rule.per-key.allowed"), 200);
    assert_eq!(envoy.filter_stat("rule.per-key.limited"), 24 * 40 - 200);
    assert_eq!(envoy.filter_stat("retries_exhausted"), 0);
}

#[test]
fn leaky_bucket_is_exact_across_both_workers() {
    let config = PER_KEY_TOKEN.replace(
        r#""algorithm": "token_bucket", "limit": 20"#,
        r#""algorithm": "leaky_bucket", "limit": 15, "burst": 15"#,
    );
    let envoy = Envoy::start(&Setup::new(&config));
    let ok = hammer(&envoy, 24, 30, |client, i| format!("key-{}", (client * 7 + i) % 6));
    assert_eq!(ok.len(), 6, "{ok:?}");
    for (key, n) in &ok {
        assert_eq!(*n, 15, "key {key} got {n} through");
    }
    assert_both_workers_served(&envoy);
}

/// With `worker_batch`, each worker takes up to 8 units of a key at once
/// and spends them from its own memory. Over both workers a key never gets
/// more than its limit, and at most what the other worker holds (7) less;
/// once the reserves end (1 s), what they held comes back and the whole
/// limit is used, never more.
#[test]
fn worker_batches_never_pass_the_limit_and_give_back_what_they_hold() {
    let config = PER_KEY_TOKEN.replace(r#""limit": 20"#, r#""limit": 100, "worker_batch": 8"#);
    let envoy = Envoy::start(&Setup::new(&config));
    let ok = hammer(&envoy, 24, 20, |client, i| format!("key-{}", (client + i) % 3));
    assert_both_workers_served(&envoy);
    assert_eq!(ok.len(), 3, "{ok:?}");
    for (key, n) in &ok {
        assert!(*n <= 100, "key {key} got {n} through, over its limit of 100");
        assert!(*n >= 100 - 7, "key {key} got {n}: more than the other worker's batch left unused");
    }
    let pause = std::time::Duration::from_millis(1500);
    std::thread::sleep(pause);
    let more = hammer(&envoy, 24, 10, |client, i| format!("key-{}", (client + i) % 3));
    // That second load may itself leave units in a worker's batch (its
    // last request of a key took them, the key's next went to the other
    // worker): once they end too, one connection (one worker, which spends
    // what it takes) uses what is left.
    std::thread::sleep(pause);
    let last = hammer(&envoy, 1, 30, |_, i| format!("key-{}", i % 3));
    for (key, n) in &ok {
        let total = n + more.get(key).copied().unwrap_or(0) + last.get(key).copied().unwrap_or(0);
        assert_eq!(total, 100, "key {key}: {n}, then {total} once the reserves ended");
    }
    assert_eq!(envoy.filter_stat("rule.per-key.allowed"), 300);
}

#[test]
fn remote_address_descriptor_limits_the_client_address() {
    let config = r#"{"rules": [{"name": "per-ip", "descriptors": [{"remote_address": {}}],
        "limit": 12, "period": "1h"}]}"#;
    let envoy = Envoy::start(&Setup::new(config));
    // Every client is 127.0.0.1 (from different ports): one bucket.
    let ok = hammer(&envoy, 8, 10, |client, _| format!("client-{client}"));
    assert_eq!(ok.values().sum::<usize>(), 12, "{ok:?}");
}

/// `remote_address` is the address Envoy settled on: with
/// `use_remote_address: true` the TCP peer, whatever `x-forwarded-for` says;
/// with `false` (and no trusted hops) the last `x-forwarded-for` entry.
#[test]
fn remote_address_follows_envoys_trust_in_x_forwarded_for() {
    let config =
        r#"{"rules": [{"name": "per-ip", "descriptors": [{"remote_address": {}}], "limit": 2, "period": "1h"}]}"#;
    let pass =
        |envoy: &Envoy, xff: &str| envoy.connect().get("/", &[("x-forwarded-for", xff.as_bytes())]).status == 200;

    // The peer is the client: a forged header does not give a new bucket.
    let envoy = Envoy::start(&Setup::new(config));
    assert!(pass(&envoy, "10.0.0.1") && pass(&envoy, "10.0.0.1"));
    assert!(!pass(&envoy, "10.0.0.1"));
    assert!(!pass(&envoy, "10.0.0.2"), "x-forwarded-for must not be trusted with use_remote_address: true");
    drop(envoy);

    // Envoy told to take the client from x-forwarded-for: one bucket per address.
    let mut setup = Setup::new(config);
    setup.use_remote_address = false;
    let envoy = Envoy::start(&setup);
    assert!(pass(&envoy, "10.0.0.1") && pass(&envoy, "10.0.0.1"));
    assert!(!pass(&envoy, "10.0.0.1"));
    assert!(pass(&envoy, "10.0.0.2"), "a different client address has its own bucket");
    assert!(pass(&envoy, "192.168.9.9, 10.0.0.3"), "the last entry is the client");
    assert!(!pass(&envoy, "10.0.0.3, 10.0.0.1"), "the last entry, 10.0.0.1, is spent");
}

#[test]
fn a_later_rule_denial_does_not_consume_earlier_rules() {
    let config = r#"{"rules": [
        {"name": "site", "descriptors": [{"generic_key": {"descriptor_value": "all"}}], "limit": 50, "period": "1h"},
        {"name": "per-key", "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "k"}}],
         "limit": 20, "period": "1h"}]}"#;
    let envoy = Envoy::start(&Setup::new(config));
    let mut conn = envoy.connect();
    let mut pass =
        |key: &str, n: usize| (0..n).filter(|_| conn.get("/", &[("x-api-key", key.as_bytes())]).status == 200).count();
    // 20 of "a" pass; its 80 denials must leave the site's other 30 untouched.
    assert_eq!(pass("a", 100), 20);
    assert_eq!(pass("b", 100), 20);
    assert_eq!(pass("c", 100), 10);
    assert_eq!(envoy.filter_stat("rule.site.allowed"), 50);
    assert_eq!(envoy.filter_stat("rule.per-key.limited"), 160);
}

#[test]
fn a_repeated_header_keys_by_its_first_value_and_pseudo_headers_are_read() {
    let config = r#"{"rules": [{"name": "per-key-and-method", "descriptors": [
        {"request_headers": {"header_name": "x-api-key", "descriptor_key": "k"}},
        {"request_headers": {"header_name": ":method", "descriptor_key": "m"}}], "limit": 2, "period": "1h"}]}"#;
    let envoy = Envoy::start(&Setup::new(config));
    let mut conn = envoy.connect();
    let twice: &[(&str, &[u8])] = &[("x-api-key", b"a"), ("x-api-key", b"b")];
    assert_eq!(conn.get("/", twice).status, 200);
    assert_eq!(conn.get("/", twice).status, 200);
    // Both went to ("a", GET): its bucket is spent, ("b", GET)'s and ("a", DELETE)'s are not.
    assert_eq!(conn.get("/", &[("x-api-key", b"a")]).status, 429);
    assert_eq!(conn.get("/", &[("x-api-key", b"b")]).status, 200);
    assert_eq!(conn.request("DELETE", "/", &[("x-api-key", b"a")]).status, 200);
    // Behind 40 other headers (more than the native build reads on its stack).
    let names: Vec<String> = (0..40).map(|i| format!("x-filler-{i}")).collect();
    let mut many: Vec<(&str, &[u8])> = names.iter().map(|n| (n.as_str(), &b"v"[..])).collect();
    many.push(("x-api-key", b"b"));
    assert_eq!(conn.get("/", &many).status, 200);
    assert_eq!(conn.get("/", &[("x-api-key", b"b")]).status, 429);
}

#[test]
fn limited_responses_carry_ietf_headers_and_retry_after() {
    let config = r#"{"rules": [{"name": "hourly", "limit": 3, "period": "1h",
        "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "k"}}]}]}"#;
    let envoy = Envoy::start(&Setup::new(config));
    let mut conn = envoy.connect();
    let key: &[(&str, &[u8])] = &[("x-api-key", b"alice")];
    let first = conn.get("/", key);
    assert_eq!(first.status, 200);
    assert_eq!(first.header("ratelimit-policy"), Some("\"hourly\";q=3;w=3600"));
    assert_eq!(first.header("ratelimit"), Some("\"hourly\";r=2;t=1200"));
    conn.get("/", key);
    assert_eq!(conn.get("/", key).header("ratelimit"), Some("\"hourly\";r=0;t=1200"));
    let limited = conn.get("/", key);
    assert_eq!(limited.status, 429);
    assert_eq!(limited.body, b"Too Many Requests\n");
    assert_eq!(limited.header("x-envoy-ratelimited"), Some("true"));
    // 3 per hour: a token every 1200 s; a few seconds may have passed.
    let retry: u64 = limited.header("retry-after").unwrap().parse().unwrap();
    assert!((1190..=1200).contains(&retry), "retry-after {retry}");
    assert_eq!(limited.header("ratelimit"), Some(format!("\"hourly\";r=0;t={retry}").as_str()));
    // Requests without the header are not limited by this rule and carry no numbers.
    let other = conn.get("/", &[]);
    assert_eq!(other.status, 200);
    assert_eq!(other.header("ratelimit"), None);
}

#[test]
fn status_body_and_header_style_are_configurable() {
    let config = r#"{"rules": [{"name": "tiny", "limit": 1, "period": "1m"}],
        "response": {"status": 503, "body": "slow down", "headers": "x-ratelimit", "headers_on_allowed": false}}"#;
    let envoy = Envoy::start(&Setup::new(config));
    let mut conn = envoy.connect();
    let allowed = conn.get("/", &[]);
    assert_eq!(allowed.status, 200);
    assert_eq!(allowed.header("x-ratelimit-limit"), None, "headers_on_allowed is false");
    let limited = conn.get("/", &[]);
    assert_eq!(limited.status, 503);
    assert_eq!(limited.body, b"slow down");
    assert_eq!(limited.header("x-ratelimit-limit"), Some("1"));
    assert_eq!(limited.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(limited.header("retry-after"), Some("60"));
    assert_eq!(limited.header("ratelimit"), None);
}

#[test]
fn shadow_mode_lets_everything_through_and_counts() {
    let config =
        PER_KEY_TOKEN.replace(r#""limit": 20, "period": "1h""#, r#""limit": 5, "period": "1h", "shadow_mode": true"#);
    let envoy = Envoy::start(&Setup::new(&config));
    let ok = hammer(&envoy, 4, 10, |_, _| "same".to_string());
    assert_eq!(ok["same"], 40);
    assert_eq!(envoy.filter_stat("rule.per-key.allowed"), 5);
    assert_eq!(envoy.filter_stat("rule.per-key.shadow_limited"), 35);
    assert_eq!(envoy.filter_stat("shadow_limited"), 35);
    assert_eq!(envoy.filter_stat("limited"), 0);
    // Logged, naming the rule, but not once per request: at most a line a
    // second per worker.
    let log = envoy.log_tail();
    let lines = log.lines().filter(|l| l.contains("shadow mode: rule per-key would have limited")).count();
    assert!(lines >= 1, "no shadow-mode log line:\n{log}");
    assert!(lines < 10, "{lines} log lines for 35 shadow-limited requests");
}

#[test]
fn every_shipped_envoy_config_validates() {
    let dir = repo_root().join("envoy");
    let mut checked = 0;
    for entry in fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let text = fs::read_to_string(&path).unwrap();
            // A crashed wasm VM is reloaded, never left failing closed. (The
            // native module has no VM to reload: it catches panics instead.)
            assert!(
                !text.contains("envoy.filters.http.wasm") || text.contains("failure_policy: FAIL_RELOAD"),
                "{}",
                path.display()
            );
            let output = validate(&path);
            assert!(
                output.status.success(),
                "{} failed validation:\n{}",
                path.display(),
                String::from_utf8_lossy(&output.stderr)
            );
            checked += 1;
        }
    }
    assert!(checked >= 1);
}

#[test]
fn invalid_plugin_configs_are_refused_and_name_the_field() {
    let fixtures = repo_root().join("core/tests/fixtures/invalid");
    let dir = std::env::temp_dir().join(format!("floodgate-invalid-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    for name in [
        "zero-limit",
        "status-below-400",
        "bad-period-unit",
        "unknown-rule-field",
        "duplicate-rule-names",
        "empty-rules",
        "metadata-lowercase-source",
        "query-parameters-empty-name",
        "route-name-empty",
    ] {
        let json = fs::read_to_string(fixtures.join(format!("{name}.json"))).unwrap();
        let expected = fs::read_to_string(fixtures.join(format!("{name}.error"))).unwrap();
        let config = dir.join(format!("{name}.json"));
        fs::write(&config, Setup::new(json.trim()).bootstrap(1, 2).to_string()).unwrap();
        let output = validate(&config);
        let log = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        assert!(!output.status.success(), "{name}: envoy accepted the config");
        assert!(log.contains(expected.trim()), "{name}: the error does not say {:?}:\n{log}", expected.trim());
    }
    // Not only validation: a real start is refused too.
    let json = fs::read_to_string(fixtures.join("zero-limit.json")).unwrap();
    let config = dir.join("start.json");
    fs::write(&config, Setup::new(json.trim()).bootstrap(0, 0).to_string()).unwrap();
    let output = std::process::Command::new(floodgate_e2e::envoy_bin())
        .args(["--concurrency", "2", "--disable-hot-restart", "--log-level", "error", "-c"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(!output.status.success(), "envoy started with an invalid plugin config");
    assert!(String::from_utf8_lossy(&output.stderr).contains("rules[0].limit: must be between 1 and 1000000000, got 0"));
}

/// Hostile requests reach the filter (Envoy's own header limits are raised so
/// they do) and must neither crash the VM nor stop any worker from answering.
#[test]
fn hostile_requests_never_break_a_worker() {
    let config = r#"{"rules": [
        {"name": "per-key", "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "k"}}],
         "limit": 1000, "period": "1h", "cost_from_header": {"header_name": "x-cost", "max": 10}},
        {"name": "beta", "match": {"path_prefix": "/", "methods": ["GET"], "authority": "localhost"},
         "descriptors": [{"header_value_match": {"descriptor_value": "b", "headers": [{"name": "x-tier", "string_match": {"prefix": "beta"}}]}},
                         {"masked_remote_address": {"v4_prefix_mask_len": 24}}],
         "limit": 1000, "period": "1h"}]}"#;
    let mut setup = Setup::new(config);
    setup.manager_fields.insert("max_request_headers_kb".into(), json!(1024));
    setup.manager_fields.insert("common_http_protocol_options".into(), json!({"max_headers_count": 6000}));
    let mut envoy = Envoy::start(&setup);
    let huge = vec![b'a'; 100 * 1024];
    let many: Vec<(String, Vec<u8>)> = (0..5000).map(|i| (format!("x-h-{i}"), format!("v{i}").into_bytes())).collect();
    let mut cases: Vec<Vec<(&str, &[u8])>> = vec![
        vec![("x-api-key", &huge)],
        vec![("x-api-key", b"\xff\xfe\xfd"), ("x-cost", b"\xc3\x28")],
        vec![("x-api-key", b""), ("x-tier", b"")],
        vec![("x-api-key", b"a"), ("x-api-key", b"b"), ("x-cost", b"99999999999999999999999")],
        vec![("x-tier", b"beta\x80\x81"), ("x-cost", b"-5")],
        vec![("x-tier", &huge), ("x-cost", &huge)],
    ];
    cases.push(many.iter().map(|(n, v)| (n.as_str(), v.as_slice())).chain([("x-api-key", &b"many"[..])]).collect());
    for (i, headers) in cases.iter().enumerate() {
        for _ in 0..3 {
            let response = envoy.connect().get("/anything?q=%01%ff", headers);
            assert!(matches!(response.status, 200 | 429), "case {i}: status {}", response.status);
        }
    }
    // Every worker still answers, and nothing panicked: no VM crashed (a
    // crash would reload it), and the native module caught no panic (each
    // hook logs one it catches, "panicked at …", at critical level).
    // Two connections open at once: the listener's exact balance gives the
    // second to the worker the first is not on (one at a time, each closed
    // before the next, they may all land on one worker).
    let mut both = [envoy.connect(), envoy.connect()];
    for _ in 0..8 {
        for conn in &mut both {
            assert_eq!(conn.get("/", &[("x-api-key", b"after")]).status, 200);
        }
    }
    assert!(envoy.is_running());
    assert_both_workers_served(&envoy);
    let stats = envoy.stats();
    if setup.build.runs_in_a_vm() {
        let reloads: u64 =
            stats.iter().filter(|(k, _)| k.starts_with("wasm.") && k.contains("vm_reload")).map(|(_, v)| v).sum();
        assert_eq!(reloads, 0, "a wasm VM was reloaded:\n{}", envoy.log_tail());
    }
    assert!(!envoy.log().contains("panicked"), "{}", envoy.log());
    // The filter decided on every hostile request it was meant to: cases 0-3
    // and 6 carry x-api-key (3 times each), plus the 16 checks afterwards;
    // only case 4's x-tier starts with "beta".
    assert_eq!(stats[&envoy.filter_stat_name("rule.per-key.allowed")], 5 * 3 + 16);
    assert_eq!(stats[&envoy.filter_stat_name("rule.beta.allowed")], 3);
}

/// Buckets outlive a listener update that keeps the filter's name (the
/// wasm build's `vm_id`, the native build's `filter_name`): a new
/// configuration with the same rule keeps its buckets, and an invalid one
/// is refused while the listener in force keeps limiting.
#[test]
fn buckets_survive_a_listener_update_and_a_bad_update_is_refused() {
    let config = |limit: u32, headers: &str| {
        format!(
            r#"{{"rules": [{{"name": "per-key", "limit": {limit}, "period": "1h",
                "descriptors": [{{"request_headers": {{"header_name": "x-api-key", "descriptor_key": "k"}}}}]}}],
                "response": {{"headers": "{headers}"}}}}"#
        )
    };
    let envoy = Envoy::start_dynamic(&Setup::new(&config(5, "ietf")));
    let get = |key: &str| envoy.connect().get("/", &[("x-api-key", key.as_bytes())]);
    for _ in 0..3 {
        assert_eq!(get("a").status, 200);
    }

    assert_eq!(envoy.update_listener(&Setup::new(&config(5, "x-ratelimit"))), Update::Accepted);
    // Wait until new connections consistently meet the new configuration
    // (throwaway keys, so the probes take nothing from "a").
    let mut in_a_row = 0;
    for probe in 0..2000 {
        let fresh = get(&format!("probe-{probe}")).header("x-ratelimit-limit").is_some();
        in_a_row = if fresh { in_a_row + 1 } else { 0 };
        if in_a_row == 16 {
            break;
        }
    }
    assert_eq!(in_a_row, 16, "the new configuration never took over");
    // "a" used 3 of 5 before the update: exactly 2 are left.
    assert_eq!(get("a").status, 200);
    assert_eq!(get("a").status, 200);
    let limited = get("a");
    assert_eq!(limited.status, 429, "the bucket was carried over");
    assert_eq!(limited.header("x-ratelimit-remaining"), Some("0"));

    // limit 0 is invalid: refused, and the listener in force keeps limiting.
    assert_eq!(envoy.update_listener(&Setup::new(&config(0, "ietf"))), Update::Rejected);
    assert_eq!(get("a").status, 429);
    let passed = (0..8).filter(|_| get("b").status == 200).count();
    assert_eq!(passed, 5);
}

/// Filters under one name share their buckets, and filters under another
/// have their own (the wasm build's `vm_id`, the native build's
/// `filter_name`): two listeners of one Envoy under one name share a limit
/// of 3, a third under another name has its own 3.
#[test]
fn buckets_are_shared_under_one_name_and_only_under_it() {
    let rule = r#"{"rules": [{"name": "site", "limit": 3, "period": "1h",
        "descriptors": [{"generic_key": {"descriptor_value": "all"}}]}]}"#;
    let build = Build::from_env();
    let (second, third) = (free_port(), free_port());
    let listener = {
        let build = build.clone();
        move |name: &str, port: u16, filter_name: &str| {
            let mut listener = Listener::new(name, port, name);
            listener.http_filters = vec![build.http_filter_named(filter_name, rule)];
            listener
        }
    };
    let envoy = Envoy::start_with(EnvoyOptions::e2e(), move |options, port, admin_port| {
        let listeners =
            vec![listener("a", port, "shared"), listener("b", second, "shared"), listener("c", third, "other")];
        write_bootstrap(options, &Bootstrap { listeners, admin_port, ..Bootstrap::default() }.to_json())
    })
    .loading(&build);
    let status = |port: u16| Conn::open(port).unwrap().get("/", &[]).status;
    let on_a: Vec<u16> = (0..2).map(|_| status(envoy.port)).collect();
    let on_b: Vec<u16> = (0..2).map(|_| status(second)).collect();
    let on_c: Vec<u16> = (0..4).map(|_| status(third)).collect();
    assert_eq!((on_a, on_b, on_c), (vec![200, 200], vec![200, 429], vec![200, 200, 200, 429]));
}
