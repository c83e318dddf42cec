//! In-memory backends of every store.
