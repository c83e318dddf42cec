//! Spans after the OpenTelemetry GenAI semantic conventions, emitted through `tracing`, and the
//! trace context that ties one request's turns together across hops.
//!
//! The runtime opens, at `INFO` level:
//!
//! | span name | when | attributes |
//! |-----------|------|------------|
//! | `invoke_agent {agent}` | one per turn | `gen_ai.operation.name`, `gen_ai.agent.name`, `gen_ai.agent.id`, `gen_ai.conversation.id`, `spacebot.envelope.kind`, `spacebot.task` |
//! | `chat {model}` | one per model call | `gen_ai.operation.name`, `gen_ai.provider.name`, `gen_ai.request.model`, `gen_ai.usage.input_tokens`, `gen_ai.usage.output_tokens`, `gen_ai.response.finish_reasons` |
//! | `execute_tool {tool}` | one per tool call | `gen_ai.operation.name`, `gen_ai.tool.name`, `gen_ai.tool.call.id`, `gen_ai.tool.type` |
//! | `spacebot.task.create`, `.claim`, `.complete`, `spacebot.notice.deliver` | delegation (a failed attempt requeued is a `.complete` reaching `ready`) | `spacebot.task`, `spacebot.task.status`, `spacebot.task.attempts` |
//! | `spacebot.conversation.message` | a conversation message to its members | `gen_ai.conversation.id` |
//! | `spacebot.steer` | messages steering a running turn | `spacebot.steer.merged` |
//! | `spacebot.store.commit` | a turn's commit to the agent's store | `spacebot.store.records`, `spacebot.store.consumed`, `spacebot.store.attempts` |
//! | `spacebot.store.retry` | one failed store write or read, and the wait before the next try | `spacebot.retry.operation`, `spacebot.retry.attempt`, `spacebot.retry.backoff_ms`, `error.type` |
//!
//! Prompt and answer text is never recorded unless the application asks for it
//! ([`set_capture_content`]).
//!
//! `tracing` alone knows nothing of trace ids. The application's telemetry layer (the `otel`
//! feature of the `spacebot` crate) installs a [`TraceHook`]: the runtime then stores the W3C trace
//! context of the span that sends an envelope or creates a task with it
//! ([`Envelope::trace_context`](crate::envelope::Envelope::trace_context),
//! [`TaskMetadata::trace_context`](crate::task::TaskMetadata::trace_context)), and a turn, claim or
//! notice that continues the work continues that trace: one trace per request, across agents,
//! restarts and processes. Without a hook nothing is stored and the spans cost what a disabled
//! `tracing` span costs.

use std::fmt;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tracing::Span;

use crate::ids::AgentId;
use crate::llm::{ChatResponse, FinishReason, Usage};

/// What the application's telemetry layer does for the runtime: read and continue trace contexts,
/// set attributes `tracing` cannot carry, and count what metrics need.
///
/// Install one with [`install`] (the `otel` feature of the `spacebot` crate does).
pub trait TraceHook: Send + Sync + fmt::Debug + 'static {
    /// The trace context of `span` as one opaque string (W3C `traceparent`), or `None`.
    fn context_of(&self, span: &Span) -> Option<String>;

    /// Makes the new span `span` (not entered yet) continue `context`, a string from
    /// [`context_of`](Self::context_of) stored earlier, perhaps by another process: it joins the
    /// trace. The span that made `context` has usually ended by then.
    fn continue_trace(&self, span: &Span, context: &str);

    /// Sets a string-array attribute (`gen_ai.response.finish_reasons`) on `span`.
    fn set_string_array(&self, span: &Span, key: &'static str, values: Vec<String>);

    /// A model call ended: for the token-usage and duration metrics.
    fn model_call(&self, call: &ModelCall<'_>) {
        let _ = call;
    }

    /// A turn ended after `duration`.
    fn turn_ended(&self, agent: &AgentId, duration: Duration) {
        let _ = (agent, duration);
    }
}

/// One model call, as [`TraceHook::model_call`] sees it.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ModelCall<'a> {
    /// The provider's name (`gen_ai.provider.name`).
    pub provider: &'a str,
    /// The model asked (`gen_ai.request.model`).
    pub model: &'a str,
    /// The usage the provider reported, if any.
    pub usage: Option<Usage>,
    /// How long the call took.
    pub duration: Duration,
    /// The error type when it failed.
    pub error: Option<&'static str>,
}

static HOOK: OnceLock<Box<dyn TraceHook>> = OnceLock::new();
static CAPTURE_CONTENT: AtomicBool = AtomicBool::new(false);

/// A hook was installed already.
#[derive(Debug, thiserror::Error)]
#[error("a trace hook is installed already")]
pub struct AlreadyInstalled;

/// Installs the process's trace hook (once; like the global `tracing` subscriber).
pub fn install(hook: Box<dyn TraceHook>) -> Result<(), AlreadyInstalled> {
    HOOK.set(hook).map_err(|_| AlreadyInstalled)
}

/// The installed hook, if any.
pub fn hook() -> Option<&'static dyn TraceHook> {
    HOOK.get().map(|h| &**h)
}

/// Whether prompt and answer text goes into spans (`gen_ai.input.messages`,
/// `gen_ai.output.messages`). Off unless the application turns it on.
pub fn set_capture_content(on: bool) {
    CAPTURE_CONTENT.store(on, Ordering::Relaxed);
}

/// Whether prompt and answer text goes into spans (see [`set_capture_content`]).
pub fn capture_content() -> bool {
    CAPTURE_CONTENT.load(Ordering::Relaxed)
}

/// The trace context of the current span, to store with what it sends.
pub fn current_context() -> Option<String> {
    let hook = hook()?;
    let span = Span::current();
    if span.is_disabled() {
        return None;
    }
    hook.context_of(&span)
}

/// The trace context of `span`.
pub fn context_of(span: &Span) -> Option<String> {
    if span.is_disabled() {
        return None;
    }
    hook()?.context_of(span)
}

/// Makes `span` continue the stored `context`, when there is one and a hook.
pub fn continue_trace(span: &Span, context: Option<&str>) {
    if let (Some(hook), Some(context), false) = (hook(), context, span.is_disabled()) {
        hook.continue_trace(span, context);
    }
}

/// The `invoke_agent` span of one turn.
pub(crate) fn invoke_agent(
    agent: &AgentId,
    name: &str,
    envelope: &crate::envelope::Envelope,
) -> Span {
    let conversation = envelope
        .conversation
        .as_ref()
        .map_or_else(|| envelope.channel.to_string(), |c| c.to_string());
    let span = tracing::info_span!(
        target: "spacebot::telemetry",
        "invoke_agent",
        otel.name = %format_args!("invoke_agent {name}"),
        otel.kind = "internal",
        gen_ai.operation.name = "invoke_agent",
        gen_ai.agent.name = %name,
        gen_ai.agent.id = %agent,
        gen_ai.conversation.id = %conversation,
        spacebot.envelope.kind = %envelope.kind,
        spacebot.envelope.id = %envelope.id,
        spacebot.task = tracing::field::Empty,
    );
    if let Some(work) = &envelope.task {
        span.record(
            "spacebot.task",
            tracing::field::display(format_args!("{agent}#{}", work.number)),
        );
    }
    continue_trace(&span, envelope.trace_context.as_deref());
    span
}

/// The `chat` span of one model call.
pub(crate) fn chat(provider: &str, model: &str, request: &crate::llm::ChatRequest) -> Span {
    let span = tracing::info_span!(
        target: "spacebot::telemetry",
        "chat",
        otel.name = %format_args!("chat {model}"),
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        gen_ai.operation.name = "chat",
        gen_ai.provider.name = %provider,
        gen_ai.request.model = %model,
        gen_ai.request.max_tokens = tracing::field::Empty,
        gen_ai.usage.input_tokens = tracing::field::Empty,
        gen_ai.usage.output_tokens = tracing::field::Empty,
        gen_ai.input.messages = tracing::field::Empty,
        gen_ai.output.messages = tracing::field::Empty,
        "error.type" = tracing::field::Empty,
    );
    if let Some(max) = request.max_tokens {
        span.record("gen_ai.request.max_tokens", i64::from(max));
    }
    if capture_content()
        && !span.is_disabled()
        && let Ok(text) = serde_json::to_string(&request.messages)
    {
        span.record("gen_ai.input.messages", text);
    }
    span
}

/// Records a model call's outcome on its `chat` span and tells the hook.
pub(crate) fn chat_ended(
    span: &Span,
    provider: &str,
    model: &str,
    response: &Result<ChatResponse, crate::error::LlmError>,
    duration: Duration,
) {
    let error = match response {
        Ok(response) => {
            if let Some(usage) = response.usage {
                span.record("gen_ai.usage.input_tokens", i64::from(usage.prompt_tokens));
                span.record(
                    "gen_ai.usage.output_tokens",
                    i64::from(usage.completion_tokens),
                );
            }
            if let (Some(hook), Some(reason), false) =
                (hook(), &response.finish_reason, span.is_disabled())
            {
                hook.set_string_array(
                    span,
                    "gen_ai.response.finish_reasons",
                    vec![finish_reason(reason).to_string()],
                );
            }
            if capture_content()
                && !span.is_disabled()
                && let Ok(text) = serde_json::to_string(&[response.to_message()])
            {
                span.record("gen_ai.output.messages", text);
            }
            None
        }
        Err(e) => {
            span.record("otel.status_code", "ERROR");
            span.record("error.type", llm_error_type(e));
            Some(llm_error_type(e))
        }
    };
    if let Some(hook) = hook() {
        hook.model_call(&ModelCall {
            provider,
            model,
            usage: response.as_ref().ok().and_then(|r| r.usage),
            duration,
            error,
        });
    }
}

fn llm_error_type(error: &crate::error::LlmError) -> &'static str {
    use crate::error::LlmError;
    match error {
        LlmError::Authentication { .. } => "authentication",
        LlmError::RateLimited { .. } => "rate_limited",
        LlmError::ContextTooLong { .. } => "context_too_long",
        LlmError::InvalidRequest { .. } => "invalid_request",
        LlmError::Server { .. } => "server",
        LlmError::Timeout(_) => "timeout",
        LlmError::MalformedResponse(_) => "malformed_response",
        LlmError::Transport { .. } => "transport",
        _ => "_OTHER",
    }
}

/// The conventions' name of a finish reason.
fn finish_reason(reason: &FinishReason) -> &str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::ToolCalls => "tool_calls",
        FinishReason::Length => "length",
        FinishReason::ContentFilter => "content_filter",
        FinishReason::Other(other) => other,
    }
}

/// The `execute_tool` span of one tool call.
pub(crate) fn execute_tool(call: &crate::llm::ToolCall) -> Span {
    let span = tracing::info_span!(
        target: "spacebot::telemetry",
        "execute_tool",
        otel.name = %format_args!("execute_tool {}", call.name),
        otel.kind = "internal",
        gen_ai.operation.name = "execute_tool",
        gen_ai.tool.name = %call.name,
        gen_ai.tool.call.id = %call.id,
        "gen_ai.tool.type" = "function",
        gen_ai.tool.call.arguments = tracing::field::Empty,
    );
    if capture_content() {
        span.record("gen_ai.tool.call.arguments", call.arguments.as_str());
    }
    span
}

/// A span of the runtime's own (`spacebot.*`) for one step of the work, continuing `context`
/// when given (a claim or a notice continues the trace of the task's creation).
pub(crate) fn step(name: &'static str, task: &crate::ids::TaskRef, context: Option<&str>) -> Span {
    let span = tracing::info_span!(
        target: "spacebot::telemetry",
        "spacebot",
        otel.name = name,
        otel.kind = "internal",
        spacebot.task = %task,
        spacebot.task.status = tracing::field::Empty,
        spacebot.task.attempts = tracing::field::Empty,
    );
    continue_trace(&span, context);
    span
}

// Counts are recorded as `i64`: `tracing-opentelemetry` exports a `u64` as a string.

/// The `spacebot.store.commit` span of a turn's commit: what it writes; the attempts it took are
/// recorded when it ends ([`commit_ended`]).
pub(crate) fn store_commit(records: usize, consumed: usize) -> Span {
    tracing::info_span!(
        target: "spacebot::telemetry",
        "spacebot.store.commit",
        otel.name = "spacebot.store.commit",
        otel.kind = "internal",
        otel.status_code = tracing::field::Empty,
        spacebot.store.records = i64::try_from(records).unwrap_or(i64::MAX),
        spacebot.store.consumed = i64::try_from(consumed).unwrap_or(i64::MAX),
        spacebot.store.attempts = tracing::field::Empty,
        "error.type" = tracing::field::Empty,
    )
}

/// Records how a commit ended on its span: the attempts it took, and the error when it was given
/// up (the agent stopping while the store failed).
pub(crate) fn commit_ended(span: &Span, attempts: u32, failed: bool) {
    span.record("spacebot.store.attempts", i64::from(attempts));
    if failed {
        span.record("otel.status_code", "ERROR");
        span.record("error.type", "store");
    }
}

/// The `spacebot.store.retry` span of one failed store operation (`operation` says which) and
/// the backoff wait before its next try; enter it around the wait.
pub(crate) fn store_retry(operation: &str, attempt: u32, backoff: Duration) -> Span {
    tracing::info_span!(
        target: "spacebot::telemetry",
        "spacebot.store.retry",
        otel.name = "spacebot.store.retry",
        otel.kind = "internal",
        otel.status_code = "ERROR",
        spacebot.retry.operation = %operation,
        spacebot.retry.attempt = i64::from(attempt),
        spacebot.retry.backoff_ms = i64::try_from(backoff.as_millis()).unwrap_or(i64::MAX),
        "error.type" = "store",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_reasons_have_the_conventions_names() {
        assert_eq!(finish_reason(&FinishReason::Stop), "stop");
        assert_eq!(finish_reason(&FinishReason::ToolCalls), "tool_calls");
        assert_eq!(finish_reason(&FinishReason::Length), "length");
        assert_eq!(
            finish_reason(&FinishReason::Other("x".into())),
            "x".to_string()
        );
    }

    #[test]
    fn without_a_hook_nothing_is_stored() {
        assert!(current_context().is_none());
    }
}
