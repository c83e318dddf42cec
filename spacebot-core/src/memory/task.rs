//! The in-memory [`TaskStore`].

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;

use super::lock;
use crate::error::StoreError;
use crate::ids::{AgentId, TaskRef};
use crate::task::{
    CompletionNotice, Expect, NewTask, Priority, Task, TaskEvent, TaskFilter, TaskStatus,
    TaskStore, Transition,
};
use crate::time::Timestamp;

/// One agent's board and outbox.
#[derive(Debug, Default)]
struct Board {
    /// The last number handed out.
    last_number: u64,
    tasks: BTreeMap<u64, Task>,
    /// Idempotency key of a create -> the number of the task it created.
    keys: HashMap<String, u64>,
    /// Unsent notices, in write order.
    outbox: Vec<CompletionNotice>,
    /// Ready tasks in claim order (highest priority, then lowest number): a claim does not scan
    /// the board, however many tasks it accumulated.
    ready: BTreeSet<(Reverse<Priority>, u64)>,
    /// Tasks in progress (the ones a lease can expire on).
    in_progress: BTreeSet<u64>,
}

impl Board {
    fn unindex(&mut self, task: &Task) {
        match task.status {
            TaskStatus::Ready => {
                self.ready.remove(&(Reverse(task.priority), task.number));
            }
            TaskStatus::InProgress => {
                self.in_progress.remove(&task.number);
            }
            _ => {}
        }
    }

    fn index(&mut self, task: &Task) {
        match task.status {
            TaskStatus::Ready => {
                self.ready.insert((Reverse(task.priority), task.number));
            }
            TaskStatus::InProgress => {
                self.in_progress.insert(task.number);
            }
            _ => {}
        }
    }

    /// Stores a task, keeping the indexes in step.
    fn put(&mut self, task: Task) {
        if let Some(old) = self.tasks.get(&task.number).cloned() {
            self.unindex(&old);
        }
        self.index(&task);
        self.tasks.insert(task.number, task);
    }

    /// Stores the outcome of an applied event: the task and its notice, together.
    fn commit(&mut self, transition: &Transition) {
        self.put(transition.task.clone());
        if let Some(notice) = &transition.notice {
            self.outbox.push(notice.clone());
        }
    }
}

/// A [`TaskStore`] in process memory: one board per agent, all behind one lock.
#[derive(Debug, Default)]
pub struct MemoryTaskStore {
    boards: Mutex<crate::fasthash::FastMap<AgentId, Board>>,
}

impl MemoryTaskStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }
}

fn task_name(agent: &AgentId, number: u64) -> String {
    format!("task {}", TaskRef::new(agent.clone(), number))
}

#[async_trait]
impl TaskStore for MemoryTaskStore {
    async fn create(
        &self,
        agent: &AgentId,
        task: NewTask,
        now: Timestamp,
    ) -> Result<Task, StoreError> {
        let mut boards = lock(&self.boards);
        let board = boards.entry(agent.clone()).or_default();
        let key = task.idempotency_key.clone();
        if let Some(existing) = key
            .as_ref()
            .and_then(|k| board.keys.get(k))
            .and_then(|n| board.tasks.get(n))
        {
            return Ok(existing.clone());
        }
        let number = board.last_number + 1;
        let task = task.into_task(agent.clone(), number, now)?;
        board.last_number = number;
        board.put(task.clone());
        if let Some(key) = key {
            board.keys.insert(key, number);
        }
        Ok(task)
    }

    async fn get(&self, agent: &AgentId, number: u64) -> Result<Option<Task>, StoreError> {
        let boards = lock(&self.boards);
        Ok(boards
            .get(agent)
            .and_then(|b| b.tasks.get(&number))
            .cloned())
    }

    async fn list(&self, agent: &AgentId, filter: &TaskFilter) -> Result<Vec<Task>, StoreError> {
        let boards = lock(&self.boards);
        let Some(board) = boards.get(agent) else {
            return Ok(Vec::new());
        };
        Ok(board
            .tasks
            .values()
            .filter(|t| filter.matches(t))
            .take(filter.limit.unwrap_or(usize::MAX))
            .cloned()
            .collect())
    }

    async fn transition(
        &self,
        agent: &AgentId,
        number: u64,
        expect: Expect,
        event: TaskEvent,
        now: Timestamp,
    ) -> Result<Transition, StoreError> {
        let mut boards = lock(&self.boards);
        let board = boards
            .get_mut(agent)
            .ok_or_else(|| StoreError::not_found(task_name(agent, number)))?;
        let task = board
            .tasks
            .get(&number)
            .ok_or_else(|| StoreError::not_found(task_name(agent, number)))?;
        expect.check(task)?;
        let transition = task.apply(event, now)?;
        board.commit(&transition);
        Ok(transition)
    }

    async fn claim_next(
        &self,
        agent: &AgentId,
        holder: &str,
        lease: Duration,
        now: Timestamp,
    ) -> Result<Option<Task>, StoreError> {
        let mut boards = lock(&self.boards);
        let Some(board) = boards.get_mut(agent) else {
            return Ok(None);
        };
        let Some(next) = board
            .ready
            .first()
            .and_then(|(_, number)| board.tasks.get(number))
        else {
            return Ok(None);
        };
        let event = TaskEvent::Claim {
            holder: holder.to_string(),
            lease_until: now.plus(lease),
        };
        let transition = next.apply(event, now)?;
        board.commit(&transition);
        Ok(Some(transition.task))
    }

    async fn requeue_expired(
        &self,
        agent: &AgentId,
        now: Timestamp,
    ) -> Result<Vec<Transition>, StoreError> {
        let mut boards = lock(&self.boards);
        let Some(board) = boards.get_mut(agent) else {
            return Ok(Vec::new());
        };
        // Compute every transition first, then write them all: nothing is half-applied.
        let transitions = board
            .in_progress
            .iter()
            .filter_map(|n| board.tasks.get(n))
            .filter(|t| t.status == TaskStatus::InProgress && t.lease_expired(now))
            .map(|t| t.apply(TaskEvent::ExpireLease, now))
            .collect::<Result<Vec<_>, _>>()?;
        for transition in &transitions {
            board.commit(transition);
        }
        Ok(transitions)
    }

    async fn outbox_pending(&self, agent: &AgentId) -> Result<Vec<CompletionNotice>, StoreError> {
        let boards = lock(&self.boards);
        Ok(boards
            .get(agent)
            .map(|b| b.outbox.clone())
            .unwrap_or_default())
    }

    async fn outbox_mark_sent(&self, agent: &AgentId, key: &str) -> Result<(), StoreError> {
        let mut boards = lock(&self.boards);
        if let Some(board) = boards.get_mut(agent) {
            board.outbox.retain(|n| n.key != key);
        }
        Ok(())
    }
}
