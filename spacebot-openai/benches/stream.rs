//! Throughput of the provider's pure parts: assembling a streamed answer from its chunks, and
//! building a request body.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use serde_json::json;
use spacebot_core::{ChatMessage, ChatRequest, ToolCall, ToolDefinition};
use spacebot_openai::{OpenAiConfig, OpenAiProvider, StreamAssembler};
use std::hint::black_box;
use std::sync::Arc;

fn text_chunks(n: usize) -> Vec<String> {
    let mut chunks: Vec<String> = (0..n)
        .map(|i| {
            json!({
                "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                "model": "gpt-4o-mini",
                "choices": [{"index": 0, "delta": {"content": format!(" word{i}")}, "finish_reason": null}]
            })
            .to_string()
        })
        .collect();
    chunks
        .push(json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}).to_string());
    chunks.push("[DONE]".to_owned());
    chunks
}

fn tool_chunks(n: usize) -> Vec<String> {
    let mut chunks = vec![json!({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "write", "arguments": "{\"text\":\""}}
    ]}, "finish_reason": null}]})
    .to_string()];
    for i in 0..n {
        chunks.push(
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "function": {"arguments": format!("part {i} ")}}
            ]}, "finish_reason": null}]})
            .to_string(),
        );
    }
    chunks.push(
        json!({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": "\"}"}}
    ]}, "finish_reason": "tool_calls"}]})
        .to_string(),
    );
    chunks.push("[DONE]".to_owned());
    chunks
}

fn assemble(chunks: &[String]) -> usize {
    let mut asm = StreamAssembler::new();
    let mut events = 0;
    for chunk in chunks {
        events += asm.feed(chunk).map(|e| e.len()).unwrap_or(0);
    }
    let response = asm.finish().map(|r| r.tool_calls.len()).unwrap_or(0);
    events + response
}

fn bench_assembly(c: &mut Criterion) {
    let mut group = c.benchmark_group("stream_assembly");
    for n in [100, 1_000] {
        let text = text_chunks(n);
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::new("text", n), &text, |b, chunks| {
            b.iter(|| assemble(black_box(chunks)))
        });
        let tools = tool_chunks(n);
        group.bench_with_input(
            BenchmarkId::new("tool_arguments", n),
            &tools,
            |b, chunks| b.iter(|| assemble(black_box(chunks))),
        );
    }
    group.finish();
}

fn bench_request(c: &mut Criterion) {
    let clock = Arc::new(spacebot_core::ManualClock::new(0));
    let Ok(provider) = OpenAiProvider::new(OpenAiConfig::new("gpt-4o-mini"), clock) else {
        return;
    };
    let mut messages = vec![ChatMessage::system("You are a researcher in a small team.")];
    for i in 0..25 {
        messages.push(ChatMessage::user(format!(
            "question {i}: what did you find?"
        )));
        messages.push(ChatMessage::Assistant {
            content: None,
            tool_calls: vec![ToolCall {
                id: format!("call_{i}"),
                name: "search".into(),
                arguments: format!("{{\"q\":\"topic {i}\"}}"),
            }],
        });
        messages.push(ChatMessage::tool(format!("call_{i}"), "three results"));
    }
    let request = ChatRequest {
        messages,
        tools: (0..8)
            .map(|i| ToolDefinition {
                name: format!("tool_{i}"),
                description: "Does one thing well.".into(),
                parameters: json!({"type": "object", "properties": {"q": {"type": "string"}}}),
            })
            .collect(),
        ..ChatRequest::default()
    };
    c.bench_function("request_body/76_messages_8_tools", |b| {
        b.iter(|| provider.request_body(black_box(&request), true).is_ok())
    });
}

criterion_group!(benches, bench_assembly, bench_request);
criterion_main!(benches);
