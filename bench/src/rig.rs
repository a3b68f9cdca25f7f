//! The processes a part runs for its variants: one Envoy per variant, and
//! the upstream Envoy and floodgate-quota instances only when a selected
//! variant needs them. All live until the rig is dropped.

use crate::envoy::{Envoy, Filters, QuotaProcess};
use crate::settings::BenchSettings;
use crate::variants::{Ports, QuotaBackend, Variant, LONG_LEASE};

/// The Envoys of a part's variants and what they ask.
pub struct Rig {
    /// One per variant, in the variants' order.
    pub envoys: Vec<Envoy>,
    quota: Option<QuotaProcess>,
    long_lease: Option<QuotaProcess>,
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
            needs(&|v| v.proxied).then(|| Envoy::start(&format!("{prefix}-upstream"), &Filters::None, &s.paths));
        let quota = needs(&|v| matches!(v.service, QuotaBackend::Rls | QuotaBackend::Leases))
            .then(|| QuotaProcess::start(&s.paths, &format!("{prefix}-quota"), &[]));
        let long_lease = needs(&|v| v.service == QuotaBackend::LongLeases).then(|| {
            QuotaProcess::start(&s.paths, &format!("{prefix}-quota-long-lease"), &["--lease-ttl", LONG_LEASE])
        });
        let ports = Ports {
            upstream: upstream.as_ref().map_or(0, |e| e.port),
            grpc: quota.as_ref().map_or(0, |q| q.grpc_port),
            quota_http: quota.as_ref().map_or(0, |q| q.http_port),
            long_lease_http: long_lease.as_ref().map_or(0, |q| q.http_port),
        };
        eprintln!("{prefix}: starting {} Envoys", variants.len());
        let mut envoys: Vec<Envoy> = variants
            .iter()
            .map(|v| Envoy::spawn(&format!("{prefix}-{}", v.id), &(v.filters)(&ports), &s.paths))
            .collect();
        for envoy in &mut envoys {
            envoy.wait_ready();
        }
        Rig { envoys, quota, long_lease, _upstream: upstream }
    }

    /// The floodgate-quota instance whose calls `variant`'s callouts are
    /// counted on, for Floodgate's global-mode variants.
    pub fn callout_service(&self, variant: &Variant) -> Option<&QuotaProcess> {
        match variant.service {
            QuotaBackend::Leases => self.quota.as_ref(),
            QuotaBackend::LongLeases => self.long_lease.as_ref(),
            QuotaBackend::None | QuotaBackend::Rls => None,
        }
    }
}
