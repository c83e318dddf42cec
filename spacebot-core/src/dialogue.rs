//! Conversations over links (seeds 000 and 002): mirrored two-party channels and member links.
//!
//! The runtime calls into this module at two points: [`route_reply`] when a turn produced a final
//! answer (a reply in a conversation channel goes to the other members instead of the agent's
//! outbound), and [`on_agent_stopped`] when an agent's session ends (which severs its conversations).

use crate::envelope::Envelope;
use crate::ids::{AgentId, ChannelId};
use crate::org::Organization;

/// Routes a final answer of `agent` in `channel` when the channel belongs to a conversation.
/// Returns `true` when the reply was handled here (it must then not go to the agent's outbound).
pub(crate) async fn route_reply(
    _org: &Organization,
    _agent: &AgentId,
    _channel: &ChannelId,
    _text: &str,
    _answered: &[Envelope],
) -> bool {
    false
}

/// Called when an agent's session ends (it is stopped or ends).
pub(crate) async fn on_agent_stopped(_org: &Organization, _agent: &AgentId) {}
