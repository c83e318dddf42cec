//! Spacebot's A2A server driven by a client no one here wrote: PyPI `a2a-sdk`'s client
//! (`tests/fixtures/a2a_client.py`) over JSON-RPC and SSE on 127.0.0.1, against a two-hop
//! delegation on the scripted mock model; and a task kept across a restart on SQLite.
//!
//! The Python tests need SPACEBOT_PYTHON (a Python with PyPI's `a2a-sdk`, made by `.ci/python`);
//! where neither it nor `.ci/python`'s environment is at hand they are compiled as ignored, with the
//! reason (`cfg(spacebot_python)`, set by the build script), unless SPACEBOT_REQUIRE_PYTHON=1
//! (CI), when they run and fail without it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Value, json};
use spacebot_a2a::{A2a, A2aServer};
use spacebot_core::testing::external::python;
use spacebot_core::testing::{OrgHarness, ScriptedLlm, last_user_text};
use spacebot_core::{
    AgentId, ChatRequest, ChatResponse, EventKind, LlmError, LlmProvider, TaskRef,
};
use tokio::io::AsyncBufReadExt;

const TOKEN: &str = "a2a-test-token";

const ORG: &str = r#"
[[agents]]
id = "chief"
name = "Chief"
a2a_expose = true
[[agents]]
id = "lead"
[[agents]]
id = "worker"
[[links]]
from = "chief"
to = "lead"
relationship = "superior"
[[links]]
from = "lead"
to = "worker"
relationship = "superior"
"#;

fn agent(id: &str) -> AgentId {
    AgentId::parse(id).unwrap()
}

/// The scripted model, except that a message saying "hang" is never answered (a turn that runs
/// until it is cancelled).
#[derive(Debug, Clone)]
struct Hanging(ScriptedLlm);

#[async_trait]
impl LlmProvider for Hanging {
    async fn complete(&self, request: ChatRequest) -> Result<ChatResponse, LlmError> {
        if last_user_text(&request.messages).contains("hang") {
            futures::future::pending::<()>().await;
        }
        self.0.complete(request).await
    }
}

/// Runs the client script to its end; its JSON lines.
async fn client(python: &str, args: &[&str]) -> Vec<Value> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/a2a_client.py");
    let out = tokio::time::timeout(
        Duration::from_secs(90),
        tokio::process::Command::new(python)
            .arg(script)
            .args(args)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the client finished within 90 s")
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the client failed: {}\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn step<'a>(lines: &'a [Value], name: &str) -> &'a Value {
    lines
        .iter()
        .find(|l| l["step"] == name)
        .unwrap_or_else(|| panic!("no step {name} in {lines:?}"))
}

async fn serve(router: axum::Router) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let served = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    (format!("http://{addr}"), served)
}

/// Card, a bad token, send across two hops, a repeated message id, stream, get, subscribe,
/// cancel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_python),
    ignore = "no Python with the protocol kits here: set SPACEBOT_PYTHON (see .ci/python); see README"
)]
async fn python_client_talks_to_the_organization_over_a2a() {
    let python = python();
    let llm = ScriptedLlm::new();
    let (chief, lead, worker) = (agent("chief"), agent("lead"), agent("worker"));
    llm.push_tool_call(
        &chief,
        "send_agent_message",
        json!({"target": "lead", "message": "ask the worker for the answer"}),
    );
    llm.push_tool_call(
        &lead,
        "send_agent_message",
        json!({"target": "worker", "message": "compute the answer"}),
    );
    llm.push_text(&worker, "the worker computed 42");
    llm.push_text(&lead, "the worker says 42");
    llm.push_text(&chief, "the answer is 42");
    llm.push_text(&chief, "streamed answer");
    let a2a = A2a::new();
    let mut h = OrgHarness::builder(ORG)
        .llm(Arc::new(Hanging(llm.clone())))
        .behaviour(Arc::new(a2a.clone()))
        .outbound(Arc::new(a2a.clone()))
        .build()
        .await;
    h.timeout = Duration::from_secs(30);
    h.org.start_all().await.unwrap();
    let server = A2aServer::new(h.org.clone(), a2a)
        .unwrap()
        .with_token(Some(TOKEN.into()));
    assert_eq!(server.exposed(), [agent("chief")]);
    let (base, served) = serve(server.router()).await;

    let lines = client(&python, &[&base, TOKEN]).await;

    let card = step(&lines, "card");
    assert_eq!(card["skills"], json!(["chief"]), "{card}");
    assert_eq!(card["url"], format!("{base}/a2a"));
    assert_eq!(card["binding"], "JSONRPC");
    assert_eq!(card["streaming"], true);
    assert_eq!(card["bearer"], "Bearer");

    let bad = step(&lines, "bad_token");
    assert_eq!(bad["status"], 401, "{bad}");
    assert!(bad["sdk_error"].is_string(), "the SDK refused too: {bad}");

    let send = step(&lines, "send");
    assert_eq!(send["state"], "TASK_STATE_COMPLETED", "{send}");
    assert_eq!(send["artifact"], "the answer is 42", "{send}");
    assert_eq!(
        send["history"],
        json!([
            ["ROLE_USER", "ask for the answer"],
            ["ROLE_AGENT", "the answer is 42"]
        ])
    );
    // The two hops ran before the A2A task completed.
    assert_eq!(llm.requests_for(&worker).len(), 1);
    assert_eq!(llm.requests_for(&lead).len(), 2);

    let repeat = step(&lines, "repeat");
    assert_eq!(
        repeat["id"], send["id"],
        "a repeated message id is the same task"
    );
    assert_eq!(repeat["state"], "TASK_STATE_COMPLETED");

    let follow_up = step(&lines, "follow_up");
    let ended = follow_up["ended"].as_str().unwrap_or_default();
    assert!(
        ended.starts_with("UnsupportedOperationError")
            && ended.contains("is completed: a task that ended takes no more messages")
            && ended.contains("without taskId"),
        "{follow_up}"
    );
    assert!(
        follow_up["unknown"]
            .as_str()
            .unwrap_or_default()
            .starts_with("TaskNotFoundError"),
        "{follow_up}"
    );

    let stream = step(&lines, "stream");
    let kinds: Vec<(String, String)> = stream["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["kind"].as_str().unwrap().to_owned(),
                e["state"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect();
    let expected: Vec<(String, String)> = [
        ("task", "TASK_STATE_SUBMITTED"),
        ("status_update", "TASK_STATE_WORKING"),
        ("artifact_update", ""),
        ("status_update", "TASK_STATE_COMPLETED"),
    ]
    .iter()
    .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
    .collect();
    assert_eq!(kinds, expected, "{stream}");
    assert_eq!(stream["events"][2]["text"], "streamed answer");
    assert_eq!(stream["events"][3]["text"], "streamed answer");

    let get = step(&lines, "get");
    assert_eq!(get["id"], send["id"]);
    assert_eq!(get["state"], "TASK_STATE_COMPLETED");
    assert_eq!(get["history"], 2);
    assert_eq!(step(&lines, "get_missing")["error"], "TaskNotFoundError");

    let subscribed = step(&lines, "subscribe_done");
    assert_eq!(
        subscribed["events"][0]["state"], "TASK_STATE_COMPLETED",
        "{subscribed}"
    );

    let cancel = step(&lines, "cancel");
    assert_eq!(cancel["first"], "TASK_STATE_SUBMITTED", "{cancel}");
    assert_eq!(cancel["before"], "TASK_STATE_WORKING", "{cancel}");
    assert_eq!(cancel["canceled"], "TASK_STATE_CANCELED", "{cancel}");
    assert_eq!(cancel["after"], "TASK_STATE_CANCELED", "{cancel}");
    assert_eq!(cancel["twice"], "TaskNotCancelableError", "{cancel}");
    // The chief's turn answering the canceled task was cancelled.
    h.wait_for("the chief's turn cancelled", |events| {
        events
            .iter()
            .any(|e| e.agent == chief && e.kind == EventKind::TurnCancelled)
    })
    .await;
    served.abort();
}

/// A task of the request behind an A2A task waits for an operator's approval: PyPI a2a-sdk's
/// client sees the task `input-required` (in the stream and with `GetTask`) with a status
/// message naming what waits; approved (`Organization::approve_task`), it is working again and
/// completes; rejected (`Organization::reject_task`), it is rejected with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_python),
    ignore = "no Python with the protocol kits here: set SPACEBOT_PYTHON (see .ci/python); see README"
)]
async fn an_approval_waiting_in_the_tree_makes_the_task_input_required() {
    let python = python();
    let llm = ScriptedLlm::new();
    let (chief, lead) = (agent("chief"), agent("lead"));
    for (verdict, after) in [
        ("approve", "chief: the lead did it"),
        ("reject", "chief: the lead was refused"),
    ] {
        llm.push_tool_call(
            &chief,
            "send_agent_message",
            json!({"target": "lead", "message": format!("{verdict} this work")}),
        );
        llm.push_text(&chief, after);
    }
    llm.push_text(&lead, "the lead did it");
    let a2a = A2a::new();
    let config = spacebot_core::testing::orgs::with_settings("approval = \"always\"", ORG);
    let mut h = OrgHarness::builder(config)
        .llm(Arc::new(llm.clone()))
        .behaviour(Arc::new(a2a.clone()))
        .outbound(Arc::new(a2a.clone()))
        .build()
        .await;
    h.timeout = Duration::from_secs(30);
    h.org.start_all().await.unwrap();
    let server = A2aServer::new(h.org.clone(), a2a)
        .unwrap()
        .with_token(Some(TOKEN.into()));
    let (base, served) = serve(server.router()).await;

    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/a2a_client.py");
    let mut child = tokio::process::Command::new(&python)
        .arg(script)
        .args([base.as_str(), TOKEN, "approval"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut out = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut lines = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = out.next_line().await.unwrap() {
            let line: Value = serde_json::from_str(&line).unwrap();
            if line["step"] == "waiting" {
                let pending = h
                    .board("lead")
                    .await
                    .into_iter()
                    .find(|t| t.status == spacebot_core::TaskStatus::PendingApproval)
                    .expect("a task of lead waits for approval");
                let task = TaskRef::new(lead.clone(), pending.number);
                if line["verdict"] == "approve" {
                    h.org.approve_task(&task).await.unwrap();
                } else {
                    h.org.reject_task(&task, "not today").await.unwrap();
                }
            }
            lines.push(line);
        }
    })
    .await
    .expect("the client finished within 60 s");
    assert!(child.wait().await.unwrap().success(), "{lines:?}");

    let states = |verdict: &str| -> Vec<String> {
        step(&lines, verdict)["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["state"].as_str().unwrap_or("artifact").to_owned())
            .collect()
    };
    let waiting: Vec<&Value> = lines.iter().filter(|l| l["step"] == "waiting").collect();
    assert_eq!(waiting.len(), 2, "{lines:?}");
    for (line, verdict) in waiting.iter().zip(["approve", "reject"]) {
        assert_eq!(line["verdict"], verdict);
        assert_eq!(
            line["state"], "TASK_STATE_INPUT_REQUIRED",
            "GetTask: {line}"
        );
        let text = line["text"].as_str().unwrap();
        assert!(
            text.contains("waiting for an operator's approval of task lead#")
                && text.contains(&format!("{verdict} this work"))
                && text.contains("delegated by chief"),
            "{text}"
        );
    }
    assert_eq!(
        states("approve"),
        [
            "TASK_STATE_SUBMITTED",
            "TASK_STATE_WORKING",
            "TASK_STATE_INPUT_REQUIRED",
            "TASK_STATE_WORKING",
            "artifact",
            "TASK_STATE_COMPLETED"
        ],
        "{lines:?}"
    );
    assert_eq!(step(&lines, "approve")["state"], "TASK_STATE_COMPLETED");
    assert_eq!(
        states("reject"),
        [
            "TASK_STATE_SUBMITTED",
            "TASK_STATE_WORKING",
            "TASK_STATE_INPUT_REQUIRED",
            "TASK_STATE_REJECTED"
        ],
        "{lines:?}"
    );
    let rejected = step(&lines, "reject");
    assert_eq!(rejected["state"], "TASK_STATE_REJECTED");
    let last = rejected["events"].as_array().unwrap().last().unwrap();
    assert!(
        last["text"].as_str().unwrap().contains("not today"),
        "{rejected}"
    );
    // The chief is told of the refusal and answers: the rejected task stays rejected.
    h.wait_until("the chief answered the refusal", || async {
        llm.remaining(&chief) == 0
    })
    .await;
    h.wait_quiet().await;
    let http = reqwest::Client::new();
    let got = rpc(
        &http,
        &format!("{base}/a2a"),
        "GetTask",
        json!({"id": rejected["id"]}),
    )
    .await;
    assert_eq!(
        got["result"]["status"]["state"], "TASK_STATE_REJECTED",
        "{got}"
    );
    served.abort();
}

async fn rpc(http: &reqwest::Client, url: &str, method: &str, params: Value) -> Value {
    http.post(url)
        .bearer_auth(TOKEN)
        .header("A2A-Version", "1.0")
        .json(&json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// A task accepted, then the organization stopped before the agent answered: reopened on the
/// same SQLite directory, the task is answered and `GetTask` tells it; the same message id sent
/// again is still the same task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_is_kept_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();
    let send = json!({
        "message": {"messageId": "m-restart", "role": "ROLE_USER", "parts": [{"text": "hello"}]},
        "configuration": {"returnImmediately": true},
    });

    // First run: the agent is not started; the task is stored as submitted.
    let a2a = A2a::new();
    let h = OrgHarness::builder(ORG)
        .stores(spacebot_sqlite::open(dir.path()).await.unwrap())
        .llm(Arc::new(ScriptedLlm::new()))
        .behaviour(Arc::new(a2a.clone()))
        .outbound(Arc::new(a2a.clone()))
        .build()
        .await;
    let server = A2aServer::new(h.org.clone(), a2a)
        .unwrap()
        .with_token(Some(TOKEN.into()));
    let (base, served) = serve(server.router()).await;
    let url = format!("{base}/a2a");
    let first = rpc(&http, &url, "SendMessage", send.clone()).await;
    let id = first["result"]["task"]["id"].as_str().unwrap().to_owned();
    assert_eq!(
        first["result"]["task"]["status"]["state"], "TASK_STATE_SUBMITTED",
        "{first}"
    );
    served.abort();
    h.org.shutdown().await.unwrap();
    h.stores.close().await;
    drop(h);

    // Second run on the same directory: the agent answers the message it was handed.
    let llm = ScriptedLlm::new();
    llm.push_text(&agent("chief"), "hello after the restart");
    let a2a = A2a::new();
    let h = OrgHarness::builder(ORG)
        .stores(spacebot_sqlite::open(dir.path()).await.unwrap())
        .llm(Arc::new(llm.clone()))
        .behaviour(Arc::new(a2a.clone()))
        .outbound(Arc::new(a2a.clone()))
        .build()
        .await;
    let server = A2aServer::new(h.org.clone(), a2a)
        .unwrap()
        .with_token(Some(TOKEN.into()));
    let (base, served) = serve(server.router()).await;
    let url = format!("{base}/a2a");
    h.org.start_all().await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let task = loop {
        let got = rpc(&http, &url, "GetTask", json!({"id": id})).await;
        if got["result"]["status"]["state"] == "TASK_STATE_COMPLETED" {
            break got["result"].clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the task was not completed after the restart: {got}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        task["artifacts"][0]["parts"][0]["text"],
        "hello after the restart"
    );
    let again = rpc(&http, &url, "SendMessage", send).await;
    assert_eq!(again["result"]["task"]["id"], id, "{again}");
    assert_eq!(llm.requests_for(&agent("chief")).len(), 1, "answered once");
    served.abort();
    h.org.shutdown().await.unwrap();
}
