//! PostgreSQL backends of every spacebot store, through `sqlx`.
//!
//! [`connect`] to a database and get the [`Stores`] bundle the runtime needs. Unlike the SQLite
//! and redb backends (one file per agent, one process per data directory), every store lives in
//! **one schema of one database**: the instance data (links, conversations, behaviours' records)
//! and every agent's board, outbox, channel history, pending deliveries and applied keys, in
//! tables keyed by agent id. Several processes may connect to the same schema at once and share the agents' boards and
//! queues; every guarantee below holds between processes, not only between tasks of one.
//!
//! ```no_run
//! # async fn run() -> Result<(), spacebot_core::StoreError> {
//! let stores = spacebot_postgres::connect("postgres://spacebot@localhost/org").await?;
//! let links = stores.links.list().await?;
//! # Ok(()) }
//! ```
//!
//! Connecting creates the schema if needed ([`PgOptions::schema`]) and migrates it: the
//! migrations (`spacebot-postgres/migrations`) are embedded in the binary and applied in one
//! transaction under a lock per schema, so processes starting together migrate it once. A schema
//! that holds another application's tables, or one migrated by a newer build, is refused with
//! [`StoreError::Corrupt`] and left untouched.
//!
//! # One organization across several processes
//!
//! [`PgStores::placement`] is the [`Placement`](spacebot_core::placement::Placement) of the
//! schema ([`PgPlacement`]: the table `agent_placement`, wake-up hints with `LISTEN`/`NOTIFY`):
//! give it to `OrganizationBuilder::placement` in every process, each with its own `ProcessId`,
//! and the agents spread over the processes and move when one dies. See `docs/scale-out.md`.
//! [`PgStores::cut_off`] simulates a partition in tests.
//!
//! # Guarantees
//! - A claim locks the ready task it takes with `SELECT ... FOR UPDATE SKIP LOCKED` (highest
//!   priority, then lowest number) and moves it to in progress in the same transaction: two
//!   claims, from any processes, never get the same task, and a claim never waits for another.
//! - A transition reads the task `FOR UPDATE`, applies the lifecycle rules (only the lease holder
//!   completes, fails or renews), and writes the task and its completion notice to the outbox in
//!   one transaction.
//! - Task numbers and channel sequence numbers come from a per-agent counter row bumped in the
//!   writing transaction: no two share a number, and there are no gaps.
//! - Idempotency keys of task creates, applied keys and pending delivery ids are unique
//!   constraints; a create with a used key returns the first task.
//! - [`DeliveryStore::commit`](spacebot_core::DeliveryStore::commit) is one transaction.
//! - A record write is one row (its version, history and effect key); the primary key and the
//!   unique index of effect keys let exactly one of racing writers, from any processes, insert.
//! - A transaction PostgreSQL aborts for a concurrent one (a deadlock, a serialization failure)
//!   is run again; nothing else is retried (an ambiguous failure is returned to the caller).
//! - What is acknowledged is committed; how durable a commit is depends on the server
//!   (`synchronous_commit`, `fsync`, replication), not on this crate.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]

mod channels;
mod codec;
mod conversations;
mod db;
mod deliveries;
mod error;
mod links;
mod options;
mod placement;
mod records;
mod tasks;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use spacebot_core::{StoreError, Stores};

pub use crate::channels::PgChannelStore;
pub use crate::conversations::PgConversationStore;
use crate::db::Db;
pub use crate::deliveries::PgDeliveryStore;
pub use crate::links::PgLinkStore;
pub use crate::options::PgOptions;
pub use crate::placement::PgPlacement;
pub use crate::records::PgRecordStore;
pub use crate::tasks::PgTaskStore;

/// The statements of a claim, of the search for expired leases and of the outbox, for the tests
/// that check which index serves them. Not a stable API.
#[doc(hidden)]
pub mod sql {
    pub use crate::tasks::{CLAIM_SQL, EXPIRED_SQL, OUTBOX_PENDING_SQL};
}

/// Connects to the database at `url` with the default [`PgOptions`] (the connection's default
/// schema, normally `public`), migrates it, and returns the [`Stores`] bundle.
///
/// # Errors
/// [`StoreError::Invalid`] for a malformed URL; [`StoreError::Corrupt`] if the schema holds
/// another application's tables or was migrated by a newer build; [`StoreError::Backend`] if the
/// server cannot be reached or refuses the connection. Each names the database and schema.
pub async fn connect(url: &str) -> Result<Stores, StoreError> {
    Ok(PgStores::connect(url).await?.stores())
}

/// Every spacebot store on one PostgreSQL schema. Cheap to clone (clones share the pool).
///
/// Each store trait is implemented by a handle sharing the pool: [`PgStores::links`],
/// [`PgStores::conversations`], [`PgStores::tasks`], [`PgStores::channels`] and
/// [`PgStores::deliveries`], [`PgStores::records`]; [`PgStores::stores`] bundles them all.
#[derive(Debug, Clone)]
pub struct PgStores {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    db: Db,
    /// Set for [`PgStores::temporary`]: the schema is dropped with the last clone.
    temporary: bool,
    /// Set by [`PgStores::close`].
    closed: AtomicBool,
    /// `true` between [`PgStores::cut_off`] and [`PgStores::reconnect`].
    cut: tokio::sync::watch::Sender<bool>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if !self.temporary {
            return;
        }
        let Some(schema) = self.db.schema.clone() else {
            return;
        };
        let base = self.db.base.clone();
        // Dropping is synchronous and may run inside (or outside) any runtime: the schema is
        // dropped from a thread of its own, with a runtime of its own, and waited for.
        let dropper = std::thread::Builder::new()
            .name("spacebot-postgres-drop".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                match runtime {
                    Ok(runtime) => runtime
                        .block_on(db::drop_schema(&base, &schema))
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                }
                .map_err(|e| (schema, e))
            });
        match dropper.map(std::thread::JoinHandle::join) {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err((schema, e)))) => {
                tracing::warn!(%schema, error = %e, "could not drop a temporary schema");
            }
            Ok(Err(_)) | Err(_) => {
                tracing::warn!("could not drop a temporary schema: its thread failed");
            }
        }
    }
}

impl PgStores {
    /// Connects to `url` with the default options. See [`connect`].
    ///
    /// # Errors
    /// As [`connect`].
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(url, PgOptions::default()).await
    }

    /// Connects to `url` with `options`: creates the schema if [`PgOptions::schema`] names one
    /// that does not exist, checks that it is empty or spacebot's, and migrates it.
    ///
    /// # Errors
    /// As [`connect`]; also [`StoreError::Invalid`] for a schema name PostgreSQL would not take
    /// as written.
    pub async fn connect_with(url: &str, options: PgOptions) -> Result<Self, StoreError> {
        let db = Db::open(url, &options).await?;
        Ok(Self::from_db(db, false))
    }

    /// Stores in a new schema of their own (`spacebot_tmp_` and 16 random hex digits), dropped
    /// when the last clone of the returned value is dropped (waiting at most a few seconds for
    /// connections still in a transaction; a schema that cannot be dropped is logged and left).
    /// For examples and tests: every call starts empty.
    ///
    /// # Errors
    /// As [`connect`].
    pub async fn temporary(url: &str) -> Result<Self, StoreError> {
        Self::temporary_with(url, PgOptions::default()).await
    }

    /// [`PgStores::temporary`] with `options` (their schema, if any, is replaced by the new one).
    ///
    /// # Errors
    /// As [`connect`].
    pub async fn temporary_with(url: &str, options: PgOptions) -> Result<Self, StoreError> {
        // Random from the OS, not from a clock: processes starting at once do not share one.
        let schema = format!("spacebot_tmp_{:016x}", uuid::Uuid::new_v4().as_u64_pair().0);
        let db = Db::open(url, &options.schema(schema)).await?;
        Ok(Self::from_db(db, true))
    }

    fn from_db(db: Db, temporary: bool) -> Self {
        Self {
            inner: Arc::new(Inner {
                db,
                temporary,
                closed: AtomicBool::new(false),
                cut: tokio::sync::watch::Sender::new(false),
            }),
        }
    }

    /// The bundle of every store, all on this pool.
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

    /// The [`LinkStore`](spacebot_core::LinkStore).
    pub fn links(&self) -> PgLinkStore {
        PgLinkStore(self.clone())
    }

    /// The [`ConversationStore`](spacebot_core::ConversationStore).
    pub fn conversations(&self) -> PgConversationStore {
        PgConversationStore(self.clone())
    }

    /// The [`TaskStore`](spacebot_core::TaskStore).
    pub fn tasks(&self) -> PgTaskStore {
        PgTaskStore(self.clone())
    }

    /// The [`ChannelStore`](spacebot_core::ChannelStore).
    pub fn channels(&self) -> PgChannelStore {
        PgChannelStore(self.clone())
    }

    /// The [`DeliveryStore`](spacebot_core::DeliveryStore).
    pub fn deliveries(&self) -> PgDeliveryStore {
        PgDeliveryStore(self.clone())
    }

    /// The [`RecordStore`](spacebot_core::RecordStore).
    pub fn records(&self) -> PgRecordStore {
        PgRecordStore(self.clone())
    }

    /// The schema named by the options (or made by [`PgStores::temporary`]); `None` when the
    /// stores use the connection's default schema.
    pub fn schema(&self) -> Option<&str> {
        self.inner.db.schema.as_deref()
    }

    /// The database and schema, as error messages name them (`postgres://user@host:port/db
    /// (schema s)`; never the password).
    pub fn location(&self) -> &str {
        &self.inner.db.location
    }

    /// The connection pool, for queries of your own (reports, inspection). Its connections'
    /// `search_path` is the stores' schema. Writing to the stores' tables directly bypasses their
    /// rules.
    pub fn pool(&self) -> &sqlx::PgPool {
        &self.inner.db.pool
    }

    /// Closes the pool, waiting for connections in use to be returned. Calls made afterwards
    /// fail with [`StoreError::Backend`]. Other processes connected to the schema are not
    /// affected.
    pub async fn close(&self) {
        self.inner.closed.store(true, Ordering::SeqCst);
        self.inner.db.pool.close().await;
    }

    /// Simulates a network partition between this process and the database, for tests: from
    /// now on every call of these stores and of their [`PgPlacement`] (and of every clone of
    /// them) fails with [`StoreError::Backend`] before reaching the server, and every wake-up
    /// stream of the placement ends. Calls already sent complete (a real partition could cut
    /// them too); other processes, with stores of their own, are not affected. Undone by
    /// [`PgStores::reconnect`].
    pub fn cut_off(&self) {
        self.inner.cut.send_replace(true);
    }

    /// Undoes [`PgStores::cut_off`]: calls reach the server again.
    pub fn reconnect(&self) {
        self.inner.cut.send_replace(false);
    }

    /// Whether the stores are cut off ([`PgStores::cut_off`]).
    pub fn is_cut_off(&self) -> bool {
        *self.inner.cut.borrow()
    }

    /// A receiver of the cut-off flag, for the wake-up streams.
    pub(crate) fn cut_watch(&self) -> tokio::sync::watch::Receiver<bool> {
        self.inner.cut.subscribe()
    }

    /// The database, or an error once the stores are closed or cut off.
    pub(crate) fn db(&self) -> Result<&Db, StoreError> {
        if self.inner.closed.load(Ordering::SeqCst) {
            return Err(error::closed(&self.inner.db.location));
        }
        if self.is_cut_off() {
            return Err(error::cut_off(&self.inner.db.location));
        }
        Ok(&self.inner.db)
    }
}
