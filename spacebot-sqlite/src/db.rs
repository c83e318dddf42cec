//! Opening one database file: checking that it is ours, migrating it, and building its pools.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::TryStreamExt;
use spacebot_core::StoreError;
use sqlx::migrate::Migrator;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use sqlx::{Connection, Row, SqliteConnection, TypeInfo, ValueRef};

use crate::error::{BACKEND, Location, corrupt, db_error, migrate_error};
use crate::options::{OpenCheck, SqliteOptions};
use crate::readers::Readers;
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
    pub(crate) reader: Readers,
    /// The file (or `:memory:`), for error messages; remembers damage seen in it.
    pub(crate) location: Location,
    /// The writer task: runs write operations in shared transactions (group commit).
    pub(crate) writes: Writer,
}

/// A database's pools before its writer task starts.
struct Pools {
    writer: SqlitePool,
    reader: Readers,
    location: Location,
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
        // A file database's writer pool serves the writer task alone (reads have their own pool):
        // the task keeps its connection. In memory, the one connection also serves the reads.
        let writes = Writer::start(
            db.writer.clone(),
            db.location.clone(),
            options.max_batch,
            path.is_some(),
        )?;
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
            reader: Readers::Shared(pool),
            location: Location::new(location),
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
        let reader = Readers::own(base, options.readers, options.reader_idle_timeout);
        Ok(Pools {
            writer,
            reader,
            location: Location::new(location),
        })
    }

    /// Finishes the queued writes, stops the writer task, then closes the readers (those in use
    /// close when given back) and the writer's pool, waiting for its connection.
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
            let checked = inspect_file(path, location, kind, options.check_on_open).await;
            if options.check_on_open != OpenCheck::Skip {
                // Also when SQLite refused the file for a reason of its own ("unsupported file
                // format"): a damaged header is named as such.
                if let Err(StoreError::Backend { .. }) | Ok(()) = &checked {
                    check_layout(path, location, "")?;
                }
            }
            checked?;
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
            if options.check_on_open != OpenCheck::Skip {
                let log = std::fs::read(wal_path(&copy)).map_err(|e| {
                    StoreError::backend(
                        BACKEND,
                        format!("reading the write-ahead log of {location} to check it: {e}"),
                        e,
                    )
                })?;
                check_wal(&log, location)?;
            }
            let connect = SqliteConnectOptions::new()
                .filename(&copy)
                .create_if_missing(false)
                .busy_timeout(options.busy_timeout);
            let mut conn = SqliteConnection::connect_with(&connect)
                .await
                .map_err(|e| db_error(location, "checking the database's write-ahead log", e))?;
            let mut checked = inspect(&mut conn, location, kind, options.check_on_open).await;
            if checked.is_ok() && options.check_on_open != OpenCheck::Skip {
                // The copy as the log leaves it, the log copied into it: its header and length are
                // then those of a closed database.
                checked = sqlx::query_scalar::<_, i64>("PRAGMA wal_checkpoint(TRUNCATE)")
                    .fetch_one(&mut conn)
                    .await
                    .map_err(|e| db_error(location, "checkpointing a copy of the database", e))
                    .and_then(|busy| {
                        if busy == 0 {
                            check_layout(&copy, location, " as its write-ahead log leaves it")
                        } else {
                            Ok(())
                        }
                    });
            }
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
async fn inspect_file(
    path: &Path,
    location: &str,
    kind: DbKind,
    check: OpenCheck,
) -> Result<(), StoreError> {
    let connect = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(false)
        .read_only(true)
        .immutable(true);
    let mut conn = SqliteConnection::connect_with(&connect)
        .await
        .map_err(|e| db_error(location, "opening the database read-only to check it", e))?;
    let checked = inspect(&mut conn, location, kind, check).await;
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
    check_on_open: OpenCheck,
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
    check_contents(conn, location, check_on_open).await
}

/// The whole file through SQLite: `PRAGMA integrity_check` (or `quick_check`), then every text
/// value decoded as UTF-8 (SQLite stores text as it was given and never checks it).
async fn check_contents(
    conn: &mut SqliteConnection,
    location: &str,
    check: OpenCheck,
) -> Result<(), StoreError> {
    let pragma = match check {
        OpenCheck::Full => "PRAGMA integrity_check(10)",
        OpenCheck::Quick => "PRAGMA quick_check(10)",
        OpenCheck::Skip => return Ok(()),
    };
    let doing = |e| db_error(location, "checking the database's integrity", e);
    let findings: Vec<String> = sqlx::query_scalar(pragma)
        .fetch_all(&mut *conn)
        .await
        .map_err(doing)?;
    if findings.len() != 1 || findings[0] != "ok" {
        return Err(corrupt(
            location,
            format!("the integrity check failed: {}", findings.join("; ")),
        ));
    }
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY name",
    )
    .fetch_all(&mut *conn)
    .await
    .map_err(doing)?;
    for table in tables {
        let sql = format!("SELECT * FROM \"{}\"", table.replace('"', "\"\""));
        let mut rows = sqlx::query(sqlx::AssertSqlSafe(sql)).fetch(&mut *conn);
        while let Some(row) = rows.try_next().await.map_err(doing)? {
            for i in 0..row.len() {
                let raw = row.try_get_raw(i).map_err(doing)?;
                if raw.is_null() || raw.type_info().name() != "TEXT" {
                    continue;
                }
                if let Err(e) = row.try_get::<&str, _>(i) {
                    return Err(corrupt(
                        location,
                        format!("table {table}: a text value is not UTF-8: {e}"),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The file's 100-byte header and its length, for what SQLite itself does not check: a file cut
/// short or extended (its length is not the page count the header gives), and header fields that
/// spacebot never sets otherwise (SQLite trusts or ignores most of them).
fn check_layout(path: &Path, location: &str, as_left: &str) -> Result<(), StoreError> {
    let bytes_of = |e: std::io::Error| {
        StoreError::backend(
            BACKEND,
            format!("reading the header of {location} to check it: {e}"),
            e,
        )
    };
    let len = std::fs::metadata(path).map_err(bytes_of)?.len();
    let mut header = Vec::with_capacity(100);
    std::fs::File::open(path)
        .and_then(|f| f.take(100).read_to_end(&mut header))
        .map_err(bytes_of)?;
    let damaged = |what: String| corrupt(location, format!("the file{as_left} is damaged: {what}"));
    if len == 0 {
        return Ok(());
    }
    if header.len() < 100 {
        return Err(damaged(format!(
            "it is {len} bytes long, shorter than its header"
        )));
    }
    let u16_at = |i: usize| u32::from(u16::from_be_bytes([header[i], header[i + 1]]));
    let u32_at =
        |i: usize| u32::from_be_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
    let page_size = match u16_at(16) {
        1 => 65536,
        n => n,
    };
    if !(512..=65536).contains(&page_size) || !page_size.is_power_of_two() {
        return Err(damaged(format!("page size {page_size} in the header")));
    }
    let fields: [(&str, u32, &[u32]); 10] = [
        ("file format write version", u32::from(header[18]), &[1, 2]),
        ("file format read version", u32::from(header[19]), &[1, 2]),
        ("reserved bytes per page", u32::from(header[20]), &[0]),
        (
            "maximum embedded payload fraction",
            u32::from(header[21]),
            &[64],
        ),
        (
            "minimum embedded payload fraction",
            u32::from(header[22]),
            &[32],
        ),
        ("leaf payload fraction", u32::from(header[23]), &[32]),
        ("schema format", u32_at(44), &[1, 2, 3, 4]),
        ("text encoding", u32_at(56), &[1]),
        ("auto-vacuum root page", u32_at(52), &[0]),
        ("incremental vacuum flag", u32_at(64), &[0]),
    ];
    // A database that never had a schema (created, killed before its first table) keeps a
    // schema cookie of 0 and may say 0 for its schema format and text encoding: not damage.
    let schemaless = u32_at(40) == 0;
    for (name, value, allowed) in fields {
        let unset_allowed =
            schemaless && value == 0 && matches!(name, "schema format" | "text encoding");
        if !allowed.contains(&value) && !unset_allowed {
            return Err(damaged(format!("{name} {value} in the header")));
        }
    }
    if header[72..92].iter().any(|b| *b != 0) {
        return Err(damaged("the header's reserved bytes are not zero".into()));
    }
    let version = u32_at(96);
    if !(3_000_000..=3_999_999).contains(&version) {
        return Err(damaged(format!(
            "the header names SQLite version number {version}"
        )));
    }
    // SQLite writes the change counter and the "version valid for" number together; the page
    // count is valid only when they agree (always, for a file SQLite 3.7 or later wrote).
    let (counter, valid_for) = (u32_at(24), u32_at(92));
    if counter != valid_for {
        return Err(damaged(format!(
            "the header's change counter {counter} and its version-valid-for number {valid_for} differ"
        )));
    }
    let pages = u64::from(u32_at(28));
    let expected = pages * u64::from(page_size);
    if len != expected {
        return Err(damaged(format!(
            "it is {len} bytes long, but its header counts {pages} pages of {page_size} bytes \
             ({expected} bytes): truncated or extended"
        )));
    }
    Ok(())
}

/// A write-ahead log's header and frames, as SQLite reads them: a log whose header is damaged is
/// ignored whole by SQLite, and one whose frame is damaged is cut at that frame, so the commits
/// in it or after it would silently be lost. A damaged frame followed by an intact frame of the
/// same log is damage; an invalid last frame is what a write cut short by a crash leaves, and
/// SQLite drops it (so does this check).
fn check_wal(log: &[u8], location: &str) -> Result<(), StoreError> {
    const MAGIC: u32 = 0x377f_0682;
    if log.len() < 32 {
        return Ok(());
    }
    let damaged = |what: String| {
        corrupt(
            location,
            format!("the write-ahead log beside the file is damaged: {what}"),
        )
    };
    let be = |b: &[u8], i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let magic = be(log, 0);
    if magic & !1 != MAGIC {
        return Err(damaged(format!("its header has magic number {magic:#x}")));
    }
    let big_endian = magic & 1 == 1;
    let version = be(log, 4);
    if version != 3_007_000 {
        return Err(damaged(format!("its header has format version {version}")));
    }
    let page_size = be(log, 8);
    if !(512..=65536).contains(&page_size) || !page_size.is_power_of_two() {
        return Err(damaged(format!("its header has page size {page_size}")));
    }
    let header_sum = wal_checksum(big_endian, (0, 0), &log[..24]);
    if header_sum != (be(log, 24), be(log, 28)) {
        return Err(damaged("its header's checksum does not match".into()));
    }
    let salts = (be(log, 16), be(log, 20));
    let frame_size = 24 + page_size as usize;
    let mut previous = header_sum;
    let mut first_bad = None;
    for (n, frame) in log[32..].chunks_exact(frame_size).enumerate() {
        let stored = (be(frame, 16), be(frame, 20));
        let sum = wal_checksum(big_endian, previous, &frame[..8]);
        let sum = wal_checksum(big_endian, sum, &frame[24..]);
        let intact = (be(frame, 8), be(frame, 12)) == salts && be(frame, 0) != 0 && sum == stored;
        match (intact, first_bad) {
            (false, None) => first_bad = Some(n),
            (true, Some(bad)) => {
                return Err(damaged(format!(
                    "frame {bad} does not match its checksum or its log, but frame {n} after it does"
                )));
            }
            _ => {}
        }
        // Each frame's checksum continues the one stored in the frame before it.
        previous = stored;
    }
    Ok(())
}

/// SQLite's write-ahead log checksum over `data` (a multiple of 8 bytes), continuing `sum`.
fn wal_checksum(big_endian: bool, sum: (u32, u32), data: &[u8]) -> (u32, u32) {
    let (mut s0, mut s1) = sum;
    for pair in data.chunks_exact(8) {
        let word = |b: &[u8]| {
            let b = [b[0], b[1], b[2], b[3]];
            if big_endian {
                u32::from_be_bytes(b)
            } else {
                u32::from_le_bytes(b)
            }
        };
        s0 = s0.wrapping_add(word(&pair[..4])).wrapping_add(s1);
        s1 = s1.wrapping_add(word(&pair[4..])).wrapping_add(s0);
    }
    (s0, s1)
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

impl Db {
    /// A reader connection for one read; `doing` names the read in the error.
    pub(crate) async fn read(&self, doing: &str) -> Result<crate::readers::Reader, StoreError> {
        self.reader
            .acquire()
            .await
            .map_err(|e| db_error(&self.location, doing, e))
    }
}
