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

/// One entry of a path down the tree: a key and its value, or any value
/// (a key-only entry).
pub type PathEntry = (String, Option<String>);

impl Domain {
    /// Every path down the tree to a limited rule (`Limited`), in no
    /// particular order.
    pub fn limited_paths(&self) -> Vec<Vec<PathEntry>> {
        let mut paths = Vec::new();
        let mut path = Vec::new();
        collect_limited(&self.root, &mut path, &mut paths);
        paths
    }

    /// The rule a descriptor following `path` (a key-only entry: any value
    /// this tree does not name) meets in this tree, if any.
    pub fn rule_on_path(&self, path: &[PathEntry]) -> Option<&DescriptorRule> {
        let mut node = &self.root;
        for (key, value) in path {
            let by_key = node.children.get(key)?;
            node = match value {
                Some(value) => by_key.values.get(value).or(by_key.any.as_ref())?,
                None => by_key.any.as_ref()?,
            };
        }
        if path.is_empty() {
            return None;
        }
        node.rule.as_ref()
    }
}

fn collect_limited(node: &Node, path: &mut Vec<PathEntry>, paths: &mut Vec<Vec<PathEntry>>) {
    if let (Some(DescriptorRule::Limited { .. }), false) = (&node.rule, path.is_empty()) {
        paths.push(path.clone());
    }
    for (key, entries) in &node.children {
        if let Some(any) = &entries.any {
            path.push((key.clone(), None));
            collect_limited(any, path, paths);
            path.pop();
        }
        for (value, child) in &entries.values {
            path.push((key.clone(), Some(value.clone())));
            collect_limited(child, path, paths);
            path.pop();
        }
    }
}

impl Domain {
    /// The rule for a set of entries in no particular order (an RLQS bucket
    /// id is a map), and the order that matches it: the entries ordered as
    /// the limits file nests their keys, the first such order found trying
    /// keys in ascending order (at most [`ORDER_STEPS`] steps of the search,
    /// so no set of entries makes it long). `None` when no order matches a
    /// rule.
    pub fn rule_for_set<'a>(&'a self, set: &[(String, String)]) -> Option<(Vec<(String, String)>, &'a DescriptorRule)> {
        let mut sorted: Vec<&(String, String)> = set.iter().collect();
        sorted.sort();
        let mut used = vec![false; sorted.len()];
        let mut path = Vec::with_capacity(sorted.len());
        let mut steps = ORDER_STEPS;
        let rule = order(&self.root, &sorted, &mut used, &mut path, &mut steps)?;
        Some((path.into_iter().filter_map(|i| sorted.get(i).map(|e| (*e).clone())).collect(), rule))
    }
}

/// Most nodes the search of [`Domain::rule_for_set`] visits.
pub const ORDER_STEPS: usize = 4_096;

/// Depth-first: at `node`, each entry not yet used whose key is a child
/// (its value's entry first, else the key-only one), until every entry is
/// used on a node with a rule.
fn order<'a>(
    node: &'a Node,
    entries: &[&(String, String)],
    used: &mut Vec<bool>,
    path: &mut Vec<usize>,
    steps: &mut usize,
) -> Option<&'a DescriptorRule> {
    if path.len() == entries.len() {
        return if path.is_empty() { None } else { node.rule.as_ref() };
    }
    for (i, (key, value)) in entries.iter().map(|e| (&e.0, &e.1)).enumerate() {
        if used.get(i).copied().unwrap_or(true) {
            continue;
        }
        let Some(by_key) = node.children.get(key) else { continue };
        let Some(next) = by_key.values.get(value).or(by_key.any.as_ref()) else { continue };
        *steps = steps.checked_sub(1)?;
        if let Some(slot) = used.get_mut(i) {
            *slot = true;
        }
        path.push(i);
        if let Some(rule) = order(next, entries, used, path, steps) {
            return Some(rule);
        }
        path.pop();
        if let Some(slot) = used.get_mut(i) {
            *slot = false;
        }
    }
    None
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

    #[test]
    fn a_set_of_entries_matches_in_the_order_the_file_nests_them() {
        let domain = Domains::parse_one("sample", SAMPLE).unwrap();
        // Given in any order, matched as [path, method].
        let (order, rule) = domain.rule_for_set(&pairs(&[("method", "POST"), ("path", "/x")])).unwrap();
        assert_eq!(order, pairs(&[("path", "/x"), ("method", "POST")]));
        assert_eq!(Some(rule), domain.rule_for(&order));
        assert!(domain.rule_for_set(&pairs(&[("path", "/login"), ("method", "POST")])).is_none());
        assert!(domain.rule_for_set(&pairs(&[("nope", "1")])).is_none());
        assert!(domain.rule_for_set(&[]).is_none());
        let many: Vec<(String, String)> = (0..16).map(|i| (format!("k{i}"), "v".to_string())).collect();
        assert!(domain.rule_for_set(&many).is_none());
    }
}
