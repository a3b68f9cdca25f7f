//! With `--redis-clock local`, an instance whose clock is off from Redis's
//! must not decide. Two instances two windows apart used to reset each other's
//! count on every write (the limit gone: about 2,000 a second admitted against
//! a limit of 5 a second); the one off by more than the bound now refuses (a
//! 503 of kind `clock`, counted), and the limit holds.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use floodgate_core::time::{Clock, Nanos};
use floodgate_e2e::RedisServer;
use floodgate_protocol::CheckRequest;
use floodgate_quota::clock::SystemClock;
use floodgate_quota::metrics::ServiceMetrics;
use floodgate_quota::service::{ApiError, Service, Settings};
use floodgate_quota::store::{QuotaStore, RedisOptions, RedisStore};
use serde_json::json;

const LIMITS: &str = "domain: skew\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 5}\n";

/// This machine's clock, moved by `ahead`.
#[derive(Debug)]
struct Skewed {
    ahead: Nanos,
}

impl Clock for Skewed {
    fn now(&self) -> Nanos {
        SystemClock.now() + self.ahead
    }
}

fn instance(url: &str, ahead: Nanos) -> Service {
    let clock: Arc<dyn Clock> = Arc::new(Skewed { ahead });
    let options = RedisOptions::local_clock(Duration::from_secs(2), clock);
    let store = QuotaStore::new(Arc::new(RedisStore::new(url, options).unwrap()));
    Service::new(
        common::domains(LIMITS),
        store,
        ServiceMetrics::new().unwrap(),
        Settings { lease_ttl: Nanos::from_secs(1) },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_whose_clock_is_off_refuses_to_decide_and_the_limit_holds() {
    let redis = RedisServer::start();
    let on_time = instance(&redis.url(), Nanos::ZERO);
    // Two hourly windows ahead.
    let off = instance(&redis.url(), Nanos::from_secs(2 * 3_600));
    let request = || -> CheckRequest {
        serde_json::from_value(json!({"domain": "skew", "descriptors": [[["k", "v"]]], "hits": 1})).unwrap()
    };
    let (mut admitted, mut refused) = (0, 0);
    for _ in 0..20 {
        for service in [&on_time, &off] {
            match service.check(request()).await {
                Ok(answer) => admitted += u64::from(answer.allowed),
                Err(ApiError::Store(failure)) => {
                    assert_eq!(failure.kind(), "clock", "{failure}");
                    assert!(failure.to_string().contains("clock"), "{failure}");
                    refused += 1;
                }
                Err(other) => panic!("{other}"),
            }
        }
    }
    assert_eq!(admitted, 5, "the limit holds");
    assert_eq!(refused, 20, "the instance two hours off never decides");
    let metrics = off.metrics().render();
    assert!(metrics.contains(r#"floodgate_quota_store_errors_total{kind="clock",store="redis"} 20"#), "{metrics}");
    // The one on time is not held back.
    assert!(on_time.check(request()).await.is_ok());
}
