//! Conversations over links (seeds 000 and 002): mirrored two-party channels and member links.
//!
//! Both modes share one primitive, the [`Conversation`] record: members, an initiator, the channel
//! to wake with the result (`initiated_from`, set once), a status, and a turn budget that can only
//! go down.
//!
//! - **Mirrored** (two agents): each side has its own link channel, `link:A:B` and `link:B:A`, both
//!   registered when the organization starts ([`Organization::ensure_link_channels`]). A send
//!   writes a user message into the peer's side (which wakes the peer) and a history-only sent
//!   record into the sender's side; the peer's final answer is mirrored back the same way.
//!   `conclude_link(summary)` ends the conversation: the summary reaches the peer's side without
//!   waking it, and the initiator's `initiated_from` channel is retriggered with it.
//! - **Group** (N members): every member speaks in its own `conversation:{id}` channel; when a
//!   member's turn ends, its distilled output (see [`distill`]) reaches every other open member.
//!   The initiator may close it with a final message; any member may sever it.
//!
//! Every message that crosses costs one turn of the budget; the conversation is severed when the
//! budget is spent, and nothing can raise it again (the stores refuse through
//! [`Conversation::check_successor`]). A concluded conversation may be reopened (same record, same
//! remaining budget, same history); a severed one stays severed. When an agent's session ends, its
//! open conversations are severed.
//!
//! The runtime calls into this module at two points: `route_reply` when a turn produced a final
//! answer (a reply in a conversation channel goes to the other members instead of the agent's
//! outbound), and `on_agent_stopped` when an agent's session ends.

mod tools;

use crate::channel::{NewRecord, RecordKind};
use crate::conversation::{
    Conversation, ConversationFilter, ConversationMode, ConversationStatus, Member, MemberRole,
};
use crate::envelope::{Envelope, EnvelopeKind, Source};
use crate::error::{InvalidInput, PolicyDenied, StoreError};
use crate::event::EventKind;
use crate::ids::{AgentId, ChannelId, ConversationId, EnvelopeId, LinkId};
use crate::org::{DeliveryError, Organization};
use crate::policy;
use crate::prompts::ConversationRulesContext;
use crate::runtime::agent::report_error;
use crate::runtime::behaviour::{Answer, Behaviour, BehaviourContext};

pub(crate) use tools::dialogue_tools;
pub use tools::{CLOSE_LINK, CONCLUDE_LINK, OPEN_GROUP, SEND_LINK_MESSAGE, SEVER_LINK};

/// Metadata key naming the conversation on the envelopes and records it produces.
pub use crate::envelope::META_CONVERSATION;
/// Metadata key naming the conversation on the retrigger that carries its result.
pub const META_RESULT: &str = "spacebot.conversation_result";

/// How many times a compare-and-swap is retried before giving up with the conflict.
const CAS_ATTEMPTS: usize = 16;

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

/// Notes that the exchange `cause` took a turn of `conversation`.
///
/// The note is stored, as an applied key `exchange:{conversation}:{cause}` of the conversation's
/// initiator in the delivery store, where [`used_by`] finds it after a restart and, under a
/// placement (an organization spread over several processes), in every process: a budget is a
/// backstop that neither a restart nor a move resets. This process keeps the latest notes in memory
/// too, so a conversation's later turns in the same exchange write nothing more.
async fn note_exchange(
    org: &Organization,
    conversation: &Conversation,
    cause: &EnvelopeId,
) -> Result<(), StoreError> {
    let fresh = {
        let mut exchanges = org
            .inner
            .exchanges
            .lock()
            .unwrap_or_else(|e| e.into_inner());
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
        org.inner
            .stores
            .deliveries
            .mark_applied(
                &conversation.initiator,
                &exchange_key(&conversation.id, cause),
                org.inner.clock.now(),
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
async fn used_by(
    org: &Organization,
    conversation: &Conversation,
    cause: &EnvelopeId,
) -> Result<bool, StoreError> {
    let here = org
        .inner
        .exchanges
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&conversation.id)
        .is_some_and(|c| c.contains(cause));
    if here {
        return Ok(true);
    }
    org.inner
        .stores
        .deliveries
        .is_applied(
            &conversation.initiator,
            &exchange_key(&conversation.id, cause),
        )
        .await
}

fn meta(id: &ConversationId) -> serde_json::Map<String, serde_json::Value> {
    let mut map = serde_json::Map::new();
    map.insert(
        META_CONVERSATION.into(),
        serde_json::Value::String(id.to_string()),
    );
    map
}

fn conversation_of(envelope: &Envelope) -> Option<ConversationId> {
    envelope.conversation.clone()
}

/// Appends a record to `agent`'s channel; a failure becomes an error event.
async fn append(
    org: &Organization,
    agent: &AgentId,
    channel: &ChannelId,
    kind: RecordKind,
    author: &str,
    content: String,
    conversation: &ConversationId,
) {
    let mut record = NewRecord::new(
        channel.clone(),
        kind,
        author,
        content,
        org.inner.clock.now(),
    );
    record.metadata = meta(conversation);
    if let Err(e) = org.inner.stores.channels.append(agent, record).await {
        report_error(
            &org.inner,
            agent,
            Some(channel),
            format!("history not written: {e}"),
        );
    }
}

/// The enabled link between two agents, either direction (for stamping envelopes).
fn link_between(org: &Organization, a: &AgentId, b: &AgentId) -> Option<LinkId> {
    let graph = org.inner.graph();
    graph
        .between(a.as_str(), b.as_str())
        .or_else(|| graph.between(b.as_str(), a.as_str()))
        .map(|l| l.id.clone())
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

fn emit(org: &Organization, agent: &AgentId, channel: Option<&ChannelId>, kind: EventKind) {
    let mut event = org.inner.event(agent, kind);
    event.channel = channel.cloned();
    org.inner.emit(event);
}

/// Applies `change` to the stored conversation with compare-and-swap, retrying on conflicts.
/// `change` returns `Ok(false)` to leave the record as it is (the stored record is returned then).
async fn modify<F>(
    org: &Organization,
    id: &ConversationId,
    mut change: F,
) -> Result<(Conversation, bool), DialogueError>
where
    F: FnMut(&mut Conversation) -> Result<bool, DialogueError>,
{
    let store = &org.inner.stores.conversations;
    let mut last = None;
    for _ in 0..CAS_ATTEMPTS {
        let current = store
            .get(id)
            .await?
            .ok_or_else(|| DialogueError::NotFound(format!("conversation {id}")))?;
        let mut next = current.clone();
        if !change(&mut next)? {
            return Ok((current, false));
        }
        next.updated_at = org.inner.clock.now();
        match store.update(&next, current.revision).await {
            Ok(stored) => return Ok((stored, true)),
            Err(e @ StoreError::Conflict { .. }) => last = Some(e),
            Err(e) => return Err(e.into()),
        }
    }
    Err(last
        .map(DialogueError::Store)
        .unwrap_or_else(|| DialogueError::NotFound(format!("conversation {id}"))))
}

/// Gives every member the anti-chattiness rules, once (called at creation only).
async fn give_rules(org: &Organization, conversation: &Conversation) {
    for member in &conversation.members {
        let ctx = ConversationRulesContext {
            members: other_names(conversation, &member.agent),
            is_initiator: member.agent == conversation.initiator,
            turn_budget: Some(conversation.budget_remaining),
        };
        match org.inner.prompts.render_conversation_rules(&ctx) {
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
            Err(e) => report_error(
                &org.inner,
                &member.agent,
                Some(&member.channel),
                format!("conversation rules not rendered: {e}"),
            ),
        }
    }
}

fn opened_event(org: &Organization, conversation: &Conversation) {
    emit(
        org,
        &conversation.initiator,
        conversation.initiated_from.as_ref(),
        EventKind::ConversationOpened {
            conversation: conversation.id.clone(),
            members: conversation
                .members
                .iter()
                .map(|m| m.agent.clone())
                .collect(),
        },
    );
}

/// The latest concluded conversation holding `key`, among those `agent` is a member of.
async fn latest_concluded(
    org: &Organization,
    agent: &AgentId,
    key: &str,
) -> Result<Option<Conversation>, StoreError> {
    let filter = ConversationFilter {
        member: Some(agent.clone()),
        statuses: vec![ConversationStatus::Concluded],
    };
    let list = org.inner.stores.conversations.list(&filter).await?;
    Ok(list
        .into_iter()
        .rev()
        .find(|c| c.pair_key.as_deref() == Some(key)))
}

/// A conversation holding `key` whose budget the exchange `cause` spent (severed with no turn
/// left after `cause` took turns of it).
async fn spent_by(
    org: &Organization,
    agent: &AgentId,
    key: &str,
    cause: &EnvelopeId,
) -> Result<Option<ConversationId>, StoreError> {
    let filter = ConversationFilter {
        member: Some(agent.clone()),
        statuses: vec![ConversationStatus::Severed],
    };
    let list = org.inner.stores.conversations.list(&filter).await?;
    for c in list.into_iter().rev() {
        if c.pair_key.as_deref() == Some(key)
            && c.budget_remaining == 0
            && used_by(org, &c, cause).await?
        {
            return Ok(Some(c.id));
        }
    }
    Ok(None)
}

/// Finds the open conversation holding `key`, reopens the latest concluded one, or creates
/// `fresh()`. Concurrent callers with one key end in one conversation. From the conversation's own
/// channel only an open conversation may be joined: an ended one is not started again from inside
/// (otherwise two models answering each other would start over whenever the budget severs them).
#[allow(clippy::too_many_arguments)]
async fn open_or_join<F>(
    org: &Organization,
    opener: &AgentId,
    key: &str,
    origin: Option<ChannelId>,
    from_own_channel: bool,
    exchange: Exchange<'_>,
    may_start: impl Fn() -> Result<(), PolicyDenied>,
    fresh: F,
) -> Result<(Conversation, Opening), DialogueError>
where
    F: Fn() -> Conversation,
{
    let store = &org.inner.stores.conversations;
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
        if let Some(concluded) = latest_concluded(org, opener, key).await? {
            let mut next = concluded.clone();
            next.status = ConversationStatus::Open;
            for m in &mut next.members {
                m.open = true;
            }
            if next.initiated_from.is_none() && next.initiator == *opener {
                next.initiated_from = origin.clone();
            }
            next.updated_at = org.inner.clock.now();
            match store.update(&next, concluded.revision).await {
                Ok(stored) => {
                    opened_event(org, &stored);
                    return Ok((stored, Opening::Reopened));
                }
                Err(e @ (StoreError::Conflict { .. } | StoreError::AlreadyExists { .. })) => {
                    last = Some(e);
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        }
        let conversation = fresh();
        match store.create(&conversation).await {
            Ok(()) => {
                give_rules(org, &conversation).await;
                opened_event(org, &conversation);
                return Ok((conversation, Opening::Created));
            }
            Err(e @ StoreError::AlreadyExists { .. }) => last = Some(e),
            Err(e) => return Err(e.into()),
        }
    }
    Err(last
        .map(DialogueError::Store)
        .unwrap_or_else(|| DialogueError::NotFound(format!("conversation with key {key}"))))
}

/// Takes one turn from the budget. With none left the conversation is severed and nothing may be
/// delivered.
async fn charge_turn(
    org: &Organization,
    id: &ConversationId,
    by: &AgentId,
) -> Result<Conversation, DialogueError> {
    let (charged, changed) = modify(org, id, |c| {
        if c.status != ConversationStatus::Open {
            return Err(DialogueError::NotAllowed {
                conversation: c.id.clone(),
                reason: format!("it is {}; nothing was delivered", c.status),
            });
        }
        if c.budget_remaining == 0 {
            return Ok(false);
        }
        c.budget_remaining -= 1;
        Ok(true)
    })
    .await?;
    if !changed {
        sever(org, id, Some(by), "its turn budget is spent").await?;
        return Err(DialogueError::NotAllowed {
            conversation: id.clone(),
            reason: "its turn budget is spent; it was severed and nothing was delivered".into(),
        });
    }
    Ok(charged)
}

/// A conversation between two agents lives on their link: once no enabled link joins them, it
/// carries nothing more and is severed.
async fn check_links(
    org: &Organization,
    conversation: &Conversation,
    from: &AgentId,
) -> Result<(), DialogueError> {
    if conversation.mode != ConversationMode::Mirrored {
        return Ok(());
    }
    let graph = org.inner.graph();
    for member in conversation.members.iter().filter(|m| &m.agent != from) {
        if let Err(denied) = policy::check_answer(&graph, from, &member.agent, true) {
            sever(org, &conversation.id, Some(from), &denied.to_string()).await?;
            return Err(DialogueError::Denied(denied));
        }
    }
    Ok(())
}

/// Hands `text` from `from` to the other open members of `conversation`, charging one turn.
/// With `sent_record`, a history-only copy goes into the sender's own channel. Returns how many
/// members received it. A failed delivery to one member does not stop the others.
pub(crate) async fn deliver_turn(
    org: &Organization,
    conversation: &Conversation,
    from: &AgentId,
    text: &str,
    sent_record: bool,
    exchange: Exchange<'_>,
) -> Result<usize, DialogueError> {
    let Some(sender) = conversation.member(from).cloned() else {
        return Err(DialogueError::NotAllowed {
            conversation: conversation.id.clone(),
            reason: format!("{from} is not a member"),
        });
    };
    check_links(org, conversation, from).await?;
    note_exchange(org, conversation, exchange.cause).await?;
    let charged = charge_turn(org, &conversation.id, from).await?;
    if sent_record {
        append(
            org,
            from,
            &sender.channel,
            RecordKind::Sent,
            from.as_str(),
            text.to_string(),
            &conversation.id,
        )
        .await;
    }
    let content = match conversation.mode {
        ConversationMode::Mirrored => text.to_string(),
        ConversationMode::Group => format!("[{}] {text}", sender.name),
    };
    let mut delivered = 0;
    let now = org.inner.clock.now();
    for member in charged
        .members
        .iter()
        .filter(|m| &m.agent != from && m.open)
    {
        let mut envelope = Envelope::new(
            Source::Internal {
                from_agent: from.clone(),
                link_id: link_between(org, from, &member.agent),
            },
            member.channel.clone(),
            EnvelopeKind::UserMessage,
            content.clone(),
            now,
        )
        .with_conversation(conversation.id.clone())
        .with_cause(exchange.cause.clone());
        if let Some(key) = exchange.key {
            envelope.idempotency_key = Some(format!("{key}:to:{}", member.agent));
        }
        match org.inner.enqueue(&member.agent, envelope, true).await {
            Ok(()) => {
                delivered += 1;
                emit(
                    org,
                    &member.agent,
                    Some(&member.channel),
                    EventKind::MessageReceived { from: from.clone() },
                );
            }
            Err(e) => report_error(
                &org.inner,
                from,
                Some(&sender.channel),
                format!(
                    "conversation {}: delivery to {} failed: {e}",
                    conversation.id, member.agent
                ),
            ),
        }
    }
    emit(
        org,
        from,
        Some(&sender.channel),
        EventKind::MessageSent {
            to: charged
                .members
                .iter()
                .find(|m| &m.agent != from)
                .map_or_else(|| from.clone(), |m| m.agent.clone()),
        },
    );
    if charged.budget_remaining == 0 {
        sever(
            org,
            &conversation.id,
            Some(from),
            "its turn budget is spent",
        )
        .await?;
    }
    Ok(delivered)
}

/// Severs a conversation: every membership ends at once. Severing a severed conversation changes
/// nothing. Members and the `initiated_from` channel get a history-only notice.
pub(crate) async fn sever(
    org: &Organization,
    id: &ConversationId,
    by: Option<&AgentId>,
    reason: &str,
) -> Result<Conversation, DialogueError> {
    let (severed, changed) = modify(org, id, |c| {
        if c.status == ConversationStatus::Severed {
            return Ok(false);
        }
        c.status = ConversationStatus::Severed;
        for m in &mut c.members {
            m.open = false;
        }
        Ok(true)
    })
    .await?;
    if !changed {
        return Ok(severed);
    }
    let who = by.map_or_else(String::new, |a| format!(" by {}", org.display_name(a)));
    let notice = format!("This conversation was severed{who}: {reason}.");
    for member in &severed.members {
        append(
            org,
            &member.agent,
            &member.channel,
            RecordKind::System,
            "system",
            notice.clone(),
            id,
        )
        .await;
    }
    if let Some(origin) = &severed.initiated_from {
        let others = other_names(&severed, &severed.initiator).join(", ");
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
    emit(
        org,
        by.unwrap_or(&severed.initiator),
        None,
        EventKind::ConversationSevered {
            conversation: id.clone(),
            reason: reason.to_string(),
        },
    );
    Ok(severed)
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
    org: &Organization,
    id: &ConversationId,
    by: &AgentId,
    summary: &str,
    exchange: Exchange<'_>,
) -> Result<Conversation, DialogueError> {
    let deliveries = &org.inner.stores.deliveries;
    let now = org.inner.clock.now();
    let marks = exchange
        .key
        .map(|k| (format!("conclude:{k}"), format!("concluded:{k}")));
    let current = org
        .inner
        .stores
        .conversations
        .get(id)
        .await?
        .ok_or_else(|| DialogueError::NotFound(format!("conversation {id}")))?;
    let name = org.display_name(by);
    let result_key = |revision: u64| match exchange.key {
        Some(key) => format!("conclusion:{id}:{key}"),
        None => format!("conclusion:{id}:{revision}"),
    };
    if let Some((_, done)) = &marks
        && deliveries.is_applied(by, done).await?
    {
        retrigger_conclusion(org, &current, &name, summary, result_key(0), exchange.cause).await;
        return Ok(current);
    }
    let mut again = false;
    if current.status == ConversationStatus::Open {
        check_links(org, &current, by).await?;
        if let Some((intent, _)) = &marks {
            again = !deliveries.mark_applied(by, intent, now).await?;
        }
    } else if let Some((intent, _)) = &marks {
        again = deliveries.is_applied(by, intent).await?;
    }
    let (concluded, changed) = modify(org, id, |c| {
        if c.status != ConversationStatus::Open {
            if again && c.status == ConversationStatus::Concluded {
                // The first run concluded it and stopped before `concluded:{key}`.
                return Ok(false);
            }
            return Err(DialogueError::NotAllowed {
                conversation: c.id.clone(),
                reason: format!("it is {} already", c.status),
            });
        }
        c.status = ConversationStatus::Concluded;
        c.summary = Some(summary.to_string());
        for m in &mut c.members {
            m.open = false;
        }
        Ok(true)
    })
    .await?;
    if let Some((_, done)) = &marks {
        deliveries.mark_applied(by, done, now).await?;
    }
    // Keyed by the concluding call when it has a key (a run again sends the same one), else by the
    // revision the conclusion replaced.
    let key = result_key(concluded.revision.saturating_sub(u64::from(changed)));
    retrigger_conclusion(org, &concluded, &name, summary, key, exchange.cause).await;
    if !changed {
        return Ok(concluded);
    }
    for member in &concluded.members {
        if &member.agent == by {
            append(
                org,
                by,
                &member.channel,
                RecordKind::Sent,
                by.as_str(),
                format!("[conclusion] {summary}"),
                id,
            )
            .await;
        } else {
            append(
                org,
                &member.agent,
                &member.channel,
                RecordKind::User,
                &format!("agent {by}"),
                format!("[conclusion from {name}] {summary}"),
                id,
            )
            .await;
        }
    }
    emit(
        org,
        by,
        concluded.member(by).map(|m| &m.channel),
        EventKind::ConversationConcluded {
            conversation: id.clone(),
        },
    );
    Ok(concluded)
}

/// Wakes the initiator's `initiated_from` channel with a conversation's conclusion, under `key`
/// (the receiver applies it once).
async fn retrigger_conclusion(
    org: &Organization,
    conversation: &Conversation,
    name: &str,
    summary: &str,
    key: String,
    cause: &EnvelopeId,
) {
    let id = &conversation.id;
    if let Some(origin) = &conversation.initiated_from {
        let others = other_names(conversation, &conversation.initiator).join(", ");
        let mut envelope = Envelope::new(
            Source::System,
            origin.clone(),
            EnvelopeKind::Retrigger,
            format!("The conversation with {others} concluded ({name}): {summary}"),
            org.inner.clock.now(),
        )
        .with_conversation(id.clone())
        .with_cause(cause.clone());
        envelope.idempotency_key = Some(key);
        if let Err(e) = org
            .inner
            .enqueue(&conversation.initiator, envelope, true)
            .await
        {
            report_error(
                &org.inner,
                &conversation.initiator,
                Some(origin),
                format!("result of conversation {id} not delivered: {e}"),
            );
        }
    }
}

/// Opens or continues the mirrored conversation of `from` with `target` and sends `message`.
pub(crate) async fn send_mirrored(
    org: &Organization,
    from: &AgentId,
    target: &str,
    origin: &ChannelId,
    message: &str,
    exchange: Exchange<'_>,
) -> Result<(Conversation, Opening), DialogueError> {
    let to = org.resolve(target)?;
    let graph = org.inner.graph();
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
    let budget = org.inner.settings.conversation_turn_budget;
    let now = org.inner.clock.now();
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
    let (conversation, opening) = open_or_join(
        org,
        from,
        &key,
        origin.clone(),
        origin.is_none(),
        exchange,
        may_start,
        fresh,
    )
    .await?;
    deliver_turn(org, &conversation, from, message, true, exchange).await?;
    Ok((conversation, opening))
}

/// Opens (or continues, or reopens) the group of `from` and `members` and sends `message`.
pub(crate) async fn open_group(
    org: &Organization,
    from: &AgentId,
    members: &[String],
    origin: &ChannelId,
    message: &str,
    exchange: Exchange<'_>,
) -> Result<(Conversation, Opening), DialogueError> {
    if members.is_empty() {
        return Err(InvalidInput::new("members", "name at least one other agent").into());
    }
    let graph = org.inner.graph();
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
    let budget = org.inner.settings.conversation_turn_budget;
    let now = org.inner.clock.now();
    let from_own_channel = match origin.as_str().strip_prefix("conversation:") {
        Some(id) => org
            .inner
            .stores
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
    let (conversation, opening) = open_or_join(
        org,
        from,
        &key,
        origin.clone(),
        from_own_channel,
        exchange,
        || Ok(()),
        fresh,
    )
    .await?;
    deliver_turn(org, &conversation, from, message, true, exchange).await?;
    Ok((conversation, opening))
}

/// The conversation `agent` means: the one named by `target` (a conversation id, or another
/// member's id or name), else the one whose channel `channel` is. Only open conversations with
/// `agent` as a member match.
pub(crate) async fn find_for(
    org: &Organization,
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
    org: &Organization,
    agent: &AgentId,
    channel: &ChannelId,
    target: Option<&str>,
    key: &str,
) -> Result<Conversation, DialogueError> {
    match find_for(org, agent, channel, target).await {
        Err(DialogueError::NotFound(why)) => {
            let applied = org
                .inner
                .stores
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
    org: &Organization,
    agent: &AgentId,
    channel: &ChannelId,
    target: Option<&str>,
    statuses: Vec<ConversationStatus>,
) -> Result<Conversation, DialogueError> {
    let filter = ConversationFilter {
        member: Some(agent.clone()),
        statuses,
    };
    let mut open = org.inner.stores.conversations.list(&filter).await?;
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
    org: &Organization,
    agent: &AgentId,
    channel: &ChannelId,
    answered: &[Envelope],
) -> Result<Option<Conversation>, StoreError> {
    let store = &org.inner.stores.conversations;
    let in_channel = |c: &Conversation| c.member(agent).is_some_and(|m| &m.channel == channel);
    let mut closed = None;
    for id in answered.iter().filter_map(conversation_of) {
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
    org: &Organization,
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
            report_error(
                &org.inner,
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
    org: &Organization,
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
        dialogue_tools()
    }

    async fn on_start_all(&self, ctx: &BehaviourContext) -> Result<(), StoreError> {
        ensure_link_channels(&ctx.organization()).await
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
            &ctx.organization(),
            answer.agent,
            answer.channel,
            answer.text,
            answer.answered,
            answer.cause,
        ))
        .await
    }

    async fn on_agent_stopped(&self, ctx: &BehaviourContext, agent: &AgentId) {
        on_agent_stopped(&ctx.organization(), agent).await;
    }
}

/// Called when an agent's session ends (it is stopped or ends): its open conversations are severed.
/// A loop stopped without ending the session ends none: a shutdown (the agent goes on at its next
/// start, as after a crash) or a hand-over to another process under a placement.
pub(crate) async fn on_agent_stopped(org: &Organization, agent: &AgentId) {
    if org.inner.is_handing_over(agent) {
        return;
    }
    let filter = ConversationFilter {
        member: Some(agent.clone()),
        statuses: vec![ConversationStatus::Open],
    };
    let open = match org.inner.stores.conversations.list(&filter).await {
        Ok(open) => open,
        Err(e) => {
            report_error(
                &org.inner,
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
            report_error(
                &org.inner,
                agent,
                None,
                format!("conversation {} not severed: {e}", conversation.id),
            );
        }
    }
}

/// Registers both link channels (`link:A:B` for A and `link:B:A` for B) of every link.
pub(crate) async fn ensure_link_channels(org: &Organization) -> Result<(), StoreError> {
    let graph = org.inner.graph();
    let channels = &org.inner.stores.channels;
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

impl Organization {
    /// The conversations matching `filter` (by member and status), oldest first.
    pub async fn conversations(
        &self,
        filter: &ConversationFilter,
    ) -> Result<Vec<Conversation>, StoreError> {
        self.inner.stores.conversations.list(filter).await
    }

    /// One conversation.
    pub async fn conversation(
        &self,
        id: &ConversationId,
    ) -> Result<Option<Conversation>, StoreError> {
        self.inner.stores.conversations.get(id).await
    }

    /// Registers both link channels of every link, so each side's history exists before the first
    /// message. [`Organization::start_all`] does it; call it after starting agents one by one or
    /// after [`Organization::reload_links`].
    pub async fn ensure_link_channels(&self) -> Result<(), StoreError> {
        ensure_link_channels(self).await
    }

    /// Severs a conversation from outside (an application ending it): every membership ends at once
    /// and the members and the `initiated_from` channel are told `reason`. Severing a severed
    /// conversation changes nothing.
    pub async fn sever_conversation(
        &self,
        id: &ConversationId,
        reason: &str,
    ) -> Result<Conversation, DialogueError> {
        sever(self, id, None, reason).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
