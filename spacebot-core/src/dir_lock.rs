//! One owner per data directory, for store backends that keep their files in one (SQLite, redb):
//! an exclusive lock on `{dir}/spacebot.lock`, held for as long as the stores are open, with the
//! holder's process id written inside for the error message of the next opener.
//!
//! Closing a backend's files can finish after its last handle is dropped (a database connection
//! closes on its own thread, a file's worker thread ends on its own). So that a directory can be
//! opened again right after the last handle of this process was dropped, a backend marks its lock
//! *releasing* when it starts closing ([`DirLock::begin_release`]) and keeps the lock until every
//! file is closed; an opener in this process that finds the directory locked by a release in
//! progress waits for it ([`release_in_progress`], [`Release::wait`],
//! [`Release::wait_blocking`]) instead of failing. A directory held by a live handle, or by
//! another process, is refused at once, naming the holder.
//!
//! ```
//! use spacebot_core::dir_lock::{DirLock, release_in_progress};
//! let dir = tempfile::tempdir().unwrap();
//! let lock = DirLock::acquire(dir.path(), "example").unwrap();
//! // A second handle of the same directory is refused, naming this process.
//! let err = DirLock::acquire(dir.path(), "example").unwrap_err();
//! assert!(err.to_string().contains("this process"), "{err}");
//! assert!(release_in_progress(dir.path()).is_none());
//! // Once released, the directory opens again.
//! drop(lock);
//! let _again = DirLock::acquire(dir.path(), "example").unwrap();
//! ```

use std::collections::HashMap;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use futures::channel::oneshot;

use crate::error::StoreError;

/// The lock file's name under the data directory.
pub const LOCK_FILE: &str = "spacebot.lock";

/// How long [`DirLock::acquire`] waits for a lock that names this process but that no handle of
/// this process holds: a descriptor copy in a child process about to exec.
const INHERITED_WAIT: Duration = Duration::from_secs(2);

/// What this process knows of a directory it locked.
#[derive(Debug)]
struct Entry {
    state: Mutex<State>,
    released: Condvar,
}

#[derive(Debug, Default)]
struct State {
    /// A release started ([`DirLock::begin_release`]).
    releasing: bool,
    /// The lock is released.
    done: bool,
    /// Async openers waiting for the release.
    waiters: Vec<oneshot::Sender<()>>,
}

impl Entry {
    fn state(&self) -> MutexGuard<'_, State> {
        // Plain flags and senders: a panic elsewhere cannot leave them half-updated.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The directories this process holds, by canonical path.
fn registry() -> MutexGuard<'static, HashMap<PathBuf, Weak<Entry>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<PathBuf, Weak<Entry>>>> = OnceLock::new();
    REGISTRY
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

fn key(dir: &Path) -> PathBuf {
    std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf())
}

/// The held lock of one data directory; dropping it releases the lock.
#[derive(Debug)]
pub struct DirLock {
    file: Option<File>,
    key: PathBuf,
    entry: Arc<Entry>,
}

impl DirLock {
    /// Takes the lock of `dir` (creating the directory and the lock file if needed), or fails at
    /// once with [`StoreError::Backend`] (of `backend`) naming the directory and its holder: this
    /// process (another open handle, or a release in progress: see [`release_in_progress`]) or
    /// another process by its pid.
    pub fn acquire(dir: &Path, backend: &'static str) -> Result<Self, StoreError> {
        let path = dir.join(LOCK_FILE);
        let io = |doing: &str, e: std::io::Error| {
            StoreError::backend(
                backend,
                format!(
                    "{doing} the lock file {} of data directory {}: {e}",
                    path.display(),
                    dir.display()
                ),
                e,
            )
        };
        std::fs::create_dir_all(dir).map_err(|e| {
            StoreError::backend(
                backend,
                format!("creating data directory {}: {e}", dir.display()),
                e,
            )
        })?;
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| io("opening", e))?;
        let key = key(dir);
        // A lock this process released can stay held for a moment by a copy of its descriptor in
        // a child being spawned by another thread (between fork and exec, where close-on-exec
        // descriptors are closed): such a holder is waited for, not reported.
        let inherited_deadline = Instant::now() + INHERITED_WAIT;
        loop {
            match file.try_lock() {
                Ok(()) => break,
                Err(TryLockError::WouldBlock) => {
                    let here = registry()
                        .get(&key)
                        .and_then(Weak::upgrade)
                        .map(|e| e.state().releasing);
                    let holder = match here {
                        Some(releasing) => Holder::Here { releasing },
                        None => holder(&mut file),
                    };
                    let inherited =
                        here.is_none() && matches!(holder, Holder::Here { releasing: false });
                    if inherited && Instant::now() < inherited_deadline {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                    return Err(in_use(backend, dir, &path, holder));
                }
                Err(TryLockError::Error(e)) => return Err(io("locking", e)),
            }
        }
        let pid = format!("{}\n", std::process::id());
        file.set_len(0).map_err(|e| io("writing", e))?;
        file.seek(SeekFrom::Start(0))
            .and_then(|_| file.write_all(pid.as_bytes()))
            .and_then(|()| file.flush())
            .map_err(|e| io("writing", e))?;
        let entry = Arc::new(Entry {
            state: Mutex::default(),
            released: Condvar::new(),
        });
        registry().insert(key.clone(), Arc::downgrade(&entry));
        Ok(Self {
            file: Some(file),
            key,
            entry,
        })
    }

    /// Says that the backend started closing its files and drops the lock once they are closed:
    /// an opener of the same directory in this process waits for the release instead of failing.
    pub fn begin_release(&self) {
        self.entry.state().releasing = true;
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // Unlocked first: a waiter woken below finds the directory free.
        drop(self.file.take());
        {
            let mut registry = registry();
            if registry
                .get(&self.key)
                .is_some_and(|w| w.as_ptr() == Arc::as_ptr(&self.entry))
            {
                registry.remove(&self.key);
            }
        }
        let waiters = {
            let mut state = self.entry.state();
            state.done = true;
            std::mem::take(&mut state.waiters)
        };
        self.entry.released.notify_all();
        for w in waiters {
            let _ = w.send(());
        }
    }
}

/// A release of a directory's lock in progress in this process (see the module's documentation).
#[derive(Debug)]
pub struct Release {
    entry: Arc<Entry>,
}

/// The release in progress of `dir`'s lock in this process, if its holder started one
/// ([`DirLock::begin_release`]); `None` when the directory is free, held by a live handle, or held
/// by another process.
pub fn release_in_progress(dir: &Path) -> Option<Release> {
    let entry = registry().get(&key(dir)).and_then(Weak::upgrade)?;
    let releasing = {
        let state = entry.state();
        state.releasing && !state.done
    };
    releasing.then_some(Release { entry })
}

impl Release {
    /// Resolves once the lock is released. Wrap it in the runtime's timeout: a backend whose
    /// files never close never releases its lock.
    pub async fn wait(self) {
        let receiver = {
            let mut state = self.entry.state();
            if state.done {
                return;
            }
            let (tx, rx) = oneshot::channel();
            state.waiters.push(tx);
            rx
        };
        let _ = receiver.await;
    }

    /// Blocks the calling thread until the lock is released or `timeout` passed; whether it was
    /// released.
    pub fn wait_blocking(self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut state = self.entry.state();
        while !state.done {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            state = self
                .entry
                .released
                .wait_timeout(state, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }
}

/// Who holds a directory's lock.
enum Holder {
    /// This process: another open handle, or one being released.
    Here { releasing: bool },
    /// Another process, by the pid in the lock file.
    Process(u32),
    /// The lock file names no process yet (its holder is writing it).
    Unknown,
}

/// The process id written in a held lock file. A holder writes it right after taking the lock:
/// an opener that comes in between reads again for a moment before saying it does not know.
fn holder(file: &mut File) -> Holder {
    let deadline = Instant::now() + Duration::from_millis(250);
    loop {
        let mut text = String::new();
        let read = file
            .seek(SeekFrom::Start(0))
            .and_then(|_| file.read_to_string(&mut text));
        if read.is_ok()
            && let Ok(pid) = text.trim().parse::<u32>()
        {
            return if pid == std::process::id() {
                Holder::Here { releasing: false }
            } else {
                Holder::Process(pid)
            };
        }
        if Instant::now() >= deadline {
            return Holder::Unknown;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn in_use(backend: &'static str, dir: &Path, path: &Path, holder: Holder) -> StoreError {
    let pid = std::process::id();
    let who = match holder {
        Holder::Here { releasing: true } => format!(
            "this process (pid {pid}): a handle dropped or closed a moment ago is still \
             closing its files"
        ),
        Holder::Here { releasing: false } => {
            format!("this process (pid {pid}) through another open handle")
        }
        Holder::Process(pid) => format!("process {pid}"),
        Holder::Unknown => {
            "another process that has just opened it (its pid is not written in the lock file)"
                .to_string()
        }
    };
    StoreError::Backend {
        backend,
        message: format!(
            "data directory {} is already open by {who}: one directory has one owner \
             (lock file {}); close the other handle or stop that process first",
            dir.display(),
            path.display()
        ),
        source: None,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn a_release_in_progress_is_waited_for_and_a_live_handle_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let lock = DirLock::acquire(dir.path(), "test").unwrap();
        assert!(
            release_in_progress(dir.path()).is_none(),
            "live, not releasing"
        );
        lock.begin_release();
        let release = release_in_progress(dir.path()).expect("releasing");
        let e = DirLock::acquire(dir.path(), "test").unwrap_err();
        assert!(e.to_string().contains("still closing"), "{e}");
        let closer = std::thread::spawn(move || drop(lock));
        assert!(release.wait_blocking(Duration::from_secs(10)));
        closer.join().unwrap();
        let again = DirLock::acquire(dir.path(), "test").unwrap();
        assert!(release_in_progress(dir.path()).is_none());
        drop(again);
    }

    #[test]
    fn an_async_waiter_is_woken_by_the_release() {
        let dir = tempfile::tempdir().unwrap();
        let lock = DirLock::acquire(dir.path(), "test").unwrap();
        lock.begin_release();
        let release = release_in_progress(dir.path()).unwrap();
        let closer = std::thread::spawn(move || drop(lock));
        futures::executor::block_on(release.wait());
        closer.join().unwrap();
        DirLock::acquire(dir.path(), "test").unwrap();
    }

    #[test]
    fn an_empty_lock_file_of_a_holder_is_read_again_then_named_unknown() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LOCK_FILE);
        std::fs::write(&path, "").unwrap();
        let mut file = File::open(&path).unwrap();
        assert!(matches!(holder(&mut file), Holder::Unknown));
        std::fs::write(&path, "4242\n").unwrap();
        let mut file = File::open(&path).unwrap();
        assert!(matches!(holder(&mut file), Holder::Process(4242)));
    }

    /// A descriptor of a released lock still open elsewhere in this process (as in a child being
    /// spawned, before its exec closes it): the opener waits for it instead of failing, and still
    /// fails, naming this process, when it is never closed.
    #[test]
    fn an_inherited_descriptor_of_a_released_lock_is_waited_for() {
        let dir = tempfile::tempdir().unwrap();
        drop(DirLock::acquire(dir.path(), "test").unwrap());
        let copy = File::options()
            .read(true)
            .write(true)
            .open(dir.path().join(LOCK_FILE))
            .unwrap();
        copy.try_lock().unwrap();
        let closer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(copy);
        });
        let lock = DirLock::acquire(dir.path(), "test").unwrap();
        closer.join().unwrap();
        drop(lock);

        let copy = File::options()
            .read(true)
            .write(true)
            .open(dir.path().join(LOCK_FILE))
            .unwrap();
        copy.try_lock().unwrap();
        let e = DirLock::acquire(dir.path(), "test").unwrap_err();
        assert!(e.to_string().contains("this process"), "{e}");
        drop(copy);
    }
}
