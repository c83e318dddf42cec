//! [`RecordStore`] on the instance database.

use async_trait::async_trait;
use rusqlite::types::Value;
use rusqlite::{Connection, Row, params, params_from_iter};
use spacebot_core::records::{
    Record, RecordStore, RecordWrite, TypedCells, WriteOutcome, check_address, check_list_prefix,
    check_namespace,
};
use spacebot_core::{StoreError, Timestamp};

use crate::SqliteStores;
use crate::error::{Location, corrupt, db_error, is_unique_violation};
use crate::query;

/// The columns [`decode`] reads, in a `SELECT`.
macro_rules! columns {
    () => {
        "namespace, key, version, value, author, written_at"
    };
}

const COLUMNS: &str = columns!();

/// The latest version of a record.
const LATEST: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM records WHERE namespace = ? AND key = ? ORDER BY version DESC LIMIT 1"
);

/// The number of a record's latest version.
const LATEST_VERSION: &str =
    "SELECT version FROM records WHERE namespace = ? AND key = ? ORDER BY version DESC LIMIT 1";

/// A record written with an effect key.
const BY_EFFECT: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM records WHERE namespace = ? AND effect_key = ?"
);

fn decode(location: &Location, row: &Row<'_>) -> Result<Record, StoreError> {
    let read = |e| db_error(location, "reading a record", e);
    let namespace: String = row.get("namespace").map_err(read)?;
    let key: String = row.get("key").map_err(read)?;
    let version: i64 = row.get("version").map_err(read)?;
    let bad = |what: &str, why: String| {
        corrupt(
            location,
            format!("record {namespace}/{key:?} version {version}: {what}: {why}"),
        )
    };
    let value: String = row.get("value").map_err(read)?;
    Ok(Record {
        version: u64::try_from(version).map_err(|_| bad("version", "negative".into()))?,
        value: serde_json::from_str(&value).map_err(|e| bad("value", e.to_string()))?,
        author: row.get("author").map_err(read)?,
        written_at: Timestamp(row.get("written_at").map_err(read)?),
        namespace,
        key,
    })
}

/// Reads one record of the writer's transaction.
fn one(
    conn: &Connection,
    location: &Location,
    sql: &str,
    binds: [&str; 2],
) -> Result<Option<Record>, StoreError> {
    query::first(conn, location, "reading a record", sql, binds, |row| {
        decode(location, row)
    })
}

impl SqliteStores {
    /// Runs a read of records; `short` (a lookup of one key's latest or given version, by the
    /// primary key) runs on the calling thread when a reader connection is idle.
    async fn query_records(
        &self,
        sql: String,
        binds: &[&str],
        version: Option<i64>,
        short: bool,
    ) -> Result<Vec<Record>, StoreError> {
        let db = self.instance();
        let mut values: Vec<Value> = binds
            .iter()
            .map(|b| Value::Text((*b).to_string()))
            .collect();
        if let Some(v) = version {
            values.push(Value::Integer(v));
        }
        let location = db.location.clone();
        let read = move |conn: &rusqlite::Connection| {
            query::all(
                conn,
                &location,
                "reading records",
                &sql,
                params_from_iter(values),
                |row| decode(&location, row),
            )
        };
        if short {
            db.read_short("reading a record", read).await
        } else {
            db.read("reading records", read).await
        }
    }
}

/// [`RecordStore`] on the instance database (table `records`). Get one from
/// [`SqliteStores::records`].
///
/// A write is one operation of the instance database's writer: its reads (the effect key, the
/// latest version) and its insert run in one transaction, after every write queued before it, so
/// racing writers are serialized.
///
/// Its [typed cells](RecordStore::typed_cells) keep their images in the table `cells` of the same
/// database (see [`TypedCells`] and `spacebot_core::records::CellImages`): one process owns a data
/// directory, so the cells in its memory are the values and the images their durable copy. The
/// request ledger keeps each request's spend there.
#[derive(Debug, Clone)]
pub struct SqliteRecordStore(pub(crate) SqliteStores);

#[async_trait]
impl RecordStore for SqliteRecordStore {
    async fn release(&self) {
        self.0.close().await;
    }

    fn typed_cells(&self) -> Option<&TypedCells> {
        Some(&self.0.inner.cells)
    }

    async fn get(&self, namespace: &str, key: &str) -> Result<Option<Record>, StoreError> {
        check_address(namespace, key)?;
        Ok(self
            .0
            .query_records(LATEST.to_owned(), &[namespace, key], None, true)
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
        let Ok(version) = i64::try_from(version) else {
            return Ok(None); // never written: versions count writes
        };
        Ok(self
            .0
            .query_records(
                format!(
                    "SELECT {COLUMNS} FROM records WHERE namespace = ? AND key = ? AND version = ?"
                ),
                &[namespace, key],
                Some(version),
                true,
            )
            .await?
            .pop())
    }

    async fn write(&self, write: RecordWrite) -> Result<WriteOutcome, StoreError> {
        let json = write.validate()?;
        let db = self.0.instance();
        let location = db.location.clone();
        db.writes
            .run(move |conn| {
                if let Some(effect) = &write.effect_key {
                    let applied = one(conn, &location, BY_EFFECT, [&write.namespace, effect])?;
                    if let Some(record) = applied {
                        return Ok(WriteOutcome::AlreadyApplied(record));
                    }
                }
                // The latest version alone (the primary key's index answers it); the whole
                // record is read only for a refusal, which carries it.
                let latest = query::first(
                    conn,
                    &location,
                    "reading a record's version",
                    LATEST_VERSION,
                    [&write.namespace, &write.key],
                    |row| {
                        let version: i64 = row
                            .get(0)
                            .map_err(|e| db_error(&location, "reading a record's version", e))?;
                        u64::try_from(version).map_err(|_| {
                            corrupt(
                                &location,
                                format!(
                                    "record {}/{:?} has a negative version",
                                    write.namespace, write.key
                                ),
                            )
                        })
                    },
                )?
                .unwrap_or(0);
                if !write.expect.admits(latest) {
                    let current = one(conn, &location, LATEST, [&write.namespace, &write.key])?;
                    return Ok(WriteOutcome::Conflict { current });
                }
                let next = latest + 1;
                let stored = i64::try_from(next).map_err(|_| {
                    corrupt(
                        &location,
                        format!("record {} has too many versions", write.key),
                    )
                })?;
                // A replacing write takes the latest version's row, unless an effect key
                // keeps that one (the writer's transaction: nothing races it).
                if write.replacing && latest > 0 {
                    let replaced = query::execute(
                        conn,
                        "UPDATE records SET version = ?, value = ?, author = ?, written_at = ?, \
                         effect_key = ? \
                         WHERE namespace = ? AND key = ? AND version = ? AND effect_key IS NULL",
                        params![
                            stored,
                            json,
                            write.author,
                            write.written_at.0,
                            write.effect_key.as_deref(),
                            write.namespace,
                            write.key,
                            stored - 1,
                        ],
                    )
                    .map_err(|e| db_error(&location, "replacing a record", e))?;
                    if replaced == 1 {
                        return Ok(WriteOutcome::Written(write.into_record(next)));
                    }
                }
                query::execute(
                    conn,
                    "INSERT INTO records \
                     (namespace, key, version, value, author, written_at, effect_key) \
                     VALUES (?, ?, ?, ?, ?, ?, ?)",
                    params![
                        write.namespace,
                        write.key,
                        stored,
                        json,
                        write.author,
                        write.written_at.0,
                        write.effect_key.as_deref(),
                    ],
                )
                .map_err(|e| {
                    if is_unique_violation(&e) {
                        // The reads above run in the writer's transaction, after every
                        // earlier write: a duplicate here is not a race but damage.
                        corrupt(
                            &location,
                            format!(
                                "record {}/{:?} version {next} exists, but was not read: {e}",
                                write.namespace, write.key
                            ),
                        )
                    } else {
                        db_error(&location, "writing a record", e)
                    }
                })?;
                Ok(WriteOutcome::Written(write.into_record(next)))
            })
            .await
    }

    async fn list(&self, namespace: &str, prefix: &str) -> Result<Vec<Record>, StoreError> {
        check_namespace(namespace)?;
        check_list_prefix(prefix)?;
        // `substr` and `length` count characters alike; the range on `key` serves the index.
        self.0
            .query_records(
                format!(
                    "SELECT {COLUMNS} FROM records r \
                     WHERE r.namespace = ?1 AND r.key >= ?2 \
                     AND substr(r.key, 1, length(?2)) = ?2 \
                     AND r.version = (SELECT max(m.version) FROM records m \
                                      WHERE m.namespace = r.namespace AND m.key = r.key) \
                     ORDER BY r.key"
                ),
                &[namespace, prefix],
                None,
                false,
            )
            .await
    }

    async fn history(&self, namespace: &str, key: &str) -> Result<Vec<Record>, StoreError> {
        check_address(namespace, key)?;
        self.0
            .query_records(
                format!(
                    "SELECT {COLUMNS} FROM records WHERE namespace = ? AND key = ? \
                     ORDER BY version"
                ),
                &[namespace, key],
                None,
                false,
            )
            .await
    }
}
