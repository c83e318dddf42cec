//! Configuration: endpoint, credentials, timeouts, retry policy and dialect switches.

use std::fmt;
use std::time::Duration;

/// The OpenAI API's base URL, used when none is configured.
pub const DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";

/// The model used when none is configured and `SPACEBOT_MODEL` is not set.
pub const DEFAULT_MODEL: &str = "gpt-4o-mini";

/// A configuration that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A setting has a value the provider refuses.
    #[error("invalid {setting}: {reason}")]
    Invalid {
        /// The setting (for example `base_url`, `extra_headers[2]`, `OPENAI_BASE_URL`).
        setting: String,
        /// Why it was refused.
        reason: String,
    },
    /// The HTTP client could not be built.
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
}

impl ConfigError {
    pub(crate) fn invalid(setting: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Invalid {
            setting: setting.into(),
            reason: reason.into(),
        }
    }
}

/// An API key. Its `Debug` and `Display` never show the key.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    /// Wraps a key.
    pub fn new(key: impl Into<String>) -> Self {
        Self(key.into())
    }

    /// The key itself, for building the `Authorization` header.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

impl fmt::Display for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl From<String> for ApiKey {
    fn from(key: String) -> Self {
        Self(key)
    }
}

impl From<&str> for ApiKey {
    fn from(key: &str) -> Self {
        Self(key.to_owned())
    }
}

/// When and how long to wait before trying a request again.
///
/// Retries happen on HTTP 429, HTTP 5xx, timeouts and connection failures (see
/// [`LlmError::is_retryable`](spacebot_core::LlmError::is_retryable)); never on other 4xx. The wait
/// before retry `n` (from 0) is `min(base_backoff * 2^n, max_backoff)`, shortened by a random part of
/// up to `jitter` of itself, unless the server said how long to wait (`Retry-After`), in which case
/// that is the wait. Every wait goes through the provider's [`Clock`](spacebot_core::Clock).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// Retries after the first attempt (0: no retry).
    pub max_retries: u32,
    /// The wait before the first retry.
    pub base_backoff: Duration,
    /// The longest computed wait.
    pub max_backoff: Duration,
    /// The fraction (0.0 to 1.0) of each computed wait that is randomised away ("jitter"), so
    /// clients that failed together do not retry together. 0.0 makes waits exact.
    pub jitter: f64,
    /// The longest `Retry-After` honoured: a server asking for a longer wait gets its
    /// [`LlmError::RateLimited`](spacebot_core::LlmError::RateLimited) back at once, with the wait
    /// it asked for, so the caller decides.
    pub max_retry_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_retries: 3,
            base_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(20),
            jitter: 0.25,
            max_retry_after: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// A policy that never retries.
    pub fn none() -> Self {
        Self {
            max_retries: 0,
            ..Self::default()
        }
    }

    /// This policy with `max_retries` retries.
    pub fn with_max_retries(mut self, max_retries: u32) -> Self {
        self.max_retries = max_retries;
        self
    }

    /// This policy with the given base and maximum backoff.
    pub fn with_backoff(mut self, base: Duration, max: Duration) -> Self {
        self.base_backoff = base;
        self.max_backoff = max;
        self
    }

    /// This policy with the given jitter fraction (0.0 to 1.0).
    pub fn with_jitter(mut self, jitter: f64) -> Self {
        self.jitter = jitter;
        self
    }

    /// This policy honouring `Retry-After` up to `max`.
    pub fn with_max_retry_after(mut self, max: Duration) -> Self {
        self.max_retry_after = max;
        self
    }

    /// The computed wait before retry `retry` (0 for the first retry), before jitter.
    pub fn backoff(&self, retry: u32) -> Duration {
        let factor = 1u32.checked_shl(retry.min(31)).unwrap_or(u32::MAX);
        self.base_backoff
            .checked_mul(factor)
            .unwrap_or(self.max_backoff)
            .min(self.max_backoff)
    }

    /// The wait before retry `retry` with jitter applied, using `random` (uniform in `[0, 1)`).
    pub fn jittered_backoff(&self, retry: u32, random: f64) -> Duration {
        let wait = self.backoff(retry);
        let cut = self.jitter.clamp(0.0, 1.0) * random.clamp(0.0, 1.0);
        wait.mul_f64(1.0 - cut)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if !(0.0..=1.0).contains(&self.jitter) {
            return Err(ConfigError::invalid(
                "retry.jitter",
                format!("must be between 0.0 and 1.0, got {}", self.jitter),
            ));
        }
        if self.base_backoff > self.max_backoff {
            return Err(ConfigError::invalid(
                "retry.base_backoff",
                format!(
                    "{:?} is longer than retry.max_backoff {:?}",
                    self.base_backoff, self.max_backoff
                ),
            ));
        }
        Ok(())
    }
}

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

/// Everything the provider needs to reach a Chat Completions server.
///
/// ```
/// use std::time::Duration;
/// use spacebot_openai::{Dialect, OpenAiConfig, RetryPolicy};
///
/// let config = OpenAiConfig::new("qwen2.5-7b-instruct")
///     .with_base_url("http://127.0.0.1:8080/v1")
///     .with_dialect(Dialect::llama_cpp())
///     .with_request_timeout(Duration::from_secs(120))
///     .with_retry(RetryPolicy::default().with_max_retries(5));
/// assert!(config.api_key.is_none());
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct OpenAiConfig {
    /// The API root, without `/chat/completions` (default [`DEFAULT_BASE_URL`]).
    pub base_url: String,
    /// The bearer token; `None` sends no `Authorization` header (local servers).
    pub api_key: Option<ApiKey>,
    /// The model used when the request names none.
    pub model: String,
    /// The `OpenAI-Organization` header.
    pub organization: Option<String>,
    /// The `OpenAI-Project` header.
    pub project: Option<String>,
    /// More headers sent with every request.
    pub extra_headers: Vec<(String, String)>,
    /// The longest wait for a connection.
    pub connect_timeout: Duration,
    /// The longest wait for a whole answer (for a stream: for the response headers), timed by the
    /// provider's clock.
    pub request_timeout: Duration,
    /// The longest silence between two pieces of a stream, timed by the provider's clock.
    pub stream_idle_timeout: Duration,
    /// When to retry.
    pub retry: RetryPolicy,
    /// How the server differs from OpenAI.
    pub dialect: Dialect,
    /// The output token limit sent when the request sets none
    /// ([`ChatRequest::max_tokens`](spacebot_core::ChatRequest::max_tokens) wins); `None` sends no
    /// limit and leaves the server's default.
    pub max_tokens: Option<u32>,
    /// Let [`complete`](spacebot_core::LlmProvider::complete) stream the answer and return the
    /// assembled response (default false). A long answer from a slow local model is then bounded
    /// by [`stream_idle_timeout`](Self::stream_idle_timeout) between pieces instead of by
    /// [`request_timeout`](Self::request_timeout) for the whole answer.
    pub stream_completions: bool,
    /// Refuse an answer whose tool-call arguments are not a JSON object, with
    /// [`LlmError::MalformedResponse`](spacebot_core::LlmError::MalformedResponse) naming the tool.
    ///
    /// Off by default: a model that writes broken arguments for one call has not failed the turn.
    /// The [`ToolCall`](spacebot_core::ToolCall) then keeps the argument text exactly as the model
    /// sent it, the provider reports it (a `tracing` warning naming the tool and the call), and the
    /// runtime's tool registry answers the model with the parse error as the tool result, so the
    /// model can correct itself. Empty arguments are always passed on as `{}`.
    pub check_tool_arguments: bool,
}

impl OpenAiConfig {
    /// A configuration for OpenAI with `model`, no key, and default timeouts and retries.
    pub fn new(model: impl Into<String>) -> Self {
        Self {
            base_url: DEFAULT_BASE_URL.to_owned(),
            api_key: None,
            model: model.into(),
            organization: None,
            project: None,
            extra_headers: Vec::new(),
            connect_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(600),
            stream_idle_timeout: Duration::from_secs(120),
            retry: RetryPolicy::default(),
            dialect: Dialect::openai(),
            max_tokens: None,
            stream_completions: false,
            check_tool_arguments: false,
        }
    }

    /// A configuration from the environment; every setting has a variable, and unset or empty
    /// variables keep the defaults of [`new`](Self::new):
    ///
    /// | Variable | Setting | Value |
    /// | --- | --- | --- |
    /// | `OPENAI_BASE_URL` | [`base_url`](Self::base_url) | an `http(s)://` URL (default [`DEFAULT_BASE_URL`]) |
    /// | `OPENAI_API_KEY` | [`api_key`](Self::api_key) | optional: local servers need none |
    /// | `SPACEBOT_MODEL` | [`model`](Self::model) | default [`DEFAULT_MODEL`] |
    /// | `OPENAI_ORG_ID` | [`organization`](Self::organization) | |
    /// | `OPENAI_PROJECT_ID` | [`project`](Self::project) | |
    /// | `SPACEBOT_DIALECT` | [`dialect`](Self::dialect) | `openai`, `llama_cpp`, `vllm`, `ollama`, `compatible` |
    /// | `SPACEBOT_TOOL_CHOICE` | [`Dialect::tool_choice`] | `auto`, or `omit` (also `none`): send nothing |
    /// | `SPACEBOT_MAX_TOKENS_FIELD` | [`Dialect::max_tokens_field`] | `max_tokens`, `max_completion_tokens` |
    /// | `SPACEBOT_SUPPORTS_TOOLS` | [`Dialect::supports_tools`] | a boolean |
    /// | `SPACEBOT_STREAM_USAGE` | [`Dialect::stream_usage`] | a boolean |
    /// | `SPACEBOT_PARALLEL_TOOL_CALLS` | [`Dialect::parallel_tool_calls`] | a boolean |
    /// | `SPACEBOT_STREAM_TOOL_CALLS` | [`Dialect::streams_tool_calls`] | a boolean |
    /// | `SPACEBOT_MAX_TOKENS` | [`max_tokens`](Self::max_tokens) | a whole number above 0 |
    /// | `SPACEBOT_STREAM` | [`stream_completions`](Self::stream_completions) | a boolean |
    /// | `SPACEBOT_CHECK_TOOL_ARGUMENTS` | [`check_tool_arguments`](Self::check_tool_arguments) | a boolean |
    /// | `SPACEBOT_CONNECT_TIMEOUT_SECS` | [`connect_timeout`](Self::connect_timeout) | seconds above 0, such as `10` or `2.5` |
    /// | `SPACEBOT_REQUEST_TIMEOUT_SECS` | [`request_timeout`](Self::request_timeout) | seconds above 0 |
    /// | `SPACEBOT_STREAM_IDLE_TIMEOUT_SECS` | [`stream_idle_timeout`](Self::stream_idle_timeout) | seconds above 0 |
    /// | `SPACEBOT_MAX_RETRIES` | [`RetryPolicy::max_retries`] | a whole number, 0 for none |
    ///
    /// Booleans are `true`/`false` (also `1`/`0`, `yes`/`no`, `on`/`off`). The dialect switches
    /// change the preset `SPACEBOT_DIALECT` picked. A value that cannot be read is an error naming
    /// the variable and the accepted values; it is never ignored.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Like [`from_env`](Self::from_env), reading variables through `lookup` (tests pass a map,
    /// so they need not change the process environment).
    ///
    /// ```
    /// use spacebot_openai::{MaxTokensField, OpenAiConfig, ToolChoicePolicy};
    ///
    /// let config = OpenAiConfig::from_lookup(|name| match name {
    ///     "OPENAI_BASE_URL" => Some("http://127.0.0.1:8000/v1".into()),
    ///     "SPACEBOT_DIALECT" => Some("llama_cpp".into()),
    ///     _ => None,
    /// })?;
    /// assert_eq!(config.dialect.tool_choice, ToolChoicePolicy::Auto);
    /// assert_eq!(config.dialect.max_tokens_field, MaxTokensField::MaxTokens);
    ///
    /// let err = OpenAiConfig::from_lookup(|name| {
    ///     (name == "SPACEBOT_DIALECT").then(|| "llama".to_owned())
    /// })
    /// .unwrap_err();
    /// assert!(err.to_string().contains("SPACEBOT_DIALECT"));
    /// # Ok::<(), spacebot_openai::ConfigError>(())
    /// ```
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let get = |name: &str| {
            lookup(name)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        let mut config =
            Self::new(get("SPACEBOT_MODEL").unwrap_or_else(|| DEFAULT_MODEL.to_owned()));
        config.api_key = get("OPENAI_API_KEY").map(ApiKey::from);
        if let Some(url) = get("OPENAI_BASE_URL") {
            check_base_url("OPENAI_BASE_URL", &url)?;
            config.base_url = url;
        }
        config.organization = get("OPENAI_ORG_ID");
        config.project = get("OPENAI_PROJECT_ID");

        if let Some(name) = get("SPACEBOT_DIALECT") {
            config.dialect = Dialect::preset(&name).ok_or_else(|| {
                not_one_of("SPACEBOT_DIALECT", &name, &Dialect::PRESETS.join(", "))
            })?;
        }
        const TOOL_CHOICE: &str = "SPACEBOT_TOOL_CHOICE";
        if let Some(value) = get(TOOL_CHOICE) {
            config.dialect.tool_choice = match value.to_ascii_lowercase().as_str() {
                "auto" => ToolChoicePolicy::Auto,
                "omit" | "none" => ToolChoicePolicy::Omit,
                _ => return Err(not_one_of(TOOL_CHOICE, &value, "auto, omit (or none)")),
            };
        }
        const FIELD: &str = "SPACEBOT_MAX_TOKENS_FIELD";
        if let Some(value) = get(FIELD) {
            config.dialect.max_tokens_field = match value.to_ascii_lowercase().as_str() {
                "max_tokens" => MaxTokensField::MaxTokens,
                "max_completion_tokens" => MaxTokensField::MaxCompletionTokens,
                _ => {
                    return Err(not_one_of(
                        FIELD,
                        &value,
                        "max_tokens, max_completion_tokens",
                    ));
                }
            };
        }
        let flag = |name: &str| get(name).map(|v| parse_bool(name, &v)).transpose();
        if let Some(on) = flag("SPACEBOT_SUPPORTS_TOOLS")? {
            config.dialect.supports_tools = on;
        }
        if let Some(on) = flag("SPACEBOT_STREAM_USAGE")? {
            config.dialect.stream_usage = on;
        }
        if let Some(on) = flag("SPACEBOT_PARALLEL_TOOL_CALLS")? {
            config.dialect.parallel_tool_calls = Some(on);
        }
        if let Some(on) = flag("SPACEBOT_STREAM_TOOL_CALLS")? {
            config.dialect.streams_tool_calls = on;
        }
        if let Some(on) = flag("SPACEBOT_STREAM")? {
            config.stream_completions = on;
        }
        if let Some(on) = flag("SPACEBOT_CHECK_TOOL_ARGUMENTS")? {
            config.check_tool_arguments = on;
        }

        const MAX_TOKENS: &str = "SPACEBOT_MAX_TOKENS";
        if let Some(value) = get(MAX_TOKENS) {
            match value.parse::<u32>() {
                Ok(n) if n > 0 => config.max_tokens = Some(n),
                _ => {
                    return Err(ConfigError::invalid(
                        MAX_TOKENS,
                        format!("{value:?} is not a whole number from 1 to {}", u32::MAX),
                    ));
                }
            }
        }
        const RETRIES: &str = "SPACEBOT_MAX_RETRIES";
        if let Some(value) = get(RETRIES) {
            let retries = value.parse::<u32>().map_err(|_| {
                ConfigError::invalid(
                    RETRIES,
                    format!(
                        "{value:?} is not a whole number from 0 (no retry) to {}",
                        u32::MAX
                    ),
                )
            })?;
            config.retry.max_retries = retries;
        }
        for (name, slot) in [
            ("SPACEBOT_CONNECT_TIMEOUT_SECS", &mut config.connect_timeout),
            ("SPACEBOT_REQUEST_TIMEOUT_SECS", &mut config.request_timeout),
            (
                "SPACEBOT_STREAM_IDLE_TIMEOUT_SECS",
                &mut config.stream_idle_timeout,
            ),
        ] {
            if let Some(value) = get(name) {
                *slot = parse_seconds(name, &value)?;
            }
        }
        Ok(config)
    }

    /// This configuration with another base URL.
    pub fn with_base_url(mut self, base_url: impl Into<String>) -> Self {
        self.base_url = base_url.into();
        self
    }

    /// This configuration with an API key.
    pub fn with_api_key(mut self, key: impl Into<ApiKey>) -> Self {
        self.api_key = Some(key.into());
        self
    }

    /// This configuration with another default model.
    pub fn with_model(mut self, model: impl Into<String>) -> Self {
        self.model = model.into();
        self
    }

    /// This configuration with an `OpenAI-Organization` header.
    pub fn with_organization(mut self, organization: impl Into<String>) -> Self {
        self.organization = Some(organization.into());
        self
    }

    /// This configuration with an `OpenAI-Project` header.
    pub fn with_project(mut self, project: impl Into<String>) -> Self {
        self.project = Some(project.into());
        self
    }

    /// This configuration with one more header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.extra_headers.push((name.into(), value.into()));
        self
    }

    /// This configuration with another connect timeout.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// This configuration with another request timeout.
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// This configuration with another stream idle timeout.
    pub fn with_stream_idle_timeout(mut self, timeout: Duration) -> Self {
        self.stream_idle_timeout = timeout;
        self
    }

    /// This configuration with another retry policy.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// This configuration with another dialect.
    pub fn with_dialect(mut self, dialect: Dialect) -> Self {
        self.dialect = dialect;
        self
    }

    /// This configuration with tool-call arguments checked or not (see
    /// [`check_tool_arguments`](Self::check_tool_arguments)).
    pub fn with_check_tool_arguments(mut self, check: bool) -> Self {
        self.check_tool_arguments = check;
        self
    }

    /// This configuration with an output token limit for requests that set none.
    pub fn with_max_tokens(mut self, max_tokens: u32) -> Self {
        self.max_tokens = Some(max_tokens);
        self
    }

    /// This configuration with [`complete`](spacebot_core::LlmProvider::complete) streaming or not
    /// (see [`stream_completions`](Self::stream_completions)).
    pub fn with_stream_completions(mut self, stream: bool) -> Self {
        self.stream_completions = stream;
        self
    }

    /// The Chat Completions endpoint: `{base_url}/chat/completions`.
    pub fn endpoint(&self) -> String {
        format!("{}/chat/completions", self.base_url.trim_end_matches('/'))
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        check_base_url("base_url", &self.base_url)?;
        if self.model.trim().is_empty() {
            return Err(ConfigError::invalid("model", "must not be empty"));
        }
        if self.max_tokens == Some(0) {
            return Err(ConfigError::invalid("max_tokens", "must be above 0"));
        }
        for (what, timeout) in [
            ("request_timeout", self.request_timeout),
            ("stream_idle_timeout", self.stream_idle_timeout),
            ("connect_timeout", self.connect_timeout),
        ] {
            if timeout.is_zero() {
                return Err(ConfigError::invalid(what, "must be longer than zero"));
            }
        }
        self.retry.validate()
    }
}

fn not_one_of(variable: &str, value: &str, accepted: &str) -> ConfigError {
    ConfigError::invalid(
        variable,
        format!("{value:?} is not accepted; use one of: {accepted}"),
    )
}

fn parse_bool(variable: &str, value: &str) -> Result<bool, ConfigError> {
    match value.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(not_one_of(
            variable,
            value,
            "true, false (also 1/0, yes/no, on/off)",
        )),
    }
}

/// A number of seconds above zero, whole or not (`30`, `2.5`).
fn parse_seconds(variable: &str, value: &str) -> Result<Duration, ConfigError> {
    value
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0)
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| {
            ConfigError::invalid(
                variable,
                format!("{value:?} is not a number of seconds above 0 (such as 30 or 2.5)"),
            )
        })
}

fn check_base_url(setting: &str, url: &str) -> Result<(), ConfigError> {
    let parsed = reqwest::Url::parse(url)
        .map_err(|e| ConfigError::invalid(setting, format!("{url:?} is not a URL: {e}")))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(ConfigError::invalid(
            setting,
            format!("{url:?} must start with http:// or https://"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_key() {
        let config = OpenAiConfig::new("m").with_api_key("sk-secret-123");
        let shown = format!("{config:?} {}", ApiKey::new("sk-secret-123"));
        assert!(!shown.contains("sk-secret-123"), "{shown}");
        assert!(shown.contains("<redacted>"));
    }

    #[test]
    fn from_lookup_reads_the_three_variables() {
        let config = OpenAiConfig::from_lookup(|name| match name {
            "OPENAI_API_KEY" => Some("sk-abc".into()),
            "OPENAI_BASE_URL" => Some("http://127.0.0.1:8080/v1".into()),
            "SPACEBOT_MODEL" => Some("qwen".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(config.api_key.as_ref().map(ApiKey::expose), Some("sk-abc"));
        assert_eq!(
            config.endpoint(),
            "http://127.0.0.1:8080/v1/chat/completions"
        );
        assert_eq!(config.model, "qwen");

        let empty = OpenAiConfig::from_lookup(|_| None).unwrap();
        assert_eq!(empty.base_url, DEFAULT_BASE_URL);
        assert_eq!(empty.model, DEFAULT_MODEL);
        assert!(empty.api_key.is_none());
    }

    #[test]
    fn from_lookup_reads_every_variable() {
        let vars = [
            ("OPENAI_API_KEY", "sk-x"),
            ("OPENAI_BASE_URL", "http://127.0.0.1:11434/v1"),
            ("SPACEBOT_MODEL", "llama3.1:8b"),
            ("OPENAI_ORG_ID", "org-1"),
            ("OPENAI_PROJECT_ID", "proj_1"),
            ("SPACEBOT_DIALECT", " Ollama "),
            ("SPACEBOT_TOOL_CHOICE", "AUTO"),
            ("SPACEBOT_MAX_TOKENS_FIELD", "max_completion_tokens"),
            ("SPACEBOT_SUPPORTS_TOOLS", "no"),
            ("SPACEBOT_STREAM_USAGE", "off"),
            ("SPACEBOT_PARALLEL_TOOL_CALLS", "1"),
            ("SPACEBOT_STREAM_TOOL_CALLS", "false"),
            ("SPACEBOT_MAX_TOKENS", "2048"),
            ("SPACEBOT_STREAM", "yes"),
            ("SPACEBOT_CHECK_TOOL_ARGUMENTS", "true"),
            ("SPACEBOT_CONNECT_TIMEOUT_SECS", "2.5"),
            ("SPACEBOT_REQUEST_TIMEOUT_SECS", "300"),
            ("SPACEBOT_STREAM_IDLE_TIMEOUT_SECS", "90"),
            ("SPACEBOT_MAX_RETRIES", "7"),
        ];
        let c = OpenAiConfig::from_lookup(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        })
        .unwrap();
        assert_eq!(c.api_key.as_ref().map(ApiKey::expose), Some("sk-x"));
        assert_eq!(c.base_url, "http://127.0.0.1:11434/v1");
        assert_eq!(c.model, "llama3.1:8b");
        assert_eq!(c.organization.as_deref(), Some("org-1"));
        assert_eq!(c.project.as_deref(), Some("proj_1"));
        assert_eq!(c.dialect.name, "ollama");
        assert_eq!(c.dialect.tool_choice, ToolChoicePolicy::Auto);
        assert_eq!(
            c.dialect.max_tokens_field,
            MaxTokensField::MaxCompletionTokens
        );
        assert!(!c.dialect.supports_tools);
        assert!(!c.dialect.stream_usage);
        assert_eq!(c.dialect.parallel_tool_calls, Some(true));
        assert!(!c.dialect.streams_tool_calls);
        assert_eq!(c.max_tokens, Some(2048));
        assert!(c.stream_completions);
        assert!(c.check_tool_arguments);
        assert_eq!(c.connect_timeout, Duration::from_millis(2_500));
        assert_eq!(c.request_timeout, Duration::from_secs(300));
        assert_eq!(c.stream_idle_timeout, Duration::from_secs(90));
        assert_eq!(c.retry.max_retries, 7);
        c.validate().unwrap();

        // Every preset name, and unset/empty variables keep the defaults.
        for name in Dialect::PRESETS {
            let c = OpenAiConfig::from_lookup(|k| (k == "SPACEBOT_DIALECT").then(|| name.into()))
                .unwrap();
            assert_eq!(Some(c.dialect), Dialect::preset(name), "{name}");
        }
        let c = OpenAiConfig::from_lookup(|_| Some("  ".into())).unwrap();
        assert_eq!(c.dialect, Dialect::openai());
        assert!(!c.check_tool_arguments && !c.stream_completions && c.max_tokens.is_none());
    }

    #[test]
    fn a_bad_base_url_names_the_variable() {
        let err = OpenAiConfig::from_lookup(|name| {
            (name == "OPENAI_BASE_URL").then(|| "localhost:8080".to_owned())
        })
        .unwrap_err();
        assert!(err.to_string().contains("OPENAI_BASE_URL"), "{err}");
    }

    #[test]
    fn validation_names_the_setting() {
        let bad = OpenAiConfig::new("m").with_retry(RetryPolicy::default().with_jitter(1.5));
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("retry.jitter")
        );
        let bad = OpenAiConfig::new(" ");
        assert!(bad.validate().unwrap_err().to_string().contains("model"));
        let bad = OpenAiConfig::new("m").with_request_timeout(Duration::ZERO);
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("request_timeout")
        );
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let policy = RetryPolicy::default()
            .with_backoff(Duration::from_millis(100), Duration::from_millis(1_000))
            .with_jitter(0.0);
        let waits: Vec<u128> = (0..6).map(|n| policy.backoff(n).as_millis()).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1_000, 1_000]);
        assert_eq!(policy.backoff(u32::MAX), Duration::from_millis(1_000));
        let jittered = policy.clone().with_jitter(0.5);
        assert_eq!(
            jittered.jittered_backoff(1, 0.0),
            Duration::from_millis(200)
        );
        assert_eq!(
            jittered.jittered_backoff(1, 1.0),
            Duration::from_millis(100)
        );
    }

    #[test]
    fn presets_by_name() {
        assert_eq!(Dialect::preset("LLAMA.CPP"), Some(Dialect::llama_cpp()));
        assert_eq!(Dialect::preset("llama_cpp"), Some(Dialect::llama_cpp()));
        assert_eq!(Dialect::preset("vllm"), Some(Dialect::vllm()));
        assert_eq!(Dialect::preset("nope"), None);
    }
}
