use std::time::Duration;

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
        let c =
            OpenAiConfig::from_lookup(|k| (k == "SPACEBOT_DIALECT").then(|| name.into())).unwrap();
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
