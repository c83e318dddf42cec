//! The organizations the test suites run: agents and links as TOML, without `[settings]` (add
//! them with [`with_settings`]).
//!
//! ```
//! use spacebot_core::config::OrgConfig;
//! use spacebot_core::testing::orgs;
//! let config = OrgConfig::from_toml_str(&orgs::with_settings("max_tool_rounds = 4", orgs::DELEGATION))?;
//! assert_eq!(config.agents.len(), 5);
//! assert_eq!(config.settings.max_tool_rounds, 4);
//! # Ok::<(), spacebot_core::config::ConfigError>(())
//! ```

/// `config` with `settings` in its `[settings]` table (`config` must have no `[settings]` of its
/// own).
pub fn with_settings(settings: &str, config: &str) -> String {
    format!("[settings]\n{settings}\n{config}")
}

/// Three agents: `a` (Alpha) superior of `b` (Beta) over a one-way link, `c` (Gamma) unlinked.
pub const RUNTIME: &str = r#"
[[agents]]
id = "a"
name = "Alpha"

[[agents]]
id = "b"
name = "Beta"

[[agents]]
id = "c"
name = "Gamma"

[[links]]
from = "a"
to = "b"
direction = "one_way"
relationship = "superior"
"#;

/// Five agents:
///
/// - `a` (Alpha) is the superior of `b` (Beta), `b` the superior of `c` (Gamma), two-way links;
/// - `c` and `a` are peers (two-way), so a chain a -> b -> c -> a is possible;
/// - `c` and `d` (Delta) are peers (two-way);
/// - `a` -> `d` is one-way: `d` may not start anything with `a`;
/// - `a` -> `e` (Echo) is disabled.
pub const DELEGATION: &str = r#"
[[agents]]
id = "a"
name = "Alpha"

[[agents]]
id = "b"
name = "Beta"

[[agents]]
id = "c"
name = "Gamma"

[[agents]]
id = "d"
name = "Delta"

[[agents]]
id = "e"
name = "Echo"

[[links]]
from = "a"
to = "b"
relationship = "superior"

[[links]]
from = "b"
to = "c"
relationship = "superior"

[[links]]
from = "c"
to = "a"

[[links]]
from = "c"
to = "d"

[[links]]
from = "a"
to = "d"
direction = "one_way"

[[links]]
from = "a"
to = "e"
enabled = false
"#;

/// Agents `a` (Alpha), `b` (Beta), `c` (Gamma), `d` (Delta). Links: `a -> b` one-way superior,
/// `a -> c` two-way peer, `a -> d` two-way peer; `b` and `c` are not linked to each other.
pub const CONVERSATION: &str = r#"
[[agents]]
id = "a"
name = "Alpha"

[[agents]]
id = "b"
name = "Beta"

[[agents]]
id = "c"
name = "Gamma"

[[agents]]
id = "d"
name = "Delta"

[[links]]
from = "a"
to = "b"
direction = "one_way"
relationship = "superior"

[[links]]
from = "a"
to = "c"
direction = "two_way"
relationship = "peer"

[[links]]
from = "a"
to = "d"
direction = "two_way"
relationship = "peer"
"#;
