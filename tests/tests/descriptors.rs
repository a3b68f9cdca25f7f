//! End to end, the descriptor entries and conditions that read what Envoy
//! knows beyond headers: JWT claims `jwt_authn` verified, other dynamic
//! metadata, the route and its metadata and cluster, query parameters; and
//! a global rule keyed on a query parameter against the real quota service.
//! A real Envoy 1.40 with two workers; counts are asserted.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;

use floodgate_e2e::{assert_both_workers_served, hammer_with, Envoy, Issuer, QuotaServer, Setup, Shot};
use serde_json::{json, Value};

/// The status counts of one label of a [`hammer_with`] run.
fn count(seen: &HashMap<String, HashMap<u16, usize>>, label: &str, status: u16) -> usize {
    seen.get(label).and_then(|s| s.get(&status)).copied().unwrap_or(0)
}

/// A request to `path` with `headers`; the status.
fn status(envoy: &Envoy, path: &str, headers: &[(&str, &[u8])]) -> u16 {
    envoy.connect().get(path, headers).status
}

/// How many of `n` requests to `path` with `headers` were admitted; every
/// answer must be 200 or 429.
fn admitted(envoy: &Envoy, n: usize, path: &str, headers: &[(&str, &[u8])]) -> usize {
    let mut conn = envoy.connect();
    (0..n)
        .filter(|_| match conn.get(path, headers).status {
            200 => true,
            429 => false,
            other => panic!("{path}: status {other}"),
        })
        .count()
}

fn bearer(token: &str) -> Vec<u8> {
    format!("Bearer {token}").into_bytes()
}

/// A `metadata` entry on the verified JWT payload, at `path` under it.
fn claim(path: &[&str], extra: &str) -> String {
    let segments: Vec<String> = ["jwt_payload"].iter().chain(path).map(|k| format!(r#"{{"key": "{k}"}}"#)).collect();
    format!(
        r#"{{"metadata": {{"descriptor_key": "user", {extra}
            "metadata_key": {{"key": "envoy.filters.http.jwt_authn", "path": [{}]}}}}}}"#,
        segments.join(", ")
    )
}

/// Rules on the claims of tokens `jwt_authn` verified, one per path:
/// - `/api/user`: 20 an hour per `sub`; a token without one is not limited;
/// - `/api/anon`: 5 per `sub`, tokens without one sharing `anonymous`;
/// - `/api/entry`: 7 per plan and `sub`, the entry dropped without one;
/// - `/api/org`: 6 per `org.id` (a nested claim);
/// - `/api/customer`: 4 per `customer`, a number: as in Envoy, not a string,
///   so every token takes the default.
fn jwt_rules() -> String {
    let rule = |name: &str, path: &str, limit: u32, descriptors: &[String]| {
        format!(
            r#"{{"name": "{name}", "match": {{"path_prefix": "{path}"}}, "limit": {limit}, "period": "1h",
                "descriptors": [{}]}}"#,
            descriptors.join(", ")
        )
    };
    let rules = [
        rule("per-user", "/api/user", 20, &[claim(&["sub"], "")]),
        rule("per-user-or-anonymous", "/api/anon", 5, &[claim(&["sub"], r#""default_value": "anonymous","#)]),
        rule(
            "per-plan-and-user",
            "/api/entry",
            7,
            &[
                r#"{"generic_key": {"descriptor_key": "plan", "descriptor_value": "free"}}"#.to_string(),
                claim(&["sub"], r#""skip_if_absent": true,"#),
            ],
        ),
        rule("per-org", "/api/org", 6, &[claim(&["org", "id"], "")]),
        rule("per-customer", "/api/customer", 4, &[claim(&["customer"], r#""default_value": "not-a-string","#)]),
    ];
    format!(r#"{{"rules": [{}]}}"#, rules.join(", "))
}

#[test]
fn jwt_claims_limit_each_user_exactly_across_both_workers() {
    let issuer = Issuer::generate();
    let mut setup = Setup::new(&jwt_rules());
    setup.filters_before.push(issuer.jwt_authn_filter("/api"));
    let envoy = Envoy::start(&setup);
    let users: Vec<String> = (0..5).map(|u| format!("user-{u}")).collect();
    let tokens: Vec<Vec<u8>> = users.iter().map(|u| bearer(&issuer.token(json!({"sub": u})))).collect();

    // 24 clients x 10 requests, every client cycling through 5 users: 48
    // requests per user, 20 may pass.
    let (labels, auth) = (users.clone(), tokens.clone());
    let seen = hammer_with(&envoy, 24, 10, move |client, i| {
        let u = (client + i) % 5;
        Shot {
            label: labels[u].clone(),
            path: "/api/user/items".into(),
            headers: vec![("authorization".into(), auth[u].clone())],
        }
    });
    for user in &users {
        assert_eq!(count(&seen, user, 200), 20, "{user}: {:?}", seen[user]);
        assert_eq!(count(&seen, user, 429), 48 - 20, "{user}: {:?}", seen[user]);
    }
    assert_both_workers_served(&envoy);
    assert_eq!(envoy.stat("wasmcustom.floodgate.rule.per-user.allowed"), 100);

    // A bad signature, an expired token, no token: Envoy answers 401 and
    // Floodgate never sees the request.
    let decided = || envoy.stat("wasmcustom.floodgate.allowed") + envoy.stat("wasmcustom.floodgate.limited");
    let before = decided();
    let forged = bearer(&Issuer::generate().token(json!({"sub": "user-0"})));
    let expired = bearer(&issuer.token(json!({"sub": "user-9", "exp": 1_000_000_000})));
    // `jwt_authn` itself refuses a `sub` that is not a string (so only other
    // claims can reach a `metadata` entry as numbers or objects).
    let numeric_sub = bearer(&issuer.token(json!({"sub": 42})));
    for headers in [
        &[("authorization", forged.as_slice())][..],
        &[("authorization", expired.as_slice())],
        &[("authorization", numeric_sub.as_slice())],
        &[],
    ] {
        assert_eq!(status(&envoy, "/api/user/items", headers), 401);
    }
    assert_eq!(decided(), before, "a rejected token reached Floodgate");

    // Without `sub`: no value and no default skips the rule...
    let no_sub = bearer(&issuer.token(json!({"scope": "read"})));
    let no_sub: &[(&str, &[u8])] = &[("authorization", &no_sub)];
    assert_eq!(admitted(&envoy, 30, "/api/user/items", no_sub), 30);
    assert_eq!(envoy.stat("wasmcustom.floodgate.rule.per-user.allowed"), 100, "the rule did not apply");
    // ...a default_value gives every such token one shared bucket...
    let alice = bearer(&issuer.token(json!({"sub": "alice"})));
    let alice: &[(&str, &[u8])] = &[("authorization", &alice)];
    assert_eq!(admitted(&envoy, 10, "/api/anon", no_sub), 5);
    assert_eq!(admitted(&envoy, 10, "/api/anon", alice), 5, "alice has her own");
    let named_anonymous = bearer(&issuer.token(json!({"sub": "anonymous"})));
    let named_anonymous: &[(&str, &[u8])] = &[("authorization", &named_anonymous)];
    assert_eq!(admitted(&envoy, 3, "/api/anon", named_anonymous), 0, "a real `anonymous` is the default's bucket");
    // ...and skip_if_absent drops the entry: the bucket of the plan alone.
    assert_eq!(admitted(&envoy, 10, "/api/entry", no_sub), 7);
    assert_eq!(admitted(&envoy, 10, "/api/entry", alice), 7, "plan and alice: another bucket");

    // A nested claim: users of one organization share its limit.
    let member = |sub: &str, org: &str| bearer(&issuer.token(json!({"sub": sub, "org": {"id": org, "tier": 2}})));
    let (ann, bob, cat) = (member("ann", "acme"), member("bob", "acme"), member("cat", "globex"));
    let acme = admitted(&envoy, 4, "/api/org", &[("authorization", &ann)])
        + admitted(&envoy, 4, "/api/org", &[("authorization", &bob)]);
    assert_eq!(acme, 6);
    assert_eq!(admitted(&envoy, 4, "/api/org", &[("authorization", &cat)]), 4);

    // A numeric claim is not a string to Envoy's metadata action, nor here:
    // different customers all take the default, one bucket.
    let customer = |sub: &str, id: u64| bearer(&issuer.token(json!({"sub": sub, "customer": id})));
    let (c42, c7) = (customer("dan", 42), customer("eve", 7));
    let both = admitted(&envoy, 3, "/api/customer", &[("authorization", &c42)])
        + admitted(&envoy, 3, "/api/customer", &[("authorization", &c7)]);
    assert_eq!(both, 4);
}

/// Two routes with names, metadata and clusters of their own, and a
/// direct-response route with none.
fn routes() -> Vec<Value> {
    vec![
        json!({"name": "search", "match": {"prefix": "/search"},
               "metadata": {"filter_metadata": {"floodgate": {"tier": "gold"}}}, "route": {"cluster": "svc-search"}}),
        json!({"name": "orders", "match": {"prefix": "/orders"},
               "metadata": {"filter_metadata": {"floodgate": {"tier": "bronze"}}}, "route": {"cluster": "svc-orders"}}),
        json!({"name": "static", "match": {"prefix": "/"},
               "direct_response": {"status": 200, "body": {"inline_string": "static"}}}),
    ]
}

#[test]
fn route_name_route_metadata_and_cluster_pick_each_routes_limit() {
    let config = r#"{"rules": [
        {"name": "search", "match": {"route_name": "search"}, "limit": 8, "period": "1h"},
        {"name": "orders", "match": {"route_name": "orders"}, "limit": 3, "period": "1h"},
        {"name": "gold-only", "limit": 1000, "period": "1h",
         "match": {"route_metadata": {"filter": "floodgate", "path": [{"key": "tier"}], "value": {"string_match": {"exact": "gold"}}}}},
        {"name": "per-tier", "limit": 1000, "period": "1h",
         "descriptors": [{"metadata": {"descriptor_key": "tier", "source": "ROUTE_ENTRY",
                                       "metadata_key": {"key": "floodgate", "path": [{"key": "tier"}]}}}]},
        {"name": "per-cluster", "limit": 1000, "period": "1h", "descriptors": [{"destination_cluster": {}}]}]}"#;
    let mut setup = Setup::new(config).with_upstream(&["svc-search", "svc-orders"]);
    setup.routes = Some(routes());
    let envoy = Envoy::start(&setup);
    let seen = hammer_with(&envoy, 6, 8, |client, i| {
        let path = ["/search/q", "/orders/1", "/about"][(client + i) % 3];
        Shot { label: path.into(), path: path.into(), headers: vec![] }
    });
    assert_eq!(count(&seen, "/search/q", 200), 8, "{seen:?}");
    assert_eq!(count(&seen, "/orders/1", 200), 3, "{seen:?}");
    assert_eq!(count(&seen, "/about", 200), 16, "no rule limits the static route: {seen:?}");
    assert_both_workers_served(&envoy);
    let stat = |rule: &str| envoy.stat(&format!("wasmcustom.floodgate.rule.{rule}.allowed"));
    assert_eq!(stat("gold-only"), 8, "only the gold route's requests");
    assert_eq!(stat("per-tier"), 11, "both routes with a tier, not the static one");
    assert_eq!(stat("per-cluster"), 11, "both routes with a cluster, not the direct response");
}

/// What the README says of a route changed before Floodgate: Lua rewrites
/// the header routing depends on (and so clears the route cache), the router
/// sends the request by the new route, but Floodgate, which cannot make Envoy
/// match the route again, still reads the one matched on arrival.
#[test]
fn a_route_changed_by_an_earlier_filter_is_not_what_the_rule_sees() {
    let config = r#"{"rules": [{"name": "route-b", "match": {"route_name": "b"}, "limit": 1, "period": "1h"}]}"#;
    let mut setup = Setup::new(config).with_upstream(&["svc-a", "svc-b"]);
    setup.routes = Some(vec![
        json!({"name": "b", "match": {"prefix": "/", "headers": [{"name": "x-route", "string_match": {"exact": "b"}}]},
               "route": {"cluster": "svc-b"},
               "response_headers_to_add": [{"header": {"key": "x-served-by", "value": "b"}}]}),
        json!({"name": "a", "match": {"prefix": "/"}, "route": {"cluster": "svc-a"},
               "response_headers_to_add": [{"header": {"key": "x-served-by", "value": "a"}}]}),
    ]);
    let lua = "function envoy_on_request(handle)
  local route = handle:headers():get(\"x-lua-route\")
  if route ~= nil then handle:headers():replace(\"x-route\", route) end
end
";
    setup.filters_before.push(json!({
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": lua},
        },
    }));
    let envoy = Envoy::start(&setup);
    let mut conn = envoy.connect();
    let direct: Vec<_> = (0..3).map(|_| conn.get("/", &[("x-route", b"b")])).collect();
    assert!(direct.iter().all(|r| r.header("x-served-by") == Some("b")));
    assert_eq!(direct.iter().map(|r| r.status).collect::<Vec<_>>(), [200, 429, 429], "route b's rule applies");
    let rerouted: Vec<_> = (0..3).map(|_| conn.get("/", &[("x-lua-route", b"b")])).collect();
    assert!(rerouted.iter().all(|r| r.header("x-served-by") == Some("b")), "the router used the new route");
    assert!(rerouted.iter().all(|r| r.status == 200), "the rule saw route a, matched on arrival");
}

/// `header_to_metadata` writes a header into dynamic metadata; a `metadata`
/// entry reads it back: one bucket per tenant, a request without the header
/// not limited.
#[test]
fn dynamic_metadata_from_header_to_metadata_keys_a_rule() {
    let config = r#"{"rules": [{"name": "per-tenant", "limit": 4, "period": "1h",
        "descriptors": [{"metadata": {"descriptor_key": "tenant",
                                      "metadata_key": {"key": "tenants", "path": [{"key": "id"}]}}}]}]}"#;
    let mut setup = Setup::new(config);
    setup.filters_before.push(json!({
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "request_rules": [{
                "header": "x-tenant",
                "on_header_present": {"metadata_namespace": "tenants", "key": "id", "type": "STRING"},
                "remove": true,
            }],
        },
    }));
    let envoy = Envoy::start(&setup);
    let seen = hammer_with(&envoy, 8, 9, |client, i| {
        let tenant = ["acme", "globex", ""][(client + i) % 3];
        let headers = if tenant.is_empty() { vec![] } else { vec![("x-tenant".into(), tenant.as_bytes().to_vec())] };
        Shot { label: tenant.into(), path: "/".into(), headers }
    });
    assert_eq!(count(&seen, "acme", 200), 4, "{seen:?}");
    assert_eq!(count(&seen, "globex", 200), 4, "{seen:?}");
    assert_eq!(count(&seen, "", 200), 24, "{seen:?}");
    assert_both_workers_served(&envoy);
}

#[test]
fn query_parameters_present_absent_repeated_encoded_and_malformed() {
    let config = r#"{"rules": [
        {"name": "per-user", "match": {"path_prefix": "/q"}, "limit": 3, "period": "1h",
         "descriptors": [{"query_parameters": {"query_parameter_name": "user", "descriptor_key": "user"}}]},
        {"name": "debug", "match": {"path_prefix": "/d"}, "limit": 2, "period": "1h",
         "descriptors": [{"query_parameter_value_match": {"descriptor_value": "on",
                            "query_parameters": [{"name": "debug", "present_match": true}]}}]}]}"#;
    let envoy = Envoy::start(&Setup::new(config));
    let n = |n: usize, path: &str| admitted(&envoy, n, path, &[]);
    // Present: 3 per value, over both workers.
    let seen = hammer_with(&envoy, 8, 6, |client, i| {
        let user = ["alice", "bob"][(client + i) % 2];
        Shot { label: user.into(), path: format!("/q?user={user}&page={i}"), headers: vec![] }
    });
    assert_eq!((count(&seen, "alice", 200), count(&seen, "bob", 200)), (3, 3), "{seen:?}");
    assert_both_workers_served(&envoy);
    // Percent-encoded: the same value; the first of repeated parameters counts.
    assert_eq!(n(1, "/q?user=%61lice"), 0, "%61lice is alice");
    assert_eq!(n(1, "/q?user=bob&user=carol"), 0, "the first user, bob, is spent");
    assert_eq!(n(5, "/q?user=carol&user=bob"), 3, "the first user is carol");
    assert_eq!(n(5, "/q?user=d%C3%A9j%C3%A0"), 3);
    // Malformed escapes stay as written: `%zz` is its own value, which `%25zz` decodes to.
    assert_eq!(n(5, "/q?user=%zz"), 3);
    assert_eq!(n(1, "/q?user=%25zz"), 0);
    // `+` is not a space.
    assert_eq!(n(5, "/q?user=a+b"), 3);
    assert_eq!(n(5, "/q?user=a%20b"), 3);
    // Absent: the rule does not apply.
    assert_eq!(n(10, "/q?users=alice"), 10);
    assert_eq!(n(10, "/q"), 10);
    // Hostile: a 30 KB value, and many parameters, are just values.
    let long = format!("/q?user={}", "%41".repeat(10_000));
    assert_eq!(n(5, &long), 3);
    let many = format!("/q?{}user=eve", "x=1&".repeat(5_000));
    assert_eq!(n(5, &many), 3);
    // A parameter's presence, valued or not, is what query_parameter_value_match sees.
    assert_eq!(n(3, "/d?debug"), 2);
    assert_eq!(n(1, "/d?debug=1"), 0);
    assert_eq!(n(5, "/d?verbose=1"), 5);
    assert!(!envoy.log_tail().contains("panicked"), "{}", envoy.log_tail());
}

/// The quota service's limits for `edge`: 4 an hour per `user` value; `vip`
/// 10; requests from this Envoy's service cluster `e2e-edge` nested by user
/// get 2 per user.
const USER_LIMITS: &str = "domain: edge
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 4, algorithm: token_bucket, burst: 4}
  - key: user
    value: vip
    rate_limit: {unit: hour, requests_per_unit: 10, algorithm: token_bucket, burst: 10}
  - key: source_cluster
    value: e2e-edge
    descriptors:
      - key: user
        rate_limit: {unit: hour, requests_per_unit: 2, algorithm: token_bucket, burst: 2}
";

#[test]
fn a_global_rule_keyed_on_a_query_parameter_holds_each_values_service_limit() {
    let service = QuotaServer::start(USER_LIMITS, "memory");
    let config = r#"{"rules": [
        {"name": "per-user", "scope": "global", "mode": "check", "fallback": "deny", "match": {"path_prefix": "/q"},
         "descriptors": [{"query_parameters": {"query_parameter_name": "user", "descriptor_key": "user"}}]},
        {"name": "per-source-and-user", "scope": "global", "mode": "check", "fallback": "deny", "match": {"path_prefix": "/s"},
         "descriptors": [{"source_cluster": {}}, {"query_parameters": {"query_parameter_name": "user", "descriptor_key": "user"}}]}],
      "global": {"cluster": "floodgate-quota", "domain": "edge", "timeout": "500ms", "max_wait": "300ms"}}"#;
    let mut setup = Setup::new(config).with_cluster("floodgate-quota", &[service.port]);
    setup.node_cluster = Some("e2e-edge".into());
    let envoy = Envoy::start(&setup);
    let seen = hammer_with(&envoy, 6, 12, |client, i| {
        let user = ["alice", "bob", "vip"][(client + i) % 3];
        Shot { label: user.into(), path: format!("/q?user={user}"), headers: vec![] }
    });
    assert_eq!(count(&seen, "alice", 200), 4, "{seen:?}\n{}", envoy.log_tail());
    assert_eq!(count(&seen, "bob", 200), 4, "{seen:?}");
    assert_eq!(count(&seen, "vip", 200), 10, "{seen:?}");
    assert_both_workers_served(&envoy);
    // Decoded before it is sent: %61lice is alice, whose quota is spent.
    assert_eq!(admitted(&envoy, 1, "/q?user=%61lice", &[]), 0);
    // The service cluster reaches the service: its nested limit applies.
    assert_eq!(admitted(&envoy, 5, "/s?user=carol", &[]), 2);
    assert_eq!(envoy.stat("wasmcustom.floodgate.rule.per-user.fallback"), 0);
    let checks = service.metric("floodgate_quota_requests_total", &[r#"endpoint="check""#, r#"status="200""#]);
    assert!(checks >= (6 * 12 + 6) as f64, "one check per request: {checks}");
}
