//! Test support: a Chat Completions server on 127.0.0.1 that replays fixtures and records what it
//! receives, a clock that records its sleeps, and the OpenAPI contract.
#![allow(dead_code, unreachable_pub)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::VecDeque;
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::post;
use futures::future::BoxFuture;
use serde_json::Value;
use spacebot_core::{Clock, ManualClock, Timestamp};
use tokio::sync::watch;

/// The fixtures directory.
pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A fixture's bytes.
pub fn fixture(name: &str) -> Vec<u8> {
    let path = fixtures_dir().join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read fixture {}: {e}", path.display()))
}

/// What the server sends for one request.
#[derive(Debug, Clone)]
pub enum Payload {
    /// The whole body at once.
    Whole(Vec<u8>),
    /// An event stream, one write per event.
    Events(Vec<u8>),
    /// An event stream, then the connection is broken once the test calls
    /// [`FixtureServer::reset`].
    EventsThenReset(Vec<u8>),
    /// An event stream, then silence with the connection open.
    EventsThenHang(Vec<u8>),
    /// No answer at all.
    Hang,
}

/// One scripted answer.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Payload,
    /// Answer a streamed request that offers tools as llama-cpp-python does ("Automatic
    /// streaming tool choice is not supported"): HTTP 200, then the stream ends without a chunk.
    /// The reply stays for the next request.
    pub cannot_stream_tools: bool,
}

impl Reply {
    /// 200 with a JSON fixture.
    pub fn json(name: &str) -> Self {
        Self::status_json(200, name)
    }
    /// `status` with a JSON fixture.
    pub fn status_json(status: u16, name: &str) -> Self {
        Self {
            status,
            headers: vec![("content-type".into(), "application/json".into())],
            body: Payload::Whole(fixture(name)),
            cannot_stream_tools: false,
        }
    }
    /// 200 with an event-stream fixture.
    pub fn sse(name: &str) -> Self {
        Self {
            status: 200,
            headers: vec![("content-type".into(), "text/event-stream".into())],
            body: Payload::Events(fixture(name)),
            cannot_stream_tools: false,
        }
    }
    /// `status` with a raw body.
    pub fn raw(status: u16, body: &str) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: Payload::Whole(body.as_bytes().to_vec()),
            cannot_stream_tools: false,
        }
    }
    /// No answer.
    pub fn hang() -> Self {
        Self {
            status: 200,
            headers: Vec::new(),
            body: Payload::Hang,
            cannot_stream_tools: false,
        }
    }
    /// This reply, kept for a request that does not stream tools; a streamed request that offers
    /// tools gets HTTP 200 and an empty stream first (see [`Reply::cannot_stream_tools`]).
    pub fn unless_streamed_with_tools(mut self) -> Self {
        self.cannot_stream_tools = true;
        self
    }
    /// This reply with one more header.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
    /// This reply's body sent as events, then `then`.
    pub fn then_reset(mut self) -> Self {
        if let Payload::Events(b) = self.body {
            self.body = Payload::EventsThenReset(b);
        }
        self
    }
    /// This reply's body sent as events, then silence.
    pub fn then_hang(mut self) -> Self {
        if let Payload::Events(b) = self.body {
            self.body = Payload::EventsThenHang(b);
        }
        self
    }
}

/// A request as the server saw it.
#[derive(Debug, Clone)]
pub struct Received {
    pub path: String,
    pub headers: HeaderMap,
    pub body: Value,
}

struct Shared {
    replies: Mutex<VecDeque<Reply>>,
    received: Mutex<Vec<Received>>,
    count: watch::Sender<usize>,
    reset: tokio::sync::Notify,
}

/// A Chat Completions server on 127.0.0.1 that answers with scripted replies, in order.
pub struct FixtureServer {
    pub base_url: String,
    shared: Arc<Shared>,
}

impl FixtureServer {
    /// Starts a server that will answer with `replies`, one per request.
    pub async fn start(replies: Vec<Reply>) -> Self {
        let (count, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            replies: Mutex::new(replies.into()),
            received: Mutex::new(Vec::new()),
            count,
            reset: tokio::sync::Notify::new(),
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(handle))
            .with_state(Arc::clone(&shared));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self {
            base_url: format!("http://{addr}/v1"),
            shared,
        }
    }

    /// Every request so far. Each body is checked against the OpenAPI request schema first.
    pub fn requests(&self) -> Vec<Received> {
        let received = self.shared.received.lock().unwrap().clone();
        for (i, r) in received.iter().enumerate() {
            assert_eq!(r.path, "/v1/chat/completions");
            contract::check_request(&r.body, &format!("request {i}"));
        }
        received
    }

    /// The one request body (asserting there was exactly one).
    pub fn only_body(&self) -> Value {
        let requests = self.requests();
        assert_eq!(requests.len(), 1, "expected exactly one request");
        requests[0].body.clone()
    }

    /// How many requests arrived.
    pub fn count(&self) -> usize {
        *self.shared.count.borrow()
    }

    /// Waits (at most 10 s of real time, as a safety net) until `n` requests have arrived.
    pub async fn wait_for_requests(&self, n: usize) {
        let mut rx = self.shared.count.subscribe();
        tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|c| *c >= n))
            .await
            .expect("the requests did not arrive")
            .unwrap();
    }

    /// Breaks the connection of a reply sent with [`Reply::then_reset`].
    pub fn reset(&self) {
        self.shared.reset.notify_one();
    }

    /// Replies not used yet.
    pub fn unused_replies(&self) -> usize {
        self.shared.replies.lock().unwrap().len()
    }
}

async fn handle(
    State(shared): State<Arc<Shared>>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or_else(|e| {
        Value::String(format!("not JSON: {e}: {}", String::from_utf8_lossy(&body)))
    });
    let streams_tools = body["stream"] == Value::Bool(true)
        && body["tools"].as_array().is_some_and(|t| !t.is_empty());
    shared.received.lock().unwrap().push(Received {
        path: uri.path().to_owned(),
        headers,
        body,
    });
    let reply = {
        let mut replies = shared.replies.lock().unwrap();
        match replies.front() {
            Some(r) if r.cannot_stream_tools && streams_tools => Some(Reply {
                status: 200,
                headers: vec![("content-type".into(), "text/event-stream".into())],
                body: Payload::Whole(Vec::new()),
                cannot_stream_tools: false,
            }),
            _ => replies.pop_front(),
        }
    };
    shared.count.send_modify(|c| *c += 1);
    let Some(reply) = reply else {
        return Response::builder()
            .status(599)
            .body(Body::from("no scripted reply left"))
            .unwrap();
    };
    let mut builder = Response::builder().status(StatusCode::from_u16(reply.status).unwrap());
    for (k, v) in &reply.headers {
        builder = builder.header(k, v);
    }
    let body = match reply.body {
        Payload::Whole(b) => Body::from(b),
        Payload::Events(b) => Body::from_stream(futures::stream::iter(
            split_events(&b).into_iter().map(Ok::<_, Infallible>),
        )),
        Payload::EventsThenReset(b) => {
            let events = split_events(&b).into_iter().map(Ok::<_, std::io::Error>);
            let shared = Arc::clone(&shared);
            let reset = futures::stream::once(async move {
                shared.reset.notified().await;
                Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "connection reset",
                ))
            });
            Body::from_stream(futures::StreamExt::chain(
                futures::stream::iter(events),
                reset,
            ))
        }
        Payload::EventsThenHang(b) => {
            let events =
                futures::stream::iter(split_events(&b).into_iter().map(Ok::<_, Infallible>));
            Body::from_stream(futures::StreamExt::chain(
                events,
                futures::stream::pending(),
            ))
        }
        Payload::Hang => {
            futures::future::pending::<()>().await;
            Body::empty()
        }
    };
    builder.body(body).unwrap()
}

/// Splits an event-stream body after each blank line, so each event is its own write.
fn split_events(body: &[u8]) -> Vec<Bytes> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i + 1 < body.len() {
        if body[i] == b'\n' && body[i + 1] == b'\n' {
            out.push(Bytes::copy_from_slice(&body[start..i + 2]));
            start = i + 2;
            i += 2;
        } else {
            i += 1;
        }
    }
    if start < body.len() {
        out.push(Bytes::copy_from_slice(&body[start..]));
    }
    out
}

/// A [`ManualClock`] that records every sleep asked of it. Sleeps shorter than `auto_below`
/// (retry waits) pass at once by moving the clock forward; longer ones (timeouts) wait until the
/// test moves the clock.
#[derive(Debug, Clone)]
pub struct TestClock {
    pub manual: ManualClock,
    sleeps: Arc<Mutex<Vec<Duration>>>,
    auto_below: Duration,
}

impl TestClock {
    /// A clock at 1 000 000 ms whose sleeps shorter than `auto_below` pass at once.
    pub fn new(auto_below: Duration) -> Self {
        Self {
            manual: ManualClock::new(1_000_000),
            sleeps: Arc::default(),
            auto_below,
        }
    }

    /// Every sleep asked for, in order.
    pub fn sleeps(&self) -> Vec<Duration> {
        self.sleeps.lock().unwrap().clone()
    }

    /// The sleeps that passed at once (the retry waits).
    pub fn waits(&self) -> Vec<Duration> {
        self.sleeps()
            .into_iter()
            .filter(|d| *d < self.auto_below)
            .collect()
    }

    /// Milliseconds since the clock started.
    pub fn elapsed_ms(&self) -> i64 {
        self.manual.now().as_millis() - 1_000_000
    }
}

impl Clock for TestClock {
    fn now(&self) -> Timestamp {
        self.manual.now()
    }
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        self.sleeps.lock().unwrap().push(duration);
        let sleep = self.manual.sleep(duration);
        if duration < self.auto_below {
            self.manual.advance(duration);
        }
        sleep
    }
}

/// The OpenAPI contract: the request and response schemas of `/chat/completions`.
pub mod contract {
    use super::*;

    /// The trimmed OpenAPI description kept with the tests (see `tests/openapi/README.md`).
    pub fn spec_path() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openapi/chat-completions.json")
    }

    /// The compiled schemas.
    pub struct Contract {
        pub request: jsonschema::Validator,
        pub response: jsonschema::Validator,
        pub chunk: jsonschema::Validator,
        pub error: jsonschema::Validator,
    }

    /// The contract, parsed once per test binary. Panics (so every test using it fails) when the
    /// file is missing, unreadable or lacks a schema: the contract is never skipped.
    pub fn get() -> &'static Contract {
        static CONTRACT: OnceLock<Contract> = OnceLock::new();
        CONTRACT.get_or_init(|| {
            let path = spec_path();
            let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
                panic!(
                    "the OpenAPI contract {} cannot be read ({e}); it is part of the repository",
                    path.display()
                )
            });
            let mut doc: Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
            openapi_nullable_to_json_schema(&mut doc);
            let components = doc
                .get("components")
                .cloned()
                .unwrap_or_else(|| panic!("{} has no components", path.display()));
            let compile = |name: &str| {
                assert!(
                    components["schemas"].get(name).is_some(),
                    "{} has no schema {name}",
                    path.display()
                );
                let schema = serde_json::json!({
                    "$schema": "https://json-schema.org/draft/2020-12/schema",
                    "$ref": format!("#/components/schemas/{name}"),
                    "components": components,
                });
                jsonschema::draft202012::new(&schema)
                    .unwrap_or_else(|e| panic!("cannot compile {name}: {e}"))
            };
            Contract {
                request: compile("CreateChatCompletionRequest"),
                response: compile("CreateChatCompletionResponse"),
                chunk: compile("CreateChatCompletionStreamResponse"),
                error: compile("ErrorResponse"),
            }
        })
    }

    /// OpenAPI's `nullable: true` (3.0 style, still used in places of this 3.1 file) means "or
    /// null"; JSON Schema ignores the keyword, so it becomes `anyOf [schema, null]`.
    pub fn openapi_nullable_to_json_schema(value: &mut Value) {
        match value {
            Value::Object(map) => {
                for v in map.values_mut() {
                    openapi_nullable_to_json_schema(v);
                }
                if map.remove("nullable") == Some(Value::Bool(true)) {
                    let inner = Value::Object(std::mem::take(map));
                    map.insert("anyOf".into(), serde_json::json!([inner, {"type": "null"}]));
                }
            }
            Value::Array(items) => items.iter_mut().for_each(openapi_nullable_to_json_schema),
            _ => {}
        }
    }

    fn check(validator: &jsonschema::Validator, instance: &Value, what: &str, schema: &str) {
        if validator.is_valid(instance) {
            return;
        }
        let errors: Vec<String> = validator
            .iter_errors(instance)
            .map(|e| format!("  at {}: {e}", e.instance_path()))
            .collect();
        assert!(
            errors.is_empty(),
            "{what} does not match {schema}:\n{}\n{}",
            errors.join("\n"),
            serde_json::to_string_pretty(instance).unwrap()
        );
    }

    /// Checks a request body against `CreateChatCompletionRequest` .
    pub fn check_request(body: &Value, what: &str) {
        check(&get().request, body, what, "CreateChatCompletionRequest");
    }

    /// Checks a response body against `CreateChatCompletionResponse`.
    pub fn check_response(body: &Value, what: &str) {
        check(&get().response, body, what, "CreateChatCompletionResponse");
    }

    /// Checks a stream chunk against `CreateChatCompletionStreamResponse`.
    pub fn check_chunk(body: &Value, what: &str) {
        check(
            &get().chunk,
            body,
            what,
            "CreateChatCompletionStreamResponse",
        );
    }

    /// Checks an error body against `ErrorResponse`.
    pub fn check_error(body: &Value, what: &str) {
        check(&get().error, body, what, "ErrorResponse");
    }
}
