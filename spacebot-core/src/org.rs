//! The [`Organization`]: one running instance of agents, links and stores.
//!
//! Build it from an [`OrgConfig`] plus backends with [`Organization::builder`], start the agents, and
//! hand it messages:
//!
//! - [`Organization::deliver`] is the one entry point for external gateways. It resolves the agent
//!   and enqueues; it never runs the model itself. Each agent's loop is the only consumer of its
//!   queue and the only caller of the tool loop.
//! - [`Organization::send_internal`] carries typed envelopes (task, announce, cancel) between agents
//!   over their links, the sender stamped by the runtime.
//! - [`Organization::spawn_child`] starts a child agent whose replies go to its parent's queue.
//!
//! See `docs/runtime.md` for the queue, the loop, checkpoints and steering.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};

use futures::channel::{mpsc, oneshot};
use futures::future::{AbortHandle, Abortable};

use crate::config::{ConfigError, OrgConfig, Settings};
use crate::envelope::{Envelope, EnvelopeKind, Source};
use crate::error::{InvalidInput, PolicyDenied, StoreError};
use crate::event::{Event, EventKind, EventSink};
use crate::ids::{AgentId, ChannelId, EnvelopeId};
use crate::link::AgentLink;
use crate::llm::LlmProvider;
use crate::policy::{self, LinkGraph};
use crate::prompts::{Identity, IdentityError, PromptError, Prompts};
use crate::runtime::behaviour::Behaviour;
use crate::runtime::outbound::{Outbound, Reply};
use crate::runtime::queue::{AgentQueue, BoundedQueue, QueueError};
use crate::stores::Stores;
use crate::time::{Clock, Spawner};
use crate::tools::ToolRegistry;
use crate::topology::{Topology, TopologyAgent};

/// Why the organization could not be built or changed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OrgError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// An agent's identity files could not be read.
    #[error(transparent)]
    Identity(#[from] IdentityError),
    /// A prompt template is invalid.
    #[error(transparent)]
    Prompt(#[from] PromptError),
    /// An argument was refused.
    #[error(transparent)]
    Invalid(#[from] InvalidInput),
    /// The builder lacks something it needs.
    #[error("the organization needs {0}; set it on the builder")]
    Missing(&'static str),
    /// The agent is not part of the organization.
    #[error("unknown agent {0}")]
    UnknownAgent(AgentId),
    /// The agent has ended and cannot be started again.
    #[error("agent {0} has ended")]
    Ended(AgentId),
}

/// Why a delivery was refused. The envelope was not taken (and nothing was stored) unless the
/// variant says otherwise.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeliveryError {
    /// No agent has this id.
    #[error("unknown agent {agent:?}")]
    UnknownAgent {
        /// The id as given.
        agent: String,
    },
    /// The agent has ended (a finished child, or one removed from the organization).
    #[error("agent {agent} has ended and takes no more messages")]
    Ended {
        /// The agent.
        agent: AgentId,
    },
    /// The agent's queue is full; try again later.
    #[error(transparent)]
    QueueFull(QueueError),
    /// The policy refused the message.
    #[error(transparent)]
    Denied(#[from] PolicyDenied),
    /// Persisting for a stopped agent failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The message itself was refused.
    #[error(transparent)]
    Invalid(#[from] InvalidInput),
}

/// A message from an external gateway (a chat platform, the application's UI).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboundMessage {
    /// The platform, such as `portal` or `discord`.
    pub platform: String,
    /// Where replies go on that platform (a chat or thread id).
    pub reply_target: String,
    /// The receiving agent's channel; defaults to `{platform}:{reply_target}`.
    pub channel: Option<ChannelId>,
    /// The text.
    pub content: String,
    /// Free-form metadata kept on the envelope.
    pub metadata: serde_json::Map<String, serde_json::Value>,
    /// The application's own id of the message, when it has one (see
    /// [`with_idempotency_key`](Self::with_idempotency_key)).
    pub idempotency_key: Option<String>,
}

impl InboundMessage {
    /// A message from `platform`, answered at `reply_target`.
    pub fn new(
        platform: impl Into<String>,
        reply_target: impl Into<String>,
        content: impl Into<String>,
    ) -> Self {
        Self {
            platform: platform.into(),
            reply_target: reply_target.into(),
            channel: None,
            content: content.into(),
            metadata: serde_json::Map::new(),
            idempotency_key: None,
        }
    }

    /// Sets the channel.
    pub fn with_channel(mut self, channel: ChannelId) -> Self {
        self.channel = Some(channel);
        self
    }

    /// Names the message with the application's own id (a chat platform's message id, a job id),
    /// so that delivering it again is harmless: of all deliveries of one key to one agent, the
    /// agent answers one; the others are consumed unanswered. An application that did not see
    /// `deliver` return (it crashed meanwhile) delivers again with the same key.
    ///
    /// The reply names the envelope that was answered in `in_reply_to`, which may be the id an
    /// earlier, unacknowledged `deliver` made.
    ///
    /// ```
    /// use spacebot_core::InboundMessage;
    ///
    /// let message = InboundMessage::new("portal", "u1", "hello").with_idempotency_key("msg-42");
    /// assert_eq!(message.idempotency_key.as_deref(), Some("msg-42"));
    /// ```
    pub fn with_idempotency_key(mut self, key: impl Into<String>) -> Self {
        self.idempotency_key = Some(key.into());
        self
    }
}

/// What an internal envelope asks of the receiving agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum InternalKind {
    /// Work for the receiver (wakes its model).
    Task,
    /// A result or status (wakes its model).
    Announce,
    /// Cancel the receiver's running turn; queued envelopes are kept.
    Cancel,
}

impl InternalKind {
    fn envelope_kind(self) -> EnvelopeKind {
        match self {
            Self::Task => EnvelopeKind::TaskAssigned,
            Self::Announce => EnvelopeKind::Announce,
            Self::Cancel => EnvelopeKind::Cancel,
        }
    }
}

/// A typed envelope between agents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InternalMessage {
    /// What it asks.
    pub kind: InternalKind,
    /// The text.
    pub content: String,
}

impl InternalMessage {
    /// A task for the receiver.
    pub fn task(content: impl Into<String>) -> Self {
        Self {
            kind: InternalKind::Task,
            content: content.into(),
        }
    }
    /// An announcement to the receiver.
    pub fn announce(content: impl Into<String>) -> Self {
        Self {
            kind: InternalKind::Announce,
            content: content.into(),
        }
    }
    /// A cancel request.
    pub fn cancel(reason: impl Into<String>) -> Self {
        Self {
            kind: InternalKind::Cancel,
            content: reason.into(),
        }
    }
}

/// What a child agent is started with.
#[derive(Debug, Clone)]
pub struct ChildSpec {
    /// Display name.
    pub name: String,
    /// The task text the child starts on.
    pub task: String,
    /// The parent's channel the child's result wakes (defaults to `child:{parent}:{child}`).
    pub report_to: Option<ChannelId>,
    /// Extra instructions appended to the child's system prompt.
    pub instructions: Option<String>,
    /// End the child after it delivered its first result (default `true`).
    pub end_after_reply: bool,
}

impl ChildSpec {
    /// A child named `name` starting on `task`.
    pub fn new(name: impl Into<String>, task: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            task: task.into(),
            report_to: None,
            instructions: None,
            end_after_reply: true,
        }
    }
}

/// The fixed description of an agent.
#[derive(Debug)]
pub(crate) struct AgentSpec {
    pub(crate) id: AgentId,
    pub(crate) name: String,
    pub(crate) identity: Identity,
    pub(crate) parent: Option<ParentLink>,
    pub(crate) outbound: Arc<dyn Outbound>,
    pub(crate) instructions: Option<String>,
}

/// A child's tie to its parent.
#[derive(Debug, Clone)]
pub(crate) struct ParentLink {
    pub(crate) parent: AgentId,
    pub(crate) report_to: ChannelId,
    pub(crate) end_after_reply: bool,
}

/// A running agent: its queue, its outbound, and the handle to cancel its turn.
#[derive(Debug)]
pub(crate) struct AgentRuntime {
    pub(crate) spec: Arc<AgentSpec>,
    pub(crate) queue: BoundedQueue,
    /// Set when something was persisted for this agent while it ran (queue full): the loop hands
    /// the pending deliveries over when its queue runs empty.
    pub(crate) pending: AtomicBool,
    pub(crate) abort: Mutex<Option<AbortHandle>>,
    /// Aborts the whole loop at once, without committing the running turn (a placement lease
    /// lost: see [`Organization::fence_agent`]).
    pub(crate) fence: Mutex<Option<AbortHandle>>,
    /// Attempts of a custom task executor running here, by lease holder: aborted when the agent
    /// is handed over under a placement (its next host runs them again at once).
    pub(crate) executors: Mutex<HashMap<String, AbortHandle>>,
    pub(crate) stopped: Mutex<Option<oneshot::Receiver<()>>>,
    /// Wakes the behaviours' workers of this agent (capacity 1: a ring while one is pending is a
    /// no-op).
    pub(crate) doorbell: Mutex<Option<mpsc::Sender<()>>>,
    /// The doorbell's receiving end, until a behaviour's worker takes it.
    pub(crate) bell_rx: Mutex<Option<mpsc::Receiver<()>>>,
    /// Whether a behaviour's worker took the doorbell.
    pub(crate) bell_taken: AtomicBool,
    /// A ring (or the worker's start) not taken up by a worker round yet: the agent is not idle.
    pub(crate) worker_due: AtomicBool,
    /// Worker rounds running now (see [`AgentWorker::round`](crate::runtime::behaviour::AgentWorker::round)).
    pub(crate) worker_rounds: AtomicUsize,
    /// Whether the loop is handling an envelope.
    pub(crate) busy: AtomicBool,
    /// Tasks claimed and not finished yet: task number -> lease holder of the claim.
    pub(crate) running_tasks: Mutex<HashMap<u64, String>>,
    /// Envelopes in the queue or in the running turn: a store hand-over skips them.
    pub(crate) known: Mutex<crate::fasthash::FastSet<EnvelopeId>>,
    /// Envelopes handed over from the store when the agent started: a delivery racing the start
    /// that pushes one of them again is not queued twice.
    pub(crate) loaded: Mutex<crate::fasthash::FastSet<EnvelopeId>>,
    /// The last external source seen per channel: a reply to a system message (a retrigger) in that
    /// channel goes to the same place. Kept in memory only.
    pub(crate) reply_sources: Mutex<HashMap<ChannelId, Source>>,
}

impl AgentRuntime {
    pub(crate) fn id(&self) -> &AgentId {
        &self.spec.id
    }

    /// Aborts every custom executor attempt running here (a hand-over under a placement).
    pub(crate) fn abort_executors(&self) {
        for (_, attempt) in lock(&self.executors).drain() {
            attempt.abort();
        }
    }

    /// Wakes the task loop.
    pub(crate) fn ring(&self) {
        if self.bell_taken.load(Ordering::Acquire) {
            self.worker_due.store(true, Ordering::Release);
        }
        if let Some(bell) = self
            .doorbell
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            let _ = bell.try_send(());
        }
    }

    /// Whether the loop waits for work (no turn running).
    pub(crate) fn idle(&self) -> bool {
        !self.busy.load(Ordering::Acquire)
    }

    /// Whether nothing is left to do: the queue empty, no turn, no claimed task, no worker round
    /// running or due.
    pub(crate) fn settled(&self) -> bool {
        self.queue.is_empty()
            && self.idle()
            && self.running_tasks() == 0
            && !self.worker_due.load(Ordering::Acquire)
            && self.worker_rounds.load(Ordering::Acquire) == 0
    }

    pub(crate) fn running_tasks(&self) -> usize {
        lock(&self.running_tasks).len()
    }

    /// The claims counted against the task concurrency, as (task number, holder).
    pub(crate) fn running_claims(&self) -> Vec<(u64, String)> {
        lock(&self.running_tasks)
            .iter()
            .map(|(n, h)| (*n, h.clone()))
            .collect()
    }

    pub(crate) fn task_started(&self, number: u64, holder: &str) {
        lock(&self.running_tasks).insert(number, holder.to_string());
    }

    /// Frees the slot of the claim `holder` on task `number` (a later claim of the same task keeps
    /// its own slot).
    pub(crate) fn task_finished(&self, number: u64, holder: &str) {
        let mut running = lock(&self.running_tasks);
        if running.get(&number).is_some_and(|h| h == holder) {
            running.remove(&number);
        }
    }

    /// Takes `id` into the queue's bookkeeping; `false` when the queue or the running turn holds
    /// it already (or it was handed over at start), so it must not be queued again.
    pub(crate) fn admit(&self, id: &EnvelopeId) -> bool {
        if lock(&self.loaded).contains(id) {
            return false;
        }
        lock(&self.known).insert(id.clone())
    }

    /// Drops envelopes from the queue's bookkeeping (they were committed, or kept in the store).
    pub(crate) fn forget(&self, ids: &[EnvelopeId]) {
        let mut known = lock(&self.known);
        for id in ids {
            known.remove(id);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Debug, Clone)]
pub(crate) enum Slot {
    Running(Arc<AgentRuntime>),
    Stopped(Arc<AgentSpec>),
    Ended,
}

/// The shared state behind an [`Organization`].
pub(crate) struct OrgInner {
    pub(crate) stores: Stores,
    pub(crate) llm: Arc<dyn LlmProvider>,
    pub(crate) spawner: Arc<dyn Spawner>,
    /// Runs the agent loops and task loops (see `runtime::executor`).
    pub(crate) loops: crate::runtime::executor::LoopExecutor,
    /// Background work that uses the stores outside agents' loops; a shutdown waits for it.
    pub(crate) background: Arc<crate::runtime::executor::Background>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) events: Arc<dyn EventSink>,
    pub(crate) prompts: Prompts,
    pub(crate) settings: Settings,
    pub(crate) tools: ToolRegistry,
    pub(crate) graph: RwLock<Arc<LinkGraph>>,
    pub(crate) agents: RwLock<crate::fasthash::FastMap<AgentId, Slot>>,
    pub(crate) config: OrgConfig,
    pub(crate) replies: Mutex<Option<mpsc::UnboundedReceiver<Reply>>>,
    pub(crate) child_counter: AtomicU64,
    /// Which exchanges (by cause) took turns from each conversation: a conversation whose budget
    /// one exchange spent is not started afresh by that exchange.
    pub(crate) exchanges: Mutex<HashMap<crate::ids::ConversationId, Vec<EnvelopeId>>>,
    /// Internal tasks sent and not yet answered, per (sender, receiver): each lets the receiver
    /// announce back once, even over a one-way link.
    pub(crate) internal_open: Mutex<HashMap<(AgentId, AgentId), u32>>,
    /// Every event, for [`Organization::subscribe`] and the waits.
    pub(crate) bus: crate::bus::EventBus,
    /// Lease holders of claims a custom executor of this process still works on.
    pub(crate) live_claims: Mutex<HashSet<String>>,
    /// Agents whose loop here is being stopped without ending their session (a shutdown; under a
    /// placement, a lease lost): their session goes on at the next start or in the next host, so
    /// their conversations are not severed.
    pub(crate) handing_over: Mutex<HashSet<AgentId>>,
    /// Callers of `wait_idle` waiting now: while there are any, every worker round that leaves its
    /// agent settled says so with an `AgentIdle` event (not only the rounds a ring started).
    pub(crate) idle_waiters: AtomicUsize,
    /// The behaviours plugged into the host, in order.
    pub(crate) behaviours: Vec<Arc<dyn Behaviour>>,
    /// Tokens each agent's turns spent since the organization was built.
    pub(crate) usage: Mutex<HashMap<AgentId, crate::llm::Usage>>,
    /// Renderings reused while the link graph is unchanged.
    pub(crate) caches: RenderCache,
    /// Bumped every time the link graph is replaced: what caches check.
    pub(crate) graph_version: AtomicU64,
    /// A short random tag of this organization instance (child ids carry it).
    pub(crate) instance_tag: String,
    /// One gate per agent serializing its outbox flushes (a notice is delivered by one at a time).
    pub(crate) flush_gates: Mutex<HashMap<AgentId, Arc<futures::lock::Mutex<()>>>>,
    /// This process's part in placement, when the organization spans several processes.
    pub(crate) hosting: Option<Arc<crate::runtime::hosting::Hosting>>,
}

/// A rendering with the link-graph version it was made for.
type Versioned<T> = (u64, T);

/// A system prompt's cache key: the agent, and the peer when it answers in a link channel.
type PromptKey = (AgentId, Option<AgentId>);

/// System prompts and tool definitions per agent, reused while the link graph (their only input
/// that changes at run time) is the same.
#[derive(Debug, Default)]
pub(crate) struct RenderCache {
    prompts: Mutex<crate::fasthash::FastMap<PromptKey, Versioned<Arc<str>>>>,
    definitions:
        Mutex<crate::fasthash::FastMap<AgentId, Versioned<Arc<[crate::llm::ToolDefinition]>>>>,
}

impl RenderCache {
    pub(crate) fn prompts(&self, key: &PromptKey) -> Option<Versioned<Arc<str>>> {
        lock(&self.prompts).get(key).cloned()
    }

    pub(crate) fn set_prompt(&self, key: PromptKey, version: u64, text: Arc<str>) {
        lock(&self.prompts).insert(key, (version, text));
    }

    pub(crate) fn definitions(
        &self,
        agent: &AgentId,
    ) -> Option<Versioned<Arc<[crate::llm::ToolDefinition]>>> {
        lock(&self.definitions).get(agent).cloned()
    }

    pub(crate) fn set_definitions(
        &self,
        agent: AgentId,
        version: u64,
        defs: Arc<[crate::llm::ToolDefinition]>,
    ) {
        lock(&self.definitions).insert(agent, (version, defs));
    }
}

impl fmt::Debug for OrgInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Organization")
            .field("agents", &self.read_agents().len())
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

/// One running organization of agents. Cheap to clone (a handle).
#[derive(Debug, Clone)]
pub struct Organization {
    pub(crate) inner: Arc<OrgInner>,
}

impl OrgInner {
    pub(crate) fn read_agents(
        &self,
    ) -> RwLockReadGuard<'_, crate::fasthash::FastMap<AgentId, Slot>> {
        self.agents.read().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn write_agents(
        &self,
    ) -> std::sync::RwLockWriteGuard<'_, crate::fasthash::FastMap<AgentId, Slot>> {
        self.agents.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Replaces the link graph (every later policy check and rendering sees the new one).
    pub(crate) fn set_graph(&self, graph: LinkGraph) {
        *self.graph.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(graph);
        self.graph_version.fetch_add(1, Ordering::AcqRel);
    }

    pub(crate) fn graph(&self) -> Arc<LinkGraph> {
        self.graph.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(crate) fn emit(&self, event: Event) {
        if self.bus.subscriber_count() > 0 {
            self.bus.emit(event.clone());
        }
        self.events.emit(event);
    }

    pub(crate) fn event(&self, agent: &AgentId, kind: EventKind) -> Event {
        Event::new(self.clock.now(), agent.clone(), kind)
    }

    pub(crate) fn slot(&self, agent: &AgentId) -> Option<Slot> {
        self.read_agents().get(agent).cloned()
    }

    pub(crate) fn display_name(&self, agent: &AgentId) -> String {
        match self.read_agents().get(agent) {
            Some(Slot::Running(rt)) => rt.spec.name.clone(),
            Some(Slot::Stopped(spec)) => spec.name.clone(),
            _ => agent.to_string(),
        }
    }

    /// Whether every delivery is stored before it is queued: on a durable delivery store, and
    /// under a placement (the shared store is the queue of an agent hosted in another process,
    /// and the record an agent taken over starts from).
    pub(crate) fn stores_every_delivery(&self) -> bool {
        self.hosting.is_some() || self.stores.deliveries.is_durable()
    }

    /// Wakes the process hosting `agent` when it is not running here (under a placement): a hint
    /// only, its failure is an error event (the host's periodic check finds the work anyway).
    pub(crate) async fn wake_elsewhere(&self, agent: &AgentId) {
        let Some(hosting) = &self.hosting else {
            return;
        };
        if matches!(self.slot(agent), Some(Slot::Running(_))) {
            return;
        }
        if let Err(e) = hosting.placement.notify(agent).await {
            crate::runtime::agent::report_error(
                self,
                agent,
                None,
                format!("wake-up hint not sent (the host's periodic check finds the work): {e}"),
            );
        }
    }

    /// Hands `envelope` to `agent`. On a durable store it is stored first (acknowledged means
    /// stored), then queued when the agent runs (the queue is the fast path and the wake-up). On a
    /// memory store it is queued when the agent runs and kept in the pending deliveries when it is
    /// stopped. With `overflow_to_store`, a full queue also keeps it for later (the loop picks it
    /// up when its queue runs empty) instead of refusing.
    pub(crate) async fn enqueue(
        &self,
        agent: &AgentId,
        envelope: Envelope,
        overflow_to_store: bool,
    ) -> Result<(), DeliveryError> {
        self.enqueue_then(agent, envelope, overflow_to_store, None)
            .await
    }

    /// [`enqueue`](Self::enqueue), running `kept` once the envelope is kept (stored, or about to
    /// be queued) and before the agent can take it: what the sender records about the hand-over
    /// (a completion notice marked sent) is then done before the receiver's turn can answer it.
    /// `kept` does not run when the envelope is refused (an unknown or ended agent, a store
    /// error); call it with `overflow_to_store`, so that a full queue refuses nothing after it ran.
    pub(crate) async fn enqueue_then(
        &self,
        agent: &AgentId,
        envelope: Envelope,
        overflow_to_store: bool,
        mut kept: Option<futures::future::BoxFuture<'_, ()>>,
    ) -> Result<(), DeliveryError> {
        let durable = self.stores_every_delivery();
        match self.slot(agent) {
            Some(Slot::Running(rt)) => {
                if !overflow_to_store && rt.queue.len() >= rt.queue.capacity() {
                    return Err(DeliveryError::QueueFull(QueueError::Full {
                        agent: agent.clone(),
                        capacity: rt.queue.capacity(),
                    }));
                }
            }
            Some(Slot::Stopped(_)) => {}
            Some(Slot::Ended) => {
                return Err(DeliveryError::Ended {
                    agent: agent.clone(),
                });
            }
            None => {
                return Err(DeliveryError::UnknownAgent {
                    agent: agent.to_string(),
                });
            }
        }
        if durable {
            self.stores.deliveries.persist(agent, &envelope).await?;
            if let Some(kept) = kept.take() {
                kept.await;
            }
        } else if matches!(self.slot(agent), Some(Slot::Running(_)))
            && let Some(kept) = kept.take()
        {
            // Queued below (or, should the agent stop meanwhile, kept in the store).
            kept.await;
        }
        // Checked again after the write: the agent may have started or stopped meanwhile. A start
        // reads the store after it marks the agent running, so an envelope stored before that is
        // handed over by the start, and one stored after it is queued here.
        let envelope = match self.slot(agent) {
            Some(Slot::Running(rt)) => {
                if !rt.admit(&envelope.id) {
                    return Ok(());
                }
                match rt.queue.try_push(envelope) {
                    Ok(()) => return Ok(()),
                    Err((e @ QueueError::Full { .. }, envelope)) => {
                        rt.forget(std::slice::from_ref(&envelope.id));
                        if durable {
                            rt.pending.store(true, Ordering::Release);
                            return Ok(());
                        }
                        if !overflow_to_store {
                            return Err(DeliveryError::QueueFull(e));
                        }
                        rt.pending.store(true, Ordering::Release);
                        *envelope
                    }
                    // Closed: the agent is stopping and its queue goes to the store; so does this.
                    Err((_, envelope)) => {
                        rt.forget(std::slice::from_ref(&envelope.id));
                        *envelope
                    }
                }
            }
            _ => envelope,
        };
        if durable {
            let mut event = self.event(agent, EventKind::DeliveryPersisted);
            event.channel = Some(envelope.channel.clone());
            self.emit(event);
            self.wake_elsewhere(agent).await;
            return Ok(());
        }
        self.persist(agent, envelope.clone()).await?;
        if let Some(kept) = kept.take() {
            kept.await;
        }
        // Here the write comes after the check above: a start that marked the agent running and
        // read the store in between missed this envelope. Queue it as that start would have (a
        // start that read it already has it in `loaded`, so it is not queued twice).
        if let Some(Slot::Running(rt)) = self.slot(agent)
            && rt.admit(&envelope.id)
        {
            let id = envelope.id.clone();
            if rt.queue.try_push(envelope).is_err() {
                rt.forget(std::slice::from_ref(&id));
                rt.pending.store(true, Ordering::Release);
            }
        }
        Ok(())
    }

    /// Keeps an envelope for a stopped (or overflowing) agent in its pending deliveries.
    pub(crate) async fn persist(
        &self,
        agent: &AgentId,
        envelope: Envelope,
    ) -> Result<(), DeliveryError> {
        self.stores.deliveries.persist(agent, &envelope).await?;
        let mut event = self.event(agent, EventKind::DeliveryPersisted);
        event.channel = Some(envelope.channel.clone());
        self.emit(event);
        Ok(())
    }
}

impl OrgInner {
    /// The gate serializing `agent`'s outbox flushes.
    pub(crate) fn flush_gate(&self, agent: &AgentId) -> Arc<futures::lock::Mutex<()>> {
        lock(&self.flush_gates)
            .entry(agent.clone())
            .or_default()
            .clone()
    }

    /// Adds to an agent's token count.
    pub(crate) fn add_usage(&self, agent: &AgentId, usage: crate::llm::Usage) {
        let mut all = lock(&self.usage);
        let entry = all.entry(agent.clone()).or_default();
        *entry = entry.plus(usage);
    }

    /// Whether a custom executor of this process still works on the claim of `holder`.
    pub(crate) fn live_claim(&self, holder: &str) -> bool {
        lock(&self.live_claims).contains(holder)
    }

    /// Whether `agent`'s loop here is stopping as a hand-over to its next host (see
    /// [`OrgInner::handing_over`]).
    pub(crate) fn is_handing_over(&self, agent: &AgentId) -> bool {
        lock(&self.handing_over).contains(agent)
    }

    /// Called when an agent's loop ended: the behaviours let go of what the agent held.
    pub(crate) async fn behaviours_agent_stopped(self: &Arc<Self>, agent: &AgentId) {
        let org = Organization {
            inner: self.clone(),
        };
        for behaviour in &self.behaviours {
            behaviour.on_agent_stopped(&org, agent).await;
        }
    }
}

impl Organization {
    /// Offers a finished answer to the behaviours; `true` when one routed it (it then does not go
    /// to the agent's outbound).
    pub(crate) async fn behaviours_route_reply(
        &self,
        agent: &AgentId,
        channel: &ChannelId,
        text: &str,
        answered: &[Envelope],
        cause: &EnvelopeId,
    ) -> bool {
        let answer = crate::runtime::behaviour::Answer {
            agent,
            channel,
            text,
            answered,
            cause,
        };
        for behaviour in &self.inner.behaviours {
            if behaviour.route_answer(self, &answer).await {
                return true;
            }
        }
        false
    }

    /// The organization's settings.
    pub fn settings(&self) -> &Settings {
        &self.inner.settings
    }

    /// The configuration it was built from.
    pub fn config(&self) -> &OrgConfig {
        &self.inner.config
    }

    /// The stores.
    pub fn stores(&self) -> &Stores {
        &self.inner.stores
    }

    /// The clock.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.inner.clock
    }

    /// The prompt templates.
    pub fn prompts(&self) -> &Prompts {
        &self.inner.prompts
    }

    /// The current link graph (a snapshot).
    pub fn graph(&self) -> Arc<LinkGraph> {
        self.inner.graph()
    }

    /// The stream of root agents' replies, when no outbound was set on the builder. `None` if an
    /// outbound was set or the stream was taken already. While it waits for a reply, the stream
    /// runs the organization's ready agent loops in the caller's task (see [`Replies`]).
    ///
    /// [`Replies`]: crate::Replies
    pub fn take_replies(&self) -> Option<crate::Replies> {
        let rx = self
            .inner
            .replies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()?;
        Some(crate::Replies::new(rx, self.inner.loops.helper()))
    }

    /// Every agent id (running, stopped and ended children excluded), sorted.
    pub fn agent_ids(&self) -> Vec<AgentId> {
        let mut ids: Vec<AgentId> = self
            .inner
            .read_agents()
            .iter()
            .filter(|(_, s)| !matches!(s, Slot::Ended))
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort();
        ids
    }

    /// Whether the agent's loop is running.
    pub fn is_running(&self, agent: &AgentId) -> bool {
        matches!(self.inner.slot(agent), Some(Slot::Running(_)))
    }

    /// The display name of an agent (its id when unknown).
    pub fn display_name(&self, agent: &AgentId) -> String {
        self.inner.display_name(agent)
    }

    /// Number of envelopes waiting in a running agent's queue.
    pub fn queue_len(&self, agent: &AgentId) -> Option<usize> {
        match self.inner.slot(agent) {
            Some(Slot::Running(rt)) => Some(rt.queue.len()),
            _ => None,
        }
    }

    /// Takes every envelope waiting in a running agent's queue, without processing it (for an
    /// application that moves work elsewhere, or to measure delivery alone). The envelopes are the
    /// caller's from then on; `None` when the agent is not running.
    pub fn take_queued(&self, agent: &AgentId) -> Option<Vec<Envelope>> {
        match self.inner.slot(agent) {
            Some(Slot::Running(rt)) => Some(rt.queue.drain()),
            _ => None,
        }
    }

    /// The topology: agents (configured ones) and links, as seed 003's JSON, DOT or Mermaid.
    pub fn topology(&self) -> Topology {
        let graph = self.inner.graph();
        let agents = self.inner.config.agents.iter().map(TopologyAgent::from);
        Topology::from_parts(agents, graph.links().iter().cloned())
    }

    /// Replaces the links with what the link store holds now (after links were created, updated or
    /// deleted through the store at runtime). Configured links win again on the next start.
    pub async fn reload_links(&self) -> Result<(), OrgError> {
        let links: Vec<AgentLink> = self.inner.stores.links.list().await?;
        let agents = self
            .inner
            .config
            .agents
            .iter()
            .map(|a| a.id.clone())
            .collect::<Vec<_>>();
        let graph = LinkGraph::new(agents, links);
        self.inner.set_graph(graph);
        Ok(())
    }

    /// Delivers a message from an external gateway to `agent`: resolves the agent and enqueues.
    /// It never runs the model. A running agent's full queue is [`DeliveryError::QueueFull`]; a
    /// stopped agent's message is persisted and handed over, once, when it starts.
    ///
    /// Returns the id of the envelope, which replies name in [`Reply::in_reply_to`].
    pub async fn deliver(
        &self,
        agent: &str,
        message: InboundMessage,
    ) -> Result<EnvelopeId, DeliveryError> {
        let agent = self.resolve(agent)?;
        let channel = message.channel.clone().unwrap_or_else(|| {
            ChannelId::new(format!("{}:{}", message.platform, message.reply_target))
        });
        let source = Source::External {
            platform: message.platform,
            reply_target: message.reply_target,
        };
        let mut envelope = Envelope::new(
            source,
            channel,
            EnvelopeKind::UserMessage,
            message.content,
            self.inner.clock.now(),
        );
        envelope.metadata = message.metadata;
        // Namespaced: an application's key never meets the runtime's own (notices, replies).
        envelope.idempotency_key = message.idempotency_key.map(|k| format!("inbound:{k}"));
        let id = envelope.id.clone();
        self.inner.enqueue(&agent, envelope, false).await?;
        Ok(id)
    }

    /// Resolves an agent by id, or by display name (case-insensitive).
    pub fn resolve(&self, agent: &str) -> Result<AgentId, DeliveryError> {
        let agents = self.inner.read_agents();
        if let Some((id, _)) = agents.get_key_value(agent) {
            return Ok(id.clone());
        }
        let lower = agent.to_lowercase();
        let mut found = agents.iter().filter_map(|(id, slot)| {
            let name = match slot {
                Slot::Running(rt) => &rt.spec.name,
                Slot::Stopped(spec) => &spec.name,
                Slot::Ended => return None,
            };
            (name.to_lowercase() == lower || id.as_str().to_lowercase() == lower).then_some(id)
        });
        match (found.next(), found.next()) {
            (Some(id), None) => Ok(id.clone()),
            _ => Err(DeliveryError::UnknownAgent {
                agent: agent.to_string(),
            }),
        }
    }

    /// Sends a typed envelope from `from` to `to` over the internal channel. The sender is stamped
    /// here, from `from`, never from model output.
    ///
    /// Policy: a task or cancel needs a link that lets `from` start an exchange with `to`; an
    /// announcement may also travel back along a one-way link. A parent and its child may always
    /// message each other. A cancel does not enter the queue: it stops the receiver's running turn
    /// at once and keeps what is queued.
    ///
    /// Errors: unknown or ended receiver, a policy denial, or a full queue (the sender may retry).
    /// A stopped receiver gets the envelope persisted, handed over once when it starts.
    pub async fn send_internal(
        &self,
        from: &AgentId,
        to: &AgentId,
        message: InternalMessage,
    ) -> Result<EnvelopeId, DeliveryError> {
        let open = match message.kind {
            InternalKind::Announce => self.exchange_open(from, to).await?,
            _ => false,
        };
        let link_id = self.check_internal(from, to, message.kind, open)?;
        let envelope = Envelope::new(
            Source::Internal {
                from_agent: from.clone(),
                link_id: link_id.clone(),
            },
            ChannelId::link(to, from),
            message.kind.envelope_kind(),
            message.content,
            self.inner.clock.now(),
        );
        let id = envelope.id.clone();
        if message.kind == InternalKind::Cancel {
            self.cancel_turn(to);
            let mut event = self.inner.event(to, EventKind::TurnCancelled);
            event.link = link_id;
            event.channel = Some(envelope.channel.clone());
            self.inner.emit(event);
            return Ok(id);
        }
        self.inner.enqueue(to, envelope, false).await?;
        {
            let mut open = lock(&self.inner.internal_open);
            match message.kind {
                InternalKind::Task => *open.entry((from.clone(), to.clone())).or_default() += 1,
                InternalKind::Announce => {
                    let key = (to.clone(), from.clone());
                    if let Some(n) = open.get_mut(&key) {
                        *n = n.saturating_sub(1);
                        if *n == 0 {
                            open.remove(&key);
                        }
                    }
                }
                _ => {}
            }
        }
        let mut sent = self
            .inner
            .event(from, EventKind::MessageSent { to: to.clone() });
        sent.link = link_id;
        self.inner.emit(sent);
        Ok(id)
    }

    /// The policy check of [`Organization::send_internal`]; returns the link used, if any.
    fn check_internal(
        &self,
        from: &AgentId,
        to: &AgentId,
        kind: InternalKind,
        exchange_open: bool,
    ) -> Result<Option<crate::ids::LinkId>, DeliveryError> {
        let agents = self.inner.read_agents();
        let related = |a: &AgentId, b: &AgentId| match agents.get(a) {
            Some(Slot::Running(rt)) => rt.spec.parent.as_ref().is_some_and(|p| &p.parent == b),
            Some(Slot::Stopped(spec)) => spec.parent.as_ref().is_some_and(|p| &p.parent == b),
            _ => false,
        };
        match agents.get(to) {
            None => {
                return Err(DeliveryError::UnknownAgent {
                    agent: to.to_string(),
                });
            }
            Some(Slot::Ended) => return Err(DeliveryError::Ended { agent: to.clone() }),
            Some(_) => {}
        }
        if related(from, to) || related(to, from) {
            return Ok(None);
        }
        drop(agents);
        let graph = self.inner.graph.read().unwrap_or_else(|e| e.into_inner());
        let link = match kind {
            InternalKind::Announce => match policy::check_start(&graph, from, to) {
                Ok(link) => link,
                Err(_) => policy::check_answer(&graph, from, to, exchange_open)?,
            },
            InternalKind::Task | InternalKind::Cancel => policy::check_start(&graph, from, to)?,
        };
        Ok(Some(link.id.clone()))
    }

    /// Whether an exchange that `to` started with `from` is open: a conversation between them, or a
    /// task `to` delegated to `from` that has not ended. On a one-way link `to -> from`, `from` may
    /// answer inside such an exchange but not start one.
    async fn exchange_open(&self, from: &AgentId, to: &AgentId) -> Result<bool, DeliveryError> {
        if lock(&self.inner.internal_open)
            .get(&(to.clone(), from.clone()))
            .is_some_and(|n| *n > 0)
        {
            return Ok(true);
        }
        for behaviour in &self.inner.behaviours {
            if behaviour.exchange_open(self, from, to).await? {
                return Ok(true);
            }
        }
        // The count above lives in this process: a task `to` sent that `from` has not consumed
        // yet is also found in `from`'s stored deliveries (after a restart, or when the task was
        // sent from another process).
        let pending = self.inner.stores.deliveries.pending(from).await?;
        Ok(pending.iter().any(|e| {
            e.kind == EnvelopeKind::TaskAssigned
                && matches!(&e.source, Source::Internal { from_agent, .. } if from_agent == to)
        }))
    }

    /// Cancels the agent's running turn, if any. The message being answered gets no reply (a
    /// `TurnCancelled` event and a system record say so); everything queued stays queued, including
    /// a message that a steer put back. Returns whether a turn was running.
    pub fn cancel_turn(&self, agent: &AgentId) -> bool {
        match self.inner.slot(agent) {
            Some(Slot::Running(rt)) => {
                let handle = rt.abort.lock().unwrap_or_else(|e| e.into_inner()).take();
                handle.map(|h| h.abort()).is_some()
            }
            _ => false,
        }
    }

    /// Starts every configured agent that is not running.
    ///
    /// Under a placement ([`OrganizationBuilder::placement`](crate::OrganizationBuilder::placement))
    /// it starts the hosting loops instead: this process acquires leases on free agents up to its
    /// capacity and starts those (the first round before this returns), renews them, and takes
    /// over agents whose host died.
    pub async fn start_all(&self) -> Result<(), OrgError> {
        for behaviour in &self.inner.behaviours {
            behaviour.on_start_all(self).await?;
        }
        if let Some(hosting) = &self.inner.hosting {
            crate::runtime::hosting::start(self, hosting).await;
            return Ok(());
        }
        for agent in self.agent_ids() {
            self.start_agent(&agent).await?;
        }
        Ok(())
    }

    /// Starts an agent: creates its queue, hands over its pending deliveries (once, in the order
    /// they were persisted) and spawns its loop. Starting a running agent does nothing.
    ///
    /// Under a placement a configured agent runs where its lease is held: starting one this
    /// process does not hold is refused ([`OrgError::Invalid`]); `start_all` places them.
    pub async fn start_agent(&self, agent: &AgentId) -> Result<(), OrgError> {
        if let Some(hosting) = &self.inner.hosting
            && self.inner.config.agents.iter().any(|a| &a.id == agent)
            && !hosting.hosted().contains(agent)
        {
            return Err(OrgError::Invalid(InvalidInput::new(
                "start_agent",
                format!(
                    "agent {agent} is placed by lease; this process ({}) does not hold it",
                    hosting.options.process
                ),
            )));
        }
        self.start_local(agent).await
    }

    /// Starts an agent here, whatever the placement (its caller holds the lease).
    pub(crate) async fn start_local(&self, agent: &AgentId) -> Result<(), OrgError> {
        let spec = match self.inner.slot(agent) {
            Some(Slot::Running(_)) => return Ok(()),
            Some(Slot::Stopped(spec)) => spec,
            Some(Slot::Ended) => return Err(OrgError::Ended(agent.clone())),
            None => return Err(OrgError::UnknownAgent(agent.clone())),
        };
        let (done_tx, done_rx) = oneshot::channel();
        let (bell_tx, bell_rx) = mpsc::channel(1);
        let runtime = Arc::new(AgentRuntime {
            spec: spec.clone(),
            queue: BoundedQueue::new(agent.clone(), self.inner.settings.queue_capacity),
            pending: AtomicBool::new(false),
            abort: Mutex::new(None),
            fence: Mutex::new(None),
            executors: Mutex::new(HashMap::new()),
            stopped: Mutex::new(Some(done_rx)),
            doorbell: Mutex::new(Some(bell_tx)),
            bell_rx: Mutex::new(Some(bell_rx)),
            bell_taken: AtomicBool::new(false),
            worker_due: AtomicBool::new(false),
            worker_rounds: AtomicUsize::new(0),
            busy: AtomicBool::new(false),
            running_tasks: Mutex::new(HashMap::new()),
            known: Mutex::default(),
            loaded: Mutex::default(),
            reply_sources: Mutex::new(HashMap::new()),
        });
        {
            let mut agents = self.inner.write_agents();
            match agents.get(agent) {
                Some(Slot::Stopped(_)) => {
                    agents.insert(agent.clone(), Slot::Running(runtime.clone()));
                }
                // Someone else started (or ended) it meanwhile.
                _ => return Ok(()),
            }
        }
        // Read only now that the agent is marked running: a delivery stored before this read is
        // handed over here, one stored after it is queued by the delivery itself.
        match self.inner.stores.deliveries.pending(agent).await {
            Ok(pending) => {
                {
                    let mut loaded = lock(&runtime.loaded);
                    let known = lock(&runtime.known);
                    for envelope in &pending {
                        if !known.contains(&envelope.id) {
                            loaded.insert(envelope.id.clone());
                        }
                    }
                }
                // Handed over past the bound, ahead of anything queued meanwhile: these were
                // admitted before.
                let known = lock(&runtime.known).clone();
                for envelope in pending.into_iter().rev() {
                    if !known.contains(&envelope.id) {
                        let _ = runtime.queue.push_front(envelope);
                    }
                }
            }
            Err(e) => {
                // The loop tries again when its queue runs empty.
                runtime.pending.store(true, Ordering::Release);
                crate::runtime::agent::report_error(
                    &self.inner,
                    agent,
                    None,
                    format!("pending deliveries not read at start: {e}"),
                );
            }
        }
        self.inner
            .emit(self.inner.event(agent, EventKind::AgentStarted));
        let inner = self.inner.clone();
        let loop_runtime = runtime.clone();
        let (fence, fenced) = AbortHandle::new_pair();
        *lock(&runtime.fence) = Some(fence);
        let counted = self.inner.background.enter();
        self.inner.loops.spawn(Box::pin(async move {
            let id = loop_runtime.id().clone();
            let run = crate::runtime::agent::run_loop(inner.clone(), loop_runtime);
            if Abortable::new(run, fenced).await.is_err() {
                // Fenced: the loop ended mid-way, the end of `run_loop` did not run.
                inner.behaviours_agent_stopped(&id).await;
                inner.emit(inner.event(&id, EventKind::AgentStopped));
            }
            // The organization is let go before the loop says it ended: a shutdown that returns
            // leaves no loop holding the stores.
            drop(inner);
            let _ = done_tx.send(());
            drop(counted);
        }));
        let worker = crate::runtime::behaviour::AgentWorker { rt: runtime };
        for behaviour in &self.inner.behaviours {
            behaviour.on_agent_started(self, worker.clone());
        }
        Ok(())
    }

    /// Stops hosting an agent at once (its placement lease was lost or not renewed in time): it is
    /// marked stopped, its queue closed and its doorbell taken (the task loop ends), and its loop
    /// aborted wherever it is. The running turn is not committed: the envelopes it consumed stay
    /// in the store (every delivery is stored under a placement) and its next host runs it again,
    /// its effects kept from repeating by their idempotency keys. Waits for the loop to end.
    pub(crate) async fn fence_agent(&self, agent: &AgentId) {
        lock(&self.inner.handing_over).insert(agent.clone());
        self.fence_agent_now(agent).await;
        lock(&self.inner.handing_over).remove(agent);
    }

    /// Stops an agent hosted under a placement for its next host to take it over (a clean
    /// shutdown of this process): [`stop_agent`](Self::stop_agent), without ending its session
    /// (its conversations stay open).
    ///
    /// The agent's custom executor attempts are aborted, not awaited (they may run for hours):
    /// their next host finds their claims orphaned and runs them again at once.
    pub(crate) async fn stop_for_hand_over(&self, agent: &AgentId) -> Result<(), OrgError> {
        self.stop_keeping_session(agent, true).await
    }

    /// [`stop_agent`](Self::stop_agent) without ending the agent's session (its conversations
    /// stay open); with `abort_executors`, its custom executor attempts are aborted.
    async fn stop_keeping_session(
        &self,
        agent: &AgentId,
        abort_executors: bool,
    ) -> Result<(), OrgError> {
        lock(&self.inner.handing_over).insert(agent.clone());
        let runtime = match self.inner.slot(agent) {
            Some(Slot::Running(rt)) => Some(rt),
            _ => None,
        };
        let stopped = self.stop_agent(agent).await;
        if let Some(runtime) = runtime.filter(|_| abort_executors) {
            runtime.abort_executors();
        }
        lock(&self.inner.handing_over).remove(agent);
        stopped
    }

    async fn fence_agent_now(&self, agent: &AgentId) {
        let runtime = {
            let mut agents = self.inner.write_agents();
            match agents.get(agent) {
                Some(Slot::Running(rt)) => {
                    let rt = rt.clone();
                    agents.insert(agent.clone(), Slot::Stopped(rt.spec.clone()));
                    rt
                }
                _ => return,
            }
        };
        let _ = runtime.queue.close();
        lock(&runtime.doorbell).take();
        if let Some(fence) = lock(&runtime.fence).take() {
            fence.abort();
        }
        runtime.abort_executors();
        let done = lock(&runtime.stopped).take();
        if let Some(done) = done {
            let _ = done.await;
        }
    }

    /// Stops an agent: closes its queue, persists what was still queued (handed over again at the
    /// next start), lets the running turn finish, and waits for the loop to end.
    pub async fn stop_agent(&self, agent: &AgentId) -> Result<(), OrgError> {
        let runtime = {
            let mut agents = self.inner.write_agents();
            match agents.get(agent) {
                Some(Slot::Running(rt)) => {
                    let rt = rt.clone();
                    agents.insert(agent.clone(), Slot::Stopped(rt.spec.clone()));
                    rt
                }
                Some(Slot::Stopped(_)) => return Ok(()),
                Some(Slot::Ended) => return Err(OrgError::Ended(agent.clone())),
                None => return Err(OrgError::UnknownAgent(agent.clone())),
            }
        };
        let rest = runtime.queue.close();
        runtime
            .doorbell
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        // A durable store holds every queued envelope already.
        let rest = if self.inner.stores_every_delivery() {
            Vec::new()
        } else {
            rest
        };
        for envelope in rest {
            self.inner
                .persist(agent, envelope)
                .await
                .map_err(|e| match e {
                    DeliveryError::Store(s) => OrgError::Store(s),
                    other => OrgError::Invalid(InvalidInput::new("stop", other.to_string())),
                })?;
        }
        let done = runtime
            .stopped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(done) = done {
            let _ = done.await;
        }
        Ok(())
    }

    /// Stops every running agent. Under a placement it also stops the hosting loops and releases
    /// this process's leases, so that other processes take its agents over at once.
    ///
    /// A shutdown ends no agent's session (as a crash ends none): open conversations stay open
    /// and go on when the agents start again (in this process or, under a placement, in
    /// another), while [`stop_agent`](Self::stop_agent) severs the stopped agent's conversations.
    pub async fn shutdown(&self) -> Result<(), OrgError> {
        if let Some(hosting) = &self.inner.hosting {
            crate::runtime::hosting::shutdown(self, hosting).await;
        }
        let running: Vec<AgentId> = self
            .inner
            .read_agents()
            .iter()
            .filter(|(_, s)| matches!(s, Slot::Running(_)))
            .map(|(id, _)| id.clone())
            .collect();
        for agent in running {
            // A custom executor's attempt is cut as a crash would cut it: its claim is recovered
            // at the next start (not counted as a failed attempt), and it writes nothing after
            // the shutdown returned.
            self.stop_keeping_session(&agent, true).await?;
        }
        // Task loops, executor attempts and wake-ups end with their agents: once they have,
        // nothing of the organization uses the stores, and dropping the last handles releases
        // them (a data directory can be opened again at once).
        self.inner.background.idle().await;
        Ok(())
    }

    /// Starts a child of `parent` on `spec.task`. The child's replies go to the parent's queue (in
    /// `spec.report_to`, default `child:{parent}:{child}`) and wake it; a child whose turn fails, or
    /// whose result cannot be delivered, is reported to the parent as well. Returns the child's id.
    pub async fn spawn_child(
        &self,
        parent: &AgentId,
        spec: ChildSpec,
    ) -> Result<AgentId, OrgError> {
        match self.inner.slot(parent) {
            Some(Slot::Running(_) | Slot::Stopped(_)) => {}
            Some(Slot::Ended) => return Err(OrgError::Ended(parent.clone())),
            None => return Err(OrgError::UnknownAgent(parent.clone())),
        }
        let n = self.inner.child_counter.fetch_add(1, Ordering::Relaxed) + 1;
        // The instance tag keeps a child's id unique across restarts: a child spawned after a crash
        // never takes over the stored queue of one that died with the process.
        let child = AgentId::parse(format!("{parent}.child-{n}-{}", self.inner.instance_tag))?;
        let report_to = spec
            .report_to
            .clone()
            .unwrap_or_else(|| ChannelId::new(format!("child:{parent}:{child}")));
        let outbound = Arc::new(crate::runtime::agent::ParentOutbound {
            org: Arc::downgrade(&self.inner),
            parent: parent.clone(),
            child: child.clone(),
            report_to: report_to.clone(),
        });
        let agent_spec = AgentSpec {
            id: child.clone(),
            name: spec.name.clone(),
            identity: Identity::default(),
            parent: Some(ParentLink {
                parent: parent.clone(),
                report_to,
                end_after_reply: spec.end_after_reply,
            }),
            outbound,
            instructions: spec.instructions.clone(),
        };
        self.inner
            .write_agents()
            .insert(child.clone(), Slot::Stopped(Arc::new(agent_spec)));
        let task = Envelope::new(
            Source::Internal {
                from_agent: parent.clone(),
                link_id: None,
            },
            ChannelId::new(format!("parent:{child}:{parent}")),
            EnvelopeKind::TaskAssigned,
            spec.task,
            self.inner.clock.now(),
        );
        self.start_local(&child).await?;
        self.inner
            .enqueue(&child, task, true)
            .await
            .map_err(|e| OrgError::Invalid(InvalidInput::new("child task", e.to_string())))?;
        Ok(child)
    }

    /// Ends an agent for good: it stops, and later deliveries to it are [`DeliveryError::Ended`].
    /// What was still queued is handed back to the caller.
    pub(crate) fn end_agent(&self, agent: &AgentId) -> Vec<Envelope> {
        let previous = self.inner.write_agents().insert(agent.clone(), Slot::Ended);
        match previous {
            Some(Slot::Running(rt)) => {
                rt.doorbell.lock().unwrap_or_else(|e| e.into_inner()).take();
                rt.queue.close()
            }
            _ => Vec::new(),
        }
    }
}
