//! What the model is offered and sent, checked on the requests the mock model receives: the tools
//! of an agent match what the policy lets it do, a woken delegator's request keeps its tool call
//! and result in a valid order, and the text a worker gets for a task comes from `Prompts`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: failing loudly is the point

use std::collections::BTreeSet;
use std::sync::Arc;

use super::support::*;
use serde_json::json;
use spacebot::ChatRequest;
use spacebot::llm::ChatMessage;
use spacebot::prompts::Prompts;
use spacebot::testing::{OrgHarness, ScriptedLlm};

/// The names of the tools a request offers.
fn offered(request: &ChatRequest) -> BTreeSet<String> {
    request.tools.iter().map(|t| t.name.clone()).collect()
}

fn names(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// The board tools: every agent may use them on its own board.
const BOARD: [&str; 3] = ["task_create", "task_list", "task_update"];

fn system_text(request: &ChatRequest) -> String {
    match request.messages.first() {
        Some(ChatMessage::System { content }) => content.to_string(),
        other => panic!("a request starts with its system prompt, not {other:?}"),
    }
}

/// Agents `a` -> `b` (one-way, `a` superior) and `c` unlinked ([`agent::ORG`]): `b` may answer
/// `a` but never start anything, `c` may do nothing with anyone.
pub async fn every_agent_is_offered_only_the_tools_its_links_allow(stores: Stores) {
    let llm = Arc::new(ScriptedLlm::new());
    let (a, b, c) = (id("a"), id("b"), id("c"));
    llm.push_tool_call(
        &a,
        "send_agent_message",
        json!({"target": "b", "message": "Pick a word."}),
    );
    // The worker tries a tool it is not offered: refused in code as an unknown tool.
    llm.push_tool_call(
        &b,
        "open_group",
        json!({"members": ["a"], "message": "Which word?"}),
    );
    llm.push_text(&b, "nebula");
    llm.push_text(&a, "Beta picked nebula");
    let mut h = agent::harness(stores, llm.clone(), "", vec![]).await;
    h.org.start_all().await.unwrap();
    h.org
        .deliver("a", user("Have Beta pick a word"))
        .await
        .unwrap();
    assert_eq!(h.reply().await.content, "Beta picked nebula");

    // The boss may start exchanges with b: every tool.
    let boss = llm.requests_for(&a);
    let mut all = names(&BOARD);
    all.extend(names(&[
        "send_agent_message",
        "send_link_message",
        "open_group",
        "close_link",
        "conclude_link",
        "sever_link",
    ]));
    assert_eq!(offered(&boss[0]), all);
    assert!(system_text(&boss[0]).contains("send_agent_message"));

    // The worker, reached one-way: its board, and continuing, concluding or severing a
    // conversation the boss opens with it; nothing that only starts an exchange (delegating,
    // opening a group, closing what it started), and its prompt does not say to delegate.
    let worker = llm.requests_for(&b);
    let mut answering = names(&BOARD);
    answering.extend(names(&["send_link_message", "conclude_link", "sever_link"]));
    assert_eq!(offered(&worker[0]), answering);
    assert!(
        !system_text(&worker[0]).contains("send_agent_message"),
        "{}",
        system_text(&worker[0])
    );
    let refused = tool_results(&worker[1]);
    assert_eq!(refused.len(), 1);
    assert!(
        refused[0].contains("open_group") && refused[0].contains("unknown"),
        "{}",
        refused[0]
    );

    // The unlinked agent: its board only.
    llm.push_text(&c, "alone");
    h.org.deliver("c", user("hello")).await.unwrap();
    assert_eq!(h.reply().await.content, "alone");
    assert_eq!(offered(&llm.requests_for(&c)[0]), names(&BOARD));

    // Offers follow the links at run time: with its only link disabled, the boss is offered its
    // board alone.
    h.org.set_link_enabled(&a, &b, false).await.unwrap();
    llm.push_text(&a, "nobody to ask");
    h.org.deliver("a", user("Ask Beta again")).await.unwrap();
    assert_eq!(h.reply().await.content, "nobody to ask");
    let last = llm.requests_for(&a).pop().unwrap();
    assert_eq!(offered(&last), names(&BOARD));
    assert!(!system_text(&last).contains("send_agent_message"));
}

/// The roles of a request's messages, one letter each: `s`ystem, `u`ser, `a`ssistant, `t`ool.
fn roles(request: &ChatRequest) -> String {
    request
        .messages
        .iter()
        .map(|m| match m {
            ChatMessage::System { .. } => 's',
            ChatMessage::User { .. } => 'u',
            ChatMessage::Assistant { .. } => 'a',
            ChatMessage::Tool { .. } => 't',
        })
        .collect()
}

/// Checks that `request` never has two user messages in a row and that every tool result
/// follows the assistant message that made its call.
fn assert_valid_sequence(request: &ChatRequest) {
    let mut open_calls: Vec<String> = Vec::new();
    let mut previous: Option<&ChatMessage> = None;
    for message in &request.messages {
        match message {
            ChatMessage::User { .. } => {
                assert!(
                    !matches!(previous, Some(ChatMessage::User { .. })),
                    "two user messages in a row: {}",
                    roles(request)
                );
                open_calls.clear();
            }
            ChatMessage::Assistant { tool_calls, .. } => {
                open_calls = tool_calls.iter().map(|c| c.id.clone()).collect();
            }
            ChatMessage::Tool { tool_call_id, .. } => {
                assert!(
                    open_calls.contains(tool_call_id),
                    "a tool result without its call: {}",
                    roles(request)
                );
            }
            ChatMessage::System { .. } => {}
        }
        previous = Some(message);
    }
}

/// A delegator woken by its task's result sees the user's message, its own `send_agent_message`
/// call, that call's result and then the notice: no two user messages in a row. The next turn in
/// the channel keeps that order, followed by the answer.
pub async fn a_woken_delegator_sees_its_call_and_result_before_the_notice(stores: Stores) {
    let llm = Arc::new(ScriptedLlm::new());
    let (a, b) = (id("a"), id("b"));
    llm.push_tool_call(
        &a,
        "send_agent_message",
        json!({"target": "b", "message": "Pick a random word."}),
    );
    llm.push_text(&b, "nebula");
    llm.push_text(&a, "Beta picked nebula");
    llm.push_text(&a, "still nebula");
    let mut h = delegation::harness(stores, llm.clone(), "").await;
    h.org
        .deliver("a", user("Have Beta pick a word"))
        .await
        .unwrap();
    assert_eq!(h.reply().await.content, "Beta picked nebula");
    let requests = llm.requests_for(&a);
    let woken = &requests[1];
    assert_eq!(roles(woken), "suatu", "{:#?}", woken.messages);
    assert_valid_sequence(woken);
    match &woken.messages[2] {
        ChatMessage::Assistant { tool_calls, .. } => {
            assert_eq!(tool_calls.len(), 1);
            assert_eq!(tool_calls[0].name, "send_agent_message");
            let args: serde_json::Value = serde_json::from_str(&tool_calls[0].arguments).unwrap();
            assert_eq!(args["target"], "b");
        }
        other => panic!("the earlier tool call, not {other:?}"),
    }
    match &woken.messages[3] {
        ChatMessage::Tool { content, .. } => {
            assert!(content.starts_with("Assigned task #1 to Beta"), "{content}")
        }
        other => panic!("the call's result, not {other:?}"),
    }
    assert!(last_user_text(woken).starts_with("Beta completed task #1: nebula"));

    h.org
        .deliver("a", user("Which word was it?"))
        .await
        .unwrap();
    assert_eq!(h.reply().await.content, "still nebula");
    // The notice is kept in the channel as a system record: the sequence stays valid.
    let next = llm.requests_for(&a).pop().unwrap();
    assert_eq!(roles(&next), "suatsau", "{:#?}", next.messages);
    assert_valid_sequence(&next);
}

/// The text a worker's turn on a task starts with is the `task_assigned` template: the built-in
/// one as documented, or the application's override.
pub async fn the_task_text_a_worker_gets_comes_from_prompts(stores: Stores) {
    let (a, b) = (id("a"), id("b"));
    let script = |llm: &ScriptedLlm| {
        llm.push_tool_call(
            &a,
            "send_agent_message",
            json!({"target": "b", "message": "Pick a random word. Only one."}),
        );
        llm.push_text(&b, "nebula");
        llm.push_text(&a, "done");
    };
    let llm = Arc::new(ScriptedLlm::new());
    script(&llm);
    let mut prompts = Prompts::new();
    prompts
        .override_template(
            "task_assigned",
            "{{ description }} (for {{ delegated_by }}, task {{ task_number }})",
        )
        .unwrap();
    let mut h = OrgHarness::builder(with_settings("", delegation::ORG))
        .stores(stores)
        .llm(llm.clone())
        .prompts(prompts)
        .build()
        .await;
    h.org.start_all().await.unwrap();
    h.org
        .deliver("a", user("Have Beta pick a word"))
        .await
        .unwrap();
    assert_eq!(h.reply().await.content, "done");
    assert_eq!(
        last_user_text(&llm.requests_for(&b)[0]),
        "Pick a random word. Only one. (for a, task 1)"
    );

    // The built-in template, as `TaskAssignedContext` documents it.
    let llm = Arc::new(ScriptedLlm::new());
    script(&llm);
    let mut h = OrgHarness::builder(with_settings("", delegation::ORG))
        .llm(llm.clone())
        .build()
        .await;
    h.org.start_all().await.unwrap();
    h.org
        .deliver("a", user("Have Beta pick a word"))
        .await
        .unwrap();
    assert_eq!(h.reply().await.content, "done");
    assert_eq!(
        last_user_text(&llm.requests_for(&b)[0]),
        "You have been assigned task #1: Pick a random word.\n\nPick a random word. Only one.\n\n(Delegated by a.)"
    );
}
