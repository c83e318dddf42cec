//! Where an agent's replies go: one [`Outbound`] per agent, fixed when the agent is built.
//!
//! A root agent answers to the application ([`Outbound`] implemented by the application, or
//! [`ChannelOutbound`] to read replies from a stream); a child agent answers to its parent through the
//! internal channel (the runtime builds that outbound itself).

use std::fmt;

use async_trait::async_trait;
use futures::channel::mpsc;
use serde::{Deserialize, Serialize};

use crate::envelope::Source;
use crate::ids::{AgentId, ChannelId, EnvelopeId};
use crate::time::Timestamp;

/// A reply an agent produced: the final answer of one turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    /// The agent that answered.
    pub agent: AgentId,
    /// The agent's channel the answer belongs to.
    pub channel: ChannelId,
    /// The source of the message answered (for an external message: the platform and reply target).
    pub source: Source,
    /// The envelopes this reply answers, in the order they arrived. After a steer, a reply answers
    /// every merged envelope at once.
    pub in_reply_to: Vec<EnvelopeId>,
    /// The text.
    pub content: String,
    /// When the reply was produced.
    pub at: Timestamp,
    /// An answer, or the news that the agent could not answer.
    pub kind: ReplyKind,
}

/// What a [`Reply`] is.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ReplyKind {
    /// The agent's answer.
    #[default]
    Answer,
    /// The agent could not answer (its model failed, or it ran out of tool rounds); `content`
    /// says why, as "the agent could not answer: ...".
    Failure,
}

impl Reply {
    /// A stable key of the envelopes this reply answers: a reply repeated after a crash (the turn ran
    /// again) has the same key, so an application can recognise it.
    pub fn in_reply_to_key(&self) -> String {
        self.in_reply_to
            .iter()
            .map(|id| id.as_str())
            .collect::<Vec<_>>()
            .join("+")
    }

    /// Whether this reply says the agent could not answer.
    pub fn is_failure(&self) -> bool {
        self.kind == ReplyKind::Failure
    }

    /// The external reply target, when the answered message came from a gateway.
    pub fn reply_target(&self) -> Option<&str> {
        match &self.source {
            Source::External { reply_target, .. } => Some(reply_target),
            _ => None,
        }
    }
}

/// Why an outbound could not take a reply.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboundError {
    /// The receiving side is gone (the application dropped its receiver, the parent ended).
    #[error("the reply could not be delivered: {0}")]
    Closed(String),
    /// Any other failure of an application outbound.
    #[error("the reply could not be delivered: {0}")]
    Failed(String),
}

/// Where an agent's replies go.
///
/// # Contract
/// - `send` delivers the reply or returns an error; the runtime reports an error as an
///   [`EventKind::Error`](crate::event::EventKind::Error) event and in the agent's channel history, so
///   a failed delivery is never silent.
/// - `send` is called by the agent's loop only, one reply at a time, in the order the replies were made.
/// - An outbound that [`wants_deltas`](Outbound::wants_deltas) gets the text of an answer to an
///   external message as it streams from the model ([`send_delta`](Outbound::send_delta)), then the
///   complete [`Reply`] as always. Deltas are a preview: the reply is the answer. A response that
///   turns out to call tools after some text ends its deltas with one whose `discard` is set.
#[async_trait]
pub trait Outbound: Send + Sync + fmt::Debug {
    /// Delivers one reply.
    async fn send(&self, reply: Reply) -> Result<(), OutboundError>;

    /// Whether this outbound wants answers streamed as they are generated (default `false`: the
    /// runtime then never streams for it).
    fn wants_deltas(&self) -> bool {
        false
    }

    /// Delivers a piece of an answer being generated.
    async fn send_delta(&self, delta: ReplyDelta) -> Result<(), OutboundError> {
        let _ = delta;
        Ok(())
    }
}

#[async_trait]
impl<T: Outbound + ?Sized> Outbound for std::sync::Arc<T> {
    async fn send(&self, reply: Reply) -> Result<(), OutboundError> {
        (**self).send(reply).await
    }
    fn wants_deltas(&self) -> bool {
        (**self).wants_deltas()
    }
    async fn send_delta(&self, delta: ReplyDelta) -> Result<(), OutboundError> {
        (**self).send_delta(delta).await
    }
}

/// A piece of an answer as the model generates it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReplyDelta {
    /// The answering agent.
    pub agent: AgentId,
    /// The channel of the envelopes being answered.
    pub channel: ChannelId,
    /// The envelopes the answer will answer (as the coming [`Reply::in_reply_to`]).
    pub in_reply_to: Vec<EnvelopeId>,
    /// The new text.
    pub text: String,
    /// Position of this delta within the answer, from 0.
    pub seq: u64,
    /// Set on a last, empty delta when the response turned out to call tools: the text streamed so
    /// far was not the answer (a UI clears it and waits).
    pub discard: bool,
}

/// What a [`StreamingOutbound`] yields: pieces of an answer, then the reply.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum OutboundItem {
    /// A piece of an answer being generated.
    Delta(ReplyDelta),
    /// A complete reply.
    Reply(Reply),
}

/// An [`Outbound`] that wants deltas: it forwards every [`ReplyDelta`] and every [`Reply`], in
/// order, into an unbounded stream the application reads (a chat UI shows the text as it comes).
///
/// ```
/// use spacebot_core::runtime::{Outbound, StreamingOutbound};
/// let (outbound, _items) = StreamingOutbound::new();
/// assert!(outbound.wants_deltas());
/// ```
#[derive(Debug, Clone)]
pub struct StreamingOutbound {
    tx: mpsc::UnboundedSender<OutboundItem>,
}

impl StreamingOutbound {
    /// The outbound and the stream of items.
    pub fn new() -> (Self, mpsc::UnboundedReceiver<OutboundItem>) {
        let (tx, rx) = mpsc::unbounded();
        (Self { tx }, rx)
    }
}

#[async_trait]
impl Outbound for StreamingOutbound {
    async fn send(&self, reply: Reply) -> Result<(), OutboundError> {
        self.tx
            .unbounded_send(OutboundItem::Reply(reply))
            .map_err(|_| OutboundError::Closed("the reply stream was dropped".into()))
    }
    fn wants_deltas(&self) -> bool {
        true
    }
    async fn send_delta(&self, delta: ReplyDelta) -> Result<(), OutboundError> {
        self.tx
            .unbounded_send(OutboundItem::Delta(delta))
            .map_err(|_| OutboundError::Closed("the reply stream was dropped".into()))
    }
}

/// An [`Outbound`] that forwards every reply into an unbounded stream the application reads.
///
/// Unbounded on purpose: an agent never waits for the application to read, and nothing is dropped.
///
/// ```
/// use spacebot_core::runtime::ChannelOutbound;
/// let (outbound, mut replies) = ChannelOutbound::new();
/// # drop(outbound);
/// # assert!(futures::executor::block_on(futures::StreamExt::next(&mut replies)).is_none());
/// ```
#[derive(Debug, Clone)]
pub struct ChannelOutbound {
    tx: mpsc::UnboundedSender<Reply>,
}

impl ChannelOutbound {
    /// The outbound and the stream of replies.
    pub fn new() -> (Self, mpsc::UnboundedReceiver<Reply>) {
        let (tx, rx) = mpsc::unbounded();
        (Self { tx }, rx)
    }
}

#[async_trait]
impl Outbound for ChannelOutbound {
    async fn send(&self, reply: Reply) -> Result<(), OutboundError> {
        self.tx
            .unbounded_send(reply)
            .map_err(|_| OutboundError::Closed("the reply stream was dropped".into()))
    }
}
