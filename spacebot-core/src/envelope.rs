//! Envelopes: what an agent's queue holds, and the [`DeliveryStore`] that keeps deliveries for
//! agents that are not running.

use std::fmt;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::channel::NewRecord;
use crate::error::StoreError;
use crate::ids::{AgentId, ChannelId, ConversationId, EnvelopeId, LinkId};
use crate::link::text_enum;
use crate::time::Timestamp;

/// Metadata key naming the conversation a channel record belongs to.
pub const META_CONVERSATION: &str = "spacebot.conversation";

/// Where an envelope came from. The runtime stamps it; it is never taken from model output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "source")]
#[non_exhaustive]
pub enum Source {
    /// An external gateway (a chat platform, the application's own UI).
    External {
        /// The platform, such as `portal` or `discord`.
        platform: String,
        /// Where replies go on that platform.
        reply_target: String,
    },
    /// Another agent, over a link (or parent/child).
    Internal {
        /// The sending agent, stamped by the runtime.
        from_agent: AgentId,
        /// The link the message went over, if any.
        link_id: Option<LinkId>,
    },
    /// The runtime itself (retriggers, audit records).
    System,
}

/// What an envelope means to the receiving agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum EnvelopeKind {
    /// A message for the model to answer.
    UserMessage,
    /// A copy of what this agent sent, kept for history; never wakes the model.
    SentRecord,
    /// An audit record; never wakes the model.
    SystemRecord,
    /// A system message that wakes the model (for example a completed delegation).
    Retrigger,
    /// A task assigned to this agent.
    TaskAssigned,
    /// A result or status announced by a child or peer.
    Announce,
    /// A request to cancel the current turn or a task.
    Cancel,
}

text_enum!(EnvelopeKind, "envelope kind", [
    UserMessage => "user_message", SentRecord => "sent_record", SystemRecord => "system_record",
    Retrigger => "retrigger", TaskAssigned => "task_assigned", Announce => "announce", Cancel => "cancel",
]);

impl EnvelopeKind {
    /// Whether an envelope of this kind starts a model turn.
    pub fn wakes_model(self) -> bool {
        matches!(
            self,
            Self::UserMessage | Self::Retrigger | Self::TaskAssigned | Self::Announce
        )
    }
}

/// One item in an agent's queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope {
    /// Unique id.
    pub id: EnvelopeId,
    /// Who sent it (stamped by the runtime).
    pub source: Source,
    /// The receiving agent's channel it belongs to.
    pub channel: ChannelId,
    /// Text content.
    pub content: String,
    /// What it means.
    pub kind: EnvelopeKind,
    /// Free-form metadata.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub metadata: serde_json::Map<String, serde_json::Value>,
    /// When it was created.
    pub timestamp: Timestamp,
    /// Receivers apply an envelope with a key at most once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// The claimed task this envelope runs, when its kind is [`EnvelopeKind::TaskAssigned`] and it
    /// came from the agent's own task loop.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<TaskWork>,
    /// How many delegate-and-retrigger rounds led to this envelope (0 for a fresh message).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub round: u32,
    /// The conversation this envelope belongs to (a message from a member, or the result of a
    /// conversation that ended).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation: Option<ConversationId>,
    /// The envelope that started the exchange this one is part of: an external message is its own
    /// cause; everything a turn sends on inherits the cause of what the turn answers. Budgets bound
    /// the whole exchange one cause started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<EnvelopeId>,
    /// The trace context (W3C `traceparent`) of the span that sent it, stored with it so the turn
    /// answering it continues the request's trace, also after a restart or in another process.
    /// Opaque to the runtime; set only when a trace hook is installed (see [`crate::telemetry`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_context: Option<String>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Claimed work carried by a [`EnvelopeKind::TaskAssigned`] envelope: whose it is (the behaviour
/// that claimed it), which item, and the lease holder of the claim (a stale claim is not run).
///
/// The host never interprets it: it asks the owner (see
/// [`Behaviour`](crate::runtime::behaviour::Behaviour)).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TaskWork {
    /// The name of the behaviour that owns the work. Envelopes stored before work had owners
    /// carry none: all their claimed work was delegation's.
    #[serde(default = "delegation_owner")]
    pub owner: String,
    /// The item's number (a task's number on the receiving agent's board).
    pub number: u64,
    /// The lease holder of the claim this envelope runs.
    pub holder: String,
    /// How many of the task's children had ended when it was claimed: an attempt run again after a
    /// crash has the same generation (its effects get the same idempotency keys), a resumed task a
    /// new one.
    #[serde(default)]
    pub generation: u32,
}

fn delegation_owner() -> String {
    "delegation".to_string()
}

impl TaskWork {
    /// Work of the behaviour `owner`: item `number`, claimed by `holder`, in its `generation`.
    pub fn new(
        owner: impl Into<String>,
        number: u64,
        holder: impl Into<String>,
        generation: u32,
    ) -> Self {
        Self {
            owner: owner.into(),
            number,
            holder: holder.into(),
            generation,
        }
    }
}

impl Envelope {
    /// A new envelope with a random id and no metadata.
    pub fn new(
        source: Source,
        channel: ChannelId,
        kind: EnvelopeKind,
        content: impl Into<String>,
        now: Timestamp,
    ) -> Self {
        Self {
            id: EnvelopeId::new_random(),
            source,
            channel,
            content: content.into(),
            kind,
            metadata: serde_json::Map::new(),
            timestamp: now,
            idempotency_key: None,
            task: None,
            round: 0,
            conversation: None,
            cause: None,
            trace_context: None,
        }
    }

    /// The cause of the exchange this envelope belongs to (itself when it starts one).
    pub fn cause(&self) -> &EnvelopeId {
        self.cause.as_ref().unwrap_or(&self.id)
    }

    /// Sets the cause.
    pub fn with_cause(mut self, cause: EnvelopeId) -> Self {
        self.cause = Some(cause);
        self
    }

    /// Sets the delegation round.
    pub fn with_round(mut self, round: u32) -> Self {
        self.round = round;
        self
    }

    /// Sets the conversation.
    pub fn with_conversation(mut self, conversation: ConversationId) -> Self {
        self.conversation = Some(conversation);
        self
    }

    /// Sets the idempotency key.
    pub fn with_idempotency_key(mut self, key: impl Into<String>) -> Self {
        self.idempotency_key = Some(key.into());
        self
    }
}

/// Durable hand-over of envelopes to agents that are not running, and the receiving side's record
/// of which idempotency keys it has applied.
///
/// # Contract
/// - `persist` stores the envelope for `agent`; persisting the same envelope id again is a no-op
///   (the first copy is kept). Removed ids are not remembered: an id removed and then persisted
///   again is stored again, last.
/// - `pending` returns the agent's stored envelopes in the order they were persisted.
/// - `remove` deletes one; removing an absent id is a no-op (hand-over may be retried).
/// - `mark_applied(agent, key)` returns `true` the first time a key is marked for that agent and
///   `false` ever after, across restarts: it is how "applied exactly once" is kept. Of concurrent
///   calls with one key, exactly one returns `true`.
/// - `is_applied(agent, key)` is `true` exactly when `key` was marked applied for that agent, by
///   `mark_applied` or by a `commit`; it marks nothing.
/// - `commit(agent, commit, now)` applies a [`TurnCommit`] for `agent` in one atomic step: it
///   removes the `consumed` envelopes from the agent's pending deliveries (absent ids are
///   ignored), appends the `records` to the agent's channel history in order, exactly as that many
///   [`ChannelStore::append`](crate::ChannelStore::append) calls would (sequence numbers, known
///   channels), and marks the `applied` keys (keys already marked are ignored, and the
///   `mark_applied` that follows returns `false`). After a crash either all of it is visible or
///   none; concurrent readers never see part of it. An empty commit changes nothing. A backend
///   whose deliveries and channel history live in different places must still make the commit
///   atomic (or refuse it with an error that writes nothing).
/// - `is_durable` says whether what the store keeps survives the process: `false` for in-memory
///   stores, whose "across restarts" lasts as long as the store lives.
///
/// The conformance suite (module `conformance`, feature `conformance`: `delivery_store_*`) checks every clause.
#[async_trait]
pub trait DeliveryStore: Send + Sync + fmt::Debug {
    /// Stores an envelope for later hand-over.
    async fn persist(&self, agent: &AgentId, envelope: &Envelope) -> Result<(), StoreError>;
    /// Stored envelopes, oldest first.
    async fn pending(&self, agent: &AgentId) -> Result<Vec<Envelope>, StoreError>;
    /// Deletes a stored envelope (idempotent).
    async fn remove(&self, agent: &AgentId, id: &EnvelopeId) -> Result<(), StoreError>;
    /// Records that `key` was applied; `true` only the first time.
    async fn mark_applied(
        &self,
        agent: &AgentId,
        key: &str,
        now: Timestamp,
    ) -> Result<bool, StoreError>;
    /// Whether what this store keeps survives the process (false for in-memory stores).
    fn is_durable(&self) -> bool {
        true
    }
    /// Whether `key` was marked applied for `agent` (by `mark_applied` or a commit).
    async fn is_applied(&self, agent: &AgentId, key: &str) -> Result<bool, StoreError>;
    /// Applies `commit` for `agent` atomically: after a crash either all of it is visible or none.
    async fn commit(
        &self,
        agent: &AgentId,
        commit: &TurnCommit,
        now: Timestamp,
    ) -> Result<(), StoreError>;
    /// [`commit`](Self::commit) of a commit the caller gives away: a store that keeps what it is
    /// given in memory moves it instead of copying it. On failure the commit is handed back with
    /// the error, so the caller can try it again. The default calls `commit`; the memory store
    /// overrides it.
    async fn commit_owned(
        &self,
        agent: &AgentId,
        commit: TurnCommit,
        now: Timestamp,
    ) -> Result<(), (StoreError, TurnCommit)> {
        match self.commit(agent, &commit, now).await {
            Ok(()) => Ok(()),
            Err(e) => Err((e, commit)),
        }
    }

    /// Closes what backs this store, waiting for the operations in progress, and releases what it
    /// holds (a data directory's lock, a connection pool); later calls fail with
    /// [`StoreError::Backend`]. Closing one store of a backend closes the backend's every store;
    /// closing again does nothing. The default does nothing (stores that hold nothing to release).
    async fn release(&self) {}
}

/// Everything one turn of an agent writes to that agent's own store, applied in one transaction.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TurnCommit {
    /// Envelopes the turn consumed: removed from the agent's pending deliveries (absent ids are
    /// ignored).
    pub consumed: Vec<EnvelopeId>,
    /// Channel records the turn wrote, appended in order (as `ChannelStore::append` would).
    pub records: Vec<NewRecord>,
    /// Idempotency keys the turn applied: marked applied (keys already marked are ignored).
    pub applied: Vec<String>,
}

impl TurnCommit {
    /// Whether the commit writes nothing.
    pub fn is_empty(&self) -> bool {
        self.consumed.is_empty() && self.records.is_empty() && self.applied.is_empty()
    }
}

/// A `dyn` delivery store.
pub type DynDeliveryStore = dyn DeliveryStore;

#[async_trait]
impl<T: DeliveryStore + ?Sized> DeliveryStore for std::sync::Arc<T> {
    async fn persist(&self, agent: &AgentId, envelope: &Envelope) -> Result<(), StoreError> {
        (**self).persist(agent, envelope).await
    }
    async fn pending(&self, agent: &AgentId) -> Result<Vec<Envelope>, StoreError> {
        (**self).pending(agent).await
    }
    async fn remove(&self, agent: &AgentId, id: &EnvelopeId) -> Result<(), StoreError> {
        (**self).remove(agent, id).await
    }
    async fn mark_applied(
        &self,
        agent: &AgentId,
        key: &str,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        (**self).mark_applied(agent, key, now).await
    }
    fn is_durable(&self) -> bool {
        (**self).is_durable()
    }
    async fn is_applied(&self, agent: &AgentId, key: &str) -> Result<bool, StoreError> {
        (**self).is_applied(agent, key).await
    }
    async fn commit(
        &self,
        agent: &AgentId,
        commit: &TurnCommit,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        (**self).commit(agent, commit, now).await
    }
    async fn commit_owned(
        &self,
        agent: &AgentId,
        commit: TurnCommit,
        now: Timestamp,
    ) -> Result<(), (StoreError, TurnCommit)> {
        (**self).commit_owned(agent, commit, now).await
    }
    async fn release(&self) {
        (**self).release().await
    }
}
