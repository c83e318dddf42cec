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
#[async_trait]
pub trait Outbound: Send + Sync + fmt::Debug {
    /// Delivers one reply.
    async fn send(&self, reply: Reply) -> Result<(), OutboundError>;
}

#[async_trait]
impl<T: Outbound + ?Sized> Outbound for std::sync::Arc<T> {
    async fn send(&self, reply: Reply) -> Result<(), OutboundError> {
        (**self).send(reply).await
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
