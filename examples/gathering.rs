//! Three members in a group conversation (seed 002), offline: a scripted mock model, memory stores.
//!
//! The host opens a group with two members. Each member's output reaches every other member; the
//! members stay silent when they have nothing to add. Once both have spoken, the host closes the
//! group with a final message, which wakes it in the chat it started from. Every channel's history
//! is printed.
//!
//! Run with `cargo run --example gathering`.

use std::sync::Arc;

use futures::StreamExt;
use serde_json::json;
use spacebot_core::conversation::ConversationFilter;
use spacebot_core::rt::{TokioClock, TokioSpawner};
use spacebot_core::testing::ScriptedLlm;
use spacebot_core::{
    AgentId, ChannelId, ChannelStore, ChatResponse, InboundMessage, OrgConfig, Organization, Stores,
};

const CONFIG: &str = r#"
[[agents]]
id = "host"
name = "Host"

[[agents]]
id = "alice"
name = "Alice"

[[agents]]
id = "bob"
name = "Bob"

[[links]]
from = "host"
to = "alice"
relationship = "superior"

[[links]]
from = "host"
to = "bob"
relationship = "superior"
"#;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let host = AgentId::parse("host")?;
    let alice = AgentId::parse("alice")?;
    let bob = AgentId::parse("bob")?;

    // Scripts per agent; once spent, an agent stays silent (silence is valid and costs nothing).
    let llm = ScriptedLlm::new().with_fallback(|_| Ok(ChatResponse::text("")));
    llm.push_tool_call(
        &host,
        "open_group",
        json!({
            "members": ["alice", "bob"],
            "message": "Name the biggest risk of Friday's launch."
        }),
    );
    llm.push_text(&host, "Gathering started with Alice and Bob.");
    llm.push_text(&alice, "The schema migration may lock the orders table.");
    llm.push_text(&bob, "The public docs still describe the old API.");
    // The host hears the first member (and stays silent), then the second, and closes.
    llm.push_text(&host, "");
    llm.push_tool_call(
        &host,
        "close_link",
        json!({
            "message": "Two risks: the migration lock (Alice) and stale docs (Bob). Thanks, both."
        }),
    );
    llm.push_text(
        &host,
        "Launch risks: the migration lock and stale docs; both have owners.",
    );

    let stores = Stores::memory();
    let org = Organization::builder(OrgConfig::from_toml_str(CONFIG)?)
        .stores(stores.clone())
        .llm(Arc::new(llm))
        .spawner(Arc::new(TokioSpawner::current()))
        .clock(Arc::new(TokioClock))
        .build()
        .await?;
    let mut replies = org.take_replies().ok_or("replies taken")?;
    org.start_all().await?;

    let chat = InboundMessage::new("portal", "chat:host", "What could go wrong on Friday?")
        .with_channel(ChannelId::portal(&host));
    org.deliver("host", chat).await?;
    for _ in 0..2 {
        if let Some(reply) = replies.next().await {
            println!("reply to the user on {}: {}", reply.channel, reply.content);
        }
    }
    org.shutdown().await?;

    for conversation in org.conversations(&ConversationFilter::default()).await? {
        let members: Vec<String> = conversation
            .members
            .iter()
            .map(|m| format!("{} #{} ({})", m.name, m.number, m.role))
            .collect();
        println!(
            "\nconversation {} ({}), {}; members: {}; {} turns left; final message: {:?}",
            conversation.id,
            conversation.mode,
            conversation.status,
            members.join(", "),
            conversation.budget_remaining,
            conversation.summary,
        );
    }
    for agent in [&host, &alice, &bob] {
        for channel in stores.channels.channels(agent).await? {
            println!("\n== {agent} / {channel}");
            for record in stores.channels.history(agent, &channel, None).await? {
                let text = record.record.content.lines().next().unwrap_or_default();
                println!(
                    "  [{}] {}: {}",
                    record.record.kind, record.record.author, text
                );
            }
        }
    }
    Ok(())
}
