//! Checks, before anything is measured, that the set-up measures what it says.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::{json, Value};

use crate::filters::{self, EnvoyBucket, Filters};
use crate::settings::BenchSettings;

/// Checks, before measuring anything, that variant (b)'s configuration really
/// limits per key: with a bucket of 3 per minute, key A gets 3 of 5 and key B
/// still gets both of its 2.
pub fn check_envoy_local(s: &BenchSettings, out: &mut String, raw: &mut BTreeMap<String, Value>) {
    let filters = Filters::EnvoyLocal(EnvoyBucket { max_tokens: 3, tokens_per_fill: 3, fill_interval: "60s" });
    let envoy = filters::start("check-envoy-local", &filters, &s.paths);
    let mut statuses = Vec::new();
    for key in ["key-a", "key-a", "key-a", "key-a", "key-a", "key-b", "key-b"] {
        // A new connection per request, so requests land on both workers.
        let status = floodgate_e2e::Conn::open(envoy.port)
            .ok()
            .and_then(|mut c| c.try_request("GET", "/api/items", &[("x-api-key", key.as_bytes())]).ok())
            .map_or(0, |r| r.status);
        statuses.push((key, status));
    }
    let ok = statuses.iter().map(|(_, s)| *s).eq([200, 200, 200, 429, 429, 200, 200]);
    let shown: Vec<String> = statuses.iter().map(|(k, s)| format!("{k}:{s}")).collect();
    let _ = writeln!(
        out,
        "\nCheck of (b)'s per-key configuration with a bucket of 3 per minute: {} — {}.",
        shown.join(" "),
        if ok { "limits per key as expected" } else { "**NOT as expected (3 of 5 for key-a, 2 of 2 for key-b)**" }
    );
    raw.insert("check_envoy_local".into(), json!({"statuses": shown, "as_expected": ok}));
}
