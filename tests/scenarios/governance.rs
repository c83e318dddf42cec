//! Governance: a request's limits bind across its whole delegation tree, across a restart, and the
//! user is told once.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: failing loudly is the point

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use serde_json::json;
use spacebot::event::EventKind;
use spacebot::limits::{Limit, Limits, RequestLedger, estimate_input};
use spacebot::llm::{ChatResponse, Usage};
use spacebot::testing::{OrgHarness, last_user_text, tool_call};
use spacebot::{AgentId, ChatRequest, InboundMessage, LlmError, LlmProvider, ReplyKind, Stores};

/// A chief, a lead under it, three workers under the lead.
const TREE: &str = r#"
[[agents]]
id = "chief"
name = "Chief"
[[agents]]
id = "lead"
name = "Lead"
[[agents]]
id = "w1"
name = "Worker One"
[[agents]]
id = "w2"
name = "Worker Two"
[[agents]]
id = "w3"
name = "Worker Three"
[[links]]
from = "chief"
to = "lead"
relationship = "superior"
[[links]]
from = "lead"
to = "w1"
relationship = "superior"
[[links]]
from = "lead"
to = "w2"
relationship = "superior"
[[links]]
from = "lead"
to = "w3"
relationship = "superior"
"#;

/// The tree's script: the chief delegates to the lead, the lead fans out to the three workers,
/// each worker answers, the lead sums up, the chief answers the user. Every call reports its
/// prompt's tokens (about a quarter of its bytes) and 40 completion tokens (fewer when the call's
/// `max_tokens` says so, as a provider would); the model counts what it reported.
#[derive(Debug, Default)]
struct Tree {
    reported: AtomicU64,
    calls: AtomicU64,
}

#[async_trait]
impl LlmProvider for Tree {
    async fn complete(&self, request: ChatRequest) -> Result<ChatResponse, LlmError> {
        let me = request.agent.as_ref().map(AgentId::as_str).unwrap_or("");
        let text = last_user_text(&request.messages);
        let mut response = match me {
            "chief" if text.contains("have ended") || text.contains("task #") => {
                ChatResponse::text("The launch plan is ready.")
            }
            "chief" => ChatResponse::tool_calls(vec![tool_call(
                "send_agent_message",
                json!({"target": "lead", "message": "Plan the launch."}),
            )]),
            "lead" if text.contains("have ended") => ChatResponse::text("Plan: w1, w2, w3 done."),
            "lead" => ChatResponse::tool_calls(
                ["w1", "w2", "w3"]
                    .iter()
                    .map(|w| {
                        tool_call(
                            "send_agent_message",
                            json!({"target": w, "message": format!("Do part {w}.")}),
                        )
                    })
                    .collect(),
            ),
            _ => ChatResponse::text("part done"),
        };
        // A tokenizer's count: about four bytes a token (the runtime's estimate, a third of the
        // bytes, is above it, as an estimate must be).
        let prompt = u32::try_from(estimate_input(&request) * 3 / 4).unwrap();
        let completion = request.max_tokens.map_or(40, |m| m.min(40));
        let usage = Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
        };
        self.reported
            .fetch_add(u64::from(usage.total_tokens), Ordering::SeqCst);
        self.calls.fetch_add(1, Ordering::SeqCst);
        response.usage = Some(usage);
        Ok(response)
    }
}

fn limited(limits: &str) -> String {
    format!("[settings.limits]\n{limits}\n{TREE}")
}

/// The whole tree costs 7 calls of about 1,100 tokens each. Under a limit of 5,000 total tokens
/// some of its calls are refused: the request spends at most 5,000 in all (what the model reported, to
/// the token, is what the ledger settled), the refusal is an event naming the limit, and the user
/// gets exactly one failure reply naming it and what was spent.
pub async fn a_fanned_out_request_spends_at_most_its_token_limit(stores: Stores) {
    let llm = Arc::new(Tree::default());
    let mut h = OrgHarness::builder(limited("total_tokens = 5000"))
        .stores(stores.clone())
        .llm(llm.clone())
        .build()
        .await;
    h.org.start_all().await.unwrap();
    let request = h
        .org
        .deliver("chief", InboundMessage::new("portal", "u1", "launch plan"))
        .await
        .unwrap();
    let reply = h.reply().await;
    assert_eq!(reply.kind, ReplyKind::Failure, "{reply:?}");
    assert!(
        reply.content.contains("total tokens") && reply.content.contains("spent"),
        "{}",
        reply.content
    );
    h.wait_quiet().await;

    let entry = RequestLedger::new(stores.records.clone())
        .get(&request)
        .await
        .unwrap()
        .expect("the request's spend is stored");
    let reported = llm.reported.load(Ordering::SeqCst);
    assert_eq!(entry.settled.total_tokens, reported, "exact sums");
    assert_eq!(entry.settled.model_calls, llm.calls.load(Ordering::SeqCst));
    assert!(reported <= 5_000, "spent {reported} under a limit of 5000");
    assert!(reported > 0, "some calls were made: {entry:?}");
    assert!(entry.reserved.is_empty(), "{:?}", entry.reserved);
    assert_eq!(
        entry.reached.as_ref().map(|r| r.over.limit),
        Some(Limit::TotalTokens)
    );
    let refusals = h
        .events
        .events()
        .iter()
        .filter(|e| matches!(&e.kind, EventKind::LimitReached { request: r, .. } if r == &request))
        .count();
    assert!(refusals >= 1);
    // Told once: once everything the request caused has ended, no second reply came.
    let more = h.replies_now();
    assert!(more.is_empty(), "told more than once: {more:?}");
}

/// Without a limit the same tree runs to its answer, and nothing is written to the ledger.
pub async fn without_limits_the_tree_runs_and_nothing_is_recorded(stores: Stores) {
    let llm = Arc::new(Tree::default());
    let mut h = OrgHarness::builder(TREE)
        .stores(stores.clone())
        .llm(llm.clone())
        .build()
        .await;
    h.org.start_all().await.unwrap();
    let request = h
        .org
        .deliver("chief", InboundMessage::new("portal", "u1", "launch plan"))
        .await
        .unwrap();
    let reply = h.reply().await;
    assert_eq!(reply.content, "The launch plan is ready.");
    assert_eq!(llm.calls.load(Ordering::SeqCst), 7);
    let ledger = RequestLedger::new(stores.records.clone());
    assert!(ledger.get(&request).await.unwrap().is_none());
}

/// A message's own limit binds its whole tree across a restart: the first run spends one of its
/// 3 model calls (the chief delegates; the lead is not running), the second run, on the same
/// stores and with no limit in its configuration, may make only the 2 left (the lead's fan-out and
/// one worker's answer; forgotten, the tree would make 6 more), and the user is told once.
pub async fn a_message_limit_holds_across_a_restart(stores: Stores) {
    let llm = Arc::new(Tree::default());
    let h = OrgHarness::builder(TREE)
        .stores(stores.clone())
        .llm(llm.clone())
        .build()
        .await;
    h.org
        .start_agent(&AgentId::parse("chief").unwrap())
        .await
        .unwrap();
    let limits = Limits {
        model_calls: Some(3),
        ..Limits::NONE
    };
    let request = h
        .org
        .deliver(
            "chief",
            InboundMessage::new("portal", "u1", "launch plan").with_limits(limits),
        )
        .await
        .unwrap();
    h.wait_idle("chief").await;
    assert_eq!(llm.calls.load(Ordering::SeqCst), 1, "the chief delegated");
    h.org.shutdown().await.unwrap();
    drop(h);

    let ledger = RequestLedger::new(stores.records.clone());
    let before = ledger.get(&request).await.unwrap().unwrap();
    assert_eq!(before.settled.model_calls, 1);
    assert_eq!(before.limits.model_calls, Some(3));

    let llm2 = Arc::new(Tree::default());
    let mut h2 = OrgHarness::builder(TREE)
        .stores(stores.clone())
        .llm(llm2.clone())
        .build()
        .await;
    h2.org.start_all().await.unwrap();
    let reply = h2.reply().await;
    assert_eq!(reply.kind, ReplyKind::Failure, "{reply:?}");
    assert!(reply.content.contains("model calls"), "{}", reply.content);
    h2.wait_quiet().await;
    assert_eq!(
        llm2.calls.load(Ordering::SeqCst),
        2,
        "after the restart only the 2 calls left were made"
    );
    let after = ledger.get(&request).await.unwrap().unwrap();
    assert_eq!(after.settled.model_calls, 3, "{:?}", after.settled);
    assert!(after.reserved.is_empty(), "{:?}", after.reserved);
    let more = h2.replies_now();
    assert!(more.is_empty(), "told more than once: {more:?}");
}
