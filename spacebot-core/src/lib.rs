#![doc = "Traits, domain model, pure state machines and runtime of spacebot."]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]

pub mod bus;
pub mod channel;
pub mod config;
pub mod conversation;
pub mod delegation;
pub mod dialogue;
pub mod envelope;
pub mod error;
pub mod event;
pub mod ids;
pub mod link;
pub mod llm;
pub mod memory;
pub mod org;
pub mod policy;
pub mod prompts;
pub mod runtime;
pub mod stores;
pub mod task;
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
pub use channel::{ChannelRecord, ChannelStore, NewRecord, RecordKind};
pub use config::{ConfigError, OrgConfig};
pub use conversation::{Conversation, ConversationStore};
pub use envelope::{DeliveryStore, Envelope, EnvelopeKind, Source, TurnCommit};
pub use error::{InvalidInput, LlmError, PolicyDenied, StoreError};
pub use event::{Event, EventKind, EventSink};
pub use ids::{AgentId, ChannelId, ConversationId, EnvelopeId, LinkId, TaskRef};
pub use link::{AgentLink, LinkDirection, LinkRelationship, LinkStore};
pub use llm::{ChatMessage, ChatRequest, ChatResponse, LlmProvider, ToolCall, ToolDefinition};
pub use org::{
    ChildSpec, DeliveryError, InboundMessage, InternalKind, InternalMessage, OrgError,
    Organization, OrganizationBuilder,
};
pub use policy::{ApprovalPolicy, LinkGraph, OrgChart};
pub use prompts::{Identity, Prompts};
pub use runtime::{AgentQueue, ChannelOutbound, Outbound, Reply};
pub use stores::Stores;
pub use task::{NewTask, Task, TaskStatus, TaskStore};
pub use time::{Clock, ManualClock, Spawner, Timestamp};
pub use tools::{Tool, ToolContext, ToolError, ToolOutput, ToolRegistry};
pub use topology::Topology;
