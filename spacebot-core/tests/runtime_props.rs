//! Property test of the per-agent queue and steer-backlog over random interleavings of external
//! and internal producers and random checkpoint positions, with the turn-by-turn mock LLM and the
//! manual clock.
//!
//! A model of the queue predicts, at every step, what the agent's loop must present to the model and
//! what each reply must answer. On top of agreeing with the model, the run must show: no envelope
//! lost, none answered twice, each producer's envelopes taken in the order sent, an interrupted
//! envelope answered after the reply to what interrupted it (by the same turn: a steer never runs
//! an envelope twice), and never two model calls of the agent at the same time.

// Helpers outside #[test] functions assert too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use proptest::prelude::*;
use serde_json::json;
use spacebot_core::testing::tools::EchoTool;
use spacebot_core::testing::{
    MockLlm, MockLlmHandle, OrgHarness, PendingCall, agent as id, last_user_text, orgs, tool_call,
};
use spacebot_core::{
    Clock, EnvelopeId, InboundMessage, InternalMessage, ManualClock, NewTask, TaskRef, TaskStatus,
};

#[derive(Debug, Clone)]
enum Step {
    /// Producer 0 and 1 are external users, 2 is agent b over the internal channel, 3 is a task on
    /// a's own board (approved, claimed by a's task loop, run as a turn of its own).
    Send(usize),
    /// Answer the pending model call with a tool call: a checkpoint follows.
    Tool,
    /// Answer the pending model call with a final text.
    Text,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0usize..4).prop_map(Step::Send),
        2 => Just(Step::Tool),
        2 => Just(Step::Text),
    ]
}

fn last_user(call: &PendingCall) -> String {
    last_user_text(&call.request.messages)
}

/// Lets the agent's loop run until it waits again (on the model or on its queue).
async fn settle() {
    for _ in 0..64 {
        tokio::task::yield_now().await;
    }
}

/// An envelope as the model sees it: id, raw text, the line it gets in a merged message, and its
/// producer (which is its channel).
type Item = (EnvelopeId, String, String, usize);

/// The turn as a stack of frames: the bottom one is the envelope the turn started with, each steer
/// pushes the envelopes that arrived; the model answers the top frame, then resumes the one below.
struct Model {
    queue: VecDeque<Item>,
    stack: Vec<Vec<Item>>,
}

impl Model {
    fn top(&self) -> &[Item] {
        self.stack.last().map(Vec::as_slice).unwrap_or(&[])
    }

    fn expected_prompt(&self) -> String {
        let top = self.top();
        if top.len() == 1 {
            return top[0].1.clone();
        }
        top.iter()
            .enumerate()
            .map(|(i, (_, _, label, _))| format!("[{}] {label}", i + 1))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

async fn take_call(
    calls: &mut MockLlmHandle,
    model: &mut Model,
    pending: &mut Option<PendingCall>,
) {
    settle().await;
    let call = calls.try_next();
    if pending.is_some() {
        assert!(
            call.is_none(),
            "two model calls of one agent at the same time"
        );
        return;
    }
    if model.stack.is_empty()
        && let Some(next) = model.queue.pop_front()
    {
        model.stack.push(vec![next]);
    }
    match (call, model.stack.is_empty()) {
        (None, true) => {}
        (Some(call), false) => {
            let text = last_user(&call);
            for line in model.expected_prompt().lines() {
                assert!(text.contains(line), "model saw {text:?}, expected {line:?}");
            }
            *pending = Some(call);
        }
        (None, false) => panic!("the agent did not take {:?}", model.top()),
        (Some(call), true) => panic!("unexpected model call: {:?}", last_user(&call)),
    }
}

async fn run(steps: Vec<Step>) {
    let (llm, mut calls) = MockLlm::pair();
    let settings = "queue_capacity = 1000\ntask_concurrency = 1000";
    let mut h = OrgHarness::builder(orgs::with_settings(settings, orgs::RUNTIME))
        .llm(Arc::new(llm))
        .manual_clock(ManualClock::new(1_000))
        .tool(Arc::new(EchoTool))
        .build()
        .await;
    let (a, b) = (id("a"), id("b"));
    h.org.start_agent(&a).await.unwrap();
    let mut model = Model {
        queue: VecDeque::new(),
        stack: Vec::new(),
    };
    let mut pending: Option<PendingCall> = None;
    let mut expected_replies: Vec<Vec<EnvelopeId>> = Vec::new();
    let mut sent: Vec<(usize, EnvelopeId)> = Vec::new();
    let mut tasks: Vec<TaskRef> = Vec::new();
    let mut counter = 0;

    // Run the steps, then answer with text until everything is answered.
    let tail = std::iter::repeat_n(Step::Text, 200);
    for step in steps.into_iter().chain(tail) {
        if matches!(step, Step::Text)
            && pending.is_none()
            && model.queue.is_empty()
            && model.stack.is_empty()
        {
            break;
        }
        match step {
            Step::Send(p) => {
                counter += 1;
                let text = format!("m{counter}");
                let (id, label) = if p == 3 {
                    let mut new = NewTask::new(text.clone(), text.clone());
                    new.status = TaskStatus::PendingApproval;
                    let task = h
                        .org
                        .stores()
                        .tasks
                        .create(&a, new, h.manual_clock().now())
                        .await
                        .unwrap();
                    h.org.approve_task(&task.task_ref()).await.unwrap();
                    tasks.push(task.task_ref());
                    (
                        EnvelopeId::new(format!("task-{text}")),
                        format!("task {text}"),
                    )
                } else if p < 2 {
                    let msg = InboundMessage::new("portal", format!("u{p}"), text.clone());
                    (
                        h.org.deliver("a", msg).await.unwrap(),
                        format!("user (portal): {text}"),
                    )
                } else {
                    // b may only answer inside an exchange a started (their link is one-way).
                    h.org
                        .send_internal(&a, &b, InternalMessage::task("report back"))
                        .await
                        .unwrap();
                    let msg = InternalMessage::announce(text.clone());
                    (
                        h.org.send_internal(&b, &a, msg).await.unwrap(),
                        format!("agent b: {text}"),
                    )
                };
                sent.push((p, id.clone()));
                model.queue.push_back((id, text, label, p));
            }
            Step::Tool => {
                let Some(call) = pending.take() else { continue };
                call.respond_tool_calls(vec![tool_call("echo", json!({"text": "x"}))]);
                // Everything that arrived steers, except tasks: those wait, in order, for turns
                // of their own. The model answers the steer next, then resumes.
                let (waiting, fresh): (Vec<Item>, Vec<Item>) =
                    model.queue.drain(..).partition(|item| item.3 == 3);
                model.queue.extend(waiting);
                if !fresh.is_empty() {
                    model.stack.push(fresh);
                }
            }
            Step::Text => {
                let Some(call) = pending.take() else { continue };
                call.respond_text("answer");
                // One reply per channel (producer), in arrival order.
                let frame = model.stack.pop().unwrap_or_default();
                let mut groups: Vec<(usize, Vec<EnvelopeId>)> = Vec::new();
                for (id, _, _, p) in frame {
                    if p == 3 {
                        // A task's answer is its result, not a reply.
                        continue;
                    }
                    match groups.iter_mut().find(|(q, _)| *q == p) {
                        Some((_, ids)) => ids.push(id),
                        None => groups.push((p, vec![id])),
                    }
                }
                expected_replies.extend(groups.into_iter().map(|(_, ids)| ids));
            }
        }
        take_call(&mut calls, &mut model, &mut pending).await;
    }
    assert!(
        pending.is_none() && model.queue.is_empty(),
        "work left over"
    );

    let mut replies = Vec::new();
    while let Ok(reply) = h.replies.try_recv() {
        replies.push(reply.in_reply_to);
    }
    assert_eq!(replies, expected_replies, "replies differ from the model");

    // Independent of the model: each envelope answered exactly once ...
    let mut answered: HashMap<EnvelopeId, usize> = HashMap::new();
    for (i, ids) in replies.iter().enumerate() {
        for id in ids {
            assert!(
                answered.insert(id.clone(), i).is_none(),
                "{id} answered twice"
            );
        }
    }
    let messages = sent.iter().filter(|(p, _)| *p != 3).count();
    assert_eq!(answered.len(), messages, "an envelope was lost");
    // ... every task ran once, as a turn of its own, and its result is that turn's answer ...
    for task in &tasks {
        h.wait_for("the task's end", |events| {
            events.iter().any(|e| {
                e.task.as_ref() == Some(task)
                    && matches!(e.kind, spacebot_core::event::EventKind::TaskCompleted)
            })
        })
        .await;
        let done = h.org.task(task).await.unwrap().unwrap();
        assert_eq!(done.status, TaskStatus::Done, "{task}");
        assert_eq!(done.result.as_deref(), Some("answer"), "{task}");
        assert_eq!(done.attempts, 0, "{task} ran more than once");
    }
    // ... and each producer's envelopes first presented to the model in the order sent.
    let mut taken = Vec::new();
    for request in calls.requests() {
        let text = last_user_text(&request.messages);
        for n in 1..=counter {
            let tag = format!("m{n}");
            let present = text
                .split(|c: char| !c.is_ascii_alphanumeric())
                .any(|w| w == tag);
            if present && !taken.contains(&n) {
                taken.push(n);
            }
        }
    }
    for p in 0..4 {
        let order: Vec<usize> = taken
            .iter()
            .copied()
            .filter(|n| sent[n - 1].0 == p)
            .collect();
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(order, sorted, "producer {p} reordered");
    }
    h.org.shutdown().await.unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn steering_never_loses_duplicates_or_reorders(steps in prop::collection::vec(step(), 1..40)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        rt.block_on(run(steps));
    }
}
