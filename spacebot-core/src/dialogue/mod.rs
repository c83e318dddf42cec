//! Conversations over links (seeds 000 and 002): mirrored two-party channels and member links.
//!
//! Both modes share one primitive, the [`Conversation`] record: members, an initiator, the channel
//! to wake with the result (`initiated_from`, set once), a status, and a turn budget that can only
//! go down.
//!
//! - **Mirrored** (two agents): each side has its own link channel, `link:A:B` and `link:B:A`, both
//!   registered when the organization starts
//!   ([`Organization::ensure_link_channels`](crate::Organization::ensure_link_channels)). A send
//!   writes a user message into the peer's side (which wakes the peer) and a history-only sent
//!   record into the sender's side; the peer's final answer is mirrored back the same way.
//!   `conclude_link(summary)` ends the conversation: the summary reaches the peer's side without
//!   waking it, and the initiator's `initiated_from` channel is retriggered with it.
//! - **Group** (N members): every member speaks in its own `conversation:{id}` channel; when a
//!   member's turn ends, its distilled output (see [`distill`]) reaches every other open member.
//!   The initiator may close it with a final message; any member may sever it.
//!
//! Every message that crosses costs one turn of the budget; the conversation is severed when the
//! budget is spent, and nothing can raise it again ([`Conversation::apply`] refuses a turn past it,
//! the stores refuse through [`Conversation::check_successor`]). A concluded conversation may be reopened (same record, same
//! remaining budget, same history); a severed one stays severed. When an agent's session ends, its
//! open conversations are severed.
//!
//! The module is split by concern:
//!
//! - [`state`]: the pure core, [`Conversation::apply`] of a [`ConversationEvent`] to the next record
//!   and the [`Effect`]s to carry out (no I/O, no clock), property-tested on its own;
//! - `service`: the stores, the read-apply-compare-and-swap loop around `apply`, the effects
//!   (records, deliveries, retriggers, events) and the exchange notes that keep budgets spent;
//! - `open`: how a send finds, reopens or creates its conversation (`send_link_message`,
//!   `open_group`), and the rule that never grants a budget twice to one request;
//! - `routing`: which answers and tool calls belong to which conversation, and the
//!   [`Behaviour`](crate::runtime::behaviour::Behaviour) hooks ([`Conversations`]);
//! - `tools`: the conversation tools, each a [`TypedTool`](crate::tools::TypedTool).
//!
//! The runtime calls in through [`Conversations`]: when a turn produced a final answer (a reply in
//! a conversation channel goes to the other members instead of the agent's outbound), and when an
//! agent's session ends.

mod open;
mod routing;
mod service;
pub mod state;
mod tools;

use crate::conversation::Conversation;
use crate::error::{InvalidInput, PolicyDenied, StoreError};
use crate::ids::{AgentId, ChannelId, ConversationId, EnvelopeId};
use crate::org::DeliveryError;

pub(crate) use open::{open_group, send_mirrored};
pub use routing::Conversations;
pub(crate) use routing::{find_for, find_to_conclude};
pub(crate) use service::{conclude, sever};
pub use state::{ConversationEvent, ConversationEventKind, Effect, Transition, TransitionError};
pub(crate) use tools::dialogue_tools;
pub use tools::{CLOSE_LINK, CONCLUDE_LINK, OPEN_GROUP, SEND_LINK_MESSAGE, SEVER_LINK};

/// Metadata key naming the conversation on the envelopes and records it produces.
pub use crate::envelope::META_CONVERSATION;
/// Metadata key naming the conversation on the retrigger that carries its result.
pub const META_RESULT: &str = "spacebot.conversation_result";

/// Why a conversation operation was refused or failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DialogueError {
    /// The link policy refused it.
    #[error(transparent)]
    Denied(#[from] PolicyDenied),
    /// A store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A message could not be handed to an agent.
    #[error(transparent)]
    Delivery(#[from] DeliveryError),
    /// An argument was refused.
    #[error(transparent)]
    Invalid(#[from] InvalidInput),
    /// No conversation matches what was asked for; nothing was changed.
    #[error("no conversation found: {0}")]
    NotFound(String),
    /// The conversation has ended and cannot be continued from here; nothing was sent.
    #[error("{0}")]
    Ended(String),
    /// The conversation exists but the operation is not allowed on it; nothing was changed.
    #[error("conversation {conversation}: {reason}")]
    NotAllowed {
        /// The conversation.
        conversation: ConversationId,
        /// Why.
        reason: String,
    },
}

impl From<TransitionError> for DialogueError {
    fn from(e: TransitionError) -> Self {
        Self::NotAllowed {
            conversation: e.conversation().clone(),
            reason: e.to_string(),
        }
    }
}

/// Names of the members other than `me`.
fn other_names(conversation: &Conversation, me: &AgentId) -> Vec<String> {
    conversation
        .members
        .iter()
        .filter(|m| &m.agent != me)
        .map(|m| m.name.clone())
        .collect()
}

/// The `pair_key` of the mirrored conversation between `a` and `b` (the same in both orders).
///
/// ```
/// use spacebot_core::AgentId;
/// use spacebot_core::dialogue::mirrored_key;
/// let (a, b) = (AgentId::parse("a").unwrap(), AgentId::parse("b").unwrap());
/// assert_eq!(mirrored_key(&a, &b), "mirrored:a:b");
/// assert_eq!(mirrored_key(&b, &a), "mirrored:a:b");
/// ```
pub fn mirrored_key(a: &AgentId, b: &AgentId) -> String {
    let (low, high) = if a <= b { (a, b) } else { (b, a) };
    format!("mirrored:{low}:{high}")
}

/// The `pair_key` of the group conversation of `members` (any order, duplicates ignored).
///
/// ```
/// use spacebot_core::AgentId;
/// use spacebot_core::dialogue::group_key;
/// let id = |s: &str| AgentId::parse(s).unwrap();
/// assert_eq!(group_key(&[id("c"), id("a"), id("b"), id("a")]), "group:a,b,c");
/// ```
pub fn group_key(members: &[AgentId]) -> String {
    let mut ids: Vec<&str> = members.iter().map(AgentId::as_str).collect();
    ids.sort_unstable();
    ids.dedup();
    format!("group:{}", ids.join(","))
}

/// The channel every member of a group conversation speaks in: `conversation:{id}` (each member
/// has its own history under that id).
pub fn group_channel(id: &ConversationId) -> ChannelId {
    ChannelId::new(format!("conversation:{id}"))
}

/// The part of a turn's output that crosses to the other members, or `None` when nothing does.
///
/// Checkpoint content stays with its author: lines starting with `[checkpoint]` and
/// `<checkpoint>...</checkpoint>` blocks (case-insensitive) are removed. What remains is trimmed;
/// empty output is silence, which is valid and costs no turn.
///
/// ```
/// use spacebot_core::dialogue::distill;
/// assert_eq!(distill("  the answer is 4 \n"), Some("the answer is 4".to_string()));
/// assert_eq!(distill("[checkpoint] still reading\n"), None);
/// assert_eq!(distill("<checkpoint>notes</checkpoint>Use redb."), Some("Use redb.".to_string()));
/// assert_eq!(distill("   "), None);
/// ```
pub fn distill(text: &str) -> Option<String> {
    let mut rest = text.to_string();
    loop {
        let lower = rest.to_ascii_lowercase();
        let Some(start) = lower.find("<checkpoint>") else {
            break;
        };
        let end = lower[start..]
            .find("</checkpoint>")
            .map_or(rest.len(), |e| start + e + "</checkpoint>".len());
        rest.replace_range(start..end, "");
    }
    let kept: Vec<&str> = rest
        .lines()
        .filter(|line| {
            !line
                .trim_start()
                .to_ascii_lowercase()
                .starts_with("[checkpoint]")
        })
        .collect();
    let out = kept.join("\n").trim().to_string();
    (!out.is_empty()).then_some(out)
}

/// How a send found its conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Opening {
    /// A new conversation was created.
    Created,
    /// A concluded conversation was opened again (history and remaining budget kept).
    Reopened,
    /// The conversation was open already; the message continues it.
    Continued,
}

impl Opening {
    fn describe(self) -> &'static str {
        match self {
            Self::Created => "opened",
            Self::Reopened => "reopened",
            Self::Continued => "continued",
        }
    }
}

/// What a send belongs to: the exchange's cause (budgets bound the whole exchange one cause
/// started) and the idempotency key of the effect (a turn run again after a crash sends under the
/// same key, and receivers apply it once).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Exchange<'a> {
    pub(crate) cause: &'a EnvelopeId,
    pub(crate) key: Option<&'a str>,
}
