//! The operator's side of [`Organization`]: links that change at run time and take effect at once,
//! tasks approved, rejected or cancelled from outside, and waits for what happened.

use crate::bus::EventSubscription;
use crate::error::{InvalidInput, StoreError};
use crate::event::{Event, EventKind};
use crate::ids::{AgentId, TaskRef};
use crate::link::{AgentLink, LinkDirection, LinkRelationship};
use crate::org::{OrgError, Organization};
use crate::policy::LinkGraph;
use crate::task::{Task, TaskEvent, TaskStatus};
use crate::tools::{ToolCapability, ToolContext};

/// A change to an existing link. Fields left `None` keep their value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LinkChange {
    /// A new direction.
    pub direction: Option<LinkDirection>,
    /// A new relationship.
    pub relationship: Option<LinkRelationship>,
    /// Enable or disable.
    pub enabled: Option<bool>,
}

impl LinkChange {
    /// Enables or disables the link.
    pub fn enabled(enabled: bool) -> Self {
        Self {
            enabled: Some(enabled),
            ..Self::default()
        }
    }
}

impl Organization {
    fn known_agent(&self, agent: &AgentId) -> Result<(), OrgError> {
        if self.graph().contains(agent.as_str()) {
            Ok(())
        } else {
            Err(OrgError::UnknownAgent(agent.clone()))
        }
    }

    /// Rebuilds the link graph from the store (every policy check reads it from then on).
    async fn refresh_links(&self) -> Result<(), OrgError> {
        let links: Vec<AgentLink> = self.inner.stores.links.list().await?;
        let agents = self.graph().agents().to_vec();
        let graph = LinkGraph::new(agents, links);
        self.inner.set_graph(graph);
        Ok(())
    }

    /// The links, as the policy sees them now.
    pub fn links(&self) -> Vec<AgentLink> {
        self.graph().links().to_vec()
    }

    /// The link from `from` to `to`, if any.
    pub fn link(&self, from: &AgentId, to: &AgentId) -> Option<AgentLink> {
        self.graph().between(from.as_str(), to.as_str()).cloned()
    }

    /// Creates a link between two agents of the organization. It takes effect at once: every
    /// later policy check sees it. Refused (nothing stored) for an unknown agent, a self-link, or a
    /// pair that is linked already in either direction.
    ///
    /// ```no_run
    /// # async fn demo(org: spacebot_core::Organization) -> Result<(), spacebot_core::OrgError> {
    /// use spacebot_core::{AgentId, LinkDirection, LinkRelationship};
    /// let (a, b) = (AgentId::parse("a")?, AgentId::parse("b")?);
    /// org.create_link(&a, &b, LinkDirection::TwoWay, LinkRelationship::Peer).await?;
    /// # Ok(()) }
    /// ```
    pub async fn create_link(
        &self,
        from: &AgentId,
        to: &AgentId,
        direction: LinkDirection,
        relationship: LinkRelationship,
    ) -> Result<AgentLink, OrgError> {
        self.known_agent(from)?;
        self.known_agent(to)?;
        if from == to {
            return Err(
                InvalidInput::new("to", format!("{from} cannot be linked to itself")).into(),
            );
        }
        let graph = self.graph();
        if graph.between(from.as_str(), to.as_str()).is_some()
            || graph.between(to.as_str(), from.as_str()).is_some()
        {
            return Err(InvalidInput::new(
                "link",
                format!("{from} and {to} are linked already; update that link instead"),
            )
            .into());
        }
        let link = AgentLink::new(
            from.clone(),
            to.clone(),
            direction,
            relationship,
            self.inner.clock.now(),
        );
        self.inner.stores.links.create(&link).await?;
        self.refresh_links().await?;
        for behaviour in &self.inner.behaviours {
            behaviour.on_start_all(&self.behaviour_context()).await?;
        }
        Ok(link)
    }

    /// Changes the link from `from` to `to`. Takes effect at once: a disabled link allows nothing,
    /// on every path (tools, internal sends, conversation replies and conclusions).
    pub async fn update_link(
        &self,
        from: &AgentId,
        to: &AgentId,
        change: LinkChange,
    ) -> Result<AgentLink, OrgError> {
        let mut link = self.link(from, to).ok_or_else(|| {
            OrgError::Store(StoreError::not_found(format!("link {from} -> {to}")))
        })?;
        if let Some(direction) = change.direction {
            link.direction = direction;
        }
        if let Some(relationship) = change.relationship {
            link.relationship = relationship;
        }
        if let Some(enabled) = change.enabled {
            link.enabled = enabled;
        }
        link.updated_at = self.inner.clock.now();
        self.inner.stores.links.update(&link).await?;
        self.refresh_links().await?;
        Ok(link)
    }

    /// Enables or disables the link from `from` to `to`.
    pub async fn set_link_enabled(
        &self,
        from: &AgentId,
        to: &AgentId,
        enabled: bool,
    ) -> Result<AgentLink, OrgError> {
        self.update_link(from, to, LinkChange::enabled(enabled))
            .await
    }

    /// Deletes the link from `from` to `to`; from then on the pair may not message each other.
    pub async fn delete_link(&self, from: &AgentId, to: &AgentId) -> Result<(), OrgError> {
        let link = self.link(from, to).ok_or_else(|| {
            OrgError::Store(StoreError::not_found(format!("link {from} -> {to}")))
        })?;
        self.inner.stores.links.delete(&link.id).await?;
        self.refresh_links().await
    }

    /// The context a tool of `agent` runs in when called in `channel` outside any turn (to call a
    /// tool directly, in a test or from the application): a fresh cause and idempotency key, no
    /// task, round 0. The tool gets `agent`'s narrow capability, never the whole organization.
    pub fn tool_context(&self, agent: &AgentId, channel: crate::ids::ChannelId) -> ToolContext {
        ToolContext {
            agent: agent.clone(),
            channel,
            task: None,
            round: 0,
            cause: crate::ids::EnvelopeId::new_random(),
            key: crate::ids::EnvelopeId::new_random().to_string(),
            org: ToolCapability::new(self.inner.clone(), agent.clone()),
        }
    }

    /// A task, by reference.
    pub async fn task(&self, task: &TaskRef) -> Result<Option<Task>, OrgError> {
        Ok(self
            .inner
            .stores
            .tasks
            .get(&task.agent, task.number)
            .await?)
    }

    async fn operate(&self, task: &TaskRef, event: TaskEvent) -> Result<Task, OrgError> {
        self.known_agent(&task.agent)?;
        let transition = self
            .task_transition(&task.agent, task.number, event)
            .await?;
        self.ring(&task.agent);
        Ok(transition.task)
    }

    /// Approves a task waiting for approval: it becomes ready and the agent's task loop is woken.
    pub async fn approve_task(&self, task: &TaskRef) -> Result<Task, OrgError> {
        self.operate(task, TaskEvent::Approve).await
    }

    /// Rejects a task waiting for approval: it is cancelled with `reason`, and its delegator is
    /// told.
    pub async fn reject_task(&self, task: &TaskRef, reason: &str) -> Result<Task, OrgError> {
        let current = self
            .task(task)
            .await?
            .ok_or_else(|| OrgError::Store(StoreError::not_found(format!("task {task}"))))?;
        if current.status != TaskStatus::PendingApproval {
            return Err(InvalidInput::new(
                "task",
                format!("task {task} is {}, not pending_approval", current.status),
            )
            .into());
        }
        self.operate(
            task,
            TaskEvent::Cancel {
                reason: format!("rejected: {reason}"),
            },
        )
        .await
    }

    /// Cancels a task that has not ended; its delegator is told.
    pub async fn cancel_task(&self, task: &TaskRef, reason: &str) -> Result<Task, OrgError> {
        self.operate(
            task,
            TaskEvent::Cancel {
                reason: reason.to_string(),
            },
        )
        .await
    }

    /// Runs `future` on the organization's own executor, beside its agents, and returns a handle
    /// to its output.
    ///
    /// The agents' loops run on one executor inside a single task of the host runtime. Code that
    /// talks to agents in a tight chain (deliver, await the reply, deliver again) and runs there
    /// too wakes them, and is woken by their replies, without the host's scheduler: on Tokio's
    /// multi-thread runtime that saves the cross-thread wake-ups a task of its own would cost
    /// every few hops. Like the agents, the future must not block its thread; a long computation
    /// belongs on the host runtime (`spawn_blocking`).
    ///
    /// Dropping the handle cancels the future; call
    /// [`RemoteHandle::forget`](futures::future::RemoteHandle::forget) to let it run on. A panic in
    /// the future is resumed where the handle is awaited.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use futures::StreamExt;
    /// use spacebot_core::config::OrgConfig;
    /// use spacebot_core::testing::FnLlm;
    /// use spacebot_core::{ChatResponse, InboundMessage, Organization, Stores};
    ///
    /// let config = OrgConfig::from_toml_str("[[agents]]\nid = \"echo\"\nname = \"Echo\"\n")?;
    /// let org = Organization::builder(config)
    ///     .stores(Stores::memory())
    ///     .llm(std::sync::Arc::new(FnLlm::new(|_| Ok(ChatResponse::text("pong")))))
    ///     .build()
    ///     .await?;
    /// org.start_all().await?;
    /// let mut replies = org.take_replies().expect("replies");
    /// let driver = org.clone();
    /// let answered = org.spawn(async move {
    ///     let mut answered = 0;
    ///     for _ in 0..3 {
    ///         driver.deliver("echo", InboundMessage::new("portal", "u", "ping")).await?;
    ///         if replies.next().await.is_some() {
    ///             answered += 1;
    ///         }
    ///     }
    ///     Ok::<_, spacebot_core::DeliveryError>(answered)
    /// });
    /// assert_eq!(answered.await?, 3);
    /// # Ok(())
    /// # }
    /// ```
    pub fn spawn<F>(&self, future: F) -> futures::future::RemoteHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        use futures::FutureExt;
        let (remote, handle) = future.remote_handle();
        self.inner.loops.spawn(Box::pin(remote));
        handle
    }

    /// Every event the organization emits from now on (besides the sink set on the builder). A
    /// subscriber that falls behind is told how many events it missed.
    pub fn subscribe(&self) -> EventSubscription {
        self.inner.bus.subscribe()
    }

    /// Waits until `task` has ended (done, failed or cancelled) and returns it. Reads the store
    /// again each time an event about the task is emitted; never polls on a timer, so it works on
    /// a manual clock too. Wrap it in your runtime's timeout.
    pub async fn wait_task_ended(&self, task: &TaskRef) -> Result<Task, OrgError> {
        let mut events = self.subscribe();
        loop {
            match self.task(task).await? {
                Some(t) if t.status.is_terminal() => return Ok(t),
                Some(_) => {}
                None => {
                    return Err(OrgError::Store(StoreError::not_found(format!(
                        "task {task}"
                    ))));
                }
            }
            loop {
                match events.recv().await {
                    Ok(event) if event.task.as_ref() == Some(task) && is_task_end(&event) => break,
                    Ok(_) => {}
                    // Missed some: read the store again.
                    Err(crate::bus::RecvError::Lagged { .. }) => break,
                    Err(crate::bus::RecvError::Closed) => {
                        return Err(OrgError::Invalid(InvalidInput::new(
                            "events",
                            "the organization's event bus closed",
                        )));
                    }
                }
            }
        }
    }

    /// Tokens `agent`'s turns spent since the organization was built (as the provider reported).
    pub fn usage(&self, agent: &AgentId) -> crate::llm::Usage {
        self.inner
            .usage
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(agent)
            .copied()
            .unwrap_or_default()
    }

    /// Tokens a delegated task cost: its own workers' model calls plus, recursively, those of the
    /// tasks it delegated.
    pub async fn task_usage(&self, task: &TaskRef) -> Result<crate::llm::Usage, OrgError> {
        let mut total = crate::llm::Usage::default();
        let mut todo = vec![task.clone()];
        let mut seen = std::collections::HashSet::new();
        while let Some(next) = todo.pop() {
            if !seen.insert(next.clone()) {
                continue;
            }
            if let Some(t) = self.task(&next).await? {
                total = total.plus(t.metadata.usage);
                todo.extend(t.metadata.children.iter().map(|c| c.task.clone()));
            }
        }
        Ok(total)
    }

    /// Whether `agent` is idle: running, its queue empty, no turn and no task running, and its
    /// behaviours' workers have nothing due (the task loop's start-up recovery, a ready task, a
    /// completion notice still in the outbox are all work not done yet).
    pub fn is_idle(&self, agent: &AgentId) -> bool {
        match self.inner.slot(agent) {
            Some(crate::org::Slot::Running(rt)) => rt.settled(),
            _ => false,
        }
    }

    /// Waits until `agent` is idle (see [`is_idle`](Self::is_idle)). Woken by the agent's
    /// `AgentIdle` events; never polls on a timer. Wrap it in your runtime's timeout.
    pub async fn wait_idle(&self, agent: &AgentId) -> Result<(), OrgError> {
        self.known_agent(agent)?;
        let mut events = self.subscribe();
        // Counted before the first check: a worker round ending after it tells the bus.
        let _waiting = IdleWaiter::new(&self.inner);
        while !self.is_idle(agent) {
            match events.recv().await {
                Ok(_) | Err(crate::bus::RecvError::Lagged { .. }) => {}
                Err(crate::bus::RecvError::Closed) => {
                    return Err(OrgError::Invalid(InvalidInput::new(
                        "events",
                        "the organization's event bus closed",
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Counts one caller of `wait_idle` while it waits.
struct IdleWaiter<'a>(&'a crate::org::OrgInner);

impl<'a> IdleWaiter<'a> {
    fn new(inner: &'a crate::org::OrgInner) -> Self {
        inner
            .idle_waiters
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Self(inner)
    }
}

impl Drop for IdleWaiter<'_> {
    fn drop(&mut self) {
        self.0
            .idle_waiters
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Whether an event says a task ended.
pub fn is_task_end(event: &Event) -> bool {
    matches!(
        event.kind,
        EventKind::TaskCompleted | EventKind::TaskFailed { .. } | EventKind::TaskCancelled
    )
}
