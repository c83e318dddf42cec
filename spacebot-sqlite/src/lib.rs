//! SQLite backends of every spacebot store, through `rusqlite`.
//!
//! [`open`] a directory and get the [`Stores`] bundle the runtime needs. The default layout,
//! [`Layout::Organization`], keeps the whole organization in one file:
//!
//! ```text
//! {dir}/
//!     instance.db                   links, conversation links and their members,
//!                                   behaviours' records, and every agent's task board,
//!                                   outbox, channel history, pending deliveries and
//!                                   applied idempotency keys (rows keyed by agent)
//! ```
//!
//! so that the writes of different agents made at the same moment share one commit (one `fsync`
//! with `synchronous = FULL`), and the runtime's own writes can wait for the next write the
//! application is answered for to be synced with it ([`SqliteOptions::sync_delay`]: one
//! write-ahead log, replayed in order). [`Layout::PerAgent`] gives each agent a database of its own instead:
//!
//! ```text
//! {dir}/
//!     instance.db                   links, conversations, records
//!     agents/
//!         {agent}/data/spacebot.db  that agent's board, outbox, channel history,
//!                                   pending deliveries, applied idempotency keys
//! ```
//!
//! A directory written in the per-agent layout (every directory written before layouts existed)
//! is migrated to the organization layout when it is opened with the default options; see
//! [`Layout`].
//!
//! `instance.db` is opened (created, migrated) by [`open`]; in the per-agent layout an agent's
//! database is opened the first time a store call names that agent. Migrations are embedded in the
//! binary (`migrations/` for agent databases, `migrations_instance/` for the instance database)
//! and run at open. Every file runs in WAL mode with a busy timeout and foreign keys on; writes of
//! one process go through a single connection per file, owned by a thread that runs each batch of
//! writes whole, and reads through a small pool, each read one closure on a blocking thread.
//!
//! # Guarantees
//! - One data directory has one owner: [`open`] takes an exclusive lock on `{dir}/spacebot.lock`
//!   (and writes its pid there) for as long as the stores are open. A second open, from another
//!   process or another handle in this one, fails with [`StoreError::Backend`] naming the directory
//!   and the holder's pid. [`SqliteStores::close`], or dropping the last clone, releases it.
//! - A claim is one `UPDATE ... RETURNING` statement that only matches a task still `ready`, so
//!   two claims never get the same task.
//! - Task numbers are allocated inside the inserting statement, under SQLite's write lock: no two
//!   tasks share a number and numbers have no gaps.
//! - A terminal transition and its completion notice are written in one `BEGIN IMMEDIATE`
//!   transaction.
//! - Group commit: each database's writes go through one writer thread, which runs every write
//!   queued meanwhile (up to [`SqliteOptions::max_batch`]) in one transaction, each in its own
//!   savepoint, commits once and only then answers the callers. A write refused by the store's
//!   contract is rolled back alone; a failed commit fails every write of the batch.
//! - A file that is not an SQLite database, another application's database, or a database whose
//!   schema is newer than this build is refused with [`StoreError::Corrupt`] naming the file, and
//!   left untouched: it is checked through a read-only, immutable connection, and a write-ahead
//!   log beside it is only ever replayed into a copy in a temporary directory.
//!
//! ```no_run
//! # async fn run() -> Result<(), spacebot_core::StoreError> {
//! let stores = spacebot_sqlite::open("./data").await?;
//! let links = stores.links.list().await?;
//! # Ok(()) }
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]

mod cells;
mod channels;
mod conversations;
mod db;
mod deliveries;
mod error;
mod layout;
mod links;
mod migrate;
mod options;
mod query;
mod readers;
mod records;
mod tasks;
mod writer;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use spacebot_core::{AgentId, StoreError, Stores};
use tokio::sync::OnceCell;

pub use crate::channels::SqliteChannelStore;
pub use crate::conversations::SqliteConversationStore;
use crate::db::{Db, DbKind};
pub use crate::deliveries::SqliteDeliveryStore;
pub use crate::links::SqliteLinkStore;
pub use crate::options::{Layout, OpenCheck, SqliteOptions, Synchronous};
pub use crate::records::SqliteRecordStore;
pub use crate::tasks::SqliteTaskStore;
pub use crate::writer::WriteStats;
use spacebot_core::dir_lock::{self, DirLock};

/// The statements of a task cycle (create, claim, complete with its outbox row), for the benchmark
/// that compares the stores with a raw driver running the same SQL. Not a stable API.
#[doc(hidden)]
pub mod sql {
    pub use crate::tasks::{CLAIM_SQL, INSERT_SQL, OUTBOX_INSERT_SQL, SELECT_ONE_SQL, UPDATE_SQL};
}

/// Opens (creating if needed) the SQLite stores under `dir` with the default [`SqliteOptions`],
/// as the [`Stores`] bundle.
///
/// # Errors
/// [`StoreError::Corrupt`] if `instance.db` is not a spacebot instance database (or is newer than
/// this build); [`StoreError::Backend`] if the directory is already open (naming the holder's
/// pid), or the directory or the file cannot be created or opened. Both name the file or the
/// directory.
pub async fn open(dir: impl AsRef<Path>) -> Result<Stores, StoreError> {
    Ok(SqliteStores::open(dir).await?.stores())
}

/// Every spacebot store on SQLite: one database for the whole organization, or (in
/// [`Layout::PerAgent`]) an instance database plus one database per agent, opened lazily. Cheap to
/// clone (clones share the databases).
///
/// Each store trait is implemented by a handle that shares these databases:
/// [`SqliteStores::links`], [`SqliteStores::conversations`] and [`SqliteStores::records`] on the
/// instance database,
/// [`SqliteStores::tasks`], [`SqliteStores::channels`] and [`SqliteStores::deliveries`] on the
/// agents' databases; [`SqliteStores::stores`] bundles them all.
#[derive(Debug, Clone)]
pub struct SqliteStores {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// `None` for in-memory stores.
    dir: Option<PathBuf>,
    options: SqliteOptions,
    /// The directory's layout, as recorded in it (for new directories, as the options asked).
    layout: Layout,
    instance: Db,
    agents: Mutex<HashMap<AgentId, Arc<OnceCell<Db>>>>,
    /// The directory of [`SqliteStores::temporary`] stores, deleted when the last clone is dropped.
    _temporary: Option<tempfile::TempDir>,
    /// The lock of an opened data directory (`None` for temporary and in-memory stores, and once
    /// closed): released by [`SqliteStores::close`] or when the last clone is dropped.
    lock: Mutex<Option<DirLock>>,
    /// Set by [`SqliteStores::close`]: no database is opened afterwards.
    closed: AtomicBool,
    /// The record store's typed cells, their images in `instance.db` (see [`SqliteRecordStore`]).
    cells: spacebot_core::records::TypedCells,
}

impl SqliteStores {
    /// Opens (creating if needed) the stores under `dir` with the default options.
    ///
    /// # Errors
    /// As [`open`].
    pub async fn open(dir: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::open_with(dir, SqliteOptions::default()).await
    }

    /// Opens (creating if needed) the stores under `dir` with `options`.
    ///
    /// # Errors
    /// As [`open`].
    pub async fn open_with(
        dir: impl AsRef<Path>,
        options: SqliteOptions,
    ) -> Result<Self, StoreError> {
        let dir = dir.as_ref().to_path_buf();
        let lock = acquire_lock(&dir).await?;
        let instance = Db::open(Some(&db::instance_path(&dir)), DbKind::Instance, &options).await?;
        let layout = match layout::settle(&dir, &instance, &options).await {
            Ok(layout) => layout,
            Err(e) => {
                instance.close().await;
                return Err(e);
            }
        };
        Ok(Self::from_parts(
            Some(dir),
            options,
            layout,
            instance,
            None,
            Some(lock),
        ))
    }

    /// Stores in a new temporary directory, deleted when the last clone of the returned value is
    /// dropped. Same files and durability as [`SqliteStores::open`]; for examples and tests.
    ///
    /// # Errors
    /// [`StoreError::Backend`] if the temporary directory cannot be created, else as [`open`].
    pub async fn temporary() -> Result<Self, StoreError> {
        Self::temporary_with(SqliteOptions::default()).await
    }

    /// [`SqliteStores::temporary`] with `options`.
    ///
    /// # Errors
    /// As [`SqliteStores::temporary`].
    pub async fn temporary_with(options: SqliteOptions) -> Result<Self, StoreError> {
        let temp = tempfile::Builder::new()
            .prefix("spacebot-")
            .tempdir()
            .map_err(|e| {
                StoreError::backend(
                    error::BACKEND,
                    format!("creating a temporary directory: {e}"),
                    e,
                )
            })?;
        let dir = temp.path().to_path_buf();
        let instance = Db::open(Some(&db::instance_path(&dir)), DbKind::Instance, &options).await?;
        let layout = layout::settle(&dir, &instance, &options).await?;
        Ok(Self::from_parts(
            Some(dir),
            options,
            layout,
            instance,
            Some(temp),
            None,
        ))
    }

    /// Stores in memory, in the default layout: nothing survives the value (and its clones).
    /// Meant for tests.
    ///
    /// # Errors
    /// [`StoreError::Backend`] if SQLite cannot open an in-memory database.
    pub async fn in_memory() -> Result<Self, StoreError> {
        Self::in_memory_with(SqliteOptions::default()).await
    }

    /// [`SqliteStores::in_memory`] with `options` (its layout and batch size; the settings of
    /// files do not apply). In [`Layout::PerAgent`] each agent gets an in-memory database of its
    /// own.
    ///
    /// # Errors
    /// As [`SqliteStores::in_memory`].
    pub async fn in_memory_with(options: SqliteOptions) -> Result<Self, StoreError> {
        let instance = Db::open(None, DbKind::Instance, &options).await?;
        let layout = options.layout;
        Ok(Self::from_parts(
            None, options, layout, instance, None, None,
        ))
    }

    fn from_parts(
        dir: Option<PathBuf>,
        options: SqliteOptions,
        layout: Layout,
        instance: Db,
        temporary: Option<tempfile::TempDir>,
        lock: Option<DirLock>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                dir,
                options,
                layout,
                cells: spacebot_core::records::TypedCells::stored_in(Arc::new(
                    crate::cells::SqliteCellImages {
                        db: instance.clone(),
                    },
                )),
                instance,
                agents: Mutex::new(HashMap::new()),
                _temporary: temporary,
                lock: Mutex::new(lock),
                closed: AtomicBool::new(false),
            }),
        }
    }

    /// The bundle of every store, all backed by these databases.
    pub fn stores(&self) -> Stores {
        Stores {
            links: Arc::new(self.links()),
            conversations: Arc::new(self.conversations()),
            tasks: Arc::new(self.tasks()),
            channels: Arc::new(self.channels()),
            deliveries: Arc::new(self.deliveries()),
            records: Arc::new(self.records()),
        }
    }

    /// The [`LinkStore`](spacebot_core::LinkStore) (instance database).
    pub fn links(&self) -> SqliteLinkStore {
        SqliteLinkStore(self.clone())
    }

    /// The [`ConversationStore`](spacebot_core::ConversationStore) (instance database).
    pub fn conversations(&self) -> SqliteConversationStore {
        SqliteConversationStore(self.clone())
    }

    /// The [`TaskStore`](spacebot_core::TaskStore) (agents' databases).
    pub fn tasks(&self) -> SqliteTaskStore {
        SqliteTaskStore(self.clone())
    }

    /// The [`ChannelStore`](spacebot_core::ChannelStore) (agents' databases).
    pub fn channels(&self) -> SqliteChannelStore {
        SqliteChannelStore(self.clone())
    }

    /// The [`DeliveryStore`](spacebot_core::DeliveryStore) (agents' databases).
    pub fn deliveries(&self) -> SqliteDeliveryStore {
        SqliteDeliveryStore(self.clone())
    }

    /// The [`RecordStore`](spacebot_core::RecordStore) (instance database).
    pub fn records(&self) -> SqliteRecordStore {
        SqliteRecordStore(self.clone())
    }

    /// The directory the stores live in (`None` in memory).
    pub fn dir(&self) -> Option<&Path> {
        self.inner.dir.as_deref()
    }

    /// The path of the instance database (`None` in memory).
    pub fn instance_db_path(&self) -> Option<PathBuf> {
        self.inner.dir.as_deref().map(db::instance_path)
    }

    /// The directory's layout.
    pub fn layout(&self) -> Layout {
        self.inner.layout
    }

    /// The agents that have rows here (tasks, channels, pending deliveries or applied keys), in
    /// the order of their ids: for tools that look into a data directory.
    ///
    /// # Errors
    /// [`StoreError::Backend`] if the database or the directory cannot be read;
    /// [`StoreError::Corrupt`] if an agent id stored (or an agent directory's name) is not one.
    pub async fn agents(&self) -> Result<Vec<AgentId>, StoreError> {
        match (self.inner.layout, self.inner.dir.as_deref()) {
            (Layout::PerAgent, Some(dir)) => Ok(layout::agent_files(dir)?
                .into_iter()
                .map(|(agent, _)| agent)
                .collect()),
            (Layout::PerAgent, None) => {
                let mut agents: Vec<AgentId> = self.lock_agents().keys().cloned().collect();
                agents.sort_by(|a, b| a.as_str().cmp(b.as_str()));
                Ok(agents)
            }
            (_, _) => layout::agents_with_rows(&self.inner.instance).await,
        }
    }

    /// The path of the database that holds `agent`'s rows (`None` in memory): `instance.db` in
    /// [`Layout::Organization`]; in [`Layout::PerAgent`] the agent's own file, which exists once a
    /// store call has named the agent.
    pub fn agent_db_path(&self, agent: &AgentId) -> Option<PathBuf> {
        self.inner.dir.as_deref().map(|d| match self.inner.layout {
            Layout::Organization => db::instance_path(d),
            Layout::PerAgent => db::agent_path(d, agent),
        })
    }

    /// Test support, not a stable API: caps the database of `agent` (the instance database for
    /// `None`) at its current number of pages plus `headroom` with `PRAGMA max_page_count` on its
    /// writer connection, so that a write needing more gets SQLite's "database or disk is full",
    /// as a full disk would give; `None` lifts the cap.
    ///
    /// # Errors
    /// As any write.
    #[doc(hidden)]
    pub async fn cap_pages_for_testing(
        &self,
        agent: Option<&AgentId>,
        headroom: Option<u32>,
    ) -> Result<(), StoreError> {
        let db = match agent {
            Some(agent) => self.agent(agent).await?.db,
            None => self.inner.instance.clone(),
        };
        let location = db.location.clone();
        db.writes
            .run(move |conn| {
                let fail = |e| error::db_error(&location, "capping the page count", e);
                let pages: i64 = conn
                    .query_row("PRAGMA page_count", [], |r| r.get(0))
                    .map_err(fail)?;
                let cap = headroom.map_or(4_294_967_294, |h| pages + i64::from(h));
                conn.query_row(&format!("PRAGMA max_page_count = {cap}"), [], |r| {
                    r.get::<_, i64>(0)
                })
                .map_err(fail)?;
                Ok(())
            })
            .await
    }

    /// Group-commit counters of the instance database's writer: transactions committed and the
    /// write operations they carried. For tests and diagnostics.
    pub fn instance_write_stats(&self) -> WriteStats {
        self.inner.instance.writes.stats()
    }

    /// Group-commit counters of the writer of the database holding `agent`'s rows: the instance
    /// database's in [`Layout::Organization`] (shared by every agent); in [`Layout::PerAgent`] the
    /// agent's own (`None` until a store call has opened it). With concurrent writers, `commits`
    /// stays below `operations`.
    pub fn agent_write_stats(&self, agent: &AgentId) -> Option<WriteStats> {
        if self.inner.layout == Layout::Organization {
            return Some(self.inner.instance.writes.stats());
        }
        let cell = self.lock_agents().get(agent).cloned()?;
        cell.get().map(|db| db.writes.stats())
    }

    /// Closes every database, waiting for operations in progress, then releases the data
    /// directory's lock so that it can be opened again. Calls made afterwards fail with
    /// [`StoreError::Backend`].
    pub async fn close(&self) {
        self.inner.closed.store(true, Ordering::SeqCst);
        if let Some(lock) = self
            .inner
            .lock
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            lock.begin_release();
        }
        let cells: Vec<Arc<OnceCell<Db>>> = self.lock_agents().values().cloned().collect();
        for cell in cells {
            if let Some(db) = cell.get() {
                db.close().await;
            }
        }
        self.inner.instance.close().await;
        let lock = self
            .inner
            .lock
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        drop(lock);
    }

    fn lock_agents(&self) -> std::sync::MutexGuard<'_, HashMap<AgentId, Arc<OnceCell<Db>>>> {
        // The map only holds cells; a panic elsewhere cannot leave it half-updated.
        self.inner.agents.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The instance database.
    pub(crate) fn instance(&self) -> &Db {
        &self.inner.instance
    }

    /// The database holding `agent`'s rows and the value of their `agent` column: the instance
    /// database and the agent's id in [`Layout::Organization`]; in [`Layout::PerAgent`] the
    /// agent's own database (opened, created and migrated on first use; a failed open is retried
    /// by the next call) and `''`.
    pub(crate) async fn agent(&self, agent: &AgentId) -> Result<AgentDb, StoreError> {
        if self.inner.layout == Layout::Organization {
            return Ok(AgentDb {
                db: self.inner.instance.clone(),
                key: Arc::from(agent.as_str()),
            });
        }
        let cell = {
            let mut agents = self.lock_agents();
            match agents.get(agent) {
                Some(cell) => cell.clone(),
                None => agents.entry(agent.clone()).or_default().clone(),
            }
        };
        if let Some(db) = cell.get() {
            return Ok(AgentDb::own(db.clone()));
        }
        if self.inner.closed.load(Ordering::SeqCst) {
            return Err(StoreError::Backend {
                backend: error::BACKEND,
                message: format!(
                    "the stores of {} are closed",
                    self.inner
                        .dir
                        .as_deref()
                        .map_or_else(|| ":memory:".to_string(), |d| d.display().to_string())
                ),
                source: None,
            });
        }
        let path = self.agent_db_path(agent);
        let db = cell
            .get_or_try_init(|| Db::open(path.as_deref(), DbKind::Agent, &self.inner.options))
            .await?;
        Ok(AgentDb::own(db.clone()))
    }
}

/// The database that holds an agent's rows, and the value of their `agent` column there.
#[derive(Debug, Clone)]
pub(crate) struct AgentDb {
    pub(crate) db: Db,
    /// The agent's id in the organization's database; `''` in the agent's own database.
    pub(crate) key: Arc<str>,
}

impl AgentDb {
    /// An agent's own database (the per-agent layout).
    fn own(db: Db) -> Self {
        Self {
            db,
            key: Arc::from(""),
        }
    }
}

impl std::ops::Deref for AgentDb {
    type Target = Db;

    fn deref(&self) -> &Db {
        &self.db
    }
}

/// How long an opener waits for this process's release of the same directory (a handle dropped or
/// closed a moment ago, its connections still closing) before it gives up.
const RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Takes `dir`'s lock; when this process is still releasing it (the last handle was dropped or
/// closed a moment ago), waits for the release first.
async fn acquire_lock(dir: &Path) -> Result<DirLock, StoreError> {
    loop {
        match DirLock::acquire(dir, error::BACKEND) {
            Ok(lock) => return Ok(lock),
            Err(e) => {
                let Some(release) = dir_lock::release_in_progress(dir) else {
                    return Err(e);
                };
                if tokio::time::timeout(RELEASE_WAIT, release.wait())
                    .await
                    .is_err()
                {
                    return Err(e);
                }
            }
        }
    }
}

impl Drop for Inner {
    /// The last handle is gone: the databases close (their connections finish on their own
    /// threads) and only then is the directory's lock released, so that an opener never meets
    /// files still being closed. An opener in this process waits for that release.
    fn drop(&mut self) {
        let Some(lock) = self
            .lock
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return;
        };
        lock.begin_release();
        let mut dbs = vec![self.instance.clone()];
        dbs.extend(
            self.agents
                .get_mut()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .filter_map(|cell| cell.get().cloned()),
        );
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                drop(runtime.spawn(async move {
                    for db in dbs {
                        db.close().await;
                    }
                    drop(lock);
                }));
            }
            // No runtime to close them on: the connections close as they are dropped.
            Err(_) => {
                drop(dbs);
                drop(lock);
            }
        }
    }
}
