//! Mirrored conversations (seed 000): both link channels from the start, mirrored sends and
//! replies, conclusions that retrigger `initiated_from`, reopening without context loss, budgets,
//! severing, and the "nebula" multi-hop example.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use super::support::{conversation::*, *};
use serde_json::json;
use spacebot::conversation::{ConversationMode, ConversationStatus, MemberRole};
use spacebot::event::EventKind;
use spacebot::testing::{FnLlm, ScriptedLlm};
use spacebot::{ChannelStore, ChatMessage, ChatRequest, ChatResponse, RecordKind};

fn silent_after_script() -> ScriptedLlm {
    ScriptedLlm::new().with_fallback(|_| Ok(ChatResponse::text("")))
}

fn last_user(req: &ChatRequest) -> String {
    last_user_text(req)
}

pub async fn both_link_channels_exist_from_the_start(stores: Stores) {
    let h = harness(stores, Arc::new(silent_after_script())).await;
    h.org.start_all().await.unwrap();
    for (owner, peer) in [
        ("a", "b"),
        ("b", "a"),
        ("a", "c"),
        ("c", "a"),
        ("a", "d"),
        ("d", "a"),
    ] {
        let channels = h.stores.channels.channels(&id(owner)).await.unwrap();
        assert!(
            channels.contains(&link(owner, peer)),
            "{owner} lacks link:{owner}:{peer}: {channels:?}"
        );
    }
    let unlinked = h.stores.channels.channels(&id("b")).await.unwrap();
    assert!(
        !unlinked.contains(&link("b", "c")),
        "b and c are not linked"
    );
}

pub async fn a_send_wakes_the_peer_and_replies_mirror_back(stores: Stores) {
    let llm = silent_after_script();
    let (a, b) = (id("a"), id("b"));
    llm.push_tool_call(
        &a,
        "send_link_message",
        json!({"target": "b", "message": "hello"}),
    );
    llm.push_text(&a, "asked Beta");
    llm.push_text(&b, "hi there");
    llm.push_text(&a, "");
    // b answers once a's turn is over (an answer arriving during it would steer it).
    let held = Held::new(Arc::new(llm.clone()), "b");
    let mut h = harness(stores, held.clone()).await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", chat("a", "ask b")).await.unwrap();
    assert_eq!(h.reply().await.content, "asked Beta");
    held.open();
    h.wait_quiet().await;

    assert_eq!(
        h.lines("b", &link("b", "a")).await,
        vec![
            (
                RecordKind::System,
                h.lines("b", &link("b", "a")).await[0].1.clone()
            ),
            (RecordKind::User, "hello".into()),
            (RecordKind::Assistant, "hi there".into()),
        ]
    );
    let a_side = h.lines("a", &link("a", "b")).await;
    assert!(
        a_side[0].1.contains("Rules for this conversation"),
        "{a_side:?}"
    );
    assert_eq!(
        a_side[1..].to_vec(),
        vec![
            (RecordKind::Sent, "hello".into()),
            (RecordKind::User, "hi there".into()),
            (RecordKind::Assistant, String::new()),
        ]
    );
    // The peer's model saw the message as a user turn in its own link channel.
    let b_req = &llm.requests_for(&b)[0];
    assert_eq!(last_user(b_req), "hello");
    assert!(
        b_req
            .messages
            .iter()
            .any(|m| matches!(m, ChatMessage::System { content } if content.contains("Alpha")))
    );

    let c = h.only_conversation().await;
    assert_eq!(c.mode, ConversationMode::Mirrored);
    assert_eq!(c.status, ConversationStatus::Open);
    assert_eq!(c.initiator, a);
    assert_eq!(c.initiated_from, Some(portal("a")));
    assert_eq!(c.member(&b).unwrap().role, MemberRole::Responder);
    // Two messages crossed (the send and b's reply); a's silence cost nothing.
    assert_eq!(c.budget_remaining, 20 - 2);
    assert!(
        h.replies.try_recv().is_err(),
        "nothing of the conversation reached the outbound"
    );
    assert_eq!(
        h.count(|k| matches!(k, EventKind::ConversationOpened { .. })),
        1
    );
}

pub async fn on_a_one_way_link_only_from_opens_and_the_other_side_may_answer(stores: Stores) {
    let llm = silent_after_script();
    let (a, b) = (id("a"), id("b"));
    llm.push_tool_call(
        &b,
        "send_link_message",
        json!({"target": "a", "message": "may I?"}),
    );
    llm.push_text(&b, "tried");
    let held = Held::new(Arc::new(llm.clone()), "b");
    held.open();
    let mut h = harness(stores, held.clone()).await;
    h.org.start_all().await.unwrap();
    h.org.deliver("b", chat("b", "talk to a")).await.unwrap();
    assert_eq!(h.reply().await.content, "tried");
    let results = tool_results(&llm.requests_for(&b)[1]);
    assert!(results[0].contains("may not start"), "{results:?}");
    assert!(
        h.all_conversations().await.is_empty(),
        "a refused open creates nothing"
    );

    // Once a opened it, b may continue it with the tool.
    llm.push_tool_call(
        &a,
        "send_link_message",
        json!({"target": "Beta", "message": "report"}),
    );
    llm.push_text(&a, "asked");
    llm.push_tool_call(
        &b,
        "send_link_message",
        json!({"target": "a", "message": "all good"}),
    );
    llm.push_text(&b, "");
    // b answers once a's turn is over (an answer arriving during it would steer it).
    held.close();
    h.org.deliver("a", chat("a", "get a report")).await.unwrap();
    assert_eq!(h.reply().await.content, "asked");
    held.open();
    h.wait_quiet().await;
    let results = tool_results(llm.requests_for(&b).last().unwrap());
    assert!(results[0].contains("continues it"), "{results:?}");
    let c = h.only_conversation().await;
    assert_eq!(c.initiator, a);
    assert!(
        h.lines("a", &link("a", "b"))
            .await
            .contains(&(RecordKind::User, "all good".into()))
    );
}

pub async fn unlinked_agents_cannot_open_a_conversation(stores: Stores) {
    let llm = silent_after_script();
    let b = id("b");
    llm.push_tool_call(
        &b,
        "send_link_message",
        json!({"target": "c", "message": "hi"}),
    );
    llm.push_text(&b, "done");
    let mut h = harness(stores, Arc::new(llm.clone())).await;
    h.org.start_all().await.unwrap();
    h.org.deliver("b", chat("b", "talk to c")).await.unwrap();
    h.reply().await;
    let results = tool_results(&llm.requests_for(&b)[1]);
    assert!(results[0].contains("no link"), "{results:?}");
    assert!(h.all_conversations().await.is_empty());
    assert!(h.history("c", &link("c", "b")).await.is_empty());
}

pub async fn conclusion_closes_both_sides_and_retriggers_initiated_from_only(stores: Stores) {
    let llm = silent_after_script();
    let (a, b) = (id("a"), id("b"));
    llm.push_tool_call(
        &a,
        "send_link_message",
        json!({"target": "b", "message": "what is 6*7?"}),
    );
    llm.push_text(&a, "asked");
    llm.push_tool_call(&b, "conclude_link", json!({"summary": "42"}));
    llm.push_text(&a, "Beta says 42");
    // b concludes once a's turn is over (a conclusion during it would steer it).
    let held = Held::new(Arc::new(llm.clone()), "b");
    let mut h = harness(stores, held.clone()).await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", chat("a", "ask b")).await.unwrap();
    assert_eq!(h.reply().await.content, "asked");
    held.open();
    let result = h.reply().await;
    assert_eq!(result.content, "Beta says 42");
    assert_eq!(result.channel, portal("a"));
    h.wait_quiet().await;

    let c = h.only_conversation().await;
    assert_eq!(c.status, ConversationStatus::Concluded);
    assert_eq!(c.summary.as_deref(), Some("42"));
    assert!(c.members.iter().all(|m| !m.open));
    // The retrigger woke a in its portal channel, with the summary.
    let a_requests = llm.requests_for(&a);
    assert_eq!(a_requests.len(), 3, "send turn (2 calls) and the retrigger");
    assert!(last_user(&a_requests[2]).contains("42"));
    // The summary reached a's link side without waking it there; b was not woken again.
    assert!(
        h.lines("a", &link("a", "b"))
            .await
            .contains(&(RecordKind::User, "[conclusion from Beta] 42".into()))
    );
    assert_eq!(llm.requests_for(&b).len(), 1);
    // The result went to initiated_from and to no other channel.
    for agent in ["a", "b", "c", "d"] {
        for channel in h.stores.channels.channels(&id(agent)).await.unwrap() {
            let results = h
                .history(agent, &channel)
                .await
                .into_iter()
                .filter(|r| {
                    r.record.kind == RecordKind::System && r.record.content.contains("concluded")
                })
                .count();
            let expected = usize::from(agent == "a" && channel == portal("a"));
            assert_eq!(results, expected, "result records in {agent}/{channel}");
        }
    }
    assert_eq!(
        h.count(|k| matches!(k, EventKind::ConversationConcluded { .. })),
        1
    );
}

pub async fn reopening_keeps_history_budget_rules_and_initiated_from(stores: Stores) {
    let llm = silent_after_script();
    let (a, b) = (id("a"), id("b"));
    llm.push_tool_call(
        &a,
        "send_link_message",
        json!({"target": "b", "message": "first task: count files"}),
    );
    llm.push_text(&a, "asked");
    llm.push_tool_call(&b, "conclude_link", json!({"summary": "12 files"}));
    llm.push_text(&a, "12");
    // b answers each time once a's turn is over (an answer during it would steer it).
    let held = Held::new(Arc::new(llm.clone()), "b");
    let mut h = harness(stores, held.clone()).await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", chat("a", "count")).await.unwrap();
    assert_eq!(h.reply().await.content, "asked");
    held.open();
    assert_eq!(h.reply().await.content, "12");
    h.wait_quiet().await;
    held.close();
    let first = h.only_conversation().await;
    assert_eq!(first.status, ConversationStatus::Concluded);

    // a reopens it from another channel; initiated_from stays where it was set.
    llm.push_tool_call(
        &a,
        "send_link_message",
        json!({"target": "b", "message": "and the lines?"}),
    );
    llm.push_text(&a, "asked again");
    llm.push_text(&b, "300 lines");
    llm.push_text(&a, "");
    let other = spacebot::InboundMessage::new("discord", "room-9", "lines too");
    h.org.deliver("a", other).await.unwrap();
    assert_eq!(h.reply().await.content, "asked again");
    held.open();
    h.wait_quiet().await;

    let again = h.only_conversation().await;
    assert_eq!(again.id, first.id, "the same conversation, not a new one");
    assert_eq!(again.status, ConversationStatus::Open);
    assert_eq!(again.initiated_from, Some(portal("a")));
    assert_eq!(
        again.budget_remaining,
        first.budget_remaining - 2,
        "budget continues"
    );
    // No context loss: b's model saw the first exchange when answering the second.
    let b_last = llm.requests_for(&b).last().unwrap().clone();
    let seen: Vec<String> = b_last
        .messages
        .iter()
        .filter_map(|m| match m {
            ChatMessage::User { content }
            | ChatMessage::Assistant {
                content: Some(content),
                ..
            } => Some(content.to_string()),
            _ => None,
        })
        .collect();
    assert!(seen.iter().any(|t| t.contains("first task")), "{seen:?}");
    assert!(seen.iter().any(|t| t.contains("12 files")), "{seen:?}");
    // The rules were given once, at creation.
    for (owner, peer) in [("a", "b"), ("b", "a")] {
        let rules = h
            .lines(owner, &link(owner, peer))
            .await
            .iter()
            .filter(|(k, t)| *k == RecordKind::System && t.contains("Rules for this conversation"))
            .count();
        assert_eq!(rules, 1, "rules in {owner}'s side");
    }
    assert_eq!(
        h.count(|k| matches!(k, EventKind::ConversationOpened { .. })),
        2
    );
}

pub async fn the_budget_severs_a_conversation_nobody_concludes(stores: Stores) {
    // Both sides always answer and never conclude.
    let llm = FnLlm::new(|req: &ChatRequest| {
        if matches!(req.messages.last(), Some(ChatMessage::Tool { .. })) {
            Ok(ChatResponse::text("sent"))
        } else if last_user(req) == "start" {
            Ok(ChatResponse::tool_calls(vec![
                spacebot::testing::tool_call(
                    "send_link_message",
                    json!({"target": "c", "message": "ping"}),
                ),
            ]))
        } else {
            Ok(ChatResponse::text("and another thing"))
        }
    });
    let mut h = Setup::new(ABCD, stores)
        .settings("conversation_turn_budget = 5")
        .build(Arc::new(llm))
        .await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", chat("a", "start")).await.unwrap();
    h.reply().await;
    h.wait_kinds("the sever", |k| {
        k.iter()
            .any(|k| matches!(k, EventKind::ConversationSevered { .. }))
    })
    .await;
    h.wait_quiet().await;
    let c = h.only_conversation().await;
    assert_eq!(c.status, ConversationStatus::Severed);
    assert_eq!(c.budget_remaining, 0);
    assert_eq!(
        h.count(|k| matches!(k, EventKind::MessageReceived { .. })),
        5,
        "exactly the budget crossed"
    );
    let notice = h.lines("a", &portal("a")).await;
    assert!(
        notice
            .iter()
            .any(|(k, t)| *k == RecordKind::System && t.contains("severed")),
        "initiated_from hears about the sever: {notice:?}"
    );
    assert!(
        h.replies.try_recv().is_err(),
        "nothing leaked to the outbound"
    );
}

pub async fn an_answer_after_the_end_is_kept_but_neither_delivered_nor_leaked(stores: Stores) {
    let llm = silent_after_script();
    let (a, c) = (id("a"), id("c"));
    // a sends and severs in one tool round, before c gets to answer.
    llm.push_tool_calls(
        &a,
        [
            (
                "send_link_message",
                json!({"target": "c", "message": "status?"}),
            ),
            ("sever_link", json!({"target": "c"})),
        ],
    );
    llm.push_text(&c, "green");
    // c answers only once the sever is recorded (else its answer may land first, legitimately).
    let held = Held::new(Arc::new(llm.clone()), "c");
    let mut h = harness(stores, held.clone()).await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", chat("a", "ask c")).await.unwrap();
    h.wait_kinds("the sever", |kinds| {
        kinds
            .iter()
            .any(|k| matches!(k, EventKind::ConversationSevered { .. }))
    })
    .await;
    held.open();
    h.wait_quiet().await;
    assert_eq!(
        h.only_conversation().await.status,
        ConversationStatus::Severed
    );
    assert_eq!(
        llm.requests_for(&c).len(),
        1,
        "c answered the message it had received"
    );
    let c_side = h.lines("c", &link("c", "a")).await;
    assert!(
        c_side.contains(&(RecordKind::Assistant, "green".into())),
        "{c_side:?}"
    );
    assert!(
        // The reply is refused either when it is looked up (the sever landed first) or when its
        // turn is charged (the sever landed in between): both notes say so.
        c_side.iter().any(|(k, t)| *k == RecordKind::System
            && (t.contains("not delivered: the conversation is severed")
                || t.contains("not delivered: conversation") && t.contains("it is severed"))),
        "{c_side:?}"
    );
    assert!(
        !h.lines("a", &link("a", "c"))
            .await
            .contains(&(RecordKind::User, "green".into())),
        "nothing crosses a severed conversation"
    );
    assert!(
        h.replies.try_recv().is_err(),
        "the late answer did not leak to the outbound"
    );
}

pub async fn stopping_an_agent_severs_its_conversations(stores: Stores) {
    let llm = silent_after_script();
    let a = id("a");
    llm.push_tool_call(
        &a,
        "send_link_message",
        json!({"target": "d", "message": "hi"}),
    );
    llm.push_text(&a, "sent");
    llm.push_tool_call(
        &a,
        "send_link_message",
        json!({"target": "d", "message": "hi again"}),
    );
    llm.push_text(&a, "sent again");
    let mut h = harness(stores, Arc::new(llm)).await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", chat("a", "go")).await.unwrap();
    h.reply().await;
    h.wait_quiet().await;
    assert_eq!(h.only_conversation().await.status, ConversationStatus::Open);
    h.org.stop_agent(&id("d")).await.unwrap();
    let c = h.only_conversation().await;
    assert_eq!(c.status, ConversationStatus::Severed);
    let reason = h.events.kinds().into_iter().find_map(|k| match k {
        EventKind::ConversationSevered { reason, .. } => Some(reason),
        _ => None,
    });
    assert!(reason.unwrap().contains("session of Delta ended"));
    // A severed conversation is not revived by a new send: a new one starts.
    h.org.start_agent(&id("d")).await.unwrap();
    h.org.deliver("a", chat("a", "again")).await.unwrap();
    h.reply().await;
    h.wait_quiet().await;
    let all = h.all_conversations().await;
    assert_eq!(all.len(), 2);
    let old = all.iter().find(|x| x.id == c.id).unwrap();
    assert_eq!(old.status, ConversationStatus::Severed);
    assert!(
        all.iter()
            .any(|x| x.id != c.id && x.status == ConversationStatus::Open)
    );
}

/// Builds eight organizations, each on fresh stores from `open`.
/// A delegation made inside a mirrored conversation sends its completion notice to the channel it
/// came from: the conversation's link channel. The delegator's answer to the notice there is
/// conversation output: it reaches the peer as a turn of the conversation, not the application.
pub async fn an_answer_to_a_notice_in_a_conversations_channel_goes_to_the_peer(stores: Stores) {
    let llm = silent_after_script();
    let (a, b, c) = (id("a"), id("b"), id("c"));
    llm.push_tool_call(
        &a,
        "send_link_message",
        json!({"target": "c", "message": "hello"}),
    );
    llm.push_text(&a, "asked Gamma");
    llm.push_text(&c, "hi");
    // Answering c inside the conversation, a delegates to b (which ends its turn).
    llm.push_tool_call(
        &a,
        "send_agent_message",
        json!({"target": "b", "message": "Compute."}),
    );
    llm.push_text(&b, "42");
    llm.push_text(&a, "Beta says 42");
    // c answers once a's first turn is over, b once a's conversation turn is over: nothing steers.
    let c_held = Held::new(Arc::new(llm.clone()), "c");
    let b_held = Held::new(c_held.clone(), "b");
    let mut h = harness(stores, b_held.clone()).await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", chat("a", "ask c")).await.unwrap();
    assert_eq!(h.reply().await.content, "asked Gamma");
    c_held.open();
    h.wait_for("a's turn in the conversation to end", |events| {
        events.iter().any(|e| {
            e.agent == a
                && matches!(e.kind, EventKind::TurnFinished { .. })
                && e.channel == Some(link("a", "c"))
        })
    })
    .await;
    let task = h.task("b", 1).await;
    assert_eq!(task.metadata.originating_channel, Some(link("a", "c")));
    b_held.open();
    h.wait_until("c to receive a's answer to the notice", || async {
        h.lines("c", &link("c", "a"))
            .await
            .contains(&(RecordKind::User, "Beta says 42".into()))
    })
    .await;
    h.wait_quiet().await;
    assert!(
        h.replies.try_recv().is_err(),
        "the answer to the notice went to the conversation, not the outbound"
    );
    assert_eq!(h.only_conversation().await.status, ConversationStatus::Open);
    assert_eq!(
        llm.requests_for(&c).len(),
        2,
        "c answered hello and a's answer"
    );
}

pub async fn concurrent_handshakes_between_one_pair_end_in_one_conversation(open: OpenStores) {
    for round in 0..8 {
        let stores = open().await;
        let llm = silent_after_script();
        let (a, c) = (id("a"), id("c"));
        llm.push_tool_call(
            &a,
            "send_link_message",
            json!({"target": "c", "message": "from a"}),
        );
        llm.push_text(&a, "a sent");
        llm.push_tool_call(
            &c,
            "send_link_message",
            json!({"target": "a", "message": "from c"}),
        );
        llm.push_text(&c, "c sent");
        let mut h = harness(stores, Arc::new(llm)).await;
        h.org.start_all().await.unwrap();
        let (x, y) = tokio::join!(
            h.org.deliver("a", chat("a", "talk to c")),
            h.org.deliver("c", chat("c", "talk to a"))
        );
        x.unwrap();
        y.unwrap();
        h.reply().await;
        h.reply().await;
        h.wait_quiet().await;
        let all = h.all_conversations().await;
        assert_eq!(all.len(), 1, "round {round}: {all:#?}");
        // Both messages crossed in the one conversation.
        assert!(
            h.lines("c", &link("c", "a"))
                .await
                .contains(&(RecordKind::User, "from a".into()))
        );
        assert!(
            h.lines("a", &link("a", "c"))
                .await
                .contains(&(RecordKind::User, "from c".into()))
        );
    }
}

/// Seed 000's multi-hop example, hop by hop: user -> chief-ai-officer -> spacebot-tech-lead ->
/// community-manager ("nebula") -> back up the chain to the user.
pub async fn nebula_multi_hop_in_mirrored_mode(stores: Stores) {
    const ORG: &str = r#"
[[agents]]
id = "chief-ai-officer"
name = "Chief AI Officer"

[[agents]]
id = "spacebot-tech-lead"
name = "Spacebot Tech Lead"

[[agents]]
id = "community-manager"
name = "Community Manager"

[[links]]
from = "chief-ai-officer"
to = "spacebot-tech-lead"
direction = "one_way"
relationship = "superior"

[[links]]
from = "spacebot-tech-lead"
to = "community-manager"
direction = "one_way"
relationship = "superior"
"#;
    let llm = silent_after_script();
    let (cao, tl, cm) = (
        id("chief-ai-officer"),
        id("spacebot-tech-lead"),
        id("community-manager"),
    );
    llm.push_tool_call(&cao, "send_link_message", json!({
        "target": "spacebot-tech-lead",
        "message": "forward this to community manager, have them pick a random word and send it back"
    }));
    llm.push_text(
        &cao,
        "Sent the request to Spacebot Tech Lead, I'll let you know when I hear back.",
    );
    llm.push_tool_call(
        &tl,
        "send_link_message",
        json!({
            "target": "Community Manager",
            "message": "pick a random word and reply with it"
        }),
    );
    llm.push_text(&tl, "");
    llm.push_tool_call(&cm, "conclude_link", json!({"summary": "nebula"}));
    llm.push_tool_call(
        &tl,
        "conclude_link",
        json!({"summary": "The word was nebula"}),
    );
    llm.push_text(
        &cao,
        "The chain came back: community manager picked 'nebula'.",
    );
    let mut h = Setup::new(ORG, stores).build(Arc::new(llm.clone())).await;
    h.org.start_all().await.unwrap();
    h.org
        .deliver(
            "chief-ai-officer",
            chat(
                "chief-ai-officer",
                "get a random word from the community manager",
            ),
        )
        .await
        .unwrap();

    let ack = h.reply().await;
    assert!(ack.content.starts_with("Sent the request"));
    let result = h.reply().await;
    assert_eq!(result.channel, portal("chief-ai-officer"));
    assert!(result.content.contains("nebula"));
    h.wait_quiet().await;

    let all = h.all_conversations().await;
    assert_eq!(all.len(), 2);
    let upper = all.iter().find(|c| c.initiator == cao).unwrap();
    let lower = all.iter().find(|c| c.initiator == tl).unwrap();
    // Each hop knows only where it was initiated from.
    assert_eq!(upper.initiated_from, Some(portal("chief-ai-officer")));
    assert_eq!(
        lower.initiated_from,
        Some(link("spacebot-tech-lead", "chief-ai-officer"))
    );
    assert_eq!(lower.summary.as_deref(), Some("nebula"));
    assert_eq!(upper.summary.as_deref(), Some("The word was nebula"));
    assert!(
        all.iter()
            .all(|c| c.status == ConversationStatus::Concluded)
    );

    // Hop 2 -> 3: tl's request is on cm's side, tl's sent copy on its own.
    assert!(
        h.lines(
            "community-manager",
            &link("community-manager", "spacebot-tech-lead")
        )
        .await
        .contains(&(
            RecordKind::User,
            "pick a random word and reply with it".into()
        ))
    );
    assert!(
        h.lines(
            "spacebot-tech-lead",
            &link("spacebot-tech-lead", "community-manager")
        )
        .await
        .contains(&(
            RecordKind::Sent,
            "pick a random word and reply with it".into()
        ))
    );
    // cm's conclusion came back to tl's side, and the retrigger woke tl on the chief link.
    assert!(
        h.lines(
            "spacebot-tech-lead",
            &link("spacebot-tech-lead", "community-manager")
        )
        .await
        .contains(&(
            RecordKind::User,
            "[conclusion from Community Manager] nebula".into()
        ))
    );
    let tl_requests = llm.requests_for(&tl);
    assert_eq!(tl_requests.len(), 3);
    // The conclusion reached tl's model before its last call: as the last message of a turn of its
    // own, or, when it arrived while tl's first turn was still running (a slower store), as the
    // steering message of that turn, followed by the prompt to continue.
    assert!(
        tl_requests[2]
            .messages
            .iter()
            .any(|m| matches!(m, ChatMessage::User { content } if content.contains("nebula"))),
        "tl's last request saw the conclusion"
    );
    assert!(
        h.lines(
            "spacebot-tech-lead",
            &link("spacebot-tech-lead", "chief-ai-officer")
        )
        .await
        .iter()
        .any(|(k, t)| *k == RecordKind::System && t.contains("nebula")),
        "the retrigger landed on tl's chief link"
    );
    // tl's conclusion reached cao's side, and cao was woken on the portal.
    assert!(
        h.lines(
            "chief-ai-officer",
            &link("chief-ai-officer", "spacebot-tech-lead")
        )
        .await
        .contains(&(
            RecordKind::User,
            "[conclusion from Spacebot Tech Lead] The word was nebula".into()
        ))
    );
    let cao_requests = llm.requests_for(&cao);
    assert_eq!(cao_requests.len(), 3);
    assert!(last_user(&cao_requests[2]).contains("The word was nebula"));
    assert_eq!(llm.requests_for(&cm).len(), 1);
    assert!(h.replies.try_recv().is_err());
}
