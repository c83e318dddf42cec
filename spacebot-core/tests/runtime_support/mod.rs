//! Shared set-up for the runtime tests.
#![allow(dead_code, unreachable_pub)]
// Test set-up: a failure should stop the test with its message.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use spacebot_core::config::OrgConfig;
use spacebot_core::rt::TokioSpawner;
use spacebot_core::runtime::Reply;
use spacebot_core::testing::RecordingSink;
use spacebot_core::tools::{Tool, ToolContext, ToolError, ToolOutput};
use spacebot_core::{
    AgentId, InternalMessage, LlmProvider, ManualClock, Organization, Stores, ToolDefinition,
};

pub fn id(s: &str) -> AgentId {
    AgentId::parse(s).unwrap()
}

/// Three agents: `a` superior of `b` over a one-way link, `c` unlinked; `extra` goes into `[settings]`.
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

[[links]]
from = "a"
to = "b"
direction = "one_way"
relationship = "superior"
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

pub async fn harness(
    llm: Arc<dyn LlmProvider>,
    settings: &str,
    tools: Vec<Arc<dyn Tool>>,
) -> Harness {
    let stores = Stores::memory();
    let events = Arc::new(RecordingSink::new());
    let clock = ManualClock::new(1_000);
    let mut builder = Organization::builder(config(settings))
        .stores(stores.clone())
        .llm(llm)
        .spawner(Arc::new(TokioSpawner::current()))
        .clock(Arc::new(clock.clone()))
        .events(events.clone());
    for tool in tools {
        builder = builder.tool(tool);
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
                "timed out waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
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
        let args: Args = spacebot_core::tools::parse_args("echo", args)?;
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
        let args: Args = spacebot_core::tools::parse_args("ping", args)?;
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
            Err(spacebot_core::DeliveryError::Denied(d)) => Err(ToolError::Denied(d)),
            Err(e) => Err(ToolError::failed("ping", e.to_string())),
        }
    }
}
