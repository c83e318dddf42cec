//! [`ChannelStore`]: every agent's channel histories, in the `channel_records` and `channels`
//! tables.

use async_trait::async_trait;
use spacebot_core::channel::{ChannelRecord, NewRecord};
use spacebot_core::{AgentId, ChannelId, ChannelStore, StoreError, Timestamp};
use sqlx::postgres::PgRow;

use crate::PgStores;
use crate::codec::{Reader, limit};
use crate::error::{corrupt, db_error, encode_error};

fn decode(location: &str, agent: &AgentId, row: &PgRow) -> Result<ChannelRecord, StoreError> {
    let seq: i64 = Reader {
        row,
        location,
        what: "a channel record",
    }
    .get("seq")?;
    let what = format!("channel record {seq} of {agent}");
    let r = Reader {
        row,
        location,
        what: &what,
    };
    let kind: String = r.get("kind")?;
    let metadata: String = r.get("metadata")?;
    Ok(ChannelRecord {
        seq: r.u64("seq")?,
        agent: agent.clone(),
        record: NewRecord {
            channel: ChannelId::new(r.text("channel_id")?),
            kind: kind
                .parse()
                .map_err(|e: spacebot_core::InvalidInput| r.bad("kind", e))?,
            author: r.text("author")?.into(),
            content: r.text("content")?.into(),
            metadata: serde_json::from_str(&metadata).map_err(|e| r.bad("metadata", e))?,
            at: Timestamp(r.get("at")?),
        },
    })
}

/// Appends one record in one statement: bumps the agent's record counter (its row lock orders
/// the agent's appends until the transaction ends, so sequence numbers have no gaps and are
/// visible in order), registers the channel, inserts the record.
const APPEND_SQL: &str = "WITH s AS ( \
         INSERT INTO histories (agent_id, last_seq) VALUES ($1, 1) \
         ON CONFLICT (agent_id) DO UPDATE SET last_seq = histories.last_seq + 1 \
         RETURNING last_seq), \
     c AS (INSERT INTO channels (agent_id, id) VALUES ($1, $2) ON CONFLICT DO NOTHING) \
     INSERT INTO channel_records (agent_id, seq, channel_id, kind, author, content, metadata, at) \
     SELECT $1, s.last_seq, $2, $3, $4, $5, $6, $7 FROM s \
     RETURNING seq";

/// [`ChannelStore`] on the `channel_records` and `channels` tables. Get one from
/// [`PgStores::channels`].
#[derive(Debug, Clone)]
pub struct PgChannelStore(pub(crate) PgStores);

#[async_trait]
impl ChannelStore for PgChannelStore {
    async fn release(&self) {
        self.0.close().await;
    }

    async fn append(
        &self,
        agent: &AgentId,
        record: NewRecord,
    ) -> Result<ChannelRecord, StoreError> {
        let db = self.0.db()?;
        let metadata = serde_json::to_string(&record.metadata)
            .map_err(|e| encode_error(&db.location, "record metadata", e))?;
        let seq: i64 = sqlx::query_scalar(APPEND_SQL)
            .bind(agent.as_str())
            .bind(record.channel.as_str().as_bytes())
            .bind(record.kind.as_str())
            .bind(record.author.as_bytes())
            .bind(record.content.as_bytes())
            .bind(metadata)
            .bind(record.at.0)
            .fetch_one(&db.pool)
            .await
            .map_err(|e| db_error(&db.location, "appending a channel record", e))?;
        Ok(ChannelRecord {
            seq: u64::try_from(seq)
                .map_err(|_| corrupt(&db.location, format!("channel record seq {seq}")))?,
            agent: agent.clone(),
            record,
        })
    }

    async fn history(
        &self,
        agent: &AgentId,
        channel: &ChannelId,
        limit_to: Option<usize>,
    ) -> Result<Vec<ChannelRecord>, StoreError> {
        let db = self.0.db()?;
        // The most recent `limit` records, returned oldest first; a NULL limit is no limit.
        let rows = sqlx::query(
            "SELECT seq, channel_id, kind, author, content, metadata, at FROM ( \
                 SELECT seq, channel_id, kind, author, content, metadata, at \
                 FROM channel_records WHERE agent_id = $1 AND channel_id = $2 \
                 ORDER BY seq DESC LIMIT $3 \
             ) AS recent ORDER BY seq ASC",
        )
        .bind(agent.as_str())
        .bind(channel.as_str().as_bytes())
        .bind(limit_to.map(limit))
        .fetch_all(&db.pool)
        .await
        .map_err(|e| db_error(&db.location, "reading a channel history", e))?;
        rows.iter()
            .map(|r| decode(&db.location, agent, r))
            .collect()
    }

    async fn ensure_channel(&self, agent: &AgentId, channel: &ChannelId) -> Result<(), StoreError> {
        let db = self.0.db()?;
        sqlx::query("INSERT INTO channels (agent_id, id) VALUES ($1, $2) ON CONFLICT DO NOTHING")
            .bind(agent.as_str())
            .bind(channel.as_str().as_bytes())
            .execute(&db.pool)
            .await
            .map_err(|e| db_error(&db.location, "registering a channel", e))?;
        Ok(())
    }

    async fn channels(&self, agent: &AgentId) -> Result<Vec<ChannelId>, StoreError> {
        let db = self.0.db()?;
        let ids: Vec<Vec<u8>> =
            sqlx::query_scalar("SELECT id FROM channels WHERE agent_id = $1 ORDER BY id")
                .bind(agent.as_str())
                .fetch_all(&db.pool)
                .await
                .map_err(|e| db_error(&db.location, "listing channels", e))?;
        ids.into_iter()
            .map(|id| {
                String::from_utf8(id)
                    .map(ChannelId::new)
                    .map_err(|e| corrupt(&db.location, format!("channel id of {agent}: {e}")))
            })
            .collect()
    }
}
