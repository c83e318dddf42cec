//! MCP: the servers the agents use, their state and grants; the calls waiting for approval.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::Serialize;
use spacebot_mcp::{Mcp, McpError, PendingCall, ServerState};
use utoipa::ToSchema;

use super::{ApiResult, St};
use crate::error::{ApiError, ErrorBody};
use crate::extract::ApiPath as Path;
use crate::views::ReasonBody;

/// An MCP server and what it does now.
#[derive(Debug, Serialize, ToSchema)]
pub struct McpServerView {
    /// Its id (`[[mcp_servers]] id`).
    pub id: String,
    /// `not_started`, `starting`, `ready`, `restarting` or `stopped`.
    pub state: String,
    /// The state in words (`restarting (attempt 2): connection refused`).
    pub detail: String,
    /// How many times a session was set up (its first start and every restart).
    pub starts: u64,
    /// The names the model sees for its tools (`{server}__{tool}`), as last listed.
    pub tools: Vec<String>,
}

/// An agent's MCP grants.
#[derive(Debug, Serialize, ToSchema)]
pub struct McpGrantsView {
    /// The agent.
    pub agent: String,
    /// Its grants (`files:*`, `files:read_file`).
    pub grants: Vec<String>,
    /// The grants whose calls wait for a human's approval.
    pub approval: Vec<String>,
}

/// The MCP servers and every agent's grants.
#[derive(Debug, Serialize, ToSchema)]
pub struct McpView {
    /// The servers, by id.
    pub servers: Vec<McpServerView>,
    /// The agents with grants, by id.
    pub grants: Vec<McpGrantsView>,
}

/// A call of a tool whose grant requires approval.
#[derive(Debug, Serialize, ToSchema)]
pub struct McpCallView {
    /// Its id (the call's idempotency key).
    pub id: String,
    /// The calling agent.
    pub agent: String,
    /// The server.
    pub server: String,
    /// The tool, as the server names it.
    pub tool: String,
    /// The arguments the model gave.
    #[schema(value_type = Object)]
    pub arguments: serde_json::Value,
    /// `pending`, `approved`, `rejected`, `running` or `done`.
    pub status: String,
    /// Who approved or rejected it.
    pub decided_by: Option<String>,
    /// Why it was rejected.
    pub reason: Option<String>,
    /// The text the model was answered once it ran.
    pub result: Option<String>,
    /// Whether the call succeeded, once it ran.
    pub ok: Option<bool>,
}

impl From<PendingCall> for McpCallView {
    fn from(c: PendingCall) -> Self {
        let status = serde_json::to_value(c.status)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        let (result, ok) = match c.result {
            Some(Ok(text)) => (Some(text), Some(true)),
            Some(Err(text)) => (Some(text), Some(false)),
            None => (None, None),
        };
        Self {
            id: c.id,
            agent: c.agent.to_string(),
            server: c.server,
            tool: c.tool,
            arguments: serde_json::Value::Object(c.arguments),
            status,
            decided_by: c.decided_by,
            reason: c.reason,
            result,
            ok,
        }
    }
}

fn mcp(st: &super::AppState) -> ApiResult<Mcp> {
    st.mcp
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
        .ok_or_else(|| {
            ApiError::not_found("MCP tools are not served by this API (Api::with_mcp_tools)")
        })
}

pub(super) fn mcp_error(e: McpError) -> ApiError {
    match e {
        McpError::NoSuchCall { .. } => ApiError::not_found(e.to_string()).with_field("id"),
        McpError::NotPending { .. } => {
            ApiError::new(StatusCode::CONFLICT, "conflict", e.to_string())
        }
        other => ApiError::internal(other.to_string()),
    }
}

fn state_name(state: &ServerState) -> &'static str {
    match state {
        ServerState::NotStarted => "not_started",
        ServerState::Starting => "starting",
        ServerState::Ready { .. } => "ready",
        ServerState::Restarting { .. } => "restarting",
        _ => "stopped",
    }
}

/// The MCP servers, their state and tools, and every agent's grants.
#[utoipa::path(get, path = "/api/mcp/servers", tag = "mcp",
    responses((status = 200, body = McpView), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn mcp_servers(State(st): St) -> ApiResult<Json<McpView>> {
    let mcp = mcp(&st)?;
    let servers = mcp
        .server_ids()
        .into_iter()
        .map(|id| {
            let state = mcp.server_state(&id).unwrap_or(ServerState::Stopped);
            McpServerView {
                state: state_name(&state).to_owned(),
                detail: state.to_string(),
                starts: mcp.starts(&id),
                tools: mcp.tool_names(&id),
                id,
            }
        })
        .collect();
    let approvals = mcp.approval_grants();
    let grants = mcp
        .grants()
        .into_iter()
        .filter(|(_, g)| !g.is_empty())
        .map(|(agent, grants)| McpGrantsView {
            approval: approvals
                .get(&agent)
                .map(|a| a.iter().map(ToString::to_string).collect())
                .unwrap_or_default(),
            agent: agent.to_string(),
            grants: grants.iter().map(ToString::to_string).collect(),
        })
        .collect();
    Ok(Json(McpView { servers, grants }))
}

/// Every call that needed approval (pending, decided, run), stored: they survive a restart.
#[utoipa::path(get, path = "/api/mcp/calls", tag = "mcp",
    responses((status = 200, body = [McpCallView]), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn mcp_calls(State(st): St) -> ApiResult<Json<Vec<McpCallView>>> {
    let calls = mcp(&st)?.approval_calls().await.map_err(mcp_error)?;
    Ok(Json(calls.into_iter().map(McpCallView::from).collect()))
}

/// Approves a pending call: it runs once and its result goes to the model.
#[utoipa::path(post, path = "/api/mcp/calls/{id}/approve", tag = "mcp",
    params(("id" = String, Path, description = "The call's id")),
    responses((status = 200, body = McpCallView), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn approve_mcp_call(
    State(st): St,
    Path(id): Path<String>,
) -> ApiResult<Json<McpCallView>> {
    let call = mcp(&st)?
        .approve(&id, "operator")
        .await
        .map_err(mcp_error)?;
    Ok(Json(call.into()))
}

/// Rejects a pending call: it never runs; the model is told why.
#[utoipa::path(post, path = "/api/mcp/calls/{id}/reject", tag = "mcp",
    params(("id" = String, Path, description = "The call's id")),
    request_body(content = ReasonBody, description = "Optional; an empty body is allowed"),
    responses((status = 200, body = McpCallView), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn reject_mcp_call(
    State(st): St,
    Path(id): Path<String>,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> ApiResult<Json<McpCallView>> {
    let reason = super::optional_reason(&body.map_err(crate::extract::body_rejection)?)?;
    let call = mcp(&st)?
        .reject(&id, "operator", &reason)
        .await
        .map_err(mcp_error)?;
    Ok(Json(call.into()))
}
