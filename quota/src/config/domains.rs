//! Every configured domain: loaded from the limits files, each defining one.

use std::collections::HashMap;
use std::path::PathBuf;

use super::error::LimitsError;
use super::file;
use super::tree::Domain;

/// Every configured domain.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Domains {
    domains: HashMap<String, Domain>,
}

impl Domains {
    /// The domain named `name`.
    pub fn domain(&self, name: &str) -> Option<&Domain> {
        self.domains.get(name)
    }

    /// The domains' names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.domains.keys().map(String::as_str)
    }

    /// Number of domains.
    pub fn len(&self) -> usize {
        self.domains.len()
    }

    /// True when no domain is configured.
    pub fn is_empty(&self) -> bool {
        self.domains.is_empty()
    }

    /// Parses one YAML document (one domain); `origin` names it in errors.
    pub fn parse_one(origin: &str, text: &str) -> Result<Domain, LimitsError> {
        file::parse(origin, text)
    }

    /// Reads and parses every file; each defines one domain, and a domain may
    /// be defined only once.
    pub fn load(paths: &[PathBuf]) -> Result<Domains, LimitsError> {
        let contents: Vec<Result<Vec<u8>, String>> =
            paths.iter().map(|path| std::fs::read(path).map_err(|e| e.to_string())).collect();
        Self::parse_files(paths, &contents)
    }

    /// Parses the files `paths` as read (`contents`, one per path: its bytes,
    /// or why it could not be read), as [`Domains::load`] does.
    pub fn parse_files(paths: &[PathBuf], contents: &[Result<Vec<u8>, String>]) -> Result<Domains, LimitsError> {
        let mut domains = HashMap::new();
        for (path, content) in paths.iter().zip(contents) {
            let origin = path.display().to_string();
            let bytes = content.as_ref().map_err(|e| LimitsError::plain(&origin, format!("cannot read: {e}")))?;
            let text = std::str::from_utf8(bytes)
                .map_err(|e| LimitsError::plain(&origin, format!("cannot read: not UTF-8 text: {e}")))?;
            let domain = Self::parse_one(&origin, text)?;
            if domains.contains_key(&domain.name) {
                return Err(LimitsError::plain(
                    &origin,
                    format!("domain {:?} is defined in more than one file", domain.name),
                ));
            }
            domains.insert(domain.name.clone(), domain);
        }
        Ok(Domains { domains })
    }

    /// Every descriptor limited now that `next` would leave without a rule
    /// (`no_rule`: unlimited, though no file says `unlimited: true`), as
    /// `domain: [key=value, key=*]` (a key-only entry: `*`), sorted; a
    /// domain `next` drops is one line, `domain: (every descriptor)`.
    pub fn dropped_limits(&self, next: &Domains) -> Vec<String> {
        let mut dropped = Vec::new();
        for (name, domain) in &self.domains {
            let paths = domain.limited_paths();
            let Some(after) = next.domain(name) else {
                if !paths.is_empty() {
                    dropped.push(format!("{name}: (every descriptor)"));
                }
                continue;
            };
            for path in paths.iter().filter(|path| after.rule_on_path(path).is_none()) {
                let entries: Vec<String> =
                    path.iter().map(|(key, value)| format!("{key}={}", value.as_deref().unwrap_or("*"))).collect();
                dropped.push(format!("{name}: [{}]", entries.join(", ")));
            }
        }
        dropped.sort();
        dropped
    }

    /// Builds a config from domains already parsed (tests, embedding).
    pub fn from_domains(list: impl IntoIterator<Item = Domain>) -> Domains {
        Domains { domains: list.into_iter().map(|d| (d.name.clone(), d)).collect() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn domains(texts: &[&str]) -> Domains {
        Domains::from_domains(texts.iter().filter_map(|t| Domains::parse_one("t", t).ok()))
    }

    const FULL: &str = "domain: edge\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 5}\n  - key: path\n    value: /login\n    rate_limit: {unit: minute, requests_per_unit: 5}\n  - key: path\n    descriptors:\n      - key: method\n        value: POST\n        rate_limit: {unit: minute, requests_per_unit: 100}\n";

    #[test]
    fn a_reload_that_leaves_limited_descriptors_without_a_rule_says_which() {
        let before = domains(&[FULL]);
        assert_eq!(before.dropped_limits(&before), Vec::<String>::new());
        // The file cut after its first descriptor: two limits gone.
        let cut = domains(&[
            "domain: edge\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 5}\n",
        ]);
        assert_eq!(before.dropped_limits(&cut), ["edge: [path=*, method=POST]", "edge: [path=/login]"]);
        // Said so: /login unlimited, the method rule under /login's own
        // entry is not a limit lost (any other path still has it).
        let said = FULL.replace("rate_limit: {unit: minute, requests_per_unit: 5}", "rate_limit: {unlimited: true}");
        assert_eq!(before.dropped_limits(&domains(&[&said])), Vec::<String>::new());
        // A key+value limit falling to a key-only one is still limited.
        let broader = domains(&["domain: edge\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 5}\n  - key: path\n    rate_limit: {unit: minute, requests_per_unit: 9}\n    descriptors:\n      - key: method\n        value: POST\n        rate_limit: {unit: minute, requests_per_unit: 100}\n"]);
        assert_eq!(before.dropped_limits(&broader), Vec::<String>::new());
        // A domain gone, or emptied.
        assert_eq!(before.dropped_limits(&Domains::default()), ["edge: (every descriptor)"]);
        let empty = domains(&["domain: edge\ndescriptors: []\n"]);
        assert_eq!(before.dropped_limits(&empty).len(), 3);
    }
}
