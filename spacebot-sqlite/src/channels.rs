//! [`ChannelStore`] on each agent's database.

use async_trait::async_trait;
use rusqlite::{Row, params};
use spacebot_core::channel::{ChannelRecord, NewRecord};
use spacebot_core::{AgentId, ChannelId, ChannelStore, StoreError, Timestamp};

use crate::SqliteStores;
use crate::error::{Location, corrupt, db_error, encode_error};
use crate::query;

fn decode(
    location: &Location,
    agent: &AgentId,
    row: &Row<'_>,
) -> Result<ChannelRecord, StoreError> {
    let read = |e| db_error(location, "reading a channel record", e);
    let seq: i64 = row.get("seq").map_err(read)?;
    let bad =
        |what: &str, why: String| corrupt(location, format!("channel record {seq}: {what}: {why}"));
    let kind: String = row.get("kind").map_err(read)?;
    let metadata: String = row.get("metadata").map_err(read)?;
    Ok(ChannelRecord {
        seq: u64::try_from(seq).map_err(|_| bad("seq", "negative".into()))?,
        agent: agent.clone(),
        record: NewRecord {
            channel: ChannelId::new(row.get::<_, String>("channel_id").map_err(read)?),
            kind: kind
                .parse()
                .map_err(|e: spacebot_core::InvalidInput| bad("kind", e.to_string()))?,
            author: row.get::<_, String>("author").map_err(read)?.into(),
            content: row.get::<_, String>("content").map_err(read)?.into(),
            metadata: serde_json::from_str(&metadata)
                .map_err(|e| bad("metadata", e.to_string()))?,
            at: Timestamp(row.get("at").map_err(read)?),
        },
    })
}

/// Appends one record (`?1` is the agent) and returns its sequence number, the agent's next,
/// allocated by the same statement under the write lock; the `channel_records_known` trigger
/// registers the channel in the same statement.
pub(crate) const APPEND_SQL: &str = "INSERT INTO channel_records \
     (agent, seq, channel_id, kind, author, content, metadata, at) \
     VALUES (?1, (SELECT coalesce(max(seq), 0) + 1 FROM channel_records WHERE agent = ?1), \
             ?2, ?3, ?4, ?5, ?6, ?7) RETURNING seq";

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
        let (location, key) = (db.location.clone(), db.key.clone());
        let seq: i64 = db
            .writes
            .run(move |conn| {
                // The `channel_records_known` trigger registers the channel in the same
                // statement.
                conn.prepare_cached(APPEND_SQL)
                    .and_then(|mut statement| {
                        statement.query_row(
                            params![&*key, channel, kind, author, content, metadata, at],
                            |r| r.get(0),
                        )
                    })
                    .map_err(|e| db_error(&location, "appending a channel record", e))
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
        let (agent, channel, location, key) = (
            agent.clone(),
            channel.as_str().to_string(),
            db.location.clone(),
            db.key.clone(),
        );
        db.read("reading a channel history", move |conn| {
            query::all(
                conn,
                &location,
                "reading a channel history",
                "SELECT seq, channel_id, kind, author, content, metadata, at FROM ( \
                     SELECT seq, channel_id, kind, author, content, metadata, at FROM channel_records \
                     WHERE agent = ? AND channel_id = ? ORDER BY seq DESC LIMIT ? \
                 ) ORDER BY seq ASC",
                params![&*key, channel, limit],
                |row| decode(&location, &agent, row),
            )
        })
        .await
    }

    async fn ensure_channel(&self, agent: &AgentId, channel: &ChannelId) -> Result<(), StoreError> {
        let db = self.0.agent(agent).await?;
        let (channel, location, key) = (
            channel.as_str().to_string(),
            db.location.clone(),
            db.key.clone(),
        );
        db.writes
            .run(move |conn| {
                query::execute(
                    conn,
                    "INSERT OR IGNORE INTO channels (agent, id) VALUES (?, ?)",
                    params![&*key, channel],
                )
                .map_err(|e| db_error(&location, "registering a channel", e))?;
                Ok(())
            })
            .await
    }

    async fn channels(&self, agent: &AgentId) -> Result<Vec<ChannelId>, StoreError> {
        let db = self.0.agent(agent).await?;
        let (location, key) = (db.location.clone(), db.key.clone());
        db.read("listing channels", move |conn| {
            query::all(
                conn,
                &location,
                "listing channels",
                "SELECT id FROM channels WHERE agent = ? ORDER BY id",
                [&*key],
                |row| {
                    query::get::<String>(&location, "listing channels", row, "id")
                        .map(ChannelId::new)
                },
            )
        })
        .await
    }
}
