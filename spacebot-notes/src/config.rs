//! The `[[notes]]` section of the organization's configuration.
//!
//! ```toml
//! [[notes]]
//! name = "deploy-status"              # 1 to 64 of a-z 0-9 _ - .
//! description = "What is deployed where"   # optional
//! text = "nothing deployed yet"       # optional: the first version, written once
//! readers = ["support"]               # optional: agents that may read it
//! writers = ["engineering"]           # optional: agents that may read and write it
//! ```

use std::collections::{BTreeMap, BTreeSet};

use spacebot_core::config::ConfigIssue;
use spacebot_core::{AgentId, ConfigError, OrgConfig};

use crate::model::{Access, NoteName};

/// The section the notes behaviour claims.
pub const SECTION: &str = "notes";

/// One `[[notes]]` entry, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoteConfig {
    /// The note.
    pub name: NoteName,
    /// Its description (empty when none).
    pub description: String,
    /// Its first version, written when the note was never written.
    pub text: Option<String>,
    /// Who may read or write it, from `readers` and `writers`.
    pub access: BTreeMap<AgentId, Access>,
}

/// Every `[[notes]]` entry of a configuration, checked.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NotesConfig {
    /// The notes, in file order.
    pub notes: Vec<NoteConfig>,
}

impl NotesConfig {
    /// Reads and checks the `[[notes]]` section of `config` (none: no notes). Every problem is
    /// reported, each naming its entry (`notes[1] (plan)`) and field; `max_text` caps the
    /// `text` of an entry, in bytes.
    ///
    /// ```
    /// use spacebot_core::OrgConfig;
    /// use spacebot_notes::NotesConfig;
    /// let config = OrgConfig::from_toml_str(r#"
    ///     [[agents]]
    ///     id = "support"
    ///     [[notes]]
    ///     name = "plan"
    ///     readers = ["support", "nobody"]
    /// "#).unwrap();
    /// let err = NotesConfig::from_org(&config, 1024).unwrap_err();
    /// assert!(err.to_string().contains("notes[0] (plan): field \"readers\": unknown agent \"nobody\""));
    /// ```
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] listing every problem.
    pub fn from_org(config: &OrgConfig, max_text: usize) -> Result<Self, ConfigError> {
        let mut issues = Vec::new();
        let mut notes = Vec::new();
        let agents: BTreeSet<&str> = config.agent_ids().map(AgentId::as_str).collect();
        let entries: Vec<Option<&toml::Table>> = match config.section(SECTION) {
            None => Vec::new(),
            Some(toml::Value::Array(items)) => items.iter().map(toml::Value::as_table).collect(),
            Some(_) => {
                issues.push(issue(
                    SECTION.to_owned(),
                    None,
                    "expected an array of tables ([[notes]])",
                ));
                Vec::new()
            }
        };
        let mut seen: BTreeMap<NoteName, usize> = BTreeMap::new();
        for (i, table) in entries.into_iter().enumerate() {
            let Some(table) = table else {
                issues.push(issue(format!("notes[{i}]"), None, "expected a table"));
                continue;
            };
            let entry = match table.get("name").and_then(toml::Value::as_str) {
                Some(name) => format!("notes[{i}] ({name})"),
                None => format!("notes[{i}]"),
            };
            let before = issues.len();
            for key in table.keys() {
                if !matches!(
                    key.as_str(),
                    "name" | "description" | "text" | "readers" | "writers"
                ) {
                    issues.push(issue(
                        entry.clone(),
                        Some(key),
                        "unknown field; expected name, description, text, readers, writers",
                    ));
                }
            }
            let name = match table.get("name") {
                None => {
                    issues.push(issue(entry.clone(), Some("name"), "missing"));
                    None
                }
                Some(toml::Value::String(name)) => {
                    match NoteName::parse(name.clone()) {
                        Ok(name) => {
                            if let Some(first) = seen.get(&name) {
                                issues.push(issue(
                                entry.clone(),
                                Some("name"),
                                &format!("duplicate note \"{name}\" (first defined by notes[{first}])"),
                            ));
                            } else {
                                seen.insert(name.clone(), i);
                            }
                            Some(name)
                        }
                        Err(e) => {
                            issues.push(issue(entry.clone(), Some("name"), &e.to_string()));
                            None
                        }
                    }
                }
                Some(_) => {
                    issues.push(issue(entry.clone(), Some("name"), "expected a string"));
                    None
                }
            };
            let description = string(table, "description", &entry, &mut issues).unwrap_or_default();
            let text = string(table, "text", &entry, &mut issues);
            if let Some(text) = &text
                && text.len() > max_text
            {
                issues.push(issue(
                    entry.clone(),
                    Some("text"),
                    &format!("{} bytes, more than the limit of {max_text}", text.len()),
                ));
            }
            let mut access = BTreeMap::new();
            for (field, grant) in [("readers", Access::Read), ("writers", Access::ReadWrite)] {
                for agent in agent_list(table, field, &entry, &agents, &mut issues) {
                    if let Some(previous) = access.insert(agent.clone(), grant) {
                        let problem = if previous == grant {
                            format!("agent \"{agent}\" is listed twice")
                        } else {
                            format!(
                                "agent \"{agent}\" is listed in both readers and writers \
                                 (writers may read too)"
                            )
                        };
                        issues.push(issue(entry.clone(), Some(field), &problem));
                    }
                }
            }
            if let Some(name) = name
                && issues.len() == before
            {
                notes.push(NoteConfig {
                    name,
                    description,
                    text,
                    access,
                });
            }
        }
        if issues.is_empty() {
            Ok(Self { notes })
        } else {
            Err(ConfigError::Invalid { path: None, issues })
        }
    }

    /// The entry for `name`.
    pub fn note(&self, name: &NoteName) -> Option<&NoteConfig> {
        self.notes.iter().find(|n| &n.name == name)
    }
}

fn issue(entry: String, field: Option<&str>, problem: &str) -> ConfigIssue {
    ConfigIssue {
        entry,
        field: field.map(str::to_owned),
        problem: problem.to_owned(),
    }
}

fn string(
    table: &toml::Table,
    field: &str,
    entry: &str,
    issues: &mut Vec<ConfigIssue>,
) -> Option<String> {
    match table.get(field) {
        None => None,
        Some(toml::Value::String(s)) => Some(s.clone()),
        Some(_) => {
            issues.push(issue(entry.to_owned(), Some(field), "expected a string"));
            None
        }
    }
}

fn agent_list(
    table: &toml::Table,
    field: &str,
    entry: &str,
    agents: &BTreeSet<&str>,
    issues: &mut Vec<ConfigIssue>,
) -> Vec<AgentId> {
    let Some(value) = table.get(field) else {
        return Vec::new();
    };
    let Some(items) = value.as_array() else {
        issues.push(issue(
            entry.to_owned(),
            Some(field),
            "expected an array of agent ids",
        ));
        return Vec::new();
    };
    let mut out = Vec::new();
    for item in items {
        let Some(id) = item.as_str() else {
            issues.push(issue(
                entry.to_owned(),
                Some(field),
                "expected an array of agent ids (strings)",
            ));
            continue;
        };
        if !agents.contains(id) {
            issues.push(issue(
                entry.to_owned(),
                Some(field),
                &format!("unknown agent \"{id}\""),
            ));
            continue;
        }
        match AgentId::parse(id) {
            Ok(agent) => out.push(agent),
            Err(e) => issues.push(issue(entry.to_owned(), Some(field), &e.to_string())),
        }
    }
    out
}
