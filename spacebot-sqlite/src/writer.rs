//! Group commit: one writer thread per database runs the queued write operations of all callers in
//! one transaction and answers each caller only once that transaction is committed.
//!
//! An operation is a synchronous closure over the writer's connection. The thread takes the first
//! queued operation and every other one already queued (up to `max_batch`), opens one
//! `BEGIN IMMEDIATE` transaction, runs each operation inside its own `SAVEPOINT` (an operation that
//! fails is rolled back to its savepoint alone, so the others are kept), commits once, and only then
//! sends every caller its result. A commit that fails fails every operation of the batch, and
//! nothing of it is kept. A batch of one operation runs without a savepoint.
//!
//! The whole batch (`BEGIN`, every statement of every operation, `COMMIT`) runs on the thread that
//! owns the connection: a caller's operation is one message to that thread and one answer back,
//! whatever the number of its statements. The connection is opened and migrated before the thread
//! starts, and nothing else writes through it.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rusqlite::Connection;
use spacebot_core::StoreError;
use spacebot_core::durability::{self, Durability};
use tokio::sync::oneshot;

use crate::error::{BACKEND, Location, db_error};

/// Answers an operation's caller once the batch's fate is known: `Ok` when it committed (or when
/// the operation failed and was rolled back alone), else the batch's error.
type Answer = Box<dyn FnOnce(Result<(), &StoreError>) + Send>;

/// One queued operation with its caller's reply channel.
trait Operation: Send {
    /// Runs the operation on the batch's connection; says whether it succeeded (its savepoint is
    /// kept) and how to answer its caller.
    fn run(self: Box<Self>, conn: &Connection) -> (bool, Answer);
    /// Answers the caller with `e` without running the operation.
    fn refuse(self: Box<Self>, e: &StoreError);
    /// Whether the caller must find the operation on the disk when it returns
    /// ([`Durability::Immediate`] where it was issued).
    fn immediate(&self) -> bool;
}

type Job = Box<dyn Operation>;

struct Op<T, F> {
    op: F,
    reply: oneshot::Sender<Result<T, StoreError>>,
    immediate: bool,
}

impl<T, F> Operation for Op<T, F>
where
    T: Send + 'static,
    F: FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
{
    fn run(self: Box<Self>, conn: &Connection) -> (bool, Answer) {
        let Self { op, reply, .. } = *self;
        let result = op(conn);
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
    }

    fn refuse(self: Box<Self>, e: &StoreError) {
        let _ = self.reply.send(Err(replicate(e)));
    }

    fn immediate(&self) -> bool {
        self.immediate
    }
}

enum Message {
    Run(Job),
    /// Finish what is queued before this, then close the connection, stop and acknowledge.
    Close(oneshot::Sender<()>),
}

/// Counters of one database's writer, for tests and diagnostics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteStats {
    /// Transactions committed by the writer.
    pub commits: u64,
    /// Operations those transactions carried (refused ones included).
    pub operations: u64,
    /// The writer's syncs of the write-ahead log (`fsync`s): one per commit that wrote to the log
    /// with `synchronous = FULL` when every commit syncs; with deferred syncing
    /// ([`SqliteOptions::sync_delay`](crate::SqliteOptions::sync_delay)), one per commit carrying
    /// an immediate write (synced by the writer itself when SQLite wrote nothing for it) plus one
    /// per delayed sync. None with `NORMAL` or `OFF` (SQLite's own syncs at checkpoints are not
    /// counted).
    pub syncs: u64,
    /// How many of `commits` were on the disk at the last sync (all of them when every commit
    /// syncs; none without syncs).
    pub synced: u64,
}

#[derive(Debug, Default)]
struct Counters {
    commits: AtomicU64,
    operations: AtomicU64,
    syncs: AtomicU64,
    synced: AtomicU64,
}

/// When the writer's commits reach the disk.
#[derive(Debug, Clone)]
pub(crate) enum Syncing {
    /// As the connection's `synchronous` setting says, every commit alike; `counted`: whether
    /// each commit is an `fsync` (`FULL`, `EXTRA`) to count.
    Setting {
        /// Whether each commit syncs.
        counted: bool,
    },
    /// `synchronous = FULL` for a batch carrying an immediate write (which syncs every deferred
    /// commit before it: one write-ahead log, synced as a whole), `NORMAL` for a batch of deferred
    /// writes alone, whose commits are synced at the latest `delay` after the first of them (by
    /// an `fsync` of the log `wal` when nothing else comes), and before the writer closes.
    Deferred {
        /// The longest a deferred commit waits for its sync.
        delay: Duration,
        /// The database's write-ahead log.
        wal: PathBuf,
    },
}

/// The sending side of a database's writer thread. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct Writer {
    queue: mpsc::Sender<Message>,
    counters: Arc<Counters>,
    location: Location,
}

/// A connection shared by the writer thread and, for an in-memory database, its reads.
pub(crate) type Shared = Arc<Mutex<Connection>>;

/// Locks `conn`: a panic in an operation cannot leave the connection half-used in a way the next
/// batch does not repair (it begins with a `ROLLBACK` of anything left open).
pub(crate) fn lock(conn: &Shared) -> std::sync::MutexGuard<'_, Connection> {
    conn.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Writer {
    /// Starts the writer thread of the database at `location`, which owns `conn` (opened and
    /// migrated) from now on.
    pub(crate) fn start(
        conn: Shared,
        location: Location,
        max_batch: usize,
        syncing: Syncing,
    ) -> Result<Self, StoreError> {
        let (queue, receiver) = mpsc::channel();
        let counters = Arc::new(Counters::default());
        let task = Task {
            conn: Some(conn),
            location: location.clone(),
            max_batch: max_batch.max(1),
            receiver,
            counters: counters.clone(),
            pending: VecDeque::new(),
            syncing,
            full: true,
            unsynced: None,
            sync_failed: false,
        };
        std::thread::Builder::new()
            .name("spacebot-sqlite-writer".into())
            .spawn(move || task.serve())
            .map_err(|e| {
                StoreError::backend(
                    BACKEND,
                    format!("starting the writer thread of {location}: {e}"),
                    e,
                )
            })?;
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
        F: FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    {
        if let Some(damage) = self.location.damage() {
            return Err(damage);
        }
        let (reply, answered) = oneshot::channel::<Result<T, StoreError>>();
        let job: Job = Box::new(Op {
            op,
            reply,
            immediate: durability::current() == Durability::Immediate,
        });
        self.queue
            .send(Message::Run(job))
            .map_err(|_| self.stopped())?;
        answered.await.map_err(|_| self.stopped())?
    }

    /// Finishes the operations queued so far, closes the connection and stops the thread; later
    /// calls fail.
    pub(crate) async fn close(&self) {
        let (done, closed) = oneshot::channel();
        if self.queue.send(Message::Close(done)).is_ok() {
            // The thread dropping the acknowledgement means it stopped anyway.
            let _ = closed.await;
        }
    }

    /// The counters so far.
    pub(crate) fn stats(&self) -> WriteStats {
        WriteStats {
            commits: self.counters.commits.load(Ordering::Relaxed),
            operations: self.counters.operations.load(Ordering::Relaxed),
            syncs: self.counters.syncs.load(Ordering::Relaxed),
            synced: self.counters.synced.load(Ordering::Relaxed),
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

/// The writer thread.
struct Task {
    /// `None` once closed.
    conn: Option<Shared>,
    location: Location,
    max_batch: usize,
    receiver: mpsc::Receiver<Message>,
    counters: Arc<Counters>,
    /// Operations taken from the queue but not run yet (after a batch broke off).
    pending: VecDeque<Job>,
    syncing: Syncing,
    /// Under [`Syncing::Deferred`]: whether the connection is at `synchronous = FULL` now (it is
    /// opened so).
    full: bool,
    /// Under [`Syncing::Deferred`]: when the first commit not synced yet was made.
    unsynced: Option<Instant>,
    /// Under [`Syncing::Deferred`]: the last delayed sync failed; the next commit syncs.
    sync_failed: bool,
}

impl Task {
    fn serve(mut self) {
        let mut closing = None;
        loop {
            if self.pending.is_empty() {
                let received = match self.sync_due() {
                    Some(due) => match self
                        .receiver
                        .recv_timeout(due.saturating_duration_since(Instant::now()))
                    {
                        Ok(message) => Ok(message),
                        Err(RecvTimeoutError::Timeout) => {
                            self.sync();
                            continue;
                        }
                        Err(RecvTimeoutError::Disconnected) => Err(()),
                    },
                    None => self.receiver.recv().map_err(|_| ()),
                };
                match received {
                    Ok(Message::Run(job)) => self.pending.push_back(job),
                    Ok(Message::Close(done)) => {
                        closing = Some(done);
                        break;
                    }
                    Err(()) => break,
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
            self.run_batch(batch);
            if closing.is_some() {
                // Operations requeued by a broken last batch still run before stopping.
                while !self.pending.is_empty() {
                    let batch: Vec<Job> = self.pending.drain(..).collect();
                    self.run_batch(batch);
                }
                break;
            }
        }
        // Deferred commits are on the disk before the stores say they are closed.
        self.sync();
        // The connection closes before the acknowledgement: whoever waits for the close (to
        // release the directory's lock) never meets the file still being closed.
        drop(self.conn.take());
        // Operations sent after the close are dropped: their callers get an error.
        let mut acknowledgements = Vec::new();
        while let Ok(message) = self.receiver.try_recv() {
            if let Message::Close(done) = message {
                acknowledgements.push(done);
            }
        }
        drop(self.receiver);
        for done in acknowledgements.into_iter().chain(closing) {
            let _ = done.send(());
        }
    }

    /// Runs `batch` in one transaction and answers each operation once it is committed.
    ///
    /// The transaction is begun, committed and rolled back with plain statements: SQLite rolls a
    /// transaction back by itself on some errors (a full disk, an I/O error, an interrupted
    /// statement), and a `ROLLBACK` statement is harmless when nothing is open.
    fn run_batch(&mut self, batch: Vec<Job>) {
        if batch.is_empty() {
            return;
        }
        // A database that has shown damage is not written to again.
        if let Some(damage) = self.location.damage() {
            return answer_all(batch, &damage);
        }
        let Some(shared) = self.conn.clone() else {
            return;
        };
        let conn = lock(&shared);
        if !conn.is_autocommit() {
            // A transaction left open (an operation that panicked) is ended first.
            rollback(&conn);
        }
        self.run_batch_on(&conn, batch);
    }

    /// [`run_batch`](Self::run_batch) on `conn`; says whether the batch committed.
    fn run_batch_on(&mut self, conn: &Connection, mut batch: Vec<Job>) -> bool {
        let location = self.location.clone();
        let fail = |doing: &str, e| db_error(&location, doing, e);
        let syncs = match self.choose_sync(conn, &batch) {
            Ok(syncs) => syncs,
            Err(e) => {
                answer_all(batch, &fail("setting the commit's synchronous mode", e));
                return false;
            }
        };
        let changes = conn.total_changes();
        if let Err(e) = control(conn, "BEGIN IMMEDIATE") {
            // A transaction left open is ended, so the next batch can begin; this one fails.
            rollback(conn);
            answer_all(batch, &fail("starting a transaction", e));
            return false;
        }
        let mut answers: Vec<Answer> = Vec::with_capacity(batch.len());
        if batch.len() == 1 {
            let Some(job) = batch.pop() else {
                return true;
            };
            let (ok, answer) = job.run(conn);
            let outcome = match self.location.damage() {
                // The operation met damage: nothing of it is kept.
                Some(damage) => {
                    rollback(conn);
                    Err(damage)
                }
                None if ok => commit(conn, &fail),
                None => {
                    // The operation failed: whatever it wrote goes; its own error is its answer.
                    rollback(conn);
                    Ok(())
                }
            };
            if outcome.is_ok() {
                self.committed(conn, 1, syncs, ok, changes);
            }
            answer(outcome.as_ref().map(|_| ()));
            return outcome.is_ok();
        }
        let mut jobs = batch.into_iter();
        let mut broken = None;
        let mut unrun = None;
        let mut all_ok = true;
        for job in jobs.by_ref() {
            if let Err(e) = control(conn, "SAVEPOINT spacebot_op") {
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
            let (ok, answer) = job.run(conn);
            all_ok &= ok;
            answers.push(answer);
            if let Some(damage) = self.location.damage() {
                // Nothing of a batch that met damage is committed.
                broken = Some(damage);
                break;
            }
            let end = if ok {
                control(conn, "RELEASE spacebot_op")
            } else {
                conn.execute_batch("ROLLBACK TO spacebot_op; RELEASE spacebot_op")
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
                rollback(conn);
                Err(e)
            }
            None => commit(conn, &fail),
        };
        if outcome.is_ok() {
            self.committed(conn, answers.len(), syncs, all_ok, changes);
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

    /// After a batch of `operations` committed: counts it and, when it was to sync (`syncs`) but
    /// may have written nothing (an operation rolled back, or no row changed: SQLite syncs a
    /// commit only when it writes to the log), syncs the log itself before anyone is answered,
    /// so that the deferred commits before it are on the disk all the same.
    fn committed(
        &mut self,
        conn: &Connection,
        operations: usize,
        syncs: bool,
        all_ok: bool,
        changes_before: u64,
    ) {
        let wrote = all_ok && conn.total_changes() > changes_before;
        self.count(operations, syncs && wrote);
        if syncs && !wrote {
            self.sync();
        }
    }

    /// Counts a commit of `operations`, synced (`syncs`) or not.
    fn count(&mut self, operations: usize, syncs: bool) {
        let commits = self.counters.commits.fetch_add(1, Ordering::Relaxed) + 1;
        self.counters
            .operations
            .fetch_add(operations as u64, Ordering::Relaxed);
        if syncs {
            self.counters.syncs.fetch_add(1, Ordering::Relaxed);
            self.counters.synced.store(commits, Ordering::Relaxed);
            self.unsynced = None;
            self.sync_failed = false;
        } else if matches!(self.syncing, Syncing::Deferred { .. }) && self.unsynced.is_none() {
            self.unsynced = Some(Instant::now());
        }
    }

    /// Whether the next commit, of `batch`, syncs; under [`Syncing::Deferred`] sets the
    /// connection's `synchronous` for it (outside any transaction, where SQLite allows it): `FULL`
    /// when an operation of the batch is immediate or deferred commits have waited their delay.
    fn choose_sync(&mut self, conn: &Connection, batch: &[Job]) -> Result<bool, rusqlite::Error> {
        let full = match &self.syncing {
            Syncing::Setting { counted } => return Ok(*counted),
            Syncing::Deferred { .. } => {
                self.sync_failed
                    || batch.iter().any(|job| job.immediate())
                    || self.sync_due().is_some_and(|due| due <= Instant::now())
            }
        };
        if full != self.full {
            conn.execute_batch(if full {
                "PRAGMA synchronous = FULL"
            } else {
                "PRAGMA synchronous = NORMAL"
            })?;
            self.full = full;
        }
        Ok(full)
    }

    /// When the deferred commits not synced yet must be: `delay` after the first of them.
    fn sync_due(&self) -> Option<Instant> {
        match (&self.syncing, self.unsynced) {
            (Syncing::Deferred { delay, .. }, Some(first)) => Some(first + *delay),
            _ => None,
        }
    }

    /// Syncs the write-ahead log, and with it every deferred commit (committed frames are in the
    /// file; `fsync` of any descriptor of it flushes them). A failed sync is an error event and
    /// is tried again by the next commit, made `FULL`.
    fn sync(&mut self) {
        let Syncing::Deferred { wal, .. } = &self.syncing else {
            return;
        };
        if self.unsynced.is_none() {
            return;
        }
        let commits = self.counters.commits.load(Ordering::Relaxed);
        match std::fs::File::open(wal).and_then(|file| file.sync_data()) {
            Ok(()) => {
                self.counters.syncs.fetch_add(1, Ordering::Relaxed);
                self.counters.synced.store(commits, Ordering::Relaxed);
                self.unsynced = None;
            }
            // No log: the last checkpoint moved every commit into the database, synced.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.counters.synced.store(commits, Ordering::Relaxed);
                self.unsynced = None;
            }
            Err(e) => {
                tracing::error!(
                    location = %self.location,
                    "syncing the write-ahead log failed: {e} (the next commit syncs instead)"
                );
                // The next batch commits with `FULL`.
                self.sync_failed = true;
            }
        }
    }
}

/// Commits the open transaction. If the commit fails, SQLite may have rolled the transaction back
/// already (a full disk) or kept it open (a busy database): a `ROLLBACK` ends it either way, so
/// the next batch starts clean.
fn commit(
    conn: &Connection,
    fail: &impl Fn(&str, rusqlite::Error) -> StoreError,
) -> Result<(), StoreError> {
    match control(conn, "COMMIT") {
        Ok(()) => Ok(()),
        Err(e) => {
            rollback(conn);
            Err(fail("committing a transaction", e))
        }
    }
}

/// Runs one transaction-control statement (`BEGIN`, `SAVEPOINT`, `RELEASE`, `COMMIT`) through
/// the connection's statement cache: every batch runs them, and `execute_batch` would parse them
/// anew each time.
fn control(conn: &Connection, sql: &str) -> Result<(), rusqlite::Error> {
    conn.prepare_cached(sql)?.execute([]).map(drop)
}

/// Ends the open transaction, if any. Its error says at most that none was open (SQLite rolled it
/// back itself), which is the state wanted.
fn rollback(conn: &Connection) {
    if let Err(e) = conn.execute_batch("ROLLBACK") {
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

    fn insert(conn: &Connection, key: &str) -> Result<(), StoreError> {
        conn.execute(
            "INSERT INTO applied_keys (agent, key, applied_at) VALUES ('', ?, 0)",
            [key],
        )
        .map_err(|e| db_error("test", "inserting", e))?;
        Ok(())
    }

    async fn insert_key(
        writes: &Writer,
        key: &'static str,
        then_fail: bool,
    ) -> Result<(), StoreError> {
        writes
            .run(move |conn| {
                insert(conn, key)?;
                if then_fail {
                    return Err(StoreError::Invalid(InvalidInput::new(
                        "key",
                        "refused after writing",
                    )));
                }
                Ok(())
            })
            .await
    }

    async fn insert_owned(writes: &Writer, key: String) -> Result<(), StoreError> {
        writes.run(move |conn| insert(conn, &key)).await
    }

    async fn keys(db: &Db) -> Vec<String> {
        db.read("reading keys", |conn| {
            let mut statement = conn
                .prepare("SELECT key FROM applied_keys ORDER BY key")
                .map_err(|e| db_error("test", "reading", e))?;
            let keys = statement
                .query_map([], |row| row.get(0))
                .and_then(Iterator::collect)
                .map_err(|e| db_error("test", "reading", e))?;
            Ok(keys)
        })
        .await
        .unwrap()
    }

    /// Keeps the writer thread busy in an operation of its own until the returned sender is
    /// dropped: operations sent meanwhile queue up and run in the next batch together. Returns
    /// once the thread is in that operation.
    async fn hold_writer(
        db: &Db,
    ) -> (
        std::sync::mpsc::Sender<()>,
        tokio::task::JoinHandle<Result<(), StoreError>>,
    ) {
        let (hold, held) = std::sync::mpsc::channel::<()>();
        let (started, running) = oneshot::channel();
        let writes = db.writes.clone();
        let holder = tokio::spawn(async move {
            writes
                .run(move |_| {
                    let _ = started.send(());
                    // Returns once the sender is dropped.
                    let _ = held.recv();
                    Ok(())
                })
                .await
        });
        running.await.unwrap();
        (hold, holder)
    }

    /// An operation that wrote and then failed is rolled back to its savepoint alone: the
    /// operations before and after it in the same transaction are committed.
    #[tokio::test]
    async fn a_failed_operation_rolls_back_alone() {
        let db = Db::open(None, DbKind::Agent, &SqliteOptions::default())
            .await
            .unwrap();
        let before = db.writes.stats();
        let (hold, holder) = hold_writer(&db).await;
        // `join!` polls each in order: the three are queued before the writer is let go.
        let (a, b, c, ()) = tokio::join!(
            insert_key(&db.writes, "a", false),
            insert_key(&db.writes, "b", true),
            insert_key(&db.writes, "c", false),
            async move { drop(hold) },
        );
        holder.await.unwrap().unwrap();
        assert!(a.is_ok() && c.is_ok(), "{a:?} {c:?}");
        assert!(matches!(b, Err(StoreError::Invalid(_))), "{b:?}");
        // One transaction carried all three (and one the holder).
        let after = db.writes.stats();
        assert_eq!(
            (
                after.commits - before.commits,
                after.operations - before.operations
            ),
            (2, 4)
        );
        assert_eq!(keys(&db).await, ["a", "c"]);
        // A lone operation that fails leaves nothing either, and the writer goes on.
        assert!(insert_key(&db.writes, "d", true).await.is_err());
        assert!(insert_key(&db.writes, "e", false).await.is_ok());
        assert_eq!(keys(&db).await, ["a", "c", "e"]);
    }

    /// SQLite ends a transaction by itself on some errors (a full disk at `COMMIT`): the batch
    /// fails, and the next one begins on the same connection.
    #[tokio::test]
    async fn a_transaction_sqlite_ended_itself_does_not_stop_the_writer() {
        let db = Db::open(None, DbKind::Agent, &SqliteOptions::default())
            .await
            .unwrap();
        let ended = || {
            db.writes.run(|conn| {
                conn.execute_batch("ROLLBACK")
                    .map_err(|e| db_error("test", "rolling back", e))
            })
        };
        // Alone: its commit fails.
        let e = ended().await.unwrap_err();
        assert!(e.to_string().contains("committing"), "{e}");
        insert_key(&db.writes, "after alone", false).await.unwrap();
        // In a batch: the batch fails whole.
        let (hold, holder) = hold_writer(&db).await;
        let (a, b, ()) = tokio::join!(insert_key(&db.writes, "lost", false), ended(), async move {
            drop(hold)
        });
        holder.await.unwrap().unwrap();
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
                conn.query_row(&format!("PRAGMA max_page_count = {pages}"), [], |r| {
                    r.get::<_, i64>(0)
                })
                .map_err(|e| db_error("test", "pragma", e))?;
                Ok(())
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
        let (hold, holder) = hold_writer(&db).await;
        let (a, b, ()) = tokio::join!(
            insert_owned(&db.writes, big(100)),
            insert_owned(&db.writes, big(101)),
            async move { drop(hold) },
        );
        holder.await.unwrap().unwrap();
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
        let (hold, holder) = hold_writer(&db).await;
        let (dup, fresh, ()) = tokio::join!(
            insert_key(&db.writes, "x", false),
            insert_key(&db.writes, "y", false),
            async move { drop(hold) },
        );
        holder.await.unwrap().unwrap();
        assert!(dup.is_err());
        assert!(fresh.is_ok(), "{fresh:?}");
        assert_eq!(keys(&db).await, ["x", "y"]);
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
    /// syncs the log before it returns. The default is `FULL` (durable against power loss).
    #[tokio::test]
    async fn the_writer_connection_has_the_configured_synchronous_mode() {
        for (mode, code) in [
            (Some(Synchronous::Normal), 1),
            (Some(Synchronous::Full), 2),
            (None, 2),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let options = match mode {
                Some(mode) => SqliteOptions::default().synchronous(mode),
                None => SqliteOptions::new(),
            };
            let db = Db::open(Some(&dir.path().join("a.db")), DbKind::Agent, &options)
                .await
                .unwrap();
            let (sync, journal) = db
                .writes
                .run(|conn| {
                    let pragma = |sql: &str| {
                        conn.query_row(sql, [], |r| r.get::<_, rusqlite::types::Value>(0))
                            .map_err(|e| db_error("test", "pragma", e))
                    };
                    Ok((
                        pragma("PRAGMA synchronous")?,
                        pragma("PRAGMA journal_mode")?,
                    ))
                })
                .await
                .unwrap();
            assert_eq!(
                (sync, journal),
                (
                    rusqlite::types::Value::Integer(code),
                    rusqlite::types::Value::Text("wal".into())
                ),
                "{mode:?}"
            );
            db.close().await;
        }
    }
}
