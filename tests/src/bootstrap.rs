//! The pieces of an Envoy bootstrap both the end-to-end tests and the bench
//! write: a loopback HTTP listener with one connection manager and one
//! virtual host, a wasm filter, the router, static clusters and the admin
//! endpoint. Each is YAML text indented for where it goes, so a caller joins
//! them as the bootstrap's shape says: `static_resources` / `listeners`
//! (items from [`Listener::item`]), `clusters` ([`clusters`]), then [`admin`].

use std::path::Path;

/// The router, the last of every `http_filters` list (an item indented for it).
pub const ROUTER: &str = r#"          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#;

/// A route answering every request 200 `upstream` from Envoy itself (a
/// direct response, so no cluster): an item indented for `routes`.
pub const DIRECT_RESPONSE_ROUTE: &str = r#"              - match: {prefix: "/"}
                direct_response: {status: 200, body: {inline_string: "upstream"}}
"#;

/// A listener on `127.0.0.1:port` with one `HttpConnectionManager` whose one
/// virtual host (`all`, every domain) is described by the fields below.
#[derive(Clone, Debug)]
pub struct Listener<'a> {
    /// The listener's port.
    pub port: u16,
    /// The connection manager's `stat_prefix`.
    pub stat_prefix: &'a str,
    /// Further connection-manager fields (e.g. `use_remote_address`), as
    /// YAML lines indented for it (10 spaces).
    pub manager: &'a str,
    /// The virtual host's fields after `domains` (`routes`, `rate_limits`),
    /// as YAML lines indented for it (14 spaces).
    pub virtual_host: &'a str,
    /// The HTTP filters before the router, as list items indented for
    /// `http_filters` (10 spaces).
    pub http_filters: &'a str,
    /// Connections balanced exactly over the workers (each new one to the
    /// worker with the fewest), rather than hashed by the kernel over each
    /// worker's own socket (`SO_REUSEPORT`, Envoy's default), which put all
    /// of a test's six connections on one worker about one run in thirty.
    pub balanced: bool,
}

impl Listener<'_> {
    /// The listener's fields (address, filter chains), indented for an item
    /// of a list whose first field the caller writes (its `name`, or an LDS
    /// resource's `@type`).
    pub fn fields(&self) -> String {
        format!(
            r#"    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
{balance}    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {stat_prefix}
{manager}          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
{virtual_host}          http_filters:
{http_filters}{ROUTER}"#,
            port = self.port,
            balance = if self.balanced {
                "    enable_reuse_port: false\n    connection_balance_config: {exact_balance: {}}\n"
            } else {
                ""
            },
            stat_prefix = self.stat_prefix,
            manager = self.manager,
            virtual_host = self.virtual_host,
            http_filters = self.http_filters,
        )
    }

    /// The listener as an item of `static_resources.listeners`, named `name`.
    pub fn item(&self, name: &str) -> String {
        format!("  - name: {name}\n{}", self.fields())
    }
}

/// An `http_filters` item: the wasm filter `name` (also its root and VM id)
/// running the module at `wasm` with the plugin configuration `config`
/// (JSON), reloaded if its VM crashes, as the README deploys it.
pub fn wasm_filter(name: &str, wasm: &Path, config: &str) -> String {
    // A single-quoted YAML scalar: quotes doubled, newlines folded away.
    let config = config.replace('\'', "''").replace('\n', " ");
    format!(
        r#"          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: {name}
                root_id: {name}
                failure_policy: FAIL_RELOAD
                vm_config:
                  vm_id: {name}
                  runtime: envoy.wasm.runtime.v8
                  code: {{local: {{filename: "{wasm}"}}}}
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: '{config}'
"#,
        wasm = wasm.display()
    )
}

/// A static cluster `name` of the loopback `ports`, as an item of
/// `static_resources.clusters`; `http2` for a gRPC service.
pub fn cluster(name: &str, ports: &[u16], connect_timeout: &str, http2: bool) -> String {
    let protocol = if http2 {
        r#"    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
"#
    } else {
        ""
    };
    let endpoints: String = ports
        .iter()
        .map(|port| {
            format!("        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}}}\n")
        })
        .collect();
    format!(
        "  - name: {name}\n    type: STATIC\n    connect_timeout: {connect_timeout}\n{protocol}    load_assignment:\n      \
         cluster_name: {name}\n      endpoints:\n      - lb_endpoints:\n{endpoints}"
    )
}

/// `clusters:` with these items under `static_resources`; nothing when there are none.
pub fn clusters(items: &[String]) -> String {
    if items.is_empty() {
        return String::new();
    }
    format!("  clusters:\n{}", items.concat())
}

/// The admin endpoint on `127.0.0.1:admin_port`.
pub fn admin(admin_port: u16) -> String {
    format!("admin:\n  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin_port}}}}}\n")
}
