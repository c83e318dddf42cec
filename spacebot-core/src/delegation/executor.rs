//! Custom executors: the [`TaskExecutor`] trait, what it gets and reports, and the attempts of a
//! custom executor, run beside the task loop.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;

use super::DEFAULT_LEASE;
use super::worker::record_outcome;
use crate::error::StoreError;
use crate::ids::TaskRef;
use crate::org::Organization;
use crate::runtime::behaviour::{AgentWorker, BehaviourContext};
use crate::task::{Expect, Task, TaskEvent};

/// What a [`TaskExecutor`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TaskOutcome {
    /// Finished with this result.
    Done(String),
    /// The work was delegated further; the task waits for its children.
    Waiting,
}

/// What a task executor gets.
#[derive(Debug, Clone)]
pub struct TaskContext {
    /// The organization.
    pub org: Organization,
    /// The worker's lease holder id (needed to complete or fail).
    pub holder: String,
    /// The task being run.
    pub task: TaskRef,
}

impl TaskContext {
    /// Renews this claim's lease for another [`DEFAULT_LEASE`]: an executor that works longer
    /// than the lease calls it now and then so its task is not requeued under it. Fails with
    /// [`StoreError::InvalidTransition`] once the claim is over.
    pub async fn renew(&self) -> Result<(), StoreError> {
        renew(&self.org.behaviour_context(), &self.task, &self.holder).await
    }
}

/// Renews the claim `holder` of `task` for another [`DEFAULT_LEASE`] (see
/// [`TaskContext::renew`]).
pub(super) async fn renew(
    org: &BehaviourContext,
    task: &TaskRef,
    holder: &str,
) -> Result<(), StoreError> {
    let now = org.clock().now();
    org.stores()
        .tasks
        .transition(
            &task.agent,
            task.number,
            Expect::any(),
            TaskEvent::Renew {
                holder: holder.to_string(),
                lease_until: now.plus(DEFAULT_LEASE),
            },
            now,
        )
        .await
        .map(|_| ())
}

/// Runs a claimed task. The default is the agent's own tool loop (the task goes through the agent's
/// queue); applications may plug deterministic code per agent with
/// [`OrganizationBuilder::task_executor`](crate::org_builder::OrganizationBuilder::task_executor).
///
/// # Contract
/// - `execute` returns the outcome or an error; the runtime completes, parks (`Waiting`) or fails the
///   task accordingly. An error is an attempt that failed: the task is requeued until its
///   `max_attempts`, then fails.
/// - Several tasks of one agent may execute concurrently, up to the agent's task concurrency.
#[async_trait]
pub trait TaskExecutor: Send + Sync + fmt::Debug {
    /// Runs the task.
    async fn execute(&self, ctx: TaskContext, task: Task) -> Result<TaskOutcome, TaskError>;
}

/// Why a [`TaskExecutor`] attempt failed, and whether trying again can help.
///
/// A `String` converts into [`TaskError::Retry`], so `Err(format!(...).into())` keeps the old
/// behaviour.
///
/// ```
/// use spacebot_core::delegation::TaskError;
/// let e: TaskError = "timeout".to_string().into();
/// assert_eq!(e, TaskError::Retry("timeout".into()));
/// assert!(TaskError::GiveUp("bad input".into()).to_string().contains("bad input"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TaskError {
    /// The attempt failed; the task is requeued until its `max_attempts`, then fails.
    #[error("{0}")]
    Retry(String),
    /// Retrying cannot help (bad input, a permanent refusal): the task fails now.
    #[error("{0} (not retried)")]
    GiveUp(String),
}

impl From<String> for TaskError {
    fn from(error: String) -> Self {
        Self::Retry(error)
    }
}

impl From<&str> for TaskError {
    fn from(error: &str) -> Self {
        Self::Retry(error.to_string())
    }
}

/// Runs one attempt of a custom executor on a claimed task, beside the task loop: records its
/// outcome, then frees the agent's slot. The attempt is registered with the agent so a hand-over
/// aborts it (its guards dropped).
pub(super) fn spawn_attempt(
    org: &BehaviourContext,
    agent: &AgentWorker,
    executor: &Arc<dyn TaskExecutor>,
    task: Task,
    holder: &str,
) {
    let holder = holder.to_string();
    let ctx = TaskContext::new(org, holder.clone(), task.task_ref());
    let executor = executor.clone();
    let org2 = org.clone();
    let holder2 = holder.clone();
    // Gives the slot back however the executor ends, a panic included; the lease
    // of a crashed attempt then expires and the task is requeued.
    let slot = SlotGuard(agent.clone(), task.number, holder.clone());
    let local = org.state::<super::local::Local>();
    let live = local.live(&holder);
    // Aborted (with its guards dropped) when the agent is handed over.
    let (attempt, registration) = futures::future::AbortHandle::new_pair();
    local.attempt_started(agent.id(), &holder, attempt);
    let run = async move {
        let number = task.number;
        let result = executor.execute(ctx, task).await;
        record_outcome(&org2, slot.0.id(), number, &holder2, result).await;
        local.attempt_ended(slot.0.id(), &holder2);
        drop(slot);
        drop(live);
    };
    org.spawn_on_runtime(async move {
        let _ = futures::future::Abortable::new(run, registration).await;
    });
}

/// Frees one task slot of an agent when dropped, and wakes its task loop.
struct SlotGuard(AgentWorker, u64, String);

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.0.claim_ended(self.1, &self.2);
        self.0.ring();
    }
}

#[cfg(all(test, feature = "testing", feature = "tokio"))]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use std::time::Duration;

    use super::super::testkit::{Attempts, claim, harness, harness_with, id, origin, wait_status};
    use super::*;
    use crate::event::EventKind;
    use crate::task::TaskStatus;

    #[tokio::test]
    async fn a_custom_executor_completes_the_task_with_its_result() {
        let done = Attempts::new(|_| Some(Ok(TaskOutcome::Done("42".into()))));
        let (h, llm) = harness_with("", vec![("b", done.clone())]).await;
        h.org
            .delegate(&id("a"), "b", "Compute the answer.", origin())
            .await
            .unwrap();
        h.org.start_agent(&id("b")).await.unwrap();
        let task = wait_status(&h, "b", 1, TaskStatus::Done).await;
        assert_eq!(task.result.as_deref(), Some("42"));
        assert_eq!(done.calls(), 1);
        assert!(llm.requests_for(&id("b")).is_empty(), "b's model not used");
        assert_eq!(h.count(|k| matches!(k, EventKind::TaskCompleted)), 1);
    }

    #[tokio::test]
    async fn an_executor_that_gives_up_fails_the_task_at_once() {
        let give_up = Attempts::new(|_| Some(Err(TaskError::GiveUp("bad input".into()))));
        let (h, _llm) = harness_with("", vec![("b", give_up.clone())]).await;
        h.org
            .delegate(&id("a"), "b", "Compute the answer.", origin())
            .await
            .unwrap();
        h.org.start_agent(&id("b")).await.unwrap();
        let task = wait_status(&h, "b", 1, TaskStatus::Failed).await;
        assert_eq!(give_up.calls(), 1, "not retried");
        assert!(
            task.error.as_deref().unwrap_or("").contains("bad input"),
            "{task:?}"
        );
        assert_eq!(h.count(|k| matches!(k, EventKind::TaskRequeued { .. })), 0);
    }

    #[tokio::test]
    async fn renew_extends_the_lease_of_its_own_claim_only_while_it_lasts() {
        let (h, _llm) = harness("").await;
        h.org
            .delegate(&id("a"), "b", "Compute the answer.", origin())
            .await
            .unwrap();
        let task = claim(&h, "b", "b:worker:t:1").await;
        let ctx = TaskContext {
            org: h.org.clone(),
            holder: "b:worker:t:1".into(),
            task: task.task_ref(),
        };
        h.manual_clock().advance(Duration::from_secs(300));
        ctx.renew().await.unwrap();
        let renewed = h.stores.tasks.get(&id("b"), 1).await.unwrap().unwrap();
        let until = renewed.lease.expect("still claimed").expires_at;
        assert_eq!(until, h.org.clock().now().plus(DEFAULT_LEASE));
        // Another holder cannot renew it.
        let stranger = TaskContext {
            holder: "b:worker:t:2".into(),
            ..ctx.clone()
        };
        assert!(matches!(
            stranger.renew().await,
            Err(StoreError::NotLeaseHolder { .. })
        ));
        // Once the claim is over, renewing fails.
        let complete = TaskEvent::Complete {
            holder: "b:worker:t:1".into(),
            result: "42".into(),
        };
        h.org.task_transition(&id("b"), 1, complete).await.unwrap();
        assert!(matches!(
            ctx.renew().await,
            Err(StoreError::InvalidTransition(_))
        ));
    }
}
