//! An [axum] router over a spacebot [`Organization`]: the operators' surface of an application.
//!
//! Mount it beside your own routes. It serves:
//!
//! | path | what |
//! |---|---|
//! | `GET /` | the operator's console: topology editor, request trees, chat with streamed answers, approvals, task boards, link timelines, live activity |
//! | `/api/agents...` | agents with status, start/stop, their links, tasks, channels; chat and delegate |
//! | `/api/links...` | links: list, create, change (enable/disable), delete, timelines |
//! | `GET /api/topology` | the graph as JSON (seed 003), DOT or Mermaid |
//! | `/api/requests...` | each recent user request as a live tree (turns, model and tool calls, tasks across agents, conversations), with its spend |
//! | `GET /api/approvals` | tasks and MCP tool calls waiting for an operator's approval |
//! | `/api/conversations...` | conversations: list, one, sever |
//! | `/api/notes...` | shared notes ([`Api::with_notes`]): list, one, history, compare-and-set write, grants |
//! | `GET /api/events` (also `/events`) | server-sent events: organization events and chat replies, with ids and a replay window |
//! | `GET /api/openapi.json` | the OpenAPI description of all of the above |
//! | `/api/mcp...` | MCP servers, their state and grants; calls waiting for approval ([`Api::with_mcp_tools`]) |
//! | `/mcp` | the organization as an MCP server over streamable HTTP ([`Api::with_mcp`]) |
//! | `GET /.well-known/agent-card.json`, `/a2a...` | the exposed agents over A2A 1.0: cards and JSON-RPC with SSE ([`Api::with_a2a`]) |
//!
//! Every error is `{"error": {"code": "...", "message": "...", "field": "..."}}` with a 4xx status
//! for anything the client can fix. `/api/*` needs `Authorization: Bearer <token>` unless the
//! application opts out with [`HttpConfig::insecure_no_auth`]; the dashboard page and the OpenAPI
//! description are public (the page asks for the token, or reads it from the URL fragment
//! `#token=...`).
//!
//! Replies to chat messages posted through the API are published on the event stream by
//! [`WebChat`], the organization's outbound: see its documentation for the order of construction.
//!
//! ```no_run
//! # async fn demo(config: spacebot_core::OrgConfig, llm: std::sync::Arc<dyn spacebot_core::LlmProvider>) -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use spacebot_core::{Organization, Stores};
//! use spacebot_http::{Api, HttpConfig, WebChat};
//!
//! let chat = WebChat::new();
//! let org = Organization::builder(config)
//!     .stores(Stores::memory())
//!     .llm(llm)
//!     .outbound(Arc::new(chat.clone()))
//!     .build()
//!     .await?;
//! org.start_all().await?;
//! let config = HttpConfig::random_token();
//! println!("token: {}", config.token().unwrap_or_default());
//! let app = axum::Router::new()
//!     .route("/my-app", axum::routing::get(|| async { "mine" }))
//!     .merge(Api::new(org, chat, config)?.router());
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! axum::serve(listener, app).await?;
//! # Ok(()) }
//! ```
//!
//! See `docs/http.md` in the repository for the endpoints, the event stream and the dashboard.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]

mod api;
mod dashboard;
pub mod error;
mod extract;
mod hub;
pub mod notes;
mod openapi;
mod requests;
pub mod views;

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use spacebot_core::Organization;

pub use error::{ApiError, ErrorBody, ErrorDetail};
pub use hub::WebChat;
pub use openapi::openapi;

use crate::api::AppState;

/// Who may call the API, and where the dashboard links a task's trace.
#[derive(Clone, PartialEq, Eq)]
pub struct HttpConfig {
    token: Option<String>,
    trace_url: Option<String>,
}

impl std::fmt::Debug for HttpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpConfig")
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("trace_url", &self.trace_url)
            .finish()
    }
}

impl HttpConfig {
    /// Every `/api` request needs `Authorization: Bearer {token}`.
    pub fn with_token(token: impl Into<String>) -> Self {
        Self {
            token: Some(token.into()),
            trace_url: None,
        }
    }

    /// A fresh random token (two version-4 UUIDs: 244 random bits from a cryptographically secure
    /// generator, 64 hex digits); read it with [`token`](Self::token).
    pub fn random_token() -> Self {
        let token = format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        Self::with_token(token)
    }

    /// No authentication at all: anyone who can reach the socket controls the organization. Only
    /// for a server bound to a loopback address in a trusted machine, or behind a proxy that
    /// authenticates.
    pub fn insecure_no_auth() -> Self {
        Self {
            token: None,
            trace_url: None,
        }
    }

    /// Where a task's trace can be seen: a URL template in which `{trace_id}` stands for the
    /// trace id (32 hex digits), such as `http://localhost:16686/trace/{trace_id}` (Jaeger). The
    /// task views then carry a `trace_url` and the dashboard links each task to its trace.
    /// [`Api::new`] refuses a template without `{trace_id}`.
    pub fn with_trace_url(mut self, template: impl Into<String>) -> Self {
        self.trace_url = Some(template.into());
        self
    }

    /// The trace URL template, if any (see [`with_trace_url`](Self::with_trace_url)).
    pub fn trace_url(&self) -> Option<&str> {
        self.trace_url.as_deref()
    }

    /// The token, unless authentication is off.
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }
}

/// Why the API could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HttpError {
    /// The token is empty or has characters a header cannot carry.
    #[error("invalid token: {0}")]
    InvalidToken(&'static str),
    /// The trace URL template has no `{trace_id}` in it.
    #[error("invalid trace URL template {0:?}: it must contain {{trace_id}}")]
    InvalidTraceUrl(String),
    /// [`Api::new`] was called outside a Tokio runtime (it spawns the task that forwards events).
    #[error("spacebot-http needs a Tokio runtime: call Api::new inside one")]
    NoRuntime,
}

/// The API over one organization; [`router`](Api::router) gives the axum router.
#[derive(Debug, Clone)]
pub struct Api {
    state: Arc<AppState>,
    mcp: Option<spacebot_mcp::OrgServer>,
    a2a: Option<spacebot_a2a::A2aServer>,
}

impl Api {
    /// The API over `org`. `chat` should be the organization's outbound (see [`WebChat`]); events
    /// are numbered from the moment this returns. Spawns one Tokio task that forwards the
    /// organization's events into the stream; it ends when the organization's event bus closes or
    /// every clone of the API and its routers is dropped.
    pub fn new(org: Organization, chat: WebChat, config: HttpConfig) -> Result<Self, HttpError> {
        if let Some(token) = &config.token {
            if token.is_empty() {
                return Err(HttpError::InvalidToken("it is empty"));
            }
            if !token.chars().all(|c| c.is_ascii_graphic()) {
                return Err(HttpError::InvalidToken(
                    "only visible ASCII characters are allowed",
                ));
            }
        }
        if let Some(template) = &config.trace_url
            && !template.contains("{trace_id}")
        {
            return Err(HttpError::InvalidTraceUrl(template.clone()));
        }
        let handle = tokio::runtime::Handle::try_current().map_err(|_| HttpError::NoRuntime)?;
        let hub = chat.hub.clone();
        let events = org.subscribe();
        handle.spawn(hub::forward(events, Arc::downgrade(&hub)));
        Ok(Self {
            mcp: None,
            a2a: None,
            state: Arc::new(AppState {
                org,
                hub,
                token: config.token,
                trace_url: config.trace_url,
                closing: tokio::sync::watch::channel(false).0,
                notes: std::sync::RwLock::new(None),
                mcp: std::sync::RwLock::new(None),
            }),
        })
    }

    /// Ends every open event stream (`GET /api/events`), and any opened later at once.
    ///
    /// An event stream never ends by itself, so a server's graceful shutdown (axum's
    /// `with_graceful_shutdown`, which waits for every connection) would wait for its clients
    /// forever: call this when the shutdown starts, or pass the signal through
    /// [`graceful_shutdown`](Self::graceful_shutdown). The rest of the API keeps working.
    pub fn shutdown(&self) {
        self.state.closing.send_replace(true);
    }

    /// Whether [`shutdown`](Self::shutdown) was called.
    pub fn is_shut_down(&self) -> bool {
        *self.state.closing.borrow()
    }

    /// A future for axum's `with_graceful_shutdown`: it waits for `signal`, then ends the event
    /// streams ([`shutdown`](Self::shutdown)) so the server's connections can close.
    ///
    /// ```no_run
    /// # async fn demo(api: spacebot_http::Api) -> std::io::Result<()> {
    /// let listener = tokio::net::TcpListener::bind("127.0.0.1:7860").await?;
    /// // In an application: `async { let _ = tokio::signal::ctrl_c().await; }`.
    /// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    /// # drop(stop);
    /// let signal = async {
    ///     let _ = stopped.await;
    /// };
    /// axum::serve(listener, api.router())
    ///     .with_graceful_shutdown(api.graceful_shutdown(signal))
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn graceful_shutdown<F>(
        &self,
        signal: F,
    ) -> impl std::future::Future<Output = ()> + Send + 'static
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let api = self.clone();
        async move {
            signal.await;
            api.shutdown();
        }
    }

    /// Serves the organization's shared notes under `/api/notes` (give the same
    /// [`Notes`](spacebot_notes::Notes) handle the organization was built with). Without it those
    /// routes answer 404.
    pub fn with_notes(self, notes: spacebot_notes::Notes) -> Self {
        *self
            .state
            .notes
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(notes);
        self
    }

    /// Serves the MCP tools behaviour's state under `/api/mcp` (give the same
    /// [`Mcp`](spacebot_mcp::Mcp) handle the organization was built with): the servers, their
    /// state and the agents' grants (`GET /api/mcp/servers`, also on the dashboard), and the calls
    /// waiting for approval (`GET /api/mcp/calls`, `POST /api/mcp/calls/{id}/approve` and
    /// `/reject`). Without it those routes answer 404.
    pub fn with_mcp_tools(self, mcp: spacebot_mcp::Mcp) -> Self {
        *self
            .state
            .mcp
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(mcp);
        self
    }

    /// Serves the organization as an MCP server at `/mcp` (streamable HTTP), behind the same
    /// bearer token as `/api`: see [`spacebot_mcp::OrgServer`]. Without a token
    /// ([`HttpConfig::insecure_no_auth`]) it also refuses requests whose `Host` is not a loopback
    /// name (against DNS rebinding); with one, the token is what keeps other callers out.
    pub fn with_mcp(mut self, server: spacebot_mcp::OrgServer) -> Self {
        self.mcp = Some(server);
        self
    }

    /// Serves the exposed agents over A2A 1.0 (see [`spacebot_a2a::A2aServer`]): the agent cards
    /// at `/.well-known/agent-card.json` and `/a2a/{agent}/.well-known/agent-card.json` (public:
    /// they are how clients discover the agents; with a token they declare the bearer scheme),
    /// JSON-RPC at `/a2a` and `/a2a/{agent}` behind the same bearer token as `/api`.
    pub fn with_a2a(mut self, server: spacebot_a2a::A2aServer) -> Self {
        self.a2a = Some(server.with_token(self.state.token.clone()));
        self
    }

    /// The organization.
    pub fn organization(&self) -> &Organization {
        &self.state.org
    }

    /// The router: the dashboard at `/`, the API under `/api`, the event stream also at `/events`.
    pub fn router(&self) -> Router {
        let api = Router::new()
            .route("/api/health", get(api::health))
            .route("/api/agents", get(api::list_agents))
            .route("/api/agents/{agent}", get(api::get_agent))
            .route("/api/agents/{agent}/start", post(api::start_agent))
            .route("/api/agents/{agent}/stop", post(api::stop_agent))
            .route("/api/agents/{agent}/links", get(api::agent_links))
            .route("/api/agents/{agent}/spend", get(api::agent_spend))
            .route("/api/spend", get(api::org_spend))
            .route(
                "/api/agents/{agent}/limits/{period}",
                axum::routing::put(api::set_agent_limits).delete(api::clear_agent_limits),
            )
            .route(
                "/api/limits/{period}",
                axum::routing::put(api::set_org_limits).delete(api::clear_org_limits),
            )
            .route("/api/requests", get(api::list_requests))
            .route("/api/requests/{request}/tree", get(api::request_tree))
            .route("/api/approvals", get(api::approvals))
            .route("/api/requests/{request}/spend", get(api::request_spend))
            .route(
                "/api/requests/{request}/limits",
                axum::routing::put(api::set_request_limits),
            )
            .route("/api/requests/{request}/resume", post(api::resume_request))
            .route("/api/agents/{agent}/messages", post(api::post_message))
            .route("/api/agents/{agent}/delegate", post(api::delegate))
            .route("/api/agents/{agent}/tasks", get(api::list_tasks))
            .route("/api/agents/{agent}/tasks/{number}", get(api::get_task))
            .route(
                "/api/agents/{agent}/tasks/{number}/approve",
                post(api::approve_task),
            )
            .route(
                "/api/agents/{agent}/tasks/{number}/reject",
                post(api::reject_task),
            )
            .route(
                "/api/agents/{agent}/tasks/{number}/cancel",
                post(api::cancel_task),
            )
            .route("/api/agents/{agent}/channels", get(api::list_channels))
            .route(
                "/api/agents/{agent}/channels/{channel}",
                get(api::channel_history),
            )
            .route("/api/links", get(api::list_links).post(api::create_link))
            .route(
                "/api/links/{link}",
                get(api::get_link)
                    .patch(api::update_link)
                    .delete(api::delete_link),
            )
            .route("/api/links/{link}/timeline", get(api::link_timeline))
            .route("/api/topology", get(api::topology))
            .route("/api/conversations", get(api::list_conversations))
            .route(
                "/api/conversations/{conversation}",
                get(api::get_conversation),
            )
            .route(
                "/api/conversations/{conversation}/sever",
                post(api::sever_conversation),
            )
            .route("/api/notes", get(notes::list_notes))
            .route(
                "/api/notes/{name}",
                get(notes::get_note).put(notes::write_note),
            )
            .route("/api/notes/{name}/history", get(notes::note_history))
            .route(
                "/api/notes/{name}/access/{agent}",
                put(notes::grant_note_access).delete(notes::revoke_note_access),
            )
            .route("/api/mcp/servers", get(api::mcp_servers))
            .route("/api/mcp/calls", get(api::mcp_calls))
            .route("/api/mcp/calls/{id}/approve", post(api::approve_mcp_call))
            .route("/api/mcp/calls/{id}/reject", post(api::reject_mcp_call))
            .route("/api/events", get(api::events))
            .route("/events", get(api::events))
            .fallback(api_not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .route_layer(middleware::from_fn_with_state(self.state.clone(), auth))
            .with_state(self.state.clone());
        let router = Router::new()
            .route("/api/openapi.json", get(openapi::serve))
            .merge(dashboard::routes())
            .merge(api);
        let router = match &self.a2a {
            Some(server) => router.merge(server.router()),
            None => router,
        };
        match &self.mcp {
            Some(server) => {
                let service = server.http_service(self.state.token.is_none());
                router.merge(
                    Router::new()
                        .nest_service("/mcp", service)
                        .layer(middleware::from_fn_with_state(self.state.clone(), auth)),
                )
            }
            None => router,
        }
    }
}

async fn api_not_found(request: Request) -> ApiError {
    ApiError::not_found(format!(
        "no endpoint {} {}",
        request.method(),
        request.uri().path()
    ))
}

async fn method_not_allowed(request: Request) -> ApiError {
    ApiError::new(
        axum::http::StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!(
            "{} is not allowed on {}",
            request.method(),
            request.uri().path()
        ),
    )
}

/// Checks the bearer token (or `access_token` on the event stream, for `EventSource`).
async fn auth(State(st): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let Some(expected) = st.token.as_deref() else {
        return next.run(request).await;
    };
    let from_header = request
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let path = request.uri().path();
    let from_query = if path == "/api/events" || path == "/events" {
        request.uri().query().and_then(|q| {
            form_urlencoded::parse(q.as_bytes())
                .find(|(k, _)| k == "access_token")
                .map(|(_, v)| v.into_owned())
        })
    } else {
        None
    };
    let given = from_header.map(str::to_string).or(from_query);
    match given {
        Some(token) if constant_time_eq(token.as_bytes(), expected.as_bytes()) => {
            next.run(request).await
        }
        Some(_) => ApiError::unauthorized("the bearer token is wrong")
            .with_field("Authorization")
            .into_response(),
        None => {
            let mut response = ApiError::unauthorized(
                "this API needs a bearer token: send Authorization: Bearer <token>",
            )
            .with_field("Authorization")
            .into_response();
            response.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer"),
            );
            response
        }
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
