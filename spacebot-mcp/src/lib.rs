//! MCP tools for spacebot agents: the tools of [Model Context Protocol](https://modelcontextprotocol.io)
//! servers, on the official Rust SDK `rmcp`, granted per agent and checked in code on every
//! call. A behaviour built on spacebot-core's public API alone
//! ([`Behaviour`](spacebot_core::Behaviour), [`ToolSet`](spacebot_core::tools::ToolSet),
//! [`AgentConfig::fields`](spacebot_core::config::AgentConfig::fields)).
//!
//! - **Servers** come from `[[mcp_servers]]`: a child process over stdio (`command`, `args`,
//!   `env`, `cwd`) or a streamable HTTP endpoint (`url`, `headers`, `bearer_token`); started
//!   lazily (when the first agent granted one of their tools starts) or eagerly
//!   (`Organization::start_all` waits for them); started again with a doubling backoff when they
//!   die, their calls answered to the model as errors meanwhile; `notifications/tools/list_changed`
//!   lists their tools again. Every invalid entry is a configuration error naming the entry and
//!   the field ([`McpConfig::from_org`]).
//! - **Grants** per agent: `[[agents]] tools = ["files:*", "search:query"]`, and at run time
//!   [`Mcp::grant`] / [`Mcp::revoke`]. The model sees only its granted tools, named
//!   `{server}__{tool}` ([`exposed_name`]); a call naming any other tool is refused in code as an
//!   unknown tool, whatever the model names.
//! - **Calls**: the arguments are checked against the tool's input schema first (errors go back
//!   to the model), the call runs within the server's `timeout_ms`, its result (text, structured
//!   content, resources, placeholders for images and audio) is cut at `max_result_bytes`, and a
//!   turn that is cancelled cancels its calls (`notifications/cancelled`).
//! - **The organization as an MCP server** ([`OrgServer`]): the agents the operator exposes
//!   (`mcp_expose = true`) are the tools `ask_{agent}`, answered with the agent's final reply and
//!   told in progress notifications meanwhile; the topology and the task boards are resources;
//!   over streamable HTTP (spacebot-http mounts it at `/mcp`) or stdio (`spacebot mcp`).
//! - **Effects**: the call's idempotency key (the runtime's `ToolContext::key`) goes to the
//!   server in `_meta` under [`IDEMPOTENCY_META_KEY`]. An MCP call is an external effect: after
//!   a crash mid-turn the turn runs again and so may the call (see `docs/mcp.md`).
//!
//! ```no_run
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use spacebot_core::{OrgConfig, Organization, Stores, testing::ScriptedLlm};
//! use spacebot_mcp::Mcp;
//!
//! let config = OrgConfig::from_toml_str(r#"
//!     [[agents]]
//!     id = "support"
//!     tools = ["files:*"]
//!     [[mcp_servers]]
//!     id = "files"
//!     command = "python3"
//!     args = ["files_server.py"]
//!     start = "eager"
//! "#)?;
//! let mcp = Mcp::new();
//! let org = Organization::builder(config)
//!     .stores(Stores::memory())
//!     .llm(Arc::new(ScriptedLlm::new()))
//!     .behaviour(Arc::new(mcp.clone()))
//!     .build()
//!     .await?;
//! org.start_all().await?;
//! println!("{:?}", mcp.tool_names("files"));
//! # Ok(())
//! # }
//! ```

mod approvals;
mod config;
mod mcp;
mod names;
mod result;
mod serve;
mod server;

pub use approvals::{APPROVALS_NAMESPACE, ApprovalStatus, PendingCall};
pub use config::{
    AGENT_FIELD, DEFAULT_MAX_RESULT_BYTES, DEFAULT_TIMEOUT, EXPOSE_FIELD, Grant, MAX_ID_LEN,
    McpConfig, SECTION, ServerConfig, Start, Transport,
};
pub use mcp::{Mcp, McpError};
pub use names::{MAX_NAME_LEN, exposed_name};
pub use serve::{McpChat, OrgServer, PLATFORM, TASKS_URI, TOPOLOGY_URI};
pub use server::{IDEMPOTENCY_META_KEY, ServerState};
