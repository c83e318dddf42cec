//! Links: listing, creating, changing and deleting them, a link's timeline, the topology.

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use spacebot_core::{ChannelId, LinkChange};

use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiJson, ApiPath as Path, ApiQuery, agent_id};
use crate::views::*;

use super::{ApiResult, St, find_link};

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
