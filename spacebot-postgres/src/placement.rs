//! [`PgPlacement`]: the placement table of the schema (`agent_placement`) and wake-up hints over
//! `LISTEN`/`NOTIFY`.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::{self, BoxStream, StreamExt};
use spacebot_core::placement::{Placement, PlacementLease, ProcessId};
use spacebot_core::{AgentId, StoreError, Timestamp};
use sqlx::Row;
use sqlx::postgres::{PgListener, PgPool, PgPoolOptions, PgRow};

use crate::PgStores;
use crate::db::Db;
use crate::error::{corrupt, db_error};

/// One atomic statement: inserts a lease for a free agent, or takes over the row when `process`
/// holds it already (a renewal: same epoch, the later expiry) or its lease has expired at `now`
/// (a change of hands: epoch + 1). Returns nothing when another process holds a live lease.
pub(crate) const ACQUIRE_SQL: &str = "\
INSERT INTO agent_placement AS p (agent_id, process, expires_at, epoch) VALUES ($1, $2, $3, 1) \
ON CONFLICT (agent_id) DO UPDATE SET \
    process = EXCLUDED.process, \
    expires_at = CASE WHEN p.process = EXCLUDED.process AND p.expires_at > $4 \
        THEN GREATEST(p.expires_at, EXCLUDED.expires_at) ELSE EXCLUDED.expires_at END, \
    epoch = CASE WHEN p.process = EXCLUDED.process AND p.expires_at > $4 \
        THEN p.epoch ELSE p.epoch + 1 END \
WHERE p.process = EXCLUDED.process OR p.expires_at <= $4 \
RETURNING agent_id, process, expires_at, epoch";

/// One statement renewing every lease a process holds: a row is extended (never shortened) only
/// while it is still held by `process` with the epoch it was granted and unexpired at `now`; the
/// rows renewed are returned. `$1`: agents, `$2`: their epochs.
pub(crate) const RENEW_SQL: &str = "\
UPDATE agent_placement AS p SET expires_at = GREATEST(p.expires_at, $3) \
FROM unnest($1::text[], $2::bigint[]) AS h(agent_id, epoch) \
WHERE p.agent_id = h.agent_id AND p.epoch = h.epoch AND p.process = $4 AND p.expires_at > $5 \
RETURNING p.agent_id, p.process, p.expires_at, p.epoch";

/// How many connections the placement's own pool keeps at most: the renewal and the acquisition
/// round run at once, each on one.
const LEASE_CONNECTIONS: u32 = 2;

/// The prefix of the notification channel (followed by the schema's name).
const CHANNEL_PREFIX: &str = "spacebot_wake_";

/// The longest identifier PostgreSQL keeps (`NAMEDATALEN - 1`).
const MAX_IDENTIFIER: usize = 63;

/// The [`Placement`] of one PostgreSQL schema, shared by every process connected to it: a lease
/// per agent in the table `agent_placement`, wake-up hints with `NOTIFY` on one channel per
/// schema. Made with [`PgStores::placement`] (or [`PgPlacement::new`]); cheap to clone.
///
/// - [`acquire`](Placement::acquire) is one `INSERT ... ON CONFLICT (agent_id) DO UPDATE ...
///   WHERE p.process = $process OR p.expires_at <= $now RETURNING ...` statement: PostgreSQL
///   locks the agent's row, so of concurrent calls exactly one takes a free or expired agent.
///   Expiry is decided by the caller's `now`, never by the server's clock.
/// - [`release`](Placement::release) keeps the row (empty process, expired) so the epoch keeps
///   growing after a release.
/// - [`notify`](Placement::notify) is `SELECT pg_notify(channel, agent)`; the channel is
///   [`PgPlacement::channel`] (`spacebot_wake_<schema>`). Every process listening on the schema
///   receives every hint and the runtime keeps those for the agents it hosts.
/// - [`wakeups`](Placement::wakeups) opens a connection of its own (outside the stores' pool)
///   and `LISTEN`s on the channel. When that connection is lost the stream **ends** (hints sent
///   meanwhile are lost: the runtime checks its agents' stores every `check_interval` anyway) and
///   the runtime subscribes again.
/// - [`renew`](Placement::renew) renews every lease of a process with one `UPDATE ... FROM
///   unnest(...)` statement (one commit per round, whatever the number of agents).
/// - The lease calls ([`acquire`](Placement::acquire), [`renew`](Placement::renew),
///   [`release`](Placement::release), [`holder`](Placement::holder),
///   [`held_by`](Placement::held_by)) run on a pool of their own (two connections, made on first
///   use, shared by the clones of this value), never on the stores' pool: a renewal never waits
///   behind the agents' own transactions for a connection. `notify` goes through the stores' pool.
/// - Every call shares the stores' state: after [`PgStores::cut_off`] (a simulated partition) or
///   [`PgStores::close`] every call fails and every wake-up stream ends.
#[derive(Debug, Clone)]
pub struct PgPlacement {
    stores: PgStores,
    channel: String,
    /// The lease calls' own pool, made on first use (inside the caller's runtime).
    leases: Arc<OnceLock<PgPool>>,
}

impl PgPlacement {
    /// The placement table of `stores`' schema, on their pool.
    pub fn new(stores: &PgStores) -> Self {
        Self {
            stores: stores.clone(),
            channel: channel_name(stores.schema()),
            leases: Arc::default(),
        }
    }

    /// The lease calls' pool: the stores' connect options (their schema), two connections at
    /// most, the stores' acquire timeout.
    fn lease_pool(&self, db: &Db) -> PgPool {
        self.leases
            .get_or_init(|| {
                PgPoolOptions::new()
                    .max_connections(LEASE_CONNECTIONS)
                    .acquire_timeout(db.pool.options().get_acquire_timeout())
                    .connect_lazy_with((*db.pool.connect_options()).clone())
            })
            .clone()
    }

    /// The `NOTIFY` channel of this schema: `spacebot_wake_<schema>` (`spacebot_wake_` alone for
    /// the connection's default schema); a name longer than PostgreSQL keeps (63 bytes) is
    /// shortened with a hash of the schema's name.
    pub fn channel(&self) -> &str {
        &self.channel
    }
}

/// `spacebot_wake_<schema>`, at most 63 bytes (schema names are checked: ASCII only).
fn channel_name(schema: Option<&str>) -> String {
    let schema = schema.unwrap_or("");
    let full = format!("{CHANNEL_PREFIX}{schema}");
    if full.len() <= MAX_IDENTIFIER {
        return full;
    }
    // FNV-1a: the same in every process and build, unlike std's RandomState.
    let hash = schema.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let keep = MAX_IDENTIFIER - CHANNEL_PREFIX.len() - 17;
    format!(
        "{CHANNEL_PREFIX}{}_{hash:016x}",
        schema.get(..keep).unwrap_or(schema)
    )
}

impl PgStores {
    /// The [`Placement`] table of this schema, for
    /// [`OrganizationBuilder::placement`](spacebot_core::OrganizationBuilder::placement): every
    /// process of one organization connects to the same schema and passes its own
    /// [`ProcessId`]. See [`PgPlacement`].
    pub fn placement(&self) -> PgPlacement {
        PgPlacement::new(self)
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn lease_from_row(location: &str, row: &PgRow) -> Result<PlacementLease, StoreError> {
    let fail = |e| db_error(location, "reading a placement row", e);
    let agent: String = row.try_get("agent_id").map_err(fail)?;
    let process: String = row.try_get("process").map_err(fail)?;
    let expires_at: i64 = row.try_get("expires_at").map_err(fail)?;
    let epoch: i64 = row.try_get("epoch").map_err(fail)?;
    Ok(PlacementLease {
        agent: AgentId::parse(agent)
            .map_err(|e| corrupt(location, format!("agent_placement: {e}")))?,
        process: ProcessId::new(process)
            .map_err(|e| corrupt(location, format!("agent_placement: {e}")))?,
        expires_at: Timestamp(expires_at),
        epoch: u64::try_from(epoch)
            .map_err(|_| corrupt(location, format!("agent_placement: epoch {epoch}")))?,
    })
}

#[async_trait]
impl Placement for PgPlacement {
    async fn acquire(
        &self,
        agent: &AgentId,
        process: &ProcessId,
        lease: Duration,
        now: Timestamp,
    ) -> Result<Option<PlacementLease>, StoreError> {
        let db = self.stores.db()?;
        let row = sqlx::query(ACQUIRE_SQL)
            .bind(agent.as_str())
            .bind(process.as_str())
            .bind(now.0.saturating_add(millis(lease)))
            .bind(now.0)
            .fetch_optional(&self.lease_pool(db))
            .await
            .map_err(|e| db_error(&db.location, "acquiring an agent", e))?;
        row.map(|row| lease_from_row(&db.location, &row))
            .transpose()
    }

    async fn renew(
        &self,
        held: &[PlacementLease],
        lease: Duration,
        now: Timestamp,
    ) -> Result<Vec<Option<PlacementLease>>, StoreError> {
        let Some(first) = held.first() else {
            return Ok(Vec::new());
        };
        let db = self.stores.db()?;
        // One statement per holder (a process renews its own; several only if the caller mixes).
        let mut out: Vec<Option<PlacementLease>> = vec![None; held.len()];
        let mut processes: Vec<&ProcessId> = vec![&first.process];
        for l in held {
            if !processes.contains(&&l.process) {
                processes.push(&l.process);
            }
        }
        for process in processes {
            let mut agents = Vec::new();
            let mut epochs = Vec::new();
            for l in held.iter().filter(|l| l.process == *process) {
                let epoch = i64::try_from(l.epoch).unwrap_or(i64::MAX);
                agents.push(l.agent.as_str().to_string());
                epochs.push(epoch);
            }
            let rows = sqlx::query(RENEW_SQL)
                .bind(&agents)
                .bind(&epochs)
                .bind(now.0.saturating_add(millis(lease)))
                .bind(process.as_str())
                .bind(now.0)
                .fetch_all(&self.lease_pool(db))
                .await
                .map_err(|e| db_error(&db.location, "renewing leases", e))?;
            for row in &rows {
                let renewed = lease_from_row(&db.location, row)?;
                for (slot, asked) in out.iter_mut().zip(held) {
                    if asked.agent == renewed.agent
                        && asked.process == renewed.process
                        && asked.epoch == renewed.epoch
                    {
                        *slot = Some(renewed.clone());
                    }
                }
            }
        }
        Ok(out)
    }

    async fn release(&self, agent: &AgentId, process: &ProcessId) -> Result<bool, StoreError> {
        let db = self.stores.db()?;
        let done = sqlx::query(
            "UPDATE agent_placement SET process = '', expires_at = $3 \
             WHERE agent_id = $1 AND process = $2",
        )
        .bind(agent.as_str())
        .bind(process.as_str())
        .bind(i64::MIN)
        .execute(&self.lease_pool(db))
        .await
        .map_err(|e| db_error(&db.location, "releasing an agent", e))?;
        Ok(done.rows_affected() > 0)
    }

    async fn holder(
        &self,
        agent: &AgentId,
        now: Timestamp,
    ) -> Result<Option<PlacementLease>, StoreError> {
        let db = self.stores.db()?;
        let row = sqlx::query(
            "SELECT agent_id, process, expires_at, epoch FROM agent_placement \
             WHERE agent_id = $1 AND expires_at > $2 AND process <> ''",
        )
        .bind(agent.as_str())
        .bind(now.0)
        .fetch_optional(&self.lease_pool(db))
        .await
        .map_err(|e| db_error(&db.location, "reading an agent's holder", e))?;
        row.map(|row| lease_from_row(&db.location, &row))
            .transpose()
    }

    async fn held_by(
        &self,
        process: &ProcessId,
        now: Timestamp,
    ) -> Result<Vec<PlacementLease>, StoreError> {
        let db = self.stores.db()?;
        let rows = sqlx::query(
            "SELECT agent_id, process, expires_at, epoch FROM agent_placement \
             WHERE process = $1 AND expires_at > $2 ORDER BY agent_id",
        )
        .bind(process.as_str())
        .bind(now.0)
        .fetch_all(&self.lease_pool(db))
        .await
        .map_err(|e| db_error(&db.location, "listing a process's agents", e))?;
        rows.iter()
            .map(|row| lease_from_row(&db.location, row))
            .collect()
    }

    async fn notify(&self, agent: &AgentId) -> Result<(), StoreError> {
        let db = self.stores.db()?;
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(&self.channel)
            .bind(agent.as_str())
            .execute(&db.pool)
            .await
            .map_err(|e| db_error(&db.location, "sending a wake-up hint", e))?;
        Ok(())
    }

    fn wakeups(&self, _process: &ProcessId) -> BoxStream<'static, AgentId> {
        let stores = self.stores.clone();
        let channel = self.channel.clone();
        let setup = async move {
            let db = stores.db().ok()?;
            let mut cut = stores.cut_watch();
            // A connection of its own (a pool of one), so that a listener never takes one of the
            // stores' connections; LISTEN needs no search_path.
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(Duration::from_secs(10))
                .connect_lazy_with(db.base.clone());
            let mut listener = match PgListener::connect_with(&pool).await {
                Ok(listener) => listener,
                Err(e) => {
                    tracing::debug!(location = %db.location, error = %e, "cannot listen for wake-up hints");
                    return None;
                }
            };
            // A lost connection ends the stream (the caller subscribes again), instead of being
            // re-established silently with the hints sent meanwhile lost.
            listener.eager_reconnect(false);
            if let Err(e) = listener.listen(&channel).await {
                tracing::debug!(location = %db.location, error = %e, "cannot listen for wake-up hints");
                return None;
            }
            // A partition that began while subscribing ends the stream at once.
            if *cut.borrow_and_update() {
                return None;
            }
            let location = db.location.clone();
            let hints = stream::unfold((listener, pool, cut), move |state| {
                let location = location.clone();
                async move {
                    let (mut listener, pool, mut cut) = state;
                    loop {
                        let next = tokio::select! {
                            next = listener.try_recv() => next,
                            _ = cut.wait_for(|cut| *cut) => return None,
                        };
                        match next {
                            Ok(Some(hint)) => match AgentId::parse(hint.payload()) {
                                Ok(agent) => return Some((agent, (listener, pool, cut))),
                                Err(_) => continue,
                            },
                            Ok(None) => return None,
                            Err(e) => {
                                tracing::debug!(location = %location, error = %e, "wake-up hints lost");
                                return None;
                            }
                        }
                    }
                }
            });
            Some(hints)
        };
        Box::pin(stream::once(setup).filter_map(std::future::ready).flatten())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channel_names_fit_an_identifier() {
        assert_eq!(channel_name(Some("org")), "spacebot_wake_org");
        assert_eq!(channel_name(None), "spacebot_wake_");
        let long = "s".repeat(63);
        let name = channel_name(Some(&long));
        assert!(name.len() <= MAX_IDENTIFIER, "{name}");
        assert_ne!(name, channel_name(Some(&"s".repeat(62))));
    }
}
