//! Admission: the policy-checked creation of a delegated task.
//!
//! [`Organization::delegate`] resolves the target, checks the link and its direction, the chain (no
//! cycle, the depth limit), the round limit and the approval policy, then creates the task on the
//! target's board under the delegation's idempotency key (a turn run again after a crash gets the
//! task created the first time) and writes the assignment record to both sides of the link.

use crate::channel::{NewRecord, RecordKind};
use crate::error::{InvalidInput, PolicyDenied, StoreError};
use crate::event::EventKind;
use crate::ids::{AgentId, ChannelId, EnvelopeId, TaskRef};
use crate::org::Organization;
use crate::policy;
use crate::runtime::behaviour::BehaviourContext;
use crate::task::{
    Expect, NewTask, Priority, Task, TaskEvent, TaskMetadata, TaskStatus, truncate_chars,
};
use tracing::Instrument;

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
        delegate(&self.behaviour_context(), from, target, message, origin).await
    }
}

/// [`Organization::delegate`], as the behaviour and its tools reach it: through the context.
pub(crate) async fn delegate(
    org: &BehaviourContext,
    from: &AgentId,
    target: &str,
    message: &str,
    origin: DelegationOrigin,
) -> Result<Task, DelegationError> {
    let graph = org.graph();
    let Ok(target_id) = org.resolve(target) else {
        return Err(DelegationError::UnknownAgent {
            target: target.to_string(),
            reachable: reachable_from(org, from),
        });
    };
    if message.trim().is_empty() {
        return Err(InvalidInput::new("message", "a delegated task needs a description").into());
    }
    let limit = org.settings().max_delegation_depth.max(1) as u32 * 2;
    if origin.round >= limit {
        return Err(DelegationError::RoundLimit {
            agent: from.clone(),
            limit,
        });
    }
    let (chain, parent_task) = match &origin.task {
        Some(task_ref) => {
            let task = org
                .stores()
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
    let link = match policy::check_delegate(
        &graph,
        from,
        &target_id,
        &chain,
        org.settings().max_delegation_depth,
    ) {
        Ok(link) => link.clone(),
        Err(denied) => {
            org.host.refused(&denied, origin.cause.as_ref()).await;
            return Err(denied.into());
        }
    };
    let approval = policy::needs_approval(org.settings().approval, &graph, from, &target_id);
    let mut full_chain = chain;
    full_chain.push(from.clone());
    let span = tracing::info_span!(
        target: "spacebot::telemetry",
        "spacebot.task.create",
        spacebot.task = tracing::field::Empty,
        spacebot.task.assignee = %target_id,
    );
    let metadata = TaskMetadata {
        trace_context: crate::telemetry::context_of(&span),
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
    let now = org.clock().now();
    let applied_key = origin.key.as_ref().map(|k| format!("delegated:{k}"));
    let already = match &applied_key {
        Some(key) => org.stores().deliveries.is_applied(from, key).await?,
        None => false,
    };
    // With a key, a second create returns the task made the first time.
    let task = org
        .stores()
        .tasks
        .create(&target_id, new, now)
        .instrument(span.clone())
        .await?;
    span.record("spacebot.task", tracing::field::display(task.task_ref()));
    if !already {
        // Told before anything else is awaited: the target's task loop may claim the task as soon
        // as it is stored, and its claim must not be told first.
        let mut event = org.event(
            &target_id,
            EventKind::TaskCreated {
                created_by: task.created_by.clone(),
                status: task.status,
            },
        );
        event.task = Some(task.task_ref());
        event.link = Some(link.id.clone());
        event.parent = parent_task.clone();
        event.request = task.metadata.cause.clone();
        org.emit_event(event);
    }
    if let Some(parent) = &parent_task {
        let added = org
            .stores()
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
            let _ = org
                .stores()
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
        org.ring(&target_id);
        return Ok(task);
    }
    let text = format!(
        "{} assigned task #{} to {}: {}",
        from, task.number, target_id, task.title
    );
    audit_pair(org, from, &target_id, &text, &task, applied_key)
        .instrument(span)
        .await?;
    org.ring(&target_id);
    Ok(task)
}

/// Agents `from` may delegate to, as `id (name)`.
pub(crate) fn reachable_from(org: &BehaviourContext, from: &AgentId) -> Vec<String> {
    reachable_agents(org, from)
        .into_iter()
        .map(|(a, name)| format!("{a} ({name})"))
        .collect()
}

/// Agents `from` may delegate to, with their display names.
pub(crate) fn reachable_agents(org: &BehaviourContext, from: &AgentId) -> Vec<(AgentId, String)> {
    let graph = org.graph();
    let max = org.settings().max_delegation_depth;
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
        .map(|a| (a.clone(), org.display_name(a)))
        .collect()
}

/// Writes a system record to both sides of the link channel between `a` (the delegator) and
/// `b`: `b`'s side first, then `a`'s side together with `a`'s applied key (one commit), so the
/// key is marked only once both records are written. A failure to write `b`'s side is
/// reported; a failure of `a`'s commit is returned when it carried a key (the delegation is
/// then not marked done), reported otherwise.
async fn audit_pair(
    org: &BehaviourContext,
    a: &AgentId,
    b: &AgentId,
    text: &str,
    task: &Task,
    applied_key: Option<String>,
) -> Result<(), StoreError> {
    let now = org.clock().now();
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
    if let Err(e) = org.stores().channels.append(b, record(b, a)).await {
        org.report_error(b, None, format!("link record not written: {e}"));
    }
    let keyed = applied_key.is_some();
    let commit = crate::envelope::TurnCommit {
        records: vec![record(a, b)],
        applied: applied_key.into_iter().collect(),
        ..Default::default()
    };
    match org.stores().deliveries.commit_owned(a, commit, now).await {
        Ok(()) => Ok(()),
        Err((e, _)) if keyed => Err(e),
        Err((e, _)) => {
            org.report_error(a, None, format!("link record not written: {e}"));
            Ok(())
        }
    }
}

#[cfg(all(test, feature = "testing", feature = "tokio"))]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::super::testkit::{board, claim, harness, id, origin, origin_in};
    use super::*;
    use crate::error::DenialReason;
    use crate::event::EventKind;

    /// The reason of a policy refusal, or a failure naming what came instead.
    fn denial(result: Result<Task, DelegationError>) -> DenialReason {
        match result {
            Err(DelegationError::Denied(denied)) => denied.reason,
            other => panic!("expected a policy refusal, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_delegation_without_a_link_is_refused_and_creates_nothing() {
        let (h, _llm) = harness("").await;
        let refused = h
            .org
            .delegate(&id("a"), "x", "Pick a word.", origin())
            .await;
        assert_eq!(denial(refused), DenialReason::NoLink);
        assert!(board(&h, "x").await.is_empty());
        // An unknown target names the agents the delegator may reach instead.
        match h
            .org
            .delegate(&id("a"), "zed", "Pick a word.", origin())
            .await
        {
            Err(DelegationError::UnknownAgent { target, reachable }) => {
                assert_eq!(target, "zed");
                assert_eq!(reachable, vec!["b (Beta)".to_string(), "c (Gamma)".into()]);
            }
            other => panic!("expected UnknownAgent, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_delegation_back_into_its_own_chain_is_refused_as_a_cycle() {
        let (h, _llm) = harness("").await;
        h.org
            .delegate(&id("a"), "b", "Find a word.", origin())
            .await
            .unwrap();
        let b1 = claim(&h, "b", "b:worker:t:1").await;
        let c1 = h
            .org
            .delegate(&id("b"), "Gamma", "Pick one.", origin_in(&b1))
            .await
            .unwrap();
        assert_eq!(c1.metadata.delegation_chain, vec![id("a"), id("b")]);
        assert_eq!(c1.metadata.parent_task, Some(b1.task_ref()));
        let c1 = claim(&h, "c", "c:worker:t:1").await;
        let refused = h
            .org
            .delegate(&id("c"), "a", "Back to you.", origin_in(&c1))
            .await;
        assert_eq!(
            denial(refused),
            DenialReason::Cycle {
                chain: vec![id("a"), id("b"), id("c")]
            }
        );
        assert!(board(&h, "a").await.is_empty(), "nothing created on a");
    }

    #[tokio::test]
    async fn a_chain_past_the_depth_limit_is_refused() {
        let (h, _llm) = harness("max_delegation_depth = 1").await;
        h.org
            .delegate(&id("a"), "b", "Find a word.", origin())
            .await
            .unwrap();
        let b1 = claim(&h, "b", "b:worker:t:1").await;
        let refused = h
            .org
            .delegate(&id("b"), "c", "Pick one.", origin_in(&b1))
            .await;
        assert_eq!(denial(refused), DenialReason::DepthExceeded { limit: 1 });
        assert!(board(&h, "c").await.is_empty());
        // The parent records no child for the refused delegation.
        let b1 = h.stores.tasks.get(&id("b"), 1).await.unwrap().unwrap();
        assert!(b1.metadata.children.is_empty());
    }

    #[tokio::test]
    async fn only_the_worker_of_a_task_in_progress_delegates_from_it() {
        let (h, _llm) = harness("").await;
        let b1 = h
            .org
            .delegate(&id("a"), "b", "Find a word.", origin())
            .await
            .unwrap();
        // b#1 is ready, not claimed: nobody works on it.
        let refused = h
            .org
            .delegate(&id("b"), "c", "Pick one.", origin_in(&b1))
            .await;
        assert!(
            matches!(refused, Err(DelegationError::Invalid(_))),
            "{refused:?}"
        );
        assert!(board(&h, "c").await.is_empty());
    }

    #[tokio::test]
    async fn empty_messages_and_rounds_past_the_limit_are_refused() {
        let (h, _llm) = harness("max_delegation_depth = 2").await;
        let empty = h.org.delegate(&id("a"), "b", "  \n", origin()).await;
        assert!(
            matches!(empty, Err(DelegationError::Invalid(_))),
            "{empty:?}"
        );
        let late = DelegationOrigin {
            round: 4,
            ..origin()
        };
        match h.org.delegate(&id("a"), "b", "Again.", late).await {
            Err(DelegationError::RoundLimit { agent, limit }) => {
                assert_eq!((agent, limit), (id("a"), 4));
            }
            other => panic!("expected RoundLimit, got {other:?}"),
        }
        assert!(board(&h, "b").await.is_empty());
    }

    #[tokio::test]
    async fn a_repeated_idempotency_key_returns_the_same_task_once() {
        let (h, _llm) = harness("").await;
        let keyed = || DelegationOrigin {
            key: Some("turn-1:0:0".into()),
            ..origin()
        };
        let first = h
            .org
            .delegate(&id("a"), "b", "Pick a word. Then tell me.", keyed())
            .await
            .unwrap();
        assert_eq!(first.title, "Pick a word.");
        assert_eq!(first.status, TaskStatus::Ready);
        assert_eq!(first.metadata.delegated_by, Some(id("a")));
        let again = h
            .org
            .delegate(&id("a"), "b", "Pick a word. Then tell me.", keyed())
            .await
            .unwrap();
        assert_eq!(again.number, first.number);
        assert_eq!(board(&h, "b").await.len(), 1);
        assert_eq!(
            h.count(|k| matches!(k, EventKind::TaskCreated { .. })),
            1,
            "told once"
        );
        // The assignment is written once on each side of the link.
        for (owner, peer) in [("a", "b"), ("b", "a")] {
            let records = h
                .history(owner, &ChannelId::link(&id(owner), &id(peer)))
                .await;
            assert_eq!(records.len(), 1, "{owner}'s side: {records:?}");
            assert_eq!(
                records[0].record.content.as_str(),
                "a assigned task #1 to b: Pick a word."
            );
        }
        // Another key is another delegation.
        let other = DelegationOrigin {
            key: Some("turn-2:0:0".into()),
            ..origin()
        };
        let second = h
            .org
            .delegate(&id("a"), "b", "Pick a word.", other)
            .await
            .unwrap();
        assert_eq!(second.number, first.number + 1);
    }
}
