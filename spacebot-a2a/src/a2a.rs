//! The shared handle: the behaviour that claims the A2A fields and the outbound that completes
//! the A2A tasks with the agents' replies.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};

use async_trait::async_trait;
use spacebot_core::runtime::OutboundError;
use spacebot_core::{
    AgentId, Behaviour, BehaviourContext, Clock, EnvelopeId, Event, EventKind, EventSubscription,
    Outbound, Reply, ReplyKind, Source, Task, TaskRef, TaskStatus,
};
use tokio::sync::broadcast;

use crate::config::{A2aConfig, EXPOSE_FIELD, TOKEN_FIELD, URL_FIELD};
use crate::store::TaskStore;
use crate::types::TaskState;

/// The platform of the messages A2A clients send; a message's reply target is its task's id.
pub const PLATFORM: &str = "a2a";

pub(crate) struct Attached {
    pub(crate) store: TaskStore,
    /// The organization's task boards (what an approval waits on).
    pub(crate) boards: Arc<dyn spacebot_core::TaskStore>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) config: A2aConfig,
}

#[derive(Default)]
struct Inner {
    fallback: RwLock<Option<Arc<dyn Outbound>>>,
    attached: OnceLock<Attached>,
    /// Task ids whose record changed in this process.
    changed: OnceLock<broadcast::Sender<String>>,
    /// The task whose turn each agent runs now (from the events).
    running: Mutex<HashMap<AgentId, String>>,
    /// The user request (the envelope delivered) behind each A2A task whose turn started here.
    requests: Mutex<HashMap<EnvelopeId, String>>,
    /// The tasks of those requests waiting for an operator's approval: the A2A task and what
    /// waits.
    approvals: Mutex<HashMap<TaskRef, (String, String)>>,
    watching: OnceLock<()>,
}

/// The A2A handle: give it to the organization's builder as a behaviour (it claims the
/// `[[agents]]` fields `a2a_expose`, `a2a` and `token`) **and** as the outbound (it completes
/// each A2A task with the reply of its agent; replies to other platforms go to the fallback).
/// Then serve it with [`A2aServer`](crate::A2aServer). Cheap to clone.
///
/// ```
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use std::sync::Arc;
/// use spacebot_core::{OrgConfig, Organization, Stores, testing::ScriptedLlm};
///
/// let a2a = spacebot_a2a::A2a::new();
/// let org = Organization::builder(OrgConfig::from_toml_str(
///     "[[agents]]\nid = \"front\"\na2a_expose = true\n",
/// )?)
/// .stores(Stores::memory())
/// .llm(Arc::new(ScriptedLlm::new()))
/// .behaviour(Arc::new(a2a.clone()))
/// .outbound(Arc::new(a2a.clone()))
/// .build()
/// .await?;
/// let server = spacebot_a2a::A2aServer::new(org, a2a)?;
/// assert_eq!(server.exposed().len(), 1);
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct A2a {
    inner: Arc<Inner>,
}

impl fmt::Debug for A2a {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("A2a")
            .field("attached", &self.inner.attached.get().is_some())
            .finish_non_exhaustive()
    }
}

impl A2a {
    /// A handle, not attached to an organization yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sends the replies to platforms other than [`PLATFORM`] to `outbound` (spacebot-http's
    /// `WebChat`, an `McpChat`, ...); without one they are dropped with a warning.
    pub fn with_fallback(self, outbound: Arc<dyn Outbound>) -> Self {
        *self
            .inner
            .fallback
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Some(outbound);
        self
    }

    pub(crate) fn attached(&self) -> Option<&Attached> {
        self.inner.attached.get()
    }

    pub(crate) fn changes(&self) -> broadcast::Receiver<String> {
        self.sender().subscribe()
    }

    fn sender(&self) -> &broadcast::Sender<String> {
        self.inner
            .changed
            .get_or_init(|| broadcast::channel(1024).0)
    }

    pub(crate) fn notify(&self, task: &str) {
        let _ = self.sender().send(task.to_owned());
    }

    /// Whether `agent` runs the turn of task `task` now.
    pub(crate) fn runs(&self, agent: &AgentId, task: &str) -> bool {
        lock(&self.inner.running)
            .get(agent)
            .is_some_and(|t| t == task)
    }

    /// Follows the organization's events (once per handle): a task's turn started makes it
    /// working.
    pub(crate) fn watch(&self, events: EventSubscription) {
        if self.inner.watching.set(()).is_err() {
            return;
        }
        let this = self.clone();
        tokio::spawn(async move { this.follow(events).await });
    }

    async fn follow(self, mut events: EventSubscription) {
        loop {
            let event = match events.recv().await {
                Ok(event) => event,
                Err(spacebot_core::bus::RecvError::Lagged { .. }) => continue,
                Err(_) => return,
            };
            if event.task.is_some() {
                self.follow_approval(&event).await;
            }
            let Some(task) = event
                .channel
                .as_ref()
                .and_then(|c| c.as_str().strip_prefix("a2a:"))
                .map(str::to_owned)
            else {
                continue;
            };
            match event.kind {
                EventKind::TurnStarted => {
                    if let Some(request) = &event.request {
                        lock(&self.inner.requests).insert(request.clone(), task.clone());
                    }
                    lock(&self.inner.running).insert(event.agent.clone(), task.clone());
                    self.set_state(&task, TaskState::Working, None).await;
                }
                EventKind::TurnFinished { .. } | EventKind::TurnCancelled => {
                    let mut running = lock(&self.inner.running);
                    if running.get(&event.agent) == Some(&task) {
                        running.remove(&event.agent);
                    }
                }
                _ => {}
            }
        }
    }

    /// A task of a request behind an A2A task waits for approval: the A2A task is
    /// `input-required` while it waits, `working` again once it is claimed (approved), `rejected`
    /// when it is cancelled (rejected) instead.
    async fn follow_approval(&self, event: &Event) {
        let Some(task_ref) = &event.task else {
            return;
        };
        match &event.kind {
            EventKind::TaskCreated {
                status: TaskStatus::PendingApproval,
                ..
            } => {
                let Some(a2a_task) = event
                    .request
                    .as_ref()
                    .and_then(|r| lock(&self.inner.requests).get(r).cloned())
                else {
                    return;
                };
                let what = self.describe(task_ref).await;
                lock(&self.inner.approvals).insert(task_ref.clone(), (a2a_task.clone(), what));
                self.show_waits(&a2a_task).await;
            }
            EventKind::TaskClaimed { .. }
            | EventKind::TaskCompleted
            | EventKind::TaskFailed { .. } => {
                let Some((a2a_task, _)) = lock(&self.inner.approvals).remove(task_ref) else {
                    return;
                };
                self.show_waits(&a2a_task).await;
            }
            EventKind::TaskCancelled => {
                // Forgotten only once rejected: until then, an answer of the agent finds it
                // (`rejected_before`).
                let Some((a2a_task, what)) = lock(&self.inner.approvals).get(task_ref).cloned()
                else {
                    return;
                };
                let error = self.board_task(task_ref).await.and_then(|t| t.error);
                self.reject(&a2a_task, &what, error).await;
                lock(&self.inner.approvals).remove(task_ref);
            }
            _ => {}
        }
    }

    /// The task `task_ref` of an organization's board, if this handle is attached and it is
    /// there.
    async fn board_task(&self, task_ref: &TaskRef) -> Option<Task> {
        self.attached()?
            .boards
            .get(&task_ref.agent, task_ref.number)
            .await
            .ok()
            .flatten()
    }

    /// The A2A task is rejected: the approval of a task of its request (`what`) was refused,
    /// for the reason the task ended with (`error`).
    async fn reject(&self, a2a_task: &str, what: &str, error: Option<String>) {
        let reason = error.map(|r| format!(" ({r})")).unwrap_or_default();
        self.set_state(
            a2a_task,
            TaskState::Rejected,
            Some(format!("refused: {what} was not approved{reason}")),
        )
        .await;
    }

    /// Whether an approval the A2A task waited for was refused, though the event saying so may
    /// not have been followed yet: then the task is rejected now. The agent answers the refusal
    /// at once, and its answer must not complete a task whose approval was refused, whichever of
    /// the two this handle sees first.
    async fn rejected_before(&self, a2a_task: &str) -> bool {
        let waits: Vec<(TaskRef, String)> = lock(&self.inner.approvals)
            .iter()
            .filter(|(_, (t, _))| t == a2a_task)
            .map(|(r, (_, what))| (r.clone(), what.clone()))
            .collect();
        for (task_ref, what) in waits {
            let Some(task) = self.board_task(&task_ref).await else {
                continue;
            };
            if task.status == TaskStatus::Cancelled {
                self.reject(a2a_task, &what, task.error).await;
                lock(&self.inner.approvals).remove(&task_ref);
                return true;
            }
        }
        false
    }

    /// What waits, said to the client: the task, its assignee, who delegated it.
    async fn describe(&self, task_ref: &TaskRef) -> String {
        match self.board_task(task_ref).await {
            Some(task) => {
                let by = task
                    .metadata
                    .delegated_by
                    .map(|a| format!(", delegated by {a}"))
                    .unwrap_or_default();
                format!("task {task_ref} ({:?}{by})", task.title)
            }
            None => format!("task {task_ref}"),
        }
    }

    /// The A2A task is `input-required` with what waits while an approval of its request waits,
    /// else `working` again.
    async fn show_waits(&self, a2a_task: &str) {
        let waits: Vec<String> = {
            let approvals = lock(&self.inner.approvals);
            let mut waits: Vec<(&TaskRef, &String)> = approvals
                .iter()
                .filter(|(_, (t, _))| t == a2a_task)
                .map(|(r, (_, what))| (r, what))
                .collect();
            waits.sort();
            waits.into_iter().map(|(_, what)| what.clone()).collect()
        };
        let waiting = (!waits.is_empty())
            .then(|| format!("waiting for an operator's approval of {}", waits.join("; ")));
        self.set_waiting(a2a_task, waiting).await;
    }

    /// `Some`: the task waits for input (`input-required`, `waiting` its status message); `None`:
    /// a task that waited is `working` again. A task that ended is left as it is.
    pub(crate) async fn set_waiting(&self, task: &str, waiting: Option<String>) {
        let Some(attached) = self.attached() else {
            return;
        };
        let result = attached
            .store
            .update(task, attached.clock.now(), |t| match &waiting {
                Some(text) => {
                    if t.state == TaskState::InputRequired && t.waiting.as_ref() == Some(text) {
                        return false;
                    }
                    t.state = TaskState::InputRequired;
                    t.waiting = Some(text.clone());
                    true
                }
                None if t.state == TaskState::InputRequired => {
                    t.state = TaskState::Working;
                    t.waiting = None;
                    true
                }
                None => false,
            })
            .await;
        match result {
            Ok(Some((_, true))) => self.notify(task),
            Ok(_) => {}
            Err(e) => tracing::warn!(task, "A2A task could not be updated: {e}"),
        }
    }

    /// Moves a task that is not terminal to `state` (with `answer`), and says so.
    pub(crate) async fn set_state(&self, task: &str, state: TaskState, answer: Option<String>) {
        let Some(attached) = self.attached() else {
            return;
        };
        let now = attached.clock.now();
        let result = attached
            .store
            .update(task, now, |t| {
                // A task that ended stays as it ended.
                if t.state.is_terminal() || (t.state == state && t.answer == answer) {
                    return false;
                }
                // A task is never moved back to working once it waits for input or ended.
                if state == TaskState::Working && t.state != TaskState::Submitted {
                    return false;
                }
                t.state = state;
                if answer.is_some() {
                    t.answer.clone_from(&answer);
                }
                true
            })
            .await;
        match result {
            Ok(Some((_, true))) => self.notify(task),
            Ok(_) => {}
            Err(e) => tracing::warn!(task, "A2A task could not be updated: {e}"),
        }
        if state.is_terminal() {
            self.forget(task);
        }
    }

    /// Forgets what is followed for a task that ended.
    fn forget(&self, task: &str) {
        lock(&self.inner.requests).retain(|_, t| t != task);
        lock(&self.inner.approvals).retain(|_, (t, _)| t != task);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[async_trait]
impl Outbound for A2a {
    async fn send(&self, reply: Reply) -> Result<(), OutboundError> {
        let task = match &reply.source {
            Source::External {
                platform,
                reply_target,
            } if platform == PLATFORM => reply_target.clone(),
            _ => {
                let fallback = self
                    .inner
                    .fallback
                    .read()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone();
                return match fallback {
                    Some(fallback) => fallback.send(reply).await,
                    None => {
                        tracing::warn!(agent = %reply.agent, "a reply to a platform other than a2a, and A2a has no fallback: dropped");
                        Ok(())
                    }
                };
            }
        };
        let state = if reply.kind == ReplyKind::Answer {
            TaskState::Completed
        } else {
            TaskState::Failed
        };
        let Some(attached) = self.attached() else {
            return Err(OutboundError::Closed(
                "the A2A handle is not attached to an organization".into(),
            ));
        };
        if self.rejected_before(&task).await {
            return Ok(());
        }
        let content = reply.content.to_string();
        attached
            .store
            .update(&task, attached.clock.now(), |t| {
                // Rejected or canceled before the agent answered: it stays so.
                if t.state.is_terminal() {
                    return false;
                }
                t.state = state;
                t.answer = Some(content.clone());
                true
            })
            .await
            .map_err(|e| OutboundError::Closed(format!("the A2A task {task}: {e}")))?;
        self.forget(&task);
        self.notify(&task);
        Ok(())
    }
}

#[async_trait]
impl Behaviour for A2a {
    fn name(&self) -> &'static str {
        "a2a"
    }

    fn agent_fields(&self) -> &'static [&'static str] {
        &[EXPOSE_FIELD, URL_FIELD, TOKEN_FIELD]
    }

    async fn on_build(&self, ctx: &BehaviourContext) -> Result<(), spacebot_core::OrgError> {
        let config = A2aConfig::from_org(ctx.config())?;
        let store = TaskStore::new(ctx.stores().records.clone())?;
        let attached = Attached {
            store,
            boards: ctx.stores().tasks.clone(),
            clock: ctx.clock().clone(),
            config,
        };
        if self.inner.attached.set(attached).is_err() {
            tracing::warn!(
                "this A2a handle is already attached to an organization; give each organization its own"
            );
        }
        Ok(())
    }
}
