//! Spacebot's A2A client against an agent no one here wrote: a small remote agent on PyPI
//! `a2a-sdk`'s server (`tests/fixtures/a2a_server.py`, on 127.0.0.1), declared as a member of
//! the organization and delegated to: the result reaches the delegator; an organization SIGKILLed
//! mid-task and restarted resumes the task and the remote agent receives the message once (killed
//! after the remote task's id was stored, or before); a remote agent killed mid-task is tried again, then the task fails and the
//! delegator is told; a link that is disabled refuses the delegation.
//!
//! Needs SPACEBOT_PYTHON (a Python with PyPI's `a2a-sdk`, made by `.ci/python`); where
//! neither it nor `.ci/python`'s environment is at hand the tests are compiled as ignored, with the
//! reason (`cfg(spacebot_python)`, set by the build script), unless SPACEBOT_REQUIRE_PYTHON=1 (CI),
//! when they run and fail without it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use spacebot_a2a::{A2a, REMOTE_NAMESPACE, RetryPolicy, remote_executors};
use spacebot_core::delegation::DelegationOrigin;
use spacebot_core::records::{Record, RecordStore, RecordWrite, WriteOutcome};
use spacebot_core::task::TaskStatus;
use spacebot_core::testing::external::python;
use spacebot_core::testing::{OrgHarness, ScriptedLlm};
use spacebot_core::{
    AgentId, ChannelId, ChatMessage, EventKind, InboundMessage, OrgConfig, StoreError, Stores,
};
use tokio::io::AsyncBufReadExt;

const TOKEN: &str = "remote-token";

fn agent(id: &str) -> AgentId {
    AgentId::parse(id).unwrap()
}

/// The fixture server (killed on drop) and its base URL.
async fn remote(python: &str, slow_seconds: &str) -> (tokio::process::Child, String) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/a2a_server.py");
    let mut child = tokio::process::Command::new(python)
        .arg(script)
        .arg(TOKEN)
        .arg(slow_seconds)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await
        .expect("the fixture printed its port in time")
        .unwrap()
        .expect("a PORT line");
    let port: u16 = line.trim_start_matches("PORT ").trim().parse().unwrap();
    let base = format!("http://127.0.0.1:{port}");
    // Ready once the card is served.
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while http
        .get(format!("{base}/.well-known/agent-card.json"))
        .send()
        .await
        .is_err()
    {
        assert!(
            Instant::now() < deadline,
            "the fixture never served its card"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (child, base)
}

/// How many times the remote received each message id.
async fn received(base: &str) -> BTreeMap<String, u64> {
    reqwest::get(format!("{base}/count"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

fn org(url: &str, link_enabled: bool) -> String {
    format!(
        r#"
[[agents]]
id = "boss"
[[agents]]
id = "far"
a2a = "{url}"
token = "{TOKEN}"
[[links]]
from = "boss"
to = "far"
relationship = "superior"
enabled = {link_enabled}
"#
    )
}

async fn harness(
    config: &str,
    llm: &ScriptedLlm,
    stores: Option<Stores>,
    retry: &RetryPolicy,
) -> OrgHarness {
    let a2a = A2a::new();
    let mut builder = OrgHarness::builder(config)
        .llm(Arc::new(llm.clone()))
        .behaviour(Arc::new(a2a.clone()));
    if let Some(stores) = stores {
        builder = builder.stores(stores);
    }
    for (id, executor) in
        remote_executors(&OrgConfig::from_toml_str(config).unwrap(), retry).unwrap()
    {
        builder = builder.executor(id.as_str(), executor);
    }
    let mut h = builder.build().await;
    h.timeout = Duration::from_secs(30);
    h
}

/// The texts the model was shown in `agent`'s last request.
fn last_request_text(llm: &ScriptedLlm, id: &str) -> String {
    let requests = llm.requests_for(&agent(id));
    let Some(last) = requests.last() else {
        return String::new();
    };
    format!("{:?}", last.messages)
}

async fn wait_task(h: &OrgHarness, status: TaskStatus) -> spacebot_core::Task {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(task) = h.stores.tasks.get(&agent("far"), 1).await.unwrap()
            && task.status == status
        {
            return task;
        }
        assert!(Instant::now() < deadline, "far#1 never became {status:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

fn script_delegation(llm: &ScriptedLlm, question: &str, after: &str) {
    let boss = agent("boss");
    llm.push_tool_call(
        &boss,
        "send_agent_message",
        json!({"target": "far", "message": question}),
    );
    llm.push_text(&boss, "asked far");
    llm.push_text(&boss, after);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_python),
    ignore = "no Python with the protocol kits here: set SPACEBOT_PYTHON (see .ci/python); see README"
)]
async fn the_remote_agents_answer_reaches_the_delegator() {
    let python = python();
    let (_server, base) = remote(&python, "0").await;
    let llm = ScriptedLlm::new();
    script_delegation(&llm, "what is far away?", "far answered");
    let h = harness(&org(&base, true), &llm, None, &RetryPolicy::default()).await;
    h.org.start_all().await.unwrap();
    h.org
        .deliver("boss", InboundMessage::new("portal", "u1", "ask far"))
        .await
        .unwrap();
    let task = wait_task(&h, TaskStatus::Done).await;
    assert_eq!(
        task.result.as_deref(),
        Some("remote answer to: what is far away?")
    );
    h.wait_until("boss was told the result", || async {
        last_request_text(&llm, "boss").contains("remote answer to: what is far away?")
    })
    .await;
    let counts = received(&base).await;
    assert_eq!(counts.len(), 1, "{counts:?}");
    assert!(
        counts.keys().all(|k| k.starts_with("spacebot-far-1-")),
        "{counts:?}"
    );
    assert!(
        llm.requests_for(&agent("far")).is_empty(),
        "far has no model here"
    );
    h.org.shutdown().await.unwrap();
}

/// Set in the first life of the SIGKILL tests (this test binary again): the data directory.
const CHILD_DIR: &str = "SPACEBOT_A2A_CHILD_DIR";
/// Set in the first life: the remote agent's base URL.
const CHILD_REMOTE: &str = "SPACEBOT_A2A_CHILD_REMOTE";
/// Set to `1` in the first life: the remote task's id is never stored (its write hangs), so the
/// kill falls between the remote accepting the message and the record of it.
const CHILD_HOLD: &str = "SPACEBOT_A2A_CHILD_HOLD";

/// Whether a [`HoldRemoteWrites`] holds a write.
static HELD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A record store whose writes of the remote tasks' ids never finish: they say `HOLDING` on
/// stdout and wait forever, as a process killed in that moment would.
#[derive(Debug)]
struct HoldRemoteWrites(Arc<dyn RecordStore>);

#[async_trait::async_trait]
impl RecordStore for HoldRemoteWrites {
    async fn get(&self, namespace: &str, key: &str) -> Result<Option<Record>, StoreError> {
        self.0.get(namespace, key).await
    }
    async fn version(
        &self,
        namespace: &str,
        key: &str,
        version: u64,
    ) -> Result<Option<Record>, StoreError> {
        self.0.version(namespace, key, version).await
    }
    async fn write(&self, write: RecordWrite) -> Result<WriteOutcome, StoreError> {
        if write.namespace == REMOTE_NAMESPACE {
            println!("HOLDING");
            HELD.store(true, std::sync::atomic::Ordering::SeqCst);
            futures::future::pending::<()>().await;
        }
        self.0.write(write).await
    }
    async fn list(&self, namespace: &str, prefix: &str) -> Result<Vec<Record>, StoreError> {
        self.0.list(namespace, prefix).await
    }
    async fn history(&self, namespace: &str, key: &str) -> Result<Vec<Record>, StoreError> {
        self.0.history(namespace, key).await
    }
    async fn release(&self) {
        self.0.release().await;
    }
}

/// The first life of the SIGKILL tests, run by them as a child process and killed once the
/// remote agent received the message: the boss delegates a held question to far; far's executor
/// sends it; `READY` once the remote task's id is stored (or, with [`CHILD_HOLD`], once its write
/// hangs) and the boss's turn is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child process of the SIGKILL tests"]
async fn a2a_child() {
    let (Ok(dir), Ok(base)) = (std::env::var(CHILD_DIR), std::env::var(CHILD_REMOTE)) else {
        panic!("run by the SIGKILL tests only");
    };
    let hold = std::env::var(CHILD_HOLD).as_deref() == Ok("1");
    let mut stores = spacebot_sqlite::open(&dir).await.unwrap();
    if hold {
        stores.records = Arc::new(HoldRemoteWrites(stores.records.clone()));
    }
    let llm = ScriptedLlm::new();
    let boss = agent("boss");
    llm.push_tool_call(
        &boss,
        "send_agent_message",
        json!({"target": "far", "message": "a held question"}),
    );
    llm.push_text(&boss, "asked far");
    let h = harness(
        &org(&base, true),
        &llm,
        Some(stores),
        &RetryPolicy::default(),
    )
    .await;
    h.org.start_all().await.unwrap();
    h.org
        .deliver("boss", InboundMessage::new("portal", "u1", "ask far"))
        .await
        .unwrap();
    h.wait_until("the remote task stored (or its write held)", || async {
        if hold {
            HELD.load(std::sync::atomic::Ordering::SeqCst)
        } else {
            !h.stores
                .records
                .list(REMOTE_NAMESPACE, "")
                .await
                .unwrap()
                .is_empty()
        }
    })
    .await;
    h.wait_until("the boss's turn started", || async {
        !llm.requests_for(&boss).is_empty()
    })
    .await;
    h.wait_idle("boss").await;
    println!("READY");
    futures::future::pending::<()>().await;
}

/// How many SendMessage requests the remote received for each message id.
async fn sent(base: &str) -> BTreeMap<String, u64> {
    reqwest::get(format!("{base}/sent"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// The organization runs in a child process, SIGKILLed while the remote task works (the remote
/// received the message: its agent holds it until released); a new organization on the same
/// SQLite directory resumes far's task: the delegator gets the remote answer, once; the remote
/// agent received the message once; the task completed once. `hold`: the kill falls before the
/// remote task's id was stored. Returns how many times the message was sent.
async fn sigkill_mid_task(python: &str, hold: bool) -> u64 {
    let (_server, base) = remote(python, "0").await;
    let dir = tempfile::tempdir().unwrap();

    // The first life, killed once the remote works on the message.
    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["a2a_child", "--exact", "--ignored", "--nocapture"])
        .env(CHILD_DIR, dir.path())
        .env(CHILD_REMOTE, &base)
        .env(CHILD_HOLD, if hold { "1" } else { "0" })
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut holding = false;
    tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            holding |= line == "HOLDING";
            if line == "READY" {
                return;
            }
        }
        panic!("the first life ended before it was ready");
    })
    .await
    .expect("the first life was ready within 60 s");
    assert_eq!(holding, hold, "the remote task's write held: {holding}");
    let received_first = received(&base).await;
    assert_eq!(
        received_first.values().copied().collect::<Vec<_>>(),
        [1],
        "the remote agent works on the message: {received_first:?}"
    );
    child.kill().await.unwrap(); // SIGKILL
    child.wait().await.unwrap();

    // The second life on the same directory.
    let llm = ScriptedLlm::new();
    llm.push_text(&agent("boss"), "far answered after the restart");
    let h = harness(
        &org(&base, true),
        &llm,
        Some(spacebot_sqlite::open(dir.path()).await.unwrap()),
        &RetryPolicy::new(5, Duration::from_millis(50)),
    )
    .await;
    h.org.start_all().await.unwrap();
    h.wait_until("far's task stored its remote task", || async {
        !h.stores
            .records
            .list(REMOTE_NAMESPACE, "")
            .await
            .unwrap()
            .is_empty()
    })
    .await;
    reqwest::get(format!("{base}/release")).await.unwrap();
    let task = wait_task(&h, TaskStatus::Done).await;
    assert_eq!(
        task.result.as_deref(),
        Some("remote answer to: a held question")
    );
    h.wait_until("boss was told the result", || async {
        last_request_text(&llm, "boss").contains("remote answer to: a held question")
    })
    .await;
    h.wait_quiet().await;
    assert_eq!(
        received(&base).await,
        received_first,
        "the remote agent received the message once"
    );
    let told = llm
        .requests_for(&agent("boss"))
        .iter()
        .filter(|r| format!("{:?}", r.messages).contains("remote answer to: a held question"))
        .count();
    assert_eq!(told, 1, "the delegator is told once");
    assert_eq!(
        h.count(|k| matches!(k, EventKind::TaskCompleted)),
        1,
        "far's task completed once"
    );
    assert!(
        h.stores
            .tasks
            .get(&agent("far"), 2)
            .await
            .unwrap()
            .is_none(),
        "no second task"
    );
    let sends = sent(&base).await;
    assert_eq!(sends.len(), 1, "one message id: {sends:?}");
    h.org.shutdown().await.unwrap();
    sends.into_values().sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_python),
    ignore = "no Python with the protocol kits here: set SPACEBOT_PYTHON (see .ci/python); see README"
)]
async fn a_sigkill_while_the_remote_works_resumes_by_the_remote_task_and_sends_once() {
    let python = python();
    assert_eq!(
        sigkill_mid_task(&python, false).await,
        1,
        "resumed by the stored remote task: not sent again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_python),
    ignore = "no Python with the protocol kits here: set SPACEBOT_PYTHON (see .ci/python); see README"
)]
async fn a_sigkill_before_the_remote_task_is_stored_sends_the_same_message_id_and_the_remote_runs_it_once()
 {
    let python = python();
    assert_eq!(
        sigkill_mid_task(&python, true).await,
        2,
        "sent again after the restart, with the same message id, answered with the first task"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_python),
    ignore = "no Python with the protocol kits here: set SPACEBOT_PYTHON (see .ci/python); see README"
)]
async fn a_remote_agent_killed_mid_task_is_retried_then_the_task_fails_and_the_delegator_is_told() {
    let python = python();
    let (mut server, base) = remote(&python, "30").await;
    let llm = ScriptedLlm::new();
    script_delegation(&llm, "a slow question", "far failed");
    let retry = RetryPolicy::new(3, Duration::from_millis(50));
    let h = harness(&org(&base, true), &llm, None, &retry).await;
    h.org.start_all().await.unwrap();
    h.org
        .deliver("boss", InboundMessage::new("portal", "u1", "ask far"))
        .await
        .unwrap();
    h.wait_until("the remote task stored", || async {
        !h.stores
            .records
            .list(REMOTE_NAMESPACE, "")
            .await
            .unwrap()
            .is_empty()
    })
    .await;
    server.kill().await.unwrap();
    let task = wait_task(&h, TaskStatus::Failed).await;
    let error = task.error.clone().unwrap_or_default();
    assert!(
        error.contains("the remote A2A agent far")
            && error.contains("unreachable")
            && error.contains("3 times"),
        "{error}"
    );
    assert_eq!(
        task.attempts, 1,
        "given up at once after the tries: {task:?}"
    );
    h.wait_until("boss was told the failure", || async {
        last_request_text(&llm, "boss").contains("unreachable")
    })
    .await;
    let told = llm
        .requests_for(&agent("boss"))
        .iter()
        .filter(|r| {
            r.messages.iter().any(|m| match m {
                ChatMessage::User { content, .. } => content.to_string().contains("unreachable"),
                _ => false,
            })
        })
        .count();
    assert_eq!(told, 1, "the delegator is told once");
    h.org.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_agent_behind_a_disabled_link_is_refused() {
    // Refused by the policy before anything is sent: no remote agent needs to run (nothing
    // listens at this address), and no task is made.
    let llm = ScriptedLlm::new();
    let h = harness(
        &org("http://127.0.0.1:9", false),
        &llm,
        None,
        &RetryPolicy::default(),
    )
    .await;
    h.org.start_all().await.unwrap();
    let refused = h
        .org
        .delegate(
            &agent("boss"),
            "far",
            "anything",
            DelegationOrigin::new(ChannelId::new("portal:u1")),
        )
        .await;
    assert!(refused.is_err(), "{refused:?}");
    let refused = format!("{:?}", refused.unwrap_err());
    assert!(
        refused.to_lowercase().contains("disabled") || refused.to_lowercase().contains("link"),
        "{refused}"
    );
    assert!(
        h.stores
            .tasks
            .get(&agent("far"), 1)
            .await
            .unwrap()
            .is_none()
    );
    h.org.shutdown().await.unwrap();
}
