//! The bundle of stores an organization runs on.

use std::sync::Arc;

use crate::channel::ChannelStore;
use crate::conversation::ConversationStore;
use crate::envelope::DeliveryStore;
use crate::link::LinkStore;
use crate::records::RecordStore;
use crate::task::TaskStore;

/// Every store the runtime needs. Backends build one of these (`spacebot_sqlite::open`,
/// `spacebot_redb::open`, [`Stores::memory`](crate::memory)).
#[derive(Debug, Clone)]
pub struct Stores {
    /// Links (instance-wide).
    pub links: Arc<dyn LinkStore>,
    /// Conversation links (instance-wide).
    pub conversations: Arc<dyn ConversationStore>,
    /// Task boards and outboxes (per agent).
    pub tasks: Arc<dyn TaskStore>,
    /// Channel histories (per agent).
    pub channels: Arc<dyn ChannelStore>,
    /// Pending deliveries and applied keys (per agent).
    pub deliveries: Arc<dyn DeliveryStore>,
    /// Behaviours' own records: keyed, versioned, in a namespace per behaviour (instance-wide;
    /// see [`records`](crate::records)).
    pub records: Arc<dyn RecordStore>,
}

impl Stores {
    /// Closes every store, waiting for the operations in progress, and releases what the backends
    /// hold: a SQLite or redb data directory's lock (the directory can be opened again as soon as
    /// this returns), a PostgreSQL pool. Calls made afterwards through any clone fail with
    /// [`StoreError::Backend`](crate::StoreError::Backend). Dropping the last clone releases the
    /// same in the background; `close` is for when the caller must know it is done. Shut the
    /// organization down first ([`Organization::shutdown`](crate::Organization::shutdown)).
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// let stores = spacebot_core::Stores::memory();
    /// stores.close().await; // in-memory stores hold nothing to release
    /// # });
    /// ```
    pub async fn close(&self) {
        self.records.release().await;
        self.deliveries.release().await;
        self.channels.release().await;
        self.tasks.release().await;
        self.conversations.release().await;
        self.links.release().await;
    }
}
