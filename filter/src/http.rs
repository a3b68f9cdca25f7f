//! One request's context: its headers are decided on, its response gets
//! the rate-limit headers, and its permit is given back when it ends.

use std::rc::Rc;

use floodgate_core::algorithm::Release;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, MapType};

use crate::host;
use crate::metrics::increment;
use crate::plugin::{schedule_ticks, Plugin};
use crate::waiting::{Shared, Stage};

/// One request.
pub(crate) struct FloodgateHttp {
    pub(crate) plugin: Rc<Plugin>,
    pub(crate) context_id: u32,
    pub(crate) state: Shared,
}

impl Context for FloodgateHttp {
    /// The stream ended (completed, reset or failed): give the permit back.
    /// A request that was still waiting was never served, so its units are
    /// undone; a served one releases what it held while in flight.
    fn on_done(&mut self) -> bool {
        let plugin = Rc::clone(&self.plugin);
        let waiting = self.state.borrow().stage == Stage::Waiting;
        let permit = std::mem::take(&mut self.state.borrow_mut().permit);
        let counted = if waiting && plugin.waiting.borrow_mut().remove(self.context_id).is_some() {
            increment(&plugin.metrics.delay_abandoned, 1);
            if let Some(checked) = plugin.callouts.borrow_mut().forget(self.context_id) {
                plugin.release(checked, Release::Undo);
            }
            plugin.release(permit, Release::Undo);
            true
        } else {
            plugin.release(permit, Release::Done)
        };
        if counted {
            plugin.counted(host::now());
        }
        true
    }
}

impl HttpContext for FloodgateHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if self.state.borrow().stage != Stage::Deciding {
            return Action::Continue;
        }
        let plugin = Rc::clone(&self.plugin);
        let now = host::now();
        let held = plugin.callouts.borrow().hold_until();
        let action = plugin.decide(self.context_id, &self.state, now, now, false);
        plugin.post(now);
        let first_count = !plugin.unflushed.replace(true);
        // Calls to send, or held back until a new instant: the tick must know.
        let callouts = plugin.callouts.borrow();
        let calls = callouts.has_outgoing(now) || callouts.hold_until() != held;
        drop(callouts);
        if first_count || self.state.borrow().stage == Stage::Waiting || calls {
            schedule_ticks(&plugin, now);
        }
        action
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        // A limited request's local reply passes here too: its headers were
        // sent with it, so only a served request's are added.
        let state = self.state.borrow();
        if state.stage != Stage::Limited {
            for (name, value) in state.headers.iter() {
                if let Err(status) = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value) {
                    log::warn!("floodgate: could not add response header {name}: {status:?}");
                }
            }
        }
        Action::Continue
    }
}

/// A request while no configuration is in force: let through.
pub(crate) struct PassThrough;

impl Context for PassThrough {}

impl HttpContext for PassThrough {}
