//! The storage conformance suite of spacebot-core, on redb files in a fresh temporary directory
//! per test.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test helpers fail loudly

use spacebot_redb::{Durability, RedbOptions, RedbStore};

fn fresh_dir() -> std::path::PathBuf {
    tempfile::tempdir().unwrap().keep()
}

// Every store, with the default options (group commit).
spacebot_core::all_store_conformance!(async { spacebot_redb::open(fresh_dir()).unwrap() });

// The task store again with one durable commit per operation and two-phase commits.
spacebot_core::task_store_conformance!(commit_each_two_phase, async {
    RedbStore::open(
        fresh_dir(),
        RedbOptions::default()
            .commit_each()
            .durability(Durability::TwoPhase),
    )
    .unwrap()
});

/// Records, versions and effect keys survive closing and reopening the data directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_survive_reopen() -> Result<(), spacebot_core::conformance::ConformanceError> {
    let dir = fresh_dir();
    spacebot_core::conformance::record_store_survives_reopen(|| {
        let dir = dir.clone();
        async move {
            let store = RedbStore::open_async(&dir, RedbOptions::default()).await?;
            Ok(store as std::sync::Arc<dyn spacebot_core::RecordStore>)
        }
    })
    .await
}
