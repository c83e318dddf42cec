//! Assembling a streamed completion from its server-sent chunks.
//!
//! [`StreamAssembler`] is pure: it takes the `data` of each event and returns the
//! [`StreamEvent`]s to pass on, then the assembled [`ChatResponse`]. The provider feeds it from the
//! HTTP body; tests and benches feed it directly.

use serde::Deserialize;
use spacebot_core::LlmError;
use spacebot_core::llm::{ChatResponse, FinishReason, StreamEvent, ToolCall, Usage};

use crate::error::{ErrorDetail, stream_error};
use crate::wire::{WireUsage, check_tool_call, finish_reason, preview};

#[derive(Debug, Deserialize)]
struct WireChunk {
    #[serde(default)]
    choices: Vec<ChunkChoice>,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(default)]
    error: Option<ErrorDetail>,
}

#[derive(Debug, Deserialize)]
struct ChunkChoice {
    #[serde(default)]
    index: u32,
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    refusal: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<ToolCallChunk>>,
}

#[derive(Debug, Deserialize)]
struct ToolCallChunk {
    #[serde(default)]
    index: Option<u32>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<FunctionChunk>,
}

#[derive(Debug, Deserialize)]
struct FunctionChunk {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

#[derive(Debug, Default)]
struct PartialCall {
    wire_index: u32,
    id: Option<String>,
    name: String,
    arguments: String,
}

/// Builds a [`ChatResponse`] from the `data` fields of a Chat Completions event stream.
///
/// Tolerates what compatible servers do differently: a tool call's id and name repeated in every
/// chunk (passed on once), tool calls sent whole under one index with distinct ids (each becomes
/// its own call), no usage chunk, usage inside the last content chunk, and no `[DONE]` after a
/// finish reason.
///
/// ```
/// use spacebot_openai::StreamAssembler;
/// let mut asm = StreamAssembler::new();
/// asm.feed(r#"{"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}"#)?;
/// asm.feed(r#"{"choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":"stop"}]}"#)?;
/// asm.feed("[DONE]")?;
/// assert!(asm.is_complete());
/// assert_eq!(asm.finish()?.content.as_deref(), Some("Hello"));
/// # Ok::<(), spacebot_core::LlmError>(())
/// ```
#[derive(Debug, Default)]
pub struct StreamAssembler {
    content: String,
    refusal: String,
    calls: Vec<PartialCall>,
    finish_reason: Option<FinishReason>,
    usage: Option<Usage>,
    done: bool,
    chunks: usize,
    check_arguments: bool,
}

impl StreamAssembler {
    /// An empty assembler.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes the `data` of one event and returns the events to pass on.
    ///
    /// `[DONE]` marks the end. A chunk that is not JSON, or an error object sent inside the
    /// stream, is an error.
    pub fn feed(&mut self, data: &str) -> Result<Vec<StreamEvent>, LlmError> {
        let data = data.trim();
        if data == "[DONE]" {
            self.done = true;
            return Ok(Vec::new());
        }
        if data.is_empty() {
            return Ok(Vec::new());
        }
        self.chunks += 1;
        let chunk: WireChunk = serde_json::from_str(data).map_err(|e| {
            LlmError::MalformedResponse(format!(
                "stream chunk {} is not a chat completion chunk: {e} (data: {:?})",
                self.chunks,
                preview(data.as_bytes())
            ))
        })?;
        if let Some(error) = chunk.error {
            return Err(stream_error(error));
        }
        if let Some(usage) = chunk.usage {
            self.usage = Some(usage.into());
        }
        let mut events = Vec::new();
        for choice in chunk.choices.into_iter().filter(|c| c.index == 0) {
            if let Some(delta) = choice.delta {
                if let Some(text) = delta.content.filter(|t| !t.is_empty()) {
                    self.content.push_str(&text);
                    events.push(StreamEvent::TextDelta { text });
                }
                if let Some(refusal) = delta.refusal {
                    self.refusal.push_str(&refusal);
                }
                for call in delta.tool_calls.unwrap_or_default() {
                    if let Some(event) = self.tool_call_chunk(call) {
                        events.push(event);
                    }
                }
            }
            if let Some(reason) = choice.finish_reason {
                self.finish_reason = Some(finish_reason(&reason));
            }
        }
        Ok(events)
    }

    fn tool_call_chunk(&mut self, chunk: ToolCallChunk) -> Option<StreamEvent> {
        let wire_index = chunk
            .index
            .or_else(|| self.calls.last().map(|c| c.wire_index))
            .unwrap_or(0);
        let (name, arguments) = match chunk.function {
            Some(f) => (f.name, f.arguments.unwrap_or_default()),
            None => (None, String::new()),
        };
        let id = chunk.id.filter(|id| !id.is_empty());
        let name = name.filter(|n| !n.is_empty());
        let existing = self.calls.iter().rposition(|c| c.wire_index == wire_index);
        // A different id under an index already in use starts a new call (servers that send each
        // call whole under index 0).
        let position = match (existing, &id) {
            (Some(p), Some(id)) if self.calls[p].id.as_ref().is_some_and(|old| old != id) => None,
            (p, _) => p,
        };
        let position = match position {
            Some(p) => p,
            None => {
                self.calls.push(PartialCall {
                    wire_index,
                    ..PartialCall::default()
                });
                self.calls.len() - 1
            }
        };
        let call = &mut self.calls[position];
        let new_id = match id {
            Some(id) if call.id.is_none() => {
                call.id = Some(id.clone());
                Some(id)
            }
            _ => None,
        };
        let new_name = match name {
            Some(name) if call.name.is_empty() => {
                call.name.clone_from(&name);
                Some(name)
            }
            // Repeated whole (llama.cpp): nothing new.
            Some(name) if call.name == name => None,
            Some(name) => {
                call.name.push_str(&name);
                Some(name)
            }
            None => None,
        };
        call.arguments.push_str(&arguments);
        if new_id.is_none() && new_name.is_none() && arguments.is_empty() {
            return None;
        }
        Some(StreamEvent::ToolCallDelta {
            index: u32::try_from(position).unwrap_or(u32::MAX),
            id: new_id,
            name: new_name,
            arguments,
        })
    }

    /// Whether [`finish`](Self::finish) refuses tool-call arguments that are not a JSON object.
    /// Off by default: such arguments are reported (a `tracing` warning) and passed on as the
    /// model wrote them (see [`OpenAiConfig::check_tool_arguments`](crate::OpenAiConfig::check_tool_arguments)).
    pub fn check_arguments(mut self, check: bool) -> Self {
        self.check_arguments = check;
        self
    }

    /// Whether the stream said it was over: `[DONE]` arrived, or a finish reason did (some servers
    /// end without `[DONE]`). A body that ends before this was cut.
    pub fn is_complete(&self) -> bool {
        self.done || self.finish_reason.is_some()
    }

    /// Whether `[DONE]` arrived.
    pub fn saw_done(&self) -> bool {
        self.done
    }

    /// Chunks received so far (`[DONE]` not counted).
    pub fn chunks(&self) -> usize {
        self.chunks
    }

    /// The assembled response. A tool call without a name is an error; arguments that are not a
    /// JSON object are an error naming the tool only with [`check_arguments`](Self::check_arguments)
    /// on, and otherwise kept as sent.
    pub fn finish(self) -> Result<ChatResponse, LlmError> {
        let mut tool_calls = Vec::with_capacity(self.calls.len());
        for (index, call) in self.calls.into_iter().enumerate() {
            let call = ToolCall {
                id: call.id.unwrap_or_else(|| format!("call_{index}")),
                name: call.name,
                arguments: call.arguments,
            };
            tool_calls.push(check_tool_call(call, index, self.check_arguments)?);
        }
        let content = if !self.content.is_empty() {
            Some(self.content)
        } else if !self.refusal.is_empty() {
            Some(self.refusal)
        } else {
            None
        };
        Ok(ChatResponse {
            content,
            tool_calls,
            finish_reason: self.finish_reason,
            usage: self.usage,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn chunk(delta: serde_json::Value, finish: Option<&str>) -> String {
        serde_json::json!({"choices":[{"index":0,"delta":delta,"finish_reason":finish}]})
            .to_string()
    }

    #[test]
    fn repeated_id_and_name_are_passed_on_once() {
        let mut asm = StreamAssembler::new();
        let mut events = Vec::new();
        for part in ["{\"a\":", "1}"] {
            events.extend(
                asm.feed(&chunk(
                    serde_json::json!({"tool_calls":[{"index":0,"id":"c1","type":"function","function":{"name":"f","arguments":part}}]}),
                    None,
                ))
                .unwrap(),
            );
        }
        asm.feed(&chunk(serde_json::json!({}), Some("tool_calls")))
            .unwrap();
        assert_eq!(
            events,
            vec![
                StreamEvent::ToolCallDelta {
                    index: 0,
                    id: Some("c1".into()),
                    name: Some("f".into()),
                    arguments: "{\"a\":".into()
                },
                StreamEvent::ToolCallDelta {
                    index: 0,
                    id: None,
                    name: None,
                    arguments: "1}".into()
                },
            ]
        );
        let response = asm.finish().unwrap();
        assert_eq!(response.tool_calls.len(), 1);
        assert_eq!(response.tool_calls[0].arguments, "{\"a\":1}");
        assert_eq!(response.finish_reason, Some(FinishReason::ToolCalls));
    }

    #[test]
    fn distinct_ids_under_one_index_are_distinct_calls() {
        let mut asm = StreamAssembler::new();
        for (id, name) in [("a", "f"), ("b", "g")] {
            asm.feed(&chunk(
                serde_json::json!({"tool_calls":[{"index":0,"id":id,"function":{"name":name,"arguments":"{}"}}]}),
                None,
            ))
            .unwrap();
        }
        let calls = asm.finish().unwrap().tool_calls;
        let names: Vec<&str> = calls.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["f", "g"]);
    }

    #[test]
    fn errors_inside_the_stream_and_bad_chunks() {
        let mut asm = StreamAssembler::new();
        let err = asm.feed("{\"choices\": [").unwrap_err();
        assert!(err.to_string().contains("stream chunk 1"), "{err}");
        let err = asm
            .feed(r#"{"error":{"message":"overloaded","type":"server_error"}}"#)
            .unwrap_err();
        assert!(matches!(err, LlmError::Server { .. }), "{err}");
    }

    proptest! {
        /// However the server splits text and arguments into chunks, the assembled response is
        /// the same, and the deltas add up to it.
        #[test]
        fn any_split_assembles_the_same(
            text in "[a-zé ]{0,40}",
            value in 0u32..100_000,
            cuts in proptest::collection::vec(0usize..64, 0..6),
        ) {
            let arguments = format!("{{\"n\":{value},\"s\":\"x y\"}}");
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (arguments.len() + 1)).collect();
            cuts.sort_unstable();
            cuts.dedup();
            let mut pieces = Vec::new();
            let mut start = 0;
            for cut in cuts.into_iter().chain([arguments.len()]) {
                pieces.push(&arguments[start..cut]);
                start = cut;
            }
            let mut asm = StreamAssembler::new();
            let mut events = Vec::new();
            for ch in text.chars() {
                events.extend(asm.feed(&chunk(serde_json::json!({"content": ch.to_string()}), None)).unwrap());
            }
            for (i, piece) in pieces.iter().enumerate() {
                let call = if i == 0 {
                    serde_json::json!({"index":0,"id":"c","type":"function","function":{"name":"t","arguments":piece}})
                } else {
                    serde_json::json!({"index":0,"function":{"arguments":piece}})
                };
                events.extend(asm.feed(&chunk(serde_json::json!({"tool_calls":[call]}), None)).unwrap());
            }
            asm.feed(&chunk(serde_json::json!({}), Some("tool_calls"))).unwrap();
            asm.feed("[DONE]").unwrap();
            let response = asm.finish().unwrap();
            let streamed_text: String = events.iter().filter_map(|e| match e {
                StreamEvent::TextDelta { text } => Some(text.as_str()),
                _ => None,
            }).collect();
            let streamed_args: String = events.iter().filter_map(|e| match e {
                StreamEvent::ToolCallDelta { arguments, .. } => Some(arguments.as_str()),
                _ => None,
            }).collect();
            prop_assert_eq!(response.content.clone().unwrap_or_default(), text.clone());
            prop_assert_eq!(&streamed_text, &text);
            prop_assert_eq!(&streamed_args, &arguments);
            prop_assert_eq!(&response.tool_calls[0].arguments, &arguments);
        }
    }
}
