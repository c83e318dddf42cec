//! The lifecycle table as one pure function: [`Task::apply`].

use super::{ChildTask, CompletionNotice, Lease, Task, TaskEvent, TaskStatus, Transition};
use crate::error::{InvalidInput, InvalidTransition, StoreError};
use crate::ids::TaskRef;
use crate::time::Timestamp;

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
