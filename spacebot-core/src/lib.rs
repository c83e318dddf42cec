//! Traits, domain model, pure state machines and runtime of spacebot: an organization of LLM agents
//! in your process, wired by a policy-checked graph of links, delegating work as durable tasks,
//! holding conversations that always end, each agent with one steerable inbound queue.
//!
//! # Layers
//!
//! | layer | modules |
//! |---|---|
//! | facade | [`Organization`] ([`org`], [`org_api`]), [`OrganizationBuilder`] ([`org_builder`]) |
//! | behaviours | [`delegation`] ([`delegation::Delegation`]), [`dialogue`] ([`dialogue::Conversations`]), plugged in through [`Behaviour`] |
//! | host | [`runtime`]: queues, the agent loop, turns, steering, outbound |
//! | pure cores | [`task::Task::apply`], [`policy`], [`runtime::steer`], [`runtime::history`] |
//! | traits and stores | [`Stores`]: [`LinkStore`], [`TaskStore`], [`ChannelStore`], [`ConversationStore`], [`DeliveryStore`], [`RecordStore`] ([`records`]: behaviours' own storage); [`memory`] |
//!
//! # A first organization
//!
//! ```
//! # #[cfg(all(feature = "tokio", feature = "testing"))]
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! use std::sync::Arc;
//! use futures::StreamExt;
//! use spacebot_core::llm::ChatResponse;
//! use spacebot_core::testing::FnLlm;
//! use spacebot_core::{InboundMessage, OrgConfig, Organization, Stores};
//!
//! let config = OrgConfig::from_toml_str("[[agents]]\nid = \"support\"\nname = \"Support\"\n").unwrap();
//! let llm = Arc::new(FnLlm::new(|_| Ok(ChatResponse::text("Hello! How can I help?"))));
//! let org = Organization::builder(config).stores(Stores::memory()).llm(llm).build().await.unwrap();
//! org.start_all().await.unwrap();
//! let mut replies = org.take_replies().unwrap();
//! let id = org.deliver("support", InboundMessage::new("portal", "chat-1", "Hi")).await.unwrap();
//! let reply = replies.next().await.unwrap();
//! assert_eq!(reply.in_reply_to, vec![id]);
//! assert_eq!(reply.content, "Hello! How can I help?");
//! # });
//! ```
//!
//! # Features
//!
//! | feature | what it adds | default |
//! |---|---|---|
//! | `tokio` | [`rt::TokioSpawner`], [`rt::TokioClock`]; the builder uses them when given none | no |
//! | `testing` | [`testing`]: `ScriptedLlm`, `MockLlm::pair`, `FnLlm`, `RecordingSink`, and with `tokio` the `OrgHarness` | no |
//! | `conformance` | [`conformance`]: the suite every store backend runs | no |
//!
//! # Guides
//!
//! In the repository's `docs/`: `concepts.md` (agents, links, channels, tasks, conversations),
//! `architecture.md` (the layers, the walk of one message and one task), `runtime.md` (queues,
//! turns, steering, waits), `delegation.md`, `conversations.md`, `durability.md` (what is stored
//! when, what repeats after a crash), `storage.md`, `providers.md`.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]

pub mod bus;
pub mod channel;
pub mod config;
pub mod context;
pub mod conversation;
pub mod delegation;
pub mod dialogue;
pub mod dir_lock;
pub mod durability;
pub mod envelope;
pub mod error;
pub mod event;
mod fasthash;
pub mod ids;
pub mod limits;
pub mod link;
pub mod llm;
pub mod memory;
pub mod org;
pub mod org_api;
pub mod org_builder;
pub mod placement;
pub mod policy;
pub mod prompts;
pub mod records;
pub mod runtime;
pub mod stores;
pub mod task;
pub mod telemetry;
pub mod text;
pub mod time;
pub mod tools;
pub mod topology;

#[cfg(feature = "conformance")]
#[cfg_attr(docsrs, doc(cfg(feature = "conformance")))]
pub mod conformance;
#[cfg(feature = "tokio")]
#[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
pub mod rt;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;

pub use bus::{EventBus, EventSubscription};
pub use channel::{ChannelRecord, ChannelStore, HistoryText, NewRecord, RecordKind};
pub use config::{ConfigError, OrgConfig};
pub use conversation::{Conversation, ConversationStore};
pub use envelope::{DeliveryStore, Envelope, EnvelopeKind, Source, TaskWork, TurnCommit};
pub use error::{InvalidInput, LlmError, PolicyDenied, StoreError};
pub use event::{Event, EventKind, EventSink};
pub use ids::{AgentId, ChannelId, ConversationId, EnvelopeId, LinkId, TaskRef};
pub use link::{AgentLink, LinkDirection, LinkRelationship, LinkStore};
pub use llm::{ChatMessage, ChatRequest, ChatResponse, LlmProvider, ToolCall, ToolDefinition};
pub use org::{
    ChildSpec, DeliveryError, InboundMessage, InternalKind, InternalMessage, OrgError, Organization,
};
pub use org_api::LinkChange;
pub use org_builder::OrganizationBuilder;
pub use placement::{MemoryPlacement, Placement, PlacementLease, PlacementOptions, ProcessId};
pub use policy::{ApprovalPolicy, LinkGraph, OrgChart};
pub use prompts::{Identity, Prompts};
pub use records::{
    DynRecordStore, Expect, Record, RecordStore, RecordWrite, Records, WriteOutcome,
};
pub use runtime::behaviour::{
    AgentWorker, Answer, Behaviour, BehaviourContext, Doorbell, WeakBehaviourContext, WorkerRound,
};
pub use runtime::{ChannelOutbound, Outbound, Replies, Reply, ReplyKind};
pub use stores::Stores;
pub use task::{NewTask, Task, TaskStatus, TaskStore};
pub use text::Text;
pub use time::{Clock, ManualClock, Spawner, Timestamp};
pub use tools::{Tool, ToolContext, ToolError, ToolOutput, ToolRegistry, ToolSet};
pub use topology::Topology;
