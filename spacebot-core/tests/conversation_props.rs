//! Property tests with adversarial models (seed 001's failure list): models that always reply,
//! never conclude, answer every linked output, try to reopen, try to reset the budget, or pass
//! work along a chain. Whatever they do, every conversation ends within its budget, no budget is
//! ever raised, results reach the `initiated_from` channel and no other, and nothing of a
//! conversation leaks to the outbound.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use proptest::prelude::*;
use serde_json::json;
use spacebot_core::conversation::{ConversationFilter, ConversationMode, ConversationStatus};
use spacebot_core::event::EventKind;
use spacebot_core::testing::{FnLlm, OrgHarness as Harness, agent as id, chat, orgs, tool_call};
use spacebot_core::tools::{Tool, ToolContext, ToolError, ToolOutput};
use spacebot_core::{
    ChannelStore, ChatMessage, ChatRequest, ChatResponse, RecordKind, ToolDefinition,
};

const ORG: &str = r#"
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
direction = "two_way"
relationship = "peer"

[[links]]
from = "a"
to = "c"
direction = "one_way"
relationship = "superior"

[[links]]
from = "b"
to = "c"
direction = "two_way"
relationship = "peer"
"#;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Adversary {
    /// Answers every message with text, never concludes.
    AlwaysReply,
    /// Answers every linked output with another send to the same peer, then with text.
    AnswerEveryOutput,
    /// Concludes at once; reopens the conversation whenever its result arrives.
    TryReopen,
    /// Tries to raise the budget (and revive ended conversations) through the store, then replies.
    ResetBudget,
    /// Replies until the history is long, then concludes.
    ConcludeLate(usize),
    /// Passes every message from Alpha on to Gamma, then replies.
    MultiHop,
}

fn adversary() -> impl Strategy<Value = Adversary> {
    prop_oneof![
        Just(Adversary::AlwaysReply),
        Just(Adversary::AnswerEveryOutput),
        Just(Adversary::TryReopen),
        Just(Adversary::ResetBudget),
        (3usize..12).prop_map(Adversary::ConcludeLate),
        Just(Adversary::MultiHop),
    ]
}

/// Tries to raise the budget of every conversation of the caller and to revive it. A tool's own
/// capability cannot write stores, so this adversary is handed the stores directly: the worst a
/// buggy or hostile tool could do.
#[derive(Debug)]
struct ResetBudget {
    attempts: AtomicUsize,
    successes: AtomicUsize,
    stores: spacebot_core::Stores,
}

#[async_trait]
impl Tool for ResetBudget {
    fn definition(&self) -> ToolDefinition {
        ToolDefinition {
            name: "reset_budget".into(),
            description: "Gives every conversation more turns.".into(),
            parameters: json!({"type": "object"}),
        }
    }
    async fn call(
        &self,
        ctx: &ToolContext,
        _args: serde_json::Value,
    ) -> Result<ToolOutput, ToolError> {
        let filter = ConversationFilter {
            member: Some(ctx.agent.clone()),
            statuses: vec![],
        };
        let all = self
            .stores
            .conversations
            .list(&filter)
            .await
            .unwrap_or_default();
        for c in all {
            let mut next = c.clone();
            next.budget_remaining = c.budget_remaining.saturating_add(10);
            next.status = ConversationStatus::Open;
            self.attempts.fetch_add(1, Ordering::Relaxed);
            if self
                .stores
                .conversations
                .update(&next, c.revision)
                .await
                .is_ok()
            {
                self.successes.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(ToolOutput::text("tried"))
    }
}

fn last_user(req: &ChatRequest) -> String {
    req.messages
        .iter()
        .rev()
        .find_map(|m| match m {
            ChatMessage::User { content } => Some(content.to_string()),
            _ => None,
        })
        .unwrap_or_default()
}

/// The peer named by the link context of the system prompt, if the turn runs in a link channel.
fn link_peer(req: &ChatRequest) -> Option<String> {
    let ChatMessage::System { content } = req.messages.first()? else {
        return None;
    };
    let start = content.find("internal channel with **")? + "internal channel with **".len();
    let len = content[start..].find("**")?;
    Some(content[start..start + len].to_string())
}

fn call(name: &str, args: serde_json::Value) -> ChatResponse {
    ChatResponse::tool_calls(vec![tool_call(name, args)])
}

fn answer(me: &str, behaviour: Adversary, group: bool, req: &ChatRequest) -> ChatResponse {
    // One tool round per turn: a model that calls a tool after every steer keeps its turn going
    // forever (the interrupted messages are drained again at each checkpoint), which is the
    // runtime's concern, not the conversations'.
    if spacebot_core::testing::tool_round(&req.messages) {
        return ChatResponse::text(format!("more from {me}"));
    }
    let text = last_user(req);
    if text == "start" {
        return if group {
            call(
                "open_group",
                json!({"members": ["b", "c"], "message": "go"}),
            )
        } else {
            call("send_link_message", json!({"target": "b", "message": "go"}))
        };
    }
    if let Some(rest) = text.strip_prefix("The conversation with ") {
        // A result came back to this origin channel.
        let names = rest.split(" concluded").next().unwrap_or_default();
        return match behaviour {
            Adversary::TryReopen if names.contains(", ") => {
                let members: Vec<&str> = names.split(", ").collect();
                call(
                    "open_group",
                    json!({"members": members, "message": "again"}),
                )
            }
            Adversary::TryReopen => call(
                "send_link_message",
                json!({"target": names, "message": "again"}),
            ),
            _ => ChatResponse::text(format!("thanks from {me}")),
        };
    }
    let peer = link_peer(req);
    let end = || match &peer {
        Some(_) => call(
            "conclude_link",
            json!({"summary": format!("result from {me}")}),
        ),
        None => call("close_link", json!({"message": format!("final from {me}")})),
    };
    match behaviour {
        Adversary::AlwaysReply => ChatResponse::text(format!("reply from {me}")),
        Adversary::AnswerEveryOutput => match &peer {
            Some(p) => call(
                "send_link_message",
                json!({"target": p, "message": "and also"}),
            ),
            None => ChatResponse::text(format!("reply from {me}")),
        },
        Adversary::TryReopen => end(),
        Adversary::ResetBudget => call("reset_budget", json!({})),
        Adversary::ConcludeLate(n) if req.messages.len() > n => end(),
        Adversary::ConcludeLate(_) => ChatResponse::text(format!("reply from {me}")),
        Adversary::MultiHop if me == "b" && peer.as_deref() == Some("Alpha") => call(
            "send_link_message",
            json!({"target": "c", "message": "forwarded"}),
        ),
        Adversary::MultiHop => ChatResponse::text(format!("reply from {me}")),
    }
}

struct Outcome {
    reset: Arc<ResetBudget>,
    budget: u32,
}

async fn run_case(
    budget: u32,
    group: bool,
    behaviours: [Adversary; 3],
) -> Result<(), TestCaseError> {
    let chosen: HashMap<String, Adversary> = ["a", "b", "c"]
        .iter()
        .zip(behaviours)
        .map(|(a, b)| (a.to_string(), b))
        .collect();
    let llm = FnLlm::new(move |req: &ChatRequest| {
        let me = req
            .agent
            .as_ref()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let behaviour = chosen.get(&me).copied().unwrap_or(Adversary::AlwaysReply);
        Ok(answer(&me, behaviour, group, req))
    });
    let stores = spacebot_core::Stores::memory();
    let reset = Arc::new(ResetBudget {
        attempts: AtomicUsize::new(0),
        successes: AtomicUsize::new(0),
        stores: stores.clone(),
    });
    let settings = format!("conversation_turn_budget = {budget}");
    let mut h = Harness::builder(orgs::with_settings(&settings, ORG))
        .stores(stores)
        .llm(Arc::new(llm))
        .manual_clock(spacebot_core::ManualClock::new(1_000))
        .tool(reset.clone())
        .build()
        .await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", chat("a", "start")).await.unwrap();
    h.wait_quiet().await;
    check(&mut h, Outcome { reset, budget }).await
}

async fn check(h: &mut Harness, outcome: Outcome) -> Result<(), TestCaseError> {
    let all = h.all_conversations().await;
    prop_assert!(!all.is_empty());
    // Every conversation ended, within its budget; none was raised.
    for c in &all {
        prop_assert_ne!(c.status, ConversationStatus::Open, "still open: {:#?}", c);
        prop_assert!(c.budget_remaining <= outcome.budget);
    }
    prop_assert_eq!(
        outcome.reset.successes.load(Ordering::Relaxed),
        0,
        "a budget was raised or a conversation revived"
    );
    // Messages that crossed, per pair (mirrored) or per group.
    let mut crossed: HashMap<String, usize> = HashMap::new();
    for event in h.events.events() {
        if let (EventKind::MessageReceived { from }, Some(channel)) = (&event.kind, &event.channel)
        {
            let key = match channel.as_link() {
                Some((owner, peer)) => spacebot_core::dialogue::mirrored_key(&owner, &peer),
                None => format!("{channel}/{from}"),
            };
            *crossed.entry(key).or_default() += 1;
        }
    }
    for c in &all {
        let limit = outcome.budget as usize;
        match c.mode {
            ConversationMode::Mirrored => {
                let key = c.pair_key.clone().unwrap_or_default();
                let same_key = all.iter().filter(|o| o.pair_key == c.pair_key).count();
                let n = crossed.get(&key).copied().unwrap_or(0);
                prop_assert!(
                    n <= limit * same_key,
                    "{} messages crossed {} (budget {})",
                    n,
                    key,
                    limit
                );
            }
            ConversationMode::Group => {
                // Each turn reaches every other member once: per sender, at most the budget.
                let channel = spacebot_core::dialogue::group_channel(&c.id);
                let turns: usize = crossed
                    .iter()
                    .filter(|(k, _)| k.starts_with(channel.as_str()))
                    .map(|(_, n)| *n)
                    .sum();
                prop_assert!(
                    turns <= limit * (c.members.len() - 1),
                    "{} deliveries in group",
                    turns
                );
            }
        }
    }
    // Results reach initiated_from and no other channel, once per conclusion (the conclusion is
    // marked before its result is sent: one that lost the race with the end of the budget tells
    // nothing).
    let mut expected: HashMap<(String, String), usize> = HashMap::new();
    for c in &all {
        let conclusions = h.count(|k| matches!(k, EventKind::ConversationConcluded { conversation } if conversation == &c.id));
        if let Some(origin) = &c.initiated_from {
            *expected
                .entry((c.initiator.to_string(), origin.to_string()))
                .or_default() += conclusions;
        }
    }
    for agent in ["a", "b", "c"] {
        for channel in h.stores.channels.channels(&id(agent)).await.unwrap() {
            let results = h
                .history(agent, &channel)
                .await
                .into_iter()
                .filter(|r| {
                    r.record.kind == RecordKind::System
                        && r.record.content.starts_with("The conversation with")
                        && r.record.content.contains(" concluded (")
                })
                .count();
            let want = expected
                .get(&(agent.to_string(), channel.to_string()))
                .copied()
                .unwrap_or(0);
            prop_assert_eq!(results, want, "results in {}/{}", agent, channel);
        }
    }
    // Nothing of a conversation reached the outbound.
    while let Ok(reply) = h.replies.try_recv() {
        prop_assert!(
            reply.channel.as_str().starts_with("portal:"),
            "leaked: {:?}",
            reply
        );
    }
    h.org.shutdown().await.unwrap();
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, max_shrink_iters: 16, ..ProptestConfig::default() })]

    #[test]
    fn adversarial_conversations_always_end_within_budget(
        budget in 1u32..7,
        group in any::<bool>(),
        a in adversary(),
        b in adversary(),
        c in adversary(),
    ) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(run_case(budget, group, [a, b, c]))?;
    }
}
