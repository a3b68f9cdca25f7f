//! The limits file: envoyproxy/ratelimit's YAML shape, so its users can bring
//! their files, plus optional extensions: `algorithm`, and that algorithm's
//! own fields, which the core's registry lists and validates.
//!
//! Parsing happens in one pass with validation inside deserialization, so that
//! every error, including semantic ones (a zero limit, an unknown unit, a
//! duplicate entry), carries the YAML line and column and the field path.
//! The result is [`Domains`] that cannot hold an invalid rule.
//!
//! By concern: the validated [`Limit`] in `limit`; the descriptor tree of a
//! [`Domain`] and its lookup in `tree`; the YAML format in `file` (a level's
//! entries) and `rate_limit` (one `rate_limit`); [`Domains`], the set loaded
//! from the files, in `domains`; [`Watched`], their reload, in `watched`; and
//! [`LimitsError`] in the leaf `error`.

mod domains;
mod error;
mod file;
mod limit;
mod rate_limit;
mod tree;
mod watched;

pub use domains::Domains;
pub use error::LimitsError;
pub use file::MAX_NAME_LEN;
pub use limit::{offered_algorithms, Limit, DEFAULT_ALGORITHM};
pub use tree::{DescriptorRule, Domain, Node};
pub use watched::Watched;
