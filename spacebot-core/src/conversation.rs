//! Conversation links (seeds 000 and 002): the record of a mirrored two-party conversation or a
//! group of members, and the [`ConversationStore`] trait.

use std::fmt;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::error::{InvalidInput, StoreError};
use crate::ids::{AgentId, ChannelId, ConversationId};
use crate::link::text_enum;
use crate::time::Timestamp;

/// Which conversation mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConversationMode {
    /// Two agents, each with its own link channel; messages are mirrored (seed 000).
    Mirrored,
    /// N members; each member's distilled output reaches every other live member (seed 002).
    Group,
}

text_enum!(ConversationMode, "conversation mode", [Mirrored => "mirrored", Group => "group"]);

/// Where a conversation is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConversationStatus {
    /// Messages may flow.
    Open,
    /// Ended by a conclusion (mirrored) or a close (group); may be reopened, history kept.
    Concluded,
    /// Ended by a sever or a member's session end; terminal.
    Severed,
}

text_enum!(ConversationStatus, "conversation status", [Open => "open", Concluded => "concluded", Severed => "severed"]);

/// A member's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemberRole {
    /// Started the conversation; owns its lifecycle.
    Initiator,
    /// Received the first message.
    Responder,
    /// Any other member of a group.
    Member,
}

text_enum!(MemberRole, "member role", [Initiator => "initiator", Responder => "responder", Member => "member"]);

/// One member of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// The agent.
    pub agent: AgentId,
    /// The agent's channel for this conversation.
    pub channel: ChannelId,
    /// Display name.
    pub name: String,
    /// Position, from 1, in joining order.
    pub number: u32,
    /// Role.
    pub role: MemberRole,
    /// Whether this member's side is still open.
    pub open: bool,
}

/// A conversation link.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Conversation {
    /// Id.
    pub id: ConversationId,
    /// Mode.
    pub mode: ConversationMode,
    /// Members, by number.
    pub members: Vec<Member>,
    /// Who started it.
    pub initiator: AgentId,
    /// The initiator's channel to wake with the result; set once, never overwritten.
    pub initiated_from: Option<ChannelId>,
    /// Status.
    pub status: ConversationStatus,
    /// Turns left; can only go down.
    pub budget_remaining: u32,
    /// At most one open conversation exists per key (for example the sorted member pair).
    pub pair_key: Option<String>,
    /// The last conclusion or closing message.
    pub summary: Option<String>,
    /// Incremented by every update.
    pub revision: u64,
    /// Creation time.
    pub created_at: Timestamp,
    /// Last change.
    pub updated_at: Timestamp,
}

impl Conversation {
    /// The member record of `agent`.
    pub fn member(&self, agent: &AgentId) -> Option<&Member> {
        self.members.iter().find(|m| &m.agent == agent)
    }

    /// Checks that `next` is an allowed successor of `self` as a stored record: same id, mode and
    /// initiator; budget not raised; `initiated_from` not overwritten once set; a severed
    /// conversation not revived. Stores call this in `update`.
    pub fn check_successor(&self, next: &Conversation) -> Result<(), InvalidInput> {
        let what = || format!("conversation {}", self.id);
        if next.id != self.id || next.mode != self.mode || next.initiator != self.initiator {
            return Err(InvalidInput::new(
                what(),
                "id, mode and initiator cannot change",
            ));
        }
        if next.budget_remaining > self.budget_remaining {
            return Err(InvalidInput::new(
                what(),
                format!(
                    "the turn budget cannot be raised ({} -> {})",
                    self.budget_remaining, next.budget_remaining
                ),
            ));
        }
        if self.initiated_from.is_some() && next.initiated_from != self.initiated_from {
            return Err(InvalidInput::new(
                what(),
                "initiated_from is set once and never overwritten",
            ));
        }
        if self.status == ConversationStatus::Severed && next.status != ConversationStatus::Severed
        {
            return Err(InvalidInput::new(
                what(),
                "a severed conversation stays severed",
            ));
        }
        Ok(())
    }
}

/// Which conversations [`ConversationStore::list`] returns. Empty fields match everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConversationFilter {
    /// Only conversations with this member.
    pub member: Option<AgentId>,
    /// Only these statuses.
    pub statuses: Vec<ConversationStatus>,
}

impl ConversationFilter {
    /// Whether `c` matches.
    pub fn matches(&self, c: &Conversation) -> bool {
        self.member.as_ref().is_none_or(|a| c.member(a).is_some())
            && (self.statuses.is_empty() || self.statuses.contains(&c.status))
    }
}

/// Storage of conversation links and their members (instance-wide).
///
/// # Contract
/// - `create` stores a new conversation (its revision as given, normally 1). It fails with
///   [`StoreError::AlreadyExists`] if the id exists, or if the new conversation is open, its
///   `pair_key` is set and an open conversation with the same key exists; nothing is written
///   then. (A concluded or severed conversation never holds its key, so it may be created with a
///   key an open one holds.) Concurrent creates with one key leave exactly one open conversation.
/// - `update(next, expected_revision)` writes `next` with revision `expected_revision + 1` if the
///   stored revision is `expected_revision` (else [`StoreError::Conflict`]) and
///   [`Conversation::check_successor`] accepts it (else [`StoreError::Invalid`]); returns what was
///   stored (the revision field of `next` is ignored). Reopening (concluded -> open) with a
///   `pair_key` fails with `AlreadyExists` when another open conversation holds the key; an open
///   conversation updated while staying open never clashes with its own key.
/// - `find_open(pair_key)` returns the open conversation holding the key.
/// - `list` returns matches sorted by `(created_at, id)`.
///
/// The conformance suite (module `conformance`, feature `conformance`: `conversation_store_*`) checks every clause.
#[async_trait]
pub trait ConversationStore: Send + Sync + fmt::Debug {
    /// Stores a new conversation.
    async fn create(&self, conversation: &Conversation) -> Result<(), StoreError>;
    /// One conversation.
    async fn get(&self, id: &ConversationId) -> Result<Option<Conversation>, StoreError>;
    /// Compare-and-swap update.
    async fn update(
        &self,
        next: &Conversation,
        expected_revision: u64,
    ) -> Result<Conversation, StoreError>;
    /// The open conversation holding `pair_key`.
    async fn find_open(&self, pair_key: &str) -> Result<Option<Conversation>, StoreError>;
    /// Conversations matching `filter`.
    async fn list(&self, filter: &ConversationFilter) -> Result<Vec<Conversation>, StoreError>;

    /// Closes what backs this store, waiting for the operations in progress, and releases what it
    /// holds (a data directory's lock, a connection pool); later calls fail with
    /// [`StoreError::Backend`]. Closing one store of a backend closes the backend's every store;
    /// closing again does nothing. The default does nothing (stores that hold nothing to release).
    async fn release(&self) {}
}

/// A `dyn` conversation store.
pub type DynConversationStore = dyn ConversationStore;

#[async_trait]
impl<T: ConversationStore + ?Sized> ConversationStore for std::sync::Arc<T> {
    async fn create(&self, conversation: &Conversation) -> Result<(), StoreError> {
        (**self).create(conversation).await
    }
    async fn get(&self, id: &ConversationId) -> Result<Option<Conversation>, StoreError> {
        (**self).get(id).await
    }
    async fn update(
        &self,
        next: &Conversation,
        expected_revision: u64,
    ) -> Result<Conversation, StoreError> {
        (**self).update(next, expected_revision).await
    }
    async fn find_open(&self, pair_key: &str) -> Result<Option<Conversation>, StoreError> {
        (**self).find_open(pair_key).await
    }
    async fn list(&self, filter: &ConversationFilter) -> Result<Vec<Conversation>, StoreError> {
        (**self).list(filter).await
    }
    async fn release(&self) {
        (**self).release().await
    }
}
