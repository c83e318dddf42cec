//! Every spacebot store on [redb](https://www.redb.org): a pure-Rust embedded backend.
//!
//! [`open`] returns the [`Stores`] bundle of an organization kept under one directory:
//!
//! ```text
//! {dir}/instance.redb                 links, conversations, behaviours' records
//! {dir}/agents/{id}/spacebot.redb     one agent's tasks, outbox, channel history, deliveries,
//!                                     applied idempotency keys
//! ```
//!
//! Agent files are opened lazily, the first time an agent's store is used. Each file records its
//! kind and schema version ([`SCHEMA_VERSION`]); a file without them, of another kind, with a newer
//! version, or damaged is refused with [`StoreError::Corrupt`] naming the file, and is never
//! written to: it is checked first (its magic number, then a full open, with any crash recovery
//! and checksum verification, of a copy-on-write view whose writes stay in memory).
//!
//! One data directory has one owner: opening takes an exclusive lock on `{dir}/spacebot.lock`
//! (with the holder's pid inside) until [`RedbStore::close`] or the last handle is dropped; a
//! second open, from any process, fails with [`StoreError::Backend`] naming the directory and the
//! pid. After an I/O error (a full disk) the failed operations fail, and the next operation reopens
//! the file, retrying for up to [`RedbOptions::io_retry`].
//!
//! # Threads and commits
//! redb's transactions are synchronous. Each open file has a dedicated thread that owns the
//! database; async callers hand it operations over a channel and await the answer on a
//! `futures` oneshot, so nothing blocks the executor and no async runtime is required. The thread
//! runs the operations queued at that moment inside one write transaction and commits them with one
//! durable commit (group commit, see [`RedbOptions::max_batch`]); every caller is answered after
//! that commit has returned. A task claim, the task's number, its indexes and its outbox row are
//! always written by one operation, hence in one transaction.
//!
//! ```
//! # async fn demo() -> Result<(), spacebot_core::StoreError> {
//! use spacebot_core::task::NewTask;
//! use spacebot_core::{AgentId, Timestamp};
//! let dir = tempfile::tempdir().map_err(|e| spacebot_core::StoreError::backend("redb", "tempdir", e))?;
//! let stores = spacebot_redb::open(dir.path())?;
//! let agent = AgentId::parse("support")?;
//! let task = stores.tasks.create(&agent, NewTask::new("Answer the ticket", ""), Timestamp(0)).await?;
//! assert_eq!(task.number, 1);
//! # Ok(()) }
//! # futures::executor::block_on(demo()).unwrap();
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]

mod agent;
mod backend;
mod file;
mod instance;
mod options;
mod records;
mod tables;
mod worker;

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use spacebot_core::channel::ChannelStore;
use spacebot_core::conversation::{Conversation, ConversationFilter, ConversationStore};
use spacebot_core::envelope::DeliveryStore;
use spacebot_core::link::LinkStore;
use spacebot_core::records::{
    Record, RecordStore, RecordWrite, WriteOutcome, check_address, check_list_prefix,
    check_namespace,
};
use spacebot_core::task::{
    CompletionNotice, Expect, NewTask, Task, TaskEvent, TaskFilter, TaskStore, Transition,
};
use spacebot_core::{
    AgentId, AgentLink, ChannelId, ChannelRecord, ConversationId, Envelope, EnvelopeId, LinkId,
    NewRecord, StoreError, Stores, Timestamp,
};

pub use file::SCHEMA_VERSION;
pub use options::{Durability, RedbOptions};

use file::FileKind;
use spacebot_core::dir_lock::{self, DirLock};
use worker::{Access, Worker};

/// The instance file's name under the data directory.
pub const INSTANCE_FILE: &str = "instance.redb";
/// An agent file's name under `{dir}/agents/{id}/`.
pub const AGENT_FILE: &str = "spacebot.redb";

/// Opens (or creates) the stores kept under `dir` with the default [`RedbOptions`].
///
/// Blocks the calling thread while the instance file is opened and checked (agent files open
/// later, on their own threads); from async code, [`open_async`] awaits instead.
pub fn open(dir: impl AsRef<Path>) -> Result<Stores, StoreError> {
    open_with(dir, RedbOptions::default())
}

/// Opens (or creates) the stores kept under `dir`, blocking like [`open`].
pub fn open_with(dir: impl AsRef<Path>, options: RedbOptions) -> Result<Stores, StoreError> {
    Ok(RedbStore::open(dir, options)?.stores())
}

/// Opens (or creates) the stores kept under `dir` with the default [`RedbOptions`], awaiting the
/// open instead of blocking.
pub async fn open_async(dir: impl AsRef<Path>) -> Result<Stores, StoreError> {
    Ok(RedbStore::open_async(dir, RedbOptions::default())
        .await?
        .stores())
}

fn open_thread_stopped(path: &Path) -> StoreError {
    StoreError::Backend {
        backend: "redb",
        message: format!("{}: the thread opening the file stopped", path.display()),
        source: None,
    }
}

/// Every store of one data directory. Cheap to share: clone the `Arc`.
pub struct RedbStore {
    dir: PathBuf,
    options: RedbOptions,
    instance: Worker,
    agents: Mutex<HashMap<AgentId, Arc<Worker>>>,
    /// The data directory's lock, released by [`RedbStore::close`] or on drop.
    lock: Mutex<Option<Arc<DirLock>>>,
    /// Set by [`RedbStore::close`]: no file is opened afterwards.
    closed: AtomicBool,
    /// Transactions committed so far, in every file ([`RedbStore::commits`]).
    commits: Arc<AtomicU64>,
}

impl fmt::Debug for RedbStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedbStore")
            .field("dir", &self.dir)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl RedbStore {
    /// Opens (or creates) the data directory `dir`: creates it if needed and opens the instance
    /// file, blocking the calling thread until it is checked. From async code, prefer
    /// [`RedbStore::open_async`].
    pub fn open(dir: impl AsRef<Path>, options: RedbOptions) -> Result<Arc<Self>, StoreError> {
        let (ready, opened) = std::sync::mpsc::sync_channel(1);
        let (store, path) = Self::start(dir.as_ref(), options, move |r| {
            let _ = ready.send(r);
        })?;
        match opened.recv() {
            Ok(Ok(())) => Ok(store),
            Ok(Err(failure)) => Err(failure.to_error()),
            Err(_) => Err(open_thread_stopped(&path)),
        }
    }

    /// Like [`RedbStore::open`], but awaits the instance file's thread instead of blocking.
    pub async fn open_async(
        dir: impl AsRef<Path>,
        options: RedbOptions,
    ) -> Result<Arc<Self>, StoreError> {
        let (ready, opened) = futures::channel::oneshot::channel();
        let (store, path) = Self::start(dir.as_ref(), options, move |r| {
            let _ = ready.send(r);
        })?;
        match opened.await {
            Ok(Ok(())) => Ok(store),
            Ok(Err(failure)) => Err(failure.to_error()),
            Err(_) => Err(open_thread_stopped(&path)),
        }
    }

    fn start(
        dir: &Path,
        options: RedbOptions,
        ready: impl FnOnce(Result<(), file::Failure>) + Send + 'static,
    ) -> Result<(Arc<Self>, PathBuf), StoreError> {
        let lock = Arc::new(acquire_lock(dir)?);
        let path = dir.join(INSTANCE_FILE);
        let commits = Arc::new(AtomicU64::new(0));
        let instance = Worker::start(
            path.clone(),
            FileKind::Instance,
            options.clone(),
            Some(Arc::clone(&lock)),
            Arc::clone(&commits),
            ready,
        )?;
        let store = Arc::new(Self {
            dir: dir.to_path_buf(),
            options,
            instance,
            agents: Mutex::new(HashMap::new()),
            lock: Mutex::new(Some(lock)),
            closed: AtomicBool::new(false),
            commits,
        });
        Ok((store, path))
    }

    /// Write transactions committed so far by this store, in every file of its directory (each
    /// one `fsync`ed with [`Durability::Immediate`]; a batch of reads alone is not committed).
    /// Several operations committed together (group commit) count once. For tests and
    /// diagnostics.
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// The bundle of stores, all served by this one.
    pub fn stores(self: &Arc<Self>) -> Stores {
        Stores {
            links: self.clone(),
            conversations: self.clone(),
            tasks: self.clone(),
            channels: self.clone(),
            deliveries: self.clone(),
            records: self.clone(),
        }
    }

    /// The data directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file that holds `agent`'s stores.
    pub fn agent_path(&self, agent: &AgentId) -> PathBuf {
        self.dir
            .join("agents")
            .join(agent.as_str())
            .join(AGENT_FILE)
    }

    /// Finishes the queued operations, closes every open file and releases the data directory's
    /// lock. Operations issued afterwards fail with [`StoreError::Backend`]. Needed (or dropping
    /// every handle) before the directory is opened again.
    pub async fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        if let Some(lock) = self.lock.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            lock.begin_release();
        }
        let agents: Vec<Arc<Worker>> = self.lock_agents().values().cloned().collect();
        for worker in agents {
            worker.close().await;
        }
        self.instance.close().await;
        let lock = self.lock.lock().unwrap_or_else(|e| e.into_inner()).take();
        drop(lock);
    }

    fn lock_agents(&self) -> std::sync::MutexGuard<'_, HashMap<AgentId, Arc<Worker>>> {
        // The map holds plain handles; a panic elsewhere cannot leave it half-updated.
        self.agents.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The worker of `agent`'s file, started (and the file opened, on its own thread) on first use.
    fn agent(&self, agent: &AgentId) -> Result<Arc<Worker>, StoreError> {
        let mut agents = self.lock_agents();
        if let Some(worker) = agents.get(agent)
            && !worker.failed()
        {
            return Ok(worker.clone());
        }
        if self.closed.load(Ordering::SeqCst) {
            return Err(StoreError::Backend {
                backend: "redb",
                message: format!("the stores of {} are closed", self.dir.display()),
                source: None,
            });
        }
        // Operations queue up while the file opens; a failed open answers them with its error.
        let keep = self.lock.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let worker = Worker::start(
            self.agent_path(agent),
            FileKind::Agent(agent.clone()),
            self.options.clone(),
            keep,
            Arc::clone(&self.commits),
            |_| {},
        )?;
        let worker = Arc::new(worker);
        agents.insert(agent.clone(), worker.clone());
        Ok(worker)
    }

    async fn on_agent<R, F>(&self, agent: &AgentId, access: Access, f: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&worker::Txn<'_>) -> Result<R, StoreError> + Send + 'static,
    {
        self.agent(agent)?.call(access, f).await
    }
}

#[async_trait]
impl LinkStore for RedbStore {
    async fn release(&self) {
        RedbStore::close(self).await;
    }

    async fn create(&self, link: &AgentLink) -> Result<(), StoreError> {
        let link = link.clone();
        self.instance
            .call(Access::Write, move |t| t.link_create(&link))
            .await
    }
    async fn update(&self, link: &AgentLink) -> Result<(), StoreError> {
        let link = link.clone();
        self.instance
            .call(Access::Write, move |t| t.link_update(&link))
            .await
    }
    async fn delete(&self, id: &LinkId) -> Result<(), StoreError> {
        let id = id.clone();
        self.instance
            .call(Access::Write, move |t| t.link_delete(&id))
            .await
    }
    async fn get(&self, id: &LinkId) -> Result<Option<AgentLink>, StoreError> {
        let id = id.clone();
        self.instance
            .call(Access::Read, move |t| t.link_get(&id))
            .await
    }
    async fn get_between(
        &self,
        from: &AgentId,
        to: &AgentId,
    ) -> Result<Option<AgentLink>, StoreError> {
        let (from, to) = (from.clone(), to.clone());
        self.instance
            .call(Access::Read, move |t| t.link_between(&from, &to))
            .await
    }
    async fn links_for_agent(&self, agent: &AgentId) -> Result<Vec<AgentLink>, StoreError> {
        let agent = agent.clone();
        self.instance
            .call(Access::Read, move |t| t.links_for_agent(&agent))
            .await
    }
    async fn list(&self) -> Result<Vec<AgentLink>, StoreError> {
        self.instance.call(Access::Read, |t| t.links_all()).await
    }
    async fn upsert_all(&self, links: &[AgentLink]) -> Result<(), StoreError> {
        let links = links.to_vec();
        self.instance
            .call(Access::Write, move |t| t.links_upsert_all(&links))
            .await
    }
}

#[async_trait]
impl ConversationStore for RedbStore {
    async fn release(&self) {
        RedbStore::close(self).await;
    }

    async fn create(&self, conversation: &Conversation) -> Result<(), StoreError> {
        let c = conversation.clone();
        self.instance
            .call(Access::Write, move |t| t.conversation_create(&c))
            .await
    }
    async fn get(&self, id: &ConversationId) -> Result<Option<Conversation>, StoreError> {
        let id = id.clone();
        self.instance
            .call(Access::Read, move |t| t.conversation_get(&id))
            .await
    }
    async fn update(
        &self,
        next: &Conversation,
        expected_revision: u64,
    ) -> Result<Conversation, StoreError> {
        let next = next.clone();
        self.instance
            .call(Access::Write, move |t| {
                t.conversation_update(&next, expected_revision)
            })
            .await
    }
    async fn find_open(&self, pair_key: &str) -> Result<Option<Conversation>, StoreError> {
        let key = pair_key.to_string();
        self.instance
            .call(Access::Read, move |t| t.conversation_find_open(&key))
            .await
    }
    async fn list(&self, filter: &ConversationFilter) -> Result<Vec<Conversation>, StoreError> {
        let filter = filter.clone();
        self.instance
            .call(Access::Read, move |t| t.conversation_list(&filter))
            .await
    }
}

#[async_trait]
impl RecordStore for RedbStore {
    async fn release(&self) {
        RedbStore::close(self).await;
    }

    async fn get(&self, namespace: &str, key: &str) -> Result<Option<Record>, StoreError> {
        check_address(namespace, key)?;
        let (ns, key) = (namespace.to_string(), key.to_string());
        self.instance
            .call(Access::Read, move |t| t.record_get(&ns, &key))
            .await
    }
    async fn version(
        &self,
        namespace: &str,
        key: &str,
        version: u64,
    ) -> Result<Option<Record>, StoreError> {
        check_address(namespace, key)?;
        let (ns, key) = (namespace.to_string(), key.to_string());
        self.instance
            .call(Access::Read, move |t| t.record_version(&ns, &key, version))
            .await
    }
    async fn write(&self, write: RecordWrite) -> Result<WriteOutcome, StoreError> {
        write.check()?;
        self.instance
            .call(Access::Write, move |t| t.record_write(write))
            .await
    }
    async fn list(&self, namespace: &str, prefix: &str) -> Result<Vec<Record>, StoreError> {
        check_namespace(namespace)?;
        check_list_prefix(prefix)?;
        let (ns, prefix) = (namespace.to_string(), prefix.to_string());
        self.instance
            .call(Access::Read, move |t| t.record_list(&ns, &prefix))
            .await
    }
    async fn history(&self, namespace: &str, key: &str) -> Result<Vec<Record>, StoreError> {
        check_address(namespace, key)?;
        let (ns, key) = (namespace.to_string(), key.to_string());
        self.instance
            .call(Access::Read, move |t| t.record_history(&ns, &key))
            .await
    }
}

#[async_trait]
impl TaskStore for RedbStore {
    async fn release(&self) {
        RedbStore::close(self).await;
    }

    async fn create(
        &self,
        agent: &AgentId,
        task: NewTask,
        now: Timestamp,
    ) -> Result<Task, StoreError> {
        let a = agent.clone();
        self.on_agent(agent, Access::Write, move |t| t.task_create(&a, task, now))
            .await
    }
    async fn get(&self, agent: &AgentId, number: u64) -> Result<Option<Task>, StoreError> {
        let a = agent.clone();
        self.on_agent(agent, Access::Read, move |t| t.task_get(&a, number))
            .await
    }
    async fn list(&self, agent: &AgentId, filter: &TaskFilter) -> Result<Vec<Task>, StoreError> {
        let (a, filter) = (agent.clone(), filter.clone());
        self.on_agent(agent, Access::Read, move |t| t.task_list(&a, &filter))
            .await
    }
    async fn transition(
        &self,
        agent: &AgentId,
        number: u64,
        expect: Expect,
        event: TaskEvent,
        now: Timestamp,
    ) -> Result<Transition, StoreError> {
        let a = agent.clone();
        self.on_agent(agent, Access::Write, move |t| {
            t.task_transition(&a, number, expect, event, now)
        })
        .await
    }
    async fn claim_next(
        &self,
        agent: &AgentId,
        holder: &str,
        lease: Duration,
        now: Timestamp,
    ) -> Result<Option<Task>, StoreError> {
        // Looked for first in a read (no commit): a task loop's round usually finds nothing to
        // claim, and a write transaction commits (and syncs) even when it wrote nothing.
        if !self
            .on_agent(agent, Access::Read, |t| t.task_ready_exists())
            .await?
        {
            return Ok(None);
        }
        let (a, holder) = (agent.clone(), holder.to_string());
        self.on_agent(agent, Access::Write, move |t| {
            t.task_claim_next(&a, &holder, lease, now)
        })
        .await
    }
    async fn requeue_expired(
        &self,
        agent: &AgentId,
        now: Timestamp,
    ) -> Result<Vec<Transition>, StoreError> {
        // Looked for first in a read, as in `claim_next`: a lease rarely expires.
        if !self
            .on_agent(agent, Access::Read, move |t| t.task_expired_exists(now))
            .await?
        {
            return Ok(Vec::new());
        }
        let a = agent.clone();
        self.on_agent(agent, Access::Write, move |t| {
            t.task_requeue_expired(&a, now)
        })
        .await
    }
    async fn outbox_pending(&self, agent: &AgentId) -> Result<Vec<CompletionNotice>, StoreError> {
        self.on_agent(agent, Access::Read, |t| t.outbox_pending())
            .await
    }
    async fn outbox_mark_sent(&self, agent: &AgentId, key: &str) -> Result<(), StoreError> {
        let key = key.to_string();
        self.on_agent(agent, Access::Write, move |t| t.outbox_mark_sent(&key))
            .await
    }
}

#[async_trait]
impl ChannelStore for RedbStore {
    async fn release(&self) {
        RedbStore::close(self).await;
    }

    async fn append(
        &self,
        agent: &AgentId,
        record: NewRecord,
    ) -> Result<ChannelRecord, StoreError> {
        let a = agent.clone();
        self.on_agent(agent, Access::Write, move |t| t.channel_append(&a, record))
            .await
    }
    async fn history(
        &self,
        agent: &AgentId,
        channel: &ChannelId,
        limit: Option<usize>,
    ) -> Result<Vec<ChannelRecord>, StoreError> {
        let channel = channel.clone();
        self.on_agent(agent, Access::Read, move |t| {
            t.channel_history(&channel, limit)
        })
        .await
    }
    async fn ensure_channel(&self, agent: &AgentId, channel: &ChannelId) -> Result<(), StoreError> {
        let channel = channel.clone();
        self.on_agent(agent, Access::Write, move |t| t.channel_ensure(&channel))
            .await
    }
    async fn channels(&self, agent: &AgentId) -> Result<Vec<ChannelId>, StoreError> {
        self.on_agent(agent, Access::Read, |t| t.channel_list())
            .await
    }
}

#[async_trait]
impl DeliveryStore for RedbStore {
    async fn release(&self) {
        RedbStore::close(self).await;
    }

    async fn persist(&self, agent: &AgentId, envelope: &Envelope) -> Result<(), StoreError> {
        let envelope = envelope.clone();
        self.on_agent(agent, Access::Write, move |t| t.delivery_persist(&envelope))
            .await
    }
    async fn pending(&self, agent: &AgentId) -> Result<Vec<Envelope>, StoreError> {
        self.on_agent(agent, Access::Read, |t| t.delivery_pending())
            .await
    }
    async fn remove(&self, agent: &AgentId, id: &EnvelopeId) -> Result<(), StoreError> {
        let id = id.clone();
        self.on_agent(agent, Access::Write, move |t| t.delivery_remove(&id))
            .await
    }
    async fn mark_applied(
        &self,
        agent: &AgentId,
        key: &str,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let key = key.to_string();
        self.on_agent(agent, Access::Write, move |t| t.mark_applied(&key, now))
            .await
    }
    async fn is_applied(&self, agent: &AgentId, key: &str) -> Result<bool, StoreError> {
        let key = key.to_string();
        self.on_agent(agent, Access::Read, move |t| t.is_applied(&key))
            .await
    }
    async fn commit(
        &self,
        agent: &AgentId,
        commit: &spacebot_core::TurnCommit,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        if commit.is_empty() {
            return Ok(());
        }
        let (a, commit) = (agent.clone(), commit.clone());
        self.on_agent(agent, Access::Write, move |t| {
            t.turn_commit(&a, &commit, now)
        })
        .await
    }
}

/// How long an opener waits for this process's release of the same directory (a store dropped or
/// closed a moment ago, its files' threads still closing them) before it gives up.
const RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Takes `dir`'s lock; when this process is still releasing it (the last handle was dropped or
/// closed a moment ago), waits for the release first (the files close on their own threads, so
/// the wait blocks only the caller).
fn acquire_lock(dir: &Path) -> Result<DirLock, StoreError> {
    loop {
        match DirLock::acquire(dir, "redb") {
            Ok(lock) => return Ok(lock),
            Err(e) => {
                let Some(release) = dir_lock::release_in_progress(dir) else {
                    return Err(e);
                };
                if !release.wait_blocking(RELEASE_WAIT) {
                    return Err(e);
                }
            }
        }
    }
}

impl Drop for RedbStore {
    /// The last handle is gone: each file's thread finishes its queue and closes its file, and the
    /// last one to end releases the directory's lock. An opener in this process waits for that.
    fn drop(&mut self) {
        if let Some(lock) = self
            .lock
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            lock.begin_release();
        }
    }
}
