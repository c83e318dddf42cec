//! The agent's one inbound queue.
//!
//! Many producers (the external gateway, other agents through the internal channel, the task loop,
//! timers) push; exactly one consumer, the agent's loop, takes. The queue is bounded: a producer that
//! finds it full gets [`QueueError::Full`] back, and nothing is dropped silently.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Mutex, MutexGuard};
use std::task::{Context, Poll};

use futures::task::AtomicWaker;

use crate::envelope::Envelope;
use crate::ids::AgentId;

/// Why a push was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QueueError {
    /// The queue holds `capacity` envelopes already; the envelope was not taken.
    #[error("the queue of agent {agent} is full ({capacity} envelopes waiting)")]
    Full {
        /// The agent whose queue is full.
        agent: AgentId,
        /// Its capacity.
        capacity: usize,
    },
    /// The agent stopped; its queue takes nothing more.
    #[error("the queue of agent {agent} is closed")]
    Closed {
        /// The agent.
        agent: AgentId,
    },
}

/// The future returned by [`BoundedQueue::recv`].
#[must_use = "futures do nothing unless awaited"]
pub struct Recv<'a> {
    queue: &'a BoundedQueue,
}

impl fmt::Debug for Recv<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Recv")
            .field("agent", self.queue.agent())
            .finish()
    }
}

impl Future for Recv<'_> {
    type Output = Option<Envelope>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let Some(envelope) = self.queue.try_recv() {
            return Poll::Ready(Some(envelope));
        }
        if self.queue.is_closed() {
            return Poll::Ready(None);
        }
        self.queue.register(cx);
        // Check again: a push between the first check and the registration must not be missed.
        if let Some(envelope) = self.queue.try_recv() {
            return Poll::Ready(Some(envelope));
        }
        if self.queue.is_closed() {
            return Poll::Ready(None);
        }
        Poll::Pending
    }
}

#[derive(Debug, Default)]
struct State {
    items: VecDeque<Envelope>,
    closed: bool,
}

/// One agent's inbound queue: a mutex-guarded deque and a waker.
///
/// # Contract
/// - `try_push` appends at the back, or hands the envelope back with [`QueueError::Full`] when `len() == capacity()` and
///   [`QueueError::Closed`] after `close`; a refused envelope is not kept.
/// - `push_front` puts an envelope the consumer already took back at the front (the interrupted
///   message of a steer); it ignores the capacity, since that envelope was admitted once already,
///   and fails only when the queue is closed.
/// - `drain` takes everything in order; `recv` waits for the next envelope and yields `None` once
///   the queue is closed and empty.
/// - Envelopes come out in the order they were admitted: two pushes from one producer keep their order.
/// - There is one consumer. Calling `recv` from two tasks at once is a misuse (the second waiter may
///   not be woken).
///
/// Storage is allocated on first use, so an idle agent's queue costs a few dozen bytes.
///
/// ```
/// use spacebot_core::runtime::{BoundedQueue, QueueError};
/// use spacebot_core::{AgentId, ChannelId, Envelope, EnvelopeKind, Source, Timestamp};
/// let agent = AgentId::parse("support").unwrap();
/// let queue = BoundedQueue::new(agent.clone(), 1);
/// let env = || Envelope::new(Source::System, ChannelId::portal(&agent), EnvelopeKind::UserMessage, "hi", Timestamp(0));
/// queue.push(env()).unwrap();
/// assert!(matches!(queue.push(env()), Err(QueueError::Full { capacity: 1, .. })));
/// assert_eq!(queue.drain().len(), 1);
/// ```
#[derive(Debug)]
pub struct BoundedQueue {
    agent: AgentId,
    capacity: usize,
    state: Mutex<State>,
    waker: AtomicWaker,
}

impl BoundedQueue {
    /// A queue for `agent` holding at most `capacity` envelopes (at least 1).
    pub fn new(agent: AgentId, capacity: usize) -> Self {
        Self {
            agent,
            capacity: capacity.max(1),
            state: Mutex::new(State::default()),
            waker: AtomicWaker::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is a plain deque: a panic elsewhere cannot leave it half-updated.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The owning agent.
    pub fn agent(&self) -> &AgentId {
        &self.agent
    }

    /// Appends an envelope, or hands it back with the reason it was refused.
    pub fn try_push(&self, envelope: Envelope) -> Result<(), (QueueError, Box<Envelope>)> {
        {
            let mut st = self.lock();
            if st.closed {
                let error = QueueError::Closed {
                    agent: self.agent.clone(),
                };
                return Err((error, Box::new(envelope)));
            }
            if st.items.len() >= self.capacity {
                let error = QueueError::Full {
                    agent: self.agent.clone(),
                    capacity: self.capacity,
                };
                return Err((error, Box::new(envelope)));
            }
            st.items.push_back(envelope);
        }
        self.waker.wake();
        Ok(())
    }

    /// Appends an envelope (a refused one is dropped: see [`try_push`](Self::try_push) to keep
    /// it).
    pub fn push(&self, envelope: Envelope) -> Result<(), QueueError> {
        self.try_push(envelope).map_err(|(e, _)| e)
    }

    /// Puts a taken envelope back at the front.
    pub fn push_front(&self, envelope: Envelope) -> Result<(), QueueError> {
        {
            let mut st = self.lock();
            if st.closed {
                return Err(QueueError::Closed {
                    agent: self.agent.clone(),
                });
            }
            st.items.push_front(envelope);
        }
        self.waker.wake();
        Ok(())
    }

    /// Takes the next envelope, if any, without waiting.
    pub fn try_recv(&self) -> Option<Envelope> {
        self.lock().items.pop_front()
    }

    /// Takes every waiting envelope, oldest first.
    pub fn drain(&self) -> Vec<Envelope> {
        self.lock().items.drain(..).collect()
    }

    /// Waits for the next envelope; `None` once closed and empty.
    pub fn recv(&self) -> Recv<'_> {
        Recv { queue: self }
    }

    /// Envelopes waiting.
    pub fn len(&self) -> usize {
        self.lock().items.len()
    }

    /// Whether nothing is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bound.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Stops taking envelopes; returns those still waiting so the caller can keep them elsewhere.
    pub fn close(&self) -> Vec<Envelope> {
        let rest = {
            let mut st = self.lock();
            st.closed = true;
            st.items.drain(..).collect()
        };
        self.waker.wake();
        rest
    }

    /// Whether `close` was called.
    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Registers the consumer's waker (used by [`Recv`]).
    pub(crate) fn register(&self, cx: &mut Context<'_>) {
        self.waker.register(cx.waker());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{EnvelopeKind, Source};
    use crate::ids::ChannelId;
    use crate::time::Timestamp;
    use futures::FutureExt;

    fn env(agent: &AgentId, text: &str) -> Envelope {
        Envelope::new(
            Source::System,
            ChannelId::portal(agent),
            EnvelopeKind::UserMessage,
            text,
            Timestamp(0),
        )
    }

    #[test]
    fn full_queue_refuses_and_keeps_order() {
        let a = AgentId::parse("a").unwrap();
        let q = BoundedQueue::new(a.clone(), 2);
        q.push(env(&a, "1")).unwrap();
        q.push(env(&a, "2")).unwrap();
        let err = q.push(env(&a, "3")).unwrap_err();
        assert_eq!(
            err,
            QueueError::Full {
                agent: a.clone(),
                capacity: 2
            }
        );
        // push_front ignores the bound: the envelope was admitted before.
        q.push_front(env(&a, "0")).unwrap();
        let texts: Vec<String> = q.drain().into_iter().map(|e| e.content).collect();
        assert_eq!(texts, ["0", "1", "2"]);
    }

    #[test]
    fn recv_waits_and_close_ends() {
        let a = AgentId::parse("a").unwrap();
        let q = BoundedQueue::new(a.clone(), 4);
        let mut fut = Box::pin(q.recv());
        assert!(fut.as_mut().now_or_never().is_none());
        q.push(env(&a, "x")).unwrap();
        assert_eq!(
            fut.now_or_never().flatten().map(|e| e.content).as_deref(),
            Some("x")
        );
        q.push(env(&a, "y")).unwrap();
        let rest = q.close();
        assert_eq!(rest.len(), 1);
        assert!(matches!(
            q.push(env(&a, "z")),
            Err(QueueError::Closed { .. })
        ));
        assert_eq!(q.recv().now_or_never(), Some(None));
    }
}
