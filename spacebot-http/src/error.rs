//! Errors: one JSON shape for every failure, `{"error": {"code", "message", "field"}}`.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use spacebot_core::delegation::DelegationError;
use spacebot_core::dialogue::DialogueError;
use spacebot_core::{DeliveryError, InvalidInput, OrgError, PolicyDenied, StoreError};
use utoipa::ToSchema;

/// The body of every error response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// What went wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    /// A stable machine-readable code: `unauthorized`, `invalid_input`, `not_found`, `conflict`,
    /// `policy_denied`, `queue_full`, `agent_ended`, `unsupported_media_type`, `payload_too_large`,
    /// `method_not_allowed`, `internal`.
    pub code: String,
    /// A sentence for people.
    pub message: String,
    /// The request field that was wrong (a path segment, a query parameter or a body field), when
    /// one was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

/// An error answered to an API client: a status code and an [`ErrorBody`].
#[derive(Debug, Clone, thiserror::Error)]
#[error("{status} {code}: {message}")]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// See [`ErrorDetail::code`].
    pub code: &'static str,
    /// See [`ErrorDetail::message`].
    pub message: String,
    /// See [`ErrorDetail::field`].
    pub field: Option<String>,
}

impl ApiError {
    /// An error with a status, code and message.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            field: None,
        }
    }

    /// Names the field that was wrong.
    pub fn with_field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }

    /// A 400 `invalid_input` about `field`.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_input", message).with_field(field)
    }

    /// A 404 `not_found`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    /// A 401 `unauthorized`.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }

    /// A 500 `internal`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }

    /// The JSON body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                code: self.code.to_string(),
                message: self.message.clone(),
                field: self.field.clone(),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(code = self.code, message = %self.message, "API request failed");
        }
        (self.status, Json(self.body())).into_response()
    }
}

impl From<InvalidInput> for ApiError {
    fn from(e: InvalidInput) -> Self {
        let field = e.what.clone();
        Self::invalid(field, e.to_string())
    }
}

impl From<PolicyDenied> for ApiError {
    fn from(e: PolicyDenied) -> Self {
        Self::new(StatusCode::FORBIDDEN, "policy_denied", e.to_string())
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match &e {
            StoreError::NotFound { .. } => Self::not_found(e.to_string()),
            StoreError::AlreadyExists { .. } | StoreError::Conflict { .. } => {
                Self::new(StatusCode::CONFLICT, "conflict", e.to_string())
            }
            StoreError::InvalidTransition(t) => {
                Self::new(StatusCode::CONFLICT, "conflict", t.to_string()).with_field("status")
            }
            StoreError::NotLeaseHolder { .. } => {
                Self::new(StatusCode::CONFLICT, "conflict", e.to_string())
            }
            StoreError::Invalid(i) => i.clone().into(),
            _ => Self::internal(e.to_string()),
        }
    }
}

impl From<OrgError> for ApiError {
    fn from(e: OrgError) -> Self {
        match e {
            OrgError::Store(s) => s.into(),
            OrgError::Invalid(i) => i.into(),
            OrgError::UnknownAgent(a) => {
                Self::not_found(format!("unknown agent {a}")).with_field("agent")
            }
            OrgError::Ended(a) => Self::new(
                StatusCode::CONFLICT,
                "agent_ended",
                format!("agent {a} has ended"),
            ),
            other => Self::internal(other.to_string()),
        }
    }
}

impl From<DeliveryError> for ApiError {
    fn from(e: DeliveryError) -> Self {
        match e {
            DeliveryError::UnknownAgent { agent } => {
                Self::not_found(format!("unknown agent {agent:?}")).with_field("agent")
            }
            DeliveryError::Ended { agent } => Self::new(
                StatusCode::CONFLICT,
                "agent_ended",
                format!("agent {agent} has ended and takes no more messages"),
            ),
            DeliveryError::QueueFull(q) => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "queue_full", q.to_string())
            }
            DeliveryError::Denied(d) => d.into(),
            DeliveryError::Store(s) => s.into(),
            DeliveryError::Invalid(i) => i.into(),
            other => Self::internal(other.to_string()),
        }
    }
}

impl From<DelegationError> for ApiError {
    fn from(e: DelegationError) -> Self {
        match e {
            DelegationError::UnknownAgent { .. } => {
                Self::not_found(e.to_string()).with_field("target")
            }
            DelegationError::Denied(d) => d.into(),
            DelegationError::Invalid(i) => i.into(),
            DelegationError::Store(s) => s.into(),
            other => Self::new(StatusCode::CONFLICT, "conflict", other.to_string()),
        }
    }
}

impl From<DialogueError> for ApiError {
    fn from(e: DialogueError) -> Self {
        match e {
            DialogueError::Denied(d) => d.into(),
            DialogueError::Store(s) => s.into(),
            DialogueError::Delivery(d) => d.into(),
            DialogueError::Invalid(i) => i.into(),
            DialogueError::NotFound(what) => {
                Self::not_found(format!("no conversation found: {what}"))
            }
            other => Self::new(StatusCode::CONFLICT, "conflict", other.to_string()),
        }
    }
}
