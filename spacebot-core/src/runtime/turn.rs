//! One turn: the tool-call loop over the model, with steering at each checkpoint, and where its
//! answers go (the behaviour that owns them, or the agent's outbound).

use std::sync::Arc;

use crate::channel::{NewRecord, RecordKind};
use crate::envelope::{Envelope, EnvelopeKind};
use crate::error::{LlmError, StoreError};
use crate::event::EventKind;
use crate::ids::{AgentId, ChannelId, EnvelopeId, TaskRef};
use crate::llm::{ChatMessage, ChatRequest, ToolCall};
use crate::prompts::PromptError;
use crate::runtime::agent::keep_for_later;
use crate::runtime::behaviour::BehaviourContext;
use crate::runtime::commit::*;
use crate::runtime::history;
use crate::runtime::host::{AgentRuntime, Host};
use crate::runtime::outbound::{Outbound, Reply, ReplyKind};
use crate::runtime::prompt::*;
use crate::runtime::queue::AgentQueue;
use crate::runtime::steer::merge_backlog;
use crate::tools::{ToolCapability, ToolContext};

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

/// A turn may take this many times `max_tool_rounds` in all, steers included: each steer gives the
/// steering message a fresh round budget, and this bounds a turn that producers keep steering.
pub(crate) const STEER_ROUND_FACTOR: u32 = 4;

/// Puts envelopes back at the front of the queue, in order. A stopping agent's queue is closed:
/// they are kept in its pending deliveries instead (durable stores hold them already).
pub(crate) async fn put_back(org: &Host, agent: &AgentRuntime, envelopes: Vec<Envelope>) {
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
pub(crate) struct Frame {
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

pub(crate) fn failure(error: impl Into<TurnError>, frames: &[Frame]) -> TurnFailure {
    TurnFailure {
        error: error.into(),
        unanswered: frames
            .iter()
            .flat_map(|f| f.envelopes.iter().cloned())
            .collect(),
    }
}

/// The text that resumes an interrupted frame after a steer was answered.
pub(crate) fn resume_text(frame: &Frame) -> String {
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
pub(crate) fn answers_outbound(host: &Host, me: &AgentId, frame: &Frame) -> bool {
    frame.envelopes.iter().all(|e| {
        e.task.is_none()
            && e.kind != EnvelopeKind::TaskAssigned
            && host.answer_owner(me, e).is_none()
    })
}

/// Whether a frame's answer must have words: claimed work's result, or a reply to the
/// application. An empty answer a behaviour routes (a conversation's turn) is silence, which is
/// allowed there.
pub(crate) fn owes_an_answer(host: &Host, me: &AgentId, frame: &Frame) -> bool {
    frame.envelopes.iter().any(|e| e.task.is_some()) || answers_outbound(host, me, frame)
}

/// Calls the model with streaming, forwarding text to the outbound as it comes.
pub(crate) async fn stream_model(
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
pub(crate) fn tool_called(
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
pub(crate) async fn deliver_answer(
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
