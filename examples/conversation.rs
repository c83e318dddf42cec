//! Two agents in a mirrored conversation (seed 000), offline: a scripted mock model, memory stores.
//!
//! The lead asks the researcher something over their link; the researcher answers, the lead asks
//! a follow-up, and the researcher concludes with a summary. The conclusion wakes the lead in the
//! chat it started from, where it answers the user. Every channel's history is printed.
//!
//! Run with `cargo run --example conversation`.

use std::sync::Arc;

use futures::StreamExt;
use serde_json::json;
use spacebot_core::conversation::ConversationFilter;
use spacebot_core::rt::{TokioClock, TokioSpawner};
use spacebot_core::testing::ScriptedLlm;
use spacebot_core::{
    AgentId, ChannelStore, ChatResponse, InboundMessage, OrgConfig, Organization, Stores,
};

const CONFIG: &str = r#"
[settings]
conversation_turn_budget = 8

[[agents]]
id = "lead"
name = "Lead"

[[agents]]
id = "researcher"
name = "Researcher"

[[links]]
from = "lead"
to = "researcher"
direction = "one_way"
relationship = "superior"
"#;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let lead = AgentId::parse("lead")?;
    let researcher = AgentId::parse("researcher")?;

    // What each model will say, turn by turn; silence once a script is spent.
    let llm = ScriptedLlm::new().with_fallback(|_| Ok(ChatResponse::text("")));
    llm.push_tool_call(
        &lead,
        "send_link_message",
        json!({
            "target": "researcher",
            "message": "Which embedded store fits an append-heavy audit log?"
        }),
    );
    llm.push_text(&lead, "I asked the researcher; I'll get back to you.");
    llm.push_text(
        &researcher,
        "redb: single file, ACID, fast appends. SQLite works too.",
    );
    llm.push_text(&lead, "Which one is simpler to ship?");
    llm.push_tool_call(
        &researcher,
        "conclude_link",
        json!({
            "summary": "Use redb: pure Rust, one file, nothing to link."
        }),
    );
    llm.push_text(
        &lead,
        "The researcher recommends redb: pure Rust, one file, nothing to link.",
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

    let chat = InboundMessage::new("portal", "chat:lead", "Pick a store for the audit log.")
        .with_channel(spacebot_core::ChannelId::portal(&lead));
    org.deliver("lead", chat).await?;
    for _ in 0..2 {
        if let Some(reply) = replies.next().await {
            println!("reply to the user on {}: {}", reply.channel, reply.content);
        }
    }
    org.shutdown().await?;

    for conversation in org.conversations(&ConversationFilter::default()).await? {
        println!(
            "\nconversation {} ({}), {}; initiated from {:?}; {} turns left; summary: {:?}",
            conversation.id,
            conversation.mode,
            conversation.status,
            conversation.initiated_from.as_ref().map(|c| c.as_str()),
            conversation.budget_remaining,
            conversation.summary,
        );
    }
    for agent in [&lead, &researcher] {
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
