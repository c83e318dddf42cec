//! The named steps of one turn (see [`run_turn`](crate::runtime::turn::run_turn)): begin, build
//! the next request, ask the model, answer, call tools, checkpoint, steer. Each step is one method
//! of [`Turn`], the turn's state between them.

use std::sync::Arc;

use crate::channel::{NewRecord, RecordKind};
use crate::context::{CompactionInput, CompactionPlan, SUMMARY_NAMESPACE};
use crate::envelope::{Envelope, EnvelopeKind};
use crate::error::LlmError;
use crate::event::EventKind;
use crate::ids::{AgentId, ChannelId, EnvelopeId};
use crate::limits::{self, Spend};
use crate::llm::{ChatMessage, ChatRequest, ChatResponse};
use crate::records::RecordWrite;
use crate::runtime::behaviour::{Behaviour, BehaviourContext};
use crate::runtime::commit::*;
use crate::runtime::host::{AgentRuntime, Host};
use crate::runtime::prompt::*;
use crate::runtime::steer::merge_backlog;
use crate::runtime::turn::{
    EMPTY_ANSWER_RETRIES, Frame, STEER_ROUND_FACTOR, TurnError, TurnFailure, TurnOptions,
    TurnOutcome, answers_outbound, deliver_answer, failure, owes_an_answer, put_back, resume_text,
    stream_model, tool_called,
};
use crate::runtime::window::{self, TurnContext};
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
    /// What the turn may send: its history and its own messages (see `runtime/window.rs`).
    context: TurnContext,
    /// Whether the window was configured or reported by the provider (not the default).
    window_known: bool,
    scope: ToolCapability,
    ctx: BehaviourContext,
    /// The behaviour owning the claimed work the turn runs, if any.
    owner: Option<Arc<dyn Behaviour>>,
    definitions: crate::runtime::host::Definitions,
    limit: u32,
    call_cap: usize,
    total_rounds: u32,
    /// The last frame's answer, the turn's outcome when no frame is left.
    pub(crate) last_text: String,
    /// Empty answers in a row (no text, no tool call) where an answer is owed: a failed attempt,
    /// asked again once.
    empty_answers: u32,
    /// The size of the messages [`next_request`](Self::next_request) built last (and how many
    /// they are), as request limits estimate it, summed from the context's units: the
    /// reservation of the call that sends them reads it instead of measuring them again.
    sent: Option<(usize, limits::TextSize)>,
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
        if host.hosting.is_some() && !host.limits_in_use() {
            // Under a placement another process may have bound a message's limits since this
            // one was built: the request this turn belongs to may be limited.
            retry_store(host, agent, "reading whether limits are in use", || {
                host.load_limits_marker()
            })
            .await
            .map_err(|e| failure(e, &frames))?;
        }
        let (window, window_known) = window::window_of(host, &me);
        let (summary, past) = retry_store(host, agent, "reading the channel's history", || {
            window::load(host, agent, &channel, window)
        })
        .await
        .map_err(|e| failure(e, &frames))?;
        for envelope in &frames[0].envelopes {
            log.record(user_record(envelope));
            log.consume(envelope);
        }
        recall_source(host, agent, &channel, &frames[0].envelopes[0]).await;
        remember_sources(agent, &frames[0].envelopes);
        // The input's records are written now, before the turn is said to start. Under limits
        // they go with the turn's first model call instead, beside its reservation (one commit,
        // see `call_model_raw`), or with the turn's commit when it makes none.
        if !host.limits_in_use() {
            log.flush_records(host, &me).await;
        }
        let system =
            cached_system_prompt(host, agent, &channel).map_err(|e| failure(e, &frames))?;
        let scope = ToolCapability::new(host.clone(), me.clone());
        let owner = options
            .work
            .as_ref()
            .and_then(|w| host.behaviour(&w.owner).cloned());
        let definitions = cached_definitions(host, &scope);
        let mut context = TurnContext::new(
            window,
            host.counter.clone(),
            ChatMessage::system(system),
            definitions.tokens,
            summary,
            past,
        );
        context.push(ChatMessage::user(merge_backlog(&frames[0].envelopes)));
        let call_cap =
            usize::try_from(host.settings.max_tool_calls_per_response.max(1)).unwrap_or(usize::MAX);
        let mut started = host.event(&me, EventKind::TurnStarted);
        started.channel = Some(channel.clone());
        started.task = options.task.clone();
        started.request = Some(cause.clone());
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
            context,
            window_known,
            scope,
            ctx: BehaviourContext::new(host.clone()),
            owner,
            definitions,
            limit: host.settings.max_tool_rounds,
            call_cap,
            total_rounds: 0,
            last_text: String::new(),
            empty_answers: 0,
            sent: None,
            options,
        })
    }

    fn failure(&self, error: impl Into<TurnError>) -> TurnFailure {
        failure(error, &self.frames)
    }

    /// The request for the top frame; `None` when no frame is left. Fails when the round limit
    /// is reached (saying so with an event). What it sends of the history and of the turn's own
    /// messages fits the agent's context window; when something older has to be left out, the
    /// compaction hook summarizes it first (see [`crate::context`]).
    pub(crate) async fn next_request(
        &mut self,
        log: &mut TurnLog,
    ) -> Result<Option<ChatRequest>, TurnFailure> {
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
            event.request = Some(self.cause.clone());
            self.host.emit(event);
            return Err(self.failure(TurnError::RoundLimit { limit }));
        }
        self.reply_channel = top
            .channel()
            .cloned()
            .unwrap_or_else(|| self.channel.clone());
        let kind = top.kind();
        let budget = self.context.budget(None);
        let mut selection = self.fit(budget)?;
        if self.context.drops(&selection) && self.compact(budget, log).await? {
            selection = self.fit(budget)?;
        }
        let messages = self.context.messages(&selection);
        self.sent = self
            .host
            .limits_in_use()
            .then(|| (messages.len(), self.context.size(&selection)));
        Ok(Some(ChatRequest {
            agent: Some(self.me.clone()),
            messages,
            tools: self.definitions.list.clone(),
            channel: Some(self.reply_channel.clone()),
            envelope_kind: kind,
            ..ChatRequest::default()
        }))
    }

    /// What of the turn's context fits `budget`; fails the turn when not even its mandatory
    /// part does.
    /// With a window nobody gave (the default), a mandatory part over it is sent alone: the
    /// server, which knows its window, decides (a context-length error compacts and resends).
    fn fit(&self, budget: u64) -> Result<window::Selection, TurnFailure> {
        let selected = match self.context.select(budget) {
            Err(needed) if !self.window_known => self.context.select(needed),
            other => other,
        };
        selected.map_err(|needed| {
            let window = self.context.window;
            self.failure(TurnError::ContextOverflow {
                needed: needed + (window - budget),
                window,
            })
        })
    }

    /// Compacts the context: what is older than what fits half of `budget` goes to the
    /// compaction hook, and its summary (stored durably for the channel) replaces it. Whether
    /// anything changed.
    async fn compact(&mut self, budget: u64, log: &mut TurnLog) -> Result<bool, TurnFailure> {
        let Some(hook) = self.host.compaction.clone() else {
            return Ok(false);
        };
        let older = self.context.older(budget / 2);
        if older.is_empty() {
            return Ok(false);
        }
        let plan = hook.plan(
            &CompactionInput {
                previous: self.context.summary_text(),
                messages: &older.messages,
                window: self.context.window,
            },
            self.host.counter.as_ref(),
        );
        let text = match plan {
            CompactionPlan::Summary(text) => Some(text),
            CompactionPlan::Ask(mut request) => {
                request.agent = Some(self.me.clone());
                request.channel = Some(self.reply_channel.clone());
                let response = self.call_model(request, false, log).await?;
                hook.read_summary(&response)
            }
            _ => None,
        };
        let Some(summary) = self.context.apply(&older, text) else {
            return Ok(true);
        };
        let mut event = self.host.event(
            &self.me,
            EventKind::Compacted {
                through: summary.through,
            },
        );
        event.channel = Some(self.channel.clone());
        event.task = self.options.task.clone();
        event.request = Some(self.cause.clone());
        self.host.emit(event);
        window::remember_summary(self.agent, &self.channel, &summary);
        let write = RecordWrite::new(
            SUMMARY_NAMESPACE,
            window::summary_key(&self.me, &self.channel),
            serde_json::to_value(&summary).unwrap_or_default(),
            self.me.as_str(),
        )
        .at(self.host.clock.now());
        if let Err(e) = self.host.stores.records.write(write).await {
            // The next turn compacts again: nothing is lost but a model call.
            report_error(
                self.host,
                &self.me,
                Some(&self.channel),
                format!("a summary of the channel's history was not stored: {e}"),
            );
        }
        Ok(true)
    }

    /// Reserves the model call against the request's limits (see [`crate::limits`]), capping its
    /// `max_tokens` to what they leave: the reservation's key and what it holds, or `None` when no
    /// limit applies. Fails the turn, with an event, when the request reached a limit.
    async fn reserve(
        &self,
        request: &mut ChatRequest,
        sent: Option<limits::TextSize>,
    ) -> Result<Option<(String, Spend)>, TurnFailure> {
        if !self.host.limits_in_use() {
            return Ok(None);
        }
        let key = format!("{}:{}", self.me, uuid::Uuid::new_v4().simple());
        let call = limits::CallEstimate {
            input: if Arc::ptr_eq(&request.tools, &self.definitions.list) {
                let messages =
                    sent.unwrap_or_else(|| limits::TextSize::of_messages(&request.messages));
                debug_assert_eq!(messages, limits::TextSize::of_messages(&request.messages));
                messages.plus(self.definitions.size).estimate()
            } else {
                limits::estimate_input(request)
            },
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
    /// deltas; counts the usage, and settles the call's reservation with it. When the server
    /// says the prompt is too long, compacts and sends once more; a second refusal fails the
    /// turn with [`TurnError::ContextTooLong`].
    pub(crate) async fn ask_model(
        &mut self,
        request: ChatRequest,
        log: &mut TurnLog,
    ) -> Result<ChatResponse, TurnFailure> {
        let (host, agent, me) = (self.host, self.agent, &self.me);
        let streams = self
            .frames
            .last()
            .is_some_and(|f| agent.spec.outbound.wants_deltas() && answers_outbound(host, me, f));
        // What a resend needs besides the messages (built anew from the compacted context): the
        // history is not copied for a resend that rarely happens.
        let retry = ChatRequest {
            messages: Vec::new(),
            agent: request.agent.clone(),
            model: request.model.clone(),
            tools: request.tools.clone(),
            tool_choice: request.tool_choice.clone(),
            temperature: request.temperature,
            max_tokens: request.max_tokens,
            channel: request.channel.clone(),
            envelope_kind: request.envelope_kind,
        };
        // The size summed from the context's units, when these are the messages it built.
        let sent = self
            .sent
            .take()
            .filter(|(n, _)| *n == request.messages.len())
            .map(|(_, size)| size);
        match self.call_model_raw(request, streams, sent, log).await? {
            Err(LlmError::ContextTooLong { message }) => {
                tracing::warn!(agent = %self.me, "the prompt was too long for the model: {message}; compacting");
                let budget = self.context.budget(None);
                self.compact(budget, log).await?;
                let selection = self.fit(budget)?;
                let request = ChatRequest {
                    messages: self.context.messages(&selection),
                    ..retry
                };
                let sent = self
                    .host
                    .limits_in_use()
                    .then(|| self.context.size(&selection));
                match self.call_model_raw(request, streams, sent, log).await? {
                    Err(LlmError::ContextTooLong { message }) => {
                        Err(self.failure(TurnError::ContextTooLong {
                            window: self.context.window,
                            message,
                        }))
                    }
                    other => other.map_err(|e| self.failure(e)),
                }
            }
            other => other.map_err(|e| self.failure(e)),
        }
    }

    /// One model call of the turn (reserved, settled, its usage counted): the answer, or the
    /// model's error.
    async fn call_model(
        &self,
        request: ChatRequest,
        streams: bool,
        log: &mut TurnLog,
    ) -> Result<ChatResponse, TurnFailure> {
        self.call_model_raw(request, streams, None, log)
            .await?
            .map_err(|e| self.failure(e))
    }

    /// [`call_model`](Self::call_model), with the model's error as a value (a refused
    /// reservation fails the turn).
    /// `sent`: the size of its messages when known (see [`Turn::sent`]).
    async fn call_model_raw(
        &self,
        mut request: ChatRequest,
        streams: bool,
        sent: Option<limits::TextSize>,
        log: &mut TurnLog,
    ) -> Result<Result<ChatResponse, LlmError>, TurnFailure> {
        // The records gathered so far (under limits, the turn's input before its first call)
        // are written beside the call's reservation: sent together, the stores group the two
        // writes into one commit, and the history shows them before the model is asked. The
        // records go first: a store may run the first write of a commit without a savepoint of
        // its own, and the reservation (a cell's image, on SQLite) needs none.
        let ((), reservation) = crate::durability::together(futures::future::join(
            log.flush_records(self.host, &self.me),
            self.reserve(&mut request, sent),
        ))
        .await;
        let reservation = reservation?;
        let (host, agent, me) = (self.host, self.agent, &self.me);
        let streams_to = self.frames.last().filter(|_| streams);
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
        let elapsed = started.elapsed();
        crate::telemetry::chat_ended(&span, provider, model, &response, elapsed);
        let mut called = host.event(
            me,
            EventKind::ModelCalled {
                ok: response.is_ok(),
                duration_ms: u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
                tool_calls: response.as_ref().is_ok_and(|r| !r.tool_calls.is_empty()),
            },
        );
        called.channel = Some(self.reply_channel.clone());
        called.task = self.options.task.clone();
        called.usage = response.as_ref().ok().and_then(|r| r.usage);
        called.request = Some(self.cause.clone());
        host.emit(called);
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
        if let Ok(r) = &response
            && let Some(usage) = r.usage
        {
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
        event.request = Some(self.cause.clone());
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
                self.context.push(ChatMessage::assistant(text.clone()));
                self.context.push(ChatMessage::user(resume_text(below)));
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
        self.context.push(response.to_message());
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
                &self.cause,
                call,
                &text,
                ok,
                log,
            );
            self.context.push(ChatMessage::tool(call.id.clone(), text));
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
                self.context.push(ChatMessage::user(resume_text(below)));
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
        event.request = Some(self.cause.clone());
        host.emit(event);
        self.context
            .push(ChatMessage::user(merge_backlog(&steering)));
        self.frames.push(Frame {
            envelopes: steering,
            rounds: 0,
        });
    }
}
