//! Property: a subscriber accounts for every event, read or reported missed, in order.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use proptest::prelude::*;
use spacebot_core::bus::{EventBus, RecvError};
use spacebot_core::{AgentId, Event, EventKind, EventSink, Timestamp};

proptest! {
    #[test]
    fn every_event_is_read_or_counted_as_missed(
        capacity in 1usize..8,
        // true = emit one event, false = read everything available
        steps in proptest::collection::vec(any::<bool>(), 0..200),
    ) {
        let agent = AgentId::parse("a").unwrap();
        let bus = EventBus::new(capacity);
        let mut sub = bus.subscribe();
        let mut emitted = 0i64;
        let mut read: Vec<i64> = Vec::new();
        let mut missed = 0u64;
        let mut drain = |sub: &mut spacebot_core::bus::EventSubscription| -> Result<(), TestCaseError> {
            loop {
                match sub.try_recv() {
                    Ok(Some(e)) => read.push(e.at.as_millis()),
                    Ok(None) | Err(RecvError::Closed) => return Ok(()),
                    Err(RecvError::Lagged { missed: n }) => {
                        prop_assert!(n > 0);
                        // The next event read is exactly the one after those missed.
                        let expected_next = read.last().copied().unwrap_or(0) + 1 + n as i64;
                        missed += n;
                        let next = sub.try_recv();
                        prop_assert!(matches!(&next, Ok(Some(e)) if e.at.as_millis() == expected_next), "{next:?}");
                        if let Ok(Some(e)) = next { read.push(e.at.as_millis()); }
                    }
                    Err(other) => prop_assert!(false, "unexpected {other:?}"),
                }
            }
        };
        for step in steps {
            if step {
                emitted += 1;
                bus.emit(Event::new(Timestamp(emitted), agent.clone(), EventKind::TurnStarted));
            } else {
                drain(&mut sub)?;
            }
        }
        drain(&mut sub)?;
        prop_assert!(read.windows(2).all(|w| w[0] < w[1]));
        prop_assert_eq!(read.len() as u64 + missed, emitted as u64);
    }
}
