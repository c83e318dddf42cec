//! Task board, outbox, channel history and deliveries, in `agents/{id}/spacebot.redb`.

use std::time::Duration;

use redb::{ReadableTable, ReadableTableMetadata, Table};
use spacebot_core::task::{
    CompletionNotice, Expect, NewTask, Task, TaskEvent, TaskFilter, TaskStatus, Transition,
};
use spacebot_core::{
    AgentId, ChannelId, ChannelRecord, Envelope, EnvelopeId, NewRecord, StoreError, Timestamp,
    TurnCommit,
};

use crate::tables::encode;
use crate::worker::Txn;

/// The key of a ready task in the ready index: ascending order is highest priority, then lowest number.
fn ready_key(task: &Task) -> (u8, u64) {
    let rank = u8::try_from(task.priority.rank()).unwrap_or(0);
    (3u8.saturating_sub(rank), task.number)
}

/// The key of an in-progress task in the lease index.
fn lease_key(task: &Task) -> Option<(i64, u64)> {
    match (&task.status, &task.lease) {
        (TaskStatus::InProgress, Some(lease)) => Some((lease.expires_at.as_millis(), task.number)),
        _ => None,
    }
}

fn next_key<T: ReadableTable<u64, V>, V: redb::Value + 'static>(
    table: &T,
) -> Result<u64, redb::StorageError> {
    Ok(table.last()?.map(|(k, _)| k.value() + 1).unwrap_or(1))
}

impl Txn<'_> {
    fn read_task(
        &self,
        tasks: &Table<'_, u64, &[u8]>,
        agent: &AgentId,
        number: u64,
    ) -> Result<Option<Task>, StoreError> {
        match tasks.get(number).map_err(self.err("read a task"))? {
            Some(v) => Ok(Some(
                self.decode(format_args!("task {agent}#{number}"), v.value())?,
            )),
            None => Ok(None),
        }
    }

    /// Writes `next` (replacing `previous`), keeps the indexes in step and stores the notice.
    fn write_task(
        &self,
        tasks: &mut Table<'_, u64, &[u8]>,
        previous: Option<&Task>,
        next: &Task,
        notice: Option<&CompletionNotice>,
    ) -> Result<(), StoreError> {
        let e = self.err("write a task");
        let bytes = encode(next)?;
        let mut ready = self.ready()?;
        let mut leases = self.leases()?;
        if let Some(prev) = previous {
            if prev.status == TaskStatus::Ready {
                ready.remove(ready_key(prev)).map_err(&e)?;
            }
            if let Some(key) = lease_key(prev) {
                leases.remove(key).map_err(&e)?;
            }
        }
        if next.status == TaskStatus::Ready {
            ready.insert(ready_key(next), ()).map_err(&e)?;
        }
        if let Some(key) = lease_key(next) {
            leases.insert(key, ()).map_err(&e)?;
        }
        tasks.insert(next.number, bytes.as_slice()).map_err(&e)?;
        if let Some(notice) = notice {
            let bytes = encode(notice)?;
            let mut outbox = self.outbox()?;
            let seq = next_key(&*outbox).map_err(&e)?;
            outbox.insert(seq, bytes.as_slice()).map_err(&e)?;
            self.outbox_keys()?
                .insert(notice.key.as_str(), seq)
                .map_err(&e)?;
        }
        Ok(())
    }

    pub(crate) fn task_create(
        &self,
        agent: &AgentId,
        new: NewTask,
        now: Timestamp,
    ) -> Result<Task, StoreError> {
        let key = new.idempotency_key.clone();
        if let Some(key) = &key {
            let existing = self
                .task_keys()?
                .get(key.as_str())
                .map_err(self.err("look up an idempotency key"))?
                .map(|v| v.value());
            if let Some(number) = existing {
                return match self.task_get(agent, number)? {
                    Some(task) => Ok(task),
                    None => Err(StoreError::Corrupt {
                        location: self.path.display().to_string(),
                        reason: format!(
                            "idempotency key {key:?} names task {agent}#{number}, which is missing"
                        ),
                    }),
                };
            }
        }
        let mut tasks = self.tasks()?;
        let number = next_key(&*tasks).map_err(self.err("number a task"))?;
        let task = new.into_task(agent.clone(), number, now)?;
        self.write_task(&mut tasks, None, &task, None)?;
        if let Some(key) = &key {
            self.task_keys()?
                .insert(key.as_str(), number)
                .map_err(self.err("record an idempotency key"))?;
        }
        Ok(task)
    }

    pub(crate) fn task_get(
        &self,
        agent: &AgentId,
        number: u64,
    ) -> Result<Option<Task>, StoreError> {
        self.read_task(&*self.tasks()?, agent, number)
    }

    pub(crate) fn task_list(
        &self,
        agent: &AgentId,
        filter: &TaskFilter,
    ) -> Result<Vec<Task>, StoreError> {
        let e = self.err("list tasks");
        let tasks = self.tasks()?;
        let mut out = Vec::new();
        if filter.limit == Some(0) {
            return Ok(out);
        }
        for row in tasks.iter().map_err(&e)? {
            let (k, v) = row.map_err(&e)?;
            let task: Task = self.decode(format_args!("task {agent}#{}", k.value()), v.value())?;
            if filter.matches(&task) {
                out.push(task);
                if filter.limit.is_some_and(|l| out.len() >= l) {
                    break;
                }
            }
        }
        Ok(out)
    }

    pub(crate) fn task_transition(
        &self,
        agent: &AgentId,
        number: u64,
        expect: Expect,
        event: TaskEvent,
        now: Timestamp,
    ) -> Result<Transition, StoreError> {
        let mut tasks = self.tasks()?;
        let Some(task) = self.read_task(&tasks, agent, number)? else {
            return Err(StoreError::not_found(format!("task {agent}#{number}")));
        };
        expect.check(&task)?;
        let transition = task.apply(event, now)?;
        self.write_task(
            &mut tasks,
            Some(&task),
            &transition.task,
            transition.notice.as_ref(),
        )?;
        Ok(transition)
    }

    pub(crate) fn task_claim_next(
        &self,
        agent: &AgentId,
        holder: &str,
        lease: Duration,
        now: Timestamp,
    ) -> Result<Option<Task>, StoreError> {
        let first = self
            .ready()?
            .first()
            .map_err(self.err("find a ready task"))?
            .map(|(k, _)| k.value().1);
        let Some(number) = first else {
            return Ok(None);
        };
        let mut tasks = self.tasks()?;
        let Some(task) = self.read_task(&tasks, agent, number)? else {
            return Err(StoreError::Corrupt {
                location: self.path.display().to_string(),
                reason: format!("the ready index names task {agent}#{number}, which is missing"),
            });
        };
        let event = TaskEvent::Claim {
            holder: holder.to_string(),
            lease_until: now.plus(lease),
        };
        let transition = task.apply(event, now)?;
        self.write_task(&mut tasks, Some(&task), &transition.task, None)?;
        Ok(Some(transition.task))
    }

    /// Whether a task is ready to be claimed.
    pub(crate) fn task_ready_exists(&self) -> Result<bool, StoreError> {
        Ok(self
            .ready()?
            .first()
            .map_err(self.err("find a ready task"))?
            .is_some())
    }

    /// Whether a lease expired at `now`.
    pub(crate) fn task_expired_exists(&self, now: Timestamp) -> Result<bool, StoreError> {
        let e = self.err("find expired leases");
        let leases = self.leases()?;
        let mut rows = leases
            .range((i64::MIN, 0u64)..=(now.as_millis(), u64::MAX))
            .map_err(&e)?;
        Ok(rows.next().transpose().map_err(&e)?.is_some())
    }

    pub(crate) fn task_requeue_expired(
        &self,
        agent: &AgentId,
        now: Timestamp,
    ) -> Result<Vec<Transition>, StoreError> {
        let e = self.err("find expired leases");
        let expired: Vec<u64> = {
            let leases = self.leases()?;
            let mut numbers = Vec::new();
            for row in leases
                .range((i64::MIN, 0u64)..=(now.as_millis(), u64::MAX))
                .map_err(&e)?
            {
                numbers.push(row.map_err(&e)?.0.value().1);
            }
            numbers
        };
        let mut tasks = self.tasks()?;
        let mut out = Vec::with_capacity(expired.len());
        for number in expired {
            let Some(task) = self.read_task(&tasks, agent, number)? else {
                continue;
            };
            if !task.lease_expired(now) || task.status != TaskStatus::InProgress {
                continue;
            }
            // Checked above, so the lifecycle accepts it; never fail after earlier writes.
            let Ok(transition) = task.apply(TaskEvent::ExpireLease, now) else {
                continue;
            };
            self.write_task(
                &mut tasks,
                Some(&task),
                &transition.task,
                transition.notice.as_ref(),
            )?;
            out.push(transition);
        }
        Ok(out)
    }

    pub(crate) fn outbox_pending(&self) -> Result<Vec<CompletionNotice>, StoreError> {
        let e = self.err("read the outbox");
        let outbox = self.outbox()?;
        let mut out = Vec::with_capacity(usize::try_from(outbox.len().map_err(&e)?).unwrap_or(0));
        for row in outbox.iter().map_err(&e)? {
            let (k, v) = row.map_err(&e)?;
            out.push(self.decode(format_args!("outbox row {}", k.value()), v.value())?);
        }
        Ok(out)
    }

    pub(crate) fn outbox_mark_sent(&self, key: &str) -> Result<(), StoreError> {
        let e = self.err("mark a notice sent");
        let seq = self
            .outbox_keys()?
            .remove(key)
            .map_err(&e)?
            .map(|v| v.value());
        if let Some(seq) = seq {
            self.outbox()?.remove(seq).map_err(&e)?;
        }
        Ok(())
    }

    // Channels.

    pub(crate) fn channel_append(
        &self,
        agent: &AgentId,
        record: NewRecord,
    ) -> Result<ChannelRecord, StoreError> {
        let e = self.err("append a record");
        let mut counters = self.counters()?;
        let seq = counters
            .get("history_seq")
            .map_err(&e)?
            .map(|v| v.value())
            .unwrap_or(0)
            + 1;
        let stored = ChannelRecord {
            seq,
            agent: agent.clone(),
            record,
        };
        let bytes = encode(&stored)?;
        counters.insert("history_seq", seq).map_err(&e)?;
        let channel = stored.record.channel.as_str();
        self.history()?
            .insert((channel, seq), bytes.as_slice())
            .map_err(&e)?;
        self.channels()?.insert(channel, ()).map_err(&e)?;
        Ok(stored)
    }

    pub(crate) fn channel_history(
        &self,
        channel: &ChannelId,
        limit: Option<usize>,
    ) -> Result<Vec<ChannelRecord>, StoreError> {
        let e = self.err("read a channel");
        let history = self.history()?;
        let range = history
            .range((channel.as_str(), 0u64)..=(channel.as_str(), u64::MAX))
            .map_err(&e)?;
        let decode = |row: Result<_, redb::StorageError>| -> Result<ChannelRecord, StoreError> {
            let (k, v): (
                redb::AccessGuard<'_, (&str, u64)>,
                redb::AccessGuard<'_, &[u8]>,
            ) = row.map_err(&e)?;
            self.decode(
                format_args!("record {} of {channel}", k.value().1),
                v.value(),
            )
        };
        match limit {
            None => range.map(decode).collect(),
            Some(limit) => {
                let mut out = range
                    .rev()
                    .take(limit)
                    .map(decode)
                    .collect::<Result<Vec<_>, _>>()?;
                out.reverse();
                Ok(out)
            }
        }
    }

    pub(crate) fn channel_ensure(&self, channel: &ChannelId) -> Result<(), StoreError> {
        let mut channels = self.channels()?;
        let e = self.err("register a channel");
        if channels.get(channel.as_str()).map_err(&e)?.is_none() {
            channels.insert(channel.as_str(), ()).map_err(&e)?;
        }
        Ok(())
    }

    pub(crate) fn channel_list(&self) -> Result<Vec<ChannelId>, StoreError> {
        let e = self.err("list channels");
        let channels = self.channels()?;
        let mut out = Vec::new();
        for row in channels.iter().map_err(&e)? {
            out.push(ChannelId::new(row.map_err(&e)?.0.value()));
        }
        Ok(out)
    }

    // Deliveries.

    pub(crate) fn delivery_persist(&self, envelope: &Envelope) -> Result<(), StoreError> {
        let e = self.err("persist a delivery");
        let mut ids = self.delivery_ids()?;
        if ids.get(envelope.id.as_str()).map_err(&e)?.is_some() {
            return Ok(());
        }
        let bytes = encode(envelope)?;
        let mut rows = self.deliveries()?;
        let order = next_key(&*rows).map_err(&e)?;
        rows.insert(order, bytes.as_slice()).map_err(&e)?;
        ids.insert(envelope.id.as_str(), order).map_err(&e)?;
        Ok(())
    }

    pub(crate) fn delivery_pending(&self) -> Result<Vec<Envelope>, StoreError> {
        let e = self.err("read deliveries");
        let rows = self.deliveries()?;
        let mut out = Vec::new();
        for row in rows.iter().map_err(&e)? {
            let (k, v) = row.map_err(&e)?;
            out.push(self.decode(format_args!("delivery {}", k.value()), v.value())?);
        }
        Ok(out)
    }

    pub(crate) fn delivery_remove(&self, id: &EnvelopeId) -> Result<(), StoreError> {
        let e = self.err("remove a delivery");
        let order = self
            .delivery_ids()?
            .remove(id.as_str())
            .map_err(&e)?
            .map(|v| v.value());
        if let Some(order) = order {
            self.deliveries()?.remove(order).map_err(&e)?;
        }
        Ok(())
    }

    pub(crate) fn mark_applied(&self, key: &str, now: Timestamp) -> Result<bool, StoreError> {
        let e = self.err("mark a key applied");
        let mut applied = self.applied()?;
        if applied.get(key).map_err(&e)?.is_some() {
            return Ok(false);
        }
        applied.insert(key, now.as_millis()).map_err(&e)?;
        Ok(true)
    }

    pub(crate) fn is_applied(&self, key: &str) -> Result<bool, StoreError> {
        Ok(self
            .applied()?
            .get(key)
            .map_err(self.err("read an applied key"))?
            .is_some())
    }

    /// Applies a turn's commit. Every failure here is a storage or encoding failure, which aborts
    /// the whole batch: nothing of a failed commit is written.
    pub(crate) fn turn_commit(
        &self,
        agent: &AgentId,
        commit: &TurnCommit,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        for id in &commit.consumed {
            self.delivery_remove(id)?;
        }
        for record in &commit.records {
            self.channel_append(agent, record.clone())?;
        }
        for key in &commit.applied {
            self.mark_applied(key, now)?;
        }
        Ok(())
    }
}
