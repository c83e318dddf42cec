//! [`ChannelStore`] on each agent's database.

use async_trait::async_trait;
use spacebot_core::channel::{ChannelRecord, NewRecord};
use spacebot_core::{AgentId, ChannelId, ChannelStore, StoreError, Timestamp};
use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use crate::SqliteStores;
use crate::error::{Location, corrupt, db_error, encode_error};

fn decode(
    location: &Location,
    agent: &AgentId,
    row: &SqliteRow,
) -> Result<ChannelRecord, StoreError> {
    let read = |e| db_error(location, "reading a channel record", e);
    let seq: i64 = row.try_get("seq").map_err(read)?;
    let bad =
        |what: &str, why: String| corrupt(location, format!("channel record {seq}: {what}: {why}"));
    let kind: String = row.try_get("kind").map_err(read)?;
    let metadata: String = row.try_get("metadata").map_err(read)?;
    Ok(ChannelRecord {
        seq: u64::try_from(seq).map_err(|_| bad("seq", "negative".into()))?,
        agent: agent.clone(),
        record: NewRecord {
            channel: ChannelId::new(row.try_get::<String, _>("channel_id").map_err(read)?),
            kind: kind
                .parse()
                .map_err(|e: spacebot_core::InvalidInput| bad("kind", e.to_string()))?,
            author: row.try_get::<String, _>("author").map_err(read)?.into(),
            content: row.try_get::<String, _>("content").map_err(read)?.into(),
            metadata: serde_json::from_str(&metadata)
                .map_err(|e| bad("metadata", e.to_string()))?,
            at: Timestamp(row.try_get("at").map_err(read)?),
        },
    })
}

/// Appends one record and returns its sequence number; the `channel_records_known` trigger
/// registers the channel in the same statement.
pub(crate) const APPEND_SQL: &str = "INSERT INTO channel_records (channel_id, kind, author, content, metadata, at) \
     VALUES (?, ?, ?, ?, ?, ?) RETURNING seq";

/// [`ChannelStore`] on the agents' databases. Get one from [`SqliteStores::channels`].
#[derive(Debug, Clone)]
pub struct SqliteChannelStore(pub(crate) SqliteStores);

#[async_trait]
impl ChannelStore for SqliteChannelStore {
    async fn release(&self) {
        self.0.close().await;
    }

    async fn append(
        &self,
        agent: &AgentId,
        record: NewRecord,
    ) -> Result<ChannelRecord, StoreError> {
        let db = self.0.agent(agent).await?;
        let metadata = serde_json::to_string(&record.metadata)
            .map_err(|e| encode_error(&db.location, "record metadata", e))?;
        let (channel, kind, author, content, at) = (
            record.channel.as_str().to_string(),
            record.kind.as_str(),
            record.author.to_string(),
            record.content.to_string(),
            record.at.0,
        );
        let location = db.location.clone();
        let seq: i64 = db
            .writes
            .run(move |conn| {
                Box::pin(async move {
                    // The `channel_records_known` trigger registers the channel in the same
                    // statement.
                    sqlx::query_scalar(APPEND_SQL)
                        .bind(channel)
                        .bind(kind)
                        .bind(author)
                        .bind(content)
                        .bind(metadata)
                        .bind(at)
                        .fetch_one(&mut *conn)
                        .await
                        .map_err(|e| db_error(&location, "appending a channel record", e))
                })
            })
            .await?;
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
        limit: Option<usize>,
    ) -> Result<Vec<ChannelRecord>, StoreError> {
        let db = self.0.agent(agent).await?;
        // The most recent `limit` records, returned oldest first; -1 is "no limit" to SQLite.
        let limit = limit.map_or(-1, |l| i64::try_from(l).unwrap_or(i64::MAX));
        let rows = sqlx::query(
            "SELECT seq, channel_id, kind, author, content, metadata, at FROM ( \
                 SELECT seq, channel_id, kind, author, content, metadata, at FROM channel_records \
                 WHERE channel_id = ? ORDER BY seq DESC LIMIT ? \
             ) ORDER BY seq ASC",
        )
        .bind(channel.as_str())
        .bind(limit)
        .fetch_all(&mut *db.read("taking a reader connection").await?)
        .await
        .map_err(|e| db_error(&db.location, "reading a channel history", e))?;
        rows.iter()
            .map(|r| decode(&db.location, agent, r))
            .collect()
    }

    async fn ensure_channel(&self, agent: &AgentId, channel: &ChannelId) -> Result<(), StoreError> {
        let db = self.0.agent(agent).await?;
        let (channel, location) = (channel.as_str().to_string(), db.location.clone());
        db.writes
            .run(move |conn| {
                Box::pin(async move {
                    sqlx::query("INSERT OR IGNORE INTO channels (id) VALUES (?)")
                        .bind(channel)
                        .execute(&mut *conn)
                        .await
                        .map_err(|e| db_error(&location, "registering a channel", e))?;
                    Ok(())
                })
            })
            .await
    }

    async fn channels(&self, agent: &AgentId) -> Result<Vec<ChannelId>, StoreError> {
        let db = self.0.agent(agent).await?;
        let ids: Vec<String> = sqlx::query_scalar("SELECT id FROM channels ORDER BY id")
            .fetch_all(&mut *db.read("taking a reader connection").await?)
            .await
            .map_err(|e| db_error(&db.location, "listing channels", e))?;
        Ok(ids.into_iter().map(ChannelId::new).collect())
    }
}
