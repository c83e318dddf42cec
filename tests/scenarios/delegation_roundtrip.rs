//! Delegation end to end on memory stores with scripted models: the round trip, failure, expired
//! leases, multi-hop, fan-out, idempotent notices, custom executors.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: failing loudly is the point

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::support::delegation::portal;
use super::support::{delegation::*, *};
use async_trait::async_trait;
use serde_json::json;
use spacebot::delegation::{
    DEFAULT_LEASE, LEASE_CHECK_INTERVAL, TaskContext, TaskExecutor, TaskOutcome,
};
use spacebot::event::EventKind;
use spacebot::testing::ScriptedLlm;
use spacebot::{ChannelId, LlmError, RecordKind, Stores, Task, TaskRef, TaskStatus};

fn delegate_call(target: &str, message: &str) -> serde_json::Value {
    json!({"target": target, "message": message})
}

pub async fn round_trip_from_user_to_target_and_back(stores: Stores) {
    let llm = Arc::new(ScriptedLlm::new());
    let (a, b) = (id("a"), id("b"));
    llm.push_tool_call(
        &a,
        "send_agent_message",
        delegate_call("Beta", "Pick a random word. Reply with the word only."),
    );
    llm.push_text(&b, "nebula");
    llm.push_text(&a, "Beta picked: nebula");
    let mut h = harness(stores, llm.clone(), "").await;

    let asked = h
        .org
        .deliver("a", user("Have Beta pick a random word"))
        .await
        .unwrap();
    let reply = h.reply().await;
    assert_eq!(reply.content, "Beta picked: nebula");
    assert_eq!(reply.channel, portal());
    assert_ne!(
        reply.in_reply_to,
        vec![asked],
        "the reply answers the retrigger, not the request"
    );

    // The task lives on the TARGET's board, with the delegation metadata.
    assert!(
        h.board("a").await.is_empty(),
        "nothing on the delegator's board"
    );
    let task = h.task("b", 1).await;
    assert_eq!(task.status, TaskStatus::Done);
    assert_eq!(task.created_by, "agent:a");
    assert_eq!(task.title, "Pick a random word.");
    assert_eq!(
        task.description,
        "Pick a random word. Reply with the word only."
    );
    assert_eq!(task.result.as_deref(), Some("nebula"));
    assert_eq!(task.metadata.delegated_by, Some(a.clone()));
    assert_eq!(task.metadata.originating_channel, Some(portal()));
    assert_eq!(
        task.metadata.link_id.as_ref().map(|l| l.as_str()),
        Some("a:b")
    );
    assert_eq!(task.metadata.delegation_chain, vec![a.clone()]);
    assert!(task.lease.is_none());

    // The target's model worked on the task as its input, in its own tool loop.
    let b_requests = llm.requests_for(&b);
    assert_eq!(b_requests.len(), 1);
    let input = last_user_text(&b_requests[0]);
    assert!(input.contains("task #1: Pick a random word."), "{input}");
    assert!(input.contains("Delegated by a"), "{input}");

    // The delegator's turn ended at the delegation; its model was woken by the retrigger.
    let a_requests = llm.requests_for(&a);
    assert_eq!(
        a_requests.len(),
        2,
        "one turn for the request, one for the retrigger"
    );
    let results = tool_results(&a_requests[0]);
    assert!(
        results.is_empty(),
        "the delegating turn ended without another model call"
    );
    assert_eq!(
        last_user_text(&a_requests[1]),
        "Beta completed task #1: nebula"
    );

    // Both link channels carry the assignment and the completion, as system records.
    for (owner, peer) in [("a", "b"), ("b", "a")] {
        let records = h
            .history(owner, &ChannelId::link(&id(owner), &id(peer)))
            .await;
        let texts: Vec<_> = records.iter().map(|r| r.record.content.as_str()).collect();
        assert_eq!(
            texts,
            vec![
                "a assigned task #1 to b: Pick a random word.",
                "b completed task #1: nebula"
            ],
            "{owner}'s side"
        );
        assert!(records.iter().all(|r| r.record.kind == RecordKind::System));
    }
    // The retrigger is in the originating channel's history and nowhere else on a's side.
    let portal_history = h.history("a", &portal()).await;
    assert_eq!(
        portal_history
            .iter()
            .filter(|r| r.record.content == "Beta completed task #1: nebula")
            .count(),
        1
    );

    // Events: created, claimed, completed, notice delivered, in that order.
    let kinds: Vec<_> = h
        .events
        .kinds()
        .into_iter()
        .filter(|k| {
            matches!(
                k,
                EventKind::TaskCreated { .. }
                    | EventKind::TaskClaimed { .. }
                    | EventKind::TaskCompleted
                    | EventKind::NoticeDelivered { .. }
            )
        })
        .collect();
    assert!(matches!(
        kinds[0],
        EventKind::TaskCreated {
            status: TaskStatus::Ready,
            ..
        }
    ));
    assert!(matches!(kinds[1], EventKind::TaskClaimed { .. }));
    assert_eq!(kinds[2], EventKind::TaskCompleted);
    assert_eq!(
        kinds[3],
        EventKind::NoticeDelivered {
            key: "b#1:done".into()
        }
    );
    assert_eq!(kinds.len(), 4);
    assert!(h.stores.tasks.outbox_pending(&b).await.unwrap().is_empty());
}

pub async fn a_failing_worker_is_requeued_until_max_attempts_then_the_notice_says_failed(
    stores: Stores,
) {
    let llm = Arc::new(ScriptedLlm::new());
    let (a, b) = (id("a"), id("b"));
    llm.push_tool_call(
        &a,
        "send_agent_message",
        delegate_call("b", "Count the stars."),
    );
    for _ in 0..3 {
        llm.push_error(&b, LlmError::Other("the model is down".into()));
    }
    llm.push_text(&a, "Sorry, Beta could not do it.");
    let mut h = harness(stores, llm.clone(), "").await;
    h.org
        .deliver("a", user("Ask Beta to count the stars"))
        .await
        .unwrap();
    let reply = h.reply().await;
    assert_eq!(reply.content, "Sorry, Beta could not do it.");

    let task = h.task("b", 1).await;
    assert_eq!(task.status, TaskStatus::Failed);
    assert_eq!(task.attempts, 3);
    assert_eq!(task.max_attempts, 3);
    assert!(
        task.error
            .as_deref()
            .unwrap_or("")
            .contains("the model is down"),
        "{task:?}"
    );
    assert_eq!(llm.requests_for(&b).len(), 3, "three attempts, no fourth");
    assert_eq!(h.count(|k| matches!(k, EventKind::TaskRequeued { .. })), 2);
    assert_eq!(h.count(|k| matches!(k, EventKind::TaskFailed { .. })), 1);
    assert_eq!(h.count(|k| matches!(k, EventKind::TaskClaimed { .. })), 3);

    let retrigger = last_user_text(&llm.requests_for(&a)[1]);
    assert!(
        retrigger.starts_with("Beta's worker failed on task #1: "),
        "{retrigger}"
    );
    assert!(retrigger.contains("the model is down"), "{retrigger}");
    let link = h.link_texts("a", "b").await;
    assert_eq!(link.len(), 2, "{link:?}");
    assert!(
        link[1].starts_with("b's worker failed on task #1: "),
        "{link:?}"
    );
}

/// An executor that answers with a script of outcomes, one per attempt; `Hang` never returns,
/// `Panic` panics (a crashed worker).
#[derive(Debug, Default)]
struct Scripted {
    steps: std::sync::Mutex<Vec<Step>>,
    calls: AtomicUsize,
}

#[derive(Debug, Clone)]
enum Step {
    Done(String),
    Fail(String),
    Hang,
    Panic,
}

impl Scripted {
    fn new(steps: Vec<Step>) -> Arc<Self> {
        Arc::new(Self {
            steps: std::sync::Mutex::new(steps.into_iter().rev().collect()),
            calls: AtomicUsize::new(0),
        })
    }
}

#[async_trait]
impl TaskExecutor for Scripted {
    async fn execute(
        &self,
        _ctx: TaskContext,
        task: Task,
    ) -> Result<TaskOutcome, spacebot_core::delegation::TaskError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let step = self.steps.lock().unwrap().pop();
        match step {
            Some(Step::Done(s)) => Ok(TaskOutcome::Done(format!("{s} ({})", task.title))),
            Some(Step::Fail(e)) => Err(e.into()),
            Some(Step::Hang) => futures::future::pending().await,
            Some(Step::Panic) => panic!("the worker crashed"),
            None => Err("no more steps".into()),
        }
    }
}

pub async fn a_custom_executor_runs_the_task_and_the_delegator_gets_its_result(stores: Stores) {
    let llm = Arc::new(ScriptedLlm::new());
    let (a, b) = (id("a"), id("b"));
    llm.push_tool_call(&a, "send_agent_message", delegate_call("b", "Sum 2 and 2."));
    llm.push_text(&a, "relayed");
    let exec = Scripted::new(vec![Step::Done("4".into())]);
    let mut h = harness_with(llm.clone(), "", stores, vec![(b.clone(), exec.clone())]).await;
    h.org.start_all().await.unwrap();
    h.org
        .deliver("a", user("What is 2 + 2? Ask Beta."))
        .await
        .unwrap();
    assert_eq!(h.reply().await.content, "relayed");
    assert_eq!(exec.calls.load(Ordering::SeqCst), 1);
    assert!(
        llm.requests_for(&b).is_empty(),
        "the custom executor replaces b's model"
    );
    assert_eq!(
        h.task("b", 1).await.result.as_deref(),
        Some("4 (Sum 2 and 2.)")
    );
    assert_eq!(
        last_user_text(&llm.requests_for(&a)[1]),
        "Beta completed task #1: 4 (Sum 2 and 2.)"
    );
}

pub async fn custom_executor_errors_requeue_then_succeed(stores: Stores) {
    let llm = Arc::new(ScriptedLlm::new());
    let (a, b) = (id("a"), id("b"));
    llm.push_tool_call(&a, "send_agent_message", delegate_call("b", "Flaky work."));
    llm.push_text(&a, "ok");
    let exec = Scripted::new(vec![
        Step::Fail("try again".into()),
        Step::Done("fine".into()),
    ]);
    let mut h = harness_with(llm.clone(), "", stores, vec![(b.clone(), exec.clone())]).await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", user("go")).await.unwrap();
    h.reply().await;
    let task = h.task("b", 1).await;
    assert_eq!((task.status, task.attempts), (TaskStatus::Done, 1));
    assert_eq!(
        task.error.as_deref(),
        Some("try again"),
        "the last error is kept"
    );
    assert_eq!(exec.calls.load(Ordering::SeqCst), 2);
    assert_eq!(
        h.count(|k| matches!(k, EventKind::TaskRequeued { attempts: 1, reason } if reason == "try again")),
        1
    );
}

/// Advances the manual clock past the lease, then in check intervals until `pred` holds (fails
/// the test after the harness's timeout).
async fn expire_lease_until(h: &Harness, what: &str, pred: impl Fn(&Harness) -> bool) {
    h.manual_clock().advance(DEFAULT_LEASE);
    let deadline = tokio::time::Instant::now() + h.timeout;
    while !pred(h) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        h.manual_clock().advance(LEASE_CHECK_INTERVAL);
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// Waits until `exec` was called `n` times.
async fn wait_calls(h: &Harness, exec: &Scripted, n: usize) {
    h.wait_until("the executor's calls", || {
        let calls = exec.calls.load(Ordering::SeqCst);
        async move { calls >= n }
    })
    .await;
}

pub async fn an_expired_lease_is_requeued_and_the_task_runs_again(stores: Stores) {
    let llm = Arc::new(ScriptedLlm::new());
    let (a, b) = (id("a"), id("b"));
    llm.push_tool_call(&a, "send_agent_message", delegate_call("b", "Slow work."));
    llm.push_text(&a, "ok");
    let exec = Scripted::new(vec![Step::Hang, Step::Done("second try".into())]);
    let mut h = harness_with(
        llm.clone(),
        "task_concurrency = 2",
        stores,
        vec![(b.clone(), exec.clone())],
    )
    .await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", user("go")).await.unwrap();
    h.wait_count("the first claim", 1, |k| {
        matches!(k, EventKind::TaskClaimed { .. })
    })
    .await;
    wait_calls(&h, &exec, 1).await;
    assert_eq!(h.task("b", 1).await.status, TaskStatus::InProgress);
    expire_lease_until(&h, "the requeue", |h| {
        h.count(|k| matches!(k, EventKind::TaskRequeued { .. })) >= 1
    })
    .await;
    h.reply().await;
    let task = h.task("b", 1).await;
    assert_eq!(task.status, TaskStatus::Done);
    assert_eq!(task.attempts, 1);
    assert!(
        task.error
            .as_deref()
            .unwrap_or("")
            .contains("lease expired"),
        "{task:?}"
    );
    assert_eq!(task.result.as_deref(), Some("second try (Slow work.)"));
}

pub async fn a_crashed_worker_frees_its_slot_and_the_task_runs_again_after_its_lease(
    stores: Stores,
) {
    let llm = Arc::new(ScriptedLlm::new());
    let (a, b) = (id("a"), id("b"));
    llm.push_tool_call(
        &a,
        "send_agent_message",
        delegate_call("b", "Fragile work."),
    );
    llm.push_text(&a, "ok");
    let exec = Scripted::new(vec![Step::Panic, Step::Done("recovered".into())]);
    // One slot: the crashed attempt must give it back, or the task never runs again.
    let mut h = harness_with(llm.clone(), "", stores, vec![(b.clone(), exec.clone())]).await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", user("go")).await.unwrap();
    h.wait_count("the first claim", 1, |k| {
        matches!(k, EventKind::TaskClaimed { .. })
    })
    .await;
    wait_calls(&h, &exec, 1).await;
    expire_lease_until(&h, "the second attempt", |h| {
        h.count(|k| matches!(k, EventKind::TaskClaimed { .. })) >= 2
    })
    .await;
    h.reply().await;
    let task = h.task("b", 1).await;
    assert_eq!((task.status, task.attempts), (TaskStatus::Done, 1));
    assert_eq!(task.result.as_deref(), Some("recovered (Fragile work.)"));
}

/// An executor whose attempts each wait for the test to release them with a result.
#[derive(Debug, Default)]
struct Gated {
    gates: std::sync::Mutex<Vec<futures::channel::oneshot::Sender<Result<TaskOutcome, String>>>>,
}

#[async_trait]
impl TaskExecutor for Gated {
    async fn execute(
        &self,
        _ctx: TaskContext,
        _task: Task,
    ) -> Result<TaskOutcome, spacebot_core::delegation::TaskError> {
        let (tx, rx) = futures::channel::oneshot::channel();
        self.gates.lock().unwrap().push(tx);
        rx.await
            .unwrap_or_else(|_| Err("gate dropped".into()))
            .map_err(spacebot_core::delegation::TaskError::from)
    }
}

impl Gated {
    fn open(&self, attempt: usize, outcome: Result<TaskOutcome, String>) {
        let mut gates = self.gates.lock().unwrap();
        let (tx, _) = futures::channel::oneshot::channel();
        let gate = std::mem::replace(&mut gates[attempt], tx);
        gate.send(outcome).unwrap();
    }
    fn attempts(&self) -> usize {
        self.gates.lock().unwrap().len()
    }
}

pub async fn a_stale_worker_cannot_complete_a_task_claimed_again_after_its_lease_expired(
    stores: Stores,
) {
    let llm = Arc::new(ScriptedLlm::new());
    let (a, b) = (id("a"), id("b"));
    llm.push_tool_call(
        &a,
        "send_agent_message",
        delegate_call("b", "Contended work."),
    );
    llm.push_text(&a, "ok");
    let exec = Arc::new(Gated::default());
    let mut h = harness_with(
        llm.clone(),
        "task_concurrency = 2",
        stores,
        vec![(b.clone(), exec.clone())],
    )
    .await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", user("go")).await.unwrap();
    h.wait_count("the first claim", 1, |k| {
        matches!(k, EventKind::TaskClaimed { .. })
    })
    .await;
    h.wait_until("the first attempt to run", || {
        let n = exec.attempts();
        async move { n >= 1 }
    })
    .await;
    let exec2 = exec.clone();
    expire_lease_until(&h, "the second claim", move |_| exec2.attempts() >= 2).await;
    // The first worker wakes up late: its lease was taken over, so its result is refused.
    exec.open(0, Ok(TaskOutcome::Done("stale".into())));
    h.wait_for("the stale result refused", |events| {
        events.iter().any(|e| {
            e.agent == b
                && matches!(&e.kind, EventKind::Error { message } if message.contains("b#1 not updated"))
        })
    })
    .await;
    assert_eq!(h.task("b", 1).await.status, TaskStatus::InProgress);
    exec.open(1, Ok(TaskOutcome::Done("fresh".into())));
    h.reply().await;
    let task = h.task("b", 1).await;
    assert_eq!(task.status, TaskStatus::Done);
    assert_eq!(task.result.as_deref(), Some("fresh"));
    assert_eq!(
        last_user_text(&llm.requests_for(&a)[1]),
        "Beta completed task #1: fresh"
    );
}

pub async fn multi_hop_waits_resumes_with_the_child_result_and_bubbles_up(stores: Stores) {
    let llm = Arc::new(ScriptedLlm::new());
    let (a, b, c) = (id("a"), id("b"), id("c"));
    llm.push_tool_call(
        &a,
        "send_agent_message",
        delegate_call("b", "Get me a random word from Gamma."),
    );
    llm.push_tool_call(
        &b,
        "send_agent_message",
        delegate_call("Gamma", "Pick a random word."),
    );
    llm.push_text(&c, "nebula");
    llm.push_text(&b, "Gamma's word is nebula");
    llm.push_text(&a, "The word is nebula");
    let mut h = harness(stores, llm.clone(), "").await;
    h.org
        .deliver("a", user("I want a random word"))
        .await
        .unwrap();
    assert_eq!(h.reply().await.content, "The word is nebula");

    let b_task = h.task("b", 1).await;
    let c_task = h.task("c", 1).await;
    assert_eq!(c_task.status, TaskStatus::Done);
    assert_eq!(c_task.created_by, "agent:b");
    assert_eq!(c_task.metadata.delegation_chain, vec![a.clone(), b.clone()]);
    assert_eq!(
        c_task.metadata.parent_task,
        Some(TaskRef::new(b.clone(), 1))
    );
    assert_eq!(b_task.status, TaskStatus::Done);
    assert_eq!(b_task.result.as_deref(), Some("Gamma's word is nebula"));
    assert_eq!(b_task.metadata.children.len(), 1);
    assert_eq!(b_task.metadata.children[0].ended, Some(TaskStatus::Done));
    assert_eq!(
        b_task.metadata.children[0].outcome.as_deref(),
        Some("nebula")
    );
    assert_eq!(b_task.attempts, 0, "waiting is not a failed attempt");

    // b's second turn on its task carried c's result.
    let b_requests = llm.requests_for(&b);
    assert_eq!(b_requests.len(), 2);
    let resumed = last_user_text(&b_requests[1]);
    assert!(resumed.contains("c#1 (done): nebula"), "{resumed}");
    // b was not woken by a retrigger in some channel: the child's end went to its task.
    assert_eq!(
        h.count(|k| matches!(k, EventKind::NoticeDelivered { .. })),
        2,
        "one notice per ended delegated task"
    );
    assert_eq!(
        last_user_text(&llm.requests_for(&a)[1]),
        "Beta completed task #1: Gamma's word is nebula"
    );
    // Each link records its own hop.
    assert_eq!(
        h.link_texts("b", "c").await,
        vec![
            "b assigned task #1 to c: Pick a random word.",
            "c completed task #1: nebula"
        ]
    );
    assert_eq!(h.link_texts("a", "b").await.len(), 2);
    assert!(
        h.link_texts("a", "c").await.is_empty(),
        "a and c never dealt directly"
    );
}

pub async fn fan_out_each_delegation_comes_back_independently(stores: Stores) {
    let llm = Arc::new(ScriptedLlm::new());
    let (a, b, c) = (id("a"), id("b"), id("c"));
    llm.push_tool_calls(
        &a,
        [
            ("send_agent_message", delegate_call("b", "First job.")),
            ("send_agent_message", delegate_call("b", "Second job.")),
            ("send_agent_message", delegate_call("c", "Third job.")),
        ],
    );
    llm.push_text(&b, "one");
    llm.push_text(&b, "two");
    llm.push_text(&c, "three");
    for n in 0..3 {
        llm.push_text(&a, &format!("relay {n}"));
    }
    let mut h = harness(stores, llm.clone(), "").await;
    h.org.deliver("a", user("three jobs please")).await.unwrap();
    let mut replies = Vec::new();
    for _ in 0..3 {
        replies.push(h.reply().await);
    }
    assert!(replies.iter().all(|r| r.channel == portal()));
    let mut woken: Vec<String> = llm.requests_for(&a)[1..]
        .iter()
        .map(last_user_text)
        .collect();
    woken.sort();
    assert_eq!(
        woken,
        vec![
            "Beta completed task #1: one",
            "Beta completed task #2: two",
            "Gamma completed task #1: three"
        ]
    );
    assert_eq!(h.board("b").await.len(), 2);
    assert_eq!(h.board("c").await.len(), 1);
    h.wait_quiet().await;
    assert!(h.replies_now().is_empty(), "exactly three replies");
}

/// A task store whose first `outbox_mark_sent` is lost (it answers Ok but marks nothing, as a
/// crash right after the delivery would lose it): the notice is delivered, then delivered again by
/// the next flush (at-least-once delivery). A mark that *fails* is tried again at once, so a
/// failure would not show the second delivery.
#[derive(Debug)]
struct ForgetfulOutbox {
    inner: Arc<dyn spacebot::TaskStore>,
    failures: AtomicUsize,
}

#[async_trait]
impl spacebot::TaskStore for ForgetfulOutbox {
    async fn create(
        &self,
        agent: &spacebot::AgentId,
        task: spacebot::NewTask,
        now: spacebot::Timestamp,
    ) -> Result<Task, spacebot::StoreError> {
        self.inner.create(agent, task, now).await
    }
    async fn get(
        &self,
        agent: &spacebot::AgentId,
        number: u64,
    ) -> Result<Option<Task>, spacebot::StoreError> {
        self.inner.get(agent, number).await
    }
    async fn list(
        &self,
        agent: &spacebot::AgentId,
        filter: &spacebot::task::TaskFilter,
    ) -> Result<Vec<Task>, spacebot::StoreError> {
        self.inner.list(agent, filter).await
    }
    async fn transition(
        &self,
        agent: &spacebot::AgentId,
        number: u64,
        expect: spacebot::task::Expect,
        event: spacebot::task::TaskEvent,
        now: spacebot::Timestamp,
    ) -> Result<spacebot::task::Transition, spacebot::StoreError> {
        self.inner
            .transition(agent, number, expect, event, now)
            .await
    }
    async fn claim_next(
        &self,
        agent: &spacebot::AgentId,
        holder: &str,
        lease: std::time::Duration,
        now: spacebot::Timestamp,
    ) -> Result<Option<Task>, spacebot::StoreError> {
        self.inner.claim_next(agent, holder, lease, now).await
    }
    async fn requeue_expired(
        &self,
        agent: &spacebot::AgentId,
        now: spacebot::Timestamp,
    ) -> Result<Vec<spacebot::task::Transition>, spacebot::StoreError> {
        self.inner.requeue_expired(agent, now).await
    }
    async fn outbox_pending(
        &self,
        agent: &spacebot::AgentId,
    ) -> Result<Vec<spacebot::task::CompletionNotice>, spacebot::StoreError> {
        self.inner.outbox_pending(agent).await
    }
    async fn outbox_mark_sent(
        &self,
        agent: &spacebot::AgentId,
        key: &str,
    ) -> Result<(), spacebot::StoreError> {
        if self
            .failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Ok(());
        }
        self.inner.outbox_mark_sent(agent, key).await
    }
}

pub async fn a_notice_delivered_twice_is_applied_once(stores: Stores) {
    let llm = Arc::new(ScriptedLlm::new());
    let (a, b) = (id("a"), id("b"));
    llm.push_tool_call(&a, "send_agent_message", delegate_call("b", "Say hi."));
    llm.push_text(&a, "relayed once");
    llm.push_text(&a, "relayed twice (must not happen)");
    let mut stores = stores;
    stores.tasks = Arc::new(ForgetfulOutbox {
        inner: stores.tasks.clone(),
        failures: AtomicUsize::new(1),
    });
    let exec = Scripted::new(vec![Step::Done("hi".into())]);
    let mut h = harness_with(llm.clone(), "", stores, vec![(b.clone(), exec)]).await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", user("go")).await.unwrap();
    assert_eq!(h.reply().await.content, "relayed once");
    // The notice stayed in the outbox; the task loop's next flush delivers it a second time.
    h.org.flush_outbox(&b).await;
    h.wait_count("the second delivery", 2, |k| {
        matches!(k, EventKind::NoticeDelivered { .. })
    })
    .await;
    h.wait_quiet().await;
    assert!(h.stores.tasks.outbox_pending(&b).await.unwrap().is_empty());
    assert!(
        h.replies_now().is_empty(),
        "the second delivery must not wake the model"
    );
    assert_eq!(llm.requests_for(&a).len(), 2);
    assert_eq!(llm.remaining(&a), 1);
    for (owner, peer) in [("a", "b"), ("b", "a")] {
        assert_eq!(
            h.link_texts(owner, peer).await,
            vec![
                "a assigned task #1 to b: Say hi.",
                "b completed task #1: hi (Say hi.)"
            ],
            "{owner}'s side holds each record once"
        );
    }
    let retriggers = h
        .history("a", &portal())
        .await
        .into_iter()
        .filter(|r| r.record.content.starts_with("Beta completed task #1"))
        .count();
    assert_eq!(retriggers, 1);
}

pub async fn a_notice_delivered_twice_while_the_delegator_works_is_applied_once(stores: Stores) {
    use spacebot::testing::{MockLlm, tool_call};
    let (llm, mut calls) = MockLlm::pair();
    let (a, b) = (id("a"), id("b"));
    let mut stores = stores;
    stores.tasks = Arc::new(ForgetfulOutbox {
        inner: stores.tasks.clone(),
        failures: AtomicUsize::new(1),
    });
    let exec = Arc::new(Gated::default());
    let mut h = harness_with(Arc::new(llm), "", stores, vec![(b.clone(), exec.clone())]).await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", user("delegate")).await.unwrap();
    next_call(&mut calls)
        .await
        .respond_tool_calls(vec![tool_call(
            "send_agent_message",
            json!({"target": "b", "message": "Work."}),
        )]);
    h.wait_count("the claim", 1, |k| {
        matches!(k, EventKind::TaskClaimed { .. })
    })
    .await;
    // a is busy with another message when the notice arrives, twice.
    h.org
        .deliver("a", user("meanwhile, list your board"))
        .await
        .unwrap();
    let busy = next_call(&mut calls).await;
    assert_eq!(busy.agent(), Some(&a));
    exec.open(0, Ok(TaskOutcome::Done("result".into())));
    h.wait_count("two deliveries", 2, |k| {
        matches!(k, EventKind::NoticeDelivered { .. })
    })
    .await;
    // The tool round ends at a checkpoint, where the queued notices steer the turn.
    busy.respond_tool_calls(vec![tool_call("task_list", json!({}))]);
    let steered = next_call(&mut calls).await;
    let text = last_user_text(&steered.request);
    assert_eq!(
        text.matches("Beta completed task #1: result").count(),
        1,
        "the duplicate notice must not reach the model: {text}"
    );
    steered.respond_text("Beta's result is in");
    let reply = h.reply().await;
    assert_eq!(reply.content, "Beta's result is in");
    // The interrupted message is answered next; nothing else wakes the model.
    next_call(&mut calls)
        .await
        .respond_text("your board is empty");
    h.reply().await;
    h.wait_quiet().await;
    assert!(calls.try_next().is_none(), "no further model call");
}

pub async fn a_retrigger_interrupted_by_a_steer_is_still_answered(stores: Stores) {
    use spacebot::testing::{MockLlm, tool_call};
    let (llm, mut calls) = MockLlm::pair();
    let b = id("b");
    let exec = Scripted::new(vec![Step::Done("done".into())]);
    let mut h = harness_with(Arc::new(llm), "", stores, vec![(b.clone(), exec)]).await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", user("delegate")).await.unwrap();
    next_call(&mut calls)
        .await
        .respond_tool_calls(vec![tool_call(
            "send_agent_message",
            json!({"target": "b", "message": "Work."}),
        )]);
    // The retrigger wakes a; while it works on it, the user writes again.
    let woken = next_call(&mut calls).await;
    assert_eq!(
        last_user_text(&woken.request),
        "Beta completed task #1: done (Work.)"
    );
    h.org.deliver("a", user("hurry up")).await.unwrap();
    woken.respond_tool_calls(vec![tool_call("task_list", json!({}))]);
    let steered = next_call(&mut calls).await;
    assert_eq!(last_user_text(&steered.request), "hurry up");
    steered.respond_text("on it");
    assert_eq!(h.reply().await.content, "on it");
    // The interrupted retrigger goes back to the queue and is answered: its idempotency key was
    // applied when it first ran, which must not make it look like a duplicate now.
    let resumed = tokio::time::timeout(std::time::Duration::from_secs(5), calls.next())
        .await
        .expect("the interrupted retrigger was dropped")
        .unwrap();
    assert!(
        last_user_text(&resumed.request).contains("Beta completed task #1: done (Work.)"),
        "{}",
        last_user_text(&resumed.request)
    );
    resumed.respond_text("Beta is done");
    assert_eq!(h.reply().await.content, "Beta is done");
}

pub async fn a_stopped_delegator_gets_its_notice_when_it_starts(stores: Stores) {
    let llm = Arc::new(ScriptedLlm::new());
    let (a, b) = (id("a"), id("b"));
    llm.push_text(&a, "caught up");
    let exec = Scripted::new(vec![Step::Done("late news".into())]);
    let mut h = harness_with(llm.clone(), "", stores, vec![(b.clone(), exec)]).await;
    h.org
        .delegate(
            &a,
            "b",
            "Tell me later.",
            spacebot::delegation::DelegationOrigin {
                channel: portal(),
                task: None,
                round: 0,
                cause: None,
                key: None,
            },
        )
        .await
        .unwrap();
    h.org.start_agent(&b).await.unwrap();
    h.wait_kinds("the notice", |ev| {
        ev.iter()
            .any(|k| matches!(k, EventKind::NoticeDelivered { .. }))
    })
    .await;
    assert_eq!(h.count(|k| *k == EventKind::DeliveryPersisted), 1);
    assert!(llm.requests_for(&a).is_empty(), "a is not running");
    h.org.start_agent(&a).await.unwrap();
    assert_eq!(h.reply().await.content, "caught up");
    assert_eq!(
        last_user_text(&llm.requests_for(&a)[0]),
        "Beta completed task #1: late news (Tell me later.)"
    );
}

pub async fn a_long_result_is_quoted_in_part_and_kept_whole_on_the_task(stores: Stores) {
    use spacebot::delegation::RETRIGGER_RESULT_CHARS;
    let llm = Arc::new(ScriptedLlm::new());
    let (a, b) = (id("a"), id("b"));
    llm.push_tool_call(
        &a,
        "send_agent_message",
        delegate_call("b", "Write a long report."),
    );
    let report = "é".repeat(RETRIGGER_RESULT_CHARS + 500);
    llm.push_text(&b, &report);
    llm.push_text(&a, "summarized");
    let mut h = harness(stores, llm.clone(), "").await;
    h.org.deliver("a", user("report please")).await.unwrap();
    h.reply().await;
    assert_eq!(
        h.task("b", 1).await.result.as_deref(),
        Some(report.as_str())
    );
    let woken = last_user_text(&llm.requests_for(&a)[1]);
    assert!(
        woken.len() < report.len(),
        "the retrigger quotes part of the result"
    );
    assert_eq!(woken.matches('é').count(), RETRIGGER_RESULT_CHARS);
    assert!(woken.contains("the full result is on task b#1"), "{woken}");
}

pub async fn a_long_task_turn_renews_its_lease_at_every_checkpoint(stores: Stores) {
    let (llm, mut calls) = spacebot::testing::MockLlm::pair();
    let (a, b) = (id("a"), id("b"));
    let mut h = harness(stores, Arc::new(llm), "").await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", user("go")).await.unwrap();
    let call = next_call(&mut calls).await;
    assert_eq!(call.agent(), Some(&a));
    call.respond_tool_calls(vec![spacebot::testing::tool_call(
        "send_agent_message",
        delegate_call("b", "Long work."),
    )]);
    // b works on the task for three lease periods, one tool round per period.
    for _ in 0..3 {
        let call = next_call(&mut calls).await;
        assert_eq!(call.agent(), Some(&b));
        h.manual_clock()
            .advance(DEFAULT_LEASE - LEASE_CHECK_INTERVAL - std::time::Duration::from_secs(1));
        let renewed_until = spacebot::Clock::now(h.manual_clock()).plus(DEFAULT_LEASE);
        call.respond_tool_calls(vec![spacebot::testing::tool_call(
            "task_list",
            serde_json::json!({}),
        )]);
        // The checkpoint after the tool round renews the lease from now.
        h.wait_until("the lease renewed", || async {
            let task = h.task("b", 1).await;
            task.lease.is_some_and(|l| l.expires_at >= renewed_until)
        })
        .await;
        // The lease check runs and finds the lease renewed, not expired.
        h.manual_clock().advance(LEASE_CHECK_INTERVAL);
        assert_eq!(h.task("b", 1).await.status, TaskStatus::InProgress);
    }
    let call = next_call(&mut calls).await;
    assert_eq!(call.agent(), Some(&b));
    call.respond_text("finished");
    let call = next_call(&mut calls).await;
    assert_eq!(call.agent(), Some(&a));
    call.respond_text("b finished");
    assert_eq!(h.reply().await.content, "b finished");
    let task = h.task("b", 1).await;
    assert_eq!((task.status, task.attempts), (TaskStatus::Done, 0));
    assert_eq!(h.count(|k| matches!(k, EventKind::TaskRequeued { .. })), 0);
}
