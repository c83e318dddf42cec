//! Speed at organization scale (in-memory stores, one core):
//!
//! - `turn_scaling/agents/{10,1000,10000}`: one agent turn (deliver, the model answers at once, the
//!   reply is out) in organizations of 10, 1,000 and 10,000 agents, each with 3 links. A turn costs
//!   what the agent's own links cost, so the three should be within a few percent of each other.
//! - `turn_scaling/history/{100,20000}`: one delegation round trip (delegate, the worker answers,
//!   the delegator is woken and answers: 3 model calls) after 100 and after 20,000 earlier round
//!   trips on the same boards. A round trip must not scan an agent's whole task history.
//! - `runtime/{turn,round_trip}/{current_thread,multi_thread,multi_thread_on_org}`: one turn, and
//!   one delegation round trip, of a 10-agent ring on each runtime (2 workers), driven from a
//!   spawned task, or (`_on_org`) from the organization's own executor (`Organization::spawn`).
//! - `runtime/tokio_ping_pong/{current_thread,multi_thread}`: two plain Tokio tasks answering each
//!   other, the answer a fixed computation of a few microseconds: the host scheduler's own cost.
//! - `org_throughput/{current_thread,multi_thread,multi_thread_2_runners}`: 1,000 agents, 100,000
//!   messages delivered round-robin, then all answered, driven from a spawned task; messages per
//!   second (`_2_runners`: the organization's loops on two tasks of the runtime,
//!   `OrganizationBuilder::runners(2)`).
//!
//! ```text
//! cargo bench -p spacebot-benches --bench scaling
//! ```

#![allow(clippy::expect_used, clippy::unwrap_used)] // A benchmark set-up that fails should stop the run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group};
use futures::StreamExt;
use spacebot::config::OrgConfig;
use spacebot::error::LlmError;
use spacebot::llm::{ChatRequest, ChatResponse, LlmProvider};
use spacebot::testing::tool_call;
use spacebot::{EnvelopeKind, InboundMessage, Organization, Stores};

/// `n` agents in a ring of peers, each linked to the next three (3 links each on average out,
/// 6 touching).
fn ring(n: usize) -> OrgConfig {
    let mut toml = String::from("[settings]\nqueue_capacity = 100000\n");
    for i in 0..n {
        toml.push_str(&format!(
            "\n[[agents]]\nid = \"agent-{i}\"\nname = \"Agent {i}\"\n"
        ));
    }
    for i in 0..n {
        for step in 1..=3 {
            let j = (i + step) % n;
            if j == i || (n <= 3 && j < i) {
                continue;
            }
            toml.push_str(&format!(
                "\n[[links]]\nfrom = \"agent-{i}\"\nto = \"agent-{j}\"\nrelationship = \"peer\"\n"
            ));
        }
    }
    OrgConfig::from_toml_str(&toml).expect("valid config")
}

/// A stub model that answers at once and keeps nothing (the `testing` providers record every
/// request, which would make the bench measure their log).
#[derive(Debug)]
struct Stub {
    /// `agent-0` delegates every user message to `agent-1` and answers the result.
    delegate: bool,
}

#[async_trait]
impl LlmProvider for Stub {
    async fn complete(&self, req: ChatRequest) -> Result<ChatResponse, LlmError> {
        if !self.delegate {
            return Ok(ChatResponse::text("ok"));
        }
        let me = req.agent.as_ref().map(|a| a.as_str()).unwrap_or("");
        Ok(match (me, req.envelope_kind) {
            ("agent-0", Some(EnvelopeKind::UserMessage)) => {
                ChatResponse::tool_calls(vec![tool_call(
                    "send_agent_message",
                    serde_json::json!({"target": "agent-1", "message": "Compute."}),
                )])
            }
            ("agent-1", _) => ChatResponse::text("42"),
            _ => ChatResponse::text("The answer is 42."),
        })
    }
}

/// Answers every message at once.
fn echo() -> Arc<Stub> {
    Arc::new(Stub { delegate: false })
}

/// The delegator (`agent-0`) delegates every user message to `agent-1` and answers the result.
fn delegating() -> Arc<Stub> {
    Arc::new(Stub { delegate: true })
}

async fn organization(config: OrgConfig, llm: Arc<Stub>) -> Organization {
    organization_with_runners(config, llm, 1).await
}

async fn organization_with_runners(
    config: OrgConfig,
    llm: Arc<Stub>,
    runners: usize,
) -> Organization {
    let org = Organization::builder(config)
        .stores(Stores::memory())
        .llm(llm)
        .runners(runners)
        .build()
        .await
        .expect("organization");
    org.start_all().await.expect("start");
    org
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn multi_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn turn_scaling(c: &mut Criterion) {
    let mut group = c.benchmark_group("turn_scaling");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(4));
    group.throughput(Throughput::Elements(1));
    for n in [10usize, 1_000, 10_000] {
        let rt = current_thread();
        let (org, mut replies) = rt.block_on(async {
            let org = organization(ring(n), echo()).await;
            let replies = org.take_replies().expect("replies");
            (org, replies)
        });
        group.bench_function(BenchmarkId::new("agents", n), |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let start = Instant::now();
                    for _ in 0..iters {
                        org.deliver("agent-0", InboundMessage::new("portal", "u", "hi"))
                            .await
                            .unwrap();
                        replies.next().await.unwrap();
                    }
                    start.elapsed()
                })
            })
        });
    }
    for earlier in [100usize, 20_000] {
        let rt = current_thread();
        let (org, mut replies) = rt.block_on(async {
            let org = organization(ring(10), delegating()).await;
            let mut replies = org.take_replies().expect("replies");
            for _ in 0..earlier {
                org.deliver("agent-0", InboundMessage::new("portal", "u", "go"))
                    .await
                    .unwrap();
                replies.next().await.unwrap();
            }
            (org, replies)
        });
        group.bench_function(BenchmarkId::new("history", earlier), |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let start = Instant::now();
                    for _ in 0..iters {
                        org.deliver("agent-0", InboundMessage::new("portal", "u", "go"))
                            .await
                            .unwrap();
                        replies.next().await.unwrap();
                    }
                    start.elapsed()
                })
            })
        });
    }
    group.finish();
}

fn org_throughput(c: &mut Criterion) {
    const AGENTS: usize = 1_000;
    const MESSAGES: usize = 100_000;
    let mut group = c.benchmark_group("org_throughput");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(8));
    group.throughput(Throughput::Elements(MESSAGES as u64));
    for (name, rt, runners) in [
        ("current_thread", current_thread(), 1),
        ("multi_thread", multi_thread(), 1),
        ("multi_thread_2_runners", multi_thread(), 2),
    ] {
        let (org, replies) = rt.block_on(async {
            let org = organization_with_runners(ring(AGENTS), echo(), runners).await;
            let replies = org.take_replies().expect("replies");
            (org, replies)
        });
        let names: Arc<Vec<String>> = Arc::new((0..AGENTS).map(|i| format!("agent-{i}")).collect());
        let mut replies = Some(replies);
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let org = org.clone();
                let names = names.clone();
                let mut rx = replies.take().expect("replies");
                // Driven from a spawned task (a worker thread of the multi-thread runtime).
                let (elapsed, rx) = rt
                    .block_on(rt.spawn(async move {
                        let start = Instant::now();
                        for _ in 0..iters {
                            for i in 0..MESSAGES {
                                org.deliver(
                                    &names[i % AGENTS],
                                    InboundMessage::new("portal", "u", "hi"),
                                )
                                .await
                                .unwrap();
                            }
                            for _ in 0..MESSAGES {
                                rx.next().await.unwrap();
                            }
                        }
                        (start.elapsed(), rx)
                    }))
                    .expect("the driver");
                replies = Some(rx);
                elapsed
            })
        });
    }
    group.finish();
}

/// Where the bench's driver (the application's code: deliver, await the reply) runs.
#[derive(Clone, Copy)]
enum Driver {
    /// A task of its own on the host runtime (`Runtime::spawn`).
    Task,
    /// The organization's executor, beside the agents ([`Organization::spawn`]).
    OnOrg,
}

/// One agent's turn and one delegation round trip on each runtime, driven from a spawned task as
/// an application's own task would (a `block_on` thread is not a worker of the multi-thread
/// runtime: driving from it makes every delivery and reply cross threads), and from the
/// organization's own executor.
fn runtimes(c: &mut Criterion) {
    let mut group = c.benchmark_group("runtime");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(4));
    group.throughput(Throughput::Elements(1));
    for (what, llm) in [("turn", echo()), ("round_trip", delegating())] {
        for (name, rt, driver) in [
            ("current_thread", current_thread(), Driver::Task),
            ("multi_thread", multi_thread(), Driver::Task),
            ("multi_thread_on_org", multi_thread(), Driver::OnOrg),
        ] {
            let (org, replies) = rt.block_on(async {
                let org = organization(ring(10), llm.clone()).await;
                let replies = org.take_replies().expect("replies");
                (org, replies)
            });
            let mut replies = Some(replies);
            group.bench_function(format!("{what}/{name}"), |b| {
                b.iter_custom(|iters| {
                    let driving = org.clone();
                    let mut rx = replies.take().expect("replies");
                    let chain = async move {
                        let start = Instant::now();
                        for _ in 0..iters {
                            driving
                                .deliver("agent-0", InboundMessage::new("portal", "u", "go"))
                                .await
                                .unwrap();
                            rx.next().await.unwrap();
                        }
                        (start.elapsed(), rx)
                    };
                    let (elapsed, rx) = match driver {
                        Driver::Task => rt.block_on(rt.spawn(chain)).expect("the driver"),
                        Driver::OnOrg => rt.block_on(org.spawn(chain)),
                    };
                    replies = Some(rx);
                    elapsed
                })
            });
        }
    }
    group.finish();
}

/// The host scheduler alone: two plain Tokio tasks answering each other over channels, the
/// answering side spending about as long per message as a turn of the stub model (a fixed
/// computation), on each runtime. What the multi-thread runtime costs any chain of two tasks.
fn ping_pong(c: &mut Criterion) {
    /// A fixed computation of a few microseconds.
    fn work(seed: u64) -> u64 {
        let mut x = seed;
        for i in 0..4_000u64 {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(i);
            x = std::hint::black_box(x);
        }
        x
    }
    let mut group = c.benchmark_group("runtime");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(4));
    group.throughput(Throughput::Elements(1));
    for (name, rt) in [
        ("current_thread", current_thread()),
        ("multi_thread", multi_thread()),
    ] {
        group.bench_function(format!("tokio_ping_pong/{name}"), |b| {
            b.iter_custom(|iters| {
                rt.block_on(rt.spawn(async move {
                    let (to_peer, mut inbox) = futures::channel::mpsc::unbounded::<u64>();
                    let (to_driver, mut answers) = futures::channel::mpsc::unbounded::<u64>();
                    tokio::spawn(async move {
                        while let Some(n) = inbox.next().await {
                            let _ = to_driver.unbounded_send(work(n));
                        }
                    });
                    let start = Instant::now();
                    for n in 0..iters {
                        to_peer.unbounded_send(n).unwrap();
                        answers.next().await.unwrap();
                    }
                    start.elapsed()
                }))
                .expect("the driver")
            })
        });
    }
    group.finish();
}

criterion_group!(benches, turn_scaling, runtimes, ping_pong, org_throughput);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
