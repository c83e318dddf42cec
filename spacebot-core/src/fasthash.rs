//! Maps keyed by ids the runtime made or validated (agent ids, envelope ids) hash with
//! `foldhash`'s fast hasher: std's SipHash resists hash flooding by chosen keys, which these keys
//! are not, and costs a few percent of a turn. Maps keyed by text from outside (channel ids,
//! idempotency keys) keep the default hasher.

use std::collections::{HashMap, HashSet};

/// A `HashMap` with `foldhash`'s fast hasher (seeded per process).
pub(crate) type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
/// A `HashSet` with `foldhash`'s fast hasher (seeded per process).
pub(crate) type FastSet<K> = HashSet<K, foldhash::fast::RandomState>;
