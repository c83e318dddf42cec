//! Connection settings.

use std::time::Duration;

use spacebot_core::StoreError;

use crate::PgStores;
use crate::error::invalid;

/// How [`PgStores`] connects. Build with [`PgOptions::new`] and the setters, then call
/// [`PgOptions::connect`].
///
/// ```no_run
/// # async fn run() -> Result<(), spacebot_core::StoreError> {
/// use spacebot_postgres::PgOptions;
/// use std::time::Duration;
/// let stores = PgOptions::new()
///     .schema("spacebot")
///     .max_connections(20)
///     .acquire_timeout(Duration::from_secs(10))
///     .connect("postgres://spacebot@db.internal/org")
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct PgOptions {
    pub(crate) schema: Option<String>,
    pub(crate) max_connections: u32,
    pub(crate) min_connections: u32,
    pub(crate) acquire_timeout: Duration,
    pub(crate) idle_timeout: Option<Duration>,
    pub(crate) application_name: String,
}

impl Default for PgOptions {
    fn default() -> Self {
        Self {
            schema: None,
            max_connections: 10,
            min_connections: 0,
            acquire_timeout: Duration::from_secs(30),
            idle_timeout: Some(Duration::from_secs(600)),
            application_name: "spacebot".to_string(),
        }
    }
}

impl PgOptions {
    /// The defaults: the connection's own schema (the server's `search_path`, normally `public`),
    /// at most 10 connections, a 30 s acquire timeout, idle connections closed after 10 minutes,
    /// application name `spacebot`.
    pub fn new() -> Self {
        Self::default()
    }

    /// Keeps every table in the schema `name`, created if missing (the connections' `search_path`
    /// is set to it). Several organizations can share one database, one schema each; the
    /// processes of one organization name the same schema.
    ///
    /// The name must be 1 to 63 lowercase ASCII letters, digits or `_`, not starting with a digit,
    /// so that it means the same quoted or not; [`PgOptions::connect`] refuses any other with
    /// [`StoreError::Invalid`].
    pub fn schema(mut self, name: impl Into<String>) -> Self {
        self.schema = Some(name.into());
        self
    }

    /// The most connections of the pool (at least 1). Each store call holds one connection for
    /// the length of its transaction.
    pub fn max_connections(mut self, max: u32) -> Self {
        self.max_connections = max.max(1);
        self
    }

    /// Connections the pool keeps open even when idle.
    pub fn min_connections(mut self, min: u32) -> Self {
        self.min_connections = min;
        self
    }

    /// How long a store call waits for a free connection before failing with a backend error.
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// How long an idle connection is kept (`None`: for ever).
    pub fn idle_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// The `application_name` the connections report (seen in `pg_stat_activity`).
    pub fn application_name(mut self, name: impl Into<String>) -> Self {
        self.application_name = name.into();
        self
    }

    /// Connects to the database at `url` and migrates the schema. See [`PgStores::connect_with`].
    ///
    /// # Errors
    /// As [`PgStores::connect_with`].
    pub async fn connect(self, url: &str) -> Result<PgStores, StoreError> {
        PgStores::connect_with(url, self).await
    }

    /// A new schema of its own, dropped when the last clone of the returned stores is dropped.
    /// See [`PgStores::temporary_with`].
    ///
    /// # Errors
    /// As [`PgStores::temporary_with`].
    pub async fn temporary(self, url: &str) -> Result<PgStores, StoreError> {
        PgStores::temporary_with(url, self).await
    }
}

/// Checks a schema name: 1 to 63 of `[a-z0-9_]`, not starting with a digit.
pub(crate) fn check_schema_name(name: &str) -> Result<(), StoreError> {
    let ok = name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && name.bytes().next().is_some_and(|b| !b.is_ascii_digit());
    if ok {
        Ok(())
    } else {
        Err(invalid(
            "postgres schema",
            format!(
                "{name:?} must be 1 to 63 lowercase ASCII letters, digits or '_', not starting \
                 with a digit"
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names() {
        for good in ["spacebot", "t_0f3a", "_x", "a"] {
            assert!(check_schema_name(good).is_ok(), "{good}");
        }
        let long = "a".repeat(64);
        for bad in [
            "",
            "0a",
            "Spacebot",
            "a-b",
            "a b",
            "a\"b",
            "ä",
            long.as_str(),
        ] {
            assert!(
                matches!(check_schema_name(bad), Err(StoreError::Invalid(_))),
                "{bad}"
            );
        }
    }
}
