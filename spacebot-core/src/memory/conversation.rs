//! The in-memory [`ConversationStore`].

use std::collections::{BTreeMap, HashMap};
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
    conversations: Mutex<State>,
}

/// Every conversation, and the open one of each pair key (so a lookup by key does not scan).
#[derive(Debug, Default)]
struct State {
    all: BTreeMap<ConversationId, Conversation>,
    open: HashMap<String, ConversationId>,
}

impl State {
    /// Stores `c`, keeping the open-by-key index in step.
    fn put(&mut self, c: Conversation) {
        if let Some(old) = self.all.get(&c.id)
            && let Some(key) = old.pair_key.as_deref()
            && self.open.get(key) == Some(&old.id)
        {
            self.open.remove(key);
        }
        if c.status == ConversationStatus::Open
            && let Some(key) = c.pair_key.clone()
        {
            self.open.insert(key, c.id.clone());
        }
        self.all.insert(c.id.clone(), c);
    }
}

impl MemoryConversationStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }
}

/// `AlreadyExists` if `candidate` is open with a `pair_key` that another open conversation holds.
fn key_taken(state: &State, candidate: &Conversation) -> Result<(), StoreError> {
    let Some(key) = candidate.pair_key.as_deref() else {
        return Ok(());
    };
    if candidate.status != ConversationStatus::Open {
        return Ok(());
    }
    match state
        .open
        .get(key)
        .filter(|id| **id != candidate.id)
        .and_then(|id| state.all.get(id))
    {
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
        let mut state = lock(&self.conversations);
        if state.all.contains_key(&conversation.id) {
            return Err(StoreError::already_exists(format!(
                "conversation {}",
                conversation.id
            )));
        }
        key_taken(&state, conversation)?;
        state.put(conversation.clone());
        Ok(())
    }

    async fn get(&self, id: &ConversationId) -> Result<Option<Conversation>, StoreError> {
        Ok(lock(&self.conversations).all.get(id).cloned())
    }

    async fn update(
        &self,
        next: &Conversation,
        expected_revision: u64,
    ) -> Result<Conversation, StoreError> {
        let mut state = lock(&self.conversations);
        let stored = state
            .all
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
        key_taken(&state, next)?;
        let written = Conversation {
            revision: expected_revision + 1,
            ..next.clone()
        };
        state.put(written.clone());
        Ok(written)
    }

    async fn find_open(&self, pair_key: &str) -> Result<Option<Conversation>, StoreError> {
        let state = lock(&self.conversations);
        Ok(state
            .open
            .get(pair_key)
            .and_then(|id| state.all.get(id))
            .cloned())
    }

    async fn list(&self, filter: &ConversationFilter) -> Result<Vec<Conversation>, StoreError> {
        let state = lock(&self.conversations);
        let mut found: Vec<Conversation> = state
            .all
            .values()
            .filter(|c| filter.matches(c))
            .cloned()
            .collect();
        found.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        Ok(found)
    }
}
