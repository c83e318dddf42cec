//! Scenarios at the junctions of the agent loop, delegation and conversations, through the public
//! API only. Each takes the stores to run on, so every backend runs them all.
#![allow(unreachable_pub)]

use spacebot::testing::last_user_text as last_user;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::json;
use spacebot::delegation::{DelegationOrigin, TaskContext, TaskExecutor, TaskOutcome};
use spacebot::event::EventKind;
use spacebot::llm::{ChatMessage, ChatResponse};
use spacebot::testing::{FnLlm, MockLlm, OrgHarness, tool_call};
use spacebot::tools::{Tool, ToolContext, ToolError, ToolOutput};
use spacebot::{
    AgentId, ChannelId, DeliveryError, EnvelopeKind, InboundMessage, InternalMessage, ManualClock,
    Stores, Task, TaskRef, TaskStatus, ToolDefinition,
};

pub fn id(s: &str) -> AgentId {
    AgentId::parse(s).unwrap()
}

fn user(text: &str) -> InboundMessage {
    InboundMessage::new("portal", "u1", text)
}

/// Sleeps for `ms` milliseconds, then answers.
#[derive(Debug)]
pub struct SlowTool(pub u64);

#[async_trait]
impl Tool for SlowTool {
    fn definition(&self) -> ToolDefinition {
        ToolDefinition::new("slow", "Takes a while.", json!({"type": "object"}))
    }
    async fn call(
        &self,
        _ctx: &ToolContext,
        _args: serde_json::Value,
    ) -> Result<ToolOutput, ToolError> {
        tokio::time::sleep(Duration::from_millis(self.0)).await;
        Ok(ToolOutput::text("done"))
    }
}

/// Echoes.
#[derive(Debug)]
pub struct Echo;

#[async_trait]
impl Tool for Echo {
    fn definition(&self) -> ToolDefinition {
        ToolDefinition::new("echo", "Echoes.", json!({"type": "object"}))
    }
    async fn call(
        &self,
        _ctx: &ToolContext,
        _args: serde_json::Value,
    ) -> Result<ToolOutput, ToolError> {
        Ok(ToolOutput::text("echo"))
    }
}

const PEERS: &str = r#"
[[agents]]
id = "a"
name = "Alpha"
[[agents]]
id = "b"
name = "Beta"
[[agents]]
id = "c"
name = "Gamma"
[[links]]
from = "a"
to = "b"
direction = "two_way"
relationship = "peer"
[[links]]
from = "c"
to = "a"
direction = "two_way"
relationship = "superior"
"#;

const ONE_WAY: &str = r#"
[[agents]]
id = "a"
name = "Alpha"
[[agents]]
id = "b"
name = "Beta"
[[links]]
from = "a"
to = "b"
direction = "one_way"
relationship = "superior"
"#;

/// Junction 1: A model that reopens after every conclusion, with a slow tool so conclusions steer its turn,
/// cannot escape the conversation budget: the exchange one user message caused is bounded.
pub async fn conversation_budget_bounds_the_whole_exchange(stores: Stores) {
    let llm = Arc::new(FnLlm::new(|req| {
        if req.agent.as_ref().map(AgentId::as_str) == Some("b") {
            return Ok(ChatResponse::tool_calls(vec![tool_call(
                "conclude_link",
                json!({"summary": "enough"}),
            )]));
        }
        Ok(ChatResponse::tool_calls(vec![
            tool_call(
                "send_link_message",
                json!({"target": "b", "message": "again"}),
            ),
            tool_call("slow", json!({})),
        ]))
    }));
    let settings = "[settings]\nconversation_turn_budget = 6\nmax_tool_rounds = 4\n";
    let mut h = OrgHarness::builder(format!("{settings}{PEERS}"))
        .stores(stores)
        .llm(llm.clone())
        .tool(Arc::new(SlowTool(150)))
        .build()
        .await;
    h.timeout = Duration::from_secs(60);
    h.org.start_all().await.unwrap();
    h.org.deliver("a", user("talk to b")).await.unwrap();
    // The user is told the turn ended without an answer (the model never stops calling tools).
    let reply = h.reply().await;
    assert!(reply.is_failure(), "{reply:?}");
    // Everything the exchange caused dies down: both agents idle with empty queues.
    let (a, b) = (id("a"), id("b"));
    h.wait_until("both agents idle", || {
        let ok = h.org.is_idle(&a) && h.org.is_idle(&b);
        async move { ok }
    })
    .await;
    let conversations = h.org.conversations(&Default::default()).await.unwrap();
    assert_eq!(
        conversations.len(),
        1,
        "one conversation, reopened, never a fresh budget: {conversations:?}"
    );
    let sent = h
        .history("b", &ChannelId::link(&b, &a))
        .await
        .into_iter()
        .filter(|r| r.record.content == "again")
        .count();
    assert!(sent <= 6, "{sent} messages crossed a budget of 6");
    assert!(sent >= 1);
    assert!(
        h.count(|k| matches!(k, EventKind::Steered { .. })) >= 1,
        "conclusions arrived mid-turn and steered"
    );
}

/// Junction 2: A task delegated to an agent while its user turn waits on the model is not merged into that
/// turn: the user gets the user's answer, the task gets its own turn and its own result.
pub async fn a_task_arriving_mid_turn_gets_its_own_turn(stores: Stores) {
    let (llm, mut calls) = MockLlm::pair();
    let mut h = OrgHarness::builder(PEERS)
        .stores(stores)
        .llm(Arc::new(llm))
        .tool(Arc::new(Echo))
        .build()
        .await;
    let (a, c) = (id("a"), id("c"));
    h.org.start_agent(&a).await.unwrap();
    h.org.deliver("a", user("hello")).await.unwrap();
    let busy = calls.next().await.unwrap();
    let task = h
        .org
        .delegate(
            &c,
            "a",
            "Count the stars.",
            DelegationOrigin::new(ChannelId::new("portal:c")),
        )
        .await
        .unwrap();
    h.wait_count("the claim", 1, |k| {
        matches!(k, EventKind::TaskClaimed { .. })
    })
    .await;
    h.wait_until("the task in a's queue", || {
        let n = h.org.queue_len(&a).unwrap_or(0);
        async move { n >= 1 }
    })
    .await;
    busy.respond_tool_calls(vec![tool_call("echo", json!({}))]);
    // The checkpoint does not merge the task: the model answers the user's message alone.
    let next = calls.next().await.unwrap();
    assert_eq!(next.request.envelope_kind, Some(EnvelopeKind::UserMessage));
    assert!(!last_user(&next.request.messages).contains("Count the stars"));
    next.respond_text("hi there");
    let reply = h.reply().await;
    assert_eq!(reply.content, "hi there");
    // Then the task runs as its own turn, and its answer is its result.
    let task_call = calls.next().await.unwrap();
    assert!(last_user(&task_call.request.messages).contains("Count the stars"));
    task_call.respond_text("seven");
    let ended = tokio::time::timeout(
        Duration::from_secs(10),
        h.org.wait_task_ended(&task.task_ref()),
    )
    .await
    .expect("the task ended")
    .unwrap();
    assert_eq!(ended.status, TaskStatus::Done);
    assert_eq!(ended.result.as_deref(), Some("seven"));
}

/// Junction 3: A user message that arrives while the agent works on a delegated task steers it: the user's
/// answer goes to the user, and the task's result is the answer to the task.
pub async fn a_user_message_steering_a_task_is_answered_to_the_user(stores: Stores) {
    let (llm, mut calls) = MockLlm::pair();
    let mut h = OrgHarness::builder(PEERS)
        .stores(stores)
        .llm(Arc::new(llm))
        .tool(Arc::new(Echo))
        .build()
        .await;
    let (a, c) = (id("a"), id("c"));
    h.org.start_agent(&a).await.unwrap();
    let task = h
        .org
        .delegate(
            &c,
            "a",
            "Write the report.",
            DelegationOrigin::new(ChannelId::new("portal:c")),
        )
        .await
        .unwrap();
    let working = calls.next().await.unwrap();
    assert!(last_user(&working.request.messages).contains("Write the report"));
    let m = h.org.deliver("a", user("are you there?")).await.unwrap();
    h.wait_until("the message queued", || {
        let n = h.org.queue_len(&a).unwrap_or(0);
        async move { n >= 1 }
    })
    .await;
    working.respond_tool_calls(vec![tool_call("echo", json!({}))]);
    let steered = calls.next().await.unwrap();
    assert_eq!(last_user(&steered.request.messages), "are you there?");
    steered.respond_text("yes, writing the report");
    let reply = h.reply().await;
    assert_eq!(reply.content, "yes, writing the report");
    assert_eq!(reply.in_reply_to, vec![m]);
    let resumed = calls.next().await.unwrap();
    assert!(last_user(&resumed.request.messages).contains("Write the report"));
    resumed.respond_text("the report");
    let ended = tokio::time::timeout(
        Duration::from_secs(10),
        h.org.wait_task_ended(&task.task_ref()),
    )
    .await
    .expect("the task ended")
    .unwrap();
    assert_eq!(ended.result.as_deref(), Some("the report"));
}

/// Junction 4: On a one-way link a -> b, b may answer inside an exchange a started, but may not start one.
pub async fn an_announce_cannot_open_an_exchange_over_a_one_way_link(stores: Stores) {
    let llm = Arc::new(FnLlm::new(|_| Ok(ChatResponse::text("ok"))));
    let h = OrgHarness::builder(ONE_WAY)
        .stores(stores)
        .llm(llm)
        .build()
        .await;
    let (a, b) = (id("a"), id("b"));
    let err = h
        .org
        .send_internal(&b, &a, InternalMessage::announce("hello?"))
        .await
        .unwrap_err();
    assert!(matches!(err, DeliveryError::Denied(_)), "{err:?}");
    assert!(
        h.org
            .stores()
            .deliveries
            .pending(&a)
            .await
            .unwrap()
            .is_empty(),
        "nothing was kept for a"
    );
    // Once a delegated to b, b may report back.
    h.org
        .delegate(
            &a,
            "b",
            "Do it.",
            DelegationOrigin::new(ChannelId::new("portal:a")),
        )
        .await
        .unwrap();
    h.org
        .send_internal(&b, &a, InternalMessage::announce("on it"))
        .await
        .unwrap();
}

/// Junction 5: After a link is disabled, an open conversation over it carries nothing more: the peer's
/// plain-text answer does not cross, and the conversation is severed.
pub async fn a_disabled_link_carries_nothing(stores: Stores) {
    let (llm, mut calls) = MockLlm::pair();
    let mut h = OrgHarness::builder(PEERS)
        .stores(stores)
        .llm(Arc::new(llm))
        .build()
        .await;
    let (a, b) = (id("a"), id("b"));
    h.org.start_all().await.unwrap();
    h.org.deliver("a", user("ask b")).await.unwrap();
    calls
        .next()
        .await
        .unwrap()
        .respond_tool_calls(vec![tool_call(
            "send_link_message",
            json!({"target": "b", "message": "what time is it?"}),
        )]);
    // a answers its user; b is woken by the message (in either order).
    let mut b_call = None;
    for _ in 0..2 {
        let call = calls.next().await.unwrap();
        if call.agent() == Some(&b) {
            b_call = Some(call);
        } else {
            call.respond_text("asked b");
        }
    }
    assert_eq!(h.reply().await.content, "asked b");
    let b_call = b_call.expect("b was woken");
    h.org.set_link_enabled(&a, &b, false).await.unwrap();
    b_call.respond_text("noon");
    h.wait_count("the severance", 1, |k| {
        matches!(k, EventKind::ConversationSevered { .. })
    })
    .await;
    let crossed = h
        .history("a", &ChannelId::link(&a, &b))
        .await
        .into_iter()
        .any(|r| r.record.content.contains("noon"));
    assert!(!crossed, "the answer crossed a disabled link");
    h.org.wait_idle(&a).await.unwrap();
    assert!(
        calls.try_next().is_none(),
        "a was woken over a disabled link"
    );
}

/// Junction 6: Deliveries racing `start_agent` are all answered by that start, none stranded.
pub async fn deliveries_racing_a_start_are_all_answered(stores: Stores) {
    let llm = Arc::new(FnLlm::new(|req| {
        Ok(ChatResponse::text(format!(
            "re: {}",
            last_user(&req.messages)
        )))
    }));
    let mut h = OrgHarness::builder(PEERS)
        .stores(stores)
        .llm(llm)
        .build()
        .await;
    let a = id("a");
    for round in 0..5 {
        let org = h.org.clone();
        let senders: Vec<_> = (0..10)
            .map(|i| {
                let org = org.clone();
                tokio::spawn(async move {
                    org.deliver("a", user(&format!("m{round}-{i}")))
                        .await
                        .unwrap()
                })
            })
            .collect();
        let starter = {
            let org = org.clone();
            let a = a.clone();
            tokio::spawn(async move { org.start_agent(&a).await.unwrap() })
        };
        let mut ids = Vec::new();
        for s in senders {
            ids.push(s.await.unwrap());
        }
        starter.await.unwrap();
        let mut answered = Vec::new();
        while answered.len() < ids.len() {
            answered.extend(h.reply().await.in_reply_to);
        }
        ids.sort();
        answered.sort();
        assert_eq!(answered, ids, "round {round}");
        h.org.stop_agent(&a).await.unwrap();
    }
}

/// Never returns on its first call; completes on the next.
#[derive(Debug, Default)]
struct HangsOnce(AtomicUsize);

#[async_trait]
impl TaskExecutor for HangsOnce {
    async fn execute(
        &self,
        _ctx: TaskContext,
        _task: Task,
    ) -> Result<TaskOutcome, spacebot::delegation::TaskError> {
        if self.0.fetch_add(1, Ordering::SeqCst) == 0 {
            futures::future::pending::<()>().await;
        }
        Ok(TaskOutcome::Done("second attempt".into()))
    }
}

/// Junction 7: A worker that never returns does not keep its slot once its lease expired: the requeued task
/// runs again.
pub async fn a_hung_worker_does_not_block_the_board(stores: Stores) {
    let clock = ManualClock::new(1_000);
    let llm = Arc::new(FnLlm::new(|_| Ok(ChatResponse::text("ok"))));
    let exec = Arc::new(HangsOnce::default());
    let h = OrgHarness::builder(format!("[settings]\ntask_concurrency = 1\n{ONE_WAY}"))
        .stores(stores)
        .llm(llm)
        .manual_clock(clock.clone())
        .executor("b", exec.clone())
        .build()
        .await;
    let (a, b) = (id("a"), id("b"));
    h.org.start_agent(&b).await.unwrap();
    let task = h
        .org
        .delegate(
            &a,
            "b",
            "Do it.",
            DelegationOrigin::new(ChannelId::new("portal:a")),
        )
        .await
        .unwrap();
    h.wait_until("the first attempt", || {
        let n = exec.0.load(Ordering::SeqCst);
        async move { n >= 1 }
    })
    .await;
    // The lease (10 minutes) runs out; the loop's next check requeues and claims again. The clock
    // is moved on until that happened (the loop may not be waiting on its timer yet when it moves).
    let task_ref = TaskRef::new(b.clone(), task.number);
    h.wait_until("the requeued task ran again", || {
        clock.advance(Duration::from_secs(11 * 60));
        let org = h.org.clone();
        let task_ref = task_ref.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            org.task(&task_ref)
                .await
                .unwrap()
                .is_some_and(|t| t.status.is_terminal())
        }
    })
    .await;
    let done = h.org.task(&task_ref).await.unwrap().unwrap();
    assert_eq!(done.result.as_deref(), Some("second attempt"));
}

/// Junction 8: One response cannot fan out into thousands of effects: calls past the cap are answered as
/// errors, not run.
pub async fn tool_calls_per_response_are_capped(stores: Stores) {
    let llm = Arc::new(FnLlm::new(|req| {
        if req.agent.as_ref().map(AgentId::as_str) != Some("a") {
            return Ok(ChatResponse::text("ok"));
        }
        let calls = (0..3_000)
            .map(|i| {
                tool_call(
                    "send_agent_message",
                    json!({"target": "b", "message": format!("job {i}")}),
                )
            })
            .collect();
        Ok(ChatResponse::tool_calls(calls))
    }));
    let settings = "[settings]\nmax_tool_calls_per_response = 5\n";
    let h = OrgHarness::builder(format!("{settings}{PEERS}"))
        .stores(stores)
        .llm(llm.clone())
        .build()
        .await;
    let (a, b) = (id("a"), id("b"));
    h.org.start_agent(&a).await.unwrap();
    h.org.deliver("a", user("fan out")).await.unwrap();
    h.wait_count("the turn end", 1, |k| {
        matches!(k, EventKind::TurnFinished { .. })
    })
    .await;
    let tasks = h
        .org
        .stores()
        .tasks
        .list(&b, &Default::default())
        .await
        .unwrap();
    assert_eq!(tasks.len(), 5, "only the first 5 calls ran");
    let refused = h.count(|k| matches!(k, EventKind::ToolCalled { ok: false, .. }));
    assert_eq!(refused, 2_995);
}

/// Streams its answers in pieces of three characters and reports 10 tokens per call.
pub struct ChunkedLlm<F>(pub F);

impl<F> std::fmt::Debug for ChunkedLlm<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChunkedLlm")
    }
}

#[async_trait]
impl<F> spacebot::LlmProvider for ChunkedLlm<F>
where
    F: Fn(&spacebot::ChatRequest) -> ChatResponse + Send + Sync,
{
    async fn complete(
        &self,
        request: spacebot::ChatRequest,
    ) -> Result<ChatResponse, spacebot::LlmError> {
        let mut response = (self.0)(&request);
        response.usage = Some(spacebot::llm::Usage {
            prompt_tokens: 7,
            completion_tokens: 3,
            total_tokens: 10,
        });
        Ok(response)
    }

    async fn stream(
        &self,
        request: spacebot::ChatRequest,
    ) -> Result<
        futures::stream::BoxStream<'static, Result<spacebot::llm::StreamEvent, spacebot::LlmError>>,
        spacebot::LlmError,
    > {
        use spacebot::llm::StreamEvent;
        let response = self.complete(request).await?;
        let text: Vec<char> = response
            .content
            .clone()
            .unwrap_or_default()
            .chars()
            .collect();
        let mut events: Vec<Result<StreamEvent, spacebot::LlmError>> = text
            .chunks(3)
            .map(|c| {
                Ok(StreamEvent::TextDelta {
                    text: c.iter().collect(),
                })
            })
            .collect();
        events.push(Ok(StreamEvent::Done(response)));
        Ok(Box::pin(futures::stream::iter(events)))
    }
}

/// A streaming outbound gets the answer's text as it is generated, in order, then the complete
/// reply; steering and tool rounds keep working.
pub async fn a_streaming_outbound_gets_deltas_then_the_reply(stores: Stores) {
    use futures::StreamExt;
    use spacebot::runtime::{OutboundItem, StreamingOutbound};
    let llm = Arc::new(ChunkedLlm(|req: &spacebot::ChatRequest| {
        let tool_round = spacebot::testing::tool_round(&req.messages);
        if tool_round {
            ChatResponse::text("Bonjour tout le monde")
        } else {
            ChatResponse::tool_calls(vec![tool_call("echo", json!({}))])
        }
    }));
    let (outbound, mut items) = StreamingOutbound::new();
    let h = OrgHarness::builder(PEERS)
        .stores(stores)
        .llm(llm)
        .tool(Arc::new(Echo))
        .outbound(Arc::new(outbound))
        .build()
        .await;
    h.org.start_agent(&id("a")).await.unwrap();
    let m = h.org.deliver("a", user("greet")).await.unwrap();
    let mut text = String::new();
    let mut seqs = Vec::new();
    let reply = loop {
        let item = tokio::time::timeout(Duration::from_secs(10), items.next())
            .await
            .expect("an item within 10 s")
            .expect("the stream is open");
        match item {
            OutboundItem::Delta(d) => {
                assert_eq!(d.in_reply_to, vec![m.clone()]);
                assert!(!d.discard);
                seqs.push(d.seq);
                text.push_str(&d.text);
            }
            OutboundItem::Reply(r) => break r,
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>(), "in order");
    assert!(seqs.len() >= 3, "streamed in pieces: {seqs:?}");
    assert_eq!(text, "Bonjour tout le monde");
    assert_eq!(reply.content, "Bonjour tout le monde");
    assert_eq!(reply.in_reply_to, vec![m]);
}

const CHAIN: &str = r#"
[[agents]]
id = "a"
name = "Alpha"
[[agents]]
id = "b"
name = "Beta"
[[agents]]
id = "c"
name = "Gamma"
[[links]]
from = "a"
to = "b"
relationship = "superior"
[[links]]
from = "b"
to = "c"
relationship = "superior"
"#;

/// Token usage is kept per turn, per agent and per delegated task, the task including its
/// children's work, across a two-hop delegation.
pub async fn usage_is_summed_across_a_two_hop_delegation(stores: Stores) {
    let llm = Arc::new(ChunkedLlm(|req: &spacebot::ChatRequest| {
        let me = req.agent.as_ref().map(AgentId::as_str).unwrap_or("");
        let text = last_user(&req.messages);
        match (me, req.envelope_kind) {
            ("a", Some(EnvelopeKind::UserMessage)) => ChatResponse::tool_calls(vec![tool_call(
                "send_agent_message",
                json!({"target": "b", "message": "Ask Gamma."}),
            )]),
            ("b", _) if !text.contains("have ended") => ChatResponse::tool_calls(vec![tool_call(
                "send_agent_message",
                json!({"target": "c", "message": "Pick a word."}),
            )]),
            ("b", _) => ChatResponse::text("Gamma says: lantern"),
            ("c", _) => ChatResponse::text("lantern"),
            _ => ChatResponse::text("The word is lantern."),
        }
    }));
    let mut h = OrgHarness::builder(CHAIN)
        .stores(stores)
        .llm(llm)
        .build()
        .await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", user("a word, please")).await.unwrap();
    let reply = h.reply().await;
    assert_eq!(reply.content, "The word is lantern.");
    let (a, b, c) = (id("a"), id("b"), id("c"));
    // The reply leaves before its turn commits, and a worker's result before its own turn
    // commits (which counts its usage): wait for every turn to end.
    for agent in [&a, &b, &c] {
        tokio::time::timeout(Duration::from_secs(10), h.org.wait_idle(agent))
            .await
            .expect("idle within 10 s")
            .unwrap();
    }
    let b_task = TaskRef::new(b.clone(), 1);
    let c_task = TaskRef::new(c.clone(), 1);
    // c answered in one call; b delegated in one call and resumed in another.
    assert_eq!(h.org.task_usage(&c_task).await.unwrap().total_tokens, 10);
    assert_eq!(
        h.org
            .task(&b_task)
            .await
            .unwrap()
            .unwrap()
            .metadata
            .usage
            .total_tokens,
        20
    );
    assert_eq!(h.org.task_usage(&b_task).await.unwrap().total_tokens, 30);
    assert_eq!(h.org.usage(&a).total_tokens, 20);
    assert_eq!(h.org.usage(&c).total_tokens, 10);
    // The turn's event carries the turn's usage.
    let per_turn: Vec<u32> = h
        .events
        .events()
        .iter()
        .filter(|e| e.agent == a && matches!(e.kind, EventKind::TurnFinished { .. }))
        .filter_map(|e| e.usage.map(|u| u.total_tokens))
        .collect();
    assert_eq!(per_turn, vec![10, 10]);
}

/// Refuses every task for good.
#[derive(Debug, Default)]
struct Refuses(AtomicUsize);

#[async_trait]
impl TaskExecutor for Refuses {
    async fn execute(
        &self,
        _ctx: TaskContext,
        _task: Task,
    ) -> Result<TaskOutcome, spacebot::delegation::TaskError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Err(spacebot::delegation::TaskError::GiveUp(
            "the input cannot be parsed".into(),
        ))
    }
}

/// An executor error is typed: `GiveUp` fails the task at once, without the retries `Retry` gets.
pub async fn an_executor_that_gives_up_fails_the_task_at_once(stores: Stores) {
    let llm = Arc::new(FnLlm::new(|_| Ok(ChatResponse::text("ok"))));
    let exec = Arc::new(Refuses::default());
    let h = OrgHarness::builder(ONE_WAY)
        .stores(stores)
        .llm(llm)
        .executor("b", exec.clone())
        .build()
        .await;
    let (a, b) = (id("a"), id("b"));
    h.org.start_agent(&b).await.unwrap();
    let task = h
        .org
        .delegate(
            &a,
            "b",
            "Parse this.",
            DelegationOrigin::new(ChannelId::new("portal:a")),
        )
        .await
        .unwrap();
    let ended = tokio::time::timeout(
        Duration::from_secs(10),
        h.org.wait_task_ended(&TaskRef::new(b.clone(), task.number)),
    )
    .await
    .expect("the task ended")
    .unwrap();
    assert_eq!(ended.status, TaskStatus::Failed);
    assert_eq!(ended.attempts, 1, "not retried");
    assert_eq!(exec.0.load(Ordering::SeqCst), 1);
    assert!(
        ended
            .error
            .as_deref()
            .is_some_and(|e| e.contains("cannot be parsed"))
    );
}

/// The error the fault-injecting store wrappers below return.
fn injected<T>(message: &str) -> Result<T, spacebot::StoreError> {
    Err(spacebot::StoreError::Backend {
        backend: "test",
        message: message.into(),
        source: None,
    })
}

/// Fails `history` reads its first `n` times, then reads through.
#[derive(Debug)]
pub struct FlakyHistory {
    inner: Arc<dyn spacebot::ChannelStore>,
    failures_left: AtomicUsize,
}

#[async_trait]
impl spacebot::ChannelStore for FlakyHistory {
    async fn append(
        &self,
        agent: &AgentId,
        record: spacebot::NewRecord,
    ) -> Result<spacebot::ChannelRecord, spacebot::StoreError> {
        self.inner.append(agent, record).await
    }
    async fn history(
        &self,
        agent: &AgentId,
        channel: &ChannelId,
        limit: Option<usize>,
    ) -> Result<Vec<spacebot::ChannelRecord>, spacebot::StoreError> {
        let left = self.failures_left.load(Ordering::SeqCst);
        if left > 0 {
            self.failures_left.store(left - 1, Ordering::SeqCst);
            return injected("the disk is busy");
        }
        self.inner.history(agent, channel, limit).await
    }
    async fn ensure_channel(
        &self,
        agent: &AgentId,
        channel: &ChannelId,
    ) -> Result<(), spacebot::StoreError> {
        self.inner.ensure_channel(agent, channel).await
    }
    async fn channels(&self, agent: &AgentId) -> Result<Vec<ChannelId>, spacebot::StoreError> {
        self.inner.channels(agent).await
    }
}

/// A store error at the start of a turn does not drop the message or fail the turn: the read is
/// retried (an Error event each time) and the message is answered as usual.
pub async fn a_store_error_at_the_start_of_a_turn_is_retried(stores: Stores) {
    let mut stores = stores;
    stores.channels = Arc::new(FlakyHistory {
        inner: stores.channels.clone(),
        failures_left: AtomicUsize::new(2),
    });
    let llm = Arc::new(FnLlm::new(|_| Ok(ChatResponse::text("answered"))));
    let mut h = OrgHarness::builder(PEERS)
        .stores(stores)
        .llm(llm)
        .build()
        .await;
    h.org.start_agent(&id("a")).await.unwrap();
    let m = h.org.deliver("a", user("hello")).await.unwrap();
    let reply = h.reply().await;
    assert!(!reply.is_failure(), "{reply:?}");
    assert_eq!(reply.content, "answered");
    assert_eq!(reply.in_reply_to, vec![m]);
    let retried = h.count(|k| {
        matches!(k, EventKind::Error { message } if message.contains("history") && message.contains("retrying"))
    });
    assert_eq!(retried, 2, "each failed read is told");
}

/// A message the application delivers again with the same idempotency key (it did not see the
/// first `deliver` return) is answered once: twice while the agent is stopped, and once more after
/// the answer while it runs.
pub async fn a_message_delivered_again_with_its_key_is_answered_once(stores: Stores) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let llm = Arc::new(FnLlm::new(move |_| {
        counted.fetch_add(1, Ordering::SeqCst);
        Ok(ChatResponse::text("answered"))
    }));
    let mut h = OrgHarness::builder(PEERS)
        .stores(stores)
        .llm(llm)
        .build()
        .await;
    let a = id("a");
    let first = h
        .org
        .deliver("a", user("hello").with_idempotency_key("msg-1"))
        .await
        .unwrap();
    let second = h
        .org
        .deliver("a", user("hello").with_idempotency_key("msg-1"))
        .await
        .unwrap();
    assert_ne!(first, second, "each delivery is its own envelope");
    // Another key is another message.
    let other = h
        .org
        .deliver("a", user("hello").with_idempotency_key("msg-2"))
        .await
        .unwrap();
    h.org.start_agent(&a).await.unwrap();
    let r1 = h.reply().await;
    let r2 = h.reply().await;
    h.wait_idle("a").await;
    let answered: Vec<_> = [&r1, &r2]
        .iter()
        .flat_map(|r| r.in_reply_to.clone())
        .collect();
    assert!(answered.contains(&first), "{answered:?}");
    assert!(answered.contains(&other), "{answered:?}");
    assert!(!answered.contains(&second), "{answered:?}");
    // Delivered once more while the agent runs, after the answer.
    h.org
        .deliver("a", user("hello").with_idempotency_key("msg-1"))
        .await
        .unwrap();
    h.wait_idle("a").await;
    assert!(
        h.replies_now().is_empty(),
        "a key answered before is not answered again"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2, "one model call per key");
    // The repeats are consumed: nothing of them stays stored (fails after the harness's timeout).
    h.wait_until("the repeats consumed", || {
        let deliveries = h.org.stores().deliveries.clone();
        let a = a.clone();
        async move { deliveries.pending(&a).await.unwrap().is_empty() }
    })
    .await;
}

/// `wait_idle` covers the work of the agent's task loop: a task waiting on the board of an agent
/// that just started (nothing in its queue yet) is run before the agent counts as idle.
pub async fn wait_idle_waits_for_the_task_loop(stores: Stores) {
    let llm = Arc::new(FnLlm::new(|_| Ok(ChatResponse::text("seven"))));
    let h = OrgHarness::builder(PEERS)
        .stores(stores)
        .llm(llm)
        .build()
        .await;
    let (a, c) = (id("a"), id("c"));
    let task = h
        .org
        .delegate(
            &c,
            "a",
            "Count the stars.",
            DelegationOrigin::new(ChannelId::new("portal:c")),
        )
        .await
        .unwrap();
    h.org.start_agent(&a).await.unwrap();
    h.wait_idle("a").await;
    let after = h.org.task(&task.task_ref()).await.unwrap().unwrap();
    assert_eq!(after.status, TaskStatus::Done, "idle before the task ran");
    assert_eq!(after.result.as_deref(), Some("seven"));
}

/// Answers every task with `parsed`, counting its calls.
#[derive(Debug, Default)]
struct Parses(AtomicUsize);

#[async_trait]
impl TaskExecutor for Parses {
    async fn execute(
        &self,
        _ctx: TaskContext,
        _task: Task,
    ) -> Result<TaskOutcome, spacebot::delegation::TaskError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(TaskOutcome::Done("parsed".into()))
    }
}

/// Fails its first `n` completions (`TaskEvent::Complete`) with a backend error, then writes
/// through, and takes `mark_delay` to mark a notice sent; everything else goes straight to the
/// inner store.
#[derive(Debug)]
pub struct FlakyCompletion {
    inner: Arc<dyn spacebot::TaskStore>,
    failures_left: AtomicUsize,
    mark_delay: Duration,
    /// Marks of a sent notice that fail before one goes through.
    mark_failures_left: AtomicUsize,
}

#[async_trait]
impl spacebot::TaskStore for FlakyCompletion {
    async fn create(
        &self,
        agent: &AgentId,
        task: spacebot::task::NewTask,
        now: spacebot::Timestamp,
    ) -> Result<Task, spacebot::StoreError> {
        self.inner.create(agent, task, now).await
    }
    async fn get(
        &self,
        agent: &AgentId,
        number: u64,
    ) -> Result<Option<Task>, spacebot::StoreError> {
        self.inner.get(agent, number).await
    }
    async fn list(
        &self,
        agent: &AgentId,
        filter: &spacebot::task::TaskFilter,
    ) -> Result<Vec<Task>, spacebot::StoreError> {
        self.inner.list(agent, filter).await
    }
    async fn transition(
        &self,
        agent: &AgentId,
        number: u64,
        expect: spacebot::task::Expect,
        event: spacebot::task::TaskEvent,
        now: spacebot::Timestamp,
    ) -> Result<spacebot::task::Transition, spacebot::StoreError> {
        if matches!(event, spacebot::task::TaskEvent::Complete { .. })
            && self
                .failures_left
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
        {
            return injected("the disk is full");
        }
        self.inner
            .transition(agent, number, expect, event, now)
            .await
    }
    async fn claim_next(
        &self,
        agent: &AgentId,
        holder: &str,
        lease: Duration,
        now: spacebot::Timestamp,
    ) -> Result<Option<Task>, spacebot::StoreError> {
        self.inner.claim_next(agent, holder, lease, now).await
    }
    async fn requeue_expired(
        &self,
        agent: &AgentId,
        now: spacebot::Timestamp,
    ) -> Result<Vec<spacebot::task::Transition>, spacebot::StoreError> {
        self.inner.requeue_expired(agent, now).await
    }
    async fn outbox_pending(
        &self,
        agent: &AgentId,
    ) -> Result<Vec<spacebot::task::CompletionNotice>, spacebot::StoreError> {
        self.inner.outbox_pending(agent).await
    }
    async fn outbox_mark_sent(
        &self,
        agent: &AgentId,
        key: &str,
    ) -> Result<(), spacebot::StoreError> {
        if !self.mark_delay.is_zero() {
            tokio::time::sleep(self.mark_delay).await;
        }
        if self
            .mark_failures_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return injected("the disk is full");
        }
        self.inner.outbox_mark_sent(agent, key).await
    }
}

/// A failed write of a task's outcome keeps the result and is retried (an Error event each time):
/// the task ends done with the executor's result, and the executor is not run again.
pub async fn a_failed_outcome_write_is_retried_with_the_result_kept(stores: Stores) {
    let mut stores = stores;
    stores.tasks = Arc::new(FlakyCompletion {
        inner: stores.tasks.clone(),
        failures_left: AtomicUsize::new(3),
        mark_delay: Duration::ZERO,
        mark_failures_left: AtomicUsize::new(0),
    });
    let llm = Arc::new(FnLlm::new(|_| Ok(ChatResponse::text("ok"))));
    let exec = Arc::new(Parses::default());
    let h = OrgHarness::builder(ONE_WAY)
        .stores(stores)
        .llm(llm)
        .executor("b", exec.clone())
        .build()
        .await;
    let (a, b) = (id("a"), id("b"));
    h.org.start_agent(&b).await.unwrap();
    let task = h
        .org
        .delegate(
            &a,
            "b",
            "Parse this.",
            DelegationOrigin::new(ChannelId::new("portal:a")),
        )
        .await
        .unwrap();
    let ended = tokio::time::timeout(
        Duration::from_secs(10),
        h.org.wait_task_ended(&TaskRef::new(b.clone(), task.number)),
    )
    .await
    .expect("the task ended")
    .unwrap();
    assert_eq!(ended.status, TaskStatus::Done);
    assert_eq!(ended.result.as_deref(), Some("parsed"));
    assert_eq!(
        ended.attempts, 0,
        "no attempt failed: the first one's result was kept"
    );
    assert_eq!(exec.0.load(Ordering::SeqCst), 1, "the executor ran once");
    let told = h.count(|k| {
        matches!(k, EventKind::Error { message } if message.contains("not updated") && message.contains("retrying"))
    });
    assert_eq!(told, 3, "each failed write is told");
}

/// A completion notice is marked sent before its retrigger can be answered: when the delegator's
/// answer is out, the worker's outbox is empty, however slow the store is to mark it (the answer
/// used to race the mark, and a reader of the outbox saw a notice already answered as pending).
pub async fn a_notice_is_marked_sent_before_the_delegator_answers_it(stores: Stores) {
    let mut stores = stores;
    stores.tasks = Arc::new(FlakyCompletion {
        inner: stores.tasks.clone(),
        failures_left: AtomicUsize::new(0),
        mark_delay: Duration::from_millis(300),
        mark_failures_left: AtomicUsize::new(0),
    });
    let b = id("b");
    let llm = Arc::new(FnLlm::new(|req| {
        let asked = req.messages.iter().any(
            |m| matches!(m, ChatMessage::User { content } if content.starts_with("Beta completed")),
        );
        Ok(match req.agent.as_ref().map(|a| a.as_str()) {
            Some("a") if asked => ChatResponse::text("Beta is done"),
            Some("a") if !spacebot::testing::tool_round(&req.messages) => {
                ChatResponse::tool_calls(vec![tool_call(
                    "send_agent_message",
                    json!({"target": "b", "message": "Count the files."}),
                )])
            }
            Some("a") => ChatResponse::text("asked"),
            _ => ChatResponse::text("12"),
        })
    }));
    let mut h = OrgHarness::builder(ONE_WAY)
        .stores(stores)
        .llm(llm)
        .build()
        .await;
    h.org.start_all().await.unwrap();
    h.org
        .deliver("a", InboundMessage::new("portal", "u1", "count"))
        .await
        .unwrap();
    let answer = h.reply().await;
    assert_eq!(answer.content, "Beta is done");
    assert!(
        h.stores.tasks.outbox_pending(&b).await.unwrap().is_empty(),
        "the notice the delegator answered is still pending in the outbox"
    );
}

pub const CHIEF_AND_LEAD: &str = r#"
[[agents]]
id = "chief"
name = "Chief"
[[agents]]
id = "lead"
name = "Lead"
[[links]]
from = "chief"
to = "lead"
direction = "one_way"
relationship = "superior"
"#;

/// The chain's model: the chief delegates a user's request and reports the result when woken;
/// the lead answers.
pub fn chain_model(req: &spacebot::ChatRequest) -> ChatResponse {
    let me = req.agent.as_ref().map(AgentId::as_str).unwrap_or("");
    match (me, req.envelope_kind) {
        ("chief", Some(EnvelopeKind::UserMessage)) => ChatResponse::tool_calls(vec![tool_call(
            "send_agent_message",
            json!({"target": "lead", "message": "count the stars"}),
        )]),
        ("chief", _) => ChatResponse::text("FINAL: the lead says seven"),
        _ => ChatResponse::text("seven"),
    }
}

/// The answer to a delegated job reaches the user who asked even when the delegator was restarted
/// between the delegation and the result: where replies in a channel go is kept with its history,
/// not only in the memory of the process that saw the user's message.
pub async fn a_result_after_a_restart_is_answered_to_the_user(stores: Stores) {
    let llm = Arc::new(FnLlm::new(|req| Ok(chain_model(req))));
    let (chief, lead) = (id("chief"), id("lead"));
    let mut first = OrgHarness::builder(CHIEF_AND_LEAD)
        .stores(stores.clone())
        .llm(llm.clone())
        .build()
        .await;
    first.org.start_agent(&chief).await.unwrap();
    first
        .org
        .deliver("chief", InboundMessage::new("portal", "u7", "count them"))
        .await
        .unwrap();
    // The delegating turn ends with the delegation; the chief answers when the result comes.
    first.wait_idle("chief").await;
    assert!(first.replies_now().is_empty(), "nothing to say yet");
    let waiting = first
        .org
        .stores()
        .tasks
        .list(&lead, &spacebot::task::TaskFilter::default())
        .await
        .unwrap();
    assert_eq!(waiting.len(), 1, "the task waits on the lead's board");
    first.org.shutdown().await.unwrap();
    drop(first);

    // The next run of the application: the lead works the task, the chief is woken by the result.
    let mut second = OrgHarness::builder(CHIEF_AND_LEAD)
        .stores(stores)
        .llm(llm)
        .build()
        .await;
    second.org.start_agent(&chief).await.unwrap();
    second.org.start_agent(&lead).await.unwrap();
    let fin = second.reply().await;
    assert_eq!(fin.agent, chief);
    assert_eq!(fin.content, "FINAL: the lead says seven");
    assert_eq!(
        fin.source,
        spacebot::Source::External {
            platform: "portal".into(),
            reply_target: "u7".into(),
        },
        "the result goes back to the user who asked"
    );
}

/// A shutdown ends no session (as a crash ends none): a conversation open when the organization
/// shut down goes on at the next start on the same stores, and its conclusion reaches the initiator.
pub async fn a_conversation_goes_on_after_a_restart(stores: Stores) {
    let llm = Arc::new(FnLlm::new(|req| {
        let tool_round = spacebot::testing::tool_round(&req.messages);
        let last = last_user(&req.messages);
        Ok(match req.agent.as_ref().map(|a| a.as_str()) {
            Some("a") if last.contains("concluded") => ChatResponse::text("Beta says 42"),
            Some("a") if !tool_round => ChatResponse::tool_calls(vec![tool_call(
                "send_link_message",
                json!({"target": "b", "message": "what is 6*7?"}),
            )]),
            Some("a") => ChatResponse::text("asked"),
            _ => {
                ChatResponse::tool_calls(vec![tool_call("conclude_link", json!({"summary": "42"}))])
            }
        })
    }));
    let (a, b) = (id("a"), id("b"));
    // b is not running: the message waits in its stored deliveries.
    let mut first = OrgHarness::builder(ONE_WAY)
        .stores(stores.clone())
        .llm(llm.clone())
        .build()
        .await;
    first.org.start_agent(&a).await.unwrap();
    first.org.deliver("a", user("ask b")).await.unwrap();
    assert_eq!(first.reply().await.content, "asked");
    first.wait_idle("a").await;
    first.org.shutdown().await.unwrap();
    let open = first.org.conversations(&Default::default()).await.unwrap();
    assert_eq!(open.len(), 1);
    assert_eq!(
        open[0].status,
        spacebot::conversation::ConversationStatus::Open,
        "a shutdown leaves the conversation open"
    );
    drop(first);

    let mut second = OrgHarness::builder(ONE_WAY)
        .stores(stores)
        .llm(llm)
        .build()
        .await;
    second.org.start_agent(&a).await.unwrap();
    second.org.start_agent(&b).await.unwrap();
    assert_eq!(second.reply().await.content, "Beta says 42");
    let ended = second.org.conversations(&Default::default()).await.unwrap();
    assert_eq!(
        ended[0].status,
        spacebot::conversation::ConversationStatus::Concluded
    );
    assert_eq!(ended[0].summary.as_deref(), Some("42"));
}

/// An internal task keeps its exchange open across a restart: the receiver may still announce its
/// answer back over the one-way link, because the task is found in its stored deliveries (the
/// count of open internal tasks lives in the process that sent it).
pub async fn an_internal_task_stays_open_across_a_restart(stores: Stores) {
    let llm = Arc::new(FnLlm::new(|_| Ok(ChatResponse::text("ok"))));
    let (a, b) = (id("a"), id("b"));
    let first = OrgHarness::builder(ONE_WAY)
        .stores(stores.clone())
        .llm(llm.clone())
        .build()
        .await;
    let refused = first
        .org
        .send_internal(&b, &a, InternalMessage::announce("unasked"))
        .await;
    assert!(
        matches!(refused, Err(DeliveryError::Denied(_))),
        "nothing open yet: {refused:?}"
    );
    first
        .org
        .send_internal(&a, &b, InternalMessage::task("count the stars"))
        .await
        .unwrap();
    first.org.shutdown().await.unwrap();
    drop(first);

    let second = OrgHarness::builder(ONE_WAY)
        .stores(stores)
        .llm(llm)
        .build()
        .await;
    second
        .org
        .send_internal(&b, &a, InternalMessage::announce("seven"))
        .await
        .expect("the task is still open: its answer may go back");
}

/// The agents of an organization share one executor: a model that panics ends the loop of the
/// agent it answers for, and no other. The other agents go on answering, and a shutdown does not
/// wait for the loop that is gone.
pub async fn a_panicking_model_ends_only_its_own_agent(stores: Stores) {
    let llm = FnLlm::new(|req| {
        if req.agent.as_ref().map(|a| a.as_str()) == Some("a") {
            panic!("the model of a panicked on purpose");
        }
        Ok(ChatResponse::text("b is fine"))
    });
    let mut h = OrgHarness::builder(PEERS)
        .stores(stores)
        .llm(Arc::new(llm.clone()))
        .build()
        .await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", user("hello a")).await.unwrap();
    h.wait_until("a's model was called", || {
        let asked = !llm.requests_for(&id("a")).is_empty();
        async move { asked }
    })
    .await;
    for n in 0..3 {
        h.org
            .deliver("b", user(&format!("hello b {n}")))
            .await
            .unwrap();
        let reply = h.reply().await;
        assert_eq!(reply.content, "b is fine");
    }
    tokio::time::timeout(Duration::from_secs(10), h.org.shutdown())
        .await
        .expect("a shutdown after a panicked loop ends")
        .unwrap();
}

/// Delivers `text` to `a` as a user message and returns the content of the next reply (10 s at
/// most).
async fn ask(org: &spacebot::Organization, replies: &mut spacebot::Replies, text: &str) -> String {
    org.deliver("a", user(text)).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), futures::StreamExt::next(replies))
        .await
        .expect("a reply within 10 s")
        .expect("a reply")
        .content
}

/// With the organization's loops on two tasks of the runtime (`OrganizationBuilder::runners`),
/// delegation round trips are answered as with one, and a shutdown ends every loop.
pub async fn two_runners_carry_delegation_round_trips(stores: Stores) {
    let llm = FnLlm::new(|req| {
        let me = req.agent.as_ref().map(|a| a.as_str()).unwrap_or("");
        Ok(match (me, req.envelope_kind) {
            ("a", Some(EnvelopeKind::UserMessage)) => ChatResponse::tool_calls(vec![tool_call(
                "send_agent_message",
                json!({"target": "b", "message": "Compute."}),
            )]),
            ("b", _) => ChatResponse::text("42"),
            _ => ChatResponse::text("The answer is 42."),
        })
    });
    let org = spacebot::Organization::builder(spacebot::OrgConfig::from_toml_str(PEERS).unwrap())
        .stores(stores)
        .llm(Arc::new(llm))
        .runners(2)
        .build()
        .await
        .unwrap();
    org.start_all().await.unwrap();
    let mut replies = org.take_replies().unwrap();
    for n in 0..10 {
        let answer = ask(&org, &mut replies, &format!("question {n}")).await;
        assert_eq!(answer, "The answer is 42.", "round trip {n}");
    }
    tokio::time::timeout(Duration::from_secs(10), org.shutdown())
        .await
        .expect("the shutdown ends")
        .unwrap();
    assert!(!org.is_running(&id("a")) && !org.is_running(&id("b")));
}

/// Waiting on the replies stream helps (it runs the organization's ready loops in the waiting
/// task, when that task is on the organization's runtime): a chain driven that way is answered
/// on every backend (a turn that waits on its store goes back to the runners), a reader outside
/// the runtime only waits, and no turn ever runs outside the runtime. (That the turns of a chain
/// on the memory stores run in the waiting task itself is a unit test of `Replies`.)
pub async fn a_chain_driven_by_waiting_for_replies_is_answered(stores: Stores) {
    type Seen = Arc<std::sync::Mutex<Vec<(Option<tokio::task::Id>, bool)>>>;
    let seen: Seen = Arc::default();
    let record = seen.clone();
    let llm = FnLlm::new(move |_| {
        let on_runtime = tokio::runtime::Handle::try_current().is_ok();
        record
            .lock()
            .unwrap()
            .push((tokio::task::try_id(), on_runtime));
        Ok(ChatResponse::text("pong"))
    });
    let org = spacebot::Organization::builder(spacebot::OrgConfig::from_toml_str(PEERS).unwrap())
        .stores(stores)
        .llm(Arc::new(llm))
        .build()
        .await
        .unwrap();
    org.start_all().await.unwrap();
    let mut replies = org.take_replies().unwrap();
    // Driven from a task of the runtime.
    let driving = org.clone();
    let (driver, mut replies) = tokio::spawn(async move {
        for n in 0..20 {
            assert_eq!(
                ask(&driving, &mut replies, &format!("ping {n}")).await,
                "pong"
            );
        }
        (tokio::task::id(), replies)
    })
    .await
    .unwrap();
    assert!(
        seen.lock()
            .unwrap()
            .iter()
            .all(|(task, on_runtime)| { *on_runtime && task.is_some() }),
        "every turn ran in a task of the runtime (the driver {driver} or a runner)"
    );
    // Read from a thread outside the runtime: the reply comes, and the turn ran on the runtime.
    seen.lock().unwrap().clear();
    let (read_tx, read_rx) = tokio::sync::oneshot::channel();
    let reader = std::thread::spawn(move || {
        let reply = futures::executor::block_on(futures::StreamExt::next(&mut replies));
        let _ = read_tx.send(reply.map(|r| r.content));
    });
    org.deliver("a", user("ping from outside")).await.unwrap();
    let content = tokio::time::timeout(Duration::from_secs(10), read_rx)
        .await
        .expect("a reply within 10 s")
        .unwrap();
    assert_eq!(content.as_deref(), Some("pong"));
    reader.join().unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert!(
        seen.iter().all(|(_, on_runtime)| *on_runtime),
        "a turn ran outside the organization's runtime: {seen:?}"
    );
}

const A_B_AND_C: &str = r#"
[settings]
conversation_turn_budget = 4
[[agents]]
id = "a"
name = "Alpha"
[[agents]]
id = "b"
name = "Beta"
[[agents]]
id = "c"
name = "Gamma"
[[links]]
from = "a"
to = "b"
direction = "two_way"
relationship = "peer"
[[links]]
from = "a"
to = "c"
direction = "one_way"
relationship = "superior"
"#;

/// A conversation budget spent by an exchange stays spent across a restart: a opens a
/// conversation with b and delegates a slow job to c in the same turn; a and b always answer, so
/// the budget severs the conversation. The organization is restarted on the same stores; c's
/// result wakes a in the same exchange, and a's new message to b is refused: no fresh conversation,
/// no fresh budget (a budget is a backstop that nothing resets).
pub async fn a_spent_conversation_budget_stays_spent_across_a_restart(stores: Stores) {
    let llm = Arc::new(FnLlm::new(|req| {
        let me = req.agent.as_ref().map(AgentId::as_str).unwrap_or("");
        let tool_round = spacebot::testing::tool_round(&req.messages);
        let in_link = req
            .channel
            .as_ref()
            .is_some_and(|c| c.as_str().starts_with("link:"));
        Ok(match me {
            "b" => ChatResponse::text("b answers"),
            "c" => ChatResponse::text("the job is done"),
            _ if in_link => ChatResponse::text("a answers"),
            _ if req.envelope_kind == Some(EnvelopeKind::UserMessage) => {
                ChatResponse::tool_calls(vec![
                    tool_call(
                        "send_link_message",
                        json!({"target": "b", "message": "hello b"}),
                    ),
                    tool_call(
                        "send_agent_message",
                        json!({"target": "c", "message": "a slow job"}),
                    ),
                ])
            }
            _ if tool_round => ChatResponse::text("a is done"),
            // Woken by c's result: try b again.
            _ => ChatResponse::tool_calls(vec![tool_call(
                "send_link_message",
                json!({"target": "b", "message": "hello again b"}),
            )]),
        })
    }));
    let (a, b, c) = (id("a"), id("b"), id("c"));
    let mut first = OrgHarness::builder(A_B_AND_C)
        .stores(stores.clone())
        .llm(llm.clone())
        .build()
        .await;
    first.timeout = Duration::from_secs(60);
    first.org.start_agent(&a).await.unwrap();
    first.org.start_agent(&b).await.unwrap();
    first.org.deliver("a", user("start")).await.unwrap();

    first
        .wait_until("the budget severed the conversation", || {
            let org = first.org.clone();
            async move {
                let list = org.conversations(&Default::default()).await.unwrap();
                list.len() == 1
                    && list[0].status == spacebot::conversation::ConversationStatus::Severed
            }
        })
        .await;
    first
        .wait_until("a and b idle", || {
            let ok = first.org.is_idle(&a) && first.org.is_idle(&b);
            async move { ok }
        })
        .await;
    let before = first
        .history("b", &ChannelId::link(&b, &a))
        .await
        .into_iter()
        .filter(|r| r.record.content.starts_with("hello"))
        .count();
    first.org.shutdown().await.unwrap();
    drop(first);

    let mut second = OrgHarness::builder(A_B_AND_C)
        .stores(stores)
        .llm(llm)
        .build()
        .await;
    second.timeout = Duration::from_secs(60);
    second.org.start_all().await.unwrap();
    // c's result wakes a; a tries b again and is refused, then reports.
    assert_eq!(second.reply().await.content, "a is done");
    second
        .wait_until("every agent idle", || {
            let ok = second.org.is_idle(&a) && second.org.is_idle(&b) && second.org.is_idle(&c);
            async move { ok }
        })
        .await;
    let conversations = second.org.conversations(&Default::default()).await.unwrap();
    assert_eq!(
        conversations.len(),
        1,
        "no fresh conversation after the restart: {conversations:?}"
    );
    let sent = second
        .history("b", &ChannelId::link(&b, &a))
        .await
        .into_iter()
        .filter(|r| r.record.content.starts_with("hello"))
        .count();
    assert_eq!(
        sent, before,
        "nothing more reached b after the restart ({before} before)"
    );
}

/// A notice whose mark as sent fails once (then twice more, then for good five times) still leaves
/// the outbox: the delegator answers it once, and the outbox is empty soon after, long before the
/// task loop's next periodic round.
pub async fn a_failed_mark_sent_does_not_leave_a_delivered_notice_in_the_outbox(stores: Stores) {
    for failures in [1, 3, 5] {
        let stores = stores.clone();
        let mut wrapped = stores.clone();
        wrapped.tasks = Arc::new(FlakyCompletion {
            inner: stores.tasks.clone(),
            failures_left: AtomicUsize::new(0),
            mark_delay: Duration::ZERO,
            mark_failures_left: AtomicUsize::new(failures),
        });
        let b = id("b");
        let llm = Arc::new(FnLlm::new(|req| {
            // This turn's own tool round (the history of the earlier runs, on the same stores,
            // holds the tool calls of their delegating turns too).
            let tool_round = spacebot::testing::tool_round(&req.messages);
            Ok(
                match (req.agent.as_ref().map(|a| a.as_str()), req.envelope_kind) {
                    (Some("a"), Some(EnvelopeKind::UserMessage)) if !tool_round => {
                        ChatResponse::tool_calls(vec![tool_call(
                            "send_agent_message",
                            json!({"target": "b", "message": "Count the files."}),
                        )])
                    }
                    (Some("a"), Some(EnvelopeKind::UserMessage)) => ChatResponse::text("asked"),
                    (Some("a"), _) => ChatResponse::text("Beta is done"),
                    _ => ChatResponse::text("12"),
                },
            )
        }));
        let mut h = OrgHarness::builder(ONE_WAY)
            .stores(wrapped)
            .llm(llm)
            .build()
            .await;
        h.org.start_all().await.unwrap();
        h.org
            .deliver("a", InboundMessage::new("portal", "u1", "count"))
            .await
            .unwrap();
        // The delegating turn ends with the delegation; the notice's retrigger is answered.
        assert_eq!(h.reply().await.content, "Beta is done");
        h.wait_until("the outbox is empty", || {
            let tasks = stores.tasks.clone();
            let b = b.clone();
            async move { tasks.outbox_pending(&b).await.unwrap().is_empty() }
        })
        .await;
        h.wait_idle("a").await;
        assert!(
            h.replies_now().is_empty(),
            "the notice was answered once ({failures} failed marks)"
        );
        h.org.shutdown().await.unwrap();
    }
}

/// A claim cut before its model call (the process killed between the claim and the call) uses up
/// no attempt: the next start recovers it, runs it once, and the task ends done with attempts 0
/// and one recovery counted, three times in a row.
pub async fn a_claim_cut_before_the_model_call_uses_no_attempt(stores: Stores) {
    let (a, b) = (id("a"), id("b"));
    let llm = Arc::new(FnLlm::new(|_| Ok(ChatResponse::text("counted"))));
    for round in 1..=3u32 {
        let h = OrgHarness::builder(ONE_WAY)
            .stores(stores.clone())
            .llm(llm.clone())
            .build()
            .await;
        let task = h
            .org
            .delegate(
                &a,
                "b",
                "Count the files.",
                DelegationOrigin::new(ChannelId::new("portal:a")),
            )
            .await
            .unwrap();
        // A process that died right after its claim (its holder names a loop no longer alive).
        let claimed = stores
            .tasks
            .claim_next(
                &b,
                &format!("b:worker:gone{round}:1"),
                Duration::from_secs(300),
                spacebot::Timestamp(1),
            )
            .await
            .unwrap()
            .expect("the task is claimed");
        assert_eq!(claimed.number, task.number);
        h.org.start_agent(&b).await.unwrap();
        let ended = tokio::time::timeout(
            Duration::from_secs(10),
            h.org.wait_task_ended(&TaskRef::new(b.clone(), task.number)),
        )
        .await
        .expect("the task ended")
        .unwrap();
        assert_eq!(ended.status, TaskStatus::Done, "{ended:?}");
        assert_eq!(ended.attempts, 0, "no attempt used by the cut claim");
        assert_eq!(ended.metadata.recoveries, 1, "one recovery counted");
        h.org.shutdown().await.unwrap();
    }
    assert_eq!(llm.requests_for(&b).len(), 3, "the model ran once per task");
}
