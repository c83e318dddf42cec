//! The agent's loop: the only consumer of its queue and the only caller of the tool loop.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use async_trait::async_trait;
use futures::future::{AbortHandle, Abortable};

use crate::channel::{NewRecord, RecordKind};
use crate::delegation::{META_HOLDER, META_ROUND, META_TASK};
use crate::envelope::{Envelope, EnvelopeKind, Source};
use crate::error::{LlmError, StoreError};
use crate::event::EventKind;
use crate::ids::{AgentId, ChannelId, TaskRef};
use crate::llm::{ChatMessage, ChatRequest};
use crate::org::{AgentRuntime, META_PERSISTED, META_RESUMED, OrgInner, Organization};
use crate::policy;
use crate::prompts::{LinkContext, OrgContext, PromptError, SystemPromptContext};
use crate::runtime::history;
use crate::runtime::outbound::{Outbound, OutboundError, Reply};
use crate::runtime::queue::AgentQueue;
use crate::runtime::steer::{merge_backlog, source_label, split_backlog};
use crate::tools::ToolContext;

/// How many history records of a channel a turn sends to the model.
const HISTORY_LIMIT: usize = 50;

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
}

/// What a finished turn produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TurnOutcome {
    /// A final answer (already sent to the outbound, unless the caller handles it).
    Answer(String),
    /// A tool ended the turn (for example a delegation); its result text.
    Ended(String),
}

/// Options of one turn.
#[derive(Debug, Clone, Default)]
pub(crate) struct TurnOptions {
    /// The task being worked on.
    pub(crate) task: Option<TaskRef>,
    /// Send the answer to the agent's outbound (the normal case); a task executor keeps it.
    pub(crate) send_reply: bool,
    /// The delegation round of the message (see [`ToolContext::round`]).
    pub(crate) round: u32,
    /// The lease holder when the turn runs a claimed task: the lease is renewed at every checkpoint.
    pub(crate) holder: Option<String>,
}

/// The loop of one agent: take an envelope, run a turn, repeat until the queue closes.
pub(crate) async fn run_loop(org: Arc<OrgInner>, agent: Arc<AgentRuntime>) {
    loop {
        if agent.queue.is_empty() && agent.pending.swap(false, Ordering::AcqRel) {
            hand_over_pending(&org, &agent).await;
        }
        let Some(envelope) = agent.queue.recv().await else {
            break;
        };
        process(&org, &agent, envelope).await;
        if let Some(parent) = &agent.spec.parent
            && parent.end_after_reply
            && agent.queue.is_empty()
        {
            let handle = Organization { inner: org.clone() };
            let leftovers = handle.end_agent(agent.id());
            for envelope in leftovers {
                report_to_parent(
                    &org,
                    &agent,
                    format!(
                        "child agent {} ended before answering a message from {}: {}",
                        agent.id(),
                        source_label(&envelope.source),
                        envelope.content
                    ),
                )
                .await;
            }
            break;
        }
    }
    crate::dialogue::on_agent_stopped(&Organization { inner: org.clone() }, agent.id()).await;
    org.emit(org.event(agent.id(), EventKind::AgentStopped));
}

/// Envelopes persisted while the agent ran (its queue was full) go into the queue now that it is
/// empty; they were admitted before, so the bound does not apply.
async fn hand_over_pending(org: &OrgInner, agent: &AgentRuntime) {
    match org.stores.deliveries.pending(agent.id()).await {
        Ok(pending) => {
            for envelope in pending.into_iter().rev() {
                let _ = agent.queue.push_front(envelope);
            }
        }
        Err(e) => {
            agent.pending.store(true, Ordering::Release);
            report_error(org, agent.id(), None, format!("pending deliveries: {e}"));
        }
    }
}

/// Reports a failure no caller waits for: an event, never only a log line.
pub(crate) fn report_error(
    org: &OrgInner,
    agent: &AgentId,
    channel: Option<&ChannelId>,
    message: String,
) {
    tracing::warn!(agent = %agent, "{message}");
    let mut event = org.event(agent, EventKind::Error { message });
    event.channel = channel.cloned();
    org.emit(event);
}

async fn append(org: &OrgInner, agent: &AgentId, record: NewRecord) {
    let channel = record.channel.clone();
    if let Err(e) = org.stores.channels.append(agent, record).await {
        report_error(
            org,
            agent,
            Some(&channel),
            format!("history not written: {e}"),
        );
    }
}

fn author_of(source: &Source) -> String {
    match source {
        Source::External { .. } => "user".to_string(),
        Source::Internal { from_agent, .. } => format!("agent {from_agent}"),
        Source::System => "system".to_string(),
        #[allow(unreachable_patterns)]
        _ => "unknown".to_string(),
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
    record
}

fn is_resumed(envelope: &Envelope) -> bool {
    envelope.metadata.contains_key(META_RESUMED)
}

fn meta_u64(envelope: &Envelope, key: &str) -> Option<u64> {
    envelope
        .metadata
        .get(key)
        .and_then(serde_json::Value::as_u64)
}

/// Takes one envelope off the queue and handles it.
async fn process(org: &Arc<OrgInner>, agent: &Arc<AgentRuntime>, envelope: Envelope) {
    let persisted = envelope.metadata.contains_key(META_PERSISTED);
    // A resumed envelope (interrupted by a steer) had its key applied when it first ran.
    let key = envelope
        .idempotency_key
        .as_ref()
        .filter(|_| !is_resumed(&envelope));
    let duplicate = match key {
        Some(key) => match org
            .stores
            .deliveries
            .mark_applied(agent.id(), key, org.clock.now())
            .await
        {
            Ok(first) => !first,
            Err(e) => {
                report_error(
                    org,
                    agent.id(),
                    None,
                    format!("idempotency key {key} not checked: {e}"),
                );
                false
            }
        },
        None => false,
    };
    if duplicate {
        // Applied before (a notice delivered twice): nothing to do.
    } else if !envelope.kind.wakes_model() {
        append(org, agent.id(), user_record(&envelope)).await;
    } else if let Some(number) = meta_u64(&envelope, META_TASK) {
        run_task(org, agent, envelope.clone(), number).await;
    } else {
        let handle = Organization { inner: org.clone() };
        let channel = envelope.channel.clone();
        let (abort, registration) = AbortHandle::new_pair();
        *agent.abort.lock().unwrap_or_else(|e| e.into_inner()) = Some(abort);
        let options = TurnOptions {
            send_reply: true,
            round: meta_u64(&envelope, META_ROUND)
                .map_or(0, |r| u32::try_from(r).unwrap_or(u32::MAX)),
            ..TurnOptions::default()
        };
        let turn = Abortable::new(
            Box::pin(run_turn(&handle, agent, vec![envelope.clone()], options)),
            registration,
        );
        let result = turn.await;
        agent.abort.lock().unwrap_or_else(|e| e.into_inner()).take();
        match result {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                let text = format!("turn failed: {e}");
                append(
                    org,
                    agent.id(),
                    NewRecord::new(
                        channel.clone(),
                        RecordKind::System,
                        "system",
                        text.clone(),
                        org.clock.now(),
                    ),
                )
                .await;
                report_error(org, agent.id(), Some(&channel), text.clone());
                if agent.spec.parent.is_some() {
                    report_to_parent(
                        org,
                        agent,
                        format!("child agent {} failed: {e}", agent.id()),
                    )
                    .await;
                }
            }
            Err(_aborted) => {
                append(
                    org,
                    agent.id(),
                    NewRecord::new(
                        channel.clone(),
                        RecordKind::System,
                        "system",
                        "turn cancelled; the message was not answered",
                        org.clock.now(),
                    ),
                )
                .await;
                let mut event = org.event(agent.id(), EventKind::TurnCancelled);
                event.channel = Some(channel);
                org.emit(event);
            }
        }
    }
    if persisted {
        // Removed only now that it was processed: a crash before this point hands it over again.
        if let Err(e) = org.stores.deliveries.remove(agent.id(), &envelope.id).await {
            report_error(org, agent.id(), None, format!("pending delivery kept: {e}"));
        }
    }
}

/// Drops drained envelopes whose idempotency key was applied before (a notice delivered twice)
/// and marks the others' keys applied, as [`process`] does for envelopes taken one at a time.
async fn drop_applied(org: &OrgInner, agent: &AgentId, drained: Vec<Envelope>) -> Vec<Envelope> {
    let mut kept = Vec::with_capacity(drained.len());
    for envelope in drained {
        if let Some(key) = envelope
            .idempotency_key
            .as_ref()
            .filter(|_| !is_resumed(&envelope))
        {
            match org
                .stores
                .deliveries
                .mark_applied(agent, key, org.clock.now())
                .await
            {
                Ok(false) => continue,
                Ok(true) => {}
                Err(e) => report_error(
                    org,
                    agent,
                    None,
                    format!("idempotency key {key} not checked: {e}"),
                ),
            }
        }
        kept.push(envelope);
    }
    kept
}

/// Runs a claimed task as a turn of the agent's own tool loop and records the outcome.
async fn run_task(org: &Arc<OrgInner>, agent: &Arc<AgentRuntime>, envelope: Envelope, number: u64) {
    let handle = Organization { inner: org.clone() };
    let holder = envelope
        .metadata
        .get(META_HOLDER)
        .and_then(|v| v.as_str())
        .unwrap_or_default()
        .to_string();
    // A task envelope handed over again after a restart may be stale: run it only while this holder
    // still holds the task.
    match org.stores.tasks.get(agent.id(), number).await {
        Ok(Some(task))
            if task.status == crate::task::TaskStatus::InProgress
                && task.lease.as_ref().is_some_and(|l| l.holder == holder) => {}
        Ok(_) => {
            // This claim is over (its lease expired and the task moved on): free its slot.
            agent.task_finished();
            agent.ring();
            return;
        }
        Err(e) => {
            report_error(
                org,
                agent.id(),
                None,
                format!("task {number} not read: {e}"),
            );
            return;
        }
    }
    let options = TurnOptions {
        task: Some(TaskRef::new(agent.id().clone(), number)),
        send_reply: false,
        round: meta_u64(&envelope, META_ROUND).map_or(0, |r| u32::try_from(r).unwrap_or(u32::MAX)),
        holder: Some(holder.clone()),
    };
    let (abort, registration) = AbortHandle::new_pair();
    *agent.abort.lock().unwrap_or_else(|e| e.into_inner()) = Some(abort);
    let turn = Abortable::new(
        Box::pin(run_turn(&handle, agent, vec![envelope], options)),
        registration,
    );
    let result = match turn.await {
        Ok(Ok(TurnOutcome::Answer(text))) => Ok(crate::delegation::TaskOutcome::Done(text)),
        Ok(Ok(TurnOutcome::Ended(_))) => Ok(crate::delegation::TaskOutcome::Waiting),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("the turn was cancelled".to_string()),
    };
    agent.abort.lock().unwrap_or_else(|e| e.into_inner()).take();
    crate::delegation::finish_task(&handle, agent, number, &holder, result).await;
}

/// Sends a message to a child's parent (its outbound failed, or its turn failed).
async fn report_to_parent(org: &OrgInner, agent: &AgentRuntime, text: String) {
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

/// The system prompt of `agent` answering in `channel`.
pub(crate) fn system_prompt(
    org: &OrgInner,
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
/// merged message a fresh round budget, and this bounds a turn that producers keep steering.
const STEER_ROUND_FACTOR: u32 = 4;

/// Puts envelopes back at the front of the queue, in order. A stopping agent's queue is closed:
/// they are kept in its pending deliveries instead.
async fn put_back(org: &OrgInner, agent: &AgentRuntime, envelopes: Vec<Envelope>) {
    for envelope in envelopes.into_iter().rev() {
        if let Err(e) = agent.queue.push_front(envelope.clone())
            && let Err(p) = org.persist(agent.id(), envelope).await
        {
            report_error(
                org,
                agent.id(),
                None,
                format!("interrupted message not kept ({e}): {p}"),
            );
        }
    }
}

/// The tool definitions `me` is offered: the registry's, with the `send_agent_message` description
/// rendered from its template and listing the agents `me` may delegate to.
fn tool_definitions(
    org: &Organization,
    me: &AgentId,
) -> Result<Vec<crate::llm::ToolDefinition>, PromptError> {
    let mut definitions = org.inner.tools.definitions();
    for definition in &mut definitions {
        if definition.name == "send_agent_message" {
            let targets = org
                .reachable_agents(me)
                .into_iter()
                .map(|(id, name)| crate::prompts::AgentSummary { id, name })
                .collect();
            definition.description = org
                .inner
                .prompts
                .render_send_agent_message(&crate::prompts::SendAgentMessageContext { targets })?;
        }
    }
    Ok(definitions)
}

/// One turn: the tool-call loop over the LLM, with steering at each checkpoint.
///
/// `current` holds the envelopes being answered (one, or several merged by a steer). After every
/// tool round the loop drains the agent's queue; if anything arrived, the interrupted envelopes go
/// back to the front of the queue, the drained ones become one user message, and the model answers
/// that; the reply goes out and the turn ends, so the loop processes the queue again.
pub(crate) async fn run_turn(
    org: &Organization,
    agent: &AgentRuntime,
    mut current: Vec<Envelope>,
    options: TurnOptions,
) -> Result<TurnOutcome, TurnError> {
    let inner = &org.inner;
    let me = agent.id().clone();
    let Some(first) = current.first() else {
        return Ok(TurnOutcome::Answer(String::new()));
    };
    let channel = first.channel.clone();
    let history = inner
        .stores
        .channels
        .history(&me, &channel, Some(HISTORY_LIMIT))
        .await?;
    for envelope in &current {
        if !is_resumed(envelope) {
            append(inner, &me, user_record(envelope)).await;
        }
    }
    remember_sources(agent, &current);
    let system = system_prompt(inner, agent, &channel)?;
    let mut messages = Vec::with_capacity(history.len() + 4);
    messages.push(ChatMessage::system(system));
    messages.extend(history::to_messages(&history));
    messages.push(ChatMessage::user(merge_backlog(&current)));

    let tools = &inner.tools;
    let definitions = tool_definitions(org, &me)?;
    let limit = inner.settings.max_tool_rounds;
    let mut started = inner.event(&me, EventKind::TurnStarted);
    started.channel = Some(channel.clone());
    started.task = options.task.clone();
    inner.emit(started);

    let mut rounds: u32 = 0;
    let mut total_rounds: u32 = 0;
    loop {
        if rounds >= limit {
            let mut event = inner.event(&me, EventKind::RoundLimitReached { limit });
            event.channel = Some(channel.clone());
            event.task = options.task.clone();
            inner.emit(event);
            return Err(TurnError::RoundLimit { limit });
        }
        let request = ChatRequest {
            agent: Some(me.clone()),
            messages: messages.clone(),
            tools: definitions.clone(),
            ..ChatRequest::default()
        };
        let response = inner.llm.complete(request).await?;
        let reply_channel = current
            .first()
            .map(|e| e.channel.clone())
            .unwrap_or_else(|| channel.clone());
        if response.tool_calls.is_empty() {
            let text = response.content.unwrap_or_default();
            append(
                inner,
                &me,
                NewRecord::new(
                    reply_channel.clone(),
                    RecordKind::Assistant,
                    me.as_str(),
                    text.clone(),
                    inner.clock.now(),
                ),
            )
            .await;
            let routed = options.send_reply
                && crate::dialogue::route_reply(org, &me, &reply_channel, &text, &current).await;
            if options.send_reply && !routed {
                let reply = Reply {
                    agent: me.clone(),
                    channel: reply_channel.clone(),
                    source: reply_source(agent, &current),
                    in_reply_to: current.iter().map(|e| e.id.clone()).collect(),
                    content: text.clone(),
                    at: inner.clock.now(),
                };
                if let Err(e) = agent.spec.outbound.send(reply).await {
                    report_error(
                        inner,
                        &me,
                        Some(&reply_channel),
                        format!("reply not delivered: {e}"),
                    );
                }
            }
            let mut event = inner.event(
                &me,
                EventKind::TurnFinished {
                    rounds: total_rounds,
                },
            );
            event.channel = Some(reply_channel);
            event.task = options.task.clone();
            inner.emit(event);
            return Ok(TurnOutcome::Answer(text));
        }

        rounds += 1;
        total_rounds += 1;
        messages.push(response.to_message());
        let ctx = ToolContext {
            agent: me.clone(),
            channel: reply_channel.clone(),
            task: options.task.clone(),
            round: options.round,
            org: org.clone(),
        };
        let mut ended: Option<String> = None;
        for call in &response.tool_calls {
            let (text, ok) = match tools.call(&ctx, call).await {
                Ok(output) => {
                    if output.end_turn {
                        ended = Some(output.content.clone());
                    }
                    (output.content, true)
                }
                Err(e) => (e.to_model_text(), false),
            };
            let mut event = inner.event(
                &me,
                EventKind::ToolCalled {
                    tool: call.name.clone(),
                    ok,
                },
            );
            event.channel = Some(reply_channel.clone());
            event.task = options.task.clone();
            inner.emit(event);
            append(
                inner,
                &me,
                NewRecord::new(
                    reply_channel.clone(),
                    RecordKind::Tool,
                    me.as_str(),
                    format!("{}({}) -> {}", call.name, call.arguments, text),
                    inner.clock.now(),
                ),
            )
            .await;
            messages.push(ChatMessage::tool(call.id.clone(), text));
        }
        if let Some(text) = ended {
            let mut event = inner.event(
                &me,
                EventKind::TurnFinished {
                    rounds: total_rounds,
                },
            );
            event.channel = Some(reply_channel);
            event.task = options.task.clone();
            inner.emit(event);
            return Ok(TurnOutcome::Ended(text));
        }

        // Checkpoint: a task's lease is renewed, so a long turn keeps its claim ...
        if let (Some(task), Some(holder)) = (&options.task, &options.holder) {
            let renew = crate::task::TaskEvent::Renew {
                holder: holder.clone(),
                lease_until: inner.clock.now().plus(crate::delegation::DEFAULT_LEASE),
            };
            inner
                .stores
                .tasks
                .transition(
                    &task.agent,
                    task.number,
                    crate::task::Expect::any(),
                    renew,
                    inner.clock.now(),
                )
                .await?;
        }
        // ... and anything that arrived meanwhile steers the turn.
        // Messages a steer put back earlier wait at the front until this answer is out: only fresh
        // arrivals steer (otherwise two interrupted messages would take turns forever).
        let (waiting, fresh): (Vec<Envelope>, Vec<Envelope>) =
            agent.queue.drain().into_iter().partition(is_resumed);
        let steers = fresh.iter().any(|e| e.kind.wakes_model());
        if steers && total_rounds >= limit.saturating_mul(STEER_ROUND_FACTOR) {
            // Steered too long: stop here; everything waits, untouched, in arrival order.
            let mut back = waiting;
            back.extend(fresh);
            put_back(inner, agent, back).await;
            let mut event = inner.event(&me, EventKind::RoundLimitReached { limit });
            event.channel = Some(channel.clone());
            event.task = options.task.clone();
            inner.emit(event);
            return Err(TurnError::RoundLimit { limit });
        }
        let backlog = split_backlog(drop_applied(inner, &me, fresh).await);
        for record in &backlog.records {
            append(inner, &me, user_record(record)).await;
        }
        if backlog.to_answer.is_empty() {
            put_back(inner, agent, waiting).await;
            continue;
        }
        let interrupted = std::mem::replace(&mut current, backlog.to_answer);
        // Back to the front in arrival order: messages interrupted earlier first, then this one.
        let mut back = waiting;
        back.extend(interrupted.into_iter().map(|mut envelope| {
            envelope
                .metadata
                .insert(META_RESUMED.into(), serde_json::Value::Bool(true));
            envelope
        }));
        put_back(inner, agent, back).await;
        let mut event = inner.event(
            &me,
            EventKind::Steered {
                merged: current.len(),
            },
        );
        event.channel = current.first().map(|e| e.channel.clone());
        event.task = options.task.clone();
        inner.emit(event);
        for envelope in &current {
            append(inner, &me, user_record(envelope)).await;
        }
        remember_sources(agent, &current);
        messages.push(ChatMessage::user(merge_backlog(&current)));
        rounds = 0;
    }
}

/// A child agent's outbound: its replies go to the parent's queue, in the channel the parent chose.
#[derive(Debug)]
pub(crate) struct ParentOutbound {
    pub(crate) org: Weak<OrgInner>,
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
        let envelope = Envelope::new(
            Source::Internal {
                from_agent: self.child.clone(),
                link_id: None,
            },
            self.report_to.clone(),
            EnvelopeKind::Announce,
            format!("Result from child agent {}: {}", self.child, reply.content),
            org.clock.now(),
        );
        // A full parent queue overflows to the parent's pending deliveries (picked up when its queue
        // runs empty): a child's result is never refused for being early.
        org.enqueue(&self.parent, envelope, true)
            .await
            .map_err(|e| OutboundError::Closed(e.to_string()))
    }
}
