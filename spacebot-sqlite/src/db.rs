//! Opening one database file: checking that it is ours, migrating it, and building its pools.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use spacebot_core::StoreError;
use sqlx::migrate::Migrator;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use sqlx::{Connection, Row, SqliteConnection};

use crate::error::{BACKEND, corrupt, db_error, migrate_error};
use crate::options::SqliteOptions;
use crate::writer::Writer;

/// Migrations of every agent's `spacebot.db`.
pub(crate) static AGENT_MIGRATOR: Migrator = sqlx::migrate!("./migrations");
/// Migrations of `instance.db`.
pub(crate) static INSTANCE_MIGRATOR: Migrator = sqlx::migrate!("./migrations_instance");

/// `PRAGMA application_id` of an instance database (`SBI1`).
pub(crate) const INSTANCE_APPLICATION_ID: i64 = 0x5342_4931;
/// `PRAGMA application_id` of an agent database (`SBA1`).
pub(crate) const AGENT_APPLICATION_ID: i64 = 0x5342_4131;

const SQLITE_HEADER: &[u8; 16] = b"SQLite format 3\0";

/// Which of the two database kinds a file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DbKind {
    /// `instance.db`.
    Instance,
    /// `agents/{id}/data/spacebot.db`.
    Agent,
}

impl DbKind {
    fn application_id(self) -> i64 {
        match self {
            Self::Instance => INSTANCE_APPLICATION_ID,
            Self::Agent => AGENT_APPLICATION_ID,
        }
    }

    fn migrator(self) -> &'static Migrator {
        match self {
            Self::Instance => &INSTANCE_MIGRATOR,
            Self::Agent => &AGENT_MIGRATOR,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Self::Instance => "a spacebot instance database",
            Self::Agent => "a spacebot agent database",
        }
    }

    fn describe_id(id: i64) -> Option<&'static str> {
        match id {
            INSTANCE_APPLICATION_ID => Some(Self::Instance.describe()),
            AGENT_APPLICATION_ID => Some(Self::Agent.describe()),
            _ => None,
        }
    }
}

/// One open database: a single writer connection and a pool of readers (the same single connection
/// for an in-memory database).
#[derive(Debug, Clone)]
pub(crate) struct Db {
    /// Serializes every write of this process to the file.
    pub(crate) writer: SqlitePool,
    /// Serves reads concurrently (WAL lets them run beside the writer).
    pub(crate) reader: SqlitePool,
    /// The file (or `:memory:`), for error messages.
    pub(crate) location: Arc<str>,
    /// The writer task: runs write operations in shared transactions (group commit).
    pub(crate) writes: Writer,
}

/// A database's pools before its writer task starts.
struct Pools {
    writer: SqlitePool,
    reader: SqlitePool,
    location: Arc<str>,
}

impl Db {
    /// Opens (creating and migrating if needed) the database of `kind` at `path`, or an in-memory
    /// one when `path` is `None`.
    pub(crate) async fn open(
        path: Option<&Path>,
        kind: DbKind,
        options: &SqliteOptions,
    ) -> Result<Self, StoreError> {
        let db = match path {
            Some(path) => Self::open_file(path, kind, options).await?,
            None => Self::open_memory(kind).await?,
        };
        // Under the write lock, so that two processes opening a new file do not both migrate it:
        // the second sees the first's migrations applied (each one runs in a savepoint).
        let mut tx = db
            .writer
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(|e| db_error(&db.location, "locking the database to migrate it", e))?;
        // `run_direct` is what `Migrator::run` calls once it has a connection; `run` itself takes an
        // `Acquire` whose higher-ranked bound makes the future not provably `Send` here.
        kind.migrator()
            .run_direct(None, &mut *tx, false)
            .await
            .map_err(|e| migrate_error(&db.location, e))?;
        tx.commit()
            .await
            .map_err(|e| db_error(&db.location, "committing migrations", e))?;
        let writes = Writer::start(db.writer.clone(), db.location.clone(), options.max_batch)?;
        Ok(Self {
            writer: db.writer,
            reader: db.reader,
            location: db.location,
            writes,
        })
    }

    async fn open_memory(kind: DbKind) -> Result<Pools, StoreError> {
        let location: Arc<str> = Arc::from(match kind {
            DbKind::Instance => ":memory: (instance)",
            DbKind::Agent => ":memory: (agent)",
        });
        let connect = SqliteConnectOptions::new()
            .in_memory(true)
            .foreign_keys(true);
        // One connection that is never closed: an in-memory database lives as long as it does.
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .test_before_acquire(false)
            .connect_with(connect)
            .await
            .map_err(|e| db_error(&location, "opening an in-memory database", e))?;
        Ok(Pools {
            writer: pool.clone(),
            reader: pool,
            location,
        })
    }

    async fn open_file(
        path: &Path,
        kind: DbKind,
        options: &SqliteOptions,
    ) -> Result<Pools, StoreError> {
        let location: Arc<str> = Arc::from(path.display().to_string());
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| {
                StoreError::backend(
                    BACKEND,
                    format!(
                        "creating directory {} for {location}: {e}",
                        parent.display()
                    ),
                    e,
                )
            })?;
        }
        check_existing(path, &location, kind, options).await?;

        let base = SqliteConnectOptions::new()
            .filename(path)
            .busy_timeout(options.busy_timeout)
            .synchronous(options.synchronous.into())
            .foreign_keys(true);
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .test_before_acquire(false)
            .connect_with(
                base.clone()
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal),
            )
            .await
            .map_err(|e| db_error(&location, "opening the database for writing", e))?;
        let reader = SqlitePoolOptions::new()
            .max_connections(options.readers.max(1))
            .min_connections(0)
            .idle_timeout(options.reader_idle_timeout)
            .test_before_acquire(false)
            .connect_lazy_with(base);
        Ok(Pools {
            writer,
            reader,
            location,
        })
    }

    /// Finishes the queued writes, stops the writer task, then closes both pools, waiting for
    /// connections in use to be returned.
    pub(crate) async fn close(&self) {
        self.writes.close().await;
        self.reader.close().await;
        self.writer.close().await;
    }
}

/// Refuses, without writing anything, a file that is not an SQLite database, another
/// application's database, the other kind of spacebot database, or one with a schema newer than
/// this build.
/// Whether a non-empty write-ahead log lies beside the database file.
fn has_wal(path: &Path) -> bool {
    std::fs::metadata(wal_path(path)).is_ok_and(|m| m.len() > 0)
}

async fn check_existing(
    path: &Path,
    location: &str,
    kind: DbKind,
    options: &SqliteOptions,
) -> Result<(), StoreError> {
    let mut header = Vec::with_capacity(16);
    match std::fs::File::open(path) {
        Ok(file) => {
            file.take(16).read_to_end(&mut header).map_err(|e| {
                StoreError::backend(BACKEND, format!("reading the header of {location}: {e}"), e)
            })?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(StoreError::backend(
                BACKEND,
                format!("opening {location}: {e}"),
                e,
            ));
        }
    }
    // SQLite treats an empty file as an empty database (though a log beside it may not be empty).
    if !header.is_empty() {
        if header.as_slice() != SQLITE_HEADER {
            return Err(corrupt(
                location,
                "not an SQLite database (the file header is wrong): refusing to touch it",
            ));
        }
        // Read-only and immutable: SQLite neither replays nor creates a write-ahead log or its
        // index beside the file, so a file that is refused is left exactly as it was found. With
        // a non-empty log beside it, the file alone may be mid-checkpoint (a process killed while
        // it closed): only the file as the log leaves it, checked on a copy below, tells.
        if !has_wal(path) {
            inspect_file(path, location, kind).await?;
        }
    }

    // A write-ahead log left beside the file (a crash, or another program's database) may hold
    // commits the file itself does not show yet, such as another application's schema. Check the
    // file as that log would leave it, on a copy in a temporary directory, so that the log is
    // replayed there and never here.
    let wal = wal_path(path);
    match std::fs::metadata(&wal) {
        Ok(meta) if meta.len() > 0 => {
            let scratch = tempfile::Builder::new()
                .prefix("spacebot-check-")
                .tempdir()
                .map_err(|e| {
                    StoreError::backend(
                        BACKEND,
                        format!("creating a temporary directory to check {location}: {e}"),
                        e,
                    )
                })?;
            let copy = scratch.path().join("check.db");
            let copied = std::fs::copy(path, &copy)
                .and_then(|_| std::fs::copy(&wal, wal_path(&copy)))
                .map_err(|e| {
                    StoreError::backend(
                        BACKEND,
                        format!("copying {location} and its write-ahead log to check them: {e}"),
                        e,
                    )
                });
            copied?;
            let connect = SqliteConnectOptions::new()
                .filename(&copy)
                .create_if_missing(false)
                .busy_timeout(options.busy_timeout);
            let mut conn = SqliteConnection::connect_with(&connect)
                .await
                .map_err(|e| db_error(location, "checking the database's write-ahead log", e))?;
            let checked = inspect(&mut conn, location, kind).await;
            // The copy is thrown away; closing it cannot lose anything.
            let _ = conn.close().await;
            checked
        }
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StoreError::backend(
            BACKEND,
            format!("reading the metadata of the write-ahead log of {location}: {e}"),
            e,
        )),
    }
}

/// Checks `path` through a read-only, immutable connection: nothing is written, created or
/// replayed.
async fn inspect_file(path: &Path, location: &str, kind: DbKind) -> Result<(), StoreError> {
    let connect = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(false)
        .read_only(true)
        .immutable(true);
    let mut conn = SqliteConnection::connect_with(&connect)
        .await
        .map_err(|e| db_error(location, "opening the database read-only to check it", e))?;
    let checked = inspect(&mut conn, location, kind).await;
    // Closing a read-only connection cannot lose anything; its error would hide the real one.
    let _ = conn.close().await;
    checked
}

/// `{path}-wal`.
fn wal_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push("-wal");
    PathBuf::from(name)
}

async fn inspect(
    conn: &mut SqliteConnection,
    location: &str,
    kind: DbKind,
) -> Result<(), StoreError> {
    let check = |e| db_error(location, "checking the database", e);
    let application_id: i64 = sqlx::query_scalar("PRAGMA application_id")
        .fetch_one(&mut *conn)
        .await
        .map_err(check)?;
    let objects: i64 = sqlx::query_scalar("SELECT count(*) FROM sqlite_schema")
        .fetch_one(&mut *conn)
        .await
        .map_err(check)?;
    if application_id != kind.application_id() {
        if application_id == 0 && objects == 0 {
            return Ok(()); // an empty database: ours to initialize
        }
        let what = match DbKind::describe_id(application_id) {
            Some(other) => format!("{other}, not {}", kind.describe()),
            None if application_id == 0 => {
                format!("an SQLite database that is not {}", kind.describe())
            }
            None => format!(
                "an SQLite database of another application (application_id {application_id:#x}), not {}",
                kind.describe()
            ),
        };
        return Err(corrupt(
            location,
            format!("the file is {what}: refusing to touch it"),
        ));
    }
    let has_migrations: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name = '_sqlx_migrations'",
    )
    .fetch_one(&mut *conn)
    .await
    .map_err(check)?;
    if has_migrations == 0 {
        return Err(corrupt(
            location,
            "the schema history table _sqlx_migrations is missing",
        ));
    }
    let rows = sqlx::query("SELECT version, success FROM _sqlx_migrations ORDER BY version")
        .fetch_all(&mut *conn)
        .await
        .map_err(check)?;
    let known = kind.migrator();
    let latest = known.iter().map(|m| m.version).max().unwrap_or(0);
    for row in rows {
        let version: i64 = row.try_get("version").map_err(check)?;
        let success: bool = row.try_get("success").map_err(check)?;
        if !known.version_exists(version) {
            return Err(corrupt(
                location,
                format!(
                    "schema version {version} is newer than this build of spacebot-sqlite knows (latest {latest}): upgrade spacebot"
                ),
            ));
        }
        if !success {
            return Err(corrupt(
                location,
                format!("schema version {version} was only partly applied"),
            ));
        }
    }
    Ok(())
}

/// `{dir}/instance.db`.
pub(crate) fn instance_path(dir: &Path) -> PathBuf {
    dir.join("instance.db")
}

/// `{dir}/agents/{id}/data/spacebot.db`.
pub(crate) fn agent_path(dir: &Path, agent: &spacebot_core::AgentId) -> PathBuf {
    dir.join("agents")
        .join(agent.as_str())
        .join("data")
        .join("spacebot.db")
}
