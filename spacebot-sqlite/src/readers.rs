//! The reader connections of one database file.
//!
//! A read is one synchronous closure run on a connection from a blocking thread of the runtime
//! (`spawn_blocking`): one hand-off there and one answer back, whatever the number of its
//! statements. A short read (a row or a few looked up by key: an applied key, a task, the outbox,
//! a record, whether a task is ready or a lease expired; or a turn's page of its channel) runs on
//! the calling thread instead when an idle connection is at hand (`run_short`). A read of several
//! statements that must see one snapshot opens a transaction in its closure; a connection given back with a transaction still open (a closure that returned early)
//! has it rolled back first, so the next read never sees an old snapshot.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rusqlite::{Connection, OpenFlags};
use spacebot_core::StoreError;
use tokio::sync::Semaphore;

use crate::error::{BACKEND, Location, db_error};
use crate::writer::{Shared, lock};

/// Where a database's reads get their connection.
#[derive(Debug, Clone)]
pub(crate) enum Readers {
    /// The writer's connection (an in-memory database: one connection for everything), and
    /// whether the database was closed.
    Shared(Shared, Arc<AtomicBool>),
    /// Connections of their own (a file database).
    Own(Arc<Own>),
}

/// How a reader connection to a file is opened.
#[derive(Debug, Clone)]
pub(crate) struct ReaderOptions {
    pub(crate) path: PathBuf,
    pub(crate) busy_timeout: Duration,
}

/// The reader connections of a file database.
#[derive(Debug)]
pub(crate) struct Own {
    options: ReaderOptions,
    /// At most this many connections exist at once (one permit each).
    permits: Arc<Semaphore>,
    /// How long an idle connection is kept (`None`: for ever).
    idle_timeout: Option<Duration>,
    /// Idle connections, the most recently used last, with when each was given back.
    idle: Mutex<Vec<(Connection, Instant)>>,
}

impl Readers {
    /// At most `max` connections to the file of `options`, each kept idle for `idle_timeout`.
    pub(crate) fn own(options: ReaderOptions, max: u32, idle_timeout: Option<Duration>) -> Self {
        let max = usize::try_from(max.max(1)).unwrap_or(1);
        Self::Own(Arc::new(Own {
            options,
            permits: Arc::new(Semaphore::new(max)),
            idle_timeout,
            idle: Mutex::new(Vec::new()),
        }))
    }

    /// Runs `read` on a connection (an idle one, else a new one while fewer than the most exist,
    /// else the first one given back) on a blocking thread. `doing` names the read in errors about
    /// the connection.
    pub(crate) async fn run<T, F>(
        &self,
        location: &Location,
        doing: &'static str,
        read: F,
    ) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let runtime = tokio::runtime::Handle::try_current().map_err(|e| {
            StoreError::backend(
                BACKEND,
                format!("{doing} in {location}: no Tokio runtime is running"),
                e,
            )
        })?;
        let closed = || StoreError::Backend {
            backend: BACKEND,
            message: format!("{doing} in {location}: the database is closed"),
            source: None,
        };
        let location = location.clone();
        let task = match self {
            Self::Shared(conn, closing) => {
                if closing.load(Ordering::SeqCst) {
                    return Err(closed());
                }
                let conn = conn.clone();
                runtime.spawn_blocking(move || {
                    let conn = lock(&conn);
                    let result = read(&conn);
                    end_read(&conn);
                    result
                })
            }
            Self::Own(own) => {
                let permit = own
                    .permits
                    .clone()
                    .acquire_owned()
                    .await
                    .map_err(|_| closed())?;
                let own = own.clone();
                runtime.spawn_blocking(move || {
                    let conn = match own.take_idle() {
                        Some(conn) => conn,
                        None => own
                            .options
                            .connect()
                            .map_err(|e| db_error(&location, doing, e))?,
                    };
                    let result = read(&conn);
                    own.give_back(conn);
                    drop(permit);
                    result
                })
            }
        };
        task.await.map_err(|e| StoreError::Backend {
            backend: BACKEND,
            message: format!("{doing}: the read did not finish: {e}"),
            source: None,
        })?
    }

    /// Runs `read`, a short read (an indexed lookup of a row or a few), on the calling thread
    /// when an idle connection and a permit are at hand at once: tens of microseconds of work,
    /// against a hand-off to a blocking thread and back that costs more than the read. Otherwise
    /// (no idle connection, every permit taken, an in-memory database whose one connection the
    /// writer holds) as [`run`](Self::run).
    pub(crate) async fn run_short<T, F>(
        &self,
        location: &Location,
        doing: &'static str,
        read: F,
    ) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let at_hand = match self {
            Self::Own(own) => own
                .permits
                .clone()
                .try_acquire_owned()
                .ok()
                .and_then(|permit| own.take_idle().map(|conn| (own, conn, permit))),
            Self::Shared(..) => None,
        };
        let Some((own, conn, permit)) = at_hand else {
            return self.run(location, doing, read).await;
        };
        // A read that panics fails as one on a blocking thread does, not the caller's task; its
        // connection is closed, not given back.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| read(&conn)))
            .map_err(|_| StoreError::Backend {
                backend: BACKEND,
                message: format!("{doing} in {location}: the read did not finish: it panicked"),
                source: None,
            });
        if result.is_ok() {
            own.give_back(conn);
        }
        drop(permit);
        result?
    }

    /// Refuses later reads and closes the idle connections (those in use close when given back).
    pub(crate) async fn close(&self) {
        if let Self::Shared(_, closed) = self {
            closed.store(true, Ordering::SeqCst);
        }
        if let Self::Own(own) = self {
            own.permits.close();
            let idle: Vec<_> = own.lock().drain(..).collect();
            if idle.is_empty() {
                return;
            }
            // Closing the last connection to a file checkpoints its log: not on the runtime.
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    let _ = runtime.spawn_blocking(move || drop(idle)).await;
                }
                Err(_) => drop(idle),
            }
        }
    }
}

/// Ends a transaction a read left open.
fn end_read(conn: &Connection) {
    if !conn.is_autocommit()
        && let Err(e) = conn.execute_batch("ROLLBACK")
    {
        tracing::trace!(error = %e, "ending a read transaction");
    }
}

impl ReaderOptions {
    /// A new connection to the file (which the writer created): never creates it.
    pub(crate) fn connect(&self) -> rusqlite::Result<Connection> {
        let conn = Connection::open_with_flags(
            &self.path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.busy_timeout(self.busy_timeout)?;
        conn.set_prepared_statement_cache_capacity(crate::db::STATEMENT_CACHE);
        conn.execute_batch("PRAGMA foreign_keys = ON")?;
        Ok(conn)
    }
}

impl Own {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Vec<(Connection, Instant)>> {
        // The list is consistent between statements, whatever panicked while holding it.
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Ends what a read left open on `conn` and keeps it idle for the next read (closes it if
    /// the readers were closed meanwhile).
    fn give_back(&self, conn: Connection) {
        end_read(&conn);
        if !self.permits.is_closed() {
            self.lock().push((conn, Instant::now()));
        }
    }

    /// The most recently used idle connection, closing those idle for longer than the timeout.
    fn take_idle(&self) -> Option<Connection> {
        let mut expired = Vec::new();
        let conn = {
            let mut idle = self.lock();
            if let Some(timeout) = self.idle_timeout {
                let now = Instant::now();
                let (keep, old): (Vec<_>, Vec<_>) = idle
                    .drain(..)
                    .partition(|(_, since)| now.duration_since(*since) < timeout);
                *idle = keep;
                expired = old;
            }
            idle.pop().map(|(conn, _)| conn)
        };
        // Closed outside the lock.
        drop(expired);
        conn
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use crate::db::{Db, DbKind};
    use crate::error::db_error;
    use crate::options::SqliteOptions;

    use super::Readers;

    async fn count(db: &Db) -> i64 {
        db.read("counting", |conn| {
            conn.query_row("SELECT count(*) FROM applied_keys", [], |r| r.get(0))
                .map_err(|e| db_error("test", "counting", e))
        })
        .await
        .unwrap()
    }

    async fn insert(db: &Db, key: &str) {
        let key = key.to_string();
        db.writes
            .run(move |conn| {
                conn.execute(
                    "INSERT INTO applied_keys (agent, key, applied_at) VALUES ('', ?, 0)",
                    [key],
                )
                .map_err(|e| db_error("test", "inserting", e))?;
                Ok(())
            })
            .await
            .unwrap();
    }

    fn idle(db: &Db) -> usize {
        match &db.reader {
            Readers::Own(own) => own.lock().len(),
            Readers::Shared(..) => panic!("a file database has readers of its own"),
        }
    }

    /// A reader given back is used again, and a read transaction left open does not leave the
    /// next read on that connection in the old snapshot.
    #[tokio::test]
    async fn readers_are_reused_and_see_later_commits() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.db");
        let db = Db::open(Some(&path), DbKind::Agent, &SqliteOptions::default())
            .await
            .unwrap();
        insert(&db, "one").await;
        for _ in 0..10 {
            assert_eq!(count(&db).await, 1);
        }
        assert_eq!(idle(&db), 1, "ten reads in a row share one connection");
        let n: i64 = db
            .read("snapshot", |conn| {
                conn.execute_batch("BEGIN")
                    .map_err(|e| db_error("test", "begin", e))?;
                // Left open: the snapshot must not outlive the read.
                conn.query_row("SELECT count(*) FROM applied_keys", [], |r| r.get(0))
                    .map_err(|e| db_error("test", "counting", e))
            })
            .await
            .unwrap();
        assert_eq!(n, 1);
        insert(&db, "two").await;
        assert_eq!(idle(&db), 1);
        assert_eq!(count(&db).await, 2, "the reader kept an old snapshot");
        db.close().await;
        assert!(db.read("after close", |_| Ok(())).await.is_err());
    }

    async fn short(db: &Db) -> Result<(i64, std::thread::ThreadId), spacebot_core::StoreError> {
        db.read_short("counting", |conn| {
            let n: i64 = conn
                .query_row("SELECT count(*) FROM applied_keys", [], |r| r.get(0))
                .map_err(|e| db_error("test", "counting", e))?;
            Ok((n, std::thread::current().id()))
        })
        .await
    }

    /// A short read runs on the calling thread when an idle connection is at hand, else on a
    /// blocking thread; either way it sees the latest commit, and the connection is given back.
    #[tokio::test]
    async fn a_short_read_runs_here_when_a_connection_is_idle() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.db");
        let db = Db::open(Some(&path), DbKind::Agent, &SqliteOptions::default())
            .await
            .unwrap();
        let here = std::thread::current().id();
        insert(&db, "one").await;
        // No connection yet: opened on a blocking thread.
        let (n, ran_on) = short(&db).await.unwrap();
        assert_eq!(n, 1);
        assert_ne!(ran_on, here, "the first read found no idle connection");
        assert_eq!(idle(&db), 1);
        insert(&db, "two").await;
        let (n, ran_on) = short(&db).await.unwrap();
        assert_eq!(
            (n, ran_on),
            (2, here),
            "an idle connection: read on this thread"
        );
        assert_eq!(idle(&db), 1, "given back");
        // A read that panics on this thread is an error, as on a blocking thread; its
        // connection is closed, and the next read opens another.
        let panicked = db
            .read_short::<(), _>("panicking", |_| panic!("on purpose"))
            .await;
        assert!(panicked.is_err());
        assert_eq!(idle(&db), 0, "a connection a read panicked on is not kept");
        assert_eq!(short(&db).await.unwrap().0, 2);
        db.close().await;
        assert!(short(&db).await.is_err(), "closed");
    }
}
