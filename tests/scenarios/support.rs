//! What the scenario suites share: the organizations they run, each on the stores it is given, as
//! an [`OrgHarness`] on a manual clock. The harness, its read-outs, the organizations' TOML, the
//! tools and the message helpers are `spacebot::testing`'s; this module only binds them to the
//! suites' names.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use futures::future::BoxFuture;
use spacebot::testing::OrgHarness;
use spacebot::{AgentId, ChatRequest, LlmProvider, ManualClock, Tool};

pub use spacebot::Stores;
pub use spacebot::testing::orgs::with_settings;
pub use spacebot::testing::{agent as id, chat, link, next_call, portal, user};

/// The harness every suite runs on.
pub type Harness = OrgHarness;

/// Opens fresh stores of the backend a scenario runs on, for scenarios that build several
/// organizations one after the other.
pub type OpenStores = Arc<dyn Fn() -> BoxFuture<'static, Stores> + Send + Sync>;

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
    spacebot::testing::tool_results(&req.messages)
}

/// The organizations of the agent-runtime scenarios.
pub mod agent {
    pub use spacebot::testing::orgs::RUNTIME as ORG;
    pub use spacebot::testing::tools::{BrokenTool, EchoTool, PingTool};

    use super::*;

    /// [`ORG`] on `stores` with `settings` and `tools`; nothing started.
    pub async fn harness(
        stores: Stores,
        llm: Arc<dyn LlmProvider>,
        settings: &str,
        tools: Vec<Arc<dyn Tool>>,
    ) -> Harness {
        build(with_settings(settings, ORG), stores, llm, tools).await
    }
}

/// The organizations of the delegation scenarios.
pub mod delegation {
    use spacebot::ChannelId;
    use spacebot::delegation::TaskExecutor;

    pub use spacebot::testing::orgs::DELEGATION as ORG;

    use super::*;

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
    pub use spacebot::testing::FailingDeliveries;
    pub use spacebot::testing::orgs::CONVERSATION as ABCD;

    use super::*;

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
