//! [`TaskStore`]: every agent's board and outbox, in the `tasks` and `outbox` tables.

use std::time::Duration;

use async_trait::async_trait;
use spacebot_core::task::{
    CompletionNotice, Expect, Lease, Priority, TaskEvent, TaskFilter, TaskMetadata, Transition,
};
use spacebot_core::{AgentId, NewTask, StoreError, Task, TaskStore, Timestamp};
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Postgres, QueryBuilder};

use crate::PgStores;
use crate::codec::{Reader, limit, to_sql, to_sql_or};
use crate::error::{corrupt, db_error, encode_error, unique_violation};

/// The columns every task query selects, as [`decode`] reads them.
const COLUMNS: &str = "number, title, description, status, priority, created_by, metadata, \
     attempts, max_attempts, lease_holder, lease_expires_at, revision, result, error, created_at, \
     updated_at";

/// Creates a task: bumps the board's counter (whose row lock serializes the board's creates until
/// the transaction ends, so numbers have no gaps) and inserts the task with the new number. A
/// keyed create whose key the board already holds inserts nothing (the unique index
/// `tasks_idempotency_key` decides) and is rolled back, counter included.
const INSERT_SQL: &str = "WITH n AS ( \
         INSERT INTO boards (agent_id, last_number) VALUES ($1, 1) \
         ON CONFLICT (agent_id) DO UPDATE SET last_number = boards.last_number + 1 \
         RETURNING last_number) \
     INSERT INTO tasks (agent_id, number, title, description, status, priority, created_by, \
         delegated_by, metadata, attempts, max_attempts, revision, created_at, updated_at, \
         idempotency_key) \
     SELECT $1, n.last_number, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14 FROM n \
     ON CONFLICT (agent_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING \
     RETURNING number";

/// The task a keyed create made.
const SELECT_BY_KEY_SQL: &str = "SELECT number, title, description, status, priority, \
     created_by, metadata, attempts, max_attempts, lease_holder, lease_expires_at, revision, \
     result, error, created_at, updated_at FROM tasks \
     WHERE agent_id = $1 AND idempotency_key = $2";

/// One task.
const SELECT_ONE_SQL: &str = "SELECT number, title, description, status, priority, created_by, \
     metadata, attempts, max_attempts, lease_holder, lease_expires_at, revision, result, error, \
     created_at, updated_at FROM tasks WHERE agent_id = $1 AND number = $2";

/// The next ready task in claim order (served by the `tasks_claim` index), unlocked: the claim
/// then writes it guarded by the revision read (a claimer that lost the race reads again).
pub const CLAIM_SQL: &str = "SELECT number, title, description, status, priority, \
     created_by, metadata, attempts, max_attempts, lease_holder, lease_expires_at, revision, \
     result, error, created_at, updated_at FROM tasks \
     WHERE agent_id = $1 AND status = 'ready' \
     ORDER BY priority DESC, number ASC LIMIT 1";

/// In-progress tasks whose lease expired (served by the `tasks_lease` index of in-progress tasks
/// in number order), locked; tasks another transaction holds are left for the next call.
pub const EXPIRED_SQL: &str = "SELECT number, title, description, status, priority, \
     created_by, metadata, attempts, max_attempts, lease_holder, lease_expires_at, revision, \
     result, error, created_at, updated_at FROM tasks \
     WHERE agent_id = $1 AND status = 'in_progress' AND lease_expires_at <= $2 \
     ORDER BY number FOR UPDATE SKIP LOCKED";

/// [`UPDATE_SQL`] with the transition's notice inserted in the same statement, only when the
/// update was made (`$18` key, `$19` notice, `$20` its time).
const UPDATE_WITH_NOTICE_SQL: &str = "WITH u AS (UPDATE tasks SET title = $3, description = $4, \
     status = $5, priority = $6, delegated_by = $7, metadata = $8, attempts = $9, \
     max_attempts = $10, lease_holder = $11, lease_expires_at = $12, revision = $13, \
     result = $14, error = $15, updated_at = $16 \
     WHERE agent_id = $1 AND number = $2 AND revision = $17 RETURNING agent_id, number) \
     INSERT INTO outbox (agent_id, key, task_number, notice, created_at) \
     SELECT u.agent_id, $18, u.number, $19, $20 FROM u";

/// How many times a transition or a claim reads again after its guarded write found the task
/// changed by a concurrent writer, before it gives up.
const OPTIMISTIC_ATTEMPTS: usize = 32;

/// Whether the agent has an in-progress task whose lease expired (no lock: what
/// [`EXPIRED_SQL`] then takes, in a transaction).
const EXPIRED_EXISTS_SQL: &str = "SELECT EXISTS (SELECT 1 FROM tasks WHERE agent_id = $1 \
     AND status = 'in_progress' AND lease_expires_at <= $2)";

/// Writes a task after a transition, guarded by the revision read (and locked) in the same
/// transaction.
const UPDATE_SQL: &str = "UPDATE tasks SET title = $3, description = $4, status = $5, \
     priority = $6, delegated_by = $7, metadata = $8, attempts = $9, max_attempts = $10, \
     lease_holder = $11, lease_expires_at = $12, revision = $13, result = $14, error = $15, \
     updated_at = $16 \
     WHERE agent_id = $1 AND number = $2 AND revision = $17";

/// Unsent notices of one agent, oldest first (served by the `outbox_unsent` index).
pub const OUTBOX_PENDING_SQL: &str =
    "SELECT notice FROM outbox WHERE agent_id = $1 AND NOT sent ORDER BY seq";

fn decode(location: &str, agent: &AgentId, row: &PgRow) -> Result<Task, StoreError> {
    let number: i64 = Reader {
        row,
        location,
        what: "a task",
    }
    .get("number")?;
    let what = format!("task {agent}#{number}");
    let r = Reader {
        row,
        location,
        what: &what,
    };
    let status: String = r.get("status")?;
    let metadata: String = r.get("metadata")?;
    let lease_holder = r.opt_text("lease_holder")?;
    let lease_expires_at: Option<i64> = r.get("lease_expires_at")?;
    Ok(Task {
        agent: agent.clone(),
        number: r.u64("number")?,
        title: r.text("title")?,
        description: r.text("description")?,
        status: status
            .parse()
            .map_err(|e: spacebot_core::InvalidInput| r.bad("status", e))?,
        priority: Priority::from_rank(r.get("priority")?).map_err(|e| r.bad("priority", e))?,
        created_by: r.text("created_by")?,
        metadata: serde_json::from_str::<TaskMetadata>(&metadata)
            .map_err(|e| r.bad("metadata", e))?,
        attempts: r.u32("attempts")?,
        max_attempts: r.u32("max_attempts")?,
        lease: match (lease_holder, lease_expires_at) {
            (Some(holder), Some(at)) => Some(Lease {
                holder,
                expires_at: Timestamp(at),
            }),
            _ => None,
        },
        revision: r.u64("revision")?,
        result: r.opt_text("result")?,
        error: r.opt_text("error")?,
        created_at: Timestamp(r.get("created_at")?),
        updated_at: Timestamp(r.get("updated_at")?),
    })
}

fn encode_metadata(location: &str, metadata: &TaskMetadata) -> Result<String, StoreError> {
    serde_json::to_string(metadata).map_err(|e| encode_error(location, "task metadata", e))
}

/// Writes `transition` (of the task read and locked at `old_revision` in this transaction) and
/// its notice.
async fn write_transition(
    conn: &mut PgConnection,
    location: &str,
    old_revision: u64,
    transition: &Transition,
) -> Result<(), StoreError> {
    if write_transition_alone(&mut *conn, location, old_revision, transition).await? {
        return Ok(());
    }
    // Unreachable while the transaction holds the row lock; refuse rather than guess.
    Err(StoreError::Conflict {
        what: format!("task {}", transition.task.task_ref()),
        expected: format!("revision {old_revision}"),
        actual: "a different revision".into(),
    })
}

/// Writes a transition in one statement (atomic on its own, or part of the caller's transaction):
/// the task's update guarded by the revision it was read at, and its notice (if any) inserted
/// only with that update. `false`: the task changed since it was read (nothing written; read it
/// again).
async fn write_transition_alone<'e>(
    executor: impl sqlx::PgExecutor<'e>,
    location: &str,
    old_revision: u64,
    transition: &Transition,
) -> Result<bool, StoreError> {
    let task = &transition.task;
    let number = to_sql_or(location, "task number", task.number)?;
    let notice = match &transition.notice {
        Some(notice) => Some((
            notice,
            serde_json::to_string(notice).map_err(|e| encode_error(location, "a notice", e))?,
        )),
        None => None,
    };
    let sql = if notice.is_some() {
        UPDATE_WITH_NOTICE_SQL
    } else {
        UPDATE_SQL
    };
    let mut query = sqlx::query(sql)
        .bind(task.agent.as_str())
        .bind(number)
        .bind(task.title.as_bytes())
        .bind(task.description.as_bytes())
        .bind(task.status.as_str())
        .bind(task.priority.rank())
        .bind(task.metadata.delegated_by.as_ref().map(AgentId::as_str))
        .bind(encode_metadata(location, &task.metadata)?)
        .bind(i64::from(task.attempts))
        .bind(i64::from(task.max_attempts))
        .bind(task.lease.as_ref().map(|l| l.holder.as_bytes()))
        .bind(task.lease.as_ref().map(|l| l.expires_at.0))
        .bind(to_sql_or(location, "task revision", task.revision)?)
        .bind(task.result.as_deref().map(str::as_bytes))
        .bind(task.error.as_deref().map(str::as_bytes))
        .bind(task.updated_at.0)
        .bind(to_sql_or(location, "task revision", old_revision)?);
    if let Some((notice, json)) = &notice {
        query = query
            .bind(notice.key.as_bytes())
            .bind(json.as_str())
            .bind(notice.created_at.0);
    }
    let done = query
        .execute(executor)
        .await
        .map_err(|e| db_error(location, "updating a task", e))?;
    Ok(done.rows_affected() == 1)
}

/// The error of a write that kept missing because concurrent writers changed what it read.
fn changed_under(what: &str) -> StoreError {
    StoreError::Conflict {
        what: what.to_string(),
        expected: "no concurrent change".into(),
        actual: format!("changed under {OPTIMISTIC_ATTEMPTS} writes in a row"),
    }
}

/// Inserts `task` with the board's next number, or returns `None` if `key` is already used on the
/// board (then the caller must roll back: the counter was bumped).
async fn insert(
    conn: &mut PgConnection,
    location: &str,
    task: &Task,
    key: Option<&str>,
) -> Result<Option<u64>, StoreError> {
    let metadata = encode_metadata(location, &task.metadata)?;
    let number: Option<i64> = sqlx::query_scalar(INSERT_SQL)
        .bind(task.agent.as_str())
        .bind(task.title.as_bytes())
        .bind(task.description.as_bytes())
        .bind(task.status.as_str())
        .bind(task.priority.rank())
        .bind(task.created_by.as_bytes())
        .bind(task.metadata.delegated_by.as_ref().map(AgentId::as_str))
        .bind(metadata)
        .bind(i64::from(task.attempts))
        .bind(i64::from(task.max_attempts))
        .bind(to_sql_or(location, "task revision", task.revision)?)
        .bind(task.created_at.0)
        .bind(task.updated_at.0)
        .bind(key.map(str::as_bytes))
        .fetch_optional(&mut *conn)
        .await
        .map_err(|e| {
            if unique_violation(&e).is_some() {
                // The board's counter is behind its tasks (rows written around the store).
                corrupt(
                    location,
                    format!(
                        "creating a task on board {}: the next number is taken: {e}",
                        task.agent
                    ),
                )
            } else {
                db_error(location, "creating a task", e)
            }
        })?;
    number
        .map(|n| {
            u64::try_from(n).map_err(|_| corrupt(location, format!("task number {n} is negative")))
        })
        .transpose()
}

/// [`TaskStore`] on the `tasks` and `outbox` tables. Get one from [`PgStores::tasks`].
///
/// A claim selects the next ready task `FOR UPDATE SKIP LOCKED` and moves it to in progress in
/// the same transaction; a transition locks its task, applies
/// [`Task::apply`](spacebot_core::Task) (only the lease holder may complete, fail or renew) and
/// writes the task and its notice in one transaction.
#[derive(Debug, Clone)]
pub struct PgTaskStore(pub(crate) PgStores);

impl PgTaskStore {
    /// [`TaskStore::create`] with an idempotency key.
    async fn create_keyed(
        &self,
        agent: &AgentId,
        task: NewTask,
        key: &str,
        now: Timestamp,
    ) -> Result<Task, StoreError> {
        let db = self.0.db()?;
        let location = db.location.clone();
        // A replay finds its task without taking the board's lock.
        if let Some(found) = self.by_key(agent, key).await? {
            return Ok(found);
        }
        let task = task.into_task(agent.clone(), 0, now)?;
        let created = db
            .tx(|conn| {
                let (task, key, location) = (task.clone(), key.to_string(), location.clone());
                Box::pin(async move {
                    match insert(conn, &location, &task, Some(&key)).await? {
                        Some(number) => Ok(Task { number, ..task }),
                        // Another create took the key meanwhile: roll back (the counter too).
                        None => Err(StoreError::already_exists(format!(
                            "task with idempotency key {key:?} on board {}",
                            task.agent
                        ))),
                    }
                })
            })
            .await;
        match created {
            Err(StoreError::AlreadyExists { .. }) => {
                self.by_key(agent, key).await?.ok_or_else(|| {
                    corrupt(
                        &location,
                        format!(
                            "the task with idempotency key {key:?} on board {agent} was refused \
                             as a duplicate but cannot be read"
                        ),
                    )
                })
            }
            other => other,
        }
    }

    async fn by_key(&self, agent: &AgentId, key: &str) -> Result<Option<Task>, StoreError> {
        let db = self.0.db()?;
        let row = sqlx::query(SELECT_BY_KEY_SQL)
            .bind(agent.as_str())
            .bind(key.as_bytes())
            .fetch_optional(&db.pool)
            .await
            .map_err(|e| db_error(&db.location, "looking up a task by its idempotency key", e))?;
        row.map(|r| decode(&db.location, agent, &r)).transpose()
    }
}

#[async_trait]
impl TaskStore for PgTaskStore {
    async fn release(&self) {
        self.0.close().await;
    }

    async fn create(
        &self,
        agent: &AgentId,
        task: NewTask,
        now: Timestamp,
    ) -> Result<Task, StoreError> {
        if let Some(key) = task.idempotency_key.clone() {
            return self.create_keyed(agent, task, &key, now).await;
        }
        // Validate first (the number is not known yet and does not affect validation).
        let task = task.into_task(agent.clone(), 0, now)?;
        let db = self.0.db()?;
        // One statement: its own transaction.
        let mut conn = db
            .pool
            .acquire()
            .await
            .map_err(|e| db_error(&db.location, "creating a task", e))?;
        let number = insert(&mut conn, &db.location, &task, None)
            .await?
            .ok_or_else(|| {
                corrupt(
                    &db.location,
                    format!("creating a task on board {agent}: no row was inserted"),
                )
            })?;
        Ok(Task { number, ..task })
    }

    async fn get(&self, agent: &AgentId, number: u64) -> Result<Option<Task>, StoreError> {
        let Some(n) = to_sql(number) else {
            return Ok(None);
        };
        let db = self.0.db()?;
        let row = sqlx::query(SELECT_ONE_SQL)
            .bind(agent.as_str())
            .bind(n)
            .fetch_optional(&db.pool)
            .await
            .map_err(|e| db_error(&db.location, "reading a task", e))?;
        row.map(|r| decode(&db.location, agent, &r)).transpose()
    }

    async fn list(&self, agent: &AgentId, filter: &TaskFilter) -> Result<Vec<Task>, StoreError> {
        let db = self.0.db()?;
        let mut q: QueryBuilder<Postgres> = QueryBuilder::new("SELECT ");
        q.push(COLUMNS)
            .push(" FROM tasks WHERE agent_id = ")
            .push_bind(agent.as_str().to_string());
        if !filter.statuses.is_empty() {
            let statuses: Vec<String> = filter
                .statuses
                .iter()
                .map(|s| s.as_str().to_string())
                .collect();
            q.push(" AND status = ANY(").push_bind(statuses).push(")");
        }
        if let Some(d) = &filter.delegated_by {
            q.push(" AND delegated_by = ")
                .push_bind(d.as_str().to_string());
        }
        if let Some(c) = &filter.created_by {
            q.push(" AND created_by = ")
                .push_bind(c.as_bytes().to_vec());
        }
        q.push(" ORDER BY number");
        if let Some(n) = filter.limit {
            q.push(" LIMIT ").push_bind(limit(n));
        }
        let rows = q
            .build()
            .fetch_all(&db.pool)
            .await
            .map_err(|e| db_error(&db.location, "listing tasks", e))?;
        rows.iter()
            .map(|r| decode(&db.location, agent, r))
            .collect()
    }

    async fn transition(
        &self,
        agent: &AgentId,
        number: u64,
        expect: Expect,
        event: TaskEvent,
        now: Timestamp,
    ) -> Result<Transition, StoreError> {
        let missing = format!("task {agent}#{number}");
        let n = to_sql(number).ok_or_else(|| StoreError::not_found(missing.clone()))?;
        let db = self.0.db()?;
        // Read, decide, then write guarded by the revision read, in one statement each (no
        // transaction): a concurrent change makes the write miss, and it is decided again.
        for _ in 0..OPTIMISTIC_ATTEMPTS {
            let row = sqlx::query(SELECT_ONE_SQL)
                .bind(agent.as_str())
                .bind(n)
                .fetch_optional(&db.pool)
                .await
                .map_err(|e| db_error(&db.location, "reading a task", e))?
                .ok_or_else(|| StoreError::not_found(missing.clone()))?;
            let task = decode(&db.location, agent, &row)?;
            expect.check(&task)?;
            let transition = task.apply(event.clone(), now)?;
            if write_transition_alone(&db.pool, &db.location, task.revision, &transition).await? {
                return Ok(transition);
            }
        }
        Err(changed_under(&missing))
    }

    async fn claim_next(
        &self,
        agent: &AgentId,
        holder: &str,
        lease: Duration,
        now: Timestamp,
    ) -> Result<Option<Task>, StoreError> {
        let db = self.0.db()?;
        // The next ready task read unlocked, then claimed by a write guarded by its revision
        // (one statement each, no transaction); a task another claimer took first makes the
        // write miss, and the next one is read. A round that finds nothing costs one read.
        for _ in 0..OPTIMISTIC_ATTEMPTS {
            let Some(row) = sqlx::query(CLAIM_SQL)
                .bind(agent.as_str())
                .fetch_optional(&db.pool)
                .await
                .map_err(|e| db_error(&db.location, "claiming a task", e))?
            else {
                return Ok(None);
            };
            let task = decode(&db.location, agent, &row)?;
            let event = TaskEvent::Claim {
                holder: holder.to_string(),
                lease_until: now.plus(lease),
            };
            let transition = task.apply(event, now)?;
            if write_transition_alone(&db.pool, &db.location, task.revision, &transition).await? {
                return Ok(Some(transition.task));
            }
        }
        Err(changed_under(&format!("the ready tasks of {agent}")))
    }

    async fn requeue_expired(
        &self,
        agent: &AgentId,
        now: Timestamp,
    ) -> Result<Vec<Transition>, StoreError> {
        let db = self.0.db()?;
        // A read first: a lease check that finds nothing expired writes nothing.
        let expired: bool = sqlx::query_scalar(EXPIRED_EXISTS_SQL)
            .bind(agent.as_str())
            .bind(now.0)
            .fetch_one(&db.pool)
            .await
            .map_err(|e| db_error(&db.location, "looking for expired leases", e))?;
        if !expired {
            return Ok(Vec::new());
        }
        let location = db.location.clone();
        db.tx(|conn| {
            let (agent, location) = (agent.clone(), location.clone());
            Box::pin(async move {
                let rows = sqlx::query(EXPIRED_SQL)
                    .bind(agent.as_str())
                    .bind(now.0)
                    .fetch_all(&mut *conn)
                    .await
                    .map_err(|e| db_error(&location, "finding expired leases", e))?;
                let mut out = Vec::with_capacity(rows.len());
                for row in &rows {
                    let task = decode(&location, &agent, row)?;
                    let transition = task.apply(TaskEvent::ExpireLease, now)?;
                    write_transition(conn, &location, task.revision, &transition).await?;
                    out.push(transition);
                }
                Ok(out)
            })
        })
        .await
    }

    async fn outbox_pending(&self, agent: &AgentId) -> Result<Vec<CompletionNotice>, StoreError> {
        let db = self.0.db()?;
        let rows: Vec<String> = sqlx::query_scalar(OUTBOX_PENDING_SQL)
            .bind(agent.as_str())
            .fetch_all(&db.pool)
            .await
            .map_err(|e| db_error(&db.location, "reading the outbox", e))?;
        rows.iter()
            .map(|json| {
                serde_json::from_str(json)
                    .map_err(|e| corrupt(&db.location, format!("outbox notice of {agent}: {e}")))
            })
            .collect()
    }

    async fn outbox_mark_sent(&self, agent: &AgentId, key: &str) -> Result<(), StoreError> {
        let db = self.0.db()?;
        sqlx::query("UPDATE outbox SET sent = TRUE WHERE agent_id = $1 AND key = $2 AND NOT sent")
            .bind(agent.as_str())
            .bind(key.as_bytes())
            .execute(&db.pool)
            .await
            .map_err(|e| db_error(&db.location, "marking a notice sent", e))?;
        Ok(())
    }
}
