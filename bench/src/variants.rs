//! The variants: one row per Envoy set-up the bench can measure, with
//! everything the harness needs to know about it. The rest of the harness
//! reads these fields and never tests a variant's id.

use crate::filters::{EnvoyBucket, Filters, Module};
use crate::targets::{Bound, Measure, ReportTable, RoundFigure, Target};

/// The API keys wrk and the latency client cycle through, and how many the
/// many-keys variants use.
pub const KEYS: u32 = 16;
pub const MANY_KEYS: u32 = 1000;
/// The long tail: wrk's throughput spread over these keys gives each about one
/// or two requests a second.
pub const LONG_TAIL_KEYS: u32 = 10_000;

/// Seconds of load before each round of the long-tail rows: a pool asks for
/// an allowance once its rate is a second old, so each key needs a few of
/// its requests (one or two a second) before the pools are as they are at
/// steady load.
pub const LONG_TAIL_REWARM: u64 = 5;

/// Calls per request of each host-call probe variant.
pub const PROBE_REPEATS: u32 = 10;

/// The lease lifetime of the long-lease service instance: its `--lease-ttl`
/// and the rule's `lease_horizon` of the variant asking it.
pub const LONG_LEASE: &str = "10s";

/// The ports of the processes some variants need, known once they run; 0
/// when no selected variant needs them.
#[derive(Clone, Copy, Debug, Default)]
pub struct Ports {
    /// The upstream Envoy of the proxied variants.
    pub upstream: u16,
    /// floodgate-quota's gRPC API.
    pub grpc: u16,
    /// floodgate-quota's HTTP API.
    pub quota_http: u16,
    /// The HTTP API of the instance with [`LONG_LEASE`] leases.
    pub long_lease_http: u16,
}

/// Which floodgate-quota instance a variant's Envoy asks, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuotaBackend {
    /// None.
    None,
    /// Envoy's own `ratelimit` filter asks the shared instance's gRPC API.
    Rls,
    /// Floodgate's global rules ask the shared instance's HTTP API.
    Leases,
    /// Floodgate's global rules ask the instance with [`LONG_LEASE`] leases.
    LongLeases,
}

impl QuotaBackend {
    /// Whether the variant's callouts are counted (Floodgate's global mode).
    pub fn counts_callouts(self) -> bool {
        matches!(self, QuotaBackend::Leases | QuotaBackend::LongLeases)
    }
}

/// One variant of the bench.
#[derive(Clone, Copy, Debug)]
pub struct Variant {
    /// A short id, as `BENCH_VARIANTS` names it and the tables show it.
    pub id: &'static str,
    /// What it is, for the tables.
    pub label: &'static str,
    /// Its HTTP filters (and the clusters they need), given the ports.
    pub filters: fn(&Ports) -> Filters,
    /// The API keys the load cycles through.
    pub keys: u32,
    /// Whether its route proxies to the upstream Envoy.
    pub proxied: bool,
    /// The floodgate-quota instance it asks.
    pub service: QuotaBackend,
    /// Whether it is meant to answer most requests with a 429.
    pub limits: bool,
    /// The variant it is measured against (the `÷ reference` figures): a
    /// global rule's local counterpart (same keys and rule shape), the no-op
    /// filter for Floodgate's local variants and the probes, Envoy without a
    /// filter for the no-op filter, a proxied path's ceiling.
    pub reference: Option<&'static str>,
    /// The tables that show every variant's req/s as a ratio to this one.
    pub column_of: &'static [ReportTable],
    /// Whether it is a host-call probe (the probe module; cost per call reported).
    pub probe: bool,
    /// Whether it is in the latency part.
    pub latency: bool,
    /// Whether it runs when `BENCH_VARIANTS` is not set.
    pub default: bool,
    /// Seconds of the same load right before each measured round: for rows
    /// whose steady state is state of their own that the other rows' turns
    /// let lapse (the long tail's pools and allowances, after the minute
    /// or more the other rows take).
    pub rewarm: u64,
    /// The issues' targets on it.
    pub targets: &'static [Target],
}

/// The fields most rows share: a direct response, 16 keys, no service, not
/// limiting, no reference, opt-in.
const ROW: Variant = Variant {
    id: "",
    label: "",
    filters: |_| Filters::None,
    keys: KEYS,
    proxied: false,
    service: QuotaBackend::None,
    limits: false,
    reference: None,
    column_of: &[],
    probe: false,
    latency: false,
    default: false,
    rewarm: 0,
    targets: &[],
};

const fn throughput_ratio(issue: u32, against: &'static str, bound: Bound) -> Target {
    Target::new(issue, Measure::Ratio { metric: RoundFigure::Rps, against }, bound)
}

const fn p99_ratio(issue: u32, against: &'static str, bound: Bound) -> Target {
    Target::new(issue, Measure::Ratio { metric: RoundFigure::P99, against }, bound)
}

/// The lease-mode targets at steady load: callouts per request (leases exist
/// to keep the service off the request path).
const LEASE_CALLOUTS: Target = Target::new(7, Measure::Value(RoundFigure::CalloutsSteady), Bound::AtMost(0.02));

/// A target measured with per-second windows.
const fn per_second(target: Target) -> Target {
    Target { quota_unit: Some("second"), ..target }
}

/// The targets of a long-tail lease variant: against the local reference (dt)
/// and the check-mode variant (gct), and what it asked the service for at
/// steady load. `quota_unit`: the `BENCH_QUOTA_UNIT` its windows follow, if
/// they do.
const fn long_tail(quota_unit: Option<&'static str>) -> [Target; 5] {
    [
        Target { quota_unit, ..throughput_ratio(21, "dt", Bound::AtLeast(0.85)) },
        Target { quota_unit, ..throughput_ratio(21, "gct", Bound::AtLeast(1.5)) },
        Target { quota_unit, ..Target::new(21, Measure::Value(RoundFigure::CalloutsSteady), Bound::AtMost(0.02)) },
        Target { quota_unit, ..Target::new(21, Measure::Value(RoundFigure::WaitedSteady), Bound::AtMost(0.005)) },
        Target { quota_unit, ..p99_ratio(21, "dt", Bound::AtMost(1.5)) },
    ]
}

/// Every variant, in the order they run each round: the local references and
/// Floodgate's local mode (a)–(f), Envoy's global filter against the quota
/// service with its ceiling, Floodgate's global mode with its local
/// references, then opt-in diagnostics.
pub static VARIANTS: &[Variant] = &[
    Variant {
        id: "a",
        label: "no rate-limit filter",
        column_of: &[ReportTable::Throughput, ReportTable::Global],
        default: true,
        ..ROW
    },
    Variant {
        id: "b",
        label: "Envoy local_ratelimit, per key, never limits",
        filters: |_| {
            Filters::EnvoyLocal(EnvoyBucket {
                max_tokens: 1_000_000_000,
                tokens_per_fill: 1_000_000_000,
                fill_interval: "1s",
            })
        },
        column_of: &[ReportTable::Throughput],
        default: true,
        ..ROW
    },
    Variant {
        id: "c",
        label: "no-op wasm filter",
        filters: |_| Filters::Noop(Module::Wasm),
        reference: Some("a"),
        default: true,
        ..ROW
    },
    // The native build's floor: a dynamic module that does nothing.
    Variant {
        id: "nc",
        label: "no-op native filter (dynamic module)",
        filters: |_| Filters::Noop(Module::Native),
        reference: Some("a"),
        default: true,
        ..ROW
    },
    Variant {
        id: "d",
        label: "Floodgate, per key, never limits",
        filters: |_| floodgate(&format!(r#"{{"rules": [{}]}}"#, per_key_rule())),
        reference: Some("c"),
        column_of: &[ReportTable::Global],
        default: true,
        targets: &[throughput_ratio(14, "c", Bound::AtLeast(0.90)), p99_ratio(14, "c", Bound::AtMost(1.20))],
        ..ROW
    },
    // (d) in the native build, beside Envoy's own per-descriptor limiter (b)
    // and the wasm build (d) on the same key and load.
    Variant {
        id: "nd",
        label: "Floodgate native, per key, never limits",
        filters: |_| native(&format!(r#"{{"rules": [{}]}}"#, per_key_rule())),
        reference: Some("nc"),
        default: true,
        targets: &[throughput_ratio(33, "b", Bound::AtLeast(1.0)), throughput_ratio(33, "d", Bound::AtLeast(1.3))],
        ..ROW
    },
    Variant {
        id: "nd2",
        label: "Floodgate native as (nd), no headers on allowed",
        filters: |_| {
            native(&format!(r#"{{"rules": [{}], "response": {{"headers_on_allowed": false}}}}"#, per_key_rule()))
        },
        reference: Some("b"),
        ..ROW
    },
    Variant {
        id: "d2",
        label: "Floodgate as (d), no headers on allowed",
        filters: |_| {
            floodgate(&format!(r#"{{"rules": [{}], "response": {{"headers_on_allowed": false}}}}"#, per_key_rule()))
        },
        reference: Some("c"),
        default: true,
        ..ROW
    },
    Variant {
        id: "e",
        label: "Floodgate, per key, limits most (10/s per key)",
        filters: |_| {
            floodgate(&format!(
                r#"{{"rules": [{{"name": "per-api-key", "descriptors": {PER_KEY}, "limit": 10, "period": "1s"}}]}}"#
            ))
        },
        limits: true,
        reference: Some("c"),
        default: true,
        targets: &[throughput_ratio(14, "c", Bound::AtLeast(0.90))],
        ..ROW
    },
    Variant {
        id: "f",
        label: "Floodgate, three rules on each request",
        filters: |_| {
            floodgate(&format!(
                r#"{{"rules": [{}, {}, {}]}}"#,
                per_key_rule(),
                never_limiting_rule("per-key-and-path", PER_KEY_AND_PATH),
                never_limiting_rule("whole-site", WHOLE_SITE),
            ))
        },
        reference: Some("c"),
        default: true,
        targets: &[throughput_ratio(14, "c", Bound::AtLeast(0.80))],
        ..ROW
    },
    // The opt-in per-worker batches on one hot key.
    Variant {
        id: "db",
        label: "Floodgate, per key, per-worker batches of 16, one hot key",
        filters: |_| {
            floodgate(&format!(
                r#"{{"rules": [{{"name": "per-api-key", "descriptors": {PER_KEY}, "limit": 1000000000, "period": "1s",
                     "worker_batch": 16}}]}}"#
            ))
        },
        keys: 1,
        reference: Some("c"),
        default: true,
        targets: &[throughput_ratio(14, "c", Bound::AtLeast(0.95))],
        ..ROW
    },
    // Envoy's own global rate limit filter, a gRPC call to floodgate-quota
    // (memory store) per request, and its ceiling: both proxy to an upstream
    // Envoy, as the filter needs a route entry.
    Variant {
        id: "u",
        label: "no filter, proxied to an upstream Envoy",
        filters: |p| Filters::Routed { upstream: p.upstream },
        proxied: true,
        latency: true,
        default: true,
        ..ROW
    },
    Variant {
        id: "r",
        label: "Envoy global ratelimit → floodgate-quota gRPC, per key, never limits",
        filters: |p| Filters::EnvoyGlobal { upstream: p.upstream, grpc: p.grpc, headers: false },
        proxied: true,
        service: QuotaBackend::Rls,
        reference: Some("u"),
        latency: true,
        default: true,
        ..ROW
    },
    // (r) with the `x-ratelimit-*` headers Floodgate adds by default: the
    // reference that does (gcu)'s response work.
    Variant {
        id: "rh",
        label: "as r, with enable_x_ratelimit_headers (DRAFT_VERSION_03)",
        filters: |p| Filters::EnvoyGlobal { upstream: p.upstream, grpc: p.grpc, headers: true },
        proxied: true,
        service: QuotaBackend::Rls,
        reference: Some("u"),
        latency: false,
        ..ROW
    },
    // Check mode on (r)'s path: per key, proxied to the upstream Envoy,
    // asking the same service process. (gc) answers directly, so its
    // ratio to (r) also carries the upstream hop's cost; this one does not.
    Variant {
        id: "gcu",
        label: "Floodgate global, check mode, per key, proxied to an upstream Envoy",
        filters: |p| per_key_check_proxied(Module::Wasm, p),
        proxied: true,
        service: QuotaBackend::Leases,
        reference: Some("r"),
        latency: true,
        default: true,
        targets: &[throughput_ratio(31, "r", Bound::AtLeast(0.9)), throughput_ratio(31, "rh", Bound::AtLeast(0.9))],
        ..ROW
    },
    // (gcu) in the native build: what the wasm floor costs check mode.
    Variant {
        id: "ngcu",
        label: "Floodgate native global, check mode, per key, proxied to an upstream Envoy",
        filters: |p| per_key_check_proxied(Module::Native, p),
        proxied: true,
        service: QuotaBackend::Leases,
        reference: Some("r"),
        latency: true,
        default: true,
        ..ROW
    },
    // (gcu) answering as (r) does: Envoy's `ratelimit` sends no rate-limit
    // headers unless `enable_x_ratelimit_headers` is set, so this row does
    // (r)'s work and no more; (gcu) keeps Floodgate's default.
    Variant {
        id: "gcuq",
        label: "Floodgate global, check mode, per key, proxied, no headers on allowed responses as (r)",
        filters: |p| quiet(per_key_check_proxied(Module::Wasm, p)),
        proxied: true,
        service: QuotaBackend::Leases,
        reference: Some("r"),
        latency: false,
        ..ROW
    },
    // Floodgate's global mode against floodgate-quota's HTTP API (the process
    // of (r)), the limit in the service's limits file far above the load: the
    // cost of global decisions, not of limiting. Each beside its local
    // reference: (dk) for (gk), (dt) for (gt), (gtm) and (gct), (i) for (gl),
    // (gc).
    Variant {
        id: "dk",
        label: "Floodgate local as (d), 1000 keys",
        filters: |_| floodgate(&format!(r#"{{"rules": [{}]}}"#, per_key_rule())),
        keys: MANY_KEYS,
        default: true,
        ..ROW
    },
    Variant {
        id: "gk",
        label: "Floodgate global, lease, per key (1000 keys)",
        filters: |p| global_rule(Module::Wasm, p.quota_http, "per-api-key", "lease", PER_KEY, ""),
        keys: MANY_KEYS,
        service: QuotaBackend::Leases,
        reference: Some("dk"),
        default: true,
        targets: &[
            per_second(throughput_ratio(15, "dk", Bound::AtLeast(0.90))),
            per_second(Target { issue: 15, ..LEASE_CALLOUTS }),
            per_second(Target::new(15, Measure::Value(RoundFigure::WaitedSteady), Bound::AtMost(0.005))),
            per_second(p99_ratio(15, "dk", Bound::AtMost(1.5))),
        ],
        ..ROW
    },
    // The long tail: 10,000 keys, each asked for once or twice a second,
    // beside their local reference (dt); the lease variants also against check
    // mode (gct), which asks the service on every request. (gt) and (gct) use
    // the service's `api_key` entry, fixed windows of `BENCH_QUOTA_UNIT` (a
    // second by default), as (gk); (gtm) its per-minute entry.
    Variant {
        id: "dt",
        label: "Floodgate local, 10,000 keys",
        filters: |_| floodgate(&format!(r#"{{"rules": [{}]}}"#, per_key_rule())),
        keys: LONG_TAIL_KEYS,
        default: true,
        rewarm: LONG_TAIL_REWARM,
        ..ROW
    },
    Variant {
        id: "gt",
        label: "Floodgate global, lease, 10,000 keys, per-second windows",
        filters: |p| global_rule(Module::Wasm, p.quota_http, "per-api-key", "lease", PER_KEY, ""),
        keys: LONG_TAIL_KEYS,
        service: QuotaBackend::Leases,
        reference: Some("dt"),
        default: true,
        targets: &long_tail(Some("second")),
        rewarm: LONG_TAIL_REWARM,
        ..ROW
    },
    Variant {
        id: "gtm",
        label: "Floodgate global, lease, 10,000 keys, per-minute windows",
        filters: |p| global_rule(Module::Wasm, p.quota_http, "per-api-key-minute", "lease", &per_minute_key(), ""),
        keys: LONG_TAIL_KEYS,
        service: QuotaBackend::Leases,
        reference: Some("dt"),
        default: true,
        targets: &long_tail(None),
        rewarm: LONG_TAIL_REWARM,
        ..ROW
    },
    Variant {
        id: "gct",
        label: "Floodgate global, check mode, 10,000 keys, per-second windows",
        filters: |p| global_rule(Module::Wasm, p.quota_http, "per-api-key", "check", PER_KEY, ""),
        keys: LONG_TAIL_KEYS,
        service: QuotaBackend::Leases,
        reference: Some("dt"),
        default: true,
        rewarm: LONG_TAIL_REWARM,
        ..ROW
    },
    // (i): one bucket for everything: both workers on one shared-data key
    // (host mutex, compare-and-swap conflicts).
    Variant {
        id: "i",
        label: "Floodgate, one global bucket (hot key)",
        filters: |_| floodgate(&format!(r#"{{"rules": [{}]}}"#, never_limiting_rule("whole-site", WHOLE_SITE))),
        latency: true,
        default: true,
        ..ROW
    },
    Variant {
        id: "gl",
        label: "Floodgate global, lease, one hot key",
        filters: |p| global_rule(Module::Wasm, p.quota_http, "whole-site", "lease", &hot_key(), ""),
        service: QuotaBackend::Leases,
        reference: Some("i"),
        latency: true,
        default: true,
        targets: &[throughput_ratio(15, "i", Bound::AtLeast(0.95)), LEASE_CALLOUTS],
        ..ROW
    },
    Variant {
        id: "gc",
        label: "Floodgate global, check mode, one hot key",
        filters: |p| global_rule(Module::Wasm, p.quota_http, "whole-site", "check", &hot_key(), ""),
        service: QuotaBackend::Leases,
        reference: Some("i"),
        latency: true,
        default: true,
        targets: &[
            // (gc) answers directly, (r) proxies: each against its own ceiling.
            Target::new(
                15,
                Measure::OverCeilings { ceiling: "a", other: "r", other_ceiling: "u" },
                Bound::AtLeast(1.0),
            ),
            Target::new(15, Measure::Ratio { metric: RoundFigure::LatencyP50, against: "r" }, Bound::AtMost(1.2)),
        ],
        ..ROW
    },
    // The native build's global mode on the hot key, beside (gl) and (gc),
    // with its own local reference (ni), as (i) is theirs.
    Variant {
        id: "ni",
        label: "Floodgate native, one global bucket (hot key)",
        filters: |_| native(&format!(r#"{{"rules": [{}]}}"#, never_limiting_rule("whole-site", WHOLE_SITE))),
        latency: true,
        default: true,
        ..ROW
    },
    Variant {
        id: "ngl",
        label: "Floodgate native global, lease, one hot key",
        filters: |p| global_rule(Module::Native, p.quota_http, "whole-site", "lease", &hot_key(), ""),
        service: QuotaBackend::Leases,
        reference: Some("ni"),
        latency: true,
        default: true,
        targets: &[LEASE_CALLOUTS],
        ..ROW
    },
    Variant {
        id: "ngc",
        label: "Floodgate native global, check mode, one hot key",
        filters: |p| global_rule(Module::Native, p.quota_http, "whole-site", "check", &hot_key(), ""),
        service: QuotaBackend::Leases,
        reference: Some("ni"),
        latency: true,
        default: true,
        ..ROW
    },
    // Diagnostics. (g): the filter runs but no rule applies — no header
    // read, no hashing, no shared data, one counter: the fixed cost.
    Variant {
        id: "g",
        label: "Floodgate, rule never applies (fixed cost)",
        filters: |_| {
            floodgate(&format!(
                r#"{{"rules": [{{"name": "per-api-key", "match": {{"path_exact": "/never"}}, "descriptors": {PER_KEY},
                     "limit": 1000000000, "period": "1s"}}]}}"#
            ))
        },
        reference: Some("c"),
        ..ROW
    },
    // (h): as (d2) and no rate-limit headers at all (none on 429s either).
    Variant {
        id: "h",
        label: "Floodgate as (d), headers none",
        filters: |_| floodgate(&format!(r#"{{"rules": [{}], "response": {{"headers": "none"}}}}"#, per_key_rule())),
        reference: Some("c"),
        ..ROW
    },
    // Host-call probes: each repeats one call PROBE_REPEATS times per
    // request; (probe − c) / PROBE_REPEATS is that call's cost.
    Variant { id: "pt", label: "probe: 10 × get_current_time", filters: |_| probe("time"), ..PROBE },
    Variant { id: "ph", label: "probe: 10 × get request header", filters: |_| probe("header"), ..PROBE },
    Variant { id: "pm", label: "probe: 10 × increment_metric", filters: |_| probe("metric"), ..PROBE },
    Variant { id: "pg", label: "probe: 10 × get_shared_data", filters: |_| probe("shared_get"), ..PROBE },
    Variant {
        id: "ps",
        label: "probe: 10 × get_shared_data + set_shared_data (cas)",
        filters: |_| probe("shared_cas"),
        ..PROBE
    },
    Variant { id: "pr", label: "probe: 10 × set response header", filters: |_| probe("response_header"), ..PROBE },
    // (gkt): as (gk) with leases living 10 s instead of 1 s (a second
    // service instance): how much of (gk)'s callouts the lifetime causes.
    Variant {
        id: "gkt",
        label: "Floodgate global as (gk), leases of 10 s",
        filters: |p| {
            global_rule(
                Module::Wasm,
                p.long_lease_http,
                "per-api-key",
                "lease",
                PER_KEY,
                &format!(r#", "lease_horizon": "{LONG_LEASE}""#),
            )
        },
        keys: MANY_KEYS,
        service: QuotaBackend::LongLeases,
        reference: Some("dk"),
        targets: &[throughput_ratio(7, "dk", Bound::AtLeast(0.95)), LEASE_CALLOUTS],
        ..ROW
    },
];

/// The descriptor entry (key, value) of the hot-key limit in the service's
/// limits file, which Floodgate's hot-key global rules send.
pub const HOT_KEY: (&str, &str) = ("route", "hot");

/// The descriptor key of the service's key-only per-minute entry (fixed
/// windows of a minute, 10⁹ each), which the per-minute global rules send.
pub const PER_MINUTE_KEY: &str = "api_key_m";

/// The fields of the host-call probes.
const PROBE: Variant = Variant { probe: true, reference: Some("c"), ..ROW };

/// The ids that run when `BENCH_VARIANTS` is not set, comma-separated.
pub fn default_ids() -> String {
    VARIANTS.iter().filter(|v| v.default).map(|v| v.id).collect::<Vec<_>>().join(",")
}

/// The per-key descriptor every per-key Floodgate rule here uses, like
/// Envoy's `request_headers` action of variant (b).
pub const PER_KEY: &str = r#"[{"request_headers": {"header_name": "x-api-key", "descriptor_key": "api_key"}}]"#;

/// Key and path: a second per-client rule for variant (f).
const PER_KEY_AND_PATH: &str = r#"[{"request_headers": {"header_name": "x-api-key", "descriptor_key": "api_key"}},
    {"request_headers": {"header_name": ":path", "descriptor_key": "path"}}]"#;

/// One bucket for every request.
const WHOLE_SITE: &str = r#"[{"generic_key": {"descriptor_value": "all"}}]"#;

/// A Floodgate rule that never limits: 10⁹ per second, burst 10⁹.
fn never_limiting_rule(name: &str, descriptors: &str) -> String {
    format!(r#"{{"name": "{name}", "descriptors": {descriptors}, "limit": 1000000000, "period": "1s"}}"#)
}

/// The never-limiting per-key rule of (d).
fn per_key_rule() -> String {
    never_limiting_rule("per-api-key", PER_KEY)
}

/// The per-key descriptor of the per-minute global rule: the same header,
/// sent as the service's [`PER_MINUTE_KEY`] entry.
fn per_minute_key() -> String {
    format!(r#"[{{"request_headers": {{"header_name": "x-api-key", "descriptor_key": "{PER_MINUTE_KEY}"}}}}]"#)
}

/// The service's hot key as a `generic_key` descriptor.
fn hot_key() -> String {
    format!(r#"[{{"generic_key": {{"descriptor_key": "{}", "descriptor_value": "{}"}}}}]"#, HOT_KEY.0, HOT_KEY.1)
}

/// The wasm build with this plugin configuration.
fn floodgate(config: &str) -> Filters {
    Filters::Floodgate(Module::Wasm, config.to_string())
}

/// The native build with this plugin configuration.
fn native(config: &str) -> Filters {
    Filters::Floodgate(Module::Native, config.to_string())
}

fn probe(call: &str) -> Filters {
    Filters::Probe(format!("{call}={PROBE_REPEATS}"))
}

/// A Floodgate global rule named `name` in `mode`, in build `module`,
/// asking floodgate-quota on `quota` (domain `bench`, default timeouts,
/// plus `global_extra` fields of the `global` section). Its limit is the
/// service's; with fallback `deny`, a decision the service could not make
/// shows as a 429.
fn global_rule(module: Module, quota: u16, name: &str, mode: &str, descriptors: &str, global_extra: &str) -> Filters {
    Filters::FloodgateGlobal {
        module,
        config: format!(
            r#"{{"rules": [{{"name": "{name}", "scope": "global", "mode": "{mode}", "fallback": "deny",
                 "descriptors": {descriptors}}}],
               "global": {{"cluster": "floodgate-quota", "domain": "bench"{global_extra}}}}}"#
        ),
        quota,
        upstream: None,
    }
}

/// A check-mode rule per `x-api-key` value in build `module`, proxied to
/// the upstream Envoy as (r) is: (r)'s path with Floodgate in place of
/// Envoy's `ratelimit` filter.
fn per_key_check_proxied(module: Module, p: &Ports) -> Filters {
    let per_key = r#"[{"request_headers": {"header_name": "x-api-key", "descriptor_key": "api_key"}}]"#;
    match global_rule(module, p.quota_http, "per-key", "check", per_key, "") {
        Filters::FloodgateGlobal { module, config, quota, .. } => {
            Filters::FloodgateGlobal { module, config, quota, upstream: Some(p.upstream) }
        }
        other => other,
    }
}

/// Floodgate's `filters` with no rate-limit headers on allowed responses.
fn quiet(filters: Filters) -> Filters {
    match filters {
        Filters::FloodgateGlobal { module, config, quota, upstream } => {
            let mut config: serde_json::Value = serde_json::from_str(&config).expect("the bench's own configuration");
            config["response"] = serde_json::json!({"headers_on_allowed": false});
            Filters::FloodgateGlobal { module, config: config.to_string(), quota, upstream }
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use floodgate_core::config::Config;

    use super::*;

    fn find(id: &str) -> Option<&'static Variant> {
        VARIANTS.iter().find(|v| v.id == id)
    }

    #[test]
    fn ids_are_unique_and_every_id_a_row_names_is_a_row() {
        for (n, v) in VARIANTS.iter().enumerate() {
            assert!(VARIANTS[..n].iter().all(|w| w.id != v.id), "({}) twice", v.id);
            let named = v.targets.iter().flat_map(|t| match t.measure {
                Measure::Value(_) => vec![],
                Measure::Ratio { against, .. } => vec![against],
                Measure::OverCeilings { ceiling, other, other_ceiling } => vec![ceiling, other, other_ceiling],
            });
            for id in v.reference.into_iter().chain(named) {
                assert!(find(id).is_some(), "({}) names ({id}), which is no row", v.id);
            }
        }
    }

    #[test]
    fn the_default_list_is_the_one_make_bench_always_ran() {
        assert_eq!(default_ids(), "a,b,c,nc,d,nd,d2,e,f,db,u,r,gcu,ngcu,dk,gk,dt,gt,gtm,gct,i,gl,gc,ni,ngl,ngc");
    }

    #[test]
    fn the_per_minute_rule_sends_the_services_per_minute_entry() {
        let ports = Ports { upstream: 1, grpc: 2, quota_http: 3, long_lease_http: 4 };
        let gtm = find("gtm").unwrap();
        assert_eq!(gtm.service, QuotaBackend::Leases, "the instance of (gk)");
        match (gtm.filters)(&ports) {
            Filters::FloodgateGlobal { config, quota, .. } => {
                assert_eq!(quota, 3);
                assert!(config.contains(&format!(r#""descriptor_key": "{PER_MINUTE_KEY}""#)), "{config}");
            }
            _ => panic!("(gtm) is no global rule"),
        }
    }

    /// Every Floodgate variant's plugin configuration is one the filter
    /// accepts: its own parser, the one `on_configure` runs, not only JSON.
    #[test]
    fn every_configuration_is_json() {
        let ports = Ports { upstream: 1, grpc: 2, quota_http: 3, long_lease_http: 4 };
        let mut parsed = 0;
        for v in VARIANTS {
            if let Filters::Floodgate(_, config) | Filters::FloodgateGlobal { config, .. } = (v.filters)(&ports) {
                Config::parse(config.as_bytes()).unwrap_or_else(|e| panic!("({}): {e}: {config}", v.id));
                parsed += 1;
            }
        }
        assert!(parsed >= 10, "only {parsed} Floodgate variants");
    }
}
