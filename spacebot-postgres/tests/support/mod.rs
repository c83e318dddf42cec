//! Fresh stores for each test, in a schema of their own in the database at `DATABASE_URL`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    dead_code,
    unreachable_pub
)]

use spacebot_postgres::{PgOptions, PgStores};

/// The database the tests use (`DATABASE_URL`, or a throwaway server started from the installed
/// binaries), or `None` after saying why on stderr. Under CI (`SPACEBOT_REQUIRE_POSTGRES=1`) a
/// missing server fails the test instead.
pub fn database_url() -> Option<String> {
    spacebot_core::testing::external::database_url()
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
