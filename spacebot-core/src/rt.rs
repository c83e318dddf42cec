//! Tokio implementations of Spawner and Clock.
