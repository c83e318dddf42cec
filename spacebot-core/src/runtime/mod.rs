//! The agent runtime: one inbound queue per agent, its loop, the tool-call loop with steering at
//! checkpoints, the outbound, and child agents.
//!
//! The [`Organization`](crate::Organization) forwards to the host here (its state and its
//! operations on agents); this module holds the pieces each
//! agent is made of. See `docs/runtime.md` for the whole picture.

pub(crate) mod agent;
pub mod behaviour;
pub(crate) mod commit;
pub(crate) mod errors;
pub(crate) mod executor;
pub(crate) mod governance;
pub mod history;
pub(crate) mod host;
pub(crate) mod hosting;
pub(crate) mod lifecycle;
pub mod outbound;
pub(crate) mod prompt;
pub mod queue;
pub mod redact;
pub mod replies;
pub mod steer;
pub(crate) mod steps;
pub(crate) mod turn;
pub(crate) mod window;

pub use outbound::{
    ChannelOutbound, Outbound, OutboundError, OutboundItem, Reply, ReplyDelta, ReplyKind,
    StreamingOutbound,
};
pub use queue::{BoundedQueue, QueueError, Recv};
pub use replies::Replies;
pub use turn::{TurnError, TurnOutcome, WorkFailure};
