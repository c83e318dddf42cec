//! The in-memory [`DeliveryStore`].

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use async_trait::async_trait;

use super::lock;
use crate::envelope::{DeliveryStore, Envelope};
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

/// A [`DeliveryStore`] in process memory. "Across restarts" holds for as long as the store lives.
#[derive(Debug, Default)]
pub struct MemoryDeliveryStore {
    agents: Mutex<HashMap<AgentId, AgentDeliveries>>,
}

impl MemoryDeliveryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
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
}
