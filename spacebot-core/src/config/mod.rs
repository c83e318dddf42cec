//! The organization's configuration: agents, links and settings, from TOML.
//!
//! ```toml
//! [[agents]]
//! id = "support"
//! name = "Support Agent"          # optional, defaults to the id
//! workspace = "agents/support"    # optional: where SOUL.md, IDENTITY.md, USER.md, ROLE.md live
//! context_window = 16384          # optional: this agent's model's window in tokens
//!
//! [[agents]]
//! id = "engineering"
//!
//! [[links]]
//! from = "support"
//! to = "engineering"
//! direction = "two_way"           # optional: one_way | two_way (default)
//! relationship = "subordinate"    # optional: peer (default) | superior | subordinate
//! enabled = true                  # optional, default true
//!
//! [settings]                      # optional, every key optional
//! approval = "never"              # never (default) | always | unless_superior
//! max_delegation_depth = 4
//! max_tool_rounds = 16
//! queue_capacity = 256
//! conversation_turn_budget = 20
//! context_window = 8192           # tokens, for agents without their own (see `context`)
//! compaction = true               # summarize history that no longer fits (default true)
//! ```
//!
//! A top-level table (or array of tables) that is none of these, such as `[[notes]]`, is a
//! behaviour's **section**: it is kept as it is in [`OrgConfig::sections`] for the behaviour that
//! claims it ([`Behaviour::config_section`](crate::Behaviour::config_section)), which checks it;
//! [`OrganizationBuilder::build`](crate::OrganizationBuilder::build) refuses a section no behaviour
//! claims, so a misspelt table still fails.
//!
//! [`OrgConfig::from_toml_str`] checks everything before returning: unknown keys, missing or
//! mistyped fields, bad agent ids, unknown enum values, duplicate agents, links to unknown agents,
//! self-links, duplicate pairs and reverse links whose relationships contradict each other. Every
//! problem found is reported, each naming its entry and field, and nothing is returned unless all
//! of it is valid. [`OrgConfig::sync_links`] then writes the links to a [`LinkStore`], config
//! winning over what the store holds.

mod error;
mod parse;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::StoreError;
use crate::ids::{AgentId, LinkId};
use crate::link::{AgentLink, LinkDirection, LinkRelationship, LinkStore};
use crate::policy::{ApprovalPolicy, LinkGraph};
use crate::time::Timestamp;

pub use error::{ConfigError, ConfigIssue};

/// A whole organization: its agents, their links, and runtime settings.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct OrgConfig {
    /// The agents, in file order.
    #[serde(default)]
    pub agents: Vec<AgentConfig>,
    /// The links, in file order.
    #[serde(default)]
    pub links: Vec<LinkConfig>,
    /// Runtime settings.
    #[serde(default)]
    pub settings: Settings,
    /// Behaviours' sections: every other top-level table or array of tables, by key, as written
    /// (checked by the behaviour that claims it, see
    /// [`Behaviour::config_section`](crate::Behaviour::config_section)).
    #[serde(flatten, default)]
    pub sections: std::collections::BTreeMap<String, toml::Value>,
}

/// One `[[agents]]` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentConfig {
    /// The agent's id.
    pub id: AgentId,
    /// Display name (defaults to the id).
    pub name: String,
    /// The directory holding the agent's identity files, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<PathBuf>,
    /// This agent's limits over a rolling period (`limits = { period = "day", total_tokens =
    /// 50000 }`), besides [`Settings::agent_limits`]: see [`crate::limits`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<crate::limits::PeriodLimits>,
    /// The context window of the agent's model in tokens (see [`crate::context`]); `None`: the
    /// organization's `[settings] context_window`, else the provider's, else the default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_window: Option<u32>,
    /// The entry's other fields, as written: each is a behaviour's per-agent setting (MCP's
    /// `tools = ["files:*"]`, say), read and checked by the behaviour that claims it (see
    /// [`Behaviour::agent_fields`](crate::Behaviour::agent_fields)); a field no behaviour claims
    /// fails the build ([`OrgConfig::check_agent_fields`]).
    #[serde(flatten, default, skip_serializing_if = "toml::Table::is_empty")]
    pub fields: toml::Table,
}

/// One `[[links]]` entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkConfig {
    /// The agent the link starts from.
    pub from: AgentId,
    /// The agent the link points to.
    pub to: AgentId,
    /// Who may start an exchange (default two-way).
    #[serde(default = "default_direction")]
    pub direction: LinkDirection,
    /// What `from` is to `to` (default peer).
    #[serde(default = "default_relationship")]
    pub relationship: LinkRelationship,
    /// Whether the link allows anything (default true).
    #[serde(default = "default_true")]
    pub enabled: bool,
}

fn default_direction() -> LinkDirection {
    LinkDirection::TwoWay
}
fn default_relationship() -> LinkRelationship {
    LinkRelationship::Peer
}
fn default_true() -> bool {
    true
}

impl LinkConfig {
    /// The id a config link gets when it is first written to a store: `{from}:{to}`. (A link that
    /// already exists for the pair keeps its id.)
    pub fn link_id(&self) -> LinkId {
        LinkId::new(format!("{}:{}", self.from, self.to))
    }

    /// This link as an [`AgentLink`] created and updated at `now`.
    pub fn to_link(&self, now: Timestamp) -> AgentLink {
        AgentLink {
            id: self.link_id(),
            from: self.from.clone(),
            to: self.to.clone(),
            direction: self.direction,
            relationship: self.relationship,
            enabled: self.enabled,
            created_at: now,
            updated_at: now,
        }
    }
}

/// The optional `[settings]` table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    /// Whether delegated tasks wait for approval (default [`ApprovalPolicy::Never`]).
    pub approval: ApprovalPolicy,
    /// The longest delegation chain, in hops (default 4).
    pub max_delegation_depth: usize,
    /// Tool rounds allowed in one model turn (default 16).
    pub max_tool_rounds: u32,
    /// Capacity of each agent's inbound queue (default 256).
    pub queue_capacity: usize,
    /// Turns a conversation may take before it is severed (default 20).
    pub conversation_turn_budget: u32,
    /// Tasks one agent works on at the same time (default 1). Tasks run as turns of the agent's own
    /// tool loop go through its queue one at a time whatever this says; custom task executors run
    /// up to this many at once.
    pub task_concurrency: usize,
    /// Tool calls run from one model response (default 32). Calls past it are not run: each is
    /// answered to the model as an error, so one response cannot fan out into thousands of effects.
    pub max_tool_calls_per_response: u32,
    /// Limits on what every request may spend (`[settings.limits]`; none by default): see
    /// [`crate::limits`].
    #[serde(skip_serializing_if = "crate::limits::Limits::is_none")]
    pub limits: crate::limits::Limits,
    /// Limits of every agent over a rolling period (`[settings.agent_limits]`, with `period =
    /// "hour"` or `"day"`; none by default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent_limits: Option<crate::limits::PeriodLimits>,
    /// Limits of the whole organization over a rolling period (`[settings.org_limits]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub org_limits: Option<crate::limits::PeriodLimits>,
    /// What each model's tokens cost (`[settings.prices."model"]` with `input_per_million` and
    /// `output_per_million`; `default` prices every model without its own entry): spend gets a
    /// cost, and `cost` limits bind. Looked up by [`LlmProvider::default_model`](crate::llm::LlmProvider::default_model).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub prices: std::collections::BTreeMap<String, crate::limits::Price>,
    /// The context window in tokens of agents without their own (`[[agents]] context_window`);
    /// `None` (the default): what the provider reports, else
    /// [`DEFAULT_CONTEXT_WINDOW`](crate::context::DEFAULT_CONTEXT_WINDOW). See [`crate::context`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context_window: Option<u32>,
    /// Whether history that no longer fits the window is summarized (default true) or left out.
    pub compaction: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            approval: ApprovalPolicy::Never,
            max_delegation_depth: 4,
            max_tool_rounds: 16,
            queue_capacity: 256,
            conversation_turn_budget: 20,
            task_concurrency: 1,
            max_tool_calls_per_response: 32,
            limits: crate::limits::Limits::NONE,
            agent_limits: None,
            org_limits: None,
            prices: std::collections::BTreeMap::new(),
            context_window: None,
            compaction: true,
        }
    }
}

impl OrgConfig {
    /// Checks a configuration built in code (or deserialized with serde, which checks only the
    /// shape) by the same rules, and with the same messages, as [`from_toml_str`](Self::from_toml_str).
    ///
    /// ```
    /// use spacebot_core::config::{AgentConfig, OrgConfig};
    /// use spacebot_core::AgentId;
    /// let agent = AgentConfig {
    ///     id: AgentId::parse("a").unwrap(),
    ///     name: "A".into(),
    ///     workspace: None,
    ///     limits: None,
    ///     context_window: None,
    ///     fields: Default::default(),
    /// };
    /// let config = OrgConfig { agents: vec![agent.clone(), agent], ..Default::default() };
    /// let err = config.validate().unwrap_err();
    /// assert!(err.to_string().contains("agents[1] (a): field \"id\": duplicate agent id"));
    /// ```
    pub fn validate(&self) -> Result<(), ConfigError> {
        let text = self.to_toml_string().map_err(|e| ConfigError::Syntax {
            path: None,
            message: e.to_string(),
        })?;
        Self::from_toml_str(&text).map(|_| ())
    }

    /// Reads and validates the configuration file at `path`; errors name the file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml_str(&text).map_err(|e| e.with_path(path))
    }

    /// The configuration as TOML text (which [`from_toml_str`](Self::from_toml_str) reads back).
    pub fn to_toml_string(&self) -> Result<String, toml::ser::Error> {
        toml::to_string(self)
    }

    /// The behaviour's section `name` (`[name]` or `[[name]]`), as written.
    pub fn section(&self, name: &str) -> Option<&toml::Value> {
        self.sections.get(name)
    }

    /// Refuses every section none of `claimed` names (a misspelt table, a behaviour not
    /// assembled), each an issue naming it.
    ///
    /// ```
    /// use spacebot_core::config::OrgConfig;
    /// let config = OrgConfig::from_toml_str("[[notse]]\nname = \"plan\"").unwrap();
    /// let err = config.check_sections(&["notes"]).unwrap_err();
    /// assert!(err.to_string().contains("top level: field \"notse\": no behaviour claims this section"));
    /// assert!(OrgConfig::default().check_sections(&[]).is_ok());
    /// ```
    pub fn check_sections(&self, claimed: &[&str]) -> Result<(), ConfigError> {
        let issues: Vec<ConfigIssue> = self
            .sections
            .keys()
            .filter(|key| !claimed.contains(&key.as_str()))
            .map(|key| ConfigIssue {
                entry: "top level".to_owned(),
                field: Some(key.clone()),
                problem: format!(
                    "no behaviour claims this section; expected agents, links, settings{}",
                    claimed.iter().map(|c| format!(", {c}")).collect::<String>()
                ),
            })
            .collect();
        if issues.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid { path: None, issues })
        }
    }

    /// Refuses every field of an `[[agents]]` entry that is not `id`, `name` or `workspace` and
    /// that none of `claimed` names (a misspelt field, a behaviour not assembled), each an issue
    /// naming the entry and the field.
    ///
    /// ```
    /// use spacebot_core::config::OrgConfig;
    /// let config = OrgConfig::from_toml_str("[[agents]]\nid = \"a\"\ntols = [\"x:*\"]").unwrap();
    /// let err = config.check_agent_fields(&["tools"]).unwrap_err();
    /// assert!(err.to_string().contains("agents[0] (a): field \"tols\": unknown field; expected id, name, workspace, limits, tools"));
    /// assert!(OrgConfig::default().check_agent_fields(&[]).is_ok());
    /// ```
    pub fn check_agent_fields(&self, claimed: &[&str]) -> Result<(), ConfigError> {
        let mut issues = Vec::new();
        for (i, agent) in self.agents.iter().enumerate() {
            for key in agent.fields.keys() {
                if !claimed.contains(&key.as_str()) {
                    issues.push(ConfigIssue {
                        entry: format!("agents[{i}] ({})", agent.id),
                        field: Some(key.clone()),
                        problem: format!(
                            "unknown field; expected id, name, workspace, limits{}",
                            claimed.iter().map(|c| format!(", {c}")).collect::<String>()
                        ),
                    });
                }
            }
        }
        if issues.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid { path: None, issues })
        }
    }

    /// The agent with this id.
    pub fn agent(&self, id: &str) -> Option<&AgentConfig> {
        self.agents.iter().find(|a| a.id.as_str() == id)
    }

    /// The display name of agent `id` (the id itself for an agent not in the config).
    pub fn name_of<'a>(&'a self, id: &'a str) -> &'a str {
        self.agent(id).map_or(id, |a| a.name.as_str())
    }

    /// The agents' ids, in file order.
    pub fn agent_ids(&self) -> impl Iterator<Item = &AgentId> {
        self.agents.iter().map(|a| &a.id)
    }

    /// The configured links as [`AgentLink`]s created and updated at `now`, with ids
    /// [`LinkConfig::link_id`].
    pub fn links_at(&self, now: Timestamp) -> Vec<AgentLink> {
        self.links.iter().map(|l| l.to_link(now)).collect()
    }

    /// Writes the configured links to `store` in one atomic
    /// [`upsert_all`](LinkStore::upsert_all): config wins over what the store holds for the same
    /// pair (the stored link keeps its id and creation time); links the config does not name are
    /// left alone.
    pub async fn sync_links(
        &self,
        store: &dyn LinkStore,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        store.upsert_all(&self.links_at(now)).await
    }

    /// What [`sync_links`](Self::sync_links) would change in `stored` (the link store's links):
    /// one sentence per configured link that was changed or deleted at run time and that the
    /// configuration resets. The configuration wins for the links it names; links it does not
    /// name (created at run time) are kept and not listed. `spacebot serve` prints these as
    /// warnings before it starts.
    pub fn link_resets(&self, stored: &[AgentLink]) -> Vec<String> {
        let mut resets = Vec::new();
        for want in &self.links {
            let found = stored
                .iter()
                .find(|l| l.from == want.from && l.to == want.to);
            let Some(have) = found else {
                resets.push(format!(
                    "link {} -> {} was deleted at run time; the configuration restores it ({}, {}, {})",
                    want.from,
                    want.to,
                    want.direction,
                    want.relationship,
                    if want.enabled { "enabled" } else { "disabled" }
                ));
                continue;
            };
            let mut changes = Vec::new();
            if have.enabled != want.enabled {
                let word = |on: bool| if on { "enabled" } else { "disabled" };
                changes.push(format!("{} -> {}", word(have.enabled), word(want.enabled)));
            }
            if have.direction != want.direction {
                changes.push(format!("{} -> {}", have.direction, want.direction));
            }
            if have.relationship != want.relationship {
                changes.push(format!("{} -> {}", have.relationship, want.relationship));
            }
            if !changes.is_empty() {
                resets.push(format!(
                    "link {} -> {} was changed at run time; the configuration resets it: {}",
                    want.from,
                    want.to,
                    changes.join(", ")
                ));
            }
        }
        resets
    }

    /// A policy snapshot of the configured agents and links (link ids as in
    /// [`links_at`](Self::links_at)). Once links are synced to a store, the runtime's snapshot
    /// comes from the store ([`LinkGraph::load`]), which also holds links created at run time.
    pub fn graph(&self) -> LinkGraph {
        LinkGraph::new(self.agent_ids().cloned(), self.links_at(Timestamp(0)))
    }
}
