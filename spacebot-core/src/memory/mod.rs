//! In-memory backends of every store.
//!
//! These are the reference implementations of the store traits: they follow each trait's
//! "# Contract" to the letter and are what the conformance suite (feature `conformance`) is checked
//! against first. They keep everything in process memory behind a [`std::sync::Mutex`] (never held
//! across an `.await`), need no async runtime, and lose everything when dropped: use them in tests,
//! examples and applications that do not need durability.
//!
//! ```
//! use spacebot_core::Stores;
//! let stores = Stores::memory();
//! # let _ = stores;
//! ```

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::stores::Stores;

mod channel;
mod conversation;
mod delivery;
mod link;
mod records;
mod task;

pub use channel::MemoryChannelStore;
pub use conversation::MemoryConversationStore;
pub use delivery::MemoryDeliveryStore;
pub use link::MemoryLinkStore;
pub use records::MemoryRecordStore;
pub use task::MemoryTaskStore;

impl Stores {
    /// Every store in memory: a fresh, empty [`MemoryLinkStore`], [`MemoryConversationStore`],
    /// [`MemoryTaskStore`], [`MemoryChannelStore`], [`MemoryDeliveryStore`] and
    /// [`MemoryRecordStore`]. The delivery
    /// store's commits append their records to the bundle's channel store.
    pub fn memory() -> Stores {
        let channels = Arc::new(MemoryChannelStore::new());
        Stores {
            links: Arc::new(MemoryLinkStore::new()),
            conversations: Arc::new(MemoryConversationStore::new()),
            tasks: Arc::new(MemoryTaskStore::new()),
            channels: channels.clone(),
            deliveries: Arc::new(MemoryDeliveryStore::with_channels(channels)),
            records: Arc::new(MemoryRecordStore::new()),
        }
    }
}

/// Locks `mutex`, recovering the data if a thread panicked while holding it.
///
/// Every critical section in this module computes the new state first and only then writes it, so a
/// poisoned lock never guards a half-applied change.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
