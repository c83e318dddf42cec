//! Delegation (seed 001): work handed from one agent to another as a durable task.
//!
//! 1. [`Organization::delegate`] (the `send_agent_message` tool) checks the link, its direction,
//!    the chain (no cycles, a depth limit) and the approval policy, creates the task on the
//!    **target's** board, writes "A assigned task #N to B: title" to both link channels, and ends the
//!    delegator's turn.
//! 2. The target's ready-task loop claims the task (compare-and-swap with a lease) and runs its
//!    [`TaskExecutor`]: by default the agent's own tool loop, through its queue, so a task never runs
//!    beside another turn of the same agent.
//! 3. Success completes the task with its result; an error requeues it until `max_attempts`, then
//!    fails it; a worker that dies leaves a lease that expires and requeues the task.
//! 4. The terminal transition writes a [`CompletionNotice`] to the target's outbox in the same step.
//!    The outbox is delivered to the delegator at least once and applied exactly once (idempotency
//!    key): a passive record in both link channels and a system retrigger into the delegator's
//!    originating channel, which wakes its model with the result. When the delegator was itself
//!    working on a task (multi-hop), the notice instead marks the child ended on that task; when its
//!    last child ends, the task is ready again and resumes with the children's results.
//!
//! See `docs/delegation.md`.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::Deserialize;

use crate::channel::{NewRecord, RecordKind};
use crate::envelope::{Envelope, EnvelopeKind, Source, TaskWork};
use crate::error::{InvalidInput, PolicyDenied, StoreError};
use crate::event::EventKind;
use crate::ids::{AgentId, ChannelId, EnvelopeId, TaskRef};
use crate::llm::ToolDefinition;
use crate::org::Organization;
use crate::policy;
use crate::runtime::agent::TurnOutcome;
use crate::runtime::behaviour::{AgentWorker, Behaviour, BehaviourContext};
use crate::task::{
    CompletionNotice, Expect, NewTask, Priority, Task, TaskEvent, TaskFilter, TaskMetadata,
    TaskStatus, Transition, truncate_chars,
};
use crate::tools::{Tool, ToolCapability, ToolContext, ToolError, ToolOutput, parse_args};

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

/// Why a delegation was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DelegationError {
    /// The target is not an agent the delegator can reach.
    #[error("unknown agent {target:?}; agents you can delegate to: {}", if reachable.is_empty() { "none".to_string() } else { reachable.join(", ") })]
    UnknownAgent {
        /// The target as given.
        target: String,
        /// Agents the delegator may delegate to, as `id (name)`.
        reachable: Vec<String>,
    },
    /// The policy refused (no link, disabled, one-way, cycle, depth).
    #[error(transparent)]
    Denied(#[from] PolicyDenied),
    /// Too many delegate-and-retrigger rounds led here.
    #[error(
        "{agent} has delegated {limit} times in a row on this request; answer with what you have instead of delegating again"
    )]
    RoundLimit {
        /// The delegator.
        agent: AgentId,
        /// The limit.
        limit: u32,
    },
    /// The message was empty.
    #[error(transparent)]
    Invalid(#[from] InvalidInput),
    /// A store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Where a delegation comes from: the delegator's channel, and its task when it is a worker.
#[derive(Debug, Clone)]
pub struct DelegationOrigin {
    /// The delegator's channel to wake with the result.
    pub channel: ChannelId,
    /// The delegator's own task, when it delegates while working on one (multi-hop).
    pub task: Option<TaskRef>,
    /// How many delegate-and-retrigger rounds led to this delegation.
    pub round: u32,
    /// The envelope that started the exchange (the task inherits it).
    pub cause: Option<EnvelopeId>,
    /// The idempotency key of this delegation: delegating again with the same key returns the task
    /// created the first time (a turn run again after a crash does not delegate twice).
    pub key: Option<String>,
}

impl DelegationOrigin {
    /// A delegation from `channel`, outside any task, at round 0, without a key.
    pub fn new(channel: ChannelId) -> Self {
        Self {
            channel,
            task: None,
            round: 0,
            cause: None,
            key: None,
        }
    }
}

/// The first sentence of `message`, at most [`Task::MAX_TITLE`] characters.
///
/// ```
/// use spacebot_core::delegation::title_from;
/// assert_eq!(title_from("Pick a random word. Then tell me."), "Pick a random word.");
/// assert_eq!(title_from("  line one\nline two"), "line one");
/// assert_eq!(title_from(&"x".repeat(300)).chars().count(), 120);
/// ```
pub fn title_from(message: &str) -> String {
    let text = message.trim();
    let line = text.lines().next().unwrap_or("").trim();
    let mut end = line.len();
    let bytes: Vec<(usize, char)> = line.char_indices().collect();
    for (i, (pos, c)) in bytes.iter().enumerate() {
        if matches!(c, '.' | '!' | '?') {
            let next = bytes.get(i + 1).map(|(_, c)| *c);
            if next.is_none_or(char::is_whitespace) {
                end = pos + c.len_utf8();
                break;
            }
        }
    }
    truncate_chars(&line[..end], Task::MAX_TITLE)
}

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
        let inner = &self.org.inner;
        let now = inner.clock.now();
        inner
            .stores
            .tasks
            .transition(
                &self.task.agent,
                self.task.number,
                Expect::any(),
                TaskEvent::Renew {
                    holder: self.holder.clone(),
                    lease_until: now.plus(DEFAULT_LEASE),
                },
                now,
            )
            .await
            .map(|_| ())
    }
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
    /// Delegates `message` from `from` to `target` (an id or a display name, case-insensitive):
    /// checks the policy, creates the task on the target's board, writes the assignment record to
    /// both link channels and wakes the target's task loop. Returns the created task.
    pub async fn delegate(
        &self,
        from: &AgentId,
        target: &str,
        message: &str,
        origin: DelegationOrigin,
    ) -> Result<Task, DelegationError> {
        let inner = &self.inner;
        let graph = inner.graph();
        let Ok(target_id) = self.resolve(target) else {
            return Err(DelegationError::UnknownAgent {
                target: target.to_string(),
                reachable: self.reachable_from(from),
            });
        };
        if message.trim().is_empty() {
            return Err(
                InvalidInput::new("message", "a delegated task needs a description").into(),
            );
        }
        let limit = inner.settings.max_delegation_depth.max(1) as u32 * 2;
        if origin.round >= limit {
            return Err(DelegationError::RoundLimit {
                agent: from.clone(),
                limit,
            });
        }
        let (chain, parent_task) = match &origin.task {
            Some(task_ref) => {
                let task = inner
                    .stores
                    .tasks
                    .get(&task_ref.agent, task_ref.number)
                    .await?
                    .ok_or_else(|| StoreError::not_found(format!("task {task_ref}")))?;
                // Only the worker on a running task delegates from it; a stale worker whose task
                // moved on must not leave a child nobody waits for.
                if task.status != TaskStatus::InProgress {
                    return Err(InvalidInput::new(
                        "origin task",
                        format!(
                            "task {task_ref} is {}, not in_progress; only its current worker may delegate from it",
                            task.status
                        ),
                    )
                    .into());
                }
                (
                    task.metadata.delegation_chain.clone(),
                    Some(task_ref.clone()),
                )
            }
            None => (Vec::new(), None),
        };
        let link = policy::check_delegate(
            &graph,
            from,
            &target_id,
            &chain,
            inner.settings.max_delegation_depth,
        )?
        .clone();
        let approval = policy::needs_approval(inner.settings.approval, &graph, from, &target_id);
        let mut full_chain = chain;
        full_chain.push(from.clone());
        let metadata = TaskMetadata {
            delegated_by: Some(from.clone()),
            originating_channel: Some(origin.channel.clone()),
            link_id: Some(link.id.clone()),
            delegation_chain: full_chain,
            parent_task: parent_task.clone(),
            round: origin.round,
            cause: origin.cause.clone(),
            ..TaskMetadata::default()
        };
        let new = NewTask {
            title: title_from(message),
            description: message.to_string(),
            status: if approval {
                TaskStatus::PendingApproval
            } else {
                TaskStatus::Ready
            },
            priority: Priority::Medium,
            created_by: format!("agent:{from}"),
            metadata,
            max_attempts: 3,
            idempotency_key: origin.key.clone(),
        };
        let now = inner.clock.now();
        let applied_key = origin.key.as_ref().map(|k| format!("delegated:{k}"));
        let already = match &applied_key {
            Some(key) => inner.stores.deliveries.is_applied(from, key).await?,
            None => false,
        };
        // With a key, a second create returns the task made the first time.
        let task = inner.stores.tasks.create(&target_id, new, now).await?;
        if !already {
            // Told before anything else is awaited: the target's task loop may claim the task as soon
            // as it is stored, and its claim must not be told first.
            let mut event = inner.event(
                &target_id,
                EventKind::TaskCreated {
                    created_by: task.created_by.clone(),
                    status: task.status,
                },
            );
            event.task = Some(task.task_ref());
            event.link = Some(link.id.clone());
            event.parent = parent_task.clone();
            inner.emit(event);
        }
        if let Some(parent) = &parent_task {
            let added = inner
                .stores
                .tasks
                .transition(
                    &parent.agent,
                    parent.number,
                    Expect::any(),
                    TaskEvent::AddChild {
                        child: task.task_ref(),
                    },
                    now,
                )
                .await;
            if let Err(e) = added {
                // The parent ended meanwhile: withdraw the child so it does not run for nobody.
                let reason = format!("withdrawn: task {parent} no longer waits for it ({e})");
                let _ = inner
                    .stores
                    .tasks
                    .transition(
                        &target_id,
                        task.number,
                        Expect::any(),
                        TaskEvent::Cancel { reason },
                        now,
                    )
                    .await;
                return Err(e.into());
            }
        }
        if already {
            // Delegated before under this key (the turn ran again after a crash): nothing to repeat.
            self.ring(&target_id);
            return Ok(task);
        }
        let text = format!(
            "{} assigned task #{} to {}: {}",
            from, task.number, target_id, task.title
        );
        self.audit_pair(from, &target_id, &text, &task, applied_key)
            .await?;
        self.ring(&target_id);
        Ok(task)
    }

    /// Agents `from` may delegate to, as `id (name)`.
    pub(crate) fn reachable_from(&self, from: &AgentId) -> Vec<String> {
        self.reachable_agents(from)
            .into_iter()
            .map(|(a, name)| format!("{a} ({name})"))
            .collect()
    }

    /// Agents `from` may delegate to, with their display names.
    pub(crate) fn reachable_agents(&self, from: &AgentId) -> Vec<(AgentId, String)> {
        let graph = self.inner.graph();
        let max = self.inner.settings.max_delegation_depth;
        // Only the agent's own links can reach anyone: the cost is its degree, not the size of
        // the organization.
        let mut candidates: Vec<&AgentId> = graph
            .links_of(from.as_str())
            .filter_map(|l| l.other(from))
            .collect();
        candidates.sort();
        candidates.dedup();
        candidates
            .into_iter()
            .filter(|a| policy::check_delegate(&graph, from, *a, &[], max).is_ok())
            .map(|a| (a.clone(), self.display_name(a)))
            .collect()
    }

    /// Writes a system record to both sides of the link channel between `a` (the delegator) and
    /// `b`: `b`'s side first, then `a`'s side together with `a`'s applied key (one commit), so the
    /// key is marked only once both records are written. A failure to write `b`'s side is
    /// reported; a failure of `a`'s commit is returned when it carried a key (the delegation is
    /// then not marked done), reported otherwise.
    async fn audit_pair(
        &self,
        a: &AgentId,
        b: &AgentId,
        text: &str,
        task: &Task,
        applied_key: Option<String>,
    ) -> Result<(), StoreError> {
        let inner = &self.inner;
        let now = inner.clock.now();
        let text = crate::text::Text::from(text);
        let task_ref = serde_json::Value::String(task.task_ref().to_string());
        let record = |owner: &AgentId, peer: &AgentId| {
            let mut record = NewRecord::new(
                ChannelId::link(owner, peer),
                RecordKind::System,
                "system",
                text.clone(),
                now,
            );
            record.metadata.insert("task".into(), task_ref.clone());
            record
        };
        if let Err(e) = inner.stores.channels.append(b, record(b, a)).await {
            crate::runtime::agent::report_error(
                inner,
                b,
                None,
                format!("link record not written: {e}"),
            );
        }
        let keyed = applied_key.is_some();
        let commit = crate::envelope::TurnCommit {
            records: vec![record(a, b)],
            applied: applied_key.into_iter().collect(),
            ..Default::default()
        };
        match inner.stores.deliveries.commit_owned(a, commit, now).await {
            Ok(()) => Ok(()),
            Err((e, _)) if keyed => Err(e),
            Err((e, _)) => {
                crate::runtime::agent::report_error(
                    inner,
                    a,
                    None,
                    format!("link record not written: {e}"),
                );
                Ok(())
            }
        }
    }

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

    fn report_transition(&self, transition: &Transition) {
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
fn owns_claim(agent: &AgentId, holder: &str) -> bool {
    holder
        .strip_prefix(agent.as_str())
        .is_some_and(|rest| rest.starts_with(":worker:"))
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

/// The task loop of one agent: requeue expired leases, flush the outbox, claim ready tasks up to the
/// concurrency limit and hand them to the executor; sleep until rung or until the next lease check.
///
/// The steps it awaits are boxed, so the loop of an idle agent holds a small future instead of the
/// state of a notice delivery (about 5 KB), for every agent.
async fn run_task_loop(
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
                Some(executor) => {
                    let ctx = TaskContext {
                        org: org.clone(),
                        holder: holder.clone(),
                        task: task.task_ref(),
                    };
                    let executor = executor.clone();
                    let org2 = org.clone();
                    let holder2 = holder.clone();
                    // Gives the slot back however the executor ends, a panic included; the lease
                    // of a crashed attempt then expires and the task is requeued.
                    let slot = SlotGuard(agent.clone(), task.number, holder.clone());
                    let live = LiveClaim::new(&inner, &holder);
                    // Aborted (with its guards dropped) when the agent is handed over.
                    let (attempt, registration) = futures::future::AbortHandle::new_pair();
                    agent
                        .rt
                        .executors
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(holder.clone(), attempt);
                    let run = async move {
                        let number = task.number;
                        let result = executor.execute(ctx, task).await;
                        record_outcome(&org2, slot.0.id(), number, &holder2, result).await;
                        slot.0
                            .rt
                            .executors
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .remove(&holder2);
                        drop(slot);
                        drop(live);
                    };
                    let counted = inner.background.enter();
                    inner.spawner.spawn(Box::pin(async move {
                        let _ = futures::future::Abortable::new(run, registration).await;
                        drop(counted);
                    }));
                }
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

/// Marks a claim as worked on in this process while alive (a restarted task loop leaves it be).
struct LiveClaim(Arc<crate::org::OrgInner>, String);

impl LiveClaim {
    fn new(inner: &Arc<crate::org::OrgInner>, holder: &str) -> Self {
        inner
            .live_claims
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(holder.to_string());
        Self(inner.clone(), holder.to_string())
    }
}

impl Drop for LiveClaim {
    fn drop(&mut self) {
        self.0
            .live_claims
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.1);
    }
}

/// Frees one task slot of an agent when dropped, and wakes its task loop.
struct SlotGuard(AgentWorker, u64, String);

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.0.claim_ended(self.1, &self.2);
        self.0.ring();
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
async fn finish_task(
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
async fn record_outcome(
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
        builtin_tools()
    }

    fn on_agent_started(&self, ctx: &BehaviourContext, agent: AgentWorker) {
        if agent.is_child() {
            return;
        }
        let Some(doorbell) = agent.take_doorbell(self.name()) else {
            return;
        };
        let executor = self.executors.get(agent.id()).cloned();
        ctx.spawn(run_task_loop(ctx.organization(), agent, doorbell, executor));
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
        if !owns_claim(agent, &work.holder) {
            return Ok(false);
        }
        let org = &ctx.organization();
        // Only a claim this process's task loop made is worked on: the envelope of a claim made
        // before a restart is handed over again, but that attempt is over (the task loop fails it
        // and claims the task anew), and a turn run for it would race the new attempt.
        let ours = match org.inner.slot(agent) {
            Some(crate::org::Slot::Running(rt)) => rt
                .running_claims()
                .iter()
                .any(|(number, holder)| *number == work.number && holder == &work.holder),
            _ => false,
        };
        if !ours {
            return Ok(false);
        }
        org.inner
            .stores
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
        let ctx = TaskContext {
            org: ctx.organization(),
            holder: work.holder.clone(),
            task: TaskRef::new(agent.clone(), work.number),
        };
        ctx.renew().await
    }

    async fn work_ended(
        &self,
        ctx: &BehaviourContext,
        agent: &AgentWorker,
        work: &TaskWork,
        outcome: &Result<TurnOutcome, String>,
        usage: crate::llm::Usage,
    ) {
        let org = &ctx.organization();
        if !usage.is_zero() {
            let event = TaskEvent::RecordUsage {
                holder: work.holder.clone(),
                usage,
            };
            if let Err(e) = org.task_transition(agent.id(), work.number, event).await {
                crate::runtime::agent::report_error(
                    &org.inner,
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
            Err(e) => Err(TaskError::Retry(e.clone())),
        };
        finish_task(org, agent, work.number, &work.holder, result).await;
    }
}

/// The `send_agent_message` tool: delegation as a task on the target's board.
#[derive(Debug, Default)]
pub struct SendAgentMessage;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SendArgs {
    target: String,
    message: String,
}

#[async_trait]
impl Tool for SendAgentMessage {
    fn definition(&self) -> ToolDefinition {
        ToolDefinition::new(
            "send_agent_message",
            "Delegate work to another agent you are linked to. The message becomes a \
                task on that agent's board; your turn ends, and you are woken with the result when \
                the task is done or failed. `target` is the agent's id or name.",
            serde_json::json!({
                "type": "object",
                "properties": {
                    "target": {"type": "string", "description": "The agent's id or display name."},
                    "message": {"type": "string", "description": "What the agent should do, with the context it needs."}
                },
                "required": ["target", "message"],
                "additionalProperties": false
            }),
        )
    }

    fn definition_for(&self, scope: &ToolCapability) -> ToolDefinition {
        let mut definition = self.definition();
        let org = scope.organization();
        let targets = org
            .reachable_agents(scope.agent())
            .into_iter()
            .map(|(id, name)| crate::prompts::AgentSummary { id, name })
            .collect();
        match org
            .inner
            .prompts
            .render_send_agent_message(&crate::prompts::SendAgentMessageContext { targets })
        {
            Ok(text) => definition.description = text,
            Err(e) => crate::runtime::agent::report_error(
                &org.inner,
                scope.agent(),
                None,
                format!("send_agent_message description not rendered: {e}"),
            ),
        }
        definition
    }

    async fn call(
        &self,
        ctx: &ToolContext,
        args: serde_json::Value,
    ) -> Result<ToolOutput, ToolError> {
        let args: SendArgs = parse_args("send_agent_message", args)?;
        let origin = DelegationOrigin {
            channel: ctx.channel.clone(),
            task: ctx.task.clone(),
            round: ctx.round,
            cause: Some(ctx.cause.clone()),
            key: Some(ctx.key.clone()),
        };
        match ctx
            .org
            .organization()
            .delegate(&ctx.agent, &args.target, &args.message, origin)
            .await
        {
            Ok(task) => {
                let name = ctx.org.display_name(&task.agent);
                let stop = if task.title.ends_with(['.', '!', '?']) {
                    ""
                } else {
                    "."
                };
                let waiting = if task.status == TaskStatus::PendingApproval {
                    " It waits for approval before it runs."
                } else {
                    ""
                };
                Ok(ToolOutput::end_turn(format!(
                    "Assigned task #{} to {name} ({}): {}{stop}{waiting} Your turn ends now; you \
                     will be woken with the result.",
                    task.number, task.agent, task.title
                )))
            }
            Err(DelegationError::Denied(denied)) => Err(ToolError::Denied(denied)),
            Err(e) => Err(ToolError::failed("send_agent_message", e.to_string())),
        }
    }
}

/// `task_create`: adds a task to the calling agent's own board.
#[derive(Debug, Default)]
pub struct TaskCreate;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateArgs {
    title: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    priority: Option<String>,
    #[serde(default)]
    backlog: bool,
}

#[async_trait]
impl Tool for TaskCreate {
    fn definition(&self) -> ToolDefinition {
        ToolDefinition::new(
            "task_create",
            "Add a task to your own board. It is ready to run unless `backlog` is true.",
            serde_json::json!({
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "description": {"type": "string"},
                    "priority": {"type": "string", "enum": ["low", "medium", "high", "urgent"]},
                    "backlog": {"type": "boolean"}
                },
                "required": ["title"],
                "additionalProperties": false
            }),
        )
    }

    async fn call(
        &self,
        ctx: &ToolContext,
        args: serde_json::Value,
    ) -> Result<ToolOutput, ToolError> {
        let args: CreateArgs = parse_args("task_create", args)?;
        let priority = match &args.priority {
            Some(p) => p
                .parse::<Priority>()
                .map_err(|e| ToolError::invalid_arguments("task_create", e.to_string()))?,
            None => Priority::Medium,
        };
        let mut new = NewTask::new(args.title, args.description);
        new.priority = priority;
        new.created_by = format!("agent:{}", ctx.agent);
        if args.backlog {
            new.status = TaskStatus::Backlog;
        }
        let task = ctx
            .org
            .organization()
            .stores()
            .tasks
            .create(&ctx.agent, new, ctx.org.clock().now())
            .await
            .map_err(|e| ToolError::failed("task_create", e.to_string()))?;
        ctx.org.organization().ring(&ctx.agent);
        Ok(ToolOutput::text(format!(
            "Created task #{} ({}): {}",
            task.number, task.status, task.title
        )))
    }
}

/// `task_list`: the calling agent's board, or a subordinate's (read-only).
#[derive(Debug, Default)]
pub struct TaskList;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListArgs {
    #[serde(default)]
    agent: Option<String>,
    #[serde(default)]
    status: Option<String>,
}

#[async_trait]
impl Tool for TaskList {
    fn definition(&self) -> ToolDefinition {
        ToolDefinition::new(
            "task_list",
            "List tasks on your board, or (read-only) on the board of an agent that \
                reports to you. Optionally only one status.",
            serde_json::json!({
                "type": "object",
                "properties": {
                    "agent": {"type": "string", "description": "A subordinate's id or name; omit for your own board."},
                    "status": {"type": "string", "enum": TaskStatus::ALL.iter().map(|s| s.as_str()).collect::<Vec<_>>()}
                },
                "additionalProperties": false
            }),
        )
    }

    async fn call(
        &self,
        ctx: &ToolContext,
        args: serde_json::Value,
    ) -> Result<ToolOutput, ToolError> {
        let args: ListArgs = parse_args("task_list", args)?;
        let board = match &args.agent {
            None => ctx.agent.clone(),
            Some(name) => {
                let id = ctx
                    .org
                    .resolve(name)
                    .map_err(|e| ToolError::failed("task_list", e.to_string()))?;
                if id != ctx.agent
                    && !policy::is_superior(&ctx.org.graph(), ctx.agent.as_str(), id.as_str())
                {
                    return Err(ToolError::failed(
                        "task_list",
                        format!(
                            "{id} does not report to you; you can list only your own board and your subordinates' boards"
                        ),
                    ));
                }
                id
            }
        };
        let mut filter = TaskFilter::default();
        if let Some(status) = &args.status {
            filter
                .statuses
                .push(status.parse().map_err(|e: InvalidInput| {
                    ToolError::invalid_arguments("task_list", e.to_string())
                })?);
        }
        let tasks = ctx
            .org
            .organization()
            .stores()
            .tasks
            .list(&board, &filter)
            .await
            .map_err(|e| ToolError::failed("task_list", e.to_string()))?;
        if tasks.is_empty() {
            return Ok(ToolOutput::text(format!("No tasks on {board}'s board.")));
        }
        let lines: Vec<String> = tasks
            .iter()
            .map(|t| {
                format!(
                    "#{} [{}] {} ({})",
                    t.number, t.status, t.title, t.created_by
                )
            })
            .collect();
        Ok(ToolOutput::text(lines.join("\n")))
    }
}

/// `task_update`: changes the status of a task on the calling agent's own board.
#[derive(Debug, Default)]
pub struct TaskUpdate;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UpdateArgs {
    number: u64,
    action: String,
    #[serde(default)]
    reason: Option<String>,
}

#[async_trait]
impl Tool for TaskUpdate {
    fn definition(&self) -> ToolDefinition {
        ToolDefinition::new(
            "task_update",
            "Change a task on your own board: approve (pending_approval -> ready), \
                schedule (backlog -> ready), park (-> backlog) or cancel.",
            serde_json::json!({
                "type": "object",
                "properties": {
                    "number": {"type": "integer", "minimum": 1},
                    "action": {"type": "string", "enum": ["approve", "schedule", "park", "cancel"]},
                    "reason": {"type": "string"}
                },
                "required": ["number", "action"],
                "additionalProperties": false
            }),
        )
    }

    async fn call(
        &self,
        ctx: &ToolContext,
        args: serde_json::Value,
    ) -> Result<ToolOutput, ToolError> {
        let args: UpdateArgs = parse_args("task_update", args)?;
        let event = match args.action.as_str() {
            "approve" => TaskEvent::Approve,
            "schedule" => TaskEvent::Schedule,
            "park" => TaskEvent::Park,
            "cancel" => TaskEvent::Cancel {
                reason: args
                    .reason
                    .unwrap_or_else(|| format!("cancelled by {}", ctx.agent)),
            },
            other => {
                return Err(ToolError::invalid_arguments(
                    "task_update",
                    format!("unknown action {other:?}; use approve, schedule, park or cancel"),
                ));
            }
        };
        let t = ctx
            .org
            .organization()
            .task_transition(&ctx.agent, args.number, event)
            .await
            .map_err(|e| ToolError::failed("task_update", e.to_string()))?;
        ctx.org.organization().ring(&ctx.agent);
        Ok(ToolOutput::text(format!(
            "Task #{} is now {}.",
            t.task.number, t.task.status
        )))
    }
}

/// The tools every agent gets from the runtime.
fn builtin_tools() -> Vec<Arc<dyn Tool>> {
    vec![
        Arc::new(SendAgentMessage),
        Arc::new(TaskCreate),
        Arc::new(TaskList),
        Arc::new(TaskUpdate),
    ]
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
}
