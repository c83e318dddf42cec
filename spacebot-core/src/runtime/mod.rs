//! The agent runtime.
