//! Shared set-up for the conversation tests.
#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use spacebot_core::channel::ChannelRecord;
use spacebot_core::config::OrgConfig;
use spacebot_core::conversation::{Conversation, ConversationFilter};
use spacebot_core::event::EventKind;
use spacebot_core::rt::TokioSpawner;
use spacebot_core::runtime::Reply;
use spacebot_core::testing::RecordingSink;
use spacebot_core::{
    AgentId, ChannelId, ChannelStore, DeliveryStore, Envelope, EnvelopeId, LlmProvider,
    ManualClock, Organization, RecordKind, StoreError, Stores, Timestamp, Tool,
};

pub fn id(s: &str) -> AgentId {
    AgentId::parse(s).unwrap()
}

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

pub fn config(settings: &str, body: &str) -> OrgConfig {
    OrgConfig::from_toml_str(&format!("[settings]\n{settings}\n{body}")).unwrap()
}

pub struct Harness {
    pub org: Organization,
    pub replies: spacebot_core::Replies,
    pub events: Arc<RecordingSink>,
    pub stores: Stores,
}

pub struct Setup {
    pub settings: String,
    pub body: String,
    pub stores: Stores,
    pub tools: Vec<Arc<dyn Tool>>,
}

impl Setup {
    pub fn new(body: &str) -> Self {
        Self {
            settings: String::new(),
            body: body.to_string(),
            stores: Stores::memory(),
            tools: Vec::new(),
        }
    }

    pub fn settings(mut self, settings: &str) -> Self {
        self.settings = settings.to_string();
        self
    }

    pub fn stores(mut self, stores: Stores) -> Self {
        self.stores = stores;
        self
    }

    pub fn tool(mut self, tool: Arc<dyn Tool>) -> Self {
        self.tools.push(tool);
        self
    }

    pub async fn build(self, llm: Arc<dyn LlmProvider>) -> Harness {
        let events = Arc::new(RecordingSink::new());
        let mut builder = Organization::builder(config(&self.settings, &self.body))
            .stores(self.stores.clone())
            .llm(llm)
            .spawner(Arc::new(TokioSpawner::current()))
            .clock(Arc::new(ManualClock::new(1_000)))
            .events(events.clone());
        for tool in self.tools {
            builder = builder.tool(tool);
        }
        let org = builder.build().await.unwrap();
        let replies = org.take_replies().unwrap();
        Harness {
            org,
            replies,
            events,
            stores: self.stores,
        }
    }
}

pub async fn harness(llm: Arc<dyn LlmProvider>) -> Harness {
    Setup::new(ABCD).build(llm).await
}

impl Harness {
    /// The next reply (hang guard 10 s, not a timing assertion).
    pub async fn reply(&mut self) -> Reply {
        tokio::time::timeout(Duration::from_secs(10), self.replies.next())
            .await
            .expect("no reply within 10 s")
            .expect("reply stream closed")
    }

    /// Waits until `pred` holds for the recorded events (hang guard 10 s).
    pub async fn wait_for(&self, what: &str, pred: impl Fn(&[EventKind]) -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !pred(&self.events.kinds()) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Waits until every running agent is idle (queue empty, no turn, no task) and no event was
    /// emitted across two consecutive checks (hang guard 10 s).
    pub async fn quiesce(&self) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut stable = 0;
        let mut last = usize::MAX;
        while stable < 2 {
            if tokio::time::Instant::now() >= deadline {
                let kinds = self.events.kinds();
                let tail = &kinds[kinds.len().saturating_sub(30)..];
                panic!("the organization never went quiet; last events: {tail:?}");
            }
            tokio::time::sleep(Duration::from_millis(3)).await;
            let n = self.events.len();
            let idle = self
                .org
                .agent_ids()
                .iter()
                .filter(|a| self.org.is_running(a))
                .all(|a| self.org.is_idle(a));
            if n == last && idle {
                stable += 1;
            } else {
                stable = 0;
            }
            last = n;
        }
    }

    pub async fn history(&self, agent: &str, channel: &ChannelId) -> Vec<ChannelRecord> {
        self.stores
            .channels
            .history(&id(agent), channel, None)
            .await
            .unwrap()
    }

    /// `(kind, content)` of a channel's records, tool records left out.
    pub async fn lines(&self, agent: &str, channel: &ChannelId) -> Vec<(RecordKind, String)> {
        self.history(agent, channel)
            .await
            .into_iter()
            .filter(|r| r.record.kind != RecordKind::Tool)
            .map(|r| (r.record.kind, r.record.content.into_string()))
            .collect()
    }

    pub async fn all_conversations(&self) -> Vec<Conversation> {
        self.org
            .conversations(&ConversationFilter::default())
            .await
            .unwrap()
    }

    pub async fn only_conversation(&self) -> Conversation {
        let all = self.all_conversations().await;
        assert_eq!(all.len(), 1, "expected one conversation, got {all:#?}");
        all.into_iter().next().unwrap()
    }

    pub fn count(&self, pred: impl Fn(&EventKind) -> bool) -> usize {
        self.events.kinds().iter().filter(|k| pred(k)).count()
    }
}

pub fn link(owner: &str, peer: &str) -> ChannelId {
    ChannelId::link(&id(owner), &id(peer))
}

pub fn portal(agent: &str) -> ChannelId {
    ChannelId::portal(&id(agent))
}

/// A message from the portal chat of `agent`.
pub fn chat(agent: &str, text: &str) -> spacebot_core::InboundMessage {
    spacebot_core::InboundMessage::new("portal", format!("chat:{agent}"), text)
        .with_channel(portal(agent))
}

/// Delivery store whose `persist` fails for one agent (a member whose deliveries cannot be kept).
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
        commit: &spacebot_core::envelope::TurnCommit,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        self.inner.commit(agent, commit, now).await
    }
}
