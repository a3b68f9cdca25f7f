//! The core's decision path on one hot key, over three stores, for counting
//! instructions per decision with callgrind (the numbers are in
//! `native/DESIGN.md`):
//!
//! ```sh
//! cargo build --profile native -p floodgate-native --example decide_cost
//! for store in in-place get-set shared-data; do
//!   valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*decide_many*' \
//!     --callgrind-out-file=/tmp/cg.$store target/native/examples/decide_cost $store 100000
//! done
//! ```
//!
//! - `in-place`: process memory deciding in place (the native build);
//! - `get-set`: the same memory read out and compared-and-set back, as the
//!   core does on a store that cannot decide in place;
//! - `shared-data`: the core's in-memory model of Envoy's shared data (one
//!   map, one global version), the wasm build's path without the host calls.

// A measuring tool, like a test: a broken setup may stop it.
#![allow(clippy::expect_used, clippy::panic)]

use floodgate_core::config::Config;
use floodgate_core::descriptor::StaticRequest;
use floodgate_core::limiter::{CompiledRule, Counters, Limiter, RequestEvent, RuleEvent, StoreEvent};
use floodgate_core::store::{Cas, MemoryStore as SharedDataModel, Store, StoreError};
use floodgate_core::time::{Nanos, SECOND};
use floodgate_native::memory::{Memory, MemoryStore};

const CONFIG: &str = r#"{"rules": [{"name": "per-key", "limit": 1000000000, "period": "1h",
    "descriptors": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "k"}}]}]}"#;

struct Uncounted;

impl Counters<()> for Uncounted {
    fn request(&mut self, _: RequestEvent) {}
    fn rule(&mut self, _: &CompiledRule<()>, _: RuleEvent) {}
    fn store(&mut self, _: StoreEvent, _: u64) {}
}

/// Process memory, but only through get and set.
struct GetSet(MemoryStore);

impl Store for GetSet {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, Cas)>, StoreError> {
        self.0.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
        self.0.set(key, value, cas)
    }
}

#[inline(never)]
fn decide_many(limiter: &Limiter<()>, store: &dyn Store, request: &mut StaticRequest, times: u64) -> u64 {
    let start = Nanos::from_nanos(1_700_000_000 * SECOND.get());
    (0..times)
        .filter(|i| {
            let now = start + Nanos::from_nanos(*i);
            let (verdict, _permit) = limiter.check(store, now, request, &mut Uncounted);
            verdict.allowed()
        })
        .count() as u64
}

fn main() {
    let mut args = std::env::args().skip(1);
    let kind = args.next().unwrap_or_else(|| "in-place".into());
    let times = args.next().and_then(|n| n.parse().ok()).unwrap_or(100_000);
    let config = Config::parse(CONFIG.as_bytes()).expect("the example's configuration is valid");
    let memory = std::sync::Arc::new(Memory::default());
    // As in Envoy: the main thread prepares, then a worker decides.
    Limiter::<()>::prepare(config.clone(), &memory.store(), [7; 16], |_| ()).expect("prepared");
    let store: Box<dyn Store> = match kind.as_str() {
        "in-place" => Box::new(memory.store()),
        "get-set" => Box::new(GetSet(memory.store())),
        "shared-data" => Box::new(SharedDataModel::default()),
        other => panic!("unknown store {other}: in-place, get-set or shared-data"),
    };
    let limiter = Limiter::prepare(config, store.as_ref(), [7; 16], |_| ()).expect("prepared");
    let mut request = StaticRequest { headers: vec![Some(b"alice".to_vec())], ..Default::default() };
    let allowed = decide_many(&limiter, store.as_ref(), &mut request, times);
    println!("{kind}: {allowed} of {times} allowed");
}
