//! Steering: a long tool loop interrupted by two user messages.
//!
//! The analyst starts a long research task (several tool rounds). While its `research` tool runs, the
//! user sends two more messages. At the next checkpoint the agent drains its queue, answers both new
//! messages at once, then resumes the interrupted task in the same turn, and finishes it.
//!
//! ```text
//! cargo run --example steering
//! ```
//!
//! Runs offline: the model is a small deterministic function of the request (`FnLlm`), the store is
//! in memory. The two interrupting messages are sent from inside the tool, as if the user typed them
//! while it ran, so the run is the same every time.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use spacebot_core::config::OrgConfig;
use spacebot_core::event::{Event, EventKind, EventSink};
use spacebot_core::rt::{TokioClock, TokioSpawner};
use spacebot_core::runtime::{Outbound, OutboundError, Reply};
use spacebot_core::testing::{FnLlm, tool_call};
use spacebot_core::tools::{Tool, ToolContext, ToolError, ToolOutput};
use spacebot_core::{
    ChatMessage, ChatRequest, ChatResponse, InboundMessage, Organization, Stores, ToolDefinition,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A slow research step. On its second call the user sends two messages (through the
/// organization's gateway, as a chat UI would: a tool itself may only act as its own agent).
#[derive(Debug, Default)]
struct Research {
    calls: AtomicU32,
    gateway: std::sync::OnceLock<Organization>,
}

#[async_trait]
impl Tool for Research {
    fn definition(&self) -> ToolDefinition {
        ToolDefinition {
            name: "research".into(),
            description: "Research one step of a topic.".into(),
            parameters: serde_json::json!({
                "type": "object",
                "properties": {"step": {"type": "integer"}},
                "required": ["step"]
            }),
        }
    }

    async fn call(
        &self,
        ctx: &ToolContext,
        args: serde_json::Value,
    ) -> Result<ToolOutput, ToolError> {
        let step = args.get("step").and_then(|s| s.as_u64()).unwrap_or(0);
        let _ = &ctx.agent;
        if self.calls.fetch_add(1, Ordering::SeqCst) == 1 {
            for text in [
                "Actually, answer in French.",
                "And keep it to one sentence.",
            ] {
                println!("user (while the tool runs): {text}");
                let Some(gateway) = self.gateway.get() else {
                    return Err(ToolError::failed("research", "no gateway"));
                };
                gateway
                    .deliver("analyst", InboundMessage::new("portal", "user-1", text))
                    .await
                    .map_err(|e| ToolError::failed("research", e.to_string()))?;
            }
        }
        Ok(ToolOutput::text(format!("notes from step {step}")))
    }
}

/// The deterministic model: research the task in four steps; answer merged messages at once.
fn model(request: &ChatRequest) -> Result<ChatResponse, spacebot_core::LlmError> {
    let last_user = request
        .messages
        .iter()
        .rposition(|m| matches!(m, ChatMessage::User { .. }))
        .unwrap_or(0);
    // Research steps done so far in this turn (the turn resumes after a steer, context kept).
    let rounds = request
        .messages
        .iter()
        .filter(|m| matches!(m, ChatMessage::Tool { .. }))
        .count();
    let ChatMessage::User { content } = &request.messages[last_user] else {
        return Ok(ChatResponse::text("?"));
    };
    if content.starts_with("2 messages arrived") {
        return Ok(ChatResponse::text(
            "D'accord : je réponds en français, en une phrase.",
        ));
    }
    if rounds < 4 {
        let step = rounds + 1;
        return Ok(ChatResponse::tool_calls(vec![tool_call(
            "research",
            serde_json::json!({ "step": step }),
        )]));
    }
    Ok(ChatResponse::text(
        "Le rapport est prêt : quatre étapes de recherche, une conclusion.",
    ))
}

/// Prints the events that tell the story, as the agent's loop emits them.
#[derive(Debug)]
struct PrintEvents;

impl EventSink for PrintEvents {
    fn emit(&self, event: Event) {
        match event.kind {
            EventKind::TurnStarted => println!("  [event] turn started"),
            EventKind::ToolCalled { tool, .. } => println!("  [event] tool {tool} ran"),
            EventKind::Steered { merged } => println!(
                "  [event] checkpoint: {merged} new message(s) merged into one, answered first; then the turn resumes the report"
            ),
            EventKind::TurnFinished { rounds } => {
                println!("  [event] turn finished after {rounds} tool round(s)")
            }
            _ => {}
        }
    }
}

/// Prints each reply and counts them.
#[derive(Debug)]
struct PrintReplies(tokio::sync::mpsc::UnboundedSender<()>);

#[async_trait]
impl Outbound for PrintReplies {
    async fn send(&self, reply: Reply) -> Result<(), OutboundError> {
        println!(
            "analyst -> user (answers {} message(s)): {}",
            reply.in_reply_to.len(),
            reply.content
        );
        self.0
            .send(())
            .map_err(|e| OutboundError::Failed(e.to_string()))
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let config = OrgConfig::from_toml_str("[[agents]]\nid = \"analyst\"\nname = \"Analyst\"\n")?;
    let (done_tx, mut done) = tokio::sync::mpsc::unbounded_channel();
    let research = Arc::new(Research::default());
    let org = Organization::builder(config)
        .stores(Stores::memory())
        .llm(Arc::new(FnLlm::new(model)))
        .spawner(Arc::new(TokioSpawner::current()))
        .clock(Arc::new(TokioClock))
        .events(Arc::new(PrintEvents))
        .outbound(Arc::new(PrintReplies(done_tx)))
        .tool(research.clone())
        .build()
        .await?;
    let _ = research.gateway.set(org.clone());
    org.start_all().await?;

    println!("user: Write a long report on the history of spaceflight.");
    org.deliver(
        "analyst",
        InboundMessage::new(
            "portal",
            "user-1",
            "Write a long report on the history of spaceflight.",
        ),
    )
    .await?;
    for _ in 0..2 {
        tokio::time::timeout(Duration::from_secs(30), done.recv())
            .await
            .map_err(|_| "no reply within 30 s")?;
    }
    org.shutdown().await?;
    Ok(())
}
