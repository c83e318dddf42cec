//! An agent using the tools of an MCP server: the Python test server of `spacebot-mcp`
//! (`spacebot-mcp/tests/fixtures/server.py`, PyPI's `mcp` package) run over stdio, the agent granted
//! one of its tools, a scripted model calling it, a granted call answered and an ungranted one
//! refused.
//!
//! ```text
//! cargo run --example mcp --features mcp,testing
//! ```
//!
//! It needs a Python with PyPI's `mcp` package: SPACEBOT_PYTHON names it (`.ci/python` makes one),
//! or `python3` when `python3 -c "import mcp"` works. Without one it says so and exits with an
//! error.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use spacebot::mcp::Mcp;
use spacebot_core::testing::ScriptedLlm;
use spacebot_core::{AgentId, ChatMessage, InboundMessage, OrgConfig, Organization, Stores};

fn python() -> Option<String> {
    if let Ok(p) = std::env::var("SPACEBOT_PYTHON")
        && !p.is_empty()
    {
        return Some(p);
    }
    let works = std::process::Command::new("python3")
        .args(["-c", "import mcp.server.mcpserver"])
        .output()
        .is_ok_and(|o| o.status.success());
    works.then(|| "python3".to_owned())
}

#[tokio::main]
async fn main() -> ExitCode {
    let Some(python) = python() else {
        eprintln!(
            "examples/mcp needs a Python with PyPI's `mcp` package (version 2): set SPACEBOT_PYTHON \
             to one (`.ci/python` makes a venv with it), or install it so that \
             `python3 -c \"import mcp\"` works."
        );
        return ExitCode::FAILURE;
    };
    match run(&python).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("examples/mcp: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(python: &str) -> Result<(), Box<dyn std::error::Error>> {
    let server = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/spacebot-mcp/tests/fixtures/server.py"
    );
    let config = OrgConfig::from_toml_str(&format!(
        r#"
        [[agents]]
        id = "clerk"
        tools = ["calc:add"]

        [[mcp_servers]]
        id = "calc"
        command = {python:?}
        args = [{server:?}]
        start = "eager"
        timeout_ms = 20000
        "#
    ))?;
    let clerk = AgentId::parse("clerk")?;
    let llm = ScriptedLlm::new();
    // The model calls the granted tool, then one it was not granted, then answers.
    llm.push_tool_calls(
        &clerk,
        [
            ("calc__add", json!({"a": 19, "b": 23})),
            ("calc__secret", json!({})),
        ],
    );
    llm.push_text(&clerk, "19 + 23 = 42");

    let mcp = Mcp::new();
    let org = Organization::builder(config)
        .stores(Stores::memory())
        .llm(Arc::new(llm.clone()))
        .behaviour(Arc::new(mcp.clone()))
        .build()
        .await?;
    org.start_all().await?;
    mcp.wait_ready("calc", Duration::from_secs(20)).await?;
    println!("server calc: {:?}", mcp.server_state("calc"));
    println!("its tools: {}", mcp.tool_names("calc").join(", "));

    let mut replies = org.take_replies().ok_or("replies taken")?;
    org.deliver(
        "clerk",
        InboundMessage::new("portal", "u1", "What is 19 + 23?"),
    )
    .await?;
    let reply = futures::StreamExt::next(&mut replies)
        .await
        .ok_or("no reply")?;
    let asked = llm.requests_for(&clerk);
    let offered: Vec<String> = asked[0].tools.iter().map(|t| t.name.clone()).collect();
    println!("the clerk was offered: {}", offered.join(", "));
    if let Some(last) = asked.last() {
        for message in &last.messages {
            if let ChatMessage::Tool { content, .. } = message {
                println!("a tool answered: {content}");
            }
        }
    }
    println!("the clerk replied: {}", reply.content);
    mcp.shutdown();
    org.shutdown().await?;
    Ok(())
}
