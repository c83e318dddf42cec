//! How the backend opens its files and commits.

use std::path::Path;
use std::time::Duration;

use redb::WriteTransaction;

use crate::file::Failure;

/// How a commit reaches the disk. Every mode keeps the crash guarantees: a caller is answered
/// only after the commit holding its operation has been made durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Durability {
    /// One `fsync` per commit; after a crash redb picks the newest commit slot whose checksum holds
    /// and repairs the allocator state by walking the file (the default).
    #[default]
    Immediate,
    /// Two `fsync`s per commit (redb's two-phase commit) with quick repair: slower commits, a
    /// recovery that does not walk the file, and no reliance on checksums to pick the commit slot.
    TwoPhase,
}

impl Durability {
    pub(crate) fn apply(self, tx: &mut WriteTransaction, path: &Path) -> Result<(), Failure> {
        tx.set_durability(redb::Durability::Immediate)
            .map_err(|e| Failure::from_redb(path, "set durability", e.into()))?;
        if self == Self::TwoPhase {
            tx.set_two_phase_commit(true);
            tx.set_quick_repair(true);
        }
        Ok(())
    }
}

/// Options of [`open_with`](crate::open_with).
///
/// ```
/// use std::time::Duration;
/// use spacebot_redb::{Durability, RedbOptions};
/// let options = RedbOptions::default()
///     .durability(Durability::TwoPhase)
///     .group_commit(512, Duration::from_micros(200));
/// assert_eq!(options.max_batch, 512);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedbOptions {
    /// How commits reach the disk.
    pub durability: Durability,
    /// Most operations committed together by one durable commit (group commit). Operations that
    /// queue up while a commit is in progress share the next one; `1` commits every operation on its
    /// own. Default 256.
    pub max_batch: usize,
    /// How long a batch waits for more operations after the first one (default zero: a batch takes
    /// only what is already queued, so a lone operation is never delayed).
    pub max_wait: Duration,
    /// redb's page cache per file, in bytes (default 16 MiB).
    pub cache_size: usize,
    /// Verify every page checksum when a file is opened (default `true`), so that a file damaged
    /// outside redb is refused with [`StoreError::Corrupt`](spacebot_core::StoreError::Corrupt)
    /// instead of being trusted. Costs a read of the whole file at open.
    pub verify_on_open: bool,
    /// After an I/O error (a full disk, a failed `fsync`) redb refuses every later operation on
    /// the open file; the next operation closes and reopens it, retrying with backoff for up to
    /// this long before it fails (default 2 s). The operation that met the error fails, and so
    /// does every operation committed with it: nothing is acknowledged that was not stored.
    pub io_retry: Duration,
}

impl Default for RedbOptions {
    fn default() -> Self {
        Self {
            durability: Durability::Immediate,
            max_batch: 256,
            max_wait: Duration::ZERO,
            cache_size: 16 * 1024 * 1024,
            verify_on_open: true,
            io_retry: Duration::from_secs(2),
        }
    }
}

impl RedbOptions {
    /// Sets the durability mode.
    pub fn durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// Commits up to `max_batch` operations together, waiting up to `max_wait` for a batch to fill.
    pub fn group_commit(mut self, max_batch: usize, max_wait: Duration) -> Self {
        self.max_batch = max_batch.max(1);
        self.max_wait = max_wait;
        self
    }

    /// One durable commit per operation.
    pub fn commit_each(mut self) -> Self {
        self.max_batch = 1;
        self.max_wait = Duration::ZERO;
        self
    }

    /// Sets redb's page cache size per file.
    pub fn cache_size(mut self, bytes: usize) -> Self {
        self.cache_size = bytes;
        self
    }

    /// How long an operation retries reopening the file after an I/O error before it fails.
    pub fn io_retry(mut self, wait: Duration) -> Self {
        self.io_retry = wait;
        self
    }

    /// Turns the checksum verification at open on or off.
    pub fn verify_on_open(mut self, verify: bool) -> Self {
        self.verify_on_open = verify;
        self
    }
}
