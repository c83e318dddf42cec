//! The event stream (server-sent events).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures::Stream;
use tokio::sync::watch;

use crate::error::{ApiError, ErrorBody};
use crate::extract::ApiQuery;
use crate::hub::{EntryKind, Hub};
use crate::views::*;

use super::{ApiResult, St};

/// The event stream (server-sent events).
///
/// Each event has an `id` (increasing from 1), an `event` type and JSON `data`:
/// - `org`: an organization event (`spacebot_core::Event`: `at`, `agent`, `link`, `channel`,
///   `task`, `parent`, and `kind` with its `type`);
/// - `reply`: an agent's reply published by the web chat (`spacebot_core::Reply`);
/// - `missed` (no id): `{"missed": n}`, events this client cannot get any more (it reconnected
///   after they left the replay window, or the router itself fell behind the organization).
///
/// A client that reconnects with `Last-Event-ID` gets every event after that id still in the
/// replay window, then live ones; an id above the newest (the server restarted and numbers from 1
/// again) replays the whole window. `EventSource` cannot set headers: pass the token as
/// `access_token`.
#[utoipa::path(get, path = "/api/events", tag = "events",
    params(EventsQuery,
        ("Last-Event-ID" = Option<u64>, Header, description = "Resume after this id")),
    responses((status = 200, content_type = "text/event-stream", body = String,
            description = "Server-sent events"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn events(
    State(st): St,
    headers: HeaderMap,
    ApiQuery(query): ApiQuery<EventsQuery>,
) -> ApiResult<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>> {
    let resume = match headers.get("last-event-id") {
        Some(value) => Some(
            value
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| {
                    ApiError::invalid("Last-Event-ID", "expected the id of an earlier event")
                })?,
        ),
        None => query.last_event_id,
    };
    let hub = st.hub.clone();
    let mut notify = hub.subscribe();
    notify.borrow_and_update();
    let now = hub.last_id();
    let last = match resume {
        Some(id) if id <= now => id,
        // An id this stream never gave: the client saw an earlier run of the server, whose ids
        // started again from 1. Everything still kept is new to it.
        Some(_) => 0,
        None => now,
    };
    let stream = EventStream {
        hub,
        notify,
        closing: st.closing.subscribe(),
        last,
        pending: VecDeque::new(),
    };
    Ok(Sse::new(futures::stream::unfold(stream, EventStream::next))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}

struct EventStream {
    hub: Arc<Hub>,
    notify: watch::Receiver<u64>,
    /// The API's shutdown flag: the stream ends once it is true.
    closing: watch::Receiver<bool>,
    last: u64,
    pending: VecDeque<SseEvent>,
}

impl EventStream {
    async fn next(mut self) -> Option<(Result<SseEvent, Infallible>, Self)> {
        loop {
            if *self.closing.borrow() {
                return None;
            }
            if let Some(event) = self.pending.pop_front() {
                return Some((Ok(event), self));
            }
            self.notify.borrow_and_update();
            let catchup = self.hub.since(self.last);
            if catchup.missed > 0 {
                let data = serde_json::json!({ "missed": catchup.missed }).to_string();
                self.pending.push_back(
                    SseEvent::default()
                        .event(EntryKind::Missed.as_str())
                        .data(data),
                );
            }
            for entry in catchup.entries {
                self.last = entry.id;
                self.pending.push_back(
                    SseEvent::default()
                        .id(entry.id.to_string())
                        .event(entry.kind.as_str())
                        .data(&*entry.data),
                );
            }
            if self.pending.is_empty() {
                let changed = std::pin::pin!(self.notify.changed());
                let closing = std::pin::pin!(self.closing.wait_for(|closing| *closing));
                match futures::future::select(changed, closing).await {
                    futures::future::Either::Left((Ok(()), _)) => {}
                    // The hub is gone, or the API shuts down (or was dropped).
                    _ => return None,
                }
            }
        }
    }
}
