//! The processes a part runs for its variants: one Envoy per variant, and
//! the upstream Envoy and floodgate-quota instances only when a selected
//! variant needs them. All live until the rig is dropped.

use floodgate_e2e::{Envoy, QuotaOptions, QuotaServer};

use crate::filters::{self, Filters, Paths};
use crate::settings::BenchSettings;
use crate::variants::{Ports, QuotaBackend, Variant, HOT_KEY, LONG_LEASE, PER_MINUTE_KEY};

/// The Envoys of a part's variants and what they ask.
pub struct Rig {
    /// One per variant, in the variants' order.
    pub envoys: Vec<Envoy>,
    quota: Option<QuotaServer>,
    long_lease: Option<QuotaServer>,
    // Held so that it lives as long as the Envoys that proxy to it.
    _upstream: Option<Envoy>,
}

impl Rig {
    /// Starts what `variants` need and one Envoy each (named
    /// `<prefix>-<id>`), and waits until all are ready. All Envoys start up
    /// front: an idle Envoy costs no CPU, and alternating them round by round
    /// spreads any drift in the machine over all variants.
    pub fn start(s: &BenchSettings, prefix: &str, variants: &[&Variant]) -> Rig {
        let needs = |f: &dyn Fn(&Variant) -> bool| variants.iter().any(|v| f(v));
        let upstream =
            needs(&|v| v.proxied).then(|| filters::start(&format!("{prefix}-upstream"), &Filters::None, &s.paths));
        let quota = needs(&|v| matches!(v.service, QuotaBackend::Rls | QuotaBackend::Leases))
            .then(|| start_quota(&s.paths, &format!("{prefix}-quota"), &[]));
        let long_lease = needs(&|v| v.service == QuotaBackend::LongLeases)
            .then(|| start_quota(&s.paths, &format!("{prefix}-quota-long-lease"), &["--lease-ttl", LONG_LEASE]));
        let ports = Ports {
            upstream: upstream.as_ref().map_or(0, |e| e.port),
            grpc: quota.as_ref().and_then(|q| q.grpc_port).unwrap_or(0),
            quota_http: quota.as_ref().map_or(0, |q| q.port),
            long_lease_http: long_lease.as_ref().map_or(0, |q| q.port),
        };
        eprintln!("{prefix}: starting {} Envoys", variants.len());
        let mut envoys: Vec<Envoy> = variants
            .iter()
            .map(|v| filters::spawn(&format!("{prefix}-{}", v.id), &(v.filters)(&ports), &s.paths))
            .collect();
        for envoy in &mut envoys {
            envoy.wait_ready();
        }
        Rig { envoys, quota, long_lease, _upstream: upstream }
    }

    /// The floodgate-quota instance whose calls `variant`'s callouts are
    /// counted on, for Floodgate's global-mode variants.
    pub fn callout_service(&self, variant: &Variant) -> Option<&QuotaServer> {
        match variant.service {
            QuotaBackend::Leases => self.quota.as_ref(),
            QuotaBackend::LongLeases => self.long_lease.as_ref(),
            QuotaBackend::None | QuotaBackend::Rls => None,
        }
    }
}

/// floodgate-quota (the release build, memory store, its gRPC API on) for
/// Envoy's global filter and Floodgate's global mode, with never-limiting
/// rules (domain `bench`): one per `api_key` value (fixed windows of
/// `BENCH_QUOTA_UNIT`), one per [`PER_MINUTE_KEY`] value (fixed windows of
/// a minute, whatever `BENCH_QUOTA_UNIT` says), and [`HOT_KEY`] for a
/// single hot key. `extra` goes on its command line (e.g. `--lease-ttl
/// 10s`); `name` tells its files from others'.
fn start_quota(paths: &Paths, name: &str, extra: &[&str]) -> QuotaServer {
    assert!(
        paths.quota_bin.exists(),
        "{} is missing: build it (make -f bench/bench.mk filter-bench builds it)",
        paths.quota_bin.display()
    );
    let limits = format!(
        "domain: bench\ndescriptors:\n  - key: api_key\n    rate_limit: {{unit: {unit}, requests_per_unit: 1000000000}}\n  \
         - key: {PER_MINUTE_KEY}\n    rate_limit: {{unit: minute, requests_per_unit: 1000000000}}\n  \
         - key: {}\n    value: {}\n    rate_limit: {{unit: {unit}, requests_per_unit: 1000000000}}\n",
        HOT_KEY.0,
        HOT_KEY.1,
        unit = paths.quota_unit
    );
    let mut args = vec![
        // Every variant's Envoy calls from 127.0.0.1: one address standing
        // for many Envoys, as behind a proxy. With a share of the lease
        // records per address, the variants run before it (10,000 keys'
        // leases, each record kept its lease plus 30 s) filled the share,
        // and the next global variant's first round was refused (503) and
        // decided by its fall-back (docs/benchmarks.md, 06:37).
        "--max-connections-per-peer".to_string(),
        "0".to_string(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    let options = QuotaOptions {
        bin: paths.quota_bin.clone(),
        name: name.to_string(),
        dir: paths.scratch.clone(),
        store: "memory".into(),
        port: None,
        grpc: true,
        args,
        env: vec![("RUST_LOG".into(), "warn".into())],
    };
    QuotaServer::launch(&limits, options)
}
