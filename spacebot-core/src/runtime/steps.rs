//! The named steps of one turn (see [`run_turn`](crate::runtime::turn::run_turn)): begin, build
//! the next request, ask the model, answer, call tools, checkpoint, steer. Each step is one method
//! of [`Turn`], the turn's state between them.

use std::sync::Arc;

use crate::channel::{NewRecord, RecordKind};
use crate::envelope::{Envelope, EnvelopeKind};
use crate::event::EventKind;
use crate::ids::{AgentId, ChannelId, EnvelopeId};
use crate::limits::{self, Spend};
use crate::llm::{ChatMessage, ChatRequest, ChatResponse, ToolDefinition};
use crate::runtime::behaviour::{Behaviour, BehaviourContext};
use crate::runtime::commit::*;
use crate::runtime::history;
use crate::runtime::host::{AgentRuntime, Host};
use crate::runtime::prompt::*;
use crate::runtime::steer::merge_backlog;
use crate::runtime::turn::{
    EMPTY_ANSWER_RETRIES, Frame, STEER_ROUND_FACTOR, TurnError, TurnFailure, TurnOptions,
    TurnOutcome, answers_outbound, deliver_answer, failure, owes_an_answer, put_back, resume_text,
    stream_model, tool_called,
};
use crate::tools::{ToolCapability, ToolContext};
use tracing::Instrument;

/// What the loop does after a step.
pub(crate) enum Step {
    /// The turn is over.
    Done(TurnOutcome),
    /// A frame ended and the one below resumes: ask the model again at once.
    Resumed,
    /// A tool round ran: checkpoint, steer, then ask the model again.
    Checkpoint,
}

/// One turn's state between its steps.
pub(crate) struct Turn<'a> {
    host: &'a Arc<Host>,
    agent: &'a AgentRuntime,
    options: TurnOptions,
    me: AgentId,
    /// The channel of the envelope the turn started with.
    channel: ChannelId,
    cause: EnvelopeId,
    base_round: u32,
    /// The levels the model answers, the steers on top.
    frames: Vec<Frame>,
    messages: Vec<ChatMessage>,
    scope: ToolCapability,
    ctx: BehaviourContext,
    /// The behaviour owning the claimed work the turn runs, if any.
    owner: Option<Arc<dyn Behaviour>>,
    definitions: Arc<[ToolDefinition]>,
    limit: u32,
    call_cap: usize,
    total_rounds: u32,
    /// The last frame's answer, the turn's outcome when no frame is left.
    pub(crate) last_text: String,
    /// Empty answers in a row (no text, no tool call) where an answer is owed: a failed attempt,
    /// asked again once.
    empty_answers: u32,
    /// The channel the top frame answers in (set by [`next_request`](Self::next_request)).
    reply_channel: ChannelId,
}

impl<'a> Turn<'a> {
    /// Begins the turn: reads the channel's history, records the first envelope, renders the
    /// system prompt and the tool definitions, and says the turn started.
    pub(crate) async fn begin(
        host: &'a Arc<Host>,
        agent: &'a AgentRuntime,
        first: Envelope,
        options: TurnOptions,
        log: &mut TurnLog,
    ) -> Result<Turn<'a>, TurnFailure> {
        let me = agent.id().clone();
        let channel = first.channel.clone();
        let cause = first.cause().clone();
        let base_round = first.round;
        let frames = vec![Frame {
            envelopes: vec![first],
            rounds: 0,
        }];
        // A store that fails here is retried (the envelope stays where it is), never a failed turn.
        let past = retry_store(host, agent, "reading the channel's history", || {
            host.stores
                .channels
                .history_texts(&me, &channel, Some(HISTORY_LIMIT))
        })
        .await
        .map_err(|e| failure(e, &frames))?;
        for envelope in &frames[0].envelopes {
            log.record(user_record(envelope));
            log.consume(envelope);
        }
        recall_source(host, agent, &channel, &frames[0].envelopes[0]).await;
        remember_sources(agent, &frames[0].envelopes);
        log.flush_records(host, &me).await;
        let system =
            cached_system_prompt(host, agent, &channel).map_err(|e| failure(e, &frames))?;
        let mut messages = Vec::with_capacity(past.len() + 4);
        messages.push(ChatMessage::system(system));
        history::extend_messages(&mut messages, past);
        messages.push(ChatMessage::user(merge_backlog(&frames[0].envelopes)));

        let scope = ToolCapability::new(host.clone(), me.clone());
        let owner = options
            .work
            .as_ref()
            .and_then(|w| host.behaviour(&w.owner).cloned());
        let definitions = cached_definitions(host, &scope);
        let call_cap =
            usize::try_from(host.settings.max_tool_calls_per_response.max(1)).unwrap_or(usize::MAX);
        let mut started = host.event(&me, EventKind::TurnStarted);
        started.channel = Some(channel.clone());
        started.task = options.task.clone();
        host.emit(started);
        Ok(Turn {
            host,
            agent,
            me,
            reply_channel: channel.clone(),
            channel,
            cause,
            base_round,
            frames,
            messages,
            scope,
            ctx: BehaviourContext::new(host.clone()),
            owner,
            definitions,
            limit: host.settings.max_tool_rounds,
            call_cap,
            total_rounds: 0,
            last_text: String::new(),
            empty_answers: 0,
            options,
        })
    }

    fn failure(&self, error: impl Into<TurnError>) -> TurnFailure {
        failure(error, &self.frames)
    }

    /// The request for the top frame; `None` when no frame is left. Fails when the round limit
    /// is reached (saying so with an event).
    pub(crate) fn next_request(&mut self) -> Result<Option<ChatRequest>, TurnFailure> {
        let Some(top) = self.frames.last() else {
            return Ok(None);
        };
        let limit = self.limit;
        if top.rounds >= limit || self.total_rounds >= limit.saturating_mul(STEER_ROUND_FACTOR) {
            let mut event = self
                .host
                .event(&self.me, EventKind::RoundLimitReached { limit });
            event.channel = top.channel().cloned();
            event.task = self.options.task.clone();
            self.host.emit(event);
            return Err(self.failure(TurnError::RoundLimit { limit }));
        }
        self.reply_channel = top
            .channel()
            .cloned()
            .unwrap_or_else(|| self.channel.clone());
        Ok(Some(ChatRequest {
            agent: Some(self.me.clone()),
            messages: self.messages.clone(),
            tools: self.definitions.clone(),
            channel: Some(self.reply_channel.clone()),
            envelope_kind: top.kind(),
            ..ChatRequest::default()
        }))
    }

    /// Reserves the model call against the request's limits (see [`crate::limits`]), capping its
    /// `max_tokens` to what they leave: the reservation's key and what it holds, or `None` when no
    /// limit applies. Fails the turn, with an event, when the request reached a limit.
    async fn reserve(
        &self,
        request: &mut ChatRequest,
    ) -> Result<Option<(String, Spend)>, TurnFailure> {
        if !self.host.limits_in_use() {
            return Ok(None);
        }
        let key = format!("{}:{}", self.me, uuid::Uuid::new_v4().simple());
        let call = limits::CallEstimate {
            input: limits::estimate_input(request),
            max_output: request
                .max_tokens
                .map_or(limits::DEFAULT_MAX_OUTPUT, u64::from),
            price: None,
        };
        match self
            .host
            .reserve_call(&self.me, &self.cause, &key, call)
            .await
        {
            Err(e) => Err(self.failure(e)),
            Ok(Err(reached)) => {
                self.host
                    .limit_reached(&self.me, &self.reply_channel, &self.cause, &reached);
                Err(self.failure(reached))
            }
            Ok(Ok(None)) => Ok(None),
            Ok(Ok(Some(granted))) => {
                request.max_tokens = Some(u32::try_from(granted.output_tokens).unwrap_or(u32::MAX));
                Ok(Some((key, granted)))
            }
        }
    }

    /// Asks the model, streaming the answer when the top frame answers an outbound that wants
    /// deltas; counts the usage, and settles the call's reservation with it.
    pub(crate) async fn ask_model(
        &mut self,
        mut request: ChatRequest,
        log: &mut TurnLog,
    ) -> Result<ChatResponse, TurnFailure> {
        let reservation = self.reserve(&mut request).await?;
        let (host, agent, me) = (self.host, self.agent, &self.me);
        let streams_to = self
            .frames
            .last()
            .filter(|f| agent.spec.outbound.wants_deltas() && answers_outbound(host, me, f));
        let (provider, model) = (host.llm.provider_name(), request.model.clone());
        let model = model
            .as_deref()
            .or(host.llm.default_model())
            .unwrap_or("unknown");
        let span = crate::telemetry::chat(provider, model, &request);
        let started = std::time::Instant::now();
        let response = match streams_to {
            Some(frame) => {
                stream_model(host, agent, request, frame)
                    .instrument(span.clone())
                    .await
            }
            None => host.llm.complete(request).instrument(span.clone()).await,
        };
        crate::telemetry::chat_ended(&span, provider, model, &response, started.elapsed());
        if let Some((key, granted)) = reservation {
            // What the provider reported; the whole reservation when it reported nothing; one
            // call and no tokens when the call failed.
            let spent = match &response {
                Ok(r) => r.usage.map_or(granted, Spend::of_call),
                Err(_) => Spend {
                    model_calls: 1,
                    ..Spend::default()
                },
            };
            if let Err(e) = host.settle_call(me, &self.cause, &key, spent).await {
                // The reservation stays counted: the request is charged its worst case.
                tracing::warn!(agent = %me, "a model call's spend was not settled: {e}");
            }
        }
        let response = response.map_err(|e| self.failure(e))?;
        if let Some(usage) = response.usage {
            log.usage = log.usage.plus(usage);
        }
        Ok(response)
    }

    /// Whether `response` is an empty answer (no text, no tool call) where one is owed, to ask
    /// again; fails when the model gave too many in a row.
    pub(crate) fn is_empty_answer_to_retry(
        &mut self,
        response: &ChatResponse,
    ) -> Result<bool, TurnFailure> {
        let empty = response.tool_calls.is_empty()
            && response
                .content
                .as_deref()
                .is_none_or(|t| t.trim().is_empty())
            && self
                .frames
                .last()
                .is_some_and(|f| owes_an_answer(self.host, &self.me, f));
        if !empty {
            self.empty_answers = 0;
            return Ok(false);
        }
        self.empty_answers += 1;
        if self.empty_answers > EMPTY_ANSWER_RETRIES {
            return Err(self.failure(TurnError::EmptyAnswer {
                attempts: self.empty_answers,
            }));
        }
        tracing::warn!(agent = %self.me, "the model gave an empty answer; asking again");
        Ok(true)
    }

    /// Says the turn (or its top frame) finished.
    fn finished(&self, log: &TurnLog) {
        let mut event = self.host.event(
            &self.me,
            EventKind::TurnFinished {
                rounds: self.total_rounds,
            },
        );
        event.channel = Some(self.reply_channel.clone());
        event.task = self.options.task.clone();
        event.usage = Some(log.usage);
        self.host.emit(event);
    }

    /// A final answer: recorded, delivered to the top frame's destinations; the frame below (if
    /// any) resumes.
    pub(crate) async fn answer(&mut self, response: ChatResponse, log: &mut TurnLog) -> Step {
        let text = response.content.unwrap_or_default();
        let Some(frame) = self.frames.pop() else {
            return Step::Done(TurnOutcome::Answer(text));
        };
        log.record(NewRecord::new(
            self.reply_channel.clone(),
            RecordKind::Assistant,
            &self.me,
            text.clone(),
            self.host.clock.now(),
        ));
        log.flush_records(self.host, &self.me).await;
        deliver_answer(self.host, self.agent, &frame, &text, &self.cause).await;
        self.finished(log);
        match self.frames.last() {
            None => Step::Done(TurnOutcome::Answer(text)),
            Some(below) => {
                self.messages.push(ChatMessage::assistant(text.clone()));
                self.messages.push(ChatMessage::user(resume_text(below)));
                self.last_text = text;
                Step::Resumed
            }
        }
    }

    /// The key base of the top frame's effects: a claimed work's from its owner (stable across
    /// attempts: a task run again after a crash asks for the same effects under the same keys),
    /// anything else's from its envelope id.
    fn key_base(&self) -> String {
        self.frames
            .last()
            .and_then(|f| f.envelopes.first())
            .map(|e| match &e.task {
                Some(work) => match self.host.behaviour(&work.owner) {
                    Some(owner) => owner.work_key(work),
                    None => format!("{}{}g{}", work.owner, work.number, work.generation),
                },
                None => e.id.to_string(),
            })
            .unwrap_or_default()
    }

    /// A tool round: runs the calls in order (past the per-response cap, each is refused), records
    /// them; a tool that ends the turn ends the top frame (it waits for a result).
    pub(crate) async fn call_tools(
        &mut self,
        response: ChatResponse,
        log: &mut TurnLog,
    ) -> Result<Step, TurnFailure> {
        if let Some(top) = self.frames.last_mut() {
            top.rounds += 1;
        }
        self.total_rounds += 1;
        // The frame's own round: a steer elsewhere in the turn does not shift the keys of the
        // effects this frame asks for, so a turn run again after a crash asks under the same keys.
        let round_index = self.frames.last().map_or(self.total_rounds, |f| f.rounds);
        self.messages.push(response.to_message());
        // The calls that will run count against the request's tool-call limit, all or none.
        let running = response.tool_calls.len().min(self.call_cap) as u64;
        match self.host.charge_tools(&self.me, &self.cause, running).await {
            Err(e) => return Err(self.failure(e)),
            Ok(Err(reached)) => {
                self.host
                    .limit_reached(&self.me, &self.reply_channel, &self.cause, &reached);
                return Err(self.failure(reached));
            }
            Ok(Ok(())) => {}
        }
        let key_base = self.key_base();
        let (host, me, call_cap) = (self.host, self.me.clone(), self.call_cap);
        let mut ended: Option<String> = None;
        for (index, call) in response.tool_calls.iter().enumerate() {
            let ctx = ToolContext {
                agent: me.clone(),
                channel: self.reply_channel.clone(),
                task: self.options.task.clone(),
                round: self.base_round,
                cause: self.cause.clone(),
                key: format!("{me}:{key_base}:{round_index}:{index}"),
                org: self.scope.clone(),
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
                let span = crate::telemetry::execute_tool(call);
                match host.tools.call(&ctx, call).instrument(span).await {
                    Ok(output) => {
                        if output.end_turn {
                            ended = Some(output.content.clone());
                        }
                        (output.content, true)
                    }
                    Err(e) => (e.to_model_text(), false),
                }
            };
            tool_called(
                host,
                &me,
                &self.reply_channel,
                &self.options,
                call,
                &text,
                ok,
                log,
            );
            self.messages.push(ChatMessage::tool(call.id.clone(), text));
        }
        let Some(text) = ended else {
            log.flush_records(host, &me).await;
            return Ok(Step::Checkpoint);
        };
        self.finished(log);
        // The frame that ended waits for a result (a retrigger answers it later).
        self.frames.pop();
        match self.frames.last() {
            // The records go with the turn's commit, which follows at once (one write, not two).
            None => Ok(Step::Done(TurnOutcome::Ended(text))),
            Some(below) => {
                log.flush_records(host, &me).await;
                self.messages.push(ChatMessage::user(resume_text(below)));
                Ok(Step::Resumed)
            }
        }
    }

    /// Checkpoint: claimed work tells its owner (a task's lease is renewed, so a long turn keeps
    /// its claim).
    pub(crate) async fn checkpoint(&mut self) -> Result<(), TurnFailure> {
        if let (Some(work), Some(owner)) = (&self.options.work, &self.owner) {
            owner
                .checkpoint(&self.ctx, &self.me, work)
                .await
                .map_err(|e| failure(e, &self.frames))?;
        }
        Ok(())
    }

    /// Steer: what arrived meanwhile is taken from the queue. Claimed work goes back (it waits for
    /// its own turn), records go to the history, and messages that wake the model become a new
    /// frame on top, answered next.
    pub(crate) async fn steer(&mut self, log: &mut TurnLog) {
        let (host, agent, me) = (self.host, self.agent, &self.me);
        let drained = agent.queue.drain();
        if drained.is_empty() {
            return;
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
        if !fresh.is_empty() && self.total_rounds >= self.limit.saturating_mul(STEER_ROUND_FACTOR) {
            // Steered too long: the fresh messages wait for their own turn.
            wait.append(&mut fresh);
        }
        put_back(host, agent, wait).await;
        if fresh.is_empty() {
            return;
        }
        // A key applied before (a notice delivered twice) is not answered again.
        let mut steering = Vec::with_capacity(fresh.len());
        for envelope in fresh {
            if let Some(key) = &envelope.idempotency_key
                && host
                    .stores
                    .deliveries
                    .is_applied(me, key)
                    .await
                    .unwrap_or(false)
            {
                log.commit.consumed.push(envelope.id.clone());
                continue;
            }
            steering.push(envelope);
        }
        if steering.is_empty() {
            return;
        }
        for envelope in &steering {
            log.record(user_record(envelope));
            log.consume(envelope);
        }
        remember_sources(agent, &steering);
        log.flush_records(host, me).await;
        tracing::info_span!(target: "spacebot::telemetry", "spacebot.steer", spacebot.steer.merged = steering.len()).in_scope(|| {});
        let mut event = host.event(
            me,
            EventKind::Steered {
                merged: steering.len(),
            },
        );
        event.channel = steering.first().map(|e| e.channel.clone());
        event.task = self.options.task.clone();
        host.emit(event);
        self.messages
            .push(ChatMessage::user(merge_backlog(&steering)));
        self.frames.push(Frame {
            envelopes: steering,
            rounds: 0,
        });
    }
}
