//! [`DeliveryStore`]: every agent's pending deliveries and applied keys, in the
//! `pending_deliveries` and `applied_keys` tables.

use async_trait::async_trait;
use spacebot_core::channel::NewRecord;
use spacebot_core::{
    AgentId, DeliveryStore, Envelope, EnvelopeId, StoreError, Timestamp, TurnCommit,
};

use crate::PgStores;
use crate::error::{corrupt, db_error, encode_error};

/// [`DeliveryStore`] on the `pending_deliveries` and `applied_keys` tables. Get one from
/// [`PgStores::deliveries`].
///
/// A [`commit`](DeliveryStore::commit) is one statement (so one transaction): consumed envelopes
/// removed, records appended (with their sequence numbers), keys marked. Ids and keys are unique constraints, so
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
        let records = Columns::of(&location, &commit.records)?;
        db.statement(|pool| {
            let (consumed, applied, records) = (consumed.clone(), applied.clone(), records.clone());
            let (agent, location) = (agent.clone(), location.clone());
            Box::pin(async move {
                sqlx::query(COMMIT_SQL)
                    .bind(agent.as_str())
                    .bind(consumed)
                    .bind(records.channels)
                    .bind(records.kinds)
                    .bind(records.authors)
                    .bind(records.contents)
                    .bind(records.metadata)
                    .bind(records.at)
                    .bind(applied)
                    .bind(now.0)
                    .execute(pool)
                    .await
                    .map_err(|e| db_error(&location, "committing a turn", e))?;
                Ok(())
            })
        })
        .await
    }
}

/// A turn's commit in one statement (atomic by itself: one round trip to the server, no
/// `BEGIN` and `COMMIT`): the consumed envelopes removed, the records appended in order with
/// the agent's next sequence numbers (the `histories` row bumped by their count: its row lock
/// orders the agent's appends until the statement ends, so numbers have no gaps and are visible
/// in order), their channels registered, the keys marked applied in key order (two commits
/// marking the same keys lock them in the same order; keys marked already are skipped).
///
/// `$1` agent, `$2` consumed ids, `$3`..`$8` the records' columns (one array each, in order),
/// `$9` applied keys (sorted), `$10` now.
const COMMIT_SQL: &str = "WITH \
     d AS (DELETE FROM pending_deliveries WHERE agent_id = $1 AND id = ANY($2::bytea[])), \
     r AS (SELECT * FROM unnest($3::bytea[], $4::text[], $5::bytea[], $6::bytea[], \
               $7::text[], $8::bigint[]) \
           WITH ORDINALITY AS r (channel_id, kind, author, content, metadata, at, ord)), \
     s AS (INSERT INTO histories (agent_id, last_seq) \
               SELECT $1, count(*) FROM r HAVING count(*) > 0 \
           ON CONFLICT (agent_id) DO UPDATE SET last_seq = histories.last_seq + excluded.last_seq \
           RETURNING last_seq), \
     c AS (INSERT INTO channels (agent_id, id) SELECT DISTINCT $1, channel_id FROM r \
           ON CONFLICT DO NOTHING), \
     i AS (INSERT INTO channel_records \
               (agent_id, seq, channel_id, kind, author, content, metadata, at) \
           SELECT $1, s.last_seq - cardinality($4::text[]) + r.ord, r.channel_id, r.kind, \
               r.author, r.content, r.metadata, r.at FROM s, r), \
     m AS (INSERT INTO applied_keys (agent_id, key, applied_at) \
           SELECT $1, k, $10 FROM unnest($9::bytea[]) AS k ORDER BY k \
           ON CONFLICT (agent_id, key) DO NOTHING) \
     SELECT 1";

/// A commit's records as columns, one array per column, in order.
#[derive(Debug, Clone, Default)]
struct Columns {
    channels: Vec<Vec<u8>>,
    kinds: Vec<String>,
    authors: Vec<Vec<u8>>,
    contents: Vec<Vec<u8>>,
    metadata: Vec<String>,
    at: Vec<i64>,
}

impl Columns {
    fn of(location: &str, records: &[NewRecord]) -> Result<Self, StoreError> {
        let mut columns = Self::default();
        for record in records {
            columns.metadata.push(
                serde_json::to_string(&record.metadata)
                    .map_err(|e| encode_error(location, "record metadata", e))?,
            );
            columns
                .channels
                .push(record.channel.as_str().as_bytes().to_vec());
            columns.kinds.push(record.kind.as_str().to_string());
            columns.authors.push(record.author.as_bytes().to_vec());
            columns.contents.push(record.content.as_bytes().to_vec());
            columns.at.push(record.at.0);
        }
        Ok(columns)
    }
}
