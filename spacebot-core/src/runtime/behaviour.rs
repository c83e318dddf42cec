//! The one hook trait through which behaviours (delegation, conversations, your own) plug into the
//! host.
//!
//! The host (this module's siblings and the core of [`Organization`]) runs agents: queues, turns,
//! steering, outbound, events. It knows no behaviour. A [`Behaviour`] adds tools, and reacts at a
//! few points of an agent's life, in the manner of an actor's lifecycle hooks:
//!
//! | hook | when |
//! |---|---|
//! | [`tools`](Behaviour::tools) | when the organization is built |
//! | [`on_start_all`](Behaviour::on_start_all) | [`Organization::start_all`], before any agent starts |
//! | [`on_agent_started`](Behaviour::on_agent_started) | an agent's loop started (a behaviour may run its own worker beside it) |
//! | [`exchange_open`](Behaviour::exchange_open) | an announcement travels back along a one-way link: is an exchange open? |
//! | [`claim_valid`](Behaviour::claim_valid), [`checkpoint`](Behaviour::checkpoint), [`work_ended`](Behaviour::work_ended) | a turn runs claimed work (an envelope with [`TaskWork`]) |
//! | [`route_answer`](Behaviour::route_answer) | a turn produced an answer: does it belong to this behaviour? |
//! | [`on_agent_stopped`](Behaviour::on_agent_stopped) | an agent's loop ended |
//!
//! Every hook has a default that does nothing, so a behaviour implements only what it needs.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use async_trait::async_trait;
use futures::channel::mpsc;

use crate::envelope::{Envelope, TaskWork};
use crate::error::StoreError;
use crate::ids::{AgentId, ChannelId, EnvelopeId};
use crate::org::{AgentRuntime, Organization};
use crate::runtime::agent::TurnOutcome;
use crate::runtime::queue::AgentQueue;
use crate::tools::Tool;

/// A finished answer of an agent, offered to the behaviours before it goes to the agent's outbound.
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
/// doorbell. Cheap to clone.
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

    /// Takes the agent's doorbell (the first caller gets it). From then on the agent counts as
    /// busy (see [`Organization::is_idle`]) until the worker's first [`round`](Self::round) ended,
    /// and again after every ring until a round took it up.
    pub fn take_doorbell(&self) -> Option<Doorbell> {
        let bell = self
            .rt
            .bell_rx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if bell.is_some() {
            self.rt.worker_due.store(true, Ordering::Release);
            self.rt.bell_taken.store(true, Ordering::Release);
        }
        bell
    }

    /// Marks one round of the worker's work (woken, doing what is due, about to wait again): the
    /// agent is not idle while the returned guard lives, and the rings before it are taken up.
    /// Dropping the guard emits `AgentIdle` when the agent is idle then and the round was due (a
    /// ring or the worker's start; a periodic round finding nothing to do is silent).
    pub fn round(&self, org: &Organization) -> WorkerRound {
        self.rt.worker_rounds.fetch_add(1, Ordering::AcqRel);
        let due = self.rt.worker_due.swap(false, Ordering::AcqRel);
        WorkerRound {
            org: org.clone(),
            rt: self.rt.clone(),
            due,
        }
    }

    /// Rings the doorbell.
    pub fn ring(&self) {
        self.rt.ring();
    }

    /// Claims counted against the agent's concurrency.
    pub fn running(&self) -> usize {
        self.rt.running_tasks()
    }

    /// The claims counted against the agent's concurrency, as (task number, holder).
    pub fn claims(&self) -> Vec<(u64, String)> {
        self.rt.running_claims()
    }

    /// Counts a claim against the agent's concurrency.
    pub fn claim_started(&self, number: u64, holder: &str) {
        self.rt.task_started(number, holder);
    }

    /// Frees the slot of a claim.
    pub fn claim_ended(&self, number: u64, holder: &str) {
        self.rt.task_finished(number, holder);
    }

    /// Whether the agent's loop handles an envelope right now.
    pub fn is_busy(&self) -> bool {
        self.rt.busy.load(Ordering::Acquire)
    }
}

/// One round of a behaviour's worker (see [`AgentWorker::round`]).
#[derive(Debug)]
pub struct WorkerRound {
    org: Organization,
    rt: Arc<AgentRuntime>,
    due: bool,
}

impl Drop for WorkerRound {
    fn drop(&mut self) {
        self.rt.worker_rounds.fetch_sub(1, Ordering::AcqRel);
        let waited_on = self.org.inner.idle_waiters.load(Ordering::Acquire) > 0;
        if (self.due || waited_on) && self.rt.settled() {
            let inner = &self.org.inner;
            inner.emit(inner.event(self.rt.id(), crate::event::EventKind::AgentIdle));
        }
    }
}

/// A behaviour: tools plus reactions at the points of an agent's life the host offers.
///
/// Delegation ([`Delegation`](crate::delegation::Delegation)) and conversations
/// ([`Conversations`](crate::dialogue::Conversations)) are the two the organization assembles by
/// default.
#[async_trait]
pub trait Behaviour: Send + Sync + fmt::Debug {
    /// A short name, for errors.
    fn name(&self) -> &'static str;

    /// The tools every agent gets from this behaviour.
    fn tools(&self) -> Vec<Arc<dyn Tool>> {
        Vec::new()
    }

    /// Called by [`Organization::start_all`] before any agent starts.
    async fn on_start_all(&self, _org: &Organization) -> Result<(), StoreError> {
        Ok(())
    }

    /// Called when an agent's loop started.
    fn on_agent_started(&self, _org: &Organization, _agent: AgentWorker) {}

    /// Whether an exchange that `to` started with `from` is open (so `from` may answer `to` even
    /// over a one-way link `to -> from`).
    async fn exchange_open(
        &self,
        _org: &Organization,
        _from: &AgentId,
        _to: &AgentId,
    ) -> Result<bool, StoreError> {
        Ok(false)
    }

    /// Whether the claimed `work` is still this claim's to run (a stale claim is let go unrun).
    /// `None` when the work is not this behaviour's.
    async fn claim_valid(
        &self,
        _org: &Organization,
        _agent: &AgentId,
        _work: &TaskWork,
    ) -> Option<Result<bool, StoreError>> {
        None
    }

    /// Called at each checkpoint of a turn running claimed `work` (for example to renew a lease).
    async fn checkpoint(
        &self,
        _org: &Organization,
        _agent: &AgentId,
        _work: &TaskWork,
    ) -> Result<(), StoreError> {
        Ok(())
    }

    /// Called when a turn running claimed `work` ended: its outcome, or why it failed, and the
    /// tokens its model calls spent.
    async fn work_ended(
        &self,
        _org: &Organization,
        _agent: &AgentWorker,
        _work: &TaskWork,
        _outcome: &Result<TurnOutcome, String>,
        _usage: crate::llm::Usage,
    ) {
    }

    /// Offered every finished answer; returns `true` when it routed the answer (it then does not
    /// go to the agent's outbound).
    async fn route_answer(&self, _org: &Organization, _answer: &Answer<'_>) -> bool {
        false
    }

    /// Called when an agent's loop ended.
    async fn on_agent_stopped(&self, _org: &Organization, _agent: &AgentId) {}
}
