//! This crate's errors and their mapping onto [`StoreError`], always naming the database and
//! schema.

use spacebot_core::{InvalidInput, StoreError};
use sqlx::migrate::MigrateError;

/// The backend name carried by [`StoreError::Backend`].
pub(crate) const BACKEND: &str = "postgres";

/// SQLSTATE of a unique violation.
const UNIQUE_VIOLATION: &str = "23505";
/// SQLSTATEs of transactions PostgreSQL rolled back because of a concurrent one: retried.
const SERIALIZATION_FAILURE: &str = "40001";
const DEADLOCK_DETECTED: &str = "40P01";
/// SQLSTATE classes of a database that is not there or not ours to use.
const UNDEFINED_TABLE: &str = "42P01";

/// What went wrong in this crate, carried as the source of a [`StoreError::Backend`].
#[derive(Debug, thiserror::Error)]
pub(crate) enum PgError {
    /// The driver (or the server) failed while the store was doing something.
    #[error("{doing} in {location}: {source}")]
    Driver {
        /// The database and schema.
        location: String,
        /// What the store was doing.
        doing: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// The stores were cut off from the database (a simulated partition).
    #[error("the stores of {location} are cut off from the database (PgStores::cut_off)")]
    CutOff {
        /// The database and schema.
        location: String,
    },
    /// The stores were closed.
    #[error("the stores of {location} are closed")]
    Closed {
        /// The database and schema.
        location: String,
    },
}

impl PgError {
    /// The server's SQLSTATE, if the server reported the error.
    fn code(&self) -> Option<String> {
        match self {
            Self::Driver {
                source: sqlx::Error::Database(d),
                ..
            } => d.code().map(|c| c.into_owned()),
            _ => None,
        }
    }
}

impl From<PgError> for StoreError {
    fn from(e: PgError) -> Self {
        StoreError::Backend {
            backend: BACKEND,
            message: e.to_string(),
            source: Some(Box::new(e)),
        }
    }
}

/// The server's SQLSTATE of a driver error.
fn sqlstate(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(d) => d.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// Whether `e` is a unique violation, and of which constraint (index) if the server named it.
pub(crate) fn unique_violation(e: &sqlx::Error) -> Option<Option<&str>> {
    match e {
        sqlx::Error::Database(d) if d.code().as_deref() == Some(UNIQUE_VIOLATION) => {
            Some(d.constraint())
        }
        _ => None,
    }
}

/// Whether `e` is a transaction PostgreSQL rolled back for a concurrent one (a deadlock, a
/// serialization failure): running it again is safe and may succeed.
pub(crate) fn is_retryable(e: &StoreError) -> bool {
    let StoreError::Backend {
        source: Some(source),
        ..
    } = e
    else {
        return false;
    };
    source
        .downcast_ref::<PgError>()
        .and_then(PgError::code)
        .is_some_and(|c| c == SERIALIZATION_FAILURE || c == DEADLOCK_DETECTED)
}

/// Maps a driver error met while `doing` something on the database at `location`.
pub(crate) fn db_error(location: &str, doing: &str, e: sqlx::Error) -> StoreError {
    if sqlstate(&e).as_deref() == Some(UNDEFINED_TABLE) {
        // A table of the schema is gone: someone dropped it (or the schema) under the stores.
        return StoreError::Corrupt {
            location: location.to_string(),
            reason: format!("{doing}: {e} (a table of the spacebot schema is missing)"),
        };
    }
    PgError::Driver {
        location: location.to_string(),
        doing: doing.to_string(),
        source: e,
    }
    .into()
}

/// The error of a call made after [`PgStores::close`](crate::PgStores::close).
pub(crate) fn closed(location: &str) -> StoreError {
    PgError::Closed {
        location: location.to_string(),
    }
    .into()
}

/// The error of a call made after [`PgStores::cut_off`](crate::PgStores::cut_off).
pub(crate) fn cut_off(location: &str) -> StoreError {
    PgError::CutOff {
        location: location.to_string(),
    }
    .into()
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
                "schema version {version} was applied by a newer build of spacebot-postgres; \
                 this build does not know it"
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

/// Stored data that does not decode (an unknown status, bad JSON, text that is not UTF-8).
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

/// Refused configuration (a malformed URL, a schema name PostgreSQL would not take as is).
pub(crate) fn invalid(field: &str, reason: impl Into<String>) -> StoreError {
    StoreError::Invalid(InvalidInput::new(field, reason))
}
