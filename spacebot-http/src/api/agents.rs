//! Agents: status, start and stop, links, chat messages, delegation and channels.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use spacebot_core::delegation::DelegationOrigin;
use spacebot_core::{ChannelId, InboundMessage};

use crate::WebChat;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiJson, ApiPath as Path, ApiQuery};
use crate::views::*;

use super::{ApiResult, St, agent_view, known_agent};

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
    if let Some(limits) = &body.limits {
        message = message.with_limits(limits.to_limits("limits")?);
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
    Ok((StatusCode::CREATED, Json(st.task_view(task))))
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
