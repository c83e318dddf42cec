//! [`DeliveryStore`]: every agent's pending deliveries and applied keys, in the
//! `pending_deliveries` and `applied_keys` tables.

use async_trait::async_trait;
use spacebot_core::{
    AgentId, DeliveryStore, Envelope, EnvelopeId, StoreError, Timestamp, TurnCommit,
};

use crate::PgStores;
use crate::channels::append_all;
use crate::error::{corrupt, db_error, encode_error};

/// Marks keys applied, in key order (two commits marking the same keys lock them in the same
/// order); keys already marked are skipped.
const MARK_ALL_SQL: &str = "INSERT INTO applied_keys (agent_id, key, applied_at) \
     SELECT $1, k, $3 FROM unnest($2::bytea[]) AS k ORDER BY k \
     ON CONFLICT (agent_id, key) DO NOTHING";

/// [`DeliveryStore`] on the `pending_deliveries` and `applied_keys` tables. Get one from
/// [`PgStores::deliveries`].
///
/// A [`commit`](DeliveryStore::commit) is one transaction: consumed envelopes removed, records
/// appended (with their sequence numbers), keys marked. Ids and keys are unique constraints, so
/// persisting an envelope twice keeps one and of concurrent `mark_applied` calls with one key,
/// from any processes, exactly one returns `true`. [`is_durable`](DeliveryStore::is_durable) is
/// `true`.
#[derive(Debug, Clone)]
pub struct PgDeliveryStore(pub(crate) PgStores);

#[async_trait]
impl DeliveryStore for PgDeliveryStore {
    async fn release(&self) {
        self.0.close().await;
    }

    async fn persist(&self, agent: &AgentId, envelope: &Envelope) -> Result<(), StoreError> {
        let db = self.0.db()?;
        let json = serde_json::to_string(envelope)
            .map_err(|e| encode_error(&db.location, "an envelope", e))?;
        sqlx::query(
            "INSERT INTO pending_deliveries (agent_id, id, channel_id, kind, envelope) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (agent_id, id) DO NOTHING",
        )
        .bind(agent.as_str())
        .bind(envelope.id.as_str().as_bytes())
        .bind(envelope.channel.as_str().as_bytes())
        .bind(envelope.kind.as_str())
        .bind(json)
        .execute(&db.pool)
        .await
        .map_err(|e| db_error(&db.location, "persisting a delivery", e))?;
        Ok(())
    }

    async fn pending(&self, agent: &AgentId) -> Result<Vec<Envelope>, StoreError> {
        let db = self.0.db()?;
        let rows: Vec<String> = sqlx::query_scalar(
            "SELECT envelope FROM pending_deliveries WHERE agent_id = $1 ORDER BY seq",
        )
        .bind(agent.as_str())
        .fetch_all(&db.pool)
        .await
        .map_err(|e| db_error(&db.location, "reading pending deliveries", e))?;
        rows.iter()
            .map(|json| {
                serde_json::from_str(json)
                    .map_err(|e| corrupt(&db.location, format!("pending delivery of {agent}: {e}")))
            })
            .collect()
    }

    async fn remove(&self, agent: &AgentId, id: &EnvelopeId) -> Result<(), StoreError> {
        let db = self.0.db()?;
        sqlx::query("DELETE FROM pending_deliveries WHERE agent_id = $1 AND id = $2")
            .bind(agent.as_str())
            .bind(id.as_str().as_bytes())
            .execute(&db.pool)
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
        let db = self.0.db()?;
        let done = sqlx::query(
            "INSERT INTO applied_keys (agent_id, key, applied_at) VALUES ($1, $2, $3) \
             ON CONFLICT (agent_id, key) DO NOTHING",
        )
        .bind(agent.as_str())
        .bind(key.as_bytes())
        .bind(now.0)
        .execute(&db.pool)
        .await
        .map_err(|e| db_error(&db.location, "marking a key applied", e))?;
        Ok(done.rows_affected() == 1)
    }

    fn is_durable(&self) -> bool {
        true
    }

    async fn is_applied(&self, agent: &AgentId, key: &str) -> Result<bool, StoreError> {
        let db = self.0.db()?;
        let found: Option<i32> =
            sqlx::query_scalar("SELECT 1 FROM applied_keys WHERE agent_id = $1 AND key = $2")
                .bind(agent.as_str())
                .bind(key.as_bytes())
                .fetch_optional(&db.pool)
                .await
                .map_err(|e| db_error(&db.location, "reading an applied key", e))?;
        Ok(found.is_some())
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
        let db = self.0.db()?;
        // Sorted: concurrent commits lock shared rows in the same order.
        let mut consumed: Vec<Vec<u8>> = commit
            .consumed
            .iter()
            .map(|id| id.as_str().as_bytes().to_vec())
            .collect();
        consumed.sort();
        consumed.dedup();
        let mut applied: Vec<Vec<u8>> = commit
            .applied
            .iter()
            .map(|k| k.as_bytes().to_vec())
            .collect();
        applied.sort();
        applied.dedup();
        let location = db.location.clone();
        db.tx(|conn| {
            let (agent, location) = (agent.clone(), location.clone());
            let (consumed, applied) = (consumed.clone(), applied.clone());
            let records = commit.records.clone();
            Box::pin(async move {
                let fail = |doing: &str, e| db_error(&location, doing, e);
                if !consumed.is_empty() {
                    sqlx::query(
                        "DELETE FROM pending_deliveries WHERE agent_id = $1 AND id = ANY($2)",
                    )
                    .bind(agent.as_str())
                    .bind(consumed)
                    .execute(&mut *conn)
                    .await
                    .map_err(|e| fail("removing consumed deliveries", e))?;
                }
                append_all(conn, &location, &agent, &records).await?;
                if !applied.is_empty() {
                    sqlx::query(MARK_ALL_SQL)
                        .bind(agent.as_str())
                        .bind(applied)
                        .bind(now.0)
                        .execute(&mut *conn)
                        .await
                        .map_err(|e| fail("marking keys applied", e))?;
                }
                Ok(())
            })
        })
        .await
    }
}
