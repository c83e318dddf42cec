//! Reading a configuration from environment variables.

use std::time::Duration;

use super::{
    ApiKey, ConfigError, DEFAULT_MODEL, Dialect, MaxTokensField, OpenAiConfig, ToolChoicePolicy,
    check_base_url,
};

impl OpenAiConfig {
    /// A configuration from the environment; every setting has a variable, and unset or empty
    /// variables keep the defaults of [`new`](Self::new):
    ///
    /// | Variable | Setting | Value |
    /// | --- | --- | --- |
    /// | `OPENAI_BASE_URL` | [`base_url`](Self::base_url) | an `http(s)://` URL (default [`DEFAULT_BASE_URL`](super::DEFAULT_BASE_URL)) |
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
    /// | `SPACEBOT_MAX_RETRIES` | [`RetryPolicy::max_retries`](super::RetryPolicy::max_retries) | a whole number, 0 for none |
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
