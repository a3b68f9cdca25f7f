//! Envoy's dynamic module ABI (`v0.2.0`, Envoy 1.40): the only code that
//! crosses it, and the only `unsafe` code of the crate.
//!
//! Declared from `source/extensions/dynamic_modules/abi/abi.h` and checked
//! against the callbacks the Envoy 1.40 binary exports (`native/ABI.md`):
//! only what Floodgate uses. Two halves:
//!
//! - the callbacks (Envoy's functions), wrapped in safe types whose
//!   lifetimes are the ABI's: a [`Filter`] exists only during one event hook
//!   of one stream, and the bytes it lends (a header value, an attribute)
//!   are borrowed from it and cannot outlive the hook nor a call that may
//!   change them; a [`Definer`] only while a configuration is created, a
//!   [`ConfigEnvoy`] during one of a configuration's main-thread hooks, a
//!   [`CalloutAnswer`] during the hook that delivers it; a [`Scheduler`]
//!   and a [`ConfigScheduler`] are owned, and deleted when dropped;
//! - the event hooks (the module's functions Envoy calls), each of which
//!   turns its raw pointers into those types, hands them to the safe code
//!   (`crate::config`, `crate::stream`) and catches any panic there, so that
//!   none unwinds into Envoy: a hook that panicked logs it and answers as if
//!   the filter were not there (a request goes on).
//!
//! Threads: `envoy_dynamic_module_on_program_init`, a configuration's
//! creation, its scheduled events and its calls' answers run on Envoy's
//! main thread (its destruction where its last holder lets it go: the main
//! thread, or a worker whose stream held it last); every hook of a
//! stream runs on the worker thread that owns it, never two at once, and
//! Envoy never destroys a stream while one of its hooks is on the stack
//! (but a hook may complete it inline: see [`Filter::send_response`]).
//!
//! The library is linked with every symbol bound at load (`build.rs`): an
//! Envoy that lacks a callback used here refuses to load the module, naming
//! the callback, instead of failing at the first call.

mod callbacks;
mod hooks;

pub use callbacks::{
    log, log_enabled, Answered, AttributeId, CalloutAnswer, ConfigEnvoy, ConfigScheduler, Definer, Filter, LogLevel,
    MetadataSource, Scheduler,
};
