//! Agents using the tools of npm's `@modelcontextprotocol/server-everything` (the MCP project's
//! reference server, written in TypeScript; no one here wrote it) over stdio, driven by the
//! scripted mock model through the public API.
//!
//! Needs `SPACEBOT_MCP_EVERYTHING`: the path of the package's `dist/index.js` (`.ci/node` installs
//! Debian's `nodejs` and `npm` when missing and the package under `target/ci-node`, and prints the
//! export); `SPACEBOT_NODE` names the `node` binary (default `node`). Where neither it nor the
//! package under `target/ci-node` is at hand the tests are compiled as ignored, with the reason
//! (`cfg(spacebot_node)`, set by the build script), unless SPACEBOT_REQUIRE_NODE=1 (CI), when they
//! run and fail without it. Only its stdio transport is
//! used: its HTTP transports listen on every interface, and tests bind to 127.0.0.1 only.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use spacebot_core::testing::external::mcp_everything;
use spacebot_core::testing::{OrgHarness, ScriptedLlm};
use spacebot_core::{AgentId, InboundMessage};
use spacebot_mcp::Mcp;

fn agent(id: &str) -> AgentId {
    AgentId::parse(id).unwrap()
}

fn config(index: &str) -> String {
    let node = std::env::var("SPACEBOT_NODE").unwrap_or_else(|_| "node".into());
    format!(
        r#"
[[agents]]
id = "a"
tools = ["ev:echo", "ev:get-sum", "ev:get-tiny-image", "ev:get-structured-content", "ev:get-resource-reference"]
[[agents]]
id = "b"
tools = ["ev:echo"]
[[agents]]
id = "lead"
[[links]]
from = "lead"
to = "b"
relationship = "superior"

[[mcp_servers]]
id = "ev"
command = {node:?}
args = [{index:?}, "stdio"]
start = "eager"
timeout_ms = 20000
"#
    )
}

async fn harness(index: &str, llm: &ScriptedLlm, mcp: &Mcp) -> OrgHarness {
    let h = OrgHarness::builder(config(index))
        .llm(Arc::new(llm.clone()))
        .behaviour(Arc::new(mcp.clone()))
        .build()
        .await;
    h.org.start_all().await.unwrap();
    mcp.wait_ready("ev", Duration::from_secs(30)).await.unwrap();
    h
}

async fn ask(h: &mut OrgHarness, to: &str, text: &str) -> String {
    h.org
        .deliver(to, InboundMessage::new("portal", "u1", text))
        .await
        .unwrap();
    let reply = tokio::time::timeout(
        Duration::from_secs(60),
        futures::StreamExt::next(&mut h.replies),
    )
    .await
    .expect("a reply within 60 s")
    .expect("the reply stream is open");
    reply.content.to_string()
}

/// The tool results of the running turn in the agent's last model request, in order (not those
/// replayed from the channel's history).
fn tool_results(llm: &ScriptedLlm, id: &str) -> Vec<String> {
    llm.requests_for(&agent(id))
        .last()
        .map(|last| spacebot_core::testing::tool_results(&last.messages))
        .unwrap_or_default()
}

/// Granted tools called and their results (text, an image, structured content, an embedded
/// resource) used; an ungranted tool of the same server refused; bad arguments answered before
/// the call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_node),
    ignore = "no MCP reference server here: set SPACEBOT_MCP_EVERYTHING (see .ci/node); see README"
)]
async fn the_reference_server_granted_refused_invalid_and_its_result_kinds() {
    let index = mcp_everything();
    let llm = ScriptedLlm::new();
    let mcp = Mcp::new();
    let a = agent("a");
    llm.push_tool_calls(
        &a,
        [
            ("ev__echo", json!({"message": "hello from spacebot"})),
            ("ev__get-sum", json!({"a": 2, "b": 40})),
            ("ev__get-env", json!({})),
            ("ev__get-sum", json!({"a": "two", "b": 1})),
            ("ev__get-tiny-image", json!({})),
            ("ev__get-structured-content", json!({"location": "Chicago"})),
            (
                "ev__get-resource-reference",
                json!({"resourceType": "Text", "resourceId": 1}),
            ),
        ],
    );
    llm.push_text(&a, "done");
    let mut h = harness(&index, &llm, &mcp).await;
    assert_eq!(ask(&mut h, "a", "try the tools").await, "done");

    let mut offered: Vec<String> = llm.requests_for(&a)[0]
        .tools
        .iter()
        .map(|t| t.name.clone())
        .filter(|n| n.starts_with("ev__"))
        .collect();
    offered.sort();
    assert_eq!(
        offered,
        [
            "ev__echo",
            "ev__get-resource-reference",
            "ev__get-structured-content",
            "ev__get-sum",
            "ev__get-tiny-image"
        ],
        "only a's granted tools are offered, namespaced"
    );

    let results = tool_results(&llm, "a");
    assert_eq!(results.len(), 7, "{results:#?}");
    assert_eq!(
        results[0], "Echo: hello from spacebot",
        "the echo reached the model"
    );
    assert!(results[1].contains("is 42"), "the sum: {}", results[1]);
    assert!(
        results[2].starts_with("Error: unknown tool \"ev__get-env\""),
        "an ungranted tool is refused in code: {}",
        results[2]
    );
    assert!(
        results[3].starts_with("Error: invalid arguments for tool ev__get-sum"),
        "bad arguments are answered before the call: {}",
        results[3]
    );
    assert!(
        results[4].contains("[image: image/png,"),
        "an image becomes a placeholder: {}",
        results[4]
    );
    assert!(
        !results[4].contains("iVBOR"),
        "the image's base64 is not pasted into the model's context: {}",
        results[4]
    );
    assert!(
        results[5].contains("\"temperature\""),
        "structured content reaches the model: {}",
        results[5]
    );
    assert!(
        results[6].contains("[resource demo://resource/dynamic/text/1]"),
        "an embedded resource reaches the model: {}",
        results[6]
    );
    mcp.shutdown();
    h.org.shutdown().await.unwrap();
}

/// A delegated task whose worker uses a tool of the reference server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_node),
    ignore = "no MCP reference server here: set SPACEBOT_MCP_EVERYTHING (see .ci/node); see README"
)]
async fn a_delegated_worker_uses_the_reference_server() {
    let index = mcp_everything();
    let llm = ScriptedLlm::new();
    let mcp = Mcp::new();
    let (lead, b) = (agent("lead"), agent("b"));
    llm.push_tool_call(
        &lead,
        "send_agent_message",
        json!({"target": "b", "message": "echo the word 'granite'"}),
    );
    llm.push_tool_call(&b, "ev__echo", json!({"message": "granite"}));
    llm.push_text(&b, "the server echoed granite");
    llm.push_text(&lead, "b says granite");
    let mut h = harness(&index, &llm, &mcp).await;
    assert_eq!(ask(&mut h, "lead", "delegate").await, "b says granite");
    let results = tool_results(&llm, "b");
    assert_eq!(results.len(), 1, "{results:?}");
    assert!(results[0].contains("granite"), "{results:?}");
    let lead_saw = format!("{:?}", llm.requests_for(&lead).last().unwrap().messages);
    assert!(
        lead_saw.contains("the server echoed granite"),
        "the worker's answer reached the delegator: {lead_saw}"
    );
    mcp.shutdown();
    h.org.shutdown().await.unwrap();
}
