//! Envoy bootstraps as structured values (Envoy reads JSON bootstraps), for
//! the end-to-end tests, the plots and the bench alike: a loopback HTTP
//! listener with one connection manager and one virtual host, Floodgate's
//! filter as the chosen [`Build`] loads it, other proxy-wasm modules,
//! Envoy's own filters the suites put around it, static clusters and the
//! admin endpoint.

use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

/// A build of Floodgate, and how an Envoy loads it. Every suite, the plots
/// and the bench render Floodgate's filter through [`Build::http_filter`]
/// with the same JSON plugin configuration, so running them against
/// another build is this one value: the end-to-end suites take it from
/// `$FLOODGATE_BUILD` ([`Build::from_env`]), and `make test` runs them once
/// per build.
///
/// What one build does and the other does not is said here, once, by the
/// methods under "What differs"; a test whose assertions depend on it asks
/// them (`tests/README.md` lists those tests).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Build {
    /// The proxy-wasm module (`wasm32-wasip1`) at this path.
    Wasm {
        /// The `.wasm` file.
        module: PathBuf,
    },
    /// The native dynamic module (`envoy.filters.http.dynamic_modules`) at
    /// this path.
    Native {
        /// The `.so` file.
        module: PathBuf,
    },
}

/// The value of `$FLOODGATE_BUILD` that selects the native build (unset,
/// empty or `wasm`: the wasm build).
const NATIVE: &str = "native";

/// Whether `$FLOODGATE_BUILD` names the native build; any value but the two
/// builds' names stops the run.
fn native_from_env() -> bool {
    match std::env::var("FLOODGATE_BUILD").as_deref() {
        Err(_) | Ok("" | "wasm") => false,
        Ok(NATIVE) => true,
        Ok(other) => panic!("FLOODGATE_BUILD={other:?}: use \"wasm\" (the default) or \"native\""),
    }
}

/// The prefix of Floodgate's stats in the build `$FLOODGATE_BUILD` names
/// (see [`Build::stats_prefix`]), without looking for the built file.
pub fn stats_prefix_from_env() -> &'static str {
    if native_from_env() {
        Build::NATIVE_STATS
    } else {
        Build::WASM_STATS
    }
}

impl Build {
    /// Where the wasm build's stats are: Envoy prefixes a wasm filter's
    /// metrics with `wasmcustom.`.
    pub const WASM_STATS: &'static str = "wasmcustom.floodgate.";
    /// Where the native build's stats are: Envoy prefixes a dynamic
    /// module's metrics with `dynamicmodulescustom.`.
    pub const NATIVE_STATS: &'static str = "dynamicmodulescustom.floodgate.";

    /// The build the end-to-end tests load, as `$FLOODGATE_BUILD` names it:
    /// `wasm` (or unset) the wasm module at `$FLOODGATE_WASM` or the release
    /// build in `target/` (`make wasm`); `native` the dynamic module at
    /// `$FLOODGATE_NATIVE` or `make native`'s in `target/native/`.
    pub fn from_env() -> Build {
        if native_from_env() {
            Build::Native { module: native_path() }
        } else {
            Build::Wasm { module: wasm_path() }
        }
    }

    /// Its short name, `wasm` or `native`, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Build::Wasm { .. } => "wasm",
            Build::Native { .. } => NATIVE,
        }
    }

    /// Floodgate's `http_filters` entry, running the plugin configuration
    /// `config` (JSON, handed to the filter as written), under the name
    /// `floodgate`.
    pub fn http_filter(&self, config: &str) -> Value {
        self.http_filter_named("floodgate", config)
    }

    /// Floodgate's `http_filters` entry under `name`, the name filters
    /// share their buckets by: the wasm build's `vm_id` (and plugin name),
    /// the native build's `filter_name`.
    pub fn http_filter_named(&self, name: &str, config: &str) -> Value {
        match self {
            Build::Wasm { module } => wasm_filter(name, module, config),
            Build::Native { module } => native_filter(name, module, config),
        }
    }

    /// The prefix of the filter's stats: [`Build::WASM_STATS`] or
    /// [`Build::NATIVE_STATS`] (the same names follow it in both).
    pub fn stats_prefix(&self) -> &'static str {
        match self {
            Build::Wasm { .. } => Build::WASM_STATS,
            Build::Native { .. } => Build::NATIVE_STATS,
        }
    }

    // What differs. Everything else — responses, headers, stat names after
    // the prefix, every algorithm, exactness, global mode — is the same.

    /// Whether a `metadata` entry or `route_metadata` condition may read
    /// below a namespace's top-level keys (a JWT claim in `jwt_authn`'s
    /// `jwt_payload`). The native build reads metadata one key deep (Envoy's
    /// dynamic module ABI serves no more) and refuses a longer path at load,
    /// naming `jwt_authn`'s `claim_to_headers` as the way to a claim.
    pub fn reads_nested_metadata(&self) -> bool {
        matches!(self, Build::Wasm { .. })
    }

    /// Whether a `source_cluster` descriptor entry is served. The native
    /// build refuses it at load (the ABI does not expose the node), naming a
    /// `generic_key` with the cluster's name as the way.
    pub fn reads_source_cluster(&self) -> bool {
        matches!(self, Build::Wasm { .. })
    }

    /// Whether the filter runs in a VM Envoy reloads if it crashes
    /// (`failure_policy: FAIL_RELOAD`, and its `vm_reload` stats). The native
    /// module has no VM: each of its hooks catches a panic and logs it
    /// (`panic caught before it reached Envoy: panicked at …`).
    pub fn runs_in_a_vm(&self) -> bool {
        matches!(self, Build::Wasm { .. })
    }
}

/// The built wasm filter: `$FLOODGATE_WASM`, or the release build in `target/`.
pub fn wasm_path() -> PathBuf {
    crate::ports::built_file("FLOODGATE_WASM", "target/wasm32-wasip1/release/floodgate.wasm", "make wasm")
}

/// The built native module: `$FLOODGATE_NATIVE`, or `make native`'s in `target/native/`.
pub fn native_path() -> PathBuf {
    crate::ports::built_file("FLOODGATE_NATIVE", "target/native/libfloodgate_native.so", "make native")
}

/// An `http_filters` entry: the proxy-wasm module at `module`, named `name`
/// (also its root and VM id), on V8, with the plugin configuration `config`
/// (a string, as Envoy hands it to `on_configure`), reloaded if its VM
/// crashes, as the README deploys it. Everything Envoy's wasm filter needs
/// beyond the configuration is here.
pub fn wasm_filter(name: &str, module: &Path, config: &str) -> Value {
    json!({
        "name": "envoy.filters.http.wasm",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": name,
                "root_id": name,
                "failure_policy": "FAIL_RELOAD",
                "vm_config": {
                    "vm_id": name,
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": module.display().to_string()}},
                },
                "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": config},
            },
        },
    })
}

/// An `http_filters` entry: the dynamic module at `module` as Envoy's
/// `dynamic_modules` filter named `name` (its `filter_name`), with the
/// plugin configuration `config` (a string, as Envoy hands it to the
/// module), kept loaded for the life of the process (`do_not_close`), as
/// the README deploys it: its buckets live in the module's memory.
pub fn native_filter(name: &str, module: &Path, config: &str) -> Value {
    json!({
        "name": "envoy.filters.http.dynamic_modules",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
            "dynamic_module_config": {
                "module": {"local": {"filename": module.display().to_string()}},
                "do_not_close": true,
            },
            "filter_name": name,
            "filter_config": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": config},
        },
    })
}

/// The router, the last of every `http_filters` list.
pub fn router() -> Value {
    json!({
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
    })
}

/// Envoy's fault filter, delaying each request by the milliseconds in its
/// `x-envoy-fault-delay-request` header (none without it): after
/// Floodgate, with a direct-response route, an upstream that takes that long.
pub fn fault_delay_from_header() -> Value {
    fault_delay(json!({"header_delay": {}}))
}

/// Envoy's fault filter, holding every request `millis` milliseconds: after
/// Floodgate, a slow upstream.
pub fn fault_fixed_delay(millis: u64) -> Value {
    fault_delay(json!({"fixed_delay": format!("{}.{:03}s", millis / 1000, millis % 1000)}))
}

fn fault_delay(delay: Value) -> Value {
    let mut delay = delay;
    delay["percentage"] = json!({"numerator": 100, "denominator": "HUNDRED"});
    json!({
        "name": "envoy.filters.http.fault",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault",
            "delay": delay,
        },
    })
}

/// A route answering every request 200 `upstream` from Envoy itself (a
/// direct response, so no cluster).
pub fn direct_response_route() -> Value {
    json!({"match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": "upstream"}}})
}

/// A route sending every request to `cluster`.
pub fn route_to(cluster: &str) -> Value {
    json!({"match": {"prefix": "/"}, "route": {"cluster": cluster}})
}

/// A listener on `127.0.0.1:port` with one `HttpConnectionManager`, whose
/// one virtual host (`all`, every domain) has [`Listener::routes`], and the
/// [`Listener::http_filters`] then the router.
#[derive(Clone, Debug)]
pub struct Listener {
    /// The listener's name.
    pub name: String,
    /// The listener's port.
    pub port: u16,
    /// The connection manager's `stat_prefix`.
    pub stat_prefix: String,
    /// Further connection-manager fields (e.g. `use_remote_address`,
    /// `access_log`), as Envoy's JSON names them.
    pub manager: Map<String, Value>,
    /// The virtual host's `rate_limits` (the actions of Envoy's own global
    /// rate limit filter); left out when empty.
    pub rate_limits: Vec<Value>,
    /// The virtual host's routes.
    pub routes: Vec<Value>,
    /// The HTTP filters before the router.
    pub http_filters: Vec<Value>,
    /// Connections balanced exactly over the workers (each new one to the
    /// worker with the fewest), rather than hashed by the kernel over each
    /// worker's own socket (`SO_REUSEPORT`, Envoy's default), which put all
    /// of a test's six connections on one worker about one run in thirty.
    pub balanced: bool,
}

impl Listener {
    /// A listener `name` on `port` answering every request itself
    /// ([`direct_response_route`]), with no filter but the router.
    pub fn new(name: &str, port: u16, stat_prefix: &str) -> Listener {
        Listener {
            name: name.to_string(),
            port,
            stat_prefix: stat_prefix.to_string(),
            manager: Map::new(),
            rate_limits: Vec::new(),
            routes: vec![direct_response_route()],
            http_filters: Vec::new(),
            balanced: false,
        }
    }

    /// The listener as Envoy's `Listener` resource.
    pub fn to_json(&self) -> Value {
        let mut virtual_host = json!({"name": "all", "domains": ["*"], "routes": self.routes});
        if !self.rate_limits.is_empty() {
            virtual_host["rate_limits"] = json!(self.rate_limits);
        }
        let mut http_filters = self.http_filters.clone();
        http_filters.push(router());
        let mut manager = self.manager.clone();
        manager.insert(
            "@type".into(),
            json!(
                "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
            ),
        );
        manager.insert("stat_prefix".into(), json!(self.stat_prefix));
        manager.insert("route_config".into(), json!({"virtual_hosts": [virtual_host]}));
        manager.insert("http_filters".into(), json!(http_filters));
        let mut listener = json!({
            "name": self.name,
            "address": socket_address(self.port),
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}],
        });
        if self.balanced {
            listener["enable_reuse_port"] = json!(false);
            listener["connection_balance_config"] = json!({"exact_balance": {}});
        }
        listener
    }

    /// The listener as the one resource of an LDS file.
    pub fn to_lds_file(&self) -> Value {
        let mut resource = self.to_json();
        resource["@type"] = json!("type.googleapis.com/envoy.config.listener.v3.Listener");
        json!({"resources": [resource]})
    }
}

/// `127.0.0.1:port` as Envoy's `address`.
fn socket_address(port: u16) -> Value {
    json!({"socket_address": {"address": "127.0.0.1", "port_value": port}})
}

/// A static cluster `name` of the loopback `ports`, connecting within
/// `connect_timeout` (e.g. `"1s"`); `http2` for a gRPC service.
pub fn cluster(name: &str, ports: &[u16], connect_timeout: &str, http2: bool) -> Value {
    let endpoints: Vec<Value> =
        ports.iter().map(|port| json!({"endpoint": {"address": socket_address(*port)}})).collect();
    let mut cluster = json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": connect_timeout,
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]},
    });
    if http2 {
        cluster["typed_extension_protocol_options"] = json!({
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            },
        });
    }
    cluster
}

/// A whole bootstrap: static listeners and clusters, listeners from an LDS
/// file, the admin endpoint on loopback.
#[derive(Clone, Debug, Default)]
pub struct Bootstrap {
    /// The `node`'s id and cluster (Envoy's local service cluster).
    pub node: Option<(String, String)>,
    /// The static listeners.
    pub listeners: Vec<Listener>,
    /// The static clusters ([`cluster`]).
    pub clusters: Vec<Value>,
    /// Listeners served by LDS from this file ([`Listener::to_lds_file`]),
    /// reread when a file is renamed into its directory.
    pub lds_file: Option<PathBuf>,
    /// The admin endpoint's port.
    pub admin_port: u16,
}

impl Bootstrap {
    /// The bootstrap as Envoy reads it.
    pub fn to_json(&self) -> Value {
        let mut bootstrap = json!({"admin": {"address": socket_address(self.admin_port)}});
        if let Some((id, cluster)) = &self.node {
            bootstrap["node"] = json!({"id": id, "cluster": cluster});
        }
        let mut static_resources = Map::new();
        if !self.listeners.is_empty() {
            static_resources.insert("listeners".into(), self.listeners.iter().map(Listener::to_json).collect());
        }
        if !self.clusters.is_empty() {
            static_resources.insert("clusters".into(), json!(self.clusters));
        }
        if !static_resources.is_empty() {
            bootstrap["static_resources"] = Value::Object(static_resources);
        }
        if let Some(file) = &self.lds_file {
            let directory = file.parent().unwrap_or(Path::new("/"));
            bootstrap["dynamic_resources"] = json!({
                "lds_config": {
                    "resource_api_version": "V3",
                    "path_config_source": {
                        "path": file.display().to_string(),
                        "watched_directory": {"path": directory.display().to_string()},
                    },
                },
            });
        }
        bootstrap
    }
}
