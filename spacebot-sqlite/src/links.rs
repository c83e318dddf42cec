//! [`LinkStore`] on the instance database.

use async_trait::async_trait;
use rusqlite::{Row, params, params_from_iter};
use spacebot_core::{AgentId, AgentLink, LinkId, LinkStore, StoreError, Timestamp};

use crate::SqliteStores;
use crate::error::{Location, corrupt, db_error, is_unique_violation};
use crate::query;

fn decode(location: &Location, row: &Row<'_>) -> Result<AgentLink, StoreError> {
    let read = |e| db_error(location, "reading a link", e);
    let text = |name: &str| row.get::<_, String>(name).map_err(read);
    let bad = |e: spacebot_core::InvalidInput| corrupt(location, format!("stored link: {e}"));
    Ok(AgentLink {
        id: LinkId::new(text("id")?),
        from: AgentId::parse(text("from_agent_id")?).map_err(bad)?,
        to: AgentId::parse(text("to_agent_id")?).map_err(bad)?,
        direction: text("direction")?.parse().map_err(bad)?,
        relationship: text("relationship")?.parse().map_err(bad)?,
        enabled: row.get("enabled").map_err(read)?,
        created_at: Timestamp(row.get("created_at").map_err(read)?),
        updated_at: Timestamp(row.get("updated_at").map_err(read)?),
    })
}

impl SqliteStores {
    async fn query_links(
        &self,
        sql: &'static str,
        binds: &[&str],
    ) -> Result<Vec<AgentLink>, StoreError> {
        let db = self.instance();
        let binds: Vec<String> = binds.iter().map(|b| (*b).to_string()).collect();
        let location = db.location.clone();
        db.read("reading links", move |conn| {
            query::all(
                conn,
                &location,
                "reading links",
                sql,
                params_from_iter(binds),
                |row| decode(&location, row),
            )
        })
        .await
    }
}

/// [`LinkStore`] on the instance database. Get one from [`SqliteStores::links`].
#[derive(Debug, Clone)]
pub struct SqliteLinkStore(pub(crate) SqliteStores);

#[async_trait]
impl LinkStore for SqliteLinkStore {
    async fn release(&self) {
        self.0.close().await;
    }

    async fn create(&self, link: &AgentLink) -> Result<(), StoreError> {
        let db = self.0.instance();
        let (link, location) = (link.clone(), db.location.clone());
        db.writes
            .run(move |conn| {
                query::execute(
                    conn,
                    "INSERT INTO agent_links (id, from_agent_id, to_agent_id, direction, \
                     relationship, enabled, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    params![
                        link.id.as_str(),
                        link.from.as_str(),
                        link.to.as_str(),
                        link.direction.as_str(),
                        link.relationship.as_str(),
                        link.enabled,
                        link.created_at.0,
                        link.updated_at.0,
                    ],
                )
                .map_err(|e| {
                    if is_unique_violation(&e) {
                        StoreError::already_exists(format!(
                            "link {} ({} -> {})",
                            link.id, link.from, link.to
                        ))
                    } else {
                        db_error(&location, "creating a link", e)
                    }
                })?;
                Ok(())
            })
            .await
    }

    async fn update(&self, link: &AgentLink) -> Result<(), StoreError> {
        let db = self.0.instance();
        let (link, location) = (link.clone(), db.location.clone());
        db.writes
            .run(move |conn| {
                let done = query::execute(
                    conn,
                    "UPDATE agent_links SET direction = ?, relationship = ?, enabled = ?, \
                     updated_at = ? WHERE id = ?",
                    params![
                        link.direction.as_str(),
                        link.relationship.as_str(),
                        link.enabled,
                        link.updated_at.0,
                        link.id.as_str(),
                    ],
                )
                .map_err(|e| db_error(&location, "updating a link", e))?;
                if done == 0 {
                    return Err(StoreError::not_found(format!("link {}", link.id)));
                }
                Ok(())
            })
            .await
    }

    async fn delete(&self, id: &LinkId) -> Result<(), StoreError> {
        let db = self.0.instance();
        let (id, location) = (id.clone(), db.location.clone());
        db.writes
            .run(move |conn| {
                let done =
                    query::execute(conn, "DELETE FROM agent_links WHERE id = ?", [id.as_str()])
                        .map_err(|e| db_error(&location, "deleting a link", e))?;
                if done == 0 {
                    return Err(StoreError::not_found(format!("link {id}")));
                }
                Ok(())
            })
            .await
    }

    async fn get(&self, id: &LinkId) -> Result<Option<AgentLink>, StoreError> {
        Ok(self
            .0
            .query_links(
                "SELECT id, from_agent_id, to_agent_id, direction, relationship, enabled, \
                 created_at, updated_at FROM agent_links WHERE id = ?",
                &[id.as_str()],
            )
            .await?
            .pop())
    }

    async fn get_between(
        &self,
        from: &AgentId,
        to: &AgentId,
    ) -> Result<Option<AgentLink>, StoreError> {
        Ok(self
            .0
            .query_links(
                "SELECT id, from_agent_id, to_agent_id, direction, relationship, enabled, \
                 created_at, updated_at FROM agent_links \
                 WHERE from_agent_id = ? AND to_agent_id = ?",
                &[from.as_str(), to.as_str()],
            )
            .await?
            .pop())
    }

    async fn links_for_agent(&self, agent: &AgentId) -> Result<Vec<AgentLink>, StoreError> {
        self.0
            .query_links(
                "SELECT id, from_agent_id, to_agent_id, direction, relationship, enabled, \
             created_at, updated_at FROM agent_links \
             WHERE from_agent_id = ?1 OR to_agent_id = ?1 \
             ORDER BY from_agent_id, to_agent_id",
                &[agent.as_str()],
            )
            .await
    }

    async fn list(&self) -> Result<Vec<AgentLink>, StoreError> {
        self.0
            .query_links(
                "SELECT id, from_agent_id, to_agent_id, direction, relationship, enabled, \
             created_at, updated_at FROM agent_links ORDER BY from_agent_id, to_agent_id",
                &[],
            )
            .await
    }

    async fn upsert_all(&self, links: &[AgentLink]) -> Result<(), StoreError> {
        let mut pairs = std::collections::HashMap::with_capacity(links.len());
        for (i, link) in links.iter().enumerate() {
            if let Some(first) = pairs.insert((&link.from, &link.to), i) {
                return Err(StoreError::Invalid(spacebot_core::InvalidInput::new(
                    format!("links[{i}]"),
                    format!(
                        "the pair {} -> {} is already named by links[{first}]",
                        link.from, link.to
                    ),
                )));
            }
        }
        let db = self.0.instance();
        let (links, location) = (links.to_vec(), db.location.clone());
        // One operation of the writer: its savepoint makes the whole list atomic.
        db.writes
            .run(move |conn| {
                let fail = |doing: &str, e| db_error(&location, doing, e);
                for link in &links {
                    query::execute(
                        conn,
                        "INSERT INTO agent_links (id, from_agent_id, to_agent_id, direction, \
                         relationship, enabled, created_at, updated_at) \
                         VALUES (?, ?, ?, ?, ?, ?, ?, ?) \
                         ON CONFLICT (from_agent_id, to_agent_id) DO UPDATE SET \
                         direction = excluded.direction, relationship = excluded.relationship, \
                         enabled = excluded.enabled, updated_at = excluded.updated_at",
                        params![
                            link.id.as_str(),
                            link.from.as_str(),
                            link.to.as_str(),
                            link.direction.as_str(),
                            link.relationship.as_str(),
                            link.enabled,
                            link.created_at.0,
                            link.updated_at.0,
                        ],
                    )
                    .map_err(|e| {
                        if is_unique_violation(&e) {
                            StoreError::already_exists(format!(
                                "link {} (its id is taken by another pair than {} -> {})",
                                link.id, link.from, link.to
                            ))
                        } else {
                            fail("writing links", e)
                        }
                    })?;
                }
                Ok(())
            })
            .await
    }
}
