//! The completion outbox: transitions applied for the runtime (reported as events), and the
//! delivery of the completion notices a terminal transition wrote to the target's outbox.
//!
//! A notice is delivered at least once (it stays in the outbox until it is handed over and marked
//! sent; every task loop iteration flushes the outbox again) and applied exactly once: its link
//! records are keyed, and its retrigger carries the notice key as its idempotency key.

use std::time::Duration;
use tracing::Instrument;

use super::RETRIGGER_RESULT_CHARS;
use crate::channel::{NewRecord, RecordKind};
use crate::envelope::{Envelope, EnvelopeKind, Source};
use crate::error::StoreError;
use crate::event::EventKind;
use crate::ids::{AgentId, ChannelId, EnvelopeId};
use crate::org::Organization;
use crate::runtime::behaviour::BehaviourContext;
use crate::task::{
    CompletionNotice, Expect, Task, TaskEvent, TaskStatus, Transition, truncate_chars,
};

impl Organization {
    /// Applies a transition from the runtime and reports it: events, and the outbox flush when the
    /// task ended.
    pub(crate) async fn task_transition(
        &self,
        agent: &AgentId,
        number: u64,
        event: TaskEvent,
    ) -> Result<Transition, StoreError> {
        task_transition(&self.behaviour_context(), agent, number, event).await
    }

    /// Delivers every unsent completion notice in `agent`'s outbox, marking each sent once it was
    /// handed over. A failure leaves the notice in the outbox for the next flush.
    pub async fn flush_outbox(&self, agent: &AgentId) {
        flush_outbox(&self.behaviour_context(), agent).await;
    }
}

/// Applies a transition from the runtime and reports it: events, and the outbox flush when the
/// task ended.
pub(crate) async fn task_transition(
    org: &BehaviourContext,
    agent: &AgentId,
    number: u64,
    event: TaskEvent,
) -> Result<Transition, StoreError> {
    let transition = org
        .stores()
        .tasks
        .transition(agent, number, Expect::any(), event, org.clock().now())
        .await?;
    report_transition(org, &transition);
    if transition.notice.is_some() {
        flush_outbox_knowing(org, agent, Some(&transition.task)).await;
    }
    Ok(transition)
}

pub(super) fn report_transition(org: &BehaviourContext, transition: &Transition) {
    let task = &transition.task;
    let kind = match task.status {
        TaskStatus::Done => EventKind::TaskCompleted,
        TaskStatus::Failed => EventKind::TaskFailed {
            error: task.error.clone().unwrap_or_default(),
        },
        TaskStatus::Cancelled => EventKind::TaskCancelled,
        TaskStatus::Ready if task.attempts > 0 && task.error.is_some() => EventKind::TaskRequeued {
            attempts: task.attempts,
            reason: task.error.clone().unwrap_or_default(),
        },
        _ => return,
    };
    let mut event = org.event(&task.agent, kind);
    event.task = Some(task.task_ref());
    event.parent = task.metadata.parent_task.clone();
    event.link = task.metadata.link_id.clone();
    event.request = task.metadata.cause.clone();
    org.emit_event(event);
}

/// Delivers every unsent completion notice in `agent`'s outbox, marking each sent once it was
/// handed over. A failure leaves the notice in the outbox for the next flush.
pub(crate) async fn flush_outbox(org: &BehaviourContext, agent: &AgentId) {
    flush_outbox_knowing(org, agent, None).await;
}

/// [`flush_outbox`](Self::flush_outbox), with the task that just ended when the caller has it
/// (a notice about it then does not read it again).
async fn flush_outbox_knowing(org: &BehaviourContext, agent: &AgentId, ended: Option<&Task>) {
    let gate = org.state::<super::local::Local>().flush_gate(agent);
    let _serialized = gate.lock().await;
    let pending = match org.stores().tasks.outbox_pending(agent).await {
        Ok(p) => p,
        Err(e) => {
            org.report_error(agent, None, format!("outbox not read: {e}"));
            return;
        }
    };
    for notice in pending {
        match deliver_notice(org, agent, &notice, ended).await {
            Ok(()) => {}
            Err(e) => org.report_error(
                agent,
                None,
                format!(
                    "notice {} not delivered (kept in the outbox): {e}",
                    notice.key
                ),
            ),
        }
    }
}

/// Marks a delivered notice sent in `agent`'s outbox. A failure is tried again at once (twice),
/// then reported and tried again in the background after growing delays while `agent` runs
/// (the organization is not kept alive for it); the next flush of the outbox tries too (delivering the notice again
/// changes nothing: its records and retrigger are keyed). A notice that was delivered does not
/// stay in the outbox because one write failed.
async fn mark_sent(org: &BehaviourContext, agent: &AgentId, key: &str) {
    let mut error = None;
    for _ in 0..3 {
        match org.stores().tasks.outbox_mark_sent(agent, key).await {
            Ok(()) => return,
            Err(e) => error = Some(e),
        }
    }
    if let Some(e) = error {
        org.report_error(
            agent,
            None,
            format!("notice {key} delivered but not marked sent (tried again later): {e}"),
        );
    }
    let weak = org.downgrade();
    let clock = org.clock().clone();
    let (agent, key) = (agent.clone(), key.to_string());
    org.spawn_detached(async move {
        for ms in [50, 250, 1_000, 5_000, 20_000] {
            clock.sleep(Duration::from_millis(ms)).await;
            // Once the owner stopped (a shutdown among others), its next start flushes the
            // outbox: nothing is written behind a stopped agent's back.
            let Some(org) = weak.upgrade() else {
                return;
            };
            if !org.is_running(&agent) {
                return;
            }
            if org
                .stores()
                .tasks
                .outbox_mark_sent(&agent, &key)
                .await
                .is_ok()
            {
                return;
            }
        }
    });
}

/// Hands one notice of `agent`'s outbox to its delegator and marks it sent: before the
/// delegator can take a retrigger up, so its answer never meets the notice still pending.
/// `ended`: the task as it ended, when the caller has it.
async fn deliver_notice(
    org: &BehaviourContext,
    agent: &AgentId,
    notice: &CompletionNotice,
    ended: Option<&Task>,
) -> Result<(), String> {
    let span = crate::telemetry::step("spacebot.notice.deliver", &notice.task, None);
    span.record(
        "spacebot.task.status",
        tracing::field::display(notice.status),
    );
    if tracing::Span::current().is_none() && crate::telemetry::hook().is_some() {
        // Flushed outside the worker's turn (at a start, after a restart): the notice continues
        // the trace the task was created in.
        let stored = match ended {
            Some(task) if task.agent == notice.task.agent && task.number == notice.task.number => {
                task.metadata.trace_context.clone()
            }
            _ => org
                .stores()
                .tasks
                .get(&notice.task.agent, notice.task.number)
                .await
                .ok()
                .flatten()
                .and_then(|t| t.metadata.trace_context),
        };
        crate::telemetry::continue_trace(&span, stored.as_deref());
    }
    deliver_notice_in_span(org, agent, notice, ended)
        .instrument(span)
        .await
}

async fn deliver_notice_in_span(
    org: &BehaviourContext,
    agent: &AgentId,
    notice: &CompletionNotice,
    ended: Option<&Task>,
) -> Result<(), String> {
    let target = &notice.task.agent;
    let delegator = &notice.delegated_by;
    let now = org.clock().now();
    let summary = truncate_chars(&notice.outcome, 200);
    let number = notice.task.number;
    let record_text = match notice.status {
        TaskStatus::Done => format!("{target} completed task #{number}: {summary}"),
        TaskStatus::Failed => format!("{target}'s worker failed on task #{number}: {summary}"),
        _ => format!("task #{number} assigned to {target} was cancelled: {summary}"),
    };
    // Passive records in both link channels, each written once per notice: the record and its
    // key in one commit (a crash cannot keep the key and lose the record), checked first (the
    // outbox flushes of one agent are serialized, so no second delivery of the notice races).
    // The two sides are independent (each keyed): written at once, the stores commit them
    // together where they share a database.
    let side = |owner: &AgentId, peer: &AgentId| {
        let key = format!("record:{}", notice.key);
        let (owner, peer) = (owner.clone(), peer.clone());
        let record_text = record_text.clone();
        async move {
            let done = org
                .stores()
                .deliveries
                .is_applied(&owner, &key)
                .await
                .map_err(|e| e.to_string())?;
            if done {
                return Ok::<(), String>(());
            }
            let mut record = NewRecord::new(
                ChannelId::link(&owner, &peer),
                RecordKind::System,
                "system",
                record_text,
                now,
            );
            record.metadata.insert(
                "task".into(),
                serde_json::Value::String(notice.task.to_string()),
            );
            let commit = crate::envelope::TurnCommit {
                records: vec![record],
                applied: vec![key],
                ..Default::default()
            };
            org.stores()
                .deliveries
                .commit_owned(&owner, commit, now)
                .await
                .map_err(|(e, _)| e.to_string())
        }
    };
    let (worker_side, delegator_side) = crate::durability::together(futures::future::join(
        side(target, delegator),
        side(delegator, target),
    ))
    .await;
    worker_side?;
    delegator_side?;
    if let Some(parent) = &notice.parent_task {
        // Multi-hop: the delegator was working on a task; mark the child ended on it. Applying
        // it twice changes nothing.
        let event = TaskEvent::ChildEnded {
            child: notice.task.clone(),
            status: notice.status,
            outcome: notice.outcome.clone(),
        };
        // Boxed: a transition may flush an outbox, which may deliver a notice here again.
        let transition = Box::pin(task_transition(org, &parent.agent, parent.number, event));
        let resume = match transition.await {
            Ok(t) => t.task.status == TaskStatus::Ready,
            // The parent task ended meanwhile (cancelled): nothing left to resume.
            Err(StoreError::InvalidTransition(_)) => false,
            Err(e) => return Err(e.to_string()),
        };
        mark_sent(org, agent, &notice.key).await;
        if resume {
            org.ring(&parent.agent);
        }
    } else {
        let mut quoted = truncate_chars(&notice.outcome, RETRIGGER_RESULT_CHARS);
        if quoted.len() < notice.outcome.len() {
            quoted.push_str(&format!(
                " … (truncated; the full result is on task {})",
                notice.task
            ));
        }
        let outcome = match notice.status {
            TaskStatus::Done => crate::prompts::TaskOutcome::Completed,
            TaskStatus::Failed => crate::prompts::TaskOutcome::Failed,
            _ => crate::prompts::TaskOutcome::Cancelled,
        };
        let content = org
            .prompts()
            .render_task_retrigger(&crate::prompts::TaskRetriggerContext {
                agent_name: org.display_name(target),
                task_number: notice.task.number,
                outcome,
                summary: quoted,
            })
            .map_err(|e| e.to_string())?;
        let channel = notice
            .originating_channel
            .clone()
            .unwrap_or_else(|| ChannelId::link(delegator, target));
        let (round, cause) = match ended {
            // Round and cause are set when the task is created and never change.
            Some(task) if task.agent == notice.task.agent && task.number == notice.task.number => {
                (task.metadata.round, task.metadata.cause.clone())
            }
            _ => notice_round(notice, org).await,
        };
        let mut envelope = Envelope::new(
            Source::System,
            channel,
            EnvelopeKind::Retrigger,
            content,
            now,
        )
        .with_idempotency_key(notice.key.clone())
        .with_round(round.saturating_add(1));
        envelope.cause = cause;
        envelope.metadata.insert(
            "task".into(),
            serde_json::Value::String(notice.task.to_string()),
        );
        let marked = Box::pin(mark_sent(org, agent, &notice.key));
        org.enqueue_then(delegator, envelope, marked)
            .await
            .map_err(|e| e.to_string())?;
    }
    let mut event = org.event(
        delegator,
        EventKind::NoticeDelivered {
            key: notice.key.clone(),
        },
    );
    event.task = Some(notice.task.clone());
    event.channel = notice.originating_channel.clone();
    org.emit_event(event);
    Ok(())
}

/// The delegation round and the cause of the task a notice is about.
async fn notice_round(
    notice: &CompletionNotice,
    org: &BehaviourContext,
) -> (u32, Option<EnvelopeId>) {
    org.stores()
        .tasks
        .get(&notice.task.agent, notice.task.number)
        .await
        .ok()
        .flatten()
        .map_or((0, None), |t| (t.metadata.round, t.metadata.cause))
}

#[cfg(all(test, feature = "testing", feature = "tokio"))]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::super::testkit::{board, claim, harness, id, origin, origin_in, portal};
    use super::*;
    use crate::task::NewTask;

    /// The texts of `owner`'s side of its link channel with `peer`.
    async fn link_texts(h: &crate::testing::OrgHarness, owner: &str, peer: &str) -> Vec<String> {
        h.history(owner, &ChannelId::link(&id(owner), &id(peer)))
            .await
            .iter()
            .map(|r| r.record.content.as_str().to_string())
            .collect()
    }

    #[tokio::test]
    async fn the_terminal_transition_writes_the_notice_and_a_flush_delivers_it_once() {
        let (h, _llm) = harness("").await;
        let (a, b) = (id("a"), id("b"));
        h.org
            .delegate(&a, "b", "Pick a random word.", origin())
            .await
            .unwrap();
        claim(&h, "b", "b:worker:t:1").await;
        let now = h.org.clock().now();
        let complete = TaskEvent::Complete {
            holder: "b:worker:t:1".into(),
            result: "nebula".into(),
        };
        let t = h
            .stores
            .tasks
            .transition(&b, 1, Expect::any(), complete, now)
            .await
            .unwrap();
        // Written in the same step as the new status.
        let notice = t.notice.expect("a notice with the terminal transition");
        assert_eq!(notice.key, "b#1:done");
        assert_eq!(notice.outcome, "nebula");
        assert_eq!(notice.delegated_by, a);
        assert_eq!(notice.originating_channel, Some(portal()));
        assert_eq!(
            h.stores.tasks.outbox_pending(&b).await.unwrap(),
            vec![notice]
        );

        h.org.flush_outbox(&b).await;
        assert!(
            h.stores.tasks.outbox_pending(&b).await.unwrap().is_empty(),
            "marked sent"
        );
        let expected = vec![
            "a assigned task #1 to b: Pick a random word.".to_string(),
            "b completed task #1: nebula".to_string(),
        ];
        assert_eq!(link_texts(&h, "a", "b").await, expected);
        assert_eq!(link_texts(&h, "b", "a").await, expected);
        // The delegator is not running: its retrigger waits in its store.
        let kept = h.stores.deliveries.pending(&a).await.unwrap();
        assert_eq!(kept.len(), 1, "{kept:?}");
        assert_eq!(kept[0].kind, EnvelopeKind::Retrigger);
        assert_eq!(kept[0].channel, portal());
        assert_eq!(kept[0].idempotency_key.as_deref(), Some("b#1:done"));
        assert_eq!(kept[0].round, 1);
        assert!(kept[0].content.contains("nebula"), "{kept:?}");
        let delivered = |h: &crate::testing::OrgHarness| {
            h.count(|k| matches!(k, EventKind::NoticeDelivered { key } if key == "b#1:done"))
        };
        assert_eq!(delivered(&h), 1);

        // Flushing again finds nothing to send: nothing is written twice.
        h.org.flush_outbox(&b).await;
        assert_eq!(delivered(&h), 1);
        assert_eq!(link_texts(&h, "a", "b").await, expected);
        assert_eq!(link_texts(&h, "b", "a").await, expected);
        assert_eq!(h.stores.deliveries.pending(&a).await.unwrap().len(), 1);
    }

    #[tokio::test]
    async fn only_the_end_of_a_delegated_task_writes_a_notice() {
        let (h, _llm) = harness("").await;
        let b = id("b");
        h.org
            .delegate(&id("a"), "b", "Pick a random word.", origin())
            .await
            .unwrap();
        claim(&h, "b", "b:worker:t:1").await;
        // A failed attempt with attempts left requeues the task: not an end.
        let fail = TaskEvent::Fail {
            holder: "b:worker:t:1".into(),
            error: "boom".into(),
        };
        let t = h.org.task_transition(&b, 1, fail).await.unwrap();
        assert_eq!(t.task.status, TaskStatus::Ready);
        assert!(t.notice.is_none());
        assert!(h.stores.tasks.outbox_pending(&b).await.unwrap().is_empty());
        assert_eq!(
            h.count(|k| matches!(k, EventKind::TaskRequeued { attempts: 1, .. })),
            1
        );
        // A task of b's own (not delegated) ends without a notice.
        let now = h.org.clock().now();
        h.stores
            .tasks
            .create(&b, NewTask::new("Tidy up.", ""), now)
            .await
            .unwrap();
        let cancel = TaskEvent::Cancel {
            reason: "not needed".into(),
        };
        let t = h.org.task_transition(&b, 2, cancel).await.unwrap();
        assert_eq!(t.task.status, TaskStatus::Cancelled);
        assert!(t.notice.is_none());
        assert!(h.stores.tasks.outbox_pending(&b).await.unwrap().is_empty());
        assert_eq!(
            h.count(|k| matches!(k, EventKind::NoticeDelivered { .. })),
            0
        );
    }

    #[tokio::test]
    async fn a_child_notice_marks_the_child_ended_on_its_parent_task_instead_of_waking_a_model() {
        let (h, _llm) = harness("").await;
        let (b, c) = (id("b"), id("c"));
        h.org
            .delegate(&id("a"), "b", "Find a word.", origin())
            .await
            .unwrap();
        let b1 = claim(&h, "b", "b:worker:t:1").await;
        h.org
            .delegate(&b, "c", "Pick one.", origin_in(&b1))
            .await
            .unwrap();
        let wait = TaskEvent::Wait {
            holder: "b:worker:t:1".into(),
        };
        let parked = h.org.task_transition(&b, 1, wait).await.unwrap();
        assert_eq!(parked.task.status, TaskStatus::Waiting);
        claim(&h, "c", "c:worker:t:1").await;
        let complete = TaskEvent::Complete {
            holder: "c:worker:t:1".into(),
            result: "nebula".into(),
        };
        // The runtime's transition flushes c's outbox at once.
        h.org.task_transition(&c, 1, complete).await.unwrap();
        assert!(h.stores.tasks.outbox_pending(&c).await.unwrap().is_empty());
        let b1 = board(&h, "b").await.remove(0);
        assert_eq!(b1.status, TaskStatus::Ready, "its last child ended");
        assert_eq!(b1.metadata.children.len(), 1);
        assert_eq!(b1.metadata.children[0].ended, Some(TaskStatus::Done));
        assert_eq!(b1.metadata.children[0].outcome.as_deref(), Some("nebula"));
        assert!(
            h.stores.deliveries.pending(&b).await.unwrap().is_empty(),
            "no retrigger for b's model"
        );
        assert_eq!(link_texts(&h, "b", "c").await.len(), 2);
    }
}
