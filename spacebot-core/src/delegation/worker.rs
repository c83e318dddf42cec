//! The worker: one task loop per running root agent. It requeues expired leases, flushes the
//! outbox, claims ready tasks up to the agent's task concurrency (each claim with its own holder
//! id) and runs them, through the agent's own queue or a custom executor; at start it recovers the
//! claims a stopped process left.

use std::sync::Arc;
use std::time::Duration;

use super::executor::spawn_attempt;
use super::{DEFAULT_LEASE, LEASE_CHECK_INTERVAL, TaskError, TaskExecutor, TaskOutcome};
use crate::envelope::{Envelope, EnvelopeKind, Source};
use crate::error::StoreError;
use crate::event::EventKind;
use crate::ids::{AgentId, ChannelId};
use crate::org::Organization;
use crate::runtime::behaviour::AgentWorker;
use crate::task::{Task, TaskEvent, TaskStatus};

/// The text a task is worked on with: its description, and the results of its children once they
/// ended (multi-hop resume).
pub fn task_input(task: &Task) -> String {
    let mut text = format!(
        "You have been assigned task #{}: {}\n\n{}",
        task.number, task.title, task.description
    );
    if let Some(by) = &task.metadata.delegated_by {
        text.push_str(&format!("\n\n(Delegated by {by}.)"));
    }
    let ended: Vec<_> = task
        .metadata
        .children
        .iter()
        .filter(|c| c.ended.is_some())
        .collect();
    if !ended.is_empty() {
        text.push_str("\n\nThe tasks you delegated have ended:");
        for child in ended {
            let status = child.ended.map(|s| s.to_string()).unwrap_or_default();
            text.push_str(&format!(
                "\n- {} ({status}): {}",
                child.task,
                child.outcome.as_deref().unwrap_or("")
            ));
        }
        text.push_str("\n\nFinish your task with these results.");
    }
    text
}

impl Organization {
    /// Wakes an agent's task loop.
    pub(crate) fn ring(&self, agent: &AgentId) {
        if let Some(crate::org::Slot::Running(rt)) = self.inner.slot(agent) {
            rt.ring();
        } else if self.inner.hosting.is_some() {
            // Hosted in another process (under a placement): a hint wakes its task loop there.
            let inner = self.inner.clone();
            let agent = agent.clone();
            let counted = self.inner.background.enter();
            self.inner.spawner.spawn(Box::pin(async move {
                inner.wake_elsewhere(&agent).await;
                drop(counted);
            }));
        }
    }
}

/// Whether `holder` names a claim of `agent`'s task loop (`{agent}:worker:{loop}:{n}[@process]`,
/// the holder ids the loop gives its claims).
pub(super) fn owns_claim(agent: &AgentId, holder: &str) -> bool {
    holder
        .strip_prefix(agent.as_str())
        .is_some_and(|rest| rest.starts_with(":worker:"))
}

/// The task loop of one agent: requeue expired leases, flush the outbox, claim ready tasks up to the
/// concurrency limit and hand them to the executor; sleep until rung or until the next lease check.
///
/// The steps it awaits are boxed, so the loop of an idle agent holds a small future instead of the
/// state of a notice delivery (about 5 KB), for every agent.
pub(super) async fn run_task_loop(
    org: Organization,
    agent: AgentWorker,
    mut doorbell: crate::runtime::behaviour::Doorbell,
    executor: Option<Arc<dyn TaskExecutor>>,
) {
    use futures::StreamExt;
    let inner = org.inner.clone();
    let me = agent.id().clone();
    let loop_id = uuid::Uuid::new_v4().simple().to_string();
    // Under a placement a claim names its process (after an `@`): the start-up recovery of the
    // agent's next host tells its own claims from others'.
    let process = inner
        .hosting
        .as_ref()
        .map(|h| format!("@{}", h.options.process))
        .unwrap_or_default();
    let mut claims: u64 = 0;
    // Holder ids are `{agent}:worker:...`: `owns_claim` tells them from other behaviours' claims.
    let limit = inner.settings.task_concurrency.max(1);
    // The agent is not idle while a round runs: the start-up recovery is the first.
    let ctx = org.behaviour_context();
    let mut round = Some(agent.round(&ctx));
    Box::pin(recover_orphaned_claims(&org, &me)).await;
    loop {
        if agent.is_stopping() {
            break;
        }
        let this_round = round.take().unwrap_or_else(|| agent.round(&ctx));
        match inner
            .stores
            .tasks
            .requeue_expired(&me, inner.clock.now())
            .await
        {
            Ok(transitions) => {
                let ended = transitions.iter().any(|t| t.notice.is_some());
                for t in &transitions {
                    org.report_transition(t);
                }
                if ended {
                    Box::pin(org.flush_outbox(&me)).await;
                }
            }
            Err(e) => crate::runtime::agent::report_error(
                &inner,
                &me,
                None,
                format!("expired leases not requeued: {e}"),
            ),
        }
        Box::pin(org.flush_outbox(&me)).await;
        Box::pin(free_stale_claims(&org, &agent)).await;
        while agent.running() < limit && !agent.is_stopping() {
            // Every claim gets its own holder id: a worker that outlived its lease cannot complete
            // the task once another attempt claimed it.
            claims += 1;
            let holder = format!("{me}:worker:{loop_id}:{claims}{process}");
            let claimed = inner
                .stores
                .tasks
                .claim_next(&me, &holder, DEFAULT_LEASE, inner.clock.now())
                .await;
            let task = match claimed {
                Ok(Some(task)) => task,
                Ok(None) => break,
                Err(e) => {
                    crate::runtime::agent::report_error(
                        &inner,
                        &me,
                        None,
                        format!("claim failed: {e}"),
                    );
                    break;
                }
            };
            let mut event = inner.event(
                &me,
                EventKind::TaskClaimed {
                    holder: holder.clone(),
                },
            );
            event.task = Some(task.task_ref());
            event.parent = task.metadata.parent_task.clone();
            inner.emit(event);
            agent.claim_started(task.number, &holder);
            match &executor {
                None => Box::pin(dispatch_to_queue(&org, &agent, &task, &holder)).await,
                Some(executor) => spawn_attempt(&org, &agent, executor, task, &holder),
            }
        }
        drop(this_round);
        let sleep = inner.clock.sleep(LEASE_CHECK_INTERVAL);
        let rung = doorbell.next();
        futures::pin_mut!(rung);
        if let futures::future::Either::Left((None, _)) = futures::future::select(rung, sleep).await
        {
            break;
        }
    }
}

/// At start, a task still in progress under a claim nobody in this process works on was left by a
/// worker that died with its process (a crash): that attempt fails now and the task is requeued
/// (or fails for good past its attempts), instead of waiting for its lease to run out.
///
/// Under a placement, a claim another process made (its holder names the process) is recovered
/// too: that process stopped the agent's loop and aborted its custom executor attempts before this
/// process could take the agent (the fencing rule of [`Placement`](crate::Placement)).
async fn recover_orphaned_claims(org: &Organization, me: &AgentId) {
    let filter = crate::task::TaskFilter {
        statuses: vec![TaskStatus::InProgress],
        ..Default::default()
    };
    let tasks = match org.inner.stores.tasks.list(me, &filter).await {
        Ok(tasks) => tasks,
        Err(e) => {
            crate::runtime::agent::report_error(
                &org.inner,
                me,
                None,
                format!("claims left by a stopped process not checked: {e}"),
            );
            return;
        }
    };
    for task in tasks {
        let Some(lease) = task.lease.clone() else {
            continue;
        };
        if org.inner.live_claim(&lease.holder) {
            continue;
        }
        let event = TaskEvent::Recover {
            holder: lease.holder,
        };
        if let Err(e) = org.task_transition(me, task.number, event).await {
            crate::runtime::agent::report_error(
                &org.inner,
                me,
                None,
                format!("claim of task {me}#{} not recovered: {e}", task.number),
            );
        }
    }
}

/// Frees the slots of claims that are over: a worker that never returns keeps running, but once
/// its lease expired and the task moved on, its claim no longer counts against the concurrency,
/// so the requeued task can run again.
async fn free_stale_claims(org: &Organization, agent: &AgentWorker) {
    let me = agent.id();
    for (number, holder) in agent.claims() {
        match org.inner.stores.tasks.get(me, number).await {
            Ok(Some(task))
                if task.status == TaskStatus::InProgress
                    && task.lease.as_ref().is_some_and(|l| l.holder == holder) => {}
            Ok(_) => agent.claim_ended(number, &holder),
            Err(e) => crate::runtime::agent::report_error(
                &org.inner,
                me,
                None,
                format!("claim of task {number} not checked: {e}"),
            ),
        }
    }
}

/// The delegation round a turn on `task` runs at: the round of the delegation that created it,
/// plus one for every child it delegated already, so a worker that re-delegates each time it
/// resumes reaches the round limit.
fn task_round(task: &Task) -> u32 {
    let children = u32::try_from(task.metadata.children.len()).unwrap_or(u32::MAX);
    task.metadata.round.saturating_add(children)
}

/// Hands a claimed task to the agent's own loop, as a task envelope in its queue.
async fn dispatch_to_queue(org: &Organization, agent: &AgentWorker, task: &Task, holder: &str) {
    let mut envelope = Envelope::new(
        Source::System,
        ChannelId::new(format!("task:{}", task.task_ref())),
        EnvelopeKind::TaskAssigned,
        task_input(task),
        org.inner.clock.now(),
    )
    .with_round(task_round(task));
    envelope.task = Some(crate::envelope::TaskWork {
        owner: "delegation".to_string(),
        number: task.number,
        holder: holder.to_string(),
        generation: u32::try_from(
            task.metadata
                .children
                .iter()
                .filter(|c| c.ended.is_some())
                .count(),
        )
        .unwrap_or(u32::MAX),
    });
    envelope.cause = task.metadata.cause.clone();
    if let Err(e) = org.inner.enqueue(agent.id(), envelope, true).await {
        // The agent is gone: give the attempt back.
        finish_task(org, agent, task.number, holder, Err(e.to_string().into())).await;
    }
}

/// Records the outcome of one attempt run through the agent's queue and frees its slot.
pub(super) async fn finish_task(
    org: &Organization,
    agent: &AgentWorker,
    number: u64,
    holder: &str,
    result: Result<TaskOutcome, TaskError>,
) {
    record_outcome(org, agent.id(), number, holder, result).await;
    agent.claim_ended(number, holder);
    agent.ring();
}

/// How many times a task's outcome write is tried again before the lease is left to expire.
const OUTCOME_ATTEMPTS: u32 = 20;

/// Records the outcome of one attempt: complete, wait or fail (requeue or fail for good).
pub(super) async fn record_outcome(
    org: &Organization,
    me: &AgentId,
    number: u64,
    holder: &str,
    result: Result<TaskOutcome, TaskError>,
) {
    let event = match result {
        Ok(TaskOutcome::Done(result)) => TaskEvent::Complete {
            holder: holder.to_string(),
            result,
        },
        Ok(TaskOutcome::Waiting) => TaskEvent::Wait {
            holder: holder.to_string(),
        },
        Err(TaskError::GiveUp(error)) => TaskEvent::GiveUp {
            holder: holder.to_string(),
            error,
        },
        Err(TaskError::Retry(error)) => TaskEvent::Fail {
            holder: holder.to_string(),
            error,
        },
    };
    // A failed write is tried again (the result is kept meanwhile); a claim that is over (the
    // lease expired and the task moved on, or another holder claimed it) is refused for good and
    // is not retried.
    let mut attempt = 0u32;
    loop {
        match org.task_transition(me, number, event.clone()).await {
            Ok(_) => return,
            Err(
                e @ (StoreError::InvalidTransition(_)
                | StoreError::NotFound { .. }
                | StoreError::NotLeaseHolder { .. }),
            ) => {
                crate::runtime::agent::report_error(
                    &org.inner,
                    me,
                    None,
                    format!("task {me}#{number} not updated: {e}"),
                );
                return;
            }
            Err(e) => {
                crate::runtime::agent::report_error(
                    &org.inner,
                    me,
                    None,
                    format!(
                        "task {me}#{number} not updated (attempt {}; retrying): {e}",
                        attempt + 1
                    ),
                );
                if attempt >= OUTCOME_ATTEMPTS {
                    return;
                }
                let wait = Duration::from_millis(50)
                    .saturating_mul(1u32 << attempt.min(7))
                    .min(Duration::from_secs(5));
                org.inner.clock.sleep(wait).await;
                attempt += 1;
            }
        }
    }
}
