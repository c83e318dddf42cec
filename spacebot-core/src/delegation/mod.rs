//! Delegation (seed 001): work handed from one agent to another as a durable task.
//!
//! 1. [`Organization::delegate`](crate::Organization::delegate) (the `send_agent_message` tool)
//!    checks the link, its direction, the chain (no cycles, a depth limit) and the approval policy,
//!    creates the task on the **target's** board, writes "A assigned task #N to B: title" to both
//!    link channels, and ends the delegator's turn.
//! 2. The target's ready-task loop claims the task (compare-and-swap with a lease) and runs its
//!    [`TaskExecutor`]: by default the agent's own tool loop, through its queue, so a task never runs
//!    beside another turn of the same agent.
//! 3. Success completes the task with its result; an error requeues it until `max_attempts`, then
//!    fails it; a worker that dies leaves a lease that expires and requeues the task.
//! 4. The terminal transition writes a [`CompletionNotice`](crate::task::CompletionNotice) to
//!    the target's outbox in the same step. The outbox is delivered to the delegator at least once
//!    and applied exactly once (idempotency key): a passive record in both link channels and a
//!    system retrigger into the delegator's originating channel, which wakes its model with the
//!    result. When the delegator was itself working on a task (multi-hop), the notice instead marks
//!    the child ended on that task; when its last child ends, the task is ready again and resumes
//!    with the children's results.
//!
//! The module is split by concern:
//!
//! | file | concern |
//! |------|---------|
//! | `admission.rs` | the policy-checked creation of a task: [`Organization::delegate`](crate::Organization::delegate) (link, cycle, depth, rounds, idempotency key) |
//! | `local.rs` | what delegation keeps in this process only (live claims, executor attempts, outbox gates) |
//! | `worker.rs` | the per-agent task loop: claims, leases, outcomes, recovery of claims a stopped process left |
//! | `outbox.rs` | completion notices: the transitions that end a task, the outbox flush, marking notices sent |
//! | `executor.rs` | [`TaskExecutor`] and the attempts of custom executors |
//! | `tools.rs` | the tools: [`SendAgentMessage`], [`TaskCreate`], [`TaskList`], [`TaskUpdate`] |
//! | `mod.rs` | [`Delegation`], the [`Behaviour`] that plugs them into the runtime |
//!
//! See `docs/delegation.md`.

mod admission;
mod executor;
mod local;
mod outbox;
mod tools;
mod worker;

#[cfg(all(test, feature = "testing", feature = "tokio"))]
mod testkit;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::envelope::{Envelope, TaskWork};
use crate::error::StoreError;
use crate::ids::{AgentId, TaskRef};
use crate::runtime::agent::TurnOutcome;
use crate::runtime::behaviour::{AgentWorker, Behaviour, BehaviourContext};
use crate::task::{TaskEvent, TaskStatus};
use crate::tools::Tool;

pub use admission::{DelegationError, DelegationOrigin, title_from};
pub use executor::{TaskContext, TaskError, TaskExecutor, TaskOutcome};
pub use tools::{
    SendAgentMessage, SendAgentMessageArgs, TaskCreate, TaskCreateArgs, TaskList, TaskListArgs,
    TaskUpdate, TaskUpdateArgs,
};
pub use worker::{task_context, task_input};

/// How long a claim lasts before the task goes back to ready. A task run as a turn of the agent's
/// tool loop renews its lease at every checkpoint (after each tool round), so only a single model
/// call or tool round longer than this loses it. A worker whose lease expired loses the task: it is
/// requeued (one attempt used), and the late worker's next renewal or result is refused, since every
/// claim has its own holder id.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(600);
/// How often (by the organization's clock) each task loop looks for expired leases.
pub const LEASE_CHECK_INTERVAL: Duration = Duration::from_secs(30);
/// Longest part of a result quoted in a retrigger; the full result stays on the task.
pub const RETRIGGER_RESULT_CHARS: usize = 2_000;

/// Delegation as a [`Behaviour`]: the `send_agent_message` and board tools, a task loop per root
/// agent (claims, leases, the completion outbox), and the outcome of task turns.
#[derive(Debug, Default)]
pub struct Delegation {
    executors: HashMap<AgentId, Arc<dyn TaskExecutor>>,
}

impl Delegation {
    /// Delegation whose tasks run as turns of each agent's own tool loop, except for the agents
    /// in `executors`, whose tasks run with their executor.
    pub fn new(executors: HashMap<AgentId, Arc<dyn TaskExecutor>>) -> Self {
        Self { executors }
    }
}

#[async_trait]
impl Behaviour for Delegation {
    fn name(&self) -> &'static str {
        "delegation"
    }

    fn tools(&self) -> Vec<Arc<dyn Tool>> {
        tools::builtin_tools()
    }

    fn on_agent_started(&self, ctx: &BehaviourContext, agent: AgentWorker) {
        if agent.is_child() {
            return;
        }
        let Some(doorbell) = agent.take_doorbell(self.name()) else {
            return;
        };
        let executor = self.executors.get(agent.id()).cloned();
        ctx.spawn(worker::run_task_loop(
            ctx.clone(),
            agent,
            doorbell,
            executor,
        ));
    }

    fn on_agent_handed_over(&self, ctx: &BehaviourContext, agent: &AgentId) {
        ctx.state::<local::Local>().abort_attempts(agent);
    }

    fn owns_answer(&self, _agent: &AgentId, envelope: &Envelope) -> bool {
        // A claimed task's answer is its result (the host routes it to `work_ended`); a task
        // handed over unclaimed (a child's) is answered where it came from.
        envelope
            .task
            .as_ref()
            .is_some_and(|w| w.owner == self.name())
    }

    fn work_key(&self, work: &TaskWork) -> String {
        // The key base of effects since before owners existed: a turn run again after an upgrade
        // asks for the same effects under the same keys.
        format!("task{}g{}", work.number, work.generation)
    }

    async fn exchange_open(
        &self,
        ctx: &BehaviourContext,
        from: &AgentId,
        to: &AgentId,
    ) -> Result<bool, StoreError> {
        let filter = crate::task::TaskFilter {
            statuses: vec![
                TaskStatus::PendingApproval,
                TaskStatus::Backlog,
                TaskStatus::Ready,
                TaskStatus::InProgress,
                TaskStatus::Waiting,
            ],
            delegated_by: Some(to.clone()),
            created_by: None,
            limit: Some(1),
        };
        Ok(!ctx.stores().tasks.list(from, &filter).await?.is_empty())
    }

    async fn claim_valid(
        &self,
        ctx: &BehaviourContext,
        agent: &AgentId,
        work: &TaskWork,
    ) -> Result<bool, StoreError> {
        // A holder that is not this agent's task loop is no claim of ours to run.
        if !worker::owns_claim(agent, &work.holder) {
            return Ok(false);
        }
        // Only a claim this process's task loop made is worked on: the envelope of a claim made
        // before a restart is handed over again, but that attempt is over (the task loop fails it
        // and claims the task anew), and a turn run for it would race the new attempt.
        let ours = ctx.worker(agent).is_some_and(|worker| {
            worker
                .claims()
                .iter()
                .any(|(number, holder)| *number == work.number && holder == &work.holder)
        });
        if !ours {
            return Ok(false);
        }
        ctx.stores()
            .tasks
            .get(agent, work.number)
            .await
            .map(|task| {
                task.is_some_and(|t| {
                    t.status == TaskStatus::InProgress
                        && t.lease.as_ref().is_some_and(|l| l.holder == work.holder)
                })
            })
    }

    async fn checkpoint(
        &self,
        ctx: &BehaviourContext,
        agent: &AgentId,
        work: &TaskWork,
    ) -> Result<(), StoreError> {
        executor::renew(ctx, &TaskRef::new(agent.clone(), work.number), &work.holder).await
    }

    async fn work_ended(
        &self,
        ctx: &BehaviourContext,
        agent: &AgentWorker,
        work: &TaskWork,
        outcome: &Result<TurnOutcome, crate::runtime::WorkFailure>,
        usage: crate::llm::Usage,
    ) {
        if !usage.is_zero() {
            let event = TaskEvent::RecordUsage {
                holder: work.holder.clone(),
                usage,
            };
            if let Err(e) = outbox::task_transition(ctx, agent.id(), work.number, event).await {
                ctx.report_error(
                    agent.id(),
                    None,
                    format!(
                        "usage of task {}#{} not recorded: {e}",
                        agent.id(),
                        work.number
                    ),
                );
            }
        }
        let result = match outcome {
            Ok(TurnOutcome::Answer(text)) => Ok(TaskOutcome::Done(text.clone())),
            Ok(TurnOutcome::Ended(_)) => Ok(TaskOutcome::Waiting),
            // A request that reached its limit fails its open tasks now: another attempt would
            // be refused the same way.
            Err(e) if e.permanent => Err(TaskError::GiveUp(e.reason.clone())),
            Err(e) => Err(TaskError::Retry(e.reason.clone())),
        };
        worker::finish_task(ctx, agent, work.number, &work.holder, result).await;
    }
}
