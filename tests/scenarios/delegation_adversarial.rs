//! Adversarial models: one that re-delegates on every result, and three that delegate in a
//! circle. Both end, with clear errors, within the limits.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: failing loudly is the point

use std::sync::Arc;
use std::time::Duration;

use super::support::{delegation::*, *};
use serde_json::json;
use spacebot::event::EventKind;
use spacebot::testing::{FnLlm, tool_call};
use spacebot::{ChatResponse, TaskStatus};

/// Waits until every task on every board is terminal and the organization is quiet (every agent
/// idle, nothing waiting in the stores); fails after 30 s.
async fn quiesce(h: &mut Harness) {
    h.timeout = Duration::from_secs(30);
    h.wait_until("every task ended", || async {
        let mut all_ended = true;
        for agent in ["a", "b", "c", "d", "e"] {
            all_ended &= h.board(agent).await.iter().all(|t| t.status.is_terminal());
        }
        all_ended
    })
    .await;
    h.wait_quiet().await;
}

pub async fn a_model_that_re_delegates_on_every_result_stops_at_the_round_limit(stores: Stores) {
    // max_delegation_depth 3: the round limit is 6.
    let llm = FnLlm::new(|req| {
        Ok(match req.agent.as_ref().map(|a| a.as_str()) {
            Some("a") => ChatResponse::tool_calls(vec![tool_call(
                "send_agent_message",
                json!({"target": "b", "message": "Check it once more."}),
            )]),
            _ => ChatResponse::text("checked"),
        })
    });
    let mut h = harness(
        stores,
        Arc::new(llm.clone()),
        "max_delegation_depth = 3\nmax_tool_rounds = 4",
    )
    .await;
    h.org.deliver("a", user("check it")).await.unwrap();
    quiesce(&mut h).await;

    let board = h.board("b").await;
    assert_eq!(board.len(), 6, "one task per round, rounds 0 to 5");
    assert!(board.iter().all(|t| t.status == TaskStatus::Done));
    // The seventh delegation was refused with a message telling the model what to do, and the
    // turn that kept insisting was stopped by the tool-round limit.
    let refused: Vec<String> = llm
        .requests_for(&id("a"))
        .iter()
        .flat_map(tool_results)
        .filter(|r| r.contains("delegated 6 times in a row"))
        .collect();
    assert!(!refused.is_empty());
    assert!(
        refused[0].contains("answer with what you have instead of delegating again"),
        "{}",
        refused[0]
    );
    assert_eq!(
        h.count(|k| matches!(k, EventKind::RoundLimitReached { limit: 4 })),
        1
    );
    // Bounded work: 6 delegating turns + 4 calls in the last one; 6 task turns for b.
    assert_eq!(llm.requests_for(&id("a")).len(), 6 + 4);
    assert_eq!(llm.requests_for(&id("b")).len(), 6);
}

pub async fn three_models_delegating_in_a_circle_end_with_cycle_errors(stores: Stores) {
    let llm = FnLlm::new(|req| {
        let next = match req.agent.as_ref().map(|a| a.as_str()) {
            Some("a") => "b",
            Some("b") => "c",
            _ => "a",
        };
        Ok(ChatResponse::tool_calls(vec![tool_call(
            "send_agent_message",
            json!({"target": next, "message": "You handle it."}),
        )]))
    });
    let mut h = harness(
        stores,
        Arc::new(llm.clone()),
        "max_delegation_depth = 3\nmax_tool_rounds = 2",
    )
    .await;
    h.org.deliver("a", user("handle it")).await.unwrap();
    quiesce(&mut h).await;

    // a never got a task: every attempt to close the circle was refused.
    assert!(h.board("a").await.is_empty());
    let c_results: Vec<String> = llm
        .requests_for(&id("c"))
        .iter()
        .flat_map(tool_results)
        .collect();
    assert!(!c_results.is_empty());
    assert!(
        c_results
            .iter()
            .all(|r| r.contains("already in the delegation chain a -> b -> c")),
        "{c_results:?}"
    );
    // Every task ended, c's in failure (its worker could only fail).
    let c_board = h.board("c").await;
    assert!(!c_board.is_empty());
    assert!(
        c_board
            .iter()
            .all(|t| t.status == TaskStatus::Failed && t.attempts == 3)
    );
    let b_board = h.board("b").await;
    assert!(!b_board.is_empty());
    assert!(b_board.iter().all(|t| t.status.is_terminal()));
    // The limits bound the work: at most 6 rounds of a's delegations, each b task re-delegating
    // at most 6 times.
    assert!(b_board.len() <= 6, "{} tasks on b's board", b_board.len());
    assert!(c_board.len() <= 6 * b_board.len());
    for t in &b_board {
        assert!(t.metadata.children.len() <= 6, "{t:?}");
    }
    // Nothing left undelivered.
    for agent in ["a", "b", "c"] {
        assert!(
            h.stores
                .tasks
                .outbox_pending(&id(agent))
                .await
                .unwrap()
                .is_empty()
        );
    }
}
