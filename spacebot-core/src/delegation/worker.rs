//! The worker: one task loop per running root agent. It requeues expired leases, flushes the
//! outbox, claims ready tasks up to the agent's task concurrency (each claim with its own holder
//! id) and runs them, through the agent's own queue or a custom executor; at start it recovers the
//! claims a stopped process left.

use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

use super::executor::spawn_attempt;
use super::outbox::{flush_outbox, report_transition, task_transition};
use super::{DEFAULT_LEASE, LEASE_CHECK_INTERVAL, TaskError, TaskExecutor, TaskOutcome};
use crate::envelope::{Envelope, EnvelopeKind, Source};
use crate::error::StoreError;
use crate::event::EventKind;
use crate::ids::{AgentId, ChannelId};
use crate::runtime::behaviour::AgentWorker;
use crate::runtime::behaviour::BehaviourContext;
use crate::task::{Task, TaskEvent, TaskStatus};

/// What the `task_assigned` template gets for `task`: its number, title and description, who
/// delegated it, and the results of its children once they ended (multi-hop resume).
pub fn task_context(task: &Task) -> crate::prompts::TaskAssignedContext {
    crate::prompts::TaskAssignedContext {
        task_number: task.number,
        title: task.title.clone(),
        description: task.description.clone(),
        delegated_by: task.metadata.delegated_by.as_ref().map(|a| a.to_string()),
        ended_children: task
            .metadata
            .children
            .iter()
            .filter_map(|c| {
                Some(crate::prompts::EndedChild {
                    task: c.task.to_string(),
                    status: c.ended?.to_string(),
                    outcome: c.outcome.clone().unwrap_or_default(),
                })
            })
            .collect(),
    }
}

/// The text a task is worked on with: the `task_assigned` template of `prompts` (see
/// [`TaskAssignedContext`](crate::prompts::TaskAssignedContext)) rendered for `task`.
pub fn task_input(
    prompts: &crate::prompts::Prompts,
    task: &Task,
) -> Result<String, crate::prompts::PromptError> {
    prompts.render_task_assigned(&task_context(task))
}

/// [`task_input`] with the organization's prompts; an override that fails to render is reported
/// and the built-in template used instead, so a task always runs.
fn task_text(org: &BehaviourContext, task: &Task) -> String {
    task_input(org.prompts(), task).unwrap_or_else(|e| {
        org.report_error(
            &task.agent,
            None,
            format!("the task_assigned prompt failed to render, the built-in one is used: {e}"),
        );
        task_input(&crate::prompts::Prompts::new(), task)
            .unwrap_or_else(|_| format!("{}\n\n{}", task.title, task.description))
    })
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
    org: BehaviourContext,
    agent: AgentWorker,
    mut doorbell: crate::runtime::behaviour::Doorbell,
    executor: Option<Arc<dyn TaskExecutor>>,
) {
    use futures::StreamExt;
    let me = agent.id().clone();
    let loop_id = uuid::Uuid::new_v4().simple().to_string();
    // Under a placement a claim names its process (after an `@`): the start-up recovery of the
    // agent's next host tells its own claims from others'.
    let process = org.process().map(|p| format!("@{p}")).unwrap_or_default();
    let mut claims: u64 = 0;
    // Holder ids are `{agent}:worker:...`: `owns_claim` tells them from other behaviours' claims.
    let limit = org.settings().task_concurrency.max(1);
    // The agent is not idle while a round runs: the start-up recovery is the first.
    let mut round = Some(agent.round(&org));
    Box::pin(recover_orphaned_claims(&org, &me)).await;
    loop {
        if agent.is_stopping() {
            break;
        }
        let this_round = round.take().unwrap_or_else(|| agent.round(&org));
        match org
            .stores()
            .tasks
            .requeue_expired(&me, org.clock().now())
            .await
        {
            Ok(transitions) => {
                let ended = transitions.iter().any(|t| t.notice.is_some());
                for t in &transitions {
                    report_transition(&org, t);
                }
                if ended {
                    Box::pin(flush_outbox(&org, &me)).await;
                }
            }
            Err(e) => org.report_error(&me, None, format!("expired leases not requeued: {e}")),
        }
        Box::pin(flush_outbox(&org, &me)).await;
        Box::pin(free_stale_claims(&org, &agent)).await;
        while agent.running() < limit && !agent.is_stopping() {
            // Every claim gets its own holder id: a worker that outlived its lease cannot complete
            // the task once another attempt claimed it.
            claims += 1;
            let holder = format!("{me}:worker:{loop_id}:{claims}{process}");
            let claimed = org
                .stores()
                .tasks
                .claim_next(&me, &holder, DEFAULT_LEASE, org.clock().now())
                .await;
            let task = match claimed {
                Ok(Some(task)) => task,
                Ok(None) => break,
                Err(e) => {
                    org.report_error(&me, None, format!("claim failed: {e}"));
                    break;
                }
            };
            let mut event = org.event(
                &me,
                EventKind::TaskClaimed {
                    holder: holder.clone(),
                },
            );
            event.task = Some(task.task_ref());
            event.parent = task.metadata.parent_task.clone();
            event.request = task.metadata.cause.clone();
            org.emit_event(event);
            agent.claim_started(task.number, &holder);
            let span = crate::telemetry::step(
                "spacebot.task.claim",
                &task.task_ref(),
                task.metadata.trace_context.as_deref(),
            );
            match &executor {
                None => {
                    Box::pin(dispatch_to_queue(&org, &agent, &task, &holder))
                        .instrument(span)
                        .await
                }
                Some(executor) => {
                    span.in_scope(|| spawn_attempt(&org, &agent, executor, task, &holder))
                }
            }
        }
        drop(this_round);
        let sleep = org.clock().sleep(LEASE_CHECK_INTERVAL);
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
async fn recover_orphaned_claims(org: &BehaviourContext, me: &AgentId) {
    let filter = crate::task::TaskFilter {
        statuses: vec![TaskStatus::InProgress],
        ..Default::default()
    };
    let tasks = match org.stores().tasks.list(me, &filter).await {
        Ok(tasks) => tasks,
        Err(e) => {
            org.report_error(
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
        if org.state::<super::local::Local>().is_live(&lease.holder) {
            continue;
        }
        let event = TaskEvent::Recover {
            holder: lease.holder,
        };
        if let Err(e) = task_transition(org, me, task.number, event).await {
            org.report_error(
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
async fn free_stale_claims(org: &BehaviourContext, agent: &AgentWorker) {
    let me = agent.id();
    for (number, holder) in agent.claims() {
        match org.stores().tasks.get(me, number).await {
            Ok(Some(task))
                if task.status == TaskStatus::InProgress
                    && task.lease.as_ref().is_some_and(|l| l.holder == holder) => {}
            Ok(_) => agent.claim_ended(number, &holder),
            Err(e) => {
                org.report_error(me, None, format!("claim of task {number} not checked: {e}"))
            }
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
async fn dispatch_to_queue(org: &BehaviourContext, agent: &AgentWorker, task: &Task, holder: &str) {
    let mut envelope = Envelope::new(
        Source::System,
        ChannelId::new(format!("task:{}", task.task_ref())),
        EnvelopeKind::TaskAssigned,
        task_text(org, task),
        org.clock().now(),
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
    // Not stored first: the claim is the record (a claim lost with the process is recovered at
    // the next start of the task loop).
    if let Err(e) = org.enqueue_claimed(agent.id(), envelope).await {
        // The agent is gone: give the attempt back.
        finish_task(org, agent, task.number, holder, Err(e.to_string().into())).await;
    }
}

/// Records the outcome of one attempt run through the agent's queue and frees its slot.
pub(super) async fn finish_task(
    org: &BehaviourContext,
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
    org: &BehaviourContext,
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
    let span = crate::telemetry::step(
        "spacebot.task.complete",
        &crate::ids::TaskRef::new(me.clone(), number),
        None,
    );
    record_transition(org, me, number, event)
        .instrument(span)
        .await;
}

/// [`record_outcome`]'s writes, tried again while the store fails.
async fn record_transition(org: &BehaviourContext, me: &AgentId, number: u64, event: TaskEvent) {
    // A failed write is tried again (the result is kept meanwhile); a claim that is over (the
    // lease expired and the task moved on, or another holder claimed it) is refused for good and
    // is not retried.
    let mut attempt = 0u32;
    loop {
        match task_transition(org, me, number, event.clone()).await {
            Ok(t) => {
                let span = tracing::Span::current();
                span.record(
                    "spacebot.task.status",
                    tracing::field::display(t.task.status),
                );
                span.record("spacebot.task.attempts", i64::from(t.task.attempts));
                return;
            }
            Err(
                e @ (StoreError::InvalidTransition(_)
                | StoreError::NotFound { .. }
                | StoreError::NotLeaseHolder { .. }),
            ) => {
                org.report_error(me, None, format!("task {me}#{number} not updated: {e}"));
                return;
            }
            Err(e) => {
                org.report_error(
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
                org.clock()
                    .sleep(wait)
                    .instrument(crate::telemetry::store_retry(
                        "updating a task",
                        attempt + 1,
                        wait,
                    ))
                    .await;
                attempt += 1;
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn claims_of_the_task_loop_are_told_from_other_behaviours_claims() {
        let b = AgentId::parse("b").unwrap();
        assert!(owns_claim(&b, "b:worker:0a1b:3"));
        assert!(owns_claim(&b, "b:worker:0a1b:3@web-1"));
        assert!(!owns_claim(&b, "b:schedule:tick-7"), "another behaviour's");
        assert!(!owns_claim(&b, "bob:worker:0a1b:3"), "another agent's");
        assert!(!owns_claim(&b, ""));
    }

    #[test]
    fn a_resumed_task_shows_its_children_results_and_counts_their_rounds() {
        let mut task = Task {
            agent: AgentId::parse("b").unwrap(),
            number: 1,
            title: "Find a word.".into(),
            description: "Find a word.".into(),
            status: TaskStatus::Ready,
            priority: crate::task::Priority::Medium,
            created_by: "agent:a".into(),
            metadata: crate::task::TaskMetadata::default(),
            attempts: 0,
            max_attempts: 3,
            lease: None,
            revision: 0,
            result: None,
            error: None,
            created_at: crate::time::Timestamp(0),
            updated_at: crate::time::Timestamp(0),
        };
        task.metadata.delegated_by = Some(AgentId::parse("a").unwrap());
        task.metadata.round = 2;
        assert_eq!(
            task_input(&crate::prompts::Prompts::new(), &task).unwrap(),
            "You have been assigned task #1: Find a word.\n\nFind a word.\n\n(Delegated by a.)"
        );
        assert_eq!(task_round(&task), 2);
        let child = |n: u64, ended: Option<TaskStatus>| crate::task::ChildTask {
            task: crate::ids::TaskRef::new(AgentId::parse("c").unwrap(), n),
            ended,
            outcome: ended.map(|_| format!("word {n}")),
        };
        task.metadata.children = vec![child(1, Some(TaskStatus::Done)), child(2, None)];
        let text = task_input(&crate::prompts::Prompts::new(), &task).unwrap();
        assert!(
            text.ends_with(
                "The tasks you delegated have ended:\n- c#1 (done): word 1\n\nFinish your task with these results."
            ),
            "{text}"
        );
        assert!(!text.contains("c#2"), "a child still running is not shown");
        assert_eq!(task_round(&task), 4, "one round per child delegated");
    }
}

#[cfg(all(test, feature = "testing", feature = "tokio"))]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod loop_tests {
    use super::super::testkit::{Attempts, claim, harness, harness_with, id, origin, wait_status};
    use super::*;

    #[tokio::test]
    async fn a_claimed_task_runs_as_a_turn_of_the_agent_and_completes_with_its_answer() {
        let (h, llm) = harness("").await;
        llm.push_text(&id("b"), "nebula");
        h.org
            .delegate(&id("a"), "b", "Pick a random word.", origin())
            .await
            .unwrap();
        h.org.start_agent(&id("b")).await.unwrap();
        let done = wait_status(&h, "b", 1, TaskStatus::Done).await;
        assert_eq!(done.result.as_deref(), Some("nebula"));
        assert_eq!(done.attempts, 0);
        assert!(done.lease.is_none());
        // The model saw the task as its input.
        let requests = llm.requests_for(&id("b"));
        assert_eq!(requests.len(), 1);
        assert_eq!(
            crate::testing::last_user_text(&requests[0].messages),
            task_input(&crate::prompts::Prompts::new(), &done).unwrap()
        );
        // The claim carried a holder id of the task loop's own.
        let holders: Vec<String> = h
            .events
            .kinds()
            .into_iter()
            .filter_map(|k| match k {
                EventKind::TaskClaimed { holder } => Some(holder),
                _ => None,
            })
            .collect();
        assert_eq!(holders.len(), 1, "{holders:?}");
        assert!(owns_claim(&id("b"), &holders[0]), "{holders:?}");
    }

    #[tokio::test]
    async fn a_failing_attempt_is_requeued_until_the_attempts_are_spent_then_fails() {
        let failing = Attempts::new(|n| Some(Err(TaskError::Retry(format!("boom {n}")))));
        let (h, _llm) = harness_with("", vec![("b", failing.clone())]).await;
        h.org
            .delegate(&id("a"), "b", "Pick a random word.", origin())
            .await
            .unwrap();
        h.org.start_agent(&id("b")).await.unwrap();
        let failed = wait_status(&h, "b", 1, TaskStatus::Failed).await;
        assert_eq!((failed.attempts, failed.max_attempts), (3, 3));
        assert_eq!(failing.calls(), 3);
        assert!(
            failed.error.as_deref().unwrap_or("").contains("boom 3"),
            "{failed:?}"
        );
        assert_eq!(h.count(|k| matches!(k, EventKind::TaskRequeued { .. })), 2);
        assert_eq!(h.count(|k| matches!(k, EventKind::TaskFailed { .. })), 1);
    }

    #[tokio::test]
    async fn a_claim_left_by_a_stopped_process_is_recovered_without_using_an_attempt() {
        let (h, llm) = harness("").await;
        llm.push_text(&id("b"), "nebula");
        h.org
            .delegate(&id("a"), "b", "Pick a random word.", origin())
            .await
            .unwrap();
        // A worker of an earlier process claimed it, then its process ended.
        claim(&h, "b", "b:worker:gone:1").await;
        h.org.start_agent(&id("b")).await.unwrap();
        let done = wait_status(&h, "b", 1, TaskStatus::Done).await;
        assert_eq!(done.result.as_deref(), Some("nebula"));
        assert_eq!(done.attempts, 0, "a recovery uses no attempt");
        assert_eq!(done.metadata.recoveries, 1);
    }

    #[tokio::test]
    async fn an_expired_lease_requeues_the_task_and_frees_the_hung_worker_slot() {
        // The first attempt never returns; the second completes.
        let hanging = Attempts::new(|n| (n > 1).then(|| Ok(TaskOutcome::Done(format!("try {n}")))));
        let (h, _llm) = harness_with("", vec![("b", hanging.clone())]).await;
        h.org
            .delegate(&id("a"), "b", "Pick a random word.", origin())
            .await
            .unwrap();
        h.org.start_agent(&id("b")).await.unwrap();
        h.wait_until("the first attempt", || async { hanging.calls() == 1 })
            .await;
        h.manual_clock()
            .advance(DEFAULT_LEASE + LEASE_CHECK_INTERVAL);
        let done = wait_status(&h, "b", 1, TaskStatus::Done).await;
        assert_eq!(done.result.as_deref(), Some("try 2"));
        assert_eq!(done.attempts, 1, "the expired attempt counts");
        assert_eq!(hanging.calls(), 2);
    }
}
