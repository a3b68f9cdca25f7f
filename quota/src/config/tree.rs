//! One domain's limits as a tree of descriptor entries, and the lookup of a
//! request's descriptor in it (envoyproxy/ratelimit's rules).

use std::collections::HashMap;

use super::limit::Limit;

/// What a matched descriptor is subject to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DescriptorRule {
    /// Counted against `limit`; with `shadow` set, over-limit decisions are
    /// counted in metrics but reported as allowed.
    Limited {
        /// The limit.
        limit: Limit,
        /// `shadow_mode` from the file.
        shadow: bool,
    },
    /// `unlimited: true`: always allowed, never counted.
    Unlimited,
}

/// One level of the descriptor tree.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Node {
    pub(super) rule: Option<DescriptorRule>,
    pub(super) children: HashMap<String, KeyEntries>,
}

/// Entries of one key at one level: the key-only entry and key+value entries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct KeyEntries {
    pub(super) any: Option<Node>,
    pub(super) values: HashMap<String, Node>,
}

/// One domain's limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Domain {
    /// The domain name.
    pub name: String,
    pub(super) root: Node,
}

impl Domain {
    /// The rule for a request descriptor (ordered key/value entries), following
    /// envoyproxy/ratelimit: at each level a key+value entry wins over a
    /// key-only entry, and only the entry matching the last pair applies.
    pub fn rule_for<'a>(&'a self, entries: &[(String, String)]) -> Option<&'a DescriptorRule> {
        let mut node = &self.root;
        let last = entries.len().checked_sub(1)?;
        for (i, (key, value)) in entries.iter().enumerate() {
            let by_key = node.children.get(key)?;
            node = by_key.values.get(value).or(by_key.any.as_ref())?;
            if i == last {
                return node.rule.as_ref();
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::file::tests::{pairs, SAMPLE};
    use crate::config::Domains;

    #[test]
    fn key_and_value_wins_and_only_the_last_entry_applies() {
        let domain = Domains::parse_one("sample", SAMPLE).unwrap();
        // /login has no nested method entry: the key+value node wins at level 1
        // and has no children, so nothing matches.
        assert_eq!(domain.rule_for(&pairs(&[("path", "/login"), ("method", "POST")])), None);
        // Another path falls to the key-only entry, whose child matches.
        let Some(DescriptorRule::Limited { shadow, .. }) =
            domain.rule_for(&pairs(&[("path", "/x"), ("method", "POST")]))
        else {
            panic!()
        };
        assert!(shadow);
        // The key-only path node itself has no limit.
        assert_eq!(domain.rule_for(&pairs(&[("path", "/x")])), None);
        assert_eq!(domain.rule_for(&pairs(&[("path", "/x"), ("method", "GET")])), None);
        assert_eq!(domain.rule_for(&[]), None);
        assert_eq!(domain.rule_for(&pairs(&[("nope", "1")])), None);
    }
}
