//! One dedicated thread per redb file: it owns the [`Database`], runs every operation on that file
//! inside a write transaction, and commits several queued operations together (group commit).
//!
//! An operation is a closure over the open transaction. It validates first and writes last, so a
//! refused operation (a conflict, an invalid transition) has written nothing and can share a
//! transaction with the others. A storage failure part-way through a write aborts the whole batch and
//! every operation in it fails. Callers are answered only after the batch's commit has returned, so
//! an acknowledged write is as durable as the configured [`Durability`](crate::Durability) makes it.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use futures::channel::oneshot;
use redb::{Database, WriteTransaction};
use spacebot_core::StoreError;

use crate::file::{Failure, FileKind, open_database};
use crate::options::RedbOptions;
use crate::tables::Tables;
use spacebot_core::dir_lock::DirLock;

/// What an operation does to the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// Only reads: a batch of reads alone is aborted instead of committed.
    Read,
    /// May write.
    Write,
}

/// The context an operation runs in.
pub(crate) struct Txn<'a> {
    /// The open write transaction.
    pub(crate) tx: &'a WriteTransaction,
    /// The file, for error messages.
    pub(crate) path: &'a Path,
    /// The tables opened so far in this batch.
    pub(crate) tables: Tables<'a>,
}

type Finish = Box<dyn FnOnce(Option<&Failure>) + Send>;

/// A queued operation.
trait Op: Send {
    /// Runs inside the batch's transaction; returns how to answer the caller once the batch ends,
    /// and whether the transaction may be half-written (then the batch must not commit).
    fn run(self: Box<Self>, txn: &Txn<'_>) -> (Finish, bool);
    /// Answers the caller with a failure without running.
    fn fail(self: Box<Self>, failure: &Failure);
}

struct Call<F, R> {
    f: F,
    reply: oneshot::Sender<Result<R, StoreError>>,
}

impl<F, R> Op for Call<F, R>
where
    R: Send + 'static,
    F: FnOnce(&Txn<'_>) -> Result<R, StoreError> + Send + 'static,
{
    fn run(self: Box<Self>, txn: &Txn<'_>) -> (Finish, bool) {
        let Call { f, reply } = *self;
        let result = f(txn);
        let poisoned = matches!(
            result,
            Err(StoreError::Backend { .. } | StoreError::Corrupt { .. })
        );
        let finish: Finish = Box::new(move |failure| {
            let outcome = match failure {
                Some(failure) if result.is_ok() => Err(failure.to_error()),
                _ => result,
            };
            let _ = reply.send(outcome);
        });
        (finish, poisoned)
    }

    fn fail(self: Box<Self>, failure: &Failure) {
        let _ = self.reply.send(Err(failure.to_error()));
    }
}

type Run = Box<dyn Op>;

enum Message {
    Job { access: Access, run: Run },
    Close(oneshot::Sender<()>),
}

/// A handle to the thread that owns one file.
#[derive(Debug)]
pub(crate) struct Worker {
    path: PathBuf,
    tx: mpsc::Sender<Message>,
    failed: Arc<OnceLock<Failure>>,
}

impl Worker {
    /// Starts the thread for `path`; it opens (or creates) the file before taking any operation,
    /// and hands the outcome of the open to `ready`.
    ///
    /// `keep` (the data directory's lock) is held by the thread until it has closed the file, so
    /// that the directory is released only once no file in it is open.
    pub(crate) fn start(
        path: PathBuf,
        kind: FileKind,
        options: RedbOptions,
        keep: Option<Arc<DirLock>>,
        commits: Arc<AtomicU64>,
        ready: impl FnOnce(Result<(), Failure>) + Send + 'static,
    ) -> Result<Self, StoreError> {
        let (tx, rx) = mpsc::channel();
        let failed = Arc::new(OnceLock::new());
        let thread_failed = Arc::clone(&failed);
        let thread_path = path.clone();
        std::thread::Builder::new()
            .name(format!("spacebot-redb {}", kind.label()))
            .spawn(move || {
                match open_database(&thread_path, &kind, &options) {
                    Ok(db) => {
                        ready(Ok(()));
                        let file = File {
                            db: Ok(db),
                            path: &thread_path,
                            kind: &kind,
                            options: &options,
                            commits: &commits,
                        };
                        run_loop(file, &rx, keep);
                    }
                    Err(failure) => {
                        // Recorded before the queue goes away: a caller whose operation is
                        // dropped unanswered reports this failure.
                        let _ = thread_failed.set(failure.clone());
                        while let Ok(message) = rx.try_recv() {
                            answer_failed(message, &failure);
                        }
                        // The directory is free again by the time the opener hears of the failure.
                        drop(keep);
                        ready(Err(failure));
                    }
                }
            })
            .map_err(|e| {
                StoreError::backend(
                    "redb",
                    format!("cannot start the thread for {}", path.display()),
                    e,
                )
            })?;
        Ok(Self { path, tx, failed })
    }

    /// Whether the file failed to open (the handle is useless then).
    pub(crate) fn failed(&self) -> bool {
        self.failed.get().is_some()
    }

    /// Runs `f` on the file's thread inside a write transaction and returns its result once the
    /// transaction is committed (or aborted, for a batch of reads).
    pub(crate) async fn call<R, F>(&self, access: Access, f: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&Txn<'_>) -> Result<R, StoreError> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let run: Run = Box::new(Call { f, reply });
        self.tx
            .send(Message::Job { access, run })
            .map_err(|_| self.stopped())?;
        answer.await.map_err(|_| self.stopped())?
    }

    /// Asks the thread to finish the queued operations and close the file; resolves when it has.
    pub(crate) async fn close(&self) {
        let (done, closed) = oneshot::channel();
        if self.tx.send(Message::Close(done)).is_ok() {
            let _ = closed.await;
        }
    }

    fn stopped(&self) -> StoreError {
        if let Some(failure) = self.failed.get() {
            return failure.to_error();
        }
        StoreError::Backend {
            backend: "redb",
            message: format!(
                "{}: the store is closed, or the operation failed on its thread",
                self.path.display()
            ),
            source: None,
        }
    }
}

fn answer_failed(message: Message, failure: &Failure) {
    match message {
        Message::Job { run, .. } => run.fail(failure),
        Message::Close(done) => {
            let _ = done.send(());
        }
    }
}

/// The open file of a worker, or why it is not open (an I/O error that the next operation
/// recovers from by reopening the file).
struct File<'a> {
    db: Result<Database, Failure>,
    path: &'a Path,
    kind: &'a FileKind,
    options: &'a RedbOptions,
    /// Counts the transactions committed (the store's [`commits`](crate::RedbStore::commits)).
    commits: &'a AtomicU64,
}

impl File<'_> {
    /// Begins the next batch's transaction. After an I/O error (the previous batch's, or one that
    /// redb reports now) the file is closed and reopened first, retrying with backoff for up to
    /// [`RedbOptions::io_retry`]: redb refuses every operation on a handle whose storage failed.
    fn begin(&mut self) -> Result<WriteTransaction, Failure> {
        if let Ok(db) = &self.db {
            match begin(db, self.path, self.options) {
                Err(failure) if failure.is_io() => self.db = Err(failure),
                other => return other,
            }
        }
        let cause = match &self.db {
            Err(cause) => cause.clone(),
            Ok(_) => {
                return Err(Failure::backend(
                    self.path,
                    "the file is in an unknown state",
                ));
            }
        };
        // Close the failed handle before opening the file again.
        self.db = Err(cause.clone());
        let db = self.reopen(&cause)?;
        let tx = begin(&db, self.path, self.options);
        self.db = Ok(db);
        tx
    }

    fn reopen(&mut self, cause: &Failure) -> Result<Database, Failure> {
        let deadline = Instant::now() + self.options.io_retry;
        let mut delay = Duration::from_millis(5);
        loop {
            match open_database(self.path, self.kind, self.options) {
                Ok(db) => {
                    tracing::info!(file = %self.path.display(), "reopened after an I/O error");
                    return Ok(db);
                }
                Err(failure) => {
                    let now = Instant::now();
                    if now + delay > deadline {
                        let failure = cause.reopen_failed(&failure);
                        tracing::warn!(file = %self.path.display(), error = %failure.to_error(), "reopen failed");
                        return Err(failure);
                    }
                    std::thread::sleep(delay);
                    delay = (delay * 2).min(Duration::from_secs(1));
                }
            }
        }
    }

    /// After a commit failed with an I/O error: close the handle now; the next batch reopens.
    fn failed(&mut self, failure: &Failure) {
        if failure.is_io() {
            self.db = Err(failure.clone());
        }
    }
}

fn run_loop(mut file: File<'_>, rx: &mpsc::Receiver<Message>, keep: Option<Arc<DirLock>>) {
    let path = file.path;
    let options = file.options;
    let max_batch = options.max_batch.max(1);
    let mut pending: Option<Message> = None;
    loop {
        let first = match pending.take() {
            Some(m) => m,
            None => match rx.recv() {
                Ok(m) => m,
                Err(_) => break,
            },
        };
        let (access, run) = match first {
            Message::Job { access, run } => (access, run),
            Message::Close(done) => {
                drop(file);
                drop(keep);
                let _ = done.send(());
                return;
            }
        };
        let tx = match file.begin() {
            Ok(tx) => tx,
            Err(failure) => {
                // Everything queued while the file was being reopened would wait as long again:
                // it fails too. Collected before anyone is answered, so that an operation sent
                // after an answer gets a fresh attempt.
                let mut failed = vec![run];
                while let Ok(message) = rx.try_recv() {
                    match message {
                        Message::Job { run, .. } => failed.push(run),
                        close @ Message::Close(_) => {
                            pending = Some(close);
                            break;
                        }
                    }
                }
                for run in failed {
                    run.fail(&failure);
                }
                continue;
            }
        };
        let started = Instant::now();
        let txn = Txn {
            tx: &tx,
            path,
            tables: Tables::default(),
        };
        let mut finishes: Vec<Finish> = Vec::with_capacity(max_batch.min(256));
        let mut dirty = access == Access::Write;
        let mut poisoned = run_one(run, &txn, &mut finishes);
        let deadline = Instant::now() + options.max_wait;
        while !poisoned && finishes.len() < max_batch {
            let next = match rx.try_recv() {
                Ok(m) => m,
                Err(TryRecvError::Empty) if !options.max_wait.is_zero() => {
                    let now = Instant::now();
                    if now >= deadline {
                        break;
                    }
                    match rx.recv_timeout(deadline - now) {
                        Ok(m) => m,
                        Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => break,
                    }
                }
                Err(_) => break,
            };
            match next {
                Message::Job { access, run } => {
                    dirty |= access == Access::Write;
                    poisoned = run_one(run, &txn, &mut finishes);
                }
                close @ Message::Close(_) => {
                    pending = Some(close);
                    break;
                }
            }
        }
        drop(txn);
        let ran = started.elapsed();
        let outcome = if poisoned {
            let _ = tx.abort();
            Some(Failure::backend(
                path,
                "the operation was rolled back because another operation committed with it failed",
            ))
        } else if dirty {
            let failed = tx.commit().err().map(|e| {
                Failure::from_redb(
                    path,
                    "commit failed, the operations in it were not acknowledged",
                    e.into(),
                )
            });
            match &failed {
                Some(failure) => file.failed(failure),
                None => {
                    file.commits.fetch_add(1, Ordering::Relaxed);
                }
            }
            failed
        } else {
            let _ = tx.abort();
            None
        };
        tracing::trace!(
            file = %path.display(),
            operations = finishes.len(),
            ?ran,
            committed = ?started.elapsed() - ran,
            "batch"
        );
        for finish in finishes {
            finish(outcome.as_ref());
        }
    }
    drop(file);
    drop(keep);
}

/// Runs one operation of a batch; `true` when the batch must not commit. An operation that panics
/// poisons the batch (its caller sees the store as failed) but not the thread.
fn run_one(run: Run, txn: &Txn<'_>, finishes: &mut Vec<Finish>) -> bool {
    match catch_unwind(AssertUnwindSafe(|| run.run(txn))) {
        Ok((finish, poisoned)) => {
            finishes.push(finish);
            poisoned
        }
        Err(_) => true,
    }
}

fn begin(db: &Database, path: &Path, options: &RedbOptions) -> Result<WriteTransaction, Failure> {
    let mut tx = db
        .begin_write()
        .map_err(|e| Failure::from_redb(path, "begin a transaction", e.into()))?;
    options.durability.apply(&mut tx, path)?;
    Ok(tx)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    use futures::executor::block_on;
    use spacebot_core::task::{NewTask, TaskFilter, TaskStore};
    use spacebot_core::{AgentId, StoreError, Timestamp};

    use crate::backend::faults;
    use crate::{RedbOptions, RedbStore};

    fn titles(store: &RedbStore, agent: &AgentId) -> Vec<String> {
        block_on(store.list(agent, &TaskFilter::default()))
            .unwrap()
            .into_iter()
            .map(|t| t.title)
            .collect()
    }

    #[test]
    fn after_an_io_error_the_file_is_reopened_and_nothing_unstored_was_acknowledged() {
        let dir = tempfile::tempdir().unwrap();
        let agent = AgentId::parse("w").unwrap();
        let options = RedbOptions::default().io_retry(Duration::from_millis(100));
        let store = RedbStore::open(dir.path(), options.clone()).unwrap();
        let path = store.agent_path(&agent);
        let disk_full = faults::install(&path);
        let create = |title: &str| {
            block_on(TaskStore::create(
                &*store,
                &agent,
                NewTask::new(title, ""),
                Timestamp(1),
            ))
        };
        assert_eq!(create("stored before").unwrap().number, 1);

        disk_full.store(true, Ordering::SeqCst);
        let err = create("refused").unwrap_err();
        assert!(matches!(err, StoreError::Backend { .. }), "{err:?}");
        let text = err.to_string();
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert!(text.contains("no space left"), "{text}");
        // Still full: the next operation retries reopening, then fails just as clearly.
        let err = create("refused too").unwrap_err();
        let text = err.to_string();
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert!(text.contains("no space left"), "{text}");

        // Space is back: the next operation reopens the file and succeeds; the refused writes
        // are not there.
        disk_full.store(false, Ordering::SeqCst);
        assert_eq!(create("stored after").unwrap().number, 2);
        assert_eq!(titles(&store, &agent), ["stored before", "stored after"]);
        block_on(store.close());

        let store = RedbStore::open(dir.path(), options).unwrap();
        assert_eq!(titles(&store, &agent), ["stored before", "stored after"]);
        block_on(store.close());
    }

    #[test]
    fn an_io_error_on_the_instance_file_is_recovered_from_too() {
        use spacebot_core::link::LinkStore;
        use spacebot_core::{AgentLink, LinkDirection, LinkRelationship};
        let dir = tempfile::tempdir().unwrap();
        let disk_full = faults::install(&dir.path().join(crate::INSTANCE_FILE));
        let store = RedbStore::open(dir.path(), RedbOptions::default()).unwrap();
        let link = |a: &str, b: &str| {
            AgentLink::new(
                AgentId::parse(a).unwrap(),
                AgentId::parse(b).unwrap(),
                LinkDirection::TwoWay,
                LinkRelationship::Peer,
                Timestamp(1),
            )
        };
        block_on(LinkStore::create(&*store, &link("a", "b"))).unwrap();
        disk_full.store(true, Ordering::SeqCst);
        block_on(LinkStore::create(&*store, &link("a", "c"))).unwrap_err();
        disk_full.store(false, Ordering::SeqCst);
        block_on(LinkStore::create(&*store, &link("b", "c"))).unwrap();
        let listed = block_on(LinkStore::list(&*store)).unwrap();
        assert_eq!(listed.len(), 2);
        block_on(store.close());
    }
}
