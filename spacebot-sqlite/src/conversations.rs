//! [`ConversationStore`] on the instance database.

use async_trait::async_trait;
use rusqlite::types::Value;
use rusqlite::{Connection, Row, params, params_from_iter};
use spacebot_core::conversation::{ConversationFilter, Member};
use spacebot_core::{
    AgentId, ChannelId, Conversation, ConversationId, ConversationStore, InvalidInput, StoreError,
    Timestamp,
};

use crate::SqliteStores;
use crate::error::{Location, corrupt, db_error, is_unique_violation};
use crate::query;

const COLUMNS: &str = "id, mode, initiator, initiated_from, status, budget_remaining, pair_key, \
     summary, revision, created_at, updated_at";

fn decode(location: &Location, row: &Row<'_>) -> Result<Conversation, StoreError> {
    let read = |e| db_error(location, "reading a conversation", e);
    let id: String = row.get("id").map_err(read)?;
    let bad =
        |what: &str, why: String| corrupt(location, format!("conversation {id}: {what}: {why}"));
    let invalid = |what: &'static str| move |e: InvalidInput| bad(what, e.to_string());
    let mode: String = row.get("mode").map_err(read)?;
    let status: String = row.get("status").map_err(read)?;
    let budget: i64 = row.get("budget_remaining").map_err(read)?;
    let revision: i64 = row.get("revision").map_err(read)?;
    Ok(Conversation {
        id: ConversationId::new(id.clone()),
        mode: mode.parse().map_err(invalid("mode"))?,
        members: Vec::new(),
        initiator: AgentId::parse(row.get::<_, String>("initiator").map_err(read)?)
            .map_err(invalid("initiator"))?,
        initiated_from: row
            .get::<_, Option<String>>("initiated_from")
            .map_err(read)?
            .map(ChannelId::new),
        status: status.parse().map_err(invalid("status"))?,
        budget_remaining: u32::try_from(budget)
            .map_err(|_| bad("budget_remaining", format!("{budget} is out of range")))?,
        pair_key: row.get("pair_key").map_err(read)?,
        summary: row.get("summary").map_err(read)?,
        revision: u64::try_from(revision).map_err(|_| bad("revision", "negative".into()))?,
        created_at: Timestamp(row.get("created_at").map_err(read)?),
        updated_at: Timestamp(row.get("updated_at").map_err(read)?),
    })
}

fn decode_member(location: &Location, row: &Row<'_>) -> Result<(String, Member), StoreError> {
    let read = |e| db_error(location, "reading a conversation member", e);
    let conversation: String = row.get("conversation_id").map_err(read)?;
    let bad = |what: &str, why: String| {
        corrupt(
            location,
            format!("conversation {conversation} member: {what}: {why}"),
        )
    };
    let number: i64 = row.get("number").map_err(read)?;
    let role: String = row.get("role").map_err(read)?;
    let member = Member {
        agent: AgentId::parse(row.get::<_, String>("agent_id").map_err(read)?)
            .map_err(|e| bad("agent", e.to_string()))?,
        channel: ChannelId::new(row.get::<_, String>("channel_id").map_err(read)?),
        name: row.get("name").map_err(read)?,
        number: u32::try_from(number).map_err(|_| bad("number", format!("{number}")))?,
        role: role
            .parse()
            .map_err(|e: InvalidInput| bad("role", e.to_string()))?,
        open: row.get("open").map_err(read)?,
    };
    Ok((conversation, member))
}

fn to_sql(location: &Location, what: &str, v: u64) -> Result<i64, StoreError> {
    i64::try_from(v).map_err(|_| corrupt(location, format!("{what} {v} is out of range")))
}

/// Maps a unique violation while writing `c` to `AlreadyExists` (its id, or its open pair key).
fn write_error(
    location: &Location,
    c: &Conversation,
    doing: &str,
    e: rusqlite::Error,
) -> StoreError {
    if is_unique_violation(&e) {
        let what = match &c.pair_key {
            Some(key) if e.to_string().contains("pair_key") => {
                format!("open conversation with pair key {key:?}")
            }
            _ => format!("conversation {}", c.id),
        };
        StoreError::already_exists(what)
    } else {
        db_error(location, doing, e)
    }
}

fn write_members(
    conn: &Connection,
    location: &Location,
    c: &Conversation,
) -> Result<(), StoreError> {
    query::execute(
        conn,
        "DELETE FROM conversation_members WHERE conversation_id = ?",
        [c.id.as_str()],
    )
    .map_err(|e| db_error(location, "replacing conversation members", e))?;
    for m in &c.members {
        query::execute(
            conn,
            "INSERT INTO conversation_members \
             (conversation_id, number, agent_id, channel_id, name, role, open) \
             VALUES (?, ?, ?, ?, ?, ?, ?)",
            params![
                c.id.as_str(),
                i64::from(m.number),
                m.agent.as_str(),
                m.channel.as_str(),
                m.name,
                m.role.as_str(),
                m.open,
            ],
        )
        .map_err(|e| {
            if is_unique_violation(&e) {
                StoreError::Invalid(InvalidInput::new(
                    format!("conversation {}", c.id),
                    format!("two members have number {}", m.number),
                ))
            } else {
                db_error(location, "writing conversation members", e)
            }
        })?;
    }
    Ok(())
}

/// Reads the conversations selected by `filter` (appended to a `SELECT` of [`COLUMNS`], with
/// `values` for its parameters) with their members.
fn load(
    conn: &Connection,
    location: &Location,
    filter: &str,
    values: Vec<Value>,
) -> Result<Vec<Conversation>, StoreError> {
    let mut out = query::all(
        conn,
        location,
        "reading conversations",
        &format!("SELECT {COLUMNS} FROM conversations{filter}"),
        params_from_iter(values),
        |row| decode(location, row),
    )?;
    for c in &mut out {
        c.members = query::all(
            conn,
            location,
            "reading conversation members",
            "SELECT conversation_id, number, agent_id, channel_id, name, role, open \
             FROM conversation_members WHERE conversation_id = ? ORDER BY number",
            [c.id.as_str()],
            |row| decode_member(location, row).map(|(_, m)| m),
        )?;
    }
    Ok(out)
}

/// [`load`] in one read transaction: the rows and their members come from the same snapshot.
async fn read(
    stores: &SqliteStores,
    doing: &'static str,
    filter: String,
    values: Vec<Value>,
) -> Result<Vec<Conversation>, StoreError> {
    let db = stores.instance();
    let location = db.location.clone();
    db.read(doing, move |conn| {
        let snapshot = conn
            .unchecked_transaction()
            .map_err(|e| db_error(&location, doing, e))?;
        // Rolled back when dropped: nothing was written.
        load(&snapshot, &location, &filter, values)
    })
    .await
}

/// [`ConversationStore`] on the instance database. Get one from [`SqliteStores::conversations`].
#[derive(Debug, Clone)]
pub struct SqliteConversationStore(pub(crate) SqliteStores);

#[async_trait]
impl ConversationStore for SqliteConversationStore {
    async fn release(&self) {
        self.0.close().await;
    }

    async fn create(&self, c: &Conversation) -> Result<(), StoreError> {
        let db = self.0.instance();
        let location = db.location.clone();
        let c = c.clone();
        // One operation of the instance database's writer (group commit).
        db.writes
            .run(move |tx| {
                let loc = &location;
                let c = &c;
                query::execute(
                    tx,
                    "INSERT INTO conversations (id, mode, initiator, initiated_from, status, \
                     budget_remaining, pair_key, summary, revision, created_at, updated_at) \
                     VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    params![
                        c.id.as_str(),
                        c.mode.as_str(),
                        c.initiator.as_str(),
                        c.initiated_from.as_ref().map(ChannelId::as_str),
                        c.status.as_str(),
                        i64::from(c.budget_remaining),
                        c.pair_key.as_deref(),
                        c.summary.as_deref(),
                        to_sql(loc, "revision", c.revision)?,
                        c.created_at.0,
                        c.updated_at.0,
                    ],
                )
                .map_err(|e| write_error(loc, c, "creating a conversation", e))?;
                write_members(tx, loc, c)?;
                Ok(())
            })
            .await
    }

    async fn get(&self, id: &ConversationId) -> Result<Option<Conversation>, StoreError> {
        let values = vec![Value::Text(id.as_str().to_string())];
        Ok(read(
            &self.0,
            "reading a conversation",
            " WHERE id = ?".into(),
            values,
        )
        .await?
        .pop())
    }

    async fn update(
        &self,
        next: &Conversation,
        expected_revision: u64,
    ) -> Result<Conversation, StoreError> {
        let db = self.0.instance();
        let location = db.location.clone();
        let next = next.clone();
        // One operation of the instance database's writer (group commit).
        db.writes
            .run(move |tx| {
                let loc = &location;
                let next = &next;
                let current = load(
                    tx,
                    loc,
                    " WHERE id = ?",
                    vec![Value::Text(next.id.as_str().to_string())],
                )?
                .pop()
                .ok_or_else(|| StoreError::not_found(format!("conversation {}", next.id)))?;
                if current.revision != expected_revision {
                    return Err(StoreError::Conflict {
                        what: format!("conversation {}", next.id),
                        expected: format!("revision {expected_revision}"),
                        actual: format!("revision {}", current.revision),
                    });
                }
                current.check_successor(next)?;
                let mut stored = next.clone();
                stored.revision = expected_revision + 1;
                query::execute(
                    tx,
                    "UPDATE conversations SET initiated_from = ?, status = ?, \
                     budget_remaining = ?, pair_key = ?, summary = ?, revision = ?, \
                     created_at = ?, updated_at = ? WHERE id = ? AND revision = ?",
                    params![
                        stored.initiated_from.as_ref().map(ChannelId::as_str),
                        stored.status.as_str(),
                        i64::from(stored.budget_remaining),
                        stored.pair_key.as_deref(),
                        stored.summary.as_deref(),
                        to_sql(loc, "revision", stored.revision)?,
                        stored.created_at.0,
                        stored.updated_at.0,
                        stored.id.as_str(),
                        to_sql(loc, "revision", expected_revision)?,
                    ],
                )
                .map_err(|e| write_error(loc, &stored, "updating a conversation", e))?;
                write_members(tx, loc, &stored)?;
                Ok(stored)
            })
            .await
    }

    async fn find_open(&self, pair_key: &str) -> Result<Option<Conversation>, StoreError> {
        let values = vec![Value::Text(pair_key.to_string())];
        Ok(read(
            &self.0,
            "reading a conversation",
            " WHERE status = 'open' AND pair_key = ?".into(),
            values,
        )
        .await?
        .pop())
    }

    async fn list(&self, filter: &ConversationFilter) -> Result<Vec<Conversation>, StoreError> {
        let mut sql = String::from(" WHERE 1 = 1");
        let mut values = Vec::new();
        if let Some(member) = &filter.member {
            sql.push_str(
                " AND EXISTS (SELECT 1 FROM conversation_members m \
                 WHERE m.conversation_id = conversations.id AND m.agent_id = ?)",
            );
            values.push(Value::Text(member.as_str().to_string()));
        }
        if !filter.statuses.is_empty() {
            let marks = vec!["?"; filter.statuses.len()].join(", ");
            sql.push_str(&format!(" AND status IN ({marks})"));
            values.extend(
                filter
                    .statuses
                    .iter()
                    .map(|s| Value::Text(s.as_str().to_string())),
            );
        }
        sql.push_str(" ORDER BY created_at, id");
        read(&self.0, "listing conversations", sql, values).await
    }
}
