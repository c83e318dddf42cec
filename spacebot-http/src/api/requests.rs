//! Requests as trees (built from the event stream), and what waits for an operator's approval.

use axum::Json;
use axum::extract::State;
use serde::{Deserialize, Serialize};
use spacebot_core::TaskStatus;
use spacebot_core::task::TaskFilter;
use utoipa::{IntoParams, ToSchema};

use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiPath as Path, ApiQuery};
use crate::requests::{RequestSummaryView, RequestTreeView};
use crate::views::TaskView;

use super::{ApiResult, McpCallView, St};

/// A list of recent requests.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct RequestsQuery {
    /// At most this many (default 50), newest first.
    #[serde(default)]
    pub(crate) limit: Option<usize>,
}

/// The recent requests (the server keeps the last 200 seen since it started), newest first.
#[utoipa::path(get, path = "/api/requests", tag = "requests",
    params(RequestsQuery),
    responses((status = 200, body = [RequestSummaryView]), (status = 400, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn list_requests(
    State(st): St,
    ApiQuery(query): ApiQuery<RequestsQuery>,
) -> Json<Vec<RequestSummaryView>> {
    Json(st.hub.requests.list(query.limit.unwrap_or(50)))
}

/// A request's tree: its turns, model calls, tool calls, steers, refusals and the tasks it fanned
/// out into across agents (their turns under them), with timings, status, token usage, and its
/// spend from the request ledger when a limit is in use.
#[utoipa::path(get, path = "/api/requests/{request}/tree", tag = "requests",
    params(("request" = String, Path, description = "The request: the envelope id a message was accepted as")),
    responses((status = 200, body = RequestTreeView), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn request_tree(
    State(st): St,
    Path(request): Path<String>,
) -> ApiResult<Json<RequestTreeView>> {
    let (summary, nodes) = st.hub.requests.tree(&request).ok_or_else(|| {
        ApiError::not_found(format!(
            "request {request} is not among the recent requests this server saw"
        ))
        .with_field("request")
    })?;
    let id = spacebot_core::EnvelopeId::new(request.as_str());
    let spend = st
        .org
        .request_spend(&id)
        .await?
        .map(|entry| super::RequestSpendView::new(&id, &entry));
    Ok(Json(RequestTreeView {
        summary,
        nodes,
        spend,
    }))
}

/// What waits for an operator: tasks waiting for approval on every board, and MCP tool calls
/// waiting for approval (when the API serves the MCP tools behaviour).
#[derive(Debug, Serialize, ToSchema)]
pub struct ApprovalsView {
    /// Tasks in `pending_approval`, every agent's.
    pub tasks: Vec<TaskView>,
    /// MCP calls in `pending`.
    pub mcp_calls: Vec<McpCallView>,
}

/// Everything waiting for an operator's approval. Approve or reject a task with
/// `POST /api/agents/{agent}/tasks/{number}/approve` (or `/reject`), a call with
/// `POST /api/mcp/calls/{id}/approve` (or `/reject`).
#[utoipa::path(get, path = "/api/approvals", tag = "tasks",
    responses((status = 200, body = ApprovalsView)),
    security(("bearer" = [])))]
pub(crate) async fn approvals(State(st): St) -> ApiResult<Json<ApprovalsView>> {
    let filter = TaskFilter {
        statuses: vec![TaskStatus::PendingApproval],
        ..TaskFilter::default()
    };
    let mut tasks = Vec::new();
    for agent in st.org.agent_ids() {
        for task in st.org.stores().tasks.list(&agent, &filter).await? {
            tasks.push(st.task_view(task));
        }
    }
    let mcp = st
        .mcp
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let mcp_calls = match mcp {
        Some(mcp) => mcp
            .approval_calls()
            .await
            .map_err(super::mcp::mcp_error)?
            .into_iter()
            .map(McpCallView::from)
            .filter(|c| c.status == "pending")
            .collect(),
        None => Vec::new(),
    };
    Ok(Json(ApprovalsView { tasks, mcp_calls }))
}
