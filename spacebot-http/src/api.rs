//! The handlers of every endpoint, with their OpenAPI descriptions.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::Stream;
use spacebot_core::conversation::{ConversationFilter, ConversationStatus};
use spacebot_core::delegation::DelegationOrigin;
use spacebot_core::task::TaskFilter;
use spacebot_core::{
    AgentId, AgentLink, ChannelId, ConversationId, InboundMessage, LinkChange, Organization,
    TaskStatus,
};
use tokio::sync::watch;

use crate::WebChat;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiJson, ApiPath as Path, ApiQuery, agent_id, body_rejection, task_ref};
use crate::hub::{EntryKind, Hub};
use crate::views::*;

/// What every handler shares.
#[derive(Debug)]
pub(crate) struct AppState {
    pub(crate) org: Organization,
    pub(crate) hub: Arc<Hub>,
    pub(crate) token: Option<String>,
    /// True once [`crate::Api::shutdown`] was called: every event stream ends.
    pub(crate) closing: watch::Sender<bool>,
}

pub(crate) type St = State<Arc<AppState>>;

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
    }
}

fn find_link(org: &Organization, id: &str) -> ApiResult<AgentLink> {
    org.links()
        .into_iter()
        .find(|l| l.id.as_str() == id)
        .ok_or_else(|| ApiError::not_found(format!("link {id} not found")).with_field("link"))
}

/// Health of the API.
#[utoipa::path(get, path = "/api/health", tag = "meta",
    responses((status = 200, body = Health), (status = 401, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn health(State(st): St) -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        agents: st.org.agent_ids().len(),
    })
}

/// Every agent with its status.
#[utoipa::path(get, path = "/api/agents", tag = "agents",
    responses((status = 200, body = [AgentView]), (status = 401, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn list_agents(State(st): St) -> Json<Vec<AgentView>> {
    let org = &st.org;
    Json(org.agent_ids().iter().map(|a| agent_view(org, a)).collect())
}

/// One agent.
#[utoipa::path(get, path = "/api/agents/{agent}", tag = "agents",
    params(("agent" = String, Path, description = "Agent id")),
    responses((status = 200, body = AgentView), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn get_agent(
    State(st): St,
    Path(agent): Path<String>,
) -> ApiResult<Json<AgentView>> {
    let id = known_agent(&st.org, &agent)?;
    Ok(Json(agent_view(&st.org, &id)))
}

/// Starts an agent (nothing happens if it runs already); its persisted messages are handed over.
#[utoipa::path(post, path = "/api/agents/{agent}/start", tag = "agents",
    params(("agent" = String, Path, description = "Agent id")),
    responses((status = 200, body = AgentView), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn start_agent(
    State(st): St,
    Path(agent): Path<String>,
) -> ApiResult<Json<AgentView>> {
    let id = known_agent(&st.org, &agent)?;
    st.org.start_agent(&id).await?;
    Ok(Json(agent_view(&st.org, &id)))
}

/// Stops an agent: what is queued is persisted and handed over at the next start; a running
/// turn finishes first.
#[utoipa::path(post, path = "/api/agents/{agent}/stop", tag = "agents",
    params(("agent" = String, Path, description = "Agent id")),
    responses((status = 200, body = AgentView), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn stop_agent(
    State(st): St,
    Path(agent): Path<String>,
) -> ApiResult<Json<AgentView>> {
    let id = known_agent(&st.org, &agent)?;
    st.org.stop_agent(&id).await?;
    Ok(Json(agent_view(&st.org, &id)))
}

/// The links an agent is part of (either end).
#[utoipa::path(get, path = "/api/agents/{agent}/links", tag = "links",
    params(("agent" = String, Path, description = "Agent id")),
    responses((status = 200, body = [LinkView]), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn agent_links(
    State(st): St,
    Path(agent): Path<String>,
) -> ApiResult<Json<Vec<LinkView>>> {
    let id = known_agent(&st.org, &agent)?;
    Ok(Json(
        st.org
            .links()
            .into_iter()
            .filter(|l| l.from == id || l.to == id)
            .map(LinkView::from)
            .collect(),
    ))
}

/// Delivers a chat message to an agent (platform `web`). Answers 202 once the message is queued
/// (or persisted for a stopped agent); the reply arrives on `GET /api/events` as a `reply` event.
#[utoipa::path(post, path = "/api/agents/{agent}/messages", tag = "chat",
    params(("agent" = String, Path, description = "Agent id or display name")),
    request_body = ChatMessageBody,
    responses((status = 202, body = Accepted), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 415, body = ErrorBody),
        (status = 503, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn post_message(
    State(st): St,
    Path(agent): Path<String>,
    ApiJson(body): ApiJson<ChatMessageBody>,
) -> ApiResult<(StatusCode, Json<Accepted>)> {
    let id = st.org.resolve(&agent)?;
    if body.content.trim().is_empty() {
        return Err(ApiError::invalid("content", "the message is empty"));
    }
    let chat = body.chat_id.unwrap_or_else(|| "dashboard".to_string());
    if chat.is_empty() || chat.len() > 128 || chat.chars().any(char::is_control) {
        return Err(ApiError::invalid(
            "chat_id",
            "a chat id is 1 to 128 characters without control characters",
        ));
    }
    let mut message = InboundMessage::new(WebChat::PLATFORM, chat.clone(), body.content);
    if let Some(key) = body.idempotency_key {
        if key.is_empty() || key.len() > 200 || key.chars().any(char::is_control) {
            return Err(ApiError::invalid(
                "idempotency_key",
                "an idempotency key is 1 to 200 characters without control characters",
            ));
        }
        message = message.with_idempotency_key(key);
    }
    let channel = format!("{}:{chat}", WebChat::PLATFORM);
    let envelope = st.org.deliver(id.as_str(), message).await?;
    Ok((
        StatusCode::ACCEPTED,
        Json(Accepted {
            envelope_id: envelope.to_string(),
            agent: id.to_string(),
            channel,
        }),
    ))
}

/// Delegates a task from `agent` to `target`, checked by the link policy like an agent's own
/// delegation (a disabled link refuses it).
#[utoipa::path(post, path = "/api/agents/{agent}/delegate", tag = "tasks",
    params(("agent" = String, Path, description = "The delegating agent")),
    request_body = DelegateBody,
    responses((status = 201, body = TaskView), (status = 400, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn delegate(
    State(st): St,
    Path(agent): Path<String>,
    ApiJson(body): ApiJson<DelegateBody>,
) -> ApiResult<(StatusCode, Json<TaskView>)> {
    let from = known_agent(&st.org, &agent)?;
    let channel = ChannelId::new(
        body.channel
            .unwrap_or_else(|| format!("{}:dashboard", WebChat::PLATFORM)),
    );
    let task = st
        .org
        .delegate(
            &from,
            &body.target,
            &body.message,
            DelegationOrigin::new(channel),
        )
        .await?;
    Ok((StatusCode::CREATED, Json(task.into())))
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

/// An agent's task board.
#[utoipa::path(get, path = "/api/agents/{agent}/tasks", tag = "tasks",
    params(("agent" = String, Path, description = "Agent id"), TaskQuery),
    responses((status = 200, body = [TaskView]), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn list_tasks(
    State(st): St,
    Path(agent): Path<String>,
    ApiQuery(query): ApiQuery<TaskQuery>,
) -> ApiResult<Json<Vec<TaskView>>> {
    let id = known_agent(&st.org, &agent)?;
    let filter = TaskFilter {
        statuses: parse_statuses::<TaskStatus>(query.status.as_deref(), "status")?,
        limit: query.limit,
        ..TaskFilter::default()
    };
    let tasks = st.org.stores().tasks.list(&id, &filter).await?;
    Ok(Json(tasks.into_iter().map(TaskView::from).collect()))
}

/// One task.
#[utoipa::path(get, path = "/api/agents/{agent}/tasks/{number}", tag = "tasks",
    params(("agent" = String, Path, description = "Agent id"),
        ("number" = u64, Path, description = "Task number")),
    responses((status = 200, body = TaskView), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn get_task(
    State(st): St,
    Path((agent, number)): Path<(String, String)>,
) -> ApiResult<Json<TaskView>> {
    known_agent(&st.org, &agent)?;
    let task = task_ref(&agent, &number)?;
    let found = st.org.task(&task).await?.ok_or_else(|| {
        ApiError::not_found(format!("task {task} not found")).with_field("number")
    })?;
    Ok(Json(found.into()))
}

async fn existing_task(
    st: &AppState,
    agent: &str,
    number: &str,
) -> ApiResult<spacebot_core::TaskRef> {
    known_agent(&st.org, agent)?;
    let task = task_ref(agent, number)?;
    if st.org.task(&task).await?.is_none() {
        return Err(ApiError::not_found(format!("task {task} not found")).with_field("number"));
    }
    Ok(task)
}

/// Approves a task waiting for approval: it becomes ready.
#[utoipa::path(post, path = "/api/agents/{agent}/tasks/{number}/approve", tag = "tasks",
    params(("agent" = String, Path, description = "Agent id"),
        ("number" = u64, Path, description = "Task number")),
    responses((status = 200, body = TaskView), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn approve_task(
    State(st): St,
    Path((agent, number)): Path<(String, String)>,
) -> ApiResult<Json<TaskView>> {
    let task = existing_task(&st, &agent, &number).await?;
    Ok(Json(st.org.approve_task(&task).await?.into()))
}

/// Rejects a task waiting for approval; its delegator is told.
#[utoipa::path(post, path = "/api/agents/{agent}/tasks/{number}/reject", tag = "tasks",
    params(("agent" = String, Path, description = "Agent id"),
        ("number" = u64, Path, description = "Task number")),
    request_body(content = ReasonBody, description = "Optional; an empty body is allowed"),
    responses((status = 200, body = TaskView), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn reject_task(
    State(st): St,
    Path((agent, number)): Path<(String, String)>,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> ApiResult<Json<TaskView>> {
    let reason = optional_reason(&body.map_err(body_rejection)?)?;
    let task = existing_task(&st, &agent, &number).await?;
    Ok(Json(st.org.reject_task(&task, &reason).await?.into()))
}

/// Cancels a task that has not ended; its delegator is told.
#[utoipa::path(post, path = "/api/agents/{agent}/tasks/{number}/cancel", tag = "tasks",
    params(("agent" = String, Path, description = "Agent id"),
        ("number" = u64, Path, description = "Task number")),
    request_body(content = ReasonBody, description = "Optional; an empty body is allowed"),
    responses((status = 200, body = TaskView), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn cancel_task(
    State(st): St,
    Path((agent, number)): Path<(String, String)>,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> ApiResult<Json<TaskView>> {
    let reason = optional_reason(&body.map_err(body_rejection)?)?;
    let task = existing_task(&st, &agent, &number).await?;
    Ok(Json(st.org.cancel_task(&task, &reason).await?.into()))
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

/// An agent's channels.
#[utoipa::path(get, path = "/api/agents/{agent}/channels", tag = "channels",
    params(("agent" = String, Path, description = "Agent id")),
    responses((status = 200, body = [String]), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn list_channels(
    State(st): St,
    Path(agent): Path<String>,
) -> ApiResult<Json<Vec<String>>> {
    let id = known_agent(&st.org, &agent)?;
    let channels = st.org.stores().channels.channels(&id).await?;
    Ok(Json(channels.into_iter().map(|c| c.to_string()).collect()))
}

/// A channel's history, oldest first.
#[utoipa::path(get, path = "/api/agents/{agent}/channels/{channel}", tag = "channels",
    params(("agent" = String, Path, description = "Agent id"),
        ("channel" = String, Path, description = "Channel id, such as `link:a:b` or `web:dashboard`"),
        HistoryQuery),
    responses((status = 200, body = [RecordView]), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn channel_history(
    State(st): St,
    Path((agent, channel)): Path<(String, String)>,
    ApiQuery(query): ApiQuery<HistoryQuery>,
) -> ApiResult<Json<Vec<RecordView>>> {
    let id = known_agent(&st.org, &agent)?;
    if channel.is_empty() || channel.chars().any(char::is_control) {
        return Err(ApiError::invalid("channel", "invalid channel id"));
    }
    let records = st
        .org
        .stores()
        .channels
        .history(&id, &ChannelId::new(channel), query.limit)
        .await?;
    Ok(Json(records.into_iter().map(RecordView::from).collect()))
}

/// Every link, as the policy sees them now.
#[utoipa::path(get, path = "/api/links", tag = "links",
    responses((status = 200, body = [LinkView]), (status = 401, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn list_links(State(st): St) -> Json<Vec<LinkView>> {
    Json(st.org.links().into_iter().map(LinkView::from).collect())
}

/// Creates a link; it takes effect at once.
#[utoipa::path(post, path = "/api/links", tag = "links",
    request_body = CreateLink,
    responses((status = 201, body = LinkView), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn create_link(
    State(st): St,
    ApiJson(body): ApiJson<CreateLink>,
) -> ApiResult<(StatusCode, Json<LinkView>)> {
    let from = agent_id(&body.from).map_err(|e| e.with_field("from"))?;
    let to = agent_id(&body.to).map_err(|e| e.with_field("to"))?;
    for (id, field) in [(&from, "from"), (&to, "to")] {
        if !st.org.agent_ids().contains(id) {
            return Err(ApiError::not_found(format!("unknown agent {id}")).with_field(field));
        }
    }
    if from == to {
        return Err(ApiError::invalid(
            "to",
            format!("{from} cannot be linked to itself"),
        ));
    }
    if st.org.link(&from, &to).is_some() || st.org.link(&to, &from).is_some() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "conflict",
            format!("{from} and {to} are linked already; update that link instead"),
        )
        .with_field("to"));
    }
    let link = st
        .org
        .create_link(&from, &to, body.direction.into(), body.relationship.into())
        .await?;
    st.org.ensure_link_channels().await.map_err(|e| {
        ApiError::internal(format!(
            "link {} was created, but its channels could not be registered: {e}",
            link.id
        ))
    })?;
    Ok((StatusCode::CREATED, Json(link.into())))
}

/// One link.
#[utoipa::path(get, path = "/api/links/{link}", tag = "links",
    params(("link" = String, Path, description = "Link id")),
    responses((status = 200, body = LinkView), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn get_link(State(st): St, Path(link): Path<String>) -> ApiResult<Json<LinkView>> {
    Ok(Json(find_link(&st.org, &link)?.into()))
}

/// Changes a link (direction, relationship, enabled); it takes effect at once: a disabled link
/// allows nothing from the moment this answers.
#[utoipa::path(patch, path = "/api/links/{link}", tag = "links",
    params(("link" = String, Path, description = "Link id")),
    request_body = UpdateLink,
    responses((status = 200, body = LinkView), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn update_link(
    State(st): St,
    Path(link): Path<String>,
    ApiJson(body): ApiJson<UpdateLink>,
) -> ApiResult<Json<LinkView>> {
    let current = find_link(&st.org, &link)?;
    let mut change = LinkChange::default();
    change.direction = body.direction.map(Into::into);
    change.relationship = body.relationship.map(Into::into);
    change.enabled = body.enabled;
    let updated = st
        .org
        .update_link(&current.from, &current.to, change)
        .await?;
    Ok(Json(updated.into()))
}

/// Deletes a link; from then on the pair may not message each other.
#[utoipa::path(delete, path = "/api/links/{link}", tag = "links",
    params(("link" = String, Path, description = "Link id")),
    responses((status = 204, description = "Deleted"), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn delete_link(State(st): St, Path(link): Path<String>) -> ApiResult<StatusCode> {
    let current = find_link(&st.org, &link)?;
    st.org.delete_link(&current.from, &current.to).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A link's timeline: both link channels merged in time order.
#[utoipa::path(get, path = "/api/links/{link}/timeline", tag = "links",
    params(("link" = String, Path, description = "Link id"), HistoryQuery),
    responses((status = 200, body = TimelineView), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn link_timeline(
    State(st): St,
    Path(link): Path<String>,
    ApiQuery(query): ApiQuery<HistoryQuery>,
) -> ApiResult<Json<TimelineView>> {
    let link = find_link(&st.org, &link)?;
    let channels = &st.org.stores().channels;
    let mut records = channels
        .history(
            &link.from,
            &ChannelId::link(&link.from, &link.to),
            query.limit,
        )
        .await?;
    records.extend(
        channels
            .history(
                &link.to,
                &ChannelId::link(&link.to, &link.from),
                query.limit,
            )
            .await?,
    );
    records.sort_by(|a, b| {
        (a.record.at, a.agent.as_str(), a.seq).cmp(&(b.record.at, b.agent.as_str(), b.seq))
    });
    if let Some(limit) = query.limit {
        let skip = records.len().saturating_sub(limit);
        records.drain(..skip);
    }
    Ok(Json(TimelineView {
        link: link.into(),
        records: records.into_iter().map(RecordView::from).collect(),
    }))
}

/// The topology: JSON (seed 003), Graphviz DOT or Mermaid.
#[utoipa::path(get, path = "/api/topology", tag = "links",
    params(TopologyQuery),
    responses((status = 200, body = TopologyView,
            description = "JSON; with `format=dot` or `format=mermaid` the text as `text/plain`"),
        (status = 400, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn topology(
    State(st): St,
    ApiQuery(query): ApiQuery<TopologyQuery>,
) -> ApiResult<Response> {
    let topology = st.org.topology();
    let text = |body: String| {
        ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], body).into_response()
    };
    match query.format.as_deref().unwrap_or("json") {
        "json" => Ok(Json(TopologyView::from(topology)).into_response()),
        "dot" => Ok(text(topology.to_dot())),
        "mermaid" => Ok(text(topology.to_mermaid())),
        other => Err(ApiError::invalid(
            "format",
            format!("unknown format {other:?}; expected json, dot or mermaid"),
        )),
    }
}

/// Conversations, oldest first.
#[utoipa::path(get, path = "/api/conversations", tag = "conversations",
    params(ConversationQuery),
    responses((status = 200, body = [ConversationView]), (status = 400, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn list_conversations(
    State(st): St,
    ApiQuery(query): ApiQuery<ConversationQuery>,
) -> ApiResult<Json<Vec<ConversationView>>> {
    let mut filter = ConversationFilter::default();
    if let Some(member) = &query.member {
        filter.member = Some(agent_id(member).map_err(|e| e.with_field("member"))?);
    }
    filter.statuses = parse_statuses::<ConversationStatus>(query.status.as_deref(), "status")?;
    let list = st.org.conversations(&filter).await?;
    Ok(Json(list.into_iter().map(ConversationView::from).collect()))
}

/// One conversation.
#[utoipa::path(get, path = "/api/conversations/{conversation}", tag = "conversations",
    params(("conversation" = String, Path, description = "Conversation id")),
    responses((status = 200, body = ConversationView), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn get_conversation(
    State(st): St,
    Path(id): Path<String>,
) -> ApiResult<Json<ConversationView>> {
    let found = st
        .org
        .conversation(&ConversationId::new(id.clone()))
        .await?
        .ok_or_else(|| {
            ApiError::not_found(format!("conversation {id} not found")).with_field("conversation")
        })?;
    Ok(Json(found.into()))
}

/// Severs a conversation: every membership ends at once; members are told the reason.
#[utoipa::path(post, path = "/api/conversations/{conversation}/sever", tag = "conversations",
    params(("conversation" = String, Path, description = "Conversation id")),
    request_body(content = ReasonBody, description = "Optional; an empty body is allowed"),
    responses((status = 200, body = ConversationView), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn sever_conversation(
    State(st): St,
    Path(id): Path<String>,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> ApiResult<Json<ConversationView>> {
    let reason = optional_reason(&body.map_err(body_rejection)?)?;
    let cid = ConversationId::new(id.clone());
    if st.org.conversation(&cid).await?.is_none() {
        return Err(
            ApiError::not_found(format!("conversation {id} not found")).with_field("conversation")
        );
    }
    Ok(Json(st.org.sever_conversation(&cid, &reason).await?.into()))
}

/// The event stream (server-sent events).
///
/// Each event has an `id` (increasing from 1), an `event` type and JSON `data`:
/// - `org`: an organization event (`spacebot_core::Event`: `at`, `agent`, `link`, `channel`,
///   `task`, `parent`, and `kind` with its `type`);
/// - `reply`: an agent's reply published by the web chat (`spacebot_core::Reply`);
/// - `missed` (no id): `{"missed": n}`, events this client cannot get any more (it reconnected
///   after they left the replay window, or the router itself fell behind the organization).
///
/// A client that reconnects with `Last-Event-ID` gets every event after that id still in the
/// replay window, then live ones; an id above the newest (the server restarted and numbers from 1
/// again) replays the whole window. `EventSource` cannot set headers: pass the token as
/// `access_token`.
#[utoipa::path(get, path = "/api/events", tag = "events",
    params(EventsQuery,
        ("Last-Event-ID" = Option<u64>, Header, description = "Resume after this id")),
    responses((status = 200, content_type = "text/event-stream", body = String,
            description = "Server-sent events"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn events(
    State(st): St,
    headers: HeaderMap,
    ApiQuery(query): ApiQuery<EventsQuery>,
) -> ApiResult<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>> {
    let resume = match headers.get("last-event-id") {
        Some(value) => Some(
            value
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| {
                    ApiError::invalid("Last-Event-ID", "expected the id of an earlier event")
                })?,
        ),
        None => query.last_event_id,
    };
    let hub = st.hub.clone();
    let mut notify = hub.subscribe();
    notify.borrow_and_update();
    let now = hub.last_id();
    let last = match resume {
        Some(id) if id <= now => id,
        // An id this stream never gave: the client saw an earlier run of the server, whose ids
        // started again from 1. Everything still kept is new to it.
        Some(_) => 0,
        None => now,
    };
    let stream = EventStream {
        hub,
        notify,
        closing: st.closing.subscribe(),
        last,
        pending: VecDeque::new(),
    };
    Ok(Sse::new(futures::stream::unfold(stream, EventStream::next))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}

struct EventStream {
    hub: Arc<Hub>,
    notify: watch::Receiver<u64>,
    /// The API's shutdown flag: the stream ends once it is true.
    closing: watch::Receiver<bool>,
    last: u64,
    pending: VecDeque<SseEvent>,
}

impl EventStream {
    async fn next(mut self) -> Option<(Result<SseEvent, Infallible>, Self)> {
        loop {
            if *self.closing.borrow() {
                return None;
            }
            if let Some(event) = self.pending.pop_front() {
                return Some((Ok(event), self));
            }
            self.notify.borrow_and_update();
            let catchup = self.hub.since(self.last);
            if catchup.missed > 0 {
                let data = serde_json::json!({ "missed": catchup.missed }).to_string();
                self.pending.push_back(
                    SseEvent::default()
                        .event(EntryKind::Missed.as_str())
                        .data(data),
                );
            }
            for entry in catchup.entries {
                self.last = entry.id;
                self.pending.push_back(
                    SseEvent::default()
                        .id(entry.id.to_string())
                        .event(entry.kind.as_str())
                        .data(&*entry.data),
                );
            }
            if self.pending.is_empty() {
                let changed = std::pin::pin!(self.notify.changed());
                let closing = std::pin::pin!(self.closing.wait_for(|closing| *closing));
                match futures::future::select(changed, closing).await {
                    futures::future::Either::Left((Ok(()), _)) => {}
                    // The hub is gone, or the API shuts down (or was dropped).
                    _ => return None,
                }
            }
        }
    }
}
