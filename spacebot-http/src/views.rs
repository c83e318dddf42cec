//! The JSON shapes of the API: what it answers and what it accepts.
//!
//! These are the wire format, kept stable on purpose; they are built from the core types and do not
//! change when a core type gains a field.

pub use crate::api::ApprovalsView;
pub use crate::api::{
    LimitsBody, McpCallView, McpGrantsView, McpServerView, McpView, PeriodSpendView, ReachedView,
    RequestSpendView, ResumeBody, SpendView,
};
pub use crate::requests::{RequestNodeView, RequestSummaryView, RequestTreeView, UsageView};
use serde::{Deserialize, Serialize};
use spacebot_core::channel::ChannelRecord;
use spacebot_core::conversation::Conversation;
use spacebot_core::{AgentLink, Task};
use utoipa::{IntoParams, ToSchema};

/// What an agent is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AgentStatus {
    /// Running, with work queued or under way.
    Running,
    /// Running, its queue empty, no turn and no task under way.
    Idle,
    /// Not running; messages to it are persisted until it starts.
    Stopped,
}

/// An agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct AgentView {
    /// Id.
    pub id: String,
    /// Display name.
    pub name: String,
    /// Status.
    pub status: AgentStatus,
    /// Envelopes waiting in its queue (0 when stopped).
    pub queued: usize,
    /// A remote A2A agent (`a2a = "..."` in its `[[agents]]` entry): its base URL. Its token is
    /// never shown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<String>,
}

/// Who may start an exchange over a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// Only `from` may start an exchange.
    OneWay,
    /// Either side may.
    TwoWay,
}

/// What `from` is to `to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Relationship {
    /// Equals.
    Peer,
    /// `from` is above `to`.
    Superior,
    /// `from` is below `to`.
    Subordinate,
}

impl From<Direction> for spacebot_core::LinkDirection {
    fn from(d: Direction) -> Self {
        match d {
            Direction::OneWay => Self::OneWay,
            Direction::TwoWay => Self::TwoWay,
        }
    }
}

impl From<spacebot_core::LinkDirection> for Direction {
    fn from(d: spacebot_core::LinkDirection) -> Self {
        match d {
            spacebot_core::LinkDirection::OneWay => Self::OneWay,
            spacebot_core::LinkDirection::TwoWay => Self::TwoWay,
        }
    }
}

impl From<Relationship> for spacebot_core::LinkRelationship {
    fn from(r: Relationship) -> Self {
        match r {
            Relationship::Peer => Self::Peer,
            Relationship::Superior => Self::Superior,
            Relationship::Subordinate => Self::Subordinate,
        }
    }
}

impl From<spacebot_core::LinkRelationship> for Relationship {
    fn from(r: spacebot_core::LinkRelationship) -> Self {
        match r {
            spacebot_core::LinkRelationship::Peer => Self::Peer,
            spacebot_core::LinkRelationship::Superior => Self::Superior,
            spacebot_core::LinkRelationship::Subordinate => Self::Subordinate,
        }
    }
}

/// A link (seed 003).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct LinkView {
    /// Id.
    pub id: String,
    /// The agent it starts from.
    pub from: String,
    /// The agent it points to.
    pub to: String,
    /// Direction.
    pub direction: Direction,
    /// What `from` is to `to`.
    pub relationship: Relationship,
    /// A disabled link allows nothing.
    pub enabled: bool,
    /// The link channels, `link:{from}:{to}` (owned by `from`) and `link:{to}:{from}`.
    pub channels: Vec<String>,
    /// Creation time, milliseconds since the Unix epoch.
    pub created_at: i64,
    /// Last change, milliseconds since the Unix epoch.
    pub updated_at: i64,
}

impl From<AgentLink> for LinkView {
    fn from(l: AgentLink) -> Self {
        Self {
            channels: vec![
                format!("link:{}:{}", l.from, l.to),
                format!("link:{}:{}", l.to, l.from),
            ],
            id: l.id.into_inner(),
            from: l.from.into_inner(),
            to: l.to.into_inner(),
            direction: l.direction.into(),
            relationship: l.relationship.into(),
            enabled: l.enabled,
            created_at: l.created_at.0,
            updated_at: l.updated_at.0,
        }
    }
}

/// A new link.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateLink {
    /// The agent it starts from.
    pub from: String,
    /// The agent it points to.
    pub to: String,
    /// Direction (default `two_way`).
    #[serde(default = "two_way")]
    pub direction: Direction,
    /// Relationship (default `peer`).
    #[serde(default = "peer")]
    pub relationship: Relationship,
}

fn two_way() -> Direction {
    Direction::TwoWay
}

fn peer() -> Relationship {
    Relationship::Peer
}

/// A change to a link; absent fields keep their value.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateLink {
    /// A new direction.
    #[serde(default)]
    pub direction: Option<Direction>,
    /// A new relationship.
    #[serde(default)]
    pub relationship: Option<Relationship>,
    /// Enable or disable.
    #[serde(default)]
    pub enabled: Option<bool>,
}

/// The organization's graph (seed 003's topology payload).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TopologyView {
    /// Agents.
    pub agents: Vec<TopologyAgentView>,
    /// Links.
    pub links: Vec<TopologyLinkView>,
}

/// An agent of the topology.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TopologyAgentView {
    /// Id.
    pub id: String,
    /// Display name.
    pub name: String,
}

/// A link of the topology.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TopologyLinkView {
    /// Id.
    pub id: String,
    /// From.
    pub from: String,
    /// To.
    pub to: String,
    /// Direction.
    pub direction: Direction,
    /// Relationship.
    pub relationship: Relationship,
    /// Enabled.
    pub enabled: bool,
}

impl From<spacebot_core::Topology> for TopologyView {
    fn from(t: spacebot_core::Topology) -> Self {
        Self {
            agents: t
                .agents
                .into_iter()
                .map(|a| TopologyAgentView {
                    id: a.id.into_inner(),
                    name: a.name,
                })
                .collect(),
            links: t
                .links
                .into_iter()
                .map(|l| TopologyLinkView {
                    id: l.id.into_inner(),
                    from: l.from.into_inner(),
                    to: l.to.into_inner(),
                    direction: l.direction.into(),
                    relationship: l.relationship.into(),
                    enabled: l.enabled,
                })
                .collect(),
        }
    }
}

/// A task on an agent's board.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TaskView {
    /// The board's owner.
    pub agent: String,
    /// Number on that board, from 1.
    pub number: u64,
    /// `{agent}#{number}`.
    pub reference: String,
    /// Title.
    pub title: String,
    /// Description.
    pub description: String,
    /// `pending_approval`, `backlog`, `ready`, `in_progress`, `waiting`, `done`, `failed` or
    /// `cancelled`.
    pub status: String,
    /// `low`, `medium`, `high` or `urgent`.
    pub priority: String,
    /// `human`, `agent:{id}`, ...
    pub created_by: String,
    /// The delegating agent, if delegated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delegated_by: Option<String>,
    /// The link it was delegated over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_id: Option<String>,
    /// The agents the work passed through, root first.
    pub delegation_chain: Vec<String>,
    /// The parent task (multi-hop), `{agent}#{number}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_task: Option<String>,
    /// Attempts so far.
    pub attempts: u32,
    /// The result, once done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// The last error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Creation time, milliseconds since the Unix epoch.
    pub created_at: i64,
    /// Last change, milliseconds since the Unix epoch.
    pub updated_at: i64,
    /// The OpenTelemetry trace the task belongs to (32 hex digits), when the organization stores
    /// trace contexts (the `otel` feature of `spacebot`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
    /// Where the trace can be seen, when the server has a trace URL template
    /// ([`HttpConfig::with_trace_url`](crate::HttpConfig::with_trace_url)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_url: Option<String>,
    /// Tokens the task's own workers used (its subtasks' are on their tasks; absent before any
    /// was reported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageView>,
}

impl TaskView {
    /// Fills [`trace_url`](Self::trace_url) from `template` (`{trace_id}` replaced), when the
    /// task has a trace id.
    pub fn with_trace_url(mut self, template: Option<&str>) -> Self {
        self.trace_url = match (template, &self.trace_id) {
            (Some(template), Some(id)) => Some(template.replace("{trace_id}", id)),
            _ => None,
        };
        self
    }
}

/// The trace id of a stored W3C trace context (`traceparent`, perhaps followed by a line of
/// `tracestate`): `00-{32 hex}-{16 hex}-{2 hex}`. `None` for anything else, or the invalid
/// all-zero id.
pub(crate) fn trace_id(context: &str) -> Option<String> {
    let parent = context.lines().next()?.trim();
    let mut parts = parent.split('-');
    let (_version, id) = (parts.next()?, parts.next()?);
    let valid = id.len() == 32
        && id.bytes().all(|b| b.is_ascii_hexdigit())
        && id.bytes().any(|b| b != b'0');
    valid.then(|| id.to_ascii_lowercase())
}

impl From<Task> for TaskView {
    fn from(t: Task) -> Self {
        Self {
            reference: format!("{}#{}", t.agent, t.number),
            agent: t.agent.into_inner(),
            number: t.number,
            title: t.title,
            description: t.description,
            status: t.status.to_string(),
            priority: t.priority.to_string(),
            created_by: t.created_by,
            delegated_by: t.metadata.delegated_by.map(|a| a.into_inner()),
            link_id: t.metadata.link_id.map(|l| l.into_inner()),
            delegation_chain: t
                .metadata
                .delegation_chain
                .into_iter()
                .map(|a| a.into_inner())
                .collect(),
            parent_task: t.metadata.parent_task.map(|p| p.to_string()),
            attempts: t.attempts,
            result: t.result,
            error: t.error,
            created_at: t.created_at.0,
            updated_at: t.updated_at.0,
            trace_id: t.metadata.trace_context.as_deref().and_then(trace_id),
            trace_url: None,
            usage: (t.metadata.usage.total_tokens > 0).then(|| UsageView {
                input_tokens: u64::from(t.metadata.usage.prompt_tokens),
                output_tokens: u64::from(t.metadata.usage.completion_tokens),
                total_tokens: u64::from(t.metadata.usage.total_tokens),
            }),
        }
    }
}

/// Filters of a task list.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct TaskQuery {
    /// Only these statuses, comma-separated (`ready,in_progress`).
    #[serde(default)]
    pub status: Option<String>,
    /// At most this many tasks (lowest numbers first).
    #[serde(default)]
    pub limit: Option<usize>,
}

/// Why a task is rejected or cancelled.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReasonBody {
    /// The reason, told to the delegator (default: `by an operator`).
    #[serde(default)]
    pub reason: Option<String>,
}

/// One record of a channel's history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct RecordView {
    /// The owning agent.
    pub agent: String,
    /// Sequence number, increasing per agent.
    pub seq: u64,
    /// The channel.
    pub channel: String,
    /// `user`, `assistant`, `sent`, `system` or `tool`.
    pub kind: String,
    /// Who wrote it (an agent id, `user`, `system`).
    pub author: String,
    /// The text.
    pub content: String,
    /// Free-form metadata.
    #[schema(value_type = Object)]
    pub metadata: serde_json::Map<String, serde_json::Value>,
    /// When, milliseconds since the Unix epoch.
    pub at: i64,
}

impl From<ChannelRecord> for RecordView {
    fn from(r: ChannelRecord) -> Self {
        Self {
            agent: r.agent.into_inner(),
            seq: r.seq,
            channel: r.record.channel.to_string(),
            kind: r.record.kind.to_string(),
            author: r.record.author.into(),
            content: r.record.content.into(),
            metadata: r.record.metadata,
            at: r.record.at.0,
        }
    }
}

/// A history query.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct HistoryQuery {
    /// At most this many records (the most recent ones, still oldest first).
    #[serde(default)]
    pub limit: Option<usize>,
}

/// A link's timeline: both sides' records, in time order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TimelineView {
    /// The link.
    pub link: LinkView,
    /// Records of `link:{from}:{to}` and `link:{to}:{from}`, by time then agent sequence.
    pub records: Vec<RecordView>,
}

/// A member of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct MemberView {
    /// The agent.
    pub agent: String,
    /// Its channel for this conversation.
    pub channel: String,
    /// `initiator`, `responder` or `member`.
    pub role: String,
    /// Whether its side is open.
    pub open: bool,
}

/// A conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ConversationView {
    /// Id.
    pub id: String,
    /// `mirrored` or `group`.
    pub mode: String,
    /// `open`, `concluded` or `severed`.
    pub status: String,
    /// Who started it.
    pub initiator: String,
    /// Members.
    pub members: Vec<MemberView>,
    /// Turns left.
    pub budget_remaining: u32,
    /// The last conclusion or closing message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    /// Creation time, milliseconds since the Unix epoch.
    pub created_at: i64,
    /// Last change, milliseconds since the Unix epoch.
    pub updated_at: i64,
}

impl From<Conversation> for ConversationView {
    fn from(c: Conversation) -> Self {
        Self {
            id: c.id.to_string(),
            mode: c.mode.to_string(),
            status: c.status.to_string(),
            initiator: c.initiator.into_inner(),
            members: c
                .members
                .into_iter()
                .map(|m| MemberView {
                    agent: m.agent.into_inner(),
                    channel: m.channel.to_string(),
                    role: m.role.to_string(),
                    open: m.open,
                })
                .collect(),
            budget_remaining: c.budget_remaining,
            summary: c.summary,
            created_at: c.created_at.0,
            updated_at: c.updated_at.0,
        }
    }
}

/// Filters of a conversation list.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ConversationQuery {
    /// Only conversations with this member.
    #[serde(default)]
    pub member: Option<String>,
    /// Only these statuses, comma-separated (`open,concluded,severed`).
    #[serde(default)]
    pub status: Option<String>,
}

/// A message to an agent from the web chat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChatMessageBody {
    /// The text (not empty).
    pub content: String,
    /// The chat this message belongs to; replies name it as their reply target (default
    /// `dashboard`).
    #[serde(default)]
    pub chat_id: Option<String>,
    /// The client's own id of the message (1 to 200 characters): posting it again (after a lost
    /// response) is answered once.
    #[serde(default)]
    pub idempotency_key: Option<String>,
    /// Limits on what this request may spend (with the organization's `[settings.limits]`, the
    /// tighter binds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<LimitsBody>,
}

/// A message was queued (or persisted for a stopped agent).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Accepted {
    /// The envelope id; the reply names it in `in_reply_to`.
    pub envelope_id: String,
    /// The receiving agent.
    pub agent: String,
    /// The agent's channel the message went to (`web:{chat_id}`).
    pub channel: String,
}

/// A delegation made by an operator on behalf of `agent`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DelegateBody {
    /// The target agent (id or display name).
    pub target: String,
    /// What to do.
    pub message: String,
    /// The delegator's channel woken with the result (default `web:dashboard`).
    #[serde(default)]
    pub channel: Option<String>,
}

/// A topology query.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct TopologyQuery {
    /// `json` (default), `dot` or `mermaid`.
    #[serde(default)]
    pub format: Option<String>,
}

/// An event stream query.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct EventsQuery {
    /// The bearer token, for clients that cannot set headers (`EventSource`).
    #[serde(default)]
    pub access_token: Option<String>,
    /// Resume after this id (as the `Last-Event-ID` header does; the header wins).
    #[serde(default)]
    pub last_event_id: Option<u64>,
}

/// The answer of `GET /api/health`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Health {
    /// Always `ok`.
    pub status: String,
    /// Number of agents.
    pub agents: usize,
    /// Whether `/api/notes` is served ([`Api::with_notes`](crate::Api::with_notes)).
    pub notes: bool,
    /// Whether `/api/mcp` is served ([`Api::with_mcp_tools`](crate::Api::with_mcp_tools)).
    pub mcp_tools: bool,
}
