//! The organization's configuration: agents, links and settings, from TOML.
//!
//! ```toml
//! [[agents]]
//! id = "support"
//! name = "Support Agent"          # optional, defaults to the id
//! workspace = "agents/support"    # optional: where SOUL.md, IDENTITY.md, USER.md, ROLE.md live
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
//! ```
//!
//! [`OrgConfig::from_toml_str`] checks everything before returning: unknown keys, missing or
//! mistyped fields, bad agent ids, unknown enum values, duplicate agents, links to unknown agents,
//! self-links, duplicate pairs and reverse links whose relationships contradict each other. Every
//! problem found is reported, each naming its entry and field, and nothing is returned unless all
//! of it is valid. [`OrgConfig::sync_links`] then writes the links to a [`LinkStore`], config
//! winning over what the store holds.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::StoreError;
use crate::ids::{AgentId, LinkId};
use crate::link::{AgentLink, LinkDirection, LinkRelationship, LinkStore};
use crate::policy::{ApprovalPolicy, LinkGraph};
use crate::time::Timestamp;

/// A whole organization: its agents, their links, and runtime settings.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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
}

/// One `[[agents]]` entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// The agent's id.
    pub id: AgentId,
    /// Display name (defaults to the id).
    pub name: String,
    /// The directory holding the agent's identity files, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<PathBuf>,
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
        }
    }
}

/// One problem in a configuration: the entry, the field (when one is at fault) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigIssue {
    /// The entry, such as `links[2] (support -> engineering)`, `agents[0] (support)` or `settings`.
    pub entry: String,
    /// The field at fault, if one is.
    pub field: Option<String>,
    /// What is wrong.
    pub problem: String,
}

impl fmt::Display for ConfigIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.field {
            Some(field) => write!(f, "{}: field \"{}\": {}", self.entry, field, self.problem),
            None => write!(f, "{}: {}", self.entry, self.problem),
        }
    }
}

fn list_issues(issues: &[ConfigIssue]) -> String {
    issues
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

fn origin(path: &Option<PathBuf>) -> String {
    path.as_ref()
        .map(|p| format!(" {}", p.display()))
        .unwrap_or_default()
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read organization config {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The text is not valid TOML.
    #[error("organization config{} is not valid TOML: {message}", origin(path))]
    Syntax {
        /// The file, when loaded from one.
        path: Option<PathBuf>,
        /// The parser's message, with line and column.
        message: String,
    },
    /// The TOML is well-formed but some entries are invalid; every problem found is listed.
    #[error("invalid organization config{}: {}", origin(path), list_issues(issues))]
    Invalid {
        /// The file, when loaded from one.
        path: Option<PathBuf>,
        /// Every problem, in file order.
        issues: Vec<ConfigIssue>,
    },
}

impl ConfigError {
    /// The problems, for [`ConfigError::Invalid`]; empty otherwise.
    pub fn issues(&self) -> &[ConfigIssue] {
        match self {
            Self::Invalid { issues, .. } => issues,
            _ => &[],
        }
    }

    fn with_path(self, file: &Path) -> Self {
        match self {
            Self::Syntax { message, .. } => Self::Syntax {
                path: Some(file.to_owned()),
                message,
            },
            Self::Invalid { issues, .. } => Self::Invalid {
                path: Some(file.to_owned()),
                issues,
            },
            other => other,
        }
    }
}

/// Reads the fields of one TOML table, recording every problem against the entry.
struct Entry<'a> {
    name: String,
    table: &'a toml::Table,
    issues: &'a mut Vec<ConfigIssue>,
}

impl<'a> Entry<'a> {
    fn issue(&mut self, field: Option<&str>, problem: impl Into<String>) {
        self.issues.push(ConfigIssue {
            entry: self.name.clone(),
            field: field.map(str::to_owned),
            problem: problem.into(),
        });
    }

    fn unknown_fields(&mut self, allowed: &[&str]) {
        let unknown: Vec<String> = self
            .table
            .keys()
            .filter(|k| !allowed.contains(&k.as_str()))
            .cloned()
            .collect();
        for key in unknown {
            let problem = format!("unknown field; expected {}", allowed.join(", "));
            self.issue(Some(&key), problem);
        }
    }

    fn opt_str(&mut self, field: &str) -> Option<&'a str> {
        match self.table.get(field)? {
            toml::Value::String(s) => Some(s),
            other => {
                let problem = format!("expected a string, found {}", describe(other));
                self.issue(Some(field), problem);
                None
            }
        }
    }

    fn required_str(&mut self, field: &str) -> Option<&'a str> {
        if !self.table.contains_key(field) {
            self.issue(Some(field), "missing");
            return None;
        }
        self.opt_str(field)
    }

    fn agent_id(&mut self, field: &str) -> Option<AgentId> {
        let text = self.required_str(field)?;
        match AgentId::parse(text) {
            Ok(id) => Some(id),
            Err(e) => {
                self.issue(Some(field), e.to_string());
                None
            }
        }
    }

    /// An optional text enum; `Ok(None)` when absent, `Err(())` when invalid (already recorded).
    fn opt_enum<T>(&mut self, field: &str) -> Result<Option<T>, ()>
    where
        T: std::str::FromStr<Err = crate::error::InvalidInput>,
    {
        if !self.table.contains_key(field) {
            return Ok(None);
        }
        let text = self.opt_str(field).ok_or(())?;
        match text.parse::<T>() {
            Ok(v) => Ok(Some(v)),
            Err(e) => {
                self.issue(Some(field), e.reason);
                Err(())
            }
        }
    }

    fn opt_bool(&mut self, field: &str) -> Result<Option<bool>, ()> {
        match self.table.get(field) {
            None => Ok(None),
            Some(toml::Value::Boolean(b)) => Ok(Some(*b)),
            Some(other) => {
                let problem = format!("expected true or false, found {}", describe(other));
                self.issue(Some(field), problem);
                Err(())
            }
        }
    }

    /// An optional positive integer no larger than `max`.
    fn opt_count(&mut self, field: &str, max: u64) -> Result<Option<u64>, ()> {
        match self.table.get(field) {
            None => Ok(None),
            Some(toml::Value::Integer(n)) if *n >= 1 && (*n as u64) <= max => Ok(Some(*n as u64)),
            Some(other) => {
                let problem = format!(
                    "expected a whole number from 1 to {max}, found {}",
                    describe(other)
                );
                self.issue(Some(field), problem);
                Err(())
            }
        }
    }
}

fn describe(value: &toml::Value) -> String {
    match value {
        toml::Value::String(s) => format!("string {s:?}"),
        toml::Value::Integer(n) => format!("integer {n}"),
        toml::Value::Float(x) => format!("float {x}"),
        toml::Value::Boolean(b) => format!("boolean {b}"),
        toml::Value::Datetime(d) => format!("datetime {d}"),
        toml::Value::Array(_) => "an array".to_owned(),
        toml::Value::Table(_) => "a table".to_owned(),
    }
}

/// The tables of an array-of-tables key, or an issue.
fn tables<'a>(
    root: &'a toml::Table,
    key: &str,
    issues: &mut Vec<ConfigIssue>,
) -> Vec<Option<&'a toml::Table>> {
    match root.get(key) {
        None => Vec::new(),
        Some(toml::Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                toml::Value::Table(t) => Some(t),
                other => {
                    issues.push(ConfigIssue {
                        entry: format!("{key}[{i}]"),
                        field: None,
                        problem: format!("expected a table ([[{key}]]), found {}", describe(other)),
                    });
                    None
                }
            })
            .collect(),
        Some(other) => {
            issues.push(ConfigIssue {
                entry: key.to_owned(),
                field: None,
                problem: format!(
                    "expected an array of tables ([[{key}]]), found {}",
                    describe(other)
                ),
            });
            Vec::new()
        }
    }
}

fn agent_entry_name(i: usize, table: &toml::Table) -> String {
    match table.get("id").and_then(toml::Value::as_str) {
        Some(id) => format!("agents[{i}] ({id})"),
        None => format!("agents[{i}]"),
    }
}

fn link_entry_name(i: usize, table: &toml::Table) -> String {
    let end = |k: &str| table.get(k).and_then(toml::Value::as_str).unwrap_or("?");
    if table.contains_key("from") || table.contains_key("to") {
        format!("links[{i}] ({} -> {})", end("from"), end("to"))
    } else {
        format!("links[{i}]")
    }
}

impl OrgConfig {
    /// Parses and validates a configuration (see the [module docs](self)).
    ///
    /// ```
    /// use spacebot_core::config::OrgConfig;
    /// let config = OrgConfig::from_toml_str(r#"
    ///     [[agents]]
    ///     id = "support"
    ///     [[agents]]
    ///     id = "engineering"
    ///     [[links]]
    ///     from = "support"
    ///     to = "engineering"
    ///     direction = "sideways"
    /// "#);
    /// assert_eq!(
    ///     config.unwrap_err().to_string(),
    ///     "invalid organization config: links[0] (support -> engineering): field \"direction\": \
    ///      unknown value \"sideways\"; expected one of: one_way, two_way"
    /// );
    /// ```
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let root: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Syntax {
            path: None,
            message: e.to_string().trim_end().to_owned(),
        })?;
        let mut issues = Vec::new();

        for key in root.keys() {
            if !matches!(key.as_str(), "agents" | "links" | "settings") {
                issues.push(ConfigIssue {
                    entry: "top level".to_owned(),
                    field: Some(key.clone()),
                    problem: "unknown key; expected agents, links, settings".to_owned(),
                });
            }
        }

        let agents = Self::read_agents(&root, &mut issues);
        let links = Self::read_links(&root, &agents, &mut issues);
        let settings = Self::read_settings(&root, &mut issues);

        if issues.is_empty() {
            Ok(Self {
                agents: agents.into_iter().flatten().collect(),
                links: links.into_iter().flatten().collect(),
                settings,
            })
        } else {
            Err(ConfigError::Invalid { path: None, issues })
        }
    }

    fn read_agents(root: &toml::Table, issues: &mut Vec<ConfigIssue>) -> Vec<Option<AgentConfig>> {
        let mut first_seen: HashMap<AgentId, usize> = HashMap::new();
        let mut out = Vec::new();
        for (i, table) in tables(root, "agents", issues).into_iter().enumerate() {
            let Some(table) = table else {
                out.push(None);
                continue;
            };
            let mut e = Entry {
                name: agent_entry_name(i, table),
                table,
                issues,
            };
            e.unknown_fields(&["id", "name", "workspace"]);
            let id = e.agent_id("id");
            let name = e.opt_str("name").map(str::to_owned);
            let name_bad = e.table.contains_key("name") && name.is_none();
            let workspace = e.opt_str("workspace").map(PathBuf::from);
            let workspace_bad = e.table.contains_key("workspace") && workspace.is_none();
            if let Some(id) = &id {
                if let Some(first) = first_seen.get(id) {
                    e.issue(
                        Some("id"),
                        format!("duplicate agent id \"{id}\" (first defined by agents[{first}])"),
                    );
                    out.push(None);
                    continue;
                }
                first_seen.insert(id.clone(), i);
            }
            out.push(match id {
                Some(id) if !name_bad && !workspace_bad => Some(AgentConfig {
                    name: name.unwrap_or_else(|| id.to_string()),
                    id,
                    workspace,
                }),
                _ => None,
            });
        }
        out
    }

    fn read_links(
        root: &toml::Table,
        agents: &[Option<AgentConfig>],
        issues: &mut Vec<ConfigIssue>,
    ) -> Vec<Option<LinkConfig>> {
        let known: std::collections::HashSet<&str> =
            agents.iter().flatten().map(|a| a.id.as_str()).collect();
        let mut by_pair: HashMap<(AgentId, AgentId), (usize, LinkRelationship)> = HashMap::new();
        let mut out = Vec::new();
        for (i, table) in tables(root, "links", issues).into_iter().enumerate() {
            let Some(table) = table else {
                out.push(None);
                continue;
            };
            let mut e = Entry {
                name: link_entry_name(i, table),
                table,
                issues,
            };
            e.unknown_fields(&["from", "to", "direction", "relationship", "enabled"]);
            let from = e.agent_id("from");
            let to = e.agent_id("to");
            let direction = e.opt_enum::<LinkDirection>("direction");
            let relationship = e.opt_enum::<LinkRelationship>("relationship");
            let enabled = e.opt_bool("enabled");
            let mut ok = direction.is_ok() && relationship.is_ok() && enabled.is_ok();
            for (field, end) in [("from", &from), ("to", &to)] {
                if let Some(id) = end.as_ref().filter(|id| !known.contains(id.as_str())) {
                    e.issue(
                        Some(field),
                        format!("unknown agent \"{id}\" (not in [[agents]])"),
                    );
                    ok = false;
                }
            }
            let (Some(from), Some(to)) = (from, to) else {
                out.push(None);
                continue;
            };
            if from == to {
                e.issue(
                    Some("to"),
                    format!("a link cannot join \"{from}\" to itself"),
                );
                out.push(None);
                continue;
            }
            let relationship_value = relationship
                .ok()
                .flatten()
                .unwrap_or_else(default_relationship);
            if let Some((first, _)) = by_pair.get(&(from.clone(), to.clone())) {
                let problem = format!(
                    "duplicate of links[{first}]: only one link per ordered pair ({from} -> {to})"
                );
                e.issue(None, problem);
                ok = false;
            } else if let Some((first, first_rel)) = by_pair.get(&(to.clone(), from.clone()))
                && relationship.is_ok()
                && relationship_value != first_rel.reversed()
            {
                let problem = format!(
                    "\"{relationship_value}\" contradicts links[{first}] ({to} -> {from}), \
                     which makes \"{from}\" {} to \"{to}\"",
                    first_rel.reversed(),
                );
                e.issue(Some("relationship"), problem);
                ok = false;
            }
            by_pair
                .entry((from.clone(), to.clone()))
                .or_insert((i, relationship_value));
            out.push(match (ok, direction, enabled) {
                (true, Ok(direction), Ok(enabled)) => Some(LinkConfig {
                    from,
                    to,
                    direction: direction.unwrap_or_else(default_direction),
                    relationship: relationship_value,
                    enabled: enabled.unwrap_or(true),
                }),
                _ => None,
            });
        }
        out
    }

    fn read_settings(root: &toml::Table, issues: &mut Vec<ConfigIssue>) -> Settings {
        let mut settings = Settings::default();
        let table = match root.get("settings") {
            None => return settings,
            Some(toml::Value::Table(t)) => t,
            Some(other) => {
                issues.push(ConfigIssue {
                    entry: "settings".to_owned(),
                    field: None,
                    problem: format!("expected a table ([settings]), found {}", describe(other)),
                });
                return settings;
            }
        };
        let mut e = Entry {
            name: "settings".to_owned(),
            table,
            issues,
        };
        e.unknown_fields(&[
            "approval",
            "max_delegation_depth",
            "max_tool_rounds",
            "queue_capacity",
            "conversation_turn_budget",
            "task_concurrency",
            "max_tool_calls_per_response",
        ]);
        if let Ok(Some(approval)) = e.opt_enum::<ApprovalPolicy>("approval") {
            settings.approval = approval;
        }
        let small = u64::from(u32::MAX);
        if let Ok(Some(n)) = e.opt_count("max_delegation_depth", small) {
            settings.max_delegation_depth = usize::try_from(n).unwrap_or(usize::MAX);
        }
        if let Ok(Some(n)) = e.opt_count("max_tool_rounds", small) {
            settings.max_tool_rounds = u32::try_from(n).unwrap_or(u32::MAX);
        }
        if let Ok(Some(n)) = e.opt_count("queue_capacity", small) {
            settings.queue_capacity = usize::try_from(n).unwrap_or(usize::MAX);
        }
        if let Ok(Some(n)) = e.opt_count("conversation_turn_budget", small) {
            settings.conversation_turn_budget = u32::try_from(n).unwrap_or(u32::MAX);
        }
        if let Ok(Some(n)) = e.opt_count("task_concurrency", small) {
            settings.task_concurrency = usize::try_from(n).unwrap_or(usize::MAX);
        }
        if let Ok(Some(n)) = e.opt_count("max_tool_calls_per_response", small) {
            settings.max_tool_calls_per_response = u32::try_from(n).unwrap_or(u32::MAX);
        }
        settings
    }

    /// Checks a configuration built in code (or deserialized with serde, which checks only the
    /// shape) by the same rules, and with the same messages, as [`from_toml_str`](Self::from_toml_str).
    ///
    /// ```
    /// use spacebot_core::config::{AgentConfig, OrgConfig};
    /// use spacebot_core::AgentId;
    /// let agent = AgentConfig { id: AgentId::parse("a").unwrap(), name: "A".into(), workspace: None };
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

    /// A policy snapshot of the configured agents and links (link ids as in
    /// [`links_at`](Self::links_at)). Once links are synced to a store, the runtime's snapshot
    /// comes from the store ([`LinkGraph::load`]), which also holds links created at run time.
    pub fn graph(&self) -> LinkGraph {
        LinkGraph::new(self.agent_ids().cloned(), self.links_at(Timestamp(0)))
    }
}
