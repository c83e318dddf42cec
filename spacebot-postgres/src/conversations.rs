//! [`ConversationStore`]: the `conversations` and `conversation_members` tables.

use async_trait::async_trait;
use spacebot_core::conversation::{ConversationFilter, Member};
use spacebot_core::{
    AgentId, ChannelId, Conversation, ConversationId, ConversationStore, InvalidInput, StoreError,
    Timestamp,
};
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Postgres, QueryBuilder};

use crate::PgStores;
use crate::codec::{Reader, to_sql_or};
use crate::error::{db_error, unique_violation};

/// Conversations with their members, one row per member (a conversation without members has one
/// row of NULL member columns), in `(created_at, id, member number)` order. The filter is added
/// after `WHERE TRUE`, then [`ORDER`].
const SELECT: &str = "SELECT c.id, c.mode, c.initiator, c.initiated_from, c.status, \
     c.budget_remaining, c.pair_key, c.summary, c.revision, c.created_at, c.updated_at, \
     m.number AS m_number, m.agent_id AS m_agent, m.channel_id AS m_channel, m.name AS m_name, \
     m.role AS m_role, m.open AS m_open \
     FROM conversations c LEFT JOIN conversation_members m ON m.conversation_id = c.id \
     WHERE TRUE";

const ORDER: &str = " ORDER BY c.created_at, c.id, m.number";

/// Unique index of open pair keys (a second open conversation with one key violates it).
const OPEN_PAIR_INDEX: &str = "conversations_open_pair";

fn decode(location: &str, row: &PgRow) -> Result<Conversation, StoreError> {
    let id = Reader {
        row,
        location,
        what: "a conversation",
    }
    .text("id")?;
    let what = format!("conversation {id}");
    let r = Reader {
        row,
        location,
        what: &what,
    };
    let invalid = |column: &'static str| move |e: InvalidInput| r.bad(column, e);
    Ok(Conversation {
        id: ConversationId::new(id.clone()),
        mode: r.get::<String>("mode")?.parse().map_err(invalid("mode"))?,
        members: Vec::new(),
        initiator: AgentId::parse(r.get::<String>("initiator")?).map_err(invalid("initiator"))?,
        initiated_from: r.opt_text("initiated_from")?.map(ChannelId::new),
        status: r
            .get::<String>("status")?
            .parse()
            .map_err(invalid("status"))?,
        budget_remaining: r.u32("budget_remaining")?,
        pair_key: r.opt_text("pair_key")?,
        summary: r.opt_text("summary")?,
        revision: r.u64("revision")?,
        created_at: Timestamp(r.get("created_at")?),
        updated_at: Timestamp(r.get("updated_at")?),
    })
}

/// The member on this row, if the conversation has any.
fn decode_member(
    location: &str,
    id: &ConversationId,
    row: &PgRow,
) -> Result<Option<Member>, StoreError> {
    let what = format!("conversation {id} member");
    let r = Reader {
        row,
        location,
        what: &what,
    };
    let number: Option<i64> = r.get("m_number")?;
    let Some(number) = number else {
        return Ok(None);
    };
    let agent: String = r.get("m_agent")?;
    let role: String = r.get("m_role")?;
    let channel: Vec<u8> = r.get("m_channel")?;
    let name: Vec<u8> = r.get("m_name")?;
    let utf8 = |column: &'static str, bytes: Vec<u8>| {
        String::from_utf8(bytes).map_err(|e| r.bad(column, format!("not UTF-8: {e}")))
    };
    Ok(Some(Member {
        agent: AgentId::parse(agent).map_err(|e| r.bad("agent_id", e))?,
        channel: ChannelId::new(utf8("channel_id", channel)?),
        name: utf8("name", name)?,
        number: u32::try_from(number).map_err(|_| r.bad("number", number))?,
        role: role.parse().map_err(|e: InvalidInput| r.bad("role", e))?,
        open: r.get("m_open")?,
    }))
}

/// Runs `q` (built on [`SELECT`], ordered by [`ORDER`]) and groups its rows into conversations.
async fn load<'e, E>(
    executor: E,
    location: &str,
    mut q: QueryBuilder<Postgres>,
) -> Result<Vec<Conversation>, StoreError>
where
    E: sqlx::PgExecutor<'e>,
{
    q.push(ORDER);
    let rows = q
        .build()
        .fetch_all(executor)
        .await
        .map_err(|e| db_error(location, "reading conversations", e))?;
    let mut out: Vec<Conversation> = Vec::new();
    for row in &rows {
        let id = Reader {
            row,
            location,
            what: "a conversation",
        }
        .text("id")?;
        let same = out.last().is_some_and(|c| c.id.as_str() == id);
        if !same {
            out.push(decode(location, row)?);
        }
        if let Some(c) = out.last_mut()
            && let Some(member) = decode_member(location, &c.id, row)?
        {
            c.members.push(member);
        }
    }
    Ok(out)
}

fn select() -> QueryBuilder<Postgres> {
    QueryBuilder::new(SELECT)
}

/// Maps a unique violation while writing `c` to `AlreadyExists` (its id, or its open pair key).
fn write_error(location: &str, c: &Conversation, doing: &str, e: sqlx::Error) -> StoreError {
    match unique_violation(&e) {
        Some(Some(OPEN_PAIR_INDEX)) => StoreError::already_exists(format!(
            "open conversation with pair key {:?}",
            c.pair_key.as_deref().unwrap_or_default()
        )),
        Some(_) => StoreError::already_exists(format!("conversation {}", c.id)),
        None => db_error(location, doing, e),
    }
}

async fn write_members(
    conn: &mut PgConnection,
    location: &str,
    c: &Conversation,
) -> Result<(), StoreError> {
    sqlx::query("DELETE FROM conversation_members WHERE conversation_id = $1")
        .bind(c.id.as_str().as_bytes())
        .execute(&mut *conn)
        .await
        .map_err(|e| db_error(location, "replacing conversation members", e))?;
    for m in &c.members {
        sqlx::query(
            "INSERT INTO conversation_members \
             (conversation_id, number, agent_id, channel_id, name, role, open) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(c.id.as_str().as_bytes())
        .bind(i64::from(m.number))
        .bind(m.agent.as_str())
        .bind(m.channel.as_str().as_bytes())
        .bind(m.name.as_bytes())
        .bind(m.role.as_str())
        .bind(m.open)
        .execute(&mut *conn)
        .await
        .map_err(|e| {
            if unique_violation(&e).is_some() {
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

/// [`ConversationStore`] on the `conversations` and `conversation_members` tables. Get one from
/// [`PgStores::conversations`].
///
/// An update locks the conversation's row (`FOR UPDATE`) and compares revisions in the same
/// transaction; the unique index over the pair key of open conversations leaves one open
/// conversation per key, whichever process creates it.
#[derive(Debug, Clone)]
pub struct PgConversationStore(pub(crate) PgStores);

#[async_trait]
impl ConversationStore for PgConversationStore {
    async fn release(&self) {
        self.0.close().await;
    }

    async fn create(&self, c: &Conversation) -> Result<(), StoreError> {
        let db = self.0.db()?;
        let location = db.location.clone();
        db.tx(|conn| {
            let (c, location) = (c.clone(), location.clone());
            Box::pin(async move {
                let loc = &*location;
                sqlx::query(
                    "INSERT INTO conversations (id, mode, initiator, initiated_from, status, \
                     budget_remaining, pair_key, summary, revision, created_at, updated_at) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
                )
                .bind(c.id.as_str().as_bytes())
                .bind(c.mode.as_str())
                .bind(c.initiator.as_str())
                .bind(c.initiated_from.as_ref().map(|ch| ch.as_str().as_bytes()))
                .bind(c.status.as_str())
                .bind(i64::from(c.budget_remaining))
                .bind(c.pair_key.as_deref().map(str::as_bytes))
                .bind(c.summary.as_deref().map(str::as_bytes))
                .bind(to_sql_or(loc, "conversation revision", c.revision)?)
                .bind(c.created_at.0)
                .bind(c.updated_at.0)
                .execute(&mut *conn)
                .await
                .map_err(|e| write_error(loc, &c, "creating a conversation", e))?;
                write_members(conn, loc, &c).await?;
                Ok(())
            })
        })
        .await
    }

    async fn get(&self, id: &ConversationId) -> Result<Option<Conversation>, StoreError> {
        let db = self.0.db()?;
        let mut q = select();
        q.push(" AND c.id = ")
            .push_bind(id.as_str().as_bytes().to_vec());
        // One statement: the conversation and its members come from one snapshot.
        Ok(load(&db.pool, &db.location, q).await?.pop())
    }

    async fn update(
        &self,
        next: &Conversation,
        expected_revision: u64,
    ) -> Result<Conversation, StoreError> {
        let db = self.0.db()?;
        let location = db.location.clone();
        db.tx(|conn| {
            let (next, location) = (next.clone(), location.clone());
            Box::pin(async move {
                let loc = &*location;
                // Lock the row: a concurrent update waits, then sees the new revision.
                let locked: Option<i64> = sqlx::query_scalar(
                    "SELECT revision FROM conversations WHERE id = $1 FOR UPDATE",
                )
                .bind(next.id.as_str().as_bytes())
                .fetch_optional(&mut *conn)
                .await
                .map_err(|e| db_error(loc, "locking a conversation", e))?;
                if locked.is_none() {
                    return Err(StoreError::not_found(format!("conversation {}", next.id)));
                }
                let mut q = select();
                q.push(" AND c.id = ")
                    .push_bind(next.id.as_str().as_bytes().to_vec());
                let current = load(&mut *conn, loc, q)
                    .await?
                    .pop()
                    .ok_or_else(|| StoreError::not_found(format!("conversation {}", next.id)))?;
                if current.revision != expected_revision {
                    return Err(StoreError::Conflict {
                        what: format!("conversation {}", next.id),
                        expected: format!("revision {expected_revision}"),
                        actual: format!("revision {}", current.revision),
                    });
                }
                current.check_successor(&next)?;
                let mut stored = next;
                stored.revision = expected_revision.saturating_add(1);
                sqlx::query(
                    "UPDATE conversations SET initiated_from = $1, status = $2, \
                     budget_remaining = $3, pair_key = $4, summary = $5, revision = $6, \
                     created_at = $7, updated_at = $8 WHERE id = $9 AND revision = $10",
                )
                .bind(
                    stored
                        .initiated_from
                        .as_ref()
                        .map(|ch| ch.as_str().as_bytes()),
                )
                .bind(stored.status.as_str())
                .bind(i64::from(stored.budget_remaining))
                .bind(stored.pair_key.as_deref().map(str::as_bytes))
                .bind(stored.summary.as_deref().map(str::as_bytes))
                .bind(to_sql_or(loc, "conversation revision", stored.revision)?)
                .bind(stored.created_at.0)
                .bind(stored.updated_at.0)
                .bind(stored.id.as_str().as_bytes())
                .bind(to_sql_or(loc, "conversation revision", expected_revision)?)
                .execute(&mut *conn)
                .await
                .map_err(|e| write_error(loc, &stored, "updating a conversation", e))?;
                write_members(conn, loc, &stored).await?;
                Ok(stored)
            })
        })
        .await
    }

    async fn find_open(&self, pair_key: &str) -> Result<Option<Conversation>, StoreError> {
        let db = self.0.db()?;
        let mut q = select();
        q.push(" AND c.status = 'open' AND c.pair_key = ")
            .push_bind(pair_key.as_bytes().to_vec());
        Ok(load(&db.pool, &db.location, q).await?.pop())
    }

    async fn list(&self, filter: &ConversationFilter) -> Result<Vec<Conversation>, StoreError> {
        let db = self.0.db()?;
        let mut q = select();
        if let Some(member) = &filter.member {
            q.push(
                " AND EXISTS (SELECT 1 FROM conversation_members x \
                 WHERE x.conversation_id = c.id AND x.agent_id = ",
            )
            .push_bind(member.as_str().to_string())
            .push(")");
        }
        if !filter.statuses.is_empty() {
            let statuses: Vec<String> = filter
                .statuses
                .iter()
                .map(|s| s.as_str().to_string())
                .collect();
            q.push(" AND c.status = ANY(").push_bind(statuses).push(")");
        }
        load(&db.pool, &db.location, q).await
    }
}
