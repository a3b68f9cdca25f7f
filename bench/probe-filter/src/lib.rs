//! A proxy-wasm HTTP filter that repeats one kind of host call a fixed number
//! of times per request and otherwise does nothing. Against the no-op filter,
//! (time per request − no-op's) / repeats is what one such call costs inside
//! a loaded Envoy, which tells where a filter like Floodgate spends its time.
//!
//! The plugin configuration is `<call>=<repeats>`, e.g. `shared_cas=10`, with
//! `<call>` one of the [`Call`] names.

use std::hint::black_box;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MapType, MetricType};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(ProbeRoot { call: Call::None, repeats: 0, metric: 0 })
    });
}}

/// The host call to repeat.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    /// Nothing (as the no-op filter).
    None,
    /// `get_current_time`.
    Time,
    /// `get_map_value` of the request's `x-api-key`.
    Header,
    /// `increment_metric` on one counter.
    Metric,
    /// `get_shared_data` of a key per API key.
    SharedGet,
    /// `get_shared_data` then `set_shared_data` with its cas, as Floodgate
    /// updates a bucket.
    SharedCas,
    /// `set_map_value` of one response header (replaced each time).
    ResponseHeader,
}

impl Call {
    fn parse(name: &str) -> Option<Call> {
        Some(match name {
            "none" => Call::None,
            "time" => Call::Time,
            "header" => Call::Header,
            "metric" => Call::Metric,
            "shared_get" => Call::SharedGet,
            "shared_cas" => Call::SharedCas,
            "response_header" => Call::ResponseHeader,
            _ => return None,
        })
    }
}

/// The root context: parses the configuration and hands it to each request.
struct ProbeRoot {
    call: Call,
    repeats: u32,
    metric: u32,
}

impl Context for ProbeRoot {}

impl RootContext for ProbeRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        let config = String::from_utf8_lossy(&config);
        let Some((call, repeats)) = config.trim().split_once('=') else { return false };
        let (Some(call), Ok(repeats)) = (Call::parse(call), repeats.parse()) else { return false };
        self.call = call;
        self.repeats = repeats;
        if call == Call::Metric {
            match hostcalls::define_metric(MetricType::Counter, "probe.calls") {
                Ok(id) => self.metric = id,
                Err(_) => return false,
            }
        }
        true
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Probe { call: self.call, repeats: self.repeats, metric: self.metric }))
    }
}

/// One request: makes the calls, then continues.
struct Probe {
    call: Call,
    repeats: u32,
    metric: u32,
}

impl Context for Probe {}

impl HttpContext for Probe {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        // Results go through black_box so the calls cannot be optimised away;
        // errors are ignored: only the time spent matters here.
        match self.call {
            Call::None | Call::ResponseHeader => {}
            Call::Time => {
                for _ in 0..self.repeats {
                    let _ = black_box(hostcalls::get_current_time());
                }
            }
            Call::Header => {
                for _ in 0..self.repeats {
                    let _ = black_box(hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, "x-api-key"));
                }
            }
            Call::Metric => {
                for _ in 0..self.repeats {
                    let _ = hostcalls::increment_metric(self.metric, 1);
                }
            }
            Call::SharedGet | Call::SharedCas => {
                // One header read to pick the key, as a per-client limiter does.
                let api_key = hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, "x-api-key")
                    .ok()
                    .flatten()
                    .unwrap_or_default();
                let key = format!("probe:{}", String::from_utf8_lossy(&api_key));
                for _ in 0..self.repeats {
                    let Ok((value, cas)) = hostcalls::get_shared_data(&key) else { continue };
                    if self.call == Call::SharedCas {
                        let mut bytes = value.unwrap_or_else(|| vec![0; 16]);
                        if let Some(first) = bytes.first_mut() {
                            *first = first.wrapping_add(1);
                        }
                        let _ = hostcalls::set_shared_data(&key, Some(&bytes), cas);
                    } else {
                        black_box(value);
                    }
                }
            }
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if self.call == Call::ResponseHeader {
            for _ in 0..self.repeats {
                let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, "x-probe", Some("1"));
            }
        }
        Action::Continue
    }
}
