//! The organization as an MCP server: the agents the operator exposes become tools
//! (`ask_{agent}`), the topology and the task boards become resources.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    ListResourcesResult, ListToolsResult, PaginatedRequestParams, ProgressNotificationParam,
    ReadResourceRequestParams, ReadResourceResponse, ReadResourceResult, Resource,
    ResourceContents, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::{
    StreamableHttpServerConfig, StreamableHttpService, session::local::LocalSessionManager,
};
use rmcp::{ErrorData, RoleServer, ServerHandler, ServiceExt};
use serde_json::{Value, json};
use spacebot_core::runtime::OutboundError;
use spacebot_core::task::TaskFilter;
use spacebot_core::{
    AgentId, Event, EventKind, Identity, InboundMessage, Organization, Outbound, Reply, ReplyKind,
    Source, TaskRef,
};
use tokio::sync::oneshot;

use crate::config::McpConfig;
use crate::mcp::McpError;

/// The platform of the messages MCP clients send (`ask_{agent}`); a message's reply target is
/// one call's own id.
pub const PLATFORM: &str = "mcp";
/// The longest tool description taken from an agent's `ROLE.md`.
const MAX_DESCRIPTION: usize = 1024;
/// The URI of the topology resource.
pub const TOPOLOGY_URI: &str = "spacebot://topology";
/// The URI prefix of the task board resources (`spacebot://tasks/{agent}`).
pub const TASKS_URI: &str = "spacebot://tasks/";

type Waiters = HashMap<String, oneshot::Sender<Reply>>;

/// The outbound that gives each `ask_{agent}` call its reply: give it to the organization's
/// builder as the outbound (`.outbound(Arc::new(chat.clone()))`) and the same handle to
/// [`OrgServer::new`]. Replies to other platforms go to the fallback (spacebot-http's `WebChat`,
/// say); without one they are dropped with a warning.
#[derive(Clone, Default)]
pub struct McpChat {
    waiters: Arc<Mutex<Waiters>>,
    fallback: Option<Arc<dyn Outbound>>,
}

impl fmt::Debug for McpChat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("McpChat")
            .field("waiting", &self.lock().len())
            .field("fallback", &self.fallback)
            .finish()
    }
}

impl McpChat {
    /// An MCP chat without fallback.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sends the replies to platforms other than [`PLATFORM`] to `outbound`.
    pub fn with_fallback(mut self, outbound: Arc<dyn Outbound>) -> Self {
        self.fallback = Some(outbound);
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Waiters> {
        self.waiters.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait(&self, target: &str) -> oneshot::Receiver<Reply> {
        let (tx, rx) = oneshot::channel();
        self.lock().insert(target.to_owned(), tx);
        rx
    }

    fn forget(&self, target: &str) {
        self.lock().remove(target);
    }
}

#[async_trait]
impl Outbound for McpChat {
    async fn send(&self, reply: Reply) -> Result<(), OutboundError> {
        let target = match &reply.source {
            Source::External {
                platform,
                reply_target,
            } if platform == PLATFORM => reply_target.clone(),
            _ => {
                return match &self.fallback {
                    Some(fallback) => fallback.send(reply).await,
                    None => {
                        tracing::warn!(agent = %reply.agent, "a reply to a platform other than mcp, and McpChat has no fallback: dropped");
                        Ok(())
                    }
                };
            }
        };
        match self.lock().remove(&target) {
            Some(tx) => {
                // The caller may have gone (cancelled): nothing waits then.
                let _ = tx.send(reply);
                Ok(())
            }
            None => Err(OutboundError::Closed(format!(
                "the MCP call {target} no longer waits for its reply"
            ))),
        }
    }

    /// Whether the fallback wants answers streamed (MCP calls themselves get the final reply).
    fn wants_deltas(&self) -> bool {
        self.fallback.as_ref().is_some_and(|f| f.wants_deltas())
    }

    /// Passes pieces of answers to other platforms on to the fallback.
    async fn send_delta(
        &self,
        delta: spacebot_core::runtime::outbound::ReplyDelta,
    ) -> Result<(), OutboundError> {
        let mcp = delta
            .channel
            .as_str()
            .strip_prefix(PLATFORM)
            .is_some_and(|rest| rest.starts_with(':'));
        match &self.fallback {
            Some(fallback) if !mcp => fallback.send_delta(delta).await,
            _ => Ok(()),
        }
    }
}

/// The organization as an MCP server (rmcp's [`ServerHandler`]).
///
/// - **Tools**: each exposed agent is the tool `ask_{agent}` (`{"message": "..."}`), described by
///   its `ROLE.md` (or a sentence naming it). A call delivers the message to the agent (platform
///   [`PLATFORM`]) and answers with the agent's final reply, its delegations included; while the
///   work goes on, a client that sent a progress token is told of each step (turns, tasks
///   created, claimed, finished, in the agent's own words: `lead: task lead#1 created`). A
///   cancelled call cancels the agent's turn answering it, if it runs
///   ([`Organization::cancel_turn`]).
/// - **Resources**: [`TOPOLOGY_URI`] (the graph as JSON) and `spacebot://tasks/{agent}` (each
///   agent's task board as JSON).
///
/// Which agents are exposed: `mcp_expose = true` in their `[[agents]]` entry (none by default),
/// and [`expose`](Self::expose). Serve it over streamable HTTP with
/// [`http_service`](Self::http_service) (spacebot-http mounts it at `/mcp`, behind its bearer
/// token) or over stdio with [`serve_stdio`](Self::serve_stdio) (`spacebot mcp`).
#[derive(Clone)]
pub struct OrgServer {
    org: Organization,
    chat: McpChat,
    exposed: Arc<BTreeSet<AgentId>>,
}

impl fmt::Debug for OrgServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OrgServer")
            .field("exposed", &self.exposed)
            .finish_non_exhaustive()
    }
}

impl OrgServer {
    /// The server over `org`, exposing the agents whose `mcp_expose` is true. `chat` must be the
    /// organization's outbound (see [`McpChat`]).
    ///
    /// # Errors
    /// [`McpError::InvalidConfig`] when the configuration's MCP fields do not check.
    pub fn new(org: Organization, chat: McpChat) -> Result<Self, McpError> {
        let config = McpConfig::from_org(org.config())
            .map_err(|e| McpError::InvalidConfig(e.to_string()))?;
        Ok(Self {
            org,
            chat,
            exposed: Arc::new(config.exposed),
        })
    }

    /// Exposes `agent` too.
    ///
    /// # Errors
    /// [`McpError::UnknownAgent`].
    pub fn expose(mut self, agent: &AgentId) -> Result<Self, McpError> {
        if !self.org.agent_ids().contains(agent) {
            return Err(McpError::UnknownAgent {
                agent: agent.to_string(),
            });
        }
        Arc::make_mut(&mut self.exposed).insert(agent.clone());
        Ok(self)
    }

    /// The exposed agents.
    pub fn exposed(&self) -> Vec<AgentId> {
        self.exposed.iter().cloned().collect()
    }

    /// The tool name of `agent` (`ask_{agent}`, characters outside `[a-zA-Z0-9_-]` as `_`).
    pub fn tool_name(agent: &AgentId) -> String {
        let name: String = agent
            .as_str()
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        format!("ask_{name}")
    }

    /// The tower service serving MCP's streamable HTTP transport (mount it with axum's
    /// `nest_service`). `check_host`: refuse requests whose `Host` is not a loopback name
    /// (against DNS rebinding; needed when nothing else authenticates the caller).
    pub fn http_service(
        &self,
        check_host: bool,
    ) -> StreamableHttpService<OrgServer, LocalSessionManager> {
        let mut config = StreamableHttpServerConfig::default();
        if !check_host {
            config = config.disable_allowed_hosts();
        }
        let server = self.clone();
        StreamableHttpService::new(
            move || Ok(server.clone()),
            Arc::new(LocalSessionManager::default()),
            config,
        )
    }

    /// Serves one client over standard input and output until it closes them.
    ///
    /// # Errors
    /// [`McpError::Transport`] when the session cannot be set up or ends in error.
    pub async fn serve_stdio(self) -> Result<(), McpError> {
        let running = self
            .serve(rmcp::transport::io::stdio())
            .await
            .map_err(|e| McpError::Transport(e.to_string()))?;
        running
            .waiting()
            .await
            .map_err(|e| McpError::Transport(e.to_string()))?;
        Ok(())
    }

    fn agent_of(&self, tool: &str) -> Option<AgentId> {
        self.exposed
            .iter()
            .find(|a| Self::tool_name(a) == tool)
            .cloned()
    }

    fn description(&self, agent: &AgentId) -> String {
        let role = self
            .org
            .config()
            .agents
            .iter()
            .find(|a| &a.id == agent)
            .and_then(|a| a.workspace.as_deref())
            .and_then(|dir| Identity::load(dir).ok())
            .and_then(|i| i.role)
            .map(|r| r.trim().to_owned())
            .filter(|r| !r.is_empty());
        let name = self.org.display_name(agent);
        match role {
            Some(role) => {
                let mut role = role;
                if role.len() > MAX_DESCRIPTION {
                    let mut cut = MAX_DESCRIPTION;
                    while !role.is_char_boundary(cut) {
                        cut -= 1;
                    }
                    role.truncate(cut);
                    role.push_str("...");
                }
                format!("Ask {name} (agent {agent}) and get its final answer. Its role: {role}")
            }
            None => format!(
                "Ask {name} (agent {agent} of a spacebot organization) and get its final answer, \
                 after any work it delegates."
            ),
        }
    }

    async fn ask(
        &self,
        agent: AgentId,
        message: String,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let target = uuid::Uuid::new_v4().simple().to_string();
        let channel = format!("{PLATFORM}:{target}");
        let mut events = self.org.subscribe();
        let reply = self.chat.wait(&target);
        let delivered = self
            .org
            .deliver(
                agent.as_str(),
                InboundMessage::new(PLATFORM, target.clone(), message),
            )
            .await;
        if let Err(e) = delivered {
            self.chat.forget(&target);
            return Ok(CallToolResult::error(vec![ContentBlock::text(format!(
                "the message was not delivered to {agent}: {e}"
            ))]));
        }
        let token = context.meta.get_progress_token();
        let mut progress = Progress {
            agent: agent.clone(),
            channel,
            running: false,
            tasks: BTreeSet::new(),
            step: 0,
        };
        tokio::pin!(reply);
        loop {
            tokio::select! {
                answer = &mut reply => {
                    // The events already published tell the steps before the answer.
                    while let Ok(Some(event)) = events.try_recv() {
                        if let Some(step) = progress.note(&event)
                            && let Some(token) = &token
                        {
                            let param = ProgressNotificationParam::new(token.clone(), f64::from(progress.step))
                                .with_message(step);
                            let _ = context.peer.notify_progress(param).await;
                        }
                    }
                    return Ok(match answer {
                        Ok(reply) if reply.kind == ReplyKind::Answer => {
                            CallToolResult::success(vec![ContentBlock::text(reply.content.to_string())])
                        }
                        Ok(reply) => CallToolResult::error(vec![ContentBlock::text(reply.content.to_string())]),
                        Err(_) => CallToolResult::error(vec![ContentBlock::text(
                            "the organization stopped before the agent answered",
                        )]),
                    });
                }
                () = context.ct.cancelled() => {
                    self.chat.forget(&target);
                    if progress.running {
                        self.org.cancel_turn(&agent);
                    }
                    return Err(ErrorData::internal_error("the call was cancelled", None));
                }
                event = events.recv() => {
                    let Ok(event) = event else { continue };
                    if let Some(step) = progress.note(&event)
                        && let Some(token) = &token
                    {
                        let param = ProgressNotificationParam::new(token.clone(), f64::from(progress.step))
                            .with_message(step);
                        let _ = context.peer.notify_progress(param).await;
                    }
                }
            }
        }
    }

    async fn board(&self, agent: &AgentId) -> Result<String, ErrorData> {
        let tasks = self
            .org
            .stores()
            .tasks
            .list(agent, &TaskFilter::default())
            .await
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        serde_json::to_string_pretty(&tasks)
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))
    }
}

/// What one call has seen of its work, to tell its steps.
struct Progress {
    agent: AgentId,
    channel: String,
    /// Whether the asked agent's turn on the call's channel runs now.
    running: bool,
    /// The tasks the call's work made, at any depth.
    tasks: BTreeSet<TaskRef>,
    step: u32,
}

impl Progress {
    /// Whether `event` is part of the call's work, and how to tell it.
    fn note(&mut self, event: &Event) -> Option<String> {
        let ours_channel = event.agent == self.agent
            && event
                .channel
                .as_ref()
                .is_some_and(|c| c.as_str() == self.channel);
        let mine = match &event.kind {
            EventKind::TurnStarted if ours_channel => {
                self.running = true;
                true
            }
            EventKind::TurnFinished { .. } | EventKind::TurnCancelled if ours_channel => {
                self.running = false;
                true
            }
            EventKind::TaskCreated { created_by, .. } => {
                // A turn answers one channel at a time: a task the asked agent creates while
                // its turn on the call's channel runs is the call's; so is any task made for
                // one of those.
                let by_us = self.running && created_by == &format!("agent:{}", self.agent);
                let under_ours = event
                    .parent
                    .as_ref()
                    .is_some_and(|p| self.tasks.contains(p));
                match &event.task {
                    Some(task) if by_us || under_ours => {
                        self.tasks.insert(task.clone());
                        true
                    }
                    _ => false,
                }
            }
            _ => event.task.as_ref().is_some_and(|t| self.tasks.contains(t)),
        };
        if !mine {
            return None;
        }
        self.step += 1;
        let what = match &event.kind {
            EventKind::TurnStarted => "turn started".to_owned(),
            EventKind::TurnFinished { .. } => "turn finished".to_owned(),
            EventKind::TurnCancelled => "turn cancelled".to_owned(),
            EventKind::TaskCreated { .. } => "task created".to_owned(),
            EventKind::TaskClaimed { .. } => "task claimed".to_owned(),
            EventKind::TaskCompleted => "task completed".to_owned(),
            EventKind::TaskFailed { error } => format!("task failed: {error}"),
            EventKind::TaskCancelled => "task cancelled".to_owned(),
            EventKind::ToolCalled { tool, ok } => {
                format!("tool {tool} {}", if *ok { "called" } else { "failed" })
            }
            other => format!("{other:?}"),
        };
        Some(match &event.task {
            Some(task) => format!("{}: {what} ({task})", event.agent),
            None => format!("{}: {what}", event.agent),
        })
    }
}

fn text_arg(args: Option<&serde_json::Map<String, Value>>) -> Result<String, ErrorData> {
    match args.and_then(|a| a.get("message")) {
        Some(Value::String(s)) if !s.trim().is_empty() => Ok(s.clone()),
        _ => Err(ErrorData::invalid_params(
            "give the message to send as {\"message\": \"...\"} (a non-empty string)",
            None,
        )),
    }
}

impl ServerHandler for OrgServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_resources()
                .build(),
        )
        .with_server_info(Implementation::new("spacebot", env!("CARGO_PKG_VERSION")))
        .with_instructions(
            "A spacebot organization of agents: each tool ask_<agent> sends one agent a message \
             and answers with its final reply; the topology and the task boards are resources.",
        )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let schema = json!({
            "type": "object",
            "properties": {"message": {"type": "string", "description": "What to ask the agent"}},
            "required": ["message"],
        });
        let Value::Object(schema) = schema else {
            return Err(ErrorData::internal_error("schema", None));
        };
        let schema = Arc::new(schema);
        let tools = self
            .exposed
            .iter()
            .map(|a| Tool::new(Self::tool_name(a), self.description(a), schema.clone()))
            .collect();
        Ok(ListToolsResult::with_all_items(tools))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let Some(agent) = self.agent_of(&request.name) else {
            return Err(ErrorData::invalid_params(
                format!("unknown tool {:?}", request.name),
                None,
            ));
        };
        let message = text_arg(request.arguments.as_ref())?;
        Ok(self.ask(agent, message, context).await?.into())
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        let mut resources = vec![
            Resource::new(TOPOLOGY_URI, "topology")
                .with_description("The organization's agents and links")
                .with_mime_type("application/json"),
        ];
        for agent in self.org.agent_ids() {
            resources.push(
                Resource::new(format!("{TASKS_URI}{agent}"), format!("tasks of {agent}"))
                    .with_description(format!("The task board of {agent}"))
                    .with_mime_type("application/json"),
            );
        }
        Ok(ListResourcesResult::with_all_items(resources))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        let uri = request.uri.as_str();
        let text = if uri == TOPOLOGY_URI {
            serde_json::to_string_pretty(&self.org.topology())
                .map_err(|e| ErrorData::internal_error(e.to_string(), None))?
        } else if let Some(agent) = uri.strip_prefix(TASKS_URI)
            && let Some(agent) = self
                .org
                .agent_ids()
                .into_iter()
                .find(|a| a.as_str() == agent)
        {
            self.board(&agent).await?
        } else {
            return Err(ErrorData::resource_not_found(
                format!("no resource {uri:?}"),
                None,
            ));
        };
        Ok(ReadResourceResult::new(vec![
            ResourceContents::text(text, uri).with_mime_type("application/json"),
        ])
        .into())
    }
}
