//! The provider inside a running organization, against the local fixture server (127.0.0.1): a
//! failed turn is told to the application, a streaming outbound gets the answer as it streams,
//! and token usage is summed across a two-hop delegation.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use spacebot_core::runtime::Reply as OutboundReply;
use spacebot_core::runtime::{OutboundItem, StreamingOutbound};
use spacebot_core::testing::OrgHarness;
use spacebot_core::{AgentId, InboundMessage, RecordKind, Stores, TaskRef, TaskStatus};
use spacebot_openai::{Dialect, OpenAiConfig, OpenAiProvider, RetryPolicy};
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

/// A provider on the llama.cpp dialect (requests with tools are never streamed) that does not
/// retry.
fn llama_provider(server: &FixtureServer) -> Arc<OpenAiProvider> {
    let config = OpenAiConfig::new("smollm2")
        .with_base_url(server.base_url.clone())
        .with_dialect(Dialect::llama_cpp())
        .with_retry(RetryPolicy::default().with_max_retries(0));
    let clock = TestClock::new(Duration::from_secs(10));
    Arc::new(OpenAiProvider::new(config, Arc::new(clock)).unwrap())
}

/// The next reply on a streaming outbound (deltas skipped).
async fn next_reply(
    items: &mut (impl futures::Stream<Item = OutboundItem> + Unpin),
) -> OutboundReply {
    loop {
        match tokio::time::timeout(Duration::from_secs(10), items.next())
            .await
            .expect("an item within 10 s")
            .expect("open")
        {
            OutboundItem::Delta(_) => {}
            OutboundItem::Reply(r) => break r,
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_streaming_outbound_and_tools_on_a_server_that_cannot_stream_them() {
    // llama-cpp-python: a streamed request with tools gets HTTP 200 and an empty stream. Every
    // model call of the turn offers tools; none may stream.
    let server = FixtureServer::start(vec![
        completion(
            None,
            Some(("get_weather", serde_json::json!({"city": "Paris"}))),
            10,
        )
        .unless_streamed_with_tools(),
        completion(Some("I cannot check the weather."), None, 20).unless_streamed_with_tools(),
    ])
    .await;
    let (outbound, mut items) = StreamingOutbound::new();
    let h = OrgHarness::builder(CHAIN)
        .stores(Stores::memory())
        .llm(llama_provider(&server))
        .outbound(Arc::new(outbound))
        .build()
        .await;
    h.org.start_all().await.unwrap();
    h.org
        .deliver(
            "a",
            InboundMessage::new("portal", "u1", "weather in Paris?"),
        )
        .await
        .unwrap();
    let reply = next_reply(&mut items).await;
    assert!(!reply.is_failure(), "{reply:?}");
    assert_eq!(reply.content, "I cannot check the weather.");
    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    for r in &requests {
        assert!(!r.body["tools"].as_array().unwrap().is_empty());
        assert!(r.body.get("stream").is_none(), "{}", r.body);
    }
}

#[tokio::test]
async fn an_empty_answer_is_asked_again_once() {
    let server = FixtureServer::start(vec![
        Reply::json("compat/llamacpp_python_empty_answer.json"),
        completion(Some("Hello."), None, 5),
    ])
    .await;
    let mut h = OrgHarness::builder(ONE)
        .stores(Stores::memory())
        .llm(llama_provider(&server))
        .build()
        .await;
    h.org.start_all().await.unwrap();
    h.org
        .deliver("a", InboundMessage::new("portal", "u1", "hi"))
        .await
        .unwrap();
    let reply = h.reply().await;
    assert!(!reply.is_failure(), "{reply:?}");
    assert_eq!(reply.content, "Hello.");
    assert_eq!(server.count(), 2);
}

#[tokio::test]
async fn two_empty_answers_are_a_failure_reply_not_an_answer() {
    let server = FixtureServer::start(vec![
        Reply::json("compat/llamacpp_python_empty_answer.json"),
        Reply::json("compat/llamacpp_python_empty_answer.json"),
        completion(Some("never asked"), None, 5),
    ])
    .await;
    let mut h = OrgHarness::builder(ONE)
        .stores(Stores::memory())
        .llm(llama_provider(&server))
        .build()
        .await;
    h.org.start_all().await.unwrap();
    h.org
        .deliver("a", InboundMessage::new("portal", "u1", "hi"))
        .await
        .unwrap();
    let reply = h.reply().await;
    assert!(reply.is_failure(), "{reply:?}");
    assert!(reply.content.contains("empty answer"), "{}", reply.content);
    assert_eq!(server.count(), 2);
}

#[tokio::test]
async fn a_task_answered_empty_fails_with_that_reason_instead_of_done() {
    let mut replies = vec![completion(
        None,
        Some((
            "send_agent_message",
            serde_json::json!({"target": "b", "message": "Pick a word."}),
        )),
        10,
    )];
    // Every attempt of b's task: an empty answer, asked again, empty again.
    replies.extend((0..6).map(|_| Reply::json("compat/llamacpp_python_empty_answer.json")));
    replies.push(completion(Some("Beta could not pick a word."), None, 30));
    let server = FixtureServer::start(replies).await;
    let mut h = OrgHarness::builder(CHAIN)
        .stores(Stores::memory())
        .llm(llama_provider(&server))
        .build()
        .await;
    h.org.start_all().await.unwrap();
    h.org
        .deliver("a", InboundMessage::new("portal", "u1", "a word"))
        .await
        .unwrap();
    let reply = h.reply().await;
    assert_eq!(reply.content, "Beta could not pick a word.");
    let task = h
        .org
        .task(&TaskRef::new(AgentId::parse("b").unwrap(), 1))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(task.status, TaskStatus::Failed, "{task:?}");
    assert!(task.result.is_none(), "{task:?}");
    assert!(
        task.error
            .as_deref()
            .unwrap_or_default()
            .contains("empty answer"),
        "{task:?}"
    );
}

#[tokio::test]
async fn a_failed_turn_leaves_a_system_notice_without_url_or_secret() {
    let server = FixtureServer::start(vec![
        Reply::raw(
            502,
            "upstream http://10.9.8.7:9000/v1/chat?api-key=sk-live-0123456789abcdef failed; \
             Authorization: Bearer sk-live-0123456789abcdef",
        ),
        completion(Some("Sorry about that."), None, 5),
    ])
    .await;
    let mut h = OrgHarness::builder(ONE)
        .stores(Stores::memory())
        .llm(provider(&server, false))
        .build()
        .await;
    h.org.start_all().await.unwrap();
    h.org
        .deliver("a", InboundMessage::new("portal", "u1", "hi"))
        .await
        .unwrap();
    let failed = h.reply().await;
    assert!(failed.is_failure(), "{failed:?}");
    for secret in ["10.9.8.7", "sk-live", "http://"] {
        assert!(!failed.content.contains(secret), "{}", failed.content);
    }
    assert!(failed.content.contains("HTTP 502"), "{}", failed.content);
    h.org
        .deliver("a", InboundMessage::new("portal", "u1", "again?"))
        .await
        .unwrap();
    assert_eq!(h.reply().await.content, "Sorry about that.");
    // The second turn's history holds the notice as a system message, without the secrets.
    let body = &server.requests()[1].body;
    let messages = body["messages"].as_array().unwrap();
    let notice: Vec<&serde_json::Value> = messages
        .iter()
        .filter(|m| m["content"].as_str().unwrap_or("").contains("turn failed"))
        .collect();
    assert_eq!(notice.len(), 1, "{body}");
    assert_eq!(notice[0]["role"], "system");
    let text = body.to_string();
    for secret in ["10.9.8.7", "sk-live", "http://"] {
        assert!(!text.contains(secret), "{text}");
    }
    assert!(
        messages
            .iter()
            .filter(|m| m["role"] == "user")
            .all(|m| !m["content"].as_str().unwrap_or("").contains("[system]")),
        "{body}"
    );
}

#[tokio::test]
async fn a_transport_failure_reply_names_no_url() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let config = OpenAiConfig::new("m")
        .with_base_url(format!("http://{addr}/v1"))
        .with_retry(RetryPolicy::none());
    let clock = TestClock::new(Duration::from_secs(10));
    let llm = Arc::new(OpenAiProvider::new(config, Arc::new(clock)).unwrap());
    let mut h = OrgHarness::builder(ONE)
        .stores(Stores::memory())
        .llm(llm)
        .build()
        .await;
    h.org.start_all().await.unwrap();
    h.org
        .deliver("a", InboundMessage::new("portal", "u1", "hi"))
        .await
        .unwrap();
    let reply = h.reply().await;
    assert!(reply.is_failure(), "{reply:?}");
    assert!(
        reply
            .content
            .starts_with("the agent could not answer: transport error"),
        "{}",
        reply.content
    );
    assert!(!reply.content.contains("http://"), "{}", reply.content);
    assert!(
        !reply.content.contains(&addr.to_string()),
        "{}",
        reply.content
    );
    let a = AgentId::parse("a").unwrap();
    tokio::time::timeout(Duration::from_secs(10), h.org.wait_idle(&a))
        .await
        .unwrap()
        .unwrap();
    let history = h.history("a", &reply.channel).await;
    let notice = history
        .iter()
        .find(|r| r.record.kind == RecordKind::System)
        .expect("a notice");
    assert!(
        notice
            .record
            .content
            .starts_with("turn failed: transport error")
    );
    assert!(!notice.record.content.contains("http://"));
}

/// The server's answer when a prompt is over its window (OpenAI's error body).
fn context_length_exceeded() -> Reply {
    Reply::raw(
        400,
        r#"{"error":{"message":"This model's maximum context length is 4000 tokens. However, your messages resulted in 4711 tokens.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}"#,
    )
    .header("content-type", "application/json")
}

/// A provider for a model OpenAI's tokenizer does not know: the runtime counts with its estimate
/// (a third of the bytes), so the notes below are over half the window whatever the tokenizer.
fn estimated_provider(server: &FixtureServer) -> Arc<OpenAiProvider> {
    let config = OpenAiConfig::new("fixture-model")
        .with_base_url(server.base_url.clone())
        .with_api_key("sk-test-key")
        .with_retry(RetryPolicy::default().with_max_retries(0));
    let clock = TestClock::new(Duration::from_secs(10));
    Arc::new(OpenAiProvider::new(config, Arc::new(clock)).unwrap())
}

/// An agent with a configured window of 4,000 tokens.
const WINDOWED: &str =
    "[settings]\ncontext_window = 4000\n[[agents]]\nid = \"a\"\nname = \"Alpha\"\n";

/// Three long notes (about 600 tokens each by the runtime's estimate), each answered: history the
/// runtime thinks fits its configured window, but which a server with a smaller one refuses.
async fn three_long_notes(h: &mut OrgHarness) {
    for n in 1..=3 {
        let note = format!("note {n}: {}", "lorem ipsum dolor sit amet ".repeat(66));
        h.org
            .deliver("a", InboundMessage::new("portal", "u1", note))
            .await
            .unwrap();
        assert_eq!(h.reply().await.content, format!("noted {n}"));
    }
}

fn messages_of(received: &support::Received) -> Vec<serde_json::Value> {
    received.body["messages"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// A context-length error from the server (past the runtime's own choice of history, which
/// fitted the configured window): the turn compacts once (a summary asked of the model), sends
/// once more with the summary instead of the older messages, and answers; the summary is stored.
#[tokio::test]
async fn a_context_length_error_compacts_once_and_resends_once() {
    let server = FixtureServer::start(vec![
        completion(Some("noted 1"), None, 11),
        completion(Some("noted 2"), None, 12),
        completion(Some("noted 3"), None, 13),
        context_length_exceeded(),
        completion(Some("SUMMARY: the user sent three long notes."), None, 14),
        completion(Some("You sent three notes."), None, 15),
    ])
    .await;
    let mut h = OrgHarness::builder(WINDOWED)
        .stores(Stores::memory())
        .llm(estimated_provider(&server))
        .build()
        .await;
    h.org.start_all().await.unwrap();
    three_long_notes(&mut h).await;
    h.org
        .deliver("a", InboundMessage::new("portal", "u1", "what did I send?"))
        .await
        .unwrap();
    let reply = h.reply().await;
    assert!(!reply.is_failure(), "{reply:?}");
    assert_eq!(reply.content, "You sent three notes.");
    let a = AgentId::parse("a").unwrap();
    tokio::time::timeout(Duration::from_secs(10), h.org.wait_idle(&a))
        .await
        .unwrap()
        .unwrap();

    let received = server.requests();
    assert_eq!(
        received.len(),
        6,
        "one refused send, one summary, one resend"
    );
    let refused = messages_of(&received[3]);
    let summary_request = serde_json::to_string(&received[4].body).unwrap();
    let resent = messages_of(&received[5]);
    assert!(
        serde_json::to_string(&refused).unwrap().contains("note 1:"),
        "the refused request held the whole history"
    );
    assert!(
        summary_request.contains("note 1:"),
        "the summary is asked of the older messages"
    );
    let resent_text = serde_json::to_string(&resent).unwrap();
    assert!(
        resent_text.contains("SUMMARY: the user sent three long notes."),
        "the resend carries the summary: {resent_text}"
    );
    assert!(
        !resent_text.contains("note 1:"),
        "the resend leaves the summarized messages out"
    );
    assert!(
        resent_text.contains("what did I send?"),
        "the resend still asks the question"
    );
    assert!(
        resent_text.len() < serde_json::to_string(&refused).unwrap().len(),
        "the resend is shorter"
    );
    let compactions = h
        .events
        .events()
        .iter()
        .filter(|e| matches!(e.kind, spacebot_core::event::EventKind::Compacted { .. }))
        .count();
    assert_eq!(compactions, 1, "compacted once");
    let summaries = h
        .stores
        .records
        .list(spacebot_core::context::SUMMARY_NAMESPACE, "a/")
        .await
        .unwrap();
    assert_eq!(summaries.len(), 1, "the summary is stored");
}

/// The server refuses the resend too: the turn fails with a reply saying the prompt was too long
/// for the model, after exactly one compaction and one resend (nothing loops).
#[tokio::test]
async fn a_second_context_length_error_is_a_failure_reply() {
    let server = FixtureServer::start(vec![
        completion(Some("noted 1"), None, 11),
        completion(Some("noted 2"), None, 12),
        completion(Some("noted 3"), None, 13),
        context_length_exceeded(),
        completion(Some("SUMMARY: three notes."), None, 14),
        context_length_exceeded(),
        completion(Some("never asked"), None, 15),
    ])
    .await;
    let mut h = OrgHarness::builder(WINDOWED)
        .stores(Stores::memory())
        .llm(estimated_provider(&server))
        .build()
        .await;
    h.org.start_all().await.unwrap();
    three_long_notes(&mut h).await;
    h.org
        .deliver("a", InboundMessage::new("portal", "u1", "what did I send?"))
        .await
        .unwrap();
    let reply = h.reply().await;
    assert!(reply.is_failure(), "{reply:?}");
    assert!(
        reply.content.contains("too long") || reply.content.contains("context"),
        "the failure says why: {}",
        reply.content
    );
    let a = AgentId::parse("a").unwrap();
    tokio::time::timeout(Duration::from_secs(10), h.org.wait_idle(&a))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(server.count(), 6, "one compaction, one resend, no more");
    assert_eq!(server.unused_replies(), 1);
}
