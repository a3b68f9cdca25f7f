//! Prometheus metrics, in a registry of the service's own (no globals, so
//! tests can run several services in one process).

use floodgate_core::lease::shares::Assignment;
use prometheus::{Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry, TextEncoder};

/// The HTTP statuses the API answers.
const HTTP_STATUSES: [&str; 8] = ["200", "400", "401", "404", "408", "413", "422", "503"];

/// The gRPC codes `ShouldRateLimit` answers, as labels (see [`grpc_code`]).
const GRPC_CODES: [&str; 7] =
    ["OK", "INVALID_ARGUMENT", "UNAUTHENTICATED", "UNIMPLEMENTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "OTHER"];

/// The gRPC codes an RLQS stream ends with, as labels.
const RLQS_CODES: [&str; 10] = [
    "OK",
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "RESOURCE_EXHAUSTED",
    "OUT_OF_RANGE",
    "UNAUTHENTICATED",
    "UNIMPLEMENTED",
    "UNAVAILABLE",
    "DEADLINE_EXCEEDED",
    "OTHER",
];

/// What a decision per descriptor can come to.
const DECISION_RESULTS: [&str; 5] = ["allowed", "denied", "shadow_denied", "unlimited", "no_rule"];

/// The label of a gRPC status code: its canonical name, or `OTHER` for one
/// the service does not answer on its own (a transport's).
pub fn grpc_code(code: tonic::Code) -> &'static str {
    match code {
        tonic::Code::Ok => "OK",
        tonic::Code::InvalidArgument => "INVALID_ARGUMENT",
        tonic::Code::Unauthenticated => "UNAUTHENTICATED",
        tonic::Code::Unimplemented => "UNIMPLEMENTED",
        tonic::Code::Unavailable => "UNAVAILABLE",
        tonic::Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        _ => "OTHER",
    }
}

/// The label of the gRPC code an RLQS stream ended with: [`grpc_code`]'s,
/// and the codes only streams end with.
pub fn rlqs_code(code: tonic::Code) -> &'static str {
    match code {
        tonic::Code::NotFound => "NOT_FOUND",
        tonic::Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        tonic::Code::OutOfRange => "OUT_OF_RANGE",
        code => grpc_code(code),
    }
}

/// Every metric the service exports.
#[derive(Debug, Clone)]
pub struct ServiceMetrics {
    registry: Registry,
    /// API calls by endpoint and HTTP status.
    pub requests: IntCounterVec,
    /// Decisions per descriptor by domain, kind (check, lease) and result
    /// (allowed, denied, shadow_denied, unlimited, no_rule).
    pub decisions: IntCounterVec,
    /// Tokens granted by leases, by domain.
    pub tokens_granted: IntCounterVec,
    /// Tokens given back, by domain.
    pub tokens_returned: IntCounterVec,
    /// Store failures by store and kind (timeout, unavailable, full).
    pub store_errors: IntCounterVec,
    /// Store call latency by store and operation.
    pub store_latency: HistogramVec,
    /// Config reloads by result (ok, error, refused: it would drop limits).
    pub reloads: IntCounterVec,
    /// RLQS streams open now.
    pub rlqs_streams: IntGauge,
    /// RLQS buckets the open streams hold now.
    pub rlqs_buckets: IntGauge,
    /// RLQS bucket usage reports by domain.
    pub rlqs_reports: IntCounterVec,
    /// RLQS assignments sent, by domain and kind (token_bucket, allow_all,
    /// deny_all, abandon).
    pub rlqs_assignments: IntCounterVec,
}

impl ServiceMetrics {
    /// Registers every metric in a fresh registry.
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new_custom(Some("floodgate_quota".into()), None)?;
        let counter = |name: &str, help: &str, labels: &[&str]| -> Result<IntCounterVec, prometheus::Error> {
            let c = IntCounterVec::new(Opts::new(name, help), labels)?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let requests = counter("requests_total", "API calls by endpoint and HTTP status.", &["endpoint", "status"])?;
        let decisions = counter(
            "decisions_total",
            "Decisions per descriptor by domain, kind and result.",
            &["domain", "kind", "result"],
        )?;
        let tokens_granted = counter("tokens_granted_total", "Tokens granted by leases.", &["domain"])?;
        let tokens_returned = counter("tokens_returned_total", "Leased tokens given back.", &["domain"])?;
        let store_errors = counter("store_errors_total", "Store failures by store and kind.", &["store", "kind"])?;
        let reloads = counter("config_reloads_total", "Config reloads by result.", &["result"])?;
        let store_latency = HistogramVec::new(
            HistogramOpts::new("store_latency_seconds", "Store call latency by store and operation.").buckets(vec![
                0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
            ]),
            &["store", "op"],
        )?;
        registry.register(Box::new(store_latency.clone()))?;
        let gauge = |name: &str, help: &str| -> Result<IntGauge, prometheus::Error> {
            let g = IntGauge::new(name, help)?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let rlqs_streams = gauge("rlqs_streams", "RLQS streams open now.")?;
        let rlqs_buckets = gauge("rlqs_buckets", "RLQS buckets the open streams hold now.")?;
        let rlqs_reports = counter("rlqs_reports_total", "RLQS bucket usage reports by domain.", &["domain"])?;
        let rlqs_assignments =
            counter("rlqs_assignments_total", "RLQS assignments sent by domain and kind.", &["domain", "kind"])?;
        Ok(Self {
            registry,
            requests,
            decisions,
            tokens_granted,
            tokens_returned,
            store_errors,
            store_latency,
            reloads,
            rlqs_streams,
            rlqs_buckets,
            rlqs_reports,
            rlqs_assignments,
        })
    }

    /// Creates every series of the API and of `store` at 0 (what it can fail
    /// with: `failures`), so that a first scrape finds them and an alert on
    /// a rate or an absent series works from a restart on.
    pub fn start(&self, store: &str, failures: &[&str]) {
        for endpoint in ["check", "lease", "return"] {
            for status in HTTP_STATUSES {
                self.requests.with_label_values(&[endpoint, status]);
            }
        }
        for code in GRPC_CODES {
            self.requests.with_label_values(&["rls", code]);
        }
        for code in RLQS_CODES {
            self.requests.with_label_values(&["rlqs", code]);
        }
        for kind in failures {
            self.store_errors.with_label_values(&[store, kind]);
        }
        for op in ["check", "lease", "return"] {
            self.store_latency.with_label_values(&[store, op]);
        }
        for result in ["ok", "error", "refused"] {
            self.reloads.with_label_values(&[result]);
        }
    }

    /// Creates every series of `domain` at 0 (on start, and when a reload
    /// adds a domain).
    pub fn add_domain(&self, domain: &str) {
        for kind in ["check", "lease"] {
            for result in DECISION_RESULTS {
                self.decisions.with_label_values(&[domain, kind, result]);
            }
        }
        self.tokens_granted.with_label_values(&[domain]);
        self.tokens_returned.with_label_values(&[domain]);
        self.rlqs_reports.with_label_values(&[domain]);
        for kind in Assignment::KINDS {
            self.rlqs_assignments.with_label_values(&[domain, kind]);
        }
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        // Encoding into a Vec cannot fail for I/O; a metric that cannot be
        // encoded is dropped rather than failing the scrape.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}
