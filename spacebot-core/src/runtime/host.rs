//! The host: the state behind an [`Organization`](crate::Organization) (its agents' slots, queues,
//! stores, events, behaviours) and the operations every message walks through (enqueue, persist,
//! emit). It knows no behaviour: delegation, conversations and your own plug in through
//! [`Behaviour`](crate::runtime::behaviour::Behaviour) and reach the host through a
//! [`BehaviourContext`](crate::runtime::behaviour::BehaviourContext).
//!
//! The facade ([`Organization`](crate::Organization)) forwards to it; nothing here imports the
//! facade or a behaviour.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};

use futures::channel::{mpsc, oneshot};
use futures::future::AbortHandle;

use crate::config::{OrgConfig, Settings};
use crate::envelope::{Envelope, Source};
use crate::event::{Event, EventKind, EventSink};
use crate::ids::{AgentId, ChannelId, EnvelopeId};
use crate::llm::LlmProvider;
use crate::policy::LinkGraph;
use crate::prompts::{Identity, Prompts};
use crate::runtime::behaviour::{Behaviour, BehaviourContext};
use crate::runtime::errors::DeliveryError;
use crate::runtime::outbound::{Outbound, Reply};
use crate::runtime::queue::{BoundedQueue, QueueError};
use crate::stores::Stores;
use crate::time::{Clock, Spawner};
use crate::tools::ToolRegistry;

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
    /// lost: see `Host::fence_agent`).
    pub(crate) fence: Mutex<Option<AbortHandle>>,
    pub(crate) stopped: Mutex<Option<oneshot::Receiver<()>>>,
    /// The doorbells of the behaviours' workers of this agent, by behaviour (capacity 1: a ring
    /// while one is pending is a no-op); `None` once the agent stops (the workers' bells end).
    pub(crate) bells: Mutex<Option<Vec<Bell>>>,
    /// Whether a behaviour's worker took the doorbell.
    pub(crate) bell_taken: AtomicBool,
    /// A ring (or the worker's start) not taken up by a worker round yet: the agent is not idle.
    pub(crate) worker_due: AtomicBool,
    /// Worker rounds running now (see [`AgentWorker::round`](crate::runtime::behaviour::AgentWorker::round)).
    pub(crate) worker_rounds: AtomicUsize,
    /// Whether the loop is handling an envelope.
    pub(crate) busy: AtomicBool,
    /// Work the behaviours claimed for this agent and have not finished: the claim's number (a
    /// task number for delegation) -> its lease holder. Counted against the agent's concurrency
    /// and in [`settled`](Self::settled); the host never reads what the numbers mean.
    pub(crate) claims: Mutex<HashMap<u64, String>>,
    /// Envelopes in the queue or in the running turn: a store hand-over skips them.
    pub(crate) known: Mutex<crate::fasthash::FastSet<EnvelopeId>>,
    /// Envelopes handed over from the store when the agent started: a delivery racing the start
    /// that pushes one of them again is not queued twice.
    pub(crate) loaded: Mutex<crate::fasthash::FastSet<EnvelopeId>>,
    /// The last external source seen per channel: a reply to a system message (a retrigger) in that
    /// channel goes to the same place. Kept in memory only.
    pub(crate) reply_sources: Mutex<HashMap<ChannelId, Source>>,
    /// What the agent keeps of each channel's history between its turns (see
    /// `runtime/window.rs`). Kept in memory only.
    pub(crate) memories: crate::runtime::window::Memories,
}

impl AgentRuntime {
    pub(crate) fn id(&self) -> &AgentId {
        &self.spec.id
    }

    /// Wakes every behaviour worker of the agent.
    pub(crate) fn ring(&self) {
        if self.bell_taken.load(Ordering::Acquire) {
            self.worker_due.store(true, Ordering::Release);
        }
        if let Some(bells) = lock(&self.bells).as_mut() {
            for (_, bell) in bells.iter_mut() {
                let _ = bell.try_send(());
            }
        }
    }

    /// Whether the loop waits for work (no turn running).
    pub(crate) fn idle(&self) -> bool {
        !self.busy.load(Ordering::Acquire)
    }

    /// Whether nothing is left to do: the queue empty, no turn, no claimed work, no worker round
    /// running or due.
    pub(crate) fn settled(&self) -> bool {
        self.queue.is_empty()
            && self.idle()
            && self.claim_count() == 0
            && !self.worker_due.load(Ordering::Acquire)
            && self.worker_rounds.load(Ordering::Acquire) == 0
    }

    pub(crate) fn claim_count(&self) -> usize {
        lock(&self.claims).len()
    }

    /// The claims counted against the task concurrency, as (task number, holder).
    pub(crate) fn running_claims(&self) -> Vec<(u64, String)> {
        lock(&self.claims)
            .iter()
            .map(|(n, h)| (*n, h.clone()))
            .collect()
    }

    pub(crate) fn claim_started(&self, number: u64, holder: &str) {
        lock(&self.claims).insert(number, holder.to_string());
    }

    /// Frees the slot of the claim `holder` on task `number` (a later claim of the same task keeps
    /// its own slot).
    pub(crate) fn claim_ended(&self, number: u64, holder: &str) {
        let mut running = lock(&self.claims);
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

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Debug, Clone)]
pub(crate) enum Slot {
    Running(Arc<AgentRuntime>),
    Stopped(Arc<AgentSpec>),
    Ended,
}

/// The shared state behind an [`Organization`](crate::Organization).
pub(crate) struct Host {
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
    /// Each configured agent's own `context_window`, read once from the config: a turn looks its
    /// agent's up here instead of scanning the config's agent list (linear in the agents).
    pub(crate) context_windows: crate::fasthash::FastMap<AgentId, u32>,
    /// Each configured agent's own period `limits`, read once from the config: a limited call
    /// looks its agent's up here instead of scanning the config's agent list.
    pub(crate) agent_period_limits: crate::fasthash::FastMap<AgentId, crate::limits::PeriodLimits>,
    pub(crate) replies: Mutex<Option<mpsc::UnboundedReceiver<Reply>>>,
    pub(crate) child_counter: AtomicU64,
    /// Internal tasks sent and not yet answered, per (sender, receiver): each lets the receiver
    /// announce back once, even over a one-way link.
    pub(crate) internal_open: Mutex<HashMap<(AgentId, AgentId), u32>>,
    /// Every event, for [`Organization::subscribe`](crate::Organization::subscribe) and the waits.
    pub(crate) bus: crate::bus::EventBus,
    /// The behaviours' own state in this process, one value per type (see
    /// [`BehaviourContext::state`]): the host stores it and never reads it.
    pub(crate) states: Mutex<HashMap<std::any::TypeId, Arc<dyn std::any::Any + Send + Sync>>>,
    /// Agents whose loop here is being stopped without ending their session (a shutdown; under a
    /// placement, a lease lost): their session goes on at the next start or in the next host, so
    /// their conversations are not severed.
    pub(crate) handing_over: Mutex<HashSet<AgentId>>,
    /// Callers of `wait_idle` waiting now: while there are any, every worker round that leaves its
    /// agent settled says so with an `AgentIdle` event (not only the rounds a ring started).
    pub(crate) idle_waiters: AtomicUsize,
    /// Agent loops handling an envelope now: while more than one is, their writes are issued
    /// [`together`](crate::durability::together) (a store may then gather them into one commit).
    pub(crate) handling: Arc<AtomicUsize>,
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
    /// Whether any request may be limited (`[settings.limits]`, or a message bound limits, now or
    /// before a restart): turns read the request ledger only then.
    pub(crate) limits_in_use: AtomicBool,
    /// The ledger of requests' spend (it remembers the entries it wrote last).
    pub(crate) request_ledger: crate::limits::RequestLedger,
    /// Calls waiting for a settlement of their request's reservations (see
    /// `runtime/governance.rs`).
    pub(crate) settle_waiters: Mutex<Vec<oneshot::Sender<()>>>,
    /// The keys of the model-call reservations this host made and has not settled yet: when
    /// the organization runs in one process, a reservation not among them was left by a run
    /// that ended without settling it (a crash), and no call waits for it.
    pub(crate) reserving: Mutex<crate::fasthash::FastSet<String>>,
    /// The flush of settlements made behind that waits for [`SETTLE_FLUSH_AFTER`]: set while
    /// one is scheduled; sending on it (shutdown) flushes at once.
    ///
    /// [`SETTLE_FLUSH_AFTER`]: crate::runtime::governance::SETTLE_FLUSH_AFTER
    pub(crate) settle_flush: Arc<Mutex<Option<oneshot::Sender<()>>>>,
    /// The period scopes an operator set limits for at run time (read at build, added to by
    /// `Organization::set_period_limits`): checked besides the configured ones.
    pub(crate) operator_periods: Mutex<Vec<crate::limits::Scope>>,
    /// This process's part in placement, when the organization spans several processes.
    pub(crate) hosting: Option<Arc<crate::runtime::hosting::Hosting>>,
    /// Counts the tokens of what turns send (the provider's counter, else the estimate).
    pub(crate) counter: Arc<dyn crate::context::TokenCounter>,
    /// The compaction hook; `None` when `[settings] compaction = false`.
    pub(crate) compaction: Option<Arc<dyn crate::context::Compaction>>,
}

/// A behaviour's doorbell: its name and the sending end.
pub(crate) type Bell = (String, mpsc::Sender<()>);

/// A rendering with the link-graph version it was made for.
type Versioned<T> = (u64, T);

/// A system prompt's cache key: the agent, and the peer when it answers in a link channel.
type PromptKey = (AgentId, Option<AgentId>);

/// System prompts and tool definitions per agent, reused while the link graph (their only input
/// that changes at run time) is the same.
#[derive(Debug, Default)]
pub(crate) struct RenderCache {
    prompts: Mutex<crate::fasthash::FastMap<PromptKey, Versioned<Arc<str>>>>,
    definitions: Mutex<crate::fasthash::FastMap<AgentId, Versioned<Definitions>>>,
    /// The distinct definition lists measured at the current version (agents offered the same
    /// tools share one list and its measure), at most [`MEASURED_LISTS`].
    measured: Mutex<Vec<Versioned<Definitions>>>,
    /// The definitions rendered for each distinct offer at one version (agents offered the same
    /// tools with the same descriptions share them without rendering them again), at most
    /// [`OFFERS`].
    offers: Mutex<Versioned<crate::fasthash::FastMap<crate::tools::Offer, Definitions>>>,
}

/// How many distinct offers the render cache keeps; past it, it starts again.
const OFFERS: usize = 4096;

/// How many distinct tool lists the render cache keeps measured; past it, it starts again.
const MEASURED_LISTS: usize = 32;

/// An agent's tool definitions with their sizes, measured once per rendering (serializing every
/// schema each turn was a good part of a turn's work).
#[derive(Debug, Clone)]
pub(crate) struct Definitions {
    /// What requests offer.
    pub(crate) list: Arc<[crate::llm::ToolDefinition]>,
    /// Their tokens, by the host's counter.
    pub(crate) tokens: u64,
    /// Their size for the limits' estimate ([`crate::limits::estimate_input`]).
    pub(crate) size: crate::limits::TextSize,
}

impl RenderCache {
    pub(crate) fn prompts(&self, key: &PromptKey) -> Option<Versioned<Arc<str>>> {
        lock(&self.prompts).get(key).cloned()
    }

    pub(crate) fn set_prompt(&self, key: PromptKey, version: u64, text: Arc<str>) {
        lock(&self.prompts).insert(key, (version, text));
    }

    pub(crate) fn definitions(&self, agent: &AgentId) -> Option<Versioned<Definitions>> {
        lock(&self.definitions).get(agent).cloned()
    }

    pub(crate) fn set_definitions(&self, agent: AgentId, version: u64, defs: Definitions) {
        lock(&self.definitions).insert(agent, (version, defs));
    }

    /// A list equal to `list` measured at `version`, shared (another agent offered the same
    /// tools): comparing is much cheaper than serializing every schema to measure it.
    pub(crate) fn measured(
        &self,
        version: u64,
        list: &[crate::llm::ToolDefinition],
    ) -> Option<Definitions> {
        let mut measured = lock(&self.measured);
        measured.retain(|(v, _)| *v == version);
        measured
            .iter()
            .find(|(_, d)| *d.list == *list)
            .map(|(_, d)| d.clone())
    }

    /// The definitions rendered at `version` for an agent offered `offer`.
    pub(crate) fn offered(&self, version: u64, offer: &crate::tools::Offer) -> Option<Definitions> {
        let offers = lock(&self.offers);
        if offers.0 != version {
            return None;
        }
        offers.1.get(offer).cloned()
    }

    /// Keeps `defs` (rendered at `version` for `offer`) for the next agent with the same offer.
    pub(crate) fn remember_offer(
        &self,
        version: u64,
        offer: crate::tools::Offer,
        defs: Definitions,
    ) {
        let mut offers = lock(&self.offers);
        if offers.0 != version || offers.1.len() >= OFFERS {
            offers.0 = version;
            offers.1.clear();
        }
        offers.1.insert(offer, defs);
    }

    /// Keeps `defs` (measured at `version`) for the next agent offered the same tools.
    pub(crate) fn remember_measured(&self, version: u64, defs: Definitions) {
        let mut measured = lock(&self.measured);
        if measured.len() >= MEASURED_LISTS {
            measured.clear();
        }
        measured.push((version, defs));
    }
}

impl fmt::Debug for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Organization")
            .field("agents", &self.read_agents().len())
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Host {
    /// Every agent that has not ended (configured and children), sorted.
    pub(crate) fn agent_ids(&self) -> Vec<AgentId> {
        let mut ids: Vec<AgentId> = self
            .read_agents()
            .iter()
            .filter(|(_, s)| !matches!(s, Slot::Ended))
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort();
        ids
    }

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

    /// Says the link policy refused `denied`: an [`EventKind::Refused`] event and, when a link
    /// joins the two agents (either way), a system record in the actor's link channel, so the
    /// link's timeline shows the attempt. `request` is the exchange the attempt belonged to.
    pub(crate) async fn refused(
        &self,
        denied: &crate::error::PolicyDenied,
        request: Option<&EnvelopeId>,
    ) {
        use crate::error::PolicyAction;
        let action = match denied.action {
            PolicyAction::Start => "start",
            PolicyAction::Answer => "answer",
            PolicyAction::Delegate => "delegate",
        };
        let actor = &denied.actor;
        let graph = self.graph();
        let link = graph
            .between(actor.as_str(), &denied.target)
            .or_else(|| graph.between(&denied.target, actor.as_str()))
            .cloned();
        if let Some(link) = &link {
            let peer = if &link.from == actor {
                &link.to
            } else {
                &link.from
            };
            let mut record = crate::channel::NewRecord::new(
                ChannelId::link(actor, peer),
                crate::channel::RecordKind::System,
                "system",
                format!("refused: {denied}"),
                self.clock.now(),
            );
            record
                .metadata
                .insert("refused".into(), serde_json::Value::String(action.into()));
            if let Err(e) = self.stores.channels.append(actor, record).await {
                crate::runtime::commit::report_error(
                    self,
                    actor,
                    None,
                    format!("the refusal was not recorded in the link channel: {e}"),
                );
            }
        }
        let mut event = self.event(
            actor,
            EventKind::Refused {
                target: denied.target.clone(),
                action: action.into(),
                reason: denied.reason.to_string(),
            },
        );
        event.link = link.map(|l| l.id);
        event.request = request.cloned();
        self.emit(event);
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
        kept: Option<futures::future::BoxFuture<'_, ()>>,
    ) -> Result<(), DeliveryError> {
        let durable = self.stores_every_delivery();
        self.hand_over(agent, envelope, overflow_to_store, kept, durable)
            .await
    }

    /// Queues an envelope of claimed work (a task the agent's task loop claimed) without storing
    /// it first: the task's claim on its board is the durable record, and a claim whose envelope
    /// is lost with the process is recovered when the agent's task loop starts again (an envelope
    /// stored for it would be refused then anyway: that attempt is over). It is stored, as
    /// on a memory store, only when the queue cannot take it (full, or closing).
    pub(crate) async fn enqueue_claimed(
        &self,
        agent: &AgentId,
        envelope: Envelope,
    ) -> Result<(), DeliveryError> {
        self.hand_over(agent, envelope, true, None, false).await
    }

    /// [`enqueue_then`](Self::enqueue_then); `durable`: the envelope is stored before it is
    /// queued (otherwise only when the queue cannot take it).
    async fn hand_over(
        &self,
        agent: &AgentId,
        envelope: Envelope,
        overflow_to_store: bool,
        mut kept: Option<futures::future::BoxFuture<'_, ()>>,
        durable: bool,
    ) -> Result<(), DeliveryError> {
        let mut envelope = envelope;
        if envelope.trace_context.is_none() {
            // Sent from within a span (a turn, a claim, a notice, the application's request):
            // the turn answering it continues that trace.
            envelope.trace_context = crate::telemetry::current_context();
        }
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

impl Host {
    /// The behaviours' value of type `T` (see [`BehaviourContext::state`]).
    pub(crate) fn state<T: std::any::Any + Send + Sync + Default>(&self) -> Arc<T> {
        let any = lock(&self.states)
            .entry(std::any::TypeId::of::<T>())
            .or_insert_with(|| Arc::new(T::default()))
            .clone();
        // Keyed by the type's id: the value is a `T`.
        any.downcast::<T>()
            .unwrap_or_else(|_| Arc::new(T::default()))
    }

    /// Adds to an agent's token count.
    pub(crate) fn add_usage(&self, agent: &AgentId, usage: crate::llm::Usage) {
        let mut all = lock(&self.usage);
        let entry = all.entry(agent.clone()).or_default();
        *entry = entry.plus(usage);
    }

    /// Whether `agent`'s loop here is stopping as a hand-over to its next host (see
    /// [`OrgInner::handing_over`]).
    pub(crate) fn is_handing_over(&self, agent: &AgentId) -> bool {
        lock(&self.handing_over).contains(agent)
    }

    /// Called when an agent's loop ended: the behaviours let go of what the agent held.
    /// Called when an agent stops here as a hand-over: the behaviours stop what they run for it.
    pub(crate) fn behaviours_handed_over(self: &Arc<Self>, agent: &AgentId) {
        let ctx = BehaviourContext::new(self.clone());
        for behaviour in &self.behaviours {
            behaviour.on_agent_handed_over(&ctx, agent);
        }
    }

    pub(crate) async fn behaviours_agent_stopped(self: &Arc<Self>, agent: &AgentId) {
        let ctx = BehaviourContext::new(self.clone());
        for behaviour in &self.behaviours {
            behaviour.on_agent_stopped(&ctx, agent).await;
        }
    }
}
