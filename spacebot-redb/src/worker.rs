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
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::time::Instant;

use futures::channel::oneshot;
use redb::{Database, WriteTransaction};
use spacebot_core::StoreError;

use crate::file::{Failure, FileKind, open_database};
use crate::options::RedbOptions;
use crate::tables::Tables;

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
    pub(crate) fn start(
        path: PathBuf,
        kind: FileKind,
        options: RedbOptions,
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
                        run_loop(db, &thread_path, &options, &rx);
                    }
                    Err(failure) => {
                        // Recorded before the queue goes away: a caller whose operation is
                        // dropped unanswered reports this failure.
                        let _ = thread_failed.set(failure.clone());
                        while let Ok(message) = rx.try_recv() {
                            answer_failed(message, &failure);
                        }
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

fn run_loop(db: Database, path: &Path, options: &RedbOptions, rx: &mpsc::Receiver<Message>) {
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
                drop(db);
                let _ = done.send(());
                return;
            }
        };
        let tx = match begin(&db, path, options) {
            Ok(tx) => tx,
            Err(failure) => {
                run.fail(&failure);
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
            tx.commit()
                .err()
                .map(|e| Failure::from_redb(path, "commit", e.into()))
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
