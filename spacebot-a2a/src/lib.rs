//! The [Agent2Agent protocol](https://a2a-protocol.org) (A2A 1.0) for spacebot, built on
//! spacebot-core's public API alone:
//!
//! - **Server** ([`A2aServer`]): the agents the operator exposes (`a2a_expose = true` in their
//!   `[[agents]]` entry) are served over A2A's JSON-RPC binding: agent cards at
//!   `/.well-known/agent-card.json` (one skill per exposed agent, the bearer scheme),
//!   `SendMessage`, `SendStreamingMessage` and `SubscribeToTask` (server-sent events), `GetTask`,
//!   `CancelTask`. An A2A task is a message delivered to the agent and its final reply, kept in
//!   the organization's records, durable on every backend; a message id sent again answers with
//!   the same task. spacebot-http mounts it ([`A2aServer::router`]).
//! - **Client** ([`RemoteExecutor`]): a remote A2A agent declared as a member
//!   (`[[agents]] id = "x", a2a = "http://...", token = "..."`) sits in the link graph like any
//!   agent; a task delegated to it is run by the A2A client: sent once (a message id derived from
//!   the task, the remote task's id stored), polled until it ends, resumed by the remote task's id
//!   after a restart; an unreachable agent is tried again with backoff, then the task fails with
//!   the reason. Give the executors to the builder ([`remote_executors`]).
//! - **Types** ([`types`]): the A2A 1.0 objects in their JSON form, as PyPI's `a2a-sdk` 1.x
//!   writes them.
//!
//! See `docs/a2a.md`.

mod a2a;
mod client;
mod config;
mod server;
mod store;
pub mod types;

pub use a2a::{A2a, PLATFORM};
pub use client::{REMOTE_NAMESPACE, RemoteExecutor, RemoteMember, RetryPolicy, remote_executors};
pub use config::{A2aConfig, EXPOSE_FIELD, RemoteAgent, TOKEN_FIELD, URL_FIELD};
pub use server::{A2aServer, SKILL_METADATA_KEY};
pub use store::{MESSAGES_NAMESPACE, TASKS_NAMESPACE, TaskRecord};

/// What can go wrong setting A2A up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum A2aError {
    /// The organization was not built with this [`A2a`] handle (as behaviour and outbound).
    #[error(
        "the organization was not built with this A2a handle: give it to the builder as a behaviour and as the outbound"
    )]
    NotAttached,
    /// Called outside a Tokio runtime.
    #[error("spacebot-a2a needs a Tokio runtime")]
    NoRuntime,
    /// No such agent in the organization.
    #[error("no agent {agent:?} in the organization")]
    UnknownAgent {
        /// The id given.
        agent: String,
    },
}
