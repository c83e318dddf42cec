//! Run an organization of LLM agents inside your application.
//!
//! Agents are joined by policy-checked links (who may start an exchange with whom, who is whose
//! superior); they delegate durable tasks to each other, hold conversations that always end, and
//! each has one steerable inbound queue. Storage and the model are traits, with SQLite, redb,
//! PostgreSQL and an OpenAI-compatible provider behind features; everything runs offline in tests
//! with the mock LLM of `spacebot::testing` (feature `testing`).
//!
//! This crate is the facade applications depend on: it re-exports [`spacebot_core`] (the domain,
//! the traits, the policy, the runtime and the in-memory backends) and, by feature, the backend
//! crates as modules. Authors of backends and providers depend on `spacebot-core` alone.
//!
//! # Quick tour
//!
//! ```
//! use spacebot::config::OrgConfig;
//! use spacebot::policy::{check_start, org_chart};
//! use spacebot::topology::Topology;
//! use spacebot::AgentId;
//!
//! let config = OrgConfig::from_toml_str(r#"
//!     [[agents]]
//!     id = "chief"
//!     [[agents]]
//!     id = "lead"
//!     [[links]]
//!     from = "chief"
//!     to = "lead"
//!     direction = "one_way"
//!     relationship = "superior"
//! "#)?;
//! let graph = config.graph();
//! let (chief, lead) = (AgentId::parse("chief")?, AgentId::parse("lead")?);
//! assert_eq!(org_chart(&graph, &lead).superiors, vec![chief.clone()]);
//! assert!(check_start(&graph, &chief, &lead).is_ok());
//! assert!(check_start(&graph, &lead, &chief).is_err()); // one-way: lead may only answer
//! println!("{}", Topology::from_config(&config).to_mermaid());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Features
//!
//! | Name | Description | Default? |
//! |---|---|---|
//! | `tokio` | `TokioSpawner` and `TokioClock` in `spacebot::rt` | yes |
//! | `sqlite` | the SQLite backends, as `spacebot::sqlite` (implies `tokio`) | yes |
//! | `redb` | the redb backends, as `spacebot::redb` (implies `tokio`) | no |
//! | `postgres` | the PostgreSQL backends, as `spacebot::postgres`: one database for many agents and several processes (implies `tokio`) | no |
//! | `openai` | the OpenAI-compatible Chat Completions provider, as `spacebot::openai` (implies `tokio`) | no |
//! | `http` | the HTTP API, event stream and dashboard, as `spacebot::http` (implies `tokio`; see `docs/http.md`) | no |
//! | `notes` | shared notes (versioned, per-agent grants), as `spacebot::notes` (see `docs/notes.md`) | yes |
//! | `mcp` | agents use MCP servers' tools, granted per agent, as `spacebot::mcp` (see `docs/mcp.md`) | no |
//! | `a2a` | the Agent2Agent protocol (A2A 1.0): exposed agents served, remote agents as members, as `spacebot::a2a` (see `docs/a2a.md`) | no |
//! | `testing` | the mock LLMs and a recording event sink, in `spacebot::testing` | no |
//! | `otel` | OpenTelemetry export of the runtime's spans and metrics over OTLP/HTTP, configured from the `OTEL_*` variables, as `spacebot::otel` (see `docs/observability.md`) | no |
//!
//! See `docs/concepts.md` in the repository for agents, links, channels, tasks and conversations.

#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]

pub use spacebot_core::*;

/// SQLite backends of every store (`spacebot-sqlite`).
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub mod sqlite {
    pub use spacebot_sqlite::*;
}

/// redb backends of every store (`spacebot-redb`).
#[cfg(feature = "redb")]
#[cfg_attr(docsrs, doc(cfg(feature = "redb")))]
pub mod redb {
    pub use spacebot_redb::*;
}

/// PostgreSQL backends of every store (`spacebot-postgres`).
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres {
    pub use spacebot_postgres::*;
}

/// The OpenAI-compatible Chat Completions provider (`spacebot-openai`).
#[cfg(feature = "openai")]
#[cfg_attr(docsrs, doc(cfg(feature = "openai")))]
pub mod openai {
    pub use spacebot_openai::*;
}

/// The HTTP API, event stream, web chat and dashboard (`spacebot-http`).
#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub mod http {
    pub use spacebot_http::*;
}

/// Shared notes: named, versioned notes agents read and write under per-agent grants
/// (`spacebot-notes`; see `docs/notes.md`).
#[cfg(feature = "notes")]
#[cfg_attr(docsrs, doc(cfg(feature = "notes")))]
pub mod notes {
    pub use spacebot_notes::*;
}

#[cfg(feature = "otel")]
#[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
pub mod otel;

/// MCP tools for agents: the tools of Model Context Protocol servers, granted per agent and
/// checked in code on every call (`spacebot-mcp`; see `docs/mcp.md`).
#[cfg(feature = "mcp")]
#[cfg_attr(docsrs, doc(cfg(feature = "mcp")))]
pub mod mcp {
    pub use spacebot_mcp::*;
}

/// The Agent2Agent protocol (A2A 1.0): exposed agents served over JSON-RPC and SSE with durable
/// tasks (`spacebot-a2a`; see `docs/a2a.md`).
#[cfg(feature = "a2a")]
#[cfg_attr(docsrs, doc(cfg(feature = "a2a")))]
pub mod a2a {
    pub use spacebot_a2a::*;
}
