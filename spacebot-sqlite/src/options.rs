//! Durability and connection settings.

use std::path::Path;
use std::time::Duration;

use spacebot_core::StoreError;

use crate::SqliteStores;
use crate::db::DbKind;
use crate::writer::Syncing;

/// SQLite's `synchronous` setting: how often a commit waits for the disk.
///
/// Every database runs in WAL mode. With [`Synchronous::Full`] (the default) a commit is synced
/// before it returns and survives a power loss or an operating-system crash, at the price of one
/// `fsync` per commit (concurrent writes of one database share a commit: group commit); in the
/// organization layout the runtime's own writes are synced with the next write the application
/// is answered for instead (see [`SqliteOptions::sync_delay`]). With
/// [`Synchronous::Normal`] a commit is atomic and survives a crash of the process; a power loss or
/// an operating-system crash may undo the last commits (never corrupting the file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Synchronous {
    /// No `fsync` at all: an operating-system crash or power loss may corrupt the database.
    Off,
    /// `fsync` at checkpoints only: safe against process crashes.
    Normal,
    /// `fsync` at every commit (the default): safe against power loss.
    #[default]
    Full,
    /// Like `Full`, and also syncs the directory after deleting journals.
    Extra,
}

impl Synchronous {
    /// The value of `PRAGMA synchronous`.
    pub(crate) fn pragma(self) -> &'static str {
        match self {
            Self::Off => "OFF",
            Self::Normal => "NORMAL",
            Self::Full => "FULL",
            Self::Extra => "EXTRA",
        }
    }
}

/// How much of an existing database file is checked when it is opened, before anything is written
/// to it ([`SqliteOptions::check_on_open`]).
///
/// Whatever the setting, a file that is not an SQLite database, another application's database,
/// the other kind of spacebot database or a schema newer than this build is refused. The checks
/// below find damage: a file refused by them is reported as [`StoreError::Corrupt`] naming the
/// file, and is not written to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OpenCheck {
    /// The default: the file header's fields and the file's length (a truncated or extended
    /// file), the write-ahead log's header and frame checksums (a damaged frame followed by intact
    /// ones), `PRAGMA integrity_check` (every b-tree page, and every index against its table), and
    /// every text value as UTF-8. Reads the whole file once per open.
    #[default]
    Full,
    /// As [`OpenCheck::Full`], with `PRAGMA quick_check` instead of `integrity_check`: indexes are
    /// not compared with their tables. Faster on large files.
    Quick,
    /// None of the checks above: only what identifies the file. For very large files whose
    /// open time matters more, or to open a file refused after an operating-system crash or power
    /// loss left its write-ahead log partly written (see `docs/storage.md`). Damage met later, by a
    /// read or a write, is still reported as [`StoreError::Corrupt`] and stops every later write.
    Skip,
}

/// Where the agents' data lives in a data directory ([`SqliteOptions::layout`]).
///
/// Both layouts hold the same data with the same guarantees; they differ in which writes share
/// a commit (an `fsync` with [`Synchronous::Full`]).
///
/// A directory records its layout at its first open. A directory written before layouts existed
/// holds [`Layout::PerAgent`]; opened with [`Layout::Organization`] (the default) it is migrated
/// once, at that open: every agent's rows are copied into `instance.db` in one transaction
/// together with the new layout's mark (a crash during the copy leaves the directory as it was),
/// then `agents/` is renamed `agents.migrated/` (kept, not read again; delete it when the
/// migrated directory has served you). A directory in [`Layout::Organization`] opened with
/// [`Layout::PerAgent`] is refused: there is no way back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Layout {
    /// Every agent's board, outbox, channel history, pending deliveries and applied keys in
    /// `instance.db`, beside the links, conversations and records, as rows keyed by agent: one
    /// writer and one write-ahead log for the organization, so the writes of different agents made
    /// at the same moment share one commit and one `fsync` (group commit across agents). The
    /// default.
    #[default]
    Organization,
    /// One database per agent (`agents/{id}/data/spacebot.db`), each with its own writer: only
    /// one agent's writes share a commit. A damaged agent file stops that agent alone.
    PerAgent,
}

impl Layout {
    /// The value stored in `instance.db`'s `layout` table.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Organization => "organization",
            Self::PerAgent => "per_agent",
        }
    }
}

/// How [`SqliteStores`] opens its databases. Build with [`SqliteOptions::new`] and the setters,
/// then call [`SqliteOptions::open`].
///
/// ```no_run
/// # async fn run() -> Result<(), spacebot_core::StoreError> {
/// use spacebot_sqlite::{SqliteOptions, Synchronous};
/// use std::time::Duration;
/// let stores = SqliteOptions::new()
///     .busy_timeout(Duration::from_secs(10))
///     .synchronous(Synchronous::Full)
///     .open("./data")
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct SqliteOptions {
    pub(crate) busy_timeout: Duration,
    pub(crate) synchronous: Synchronous,
    pub(crate) readers: u32,
    pub(crate) reader_idle_timeout: Option<Duration>,
    pub(crate) max_batch: usize,
    pub(crate) check_on_open: OpenCheck,
    pub(crate) layout: Layout,
    pub(crate) sync_delay: Duration,
}

impl Default for SqliteOptions {
    fn default() -> Self {
        Self {
            busy_timeout: Duration::from_secs(5),
            synchronous: Synchronous::Full,
            readers: 4,
            reader_idle_timeout: Some(Duration::from_secs(60)),
            max_batch: 256,
            check_on_open: OpenCheck::Full,
            layout: Layout::Organization,
            sync_delay: Duration::from_millis(20),
        }
    }
}

impl SqliteOptions {
    /// The defaults: the organization layout (one database for every agent), 5 s busy timeout,
    /// `synchronous = FULL`, 4 readers per database, group commit of up to 256 write operations
    /// per transaction, the full check of every existing file at open ([`OpenCheck::Full`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// How long a statement waits for a lock held by another connection or process before
    /// failing with a backend error.
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// The `synchronous` setting of every database.
    pub fn synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// The most reader connections per database (at least 1). Writes always go through one
    /// connection per database.
    pub fn readers(mut self, readers: u32) -> Self {
        self.readers = readers.max(1);
        self
    }

    /// How long an idle reader connection is kept (`None`: for ever).
    pub fn reader_idle_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.reader_idle_timeout = timeout;
        self
    }

    /// Group commit: the most write operations of one database that share a transaction (and its
    /// `fsync`), at least 1; default 256.
    ///
    /// Each database has one writer thread. It takes every operation queued while the previous
    /// transaction committed (up to `max_batch`), runs them in one transaction, each after the
    /// first inside its own savepoint (an operation refused by the store's contract is rolled back
    /// alone; the first one refused rolls the transaction back and the others run in the next
    /// batch), commits once,
    /// and only then answers every caller: an acknowledged write is committed whatever the batch
    /// size. A lone operation is never delayed.
    pub fn max_batch(mut self, max_batch: usize) -> Self {
        self.max_batch = max_batch.max(1);
        self
    }

    /// One transaction per write operation (`max_batch(1)`): no group commit.
    pub fn commit_each(self) -> Self {
        self.max_batch(1)
    }

    /// How much of an existing database file is checked at open, before it is written to:
    /// [`OpenCheck::Full`] by default. See [`OpenCheck`].
    pub fn check_on_open(mut self, check: OpenCheck) -> Self {
        self.check_on_open = check;
        self
    }

    /// Where the agents' data lives: [`Layout::Organization`] by default. See [`Layout`] for the
    /// migration of a directory written in the per-agent layout.
    pub fn layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    /// How long the runtime's own writes may wait for their `fsync` under [`Synchronous::Full`]
    /// in [`Layout::Organization`]: 20 ms by default; [`Duration::ZERO`] syncs every commit.
    ///
    /// A write the application is answered for (`Organization::deliver`, an operator's change,
    /// any store call of its own) is synced before it returns, whatever this says. Writes the
    /// runtime makes in its loops between two of those (a turn's commit, a task's claim, a
    /// completion notice handed to its delegator: see `spacebot_core::durability`) are committed
    /// without an `fsync` and synced together by the next immediate write, or at the latest
    /// `delay` after the first of them, and before the stores close. One database, one
    /// write-ahead log replayed in order: a power loss can take back the last of those writes
    /// only together with every write after them, which leaves the organization as a kill at
    /// that point would. A durable delegation round trip then costs one `fsync` (its delivery)
    /// instead of one per commit (about 18).
    ///
    /// Without effect in [`Layout::PerAgent`] (one log per agent: no order between them) and with
    /// other [`Synchronous`] settings.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), spacebot_core::StoreError> {
    /// use std::time::Duration;
    /// // Every commit synced, as before deferred syncing existed.
    /// let stores = spacebot_sqlite::SqliteOptions::new()
    ///     .sync_delay(Duration::ZERO)
    ///     .open("./data")
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn sync_delay(mut self, delay: Duration) -> Self {
        self.sync_delay = delay;
        self
    }

    /// How the writer of the database at `path` syncs its commits.
    pub(crate) fn syncing(&self, path: &Path, kind: DbKind) -> Syncing {
        let counted = matches!(self.synchronous, Synchronous::Full | Synchronous::Extra);
        if self.synchronous == Synchronous::Full
            && self.layout == Layout::Organization
            && kind == DbKind::Instance
            && !self.sync_delay.is_zero()
        {
            Syncing::Deferred {
                delay: self.sync_delay,
                wal: crate::db::wal_path(path),
            }
        } else {
            Syncing::Setting { counted }
        }
    }

    /// Opens (creating if needed) the stores under `dir`. See [`SqliteStores::open_with`].
    pub async fn open(self, dir: impl AsRef<Path>) -> Result<SqliteStores, StoreError> {
        SqliteStores::open_with(dir, self).await
    }
}
