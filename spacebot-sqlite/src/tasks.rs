//! [`TaskStore`] on each agent's database: the board and its outbox.

use std::time::Duration;

use async_trait::async_trait;
use rusqlite::types::{ToSql, Value};
use rusqlite::{Connection, Row, params, params_from_iter};
use spacebot_core::task::{
    CompletionNotice, Expect, Lease, Priority, TaskEvent, TaskFilter, TaskMetadata, Transition,
};
use spacebot_core::{AgentId, NewTask, StoreError, Task, TaskStore, Timestamp};

use crate::SqliteStores;
use crate::error::{Location, corrupt, db_error, encode_error};
use crate::query;

/// The columns every task query selects, in the order [`decode`] reads them (by position).
const TASK_COLUMNS: &str = "number, title, description, status, priority, created_by, metadata, \
     attempts, max_attempts, lease_holder, lease_expires_at, revision, result, error, created_at, \
     updated_at";

/// Claims the next ready task: highest priority, then lowest number, in one compare-and-swap
/// statement. The inner `SELECT` is served by the `tasks_claim` index in the order it sorts; the
/// outer `status = 'ready'` makes the update a no-op if the task was taken meanwhile. The columns
/// set are exactly what [`Task::apply`] changes for [`TaskEvent::Claim`].
pub const CLAIM_SQL: &str = "UPDATE tasks \
     SET status = 'in_progress', lease_holder = ?1, lease_expires_at = ?2, \
         revision = revision + 1, updated_at = ?3 \
     WHERE agent = ?4 \
       AND number = (SELECT number FROM tasks WHERE agent = ?4 AND status = 'ready' \
                     ORDER BY priority DESC, number ASC LIMIT 1) \
       AND status = 'ready' \
     RETURNING number, title, description, status, priority, created_by, metadata, attempts, \
         max_attempts, lease_holder, lease_expires_at, revision, result, error, created_at, \
         updated_at";

/// Inserts a task of agent `?1`; its number, the agent's next, is allocated by the same
/// statement, under the write lock.
pub const INSERT_SQL: &str = "INSERT INTO tasks (agent, number, title, description, status, \
     priority, created_by, delegated_by, metadata, attempts, max_attempts, lease_holder, \
     lease_expires_at, revision, result, error, created_at, updated_at) \
     VALUES (?1, (SELECT coalesce(max(number), 0) + 1 FROM tasks WHERE agent = ?1), \
             ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, NULL, NULL, ?11, NULL, NULL, ?12, ?13) \
     RETURNING number";

/// [`INSERT_SQL`] with the create's idempotency key as the last parameter.
const INSERT_KEYED_SQL: &str = "INSERT INTO tasks (agent, number, title, description, status, \
     priority, created_by, delegated_by, metadata, attempts, max_attempts, lease_holder, \
     lease_expires_at, revision, result, error, created_at, updated_at, idempotency_key) \
     VALUES (?1, (SELECT coalesce(max(number), 0) + 1 FROM tasks WHERE agent = ?1), \
             ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, NULL, NULL, ?11, NULL, NULL, ?12, ?13, ?14) \
     RETURNING number";

/// Reads the task a keyed create made (served by the `tasks_idempotency_key` index).
const SELECT_BY_KEY_SQL: &str = "SELECT number, title, description, status, priority, \
     created_by, metadata, attempts, max_attempts, lease_holder, lease_expires_at, revision, \
     result, error, created_at, updated_at FROM tasks WHERE agent = ? AND idempotency_key = ?";

/// Reads one task inside a transition.
pub const SELECT_ONE_SQL: &str = "SELECT number, title, description, status, priority, \
     created_by, metadata, attempts, max_attempts, lease_holder, lease_expires_at, revision, \
     result, error, created_at, updated_at FROM tasks WHERE agent = ? AND number = ?";

/// Writes the task after a transition, guarded by the revision read in the same transaction.
pub const UPDATE_SQL: &str = "UPDATE tasks SET title = ?, description = ?, status = ?, \
     priority = ?, delegated_by = ?, metadata = ?, attempts = ?, max_attempts = ?, \
     lease_holder = ?, lease_expires_at = ?, revision = ?, result = ?, error = ?, updated_at = ? \
     WHERE agent = ? AND number = ? AND revision = ?";

/// Writes a completion notice to the outbox.
pub const OUTBOX_INSERT_SQL: &str = "INSERT INTO outbox (agent, key, task_number, notice, created_at) \
     VALUES (?, ?, ?, ?, ?)";

fn number_to_sql(number: u64) -> Option<i64> {
    i64::try_from(number).ok()
}

/// Decodes a row of [`TASK_COLUMNS`] (every task query selects them in that order), by position:
/// a lookup by name compares strings on every value.
fn decode(location: &Location, agent: &AgentId, row: &Row<'_>) -> Result<Task, StoreError> {
    let read = |e| db_error(location, "reading a task", e);
    let number: i64 = row.get(0).map_err(read)?;
    let bad = |what: &str, why: String| corrupt(location, format!("task {number}: {what}: {why}"));
    let count = |at: usize, name: &str| -> Result<u32, StoreError> {
        let v: i64 = row.get(at).map_err(read)?;
        u32::try_from(v).map_err(|_| bad(name, format!("{v} is out of range")))
    };
    let status: String = row.get(3).map_err(read)?;
    let metadata: String = row.get(6).map_err(read)?;
    let lease_holder: Option<String> = row.get(9).map_err(read)?;
    let lease_expires_at: Option<i64> = row.get(10).map_err(read)?;
    let revision: i64 = row.get(11).map_err(read)?;
    Ok(Task {
        agent: agent.clone(),
        number: u64::try_from(number).map_err(|_| bad("number", "negative".into()))?,
        title: row.get(1).map_err(read)?,
        description: row.get(2).map_err(read)?,
        status: status
            .parse()
            .map_err(|e: spacebot_core::InvalidInput| bad("status", e.to_string()))?,
        priority: Priority::from_rank(row.get(4).map_err(read)?)
            .map_err(|e| bad("priority", e.to_string()))?,
        created_by: row.get(5).map_err(read)?,
        metadata: serde_json::from_str::<TaskMetadata>(&metadata)
            .map_err(|e| bad("metadata", e.to_string()))?,
        attempts: count(7, "attempts")?,
        max_attempts: count(8, "max_attempts")?,
        lease: match (lease_holder, lease_expires_at) {
            (Some(holder), Some(at)) => Some(Lease {
                holder,
                expires_at: Timestamp(at),
            }),
            _ => None,
        },
        revision: u64::try_from(revision).map_err(|_| bad("revision", "negative".into()))?,
        result: row.get(12).map_err(read)?,
        error: row.get(13).map_err(read)?,
        created_at: Timestamp(row.get(14).map_err(read)?),
        updated_at: Timestamp(row.get(15).map_err(read)?),
    })
}

fn encode_metadata(location: &Location, metadata: &TaskMetadata) -> Result<String, StoreError> {
    serde_json::to_string(metadata).map_err(|e| encode_error(location, "task metadata", e))
}

fn revision_to_sql(location: &Location, revision: u64) -> Result<i64, StoreError> {
    i64::try_from(revision).map_err(|_| {
        corrupt(
            location,
            format!("task revision {revision} is out of range"),
        )
    })
}

/// Writes `transition` (read at `old_revision` in the same transaction) and its notice.
fn write_transition(
    conn: &Connection,
    location: &Location,
    agent: &str,
    old_revision: u64,
    transition: &Transition,
) -> Result<(), StoreError> {
    let task = &transition.task;
    let number = number_to_sql(task.number).ok_or_else(|| {
        corrupt(
            location,
            format!("task number {} is out of range", task.number),
        )
    })?;
    let done = query::execute(
        conn,
        UPDATE_SQL,
        params![
            task.title,
            task.description,
            task.status.as_str(),
            task.priority.rank(),
            task.metadata.delegated_by.as_ref().map(AgentId::as_str),
            encode_metadata(location, &task.metadata)?,
            i64::from(task.attempts),
            i64::from(task.max_attempts),
            task.lease.as_ref().map(|l| l.holder.as_str()),
            task.lease.as_ref().map(|l| l.expires_at.0),
            revision_to_sql(location, task.revision)?,
            task.result.as_deref(),
            task.error.as_deref(),
            task.updated_at.0,
            agent,
            number,
            revision_to_sql(location, old_revision)?,
        ],
    )
    .map_err(|e| db_error(location, "updating a task", e))?;
    if done != 1 {
        // Unreachable while the transaction holds the write lock; refuse rather than guess.
        return Err(StoreError::Conflict {
            what: format!("task {}", task.task_ref()),
            expected: format!("revision {old_revision}"),
            actual: "a different revision".into(),
        });
    }
    if let Some(notice) = &transition.notice {
        write_notice(conn, location, agent, number, notice)?;
    }
    Ok(())
}

fn write_notice(
    conn: &Connection,
    location: &Location,
    agent: &str,
    number: i64,
    notice: &CompletionNotice,
) -> Result<(), StoreError> {
    let json = serde_json::to_string(notice).map_err(|e| encode_error(location, "a notice", e))?;
    query::execute(
        conn,
        OUTBOX_INSERT_SQL,
        params![agent, notice.key, number, json, notice.created_at.0],
    )
    .map_err(|e| db_error(location, "writing a completion notice", e))?;
    Ok(())
}

/// [`TaskStore`] on the agents' databases: boards and outboxes. Get one from [`SqliteStores::tasks`].
#[derive(Debug, Clone)]
pub struct SqliteTaskStore(pub(crate) SqliteStores);

impl SqliteTaskStore {
    /// [`TaskStore::create`] with an idempotency key.
    async fn create_keyed(
        &self,
        agent: &AgentId,
        task: NewTask,
        key: &str,
        now: Timestamp,
    ) -> Result<Task, StoreError> {
        // A keyed create: look the key up and insert in one operation of the writer, so that of
        // concurrent creates with one key exactly one inserts and the others find its task.
        let db = self.0.agent(agent).await?;
        let (agent, key, location, owner) = (
            agent.clone(),
            key.to_string(),
            db.location.clone(),
            db.key.clone(),
        );
        db.writes
            .run(move |conn| {
                let existing = query::first(
                    conn,
                    &location,
                    "looking up a task by its idempotency key",
                    SELECT_BY_KEY_SQL,
                    params![&*owner, &key],
                    |row| decode(&location, &agent, row),
                )?;
                if let Some(task) = existing {
                    return Ok(task);
                }
                let mut task = task.into_task(agent.clone(), 0, now)?;
                let number = insert(conn, &location, &owner, &task, Some(&key))?;
                task.number = u64::try_from(number)
                    .map_err(|_| corrupt(&location, format!("task number {number} is negative")))?;
                Ok(task)
            })
            .await
    }
}

/// Inserts `task` (with its create's idempotency key, if any) and returns its new number.
fn insert(
    conn: &Connection,
    location: &Location,
    agent: &str,
    task: &Task,
    key: Option<&str>,
) -> Result<i64, StoreError> {
    let metadata = encode_metadata(location, &task.metadata)?;
    let (status, rank) = (task.status.as_str(), task.priority.rank());
    let delegated_by = task.metadata.delegated_by.as_ref().map(AgentId::as_str);
    let (attempts, max_attempts) = (i64::from(task.attempts), i64::from(task.max_attempts));
    let revision = revision_to_sql(location, task.revision)?;
    let mut values: Vec<&dyn ToSql> = vec![
        &agent,
        &task.title,
        &task.description,
        &status,
        &rank,
        &task.created_by,
        &delegated_by,
        &metadata,
        &attempts,
        &max_attempts,
        &revision,
        &task.created_at.0,
        &task.updated_at.0,
    ];
    let sql = match &key {
        Some(key) => {
            values.push(key);
            INSERT_KEYED_SQL
        }
        None => INSERT_SQL,
    };
    conn.prepare_cached(sql)
        .and_then(|mut statement| statement.query_row(params_from_iter(values), |r| r.get(0)))
        .map_err(|e| db_error(location, "creating a task", e))
}

#[async_trait]
impl TaskStore for SqliteTaskStore {
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
        let mut task = task.into_task(agent.clone(), 0, now)?;
        let db = self.0.agent(agent).await?;
        let (location, owner) = (db.location.clone(), db.key.clone());
        db.writes
            .run(move |conn| {
                let number = insert(conn, &location, &owner, &task, None)?;
                task.number = u64::try_from(number)
                    .map_err(|_| corrupt(&location, format!("task number {number} is negative")))?;
                Ok(task)
            })
            .await
    }

    async fn get(&self, agent: &AgentId, number: u64) -> Result<Option<Task>, StoreError> {
        let Some(n) = number_to_sql(number) else {
            return Ok(None);
        };
        let db = self.0.agent(agent).await?;
        let (agent, location, owner) = (agent.clone(), db.location.clone(), db.key.clone());
        db.read_short("reading a task", move |conn| {
            query::first(
                conn,
                &location,
                "reading a task",
                SELECT_ONE_SQL,
                params![&*owner, n],
                |row| decode(&location, &agent, row),
            )
        })
        .await
    }

    async fn list(&self, agent: &AgentId, filter: &TaskFilter) -> Result<Vec<Task>, StoreError> {
        let db = self.0.agent(agent).await?;
        let mut sql = format!("SELECT {TASK_COLUMNS} FROM tasks WHERE agent = ?");
        let mut values: Vec<Value> = vec![Value::Text(db.key.to_string())];
        if !filter.statuses.is_empty() {
            let marks = vec!["?"; filter.statuses.len()].join(", ");
            sql.push_str(&format!(" AND status IN ({marks})"));
            values.extend(
                filter
                    .statuses
                    .iter()
                    .map(|s| Value::Text(s.as_str().to_string())),
            );
        }
        if let Some(d) = &filter.delegated_by {
            sql.push_str(" AND delegated_by = ?");
            values.push(Value::Text(d.as_str().to_string()));
        }
        if let Some(c) = &filter.created_by {
            sql.push_str(" AND created_by = ?");
            values.push(Value::Text(c.clone()));
        }
        sql.push_str(" ORDER BY number");
        if let Some(limit) = filter.limit {
            // `? + 0`, not `?`: see `channels::HISTORY_SQL`.
            sql.push_str(" LIMIT ? + 0");
            values.push(Value::Integer(i64::try_from(limit).unwrap_or(i64::MAX)));
        }
        let (agent, location) = (agent.clone(), db.location.clone());
        db.read("listing tasks", move |conn| {
            query::all(
                conn,
                &location,
                "listing tasks",
                &sql,
                params_from_iter(values),
                |row| decode(&location, &agent, row),
            )
        })
        .await
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
        let n = number_to_sql(number).ok_or_else(|| StoreError::not_found(missing.clone()))?;
        let db = self.0.agent(agent).await?;
        let (agent, location, owner) = (agent.clone(), db.location.clone(), db.key.clone());
        db.writes
            .run(move |conn| {
                let task = query::first(
                    conn,
                    &location,
                    "reading a task",
                    SELECT_ONE_SQL,
                    params![&*owner, n],
                    |row| decode(&location, &agent, row),
                )?
                .ok_or_else(|| StoreError::not_found(missing))?;
                expect.check(&task)?;
                let transition = task.apply(event, now)?;
                write_transition(conn, &location, &owner, task.revision, &transition)?;
                Ok(transition)
            })
            .await
    }

    async fn claim_next(
        &self,
        agent: &AgentId,
        holder: &str,
        lease: Duration,
        now: Timestamp,
    ) -> Result<Option<Task>, StoreError> {
        let db = self.0.agent(agent).await?;
        // Looked for first without the writer: a task loop's round usually finds nothing to
        // claim, and an empty write transaction still costs a turn of the writer.
        if !exists(&db, READY_EXISTS_SQL, None, "looking for a ready task").await? {
            return Ok(None);
        }
        let (agent, holder, location, owner) = (
            agent.clone(),
            holder.to_string(),
            db.location.clone(),
            db.key.clone(),
        );
        db.writes
            .run(move |conn| {
                query::first(
                    conn,
                    &location,
                    "claiming a task",
                    CLAIM_SQL,
                    params![holder, now.plus(lease).0, now.0, &*owner],
                    |row| decode(&location, &agent, row),
                )
            })
            .await
    }

    async fn requeue_expired(
        &self,
        agent: &AgentId,
        now: Timestamp,
    ) -> Result<Vec<Transition>, StoreError> {
        let db = self.0.agent(agent).await?;
        // Looked for first without the writer, as in `claim_next`: a lease rarely expires.
        if !exists(
            &db,
            EXPIRED_EXISTS_SQL,
            Some(now.0),
            "finding expired leases",
        )
        .await?
        {
            return Ok(Vec::new());
        }
        let (agent, location, owner) = (agent.clone(), db.location.clone(), db.key.clone());
        db.writes
            .run(move |conn| {
                let tasks = query::all(
                    conn,
                    &location,
                    "finding expired leases",
                    EXPIRED_SQL,
                    params![&*owner, now.0],
                    |row| decode(&location, &agent, row),
                )?;
                let mut out = Vec::with_capacity(tasks.len());
                for task in tasks {
                    let transition = task.apply(TaskEvent::ExpireLease, now)?;
                    write_transition(conn, &location, &owner, task.revision, &transition)?;
                    out.push(transition);
                }
                Ok(out)
            })
            .await
    }

    async fn outbox_pending(&self, agent: &AgentId) -> Result<Vec<CompletionNotice>, StoreError> {
        let db = self.0.agent(agent).await?;
        let (location, owner) = (db.location.clone(), db.key.clone());
        db.read_short("reading the outbox", move |conn| {
            query::all(
                conn,
                &location,
                "reading the outbox",
                OUTBOX_PENDING_SQL,
                [&*owner],
                |row| {
                    let json: String = query::get(&location, "reading the outbox", row, "notice")?;
                    serde_json::from_str(&json)
                        .map_err(|e| corrupt(&location, format!("outbox notice: {e}")))
                },
            )
        })
        .await
    }

    async fn outbox_mark_sent(&self, agent: &AgentId, key: &str) -> Result<(), StoreError> {
        let db = self.0.agent(agent).await?;
        let (key, location, owner) = (key.to_string(), db.location.clone(), db.key.clone());
        db.writes
            .run(move |conn| {
                query::execute(
                    conn,
                    "UPDATE outbox SET sent = 1 WHERE agent = ? AND key = ? AND sent = 0",
                    params![&*owner, key],
                )
                .map_err(|e| db_error(&location, "marking a notice sent", e))?;
                Ok(())
            })
            .await
    }
}

/// Finds in-progress tasks whose lease expired.
pub(crate) const EXPIRED_SQL: &str = "SELECT number, title, description, status, priority, \
     created_by, metadata, attempts, max_attempts, lease_holder, lease_expires_at, revision, \
     result, error, created_at, updated_at FROM tasks \
     WHERE agent = ? AND status = 'in_progress' AND lease_expires_at <= ? ORDER BY number";

/// Whether a task is ready to be claimed (read before [`CLAIM_SQL`] is sent to the writer).
const READY_EXISTS_SQL: &str = "SELECT 1 FROM tasks WHERE agent = ? AND status = 'ready' LIMIT 1";

/// Whether a lease expired at the second parameter (read before [`EXPIRED_SQL`] is sent to the
/// writer).
const EXPIRED_EXISTS_SQL: &str = "SELECT 1 FROM tasks \
     WHERE agent = ? AND status = 'in_progress' AND lease_expires_at <= ? LIMIT 1";

/// Whether `sql` (with the agent's key, then `bind` if any) finds a row, read on `db`'s reader.
async fn exists(
    db: &crate::AgentDb,
    sql: &'static str,
    bind: Option<i64>,
    what: &'static str,
) -> Result<bool, StoreError> {
    let (location, owner) = (db.location.clone(), db.key.clone());
    // One indexed row looked up: on the calling thread when a reader connection is idle.
    db.read_short(what, move |conn| {
        let found = match bind {
            Some(value) => {
                query::first(conn, &location, what, sql, params![&*owner, value], |_| {
                    Ok(())
                })
            }
            None => query::first(conn, &location, what, sql, [&*owner], |_| Ok(())),
        }?;
        Ok(found.is_some())
    })
    .await
}

/// Unsent notices, oldest first.
pub(crate) const OUTBOX_PENDING_SQL: &str =
    "SELECT notice FROM outbox WHERE agent = ? AND sent = 0 ORDER BY seq";

#[cfg(test)]
mod tests {
    use super::*;
    use spacebot_core::TaskStatus;

    const CLAIMABLE: TaskStatus = TaskStatus::Ready;

    /// The `detail` column of `EXPLAIN QUERY PLAN sql`, one line per step.
    async fn plan(stores: &SqliteStores, agent: &AgentId, sql: &str) -> Vec<String> {
        let db = stores.agent(agent).await.unwrap();
        let sql = format!("EXPLAIN QUERY PLAN {sql}");
        let location = db.location.clone();
        db.read("planning", move |conn| {
            // Its parameters are left NULL: the plan does not depend on them.
            let unbound = conn.prepare(&sql).unwrap().parameter_count();
            let nulls = params_from_iter(vec![Value::Null; unbound]);
            query::all(conn, &location, "planning", &sql, nulls, |row| {
                query::get(&location, "planning", row, "detail")
            })
        })
        .await
        .unwrap()
    }

    async fn board_with_tasks() -> (SqliteStores, AgentId) {
        let stores = SqliteStores::in_memory().await.unwrap();
        let agent = AgentId::parse("w").unwrap();
        let tasks = stores.tasks();
        for i in 0..50 {
            let mut t = NewTask::new(format!("t{i}"), "");
            t.priority = Priority::from_rank(i % 4).unwrap();
            tasks.create(&agent, t, Timestamp(i)).await.unwrap();
        }
        for _ in 0..10 {
            tasks
                .claim_next(&agent, "h", Duration::from_secs(1), Timestamp(100))
                .await
                .unwrap();
        }
        (stores, agent)
    }

    #[tokio::test]
    async fn the_claim_is_served_by_an_index_in_the_order_it_sorts() {
        let (stores, agent) = board_with_tasks().await;
        let plan = plan(&stores, &agent, CLAIM_SQL).await;
        let text = plan.join("\n");
        assert!(
            plan.iter()
                .any(|l| l.contains("USING COVERING INDEX tasks_claim")),
            "the claim does not use tasks_claim:\n{text}"
        );
        assert!(
            !text.contains("TEMP B-TREE"),
            "the claim sorts in a temporary B-tree:\n{text}"
        );
        assert!(
            plan.iter()
                .any(|l| l.contains("sqlite_autoindex_tasks_1 (agent=? AND number=?)")),
            "the update does not find the task by its agent and number:\n{text}"
        );
        assert!(
            !plan
                .iter()
                .any(|l| l.starts_with("SCAN tasks") && !l.contains("INDEX"))
        );
    }

    #[tokio::test]
    async fn lease_expiry_and_the_outbox_are_served_by_indexes() {
        let (stores, agent) = board_with_tasks().await;
        let expired = plan(&stores, &agent, EXPIRED_SQL).await.join("\n");
        assert!(expired.contains("INDEX tasks_lease"), "{expired}");
        let outbox = plan(&stores, &agent, OUTBOX_PENDING_SQL).await.join("\n");
        assert!(outbox.contains("INDEX outbox_unsent"), "{outbox}");
        assert!(!outbox.contains("TEMP B-TREE"), "{outbox}");
    }

    /// `decode` reads by position: every statement it decodes returns [`TASK_COLUMNS`], in order.
    #[test]
    fn every_task_query_returns_the_decoded_columns_in_order() {
        let squash = |sql: &str| sql.split_whitespace().collect::<Vec<_>>().join(" ");
        let columns = squash(TASK_COLUMNS);
        for sql in [CLAIM_SQL, SELECT_BY_KEY_SQL, SELECT_ONE_SQL, EXPIRED_SQL] {
            let sql = squash(sql);
            assert!(
                sql.contains(&format!("RETURNING {columns}"))
                    || sql.contains(&format!("SELECT {columns} FROM")),
                "{sql}"
            );
        }
    }

    #[test]
    fn claim_sql_names_the_statuses_of_the_domain() {
        assert!(CLAIM_SQL.contains(&format!("status = '{}'", CLAIMABLE.as_str())));
        assert!(CLAIM_SQL.contains(&format!("'{}'", TaskStatus::InProgress.as_str())));
    }
}
