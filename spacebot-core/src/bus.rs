//! The event bus: a broadcast [`EventSink`] the application subscribes to.
//!
//! [`EventBus::emit`] never blocks: the bus keeps the last `capacity` events, and when a subscriber
//! falls further behind, the oldest events it has not read are overwritten. That subscriber is
//! then told exactly how many it missed ([`RecvError::Lagged`]) and continues with the oldest
//! event still kept. Nothing is skipped silently.
//!
//! ```
//! # futures::executor::block_on(async {
//! use spacebot_core::bus::{EventBus, RecvError};
//! use spacebot_core::{AgentId, Event, EventKind, EventSink, Timestamp};
//!
//! let bus = EventBus::new(2);
//! let mut events = bus.subscribe();
//! let a = AgentId::parse("a").unwrap();
//! for at in 1..=3 {
//!     bus.emit(Event::new(Timestamp(at), a.clone(), EventKind::TurnStarted));
//! }
//! assert_eq!(events.recv().await, Err(RecvError::Lagged { missed: 1 }));
//! assert_eq!(events.recv().await.unwrap().at, Timestamp(2));
//! assert_eq!(events.recv().await.unwrap().at, Timestamp(3));
//! bus.close();
//! assert_eq!(events.recv().await, Err(RecvError::Closed));
//! # });
//! ```

use std::pin::Pin;
use std::task::{Context, Poll};

use futures::{Stream, StreamExt};

use crate::event::{Event, EventSink};

/// Why [`EventSubscription::recv`] returned no event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecvError {
    /// The subscriber fell behind and `missed` events were overwritten before it read them. The
    /// next call returns the oldest event still kept.
    #[error("the subscriber fell behind and missed {missed} events")]
    Lagged {
        /// How many events it missed.
        missed: u64,
    },
    /// The bus was closed (or dropped) and every event was read.
    #[error("the event bus is closed")]
    Closed,
}

/// A broadcast [`EventSink`]. Clones publish to the same subscribers.
#[derive(Debug, Clone)]
pub struct EventBus {
    sender: async_broadcast::Sender<Event>,
    /// Keeps the channel open while nobody subscribes.
    _keep_open: async_broadcast::InactiveReceiver<Event>,
}

impl EventBus {
    /// A bus that keeps the last `capacity` events for slow subscribers (at least 1).
    pub fn new(capacity: usize) -> Self {
        let (mut sender, receiver) = async_broadcast::broadcast(capacity.max(1));
        sender.set_overflow(true);
        sender.set_await_active(false);
        Self {
            sender,
            _keep_open: receiver.deactivate(),
        }
    }

    /// A subscription to every event emitted from now on.
    pub fn subscribe(&self) -> EventSubscription {
        EventSubscription {
            receiver: self.sender.new_receiver(),
        }
    }

    /// How many events the bus keeps for slow subscribers.
    pub fn capacity(&self) -> usize {
        self.sender.capacity()
    }

    /// How many subscriptions are alive.
    pub fn subscriber_count(&self) -> usize {
        self.sender.receiver_count()
    }

    /// Closes the bus: later events are discarded; subscribers read what is kept, then
    /// [`RecvError::Closed`]. Returns `false` if it was already closed.
    pub fn close(&self) -> bool {
        self.sender.close()
    }

    /// Whether the bus is closed.
    pub fn is_closed(&self) -> bool {
        self.sender.is_closed()
    }
}

impl EventSink for EventBus {
    fn emit(&self, event: Event) {
        // With overflow on, a full buffer overwrites its oldest event (whose readers learn it
        // through `Lagged`). With no subscriber or a closed bus there is nobody to tell.
        let _ = self.sender.try_broadcast(event);
    }
}

/// A subscription to an [`EventBus`].
///
/// It is also a [`Stream`] of `Result<Event, RecvError>` whose errors are only
/// [`RecvError::Lagged`]; the stream ends when the bus is closed.
#[derive(Debug)]
pub struct EventSubscription {
    receiver: async_broadcast::Receiver<Event>,
}

impl EventSubscription {
    /// The next event, waiting for one; [`RecvError::Lagged`] first if events were missed.
    pub async fn recv(&mut self) -> Result<Event, RecvError> {
        self.next().await.unwrap_or(Err(RecvError::Closed))
    }

    /// The next event if one is waiting: `Ok(None)` if none is.
    pub fn try_recv(&mut self) -> Result<Option<Event>, RecvError> {
        match self.receiver.try_recv() {
            Ok(event) => Ok(Some(event)),
            Err(async_broadcast::TryRecvError::Empty) => Ok(None),
            Err(async_broadcast::TryRecvError::Overflowed(missed)) => {
                Err(RecvError::Lagged { missed })
            }
            Err(async_broadcast::TryRecvError::Closed) => Err(RecvError::Closed),
        }
    }
}

impl Stream for EventSubscription {
    type Item = Result<Event, RecvError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.receiver)
            .poll_recv(cx)
            .map(|item| match item {
                Some(Ok(event)) => Some(Ok(event)),
                Some(Err(async_broadcast::RecvError::Overflowed(missed))) => {
                    Some(Err(RecvError::Lagged { missed }))
                }
                Some(Err(async_broadcast::RecvError::Closed)) | None => None,
            })
    }
}

#[cfg(test)]
mod tests {
    use futures::FutureExt;
    use futures::executor::block_on;

    use super::*;
    use crate::event::EventKind;
    use crate::ids::AgentId;
    use crate::time::Timestamp;

    fn event(at: i64) -> Event {
        Event::new(
            Timestamp(at),
            AgentId::parse("a").unwrap(),
            EventKind::TurnStarted,
        )
    }

    fn times(sub: &mut EventSubscription) -> Vec<Result<i64, RecvError>> {
        let mut out = Vec::new();
        loop {
            match sub.try_recv() {
                Ok(Some(e)) => out.push(Ok(e.at.as_millis())),
                Ok(None) => return out,
                Err(RecvError::Closed) => {
                    out.push(Err(RecvError::Closed));
                    return out;
                }
                Err(lagged) => out.push(Err(lagged)),
            }
        }
    }

    #[test]
    fn a_lagging_subscriber_is_told_the_exact_number_missed() {
        let bus = EventBus::new(4);
        let mut fast = bus.subscribe();
        let mut slow = bus.subscribe();
        for at in 1..=3 {
            bus.emit(event(at));
        }
        assert_eq!(times(&mut fast), vec![Ok(1), Ok(2), Ok(3)]);
        for at in 4..=10 {
            bus.emit(event(at));
        }
        // slow never read: 10 emitted, 4 kept, 6 missed.
        assert_eq!(
            times(&mut slow),
            vec![
                Err(RecvError::Lagged { missed: 6 }),
                Ok(7),
                Ok(8),
                Ok(9),
                Ok(10)
            ]
        );
        // fast had read 3: of 4..=10 (7 events) the bus keeps 4, so it missed 3.
        assert_eq!(
            times(&mut fast),
            vec![
                Err(RecvError::Lagged { missed: 3 }),
                Ok(7),
                Ok(8),
                Ok(9),
                Ok(10)
            ]
        );
        // Both continue with the next ones.
        bus.emit(event(11));
        assert_eq!(block_on(slow.recv()).map(|e| e.at), Ok(Timestamp(11)));
        assert_eq!(block_on(fast.recv()).map(|e| e.at), Ok(Timestamp(11)));
    }

    #[test]
    fn emit_never_blocks_without_subscribers_and_subscriptions_start_now() {
        let bus = EventBus::new(0);
        assert_eq!(bus.capacity(), 1);
        for at in 0..100 {
            bus.emit(event(at));
        }
        let mut sub = bus.subscribe();
        assert_eq!(bus.subscriber_count(), 1);
        assert!(
            sub.recv().now_or_never().is_none(),
            "old events are not replayed"
        );
        bus.clone().emit(event(100));
        assert_eq!(block_on(sub.recv()).map(|e| e.at), Ok(Timestamp(100)));
    }

    #[test]
    fn closing_drains_then_ends_and_the_stream_reports_lag() {
        let bus = EventBus::new(2);
        let mut stream = bus.subscribe();
        for at in 1..=5 {
            bus.emit(event(at));
        }
        assert!(bus.close());
        assert!(bus.is_closed());
        bus.emit(event(6)); // discarded
        let items: Vec<Result<i64, RecvError>> = block_on(
            stream
                .by_ref()
                .map(|r| r.map(|e| e.at.as_millis()))
                .collect(),
        );
        assert_eq!(
            items,
            vec![Err(RecvError::Lagged { missed: 3 }), Ok(4), Ok(5)]
        );
        assert_eq!(block_on(stream.recv()), Err(RecvError::Closed));
    }

    #[test]
    fn dropping_every_bus_clone_closes_subscriptions() {
        let bus = EventBus::new(8);
        let mut sub = bus.subscribe();
        bus.emit(event(1));
        drop(bus);
        assert_eq!(block_on(sub.recv()).map(|e| e.at), Ok(Timestamp(1)));
        assert_eq!(block_on(sub.recv()), Err(RecvError::Closed));
    }
}
