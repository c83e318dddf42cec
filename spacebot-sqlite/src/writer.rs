//! Group commit: one writer thread per database runs the queued write operations of all callers in
//! one transaction and answers each caller only once that transaction is committed.
//!
//! An operation is a synchronous closure over the writer's connection. The thread takes the first
//! queued operation and every other one already queued (up to `max_batch`), opens one
//! `BEGIN IMMEDIATE` transaction, runs each operation inside its own `SAVEPOINT` (an operation that
//! fails is rolled back to its savepoint alone, so the others are kept), commits once, and only then
//! sends every caller its result. A commit that fails fails every operation of the batch, and
//! nothing of it is kept. The first operation of a batch runs without a savepoint: if it fails,
//! the transaction is rolled back whole (nothing else ran yet) and the other operations run in the
//! next batch. An operation issued with [`Writer::run_unguarded`] (every statement of it a whole
//! change, as a cell's image) runs without one wherever it stands.
//!
//! The whole batch (`BEGIN`, every statement of every operation, `COMMIT`) runs on the thread that
//! owns the connection: a caller's operation is one message to that thread and one answer back,
//! whatever the number of its statements. The connection is opened and migrated before the thread
//! starts, and nothing else writes through it.
//!
//! Under deferred syncing ([`Syncing::Deferred`]) a deferred operation that finds the writer idle
//! (nothing queued, no batch running) runs on its caller's thread instead, without the hand-off,
//! in one batch with the writes issued beside it (a [`Gathering`]; it yields once for them when
//! issued [`together`](durability::together)): such a commit is not synced, so it costs no
//! `fsync` there. Whatever syncs
//! stays on the thread (immediate operations, a commit due to sync, the delayed sync), and so do
//! checkpoints: a write-ahead-log hook replaces SQLite's automatic checkpoint on the writer
//! connection, and the thread checkpoints once a commit leaves the log at [`CHECKPOINT_PAGES`].

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError};
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
    /// Whether it runs inside a savepoint of its own in a batch of several (see
    /// [`Writer::run_unguarded`]).
    fn guarded(&self) -> bool {
        true
    }
}

type Job = Box<dyn Operation>;

struct Op<T, F> {
    op: F,
    reply: oneshot::Sender<Result<T, StoreError>>,
    immediate: bool,
    guarded: bool,
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

    fn guarded(&self) -> bool {
        self.guarded
    }
}

enum Message {
    Run(Job),
    /// A deferred commit was made off the thread: its sync is now due at some time (the thread
    /// waits for it).
    Wake,
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
    /// Checkpoints the writer thread ran (copying the write-ahead log into the database) under
    /// deferred syncing, where it runs them instead of SQLite's automatic checkpoint; SQLite's
    /// own automatic checkpoints (the other settings) are not counted.
    pub checkpoints: u64,
}

#[derive(Debug, Default)]
struct Counters {
    commits: AtomicU64,
    operations: AtomicU64,
    syncs: AtomicU64,
    synced: AtomicU64,
    checkpoints: AtomicU64,
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
    /// What runs batches, shared with the thread.
    state: Arc<Mutex<State>>,
    /// Operations sent to the thread and not taken yet.
    queued: Arc<AtomicUsize>,
    /// Whether the thread holds, or is about to take, the state for a batch, a sync or a
    /// checkpoint (otherwise it holds it a moment at most).
    busy: Arc<AtomicBool>,
    /// Whether a deferred write may run on its caller's thread ([`Syncing::Deferred`]).
    inline: bool,
    /// Deferred writes gathered to run together on a caller's thread.
    gathering: Arc<Mutex<Gathering>>,
    /// The most operations one transaction carries.
    max_batch: usize,
}

/// Deferred writes gathered for a batch on a caller's thread: the first to come leads (issued
/// [`together`](durability::together) with others, it yields once so that they join it; writes
/// of other tasks arriving meanwhile join too), the others wait for the leader's batch.
#[derive(Default)]
struct Gathering {
    jobs: Vec<Job>,
    led: bool,
}

/// The leader of a [`Gathering`]: dropped before it ran the batch (its future dropped while it
/// yielded), it hands the gathered writes to the thread, so no caller is left waiting.
struct Leader<'a> {
    writer: &'a Writer,
    done: bool,
}

impl std::fmt::Debug for Gathering {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gathering")
            .field("jobs", &self.jobs.len())
            .field("led", &self.led)
            .finish()
    }
}

impl Leader<'_> {
    /// The writes gathered; the next deferred write leads a new gathering.
    fn take(&mut self) -> Vec<Job> {
        self.done = true;
        let mut gathering = self.writer.gathering();
        gathering.led = false;
        std::mem::take(&mut gathering.jobs)
    }
}

impl Drop for Leader<'_> {
    fn drop(&mut self) {
        if !self.done {
            let jobs = self.take();
            self.writer.send_all(jobs);
        }
    }
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
        let inline = matches!(syncing, Syncing::Deferred { .. });
        if inline {
            // Commits run on callers' threads too: SQLite's automatic checkpoint (copying the
            // log into the database and syncing both, milliseconds) would run there. The hook
            // replaces it; the thread checkpoints instead.
            lock(&conn).wal_hook(Some(note_wal_pages));
        }
        let state = Arc::new(Mutex::new(State {
            conn: Some(conn),
            location: location.clone(),
            counters: counters.clone(),
            pending: VecDeque::new(),
            syncing,
            full: true,
            unsynced: None,
            sync_failed: false,
            checkpoint_due: false,
        }));
        let queued = Arc::new(AtomicUsize::new(0));
        let busy = Arc::new(AtomicBool::new(false));
        let task = Task {
            state: state.clone(),
            max_batch: max_batch.max(1),
            receiver,
            queued: queued.clone(),
            busy: busy.clone(),
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
            state,
            queued,
            busy,
            inline,
            gathering: Arc::default(),
            max_batch: max_batch.max(1),
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
        self.run_op(op, true).await
    }

    /// [`run`](Self::run) without the savepoint that lets a failed operation be rolled back alone
    /// in a batch of several: for an operation every statement of which leaves the database right
    /// by itself (each one a whole change), so that what it wrote before it failed may stay. Its
    /// batch's transaction still commits or rolls back as a whole.
    pub(crate) async fn run_unguarded<T, F>(&self, op: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    {
        self.run_op(op, false).await
    }

    async fn run_op<T, F>(&self, op: F, guarded: bool) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    {
        if let Some(damage) = self.location.damage() {
            return Err(damage);
        }
        let (reply, answered) = oneshot::channel::<Result<T, StoreError>>();
        let immediate = durability::current() == Durability::Immediate;
        let together = durability::is_together();
        let job: Job = Box::new(Op {
            op,
            reply,
            immediate,
            guarded,
        });
        if immediate
            || !self.inline
            || self.queued.load(Ordering::Acquire) != 0
            || self.busy.load(Ordering::Acquire)
        {
            // Writes gathered before this one go first: the thread runs them in the order they
            // were issued (their leader then finds nothing left to run).
            if self.inline {
                self.hand_over_gathered();
            }
            self.send(job)?;
        } else {
            let leads = {
                let mut gathering = self.gathering();
                gathering.jobs.push(job);
                !std::mem::replace(&mut gathering.led, true)
            };
            if leads {
                let mut leader = Leader {
                    writer: self,
                    done: false,
                };
                // Writes issued beside this one (a `join` marked `together`) join the batch.
                if together {
                    tokio::task::yield_now().await;
                }
                let jobs = leader.take();
                for batch in chunks(jobs, self.max_batch) {
                    if let Some(jobs) = self.run_here(batch) {
                        self.send_all(jobs);
                    }
                }
            }
        }
        answered.await.map_err(|_| self.stopped())?
    }

    fn gathering(&self) -> MutexGuard<'_, Gathering> {
        self.gathering
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Sends the writes gathered so far to the thread, in order.
    fn hand_over_gathered(&self) {
        let gathered = std::mem::take(&mut self.gathering().jobs);
        self.send_all(gathered);
    }

    /// Sends `job` to the thread.
    fn send(&self, job: Job) -> Result<(), StoreError> {
        self.queued.fetch_add(1, Ordering::AcqRel);
        if self.queue.send(Message::Run(job)).is_err() {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(self.stopped());
        }
        Ok(())
    }

    /// Sends `jobs` to the thread, in order; a job the stopped thread cannot take is dropped,
    /// and its caller told the writer stopped.
    fn send_all(&self, jobs: Vec<Job>) {
        for job in jobs {
            let _ = self.send(job);
        }
    }

    /// Runs `read` on the writer's connection, on the calling thread, when the writer is idle
    /// under deferred syncing (nothing queued, no batch running, no transaction open) and its
    /// state is free at once: that connection's cache holds the pages the last commits wrote,
    /// where a reader connection would read them again from the log (its cache is dropped at
    /// every commit it did not make). Gives `read` back otherwise.
    pub(crate) fn read_if_idle<T, F>(
        &self,
        doing: &'static str,
        read: F,
    ) -> Result<Result<T, StoreError>, F>
    where
        F: FnOnce(&Connection) -> Result<T, StoreError>,
    {
        if !self.inline
            || self.queued.load(Ordering::Acquire) != 0
            || self.busy.load(Ordering::Acquire)
        {
            return Err(read);
        }
        let state = match self.state.try_lock() {
            Ok(state) => state,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return Err(read),
        };
        if !state.pending.is_empty() {
            return Err(read);
        }
        let Some(shared) = state.conn.as_ref() else {
            return Err(read);
        };
        let conn = lock(shared);
        if !conn.is_autocommit() {
            return Err(read);
        }
        // A read that panics fails as one on a reader connection does, not the caller's task.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| read(&conn)))
            .unwrap_or_else(|_| {
                Err(StoreError::Backend {
                    backend: BACKEND,
                    message: format!(
                        "{doing} in {}: the read did not finish: it panicked",
                        self.location
                    ),
                    source: None,
                })
            });
        // A read that opened a transaction and returned early must not leave it open: the next
        // batch's `BEGIN IMMEDIATE` would fail.
        if !conn.is_autocommit() {
            let _ = conn.execute_batch("ROLLBACK");
        }
        Ok(result)
    }

    /// Runs deferred `jobs` as one batch on the calling thread when the writer is idle (nothing
    /// queued, no batch running, not closed): no hand-off to the thread and back. Gives the jobs
    /// back otherwise.
    fn run_here(&self, jobs: Vec<Job>) -> Option<Vec<Job>> {
        if self.queued.load(Ordering::Acquire) != 0 {
            return Some(jobs);
        }
        // The thread looking at the state between two messages holds it for a moment: worth a
        // short wait. Work of its own (or another caller's write) is not.
        let mut spins = 0;
        let mut state = loop {
            match self.state.try_lock() {
                Ok(state) => break state,
                Err(TryLockError::Poisoned(p)) => break p.into_inner(),
                Err(TryLockError::WouldBlock)
                    if spins < SPINS && !self.busy.load(Ordering::Acquire) =>
                {
                    spins += 1;
                    std::hint::spin_loop();
                }
                Err(TryLockError::WouldBlock) => return Some(jobs),
            }
        };
        // A commit that syncs (a failed sync to make good, or deferred commits past their delay)
        // is the thread's: an `fsync` does not run on a caller's thread.
        if !state.pending.is_empty() || state.conn.is_none() || state.sync_now() {
            return Some(jobs);
        }
        let armed = state.unsynced.is_some();
        let answers = state.run_batch(jobs);
        // Operations a failed first operation sent back are the thread's to run.
        let wake = (!armed && state.unsynced.is_some())
            || state.checkpoint_due
            || !state.pending.is_empty();
        drop(state);
        answers.send();
        if wake {
            // The thread waits for the sync now due (it may have stopped: then nothing is due).
            let _ = self.queue.send(Message::Wake);
        }
        None
    }

    /// Finishes the operations queued so far, closes the connection and stops the thread; later
    /// calls fail.
    pub(crate) async fn close(&self) {
        // Writes issued before the close are run before it.
        self.hand_over_gathered();
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
            checkpoints: self.counters.checkpoints.load(Ordering::Relaxed),
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

/// How many times a deferred write tries for the state while the thread holds it for a moment,
/// before it queues instead.
const SPINS: u32 = 1000;

/// The write-ahead log's size, in pages, at which the writer checkpoints it: SQLite's default for
/// its automatic checkpoint.
const CHECKPOINT_PAGES: i32 = 1000;

thread_local! {
    /// The write-ahead log's pages after the last commit on this thread ([`note_wal_pages`]).
    static WAL_PAGES: std::cell::Cell<Option<i32>> = const { std::cell::Cell::new(None) };
}

/// The writer connection's write-ahead log hook (in place of SQLite's automatic checkpoint):
/// notes the log's size for [`State::committed`], read on the same thread once the commit returns.
fn note_wal_pages(_: &rusqlite::hooks::Wal, pages: std::ffi::c_int) -> rusqlite::Result<()> {
    WAL_PAGES.set(Some(pages));
    Ok(())
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
    state: Arc<Mutex<State>>,
    max_batch: usize,
    receiver: mpsc::Receiver<Message>,
    queued: Arc<AtomicUsize>,
    busy: Arc<AtomicBool>,
}

/// What runs batches: the connection and the commits' syncing, used by the writer thread and by
/// deferred writes run on their callers' threads, one at a time.
struct State {
    /// `None` once closed.
    conn: Option<Shared>,
    location: Location,
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
    /// Under [`Syncing::Deferred`]: the write-ahead log has reached [`CHECKPOINT_PAGES`]; the
    /// thread checkpoints it.
    checkpoint_due: bool,
}

impl Task {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs a checkpoint a commit made due.
    fn checkpoint_if_due(&self) {
        let mut state = self.state();
        if state.checkpoint_due {
            self.busy.store(true, Ordering::Release);
            state.checkpoint();
            drop(state);
            self.busy.store(false, Ordering::Release);
        }
    }

    /// An operation taken from the queue.
    fn taken(&self, job: Job) -> Job {
        self.queued.fetch_sub(1, Ordering::AcqRel);
        job
    }

    fn serve(self) {
        let mut closing = None;
        loop {
            self.checkpoint_if_due();
            let (idle, due) = {
                let state = self.state();
                (state.pending.is_empty(), state.sync_due())
            };
            if idle {
                let received = match due {
                    Some(due) => match self
                        .receiver
                        .recv_timeout(due.saturating_duration_since(Instant::now()))
                    {
                        Ok(message) => Ok(message),
                        Err(RecvTimeoutError::Timeout) => {
                            self.busy.store(true, Ordering::Release);
                            self.state().sync();
                            self.busy.store(false, Ordering::Release);
                            continue;
                        }
                        Err(RecvTimeoutError::Disconnected) => Err(()),
                    },
                    None => self.receiver.recv().map_err(|_| ()),
                };
                match received {
                    Ok(Message::Run(job)) => {
                        let job = self.taken(job);
                        self.state().pending.push_back(job);
                    }
                    Ok(Message::Wake) => continue,
                    Ok(Message::Close(done)) => {
                        closing = Some(done);
                        break;
                    }
                    Err(()) => break,
                }
            }
            self.busy.store(true, Ordering::Release);
            let mut state = self.state();
            let mut batch: Vec<Job> = Vec::new();
            while batch.len() < self.max_batch {
                if let Some(job) = state.pending.pop_front() {
                    batch.push(job);
                    continue;
                }
                match self.receiver.try_recv() {
                    Ok(Message::Run(job)) => batch.push(self.taken(job)),
                    Ok(Message::Wake) => {}
                    Ok(Message::Close(done)) => {
                        closing = Some(done);
                        break;
                    }
                    Err(_) => break,
                }
            }
            let answers = state.run_batch(batch);
            if closing.is_some() {
                answers.send();
                // Operations requeued by a broken last batch still run before stopping.
                while !state.pending.is_empty() {
                    let batch: Vec<Job> = state.pending.drain(..).collect();
                    state.run_batch(batch).send();
                }
                break;
            }
            drop(state);
            self.busy.store(false, Ordering::Release);
            answers.send();
        }
        let mut state = self.state();
        // Deferred commits are on the disk before the stores say they are closed.
        state.sync();
        // The connection closes before the acknowledgement: whoever waits for the close (to
        // release the directory's lock) never meets the file still being closed.
        drop(state.conn.take());
        drop(state);
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
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("location", &self.location)
            .field("pending", &self.pending.len())
            .field("unsynced", &self.unsynced)
            .finish_non_exhaustive()
    }
}

impl State {
    /// Runs `batch` in one transaction and answers each operation once it is committed.
    ///
    /// The transaction is begun, committed and rolled back with plain statements: SQLite rolls a
    /// transaction back by itself on some errors (a full disk, an I/O error, an interrupted
    /// statement), and a `ROLLBACK` statement is harmless when nothing is open.
    ///
    /// The callers are answered by the returned [`Answers`], sent once the state is unlocked: a
    /// caller woken by its answer then finds the writer free.
    fn run_batch(&mut self, batch: Vec<Job>) -> Answers {
        if batch.is_empty() {
            return Answers::NONE;
        }
        // A database that has shown damage is not written to again.
        if let Some(damage) = self.location.damage() {
            answer_all(batch, &damage);
            return Answers::NONE;
        }
        let Some(shared) = self.conn.clone() else {
            return Answers::NONE;
        };
        let conn = lock(&shared);
        if !conn.is_autocommit() {
            // A transaction left open (an operation that panicked) is ended first.
            rollback(&conn);
        }
        self.run_batch_on(&conn, batch)
    }

    /// [`run_batch`](Self::run_batch) on `conn`.
    fn run_batch_on(&mut self, conn: &Connection, mut batch: Vec<Job>) -> Answers {
        let location = self.location.clone();
        let fail = |doing: &str, e| db_error(&location, doing, e);
        let syncs = match self.choose_sync(conn, &batch) {
            Ok(syncs) => syncs,
            Err(e) => {
                answer_all(batch, &fail("setting the commit's synchronous mode", e));
                return Answers::NONE;
            }
        };
        let changes = conn.total_changes();
        if let Err(e) = control(conn, "BEGIN IMMEDIATE") {
            // A transaction left open is ended, so the next batch can begin; this one fails.
            rollback(conn);
            answer_all(batch, &fail("starting a transaction", e));
            return Answers::NONE;
        }
        let mut answers: Vec<Answer> = Vec::with_capacity(batch.len());
        if batch.len() == 1 {
            let Some(job) = batch.pop() else {
                return Answers::NONE;
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
            return Answers {
                answers: vec![answer],
                outcome,
            };
        }
        let mut jobs = batch.into_iter();
        let mut broken = None;
        let mut unrun = None;
        let mut all_ok = true;
        // The first operation needs no savepoint: nothing ran before it, so if it fails the
        // transaction is rolled back whole and the others run in the next batch.
        if let Some(first) = jobs.next() {
            let (ok, answer) = first.run(conn);
            if !ok || self.location.damage().is_some() {
                let rest: Vec<Job> = jobs.collect();
                rollback(conn);
                // Run, though nothing of it was committed.
                self.counters.operations.fetch_add(1, Ordering::Relaxed);
                if let Some(damage) = self.location.damage() {
                    // Refused at once by the next batch.
                    for job in rest.into_iter().rev() {
                        self.pending.push_front(job);
                    }
                    return Answers {
                        answers: vec![answer],
                        outcome: Err(damage),
                    };
                }
                for job in rest.into_iter().rev() {
                    self.pending.push_front(job);
                }
                // Its own error is its answer.
                return Answers {
                    answers: vec![answer],
                    outcome: Ok(()),
                };
            }
            answers.push(answer);
        }
        for job in jobs.by_ref() {
            if !job.guarded() {
                // Every statement of it a whole change: what it wrote before failing may stay.
                let (ok, answer) = job.run(conn);
                all_ok &= ok;
                answers.push(answer);
                if let Some(damage) = self.location.damage() {
                    broken = Some(damage);
                    break;
                }
                continue;
            }
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
        Answers { answers, outcome }
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
        if WAL_PAGES
            .take()
            .is_some_and(|pages| pages >= CHECKPOINT_PAGES)
        {
            self.checkpoint_due = true;
        }
    }

    /// Whether the next commit must sync (`FULL`) whatever it carries: a delayed sync failed, or
    /// deferred commits have waited their delay.
    fn sync_now(&self) -> bool {
        matches!(self.syncing, Syncing::Deferred { .. })
            && (self.sync_failed || self.sync_due().is_some_and(|due| due <= Instant::now()))
    }

    /// Copies the write-ahead log into the database as far as no reader holds it back (a passive
    /// checkpoint: SQLite syncs the log first, then the database), so that the log starts over.
    /// A failure is logged; the next commit past [`CHECKPOINT_PAGES`] tries again.
    fn checkpoint(&mut self) {
        self.checkpoint_due = false;
        let Some(shared) = self.conn.clone() else {
            return;
        };
        let conn = lock(&shared);
        match conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
            Ok(()) => {
                self.counters.checkpoints.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => tracing::warn!(location = %self.location, "checkpoint failed: {e}"),
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
            Syncing::Deferred { .. } => self.sync_now() || batch.iter().any(|job| job.immediate()),
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

/// The answers of a batch's callers and the batch's fate, to send once the writer's state is
/// unlocked.
#[must_use = "the batch's callers wait for their answers"]
struct Answers {
    answers: Vec<Answer>,
    outcome: Result<(), StoreError>,
}

impl Answers {
    /// Nothing to answer (the callers were answered, or their answers dropped, already).
    const NONE: Answers = Answers {
        answers: Vec::new(),
        outcome: Ok(()),
    };

    fn send(self) {
        for answer in self.answers {
            answer(self.outcome.as_ref().map(|_| ()));
        }
    }
}

/// `jobs` in batches of at most `max` (at least one), in order.
fn chunks(mut jobs: Vec<Job>, max: usize) -> Vec<Vec<Job>> {
    let mut batches = Vec::with_capacity(jobs.len().div_ceil(max.max(1)));
    while jobs.len() > max.max(1) {
        let rest = jobs.split_off(max.max(1));
        batches.push(std::mem::replace(&mut jobs, rest));
    }
    batches.push(jobs);
    batches
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

    /// The organization layout's instance database at `dir`, with deferred syncing (the
    /// defaults) after `delay`.
    async fn deferred_db(dir: &std::path::Path, delay: Duration) -> Db {
        let options = SqliteOptions::default().sync_delay(delay);
        Db::open(Some(&dir.join("instance.db")), DbKind::Instance, &options)
            .await
            .unwrap()
    }

    /// The thread a write ran on.
    async fn writer_of(writes: &Writer, scope: Durability) -> std::thread::ThreadId {
        durability::scope(
            scope,
            writes.run(|_| Ok::<_, StoreError>(std::thread::current().id())),
        )
        .await
        .unwrap()
    }

    /// Under deferred syncing, a deferred write finding the writer idle runs on its caller's
    /// thread (no hand-off to the writer thread and back), committed and synced later as any
    /// deferred write; an immediate write, and a deferred one while the writer is busy, run on
    /// the writer thread.
    #[tokio::test]
    async fn a_deferred_write_runs_on_its_callers_thread_when_the_writer_is_idle() {
        let dir = tempfile::tempdir().unwrap();
        let db = deferred_db(dir.path(), Duration::from_millis(20)).await;
        let here = std::thread::current().id();
        let writer = writer_of(&db.writes, Durability::Immediate).await;
        assert_ne!(writer, here);
        // Not issued `together`, a deferred write does not wait for company: it is done at its
        // first poll (here on this thread, or sent to the thread and not answered yet).
        let mut lone = Box::pin(durability::scope(
            Durability::Deferred,
            db.writes
                .run(|_| Ok::<_, StoreError>(std::thread::current().id())),
        ));
        if let std::task::Poll::Ready(ran_on) = futures::poll!(lone.as_mut()) {
            assert_eq!(ran_on.unwrap(), here);
        } else {
            assert_ne!(lone.await.unwrap(), here, "pending, yet it ran here");
        }
        let before = db.writes.stats();
        // On a loaded machine the thread may be descheduled while it looks at the state between
        // two messages: the write then queues. One of a few finds the writer idle.
        let mut tries = 1;
        while writer_of(&db.writes, Durability::Deferred).await != here {
            assert!(tries < 20, "no deferred write ran on its caller's thread");
            tries += 1;
        }
        let written = db.writes.stats();
        assert_eq!(written.commits, before.commits + tries, "{written:?}");
        assert!(written.synced < written.commits, "{written:?}");
        // Its sync, due 20 ms later, is the writer thread's.
        let deadline = Instant::now() + Duration::from_secs(10);
        while db.writes.stats().synced < written.commits {
            assert!(
                Instant::now() < deadline,
                "never synced: {:?}",
                db.writes.stats()
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(db.writes.stats().syncs, written.syncs + 1);
        // Busy: the deferred write waits for the thread like any other.
        let (hold, holder) = hold_writer(&db).await;
        let (ran_on, ()) = tokio::join!(writer_of(&db.writes, Durability::Deferred), async move {
            drop(hold)
        });
        holder.await.unwrap().unwrap();
        assert_eq!(ran_on, writer);
        db.close().await;
        // Closed: refused, not run here.
        let refused = durability::scope(
            Durability::Deferred,
            db.writes.run(|_| Ok::<_, StoreError>(())),
        )
        .await;
        assert!(refused.is_err(), "{refused:?}");
    }

    /// Deferred writes sent together (a `join` marked `together`) while the writer is idle share
    /// one commit on the caller's thread, as they would on the writer thread; a leader dropped before it runs
    /// the batch hands it to the thread, so the others are still answered.
    #[tokio::test]
    async fn deferred_writes_sent_together_share_one_commit_on_the_callers_thread() {
        let dir = tempfile::tempdir().unwrap();
        let db = deferred_db(dir.path(), Duration::from_secs(3600)).await;
        let here = std::thread::current().id();
        let writer = writer_of(&db.writes, Durability::Immediate).await;
        let before = db.writes.stats();
        let (a, b, c) = durability::together(async {
            tokio::join!(
                writer_of(&db.writes, Durability::Deferred),
                writer_of(&db.writes, Durability::Deferred),
                writer_of(&db.writes, Durability::Deferred),
            )
        })
        .await;
        let after = db.writes.stats();
        // On a loaded machine the thread may hold the state a moment too long: then all three
        // went to it, still together.
        assert!(
            a == b && b == c && (a == here || a == writer),
            "{a:?} {b:?} {c:?}"
        );
        assert_eq!(
            (
                after.commits - before.commits,
                after.operations - before.operations
            ),
            (1, 3),
            "{after:?}"
        );
        // The leader (the first write) dropped while it gathers: the second is answered anyway.
        let mut leader = Box::pin(durability::together(writer_of(
            &db.writes,
            Durability::Deferred,
        )));
        let polled = futures::poll!(leader.as_mut());
        assert!(polled.is_pending());
        let mut follower = Box::pin(writer_of(&db.writes, Durability::Deferred));
        let polled = futures::poll!(follower.as_mut());
        assert!(polled.is_pending());
        drop(leader);
        let ran_on = tokio::time::timeout(Duration::from_secs(10), follower)
            .await
            .expect("the follower of a dropped leader was never answered");
        assert_eq!(ran_on, writer);
        db.close().await;
    }

    /// A deferred write of another task, issued while a leader gathers, joins its commit (group
    /// commit across tasks on the caller's thread).
    #[tokio::test]
    async fn a_write_of_another_task_joins_a_gathering_leader() {
        let dir = tempfile::tempdir().unwrap();
        let db = deferred_db(dir.path(), Duration::from_secs(3600)).await;
        let here = std::thread::current().id();
        let before = db.writes.stats();
        let mut leader = Box::pin(durability::together(writer_of(
            &db.writes,
            Durability::Deferred,
        )));
        assert!(futures::poll!(leader.as_mut()).is_pending());
        let writes = db.writes.clone();
        let other = tokio::spawn(async move { writer_of(&writes, Durability::Deferred).await });
        // The leader's task lets the others run before it goes on, as its yield does.
        tokio::task::yield_now().await;
        let (led, joined) = tokio::join!(leader, other);
        // One commit, on this thread (the test's runtime has one): not handed to the writer.
        assert_eq!((led, joined.unwrap()), (here, here));
        let after = db.writes.stats();
        assert_eq!(
            (
                after.commits - before.commits,
                after.operations - before.operations
            ),
            (1, 2),
            "{after:?}"
        );
        db.close().await;
    }

    /// A write that goes to the thread (here an immediate one) does not overtake deferred writes
    /// issued before it and still gathering: the thread runs them first, in order.
    #[tokio::test]
    async fn a_write_sent_to_the_thread_does_not_overtake_the_writes_gathered_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let db = deferred_db(dir.path(), Duration::from_secs(3600)).await;
        let deferred = durability::together(durability::scope(
            Durability::Deferred,
            insert_key(&db.writes, "deferred first", false),
        ));
        let immediate = db.writes.run(|conn| {
            insert(conn, "immediate second")?;
            conn.query_row(
                "SELECT count(*) FROM applied_keys WHERE key = 'deferred first'",
                [],
                |row| row.get::<_, i64>(0),
            )
            .map_err(|e| db_error("test", "reading", e))
        });
        let (first, seen) = tokio::join!(deferred, immediate);
        first.unwrap();
        assert_eq!(
            seen.unwrap(),
            1,
            "the immediate write ran before the deferred one"
        );
        assert_eq!(keys(&db).await, ["deferred first", "immediate second"]);
        // Closing runs what is gathered first as well.
        let mut late = Box::pin(durability::together(durability::scope(
            Durability::Deferred,
            insert_key(&db.writes, "late", false),
        )));
        assert!(futures::poll!(late.as_mut()).is_pending());
        db.close().await;
        late.await.unwrap();
    }

    /// Commits made on callers' threads do not run SQLite's automatic checkpoint there: once the
    /// log reaches its size, the writer thread checkpoints it, and the log starts over instead
    /// of growing with every write.
    #[tokio::test]
    async fn the_writer_thread_checkpoints_the_log_of_commits_made_elsewhere() {
        let dir = tempfile::tempdir().unwrap();
        let db = deferred_db(dir.path(), Duration::from_secs(3600)).await;
        let wal = crate::db::wal_path(&dir.path().join("instance.db"));
        let here = std::thread::current().id();
        let before = db.writes.stats();
        let mut here_too = 0;
        // 64 KiB a write, 24 MiB in all: six times the log's checkpoint size.
        for i in 0..384 {
            let key = format!("{i:04}{}", "x".repeat(64 * 1024));
            let ran_on = durability::scope(
                Durability::Deferred,
                db.writes.run(move |conn| {
                    insert(conn, &key)?;
                    Ok(std::thread::current().id())
                }),
            )
            .await
            .unwrap();
            here_too += usize::from(ran_on == here);
        }
        assert!(here_too > 0, "no write ran on the caller's thread");
        let after = db.writes.stats();
        assert!(after.checkpoints > before.checkpoints, "{after:?}");
        let size = std::fs::metadata(&wal).unwrap().len();
        assert!(size < 12 * 1024 * 1024, "the log grew to {size} bytes");
        db.close().await;
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

    /// The keys the writer's connection reads, when the writer lets it.
    fn keys_on_writer(writes: &Writer) -> Option<Vec<String>> {
        let read = |conn: &Connection| {
            let mut statement = conn
                .prepare("SELECT key FROM applied_keys ORDER BY key")
                .map_err(|e| db_error("test", "reading", e))?;
            statement
                .query_map([], |row| row.get(0))
                .and_then(Iterator::collect)
                .map_err(|e| db_error("test", "reading", e))
        };
        writes
            .read_if_idle("reading keys", read)
            .ok()
            .map(Result::unwrap)
    }

    /// [`keys_on_writer`] once the writer is idle (the thread takes its state a moment to arm
    /// or run a delayed sync), within 10 s.
    async fn keys_when_idle(writes: &Writer) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(keys) = keys_on_writer(writes) {
                return keys;
            }
            assert!(Instant::now() < deadline, "the writer was never idle");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Under deferred syncing a short read runs on the writer's connection when the writer is
    /// idle, and sees every commit; not while a batch runs, nor while the writer thread holds
    /// its state; a read that leaves a transaction open has it rolled back, so the next write
    /// begins its own.
    #[tokio::test]
    async fn a_short_read_runs_on_the_idle_writers_connection() {
        let dir = tempfile::tempdir().unwrap();
        let db = deferred_db(dir.path(), Duration::from_millis(20)).await;
        durability::scope(Durability::Deferred, insert_key(&db.writes, "k1", false))
            .await
            .unwrap();
        assert_eq!(keys_when_idle(&db.writes).await, vec!["k1".to_string()]);

        // A batch running on the thread: the read goes elsewhere.
        let (hold, holder) = hold_writer(&db).await;
        assert_eq!(keys_on_writer(&db.writes), None);
        drop(hold);
        holder.await.unwrap().unwrap();

        // A read that opens a transaction and returns with it open.
        let deadline = Instant::now() + Duration::from_secs(10);
        let open_one = |conn: &Connection| {
            conn.execute_batch("BEGIN; SELECT count(*) FROM applied_keys;")
                .map_err(|e| db_error("test", "reading", e))
        };
        while db
            .writes
            .read_if_idle("leaving a transaction open", open_one)
            .is_err()
        {
            assert!(Instant::now() < deadline, "the writer was never idle");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // Rolled back: the next read finds no transaction open (it would see an old snapshot).
        assert_eq!(keys_when_idle(&db.writes).await, vec!["k1".to_string()]);
        durability::scope(Durability::Deferred, insert_key(&db.writes, "k2", false))
            .await
            .unwrap();
        assert_eq!(
            keys_when_idle(&db.writes).await,
            vec!["k1".to_string(), "k2".to_string()]
        );
        assert_eq!(keys(&db).await, vec!["k1".to_string(), "k2".to_string()]);
        db.close().await;
        assert_eq!(keys_on_writer(&db.writes), None, "closed");
    }

    /// Without deferred syncing (every commit synced on the thread) reads keep to the readers.
    #[tokio::test]
    async fn a_short_read_keeps_to_the_readers_when_every_commit_syncs() {
        let dir = tempfile::tempdir().unwrap();
        let db = deferred_db(dir.path(), Duration::ZERO).await;
        insert_key(&db.writes, "k1", false).await.unwrap();
        assert_eq!(keys_on_writer(&db.writes), None);
        assert_eq!(keys(&db).await, vec!["k1".to_string()]);
        db.close().await;
    }
}
