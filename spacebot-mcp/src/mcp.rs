//! The [`Mcp`] behaviour: servers, grants, the tool set the agents are offered, and the API for
//! operators.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Map, Value};
use spacebot_core::llm::ToolDefinition;
use spacebot_core::tools::{ToolCapability, ToolContext, ToolError, ToolOutput, ToolSet};
use spacebot_core::{
    AgentId, AgentWorker, Behaviour, BehaviourContext, OrgError, Records, StoreError,
    WeakBehaviourContext,
};

use crate::approvals::{APPROVALS_NAMESPACE, ApprovalStatus, PendingCall, decide, run_approved};
use crate::config::{AGENT_FIELD, EXPOSE_FIELD, Grant, McpConfig, SECTION, Start};
use crate::result::{cap_text, render};
use crate::server::{CallError, McpTool, Server, ServerState};

/// Why an operator's call was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum McpError {
    /// The organization was not built with this behaviour yet.
    #[error("MCP is not attached to an organization yet (build the organization first)")]
    NotBuilt,
    /// No such agent.
    #[error("unknown agent {agent:?}")]
    UnknownAgent {
        /// The id given.
        agent: String,
    },
    /// No such server.
    #[error("unknown MCP server {server:?}")]
    UnknownServer {
        /// The id given.
        server: String,
    },
    /// A grant that does not parse.
    #[error("{0}")]
    InvalidGrant(String),
    /// A server did not become ready in time.
    #[error("MCP server {server:?} is not ready after {waited_ms} ms: {state}")]
    NotReady {
        /// The server.
        server: String,
        /// How long was waited.
        waited_ms: u128,
        /// Its state then.
        state: ServerState,
    },
    /// The configuration's MCP fields do not check.
    #[error("{0}")]
    InvalidConfig(String),
    /// An MCP session could not be served.
    #[error("MCP transport: {0}")]
    Transport(String),
    /// The store of calls waiting for approval failed.
    #[error("the approval store failed: {0}")]
    Store(String),
    /// No call waiting for approval has this id.
    #[error("no MCP call {id:?} waits for approval")]
    NoSuchCall {
        /// The id given.
        id: String,
    },
    /// The call was decided already.
    #[error("the MCP call {id:?} is not pending (it is {status:?})")]
    NotPending {
        /// The call.
        id: String,
        /// Where it is.
        status: ApprovalStatus,
    },
}

/// MCP tools for agents: the tools of the servers in `[[mcp_servers]]`, offered to each agent as
/// granted (`[[agents]] tools = ["files:*"]`, [`Mcp::grant`]) and checked in code on every call.
/// Add it with `OrganizationBuilder::behaviour(Arc::new(mcp.clone()))` and keep the handle for
/// the operator's API (cheap to clone; every clone is the same behaviour). See the
/// [crate docs](crate).
#[derive(Clone, Default)]
pub struct Mcp {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    attached: RwLock<Option<Attached>>,
    /// Each agent's grants now.
    grants: RwLock<BTreeMap<AgentId, BTreeSet<Grant>>>,
    /// Each agent's grants whose calls wait for approval.
    approvals: RwLock<BTreeMap<AgentId, BTreeSet<Grant>>>,
    /// Rings when a call is approved or rejected in this process.
    decided: Decided,
}

struct Decided(tokio::sync::watch::Sender<u64>);

impl Default for Decided {
    fn default() -> Self {
        Self(tokio::sync::watch::Sender::new(0))
    }
}

#[derive(Clone)]
struct Attached {
    /// Weak: the organization holds this behaviour, which must not keep it alive.
    ctx: WeakBehaviourContext,
    servers: Arc<BTreeMap<String, Arc<Server>>>,
    /// The calls waiting for approval, and their outcome.
    records: Records<PendingCall>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(at) = self
            .attached
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            for server in at.servers.values() {
                server.stop();
            }
        }
    }
}

impl fmt::Debug for Mcp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mcp")
            .field("servers", &self.server_ids())
            .finish_non_exhaustive()
    }
}

impl Mcp {
    /// The behaviour, not attached to an organization yet (its build attaches it).
    pub fn new() -> Self {
        Self::default()
    }

    fn attached(&self) -> Option<Attached> {
        self.inner
            .attached
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn servers(&self) -> Arc<BTreeMap<String, Arc<Server>>> {
        self.attached().map(|a| a.servers).unwrap_or_default()
    }

    /// The configured servers' ids, sorted.
    pub fn server_ids(&self) -> Vec<String> {
        self.servers().keys().cloned().collect()
    }

    /// What the server `id` is doing now (`None`: no such server).
    pub fn server_state(&self, id: &str) -> Option<ServerState> {
        self.servers().get(id).map(|s| s.state())
    }

    /// How many times a session with the server `id` was set up (its first start and every
    /// restart after it died; 0 for an unknown server).
    pub fn starts(&self, id: &str) -> u64 {
        self.servers().get(id).map_or(0, |s| s.starts())
    }

    /// The names the model sees for the server's tools (`{server}__{tool}`), as last listed.
    pub fn tool_names(&self, id: &str) -> Vec<String> {
        self.servers()
            .get(id)
            .map(|s| s.tools().iter().map(|t| t.exposed.clone()).collect())
            .unwrap_or_default()
    }

    /// Starts the server `id` if it does not run yet and waits until it is ready, at most
    /// `timeout`.
    ///
    /// # Errors
    /// [`McpError::UnknownServer`]; [`McpError::NotReady`] with its state when the time is up.
    pub async fn wait_ready(&self, id: &str, timeout: Duration) -> Result<(), McpError> {
        let server = self
            .servers()
            .get(id)
            .cloned()
            .ok_or_else(|| McpError::UnknownServer { server: id.into() })?;
        server.start();
        let mut rx = server.subscribe();
        let ready = tokio::time::timeout(
            timeout,
            rx.wait_for(|s| matches!(s, ServerState::Ready { .. } | ServerState::Stopped)),
        )
        .await;
        match ready {
            Ok(Ok(state)) if matches!(*state, ServerState::Ready { .. }) => Ok(()),
            _ => Err(McpError::NotReady {
                server: id.into(),
                waited_ms: timeout.as_millis(),
                state: server.state(),
            }),
        }
    }

    /// Each agent's grants now.
    pub fn grants(&self) -> BTreeMap<AgentId, BTreeSet<Grant>> {
        self.inner
            .grants
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Lets `agent` use the tools `grant` covers (`"files:*"`, `"files:read_file"`). Takes effect
    /// on the agent's next tool call and its next turn's tool definitions; starts the server if
    /// it does not run yet. Returns whether the grant is new. Kept in this process: a restart
    /// goes back to the configuration.
    ///
    /// # Errors
    /// [`McpError::NotBuilt`], [`McpError::UnknownAgent`], [`McpError::InvalidGrant`],
    /// [`McpError::UnknownServer`].
    pub fn grant(&self, agent: &AgentId, grant: &str) -> Result<bool, McpError> {
        let (at, grant) = self.check(agent, grant)?;
        let added = self
            .inner
            .grants
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(agent.clone())
            .or_default()
            .insert(grant.clone());
        if let Some(server) = at.servers.get(&grant.server) {
            server.start();
        }
        if let Some(ctx) = at.ctx.upgrade() {
            ctx.tools_changed();
        }
        Ok(added)
    }

    /// Takes the grant `grant` (as written in [`grant`](Self::grant) or the configuration) from
    /// `agent`. Takes effect on the agent's next tool call. Returns whether it had it.
    ///
    /// # Errors
    /// As [`grant`](Self::grant).
    pub fn revoke(&self, agent: &AgentId, grant: &str) -> Result<bool, McpError> {
        let (at, grant) = self.check(agent, grant)?;
        let removed = self
            .inner
            .grants
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(agent)
            .is_some_and(|g| g.remove(&grant));
        if let Some(ctx) = at.ctx.upgrade() {
            ctx.tools_changed();
        }
        Ok(removed)
    }

    fn check(&self, agent: &AgentId, grant: &str) -> Result<(Attached, Grant), McpError> {
        let at = self.attached().ok_or(McpError::NotBuilt)?;
        let ctx = at.ctx.upgrade().ok_or(McpError::NotBuilt)?;
        if !ctx.agent_ids().contains(agent) {
            return Err(McpError::UnknownAgent {
                agent: agent.to_string(),
            });
        }
        let grant = Grant::parse(grant).map_err(McpError::InvalidGrant)?;
        if !at.servers.contains_key(&grant.server) {
            return Err(McpError::UnknownServer {
                server: grant.server,
            });
        }
        Ok((at, grant))
    }

    /// Whether `agent` may use the tool `tool` of the server `server` now.
    fn granted(&self, agent: &AgentId, server: &str, tool: &str) -> bool {
        self.inner
            .grants
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(agent)
            .is_some_and(|grants| grants.iter().any(|g| g.covers(server, tool)))
    }

    /// Whether `agent` has a grant on the server `server`.
    fn uses(&self, agent: &AgentId, server: &str) -> bool {
        self.inner
            .grants
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(agent)
            .is_some_and(|grants| grants.iter().any(|g| g.server == server))
    }

    /// Each agent's grants whose calls wait for a human's approval (from the configuration).
    pub fn approval_grants(&self) -> BTreeMap<AgentId, BTreeSet<Grant>> {
        self.inner
            .approvals
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Whether `agent`'s calls of `tool` of `server` wait for a human's approval.
    pub fn requires_approval(&self, agent: &AgentId, server: &str, tool: &str) -> bool {
        self.inner
            .approvals
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(agent)
            .is_some_and(|grants| grants.iter().any(|g| g.covers(server, tool)))
    }

    fn records(&self) -> Result<Records<PendingCall>, McpError> {
        self.attached().map(|a| a.records).ok_or(McpError::NotBuilt)
    }

    /// The calls waiting for approval now (stored: they survive a restart).
    ///
    /// # Errors
    /// [`McpError::NotBuilt`], [`McpError::Store`].
    pub async fn pending_calls(&self) -> Result<Vec<PendingCall>, McpError> {
        Ok(self
            .approval_calls()
            .await?
            .into_iter()
            .filter(|c| c.status == ApprovalStatus::Pending)
            .collect())
    }

    /// Every call that needed approval, whatever its status, by id.
    ///
    /// # Errors
    /// [`McpError::NotBuilt`], [`McpError::Store`].
    pub async fn approval_calls(&self) -> Result<Vec<PendingCall>, McpError> {
        let records = self.records()?;
        let all = records
            .list("")
            .await
            .map_err(|e| McpError::Store(e.to_string()))?;
        Ok(all.into_iter().map(|r| r.value).collect())
    }

    /// Approves the pending call `id` (`by`: who, as recorded): it runs once, and its result
    /// goes to the model.
    ///
    /// # Errors
    /// [`McpError::NoSuchCall`], [`McpError::NotPending`] (decided already), [`McpError::Store`].
    pub async fn approve(&self, id: &str, by: &str) -> Result<PendingCall, McpError> {
        let call = decide(&self.records()?, id, by, None).await?;
        self.inner.decided.0.send_modify(|n| *n += 1);
        Ok(call)
    }

    /// Rejects the pending call `id`: it never runs; the model is answered that a human
    /// rejected it, with `reason`.
    ///
    /// # Errors
    /// As [`approve`](Self::approve).
    pub async fn reject(&self, id: &str, by: &str, reason: &str) -> Result<PendingCall, McpError> {
        let call = decide(&self.records()?, id, by, Some(reason)).await?;
        self.inner.decided.0.send_modify(|n| *n += 1);
        Ok(call)
    }

    /// Stops every server (their child processes are killed). Calls are answered as errors
    /// from then on.
    pub fn shutdown(&self) {
        for server in self.servers().values() {
            server.stop();
        }
    }

    /// The tool the model names `name`, with its server.
    fn find(&self, name: &str) -> Option<(Arc<Server>, McpTool)> {
        for server in self.servers().values() {
            if let Some(tool) = server.tools().iter().find(|t| t.exposed == name) {
                return Some((server.clone(), tool.clone()));
            }
        }
        None
    }
}

#[async_trait]
impl Behaviour for Mcp {
    fn name(&self) -> &'static str {
        "mcp"
    }

    fn config_section(&self) -> Option<&'static str> {
        Some(SECTION)
    }

    fn agent_fields(&self) -> &'static [&'static str] {
        &[AGENT_FIELD, EXPOSE_FIELD]
    }

    fn tool_sets(&self) -> Vec<Arc<dyn ToolSet>> {
        vec![Arc::new(McpTools(self.clone()))]
    }

    async fn on_build(&self, ctx: &BehaviourContext) -> Result<(), OrgError> {
        let config = McpConfig::from_org(ctx.config())?;
        let mut servers = BTreeMap::new();
        for server in config.servers {
            let weak = ctx.downgrade();
            let changed = Box::new(move || {
                if let Some(ctx) = weak.upgrade() {
                    ctx.tools_changed();
                }
            });
            servers.insert(server.id.clone(), Arc::new(Server::new(server, changed)));
        }
        *self
            .inner
            .grants
            .write()
            .unwrap_or_else(PoisonError::into_inner) = config.grants;
        *self
            .inner
            .approvals
            .write()
            .unwrap_or_else(PoisonError::into_inner) = config.approvals;
        let records = Records::new(ctx.stores().records.clone(), APPROVALS_NAMESPACE)?;
        let previous = self
            .inner
            .attached
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(Attached {
                ctx: ctx.downgrade(),
                servers: Arc::new(servers),
                records,
            });
        if let Some(previous) = previous {
            for server in previous.servers.values() {
                server.stop();
            }
        }
        Ok(())
    }

    async fn on_start_all(&self, _ctx: &BehaviourContext) -> Result<(), StoreError> {
        let eager: Vec<(String, Duration)> = self
            .servers()
            .values()
            .filter(|s| s.config.start == Start::Eager)
            .map(|s| (s.config.id.clone(), s.config.timeout))
            .collect();
        for (id, timeout) in eager {
            if let Err(e) = self.wait_ready(&id, timeout).await {
                tracing::warn!(server = %id, "MCP server not ready at start: {e}; it is started again in the background");
            }
        }
        Ok(())
    }

    fn on_agent_started(&self, _ctx: &BehaviourContext, agent: AgentWorker) {
        for server in self.servers().values() {
            if self.uses(agent.id(), &server.config.id) {
                server.start();
            }
        }
    }
}

/// The tool set the agents are offered: every granted tool of every server, as last listed.
#[derive(Debug)]
struct McpTools(Mcp);

#[async_trait]
impl ToolSet for McpTools {
    fn definitions_for(&self, scope: &ToolCapability) -> Vec<ToolDefinition> {
        let mut defs = Vec::new();
        for server in self.0.servers().values() {
            for tool in server.tools().iter() {
                if self.0.granted(scope.agent(), &server.config.id, &tool.name) {
                    defs.push(ToolDefinition::new(
                        tool.exposed.clone(),
                        tool.description.clone(),
                        tool.schema.clone(),
                    ));
                }
            }
        }
        defs
    }

    async fn call(
        &self,
        ctx: &ToolContext,
        name: &str,
        args: Value,
    ) -> Option<Result<ToolOutput, ToolError>> {
        let (server, tool) = self.0.find(name)?;
        // The grant is read now, whatever the model was offered: a tool not granted to the
        // calling agent is an unknown tool to it.
        if !self.0.granted(&ctx.agent, &server.config.id, &tool.name) {
            return None;
        }
        if self
            .0
            .requires_approval(&ctx.agent, &server.config.id, &tool.name)
        {
            let records = match self.0.records() {
                Ok(r) => r,
                Err(e) => return Some(Err(ToolError::failed(&tool.exposed, e.to_string()))),
            };
            let args = match validate(&tool, args) {
                Ok(a) => a,
                Err(e) => return Some(Err(e)),
            };
            let decided = self.0.inner.decided.0.subscribe();
            return Some(run_approved(&records, decided, &server, &tool, ctx, args).await);
        }
        Some(run(&server, &tool, ctx, args).await)
    }
}

async fn run(
    server: &Server,
    tool: &McpTool,
    ctx: &ToolContext,
    args: Value,
) -> Result<ToolOutput, ToolError> {
    let args = validate(tool, args)?;
    execute(server, tool, ctx, args)
        .await
        .map(ToolOutput::text)
        .map_err(|e| ToolError::failed(&tool.exposed, e))
}

/// The arguments, checked against the tool's input schema.
pub(crate) fn validate(tool: &McpTool, args: Value) -> Result<Map<String, Value>, ToolError> {
    let name = tool.exposed.as_str();
    if let Some(validator) = &tool.validator {
        let problems: Vec<String> = validator
            .iter_errors(&args)
            .take(5)
            .map(|e| {
                let at = e.instance_path().to_string();
                if at.is_empty() {
                    e.to_string()
                } else {
                    format!("{at}: {e}")
                }
            })
            .collect();
        if !problems.is_empty() {
            return Err(ToolError::invalid_arguments(
                name,
                format!(
                    "{}; the arguments must match this JSON Schema: {}",
                    problems.join("; "),
                    tool.schema
                ),
            ));
        }
    }
    let Value::Object(args) = args else {
        return Err(ToolError::invalid_arguments(
            name,
            "the arguments must be one JSON object",
        ));
    };
    Ok(args)
}

/// Runs the call: the text shown to the model, or the failure's.
pub(crate) async fn execute(
    server: &Server,
    tool: &McpTool,
    ctx: &ToolContext,
    args: Map<String, Value>,
) -> Result<String, String> {
    let cap = server.config.max_result_bytes;
    match server.call(&tool.name, args, &ctx.key).await {
        Ok(result) => {
            let (text, is_error) = render(&result, cap);
            if is_error { Err(text) } else { Ok(text) }
        }
        Err(CallError::NotReady(state)) => Err(format!(
            "the MCP server {} is not available now ({state}); it is being started again, \
             try again later",
            server.config.id
        )),
        Err(CallError::Timeout(after)) => Err(format!(
            "no answer within {} ms; the call was cancelled",
            after.as_millis()
        )),
        Err(CallError::Failed(e)) => Err(cap_text(
            format!("the MCP server {} failed to answer: {e}", server.config.id),
            cap,
        )),
    }
}
