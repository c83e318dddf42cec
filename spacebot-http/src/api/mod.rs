//! The handlers of every endpoint, with their OpenAPI descriptions, one module a resource; the
//! helpers they share live here.

mod agents;
mod conversations;
mod events;
mod limits;
mod links;
mod mcp;
mod requests;
mod tasks;

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use spacebot_core::{AgentId, AgentLink, Organization};
use tokio::sync::watch;

use crate::error::{ApiError, ErrorBody};
use crate::extract::agent_id;
use crate::hub::Hub;
use crate::views::*;

pub(crate) use agents::*;
pub(crate) use conversations::*;
pub(crate) use events::*;
pub(crate) use limits::*;
pub use limits::{
    LimitsBody, PeriodSpendView, ReachedView, RequestSpendView, ResumeBody, SpendView,
};
pub(crate) use links::*;
pub(crate) use mcp::*;
pub use mcp::{McpCallView, McpGrantsView, McpServerView, McpView};
pub use requests::ApprovalsView;
pub(crate) use requests::*;
pub(crate) use tasks::*;

/// What every handler shares.
#[derive(Debug)]
pub(crate) struct AppState {
    pub(crate) org: Organization,
    pub(crate) hub: Arc<Hub>,
    pub(crate) token: Option<String>,
    /// The trace URL template (`{trace_id}` in it), if any.
    pub(crate) trace_url: Option<String>,
    /// True once [`crate::Api::shutdown`] was called: every event stream ends.
    pub(crate) closing: watch::Sender<bool>,
    /// The shared notes, when the API was given them ([`crate::Api::with_notes`]).
    pub(crate) notes: std::sync::RwLock<Option<spacebot_notes::Notes>>,
    /// The MCP tools behaviour, when the API was given it ([`crate::Api::with_mcp_tools`]).
    pub(crate) mcp: std::sync::RwLock<Option<spacebot_mcp::Mcp>>,
}

pub(crate) type St = State<Arc<AppState>>;

impl AppState {
    /// A task as the API shows it, linked to its trace when a trace URL template is set.
    pub(crate) fn task_view(&self, task: spacebot_core::Task) -> crate::views::TaskView {
        crate::views::TaskView::from(task).with_trace_url(self.trace_url.as_deref())
    }
}

type ApiResult<T> = Result<T, ApiError>;

fn known_agent(org: &Organization, raw: &str) -> ApiResult<AgentId> {
    let id = agent_id(raw)?;
    if org.agent_ids().contains(&id) {
        Ok(id)
    } else {
        Err(ApiError::not_found(format!("unknown agent {id}")).with_field("agent"))
    }
}

fn agent_view(org: &Organization, id: &AgentId) -> AgentView {
    let status = if org.is_idle(id) {
        AgentStatus::Idle
    } else if org.is_running(id) {
        AgentStatus::Running
    } else {
        AgentStatus::Stopped
    };
    AgentView {
        id: id.to_string(),
        name: org.display_name(id),
        status,
        queued: org.queue_len(id).unwrap_or(0),
        remote: remote_url(org, id),
    }
}

/// The base URL of a remote A2A agent (its `a2a` field), never its token.
fn remote_url(org: &Organization, id: &AgentId) -> Option<String> {
    org.config()
        .agents
        .iter()
        .find(|a| &a.id == id)?
        .fields
        .get(spacebot_a2a::URL_FIELD)?
        .as_str()
        .map(|url| url.trim_end_matches('/').to_owned())
}

fn find_link(org: &Organization, id: &str) -> ApiResult<AgentLink> {
    org.links()
        .into_iter()
        .find(|l| l.id.as_str() == id)
        .ok_or_else(|| ApiError::not_found(format!("link {id} not found")).with_field("link"))
}

fn parse_statuses<T: std::str::FromStr>(raw: Option<&str>, field: &str) -> ApiResult<Vec<T>>
where
    T::Err: std::fmt::Display,
{
    let Some(raw) = raw else {
        return Ok(Vec::new());
    };
    raw.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<T>()
                .map_err(|e| ApiError::invalid(field, e.to_string()))
        })
        .collect()
}

fn optional_reason(body: &[u8]) -> ApiResult<String> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok("by an operator".into());
    }
    let body: ReasonBody = crate::extract::parse_json(body)?;
    Ok(body
        .reason
        .filter(|r| !r.trim().is_empty())
        .unwrap_or_else(|| "by an operator".into()))
}

/// Health of the API.
#[utoipa::path(get, path = "/api/health", tag = "meta",
    responses((status = 200, body = Health), (status = 401, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn health(State(st): St) -> Json<Health> {
    let notes = st
        .notes
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .is_some();
    let mcp_tools = st
        .mcp
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .is_some();
    Json(Health {
        status: "ok".into(),
        agents: st.org.agent_ids().len(),
        notes,
        mcp_tools,
    })
}
