//! [`RecordingSink`]: an event sink that keeps every event.

use std::sync::{Arc, Mutex};

use super::lock;
use crate::event::{Event, EventKind, EventSink};
use crate::ids::AgentId;

/// An [`EventSink`] that keeps every event, in emission order, for assertions. Clones share the
/// log.
///
/// ```
/// use spacebot_core::testing::RecordingSink;
/// use spacebot_core::{AgentId, Event, EventKind, EventSink, Timestamp};
/// let sink = RecordingSink::new();
/// let a = AgentId::parse("a").unwrap();
/// sink.emit(Event::new(Timestamp(1), a.clone(), EventKind::TurnStarted));
/// assert_eq!(sink.kinds(), vec![EventKind::TurnStarted]);
/// assert_eq!(sink.events_for(&a).len(), 1);
/// ```
#[derive(Debug, Clone, Default)]
pub struct RecordingSink {
    events: Arc<Mutex<Vec<Event>>>,
}

impl RecordingSink {
    /// An empty sink.
    pub fn new() -> Self {
        Self::default()
    }

    /// Every event emitted so far, in order.
    pub fn events(&self) -> Vec<Event> {
        lock(&self.events).clone()
    }

    /// The events about `agent`, in order.
    pub fn events_for(&self, agent: &AgentId) -> Vec<Event> {
        lock(&self.events)
            .iter()
            .filter(|e| &e.agent == agent)
            .cloned()
            .collect()
    }

    /// The kinds of every event so far, in order.
    pub fn kinds(&self) -> Vec<EventKind> {
        lock(&self.events).iter().map(|e| e.kind.clone()).collect()
    }

    /// How many events were emitted.
    pub fn len(&self) -> usize {
        lock(&self.events).len()
    }

    /// Whether no event was emitted.
    pub fn is_empty(&self) -> bool {
        lock(&self.events).is_empty()
    }

    /// Removes and returns every event kept so far.
    pub fn take(&self) -> Vec<Event> {
        std::mem::take(&mut *lock(&self.events))
    }
}

impl EventSink for RecordingSink {
    fn emit(&self, event: Event) {
        lock(&self.events).push(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::Timestamp;

    #[test]
    fn keeps_events_in_order_and_take_empties() {
        let sink = RecordingSink::new();
        let (a, b) = (AgentId::parse("a").unwrap(), AgentId::parse("b").unwrap());
        sink.emit(Event::new(Timestamp(1), a.clone(), EventKind::TurnStarted));
        sink.clone()
            .emit(Event::new(Timestamp(2), b.clone(), EventKind::AgentStarted));
        sink.emit(Event::new(
            Timestamp(3),
            a.clone(),
            EventKind::TurnCancelled,
        ));
        assert_eq!(sink.len(), 3);
        assert_eq!(
            sink.events_for(&a).iter().map(|e| e.at).collect::<Vec<_>>(),
            vec![Timestamp(1), Timestamp(3)]
        );
        assert_eq!(sink.kinds()[1], EventKind::AgentStarted);
        assert_eq!(sink.take().len(), 3);
        assert!(sink.is_empty());
    }
}
