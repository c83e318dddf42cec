//! The Chat Completions wire format (private) and its mapping to and from spacebot-core's types.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use spacebot_core::LlmError;
use spacebot_core::llm::{
    ChatMessage, ChatRequest, ChatResponse, FinishReason, ToolCall, ToolChoice, Usage,
};

use crate::config::{Dialect, MaxTokensField, ToolChoicePolicy};
use crate::error::{ErrorDetail, stream_error};

/// A request body.
#[derive(Debug, Serialize)]
pub(crate) struct WireRequest<'a> {
    pub(crate) model: &'a str,
    pub(crate) messages: Vec<WireMessage<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) tools: Vec<WireTool<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tool_choice: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) parallel_tool_calls: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) max_completion_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) max_tokens: Option<u32>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub(crate) stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) stream_options: Option<StreamOptions>,
}

#[derive(Debug, Serialize)]
pub(crate) struct StreamOptions {
    pub(crate) include_usage: bool,
}

#[derive(Debug, Serialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub(crate) enum WireMessage<'a> {
    System {
        content: &'a str,
    },
    User {
        content: &'a str,
    },
    Assistant {
        // `None` is written as `null`: OpenAI accepts it next to tool calls; dialects without
        // `null_content_with_tool_calls` get `""` instead.
        content: Option<&'a str>,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        tool_calls: Vec<WireToolCallOut<'a>>,
    },
    Tool {
        tool_call_id: &'a str,
        content: &'a str,
    },
}

#[derive(Debug, Serialize)]
pub(crate) struct WireToolCallOut<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: WireFunctionOut<'a>,
}

#[derive(Debug, Serialize)]
pub(crate) struct WireFunctionOut<'a> {
    name: &'a str,
    arguments: &'a str,
}

#[derive(Debug, Serialize)]
pub(crate) struct WireTool<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    function: WireFunctionDef<'a>,
}

#[derive(Debug, Serialize)]
pub(crate) struct WireFunctionDef<'a> {
    name: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    description: &'a str,
    parameters: &'a Value,
}

/// What the request body takes from the configuration.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Defaults<'a> {
    pub(crate) model: &'a str,
    pub(crate) max_tokens: Option<u32>,
    pub(crate) dialect: &'a Dialect,
}

/// Builds the request body for `request`, refusing what cannot be sent.
pub(crate) fn build_request<'a>(
    request: &'a ChatRequest,
    defaults: Defaults<'a>,
    stream: bool,
) -> Result<WireRequest<'a>, LlmError> {
    let dialect = defaults.dialect;
    let default_model = defaults.model;
    if request.messages.is_empty() {
        return Err(refused("messages", "at least one message is required"));
    }
    if !dialect.supports_tools && (!request.tools.is_empty() || request.tool_choice.is_some()) {
        return Err(refused(
            "tools",
            format!(
                "the {} dialect is configured without tool support, but the request offers {} tool(s)",
                dialect.name,
                request.tools.len()
            ),
        ));
    }
    if let Some(t) = request.temperature
        && (!t.is_finite() || t < 0.0)
    {
        return Err(refused(
            "temperature",
            format!("must be a finite number >= 0, got {t}"),
        ));
    }
    let model = request.model.as_deref().unwrap_or(default_model);
    if model.trim().is_empty() {
        return Err(refused("model", "must not be empty"));
    }

    let messages = request
        .messages
        .iter()
        .map(|m| match m {
            ChatMessage::System { content } => WireMessage::System { content },
            ChatMessage::User { content } => WireMessage::User { content },
            ChatMessage::Assistant {
                content,
                tool_calls,
            } => WireMessage::Assistant {
                content: match content.as_deref() {
                    Some(text) => Some(text),
                    None if tool_calls.is_empty() || !dialect.null_content_with_tool_calls => {
                        Some("")
                    }
                    None => None,
                },
                tool_calls: tool_calls
                    .iter()
                    .map(|c| WireToolCallOut {
                        id: &c.id,
                        kind: "function",
                        function: WireFunctionOut {
                            name: &c.name,
                            arguments: if c.arguments.trim().is_empty() {
                                "{}"
                            } else {
                                &c.arguments
                            },
                        },
                    })
                    .collect(),
            },
            ChatMessage::Tool {
                tool_call_id,
                content,
            } => WireMessage::Tool {
                tool_call_id,
                content,
            },
        })
        .collect();

    let tools: Vec<WireTool<'a>> = request
        .tools
        .iter()
        .map(|t| WireTool {
            kind: "function",
            function: WireFunctionDef {
                name: &t.name,
                description: &t.description,
                parameters: &t.parameters,
            },
        })
        .collect();

    // A choice without tools is not sent: OpenAI refuses `tool_choice` when no tools are given.
    let tool_choice = match (&request.tool_choice, dialect.tool_choice) {
        _ if tools.is_empty() => None,
        (Some(choice), _) => Some(match choice {
            ToolChoice::Auto => Value::from("auto"),
            ToolChoice::None => Value::from("none"),
            ToolChoice::Required => Value::from("required"),
            ToolChoice::Function(name) => serde_json::json!({
                "type": "function",
                "function": { "name": name },
            }),
        }),
        (None, ToolChoicePolicy::Auto) => Some(Value::from("auto")),
        (None, ToolChoicePolicy::Omit) => None,
    };
    let parallel_tool_calls = if tools.is_empty() {
        None
    } else {
        dialect.parallel_tool_calls
    };
    let limit = request.max_tokens.or(defaults.max_tokens);
    let (max_completion_tokens, max_tokens) = match dialect.max_tokens_field {
        MaxTokensField::MaxCompletionTokens => (limit, None),
        MaxTokensField::MaxTokens => (None, limit),
    };

    Ok(WireRequest {
        model,
        messages,
        tools,
        tool_choice,
        parallel_tool_calls,
        temperature: request.temperature,
        max_completion_tokens,
        max_tokens,
        stream,
        stream_options: (stream && dialect.stream_usage).then_some(StreamOptions {
            include_usage: true,
        }),
    })
}

/// A request the provider refuses to send. Core's error type has no variant for a request refused
/// before it reaches the server, so this is [`LlmError::Other`] with a message naming the field.
fn refused(what: &str, reason: impl std::fmt::Display) -> LlmError {
    LlmError::Other(format!("invalid request: {what}: {reason}"))
}

/// A non-streamed response body.
#[derive(Debug, Deserialize)]
pub(crate) struct WireResponse {
    #[serde(default)]
    choices: Vec<WireChoice>,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(default)]
    error: Option<ErrorDetail>,
}

#[derive(Debug, Deserialize)]
struct WireChoice {
    message: WireResponseMessage,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
struct WireResponseMessage {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    refusal: Option<String>,
    #[serde(default)]
    tool_calls: Vec<WireToolCallIn>,
}

#[derive(Debug, Deserialize)]
struct WireToolCallIn {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<WireFunctionIn>,
}

#[derive(Debug, Deserialize)]
struct WireFunctionIn {
    name: String,
    #[serde(default)]
    arguments: Option<String>,
}

/// Token usage as sent.
#[derive(Debug, Clone, Copy, Deserialize)]
pub(crate) struct WireUsage {
    #[serde(default)]
    prompt_tokens: u32,
    #[serde(default)]
    completion_tokens: u32,
    #[serde(default)]
    total_tokens: Option<u32>,
}

impl From<WireUsage> for Usage {
    fn from(u: WireUsage) -> Self {
        Usage {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u
                .total_tokens
                .unwrap_or_else(|| u.prompt_tokens.saturating_add(u.completion_tokens)),
        }
    }
}

/// Parses a non-streamed response body.
pub(crate) fn parse_response(body: &[u8], check_arguments: bool) -> Result<ChatResponse, LlmError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(LlmError::MalformedResponse(
            "the server sent an empty body with HTTP 200 instead of a chat completion".to_owned(),
        ));
    }
    let wire: WireResponse = serde_json::from_slice(body).map_err(|e| {
        LlmError::MalformedResponse(format!(
            "the response body is not a chat completion: {e} (body starts with {:?})",
            preview(body)
        ))
    })?;
    if let (true, Some(error)) = (wire.choices.is_empty(), wire.error) {
        // Some proxies answer HTTP 200 with an error object.
        return Err(stream_error(error));
    }
    let choice = wire
        .choices
        .into_iter()
        .next()
        .ok_or_else(|| LlmError::MalformedResponse("the response has no choices".to_owned()))?;
    let message = choice.message;
    let mut tool_calls = Vec::with_capacity(message.tool_calls.len());
    for (index, call) in message.tool_calls.into_iter().enumerate() {
        let Some(function) = call.function else {
            return Err(LlmError::MalformedResponse(format!(
                "tool call {index} is not a function call"
            )));
        };
        let call = ToolCall {
            id: call.id.unwrap_or_else(|| format!("call_{index}")),
            name: function.name,
            arguments: function.arguments.unwrap_or_default(),
        };
        tool_calls.push(check_tool_call(call, index, check_arguments)?);
    }
    Ok(ChatResponse {
        content: message.content.or(message.refusal),
        tool_calls,
        finish_reason: choice.finish_reason.as_deref().map(finish_reason),
        usage: wire.usage.map(Usage::from),
    })
}

/// Checks one finished tool call: it must have a name. Empty arguments become `{}`.
///
/// Arguments that are not a JSON object are an error naming the tool when `check_arguments`;
/// otherwise they are reported (a `tracing` warning) and passed on exactly as the model wrote them,
/// for the runtime to answer the model with the parse error as the tool result.
pub(crate) fn check_tool_call(
    mut call: ToolCall,
    index: usize,
    check_arguments: bool,
) -> Result<ToolCall, LlmError> {
    if call.name.is_empty() {
        return Err(LlmError::MalformedResponse(format!(
            "tool call {index} (id {:?}) has no tool name",
            call.id
        )));
    }
    if call.arguments.trim().is_empty() {
        call.arguments = "{}".to_owned();
        return Ok(call);
    }
    let problem = match serde_json::from_str::<Value>(&call.arguments) {
        Ok(Value::Object(_)) => return Ok(call),
        Ok(other) => format!("are JSON but not an object: {}", kind_of(&other)),
        Err(e) => format!(
            "are not valid JSON: {e}: {:?}",
            preview(call.arguments.as_bytes())
        ),
    };
    if check_arguments {
        return Err(LlmError::MalformedResponse(format!(
            "the arguments of tool call {index} to `{}` (id {:?}) {problem}",
            call.name, call.id
        )));
    }
    tracing::warn!(
        tool = %call.name,
        call_id = %call.id,
        index,
        "the model sent tool-call arguments that {problem}; passing them on as written"
    );
    Ok(call)
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Maps a finish reason as sent.
pub(crate) fn finish_reason(reason: &str) -> FinishReason {
    match reason {
        "stop" => FinishReason::Stop,
        "tool_calls" | "function_call" => FinishReason::ToolCalls,
        "length" => FinishReason::Length,
        "content_filter" => FinishReason::ContentFilter,
        other => FinishReason::Other(other.to_owned()),
    }
}

/// The first 200 characters of a body, for error messages.
pub(crate) fn preview(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let mut out: String = text.chars().take(200).collect();
    if text.chars().count() > 200 {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use spacebot_core::ToolDefinition;

    fn body(request: &ChatRequest, dialect: &Dialect, stream: bool) -> Value {
        serde_json::to_value(
            build_request(request, defaults("default-model", dialect), stream).unwrap(),
        )
        .unwrap()
    }

    fn defaults<'a>(model: &'a str, dialect: &'a Dialect) -> Defaults<'a> {
        Defaults {
            model,
            max_tokens: None,
            dialect,
        }
    }

    fn history() -> ChatRequest {
        ChatRequest {
            messages: vec![
                ChatMessage::system("be brief"),
                ChatMessage::user("weather in Paris?"),
                ChatMessage::Assistant {
                    content: None,
                    tool_calls: vec![ToolCall {
                        id: "call_1".into(),
                        name: "get_weather".into(),
                        arguments: "{\"city\":\"Paris\"}".into(),
                    }],
                },
                ChatMessage::tool("call_1", "sunny"),
            ],
            tools: vec![ToolDefinition {
                name: "get_weather".into(),
                description: "Weather for a city".into(),
                parameters: serde_json::json!({"type":"object","properties":{"city":{"type":"string"}}}),
            }]
            .into(),
            tool_choice: Some(ToolChoice::Function("get_weather".into())),
            temperature: Some(0.2),
            max_tokens: Some(64),
            ..ChatRequest::default()
        }
    }

    #[test]
    fn openai_body() {
        let b = body(&history(), &Dialect::openai(), false);
        assert_eq!(b["model"], "default-model");
        assert_eq!(b["messages"][2]["content"], Value::Null);
        assert_eq!(
            b["messages"][2]["tool_calls"][0]["function"]["name"],
            "get_weather"
        );
        assert_eq!(b["messages"][3]["role"], "tool");
        assert_eq!(b["tool_choice"]["function"]["name"], "get_weather");
        assert_eq!(b["max_completion_tokens"], 64);
        assert!(b.get("max_tokens").is_none());
        assert!(b.get("stream").is_none());
        assert_eq!(
            b["temperature"].as_f64().map(|t| (t * 10.0).round()),
            Some(2.0)
        );
    }

    #[test]
    fn llama_cpp_body() {
        let mut dialect = Dialect::llama_cpp();
        dialect.parallel_tool_calls = Some(false);
        let b = body(&history(), &dialect, true);
        assert_eq!(b["messages"][2]["content"], "");
        assert_eq!(b["max_tokens"], 64);
        assert_eq!(b["parallel_tool_calls"], false);
        assert_eq!(b["stream"], true);
        assert!(b.get("stream_options").is_none());
        let b = body(&history(), &Dialect::openai(), true);
        assert_eq!(b["stream_options"]["include_usage"], true);
    }

    #[test]
    fn tool_choice_policy_applies_only_when_tools_are_offered_and_no_choice_is_named() {
        let mut r = history();
        r.tool_choice = None;
        assert_eq!(
            body(&r, &Dialect::llama_cpp(), false)["tool_choice"],
            "auto"
        );
        assert!(
            body(&r, &Dialect::openai(), false)
                .get("tool_choice")
                .is_none()
        );
        r.tool_choice = Some(ToolChoice::None);
        assert_eq!(
            body(&r, &Dialect::llama_cpp(), false)["tool_choice"],
            "none"
        );
        r.tools = Default::default();
        assert!(
            body(&r, &Dialect::llama_cpp(), false)
                .get("tool_choice")
                .is_none()
        );
    }

    #[test]
    fn the_configured_token_limit_applies_when_the_request_sets_none() {
        let mut r = history();
        r.max_tokens = None;
        let dialect = Dialect::vllm();
        let with_default = Defaults {
            max_tokens: Some(512),
            ..defaults("m", &dialect)
        };
        let b = serde_json::to_value(build_request(&r, with_default, false).unwrap()).unwrap();
        assert_eq!(b["max_tokens"], 512);
        r.max_tokens = Some(8);
        let b = serde_json::to_value(build_request(&r, with_default, false).unwrap()).unwrap();
        assert_eq!(b["max_tokens"], 8);
    }

    #[test]
    fn refuses_what_cannot_be_sent() {
        let mut dialect = Dialect::openai();
        dialect.supports_tools = false;
        let err = build_request(&history(), defaults("m", &dialect), false).unwrap_err();
        assert!(err.to_string().contains("tools"), "{err}");
        let mut r = history();
        r.temperature = Some(f32::NAN);
        let err = build_request(&r, defaults("m", &Dialect::openai()), false).unwrap_err();
        assert!(err.to_string().contains("temperature"), "{err}");
        let err = build_request(
            &ChatRequest::default(),
            defaults("m", &Dialect::openai()),
            false,
        )
        .unwrap_err();
        assert!(err.to_string().contains("messages"), "{err}");
    }

    #[test]
    fn bad_tool_arguments_name_the_tool() {
        let call = ToolCall {
            id: "c".into(),
            name: "lookup".into(),
            arguments: "{\"q\": ".into(),
        };
        let err = check_tool_call(call.clone(), 0, true).unwrap_err();
        assert_eq!(check_tool_call(call.clone(), 0, false).unwrap(), call);
        assert!(matches!(err, LlmError::MalformedResponse(_)));
        assert!(err.to_string().contains("`lookup`"), "{err}");
        let call = ToolCall {
            id: "c".into(),
            name: "lookup".into(),
            arguments: "[1]".into(),
        };
        assert!(
            check_tool_call(call, 0, true)
                .unwrap_err()
                .to_string()
                .contains("an array")
        );
    }
}
