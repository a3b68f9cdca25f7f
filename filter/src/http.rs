//! One request's context: its headers are decided on (a check-mode rule's
//! check leaves from here, and its answer comes back here), its response
//! gets the rate-limit headers, and its permit is given back when it ends.

use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use crate::envoy::EnvoyHost;
use crate::host::Host;
use crate::outcome::{Outcome, Site};
use crate::plugin::{schedule_ticks, Plugin, RequestRef};
use crate::quota::{answer_body, answer_status};
use crate::waiting::{Shared, Stage, Wait};

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

    /// The answer to this request's check (its only call): the request is
    /// finished here, in its own context, as the root would finish it.
    fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize, _num_trailers: usize) {
        let plugin = Rc::clone(&self.plugin);
        let body = answer_body(&plugin.host, body_size);
        let Some(callout) = plugin.callouts.borrow_mut().answered(token_id) else { return };
        let now = plugin.host.now();
        plugin.current.set(Some((self.context_id, false)));
        plugin.callback_now.set(Some(now));
        plugin.answered(callout, || answer_status(&plugin.host, num_headers), body);
        plugin.callback_now.set(None);
        plugin.current.set(None);
        if plugin.modes_changed.take() {
            plugin.metrics.set_modes(&plugin.host, &plugin.limiter);
        }
        // Anything it queued leaves from the root.
        plugin.post(now);
        plugin.settle_calls(now);
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
        plugin.current.set(Some((self.context_id, true)));
        plugin.callback_now.set(Some(now));
        let mut outcome = plugin.decide(Site::Handler, request, now, false);
        if outcome == Outcome::Pause(Wait::Answer) {
            // Its check leaves now, as its own call. One the host would not
            // send is decided at once by the fall-back.
            plugin.send_check(self.context_id);
            outcome = match self.state.borrow().stage {
                Stage::Waiting => outcome,
                Stage::Limited => Outcome::Reply,
                Stage::Deciding | Stage::Passed => Outcome::Continue,
            };
        }
        plugin.callback_now.set(None);
        plugin.current.set(None);
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
