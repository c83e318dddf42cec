//! The storage conformance suite of spacebot-core, on SQLite: files in a temporary directory
//! (each store on its own, and the whole bundle) and in-memory databases.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use spacebot_sqlite::SqliteStores;

async fn on_disk() -> SqliteStores {
    SqliteStores::temporary().await.unwrap()
}

async fn in_memory() -> SqliteStores {
    SqliteStores::in_memory().await.unwrap()
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
