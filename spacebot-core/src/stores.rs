//! The bundle of stores an organization runs on.

use std::sync::Arc;

use crate::channel::ChannelStore;
use crate::conversation::ConversationStore;
use crate::envelope::DeliveryStore;
use crate::link::LinkStore;
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
}
