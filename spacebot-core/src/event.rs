//! Events: what happened in the organization, for the application to observe.
//!
//! Every event carries the ids needed to follow nested work: the agent, and where relevant the
//! link, channel, task and parent task. `tracing` spans mirror them.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids::{AgentId, ChannelId, ConversationId, LinkId, TaskRef};
use crate::task::TaskStatus;
use crate::time::Timestamp;

/// One event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// When it happened, by the organization's clock.
    pub at: Timestamp,
    /// The agent it happened to (or that caused it).
    pub agent: AgentId,
    /// The link involved, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<LinkId>,
    /// The channel involved, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channel: Option<ChannelId>,
    /// The task involved, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<TaskRef>,
    /// The parent task (multi-hop delegation) or parent agent's task, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<TaskRef>,
    /// Tokens spent: on a `TurnFinished` event, the turn's model calls summed (when the provider
    /// reported usage).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<crate::llm::Usage>,
    /// The user request the event belongs to: the cause of the exchange (the id of the inbound
    /// envelope that started it, see [`Envelope::cause`](crate::envelope::Envelope::cause)), when
    /// known. Turns, model and tool calls, steers and the tasks of a request carry it, so an
    /// observer can build the request's tree.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<crate::ids::EnvelopeId>,
    /// What happened.
    pub kind: EventKind,
}

impl Event {
    /// An event about `agent` with no other ids.
    pub fn new(at: Timestamp, agent: AgentId, kind: EventKind) -> Self {
        Self {
            at,
            agent,
            link: None,
            channel: None,
            task: None,
            usage: None,
            parent: None,
            request: None,
            kind,
        }
    }
    /// Sets the link.
    pub fn with_link(mut self, link: LinkId) -> Self {
        self.link = Some(link);
        self
    }
    /// Sets the channel.
    pub fn with_channel(mut self, channel: ChannelId) -> Self {
        self.channel = Some(channel);
        self
    }
    /// Sets the task.
    pub fn with_task(mut self, task: TaskRef) -> Self {
        self.task = Some(task);
        self
    }
    /// Sets the parent task.
    pub fn with_parent(mut self, parent: TaskRef) -> Self {
        self.parent = Some(parent);
        self
    }
    /// Sets the request (the cause of the exchange).
    pub fn with_request(mut self, request: crate::ids::EnvelopeId) -> Self {
        self.request = Some(request);
        self
    }
}

/// What happened.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "type")]
#[non_exhaustive]
pub enum EventKind {
    /// `agent` sent a message to `to`.
    MessageSent {
        /// Receiver.
        to: AgentId,
    },
    /// `agent` received a message from `from`.
    MessageReceived {
        /// Sender.
        from: AgentId,
    },
    /// A task was created on `agent`'s board.
    TaskCreated {
        /// `created_by` of the task.
        created_by: String,
        /// Initial status.
        status: TaskStatus,
    },
    /// A worker claimed a task.
    TaskClaimed {
        /// The worker.
        holder: String,
    },
    /// A task finished.
    TaskCompleted,
    /// A task failed for good.
    TaskFailed {
        /// The error.
        error: String,
    },
    /// A task went back to ready (failed attempt or expired lease).
    TaskRequeued {
        /// Attempts so far.
        attempts: u32,
        /// Why.
        reason: String,
    },
    /// A task was cancelled.
    TaskCancelled,
    /// A completion notice reached the delegator.
    NoticeDelivered {
        /// The notice's idempotency key.
        key: String,
    },
    /// A conversation opened.
    ConversationOpened {
        /// The conversation.
        conversation: ConversationId,
        /// Its members.
        members: Vec<AgentId>,
    },
    /// A conversation was concluded (or closed by its initiator).
    ConversationConcluded {
        /// The conversation.
        conversation: ConversationId,
    },
    /// A conversation was severed.
    ConversationSevered {
        /// The conversation.
        conversation: ConversationId,
        /// Why (explicit sever, session end, budget spent).
        reason: String,
    },
    /// Messages that arrived mid-turn were merged and answered first.
    Steered {
        /// How many queued envelopes were merged.
        merged: usize,
    },
    /// A model turn started.
    TurnStarted,
    /// The agent's loop finished its work and waits with an empty queue.
    AgentIdle,
    /// A model turn finished.
    TurnFinished {
        /// Tool rounds used.
        rounds: u32,
    },
    /// A turn's history no longer fitted the agent's context window: the older part was compacted
    /// into the channel's summary (see [`crate::context`]).
    Compacted {
        /// The sequence number of the newest history record the summary covers.
        through: u64,
    },
    /// A turn hit the round limit and was stopped.
    RoundLimitReached {
        /// The limit.
        limit: u32,
    },
    /// A request reached a limit: a model or tool call was refused (see [`crate::limits`]).
    LimitReached {
        /// The request (the cause of the exchange).
        request: crate::ids::EnvelopeId,
        /// The limit and what the refused call would have reached.
        over: crate::limits::Over,
        /// What the request had spent.
        spent: crate::limits::Spend,
    },
    /// A model call waits for budget: it would fit the request's limits but for the request's
    /// other open reservations (calls under way on other agents, or in other processes), and
    /// waits for them to settle (see [`crate::limits`]). Said once a call, when it starts
    /// waiting; a [`LimitReached`](Self::LimitReached) follows if it is refused in the end.
    LimitWait {
        /// The request (the cause of the exchange).
        request: crate::ids::EnvelopeId,
        /// The limit the open reservations keep the call out of, and what it would reach.
        over: crate::limits::Over,
    },
    /// A turn was cancelled.
    TurnCancelled,
    /// A model call of a turn ended; the event's `usage` is what the provider reported.
    ModelCalled {
        /// Whether the model answered (`false`: it failed).
        ok: bool,
        /// How long the call took, in milliseconds.
        duration_ms: u64,
        /// Whether the answer asks for tool calls.
        tool_calls: bool,
    },
    /// The link policy refused an attempt of `agent` (a delegation, a message, a conversation):
    /// nothing was sent. When a link joins the two agents, the refusal is also recorded in the
    /// link channel of `agent`, so the link's timeline shows it (seed 003: no hidden side
    /// channels).
    Refused {
        /// The agent addressed.
        target: String,
        /// What was tried (`delegate`, `send_message`, ...).
        action: String,
        /// Why it was refused.
        reason: String,
    },
    /// A tool was called.
    ToolCalled {
        /// Tool name.
        tool: String,
        /// Whether it succeeded.
        ok: bool,
    },
    /// A delivery to a stopped agent was persisted for later.
    DeliveryPersisted,
    /// An agent started.
    AgentStarted,
    /// An agent stopped.
    AgentStopped,
    /// This process took `agent` under a placement lease (an organization spread over several
    /// processes) and started it here.
    AgentPlaced {
        /// This process.
        process: String,
    },
    /// This process stopped hosting `agent`: its lease was taken, or not renewed in time. Another
    /// process takes it over; nothing stored is lost.
    PlacementLost {
        /// This process.
        process: String,
        /// Why.
        reason: String,
    },
    /// Something failed that no caller was waiting for (delivered as an event so it is never only logged).
    Error {
        /// What failed.
        message: String,
    },
    /// Something a behaviour of its own reports (see
    /// [`BehaviourContext::emit`](crate::runtime::behaviour::BehaviourContext::emit)): shared notes
    /// say a note was written, say.
    Behaviour {
        /// The behaviour's name.
        behaviour: String,
        /// What happened, in the behaviour's words (`note_written`).
        name: String,
        /// Details, as JSON.
        #[serde(default)]
        detail: serde_json::Value,
    },
}

/// Where the runtime sends events.
///
/// # Contract
/// - `emit` never blocks and never fails the operation that emitted; a sink that cannot keep up
///   must account for what it dropped (see the event bus, whose subscribers learn how many events
///   they missed).
pub trait EventSink: Send + Sync + fmt::Debug {
    /// Publishes an event.
    fn emit(&self, event: Event);
}

impl<T: EventSink + ?Sized> EventSink for std::sync::Arc<T> {
    fn emit(&self, event: Event) {
        (**self).emit(event)
    }
}

/// An event sink that discards everything.
#[derive(Debug, Default, Clone, Copy)]
pub struct NullSink;

impl EventSink for NullSink {
    fn emit(&self, _event: Event) {}
}
