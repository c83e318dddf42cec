//! A data directory's layout: recorded in `instance.db` at the first open, and the migration of a
//! directory from the per-agent layout to the organization layout.

use std::path::{Path, PathBuf};

use rusqlite::types::Value;
use rusqlite::{Connection, OpenFlags, OptionalExtension, params_from_iter};
use spacebot_core::{AgentId, StoreError};

use crate::db::{self, Db, DbKind};
use crate::error::{BACKEND, Location, corrupt, db_error};
use crate::options::{Layout, SqliteOptions};

/// Where the agents' own databases of the per-agent layout live.
const AGENTS: &str = "agents";
/// Where `agents/` goes once its rows are in `instance.db`.
const MIGRATED: &str = "agents.migrated";

/// The agent tables, in the order they are copied (a table before the tables that refer to it),
/// with the columns copied (all but `agent`) and the order the rows are read in. `outbox` and
/// `pending_deliveries` leave out `seq`: in the organization's database it counts every agent's
/// rows together, so their rows are given new numbers, in their old order.
const TABLES: [(&str, &str, &str); 6] = [
    (
        "tasks",
        "number, title, description, status, priority, created_by, delegated_by, metadata, \
         attempts, max_attempts, lease_holder, lease_expires_at, revision, result, error, \
         created_at, updated_at, idempotency_key",
        "number",
    ),
    (
        "outbox",
        "key, task_number, notice, created_at, sent",
        "seq",
    ),
    ("channels", "id", "id"),
    (
        "channel_records",
        "seq, channel_id, kind, author, content, metadata, at",
        "seq",
    ),
    (
        "pending_deliveries",
        "id, channel_id, kind, envelope",
        "seq",
    ),
    ("applied_keys", "key, applied_at", "key"),
];

/// The layout `dir` holds, recording `options`' layout in a new directory and migrating a
/// directory in the per-agent layout when `options` ask for the organization layout. `instance`
/// is the directory's opened (and migrated) `instance.db`.
pub(crate) async fn settle(
    dir: &Path,
    instance: &Db,
    options: &SqliteOptions,
) -> Result<Layout, StoreError> {
    let location = instance.location.clone();
    let recorded = instance
        .writes
        .run(move |conn| {
            let kind: Option<String> = conn
                .query_row("SELECT kind FROM layout WHERE one = 1", [], |r| r.get(0))
                .optional()
                .map_err(|e| db_error(&location, "reading the directory's layout", e))?;
            match kind.as_deref() {
                None => Ok(None),
                Some("organization") => Ok(Some(Layout::Organization)),
                Some("per_agent") => Ok(Some(Layout::PerAgent)),
                Some(other) => Err(corrupt(&location, format!("unknown layout {other:?}"))),
            }
        })
        .await?;
    let wanted = options.layout;
    match (recorded, wanted) {
        (Some(Layout::Organization), Layout::Organization) => {
            // A migration killed after its commit may have left `agents/` where it was.
            move_aside(dir)?;
            Ok(Layout::Organization)
        }
        (Some(Layout::PerAgent), Layout::PerAgent) => Ok(Layout::PerAgent),
        (Some(Layout::Organization), Layout::PerAgent) => Err(StoreError::Backend {
            backend: BACKEND,
            message: format!(
                "{} holds the organization layout (every agent in instance.db): it cannot be \
                 opened in the per-agent layout; open it with Layout::Organization",
                dir.display()
            ),
            source: None,
        }),
        (None, Layout::PerAgent) => {
            record(instance, Layout::PerAgent).await?;
            Ok(Layout::PerAgent)
        }
        (Some(Layout::PerAgent) | None, Layout::Organization) => {
            for (agent, path) in agent_files(dir)? {
                copy_agent(instance, &agent, &path, options).await?;
            }
            record(instance, Layout::Organization).await?;
            move_aside(dir)?;
            Ok(Layout::Organization)
        }
    }
}

/// Records `layout` as the directory's.
async fn record(instance: &Db, layout: Layout) -> Result<(), StoreError> {
    let location = instance.location.clone();
    instance
        .writes
        .run(move |conn| {
            conn.execute(
                "INSERT INTO layout (one, kind) VALUES (1, ?1) \
                 ON CONFLICT (one) DO UPDATE SET kind = excluded.kind",
                [layout.as_str()],
            )
            .map_err(|e| db_error(&location, "recording the directory's layout", e))?;
            Ok(())
        })
        .await
}

/// The agents with rows in the organization's database `instance`, in the order of their ids.
pub(crate) async fn agents_with_rows(instance: &Db) -> Result<Vec<AgentId>, StoreError> {
    let location = instance.location.clone();
    instance
        .read("listing the agents", move |conn| {
            let fail = |e| db_error(&location, "listing the agents", e);
            let mut statement = conn
                .prepare(
                    "SELECT agent FROM tasks UNION SELECT agent FROM channels \
                     UNION SELECT agent FROM pending_deliveries \
                     UNION SELECT agent FROM applied_keys ORDER BY 1",
                )
                .map_err(fail)?;
            let ids: Vec<String> = statement
                .query_map([], |r| r.get(0))
                .and_then(Iterator::collect)
                .map_err(fail)?;
            ids.into_iter()
                .map(|id| {
                    AgentId::parse(&id)
                        .map_err(|e| corrupt(&location, format!("stored agent id {id:?}: {e}")))
                })
                .collect()
        })
        .await
}

/// Every agent database of the per-agent layout under `dir`, by agent, in the order of their ids.
pub(crate) fn agent_files(dir: &Path) -> Result<Vec<(AgentId, PathBuf)>, StoreError> {
    let agents = dir.join(AGENTS);
    let entries = match std::fs::read_dir(&agents) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(StoreError::backend(
                BACKEND,
                format!("listing {} to migrate it: {e}", agents.display()),
                e,
            ));
        }
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| {
            StoreError::backend(
                BACKEND,
                format!("listing {} to migrate it: {e}", agents.display()),
                e,
            )
        })?;
        let name = entry.file_name();
        let path = entry.path().join("data").join("spacebot.db");
        if !path.is_file() {
            continue;
        }
        let agent = name
            .to_str()
            .and_then(|name| AgentId::parse(name).ok())
            .ok_or_else(|| {
                corrupt(
                    path.display().to_string().as_str(),
                    "the directory's name is not an agent id: refusing to migrate it",
                )
            })?;
        found.push((agent, path));
    }
    found.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
    Ok(found)
}

/// Copies `agent`'s rows from its own database at `path` into `instance`, replacing what an
/// earlier, unfinished migration copied, in one transaction.
async fn copy_agent(
    instance: &Db,
    agent: &AgentId,
    path: &Path,
    options: &SqliteOptions,
) -> Result<(), StoreError> {
    // Opened as any agent database is: checked (a damaged file is refused and left as it is),
    // its write-ahead log replayed, migrated to the schema with the `agent` column; closed again
    // before its rows are read.
    let own = Db::open(Some(path), DbKind::Agent, options).await?;
    own.close().await;
    // Its rows are read from the file alone: a log still beside it would hold commits the file
    // does not show yet.
    if db::has_wal(path) {
        return Err(StoreError::Backend {
            backend: BACKEND,
            message: format!(
                "migrating {}: its write-ahead log was not checkpointed when it closed; \
                 nothing was migrated, open the directory again",
                path.display()
            ),
            source: None,
        });
    }
    let (agent, path) = (agent.as_str().to_string(), path.to_path_buf());
    let location = instance.location.clone();
    instance
        .writes
        .run(move |conn| {
            let from = Location::new(path.display().to_string());
            // Closed just above (its log checkpointed into the file and removed), and nothing
            // else writes it while the directory is locked: read as an immutable file, which
            // leaves no log or shared-memory file beside it.
            let source = Connection::open_with_flags(
                db::immutable_uri(&path),
                OpenFlags::SQLITE_OPEN_READ_ONLY
                    | OpenFlags::SQLITE_OPEN_URI
                    | OpenFlags::SQLITE_OPEN_NO_MUTEX,
            )
            .map_err(|e| db_error(&from, "opening the database to migrate it", e))?;
            for (table, _, _) in TABLES.iter().rev() {
                conn.execute(&format!("DELETE FROM {table} WHERE agent = ?1"), [&agent])
                    .map_err(|e| db_error(&location, "migrating an agent's rows", e))?;
            }
            for (table, columns, order) in TABLES {
                copy_table(
                    &source, &from, conn, &location, &agent, table, columns, order,
                )?;
            }
            Ok(())
        })
        .await
}

/// Copies one table's rows of an agent's database into the organization's.
#[allow(clippy::too_many_arguments)]
fn copy_table(
    source: &Connection,
    from: &Location,
    conn: &Connection,
    location: &Location,
    agent: &str,
    table: &str,
    columns: &str,
    order: &str,
) -> Result<(), StoreError> {
    let count = columns.split(',').count();
    let marks: Vec<String> = (2..=count + 1).map(|i| format!("?{i}")).collect();
    let mut insert = conn
        .prepare(&format!(
            "INSERT INTO {table} (agent, {columns}) VALUES (?1, {})",
            marks.join(", ")
        ))
        .map_err(|e| db_error(location, "migrating an agent's rows", e))?;
    let mut select = source
        .prepare(&format!("SELECT {columns} FROM {table} ORDER BY {order}"))
        .map_err(|e| db_error(from, "reading an agent's rows to migrate them", e))?;
    let mut rows = select
        .query([])
        .map_err(|e| db_error(from, "reading an agent's rows to migrate them", e))?;
    while let Some(row) = rows
        .next()
        .map_err(|e| db_error(from, "reading an agent's rows to migrate them", e))?
    {
        let mut values = Vec::with_capacity(count + 1);
        values.push(Value::Text(agent.to_string()));
        for i in 0..count {
            values.push(
                row.get::<_, Value>(i)
                    .map_err(|e| db_error(from, "reading an agent's rows to migrate them", e))?,
            );
        }
        insert
            .execute(params_from_iter(values))
            .map_err(|e| db_error(location, "migrating an agent's rows", e))?;
    }
    Ok(())
}

/// Renames `agents/` to `agents.migrated/` (or `agents.migrated.N/` if that is taken) once its
/// rows are in `instance.db`.
fn move_aside(dir: &Path) -> Result<(), StoreError> {
    let agents = dir.join(AGENTS);
    if !agents.is_dir() {
        return Ok(());
    }
    let mut target = dir.join(MIGRATED);
    let mut n = 1;
    while target.exists() {
        target = dir.join(format!("{MIGRATED}.{n}"));
        n += 1;
    }
    std::fs::rename(&agents, &target).map_err(|e| {
        StoreError::backend(
            BACKEND,
            format!(
                "moving {} aside to {} after migrating it: {e}",
                agents.display(),
                target.display()
            ),
            e,
        )
    })?;
    // Not synced: a rename undone by a power loss is redone by the next open.
    Ok(())
}
