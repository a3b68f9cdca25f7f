//! What the lease folder's tests share: a rule's policy by algorithm name,
//! and a fresh bucket of it.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use crate::algorithm::{Params, Policy, Registration};
use crate::time::Nanos;

/// The policy of algorithm `name` with `limit` and the JSON `fields`.
pub(super) fn policy(name: &str, limit: u64, fields: &str) -> Arc<dyn Policy> {
    let fields = serde_json::from_str(fields).unwrap();
    Registration::find(name).unwrap().build(Params::new("rule", limit, fields)).unwrap()
}

/// A fresh bucket of `policy` at `now`.
pub(super) fn fresh(policy: &dyn Policy, now: Nanos) -> Vec<u8> {
    let mut state = vec![0; policy.state_len()];
    policy.write_fresh(&mut state, now);
    state
}
