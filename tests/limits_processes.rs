//! A request's limits bind across processes: two processes on one PostgreSQL schema spend from one
//! request at once, and together never pass its limit; a call kept out only by another process's
//! open reservation waits for it to settle, then is made.
//!
//! The chief and worker `w1` run in this process, worker `w2` in a second one (this test binary
//! again, hosting only `w2` through the placement). The chief delegates to both workers in one
//! response; each worker's model never stops working (every answer is another tool call), so the
//! two processes race for the request's budget until the limit refuses them. Needs a PostgreSQL
//! server (`DATABASE_URL`, or one started from the installed binaries; see README); where none can
//! be had it is compiled as ignored, with the reason, unless SPACEBOT_REQUIRE_POSTGRES=1 (CI).
#![cfg(all(feature = "postgres", feature = "testing"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: failing loudly is the point

#[path = "support/shared_stores.rs"]
mod shared_stores;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use spacebot::event::EventKind;
use spacebot::limits::{Limit, Limits};
use spacebot::llm::{ChatRequest, ChatResponse, LlmProvider, Usage};
use spacebot::placement::{PlacementOptions, ProcessId};
use spacebot::postgres::{PgOptions, PgStores};
use spacebot::testing::{FnLlm, OrgHarness, last_user_text, tool_call};
use spacebot::{AgentId, ChatMessage, InboundMessage, LlmError, ReplyKind};

/// Set in the second process: the run directory (where `stop` appears and the child writes how
/// many model calls it made).
const CHILD_DIR: &str = "SPACEBOT_LIMITS_CHILD_DIR";
/// Set in the second process: the PostgreSQL schema both processes share.
const CHILD_SCHEMA: &str = "SPACEBOT_LIMITS_CHILD_SCHEMA";

/// The request's limit on model calls: the chief's first call, then the two workers race.
const CALLS: u64 = 12;
/// Tokens each call reports.
const INPUT: u32 = 100;
const OUTPUT: u32 = 20;

const CONFIG: &str = r#"
[[agents]]
id = "chief"
name = "Chief"
[[agents]]
id = "w1"
name = "Worker One"
[[agents]]
id = "w2"
name = "Worker Two"
[[links]]
from = "chief"
to = "w1"
relationship = "superior"
[[links]]
from = "chief"
to = "w2"
relationship = "superior"
"#;

fn id(a: &str) -> AgentId {
    AgentId::parse(a).unwrap()
}

/// The chief delegates to both workers at once and sums up when told they ended; a worker never
/// stops: every answer is one more tool call (`task_list`), a fresh call id each time.
fn model() -> FnLlm {
    FnLlm::new(|request| {
        let me = request.agent.as_ref().map(AgentId::as_str).unwrap_or("");
        let mut response = match me {
            "chief" if last_user_text(&request.messages).contains("task #") => {
                ChatResponse::text("both workers are done")
            }
            "chief" => ChatResponse::tool_calls(
                ["w1", "w2"]
                    .iter()
                    .map(|w| {
                        tool_call(
                            "send_agent_message",
                            json!({"target": w, "message": format!("Work on part {w}.")}),
                        )
                    })
                    .collect(),
            ),
            _ => {
                // In the second process, w2 says it was asked (see `FirstAfterOther`).
                if me == "w2"
                    && let Ok(dir) = std::env::var(CHILD_DIR)
                {
                    let _ = std::fs::write(std::path::Path::new(&dir).join(W2_ASKED), b"");
                }
                let done = request
                    .messages
                    .iter()
                    .filter(|m| matches!(m, ChatMessage::Tool { .. }))
                    .count();
                let mut call = tool_call("task_list", json!({}));
                call.id = format!("{me}-step-{done}");
                ChatResponse::tool_calls(vec![call])
            }
        };
        response.usage = Some(Usage {
            prompt_tokens: INPUT,
            completion_tokens: OUTPUT,
            total_tokens: INPUT + OUTPUT,
        });
        Ok(response)
    })
}

/// The file the second process writes when its model is first asked for `w2`.
const W2_ASKED: &str = "w2-asked";

/// This process's model: `w1`'s first call waits (without blocking a thread) until `w2` was asked
/// in the other process, so both processes spend from the request however the two are scheduled
/// (a starved second process could otherwise find the limit used up before it starts).
#[derive(Debug)]
struct FirstAfterOther {
    inner: FnLlm,
    asked: std::path::PathBuf,
}

#[async_trait::async_trait]
impl LlmProvider for FirstAfterOther {
    async fn complete(&self, request: ChatRequest) -> Result<ChatResponse, LlmError> {
        if request.agent.as_ref().is_some_and(|a| a.as_str() == "w1") {
            tokio::time::timeout(Duration::from_secs(60), async {
                while !self.asked.exists() {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
            .await
            .expect("w2 was asked in the other process within 60 s");
        }
        self.inner.complete(request).await
    }
}

/// A process of the organization on the shared schema, hosting `agents`.
async fn placed(
    stores: &PgStores,
    process: &str,
    agents: &[&str],
    llm: Arc<dyn LlmProvider>,
) -> OrgHarness {
    let options = PlacementOptions::new(ProcessId::new(process).unwrap())
        .with_lease(
            Duration::from_secs(5),
            Duration::from_millis(500),
            Duration::from_secs(1),
        )
        .with_check_interval(Duration::from_millis(100))
        .with_agents(agents.iter().map(|a| id(a)));
    let mut h = OrgHarness::builder(CONFIG)
        .stores(stores.stores())
        .llm(llm)
        .placement(Arc::new(stores.placement()), options)
        .build()
        .await;
    h.timeout = Duration::from_secs(60);
    h
}

/// The second process of a test: this test binary again, running the ignored test `test` with
/// `dir_var` naming the run directory and the schema both processes share; its standard error
/// goes to `child.stderr` there. Killed and reaped when dropped.
struct Second(Child);

impl Second {
    fn start(test: &str, dir_var: &str, dir: &std::path::Path, url: &str, pg: &PgStores) -> Self {
        let stderr = std::fs::File::create(dir.join("child.stderr")).unwrap();
        let child = Command::new(std::env::current_exe().unwrap())
            .args([test, "--exact", "--ignored", "--nocapture", "--quiet"])
            .env(dir_var, dir)
            .env("DATABASE_URL", url)
            .env(CHILD_SCHEMA, pg.schema().unwrap())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap();
        Self(child)
    }

    /// Once nothing waits in the shared stores, tells the second process to stop (`stop` in
    /// `dir`), waits for it to exit successfully and answers how many model calls it made.
    async fn stop(mut self, h: &OrgHarness, pg: &PgStores, dir: &std::path::Path) -> u64 {
        let stores = pg.stores();
        h.wait_until("nothing waits in the shared stores", || {
            let stores = stores.clone();
            async move { shared_stores::nothing_waits(&stores, &["chief", "w1", "w2"]).await }
        })
        .await;
        std::fs::write(dir.join("stop"), b"").unwrap();
        h.wait_until("the second process exits", || {
            let calls = dir.join("calls");
            async move { calls.exists() }
        })
        .await;
        let status = self.0.wait().unwrap();
        assert!(
            status.success(),
            "the second process failed: {}",
            std::fs::read_to_string(dir.join("child.stderr")).unwrap_or_default()
        );
        std::fs::read_to_string(dir.join("calls"))
            .unwrap()
            .parse()
            .unwrap()
    }
}

impl Drop for Second {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// In the second process: the shared schema, from the environment the first process set.
async fn second_stores() -> PgStores {
    let url = std::env::var("DATABASE_URL").unwrap();
    PgOptions::new()
        .schema(std::env::var(CHILD_SCHEMA).unwrap())
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap()
}

/// The first process's stores: a temporary schema on `url`, dropped with them.
async fn first_stores(url: &str) -> PgStores {
    PgOptions::new()
        .max_connections(4)
        .temporary(url)
        .await
        .unwrap()
}

/// In the second process: runs until `stop` appears in `dir`, then shuts down and writes how many
/// model calls `llm` was asked (`calls`).
async fn second_until_stopped(h: OrgHarness, pg: PgStores, llm: &FnLlm, dir: &std::path::Path) {
    h.wait_until("the first process is done", || {
        let stop = dir.join("stop");
        async move { stop.exists() }
    })
    .await;
    h.wait_quiet().await;
    h.org.shutdown().await.unwrap();
    drop(h);
    pg.close().await;
    std::fs::write(dir.join("calls"), llm.requests().len().to_string()).unwrap();
}

/// The second process: hosts `w2` until `stop` appears in the run directory, then writes how many
/// model calls it made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the second process of the two-process limits test (run by it with SPACEBOT_LIMITS_CHILD_DIR set)"]
async fn limits_child() {
    let Ok(dir) = std::env::var(CHILD_DIR) else {
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    let pg = second_stores().await;
    let llm = model();
    let h = placed(&pg, "b", &["w2"], Arc::new(llm.clone())).await;
    h.org.start_all().await.unwrap();
    std::fs::write(dir.join("started"), b"").unwrap();
    second_until_stopped(h, pg, &llm, &dir).await;
}

/// Two processes spend from one request at once: the model calls made in both, together, stay
/// within the request's limit (and use it up: the workers never stop on their own), the ledger's
/// settled spend is exactly what both models were asked, both processes spent, and the user is
/// told once, naming the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_pg),
    ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README"
)]
async fn two_processes_spending_from_one_request_never_pass_its_limit() {
    let Some(url) = spacebot::testing::external::database_url() else {
        return;
    };
    let pg = first_stores(&url).await;
    let dir = tempfile::tempdir().unwrap();
    let second = Second::start("limits_child", CHILD_DIR, dir.path(), &url, &pg);
    let llm = model();
    let first_after_other = FirstAfterOther {
        inner: llm.clone(),
        asked: dir.path().join(W2_ASKED),
    };
    let mut h = placed(&pg, "a", &["chief", "w1"], Arc::new(first_after_other)).await;
    h.org.start_all().await.unwrap();
    h.wait_until("the second process hosts w2", || {
        let started = dir.path().join("started");
        async move { started.exists() }
    })
    .await;

    let request = h
        .org
        .deliver(
            "chief",
            InboundMessage::new("portal", "u1", "Split the work.").with_limits(Limits {
                model_calls: Some(CALLS),
                ..Limits::NONE
            }),
        )
        .await
        .unwrap();
    let reply = h.reply().await;
    assert_eq!(reply.kind, ReplyKind::Failure, "{reply:?}");
    assert!(
        reply.content.contains("model calls"),
        "the failure names the limit: {}",
        reply.content
    );

    let theirs = second.stop(&h, &pg, dir.path()).await;
    h.wait_quiet().await;
    let ours = llm.requests().len() as u64;
    // This process's view: the settlements it made behind count; the other process stored its
    // own before it exited.
    let entry = h
        .org
        .request_spend(&request)
        .await
        .unwrap()
        .expect("the request's spend is stored");
    assert!(
        ours + theirs <= CALLS,
        "{ours} + {theirs} model calls under a limit of {CALLS}"
    );
    assert!(
        theirs >= 1,
        "the other process spent from the request too (w2 ran there)"
    );
    assert!(
        !llm.requests_for(&id("w1")).is_empty(),
        "this process's worker spent"
    );
    assert_eq!(
        entry.settled.model_calls,
        ours + theirs,
        "the ledger settled every call both processes made: {entry:?}"
    );
    assert_eq!(
        entry.settled.total_tokens,
        (ours + theirs) * u64::from(INPUT + OUTPUT),
        "exact token sums"
    );
    assert_eq!(
        ours + theirs,
        CALLS,
        "workers that never stop use the whole budget, no more"
    );
    assert!(entry.reserved.is_empty(), "{:?}", entry.reserved);
    assert_eq!(
        entry.reached.as_ref().map(|r| r.over.limit),
        Some(Limit::ModelCalls)
    );
    assert!(
        h.events.events().iter().any(
            |e| matches!(&e.kind, EventKind::LimitReached { request: r, .. } if r == &request)
        ),
        "an event names the limit"
    );
    let more = h.replies_now();
    assert!(more.is_empty(), "told more than once: {more:?}");
    h.org.shutdown().await.unwrap();
    drop(h);
    pg.close().await;
}

/// Set in the second process of the wait test: the run directory (`w2-waits`, `w2-called`, `stop`,
/// `calls`).
const WAIT_CHILD_DIR: &str = "SPACEBOT_LIMITS_WAIT_CHILD_DIR";

/// The request's token limit in the wait test: the first call of a worker reserves all that is
/// left (its worst case: a prompt estimate of about 1,600 tokens, the tools' definitions most of
/// it, and the output the limit leaves, under the 4,096 a call may answer), so the other worker's
/// call fits only once that one settles (each call spends `INPUT + OUTPUT`, far less).
const WAIT_TOKENS: u64 = 5_000;

/// The wait test's model: the chief delegates to both workers at once and answers when told a
/// task ended; a worker answers at once. In the second process `w2` leaves `w2-called` when asked.
fn answering_model() -> FnLlm {
    FnLlm::new(|request| {
        let me = request.agent.as_ref().map(AgentId::as_str).unwrap_or("");
        let mut response = match me {
            "chief" if last_user_text(&request.messages).contains("task #") => {
                ChatResponse::text("a worker is done")
            }
            "chief" => ChatResponse::tool_calls(
                ["w1", "w2"]
                    .iter()
                    .map(|w| {
                        tool_call(
                            "send_agent_message",
                            json!({"target": w, "message": format!("Work on part {w}.")}),
                        )
                    })
                    .collect(),
            ),
            _ => {
                if let Ok(dir) = std::env::var(WAIT_CHILD_DIR) {
                    let _ = std::fs::write(std::path::Path::new(&dir).join("w2-called"), b"");
                }
                ChatResponse::text(format!("part {me} done"))
            }
        };
        response.usage = Some(Usage {
            prompt_tokens: INPUT,
            completion_tokens: OUTPUT,
            total_tokens: INPUT + OUTPUT,
        });
        Ok(response)
    })
}

/// This process's model in the wait test: `w1`'s call (its reservation already stored) leaves
/// `w1-calling` and waits, without blocking a thread, until `release` appears.
#[derive(Debug)]
struct HeldUntilReleased {
    inner: FnLlm,
    dir: std::path::PathBuf,
}

#[async_trait::async_trait]
impl LlmProvider for HeldUntilReleased {
    async fn complete(&self, request: ChatRequest) -> Result<ChatResponse, LlmError> {
        if request.agent.as_ref().is_some_and(|a| a.as_str() == "w1") {
            std::fs::write(self.dir.join("w1-calling"), b"").unwrap();
            let release = self.dir.join("release");
            tokio::time::timeout(Duration::from_secs(60), async {
                while !release.exists() {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
            .await
            .expect("the test released w1's call within 60 s");
        }
        self.inner.complete(request).await
    }
}

/// The second process of the wait test: hosts `w2`, leaves `w2-waits` (the request and the limit
/// its call waits on) once an event says `w2`'s call waits, and once `stop` appears writes how many
/// model calls it made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the second process of the limits wait test (run by it with SPACEBOT_LIMITS_WAIT_CHILD_DIR set)"]
async fn limits_wait_child() {
    let Ok(dir) = std::env::var(WAIT_CHILD_DIR) else {
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    let pg = second_stores().await;
    let llm = answering_model();
    let h = placed(&pg, "b", &["w2"], Arc::new(llm.clone())).await;
    h.org.start_all().await.unwrap();
    h.wait_until("w2's call waits for budget", || {
        let events = h.events.events();
        async move {
            events
                .iter()
                .any(|e| e.agent.as_str() == "w2" && matches!(e.kind, EventKind::LimitWait { .. }))
        }
    })
    .await;
    let said = h
        .events
        .events()
        .into_iter()
        .find_map(|e| match e.kind {
            EventKind::LimitWait { request, over } => Some(format!(
                "{request} {}",
                serde_json::to_value(over.limit).unwrap().as_str().unwrap()
            )),
            _ => None,
        })
        .unwrap();
    std::fs::write(dir.join("w2-waits"), said).unwrap();
    second_until_stopped(h, pg, &llm, &dir).await;
}

/// A call kept out only by an open reservation another process made waits for it across
/// processes, then is made: `w1`'s call in this process reserves all the request has left and is
/// held; `w2`, started in a second process only then, finds the request busy and waits (an event
/// says so); once `w1`'s call is released and settled, `w2`'s call is made. Nothing is refused,
/// the request ends with the workers' answers, and the ledger settles exactly the calls both
/// processes made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_pg),
    ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README"
)]
async fn a_call_waits_for_a_reservation_of_another_process_to_settle() {
    let Some(url) = spacebot::testing::external::database_url() else {
        return;
    };
    let pg = first_stores(&url).await;
    let dir = tempfile::tempdir().unwrap();
    let llm = answering_model();
    let held = HeldUntilReleased {
        inner: llm.clone(),
        dir: dir.path().to_owned(),
    };
    let mut h = placed(&pg, "a", &["chief", "w1"], Arc::new(held)).await;
    h.org.start_all().await.unwrap();
    let request = h
        .org
        .deliver(
            "chief",
            InboundMessage::new("portal", "u1", "Split the work.").with_limits(Limits {
                total_tokens: Some(WAIT_TOKENS),
                ..Limits::NONE
            }),
        )
        .await
        .unwrap();
    h.wait_until("w1's call is made, its reservation stored", || {
        let calling = dir.path().join("w1-calling");
        async move { calling.exists() }
    })
    .await;
    let held_back = h.org.request_spend(&request).await.unwrap().unwrap();
    assert_eq!(
        held_back.committed().total_tokens,
        WAIT_TOKENS,
        "w1's call reserved all the request had left: {held_back:?}"
    );

    // Only now the second process starts, and w2 (its task queued in the shared stores) with it.
    let second = Second::start("limits_wait_child", WAIT_CHILD_DIR, dir.path(), &url, &pg);
    h.wait_until("w2's call waits in the second process", || {
        let waits = dir.path().join("w2-waits");
        async move { waits.exists() }
    })
    .await;
    assert_eq!(
        std::fs::read_to_string(dir.path().join("w2-waits")).unwrap(),
        format!("{request} total_tokens"),
        "w2's call waits on this request's token limit"
    );
    assert!(
        !dir.path().join("w2-called").exists(),
        "w2's model is not asked while w1's reservation holds the budget"
    );

    std::fs::write(dir.path().join("release"), b"").unwrap();
    let reply = h.reply().await;
    assert_eq!(reply.kind, ReplyKind::Answer, "{reply:?}");
    h.wait_until("w2's call is made in the second process", || {
        let called = dir.path().join("w2-called");
        async move { called.exists() }
    })
    .await;
    let theirs = second.stop(&h, &pg, dir.path()).await;
    h.wait_quiet().await;
    let ours = llm.requests().len() as u64;
    assert_eq!(theirs, 1, "w2 made its one call in the second process");
    let entry = h.org.request_spend(&request).await.unwrap().unwrap();
    assert_eq!(entry.settled.model_calls, ours + theirs, "{entry:?}");
    assert_eq!(
        entry.settled.total_tokens,
        (ours + theirs) * u64::from(INPUT + OUTPUT),
        "exact token sums"
    );
    assert!(entry.reserved.is_empty(), "{:?}", entry.reserved);
    assert_eq!(entry.reached, None, "no call was refused: {entry:?}");
    assert!(
        !h.events
            .events()
            .iter()
            .any(|e| matches!(e.kind, EventKind::LimitReached { .. })),
        "nothing reached a limit"
    );
    let more = h.replies_now();
    assert!(
        more.iter().all(|r| r.kind == ReplyKind::Answer),
        "no failure reply: {more:?}"
    );
    h.org.shutdown().await.unwrap();
    drop(h);
    pg.close().await;
}
