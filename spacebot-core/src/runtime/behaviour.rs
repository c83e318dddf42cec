//! The one hook trait through which behaviours (delegation, conversations, your own) plug into the
//! host.
//!
//! The host (this module's siblings, behind [`Organization`](crate::Organization)) runs agents:
//! queues, turns, steering, outbound, events. It knows no behaviour. A [`Behaviour`] adds tools,
//! reacts at a few points of an agent's life, in the manner of an actor's lifecycle hooks, and
//! reaches the host only through a [`BehaviourContext`]:
//!
//! | hook | when |
//! |---|---|
//! | [`tools`](Behaviour::tools), [`config_section`](Behaviour::config_section) | when the organization is built |
//! | [`on_build`](Behaviour::on_build) | the organization was built (agents stopped): check the behaviour's configuration, load its state |
//! | [`on_start_all`](Behaviour::on_start_all) | [`Organization::start_all`](crate::Organization::start_all), before any agent starts |
//! | [`on_agent_started`](Behaviour::on_agent_started) | an agent's loop started (a behaviour may run its own worker beside it) |
//! | [`exchange_open`](Behaviour::exchange_open) | an announcement travels back along a one-way link: is an exchange open? |
//! | [`claim_valid`](Behaviour::claim_valid), [`checkpoint`](Behaviour::checkpoint), [`work_ended`](Behaviour::work_ended), [`work_key`](Behaviour::work_key) | a turn runs the behaviour's claimed work (an envelope with [`TaskWork`] whose owner it is) |
//! | [`owns_answer`](Behaviour::owns_answer), [`route_answer`](Behaviour::route_answer) | a turn produced an answer: is it this behaviour's to route (not streamed, not sent to the outbound)? |
//! | [`on_agent_stopped`](Behaviour::on_agent_stopped) | an agent's loop ended |
//!
//! Every hook has a default that does nothing, so a behaviour implements only what it needs.

use std::fmt;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use async_trait::async_trait;
use futures::channel::mpsc;

use crate::config::{OrgConfig, Settings};
use crate::envelope::{Envelope, TaskWork};
use crate::error::StoreError;
use crate::event::{Event, EventKind};
use crate::ids::{AgentId, ChannelId, EnvelopeId};
use crate::placement::ProcessId;
use crate::policy::LinkGraph;
use crate::prompts::Prompts;
use crate::runtime::agent::TurnOutcome;
use crate::runtime::errors::{DeliveryError, OrgError};
use crate::runtime::host::{AgentRuntime, Host, Slot, lock};
use crate::stores::Stores;
use crate::time::Clock;
use crate::tools::Tool;

/// What a behaviour may do in the host: read the stores and the organization's shape, hand
/// envelopes to agents, ring their workers, emit events and run background work. Cheap to clone.
///
/// It is the only door from a behaviour into the host: a behaviour never reaches the host's
/// internals, so a behaviour of your own has the same powers as delegation and conversations.
#[derive(Clone)]
pub struct BehaviourContext {
    pub(crate) host: Arc<Host>,
}

impl fmt::Debug for BehaviourContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BehaviourContext").finish_non_exhaustive()
    }
}

impl BehaviourContext {
    pub(crate) fn new(host: Arc<Host>) -> Self {
        Self { host }
    }

    /// The organization's stores (a behaviour keeps its own state in
    /// [`Stores::records`](crate::stores::Stores) or in a store of its own).
    pub fn stores(&self) -> &Stores {
        &self.host.stores
    }

    /// The organization's clock.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.host.clock
    }

    /// The runtime settings.
    pub fn settings(&self) -> &Settings {
        &self.host.settings
    }

    /// The configuration the organization was built from.
    pub fn config(&self) -> &OrgConfig {
        &self.host.config
    }

    /// The link graph as it is now.
    pub fn graph(&self) -> Arc<LinkGraph> {
        self.host.graph()
    }

    /// Every agent that has not ended, sorted.
    pub fn agent_ids(&self) -> Vec<AgentId> {
        self.host.agent_ids()
    }

    /// Whether the agent's loop runs in this process.
    pub fn is_running(&self, agent: &AgentId) -> bool {
        matches!(self.host.slot(agent), Some(Slot::Running(_)))
    }

    /// The agent's display name (its id when unknown).
    pub fn display_name(&self, agent: &AgentId) -> String {
        self.host.display_name(agent)
    }

    /// Emits an event of the behaviour `behaviour` about `agent` ([`EventKind::Behaviour`]).
    pub fn emit(&self, agent: &AgentId, behaviour: &str, name: &str, detail: serde_json::Value) {
        self.emit_event(self.host.event(
            agent,
            EventKind::Behaviour {
                behaviour: behaviour.to_string(),
                name: name.to_string(),
                detail,
            },
        ));
    }

    /// Emits an event (made with [`event`](Self::event), its optional fields filled in).
    pub fn emit_event(&self, event: Event) {
        self.host.emit(event);
    }

    /// A new event of `kind` about `agent`, stamped with the organization's clock; its optional
    /// fields (task, link, channel, parent) are empty. [`emit_event`](Self::emit_event) emits it.
    pub fn event(&self, agent: &AgentId, kind: EventKind) -> Event {
        self.host.event(agent, kind)
    }

    /// Reports a failure that has no caller to return to (a background step, a hook): a warning
    /// in the log and an [`EventKind::Error`] about `agent`, in `channel` when given.
    pub fn report_error(
        &self,
        agent: &AgentId,
        channel: Option<&ChannelId>,
        message: impl Into<String>,
    ) {
        crate::runtime::agent::report_error(&self.host, agent, channel, message.into());
    }

    /// The organization's prompt templates (a behaviour renders its tools' texts and its
    /// messages to agents with them).
    pub fn prompts(&self) -> &Prompts {
        &self.host.prompts
    }

    /// Hands `envelope` to `agent` as every internal producer does: stored first on a durable
    /// store (acknowledged means stored), queued when the agent runs, kept for later when its
    /// queue is full.
    pub async fn enqueue(&self, agent: &AgentId, envelope: Envelope) -> Result<(), DeliveryError> {
        self.host.enqueue(agent, envelope, true).await
    }

    /// Queues an envelope of work the agent's task loop claimed, storing it only when the queue
    /// cannot take it: the claim is the durable record (recovered at the next start).
    pub(crate) async fn enqueue_claimed(
        &self,
        agent: &AgentId,
        envelope: Envelope,
    ) -> Result<(), DeliveryError> {
        self.host.enqueue_claimed(agent, envelope).await
    }

    /// [`enqueue`](Self::enqueue), running `kept` once the envelope is kept (stored, or about to
    /// be queued) and before the agent can take it: what the sender records about the hand-over
    /// (a completion notice marked sent, say) is then done before the receiver's turn can answer
    /// it. `kept` does not run when the envelope is refused (an unknown or ended agent, a store
    /// error).
    pub async fn enqueue_then(
        &self,
        agent: &AgentId,
        envelope: Envelope,
        kept: impl Future<Output = ()> + Send,
    ) -> Result<(), DeliveryError> {
        self.host
            .enqueue_then(agent, envelope, true, Some(Box::pin(kept)))
            .await
    }

    /// Rings every behaviour worker of `agent`. When it does not run here but, under a
    /// placement, in another process, a wake-up hint goes to that process (in the background; a
    /// failed hint is an error event, and that process's periodic check finds the work anyway).
    pub fn ring(&self, agent: &AgentId) {
        if let Some(Slot::Running(rt)) = self.host.slot(agent) {
            rt.ring();
        } else if self.host.hosting.is_some() {
            let host = self.host.clone();
            let agent = agent.clone();
            let counted = self.host.background.enter();
            self.host.spawner.spawn(Box::pin(async move {
                host.wake_elsewhere(&agent).await;
                drop(counted);
            }));
        }
    }

    /// The agent, as a behaviour's worker sees it, when its loop runs in this process.
    pub fn worker(&self, agent: &AgentId) -> Option<AgentWorker> {
        match self.host.slot(agent) {
            Some(Slot::Running(rt)) => Some(AgentWorker { rt }),
            _ => None,
        }
    }

    /// Whether `agent`'s loop here is stopping as a hand-over to its next host (a placement lease
    /// lost or given up), not because its session ends: what the agent holds goes on there.
    pub fn is_handing_over(&self, agent: &AgentId) -> bool {
        self.host.is_handing_over(agent)
    }

    /// This process's id under a placement (see
    /// [`OrganizationBuilder::placement`](crate::OrganizationBuilder::placement)), `None` without
    /// one.
    pub fn process(&self) -> Option<&ProcessId> {
        self.host.hosting.as_ref().map(|h| &h.options.process)
    }

    /// Resolves an agent by id, or by display name (case-insensitive); an ended agent is not
    /// found.
    pub fn resolve(&self, agent: &str) -> Result<AgentId, DeliveryError> {
        let agents = self.host.read_agents();
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

    /// Says that what tools some agents are offered changed (see
    /// [`Tool::offered_to`]): their next turn renders the
    /// definitions again.
    pub fn tools_changed(&self) {
        self.host.graph_version.fetch_add(1, Ordering::AcqRel);
    }

    /// The organization's one value of type `T` in this process, made with `T::default()` on
    /// first use: where a behaviour keeps the state its hooks, tools and workers share (use a type
    /// of your own, private to your behaviour; the host stores it and never reads it). State that
    /// must survive a restart belongs in the stores.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use spacebot_core::testing::FnLlm;
    /// use spacebot_core::{ChatResponse, OrgConfig, Organization, Stores};
    ///
    /// #[derive(Debug, Default)]
    /// struct Ticks(AtomicU64);
    ///
    /// let config = OrgConfig::from_toml_str("[[agents]]\nid = \"a\"\nname = \"A\"\n")?;
    /// let org = Organization::builder(config)
    ///     .stores(Stores::memory())
    ///     .llm(std::sync::Arc::new(FnLlm::new(|_| Ok(ChatResponse::text("ok")))))
    ///     .build()
    ///     .await?;
    /// let ctx = org.behaviour_context();
    /// ctx.state::<Ticks>().0.fetch_add(1, Ordering::Relaxed);
    /// assert_eq!(ctx.state::<Ticks>().0.load(Ordering::Relaxed), 1);
    /// # Ok(()) }
    /// ```
    pub fn state<T: std::any::Any + Send + Sync + Default>(&self) -> Arc<T> {
        self.host.state::<T>()
    }

    /// Runs `work` in the background on the organization's executor. A shutdown waits for it, so
    /// it must end when its agent stops (a worker ends with its doorbell).
    pub fn spawn(&self, work: impl Future<Output = ()> + Send + 'static) {
        let counted = self.host.background.enter();
        self.host.loops.spawn(Box::pin(async move {
            work.await;
            drop(counted);
        }));
    }

    /// Runs `work` in the background as a task of the application's runtime (through the
    /// organization's [`Spawner`](crate::time::Spawner)), not on the organization's executor:
    /// for the application's own code, which may keep a thread busy (a custom task executor). A
    /// shutdown waits for it, as for [`spawn`](Self::spawn).
    pub fn spawn_on_runtime(&self, work: impl Future<Output = ()> + Send + 'static) {
        let counted = self.host.background.enter();
        self.host.spawner.spawn(Box::pin(async move {
            work.await;
            drop(counted);
        }));
    }

    /// Runs `work` as a task of the application's runtime that a shutdown does not wait for: a
    /// retry in the background that must neither delay a shutdown nor keep the organization alive
    /// (it holds a [`WeakBehaviourContext`], see [`downgrade`](Self::downgrade), and ends when
    /// that no longer upgrades).
    pub fn spawn_detached(&self, work: impl Future<Output = ()> + Send + 'static) {
        self.host.spawner.spawn(Box::pin(work));
    }

    /// A handle on this context that does not keep the organization alive.
    pub fn downgrade(&self) -> WeakBehaviourContext {
        WeakBehaviourContext {
            host: Arc::downgrade(&self.host),
        }
    }
}

/// A [`BehaviourContext`] that does not keep the organization alive (see
/// [`BehaviourContext::downgrade`]).
#[derive(Clone)]
pub struct WeakBehaviourContext {
    host: Weak<Host>,
}

impl fmt::Debug for WeakBehaviourContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WeakBehaviourContext")
            .finish_non_exhaustive()
    }
}

impl WeakBehaviourContext {
    /// The context, while the organization lives.
    pub fn upgrade(&self) -> Option<BehaviourContext> {
        self.host.upgrade().map(BehaviourContext::new)
    }
}

/// A finished answer of an agent, offered to the behaviour that owns it (see
/// [`Behaviour::owns_answer`]) before it would go to the agent's outbound.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Answer<'a> {
    /// The answering agent.
    pub agent: &'a AgentId,
    /// The channel of the envelopes answered.
    pub channel: &'a ChannelId,
    /// The text.
    pub text: &'a str,
    /// The envelopes it answers (all in `channel`).
    pub answered: &'a [Envelope],
    /// The cause of the exchange the answer belongs to.
    pub cause: &'a EnvelopeId,
}

/// A running agent, as a behaviour sees it: its id, whether it stops, its work slots and its
/// behaviours' doorbells. Cheap to clone.
#[derive(Debug, Clone)]
pub struct AgentWorker {
    pub(crate) rt: Arc<AgentRuntime>,
}

/// Rings when a behaviour's worker of an agent has something to do; ends when the agent stops.
pub type Doorbell = mpsc::Receiver<()>;

impl AgentWorker {
    /// The agent.
    pub fn id(&self) -> &AgentId {
        self.rt.id()
    }

    /// Whether the agent is a child (spawned by another agent).
    pub fn is_child(&self) -> bool {
        self.rt.spec.parent.is_some()
    }

    /// Whether the agent's loop is stopping (its queue is closed).
    pub fn is_stopping(&self) -> bool {
        self.rt.queue.is_closed()
    }

    /// Takes the doorbell of the behaviour `behaviour`'s worker of this agent: every behaviour has
    /// its own (the first caller for a name gets it; `None` after that, or once the agent stops).
    /// From then on the agent counts as busy (see
    /// [`Organization::is_idle`](crate::Organization::is_idle)) until the worker's first
    /// [`round`](Self::round) ended, and again after every ring until a round took it up.
    pub fn take_doorbell(&self, behaviour: &str) -> Option<Doorbell> {
        let bell = self.rt.new_bell(behaviour)?;
        self.rt.worker_due.store(true, Ordering::Release);
        self.rt.bell_taken.store(true, Ordering::Release);
        Some(bell)
    }

    /// Marks one round of a worker's work (woken, doing what is due, about to wait again): the
    /// agent is not idle while the returned guard lives, and the rings before it are taken up.
    /// Dropping the guard emits `AgentIdle` when the agent is idle then and the round was due (a
    /// ring or the worker's start; a periodic round finding nothing to do is silent).
    pub fn round(&self, ctx: &BehaviourContext) -> WorkerRound {
        self.rt.worker_rounds.fetch_add(1, Ordering::AcqRel);
        let due = self.rt.worker_due.swap(false, Ordering::AcqRel);
        WorkerRound {
            host: ctx.host.clone(),
            rt: self.rt.clone(),
            due,
        }
    }

    /// Rings every behaviour worker of this agent.
    pub fn ring(&self) {
        self.rt.ring();
    }

    /// Claims counted against the agent's concurrency.
    pub fn running(&self) -> usize {
        self.rt.claim_count()
    }

    /// The claims counted against the agent's concurrency, as (task number, holder).
    pub fn claims(&self) -> Vec<(u64, String)> {
        self.rt.running_claims()
    }

    /// Counts a claim against the agent's concurrency.
    pub fn claim_started(&self, number: u64, holder: &str) {
        self.rt.claim_started(number, holder);
    }

    /// Frees the slot of a claim.
    pub fn claim_ended(&self, number: u64, holder: &str) {
        self.rt.claim_ended(number, holder);
    }

    /// Whether the agent's loop handles an envelope right now.
    pub fn is_busy(&self) -> bool {
        self.rt.busy.load(Ordering::Acquire)
    }
}

/// One round of a behaviour's worker (see [`AgentWorker::round`]).
#[derive(Debug)]
pub struct WorkerRound {
    host: Arc<Host>,
    rt: Arc<AgentRuntime>,
    due: bool,
}

impl Drop for WorkerRound {
    fn drop(&mut self) {
        self.rt.worker_rounds.fetch_sub(1, Ordering::AcqRel);
        let waited_on = self.host.idle_waiters.load(Ordering::Acquire) > 0;
        if (self.due || waited_on) && self.rt.settled() {
            let host = &self.host;
            host.emit(host.event(self.rt.id(), EventKind::AgentIdle));
        }
    }
}

/// A behaviour: tools plus reactions at the points of an agent's life the host offers, in the
/// manner of an actor's lifecycle hooks. Every hook has a default that does nothing.
///
/// A behaviour owns three things the host never interprets:
/// - **its claimed work**: an envelope carrying [`TaskWork`] whose `owner` is the behaviour's
///   [`name`](Self::name); the host asks only the owner whether a claim is still valid, tells only
///   the owner of checkpoints and of the work's end, and asks it for the key base of the turn's
///   effects ([`work_key`](Self::work_key));
/// - **its answers**: an answer to an envelope the behaviour [owns](Self::owns_answer) goes to
///   [`route_answer`](Self::route_answer), never to the agent's outbound (and is not streamed);
/// - **its state**: in its own fields, and durably in the stores through the
///   [`BehaviourContext`].
///
/// Delegation (`spacebot_core::delegation::Delegation`) and conversations
/// (`spacebot_core::dialogue::Conversations`) are the two the organization assembles by
/// default; `docs/behaviours.md` shows how to write one.
#[async_trait]
pub trait Behaviour: Send + Sync + fmt::Debug {
    /// A short, unique name: the owner of its claimed work, the name of its doorbell, its events.
    fn name(&self) -> &'static str;

    /// The tools this behaviour adds (each decides which agents it is offered to, see
    /// [`Tool::offered_to`]).
    fn tools(&self) -> Vec<Arc<dyn Tool>> {
        Vec::new()
    }

    /// The top-level configuration section this behaviour reads (`notes` for `[[notes]]` tables),
    /// if any: [`OrganizationBuilder::build`](crate::OrganizationBuilder::build) refuses a section
    /// of the configuration that no behaviour claims, so a misspelt table fails. The behaviour
    /// finds it in [`OrgConfig::section`] and checks it itself (in
    /// [`on_build`](Self::on_build)).
    fn config_section(&self) -> Option<&'static str> {
        None
    }

    /// The per-agent fields this behaviour reads in `[[agents]]` entries (MCP's `tools`), if
    /// any: the build refuses an `[[agents]]` field that no behaviour claims
    /// ([`OrgConfig::check_agent_fields`]). The behaviour finds them in
    /// [`AgentConfig::fields`](crate::config::AgentConfig::fields) and checks them itself (in
    /// [`on_build`](Self::on_build)).
    fn agent_fields(&self) -> &'static [&'static str] {
        &[]
    }

    /// The tool sets this behaviour adds: tools whose names and number change at run time (the
    /// tools of MCP servers), offered and called through [`ToolSet`](crate::tools::ToolSet).
    fn tool_sets(&self) -> Vec<Arc<dyn crate::tools::ToolSet>> {
        Vec::new()
    }

    /// Called once at the end of [`OrganizationBuilder::build`](crate::OrganizationBuilder::build),
    /// before any agent starts: the behaviour checks its configuration section, loads or seeds its
    /// state, and keeps `ctx` if it serves calls from the application. An error fails the build.
    async fn on_build(&self, _ctx: &BehaviourContext) -> Result<(), OrgError> {
        Ok(())
    }

    /// Called by [`Organization::start_all`](crate::Organization::start_all) before any agent
    /// starts.
    async fn on_start_all(&self, _ctx: &BehaviourContext) -> Result<(), StoreError> {
        Ok(())
    }

    /// Called when an agent's loop started (a behaviour may run its own worker beside it, woken
    /// by its own doorbell: [`AgentWorker::take_doorbell`]).
    fn on_agent_started(&self, _ctx: &BehaviourContext, _agent: AgentWorker) {}

    /// Whether an exchange that `to` started with `from` is open (so `from` may answer `to` even
    /// over a one-way link `to -> from`).
    async fn exchange_open(
        &self,
        _ctx: &BehaviourContext,
        _from: &AgentId,
        _to: &AgentId,
    ) -> Result<bool, StoreError> {
        Ok(false)
    }

    /// Whether the answer `agent` gives to `envelope` is this behaviour's to route (it then goes
    /// to [`route_answer`](Self::route_answer) and is not streamed to the agent's outbound). One
    /// decision, used for both.
    fn owns_answer(&self, _agent: &AgentId, _envelope: &Envelope) -> bool {
        false
    }

    /// The key base of the effects of a turn running this behaviour's claimed `work`: stable
    /// across attempts of the same work, so a turn run again after a crash asks for the same
    /// effects under the same keys.
    fn work_key(&self, work: &TaskWork) -> String {
        format!("{}{}g{}", work.owner, work.number, work.generation)
    }

    /// Whether this behaviour's claimed `work` is still this claim's to run (a stale claim is let
    /// go unrun).
    async fn claim_valid(
        &self,
        _ctx: &BehaviourContext,
        _agent: &AgentId,
        _work: &TaskWork,
    ) -> Result<bool, StoreError> {
        Ok(true)
    }

    /// Called at each checkpoint of a turn running this behaviour's claimed `work` (for example
    /// to renew a lease).
    async fn checkpoint(
        &self,
        _ctx: &BehaviourContext,
        _agent: &AgentId,
        _work: &TaskWork,
    ) -> Result<(), StoreError> {
        Ok(())
    }

    /// Called when a turn running this behaviour's claimed `work` ended: its outcome, or why it
    /// failed (a [`permanent`](crate::runtime::WorkFailure::permanent) failure, such as a request
    /// that reached its limit, should not be retried), and the tokens its model calls spent.
    async fn work_ended(
        &self,
        _ctx: &BehaviourContext,
        _agent: &AgentWorker,
        _work: &TaskWork,
        _outcome: &Result<TurnOutcome, crate::runtime::WorkFailure>,
        _usage: crate::llm::Usage,
    ) {
    }

    /// Routes an answer this behaviour [owns](Self::owns_answer); returns `false` when it could
    /// not (the answer then goes to the agent's outbound).
    async fn route_answer(&self, _ctx: &BehaviourContext, _answer: &Answer<'_>) -> bool {
        false
    }

    /// Called when an agent's loop ended.
    async fn on_agent_stopped(&self, _ctx: &BehaviourContext, _agent: &AgentId) {}

    /// Called when an agent stops here as a hand-over to another host (its placement lease was
    /// lost or given up), before [`on_agent_stopped`](Self::on_agent_stopped): work this
    /// behaviour runs for the agent in this process must stop now (its next host runs it again).
    fn on_agent_handed_over(&self, _ctx: &BehaviourContext, _agent: &AgentId) {}
}

impl Host {
    /// The behaviour named `name`.
    pub(crate) fn behaviour(&self, name: &str) -> Option<&Arc<dyn Behaviour>> {
        self.behaviours.iter().find(|b| b.name() == name)
    }

    /// The behaviour that owns the answer `agent` gives to `envelope`, if any.
    pub(crate) fn answer_owner(
        &self,
        agent: &AgentId,
        envelope: &Envelope,
    ) -> Option<&Arc<dyn Behaviour>> {
        self.behaviours
            .iter()
            .find(|b| b.owns_answer(agent, envelope))
    }
}

impl AgentRuntime {
    /// A new doorbell for the behaviour `behaviour`; `None` when it has one already or the agent
    /// stops.
    pub(crate) fn new_bell(&self, behaviour: &str) -> Option<Doorbell> {
        let mut bells = lock(&self.bells);
        let bells = bells.as_mut()?;
        if bells.iter().any(|(name, _)| name == behaviour) {
            return None;
        }
        let (tx, rx) = mpsc::channel(1);
        bells.push((behaviour.to_string(), tx));
        Some(rx)
    }
}
