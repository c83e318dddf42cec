//! The workload a child process runs: a whole organization on a durable backend, behind the
//! failpoint wrapper, answering a fixed list of jobs. Killed and run again on the same directory, it
//! delivers only the jobs not acknowledged yet and runs until every job is answered.
//!
//! - `job-1` to `chief`, delegated over two hops (chief -> lead -> worker) and answered when the
//!   completion notice comes back;
//! - `job-2` to `late`, an agent that is stopped when it arrives and started afterwards;
//! - `job-3` to `ann`, who asks her peer `bob` in a mirrored conversation; bob concludes it and
//!   the conclusion wakes ann, who answers;
//! - `job-4`, a child agent of `ann` (`Organization::spawn_child`) whose result wakes ann;
//! - `job-5` to `chief`, answered directly.
//!
//! The budget workload (`SPACEBOT_CRASH_WORKLOAD=budget`, a separate, smaller sweep) has one job:
//!
//! - `job-6` to `a`, who in one turn opens a conversation with `b` and delegates a slow job to `c`;
//!   `a` and `b` always answer, so the conversation's turn budget (4) is spent and it is severed.
//!   `c` is started only once the conversation is severed (its job is "slow"), so a kill between
//!   the spent budget and `c`'s result is a restart between the two. `c`'s result wakes `a` in the
//!   same exchange, and `a` calls `send_link_message(b)` again: that must be refused (a budget is
//!   never granted again to one exchange, restart or not). `a` then answers `FINAL job-6`.
//!
//! The notes workload (`SPACEBOT_CRASH_WORKLOAD=notes`) has four jobs, `job-7` to `job-10`, each
//! delivered (once the one before was answered) to `w1` or `w2` in turn. Each turn reads the shared
//! note `log` and writes it back with its job appended as a line (`write_shared_note`, compared and
//! set against the version read); the agent answers `FINAL job-N` once the write was acknowledged.
//! The model appends blindly: a turn run again after a kill appends its line again, and only the
//! write's effect key (`ToolContext::key`) keeps the note from holding it twice. A turn run again
//! after a kill can be steered (the next job arrives while it runs, once its reply was out): the
//! resumed frame continues from its own last tool result, as a model reading its conversation
//! would, so a write acknowledged before the steer is not asked for again under a new key.
//!
//! The limits workload (`SPACEBOT_CRASH_WORKLOAD=limits`) has one job, `job-11`, delivered to
//! `chief` with a limit of [`LIMIT_CALLS`] model calls (`InboundMessage::with_limits`): the chief
//! delegates to `lead`, who delegates to `w1` and `w2` in one response; the tree needs more
//! calls than the limit, so the request is stopped and the user told. Every model call is logged
//! (`call <agent>` in `models.log`, synced before the model answers): however the kills fall
//! (between a reservation and its settlement, after a call and before its turn's commit), the
//! calls made never exceed the limit.
//!
//! Files in the run directory: `ack.log` (`ack <job> <envelope>` once `deliver` returned Ok,
//! `spawn <job> <child>` once `spawn_child` did), `replies.jsonl` (every reply to the application's
//! outbound), `models.log` (`run <agent> <channel>` before the model answers a task's turn: how
//! many times a task's model really ran). All are appended with `sync_data`.

use spacebot::testing::last_user_text as last_user;
use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::json;
use spacebot::config::OrgConfig;
use spacebot::conversation::{ConversationFilter, ConversationStatus};
use spacebot::llm::ChatResponse;
use spacebot::runtime::OutboundError;
use spacebot::testing::{FnLlm, tool_call};
use spacebot::{
    AgentId, ChatMessage, ChatRequest, ChildSpec, EnvelopeKind, InboundMessage, LlmProvider,
    Organization, Outbound, Reply, ReplyKind, Source, Stores,
};
use tokio::sync::watch;

use super::failpoint::Failpoint;

/// The environment variable that makes the test binary run the workload: the run directory.
pub const CHILD_DIR: &str = "SPACEBOT_CRASH_CHILD_DIR";
/// The backend the child opens: `sqlite` or `redb`.
pub const CHILD_BACKEND: &str = "SPACEBOT_CRASH_BACKEND";
/// The write to stop before (none: run to completion).
pub const CHILD_AT: &str = "SPACEBOT_CRASH_AT";
/// What a finished child prints last: `WRITES <n>`.
pub const WRITES: &str = "WRITES";
/// The workload the child runs: `org` (the default) or `budget`.
pub const CHILD_WORKLOAD: &str = "SPACEBOT_CRASH_WORKLOAD";
/// Set: the child stops at its first write (or model call) after a task was claimed.
pub const CHILD_AFTER_CLAIM: &str = "SPACEBOT_CRASH_AFTER_CLAIM";

/// Which workload a child runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// The whole organization: jobs 1 to 5.
    Org,
    /// A spent conversation budget and a retrigger, and a task claimed by `c`: job 6.
    Budget,
    /// Turns that write a shared note: jobs 7 to 10.
    Notes,
    /// A request under a limit of model calls fanned out over two hops: job 11.
    Limits,
}

impl Workload {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Org => "org",
            Self::Budget => "budget",
            Self::Notes => "notes",
            Self::Limits => "limits",
        }
    }

    pub fn parse(s: &str) -> Self {
        match s {
            "org" => Self::Org,
            "budget" => Self::Budget,
            "notes" => Self::Notes,
            "limits" => Self::Limits,
            other => panic!("unknown workload {other}"),
        }
    }

    /// The jobs a run answers.
    pub fn jobs(self) -> &'static [&'static str] {
        match self {
            Self::Org => &JOBS,
            Self::Budget => &BUDGET_JOBS,
            Self::Notes => &NOTES_JOBS,
            Self::Limits => &LIMITS_JOBS,
        }
    }

    /// The agents of its organization.
    pub fn agents(self) -> &'static [&'static str] {
        match self {
            Self::Org => &["chief", "lead", "worker", "ann", "bob", "late"],
            Self::Budget => &["a", "b", "c"],
            Self::Notes => &["w1", "w2"],
            Self::Limits => &["chief", "lead", "w1", "w2"],
        }
    }
}

/// Every job of the workload; each is answered by a reply starting with `FINAL` naming it.
pub const JOBS: [&str; 5] = ["job-1", "job-2", "job-3", "job-4", "job-5"];

/// The job answered by a child agent (spawned, not delivered).
pub const CHILD_JOB: &str = "job-4";

/// The job of the budget workload.
pub const BUDGET_JOBS: [&str; 1] = ["job-6"];

/// The jobs of the notes workload, answered in this order.
pub const NOTES_JOBS: [&str; 4] = ["job-7", "job-8", "job-9", "job-10"];

/// The job of the limits workload.
pub const LIMITS_JOBS: [&str; 1] = ["job-11"];

/// The limit of model calls of the limits workload's request: the tree needs more (the chief,
/// the lead, two workers, the lead woken, the chief woken), so it is reached in every run.
pub const LIMIT_CALLS: u64 = 4;

pub const LIMITS_CONFIG: &str = r#"
[settings]
max_tool_rounds = 6

[[agents]]
id = "chief"
[[agents]]
id = "lead"
[[agents]]
id = "w1"
[[agents]]
id = "w2"

[[links]]
from = "chief"
to = "lead"
direction = "one_way"
relationship = "superior"
[[links]]
from = "lead"
to = "w1"
direction = "one_way"
relationship = "superior"
[[links]]
from = "lead"
to = "w2"
direction = "one_way"
relationship = "superior"
"#;

/// The shared note the notes workload writes, and its first text.
pub const NOTE: &str = "log";
pub const NOTE_START: &str = "log";

pub const NOTES_CONFIG: &str = r#"
[settings]
max_tool_rounds = 6

[[agents]]
id = "w1"
[[agents]]
id = "w2"

[[notes]]
name = "log"
text = "log"
writers = ["w1", "w2"]
"#;

/// The conversation turn budget of the budget workload.
pub const BUDGET: u32 = 4;

/// What `a` sends `b` when `c`'s result woke it: must never reach `b`.
pub const AGAIN: &str = "hello again";

/// How long a run may take to answer every job before it fails.
const RUN_TIMEOUT: Duration = Duration::from_secs(30);

pub const CONFIG: &str = r#"
[settings]
max_tool_rounds = 6

[[agents]]
id = "chief"
name = "Chief"
[[agents]]
id = "lead"
name = "Lead"
[[agents]]
id = "worker"
name = "Worker"
[[agents]]
id = "ann"
name = "Ann"
[[agents]]
id = "bob"
name = "Bob"
[[agents]]
id = "late"
name = "Late"

[[links]]
from = "chief"
to = "lead"
direction = "one_way"
relationship = "superior"
[[links]]
from = "lead"
to = "worker"
direction = "one_way"
relationship = "superior"
[[links]]
from = "ann"
to = "bob"
direction = "two_way"
relationship = "peer"
"#;

pub const BUDGET_CONFIG: &str = r#"
[settings]
max_tool_rounds = 6
conversation_turn_budget = 4

[[agents]]
id = "a"
name = "Alpha"
[[agents]]
id = "b"
name = "Beta"
[[agents]]
id = "c"
name = "Gamma"

[[links]]
from = "a"
to = "b"
direction = "two_way"
relationship = "peer"
[[links]]
from = "a"
to = "c"
direction = "one_way"
relationship = "superior"
"#;

pub fn id(s: &str) -> AgentId {
    AgentId::parse(s).expect("a valid agent id")
}

/// The job ids named in `text`, in order, each once.
pub fn job_ids(text: &str) -> Vec<String> {
    let mut found: Vec<String> = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("job-") {
        let digits: String = rest[at + 4..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        if !digits.is_empty() {
            let job = format!("job-{digits}");
            if !found.contains(&job) {
                found.push(job);
            }
        }
        rest = &rest[at + 4..];
    }
    found
}

/// The model: a deterministic function of the asking agent, the kind of envelope it answers, and
/// the last user message (the job ids travel in the texts).
pub fn model(req: &ChatRequest) -> ChatResponse {
    let me = req.agent.as_ref().map(AgentId::as_str).unwrap_or("");
    let text = last_user(&req.messages);
    let jobs = job_ids(&text).join(" ");
    let tool_round = spacebot::testing::tool_round(&req.messages);
    let kind = req.envelope_kind;
    match me {
        "chief" => match kind {
            Some(EnvelopeKind::UserMessage) if text.contains("delegate") && !tool_round => {
                ChatResponse::tool_calls(vec![tool_call(
                    "send_agent_message",
                    json!({"target": "lead", "message": format!("{jobs} for the lead")}),
                )])
            }
            _ => ChatResponse::text(format!("FINAL {jobs} (chief)")),
        },
        "lead" if text.contains("have ended") => ChatResponse::text(format!("lead result {jobs}")),
        "lead" => ChatResponse::tool_calls(vec![tool_call(
            "send_agent_message",
            json!({"target": "worker", "message": format!("{jobs} for the worker")}),
        )]),
        "worker" => ChatResponse::text(format!("worker result {jobs}")),
        "ann" => match kind {
            Some(EnvelopeKind::UserMessage) if text.contains("ask bob") && !tool_round => {
                ChatResponse::tool_calls(vec![tool_call(
                    "send_link_message",
                    json!({"target": "bob", "message": format!("{jobs}: what is the answer?")}),
                )])
            }
            Some(EnvelopeKind::UserMessage) => ChatResponse::text(format!("ACK {jobs} asked bob")),
            _ => ChatResponse::text(format!("FINAL {jobs} (ann)")),
        },
        "bob" => ChatResponse::tool_calls(vec![tool_call(
            "conclude_link",
            json!({"summary": format!("{jobs} bob says 42")}),
        )]),
        "late" => ChatResponse::text(format!("FINAL {jobs} (late)")),
        // A child of ann.
        _ => ChatResponse::text(format!("child result {jobs}")),
    }
}

/// Whether the model is in a tool round of the envelope it answers (a tool result after the last
/// user message; earlier turns' tool records in the history do not count).
fn in_tool_round(messages: &[ChatMessage]) -> bool {
    for m in messages.iter().rev() {
        match m {
            ChatMessage::Tool { .. } => return true,
            ChatMessage::User { .. } => return false,
            _ => {}
        }
    }
    false
}

/// The model of the budget workload: `a` opens a conversation with `b` and delegates to `c` in
/// one turn; `a` and `b` answer each other until the budget severs them; `c`'s result wakes `a`,
/// who tries `b` again (refused) and answers the job.
pub fn budget_model(req: &ChatRequest) -> ChatResponse {
    let me = req.agent.as_ref().map(AgentId::as_str).unwrap_or("");
    let text = last_user(&req.messages);
    let mut jobs = job_ids(&text).join(" ");
    if jobs.is_empty() {
        // A failure notice names no job: the job is the one of the conversation's history.
        let history = spacebot::testing::user_texts(&req.messages);
        jobs = job_ids(&history.join(" ")).join(" ");
    }
    let tool_round = in_tool_round(&req.messages);
    let in_link = req
        .channel
        .as_ref()
        .is_some_and(|c| c.as_str().starts_with("link:"));
    match me {
        "b" => ChatResponse::text(format!("b answers {jobs}")),
        "c" => ChatResponse::text(format!("c result {jobs}")),
        // a, in the conversation with b (or steered by b's message).
        _ if in_link || text.contains("b answers") => {
            ChatResponse::text(format!("a answers {jobs}"))
        }
        // The notice of the severed conversation: nothing to do.
        _ if text.contains("severed") => ChatResponse::text(format!("NOTED {jobs}")),
        _ if req.envelope_kind == Some(EnvelopeKind::UserMessage) && !tool_round => {
            ChatResponse::tool_calls(vec![
                tool_call(
                    "send_link_message",
                    json!({"target": "b", "message": format!("{jobs}: hello b")}),
                ),
                tool_call(
                    "send_agent_message",
                    json!({"target": "c", "message": format!("{jobs}: a slow job for c")}),
                ),
            ])
        }
        _ if req.envelope_kind == Some(EnvelopeKind::UserMessage) => {
            ChatResponse::text(format!("ACK {jobs} asked b and c"))
        }
        // Woken by c's result (or failure): try b again, which must be refused.
        _ if !tool_round => ChatResponse::tool_calls(vec![tool_call(
            "send_link_message",
            json!({"target": "b", "message": format!("{jobs}: {AGAIN} b")}),
        )]),
        _ => ChatResponse::text(format!("FINAL {jobs} (a)")),
    }
}

/// One reply as the outbound wrote it.
#[derive(Debug, Clone)]
pub struct ReplyLine {
    pub agent: String,
    pub in_reply_to: Vec<String>,
    pub content: String,
    pub kind: ReplyKind,
}

impl ReplyLine {
    /// The jobs this reply gives the final answer to.
    pub fn finals(&self) -> Vec<String> {
        if self.kind == ReplyKind::Answer && self.content.starts_with("FINAL") {
            job_ids(&self.content)
        } else {
            Vec::new()
        }
    }

    /// One JSON line.
    pub fn to_json(&self) -> String {
        json!({
            "agent": self.agent,
            "in_reply_to": self.in_reply_to,
            "content": self.content,
            "kind": self.kind,
        })
        .to_string()
    }

    /// Parses a line written by [`ReplyLine::to_json`].
    pub fn from_json(line: &str) -> Self {
        let v: serde_json::Value = serde_json::from_str(line).expect("a reply line");
        let text = |k: &str| v[k].as_str().expect("a string field").to_string();
        Self {
            agent: text("agent"),
            in_reply_to: v["in_reply_to"]
                .as_array()
                .expect("in_reply_to")
                .iter()
                .map(|i| i.as_str().expect("an id").to_string())
                .collect(),
            content: text("content"),
            kind: serde_json::from_value(v["kind"].clone()).expect("a reply kind"),
        }
    }

    /// Whether this reply tells the user of the limits workload's job (delivered as `envelope`):
    /// its answer, or the failure naming the limit (in reply to the notice that woke the chief).
    pub fn tells_limits_job(&self, envelope: &str) -> bool {
        self.agent == "chief"
            && (self.in_reply_to.iter().any(|e| e == envelope)
                || self.finals().iter().any(|j| j == LIMITS_JOBS[0])
                || (self.kind == ReplyKind::Failure
                    && self.content.contains("limit on model calls")))
    }

    /// `in_reply_to` as one string.
    pub fn key(&self) -> String {
        self.in_reply_to.join("+")
    }
}

fn append_synced(path: &Path, line: &str) {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("open for append");
    file.write_all(format!("{line}\n").as_bytes())
        .expect("append");
    file.sync_data().expect("sync_data");
}

/// The complete lines of a file (a line cut by the kill is left out).
pub fn complete_lines(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let complete = match text.rfind('\n') {
        Some(end) => &text[..=end],
        None => "",
    };
    complete.lines().map(str::to_string).collect()
}

pub fn read_replies(dir: &Path) -> Vec<ReplyLine> {
    complete_lines(&dir.join("replies.jsonl"))
        .iter()
        .map(|l| ReplyLine::from_json(l))
        .collect()
}

/// How many times the model ran for each task channel (`task:<agent>#<n>`), from `models.log`.
pub fn read_model_runs(dir: &Path) -> std::collections::BTreeMap<String, u32> {
    let mut runs = std::collections::BTreeMap::new();
    for line in complete_lines(&dir.join("models.log")) {
        if let Some(channel) = line.split(' ').nth(2) {
            *runs.entry(channel.to_string()).or_default() += 1;
        }
    }
    runs
}

/// `(verb, job, id)` of every acknowledgement.
pub fn read_acks(dir: &Path) -> Vec<(String, String, String)> {
    complete_lines(&dir.join("ack.log"))
        .iter()
        .map(|l| {
            let mut w = l.split(' ').map(str::to_string);
            let verb = w.next().unwrap_or_default();
            let job = w.next().unwrap_or_default();
            let id = w.next().unwrap_or_default();
            (verb, job, id)
        })
        .collect()
}

/// The application's outbound: every reply appended to `replies.jsonl`, synced; the set of jobs
/// answered is published for the run's wait.
#[derive(Debug)]
struct FileOutbound {
    path: PathBuf,
    lock: Mutex<()>,
    answered: watch::Sender<BTreeSet<String>>,
}

#[async_trait]
impl Outbound for FileOutbound {
    async fn send(&self, reply: Reply) -> Result<(), OutboundError> {
        let line = ReplyLine {
            agent: reply.agent.to_string(),
            in_reply_to: reply.in_reply_to.iter().map(|i| i.to_string()).collect(),
            content: reply.content.clone(),
            kind: reply.kind,
        };
        {
            let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            append_synced(&self.path, &line.to_json());
        }
        let finals = line.finals();
        self.answered.send_modify(|set| set.extend(finals));
        Ok(())
    }
}

/// Writes every `Error` event to stderr (the run's log), and every event with
/// `SPACEBOT_CRASH_TRACE` set.
#[derive(Debug)]
struct LogSink(bool);

impl spacebot::EventSink for LogSink {
    fn emit(&self, event: spacebot::Event) {
        if self.0 || matches!(event.kind, spacebot::EventKind::Error { .. }) {
            eprintln!(
                "event {} {:?} task={:?}",
                event.agent, event.kind, event.task
            );
        }
    }
}

/// The model of the limits workload (see the module's documentation), logging every call in
/// `models.log` (`call <agent>`, synced) before it answers.
fn limits_model(dir: &Path) -> FnLlm {
    let log = dir.join("models.log");
    FnLlm::new(move |req| {
        let me = req
            .agent
            .as_ref()
            .map(AgentId::as_str)
            .unwrap_or("")
            .to_string();
        append_synced(&log, &format!("call {me}"));
        let text = last_user(&req.messages);
        let tool_round = in_tool_round(&req.messages);
        let delegate = |targets: &[&str]| {
            ChatResponse::tool_calls(
                targets
                    .iter()
                    .map(|t| {
                        tool_call(
                            "send_agent_message",
                            json!({"target": t, "message": format!("job-11 part for {t}")}),
                        )
                    })
                    .collect(),
            )
        };
        Ok(match me.as_str() {
            "chief" if req.envelope_kind == Some(EnvelopeKind::UserMessage) && !tool_round => {
                delegate(&["lead"])
            }
            "chief" => ChatResponse::text("FINAL job-11 (chief)"),
            "lead" if text.contains("have ended") || tool_round => {
                ChatResponse::text("lead result job-11")
            }
            "lead" => delegate(&["w1", "w2"]),
            _ => ChatResponse::text(format!("{me} result job-11")),
        })
    })
}

/// The model calls logged in `models.log` by the limits workload.
pub fn read_model_calls(dir: &Path) -> u64 {
    complete_lines(&dir.join("models.log"))
        .iter()
        .filter(|l| l.starts_with("call "))
        .count() as u64
}

/// The limits workload (see the module's documentation).
async fn run_limits(dir: &Path, backend: &str, failpoint: Arc<Failpoint>) -> u64 {
    let stores = failpoint.wrap(open(backend, &dir.join("data")).await);
    let acked = read_acks(dir);
    let llm = Arc::new(limits_model(dir));
    let agents = Workload::Limits.agents();
    let (org, _rx) = start_org(dir, LIMITS_CONFIG, stores, llm, BTreeSet::new(), agents).await;
    let job = LIMITS_JOBS[0];
    let envelope = match acked.iter().find(|(verb, j, _)| verb == "ack" && j == job) {
        Some((_, _, envelope)) => envelope.clone(),
        None => {
            let limits = spacebot::limits::Limits {
                model_calls: Some(LIMIT_CALLS),
                ..spacebot::limits::Limits::NONE
            };
            let envelope = org
                .deliver(
                    "chief",
                    InboundMessage::new("portal", "u1", format!("{job}: fan out"))
                        .with_idempotency_key(job)
                        .with_limits(limits),
                )
                .await
                .expect("deliver")
                .to_string();
            append_synced(&dir.join("ack.log"), &format!("ack {job} {envelope}"));
            envelope
        }
    };
    // The user is told (an answer or a failure naming the limit), and every agent goes idle.
    wait_until(&format!("{job} answered"), || {
        let told = read_replies(dir)
            .iter()
            .any(|r| r.tells_limits_job(&envelope));
        async move { told }
    })
    .await;
    for agent in agents {
        tokio::time::timeout(RUN_TIMEOUT, org.wait_idle(&id(agent)))
            .await
            .unwrap_or_else(|_| panic!("{agent} not idle within {RUN_TIMEOUT:?}"))
            .expect("wait_idle");
    }
    org.shutdown().await.expect("shutdown");
    failpoint.writes()
}

/// Opens the backend named by `backend` in `dir`.
pub async fn try_open(backend: &str, dir: &Path) -> Result<Stores, spacebot::StoreError> {
    match backend {
        "sqlite" => spacebot::sqlite::open(dir).await,
        "sqlite_per_agent" => spacebot::sqlite::SqliteOptions::new()
            .layout(spacebot::sqlite::Layout::PerAgent)
            .open(dir)
            .await
            .map(|stores| stores.stores()),
        #[cfg(feature = "redb")]
        "redb" => spacebot::redb::open(dir),
        other => panic!("unknown backend {other}"),
    }
}

/// Opens the backend named by `backend` in `dir`, or fails.
pub async fn open(backend: &str, dir: &Path) -> Stores {
    match try_open(backend, dir).await {
        Ok(stores) => stores,
        Err(e) => panic!("{backend} stores in {} do not open: {e}", dir.display()),
    }
}

/// The child process: runs `workload` in `dir` (stopping before write `at`, if set, or after a
/// claim with `after_claim`) until every job is answered, then prints `WRITES <n>`.
pub fn child_main(
    dir: &Path,
    backend: &str,
    workload: Workload,
    at: Option<u64>,
    after_claim: bool,
) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let failpoint = Failpoint::with_claim_kill(at, after_claim);
    let writes = runtime.block_on(async {
        match workload {
            Workload::Org => run(dir, backend, failpoint).await,
            Workload::Budget => run_budget(dir, backend, failpoint).await,
            Workload::Notes => run_notes(dir, backend, failpoint).await,
            Workload::Limits => run_limits(dir, backend, failpoint).await,
        }
    });
    let mut out = std::io::stdout().lock();
    writeln!(out, "{WRITES} {writes}").expect("stdout");
    out.flush().expect("stdout");
}

/// The organization of `config` on `stores` with `llm`, answering into `replies.jsonl` (the jobs
/// answered so far, `answered` included, go to the receiver returned), its link channels made and
/// `agents` started.
async fn start_org(
    dir: &Path,
    config: &str,
    stores: Stores,
    llm: Arc<dyn LlmProvider>,
    answered: BTreeSet<String>,
    agents: &[&str],
) -> (Organization, watch::Receiver<BTreeSet<String>>) {
    let (tx, rx) = watch::channel(answered);
    let outbound = Arc::new(FileOutbound {
        path: dir.join("replies.jsonl"),
        lock: Mutex::new(()),
        answered: tx,
    });
    let config = OrgConfig::from_toml_str(config).expect("the configuration");
    let org = Organization::builder(config)
        .stores(stores)
        .llm(llm)
        .outbound(outbound)
        .events(Arc::new(LogSink(
            std::env::var_os("SPACEBOT_CRASH_TRACE").is_some(),
        )))
        .build()
        .await
        .expect("the organization");
    org.ensure_link_channels().await.expect("link channels");
    for agent in agents {
        org.start_agent(&id(agent)).await.expect("start");
    }
    (org, rx)
}

async fn run(dir: &Path, backend: &str, failpoint: Arc<Failpoint>) -> u64 {
    let stores = failpoint.wrap(open(backend, &dir.join("data")).await);
    let answered: BTreeSet<String> = read_replies(dir).iter().flat_map(|r| r.finals()).collect();
    let acked: BTreeSet<String> = read_acks(dir).into_iter().map(|(_, job, _)| job).collect();
    let llm = Arc::new(FnLlm::new(|req| Ok(model(req))));
    let agents = ["chief", "lead", "worker", "ann", "bob"];
    let (org, mut rx) = start_org(dir, CONFIG, stores, llm, answered.clone(), &agents).await;
    let ack = |verb: &str, job: &str, what: &str| {
        append_synced(&dir.join("ack.log"), &format!("{verb} {job} {what}"));
    };
    let deliveries = [
        ("job-1", "chief", "job-1: delegate this to your team"),
        ("job-2", "late", "job-2: hello, late agent"),
        ("job-3", "ann", "job-3: ask bob for the answer"),
        (CHILD_JOB, "ann", ""),
        ("job-5", "chief", "job-5: answer this directly"),
    ];
    for (job, agent, text) in deliveries {
        if job == CHILD_JOB {
            // Children are not restarted by the runtime: like an application would, spawn the
            // child again when its result was neither answered nor kept for ann.
            let kept = org
                .stores()
                .deliveries
                .pending(&id("ann"))
                .await
                .expect("ann's pending deliveries")
                .iter()
                .any(|e| {
                    e.kind == EnvelopeKind::Announce
                        && matches!(&e.source, Source::Internal { from_agent, .. }
                            if from_agent.as_str().starts_with("ann.child-"))
                });
            // Read after the pending deliveries: a reply leaves before its turn commits.
            let done = rx.borrow().contains(job);
            if !done && !kept {
                let child = org
                    .spawn_child(
                        &id("ann"),
                        ChildSpec::new("helper", format!("{job}: count the stars")),
                    )
                    .await
                    .expect("spawn the child");
                ack("spawn", job, child.as_str());
            }
            continue;
        }
        if acked.contains(job) {
            continue;
        }
        let envelope = org
            .deliver(
                agent,
                InboundMessage::new("portal", "u1", text).with_idempotency_key(job),
            )
            .await
            .expect("deliver");
        ack("ack", job, envelope.as_str());
    }
    org.start_agent(&id("late")).await.expect("start late");
    let all = tokio::time::timeout(
        RUN_TIMEOUT,
        rx.wait_for(|set| JOBS.iter().all(|j| set.contains(*j))),
    )
    .await;
    let ok = matches!(all, Ok(Ok(_)));
    drop(all);
    if !ok {
        panic!(
            "not every job was answered within {RUN_TIMEOUT:?}: answered {:?}",
            *rx.borrow()
        );
    }
    // The last replies leave before their turns commit: let every agent finish.
    for agent in ["chief", "lead", "worker", "ann", "bob", "late"] {
        tokio::time::timeout(RUN_TIMEOUT, org.wait_idle(&id(agent)))
            .await
            .unwrap_or_else(|_| panic!("{agent} not idle within {RUN_TIMEOUT:?}"))
            .expect("wait_idle");
    }
    org.shutdown().await.expect("shutdown");
    failpoint.writes()
}

/// The model of the budget workload, counting each run for a task in `models.log` (synced before
/// it answers) and stopping the process at the model call when the failpoint is armed.
fn counting_model(dir: &Path, failpoint: Arc<Failpoint>) -> FnLlm {
    let log = dir.join("models.log");
    FnLlm::new(move |req| {
        let channel = req.channel.as_ref().map(|c| c.as_str().to_string());
        if let Some(channel) = channel.filter(|c| c.starts_with("task:")) {
            let agent = req.agent.as_ref().map(AgentId::as_str).unwrap_or("");
            // A claimed task's model call: a kill armed after the claim lands here at the latest.
            failpoint.model_call(&channel);
            append_synced(&log, &format!("run {agent} {channel}"));
        }
        Ok(budget_model(req))
    })
}

/// Polls `check` until it holds, failing after [`RUN_TIMEOUT`] with `what`.
async fn wait_until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + RUN_TIMEOUT;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {RUN_TIMEOUT:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The budget workload (see the module's documentation).
async fn run_budget(dir: &Path, backend: &str, failpoint: Arc<Failpoint>) -> u64 {
    let stores = failpoint.wrap(open(backend, &dir.join("data")).await);
    let answered: BTreeSet<String> = read_replies(dir).iter().flat_map(|r| r.finals()).collect();
    let acked: BTreeSet<String> = read_acks(dir).into_iter().map(|(_, job, _)| job).collect();
    let llm = Arc::new(counting_model(dir, failpoint.clone()));
    let (org, mut rx) = start_org(dir, BUDGET_CONFIG, stores, llm, answered, &["a", "b"]).await;
    let job = BUDGET_JOBS[0];
    if !acked.contains(job) {
        let envelope = org
            .deliver(
                "a",
                InboundMessage::new("portal", "u1", format!("{job}: start the budget job"))
                    .with_idempotency_key(job),
            )
            .await
            .expect("deliver");
        append_synced(&dir.join("ack.log"), &format!("ack {job} {envelope}"));
    }
    // c's job is slow: c starts once the budget severed the conversation (or, after a restart,
    // the job was answered already).
    let (a, b) = (id("a"), id("b"));
    wait_until("the conversation of a and b severed", || {
        let org = org.clone();
        let (a, b) = (a.clone(), b.clone());
        let done = rx.borrow().contains(job);
        async move {
            done || org
                .conversations(&ConversationFilter {
                    member: Some(a),
                    statuses: vec![ConversationStatus::Severed],
                })
                .await
                .expect("conversations")
                .iter()
                .any(|c| c.member(&b).is_some())
        }
    })
    .await;
    org.start_agent(&id("c")).await.expect("start c");
    let all = tokio::time::timeout(RUN_TIMEOUT, rx.wait_for(|set| set.contains(job))).await;
    let ok = matches!(all, Ok(Ok(_)));
    drop(all);
    if !ok {
        panic!(
            "{job} was not answered within {RUN_TIMEOUT:?}: answered {:?}",
            *rx.borrow()
        );
    }
    for agent in ["a", "b", "c"] {
        tokio::time::timeout(RUN_TIMEOUT, org.wait_idle(&id(agent)))
            .await
            .unwrap_or_else(|_| panic!("{agent} not idle within {RUN_TIMEOUT:?}"))
            .expect("wait_idle");
    }
    org.shutdown().await.expect("shutdown");
    failpoint.writes()
}

/// The model of the notes workload: read the note, write it back with the job appended (blindly:
/// a line already there is appended again), answer `FINAL job-N` once the write was acknowledged.
///
/// A frame resumed after a steer (the runtime's "continue with what you were doing" message)
/// continues from its own last tool result, as a model reading its conversation does: a write
/// acknowledged before the interruption is answered, not made again.
pub fn notes_model(req: &ChatRequest) -> ChatResponse {
    let job = job_ids(&last_user(&req.messages)).pop().unwrap_or_default();
    let last_tool = frame_tool_result(&req.messages);
    match last_tool.as_deref() {
        Some(result) if result.starts_with("Wrote note") => {
            ChatResponse::text(format!("FINAL {job} (notes)"))
        }
        Some(result) if result.starts_with("Note ") => {
            // "Note log (version V, written by A; your access: read_write):\n<text>"
            let version: u64 = result
                .split("(version ")
                .nth(1)
                .and_then(|r| r.split(',').next())
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let text = result.split_once('\n').map_or("", |(_, t)| t);
            ChatResponse::tool_calls(vec![tool_call(
                "write_shared_note",
                json!({"name": NOTE, "text": format!("{text}\n{job}"), "base_version": version}),
            )])
        }
        // A new job, or an error (a conflict): read the note (again).
        _ => ChatResponse::tool_calls(vec![tool_call("read_shared_note", json!({"name": NOTE}))]),
    }
}

/// The runtime's first words when a frame resumes after a steer was answered.
const RESUMED: &str = "Your answer to the interruption was delivered.";

/// The last tool result of the frame the model answers now (`Some("")` when its last message is
/// a new job): the last message's, or, for a resumed frame, the last tool result before the
/// interruption (the first user message after the one that asked for the resumed job).
fn frame_tool_result(messages: &[ChatMessage]) -> Option<String> {
    let last_tool = |messages: &[ChatMessage]| {
        messages.iter().rev().find_map(|m| match m {
            ChatMessage::Tool { content, .. } => Some(content.to_string()),
            ChatMessage::User { .. } => Some(String::new()),
            _ => None,
        })
    };
    let resumed = matches!(messages.last(), Some(ChatMessage::User { content })
        if content.to_string().starts_with(RESUMED));
    if !resumed {
        return last_tool(messages);
    }
    let job = job_ids(&last_user(messages)).pop()?;
    // The user message that asked for the job (not a resume), and the first user message after it.
    let asked = messages.iter().rposition(|m| match m {
        ChatMessage::User { content } => {
            let text = content.to_string();
            !text.starts_with(RESUMED) && job_ids(&text).contains(&job)
        }
        _ => false,
    })?;
    let interrupted = messages[asked + 1..]
        .iter()
        .position(|m| matches!(m, ChatMessage::User { .. }))
        .map_or(messages.len(), |i| asked + 1 + i);
    last_tool(&messages[..interrupted])
}

/// The notes workload (see the module's documentation).
async fn run_notes(dir: &Path, backend: &str, failpoint: Arc<Failpoint>) -> u64 {
    let stores = failpoint.wrap(open(backend, &dir.join("data")).await);
    let answered: BTreeSet<String> = read_replies(dir).iter().flat_map(|r| r.finals()).collect();
    let acked: BTreeSet<String> = read_acks(dir).into_iter().map(|(_, job, _)| job).collect();
    let (tx, mut rx) = watch::channel(answered);
    let outbound = Arc::new(FileOutbound {
        path: dir.join("replies.jsonl"),
        lock: Mutex::new(()),
        answered: tx,
    });
    let config = OrgConfig::from_toml_str(NOTES_CONFIG).expect("the configuration");
    let org = Organization::builder(config)
        .stores(stores)
        .llm(Arc::new(FnLlm::new(|req| Ok(notes_model(req)))))
        .outbound(outbound)
        .behaviour(Arc::new(spacebot::notes::Notes::new()))
        .events(Arc::new(LogSink(
            std::env::var_os("SPACEBOT_CRASH_TRACE").is_some(),
        )))
        .build()
        .await
        .expect("the organization");
    org.start_all().await.expect("start");
    for (i, job) in NOTES_JOBS.iter().enumerate() {
        let agent = if i % 2 == 0 { "w1" } else { "w2" };
        if !acked.contains(*job) {
            let envelope = org
                .deliver(
                    agent,
                    InboundMessage::new("portal", "u1", format!("{job}: append to the log"))
                        .with_idempotency_key(*job),
                )
                .await
                .expect("deliver");
            append_synced(&dir.join("ack.log"), &format!("ack {job} {envelope}"));
        }
        let done = tokio::time::timeout(RUN_TIMEOUT, rx.wait_for(|set| set.contains(*job))).await;
        let ok = matches!(done, Ok(Ok(_)));
        drop(done);
        if !ok {
            panic!(
                "{job} was not answered within {RUN_TIMEOUT:?}: answered {:?}",
                *rx.borrow()
            );
        }
    }
    for agent in ["w1", "w2"] {
        tokio::time::timeout(RUN_TIMEOUT, org.wait_idle(&id(agent)))
            .await
            .unwrap_or_else(|_| panic!("{agent} not idle within {RUN_TIMEOUT:?}"))
            .expect("wait_idle");
    }
    org.shutdown().await.expect("shutdown");
    failpoint.writes()
}
