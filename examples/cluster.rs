//! One process of an organization spread over several processes that share a PostgreSQL schema.
//!
//! ```text
//! eval "$(.ci/postgres start)"            # or export DATABASE_URL=postgres://...
//! cargo run --features postgres --example cluster -- web-1     # terminal 1
//! cargo run --features postgres --example cluster -- web-2     # terminal 2
//! cargo run --features postgres --example cluster -- web-3 4   # terminal 3 (capacity 4)
//! ```
//!
//! Each process takes a share of the 12 agents (`chief-i` delegating to `lead-i`, `i` in 0..6)
//! under a 6 s lease, prints which agents it hosts whenever that changes, and every 3 s delivers a
//! question to one chief, wherever it is hosted (stored in the schema and hinted with `NOTIFY`).
//! Answers are printed by the process that hosts the chief. Stop one process with Ctrl-C (its
//! leases are released: the others take its agents at their next round) or kill it with
//! `kill -9` (the others take them once its leases run out, 6 s): the agents move, and no question
//! is lost. The schema is `spacebot_cluster_example` (arguments: process id, capacity).
#![allow(clippy::print_stdout)]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use spacebot::llm::{ChatMessage, ChatRequest, ChatResponse, ToolCall};
use spacebot::placement::{PlacementOptions, ProcessId};
use spacebot::postgres::PgOptions;
use spacebot::{EnvelopeKind, InboundMessage, LlmError, LlmProvider, OrgConfig, Organization};

const CHAINS: usize = 6;

/// A model that needs no network: a chief delegates the question to its lead, the lead answers,
/// the chief relays the answer.
#[derive(Debug)]
struct LocalModel;

#[async_trait]
impl LlmProvider for LocalModel {
    async fn complete(&self, request: ChatRequest) -> Result<ChatResponse, LlmError> {
        let me = request
            .agent
            .as_ref()
            .map_or("", |a| a.as_str())
            .to_string();
        let after_tool = matches!(request.messages.last(), Some(ChatMessage::Tool { .. }));
        if let Some(n) = me.strip_prefix("chief-") {
            if request.envelope_kind == Some(EnvelopeKind::UserMessage) && !after_tool {
                let args = serde_json::json!({"target": format!("lead-{n}"), "message": "What time is it?"});
                return Ok(ChatResponse::tool_calls(vec![ToolCall {
                    id: format!("call-{me}"),
                    name: "send_agent_message".into(),
                    arguments: args.to_string(),
                }]));
            }
            if after_tool {
                return Ok(ChatResponse::text("Asked my lead."));
            }
            return Ok(ChatResponse::text(format!("{me}: my lead answered.")));
        }
        Ok(ChatResponse::text(format!("{me}: it is time.")))
    }
}

fn config() -> Result<OrgConfig, spacebot::config::ConfigError> {
    let mut toml = String::new();
    for i in 0..CHAINS {
        toml.push_str(&format!(
            "[[agents]]\nid = \"chief-{i}\"\n\n[[agents]]\nid = \"lead-{i}\"\n\n\
             [[links]]\nfrom = \"chief-{i}\"\nto = \"lead-{i}\"\nrelationship = \"superior\"\n\n"
        ));
    }
    OrgConfig::from_toml_str(&toml)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL (see the README)")?;
    let mut args = std::env::args().skip(1);
    let process = ProcessId::new(args.next().unwrap_or_else(|| "web-1".into()))?;
    let capacity: usize = match args.next() {
        Some(n) => n.parse()?,
        None => usize::MAX,
    };
    let pg = PgOptions::new()
        .schema("spacebot_cluster_example")
        .connect(&url)
        .await?;
    let options = PlacementOptions::new(process.clone())
        .with_capacity(capacity)
        .with_acquire_per_round(2)
        .with_lease(
            Duration::from_secs(6),
            Duration::from_secs(1),
            Duration::from_secs(2),
        )
        .with_check_interval(Duration::from_secs(1));
    let org = Organization::builder(config()?)
        .stores(pg.stores())
        .llm(Arc::new(LocalModel))
        .placement(Arc::new(pg.placement()), options)
        .build()
        .await?;
    let mut replies = org.take_replies().ok_or("replies already taken")?;
    org.start_all().await?;
    println!("{process}: started (Ctrl-C stops it cleanly)");
    tokio::spawn(async move {
        while let Some(reply) = replies.next().await {
            println!("  reply from {}: {}", reply.agent, reply.content);
        }
    });

    let mut hosted = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut n: u64 = 0;
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = tick.tick() => {}
        }
        let now = org.hosted_agents();
        if now != hosted {
            let names: Vec<&str> = now.iter().map(|a| a.as_str()).collect();
            println!("{process} hosts {} agents: {}", now.len(), names.join(" "));
            hosted = now;
        }
        n += 1;
        if n.is_multiple_of(3) {
            let chief = format!("chief-{}", (n / 3) % CHAINS as u64);
            let question = format!("question {n} from {process}");
            match org
                .deliver(
                    &chief,
                    InboundMessage::new("terminal", process.as_str(), question),
                )
                .await
            {
                Ok(_) => println!("{process} asked {chief} (question {n})"),
                Err(e) => println!("{process} could not ask {chief}: {e}"),
            }
        }
    }
    org.shutdown().await?;
    println!("{process}: stopped; its agents are released");
    Ok(())
}
