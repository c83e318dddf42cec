//! Reading columns: free text is stored as BYTEA (UTF-8), so that NUL survives; numbers as
//! BIGINT.

use spacebot_core::StoreError;
use sqlx::Row;
use sqlx::postgres::PgRow;

use crate::error::{corrupt, db_error};

/// Reads columns of one row of `what` (`"task lead#4"`), naming it in every error.
#[derive(Clone, Copy)]
pub(crate) struct Reader<'r> {
    pub(crate) row: &'r PgRow,
    pub(crate) location: &'r str,
    pub(crate) what: &'r str,
}

impl Reader<'_> {
    /// A column of any type sqlx decodes directly.
    pub(crate) fn get<'a, T>(&'a self, column: &str) -> Result<T, StoreError>
    where
        T: sqlx::Decode<'a, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
    {
        self.row.try_get(column).map_err(|e| {
            db_error(
                self.location,
                &format!("reading {} of {}", column, self.what),
                e,
            )
        })
    }

    /// A BYTEA column holding UTF-8 text.
    pub(crate) fn text(&self, column: &str) -> Result<String, StoreError> {
        let bytes: Vec<u8> = self.get(column)?;
        self.utf8(column, bytes)
    }

    /// A nullable BYTEA column holding UTF-8 text.
    pub(crate) fn opt_text(&self, column: &str) -> Result<Option<String>, StoreError> {
        let bytes: Option<Vec<u8>> = self.get(column)?;
        bytes.map(|b| self.utf8(column, b)).transpose()
    }

    /// A BIGINT column that must fit a `u64` (not negative).
    pub(crate) fn u64(&self, column: &str) -> Result<u64, StoreError> {
        let v: i64 = self.get(column)?;
        u64::try_from(v).map_err(|_| self.bad(column, format!("{v} is negative")))
    }

    /// A BIGINT column that must fit a `u32`.
    pub(crate) fn u32(&self, column: &str) -> Result<u32, StoreError> {
        let v: i64 = self.get(column)?;
        u32::try_from(v).map_err(|_| self.bad(column, format!("{v} is out of range")))
    }

    /// A [`StoreError::Corrupt`] about `column`.
    pub(crate) fn bad(&self, column: &str, why: impl std::fmt::Display) -> StoreError {
        corrupt(self.location, format!("{}: {column}: {why}", self.what))
    }

    fn utf8(&self, column: &str, bytes: Vec<u8>) -> Result<String, StoreError> {
        String::from_utf8(bytes).map_err(|e| self.bad(column, format!("not UTF-8: {e}")))
    }
}

/// A `u64` (task number, revision) as BIGINT, `None` if it does not fit.
pub(crate) fn to_sql(v: u64) -> Option<i64> {
    i64::try_from(v).ok()
}

/// A `u64` that must fit a BIGINT when written (a revision): else a refusal naming `what`.
pub(crate) fn to_sql_or(location: &str, what: &str, v: u64) -> Result<i64, StoreError> {
    to_sql(v).ok_or_else(|| corrupt(location, format!("{what} {v} is out of range")))
}

/// A `usize` limit as BIGINT (saturating).
pub(crate) fn limit(v: usize) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}
