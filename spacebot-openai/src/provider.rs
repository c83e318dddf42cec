//! The provider: HTTP, timeouts, retries and streaming.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use eventsource_stream::{Event, EventStreamError, Eventsource};
use futures::future::{self, Either};
use futures::stream::{BoxStream, Stream, StreamExt};
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use spacebot_core::llm::{ChatRequest, ChatResponse, LlmProvider, StreamEvent, ToolChoice};
use spacebot_core::{Clock, LlmError};

use crate::config::{ConfigError, OpenAiConfig};
use crate::error::{error_event, from_status, is_quota_exhausted, retry_after};
use crate::stream::StreamAssembler;
use crate::wire::{Defaults, build_request, parse_response};

/// An [`LlmProvider`] for OpenAI's Chat Completions API and the servers that speak it.
///
/// Timeouts and retry waits are measured by the [`Clock`] given at construction, so a test with a
/// [`ManualClock`](spacebot_core::ManualClock) decides when they pass. The HTTP client needs a
/// tokio runtime.
///
/// ```no_run
/// use std::sync::Arc;
/// use spacebot_core::{ChatMessage, ChatRequest, LlmProvider};
/// use spacebot_core::rt::TokioClock;
/// use spacebot_openai::{OpenAiConfig, OpenAiProvider};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let provider = OpenAiProvider::new(OpenAiConfig::from_env()?, Arc::new(TokioClock))?;
/// let answer = provider
///     .complete(ChatRequest {
///         messages: vec![ChatMessage::user("Say hello.")],
///         ..ChatRequest::default()
///     })
///     .await?;
/// println!("{}", answer.content.unwrap_or_default());
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct OpenAiProvider {
    inner: Arc<Inner>,
}

struct Inner {
    config: OpenAiConfig,
    endpoint: String,
    client: reqwest::Client,
    clock: Arc<dyn Clock>,
}

impl fmt::Debug for OpenAiProvider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAiProvider")
            .field("endpoint", &self.inner.endpoint)
            .field("model", &self.inner.config.model)
            .field("dialect", &self.inner.config.dialect.name)
            .finish_non_exhaustive()
    }
}

/// A failed attempt: the error, and how long the server asked to wait before the next one.
#[derive(Debug)]
struct Failure {
    error: LlmError,
    retry_after: Option<Duration>,
}

impl From<LlmError> for Failure {
    fn from(error: LlmError) -> Self {
        let retry_after = match &error {
            LlmError::RateLimited { retry_after, .. } => *retry_after,
            _ => None,
        };
        Self { error, retry_after }
    }
}

impl OpenAiProvider {
    /// A provider for `config`, timing timeouts and retries with `clock`.
    ///
    /// Fails when the configuration is unusable (a base URL that is not an http(s) URL, an empty
    /// model, zero timeouts, a header that HTTP cannot carry); the error names the setting.
    pub fn new(config: OpenAiConfig, clock: Arc<dyn Clock>) -> Result<Self, ConfigError> {
        config.validate()?;
        let client = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .default_headers(default_headers(&config)?)
            .user_agent(concat!("spacebot-openai/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| ConfigError::Client(e.to_string()))?;
        Ok(Self {
            inner: Arc::new(Inner {
                endpoint: config.endpoint(),
                config,
                client,
                clock,
            }),
        })
    }

    /// The configuration in use.
    pub fn config(&self) -> &OpenAiConfig {
        &self.inner.config
    }

    /// The request body this provider sends for `request` (streamed or not), as JSON.
    pub fn request_body(
        &self,
        request: &ChatRequest,
        stream: bool,
    ) -> Result<serde_json::Value, LlmError> {
        let wire = build_request(request, self.defaults(), stream)?;
        serde_json::to_value(&wire)
            .map_err(|e| LlmError::Other(format!("cannot encode the request: {e}")))
    }

    fn defaults(&self) -> Defaults<'_> {
        let config = &self.inner.config;
        Defaults {
            model: &config.model,
            max_tokens: config.max_tokens,
            dialect: &config.dialect,
        }
    }

    fn encode(&self, request: &ChatRequest, stream: bool) -> Result<Vec<u8>, LlmError> {
        let wire = build_request(request, self.defaults(), stream)?;
        serde_json::to_vec(&wire)
            .map_err(|e| LlmError::Other(format!("cannot encode the request: {e}")))
    }

    /// Whether `request` may be streamed: it offers no tools (or forbids them), or the dialect
    /// streams answers to requests with tools ([`Dialect::streams_tool_calls`]).
    ///
    /// [`Dialect::streams_tool_calls`]: crate::Dialect::streams_tool_calls
    fn may_stream(&self, request: &ChatRequest) -> bool {
        let offers_tools =
            !request.tools.is_empty() && !matches!(request.tool_choice, Some(ToolChoice::None));
        !offers_tools || self.inner.config.dialect.streams_tool_calls
    }

    /// `complete` without a stream, with retries.
    async fn complete_plain(&self, request: &ChatRequest) -> Result<ChatResponse, LlmError> {
        let body = self.encode(request, false)?;
        let inner = &self.inner;
        inner
            .with_retries(|| inner.complete_once(body.clone()))
            .await
    }

    /// `complete` through a stream (see [`OpenAiConfig::stream_completions`]).
    async fn complete_streamed(&self, request: ChatRequest) -> Result<ChatResponse, LlmError> {
        let mut events = self.stream(request).await?;
        while let Some(event) = events.next().await {
            if let StreamEvent::Done(response) = event? {
                return Ok(response);
            }
        }
        Err(LlmError::MalformedResponse(
            "the stream ended without a response".to_owned(),
        ))
    }
}

fn default_headers(config: &OpenAiConfig) -> Result<HeaderMap, ConfigError> {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(key) = &config.api_key {
        let mut value =
            HeaderValue::from_str(&format!("Bearer {}", key.expose())).map_err(|_| {
                ConfigError::invalid("api_key", "contains characters an HTTP header cannot carry")
            })?;
        value.set_sensitive(true);
        headers.insert(AUTHORIZATION, value);
    }
    let named = [
        ("organization", "openai-organization", &config.organization),
        ("project", "openai-project", &config.project),
    ];
    for (setting, name, value) in named {
        if let Some(value) = value {
            let value = HeaderValue::from_str(value).map_err(|_| {
                ConfigError::invalid(setting, "contains characters an HTTP header cannot carry")
            })?;
            headers.insert(HeaderName::from_static(name), value);
        }
    }
    for (i, (name, value)) in config.extra_headers.iter().enumerate() {
        let setting = format!("extra_headers[{i}]");
        let name = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
            ConfigError::invalid(&setting, format!("{name:?} is not a header name"))
        })?;
        let mut value = HeaderValue::from_str(value).map_err(|_| {
            ConfigError::invalid(
                &setting,
                "the value contains characters a header cannot carry",
            )
        })?;
        if name == AUTHORIZATION || name.as_str().contains("key") {
            value.set_sensitive(true);
        }
        headers.insert(name, value);
    }
    Ok(headers)
}

impl Inner {
    fn now(&self) -> SystemTime {
        let millis = u64::try_from(self.clock.now().as_millis()).unwrap_or(0);
        SystemTime::UNIX_EPOCH + Duration::from_millis(millis)
    }

    /// Runs `attempt` until it succeeds, fails in a way retrying cannot help, or the retries are
    /// spent, waiting between attempts on the clock.
    async fn with_retries<T, F, Fut>(&self, mut attempt: F) -> Result<T, LlmError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, Failure>>,
    {
        let policy = &self.config.retry;
        let mut retry = 0;
        loop {
            let failure = match attempt().await {
                Ok(value) => return Ok(value),
                Err(failure) => failure,
            };
            let error = failure.error;
            let retryable = error.is_retryable()
                && !matches!(&error, LlmError::RateLimited { message, .. } if is_quota_exhausted(message));
            if !retryable {
                return Err(error);
            }
            if retry >= policy.max_retries {
                return Err(gave_up(error, retry + 1));
            }
            let wait = match failure.retry_after {
                Some(asked) if asked > policy.max_retry_after => return Err(error),
                Some(asked) => asked,
                None => policy.jittered_backoff(retry, fastrand::f64()),
            };
            tracing::warn!(
                endpoint = %self.endpoint,
                retry = retry + 1,
                of = policy.max_retries,
                wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
                error = %error,
                "chat completion failed; retrying"
            );
            self.clock.sleep(wait).await;
            retry += 1;
        }
    }

    /// `fut`, or a timeout error once `limit` has passed on the clock.
    async fn timed<T>(
        &self,
        limit: Duration,
        fut: impl Future<Output = Result<T, Failure>>,
    ) -> Result<T, Failure> {
        let fut = std::pin::pin!(fut);
        match future::select(fut, self.clock.sleep(limit)).await {
            Either::Left((result, _)) => result,
            Either::Right(((), _)) => Err(LlmError::Timeout(limit).into()),
        }
    }

    /// Sends `body` once; a non-2xx answer becomes a [`Failure`] (its body read in full).
    async fn send(&self, body: Vec<u8>) -> Result<reqwest::Response, Failure> {
        let response = self
            .client
            .post(&self.endpoint)
            .body(body)
            .send()
            .await
            .map_err(|e| transport_error(e, self.config.connect_timeout))?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let headers = response.headers().clone();
        let body = response
            .bytes()
            .await
            .map_err(|e| transport_error(e, self.config.request_timeout))?;
        let error = from_status(
            status.as_u16(),
            &headers,
            &body,
            &self.config.dialect,
            self.now(),
        );
        Err(Failure {
            error,
            retry_after: retry_after(&headers, self.now()),
        })
    }

    async fn complete_once(&self, body: Vec<u8>) -> Result<ChatResponse, Failure> {
        self.timed(self.config.request_timeout, async {
            let response = self.send(body).await?;
            let bytes = response
                .bytes()
                .await
                .map_err(|e| transport_error(e, self.config.request_timeout))?;
            Ok(parse_response(&bytes, self.config.check_tool_arguments)?)
        })
        .await
    }
}

/// The last error of `attempts` failed attempts, its message saying so. Core's [`LlmError`] has no
/// variant for spent retries, so the last error keeps its kind (and what `is_retryable` says of
/// it) and its message gains `gave up after N attempts; last: ...`. A [`LlmError::Timeout`] carries
/// no message and is returned as it is.
fn gave_up(error: LlmError, attempts: u32) -> LlmError {
    if attempts < 2 {
        return error;
    }
    let note = |message: String| format!("gave up after {attempts} attempts; last: {message}");
    match error {
        LlmError::RateLimited {
            retry_after,
            message,
        } => LlmError::RateLimited {
            retry_after,
            message: note(message),
        },
        LlmError::Server { status, message } => LlmError::Server {
            status,
            message: note(message),
        },
        LlmError::Transport { message, source } => LlmError::Transport {
            message: note(message),
            source,
        },
        other => other,
    }
}

/// The text of `error` and its causes, each said once (hyper and reqwest often repeat a cause in
/// the text of the error that wraps it).
fn describe_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !message.contains(&text) {
            message = format!("{message}: {text}");
        }
        source = cause.source();
    }
    message
}

fn transport_error(error: reqwest::Error, limit: Duration) -> LlmError {
    if error.is_timeout() {
        return LlmError::Timeout(limit);
    }
    LlmError::Transport {
        message: describe_chain(&error),
        source: Some(Box::new(error)),
    }
}

#[async_trait]
impl LlmProvider for OpenAiProvider {
    fn provider_name(&self) -> &str {
        "openai"
    }

    fn default_model(&self) -> Option<&str> {
        Some(&self.inner.config.model)
    }

    /// OpenAI's tokenizer for models tiktoken-rs knows by name (feature `tiktoken`, on by
    /// default: [`TiktokenCounter`](crate::TiktokenCounter)); `None` otherwise, and the runtime
    /// estimates.
    fn token_counter(
        &self,
        model: Option<&str>,
    ) -> Option<Arc<dyn spacebot_core::context::TokenCounter>> {
        let model = model.unwrap_or(&self.inner.config.model);
        #[cfg(feature = "tiktoken")]
        {
            crate::tokens::TiktokenCounter::shared(model)
        }
        #[cfg(not(feature = "tiktoken"))]
        {
            let _ = model;
            None
        }
    }

    async fn complete(&self, request: ChatRequest) -> Result<ChatResponse, LlmError> {
        if self.inner.config.stream_completions && self.may_stream(&request) {
            return self.complete_streamed(request).await;
        }
        self.complete_plain(&request).await
    }

    async fn stream(
        &self,
        request: ChatRequest,
    ) -> Result<BoxStream<'static, Result<StreamEvent, LlmError>>, LlmError> {
        if !self.may_stream(&request) {
            // The server cannot stream an answer that may call tools: one plain call, its answer
            // yielded as the pieces a stream would have carried.
            tracing::debug!(
                dialect = self.inner.config.dialect.name,
                "the request offers tools and the dialect does not stream them; calling without a stream"
            );
            let response = self.complete_plain(&request).await?;
            return Ok(Box::pin(futures::stream::iter(
                as_events(response).into_iter().map(Ok),
            )));
        }
        let body = self.encode(&request, true)?;
        let inner = &self.inner;
        let response = inner
            .with_retries(|| inner.timed(inner.config.request_timeout, inner.send(body.clone())))
            .await?;
        let state = StreamState {
            events: Box::pin(error_lines_as_events(response.bytes_stream()).eventsource()),
            assembler: Some(
                StreamAssembler::new().check_arguments(self.inner.config.check_tool_arguments),
            ),
            pending: VecDeque::new(),
            inner: Arc::clone(&self.inner),
        };
        Ok(Box::pin(futures::stream::unfold(state, next_event)))
    }
}

/// The events a stream of `response` would have carried: its text (when it calls no tool), each
/// tool call whole, then `Done`.
fn as_events(response: ChatResponse) -> Vec<StreamEvent> {
    let mut events = Vec::with_capacity(response.tool_calls.len() + 2);
    match &response.content {
        Some(text) if !text.is_empty() && response.tool_calls.is_empty() => {
            events.push(StreamEvent::TextDelta { text: text.clone() });
        }
        _ => {}
    }
    for (index, call) in response.tool_calls.iter().enumerate() {
        events.push(StreamEvent::ToolCallDelta {
            index: u32::try_from(index).unwrap_or(u32::MAX),
            id: Some(call.id.clone()),
            name: Some(call.name.clone()),
            arguments: call.arguments.clone(),
        });
    }
    events.push(StreamEvent::Done(response));
    events
}

/// Rewrites `error: {...}` lines into `event: error` / `data: {...}`. llama.cpp's server has sent
/// errors that arise once a stream has started (a prompt too long for the context, for one) as a
/// line with the field name `error`, which event-stream readers ignore: the stream would look
/// empty. Nothing else changes, and no valid event-stream line starts with `error:`.
fn error_lines_as_events<S, B>(
    bytes: S,
) -> impl Stream<Item = Result<Vec<u8>, reqwest::Error>> + Send + 'static
where
    S: Stream<Item = Result<B, reqwest::Error>> + Send + 'static,
    B: AsRef<[u8]>,
{
    fn rewrite(lines: Vec<u8>) -> Vec<u8> {
        if !lines.windows(6).any(|w| w == b"error:") {
            return lines;
        }
        let mut out = Vec::with_capacity(lines.len() + 32);
        for line in lines.split_inclusive(|b| *b == b'\n') {
            match line.strip_prefix(b"error:") {
                Some(rest) => {
                    out.extend_from_slice(b"event: error\ndata:");
                    out.extend_from_slice(rest);
                }
                None => out.extend_from_slice(line),
            }
        }
        out
    }
    let state = (Box::pin(bytes), Vec::<u8>::new(), false);
    futures::stream::unfold(state, |(mut bytes, mut carry, ended)| async move {
        if ended {
            return None;
        }
        loop {
            match bytes.next().await {
                Some(Ok(piece)) => {
                    carry.extend_from_slice(piece.as_ref());
                    // Pass on whole lines only, so a line's start is always seen.
                    let Some(end) = carry.iter().rposition(|b| *b == b'\n') else {
                        continue;
                    };
                    let rest = carry.split_off(end + 1);
                    return Some((Ok(rewrite(carry)), (bytes, rest, false)));
                }
                Some(Err(error)) => return Some((Err(error), (bytes, carry, true))),
                None if carry.is_empty() => return None,
                None => return Some((Ok(rewrite(carry)), (bytes, Vec::new(), true))),
            }
        }
    })
}

type SseStream = std::pin::Pin<
    Box<dyn Stream<Item = Result<Event, EventStreamError<reqwest::Error>>> + Send + 'static>,
>;

struct StreamState {
    events: SseStream,
    /// `None` once the stream has ended (with `Done` or an error).
    assembler: Option<StreamAssembler>,
    pending: VecDeque<StreamEvent>,
    inner: Arc<Inner>,
}

async fn next_event(
    mut state: StreamState,
) -> Option<(Result<StreamEvent, LlmError>, StreamState)> {
    loop {
        if let Some(event) = state.pending.pop_front() {
            return Some((Ok(event), state));
        }
        let assembler = state.assembler.as_mut()?;
        if assembler.saw_done() {
            return finish(state);
        }
        let idle = state.inner.config.stream_idle_timeout;
        let next = match future::select(state.events.next(), state.inner.clock.sleep(idle)).await {
            Either::Left((next, _)) => next,
            Either::Right(((), _)) => {
                state.assembler = None;
                return Some((Err(LlmError::Timeout(idle)), state));
            }
        };
        match next {
            Some(Ok(event)) => {
                let fed = if event.event == "error" {
                    Err(error_event(&event.data))
                } else {
                    assembler.feed(&event.data)
                };
                match fed {
                    Ok(events) => state.pending.extend(events),
                    Err(error) => {
                        state.assembler = None;
                        return Some((Err(error), state));
                    }
                }
            }
            Some(Err(error)) => {
                let chunks = assembler.chunks();
                state.assembler = None;
                let error = match error {
                    EventStreamError::Transport(e) if e.is_timeout() => {
                        LlmError::Timeout(state.inner.config.request_timeout)
                    }
                    EventStreamError::Transport(e) => LlmError::Transport {
                        message: format!(
                            "the connection broke after {chunks} chunk(s) of the stream: {}",
                            describe_chain(&e)
                        ),
                        source: Some(Box::new(e)),
                    },
                    other => LlmError::MalformedResponse(format!(
                        "the event stream is unreadable after {chunks} chunk(s): {other}"
                    )),
                };
                return Some((Err(error), state));
            }
            None if assembler.is_complete() => return finish(state),
            None if assembler.chunks() == 0 => {
                state.assembler = None;
                return Some((Err(empty_stream()), state));
            }
            None => {
                let chunks = assembler.chunks();
                state.assembler = None;
                return Some((
                    Err(LlmError::MalformedResponse(format!(
                        "the stream ended after {chunks} chunk(s) without a finish reason or [DONE]: it was cut mid-way"
                    ))),
                    state,
                ));
            }
        }
    }
}

fn finish(mut state: StreamState) -> Option<(Result<StreamEvent, LlmError>, StreamState)> {
    let assembler = state.assembler.take()?;
    if assembler.chunks() == 0 {
        return Some((Err(empty_stream()), state));
    }
    let result = assembler.finish().map(StreamEvent::Done);
    Some((result, state))
}

/// HTTP 200, then a stream with no chunk (nothing at all, or only `[DONE]`). Core's [`LlmError`]
/// has no variant for it; it is a [`LlmError::MalformedResponse`] that says what was seen and
/// guesses no cause (servers do this for several: a prompt too long, a request they cannot
/// stream, a crash).
fn empty_stream() -> LlmError {
    LlmError::MalformedResponse(
        "the server sent an empty stream (HTTP 200, then the stream ended without a single chunk)"
            .to_owned(),
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    async fn rewritten(pieces: &[&str]) -> String {
        let input = futures::stream::iter(
            pieces
                .iter()
                .map(|p| Ok::<_, reqwest::Error>(p.as_bytes().to_vec()))
                .collect::<Vec<_>>(),
        );
        let out: Vec<Vec<u8>> = error_lines_as_events(input)
            .map(Result::unwrap)
            .collect()
            .await;
        String::from_utf8(out.concat()).unwrap()
    }

    #[tokio::test]
    async fn error_lines_become_error_events_however_the_body_is_split() {
        let body = "data: {\"a\":1}\n\nerror: {\"message\":\"x\"}\n\ndata: [DONE]\n\n";
        let expected =
            "data: {\"a\":1}\n\nevent: error\ndata: {\"message\":\"x\"}\n\ndata: [DONE]\n\n";
        for cut in 0..=body.len() {
            for second in cut..=body.len() {
                let pieces = [&body[..cut], &body[cut..second], &body[second..]];
                assert_eq!(rewritten(&pieces).await, expected, "cut at {cut}, {second}");
            }
        }
        // A last line without its newline is passed on; other text is untouched.
        assert_eq!(
            rewritten(&["data: x\n", "error: y"]).await,
            "data: x\nevent: error\ndata: y"
        );
        assert_eq!(
            rewritten(&["data: {\"e\":\"error: no\"}\n\n"]).await,
            "data: {\"e\":\"error: no\"}\n\n"
        );
    }
}
