//! Governance, as a property: over random delegation trees, parallel workers, steering messages
//! and limits, spend never passes any limit and every request ends.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use proptest::prelude::*;
use serde_json::json;
use spacebot::limits::{Limits, estimate_input};
use spacebot::llm::{ChatResponse, Usage};
use spacebot::testing::{OrgHarness, last_user_text, tool_call};
use spacebot::{ChatRequest, EnvelopeId, InboundMessage, LlmError, LlmProvider, Stores};

/// One generated organization and what happens to it.
#[derive(Debug, Clone)]
pub struct Case {
    /// The parent of agent `i + 1` (agent 0 is the root): an index below `i + 1`.
    parents: Vec<usize>,
    /// Prompt tokens each call reports, as a share (percent) of the runtime's estimate.
    prompt_share: u64,
    /// Completion tokens each call reports (capped by the call's `max_tokens`).
    completion: u32,
    /// The limits of every request.
    limits: Limits,
    /// A second message to the root right after the first (it steers the running turn or waits).
    steer: bool,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(0usize..100, 0..6),
        20u64..=100,
        1u32..200,
        prop::option::of(300u64..6_000),
        prop::option::of(1u64..10),
        prop::option::of(1u64..8),
        any::<bool>(),
    )
        .prop_map(
            |(raw, prompt_share, completion, total, calls, tools, steer)| Case {
                parents: raw.iter().enumerate().map(|(i, r)| r % (i + 1)).collect(),
                prompt_share,
                completion,
                limits: Limits {
                    total_tokens: total,
                    model_calls: calls,
                    tool_calls: tools,
                    ..Limits::NONE
                },
                steer,
            },
        )
}

impl Case {
    fn config(&self) -> String {
        let n = self.parents.len() + 1;
        let mut out = String::from("[settings]\nmax_delegation_depth = 8\n");
        for i in 0..n {
            out.push_str(&format!("[[agents]]\nid = \"a{i}\"\n"));
        }
        for (i, p) in self.parents.iter().enumerate() {
            out.push_str(&format!(
                "[[links]]\nfrom = \"a{p}\"\nto = \"a{}\"\nrelationship = \"superior\"\n",
                i + 1
            ));
        }
        out
    }

    fn children(&self, agent: usize) -> Vec<usize> {
        (0..self.parents.len())
            .filter(|&i| self.parents[i] == agent)
            .map(|i| i + 1)
            .collect()
    }
}

/// Delegates to every child at once on a fresh message, answers once woken (or when a leaf);
/// reports usage as the case says, never above the estimate and `max_tokens`.
#[derive(Debug)]
struct Model {
    case: Case,
    reported: Mutex<u64>,
}

#[async_trait]
impl LlmProvider for Model {
    async fn complete(&self, request: ChatRequest) -> Result<ChatResponse, LlmError> {
        let me: usize = request
            .agent
            .as_ref()
            .and_then(|a| a.as_str().strip_prefix('a'))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        let text = last_user_text(&request.messages);
        let children = self.case.children(me);
        let mut response =
            if children.is_empty() || text.contains("have ended") || text.contains("task #") {
                ChatResponse::text(format!("a{me} done"))
            } else {
                ChatResponse::tool_calls(
                    children
                        .iter()
                        .map(|c| {
                            tool_call(
                                "send_agent_message",
                                json!({"target": format!("a{c}"), "message": "your part"}),
                            )
                        })
                        .collect(),
                )
            };
        let prompt = estimate_input(&request) * self.case.prompt_share / 100;
        let prompt = u32::try_from(prompt).unwrap();
        let completion = request
            .max_tokens
            .map_or(self.case.completion, |m| m.min(self.case.completion));
        response.usage = Some(Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
        });
        *self.reported.lock().unwrap() += u64::from(prompt + completion);
        Ok(response)
    }
}

async fn run(case: Case) -> Result<(), TestCaseError> {
    let stores = Stores::memory();
    let model = Arc::new(Model {
        case: case.clone(),
        reported: Mutex::new(0),
    });
    let mut h = OrgHarness::builder(case.config())
        .stores(stores.clone())
        .llm(model.clone())
        .build()
        .await;
    h.org.start_all().await.unwrap();
    let mut requests: Vec<EnvelopeId> = Vec::new();
    let messages = if case.steer { 2 } else { 1 };
    for i in 0..messages {
        let message =
            InboundMessage::new("portal", "u1", format!("request {i}")).with_limits(case.limits);
        requests.push(h.org.deliver("a0", message).await.unwrap());
    }
    // Every request ends: the user hears back, then everything it caused ends: no task is left
    // open on any board, nothing waits to be run; a limit's failure is told at most once per
    // request.
    let first = h.reply().await;
    h.wait_quiet().await;
    let mut replies = vec![first];
    replies.extend(h.replies_now());
    let failures = replies
        .iter()
        .filter(|r| r.kind == spacebot::ReplyKind::Failure)
        .count();
    prop_assert!(failures <= requests.len(), "{replies:?}");
    for i in 0..=case.parents.len() {
        for task in h.board(&format!("a{i}")).await {
            prop_assert!(task.status.is_terminal(), "left open: {task:?}");
        }
    }
    let mut settled = 0;
    for request in &requests {
        let Some(entry) = h.org.request_spend(request).await.unwrap() else {
            continue;
        };
        prop_assert!(entry.reserved.is_empty(), "{:?}", entry.reserved);
        let s = entry.settled;
        let l = case.limits;
        prop_assert!(
            l.total_tokens.is_none_or(|m| s.total_tokens <= m),
            "{s:?} {l:?}"
        );
        prop_assert!(
            l.model_calls.is_none_or(|m| s.model_calls <= m),
            "{s:?} {l:?}"
        );
        prop_assert!(
            l.tool_calls.is_none_or(|m| s.tool_calls <= m),
            "{s:?} {l:?}"
        );
        settled += s.total_tokens;
    }
    // Exact sums: what the model reported is what the requests were charged.
    if !case.limits.is_none() {
        prop_assert_eq!(settled, *model.reported.lock().unwrap());
    }
    h.org.shutdown().await.unwrap();
    Ok(())
}

/// 256 random cases (`PROPTEST_CASES` sets another count).
pub fn random_trees_never_overspend_and_always_end() {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(256);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    runner.run(&case(), |case| rt.block_on(run(case))).unwrap();
}
