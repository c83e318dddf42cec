//! The promises of shared notes on every backend (memory, SQLite, redb, PostgreSQL): a note is
//! created, a write based on an old version is refused with the current text, the history is
//! kept, a keyed write is applied once, also across a reopen, and run-time grants survive it.
//!
//! The PostgreSQL test runs against `DATABASE_URL` or a throwaway server started from the installed
//! binaries; where neither is at hand it is compiled as ignored, with the reason.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::future::Future;

use spacebot_core::Stores;
use spacebot_notes::{Access, Notes, NotesError};
use support::{CONFIG, agent, org};

/// Runs every clause on the storage `open` opens (again: the second call must see what the
/// first stored). `durable`: close the stores between the two.
async fn clauses<F, Fut>(open: F, durable: bool)
where
    F: Fn() -> Fut,
    Fut: Future<Output = Stores>,
{
    let stores = open().await;
    let notes = Notes::new();
    let organization = org(CONFIG, stores.clone(), &notes).await;

    // The configured note's first version.
    let plan = notes.read("plan").await.unwrap();
    let v1 = plan.latest.clone().unwrap();
    assert_eq!(
        (v1.version, v1.text.as_str(), v1.author.as_str()),
        (1, "start", "config")
    );
    assert_eq!(plan.description, "The team's plan");
    assert_eq!(plan.access.get(&agent("c")), Some(&Access::Read));

    // Create: a new note at base version 0; creating it again is a conflict.
    let created = notes.write_as_operator("fresh", "hello", 0).await.unwrap();
    assert_eq!(created.version, 1);
    match notes.write_as_operator("fresh", "again", 0).await {
        Err(NotesError::Conflict {
            current: Some(c), ..
        }) => {
            assert_eq!((c.version, c.text.as_str()), (1, "hello"));
        }
        other => panic!("expected a conflict, got {other:?}"),
    }

    // Compare and set: the second writer based on version 1 is shown the current text.
    let v2 = notes
        .write_as_operator("plan", "ship Friday", 1)
        .await
        .unwrap();
    assert_eq!(v2.version, 2);
    match notes.write_as_operator("plan", "ship Monday", 1).await {
        Err(NotesError::Conflict {
            current: Some(c),
            base_version,
            ..
        }) => {
            assert_eq!(base_version, 1);
            assert_eq!((c.version, c.text.as_str()), (2, "ship Friday"));
        }
        other => panic!("expected a conflict, got {other:?}"),
    }

    // A keyed write (a turn's effect) is applied once.
    let first = notes
        .write_as_agent(
            "plan",
            "ship Friday, then rest",
            2,
            &agent("a"),
            "turn-1/call-1",
        )
        .await
        .unwrap();
    assert!(first.fresh);
    assert_eq!(first.version.version, 3);
    let again = notes
        .write_as_agent(
            "plan",
            "ship Friday, then rest",
            2,
            &agent("a"),
            "turn-1/call-1",
        )
        .await
        .unwrap();
    assert!(!again.fresh, "the same effect key wrote twice");
    assert_eq!(again.version, first.version);

    // History, oldest first.
    let history = notes.history("plan").await.unwrap();
    let texts: Vec<_> = history.iter().map(|v| v.text.as_str()).collect();
    assert_eq!(texts, ["start", "ship Friday", "ship Friday, then rest"]);
    let authors: Vec<_> = history.iter().map(|v| v.author.as_str()).collect();
    assert_eq!(authors, ["config", "operator", "a"]);

    // A run-time grant and a run-time revocation.
    notes
        .grant("plan", &agent("d"), Access::ReadWrite)
        .await
        .unwrap();
    notes.revoke("plan", &agent("c")).await.unwrap();
    assert!(matches!(
        notes.read("nothing-here").await,
        Err(NotesError::NotFound { .. })
    ));

    organization.shutdown().await.unwrap();
    drop(organization);
    if durable {
        stores.close().await;
    }
    drop(stores);

    // Reopened: everything is there, the keyed write is still applied once, the run-time grants
    // survive (the configuration did not change).
    let stores = open().await;
    let notes = Notes::new();
    let organization = org(CONFIG, stores.clone(), &notes).await;
    let again = notes
        .write_as_agent(
            "plan",
            "ship Friday, then rest",
            2,
            &agent("a"),
            "turn-1/call-1",
        )
        .await
        .unwrap();
    assert!(!again.fresh, "the effect key wrote again after a reopen");
    assert_eq!(again.version.version, 3);
    assert_eq!(notes.history("plan").await.unwrap().len(), 3);
    assert_eq!(notes.history("fresh").await.unwrap().len(), 1);
    let access = notes.access("plan").await.unwrap();
    assert_eq!(access.get(&agent("d")), Some(&Access::ReadWrite));
    assert_eq!(
        access.get(&agent("c")),
        None,
        "a run-time revocation was undone"
    );
    assert_eq!(access.get(&agent("a")), Some(&Access::ReadWrite));
    let names: Vec<_> = notes
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|n| n.name.to_string())
        .collect();
    assert_eq!(names, ["fresh", "plan", "secret"]);
    organization.shutdown().await.unwrap();
    if durable {
        stores.close().await;
    }
}

#[tokio::test]
async fn memory() {
    let stores = Stores::memory();
    clauses(|| std::future::ready(stores.clone()), false).await;
}

#[tokio::test]
async fn sqlite() {
    let dir = tempfile::tempdir().unwrap();
    clauses(
        || async { spacebot_sqlite::open(dir.path()).await.unwrap() },
        true,
    )
    .await;
}

#[tokio::test]
async fn redb() {
    let dir = tempfile::tempdir().unwrap();
    clauses(
        || async { spacebot_redb::open_async(dir.path()).await.unwrap() },
        true,
    )
    .await;
}

#[tokio::test]
#[cfg_attr(
    not(spacebot_pg),
    ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README"
)]
async fn postgres() {
    let Some(url) = spacebot_core::testing::external::database_url() else {
        return;
    };
    let options = || spacebot_postgres::PgOptions::new().max_connections(4);
    let schema_owner = spacebot_postgres::PgStores::temporary_with(&url, options())
        .await
        .unwrap();
    let schema = schema_owner.schema().unwrap().to_owned();
    clauses(
        || async {
            spacebot_postgres::PgStores::connect_with(&url, options().schema(schema.clone()))
                .await
                .unwrap()
                .stores()
        },
        true,
    )
    .await;
    drop(schema_owner);
}
