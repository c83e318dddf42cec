//! The agent runtime: delivery, queue bounds, the internal channel, children, tool errors, the
//! round limit, steering and cancellation.

// Helpers outside #[test] functions assert too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use super::support::{agent::*, *};
use serde_json::json;
use spacebot::event::EventKind;
use spacebot::testing::{MockLlm, ScriptedLlm, raw_tool_call, tool_call};
use spacebot::{
    AgentId, ChannelId, ChannelStore, ChatMessage, ChatResponse, ChildSpec, DeliveryError,
    DeliveryStore, InboundMessage, InternalMessage, LlmError, RecordKind,
};

fn msg(text: &str) -> InboundMessage {
    InboundMessage::new("portal", "u1", text)
}

pub async fn delivery_to_a_stopped_agent_is_persisted_and_handed_over_once(stores: Stores) {
    let llm = Arc::new(ScriptedLlm::new());
    llm.push_text(&id("a"), "hello back");
    let mut h = harness(stores, llm.clone(), "", vec![]).await;
    let a = id("a");
    let envelope = h.org.deliver("a", msg("hello")).await.unwrap();
    assert_eq!(h.stores.deliveries.pending(&a).await.unwrap().len(), 1);
    assert!(llm.requests().is_empty(), "a stopped agent must not run");

    h.org.start_agent(&a).await.unwrap();
    let reply = h.reply().await;
    assert_eq!(reply.content, "hello back");
    assert_eq!(reply.in_reply_to, vec![envelope]);
    // Restarting must not hand the same envelope over again.
    h.org.stop_agent(&a).await.unwrap();
    assert!(h.stores.deliveries.pending(&a).await.unwrap().is_empty());
    h.org.start_agent(&a).await.unwrap();
    // A later message is answered after anything handed over at the start: once it is, and the
    // agent is idle, whatever the restart handed over has been answered.
    llm.push_text(&a, "pong");
    let ping = h.org.deliver("a", msg("ping")).await.unwrap();
    let reply = h.reply().await;
    assert_eq!(
        (reply.content.as_str(), reply.in_reply_to.clone()),
        ("pong", vec![ping])
    );
    h.wait_idle("a").await;
    assert_eq!(llm.requests_for(&a).len(), 2, "handed over exactly once");
    assert!(h.replies_now().is_empty(), "no second reply");
}

pub async fn a_full_queue_refuses_with_queue_full(stores: Stores) {
    let (llm, mut calls) = MockLlm::pair();
    let h = harness(stores, Arc::new(llm), "queue_capacity = 2", vec![]).await;
    let a = id("a");
    h.org.start_agent(&a).await.unwrap();
    h.org.deliver("a", msg("1")).await.unwrap();
    let call = next_call(&mut calls).await; // the loop took "1" and waits on the model
    h.org.deliver("a", msg("2")).await.unwrap();
    h.org.deliver("a", msg("3")).await.unwrap();
    let err = h.org.deliver("a", msg("4")).await.unwrap_err();
    assert!(
        matches!(&err, DeliveryError::QueueFull(_)),
        "expected QueueFull, got {err:?}"
    );
    assert!(
        err.to_string().contains("queue of agent a is full"),
        "{err}"
    );
    assert_eq!(h.org.queue_len(&a), Some(2));
    call.respond_text("done");
}

pub async fn unknown_and_ended_targets_are_typed_errors(stores: Stores) {
    let llm = Arc::new(ScriptedLlm::new());
    let h = harness(stores, llm.clone(), "", vec![]).await;
    let a = id("a");
    let err = h.org.deliver("nobody", msg("hi")).await.unwrap_err();
    assert!(matches!(err, DeliveryError::UnknownAgent { ref agent } if agent == "nobody"));
    let err = h
        .org
        .send_internal(&a, &id("nobody"), InternalMessage::task("x"))
        .await
        .unwrap_err();
    assert!(matches!(err, DeliveryError::UnknownAgent { .. }), "{err:?}");

    // A child that answered its task ends; later messages to it are refused.
    h.org.start_agent(&a).await.unwrap();
    let child = h
        .org
        .spawn_child(&a, ChildSpec::new("helper", "say ok"))
        .await
        .unwrap();
    llm.push_text(&child, "ok");
    llm.push_text(&a, "thanks");
    // the child's script was pushed after spawn: the first request may have failed; accept both
    h.wait_for("the child to stop", |ev| {
        ev.iter()
            .any(|e| e.agent == child && e.kind == EventKind::AgentStopped)
    })
    .await;
    let err = h
        .org
        .send_internal(&a, &child, InternalMessage::announce("more"))
        .await
        .unwrap_err();
    assert!(matches!(err, DeliveryError::Ended { .. }), "{err:?}");
    assert!(err.to_string().contains("has ended"));
}

pub async fn internal_messages_are_policy_checked_and_stamped(stores: Stores) {
    let (llm, mut calls) = MockLlm::pair();
    let h = harness(stores, Arc::new(llm), "", vec![]).await;
    let (a, b, c) = (id("a"), id("b"), id("c"));
    // a -> b one-way: a may start, b may not; c has no link.
    let err = h
        .org
        .send_internal(&b, &a, InternalMessage::task("do this"))
        .await
        .unwrap_err();
    let DeliveryError::Denied(denied) = err else {
        panic!("expected a denial")
    };
    assert_eq!((denied.actor.as_str(), denied.target.as_str()), ("b", "a"));
    assert!(denied.to_string().contains("one-way"), "{denied}");
    let err = h
        .org
        .send_internal(&c, &a, InternalMessage::task("x"))
        .await
        .unwrap_err();
    assert!(matches!(err, DeliveryError::Denied(_)), "{err:?}");
    // b may answer back along the one-way link.
    h.org.start_agent(&b).await.unwrap();
    h.org
        .send_internal(&a, &b, InternalMessage::task("count to 3"))
        .await
        .unwrap();
    let call = next_call(&mut calls).await;
    assert_eq!(call.agent(), Some(&b));
    assert!(last_user_text(&call.request).contains("count to 3"));
    call.respond_text("1 2 3");
    h.org
        .send_internal(&b, &a, InternalMessage::announce("done"))
        .await
        .unwrap();
    let history = h
        .stores
        .channels
        .history(&b, &ChannelId::link(&b, &a), None)
        .await
        .unwrap();
    // The refused attempt of c (no link to a) left nothing; b's refused one along the one-way
    // link is recorded first, by the runtime; then a's message, stamped with its sender.
    assert!(
        history[0]
            .record
            .content
            .to_string()
            .starts_with("refused: "),
        "{:?}",
        history[0].record
    );
    assert_eq!(
        history[1].record.author, "agent a",
        "sender stamped by the runtime"
    );
}

pub async fn a_child_result_wakes_the_parent(stores: Stores) {
    let (llm, mut calls) = MockLlm::pair();
    let mut h = harness(stores, Arc::new(llm), "", vec![]).await;
    let a = id("a");
    h.org.start_agent(&a).await.unwrap();
    let child = h
        .org
        .spawn_child(&a, ChildSpec::new("word picker", "pick a random word"))
        .await
        .unwrap();
    let call = next_call(&mut calls).await;
    assert_eq!(call.agent(), Some(&child));
    assert!(last_user_text(&call.request).contains("pick a random word"));
    call.respond_text("nebula");
    let call = next_call(&mut calls).await;
    assert_eq!(call.agent(), Some(&a), "the parent is woken");
    assert!(last_user_text(&call.request).contains("nebula"));
    call.respond_text("the child picked nebula");
    let reply = h.reply().await;
    assert_eq!(reply.agent, a);
    assert_eq!(reply.content, "the child picked nebula");
}

pub async fn a_failed_child_and_an_undeliverable_result_are_reported(stores: Stores) {
    let (llm, mut calls) = MockLlm::pair();
    let h = harness(stores, Arc::new(llm), "", vec![]).await;
    let a = id("a");
    h.org.start_agent(&a).await.unwrap();
    // The child's model fails: the parent is told.
    let child = h
        .org
        .spawn_child(&a, ChildSpec::new("flaky", "work"))
        .await
        .unwrap();
    let call = next_call(&mut calls).await;
    assert_eq!(call.agent(), Some(&child));
    call.fail(LlmError::Other("model unavailable".into()));
    let call = next_call(&mut calls).await;
    assert_eq!(call.agent(), Some(&a));
    let text = last_user_text(&call.request);
    assert!(
        text.contains("failed") && text.contains("model unavailable"),
        "{text}"
    );
    call.respond_text("noted");

    // A grandchild whose parent ended before it answered: the result cannot be delivered.
    let mid = h
        .org
        .spawn_child(&a, ChildSpec::new("mid", "delegate further"))
        .await
        .unwrap();
    let grandchild = h
        .org
        .spawn_child(&mid, ChildSpec::new("leaf", "answer late"))
        .await
        .unwrap();
    // Answer mid first: it ends; then the leaf answers into the void.
    let mut pending = Vec::new();
    while pending.len() < 2 {
        pending.push(next_call(&mut calls).await);
    }
    let (mid_call, leaf_call): (Vec<_>, Vec<_>) =
        pending.into_iter().partition(|c| c.agent() == Some(&mid));
    mid_call
        .into_iter()
        .next()
        .unwrap()
        .respond_text("mid done");
    let parent_call = next_call(&mut calls).await;
    assert_eq!(parent_call.agent(), Some(&a));
    parent_call.respond_text("ok");
    h.wait_for("mid to end", |ev| {
        ev.iter()
            .any(|e| e.agent == mid && e.kind == EventKind::AgentStopped)
    })
    .await;
    leaf_call
        .into_iter()
        .next()
        .unwrap()
        .respond_text("too late");
    h.wait_for("the undeliverable result to be reported", |ev| {
        ev.iter().any(|e| e.agent == grandchild && {
            matches!(&e.kind, EventKind::Error { message } if message.contains("reply not delivered") && message.contains("ended"))
        })
    })
    .await;
}

pub async fn tool_errors_go_back_to_the_model(stores: Stores) {
    let llm = Arc::new(ScriptedLlm::new());
    let a = id("a");
    llm.push(
        &a,
        ChatResponse::tool_calls(vec![
            tool_call("no_such_tool", json!({})),
            raw_tool_call("c1", "echo", "{not json"),
            raw_tool_call("c2", "echo", "[1,2]"),
            tool_call("echo", json!({"wrong": 1})),
            tool_call("broken", json!({})),
            tool_call("ping", json!({"target": "c"})),
            tool_call("echo", json!({"text": "fine"})),
        ]),
    );
    llm.push_text(&a, "recovered");
    let mut h = harness(
        stores,
        llm.clone(),
        "",
        vec![Arc::new(EchoTool), Arc::new(BrokenTool), Arc::new(PingTool)],
    )
    .await;
    h.org.start_agent(&a).await.unwrap();
    h.org.deliver("a", msg("go")).await.unwrap();
    assert_eq!(h.reply().await.content, "recovered");
    let requests = llm.requests_for(&a);
    let results = tool_results(&requests[1]);
    assert_eq!(results.len(), 7);
    assert!(
        results[0].starts_with("Error: unknown tool \"no_such_tool\"")
            && results[0].contains("echo"),
        "{}",
        results[0]
    );
    assert!(results[1].contains("not valid JSON"), "{}", results[1]);
    assert!(
        results[2].contains("must be one JSON object"),
        "{}",
        results[2]
    );
    assert!(
        results[3].contains("invalid arguments for tool echo"),
        "{}",
        results[3]
    );
    assert!(results[4].contains("the disk is on fire"), "{}", results[4]);
    assert!(
        results[5].contains("a may not") && results[5].contains("c"),
        "{}",
        results[5]
    );
    assert_eq!(results[6], "echo: fine");
    let failed = h
        .events
        .kinds()
        .iter()
        .filter(|k| matches!(k, EventKind::ToolCalled { ok: false, .. }))
        .count();
    assert_eq!(failed, 6);
}

pub async fn the_round_limit_stops_a_looping_model(stores: Stores) {
    let a = id("a");
    let llm = Arc::new(spacebot::testing::FnLlm::new(|req| {
        if req
            .messages
            .iter()
            .any(|m| matches!(m, ChatMessage::User { content } if content == "second"))
        {
            return Ok(ChatResponse::text("second answered"));
        }
        Ok(ChatResponse::tool_calls(vec![tool_call(
            "echo",
            json!({"text": "again"}),
        )]))
    }));
    let mut h = harness(
        stores,
        llm.clone(),
        "max_tool_rounds = 3",
        vec![Arc::new(EchoTool)],
    )
    .await;
    h.org.start_agent(&a).await.unwrap();
    h.org.deliver("a", msg("loop forever")).await.unwrap();
    h.wait_kinds("the round limit", |ev| {
        ev.contains(&EventKind::RoundLimitReached { limit: 3 })
    })
    .await;
    // The user is told the turn failed, and why.
    let failed = h.reply().await;
    assert!(failed.is_failure(), "{failed:?}");
    assert!(
        failed.content.contains("3 tool rounds"),
        "{}",
        failed.content
    );
    // The loop is not stuck: it goes on with the next message.
    h.org.deliver("a", msg("second")).await.unwrap();
    assert_eq!(h.reply().await.content, "second answered");
    assert!(
        h.events.kinds().iter().any(
            |k| matches!(k, EventKind::Error { message } if message.contains("3 tool rounds"))
        )
    );
    let history = h
        .stores
        .channels
        .history(&a, &ChannelId::new("portal:u1"), None)
        .await
        .unwrap();
    assert!(
        history.iter().any(
            |r| r.record.kind == RecordKind::System && r.record.content.contains("tool rounds")
        )
    );
    assert_eq!(
        llm.requests_for(&a).len(),
        4,
        "3 rounds, then the second message"
    );
}

pub async fn steering_answers_the_merged_backlog_then_the_interrupted_message(stores: Stores) {
    let (llm, mut calls) = MockLlm::pair();
    let mut h = harness(stores, Arc::new(llm), "", vec![Arc::new(EchoTool)]).await;
    let a = id("a");
    h.org.start_agent(&a).await.unwrap();
    let m1 = h
        .org
        .deliver("a", msg("write a long report"))
        .await
        .unwrap();
    let call = next_call(&mut calls).await;
    let m2 = h.org.deliver("a", msg("stop, use French")).await.unwrap();
    let m3 = h.org.deliver("a", msg("and keep it short")).await.unwrap();
    call.respond_tool_calls(vec![tool_call("echo", json!({"text": "working"}))]);
    // Checkpoint: m2 and m3 are merged into one user message.
    let call = next_call(&mut calls).await;
    let merged = last_user_text(&call.request);
    assert!(
        merged.contains("[1] user (portal): stop, use French"),
        "{merged}"
    );
    assert!(
        merged.contains("[2] user (portal): and keep it short"),
        "{merged}"
    );
    call.respond_text("d'accord");
    let reply = h.reply().await;
    assert_eq!(reply.in_reply_to, vec![m2, m3]);
    // Then the interrupted message, resumed by the same turn.
    let call = next_call(&mut calls).await;
    assert!(last_user_text(&call.request).contains("write a long report"));
    call.respond_text("rapport");
    let reply = h.reply().await;
    assert_eq!(reply.in_reply_to, vec![m1]);
    assert!(h.events.kinds().contains(&EventKind::Steered { merged: 2 }));
}

pub async fn cancelling_a_turn_keeps_what_is_queued(stores: Stores) {
    let (llm, mut calls) = MockLlm::pair();
    let mut h = harness(stores, Arc::new(llm), "", vec![]).await;
    let (a, b) = (id("a"), id("b"));
    h.org.start_agent(&a).await.unwrap();
    h.org.deliver("a", msg("slow question")).await.unwrap();
    let slow = next_call(&mut calls).await;
    let m2 = h.org.deliver("a", msg("next question")).await.unwrap();
    assert!(h.org.cancel_turn(&a));
    h.wait_kinds("the cancel event", |ev| {
        ev.contains(&EventKind::TurnCancelled)
    })
    .await;
    // The model call is still unanswered: only the cancel can have freed the loop for the next
    // message.
    let call = next_call(&mut calls).await;
    drop(slow);
    assert_eq!(last_user_text(&call.request), "next question");
    call.respond_text("answer 2");
    let reply = h.reply().await;
    assert_eq!(reply.in_reply_to, vec![m2]);
    h.wait_idle("a").await;
    assert!(!h.org.cancel_turn(&a), "nothing runs now");
    // The channel says the cancelled message was not answered.
    let portal = ChannelId::new("portal:u1");
    assert!(
        h.history("a", &portal)
            .await
            .iter()
            .any(|r| r.record.kind == RecordKind::System
                && r.record
                    .content
                    .contains("turn cancelled; the message was not answered")),
        "{:?}",
        h.history("a", &portal).await
    );

    // A cancel envelope over the internal channel does the same for b.
    h.org.start_agent(&b).await.unwrap();
    h.org
        .send_internal(&a, &b, InternalMessage::task("long job"))
        .await
        .unwrap();
    let job = next_call(&mut calls).await;
    h.org
        .send_internal(&a, &b, InternalMessage::task("queued job"))
        .await
        .unwrap();
    h.org
        .send_internal(&a, &b, InternalMessage::cancel("changed my mind"))
        .await
        .unwrap();
    // As above, the long job's model call stays unanswered until the queued job is asked.
    let call = next_call(&mut calls).await;
    drop(job);
    assert_eq!(call.agent(), Some(&b));
    assert!(last_user_text(&call.request).contains("queued job"));
    call.respond_text("ok");
}

pub async fn stopping_an_agent_persists_its_queue_for_the_next_start(stores: Stores) {
    let (llm, mut calls) = MockLlm::pair();
    let mut h = harness(stores, Arc::new(llm), "", vec![]).await;
    let a = id("a");
    h.org.start_agent(&a).await.unwrap();
    h.org.deliver("a", msg("first")).await.unwrap();
    let first = next_call(&mut calls).await;
    let m2 = h.org.deliver("a", msg("second")).await.unwrap();
    let org = h.org.clone();
    let stopping = tokio::spawn(async move { org.stop_agent(&id("a")).await });
    // The stop closes the queue at once, while the first turn still waits on the model.
    h.wait_until("the stop to begin", || {
        let running = h.org.is_running(&a);
        async move { !running }
    })
    .await;
    first.respond_text("one");
    stopping.await.unwrap().unwrap();
    assert_eq!(h.reply().await.content, "one");
    let pending = h.stores.deliveries.pending(&a).await.unwrap();
    assert_eq!(
        pending.iter().map(|e| e.id.clone()).collect::<Vec<_>>(),
        vec![m2.clone()]
    );
    h.org.start_agent(&a).await.unwrap();
    let call = next_call(&mut calls).await;
    assert_eq!(last_user_text(&call.request), "second");
    call.respond_text("two");
    assert_eq!(h.reply().await.in_reply_to, vec![m2]);
}

pub async fn after_a_steer_the_interrupted_message_waits_for_the_merged_answer(stores: Stores) {
    let (llm, mut calls) = MockLlm::pair();
    let mut h = harness(stores, Arc::new(llm), "", vec![Arc::new(EchoTool)]).await;
    let a = id("a");
    h.org.start_agent(&a).await.unwrap();
    let m1 = h.org.deliver("a", msg("first")).await.unwrap();
    let call = next_call(&mut calls).await;
    let m2 = h.org.deliver("a", msg("second")).await.unwrap();
    call.respond_tool_calls(vec![tool_call("echo", json!({"text": "1"}))]);
    // Steered to "second"; the model keeps calling tools: "first" must not steer back in.
    for round in 0..5 {
        let call = next_call(&mut calls).await;
        assert_eq!(last_user_text(&call.request), "second", "round {round}");
        call.respond_tool_calls(vec![tool_call("echo", json!({"text": "more"}))]);
    }
    let call = next_call(&mut calls).await;
    assert_eq!(last_user_text(&call.request), "second");
    call.respond_text("second answered");
    assert_eq!(h.reply().await.in_reply_to, vec![m2]);
    let call = next_call(&mut calls).await;
    assert!(last_user_text(&call.request).contains("first"));
    call.respond_text("first answered");
    assert_eq!(h.reply().await.in_reply_to, vec![m1]);
    assert_eq!(
        h.events
            .kinds()
            .iter()
            .filter(|k| matches!(k, EventKind::Steered { .. }))
            .count(),
        1
    );
}

pub async fn a_parent_and_its_child_may_always_message_each_other(stores: Stores) {
    let (llm, mut calls) = MockLlm::pair();
    let h = harness(stores, Arc::new(llm), "", vec![]).await;
    let (a, c) = (id("a"), id("c"));
    h.org.start_agent(&a).await.unwrap();
    let mut spec = ChildSpec::new("helper", "wait for instructions");
    spec.end_after_reply = false;
    let child = h.org.spawn_child(&a, spec).await.unwrap();
    // No link joins them ...
    assert!(h.org.graph().between(a.as_str(), child.as_str()).is_none());
    let first = next_call(&mut calls).await;
    assert_eq!(first.agent(), Some(&child));
    // ... yet the parent may send its child work, and the child may write to its parent.
    h.org
        .send_internal(&a, &child, InternalMessage::task("now count to 2"))
        .await
        .unwrap();
    h.org
        .send_internal(&child, &a, InternalMessage::announce("starting"))
        .await
        .unwrap();
    // An agent that is neither is refused.
    let err = h
        .org
        .send_internal(&c, &child, InternalMessage::task("x"))
        .await
        .unwrap_err();
    assert!(matches!(err, DeliveryError::Denied(_)), "{err:?}");
    first.respond_text("ready");
    // The child answers its task, the parent its message (and the child's reply), in any order.
    let child_told = |seen: &[(Option<AgentId>, String)]| {
        seen.iter()
            .any(|(agent, text)| agent.as_ref() == Some(&child) && text.contains("now count to 2"))
    };
    let parent_told = |seen: &[(Option<AgentId>, String)]| {
        seen.iter()
            .any(|(agent, text)| agent.as_ref() == Some(&a) && text.contains("starting"))
    };
    let mut seen = Vec::new();
    while !(child_told(&seen) && parent_told(&seen)) {
        assert!(seen.len() < 6, "expected calls missing: {seen:?}");
        let call = next_call(&mut calls).await;
        seen.push((call.agent().cloned(), last_user_text(&call.request)));
        call.respond_text("ok");
    }
}

pub async fn a_handed_over_delivery_stays_stored_until_it_was_processed(stores: Stores) {
    let (llm, mut calls) = MockLlm::pair();
    let mut h = harness(stores, Arc::new(llm), "", vec![]).await;
    let a = id("a");
    let envelope = h
        .org
        .deliver("a", msg("kept until answered"))
        .await
        .unwrap();
    h.org.start_agent(&a).await.unwrap();
    let call = next_call(&mut calls).await;
    // Mid-turn (a crash now would lose the in-memory queue): the store still holds it.
    let pending = h.stores.deliveries.pending(&a).await.unwrap();
    assert_eq!(
        pending.iter().map(|e| e.id.clone()).collect::<Vec<_>>(),
        vec![envelope.clone()]
    );
    call.respond_text("answered");
    assert_eq!(h.reply().await.in_reply_to, vec![envelope]);
    h.wait_until("the processed delivery removed from the store", || async {
        h.stores.deliveries.pending(&a).await.unwrap().is_empty()
    })
    .await;
}

pub async fn deliveries_to_a_stopped_agent_are_handed_over_in_order(stores: Stores) {
    let (llm, mut calls) = MockLlm::pair();
    let mut h = harness(stores, Arc::new(llm), "", vec![]).await;
    let a = id("a");
    let mut sent = Vec::new();
    for text in ["m1", "m2", "m3"] {
        sent.push(h.org.deliver("a", msg(text)).await.unwrap());
    }
    h.org.start_agent(&a).await.unwrap();
    for (text, envelope) in ["m1", "m2", "m3"].into_iter().zip(sent) {
        let call = next_call(&mut calls).await;
        assert_eq!(last_user_text(&call.request), text);
        call.respond_text(format!("re {text}"));
        assert_eq!(h.reply().await.in_reply_to, vec![envelope]);
    }
}

/// A parent whose queue is full while its children answer still gets their results: they overflow
/// to its pending deliveries and are handed over, in the order they came, once its queue runs
/// empty.
pub async fn a_parent_with_a_full_queue_gets_its_childrens_results_in_order(stores: Stores) {
    let (llm, mut calls) = MockLlm::pair();
    let mut h = harness(stores, Arc::new(llm), "queue_capacity = 1", vec![]).await;
    let a = id("a");
    h.org.start_agent(&a).await.unwrap();
    let m1 = h.org.deliver("a", msg("first")).await.unwrap();
    let first = next_call(&mut calls).await;
    let m2 = h.org.deliver("a", msg("second")).await.unwrap();
    assert!(matches!(
        h.org.deliver("a", msg("third")).await,
        Err(DeliveryError::QueueFull(_))
    ));
    for (name, word) in [("one", "alpha-result"), ("two", "beta-result")] {
        let child = h
            .org
            .spawn_child(&a, ChildSpec::new(name, "say your word"))
            .await
            .unwrap();
        let call = next_call(&mut calls).await;
        assert_eq!(call.agent(), Some(&child));
        call.respond_text(word);
        h.wait_for("the child to end", |events| {
            events
                .iter()
                .any(|e| e.agent == child && e.kind == EventKind::AgentStopped)
        })
        .await;
        assert_eq!(h.org.queue_len(&a), Some(1), "the queue keeps its bound");
    }
    first.respond_text("answer 1");
    assert_eq!(h.reply().await.in_reply_to, vec![m1]);
    let call = next_call(&mut calls).await;
    assert_eq!(last_user_text(&call.request), "second");
    call.respond_text("answer 2");
    assert_eq!(h.reply().await.in_reply_to, vec![m2]);
    for word in ["alpha-result", "beta-result"] {
        let call = next_call(&mut calls).await;
        assert_eq!(call.agent(), Some(&a));
        let text = last_user_text(&call.request);
        assert!(
            text.contains(word),
            "expected {word} next, the model saw {text:?}"
        );
        call.respond_text("noted");
        assert_eq!(h.reply().await.agent, a);
    }
}

/// Delivers a new user message to agent `a` on each of its first `max` calls, so the turn that
/// called it is steered at the next checkpoint.
#[derive(Debug)]
struct SteerTool {
    org: std::sync::OnceLock<spacebot::Organization>,
    calls: std::sync::atomic::AtomicUsize,
    max: usize,
}

#[async_trait::async_trait]
impl spacebot::Tool for SteerTool {
    fn definition(&self) -> spacebot::ToolDefinition {
        spacebot::ToolDefinition::new("steer", "Steers.", json!({"type": "object"}))
    }
    async fn call(
        &self,
        _ctx: &spacebot::ToolContext,
        _args: serde_json::Value,
    ) -> Result<spacebot::ToolOutput, spacebot::ToolError> {
        let n = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if n < self.max {
            let org = self.org.get().expect("the organization is set");
            org.deliver("a", msg(&format!("steer {n}")))
                .await
                .map_err(|e| spacebot::ToolError::failed("steer", e.to_string()))?;
        }
        Ok(spacebot::ToolOutput::text("steered"))
    }
}

/// Each steer gives the steering message a fresh round budget, but a turn producers keep steering
/// takes four times `max_tool_rounds` in all, then stops.
pub async fn a_turn_kept_steered_stops_at_four_times_the_round_limit(stores: Stores) {
    let llm = Arc::new(spacebot::testing::FnLlm::new(|_| {
        Ok(ChatResponse::tool_calls(vec![tool_call(
            "steer",
            json!({}),
        )]))
    }));
    let steer = Arc::new(SteerTool {
        org: std::sync::OnceLock::new(),
        calls: std::sync::atomic::AtomicUsize::new(0),
        max: 12,
    });
    let mut h = harness(stores, llm, "max_tool_rounds = 2", vec![steer.clone()]).await;
    steer.org.set(h.org.clone()).unwrap();
    h.org.start_agent(&id("a")).await.unwrap();
    h.org.deliver("a", msg("go")).await.unwrap();
    h.wait_count("the round limit", 1, |k| {
        matches!(k, EventKind::RoundLimitReached { .. })
    })
    .await;
    let kinds = h.events.kinds();
    let first_limit = kinds
        .iter()
        .position(|k| matches!(k, EventKind::RoundLimitReached { .. }))
        .unwrap();
    let rounds = kinds[..first_limit]
        .iter()
        .filter(|k| matches!(k, EventKind::ToolCalled { .. }))
        .count();
    assert_eq!(rounds, 2 * 4, "the steered turn's rounds");
    assert!(
        kinds[..first_limit]
            .iter()
            .filter(|k| matches!(k, EventKind::Steered { .. }))
            .count()
            >= 2,
        "the turn was steered: {kinds:?}"
    );
    assert!(h.reply().await.is_failure());
    // The messages that arrived meanwhile are answered by turns of their own (each failing at
    // the round limit, as the model only ever calls the tool).
    h.wait_quiet().await;
}
