//! The filter's quota client: everything one worker does with the quota
//! service. The client itself — what to send when, batching, matching
//! answers with their calls, applying them — is shared with the native
//! build (`floodgate_filter_common::quota`); here the worker's plugin is its
//! host (`client`): calls leave from the worker's root context, and a
//! request's check from the request's own.

mod client;

pub(crate) use client::{answer_body, answer_status};
pub(crate) use floodgate_filter_common::quota::{Callout, Callouts};
