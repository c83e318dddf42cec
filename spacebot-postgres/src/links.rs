//! [`LinkStore`]: the `agent_links` table.

use async_trait::async_trait;
use spacebot_core::{AgentId, AgentLink, InvalidInput, LinkId, LinkStore, StoreError, Timestamp};
use sqlx::postgres::PgRow;

use crate::PgStores;
use crate::codec::Reader;
use crate::error::{db_error, unique_violation};

fn decode(location: &str, row: &PgRow) -> Result<AgentLink, StoreError> {
    let r = Reader {
        row,
        location,
        what: "a link",
    };
    let bad = |column: &'static str| move |e: InvalidInput| r.bad(column, e);
    Ok(AgentLink {
        id: LinkId::new(r.text("id")?),
        from: AgentId::parse(r.get::<String>("from_agent_id")?).map_err(bad("from_agent_id"))?,
        to: AgentId::parse(r.get::<String>("to_agent_id")?).map_err(bad("to_agent_id"))?,
        direction: r
            .get::<String>("direction")?
            .parse()
            .map_err(bad("direction"))?,
        relationship: r
            .get::<String>("relationship")?
            .parse()
            .map_err(bad("relationship"))?,
        enabled: r.get("enabled")?,
        created_at: Timestamp(r.get("created_at")?),
        updated_at: Timestamp(r.get("updated_at")?),
    })
}

/// Inserts a link as given, or, when its ordered pair exists, takes every field but the id and
/// `created_at` from it. A new pair whose id another link holds violates the primary key.
const UPSERT_SQL: &str = "INSERT INTO agent_links (id, from_agent_id, to_agent_id, direction, \
     relationship, enabled, created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
     ON CONFLICT (from_agent_id, to_agent_id) DO UPDATE SET \
     direction = excluded.direction, relationship = excluded.relationship, \
     enabled = excluded.enabled, updated_at = excluded.updated_at";

/// [`LinkStore`] on the `agent_links` table. Get one from [`PgStores::links`].
#[derive(Debug, Clone)]
pub struct PgLinkStore(pub(crate) PgStores);

impl PgLinkStore {
    async fn query(&self, sql: &'static str, binds: &[&str]) -> Result<Vec<AgentLink>, StoreError> {
        let db = self.0.db()?;
        let mut query = sqlx::query(sql);
        for b in binds {
            query = query.bind(*b);
        }
        let rows = query
            .fetch_all(&db.pool)
            .await
            .map_err(|e| db_error(&db.location, "reading links", e))?;
        rows.iter().map(|r| decode(&db.location, r)).collect()
    }
}

#[async_trait]
impl LinkStore for PgLinkStore {
    async fn release(&self) {
        self.0.close().await;
    }

    async fn create(&self, link: &AgentLink) -> Result<(), StoreError> {
        let db = self.0.db()?;
        sqlx::query(
            "INSERT INTO agent_links (id, from_agent_id, to_agent_id, direction, relationship, \
             enabled, created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(link.id.as_str().as_bytes())
        .bind(link.from.as_str())
        .bind(link.to.as_str())
        .bind(link.direction.as_str())
        .bind(link.relationship.as_str())
        .bind(link.enabled)
        .bind(link.created_at.0)
        .bind(link.updated_at.0)
        .execute(&db.pool)
        .await
        .map_err(|e| {
            if unique_violation(&e).is_some() {
                StoreError::already_exists(format!(
                    "link {} ({} -> {})",
                    link.id, link.from, link.to
                ))
            } else {
                db_error(&db.location, "creating a link", e)
            }
        })?;
        Ok(())
    }

    async fn update(&self, link: &AgentLink) -> Result<(), StoreError> {
        let db = self.0.db()?;
        let done = sqlx::query(
            "UPDATE agent_links SET direction = $1, relationship = $2, enabled = $3, \
             updated_at = $4 WHERE id = $5",
        )
        .bind(link.direction.as_str())
        .bind(link.relationship.as_str())
        .bind(link.enabled)
        .bind(link.updated_at.0)
        .bind(link.id.as_str().as_bytes())
        .execute(&db.pool)
        .await
        .map_err(|e| db_error(&db.location, "updating a link", e))?;
        if done.rows_affected() == 0 {
            return Err(StoreError::not_found(format!("link {}", link.id)));
        }
        Ok(())
    }

    async fn delete(&self, id: &LinkId) -> Result<(), StoreError> {
        let db = self.0.db()?;
        let done = sqlx::query("DELETE FROM agent_links WHERE id = $1")
            .bind(id.as_str().as_bytes())
            .execute(&db.pool)
            .await
            .map_err(|e| db_error(&db.location, "deleting a link", e))?;
        if done.rows_affected() == 0 {
            return Err(StoreError::not_found(format!("link {id}")));
        }
        Ok(())
    }

    async fn get(&self, id: &LinkId) -> Result<Option<AgentLink>, StoreError> {
        let db = self.0.db()?;
        let row = sqlx::query(
            "SELECT id, from_agent_id, to_agent_id, direction, relationship, enabled, \
             created_at, updated_at FROM agent_links WHERE id = $1",
        )
        .bind(id.as_str().as_bytes())
        .fetch_optional(&db.pool)
        .await
        .map_err(|e| db_error(&db.location, "reading a link", e))?;
        row.map(|r| decode(&db.location, &r)).transpose()
    }

    async fn get_between(
        &self,
        from: &AgentId,
        to: &AgentId,
    ) -> Result<Option<AgentLink>, StoreError> {
        Ok(self
            .query(
                "SELECT id, from_agent_id, to_agent_id, direction, relationship, enabled, \
                 created_at, updated_at FROM agent_links \
                 WHERE from_agent_id = $1 AND to_agent_id = $2",
                &[from.as_str(), to.as_str()],
            )
            .await?
            .pop())
    }

    async fn links_for_agent(&self, agent: &AgentId) -> Result<Vec<AgentLink>, StoreError> {
        self.query(
            "SELECT id, from_agent_id, to_agent_id, direction, relationship, enabled, \
             created_at, updated_at FROM agent_links \
             WHERE from_agent_id = $1 OR to_agent_id = $1 \
             ORDER BY from_agent_id, to_agent_id",
            &[agent.as_str()],
        )
        .await
    }

    async fn list(&self) -> Result<Vec<AgentLink>, StoreError> {
        self.query(
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
                return Err(StoreError::Invalid(InvalidInput::new(
                    format!("links[{i}]"),
                    format!(
                        "the pair {} -> {} is already named by links[{first}]",
                        link.from, link.to
                    ),
                )));
            }
        }
        if links.is_empty() {
            return Ok(());
        }
        let db = self.0.db()?;
        let location = db.location.clone();
        // One transaction: every link or none.
        db.tx(|conn| {
            let (links, location) = (links.to_vec(), location.clone());
            Box::pin(async move {
                for link in &links {
                    sqlx::query(UPSERT_SQL)
                        .bind(link.id.as_str().as_bytes())
                        .bind(link.from.as_str())
                        .bind(link.to.as_str())
                        .bind(link.direction.as_str())
                        .bind(link.relationship.as_str())
                        .bind(link.enabled)
                        .bind(link.created_at.0)
                        .bind(link.updated_at.0)
                        .execute(&mut *conn)
                        .await
                        .map_err(|e| {
                            if unique_violation(&e).is_some() {
                                StoreError::already_exists(format!(
                                    "link {} (its id is taken by another pair than {} -> {})",
                                    link.id, link.from, link.to
                                ))
                            } else {
                                db_error(&location, "writing links", e)
                            }
                        })?;
                }
                Ok(())
            })
        })
        .await
    }
}
