//! The router's event stream: organization events and web chat replies, numbered, kept in a
//! bounded replay window, and the [`WebChat`] outbound that publishes replies into it.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};

use async_trait::async_trait;
use serde::Serialize;
use spacebot_core::bus::RecvError;
use spacebot_core::runtime::outbound::{OutboundError, ReplyDelta};
use spacebot_core::{EventSubscription, Outbound, Reply, Source};
use tokio::sync::watch;

/// What an entry of the stream carries; the SSE `event:` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EntryKind {
    /// A [`spacebot_core::Event`].
    Org,
    /// A [`Reply`] published by [`WebChat`].
    Reply,
    /// The router's own subscription to the organization fell behind: `{"missed": n}`.
    Missed,
    /// A piece of an answer being generated ([`spacebot_core::runtime::outbound::ReplyDelta`]).
    Delta,
}

impl EntryKind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Org => "org",
            Self::Reply => "reply",
            Self::Missed => "missed",
            Self::Delta => "delta",
        }
    }
}

/// One numbered entry of the stream.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) id: u64,
    pub(crate) kind: EntryKind,
    pub(crate) data: Arc<str>,
}

#[derive(Debug)]
struct Window {
    entries: VecDeque<Entry>,
    last_id: u64,
}

/// Numbered entries (ids from 1), the last `capacity` kept for clients that reconnect.
#[derive(Debug)]
pub(crate) struct Hub {
    /// The recent requests' trees, fed by the same events and replies.
    pub(crate) requests: crate::requests::Requests,
    window: Mutex<Window>,
    capacity: usize,
    notify: watch::Sender<u64>,
}

/// What a client gets when it asks for entries after an id.
#[derive(Debug)]
pub(crate) struct Catchup {
    /// Entries that left the window before the client read them.
    pub(crate) missed: u64,
    /// The entries still kept, in order.
    pub(crate) entries: Vec<Entry>,
}

impl Hub {
    pub(crate) fn new(capacity: usize) -> Self {
        let (notify, _) = watch::channel(0);
        Self {
            requests: crate::requests::Requests::new(200),
            window: Mutex::new(Window {
                entries: VecDeque::new(),
                last_id: 0,
            }),
            capacity: capacity.max(1),
            notify,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Window> {
        self.window.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn push(&self, kind: EntryKind, data: String) -> u64 {
        let id = {
            let mut window = self.lock();
            window.last_id += 1;
            let id = window.last_id;
            window.entries.push_back(Entry {
                id,
                kind,
                data: data.into(),
            });
            while window.entries.len() > self.capacity {
                window.entries.pop_front();
            }
            id
        };
        self.notify.send_replace(id);
        id
    }

    pub(crate) fn push_json<T: Serialize>(&self, kind: EntryKind, value: &T) {
        match serde_json::to_string(value) {
            Ok(data) => {
                self.push(kind, data);
            }
            Err(e) => tracing::warn!(error = %e, "an event could not be serialized"),
        }
    }

    pub(crate) fn last_id(&self) -> u64 {
        self.lock().last_id
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.notify.subscribe()
    }

    /// Every entry after `after`, and how many of those left the window already.
    pub(crate) fn since(&self, after: u64) -> Catchup {
        let window = self.lock();
        let oldest = window.entries.front().map_or(window.last_id + 1, |e| e.id);
        let missed = oldest.saturating_sub(after + 1);
        let entries = window
            .entries
            .iter()
            .filter(|e| e.id > after)
            .cloned()
            .collect();
        Catchup { missed, entries }
    }
}

/// Forwards the organization's events into `hub` until the bus closes or the hub is dropped.
pub(crate) async fn forward(mut events: EventSubscription, hub: Weak<Hub>) {
    loop {
        let next = events.recv().await;
        let Some(hub) = hub.upgrade() else { return };
        match next {
            Ok(event) => {
                hub.requests.observe(&event);
                hub.push_json(EntryKind::Org, &event);
            }
            Err(RecvError::Lagged { missed }) => {
                hub.push_json(EntryKind::Missed, &serde_json::json!({ "missed": missed }));
            }
            Err(_) => return,
        }
    }
}

/// A web chat gateway: an [`Outbound`] that publishes every reply as a `reply` entry on the event
/// stream of the router it is given to (`GET /api/events`).
///
/// The organization's outbound is fixed when it is built, before the router exists, so the order is:
/// make a `WebChat`, give it to the builder as the outbound, build the organization, then hand both
/// to [`crate::Api::new`]. Replies made before the router exists wait in the chat's own stream
/// (kept in the replay window like every entry). A message posted to
/// `POST /api/agents/{agent}/messages` comes from platform [`WebChat::PLATFORM`]; its reply target
/// is the `chat_id` of the request.
///
/// By default every reply is published (the dashboard shows them all). With
/// [`WebChat::with_fallback`], replies to other platforms go to the application's own outbound
/// instead.
///
/// ```no_run
/// # async fn demo(config: spacebot_core::OrgConfig, llm: std::sync::Arc<dyn spacebot_core::LlmProvider>) -> Result<(), Box<dyn std::error::Error>> {
/// use std::sync::Arc;
/// use spacebot_core::{Organization, Stores};
/// use spacebot_http::{Api, HttpConfig, WebChat};
///
/// let chat = WebChat::new();
/// let org = Organization::builder(config)
///     .stores(Stores::memory())
///     .llm(llm)
///     .outbound(Arc::new(chat.clone()))
///     .build()
///     .await?;
/// org.start_all().await?;
/// let app = Api::new(org, chat, HttpConfig::with_token("s3cret"))?.router();
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
/// axum::serve(listener, app).await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct WebChat {
    pub(crate) hub: Arc<Hub>,
    fallback: Option<Arc<dyn Outbound>>,
}

impl WebChat {
    /// The platform of messages posted through the API.
    pub const PLATFORM: &'static str = "web";

    /// A web chat whose stream keeps the last 1024 entries for clients that reconnect.
    pub fn new() -> Self {
        Self::with_replay_window(1024)
    }

    /// A web chat whose stream keeps the last `entries` entries (at least 1) for clients that
    /// reconnect with `Last-Event-ID`.
    pub fn with_replay_window(entries: usize) -> Self {
        Self {
            hub: Arc::new(Hub::new(entries)),
            fallback: None,
        }
    }

    /// Sends replies to platforms other than [`WebChat::PLATFORM`] to `outbound` instead of
    /// publishing them.
    pub fn with_fallback(mut self, outbound: Arc<dyn Outbound>) -> Self {
        self.fallback = Some(outbound);
        self
    }
}

impl Default for WebChat {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl Outbound for WebChat {
    async fn send(&self, reply: Reply) -> Result<(), OutboundError> {
        self.hub.requests.reply(&reply);
        let web = matches!(&reply.source, Source::External { platform, .. } if platform == Self::PLATFORM);
        match &self.fallback {
            Some(fallback) if !web => fallback.send(reply).await,
            _ => {
                let data = serde_json::to_string(&reply)
                    .map_err(|e| OutboundError::Failed(format!("reply not serializable: {e}")))?;
                self.hub.push(EntryKind::Reply, data);
                Ok(())
            }
        }
    }

    /// Yes: the dashboard shows answers to web chat messages as they are generated.
    fn wants_deltas(&self) -> bool {
        true
    }

    /// Publishes a piece of an answer to a web chat message as a `delta` entry; pieces of answers
    /// to other platforms go to the fallback, when there is one.
    async fn send_delta(&self, delta: ReplyDelta) -> Result<(), OutboundError> {
        let web = delta
            .channel
            .as_str()
            .strip_prefix(Self::PLATFORM)
            .is_some_and(|rest| rest.starts_with(':'));
        match &self.fallback {
            Some(fallback) if !web => {
                if fallback.wants_deltas() {
                    fallback.send_delta(delta).await
                } else {
                    Ok(())
                }
            }
            _ => {
                let data = serde_json::to_string(&delta)
                    .map_err(|e| OutboundError::Failed(format!("delta not serializable: {e}")))?;
                self.hub.push(EntryKind::Delta, data);
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_reports_what_left_the_window() {
        let hub = Hub::new(3);
        for i in 0..5 {
            hub.push(EntryKind::Org, format!("{i}"));
        }
        let c = hub.since(0);
        assert_eq!(c.missed, 2);
        assert_eq!(
            c.entries.iter().map(|e| e.id).collect::<Vec<_>>(),
            [3, 4, 5]
        );
        let c = hub.since(3);
        assert_eq!(c.missed, 0);
        assert_eq!(c.entries.iter().map(|e| e.id).collect::<Vec<_>>(), [4, 5]);
        let c = hub.since(5);
        assert_eq!((c.missed, c.entries.len()), (0, 0));
    }
}
