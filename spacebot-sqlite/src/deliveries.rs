//! [`DeliveryStore`] on each agent's database: pending deliveries and applied keys.

use async_trait::async_trait;
use spacebot_core::{AgentId, DeliveryStore, Envelope, EnvelopeId, StoreError, Timestamp};

use crate::SqliteStores;
use crate::error::{corrupt, db_error, encode_error};

/// [`DeliveryStore`] on the agents' databases: pending deliveries and applied keys. Get one from [`SqliteStores::deliveries`].
#[derive(Debug, Clone)]
pub struct SqliteDeliveryStore(pub(crate) SqliteStores);

#[async_trait]
impl DeliveryStore for SqliteDeliveryStore {
    async fn persist(&self, agent: &AgentId, envelope: &Envelope) -> Result<(), StoreError> {
        let db = self.0.agent(agent).await?;
        let json = serde_json::to_string(envelope)
            .map_err(|e| encode_error(&db.location, "an envelope", e))?;
        sqlx::query(
            "INSERT INTO pending_deliveries (id, channel_id, kind, envelope) VALUES (?, ?, ?, ?) \
             ON CONFLICT (id) DO NOTHING",
        )
        .bind(envelope.id.as_str())
        .bind(envelope.channel.as_str())
        .bind(envelope.kind.as_str())
        .bind(json)
        .execute(&db.writer)
        .await
        .map_err(|e| db_error(&db.location, "persisting a delivery", e))?;
        Ok(())
    }

    async fn pending(&self, agent: &AgentId) -> Result<Vec<Envelope>, StoreError> {
        let db = self.0.agent(agent).await?;
        let rows: Vec<String> =
            sqlx::query_scalar("SELECT envelope FROM pending_deliveries ORDER BY seq")
                .fetch_all(&db.reader)
                .await
                .map_err(|e| db_error(&db.location, "reading pending deliveries", e))?;
        rows.iter()
            .map(|json| {
                serde_json::from_str(json)
                    .map_err(|e| corrupt(&db.location, format!("pending delivery: {e}")))
            })
            .collect()
    }

    async fn remove(&self, agent: &AgentId, id: &EnvelopeId) -> Result<(), StoreError> {
        let db = self.0.agent(agent).await?;
        sqlx::query("DELETE FROM pending_deliveries WHERE id = ?")
            .bind(id.as_str())
            .execute(&db.writer)
            .await
            .map_err(|e| db_error(&db.location, "removing a delivery", e))?;
        Ok(())
    }

    async fn mark_applied(
        &self,
        agent: &AgentId,
        key: &str,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let db = self.0.agent(agent).await?;
        let done = sqlx::query(
            "INSERT INTO applied_keys (key, applied_at) VALUES (?, ?) ON CONFLICT (key) DO NOTHING",
        )
        .bind(key)
        .bind(now.0)
        .execute(&db.writer)
        .await
        .map_err(|e| db_error(&db.location, "marking a key applied", e))?;
        Ok(done.rows_affected() == 1)
    }
}
