//! The Envoys under test: one bootstrap per variant, built from the
//! harness's pieces (`floodgate_e2e::bootstrap`) — the same listener and
//! connection manager for every variant, a `direct_response` route unless
//! the variant proxies to an upstream; only the HTTP filters differ (and
//! which build of Floodgate, wasm or native, they load), and the clusters
//! they call.

use std::path::PathBuf;

use floodgate_e2e::bootstrap::{self, cluster, native_filter, route_to, wasm_filter, Bootstrap, Listener};
use floodgate_e2e::envoy::write_bootstrap;
use floodgate_e2e::{Build, Envoy, EnvoyOptions};
use serde_json::{json, Value};

/// Where the binaries and modules are.
#[derive(Clone, Debug)]
pub struct Paths {
    /// The Envoy binary.
    pub envoy: String,
    /// Floodgate's wasm module.
    pub floodgate_wasm: PathBuf,
    /// Floodgate's native module.
    pub floodgate_native: PathBuf,
    /// The no-op wasm module.
    pub noop_wasm: PathBuf,
    /// The no-op native module.
    pub noop_native: PathBuf,
    /// The host-call probe wasm module.
    pub probe_wasm: PathBuf,
    /// The floodgate-quota binary (for the global-filter and global-mode variants).
    pub quota_bin: PathBuf,
    /// A scratch directory for bootstraps and logs.
    pub scratch: PathBuf,
    /// The `unit` of the quota service's never-limiting fixed windows
    /// (`second`, `minute`, `hour`): a lease never outlives its window.
    pub quota_unit: String,
}

/// Which of Floodgate's builds a variant loads (and which no-op module).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Module {
    /// The proxy-wasm module.
    Wasm,
    /// The dynamic module.
    Native,
}

impl Paths {
    /// Floodgate's build `module`.
    pub fn floodgate(&self, module: Module) -> Build {
        match module {
            Module::Wasm => Build::Wasm { module: self.floodgate_wasm.clone() },
            Module::Native => Build::Native { module: self.floodgate_native.clone() },
        }
    }
}

/// A token bucket of Envoy's `local_ratelimit` (max tokens, tokens per fill, fill interval).
#[derive(Clone, Copy, Debug)]
pub struct EnvoyBucket {
    /// `max_tokens` (also the initial content).
    pub max_tokens: u32,
    /// `tokens_per_fill`.
    pub tokens_per_fill: u32,
    /// `fill_interval`, e.g. `"10s"`.
    pub fill_interval: &'static str,
}

/// The HTTP filters in front of the router.
#[derive(Clone, Debug)]
pub enum Filters {
    /// No filter but the router.
    None,
    /// Envoy's `local_ratelimit` with one dynamic bucket per `x-api-key` value.
    EnvoyLocal(EnvoyBucket),
    /// The no-op filter of this build: wasm (`noop-filter/`) or a dynamic
    /// module (`noop-native/`).
    Noop(Module),
    /// Floodgate's build `module` with this plugin configuration (JSON).
    Floodgate(Module, String),
    /// Floodgate in global mode: its build, this plugin configuration
    /// (JSON), and the cluster `floodgate-quota` its callouts go to,
    /// floodgate-quota's HTTP API on this loopback port.
    FloodgateGlobal {
        /// The build.
        module: Module,
        /// The plugin configuration.
        config: String,
        /// floodgate-quota's `--listen` port.
        quota: u16,
        /// Proxied to the upstream on this port, as [`Filters::EnvoyGlobal`]
        /// is (`None`: a `direct_response`).
        upstream: Option<u16>,
    },
    /// The host-call probe with this configuration (`<call>=<repeats>`).
    Probe(String),
    /// No filter, but proxied to an upstream (another Envoy's
    /// `direct_response`) on this loopback port: the ceiling of [`Filters::EnvoyGlobal`].
    Routed {
        /// The upstream's port.
        upstream: u16,
    },
    /// Envoy's global `ratelimit` filter, one descriptor per `x-api-key`
    /// value, asking floodgate-quota's gRPC API; proxied like [`Filters::Routed`]
    /// because the filter only acts on routes with a route entry.
    EnvoyGlobal {
        /// The upstream's port.
        upstream: u16,
        /// floodgate-quota's `--grpc-listen` port.
        grpc: u16,
        /// `enable_x_ratelimit_headers: DRAFT_VERSION_03`: the service's
        /// limit, remaining and reset as `x-ratelimit-*` headers on every
        /// response, as Floodgate adds its own by default.
        headers: bool,
    },
}

/// Envoy's `request_headers` action keying a descriptor `api_key` on the
/// `x-api-key` header.
fn per_key_action() -> Value {
    json!({"actions": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "api_key"}}]})
}

impl Filters {
    /// The `http_filters` entries before the router.
    fn http_filters(&self, paths: &Paths) -> Vec<Value> {
        match self {
            Filters::None | Filters::Routed { .. } => Vec::new(),
            // A descriptor entry with an empty value is a wildcard: each
            // distinct `api_key` value gets its own bucket (Envoy's "dynamic
            // descriptors", kept in an LRU of `max_dynamic_descriptors`). The
            // descriptor comes from the filter-level `rate_limits`, so no route
            // configuration is needed. `always_consume_default_token_bucket:
            // false` keeps the (never-limiting) default bucket out of requests
            // a descriptor matched, so only the per-key bucket decides.
            Filters::EnvoyLocal(b) => vec![json!({
                "name": "envoy.filters.http.local_ratelimit",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
                    "stat_prefix": "per_api_key",
                    "token_bucket": {"max_tokens": 1_000_000_000, "tokens_per_fill": 1_000_000_000, "fill_interval": "1s"},
                    "filter_enabled": {"default_value": {"numerator": 100, "denominator": "HUNDRED"}},
                    "filter_enforced": {"default_value": {"numerator": 100, "denominator": "HUNDRED"}},
                    "always_consume_default_token_bucket": false,
                    "max_dynamic_descriptors": 65536,
                    "rate_limits": [per_key_action()],
                    "descriptors": [{
                        "entries": [{"key": "api_key", "value": ""}],
                        "token_bucket": {
                            "max_tokens": b.max_tokens,
                            "tokens_per_fill": b.tokens_per_fill,
                            "fill_interval": b.fill_interval,
                        },
                    }],
                },
            })],
            // failure_mode_deny: an unanswered call shows as a 500 (a
            // non-2xx in the table) rather than as a cheap pass.
            Filters::EnvoyGlobal { headers, .. } => {
                let mut config = json!({
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
                    "domain": "bench",
                    "timeout": "1s",
                    "failure_mode_deny": true,
                    "rate_limit_service": {
                        "transport_api_version": "V3",
                        "grpc_service": {"envoy_grpc": {"cluster_name": "floodgate_quota"}},
                    },
                });
                if *headers {
                    config["enable_x_ratelimit_headers"] = json!("DRAFT_VERSION_03");
                }
                vec![json!({"name": "envoy.filters.http.ratelimit", "typed_config": config})]
            }
            Filters::Noop(Module::Wasm) => vec![wasm_filter("noop", &paths.noop_wasm, "{}")],
            Filters::Noop(Module::Native) => vec![native_filter("noop", &paths.noop_native, "{}")],
            Filters::Floodgate(module, config) | Filters::FloodgateGlobal { module, config, .. } => {
                vec![paths.floodgate(*module).http_filter(config)]
            }
            Filters::Probe(config) => vec![wasm_filter("probe", &paths.probe_wasm, config)],
        }
    }

    /// The build (wasm or native) of the Floodgate or no-op filter it loads, if any.
    pub fn module(&self) -> Option<Module> {
        match self {
            Filters::Noop(module) | Filters::Floodgate(module, _) | Filters::FloodgateGlobal { module, .. } => {
                Some(*module)
            }
            _ => None,
        }
    }

    /// The build of Floodgate it loads, if it loads one.
    pub fn floodgate(&self, paths: &Paths) -> Option<Build> {
        match self {
            Filters::Floodgate(module, _) | Filters::FloodgateGlobal { module, .. } => Some(paths.floodgate(*module)),
            _ => None,
        }
    }

    /// The static clusters the variant needs.
    fn clusters(&self) -> Vec<Value> {
        match self {
            Filters::Routed { upstream } => vec![cluster("upstream", &[*upstream], "1s", false)],
            Filters::EnvoyGlobal { upstream, grpc, .. } => {
                vec![cluster("upstream", &[*upstream], "1s", false), cluster("floodgate_quota", &[*grpc], "1s", true)]
            }
            // The filter's callouts are HTTP/1.1, as in the end-to-end tests.
            Filters::FloodgateGlobal { quota, upstream, .. } => {
                let mut clusters = vec![cluster("floodgate-quota", &[*quota], "1s", false)];
                clusters.extend(upstream.map(|port| cluster("upstream", &[port], "1s", false)));
                clusters
            }
            _ => Vec::new(),
        }
    }
}

/// A complete bootstrap: the same listener and connection manager for
/// every variant, with a `direct_response` route unless the variant proxies
/// to the upstream (with the per-key rate limit action for Envoy's global
/// filter); only `filters` differ.
pub fn bootstrap(filters: &Filters, paths: &Paths, port: u16, admin_port: u16) -> Value {
    let mut listener = Listener::new("bench", port, "bench");
    listener.manager.insert("use_remote_address".into(), json!(true));
    listener.http_filters = filters.http_filters(paths);
    match filters {
        Filters::Routed { .. } | Filters::FloodgateGlobal { upstream: Some(_), .. } => {
            listener.routes = vec![route_to("upstream")]
        }
        Filters::EnvoyGlobal { .. } => {
            listener.routes = vec![route_to("upstream")];
            listener.rate_limits = vec![per_key_action()];
        }
        _ => listener.routes = vec![bootstrap::direct_response_route()],
    }
    Bootstrap { node: None, listeners: vec![listener], clusters: filters.clusters(), lds_file: None, admin_port }
        .to_json()
}

/// Writes the variant's bootstrap, checks it with `envoy --mode validate`,
/// and spawns Envoy (`name`) without waiting for it to be ready (several
/// start in parallel; call [`Envoy::wait_ready`]).
pub fn spawn(name: &str, filters: &Filters, paths: &Paths) -> Envoy {
    let options = EnvoyOptions {
        bin: paths.envoy.clone(),
        name: name.to_string(),
        dir: paths.scratch.clone(),
        // Only what goes wrong: logging costs nothing under load then.
        log_level: "warn",
        flags: Vec::new(),
        validate_first: true,
    };
    let build = filters.floodgate(paths);
    let (filters, paths) = (filters.clone(), paths.clone());
    let envoy = Envoy::spawn(options, move |options, port, admin_port| {
        write_bootstrap(options, &bootstrap(&filters, &paths, port, admin_port))
    });
    // Floodgate's stats are read where its build has them.
    match build {
        Some(build) => envoy.loading(&build),
        None => envoy,
    }
}

/// Starts Envoy (`name`) with the variant's bootstrap and waits until it is ready.
pub fn start(name: &str, filters: &Filters, paths: &Paths) -> Envoy {
    let mut envoy = spawn(name, filters, paths);
    envoy.wait_ready();
    envoy
}
