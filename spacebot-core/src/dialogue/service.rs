//! The conversation service: reads a conversation, applies an event with [`Conversation::apply`],
//! stores the result with compare-and-swap (retrying on conflicts), then carries out the
//! transition's [`Effect`]s: records, deliveries, the result retrigger, events. It also keeps the
//! exchange notes that make a spent budget stay spent across restarts and processes.

use super::state::{ConversationEvent, Effect, Transition, TransitionError};
use super::{DialogueError, Exchange, other_names};
use crate::channel::{NewRecord, RecordKind};
use crate::conversation::{Conversation, ConversationMode, ConversationStatus, Member};
use crate::envelope::{Envelope, EnvelopeKind, META_CONVERSATION, Source};
use crate::error::StoreError;
use crate::event::EventKind;
use crate::ids::{AgentId, ChannelId, ConversationId, EnvelopeId, LinkId};
use crate::policy;
use crate::prompts::ConversationRulesContext;
use crate::runtime::behaviour::BehaviourContext;
use tracing::Instrument;

/// How many times a compare-and-swap is retried before giving up with the conflict.
pub(super) const CAS_ATTEMPTS: usize = 16;

/// Which exchanges (by cause) took turns from each conversation in this process: a conversation
/// whose budget one exchange spent is not started afresh by that exchange.
#[derive(Debug, Default)]
struct Exchanges(std::sync::Mutex<std::collections::HashMap<ConversationId, Vec<EnvelopeId>>>);

/// Notes that the exchange `cause` took a turn of `conversation`.
///
/// The note is stored, as an applied key `exchange:{conversation}:{cause}` of the conversation's
/// initiator in the delivery store, where [`used_by`] finds it after a restart and, under a
/// placement (an organization spread over several processes), in every process: a budget is a
/// backstop that neither a restart nor a move resets. This process keeps the latest notes in memory
/// too, so a conversation's later turns in the same exchange write nothing more.
async fn note_exchange(
    org: &BehaviourContext,
    conversation: &Conversation,
    cause: &EnvelopeId,
) -> Result<(), StoreError> {
    let fresh = {
        let exchanges = org.state::<Exchanges>();
        let mut exchanges = exchanges.0.lock().unwrap_or_else(|e| e.into_inner());
        let causes = exchanges.entry(conversation.id.clone()).or_default();
        let fresh = !causes.contains(cause);
        if fresh {
            if causes.len() >= 16 {
                causes.remove(0);
            }
            causes.push(cause.clone());
        }
        fresh
    };
    if fresh {
        org.stores()
            .deliveries
            .mark_applied(
                &conversation.initiator,
                &exchange_key(&conversation.id, cause),
                org.clock().now(),
            )
            .await?;
    }
    Ok(())
}

/// The stored form of an exchange's note (see [`note_exchange`]).
fn exchange_key(conversation: &ConversationId, cause: &EnvelopeId) -> String {
    format!("exchange:{conversation}:{cause}")
}

/// Whether the exchange `cause` took turns of `conversation` (in this process, before a restart, or
/// under a placement in any process).
pub(super) async fn used_by(
    org: &BehaviourContext,
    conversation: &Conversation,
    cause: &EnvelopeId,
) -> Result<bool, StoreError> {
    let here = org
        .state::<Exchanges>()
        .0
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&conversation.id)
        .is_some_and(|c| c.contains(cause));
    if here {
        return Ok(true);
    }
    org.stores()
        .deliveries
        .is_applied(
            &conversation.initiator,
            &exchange_key(&conversation.id, cause),
        )
        .await
}

/// Appends a record to `agent`'s channel; a failure becomes an error event.
pub(super) async fn append(
    org: &BehaviourContext,
    agent: &AgentId,
    channel: &ChannelId,
    kind: RecordKind,
    author: &str,
    content: String,
    conversation: &ConversationId,
) {
    let mut record = NewRecord::new(channel.clone(), kind, author, content, org.clock().now());
    record.metadata.insert(
        META_CONVERSATION.into(),
        serde_json::Value::String(conversation.to_string()),
    );
    if let Err(e) = org.stores().channels.append(agent, record).await {
        org.report_error(agent, Some(channel), format!("history not written: {e}"));
    }
}

/// The enabled link between two agents, either direction (for stamping envelopes).
fn link_between(org: &BehaviourContext, a: &AgentId, b: &AgentId) -> Option<LinkId> {
    let graph = org.graph();
    graph
        .between(a.as_str(), b.as_str())
        .or_else(|| graph.between(b.as_str(), a.as_str()))
        .map(|l| l.id.clone())
}

/// Emits `kind` for `agent`, naming the user request whose exchange caused it (the console hangs
/// a conversation in that request's tree).
fn emit(
    org: &BehaviourContext,
    agent: &AgentId,
    channel: Option<&ChannelId>,
    request: Option<&EnvelopeId>,
    kind: EventKind,
) {
    let mut event = org.event(agent, kind);
    event.channel = channel.cloned();
    event.request = request.cloned();
    org.emit_event(event);
}

/// Applies `event` to the stored conversation with compare-and-swap, retrying on conflicts: read,
/// [`Conversation::apply`], write if it changed. The outer error is the store's; the inner one the
/// lifecycle's refusal (nothing was written then).
async fn commit(
    org: &BehaviourContext,
    id: &ConversationId,
    event: ConversationEvent,
) -> Result<Result<Transition, TransitionError>, DialogueError> {
    let store = &org.stores().conversations;
    let mut last = None;
    for _ in 0..CAS_ATTEMPTS {
        let current = store
            .get(id)
            .await?
            .ok_or_else(|| DialogueError::NotFound(format!("conversation {id}")))?;
        let transition = match current.apply(event.clone()) {
            Ok(t) if t.changed => t,
            other => return Ok(other),
        };
        match store
            .update(&transition.conversation, current.revision)
            .await
        {
            Ok(stored) => {
                return Ok(Ok(Transition {
                    conversation: stored,
                    ..transition
                }));
            }
            Err(e @ StoreError::Conflict { .. }) => last = Some(e),
            Err(e) => return Err(e.into()),
        }
    }
    Err(last
        .map(DialogueError::Store)
        .unwrap_or_else(|| DialogueError::NotFound(format!("conversation {id}"))))
}

/// What carrying out a transition's effects needs besides the conversation: the exchange a turn or
/// a conclusion belongs to, and the idempotency key of a conclusion's result.
#[derive(Default)]
pub(super) struct Context<'a> {
    pub(super) exchange: Option<Exchange<'a>>,
    pub(super) result_key: Option<String>,
}

/// Carries out `effects` of a stored transition of `conversation`, in order. Returns how many
/// members a delivery reached, and who spent the budget when the conversation must now be severed
/// for it.
pub(super) async fn carry_out(
    org: &BehaviourContext,
    conversation: &Conversation,
    effects: &[Effect],
    ctx: &Context<'_>,
) -> (usize, Option<AgentId>) {
    let id = &conversation.id;
    let request = ctx.exchange.map(|e| e.cause);
    let mut delivered = 0;
    let mut sever_for_budget = None;
    for effect in effects {
        match effect {
            Effect::GiveRules => give_rules(org, conversation).await,
            Effect::Opened => emit(
                org,
                &conversation.initiator,
                conversation.initiated_from.as_ref(),
                request,
                EventKind::ConversationOpened {
                    conversation: id.clone(),
                    members: conversation
                        .members
                        .iter()
                        .map(|m| m.agent.clone())
                        .collect(),
                },
            ),
            Effect::RecordSent { from, text } => {
                let (agent, channel) = (&from.agent, &from.channel);
                let text = text.clone();
                append(
                    org,
                    agent,
                    channel,
                    RecordKind::Sent,
                    agent.as_str(),
                    text,
                    id,
                )
                .await;
            }
            Effect::Deliver { from, to, content } => {
                delivered += deliver(org, conversation, from, to, content, ctx).await;
            }
            Effect::MessageSent { from, to } => emit(
                org,
                &from.agent,
                Some(&from.channel),
                request,
                EventKind::MessageSent { to: to.clone() },
            ),
            Effect::SeverForBudget { by } => sever_for_budget = Some(by.clone()),
            Effect::Retrigger {
                initiator,
                channel,
                by,
                summary,
            } => {
                let key = ctx.result_key.clone().unwrap_or_default();
                let cause = ctx.exchange.map(|e| e.cause);
                let result = (initiator, channel, by, summary.as_str());
                retrigger_conclusion(org, conversation, result, key, cause).await;
            }
            Effect::RecordConclusion { by, summary } => {
                record_conclusion(org, conversation, by, summary).await;
            }
            Effect::Concluded { by } => emit(
                org,
                by,
                conversation.member(by).map(|m| &m.channel),
                request,
                EventKind::ConversationConcluded {
                    conversation: id.clone(),
                },
            ),
            Effect::RecordSevered { by, reason } => {
                record_severed(org, conversation, by.as_ref(), reason).await;
            }
            Effect::Severed { by, reason } => emit(
                org,
                by.as_ref().unwrap_or(&conversation.initiator),
                None,
                request,
                EventKind::ConversationSevered {
                    conversation: id.clone(),
                    reason: reason.clone(),
                },
            ),
        }
    }
    (delivered, sever_for_budget)
}

/// Hands `content` from `from` to each of `to` (a user message that wakes it). Returns how many
/// received it; a failed delivery to one member does not stop the others.
async fn deliver(
    org: &BehaviourContext,
    conversation: &Conversation,
    from: &Member,
    to: &[Member],
    content: &str,
    ctx: &Context<'_>,
) -> usize {
    let mut delivered = 0;
    let now = org.clock().now();
    let span = tracing::info_span!(
        target: "spacebot::telemetry",
        "spacebot.conversation.message",
        gen_ai.conversation.id = %conversation.id,
        spacebot.from = %from.agent,
        spacebot.to = to.len(),
    );
    for member in to {
        let mut envelope = Envelope::new(
            Source::Internal {
                from_agent: from.agent.clone(),
                link_id: link_between(org, &from.agent, &member.agent),
            },
            member.channel.clone(),
            EnvelopeKind::UserMessage,
            content.to_string(),
            now,
        )
        .with_conversation(conversation.id.clone());
        if let Some(exchange) = ctx.exchange {
            envelope = envelope.with_cause(exchange.cause.clone());
            if let Some(key) = exchange.key {
                envelope.idempotency_key = Some(format!("{key}:to:{}", member.agent));
            }
        }
        match org
            .enqueue(&member.agent, envelope)
            .instrument(span.clone())
            .await
        {
            Ok(()) => {
                delivered += 1;
                emit(
                    org,
                    &member.agent,
                    Some(&member.channel),
                    ctx.exchange.map(|e| e.cause),
                    EventKind::MessageReceived {
                        from: from.agent.clone(),
                    },
                );
            }
            Err(e) => org.report_error(
                &from.agent,
                Some(&from.channel),
                format!(
                    "conversation {}: delivery to {} failed: {e}",
                    conversation.id, member.agent
                ),
            ),
        }
    }
    delivered
}

/// Gives every member the anti-chattiness rules, once (called at creation only).
async fn give_rules(org: &BehaviourContext, conversation: &Conversation) {
    for member in &conversation.members {
        let ctx = ConversationRulesContext {
            members: other_names(conversation, &member.agent),
            is_initiator: member.agent == conversation.initiator,
            turn_budget: Some(conversation.budget_remaining),
        };
        match org.prompts().render_conversation_rules(&ctx) {
            Ok(rules) => {
                append(
                    org,
                    &member.agent,
                    &member.channel,
                    RecordKind::System,
                    "system",
                    rules,
                    &conversation.id,
                )
                .await;
            }
            Err(e) => org.report_error(
                &member.agent,
                Some(&member.channel),
                format!("conversation rules not rendered: {e}"),
            ),
        }
    }
}

/// A conversation between two agents lives on their link: once no enabled link joins them, it
/// carries nothing more and is severed.
async fn check_links(
    org: &BehaviourContext,
    conversation: &Conversation,
    from: &AgentId,
) -> Result<(), DialogueError> {
    if conversation.mode != ConversationMode::Mirrored {
        return Ok(());
    }
    let graph = org.graph();
    for member in conversation.members.iter().filter(|m| &m.agent != from) {
        if let Err(denied) = policy::check_answer(&graph, from, &member.agent, true) {
            sever(org, &conversation.id, Some(from), &denied.to_string()).await?;
            return Err(DialogueError::Denied(denied));
        }
    }
    Ok(())
}

/// The reason a conversation severed for its budget gives.
const BUDGET_SPENT: &str = "its turn budget is spent";

/// Hands `text` from `from` to the other open members of `conversation`, taking one turn of the
/// budget ([`ConversationEvent::TakeTurn`]). With `sent_record`, a history-only copy goes into the
/// sender's own channel. Returns how many members received it. A failed delivery to one member
/// does not stop the others. The turn that spends the budget is delivered, then the conversation is
/// severed; a turn with none left severs it and delivers nothing.
pub(crate) async fn deliver_turn(
    org: &BehaviourContext,
    conversation: &Conversation,
    from: &AgentId,
    text: &str,
    sent_record: bool,
    exchange: Exchange<'_>,
) -> Result<usize, DialogueError> {
    if conversation.member(from).is_none() {
        return Err(DialogueError::NotAllowed {
            conversation: conversation.id.clone(),
            reason: format!("{from} is not a member"),
        });
    }
    check_links(org, conversation, from).await?;
    note_exchange(org, conversation, exchange.cause).await?;
    let turn = ConversationEvent::TakeTurn {
        by: from.clone(),
        text: text.to_string(),
        sent_record,
        at: org.clock().now(),
    };
    let taken = match commit(org, &conversation.id, turn).await? {
        Ok(taken) => taken,
        Err(spent @ TransitionError::BudgetSpent { .. }) => {
            sever(org, &conversation.id, Some(from), BUDGET_SPENT).await?;
            return Err(spent.into());
        }
        Err(refused) => return Err(refused.into()),
    };
    let ctx = Context {
        exchange: Some(exchange),
        result_key: None,
    };
    let (delivered, spent) = carry_out(org, &taken.conversation, &taken.effects, &ctx).await;
    if let Some(by) = spent {
        sever(org, &conversation.id, Some(&by), BUDGET_SPENT).await?;
    }
    Ok(delivered)
}

/// Severs a conversation: every membership ends at once. Severing a severed conversation changes
/// nothing. Members and the `initiated_from` channel get a history-only notice.
pub(crate) async fn sever(
    org: &BehaviourContext,
    id: &ConversationId,
    by: Option<&AgentId>,
    reason: &str,
) -> Result<Conversation, DialogueError> {
    let event = ConversationEvent::Sever {
        by: by.cloned(),
        reason: reason.to_string(),
        at: org.clock().now(),
    };
    let severed = commit(org, id, event).await??;
    carry_out(
        org,
        &severed.conversation,
        &severed.effects,
        &Context::default(),
    )
    .await;
    Ok(severed.conversation)
}

/// The notices of a sever: one in every member's channel, one in `initiated_from`.
async fn record_severed(
    org: &BehaviourContext,
    severed: &Conversation,
    by: Option<&AgentId>,
    reason: &str,
) {
    let id = &severed.id;
    let who = by.map_or_else(String::new, |a| format!(" by {}", org.display_name(a)));
    let notice = format!("This conversation was severed{who}: {reason}.");
    for member in &severed.members {
        let (agent, channel) = (&member.agent, &member.channel);
        let notice = notice.clone();
        append(
            org,
            agent,
            channel,
            RecordKind::System,
            "system",
            notice,
            id,
        )
        .await;
    }
    if let Some(origin) = &severed.initiated_from {
        let others = other_names(severed, &severed.initiator).join(", ");
        append(
            org,
            &severed.initiator,
            origin,
            RecordKind::System,
            "system",
            format!(
                "The conversation with {others} was severed{who}, without a conclusion: {reason}."
            ),
            id,
        )
        .await;
    }
}

/// Ends an open conversation with `summary` (a conclusion, or the initiator's close): the summary
/// reaches the other members' channels without waking them, every side closes, and the initiator's
/// `initiated_from` channel is retriggered with the summary.
///
/// The conclusion is marked before the result is sent, so nobody hears a result of a conversation
/// that is still open (and sends into it again) or that ended otherwise meanwhile (a sever, the
/// budget). A turn run again after a crash or a hand-over makes the same call under the same key,
/// and two applied keys of the concluder tell it how far the first run got: `conclude:{key}`
/// (written before the mark) and `concluded:{key}` (after it). A call that concluded already only
/// sends its result again (under the same key: the receiver applies it once), so a conversation
/// reopened since is not concluded by a stale call.
pub(crate) async fn conclude(
    org: &BehaviourContext,
    id: &ConversationId,
    by: &AgentId,
    summary: &str,
    exchange: Exchange<'_>,
) -> Result<Conversation, DialogueError> {
    let deliveries = &org.stores().deliveries;
    let now = org.clock().now();
    let marks = exchange
        .key
        .map(|k| (format!("conclude:{k}"), format!("concluded:{k}")));
    let current = org
        .stores()
        .conversations
        .get(id)
        .await?
        .ok_or_else(|| DialogueError::NotFound(format!("conversation {id}")))?;
    let result_key = |revision: u64| match exchange.key {
        Some(key) => format!("conclusion:{id}:{key}"),
        None => format!("conclusion:{id}:{revision}"),
    };
    if let Some((_, done)) = &marks
        && deliveries.is_applied(by, done).await?
    {
        if let Some(origin) = &current.initiated_from {
            let result = (&current.initiator, origin, by, summary);
            let cause = Some(exchange.cause);
            retrigger_conclusion(org, &current, result, result_key(0), cause).await;
        }
        return Ok(current);
    }
    let mut replay = false;
    if current.status == ConversationStatus::Open {
        check_links(org, &current, by).await?;
        if let Some((intent, _)) = &marks {
            replay = !deliveries.mark_applied(by, intent, now).await?;
        }
    } else if let Some((intent, _)) = &marks {
        replay = deliveries.is_applied(by, intent).await?;
    }
    let event = ConversationEvent::Conclude {
        by: by.clone(),
        summary: summary.to_string(),
        replay,
        at: now,
    };
    let concluded = commit(org, id, event).await??;
    if let Some((_, done)) = &marks {
        deliveries.mark_applied(by, done, now).await?;
    }
    // Keyed by the concluding call when it has a key (a run again sends the same one), else by the
    // revision the conclusion replaced.
    let changed = u64::from(concluded.changed);
    let ctx = Context {
        exchange: Some(exchange),
        result_key: Some(result_key(
            concluded.conversation.revision.saturating_sub(changed),
        )),
    };
    carry_out(org, &concluded.conversation, &concluded.effects, &ctx).await;
    Ok(concluded.conversation)
}

/// The conclusion in every member's channel, without waking anyone: a sent record for its author,
/// a user record for the others.
async fn record_conclusion(
    org: &BehaviourContext,
    concluded: &Conversation,
    by: &AgentId,
    summary: &str,
) {
    let name = org.display_name(by);
    for member in &concluded.members {
        let (kind, author, content) = if &member.agent == by {
            (
                RecordKind::Sent,
                by.to_string(),
                format!("[conclusion] {summary}"),
            )
        } else {
            (
                RecordKind::User,
                format!("agent {by}"),
                format!("[conclusion from {name}] {summary}"),
            )
        };
        let (agent, channel) = (&member.agent, &member.channel);
        append(org, agent, channel, kind, &author, content, &concluded.id).await;
    }
}

/// Wakes the initiator's `initiated_from` channel (`origin`) with a conversation's conclusion by
/// `by`, under `key` (the receiver applies it once).
async fn retrigger_conclusion(
    org: &BehaviourContext,
    conversation: &Conversation,
    (initiator, origin, by, summary): (&AgentId, &ChannelId, &AgentId, &str),
    key: String,
    cause: Option<&EnvelopeId>,
) {
    let id = &conversation.id;
    let others = other_names(conversation, initiator).join(", ");
    let name = org.display_name(by);
    let mut envelope = Envelope::new(
        Source::System,
        origin.clone(),
        EnvelopeKind::Retrigger,
        format!("The conversation with {others} concluded ({name}): {summary}"),
        org.clock().now(),
    )
    .with_conversation(id.clone());
    if let Some(cause) = cause {
        envelope = envelope.with_cause(cause.clone());
    }
    envelope.idempotency_key = Some(key);
    if let Err(e) = org.enqueue(initiator, envelope).await {
        org.report_error(
            initiator,
            Some(origin),
            format!("result of conversation {id} not delivered: {e}"),
        );
    }
}
