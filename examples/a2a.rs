//! Two organizations in two processes talking over A2A 1.0 on 127.0.0.1.
//!
//! This process runs the organization "front": its agent `boss` delegates to `far`, a member
//! declared as a remote A2A agent (`a2a = "http://..."`). It starts itself again as a child
//! process running the organization "back", whose agent `expert` is exposed over A2A
//! (`a2a_expose = true`) behind a bearer token. The delegation travels over A2A (the agent card,
//! `SendMessage`, then `GetTask` until done), the expert's answer completes the task of `far`, and
//! `boss` is told. Both organizations run on the scripted mock model.
//!
//! ```text
//! cargo run --example a2a --features a2a,testing
//! ```

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde_json::json;
use spacebot::a2a::{A2a, A2aServer, RetryPolicy, remote_executors};
use spacebot_core::runtime::ChannelOutbound;
use spacebot_core::testing::ScriptedLlm;
use spacebot_core::{AgentId, InboundMessage, OrgConfig, Organization, Stores};
use tokio::io::AsyncBufReadExt;

const TOKEN: &str = "example-token";

fn agent(id: &str) -> AgentId {
    #[allow(clippy::expect_used)]
    AgentId::parse(id).expect("a valid agent id")
}

/// The child: the organization "back", serving `expert` over A2A until its standard input closes.
async fn back() -> Result<(), Box<dyn std::error::Error>> {
    let config = OrgConfig::from_toml_str(
        "[[agents]]\nid = \"expert\"\nname = \"Expert\"\na2a_expose = true\n",
    )?;
    let llm = ScriptedLlm::new();
    llm.push_text(&agent("expert"), "the expert says: 42");
    let a2a = A2a::new();
    let org = Organization::builder(config)
        .stores(Stores::memory())
        .llm(Arc::new(llm))
        .behaviour(Arc::new(a2a.clone()))
        .outbound(Arc::new(a2a.clone()))
        .build()
        .await?;
    org.start_all().await?;
    let server = A2aServer::new(org.clone(), a2a)?.with_token(Some(TOKEN.into()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("PORT {}", listener.local_addr()?.port());
    tokio::spawn(server.serve(listener));
    // Until the parent is done (it closes our standard input).
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(_)) = lines.next_line().await {}
    org.shutdown().await?;
    Ok(())
}

/// The parent: the organization "front", delegating to the remote `far`.
async fn front() -> Result<(), Box<dyn std::error::Error>> {
    let mut child = tokio::process::Command::new(std::env::current_exe()?)
        .arg("back")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let line = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::io::BufReader::new(stdout).lines().next_line(),
    )
    .await??
    .ok_or("the child printed no port")?;
    let port: u16 = line.trim_start_matches("PORT ").trim().parse()?;
    let url = format!("http://127.0.0.1:{port}/a2a/expert");
    println!("back:  expert served over A2A at {url} (card at {url}/.well-known/agent-card.json)");

    let config = OrgConfig::from_toml_str(&format!(
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
"#
    ))?;
    let llm = ScriptedLlm::new();
    let boss = agent("boss");
    llm.push_tool_call(
        &boss,
        "send_agent_message",
        json!({"target": "far", "message": "What is the answer?"}),
    );
    llm.push_text(&boss, "I asked the expert of the other organization.");
    llm.push_text(&boss, "The other organization's expert answered: 42.");
    let (outbound, mut replies) = ChannelOutbound::new();
    let mut builder = Organization::builder(config.clone())
        .stores(Stores::memory())
        .llm(Arc::new(llm.clone()))
        .behaviour(Arc::new(A2a::new()))
        .outbound(Arc::new(outbound));
    for (id, executor) in remote_executors(&config, &RetryPolicy::default())? {
        builder = builder.task_executor(id, executor);
    }
    let org = builder.build().await?;
    org.start_all().await?;
    println!("front: boss delegates to far, a remote A2A agent");
    org.deliver(
        "boss",
        InboundMessage::new("portal", "u1", "Ask the expert."),
    )
    .await?;
    let first = tokio::time::timeout(Duration::from_secs(30), replies.next())
        .await?
        .ok_or("the reply stream closed")?;
    println!("front: {} says: {}", first.agent, first.content);
    // The task of far is run by the A2A client: sent to the other organization, polled until done.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let task = loop {
        let task = org.stores().tasks.get(&agent("far"), 1).await?;
        if let Some(task) = task.filter(|t| t.status.is_terminal()) {
            break task;
        }
        if tokio::time::Instant::now() > deadline {
            return Err("the task of far did not end within 30 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    println!(
        "front: task far#1 is {:?}: {}",
        task.status,
        task.result.or(task.error).unwrap_or_default()
    );
    // The result retriggers boss: its model is shown the expert's answer.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !llm
        .requests_for(&boss)
        .last()
        .is_some_and(|r| format!("{:?}", r.messages).contains("the expert says: 42"))
    {
        if tokio::time::Instant::now() > deadline {
            return Err("boss was not told the result within 30 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!("front: boss was told the result of far#1 and answered again");
    org.shutdown().await?;
    drop(child.stdin.take());
    let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let result = if std::env::args().nth(1).as_deref() == Some("back") {
        back().await
    } else {
        front().await
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("examples/a2a: {e}");
            ExitCode::FAILURE
        }
    }
}
