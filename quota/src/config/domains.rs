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
        let mut domains = HashMap::new();
        for path in paths {
            let origin = path.display().to_string();
            let text =
                std::fs::read_to_string(path).map_err(|e| LimitsError::plain(&origin, format!("cannot read: {e}")))?;
            let domain = Self::parse_one(&origin, &text)?;
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

    /// Builds a config from domains already parsed (tests, embedding).
    pub fn from_domains(list: impl IntoIterator<Item = Domain>) -> Domains {
        Domains { domains: list.into_iter().map(|d| (d.name.clone(), d)).collect() }
    }
}
