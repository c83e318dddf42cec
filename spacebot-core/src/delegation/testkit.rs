//! What the unit tests of the delegation modules share: a small organization on the memory stores,
//! the scripted mock LLM and a manual clock, and the helpers to reach into it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use super::DelegationOrigin;
use crate::ids::{AgentId, ChannelId, EnvelopeId};
use crate::task::{Task, TaskFilter};
use crate::testing::{OrgHarness, ScriptedLlm};
use crate::time::ManualClock;
use crate::tools::ToolContext;

/// Four agents: `a` (Alpha) is the superior of `b` (Beta), `b` the superior of `c` (Gamma); `c`
/// and `a` are peers, so a chain a -> b -> c -> a can be tried; `x` (Xeno) has no link at all.
/// `settings` goes into `[settings]`.
fn config(settings: &str) -> String {
    format!(
        r#"
[settings]
{settings}

[[agents]]
id = "a"
name = "Alpha"

[[agents]]
id = "b"
name = "Beta"

[[agents]]
id = "c"
name = "Gamma"

[[agents]]
id = "x"
name = "Xeno"

[[links]]
from = "a"
to = "b"
relationship = "superior"

[[links]]
from = "b"
to = "c"
relationship = "superior"

[[links]]
from = "c"
to = "a"
"#
    )
}

/// The organization of [`config`] on fresh memory stores, with a manual clock and a scripted
/// model (nothing scripted yet, no fallback: an unexpected model call fails its turn). Nothing is
/// started.
pub(super) async fn harness(settings: &str) -> (OrgHarness, ScriptedLlm) {
    harness_with(settings, Vec::new()).await
}

/// [`harness`], with custom executors for some agents.
pub(super) async fn harness_with(
    settings: &str,
    executors: Vec<(&str, Arc<dyn super::TaskExecutor>)>,
) -> (OrgHarness, ScriptedLlm) {
    let llm = ScriptedLlm::new();
    let mut builder = OrgHarness::builder(config(settings))
        .llm(Arc::new(llm.clone()))
        .manual_clock(ManualClock::new(1_000));
    for (agent, executor) in executors {
        builder = builder.executor(agent, executor);
    }
    (builder.build().await, llm)
}

/// An agent id.
pub(super) fn id(s: &str) -> AgentId {
    AgentId::parse(s).unwrap()
}

/// The channel a user's request arrived on.
pub(super) fn portal() -> ChannelId {
    ChannelId::new("portal:u1")
}

/// A delegation from [`portal`], outside any task.
pub(super) fn origin() -> DelegationOrigin {
    DelegationOrigin::new(portal())
}

/// A delegation from the task `task` its worker is running.
pub(super) fn origin_in(task: &Task) -> DelegationOrigin {
    DelegationOrigin {
        task: Some(task.task_ref()),
        ..DelegationOrigin::new(ChannelId::new(format!("task:{}", task.task_ref())))
    }
}

/// Claims `agent`'s next ready task for `holder` in the store, as a worker would.
pub(super) async fn claim(h: &OrgHarness, agent: &str, holder: &str) -> Task {
    let now = h.org.clock().now();
    h.stores
        .tasks
        .claim_next(&id(agent), holder, super::DEFAULT_LEASE, now)
        .await
        .unwrap()
        .expect("a ready task to claim")
}

/// Every task on `agent`'s board.
pub(super) async fn board(h: &OrgHarness, agent: &str) -> Vec<Task> {
    h.stores
        .tasks
        .list(&id(agent), &TaskFilter::default())
        .await
        .unwrap()
}

/// The context a tool of `agent` runs in, answering a message in [`portal`].
pub(super) fn tool_context(h: &OrgHarness, agent: &str) -> ToolContext {
    ToolContext {
        cause: EnvelopeId::new("cause-1"),
        key: "cause-1:0:0".into(),
        ..h.org.tool_context(&id(agent), portal())
    }
}

/// A custom executor answering attempt `n` (from 1) with `answer(n)`; `None` hangs for ever (a
/// worker that never returns).
#[derive(Debug)]
pub(super) struct Attempts {
    calls: std::sync::atomic::AtomicU32,
    answer: fn(u32) -> Option<Result<super::TaskOutcome, super::TaskError>>,
}

impl Attempts {
    pub(super) fn new(
        answer: fn(u32) -> Option<Result<super::TaskOutcome, super::TaskError>>,
    ) -> Arc<Self> {
        Arc::new(Self {
            calls: std::sync::atomic::AtomicU32::new(0),
            answer,
        })
    }

    /// How many attempts started.
    pub(super) fn calls(&self) -> u32 {
        self.calls.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[async_trait::async_trait]
impl super::TaskExecutor for Attempts {
    async fn execute(
        &self,
        _ctx: super::TaskContext,
        _task: Task,
    ) -> Result<super::TaskOutcome, super::TaskError> {
        let n = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        match (self.answer)(n) {
            Some(result) => result,
            None => futures::future::pending().await,
        }
    }
}

/// Waits until task `number` of `agent` is in `status` (fails the test after the harness'
/// timeout), and returns it.
pub(super) async fn wait_status(
    h: &OrgHarness,
    agent: &str,
    number: u64,
    status: crate::task::TaskStatus,
) -> Task {
    let what = format!("{agent}#{number} {status}");
    h.wait_until(&what, || async {
        h.stores
            .tasks
            .get(&id(agent), number)
            .await
            .unwrap()
            .is_some_and(|t| t.status == status)
    })
    .await;
    h.stores
        .tasks
        .get(&id(agent), number)
        .await
        .unwrap()
        .unwrap()
}
