//! One turn: the tool-call loop over the model, with steering at each checkpoint, and where its
//! answers go (the behaviour that owns them, or the agent's outbound).

use std::sync::Arc;

use crate::channel::{NewRecord, RecordKind};
use crate::envelope::{Envelope, EnvelopeKind};
use crate::error::{LlmError, StoreError};
use crate::event::EventKind;
use crate::ids::{AgentId, ChannelId, EnvelopeId, TaskRef};
use crate::llm::{ChatRequest, ToolCall};
use crate::prompts::PromptError;
use crate::runtime::agent::keep_for_later;
use crate::runtime::behaviour::BehaviourContext;
use crate::runtime::commit::*;
use crate::runtime::host::{AgentRuntime, Host};
use crate::runtime::outbound::{Outbound, Reply, ReplyKind};
use crate::runtime::steer::merge_backlog;
use crate::runtime::steps::{Step, Turn};

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
    /// The request reached one of its limits; the call was not made (see [`crate::limits`]).
    #[error(transparent)]
    LimitReached(#[from] crate::limits::LimitReached),
    /// Not even the turn's system prompt, tools, message, newest tool round and the answer's
    /// room fit the agent's context window (see [`crate::context`]); the model was not called.
    #[error(
        "the turn needs {needed} tokens (system prompt, tools, the message, the latest tool round \
         and room for the answer), more than the context window of {window}"
    )]
    ContextOverflow {
        /// The tokens the turn needs at least.
        needed: u64,
        /// The agent's context window.
        window: u64,
    },
    /// The server refused the prompt as too long for the model's context window, again after
    /// the turn compacted its history and sent it once more.
    #[error(
        "the conversation does not fit the model's context window ({window} tokens configured), \
         even after compaction: {message}"
    )]
    ContextTooLong {
        /// The agent's context window, as configured or reported.
        window: u64,
        /// The server's explanation.
        message: String,
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
pub(crate) const EMPTY_ANSWER_RETRIES: u32 = 1;

/// What a finished turn produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TurnOutcome {
    /// A final answer (already sent to the outbound, unless the caller handles it).
    Answer(String),
    /// A tool ended the turn (for example a delegation); its result text.
    Ended(String),
}

/// Why a turn running claimed work failed, as its behaviour's
/// [`work_ended`](crate::Behaviour::work_ended) sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkFailure {
    /// The failure's text, fit to leave the runtime ([`TurnError::public_text`]).
    pub reason: String,
    /// Whether running the work again cannot help: the request reached a limit (see
    /// [`crate::limits`]); the work should fail now rather than be retried.
    pub permanent: bool,
}

impl WorkFailure {
    /// A failure that another attempt may not repeat.
    pub fn transient(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            permanent: false,
        }
    }

    /// A failure another attempt would repeat.
    pub fn permanent(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            permanent: true,
        }
    }

    /// How a failed turn's error fails its work.
    pub(crate) fn of(error: &TurnError) -> Self {
        Self {
            reason: error.public_text(),
            permanent: matches!(error, TurnError::LimitReached(_)),
        }
    }
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
    pub(crate) envelopes: Vec<Envelope>,
    pub(crate) rounds: u32,
}

impl Frame {
    pub(crate) fn kind(&self) -> Option<EnvelopeKind> {
        self.envelopes.first().map(|e| e.kind)
    }
    pub(crate) fn channel(&self) -> Option<&ChannelId> {
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
    let mut turn = Turn::begin(inner, agent, first, options, log).await?;
    loop {
        let Some(request) = turn.next_request(log).await? else {
            return Ok(TurnOutcome::Answer(std::mem::take(&mut turn.last_text)));
        };
        let response = turn.ask_model(request, log).await?;
        if turn.is_empty_answer_to_retry(&response)? {
            continue;
        }
        let step = if response.tool_calls.is_empty() {
            turn.answer(response, log).await
        } else {
            turn.call_tools(response, log).await?
        };
        match step {
            Step::Done(outcome) => return Ok(outcome),
            Step::Resumed => {}
            Step::Checkpoint => {
                turn.checkpoint().await?;
                turn.steer(log).await;
            }
        }
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
    request: &EnvelopeId,
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
    event.request = Some(request.clone());
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
