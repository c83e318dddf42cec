//! The [`TaskStore`] trait, its list filter and its transition guard.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;

use super::{CompletionNotice, NewTask, Task, TaskEvent, TaskStatus, Transition};
use crate::error::{InvalidInput, StoreError};
use crate::ids::{AgentId, TaskRef};
use crate::time::Timestamp;

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
