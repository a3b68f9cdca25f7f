//! One request's context: its headers are decided on, its response gets
//! the rate-limit headers, and its permit is given back when it ends.

use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use crate::envoy::EnvoyHost;
use crate::host::Host;
use crate::outcome::{Outcome, Site};
use crate::plugin::{schedule_ticks, Plugin, RequestRef};
use crate::waiting::{Shared, Stage};

/// One request.
pub(crate) struct FloodgateHttp {
    pub(crate) plugin: Rc<Plugin<EnvoyHost>>,
    pub(crate) context_id: u32,
    pub(crate) state: Shared,
}

impl Context for FloodgateHttp {
    /// The stream ended (completed, reset or failed): give the permit back.
    fn on_done(&mut self) -> bool {
        self.plugin.ended(self.context_id, &self.state);
        true
    }
}

impl HttpContext for FloodgateHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if self.state.borrow().stage != Stage::Deciding {
            return Action::Continue;
        }
        let plugin = Rc::clone(&self.plugin);
        let now = plugin.host.now();
        let held = plugin.callouts.borrow().hold_until();
        let request = RequestRef { context_id: self.context_id, state: &self.state, since: now };
        let outcome = plugin.decide(Site::Handler, request, now, false);
        plugin.post(now);
        let first_count = !plugin.unflushed.replace(true);
        // Calls to send, or held back until a new instant: the tick must know.
        let callouts = plugin.callouts.borrow();
        let calls = callouts.has_outgoing(now) || callouts.hold_until() != held;
        drop(callouts);
        if first_count || matches!(outcome, Outcome::Pause(_)) || calls {
            schedule_ticks(&plugin, now);
        }
        action(outcome)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        // A limited request's local reply passes here too: its headers were
        // sent with it, so only a served request's are added.
        let state = self.state.borrow();
        if state.stage != Stage::Limited {
            for (name, value) in state.headers.iter() {
                if let Err(status) = self.plugin.host.add_response_header(name, value) {
                    log::warn!("floodgate: could not add response header {name}: {status:?}");
                }
            }
        }
        Action::Continue
    }
}

/// What a request's handler returns to Envoy: a request that is not let
/// through at once is paused (a local reply ends it).
fn action(outcome: Outcome) -> Action {
    if outcome.goes_on() {
        Action::Continue
    } else {
        Action::Pause
    }
}

/// A request while no configuration is in force: let through.
pub(crate) struct PassThrough;

impl Context for PassThrough {}

impl HttpContext for PassThrough {}
