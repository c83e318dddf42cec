//! The storage under redb: the file itself ([`FileStorage`]), and a copy-on-write view of a file
//! that never writes to it ([`ScratchStorage`]), used to check a file before trusting it.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, ErrorKind, Read, Seek, SeekFrom};
use std::ops::Bound;
use std::path::Path;
use std::sync::atomic::AtomicBool;
#[cfg(test)]
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use redb::backends::FileBackend;
use redb::{BackendError, StorageBackend};

/// A database file: redb's own file backend (with its file locks), plus, in this crate's tests, a
/// switch that makes every write fail as a full disk would.
#[derive(Debug)]
pub(crate) struct FileStorage {
    file: FileBackend,
    fail_writes: Option<Arc<AtomicBool>>,
}

impl FileStorage {
    /// Opens `path` for reading and writing, creating it when `create` is set.
    pub(crate) fn open(path: &Path, create: bool) -> io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .truncate(false)
            .open(path)?;
        let file = FileBackend::new(file).map_err(io::Error::other)?;
        Ok(Self {
            file,
            fail_writes: faults::switch(path),
        })
    }

    fn check(&self) -> io::Result<()> {
        #[cfg(test)]
        if self
            .fail_writes
            .as_ref()
            .is_some_and(|f| f.load(Ordering::SeqCst))
        {
            return Err(io::Error::new(
                ErrorKind::StorageFull,
                "no space left on device (injected)",
            ));
        }
        let _ = &self.fail_writes;
        Ok(())
    }
}

impl StorageBackend for FileStorage {
    fn len(&self) -> Result<u64, io::Error> {
        self.file.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), io::Error> {
        self.file.read(offset, out)
    }

    fn set_len(&self, len: u64) -> Result<(), io::Error> {
        self.check()?;
        self.file.set_len(len)
    }

    fn sync_data(&self) -> Result<(), io::Error> {
        self.check()?;
        self.file.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), io::Error> {
        self.check()?;
        self.file.write(offset, data)
    }

    fn close(&self) -> Result<(), io::Error> {
        self.file.close()
    }

    fn try_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.file.try_lock_range(start, end)
    }

    fn try_lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, BackendError> {
        self.file.try_lock_shared_range(start, end)
    }

    fn lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.file.lock_range(start, end)
    }

    fn lock_shared_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.file.lock_shared_range(start, end)
    }

    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.file.unlock_range(start, end)
    }

    fn query_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.file.query_lock_range(start, end)
    }
}

const CHUNK: u64 = 4096;

/// A view of a file opened read-only: reads see the file, writes (redb's crash recovery, its
/// integrity check) land in memory. The file is never written, whatever redb does to the view.
#[derive(Debug)]
pub(crate) struct ScratchStorage {
    file: Mutex<File>,
    state: Mutex<Scratch>,
}

#[derive(Debug)]
struct Scratch {
    /// The view's length.
    len: u64,
    /// Bytes of the file below this offset are still visible (a shrink hides the rest).
    visible: u64,
    /// Chunks written through the view, by index.
    chunks: HashMap<u64, Vec<u8>>,
}

impl ScratchStorage {
    /// A view of the file at `path`, opened read-only.
    pub(crate) fn open(path: &Path) -> io::Result<Self> {
        let file = File::open(path)?;
        let len = file.metadata()?.len();
        Ok(Self {
            file: Mutex::new(file),
            state: Mutex::new(Scratch {
                len,
                visible: len,
                chunks: HashMap::new(),
            }),
        })
    }

    fn state(&self) -> MutexGuard<'_, Scratch> {
        // Plain data: a panic elsewhere cannot leave it half-updated in a way reads would trust.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Chunk `index` as the view shows it.
    fn chunk(&self, state: &Scratch, index: u64) -> io::Result<Vec<u8>> {
        if let Some(chunk) = state.chunks.get(&index) {
            return Ok(chunk.clone());
        }
        let mut chunk = vec![0u8; CHUNK as usize];
        let start = index * CHUNK;
        if start < state.visible {
            let n =
                usize::try_from((state.visible - start).min(CHUNK)).map_err(io::Error::other)?;
            let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
            file.seek(SeekFrom::Start(start))?;
            file.read_exact(&mut chunk[..n])?;
        }
        Ok(chunk)
    }
}

fn span(offset: u64, len: usize) -> impl Iterator<Item = (u64, usize, usize, usize)> {
    // (chunk index, offset in the chunk, offset in the buffer, length)
    let end = offset + len as u64;
    let mut at = offset;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let index = at / CHUNK;
        let within = (at % CHUNK) as usize;
        let n = ((CHUNK - at % CHUNK).min(end - at)) as usize;
        let item = (index, within, (at - offset) as usize, n);
        at += n as u64;
        Some(item)
    })
}

impl StorageBackend for ScratchStorage {
    fn len(&self) -> Result<u64, io::Error> {
        Ok(self.state().len)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), io::Error> {
        let state = self.state();
        if offset.saturating_add(out.len() as u64) > state.len {
            return Err(io::Error::new(
                ErrorKind::UnexpectedEof,
                "read past the end of the file",
            ));
        }
        for (index, within, at, n) in span(offset, out.len()) {
            let chunk = self.chunk(&state, index)?;
            out[at..at + n].copy_from_slice(&chunk[within..within + n]);
        }
        Ok(())
    }

    fn set_len(&self, len: u64) -> Result<(), io::Error> {
        let mut state = self.state();
        if len < state.len {
            // What is cut off reads as zeros if the view grows again.
            let tail = len % CHUNK;
            let last = len / CHUNK;
            if tail != 0 {
                let mut chunk = self.chunk(&state, last)?;
                chunk[tail as usize..].fill(0);
                state.chunks.insert(last, chunk);
            }
            let first_gone = len.div_ceil(CHUNK);
            state.chunks.retain(|index, _| *index < first_gone);
            state.visible = state.visible.min(len);
        }
        state.len = len;
        Ok(())
    }

    fn sync_data(&self) -> Result<(), io::Error> {
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), io::Error> {
        let mut state = self.state();
        for (index, within, at, n) in span(offset, data.len()) {
            let mut chunk = self.chunk(&state, index)?;
            chunk[within..within + n].copy_from_slice(&data[at..at + n]);
            state.chunks.insert(index, chunk);
        }
        state.len = state.len.max(offset + data.len() as u64);
        Ok(())
    }
}

/// Failure injection for this crate's tests: a switch per file path.
pub(crate) mod faults {
    use std::path::Path;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    #[cfg(test)]
    static SWITCHES: std::sync::Mutex<Vec<(std::path::PathBuf, Arc<AtomicBool>)>> =
        std::sync::Mutex::new(Vec::new());

    /// The switch that makes writes to `path` fail, if a test installed one.
    #[cfg(test)]
    pub(crate) fn switch(path: &Path) -> Option<Arc<AtomicBool>> {
        let switches = SWITCHES.lock().unwrap_or_else(|e| e.into_inner());
        switches
            .iter()
            .find(|(p, _)| p == path)
            .map(|(_, s)| Arc::clone(s))
    }

    /// No failure is injected outside this crate's tests.
    #[cfg(not(test))]
    pub(crate) fn switch(_path: &Path) -> Option<Arc<AtomicBool>> {
        None
    }

    /// Installs (or returns) the switch of `path`; files opened afterwards obey it.
    #[cfg(test)]
    pub(crate) fn install(path: &Path) -> Arc<AtomicBool> {
        if let Some(s) = switch(path) {
            return s;
        }
        let s = Arc::new(AtomicBool::new(false));
        SWITCHES
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((path.to_path_buf(), Arc::clone(&s)));
        s
    }
}
