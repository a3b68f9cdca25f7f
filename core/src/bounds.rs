//! The largest amounts and spans a configuration may name, shared by the
//! parser, the algorithms and global mode. A leaf, like [`crate::error`].

use crate::time::Nanos;

/// The largest `limit`, `burst` or cost.
pub const MAX_AMOUNT: u64 = 1_000_000_000;

/// The longest duration a rule may name.
pub const MAX_PERIOD: Nanos = Nanos::from_secs(366 * 86_400);
