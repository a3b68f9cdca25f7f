//! A full memory store (issue 10, finding 3): at `--memory-max-buckets` with
//! no idle bucket, requests for existing keys are still decided and new keys
//! get a clear 503 `full`, and neither refusing nor sweeping scans the store:
//! they look only at entries queued as possibly idle (counted by
//! `LocalStore::examined`). Timings belong in the benchmark; this asserts
//! behaviour and counts.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{Backend, Fixture, Options};
use floodgate_core::time::SECOND;
use floodgate_quota::config::Limit;
use floodgate_quota::store::{bucket_key, BucketCheck, QuotaStore};
use serde_json::json;

const LIMITS: &str = "domain: test\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 10}\n";
const MAX: usize = 20_000;

fn check(value: &str) -> serde_json::Value {
    json!({"domain": "test", "descriptors": [[["k", value]]]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_serves_known_keys_and_refuses_new_ones_without_scanning() {
    let f = Fixture::with(Backend::Memory, LIMITS, Options { max_buckets: MAX, ..Options::default() }).await;
    let store = f.service.store();
    let QuotaStore::Memory(memory) = store else { panic!("memory store") };
    let limit = Limit::new("fixed_window", 10, SECOND.times(3_600), "{}").unwrap();
    // Fill the store with buckets in use (none idle until the hour ends).
    for i in 0..MAX {
        let key = bucket_key("test", &limit, &[("k".to_string(), format!("u{i}"))]);
        assert!(
            store.check(&[BucketCheck { key, limit: limit.clone(), cost: 1, shadow: false }]).await.unwrap().committed
        );
    }
    assert_eq!(memory.len(), MAX);
    let examined = memory.examined();

    // Known keys are decided as usual.
    let r = f.check(check("u7")).await;
    assert_eq!(r["allowed"], true);
    assert_eq!(r["results"][0]["remaining"], 8);
    // New keys get a clear 503.
    for i in 0..50 {
        let (status, body) = f.post("/v1/check", &check(&format!("new{i}"))).await;
        assert_eq!(status, 503, "{body}");
        assert!(body["error"].as_str().unwrap().contains("full"), "{body}");
    }
    let lease = json!({"domain": "test", "leases": [{"id": "l1", "descriptor": [["k", "new"]], "wanted": 1}]});
    let (status, body) = f.post("/v1/lease", &lease).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(memory.sweep(), 0, "nothing is idle");
    assert_eq!(memory.examined(), examined, "refusing and sweeping looked at no entry, let alone all {MAX}");
    assert!(f.metrics().await.contains(r#"floodgate_quota_store_errors_total{kind="full",store="memory"} 51"#));
    let r = f.check(check("u7")).await;
    assert_eq!(r["results"][0]["remaining"], 7, "known keys still served");

    // The hour ends: every bucket is idle. A new key makes room by dropping
    // a bounded number of them, not by scanning the rest.
    f.clock.advance(SECOND.times(3_600));
    let r = f.check(check("after")).await;
    assert_eq!(r["allowed"], true);
    let dropped = MAX + 1 - memory.len();
    assert!((1..=1_025).contains(&dropped), "one request dropped {dropped} idle entries: a bounded step, not all");
    let looked = memory.examined() - examined;
    assert!((1..=1_025).contains(&looked), "looked at {looked} entries to make room for one");
    assert_eq!(memory.len(), MAX + 1 - looked, "each entry looked at was idle and dropped");
    assert_eq!(memory.sweep(), MAX - looked, "the sweep drops the rest");
    assert_eq!(memory.len(), 1);
}
