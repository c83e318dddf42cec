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
            invalid_request_as_500: false,
        }
    }

    /// llama.cpp's `llama-server` (and servers built on it): no usage chunk, no null content next
    /// to tool calls, `max_tokens`, validation errors as HTTP 500.
    pub fn llama_cpp() -> Self {
        Self {
            name: "llama.cpp",
            supports_tools: true,
            stream_usage: false,
            parallel_tool_calls: None,
            null_content_with_tool_calls: false,
            max_tokens_field: MaxTokensField::MaxTokens,
            invalid_request_as_500: true,
        }
    }

    /// vLLM's OpenAI-compatible server.
    pub fn vllm() -> Self {
        Self {
            name: "vllm",
            supports_tools: true,
            stream_usage: true,
            parallel_tool_calls: None,
            null_content_with_tool_calls: true,
            max_tokens_field: MaxTokensField::MaxTokens,
            invalid_request_as_500: false,
        }
    }

    /// Ollama's `/v1` endpoint.
    pub fn ollama() -> Self {
        Self {
            name: "ollama",
            supports_tools: true,
            stream_usage: true,
            parallel_tool_calls: None,
            null_content_with_tool_calls: false,
            max_tokens_field: MaxTokensField::MaxTokens,
            invalid_request_as_500: false,
        }
    }

    /// A cautious choice for an unknown compatible server (LM Studio, proxies, ...): `max_tokens`,
    /// no usage request, `""` instead of null content.
    pub fn compatible() -> Self {
        Self {
            name: "compatible",
            supports_tools: true,
            stream_usage: false,
            parallel_tool_calls: None,
            null_content_with_tool_calls: false,
            max_tokens_field: MaxTokensField::MaxTokens,
            invalid_request_as_500: false,
        }
    }

    /// The preset called `name` (`openai`, `llama.cpp`/`llama_cpp`, `vllm`, `ollama`,
    /// `compatible`), ignoring case.
    pub fn preset(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
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
            check_tool_arguments: false,
        }
    }

    /// A configuration from the environment: `OPENAI_API_KEY` (optional: local servers need none),
    /// `OPENAI_BASE_URL` (default [`DEFAULT_BASE_URL`]), `SPACEBOT_MODEL` (default
    /// [`DEFAULT_MODEL`]).
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Like [`from_env`](Self::from_env), reading variables through `lookup`.
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

    /// The Chat Completions endpoint: `{base_url}/chat/completions`.
    pub fn endpoint(&self) -> String {
        format!("{}/chat/completions", self.base_url.trim_end_matches('/'))
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        check_base_url("base_url", &self.base_url)?;
        if self.model.trim().is_empty() {
            return Err(ConfigError::invalid("model", "must not be empty"));
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
        assert_eq!(Dialect::preset("vllm"), Some(Dialect::vllm()));
        assert_eq!(Dialect::preset("nope"), None);
    }
}
