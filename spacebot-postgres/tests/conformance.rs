//! The storage conformance suite of spacebot-core, on PostgreSQL: each store on its own and the
//! whole bundle, every test in a new schema of the database at `DATABASE_URL`.
//!
//! Without `DATABASE_URL` a throwaway server is started where the server binaries are installed
//! (`spacebot_core::testing::external::database_url`); where neither is at hand the suite is not
//! compiled and one ignored test, `conformance_suite_not_run`, says why (`cfg(spacebot_pg)`, set
//! by the build script). Under `SPACEBOT_REQUIRE_POSTGRES=1` (CI) it always runs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

/// Evaluates to a future of `$access` on fresh stores, or returns from the test (which passes)
/// when there is no database to run on. The conformance macros insert this block in each test's
/// body, so its `return` ends that test.
#[cfg(spacebot_pg)]
macro_rules! fresh {
    ($stores:ident => $access:expr) => {{
        let Some($stores) = support::fresh().await else {
            return Ok(());
        };
        std::future::ready($access)
    }};
}

#[cfg(not(spacebot_pg))]
#[test]
#[ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README"]
fn conformance_suite_not_run() {}

#[cfg(spacebot_pg)]
mod suite {
    use super::support;

    spacebot_core::link_store_conformance!(links, fresh!(s => s.links()));
    spacebot_core::task_store_conformance!(tasks, fresh!(s => s.tasks()));
    spacebot_core::channel_store_conformance!(channels, fresh!(s => s.channels()));
    spacebot_core::delivery_store_conformance!(deliveries, fresh!(s => s.deliveries()));
    spacebot_core::conversation_store_conformance!(conversations, fresh!(s => s.conversations()));
    spacebot_core::record_store_conformance!(records, fresh!(s => s.records()));

    spacebot_core::all_store_conformance!(bundle, fresh!(s => s.stores()));

    spacebot_core::placement_conformance!(placement, fresh!(s => s.placement()));
}
