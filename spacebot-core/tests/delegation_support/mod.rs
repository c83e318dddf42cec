//! Shared set-up for the delegation tests.
#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use spacebot_core::config::OrgConfig;
use spacebot_core::delegation::TaskExecutor;
use spacebot_core::event::EventKind;
use spacebot_core::rt::TokioSpawner;
use spacebot_core::runtime::Reply;
use spacebot_core::testing::RecordingSink;
use spacebot_core::{
    AgentId, ChannelId, ChannelRecord, ChannelStore, ChatMessage, ChatRequest, InboundMessage,
    LlmProvider, ManualClock, Organization, Stores, Task, TaskStore,
};

pub fn id(s: &str) -> AgentId {
    AgentId::parse(s).unwrap()
}

/// Five agents:
///
/// - `a` (Alpha) is the superior of `b` (Beta), `b` the superior of `c` (Gamma), two-way links;
/// - `c` and `a` are peers (two-way), so a chain a -> b -> c -> a is possible;
/// - `c` and `d` (Delta) are peers (two-way);
/// - `a` -> `d` is one-way: `d` may not start anything with `a`;
/// - `a` -> `e` (Echo) is disabled.
///
/// `extra` goes into `[settings]`.
pub fn config(extra_settings: &str) -> OrgConfig {
    OrgConfig::from_toml_str(&format!(
        r#"
[settings]
{extra_settings}

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
"#
    ))
    .unwrap()
}

pub struct Harness {
    pub org: Organization,
    pub replies: spacebot_core::Replies,
    pub events: Arc<RecordingSink>,
    pub stores: Stores,
    pub clock: ManualClock,
}

/// An organization on memory stores (or `stores`), a manual clock, the tokio spawner, and the given
/// per-agent task executors. Nothing is started.
pub async fn harness_with(
    llm: Arc<dyn LlmProvider>,
    settings: &str,
    stores: Stores,
    executors: Vec<(AgentId, Arc<dyn TaskExecutor>)>,
) -> Harness {
    let events = Arc::new(RecordingSink::new());
    let clock = ManualClock::new(1_000);
    let mut builder = Organization::builder(config(settings))
        .stores(stores.clone())
        .llm(llm)
        .spawner(Arc::new(TokioSpawner::current()))
        .clock(Arc::new(clock.clone()))
        .events(events.clone());
    for (agent, executor) in executors {
        builder = builder.task_executor(agent, executor);
    }
    let org = builder.build().await.unwrap();
    let replies = org.take_replies().unwrap();
    Harness {
        org,
        replies,
        events,
        stores,
        clock,
    }
}

/// [`harness_with`] on fresh memory stores, without executors, every agent started.
pub async fn harness(llm: Arc<dyn LlmProvider>, settings: &str) -> Harness {
    let h = harness_with(llm, settings, Stores::memory(), vec![]).await;
    h.org.start_all().await.unwrap();
    h
}

pub fn user(text: &str) -> InboundMessage {
    InboundMessage::new("portal", "u1", text)
}

/// The channel `user` messages arrive on.
pub fn portal() -> ChannelId {
    ChannelId::new("portal:u1")
}

impl Harness {
    /// The next reply, failing the test after 10 s (a hang guard, not a timing assertion).
    pub async fn reply(&mut self) -> Reply {
        tokio::time::timeout(Duration::from_secs(10), self.replies.next())
            .await
            .expect("no reply within 10 s")
            .expect("reply stream closed")
    }

    /// Waits until `pred` holds for the recorded events (hang guard 10 s).
    pub async fn wait_for(&self, what: &str, pred: impl Fn(&RecordingSink) -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !pred(&self.events) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}; events: {:#?}",
                self.events.kinds()
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Waits until `count` events match `pred`.
    pub async fn wait_count(&self, what: &str, count: usize, pred: impl Fn(&EventKind) -> bool) {
        self.wait_for(what, |ev| {
            ev.kinds().iter().filter(|k| pred(k)).count() >= count
        })
        .await;
    }

    /// Waits until the organization is quiet: every running agent idle, no task ready to claim and
    /// no completion notice to send, and no event across two consecutive checks (hang guard 10 s).
    pub async fn settle(&self) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut settled_at = None;
        loop {
            let before = self.events.len();
            let mut quiet = true;
            for agent in self.org.agent_ids() {
                if !self.org.is_running(&agent) {
                    continue;
                }
                let ready = spacebot_core::task::TaskFilter {
                    statuses: vec![spacebot_core::TaskStatus::Ready],
                    ..Default::default()
                };
                quiet &= self.org.is_idle(&agent)
                    && self
                        .stores
                        .tasks
                        .list(&agent, &ready)
                        .await
                        .unwrap()
                        .is_empty()
                    && self
                        .stores
                        .tasks
                        .outbox_pending(&agent)
                        .await
                        .unwrap()
                        .is_empty();
            }
            let quiet = quiet && self.events.len() == before;
            if quiet && settled_at == Some(before) {
                return;
            }
            settled_at = quiet.then_some(before);
            assert!(
                tokio::time::Instant::now() < deadline,
                "the organization was not quiet within 10 s; events: {:#?}",
                self.events.kinds()
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    pub async fn task(&self, agent: &str, number: u64) -> Task {
        self.stores
            .tasks
            .get(&id(agent), number)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("no task {agent}#{number}"))
    }

    pub async fn board(&self, agent: &str) -> Vec<Task> {
        self.stores
            .tasks
            .list(&id(agent), &Default::default())
            .await
            .unwrap()
    }

    pub async fn history(&self, agent: &str, channel: &ChannelId) -> Vec<ChannelRecord> {
        self.stores
            .channels
            .history(&id(agent), channel, None)
            .await
            .unwrap()
    }

    /// The texts of `owner`'s side of the link channel with `peer`.
    pub async fn link_texts(&self, owner: &str, peer: &str) -> Vec<String> {
        self.history(owner, &ChannelId::link(&id(owner), &id(peer)))
            .await
            .into_iter()
            .map(|r| r.record.content.into_string())
            .collect()
    }

    pub fn count(&self, pred: impl Fn(&EventKind) -> bool) -> usize {
        self.events.kinds().iter().filter(|k| pred(k)).count()
    }
}

/// The last user message of a request.
pub fn last_user_text(req: &ChatRequest) -> String {
    req.messages
        .iter()
        .rev()
        .find_map(|m| match m {
            ChatMessage::User { content } => Some(content.to_string()),
            _ => None,
        })
        .unwrap_or_default()
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
