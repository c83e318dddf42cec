//! The host's operations on agents: start, stop, fence, shut down, spawn children.
//!
//! [`Organization`](crate::Organization) forwards its lifecycle methods here.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use futures::channel::oneshot;
use futures::future::{AbortHandle, Abortable};

use crate::envelope::{Envelope, EnvelopeKind, Source};
use crate::error::InvalidInput;
use crate::event::EventKind;
use crate::ids::{AgentId, ChannelId};
use crate::prompts::Identity;
use crate::runtime::behaviour::BehaviourContext;
use crate::runtime::errors::{DeliveryError, OrgError};
use crate::runtime::host::{AgentRuntime, AgentSpec, ChildSpec, Host, ParentLink, Slot, lock};
use crate::runtime::queue::BoundedQueue;

impl Host {
    /// Starts every configured agent that is not running.
    ///
    /// Under a placement ([`OrganizationBuilder::placement`](crate::OrganizationBuilder::placement))
    /// it starts the hosting loops instead: this process acquires leases on free agents up to its
    /// capacity and starts those (the first round before this returns), renews them, and takes
    /// over agents whose host died.
    pub(crate) async fn start_all(self: &Arc<Self>) -> Result<(), OrgError> {
        for behaviour in &self.behaviours {
            behaviour
                .on_start_all(&BehaviourContext::new(self.clone()))
                .await?;
        }
        if let Some(hosting) = &self.hosting {
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
    pub(crate) async fn start_agent(self: &Arc<Self>, agent: &AgentId) -> Result<(), OrgError> {
        if let Some(hosting) = &self.hosting
            && self.config.agents.iter().any(|a| &a.id == agent)
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
    pub(crate) async fn start_local(self: &Arc<Self>, agent: &AgentId) -> Result<(), OrgError> {
        let spec = match self.slot(agent) {
            Some(Slot::Running(_)) => return Ok(()),
            Some(Slot::Stopped(spec)) => spec,
            Some(Slot::Ended) => return Err(OrgError::Ended(agent.clone())),
            None => return Err(OrgError::UnknownAgent(agent.clone())),
        };
        let (done_tx, done_rx) = oneshot::channel();
        let runtime = Arc::new(AgentRuntime {
            spec: spec.clone(),
            queue: BoundedQueue::new(agent.clone(), self.settings.queue_capacity),
            pending: AtomicBool::new(false),
            abort: Mutex::new(None),
            fence: Mutex::new(None),
            stopped: Mutex::new(Some(done_rx)),
            bells: Mutex::new(Some(Vec::new())),
            bell_taken: AtomicBool::new(false),
            worker_due: AtomicBool::new(false),
            worker_rounds: AtomicUsize::new(0),
            busy: AtomicBool::new(false),
            claims: Mutex::new(HashMap::new()),
            known: Mutex::default(),
            loaded: Mutex::default(),
            reply_sources: Mutex::new(HashMap::new()),
            memories: Default::default(),
        });
        {
            let mut agents = self.write_agents();
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
        match self.stores.deliveries.pending(agent).await {
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
                    self,
                    agent,
                    None,
                    format!("pending deliveries not read at start: {e}"),
                );
            }
        }
        self.emit(self.event(agent, EventKind::AgentStarted));
        let inner = self.clone();
        let loop_runtime = runtime.clone();
        let (fence, fenced) = AbortHandle::new_pair();
        *lock(&runtime.fence) = Some(fence);
        let counted = self.background.enter();
        self.loops.spawn(Box::pin(async move {
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
        for behaviour in &self.behaviours {
            behaviour.on_agent_started(&BehaviourContext::new(self.clone()), worker.clone());
        }
        Ok(())
    }

    /// Stops hosting an agent at once (its placement lease was lost or not renewed in time): it is
    /// marked stopped, its queue closed and its doorbell taken (the task loop ends), and its loop
    /// aborted wherever it is. The running turn is not committed: the envelopes it consumed stay
    /// in the store (every delivery is stored under a placement) and its next host runs it again,
    /// its effects kept from repeating by their idempotency keys. Waits for the loop to end.
    pub(crate) async fn fence_agent(self: &Arc<Self>, agent: &AgentId) {
        lock(&self.handing_over).insert(agent.clone());
        self.fence_agent_now(agent).await;
        lock(&self.handing_over).remove(agent);
    }

    /// Stops an agent hosted under a placement for its next host to take it over (a clean
    /// shutdown of this process): [`stop_agent`](Self::stop_agent), without ending its session
    /// (its conversations stay open).
    ///
    /// The agent's custom executor attempts are aborted, not awaited (they may run for hours):
    /// their next host finds their claims orphaned and runs them again at once.
    pub(crate) async fn stop_for_hand_over(
        self: &Arc<Self>,
        agent: &AgentId,
    ) -> Result<(), OrgError> {
        self.stop_keeping_session(agent, true).await
    }

    /// [`stop_agent`](Self::stop_agent) without ending the agent's session (its conversations
    /// stay open); with `abort_executors`, its custom executor attempts are aborted.
    pub(crate) async fn stop_keeping_session(
        self: &Arc<Self>,
        agent: &AgentId,
        abort_executors: bool,
    ) -> Result<(), OrgError> {
        lock(&self.handing_over).insert(agent.clone());
        let runtime = match self.slot(agent) {
            Some(Slot::Running(rt)) => Some(rt),
            _ => None,
        };
        let stopped = self.stop_agent(agent).await;
        if runtime.is_some() && abort_executors {
            self.behaviours_handed_over(agent);
        }
        lock(&self.handing_over).remove(agent);
        stopped
    }

    pub(crate) async fn fence_agent_now(self: &Arc<Self>, agent: &AgentId) {
        let runtime = {
            let mut agents = self.write_agents();
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
        lock(&runtime.bells).take();
        if let Some(fence) = lock(&runtime.fence).take() {
            fence.abort();
        }
        self.behaviours_handed_over(agent);
        let done = lock(&runtime.stopped).take();
        if let Some(done) = done {
            let _ = done.await;
        }
    }

    /// Stops an agent: closes its queue, persists what was still queued (handed over again at the
    /// next start), lets the running turn finish, and waits for the loop to end.
    pub(crate) async fn stop_agent(self: &Arc<Self>, agent: &AgentId) -> Result<(), OrgError> {
        let runtime = {
            let mut agents = self.write_agents();
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
        lock(&runtime.bells).take();
        // A durable store holds every queued envelope already.
        let rest = if self.stores_every_delivery() {
            Vec::new()
        } else {
            rest
        };
        for envelope in rest {
            self.persist(agent, envelope).await.map_err(|e| match e {
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
    pub(crate) async fn shutdown(self: &Arc<Self>) -> Result<(), OrgError> {
        if let Some(hosting) = &self.hosting {
            crate::runtime::hosting::shutdown(self, hosting).await;
        }
        let running: Vec<AgentId> = self
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
        // Settlements of model calls made behind are stored now, not after their delay.
        self.flush_settlements_now();
        // Task loops, executor attempts and wake-ups end with their agents: once they have,
        // nothing of the organization uses the stores, and dropping the last handles releases
        // them (a data directory can be opened again at once).
        self.background.idle().await;
        Ok(())
    }

    /// Starts a child of `parent` on `spec.task`. The child's replies go to the parent's queue (in
    /// `spec.report_to`, default `child:{parent}:{child}`) and wake it; a child whose turn fails, or
    /// whose result cannot be delivered, is reported to the parent as well. Returns the child's id.
    pub(crate) async fn spawn_child(
        self: &Arc<Self>,
        parent: &AgentId,
        spec: ChildSpec,
    ) -> Result<AgentId, OrgError> {
        match self.slot(parent) {
            Some(Slot::Running(_) | Slot::Stopped(_)) => {}
            Some(Slot::Ended) => return Err(OrgError::Ended(parent.clone())),
            None => return Err(OrgError::UnknownAgent(parent.clone())),
        }
        let n = self.child_counter.fetch_add(1, Ordering::Relaxed) + 1;
        // The instance tag keeps a child's id unique across restarts: a child spawned after a crash
        // never takes over the stored queue of one that died with the process.
        let child = AgentId::parse(format!("{parent}.child-{n}-{}", self.instance_tag))?;
        let report_to = spec
            .report_to
            .clone()
            .unwrap_or_else(|| ChannelId::new(format!("child:{parent}:{child}")));
        let outbound = Arc::new(crate::runtime::agent::ParentOutbound {
            org: Arc::downgrade(self),
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
        self.write_agents()
            .insert(child.clone(), Slot::Stopped(Arc::new(agent_spec)));
        let task = Envelope::new(
            Source::Internal {
                from_agent: parent.clone(),
                link_id: None,
            },
            ChannelId::new(format!("parent:{child}:{parent}")),
            EnvelopeKind::TaskAssigned,
            spec.task,
            self.clock.now(),
        );
        self.start_local(&child).await?;
        self.enqueue(&child, task, true)
            .await
            .map_err(|e| OrgError::Invalid(InvalidInput::new("child task", e.to_string())))?;
        Ok(child)
    }

    /// Ends an agent for good: it stops, and later deliveries to it are [`DeliveryError::Ended`].
    /// What was still queued is handed back to the caller.
    pub(crate) fn end_agent(&self, agent: &AgentId) -> Vec<Envelope> {
        let previous = self.write_agents().insert(agent.clone(), Slot::Ended);
        match previous {
            Some(Slot::Running(rt)) => {
                lock(&rt.bells).take();
                rt.queue.close()
            }
            _ => Vec::new(),
        }
    }
}
