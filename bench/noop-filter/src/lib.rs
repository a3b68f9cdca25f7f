//! A proxy-wasm HTTP filter that does nothing: every request continues
//! untouched. The benchmark loads it as variant (c), the floor cost of any
//! wasm filter (VM entry per callback, header maps crossing the ABI), so
//! Floodgate's own cost is what it adds on top of this.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(NoopRoot) });
}}

/// The root context: hands out one [`Noop`] per request.
struct NoopRoot;

impl Context for NoopRoot {}

impl RootContext for NoopRoot {
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Noop))
    }
}

/// The per-request context: continues at once.
struct Noop;

impl Context for Noop {}

impl HttpContext for Noop {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        Action::Continue
    }
}
