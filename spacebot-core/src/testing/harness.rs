//! [`OrgHarness`]: an organization wired for tests, with the waits tests need.
//!
//! It builds an [`Organization`] from a TOML configuration on the stores you give it, records every
//! event, and collects the replies. Every wait fails the test after a timeout (10 s by default): a
//! hang guard, never a timing assertion. Tests wait on a condition or an event; they never sleep and
//! then assert that something did not happen.
//!
//! ```no_run
//! # async fn demo() {
//! use std::sync::Arc;
//! use spacebot_core::testing::{OrgHarness, ScriptedLlm};
//! use spacebot_core::{InboundMessage, Stores};
//! let llm = Arc::new(ScriptedLlm::new().with_fallback(|_| {
//!     Ok(spacebot_core::llm::ChatResponse::text("hello"))
//! }));
//! let mut h = OrgHarness::builder("[[agents]]\nid = \"a\"\nname = \"A\"\n")
//!     .stores(Stores::memory())
//!     .llm(llm)
//!     .build()
//!     .await;
//! h.org.start_all().await.unwrap();
//! h.org.deliver("a", InboundMessage::new("portal", "u1", "hi")).await.unwrap();
//! assert_eq!(h.reply().await.content, "hello");
//! # }
//! ```

// A test harness: a failed wait or a failed set-up ends the test with its message.
#![allow(clippy::panic, clippy::expect_used, clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;

use crate::channel::RecordKind;
use crate::config::OrgConfig;
use crate::conversation::{Conversation, ConversationFilter};
use crate::delegation::TaskExecutor;
use crate::event::{Event, EventKind};
use crate::ids::{AgentId, ChannelId};
use crate::llm::LlmProvider;
use crate::org::Organization;
use crate::rt::{TokioClock, TokioSpawner};
use crate::runtime::Reply;
use crate::stores::Stores;
use crate::task::{Task, TaskFilter, TaskStatus};
use crate::testing::{MockLlmHandle, PendingCall, RecordingSink, agent as agent_id};
use crate::time::{Clock, ManualClock};
use crate::tools::Tool;

/// Builds an [`OrgHarness`].
#[derive(Debug)]
pub struct OrgHarnessBuilder {
    config: String,
    stores: Option<Stores>,
    llm: Option<Arc<dyn LlmProvider>>,
    clock: Option<ManualClock>,
    tools: Vec<Arc<dyn Tool>>,
    behaviours: Vec<Arc<dyn crate::Behaviour>>,
    executors: Vec<(AgentId, Arc<dyn TaskExecutor>)>,
    outbound: Option<Arc<dyn crate::runtime::Outbound>>,
    placement: Option<(
        Arc<dyn crate::placement::Placement>,
        crate::placement::PlacementOptions,
    )>,
    prompts: Option<crate::prompts::Prompts>,
}

/// An organization wired for tests: its replies, its events, its stores, and waits that fail the
/// test after a timeout.
#[derive(Debug)]
pub struct OrgHarness {
    /// The organization (agents not started).
    pub org: Organization,
    /// The replies of root agents.
    pub replies: crate::Replies,
    /// Every event, recorded.
    pub events: Arc<RecordingSink>,
    /// The stores the organization runs on.
    pub stores: Stores,
    /// The manual clock, when the harness was built with one.
    pub clock: Option<ManualClock>,
    /// How long a wait may take before it fails the test (default 10 s).
    pub timeout: Duration,
}

impl OrgHarness {
    /// Starts building a harness from a TOML configuration.
    pub fn builder(config: impl Into<String>) -> OrgHarnessBuilder {
        OrgHarnessBuilder {
            config: config.into(),
            stores: None,
            llm: None,
            clock: None,
            tools: Vec::new(),
            behaviours: Vec::new(),
            executors: Vec::new(),
            outbound: None,
            placement: None,
            prompts: None,
        }
    }

    /// The next reply (fails the test after the timeout).
    pub async fn reply(&mut self) -> Reply {
        match tokio::time::timeout(self.timeout, self.replies.next()).await {
            Ok(Some(reply)) => reply,
            Ok(None) => panic!("the reply stream closed"),
            Err(_) => panic!("no reply within {:?}", self.timeout),
        }
    }

    /// Replies received so far, without waiting.
    pub fn replies_now(&mut self) -> Vec<Reply> {
        let mut out = Vec::new();
        while let Ok(reply) = self.replies.try_recv() {
            out.push(reply);
        }
        out
    }

    /// Waits until `pred` holds for the recorded events (fails the test after the timeout).
    pub async fn wait_for(&self, what: &str, pred: impl Fn(&[Event]) -> bool) {
        let deadline = tokio::time::Instant::now() + self.timeout;
        loop {
            if pred(&self.events.events()) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out after {:?} waiting for {what}",
                self.timeout
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Waits until at least `n` recorded events match `pred`.
    pub async fn wait_count(&self, what: &str, n: usize, pred: impl Fn(&EventKind) -> bool) {
        self.wait_for(what, |events| {
            events.iter().filter(|e| pred(&e.kind)).count() >= n
        })
        .await;
    }

    /// Waits until an async condition holds (polled; fails the test after the timeout).
    pub async fn wait_until<F, Fut>(&self, what: &str, mut cond: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = tokio::time::Instant::now() + self.timeout;
        loop {
            if cond().await {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out after {:?} waiting for {what}",
                self.timeout
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Waits until `agent` is idle: running, its queue empty, no turn and no task running (see
    /// [`Organization::wait_idle`]; fails the test after the timeout).
    pub async fn wait_idle(&self, agent: &str) {
        let agent = AgentId::parse(agent).expect("a valid agent id");
        match tokio::time::timeout(self.timeout, self.org.wait_idle(&agent)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("waiting for {agent} to be idle failed: {e}"),
            Err(_) => panic!("{agent} not idle within {:?}", self.timeout),
        }
    }

    /// Waits until the organization is quiet: every running agent idle (queue empty, no turn and no
    /// task running), nothing waiting for any of them in the stores (no delivery kept, no task ready
    /// to claim, no completion notice to send), and no event emitted
    /// across two consecutive checks (an agent between taking an envelope and starting its turn
    /// looks idle for an instant). Fails the test after the timeout, with the last events.
    ///
    /// This is the end of everything a stimulus caused: assert on counts after it.
    pub async fn wait_quiet(&self) {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let mut settled_at: Option<usize> = None;
        loop {
            let before = self.events.len();
            let mut quiet = true;
            for agent in self.org.agent_ids() {
                if !self.org.is_running(&agent) {
                    continue;
                }
                if !self.org.is_idle(&agent) || !self.nothing_waits(&agent).await {
                    quiet = false;
                    break;
                }
            }
            let quiet = quiet && self.events.len() == before;
            if quiet && settled_at == Some(before) {
                return;
            }
            settled_at = quiet.then_some(before);
            if tokio::time::Instant::now() >= deadline {
                let kinds = self.events.kinds();
                let tail = &kinds[kinds.len().saturating_sub(30)..];
                panic!(
                    "the organization was not quiet within {:?}; last events: {tail:?}",
                    self.timeout
                );
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Whether nothing waits for `agent` in the stores: no delivery kept, no task ready to claim,
    /// no completion notice to send.
    async fn nothing_waits(&self, agent: &AgentId) -> bool {
        let ready = TaskFilter {
            statuses: vec![TaskStatus::Ready],
            ..TaskFilter::default()
        };
        let deliveries = self.stores.deliveries.pending(agent).await;
        let tasks = self.stores.tasks.list(agent, &ready).await;
        let outbox = self.stores.tasks.outbox_pending(agent).await;
        matches!(deliveries, Ok(d) if d.is_empty())
            && matches!(tasks, Ok(t) if t.is_empty())
            && matches!(outbox, Ok(o) if o.is_empty())
    }

    /// Waits until `pred` holds for the kinds of the recorded events.
    pub async fn wait_kinds(&self, what: &str, pred: impl Fn(&[EventKind]) -> bool) {
        self.wait_for(what, |events| {
            let kinds: Vec<EventKind> = events.iter().map(|e| e.kind.clone()).collect();
            pred(&kinds)
        })
        .await;
    }

    /// The manual clock (panics when the harness runs on the wall clock).
    pub fn manual_clock(&self) -> &ManualClock {
        self.clock
            .as_ref()
            .expect("the harness was built with .manual_clock(...)")
    }

    /// How many recorded events match `pred`.
    pub fn count(&self, pred: impl Fn(&EventKind) -> bool) -> usize {
        self.events.kinds().iter().filter(|k| pred(k)).count()
    }

    /// Task `number` of `agent`'s board (fails the test when it is missing).
    pub async fn task(&self, agent: &str, number: u64) -> Task {
        self.stores
            .tasks
            .get(&agent_id(agent), number)
            .await
            .expect("the task store answers")
            .unwrap_or_else(|| panic!("no task {agent}#{number}"))
    }

    /// Every task of `agent`'s board, by number.
    pub async fn board(&self, agent: &str) -> Vec<Task> {
        self.stores
            .tasks
            .list(&agent_id(agent), &TaskFilter::default())
            .await
            .expect("the task store answers")
    }

    /// The texts of `owner`'s side of the link channel with `peer`, oldest first.
    pub async fn link_texts(&self, owner: &str, peer: &str) -> Vec<String> {
        self.history(owner, &super::link(owner, peer))
            .await
            .into_iter()
            .map(|r| r.record.content.into_string())
            .collect()
    }

    /// `(kind, content)` of the records of `agent`'s `channel`, oldest first, tool records left
    /// out.
    pub async fn lines(&self, agent: &str, channel: &ChannelId) -> Vec<(RecordKind, String)> {
        self.history(agent, channel)
            .await
            .into_iter()
            .filter(|r| r.record.kind != RecordKind::Tool)
            .map(|r| (r.record.kind, r.record.content.into_string()))
            .collect()
    }

    /// Every conversation.
    pub async fn all_conversations(&self) -> Vec<Conversation> {
        self.org
            .conversations(&ConversationFilter::default())
            .await
            .expect("the conversation store answers")
    }

    /// The one conversation (fails the test when there are more or none).
    pub async fn only_conversation(&self) -> Conversation {
        let all = self.all_conversations().await;
        assert_eq!(all.len(), 1, "expected one conversation, got {all:#?}");
        all.into_iter().next().expect("one conversation")
    }

    /// The history of `agent`'s `channel`, oldest first.
    pub async fn history(&self, agent: &str, channel: &ChannelId) -> Vec<crate::ChannelRecord> {
        let agent = AgentId::parse(agent).expect("a valid agent id");
        self.stores
            .channels
            .history(&agent, channel, None)
            .await
            .expect("history readable")
    }
}

impl OrgHarnessBuilder {
    /// The stores (default: in memory).
    pub fn stores(mut self, stores: Stores) -> Self {
        self.stores = Some(stores);
        self
    }

    /// The model (required).
    pub fn llm(mut self, llm: Arc<dyn LlmProvider>) -> Self {
        self.llm = Some(llm);
        self
    }

    /// Runs on a manual clock (default: the wall clock).
    pub fn manual_clock(mut self, clock: ManualClock) -> Self {
        self.clock = Some(clock);
        self
    }

    /// A tool every agent gets.
    pub fn tool(mut self, tool: Arc<dyn Tool>) -> Self {
        self.tools.push(tool);
        self
    }

    /// A behaviour of the test's own (see [`OrganizationBuilder::behaviour`](crate::OrganizationBuilder::behaviour)).
    pub fn behaviour(mut self, behaviour: Arc<dyn crate::Behaviour>) -> Self {
        self.behaviours.push(behaviour);
        self
    }

    /// Root agents answer to `outbound` instead of the harness's reply stream (which then stays
    /// empty).
    pub fn outbound(mut self, outbound: Arc<dyn crate::runtime::Outbound>) -> Self {
        self.outbound = Some(outbound);
        self
    }

    /// The prompt templates (default: the built-in ones).
    pub fn prompts(mut self, prompts: crate::prompts::Prompts) -> Self {
        self.prompts = Some(prompts);
        self
    }

    /// Runs `agent`'s tasks with `executor`.
    pub fn executor(mut self, agent: &str, executor: Arc<dyn TaskExecutor>) -> Self {
        self.executors
            .push((AgentId::parse(agent).expect("a valid agent id"), executor));
        self
    }

    /// Hosts agents under `placement` (see
    /// [`OrganizationBuilder::placement`](crate::OrganizationBuilder::placement)): the organization
    /// shares its stores with other processes and runs only the agents it holds.
    pub fn placement(
        mut self,
        placement: Arc<dyn crate::placement::Placement>,
        options: crate::placement::PlacementOptions,
    ) -> Self {
        self.placement = Some((placement, options));
        self
    }

    /// Builds the organization (agents stopped). Must run inside a Tokio runtime.
    pub async fn build(self) -> OrgHarness {
        let config = OrgConfig::from_toml_str(&self.config).expect("a valid configuration");
        let stores = self.stores.unwrap_or_else(Stores::memory);
        let events = Arc::new(RecordingSink::new());
        let clock: Arc<dyn Clock> = match &self.clock {
            Some(c) => Arc::new(c.clone()),
            None => Arc::new(TokioClock),
        };
        let mut builder = Organization::builder(config)
            .stores(stores.clone())
            .llm(self.llm.expect("the harness needs a model: call .llm(...)"))
            .spawner(Arc::new(TokioSpawner::current()))
            .clock(clock)
            .events(events.clone());
        for tool in self.tools {
            builder = builder.tool(tool);
        }
        for behaviour in self.behaviours {
            builder = builder.behaviour(behaviour);
        }
        for (agent, executor) in self.executors {
            builder = builder.task_executor(agent, executor);
        }
        if let Some((placement, options)) = self.placement {
            builder = builder.placement(placement, options);
        }
        if let Some(prompts) = self.prompts {
            builder = builder.prompts(prompts);
        }
        let custom_outbound = self.outbound.is_some();
        if let Some(outbound) = self.outbound {
            builder = builder.outbound(outbound);
        }
        let org = builder.build().await.expect("the organization builds");
        let replies = if custom_outbound {
            // An outbound of the test's own: a stream that stays empty.
            crate::Replies::new(
                futures::channel::mpsc::unbounded().1,
                org.inner.loops.helper(),
            )
        } else {
            org.take_replies().expect("replies not taken yet")
        };
        OrgHarness {
            org,
            replies,
            events,
            stores,
            clock: self.clock,
            timeout: Duration::from_secs(10),
        }
    }
}

/// The next model call of a [`MockLlm`](crate::testing::MockLlm) pair, failing the test after
/// 10 s (a hang guard, not a timing assertion).
pub async fn next_call(calls: &mut MockLlmHandle) -> PendingCall {
    match tokio::time::timeout(Duration::from_secs(10), calls.next()).await {
        Ok(Some(call)) => call,
        Ok(None) => panic!("the model's handle closed"),
        Err(_) => panic!("no model call within 10 s"),
    }
}
