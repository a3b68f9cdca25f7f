//! The set-up of an Envoy under test: Floodgate with a plugin
//! configuration on a balanced loopback listener, what the test puts
//! around it (filters before and after, routes, clusters,
//! connection-manager fields), rendered as a bootstrap or an LDS file.

use std::path::Path;

use serde_json::{json, Map, Value};

use crate::bootstrap::{cluster, Bootstrap, Build, Listener};
use crate::ports::free_port;

/// How to set up the Envoy under test.
#[derive(Clone, Debug)]
pub struct Setup {
    /// The build of Floodgate it loads.
    pub build: Build,
    /// The plugin configuration (JSON).
    pub plugin_config: String,
    /// Further `HttpConnectionManager` fields (e.g. `access_log`,
    /// `max_request_headers_kb`), as Envoy's JSON names them.
    pub manager_fields: Map<String, Value>,
    /// The connection manager's `use_remote_address`: whether the client is
    /// the connection's peer (true) or taken from `x-forwarded-for`.
    pub use_remote_address: bool,
    /// Clusters the filter may call (name, loopback ports): e.g. the quota service.
    pub clusters: Vec<(String, Vec<u16>)>,
    /// HTTP filters before Floodgate (e.g. `jwt_authn`).
    pub filters_before: Vec<Value>,
    /// HTTP filters between Floodgate and the router (e.g.
    /// [`crate::bootstrap::fault_delay_from_header`]).
    pub filters_after: Vec<Value>,
    /// The routes of the listener's one virtual host; `None`: every request
    /// answered 200 by Envoy itself
    /// ([`crate::bootstrap::direct_response_route`]).
    pub routes: Option<Vec<Value>>,
    /// The bootstrap's `node.cluster` (Envoy's local service cluster).
    pub node_cluster: Option<String>,
    /// The port of a second listener that answers every request 200
    /// `upstream`, once [`Setup::with_upstream`] named clusters for it.
    upstream_port: Option<u16>,
    /// The loopback address its clusters' connections come from
    /// ([`Setup::with_source_address`]); `None`: the kernel's choice.
    source_address: Option<String>,
}

impl Setup {
    /// Envoy with `plugin_config`, the build [`Build::from_env`] names, and
    /// default connection-manager settings.
    pub fn new(plugin_config: &str) -> Self {
        Self {
            build: Build::from_env(),
            plugin_config: plugin_config.to_string(),
            manager_fields: Map::new(),
            use_remote_address: true,
            clusters: Vec::new(),
            filters_before: Vec::new(),
            filters_after: Vec::new(),
            routes: None,
            node_cluster: None,
            upstream_port: None,
            source_address: None,
        }
    }

    /// The same, its clusters' connections made from `address` (a loopback
    /// address such as `127.0.0.11`): the Envoys of a fleet each have an
    /// address of their own, and the quota service tells its callers apart
    /// by it; on loopback they would all be 127.0.0.1, one caller.
    pub fn with_source_address(mut self, address: &str) -> Self {
        self.source_address = Some(address.to_string());
        self
    }

    /// The same, with clusters `names` that lead to an upstream answering
    /// every request 200 `upstream` (a listener of the same Envoy), for
    /// routes that need a cluster.
    pub fn with_upstream(mut self, names: &[&str]) -> Self {
        let port = *self.upstream_port.get_or_insert_with(free_port);
        for name in names {
            self.clusters.push((name.to_string(), vec![port]));
        }
        self
    }

    /// The same, with a cluster `name` of loopback `ports` for the filter's callouts.
    pub fn with_cluster(mut self, name: &str, ports: &[u16]) -> Self {
        self.clusters.push((name.to_string(), ports.to_vec()));
        self
    }

    /// The static clusters.
    fn cluster_values(&self) -> Vec<Value> {
        let bind = self
            .source_address
            .as_ref()
            .map(|address| json!({"source_address": {"address": address, "port_value": 0}}));
        self.clusters
            .iter()
            .map(|(name, ports)| {
                let mut cluster = cluster(name, ports, "0.25s", false);
                if let Some(bind) = &bind {
                    cluster["upstream_bind_config"] = bind.clone();
                }
                cluster
            })
            .collect()
    }

    /// The listener under test, `main` on `port`. Its connections are
    /// balanced over the workers, so what a test says of two workers is
    /// shown whenever it opens two connections.
    pub fn listener(&self, port: u16) -> Listener {
        let mut listener = Listener::new("main", port, "e2e");
        listener.manager = self.manager_fields.clone();
        listener.manager.insert("use_remote_address".into(), json!(self.use_remote_address));
        if let Some(routes) = &self.routes {
            listener.routes = routes.clone();
        }
        listener.http_filters = self.filters_before.clone();
        listener.http_filters.push(self.build.http_filter(&self.plugin_config));
        listener.http_filters.extend(self.filters_after.iter().cloned());
        listener.balanced = true;
        listener
    }

    /// The listener that plays the upstream, if any.
    fn upstream_listener(&self) -> Option<Listener> {
        self.upstream_port.map(|port| Listener::new("upstream", port, "upstream"))
    }

    /// The bootstrap with the listener under test on `port` (and the
    /// upstream's, if any) and the admin endpoint on `admin_port`.
    pub fn bootstrap(&self, port: u16, admin_port: u16) -> Value {
        Bootstrap {
            node: self.node_cluster.as_ref().map(|cluster| ("e2e".to_string(), cluster.clone())),
            listeners: std::iter::once(self.listener(port)).chain(self.upstream_listener()).collect(),
            clusters: self.cluster_values(),
            lds_file: None,
            admin_port,
        }
        .to_json()
    }

    /// A bootstrap that takes its listener from the LDS file `lds` (the
    /// test writes [`Setup::listener`]'s there), with this set-up's clusters.
    pub fn dynamic_bootstrap(&self, lds: &Path, admin_port: u16) -> Value {
        Bootstrap {
            node: Some(("e2e".to_string(), "e2e".to_string())),
            listeners: Vec::new(),
            clusters: self.cluster_values(),
            lds_file: Some(lds.to_path_buf()),
            admin_port,
        }
        .to_json()
    }
}
