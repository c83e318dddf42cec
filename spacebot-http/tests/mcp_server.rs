//! The organization as an MCP server, driven by a client no one here wrote: PyPI `mcp`'s
//! `ClientSession` (`tests/fixtures/mcp_client.py`) over streamable HTTP at `/mcp`, behind the
//! API's bearer token, against a two-hop delegation on the scripted mock model.
//!
//! Needs SPACEBOT_PYTHON (a Python with PyPI's `mcp`, made by `.ci/python`); where
//! neither it nor `.ci/python`'s environment is at hand the tests are compiled as ignored, with the
//! reason (`cfg(spacebot_python)`, set by the build script), unless SPACEBOT_REQUIRE_PYTHON=1 (CI),
//! when they run and fail without it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use spacebot_core::testing::external::python;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Value, json};
use spacebot_core::testing::{OrgHarness, ScriptedLlm, last_user_text};
use spacebot_core::{AgentId, ChatRequest, ChatResponse, EventKind, LlmError, LlmProvider};
use spacebot_http::{Api, HttpConfig, WebChat};
use spacebot_mcp::{Mcp, McpChat, OrgServer};

const TOKEN: &str = "mcp-test-token";

const ORG: &str = r#"
[[agents]]
id = "chief"
name = "Chief"
mcp_expose = true
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

/// Runs the client script to its end; its JSON lines by step.
async fn client(python: &str, args: &[&str]) -> Vec<Value> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mcp_client.py");
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

fn script(llm: &ScriptedLlm) {
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
}

/// list tools, ask across two hops with progress, read resources, cancel, a bad token refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_python),
    ignore = "no Python with the protocol kits here: set SPACEBOT_PYTHON (see .ci/python); see README"
)]
async fn python_client_asks_the_organization_over_streamable_http() {
    let python = python();
    let llm = ScriptedLlm::new();
    script(&llm);
    let web = WebChat::new();
    let chat = McpChat::new().with_fallback(Arc::new(web.clone()));
    let mcp = Mcp::new();
    let mut h = OrgHarness::builder(ORG)
        .llm(Arc::new(Hanging(llm.clone())))
        .behaviour(Arc::new(mcp.clone()))
        .outbound(Arc::new(chat.clone()))
        .build()
        .await;
    h.timeout = Duration::from_secs(30);
    h.org.start_all().await.unwrap();
    let server = OrgServer::new(h.org.clone(), chat).unwrap();
    assert_eq!(server.exposed(), [agent("chief")]);
    let api = Api::new(h.org.clone(), web, HttpConfig::with_token(TOKEN))
        .unwrap()
        .with_mcp_tools(mcp)
        .with_mcp(server);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let served = tokio::spawn(async move {
        let _ = axum::serve(listener, api.router()).await;
    });
    let url = format!("http://{addr}/mcp");

    // The MCP routes of the API: servers and grants, calls waiting for approval.
    let http = reqwest::Client::new();
    let servers: Value = http
        .get(format!("http://{addr}/api/mcp/servers"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(servers, json!({"servers": [], "grants": []}));
    let unknown = http
        .post(format!("http://{addr}/api/mcp/calls/nope/approve"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);

    let lines = client(&python, &["http", &url, TOKEN]).await;

    let bad = step(&lines, "bad_token");
    assert_eq!(bad["status"], 401, "{bad}");
    assert!(bad["sdk_error"].is_string(), "the SDK refused too: {bad}");

    let tools = step(&lines, "tools")["tools"].as_array().unwrap();
    assert_eq!(tools.len(), 1, "only chief is exposed: {tools:?}");
    assert_eq!(tools[0]["name"], "ask_chief");
    assert!(tools[0]["description"].as_str().unwrap().contains("Chief"));

    let resources = step(&lines, "resources");
    let uris: Vec<&str> = resources["uris"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u.as_str().unwrap())
        .collect();
    assert!(uris.contains(&"spacebot://topology"), "{uris:?}");
    assert!(uris.contains(&"spacebot://tasks/worker"), "{uris:?}");
    assert_eq!(resources["topology"]["agents"].as_array().unwrap().len(), 3);

    let ask = step(&lines, "ask");
    assert_eq!(ask["text"], "the answer is 42", "{ask}");
    assert_eq!(ask["is_error"], false);
    let progress: Vec<&str> = ask["progress"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    assert!(
        progress
            .iter()
            .any(|p| p.starts_with("chief: turn started")),
        "{progress:?}"
    );
    assert!(
        progress
            .iter()
            .any(|p| p.starts_with("worker: task created")),
        "the second hop is told too: {progress:?}"
    );
    assert!(
        progress
            .iter()
            .any(|p| p.starts_with("worker: task completed")),
        "{progress:?}"
    );

    let cancel = step(&lines, "cancel");
    assert!(
        cancel["progress"][0]
            .as_str()
            .unwrap()
            .starts_with("chief: turn started"),
        "{cancel}"
    );
    // The client gave up: the chief's turn answering it is cancelled.
    h.wait_for("the chief's turn cancelled", |events| {
        events
            .iter()
            .any(|e| e.agent == agent("chief") && e.kind == EventKind::TurnCancelled)
    })
    .await;
    served.abort();
}
