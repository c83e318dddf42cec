//! Contract tests: the request bodies the provider builds and the recorded responses the tests
//! replay, checked against the official OpenAPI description of the Chat Completions API.
//!
//! The schemas are a trimmed copy of that description kept in `tests/openapi/` (with its licence);
//! when the file is missing every test here fails.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use serde_json::{Value, json};
use spacebot_core::llm::ToolChoice;
use spacebot_core::{ChatMessage, ChatRequest, ToolCall, ToolDefinition};
use spacebot_openai::{Dialect, OpenAiConfig, OpenAiProvider};
use support::{TestClock, contract, fixtures_dir};

fn fixture_files(dir: &str, ext: &str) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(fixtures_dir().join(dir))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no {dir}/*.{ext} fixtures");
    files
}

/// The `data` of each event of an event-stream body, `[DONE]` excluded.
fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|event| {
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:").map(str::trim_start))
                .collect();
            (!data.is_empty()).then(|| data.join("\n"))
        })
        .filter(|d| d != "[DONE]")
        .collect()
}

#[test]
fn the_contract_is_kept_with_the_tests_under_its_licence() {
    let path = contract::spec_path();
    assert!(
        path.starts_with(env!("CARGO_MANIFEST_DIR")),
        "{}",
        path.display()
    );
    let licence = path.with_file_name("LICENSE");
    let text =
        std::fs::read_to_string(&licence).unwrap_or_else(|e| panic!("{}: {e}", licence.display()));
    assert!(text.contains("The MIT License") && text.contains("OpenAI"));
    let doc: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let schemas = doc["components"]["schemas"].as_object().unwrap();
    // Every reference resolves inside the trimmed file.
    let text = serde_json::to_string(&doc).unwrap();
    let mut refs = 0;
    for part in text.split("\"$ref\":\"#/components/schemas/").skip(1) {
        let name = &part[..part.find('"').unwrap()];
        assert!(schemas.contains_key(name), "dangling $ref to {name}");
        refs += 1;
    }
    assert!(refs > 50, "only {refs} references");
    // Compiling the validators is the contract every other test relies on.
    let _ = contract::get();
}

#[test]
fn recorded_responses_match_the_response_schema() {
    let mut checked = 0;
    for dir in ["openai", "compat"] {
        for path in fixture_files(dir, "json") {
            let body: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
            let name = path.display().to_string();
            if body.get("error").is_some() {
                // OpenAI's error bodies follow `ErrorResponse`; other servers' do not (llama.cpp
                // sends a numeric code and no `param`), which the provider tolerates.
                if dir == "openai" {
                    contract::check_error(&body, &name);
                    checked += 1;
                }
            } else if dir == "compat"
                && path
                    .file_name()
                    .is_some_and(|f| f.to_string_lossy().starts_with("llamacpp_python_"))
            {
                // llama-cpp-python's messages lack `refusal`, which the schema requires (and the
                // provider does not need): recorded as the server sends them, not checked.
            } else {
                contract::check_response(&body, &name);
                checked += 1;
            }
        }
    }
    assert!(checked >= 10, "only {checked} fixtures checked");
}

#[test]
fn recorded_stream_chunks_match_the_chunk_schema() {
    let mut checked = 0;
    for dir in ["openai", "compat"] {
        for path in fixture_files(dir, "sse") {
            let body = std::fs::read_to_string(&path).unwrap();
            let chunks = sse_data(&body);
            assert!(chunks.len() >= 3, "{}", path.display());
            for (i, data) in chunks.iter().enumerate() {
                let chunk: Value = serde_json::from_str(data).unwrap();
                contract::check_chunk(&chunk, &format!("{} chunk {i}", path.display()));
                checked += 1;
            }
        }
    }
    assert!(checked > 40, "only {checked} chunks checked");
}

#[test]
fn the_schemas_refuse_what_they_should() {
    let c = contract::get();
    // Proof that the checks can fail: the broken fixtures, and bodies the API would refuse.
    assert!(!c.response.is_valid(&json!({"choices": []})));
    assert!(!c.request.is_valid(&json!({"model": "m", "messages": []})));
    assert!(!c.request.is_valid(&json!({
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tool_choice": "sometimes"
    })));
    assert!(!c.request.is_valid(&json!({
        "model": "m",
        "messages": [{"role": "wizard", "content": "hi"}]
    })));
    let cut = std::fs::read_to_string(fixtures_dir().join("broken/stream_cut.sse")).unwrap();
    let last = sse_data(&cut).pop().unwrap();
    assert!(serde_json::from_str::<Value>(&last).is_err());
    // A chunk with the finish reason's null is valid once `nullable` is read as JSON Schema.
    assert!(c.chunk.is_valid(&json!({
        "id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": null}]
    })));
    assert!(!c.chunk.is_valid(&json!({
        "id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "tired"}]
    })));
}

fn provider(dialect: Dialect) -> OpenAiProvider {
    let config = OpenAiConfig::new("gpt-4o-mini")
        .with_base_url("http://127.0.0.1:9/v1")
        .with_dialect(dialect);
    OpenAiProvider::new(config, Arc::new(TestClock::new(Duration::ZERO))).unwrap()
}

fn dialects() -> [Dialect; 6] {
    let mut parallel = Dialect::openai();
    parallel.parallel_tool_calls = Some(false);
    [
        Dialect::openai(),
        parallel,
        Dialect::llama_cpp(),
        Dialect::vllm(),
        Dialect::ollama(),
        Dialect::compatible(),
    ]
}

#[test]
fn request_bodies_of_every_dialect_match_the_request_schema() {
    let request = ChatRequest {
        model: Some("gpt-4.1".into()),
        messages: vec![
            ChatMessage::system("sys"),
            ChatMessage::user("u"),
            ChatMessage::Assistant {
                content: None,
                tool_calls: vec![
                    ToolCall {
                        id: "a".into(),
                        name: "f".into(),
                        arguments: "{}".into(),
                    },
                    ToolCall {
                        id: "b".into(),
                        name: "g".into(),
                        arguments: String::new(),
                    },
                ],
            },
            ChatMessage::tool("a", "ok"),
            ChatMessage::tool("b", ""),
            ChatMessage::assistant("done"),
        ],
        tools: vec![ToolDefinition {
            name: "f".into(),
            description: String::new(),
            parameters: json!({"type": "object", "properties": {}}),
        }]
        .into(),
        tool_choice: Some(ToolChoice::Function("f".into())),
        temperature: Some(1.5),
        max_tokens: Some(1),
        ..ChatRequest::default()
    };
    for dialect in dialects() {
        let provider = provider(dialect.clone());
        for stream in [false, true] {
            let body = provider.request_body(&request, stream).unwrap();
            contract::check_request(&body, &format!("{} stream={stream}", dialect.name));
        }
    }
}

fn arb_text() -> impl Strategy<Value = String> {
    "[ -~é\n]{0,24}"
}

fn arb_call() -> impl Strategy<Value = ToolCall> {
    (
        "[a-z0-9_]{1,12}",
        "[a-z_]{1,12}",
        prop::option::of(0u32..1000),
    )
        .prop_map(|(id, name, n)| ToolCall {
            id,
            name,
            arguments: n.map(|n| format!("{{\"n\":{n}}}")).unwrap_or_default(),
        })
}

fn arb_message() -> impl Strategy<Value = ChatMessage> {
    prop_oneof![
        arb_text().prop_map(ChatMessage::system),
        arb_text().prop_map(ChatMessage::user),
        (
            prop::option::of(arb_text()),
            prop::collection::vec(arb_call(), 0..3)
        )
            .prop_map(|(content, tool_calls)| ChatMessage::Assistant {
                content: content.map(Into::into),
                tool_calls
            }),
        ("[a-z0-9_]{1,12}", arb_text()).prop_map(|(id, text)| ChatMessage::tool(id, text)),
    ]
}

fn arb_tool() -> impl Strategy<Value = ToolDefinition> {
    ("[a-zA-Z0-9_-]{1,20}", arb_text()).prop_map(|(name, description)| ToolDefinition {
        name,
        description,
        parameters: json!({"type": "object", "properties": {"q": {"type": "string"}}}),
    })
}

fn arb_request() -> impl Strategy<Value = ChatRequest> {
    (
        prop::collection::vec(arb_message(), 1..6),
        prop::collection::vec(arb_tool(), 0..3),
        prop::option::of(prop_oneof![
            Just(ToolChoice::Auto),
            Just(ToolChoice::None),
            Just(ToolChoice::Required),
            "[a-z_]{1,10}".prop_map(ToolChoice::Function),
        ]),
        prop::option::of(0.0f32..2.0),
        prop::option::of(1u32..100_000),
        prop::option::of("[a-z0-9.-]{1,16}"),
    )
        .prop_map(
            |(messages, tools, tool_choice, temperature, max_tokens, model)| ChatRequest {
                agent: None,
                model,
                messages,
                tools: tools.into(),
                tool_choice,
                temperature,
                max_tokens,
                ..ChatRequest::default()
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever spacebot asks, the body sent is a valid `CreateChatCompletionRequest`, in every
    /// dialect, streamed or not.
    #[test]
    fn any_request_body_matches_the_request_schema(request in arb_request(), stream: bool) {
        for dialect in dialects() {
            let body = provider(dialect.clone()).request_body(&request, stream).unwrap();
            contract::check_request(&body, &format!("{} stream={stream}", dialect.name));
        }
    }
}
