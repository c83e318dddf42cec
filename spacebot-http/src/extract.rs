//! Extractors whose every refusal is an [`ApiError`] naming the field.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::header::CONTENT_TYPE;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;
use spacebot_core::{AgentId, TaskRef};

use crate::error::ApiError;

/// A JSON body; a refusal names the body field that was wrong.
#[derive(Debug, Clone)]
pub(crate) struct ApiJson<T>(pub(crate) T);

impl<T, S> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let json = req
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| {
                v.split(';')
                    .next()
                    .unwrap_or("")
                    .trim()
                    .to_ascii_lowercase()
            });
        match json.as_deref() {
            Some("application/json") => {}
            _ => {
                return Err(ApiError::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported_media_type",
                    "the body must be JSON (Content-Type: application/json)",
                )
                .with_field("body"));
            }
        }
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(body_rejection)?;
        parse_json(&bytes).map(ApiJson)
    }
}

/// A body that could not be read (too large, a broken upload).
pub(crate) fn body_rejection(e: axum::extract::rejection::BytesRejection) -> ApiError {
    let status = e.status();
    let code = if status == StatusCode::PAYLOAD_TOO_LARGE {
        "payload_too_large"
    } else {
        "invalid_input"
    };
    ApiError::new(status, code, e.body_text()).with_field("body")
}

/// Path segments; a refusal (a segment that is not valid UTF-8) names the path.
#[derive(Debug, Clone)]
pub(crate) struct ApiPath<T>(pub(crate) T);

impl<T, S> FromRequestParts<S> for ApiPath<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(ApiPath(value)),
            Err(e) => Err(ApiError::invalid("path", e.body_text())),
        }
    }
}

/// Parses a JSON body, naming the field a failure is about.
pub(crate) fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    match serde_path_to_error::deserialize::<_, T>(&mut de) {
        Ok(value) => Ok(value),
        Err(e) => {
            let message = e.inner().to_string();
            let path = e.path().to_string();
            let field = if path == "." || path.is_empty() {
                missing_field(&message).unwrap_or_else(|| "body".to_string())
            } else {
                path
            };
            Err(ApiError::invalid(field, format!("invalid body: {message}")))
        }
    }
}

fn missing_field(message: &str) -> Option<String> {
    let rest = message.strip_prefix("missing field `")?;
    Some(rest.split('`').next()?.to_string())
}

/// Query parameters; a refusal names the parameter.
#[derive(Debug, Clone)]
pub(crate) struct ApiQuery<T>(pub(crate) T);

impl<T, S> FromRequestParts<S> for ApiQuery<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let query = parts.uri.query().unwrap_or("");
        let de = serde_urlencoded::Deserializer::new(form_urlencoded::parse(query.as_bytes()));
        match serde_path_to_error::deserialize::<_, T>(de) {
            Ok(value) => Ok(ApiQuery(value)),
            Err(e) => {
                let message = e.inner().to_string();
                let path = e.path().to_string();
                let field = if path == "." || path.is_empty() {
                    missing_field(&message).unwrap_or_else(|| "query".to_string())
                } else {
                    path
                };
                Err(ApiError::invalid(
                    field,
                    format!("invalid query: {message}"),
                ))
            }
        }
    }
}

/// Parses an agent id from a path segment.
pub(crate) fn agent_id(raw: &str) -> Result<AgentId, ApiError> {
    AgentId::parse(raw).map_err(|e| ApiError::invalid("agent", e.to_string()))
}

/// Parses a task number from a path segment.
pub(crate) fn task_ref(agent: &str, number: &str) -> Result<TaskRef, ApiError> {
    let agent = agent_id(agent)?;
    let number: u64 = number.parse().map_err(|_| {
        ApiError::invalid(
            "number",
            format!("invalid task number {number:?}: expected a positive integer"),
        )
    })?;
    if number == 0 {
        return Err(ApiError::invalid("number", "task numbers start at 1"));
    }
    Ok(TaskRef::new(agent, number))
}
