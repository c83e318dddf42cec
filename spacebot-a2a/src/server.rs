//! The organization's exposed agents served over A2A 1.0: agent cards, and the JSON-RPC binding
//! with its two streaming methods over server-sent events.

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use spacebot_core::{AgentId, Identity, InboundMessage, Organization};
use tokio::sync::{broadcast, mpsc};

use crate::A2aError;
use crate::a2a::{A2a, Attached, PLATFORM};
use crate::store::TaskRecord;
use crate::types::{
    AGENT_CARD_PATH, PROTOCOL_VERSION, SendMessageRequest, StreamResponse, TaskArtifactUpdateEvent,
    TaskIdParams, TaskState, TaskStatusUpdateEvent, VERSION_HEADER, codes, methods,
};

/// The longest skill description taken from an agent's `ROLE.md`.
const MAX_DESCRIPTION: usize = 1024;
/// How often a waiting request or a stream reads its task again (a task answered in another
/// process sharing the stores is seen this way).
const POLL: Duration = Duration::from_millis(500);
/// The metadata key (of the message or the request) naming the exposed agent asked at `/a2a`.
pub const SKILL_METADATA_KEY: &str = "skill";

/// The organization's exposed agents over A2A 1.0 (JSON-RPC binding), as an axum router
/// ([`router`](Self::router)):
///
/// | route | what |
/// |---|---|
/// | `GET /.well-known/agent-card.json` | the organization's card: one skill per exposed agent |
/// | `POST /a2a` | JSON-RPC; the agent asked is the skill named in the message's (or the request's) metadata `skill`, else the first exposed agent |
/// | `GET /a2a/{agent}/.well-known/agent-card.json` | one agent's card |
/// | `POST /a2a/{agent}` | JSON-RPC to that agent |
///
/// Methods: `SendMessage`, `SendStreamingMessage` (SSE), `GetTask`, `CancelTask`,
/// `SubscribeToTask` (SSE). An A2A task is one message delivered to the agent (platform
/// [`PLATFORM`], its own channel `a2a:{task id}`) and the agent's final reply, its delegations
/// included, kept in the organization's records (namespace
/// [`TASKS_NAMESPACE`](crate::TASKS_NAMESPACE)): `submitted` when stored, `working` when the
/// agent's turn starts, `input-required` while a task of its request waits for an operator's
/// approval (`working` again once approved, `rejected` when rejected), `completed` with the
/// reply, `failed` when the agent could not answer,
/// `rejected` when the message could not be delivered, `canceled` by `CancelTask`. A message id
/// sent again (per agent) answers with the same task and delivers nothing new.
///
/// With a token ([`with_token`](Self::with_token)) every JSON-RPC request must carry
/// `Authorization: Bearer <token>` (else 401), and the cards declare the bearer scheme; the
/// cards themselves are public.
#[derive(Clone)]
pub struct A2aServer {
    org: Organization,
    a2a: A2a,
    exposed: Arc<BTreeSet<AgentId>>,
    token: Option<Arc<str>>,
}

impl fmt::Debug for A2aServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("A2aServer")
            .field("exposed", &self.exposed)
            .field("token", &self.token.as_ref().map(|_| "..."))
            .finish_non_exhaustive()
    }
}

/// A JSON-RPC error.
struct RpcError {
    code: i64,
    message: String,
}

impl RpcError {
    fn new(code: i64, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

fn store_error(e: impl fmt::Display) -> RpcError {
    RpcError::new(codes::INTERNAL_ERROR, format!("the task store failed: {e}"))
}

impl A2aServer {
    /// The server over `org`, exposing the agents whose `a2a_expose` is true. `a2a` must be the
    /// handle the organization was built with (as behaviour and outbound). Must be called inside
    /// a Tokio runtime: it follows the organization's events (a task's turn started makes it
    /// working).
    ///
    /// # Errors
    /// [`A2aError::NotAttached`] when the organization was not built with `a2a`;
    /// [`A2aError::NoRuntime`] outside a Tokio runtime.
    pub fn new(org: Organization, a2a: A2a) -> Result<Self, A2aError> {
        let Some(attached) = a2a.attached() else {
            return Err(A2aError::NotAttached);
        };
        let exposed = attached.config.exposed.clone();
        tokio::runtime::Handle::try_current().map_err(|_| A2aError::NoRuntime)?;
        a2a.watch(org.subscribe());
        Ok(Self {
            org,
            a2a,
            exposed: Arc::new(exposed),
            token: None,
        })
    }

    /// Exposes `agent` too.
    ///
    /// # Errors
    /// [`A2aError::UnknownAgent`].
    pub fn expose(mut self, agent: &AgentId) -> Result<Self, A2aError> {
        if !self.org.agent_ids().contains(agent) {
            return Err(A2aError::UnknownAgent {
                agent: agent.to_string(),
            });
        }
        Arc::make_mut(&mut self.exposed).insert(agent.clone());
        Ok(self)
    }

    /// Requires `Authorization: Bearer <token>` on every JSON-RPC request (spacebot-http gives
    /// its own token).
    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token.map(Arc::from);
        self
    }

    /// The exposed agents.
    pub fn exposed(&self) -> Vec<AgentId> {
        self.exposed.iter().cloned().collect()
    }

    /// The routes (see the type's docs).
    pub fn router(&self) -> Router {
        Router::new()
            .route(AGENT_CARD_PATH, get(org_card))
            .route("/a2a", post(org_rpc))
            .route(&format!("/a2a/{{agent}}{AGENT_CARD_PATH}"), get(agent_card))
            .route("/a2a/{agent}", post(agent_rpc))
            .with_state(self.clone())
    }

    /// Serves [`router`](Self::router) alone on `listener` until the connection fails (an
    /// application with routes of its own merges the router instead).
    ///
    /// # Errors
    /// The server's I/O error.
    pub async fn serve(self, listener: tokio::net::TcpListener) -> std::io::Result<()> {
        axum::serve(listener, self.router()).await
    }

    fn attached(&self) -> Result<&Attached, RpcError> {
        self.a2a
            .attached()
            .ok_or_else(|| RpcError::new(codes::INTERNAL_ERROR, "not attached"))
    }

    fn role(&self, agent: &AgentId) -> Option<String> {
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
            .filter(|r| !r.is_empty())?;
        let mut role = role;
        if role.len() > MAX_DESCRIPTION {
            let mut cut = MAX_DESCRIPTION;
            while !role.is_char_boundary(cut) {
                cut -= 1;
            }
            role.truncate(cut);
            role.push_str("...");
        }
        Some(role)
    }

    fn skill(&self, agent: &AgentId) -> Value {
        let name = self.org.display_name(agent);
        let description = self.role(agent).unwrap_or_else(|| {
            format!("{name} (agent {agent} of a spacebot organization): answers after any work it delegates.")
        });
        json!({
            "id": agent.as_str(),
            "name": name,
            "description": description,
            "tags": ["spacebot"],
            "inputModes": ["text/plain"],
            "outputModes": ["text/plain"],
        })
    }

    fn card(&self, base: &str, agent: Option<&AgentId>) -> Value {
        let (name, description, url, skills) = match agent {
            Some(agent) => (
                self.org.display_name(agent),
                self.role(agent)
                    .unwrap_or_else(|| format!("Agent {agent} of a spacebot organization.")),
                format!("{base}/a2a/{agent}"),
                vec![self.skill(agent)],
            ),
            None => (
                "spacebot organization".to_owned(),
                "A spacebot organization of agents: each skill is one agent; name it in the \
                 message's metadata as \"skill\" (the first skill otherwise)."
                    .to_owned(),
                format!("{base}/a2a"),
                self.exposed.iter().map(|a| self.skill(a)).collect(),
            ),
        };
        let mut card = json!({
            "name": name,
            "description": description,
            "supportedInterfaces": [{
                "url": url,
                "protocolBinding": "JSONRPC",
                "protocolVersion": PROTOCOL_VERSION,
            }],
            "version": env!("CARGO_PKG_VERSION"),
            "capabilities": {"streaming": true, "pushNotifications": false},
            "defaultInputModes": ["text/plain"],
            "defaultOutputModes": ["text/plain"],
            "skills": skills,
        });
        if self.token.is_some() {
            card["securitySchemes"] = json!({
                "bearer": {"httpAuthSecurityScheme": {"scheme": "Bearer", "description": "the organization's API token"}}
            });
            card["securityRequirements"] = json!([{"schemes": {"bearer": {"list": []}}}]);
        }
        card
    }

    fn authorized(&self, headers: &HeaderMap) -> bool {
        let Some(expected) = &self.token else {
            return true;
        };
        headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|t| constant_time_eq(t.trim().as_bytes(), expected.as_bytes()))
    }

    async fn rpc(&self, agent: Option<AgentId>, headers: HeaderMap, body: Bytes) -> Response {
        if !self.authorized(&headers) {
            return (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
                axum::Json(
                    json!({"error": "unauthorized", "message": "a valid bearer token is required"}),
                ),
            )
                .into_response();
        }
        let request: Value = match serde_json::from_slice(&body) {
            Ok(v) => v,
            Err(e) => {
                return rpc_error(
                    &Value::Null,
                    RpcError::new(codes::PARSE_ERROR, format!("not JSON: {e}")),
                );
            }
        };
        let id = request.get("id").cloned().unwrap_or(Value::Null);
        let Some(method) = request.get("method").and_then(Value::as_str) else {
            return rpc_error(
                &id,
                RpcError::new(
                    codes::INVALID_REQUEST,
                    "a JSON-RPC 2.0 request with a method is expected",
                ),
            );
        };
        if let Some(version) = headers.get(VERSION_HEADER).and_then(|v| v.to_str().ok())
            && !version.trim().is_empty()
            && !(version.trim() == "1" || version.trim().starts_with("1."))
        {
            return rpc_error(
                &id,
                RpcError::new(
                    codes::VERSION_NOT_SUPPORTED,
                    format!(
                        "A2A version {version} is not supported; this server speaks {PROTOCOL_VERSION}"
                    ),
                ),
            );
        }
        let params = request.get("params").cloned().unwrap_or(Value::Null);
        match method {
            methods::SEND_MESSAGE => {
                let result = async {
                    let request: SendMessageRequest = parse(params)?;
                    let blocking = !request
                        .configuration
                        .as_ref()
                        .is_some_and(|c| c.return_immediately);
                    let history = request
                        .configuration
                        .as_ref()
                        .and_then(|c| c.history_length);
                    let task = self.submit(agent, request).await?;
                    let task = if blocking {
                        self.until_settled(task).await?
                    } else {
                        task
                    };
                    Ok(json!({"task": task.to_task(history)}))
                }
                .await;
                rpc_reply(&id, result)
            }
            methods::SEND_STREAMING_MESSAGE => {
                let result = async {
                    let request: SendMessageRequest = parse(params)?;
                    // Subscribed before the task is stored: no change is missed.
                    let changes = self.a2a.changes();
                    let task = self.submit(agent, request).await?;
                    Ok((task, changes))
                }
                .await;
                match result {
                    Ok((task, changes)) => self.stream(id, task, changes, true),
                    Err(e) => rpc_error(&id, e),
                }
            }
            methods::GET_TASK => {
                let result = async {
                    let params: TaskIdParams = parse(params)?;
                    let task = self.find(&params.id).await?;
                    Ok(serde_json::to_value(task.to_task(params.history_length))
                        .unwrap_or(Value::Null))
                }
                .await;
                rpc_reply(&id, result)
            }
            methods::CANCEL_TASK => {
                let result = async {
                    let params: TaskIdParams = parse(params)?;
                    let task = self.cancel(&params.id).await?;
                    Ok(serde_json::to_value(task.to_task(None)).unwrap_or(Value::Null))
                }
                .await;
                rpc_reply(&id, result)
            }
            methods::SUBSCRIBE_TO_TASK => {
                let result = async {
                    let params: TaskIdParams = parse(params)?;
                    let changes = self.a2a.changes();
                    let task = self.find(&params.id).await?;
                    Ok((task, changes))
                }
                .await;
                match result {
                    Ok((task, changes)) => self.stream(id, task, changes, false),
                    Err(e) => rpc_error(&id, e),
                }
            }
            "CreateTaskPushNotificationConfig"
            | "GetTaskPushNotificationConfig"
            | "ListTaskPushNotificationConfigs"
            | "DeleteTaskPushNotificationConfig" => rpc_error(
                &id,
                RpcError::new(
                    codes::PUSH_NOTIFICATION_NOT_SUPPORTED,
                    "push notifications are not supported; use SubscribeToTask or GetTask",
                ),
            ),
            other => rpc_error(
                &id,
                RpcError::new(codes::METHOD_NOT_FOUND, format!("no method {other:?}")),
            ),
        }
    }

    /// The agent a request asks: the route's, else the skill named in the metadata, else the
    /// first exposed agent.
    fn pick(
        &self,
        route: Option<AgentId>,
        request: &SendMessageRequest,
    ) -> Result<AgentId, RpcError> {
        let named = match route {
            Some(agent) => Some(agent.as_str().to_owned()),
            None => request
                .message
                .metadata
                .as_ref()
                .and_then(|m| m.get(SKILL_METADATA_KEY))
                .or_else(|| {
                    request
                        .metadata
                        .as_ref()
                        .and_then(|m| m.get(SKILL_METADATA_KEY))
                })
                .and_then(Value::as_str)
                .map(str::to_owned),
        };
        match named {
            Some(name) => self
                .exposed
                .iter()
                .find(|a| a.as_str() == name)
                .cloned()
                .ok_or_else(|| {
                    RpcError::new(
                        codes::INVALID_PARAMS,
                        format!("no exposed agent {name:?}; the skills are in the agent card"),
                    )
                }),
            None => self.exposed.iter().next().cloned().ok_or_else(|| {
                RpcError::new(
                    codes::UNSUPPORTED_OPERATION,
                    "this organization exposes no agent over A2A",
                )
            }),
        }
    }

    /// Stores the task of a new message (or finds the task of a message sent before) and
    /// delivers it to its agent.
    async fn submit(
        &self,
        route: Option<AgentId>,
        request: SendMessageRequest,
    ) -> Result<TaskRecord, RpcError> {
        let agent = self.pick(route, &request)?;
        let message = request.message;
        if message.message_id.trim().is_empty() {
            return Err(RpcError::new(
                codes::INVALID_PARAMS,
                "the message has no messageId",
            ));
        }
        if !message.task_id.is_empty() {
            return Err(self.follow_up(&message.task_id).await);
        }
        let text = message.to_text();
        if text.trim().is_empty() {
            return Err(RpcError::new(
                codes::INVALID_PARAMS,
                "the message has no content",
            ));
        }
        let key = format!("{agent}/{}", message.message_id);
        if spacebot_core::records::check_key(&key).is_err() {
            return Err(RpcError::new(
                codes::INVALID_PARAMS,
                "the messageId is too long",
            ));
        }
        let attached = self.attached()?;
        let now = attached.clock.now();
        let id = uuid::Uuid::new_v4().to_string();
        let context_id = if message.context_id.is_empty() {
            uuid::Uuid::new_v4().to_string()
        } else {
            message.context_id.clone()
        };
        let record = TaskRecord {
            id: id.clone(),
            context_id,
            agent: agent.clone(),
            state: TaskState::Submitted,
            request: message,
            answer: None,
            waiting: None,
            updated_ms: now.as_millis(),
        };
        let (task, _new) = attached
            .store
            .create(record, &key, now)
            .await
            .map_err(store_error)?;
        if task.state == TaskState::Submitted {
            // New, or sent again before it was seen to start: delivered (again); the idempotency
            // key makes a second delivery a no-op.
            let inbound = InboundMessage::new(PLATFORM, task.id.clone(), text)
                .with_idempotency_key(format!("a2a:{}", task.id));
            if let Err(e) = self.org.deliver(task.agent.as_str(), inbound).await {
                self.a2a
                    .set_state(
                        &task.id,
                        TaskState::Rejected,
                        Some(format!(
                            "the message was not delivered to {}: {e}",
                            task.agent
                        )),
                    )
                    .await;
                return self.find(&task.id).await;
            }
        }
        Ok(task)
    }

    /// The refusal of a message continuing the task `id`: not found (-32001), else unsupported
    /// (-32004), saying why for the task's state.
    async fn follow_up(&self, id: &str) -> RpcError {
        let task = match self.find(id).await {
            Ok(task) => task,
            Err(e) => return e,
        };
        // `completed`, `input-required`: as the protocol's text names the states.
        let state = task
            .state
            .as_str()
            .trim_start_matches("TASK_STATE_")
            .to_lowercase()
            .replace('_', "-");
        let why = if task.state.is_terminal() {
            format!("task {id} is {state}: a task that ended takes no more messages")
        } else if task.state == TaskState::InputRequired {
            format!(
                "task {id} is {state}, and waits for an operator's approval in the organization, \
                 not for a message: this server takes no follow-up messages in a task"
            )
        } else {
            format!("task {id} is {state}: this server takes no follow-up messages in a task")
        };
        RpcError::new(
            codes::UNSUPPORTED_OPERATION,
            format!("{why}; send the message without taskId to start a new task"),
        )
    }

    async fn find(&self, id: &str) -> Result<TaskRecord, RpcError> {
        self.attached()?
            .store
            .get(id)
            .await
            .map_err(store_error)?
            .ok_or_else(|| RpcError::new(codes::TASK_NOT_FOUND, format!("no task {id:?}")))
    }

    async fn cancel(&self, id: &str) -> Result<TaskRecord, RpcError> {
        let task = self.find(id).await?;
        if task.state.is_terminal() {
            return Err(RpcError::new(
                codes::TASK_NOT_CANCELABLE,
                format!("the task is {}", task.state.as_str()),
            ));
        }
        self.a2a
            .set_state(
                id,
                TaskState::Canceled,
                Some("canceled by the client".into()),
            )
            .await;
        if self.a2a.runs(&task.agent, id) {
            self.org.cancel_turn(&task.agent);
        }
        let task = self.find(id).await?;
        if task.state != TaskState::Canceled {
            return Err(RpcError::new(
                codes::TASK_NOT_CANCELABLE,
                format!("the task is {}", task.state.as_str()),
            ));
        }
        Ok(task)
    }

    /// Waits until the task ends or waits for input.
    async fn until_settled(&self, task: TaskRecord) -> Result<TaskRecord, RpcError> {
        let mut changes = self.a2a.changes();
        let mut task = task;
        loop {
            task = self.find(&task.id).await?;
            if task.state.is_terminal() || task.state == TaskState::InputRequired {
                return Ok(task);
            }
            wait_change(&mut changes, &task.id).await;
        }
    }

    /// The task's events as server-sent events: the task as it is, then each status change
    /// (the answer as an artifact before the final status), until a terminal state.
    fn stream(
        &self,
        id: Value,
        task: TaskRecord,
        changes: broadcast::Receiver<String>,
        _new: bool,
    ) -> Response {
        let (tx, rx) = mpsc::channel::<SseEvent>(16);
        let this = self.clone();
        tokio::spawn(async move {
            let mut changes = changes;
            let send = |value: StreamResponse| {
                let body = json!({"jsonrpc": "2.0", "id": id.clone(), "result": value});
                SseEvent::default().data(body.to_string())
            };
            let mut last = task.clone();
            if tx
                .send(send(StreamResponse::Task(task.to_task(None))))
                .await
                .is_err()
            {
                return;
            }
            while !last.state.is_terminal() {
                wait_change(&mut changes, &last.id).await;
                let Ok(now) = this.find(&last.id).await else {
                    return;
                };
                if now.state == last.state && now.waiting == last.waiting {
                    continue;
                }
                // An answer means the turn ran: a client that read the task too late to see it
                // working is told so first, so every stream tells the states in their order.
                // The same for a task that waits for input: its turn ran.
                let ran = match now.state {
                    TaskState::Completed | TaskState::Failed => last.state != TaskState::Working,
                    TaskState::InputRequired => last.state == TaskState::Submitted,
                    _ => false,
                };
                if ran {
                    let mut working = now.status();
                    working.state = TaskState::Working;
                    working.message = None;
                    let update = TaskStatusUpdateEvent {
                        task_id: now.id.clone(),
                        context_id: now.context_id.clone(),
                        status: working,
                    };
                    if tx
                        .send(send(StreamResponse::StatusUpdate(update)))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                if now.state == TaskState::Completed
                    && let Some(text) = &now.answer
                {
                    let artifact = TaskArtifactUpdateEvent {
                        task_id: now.id.clone(),
                        context_id: now.context_id.clone(),
                        artifact: crate::types::Artifact {
                            artifact_id: format!("{}-answer", now.id),
                            name: "answer".into(),
                            parts: vec![crate::types::Part::text(text.clone())],
                        },
                        append: false,
                        last_chunk: true,
                    };
                    if tx
                        .send(send(StreamResponse::ArtifactUpdate(artifact)))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                let update = TaskStatusUpdateEvent {
                    task_id: now.id.clone(),
                    context_id: now.context_id.clone(),
                    status: now.status(),
                };
                if tx
                    .send(send(StreamResponse::StatusUpdate(update)))
                    .await
                    .is_err()
                {
                    return;
                }
                last = now;
            }
        });
        let events = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|e| (Ok::<_, Infallible>(e), rx))
        });
        Sse::new(events)
            .keep_alive(KeepAlive::default())
            .into_response()
    }
}

/// Waits until `task` may have changed: a change said in this process, or [`POLL`].
async fn wait_change(changes: &mut broadcast::Receiver<String>, task: &str) {
    let deadline = tokio::time::sleep(POLL);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            changed = changes.recv() => match changed {
                Ok(id) if id == task => return,
                Ok(_) => {}
                Err(broadcast::error::RecvError::Lagged(_)) => return,
                Err(broadcast::error::RecvError::Closed) => {
                    (&mut deadline).await;
                    return;
                }
            },
            () = &mut deadline => return,
        }
    }
}

fn parse<T: DeserializeOwned>(params: Value) -> Result<T, RpcError> {
    serde_json::from_value(params)
        .map_err(|e| RpcError::new(codes::INVALID_PARAMS, format!("invalid params: {e}")))
}

fn rpc_reply<T: Serialize>(id: &Value, result: Result<T, RpcError>) -> Response {
    rpc_body(id, result)
}

fn rpc_error(id: &Value, e: RpcError) -> Response {
    rpc_body::<Value>(id, Err(e))
}

fn rpc_body<T: Serialize>(id: &Value, result: Result<T, RpcError>) -> Response {
    let body = match result {
        Ok(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
        Err(e) => {
            json!({"jsonrpc": "2.0", "id": id, "error": {"code": e.code, "message": e.message}})
        }
    };
    axum::Json(body).into_response()
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The base URL the client reached this server at (from `Host`).
fn base_url(headers: &HeaderMap) -> String {
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("127.0.0.1");
    let scheme = headers
        .get("x-forwarded-proto")
        .and_then(|h| h.to_str().ok())
        .filter(|p| *p == "https")
        .unwrap_or("http");
    format!("{scheme}://{host}")
}

async fn org_card(State(server): State<A2aServer>, headers: HeaderMap) -> Response {
    axum::Json(server.card(&base_url(&headers), None)).into_response()
}

async fn agent_card(
    State(server): State<A2aServer>,
    Path(agent): Path<String>,
    headers: HeaderMap,
) -> Response {
    match server.exposed.iter().find(|a| a.as_str() == agent) {
        Some(agent) => axum::Json(server.card(&base_url(&headers), Some(agent))).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            axum::Json(
                json!({"error": "not_found", "message": format!("no exposed agent {agent:?}")}),
            ),
        )
            .into_response(),
    }
}

async fn org_rpc(State(server): State<A2aServer>, headers: HeaderMap, body: Bytes) -> Response {
    server.rpc(None, headers, body).await
}

async fn agent_rpc(
    State(server): State<A2aServer>,
    Path(agent): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match server.exposed.iter().find(|a| a.as_str() == agent).cloned() {
        Some(agent) => server.rpc(Some(agent), headers, body).await,
        None => (
            StatusCode::NOT_FOUND,
            axum::Json(
                json!({"error": "not_found", "message": format!("no exposed agent {agent:?}")}),
            ),
        )
            .into_response(),
    }
}
