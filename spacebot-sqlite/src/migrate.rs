//! The schema's migrations, applied at open and recorded as sqlx's migrator recorded them.
//!
//! Releases up to 0.1 ran these same SQL files through `sqlx::migrate!`, which records each applied
//! version in the table `_sqlx_migrations` with the SHA-384 checksum of its SQL. This module keeps
//! that table and its meaning, so a data directory written by any release opens unchanged and a
//! directory written by this one still opens with those releases: every version the file records
//! must be known to this build with the same checksum and have succeeded; the versions it lacks
//! are applied in order, each with its record, in the transaction of the open.

use rusqlite::{Connection, OptionalExtension};
use sha2::{Digest, Sha384};

use crate::error::MigrateError;

/// One migration: its version, its description (the file name's rest, `_` read as a space), its SQL.
#[derive(Debug)]
pub(crate) struct Migration {
    pub(crate) version: i64,
    pub(crate) description: &'static str,
    pub(crate) sql: &'static str,
}

impl Migration {
    /// The checksum sqlx recorded for it: SHA-384 of the SQL as the file holds it.
    fn checksum(&self) -> Vec<u8> {
        Sha384::digest(self.sql.as_bytes()).to_vec()
    }
}

/// Migrations of every agent's `spacebot.db` (the files of `migrations/`).
pub(crate) static AGENT: &[Migration] = &[
    Migration {
        version: 1,
        description: "agent",
        sql: include_str!("../migrations/0001_agent.sql"),
    },
    Migration {
        version: 2,
        description: "task idempotency key",
        sql: include_str!("../migrations/0002_task_idempotency_key.sql"),
    },
    Migration {
        version: 3,
        description: "agent column",
        sql: include_str!("../migrations/0003_agent_column.sql"),
    },
];

/// Migrations of `instance.db` (the files of `migrations_instance/`).
pub(crate) static INSTANCE: &[Migration] = &[
    Migration {
        version: 1,
        description: "instance",
        sql: include_str!("../migrations_instance/0001_instance.sql"),
    },
    Migration {
        version: 2,
        description: "records",
        sql: include_str!("../migrations_instance/0002_records.sql"),
    },
    Migration {
        version: 3,
        description: "agents",
        sql: include_str!("../migrations_instance/0003_agents.sql"),
    },
    Migration {
        version: 4,
        description: "cells",
        sql: include_str!("../migrations_instance/0004_cells.sql"),
    },
];

/// The history table, as sqlx creates it.
const HISTORY_TABLE: &str = "CREATE TABLE IF NOT EXISTS _sqlx_migrations (
    version BIGINT PRIMARY KEY,
    description TEXT NOT NULL,
    installed_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
    success BOOLEAN NOT NULL,
    checksum BLOB NOT NULL,
    execution_time BIGINT NOT NULL
);";

/// Whether `migrations` has `version`.
pub(crate) fn knows(migrations: &[Migration], version: i64) -> bool {
    migrations.iter().any(|m| m.version == version)
}

/// Applies the migrations `conn` lacks, inside the transaction the caller opened (the write lock
/// is held, so two processes opening a new file do not both migrate it), and says how many it
/// applied.
pub(crate) fn run(conn: &Connection, migrations: &[Migration]) -> Result<usize, MigrateError> {
    conn.execute_batch(HISTORY_TABLE)
        .map_err(MigrateError::Execute)?;
    let dirty: Option<i64> = conn
        .query_row(
            "SELECT version FROM _sqlx_migrations WHERE success = false ORDER BY version LIMIT 1",
            [],
            |r| r.get(0),
        )
        .optional()
        .map_err(MigrateError::Execute)?;
    if let Some(version) = dirty {
        return Err(MigrateError::Dirty(version));
    }
    let applied: Vec<(i64, Vec<u8>)> = conn
        .prepare("SELECT version, checksum FROM _sqlx_migrations ORDER BY version")
        .and_then(|mut statement| {
            statement
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect()
        })
        .map_err(MigrateError::Execute)?;
    for (version, _) in &applied {
        if !knows(migrations, *version) {
            return Err(MigrateError::VersionMissing(*version));
        }
    }
    let mut count = 0;
    for migration in migrations {
        match applied.iter().find(|(v, _)| *v == migration.version) {
            Some((_, checksum)) => {
                if *checksum != migration.checksum() {
                    return Err(MigrateError::VersionMismatch(migration.version));
                }
            }
            None => {
                apply(conn, migration)?;
                count += 1;
            }
        }
    }
    Ok(count)
}

/// Runs `migration`'s SQL and records it, in one savepoint.
fn apply(conn: &Connection, migration: &Migration) -> Result<(), MigrateError> {
    let start = std::time::Instant::now();
    let failed = |e| MigrateError::ExecuteMigration(e, migration.version);
    conn.execute_batch("SAVEPOINT spacebot_migration")
        .map_err(MigrateError::Execute)?;
    let applied = conn.execute_batch(migration.sql).map_err(failed).and_then(|()| {
        conn.execute(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
             VALUES (?1, ?2, TRUE, ?3, -1)",
            rusqlite::params![migration.version, migration.description, migration.checksum()],
        )
        .map_err(MigrateError::Execute)
    });
    if let Err(e) = applied {
        // Nothing of a failed migration is kept; the open fails with its error.
        let _ = conn.execute_batch("ROLLBACK TO spacebot_migration; RELEASE spacebot_migration");
        return Err(e);
    }
    conn.execute_batch("RELEASE spacebot_migration")
        .map_err(MigrateError::Execute)?;
    let nanos = i64::try_from(start.elapsed().as_nanos()).unwrap_or(i64::MAX);
    conn.execute(
        "UPDATE _sqlx_migrations SET execution_time = ?1 WHERE version = ?2",
        rusqlite::params![nanos, migration.version],
    )
    .map_err(MigrateError::Execute)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    /// Every file of the migration directories is embedded, under the version and description
    /// sqlx read from its name, in order.
    #[test]
    fn the_embedded_migrations_are_the_directories_files() {
        for (dir, migrations) in [("migrations", AGENT), ("migrations_instance", INSTANCE)] {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
            let mut files: Vec<(i64, String, String)> = std::fs::read_dir(&path)
                .unwrap()
                .map(|entry| {
                    let name = entry.unwrap().file_name().into_string().unwrap();
                    let (version, rest) = name.split_once('_').unwrap();
                    let description = rest.trim_end_matches(".sql").replace('_', " ");
                    let sql = std::fs::read_to_string(path.join(&name)).unwrap();
                    (version.parse().unwrap(), description, sql)
                })
                .collect();
            files.sort();
            let embedded: Vec<(i64, String, String)> = migrations
                .iter()
                .map(|m| (m.version, m.description.to_string(), m.sql.to_string()))
                .collect();
            assert_eq!(embedded, files, "{dir}");
        }
    }
}
