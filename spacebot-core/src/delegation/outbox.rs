//! The completion outbox: transitions applied for the runtime (reported as events), and the
//! delivery of the completion notices a terminal transition wrote to the target's outbox.
//!
//! A notice is delivered at least once (it stays in the outbox until it is handed over and marked
//! sent; every task loop iteration flushes the outbox again) and applied exactly once: its link
//! records are keyed, and its retrigger carries the notice key as its idempotency key.

use std::time::Duration;

use super::RETRIGGER_RESULT_CHARS;
use crate::channel::{NewRecord, RecordKind};
use crate::envelope::{Envelope, EnvelopeKind, Source};
use crate::error::StoreError;
use crate::event::EventKind;
use crate::ids::{AgentId, ChannelId, EnvelopeId};
use crate::org::Organization;
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
        let inner = &self.inner;
        let transition = inner
            .stores
            .tasks
            .transition(agent, number, Expect::any(), event, inner.clock.now())
            .await?;
        self.report_transition(&transition);
        if transition.notice.is_some() {
            self.flush_outbox_knowing(agent, Some(&transition.task))
                .await;
        }
        Ok(transition)
    }

    pub(super) fn report_transition(&self, transition: &Transition) {
        let task = &transition.task;
        let kind = match task.status {
            TaskStatus::Done => EventKind::TaskCompleted,
            TaskStatus::Failed => EventKind::TaskFailed {
                error: task.error.clone().unwrap_or_default(),
            },
            TaskStatus::Cancelled => EventKind::TaskCancelled,
            TaskStatus::Ready if task.attempts > 0 && task.error.is_some() => {
                EventKind::TaskRequeued {
                    attempts: task.attempts,
                    reason: task.error.clone().unwrap_or_default(),
                }
            }
            _ => return,
        };
        let mut event = self.inner.event(&task.agent, kind);
        event.task = Some(task.task_ref());
        event.parent = task.metadata.parent_task.clone();
        event.link = task.metadata.link_id.clone();
        self.inner.emit(event);
    }

    /// Delivers every unsent completion notice in `agent`'s outbox, marking each sent once it was
    /// handed over. A failure leaves the notice in the outbox for the next flush.
    pub async fn flush_outbox(&self, agent: &AgentId) {
        self.flush_outbox_knowing(agent, None).await;
    }

    /// [`flush_outbox`](Self::flush_outbox), with the task that just ended when the caller has it
    /// (a notice about it then does not read it again).
    async fn flush_outbox_knowing(&self, agent: &AgentId, ended: Option<&Task>) {
        let gate = self.inner.flush_gate(agent);
        let _serialized = gate.lock().await;
        let pending = match self.inner.stores.tasks.outbox_pending(agent).await {
            Ok(p) => p,
            Err(e) => {
                crate::runtime::agent::report_error(
                    &self.inner,
                    agent,
                    None,
                    format!("outbox not read: {e}"),
                );
                return;
            }
        };
        for notice in pending {
            match self.deliver_notice(agent, &notice, ended).await {
                Ok(()) => {}
                Err(e) => crate::runtime::agent::report_error(
                    &self.inner,
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
    async fn mark_sent(&self, agent: &AgentId, key: &str) {
        let mut error = None;
        for _ in 0..3 {
            match self.inner.stores.tasks.outbox_mark_sent(agent, key).await {
                Ok(()) => return,
                Err(e) => error = Some(e),
            }
        }
        if let Some(e) = error {
            crate::runtime::agent::report_error(
                &self.inner,
                agent,
                None,
                format!("notice {key} delivered but not marked sent (tried again later): {e}"),
            );
        }
        let weak = std::sync::Arc::downgrade(&self.inner);
        let clock = self.inner.clock.clone();
        let (agent, key) = (agent.clone(), key.to_string());
        self.inner.spawner.spawn(Box::pin(async move {
            for ms in [50, 250, 1_000, 5_000, 20_000] {
                clock.sleep(Duration::from_millis(ms)).await;
                // Once the owner stopped (a shutdown among others), its next start flushes the
                // outbox: nothing is written behind a stopped agent's back.
                let Some(inner) = weak.upgrade() else {
                    return;
                };
                if !matches!(inner.slot(&agent), Some(crate::org::Slot::Running(_))) {
                    return;
                }
                if inner
                    .stores
                    .tasks
                    .outbox_mark_sent(&agent, &key)
                    .await
                    .is_ok()
                {
                    return;
                }
            }
        }));
    }

    /// Hands one notice of `agent`'s outbox to its delegator and marks it sent: before the
    /// delegator can take a retrigger up, so its answer never meets the notice still pending.
    /// `ended`: the task as it ended, when the caller has it.
    async fn deliver_notice(
        &self,
        agent: &AgentId,
        notice: &CompletionNotice,
        ended: Option<&Task>,
    ) -> Result<(), String> {
        let inner = &self.inner;
        let target = &notice.task.agent;
        let delegator = &notice.delegated_by;
        let now = inner.clock.now();
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
        for (owner, peer) in [(target, delegator), (delegator, target)] {
            let key = format!("record:{}", notice.key);
            let done = inner
                .stores
                .deliveries
                .is_applied(owner, &key)
                .await
                .map_err(|e| e.to_string())?;
            if !done {
                let mut record = NewRecord::new(
                    ChannelId::link(owner, peer),
                    RecordKind::System,
                    "system",
                    record_text.clone(),
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
                inner
                    .stores
                    .deliveries
                    .commit(owner, &commit, now)
                    .await
                    .map_err(|e| e.to_string())?;
            }
        }
        if let Some(parent) = &notice.parent_task {
            // Multi-hop: the delegator was working on a task; mark the child ended on it. Applying
            // it twice changes nothing.
            let event = TaskEvent::ChildEnded {
                child: notice.task.clone(),
                status: notice.status,
                outcome: notice.outcome.clone(),
            };
            // Boxed: a transition may flush an outbox, which may deliver a notice here again.
            let transition = Box::pin(self.task_transition(&parent.agent, parent.number, event));
            let resume = match transition.await {
                Ok(t) => t.task.status == TaskStatus::Ready,
                // The parent task ended meanwhile (cancelled): nothing left to resume.
                Err(StoreError::InvalidTransition(_)) => false,
                Err(e) => return Err(e.to_string()),
            };
            self.mark_sent(agent, &notice.key).await;
            if resume {
                self.ring(&parent.agent);
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
            let content = inner
                .prompts
                .render_task_retrigger(&crate::prompts::TaskRetriggerContext {
                    agent_name: inner.display_name(target),
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
                Some(task)
                    if task.agent == notice.task.agent && task.number == notice.task.number =>
                {
                    (task.metadata.round, task.metadata.cause.clone())
                }
                _ => notice_round(notice, inner).await,
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
            let marked = Box::pin(self.mark_sent(agent, &notice.key));
            inner
                .enqueue_then(delegator, envelope, true, Some(marked))
                .await
                .map_err(|e| e.to_string())?;
        }
        let mut event = inner.event(
            delegator,
            EventKind::NoticeDelivered {
                key: notice.key.clone(),
            },
        );
        event.task = Some(notice.task.clone());
        event.channel = notice.originating_channel.clone();
        inner.emit(event);
        Ok(())
    }
}

/// The delegation round and the cause of the task a notice is about.
async fn notice_round(
    notice: &CompletionNotice,
    inner: &crate::org::OrgInner,
) -> (u32, Option<EnvelopeId>) {
    inner
        .stores
        .tasks
        .get(&notice.task.agent, notice.task.number)
        .await
        .ok()
        .flatten()
        .map_or((0, None), |t| (t.metadata.round, t.metadata.cause))
}
