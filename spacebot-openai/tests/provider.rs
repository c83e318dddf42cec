//! The provider against a Chat Completions server on 127.0.0.1 that replays recorded responses.
//! Every request body is checked against the OpenAPI request schema (see `support`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};
use spacebot_core::llm::{FinishReason, StreamEvent, ToolChoice, Usage};
use spacebot_core::{ChatMessage, ChatRequest, LlmError, LlmProvider, ToolCall, ToolDefinition};
use spacebot_openai::{Dialect, OpenAiConfig, OpenAiProvider, RetryPolicy};
use support::{FixtureServer, Reply, TestClock};

const TIMEOUT: Duration = Duration::from_secs(30);
const IDLE: Duration = Duration::from_secs(20);

fn config(server: &FixtureServer) -> OpenAiConfig {
    OpenAiConfig::new("gpt-4o-mini")
        .with_base_url(server.base_url.clone())
        .with_api_key("sk-test-key")
        .with_request_timeout(TIMEOUT)
        .with_stream_idle_timeout(IDLE)
        .with_retry(
            RetryPolicy::default()
                .with_max_retries(3)
                .with_backoff(Duration::from_millis(500), Duration::from_secs(8))
                .with_jitter(0.0),
        )
}

fn make(config: OpenAiConfig) -> (OpenAiProvider, TestClock) {
    // Waits under 10 s (retry waits) pass at once; timeouts wait for the test.
    let clock = TestClock::new(Duration::from_secs(10));
    let provider = OpenAiProvider::new(config, Arc::new(clock.clone())).unwrap();
    (provider, clock)
}

fn weather_tool() -> ToolDefinition {
    ToolDefinition {
        name: "get_weather".into(),
        description: "Current weather for a city".into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
            },
            "required": ["city"]
        }),
    }
}

fn ask(text: &str) -> ChatRequest {
    ChatRequest {
        messages: vec![
            ChatMessage::system("You are terse."),
            ChatMessage::user(text),
        ],
        ..ChatRequest::default()
    }
}

/// A conversation that already went through one tool round.
fn after_tool_round() -> ChatRequest {
    ChatRequest {
        messages: vec![
            ChatMessage::system("You are terse."),
            ChatMessage::user("Weather in Paris?"),
            ChatMessage::Assistant {
                content: None,
                tool_calls: vec![ToolCall {
                    id: "call_1".into(),
                    name: "get_weather".into(),
                    arguments: r#"{"city":"Paris"}"#.into(),
                }],
            },
            ChatMessage::tool("call_1", "18 C, clear"),
        ],
        tools: vec![weather_tool()].into(),
        tool_choice: Some(ToolChoice::Auto),
        ..ChatRequest::default()
    }
}

async fn collect(
    provider: &OpenAiProvider,
    request: ChatRequest,
) -> Vec<Result<StreamEvent, LlmError>> {
    provider.stream(request).await.unwrap().collect().await
}

fn done(events: &[Result<StreamEvent, LlmError>]) -> spacebot_core::ChatResponse {
    let dones: Vec<_> = events
        .iter()
        .filter(|e| matches!(e, Ok(StreamEvent::Done(_))))
        .collect();
    assert_eq!(dones.len(), 1, "exactly one Done: {events:?}");
    match events.last() {
        Some(Ok(StreamEvent::Done(r))) => r.clone(),
        other => panic!("the last event is not Done: {other:?}"),
    }
}

#[tokio::test]
async fn plain_completion_maps_both_ways() {
    let server = FixtureServer::start(vec![Reply::json("openai/plain.json")]).await;
    let (provider, _) = make(
        config(&server)
            .with_organization("org-123")
            .with_project("proj_456")
            .with_header("x-trace", "abc"),
    );
    let mut request = ask("Capital of France?");
    request.temperature = Some(0.5);
    request.max_tokens = Some(100);
    let response = provider.complete(request).await.unwrap();

    assert_eq!(
        response.content.as_deref(),
        Some("The capital of France is Paris.")
    );
    assert!(response.tool_calls.is_empty());
    assert_eq!(response.finish_reason, Some(FinishReason::Stop));
    assert_eq!(
        response.usage,
        Some(Usage {
            prompt_tokens: 24,
            completion_tokens: 8,
            total_tokens: 32
        })
    );

    let requests = server.requests();
    assert_eq!(requests.len(), 1);
    let headers = &requests[0].headers;
    assert_eq!(headers["authorization"], "Bearer sk-test-key");
    assert_eq!(headers["openai-organization"], "org-123");
    assert_eq!(headers["openai-project"], "proj_456");
    assert_eq!(headers["x-trace"], "abc");
    assert_eq!(
        requests[0].body,
        json!({
            "model": "gpt-4o-mini",
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Capital of France?"}
            ],
            "temperature": 0.5,
            "max_completion_tokens": 100
        })
    );
}

#[tokio::test]
async fn the_request_model_overrides_the_default_and_no_key_sends_no_authorization() {
    let server = FixtureServer::start(vec![Reply::json("openai/plain.json")]).await;
    let mut cfg = config(&server);
    cfg.api_key = None;
    let (provider, _) = make(cfg);
    let mut request = ask("hi");
    request.model = Some("gpt-4.1".into());
    provider.complete(request).await.unwrap();
    let requests = server.requests();
    assert_eq!(requests[0].body["model"], "gpt-4.1");
    assert!(requests[0].headers.get("authorization").is_none());
}

#[tokio::test]
async fn a_tool_call_and_the_tool_round_trip() {
    let server = FixtureServer::start(vec![Reply::json("openai/tool_calls.json")]).await;
    let (provider, _) = make(config(&server));
    let mut request = after_tool_round();
    request.tool_choice = Some(ToolChoice::Function("get_weather".into()));
    let response = provider.complete(request).await.unwrap();

    assert_eq!(response.content, None);
    assert_eq!(response.finish_reason, Some(FinishReason::ToolCalls));
    assert_eq!(
        response.tool_calls,
        vec![ToolCall {
            id: "call_5fQ2m8kXb1ZrT0yWc7LhD3aN".into(),
            name: "send_agent_message".into(),
            arguments: r#"{"target":"researcher","message":"Find three sources on tidal energy."}"#
                .into(),
        }]
    );

    let body = server.only_body();
    assert_eq!(
        body["messages"][2],
        json!({
            "role": "assistant",
            "content": null,
            "tool_calls": [{
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}
            }]
        })
    );
    assert_eq!(
        body["messages"][3],
        json!({"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"})
    );
    assert_eq!(
        body["tools"],
        json!([{
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather for a city",
                "parameters": weather_tool().parameters
            }
        }])
    );
    assert_eq!(
        body["tool_choice"],
        json!({"type": "function", "function": {"name": "get_weather"}})
    );
    assert!(body.get("parallel_tool_calls").is_none());
}

#[tokio::test]
async fn tool_choice_words() {
    for (choice, wire) in [
        (ToolChoice::Auto, "auto"),
        (ToolChoice::None, "none"),
        (ToolChoice::Required, "required"),
    ] {
        let server = FixtureServer::start(vec![Reply::json("openai/plain.json")]).await;
        let (provider, _) = make(config(&server));
        let mut request = ask("hi");
        request.tools = vec![weather_tool()].into();
        request.tool_choice = Some(choice);
        provider.complete(request).await.unwrap();
        assert_eq!(server.only_body()["tool_choice"], wire);
    }
}

#[tokio::test]
async fn several_tool_calls_in_one_response() {
    let server = FixtureServer::start(vec![Reply::json("openai/parallel_tool_calls.json")]).await;
    let mut cfg = config(&server);
    cfg.dialect.parallel_tool_calls = Some(true);
    let (provider, _) = make(cfg);
    let mut request = ask("Weather in Paris and Tokyo?");
    request.tools = vec![weather_tool()].into();
    let response = provider.complete(request).await.unwrap();
    let cities: Vec<Value> = response
        .tool_calls
        .iter()
        .map(|c| serde_json::from_str::<Value>(&c.arguments).unwrap()["city"].clone())
        .collect();
    assert_eq!(cities, [json!("Paris"), json!("Tokyo")]);
    assert_ne!(response.tool_calls[0].id, response.tool_calls[1].id);
    assert_eq!(server.only_body()["parallel_tool_calls"], true);
}

#[tokio::test]
async fn streamed_text_with_usage() {
    let server = FixtureServer::start(vec![Reply::sse("openai/stream_text.sse")]).await;
    let (provider, _) = make(config(&server));
    let events = collect(&provider, ask("Capital of France?")).await;
    let text: String = events
        .iter()
        .filter_map(|e| match e {
            Ok(StreamEvent::TextDelta { text }) => Some(text.clone()),
            _ => None,
        })
        .collect();
    let response = done(&events);
    assert_eq!(text, "The capital of France is Paris.");
    assert_eq!(response.content.as_deref(), Some(text.as_str()));
    assert_eq!(response.finish_reason, Some(FinishReason::Stop));
    assert_eq!(response.usage.map(|u| u.total_tokens), Some(32));
    let body = server.only_body();
    assert_eq!(body["stream"], true);
    assert_eq!(body["stream_options"], json!({"include_usage": true}));
}

#[tokio::test]
async fn streamed_parallel_tool_calls_end_as_complete_would() {
    let server = FixtureServer::start(vec![
        Reply::sse("openai/stream_tool_calls.sse"),
        Reply::json("openai/parallel_tool_calls.json"),
    ])
    .await;
    let (provider, _) = make(config(&server));
    let mut request = ask("Weather in Paris and Tokyo?");
    request.tools = vec![weather_tool()].into();
    let events = collect(&provider, request.clone()).await;
    let streamed = done(&events);
    let completed = provider.complete(request).await.unwrap();
    assert_eq!(streamed.tool_calls.len(), 2);
    assert_eq!(
        serde_json::from_str::<Value>(&streamed.tool_calls[1].arguments).unwrap(),
        json!({"city": "Tokyo", "unit": "celsius"})
    );
    // The wire text of the arguments differs in spacing; compare them as JSON.
    let as_json = |r: &spacebot_core::ChatResponse| -> Vec<(String, String, Value)> {
        r.tool_calls
            .iter()
            .map(|c| {
                (
                    c.id.clone(),
                    c.name.clone(),
                    serde_json::from_str(&c.arguments).unwrap(),
                )
            })
            .collect()
    };
    assert_eq!(as_json(&streamed), as_json(&completed));
    assert_eq!(streamed.finish_reason, completed.finish_reason);
    assert_eq!(streamed.usage, completed.usage);

    // The deltas: ids and names once, at the call's position, arguments in pieces.
    let deltas: Vec<(u32, Option<String>, Option<String>)> = events
        .iter()
        .filter_map(|e| match e {
            Ok(StreamEvent::ToolCallDelta {
                index, id, name, ..
            }) if id.is_some() || name.is_some() => Some((*index, id.clone(), name.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        deltas,
        vec![
            (
                0,
                Some("call_Q1w2E3r4T5y6U7i8O9p0A1s2".into()),
                Some("get_weather".into())
            ),
            (
                1,
                Some("call_Z9x8C7v6B5n4M3l2K1j0H9g8".into()),
                Some("get_weather".into())
            ),
        ]
    );
}

#[tokio::test]
async fn llama_cpp_stream_repeats_id_and_name_and_sends_no_usage() {
    let server =
        FixtureServer::start(vec![Reply::sse("compat/llamacpp_stream_tool_calls.sse")]).await;
    // llama.cpp's own server streams tool calls (llama-cpp-python does not: the preset's default).
    let mut dialect = Dialect::llama_cpp();
    dialect.streams_tool_calls = true;
    let (provider, _) = make(config(&server).with_dialect(dialect));
    let mut request = after_tool_round();
    request.max_tokens = Some(256);
    let events = collect(&provider, request).await;
    let response = done(&events);
    assert_eq!(response.usage, None);
    assert_eq!(response.tool_calls.len(), 1);
    assert_eq!(response.tool_calls[0].name, "send_agent_message");
    assert_eq!(
        response.tool_calls[0].arguments,
        r#"{"target":"researcher","message":"Find three sources"}"#
    );
    let names = events
        .iter()
        .filter(|e| matches!(e, Ok(StreamEvent::ToolCallDelta { name: Some(_), .. })))
        .count();
    assert_eq!(names, 1, "the repeated name is passed on once");

    let body = server.only_body();
    assert_eq!(
        body["messages"][2]["content"], "",
        "no null content next to tool calls"
    );
    assert_eq!(body["max_tokens"], 256);
    assert!(body.get("max_completion_tokens").is_none());
    assert!(body.get("stream_options").is_none());
}

#[tokio::test]
async fn llama_cpp_text_stream() {
    let server = FixtureServer::start(vec![Reply::sse("compat/llamacpp_stream_text.sse")]).await;
    let (provider, _) = make(config(&server).with_dialect(Dialect::llama_cpp()));
    let response = done(&collect(&provider, ask("hi")).await);
    assert_eq!(response.content.as_deref(), Some("Hello, world!"));
    assert_eq!(response.usage, None);
}

#[tokio::test]
async fn ollama_stream_sends_calls_whole_under_one_index() {
    let server =
        FixtureServer::start(vec![Reply::sse("compat/ollama_stream_tool_calls.sse")]).await;
    let (provider, _) = make(config(&server).with_dialect(Dialect::ollama()));
    let mut request = ask("Weather in Paris and Tokyo?");
    request.tools = vec![weather_tool()].into();
    let response = done(&collect(&provider, request).await);
    let ids: Vec<&str> = response.tool_calls.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids, ["call_4x7b1k2m", "call_9q3w8e5r"]);
    assert_eq!(response.usage.map(|u| u.total_tokens), Some(118));
    assert_eq!(response.content, None);
}

#[tokio::test]
async fn a_stream_that_finishes_without_done_is_complete() {
    let server = FixtureServer::start(vec![Reply::sse("compat/stream_without_done.sse")]).await;
    let (provider, _) = make(config(&server).with_dialect(Dialect::vllm()));
    let response = done(&collect(&provider, ask("hi")).await);
    assert_eq!(response.content.as_deref(), Some("Done here."));
}

fn last_error(events: &[Result<StreamEvent, LlmError>]) -> &LlmError {
    assert!(
        !events.iter().any(|e| matches!(e, Ok(StreamEvent::Done(_)))),
        "a failed stream has no Done: {events:?}"
    );
    match events.last() {
        Some(Err(e)) => e,
        other => panic!("the stream did not end with an error: {other:?}"),
    }
}

#[tokio::test]
async fn a_stream_cut_mid_way_is_an_error() {
    let server = FixtureServer::start(vec![Reply::sse("broken/stream_cut.sse")]).await;
    let (provider, _) = make(config(&server));
    let events = collect(&provider, ask("hi")).await;
    let error = last_error(&events);
    assert!(matches!(error, LlmError::MalformedResponse(_)), "{error}");
    assert!(error.to_string().contains("cut mid-way"), "{error}");
    assert!(matches!(events[0], Ok(StreamEvent::TextDelta { .. })));
}

#[tokio::test]
async fn a_stream_whose_connection_breaks_is_an_error() {
    let server = FixtureServer::start(vec![Reply::sse("broken/stream_cut.sse").then_reset()]).await;
    let (provider, _) = make(config(&server));
    let mut stream = provider.stream(ask("hi")).await.unwrap();
    let first = stream.next().await.unwrap().unwrap();
    assert_eq!(first, StreamEvent::TextDelta { text: "The".into() });
    server.reset();
    let events: Vec<_> = stream.collect().await;
    let error = last_error(&events);
    assert!(matches!(error, LlmError::Transport { .. }), "{error}");
    let text = error.to_string();
    assert!(
        text.starts_with("transport error: the connection broke after 3 chunk(s) of the stream: "),
        "{text}"
    );
    assert_eq!(text.matches("transport error").count(), 1, "{text}");
    assert_eq!(
        text.matches("error decoding response body").count(),
        1,
        "{text}"
    );
}

#[tokio::test]
async fn a_bad_chunk_is_an_error() {
    let server = FixtureServer::start(vec![Reply::sse("broken/stream_bad_chunk.sse")]).await;
    let (provider, _) = make(config(&server));
    let events = collect(&provider, ask("hi")).await;
    let error = last_error(&events);
    assert!(matches!(error, LlmError::MalformedResponse(_)), "{error}");
    assert!(error.to_string().contains("stream chunk 3"), "{error}");
}

#[tokio::test]
async fn an_error_inside_the_stream_is_an_error() {
    let server = FixtureServer::start(vec![Reply::sse("broken/stream_error_object.sse")]).await;
    let (provider, _) = make(config(&server));
    let events = collect(&provider, ask("hi")).await;
    let error = last_error(&events);
    assert!(matches!(error, LlmError::Server { .. }), "{error}");
    assert!(error.to_string().contains("had an error"), "{error}");
}

#[tokio::test]
async fn streamed_tool_arguments_that_are_not_json_name_the_tool_when_checked() {
    let server = FixtureServer::start(vec![Reply::sse(
        "openai/stream_tool_calls_bad_arguments.sse",
    )])
    .await;
    let (provider, _) = make(config(&server).with_check_tool_arguments(true));
    let mut request = ask("Weather?");
    request.tools = vec![weather_tool()].into();
    let events = collect(&provider, request).await;
    let error = last_error(&events);
    assert!(matches!(error, LlmError::MalformedResponse(_)), "{error}");
    assert!(error.to_string().contains("`get_weather`"), "{error}");
}

#[tokio::test]
async fn tool_arguments_that_are_not_json_name_the_tool_when_checked() {
    let server =
        FixtureServer::start(vec![Reply::json("openai/tool_calls_bad_arguments.json")]).await;
    let (provider, _) = make(config(&server).with_check_tool_arguments(true));
    let error = provider.complete(after_tool_round()).await.unwrap_err();
    assert!(matches!(error, LlmError::MalformedResponse(_)), "{error}");
    assert!(error.to_string().contains("`get_weather`"), "{error}");
    assert!(error.to_string().contains("not valid JSON"), "{error}");
    assert_eq!(server.count(), 1, "not retried");

    // Passed on as written by default: the runtime answers the model with the parse error.
    let server = FixtureServer::start(vec![
        Reply::json("openai/tool_calls_bad_arguments.json"),
        Reply::sse("openai/stream_tool_calls_bad_arguments.sse"),
    ])
    .await;
    let (provider, _) = make(config(&server));
    assert!(!provider.config().check_tool_arguments, "off by default");
    let response = provider.complete(after_tool_round()).await.unwrap();
    assert_eq!(
        response.tool_calls[0].arguments,
        r#"{"city": "Paris", "unit": "#
    );
    let streamed = done(&collect(&provider, after_tool_round()).await);
    assert_eq!(streamed.tool_calls[0].arguments, r#"{"city": Paris}"#);
}

#[tokio::test]
async fn malformed_bodies_are_errors_and_not_retried() {
    for name in ["broken/truncated.json", "broken/html.json"] {
        let server = FixtureServer::start(vec![Reply::json(name)]).await;
        let (provider, _) = make(config(&server));
        let error = provider.complete(ask("hi")).await.unwrap_err();
        assert!(
            matches!(error, LlmError::MalformedResponse(_)),
            "{name}: {error}"
        );
        assert!(
            error.to_string().contains("not a chat completion"),
            "{error}"
        );
        assert_eq!(server.count(), 1);
    }
}

#[tokio::test]
async fn client_errors_are_typed_and_not_retried() {
    type Check = fn(&LlmError) -> bool;
    let cases: [(u16, &str, Check); 5] = [
        (
            401,
            "openai/error_401.json",
            |e| matches!(e, LlmError::Authentication { message } if message.contains("invalid_api_key")),
        ),
        (403, "openai/error_401.json", |e| {
            matches!(e, LlmError::Authentication { .. })
        }),
        (
            400,
            "openai/error_400.json",
            |e| matches!(e, LlmError::InvalidRequest { status: 400, message } if message.contains("tool_choice")),
        ),
        (
            400,
            "openai/error_context_length.json",
            |e| matches!(e, LlmError::ContextTooLong { message } if message.contains("128000")),
        ),
        (400, "compat/llamacpp_error_context.json", |e| {
            matches!(e, LlmError::ContextTooLong { .. })
        }),
    ];
    for (status, name, expected) in cases {
        let server = FixtureServer::start(vec![
            Reply::status_json(status, name),
            Reply::json("openai/plain.json"),
        ])
        .await;
        let (provider, clock) = make(config(&server));
        let error = provider.complete(ask("hi")).await.unwrap_err();
        assert!(expected(&error), "{status} {name}: {error:?}");
        assert_eq!(server.count(), 1, "{name} was retried");
        assert!(clock.waits().is_empty());
    }
}

#[tokio::test]
async fn llama_cpp_validation_errors_arrive_as_500_and_are_not_retried() {
    let server = FixtureServer::start(vec![
        Reply::status_json(500, "compat/llamacpp_error_500.json"),
        Reply::json("openai/plain.json"),
    ])
    .await;
    let (provider, _) = make(config(&server).with_dialect(Dialect::llama_cpp()));
    let error = provider.complete(after_tool_round()).await.unwrap_err();
    assert!(
        matches!(&error, LlmError::InvalidRequest { status: 500, message } if message.contains("must contain")),
        "{error:?}"
    );
    assert_eq!(server.count(), 1);

    // The same answer from a server configured as OpenAI is a server error, retried.
    let server = FixtureServer::start(vec![
        Reply::status_json(500, "compat/llamacpp_error_500.json"),
        Reply::json("openai/plain.json"),
    ])
    .await;
    let (provider, _) = make(config(&server));
    provider.complete(ask("hi")).await.unwrap();
    assert_eq!(server.count(), 2);
}

#[tokio::test]
async fn llama_cpp_plain_server_errors_are_retried() {
    let server = FixtureServer::start(vec![
        Reply::status_json(500, "compat/llamacpp_error_500_plain.json"),
        Reply::raw(500, "Internal Server Error"),
        Reply::raw(502, "<html>Bad gateway</html>"),
        Reply::raw(
            503,
            r#"{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}"#,
        ),
        Reply::json("openai/plain.json"),
    ])
    .await;
    let mut cfg = config(&server).with_dialect(Dialect::llama_cpp());
    cfg.retry.max_retries = 4;
    let (provider, clock) = make(cfg);
    let response = provider.complete(ask("hi")).await.unwrap();
    assert_eq!(response.finish_reason, Some(FinishReason::Stop));
    assert_eq!(server.count(), 5);
    assert_eq!(clock.waits().len(), 4);
}

#[tokio::test]
async fn server_errors_are_retried_with_exponential_backoff() {
    let server = FixtureServer::start(vec![
        Reply::status_json(500, "openai/error_500.json"),
        Reply::raw(502, "<html>Bad gateway</html>"),
        Reply::raw(503, ""),
        Reply::json("openai/plain.json"),
    ])
    .await;
    let (provider, clock) = make(config(&server));
    let response = provider.complete(ask("hi")).await.unwrap();
    assert_eq!(response.finish_reason, Some(FinishReason::Stop));
    assert_eq!(server.count(), 4);
    assert_eq!(
        clock.waits(),
        [500, 1_000, 2_000].map(Duration::from_millis)
    );
    assert_eq!(clock.elapsed_ms(), 3_500);
}

#[tokio::test]
async fn retries_stop_after_the_limit_with_the_last_error() {
    let server = FixtureServer::start(vec![
        Reply::raw(503, "busy"),
        Reply::raw(503, "busy"),
        Reply::raw(503, "still busy"),
        Reply::json("openai/plain.json"),
    ])
    .await;
    let (provider, clock) = make(
        config(&server).with_retry(
            RetryPolicy::default()
                .with_max_retries(2)
                .with_backoff(Duration::from_millis(100), Duration::from_millis(150))
                .with_jitter(0.0),
        ),
    );
    let error = provider.complete(ask("hi")).await.unwrap_err();
    assert!(
        matches!(&error, LlmError::Server { status: 503, message } if message == "gave up after 3 attempts; last: still busy"),
        "{error:?}"
    );
    assert_eq!(
        error.to_string(),
        "server error (HTTP 503): gave up after 3 attempts; last: still busy"
    );
    assert_eq!(server.count(), 3);
    assert_eq!(clock.waits(), [100, 150].map(Duration::from_millis));
}

#[tokio::test]
async fn jitter_shortens_waits_within_its_bounds() {
    let server = FixtureServer::start(vec![
        Reply::raw(503, ""),
        Reply::raw(503, ""),
        Reply::raw(503, ""),
        Reply::json("openai/plain.json"),
    ])
    .await;
    let (provider, clock) = make(
        config(&server).with_retry(
            RetryPolicy::default()
                .with_max_retries(3)
                .with_backoff(Duration::from_millis(1_000), Duration::from_secs(8))
                .with_jitter(0.5),
        ),
    );
    provider.complete(ask("hi")).await.unwrap();
    let waits = clock.waits();
    assert_eq!(waits.len(), 3);
    for (n, wait) in waits.iter().enumerate() {
        let full = Duration::from_millis(1_000 << n);
        assert!(*wait <= full && *wait >= full / 2, "wait {n}: {wait:?}");
    }
}

#[tokio::test]
async fn rate_limits_honour_retry_after_in_seconds_and_as_a_date() {
    let clock_start = std::time::SystemTime::UNIX_EPOCH + Duration::from_millis(1_000_000);
    let date = httpdate::fmt_http_date(clock_start + Duration::from_secs(7));
    let server = FixtureServer::start(vec![
        Reply::status_json(429, "openai/error_429.json").header("retry-after", "3"),
        Reply::status_json(429, "openai/error_429.json").header("retry-after", &date),
        Reply::status_json(429, "openai/error_429.json").header("retry-after-ms", "250"),
        Reply::json("openai/plain.json"),
    ])
    .await;
    let (provider, clock) = make(config(&server));
    provider.complete(ask("hi")).await.unwrap();
    assert_eq!(server.count(), 4);
    // 3 s; then the date, 7 s after the clock's start, 3 s of which have passed; then 250 ms.
    assert_eq!(
        clock.waits(),
        [3_000, 4_000, 250].map(Duration::from_millis)
    );
}

#[tokio::test]
async fn a_server_error_with_retry_after_waits_as_asked() {
    let server = FixtureServer::start(vec![
        Reply::raw(503, "maintenance").header("retry-after", "2"),
        Reply::json("openai/plain.json"),
    ])
    .await;
    let (provider, clock) = make(config(&server));
    provider.complete(ask("hi")).await.unwrap();
    assert_eq!(clock.waits(), [Duration::from_secs(2)]);
}

#[tokio::test]
async fn an_error_object_with_status_200_is_an_error() {
    let server = FixtureServer::start(vec![Reply::json("openai/error_500.json")]).await;
    let (provider, _) = make(config(&server).with_retry(RetryPolicy::none()));
    let error = provider.complete(ask("hi")).await.unwrap_err();
    assert!(
        matches!(&error, LlmError::Server { status: 200, message } if message.contains("had an error")),
        "{error:?}"
    );
}

#[tokio::test]
async fn a_rate_limit_without_retry_after_backs_off() {
    let server = FixtureServer::start(vec![
        Reply::status_json(429, "openai/error_429.json"),
        Reply::json("openai/plain.json"),
    ])
    .await;
    let (provider, clock) = make(config(&server));
    provider.complete(ask("hi")).await.unwrap();
    assert_eq!(clock.waits(), [Duration::from_millis(500)]);
}

#[tokio::test]
async fn a_retry_after_longer_than_allowed_is_returned_at_once() {
    let server = FixtureServer::start(vec![
        Reply::status_json(429, "openai/error_429.json").header("retry-after", "3600"),
        Reply::json("openai/plain.json"),
    ])
    .await;
    let (provider, clock) = make(config(&server));
    let error = provider.complete(ask("hi")).await.unwrap_err();
    assert!(
        matches!(error, LlmError::RateLimited { retry_after: Some(d), .. } if d == Duration::from_secs(3600)),
        "{error:?}"
    );
    assert_eq!(server.count(), 1);
    assert!(clock.waits().is_empty());
}

#[tokio::test]
async fn an_exhausted_quota_is_not_retried() {
    let server = FixtureServer::start(vec![
        Reply::status_json(429, "openai/error_quota.json"),
        Reply::json("openai/plain.json"),
    ])
    .await;
    let (provider, _) = make(config(&server));
    let error = provider.complete(ask("hi")).await.unwrap_err();
    assert!(matches!(error, LlmError::RateLimited { .. }), "{error:?}");
    assert_eq!(server.count(), 1);
}

#[tokio::test]
async fn a_silent_server_times_out_on_the_clock_and_is_retried() {
    let server = FixtureServer::start(vec![Reply::hang(), Reply::json("openai/plain.json")]).await;
    let (provider, clock) = make(config(&server));
    let call = tokio::spawn({
        let provider = provider.clone();
        async move { provider.complete(ask("hi")).await }
    });
    server.wait_for_requests(1).await;
    assert!(!call.is_finished());
    clock.manual.advance(TIMEOUT);
    let response = call.await.unwrap().unwrap();
    assert_eq!(response.finish_reason, Some(FinishReason::Stop));
    assert_eq!(server.count(), 2);
    assert_eq!(clock.waits(), [Duration::from_millis(500)]);
    assert_eq!(clock.elapsed_ms(), 30_500);
}

#[tokio::test]
async fn a_timeout_without_retries_is_a_timeout_error() {
    let server = FixtureServer::start(vec![Reply::hang()]).await;
    let (provider, clock) = make(config(&server).with_retry(RetryPolicy::none()));
    let call = tokio::spawn({
        let provider = provider.clone();
        async move { provider.complete(ask("hi")).await }
    });
    server.wait_for_requests(1).await;
    clock.manual.advance(TIMEOUT - Duration::from_millis(1));
    tokio::task::yield_now().await;
    assert!(!call.is_finished(), "timed out early");
    clock.manual.advance(Duration::from_millis(1));
    let error = call.await.unwrap().unwrap_err();
    assert!(
        matches!(error, LlmError::Timeout(d) if d == TIMEOUT),
        "{error:?}"
    );
}

#[tokio::test]
async fn a_stream_that_goes_silent_times_out() {
    let server = FixtureServer::start(vec![Reply::sse("broken/stream_cut.sse").then_hang()]).await;
    let (provider, clock) = make(config(&server));
    let mut stream = provider.stream(ask("hi")).await.unwrap();
    let first = stream.next().await.unwrap().unwrap();
    assert_eq!(first, StreamEvent::TextDelta { text: "The".into() });
    let second = stream.next().await.unwrap().unwrap();
    assert_eq!(
        second,
        StreamEvent::TextDelta {
            text: " capital".into()
        }
    );
    let sleeps = clock.sleeps().len();
    let third = tokio::spawn(async move { stream.next().await });
    // Once the provider waits for the next piece, the silence starts counting.
    while clock.sleeps().len() == sleeps {
        tokio::task::yield_now().await;
    }
    clock.manual.advance(IDLE - Duration::from_millis(1));
    tokio::task::yield_now().await;
    assert!(!third.is_finished(), "timed out early");
    clock.manual.advance(Duration::from_millis(1));
    let error = third.await.unwrap().unwrap().unwrap_err();
    assert!(
        matches!(error, LlmError::Timeout(d) if d == IDLE),
        "{error:?}"
    );
}

#[tokio::test]
async fn stream_setup_is_retried_like_complete() {
    let server = FixtureServer::start(vec![
        Reply::raw(502, ""),
        Reply::sse("openai/stream_text.sse"),
    ])
    .await;
    let (provider, clock) = make(config(&server));
    let response = done(&collect(&provider, ask("hi")).await);
    assert_eq!(
        response.content.as_deref(),
        Some("The capital of France is Paris.")
    );
    assert_eq!(clock.waits(), [Duration::from_millis(500)]);
    let errors = FixtureServer::start(vec![Reply::status_json(401, "openai/error_401.json")]).await;
    let (provider, _) = make(config(&errors));
    let error = provider.stream(ask("hi")).await.err().unwrap();
    assert!(
        matches!(error, LlmError::Authentication { .. }),
        "{error:?}"
    );
}

#[tokio::test]
async fn a_refused_connection_is_a_transport_error_after_retries() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let cfg = OpenAiConfig::new("m")
        .with_base_url(format!("http://{addr}/v1"))
        .with_retry(
            RetryPolicy::default()
                .with_max_retries(2)
                .with_backoff(Duration::from_millis(10), Duration::from_millis(10))
                .with_jitter(0.0),
        );
    let (provider, clock) = make(cfg);
    let error = provider.complete(ask("hi")).await.unwrap_err();
    assert!(matches!(error, LlmError::Transport { .. }), "{error:?}");
    assert_eq!(clock.waits().len(), 2);
}

#[tokio::test]
async fn a_dialect_without_tools_refuses_tools_before_sending() {
    let server = FixtureServer::start(vec![Reply::json("openai/plain.json")]).await;
    let mut cfg = config(&server).with_dialect(Dialect::compatible());
    cfg.dialect.supports_tools = false;
    let (provider, _) = make(cfg);
    let mut request = ask("hi");
    request.tools = vec![weather_tool()].into();
    let error = provider.complete(request).await.unwrap_err();
    assert!(error.to_string().contains("tools"), "{error}");
    assert_eq!(server.count(), 0);
}

#[tokio::test]
async fn bad_configuration_is_refused_with_the_setting_named() {
    let clock: Arc<dyn spacebot_core::Clock> = Arc::new(TestClock::new(Duration::ZERO));
    let bad = OpenAiConfig::new("m").with_base_url("ftp://example");
    let err = OpenAiProvider::new(bad, Arc::clone(&clock)).unwrap_err();
    assert!(err.to_string().contains("base_url"), "{err}");
    let bad = OpenAiConfig::new("m").with_header("bad header", "x");
    let err = OpenAiProvider::new(bad, Arc::clone(&clock)).unwrap_err();
    assert!(err.to_string().contains("extra_headers[0]"), "{err}");
    let ok = OpenAiProvider::new(OpenAiConfig::new("m").with_api_key("sk-secret"), clock).unwrap();
    assert!(!format!("{ok:?}").contains("sk-secret"));
}

// --- Configuration from the environment, and what each dialect sends ---

fn env_config(
    server: &FixtureServer,
    vars: &[(&str, &str)],
) -> Result<OpenAiConfig, spacebot_openai::ConfigError> {
    let base_url = server.base_url.clone();
    let vars: Vec<(String, String)> = vars
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    OpenAiConfig::from_lookup(move |name| {
        if name == "OPENAI_BASE_URL" {
            return Some(base_url.clone());
        }
        vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    })
}

fn with_test_clock(mut cfg: OpenAiConfig) -> OpenAiConfig {
    cfg.retry = cfg.retry.with_jitter(0.0);
    cfg
}

#[tokio::test]
async fn the_dialect_and_its_switches_come_from_the_environment() {
    let server =
        FixtureServer::start(vec![Reply::sse("compat/llamacpp_stream_tool_calls.sse")]).await;
    let cfg = env_config(
        &server,
        &[
            ("SPACEBOT_DIALECT", "llama_cpp"),
            ("SPACEBOT_MODEL", "qwen2.5-7b-instruct"),
            ("SPACEBOT_MAX_TOKENS", "300"),
            ("SPACEBOT_STREAM", "true"),
            ("SPACEBOT_REQUEST_TIMEOUT_SECS", "45"),
            ("SPACEBOT_MAX_RETRIES", "0"),
            ("SPACEBOT_STREAM_TOOL_CALLS", "true"),
        ],
    )
    .unwrap();
    let mut expected = Dialect::llama_cpp();
    expected.streams_tool_calls = true;
    assert_eq!(cfg.dialect, expected);
    assert_eq!(cfg.request_timeout, Duration::from_secs(45));
    assert_eq!(cfg.retry.max_retries, 0);
    assert!(cfg.api_key.is_none());
    let (provider, _) = make(with_test_clock(cfg));
    // The runtime names no tool choice and no token limit; `complete` streams underneath.
    let mut request = after_tool_round();
    request.tool_choice = None;
    let response = provider.complete(request).await.unwrap();
    assert_eq!(response.tool_calls[0].name, "send_agent_message");

    let body = server.only_body();
    assert_eq!(body["model"], "qwen2.5-7b-instruct");
    assert_eq!(body["stream"], true);
    assert_eq!(body["tool_choice"], "auto");
    assert_eq!(body["max_tokens"], 300);
    assert!(body.get("max_completion_tokens").is_none());
    assert_eq!(body["messages"][2]["content"], "");
}

#[tokio::test]
async fn environment_switches_override_the_preset() {
    let server = FixtureServer::start(vec![Reply::json("openai/plain.json")]).await;
    let cfg = env_config(
        &server,
        &[
            ("SPACEBOT_DIALECT", "vllm"),
            ("SPACEBOT_TOOL_CHOICE", "omit"),
            ("SPACEBOT_MAX_TOKENS_FIELD", "max_completion_tokens"),
            ("SPACEBOT_PARALLEL_TOOL_CALLS", "false"),
            ("SPACEBOT_MAX_TOKENS", "64"),
        ],
    )
    .unwrap();
    let (provider, _) = make(with_test_clock(cfg));
    let mut request = ask("hi");
    request.tools = vec![weather_tool()].into();
    provider.complete(request).await.unwrap();
    let body = server.only_body();
    assert!(body.get("tool_choice").is_none(), "{body}");
    assert_eq!(body["max_completion_tokens"], 64);
    assert_eq!(body["parallel_tool_calls"], false);
}

#[test]
fn bad_environment_values_name_the_variable_and_the_accepted_values() {
    let cases = [
        (
            "SPACEBOT_DIALECT",
            "llama",
            "openai, llama_cpp, vllm, ollama, compatible",
        ),
        ("SPACEBOT_TOOL_CHOICE", "required", "auto, omit"),
        (
            "SPACEBOT_MAX_TOKENS_FIELD",
            "tokens",
            "max_tokens, max_completion_tokens",
        ),
        ("SPACEBOT_STREAM", "maybe", "true, false"),
        ("SPACEBOT_SUPPORTS_TOOLS", "2", "true, false"),
        ("SPACEBOT_MAX_TOKENS", "0", "whole number"),
        ("SPACEBOT_MAX_TOKENS", "-5", "whole number"),
        ("SPACEBOT_MAX_RETRIES", "three", "whole number"),
        ("SPACEBOT_REQUEST_TIMEOUT_SECS", "0", "seconds above 0"),
        ("SPACEBOT_STREAM_IDLE_TIMEOUT_SECS", "1m", "seconds above 0"),
        ("SPACEBOT_CONNECT_TIMEOUT_SECS", "NaN", "seconds above 0"),
        ("OPENAI_BASE_URL", "localhost:8080", "http"),
    ];
    for (name, value, accepted) in cases {
        let err =
            OpenAiConfig::from_lookup(|k| (k == name).then(|| value.to_owned())).expect_err(name);
        let text = err.to_string();
        assert!(text.contains(name), "{name}={value}: {text}");
        assert!(text.contains(value), "{name}={value}: {text}");
        assert!(text.contains(accepted), "{name}={value}: {text}");
    }
}

#[test]
fn from_env_reads_the_process_environment_in_a_child_process() {
    // The child sets nothing itself: the variables are given to it, so no test races on the
    // process environment.
    if let Ok(expected) = std::env::var("SPACEBOT_TEST_EXPECT_DIALECT") {
        let cfg = OpenAiConfig::from_env().unwrap();
        assert_eq!(cfg.dialect.name, expected);
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let run = |dialect: &str, expect: &str| {
        std::process::Command::new(&exe)
            .args([
                "from_env_reads_the_process_environment_in_a_child_process",
                "--exact",
                "--nocapture",
            ])
            .env("SPACEBOT_DIALECT", dialect)
            .env("SPACEBOT_TEST_EXPECT_DIALECT", expect)
            .output()
            .unwrap()
    };
    let ok = run("ollama", "ollama");
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(String::from_utf8_lossy(&ok.stdout).contains("1 passed"));
    let bad = run("ollama", "vllm");
    assert!(!bad.status.success(), "the child's check can fail");
    let unknown = run("gpt", "openai");
    assert!(!unknown.status.success());
    assert!(
        String::from_utf8_lossy(&unknown.stdout).contains("SPACEBOT_DIALECT")
            || String::from_utf8_lossy(&unknown.stderr).contains("SPACEBOT_DIALECT")
    );
}

fn presets() -> [Dialect; 5] {
    [
        Dialect::openai(),
        Dialect::llama_cpp(),
        Dialect::vllm(),
        Dialect::ollama(),
        Dialect::compatible(),
    ]
}

#[tokio::test]
async fn tool_choice_per_dialect() {
    for dialect in presets() {
        let expected = match dialect.name {
            "openai" | "ollama" => None,
            _ => Some("auto"),
        };
        let server = FixtureServer::start(vec![
            Reply::json("openai/plain.json"),
            Reply::json("openai/plain.json"),
            Reply::json("openai/plain.json"),
        ])
        .await;
        let (provider, _) = make(config(&server).with_dialect(dialect.clone()));
        let mut with_tools = ask("hi");
        with_tools.tools = vec![weather_tool()].into();
        provider.complete(with_tools.clone()).await.unwrap();
        // A choice the request names is sent as it is, whatever the dialect.
        with_tools.tool_choice = Some(ToolChoice::Required);
        provider.complete(with_tools).await.unwrap();
        // No tools, no tool_choice.
        provider.complete(ask("hi")).await.unwrap();
        let bodies: Vec<Value> = server.requests().into_iter().map(|r| r.body).collect();
        assert_eq!(
            bodies[0].get("tool_choice").and_then(Value::as_str),
            expected,
            "{}",
            dialect.name
        );
        assert_eq!(bodies[1]["tool_choice"], "required", "{}", dialect.name);
        assert!(bodies[2].get("tool_choice").is_none(), "{}", dialect.name);
        assert!(bodies[2].get("tools").is_none(), "{}", dialect.name);
    }
}

#[tokio::test]
async fn assistant_tool_calls_are_encoded_per_dialect() {
    for dialect in presets() {
        let (content, field) = match dialect.name {
            "openai" => (Value::Null, "max_completion_tokens"),
            "vllm" => (Value::Null, "max_tokens"),
            _ => (json!(""), "max_tokens"),
        };
        let server = FixtureServer::start(vec![Reply::json("openai/plain.json")]).await;
        let (provider, _) = make(
            config(&server)
                .with_dialect(dialect.clone())
                .with_max_tokens(99),
        );
        provider.complete(after_tool_round()).await.unwrap();
        let body = server.only_body();
        assert_eq!(
            body["messages"][2],
            json!({
                "role": "assistant",
                "content": content,
                "tool_calls": [{
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}
                }]
            }),
            "{}",
            dialect.name
        );
        assert_eq!(body[field], 99, "{}", dialect.name);
        let other = if field == "max_tokens" {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        assert!(body.get(other).is_none(), "{}", dialect.name);
    }
}

#[tokio::test]
async fn malformed_tool_arguments_are_passed_through_not_errors() {
    let server = FixtureServer::start(vec![
        Reply::json("openai/tool_calls_bad_arguments.json"),
        Reply::sse("openai/stream_tool_calls_bad_arguments.sse"),
    ])
    .await;
    let mut dialect = Dialect::llama_cpp();
    dialect.streams_tool_calls = true;
    let (provider, _) = make(config(&server).with_dialect(dialect));
    let mut request = ask("Weather?");
    request.tools = vec![weather_tool()].into();
    let response = provider.complete(request.clone()).await.unwrap();
    assert_eq!(response.finish_reason, Some(FinishReason::ToolCalls));
    assert_eq!(response.tool_calls[0].name, "get_weather");
    assert_eq!(
        response.tool_calls[0].arguments,
        r#"{"city": "Paris", "unit": "#
    );
    assert!(serde_json::from_str::<Value>(&response.tool_calls[0].arguments).is_err());
    let streamed = done(&collect(&provider, request).await);
    assert_eq!(streamed.tool_calls[0].arguments, r#"{"city": Paris}"#);
    assert_eq!(server.count(), 2, "nothing retried");
}

// --- Error classes ---

#[tokio::test]
async fn a_context_error_inside_a_stream_is_context_too_long() {
    for (name, dialect, needle) in [
        (
            "broken/llamacpp_stream_context_error.sse",
            Dialect::llama_cpp(),
            "available context size",
        ),
        (
            "broken/stream_error_event_context.sse",
            Dialect::vllm(),
            "maximum context length",
        ),
    ] {
        let server = FixtureServer::start(vec![Reply::sse(name)]).await;
        let (provider, _) = make(config(&server).with_dialect(dialect));
        let events = collect(&provider, ask("a very long prompt")).await;
        let error = last_error(&events);
        assert!(
            matches!(error, LlmError::ContextTooLong { message } if message.contains(needle)),
            "{name}: {error:?}"
        );
        assert_eq!(events.len(), 1, "{name}");
    }
}

#[tokio::test]
async fn an_empty_stream_is_its_own_error() {
    for name in ["broken/stream_empty.sse", "broken/stream_done_only.sse"] {
        let server = FixtureServer::start(vec![Reply::sse(name)]).await;
        let (provider, _) = make(config(&server).with_dialect(Dialect::llama_cpp()));
        let events = collect(&provider, ask("hi")).await;
        assert_eq!(events.len(), 1, "{name}: {events:?}");
        let error = last_error(&events);
        let text = error.to_string();
        assert!(
            matches!(error, LlmError::MalformedResponse(_)),
            "{name}: {text}"
        );
        assert!(
            text.contains("the server sent an empty stream"),
            "{name}: {text}"
        );
        assert!(!text.contains("cut mid-way"), "{name}: {text}");
    }
}

#[tokio::test]
async fn an_empty_body_with_status_200_says_so() {
    let server = FixtureServer::start(vec![Reply::raw(200, "")]).await;
    let (provider, _) = make(config(&server));
    let error = provider.complete(ask("hi")).await.unwrap_err();
    assert!(
        matches!(&error, LlmError::MalformedResponse(m) if m.contains("empty body")),
        "{error:?}"
    );
}

#[tokio::test]
async fn exhausted_retries_say_how_many_attempts_for_each_retried_kind() {
    // Rate limits.
    let server = FixtureServer::start(vec![
        Reply::status_json(429, "openai/error_429.json"),
        Reply::status_json(429, "openai/error_429.json"),
    ])
    .await;
    let (provider, _) = make(
        config(&server).with_retry(
            RetryPolicy::default()
                .with_max_retries(1)
                .with_backoff(Duration::from_millis(10), Duration::from_millis(10))
                .with_jitter(0.0),
        ),
    );
    let error = provider.complete(ask("hi")).await.unwrap_err();
    assert!(
        matches!(&error, LlmError::RateLimited { message, .. } if message.starts_with("gave up after 2 attempts; last: ")),
        "{error:?}"
    );
    // Refused connections.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let (provider, _) = make(
        OpenAiConfig::new("m")
            .with_base_url(format!("http://{addr}/v1"))
            .with_retry(
                RetryPolicy::default()
                    .with_max_retries(2)
                    .with_backoff(Duration::from_millis(10), Duration::from_millis(10))
                    .with_jitter(0.0),
            ),
    );
    let error = provider.complete(ask("hi")).await.unwrap_err();
    let text = error.to_string();
    assert!(
        text.starts_with("transport error: gave up after 3 attempts; last: "),
        "{text}"
    );
    // A single attempt (no retries configured) is not dressed up.
    let server = FixtureServer::start(vec![Reply::raw(503, "busy")]).await;
    let (provider, _) = make(config(&server).with_retry(RetryPolicy::none()));
    let error = provider.complete(ask("hi")).await.unwrap_err();
    assert!(
        matches!(&error, LlmError::Server { status: 503, message } if message == "busy"),
        "{error:?}"
    );
}

#[tokio::test]
async fn not_implemented_is_not_retried() {
    let server = FixtureServer::start(vec![
        Reply::raw(501, "tools are not supported"),
        Reply::json("openai/plain.json"),
    ])
    .await;
    let (provider, _) = make(config(&server));
    let error = provider.complete(ask("hi")).await.unwrap_err();
    assert!(
        matches!(error, LlmError::InvalidRequest { status: 501, .. }),
        "{error:?}"
    );
    assert_eq!(server.count(), 1);
}

/// A request that offers the weather tool.
fn ask_with_tools(text: &str) -> ChatRequest {
    let mut request = ask(text);
    request.tools = vec![weather_tool()].into();
    request
}

#[tokio::test]
async fn a_dialect_that_cannot_stream_tools_calls_without_a_stream() {
    // llama-cpp-python: a streamed request with tools gets HTTP 200 and an empty stream.
    for dialect in [Dialect::llama_cpp(), Dialect::compatible()] {
        let server = FixtureServer::start(vec![
            Reply::json("compat/llamacpp_python_tool_calls.json").unless_streamed_with_tools(),
            Reply::json("compat/llamacpp_python_text.json").unless_streamed_with_tools(),
        ])
        .await;
        let (provider, _) = make(config(&server).with_dialect(dialect.clone()));
        let name = dialect.name;

        // A tool call: one plain request, its call yielded whole, then Done.
        let events = collect(&provider, ask_with_tools("Weather in Paris?")).await;
        let response = done(&events);
        assert_eq!(response.tool_calls.len(), 1, "{name}");
        assert_eq!(response.tool_calls[0].name, "get_weather");
        assert!(
            matches!(&events[0], Ok(StreamEvent::ToolCallDelta { index: 0, name: Some(n), arguments, .. })
                if n == "get_weather" && arguments.contains("Paris")),
            "{name}: {events:?}"
        );
        // A text answer to a request with tools: its text as one delta, then Done.
        let events = collect(&provider, ask_with_tools("And now?")).await;
        assert!(
            matches!(&events[0], Ok(StreamEvent::TextDelta { text }) if text == "It is sunny in Paris."),
            "{name}: {events:?}"
        );
        assert_eq!(
            done(&events).content.as_deref(),
            Some("It is sunny in Paris.")
        );
        let requests = server.requests();
        assert_eq!(requests.len(), 2, "{name}");
        for r in &requests {
            assert!(r.body.get("stream").is_none(), "{name}: {}", r.body);
            assert_eq!(r.body["tool_choice"], "auto", "{name}");
        }
    }
}

#[tokio::test]
async fn streamed_completions_call_without_a_stream_when_tools_cannot_stream() {
    let server = FixtureServer::start(vec![
        Reply::json("compat/llamacpp_python_tool_calls.json").unless_streamed_with_tools(),
        Reply::sse("compat/llamacpp_stream_text.sse"),
    ])
    .await;
    let (provider, _) = make(
        config(&server)
            .with_dialect(Dialect::llama_cpp())
            .with_stream_completions(true),
    );
    let response = provider
        .complete(ask_with_tools("Weather in Paris?"))
        .await
        .unwrap();
    assert_eq!(response.tool_calls[0].name, "get_weather");
    // Without tools the request still streams.
    let response = provider.complete(ask("hi")).await.unwrap();
    assert!(response.content.is_some());
    let requests = server.requests();
    assert!(requests[0].body.get("stream").is_none());
    assert_eq!(requests[1].body["stream"], true);
}

#[tokio::test]
async fn a_request_that_forbids_tools_still_streams() {
    let server = FixtureServer::start(vec![Reply::sse("compat/llamacpp_stream_text.sse")]).await;
    let (provider, _) = make(config(&server).with_dialect(Dialect::llama_cpp()));
    let mut request = ask_with_tools("hi");
    request.tool_choice = Some(ToolChoice::None);
    let events = collect(&provider, request).await;
    done(&events);
    assert_eq!(server.only_body()["stream"], true);
}

#[tokio::test]
async fn an_empty_stream_to_a_request_with_tools_names_no_cause_it_did_not_see() {
    // The switch overridden from the environment: the request streams, the server closes.
    let server = FixtureServer::start(vec![
        Reply::json("compat/llamacpp_python_tool_calls.json").unless_streamed_with_tools(),
    ])
    .await;
    let cfg = OpenAiConfig::from_lookup(|name| match name {
        "OPENAI_BASE_URL" => Some(server.base_url.clone()),
        "SPACEBOT_DIALECT" => Some("llama_cpp".into()),
        "SPACEBOT_STREAM_TOOL_CALLS" => Some("true".into()),
        _ => None,
    })
    .unwrap();
    assert!(cfg.dialect.streams_tool_calls);
    let (provider, _) = make(cfg.with_retry(RetryPolicy::none()));
    let events = collect(&provider, ask_with_tools("Weather in Paris?")).await;
    assert_eq!(events.len(), 1, "{events:?}");
    let error = last_error(&events);
    let text = error.to_string();
    assert!(matches!(error, LlmError::MalformedResponse(_)), "{text}");
    assert!(text.contains("empty stream"), "{text}");
    assert!(!text.to_lowercase().contains("context"), "{text}");
    assert_eq!(server.only_body()["stream"], true);
}

#[tokio::test]
async fn a_500_with_an_empty_body_is_not_retried() {
    for dialect in presets() {
        for body in ["", "\n"] {
            let server = FixtureServer::start(vec![
                Reply::raw(500, body),
                Reply::json("openai/plain.json"),
            ])
            .await;
            let (provider, clock) = make(config(&server).with_dialect(dialect.clone()));
            let error = provider.complete(ask("hi")).await.unwrap_err();
            assert!(!error.is_retryable(), "{}: {error:?}", dialect.name);
            assert!(
                matches!(&error, LlmError::InvalidRequest { status: 500, message } if message.contains("empty body")),
                "{}: {error:?}",
                dialect.name
            );
            assert_eq!(server.count(), 1, "{}", dialect.name);
            assert!(clock.waits().is_empty());
        }
    }
}

#[tokio::test]
async fn a_validation_error_as_500_is_not_retried() {
    // `_recorded`: llama-cpp-python 0.3 answering a message whose content is a number.
    for (dialect, name) in [
        (Dialect::llama_cpp(), "llamacpp_python_error_validation"),
        (Dialect::compatible(), "llamacpp_python_error_validation"),
        (
            Dialect::llama_cpp(),
            "llamacpp_python_error_validation_recorded",
        ),
    ] {
        let server = FixtureServer::start(vec![
            Reply::status_json(500, &format!("compat/{name}.json")),
            Reply::json("openai/plain.json"),
        ])
        .await;
        let (provider, clock) = make(config(&server).with_dialect(dialect.clone()));
        let error = provider.complete(ask("hi")).await.unwrap_err();
        assert!(!error.is_retryable(), "{}: {error:?}", dialect.name);
        assert!(
            matches!(&error, LlmError::InvalidRequest { status: 500, message } if message.contains("validation error")),
            "{}: {error:?}",
            dialect.name
        );
        assert_eq!(server.count(), 1, "{}", dialect.name);
        assert!(clock.waits().is_empty());
    }
}

#[tokio::test]
async fn an_empty_answer_is_passed_on_as_it_came() {
    // The provider reports what the server said; the runtime decides what an empty answer means
    // (it tries once more, then fails the turn).
    let server = FixtureServer::start(vec![Reply::json(
        "compat/llamacpp_python_empty_answer.json",
    )])
    .await;
    let (provider, _) = make(config(&server).with_dialect(Dialect::llama_cpp()));
    let response = provider.complete(ask("hi")).await.unwrap();
    assert_eq!(response.content.as_deref(), Some(""));
    assert!(response.tool_calls.is_empty());
    assert_eq!(response.finish_reason, Some(FinishReason::Stop));
}
