//! One OpenTelemetry trace per request, checked by a receiver no one here wrote: a small OTLP/HTTP
//! endpoint in Python (`tests/fixtures/otlp_receiver.py`) decoding with PyPI's
//! `opentelemetry-proto`. A two-hop delegation with a conversation on mock models reporting
//! usage, in memory, with the organization restarted between the hops (SQLite), and with the hops
//! run by two processes sharing one PostgreSQL schema (the second process is this test binary
//! again, `otel_child`, exporting to the same receiver); a turn whose commit fails once (the
//! store commit and retry spans); the metrics the receiver got.
//!
//! Needs `SPACEBOT_PYTHON` (a Python with `opentelemetry-proto`, see `.ci/python`); where neither
//! it nor `.ci/python`'s environment is at hand the tests are compiled as ignored, with the reason
//! (`cfg(spacebot_python)`, set by the build script), unless `SPACEBOT_REQUIRE_PYTHON=1`, when
//! they run and fail without it. The PostgreSQL test needs a server likewise (`cfg(spacebot_pg)`,
//! `SPACEBOT_REQUIRE_POSTGRES=1`).
//!
//! The tests of this binary share one receiver and one exporter (a process has one global
//! subscriber) and run one at a time.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[cfg(feature = "postgres")]
#[path = "support/shared_stores.rs"]
mod shared_stores;

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;

use serde_json::{Value, json};
use spacebot::envelope::{DeliveryStore, Envelope, TurnCommit};
use spacebot::error::StoreError;
use spacebot::ids::EnvelopeId;
use spacebot::llm::Usage;
use spacebot::testing::{FnLlm, OrgHarness, chat};
use spacebot::{
    AgentId, ChatMessage, ChatRequest, ChatResponse, EnvelopeKind, Stores, Timestamp, ToolCall,
};

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
        let python = spacebot::testing::external::python();
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/otlp_receiver.py"
        );
        // Its errors go to a file: it outlives the test (the tests share it), and a test runner
        // waits for whoever holds the test's own stderr.
        let errors = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(concat!(
                env!("CARGO_TARGET_TMPDIR"),
                "/otlp_receiver.stderr"
            ))
            .expect("the receiver's error file opens");
        let mut child = Command::new(python)
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(errors)
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

/// The receiver and the exporter the tests of this binary share (a process has one global
/// subscriber), and the lock that runs them one at a time (the metrics are the process's).
struct Shared {
    receiver: Mutex<Receiver>,
    otel: Arc<spacebot::otel::Otel>,
    serial: tokio::sync::Mutex<()>,
}

impl Shared {
    fn dump(&self) -> Value {
        self.receiver
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .dump()
    }

    fn endpoint(&self) -> String {
        let port = self.receiver.lock().unwrap_or_else(|e| e.into_inner()).port;
        format!("http://127.0.0.1:{port}")
    }

    async fn flushed(&self) {
        let otel = self.otel.clone();
        tokio::task::spawn_blocking(move || otel.flush())
            .await
            .unwrap()
            .unwrap();
    }
}

/// The shared receiver and exporter, started by the first test; `None` (said once) without
/// `SPACEBOT_PYTHON`.
fn shared() -> Option<&'static Shared> {
    static SHARED: OnceLock<Option<Shared>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            let receiver = Receiver::start()?;
            let otel = spacebot::otel::builder()
                .endpoint(format!("http://127.0.0.1:{}", receiver.port))
                .metric_interval(Duration::from_secs(3600))
                .init()
                .unwrap();
            Some(Shared {
                receiver: Mutex::new(receiver),
                otel: Arc::new(otel),
                serial: tokio::sync::Mutex::new(()),
            })
        })
        .as_ref()
}

/// The latest value of the metric `name` at the point whose attributes include `with`: the
/// receiver keeps every export, and the points are cumulative.
fn metric_point<'a>(dump: &'a Value, name: &str, with: &[(&str, &str)]) -> Option<&'a Value> {
    dump["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["name"] == name)
        .flat_map(|m| m["points"].as_array().unwrap())
        .rfind(|p| {
            with.iter()
                .all(|(k, v)| p["attributes"][*k]["value"].as_str() == Some(*v))
        })
}

/// The metrics: token usage and model call durations agree with each other (every mock call of
/// this process reports the same usage), and the chief's turns were timed.
fn check_metrics(dump: &Value, chief: &str, chief_turns: usize, calls: usize) {
    let durations = metric_point(dump, "gen_ai.client.operation.duration", &[])
        .expect("model call durations were exported");
    let count = durations["count"].as_u64().unwrap();
    assert!(count >= calls as u64, "{count} durations for {calls} calls");
    assert!(durations["sum"].as_f64().unwrap() > 0.0);
    for (kind, per_call) in [("input", INPUT), ("output", OUTPUT)] {
        let tokens = metric_point(
            dump,
            "gen_ai.client.token.usage",
            &[
                ("gen_ai.token.type", kind),
                ("gen_ai.operation.name", "chat"),
            ],
        )
        .unwrap_or_else(|| panic!("{kind} token usage was exported"));
        assert_eq!(tokens["count"].as_u64().unwrap(), count);
        assert_eq!(
            tokens["sum"].as_f64().unwrap(),
            f64::from(per_call) * count as f64,
            "{kind} tokens: {per_call} per call"
        );
    }
    let turns = metric_point(
        dump,
        "spacebot.turn.duration",
        &[("gen_ai.agent.id", chief)],
    )
    .expect("the chief's turn durations were exported");
    assert_eq!(turns["count"].as_u64().unwrap(), chief_turns as u64);
}

/// A turn's commit is a `spacebot.store.commit` span in the turn, written in one attempt.
fn check_commits(dump: &Value, p: &str) {
    let spans = dump["spans"].as_array().unwrap();
    let by_id: HashMap<&str, &Value> = spans
        .iter()
        .map(|s| (s["span_id"].as_str().unwrap(), s))
        .collect();
    let commits: Vec<&Value> = spans
        .iter()
        .filter(|s| s["name"] == "spacebot.store.commit")
        .filter(|s| {
            by_id
                .get(s["parent_span_id"].as_str().unwrap())
                .is_some_and(|turn| {
                    turn["name"].as_str().unwrap().starts_with("invoke_agent")
                        && attr_str(turn, "gen_ai.agent.id").is_some_and(|a| a.starts_with(p))
                })
        })
        .collect();
    assert!(!commits.is_empty(), "the turns' commits have spans");
    for commit in commits {
        assert_eq!(attr(commit, "spacebot.store.attempts").unwrap()["value"], 1);
        assert_eq!(
            attr(commit, "spacebot.store.consumed").unwrap()["type"],
            "int"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_python),
    ignore = "no Python with the protocol kits here: set SPACEBOT_PYTHON (see .ci/python); see README"
)]
async fn one_trace_per_request_across_hops() {
    let Some(shared) = shared() else {
        return;
    };
    let _serial = shared.serial.lock().await;
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
    shared.flushed().await;
    let dump = shared.dump();
    let calls = llm.requests().len();
    check_trace(&dump, "m", calls);
    check_commits(&dump, "m");
    let chief_turns = dump["spans"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| {
            s["name"] == "invoke_agent Chief" && attr_str(s, "gen_ai.agent.id") == Some("mchief")
        })
        .count();
    check_metrics(&dump, "mchief", chief_turns, calls);
}

/// The organization stops after chief and lead delegated and before the worker ran: the
/// worker's turn, after the restart, continues the trace stored with its task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_python),
    ignore = "no Python with the protocol kits here: set SPACEBOT_PYTHON (see .ci/python); see README"
)]
async fn one_trace_per_request_across_a_restart() {
    let Some(shared) = shared() else {
        return;
    };
    let _serial = shared.serial.lock().await;
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
    shared.flushed().await;
    check_trace(&shared.dump(), "s", llm.requests().len());
}

/// A delivery store whose turn commits fail `failures` times, then go through.
#[derive(Debug)]
struct FlakyCommits {
    inner: Arc<dyn DeliveryStore>,
    failures: AtomicU32,
}

#[async_trait]
impl DeliveryStore for FlakyCommits {
    async fn persist(&self, agent: &AgentId, envelope: &Envelope) -> Result<(), StoreError> {
        self.inner.persist(agent, envelope).await
    }
    async fn pending(&self, agent: &AgentId) -> Result<Vec<Envelope>, StoreError> {
        self.inner.pending(agent).await
    }
    async fn remove(&self, agent: &AgentId, id: &EnvelopeId) -> Result<(), StoreError> {
        self.inner.remove(agent, id).await
    }
    async fn mark_applied(
        &self,
        agent: &AgentId,
        key: &str,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.inner.mark_applied(agent, key, now).await
    }
    async fn is_applied(&self, agent: &AgentId, key: &str) -> Result<bool, StoreError> {
        self.inner.is_applied(agent, key).await
    }
    async fn commit(
        &self,
        agent: &AgentId,
        commit: &TurnCommit,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        // Only a turn's commit (what consumes envelopes), not the records written during it.
        let failing = !commit.consumed.is_empty()
            && self
                .failures
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
        if failing {
            return Err(StoreError::Backend {
                backend: "test",
                message: "the connection dropped".into(),
                source: None,
            });
        }
        self.inner.commit(agent, commit, now).await
    }
}

/// A commit that fails once is retried: a `spacebot.store.retry` span (the failed try and the
/// wait) inside the commit's span, which took two attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_python),
    ignore = "no Python with the protocol kits here: set SPACEBOT_PYTHON (see .ci/python); see README"
)]
async fn a_retried_commit_has_its_spans() {
    let Some(shared) = shared() else {
        return;
    };
    let _serial = shared.serial.lock().await;
    let mut stores = Stores::memory();
    stores.deliveries = Arc::new(FlakyCommits {
        inner: stores.deliveries.clone(),
        failures: AtomicU32::new(1),
    });
    let llm = FnLlm::new(|_: &ChatRequest| Ok(with_usage(ChatResponse::text("noted"))));
    let mut h = harness("r", stores, &llm).await;
    h.org.start_all().await.unwrap();
    h.org
        .deliver("rworker", chat("rworker", "Note this."))
        .await
        .unwrap();
    assert_eq!(h.reply().await.content, "noted");
    h.wait_quiet().await;
    h.org.shutdown().await.unwrap();
    shared.flushed().await;
    let dump = shared.dump();
    let spans = dump["spans"].as_array().unwrap();
    let turn = spans
        .iter()
        .find(|s| attr_str(s, "gen_ai.agent.id") == Some("rworker"))
        .expect("the worker's turn");
    let commit = spans
        .iter()
        .find(|s| s["name"] == "spacebot.store.commit" && s["parent_span_id"] == turn["span_id"])
        .expect("the turn's commit has a span in the turn");
    assert_eq!(attr(commit, "spacebot.store.attempts").unwrap()["value"], 2);
    let retries: Vec<&Value> = spans
        .iter()
        .filter(|s| s["name"] == "spacebot.store.retry" && s["parent_span_id"] == commit["span_id"])
        .collect();
    assert_eq!(retries.len(), 1, "one retry span");
    let retry = retries[0];
    assert_eq!(
        attr_str(retry, "spacebot.retry.operation"),
        Some("committing a turn")
    );
    assert_eq!(attr(retry, "spacebot.retry.attempt").unwrap()["value"], 1);
    assert_eq!(
        attr(retry, "spacebot.retry.backoff_ms").unwrap()["type"],
        "int"
    );
    assert_eq!(attr_str(retry, "error.type"), Some("store"));
    assert_eq!(retry["status"], 2, "an error status");
}

// ---------------------------------------------------------------------------------------------
// Two processes on one PostgreSQL schema.

/// Set in the child process: the run directory (where `stop` appears and the child writes how
/// many model calls it made).
#[cfg(feature = "postgres")]
const CHILD_DIR: &str = "SPACEBOT_OTEL_CHILD_DIR";
#[cfg(feature = "postgres")]
const CHILD_SCHEMA: &str = "SPACEBOT_OTEL_CHILD_SCHEMA";

/// A process hosting `agents` of the `p` organization on the shared schema.
#[cfg(feature = "postgres")]
async fn placed(
    stores: &spacebot::postgres::PgStores,
    process: &str,
    agents: &[&str],
    llm: &FnLlm,
) -> OrgHarness {
    use spacebot::placement::{PlacementOptions, ProcessId};
    let options = PlacementOptions::new(ProcessId::new(process).unwrap())
        .with_lease(
            Duration::from_secs(5),
            Duration::from_millis(500),
            Duration::from_secs(1),
        )
        .with_check_interval(Duration::from_millis(100))
        .with_agents(agents.iter().map(|a| id(a)));
    let mut h = OrgHarness::builder(config("p"))
        .stores(stores.stores())
        .llm(Arc::new(llm.clone()))
        .placement(Arc::new(stores.placement()), options)
        .build()
        .await;
    h.timeout = Duration::from_secs(30);
    h
}

/// The second process: hosts the lead until `stop` appears in the run directory, then waits until
/// its part is quiet, writes how many model calls it made, and flushes its spans as it exits.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the second process of the PostgreSQL telemetry test (run by it with SPACEBOT_OTEL_CHILD_DIR set)"]
async fn otel_child() {
    let Ok(dir) = std::env::var(CHILD_DIR) else {
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    let otel = spacebot::otel::builder()
        .metric_interval(Duration::from_secs(3600))
        .init()
        .unwrap();
    let url = std::env::var("DATABASE_URL").unwrap();
    let pg = spacebot::postgres::PgOptions::new()
        .schema(std::env::var(CHILD_SCHEMA).unwrap())
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    let llm = model("p");
    let h = placed(&pg, "b", &["plead"], &llm).await;
    h.org.start_all().await.unwrap();
    h.wait_until("the parent is done", || {
        let stop = dir.join("stop");
        async move { stop.exists() }
    })
    .await;
    h.wait_quiet().await;
    h.org.shutdown().await.unwrap();
    drop(h);
    pg.close().await;
    tokio::task::spawn_blocking(move || drop(otel))
        .await
        .unwrap();
    std::fs::write(dir.join("calls"), llm.requests().len().to_string()).unwrap();
}

/// The chief and the worker run in this process, the lead in another (this binary again), on one
/// PostgreSQL schema, both exporting to the receiver: every hop crosses a process, and the
/// request is still one trace with the same parent/child relations.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_pg),
    ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README"
)]
#[cfg_attr(
    all(spacebot_pg, not(spacebot_python)),
    ignore = "no Python with the protocol kits here: set SPACEBOT_PYTHON (see .ci/python); see README"
)]
async fn one_trace_per_request_across_two_processes_on_postgres() {
    let Some(url) = spacebot::testing::external::database_url() else {
        return;
    };
    let Some(shared) = shared() else {
        return;
    };
    let _serial = shared.serial.lock().await;
    let pg = spacebot::postgres::PgOptions::new()
        .max_connections(4)
        .temporary(&url)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let stderr = std::fs::File::create(dir.path().join("child.stderr")).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "otel_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--quiet",
        ])
        .env(CHILD_DIR, dir.path())
        .env("DATABASE_URL", &url)
        .env(CHILD_SCHEMA, pg.schema().unwrap())
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", shared.endpoint())
        .env("OTEL_SERVICE_NAME", "spacebot-b")
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap();
    struct Reap<'a>(&'a mut Child);
    impl Drop for Reap<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let child = Reap(&mut child);
    let llm = model("p");
    let mut h = placed(&pg, "a", &["pchief", "pworker"], &llm).await;
    h.org.ensure_link_channels().await.unwrap();
    h.org.start_all().await.unwrap();
    h.org
        .deliver("pchief", chat("pchief", "Plan the launch."))
        .await
        .unwrap();
    assert_eq!(h.reply().await.content, "all done");
    // Both processes' parts quiet: this one's agents idle and nothing waiting in the stores (the
    // lead's conversation turn runs in the other process), then the other one stops and this one
    // answers what it said last.
    let stores = pg.stores();
    h.wait_until("nothing waits in the shared stores", || {
        let stores = stores.clone();
        async move { shared_stores::nothing_waits(&stores, &["pchief", "plead", "pworker"]).await }
    })
    .await;
    std::fs::write(dir.path().join("stop"), b"").unwrap();
    h.wait_until("the second process exits", || {
        let calls = dir.path().join("calls");
        async move { calls.exists() }
    })
    .await;
    let status = child.0.wait().unwrap();
    assert!(
        status.success(),
        "the second process failed: {}",
        std::fs::read_to_string(dir.path().join("child.stderr")).unwrap_or_default()
    );
    drop(child);
    h.wait_until("nothing waits in the shared stores", || {
        let stores = stores.clone();
        async move { shared_stores::nothing_waits(&stores, &["pchief", "plead", "pworker"]).await }
    })
    .await;
    h.wait_quiet().await;
    h.org.shutdown().await.unwrap();
    drop(h);
    shared.flushed().await;
    let theirs: usize = std::fs::read_to_string(dir.path().join("calls"))
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        theirs > 0,
        "the lead's model calls ran in the other process"
    );
    let dump = shared.dump();
    check_trace(&dump, "p", llm.requests().len() + theirs);
    let services: HashSet<&str> = dump["spans"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| attr_str(s, "gen_ai.agent.id").is_some_and(|a| a.starts_with('p')))
        .map(|s| s["resource"]["service.name"]["value"].as_str().unwrap())
        .collect();
    assert_eq!(
        services,
        HashSet::from(["spacebot", "spacebot-b"]),
        "turns exported by both processes"
    );
    pg.close().await;
}
