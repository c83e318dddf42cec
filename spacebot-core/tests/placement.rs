//! One organization spread over three "processes": three `Organization`s sharing one in-memory
//! `Stores` bundle and one `MemoryPlacement` table, each with its own spawner (so a test can kill
//! one: every task it spawned is aborted, nothing is shut down, its leases stay until they expire).
//!
//! - `a_killed_process_agents_are_taken_over`: 13 agents (delegations over two hops, mirrored
//!   conversations, direct answers); one process is killed while work is in flight; the others take
//!   its agents over within the lease, every acknowledged job is answered, no task is duplicated.
//! - `a_partitioned_process_stops_before_another_takes_over`: one process is cut off from the
//!   placement table; it fences its agents before they are taken over. A shared counter of loops
//!   per agent (a behaviour's start/stop hooks) and of model calls in flight per agent proves no
//!   two loops of one agent ever ran at once.
#![cfg(all(feature = "tokio", feature = "testing"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use spacebot_core::testing::last_user_text as last_user;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::future::BoxFuture;
use serde_json::json;
use spacebot_core::delegation::{
    DelegationOrigin, TaskContext, TaskError, TaskExecutor, TaskOutcome,
};
use spacebot_core::error::LlmError;
use spacebot_core::event::{Event, EventKind, EventSink};
use spacebot_core::llm::ChatResponse;
use spacebot_core::runtime::OutboundError;
use spacebot_core::testing::tool_call;
use spacebot_core::{
    AgentId, AgentWorker, Behaviour, BehaviourContext, ChatRequest, EnvelopeKind, InboundMessage,
    LlmProvider, MemoryPlacement, OrgConfig, Organization, Outbound, PlacementOptions, ProcessId,
    Reply, ReplyKind, Spawner, Stores, TaskStore,
};
use spacebot_core::{ChannelId, Task, TaskRef, TaskStatus};

const LEASE: Duration = Duration::from_millis(1500);
const RENEW: Duration = Duration::from_millis(150);
const MARGIN: Duration = Duration::from_millis(600);
const CHECK: Duration = Duration::from_millis(150);
const TIMEOUT: Duration = Duration::from_secs(40);

/// Three chiefs delegating over two hops (chief -> lead -> worker), two pairs talking in mirrored
/// conversations (ann asks bob, bob concludes): 13 agents.
fn config() -> OrgConfig {
    let mut toml = String::from("[settings]\nmax_tool_rounds = 6\n");
    let mut agent =
        |a: String| toml.push_str(&format!("[[agents]]\nid = \"{a}\"\nname = \"{a}\"\n"));
    for i in 0..3 {
        agent(format!("chief{i}"));
        agent(format!("lead{i}"));
        agent(format!("worker{i}"));
    }
    for i in 0..2 {
        agent(format!("ann{i}"));
        agent(format!("bob{i}"));
    }
    for i in 0..3 {
        toml.push_str(&format!(
            "[[links]]\nfrom = \"chief{i}\"\nto = \"lead{i}\"\ndirection = \"one_way\"\nrelationship = \"superior\"\n\
             [[links]]\nfrom = \"lead{i}\"\nto = \"worker{i}\"\ndirection = \"one_way\"\nrelationship = \"superior\"\n"
        ));
    }
    for i in 0..2 {
        toml.push_str(&format!(
            "[[links]]\nfrom = \"ann{i}\"\nto = \"bob{i}\"\ndirection = \"two_way\"\nrelationship = \"peer\"\n"
        ));
    }
    OrgConfig::from_toml_str(&toml).unwrap()
}

fn all_agents() -> Vec<AgentId> {
    let mut out: Vec<AgentId> = config().agents.iter().map(|a| a.id.clone()).collect();
    out.sort();
    out
}

/// The job ids named in `text`, in order, each once.
fn job_ids(text: &str) -> Vec<String> {
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

/// The model: a function of the asking agent, the envelope kind and the last user message.
fn answer(req: &ChatRequest) -> ChatResponse {
    let me = req.agent.as_ref().map(AgentId::as_str).unwrap_or("");
    let text = last_user(&req.messages);
    let jobs = job_ids(&text).join(" ");
    let tool_round = spacebot_core::testing::tool_round(&req.messages);
    let kind = req.envelope_kind;
    let n = me.chars().last().unwrap_or('0');
    match me.trim_end_matches(|c: char| c.is_ascii_digit()) {
        "chief" => match kind {
            Some(EnvelopeKind::UserMessage) if text.contains("delegate") && !tool_round => {
                ChatResponse::tool_calls(vec![tool_call(
                    "send_agent_message",
                    json!({"target": format!("lead{n}"), "message": format!("{jobs} for the lead")}),
                )])
            }
            _ => ChatResponse::text(format!("FINAL {jobs} ({me})")),
        },
        "lead" if text.contains("have ended") => ChatResponse::text(format!("lead result {jobs}")),
        "lead" => ChatResponse::tool_calls(vec![tool_call(
            "send_agent_message",
            json!({"target": format!("worker{n}"), "message": format!("{jobs} for the worker")}),
        )]),
        "worker" if kind == Some(EnvelopeKind::UserMessage) => {
            ChatResponse::text(format!("FINAL {jobs} ({me})"))
        }
        "worker" => ChatResponse::text(format!("worker result {jobs}")),
        // Bob's conclusion (a retrigger, or merged into a turn by a steer) is answered; a request
        // is asked of bob once per turn.
        "ann" if text.contains("bob says") => ChatResponse::text(format!("FINAL {jobs} ({me})")),
        "ann" if text.contains("ask bob") && !tool_round => {
            ChatResponse::tool_calls(vec![tool_call(
                "send_link_message",
                json!({"target": format!("bob{n}"), "message": format!("{jobs}: what is the answer?")}),
            )])
        }
        "ann" => ChatResponse::text(format!("ACK {jobs} asked bob")),
        "bob" => ChatResponse::tool_calls(vec![tool_call(
            "conclude_link",
            json!({"summary": format!("{jobs} bob says 42")}),
        )]),
        _ => ChatResponse::text(format!("FINAL {jobs} ({me})")),
    }
}

/// What the three processes share to check the one-loop rule.
#[derive(Debug, Default)]
struct Watch {
    /// Model calls in flight per agent (a guard decrements, also when the call is aborted).
    calls: Mutex<HashMap<AgentId, u32>>,
    /// Loops running per agent: +1 when a loop starts, -1 when it stops (behaviour hooks).
    loops: Mutex<HashMap<AgentId, i32>>,
    /// Every time a second call or loop of one agent ran beside the first.
    violations: Mutex<Vec<String>>,
    /// An agent whose model calls wait while it is set (the test decides what happens meanwhile).
    held: Mutex<Option<AgentId>>,
    /// Told when `held` is cleared.
    released: tokio::sync::Notify,
}

impl Watch {
    fn hold(&self, agent: &str) {
        *self.held.lock().unwrap() = Some(AgentId::parse(agent).unwrap());
    }

    fn release(&self) {
        *self.held.lock().unwrap() = None;
        self.released.notify_waiters();
    }

    /// Waits while `agent`'s calls are held.
    async fn pass(&self, agent: &AgentId) {
        loop {
            let released = self.released.notified();
            if self.held.lock().unwrap().as_ref() != Some(agent) {
                return;
            }
            released.await;
        }
    }

    fn in_flight(&self, agent: &str) -> u32 {
        let agent = AgentId::parse(agent).unwrap();
        self.calls.lock().unwrap().get(&agent).copied().unwrap_or(0)
    }
}

struct CallGuard(Arc<Watch>, AgentId);

impl Drop for CallGuard {
    fn drop(&mut self) {
        let mut calls = self.0.calls.lock().unwrap();
        if let Some(n) = calls.get_mut(&self.1) {
            *n -= 1;
        }
    }
}

/// A model that takes a little time per call and counts calls in flight per agent.
#[derive(Debug)]
struct SlowModel(Arc<Watch>);

#[async_trait]
impl LlmProvider for SlowModel {
    async fn complete(&self, request: ChatRequest) -> Result<ChatResponse, LlmError> {
        let agent = request.agent.clone().unwrap();
        let _guard = {
            let mut calls = self.0.calls.lock().unwrap();
            let n = calls.entry(agent.clone()).or_default();
            *n += 1;
            if *n > 1 {
                self.0
                    .violations
                    .lock()
                    .unwrap()
                    .push(format!("{n} model calls of {agent} at once"));
            }
            CallGuard(self.0.clone(), agent.clone())
        };
        self.0.pass(&agent).await;
        tokio::time::sleep(Duration::from_millis(15)).await;
        Ok(answer(&request))
    }
}

/// Counts loops per agent across the processes.
#[derive(Debug)]
struct LoopCounter(Arc<Watch>, &'static str);

#[async_trait]
impl Behaviour for LoopCounter {
    fn name(&self) -> &'static str {
        "loop-counter"
    }

    fn on_agent_started(&self, _ctx: &BehaviourContext, agent: AgentWorker) {
        let mut loops = self.0.loops.lock().unwrap();
        let n = loops.entry(agent.id().clone()).or_default();
        *n += 1;
        if *n > 1 {
            self.0.violations.lock().unwrap().push(format!(
                "{} started {} while {n} loops of it ran",
                self.1,
                agent.id()
            ));
        }
    }

    async fn on_agent_stopped(&self, _ctx: &BehaviourContext, agent: &AgentId) {
        *self
            .0
            .loops
            .lock()
            .unwrap()
            .entry(agent.clone())
            .or_default() -= 1;
    }
}

/// Every `PlacementLost` event of every process, as (process, agent).
#[derive(Debug)]
struct LostSink(Arc<Mutex<Vec<(String, AgentId)>>>);

impl EventSink for LostSink {
    fn emit(&self, event: Event) {
        if let EventKind::PlacementLost { process, .. } = &event.kind {
            self.0
                .lock()
                .unwrap()
                .push((process.clone(), event.agent.clone()));
        }
        if std::env::var("PLACEMENT_TRACE").is_ok() {
            eprintln!("{:?} {} {:?}", event.at, event.agent, event.kind);
        }
    }
}

/// Every reply of every process, with the process that sent it.
#[derive(Debug)]
struct SharedOutbound(Arc<Mutex<Vec<(String, Reply)>>>, &'static str);

#[async_trait]
impl Outbound for SharedOutbound {
    async fn send(&self, reply: Reply) -> Result<(), OutboundError> {
        self.0.lock().unwrap().push((self.1.to_string(), reply));
        Ok(())
    }
}

/// A spawner whose tasks can all be aborted at once: a killed process.
#[derive(Debug, Default)]
struct KillableSpawner {
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
    killed: AtomicBool,
}

impl KillableSpawner {
    fn kill(&self) {
        self.killed.store(true, Ordering::SeqCst);
        for task in self.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}

impl Spawner for KillableSpawner {
    fn spawn(&self, future: BoxFuture<'static, ()>) {
        if self.killed.load(Ordering::SeqCst) {
            return;
        }
        let handle = tokio::spawn(future).abort_handle();
        let mut tasks = self.tasks.lock().unwrap();
        tasks.retain(|t| !t.is_finished());
        tasks.push(handle);
    }
}

struct Process {
    name: &'static str,
    org: Organization,
    spawner: Arc<KillableSpawner>,
}

struct Cluster {
    processes: Vec<Process>,
    stores: Stores,
    placement: MemoryPlacement,
    replies: Arc<Mutex<Vec<(String, Reply)>>>,
    watch: Arc<Watch>,
    lost: Arc<Mutex<Vec<(String, AgentId)>>>,
}

async fn cluster(capacity: usize) -> Cluster {
    let c = cluster_with(|_, options| options.with_capacity(capacity), None).await;
    for p in &c.processes {
        p.org.start_all().await.unwrap();
    }
    c
}

/// Three processes, nothing started; `options(name, defaults)` gives each its placement options.
async fn cluster_with(
    options: impl Fn(&str, PlacementOptions) -> PlacementOptions,
    executor: Option<Arc<dyn TaskExecutor>>,
) -> Cluster {
    let stores = Stores::memory();
    let placement = MemoryPlacement::new();
    let replies = Arc::new(Mutex::new(Vec::new()));
    let watch = Arc::new(Watch::default());
    let lost = Arc::new(Mutex::new(Vec::new()));
    let mut processes = Vec::new();
    for name in ["p1", "p2", "p3"] {
        let spawner = Arc::new(KillableSpawner::default());
        let options = options(
            name,
            PlacementOptions::new(ProcessId::new(name).unwrap())
                .with_acquire_per_round(2)
                .with_lease(LEASE, RENEW, MARGIN)
                .with_check_interval(CHECK),
        );
        let mut builder = Organization::builder(config());
        if let Some(executor) = &executor {
            builder = builder.task_executor(AgentId::parse("worker0").unwrap(), executor.clone());
        }
        let org = builder
            .stores(stores.clone())
            .llm(Arc::new(SlowModel(watch.clone())))
            .spawner(spawner.clone())
            .outbound(Arc::new(SharedOutbound(replies.clone(), name)))
            .behaviour(Arc::new(LoopCounter(watch.clone(), name)))
            .events(Arc::new(LostSink(lost.clone())))
            .placement(Arc::new(placement.clone()), options)
            .build()
            .await
            .unwrap();
        processes.push(Process { name, org, spawner });
    }
    Cluster {
        processes,
        stores,
        placement,
        replies,
        watch,
        lost,
    }
}

/// Waits for `cond`, failing the test with `what` after [`TIMEOUT`].
async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < TIMEOUT, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

impl Cluster {
    fn live(&self) -> impl Iterator<Item = &Process> {
        self.processes
            .iter()
            .filter(|p| !p.spawner.killed.load(Ordering::SeqCst))
    }

    /// Which live process hosts each agent (several when the rule broke).
    fn hosts(&self) -> BTreeMap<AgentId, Vec<&'static str>> {
        let mut hosts: BTreeMap<AgentId, Vec<&'static str>> = BTreeMap::new();
        for p in self.live() {
            for a in p.org.hosted_agents() {
                hosts.entry(a).or_default().push(p.name);
            }
        }
        hosts
    }

    fn every_agent_hosted_once(&self) -> bool {
        let hosts = self.hosts();
        all_agents()
            .iter()
            .all(|a| hosts.get(a).is_some_and(|h| h.len() == 1))
    }

    fn answered(&self) -> BTreeSet<String> {
        self.replies
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, r)| r.kind == ReplyKind::Answer && r.content.starts_with("FINAL"))
            .flat_map(|(_, r)| job_ids(&r.content))
            .collect()
    }

    /// Waits until every job in `jobs` has a final answer; on a timeout, says which have none.
    async fn wait_answered(&self, jobs: &[String]) {
        let start = Instant::now();
        loop {
            let answered = self.answered();
            let missing: Vec<&String> = jobs.iter().filter(|j| !answered.contains(*j)).collect();
            if missing.is_empty() {
                return;
            }
            if start.elapsed() > TIMEOUT {
                let replies: Vec<String> = self
                    .replies
                    .lock()
                    .unwrap()
                    .iter()
                    .map(|(p, r)| format!("{p} {} {:?}: {}", r.agent, r.kind, r.content))
                    .collect();
                panic!(
                    "jobs never answered: {missing:?}; hosts {:?}; replies {replies:#?}",
                    self.hosts()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Delivers `job` through process `via` to `agent`; returns once it was acknowledged.
    async fn deliver(&self, via: usize, agent: &str, job: &str, text: &str) {
        let org = &self.processes[via].org;
        org.deliver(
            agent,
            InboundMessage::new("portal", format!("u-{job}"), format!("{job} {text}"))
                .with_idempotency_key(job),
        )
        .await
        .unwrap_or_else(|e| {
            panic!(
                "{job} to {agent} via {} refused: {e}",
                self.processes[via].name
            )
        });
    }

    /// No task was created twice: per board, each job's title appears once.
    async fn assert_no_duplicate_tasks(&self) {
        for agent in all_agents() {
            let tasks = self
                .stores
                .tasks
                .list(&agent, &Default::default())
                .await
                .unwrap();
            let mut seen: BTreeMap<String, u32> = BTreeMap::new();
            for t in &tasks {
                for job in job_ids(&format!("{} {}", t.title, t.description)) {
                    *seen.entry(job).or_default() += 1;
                }
            }
            for (job, n) in seen {
                assert_eq!(n, 1, "{job} has {n} tasks on {agent}'s board: {tasks:#?}");
            }
        }
    }
}

/// The jobs: `(agent, text)` per job number. One conversation job per pair (ann0 before the cut,
/// ann1 after): the scripted model answers a conclusion in the channel the conversation started
/// from, so several jobs reopening one conversation at once are not what it models.
fn job(n: usize) -> (String, &'static str) {
    match (n, n % 4) {
        (2, _) => ("ann0".to_string(), "please ask bob"),
        (14, _) => ("ann1".to_string(), "please ask bob"),
        (_, 0 | 1) => (format!("chief{}", n % 3), "please delegate this"),
        _ => (format!("worker{}", n % 3), "answer directly"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_process_agents_are_taken_over() {
    let c = cluster(7).await;
    wait_for("every agent hosted by one process", || {
        c.every_agent_hosted_once()
    })
    .await;
    let spread = c.hosts();
    let victim_agents: Vec<AgentId> = spread
        .iter()
        .filter(|(_, h)| h.contains(&"p1"))
        .map(|(a, _)| a.clone())
        .collect();
    assert!(
        victim_agents.len() >= 2,
        "p1 should host a share of the agents: {spread:?}"
    );

    // Work in flight, delivered through every process (to agents hosted anywhere).
    let mut jobs = Vec::new();
    for n in 0..12 {
        let (agent, text) = job(n);
        let name = format!("job-{n}");
        c.deliver(n % 3, &agent, &name, text).await;
        jobs.push(name);
    }
    // Kill p1 (a SIGKILL: nothing shut down, its leases stay until they expire) once some of the
    // work is under way.
    wait_for("some work to start", || c.answered().len() >= 2).await;
    let killed_at = Instant::now();
    c.processes[0].spawner.kill();

    // More work after the kill, through the survivors, also to agents p1 hosted.
    for n in 12..20 {
        let (agent, text) = job(n);
        let name = format!("job-{n}");
        c.deliver(1 + n % 2, &agent, &name, text).await;
        jobs.push(name);
    }

    wait_for("the survivors to take over every agent", || {
        c.every_agent_hosted_once()
    })
    .await;
    let took = killed_at.elapsed();
    assert!(
        took < LEASE + Duration::from_secs(3),
        "the takeover took {took:?} (lease {LEASE:?})"
    );
    for a in &victim_agents {
        let hosts = c.hosts();
        assert!(
            hosts[a].iter().all(|h| *h != "p1"),
            "{a} still on the killed process"
        );
    }

    c.wait_answered(&jobs).await;
    c.assert_no_duplicate_tasks().await;
    // The killed process's loops never ran their stop hooks (they were aborted), so only the model
    // calls count here: an aborted call's guard was dropped with it.
    let violations = c.watch.violations.lock().unwrap().clone();
    assert!(
        violations.iter().all(|v| !v.contains("model calls")),
        "two model calls of one agent ran at once: {violations:?}"
    );
    for p in c.live() {
        p.org.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_partitioned_process_stops_before_another_takes_over() {
    let c = cluster(7).await;
    wait_for("every agent hosted by one process", || {
        c.every_agent_hosted_once()
    })
    .await;
    let p1 = c.processes[0].org.process().unwrap().clone();
    let before: Vec<AgentId> = c.processes[0].org.hosted_agents();
    assert!(!before.is_empty(), "p1 should host agents: {:?}", c.hosts());

    let mut jobs = Vec::new();
    for n in 0..12 {
        let (agent, text) = job(n);
        let name = format!("job-{n}");
        c.deliver(n % 3, &agent, &name, text).await;
        jobs.push(name);
    }
    wait_for("some work to start", || c.answered().len() >= 2).await;
    // p1's database connection drops: its renewals fail, so it fences its agents before their
    // leases run out; only then may p2 and p3 take them.
    c.placement.cut_off(&p1);
    for n in 12..20 {
        let (agent, text) = job(n);
        let name = format!("job-{n}");
        c.deliver(1 + n % 2, &agent, &name, text).await;
        jobs.push(name);
    }
    wait_for("p2 and p3 to host every agent", || {
        let hosts = c.hosts();
        all_agents()
            .iter()
            .all(|a| hosts.get(a).is_some_and(|h| h.len() == 1 && h[0] != "p1"))
    })
    .await;
    c.wait_answered(&jobs).await;

    // p1 said why it let its agents go.
    wait_for("p1 to report fencing each agent it hosted", || {
        let lost = c.lost.lock().unwrap();
        before
            .iter()
            .all(|a| lost.iter().any(|(p, l)| p == "p1" && l == a))
    })
    .await;
    c.assert_no_duplicate_tasks().await;
    let violations = c.watch.violations.lock().unwrap().clone();
    assert!(
        violations.is_empty(),
        "two loops (or model calls) of one agent ran at once: {violations:?}"
    );
    for p in c.live() {
        p.org.shutdown().await.unwrap();
    }
}

/// A hand-over is not the end of an agent's session: a conversation stays open when a member's
/// process is cut off mid-turn (its loop fenced, the turn run again by the next host) and when the
/// other member's process shuts down cleanly (its lease released to the next host). The peer's
/// conclusion then reaches the initiator, who answers the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_conversation_goes_on_when_its_members_are_handed_over() {
    let only = |agents: &[&str]| -> Vec<AgentId> {
        agents.iter().map(|a| AgentId::parse(*a).unwrap()).collect()
    };
    // p1 may host ann0, p2 bob0, p3 both (started last: it takes them over).
    let c = cluster_with(
        |name, options| match name {
            "p1" => options.with_agents(only(&["ann0"])),
            "p2" => options.with_agents(only(&["bob0"])),
            _ => options.with_agents(only(&["ann0", "bob0"])),
        },
        None,
    )
    .await;
    c.processes[0].org.start_all().await.unwrap();
    c.processes[1].org.start_all().await.unwrap();
    wait_for("ann0 on p1 and bob0 on p2", || {
        let hosts = c.hosts();
        hosts.get(&AgentId::parse("ann0").unwrap()) == Some(&vec!["p1"])
            && hosts.get(&AgentId::parse("bob0").unwrap()) == Some(&vec!["p2"])
    })
    .await;
    c.processes[2].org.start_all().await.unwrap();

    // bob0's turn on p2 is under way (its model call held) when p2 is cut off: p2 fences bob0.
    c.watch.hold("bob0");
    c.deliver(0, "ann0", "job-2", "please ask bob").await;
    wait_for("bob0's model call on p2", || c.watch.in_flight("bob0") == 1).await;
    let p2 = c.processes[1].org.process().unwrap().clone();
    c.placement.cut_off(&p2);
    wait_for("bob0 fenced on p2", || {
        c.lost
            .lock()
            .unwrap()
            .iter()
            .any(|(p, a)| p == "p2" && a.as_str() == "bob0")
    })
    .await;
    // p1 shuts down cleanly: ann0's lease is released for p3.
    c.processes[0].org.shutdown().await.unwrap();
    c.watch.release();
    c.wait_answered(&["job-2".to_string()]).await;

    let conversations = c.processes[2]
        .org
        .conversations(&Default::default())
        .await
        .unwrap();
    assert_eq!(conversations.len(), 1, "{conversations:#?}");
    assert_eq!(
        conversations[0].status,
        spacebot_core::conversation::ConversationStatus::Concluded,
        "{conversations:#?}"
    );
    assert_eq!(
        c.hosts().get(&AgentId::parse("ann0").unwrap()),
        Some(&vec!["p3"])
    );
    assert_eq!(
        c.hosts().get(&AgentId::parse("bob0").unwrap()),
        Some(&vec!["p3"])
    );
    c.processes[2].org.shutdown().await.unwrap();
}

/// Its first attempt never ends (until it is dropped, which it records); later attempts are done.
#[derive(Debug, Default)]
struct HangsOnce {
    attempts: std::sync::atomic::AtomicU32,
    dropped: Arc<AtomicBool>,
}

struct Dropped(Arc<AtomicBool>);

impl Drop for Dropped {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[async_trait]
impl TaskExecutor for HangsOnce {
    async fn execute(&self, _ctx: TaskContext, _task: Task) -> Result<TaskOutcome, TaskError> {
        if self.attempts.fetch_add(1, Ordering::SeqCst) == 0 {
            let _dropped = Dropped(self.dropped.clone());
            std::future::pending::<()>().await;
        }
        Ok(TaskOutcome::Done("ran".into()))
    }
}

/// A custom executor's attempt is fenced with its agent: a process cut off from the placement
/// table aborts it, and the next host runs the task again at once (not after the 10-minute task
/// lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fenced_executor_attempt_is_aborted_and_run_again_at_once() {
    an_executor_attempt_moves_at_once(Leave::CutOff).await;
}

/// The same on a clean shutdown of the process that hosts the agent: its attempt is aborted, not
/// awaited, and the next host runs the task again at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_executor_attempt_is_aborted_by_a_clean_shutdown_and_run_again_at_once() {
    an_executor_attempt_moves_at_once(Leave::Shutdown).await;
}

/// How the first host lets go of its agent.
enum Leave {
    /// Cut off from the placement table: it fences the agent.
    CutOff,
    /// `Organization::shutdown`: it hands the agent over.
    Shutdown,
}

async fn an_executor_attempt_moves_at_once(leave: Leave) {
    let executor = Arc::new(HangsOnce::default());
    let worker0 = AgentId::parse("worker0").unwrap();
    let c = cluster_with(
        |name, options| match name {
            "p1" => options.with_agents(vec![worker0.clone()]),
            "p2" => options.with_agents(Vec::new()),
            _ => options.with_agents(vec![worker0.clone()]),
        },
        Some(executor.clone()),
    )
    .await;
    c.processes[0].org.start_all().await.unwrap();
    c.processes[1].org.start_all().await.unwrap();
    wait_for("worker0 on p1", || {
        c.hosts().get(&worker0) == Some(&vec!["p1"])
    })
    .await;
    c.processes[2].org.start_all().await.unwrap();

    let task = c.processes[1]
        .org
        .delegate(
            &AgentId::parse("lead0").unwrap(),
            "worker0",
            "job-1 for the worker",
            DelegationOrigin::new(ChannelId::new("portal:lead0")),
        )
        .await
        .unwrap();
    wait_for("the first attempt on p1", || {
        executor.attempts.load(Ordering::SeqCst) == 1
    })
    .await;
    match leave {
        Leave::CutOff => {
            let p1 = c.processes[0].org.process().unwrap().clone();
            c.placement.cut_off(&p1);
        }
        Leave::Shutdown => {
            tokio::time::timeout(TIMEOUT, c.processes[0].org.shutdown())
                .await
                .expect("the shutdown does not wait for the attempt")
                .unwrap();
        }
    }
    wait_for("p1 to abort the attempt when it lets worker0 go", || {
        executor.dropped.load(Ordering::SeqCst)
    })
    .await;
    let ended = tokio::time::timeout(
        TIMEOUT,
        c.processes[2]
            .org
            .wait_task_ended(&TaskRef::new(worker0.clone(), task.number)),
    )
    .await
    .expect("the task ran again on p3 within the timeout, not after its lease")
    .unwrap();
    assert_eq!(ended.status, TaskStatus::Done);
    assert_eq!(ended.result.as_deref(), Some("ran"));
    assert_eq!(executor.attempts.load(Ordering::SeqCst), 2);
    assert_eq!(c.hosts().get(&worker0), Some(&vec!["p3"]));
    for p in c.live() {
        let _ = tokio::time::timeout(Duration::from_secs(5), p.org.shutdown()).await;
    }
}
