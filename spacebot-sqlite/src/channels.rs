//! [`ChannelStore`] on each agent's database.

use async_trait::async_trait;
use rusqlite::{Row, params};
use spacebot_core::channel::{ChannelRecord, HistoryText, NewRecord};
use spacebot_core::{AgentId, ChannelId, ChannelStore, RecordKind, StoreError, Timestamp};

use crate::SqliteStores;
use crate::error::{Location, corrupt, db_error, encode_error};
use crate::query;

/// Decodes a row of [`HISTORY_SQL`] (columns by position: `seq, channel_id, kind, author,
/// content, metadata, at`; a lookup by name compares strings on every value).
fn decode(
    location: &Location,
    agent: &AgentId,
    row: &Row<'_>,
) -> Result<ChannelRecord, StoreError> {
    let read = |e| db_error(location, "reading a channel record", e);
    let (seq, kind, author, content) = decode_text(location, row)?;
    let metadata: String = row.get(5).map_err(read)?;
    let metadata = if metadata == "{}" {
        serde_json::Map::new()
    } else {
        serde_json::from_str(&metadata)
            .map_err(|e| corrupt(location, format!("channel record {seq}: metadata: {e}")))?
    };
    Ok(ChannelRecord {
        seq,
        agent: agent.clone(),
        record: NewRecord {
            channel: ChannelId::new(row.get::<_, String>(1).map_err(read)?),
            kind,
            author: author.into(),
            content: content.into(),
            metadata,
            at: Timestamp(row.get(6).map_err(read)?),
        },
    })
}

/// The sequence number, kind, author and text of a row of [`HISTORY_SQL`] or
/// [`HISTORY_TEXTS_SQL`] (columns 0, 2, 3 and 4 in both).
fn decode_text(
    location: &Location,
    row: &Row<'_>,
) -> Result<(u64, RecordKind, String, String), StoreError> {
    let read = |e| db_error(location, "reading a channel record", e);
    let seq: i64 = row.get(0).map_err(read)?;
    let bad =
        |what: &str, why: String| corrupt(location, format!("channel record {seq}: {what}: {why}"));
    let kind: String = row.get(2).map_err(read)?;
    Ok((
        u64::try_from(seq).map_err(|_| bad("seq", "negative".into()))?,
        kind.parse()
            .map_err(|e: spacebot_core::InvalidInput| bad("kind", e.to_string()))?,
        row.get(3).map_err(read)?,
        row.get(4).map_err(read)?,
    ))
}

/// A row of [`HISTORY_TEXTS_SQL`] or [`TEXTS_AFTER_SQL`] as a [`HistoryText`].
fn decode_history_text(location: &Location, row: &Row<'_>) -> Result<HistoryText, StoreError> {
    let (seq, kind, author, content) = decode_text(location, row)?;
    Ok(HistoryText {
        seq,
        kind,
        author: author.into(),
        content: content.into(),
    })
}

/// The number the agent's next channel record gets.
const NEXT_SEQ_SQL: &str = "SELECT coalesce(max(seq), 0) + 1 FROM channel_records WHERE agent = ?1";

/// A channel record with the number [`NEXT_SEQ_SQL`] gave it.
const APPEND_NUMBERED_SQL: &str = "INSERT INTO channel_records \
     (agent, seq, channel_id, kind, author, content, metadata, at) \
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)";

/// A channel record numbered next, for a caller that does not need its number (no `RETURNING`,
/// which SQLite runs through a temporary table of its own, opened, paged and dropped at every
/// append).
pub(crate) const APPEND_UNNUMBERED_SQL: &str = "INSERT INTO channel_records \
     (agent, seq, channel_id, kind, author, content, metadata, at) \
     VALUES (?1, (SELECT coalesce(max(seq), 0) + 1 FROM channel_records WHERE agent = ?1), \
             ?2, ?3, ?4, ?5, ?6, ?7)";

/// The most recent `?3` records of a channel (`-1`: all of them), oldest first. The limit is
/// written `?3 + 0`: SQLite plans a bare `LIMIT ?` with the value bound at the time and marks the
/// statement to be prepared again whenever it is bound anew (every read, a whole parse of the
/// statement); an expression keeps the prepared statement valid.
pub(crate) const HISTORY_SQL: &str = "SELECT seq, channel_id, kind, author, content, metadata, at FROM ( \
     SELECT seq, channel_id, kind, author, content, metadata, at FROM channel_records \
     WHERE agent = ?1 AND channel_id = ?2 ORDER BY seq DESC LIMIT ?3 + 0 \
 ) ORDER BY seq ASC";

/// [`HISTORY_SQL`] with only what a model's input needs (`ChannelStore::history_texts`): the
/// same rows, the same positions for `seq`, `kind`, `author` and `content`, no metadata to decode.
pub(crate) const HISTORY_TEXTS_SQL: &str = "SELECT seq, NULL, kind, author, content FROM ( \
     SELECT seq, kind, author, content FROM channel_records \
     WHERE agent = ?1 AND channel_id = ?2 ORDER BY seq DESC LIMIT ?3 + 0 \
 ) ORDER BY seq ASC";

/// The newest `?4` records of a channel numbered after `?3`, newest first (the columns of
/// [`HISTORY_TEXTS_SQL`]; one seek in the `(agent, channel_id, seq)` index): what a turn that
/// kept the channel's history reads of it.
const TEXTS_AFTER_SQL: &str = "SELECT seq, NULL, kind, author, content FROM channel_records \
     WHERE agent = ?1 AND channel_id = ?2 AND seq > ?3 ORDER BY seq DESC LIMIT ?4 + 0";

/// [`ChannelStore`] on the agents' databases. Get one from [`SqliteStores::channels`].
#[derive(Debug, Clone)]
pub struct SqliteChannelStore(pub(crate) SqliteStores);

/// The most records a history read may ask for and still run on the calling thread (a turn's
/// page of its channel, `spacebot_core::context::HISTORY_PAGE`).
const SHORT_PAGE: i64 = 64;

impl SqliteChannelStore {
    /// The most recent `limit` records of `agent`'s `channel` (all of them for `None`), oldest
    /// first, read with `sql` ([`HISTORY_SQL`] or [`HISTORY_TEXTS_SQL`]) and decoded by `decode`.
    async fn read_history<T: Send + 'static>(
        &self,
        agent: &AgentId,
        channel: &ChannelId,
        limit: Option<usize>,
        sql: &'static str,
        decode: fn(&Location, &AgentId, &Row<'_>) -> Result<T, StoreError>,
    ) -> Result<Vec<T>, StoreError> {
        let db = self.0.agent(agent).await?;
        // -1 is "no limit" to SQLite.
        let limit = limit.map_or(-1, |l| i64::try_from(l).unwrap_or(i64::MAX));
        let (agent, channel, location, key) = (
            agent.clone(),
            channel.as_str().to_string(),
            db.location.clone(),
            db.key.clone(),
        );
        let read = move |conn: &rusqlite::Connection| {
            query::all(
                conn,
                &location,
                "reading a channel history",
                sql,
                params![&*key, channel, limit],
                |row| decode(&location, &agent, row),
            )
        };
        // A page (a turn's read of its channel's newest records) is a short read on the calling
        // thread when a reader connection is idle; a longer read goes to a blocking thread.
        if (0..=SHORT_PAGE).contains(&limit) {
            db.read_short("reading a channel history", read).await
        } else {
            db.read("reading a channel history", read).await
        }
    }
}

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
                // The number first, then the row with it (the writer's transaction: nothing
                // comes in between), not `RETURNING`, which costs SQLite a temporary table at
                // every append. The `channel_records_known` trigger registers the channel in
                // the same statement as the row.
                let fail = |e| db_error(&location, "appending a channel record", e);
                let seq: i64 = conn
                    .prepare_cached(NEXT_SEQ_SQL)
                    .and_then(|mut statement| statement.query_row([&*key], |r| r.get(0)))
                    .map_err(fail)?;
                query::execute(
                    conn,
                    APPEND_NUMBERED_SQL,
                    params![&*key, seq, channel, kind, author, content, metadata, at],
                )
                .map_err(fail)?;
                Ok(seq)
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
        self.read_history(agent, channel, limit, HISTORY_SQL, decode)
            .await
    }

    async fn history_texts(
        &self,
        agent: &AgentId,
        channel: &ChannelId,
        limit: Option<usize>,
    ) -> Result<Vec<HistoryText>, StoreError> {
        self.read_history(
            agent,
            channel,
            limit,
            HISTORY_TEXTS_SQL,
            |location, _, row| decode_history_text(location, row),
        )
        .await
    }

    async fn history_texts_after(
        &self,
        agent: &AgentId,
        channel: &ChannelId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<HistoryText>, StoreError> {
        let db = self.0.agent(agent).await?;
        let (channel, location, key) = (
            channel.as_str().to_string(),
            db.location.clone(),
            db.key.clone(),
        );
        let bounds = (
            i64::try_from(after).unwrap_or(i64::MAX),
            i64::try_from(limit).unwrap_or(i64::MAX),
        );
        let read = move |conn: &rusqlite::Connection| {
            query::all(
                conn,
                &location,
                "reading a channel history",
                TEXTS_AFTER_SQL,
                params![&*key, channel, bounds.0, bounds.1],
                |row| decode_history_text(&location, row),
            )
        };
        // Newest first from the index, oldest first to the caller.
        let mut texts = if bounds.1 <= SHORT_PAGE {
            db.read_short("reading a channel history", read).await?
        } else {
            db.read("reading a channel history", read).await?
        };
        texts.reverse();
        Ok(texts)
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use rusqlite::StatementStatus;

    /// Appends `n` user records (`m0`, `m1`...) to `agent`'s portal channel.
    async fn append_users(stores: &SqliteStores, agent: &AgentId, n: i64) {
        for i in 0..n {
            stores
                .channels()
                .append(
                    agent,
                    NewRecord::new(
                        ChannelId::portal(agent),
                        spacebot_core::RecordKind::User,
                        "u",
                        format!("m{i}"),
                        Timestamp(i),
                    ),
                )
                .await
                .unwrap();
        }
    }

    /// A history read does not make SQLite prepare its statement again (a `LIMIT ?` did, on every
    /// read), and it is served by the index in the order it sorts.
    #[tokio::test]
    async fn a_history_read_keeps_its_prepared_statement() {
        let stores = SqliteStores::in_memory().await.unwrap();
        let agent = AgentId::parse("w").unwrap();
        append_users(&stores, &agent, 5).await;
        let db = stores.agent(&agent).await.unwrap();
        let (key, location) = (db.key.clone(), db.location.clone());
        let channel = ChannelId::portal(&agent).as_str().to_string();
        let (reprepared, plan) = db
            .read("probing", move |conn| {
                let fail = |e| db_error(&location, "probing", e);
                let mut statement = conn.prepare(HISTORY_SQL).map_err(fail)?;
                for limit in [2_i64, 3, -1, 3] {
                    let mut rows = statement
                        .query(params![&*key, &channel, limit])
                        .map_err(fail)?;
                    let mut n = 0_i64;
                    while rows.next().map_err(fail)?.is_some() {
                        n += 1;
                    }
                    assert_eq!(n, if limit < 0 { 5 } else { limit });
                }
                let reprepared = statement.get_status(StatementStatus::RePrepare);
                let plan: Vec<String> = conn
                    .prepare(&format!("EXPLAIN QUERY PLAN {HISTORY_SQL}"))
                    .and_then(|mut s| {
                        s.query_map(params![&*key, &channel, 2], |r| r.get::<_, String>(3))?
                            .collect()
                    })
                    .map_err(fail)?;
                Ok((reprepared, plan.join("\n")))
            })
            .await
            .unwrap();
        assert_eq!(reprepared, 0, "the history statement was prepared again");
        assert!(plan.contains("channel_records_channel"), "{plan}");
    }

    /// The records after a number are read by a seek in the channel index, in its order (no
    /// sort of the rows).
    #[tokio::test]
    async fn records_after_a_number_are_one_seek_in_the_channel_index() {
        let stores = SqliteStores::in_memory().await.unwrap();
        let agent = AgentId::parse("w").unwrap();
        let db = stores.agent(&agent).await.unwrap();
        let location = db.location.clone();
        let plan = db
            .read("probing", move |conn| {
                let fail = |e| db_error(&location, "probing", e);
                let plan: Vec<String> = conn
                    .prepare(&format!("EXPLAIN QUERY PLAN {TEXTS_AFTER_SQL}"))
                    .and_then(|mut s| {
                        s.query_map(params!["w", "portal:w", 3, 64], |r| r.get::<_, String>(3))?
                            .collect()
                    })
                    .map_err(fail)?;
                Ok(plan.join("\n"))
            })
            .await
            .unwrap();
        assert!(
            plan.contains("channel_records_channel") && plan.contains("seq>?"),
            "{plan}"
        );
        assert!(!plan.contains("TEMP B-TREE"), "{plan}");
    }

    /// The thread the rows of a history read were last decoded on.
    static SEEN_ON: std::sync::Mutex<Option<std::thread::ThreadId>> = std::sync::Mutex::new(None);

    /// [`decode`], noting the thread it runs on in [`SEEN_ON`].
    fn decode_noting_thread(
        location: &Location,
        agent: &AgentId,
        row: &Row<'_>,
    ) -> Result<ChannelRecord, StoreError> {
        *SEEN_ON.lock().unwrap() = Some(std::thread::current().id());
        decode(location, agent, row)
    }

    /// A turn's page of its channel (at most 64 records) is read on the calling thread when a
    /// reader connection is idle; a longer read (the whole channel) on a blocking thread.
    #[tokio::test]
    async fn a_page_of_history_is_read_on_the_calling_thread() {
        let stores = SqliteStores::temporary().await.unwrap();
        let agent = AgentId::parse("w").unwrap();
        let channel = ChannelId::portal(&agent);
        append_users(&stores, &agent, 3).await;
        let store = stores.channels();
        let here = std::thread::current().id();
        // The first read opens a reader connection (on a blocking thread): after it, one is idle.
        let read =
            |limit| store.read_history(&agent, &channel, limit, HISTORY_SQL, decode_noting_thread);
        assert_eq!(read(None).await.unwrap().len(), 3);
        for (limit, on_caller) in [
            (Some(SHORT_PAGE as usize), true),
            (None, false),
            (Some(2), true),
        ] {
            *SEEN_ON.lock().unwrap() = None;
            let rows = read(limit).await.unwrap();
            assert!(!rows.is_empty());
            let seen = SEEN_ON.lock().unwrap().expect("rows decoded");
            assert_eq!(seen == here, on_caller, "a read of {limit:?} records");
        }
    }
}
