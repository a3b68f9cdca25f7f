//! Plugin configuration parsing: any bytes give a config or an error, never
//! a panic; an accepted config prepares on a store.
#![no_main]

use floodgate_core::config::Config;
use floodgate_core::limiter::Limiter;
use floodgate_core::store::MemoryStore;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(config) = Config::parse(data) {
        // Keep table creation small enough to stay fast.
        if config.rules.iter().all(|r| r.table.groups() <= 1024) {
            let store = MemoryStore::default();
            let _ = Limiter::prepare(config, &store, [0; 16], |_| ());
        }
    }
});
