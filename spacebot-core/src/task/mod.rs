//! Tasks (seed 001): the model, the lifecycle table as one pure function, and the [`TaskStore`] trait.
//!
//! # Lifecycle
//!
//! | from \ event      | approve | schedule | park    | claim       | renew | wait    | child_ended      | resume | complete | fail / expire_lease              | cancel    |
//! |-------------------|---------|----------|---------|-------------|-------|---------|------------------|--------|----------|----------------------------------|-----------|
//! | pending_approval  | ready   |          | backlog |             |       |         |                  |        |          |                                  | cancelled |
//! | backlog           |         | ready    |         |             |       |         |                  |        |          |                                  | cancelled |
//! | ready             |         |          | backlog | in_progress |       |         |                  |        |          |                                  | cancelled |
//! | in_progress       |         |          |         |             | same  | waiting¹| same             |        | done     | ready, or failed at max attempts | cancelled |
//! | waiting           |         |          |         |             |       |         | same, or ready²  | ready  |          |                                  | cancelled |
//! | done, failed, cancelled: terminal, every event is refused |
//!
//! ¹ `wait` goes straight to `ready` when every child has already ended.
//! ² `child_ended` moves a waiting task to `ready` when it was the last child still running.
//!
//! Everything not in the table is [`InvalidTransition`](crate::error::InvalidTransition).
//! `complete`, `fail`, `renew` and `wait` are accepted only from the lease holder
//! ([`StoreError::NotLeaseHolder`](crate::error::StoreError::NotLeaseHolder)). `attempts` counts failed
//! or expired attempts; when it reaches `max_attempts` the task fails for good. `recover` (from the
//! holder, in_progress -> ready) puts back a claim whose worker's process ended: not an attempt, it
//! counts in `metadata.recoveries` up to [`Task::recovery_allowance`], then the task fails. A terminal
//! transition of a delegated task (one with `metadata.delegated_by`) yields exactly one
//! [`CompletionNotice`], which stores write to their outbox in the same transaction.

mod event;
mod lifecycle;
mod store;

use serde::{Deserialize, Serialize};

use crate::error::InvalidInput;
use crate::ids::{AgentId, ChannelId, LinkId, TaskRef};
use crate::link::text_enum;
use crate::time::Timestamp;

pub use event::{CompletionNotice, TaskEvent, TaskEventKind, Transition};
pub use store::{DynTaskStore, Expect, TaskFilter, TaskStore};

/// Where a task is in its lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum TaskStatus {
    /// Waiting for a human (or a superior) to approve it.
    PendingApproval,
    /// Accepted but not scheduled.
    Backlog,
    /// Ready to be claimed by the agent's task loop.
    Ready,
    /// Claimed; a worker holds its lease.
    InProgress,
    /// Waiting on tasks it delegated.
    Waiting,
    /// Finished with a result.
    Done,
    /// Given up on after `max_attempts`, or failed for good.
    Failed,
    /// Cancelled.
    Cancelled,
}

text_enum!(TaskStatus, "task status", [
    PendingApproval => "pending_approval",
    Backlog => "backlog",
    Ready => "ready",
    InProgress => "in_progress",
    Waiting => "waiting",
    Done => "done",
    Failed => "failed",
    Cancelled => "cancelled",
]);

impl TaskStatus {
    /// Every status, in lifecycle order.
    pub const ALL: [TaskStatus; 8] = [
        Self::PendingApproval,
        Self::Backlog,
        Self::Ready,
        Self::InProgress,
        Self::Waiting,
        Self::Done,
        Self::Failed,
        Self::Cancelled,
    ];

    /// Done, failed or cancelled.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Done | Self::Failed | Self::Cancelled)
    }
}

/// How urgent a task is. Claims take the highest priority first, then the lowest number.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    /// Low.
    Low,
    /// Medium (the default).
    #[default]
    Medium,
    /// High.
    High,
    /// Urgent.
    Urgent,
}

text_enum!(Priority, "task priority", [Low => "low", Medium => "medium", High => "high", Urgent => "urgent"]);

impl Priority {
    /// A number that sorts like the priority: 0 (low) to 3 (urgent). Backends index on it.
    pub fn rank(self) -> i64 {
        match self {
            Self::Low => 0,
            Self::Medium => 1,
            Self::High => 2,
            Self::Urgent => 3,
        }
    }

    /// The inverse of [`Priority::rank`].
    pub fn from_rank(rank: i64) -> Result<Self, InvalidInput> {
        match rank {
            0 => Ok(Self::Low),
            1 => Ok(Self::Medium),
            2 => Ok(Self::High),
            3 => Ok(Self::Urgent),
            other => Err(InvalidInput::new(
                "task priority",
                format!("unknown rank {other}"),
            )),
        }
    }
}

/// A child task this task delegated, and how it ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChildTask {
    /// The child.
    pub task: TaskRef,
    /// Its final status, once it ended.
    pub ended: Option<TaskStatus>,
    /// Its result or error, once it ended.
    pub outcome: Option<String>,
}

/// Delegation metadata of a task.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TaskMetadata {
    /// The agent that delegated this task, if it was delegated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delegated_by: Option<AgentId>,
    /// The delegator's channel to wake with the result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub originating_channel: Option<ChannelId>,
    /// The link the delegation went over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_id: Option<LinkId>,
    /// The agents the work passed through before reaching this task's owner, root first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub delegation_chain: Vec<AgentId>,
    /// The delegator's task this one was delegated from (multi-hop), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_task: Option<TaskRef>,
    /// Tasks this task delegated, with their outcomes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<ChildTask>,
    /// How many delegate-and-retrigger rounds led to the delegation that created this task.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub round: u32,
    /// The envelope that started the exchange this task is part of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<crate::ids::EnvelopeId>,
    /// Tokens the task's own workers spent (its children's are on their tasks; see
    /// `Organization::task_usage` for the sum).
    #[serde(default, skip_serializing_if = "crate::llm::Usage::is_zero")]
    pub usage: crate::llm::Usage,
    /// How many times the claim was recovered after its worker's process ended
    /// ([`TaskEvent::Recover`]); not failed attempts.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub recoveries: u32,
    /// The trace context (W3C `traceparent`) of the span that created the task: its claim, its
    /// turn and its completion notice continue that trace (see [`crate::telemetry`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_context: Option<String>,
    /// Application data.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The claim a worker holds on an in-progress task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// Who holds it (a worker id).
    pub holder: String,
    /// When it expires, by the [`Clock`](crate::time::Clock).
    pub expires_at: Timestamp,
}

/// A task on an agent's board.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Task {
    /// The board's owner.
    pub agent: AgentId,
    /// Per-agent number, from 1.
    pub number: u64,
    /// Short title (at most [`Task::MAX_TITLE`] characters).
    pub title: String,
    /// Full description.
    pub description: String,
    /// Lifecycle status.
    pub status: TaskStatus,
    /// Priority.
    pub priority: Priority,
    /// `human`, `agent:{id}`, or an application-chosen origin.
    pub created_by: String,
    /// Delegation metadata.
    pub metadata: TaskMetadata,
    /// Failed or expired attempts so far.
    pub attempts: u32,
    /// Attempts allowed before the task fails for good (at least 1).
    pub max_attempts: u32,
    /// The current claim, while in progress.
    pub lease: Option<Lease>,
    /// Incremented by every change; guards optimistic updates.
    pub revision: u64,
    /// The result, once done.
    pub result: Option<String>,
    /// The last error.
    pub error: Option<String>,
    /// Creation time.
    pub created_at: Timestamp,
    /// Last change.
    pub updated_at: Timestamp,
}

/// What [`TaskStore::create`] needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewTask {
    /// Title (trimmed and cut to [`Task::MAX_TITLE`] characters).
    pub title: String,
    /// Description.
    pub description: String,
    /// Initial status: pending_approval, backlog or ready.
    pub status: TaskStatus,
    /// Priority.
    pub priority: Priority,
    /// Origin (`human`, `agent:{id}`, ...).
    pub created_by: String,
    /// Delegation metadata.
    pub metadata: TaskMetadata,
    /// Attempts allowed (at least 1).
    pub max_attempts: u32,
    /// Creating with a key already used on the agent's board returns the task created the first
    /// time, unchanged: a delegation repeated after a crash does not make a second task.
    pub idempotency_key: Option<String>,
}

impl NewTask {
    /// A ready, medium-priority task with three attempts, created by `human`.
    pub fn new(title: impl Into<String>, description: impl Into<String>) -> Self {
        Self {
            title: title.into(),
            description: description.into(),
            status: TaskStatus::Ready,
            priority: Priority::Medium,
            created_by: "human".into(),
            metadata: TaskMetadata::default(),
            max_attempts: 3,
            idempotency_key: None,
        }
    }

    /// Sets the idempotency key (see [`TaskStore::create`]).
    pub fn with_idempotency_key(mut self, key: impl Into<String>) -> Self {
        self.idempotency_key = Some(key.into());
        self
    }

    /// Checks the input and builds task `number` of `agent` at `now`.
    pub fn into_task(
        self,
        agent: AgentId,
        number: u64,
        now: Timestamp,
    ) -> Result<Task, InvalidInput> {
        if !matches!(
            self.status,
            TaskStatus::PendingApproval | TaskStatus::Backlog | TaskStatus::Ready
        ) {
            return Err(InvalidInput::new(
                "task status",
                format!(
                    "a new task starts as pending_approval, backlog or ready, not {}",
                    self.status
                ),
            ));
        }
        if self.max_attempts == 0 {
            return Err(InvalidInput::new("task max_attempts", "must be at least 1"));
        }
        let title = truncate_chars(self.title.trim(), Task::MAX_TITLE);
        if title.is_empty() {
            return Err(InvalidInput::new("task title", "must not be empty"));
        }
        Ok(Task {
            agent,
            number,
            title,
            description: self.description,
            status: self.status,
            priority: self.priority,
            created_by: self.created_by,
            metadata: self.metadata,
            attempts: 0,
            max_attempts: self.max_attempts,
            lease: None,
            revision: 1,
            result: None,
            error: None,
            created_at: now,
            updated_at: now,
        })
    }
}

/// The first `max` characters of `s` (on a character boundary).
pub fn truncate_chars(s: &str, max: usize) -> String {
    s.chars().take(max).collect()
}
