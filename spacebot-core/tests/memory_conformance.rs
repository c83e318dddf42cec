//! The storage conformance suite on the in-memory backends: directly, through `Arc<dyn ...>` (the
//! forwarding impls), and as the `Stores::memory()` bundle.
#![cfg(feature = "conformance")]

use std::sync::Arc;

use spacebot_core::Stores;
use spacebot_core::channel::ChannelStore;
use spacebot_core::conversation::ConversationStore;
use spacebot_core::envelope::DeliveryStore;
use spacebot_core::link::LinkStore;
use spacebot_core::memory::{
    MemoryChannelStore, MemoryConversationStore, MemoryDeliveryStore, MemoryLinkStore,
    MemoryRecordStore, MemoryTaskStore,
};
use spacebot_core::records::RecordStore;
use spacebot_core::task::TaskStore;

spacebot_core::link_store_conformance!(async { MemoryLinkStore::new() });
spacebot_core::task_store_conformance!(async { MemoryTaskStore::new() });
spacebot_core::channel_store_conformance!(async { MemoryChannelStore::new() });
spacebot_core::delivery_store_conformance!(async { MemoryDeliveryStore::default() });
spacebot_core::conversation_store_conformance!(async { MemoryConversationStore::new() });
spacebot_core::record_store_conformance!(async { MemoryRecordStore::new() });
spacebot_core::placement_conformance!(async { spacebot_core::MemoryPlacement::new() });
spacebot_core::placement_conformance!(placement_through_arc_dyn, async {
    Arc::new(spacebot_core::MemoryPlacement::new()) as Arc<dyn spacebot_core::Placement>
});

mod through_arc_dyn {
    use super::*;

    spacebot_core::link_store_conformance!(links, async {
        Arc::new(MemoryLinkStore::new()) as Arc<dyn LinkStore>
    });
    spacebot_core::task_store_conformance!(tasks, async {
        Arc::new(MemoryTaskStore::new()) as Arc<dyn TaskStore>
    });
    spacebot_core::channel_store_conformance!(channels, async {
        Arc::new(MemoryChannelStore::new()) as Arc<dyn ChannelStore>
    });
    spacebot_core::delivery_store_conformance!(deliveries, async {
        Arc::new(MemoryDeliveryStore::new()) as Arc<dyn DeliveryStore>
    });
    spacebot_core::conversation_store_conformance!(conversations, async {
        Arc::new(MemoryConversationStore::new()) as Arc<dyn ConversationStore>
    });
    spacebot_core::record_store_conformance!(records, async {
        Arc::new(MemoryRecordStore::new()) as Arc<dyn RecordStore>
    });
}

/// A memory store is its own "reopen": the same store each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_records_through_reopen() -> Result<(), spacebot_core::conformance::ConformanceError>
{
    let store: Arc<dyn RecordStore> = Arc::new(MemoryRecordStore::new());
    spacebot_core::conformance::record_store_survives_reopen(|| {
        let store = store.clone();
        async move { Ok(store) }
    })
    .await
}

spacebot_core::all_store_conformance!(bundle, async { Stores::memory() });

#[test]
fn memory_deliveries_are_not_durable() {
    assert!(!MemoryDeliveryStore::new().is_durable());
    assert!(!Stores::memory().deliveries.is_durable());
    let as_dyn: Arc<dyn DeliveryStore> = Arc::new(MemoryDeliveryStore::new());
    assert!(!as_dyn.is_durable(), "through Arc<dyn DeliveryStore>");
}
