//! An agent's task board: listing, reading, approving, rejecting and cancelling tasks.

use axum::Json;
use axum::extract::State;
use spacebot_core::TaskStatus;
use spacebot_core::task::TaskFilter;

use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiPath as Path, ApiQuery, body_rejection, task_ref};
use crate::views::*;

use super::{ApiResult, AppState, St, known_agent, optional_reason, parse_statuses};

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
    Ok(Json(tasks.into_iter().map(|t| st.task_view(t)).collect()))
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
    Ok(Json(st.task_view(found)))
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
    Ok(Json(st.task_view(st.org.approve_task(&task).await?)))
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
    Ok(Json(
        st.task_view(st.org.reject_task(&task, &reason).await?),
    ))
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
    Ok(Json(
        st.task_view(st.org.cancel_task(&task, &reason).await?),
    ))
}
