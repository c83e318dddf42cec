//! Fresh stores for each test, in a schema of their own in the database at `DATABASE_URL`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    dead_code,
    unreachable_pub
)]

use spacebot_postgres::{PgOptions, PgStores};

/// The database the tests use, or `None` (after saying so on stderr) when `DATABASE_URL` is not
/// set. Under CI (`SPACEBOT_REQUIRE_POSTGRES=1`) a missing `DATABASE_URL` fails the test instead.
pub fn database_url() -> Option<String> {
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ => {
            if std::env::var("SPACEBOT_REQUIRE_POSTGRES").as_deref() == Ok("1") {
                panic!(
                    "DATABASE_URL not set but SPACEBOT_REQUIRE_POSTGRES=1: the PostgreSQL tests \
                     must run; start a server with `eval \"$(.ci/postgres start)\"` (see README)"
                );
            }
            eprintln!("DATABASE_URL not set: PostgreSQL tests not run; see README");
            None
        }
    }
}

/// Options for tests: a small pool (tests run in parallel against one server).
pub fn options() -> PgOptions {
    PgOptions::new().max_connections(4)
}

/// Stores in a new schema, dropped with the last clone; `None` without `DATABASE_URL`.
pub async fn fresh() -> Option<PgStores> {
    let url = database_url()?;
    Some(options().temporary(&url).await.unwrap())
}
