//! The events that may change a task, and what applying one yields.

use serde::{Deserialize, Serialize};

use super::{Task, TaskStatus};
use crate::ids::{AgentId, ChannelId, LinkId, TaskRef};
use crate::link::text_enum;
use crate::time::Timestamp;

/// An event that may change a task. See the module docs for the table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "event")]
#[non_exhaustive]
pub enum TaskEvent {
    /// pending_approval -> ready.
    Approve,
    /// backlog -> ready.
    Schedule,
    /// ready or pending_approval -> backlog.
    Park,
    /// ready -> in_progress, with a lease for `holder` until `lease_until`.
    Claim {
        /// The worker.
        holder: String,
        /// Lease expiry.
        lease_until: Timestamp,
    },
    /// Extends the holder's lease.
    Renew {
        /// The worker.
        holder: String,
        /// New expiry.
        lease_until: Timestamp,
    },
    /// Adds the token usage of a worker's model calls to the task (in_progress; the status does not
    /// change; the worker must hold the lease).
    RecordUsage {
        /// The worker.
        holder: String,
        /// Tokens spent.
        usage: crate::llm::Usage,
    },
    /// Records a delegated child (in_progress or waiting; the status does not change).
    AddChild {
        /// The child task.
        child: TaskRef,
    },
    /// in_progress -> waiting on children (straight to ready when all children already ended).
    Wait {
        /// The worker.
        holder: String,
    },
    /// in_progress -> failed for good, whatever attempts are left: the worker says retrying cannot
    /// help.
    GiveUp {
        /// The worker.
        holder: String,
        /// Why.
        error: String,
    },
    /// A child ended (in_progress or waiting); a waiting task whose last child ended becomes ready.
    ChildEnded {
        /// The child task.
        child: TaskRef,
        /// Its terminal status.
        status: TaskStatus,
        /// Its result or error.
        outcome: String,
    },
    /// waiting -> ready, whatever the children (an operator's override).
    Resume,
    /// in_progress -> done.
    Complete {
        /// The worker.
        holder: String,
        /// The result.
        result: String,
    },
    /// in_progress -> ready (attempts left) or failed.
    Fail {
        /// The worker.
        holder: String,
        /// The error.
        error: String,
    },
    /// in_progress with an expired lease -> ready (attempts left) or failed.
    ExpireLease,
    /// in_progress -> ready: the holder's process ended (a crash, a kill) before the work finished,
    /// and the claim is recovered. The work may not have begun (a kill between the claim and the
    /// model call), so this is no failed attempt: it counts in [`TaskMetadata::recoveries`](super::TaskMetadata::recoveries),
    /// which has an allowance of its own ([`Task::recovery_allowance`]); past it the task fails
    /// for good, saying so.
    Recover {
        /// The holder whose process ended.
        holder: String,
    },
    /// Any non-terminal status -> cancelled.
    Cancel {
        /// Why.
        reason: String,
    },
}

/// The name of a [`TaskEvent`], for errors and events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[allow(missing_docs)]
#[non_exhaustive]
pub enum TaskEventKind {
    Approve,
    Schedule,
    Park,
    Claim,
    Renew,
    RecordUsage,
    AddChild,
    Wait,
    ChildEnded,
    Resume,
    Complete,
    Fail,
    GiveUp,
    ExpireLease,
    Recover,
    Cancel,
}

text_enum!(TaskEventKind, "task event", [
    Approve => "approve", Schedule => "schedule", Park => "park", Claim => "claim", Renew => "renew",
    RecordUsage => "record_usage", AddChild => "add_child", Wait => "wait", ChildEnded => "child_ended", Resume => "resume",
    Complete => "complete", Fail => "fail", GiveUp => "give_up", ExpireLease => "expire_lease", Recover => "recover", Cancel => "cancel",
]);

impl TaskEvent {
    /// The event's name.
    pub fn kind(&self) -> TaskEventKind {
        match self {
            Self::Approve => TaskEventKind::Approve,
            Self::Schedule => TaskEventKind::Schedule,
            Self::Park => TaskEventKind::Park,
            Self::Claim { .. } => TaskEventKind::Claim,
            Self::Renew { .. } => TaskEventKind::Renew,
            Self::RecordUsage { .. } => TaskEventKind::RecordUsage,
            Self::AddChild { .. } => TaskEventKind::AddChild,
            Self::Wait { .. } => TaskEventKind::Wait,
            Self::ChildEnded { .. } => TaskEventKind::ChildEnded,
            Self::Resume => TaskEventKind::Resume,
            Self::Complete { .. } => TaskEventKind::Complete,
            Self::Fail { .. } => TaskEventKind::Fail,
            Self::GiveUp { .. } => TaskEventKind::GiveUp,
            Self::ExpireLease => TaskEventKind::ExpireLease,
            Self::Recover { .. } => TaskEventKind::Recover,
            Self::Cancel { .. } => TaskEventKind::Cancel,
        }
    }
}

/// The notice a delegated task's terminal transition leaves in its owner's outbox, to be delivered
/// to the delegator at least once and applied exactly once (by `key`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompletionNotice {
    /// Idempotency key, unique per task end: `{agent}#{number}:{status}`.
    pub key: String,
    /// The task that ended.
    pub task: TaskRef,
    /// Its title.
    pub title: String,
    /// done, failed or cancelled.
    pub status: TaskStatus,
    /// The result (done) or error (failed, cancelled), in full.
    pub outcome: String,
    /// The delegator to notify.
    pub delegated_by: AgentId,
    /// The delegator's channel to wake.
    pub originating_channel: Option<ChannelId>,
    /// The link the delegation went over.
    pub link_id: Option<LinkId>,
    /// The delegator's task waiting on this one, if any.
    pub parent_task: Option<TaskRef>,
    /// When the task ended.
    pub created_at: Timestamp,
}

/// The outcome of applying an event: the new task and, for a delegated task that ended, its notice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    /// The task after the event (revision incremented, `updated_at` set).
    pub task: Task,
    /// The notice to write to the outbox in the same transaction.
    pub notice: Option<CompletionNotice>,
}
