//! Group conversations (seed 002): fan-out to every other live member, what never crosses, the
//! rules given once, closing, severing, session ends and failed deliveries.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use super::support::{conversation::*, *};
use async_trait::async_trait;
use serde_json::json;
use spacebot::conversation::{Conversation, ConversationMode, ConversationStatus, MemberRole};
use spacebot::dialogue::group_channel;
use spacebot::event::EventKind;
use spacebot::testing::ScriptedLlm;
use spacebot::tools::{Tool, ToolContext, ToolError, ToolOutput};
use spacebot::{ChatResponse, RecordKind, Stores, ToolDefinition};

fn silent_after_script() -> ScriptedLlm {
    ScriptedLlm::new().with_fallback(|_| Ok(ChatResponse::text("")))
}

/// A tool whose output must never cross to other members.
#[derive(Debug)]
struct Note;

#[async_trait]
impl Tool for Note {
    fn definition(&self) -> ToolDefinition {
        ToolDefinition {
            name: "note".into(),
            description: "Takes a private note.".into(),
            parameters: json!({"type": "object"}),
        }
    }
    async fn call(
        &self,
        _ctx: &ToolContext,
        _args: serde_json::Value,
    ) -> Result<ToolOutput, ToolError> {
        Ok(ToolOutput::text("SECRET TOOL OUTPUT"))
    }
}

/// `a` opens a group with `members` from its portal channel; returns the conversation.
async fn open(h: &mut Harness, llm: &ScriptedLlm, members: &[&str], message: &str) -> Conversation {
    llm.push_tool_call(
        &id("a"),
        "open_group",
        json!({"members": members, "message": message}),
    );
    llm.push_text(&id("a"), "opened");
    let before: Vec<_> = h
        .all_conversations()
        .await
        .into_iter()
        .map(|c| c.id)
        .collect();
    h.org.deliver("a", chat("a", "gather them")).await.unwrap();
    assert_eq!(h.reply().await.content, "opened");
    h.wait_quiet().await;
    let all = h.all_conversations().await;
    if let Some(new) = all.iter().find(|c| !before.contains(&c.id)) {
        return new.clone();
    }
    all.into_iter()
        .find(|c| c.status == ConversationStatus::Open)
        .expect("a new or an open conversation")
}

/// Starts only `a`: members that answer at once could otherwise steer the turn that opens the
/// group (their answer arriving at its checkpoint), and the opening would not be answered as
/// scripted.
async fn start_initiator_only(h: &Harness) {
    h.org.ensure_link_channels().await.unwrap();
    h.org.start_agent(&id("a")).await.unwrap();
}

/// Starts `members`, which get the opening then, and waits until everything it caused is done.
async fn start_members(h: &Harness, members: &[&str]) {
    for member in members {
        h.org.start_agent(&id(member)).await.unwrap();
    }
    h.wait_quiet().await;
}

fn conv_lines(lines: &[(RecordKind, String)]) -> Vec<(RecordKind, String)> {
    lines
        .iter()
        .filter(|(k, t)| !(*k == RecordKind::System && t.contains("Rules for this conversation")))
        .cloned()
        .collect()
}

pub async fn a_members_output_reaches_every_other_member(stores: Stores) {
    let llm = silent_after_script();
    llm.push_text(&id("b"), "ship on friday");
    let mut h = harness(stores, Arc::new(llm.clone())).await;
    start_initiator_only(&h).await;
    let conv = open(&mut h, &llm, &["b", "Gamma"], "plan the release").await;
    start_members(&h, &["b", "c"]).await;
    let ch = group_channel(&conv.id);
    assert_eq!(conv.mode, ConversationMode::Group);
    assert_eq!(conv.members.len(), 3);
    assert_eq!(conv.members[0].role, MemberRole::Initiator);
    assert_eq!(conv.members[1].role, MemberRole::Member);
    assert_eq!(conv.initiated_from, Some(portal("a")));

    let a_lines = conv_lines(&h.lines("a", &ch).await);
    assert_eq!(a_lines[0], (RecordKind::Sent, "plan the release".into()));
    assert!(
        a_lines.contains(&(RecordKind::User, "[Beta] ship on friday".into())),
        "{a_lines:?}"
    );
    let c_lines = conv_lines(&h.lines("c", &ch).await);
    assert!(
        c_lines.contains(&(RecordKind::User, "[Alpha] plan the release".into())),
        "{c_lines:?}"
    );
    assert!(
        c_lines.contains(&(RecordKind::User, "[Beta] ship on friday".into())),
        "{c_lines:?}"
    );
    let b_lines = conv_lines(&h.lines("b", &ch).await);
    assert!(
        !b_lines
            .iter()
            .any(|(k, t)| *k == RecordKind::User && t.contains("ship on friday")),
        "the speaker does not get its own output"
    );
    let now = h.org.conversation(&conv.id).await.unwrap().unwrap();
    assert_eq!(
        now.budget_remaining,
        20 - 2,
        "the opening and b's output; silence is free"
    );
    assert!(h.replies.try_recv().is_err());
}

pub async fn checkpoint_content_tool_chatter_and_empty_output_never_cross(stores: Stores) {
    let llm = silent_after_script();
    let b = id("b");
    llm.push_tool_call(&b, "note", json!({}));
    llm.push(
        &b,
        ChatResponse::text(
            "[checkpoint] still reading the logs\n<checkpoint>draft: maybe</checkpoint>\n",
        ),
    );
    let mut h = Setup::new(ABCD, stores)
        .tool(Arc::new(Note))
        .build(Arc::new(llm.clone()))
        .await;
    h.org.start_all().await.unwrap();
    let conv = open(&mut h, &llm, &["b", "c"], "thoughts?").await;
    let ch = group_channel(&conv.id);
    for agent in ["a", "c"] {
        for (_, text) in h.lines(agent, &ch).await {
            assert!(!text.contains("SECRET"), "tool chatter crossed to {agent}");
            assert!(
                !text.contains("reading the logs") && !text.contains("draft"),
                "checkpoint crossed to {agent}"
            );
        }
    }
    let now = h.org.conversation(&conv.id).await.unwrap().unwrap();
    assert_eq!(now.budget_remaining, 20 - 1, "only the opening cost a turn");
    assert_eq!(
        h.count(|k| matches!(k, EventKind::MessageReceived { .. })),
        2
    );
}

pub async fn the_rules_reach_every_member_exactly_once_at_creation(stores: Stores) {
    let llm = silent_after_script();
    let mut h = harness(stores, Arc::new(llm.clone())).await;
    h.org.start_all().await.unwrap();
    let conv = open(&mut h, &llm, &["b", "c"], "hello").await;
    // Closed, then opened again with the same members: the same conversation, no second copy.
    llm.push_tool_call(
        &id("a"),
        "close_link",
        json!({"message": "done", "target": conv.id.as_str()}),
    );
    h.org.deliver("a", chat("a", "close it")).await.unwrap();
    // The close retriggers the portal, where a answers (silently).
    assert_eq!(h.reply().await.content, "");
    h.wait_quiet().await;
    let again = open(&mut h, &llm, &["c", "b"], "one more thing").await;
    assert_eq!(again.id, conv.id);
    assert_eq!(again.status, ConversationStatus::Open);
    let ch = group_channel(&conv.id);
    for agent in ["a", "b", "c"] {
        let rules: Vec<String> = h
            .lines(agent, &ch)
            .await
            .into_iter()
            .filter(|(k, t)| *k == RecordKind::System && t.contains("Rules for this conversation"))
            .map(|(_, t)| t)
            .collect();
        assert_eq!(rules.len(), 1, "{agent}: {rules:?}");
        assert_eq!(
            rules[0].contains("You started this conversation"),
            agent == "a"
        );
        assert!(rules[0].contains("Silence is valid"));
    }
}

pub async fn only_the_initiator_closes_and_a_non_matching_close_closes_nothing(stores: Stores) {
    let llm = silent_after_script();
    let (a, c) = (id("a"), id("c"));
    let mut h = harness(stores, Arc::new(llm.clone())).await;
    h.org.start_all().await.unwrap();
    let group = open(&mut h, &llm, &["b", "c"], "hello").await;
    // A mirrored conversation with d besides.
    llm.push_tool_call(
        &a,
        "send_link_message",
        json!({"target": "d", "message": "hi d"}),
    );
    llm.push_text(&a, "sent");
    h.org.deliver("a", chat("a", "talk to d")).await.unwrap();
    h.reply().await;
    h.wait_quiet().await;

    // c is not the initiator (b, who may start nothing, is not even offered close_link).
    llm.push_tool_call(
        &c,
        "close_link",
        json!({"message": "bye", "target": group.id.as_str()}),
    );
    llm.push_text(&c, "tried");
    h.org
        .deliver("c", chat("c", "close the group"))
        .await
        .unwrap();
    h.reply().await;
    let results = tool_results(llm.requests_for(&c).last().unwrap());
    assert!(
        results[0].contains("only its initiator (Alpha)"),
        "{results:?}"
    );

    // a aims at an agent it has no conversation with.
    llm.push_tool_call(
        &a,
        "close_link",
        json!({"message": "bye", "target": "nobody"}),
    );
    llm.push_text(&a, "tried");
    h.org.deliver("a", chat("a", "close")).await.unwrap();
    h.reply().await;
    let results = tool_results(llm.requests_for(&a).last().unwrap());
    assert!(results[0].contains("nothing was changed"), "{results:?}");
    assert!(
        h.all_conversations()
            .await
            .iter()
            .all(|c| c.status == ConversationStatus::Open)
    );

    // a aims at d: the conversation with d closes, the group stays open.
    llm.push_tool_call(
        &a,
        "close_link",
        json!({"message": "thanks d", "target": "d"}),
    );
    llm.push_text(&a, "");
    h.org.deliver("a", chat("a", "close d")).await.unwrap();
    h.wait_quiet().await;
    for c in h.all_conversations().await {
        let expected = if c.id == group.id {
            ConversationStatus::Open
        } else {
            ConversationStatus::Concluded
        };
        assert_eq!(c.status, expected, "{c:#?}");
    }
}

pub async fn the_initiators_close_delivers_the_final_message_and_wakes_its_origin(stores: Stores) {
    let llm = silent_after_script();
    let a = id("a");
    llm.push_text(&id("b"), "friday works");
    let mut h = harness(stores, Arc::new(llm.clone())).await;
    // Only a runs while it opens the group, so b's answer cannot steer the opening turn; b and c
    // get the opening when they start.
    h.org.ensure_link_channels().await.unwrap();
    h.org.start_agent(&a).await.unwrap();
    // a's turn in the group (woken by b's output) closes it; then the retrigger wakes the portal.
    llm.push_tool_call(
        &a,
        "open_group",
        json!({"members": ["b", "c"], "message": "when?"}),
    );
    llm.push_text(&a, "opened");
    llm.push_tool_call(&a, "close_link", json!({"message": "decision: friday"}));
    llm.push_text(&a, "The team settled on friday.");
    h.org.deliver("a", chat("a", "gather them")).await.unwrap();
    assert_eq!(h.reply().await.content, "opened");
    h.org.start_agent(&id("b")).await.unwrap();
    h.org.start_agent(&id("c")).await.unwrap();
    let result = h.reply().await;
    assert_eq!(result.channel, portal("a"));
    assert_eq!(result.content, "The team settled on friday.");
    h.wait_quiet().await;
    let conv = h.only_conversation().await;
    assert_eq!(conv.status, ConversationStatus::Concluded);
    assert_eq!(conv.summary.as_deref(), Some("decision: friday"));
    let ch = group_channel(&conv.id);
    for agent in ["b", "c"] {
        assert!(
            h.lines(agent, &ch).await.contains(&(
                RecordKind::User,
                "[conclusion from Alpha] decision: friday".into()
            )),
            "{agent} got the final message"
        );
    }
    assert_eq!(
        h.count(|k| matches!(k, EventKind::ConversationConcluded { .. })),
        1
    );
}

pub async fn any_member_may_sever_and_the_link_and_all_memberships_go_at_once(stores: Stores) {
    let llm = silent_after_script();
    let c = id("c");
    llm.push_tool_call(&c, "sever_link", json!({}));
    let mut h = harness(stores, Arc::new(llm.clone())).await;
    start_initiator_only(&h).await;
    let conv = open(&mut h, &llm, &["b", "c"], "hello").await;
    start_members(&h, &["b", "c"]).await;
    let now = h.org.conversation(&conv.id).await.unwrap().unwrap();
    assert_eq!(now.status, ConversationStatus::Severed);
    assert!(now.members.iter().all(|m| !m.open));
    let ch = group_channel(&conv.id);
    for agent in ["a", "b", "c"] {
        assert!(
            h.lines(agent, &ch)
                .await
                .iter()
                .any(|(k, t)| *k == RecordKind::System && t.contains("severed by Gamma")),
            "{agent} was told"
        );
    }
    assert!(
        h.lines("a", &portal("a"))
            .await
            .iter()
            .any(|(_, t)| t.contains("severed by Gamma"))
    );
    assert_eq!(
        h.count(|k| matches!(k, EventKind::ConversationSevered { .. })),
        1
    );
    // A severed group is not revived: opening again makes a new one.
    let next = open(&mut h, &llm, &["b", "c"], "again").await;
    assert_ne!(next.id, conv.id);
}

pub async fn a_members_session_end_severs_the_group(stores: Stores) {
    let llm = silent_after_script();
    let mut h = harness(stores, Arc::new(llm.clone())).await;
    h.org.start_all().await.unwrap();
    let conv = open(&mut h, &llm, &["b", "c"], "hello").await;
    h.org.stop_agent(&id("b")).await.unwrap();
    let now = h.org.conversation(&conv.id).await.unwrap().unwrap();
    assert_eq!(now.status, ConversationStatus::Severed);
    assert!(h.events.kinds().iter().any(
        |k| matches!(k, EventKind::ConversationSevered { reason, .. } if reason.contains("Beta"))
    ));
}

pub async fn a_failed_delivery_to_one_member_does_not_stop_the_others(stores: Stores) {
    let mut stores = stores;
    stores.deliveries = Arc::new(FailingDeliveries {
        inner: stores.deliveries.clone(),
        broken: id("d"),
    });
    let llm = silent_after_script();
    let mut h = Setup::new(ABCD, stores).build(Arc::new(llm.clone())).await;
    h.org.ensure_link_channels().await.unwrap();
    for agent in ["a", "b", "c"] {
        h.org.start_agent(&id(agent)).await.unwrap();
    }
    // d is not running and its deliveries cannot be kept.
    let conv = open(&mut h, &llm, &["d", "b", "c"], "status, everyone").await;
    let ch = group_channel(&conv.id);
    for agent in ["b", "c"] {
        assert!(
            h.lines(agent, &ch)
                .await
                .contains(&(RecordKind::User, "[Alpha] status, everyone".into())),
            "{agent} got the message"
        );
    }
    assert!(h.events.kinds().iter().any(
        |k| matches!(k, EventKind::Error { message } if message.contains("delivery to d failed"))
    ));
    assert_eq!(
        h.org.conversation(&conv.id).await.unwrap().unwrap().status,
        ConversationStatus::Open
    );
}

pub async fn opening_a_group_that_is_already_open_continues_it_with_a_clear_answer(stores: Stores) {
    let llm = silent_after_script();
    let a = id("a");
    let mut h = harness(stores, Arc::new(llm.clone())).await;
    h.org.start_all().await.unwrap();
    let conv = open(&mut h, &llm, &["b", "c"], "first").await;
    let again = open(&mut h, &llm, &["c", "b"], "second").await;
    assert_eq!(again.id, conv.id);
    assert_eq!(h.all_conversations().await.len(), 1);
    let results = tool_results(&llm.requests_for(&a)[3]);
    assert!(results[0].contains("already linked"), "{results:?}");
    assert!(
        h.lines("b", &group_channel(&conv.id))
            .await
            .contains(&(RecordKind::User, "[Alpha] second".into()))
    );
}

pub async fn a_group_needs_a_link_the_opener_may_start_with_each_member(stores: Stores) {
    let llm = silent_after_script();
    // c may start with a (two-way peers) but has no link with b.
    let c = id("c");
    llm.push_tool_call(
        &c,
        "open_group",
        json!({"members": ["a", "b"], "message": "hi"}),
    );
    llm.push_text(&c, "tried");
    let mut h = harness(stores, Arc::new(llm.clone())).await;
    h.org.start_all().await.unwrap();
    h.org.deliver("c", chat("c", "gather")).await.unwrap();
    h.reply().await;
    let results = tool_results(&llm.requests_for(&c)[1]);
    assert!(results[0].contains("may not start"), "{results:?}");
    assert!(h.all_conversations().await.is_empty());
}
