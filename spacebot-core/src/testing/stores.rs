//! Store wrappers that fail on purpose: [`FailingDeliveries`].

use std::sync::Arc;

use async_trait::async_trait;

use crate::envelope::{DeliveryStore, Envelope};
use crate::error::StoreError;
use crate::ids::{AgentId, EnvelopeId};
use crate::time::Timestamp;

/// Delivery store whose `persist` fails for one agent (a member whose deliveries cannot be
/// kept).
#[derive(Debug)]
pub struct FailingDeliveries {
    /// The store every call goes to, except the refused ones.
    pub inner: Arc<dyn DeliveryStore>,
    /// The agent whose deliveries cannot be kept.
    pub broken: AgentId,
}

#[async_trait]
impl DeliveryStore for FailingDeliveries {
    async fn persist(&self, agent: &AgentId, envelope: &Envelope) -> Result<(), StoreError> {
        if agent == &self.broken {
            return Err(StoreError::Backend {
                backend: "test",
                message: "the disk is full".into(),
                source: None,
            });
        }
        self.inner.persist(agent, envelope).await
    }
    async fn pending(&self, agent: &AgentId) -> Result<Vec<Envelope>, StoreError> {
        self.inner.pending(agent).await
    }
    async fn remove(&self, agent: &AgentId, id: &EnvelopeId) -> Result<(), StoreError> {
        self.inner.remove(agent, id).await
    }
    async fn mark_applied(
        &self,
        agent: &AgentId,
        key: &str,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.inner.mark_applied(agent, key, now).await
    }
    fn is_durable(&self) -> bool {
        self.inner.is_durable()
    }
    async fn is_applied(&self, agent: &AgentId, key: &str) -> Result<bool, StoreError> {
        self.inner.is_applied(agent, key).await
    }
    async fn commit(
        &self,
        agent: &AgentId,
        commit: &crate::envelope::TurnCommit,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        self.inner.commit(agent, commit, now).await
    }
}
