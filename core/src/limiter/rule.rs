//! A rule compiled for requests: the validated rule with its shared-data key
//! prefix, its headers' constant parts and the host's data, and the one way
//! every decision reaches a bucket group — address the group's key, then run
//! the measure-and-replace loop on it.

use std::cell::{Cell, RefCell};

use crate::config::Rule;
use crate::descriptor::RuleHasher;
use crate::global::settings::Fallback;
use crate::headers::RuleHeaders;
use crate::store::{measure_and_replace_group, GroupKey, KeyText, LoopError, Replaced, Step, Store, StoreError};
use crate::table::Table;

use super::reserves::Reserves;

/// Room for a group's key (see [`KeyText`]).
pub(super) type Key = KeyText;

/// Which of a rule's tables units came from, or that none did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Bucket {
    /// The rule's own table (a global rule's: its lease pools).
    Main,
    /// A global rule's local fall-back table.
    Fallback,
    /// No table here: the quota service decided (a check-mode rule), so
    /// nothing is held locally and nothing is given back.
    Service,
    /// The worker's reserve of the rule's table (`worker_batch`): units it
    /// took ahead; given back into the reserve.
    Reserve,
}

/// One rule, prepared once per configuration with everything a request needs:
/// the validated rule, its shared-data key prefix, the constant parts of its
/// headers, and whatever the host keeps per rule (`H`, e.g. metric ids).
#[derive(Debug)]
pub struct CompiledRule<H> {
    /// The rule as configured.
    pub rule: Rule,
    /// The host's data for this rule.
    pub host: H,
    /// `fg:<name>:`: a group's shared-data key is this and its number.
    key_prefix: String,
    /// `fg:<name>:fb:`: a group of its local fall-back's table is this and
    /// its number.
    fallback_prefix: String,
    /// The rule's place in its configuration: its tables' places among the
    /// configuration's (see [`GroupKey::table`]).
    index: usize,
    /// The constant parts of the rule's response headers.
    pub(crate) headers: RuleHeaders,
    /// A global rule's fall-back is in force, as this worker last saw the
    /// rule's mode in shared data.
    in_fallback: Cell<bool>,
    /// This worker's reserves, for a rule with `worker_batch`.
    pub(super) reserves: RefCell<Reserves>,
    /// A request may drop every entry of the rule's descriptor.
    pub(super) may_drop_every_entry: bool,
    /// The hash state of the rule's fingerprints before their entries.
    pub(super) hasher: RuleHasher,
}

impl<H> CompiledRule<H> {
    pub(super) fn new(index: usize, rule: Rule, host: H, headers: RuleHeaders, hash_key: (u64, u64)) -> Self {
        let key_prefix = format!("fg:{}:", rule.name);
        let fallback_prefix = format!("{key_prefix}fb:");
        let reserves =
            RefCell::new(if rule.worker_batch.is_some() { Reserves::with_room() } else { Reserves::default() });
        let may_drop_every_entry = crate::descriptor::may_drop_every_entry(&rule.descriptors);
        let hasher = crate::descriptor::rule_hasher(hash_key, &rule.name, &rule.descriptors);
        CompiledRule {
            rule,
            host,
            key_prefix,
            fallback_prefix,
            index,
            headers,
            in_fallback: Cell::new(false),
            reserves,
            may_drop_every_entry,
            hasher,
        }
    }

    /// True while this global rule uses its fall-back (as this worker knows).
    pub fn in_fallback(&self) -> bool {
        self.in_fallback.get()
    }

    pub(super) fn set_in_fallback(&self, in_fallback: bool) {
        self.in_fallback.set(in_fallback);
    }

    /// One of the rule's tables.
    pub(super) fn table(&self, bucket: Bucket) -> Option<&Table> {
        match bucket {
            Bucket::Main => Some(&self.rule.table),
            Bucket::Fallback => match self.rule.global.as_ref().map(|g| &g.fallback) {
                Some(Fallback::Local(table)) => Some(table),
                _ => None,
            },
            Bucket::Service | Bucket::Reserve => None,
        }
    }

    /// Every table the rule keeps in shared data.
    pub(super) fn tables(&self) -> impl Iterator<Item = (Bucket, &Table)> {
        [Bucket::Main, Bucket::Fallback].into_iter().filter_map(|bucket| Some((bucket, self.table(bucket)?)))
    }

    /// Creates the groups of every table that does not exist yet.
    pub(super) fn create_tables(&self, store: &dyn Store) -> Result<(), StoreError> {
        let mut key = Key::default();
        for (bucket, table) in self.tables() {
            // Groups are created in order, so the last one existing means all do.
            self.write_key(bucket, table.groups() - 1, &mut key)?;
            if store.get(key.as_str())?.is_some() {
                continue;
            }
            let empty = table.empty_group();
            for group in 0..table.groups() {
                self.write_key(bucket, group, &mut key)?;
                store.create_if_absent(key.as_str(), &empty)?;
            }
        }
        Ok(())
    }

    /// Runs the measure-and-replace loop on group `group` of one of the
    /// rule's tables: the one path from a decision to a bucket group.
    pub(super) fn on_group<T>(
        &self,
        store: &dyn Store,
        bucket: Bucket,
        group: u32,
        max_retries: u32,
        decide: impl FnMut(Vec<u8>) -> Step<T>,
    ) -> Result<Replaced<T>, LoopError> {
        measure_and_replace_group(store, self.group_key(bucket, group), max_retries, decide)
    }

    /// The address of group `group` of one of the rule's tables.
    pub(super) fn group_key(&self, bucket: Bucket, group: u32) -> GroupKey<'_> {
        let (table, prefix) = match bucket {
            Bucket::Fallback => (2 * self.index + 1, self.fallback_prefix.as_str()),
            Bucket::Main | Bucket::Service | Bucket::Reserve => (2 * self.index, self.key_prefix.as_str()),
        };
        GroupKey { table, prefix, group }
    }

    /// Writes the shared-data key of a bucket group into `key`:
    /// `fg:<rule>:<group>`, or `fg:<rule>:fb:<group>` for a global rule's
    /// local fall-back. It always fits (see [`Key`]); if it did not, that
    /// would be a store error rather than a wrong key.
    pub(super) fn write_key(&self, bucket: Bucket, group: u32, key: &mut Key) -> Result<(), StoreError> {
        if self.group_key(bucket, group).write(key) {
            Ok(())
        } else {
            Err(StoreError::Host)
        }
    }

    /// Writes the key of a global rule's mode, `fg:<rule>:mode`.
    pub(super) fn write_mode_key(&self, key: &mut Key) -> Result<(), StoreError> {
        key.clear();
        if key.push_str(&self.key_prefix) && key.push_str("mode") {
            Ok(())
        } else {
            Err(StoreError::Host)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn the_longest_key_fits() {
        let name = "n".repeat(64);
        let json = format!(r#"{{"rules": [{{"name": "{name}", "limit": 1, "period": "1s", "max_keys": 4}}]}}"#);
        let store = MemoryStore::default();
        let limiter = build(&json, &store);
        let mut key = Key::default();
        let most_groups = (crate::config::MAX_MAX_KEYS / 4 - 1) as u32;
        for (bucket, kind) in [(Bucket::Main, ""), (Bucket::Fallback, "fb:")] {
            assert_eq!(limiter.rules()[0].write_key(bucket, most_groups, &mut key), Ok(()));
            assert_eq!(key.as_str(), format!("fg:{name}:{kind}{most_groups}"));
        }
    }
}
