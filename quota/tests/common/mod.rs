//! What the integration suites share of the service's own: its router
//! served in-process on a free loopback port, on a manual clock, over the
//! memory store or a real Redis or Redis Cluster (the processes are the
//! workspace harness's, `floodgate_e2e::redis`), and raw gRPC bytes.

#![allow(dead_code)] // each suite uses a different part of the harness

use std::sync::Arc;
use std::time::Duration;

use floodgate_core::time::{Clock, FakeClock, Nanos, SECOND};
use floodgate_e2e::{RedisCluster, RedisServer};
use floodgate_quota::config::Domains;
use floodgate_quota::http::{router, AppState};
use floodgate_quota::metrics::ServiceMetrics;
use floodgate_quota::server::{serve, App, Limits};
use floodgate_quota::service::{Service, Settings};
use floodgate_quota::store::{LocalStore, QuotaStore, RedisOptions, RedisStore};
use serde_json::Value;

/// An instant on every period boundary a test uses (a multiple of one hour).
pub const T0: Nanos = Nanos::from_secs(1_700_002_800);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Memory,
    Redis,
    /// A three-master Redis Cluster of its own.
    RedisCluster,
}

/// A service served on loopback, with its clock and (for Redis) its server.
pub struct Fixture {
    pub base: String,
    pub clock: Arc<FakeClock>,
    pub service: Arc<Service>,
    pub redis: Option<RedisServer>,
    pub cluster: Option<RedisCluster>,
    pub client: reqwest::Client,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// One domain per YAML document (documents separated by `---` lines).
pub fn domains(yaml: &str) -> Domains {
    Domains::from_domains(yaml.split("\n---\n").map(|doc| Domains::parse_one("test", doc).expect("test config parses")))
}

pub struct Options {
    pub auth_token: Option<&'static str>,
    pub lease_ttl: Nanos,
    pub store_timeout: Duration,
    /// Use Redis's own clock instead of the manual one.
    pub redis_time: bool,
    pub max_buckets: usize,
    /// The server loop's timeouts and connection cap.
    pub limits: Limits,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            auth_token: None,
            lease_ttl: SECOND,
            // Ample for a loaded two-core CI machine: the functional tests
            // must not turn a slow moment into a 503. The outage tests,
            // which are about the timeout, set a short one of their own.
            store_timeout: Duration::from_secs(2),
            redis_time: false,
            max_buckets: 100_000,
            limits: Limits::default(),
        }
    }
}

impl Fixture {
    pub async fn new(backend: Backend, yaml: &str) -> Fixture {
        Self::with(backend, yaml, Options::default()).await
    }

    pub async fn with(backend: Backend, yaml: &str, options: Options) -> Fixture {
        if backend == Backend::RedisCluster {
            let cluster = tokio::task::spawn_blocking(RedisCluster::start).await.expect("cluster started");
            let mut fixture = Self::serve(Some(cluster.url()), None, yaml, options).await;
            fixture.cluster = Some(cluster);
            return fixture;
        }
        let redis = (backend == Backend::Redis).then(RedisServer::start);
        let url = redis.as_ref().map(|r| r.url());
        Self::serve(url, redis, yaml, options).await
    }

    /// A service using the Redis at `url` (which may be down).
    pub async fn serve(url: Option<String>, redis: Option<RedisServer>, yaml: &str, options: Options) -> Fixture {
        let clock = Arc::new(FakeClock::new(T0));
        let shared: Arc<dyn Clock> = clock.clone();
        let store = match url {
            None => QuotaStore::new(Arc::new(LocalStore::new(shared, options.max_buckets))),
            Some(url) => {
                // A manual clock is years from Redis's: its offset is not looked at.
                let redis_options = RedisOptions {
                    timeout: options.store_timeout,
                    clock: if options.redis_time { None } else { Some(shared) },
                    clock_bound: None,
                };
                QuotaStore::new(Arc::new(RedisStore::new(&url, redis_options).expect("redis store")))
            }
        };
        let metrics = ServiceMetrics::new().expect("metrics");
        let service = Arc::new(Service::new(domains(yaml), store, metrics, Settings { lease_ttl: options.lease_ttl }));
        let state = AppState { service: service.clone(), auth_token: options.auth_token.map(Arc::from) };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let app = router(state);
        let server = tokio::spawn(serve(listener, App::Http(app), options.limits, std::future::pending()));
        let client = reqwest::Client::builder()
            // A safety net against a hang, not a speed assertion.
            .timeout(Duration::from_secs(10))
            .no_proxy()
            .build()
            .expect("client");
        Fixture { base, clock, service, redis, cluster: None, client, server }
    }

    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        Self::post_with(&self.client, &self.base, path, body).await
    }

    /// A client whose connections come from `address` (a loopback address
    /// other than 127.0.0.1: another peer, another caller).
    pub fn client_from(address: &str) -> reqwest::Client {
        reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .no_proxy()
            .local_address(Some(address.parse().expect("an address")))
            .build()
            .expect("client")
    }

    /// POST through `client` (see [`Fixture::client_from`]).
    pub async fn post_from(&self, client: &reqwest::Client, path: &str, body: &Value) -> (u16, Value) {
        Self::post_with(client, &self.base, path, body).await
    }

    async fn post_with(client: &reqwest::Client, base: &str, path: &str, body: &Value) -> (u16, Value) {
        let response = client.post(format!("{base}{path}")).json(body).send().await.expect("request");
        let status = response.status().as_u16();
        let text = response.text().await.expect("body");
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    /// POST /v1/check, expecting 200.
    pub async fn check(&self, body: Value) -> Value {
        let (status, value) = self.post("/v1/check", &body).await;
        assert_eq!(status, 200, "{value}");
        value
    }

    /// POST /v1/lease, expecting 200.
    pub async fn lease(&self, body: Value) -> Value {
        let (status, value) = self.post("/v1/lease", &body).await;
        assert_eq!(status, 200, "{value}");
        value
    }

    /// POST /v1/return, expecting 200.
    pub async fn give_back(&self, body: Value) -> Value {
        let (status, value) = self.post("/v1/return", &body).await;
        assert_eq!(status, 200, "{value}");
        value
    }

    pub async fn metrics(&self) -> String {
        self.client.get(format!("{}/metrics", self.base)).send().await.expect("metrics").text().await.expect("text")
    }
}

/// The bytes of a message, sent as they are: what a broken or hostile
/// client sends.
#[derive(Clone, Copy)]
pub struct RawCodec;

pub struct RawBytes;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = ();
    type Encoder = RawBytes;
    type Decoder = RawBytes;

    fn encoder(&mut self) -> RawBytes {
        RawBytes
    }

    fn decoder(&mut self) -> RawBytes {
        RawBytes
    }
}

impl tonic::codec::Encoder for RawBytes {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn encode(&mut self, item: Vec<u8>, dst: &mut tonic::codec::EncodeBuf<'_>) -> Result<(), tonic::Status> {
        tonic_prost::prost::bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawBytes {
    type Item = ();
    type Error = tonic::Status;

    fn decode(&mut self, src: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<()>, tonic::Status> {
        let rest = tonic_prost::prost::bytes::Buf::remaining(src);
        tonic_prost::prost::bytes::Buf::advance(src, rest);
        Ok(Some(()))
    }
}
