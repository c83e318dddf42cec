//! [`TaskStore`] on each agent's database: the board and its outbox.

use std::time::Duration;

use async_trait::async_trait;
use spacebot_core::task::{
    CompletionNotice, Expect, Lease, Priority, TaskEvent, TaskFilter, TaskMetadata, Transition,
};
use spacebot_core::{AgentId, NewTask, StoreError, Task, TaskStore, Timestamp};
use sqlx::sqlite::SqliteRow;
use sqlx::{QueryBuilder, Row, Sqlite, SqliteConnection};

use crate::SqliteStores;
use crate::error::{Location, corrupt, db_error, encode_error};

/// The columns every task query selects, in the order [`decode`] reads them by name.
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
     WHERE number = (SELECT number FROM tasks WHERE status = 'ready' \
                     ORDER BY priority DESC, number ASC LIMIT 1) \
       AND status = 'ready' \
     RETURNING number, title, description, status, priority, created_by, metadata, attempts, \
         max_attempts, lease_holder, lease_expires_at, revision, result, error, created_at, \
         updated_at";

/// Inserts a task; its number is allocated by the same statement, under the write lock.
pub const INSERT_SQL: &str = "INSERT INTO tasks (number, title, description, status, \
     priority, created_by, delegated_by, metadata, attempts, max_attempts, lease_holder, \
     lease_expires_at, revision, result, error, created_at, updated_at) \
     VALUES ((SELECT coalesce(max(number), 0) + 1 FROM tasks), \
             ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL, ?, NULL, NULL, ?, ?) \
     RETURNING number";

/// [`INSERT_SQL`] with the create's idempotency key as the last parameter.
const INSERT_KEYED_SQL: &str = "INSERT INTO tasks (number, title, description, status, \
     priority, created_by, delegated_by, metadata, attempts, max_attempts, lease_holder, \
     lease_expires_at, revision, result, error, created_at, updated_at, idempotency_key) \
     VALUES ((SELECT coalesce(max(number), 0) + 1 FROM tasks), \
             ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL, ?, NULL, NULL, ?, ?, ?) \
     RETURNING number";

/// Reads the task a keyed create made (served by the `tasks_idempotency_key` index).
const SELECT_BY_KEY_SQL: &str = "SELECT number, title, description, status, priority, \
     created_by, metadata, attempts, max_attempts, lease_holder, lease_expires_at, revision, \
     result, error, created_at, updated_at FROM tasks WHERE idempotency_key = ?";

/// Reads one task inside a transition.
pub const SELECT_ONE_SQL: &str = "SELECT number, title, description, status, priority, \
     created_by, metadata, attempts, max_attempts, lease_holder, lease_expires_at, revision, \
     result, error, created_at, updated_at FROM tasks WHERE number = ?";

/// Writes the task after a transition, guarded by the revision read in the same transaction.
pub const UPDATE_SQL: &str = "UPDATE tasks SET title = ?, description = ?, status = ?, \
     priority = ?, delegated_by = ?, metadata = ?, attempts = ?, max_attempts = ?, \
     lease_holder = ?, lease_expires_at = ?, revision = ?, result = ?, error = ?, updated_at = ? \
     WHERE number = ? AND revision = ?";

/// Writes a completion notice to the outbox.
pub const OUTBOX_INSERT_SQL: &str =
    "INSERT INTO outbox (key, task_number, notice, created_at) VALUES (?, ?, ?, ?)";

fn number_to_sql(number: u64) -> Option<i64> {
    i64::try_from(number).ok()
}

fn decode(location: &Location, agent: &AgentId, row: &SqliteRow) -> Result<Task, StoreError> {
    let read = |e| db_error(location, "reading a task", e);
    let number: i64 = row.try_get("number").map_err(read)?;
    let bad = |what: &str, why: String| corrupt(location, format!("task {number}: {what}: {why}"));
    let count = |name: &str| -> Result<u32, StoreError> {
        let v: i64 = row.try_get(name).map_err(read)?;
        u32::try_from(v).map_err(|_| bad(name, format!("{v} is out of range")))
    };
    let status: String = row.try_get("status").map_err(read)?;
    let metadata: String = row.try_get("metadata").map_err(read)?;
    let lease_holder: Option<String> = row.try_get("lease_holder").map_err(read)?;
    let lease_expires_at: Option<i64> = row.try_get("lease_expires_at").map_err(read)?;
    let revision: i64 = row.try_get("revision").map_err(read)?;
    Ok(Task {
        agent: agent.clone(),
        number: u64::try_from(number).map_err(|_| bad("number", "negative".into()))?,
        title: row.try_get("title").map_err(read)?,
        description: row.try_get("description").map_err(read)?,
        status: status
            .parse()
            .map_err(|e: spacebot_core::InvalidInput| bad("status", e.to_string()))?,
        priority: Priority::from_rank(row.try_get("priority").map_err(read)?)
            .map_err(|e| bad("priority", e.to_string()))?,
        created_by: row.try_get("created_by").map_err(read)?,
        metadata: serde_json::from_str::<TaskMetadata>(&metadata)
            .map_err(|e| bad("metadata", e.to_string()))?,
        attempts: count("attempts")?,
        max_attempts: count("max_attempts")?,
        lease: match (lease_holder, lease_expires_at) {
            (Some(holder), Some(at)) => Some(Lease {
                holder,
                expires_at: Timestamp(at),
            }),
            _ => None,
        },
        revision: u64::try_from(revision).map_err(|_| bad("revision", "negative".into()))?,
        result: row.try_get("result").map_err(read)?,
        error: row.try_get("error").map_err(read)?,
        created_at: Timestamp(row.try_get("created_at").map_err(read)?),
        updated_at: Timestamp(row.try_get("updated_at").map_err(read)?),
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
async fn write_transition(
    conn: &mut SqliteConnection,
    location: &Location,
    old_revision: u64,
    transition: &Transition,
) -> Result<(), StoreError> {
    let fail = |doing: &str, e| db_error(location, doing, e);
    let task = &transition.task;
    let number = number_to_sql(task.number).ok_or_else(|| {
        corrupt(
            location,
            format!("task number {} is out of range", task.number),
        )
    })?;
    let done = sqlx::query(UPDATE_SQL)
        .bind(&task.title)
        .bind(&task.description)
        .bind(task.status.as_str())
        .bind(task.priority.rank())
        .bind(task.metadata.delegated_by.as_ref().map(AgentId::as_str))
        .bind(encode_metadata(location, &task.metadata)?)
        .bind(i64::from(task.attempts))
        .bind(i64::from(task.max_attempts))
        .bind(task.lease.as_ref().map(|l| l.holder.as_str()))
        .bind(task.lease.as_ref().map(|l| l.expires_at.0))
        .bind(revision_to_sql(location, task.revision)?)
        .bind(task.result.as_deref())
        .bind(task.error.as_deref())
        .bind(task.updated_at.0)
        .bind(number)
        .bind(revision_to_sql(location, old_revision)?)
        .execute(&mut *conn)
        .await
        .map_err(|e| fail("updating a task", e))?;
    if done.rows_affected() != 1 {
        // Unreachable while the transaction holds the write lock; refuse rather than guess.
        return Err(StoreError::Conflict {
            what: format!("task {}", task.task_ref()),
            expected: format!("revision {old_revision}"),
            actual: "a different revision".into(),
        });
    }
    if let Some(notice) = &transition.notice {
        write_notice(conn, location, number, notice).await?;
    }
    Ok(())
}

async fn write_notice(
    conn: &mut SqliteConnection,
    location: &Location,
    number: i64,
    notice: &CompletionNotice,
) -> Result<(), StoreError> {
    let json = serde_json::to_string(notice).map_err(|e| encode_error(location, "a notice", e))?;
    sqlx::query(OUTBOX_INSERT_SQL)
        .bind(&notice.key)
        .bind(number)
        .bind(json)
        .bind(notice.created_at.0)
        .execute(&mut *conn)
        .await
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
        let (agent, key, location) = (agent.clone(), key.to_string(), db.location.clone());
        db.writes
            .run(move |conn| {
                Box::pin(async move {
                    let fail = |doing: &str, e| db_error(&location, doing, e);
                    let existing = sqlx::query(SELECT_BY_KEY_SQL)
                        .bind(&key)
                        .fetch_optional(&mut *conn)
                        .await
                        .map_err(|e| fail("looking up a task by its idempotency key", e))?;
                    if let Some(row) = existing {
                        return decode(&location, &agent, &row);
                    }
                    let mut task = task.into_task(agent.clone(), 0, now)?;
                    let number = insert(conn, &location, &task, Some(&key)).await?;
                    task.number = u64::try_from(number).map_err(|_| {
                        corrupt(&location, format!("task number {number} is negative"))
                    })?;
                    Ok(task)
                })
            })
            .await
    }
}

/// Inserts `task` (with its create's idempotency key, if any) and returns its new number.
async fn insert(
    conn: &mut SqliteConnection,
    location: &Location,
    task: &Task,
    key: Option<&str>,
) -> Result<i64, StoreError> {
    let metadata = encode_metadata(location, &task.metadata)?;
    let query = sqlx::query_scalar(if key.is_some() {
        INSERT_KEYED_SQL
    } else {
        INSERT_SQL
    })
    .bind(&task.title)
    .bind(&task.description)
    .bind(task.status.as_str())
    .bind(task.priority.rank())
    .bind(&task.created_by)
    .bind(task.metadata.delegated_by.as_ref().map(AgentId::as_str))
    .bind(metadata)
    .bind(i64::from(task.attempts))
    .bind(i64::from(task.max_attempts))
    .bind(revision_to_sql(location, task.revision)?)
    .bind(task.created_at.0)
    .bind(task.updated_at.0);
    let query = match key {
        Some(key) => query.bind(key),
        None => query,
    };
    query
        .fetch_one(&mut *conn)
        .await
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
        let location = db.location.clone();
        db.writes
            .run(move |conn| {
                Box::pin(async move {
                    let number = insert(conn, &location, &task, None).await?;
                    task.number = u64::try_from(number).map_err(|_| {
                        corrupt(&location, format!("task number {number} is negative"))
                    })?;
                    Ok(task)
                })
            })
            .await
    }

    async fn get(&self, agent: &AgentId, number: u64) -> Result<Option<Task>, StoreError> {
        let Some(n) = number_to_sql(number) else {
            return Ok(None);
        };
        let db = self.0.agent(agent).await?;
        let row = sqlx::query(SELECT_ONE_SQL)
            .bind(n)
            .fetch_optional(&mut *db.read("taking a reader connection").await?)
            .await
            .map_err(|e| db_error(&db.location, "reading a task", e))?;
        row.map(|r| decode(&db.location, agent, &r)).transpose()
    }

    async fn list(&self, agent: &AgentId, filter: &TaskFilter) -> Result<Vec<Task>, StoreError> {
        let db = self.0.agent(agent).await?;
        let mut q: QueryBuilder<Sqlite> = QueryBuilder::new("SELECT ");
        q.push(TASK_COLUMNS).push(" FROM tasks WHERE 1 = 1");
        if !filter.statuses.is_empty() {
            q.push(" AND status IN (");
            let mut list = q.separated(", ");
            for s in &filter.statuses {
                list.push_bind(s.as_str());
            }
            q.push(")");
        }
        if let Some(d) = &filter.delegated_by {
            q.push(" AND delegated_by = ").push_bind(d.as_str());
        }
        if let Some(c) = &filter.created_by {
            q.push(" AND created_by = ").push_bind(c.as_str());
        }
        q.push(" ORDER BY number");
        if let Some(limit) = filter.limit {
            q.push(" LIMIT ")
                .push_bind(i64::try_from(limit).unwrap_or(i64::MAX));
        }
        let rows = q
            .build()
            .fetch_all(&mut *db.read("taking a reader connection").await?)
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
        let n = number_to_sql(number).ok_or_else(|| StoreError::not_found(missing.clone()))?;
        let db = self.0.agent(agent).await?;
        let (agent, location) = (agent.clone(), db.location.clone());
        db.writes
            .run(move |conn| {
                Box::pin(async move {
                    let row = sqlx::query(SELECT_ONE_SQL)
                        .bind(n)
                        .fetch_optional(&mut *conn)
                        .await
                        .map_err(|e| db_error(&location, "reading a task", e))?
                        .ok_or_else(|| StoreError::not_found(missing))?;
                    let task = decode(&location, &agent, &row)?;
                    expect.check(&task)?;
                    let transition = task.apply(event, now)?;
                    write_transition(conn, &location, task.revision, &transition).await?;
                    Ok(transition)
                })
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
        let (agent, holder, location) = (agent.clone(), holder.to_string(), db.location.clone());
        db.writes
            .run(move |conn| {
                Box::pin(async move {
                    let row = sqlx::query(CLAIM_SQL)
                        .bind(holder)
                        .bind(now.plus(lease).0)
                        .bind(now.0)
                        .fetch_optional(&mut *conn)
                        .await
                        .map_err(|e| db_error(&location, "claiming a task", e))?;
                    row.map(|r| decode(&location, &agent, &r)).transpose()
                })
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
        let (agent, location) = (agent.clone(), db.location.clone());
        db.writes
            .run(move |conn| {
                Box::pin(async move {
                    let rows = sqlx::query(EXPIRED_SQL)
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
        let db = self.0.agent(agent).await?;
        let rows: Vec<String> = sqlx::query_scalar(OUTBOX_PENDING_SQL)
            .fetch_all(&mut *db.read("taking a reader connection").await?)
            .await
            .map_err(|e| db_error(&db.location, "reading the outbox", e))?;
        rows.iter()
            .map(|json| {
                serde_json::from_str(json)
                    .map_err(|e| corrupt(&db.location, format!("outbox notice: {e}")))
            })
            .collect()
    }

    async fn outbox_mark_sent(&self, agent: &AgentId, key: &str) -> Result<(), StoreError> {
        let db = self.0.agent(agent).await?;
        let (key, location) = (key.to_string(), db.location.clone());
        db.writes
            .run(move |conn| {
                Box::pin(async move {
                    sqlx::query("UPDATE outbox SET sent = 1 WHERE key = ? AND sent = 0")
                        .bind(key)
                        .execute(&mut *conn)
                        .await
                        .map_err(|e| db_error(&location, "marking a notice sent", e))?;
                    Ok(())
                })
            })
            .await
    }
}

/// Finds in-progress tasks whose lease expired.
pub(crate) const EXPIRED_SQL: &str = "SELECT number, title, description, status, priority, \
     created_by, metadata, attempts, max_attempts, lease_holder, lease_expires_at, revision, \
     result, error, created_at, updated_at FROM tasks \
     WHERE status = 'in_progress' AND lease_expires_at <= ? ORDER BY number";

/// Whether a task is ready to be claimed (read before [`CLAIM_SQL`] is sent to the writer).
const READY_EXISTS_SQL: &str = "SELECT 1 FROM tasks WHERE status = 'ready' LIMIT 1";

/// Whether a lease expired at `?` (read before [`EXPIRED_SQL`] is sent to the writer).
const EXPIRED_EXISTS_SQL: &str =
    "SELECT 1 FROM tasks WHERE status = 'in_progress' AND lease_expires_at <= ? LIMIT 1";

/// Whether `sql` (with `bind`, if any) finds a row, read on `db`'s reader.
async fn exists(
    db: &crate::db::Db,
    sql: &'static str,
    bind: Option<i64>,
    what: &str,
) -> Result<bool, StoreError> {
    let mut query = sqlx::query_scalar::<_, i64>(sql);
    if let Some(value) = bind {
        query = query.bind(value);
    }
    let found = query
        .fetch_optional(&mut *db.read("taking a reader connection").await?)
        .await
        .map_err(|e| db_error(&db.location, what, e))?;
    Ok(found.is_some())
}

/// Unsent notices, oldest first.
pub(crate) const OUTBOX_PENDING_SQL: &str = "SELECT notice FROM outbox WHERE sent = 0 ORDER BY seq";

#[cfg(test)]
mod tests {
    use super::*;
    use spacebot_core::TaskStatus;

    const CLAIMABLE: TaskStatus = TaskStatus::Ready;

    /// The `detail` column of `EXPLAIN QUERY PLAN sql`, one line per step.
    async fn plan(stores: &SqliteStores, agent: &AgentId, sql: &str) -> Vec<String> {
        let db = stores.agent(agent).await.unwrap();
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {sql}")))
            .fetch_all(&db.writer)
            .await
            .unwrap();
        rows.iter()
            .map(|r| r.try_get::<String, _>("detail").unwrap())
            .collect()
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
            plan.iter().any(|l| l.contains("INTEGER PRIMARY KEY")),
            "the update does not find the task by its number:\n{text}"
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

    #[test]
    fn claim_sql_names_the_statuses_of_the_domain() {
        assert!(CLAIM_SQL.contains(&format!("status = '{}'", CLAIMABLE.as_str())));
        assert!(CLAIM_SQL.contains(&format!("'{}'", TaskStatus::InProgress.as_str())));
    }
}
