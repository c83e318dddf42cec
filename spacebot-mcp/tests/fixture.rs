//! Agents using the tools of an MCP server no one here wrote: PyPI `mcp`'s `MCPServer` (formerly
//! FastMCP) in `tests/fixtures/server.py`, over stdio and over streamable HTTP on 127.0.0.1,
//! driven by the scripted mock model through the public API.
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

use serde_json::json;
use spacebot_core::testing::{OrgHarness, ScriptedLlm};
use spacebot_core::{AgentId, ChatRequest, InboundMessage};
use spacebot_mcp::{Mcp, ServerState};
use tokio::io::AsyncBufReadExt;

fn fixture() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/server.py")
        .display()
        .to_string()
}

fn agent(id: &str) -> AgentId {
    AgentId::parse(id).unwrap()
}

/// `[[mcp_servers]]` for the stdio fixture.
fn stdio_server(python: &str, extra: &str) -> String {
    format!(
        "[[mcp_servers]]\nid = \"fx\"\ncommand = {python:?}\nargs = [{:?}]\nstart = \"eager\"\ntimeout_ms = 20000\n{extra}\n",
        fixture()
    )
}

/// An HTTP fixture server: the child (killed on drop) and its `[[mcp_servers]]` entry.
async fn http_server(python: &str) -> (tokio::process::Child, String) {
    let mut child = tokio::process::Command::new(python)
        .arg(fixture())
        .arg("http")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await
        .expect("the HTTP fixture printed its port in time")
        .unwrap()
        .expect("a PORT line");
    let port: u16 = line.trim_start_matches("PORT ").trim().parse().unwrap();
    let entry = format!(
        "[[mcp_servers]]\nid = \"fx\"\nurl = \"http://127.0.0.1:{port}/mcp\"\nstart = \"eager\"\ntimeout_ms = 20000\nheaders = {{ \"X-Test\" = \"yes\" }}\n"
    );
    (child, entry)
}

const AGENTS: &str = r#"
[[agents]]
id = "a"
tools = ["fx:add", "fx:big", "fx:die", "fx:whoami", "fx:grow", "fx:extra"]
[[agents]]
id = "b"
tools = ["fx:*"]
[[agents]]
id = "lead"
[[links]]
from = "lead"
to = "b"
relationship = "superior"
"#;

async fn harness(config: String, llm: &ScriptedLlm, mcp: &Mcp) -> OrgHarness {
    let h = OrgHarness::builder(config)
        .llm(Arc::new(llm.clone()))
        .behaviour(Arc::new(mcp.clone()))
        .build()
        .await;
    h.org.start_all().await.unwrap();
    mcp.wait_ready("fx", Duration::from_secs(20)).await.unwrap();
    h
}

async fn ask(h: &mut OrgHarness, to: &str, text: &str) -> String {
    h.org
        .deliver(to, InboundMessage::new("portal", "u1", text))
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let reply = tokio::time::timeout(
        Duration::from_secs(60),
        futures::StreamExt::next(&mut h.replies),
    )
    .await
    .expect("a reply within 60 s")
    .expect("the reply stream is open");
    eprintln!("{to} answered {text:?} in {:?}", started.elapsed());
    reply.content.to_string()
}

fn tool_names(request: &ChatRequest) -> Vec<String> {
    request.tools.iter().map(|t| t.name.clone()).collect()
}

/// The tool results shown in the agent's last model request, in order.
fn tool_results(llm: &ScriptedLlm, id: &str) -> Vec<String> {
    let requests = llm.requests_for(&agent(id));
    let Some(last) = requests.last() else {
        return Vec::new();
    };
    // The running turn's own results (not those replayed from the channel's history).
    spacebot_core::testing::tool_results(&last.messages)
}

/// Granted tools called and their results used; an ungranted and an unknown tool refused; bad
/// arguments answered; the idempotency key in `_meta`; a 10 MB result capped.
async fn granted_refused_invalid_capped(config: String) {
    let llm = ScriptedLlm::new();
    let mcp = Mcp::new();
    let a = agent("a");
    llm.push_tool_calls(
        &a,
        [
            ("fx__add", json!({"a": 2, "b": 40})),
            ("fx__secret", json!({})),
            ("fx__nothing", json!({})),
            ("fx__add", json!({"a": "two"})),
            ("fx__whoami", json!({})),
            ("fx__big", json!({"size": 10_000_000})),
        ],
    );
    llm.push_text(&a, "the sum is 42");
    let mut h = harness(config, &llm, &mcp).await;
    let answer = ask(&mut h, "a", "add 2 and 40").await;
    assert_eq!(answer, "the sum is 42");

    let first = &llm.requests_for(&a)[0];
    let mut offered = tool_names(first);
    offered.retain(|n| n.starts_with("fx__"));
    assert_eq!(
        offered,
        ["fx__add", "fx__big", "fx__die", "fx__grow", "fx__whoami"],
        "only a's granted tools are offered, namespaced"
    );
    let results = tool_results(&llm, "a");
    assert_eq!(results.len(), 6, "{results:?}");
    assert_eq!(results[0], "42", "the server's answer reached the model");
    assert!(
        results[1].starts_with("Error: unknown tool \"fx__secret\""),
        "an ungranted tool is refused: {}",
        results[1]
    );
    assert!(!results[1].contains("the secret"));
    assert!(
        results[2].starts_with("Error: unknown tool \"fx__nothing\""),
        "{}",
        results[2]
    );
    assert!(
        results[3].starts_with("Error: invalid arguments for tool fx__add"),
        "bad arguments are answered before the call: {}",
        results[3]
    );
    assert!(results[3].contains("\"two\""), "{}", results[3]);
    assert!(
        results[4].starts_with("key=") && results[4] != "key=None" && results[4].len() > 6,
        "the call's idempotency key reached the server in _meta: {}",
        results[4]
    );
    let cap = spacebot_mcp::DEFAULT_MAX_RESULT_BYTES;
    assert!(
        results[5].len() < cap + 200,
        "a 10 MB result is capped: {} bytes",
        results[5].len()
    );
    assert!(
        results[5].contains("[result cut: it was 10000000 bytes; only the first 65536 are shown]"),
        "{}",
        &results[5][results[5].len().saturating_sub(300)..]
    );

    // A second ask under the same agent: the key differs per call.
    llm.push_tool_call(&a, "fx__whoami", json!({}));
    llm.push_text(&a, "ok");
    ask(&mut h, "a", "who am i").await;
    let again = tool_results(&llm, "a");
    assert_ne!(again.last(), Some(&results[4]), "another call, another key");

    mcp.shutdown();
    h.org.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_python),
    ignore = "no Python with the protocol kits here: set SPACEBOT_PYTHON (see .ci/python); see README"
)]
async fn stdio_granted_refused_invalid_capped() {
    let python = python();
    granted_refused_invalid_capped(format!("{AGENTS}{}", stdio_server(&python, ""))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_python),
    ignore = "no Python with the protocol kits here: set SPACEBOT_PYTHON (see .ci/python); see README"
)]
async fn http_granted_refused_invalid_capped() {
    let python = python();
    let (_child, entry) = http_server(&python).await;
    granted_refused_invalid_capped(format!("{AGENTS}{entry}")).await;
}

/// The server dies in the middle of a call: the model is told, the server is started again, and
/// the next call works. A changed tool list is picked up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_python),
    ignore = "no Python with the protocol kits here: set SPACEBOT_PYTHON (see .ci/python); see README"
)]
async fn stdio_server_killed_mid_call_is_restarted_and_list_changes_are_seen() {
    let python = python();
    let llm = ScriptedLlm::new();
    let mcp = Mcp::new();
    let a = agent("a");
    llm.push_tool_call(&a, "fx__die", json!({}));
    llm.push_text(&a, "it died");
    let mut h = harness(format!("{AGENTS}{}", stdio_server(&python, "")), &llm, &mcp).await;
    assert_eq!(ask(&mut h, "a", "die").await, "it died");
    let died = tool_results(&llm, "a");
    assert!(
        died[0].starts_with("Error: tool fx__die failed"),
        "the model is told: {died:?}"
    );

    // Started again with backoff; the next call works.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while mcp.starts("fx") < 2 || !matches!(mcp.server_state("fx"), Some(ServerState::Ready { .. }))
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not started again: {:?}",
            mcp.server_state("fx")
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    llm.push_tool_call(&a, "fx__add", json!({"a": 1, "b": 1}));
    llm.push_text(&a, "two");
    assert_eq!(ask(&mut h, "a", "add").await, "two");
    assert_eq!(tool_results(&llm, "a"), ["2"]);

    // tools/list_changed: `grow` adds `extra`, which a's grant names; the next turn offers it.
    llm.push_tool_call(&a, "fx__grow", json!({}));
    llm.push_text(&a, "grown");
    assert_eq!(ask(&mut h, "a", "grow").await, "grown");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !mcp.tool_names("fx").contains(&"fx__extra".to_owned()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the changed list was not picked up: {:?}",
            mcp.tool_names("fx")
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    llm.push_tool_call(&a, "fx__extra", json!({}));
    llm.push_text(&a, "extra");
    assert_eq!(ask(&mut h, "a", "extra").await, "extra");
    assert!(tool_names(llm.requests_for(&a).last().unwrap()).contains(&"fx__extra".to_owned()));
    assert_eq!(tool_results(&llm, "a"), ["extra tool here"]);
    assert!(matches!(
        mcp.server_state("fx"),
        Some(ServerState::Ready { .. })
    ));

    mcp.shutdown();
    h.org.shutdown().await.unwrap();
}

/// A delegated task whose worker uses an MCP tool; grants at run time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_python),
    ignore = "no Python with the protocol kits here: set SPACEBOT_PYTHON (see .ci/python); see README"
)]
async fn stdio_a_delegated_worker_uses_an_mcp_tool_and_grants_change_at_run_time() {
    let python = python();
    let llm = ScriptedLlm::new();
    let mcp = Mcp::new();
    let (lead, b) = (agent("lead"), agent("b"));
    llm.push_tool_call(
        &lead,
        "send_agent_message",
        json!({"target": "b", "message": "add 20 and 22"}),
    );
    llm.push_tool_call(&b, "fx__add", json!({"a": 20, "b": 22}));
    llm.push_text(&b, "the worker's sum: 42");
    llm.push_text(&lead, "b says 42");
    let mut h = harness(format!("{AGENTS}{}", stdio_server(&python, "")), &llm, &mcp).await;
    assert_eq!(ask(&mut h, "lead", "delegate").await, "b says 42");
    assert_eq!(tool_results(&llm, "b"), ["42"]);
    let lead_saw: Vec<String> = llm
        .requests_for(&lead)
        .last()
        .unwrap()
        .messages
        .iter()
        .map(|m| format!("{m:?}"))
        .collect();
    assert!(
        lead_saw.iter().any(|m| m.contains("the worker's sum: 42")),
        "the worker's result came back to the lead: {lead_saw:?}"
    );

    // The lead has no grant: it is offered nothing of fx, and refused when it names a tool.
    assert!(
        !tool_names(&llm.requests_for(&lead)[0])
            .iter()
            .any(|n| n.starts_with("fx__"))
    );
    llm.push_tool_call(&lead, "fx__add", json!({"a": 1, "b": 2}));
    llm.push_text(&lead, "refused");
    ask(&mut h, "lead", "add").await;
    assert!(tool_results(&llm, "lead")[0].starts_with("Error: unknown tool \"fx__add\""));
    // Granted at run time: offered and run on the next turn; revoked: refused again.
    assert!(mcp.grant(&lead, "fx:add").unwrap());
    llm.push_tool_call(&lead, "fx__add", json!({"a": 1, "b": 2}));
    llm.push_text(&lead, "three");
    ask(&mut h, "lead", "add").await;
    assert!(tool_names(llm.requests_for(&lead).last().unwrap()).contains(&"fx__add".to_owned()));
    assert_eq!(tool_results(&llm, "lead"), ["3"]);
    assert!(mcp.revoke(&lead, "fx:add").unwrap());
    llm.push_tool_call(&lead, "fx__add", json!({"a": 1, "b": 2}));
    llm.push_text(&lead, "refused again");
    ask(&mut h, "lead", "add").await;
    assert!(tool_results(&llm, "lead")[0].starts_with("Error: unknown tool \"fx__add\""));
    assert!(mcp.grant(&lead, "nope:add").is_err());
    assert!(mcp.grant(&agent("ghost"), "fx:add").is_err());

    mcp.shutdown();
    h.org.shutdown().await.unwrap();
}

/// An agent's organization on SQLite in `dir`, with `a` granted `fx:bump` under approval.
async fn approval_org(
    python: &str,
    dir: &std::path::Path,
    llm: &ScriptedLlm,
    mcp: &Mcp,
) -> OrgHarness {
    let log = dir.join("bumps.log");
    let config = format!(
        "[[agents]]\nid = \"a\"\ntools = [\"fx:add\", {{ tool = \"fx:bump\", approval = true }}]\n\
         [[mcp_servers]]\nid = \"fx\"\ncommand = {python:?}\nargs = [{:?}]\nstart = \"eager\"\n\
         timeout_ms = 20000\nenv = {{ SPACEBOT_FIXTURE_LOG = {:?} }}\n",
        fixture(),
        log.display().to_string()
    );
    let stores = spacebot_sqlite::open(dir.join("data")).await.unwrap();
    let mut h = OrgHarness::builder(config)
        .stores(stores)
        .llm(Arc::new(llm.clone()))
        .behaviour(Arc::new(mcp.clone()))
        .build()
        .await;
    h.timeout = Duration::from_secs(30);
    h.org.start_all().await.unwrap();
    mcp.wait_ready("fx", Duration::from_secs(20)).await.unwrap();
    h
}

async fn wait_pending(mcp: &Mcp) -> Vec<spacebot_mcp::PendingCall> {
    let started = std::time::Instant::now();
    loop {
        let pending = mcp.pending_calls().await.unwrap();
        if !pending.is_empty() {
            return pending;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no call became pending within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn bumps(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("bumps.log"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The first life of the approval test, run by it as a child process and killed (SIGKILL) once
/// the call is pending: the model calls bump, the call waits for a human.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child process of approval_pending_across_a_sigkill_then_run_once_or_rejected"]
async fn approval_child() {
    let (Ok(python), Ok(dir)) = (
        std::env::var("SPACEBOT_PYTHON"),
        std::env::var("SPACEBOT_APPROVAL_DIR"),
    ) else {
        panic!("run by approval_pending_across_a_sigkill_then_run_once_or_rejected only");
    };
    let dir = PathBuf::from(dir);
    let a = agent("a");
    let llm = ScriptedLlm::new();
    llm.push_tool_call(&a, "fx__bump", json!({"note": "first"}));
    let mcp = Mcp::new();
    let h = approval_org(&python, &dir, &llm, &mcp).await;
    assert!(mcp.requires_approval(&a, "fx", "bump"));
    assert!(!mcp.requires_approval(&a, "fx", "add"));
    h.org
        .deliver("a", InboundMessage::new("portal", "u1", "bump it"))
        .await
        .unwrap();
    let pending = wait_pending(&mcp).await;
    assert_eq!(pending.len(), 1);
    assert!(bumps(&dir).is_empty(), "nothing ran before approval");
    println!("PENDING {}", serde_json::to_string(&pending[0]).unwrap());
    futures::future::pending::<()>().await;
}

/// A grant requiring approval: the call is stored as pending, survives a SIGKILL of the process
/// and a new organization on the same stores, runs once after approval; a rejection is answered
/// to the model; a call decided already cannot be decided again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_python),
    ignore = "no Python with the protocol kits here: set SPACEBOT_PYTHON (see .ci/python); see README"
)]
async fn approval_pending_across_a_sigkill_then_run_once_or_rejected() {
    let python = python();
    let dir = tempfile::tempdir().unwrap();
    let a = agent("a");

    // The first life, in a child process killed once the call is pending.
    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["approval_child", "--exact", "--ignored", "--nocapture"])
        .env("SPACEBOT_APPROVAL_DIR", dir.path())
        .env("SPACEBOT_PYTHON", &python)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let pending: spacebot_mcp::PendingCall = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(json) = line.strip_prefix("PENDING ") {
                return serde_json::from_str(json).unwrap();
            }
        }
        panic!("the child ended before its call was pending");
    })
    .await
    .expect("the child's call was pending within 60 s");
    assert_eq!(
        (pending.server.as_str(), pending.tool.as_str()),
        ("fx", "bump")
    );
    assert_eq!(pending.arguments["note"], "first");
    let id = pending.id.clone();
    child.kill().await.unwrap();
    assert!(bumps(dir.path()).is_empty(), "nothing ran before approval");

    // The second life on the same stores: the call is still pending; the turn runs again and
    // waits on the same call.
    let llm = ScriptedLlm::new();
    llm.push_tool_call(&a, "fx__bump", json!({"note": "first"}));
    llm.push_text(&a, "bumped after approval");
    let mcp = Mcp::new();
    let mut h = approval_org(&python, dir.path(), &llm, &mcp).await;
    let pending = wait_pending(&mcp).await;
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!(pending[0].id, id, "the same call, not a second one");
    let approved = mcp.approve(&id, "operator").await.unwrap();
    assert_eq!(approved.decided_by.as_deref(), Some("operator"));
    let reply = h.reply().await;
    assert_eq!(reply.content.to_string(), "bumped after approval");
    assert_eq!(tool_results(&llm, "a"), ["bumped 1"]);
    assert_eq!(bumps(dir.path()), ["first"], "run exactly once");
    assert!(matches!(
        mcp.approve(&id, "operator").await,
        Err(spacebot_mcp::McpError::NotPending { .. })
    ));
    assert!(mcp.pending_calls().await.unwrap().is_empty());

    // A rejection is answered to the model; the tool never runs.
    llm.push_tool_call(&a, "fx__bump", json!({"note": "second"}));
    llm.push_text(&a, "it was rejected");
    h.org
        .deliver("a", InboundMessage::new("portal", "u1", "bump again"))
        .await
        .unwrap();
    let pending = wait_pending(&mcp).await;
    mcp.reject(&pending[0].id, "operator", "not today")
        .await
        .unwrap();
    assert_eq!(h.reply().await.content.to_string(), "it was rejected");
    let results = tool_results(&llm, "a");
    assert!(
        results[0].contains("a human rejected this call (operator): not today"),
        "{results:?}"
    );
    assert_eq!(bumps(dir.path()), ["first"]);
    assert!(mcp.approve("nope", "operator").await.is_err());
    mcp.shutdown();
}
