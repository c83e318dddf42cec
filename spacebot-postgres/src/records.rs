//! [`RecordStore`]: the `records` table.

use async_trait::async_trait;
use spacebot_core::records::{
    Record, RecordStore, RecordWrite, WriteOutcome, check_address, check_list_prefix,
    check_namespace,
};
use spacebot_core::{StoreError, Timestamp};
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};

use crate::PgStores;
use crate::codec::{Reader, to_sql, to_sql_or};
use crate::error::db_error;

const COLUMNS: &str = "namespace, key, version, value, author, written_at";

/// How often a write that lost a race (another writer inserted the version it wanted, or its
/// effect key) is tried again before the caller is told; each lost race means another write was
/// committed meanwhile.
const RACES: u32 = 256;

fn decode(location: &str, row: &PgRow) -> Result<Record, StoreError> {
    let namespace: String = row
        .try_get("namespace")
        .map_err(|e| db_error(location, "reading a record", e))?;
    let key = Reader {
        row,
        location,
        what: "a record",
    }
    .text("key")?;
    let what = format!("record {namespace}/{key:?}");
    let r = Reader {
        row,
        location,
        what: &what,
    };
    let value: String = r.get("value")?;
    Ok(Record {
        version: r.u64("version")?,
        value: serde_json::from_str(&value).map_err(|e| r.bad("value", e))?,
        author: r.text("author")?,
        written_at: Timestamp(r.get("written_at")?),
        namespace,
        key,
    })
}

/// What one attempt of a write did.
enum Attempt {
    Done(WriteOutcome),
    /// Another writer took the version or the effect key first: read again.
    Raced,
}

async fn fetch_one(
    conn: &mut PgConnection,
    location: &str,
    sql: &str,
    namespace: &str,
    key: &[u8],
) -> Result<Option<Record>, StoreError> {
    let row = sqlx::query(sqlx::AssertSqlSafe(sql.to_string()))
        .bind(namespace)
        .bind(key)
        .fetch_optional(&mut *conn)
        .await
        .map_err(|e| db_error(location, "reading a record", e))?;
    row.map(|r| decode(location, &r)).transpose()
}

async fn attempt(
    conn: &mut PgConnection,
    location: &str,
    write: &RecordWrite,
    json: &str,
) -> Result<Attempt, StoreError> {
    // Writers of one key take turns, from any process: a replacing write frees the number of
    // the version it replaces, and a writer that read the key before must not fill it.
    sqlx::query(
        "SELECT pg_advisory_xact_lock(hashtextextended(\
         'spacebot-postgres record ' || current_schema() || '/' || $1 || '/' || encode($2, 'hex'), \
         0))",
    )
    .bind(&write.namespace)
    .bind(write.key.as_bytes())
    .execute(&mut *conn)
    .await
    .map_err(|e| db_error(location, "locking a record's key", e))?;
    if let Some(effect) = &write.effect_key {
        let sql = format!("SELECT {COLUMNS} FROM records WHERE namespace = $1 AND effect_key = $2");
        if let Some(record) =
            fetch_one(conn, location, &sql, &write.namespace, effect.as_bytes()).await?
        {
            return Ok(Attempt::Done(WriteOutcome::AlreadyApplied(record)));
        }
    }
    let sql = format!(
        "SELECT {COLUMNS} FROM records WHERE namespace = $1 AND key = $2 \
         ORDER BY version DESC LIMIT 1"
    );
    let current = fetch_one(conn, location, &sql, &write.namespace, write.key.as_bytes()).await?;
    let latest = current.as_ref().map_or(0, |r| r.version);
    if !write.expect.admits(latest) {
        return Ok(Attempt::Done(WriteOutcome::Conflict { current }));
    }
    let next = latest + 1;
    // Waits for a concurrent insert of the same version or effect key to end; if it committed,
    // this one inserts nothing (and the transaction stays usable).
    let inserted = sqlx::query(
        "INSERT INTO records (namespace, key, version, value, author, written_at, effect_key) \
         VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT DO NOTHING",
    )
    .bind(&write.namespace)
    .bind(write.key.as_bytes())
    .bind(to_sql_or(location, "record version", next)?)
    .bind(json)
    .bind(write.author.as_bytes())
    .bind(write.written_at.0)
    .bind(write.effect_key.as_deref().map(str::as_bytes))
    .execute(&mut *conn)
    .await
    .map_err(|e| db_error(location, "writing a record", e))?;
    if inserted.rows_affected() == 0 {
        return Ok(Attempt::Raced);
    }
    if write.replacing && latest > 0 {
        // The version this one follows goes in the same transaction, unless an effect key keeps
        // it (of racing writers only the one that inserted gets here).
        sqlx::query(
            "DELETE FROM records WHERE namespace = $1 AND key = $2 AND version = $3 \
             AND effect_key IS NULL",
        )
        .bind(&write.namespace)
        .bind(write.key.as_bytes())
        .bind(to_sql_or(location, "record version", latest)?)
        .execute(&mut *conn)
        .await
        .map_err(|e| db_error(location, "replacing a record", e))?;
    }
    Ok(Attempt::Done(WriteOutcome::Written(
        write.clone().into_record(next),
    )))
}

/// [`RecordStore`] on the `records` table. Get one from [`PgStores::records`].
///
/// A write reads the effect key and the key's latest version, then inserts the next version with
/// `ON CONFLICT DO NOTHING`. Writers of one key, from any processes, take turns on a
/// transaction-scoped advisory lock of the key (a replacing write deletes the version it follows
/// in the same transaction, freeing its number: a writer that read the key before must not fill
/// it); writers of one effect key on different keys are decided by the unique index of effect
/// keys, one inserting; a writer that inserted nothing reads again in a new transaction, and so
/// ends `AlreadyApplied`, `Conflict`, or (with `Expect::Any`) written as the next version.
#[derive(Debug, Clone)]
pub struct PgRecordStore(pub(crate) PgStores);

impl PgRecordStore {
    async fn query(
        &self,
        sql: String,
        namespace: &str,
        key: &[u8],
        version: Option<i64>,
    ) -> Result<Vec<Record>, StoreError> {
        let db = self.0.db()?;
        let mut q = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(namespace)
            .bind(key);
        if let Some(v) = version {
            q = q.bind(v);
        }
        let rows = q
            .fetch_all(&db.pool)
            .await
            .map_err(|e| db_error(&db.location, "reading records", e))?;
        rows.iter().map(|r| decode(&db.location, r)).collect()
    }
}

#[async_trait]
impl RecordStore for PgRecordStore {
    async fn release(&self) {
        self.0.close().await;
    }

    async fn get(&self, namespace: &str, key: &str) -> Result<Option<Record>, StoreError> {
        check_address(namespace, key)?;
        Ok(self
            .query(
                format!(
                    "SELECT {COLUMNS} FROM records WHERE namespace = $1 AND key = $2 \
                     ORDER BY version DESC LIMIT 1"
                ),
                namespace,
                key.as_bytes(),
                None,
            )
            .await?
            .pop())
    }

    async fn version(
        &self,
        namespace: &str,
        key: &str,
        version: u64,
    ) -> Result<Option<Record>, StoreError> {
        check_address(namespace, key)?;
        let Some(version) = to_sql(version) else {
            return Ok(None); // never written: versions count writes
        };
        Ok(self
            .query(
                format!(
                    "SELECT {COLUMNS} FROM records \
                     WHERE namespace = $1 AND key = $2 AND version = $3"
                ),
                namespace,
                key.as_bytes(),
                Some(version),
            )
            .await?
            .pop())
    }

    async fn write(&self, write: RecordWrite) -> Result<WriteOutcome, StoreError> {
        let json = write.validate()?;
        let db = self.0.db()?;
        let location = db.location.clone();
        // Shared with each attempt's future (which must own what it uses) without copying the
        // value.
        let shared = std::sync::Arc::new((write, json, location.clone()));
        for _ in 0..RACES {
            let done = db
                .tx(|conn| {
                    let shared = shared.clone();
                    Box::pin(async move {
                        let (write, json, location) = &*shared;
                        attempt(conn, location, write, json).await
                    })
                })
                .await?;
            if let Attempt::Done(outcome) = done {
                return Ok(outcome);
            }
        }
        Err(StoreError::Backend {
            backend: "postgres",
            message: format!(
                "writing record {}/{:?} in {location}: lost {RACES} races in a row to other writers",
                shared.0.namespace, shared.0.key
            ),
            source: None,
        })
    }

    async fn list(&self, namespace: &str, prefix: &str) -> Result<Vec<Record>, StoreError> {
        check_namespace(namespace)?;
        check_list_prefix(prefix)?;
        self.query(
            format!(
                "SELECT DISTINCT ON (key) {COLUMNS} FROM records \
                 WHERE namespace = $1 AND key >= $2 \
                 AND substring(key FROM 1 FOR length($2)) = $2 \
                 ORDER BY key, version DESC"
            ),
            namespace,
            prefix.as_bytes(),
            None,
        )
        .await
    }

    async fn history(&self, namespace: &str, key: &str) -> Result<Vec<Record>, StoreError> {
        check_address(namespace, key)?;
        self.query(
            format!(
                "SELECT {COLUMNS} FROM records WHERE namespace = $1 AND key = $2 ORDER BY version"
            ),
            namespace,
            key.as_bytes(),
            None,
        )
        .await
    }
}
