//! [`DeliveryStore`] on each agent's database: pending deliveries and applied keys.

use async_trait::async_trait;
use spacebot_core::{
    AgentId, DeliveryStore, Envelope, EnvelopeId, StoreError, Timestamp, TurnCommit,
};

use rusqlite::params;

use crate::SqliteStores;
use crate::channels::APPEND_UNNUMBERED_SQL;
use crate::error::{corrupt, db_error, encode_error};
use crate::query;

/// Marks an idempotency key applied (a no-op if it already is).
const APPLY_KEY_SQL: &str = "INSERT INTO applied_keys (agent, key, applied_at) VALUES (?, ?, ?) \
     ON CONFLICT (agent, key) DO NOTHING";

/// Removes a pending delivery.
const REMOVE_SQL: &str = "DELETE FROM pending_deliveries WHERE agent = ? AND id = ?";

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
        let (location, key) = (db.location.clone(), db.key.clone());
        db.writes
            .run(move |conn| {
                query::execute(
                    conn,
                    "INSERT INTO pending_deliveries (agent, id, channel_id, kind, envelope) \
                     VALUES (?, ?, ?, ?, ?) ON CONFLICT (agent, id) DO NOTHING",
                    params![&*key, id, channel, kind, json],
                )
                .map_err(|e| db_error(&location, "persisting a delivery", e))?;
                Ok(())
            })
            .await
    }

    async fn pending(&self, agent: &AgentId) -> Result<Vec<Envelope>, StoreError> {
        let db = self.0.agent(agent).await?;
        let (location, key) = (db.location.clone(), db.key.clone());
        db.read("reading pending deliveries", move |conn| {
            query::all(
                conn,
                &location,
                "reading pending deliveries",
                "SELECT envelope FROM pending_deliveries WHERE agent = ? ORDER BY seq",
                [&*key],
                |row| {
                    let json: String =
                        query::get(&location, "reading pending deliveries", row, "envelope")?;
                    serde_json::from_str(&json)
                        .map_err(|e| corrupt(&location, format!("pending delivery: {e}")))
                },
            )
        })
        .await
    }

    async fn remove(&self, agent: &AgentId, id: &EnvelopeId) -> Result<(), StoreError> {
        let db = self.0.agent(agent).await?;
        let id = id.as_str().to_string();
        let (location, agent) = (db.location.clone(), db.key.clone());
        db.writes
            .run(move |conn| {
                query::execute(conn, REMOVE_SQL, params![&*agent, id])
                    .map_err(|e| db_error(&location, "removing a delivery", e))?;
                Ok(())
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
        let (location, agent) = (db.location.clone(), db.key.clone());
        db.writes
            .run(move |conn| {
                let done = query::execute(conn, APPLY_KEY_SQL, params![&*agent, key, now.0])
                    .map_err(|e| db_error(&location, "marking a key applied", e))?;
                Ok(done == 1)
            })
            .await
    }

    fn is_durable(&self) -> bool {
        self.0.dir().is_some()
    }

    async fn is_applied(&self, agent: &AgentId, key: &str) -> Result<bool, StoreError> {
        let db = self.0.agent(agent).await?;
        let (key, location, agent) = (key.to_string(), db.location.clone(), db.key.clone());
        db.read_short("reading an applied key", move |conn| {
            let found = query::first(
                conn,
                &location,
                "reading an applied key",
                "SELECT 1 FROM applied_keys WHERE agent = ? AND key = ?",
                params![&*agent, key],
                |_| Ok(()),
            )?;
            Ok(found.is_some())
        })
        .await
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
        let (location, agent) = (db.location.clone(), db.key.clone());
        // One operation of the writer: its savepoint keeps the whole turn together.
        db.writes
            .run(move |conn| {
                let fail = |doing: &str, e| db_error(&location, doing, e);
                for id in consumed {
                    query::execute(conn, REMOVE_SQL, params![&*agent, id])
                        .map_err(|e| fail("removing a consumed delivery", e))?;
                }
                if !records.is_empty() {
                    let mut append = conn
                        .prepare_cached(APPEND_UNNUMBERED_SQL)
                        .map_err(|e| fail("appending a channel record", e))?;
                    for (channel, kind, author, content, metadata, at) in records {
                        append
                            .execute(params![
                                &*agent, channel, kind, author, content, metadata, at
                            ])
                            .map_err(|e| fail("appending a channel record", e))?;
                    }
                }
                for key in applied {
                    query::execute(conn, APPLY_KEY_SQL, params![&*agent, key, now.0])
                        .map_err(|e| fail("marking a key applied", e))?;
                }
                Ok(())
            })
            .await
    }
}
