//! Which conversation a tool call or an answer belongs to, and the [`Behaviour`] hooks
//! ([`Conversations`]): an answer in a conversation's channel goes to the other members instead of
//! the agent's outbound, and a stopped agent's conversations are severed.

use super::service::{append, deliver_turn};
use super::{DialogueError, Exchange, distill, mirrored_key, sever};
use crate::channel::RecordKind;
use crate::conversation::{Conversation, ConversationFilter, ConversationStatus};
use crate::envelope::{Envelope, EnvelopeKind};
use crate::error::StoreError;
use crate::ids::{AgentId, ChannelId, ConversationId, EnvelopeId};
use crate::runtime::behaviour::{Answer, Behaviour, BehaviourContext};

/// The conversation `agent` means: the one named by `target` (a conversation id, or another
/// member's id or name), else the one whose channel `channel` is. Only open conversations with
/// `agent` as a member match.
pub(crate) async fn find_for(
    org: &BehaviourContext,
    agent: &AgentId,
    channel: &ChannelId,
    target: Option<&str>,
) -> Result<Conversation, DialogueError> {
    find_among(org, agent, channel, target, vec![ConversationStatus::Open]).await
}

/// The conversation a conclusion (or close) by `agent` is about: an open one as
/// [`find_for`] finds it, or, when the call under `key` concluded one already (its turn runs
/// again after a crash), that one, to finish what the first run left (see [`conclude`]).
pub(crate) async fn find_to_conclude(
    org: &BehaviourContext,
    agent: &AgentId,
    channel: &ChannelId,
    target: Option<&str>,
    key: &str,
) -> Result<Conversation, DialogueError> {
    match find_for(org, agent, channel, target).await {
        Err(DialogueError::NotFound(why)) => {
            let applied = org
                .stores()
                .deliveries
                .is_applied(agent, &format!("conclude:{key}"))
                .await?;
            if !applied {
                return Err(DialogueError::NotFound(why));
            }
            let statuses = vec![ConversationStatus::Concluded];
            match find_among(org, agent, channel, target, statuses).await {
                Ok(concluded) => Ok(concluded),
                Err(_) => Err(DialogueError::NotFound(why)),
            }
        }
        found => found,
    }
}

/// [`find_for`] among `agent`'s conversations of `statuses` (the latest when several match on
/// the channel).
async fn find_among(
    org: &BehaviourContext,
    agent: &AgentId,
    channel: &ChannelId,
    target: Option<&str>,
    statuses: Vec<ConversationStatus>,
) -> Result<Conversation, DialogueError> {
    let filter = ConversationFilter {
        member: Some(agent.clone()),
        statuses,
    };
    let mut open = org.stores().conversations.list(&filter).await?;
    // Oldest first from the store: the latest match wins.
    open.reverse();
    match target {
        Some(t) => {
            let peer = org.resolve(t).ok();
            let mut found = open.into_iter().filter(|c| {
                c.id.as_str() == t
                    || peer
                        .as_ref()
                        .is_some_and(|p| p != agent && c.member(p).is_some())
            });
            match (found.next(), found.next()) {
                (Some(c), None) => Ok(c),
                (Some(_), Some(_)) => Err(DialogueError::NotFound(format!(
                    "{t:?} matches several of your open conversations; name one by its id"
                ))),
                (None, _) => Err(DialogueError::NotFound(format!(
                    "none of your open conversations matches {t:?}; nothing was changed"
                ))),
            }
        }
        None => open
            .into_iter()
            .find(|c| c.member(agent).is_some_and(|m| &m.channel == channel))
            .ok_or_else(|| {
                DialogueError::NotFound(format!(
                    "{channel} is not the channel of one of your open conversations; name the \
                     conversation (its id or a member) as `target`"
                ))
            }),
    }
}

/// The conversation a final answer of `agent` in `channel` belongs to, if any.
async fn conversation_for_reply(
    org: &BehaviourContext,
    agent: &AgentId,
    channel: &ChannelId,
    answered: &[Envelope],
) -> Result<Option<Conversation>, StoreError> {
    let store = &org.stores().conversations;
    let in_channel = |c: &Conversation| c.member(agent).is_some_and(|m| &m.channel == channel);
    let mut closed = None;
    for id in answered.iter().filter_map(|e| e.conversation.clone()) {
        if let Some(c) = store.get(&id).await?
            && in_channel(&c)
        {
            if c.status == ConversationStatus::Open {
                return Ok(Some(c));
            }
            closed = Some(c);
        }
    }
    if let Some(id) = channel.as_str().strip_prefix("conversation:") {
        if let Some(c) = store.get(&ConversationId::new(id)).await?
            && in_channel(&c)
        {
            return Ok(Some(c));
        }
    } else if let Some((owner, peer)) = channel.as_link()
        && &owner == agent
        && let Some(c) = store.find_open(&mirrored_key(&owner, &peer)).await?
    {
        return Ok(Some(c));
    }
    Ok(closed)
}

/// Whether [`route_reply`] could route `answer`: it answers an envelope of a conversation, or it is
/// in a conversation's channel or in a link channel of the answering agent (where a mirrored
/// conversation may be open). Anything else, [`route_reply`] leaves to the agent's outbound.
fn belongs_to_conversation(agent: &AgentId, envelope: &Envelope) -> bool {
    if envelope.conversation.is_some() {
        return true;
    }
    let channel = envelope.channel.as_str();
    channel.starts_with("conversation:")
        || channel
            .strip_prefix("link:")
            .and_then(|rest| rest.strip_prefix(agent.as_str()))
            .is_some_and(|rest| rest.starts_with(':'))
}

/// Routes a final answer of `agent` in `channel` when the channel belongs to a conversation.
/// Returns `true` when the reply was handled here (it must then not go to the agent's outbound).
///
/// In an open conversation the distilled output (see [`distill`]) goes to the other members and
/// costs one turn; empty output and checkpoint content cost nothing. An answer in a conversation
/// that has ended is kept in the author's history only, with a note saying so.
pub(crate) async fn route_reply(
    org: &BehaviourContext,
    agent: &AgentId,
    channel: &ChannelId,
    text: &str,
    answered: &[Envelope],
    cause: &EnvelopeId,
) -> bool {
    let conversation = match conversation_for_reply(org, agent, channel, answered).await {
        Ok(Some(c)) => c,
        Ok(None) => return orphan_result_answer(org, agent, channel, answered).await,
        Err(e) => {
            org.report_error(
                agent,
                Some(channel),
                format!("conversation lookup failed: {e}"),
            );
            return false;
        }
    };
    let Some(text) = distill(text) else {
        return true;
    };
    let note = if conversation.status == ConversationStatus::Open {
        let key = answered
            .first()
            .map(|e| format!("{agent}:{}:reply", e.id))
            .unwrap_or_default();
        let exchange = Exchange {
            cause,
            key: Some(&key),
        };
        match deliver_turn(org, &conversation, agent, &text, false, exchange).await {
            Ok(_) => None,
            Err(e) => Some(format!("This reply was not delivered: {e}")),
        }
    } else {
        Some(format!(
            "This reply was not delivered: the conversation is {}.",
            conversation.status
        ))
    };
    if let Some(note) = note {
        append(
            org,
            agent,
            channel,
            RecordKind::System,
            "system",
            note,
            &conversation.id,
        )
        .await;
    }
    true
}

/// An answer to a conversation's result, given in a link channel whose own conversation has ended
/// (a middle hop of a chain): it belongs to no conversation and to no external user, so it stays in
/// the author's history with a note. Returns whether that was the case.
async fn orphan_result_answer(
    org: &BehaviourContext,
    agent: &AgentId,
    channel: &ChannelId,
    answered: &[Envelope],
) -> bool {
    let result = answered
        .iter()
        .filter(|e| e.kind == EnvelopeKind::Retrigger)
        .find_map(|e| e.conversation.as_ref().map(|c| c.to_string()));
    let Some(result) = result else {
        return false;
    };
    let conversation_channel = channel.as_str().starts_with("conversation:")
        || channel.as_link().is_some_and(|(owner, _)| &owner == agent);
    if !conversation_channel {
        return false;
    }
    append(
        org,
        agent,
        channel,
        RecordKind::System,
        "system",
        "This reply was not delivered: no conversation is open in this channel.".to_string(),
        &ConversationId::new(result),
    )
    .await;
    true
}

/// Conversations as a [`Behaviour`]: the conversation tools, both channels of every link, answers
/// routed to a conversation's other members, and a stopped agent's conversations severed.
#[derive(Debug, Default, Clone, Copy)]
pub struct Conversations;

#[async_trait::async_trait]
impl Behaviour for Conversations {
    fn name(&self) -> &'static str {
        "conversations"
    }

    fn tools(&self) -> Vec<std::sync::Arc<dyn crate::tools::Tool>> {
        super::dialogue_tools()
    }

    async fn on_start_all(&self, ctx: &BehaviourContext) -> Result<(), StoreError> {
        ensure_link_channels(ctx).await
    }

    async fn exchange_open(
        &self,
        ctx: &BehaviourContext,
        from: &AgentId,
        to: &AgentId,
    ) -> Result<bool, StoreError> {
        Ok(ctx
            .stores()
            .conversations
            .find_open(&mirrored_key(from, to))
            .await?
            .is_some_and(|c| c.initiator == *to))
    }

    fn owns_answer(&self, agent: &AgentId, envelope: &Envelope) -> bool {
        belongs_to_conversation(agent, envelope)
    }

    async fn route_answer(&self, ctx: &BehaviourContext, answer: &Answer<'_>) -> bool {
        // The routing's state (a few kilobytes) is boxed: this hook's future stays small.
        Box::pin(route_reply(
            ctx,
            answer.agent,
            answer.channel,
            answer.text,
            answer.answered,
            answer.cause,
        ))
        .await
    }

    async fn on_agent_stopped(&self, ctx: &BehaviourContext, agent: &AgentId) {
        on_agent_stopped(ctx, agent).await;
    }
}

/// Called when an agent's session ends (it is stopped or ends): its open conversations are severed.
/// A loop stopped without ending the session ends none: a shutdown (the agent goes on at its next
/// start, as after a crash) or a hand-over to another process under a placement.
pub(crate) async fn on_agent_stopped(org: &BehaviourContext, agent: &AgentId) {
    if org.is_handing_over(agent) {
        return;
    }
    let filter = ConversationFilter {
        member: Some(agent.clone()),
        statuses: vec![ConversationStatus::Open],
    };
    let open = match org.stores().conversations.list(&filter).await {
        Ok(open) => open,
        Err(e) => {
            org.report_error(
                agent,
                None,
                format!("conversations of a stopped agent not severed: {e}"),
            );
            return;
        }
    };
    let reason = format!("the session of {} ended", org.display_name(agent));
    for conversation in open {
        if let Err(e) = sever(org, &conversation.id, Some(agent), &reason).await {
            org.report_error(
                agent,
                None,
                format!("conversation {} not severed: {e}", conversation.id),
            );
        }
    }
}

/// Registers both link channels (`link:A:B` for A and `link:B:A` for B) of every link.
pub(crate) async fn ensure_link_channels(org: &BehaviourContext) -> Result<(), StoreError> {
    let graph = org.graph();
    let channels = &org.stores().channels;
    for link in graph.links() {
        channels
            .ensure_channel(&link.from, &ChannelId::link(&link.from, &link.to))
            .await?;
        channels
            .ensure_channel(&link.to, &ChannelId::link(&link.to, &link.from))
            .await?;
    }
    Ok(())
}

impl crate::org::Organization {
    /// The conversations matching `filter` (by member and status), oldest first.
    pub async fn conversations(
        &self,
        filter: &ConversationFilter,
    ) -> Result<Vec<Conversation>, StoreError> {
        self.behaviour_context()
            .stores()
            .conversations
            .list(filter)
            .await
    }

    /// One conversation.
    pub async fn conversation(
        &self,
        id: &ConversationId,
    ) -> Result<Option<Conversation>, StoreError> {
        self.behaviour_context()
            .stores()
            .conversations
            .get(id)
            .await
    }

    /// Registers both link channels of every link, so each side's history exists before the first
    /// message. [`Organization::start_all`](Self::start_all) does it; call it after starting
    /// agents one by one or after [`Organization::reload_links`](Self::reload_links).
    pub async fn ensure_link_channels(&self) -> Result<(), StoreError> {
        ensure_link_channels(&self.behaviour_context()).await
    }

    /// Severs a conversation from outside (an application ending it): every membership ends at once
    /// and the members and the `initiated_from` channel are told `reason`. Severing a severed
    /// conversation changes nothing.
    pub async fn sever_conversation(
        &self,
        id: &ConversationId,
        reason: &str,
    ) -> Result<Conversation, DialogueError> {
        sever(&self.behaviour_context(), id, None, reason).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::Source;
    use crate::time::Timestamp;

    /// Whether `agent`'s answer in `channel` to one envelope (tagged with a conversation or not)
    /// goes to the conversation routing.
    fn may_route(agent: &str, channel: &str, tagged: bool) -> bool {
        let agent = AgentId::parse(agent).unwrap();
        let channel = ChannelId::new(channel);
        let mut envelope = Envelope::new(
            Source::System,
            channel.clone(),
            EnvelopeKind::Retrigger,
            "done",
            Timestamp(0),
        );
        if tagged {
            envelope.conversation = Some(ConversationId::new("c1"));
        }
        belongs_to_conversation(&agent, &envelope)
    }

    /// The fast path leaves out only answers `route_reply` would leave to the outbound: every
    /// channel `conversation_for_reply` looks a conversation up for still goes to it.
    #[test]
    fn only_answers_outside_every_conversation_skip_the_routing() {
        // Where a conversation may be found: a tagged envelope, a conversation's channel, the
        // answering agent's own link channel (a mirrored conversation with that peer).
        assert!(may_route("a", "portal:chat:a", true));
        assert!(may_route("a", "conversation:c1", false));
        assert!(may_route("a", "link:a:b", false));
        // Where none can be: a user's channel, a peer's side of a link, an id that only starts
        // like the agent's.
        assert!(!may_route("a", "portal:chat:a", false));
        assert!(!may_route("a", "link:b:a", false));
        assert!(!may_route("a", "link:ab:c", false));
        assert!(!may_route("a", "task:a:1", false));
    }
}
