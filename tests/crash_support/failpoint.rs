//! A [`Stores`] wrapper that counts every write call of the six stores and, in a child process
//! started with a failpoint, stops the process exactly before the write with that number: it prints
//! `CRASHPOINT <n> <call>` to stdout, flushes, and blocks the thread until the parent kills it.
//! Armed "after a claim" instead, it stops the process at the first write after a task was claimed,
//! or at the model call of a claimed task if that comes first: a kill between a claim and its model
//! call.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use spacebot::conversation::ConversationFilter;
use spacebot::task::{CompletionNotice, Expect, TaskEvent, TaskFilter, Transition};
use spacebot::{
    AgentId, AgentLink, ChannelId, ChannelRecord, ChannelStore, Conversation, ConversationId,
    ConversationStore, DeliveryStore, Envelope, EnvelopeId, LinkId, LinkStore, NewRecord, NewTask,
    Record, RecordStore, RecordWrite, StoreError, Stores, Task, TaskStore, Timestamp, TurnCommit,
    WriteOutcome,
};

/// The marker a child prints just before the write it stops at.
pub const MARKER: &str = "CRASHPOINT";

/// Counts writes; stops the process before write number `at`, or (with `after_claim`) at the first
/// write or model call after a task was claimed.
#[derive(Debug)]
pub struct Failpoint {
    writes: AtomicU64,
    at: Option<u64>,
    after_claim: bool,
    /// A task was claimed (with `after_claim`): the next write or model call stops the process.
    armed: AtomicBool,
}

impl Failpoint {
    /// A counter that stops before write `at` (never, with `None`).
    pub fn new(at: Option<u64>) -> Arc<Self> {
        Self::with_claim_kill(at, false)
    }

    /// A counter that stops before write `at`, or with `after_claim` at the first write or model
    /// call after a claim.
    pub fn with_claim_kill(at: Option<u64>, after_claim: bool) -> Arc<Self> {
        Arc::new(Self {
            writes: AtomicU64::new(0),
            at,
            after_claim,
            armed: AtomicBool::new(false),
        })
    }

    /// Called by the model before it answers a claimed task: stops the process when armed (a claim
    /// made, no write since).
    pub fn model_call(&self, what: &str) {
        if self.armed.load(Ordering::SeqCst) {
            self.stop(self.writes(), &format!("model call {what} after a claim"));
        }
    }

    fn claimed(&self) {
        if self.after_claim {
            self.armed.store(true, Ordering::SeqCst);
        }
    }

    /// Prints the marker and blocks the thread for good: the parent kills the process now.
    fn stop(&self, n: u64, call: &str) -> ! {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{MARKER} {n} {call}");
        let _ = out.flush();
        drop(out);
        // The parent kills this process now; nothing after this line runs.
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }

    /// How many writes were started so far.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::SeqCst)
    }

    /// Called before every write: counts it, and blocks forever when it is the failpoint's.
    fn write(&self, call: &str) {
        let n = self.writes.fetch_add(1, Ordering::SeqCst) + 1;
        if self.at == Some(n) || self.armed.load(Ordering::SeqCst) {
            self.stop(n, call);
        }
    }

    /// Wraps each of the six stores of `stores`.
    pub fn wrap(self: &Arc<Self>, stores: Stores) -> Stores {
        Stores {
            links: Arc::new(Links(stores.links, self.clone())),
            conversations: Arc::new(Conversations(stores.conversations, self.clone())),
            tasks: Arc::new(Tasks(stores.tasks, self.clone())),
            channels: Arc::new(Channels(stores.channels, self.clone())),
            deliveries: Arc::new(Deliveries(stores.deliveries, self.clone())),
            records: Arc::new(Records::new(stores.records, self.clone())),
        }
    }
}

#[derive(Debug)]
struct Links(Arc<dyn LinkStore>, Arc<Failpoint>);

#[async_trait]
impl LinkStore for Links {
    async fn release(&self) {
        self.0.release().await;
    }
    async fn create(&self, link: &AgentLink) -> Result<(), StoreError> {
        self.1.write("links.create");
        self.0.create(link).await
    }
    async fn update(&self, link: &AgentLink) -> Result<(), StoreError> {
        self.1.write("links.update");
        self.0.update(link).await
    }
    async fn delete(&self, id: &LinkId) -> Result<(), StoreError> {
        self.1.write("links.delete");
        self.0.delete(id).await
    }
    async fn get(&self, id: &LinkId) -> Result<Option<AgentLink>, StoreError> {
        self.0.get(id).await
    }
    async fn get_between(
        &self,
        from: &AgentId,
        to: &AgentId,
    ) -> Result<Option<AgentLink>, StoreError> {
        self.0.get_between(from, to).await
    }
    async fn links_for_agent(&self, agent: &AgentId) -> Result<Vec<AgentLink>, StoreError> {
        self.0.links_for_agent(agent).await
    }
    async fn list(&self) -> Result<Vec<AgentLink>, StoreError> {
        self.0.list().await
    }
    async fn upsert_all(&self, links: &[AgentLink]) -> Result<(), StoreError> {
        self.1.write("links.upsert_all");
        self.0.upsert_all(links).await
    }
}

#[derive(Debug)]
struct Conversations(Arc<dyn ConversationStore>, Arc<Failpoint>);

#[async_trait]
impl ConversationStore for Conversations {
    async fn release(&self) {
        self.0.release().await;
    }
    async fn create(&self, conversation: &Conversation) -> Result<(), StoreError> {
        self.1.write("conversations.create");
        self.0.create(conversation).await
    }
    async fn get(&self, id: &ConversationId) -> Result<Option<Conversation>, StoreError> {
        self.0.get(id).await
    }
    async fn update(
        &self,
        next: &Conversation,
        expected_revision: u64,
    ) -> Result<Conversation, StoreError> {
        self.1.write("conversations.update");
        self.0.update(next, expected_revision).await
    }
    async fn find_open(&self, pair_key: &str) -> Result<Option<Conversation>, StoreError> {
        self.0.find_open(pair_key).await
    }
    async fn list(&self, filter: &ConversationFilter) -> Result<Vec<Conversation>, StoreError> {
        self.0.list(filter).await
    }
}

#[derive(Debug)]
struct Tasks(Arc<dyn TaskStore>, Arc<Failpoint>);

#[async_trait]
impl TaskStore for Tasks {
    async fn release(&self) {
        self.0.release().await;
    }
    async fn create(
        &self,
        agent: &AgentId,
        task: NewTask,
        now: Timestamp,
    ) -> Result<Task, StoreError> {
        self.1.write("tasks.create");
        self.0.create(agent, task, now).await
    }
    async fn get(&self, agent: &AgentId, number: u64) -> Result<Option<Task>, StoreError> {
        self.0.get(agent, number).await
    }
    async fn list(&self, agent: &AgentId, filter: &TaskFilter) -> Result<Vec<Task>, StoreError> {
        self.0.list(agent, filter).await
    }
    async fn transition(
        &self,
        agent: &AgentId,
        number: u64,
        expect: Expect,
        event: TaskEvent,
        now: Timestamp,
    ) -> Result<Transition, StoreError> {
        self.1.write("tasks.transition");
        self.0.transition(agent, number, expect, event, now).await
    }
    async fn claim_next(
        &self,
        agent: &AgentId,
        holder: &str,
        lease: Duration,
        now: Timestamp,
    ) -> Result<Option<Task>, StoreError> {
        self.1.write("tasks.claim_next");
        let claimed = self.0.claim_next(agent, holder, lease, now).await;
        if matches!(claimed, Ok(Some(_))) {
            self.1.claimed();
        }
        claimed
    }
    async fn requeue_expired(
        &self,
        agent: &AgentId,
        now: Timestamp,
    ) -> Result<Vec<Transition>, StoreError> {
        self.1.write("tasks.requeue_expired");
        self.0.requeue_expired(agent, now).await
    }
    async fn outbox_pending(&self, agent: &AgentId) -> Result<Vec<CompletionNotice>, StoreError> {
        self.0.outbox_pending(agent).await
    }
    async fn outbox_mark_sent(&self, agent: &AgentId, key: &str) -> Result<(), StoreError> {
        self.1.write("tasks.outbox_mark_sent");
        self.0.outbox_mark_sent(agent, key).await
    }
}

#[derive(Debug)]
struct Channels(Arc<dyn ChannelStore>, Arc<Failpoint>);

#[async_trait]
impl ChannelStore for Channels {
    async fn release(&self) {
        self.0.release().await;
    }
    async fn append(
        &self,
        agent: &AgentId,
        record: NewRecord,
    ) -> Result<ChannelRecord, StoreError> {
        self.1.write("channels.append");
        self.0.append(agent, record).await
    }
    async fn history(
        &self,
        agent: &AgentId,
        channel: &ChannelId,
        limit: Option<usize>,
    ) -> Result<Vec<ChannelRecord>, StoreError> {
        self.0.history(agent, channel, limit).await
    }
    async fn ensure_channel(&self, agent: &AgentId, channel: &ChannelId) -> Result<(), StoreError> {
        self.1.write("channels.ensure_channel");
        self.0.ensure_channel(agent, channel).await
    }
    async fn channels(&self, agent: &AgentId) -> Result<Vec<ChannelId>, StoreError> {
        self.0.channels(agent).await
    }
}

#[derive(Debug)]
struct Deliveries(Arc<dyn DeliveryStore>, Arc<Failpoint>);

#[async_trait]
impl DeliveryStore for Deliveries {
    async fn release(&self) {
        self.0.release().await;
    }
    async fn persist(&self, agent: &AgentId, envelope: &Envelope) -> Result<(), StoreError> {
        self.1.write("deliveries.persist");
        self.0.persist(agent, envelope).await
    }
    async fn pending(&self, agent: &AgentId) -> Result<Vec<Envelope>, StoreError> {
        self.0.pending(agent).await
    }
    async fn remove(&self, agent: &AgentId, id: &EnvelopeId) -> Result<(), StoreError> {
        self.1.write("deliveries.remove");
        self.0.remove(agent, id).await
    }
    async fn mark_applied(
        &self,
        agent: &AgentId,
        key: &str,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.1.write("deliveries.mark_applied");
        self.0.mark_applied(agent, key, now).await
    }
    fn is_durable(&self) -> bool {
        self.0.is_durable()
    }
    async fn is_applied(&self, agent: &AgentId, key: &str) -> Result<bool, StoreError> {
        self.0.is_applied(agent, key).await
    }
    async fn commit(
        &self,
        agent: &AgentId,
        commit: &TurnCommit,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        self.1.write("deliveries.commit");
        self.0.commit(agent, commit, now).await
    }
}

/// The record store, and its typed cells: a store whose cells store images (SQLite) gets cells of
/// the wrapper's own over the same images, each store of images counted as a write (a kill
/// before the image of a reservation is stored, or a settlement's); cells without images (the
/// memory store's) are the inner store's.
#[derive(Debug)]
struct Records(
    Arc<dyn RecordStore>,
    Arc<Failpoint>,
    Option<spacebot::records::TypedCells>,
);

impl Records {
    fn new(inner: Arc<dyn RecordStore>, failpoint: Arc<Failpoint>) -> Self {
        let stored = inner
            .typed_cells()
            .is_some_and(|cells| cells.images().is_some());
        let cells = stored.then(|| {
            spacebot::records::TypedCells::stored_in(Arc::new(Images(
                inner.clone(),
                failpoint.clone(),
            )))
        });
        Self(inner, failpoint, cells)
    }
}

/// The inner store's cells' images, each store counted as a write.
#[derive(Debug)]
struct Images(Arc<dyn RecordStore>, Arc<Failpoint>);

impl Images {
    fn inner(&self) -> &dyn spacebot::records::CellImages {
        self.0
            .typed_cells()
            .and_then(|cells| cells.images())
            .expect("the wrapped store's cells store images")
    }
}

#[async_trait]
impl spacebot::records::CellImages for Images {
    async fn load(&self, namespace: &str, key: &str) -> Result<Option<(u64, String)>, StoreError> {
        self.inner().load(namespace, key).await
    }
    async fn store(&self, images: Vec<spacebot::records::CellImage>) -> Result<(), StoreError> {
        self.1.write("cells.store");
        self.inner().store(images).await
    }
}

#[async_trait]
impl RecordStore for Records {
    async fn release(&self) {
        self.0.release().await;
    }
    fn typed_cells(&self) -> Option<&spacebot::records::TypedCells> {
        self.2.as_ref().or_else(|| self.0.typed_cells())
    }
    async fn get(&self, namespace: &str, key: &str) -> Result<Option<Record>, StoreError> {
        self.0.get(namespace, key).await
    }
    async fn version(
        &self,
        namespace: &str,
        key: &str,
        version: u64,
    ) -> Result<Option<Record>, StoreError> {
        self.0.version(namespace, key, version).await
    }
    async fn write(&self, write: RecordWrite) -> Result<WriteOutcome, StoreError> {
        self.1.write("records.write");
        self.0.write(write).await
    }
    async fn list(&self, namespace: &str, prefix: &str) -> Result<Vec<Record>, StoreError> {
        self.0.list(namespace, prefix).await
    }
    async fn history(&self, namespace: &str, key: &str) -> Result<Vec<Record>, StoreError> {
        self.0.history(namespace, key).await
    }
}
