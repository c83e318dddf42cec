//! The LLM provider trait and the provider-neutral request and response types.
//!
//! Providers (such as `spacebot-openai`) keep their wire types private and speak only these.

use std::fmt;

use async_trait::async_trait;
use futures::stream::BoxStream;
use serde::{Deserialize, Serialize};

use crate::envelope::EnvelopeKind;
use crate::error::LlmError;
use crate::ids::{AgentId, ChannelId};
use crate::text::Text;

/// One message of a chat request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "role")]
pub enum ChatMessage {
    /// Instructions.
    System {
        /// Text.
        content: Text,
    },
    /// Input (a user, a peer agent, a system retrigger).
    User {
        /// Text.
        content: Text,
    },
    /// The model's earlier output.
    Assistant {
        /// Text, if any.
        content: Option<Text>,
        /// Tool calls, if any.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        tool_calls: Vec<ToolCall>,
    },
    /// A tool's result.
    Tool {
        /// The call this answers.
        tool_call_id: String,
        /// The result text.
        content: Text,
    },
}

impl ChatMessage {
    /// A system message.
    pub fn system(content: impl Into<Text>) -> Self {
        Self::System {
            content: content.into(),
        }
    }
    /// A user message.
    pub fn user(content: impl Into<Text>) -> Self {
        Self::User {
            content: content.into(),
        }
    }
    /// An assistant text message.
    pub fn assistant(content: impl Into<Text>) -> Self {
        Self::Assistant {
            content: Some(content.into()),
            tool_calls: Vec::new(),
        }
    }
    /// A tool result.
    pub fn tool(tool_call_id: impl Into<String>, content: impl Into<Text>) -> Self {
        Self::Tool {
            tool_call_id: tool_call_id.into(),
            content: content.into(),
        }
    }
}

/// A tool call the model asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call id (echoed in the tool result).
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments as the model wrote them: a JSON text that may be malformed.
    pub arguments: String,
}

/// A tool the model may call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolDefinition {
    /// Name.
    pub name: String,
    /// What it does, for the model.
    pub description: String,
    /// JSON Schema of the arguments object.
    pub parameters: serde_json::Value,
}

impl ToolDefinition {
    /// A tool definition.
    ///
    /// ```
    /// let t = spacebot_core::ToolDefinition::new("echo", "Echoes.", serde_json::json!({"type": "object"}));
    /// assert_eq!(t.name, "echo");
    /// ```
    pub fn new(
        name: impl Into<String>,
        description: impl Into<String>,
        parameters: serde_json::Value,
    ) -> Self {
        Self {
            name: name.into(),
            description: description.into(),
            parameters,
        }
    }
}

/// Whether and which tools the model must call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolChoice {
    /// The model decides.
    Auto,
    /// No tools.
    None,
    /// At least one tool.
    Required,
    /// This tool.
    Function(String),
}

/// A chat completion request.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ChatRequest {
    /// The agent asking (providers may ignore it; the mock LLM scripts per agent).
    pub agent: Option<AgentId>,
    /// Model name; `None` for the provider's default.
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Tools offered. Shared (`Arc`): the runtime renders an agent's definitions once per link
    /// graph and hands the same list to every request (build one with `vec![...].into()`).
    pub tools: std::sync::Arc<[ToolDefinition]>,
    /// Tool choice.
    pub tool_choice: Option<ToolChoice>,
    /// Sampling temperature.
    pub temperature: Option<f32>,
    /// Output token limit.
    pub max_tokens: Option<u32>,
    /// The agent's channel the turn answers in (providers ignore it; mock models may script by it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channel: Option<ChannelId>,
    /// The kind of envelope the model is answering right now (a user message, a task, a
    /// conversation message, a retrigger); after a steer, the kind of the steering envelope.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub envelope_kind: Option<EnvelopeKind>,
}

/// Token usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Completion tokens.
    pub completion_tokens: u32,
    /// Total.
    pub total_tokens: u32,
}

impl Usage {
    /// The sum of two usages (saturating).
    pub fn plus(self, other: Usage) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens.saturating_add(other.prompt_tokens),
            completion_tokens: self
                .completion_tokens
                .saturating_add(other.completion_tokens),
            total_tokens: self.total_tokens.saturating_add(other.total_tokens),
        }
    }

    /// Whether nothing was counted.
    pub fn is_zero(&self) -> bool {
        *self == Usage::default()
    }
}

/// Why the model stopped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum FinishReason {
    /// A natural end.
    Stop,
    /// It asked for tools.
    ToolCalls,
    /// The token limit.
    Length,
    /// Filtered.
    ContentFilter,
    /// Anything else the server said.
    Other(String),
}

/// A chat completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatResponse {
    /// Text, if any.
    pub content: Option<String>,
    /// Tool calls, if any.
    pub tool_calls: Vec<ToolCall>,
    /// Why it stopped.
    pub finish_reason: Option<FinishReason>,
    /// Usage, where the server reports it.
    pub usage: Option<Usage>,
}

impl ChatResponse {
    /// A text answer.
    pub fn text(content: impl Into<String>) -> Self {
        Self {
            content: Some(content.into()),
            tool_calls: Vec::new(),
            finish_reason: Some(FinishReason::Stop),
            usage: None,
        }
    }

    /// An answer that calls tools.
    pub fn tool_calls(calls: Vec<ToolCall>) -> Self {
        Self {
            content: None,
            tool_calls: calls,
            finish_reason: Some(FinishReason::ToolCalls),
            usage: None,
        }
    }

    /// This response as the assistant message to append to the history.
    pub fn to_message(&self) -> ChatMessage {
        ChatMessage::Assistant {
            content: self.content.as_deref().map(Text::from),
            tool_calls: self.tool_calls.clone(),
        }
    }
}

/// A piece of a streamed completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "type")]
#[non_exhaustive]
pub enum StreamEvent {
    /// More text.
    TextDelta {
        /// The text.
        text: String,
    },
    /// A fragment of a tool call (arguments arrive in pieces).
    ToolCallDelta {
        /// Position of the call in the response.
        index: u32,
        /// The call id, when this fragment carries it.
        id: Option<String>,
        /// The tool name, when this fragment carries it.
        name: Option<String>,
        /// More argument text.
        arguments: String,
    },
    /// The assembled response; always the last event of a successful stream.
    Done(ChatResponse),
}

/// A chat-completion model with tools.
///
/// # Contract
/// - `complete` returns the whole answer or a typed [`LlmError`]; it never panics on bad server
///   output (that is [`LlmError::MalformedResponse`]).
/// - `stream` yields deltas and ends with exactly one [`StreamEvent::Done`] carrying the same
///   response `complete` would have returned; a stream cut mid-way ends with an error instead.
///   The default implementation calls `complete` and yields only `Done`.
/// - Retries, if any, are the provider's business and are timed by the [`Clock`](crate::Clock).
#[async_trait]
pub trait LlmProvider: Send + Sync + fmt::Debug {
    /// One completion.
    async fn complete(&self, request: ChatRequest) -> Result<ChatResponse, LlmError>;

    /// The provider's name for telemetry (`gen_ai.provider.name`: `openai`, ...). Defaults to
    /// `_OTHER`, as the OpenTelemetry conventions name a provider they do not know.
    fn provider_name(&self) -> &str {
        "_OTHER"
    }

    /// The model a request without [`ChatRequest::model`] gets, when the provider knows it: for
    /// telemetry (`gen_ai.request.model`) and the price table
    /// ([`Settings::prices`](crate::config::Settings::prices), whose `default` entry applies
    /// otherwise).
    fn default_model(&self) -> Option<&str> {
        None
    }

    /// A streamed completion.
    async fn stream(
        &self,
        request: ChatRequest,
    ) -> Result<BoxStream<'static, Result<StreamEvent, LlmError>>, LlmError> {
        let response = self.complete(request).await?;
        Ok(Box::pin(futures::stream::once(async move {
            Ok(StreamEvent::Done(response))
        })))
    }

    /// The context window of `model` (the provider's default model for `None`) in tokens, when
    /// the provider knows it (see [`crate::context`]). The default knows none.
    fn context_window(&self, model: Option<&str>) -> Option<u32> {
        let _ = model;
        None
    }

    /// The token counter for `model` (the provider's default model for `None`); `None`, the
    /// default, lets the runtime estimate ([`EstimateCounter`](crate::context::EstimateCounter)).
    fn token_counter(
        &self,
        model: Option<&str>,
    ) -> Option<std::sync::Arc<dyn crate::context::TokenCounter>> {
        let _ = model;
        None
    }
}

/// A `dyn` provider.
pub type DynLlmProvider = dyn LlmProvider;

#[async_trait]
impl<T: LlmProvider + ?Sized> LlmProvider for std::sync::Arc<T> {
    async fn complete(&self, request: ChatRequest) -> Result<ChatResponse, LlmError> {
        (**self).complete(request).await
    }
    fn provider_name(&self) -> &str {
        (**self).provider_name()
    }
    fn default_model(&self) -> Option<&str> {
        (**self).default_model()
    }
    async fn stream(
        &self,
        request: ChatRequest,
    ) -> Result<BoxStream<'static, Result<StreamEvent, LlmError>>, LlmError> {
        (**self).stream(request).await
    }
    fn context_window(&self, model: Option<&str>) -> Option<u32> {
        (**self).context_window(model)
    }
    fn token_counter(
        &self,
        model: Option<&str>,
    ) -> Option<std::sync::Arc<dyn crate::context::TokenCounter>> {
        (**self).token_counter(model)
    }
}
