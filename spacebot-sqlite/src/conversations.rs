//! [`ConversationStore`] on the instance database.

use async_trait::async_trait;
use spacebot_core::conversation::{ConversationFilter, Member};
use spacebot_core::{
    AgentId, ChannelId, Conversation, ConversationId, ConversationStore, InvalidInput, StoreError,
    Timestamp,
};
use sqlx::sqlite::SqliteRow;
use sqlx::{QueryBuilder, Row, Sqlite, SqliteConnection};

use crate::SqliteStores;
use crate::error::{Location, corrupt, db_error, is_unique_violation};

const COLUMNS: &str = "id, mode, initiator, initiated_from, status, budget_remaining, pair_key, \
     summary, revision, created_at, updated_at";

fn decode(location: &Location, row: &SqliteRow) -> Result<Conversation, StoreError> {
    let read = |e| db_error(location, "reading a conversation", e);
    let id: String = row.try_get("id").map_err(read)?;
    let bad =
        |what: &str, why: String| corrupt(location, format!("conversation {id}: {what}: {why}"));
    let invalid = |what: &'static str| move |e: InvalidInput| bad(what, e.to_string());
    let mode: String = row.try_get("mode").map_err(read)?;
    let status: String = row.try_get("status").map_err(read)?;
    let budget: i64 = row.try_get("budget_remaining").map_err(read)?;
    let revision: i64 = row.try_get("revision").map_err(read)?;
    Ok(Conversation {
        id: ConversationId::new(id.clone()),
        mode: mode.parse().map_err(invalid("mode"))?,
        members: Vec::new(),
        initiator: AgentId::parse(row.try_get::<String, _>("initiator").map_err(read)?)
            .map_err(invalid("initiator"))?,
        initiated_from: row
            .try_get::<Option<String>, _>("initiated_from")
            .map_err(read)?
            .map(ChannelId::new),
        status: status.parse().map_err(invalid("status"))?,
        budget_remaining: u32::try_from(budget)
            .map_err(|_| bad("budget_remaining", format!("{budget} is out of range")))?,
        pair_key: row.try_get("pair_key").map_err(read)?,
        summary: row.try_get("summary").map_err(read)?,
        revision: u64::try_from(revision).map_err(|_| bad("revision", "negative".into()))?,
        created_at: Timestamp(row.try_get("created_at").map_err(read)?),
        updated_at: Timestamp(row.try_get("updated_at").map_err(read)?),
    })
}

fn decode_member(location: &Location, row: &SqliteRow) -> Result<(String, Member), StoreError> {
    let read = |e| db_error(location, "reading a conversation member", e);
    let conversation: String = row.try_get("conversation_id").map_err(read)?;
    let bad = |what: &str, why: String| {
        corrupt(
            location,
            format!("conversation {conversation} member: {what}: {why}"),
        )
    };
    let number: i64 = row.try_get("number").map_err(read)?;
    let role: String = row.try_get("role").map_err(read)?;
    let member = Member {
        agent: AgentId::parse(row.try_get::<String, _>("agent_id").map_err(read)?)
            .map_err(|e| bad("agent", e.to_string()))?,
        channel: ChannelId::new(row.try_get::<String, _>("channel_id").map_err(read)?),
        name: row.try_get("name").map_err(read)?,
        number: u32::try_from(number).map_err(|_| bad("number", format!("{number}")))?,
        role: role
            .parse()
            .map_err(|e: InvalidInput| bad("role", e.to_string()))?,
        open: row.try_get("open").map_err(read)?,
    };
    Ok((conversation, member))
}

fn to_sql(location: &Location, what: &str, v: u64) -> Result<i64, StoreError> {
    i64::try_from(v).map_err(|_| corrupt(location, format!("{what} {v} is out of range")))
}

/// Maps a unique violation while writing `c` to `AlreadyExists` (its id, or its open pair key).
fn write_error(location: &Location, c: &Conversation, doing: &str, e: sqlx::Error) -> StoreError {
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

async fn write_members(
    conn: &mut SqliteConnection,
    location: &Location,
    c: &Conversation,
) -> Result<(), StoreError> {
    sqlx::query("DELETE FROM conversation_members WHERE conversation_id = ?")
        .bind(c.id.as_str())
        .execute(&mut *conn)
        .await
        .map_err(|e| db_error(location, "replacing conversation members", e))?;
    for m in &c.members {
        sqlx::query(
            "INSERT INTO conversation_members \
             (conversation_id, number, agent_id, channel_id, name, role, open) \
             VALUES (?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(c.id.as_str())
        .bind(i64::from(m.number))
        .bind(m.agent.as_str())
        .bind(m.channel.as_str())
        .bind(&m.name)
        .bind(m.role.as_str())
        .bind(m.open)
        .execute(&mut *conn)
        .await
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

/// Reads the conversations selected by `q` (which must select [`COLUMNS`]) with their members.
async fn load(
    conn: &mut SqliteConnection,
    location: &Location,
    mut q: QueryBuilder<Sqlite>,
) -> Result<Vec<Conversation>, StoreError> {
    let rows = q
        .build()
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| db_error(location, "reading conversations", e))?;
    let mut out = Vec::with_capacity(rows.len());
    for row in &rows {
        let mut c = decode(location, row)?;
        let members = sqlx::query(
            "SELECT conversation_id, number, agent_id, channel_id, name, role, open \
             FROM conversation_members WHERE conversation_id = ? ORDER BY number",
        )
        .bind(c.id.as_str())
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| db_error(location, "reading conversation members", e))?;
        c.members = members
            .iter()
            .map(|r| decode_member(location, r).map(|(_, m)| m))
            .collect::<Result<_, _>>()?;
        out.push(c);
    }
    Ok(out)
}

fn select() -> QueryBuilder<Sqlite> {
    let mut q = QueryBuilder::new("SELECT ");
    q.push(COLUMNS).push(" FROM conversations");
    q
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
                Box::pin(async move {
                    let loc = &location;
                    let c = &c;
                    sqlx::query(
                        "INSERT INTO conversations (id, mode, initiator, initiated_from, status, \
             budget_remaining, pair_key, summary, revision, created_at, updated_at) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    )
                    .bind(c.id.as_str())
                    .bind(c.mode.as_str())
                    .bind(c.initiator.as_str())
                    .bind(c.initiated_from.as_ref().map(ChannelId::as_str))
                    .bind(c.status.as_str())
                    .bind(i64::from(c.budget_remaining))
                    .bind(c.pair_key.as_deref())
                    .bind(c.summary.as_deref())
                    .bind(to_sql(loc, "revision", c.revision)?)
                    .bind(c.created_at.0)
                    .bind(c.updated_at.0)
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| write_error(loc, c, "creating a conversation", e))?;
                    write_members(tx, loc, c).await?;
                    Ok(())
                })
            })
            .await
    }

    async fn get(&self, id: &ConversationId) -> Result<Option<Conversation>, StoreError> {
        let db = self.0.instance();
        // One read transaction: the rows and their members come from the same snapshot.
        let mut reader = db.read("reading a conversation").await?;
        let mut conn = sqlx::Connection::begin(&mut *reader)
            .await
            .map_err(|e| db_error(&db.location, "reading a conversation", e))?;
        let mut q = select();
        q.push(" WHERE id = ").push_bind(id.as_str());
        Ok(load(&mut conn, &db.location, q).await?.pop())
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
                Box::pin(async move {
                    let loc = &location;
                    let next = &next;
                    let mut q = select();
                    q.push(" WHERE id = ").push_bind(next.id.as_str());
                    let current = load(tx, loc, q).await?.pop().ok_or_else(|| {
                        StoreError::not_found(format!("conversation {}", next.id))
                    })?;
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
                    sqlx::query(
            "UPDATE conversations SET initiated_from = ?, status = ?, budget_remaining = ?, \
             pair_key = ?, summary = ?, revision = ?, created_at = ?, updated_at = ? \
             WHERE id = ? AND revision = ?",
        )
        .bind(stored.initiated_from.as_ref().map(ChannelId::as_str))
        .bind(stored.status.as_str())
        .bind(i64::from(stored.budget_remaining))
        .bind(stored.pair_key.as_deref())
        .bind(stored.summary.as_deref())
        .bind(to_sql(loc, "revision", stored.revision)?)
        .bind(stored.created_at.0)
        .bind(stored.updated_at.0)
        .bind(stored.id.as_str())
        .bind(to_sql(loc, "revision", expected_revision)?)
        .execute(&mut *tx)
        .await
        .map_err(|e| write_error(loc, &stored, "updating a conversation", e))?;
                    write_members(tx, loc, &stored).await?;
                    Ok(stored)
                })
            })
            .await
    }

    async fn find_open(&self, pair_key: &str) -> Result<Option<Conversation>, StoreError> {
        let db = self.0.instance();
        // One read transaction: the rows and their members come from the same snapshot.
        let mut reader = db.read("reading a conversation").await?;
        let mut conn = sqlx::Connection::begin(&mut *reader)
            .await
            .map_err(|e| db_error(&db.location, "reading a conversation", e))?;
        let mut q = select();
        q.push(" WHERE status = 'open' AND pair_key = ")
            .push_bind(pair_key.to_string());
        Ok(load(&mut conn, &db.location, q).await?.pop())
    }

    async fn list(&self, filter: &ConversationFilter) -> Result<Vec<Conversation>, StoreError> {
        let db = self.0.instance();
        // One read transaction: the rows and their members come from the same snapshot.
        let mut reader = db.read("listing conversations").await?;
        let mut conn = sqlx::Connection::begin(&mut *reader)
            .await
            .map_err(|e| db_error(&db.location, "listing conversations", e))?;
        let mut q = select();
        q.push(" WHERE 1 = 1");
        if let Some(member) = &filter.member {
            q.push(
                " AND EXISTS (SELECT 1 FROM conversation_members m \
                 WHERE m.conversation_id = conversations.id AND m.agent_id = ",
            )
            .push_bind(member.as_str().to_string())
            .push(")");
        }
        if !filter.statuses.is_empty() {
            q.push(" AND status IN (");
            let mut list = q.separated(", ");
            for s in &filter.statuses {
                list.push_bind(s.as_str());
            }
            q.push(")");
        }
        q.push(" ORDER BY created_at, id");
        load(&mut conn, &db.location, q).await
    }
}
