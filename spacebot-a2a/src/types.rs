//! The A2A 1.0 objects this crate sends and reads, in their JSON form (the protocol buffers'
//! JSON mapping: camelCase fields, enums as `TASK_STATE_*` / `ROLE_*` strings), as PyPI's
//! `a2a-sdk` 1.x reads and writes them. Fields this crate does not use are kept out; unknown
//! fields are ignored on input.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The protocol version this crate speaks (sent in the `A2A-Version` header).
pub const PROTOCOL_VERSION: &str = "1.0";
/// The header carrying the protocol version.
pub const VERSION_HEADER: &str = "A2A-Version";
/// Where an agent card is served, under its base URL.
pub const AGENT_CARD_PATH: &str = "/.well-known/agent-card.json";

/// The JSON-RPC methods of A2A 1.0.
pub mod methods {
    /// Sends a message; answers with the task (or a message).
    pub const SEND_MESSAGE: &str = "SendMessage";
    /// Sends a message; answers with a stream of events (SSE).
    pub const SEND_STREAMING_MESSAGE: &str = "SendStreamingMessage";
    /// A task's current state.
    pub const GET_TASK: &str = "GetTask";
    /// Cancels a task.
    pub const CANCEL_TASK: &str = "CancelTask";
    /// Streams a task's events from now on (SSE).
    pub const SUBSCRIBE_TO_TASK: &str = "SubscribeToTask";
}

/// A2A's JSON-RPC error codes.
pub mod codes {
    /// The body is not JSON.
    pub const PARSE_ERROR: i64 = -32700;
    /// Not a JSON-RPC request.
    pub const INVALID_REQUEST: i64 = -32600;
    /// No such method.
    pub const METHOD_NOT_FOUND: i64 = -32601;
    /// The params do not fit the method.
    pub const INVALID_PARAMS: i64 = -32602;
    /// The server failed.
    pub const INTERNAL_ERROR: i64 = -32603;
    /// No such task.
    pub const TASK_NOT_FOUND: i64 = -32001;
    /// The task is in a terminal state.
    pub const TASK_NOT_CANCELABLE: i64 = -32002;
    /// Push notifications are not supported.
    pub const PUSH_NOTIFICATION_NOT_SUPPORTED: i64 = -32003;
    /// The operation is not supported.
    pub const UNSUPPORTED_OPERATION: i64 = -32004;
    /// The `A2A-Version` is not one the server speaks.
    pub const VERSION_NOT_SUPPORTED: i64 = -32009;
}

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Role {
    /// Not said.
    #[default]
    #[serde(rename = "ROLE_UNSPECIFIED")]
    Unspecified,
    /// The client.
    #[serde(rename = "ROLE_USER")]
    User,
    /// The agent.
    #[serde(rename = "ROLE_AGENT")]
    Agent,
}

/// One part of a message or an artifact: text, structured data, a URL or raw bytes (base64).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Part {
    /// Text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Structured data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    /// A file's URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Bytes, base64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw: Option<String>,
    /// The media type.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub media_type: String,
    /// A file name.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub filename: String,
}

impl Part {
    /// A text part.
    pub fn text(text: impl Into<String>) -> Self {
        Self {
            text: Some(text.into()),
            ..Self::default()
        }
    }
}

/// A message between a client and an agent.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Message {
    /// Its id, chosen by its writer (the server deduplicates on it).
    #[serde(default)]
    pub message_id: String,
    /// The conversation it belongs to.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub context_id: String,
    /// The task it belongs to.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub task_id: String,
    /// Who wrote it.
    #[serde(default)]
    pub role: Role,
    /// Its content.
    #[serde(default)]
    pub parts: Vec<Part>,
    /// Free-form metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Map<String, Value>>,
}

impl Message {
    /// A one-part text message.
    pub fn text(role: Role, message_id: impl Into<String>, text: impl Into<String>) -> Self {
        Self {
            message_id: message_id.into(),
            role,
            parts: vec![Part::text(text)],
            ..Self::default()
        }
    }

    /// The message as text: its text parts, its data parts as JSON, its files by URL or name,
    /// one per line.
    pub fn to_text(&self) -> String {
        parts_text(&self.parts)
    }
}

/// Parts as text (see [`Message::to_text`]).
pub fn parts_text(parts: &[Part]) -> String {
    parts
        .iter()
        .filter_map(|p| {
            if let Some(t) = &p.text {
                Some(t.clone())
            } else if let Some(d) = &p.data {
                Some(d.to_string())
            } else if let Some(u) = &p.url {
                Some(format!("[file: {u}]"))
            } else if p.raw.is_some() {
                Some(format!(
                    "[file: {} {}, not shown]",
                    p.filename, p.media_type
                ))
            } else {
                None
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Where a task is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum TaskState {
    /// Not said.
    #[default]
    #[serde(rename = "TASK_STATE_UNSPECIFIED")]
    Unspecified,
    /// Accepted, not started.
    #[serde(rename = "TASK_STATE_SUBMITTED")]
    Submitted,
    /// Being worked on.
    #[serde(rename = "TASK_STATE_WORKING")]
    Working,
    /// Done (terminal).
    #[serde(rename = "TASK_STATE_COMPLETED")]
    Completed,
    /// Failed (terminal).
    #[serde(rename = "TASK_STATE_FAILED")]
    Failed,
    /// Canceled (terminal).
    #[serde(rename = "TASK_STATE_CANCELED")]
    Canceled,
    /// Waits for input (here: for a human's approval).
    #[serde(rename = "TASK_STATE_INPUT_REQUIRED")]
    InputRequired,
    /// Refused (terminal).
    #[serde(rename = "TASK_STATE_REJECTED")]
    Rejected,
    /// Waits for authentication.
    #[serde(rename = "TASK_STATE_AUTH_REQUIRED")]
    AuthRequired,
}

impl TaskState {
    /// Whether nothing changes the task any more.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::Completed | Self::Failed | Self::Canceled | Self::Rejected
        )
    }

    /// The state's name as A2A's JSON writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unspecified => "TASK_STATE_UNSPECIFIED",
            Self::Submitted => "TASK_STATE_SUBMITTED",
            Self::Working => "TASK_STATE_WORKING",
            Self::Completed => "TASK_STATE_COMPLETED",
            Self::Failed => "TASK_STATE_FAILED",
            Self::Canceled => "TASK_STATE_CANCELED",
            Self::InputRequired => "TASK_STATE_INPUT_REQUIRED",
            Self::Rejected => "TASK_STATE_REJECTED",
            Self::AuthRequired => "TASK_STATE_AUTH_REQUIRED",
        }
    }
}

/// A task's state, with the message that goes with it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskStatus {
    /// The state.
    #[serde(default)]
    pub state: TaskState,
    /// What the agent says with it (its answer, why it failed, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<Message>,
    /// When (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<String>,
}

/// An output of a task.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Artifact {
    /// Its id.
    #[serde(default)]
    pub artifact_id: String,
    /// Its name.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// Its content.
    #[serde(default)]
    pub parts: Vec<Part>,
}

/// A task.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Task {
    /// Its id (the server's).
    #[serde(default)]
    pub id: String,
    /// Its conversation.
    #[serde(default)]
    pub context_id: String,
    /// Where it is.
    #[serde(default)]
    pub status: TaskStatus,
    /// Its outputs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub artifacts: Vec<Artifact>,
    /// The messages exchanged.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<Message>,
    /// Free-form metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Map<String, Value>>,
}

impl Task {
    /// The result's text: the artifacts' text, else the status message's.
    pub fn result_text(&self) -> String {
        let artifacts: Vec<String> = self
            .artifacts
            .iter()
            .map(|a| parts_text(&a.parts))
            .filter(|t| !t.is_empty())
            .collect();
        if !artifacts.is_empty() {
            return artifacts.join("\n");
        }
        self.status
            .message
            .as_ref()
            .map(Message::to_text)
            .unwrap_or_default()
    }
}

/// A task's state changed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskStatusUpdateEvent {
    /// The task.
    #[serde(default)]
    pub task_id: String,
    /// Its conversation.
    #[serde(default)]
    pub context_id: String,
    /// The new status.
    #[serde(default)]
    pub status: TaskStatus,
}

/// A task produced (part of) an artifact.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskArtifactUpdateEvent {
    /// The task.
    #[serde(default)]
    pub task_id: String,
    /// Its conversation.
    #[serde(default)]
    pub context_id: String,
    /// The artifact.
    #[serde(default)]
    pub artifact: Artifact,
    /// Whether it adds to an artifact sent before.
    #[serde(default)]
    pub append: bool,
    /// Whether it is the artifact's last chunk.
    #[serde(default)]
    pub last_chunk: bool,
}

/// One event of a stream (and, as `task` or `message`, the answer to `SendMessage`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum StreamResponse {
    /// The task as it is.
    Task(Task),
    /// A message (no task).
    Message(Message),
    /// A status change.
    StatusUpdate(TaskStatusUpdateEvent),
    /// An artifact.
    ArtifactUpdate(TaskArtifactUpdateEvent),
}

/// How the client wants `SendMessage` answered.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SendMessageConfiguration {
    /// The output media types the client accepts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub accepted_output_modes: Vec<String>,
    /// How many messages of the history to return.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history_length: Option<i64>,
    /// Answer at once with the task as it is, not when it ends.
    #[serde(default)]
    pub return_immediately: bool,
}

/// The params of `SendMessage` and `SendStreamingMessage`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SendMessageRequest {
    /// The message.
    pub message: Message,
    /// How to answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub configuration: Option<SendMessageConfiguration>,
    /// Free-form metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Map<String, Value>>,
}

/// The params of `GetTask`, `CancelTask` and `SubscribeToTask`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskIdParams {
    /// The task's id.
    pub id: String,
    /// How many messages of the history to return (`GetTask`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history_length: Option<i64>,
}

/// A timestamp as RFC 3339 (UTC, milliseconds), as A2A writes times.
pub fn rfc3339(millis: i64) -> String {
    let secs = millis.div_euclid(1000);
    let ms = millis.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_709_251_200_123), "2024-03-01T00:00:00.123Z");
    }

    #[test]
    fn stream_responses_are_one_field_objects() {
        let event = StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
            task_id: "t".into(),
            context_id: "c".into(),
            status: TaskStatus {
                state: TaskState::Working,
                ..TaskStatus::default()
            },
        });
        let json = serde_json::to_value(&event).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"statusUpdate": {"taskId": "t", "contextId": "c", "status": {"state": "TASK_STATE_WORKING"}}})
        );
        let back: StreamResponse = serde_json::from_value(json).unwrap();
        assert_eq!(back, event);
    }
}
