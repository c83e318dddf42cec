//! Implementing `LlmProvider` for another model, and running the delegation organization on it.
//!
//! The "model" here is a small local, deterministic one (so the example runs offline): it knows
//! whom each agent delegates to, picks a word from a list by hashing its task, and relays results.
//! A provider for a remote API has the same shape: map `ChatRequest` to the API's request, call it,
//! map the answer (text or tool calls) back to `ChatResponse`, and report failures as `LlmError`.
//!
//! ```text
//! cargo run --example custom_provider
//! ```

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use spacebot_core::config::OrgConfig;
use spacebot_core::llm::{ChatMessage, ChatRequest, ChatResponse, LlmProvider, ToolCall};
use spacebot_core::rt::{TokioClock, TokioSpawner};
use spacebot_core::{InboundMessage, LlmError, Organization, Stores};

/// The provider: a routing table (who delegates to whom) and a vocabulary.
#[derive(Debug)]
struct LocalModel {
    delegates_to: HashMap<&'static str, &'static str>,
    words: Vec<&'static str>,
}

#[async_trait]
impl LlmProvider for LocalModel {
    async fn complete(&self, request: ChatRequest) -> Result<ChatResponse, LlmError> {
        let agent = request.agent.as_ref().ok_or(LlmError::Other("no agent".into()))?;
        let input = match request.messages.last() {
            Some(ChatMessage::User { content }) => content.clone(),
            // After a tool result the turn has ended already (delegation ends it); nothing to add.
            _ => return Ok(ChatResponse::text("Done.")),
        };
        // A result came back (a retrigger, or a resumed task with its children's results): relay it.
        if let Some((_, result)) = input.rsplit_once("): ").or_else(|| input.rsplit_once(": ")) {
            if input.contains("completed task") || input.contains("have ended") {
                let word = result.lines().next().unwrap_or(result).trim();
                return Ok(ChatResponse::text(format!("The word is: {word}")));
            }
        }
        // A fresh request: delegate if this agent has someone to delegate to, else do the work.
        if let Some(target) = self.delegates_to.get(agent.as_str()) {
            let args = serde_json::json!({"target": target, "message": "Pick a random word."});
            return Ok(ChatResponse::tool_calls(vec![ToolCall {
                id: format!("call-{agent}"),
                name: "send_agent_message".into(),
                arguments: args.to_string(),
            }]));
        }
        let mut hasher = DefaultHasher::new();
        input.hash(&mut hasher);
        let word = self.words[(hasher.finish() % self.words.len() as u64) as usize];
        Ok(ChatResponse::text(word))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let model = LocalModel {
        delegates_to: HashMap::from([
            ("chief-ai-officer", "spacebot-tech-lead"),
            ("spacebot-tech-lead", "community-manager"),
        ]),
        words: vec!["nebula", "quasar", "comet", "aurora", "pulsar"],
    };
    let config = OrgConfig::load(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/org.toml"))?;
    let org = Organization::builder(config)
        .stores(Stores::memory())
        .llm(Arc::new(model))
        .spawner(Arc::new(TokioSpawner::current()))
        .clock(Arc::new(TokioClock))
        .build()
        .await?;
    let mut replies = org.take_replies().ok_or("replies taken")?;
    org.start_all().await?;
    let request = "Ask the community manager to pick a random word for me.";
    println!("user -> chief-ai-officer: {request}");
    org.deliver("chief-ai-officer", InboundMessage::new("portal", "user-1", request))
        .await?;
    let reply = tokio::time::timeout(Duration::from_secs(30), replies.next())
        .await?
        .ok_or("no reply")?;
    println!("chief-ai-officer -> user: {}", reply.content);
    org.shutdown().await?;
    Ok(())
}
