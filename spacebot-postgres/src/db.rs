//! Connecting: checking that the schema is ours, migrating it, building the pool; and running a
//! store operation in a transaction.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use spacebot_core::StoreError;
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Connection, PgConnection, Row};

use crate::error::{corrupt, db_error, invalid, is_retryable, migrate_error};
use crate::options::{PgOptions, check_schema_name};

/// The schema's migrations (`spacebot-postgres/migrations`), embedded at compile time.
pub(crate) fn migrator() -> Migrator {
    let mut migrator = sqlx::migrate!("./migrations");
    // Connecting takes its own lock, per schema, in the transaction that migrates (see `migrate`):
    // sqlx's lock is one per database and held by the session, not the transaction.
    migrator.set_locking(false);
    migrator
}

/// The value of `spacebot_meta.format` in a spacebot schema.
const FORMAT: &str = "spacebot-postgres";

/// How often a transaction PostgreSQL rolled back for a concurrent one (deadlock, serialization
/// failure) is run again before its error is returned.
const RETRIES: u32 = 8;

/// One connected database: the pool every store call uses.
#[derive(Debug)]
pub(crate) struct Db {
    pub(crate) pool: PgPool,
    /// `postgres://user@host:port/db (schema s)`, for error messages (never the password).
    pub(crate) location: Arc<str>,
    /// The schema named in the options (`None`: the connection's default).
    pub(crate) schema: Option<String>,
    /// The connect options without the schema's `search_path` (to drop a temporary schema).
    pub(crate) base: PgConnectOptions,
}

impl Db {
    /// Connects to `url`, creates the schema if needed, checks that it is spacebot's (or empty),
    /// migrates it, and builds the pool.
    pub(crate) async fn open(url: &str, options: &PgOptions) -> Result<Self, StoreError> {
        let base = PgConnectOptions::from_str(url)
            .map_err(|e| invalid("postgres url", format!("not a PostgreSQL URL: {e}")))?
            .application_name(&options.application_name);
        if let Some(schema) = &options.schema {
            check_schema_name(schema)?;
        }
        let location: Arc<str> = Arc::from(describe(&base, options.schema.as_deref()));
        let connect = match &options.schema {
            Some(schema) => base.clone().options([("search_path", schema.as_str())]),
            None => base.clone(),
        };

        let mut conn = PgConnection::connect_with(&connect)
            .await
            .map_err(|e| db_error(&location, "connecting", e))?;
        let migrated = migrate(&mut conn, &location, options.schema.as_deref()).await;
        // The session is thrown away: its error would hide the real one.
        let _ = conn.close().await;
        migrated?;

        let pool = PgPoolOptions::new()
            .max_connections(options.max_connections.max(1))
            .min_connections(options.min_connections)
            .acquire_timeout(options.acquire_timeout)
            .idle_timeout(options.idle_timeout)
            .connect_lazy_with(connect);
        Ok(Self {
            pool,
            location,
            schema: options.schema.clone(),
            base,
        })
    }

    /// Runs `op` in a transaction and commits it. A transaction PostgreSQL rolled back because of
    /// a concurrent one (a deadlock, a serialization failure) is run again, up to a few times;
    /// any other error rolls back and is returned.
    ///
    /// `op` is called once per attempt and must not keep state between attempts.
    pub(crate) async fn tx<T, F>(&self, op: F) -> Result<T, StoreError>
    where
        T: Send,
        F: for<'c> Fn(&'c mut PgConnection) -> BoxFuture<'c, Result<T, StoreError>> + Send + Sync,
    {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut tx = self
                .pool
                .begin()
                .await
                .map_err(|e| db_error(&self.location, "starting a transaction", e))?;
            let outcome = match op(&mut tx).await {
                Ok(value) => tx
                    .commit()
                    .await
                    .map(|()| value)
                    .map_err(|e| db_error(&self.location, "committing a transaction", e)),
                Err(e) => {
                    // The server rolls back anyway when the connection goes; an error here would
                    // hide the operation's own.
                    let _ = tx.rollback().await;
                    Err(e)
                }
            };
            match outcome {
                Err(e) if attempt < RETRIES && is_retryable(&e) => {
                    tracing::debug!(location = %self.location, attempt, error = %e, "retrying a transaction");
                    tokio::time::sleep(pause(attempt)).await;
                }
                other => return other,
            }
        }
    }
}

impl Db {
    /// Runs `op`: one statement on the pool, outside any transaction (PostgreSQL makes a single
    /// statement atomic by itself: no `BEGIN` and `COMMIT` round trips), run again when the
    /// server refused it because of a concurrent transaction, as [`tx`](Self::tx) does.
    pub(crate) async fn statement<T, F>(&self, op: F) -> Result<T, StoreError>
    where
        T: Send,
        F: for<'p> Fn(&'p PgPool) -> BoxFuture<'p, Result<T, StoreError>> + Send + Sync,
    {
        let mut attempt = 0;
        loop {
            attempt += 1;
            match op(&self.pool).await {
                Err(e) if attempt < RETRIES && is_retryable(&e) => {
                    tracing::debug!(location = %self.location, attempt, error = %e, "retrying a statement");
                    tokio::time::sleep(pause(attempt)).await;
                }
                other => return other,
            }
        }
    }
}

/// A short, growing, randomized pause before retry `attempt` (so that two transactions that
/// deadlocked do not meet again at once): up to 10, 20, 40 ... 640 ms.
fn pause(attempt: u32) -> Duration {
    Duration::from_millis(fastrand::u64(0..5u64 << attempt.min(7)))
}

/// `postgres://user@host:port/db (schema s)`.
fn describe(options: &PgConnectOptions, schema: Option<&str>) -> String {
    let host = match options.get_socket() {
        Some(socket) => socket.display().to_string(),
        None => format!("{}:{}", options.get_host(), options.get_port()),
    };
    let db = options.get_database().unwrap_or(options.get_username());
    let schema = schema.map_or_else(
        || "the default schema".to_string(),
        |s| format!("schema {s}"),
    );
    format!(
        "postgres://{}@{host}/{db} ({schema})",
        options.get_username()
    )
}

/// Creates the schema if needed, refuses one that holds another application's tables or a newer
/// spacebot schema, and applies the migrations: all in one transaction, under a lock per schema,
/// so that processes connecting at once migrate it once.
async fn migrate(
    conn: &mut PgConnection,
    location: &str,
    schema: Option<&str>,
) -> Result<(), StoreError> {
    let fail = |doing: &'static str| move |e| db_error(location, doing, e);
    let mut tx = conn
        .begin()
        .await
        .map_err(fail("starting the migration transaction"))?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
        .bind(format!(
            "spacebot-postgres migrate {}",
            schema.unwrap_or("")
        ))
        .execute(&mut *tx)
        .await
        .map_err(fail("locking the schema to migrate it"))?;
    if let Some(schema) = schema {
        // The name is checked: lowercase letters, digits and '_' only.
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE SCHEMA IF NOT EXISTS \"{schema}\""
        )))
        .execute(&mut *tx)
        .await
        .map_err(fail("creating the schema"))?;
    }
    let current: Option<String> = sqlx::query_scalar("SELECT current_schema()")
        .fetch_one(&mut *tx)
        .await
        .map_err(fail("reading the current schema"))?;
    let Some(current) = current else {
        return Err(corrupt(
            location,
            "no schema of the search_path exists: name one with PgOptions::schema",
        ));
    };
    check_schema(&mut tx, location, &current).await?;
    migrator()
        .run_direct(None, &mut *tx, false)
        .await
        .map_err(|e| migrate_error(location, e))?;
    tx.commit()
        .await
        .map_err(fail("committing the migrations"))?;
    Ok(())
}

/// Refuses a schema that holds tables but is not a spacebot schema.
async fn check_schema(
    conn: &mut PgConnection,
    location: &str,
    schema: &str,
) -> Result<(), StoreError> {
    let fail = |e| db_error(location, "checking the schema", e);
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT tablename::text FROM pg_catalog.pg_tables WHERE schemaname = $1 ORDER BY 1",
    )
    .bind(schema)
    .fetch_all(&mut *conn)
    .await
    .map_err(fail)?;
    if tables.is_empty() {
        return Ok(()); // an empty schema: ours to initialize
    }
    if !tables.iter().any(|t| t == "spacebot_meta") {
        let shown: Vec<&str> = tables.iter().take(5).map(String::as_str).collect();
        return Err(corrupt(
            location,
            format!(
                "schema {schema} holds tables of another application ({}{}) and no spacebot_meta: \
                 refusing to touch it; name an empty or new schema with PgOptions::schema",
                shown.join(", "),
                if tables.len() > shown.len() {
                    ", ..."
                } else {
                    ""
                }
            ),
        ));
    }
    let row = sqlx::query("SELECT value FROM spacebot_meta WHERE key = 'format'")
        .fetch_optional(&mut *conn)
        .await
        .map_err(fail)?;
    let format: Option<String> = row
        .map(|r| r.try_get::<String, _>("value"))
        .transpose()
        .map_err(fail)?;
    if format.as_deref() != Some(FORMAT) {
        return Err(corrupt(
            location,
            format!(
                "schema {schema} has a spacebot_meta table of another format ({format:?}): \
                 refusing to touch it"
            ),
        ));
    }
    Ok(())
}

/// Drops the temporary `schema` over a connection of its own, waiting at most a few seconds for
/// locks (a connection left in a transaction would otherwise block it for ever).
pub(crate) async fn drop_schema(base: &PgConnectOptions, schema: &str) -> Result<(), sqlx::Error> {
    let mut conn = PgConnection::connect_with(base).await?;
    sqlx::query("SET lock_timeout = '5s'")
        .execute(&mut conn)
        .await?;
    // The name is checked: lowercase letters, digits and '_' only.
    let dropped = sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"
    )))
    .execute(&mut conn)
    .await;
    let _ = conn.close().await;
    dropped.map(|_| ())
}
