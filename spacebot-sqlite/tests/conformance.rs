//! The storage conformance suite of spacebot-core, on SQLite: files in a temporary directory
//! (each store on its own, and the whole bundle) and in-memory databases, in both layouts (the
//! organization's one database, the default, and one database per agent).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use spacebot_sqlite::{Layout, SqliteOptions, SqliteStores};

async fn on_disk() -> SqliteStores {
    SqliteStores::temporary().await.unwrap()
}

async fn in_memory() -> SqliteStores {
    SqliteStores::in_memory().await.unwrap()
}

fn per_agent() -> SqliteOptions {
    SqliteOptions::new().layout(Layout::PerAgent)
}

async fn on_disk_per_agent() -> SqliteStores {
    let stores = SqliteStores::temporary_with(per_agent()).await.unwrap();
    assert_eq!(stores.layout(), Layout::PerAgent);
    stores
}

async fn in_memory_per_agent() -> SqliteStores {
    SqliteStores::in_memory_with(per_agent()).await.unwrap()
}

spacebot_core::link_store_conformance!(links_on_disk, async { on_disk().await.links() });
spacebot_core::task_store_conformance!(tasks_on_disk, async { on_disk().await.tasks() });
spacebot_core::channel_store_conformance!(channels_on_disk, async { on_disk().await.channels() });
spacebot_core::delivery_store_conformance!(deliveries_on_disk, async {
    on_disk().await.deliveries()
});
spacebot_core::conversation_store_conformance!(conversations_on_disk, async {
    on_disk().await.conversations()
});

spacebot_core::all_store_conformance!(bundle_on_disk, async { on_disk().await.stores() });
spacebot_core::all_store_conformance!(bundle_in_memory, async { in_memory().await.stores() });
spacebot_core::record_store_conformance!(records_on_disk, async { on_disk().await.records() });

spacebot_core::all_store_conformance!(bundle_on_disk_per_agent, async {
    on_disk_per_agent().await.stores()
});
spacebot_core::all_store_conformance!(bundle_in_memory_per_agent, async {
    in_memory_per_agent().await.stores()
});

/// Records, versions and effect keys survive closing and reopening the data directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_survive_reopen() -> Result<(), spacebot_core::conformance::ConformanceError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    spacebot_core::conformance::record_store_survives_reopen(|| {
        let path = path.clone();
        async move {
            let records = SqliteStores::open(&path).await?.records();
            Ok(std::sync::Arc::new(records) as std::sync::Arc<dyn spacebot_core::RecordStore>)
        }
    })
    .await
}
