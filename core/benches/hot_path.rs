//! The core's per-request path, natively: what each stage of a decision
//! costs in Floodgate's own code, with the store in memory (no host calls).
//! The rules are those of the filter benchmark's variants (d), (e) and (f):
//! one never-limiting rule per API key, the same rule limiting (10 a
//! second), and three rules on each request.
//!
//! `cargo bench -p floodgate-core --bench hot_path` (or `make core-bench`).

#![allow(clippy::expect_used)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use floodgate_core::config::Config;
use floodgate_core::descriptor::{fingerprint, StaticRequest};
use floodgate_core::headers::HeaderBlock;
use floodgate_core::limiter::{CompiledRule, Counters, Limiter, RequestEvent, RuleEvent, StoreEvent};
use floodgate_core::store::{MemoryStore, Step};
use floodgate_core::time::{Nanos, SECOND};

const NOW: Nanos = Nanos::from_nanos(1_700_000_000 * SECOND.get());

const PER_KEY: &str = r#"[{"request_headers": {"header_name": "x-api-key", "descriptor_key": "api_key"}}]"#;
const PER_KEY_AND_PATH: &str = r#"[{"request_headers": {"header_name": "x-api-key", "descriptor_key": "api_key"}},
    {"request_headers": {"header_name": ":path", "descriptor_key": "path"}}]"#;
const WHOLE_SITE: &str = r#"[{"generic_key": {"descriptor_value": "all"}}]"#;

fn never_limiting(name: &str, descriptors: &str) -> String {
    format!(r#"{{"name": "{name}", "descriptors": {descriptors}, "limit": 1000000000, "period": "1s"}}"#)
}

/// Counts nothing: the host's metrics are not the core's cost.
struct Discard;

impl Counters<()> for Discard {
    fn request(&mut self, _: RequestEvent) {}
    fn rule(&mut self, _: &CompiledRule<()>, _: RuleEvent) {}
    fn store(&mut self, _: StoreEvent, _: u64) {}
}

fn limiter(json: &str, store: &MemoryStore) -> Limiter {
    let config = Config::parse(json.as_bytes()).expect("a valid configuration");
    Limiter::prepare(config, store, [7; 16], |_| ()).expect("prepared")
}

fn request(limiter: &Limiter) -> StaticRequest {
    let value = |name: &str| match name {
        "x-api-key" => Some(b"key-7".to_vec()),
        ":path" => Some(b"/api/items".to_vec()),
        _ => None,
    };
    StaticRequest {
        headers: limiter.header_names().iter().map(|name| value(name)).collect(),
        remote_address: Some(b"10.0.0.1:5555".to_vec()),
        attributes: Default::default(),
    }
}

/// Whole decisions: `Limiter::check`, and rendering the response headers.
fn decisions(c: &mut Criterion) {
    let one = format!(r#"{{"rules": [{}]}}"#, never_limiting("per-api-key", PER_KEY));
    let limited =
        format!(r#"{{"rules": [{{"name": "per-api-key", "descriptors": {PER_KEY}, "limit": 10, "period": "1s"}}]}}"#);
    let three = format!(
        r#"{{"rules": [{}, {}, {}]}}"#,
        never_limiting("per-api-key", PER_KEY),
        never_limiting("per-key-and-path", PER_KEY_AND_PATH),
        never_limiting("whole-site", WHOLE_SITE)
    );
    for (name, json) in [("one rule, allowed", &one), ("one rule, limited", &limited), ("three rules, allowed", &three)]
    {
        let store = MemoryStore::default();
        let limiter = limiter(json, &store);
        let mut request = request(&limiter);
        let mut headers = HeaderBlock::default();
        c.bench_function(&format!("check + headers: {name}"), |b| {
            b.iter(|| {
                let (verdict, permit) = limiter.check(&store, NOW, &mut request, &mut Discard);
                limiter.render_headers(&verdict, &mut headers);
                black_box(&headers);
                black_box(permit)
            })
        });
    }
}

/// The stages of one rule's decision, each alone.
fn stages(c: &mut Criterion) {
    let store = MemoryStore::default();
    let limiter = limiter(&format!(r#"{{"rules": [{}]}}"#, never_limiting("per-api-key", PER_KEY)), &store);
    let rule = &limiter.rules()[0].rule;
    let mut request = request(&limiter);
    c.bench_function("stage: rule matching", |b| b.iter(|| black_box(rule.request_match.matches(&mut request))));
    c.bench_function("stage: descriptor and hash", |b| {
        b.iter(|| black_box(fingerprint((1, 2), &rule.name, &rule.descriptors, &mut request)))
    });
    let fp = fingerprint((1, 2), &rule.name, &rule.descriptors, &mut request).expect("a descriptor");
    let table = &rule.table;
    let mut group = table.empty_group();
    if let Step::Write(next, _) = table.decide(group.clone(), fp, NOW, 1) {
        group = next;
    }
    c.bench_function("stage: slot lookup and algorithm (group in hand)", |b| {
        b.iter(|| black_box(table.decide(group.clone(), fp, NOW, 1)))
    });
    let policy = rule.policy();
    let mut slot = vec![0u8; policy.state_len()];
    policy.write_fresh(&mut slot, NOW);
    c.bench_function("stage: algorithm alone", |b| b.iter(|| black_box(policy.decide(&mut slot, NOW, 1))));
    c.bench_function("stage: memory store get + set", |b| {
        use floodgate_core::store::Store;
        let key = "fg:per-api-key:0";
        b.iter(|| {
            let (value, cas) = store.get(key).ok().flatten().expect("the group exists");
            black_box(store.set(key, &value, Some(cas)))
        })
    });
    let (verdict, _permit) = limiter.check(&store, NOW, &mut request, &mut Discard);
    let mut headers = HeaderBlock::default();
    c.bench_function("stage: header rendering", |b| {
        b.iter(|| {
            limiter.render_headers(&verdict, &mut headers);
            black_box(&headers);
        })
    });
}

criterion_group!(benches, decisions, stages);
criterion_main!(benches);
