//! How a send finds its conversation: the open one holding the key, the latest concluded one
//! opened again ([`ConversationEvent::Reopen`]), or a new one; and the two sends that open
//! conversations, `send_link_message` (mirrored) and `open_group`.

use super::service::{CAS_ATTEMPTS, Context, carry_out, deliver_turn, used_by};
use super::state::{ConversationEvent, Transition};
use super::{DialogueError, Exchange, Opening, group_channel, group_key, mirrored_key};
use crate::conversation::{
    Conversation, ConversationFilter, ConversationMode, ConversationStatus, Member, MemberRole,
};
use crate::error::{InvalidInput, PolicyDenied, StoreError};
use crate::ids::{AgentId, ChannelId, ConversationId, EnvelopeId};
use crate::policy;
use crate::runtime::behaviour::BehaviourContext;

/// The conversations of `status` holding `key` among those `agent` is a member of, latest first.
async fn holding(
    org: &BehaviourContext,
    agent: &AgentId,
    key: &str,
    status: ConversationStatus,
) -> Result<impl Iterator<Item = Conversation>, StoreError> {
    let filter = ConversationFilter {
        member: Some(agent.clone()),
        statuses: vec![status],
    };
    let list = org.stores().conversations.list(&filter).await?;
    let key = key.to_string();
    Ok(list
        .into_iter()
        .rev()
        .filter(move |c| c.pair_key.as_deref() == Some(key.as_str())))
}

/// A conversation holding `key` whose budget the exchange `cause` spent (severed with no turn
/// left after `cause` took turns of it).
async fn spent_by(
    org: &BehaviourContext,
    agent: &AgentId,
    key: &str,
    cause: &EnvelopeId,
) -> Result<Option<ConversationId>, StoreError> {
    for c in holding(org, agent, key, ConversationStatus::Severed).await? {
        if c.budget_remaining == 0 && used_by(org, &c, cause).await? {
            return Ok(Some(c.id));
        }
    }
    Ok(None)
}

/// How [`open_or_join`] may start a conversation.
struct Start<'a> {
    opener: &'a AgentId,
    key: &'a str,
    origin: Option<ChannelId>,
    from_own_channel: bool,
    exchange: Exchange<'a>,
}

/// Finds the open conversation holding `key`, reopens the latest concluded one, or creates
/// `fresh()`. Concurrent callers with one key end in one conversation. From the conversation's own
/// channel only an open conversation may be joined: an ended one is not started again from inside
/// (otherwise two models answering each other would start over whenever the budget severs them).
async fn open_or_join(
    org: &BehaviourContext,
    start: Start<'_>,
    may_start: impl Fn() -> Result<(), PolicyDenied>,
    fresh: impl Fn() -> Conversation,
) -> Result<(Conversation, Opening), DialogueError> {
    let Start {
        opener,
        key,
        origin,
        from_own_channel,
        exchange,
    } = start;
    let store = &org.stores().conversations;
    let mut last = None;
    for _ in 0..CAS_ATTEMPTS {
        if let Some(open) = store.find_open(key).await? {
            return Ok((open, Opening::Continued));
        }
        if from_own_channel {
            return Err(DialogueError::Ended(format!(
                "the conversation {key} is not open, and an ended conversation cannot be started \
                 again from its own channel; nothing was sent"
            )));
        }
        may_start()?;
        if let Some(spent) = spent_by(org, opener, key, exchange.cause).await? {
            return Err(DialogueError::NotAllowed {
                conversation: spent,
                reason: "this exchange spent its turn budget with them already; a budget is \
                         never granted again to the same request, so nothing was sent"
                    .into(),
            });
        }
        let mut concluded = holding(org, opener, key, ConversationStatus::Concluded).await?;
        if let Some(concluded) = concluded.next() {
            let reopen = ConversationEvent::Reopen {
                by: opener.clone(),
                origin: origin.clone(),
                at: org.clock().now(),
            };
            let transition = concluded.apply(reopen)?;
            match store
                .update(&transition.conversation, concluded.revision)
                .await
            {
                Ok(stored) => {
                    let ctx = Context {
                        exchange: Some(exchange),
                        result_key: None,
                    };
                    carry_out(org, &stored, &transition.effects, &ctx).await;
                    return Ok((stored, Opening::Reopened));
                }
                Err(e @ (StoreError::Conflict { .. } | StoreError::AlreadyExists { .. })) => {
                    last = Some(e);
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        }
        let created = Transition::created(fresh());
        match store.create(&created.conversation).await {
            Ok(()) => {
                let conversation = &created.conversation;
                let ctx = Context {
                    exchange: Some(exchange),
                    result_key: None,
                };
                carry_out(org, conversation, &created.effects, &ctx).await;
                return Ok((created.conversation, Opening::Created));
            }
            Err(e @ StoreError::AlreadyExists { .. }) => last = Some(e),
            Err(e) => return Err(e.into()),
        }
    }
    Err(last
        .map(DialogueError::Store)
        .unwrap_or_else(|| DialogueError::NotFound(format!("conversation with key {key}"))))
}

/// Opens or continues the mirrored conversation of `from` with `target` and sends `message`.
pub(crate) async fn send_mirrored(
    org: &BehaviourContext,
    from: &AgentId,
    target: &str,
    origin: &ChannelId,
    message: &str,
    exchange: Exchange<'_>,
) -> Result<(Conversation, Opening), DialogueError> {
    let to = org.resolve(target)?;
    let graph = org.graph();
    if &to == from {
        return Err(policy::check_start(&graph, from, &to)
            .err()
            .map(DialogueError::Denied)
            .unwrap_or_else(|| {
                DialogueError::Invalid(InvalidInput::new(
                    "target",
                    "an agent cannot message itself",
                ))
            }));
    }
    // Any enabled link lets a member speak in an open conversation; opening needs a start.
    policy::check_answer(&graph, from, &to, true)?;
    let key = mirrored_key(from, &to);
    let own_channel = ChannelId::link(from, &to);
    let origin = (origin != &own_channel).then(|| origin.clone());
    let budget = org.settings().conversation_turn_budget;
    let now = org.clock().now();
    let fresh = || Conversation {
        id: ConversationId::new_random(),
        mode: ConversationMode::Mirrored,
        members: vec![
            Member {
                agent: from.clone(),
                channel: ChannelId::link(from, &to),
                name: org.display_name(from),
                number: 1,
                role: MemberRole::Initiator,
                open: true,
            },
            Member {
                agent: to.clone(),
                channel: ChannelId::link(&to, from),
                name: org.display_name(&to),
                number: 2,
                role: MemberRole::Responder,
                open: true,
            },
        ],
        initiator: from.clone(),
        initiated_from: origin.clone(),
        status: ConversationStatus::Open,
        budget_remaining: budget,
        pair_key: Some(key.clone()),
        summary: None,
        revision: 1,
        created_at: now,
        updated_at: now,
    };
    let may_start = || policy::check_start(&graph, from, &to).map(|_| ());
    let start = Start {
        opener: from,
        key: &key,
        origin: origin.clone(),
        from_own_channel: origin.is_none(),
        exchange,
    };
    let (conversation, opening) = open_or_join(org, start, may_start, fresh).await?;
    deliver_turn(org, &conversation, from, message, true, exchange).await?;
    Ok((conversation, opening))
}

/// Opens (or continues, or reopens) the group of `from` and `members` and sends `message`.
pub(crate) async fn open_group(
    org: &BehaviourContext,
    from: &AgentId,
    members: &[String],
    origin: &ChannelId,
    message: &str,
    exchange: Exchange<'_>,
) -> Result<(Conversation, Opening), DialogueError> {
    if members.is_empty() {
        return Err(InvalidInput::new("members", "name at least one other agent").into());
    }
    let graph = org.graph();
    let mut others: Vec<AgentId> = Vec::new();
    for name in members {
        let agent = org.resolve(name)?;
        if &agent == from {
            return Err(InvalidInput::new(
                "members",
                "list the other members only; you are a member already",
            )
            .into());
        }
        policy::check_start(&graph, from, &agent)?;
        if !others.contains(&agent) {
            others.push(agent);
        }
    }
    let mut all = vec![from.clone()];
    all.extend(others.iter().cloned());
    let key = group_key(&all);
    let budget = org.settings().conversation_turn_budget;
    let now = org.clock().now();
    let from_own_channel = match origin.as_str().strip_prefix("conversation:") {
        Some(id) => org
            .stores()
            .conversations
            .get(&ConversationId::new(id))
            .await?
            .is_some_and(|c| c.pair_key.as_deref() == Some(key.as_str())),
        None => false,
    };
    let origin = Some(origin.clone()).filter(|o| !o.as_str().starts_with("conversation:"));
    let fresh = || {
        let id = ConversationId::new_random();
        let channel = group_channel(&id);
        let members = all
            .iter()
            .enumerate()
            .map(|(i, agent)| Member {
                agent: agent.clone(),
                channel: channel.clone(),
                name: org.display_name(agent),
                number: u32::try_from(i + 1).unwrap_or(u32::MAX),
                role: if i == 0 {
                    MemberRole::Initiator
                } else {
                    MemberRole::Member
                },
                open: true,
            })
            .collect();
        Conversation {
            id,
            mode: ConversationMode::Group,
            members,
            initiator: from.clone(),
            initiated_from: origin.clone(),
            status: ConversationStatus::Open,
            budget_remaining: budget,
            pair_key: Some(key.clone()),
            summary: None,
            revision: 1,
            created_at: now,
            updated_at: now,
        }
    };
    let start = Start {
        opener: from,
        key: &key,
        origin: origin.clone(),
        from_own_channel,
        exchange,
    };
    let (conversation, opening) = open_or_join(org, start, || Ok(()), fresh).await?;
    deliver_turn(org, &conversation, from, message, true, exchange).await?;
    Ok((conversation, opening))
}
