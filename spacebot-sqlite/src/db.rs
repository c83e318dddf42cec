//! Opening one database file: checking that it is ours, migrating it, and starting its writer
//! thread and its readers.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use rusqlite::{Connection, OpenFlags};
use spacebot_core::StoreError;

use crate::error::{BACKEND, Location, corrupt, db_error, migrate_error};
use crate::migrate::{self, Migration};
use crate::options::{OpenCheck, SqliteOptions};
use crate::readers::{ReaderOptions, Readers};
use crate::writer::{Syncing, Writer};

/// `PRAGMA application_id` of an instance database (`SBI1`).
pub(crate) const INSTANCE_APPLICATION_ID: i64 = 0x5342_4931;
/// `PRAGMA application_id` of an agent database (`SBA1`).
pub(crate) const AGENT_APPLICATION_ID: i64 = 0x5342_4131;

/// Prepared statements each connection keeps (the stores use about 40 distinct ones).
pub(crate) const STATEMENT_CACHE: usize = 64;

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

    fn migrations(self) -> &'static [Migration] {
        match self {
            Self::Instance => migrate::INSTANCE,
            Self::Agent => migrate::AGENT,
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

/// One open database: a writer thread owning the single writer connection, and a pool of readers
/// (the writer's connection itself for an in-memory database).
#[derive(Debug, Clone)]
pub(crate) struct Db {
    /// Serves reads concurrently (WAL lets them run beside the writer).
    pub(crate) reader: Readers,
    /// The file (or `:memory:`), for error messages; remembers damage seen in it.
    pub(crate) location: Location,
    /// The writer thread: runs write operations in shared transactions (group commit).
    pub(crate) writes: Writer,
}

impl Db {
    /// Opens (creating and migrating if needed) the database of `kind` at `path`, or an in-memory
    /// one when `path` is `None`.
    pub(crate) async fn open(
        path: Option<&Path>,
        kind: DbKind,
        options: &SqliteOptions,
    ) -> Result<Self, StoreError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|e| {
            StoreError::backend(
                BACKEND,
                format!(
                    "opening {}: no Tokio runtime is running",
                    path.map_or_else(|| ":memory:".into(), |p| p.display().to_string())
                ),
                e,
            )
        })?;
        let (path, options) = (path.map(Path::to_path_buf), options.clone());
        // Checking and migrating read and write the file: on a blocking thread.
        let opened = runtime
            .spawn_blocking(move || open_blocking(path.as_deref(), kind, &options))
            .await
            .map_err(|e| StoreError::Backend {
                backend: BACKEND,
                message: format!("opening a database: the open did not finish: {e}"),
                source: None,
            })??;
        Ok(opened)
    }

    /// Finishes the queued writes, stops the writer thread (closing its connection), then closes
    /// the readers (those in use close when given back).
    pub(crate) async fn close(&self) {
        self.writes.close().await;
        self.reader.close().await;
    }

    /// Runs `read` on a reader connection, in one hand-off to a blocking thread; `doing` names
    /// the read in errors about the connection.
    pub(crate) async fn read<T, F>(&self, doing: &'static str, read: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    {
        self.reader.run(&self.location, doing, read).await
    }

    /// Runs `read`, an indexed lookup of a row or a few, on the calling thread when a reader
    /// connection is idle (no hand-off), else as [`read`](Self::read).
    pub(crate) async fn read_short<T, F>(
        &self,
        doing: &'static str,
        read: F,
    ) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    {
        match self.writes.read_if_idle(doing, read) {
            Ok(result) => result,
            Err(read) => self.reader.run_short(&self.location, doing, read).await,
        }
    }
}

/// [`Db::open`], on a blocking thread.
fn open_blocking(
    path: Option<&Path>,
    kind: DbKind,
    options: &SqliteOptions,
) -> Result<Db, StoreError> {
    let (conn, location, reader) = match path {
        Some(path) => open_file(path, kind, options)?,
        None => open_memory(kind)?,
    };
    // Under the write lock, so that two processes opening a new file do not both migrate it:
    // the second sees the first's migrations applied (each one runs in a savepoint).
    conn.execute_batch("BEGIN IMMEDIATE")
        .map_err(|e| db_error(&location, "locking the database to migrate it", e))?;
    let applied = match migrate::run(&conn, kind.migrations()) {
        Ok(applied) => applied,
        Err(e) => {
            let _ = conn.execute_batch("ROLLBACK");
            return Err(migrate_error(&location, e));
        }
    };
    if let Err(e) = conn.execute_batch("COMMIT") {
        let _ = conn.execute_batch("ROLLBACK");
        return Err(db_error(&location, "committing migrations", e));
    }
    if applied > 0 {
        compact(&conn, &location)?;
    }
    let shared = Arc::new(Mutex::new(conn));
    let reader =
        reader.unwrap_or_else(|| Readers::Shared(shared.clone(), Arc::new(AtomicBool::new(false))));
    let syncing = match path {
        Some(path) => options.syncing(path, kind),
        None => Syncing::Setting { counted: false },
    };
    let writes = Writer::start(shared, location.clone(), options.max_batch, syncing)?;
    Ok(Db {
        reader,
        location,
        writes,
    })
}

/// Gives the pages that migrations freed (tables rebuilt by migration 3 of an agent's database)
/// back to the file system, so that a migrated file holds no unused pages. Runs once, after the
/// migrations' commit; `VACUUM` is atomic like any transaction.
fn compact(conn: &Connection, location: &Location) -> Result<(), StoreError> {
    let free: i64 = conn
        .query_row("PRAGMA freelist_count", [], |r| r.get(0))
        .map_err(|e| db_error(location, "counting free pages after migrating", e))?;
    if free > 0 {
        conn.execute_batch("VACUUM")
            .map_err(|e| db_error(location, "compacting the file after migrating it", e))?;
    }
    Ok(())
}

/// A database's writer connection and readers (`None`: the writer's connection) before its
/// migrations.
type Opened = (Connection, Location, Option<Readers>);

fn open_memory(kind: DbKind) -> Result<Opened, StoreError> {
    let location = Location::new(match kind {
        DbKind::Instance => ":memory: (instance)",
        DbKind::Agent => ":memory: (agent)",
    });
    // One connection that is never closed: an in-memory database lives as long as it does.
    let conn = Connection::open_in_memory()
        .and_then(|conn| {
            conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
            conn.execute_batch("PRAGMA foreign_keys = ON")?;
            Ok(conn)
        })
        .map_err(|e| db_error(&location, "opening an in-memory database", e))?;
    Ok((conn, location, None))
}

fn open_file(path: &Path, kind: DbKind, options: &SqliteOptions) -> Result<Opened, StoreError> {
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
    check_existing(path, &location, kind, options)?;
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .and_then(|conn| {
        conn.busy_timeout(options.busy_timeout)?;
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        // `journal_mode` answers with the mode set; the others answer nothing.
        conn.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))?;
        conn.execute_batch(&format!(
            "PRAGMA synchronous = {}; PRAGMA foreign_keys = ON;",
            options.synchronous.pragma()
        ))?;
        Ok(conn)
    })
    .map_err(|e| db_error(&*location, "opening the database for writing", e))?;
    let reader = Readers::own(
        ReaderOptions {
            path: path.to_path_buf(),
            busy_timeout: options.busy_timeout,
        },
        options.readers,
        options.reader_idle_timeout,
    );
    Ok((conn, Location::new(location), Some(reader)))
}

/// Whether a non-empty write-ahead log lies beside the database file.
pub(crate) fn has_wal(path: &Path) -> bool {
    std::fs::metadata(wal_path(path)).is_ok_and(|m| m.len() > 0)
}

/// Refuses, without writing anything, a file that is not an SQLite database, another
/// application's database, the other kind of spacebot database, or one with a schema newer than
/// this build.
fn check_existing(
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
            let checked = inspect_file(path, location, kind, options.check_on_open);
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
            let conn = Connection::open_with_flags(
                &copy,
                OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
            )
            .and_then(|conn| {
                conn.busy_timeout(options.busy_timeout)?;
                Ok(conn)
            })
            .map_err(|e| db_error(location, "checking the database's write-ahead log", e))?;
            let mut checked = inspect(&conn, location, kind, options.check_on_open);
            if checked.is_ok() && options.check_on_open != OpenCheck::Skip {
                // The copy as the log leaves it, the log copied into it: its header and length are
                // then those of a closed database.
                checked = conn
                    .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
                        r.get::<_, i64>(0)
                    })
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
            drop(conn);
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
fn inspect_file(
    path: &Path,
    location: &str,
    kind: DbKind,
    check: OpenCheck,
) -> Result<(), StoreError> {
    let conn = Connection::open_with_flags(
        immutable_uri(path),
        OpenFlags::SQLITE_OPEN_READ_ONLY
            | OpenFlags::SQLITE_OPEN_URI
            | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| db_error(location, "opening the database read-only to check it", e))?;
    // Closing a read-only connection cannot lose anything.
    inspect(&conn, location, kind, check)
}

/// `file:{path}?immutable=1`, the path percent-encoded where a URI needs it.
pub(crate) fn immutable_uri(path: &Path) -> String {
    let mut uri = String::from("file:");
    for byte in path.as_os_str().as_encoded_bytes() {
        match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'/' | b'-' | b'_' | b'.' | b'~' => {
                uri.push(char::from(*byte));
            }
            _ => uri.push_str(&format!("%{byte:02X}")),
        }
    }
    uri.push_str("?immutable=1");
    uri
}

/// `{path}-wal`.
pub(crate) fn wal_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push("-wal");
    PathBuf::from(name)
}

fn inspect(
    conn: &Connection,
    location: &str,
    kind: DbKind,
    check_on_open: OpenCheck,
) -> Result<(), StoreError> {
    let check = |e| db_error(location, "checking the database", e);
    let application_id: i64 = conn
        .query_row("PRAGMA application_id", [], |r| r.get(0))
        .map_err(check)?;
    let objects: i64 = conn
        .query_row("SELECT count(*) FROM sqlite_schema", [], |r| r.get(0))
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
    let has_migrations: i64 = conn
        .query_row(
            "SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name = '_sqlx_migrations'",
            [],
            |r| r.get(0),
        )
        .map_err(check)?;
    if has_migrations == 0 {
        return Err(corrupt(
            location,
            "the schema history table _sqlx_migrations is missing",
        ));
    }
    let rows: Vec<(i64, bool)> = conn
        .prepare("SELECT version, success FROM _sqlx_migrations ORDER BY version")
        .and_then(|mut statement| {
            statement
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect()
        })
        .map_err(check)?;
    let known = kind.migrations();
    let latest = known.iter().map(|m| m.version).max().unwrap_or(0);
    for (version, success) in rows {
        if !migrate::knows(known, version) {
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
    check_contents(conn, location, check_on_open)
}

/// The whole file through SQLite: `PRAGMA integrity_check` (or `quick_check`), then every text
/// value decoded as UTF-8 (SQLite stores text as it was given and never checks it).
fn check_contents(conn: &Connection, location: &str, check: OpenCheck) -> Result<(), StoreError> {
    let pragma = match check {
        OpenCheck::Full => "PRAGMA integrity_check(10)",
        OpenCheck::Quick => "PRAGMA quick_check(10)",
        OpenCheck::Skip => return Ok(()),
    };
    let doing = |e| db_error(location, "checking the database's integrity", e);
    let findings: Vec<String> = conn
        .prepare(pragma)
        .and_then(|mut statement| statement.query_map([], |r| r.get(0))?.collect())
        .map_err(doing)?;
    if findings.len() != 1 || findings[0] != "ok" {
        return Err(corrupt(
            location,
            format!("the integrity check failed: {}", findings.join("; ")),
        ));
    }
    let tables: Vec<String> = conn
        .prepare(
            "SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY name",
        )
        .and_then(|mut statement| statement.query_map([], |r| r.get(0))?.collect())
        .map_err(doing)?;
    for table in tables {
        let sql = format!("SELECT * FROM \"{}\"", table.replace('"', "\"\""));
        let mut statement = conn.prepare(&sql).map_err(doing)?;
        let columns = statement.column_count();
        let mut rows = statement.query([]).map_err(doing)?;
        while let Some(row) = rows.next().map_err(doing)? {
            for i in 0..columns {
                if let rusqlite::types::ValueRef::Text(text) = row.get_ref(i).map_err(doing)?
                    && let Err(e) = std::str::from_utf8(text)
                {
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
