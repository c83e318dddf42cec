//! Running a statement and decoding its rows, with every error mapped onto [`StoreError`].

use rusqlite::{Connection, Params, Row};
use spacebot_core::StoreError;

use crate::error::{Location, db_error};

/// Runs `sql` (a prepared statement kept by the connection) with `params` and decodes every row.
pub(crate) fn all<T>(
    conn: &Connection,
    location: &Location,
    doing: &str,
    sql: &str,
    params: impl Params,
    mut decode: impl FnMut(&Row<'_>) -> Result<T, StoreError>,
) -> Result<Vec<T>, StoreError> {
    let fail = |e| db_error(location, doing, e);
    let mut statement = conn.prepare_cached(sql).map_err(fail)?;
    let mut rows = statement.query(params).map_err(fail)?;
    let mut out = Vec::new();
    while let Some(row) = rows.next().map_err(fail)? {
        out.push(decode(row)?);
    }
    Ok(out)
}

/// Runs `sql` with `params` and decodes its first row, if any.
pub(crate) fn first<T>(
    conn: &Connection,
    location: &Location,
    doing: &str,
    sql: &str,
    params: impl Params,
    decode: impl FnOnce(&Row<'_>) -> Result<T, StoreError>,
) -> Result<Option<T>, StoreError> {
    let fail = |e| db_error(location, doing, e);
    let mut statement = conn.prepare_cached(sql).map_err(fail)?;
    let mut rows = statement.query(params).map_err(fail)?;
    match rows.next().map_err(fail)? {
        Some(row) => decode(row).map(Some),
        None => Ok(None),
    }
}

/// Runs `sql` (which returns no rows) with `params`; the number of rows it changed, or the
/// driver's error as it is (for callers that tell constraint violations apart).
pub(crate) fn execute(
    conn: &Connection,
    sql: &str,
    params: impl Params,
) -> Result<usize, rusqlite::Error> {
    conn.prepare_cached(sql)?.execute(params)
}

/// Reads column `name` of `row`, mapping a value that does not decode onto damage.
pub(crate) fn get<T: rusqlite::types::FromSql>(
    location: &Location,
    doing: &str,
    row: &Row<'_>,
    name: &str,
) -> Result<T, StoreError> {
    row.get(name).map_err(|e| db_error(location, doing, e))
}
