//! What the scenario suites share: the organizations they run (each on the stores it is given, as
//! an [`OrgHarness`] on a manual clock), message helpers, and read-outs of the stores.
#![allow(dead_code, unreachable_pub, async_fn_in_trait)]

use std::sync::Arc;

use futures::future::BoxFuture;
use spacebot::conversation::{Conversation, ConversationFilter};
use spacebot::testing::{MockLlmHandle, OrgHarness, PendingCall};
use spacebot::{
    AgentId, ChannelId, ChatMessage, ChatRequest, InboundMessage, LlmProvider, ManualClock,
    RecordKind, Task, Tool,
};

pub use spacebot::Stores;

/// The harness every suite runs on.
pub type Harness = OrgHarness;

/// Opens fresh stores of the backend a scenario runs on, for scenarios that build several
/// organizations one after the other.
pub type OpenStores = Arc<dyn Fn() -> BoxFuture<'static, Stores> + Send + Sync>;

pub fn id(s: &str) -> AgentId {
    AgentId::parse(s).unwrap()
}

/// `config` with `settings` in its `[settings]` table.
pub fn with_settings(settings: &str, config: &str) -> String {
    format!("[settings]\n{settings}\n{config}")
}

/// A harness for `config` on `stores`, a manual clock at 1 000 ms, `llm`, and `tools`; nothing
/// started.
pub async fn build(
    config: String,
    stores: Stores,
    llm: Arc<dyn LlmProvider>,
    tools: Vec<Arc<dyn Tool>>,
) -> Harness {
    let mut builder = OrgHarness::builder(config)
        .stores(stores)
        .llm(llm)
        .manual_clock(ManualClock::new(1_000));
    for tool in tools {
        builder = builder.tool(tool);
    }
    builder.build().await
}

/// The last user message of a request.
pub fn last_user_text(req: &ChatRequest) -> String {
    spacebot::testing::last_user_text(&req.messages)
}

/// The tool results of a request, in order.
pub fn tool_results(req: &ChatRequest) -> Vec<String> {
    req.messages
        .iter()
        .filter_map(|m| match m {
            ChatMessage::Tool { content, .. } => Some(content.to_string()),
            _ => None,
        })
        .collect()
}

/// The next model call of a [`MockLlm`](spacebot::testing::MockLlm) pair, failing the test after
/// 10 s (a hang guard, not a timing assertion).
pub async fn next_call(calls: &mut MockLlmHandle) -> PendingCall {
    match tokio::time::timeout(std::time::Duration::from_secs(10), calls.next()).await {
        Ok(Some(call)) => call,
        Ok(None) => panic!("the model's handle closed"),
        Err(_) => panic!("no model call within 10 s"),
    }
}

/// A message from user `u1` of the portal (channel `portal:u1`).
pub fn user(text: &str) -> InboundMessage {
    InboundMessage::new("portal", "u1", text)
}

/// The link channel `owner` keeps with `peer`.
pub fn link(owner: &str, peer: &str) -> ChannelId {
    ChannelId::link(&id(owner), &id(peer))
}

/// The portal chat channel of `agent`.
pub fn portal(agent: &str) -> ChannelId {
    ChannelId::portal(&id(agent))
}

/// A message from the portal chat of `agent`.
pub fn chat(agent: &str, text: &str) -> InboundMessage {
    InboundMessage::new("portal", format!("chat:{agent}"), text).with_channel(portal(agent))
}

/// Read-outs of the stores and the organization a harness runs.
pub trait Look {
    /// Task `number` of `agent`'s board (fails the test when missing).
    async fn task(&self, agent: &str, number: u64) -> Task;
    /// `agent`'s board.
    async fn board(&self, agent: &str) -> Vec<Task>;
    /// The texts of `owner`'s side of the link channel with `peer`.
    async fn link_texts(&self, owner: &str, peer: &str) -> Vec<String>;
    /// `(kind, content)` of a channel's records, tool records left out.
    async fn lines(&self, agent: &str, channel: &ChannelId) -> Vec<(RecordKind, String)>;
    /// Every conversation.
    async fn all_conversations(&self) -> Vec<Conversation>;
    /// The one conversation (fails the test when there are more or none).
    async fn only_conversation(&self) -> Conversation;
}

impl Look for OrgHarness {
    async fn task(&self, agent: &str, number: u64) -> Task {
        self.stores
            .tasks
            .get(&id(agent), number)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("no task {agent}#{number}"))
    }

    async fn board(&self, agent: &str) -> Vec<Task> {
        self.stores
            .tasks
            .list(&id(agent), &Default::default())
            .await
            .unwrap()
    }

    async fn link_texts(&self, owner: &str, peer: &str) -> Vec<String> {
        self.history(owner, &link(owner, peer))
            .await
            .into_iter()
            .map(|r| r.record.content.into_string())
            .collect()
    }

    async fn lines(&self, agent: &str, channel: &ChannelId) -> Vec<(RecordKind, String)> {
        self.history(agent, channel)
            .await
            .into_iter()
            .filter(|r| r.record.kind != RecordKind::Tool)
            .map(|r| (r.record.kind, r.record.content.into_string()))
            .collect()
    }

    async fn all_conversations(&self) -> Vec<Conversation> {
        self.org
            .conversations(&ConversationFilter::default())
            .await
            .unwrap()
    }

    async fn only_conversation(&self) -> Conversation {
        let all = self.all_conversations().await;
        assert_eq!(all.len(), 1, "expected one conversation, got {all:#?}");
        all.into_iter().next().unwrap()
    }
}

/// The organizations of the agent-runtime scenarios.
pub mod agent {
    use async_trait::async_trait;
    use spacebot::tools::{ToolContext, ToolError, ToolOutput};
    use spacebot::{InternalMessage, ToolDefinition};

    use super::*;

    /// Three agents: `a` superior of `b` over a one-way link, `c` unlinked.
    pub const ORG: &str = r#"
[[agents]]
id = "a"
name = "Alpha"

[[agents]]
id = "b"
name = "Beta"

[[agents]]
id = "c"
name = "Gamma"

[[links]]
from = "a"
to = "b"
direction = "one_way"
relationship = "superior"
"#;

    /// [`ORG`] on `stores` with `settings` and `tools`; nothing started.
    pub async fn harness(
        stores: Stores,
        llm: Arc<dyn LlmProvider>,
        settings: &str,
        tools: Vec<Arc<dyn Tool>>,
    ) -> Harness {
        build(with_settings(settings, ORG), stores, llm, tools).await
    }

    /// Echoes its `text` argument.
    #[derive(Debug)]
    pub struct EchoTool;

    #[async_trait]
    impl Tool for EchoTool {
        fn definition(&self) -> ToolDefinition {
            ToolDefinition {
                name: "echo".into(),
                description: "Echoes text.".into(),
                parameters: serde_json::json!({
                    "type": "object",
                    "properties": {"text": {"type": "string"}},
                    "required": ["text"]
                }),
            }
        }
        async fn call(
            &self,
            _ctx: &ToolContext,
            args: serde_json::Value,
        ) -> Result<ToolOutput, ToolError> {
            #[derive(serde::Deserialize)]
            struct Args {
                text: String,
            }
            let args: Args = spacebot::tools::parse_args("echo", args)?;
            Ok(ToolOutput::text(format!("echo: {}", args.text)))
        }
    }

    /// Always fails.
    #[derive(Debug)]
    pub struct BrokenTool;

    #[async_trait]
    impl Tool for BrokenTool {
        fn definition(&self) -> ToolDefinition {
            ToolDefinition {
                name: "broken".into(),
                description: "Always fails.".into(),
                parameters: serde_json::json!({"type": "object"}),
            }
        }
        async fn call(
            &self,
            _ctx: &ToolContext,
            _args: serde_json::Value,
        ) -> Result<ToolOutput, ToolError> {
            Err(ToolError::failed("broken", "the disk is on fire"))
        }
    }

    /// Sends a task to `target` over the internal channel, as the calling agent.
    #[derive(Debug)]
    pub struct PingTool;

    #[async_trait]
    impl Tool for PingTool {
        fn definition(&self) -> ToolDefinition {
            ToolDefinition {
                name: "ping".into(),
                description: "Sends a task to another agent.".into(),
                parameters: serde_json::json!({
                    "type": "object",
                    "properties": {"target": {"type": "string"}},
                    "required": ["target"]
                }),
            }
        }
        async fn call(
            &self,
            ctx: &ToolContext,
            args: serde_json::Value,
        ) -> Result<ToolOutput, ToolError> {
            #[derive(serde::Deserialize)]
            struct Args {
                target: String,
            }
            let args: Args = spacebot::tools::parse_args("ping", args)?;
            let target = ctx
                .org
                .resolve(&args.target)
                .map_err(|e| ToolError::failed("ping", e.to_string()))?;
            match ctx
                .org
                .send_internal(&ctx.agent, &target, InternalMessage::task("ping"))
                .await
            {
                Ok(_) => Ok(ToolOutput::text("sent")),
                Err(spacebot::DeliveryError::Denied(d)) => Err(ToolError::Denied(d)),
                Err(e) => Err(ToolError::failed("ping", e.to_string())),
            }
        }
    }
}

/// The organizations of the delegation scenarios.
pub mod delegation {
    use spacebot::delegation::TaskExecutor;

    use super::*;

    /// Five agents:
    ///
    /// - `a` (Alpha) is the superior of `b` (Beta), `b` the superior of `c` (Gamma), two-way links;
    /// - `c` and `a` are peers (two-way), so a chain a -> b -> c -> a is possible;
    /// - `c` and `d` (Delta) are peers (two-way);
    /// - `a` -> `d` is one-way: `d` may not start anything with `a`;
    /// - `a` -> `e` (Echo) is disabled.
    pub const ORG: &str = r#"
[[agents]]
id = "a"
name = "Alpha"

[[agents]]
id = "b"
name = "Beta"

[[agents]]
id = "c"
name = "Gamma"

[[agents]]
id = "d"
name = "Delta"

[[agents]]
id = "e"
name = "Echo"

[[links]]
from = "a"
to = "b"
relationship = "superior"

[[links]]
from = "b"
to = "c"
relationship = "superior"

[[links]]
from = "c"
to = "a"

[[links]]
from = "c"
to = "d"

[[links]]
from = "a"
to = "d"
direction = "one_way"

[[links]]
from = "a"
to = "e"
enabled = false
"#;

    /// [`ORG`] on `stores` with `settings` and the given per-agent task executors; nothing
    /// started.
    pub async fn harness_with(
        llm: Arc<dyn LlmProvider>,
        settings: &str,
        stores: Stores,
        executors: Vec<(AgentId, Arc<dyn TaskExecutor>)>,
    ) -> Harness {
        let mut builder = OrgHarness::builder(with_settings(settings, ORG))
            .stores(stores)
            .llm(llm)
            .manual_clock(ManualClock::new(1_000));
        for (agent, executor) in executors {
            builder = builder.executor(agent.as_str(), executor);
        }
        builder.build().await
    }

    /// [`harness_with`] without executors, every agent started.
    pub async fn harness(stores: Stores, llm: Arc<dyn LlmProvider>, settings: &str) -> Harness {
        let h = harness_with(llm, settings, stores, vec![]).await;
        h.org.start_all().await.unwrap();
        h
    }

    /// The channel [`user`] messages arrive on.
    pub fn portal() -> ChannelId {
        ChannelId::new("portal:u1")
    }
}

/// The organizations of the conversation scenarios.
pub mod conversation {
    use async_trait::async_trait;
    use spacebot::{DeliveryStore, Envelope, EnvelopeId, StoreError, Timestamp};

    use super::*;

    /// Agents `a` (Alpha), `b` (Beta), `c` (Gamma), `d` (Delta). Links: `a -> b` one-way superior,
    /// `a -> c` two-way peer, `a -> d` two-way peer; `b` and `c` are not linked to each other.
    pub const ABCD: &str = r#"
[[agents]]
id = "a"
name = "Alpha"

[[agents]]
id = "b"
name = "Beta"

[[agents]]
id = "c"
name = "Gamma"

[[agents]]
id = "d"
name = "Delta"

[[links]]
from = "a"
to = "b"
direction = "one_way"
relationship = "superior"

[[links]]
from = "a"
to = "c"
direction = "two_way"
relationship = "peer"

[[links]]
from = "a"
to = "d"
direction = "two_way"
relationship = "peer"
"#;

    /// An organization to build: its settings, agents and links, stores and tools.
    pub struct Setup {
        pub settings: String,
        pub body: String,
        pub stores: Stores,
        pub tools: Vec<Arc<dyn Tool>>,
    }

    impl Setup {
        pub fn new(body: &str, stores: Stores) -> Self {
            Self {
                settings: String::new(),
                body: body.to_string(),
                stores,
                tools: Vec::new(),
            }
        }

        pub fn settings(mut self, settings: &str) -> Self {
            self.settings = settings.to_string();
            self
        }

        pub fn tool(mut self, tool: Arc<dyn Tool>) -> Self {
            self.tools.push(tool);
            self
        }

        pub async fn build(self, llm: Arc<dyn LlmProvider>) -> Harness {
            build(
                with_settings(&self.settings, &self.body),
                self.stores,
                llm,
                self.tools,
            )
            .await
        }
    }

    /// [`ABCD`] on `stores`; nothing started.
    pub async fn harness(stores: Stores, llm: Arc<dyn LlmProvider>) -> Harness {
        Setup::new(ABCD, stores).build(llm).await
    }

    /// Delivery store whose `persist` fails for one agent (a member whose deliveries cannot be
    /// kept).
    #[derive(Debug)]
    pub struct FailingDeliveries {
        pub inner: Arc<dyn DeliveryStore>,
        pub broken: AgentId,
    }

    #[async_trait]
    impl DeliveryStore for FailingDeliveries {
        async fn persist(&self, agent: &AgentId, envelope: &Envelope) -> Result<(), StoreError> {
            if agent == &self.broken {
                return Err(StoreError::Backend {
                    backend: "test",
                    message: "the disk is full".into(),
                    source: None,
                });
            }
            self.inner.persist(agent, envelope).await
        }
        async fn pending(&self, agent: &AgentId) -> Result<Vec<Envelope>, StoreError> {
            self.inner.pending(agent).await
        }
        async fn remove(&self, agent: &AgentId, id: &EnvelopeId) -> Result<(), StoreError> {
            self.inner.remove(agent, id).await
        }
        async fn mark_applied(
            &self,
            agent: &AgentId,
            key: &str,
            now: Timestamp,
        ) -> Result<bool, StoreError> {
            self.inner.mark_applied(agent, key, now).await
        }
        fn is_durable(&self) -> bool {
            self.inner.is_durable()
        }
        async fn is_applied(&self, agent: &AgentId, key: &str) -> Result<bool, StoreError> {
            self.inner.is_applied(agent, key).await
        }
        async fn commit(
            &self,
            agent: &AgentId,
            commit: &spacebot::envelope::TurnCommit,
            now: Timestamp,
        ) -> Result<(), StoreError> {
            self.inner.commit(agent, commit, now).await
        }
    }
}

/// A model whose calls for one agent wait while the gate is closed: the test decides what
/// happens before that agent answers (instead of hoping another task wins a race). Starts closed.
#[derive(Debug)]
pub struct Held {
    inner: Arc<dyn LlmProvider>,
    agent: AgentId,
    open: tokio::sync::watch::Sender<bool>,
}

impl Held {
    /// `inner`, with every call of `agent` held until [`open`](Self::open).
    pub fn new(inner: Arc<dyn LlmProvider>, agent: &str) -> Arc<Self> {
        Arc::new(Self {
            inner,
            agent: id(agent),
            open: tokio::sync::watch::Sender::new(false),
        })
    }

    /// Lets every held and later call through.
    pub fn open(&self) {
        self.open.send_replace(true);
    }

    /// Holds the calls that start from now on.
    pub fn close(&self) {
        self.open.send_replace(false);
    }
}

#[async_trait::async_trait]
impl LlmProvider for Held {
    async fn complete(
        &self,
        request: ChatRequest,
    ) -> Result<spacebot::ChatResponse, spacebot::LlmError> {
        if request.agent.as_ref() == Some(&self.agent) {
            let mut open = self.open.subscribe();
            // The sender lives as long as `self`: `wait_for` cannot fail here.
            let _ = open.wait_for(|open| *open).await;
        }
        self.inner.complete(request).await
    }
}
