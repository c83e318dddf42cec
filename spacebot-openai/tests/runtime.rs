//! The provider inside a running organization, against the local fixture server (127.0.0.1): a
//! failed turn is told to the application, a streaming outbound gets the answer as it streams,
//! and token usage is summed across a two-hop delegation.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use spacebot_core::runtime::{OutboundItem, StreamingOutbound};
use spacebot_core::testing::OrgHarness;
use spacebot_core::{AgentId, InboundMessage, Stores, TaskRef};
use spacebot_openai::{OpenAiConfig, OpenAiProvider, RetryPolicy};
use support::{FixtureServer, Reply, TestClock};

const ONE: &str = "[[agents]]\nid = \"a\"\nname = \"Alpha\"\n";

fn provider(server: &FixtureServer, stream: bool) -> Arc<OpenAiProvider> {
    let config = OpenAiConfig::new("gpt-4o-mini")
        .with_base_url(server.base_url.clone())
        .with_api_key("sk-test-key")
        .with_retry(RetryPolicy::default().with_max_retries(0));
    let config = if stream {
        config.with_stream_completions(true)
    } else {
        config
    };
    let clock = TestClock::new(Duration::from_secs(10));
    Arc::new(OpenAiProvider::new(config, Arc::new(clock)).unwrap())
}

/// A completion body with `content` or one tool call, and `tokens` of usage.
fn completion(
    content: Option<&str>,
    call: Option<(&str, serde_json::Value)>,
    tokens: u32,
) -> Reply {
    let message = match (content, call) {
        (_, Some((name, args))) => serde_json::json!({
            "role": "assistant", "content": null,
            "tool_calls": [{"id": format!("call_{tokens}"), "type": "function",
                            "function": {"name": name, "arguments": args.to_string()}}]
        }),
        (text, None) => serde_json::json!({"role": "assistant", "content": text.unwrap_or("")}),
    };
    let body = serde_json::json!({
        "id": format!("chatcmpl-{tokens}"), "object": "chat.completion", "created": 1,
        "model": "gpt-4o-mini",
        "choices": [{"index": 0, "message": message, "logprobs": null,
                     "finish_reason": if message.get("tool_calls").is_some() { "tool_calls" } else { "stop" }}],
        "usage": {"prompt_tokens": tokens - 1, "completion_tokens": 1, "total_tokens": tokens}
    });
    Reply::raw(200, &body.to_string()).header("content-type", "application/json")
}

#[tokio::test]
async fn a_failed_turn_reaches_the_outbound_as_a_failure_reply() {
    let server = FixtureServer::start(vec![Reply::status_json(401, "openai/error_401.json")]).await;
    let mut h = OrgHarness::builder(ONE)
        .stores(Stores::memory())
        .llm(provider(&server, false))
        .build()
        .await;
    h.org.start_all().await.unwrap();
    let id = h
        .org
        .deliver("a", InboundMessage::new("portal", "u1", "hi"))
        .await
        .unwrap();
    let reply = h.reply().await;
    assert!(reply.is_failure(), "{reply:?}");
    assert_eq!(reply.in_reply_to, vec![id]);
    assert!(
        reply
            .content
            .starts_with("the agent could not answer: authentication failed"),
        "{}",
        reply.content
    );
}

#[tokio::test]
async fn a_streaming_outbound_gets_the_server_stream_in_order_then_the_reply() {
    let server = FixtureServer::start(vec![Reply::sse("openai/stream_text.sse")]).await;
    let (outbound, mut items) = StreamingOutbound::new();
    let h = OrgHarness::builder(ONE)
        .stores(Stores::memory())
        .llm(provider(&server, false))
        .outbound(Arc::new(outbound))
        .build()
        .await;
    h.org.start_all().await.unwrap();
    h.org
        .deliver("a", InboundMessage::new("portal", "u1", "capital?"))
        .await
        .unwrap();
    let mut deltas = Vec::new();
    let reply = loop {
        match tokio::time::timeout(Duration::from_secs(10), items.next())
            .await
            .expect("an item within 10 s")
            .expect("open")
        {
            OutboundItem::Delta(d) => deltas.push(d),
            OutboundItem::Reply(r) => break r,
            other => panic!("unexpected {other:?}"),
        }
    };
    let texts: Vec<&str> = deltas.iter().map(|d| d.text.as_str()).collect();
    assert_eq!(
        texts,
        ["The", " capital", " of", " France", " is", " Paris", "."]
    );
    assert!(deltas.iter().enumerate().all(|(i, d)| d.seq == i as u64));
    assert_eq!(reply.content, "The capital of France is Paris.");
    // The request asked the server to stream.
    assert_eq!(server.only_body()["stream"], serde_json::json!(true));
}

const CHAIN: &str = r#"
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
relationship = "superior"
[[links]]
from = "b"
to = "c"
relationship = "superior"
"#;

#[tokio::test]
async fn usage_reported_by_the_server_is_summed_across_a_two_hop_delegation() {
    // The calls come one after another: a delegates, b delegates, c answers, b answers, a answers.
    let server = FixtureServer::start(vec![
        completion(
            None,
            Some((
                "send_agent_message",
                serde_json::json!({"target": "b", "message": "Ask Gamma."}),
            )),
            10,
        ),
        completion(
            None,
            Some((
                "send_agent_message",
                serde_json::json!({"target": "c", "message": "Pick a word."}),
            )),
            20,
        ),
        completion(Some("lantern"), None, 30),
        completion(Some("Gamma says lantern"), None, 40),
        completion(Some("The word is lantern."), None, 50),
    ])
    .await;
    let mut h = OrgHarness::builder(CHAIN)
        .stores(Stores::memory())
        .llm(provider(&server, false))
        .build()
        .await;
    h.org.start_all().await.unwrap();
    h.org
        .deliver("a", InboundMessage::new("portal", "u1", "a word"))
        .await
        .unwrap();
    assert_eq!(h.reply().await.content, "The word is lantern.");
    let a = AgentId::parse("a").unwrap();
    tokio::time::timeout(Duration::from_secs(10), h.org.wait_idle(&a))
        .await
        .unwrap()
        .unwrap();
    let b_task = TaskRef::new(AgentId::parse("b").unwrap(), 1);
    let c_task = TaskRef::new(AgentId::parse("c").unwrap(), 1);
    assert_eq!(h.org.task_usage(&c_task).await.unwrap().total_tokens, 30);
    assert_eq!(
        h.org.task_usage(&b_task).await.unwrap().total_tokens,
        20 + 40 + 30
    );
    assert_eq!(h.org.usage(&a).total_tokens, 10 + 50);
}
