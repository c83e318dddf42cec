//! Shared notes (`/api/notes...`): the operator's side of [`spacebot_notes::Notes`], mounted when
//! the API was given the notes ([`crate::Api::with_notes`]).

use std::collections::BTreeMap;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use spacebot_notes::{Access, NoteSummary, NoteVersion, Notes, NotesError};
use utoipa::ToSchema;

use crate::api::St;
use crate::error::{ApiError, ErrorBody, ErrorDetail};
use crate::extract::{ApiJson, ApiPath as Path, agent_id};

/// What an agent may do with a note.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum NoteAccess {
    /// Read it.
    Read,
    /// Read and write it.
    ReadWrite,
}

impl From<Access> for NoteAccess {
    fn from(a: Access) -> Self {
        match a {
            Access::Read => Self::Read,
            Access::ReadWrite => Self::ReadWrite,
        }
    }
}

impl From<NoteAccess> for Access {
    fn from(a: NoteAccess) -> Self {
        match a {
            NoteAccess::Read => Self::Read,
            NoteAccess::ReadWrite => Self::ReadWrite,
        }
    }
}

/// One version of a note.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct NoteVersionView {
    /// The note's name.
    pub name: String,
    /// 1 for the first write, one more for each later write.
    pub version: u64,
    /// The text.
    pub text: String,
    /// Who wrote it: an agent id, `operator` or `config`.
    pub author: String,
    /// When, in milliseconds since the Unix epoch.
    pub written_at: i64,
}

impl From<NoteVersion> for NoteVersionView {
    fn from(v: NoteVersion) -> Self {
        Self {
            name: v.name.to_string(),
            version: v.version,
            text: v.text,
            author: v.author,
            written_at: v.written_at.0,
        }
    }
}

/// A note: its latest version (version 0 and empty text when never written), description and
/// grants.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct NoteView {
    /// The note's name.
    pub name: String,
    /// The description from the configuration (empty when none).
    pub description: String,
    /// The latest version (0: never written).
    pub version: u64,
    /// The latest text (empty when never written).
    pub text: String,
    /// Who wrote the latest version (absent when never written).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub author: Option<String>,
    /// When the latest version was written, in milliseconds since the Unix epoch (absent when
    /// never written).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub written_at: Option<i64>,
    /// Who may read or write it, by agent id.
    pub access: BTreeMap<String, NoteAccess>,
}

impl From<NoteSummary> for NoteView {
    fn from(n: NoteSummary) -> Self {
        let latest = n.latest;
        Self {
            name: n.name.to_string(),
            description: n.description,
            version: latest.as_ref().map_or(0, |v| v.version),
            text: latest.as_ref().map(|v| v.text.clone()).unwrap_or_default(),
            author: latest.as_ref().map(|v| v.author.clone()),
            written_at: latest.as_ref().map(|v| v.written_at.0),
            access: n
                .access
                .into_iter()
                .map(|(agent, access)| (agent.to_string(), access.into()))
                .collect(),
        }
    }
}

/// `PUT /api/notes/{name}`: a compare-and-set write.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteNoteBody {
    /// The whole new text.
    pub text: String,
    /// The version the text was based on (0 or absent for a new note): a write based on another
    /// version than the latest is refused with 409 and the current note.
    #[serde(default)]
    pub base_version: u64,
}

/// `PUT /api/notes/{name}/access/{agent}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NoteAccessBody {
    /// The access to grant.
    pub access: NoteAccess,
}

/// An agent's access to a note after a change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct NoteAccessView {
    /// The note's name.
    pub name: String,
    /// The agent.
    pub agent: String,
    /// Its access now (absent: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access: Option<NoteAccess>,
    /// Its access before (absent: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<NoteAccess>,
}

/// The 409 answer to a write based on an old version: the error and the note as it is now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct NoteConflictBody {
    /// The error (`code` is `conflict`).
    pub error: ErrorDetail,
    /// The note's latest version (absent: never written).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current: Option<NoteVersionView>,
}

/// A notes call's failure, as an HTTP answer.
#[derive(Debug)]
pub(crate) enum NotesFailure {
    Api(ApiError),
    Conflict(Box<NoteConflictBody>),
}

impl From<ApiError> for NotesFailure {
    fn from(e: ApiError) -> Self {
        Self::Api(e)
    }
}

impl From<NotesError> for NotesFailure {
    fn from(e: NotesError) -> Self {
        let message = e.to_string();
        match e {
            NotesError::InvalidName { .. } => Self::Api(ApiError::invalid("name", message)),
            NotesError::TooLarge { .. } => Self::Api(
                ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", message)
                    .with_field("text"),
            ),
            NotesError::NotFound { .. } => {
                Self::Api(ApiError::not_found(message).with_field("name"))
            }
            NotesError::UnknownAgent { .. } => {
                Self::Api(ApiError::not_found(message).with_field("agent"))
            }
            NotesError::Conflict { current, .. } => Self::Conflict(Box::new(NoteConflictBody {
                error: ErrorDetail {
                    code: "conflict".to_owned(),
                    message,
                    field: Some("base_version".to_owned()),
                },
                current: current.map(|c| (*c).into()),
            })),
            NotesError::Store(e) => Self::Api(e.into()),
            _ => Self::Api(ApiError::internal(message)),
        }
    }
}

impl IntoResponse for NotesFailure {
    fn into_response(self) -> Response {
        match self {
            Self::Api(e) => e.into_response(),
            Self::Conflict(body) => (StatusCode::CONFLICT, Json(*body)).into_response(),
        }
    }
}

type NotesResult<T> = Result<T, NotesFailure>;

fn notes(st: &crate::api::AppState) -> Result<Notes, ApiError> {
    st.notes
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
        .ok_or_else(|| ApiError::not_found("shared notes are not enabled in this organization"))
}

/// Every note: written, configured, or granted to someone.
#[utoipa::path(get, path = "/api/notes", tag = "notes",
    responses((status = 200, body = [NoteView]), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn list_notes(State(st): St) -> NotesResult<Json<Vec<NoteView>>> {
    let all = notes(&st)?.list().await?;
    Ok(Json(all.into_iter().map(Into::into).collect()))
}

/// One note: its latest text and version, description and grants.
#[utoipa::path(get, path = "/api/notes/{name}", tag = "notes",
    params(("name" = String, Path, description = "The note's name")),
    responses((status = 200, body = NoteView), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn get_note(
    State(st): St,
    Path(name): Path<String>,
) -> NotesResult<Json<NoteView>> {
    Ok(Json(notes(&st)?.read(&name).await?.into()))
}

/// Every version of a note, oldest first.
#[utoipa::path(get, path = "/api/notes/{name}/history", tag = "notes",
    params(("name" = String, Path, description = "The note's name")),
    responses((status = 200, body = [NoteVersionView]), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn note_history(
    State(st): St,
    Path(name): Path<String>,
) -> NotesResult<Json<Vec<NoteVersionView>>> {
    let history = notes(&st)?.history(&name).await?;
    Ok(Json(history.into_iter().map(Into::into).collect()))
}

/// Writes a note as the operator, compared and set: a write whose `base_version` is not the
/// note's latest version is refused with 409 and the current note; nothing is written then.
#[utoipa::path(put, path = "/api/notes/{name}", tag = "notes",
    params(("name" = String, Path, description = "The note's name")),
    request_body = WriteNoteBody,
    responses((status = 200, body = NoteVersionView), (status = 400, body = ErrorBody),
        (status = 409, body = NoteConflictBody), (status = 413, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn write_note(
    State(st): St,
    Path(name): Path<String>,
    ApiJson(body): ApiJson<WriteNoteBody>,
) -> NotesResult<Json<NoteVersionView>> {
    let written = notes(&st)?
        .write_as_operator(&name, &body.text, body.base_version)
        .await?;
    Ok(Json(written.into()))
}

/// Grants an agent access to a note (which need not exist yet); it takes effect on the agent's
/// next tool call and is stored (it survives a restart).
#[utoipa::path(put, path = "/api/notes/{name}/access/{agent}", tag = "notes",
    params(("name" = String, Path, description = "The note's name"),
        ("agent" = String, Path, description = "Agent id")),
    request_body = NoteAccessBody,
    responses((status = 200, body = NoteAccessView), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn grant_note_access(
    State(st): St,
    Path((name, agent)): Path<(String, String)>,
    ApiJson(body): ApiJson<NoteAccessBody>,
) -> NotesResult<Json<NoteAccessView>> {
    let id = agent_id(&agent)?;
    let previous = notes(&st)?.grant(&name, &id, body.access.into()).await?;
    Ok(Json(NoteAccessView {
        name,
        agent: id.to_string(),
        access: Some(body.access),
        previous: previous.map(Into::into),
    }))
}

/// Takes an agent's access to a note away (nothing to take is not an error); it takes effect
/// on the agent's next tool call.
#[utoipa::path(delete, path = "/api/notes/{name}/access/{agent}", tag = "notes",
    params(("name" = String, Path, description = "The note's name"),
        ("agent" = String, Path, description = "Agent id")),
    responses((status = 200, body = NoteAccessView), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn revoke_note_access(
    State(st): St,
    Path((name, agent)): Path<(String, String)>,
) -> NotesResult<Json<NoteAccessView>> {
    let id = agent_id(&agent)?;
    let previous = notes(&st)?.revoke(&name, &id).await?;
    Ok(Json(NoteAccessView {
        name,
        agent: id.to_string(),
        access: None,
        previous: previous.map(Into::into),
    }))
}
