//! The `[[mcp_servers]]` section and the `tools` field of `[[agents]]` entries.
//!
//! ```toml
//! [[mcp_servers]]
//! id = "files"                    # 1 to 32 of a-z A-Z 0-9 _ -, no "__"
//! command = "python3"             # stdio: a child process ...
//! args = ["files_server.py"]
//! env = { ROOT = "/srv" }
//! cwd = "/srv"
//! start = "eager"                 # or "lazy" (default)
//! timeout_ms = 30000              # per call (default 30000)
//! max_result_bytes = 65536        # the cap of a result shown to the model (default 65536)
//!
//! [[mcp_servers]]
//! id = "search"
//! url = "http://127.0.0.1:8931/mcp"   # ... or streamable HTTP
//! headers = { "X-Team" = "docs" }
//! bearer_token = "..."
//!
//! [[agents]]
//! id = "support"
//! tools = ["files:*", "search:query"] # every tool of files, the tool query of search
//! # tools = ["files:read_file", { tool = "files:write_file", approval = true }]
//! #   (a call of files:write_file waits for a human's approval; see Mcp::approve)
//! mcp_expose = true                   # MCP clients may ask it (`ask_support`, see OrgServer)
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use spacebot_core::config::ConfigIssue;
use spacebot_core::{AgentId, ConfigError, OrgConfig};

/// The section the MCP behaviour claims.
pub const SECTION: &str = "mcp_servers";
/// The `[[agents]]` field holding an agent's grants.
pub const AGENT_FIELD: &str = "tools";
/// The `[[agents]]` field that exposes an agent to MCP clients as the tool `ask_{agent}`
/// (`mcp_expose = true`; default false: no agent is exposed unless the operator says so).
pub const EXPOSE_FIELD: &str = "mcp_expose";
/// The per-call timeout when `timeout_ms` is not given.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// The result cap when `max_result_bytes` is not given.
pub const DEFAULT_MAX_RESULT_BYTES: usize = 64 * 1024;
/// The longest server id.
pub const MAX_ID_LEN: usize = 32;

const FIELDS: &[&str] = &[
    "id",
    "command",
    "args",
    "env",
    "cwd",
    "url",
    "headers",
    "bearer_token",
    "start",
    "timeout_ms",
    "max_result_bytes",
];

/// How the organization reaches a server.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Transport {
    /// A child process speaking MCP on its standard input and output.
    Stdio {
        /// The program.
        command: String,
        /// Its arguments.
        args: Vec<String>,
        /// Variables added to its environment.
        env: BTreeMap<String, String>,
        /// Its working directory (the application's when absent).
        cwd: Option<PathBuf>,
    },
    /// A server speaking streamable HTTP at `url`.
    Http {
        /// The endpoint (`http://` or `https://`).
        url: String,
        /// Headers sent with every request.
        headers: BTreeMap<String, String>,
        /// Sent as `Authorization: Bearer ...` when given.
        bearer_token: Option<String>,
    },
}

/// When a server is started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Start {
    /// When the first agent granted one of its tools starts (the default).
    #[default]
    Lazy,
    /// When the organization starts (`Organization::start_all`), which waits for it.
    Eager,
}

/// One `[[mcp_servers]]` entry, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerConfig {
    /// The server's id: the namespace of its tools (`{id}__{tool}`) and of grants (`{id}:*`).
    pub id: String,
    /// How it is reached.
    pub transport: Transport,
    /// When it is started.
    pub start: Start,
    /// The longest a call may take (and the longest the connection may take to be set up).
    pub timeout: Duration,
    /// The largest result shown to the model, in bytes; a larger one is cut and says so.
    pub max_result_bytes: usize,
}

impl ServerConfig {
    /// A stdio server (lazy, default timeout and cap).
    pub fn stdio(id: impl Into<String>, command: impl Into<String>, args: Vec<String>) -> Self {
        Self {
            id: id.into(),
            transport: Transport::Stdio {
                command: command.into(),
                args,
                env: BTreeMap::new(),
                cwd: None,
            },
            start: Start::Lazy,
            timeout: DEFAULT_TIMEOUT,
            max_result_bytes: DEFAULT_MAX_RESULT_BYTES,
        }
    }
}

/// One grant: every tool of a server (`files:*`) or one (`files:read_file`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Grant {
    /// The server's id.
    pub server: String,
    /// The tool's name as the server lists it; `None`: every tool of the server.
    pub tool: Option<String>,
}

impl Grant {
    /// Parses `server:*` or `server:tool`.
    ///
    /// ```
    /// use spacebot_mcp::Grant;
    /// assert_eq!(Grant::parse("files:*").unwrap().tool, None);
    /// assert_eq!(Grant::parse("files:read").unwrap().tool.as_deref(), Some("read"));
    /// assert!(Grant::parse("files").is_err());
    /// ```
    ///
    /// # Errors
    /// A sentence saying what is wrong.
    pub fn parse(text: &str) -> Result<Self, String> {
        let Some((server, tool)) = text.split_once(':') else {
            return Err(format!(
                "grant {text:?} must be \"server:*\" (every tool) or \"server:tool\""
            ));
        };
        check_id(server).map_err(|e| format!("grant {text:?}: {e}"))?;
        if tool.is_empty() {
            return Err(format!("grant {text:?} names no tool (use \"{server}:*\")"));
        }
        Ok(Self {
            server: server.to_owned(),
            tool: (tool != "*").then(|| tool.to_owned()),
        })
    }

    /// Whether it covers the tool `tool` of the server `server`.
    pub fn covers(&self, server: &str, tool: &str) -> bool {
        self.server == server && self.tool.as_deref().is_none_or(|t| t == tool)
    }
}

impl std::fmt::Display for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.server, self.tool.as_deref().unwrap_or("*"))
    }
}

/// The whole MCP configuration of an organization, checked.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct McpConfig {
    /// The servers, in file order.
    pub servers: Vec<ServerConfig>,
    /// Each agent's grants from its `tools` field.
    pub grants: BTreeMap<AgentId, BTreeSet<Grant>>,
    /// Each agent's grants whose calls wait for a human's approval
    /// (`{ tool = "files:write", approval = true }`); each is in [`grants`](Self::grants) too.
    pub approvals: BTreeMap<AgentId, BTreeSet<Grant>>,
    /// The agents whose `mcp_expose` is true: the ones MCP clients may ask.
    pub exposed: BTreeSet<AgentId>,
}

impl McpConfig {
    /// Reads and checks `[[mcp_servers]]` and the `tools` fields of `[[agents]]`. Every problem
    /// is reported, each naming its entry (`mcp_servers[0] (files)`, `agents[1] (support)`) and
    /// field.
    ///
    /// ```
    /// use spacebot_core::OrgConfig;
    /// use spacebot_mcp::McpConfig;
    /// let config = OrgConfig::from_toml_str(r#"
    ///     [[agents]]
    ///     id = "support"
    ///     tools = ["files:*"]
    ///     [[mcp_servers]]
    ///     id = "files"
    ///     command = "files-server"
    ///     url = "http://127.0.0.1:1/mcp"
    /// "#).unwrap();
    /// let err = McpConfig::from_org(&config).unwrap_err().to_string();
    /// assert!(err.contains("mcp_servers[0] (files): field \"url\": give either command (stdio) or url"), "{err}");
    /// ```
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] listing every problem.
    pub fn from_org(config: &OrgConfig) -> Result<Self, ConfigError> {
        let mut issues = Vec::new();
        let entries: Vec<Option<&toml::Table>> = match config.section(SECTION) {
            None => Vec::new(),
            Some(toml::Value::Array(items)) => items.iter().map(toml::Value::as_table).collect(),
            Some(_) => {
                issues.push(issue(
                    SECTION,
                    None,
                    "expected an array of tables ([[mcp_servers]])",
                ));
                Vec::new()
            }
        };
        let mut servers = Vec::new();
        let mut seen: BTreeMap<String, usize> = BTreeMap::new();
        for (i, table) in entries.into_iter().enumerate() {
            let Some(table) = table else {
                issues.push(issue(&format!("{SECTION}[{i}]"), None, "expected a table"));
                continue;
            };
            let entry = match table.get("id").and_then(toml::Value::as_str) {
                Some(id) => format!("{SECTION}[{i}] ({id})"),
                None => format!("{SECTION}[{i}]"),
            };
            let before = issues.len();
            let server = read_server(table, &entry, &mut issues);
            if let Some(server) = &server {
                if let Some(first) = seen.get(&server.id) {
                    issues.push(issue(
                        &entry,
                        Some("id"),
                        &format!(
                            "duplicate server id \"{}\" (first defined by {SECTION}[{first}])",
                            server.id
                        ),
                    ));
                } else {
                    seen.insert(server.id.clone(), i);
                }
            }
            if let Some(server) = server
                && issues.len() == before
            {
                servers.push(server);
            }
        }
        let mut grants = BTreeMap::new();
        let mut exposed = BTreeSet::new();
        let mut approvals = BTreeMap::new();
        for (i, agent) in config.agents.iter().enumerate() {
            match agent.fields.get(EXPOSE_FIELD) {
                None | Some(toml::Value::Boolean(false)) => {}
                Some(toml::Value::Boolean(true)) => {
                    exposed.insert(agent.id.clone());
                }
                Some(_) => issues.push(issue(
                    &format!("agents[{i}] ({})", agent.id),
                    Some(EXPOSE_FIELD),
                    "expected true or false",
                )),
            }
            let Some(value) = agent.fields.get(AGENT_FIELD) else {
                continue;
            };
            let entry = format!("agents[{i}] ({})", agent.id);
            let Some(items) = value.as_array() else {
                issues.push(issue(
                    &entry,
                    Some(AGENT_FIELD),
                    "expected an array of grants such as [\"files:*\", \"files:read_file\"]",
                ));
                continue;
            };
            let mut mine = BTreeSet::new();
            let mut mine_approval = BTreeSet::new();
            for item in items {
                let (text, approval) = match item {
                    toml::Value::String(text) => (text.as_str(), false),
                    toml::Value::Table(t)
                        if t.keys().all(|k| k == "tool" || k == "approval")
                            && t.get("tool").is_some_and(toml::Value::is_str)
                            && t.get("approval").is_none_or(toml::Value::is_bool) =>
                    {
                        (
                            t.get("tool")
                                .and_then(toml::Value::as_str)
                                .unwrap_or_default(),
                            t.get("approval")
                                .and_then(toml::Value::as_bool)
                                .unwrap_or(false),
                        )
                    }
                    _ => {
                        issues.push(issue(
                            &entry,
                            Some(AGENT_FIELD),
                            "expected an array of grants: strings such as \"files:*\", or tables \
                             such as { tool = \"files:write\", approval = true }",
                        ));
                        continue;
                    }
                };
                match Grant::parse(text) {
                    Ok(grant) if seen.contains_key(&grant.server) => {
                        if approval {
                            mine_approval.insert(grant.clone());
                        }
                        if !mine.insert(grant) {
                            issues.push(issue(
                                &entry,
                                Some(AGENT_FIELD),
                                &format!("grant {text:?} is listed twice"),
                            ));
                        }
                    }
                    Ok(grant) => issues.push(issue(
                        &entry,
                        Some(AGENT_FIELD),
                        &format!(
                            "grant {text:?} names the server \"{}\", which is not in [[{SECTION}]]",
                            grant.server
                        ),
                    )),
                    Err(e) => issues.push(issue(&entry, Some(AGENT_FIELD), &e)),
                }
            }
            grants.insert(agent.id.clone(), mine);
            if !mine_approval.is_empty() {
                approvals.insert(agent.id.clone(), mine_approval);
            }
        }
        if issues.is_empty() {
            Ok(Self {
                servers,
                grants,
                approvals,
                exposed,
            })
        } else {
            Err(ConfigError::Invalid { path: None, issues })
        }
    }

    /// The server `id`.
    pub fn server(&self, id: &str) -> Option<&ServerConfig> {
        self.servers.iter().find(|s| s.id == id)
    }
}

/// Checks a server id: 1 to [`MAX_ID_LEN`] of ASCII letters, digits, `_` and `-`, without `__`
/// (which separates a server's id from a tool's name in the names the model sees).
fn check_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > MAX_ID_LEN {
        return Err(format!(
            "server id {id:?} must be 1 to {MAX_ID_LEN} characters"
        ));
    }
    if !id
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err(format!(
            "server id {id:?} may hold only ASCII letters, digits, '_' and '-'"
        ));
    }
    if id.contains("__") || id.ends_with('_') {
        return Err(format!(
            "server id {id:?} may not hold \"__\" or end with '_' (\"__\" separates a server from its tools)"
        ));
    }
    Ok(())
}

fn read_server(
    table: &toml::Table,
    entry: &str,
    issues: &mut Vec<ConfigIssue>,
) -> Option<ServerConfig> {
    for key in table.keys() {
        if !FIELDS.contains(&key.as_str()) {
            issues.push(issue(
                entry,
                Some(key),
                &format!("unknown field; expected {}", FIELDS.join(", ")),
            ));
        }
    }
    let id = match table.get("id") {
        None => {
            issues.push(issue(entry, Some("id"), "missing"));
            None
        }
        Some(toml::Value::String(id)) => match check_id(id) {
            Ok(()) => Some(id.clone()),
            Err(e) => {
                issues.push(issue(entry, Some("id"), &e));
                None
            }
        },
        Some(_) => {
            issues.push(issue(entry, Some("id"), "expected a string"));
            None
        }
    };
    let command = string(table, "command", entry, issues);
    let url = string(table, "url", entry, issues);
    let args = strings(table, "args", entry, issues);
    let env = string_map(table, "env", entry, issues);
    let cwd = string(table, "cwd", entry, issues).map(PathBuf::from);
    let headers = string_map(table, "headers", entry, issues);
    let bearer_token = string(table, "bearer_token", entry, issues);
    let transport = match (command, url) {
        (Some(_), Some(_)) => {
            issues.push(issue(
                entry,
                Some("url"),
                "give either command (stdio) or url (streamable HTTP), not both",
            ));
            None
        }
        (None, None) => {
            if !table.contains_key("command") && !table.contains_key("url") {
                issues.push(issue(
                    entry,
                    Some("command"),
                    "missing: give command (stdio) or url (streamable HTTP)",
                ));
            }
            None
        }
        (Some(command), None) => {
            if command.trim().is_empty() {
                issues.push(issue(entry, Some("command"), "is empty"));
            }
            for field in ["headers", "bearer_token"] {
                if table.contains_key(field) {
                    issues.push(issue(
                        entry,
                        Some(field),
                        "only for a streamable HTTP server (url), not for a stdio one (command)",
                    ));
                }
            }
            Some(Transport::Stdio {
                command,
                args: args.unwrap_or_default(),
                env: env.unwrap_or_default(),
                cwd,
            })
        }
        (None, Some(url)) => {
            if !(url.starts_with("http://") || url.starts_with("https://")) || url.len() < 10 {
                issues.push(issue(
                    entry,
                    Some("url"),
                    &format!("{url:?} is not an http:// or https:// URL"),
                ));
            }
            for field in ["args", "env", "cwd"] {
                if table.contains_key(field) {
                    issues.push(issue(
                        entry,
                        Some(field),
                        "only for a stdio server (command), not for a streamable HTTP one (url)",
                    ));
                }
            }
            let headers = headers.unwrap_or_default();
            for (name, value) in &headers {
                if http::HeaderName::from_bytes(name.as_bytes()).is_err()
                    || http::HeaderValue::from_str(value).is_err()
                {
                    issues.push(issue(
                        entry,
                        Some("headers"),
                        &format!("{name:?} is not a valid HTTP header name and value"),
                    ));
                }
            }
            if let Some(token) = &bearer_token
                && (token.is_empty() || http::HeaderValue::from_str(token).is_err())
            {
                issues.push(issue(
                    entry,
                    Some("bearer_token"),
                    "must be a non-empty header-safe string",
                ));
            }
            Some(Transport::Http {
                url,
                headers,
                bearer_token,
            })
        }
    };
    let start = match table.get("start") {
        None => Some(Start::Lazy),
        Some(toml::Value::String(s)) if s == "lazy" => Some(Start::Lazy),
        Some(toml::Value::String(s)) if s == "eager" => Some(Start::Eager),
        Some(other) => {
            issues.push(issue(
                entry,
                Some("start"),
                &format!("unknown value {other}; expected one of: lazy, eager"),
            ));
            None
        }
    };
    let timeout = positive(table, "timeout_ms", entry, issues)
        .map(|ms| ms.map_or(DEFAULT_TIMEOUT, Duration::from_millis));
    let max_result_bytes = positive(table, "max_result_bytes", entry, issues).map(|b| {
        b.map_or(DEFAULT_MAX_RESULT_BYTES, |b| {
            usize::try_from(b).unwrap_or(usize::MAX)
        })
    });
    Some(ServerConfig {
        id: id?,
        transport: transport?,
        start: start?,
        timeout: timeout?,
        max_result_bytes: max_result_bytes?,
    })
}

fn issue(entry: &str, field: Option<&str>, problem: &str) -> ConfigIssue {
    ConfigIssue {
        entry: entry.to_owned(),
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
    match table.get(field)? {
        toml::Value::String(s) => Some(s.clone()),
        _ => {
            issues.push(issue(entry, Some(field), "expected a string"));
            None
        }
    }
}

fn strings(
    table: &toml::Table,
    field: &str,
    entry: &str,
    issues: &mut Vec<ConfigIssue>,
) -> Option<Vec<String>> {
    let items = table.get(field)?;
    let Some(items) = items.as_array() else {
        issues.push(issue(entry, Some(field), "expected an array of strings"));
        return None;
    };
    let mut out = Vec::new();
    for item in items {
        match item.as_str() {
            Some(s) => out.push(s.to_owned()),
            None => {
                issues.push(issue(entry, Some(field), "expected an array of strings"));
                return None;
            }
        }
    }
    Some(out)
}

fn string_map(
    table: &toml::Table,
    field: &str,
    entry: &str,
    issues: &mut Vec<ConfigIssue>,
) -> Option<BTreeMap<String, String>> {
    let map = table.get(field)?;
    let Some(map) = map.as_table() else {
        issues.push(issue(
            entry,
            Some(field),
            "expected a table of strings ({ NAME = \"value\" })",
        ));
        return None;
    };
    let mut out = BTreeMap::new();
    for (key, value) in map {
        match value.as_str() {
            Some(v) => {
                out.insert(key.clone(), v.to_owned());
            }
            None => {
                issues.push(issue(
                    entry,
                    Some(field),
                    &format!("{key:?}: expected a string"),
                ));
                return None;
            }
        }
    }
    Some(out)
}

/// `Some(None)`: absent; `Some(Some(n))`: a positive integer; `None`: invalid (reported).
fn positive(
    table: &toml::Table,
    field: &str,
    entry: &str,
    issues: &mut Vec<ConfigIssue>,
) -> Option<Option<u64>> {
    match table.get(field) {
        None => Some(None),
        Some(toml::Value::Integer(n)) if *n > 0 => Some(u64::try_from(*n).ok()),
        Some(_) => {
            issues.push(issue(entry, Some(field), "expected a positive integer"));
            None
        }
    }
}
