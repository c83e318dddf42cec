//! [`DeliveryStore`] on each agent's database: pending deliveries and applied keys.

use async_trait::async_trait;
use spacebot_core::{
    AgentId, DeliveryStore, Envelope, EnvelopeId, StoreError, Timestamp, TurnCommit,
};

use crate::SqliteStores;
use crate::channels::APPEND_SQL;
use crate::error::{corrupt, db_error, encode_error};

/// [`DeliveryStore`] on the agents' databases: pending deliveries and applied keys. Get one from [`SqliteStores::deliveries`].
///
/// A [`commit`](DeliveryStore::commit) is one operation of the agent database's writer (one
/// savepoint in a `BEGIN IMMEDIATE` transaction it may share with other writes), on the database
/// that holds the agent's pending deliveries, applied keys and channel history alike.
/// [`is_durable`](DeliveryStore::is_durable) is `true` for stores in a directory and `false` for
/// [`SqliteStores::in_memory`].
#[derive(Debug, Clone)]
pub struct SqliteDeliveryStore(pub(crate) SqliteStores);

#[async_trait]
impl DeliveryStore for SqliteDeliveryStore {
    async fn release(&self) {
        self.0.close().await;
    }

    async fn persist(&self, agent: &AgentId, envelope: &Envelope) -> Result<(), StoreError> {
        let db = self.0.agent(agent).await?;
        let json = serde_json::to_string(envelope)
            .map_err(|e| encode_error(&db.location, "an envelope", e))?;
        let (id, channel, kind) = (
            envelope.id.as_str().to_string(),
            envelope.channel.as_str().to_string(),
            envelope.kind.as_str(),
        );
        let location = db.location.clone();
        db.writes
            .run(move |conn| {
                Box::pin(async move {
                    sqlx::query(
                        "INSERT INTO pending_deliveries (id, channel_id, kind, envelope) \
                         VALUES (?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
                    )
                    .bind(id)
                    .bind(channel)
                    .bind(kind)
                    .bind(json)
                    .execute(&mut *conn)
                    .await
                    .map_err(|e| db_error(&location, "persisting a delivery", e))?;
                    Ok(())
                })
            })
            .await
    }

    async fn pending(&self, agent: &AgentId) -> Result<Vec<Envelope>, StoreError> {
        let db = self.0.agent(agent).await?;
        let rows: Vec<String> =
            sqlx::query_scalar("SELECT envelope FROM pending_deliveries ORDER BY seq")
                .fetch_all(&mut *db.read("taking a reader connection").await?)
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
        let id = id.as_str().to_string();
        let location = db.location.clone();
        db.writes
            .run(move |conn| {
                Box::pin(async move {
                    sqlx::query("DELETE FROM pending_deliveries WHERE id = ?")
                        .bind(id)
                        .execute(&mut *conn)
                        .await
                        .map_err(|e| db_error(&location, "removing a delivery", e))?;
                    Ok(())
                })
            })
            .await
    }

    async fn mark_applied(
        &self,
        agent: &AgentId,
        key: &str,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let db = self.0.agent(agent).await?;
        let key = key.to_string();
        let location = db.location.clone();
        db.writes
            .run(move |conn| {
                Box::pin(async move {
                    let done = sqlx::query(
                        "INSERT INTO applied_keys (key, applied_at) VALUES (?, ?) \
                         ON CONFLICT (key) DO NOTHING",
                    )
                    .bind(key)
                    .bind(now.0)
                    .execute(&mut *conn)
                    .await
                    .map_err(|e| db_error(&location, "marking a key applied", e))?;
                    Ok(done.rows_affected() == 1)
                })
            })
            .await
    }

    fn is_durable(&self) -> bool {
        self.0.dir().is_some()
    }

    async fn is_applied(&self, agent: &AgentId, key: &str) -> Result<bool, StoreError> {
        let db = self.0.agent(agent).await?;
        let found: Option<i64> = sqlx::query_scalar("SELECT 1 FROM applied_keys WHERE key = ?")
            .bind(key)
            .fetch_optional(&mut *db.read("taking a reader connection").await?)
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
        let db = self.0.agent(agent).await?;
        // Encode before the transaction: nothing can fail half-way for want of a value.
        let metadata = commit
            .records
            .iter()
            .map(|r| {
                serde_json::to_string(&r.metadata)
                    .map_err(|e| encode_error(&db.location, "record metadata", e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let consumed: Vec<String> = commit
            .consumed
            .iter()
            .map(|id| id.as_str().to_string())
            .collect();
        let records: Vec<_> = commit
            .records
            .iter()
            .zip(metadata)
            .map(|(r, metadata)| {
                (
                    r.channel.as_str().to_string(),
                    r.kind.as_str(),
                    r.author.to_string(),
                    r.content.to_string(),
                    metadata,
                    r.at.0,
                )
            })
            .collect();
        let applied = commit.applied.clone();
        let location = db.location.clone();
        // One operation of the writer: its savepoint keeps the whole turn together.
        db.writes
            .run(move |conn| {
                Box::pin(async move {
                    let fail = |doing: &str, e| db_error(&location, doing, e);
                    for id in consumed {
                        sqlx::query("DELETE FROM pending_deliveries WHERE id = ?")
                            .bind(id)
                            .execute(&mut *conn)
                            .await
                            .map_err(|e| fail("removing a consumed delivery", e))?;
                    }
                    for (channel, kind, author, content, metadata, at) in records {
                        sqlx::query(APPEND_SQL)
                            .bind(channel)
                            .bind(kind)
                            .bind(author)
                            .bind(content)
                            .bind(metadata)
                            .bind(at)
                            .fetch_one(&mut *conn)
                            .await
                            .map_err(|e| fail("appending a channel record", e))?;
                    }
                    for key in applied {
                        sqlx::query(
                            "INSERT INTO applied_keys (key, applied_at) VALUES (?, ?) \
                             ON CONFLICT (key) DO NOTHING",
                        )
                        .bind(key)
                        .bind(now.0)
                        .execute(&mut *conn)
                        .await
                        .map_err(|e| fail("marking a key applied", e))?;
                    }
                    Ok(())
                })
            })
            .await
    }
}
