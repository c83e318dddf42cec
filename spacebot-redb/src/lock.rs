//! One owner per data directory: an exclusive lock on `{dir}/spacebot.lock`, held for as long as
//! the stores are open, with the holder's process id written inside for the error message of the
//! next opener.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use spacebot_core::StoreError;

const BACKEND: &str = "redb";

/// The lock file's name under the data directory.
pub(crate) const LOCK_FILE: &str = "spacebot.lock";

/// The held lock of one data directory; dropping it releases the lock.
#[derive(Debug)]
pub(crate) struct DirLock {
    _file: File,
}

impl DirLock {
    /// Takes the lock of `dir` (creating the directory and the lock file if needed), or fails with
    /// [`StoreError::Backend`] naming the directory and, when it is known, the holder's process id.
    pub(crate) fn acquire(dir: &Path) -> Result<Self, StoreError> {
        let path = dir.join(LOCK_FILE);
        let io = |doing: &str, e: std::io::Error| {
            StoreError::backend(
                BACKEND,
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
                BACKEND,
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
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(in_use(dir, &path, holder(&mut file)));
            }
            Err(TryLockError::Error(e)) => return Err(io("locking", e)),
        }
        let pid = format!("{}\n", std::process::id());
        file.set_len(0).map_err(|e| io("writing", e))?;
        file.seek(SeekFrom::Start(0))
            .and_then(|_| file.write_all(pid.as_bytes()))
            .and_then(|()| file.flush())
            .map_err(|e| io("writing", e))?;
        Ok(Self { _file: file })
    }
}

/// The process id written in a held lock file, if it can be read.
fn holder(file: &mut File) -> Option<u32> {
    let mut text = String::new();
    file.read_to_string(&mut text).ok()?;
    text.trim().parse().ok()
}

fn in_use(dir: &Path, path: &Path, holder: Option<u32>) -> StoreError {
    let who = match holder {
        Some(pid) if pid == std::process::id() => {
            format!("this process (pid {pid}) through another open handle")
        }
        Some(pid) => format!("process {pid}"),
        None => "another process (its pid is not recorded yet)".to_string(),
    };
    StoreError::Backend {
        backend: BACKEND,
        message: format!(
            "data directory {} is already open by {who}: one directory has one owner \
             (lock file {}); close the other handle or stop that process first",
            dir.display(),
            path.display()
        ),
        source: None,
    }
}
