//! The in-memory [`DeliveryStore`].

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use super::{MemoryChannelStore, lock};
use crate::envelope::{DeliveryStore, Envelope, TurnCommit};
use crate::error::StoreError;
use crate::ids::{AgentId, EnvelopeId};
use crate::time::Timestamp;

/// One agent's pending envelopes and applied keys.
#[derive(Debug, Default)]
struct AgentDeliveries {
    /// Stored envelopes in persist order.
    pending: Vec<Envelope>,
    /// Keys marked applied.
    applied: HashSet<String>,
}

/// A [`DeliveryStore`] in process memory. "Across restarts" holds for as long as the store lives,
/// and [`is_durable`](DeliveryStore::is_durable) is `false`.
///
/// [`commit`](DeliveryStore::commit) appends its records to a [`MemoryChannelStore`]: the one
/// given to [`MemoryDeliveryStore::with_channels`] (as [`Stores::memory`](crate::Stores::memory)
/// does, so that committed records show in the bundle's channel store), or, for a store made with
/// [`MemoryDeliveryStore::new`], a private one that nothing else reads. A commit holds this store's
/// lock while it appends, so no reader of this store sees part of it; records become visible in
/// the channel store together, under one hold of its lock.
#[derive(Debug, Default)]
pub struct MemoryDeliveryStore {
    agents: Mutex<crate::fasthash::FastMap<AgentId, AgentDeliveries>>,
    channels: Arc<MemoryChannelStore>,
}

impl MemoryDeliveryStore {
    /// An empty store whose commits write records to a channel store of its own (which nothing
    /// else reads: use [`MemoryDeliveryStore::with_channels`] to see them).
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store whose commits write records to `channels`.
    pub fn with_channels(channels: Arc<MemoryChannelStore>) -> Self {
        Self {
            agents: Mutex::default(),
            channels,
        }
    }
}

#[async_trait]
impl DeliveryStore for MemoryDeliveryStore {
    async fn persist(&self, agent: &AgentId, envelope: &Envelope) -> Result<(), StoreError> {
        let mut agents = lock(&self.agents);
        let state = agents.entry(agent.clone()).or_default();
        if !state.pending.iter().any(|e| e.id == envelope.id) {
            state.pending.push(envelope.clone());
        }
        Ok(())
    }

    async fn pending(&self, agent: &AgentId) -> Result<Vec<Envelope>, StoreError> {
        let agents = lock(&self.agents);
        Ok(agents
            .get(agent)
            .map(|a| a.pending.clone())
            .unwrap_or_default())
    }

    async fn remove(&self, agent: &AgentId, id: &EnvelopeId) -> Result<(), StoreError> {
        let mut agents = lock(&self.agents);
        if let Some(state) = agents.get_mut(agent) {
            state.pending.retain(|e| &e.id != id);
        }
        Ok(())
    }

    async fn mark_applied(
        &self,
        agent: &AgentId,
        key: &str,
        _now: Timestamp,
    ) -> Result<bool, StoreError> {
        let mut agents = lock(&self.agents);
        Ok(agents
            .entry(agent.clone())
            .or_default()
            .applied
            .insert(key.to_string()))
    }

    fn is_durable(&self) -> bool {
        false
    }

    async fn is_applied(&self, agent: &AgentId, key: &str) -> Result<bool, StoreError> {
        Ok(lock(&self.agents)
            .get(agent)
            .is_some_and(|a| a.applied.contains(key)))
    }

    async fn commit(
        &self,
        agent: &AgentId,
        commit: &TurnCommit,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        if commit.is_empty() {
            return Ok(());
        }
        // The memory store keeps copies of what it is lent.
        self.commit_owned(agent, commit.clone(), now)
            .await
            .map_err(|(e, _)| e)
    }

    async fn commit_owned(
        &self,
        agent: &AgentId,
        commit: TurnCommit,
        _now: Timestamp,
    ) -> Result<(), (StoreError, TurnCommit)> {
        if commit.is_empty() {
            return Ok(());
        }
        // Lock order: this store, then the channel store (which never takes this one's lock).
        let mut agents = lock(&self.agents);
        let state = agents.entry(agent.clone()).or_default();
        if !commit.consumed.is_empty() {
            state.pending.retain(|e| !commit.consumed.contains(&e.id));
        }
        state.applied.extend(commit.applied);
        // Given away: the channel store keeps their texts without a copy.
        self.channels.append_owned(agent, commit.records);
        Ok(())
    }
}
