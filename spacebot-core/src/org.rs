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

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::config::{OrgConfig, Settings};
use crate::envelope::{Envelope, EnvelopeKind, Source};
use crate::error::InvalidInput;
use crate::event::EventKind;
use crate::ids::{AgentId, ChannelId, EnvelopeId};
use crate::link::AgentLink;
use crate::policy::{self, LinkGraph};
use crate::prompts::Prompts;
use crate::stores::Stores;
use crate::time::Clock;
use crate::topology::{Topology, TopologyAgent};

pub use crate::runtime::errors::{DeliveryError, OrgError};
pub use crate::runtime::host::ChildSpec;
pub(crate) use crate::runtime::host::{AgentSpec, Host as OrgInner, RenderCache, Slot, lock};

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
    /// Limits on what this request may spend, with `[settings.limits]` (the tighter binds): see
    /// [`with_limits`](Self::with_limits).
    pub limits: Option<crate::limits::Limits>,
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
            limits: None,
        }
    }

    /// Limits what this request may spend: its turns, every task delegated from it at any depth,
    /// every retrigger and conversation turn it leads to (see [`crate::limits`]). They are stored
    /// with the request before it is queued, so they hold across a restart.
    ///
    /// ```
    /// use spacebot_core::InboundMessage;
    /// use spacebot_core::limits::Limits;
    /// let message = InboundMessage::new("portal", "u1", "plan the launch")
    ///     .with_limits(Limits { total_tokens: Some(20_000), ..Limits::NONE });
    /// assert_eq!(message.limits.unwrap().total_tokens, Some(20_000));
    /// ```
    pub fn with_limits(mut self, limits: crate::limits::Limits) -> Self {
        self.limits = Some(limits);
        self
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

/// One running organization of agents. Cheap to clone (a handle).
#[derive(Debug, Clone)]
pub struct Organization {
    pub(crate) inner: Arc<OrgInner>,
}

impl Organization {
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
        self.inner.agent_ids()
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

    /// Says that what tools some agents are offered changed (a behaviour's grants, see
    /// [`Tool::offered_to`](crate::tools::Tool::offered_to)): the next turn of every agent renders
    /// its tool definitions (and system prompt) again.
    pub fn tools_changed(&self) {
        self.inner.graph_version.fetch_add(1, Ordering::AcqRel);
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
    /// Returns the id of the envelope, which replies name in
    /// [`Reply::in_reply_to`](crate::runtime::Reply::in_reply_to).
    pub async fn deliver(
        &self,
        agent: &str,
        message: InboundMessage,
    ) -> Result<EnvelopeId, DeliveryError> {
        self.deliver_as(agent, message, None).await
    }

    /// [`deliver`](Self::deliver), as part of request `cause` when given.
    pub(crate) async fn deliver_as(
        &self,
        agent: &str,
        message: InboundMessage,
        cause: Option<EnvelopeId>,
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
        let new_request = cause.is_none();
        if let Some(cause) = cause {
            envelope = envelope.with_cause(cause);
        }
        let id = envelope.id.clone();
        if new_request && self.inner.limits_in_use() {
            // A request begun here: nothing of it is stored yet.
            self.inner.request_ledger.begin_new(&id);
        }
        if let Some(limits) = message.limits.filter(|l| !l.is_none()) {
            self.inner.bind_limits(envelope.cause(), limits).await?;
        }
        self.inner.enqueue(&agent, envelope, false).await?;
        Ok(id)
    }

    /// Resolves an agent by id, or by display name (case-insensitive).
    pub fn resolve(&self, agent: &str) -> Result<AgentId, DeliveryError> {
        self.behaviour_context().resolve(agent)
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
        let link_id = match self.check_internal(from, to, message.kind, open) {
            Ok(link) => link,
            Err(DeliveryError::Denied(denied)) => {
                self.inner.refused(&denied, None).await;
                return Err(DeliveryError::Denied(denied));
            }
            Err(e) => return Err(e),
        };
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
            if behaviour
                .exchange_open(&self.behaviour_context(), from, to)
                .await?
            {
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
        self.inner.start_all().await
    }

    /// Starts an agent: creates its queue, hands over its pending deliveries (once, in the order
    /// they were persisted) and spawns its loop. Starting a running agent does nothing.
    ///
    /// Under a placement a configured agent runs where its lease is held: starting one this
    /// process does not hold is refused ([`OrgError::Invalid`]); `start_all` places them.
    pub async fn start_agent(&self, agent: &AgentId) -> Result<(), OrgError> {
        self.inner.start_agent(agent).await
    }

    /// Stops an agent: closes its queue, persists what was still queued (handed over again at the
    /// next start), lets the running turn finish, and waits for the loop to end.
    pub async fn stop_agent(&self, agent: &AgentId) -> Result<(), OrgError> {
        self.inner.stop_agent(agent).await
    }

    /// Stops every running agent. Under a placement it also stops the hosting loops and releases
    /// this process's leases, so that other processes take its agents over at once.
    ///
    /// A shutdown ends no agent's session (as a crash ends none): open conversations stay open
    /// and go on when the agents start again (in this process or, under a placement, in
    /// another), while [`stop_agent`](Self::stop_agent) severs the stopped agent's conversations.
    pub async fn shutdown(&self) -> Result<(), OrgError> {
        self.inner.shutdown().await
    }

    /// Starts a child of `parent` on `spec.task`. The child's replies go to the parent's queue (in
    /// `spec.report_to`, default `child:{parent}:{child}`) and wake it; a child whose turn fails, or
    /// whose result cannot be delivered, is reported to the parent as well. Returns the child's id.
    pub async fn spawn_child(
        &self,
        parent: &AgentId,
        spec: ChildSpec,
    ) -> Result<AgentId, OrgError> {
        self.inner.spawn_child(parent, spec).await
    }
}

impl Organization {
    /// This process's id under a placement (see
    /// [`OrganizationBuilder::placement`](crate::OrganizationBuilder::placement)), `None` without.
    pub fn process(&self) -> Option<&crate::placement::ProcessId> {
        self.inner.hosting.as_ref().map(|h| &h.options.process)
    }

    /// How many leases this process lost since it started (under a placement; 0 without one):
    /// agents fenced because a renewal found their lease taken or expired, or because no renewal
    /// succeeded by their deadline. Each loss also emits [`EventKind::PlacementLost`]. Without a
    /// process killed or cut off, it should stay 0: a renewal that starves (a busy database or
    /// machine) shows here.
    pub fn leases_lost(&self) -> u64 {
        self.inner.hosting.as_ref().map_or(0, |h| h.losses())
    }

    /// The configured agents whose loop runs in this process, sorted: under a placement those it
    /// holds a lease on and runs; without one, every running configured agent.
    pub fn hosted_agents(&self) -> Vec<AgentId> {
        let mut agents: Vec<AgentId> = self
            .inner
            .config
            .agents
            .iter()
            .map(|a| a.id.clone())
            .filter(|a| self.is_running(a))
            .filter(|a| self.inner.hosting.as_ref().is_none_or(|h| h.is_hosted(a)))
            .collect();
        agents.sort();
        agents
    }
}

impl Organization {
    /// The view of this organization a behaviour gets (see
    /// [`BehaviourContext`](crate::runtime::behaviour::BehaviourContext)).
    pub fn behaviour_context(&self) -> crate::runtime::behaviour::BehaviourContext {
        crate::runtime::behaviour::BehaviourContext::new(self.inner.clone())
    }
}

impl Organization {
    /// Wakes an agent's behaviour workers (its task loop): here, or with a hint to the process
    /// hosting it (see [`BehaviourContext::ring`](crate::BehaviourContext::ring)).
    pub(crate) fn ring(&self, agent: &AgentId) {
        self.behaviour_context().ring(agent);
    }
}

impl crate::delegation::TaskContext {
    /// What a custom executor gets for the claim `holder` of `task`: the organization's public
    /// API (the executor is the application's code), made here so that delegation itself reaches
    /// the host only through its [`BehaviourContext`](crate::BehaviourContext).
    pub(crate) fn new(
        ctx: &crate::runtime::behaviour::BehaviourContext,
        holder: String,
        task: crate::ids::TaskRef,
    ) -> Self {
        Self {
            org: Organization {
                inner: ctx.host.clone(),
            },
            holder,
            task,
        }
    }
}

impl crate::tools::ToolCapability {
    /// Resolves an agent by id or display name (case-insensitive).
    pub fn resolve(&self, agent: &str) -> Result<AgentId, DeliveryError> {
        self.behaviour_context().resolve(agent)
    }

    /// Sends a typed envelope to `to`, from this tool's agent (`from` must be that agent: a tool
    /// cannot send as another one). Policy-checked like [`Organization::send_internal`].
    pub async fn send_internal(
        &self,
        from: &AgentId,
        to: &AgentId,
        message: InternalMessage,
    ) -> Result<EnvelopeId, DeliveryError> {
        if from != self.agent() {
            return Err(DeliveryError::Invalid(InvalidInput::new(
                "from",
                format!(
                    "a tool of {} cannot send as {from}; the sender is always the calling agent",
                    self.agent()
                ),
            )));
        }
        let org = Organization {
            inner: self.host.clone(),
        };
        org.send_internal(from, to, message).await
    }
}
