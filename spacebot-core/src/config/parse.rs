//! Reading a configuration from TOML: every field checked, every problem recorded.

use std::collections::HashMap;
use std::path::PathBuf;

use super::{
    AgentConfig, ConfigError, ConfigIssue, LinkConfig, OrgConfig, Settings, default_direction,
    default_relationship,
};
use crate::ids::AgentId;
use crate::link::{LinkDirection, LinkRelationship};
use crate::policy::ApprovalPolicy;

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

impl Entry<'_> {
    /// An optional amount of money (`0.25`, or a whole number): `Ok(None)` when absent.
    fn opt_money(&mut self, field: &str) -> Result<Option<crate::limits::Money>, ()> {
        let units = match self.table.get(field) {
            None => return Ok(None),
            Some(toml::Value::Float(x)) => *x,
            Some(toml::Value::Integer(n)) => *n as f64,
            Some(other) => {
                let problem = format!("expected an amount such as 0.25, found {}", describe(other));
                self.issue(Some(field), problem);
                return Err(());
            }
        };
        match crate::limits::Money::from_units(units) {
            Some(m) => Ok(Some(m)),
            None => {
                self.issue(
                    Some(field),
                    format!("expected an amount of 0 or more, found {units}"),
                );
                Err(())
            }
        }
    }

    /// The measures of a limits table (`[settings.limits]`, a period's limits); a period's
    /// table also has `period` ("hour" or "day") and no wall time.
    fn limits(&mut self, period: bool) -> (crate::limits::Limits, Option<crate::limits::Period>) {
        let mut fields = vec![
            "input_tokens",
            "output_tokens",
            "total_tokens",
            "model_calls",
            "tool_calls",
            "cost",
        ];
        fields.push(if period { "period" } else { "wall_time_ms" });
        self.unknown_fields(&fields);
        let big = u64::MAX >> 1;
        let mut limits = crate::limits::Limits::NONE;
        for (field, slot) in [
            ("input_tokens", &mut limits.input_tokens),
            ("output_tokens", &mut limits.output_tokens),
            ("total_tokens", &mut limits.total_tokens),
            ("model_calls", &mut limits.model_calls),
            ("tool_calls", &mut limits.tool_calls),
            ("wall_time_ms", &mut limits.wall_time_ms),
        ] {
            if (!period || field != "wall_time_ms")
                && let Ok(Some(n)) = self.opt_count(field, big)
            {
                *slot = Some(n);
            }
        }
        if let Ok(Some(cost)) = self.opt_money("cost") {
            limits.cost = Some(cost);
        }
        let mut which = None;
        if period {
            match self.opt_str("period") {
                Some("hour") => which = Some(crate::limits::Period::Hour),
                Some("day") => which = Some(crate::limits::Period::Day),
                Some(other) => {
                    self.issue(
                        Some("period"),
                        format!("expected \"hour\" or \"day\", found {other:?}"),
                    );
                }
                None if !self.table.contains_key("period") => {
                    self.issue(Some("period"), "missing (\"hour\" or \"day\")");
                }
                None => {}
            }
        }
        (limits, which)
    }

    /// An optional period limits table `field` of this entry.
    fn opt_period_limits(&mut self, field: &str) -> Option<crate::limits::PeriodLimits> {
        match self.table.get(field)? {
            toml::Value::Table(t) => {
                let mut l = Entry {
                    name: format!("{}.{field}", self.name),
                    table: t,
                    issues: &mut *self.issues,
                };
                let (limits, period) = l.limits(true);
                period.map(|period| crate::limits::PeriodLimits { period, limits })
            }
            other => {
                let problem = format!("expected a table, found {}", describe(other));
                self.issue(Some(field), problem);
                None
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
    /// Parses and validates a configuration (see the [module docs](crate::config)).
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

        let mut sections = std::collections::BTreeMap::new();
        for (key, value) in &root {
            if matches!(key.as_str(), "agents" | "links" | "settings") {
                continue;
            }
            let is_section = match value {
                toml::Value::Table(_) => true,
                toml::Value::Array(items) => items.iter().all(toml::Value::is_table),
                _ => false,
            };
            if is_section {
                sections.insert(key.clone(), value.clone());
            } else {
                issues.push(ConfigIssue {
                    entry: "top level".to_owned(),
                    field: Some(key.clone()),
                    problem: "unknown key; expected agents, links, settings, or a behaviour's \
                              section (a table or an array of tables)"
                        .to_owned(),
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
                sections,
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
            // Other fields are behaviours' per-agent settings, checked by the behaviour that
            // claims them (`OrgConfig::check_agent_fields` refuses the rest at the build).
            let fields: toml::Table = table
                .iter()
                .filter(|(k, _)| {
                    !matches!(
                        k.as_str(),
                        "id" | "name" | "workspace" | "limits" | "context_window"
                    )
                })
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let id = e.agent_id("id");
            let name = e.opt_str("name").map(str::to_owned);
            let name_bad = e.table.contains_key("name") && name.is_none();
            let workspace = e.opt_str("workspace").map(PathBuf::from);
            let workspace_bad = e.table.contains_key("workspace") && workspace.is_none();
            let issues_before = e.issues.len();
            let limits = e.opt_period_limits("limits");
            let limits_bad = e.issues.len() > issues_before;
            let window = e.opt_count("context_window", u64::from(u32::MAX));
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
            out.push(match (id, window) {
                (Some(id), Ok(window)) if !name_bad && !workspace_bad && !limits_bad => {
                    Some(AgentConfig {
                        name: name.unwrap_or_else(|| id.to_string()),
                        id,
                        workspace,
                        limits,
                        context_window: window.and_then(|n| u32::try_from(n).ok()),
                        fields,
                    })
                }
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
            "limits",
            "agent_limits",
            "org_limits",
            "prices",
            "context_window",
            "compaction",
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
        if let Ok(Some(n)) = e.opt_count("context_window", small) {
            settings.context_window = u32::try_from(n).ok();
        }
        if let Ok(Some(on)) = e.opt_bool("compaction") {
            settings.compaction = on;
        }
        match e.table.get("limits") {
            None => {}
            Some(toml::Value::Table(limits)) => {
                let mut l = Entry {
                    name: "settings.limits".to_owned(),
                    table: limits,
                    issues: &mut *e.issues,
                };
                settings.limits = l.limits(false).0;
            }
            Some(other) => e.issues.push(ConfigIssue {
                entry: "settings".to_owned(),
                field: Some("limits".to_owned()),
                problem: format!(
                    "expected a table ([settings.limits]), found {}",
                    describe(other)
                ),
            }),
        }
        settings.agent_limits = e.opt_period_limits("agent_limits");
        settings.org_limits = e.opt_period_limits("org_limits");
        match e.table.get("prices") {
            None => {}
            Some(toml::Value::Table(prices)) => {
                for (model, price) in prices {
                    let name = format!("settings.prices.{model}");
                    let toml::Value::Table(price) = price else {
                        e.issues.push(ConfigIssue {
                            entry: name,
                            field: None,
                            problem: format!("expected a table, found {}", describe(price)),
                        });
                        continue;
                    };
                    let mut p = Entry {
                        name,
                        table: price,
                        issues: &mut *e.issues,
                    };
                    p.unknown_fields(&["input_per_million", "output_per_million"]);
                    let input = p.opt_money("input_per_million");
                    let output = p.opt_money("output_per_million");
                    if let (Ok(input), Ok(output)) = (input, output) {
                        settings.prices.insert(
                            model.clone(),
                            crate::limits::Price {
                                input_per_million: input.unwrap_or_default(),
                                output_per_million: output.unwrap_or_default(),
                            },
                        );
                    }
                }
            }
            Some(other) => e.issues.push(ConfigIssue {
                entry: "settings".to_owned(),
                field: Some("prices".to_owned()),
                problem: format!(
                    "expected a table ([settings.prices.\"model\"]), found {}",
                    describe(other)
                ),
            }),
        }
        settings
    }
}
