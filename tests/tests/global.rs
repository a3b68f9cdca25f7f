//! End to end, global mode: real Envoys (two workers each) with the filter,
//! and the real quota service, on loopback. Counts are asserted: what the
//! whole fleet admits against what the service's limit allows.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use floodgate_e2e::{Conn, Envoy, QuotaService, Setup};

/// 30 per hour, as a token bucket holding 30: nothing refills during a test.
const LIMITS: &str = "domain: edge
descriptors:
  - key: route
    value: api
    rate_limit: {unit: hour, requests_per_unit: 30, algorithm: token_bucket, burst: 30}
  - key: api_key
    rate_limit: {unit: hour, requests_per_unit: 20, algorithm: token_bucket, burst: 20}
";

fn plugin(mode: &str, fallback: &str) -> String {
    format!(
        r#"{{"rules": [{{"name": "fleet", "scope": "global", "mode": "{mode}", "fallback": {fallback},
            "descriptors": [{{"generic_key": {{"descriptor_key": "route", "descriptor_value": "api"}}}}]}}],
          "global": {{"cluster": "floodgate-quota", "domain": "edge", "timeout": "500ms", "max_wait": "300ms"}}}}"#
    )
}

fn envoy_for(service_ports: &[u16], plugin: &str) -> Envoy {
    Envoy::start(&Setup::new(plugin).with_cluster("floodgate-quota", service_ports))
}

/// Sends requests from `clients` connections to each Envoy until `stop`;
/// returns (admitted, limited, other statuses).
fn load(envoys: &[&Envoy], clients: usize, run_for: Duration, path: &'static str, key: fn(usize) -> String) -> (u64, u64, u64) {
    let stop = Arc::new(AtomicBool::new(false));
    let handles: Vec<_> = envoys
        .iter()
        .flat_map(|envoy| (0..clients).map(move |c| (envoy.port, c)))
        .map(|(port, client)| {
            let stop = Arc::clone(&stop);
            thread::spawn(move || {
                let mut conn = Conn::open(port).unwrap();
                let (mut ok, mut limited, mut other) = (0, 0, 0);
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let k = key(client + i);
                    i += 1;
                    match conn.try_request("GET", path, &[("x-api-key", k.as_bytes())]) {
                        Ok(r) if r.status == 200 => ok += 1,
                        Ok(r) if r.status == 429 => limited += 1,
                        Ok(_) => other += 1,
                        Err(_) => {
                            other += 1;
                            conn = Conn::open(port).unwrap();
                        }
                    }
                }
                (ok, limited, other)
            })
        })
        .collect();
    thread::sleep(run_for);
    stop.store(true, Ordering::Relaxed);
    handles.into_iter().map(|h| h.join().unwrap()).fold((0, 0, 0), |a, b| (a.0 + b.0, a.1 + b.1, a.2 + b.2))
}

#[test]
fn one_envoy_spends_leases_and_never_passes_the_service_limit() {
    let service = QuotaService::start(LIMITS, "memory");
    let envoy = envoy_for(&[service.port], &plugin("lease", r#""deny""#));
    let mut conn = envoy.connect();
    let admitted = (0..60).filter(|_| conn.get("/", &[]).status == 200).count();
    assert_eq!(admitted, 30, "exactly the service's 30 per hour\n{}", envoy.log_tail());
    assert!(envoy.stat("wasmcustom.floodgate.global.callouts_ok") > 0);
    assert_eq!(envoy.stat("wasmcustom.floodgate.rule.fleet.fallback"), 0);
}
