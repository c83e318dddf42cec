//! The agent's loop: the only consumer of its queue and the only caller of the tool loop.
//!
//! One envelope at a time: a record is written, a task runs as a turn whose answer is the task's
//! result, anything else runs as a turn whose answer goes to the envelope's own destination. A turn
//! commits once, at its end: the envelopes it consumed leave the agent's pending deliveries in the
//! same store transaction as the records it wrote and the idempotency keys it applied (see
//! [`TurnCommit`]). A turn killed before that commit runs again after a restart; the effects its
//! tools had carry idempotency keys derived from the envelope and the call, so they are not repeated.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use async_trait::async_trait;
use futures::future::{AbortHandle, Abortable};

use crate::channel::{NewRecord, RecordKind};
use crate::envelope::{Envelope, EnvelopeKind, Source, TurnCommit};
use crate::error::{LlmError, StoreError};
use crate::event::EventKind;
use crate::ids::{AgentId, ChannelId, EnvelopeId, TaskRef};
use crate::llm::{ChatMessage, ChatRequest, ToolCall};
use crate::policy;
use crate::prompts::{LinkContext, OrgContext, PromptError, SystemPromptContext};
use crate::runtime::behaviour::BehaviourContext;
use crate::runtime::history;
use crate::runtime::host::{AgentRuntime, Host};
use crate::runtime::outbound::{Outbound, OutboundError, Reply, ReplyKind};
use crate::runtime::queue::AgentQueue;
use crate::runtime::steer::{merge_backlog, source_label};
use crate::text::Text;
use crate::tools::{ToolCapability, ToolContext};

/// How many history records of a channel a turn sends to the model.
const HISTORY_LIMIT: usize = 50;

/// The first wait after a store failure; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
/// The longest wait between two tries of a failing store write.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Why a turn ended without a reply.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TurnError {
    /// The model call failed.
    #[error(transparent)]
    Llm(#[from] LlmError),
    /// A store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The system prompt could not be rendered.
    #[error(transparent)]
    Prompt(#[from] PromptError),
    /// The model kept calling tools past the limit.
    #[error("the turn used {limit} tool rounds without a final answer and was stopped")]
    RoundLimit {
        /// The limit.
        limit: u32,
    },
    /// The model answered with no text and no tool call, again when asked once more.
    #[error("the model gave an empty answer {attempts} times in a row")]
    EmptyAnswer {
        /// How many empty answers it gave.
        attempts: u32,
    },
}

impl TurnError {
    /// This error's text fit to leave the runtime (a failure reply, a task's failure reason, the
    /// notice in the channel's history the model reads): without URLs or credentials (see
    /// [`redact`](crate::runtime::redact::redact)).
    pub fn public_text(&self) -> String {
        crate::runtime::redact::redact(&self.to_string())
    }
}

/// How many times a turn asks the model again after an empty answer before it fails.
const EMPTY_ANSWER_RETRIES: u32 = 1;

/// What a finished turn produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TurnOutcome {
    /// A final answer (already sent to the outbound, unless the caller handles it).
    Answer(String),
    /// A tool ended the turn (for example a delegation); its result text.
    Ended(String),
}

/// What a turn writes to the agent's own store at its end, gathered while it runs.
#[derive(Debug, Default)]
pub(crate) struct TurnLog {
    commit: TurnCommit,
    keys: HashSet<String>,
    /// Tokens the turn's model calls spent, as the provider reported them.
    pub(crate) usage: crate::llm::Usage,
}

impl TurnLog {
    fn record(&mut self, record: NewRecord) {
        self.commit.records.push(record);
    }

    /// Takes `envelope` as consumed by this turn; its key (if any) is applied at the commit.
    fn consume(&mut self, envelope: &Envelope) {
        self.commit.consumed.push(envelope.id.clone());
        if let Some(key) = &envelope.idempotency_key
            && self.keys.insert(key.clone())
        {
            self.commit.applied.push(key.clone());
        }
    }

    /// Whether this turn consumed an envelope with `key` already.
    fn has_key(&self, key: &str) -> bool {
        self.keys.contains(key)
    }

    /// Writes the records gathered so far (in one store transaction), so the history shows them
    /// while the turn goes on and before its answer leaves. The consumed envelopes and applied keys
    /// wait for the turn's commit: a turn killed before it runs again (its records may then show
    /// twice; its effects do not happen twice).
    async fn flush_records(&mut self, org: &Host, agent: &AgentId) {
        if self.commit.records.is_empty() {
            return;
        }
        let records = TurnCommit {
            records: std::mem::take(&mut self.commit.records),
            ..TurnCommit::default()
        };
        if let Err((e, records)) = org
            .stores
            .deliveries
            .commit_owned(agent, records, org.clock.now())
            .await
        {
            // Kept for the turn's commit, which retries.
            self.commit.records = records.records;
            report_error(org, agent, None, format!("history not written yet: {e}"));
        }
    }
}

/// The loop of one agent: take an envelope, run a turn, repeat until the queue closes.
///
/// What it awaits besides the queue is boxed, so an idle agent's loop holds a small future instead
/// of the state of a whole turn (about 4 KB), for every agent.
pub(crate) async fn run_loop(org: Arc<Host>, agent: Arc<AgentRuntime>) {
    loop {
        if agent.queue.is_empty() && agent.pending.swap(false, Ordering::AcqRel) {
            Box::pin(hand_over_pending(&org, &agent)).await;
        }
        let Some(envelope) = agent.queue.recv().await else {
            break;
        };
        agent.busy.store(true, Ordering::Release);
        Box::pin(process(&org, &agent, envelope)).await;
        agent.busy.store(false, Ordering::Release);
        if agent.queue.is_empty() {
            org.emit(org.event(agent.id(), EventKind::AgentIdle));
        }
        if let Some(parent) = &agent.spec.parent
            && parent.end_after_reply
            && agent.queue.is_empty()
        {
            let leftovers = org.end_agent(agent.id());
            for envelope in leftovers {
                Box::pin(report_to_parent(
                    &org,
                    &agent,
                    format!(
                        "child agent {} ended before answering a message from {}: {}",
                        agent.id(),
                        source_label(&envelope.source),
                        envelope.content
                    ),
                ))
                .await;
            }
            break;
        }
    }
    Box::pin(org.behaviours_agent_stopped(agent.id())).await;
    org.emit(org.event(agent.id(), EventKind::AgentStopped));
}

/// Envelopes kept in the store that the queue does not hold yet (persisted while the queue was
/// full, or while the agent started) go into the queue now that it is empty.
async fn hand_over_pending(org: &Host, agent: &AgentRuntime) {
    match org.stores.deliveries.pending(agent.id()).await {
        Ok(pending) => {
            let fresh: Vec<Envelope> = pending.into_iter().filter(|e| agent.admit(&e.id)).collect();
            for envelope in fresh.into_iter().rev() {
                let _ = agent.queue.push_front(envelope);
            }
        }
        Err(e) => {
            agent.pending.store(true, Ordering::Release);
            report_error(org, agent.id(), None, format!("pending deliveries: {e}"));
            backoff_sleep(org, 0).await;
        }
    }
}

/// Reports a failure no caller waits for: an event, never only a log line.
pub(crate) fn report_error(
    org: &Host,
    agent: &AgentId,
    channel: Option<&ChannelId>,
    message: String,
) {
    tracing::warn!(agent = %agent, "{message}");
    let mut event = org.event(agent, EventKind::Error { message });
    event.channel = channel.cloned();
    org.emit(event);
}

async fn backoff_sleep(org: &Host, attempt: u32) {
    let wait = FIRST_BACKOFF
        .saturating_mul(1u32 << attempt.min(10))
        .min(MAX_BACKOFF);
    org.clock.sleep(wait).await;
}

/// Runs a store operation until it succeeds, waiting longer after each failure (an Error event
/// each time). Gives up only when the agent is stopping, returning the last error.
pub(crate) async fn retry_store<T, F, Fut>(
    org: &Host,
    agent: &AgentRuntime,
    what: &str,
    mut op: F,
) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let mut attempt = 0u32;
    loop {
        match op().await {
            Ok(value) => return Ok(value),
            Err(e) => {
                report_error(
                    org,
                    agent.id(),
                    None,
                    format!("{what} failed (attempt {}; retrying): {e}", attempt + 1),
                );
                if agent.queue.is_closed() {
                    return Err(e);
                }
                backoff_sleep(org, attempt).await;
                attempt = attempt.saturating_add(1);
            }
        }
    }
}

/// Writes a turn's commit, retrying until it is stored.
async fn commit(org: &Host, agent: &AgentRuntime, log: TurnLog) {
    if !log.usage.is_zero() {
        org.add_usage(agent.id(), log.usage);
    }
    if log.commit.is_empty() {
        return;
    }
    let me = agent.id();
    let result = retry_store(org, agent, "committing a turn", || {
        org.stores
            .deliveries
            .commit(me, &log.commit, org.clock.now())
    })
    .await;
    match result {
        Ok(()) => {}
        Err(e) => report_error(
            org,
            me,
            None,
            format!("turn not committed (it runs again at the next start): {e}"),
        ),
    }
    agent.forget(&log.commit.consumed);
}

/// The authors `user` and `system`, made once per process (a clone is a reference count).
fn fixed_author(user: bool) -> Text {
    static USER: OnceLock<Text> = OnceLock::new();
    static SYSTEM: OnceLock<Text> = OnceLock::new();
    if user {
        USER.get_or_init(|| Text::from("user")).clone()
    } else {
        SYSTEM.get_or_init(|| Text::from("system")).clone()
    }
}

fn author_of(source: &Source) -> Text {
    match source {
        Source::External { .. } => fixed_author(true),
        Source::Internal { from_agent, .. } => ["agent ", from_agent.as_str()].concat().into(),
        Source::System => fixed_author(false),
    }
}

fn user_record(envelope: &Envelope) -> NewRecord {
    let kind = match envelope.kind {
        EnvelopeKind::SentRecord => RecordKind::Sent,
        EnvelopeKind::SystemRecord | EnvelopeKind::Retrigger | EnvelopeKind::Cancel => {
            RecordKind::System
        }
        _ => RecordKind::User,
    };
    let mut record = NewRecord::new(
        envelope.channel.clone(),
        kind,
        author_of(&envelope.source),
        envelope.content.clone(),
        envelope.timestamp,
    );
    record.metadata.insert(
        "envelope".into(),
        serde_json::Value::String(envelope.id.to_string()),
    );
    // Where replies in this channel go, kept with the history: a retrigger answered after a
    // restart (or in another process) still reaches the application's user.
    if let Some(source) = external_source_value(&envelope.source) {
        record.metadata.insert(META_REPLY_SOURCE.into(), source);
    }
    if let Some(conversation) = &envelope.conversation {
        record.metadata.insert(
            crate::envelope::META_CONVERSATION.into(),
            serde_json::Value::String(conversation.to_string()),
        );
    }
    record
}

/// An external source as JSON, as `serde_json::to_value` writes it (`{"source": "external",
/// "platform": ..., "reply_target": ...}`), built directly: once per user message.
fn external_source_value(source: &Source) -> Option<serde_json::Value> {
    let Source::External {
        platform,
        reply_target,
    } = source
    else {
        return None;
    };
    let mut map = serde_json::Map::new();
    map.insert("source".into(), serde_json::Value::from("external"));
    map.insert(
        "platform".into(),
        serde_json::Value::from(platform.as_str()),
    );
    map.insert(
        "reply_target".into(),
        serde_json::Value::from(reply_target.as_str()),
    );
    Some(serde_json::Value::Object(map))
}

fn system_record(channel: &ChannelId, text: impl Into<crate::text::Text>, org: &Host) -> NewRecord {
    NewRecord::new(
        channel.clone(),
        RecordKind::System,
        fixed_author(false),
        text,
        org.clock.now(),
    )
}

/// Takes one envelope off the queue and handles it.
async fn process(org: &Arc<Host>, agent: &Arc<AgentRuntime>, envelope: Envelope) {
    let me = agent.id().clone();
    let mut log = TurnLog::default();
    if let Some(key) = &envelope.idempotency_key {
        let applied = retry_store(org, agent, "checking an idempotency key", || {
            org.stores.deliveries.is_applied(&me, key)
        })
        .await;
        match applied {
            Ok(true) => {
                // Applied before (a notice delivered twice): nothing to do but let it go.
                log.commit.consumed.push(envelope.id.clone());
                commit(org, agent, log).await;
                return;
            }
            Ok(false) => {}
            Err(_) => {
                // Stopping while the store fails: the envelope stays stored for the next start.
                agent.forget(std::slice::from_ref(&envelope.id));
                keep_for_later(org, agent, envelope).await;
                return;
            }
        }
    }
    if !envelope.kind.wakes_model() {
        log.record(user_record(&envelope));
        log.consume(&envelope);
        commit(org, agent, log).await;
        return;
    }
    // The task path and the failure path are boxed where taken: the future of every turn (boxed
    // by the loop) carries only the common path's state.
    if let Some(work) = envelope.task.clone() {
        Box::pin(run_task(
            org,
            agent,
            envelope,
            work.number,
            work.holder,
            log,
        ))
        .await;
        return;
    }
    let channel = envelope.channel.clone();
    let (abort, registration) = AbortHandle::new_pair();
    *agent.abort.lock().unwrap_or_else(|e| e.into_inner()) = Some(abort);
    let options = TurnOptions {
        task: None,
        work: None,
    };
    let mut turn_log = TurnLog::default();
    let result = {
        let turn = Abortable::new(
            Box::pin(run_turn(
                org,
                agent,
                envelope.clone(),
                options,
                &mut turn_log,
            )),
            registration,
        );
        turn.await
    };
    agent.abort.lock().unwrap_or_else(|e| e.into_inner()).take();
    let mut log = turn_log;
    match result {
        Ok(Ok(_)) => {}
        Ok(Err(failure)) => {
            let text = format!("turn failed: {}", failure.error.public_text());
            for envelope in &failure.unanswered {
                log.record(system_record(&envelope.channel, text.clone(), org));
            }
            report_error(org, &me, Some(&channel), text);
            Box::pin(tell_failure(org, agent, &failure)).await;
        }
        Err(_aborted) => {
            log.record(system_record(
                &channel,
                "turn cancelled; the message was not answered",
                org,
            ));
            let mut event = org.event(&me, EventKind::TurnCancelled);
            event.channel = Some(channel);
            org.emit(event);
        }
    }
    commit(org, agent, log).await;
}

/// An envelope the loop could not process because the agent is stopping: in memory-only stores it
/// is kept in the pending deliveries (durable stores hold it already).
async fn keep_for_later(org: &Host, agent: &AgentRuntime, envelope: Envelope) {
    if org.stores_every_delivery() {
        return;
    }
    if let Err(e) = org.persist(agent.id(), envelope).await {
        report_error(
            org,
            agent.id(),
            None,
            format!("a message could not be kept: {e}"),
        );
    }
}

/// Tells the destinations of a failed turn's envelopes that it failed: a failure reply to the
/// application for external messages, a report to the parent for a child agent.
async fn tell_failure(inner: &Arc<Host>, agent: &AgentRuntime, failure: &TurnFailure) {
    let reason = failure.error.public_text();
    let mut by_source: Vec<(Source, ChannelId, Vec<EnvelopeId>)> = Vec::new();
    for envelope in failure.unanswered.iter().filter(|e| e.task.is_none()) {
        let source = reply_source(agent, std::slice::from_ref(envelope));
        if !matches!(source, Source::External { .. }) || agent.spec.parent.is_some() {
            continue;
        }
        match by_source
            .iter_mut()
            .find(|(s, c, _)| s == &source && c == &envelope.channel)
        {
            Some((_, _, ids)) => ids.push(envelope.id.clone()),
            None => by_source.push((source, envelope.channel.clone(), vec![envelope.id.clone()])),
        }
    }
    for (source, channel, ids) in by_source {
        let reply = Reply {
            agent: agent.id().clone(),
            channel: channel.clone(),
            source,
            in_reply_to: ids,
            content: format!("the agent could not answer: {reason}"),
            at: inner.clock.now(),
            kind: ReplyKind::Failure,
        };
        if let Err(e) = agent.spec.outbound.send(reply).await {
            report_error(
                inner,
                agent.id(),
                Some(&channel),
                format!("failure reply not delivered: {e}"),
            );
        }
    }
    if agent.spec.parent.is_some() {
        report_to_parent(
            inner,
            agent,
            format!("child agent {} failed: {reason}", agent.id()),
        )
        .await;
    }
}

/// Runs a claimed task as a turn of the agent's own tool loop and records the outcome.
async fn run_task(
    org: &Arc<Host>,
    agent: &Arc<AgentRuntime>,
    envelope: Envelope,
    number: u64,
    holder: String,
    mut log: TurnLog,
) {
    let me = agent.id().clone();
    // Claimed work handed over again after a restart may be stale: run it only while this claim
    // is still valid, as its owner says.
    let work = match envelope.task.clone() {
        Some(work) => work,
        None => crate::envelope::TaskWork::new("", number, holder.clone(), 0),
    };
    let owner = org.behaviour(&work.owner).cloned();
    let ctx = BehaviourContext::new(org.clone());
    let valid = retry_store(org, agent, "checking a claim", || async {
        match &owner {
            Some(owner) => owner.claim_valid(&ctx, &me, &work).await,
            None => Ok(true),
        }
    })
    .await;
    let worker = crate::runtime::behaviour::AgentWorker { rt: agent.clone() };
    match valid {
        Ok(true) => {}
        Ok(false) => {
            // This claim is over (its lease expired and the task moved on): let it go.
            log.consume(&envelope);
            commit(org, agent, log).await;
            worker.claim_ended(number, &holder);
            worker.ring();
            return;
        }
        Err(_) => {
            agent.forget(std::slice::from_ref(&envelope.id));
            keep_for_later(org, agent, envelope).await;
            return;
        }
    }
    let options = TurnOptions {
        task: Some(TaskRef::new(me.clone(), number)),
        work: Some(work.clone()),
    };
    let (abort, registration) = AbortHandle::new_pair();
    *agent.abort.lock().unwrap_or_else(|e| e.into_inner()) = Some(abort);
    let mut turn_log = TurnLog::default();
    let outcome = {
        let turn = Abortable::new(
            Box::pin(run_turn(
                org,
                agent,
                envelope.clone(),
                options,
                &mut turn_log,
            )),
            registration,
        );
        turn.await
    };
    agent.abort.lock().unwrap_or_else(|e| e.into_inner()).take();
    let result = match outcome {
        Ok(Ok(outcome)) => Ok(outcome),
        Ok(Err(failure)) => {
            let reason = failure.error.public_text();
            let text = format!("turn failed: {reason}");
            for e in failure.unanswered.iter().filter(|e| e.task.is_none()) {
                turn_log.record(system_record(&e.channel, text.clone(), org));
            }
            tell_failure(org, agent, &failure).await;
            Err(reason)
        }
        Err(_) => Err("the turn was cancelled".to_string()),
    };
    // The outcome is recorded first: a crash between the two runs the (finished) task envelope
    // again, which then finds its claim over and only lets it go.
    if let Some(owner) = &owner {
        owner
            .work_ended(&ctx, &worker, &work, &result, turn_log.usage)
            .await;
    }
    commit(org, agent, turn_log).await;
}

/// Sends a message to a child's parent (its outbound failed, or its turn failed).
async fn report_to_parent(org: &Host, agent: &AgentRuntime, text: String) {
    let Some(parent) = &agent.spec.parent else {
        return;
    };
    let envelope = Envelope::new(
        Source::Internal {
            from_agent: agent.id().clone(),
            link_id: None,
        },
        parent.report_to.clone(),
        EnvelopeKind::Announce,
        text,
        org.clock.now(),
    );
    if let Err(e) = org.enqueue(&parent.parent, envelope, true).await {
        report_error(
            org,
            agent.id(),
            None,
            format!("could not report to parent {}: {e}", parent.parent),
        );
    }
}

/// The record metadata key holding the external source of a user's message.
const META_REPLY_SOURCE: &str = "reply_source";

/// Before a turn on a system message (a retrigger) in `channel`: when this process knows no
/// external source for that channel yet (after a restart, or an agent taken over from another
/// process), recalls the last one recorded in the channel's history, so the answer reaches the
/// user. Read only in that case: the turn's own history read skips metadata.
async fn recall_source(org: &Host, agent: &AgentRuntime, channel: &ChannelId, first: &Envelope) {
    if first.source != Source::System
        || agent
            .reply_sources
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(channel)
    {
        return;
    }
    let history = match org
        .stores
        .channels
        .history(agent.id(), channel, Some(HISTORY_LIMIT))
        .await
    {
        Ok(history) => history,
        Err(e) => {
            report_error(
                org,
                agent.id(),
                None,
                format!("the reply target of {channel} not recalled: {e}"),
            );
            return;
        }
    };
    let recorded = history.iter().rev().find_map(|r| {
        r.record
            .metadata
            .get(META_REPLY_SOURCE)
            .and_then(|v| serde_json::from_value::<Source>(v.clone()).ok())
    });
    if let Some(source) = recorded {
        agent
            .reply_sources
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(channel.clone())
            .or_insert(source);
    }
}

/// Remembers the external sources of `current`, per channel.
fn remember_sources(agent: &AgentRuntime, current: &[Envelope]) {
    let mut known = agent
        .reply_sources
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    for envelope in current {
        if matches!(envelope.source, Source::External { .. }) {
            known.insert(envelope.channel.clone(), envelope.source.clone());
        }
    }
}

/// Where a reply to `current` goes: the source of the first envelope, or, for a system message (a
/// retrigger), the last external source seen in its channel.
fn reply_source(agent: &AgentRuntime, current: &[Envelope]) -> Source {
    match current.first() {
        Some(first) if first.source == Source::System => agent
            .reply_sources
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&first.channel)
            .cloned()
            .unwrap_or(Source::System),
        Some(first) => first.source.clone(),
        None => Source::System,
    }
}

/// The version of the link graph a cached rendering was made for (bumped whenever a link changes).
fn graph_version(org: &Host) -> u64 {
    org.graph_version.load(Ordering::Acquire)
}

/// The system prompt of `agent` in `channel`, rendered once per link graph and link peer.
fn cached_system_prompt(
    org: &Host,
    agent: &AgentRuntime,
    channel: &ChannelId,
) -> Result<Arc<str>, PromptError> {
    let peer = channel
        .as_link()
        .filter(|(owner, _)| owner == agent.id())
        .map(|(_, peer)| peer);
    let version = graph_version(org);
    let key = (agent.id().clone(), peer);
    if let Some((v, text)) = org.caches.prompts(&key)
        && v == version
    {
        return Ok(text);
    }
    let text: Arc<str> = system_prompt(org, agent, channel)?.into();
    org.caches.set_prompt(key, version, text.clone());
    Ok(text)
}

/// The tool definitions offered to the agent of `scope`, rendered once per link graph.
fn cached_definitions(org: &Host, scope: &ToolCapability) -> Arc<[crate::llm::ToolDefinition]> {
    let version = graph_version(org);
    if let Some((v, defs)) = org.caches.definitions(scope.agent())
        && v == version
    {
        return defs;
    }
    let defs: Arc<[crate::llm::ToolDefinition]> = org.tools.definitions_for(scope).into();
    org.caches
        .set_definitions(scope.agent().clone(), version, defs.clone());
    defs
}

/// The system prompt of `agent` answering in `channel`.
pub(crate) fn system_prompt(
    org: &Host,
    agent: &AgentRuntime,
    channel: &ChannelId,
) -> Result<String, PromptError> {
    let graph = org.graph();
    let me = agent.id();
    let name = |id: &AgentId| org.display_name(id);
    let chart = policy::org_chart(&graph, me);
    let org_context =
        (!chart.superiors.is_empty() || !chart.subordinates.is_empty() || !chart.peers.is_empty())
            .then(|| OrgContext::from_chart(&chart, name));
    let link_context = channel.as_link().and_then(|(owner, peer)| {
        if &owner != me {
            return None;
        }
        let link = graph
            .between(me.as_str(), peer.as_str())
            .or_else(|| graph.between(peer.as_str(), me.as_str()))?;
        Some(LinkContext {
            agent_id: peer.clone(),
            agent_name: org.display_name(&peer),
            relationship: link.relationship_of_other(me)?,
        })
    });
    org.prompts.render_system_prompt(&SystemPromptContext {
        agent_name: agent.spec.name.clone(),
        identity: agent.spec.identity.clone(),
        org_context,
        link_context,
        extra: agent.spec.instructions.clone(),
    })
}

/// A turn may take this many times `max_tool_rounds` in all, steers included: each steer gives the
/// steering message a fresh round budget, and this bounds a turn that producers keep steering.
const STEER_ROUND_FACTOR: u32 = 4;

/// Puts envelopes back at the front of the queue, in order. A stopping agent's queue is closed:
/// they are kept in its pending deliveries instead (durable stores hold them already).
async fn put_back(org: &Host, agent: &AgentRuntime, envelopes: Vec<Envelope>) {
    for envelope in envelopes.into_iter().rev() {
        if agent.queue.push_front(envelope.clone()).is_err() {
            agent.forget(std::slice::from_ref(&envelope.id));
            keep_for_later(org, agent, envelope).await;
        }
    }
}

/// Options of one turn.
#[derive(Debug, Clone, Default)]
pub(crate) struct TurnOptions {
    /// The task being worked on.
    pub(crate) task: Option<TaskRef>,
    /// The claimed work the turn runs: the behaviours' checkpoint hook runs at every checkpoint.
    pub(crate) work: Option<crate::envelope::TaskWork>,
}

/// A turn that failed, and the envelopes it had not answered when it did.
#[derive(Debug)]
pub(crate) struct TurnFailure {
    pub(crate) error: TurnError,
    pub(crate) unanswered: Vec<Envelope>,
}

/// One level of a turn: the envelopes the model answers at that level. A steer pushes a frame;
/// its answer goes to the steering envelopes' destinations, then the turn resumes the frame below.
#[derive(Debug)]
struct Frame {
    envelopes: Vec<Envelope>,
    rounds: u32,
}

impl Frame {
    fn kind(&self) -> Option<EnvelopeKind> {
        self.envelopes.first().map(|e| e.kind)
    }
    fn channel(&self) -> Option<&ChannelId> {
        self.envelopes.first().map(|e| &e.channel)
    }
}

fn failure(error: impl Into<TurnError>, frames: &[Frame]) -> TurnFailure {
    TurnFailure {
        error: error.into(),
        unanswered: frames
            .iter()
            .flat_map(|f| f.envelopes.iter().cloned())
            .collect(),
    }
}

/// The text that resumes an interrupted frame after a steer was answered.
fn resume_text(frame: &Frame) -> String {
    format!(
        "Your answer to the interruption was delivered. Now continue with what you were doing \
         before it, and give your answer to this:\n\n{}",
        merge_backlog(&frame.envelopes)
    )
}

/// One turn: the tool-call loop over the LLM, with steering at each checkpoint.
///
/// The turn starts with one envelope. After every tool round the loop drains the agent's queue:
/// records go to the history; tasks go back to the front of the queue (a task is work with its own
/// result and waits for its own turn); anything else that wakes the model steers: the model answers
/// it next, that answer goes to the steering envelopes' own destinations, and the turn then resumes
/// what it was doing. Every envelope is answered once, to its own destination, by this one turn.
pub(crate) async fn run_turn(
    inner: &Arc<Host>,
    agent: &AgentRuntime,
    first: Envelope,
    options: TurnOptions,
    log: &mut TurnLog,
) -> Result<TurnOutcome, TurnFailure> {
    let me = agent.id().clone();
    let channel = first.channel.clone();
    let cause = first.cause().clone();
    let base_round = first.round;
    let mut frames = vec![Frame {
        envelopes: vec![first],
        rounds: 0,
    }];
    // A store that fails here is retried (the envelope stays where it is), never a failed turn.
    let history = retry_store(inner, agent, "reading the channel's history", || {
        inner
            .stores
            .channels
            .history_texts(&me, &channel, Some(HISTORY_LIMIT))
    })
    .await
    .map_err(|e| failure(e, &frames))?;
    for envelope in &frames[0].envelopes {
        log.record(user_record(envelope));
        log.consume(envelope);
    }
    recall_source(inner, agent, &channel, &frames[0].envelopes[0]).await;
    remember_sources(agent, &frames[0].envelopes);
    log.flush_records(inner, &me).await;
    let system = cached_system_prompt(inner, agent, &channel).map_err(|e| failure(e, &frames))?;
    let mut messages = Vec::with_capacity(history.len() + 4);
    messages.push(ChatMessage::system(system));
    history::extend_messages(&mut messages, history);
    messages.push(ChatMessage::user(merge_backlog(&frames[0].envelopes)));

    let tools = &inner.tools;
    let scope = ToolCapability::new(inner.clone(), me.clone());
    let ctx = BehaviourContext::new(inner.clone());
    let owner = options
        .work
        .as_ref()
        .and_then(|w| inner.behaviour(&w.owner).cloned());
    let definitions = cached_definitions(inner, &scope);
    let limit = inner.settings.max_tool_rounds;
    let call_cap =
        usize::try_from(inner.settings.max_tool_calls_per_response.max(1)).unwrap_or(usize::MAX);
    let mut started = inner.event(&me, EventKind::TurnStarted);
    started.channel = Some(channel.clone());
    started.task = options.task.clone();
    inner.emit(started);

    let mut total_rounds: u32 = 0;
    let mut last_text = String::new();
    // Empty answers in a row (no text, no tool call) where an answer is owed: a failed attempt,
    // asked again once.
    let mut empty_answers: u32 = 0;
    loop {
        let Some(top) = frames.last() else {
            return Ok(TurnOutcome::Answer(last_text));
        };
        if top.rounds >= limit || total_rounds >= limit.saturating_mul(STEER_ROUND_FACTOR) {
            let mut event = inner.event(&me, EventKind::RoundLimitReached { limit });
            event.channel = top.channel().cloned();
            event.task = options.task.clone();
            inner.emit(event);
            return Err(failure(TurnError::RoundLimit { limit }, &frames));
        }
        let reply_channel = top.channel().cloned().unwrap_or_else(|| channel.clone());
        let request = ChatRequest {
            agent: Some(me.clone()),
            messages: messages.clone(),
            tools: definitions.clone(),
            channel: Some(reply_channel.clone()),
            envelope_kind: top.kind(),
            ..ChatRequest::default()
        };
        let streams_to = frames
            .last()
            .filter(|f| agent.spec.outbound.wants_deltas() && answers_outbound(inner, &me, f));
        let response = match streams_to {
            Some(frame) => stream_model(inner, agent, request, frame).await,
            None => inner.llm.complete(request).await,
        };
        let response = match response {
            Ok(r) => r,
            Err(e) => return Err(failure(e, &frames)),
        };
        if let Some(usage) = response.usage {
            log.usage = log.usage.plus(usage);
        }
        if response.tool_calls.is_empty()
            && response
                .content
                .as_deref()
                .is_none_or(|t| t.trim().is_empty())
            && frames.last().is_some_and(|f| owes_an_answer(inner, &me, f))
        {
            empty_answers += 1;
            if empty_answers > EMPTY_ANSWER_RETRIES {
                return Err(failure(
                    TurnError::EmptyAnswer {
                        attempts: empty_answers,
                    },
                    &frames,
                ));
            }
            tracing::warn!(agent = %me, "the model gave an empty answer; asking again");
            continue;
        }
        empty_answers = 0;
        if response.tool_calls.is_empty() {
            let text = response.content.unwrap_or_default();
            let Some(frame) = frames.pop() else {
                return Ok(TurnOutcome::Answer(text));
            };
            log.record(NewRecord::new(
                reply_channel.clone(),
                RecordKind::Assistant,
                &me,
                text.clone(),
                inner.clock.now(),
            ));
            log.flush_records(inner, &me).await;
            deliver_answer(inner, agent, &frame, &text, &cause).await;
            let mut event = inner.event(
                &me,
                EventKind::TurnFinished {
                    rounds: total_rounds,
                },
            );
            event.channel = Some(reply_channel);
            event.task = options.task.clone();
            event.usage = Some(log.usage);
            inner.emit(event);
            match frames.last() {
                None => return Ok(TurnOutcome::Answer(text)),
                Some(below) => {
                    messages.push(ChatMessage::assistant(text.clone()));
                    messages.push(ChatMessage::user(resume_text(below)));
                    last_text = text;
                    continue;
                }
            }
        }

        if let Some(top) = frames.last_mut() {
            top.rounds += 1;
        }
        total_rounds += 1;
        // The frame's own round: a steer elsewhere in the turn does not shift the keys of the
        // effects this frame asks for, so a turn run again after a crash asks under the same keys.
        let round_index = frames.last().map_or(total_rounds, |f| f.rounds);
        messages.push(response.to_message());
        // The effects' keys come from what the frame answers: a task by its number and generation
        // (stable across attempts: a task run again after a crash asks for the same effects under
        // the same keys), anything else by its envelope id.
        let key_base = frames
            .last()
            .and_then(|f| f.envelopes.first())
            .map(|e| match &e.task {
                Some(work) => match inner.behaviour(&work.owner) {
                    Some(owner) => owner.work_key(work),
                    None => format!("{}{}g{}", work.owner, work.number, work.generation),
                },
                None => e.id.to_string(),
            })
            .unwrap_or_default();
        let mut ended: Option<String> = None;
        for (index, call) in response.tool_calls.iter().enumerate() {
            let ctx = ToolContext {
                agent: me.clone(),
                channel: reply_channel.clone(),
                task: options.task.clone(),
                round: base_round,
                cause: cause.clone(),
                key: format!("{me}:{key_base}:{round_index}:{index}"),
                org: scope.clone(),
            };
            let (text, ok) = if index >= call_cap {
                (
                    format!(
                        "error: not run: one response may call at most {call_cap} tools \
                         (max_tool_calls_per_response); call fewer at a time"
                    ),
                    false,
                )
            } else {
                match tools.call(&ctx, call).await {
                    Ok(output) => {
                        if output.end_turn {
                            ended = Some(output.content.clone());
                        }
                        (output.content, true)
                    }
                    Err(e) => (e.to_model_text(), false),
                }
            };
            tool_called(inner, &me, &reply_channel, &options, call, &text, ok, log);
            messages.push(ChatMessage::tool(call.id.clone(), text));
        }
        log.flush_records(inner, &me).await;
        if let Some(text) = ended {
            let mut event = inner.event(
                &me,
                EventKind::TurnFinished {
                    rounds: total_rounds,
                },
            );
            event.channel = Some(reply_channel);
            event.task = options.task.clone();
            event.usage = Some(log.usage);
            inner.emit(event);
            // The frame that ended waits for a result (a retrigger answers it later).
            frames.pop();
            match frames.last() {
                None => return Ok(TurnOutcome::Ended(text)),
                Some(below) => {
                    messages.push(ChatMessage::user(resume_text(below)));
                    continue;
                }
            }
        }

        // Checkpoint: claimed work tells its behaviour (a task's lease is renewed, so a long turn
        // keeps its claim) ...
        if let (Some(work), Some(owner)) = (&options.work, &owner) {
            owner
                .checkpoint(&ctx, &me, work)
                .await
                .map_err(|e| failure(e, &frames))?;
        }
        // ... and anything that arrived meanwhile steers the turn.
        let drained = agent.queue.drain();
        if drained.is_empty() {
            continue;
        }
        let mut wait = Vec::new();
        let mut fresh: Vec<Envelope> = Vec::new();
        for envelope in drained {
            let seen = envelope.idempotency_key.as_ref().is_some_and(|k| {
                log.has_key(k) || fresh.iter().any(|f| f.idempotency_key.as_ref() == Some(k))
            });
            if envelope.task.is_some() || envelope.kind == EnvelopeKind::TaskAssigned {
                wait.push(envelope);
            } else if seen {
                log.commit.consumed.push(envelope.id.clone());
            } else if !envelope.kind.wakes_model() {
                log.record(user_record(&envelope));
                log.consume(&envelope);
            } else {
                fresh.push(envelope);
            }
        }
        if !fresh.is_empty() && total_rounds >= limit.saturating_mul(STEER_ROUND_FACTOR) {
            // Steered too long: the fresh messages wait for their own turn.
            wait.append(&mut fresh);
        }
        put_back(inner, agent, wait).await;
        if fresh.is_empty() {
            continue;
        }
        // A key applied before (a notice delivered twice) is not answered again.
        let mut steering = Vec::with_capacity(fresh.len());
        for envelope in fresh {
            if let Some(key) = &envelope.idempotency_key
                && inner
                    .stores
                    .deliveries
                    .is_applied(&me, key)
                    .await
                    .unwrap_or(false)
            {
                log.commit.consumed.push(envelope.id.clone());
                continue;
            }
            steering.push(envelope);
        }
        if steering.is_empty() {
            continue;
        }
        for envelope in &steering {
            log.record(user_record(envelope));
            log.consume(envelope);
        }
        remember_sources(agent, &steering);
        log.flush_records(inner, &me).await;
        let mut event = inner.event(
            &me,
            EventKind::Steered {
                merged: steering.len(),
            },
        );
        event.channel = steering.first().map(|e| e.channel.clone());
        event.task = options.task.clone();
        inner.emit(event);
        messages.push(ChatMessage::user(merge_backlog(&steering)));
        frames.push(Frame {
            envelopes: steering,
            rounds: 0,
        });
    }
}

/// Whether a frame's answer goes to the agent's outbound: it is no claimed work's result and no
/// behaviour owns it (see [`Behaviour::owns_answer`](crate::runtime::behaviour::Behaviour::owns_answer)).
fn answers_outbound(host: &Host, me: &AgentId, frame: &Frame) -> bool {
    frame.envelopes.iter().all(|e| {
        e.task.is_none()
            && e.kind != EnvelopeKind::TaskAssigned
            && host.answer_owner(me, e).is_none()
    })
}

/// Whether a frame's answer must have words: claimed work's result, or a reply to the
/// application. An empty answer a behaviour routes (a conversation's turn) is silence, which is
/// allowed there.
fn owes_an_answer(host: &Host, me: &AgentId, frame: &Frame) -> bool {
    frame.envelopes.iter().any(|e| e.task.is_some()) || answers_outbound(host, me, frame)
}

/// Calls the model with streaming, forwarding text to the outbound as it comes.
async fn stream_model(
    inner: &Host,
    agent: &AgentRuntime,
    request: ChatRequest,
    frame: &Frame,
) -> Result<crate::llm::ChatResponse, LlmError> {
    use futures::StreamExt;
    let mut stream = inner.llm.stream(request).await?;
    let channel = frame
        .channel()
        .cloned()
        .unwrap_or_else(|| ChannelId::new(""));
    let ids: Vec<EnvelopeId> = frame.envelopes.iter().map(|e| e.id.clone()).collect();
    let mut seq = 0u64;
    let mut calls_tools = false;
    let delta = |text: String, seq: u64, discard: bool| crate::runtime::outbound::ReplyDelta {
        agent: agent.id().clone(),
        channel: channel.clone(),
        in_reply_to: ids.clone(),
        text,
        seq,
        discard,
    };
    while let Some(item) = stream.next().await {
        match item? {
            crate::llm::StreamEvent::TextDelta { text } if !calls_tools && !text.is_empty() => {
                if let Err(e) = agent
                    .spec
                    .outbound
                    .send_delta(delta(text, seq, false))
                    .await
                {
                    report_error(
                        inner,
                        agent.id(),
                        Some(&channel),
                        format!("delta lost: {e}"),
                    );
                }
                seq += 1;
            }
            crate::llm::StreamEvent::ToolCallDelta { .. } if !calls_tools => {
                calls_tools = true;
                if seq > 0 {
                    let _ = agent
                        .spec
                        .outbound
                        .send_delta(delta(String::new(), seq, true))
                        .await;
                }
            }
            crate::llm::StreamEvent::Done(response) => {
                if !response.tool_calls.is_empty() && !calls_tools && seq > 0 {
                    let _ = agent
                        .spec
                        .outbound
                        .send_delta(delta(String::new(), seq, true))
                        .await;
                }
                return Ok(response);
            }
            _ => {}
        }
    }
    Err(LlmError::MalformedResponse(
        "the stream ended without its final response".into(),
    ))
}

#[allow(clippy::too_many_arguments)]
fn tool_called(
    inner: &Host,
    me: &AgentId,
    channel: &ChannelId,
    options: &TurnOptions,
    call: &ToolCall,
    text: &str,
    ok: bool,
    log: &mut TurnLog,
) {
    let mut event = inner.event(
        me,
        EventKind::ToolCalled {
            tool: call.name.clone(),
            ok,
        },
    );
    event.channel = Some(channel.clone());
    event.task = options.task.clone();
    inner.emit(event);
    log.record(NewRecord::new(
        channel.clone(),
        RecordKind::Tool,
        me,
        format!("{}({}) -> {}", call.name, call.arguments, text),
        inner.clock.now(),
    ));
}

/// Sends a frame's answer to each of its envelopes' destinations: a conversation's other members,
/// the application's outbound (grouped per reply target), and, for a task, nowhere here (the caller
/// records it as the task's result).
async fn deliver_answer(
    inner: &Arc<Host>,
    agent: &AgentRuntime,
    frame: &Frame,
    text: &str,
    cause: &EnvelopeId,
) {
    let me = agent.id();
    // Group the frame's non-task envelopes by channel, in arrival order.
    let mut groups: Vec<(ChannelId, Vec<Envelope>)> = Vec::new();
    for envelope in frame.envelopes.iter().filter(|e| e.task.is_none()) {
        match groups.iter_mut().find(|(c, _)| c == &envelope.channel) {
            Some((_, list)) => list.push(envelope.clone()),
            None => groups.push((envelope.channel.clone(), vec![envelope.clone()])),
        }
    }
    for (channel, envelopes) in groups {
        // The behaviour that owns the answer routes it (a conversation's other members).
        if let Some(owner) = envelopes.iter().find_map(|e| inner.answer_owner(me, e)) {
            let answer = crate::runtime::behaviour::Answer {
                agent: me,
                channel: &channel,
                text,
                answered: &envelopes,
                cause,
            };
            let ctx = BehaviourContext::new(inner.clone());
            if owner.route_answer(&ctx, &answer).await {
                continue;
            }
        }
        let reply = Reply {
            agent: me.clone(),
            channel: channel.clone(),
            source: reply_source(agent, &envelopes),
            in_reply_to: envelopes.iter().map(|e| e.id.clone()).collect(),
            content: text.to_string(),
            at: inner.clock.now(),
            kind: ReplyKind::Answer,
        };
        if let Err(e) = agent.spec.outbound.send(reply).await {
            report_error(
                inner,
                me,
                Some(&channel),
                format!("reply not delivered: {e}"),
            );
        }
    }
}

/// A child agent's outbound: its replies go to the parent's queue, in the channel the parent chose.
#[derive(Debug)]
pub(crate) struct ParentOutbound {
    pub(crate) org: Weak<Host>,
    pub(crate) parent: AgentId,
    pub(crate) child: AgentId,
    pub(crate) report_to: ChannelId,
}

#[async_trait]
impl Outbound for ParentOutbound {
    async fn send(&self, reply: Reply) -> Result<(), OutboundError> {
        let Some(org) = self.org.upgrade() else {
            return Err(OutboundError::Closed(
                "the organization is gone".to_string(),
            ));
        };
        let content = match reply.kind {
            ReplyKind::Failure => format!("Child agent {} failed: {}", self.child, reply.content),
            _ => format!("Result from child agent {}: {}", self.child, reply.content),
        };
        let envelope = Envelope::new(
            Source::Internal {
                from_agent: self.child.clone(),
                link_id: None,
            },
            self.report_to.clone(),
            EnvelopeKind::Announce,
            content,
            org.clock.now(),
        )
        .with_idempotency_key(format!("child-reply:{}", reply.in_reply_to_key()));
        // A full parent queue overflows to the parent's pending deliveries (picked up when its queue
        // runs empty): a child's result is never refused for being early.
        org.enqueue(&self.parent, envelope, true)
            .await
            .map_err(|e| OutboundError::Closed(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_external_source_is_written_as_serde_writes_it() {
        let source = Source::External {
            platform: "portal".into(),
            reply_target: "u \"1\"".into(),
        };
        assert_eq!(
            external_source_value(&source),
            serde_json::to_value(&source).ok()
        );
        let back: Source =
            serde_json::from_value(external_source_value(&source).unwrap_or_default())
                .unwrap_or(Source::System);
        assert_eq!(back, source);
        assert_eq!(external_source_value(&Source::System), None);
    }
}
