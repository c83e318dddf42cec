//! The in-memory [`ConversationStore`].

use std::collections::BTreeMap;
use std::sync::Mutex;

use async_trait::async_trait;

use super::lock;
use crate::conversation::{
    Conversation, ConversationFilter, ConversationStatus, ConversationStore,
};
use crate::error::StoreError;
use crate::ids::ConversationId;

/// A [`ConversationStore`] in process memory.
#[derive(Debug, Default)]
pub struct MemoryConversationStore {
    conversations: Mutex<BTreeMap<ConversationId, Conversation>>,
}

impl MemoryConversationStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }
}

/// `AlreadyExists` if `candidate` is open with a `pair_key` that another open conversation holds.
fn key_taken(
    all: &BTreeMap<ConversationId, Conversation>,
    candidate: &Conversation,
) -> Result<(), StoreError> {
    let Some(key) = candidate.pair_key.as_deref() else {
        return Ok(());
    };
    if candidate.status != ConversationStatus::Open {
        return Ok(());
    }
    match all.values().find(|c| {
        c.id != candidate.id
            && c.status == ConversationStatus::Open
            && c.pair_key.as_deref() == Some(key)
    }) {
        Some(holder) => Err(StoreError::already_exists(format!(
            "open conversation {} with pair key {key:?}",
            holder.id
        ))),
        None => Ok(()),
    }
}

#[async_trait]
impl ConversationStore for MemoryConversationStore {
    async fn create(&self, conversation: &Conversation) -> Result<(), StoreError> {
        let mut all = lock(&self.conversations);
        if all.contains_key(&conversation.id) {
            return Err(StoreError::already_exists(format!(
                "conversation {}",
                conversation.id
            )));
        }
        key_taken(&all, conversation)?;
        all.insert(conversation.id.clone(), conversation.clone());
        Ok(())
    }

    async fn get(&self, id: &ConversationId) -> Result<Option<Conversation>, StoreError> {
        Ok(lock(&self.conversations).get(id).cloned())
    }

    async fn update(
        &self,
        next: &Conversation,
        expected_revision: u64,
    ) -> Result<Conversation, StoreError> {
        let mut all = lock(&self.conversations);
        let stored = all
            .get(&next.id)
            .ok_or_else(|| StoreError::not_found(format!("conversation {}", next.id)))?;
        if stored.revision != expected_revision {
            return Err(StoreError::Conflict {
                what: format!("conversation {}", next.id),
                expected: format!("revision {expected_revision}"),
                actual: format!("revision {}", stored.revision),
            });
        }
        stored.check_successor(next)?;
        key_taken(&all, next)?;
        let written = Conversation {
            revision: expected_revision + 1,
            ..next.clone()
        };
        all.insert(written.id.clone(), written.clone());
        Ok(written)
    }

    async fn find_open(&self, pair_key: &str) -> Result<Option<Conversation>, StoreError> {
        let all = lock(&self.conversations);
        Ok(all
            .values()
            .find(|c| {
                c.status == ConversationStatus::Open && c.pair_key.as_deref() == Some(pair_key)
            })
            .cloned())
    }

    async fn list(&self, filter: &ConversationFilter) -> Result<Vec<Conversation>, StoreError> {
        let all = lock(&self.conversations);
        let mut found: Vec<Conversation> = all
            .values()
            .filter(|c| filter.matches(c))
            .cloned()
            .collect();
        found.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        Ok(found)
    }
}
