//! Configuration: endpoint, credentials, timeouts, retry policy and dialect switches.
//!
//! [`OpenAiConfig`] holds every setting, built in code or read from the environment
//! ([`OpenAiConfig::from_env`]); [`RetryPolicy`] says when to retry, [`Dialect`] how a server
//! differs from OpenAI.

mod dialect;
mod env;
mod retry;
#[cfg(test)]
mod tests;

use std::fmt;
use std::time::Duration;

pub use dialect::{Dialect, MaxTokensField, ToolChoicePolicy};
pub use retry::RetryPolicy;

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
}

impl OpenAiConfig {
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
