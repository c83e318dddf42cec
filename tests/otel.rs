//! One OpenTelemetry trace per request, checked by a receiver no one here wrote: a small OTLP/HTTP
//! endpoint in Python (`tests/fixtures/otlp_receiver.py`) decoding with PyPI's
//! `opentelemetry-proto`. A two-hop delegation with a conversation on mock models reporting
//! usage, in memory and with the organization restarted between the hops (SQLite).
//!
//! Needs `SPACEBOT_PYTHON` (a Python with `opentelemetry-proto`, see `.ci/python`); without it
//! the test says why and returns, unless `SPACEBOT_REQUIRE_PYTHON=1`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use spacebot::llm::Usage;
use spacebot::testing::{FnLlm, OrgHarness, chat};
use spacebot::{AgentId, ChatMessage, ChatRequest, ChatResponse, EnvelopeKind, Stores, ToolCall};

const INPUT: u32 = 11;
const OUTPUT: u32 = 7;

/// The Python receiver: its port, and a pipe to ask it for what it received.
struct Receiver {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    port: u16,
}

impl Receiver {
    fn start() -> Option<Self> {
        let python = match std::env::var("SPACEBOT_PYTHON") {
            Ok(p) if !p.is_empty() => p,
            _ => {
                assert!(
                    std::env::var("SPACEBOT_REQUIRE_PYTHON").as_deref() != Ok("1"),
                    "SPACEBOT_REQUIRE_PYTHON=1 but SPACEBOT_PYTHON is not set"
                );
                eprintln!(
                    "skipped: SPACEBOT_PYTHON is not set (a Python with opentelemetry-proto; see .ci/python)"
                );
                return None;
            }
        };
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/otlp_receiver.py"
        );
        let mut child = Command::new(python)
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("the receiver starts");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let port = line.trim().parse().expect("the receiver prints its port");
        Some(Self {
            child,
            stdin,
            stdout,
            port,
        })
    }

    fn dump(&mut self) -> Value {
        writeln!(self.stdin, "dump").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn config(p: &str) -> String {
    format!(
        r#"
[[agents]]
id = "{p}chief"
name = "Chief"

[[agents]]
id = "{p}lead"
name = "Lead"

[[agents]]
id = "{p}worker"
name = "Worker"

[[links]]
from = "{p}chief"
to = "{p}lead"
relationship = "superior"

[[links]]
from = "{p}lead"
to = "{p}worker"
relationship = "superior"
"#
    )
}

fn with_usage(mut response: ChatResponse) -> ChatResponse {
    response.usage = Some(Usage {
        prompt_tokens: INPUT,
        completion_tokens: OUTPUT,
        total_tokens: INPUT + OUTPUT,
    });
    response
}

fn call(id: &str, name: &str, args: Value) -> ChatResponse {
    ChatResponse::tool_calls(vec![ToolCall {
        id: id.to_string(),
        name: name.to_string(),
        arguments: args.to_string(),
    }])
}

fn last_user(request: &ChatRequest) -> String {
    spacebot::testing::last_user_text(&request.messages)
}

/// chief delegates to lead, lead to worker; worker answers, lead answers, chief (woken by the
/// notice) opens a conversation with lead, lead answers in it, chief answers the user.
fn model(p: &'static str) -> FnLlm {
    FnLlm::new(move |request: &ChatRequest| {
        let agent = request
            .agent
            .as_ref()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let role = agent.strip_prefix(p).unwrap_or_default();
        let kind = request.envelope_kind;
        let answered = |id: &str| {
            request
                .messages
                .iter()
                .any(|m| matches!(m, ChatMessage::Tool { tool_call_id, .. } if tool_call_id == id))
        };
        let response = match (role, kind) {
            ("chief", Some(EnvelopeKind::UserMessage))
                if request
                    .channel
                    .as_ref()
                    .is_some_and(|c| c.as_str().starts_with("portal")) =>
            {
                call(
                    "call-delegate",
                    "send_agent_message",
                    json!({"target": format!("{p}lead"), "message": "Draft the plan."}),
                )
            }
            ("chief", Some(EnvelopeKind::Retrigger)) if !answered("call-link") => call(
                "call-link",
                "send_link_message",
                json!({"target": format!("{p}lead"), "message": "Thanks, well done."}),
            ),
            ("chief", Some(EnvelopeKind::Retrigger)) => ChatResponse::text("all done"),
            ("lead", Some(EnvelopeKind::TaskAssigned))
                if last_user(request).contains("part done") =>
            {
                ChatResponse::text("plan ready")
            }
            ("lead", Some(EnvelopeKind::TaskAssigned)) => call(
                "call-sub",
                "send_agent_message",
                json!({"target": format!("{p}worker"), "message": "Write the part."}),
            ),
            ("lead", Some(EnvelopeKind::UserMessage)) => ChatResponse::text("welcome"),
            ("worker", Some(EnvelopeKind::TaskAssigned)) => ChatResponse::text("part done"),
            _ => ChatResponse::text(""),
        };
        Ok(with_usage(response))
    })
}

async fn harness(p: &'static str, stores: Stores, llm: &FnLlm) -> OrgHarness {
    OrgHarness::builder(config(p))
        .stores(stores)
        .llm(Arc::new(llm.clone()))
        .build()
        .await
}

fn id(s: &str) -> AgentId {
    AgentId::parse(s).unwrap()
}

fn attr<'a>(span: &'a Value, key: &str) -> Option<&'a Value> {
    span["attributes"].get(key)
}

fn attr_str<'a>(span: &'a Value, key: &str) -> Option<&'a str> {
    attr(span, key).and_then(|a| a["value"].as_str())
}

/// Checks the trace of one scenario (agents named with prefix `p`), whose models answered
/// `calls` times.
fn check_trace(dump: &Value, p: &str, calls: usize) {
    let all = dump["spans"].as_array().unwrap();
    let ours: Vec<&Value> = all
        .iter()
        .filter(|s| {
            attr_str(s, "gen_ai.agent.id").is_some_and(|a| a.starts_with(p))
                && s["name"].as_str().unwrap().starts_with("invoke_agent")
        })
        .collect();
    let traces: HashSet<&str> = ours
        .iter()
        .map(|s| s["trace_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        traces.len(),
        1,
        "one trace for the whole request: {traces:?}"
    );
    let trace = *traces.iter().next().unwrap();
    let spans: Vec<&Value> = all.iter().filter(|s| s["trace_id"] == trace).collect();
    let by_id: HashMap<&str, &Value> = spans
        .iter()
        .map(|s| (s["span_id"].as_str().unwrap(), *s))
        .collect();
    let roots: Vec<&str> = spans
        .iter()
        .filter(|s| s["parent_span_id"].as_str().unwrap().is_empty())
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        roots,
        vec!["invoke_agent Chief"],
        "one root: the chief's first turn"
    );
    for span in &spans {
        let parent = span["parent_span_id"].as_str().unwrap();
        assert!(
            parent.is_empty() || by_id.contains_key(parent),
            "the parent of {} was exported in the trace",
            span["name"]
        );
    }
    let ancestors = |span: &Value| -> Vec<String> {
        let mut names = Vec::new();
        let mut parent = span["parent_span_id"].as_str().unwrap().to_string();
        while let Some(p) = by_id.get(parent.as_str()) {
            names.push(p["name"].as_str().unwrap().to_string());
            parent = p["parent_span_id"].as_str().unwrap().to_string();
        }
        names
    };
    let named = |name: &str| -> Vec<&Value> {
        spans
            .iter()
            .filter(|s| s["name"] == name)
            .copied()
            .collect()
    };
    // The worker's turn descends from its claim, the task's creation, the lead's tool call and
    // turn, the chief's tool call and its first turn.
    let worker = named("invoke_agent Worker");
    assert_eq!(worker.len(), 1, "one worker turn");
    assert_eq!(
        ancestors(worker[0]),
        vec![
            "spacebot.task.claim",
            "spacebot.task.create",
            "execute_tool send_agent_message",
            "invoke_agent Lead",
            "spacebot.task.claim",
            "spacebot.task.create",
            "execute_tool send_agent_message",
            "invoke_agent Chief",
        ]
    );
    assert!(
        !worker[0]["links"].as_array().unwrap().is_empty(),
        "a turn continuing a stored context links to it"
    );
    assert!(
        named("invoke_agent Chief").len() >= 2,
        "the chief's first turn and the one its notice woke"
    );
    assert!(!named("spacebot.notice.deliver").is_empty());
    assert!(!named("spacebot.task.complete").is_empty());
    let conversation = named("spacebot.conversation.message");
    assert!(
        !conversation.is_empty(),
        "the conversation's messages have spans"
    );
    assert!(attr_str(conversation[0], "gen_ai.conversation.id").is_some());
    // Model calls: the conventions' names and types, and the mock's usage summed.
    let chats: Vec<&Value> = spans
        .iter()
        .filter(|s| attr_str(s, "gen_ai.operation.name") == Some("chat"))
        .copied()
        .collect();
    assert_eq!(chats.len(), calls, "one chat span per model call");
    let (mut input, mut output) = (0, 0);
    for chat in &chats {
        assert!(chat["name"].as_str().unwrap().starts_with("chat "));
        assert_eq!(chat["kind"], 3, "a client span");
        assert_eq!(
            attr(chat, "gen_ai.usage.input_tokens").unwrap()["type"],
            "int"
        );
        assert_eq!(
            attr(chat, "gen_ai.usage.output_tokens").unwrap()["type"],
            "int"
        );
        input += attr(chat, "gen_ai.usage.input_tokens").unwrap()["value"]
            .as_str()
            .map(|v| v.parse::<u64>().unwrap())
            .or_else(|| attr(chat, "gen_ai.usage.input_tokens").unwrap()["value"].as_u64())
            .unwrap();
        output += attr(chat, "gen_ai.usage.output_tokens").unwrap()["value"]
            .as_u64()
            .or_else(|| {
                attr(chat, "gen_ai.usage.output_tokens").unwrap()["value"]
                    .as_str()
                    .map(|v| v.parse::<u64>().unwrap())
            })
            .unwrap();
        let reasons = attr(chat, "gen_ai.response.finish_reasons").unwrap();
        assert_eq!(reasons["type"], "array");
        assert_eq!(reasons["value"][0]["type"], "string");
        for key in ["gen_ai.provider.name", "gen_ai.request.model"] {
            assert_eq!(attr(chat, key).unwrap()["type"], "string", "{key}");
        }
        assert!(
            attr(chat, "gen_ai.input.messages").is_none(),
            "content is off by default"
        );
        assert!(
            attr(chat, "gen_ai.output.messages").is_none(),
            "content is off by default"
        );
        let parent = by_id[chat["parent_span_id"].as_str().unwrap()];
        assert!(parent["name"].as_str().unwrap().starts_with("invoke_agent"));
    }
    assert_eq!(input, u64::from(INPUT) * calls as u64);
    assert_eq!(output, u64::from(OUTPUT) * calls as u64);
    for tool in spans
        .iter()
        .filter(|s| attr_str(s, "gen_ai.operation.name") == Some("execute_tool"))
    {
        assert!(attr_str(tool, "gen_ai.tool.name").is_some());
        assert!(attr_str(tool, "gen_ai.tool.call.id").is_some());
    }
    for turn in named("invoke_agent Lead") {
        assert_eq!(attr_str(turn, "gen_ai.agent.name"), Some("Lead"));
        assert_eq!(
            attr_str(turn, "gen_ai.agent.id"),
            Some(format!("{p}lead").as_str())
        );
        assert!(attr_str(turn, "gen_ai.conversation.id").is_some());
    }
}

async fn flushed(otel: &Arc<spacebot::otel::Otel>) {
    let otel = otel.clone();
    tokio::task::spawn_blocking(move || otel.flush())
        .await
        .unwrap()
        .unwrap();
}

async fn in_memory(otel: &Arc<spacebot::otel::Otel>, receiver: &mut Receiver) {
    let llm = model("m");
    let mut h = harness("m", Stores::memory(), &llm).await;
    h.org.start_all().await.unwrap();
    h.org
        .deliver("mchief", chat("mchief", "Plan the launch."))
        .await
        .unwrap();
    assert_eq!(h.reply().await.content, "all done");
    h.wait_quiet().await;
    h.org.shutdown().await.unwrap();
    flushed(otel).await;
    check_trace(&receiver.dump(), "m", llm.requests().len());
}

/// The organization stops after chief and lead delegated and before the worker ran: the
/// worker's turn, after the restart, continues the trace stored with its task.
async fn restarted(otel: &Arc<spacebot::otel::Otel>, receiver: &mut Receiver) {
    let dir = tempfile::tempdir().unwrap();
    let llm = model("s");
    let stores = spacebot::sqlite::open(dir.path()).await.unwrap();
    let h = harness("s", stores.clone(), &llm).await;
    h.org.start_agent(&id("schief")).await.unwrap();
    h.org.start_agent(&id("slead")).await.unwrap();
    h.org
        .deliver("schief", chat("schief", "Plan the launch."))
        .await
        .unwrap();
    h.wait_until("the worker's task is stored", || {
        let stores = stores.clone();
        async move {
            !stores
                .tasks
                .list(&id("sworker"), &Default::default())
                .await
                .unwrap()
                .is_empty()
        }
    })
    .await;
    h.wait_idle("slead").await;
    h.wait_idle("schief").await;
    h.org.shutdown().await.unwrap();
    drop(h);
    stores.close().await;

    let stores = spacebot::sqlite::open(dir.path()).await.unwrap();
    let mut h = harness("s", stores.clone(), &llm).await;
    h.org.start_all().await.unwrap();
    assert_eq!(h.reply().await.content, "all done");
    h.wait_quiet().await;
    h.org.shutdown().await.unwrap();
    drop(h);
    stores.close().await;
    flushed(otel).await;
    check_trace(&receiver.dump(), "s", llm.requests().len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_per_request_across_hops_and_a_restart() {
    let Some(mut receiver) = Receiver::start() else {
        return;
    };
    let otel = Arc::new(
        spacebot::otel::builder()
            .endpoint(format!("http://127.0.0.1:{}", receiver.port))
            .metric_interval(Duration::from_secs(3600))
            .init()
            .unwrap(),
    );
    in_memory(&otel, &mut receiver).await;
    restarted(&otel, &mut receiver).await;
}
