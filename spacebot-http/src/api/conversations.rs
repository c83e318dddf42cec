//! Conversations: listing, reading and severing them.

use axum::Json;
use axum::extract::State;
use spacebot_core::ConversationId;
use spacebot_core::conversation::{ConversationFilter, ConversationStatus};

use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiPath as Path, ApiQuery, agent_id, body_rejection};
use crate::views::*;

use super::{ApiResult, St, optional_reason, parse_statuses};

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
