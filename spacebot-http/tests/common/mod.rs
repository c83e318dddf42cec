//! A test organization served on 127.0.0.1 with the API, and small HTTP helpers.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use spacebot_core::llm::ChatResponse;
use spacebot_core::testing::ScriptedLlm;
use spacebot_core::{AgentId, OrgConfig, Organization, Stores};
use spacebot_http::{Api, HttpConfig, WebChat};

pub const TOKEN: &str = "test-token-123";

pub const ORG: &str = r#"
[[agents]]
id = "chief"
name = "Chief"

[[agents]]
id = "lead"
name = "Tech Lead"

[[agents]]
id = "cm"
name = "Community Manager"

[[links]]
from = "chief"
to = "lead"
direction = "two_way"
relationship = "superior"

[[links]]
from = "chief"
to = "cm"
direction = "one_way"
relationship = "peer"

[settings]
approval = "unless_superior"
conversation_turn_budget = 6
"#;

pub fn id(s: &str) -> AgentId {
    AgentId::parse(s).unwrap()
}

pub struct Server {
    pub base: String,
    pub org: Organization,
    pub llm: ScriptedLlm,
    pub http: reqwest::Client,
    pub token: Option<String>,
    /// The shared notes, when served with [`Options::notes`].
    pub notes: Option<spacebot_notes::Notes>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub struct Options {
    pub http: HttpConfig,
    pub replay_window: usize,
    pub toml: String,
    pub llm: Option<ScriptedLlm>,
    /// Serve shared notes (the organization gets the behaviour, the API its routes).
    pub notes: bool,
    /// Stream the scripted model's text answers word by word, this long between words.
    pub stream_pause: Option<Duration>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            http: HttpConfig::with_token(TOKEN),
            replay_window: 1024,
            toml: ORG.to_string(),
            llm: None,
            notes: false,
            stream_pause: None,
        }
    }
}

pub async fn serve() -> Server {
    serve_with(Options::default()).await
}

pub async fn serve_with(options: Options) -> Server {
    let llm = options.llm.clone().unwrap_or_else(|| {
        ScriptedLlm::new().with_fallback(|request| {
            let agent = request.agent.as_ref().map_or("?", |a| a.as_str());
            Ok(ChatResponse::text(format!("{agent} says ok")))
        })
    });
    let chat = WebChat::with_replay_window(options.replay_window);
    let config = OrgConfig::from_toml_str(&options.toml).unwrap();
    let notes = options.notes.then(spacebot_notes::Notes::new);
    let provider: Arc<dyn spacebot_core::LlmProvider> = match options.stream_pause {
        Some(pause) => Arc::new(Streaming {
            inner: llm.clone(),
            pause,
        }),
        None => Arc::new(llm.clone()),
    };
    let mut builder = Organization::builder(config)
        .stores(Stores::memory())
        .llm(provider)
        .outbound(Arc::new(chat.clone()));
    if let Some(notes) = &notes {
        builder = builder.behaviour(Arc::new(notes.clone()));
    }
    let org = builder.build().await.unwrap();
    org.start_all().await.unwrap();
    let token = options.http.token().map(str::to_string);
    let mut api = Api::new(org.clone(), chat, options.http).unwrap();
    if let Some(notes) = &notes {
        api = api.with_notes(notes.clone());
    }
    let app = api.router();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    Server {
        base: format!("http://{addr}"),
        org,
        llm,
        http: reqwest::Client::new(),
        token,
        notes,
        task,
    }
}

impl Server {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn authed(&self, rb: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.token {
            Some(t) => rb.bearer_auth(t),
            None => rb,
        }
    }

    pub async fn get(&self, path: &str) -> (u16, serde_json::Value) {
        let r = self
            .authed(self.http.get(self.url(path)))
            .send()
            .await
            .unwrap();
        decode(r).await
    }

    pub async fn get_text(&self, path: &str) -> (u16, String) {
        let r = self
            .authed(self.http.get(self.url(path)))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    pub async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> (u16, serde_json::Value) {
        let mut rb = self.authed(self.http.request(method, self.url(path)));
        if let Some(body) = body {
            rb = rb.json(&body);
        }
        decode(rb.send().await.unwrap()).await
    }

    pub async fn post(&self, path: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
        self.send(reqwest::Method::POST, path, Some(body)).await
    }

    pub async fn patch(&self, path: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
        self.send(reqwest::Method::PATCH, path, Some(body)).await
    }

    /// GETs `path` until `pred` holds (re-checking on every organization event, up to 10 s).
    pub async fn get_until(
        &self,
        path: &str,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let mut events = self.org.subscribe();
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let (_, body) = self.get(path).await;
                if pred(&body) {
                    return body;
                }
                let _ = tokio::time::timeout(Duration::from_millis(200), events.recv()).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("GET {path} did not satisfy the condition within 10 s"))
    }

    pub async fn link_id(&self, from: &str, to: &str) -> String {
        self.org.link(&id(from), &id(to)).unwrap().id.to_string()
    }

    /// Opens the event stream, resuming after `last_event_id` if given.
    pub async fn events(&self, last_event_id: Option<u64>) -> Events {
        let mut rb = self.authed(self.http.get(self.url("/api/events")));
        if let Some(id) = last_event_id {
            rb = rb.header("Last-Event-ID", id.to_string());
        }
        let response = rb.send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(
            response.headers()["content-type"].to_str().unwrap(),
            "text/event-stream"
        );
        use eventsource_stream::Eventsource;
        Events {
            inner: Box::pin(response.bytes_stream().eventsource()),
        }
    }
}

async fn decode(r: reqwest::Response) -> (u16, serde_json::Value) {
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    let value = if text.is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
    };
    (status, value)
}

/// Asserts the stable error shape and returns (code, field).
pub fn error_of(body: &serde_json::Value) -> (String, Option<String>) {
    let error = body
        .get("error")
        .unwrap_or_else(|| panic!("no error in {body}"));
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    (
        error["code"].as_str().unwrap().to_string(),
        error["field"].as_str().map(str::to_string),
    )
}

#[derive(Debug, Clone)]
pub struct Sse {
    pub id: Option<u64>,
    pub event: String,
    pub data: serde_json::Value,
}

type EventStream = std::pin::Pin<
    Box<
        dyn futures::Stream<
                Item = Result<
                    eventsource_stream::Event,
                    eventsource_stream::EventStreamError<reqwest::Error>,
                >,
            > + Send,
    >,
>;

pub struct Events {
    inner: EventStream,
}

impl Events {
    /// The next event, within 10 s.
    pub async fn next(&mut self) -> Sse {
        let e = tokio::time::timeout(Duration::from_secs(10), self.inner.next())
            .await
            .expect("no event within 10 s")
            .expect("stream ended")
            .expect("stream error");
        Sse {
            id: if e.id.is_empty() {
                None
            } else {
                Some(e.id.parse().unwrap())
            },
            event: e.event,
            data: serde_json::from_str(&e.data).unwrap(),
        }
    }

    /// Reads events until one matches, within 10 s; returns everything read.
    pub async fn until(&mut self, pred: impl Fn(&Sse) -> bool) -> Vec<Sse> {
        let mut seen = Vec::new();
        loop {
            let e = self.next().await;
            let done = pred(&e);
            seen.push(e);
            if done {
                return seen;
            }
        }
    }
}

/// Waits (up to 10 s) until `f` returns true, re-checking on every organization event.
pub async fn wait_for<F, Fut>(org: &Organization, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let mut events = org.subscribe();
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if f().await {
                return;
            }
            let _ = tokio::time::timeout(Duration::from_millis(200), events.recv()).await;
        }
    })
    .await
    .expect("condition not met within 10 s");
}

/// A scripted model that streams its text answers word by word, `pause` between words (answers
/// that call tools come whole).
#[derive(Debug)]
pub struct Streaming {
    pub inner: ScriptedLlm,
    pub pause: Duration,
}

#[async_trait::async_trait]
impl spacebot_core::LlmProvider for Streaming {
    async fn complete(
        &self,
        request: spacebot_core::llm::ChatRequest,
    ) -> Result<ChatResponse, spacebot_core::LlmError> {
        self.inner.complete(request).await
    }

    async fn stream(
        &self,
        request: spacebot_core::llm::ChatRequest,
    ) -> Result<
        futures::stream::BoxStream<
            'static,
            Result<spacebot_core::llm::StreamEvent, spacebot_core::LlmError>,
        >,
        spacebot_core::LlmError,
    > {
        use spacebot_core::llm::StreamEvent;
        let response = self.inner.complete(request).await?;
        let text = response.content.clone().unwrap_or_default();
        let pieces: Vec<String> = if response.tool_calls.is_empty() {
            text.split_inclusive(' ').map(str::to_string).collect()
        } else {
            Vec::new()
        };
        let pause = self.pause;
        let deltas = futures::stream::iter(pieces).then(move |text| async move {
            tokio::time::sleep(pause).await;
            Ok(StreamEvent::TextDelta { text })
        });
        let done = futures::stream::once(async move { Ok(StreamEvent::Done(response)) });
        Ok(Box::pin(deltas.chain(done)))
    }
}
