//! Mapping of driver errors onto [`StoreError`], always naming the database file.

use spacebot_core::StoreError;
use sqlx::migrate::MigrateError;

/// The backend name carried by [`StoreError::Backend`].
pub(crate) const BACKEND: &str = "sqlite";

/// SQLite primary result codes this crate tells apart.
const SQLITE_CORRUPT: i64 = 11;
const SQLITE_NOTADB: i64 = 26;
const SQLITE_READONLY: i64 = 8;
const SQLITE_CANTOPEN: i64 = 14;
/// Extended codes of unique and primary-key violations.
const SQLITE_CONSTRAINT_PRIMARYKEY: i64 = 1555;
const SQLITE_CONSTRAINT_UNIQUE: i64 = 2067;

fn extended_code(e: &sqlx::Error) -> Option<i64> {
    match e {
        sqlx::Error::Database(d) => d.code().and_then(|c| c.parse().ok()),
        _ => None,
    }
}

/// Whether `e` is a unique or primary-key constraint violation.
pub(crate) fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(
        extended_code(e),
        Some(SQLITE_CONSTRAINT_UNIQUE | SQLITE_CONSTRAINT_PRIMARYKEY)
    )
}

/// Maps a driver error met while `doing` something on the database at `location`.
///
/// A file that is not a database, or a corrupted one, is [`StoreError::Corrupt`]; everything else
/// is [`StoreError::Backend`]. Both name the file.
pub(crate) fn db_error(location: &str, doing: &str, e: sqlx::Error) -> StoreError {
    match extended_code(&e).map(|c| c & 0xff) {
        Some(SQLITE_CORRUPT | SQLITE_NOTADB) => StoreError::Corrupt {
            location: location.to_string(),
            reason: format!("{doing}: {e}"),
        },
        Some(SQLITE_READONLY | SQLITE_CANTOPEN) => StoreError::backend(
            BACKEND,
            format!(
                "{doing} in {location}: {e} (the file and its directory must be writable: \
                 SQLite keeps its write-ahead log beside the file)"
            ),
            e,
        ),
        _ => StoreError::backend(BACKEND, format!("{doing} in {location}: {e}"), e),
    }
}

/// Maps a migration failure on the database at `location`.
pub(crate) fn migrate_error(location: &str, e: MigrateError) -> StoreError {
    match e {
        MigrateError::Execute(e) => db_error(location, "running migrations", e),
        MigrateError::ExecuteMigration(e, version) => {
            db_error(location, &format!("applying migration {version}"), e)
        }
        MigrateError::VersionMissing(version) => StoreError::Corrupt {
            location: location.to_string(),
            reason: format!(
                "schema version {version} was applied by a newer build of spacebot-sqlite; this build does not know it"
            ),
        },
        MigrateError::VersionMismatch(version) => StoreError::Corrupt {
            location: location.to_string(),
            reason: format!(
                "schema version {version} was applied with different contents than this build's"
            ),
        },
        MigrateError::Dirty(version) => StoreError::Corrupt {
            location: location.to_string(),
            reason: format!("schema version {version} was only partly applied"),
        },
        other => StoreError::backend(
            BACKEND,
            format!("running migrations in {location}: {other}"),
            other,
        ),
    }
}

/// Stored data that does not decode (an unknown status, bad JSON, a negative count).
pub(crate) fn corrupt(location: &str, what: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt {
        location: location.to_string(),
        reason: what.to_string(),
    }
}

/// A value this crate failed to encode (should not happen with well-formed domain values).
pub(crate) fn encode_error(location: &str, what: &str, e: serde_json::Error) -> StoreError {
    StoreError::backend(BACKEND, format!("encoding {what} for {location}: {e}"), e)
}
