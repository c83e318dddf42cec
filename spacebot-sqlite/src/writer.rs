//! Group commit: one writer task per database runs the queued write operations of all callers in
//! one transaction and answers each caller only once that transaction is committed.
//!
//! An operation is a closure over the open transaction's connection. The task takes the first
//! queued operation and every other one already queued (up to `max_batch`), opens one
//! `BEGIN IMMEDIATE` transaction, runs each operation inside its own `SAVEPOINT` (an operation that
//! fails is rolled back to its savepoint alone, so the others are kept), commits once, and only then
//! sends every caller its result. A commit that fails fails every operation of the batch, and
//! nothing of it is kept. A batch of one operation runs without a savepoint.
//!
//! The task borrows the database's single writer connection from its pool, so a write that does
//! not go through this task (a migration) still waits for the connection and never interleaves
//! with a batch. Where nothing else uses that pool (a file database, whose reads have their own
//! pool), the task keeps the connection between batches: returning it to the pool costs a round
//! trip to the connection's thread (the pool tests every connection given back) and a spawned
//! task, for every batch. After a batch that failed, the connection goes back to the pool, which
//! replaces it if it is broken.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use spacebot_core::StoreError;
use sqlx::pool::PoolConnection;
use sqlx::sqlite::SqlitePool;
use sqlx::{Sqlite, SqliteConnection};
use tokio::sync::{mpsc, oneshot};

use crate::error::{BACKEND, Location, db_error};

/// A boxed, sendable future borrowing the connection for `'a`.
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Answers an operation's caller once the batch's fate is known: `Ok` when it committed (or when
/// the operation failed and was rolled back alone), else the batch's error.
type Answer = Box<dyn FnOnce(Result<(), &StoreError>) + Send>;

/// One queued operation with its caller's reply channel.
trait Operation: Send {
    /// Runs the operation on the batch's connection; says whether it succeeded (its savepoint is
    /// kept) and how to answer its caller.
    fn run<'c>(self: Box<Self>, conn: &'c mut SqliteConnection) -> BoxFuture<'c, (bool, Answer)>;
    /// Answers the caller with `e` without running the operation.
    fn refuse(self: Box<Self>, e: &StoreError);
}

type Job = Box<dyn Operation>;

struct Op<T, F> {
    op: F,
    reply: oneshot::Sender<Result<T, StoreError>>,
}

impl<T, F> Operation for Op<T, F>
where
    T: Send + 'static,
    F: for<'c> FnOnce(&'c mut SqliteConnection) -> BoxFuture<'c, Result<T, StoreError>>
        + Send
        + 'static,
{
    fn run<'c>(self: Box<Self>, conn: &'c mut SqliteConnection) -> BoxFuture<'c, (bool, Answer)> {
        let Self { op, reply } = *self;
        Box::pin(async move {
            let result = op(conn).await;
            let ok = result.is_ok();
            let answer: Answer = Box::new(move |batch: Result<(), &StoreError>| {
                let result = match (result, batch) {
                    (Err(e), _) => Err(e),
                    (Ok(value), Ok(())) => Ok(value),
                    (Ok(_), Err(e)) => Err(replicate(e)),
                };
                // A caller that stopped waiting does not need its answer.
                let _ = reply.send(result);
            });
            (ok, answer)
        })
    }

    fn refuse(self: Box<Self>, e: &StoreError) {
        let _ = self.reply.send(Err(replicate(e)));
    }
}

enum Message {
    Run(Job),
    /// Finish what is queued before this, then stop and acknowledge.
    Close(oneshot::Sender<()>),
}

/// Counters of one database's writer, for tests and diagnostics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteStats {
    /// Transactions committed by the writer task (each one `fsync` with `synchronous = FULL`).
    pub commits: u64,
    /// Operations those transactions carried (refused ones included).
    pub operations: u64,
}

#[derive(Debug, Default)]
struct Counters {
    commits: AtomicU64,
    operations: AtomicU64,
}

/// The sending side of a database's writer task. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct Writer {
    queue: mpsc::UnboundedSender<Message>,
    counters: Arc<Counters>,
    location: Location,
}

impl Writer {
    /// Starts the writer task of the database at `location` on the current Tokio runtime.
    /// `keep_connection`: the task keeps the pool's connection between batches (only where
    /// nothing else takes connections from `pool`).
    pub(crate) fn start(
        pool: SqlitePool,
        location: Location,
        max_batch: usize,
        keep_connection: bool,
    ) -> Result<Self, StoreError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|e| {
            StoreError::backend(
                BACKEND,
                format!("starting the writer of {location}: no Tokio runtime is running"),
                e,
            )
        })?;
        let (queue, receiver) = mpsc::unbounded_channel();
        let counters = Arc::new(Counters::default());
        let task = Task {
            pool,
            location: location.clone(),
            max_batch: max_batch.max(1),
            receiver,
            counters: counters.clone(),
            pending: VecDeque::new(),
            keep_connection,
            kept: None,
        };
        runtime.spawn(task.serve());
        Ok(Self {
            queue,
            counters,
            location,
        })
    }

    /// Runs `op` in the next batch and returns its result once the batch is committed.
    ///
    /// Once a read or a write has met damage in the database ([`StoreError::Corrupt`]), every
    /// later call is refused with that same error and nothing more is written to the file.
    ///
    /// `op` must read and check before it writes where it can; if it fails, whatever it wrote is
    /// rolled back and the other operations of its batch are kept.
    pub(crate) async fn run<T, F>(&self, op: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(&'c mut SqliteConnection) -> BoxFuture<'c, Result<T, StoreError>>
            + Send
            + 'static,
    {
        if let Some(damage) = self.location.damage() {
            return Err(damage);
        }
        let (reply, answered) = oneshot::channel::<Result<T, StoreError>>();
        let job: Job = Box::new(Op { op, reply });
        self.queue
            .send(Message::Run(job))
            .map_err(|_| self.stopped())?;
        answered.await.map_err(|_| self.stopped())?
    }

    /// Finishes the operations queued so far and stops the task; later calls fail.
    pub(crate) async fn close(&self) {
        let (done, closed) = oneshot::channel();
        if self.queue.send(Message::Close(done)).is_ok() {
            // The task dropping the acknowledgement means it stopped anyway.
            let _ = closed.await;
        }
    }

    /// The counters so far.
    pub(crate) fn stats(&self) -> WriteStats {
        WriteStats {
            commits: self.counters.commits.load(Ordering::Relaxed),
            operations: self.counters.operations.load(Ordering::Relaxed),
        }
    }

    fn stopped(&self) -> StoreError {
        StoreError::Backend {
            backend: BACKEND,
            message: format!(
                "the writer of {} has stopped (the stores were closed, or their runtime shut down)",
                self.location
            ),
            source: None,
        }
    }
}

/// A copy of a batch's error for each of its operations (`StoreError` is not `Clone`).
fn replicate(e: &StoreError) -> StoreError {
    match e {
        StoreError::Corrupt { location, reason } => StoreError::Corrupt {
            location: location.clone(),
            reason: reason.clone(),
        },
        other => StoreError::Backend {
            backend: BACKEND,
            message: format!("the transaction this write was part of failed: {other}"),
            source: None,
        },
    }
}

/// The writer task.
struct Task {
    pool: SqlitePool,
    location: Location,
    max_batch: usize,
    receiver: mpsc::UnboundedReceiver<Message>,
    counters: Arc<Counters>,
    /// Operations taken from the queue but not run yet (after a batch broke off).
    pending: VecDeque<Job>,
    /// Whether the connection is kept between batches (see the module's documentation).
    keep_connection: bool,
    /// The connection kept since the last batch, which committed.
    kept: Option<PoolConnection<Sqlite>>,
}

impl Task {
    async fn serve(mut self) {
        let mut closing = None;
        loop {
            if self.pending.is_empty() {
                match self.receiver.recv().await {
                    Some(Message::Run(job)) => self.pending.push_back(job),
                    Some(Message::Close(done)) => {
                        closing = Some(done);
                        break;
                    }
                    None => break,
                }
            }
            let mut batch: Vec<Job> = Vec::new();
            while batch.len() < self.max_batch {
                if let Some(job) = self.pending.pop_front() {
                    batch.push(job);
                    continue;
                }
                match self.receiver.try_recv() {
                    Ok(Message::Run(job)) => batch.push(job),
                    Ok(Message::Close(done)) => {
                        closing = Some(done);
                        break;
                    }
                    Err(_) => break,
                }
            }
            self.run_batch(batch).await;
            if closing.is_some() {
                // Operations requeued by a broken last batch still run before stopping.
                while !self.pending.is_empty() {
                    let batch: Vec<Job> = self.pending.drain(..).collect();
                    self.run_batch(batch).await;
                }
                break;
            }
        }
        // Operations sent after the close are dropped: their callers get an error.
        self.receiver.close();
        while let Ok(message) = self.receiver.try_recv() {
            if let Message::Close(done) = message {
                let _ = done.send(());
            }
        }
        if let Some(done) = closing {
            let _ = done.send(());
        }
    }

    /// Runs `batch` in one transaction and answers each operation once it is committed.
    ///
    /// The transaction is begun, committed and rolled back with plain statements on a connection
    /// taken from the pool, not with the driver's transaction object: SQLite rolls a transaction
    /// back by itself on some errors (a full disk, an I/O error, an interrupted statement), and
    /// the driver's count of open transactions would then stay at one for ever (every later
    /// `BEGIN` refused), whereas a `ROLLBACK` statement is harmless when nothing is open.
    async fn run_batch(&mut self, batch: Vec<Job>) {
        if batch.is_empty() {
            return;
        }
        // A database that has shown damage is not written to again.
        if let Some(damage) = self.location.damage() {
            return answer_all(batch, &damage);
        }
        // Waits for the writer connection (a migration or a write outside this task may hold it).
        let mut conn = match self.kept.take() {
            Some(conn) => conn,
            None => match self.pool.acquire().await {
                Ok(conn) => conn,
                Err(e) => {
                    let e = db_error(&self.location, "taking the writer connection", e);
                    return answer_all(batch, &e);
                }
            },
        };
        let committed = self.run_batch_on(&mut conn, batch).await;
        if committed && self.keep_connection {
            self.kept = Some(conn);
        }
    }

    /// [`run_batch`](Self::run_batch) on `conn`; says whether the batch committed.
    async fn run_batch_on(&mut self, conn: &mut SqliteConnection, mut batch: Vec<Job>) -> bool {
        let location = self.location.clone();
        let fail = |doing: &str, e| db_error(&location, doing, e);
        if let Err(e) = sqlx::query("BEGIN IMMEDIATE").execute(&mut *conn).await {
            // A transaction left open (a batch cancelled half-way) is ended, so the next batch can
            // begin; this one fails.
            rollback(conn).await;
            answer_all(batch, &fail("starting a transaction", e));
            return false;
        }
        let mut answers: Vec<Answer> = Vec::with_capacity(batch.len());
        if batch.len() == 1 {
            let Some(job) = batch.pop() else {
                return true;
            };
            let (ok, answer) = job.run(conn).await;
            let outcome = match self.location.damage() {
                // The operation met damage: nothing of it is kept.
                Some(damage) => {
                    rollback(conn).await;
                    Err(damage)
                }
                None if ok => commit(conn, &fail).await,
                None => {
                    // The operation failed: whatever it wrote goes; its own error is its answer.
                    rollback(conn).await;
                    Ok(())
                }
            };
            if outcome.is_ok() {
                self.count(1);
            }
            answer(outcome.as_ref().map(|_| ()));
            return outcome.is_ok();
        }
        let mut jobs = batch.into_iter();
        let mut broken = None;
        let mut unrun = None;
        for job in jobs.by_ref() {
            if let Err(e) = sqlx::query("SAVEPOINT spacebot_op")
                .execute(&mut *conn)
                .await
            {
                let e = fail("starting an operation's savepoint", e);
                if answers.is_empty() {
                    // The first operation: refuse it, so that every batch makes progress.
                    job.refuse(&e);
                } else {
                    // This operation did not run: it goes to the next batch with the rest.
                    unrun = Some(job);
                }
                broken = Some(e);
                break;
            }
            let (ok, answer) = job.run(conn).await;
            answers.push(answer);
            if let Some(damage) = self.location.damage() {
                // Nothing of a batch that met damage is committed.
                broken = Some(damage);
                break;
            }
            let end = if ok {
                sqlx::query("RELEASE spacebot_op").execute(&mut *conn).await
            } else {
                match sqlx::query("ROLLBACK TO spacebot_op")
                    .execute(&mut *conn)
                    .await
                {
                    Ok(_) => sqlx::query("RELEASE spacebot_op").execute(&mut *conn).await,
                    Err(e) => Err(e),
                }
            };
            if let Err(e) = end {
                // SQLite may have rolled the whole transaction back (a full disk, an I/O error):
                // nothing of this batch can be trusted to commit.
                broken = Some(fail("ending an operation's savepoint", e));
                break;
            }
        }
        // Operations not run because the batch broke off go first into the next batch, in order
        // (to be refused at once if the batch met damage).
        let rest: Vec<Job> = unrun.into_iter().chain(jobs).collect();
        for job in rest.into_iter().rev() {
            self.pending.push_front(job);
        }
        let outcome = match broken {
            Some(e) => {
                rollback(conn).await;
                Err(e)
            }
            None => commit(conn, &fail).await,
        };
        if outcome.is_ok() {
            self.count(answers.len());
            tracing::trace!(
                location = %self.location,
                operations = answers.len(),
                "group commit"
            );
        }
        for answer in answers {
            answer(outcome.as_ref().map(|_| ()));
        }
        outcome.is_ok()
    }

    fn count(&self, operations: usize) {
        self.counters.commits.fetch_add(1, Ordering::Relaxed);
        self.counters
            .operations
            .fetch_add(operations as u64, Ordering::Relaxed);
    }
}

/// Commits the open transaction. If the commit fails, SQLite may have rolled the transaction back
/// already (a full disk) or kept it open (a busy database): a `ROLLBACK` ends it either way, so
/// the next batch starts clean.
async fn commit(
    conn: &mut SqliteConnection,
    fail: &impl Fn(&str, sqlx::Error) -> StoreError,
) -> Result<(), StoreError> {
    match sqlx::query("COMMIT").execute(&mut *conn).await {
        Ok(_) => Ok(()),
        Err(e) => {
            rollback(conn).await;
            Err(fail("committing a transaction", e))
        }
    }
}

/// Ends the open transaction, if any. Its error says at most that none was open (SQLite rolled it
/// back itself), which is the state wanted.
async fn rollback(conn: &mut SqliteConnection) {
    if let Err(e) = sqlx::query("ROLLBACK").execute(&mut *conn).await {
        tracing::trace!(error = %e, "rollback after a failure");
    }
}

/// Fails every operation of `batch` with `e` without running it.
fn answer_all(batch: Vec<Job>, e: &StoreError) {
    for job in batch {
        job.refuse(e);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use crate::db::{Db, DbKind};
    use crate::options::{SqliteOptions, Synchronous};
    use spacebot_core::InvalidInput;

    async fn insert_key(
        writes: &Writer,
        key: &'static str,
        then_fail: bool,
    ) -> Result<(), StoreError> {
        writes
            .run(move |conn| {
                Box::pin(async move {
                    sqlx::query("INSERT INTO applied_keys (key, applied_at) VALUES (?, 0)")
                        .bind(key)
                        .execute(&mut *conn)
                        .await
                        .map_err(|e| db_error("test", "inserting", e))?;
                    if then_fail {
                        return Err(StoreError::Invalid(InvalidInput::new(
                            "key",
                            "refused after writing",
                        )));
                    }
                    Ok(())
                })
            })
            .await
    }

    /// An operation that wrote and then failed is rolled back to its savepoint alone: the
    /// operations before and after it in the same transaction are committed.
    #[tokio::test]
    async fn a_failed_operation_rolls_back_alone() {
        let db = Db::open(None, DbKind::Agent, &SqliteOptions::default())
            .await
            .unwrap();
        let (a, b, c) = tokio::join!(
            insert_key(&db.writes, "a", false),
            insert_key(&db.writes, "b", true),
            insert_key(&db.writes, "c", false),
        );
        assert!(a.is_ok() && c.is_ok(), "{a:?} {c:?}");
        assert!(matches!(b, Err(StoreError::Invalid(_))), "{b:?}");
        // One transaction carried all three (a current-thread runtime queues them all first).
        assert_eq!(
            db.writes.stats(),
            WriteStats {
                commits: 1,
                operations: 3
            }
        );
        let keys: Vec<String> = sqlx::query_scalar("SELECT key FROM applied_keys ORDER BY key")
            .fetch_all(&mut *db.read("taking a reader connection").await.unwrap())
            .await
            .unwrap();
        assert_eq!(keys, ["a", "c"]);
        // A lone operation that fails leaves nothing either, and the writer goes on.
        assert!(insert_key(&db.writes, "d", true).await.is_err());
        assert!(insert_key(&db.writes, "e", false).await.is_ok());
        let keys: Vec<String> = sqlx::query_scalar("SELECT key FROM applied_keys ORDER BY key")
            .fetch_all(&mut *db.read("taking a reader connection").await.unwrap())
            .await
            .unwrap();
        assert_eq!(keys, ["a", "c", "e"]);
    }

    async fn insert_owned(writes: &Writer, key: String) -> Result<(), StoreError> {
        writes
            .run(move |conn| {
                Box::pin(async move {
                    sqlx::query("INSERT INTO applied_keys (key, applied_at) VALUES (?, 0)")
                        .bind(key)
                        .execute(&mut *conn)
                        .await
                        .map_err(|e| db_error("test", "inserting", e))?;
                    Ok(())
                })
            })
            .await
    }

    async fn keys(db: &Db) -> Vec<String> {
        sqlx::query_scalar("SELECT key FROM applied_keys ORDER BY key")
            .fetch_all(&mut *db.read("taking a reader connection").await.unwrap())
            .await
            .unwrap()
    }

    /// SQLite ends a transaction by itself on some errors (a full disk at `COMMIT`): the batch
    /// fails, and the next one begins on the same connection. (The driver's transaction object
    /// counted the transaction as still open and refused every later `BEGIN`.)
    #[tokio::test]
    async fn a_transaction_sqlite_ended_itself_does_not_stop_the_writer() {
        let db = Db::open(None, DbKind::Agent, &SqliteOptions::default())
            .await
            .unwrap();
        let ended = || {
            db.writes.run(|conn| {
                Box::pin(async move {
                    sqlx::query("ROLLBACK")
                        .execute(&mut *conn)
                        .await
                        .map_err(|e| db_error("test", "rolling back", e))?;
                    Ok(())
                })
            })
        };
        // Alone: its commit fails.
        let e = ended().await.unwrap_err();
        assert!(e.to_string().contains("committing"), "{e}");
        insert_key(&db.writes, "after alone", false).await.unwrap();
        // In a batch: the batch fails whole.
        let (a, b) = tokio::join!(insert_key(&db.writes, "lost", false), ended());
        assert!(a.is_err() && b.is_err(), "{a:?} {b:?}");
        insert_key(&db.writes, "after batch", false).await.unwrap();
        assert_eq!(keys(&db).await, ["after alone", "after batch"]);
    }

    /// A full database ("database or disk is full", here from `max_page_count`) fails the writes
    /// that need space; once there is space again, the same writer writes again.
    #[tokio::test]
    async fn after_a_full_disk_the_writer_recovers_on_the_same_connection() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(
            Some(&dir.path().join("a.db")),
            DbKind::Agent,
            &SqliteOptions::default(),
        )
        .await
        .unwrap();
        let cap = |pages: u32| {
            db.writes.run(move |conn| {
                Box::pin(async move {
                    sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
                        "PRAGMA max_page_count = {pages}"
                    )))
                    .fetch_one(&mut *conn)
                    .await
                    .map_err(|e| db_error("test", "pragma", e))?;
                    Ok(())
                })
            })
        };
        insert_key(&db.writes, "before", false).await.unwrap();
        cap(1).await.unwrap(); // clamped to the current size
        let big = |i: usize| format!("{i:03}{}", "x".repeat(20_000));
        let mut stored = vec!["before".to_string()];
        let mut full = None;
        for i in 0..50 {
            match insert_owned(&db.writes, big(i)).await {
                Ok(()) => stored.push(big(i)),
                Err(e) => {
                    full = Some(e);
                    break;
                }
            }
        }
        let e = full.expect("the capped database never filled up");
        assert!(e.to_string().contains("full"), "{e}");
        // Several writes in one batch fail together while it is full.
        let (a, b) = tokio::join!(
            insert_owned(&db.writes, big(100)),
            insert_owned(&db.writes, big(101))
        );
        assert!(a.is_err() && b.is_err(), "{a:?} {b:?}");
        // Space is back: the same writer writes again, and nothing refused was kept.
        cap(u32::MAX - 1).await.unwrap();
        insert_key(&db.writes, "zafter", false).await.unwrap();
        stored.push("zafter".to_string());
        stored.sort();
        assert_eq!(keys(&db).await, stored);
        db.close().await;
    }

    /// A statement error inside a batch (a duplicate key) is an operation's own failure.
    #[tokio::test]
    async fn a_constraint_violation_fails_only_its_operation() {
        let db = Db::open(None, DbKind::Agent, &SqliteOptions::default())
            .await
            .unwrap();
        insert_key(&db.writes, "x", false).await.unwrap();
        let (dup, fresh) = tokio::join!(
            insert_key(&db.writes, "x", false),
            insert_key(&db.writes, "y", false)
        );
        assert!(dup.is_err());
        assert!(fresh.is_ok(), "{fresh:?}");
    }

    /// After close, a write is refused with an error naming the database.
    #[tokio::test]
    async fn writes_after_close_fail() {
        let db = Db::open(None, DbKind::Agent, &SqliteOptions::default())
            .await
            .unwrap();
        db.writes.close().await;
        let e = insert_key(&db.writes, "z", false).await.unwrap_err();
        assert!(e.to_string().contains("stopped"), "{e}");
    }

    /// The `synchronous` setting reaches the writer connection, in WAL mode: with `FULL` a commit
    /// syncs the log before it returns.
    #[tokio::test]
    async fn the_writer_connection_has_the_configured_synchronous_mode() {
        for (mode, code) in [(Synchronous::Normal, 1), (Synchronous::Full, 2)] {
            let dir = tempfile::tempdir().unwrap();
            let options = SqliteOptions::default().synchronous(mode);
            let db = Db::open(Some(&dir.path().join("a.db")), DbKind::Agent, &options)
                .await
                .unwrap();
            let (sync, journal) = db
                .writes
                .run(|conn| {
                    Box::pin(async move {
                        let sync: i64 = sqlx::query_scalar("PRAGMA synchronous")
                            .fetch_one(&mut *conn)
                            .await
                            .map_err(|e| db_error("test", "pragma", e))?;
                        let journal: String = sqlx::query_scalar("PRAGMA journal_mode")
                            .fetch_one(&mut *conn)
                            .await
                            .map_err(|e| db_error("test", "pragma", e))?;
                        Ok((sync, journal))
                    })
                })
                .await
                .unwrap();
            assert_eq!((sync, journal.as_str()), (code, "wal"), "{mode:?}");
            db.close().await;
        }
    }
}
