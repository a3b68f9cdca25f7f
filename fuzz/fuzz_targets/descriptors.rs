//! Descriptor extraction and the whole limiter over arbitrary header sets:
//! every descriptor kind, match condition and the cost header read bytes a
//! client controls.
#![no_main]

use arbitrary::Arbitrary;
use floodgate_core::config::Config;
use floodgate_core::descriptor::StaticRequest;
use floodgate_core::algorithm::Release;
use floodgate_core::headers::HeaderBlock;
use floodgate_core::limiter::{CompiledRule, Counters, Limiter, RuleEvent, StoreEvent};
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
                 {"name": "x-flag", "present_match": true}]}}], "limit": 2, "period": "1h", "shadow_mode": true}
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
    advance_ms: u16,
}

struct Ignore;

impl Counters<()> for Ignore {
    fn rule(&mut self, _: &CompiledRule<()>, _: RuleEvent) {}
    fn store(&mut self, _: StoreEvent, _: u64) {}
}

fuzz_target!(|input: Input| {
    let Ok(config) = Config::parse(CONFIG.as_bytes()) else { panic!("the fuzz config must parse") };
    let store = MemoryStore::default();
    let Ok(limiter) = Limiter::prepare(config, &store, [1; 16], |_| ()) else { panic!("prepare") };
    let mut headers = HeaderBlock::default();
    let mut now = Nanos(1_700_000_000_000_000_000);
    for request in input.requests.into_iter().take(64) {
        now = now + Nanos::from_millis(u64::from(request.advance_ms));
        let release = match request.advance_ms % 3 {
            0 => Release::Undo,
            _ => Release::Done,
        };
        let mut request = StaticRequest { headers: request.headers, remote_address: request.remote_address };
        let (verdict, permit) = limiter.check(&store, now, &mut request, &mut Ignore);
        limiter.render_headers(&verdict, &mut headers);
        limiter.release(&store, now, permit, release, &mut Ignore);
    }
});
