//! Channel history: each agent's conversations and audit logs, and the [`ChannelStore`] trait.

use std::fmt;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::error::StoreError;
use crate::ids::{AgentId, ChannelId};
use crate::link::text_enum;
use crate::text::Text;
use crate::time::Timestamp;

/// The role of a history record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum RecordKind {
    /// Something the agent received and answered (a user message, a peer's message).
    User,
    /// The agent's own reply.
    Assistant,
    /// A copy of what the agent sent to a peer (history only).
    Sent,
    /// A system or audit record (never sent to a model as a user turn).
    System,
    /// A tool call and its result.
    Tool,
}

text_enum!(RecordKind, "record kind", [User => "user", Assistant => "assistant", Sent => "sent", System => "system", Tool => "tool"]);

/// A record to append.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewRecord {
    /// The owner's channel.
    pub channel: ChannelId,
    /// The role.
    pub kind: RecordKind,
    /// Who wrote it (an agent id, `user`, `system`).
    pub author: Text,
    /// The text (shared: a history read hands it out without a copy).
    pub content: Text,
    /// Free-form metadata (task number, link id, ...).
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub metadata: serde_json::Map<String, serde_json::Value>,
    /// When it happened.
    pub at: Timestamp,
}

impl NewRecord {
    /// A record without metadata.
    pub fn new(
        channel: ChannelId,
        kind: RecordKind,
        author: impl Into<Text>,
        content: impl Into<Text>,
        at: Timestamp,
    ) -> Self {
        Self {
            channel,
            kind,
            author: author.into(),
            content: content.into(),
            metadata: serde_json::Map::new(),
            at,
        }
    }
}

/// A stored record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelRecord {
    /// Sequence number, increasing per agent in append order.
    pub seq: u64,
    /// The owning agent.
    pub agent: AgentId,
    /// The record.
    #[serde(flatten)]
    pub record: NewRecord,
}

/// What a model sees of a stored record: its kind, author and text
/// ([`ChannelStore::history_texts`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistoryText {
    /// The record's sequence number ([`ChannelRecord::seq`]).
    pub seq: u64,
    /// The role.
    pub kind: RecordKind,
    /// Who wrote it.
    pub author: Text,
    /// The text.
    pub content: Text,
}

/// Storage of channel histories, per agent.
///
/// # Contract
/// - `append` assigns a sequence number that increases strictly per agent and returns the record.
/// - `history(agent, channel, limit)` returns the channel's records in append order (not by
///   timestamp); with a limit, the most recent `limit` records (still oldest first; a limit of 0
///   returns none). An unknown channel has an empty history. `history_texts` gives the same
///   records' texts; `history_texts_after(agent, channel, n, limit)` the newest `limit` of those
///   numbered after `n`.
/// - `ensure_channel` makes the channel known (so it is listed even with no records); idempotent.
/// - `channels` lists the agent's known channels (ensured or appended to), sorted.
/// - Records round-trip exactly: text (including NUL and any Unicode), metadata and timestamps.
///
/// The conformance suite (module `conformance`, feature `conformance`: `channel_store_*`) checks every clause.
#[async_trait]
pub trait ChannelStore: Send + Sync + fmt::Debug {
    /// Appends a record to `agent`'s channel.
    async fn append(&self, agent: &AgentId, record: NewRecord)
    -> Result<ChannelRecord, StoreError>;
    /// A channel's history, oldest first.
    async fn history(
        &self,
        agent: &AgentId,
        channel: &ChannelId,
        limit: Option<usize>,
    ) -> Result<Vec<ChannelRecord>, StoreError>;
    /// [`history`](Self::history) for a model's input: the sequence number, kind, author and text of the same
    /// records in the same order (the rest of each record left out). A turn reads its channel's
    /// history with it. The default calls `history`; a store that can hand out its texts without
    /// building whole records overrides it (the memory store shares them: no copy).
    async fn history_texts(
        &self,
        agent: &AgentId,
        channel: &ChannelId,
        limit: Option<usize>,
    ) -> Result<Vec<HistoryText>, StoreError> {
        Ok(self
            .history(agent, channel, limit)
            .await?
            .into_iter()
            .map(|r| HistoryText {
                seq: r.seq,
                kind: r.record.kind,
                author: r.record.author,
                content: r.record.content,
            })
            .collect())
    }
    /// The newest `limit` of the records numbered after `after` in a channel, as
    /// [`history_texts`](Self::history_texts) gives them, oldest first: fewer than `limit` means
    /// every record after `after`. A turn that kept its channel's history from an earlier turn
    /// reads with it only what was appended since. The default reads `history_texts` with the
    /// limit and leaves out the records up to `after`; a store that can seek by number overrides
    /// it.
    async fn history_texts_after(
        &self,
        agent: &AgentId,
        channel: &ChannelId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<HistoryText>, StoreError> {
        let mut texts = self.history_texts(agent, channel, Some(limit)).await?;
        texts.retain(|t| t.seq > after);
        Ok(texts)
    }
    /// Registers a channel.
    async fn ensure_channel(&self, agent: &AgentId, channel: &ChannelId) -> Result<(), StoreError>;
    /// The agent's channels, sorted.
    async fn channels(&self, agent: &AgentId) -> Result<Vec<ChannelId>, StoreError>;

    /// Closes what backs this store, waiting for the operations in progress, and releases what it
    /// holds (a data directory's lock, a connection pool); later calls fail with
    /// [`StoreError::Backend`]. Closing one store of a backend closes the backend's every store;
    /// closing again does nothing. The default does nothing (stores that hold nothing to release).
    async fn release(&self) {}
}

/// A `dyn` channel store.
pub type DynChannelStore = dyn ChannelStore;

#[async_trait]
impl<T: ChannelStore + ?Sized> ChannelStore for std::sync::Arc<T> {
    async fn append(
        &self,
        agent: &AgentId,
        record: NewRecord,
    ) -> Result<ChannelRecord, StoreError> {
        (**self).append(agent, record).await
    }
    async fn history(
        &self,
        agent: &AgentId,
        channel: &ChannelId,
        limit: Option<usize>,
    ) -> Result<Vec<ChannelRecord>, StoreError> {
        (**self).history(agent, channel, limit).await
    }
    async fn history_texts(
        &self,
        agent: &AgentId,
        channel: &ChannelId,
        limit: Option<usize>,
    ) -> Result<Vec<HistoryText>, StoreError> {
        (**self).history_texts(agent, channel, limit).await
    }
    async fn history_texts_after(
        &self,
        agent: &AgentId,
        channel: &ChannelId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<HistoryText>, StoreError> {
        (**self)
            .history_texts_after(agent, channel, after, limit)
            .await
    }
    async fn ensure_channel(&self, agent: &AgentId, channel: &ChannelId) -> Result<(), StoreError> {
        (**self).ensure_channel(agent, channel).await
    }
    async fn channels(&self, agent: &AgentId) -> Result<Vec<ChannelId>, StoreError> {
        (**self).channels(agent).await
    }
    async fn release(&self) {
        (**self).release().await
    }
}
