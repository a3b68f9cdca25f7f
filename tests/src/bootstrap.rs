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
/// another build is this one value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Build {
    /// The proxy-wasm module (`wasm32-wasip1`) at this path.
    Wasm {
        /// The `.wasm` file.
        module: PathBuf,
    },
}

impl Build {
    /// The build the end-to-end tests load: the wasm module at
    /// `$FLOODGATE_WASM`, or the release build in `target/`.
    pub fn from_env() -> Build {
        Build::Wasm { module: wasm_path() }
    }

    /// Floodgate's `http_filters` entry, running the plugin configuration
    /// `config` (JSON, handed to the filter as written).
    pub fn http_filter(&self, config: &str) -> Value {
        match self {
            Build::Wasm { module } => wasm_filter("floodgate", module, config),
        }
    }
}

/// The built wasm filter: `$FLOODGATE_WASM`, or the release build in `target/`.
pub fn wasm_path() -> PathBuf {
    crate::ports::built_file("FLOODGATE_WASM", "target/wasm32-wasip1/release/floodgate.wasm", "make wasm")
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
