//! Shared pieces of the notes tests: a configuration, and an organization with shared notes on
//! given stores.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    dead_code,
    unreachable_pub
)]

use std::sync::Arc;

use spacebot_core::testing::ScriptedLlm;
use spacebot_core::{AgentId, OrgConfig, Organization, Stores};
use spacebot_notes::Notes;

/// Agents `a`, `b` (writers of `plan`), `c` (reader of `plan`), `d` (no note), and `secret`
/// (a's alone).
pub const CONFIG: &str = r#"
[[agents]]
id = "a"
[[agents]]
id = "b"
[[agents]]
id = "c"
[[agents]]
id = "d"

[[notes]]
name = "plan"
description = "The team's plan"
text = "start"
writers = ["a", "b"]
readers = ["c"]

[[notes]]
name = "secret"
writers = ["a"]
"#;

pub fn agent(id: &str) -> AgentId {
    AgentId::parse(id).unwrap()
}

/// An organization built from `config` on `stores`, with `notes` (agents stopped).
pub async fn org(config: &str, stores: Stores, notes: &Notes) -> Organization {
    Organization::builder(OrgConfig::from_toml_str(config).unwrap())
        .stores(stores)
        .llm(Arc::new(ScriptedLlm::new()))
        .behaviour(Arc::new(notes.clone()))
        .build()
        .await
        .unwrap()
}
