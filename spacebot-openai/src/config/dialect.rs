//! How a Chat Completions server differs from OpenAI, as data.

/// Which field carries the output token limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MaxTokensField {
    /// `max_completion_tokens` (OpenAI; `max_tokens` is deprecated there and refused by
    /// reasoning models).
    #[default]
    MaxCompletionTokens,
    /// `max_tokens` (most other servers).
    MaxTokens,
}

/// What to send as `tool_choice` when the request offers tools but names no
/// [`ToolChoice`](spacebot_core::llm::ToolChoice) (the runtime never names one).
///
/// A choice the request names is always sent as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ToolChoicePolicy {
    /// Send no `tool_choice` and leave the server's default (OpenAI's default with tools is
    /// `"auto"`).
    #[default]
    Omit,
    /// Send `"auto"` whenever tools are offered. llama-cpp-python ignores `tools` when
    /// `tool_choice` is absent, so its model never sees them without this.
    Auto,
}

/// The small ways servers that speak the Chat Completions dialect differ from OpenAI, as data.
///
/// One provider serves them all; pick a preset ([`Dialect::openai`], [`Dialect::llama_cpp`],
/// [`Dialect::vllm`], [`Dialect::ollama`], [`Dialect::compatible`]) and change single switches as
/// needed. Some differences need no switch and are always tolerated: streamed tool-call chunks that
/// repeat the call's id and name, streams without a usage chunk or without the final `[DONE]` after a
/// finish reason, and tool calls streamed whole under one index with distinct ids.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Dialect {
    /// A name for messages and logs (`openai`, `llama.cpp`, ...).
    pub name: &'static str,
    /// The server accepts `tools` and `tool_choice`. When false, a request that offers tools is
    /// refused before it is sent.
    pub supports_tools: bool,
    /// Ask for token usage at the end of a stream (`stream_options.include_usage`).
    pub stream_usage: bool,
    /// Send `parallel_tool_calls` with this value when tools are offered; `None` sends nothing and
    /// leaves the server's default.
    pub parallel_tool_calls: Option<bool>,
    /// An assistant message that carries tool calls and no text may have `content: null`. When
    /// false, `""` is sent instead (llama.cpp-based servers refuse the null).
    pub null_content_with_tool_calls: bool,
    /// Which field carries [`ChatRequest::max_tokens`](spacebot_core::ChatRequest::max_tokens).
    pub max_tokens_field: MaxTokensField,
    /// What to send as `tool_choice` when tools are offered and the request names no choice.
    pub tool_choice: ToolChoicePolicy,
    /// The server answers some invalid requests with HTTP 500 (llama.cpp's server and
    /// llama-cpp-python do, for example when the chat template refuses the messages). When true, a
    /// 500 whose JSON error body reads as a validation error (type `invalid_request_error`, a
    /// numeric 4xx `code`, or a message such as "must contain", "invalid", "expected", "missing",
    /// "not supported") is an [`LlmError::InvalidRequest`] and is not retried. Any other 500 (no
    /// JSON body, `Internal Server Error`, a crash) stays a retried server error, like 502 and
    /// 503.
    ///
    /// [`LlmError::InvalidRequest`]: spacebot_core::LlmError::InvalidRequest
    pub invalid_request_as_500: bool,
    /// The server can stream an answer to a request that offers tools. When false,
    /// [`stream`](spacebot_core::LlmProvider::stream) (and a streamed
    /// [`complete`](spacebot_core::LlmProvider::complete)) sends such a request as a plain call and
    /// yields the answer as one piece: llama-cpp-python answers a streamed request with tools
    /// with HTTP 200 and then closes the stream without a chunk ("Automatic streaming tool choice
    /// is not supported"). Requests without tools (or with `tool_choice: none`) still stream.
    pub streams_tool_calls: bool,
}

impl Default for Dialect {
    fn default() -> Self {
        Self::openai()
    }
}

impl Dialect {
    /// OpenAI itself.
    pub fn openai() -> Self {
        Self {
            name: "openai",
            supports_tools: true,
            stream_usage: true,
            parallel_tool_calls: None,
            null_content_with_tool_calls: true,
            max_tokens_field: MaxTokensField::MaxCompletionTokens,
            tool_choice: ToolChoicePolicy::Omit,
            invalid_request_as_500: false,
            streams_tool_calls: true,
        }
    }

    /// llama.cpp's `llama-server` and llama-cpp-python's server: no usage chunk, `""` instead of
    /// null content next to tool calls, `max_tokens`, `tool_choice: "auto"` whenever tools are
    /// offered (llama-cpp-python drops `tools` without it), validation errors as HTTP 500, and
    /// requests with tools never streamed (llama-cpp-python cannot stream them).
    pub fn llama_cpp() -> Self {
        Self {
            name: "llama.cpp",
            supports_tools: true,
            stream_usage: false,
            parallel_tool_calls: None,
            null_content_with_tool_calls: false,
            max_tokens_field: MaxTokensField::MaxTokens,
            tool_choice: ToolChoicePolicy::Auto,
            invalid_request_as_500: true,
            streams_tool_calls: false,
        }
    }

    /// vLLM's OpenAI-compatible server: `max_tokens`, `tool_choice: "auto"` whenever tools are
    /// offered (start it with `--enable-auto-tool-choice` and a `--tool-call-parser`).
    pub fn vllm() -> Self {
        Self {
            name: "vllm",
            supports_tools: true,
            stream_usage: true,
            parallel_tool_calls: None,
            null_content_with_tool_calls: true,
            max_tokens_field: MaxTokensField::MaxTokens,
            tool_choice: ToolChoicePolicy::Auto,
            invalid_request_as_500: false,
            streams_tool_calls: true,
        }
    }

    /// Ollama's `/v1` endpoint: `max_tokens`, `""` instead of null content, no `tool_choice`
    /// (Ollama ignores it).
    pub fn ollama() -> Self {
        Self {
            name: "ollama",
            supports_tools: true,
            stream_usage: true,
            parallel_tool_calls: None,
            null_content_with_tool_calls: false,
            max_tokens_field: MaxTokensField::MaxTokens,
            tool_choice: ToolChoicePolicy::Omit,
            invalid_request_as_500: false,
            streams_tool_calls: true,
        }
    }

    /// A cautious choice for an unknown compatible server (LM Studio, proxies, ...): `max_tokens`,
    /// no usage request, `""` instead of null content, `tool_choice: "auto"` whenever tools are
    /// offered, validation errors read from HTTP 500 (see
    /// [`invalid_request_as_500`](Self::invalid_request_as_500)), requests with tools never
    /// streamed.
    pub fn compatible() -> Self {
        Self {
            name: "compatible",
            supports_tools: true,
            stream_usage: false,
            parallel_tool_calls: None,
            null_content_with_tool_calls: false,
            max_tokens_field: MaxTokensField::MaxTokens,
            tool_choice: ToolChoicePolicy::Auto,
            invalid_request_as_500: true,
            streams_tool_calls: false,
        }
    }

    /// The names [`preset`](Self::preset) accepts, as `SPACEBOT_DIALECT` takes them.
    pub const PRESETS: [&'static str; 5] = ["openai", "llama_cpp", "vllm", "ollama", "compatible"];

    /// The preset called `name` (`openai`, `llama_cpp` (also `llama.cpp`, `llama-cpp`,
    /// `llamacpp`), `vllm`, `ollama`, `compatible`), ignoring case and surrounding spaces.
    pub fn preset(name: &str) -> Option<Self> {
        match name.trim().to_ascii_lowercase().as_str() {
            "openai" => Some(Self::openai()),
            "llama.cpp" | "llama_cpp" | "llamacpp" | "llama-cpp" => Some(Self::llama_cpp()),
            "vllm" => Some(Self::vllm()),
            "ollama" => Some(Self::ollama()),
            "compatible" | "generic" => Some(Self::compatible()),
            _ => None,
        }
    }
}
