//! Descriptor extraction and the whole limiter over arbitrary requests:
//! every descriptor kind, match condition and the cost header read bytes a
//! client controls (headers, the query), and so do Envoy's attributes here
//! (metadata as arbitrary bytes or as a well-formed message of arbitrary
//! values, route and cluster names).
#![no_main]

use arbitrary::Arbitrary;
use floodgate_core::config::Config;
use floodgate_core::descriptor::{Attribute, StaticRequest};
use floodgate_core::metadata::build::{self, Fields};
use floodgate_core::algorithm::Release;
use floodgate_core::headers::HeaderBlock;
use floodgate_core::limiter::{CompiledRule, Counters, Limiter, RequestEvent, RuleEvent, StoreEvent};
use floodgate_core::store::MemoryStore;
use floodgate_core::time::Nanos;
use libfuzzer_sys::fuzz_target;

const CONFIG: &str = r#"{"rules": [
  {"name": "api", "match": {"path_prefix": "/api", "methods": ["GET", "POST"], "authority": "example.com"},
   "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "k"}},
                   {"request_headers": {"header_name": "x-tenant", "descriptor_key": "t", "skip_if_absent": true}}],
   "limit": 5, "period": "1s", "cost_from_header": {"header_name": "x-cost", "max": 5}, "max_keys": 8},
  {"name": "login", "match": {"path_exact": "/login"}, "algorithm": "leaky_bucket",
   "descriptors": [{"remote_address": {}}], "limit": 3, "period": "1m", "burst": 2, "max_keys": 8},
  {"name": "subnet", "algorithm": "fixed_window", "descriptors": [{"masked_remote_address": {"v4_prefix_mask_len": 24, "v6_prefix_mask_len": 48}}],
   "limit": 4, "period": "10s", "max_keys": 4},
  {"name": "paced", "algorithm": "shaper", "descriptors": [{"request_headers": {"header_name": "x-tenant", "descriptor_key": "t"}}],
   "limit": 3, "period": "1s", "max_delay": "2s", "cost_from_header": {"header_name": "x-cost", "max": 4}, "max_keys": 4},
  {"name": "beta", "descriptors": [{"header_value_match": {"descriptor_value": "b", "expect_match": false,
     "headers": [{"name": "x-tenant", "string_match": {"contains": "beta"}, "invert_match": true},
                 {"name": "x-flag", "present_match": true}]}}], "limit": 2, "period": "1h", "shadow_mode": true},
  {"name": "per-user", "match": {"route_name": "api", "route_metadata": {"filter": "jwt", "path": [{"key": "tier"}],
     "value": {"string_match": {"prefix": "g"}}, "invert": true}},
   "descriptors": [{"metadata": {"descriptor_key": "user", "metadata_key": {"key": "jwt", "path": [{"key": "p"}, {"key": "sub"}]}}},
                   {"metadata": {"descriptor_key": "tier", "source": "ROUTE_ENTRY", "default_value": "free",
                                 "metadata_key": {"key": "jwt", "path": [{"key": "tier"}]}}},
                   {"query_parameters": {"query_parameter_name": "user", "descriptor_key": "q", "skip_if_absent": true}},
                   {"destination_cluster": {}}],
   "limit": 3, "period": "1s", "max_keys": 8},
  {"name": "per-param", "algorithm": "sliding_window",
   "descriptors": [{"query_parameter_value_match": {"descriptor_value": "dbg", "expect_match": false,
                      "query_parameters": [{"name": "debug", "present_match": true}, {"name": "mode", "string_match": {"suffix": "x"}}]}},
                   {"metadata": {"descriptor_key": "sub", "skip_if_absent": true,
                                 "metadata_key": {"key": "jwt", "path": [{"key": "p"}, {"key": "p"}, {"key": "sub"}]}}},
                   {"query_parameters": {"query_parameter_name": "k%", "descriptor_key": "k"}},
                   {"source_cluster": {}}],
   "limit": 4, "period": "10s", "max_keys": 4}
], "failure_mode": "deny"}"#;

#[derive(Arbitrary, Debug)]
struct Input {
    requests: Vec<Request>,
}

#[derive(Arbitrary, Debug)]
struct Request {
    /// One value per header name the config needs (missing entries: absent).
    headers: Vec<Option<Vec<u8>>>,
    remote_address: Option<Vec<u8>>,
    dynamic_metadata: Option<Metadata>,
    route_metadata: Option<Metadata>,
    /// Whether the route's name is the one a rule matches (else `other`).
    on_api_route: bool,
    destination_cluster: Option<Vec<u8>>,
    source_cluster: Option<Vec<u8>>,
    advance_ms: u16,
}

/// Metadata as Envoy would serialize it (namespace `jwt` holding these
/// fields), or any bytes.
#[derive(Arbitrary, Debug)]
enum Metadata {
    Fields(Vec<(Name, Value)>),
    Raw(Vec<u8>),
}

impl Metadata {
    fn bytes(self) -> Vec<u8> {
        match self {
            Metadata::Fields(f) => build::metadata(&[(b"jwt", fields(f))]),
            Metadata::Raw(bytes) => bytes,
        }
    }
}

/// A field name: one of those the rules look for, or any bytes.
#[derive(Arbitrary, Debug)]
enum Name {
    P,
    Sub,
    Tier,
    Other(Vec<u8>),
}

/// A metadata value.
#[derive(Arbitrary, Debug)]
enum Value {
    Null,
    Number(f64),
    String(Vec<u8>),
    Bool(bool),
    Struct(Vec<(Name, Value)>),
    List(Vec<Value>),
}

fn fields(fields: Vec<(Name, Value)>) -> Fields {
    fields.into_iter().map(|(name, value)| (name.bytes(), value.build())).collect()
}

impl Name {
    fn bytes(self) -> Vec<u8> {
        match self {
            Name::P => b"p".to_vec(),
            Name::Sub => b"sub".to_vec(),
            Name::Tier => b"tier".to_vec(),
            Name::Other(bytes) => bytes,
        }
    }
}

impl Value {
    fn build(self) -> build::ProtoValue {
        match self {
            Value::Null => build::ProtoValue::Null,
            Value::Number(n) => build::ProtoValue::Number(n),
            Value::String(s) => build::ProtoValue::String(s),
            Value::Bool(b) => build::ProtoValue::Bool(b),
            Value::Struct(f) => build::ProtoValue::Struct(fields(f)),
            Value::List(items) => build::ProtoValue::List(items.into_iter().map(Value::build).collect()),
        }
    }
}

struct Ignore;

impl Counters<()> for Ignore {
    fn request(&mut self, _: RequestEvent) {}
    fn rule(&mut self, _: &CompiledRule<()>, _: RuleEvent) {}
    fn store(&mut self, _: StoreEvent, _: u64) {}
}

fuzz_target!(|input: Input| {
    let Ok(config) = Config::parse(CONFIG.as_bytes()) else { panic!("the fuzz config must parse") };
    let store = MemoryStore::default();
    let Ok(limiter) = Limiter::prepare(config, &store, [1; 16], |_| ()) else { panic!("prepare") };
    let mut headers = HeaderBlock::default();
    let mut now = Nanos::from_nanos(1_700_000_000_000_000_000);
    for request in input.requests.into_iter().take(64) {
        now = now + Nanos::from_millis(u64::from(request.advance_ms));
        let release = match request.advance_ms % 3 {
            0 => Release::Undo,
            _ => Release::Done,
        };
        let mut attributes: [Option<Vec<u8>>; Attribute::COUNT] = Default::default();
        attributes[Attribute::DynamicMetadata.index()] = request.dynamic_metadata.map(Metadata::bytes);
        attributes[Attribute::RouteMetadata.index()] = request.route_metadata.map(Metadata::bytes);
        attributes[Attribute::RouteName.index()] = Some(if request.on_api_route { b"api".to_vec() } else { b"other".to_vec() });
        attributes[Attribute::DestinationCluster.index()] = request.destination_cluster;
        attributes[Attribute::SourceCluster.index()] = request.source_cluster;
        let mut request = StaticRequest { headers: request.headers, remote_address: request.remote_address, attributes };
        let (verdict, permit) = limiter.check(&store, now, &mut request, &mut Ignore);
        limiter.render_headers(&verdict, &mut headers);
        limiter.release(&store, now, permit, release, &mut Ignore);
    }
});
