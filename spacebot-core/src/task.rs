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
//! Everything not in the table is [`InvalidTransition`]. `complete`, `fail`, `renew` and `wait` are
//! accepted only from the lease holder ([`StoreError::NotLeaseHolder`]). `attempts` counts failed
//! or expired attempts; when it reaches `max_attempts` the task fails for good. `recover` (from the
//! holder, in_progress -> ready) puts back a claim whose worker's process ended: not an attempt, it
//! counts in `metadata.recoveries` up to [`Task::recovery_allowance`], then the task fails. A terminal
//! transition of a delegated task (one with `metadata.delegated_by`) yields exactly one
//! [`CompletionNotice`], which stores write to their outbox in the same transaction.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::error::{InvalidInput, InvalidTransition, StoreError};
use crate::ids::{AgentId, ChannelId, LinkId, TaskRef};
use crate::link::text_enum;
use crate::time::Timestamp;

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
    /// model call), so this is no failed attempt: it counts in [`TaskMetadata::recoveries`],
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

impl Task {
    /// Longest title, in characters.
    pub const MAX_TITLE: usize = 120;

    /// This task's reference.
    pub fn task_ref(&self) -> TaskRef {
        TaskRef::new(self.agent.clone(), self.number)
    }

    /// Whether the lease has expired at `now` (false when there is no lease).
    pub fn lease_expired(&self, now: Timestamp) -> bool {
        self.lease.as_ref().is_some_and(|l| l.expires_at <= now)
    }

    fn invalid(&self, event: &TaskEvent) -> StoreError {
        StoreError::InvalidTransition(InvalidTransition {
            task: self.task_ref(),
            from: self.status,
            event: event.kind(),
        })
    }

    fn check_holder(&self, holder: &str) -> Result<(), StoreError> {
        match &self.lease {
            Some(l) if l.holder == holder => Ok(()),
            other => Err(StoreError::NotLeaseHolder {
                task: self.task_ref(),
                caller: holder.to_string(),
                holder: other.as_ref().map(|l| l.holder.clone()),
            }),
        }
    }

    fn all_children_ended(&self) -> bool {
        self.metadata.children.iter().all(|c| c.ended.is_some())
    }

    /// Applies `event` at `now`: the lifecycle table as a pure function.
    ///
    /// ```
    /// use spacebot_core::task::{NewTask, TaskEvent, TaskStatus};
    /// use spacebot_core::{AgentId, Timestamp};
    /// let task = NewTask::new("Pick a word", "").into_task(AgentId::parse("cm").unwrap(), 1, Timestamp(0)).unwrap();
    /// let claimed = task.apply(TaskEvent::Claim { holder: "w1".into(), lease_until: Timestamp(60_000) }, Timestamp(1)).unwrap().task;
    /// assert_eq!(claimed.status, TaskStatus::InProgress);
    /// let done = claimed.apply(TaskEvent::Complete { holder: "w1".into(), result: "nebula".into() }, Timestamp(2)).unwrap().task;
    /// assert_eq!(done.result.as_deref(), Some("nebula"));
    /// assert!(done.apply(TaskEvent::Cancel { reason: "late".into() }, Timestamp(3)).is_err());
    /// ```
    pub fn apply(&self, event: TaskEvent, now: Timestamp) -> Result<Transition, StoreError> {
        use TaskStatus as S;
        let mut next = self.clone();
        match (&self.status, &event) {
            (S::PendingApproval, TaskEvent::Approve) | (S::Backlog, TaskEvent::Schedule) => {
                next.status = S::Ready;
            }
            (S::PendingApproval | S::Ready, TaskEvent::Park) => next.status = S::Backlog,
            (
                S::Ready,
                TaskEvent::Claim {
                    holder,
                    lease_until,
                },
            ) => {
                next.status = S::InProgress;
                next.lease = Some(Lease {
                    holder: holder.clone(),
                    expires_at: *lease_until,
                });
            }
            (
                S::InProgress,
                TaskEvent::Renew {
                    holder,
                    lease_until,
                },
            ) => {
                self.check_holder(holder)?;
                next.lease = Some(Lease {
                    holder: holder.clone(),
                    expires_at: *lease_until,
                });
            }
            (S::InProgress, TaskEvent::RecordUsage { holder, usage }) => {
                self.check_holder(holder)?;
                next.metadata.usage = next.metadata.usage.plus(*usage);
            }
            (S::InProgress | S::Waiting, TaskEvent::AddChild { child }) => {
                if !next.metadata.children.iter().any(|c| &c.task == child) {
                    next.metadata.children.push(ChildTask {
                        task: child.clone(),
                        ended: None,
                        outcome: None,
                    });
                }
            }
            (S::InProgress, TaskEvent::Wait { holder }) => {
                self.check_holder(holder)?;
                next.lease = None;
                next.status = if self.all_children_ended() {
                    S::Ready
                } else {
                    S::Waiting
                };
            }
            // A child's end is recorded whatever the parent is doing, short of having ended: a
            // parent requeued after a crash (ready, claimed again later) keeps it, and its next
            // `Wait` finds the child ended instead of waiting for a notice that was already sent.
            (
                S::PendingApproval | S::Backlog | S::Ready | S::InProgress | S::Waiting,
                TaskEvent::ChildEnded {
                    child,
                    status,
                    outcome,
                },
            ) => {
                if !status.is_terminal() {
                    return Err(StoreError::Invalid(InvalidInput::new(
                        "child status",
                        format!("{status} is not terminal"),
                    )));
                }
                match next.metadata.children.iter_mut().find(|c| &c.task == child) {
                    Some(c) => {
                        c.ended = Some(*status);
                        c.outcome = Some(outcome.clone());
                    }
                    None => next.metadata.children.push(ChildTask {
                        task: child.clone(),
                        ended: Some(*status),
                        outcome: Some(outcome.clone()),
                    }),
                }
                if self.status == S::Waiting && next.all_children_ended() {
                    next.status = S::Ready;
                }
            }
            (S::Waiting, TaskEvent::Resume) => next.status = S::Ready,
            (S::InProgress, TaskEvent::Complete { holder, result }) => {
                self.check_holder(holder)?;
                next.status = S::Done;
                next.lease = None;
                next.result = Some(result.clone());
            }
            (S::InProgress, TaskEvent::Fail { holder, error }) => {
                self.check_holder(holder)?;
                next.fail_attempt(error.clone());
            }
            (S::InProgress, TaskEvent::GiveUp { holder, error }) => {
                self.check_holder(holder)?;
                next.attempts += 1;
                next.lease = None;
                next.error = Some(error.clone());
                next.status = S::Failed;
            }
            (S::InProgress, TaskEvent::ExpireLease) => {
                if !self.lease_expired(now) {
                    return Err(self.invalid(&event));
                }
                next.fail_attempt("lease expired: the worker stopped without finishing".into());
            }
            (S::InProgress, TaskEvent::Recover { holder }) => {
                self.check_holder(holder)?;
                next.lease = None;
                next.metadata.recoveries = next.metadata.recoveries.saturating_add(1);
                let n = next.metadata.recoveries;
                if n >= self.recovery_allowance() {
                    next.status = S::Failed;
                    next.error = Some(format!(
                        "the worker's process ended before the task finished, {n} times: \
                         given up (recovery allowance {})",
                        self.recovery_allowance()
                    ));
                } else {
                    next.status = S::Ready;
                    next.error = Some(
                        "the worker's process ended before the task finished; it runs again \
                         (not counted as a failed attempt)"
                            .into(),
                    );
                }
            }
            (s, TaskEvent::Cancel { reason }) if !s.is_terminal() => {
                next.status = S::Cancelled;
                next.lease = None;
                next.error = Some(reason.clone());
            }
            _ => return Err(self.invalid(&event)),
        }
        next.revision = self.revision + 1;
        next.updated_at = now;
        let notice = if next.status.is_terminal() && !self.status.is_terminal() {
            next.notice(now)
        } else {
            None
        };
        Ok(Transition { task: next, notice })
    }

    /// How many crash recoveries ([`TaskEvent::Recover`]) the task may go through before it
    /// fails for good: three times its attempts, at least 10. A crash between a claim and the
    /// model call uses up no attempt, but a task whose work ends its worker's process every time
    /// still ends.
    pub fn recovery_allowance(&self) -> u32 {
        self.max_attempts.saturating_mul(3).max(10)
    }

    fn fail_attempt(&mut self, error: String) {
        self.attempts += 1;
        self.lease = None;
        self.error = Some(error);
        self.status = if self.attempts >= self.max_attempts {
            TaskStatus::Failed
        } else {
            TaskStatus::Ready
        };
    }

    fn notice(&self, now: Timestamp) -> Option<CompletionNotice> {
        let delegated_by = self.metadata.delegated_by.clone()?;
        let outcome = match self.status {
            TaskStatus::Done => self.result.clone().unwrap_or_default(),
            _ => self.error.clone().unwrap_or_default(),
        };
        Some(CompletionNotice {
            key: format!("{}#{}:{}", self.agent, self.number, self.status),
            task: self.task_ref(),
            title: self.title.clone(),
            status: self.status,
            outcome,
            delegated_by,
            originating_channel: self.metadata.originating_channel.clone(),
            link_id: self.metadata.link_id.clone(),
            parent_task: self.metadata.parent_task.clone(),
            created_at: now,
        })
    }
}

/// Which tasks [`TaskStore::list`] returns. Empty fields match everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskFilter {
    /// Only these statuses.
    pub statuses: Vec<TaskStatus>,
    /// Only tasks delegated by this agent.
    pub delegated_by: Option<AgentId>,
    /// Only tasks with this `created_by`.
    pub created_by: Option<String>,
    /// At most this many (lowest numbers first).
    pub limit: Option<usize>,
}

impl TaskFilter {
    /// Whether `task` matches (ignoring `limit`).
    pub fn matches(&self, task: &Task) -> bool {
        (self.statuses.is_empty() || self.statuses.contains(&task.status))
            && self
                .delegated_by
                .as_ref()
                .is_none_or(|d| task.metadata.delegated_by.as_ref() == Some(d))
            && self
                .created_by
                .as_ref()
                .is_none_or(|c| &task.created_by == c)
    }
}

/// A guard for [`TaskStore::transition`]: the change applies only if the task still looks like this.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Expect {
    /// The status the caller saw.
    pub status: Option<TaskStatus>,
    /// The revision the caller saw.
    pub revision: Option<u64>,
}

impl Expect {
    /// No guard.
    pub fn any() -> Self {
        Self::default()
    }

    /// Checks `task` against the guard.
    pub fn check(&self, task: &Task) -> Result<(), StoreError> {
        let status_ok = self.status.is_none_or(|s| s == task.status);
        let rev_ok = self.revision.is_none_or(|r| r == task.revision);
        if status_ok && rev_ok {
            return Ok(());
        }
        Err(StoreError::Conflict {
            what: format!("task {}", task.task_ref()),
            expected: format!(
                "status {} revision {}",
                self.status
                    .map(|s| s.to_string())
                    .unwrap_or_else(|| "any".into()),
                self.revision
                    .map(|r| r.to_string())
                    .unwrap_or_else(|| "any".into())
            ),
            actual: format!("status {} revision {}", task.status, task.revision),
        })
    }
}

/// Storage of every agent's task board, with each board's completion outbox.
///
/// Tasks are addressed by `(agent, number)`; a backend may keep one file per agent (SQLite, redb) or
/// one database for all (PostgreSQL). No call spans two agents' boards.
///
/// # Contract
/// - `create` numbers tasks per agent from 1 without gaps under concurrency, validates with
///   [`NewTask::into_task`] (a refusal is [`StoreError::Invalid`] and uses no number) and returns
///   the stored task (revision 1).
/// - `create` with an [`idempotency_key`](NewTask::idempotency_key) already used on that agent's
///   board returns the task created the first time, as it is stored now, and changes nothing: no
///   second task, no new number, the rest of the input ignored (not even validated). Of
///   concurrent creates with one key exactly one creates the task; the others return it. Keys are
///   per agent (the same key on two boards makes two tasks), are kept as long as the board, and a
///   refused create does not use its key. Without a key, every create makes a new task.
/// - `get` of an absent task, or on a board that has no tasks yet, is `Ok(None)`.
/// - `list` returns matching tasks sorted by number; `limit` applies after the other filters and
///   keeps the lowest numbers.
/// - `transition` checks `expect` (else [`StoreError::Conflict`]), applies [`Task::apply`], and
///   writes the new task and its notice (if any) to the outbox in one atomic step; a refused event
///   (conflict, invalid transition, not the lease holder) writes nothing.
///   [`StoreError::NotFound`] if the task does not exist.
/// - `claim_next` atomically moves the ready task with the highest priority, then the lowest
///   number, to in_progress with a lease for `holder` until `now + lease`; two concurrent claims
///   never get the same task. `None` when nothing is ready.
/// - `requeue_expired` applies [`TaskEvent::ExpireLease`] to every in-progress task whose lease
///   expired at `now` (`expires_at <= now`, see [`Task::lease_expired`]; time is the `now`
///   argument, never the wall clock), writing notices for those that fail for good, and returns
///   them.
/// - `outbox_pending` lists unsent notices in the order they were written (not by timestamp or
///   task number); `outbox_mark_sent` removes (or marks) one by key and is idempotent: marking a
///   key again, or a key that was never written, succeeds and changes nothing.
///
/// The conformance suite (module `conformance`, feature `conformance`: `task_store_*`) checks every clause.
#[async_trait]
pub trait TaskStore: Send + Sync + fmt::Debug {
    /// Creates the next task on `agent`'s board.
    async fn create(
        &self,
        agent: &AgentId,
        task: NewTask,
        now: Timestamp,
    ) -> Result<Task, StoreError>;
    /// One task.
    async fn get(&self, agent: &AgentId, number: u64) -> Result<Option<Task>, StoreError>;
    /// Tasks matching `filter`, by number.
    async fn list(&self, agent: &AgentId, filter: &TaskFilter) -> Result<Vec<Task>, StoreError>;
    /// Applies `event` if `expect` holds, writing any notice atomically.
    async fn transition(
        &self,
        agent: &AgentId,
        number: u64,
        expect: Expect,
        event: TaskEvent,
        now: Timestamp,
    ) -> Result<Transition, StoreError>;
    /// Claims the next ready task for `holder`.
    async fn claim_next(
        &self,
        agent: &AgentId,
        holder: &str,
        lease: Duration,
        now: Timestamp,
    ) -> Result<Option<Task>, StoreError>;
    /// Returns expired leases to ready (or failed).
    async fn requeue_expired(
        &self,
        agent: &AgentId,
        now: Timestamp,
    ) -> Result<Vec<Transition>, StoreError>;
    /// Unsent completion notices, oldest first.
    async fn outbox_pending(&self, agent: &AgentId) -> Result<Vec<CompletionNotice>, StoreError>;
    /// Marks a notice as sent (idempotent).
    async fn outbox_mark_sent(&self, agent: &AgentId, key: &str) -> Result<(), StoreError>;

    /// Closes what backs this store, waiting for the operations in progress, and releases what it
    /// holds (a data directory's lock, a connection pool); later calls fail with
    /// [`StoreError::Backend`]. Closing one store of a backend closes the backend's every store;
    /// closing again does nothing. The default does nothing (stores that hold nothing to release).
    async fn release(&self) {}
}

/// A `dyn` task store.
pub type DynTaskStore = dyn TaskStore;

#[async_trait]
impl<T: TaskStore + ?Sized> TaskStore for std::sync::Arc<T> {
    async fn create(
        &self,
        agent: &AgentId,
        task: NewTask,
        now: Timestamp,
    ) -> Result<Task, StoreError> {
        (**self).create(agent, task, now).await
    }
    async fn get(&self, agent: &AgentId, number: u64) -> Result<Option<Task>, StoreError> {
        (**self).get(agent, number).await
    }
    async fn list(&self, agent: &AgentId, filter: &TaskFilter) -> Result<Vec<Task>, StoreError> {
        (**self).list(agent, filter).await
    }
    async fn transition(
        &self,
        agent: &AgentId,
        number: u64,
        expect: Expect,
        event: TaskEvent,
        now: Timestamp,
    ) -> Result<Transition, StoreError> {
        (**self).transition(agent, number, expect, event, now).await
    }
    async fn claim_next(
        &self,
        agent: &AgentId,
        holder: &str,
        lease: Duration,
        now: Timestamp,
    ) -> Result<Option<Task>, StoreError> {
        (**self).claim_next(agent, holder, lease, now).await
    }
    async fn requeue_expired(
        &self,
        agent: &AgentId,
        now: Timestamp,
    ) -> Result<Vec<Transition>, StoreError> {
        (**self).requeue_expired(agent, now).await
    }
    async fn outbox_pending(&self, agent: &AgentId) -> Result<Vec<CompletionNotice>, StoreError> {
        (**self).outbox_pending(agent).await
    }
    async fn outbox_mark_sent(&self, agent: &AgentId, key: &str) -> Result<(), StoreError> {
        (**self).outbox_mark_sent(agent, key).await
    }
    async fn release(&self) {
        (**self).release().await
    }
}

impl FromStr for TaskRef {
    type Err = InvalidInput;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (agent, n) = s.rsplit_once('#').ok_or_else(|| {
            InvalidInput::new(
                "task reference",
                format!("{s:?} is not of the form agent#number"),
            )
        })?;
        let number = n.parse().map_err(|_| {
            InvalidInput::new(
                "task reference",
                format!("{n:?} in {s:?} is not a task number"),
            )
        })?;
        Ok(TaskRef::new(AgentId::parse(agent)?, number))
    }
}
