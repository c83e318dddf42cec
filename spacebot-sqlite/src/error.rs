//! Mapping of driver errors onto [`StoreError`], always naming the database file.

use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, OnceLock};

use spacebot_core::StoreError;

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

/// An open database's name for error messages, and the first damage any read or write met in it.
///
/// Every error about the database is built from its `Location` ([`db_error`], [`corrupt`]), so a
/// [`StoreError::Corrupt`] raised anywhere (a read on the reader pool, an operation of the writer
/// task) is remembered here, and the writer refuses every later write with that same error.
#[derive(Debug, Clone)]
pub(crate) struct Location {
    name: Arc<str>,
    damage: Arc<OnceLock<String>>,
}

impl Location {
    pub(crate) fn new(name: impl Into<Arc<str>>) -> Self {
        Self {
            name: name.into(),
            damage: Arc::new(OnceLock::new()),
        }
    }

    /// The error of the first damage seen in this database, if any: the same
    /// [`StoreError::Corrupt`] its reader or writer was given.
    pub(crate) fn damage(&self) -> Option<StoreError> {
        self.damage.get().map(|reason| StoreError::Corrupt {
            location: self.name.to_string(),
            reason: reason.clone(),
        })
    }
}

impl Deref for Location {
    type Target = str;
    fn deref(&self) -> &str {
        &self.name
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

/// What an error names: a plain file name, or an open database's [`Location`] (which remembers
/// damage).
pub(crate) trait Site {
    /// The file, for the message.
    fn name(&self) -> &str;
    /// Called with the reason of every [`StoreError::Corrupt`] built for this site.
    fn saw_damage(&self, _reason: &str) {}
}

impl Site for str {
    fn name(&self) -> &str {
        self
    }
}

impl Site for Location {
    fn name(&self) -> &str {
        &self.name
    }
    fn saw_damage(&self, reason: &str) {
        // The first damage is the one every later write is refused with.
        let _ = self.damage.set(reason.to_string());
    }
}

impl<T: Site + ?Sized> Site for &T {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn saw_damage(&self, reason: &str) {
        (**self).saw_damage(reason);
    }
}

impl Site for Arc<str> {
    fn name(&self) -> &str {
        self
    }
}

/// A [`StoreError::Corrupt`] about `site`, remembered by it.
fn damaged<S: Site + ?Sized>(site: &S, reason: String) -> StoreError {
    site.saw_damage(&reason);
    StoreError::Corrupt {
        location: site.name().to_string(),
        reason,
    }
}

fn extended_code(e: &rusqlite::Error) -> Option<i64> {
    match e {
        rusqlite::Error::SqliteFailure(failure, _) => Some(i64::from(failure.extended_code)),
        _ => None,
    }
}

/// Whether `e` is a unique or primary-key constraint violation.
pub(crate) fn is_unique_violation(e: &rusqlite::Error) -> bool {
    matches!(
        extended_code(e),
        Some(SQLITE_CONSTRAINT_UNIQUE | SQLITE_CONSTRAINT_PRIMARYKEY)
    )
}

/// Maps a driver error met while `doing` something on the database at `location`.
///
/// A file that is not a database, or a corrupted one, and a stored value that does not decode as
/// its column's type (text that is not UTF-8, a blob where text belongs) are
/// [`StoreError::Corrupt`]; everything else is [`StoreError::Backend`]. Both name the file.
pub(crate) fn db_error<S: Site + ?Sized>(site: &S, doing: &str, e: rusqlite::Error) -> StoreError {
    let location = site.name();
    if matches!(
        e,
        rusqlite::Error::FromSqlConversionFailure(..)
            | rusqlite::Error::InvalidColumnType(..)
            | rusqlite::Error::IntegralValueOutOfRange(..)
            | rusqlite::Error::Utf8Error(..)
    ) {
        return damaged(
            site,
            format!("{doing}: a stored value does not decode: {e}"),
        );
    }
    match extended_code(&e).map(|c| c & 0xff) {
        Some(SQLITE_CORRUPT | SQLITE_NOTADB) => damaged(site, format!("{doing}: {e}")),
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

/// Why the recorded migrations of a database refuse it (see `crate::migrate`).
#[derive(Debug)]
pub(crate) enum MigrateError {
    /// A statement failed outside any one migration (the history table, the lock).
    Execute(rusqlite::Error),
    /// Migration `version`'s SQL failed.
    ExecuteMigration(rusqlite::Error, i64),
    /// The file records a version this build does not know (a newer build applied it).
    VersionMissing(i64),
    /// The file records a version this build knows, with another checksum.
    VersionMismatch(i64),
    /// The file records a version as not successfully applied.
    Dirty(i64),
}

/// Maps a migration failure on the database at `location`.
pub(crate) fn migrate_error<S: Site + ?Sized>(site: &S, e: MigrateError) -> StoreError {
    let location = site.name();
    match e {
        MigrateError::Execute(e) => db_error(site, "running migrations", e),
        MigrateError::ExecuteMigration(e, version) => {
            db_error(site, &format!("applying migration {version}"), e)
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
    }
}

/// Stored data that does not decode (an unknown status, bad JSON, a negative count).
pub(crate) fn corrupt<S: Site + ?Sized>(site: &S, what: impl fmt::Display) -> StoreError {
    damaged(site, what.to_string())
}

/// A value this crate failed to encode (should not happen with well-formed domain values).
pub(crate) fn encode_error<S: Site + ?Sized>(
    site: &S,
    what: &str,
    e: serde_json::Error,
) -> StoreError {
    let location = site.name();
    StoreError::backend(BACKEND, format!("encoding {what} for {location}: {e}"), e)
}
