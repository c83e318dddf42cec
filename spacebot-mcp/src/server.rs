//! One MCP server: its connection (made on the official `rmcp` SDK), its tools, and its restarts.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use rmcp::model::{CallToolRequestParams, CallToolResult, MetaObject, RequestMetaObject};
use rmcp::service::{NotificationContext, RunningService, RunningServiceCancellationToken};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use rmcp::{ClientHandler, Peer, RoleClient, ServiceExt};
use serde_json::Value;

use crate::config::{ServerConfig, Transport};
use crate::names::exposed_name;

/// The `_meta` key of a call's idempotency key (see `docs/mcp.md`, effects).
pub const IDEMPOTENCY_META_KEY: &str = "spacebot/idempotency_key";

/// The first wait before a dead server is started again; doubled after each failed start.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// The longest wait between two starts.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// What a server is doing.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ServerState {
    /// Not started yet (a lazy server no granted agent needed yet).
    NotStarted,
    /// Being started (the process spawned or the endpoint reached, the session set up).
    Starting,
    /// Connected, with this many tools.
    Ready {
        /// How many tools it lists.
        tools: usize,
    },
    /// Dead or never reached: started again after a wait that doubles with each failure. Calls
    /// are answered as errors meanwhile.
    Restarting {
        /// How many starts failed in a row (0: it died after it was ready).
        attempt: u32,
        /// Why.
        error: String,
    },
    /// Shut down for good.
    Stopped,
}

impl fmt::Display for ServerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotStarted => f.write_str("not started"),
            Self::Starting => f.write_str("starting"),
            Self::Ready { tools } => write!(f, "ready ({tools} tools)"),
            Self::Restarting { error, .. } => write!(f, "restarting ({error})"),
            Self::Stopped => f.write_str("stopped"),
        }
    }
}

/// One tool of a server.
#[derive(Clone)]
pub(crate) struct McpTool {
    /// The name the server lists.
    pub(crate) name: String,
    /// The name the model sees (`{server}__{tool}`).
    pub(crate) exposed: String,
    pub(crate) description: String,
    pub(crate) schema: Value,
    /// The compiled input schema (`None`: the server's schema does not compile; not checked).
    pub(crate) validator: Option<Arc<jsonschema::Validator>>,
}

/// Why a call did not give a result.
#[derive(Debug)]
pub(crate) enum CallError {
    NotReady(ServerState),
    Timeout(Duration),
    Failed(String),
}

struct Live {
    state: ServerState,
    peer: Option<Peer<RoleClient>>,
    tools: Arc<Vec<McpTool>>,
    cancel: Option<RunningServiceCancellationToken>,
    running: bool,
    stopped: bool,
    starts: u64,
}

/// A server, shared by the behaviour, its run loop and its notification handler.
pub(crate) struct Server {
    pub(crate) config: ServerConfig,
    live: Mutex<Live>,
    state_tx: tokio::sync::watch::Sender<ServerState>,
    /// Called when the server's tools changed (the behaviour says so to the host).
    on_tools_changed: Box<dyn Fn() + Send + Sync>,
}

impl fmt::Debug for Server {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Server")
            .field("id", &self.config.id)
            .field("state", &self.state())
            .finish_non_exhaustive()
    }
}

type Service = RunningService<RoleClient, Handler>;

impl Server {
    pub(crate) fn new(config: ServerConfig, on_tools_changed: Box<dyn Fn() + Send + Sync>) -> Self {
        let (state_tx, _) = tokio::sync::watch::channel(ServerState::NotStarted);
        Self {
            config,
            live: Mutex::new(Live {
                state: ServerState::NotStarted,
                peer: None,
                tools: Arc::new(Vec::new()),
                cancel: None,
                running: false,
                stopped: false,
                starts: 0,
            }),
            state_tx,
            on_tools_changed,
        }
    }

    fn live(&self) -> std::sync::MutexGuard<'_, Live> {
        self.live.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How many times a session with the server was set up.
    pub(crate) fn starts(&self) -> u64 {
        self.live().starts
    }

    pub(crate) fn state(&self) -> ServerState {
        self.live().state.clone()
    }

    fn set_state(&self, state: ServerState) {
        self.live().state = state.clone();
        self.state_tx.send_replace(state);
    }

    /// The tools as last listed (kept while the server restarts: their calls are answered as
    /// errors meanwhile).
    pub(crate) fn tools(&self) -> Arc<Vec<McpTool>> {
        self.live().tools.clone()
    }

    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<ServerState> {
        self.state_tx.subscribe()
    }

    /// Starts the server's run loop unless it runs (or was stopped).
    pub(crate) fn start(self: &Arc<Self>) {
        {
            let mut live = self.live();
            if live.running || live.stopped {
                return;
            }
            live.running = true;
        }
        let server = self.clone();
        tokio::spawn(async move { server.run().await });
    }

    /// Stops the server for good: its session is cancelled, a child process is killed.
    pub(crate) fn stop(&self) {
        let cancel = {
            let mut live = self.live();
            live.stopped = true;
            live.peer = None;
            live.cancel.take()
        };
        if let Some(cancel) = cancel {
            cancel.cancel();
        }
        self.set_state(ServerState::Stopped);
    }

    fn stopped(&self) -> bool {
        self.live().stopped
    }

    /// Connects, serves until the connection ends, and connects again after a backoff, until
    /// stopped.
    async fn run(self: Arc<Self>) {
        let mut attempt: u32 = 0;
        loop {
            if self.stopped() {
                return;
            }
            self.set_state(ServerState::Starting);
            let error = match self.connect().await {
                Ok(service) => {
                    attempt = 0;
                    let reason = service.waiting().await;
                    {
                        let mut live = self.live();
                        live.peer = None;
                        live.cancel = None;
                    }
                    let why = match reason {
                        Ok(reason) => format!("the connection ended ({reason:?})"),
                        Err(e) => format!("the connection failed ({e})"),
                    };
                    tracing::warn!(server = %self.config.id, "MCP server: {why}; starting it again");
                    why
                }
                Err(e) => {
                    tracing::warn!(server = %self.config.id, attempt, "MCP server could not be started: {e}");
                    attempt = attempt.saturating_add(1);
                    e
                }
            };
            if self.stopped() {
                return;
            }
            self.set_state(ServerState::Restarting { attempt, error });
            let exp = attempt.saturating_sub(1).min(16);
            let wait = FIRST_BACKOFF.saturating_mul(1 << exp).min(MAX_BACKOFF);
            tokio::time::sleep(wait).await;
        }
    }

    async fn connect(self: &Arc<Self>) -> Result<Service, String> {
        let handler = Handler {
            server: Arc::downgrade(self),
        };
        let timeout = self.config.timeout;
        let service = match &self.config.transport {
            Transport::Stdio {
                command,
                args,
                env,
                cwd,
            } => {
                let mut cmd = tokio::process::Command::new(command);
                cmd.args(args).envs(env).kill_on_drop(true);
                if let Some(cwd) = cwd {
                    cmd.current_dir(cwd);
                }
                let (transport, _stderr) = TokioChildProcess::builder(cmd)
                    .spawn()
                    .map_err(|e| format!("cannot run {command:?}: {e}"))?;
                tokio::time::timeout(timeout, handler.serve(transport))
                    .await
                    .map_err(|_| format!("no MCP session within {} ms", timeout.as_millis()))?
                    .map_err(|e| format!("the MCP session could not be set up: {e}"))?
            }
            Transport::Http {
                url,
                headers,
                bearer_token,
            } => {
                let mut config = StreamableHttpClientTransportConfig::with_uri(url.clone());
                if let Some(token) = bearer_token {
                    config = config.auth_header(token.clone());
                }
                let mut map = HashMap::new();
                for (name, value) in headers {
                    // Checked by the configuration.
                    if let (Ok(name), Ok(value)) = (
                        http::HeaderName::from_bytes(name.as_bytes()),
                        http::HeaderValue::from_str(value),
                    ) {
                        map.insert(name, value);
                    }
                }
                config = config.custom_headers(map);
                let transport = StreamableHttpClientTransport::from_config(config);
                tokio::time::timeout(timeout, handler.serve(transport))
                    .await
                    .map_err(|_| {
                        format!(
                            "no MCP session with {url} within {} ms",
                            timeout.as_millis()
                        )
                    })?
                    .map_err(|e| format!("the MCP session with {url} could not be set up: {e}"))?
            }
        };
        let tools = list_tools(&self.config.id, service.peer(), timeout).await?;
        let count = tools.len();
        let stopped = {
            let mut live = self.live();
            if !live.stopped {
                live.peer = Some(service.peer().clone());
                live.cancel = Some(service.cancellation_token());
                live.tools = Arc::new(tools);
                live.starts += 1;
            }
            live.stopped
        };
        if stopped {
            let mut service = service;
            let _ = service.close().await;
            return Err("stopped".to_owned());
        }
        self.set_state(ServerState::Ready { tools: count });
        tracing::info!(server = %self.config.id, tools = count, "MCP server ready");
        (self.on_tools_changed)();
        Ok(service)
    }

    /// Lists the tools again (`notifications/tools/list_changed`).
    async fn refresh(self: Arc<Self>, peer: Peer<RoleClient>) {
        match list_tools(&self.config.id, &peer, self.config.timeout).await {
            Ok(tools) => {
                let count = tools.len();
                {
                    let mut live = self.live();
                    if live.stopped {
                        return;
                    }
                    live.tools = Arc::new(tools);
                }
                if matches!(self.state(), ServerState::Ready { .. }) {
                    self.set_state(ServerState::Ready { tools: count });
                }
                (self.on_tools_changed)();
            }
            Err(e) => {
                tracing::warn!(server = %self.config.id, "MCP server: the changed tool list could not be read: {e}");
            }
        }
    }

    /// Calls the tool `tool` (its name as the server lists it) with `arguments`, passing `key`
    /// in `_meta`, within the server's timeout. Dropping the future cancels the call (the SDK
    /// sends `notifications/cancelled`).
    pub(crate) async fn call(
        &self,
        tool: &str,
        arguments: serde_json::Map<String, Value>,
        key: &str,
    ) -> Result<CallToolResult, CallError> {
        let peer = {
            let live = self.live();
            match &live.peer {
                Some(peer) => peer.clone(),
                None => return Err(CallError::NotReady(live.state.clone())),
            }
        };
        let mut meta = serde_json::Map::new();
        meta.insert(
            IDEMPOTENCY_META_KEY.to_owned(),
            Value::String(key.to_owned()),
        );
        let mut params = CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments);
        params.meta = Some(RequestMetaObject(MetaObject(meta)));
        match tokio::time::timeout(self.config.timeout, peer.call_tool(params)).await {
            Err(_) => Err(CallError::Timeout(self.config.timeout)),
            Ok(Err(e)) => Err(CallError::Failed(e.to_string())),
            Ok(Ok(result)) => Ok(result),
        }
    }
}

async fn list_tools(
    server: &str,
    peer: &Peer<RoleClient>,
    timeout: Duration,
) -> Result<Vec<McpTool>, String> {
    let listed = tokio::time::timeout(timeout, peer.list_all_tools())
        .await
        .map_err(|_| format!("tools/list took more than {} ms", timeout.as_millis()))?
        .map_err(|e| format!("tools/list failed: {e}"))?;
    let mut taken = BTreeSet::new();
    let mut tools = Vec::new();
    for tool in listed {
        let name = tool.name.to_string();
        let exposed = exposed_name(server, &name, &taken);
        taken.insert(exposed.clone());
        let schema = Value::Object((*tool.input_schema).clone());
        let validator = match jsonschema::validator_for(&schema) {
            Ok(v) => Some(Arc::new(v)),
            Err(e) => {
                tracing::warn!(server, tool = %name, "MCP tool's input schema does not compile ({e}); its arguments are not checked");
                None
            }
        };
        tools.push(McpTool {
            description: tool.description.as_deref().map_or_else(
                || format!("Tool {name} of the MCP server {server}."),
                str::to_owned,
            ),
            name,
            exposed,
            schema,
            validator,
        });
    }
    Ok(tools)
}

/// The client side's handler: picks up `notifications/tools/list_changed`.
struct Handler {
    server: Weak<Server>,
}

impl ClientHandler for Handler {
    fn on_tool_list_changed(
        &self,
        context: NotificationContext<RoleClient>,
    ) -> impl Future<Output = ()> + Send + '_ {
        if let Some(server) = self.server.upgrade() {
            // In a task of its own: the list is read with a request on this same session.
            tokio::spawn(server.refresh(context.peer));
        }
        std::future::ready(())
    }
}
