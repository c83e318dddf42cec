//! Governance: a request's limits bind across its whole delegation tree, across a restart, and the
//! user is told once.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: failing loudly is the point

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use async_trait::async_trait;
use serde_json::json;
use spacebot::event::EventKind;
use spacebot::limits::{Limit, Limits, Period, RequestLedger, Scope, estimate_input};
use spacebot::llm::{ChatResponse, Usage};
use spacebot::testing::{OrgHarness, last_user_text, tool_call};
use spacebot::{
    AgentId, ChatRequest, InboundMessage, LlmError, LlmProvider, ReplyKind, Stores, TaskStatus,
};

/// A chief, a lead under it, three workers under the lead.
const TREE: &str = r#"
[[agents]]
id = "chief"
name = "Chief"
[[agents]]
id = "lead"
name = "Lead"
[[agents]]
id = "w1"
name = "Worker One"
[[agents]]
id = "w2"
name = "Worker Two"
[[agents]]
id = "w3"
name = "Worker Three"
[[links]]
from = "chief"
to = "lead"
relationship = "superior"
[[links]]
from = "lead"
to = "w1"
relationship = "superior"
[[links]]
from = "lead"
to = "w2"
relationship = "superior"
[[links]]
from = "lead"
to = "w3"
relationship = "superior"
"#;

/// The tree's script: the chief delegates to the lead, the lead fans out to the three workers,
/// each worker answers, the lead sums up, the chief answers the user. Every call reports its
/// prompt's tokens (about a quarter of its bytes) and 40 completion tokens (fewer when the call's
/// `max_tokens` says so, as a provider would); the model counts what it reported.
#[derive(Debug, Default)]
struct Tree {
    reported: AtomicU64,
    calls: AtomicU64,
    /// Paced: a worker's call waits (up to half a second) for another worker's call to start, so
    /// that calls free to run together do, and counts how many ran at once.
    paced: bool,
    workers_in_flight: AtomicU64,
    most_workers_at_once: AtomicU64,
    worker_started: tokio::sync::Notify,
}

impl Tree {
    fn paced() -> Self {
        Self {
            paced: true,
            ..Self::default()
        }
    }

    /// A worker's call, paced (see [`Tree::paced`]).
    async fn pace(&self) {
        let now = self.workers_in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_workers_at_once.fetch_max(now, Ordering::SeqCst);
        self.worker_started.notify_waiters();
        if now < 2 {
            let another = self.worker_started.notified();
            tokio::pin!(another);
            another.as_mut().enable();
            if self.workers_in_flight.load(Ordering::SeqCst) < 2 {
                let _ = tokio::time::timeout(std::time::Duration::from_millis(500), another).await;
            }
        }
        self.workers_in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

#[async_trait]
impl LlmProvider for Tree {
    async fn complete(&self, request: ChatRequest) -> Result<ChatResponse, LlmError> {
        let me = request.agent.as_ref().map(AgentId::as_str).unwrap_or("");
        if self.paced && me.starts_with('w') {
            self.pace().await;
        }
        let text = last_user_text(&request.messages);
        let mut response = match me {
            "chief" if text.contains("have ended") || text.contains("task #") => {
                ChatResponse::text("The launch plan is ready.")
            }
            "chief" => ChatResponse::tool_calls(vec![tool_call(
                "send_agent_message",
                json!({"target": "lead", "message": "Plan the launch."}),
            )]),
            "lead" if text.contains("have ended") => ChatResponse::text("Plan: w1, w2, w3 done."),
            "lead" => ChatResponse::tool_calls(
                ["w1", "w2", "w3"]
                    .iter()
                    .map(|w| {
                        tool_call(
                            "send_agent_message",
                            json!({"target": w, "message": format!("Do part {w}.")}),
                        )
                    })
                    .collect(),
            ),
            _ => ChatResponse::text("part done"),
        };
        // A tokenizer's count: about four bytes a token (the runtime's estimate, a third of the
        // bytes, is above it, as an estimate must be).
        let prompt = u32::try_from(estimate_input(&request) * 3 / 4).unwrap();
        let completion = request.max_tokens.map_or(40, |m| m.min(40));
        let usage = Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
        };
        self.reported
            .fetch_add(u64::from(usage.total_tokens), Ordering::SeqCst);
        self.calls.fetch_add(1, Ordering::SeqCst);
        response.usage = Some(usage);
        Ok(response)
    }
}

/// An organization of `config` on `stores` and `llm`, every agent started, with the user's
/// request (the chief asked for the launch plan) delivered: the harness and the request's id.
async fn launched(
    config: impl Into<String>,
    stores: Stores,
    llm: Arc<dyn LlmProvider>,
) -> (OrgHarness, spacebot::EnvelopeId) {
    let h = OrgHarness::builder(config)
        .stores(stores)
        .llm(llm)
        .build()
        .await;
    h.org.start_all().await.unwrap();
    let request = h
        .org
        .deliver("chief", InboundMessage::new("portal", "u1", "launch plan"))
        .await
        .unwrap();
    (h, request)
}

fn limited(limits: &str) -> String {
    format!("[settings.limits]\n{limits}\n{TREE}")
}

/// The whole tree costs 7 calls of about 1,100 tokens each. Under a limit of 5,000 total tokens
/// some of its calls are refused: the request spends at most 5,000 in all (what the model reported, to
/// the token, is what the ledger settled), the refusal is an event naming the limit, and the user
/// gets exactly one failure reply naming it and what was spent.
pub async fn a_fanned_out_request_spends_at_most_its_token_limit(stores: Stores) {
    let llm = Arc::new(Tree::default());
    let (mut h, request) =
        launched(limited("total_tokens = 5000"), stores.clone(), llm.clone()).await;
    let reply = h.reply().await;
    assert_eq!(reply.kind, ReplyKind::Failure, "{reply:?}");
    assert!(
        reply.content.contains("total tokens") && reply.content.contains("spent"),
        "{}",
        reply.content
    );
    h.wait_quiet().await;

    let entry = h
        .org
        .request_spend(&request)
        .await
        .unwrap()
        .expect("the request's spend is stored");
    let reported = llm.reported.load(Ordering::SeqCst);
    assert_eq!(entry.settled.total_tokens, reported, "exact sums");
    assert_eq!(entry.settled.model_calls, llm.calls.load(Ordering::SeqCst));
    assert!(reported <= 5_000, "spent {reported} under a limit of 5000");
    assert!(reported > 0, "some calls were made: {entry:?}");
    assert!(entry.reserved.is_empty(), "{:?}", entry.reserved);
    assert_eq!(
        entry.reached.as_ref().map(|r| r.over.limit),
        Some(Limit::TotalTokens)
    );
    let refusals = h
        .events
        .events()
        .iter()
        .filter(|e| matches!(&e.kind, EventKind::LimitReached { request: r, .. } if r == &request))
        .count();
    assert!(refusals >= 1);
    // Told once: once everything the request caused has ended, no second reply came.
    let more = h.replies_now();
    assert!(more.is_empty(), "told more than once: {more:?}");
}

/// A call that would fit but for another open reservation of its request waits for that one to
/// settle, then runs. The limit is what the tree spends (measured on a run without limits: the
/// calls' prompts are the same) plus a margin for the estimates, which count more than the model
/// reports: room for every call made one after another, not for two workers at once (a
/// reservation takes up to 4,096 output tokens of the room left). Without the limit the three
/// workers' calls run together; with it they run one at a time, and the user gets the answer.
pub async fn a_call_kept_out_by_an_open_reservation_waits_for_it(stores: Stores) {
    let free = Arc::new(Tree::paced());
    let mut m = OrgHarness::builder(TREE)
        .stores(Stores::memory())
        .llm(free.clone())
        .build()
        .await;
    m.org.start_all().await.unwrap();
    m.org
        .deliver("chief", InboundMessage::new("portal", "u1", "launch plan"))
        .await
        .unwrap();
    assert_eq!(m.reply().await.content, "The launch plan is ready.");
    assert!(
        free.most_workers_at_once.load(Ordering::SeqCst) >= 2,
        "without limits the workers' calls run together"
    );
    let limit = free.reported.load(Ordering::SeqCst) + 600;

    let llm = Arc::new(Tree::paced());
    let (mut h, request) = launched(
        limited(&format!("total_tokens = {limit}")),
        stores,
        llm.clone(),
    )
    .await;
    let reply = h.reply().await;
    assert_eq!(reply.content, "The launch plan is ready.", "{reply:?}");
    h.wait_quiet().await;
    assert_eq!(llm.calls.load(Ordering::SeqCst), 7, "every call was made");
    assert_eq!(
        llm.most_workers_at_once.load(Ordering::SeqCst),
        1,
        "the workers' calls waited for each other's settlement"
    );
    let entry = h.org.request_spend(&request).await.unwrap().unwrap();
    let reported = llm.reported.load(Ordering::SeqCst);
    assert_eq!(entry.settled.total_tokens, reported);
    assert!(reported <= limit, "spent {reported} under {limit}");
    assert!(entry.reached.is_none(), "{entry:?}");
    assert!(entry.reserved.is_empty(), "{:?}", entry.reserved);
}

/// The failure that tells a request's user claims the telling in the request's record, then sends
/// the reply: a process killed in between leaves the claim without the reply. The claim names its
/// teller (the message the failure answers): run again after the restart, the same failure tells
/// again; a failure answering another message does not. The claims are made here as the run that
/// crashed would have made them, before the refused turn runs.
pub async fn a_claim_to_tell_left_by_a_crash_is_told_again(stores: Stores) {
    // A limit no call fits: the chief's first turn is refused.
    let config = limited("total_tokens = 1");
    for mine in [true, false] {
        let llm = Arc::new(Tree::default());
        let mut h = OrgHarness::builder(config.clone())
            .stores(stores.clone())
            .llm(llm.clone())
            .build()
            .await;
        let request = h
            .org
            .deliver("chief", InboundMessage::new("portal", "u1", "launch plan"))
            .await
            .unwrap();
        let teller = if mine {
            request.as_str()
        } else {
            "another-message"
        };
        let ledger = RequestLedger::new(stores.records.clone());
        assert!(
            ledger
                .tell_once(&request, teller, spacebot::Timestamp(1))
                .await
                .unwrap()
        );
        h.org
            .start_agent(&AgentId::parse("chief").unwrap())
            .await
            .unwrap();
        if mine {
            let reply = h.reply().await;
            assert_eq!(reply.kind, ReplyKind::Failure, "{reply:?}");
            assert!(reply.content.contains("total tokens"), "{}", reply.content);
            assert_eq!(reply.in_reply_to, vec![request.clone()]);
        }
        h.wait_quiet().await;
        let more = h.replies_now();
        assert!(more.is_empty(), "told by another failure: {more:?}");
        assert_eq!(llm.calls.load(Ordering::SeqCst), 0, "no call fits");
        h.org.shutdown().await.unwrap();
    }
}

/// Without a limit the same tree runs to its answer, and nothing is written to the ledger.
pub async fn without_limits_the_tree_runs_and_nothing_is_recorded(stores: Stores) {
    let llm = Arc::new(Tree::default());
    let (mut h, request) = launched(TREE, stores.clone(), llm.clone()).await;
    let reply = h.reply().await;
    assert_eq!(reply.content, "The launch plan is ready.");
    assert_eq!(llm.calls.load(Ordering::SeqCst), 7);
    let ledger = RequestLedger::new(stores.records.clone());
    assert!(ledger.get(&request).await.unwrap().is_none());
}

/// A message's own limit binds its whole tree across a restart: the first run spends one of its
/// 3 model calls (the chief delegates; the lead is not running), the second run, on the same
/// stores and with no limit in its configuration, may make only the 2 left (the lead's fan-out and
/// one worker's answer; forgotten, the tree would make 6 more), and the user is told once.
pub async fn a_message_limit_holds_across_a_restart(stores: Stores) {
    let llm = Arc::new(Tree::default());
    let h = OrgHarness::builder(TREE)
        .stores(stores.clone())
        .llm(llm.clone())
        .build()
        .await;
    h.org
        .start_agent(&AgentId::parse("chief").unwrap())
        .await
        .unwrap();
    let limits = Limits {
        model_calls: Some(3),
        ..Limits::NONE
    };
    let request = h
        .org
        .deliver(
            "chief",
            InboundMessage::new("portal", "u1", "launch plan").with_limits(limits),
        )
        .await
        .unwrap();
    h.wait_idle("chief").await;
    assert_eq!(llm.calls.load(Ordering::SeqCst), 1, "the chief delegated");
    h.org.shutdown().await.unwrap();
    drop(h);

    let ledger = RequestLedger::new(stores.records.clone());
    let before = ledger.get(&request).await.unwrap().unwrap();
    assert_eq!(before.settled.model_calls, 1);
    assert_eq!(before.limits.model_calls, Some(3));

    let llm2 = Arc::new(Tree::default());
    let mut h2 = OrgHarness::builder(TREE)
        .stores(stores.clone())
        .llm(llm2.clone())
        .build()
        .await;
    h2.org.start_all().await.unwrap();
    let reply = h2.reply().await;
    assert_eq!(reply.kind, ReplyKind::Failure, "{reply:?}");
    assert!(reply.content.contains("model calls"), "{}", reply.content);
    h2.wait_quiet().await;
    assert_eq!(
        llm2.calls.load(Ordering::SeqCst),
        2,
        "after the restart only the 2 calls left were made"
    );
    let after = h2.org.request_spend(&request).await.unwrap().unwrap();
    assert_eq!(after.settled.model_calls, 3, "{:?}", after.settled);
    assert!(after.reserved.is_empty(), "{:?}", after.reserved);
    let more = h2.replies_now();
    assert!(more.is_empty(), "told more than once: {more:?}");
}

/// Under limits a turn's input records go with its first model call's reservation (written
/// together, one commit where the store can): both are stored before the model is asked. The
/// model here waits for the test, which reads the stores as another process would.
pub async fn a_limited_turns_input_and_reservation_are_stored_before_its_call(stores: Stores) {
    let (llm, mut calls) = spacebot::testing::MockLlm::pair();
    let mut h = OrgHarness::builder(limited("total_tokens = 100000"))
        .stores(stores.clone())
        .llm(Arc::new(llm))
        .build()
        .await;
    let w1 = AgentId::parse("w1").unwrap();
    h.org.start_agent(&w1).await.unwrap();
    let request = h
        .org
        .deliver(
            "w1",
            InboundMessage::new("portal", "u1", "stored before the call"),
        )
        .await
        .unwrap();
    let call = tokio::time::timeout(h.timeout, calls.next())
        .await
        .expect("the model was asked")
        .expect("a call");
    let channel = call.request.channel.clone().expect("the request's channel");
    let history = stores.channels.history(&w1, &channel, None).await.unwrap();
    assert!(
        history
            .iter()
            .any(|r| r.record.content.as_ref() == "stored before the call"),
        "the input is not in the stored history: {history:?}"
    );
    let stored = RequestLedger::new(stores.records.clone())
        .get(&request)
        .await
        .unwrap()
        .expect("the request's ledger record");
    assert_eq!(stored.reserved.len(), 1, "{stored:?}");
    call.respond_text("part done");
    assert_eq!(h.reply().await.content, "part done");
}

/// A request of one model call: nothing writes the request after its call, so its settlement
/// (counted at once in the process, see `RequestLedger::settle_behind`) is stored by the flush
/// that follows it at most 50 ms later: another reader of the stores (another process) sees the
/// call settled, not its reservation, soon after the reply and before any shutdown; a shutdown
/// right after a reply runs that flush at once and waits for it; a restart finds both settled.
pub async fn the_settlement_of_a_requests_last_call_is_stored(stores: Stores) {
    let llm = Arc::new(Tree::default());
    let mut h = OrgHarness::builder(limited("total_tokens = 100000"))
        .stores(stores.clone())
        .llm(llm.clone())
        .build()
        .await;
    h.org
        .start_agent(&AgentId::parse("w1").unwrap())
        .await
        .unwrap();
    let request = h
        .org
        .deliver("w1", InboundMessage::new("portal", "u1", "one part"))
        .await
        .unwrap();
    let reply = h.reply().await;
    assert_eq!(reply.content, "part done");
    let reported = llm.reported.load(Ordering::SeqCst);
    // This process counts it at once.
    let here = h.org.request_spend(&request).await.unwrap().unwrap();
    assert_eq!(
        (here.settled.total_tokens, here.reserved.len()),
        (reported, 0)
    );
    // Another reader: the stored record, once the flush ran.
    let other = RequestLedger::new(stores.records.clone());
    h.wait_until("the settlement is stored", || {
        let (other, request) = (other.clone(), request.clone());
        async move {
            other
                .get(&request)
                .await
                .unwrap()
                .is_some_and(|e| e.reserved.is_empty() && e.settled.model_calls == 1)
        }
    })
    .await;
    // A second request, and a shutdown right after its reply: the shutdown waits for the flush.
    let second = h
        .org
        .deliver("w1", InboundMessage::new("portal", "u2", "another part"))
        .await
        .unwrap();
    assert_eq!(h.reply().await.content, "part done");
    let reported_second = llm.reported.load(Ordering::SeqCst) - reported;
    h.org.shutdown().await.unwrap();
    drop(h);
    let ledger = RequestLedger::new(stores.records.clone());
    for (request, tokens) in [(&request, reported), (&second, reported_second)] {
        let stored = ledger.get(request).await.unwrap().unwrap();
        assert_eq!(stored.settled.total_tokens, tokens, "exact sums");
        assert_eq!(stored.settled.model_calls, 1);
        assert!(stored.reserved.is_empty(), "{:?}", stored.reserved);
    }
}

/// Under a limit of 3 model calls the chief delegates (1), the lead fans out (2), one worker
/// answers (3): the two other workers' turns are refused and their tasks fail at once, on their
/// first attempt (another would be refused the same way), as do the lead's and every task of
/// the request; nothing is left open, nothing loops, the user is told once.
pub async fn open_tasks_of_a_stopped_request_fail_at_once(stores: Stores) {
    let llm = Arc::new(Tree::default());
    let mut h = OrgHarness::builder(limited("model_calls = 3"))
        .stores(stores.clone())
        .llm(llm.clone())
        .build()
        .await;
    h.org.start_all().await.unwrap();
    h.org
        .deliver("chief", InboundMessage::new("portal", "u1", "launch plan"))
        .await
        .unwrap();
    let reply = h.reply().await;
    assert_eq!(reply.kind, ReplyKind::Failure, "{reply:?}");
    assert!(reply.content.contains("model calls"), "{}", reply.content);
    h.wait_quiet().await;
    assert_eq!(llm.calls.load(Ordering::SeqCst), 3);
    let mut failed = 0;
    for agent in ["lead", "w1", "w2", "w3"] {
        for task in h.board(agent).await {
            assert!(task.status.is_terminal(), "{agent}: {task:?}");
            if task.status == TaskStatus::Failed {
                failed += 1;
                assert_eq!(task.attempts, 1, "not retried: {task:?}");
                let error = task.error.clone().unwrap_or_default();
                assert!(error.contains("model calls"), "{error}");
            }
        }
    }
    // Two workers' tasks and the lead's.
    assert_eq!(failed, 3);
    assert!(h.replies_now().is_empty(), "told more than once");
}

/// A price table gives each call a cost (1 millionth per input token, 2 per output token, so
/// the sum is exact), and a cost limit binds: the request spends at most 0.004.
pub async fn a_cost_limit_binds_with_the_price_table(stores: Stores) {
    let llm = Arc::new(Tree::default());
    let config = format!(
        "[settings.limits]\ncost = 0.004\n[settings.prices.default]\ninput_per_million = 1.0\noutput_per_million = 2.0\n{TREE}"
    );
    let (mut h, request) = launched(config, stores.clone(), llm.clone()).await;
    let reply = h.reply().await;
    assert_eq!(reply.kind, ReplyKind::Failure, "{reply:?}");
    assert!(reply.content.contains("cost"), "{}", reply.content);
    h.wait_quiet().await;
    let entry = h.org.request_spend(&request).await.unwrap().unwrap();
    let s = entry.settled;
    assert_eq!(s.total_tokens, llm.reported.load(Ordering::SeqCst));
    assert_eq!(s.cost.0, s.input_tokens + 2 * s.output_tokens, "{s:?}");
    assert!(s.cost.0 <= 4_000 && s.model_calls >= 1, "{s:?}");
}

/// "ok", reporting 12 tokens (10 in, 2 out).
fn ok_response() -> ChatResponse {
    let mut r = ChatResponse::text("ok");
    r.usage = Some(Usage {
        prompt_tokens: 10,
        completion_tokens: 2,
        total_tokens: 12,
    });
    r
}

/// A model that always answers [`ok_response`].
fn ok_llm() -> spacebot::testing::FnLlm {
    spacebot::testing::FnLlm::new(|_| Ok(ok_response()))
}

/// User `u{n}` says "hi" to `agent`; the reply.
async fn ask(h: &mut OrgHarness, agent: &str, n: u32) -> spacebot::Reply {
    h.org
        .deliver(agent, InboundMessage::new("portal", format!("u{n}"), "hi"))
        .await
        .unwrap();
    h.reply().await
}

/// A record store that holds the request ledger's writes once `hold` is set, until `release`;
/// `held` says one is waiting, `stored` that a held write reached the store.
#[derive(Debug)]
struct HeldLedger {
    inner: Arc<dyn spacebot::records::RecordStore>,
    hold: AtomicBool,
    held: AtomicBool,
    release: AtomicBool,
    released: tokio::sync::Notify,
    stored: AtomicBool,
}

#[async_trait]
impl spacebot::records::RecordStore for HeldLedger {
    async fn get(
        &self,
        namespace: &str,
        key: &str,
    ) -> Result<Option<spacebot::records::Record>, spacebot::StoreError> {
        self.inner.get(namespace, key).await
    }
    async fn version(
        &self,
        namespace: &str,
        key: &str,
        version: u64,
    ) -> Result<Option<spacebot::records::Record>, spacebot::StoreError> {
        self.inner.version(namespace, key, version).await
    }
    async fn write(
        &self,
        write: spacebot::records::RecordWrite,
    ) -> Result<spacebot::records::WriteOutcome, spacebot::StoreError> {
        let holding =
            write.namespace == spacebot::limits::NAMESPACE && self.hold.load(Ordering::SeqCst);
        if holding {
            self.held.store(true, Ordering::SeqCst);
            loop {
                let released = self.released.notified();
                if self.release.load(Ordering::SeqCst) {
                    break;
                }
                released.await;
            }
        }
        let outcome = self.inner.write(write).await;
        if holding {
            self.stored.store(true, Ordering::SeqCst);
        }
        outcome
    }
    async fn list(
        &self,
        namespace: &str,
        prefix: &str,
    ) -> Result<Vec<spacebot::records::Record>, spacebot::StoreError> {
        self.inner.list(namespace, prefix).await
    }
    async fn history(
        &self,
        namespace: &str,
        key: &str,
    ) -> Result<Vec<spacebot::records::Record>, spacebot::StoreError> {
        self.inner.history(namespace, key).await
    }
    async fn release(&self) {
        self.inner.release().await;
    }
}

/// A shutdown waits for the settlement a turn left to store behind it: the model's call makes
/// the ledger's next writes wait (the reservation was stored before it), so the flush is held
/// when the reply arrives; the shutdown cannot return before it is released and stored (the
/// release comes only once the shutdown has had 2 s to return without it, which it must not).
pub async fn a_shutdown_waits_for_the_settlement_left_behind(stores: Stores) {
    let held = Arc::new(HeldLedger {
        inner: stores.records.clone(),
        hold: AtomicBool::new(false),
        held: AtomicBool::new(false),
        release: AtomicBool::new(false),
        released: tokio::sync::Notify::new(),
        stored: AtomicBool::new(false),
    });
    let gate = held.clone();
    let llm = spacebot::testing::FnLlm::new(move |_| {
        gate.hold.store(true, Ordering::SeqCst);
        Ok(ok_response())
    });
    let wrapped = Stores {
        records: held.clone(),
        ..stores.clone()
    };
    let mut h = OrgHarness::builder(limited("total_tokens = 100000"))
        .stores(wrapped)
        .llm(Arc::new(llm))
        .build()
        .await;
    h.org
        .start_agent(&AgentId::parse("w1").unwrap())
        .await
        .unwrap();
    let request = h
        .org
        .deliver("w1", InboundMessage::new("portal", "u1", "one part"))
        .await
        .unwrap();
    assert_eq!(h.reply().await.content, "ok");
    h.wait_until("the settlement's write is held", || {
        let held = held.clone();
        async move { held.held.load(Ordering::SeqCst) }
    })
    .await;
    let shutdown = async {
        h.org.shutdown().await.unwrap();
        held.stored.load(Ordering::SeqCst)
    };
    let release = async {
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        held.release.store(true, Ordering::SeqCst);
        held.released.notify_waiters();
        std::future::pending::<()>().await;
    };
    let stored_before_return = tokio::select! {
        stored = shutdown => stored,
        () = release => unreachable!(),
    };
    assert!(
        stored_before_return,
        "the shutdown returned before the settlement was stored"
    );
    drop(h);
    let entry = RequestLedger::new(stores.records.clone())
        .get(&request)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((entry.settled.model_calls, entry.reserved.len()), (1, 0));
}

/// An organization of `config` on `stores` with the ok model and a manual clock at 1,000,000 ms,
/// every agent started.
async fn started_on_a_manual_clock(config: &str, stores: Stores) -> OrgHarness {
    let h = OrgHarness::builder(config)
        .stores(stores)
        .llm(Arc::new(ok_llm()))
        .manual_clock(spacebot::ManualClock::new(1_000_000))
        .build()
        .await;
    h.org.start_all().await.unwrap();
    h
}

/// One agent's own `limits` (`[[agents]] limits`, 1 model call an hour) bind that agent alone,
/// tightened with `[settings.agent_limits]` (3 an hour): solo's second call is refused naming its
/// hour, the other agent makes three.
pub async fn an_agents_own_period_limits_bind_it_alone(stores: Stores) {
    let config = r#"
[settings.agent_limits]
period = "hour"
model_calls = 3
[[agents]]
id = "solo"
limits = { period = "hour", model_calls = 1 }
[[agents]]
id = "other"
"#;
    let mut h = started_on_a_manual_clock(config, stores).await;
    assert_eq!(ask(&mut h, "solo", 1).await.kind, ReplyKind::Answer);
    let refused = ask(&mut h, "solo", 2).await;
    assert_eq!(refused.kind, ReplyKind::Failure);
    assert!(
        refused.content.contains("agent solo (last hour)")
            && refused.content.contains("model calls"),
        "{}",
        refused.content
    );
    for n in 3..6 {
        assert_eq!(ask(&mut h, "other", n).await.kind, ReplyKind::Answer);
    }
    assert_eq!(ask(&mut h, "other", 6).await.kind, ReplyKind::Failure);
    let hour = |agent: &str| Scope::Agent {
        agent: AgentId::parse(agent).unwrap(),
        period: Period::Hour,
    };
    assert_eq!(
        h.org.period_spend(&hour("solo")).await.unwrap().model_calls,
        1
    );
    assert_eq!(
        h.org
            .period_spend(&hour("other"))
            .await
            .unwrap()
            .model_calls,
        3
    );
}

/// Every agent may make 2 model calls an hour, the organization 3 a day, on a manual clock:
/// solo's third call in the hour is refused (the user told why), an hour later it may call
/// again, and the organization's third call of the day is its last.
pub async fn period_limits_roll_with_the_clock(stores: Stores) {
    let config = r#"
[settings.agent_limits]
period = "hour"
model_calls = 2
[settings.org_limits]
period = "day"
model_calls = 3
[[agents]]
id = "solo"
[[agents]]
id = "other"
"#;
    let mut h = started_on_a_manual_clock(config, stores).await;
    assert_eq!(ask(&mut h, "solo", 1).await.kind, ReplyKind::Answer);
    assert_eq!(ask(&mut h, "solo", 2).await.kind, ReplyKind::Answer);
    let refused = ask(&mut h, "solo", 3).await;
    assert_eq!(refused.kind, ReplyKind::Failure);
    assert!(
        refused.content.contains("agent solo (last hour)")
            && refused.content.contains("model calls"),
        "{}",
        refused.content
    );
    let solo = Scope::Agent {
        agent: AgentId::parse("solo").unwrap(),
        period: Period::Hour,
    };
    assert_eq!(h.org.period_spend(&solo).await.unwrap().model_calls, 2);
    h.manual_clock()
        .advance(std::time::Duration::from_secs(61 * 60));
    assert_eq!(h.org.period_spend(&solo).await.unwrap().model_calls, 0);
    // The hour rolled: solo may call again, the organization's third of the day.
    assert_eq!(ask(&mut h, "solo", 4).await.kind, ReplyKind::Answer);
    let day = Scope::Organization {
        period: Period::Day,
    };
    let spent = h.org.period_spend(&day).await.unwrap();
    assert_eq!((spent.model_calls, spent.total_tokens), (3, 36));
    let org_refused = ask(&mut h, "other", 5).await;
    assert_eq!(org_refused.kind, ReplyKind::Failure);
    assert!(
        org_refused.content.contains("the organization (last day)"),
        "{}",
        org_refused.content
    );
}

/// A request stopped at its limit of one model call (the chief delegated; nothing else ran) is
/// raised by an operator and resumed: the chief is told to go on, the tree runs to its answer,
/// and the request's spend counts both runs.
pub async fn an_operator_raises_a_request_limit_and_resumes_it(stores: Stores) {
    let llm = Arc::new(Tree::default());
    let mut h = OrgHarness::builder(TREE)
        .stores(stores.clone())
        .llm(llm.clone())
        .build()
        .await;
    h.org.start_all().await.unwrap();
    let one = Limits {
        model_calls: Some(1),
        ..Limits::NONE
    };
    let request = h
        .org
        .deliver(
            "chief",
            InboundMessage::new("portal", "u1", "launch plan").with_limits(one),
        )
        .await
        .unwrap();
    let reply = h.reply().await;
    assert_eq!(reply.kind, ReplyKind::Failure, "{reply:?}");
    h.wait_quiet().await;
    assert_eq!(llm.calls.load(Ordering::SeqCst), 1);
    let stopped = h.org.request_spend(&request).await.unwrap().unwrap();
    assert!(stopped.reached.is_some());

    let raised = Limits {
        model_calls: Some(20),
        ..Limits::NONE
    };
    h.org.set_request_limits(&request, raised).await.unwrap();
    h.org
        .resume_request(
            "chief",
            &request,
            InboundMessage::new("portal", "u1", "the limit was raised: go on"),
        )
        .await
        .unwrap();
    let reply = h.reply().await;
    assert_eq!(reply.kind, ReplyKind::Answer, "{reply:?}");
    assert_eq!(reply.content, "The launch plan is ready.");
    h.wait_quiet().await;
    let entry = h.org.request_spend(&request).await.unwrap().unwrap();
    assert_eq!(entry.settled.model_calls, 8, "{:?}", entry.settled);
    assert_eq!(entry.settled.model_calls, llm.calls.load(Ordering::SeqCst));
    assert!(entry.reached.is_none());
    // An unknown request cannot be resumed.
    let unknown = h
        .org
        .resume_request(
            "chief",
            &spacebot::EnvelopeId::new("no-such-request"),
            InboundMessage::new("portal", "u1", "go on"),
        )
        .await;
    assert!(unknown.is_err());
}

/// An operator limits an agent's hour to two calls at run time (the configuration limits
/// nothing): its third call after that is refused; the limit is stored, so it holds across a restart on the same
/// stores; cleared, the agent may call again.
pub async fn period_limits_set_at_run_time_hold_across_a_restart(stores: Stores) {
    let config = "[[agents]]\nid = \"solo\"\n";
    let llm = Arc::new(ok_llm());
    let clock = spacebot::ManualClock::new(1_000_000);
    let solo = Scope::Agent {
        agent: AgentId::parse("solo").unwrap(),
        period: Period::Hour,
    };
    let build = async |stores: &Stores| {
        let h = OrgHarness::builder(config)
            .stores(stores.clone())
            .llm(llm.clone())
            .manual_clock(clock.clone())
            .build()
            .await;
        h.org.start_all().await.unwrap();
        h
    };
    let mut h = build(&stores).await;
    assert_eq!(ask(&mut h, "solo", 1).await.kind, ReplyKind::Answer);
    assert!(
        h.org
            .set_period_limits(&Scope::Request, Some(Limits::NONE))
            .await
            .is_err(),
        "a request's limits are not a period's"
    );
    let nobody = Scope::Agent {
        agent: AgentId::parse("nobody").unwrap(),
        period: Period::Hour,
    };
    assert!(
        h.org
            .set_period_limits(&nobody, Some(Limits::NONE))
            .await
            .is_err()
    );
    let two = Limits {
        model_calls: Some(2),
        ..Limits::NONE
    };
    h.org.set_period_limits(&solo, Some(two)).await.unwrap();
    assert_eq!(h.org.period_limits(&solo).await.unwrap(), Some(two));
    // Nothing limited the organization before: the call made then was not counted (an
    // organization without limits keeps no ledger). Two more fit in the hour, not a third.
    assert_eq!(ask(&mut h, "solo", 2).await.kind, ReplyKind::Answer);
    assert_eq!(ask(&mut h, "solo", 3).await.kind, ReplyKind::Answer);
    let refused = ask(&mut h, "solo", 4).await;
    assert_eq!(refused.kind, ReplyKind::Failure, "{refused:?}");
    assert!(
        refused.content.contains("agent solo (last hour)")
            && refused.content.contains("model calls"),
        "{}",
        refused.content
    );
    h.org.shutdown().await.unwrap();
    drop(h);

    // Restarted on the same stores with the same configuration: the operator's limit holds.
    let mut h = build(&stores).await;
    let refused = ask(&mut h, "solo", 5).await;
    assert_eq!(
        refused.kind,
        ReplyKind::Failure,
        "forgotten on restart: {refused:?}"
    );
    assert_eq!(h.org.period_spend(&solo).await.unwrap().model_calls, 2);
    // Cleared: the configuration (no limit) applies again.
    h.org.set_period_limits(&solo, None).await.unwrap();
    assert_eq!(h.org.period_limits(&solo).await.unwrap(), None);
    assert_eq!(ask(&mut h, "solo", 6).await.kind, ReplyKind::Answer);
    h.org.shutdown().await.unwrap();
}
