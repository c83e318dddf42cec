//! Shared notes for spacebot: named, versioned notes that agents read and write, under per-agent
//! grants checked in code. A behaviour built on spacebot-core's public API alone
//! ([`Behaviour`](spacebot_core::Behaviour), [`BehaviourContext`](spacebot_core::BehaviourContext),
//! [`TypedTool`](spacebot_core::tools::TypedTool), [`Stores::records`](spacebot_core::Stores)).
//!
//! - **Notes** are named (1 to 64 of `a-z 0-9 _ - .`); every write makes a new version, and the
//!   history is kept ([`Notes::history`]).
//! - **Access** is per note and agent: [`Access::Read`] or [`Access::ReadWrite`], from the
//!   configuration's `[[notes]]` tables and at run time ([`Notes::grant`], [`Notes::revoke`]).
//! - **Tools** `list_shared_notes`, `read_shared_note`, `write_shared_note` are offered only to
//!   agents with access to at least one note, and every call is checked against the grants stored
//!   now: an agent without access is refused whatever note it names, a write needs
//!   [`Access::ReadWrite`] on that note, a list shows only the notes the agent may read.
//! - **Writes are compared and set**: a write names the version it was based on; a write based on
//!   an old version is refused and the model is shown the current text and version, so two agents
//!   never silently overwrite each other.
//! - **A write is one of the turn's keyed effects**: the tool call's `ToolContext::key` is the
//!   record's effect key, so a turn run again after a crash does not write twice.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use spacebot_core::{AgentId, OrgConfig, Organization, Stores, testing::ScriptedLlm};
//! use spacebot_notes::{Access, Notes};
//!
//! let config = OrgConfig::from_toml_str(r#"
//!     [[agents]]
//!     id = "support"
//!     [[agents]]
//!     id = "engineering"
//!     [[notes]]
//!     name = "deploy-status"
//!     text = "nothing deployed yet"
//!     readers = ["support"]
//!     writers = ["engineering"]
//! "#)?;
//! let notes = Notes::new();
//! let org = Organization::builder(config)
//!     .stores(Stores::memory())
//!     .llm(Arc::new(ScriptedLlm::new()))
//!     .behaviour(Arc::new(notes.clone()))
//!     .build()
//!     .await?;
//! let v2 = notes.write_as_operator("deploy-status", "v1.4 on staging", 1).await?;
//! assert_eq!(v2.version, 2);
//! // A write based on version 1 again is refused: someone wrote since.
//! assert!(notes.write_as_operator("deploy-status", "stale", 1).await.is_err());
//! notes.grant("deploy-status", &AgentId::parse("support")?, Access::ReadWrite).await?;
//! assert_eq!(notes.history("deploy-status").await?.len(), 2);
//! # drop(org);
//! # Ok(())
//! # }
//! ```
//!
//! See `docs/notes.md` for the configuration, the HTTP routes and what happens at a restart.

mod access;
mod config;
mod model;
mod notes;
mod tools;

pub use access::{AccessRecord, Reconciled, reconcile};
pub use config::{NoteConfig, NotesConfig, SECTION};
pub use model::{
    Access, CONFIG_AUTHOR, DEFAULT_MAX_TEXT, MAX_NAME_LEN, NoteName, NoteSummary, NoteVersion,
    NotesError, OPERATOR,
};
pub use notes::{ACCESS_NAMESPACE, NOTES_NAMESPACE, Notes, Written};
pub use tools::{LIST_TOOL, READ_TOOL, WRITE_TOOL};
