//! The reader connections of one database file.
//!
//! A small pool of its own rather than sqlx's: sqlx's pool tests every connection given back to it
//! with a ping, a command to the connection's thread and back, in a task spawned for it, after
//! every read. A read here is one statement on a connection that never opens a transaction, whose
//! thread runs commands in order (a statement dropped half-way is reset before the next one
//! runs), so a connection given back is ready for the next read as it is.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool};
use sqlx::{ConnectOptions, Connection, Sqlite, SqliteConnection};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Where a database's reads get their connection.
#[derive(Debug, Clone)]
pub(crate) enum Readers {
    /// A pool shared with the writer (an in-memory database: one connection for everything).
    Shared(SqlitePool),
    /// Connections of their own (a file database).
    Own(Arc<Own>),
}

/// The reader connections of a file database.
#[derive(Debug)]
pub(crate) struct Own {
    options: SqliteConnectOptions,
    /// At most this many connections exist at once (one permit each).
    permits: Arc<Semaphore>,
    /// How long an idle connection is kept (`None`: for ever).
    idle_timeout: Option<Duration>,
    /// Idle connections, the most recently used last, with when each was given back.
    idle: Mutex<Vec<(SqliteConnection, Instant)>>,
}

/// A connection taken for one read; given back when dropped.
#[derive(Debug)]
pub(crate) enum Reader {
    /// From the shared pool.
    Shared(PoolConnection<Sqlite>),
    /// One of a file database's own readers.
    Own {
        /// Always `Some` until dropped.
        conn: Option<SqliteConnection>,
        _permit: OwnedSemaphorePermit,
        readers: Arc<Own>,
    },
}

impl Readers {
    /// At most `max` connections to the file of `options`, each kept idle for `idle_timeout`.
    pub(crate) fn own(
        options: SqliteConnectOptions,
        max: u32,
        idle_timeout: Option<Duration>,
    ) -> Self {
        let max = usize::try_from(max.max(1)).unwrap_or(1);
        Self::Own(Arc::new(Own {
            options,
            permits: Arc::new(Semaphore::new(max)),
            idle_timeout,
            idle: Mutex::new(Vec::new()),
        }))
    }

    /// A connection for one read: an idle one, else a new one while fewer than the most exist,
    /// else the first one given back.
    pub(crate) async fn acquire(&self) -> Result<Reader, sqlx::Error> {
        match self {
            Self::Shared(pool) => Ok(Reader::Shared(pool.acquire().await?)),
            Self::Own(own) => {
                let permit = own
                    .permits
                    .clone()
                    .acquire_owned()
                    .await
                    .map_err(|_| sqlx::Error::PoolClosed)?;
                let idle = own.take_idle();
                let conn = match idle {
                    Some(conn) => conn,
                    None => own.options.connect().await?,
                };
                Ok(Reader::Own {
                    conn: Some(conn),
                    _permit: permit,
                    readers: own.clone(),
                })
            }
        }
    }

    /// Refuses later reads and closes the idle connections (those in use close when given back).
    pub(crate) async fn close(&self) {
        match self {
            Self::Shared(pool) => pool.close().await,
            Self::Own(own) => {
                own.permits.close();
                let idle: Vec<_> = own.lock().drain(..).collect();
                for (conn, _) in idle {
                    // A connection that fails to close cleanly is dropped all the same.
                    let _ = conn.close().await;
                }
            }
        }
    }
}

impl Own {
    fn lock(&self) -> MutexGuard<'_, Vec<(SqliteConnection, Instant)>> {
        // The list is consistent between statements, whatever panicked while holding it.
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The most recently used idle connection, dropping those idle for longer than the timeout.
    fn take_idle(&self) -> Option<SqliteConnection> {
        let mut idle = self.lock();
        if let Some(timeout) = self.idle_timeout {
            let now = Instant::now();
            idle.retain(|(_, since)| now.duration_since(*since) < timeout);
        }
        idle.pop().map(|(conn, _)| conn)
    }
}

impl Deref for Reader {
    type Target = SqliteConnection;

    fn deref(&self) -> &SqliteConnection {
        match self {
            Self::Shared(conn) => conn,
            Self::Own { conn, .. } => conn
                .as_ref()
                .unwrap_or_else(|| unreachable!("a reader's connection is taken only on drop")),
        }
    }
}

impl DerefMut for Reader {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        match self {
            Self::Shared(conn) => conn,
            Self::Own { conn, .. } => conn
                .as_mut()
                .unwrap_or_else(|| unreachable!("a reader's connection is taken only on drop")),
        }
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        if let Self::Own { conn, readers, .. } = self
            && let Some(conn) = conn.take()
            && !readers.permits.is_closed()
        {
            readers.lock().push((conn, Instant::now()));
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use crate::db::{Db, DbKind};
    use crate::options::SqliteOptions;

    use super::Readers;

    async fn count(db: &Db) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM applied_keys")
            .fetch_one(&mut *db.read("counting").await.unwrap())
            .await
            .unwrap()
    }

    async fn insert(db: &Db, key: &str) {
        let key = key.to_string();
        db.writes
            .run(move |conn| {
                Box::pin(async move {
                    sqlx::query("INSERT INTO applied_keys (key, applied_at) VALUES (?, 0)")
                        .bind(key)
                        .execute(&mut *conn)
                        .await
                        .map_err(|e| crate::error::db_error("test", "inserting", e))?;
                    Ok(())
                })
            })
            .await
            .unwrap();
    }

    fn idle(db: &Db) -> usize {
        match &db.reader {
            Readers::Own(own) => own.lock().len(),
            Readers::Shared(_) => panic!("a file database has readers of its own"),
        }
    }

    /// A reader given back is used again, and a read transaction dropped without its end does not
    /// leave the next read on that connection in the old snapshot.
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
        {
            let mut reader = db.read("snapshot").await.unwrap();
            let mut tx = sqlx::Connection::begin(&mut *reader).await.unwrap();
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM applied_keys")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            assert_eq!(n, 1);
            // Dropped here, open: the snapshot must not outlive it.
        }
        insert(&db, "two").await;
        assert_eq!(idle(&db), 1);
        assert_eq!(count(&db).await, 2, "the reader kept an old snapshot");
        db.close().await;
        assert!(db.read("after close").await.is_err());
    }
}
