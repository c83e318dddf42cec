//! [`CellImages`] on the instance database (table `cells`): the images of the record store's
//! typed cells (see [`SqliteRecordStore`](crate::SqliteRecordStore)).

use async_trait::async_trait;
use rusqlite::params;
use spacebot_core::StoreError;
use spacebot_core::records::{CellImage, CellImages};

use crate::db::Db;
use crate::error::{corrupt, db_error};
use crate::query;

/// A cell's image, else the latest record at its address (a value written before cells existed,
/// revision 0).
const LOAD: &str = "SELECT revision, value, 0 AS source FROM cells WHERE namespace = ?1 AND key = ?2 \
     UNION ALL \
     SELECT 0, value, 1 FROM (SELECT value FROM records WHERE namespace = ?1 AND key = ?2 \
     ORDER BY version DESC LIMIT 1) \
     ORDER BY source LIMIT 1";

/// Stores `rows` images at once, each unless the stored one is as recent.
fn store_sql(rows: usize) -> String {
    let values = vec!["(?, ?, ?, ?)"; rows].join(", ");
    format!(
        "INSERT INTO cells (namespace, key, revision, value) VALUES {values} \
         ON CONFLICT (namespace, key) DO UPDATE SET revision = excluded.revision, \
         value = excluded.value WHERE excluded.revision > cells.revision"
    )
}

/// The row counts of the statements that store many images: as many of the largest as fit, then
/// of the next; the rest one by one (three statements kept prepared, whatever the count).
const CHUNKS: [usize; 3] = [32, 8, 1];

/// The statements of [`CHUNKS`], made once.
fn statements() -> &'static [String; 3] {
    static STATEMENTS: std::sync::OnceLock<[String; 3]> = std::sync::OnceLock::new();
    STATEMENTS.get_or_init(|| CHUNKS.map(store_sql))
}

/// The images of one directory's typed cells, in its instance database. One process owns a data
/// directory (its lock), so the cells in that process's memory are the values and these their
/// durable copy.
#[derive(Debug)]
pub(crate) struct SqliteCellImages {
    pub(crate) db: Db,
}

#[async_trait]
impl CellImages for SqliteCellImages {
    async fn load(&self, namespace: &str, key: &str) -> Result<Option<(u64, String)>, StoreError> {
        let location = self.db.location.clone();
        let (namespace, key) = (namespace.to_owned(), key.to_owned());
        self.db
            .read_short("reading a cell's image", move |conn| {
                query::first(
                    conn,
                    &location,
                    "reading a cell's image",
                    LOAD,
                    params![namespace, key],
                    |row| {
                        let read = |e| db_error(&location, "reading a cell's image", e);
                        let revision: i64 = row.get(0).map_err(read)?;
                        let value: String = row.get(1).map_err(read)?;
                        let revision = u64::try_from(revision).map_err(|_| {
                            corrupt(
                                &location,
                                format!("cell {namespace}/{key:?} has a negative revision"),
                            )
                        })?;
                        Ok((revision, value))
                    },
                )
            })
            .await
    }

    async fn store(&self, images: Vec<CellImage>) -> Result<(), StoreError> {
        if images.is_empty() {
            return Ok(());
        }
        let location = self.db.location.clone();
        // Each row a whole image: no savepoint of its own needed in its batch.
        self.db
            .writes
            .run_unguarded(move |conn| {
                let mut rest: &[CellImage] = &images;
                for (rows, sql) in CHUNKS.iter().zip(statements()) {
                    while rest.len() >= *rows {
                        let (chunk, after) = rest.split_at(*rows);
                        let revisions = chunk
                            .iter()
                            .map(|image| {
                                i64::try_from(image.revision).map_err(|_| StoreError::Backend {
                                    backend: crate::error::BACKEND,
                                    message: format!(
                                        "cell {}/{:?}: revision {} is past what {location} holds",
                                        image.namespace, image.key, image.revision
                                    ),
                                    source: None,
                                })
                            })
                            .collect::<Result<Vec<i64>, StoreError>>()?;
                        let mut values: Vec<&dyn rusqlite::ToSql> = Vec::with_capacity(rows * 4);
                        for (image, revision) in chunk.iter().zip(&revisions) {
                            values.extend([
                                &image.namespace as &dyn rusqlite::ToSql,
                                &image.key,
                                revision,
                                &image.value,
                            ]);
                        }
                        query::execute(conn, sql, rusqlite::params_from_iter(values))
                            .map_err(|e| db_error(&location, "storing cells' images", e))?;
                        rest = after;
                    }
                }
                Ok(())
            })
            .await
    }
}
