//! The OpenAPI description, generated from the handlers' annotations.

use axum::Json;
use utoipa::OpenApi;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};

use crate::api;
use crate::error::{ErrorBody, ErrorDetail};
use crate::notes::{self, *};
use crate::views::*;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "spacebot HTTP API",
        description = "Agents, links, topology, channels, tasks, conversations, shared notes, web chat and server-sent events of a spacebot organization. Every error is {\"error\": {\"code\", \"message\", \"field\"}}.",
        license(name = "MIT OR Apache-2.0"),
    ),
    paths(
        api::health, api::list_agents, api::get_agent, api::start_agent, api::stop_agent,
        api::agent_links, api::post_message, api::delegate, api::list_tasks, api::get_task,
        api::approve_task, api::reject_task, api::cancel_task, api::list_channels,
        api::channel_history, api::list_links, api::create_link, api::get_link, api::update_link,
        api::delete_link, api::link_timeline, api::topology, api::list_conversations,
        api::get_conversation, api::sever_conversation, api::events,
        notes::list_notes, notes::get_note, notes::note_history, notes::write_note,
        notes::grant_note_access, notes::revoke_note_access,
        api::request_spend, api::set_request_limits, api::set_agent_limits, api::clear_agent_limits,
        api::set_org_limits, api::clear_org_limits, api::resume_request, api::agent_spend,
        api::org_spend, api::mcp_servers, api::mcp_calls, api::approve_mcp_call,
        api::reject_mcp_call, api::list_requests, api::request_tree, api::approvals,
    ),
    components(schemas(
        ErrorBody, ErrorDetail, AgentView, AgentStatus, LinkView, Direction, Relationship,
        CreateLink, UpdateLink, TopologyView, TopologyAgentView, TopologyLinkView, TaskView,
        ReasonBody, RecordView, TimelineView, ConversationView, MemberView, ChatMessageBody,
        Accepted, DelegateBody, Health, NoteView, NoteVersionView, NoteAccess, WriteNoteBody,
        NoteAccessBody, NoteAccessView, NoteConflictBody, LimitsBody, SpendView, ReachedView,
        RequestSpendView, ResumeBody, PeriodSpendView, McpView, McpServerView, McpGrantsView,
        McpCallView, RequestSummaryView, RequestTreeView, RequestNodeView, UsageView,
        ApprovalsView,
    )),
    modifiers(&Bearer),
    tags(
        (name = "agents", description = "Agents and their status"),
        (name = "links", description = "Links, timelines and the topology"),
        (name = "tasks", description = "Task boards"),
        (name = "requests", description = "Each recent user request as a tree, with its spend"),
        (name = "limits", description = "Spend and limits of requests, agents and the organization"),
        (name = "channels", description = "Channel histories"),
        (name = "conversations", description = "Conversations"),
        (name = "chat", description = "The web chat gateway"),
        (name = "events", description = "Server-sent events"),
        (name = "notes", description = "Shared notes: versioned texts and per-agent grants"),
        (name = "mcp", description = "MCP servers, grants and calls waiting for approval"),
        (name = "meta", description = "Health"),
    )
)]
struct ApiDoc;

struct Bearer;

impl utoipa::Modify for Bearer {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        if let Some(components) = openapi.components.as_mut() {
            components.add_security_scheme(
                "bearer",
                SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
            );
        }
    }
}

/// The OpenAPI description of the API. The repository keeps it as `spacebot-http/openapi.json`,
/// checked by a test against this function.
pub fn openapi() -> utoipa::openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").to_string();
    doc
}

pub(crate) async fn serve() -> Json<utoipa::openapi::OpenApi> {
    Json(openapi())
}
