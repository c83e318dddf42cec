//! HTTP failures to [`LlmError`].

use std::time::{Duration, SystemTime};

use reqwest::header::HeaderMap;
use serde::Deserialize;
use spacebot_core::LlmError;

use crate::config::Dialect;
use crate::wire::preview;

#[derive(Debug, Deserialize)]
struct ErrorBody {
    error: ErrorDetail,
}

/// The `error` object of an error body (OpenAI, vLLM, llama.cpp and Ollama all send one).
#[derive(Debug, Default, Deserialize)]
pub(crate) struct ErrorDetail {
    #[serde(default)]
    message: Option<String>,
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    code: Option<serde_json::Value>,
}

impl ErrorDetail {
    fn code(&self) -> Option<String> {
        match &self.code {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            _ => None,
        }
    }

    fn describe(&self) -> String {
        let mut text = self.message.clone().unwrap_or_default();
        if let Some(code) = self.code().or_else(|| self.kind.clone()) {
            if text.is_empty() {
                text = code;
            } else {
                text = format!("{text} ({code})");
            }
        }
        text
    }

    fn numeric_code(&self) -> Option<u64> {
        match &self.code {
            Some(serde_json::Value::Number(n)) => n.as_u64(),
            Some(serde_json::Value::String(s)) => s.parse().ok(),
            _ => None,
        }
    }

    /// Whether this error says the prompt does not fit the context window.
    fn is_context_too_long(&self) -> bool {
        const CODES: [&str; 2] = ["context_length_exceeded", "exceed_context_size_error"];
        if self
            .code()
            .iter()
            .chain(self.kind.iter())
            .any(|c| CODES.contains(&c.as_str()))
        {
            return true;
        }
        says_context_too_long(self.message.as_deref().unwrap_or_default())
    }

    /// Whether this error, sent with HTTP 500, describes a request the server refuses rather than
    /// a failure of the server (llama.cpp and llama-cpp-python answer template and validation
    /// errors so). Words of a passing failure ("loading", "busy", "try again") win.
    fn reads_as_invalid_request(&self) -> bool {
        const TRANSIENT: [&str; 11] = [
            "loading",
            "busy",
            "overloaded",
            "unavailable",
            "try again",
            "timeout",
            "timed out",
            "out of memory",
            "internal server error",
            "unknown error",
            "unexpected error",
        ];
        const INVALID: [&str; 15] = [
            "validation error",
            "validation errors",
            "should be",
            "not a valid",
            "must",
            "invalid",
            "expected",
            "missing",
            "required",
            "not supported",
            "unsupported",
            "cannot be",
            "not allowed",
            "roles must alternate",
            "failed to parse",
        ];
        let message = self
            .message
            .as_deref()
            .unwrap_or_default()
            .to_ascii_lowercase();
        if TRANSIENT.iter().any(|p| message.contains(p)) {
            return false;
        }
        let kind = self.kind.as_deref().unwrap_or_default();
        kind == "invalid_request_error"
            || self.numeric_code().is_some_and(|c| (400..500).contains(&c))
            || INVALID.iter().any(|p| contains_word(&message, p))
    }
}

/// Whether `phrase` occurs in `text` as whole words ("expected" in "expected a string", not in
/// "unexpected").
fn contains_word(text: &str, phrase: &str) -> bool {
    let is_letter = |c: Option<char>| c.is_some_and(char::is_alphanumeric);
    text.match_indices(phrase).any(|(at, _)| {
        !is_letter(text[..at].chars().next_back())
            && !is_letter(text[at + phrase.len()..].chars().next())
    })
}

/// Whether an error text says the prompt does not fit the context window (OpenAI, vLLM,
/// llama.cpp, llama-cpp-python and Ollama phrasings).
pub(crate) fn says_context_too_long(text: &str) -> bool {
    const PHRASES: [&str; 8] = [
        "maximum context length",
        "context length exceeded",
        "exceeds the available context size",
        "exceed context window",
        "context window",
        "context size",
        "prompt is too long",
        "too many tokens",
    ];
    let text = text.to_ascii_lowercase();
    PHRASES.iter().any(|p| text.contains(p))
}

/// An error object sent with HTTP 200: inside a stream (`data: {"error": {...}}`), or as the
/// whole body by some proxies.
pub(crate) fn stream_error(detail: ErrorDetail) -> LlmError {
    if detail.is_context_too_long() {
        return LlmError::ContextTooLong {
            message: detail.describe(),
        };
    }
    LlmError::Server {
        status: 200,
        message: format!(
            "the server sent an error with HTTP 200: {}",
            detail.describe()
        ),
    }
}

/// The data of an `event: error` in a stream: an error body, a bare error object, or text.
pub(crate) fn error_event(data: &str) -> LlmError {
    if let Ok(body) = serde_json::from_str::<ErrorBody>(data) {
        return stream_error(body.error);
    }
    if let Ok(detail) = serde_json::from_str::<ErrorDetail>(data)
        && detail.message.is_some()
    {
        return stream_error(detail);
    }
    let text = preview(data.as_bytes());
    if says_context_too_long(data) {
        return LlmError::ContextTooLong { message: text };
    }
    LlmError::Server {
        status: 200,
        message: format!("the server sent an error event with HTTP 200: {text}"),
    }
}

/// Maps a failed HTTP response to an error. `now` is the clock's time, for `Retry-After` dates.
pub(crate) fn from_status(
    status: u16,
    headers: &HeaderMap,
    body: &[u8],
    dialect: &Dialect,
    now: SystemTime,
) -> LlmError {
    let detail = serde_json::from_slice::<ErrorBody>(body)
        .ok()
        .map(|b| b.error);
    let message = match &detail {
        Some(d) => d.describe(),
        None if body.is_empty() => format!("HTTP {status} with an empty body"),
        None => preview(body),
    };
    let context_too_long = detail
        .as_ref()
        .is_some_and(ErrorDetail::is_context_too_long);
    match status {
        401 | 403 => LlmError::Authentication { message },
        429 => LlmError::RateLimited {
            retry_after: retry_after(headers, now),
            message,
        },
        400..=499 if context_too_long => LlmError::ContextTooLong { message },
        400..=499 => LlmError::InvalidRequest { status, message },
        500 if context_too_long => LlmError::ContextTooLong { message },
        // A 500 that says nothing: the server failed on this very request without a word (a
        // handler that crashed on it); the same request fails the same way, so it is not retried.
        // 502, 503 and 504 without a body stay retried: they come from a server passing through a
        // bad moment.
        500 if body.iter().all(u8::is_ascii_whitespace) => LlmError::InvalidRequest {
            status,
            message: "the server failed with HTTP 500 and an empty body; not retried, the same \
                      request would fail the same way"
                .to_owned(),
        },
        500 if dialect.invalid_request_as_500
            && detail
                .as_ref()
                .is_some_and(ErrorDetail::reads_as_invalid_request) =>
        {
            LlmError::InvalidRequest { status, message }
        }
        // Not implemented: the server does not offer this, however often it is asked.
        501 => LlmError::InvalidRequest { status, message },
        _ => LlmError::Server { status, message },
    }
}

/// Whether a 429 should not be retried however long one waits (the account has no quota left).
pub(crate) fn is_quota_exhausted(message: &str) -> bool {
    message.contains("insufficient_quota")
}

/// The wait a response asks for: `retry-after-ms` (milliseconds), else `Retry-After` in seconds or
/// as an HTTP date.
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    if let Some(ms) = header("retry-after-ms").and_then(|v| v.parse::<f64>().ok())
        && ms.is_finite()
        && ms >= 0.0
    {
        return Some(Duration::from_secs_f64(ms / 1000.0));
    }
    let value = header("retry-after")?;
    if let Ok(secs) = value.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        map
    }

    #[test]
    fn retry_after_in_seconds_millis_and_dates() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(
            retry_after(&headers(&[("retry-after", "7")]), now),
            Some(Duration::from_secs(7))
        );
        assert_eq!(
            retry_after(
                &headers(&[("retry-after-ms", "250"), ("retry-after", "7")]),
                now
            ),
            Some(Duration::from_millis(250))
        );
        let later = httpdate::fmt_http_date(now + Duration::from_secs(30));
        assert_eq!(
            retry_after(&headers(&[("retry-after", &later)]), now),
            Some(Duration::from_secs(30))
        );
        let earlier = httpdate::fmt_http_date(now - Duration::from_secs(30));
        assert_eq!(
            retry_after(&headers(&[("retry-after", &earlier)]), now),
            Some(Duration::ZERO)
        );
        assert_eq!(retry_after(&headers(&[("retry-after", "soon")]), now), None);
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
    }

    #[test]
    fn whole_words_only() {
        assert!(contains_word("value expected here", "expected"));
        assert!(contains_word("expected", "expected"));
        assert!(!contains_word("unexpected value", "expected"));
        assert!(contains_word("roles must alternate", "must"));
        assert!(!contains_word("mustache", "must"));
    }

    #[test]
    fn error_events_are_read_whatever_their_shape() {
        assert!(matches!(
            error_event(
                r#"{"error":{"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error","code":400}}"#
            ),
            LlmError::ContextTooLong { .. }
        ));
        assert!(matches!(
            error_event(r#"{"message":"Requested tokens (9000) exceed context window of 4096"}"#),
            LlmError::ContextTooLong { .. }
        ));
        assert!(matches!(
            error_event("prompt is too long"),
            LlmError::ContextTooLong { .. }
        ));
        let other = error_event("boom");
        assert!(
            matches!(&other, LlmError::Server { status: 200, message } if message.contains("boom")),
            "{other:?}"
        );
    }

    #[test]
    fn statuses_map_to_kinds() {
        let d = Dialect::openai();
        let now = SystemTime::UNIX_EPOCH;
        let h = HeaderMap::new();
        let body = br#"{"error":{"message":"nope","type":"invalid_request_error","code":null}}"#;
        assert!(matches!(
            from_status(401, &h, body, &d, now),
            LlmError::Authentication { .. }
        ));
        assert!(matches!(
            from_status(403, &h, body, &d, now),
            LlmError::Authentication { .. }
        ));
        assert!(matches!(
            from_status(404, &h, body, &d, now),
            LlmError::InvalidRequest { status: 404, .. }
        ));
        assert!(matches!(
            from_status(503, &h, b"", &d, now),
            LlmError::Server { status: 503, .. }
        ));
        assert!(matches!(
            from_status(500, &h, body, &d, now),
            LlmError::Server { .. }
        ));
        assert!(matches!(
            from_status(500, &h, body, &Dialect::llama_cpp(), now),
            LlmError::InvalidRequest { status: 500, .. }
        ));
        assert!(matches!(
            from_status(
                500,
                &h,
                b"<html>bad gateway</html>",
                &Dialect::llama_cpp(),
                now
            ),
            LlmError::Server { status: 500, .. }
        ));
        let llama = Dialect::llama_cpp();
        for plain in [
            &br#"{"error":{"code":500,"message":"Internal Server Error","type":"server_error"}}"#[..],
            br#"{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}"#,
            br#"{"detail":"oops"}"#,
            br#"{"error":{"code":500,"message":"Unexpected token at position 3 in the model output","type":"server_error"}}"#,
            br#"{"error":{"code":500,"message":"mustache renderer crashed","type":"server_error"}}"#,
            br#"{"error":{"code":500,"message":"An unknown error occurred","type":"server_error"}}"#,
        ] {
            assert!(
                matches!(
                    from_status(500, &h, plain, &llama, now),
                    LlmError::Server { status: 500, .. }
                ),
                "{}",
                String::from_utf8_lossy(plain)
            );
        }
        let template = br#"{"error":{"code":500,"message":"Assistant message must contain either 'content' or 'tool_calls'!","type":"server_error"}}"#;
        assert!(matches!(
            from_status(500, &h, template, &llama, now),
            LlmError::InvalidRequest { status: 500, .. }
        ));
        // A 500 without a word is not retried, whatever the dialect; other empty 5xx are.
        for dialect in [&d, &llama] {
            for empty in [&b""[..], b" \r\n"] {
                assert!(matches!(
                    from_status(500, &h, empty, dialect, now),
                    LlmError::InvalidRequest { status: 500, .. }
                ));
            }
            assert!(matches!(
                from_status(503, &h, b"", dialect, now),
                LlmError::Server { status: 503, .. }
            ));
        }
        // llama-cpp-python's pydantic validation errors.
        let pydantic = br#"{"error":{"message":"1 validation error for CreateChatCompletionRequest\nmessages.1.content\n  Input should be a valid string [type=string_type, input_value=None, input_type=NoneType]","type":"internal_server_error","param":null,"code":null}}"#;
        assert!(matches!(
            from_status(500, &h, pydantic, &llama, now),
            LlmError::InvalidRequest { status: 500, .. }
        ));
        let python = br#"{"error":{"message":"Conversation roles must alternate user/assistant/user/assistant/...","type":"internal_server_error","param":null,"code":null}}"#;
        assert!(matches!(
            from_status(500, &h, python, &llama, now),
            LlmError::InvalidRequest { status: 500, .. }
        ));
        assert!(matches!(
            from_status(500, &h, template, &d, now),
            LlmError::Server { status: 500, .. }
        ));
        let ctx_python = br#"{"error":{"message":"Requested tokens (9120) exceed context window of 8192","type":"internal_server_error","param":null,"code":null}}"#;
        assert!(matches!(
            from_status(500, &h, ctx_python, &llama, now),
            LlmError::ContextTooLong { .. }
        ));
        let ctx = br#"{"error":{"message":"This model's maximum context length is 8192 tokens.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}"#;
        assert!(matches!(
            from_status(400, &h, ctx, &d, now),
            LlmError::ContextTooLong { .. }
        ));
    }
}
