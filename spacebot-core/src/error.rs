//! Error types shared by every trait of the core.
//!
//! Errors say what happened (not which backend failed) and carry enough context to act on:
//! a policy denial names who, whom and why; a store error names the record.

use std::time::Duration;

use crate::ids::{AgentId, TaskRef};
use crate::task::{TaskEventKind, TaskStatus};

/// A boxed error source, for backend-specific causes.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Input that was refused, with the name of what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what}: {reason}")]
pub struct InvalidInput {
    /// What was invalid (for example `agent id`, `links[2].direction`).
    pub what: String,
    /// Why it was refused.
    pub reason: String,
}

impl InvalidInput {
    /// An invalid-input error about `what`.
    pub fn new(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            what: what.into(),
            reason: reason.into(),
        }
    }
}

/// A task event that the lifecycle table does not allow from the task's current status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid transition for task {task}: {event} is not allowed from {from}")]
pub struct InvalidTransition {
    /// The task.
    pub task: TaskRef,
    /// Its status when the event arrived.
    pub from: TaskStatus,
    /// The refused event.
    pub event: TaskEventKind,
}

/// Failures of the storage traits ([`LinkStore`](crate::link::LinkStore),
/// [`TaskStore`](crate::task::TaskStore), ...). Every backend maps its errors onto these.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The record does not exist.
    #[error("{what} not found")]
    NotFound {
        /// The missing record, for example `link 1f3c...` or `task support#4`.
        what: String,
    },
    /// A record with the same identity (or unique key) exists already.
    #[error("{what} already exists")]
    AlreadyExists {
        /// The conflicting record.
        what: String,
    },
    /// An optimistic-concurrency guard failed: the record changed since it was read.
    #[error("conflict on {what}: expected {expected}, found {actual}")]
    Conflict {
        /// The record.
        what: String,
        /// What the caller expected (status and/or revision).
        expected: String,
        /// What the store holds.
        actual: String,
    },
    /// The lifecycle table refused the change.
    #[error(transparent)]
    InvalidTransition(#[from] InvalidTransition),
    /// Only the holder of a task's lease may complete or fail it.
    #[error("task {task} is not leased to {caller} (holder: {})", holder.as_deref().unwrap_or("none"))]
    NotLeaseHolder {
        /// The task.
        task: TaskRef,
        /// Who tried.
        caller: String,
        /// Who holds the lease, if anyone.
        holder: Option<String>,
    },
    /// The caller passed something the store refuses (for example raising a conversation budget).
    #[error(transparent)]
    Invalid(#[from] InvalidInput),
    /// The stored data is unreadable: a corrupted file, a foreign file, or a schema this code does not know.
    #[error("corrupt or foreign store {location}: {reason}")]
    Corrupt {
        /// The file or database that is wrong.
        location: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Any other backend failure (I/O, driver errors, a closed pool).
    #[error("{backend} backend error: {message}")]
    Backend {
        /// Which backend (`sqlite`, `redb`, `memory`, ...).
        backend: &'static str,
        /// What went wrong, including the file when there is one.
        message: String,
        /// The underlying error.
        #[source]
        source: Option<BoxError>,
    },
}

impl StoreError {
    /// A [`StoreError::NotFound`] for `what`.
    pub fn not_found(what: impl Into<String>) -> Self {
        Self::NotFound { what: what.into() }
    }

    /// A [`StoreError::AlreadyExists`] for `what`.
    pub fn already_exists(what: impl Into<String>) -> Self {
        Self::AlreadyExists { what: what.into() }
    }

    /// A [`StoreError::Backend`] wrapping `source`.
    pub fn backend(
        backend: &'static str,
        message: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        Self::Backend {
            backend,
            message: message.into(),
            source: Some(source.into()),
        }
    }
}

/// Why the policy refused an operation. Part of [`PolicyDenied`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "reason")]
#[non_exhaustive]
pub enum DenialReason {
    /// There is no link between the two agents in either direction.
    NoLink,
    /// The link exists but is disabled.
    LinkDisabled,
    /// The link is one-way from the target to the actor: the actor may answer inside an exchange
    /// the target started, but may not start one.
    OneWayReverse,
    /// The actor tried to answer but no exchange started by the other side is open.
    NoOpenExchange,
    /// The actor addressed itself.
    SelfTarget,
    /// The target is not a known agent.
    UnknownAgent,
    /// The target is already in the delegation chain (the delegation would loop).
    Cycle {
        /// The chain so far, root first.
        chain: Vec<AgentId>,
    },
    /// The delegation chain would exceed the configured depth limit.
    DepthExceeded {
        /// The configured limit.
        limit: usize,
    },
}

impl std::fmt::Display for DenialReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoLink => f.write_str("there is no link between them"),
            Self::LinkDisabled => f.write_str("their link is disabled"),
            Self::OneWayReverse => f.write_str(
                "their link is one-way in the other direction: only the other side may start an exchange",
            ),
            Self::NoOpenExchange => f.write_str("no exchange started by the other side is open"),
            Self::SelfTarget => f.write_str("an agent cannot address itself"),
            Self::UnknownAgent => f.write_str("the target is not a known agent"),
            Self::Cycle { chain } => {
                let chain: Vec<&str> = chain.iter().map(AgentId::as_str).collect();
                write!(f, "the target is already in the delegation chain {}", chain.join(" -> "))
            }
            Self::DepthExceeded { limit } => {
                write!(f, "the delegation chain would be deeper than the limit of {limit}")
            }
        }
    }
}

/// What the policy was asked about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum PolicyAction {
    /// Start an exchange (a message or a conversation).
    Start,
    /// Answer inside an exchange the other side started.
    Answer,
    /// Delegate a task.
    Delegate,
}

impl std::fmt::Display for PolicyAction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Start => "start an exchange with",
            Self::Answer => "answer",
            Self::Delegate => "delegate to",
        })
    }
}

/// The policy refused an operation: who tried what on whom, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
#[error("{actor} may not {action} {target}: {reason}")]
pub struct PolicyDenied {
    /// The agent that tried.
    pub actor: AgentId,
    /// The agent it addressed (as given, when unknown).
    pub target: String,
    /// What it tried.
    pub action: PolicyAction,
    /// Why it was refused.
    pub reason: DenialReason,
}

/// Failures of an [`LlmProvider`](crate::llm::LlmProvider).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LlmError {
    /// The credentials were refused (HTTP 401/403).
    #[error("authentication failed: {message}")]
    Authentication {
        /// The server's explanation.
        message: String,
    },
    /// Too many requests (HTTP 429).
    #[error("rate limited{}: {message}", retry_after.map(|d| format!(" (retry after {d:?})")).unwrap_or_default())]
    RateLimited {
        /// How long the server asked to wait, if it said.
        retry_after: Option<Duration>,
        /// The server's explanation.
        message: String,
    },
    /// The prompt does not fit the model's context window.
    #[error("context too long: {message}")]
    ContextTooLong {
        /// The server's explanation.
        message: String,
    },
    /// The request was refused as invalid (HTTP 4xx other than the above).
    #[error("invalid request (HTTP {status}): {message}")]
    InvalidRequest {
        /// The HTTP status.
        status: u16,
        /// The server's explanation.
        message: String,
    },
    /// The server failed (HTTP 5xx).
    #[error("server error (HTTP {status}): {message}")]
    Server {
        /// The HTTP status.
        status: u16,
        /// The server's explanation.
        message: String,
    },
    /// No answer in time.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// The answer could not be understood (bad JSON, a stream cut mid-way, bad tool arguments).
    #[error("malformed response: {0}")]
    MalformedResponse(String),
    /// The connection failed.
    #[error("transport error: {message}")]
    Transport {
        /// What failed.
        message: String,
        /// The underlying error.
        #[source]
        source: Option<BoxError>,
    },
    /// A scripted or custom provider has nothing to answer with.
    #[error("provider error: {0}")]
    Other(String),
}

impl LlmError {
    /// Whether retrying the same request later can help (rate limits, server errors, timeouts,
    /// transport failures).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::RateLimited { .. }
                | Self::Server { .. }
                | Self::Timeout(_)
                | Self::Transport { .. }
        )
    }
}
