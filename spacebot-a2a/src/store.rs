//! The A2A tasks this organization serves, kept in the organization's records (durable on every
//! backend): one record per task (namespace [`TASKS_NAMESPACE`]) and one per message id
//! (namespace [`MESSAGES_NAMESPACE`]), written once by compare-and-set, so a message sent again
//! finds its task.

use serde::{Deserialize, Serialize};
use spacebot_core::{AgentId, Expect, Records, StoreError, Timestamp, WriteOutcome};

use crate::types::{Artifact, Message, Part, Role, Task, TaskState, TaskStatus, rfc3339};

/// The records namespace of the tasks.
pub const TASKS_NAMESPACE: &str = "a2a_tasks";
/// The records namespace of the message ids (`{agent}/{message id}` to a task id).
pub const MESSAGES_NAMESPACE: &str = "a2a_messages";
/// The author of the records this crate writes.
const AUTHOR: &str = "a2a";

/// One A2A task served by this organization: the message delivered to an agent and the reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct TaskRecord {
    /// The task's id.
    pub id: String,
    /// Its conversation.
    pub context_id: String,
    /// The agent asked.
    pub agent: AgentId,
    /// Where it is.
    pub state: TaskState,
    /// The client's message.
    pub request: Message,
    /// The agent's answer (completed), or why it failed, was rejected or canceled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    /// What it waits for while `input-required` (an operator's approval of a task of its
    /// request): its status message then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<String>,
    /// When the state last changed (milliseconds since the epoch).
    pub updated_ms: i64,
}

impl TaskRecord {
    /// The task as A2A shows it: the client's message and the agent's reply as its history, the
    /// answer as an artifact and as the status message.
    pub fn to_task(&self, history_length: Option<i64>) -> Task {
        let reply = self.answer.as_ref().map(|text| Message {
            message_id: format!("{}-reply", self.id),
            context_id: self.context_id.clone(),
            task_id: self.id.clone(),
            role: Role::Agent,
            parts: vec![Part::text(text.clone())],
            metadata: None,
        });
        let mut request = self.request.clone();
        request.task_id.clone_from(&self.id);
        request.context_id.clone_from(&self.context_id);
        let mut history = vec![request];
        history.extend(reply.clone());
        if let Some(n) = history_length {
            let keep = usize::try_from(n.max(0)).unwrap_or(0);
            let drop = history.len().saturating_sub(keep);
            history.drain(..drop);
        }
        let artifacts = match (&self.state, &self.answer) {
            (TaskState::Completed, Some(text)) => vec![Artifact {
                artifact_id: format!("{}-answer", self.id),
                name: "answer".into(),
                parts: vec![Part::text(text.clone())],
            }],
            _ => Vec::new(),
        };
        Task {
            id: self.id.clone(),
            context_id: self.context_id.clone(),
            status: self.status(),
            artifacts,
            history,
            metadata: None,
        }
    }

    /// The task's status (with the answer as its message once there is one; what it waits for
    /// while `input-required`).
    pub fn status(&self) -> TaskStatus {
        if self.state == TaskState::InputRequired
            && let Some(waiting) = &self.waiting
        {
            return TaskStatus {
                state: self.state,
                message: Some(Message {
                    message_id: format!("{}-waiting", self.id),
                    context_id: self.context_id.clone(),
                    task_id: self.id.clone(),
                    role: Role::Agent,
                    parts: vec![Part::text(waiting.clone())],
                    metadata: None,
                }),
                timestamp: Some(rfc3339(self.updated_ms)),
            };
        }
        TaskStatus {
            state: self.state,
            message: self.answer.as_ref().map(|text| Message {
                message_id: format!("{}-reply", self.id),
                context_id: self.context_id.clone(),
                task_id: self.id.clone(),
                role: Role::Agent,
                parts: vec![Part::text(text.clone())],
                metadata: None,
            }),
            timestamp: Some(rfc3339(self.updated_ms)),
        }
    }
}

/// What a message id points at.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct MessageRecord {
    task: String,
}

/// The tasks and message ids, over the organization's records.
#[derive(Debug, Clone)]
pub(crate) struct TaskStore {
    tasks: Records<TaskRecord>,
    messages: Records<MessageRecord>,
}

impl TaskStore {
    pub(crate) fn new(
        records: std::sync::Arc<dyn spacebot_core::RecordStore>,
    ) -> Result<Self, StoreError> {
        Ok(Self {
            tasks: Records::new(records.clone(), TASKS_NAMESPACE)?,
            messages: Records::new(records, MESSAGES_NAMESPACE)?,
        })
    }

    pub(crate) async fn get(&self, id: &str) -> Result<Option<TaskRecord>, StoreError> {
        Ok(self.tasks.get(id).await?.map(|r| r.value))
    }

    /// Stores `task` (a new id) and binds `message_key` to it, once: when the key was bound
    /// before, the task it points at is returned and `false` (nothing new).
    pub(crate) async fn create(
        &self,
        task: TaskRecord,
        message_key: &str,
        now: Timestamp,
    ) -> Result<(TaskRecord, bool), StoreError> {
        // The message id first: of two clients racing with one id exactly one binds it.
        let bind = self
            .messages
            .draft(
                message_key,
                &MessageRecord {
                    task: task.id.clone(),
                },
                AUTHOR,
            )?
            .expect(Expect::Absent)
            .at(now);
        match self.messages.write(bind).await? {
            WriteOutcome::Written(_) => {}
            WriteOutcome::AlreadyApplied(r) | WriteOutcome::Conflict { current: Some(r) } => {
                // Bound before: that task (it may still be being stored by the first sender).
                for _ in 0..50 {
                    if let Some(existing) = self.get(&r.value.task).await? {
                        return Ok((existing, false));
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                return Err(StoreError::Corrupt {
                    location: format!("record {MESSAGES_NAMESPACE}/{message_key:?}"),
                    reason: format!("it names the task {} that does not exist", r.value.task),
                });
            }
            WriteOutcome::Conflict { current: None } => {
                return Err(StoreError::Corrupt {
                    location: format!("record {MESSAGES_NAMESPACE}/{message_key:?}"),
                    reason: "a conflict without a current record".into(),
                });
            }
        }
        let write = self
            .tasks
            .draft(&task.id, &task, AUTHOR)?
            .expect(Expect::Absent)
            .at(now);
        self.tasks.write(write).await?;
        Ok((task, true))
    }

    /// Changes the task `id` with `change` (compare-and-set, retried on a conflict). `change`
    /// returns whether it changed anything; a terminal task is never changed. Returns the task
    /// as it is after, and whether this call changed it.
    pub(crate) async fn update(
        &self,
        id: &str,
        now: Timestamp,
        mut change: impl FnMut(&mut TaskRecord) -> bool,
    ) -> Result<Option<(TaskRecord, bool)>, StoreError> {
        loop {
            let Some(current) = self.tasks.get(id).await? else {
                return Ok(None);
            };
            let mut task = current.value.clone();
            if task.state.is_terminal() || !change(&mut task) {
                return Ok(Some((current.value, false)));
            }
            task.updated_ms = now.as_millis();
            let write = self
                .tasks
                .draft(id, &task, AUTHOR)?
                .expect(Expect::Version(current.version))
                .at(now);
            match self.tasks.write(write).await? {
                WriteOutcome::Written(_) | WriteOutcome::AlreadyApplied(_) => {
                    return Ok(Some((task, true)));
                }
                WriteOutcome::Conflict { .. } => continue,
            }
        }
    }
}
