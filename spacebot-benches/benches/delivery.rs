//! Delivery throughput: envelopes per second through the organization's internal channel (policy
//! check included) into 1,000 agents' queues, against a raw channel router doing the same work in
//! the same run; and the memory an idle agent costs, queue included, at 10,000 agents.
//!
//! ```text
//! cargo bench -p spacebot-benches --bench delivery
//! ```
//!
//! Both sides build the same envelope, look the target up and push into a bounded per-agent queue;
//! the organization also checks the link policy and emits an event. Queues are emptied between
//! batches, outside the measured time, and no agent loop consumes them (an inert spawner), so only
//! delivery is measured.

#![allow(clippy::expect_used)] // A benchmark set-up that fails should stop the run.

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group};
use futures::channel::mpsc;
use futures::future::BoxFuture;
use spacebot_core::config::OrgConfig;
use spacebot_core::testing::ScriptedLlm;
use spacebot_core::{
    AgentId, ChannelId, Envelope, EnvelopeKind, InternalMessage, ManualClock, Organization, Source,
    Spawner, Stores,
};

const AGENTS: usize = 1_000;
const BATCH: usize = 100_000;

/// A spawner that never runs what it is given: agents get queues but no consumer.
#[derive(Debug)]
struct Inert;

impl Spawner for Inert {
    fn spawn(&self, future: BoxFuture<'static, ()>) {
        drop(future);
    }
}

/// `hub` superior of `agent-0` .. `agent-{n-1}`, one-way links.
fn config(n: usize, capacity: usize) -> OrgConfig {
    let mut toml = format!("[settings]\nqueue_capacity = {capacity}\n\n[[agents]]\nid = \"hub\"\n");
    for i in 0..n {
        toml.push_str(&format!("\n[[agents]]\nid = \"agent-{i}\"\n"));
    }
    for i in 0..n {
        toml.push_str(&format!(
            "\n[[links]]\nfrom = \"hub\"\nto = \"agent-{i}\"\ndirection = \"one_way\"\nrelationship = \"superior\"\n"
        ));
    }
    OrgConfig::from_toml_str(&toml).expect("valid config")
}

async fn organization(n: usize, capacity: usize, spawner: Arc<dyn Spawner>) -> Organization {
    let org = Organization::builder(config(n, capacity))
        .stores(Stores::memory())
        .llm(Arc::new(ScriptedLlm::new()))
        .spawner(spawner)
        .clock(Arc::new(ManualClock::new(0)))
        .build()
        .await
        .expect("organization");
    org.start_all().await.expect("start");
    org
}

/// The baseline: a map from agent id to a bounded channel.
struct RawRouter {
    senders: HashMap<AgentId, mpsc::Sender<Envelope>>,
    receivers: Vec<mpsc::Receiver<Envelope>>,
}

impl RawRouter {
    fn new(agents: &[AgentId], capacity: usize) -> Self {
        let mut senders = HashMap::new();
        let mut receivers = Vec::new();
        for agent in agents {
            let (tx, rx) = mpsc::channel(capacity);
            senders.insert(agent.clone(), tx);
            receivers.push(rx);
        }
        Self { senders, receivers }
    }

    fn send(&mut self, from: &AgentId, to: &AgentId, content: &str) {
        let envelope = Envelope::new(
            Source::Internal {
                from_agent: from.clone(),
                link_id: None,
            },
            ChannelId::link(to, from),
            EnvelopeKind::TaskAssigned,
            content,
            spacebot_core::Timestamp(0),
        );
        let sender = self.senders.get_mut(to).expect("known agent");
        sender.try_send(envelope).expect("room in the queue");
    }

    fn drain(&mut self) {
        for rx in &mut self.receivers {
            while let Ok(envelope) = rx.try_recv() {
                black_box(envelope);
            }
        }
    }
}

fn delivery(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let capacity = BATCH / AGENTS + 1;
    let org = rt.block_on(organization(AGENTS, capacity, Arc::new(Inert)));
    let hub = AgentId::parse("hub").expect("id");
    let agents: Vec<AgentId> = (0..AGENTS)
        .map(|i| AgentId::parse(format!("agent-{i}")).expect("id"))
        .collect();
    let mut raw = RawRouter::new(&agents, capacity);

    let mut group = c.benchmark_group("delivery_into_1000_queues");
    group.throughput(Throughput::Elements(BATCH as u64));
    group.sample_size(20);
    group.measurement_time(Duration::from_secs(10));
    group.bench_function("organization_send_internal", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let start = Instant::now();
                rt.block_on(async {
                    for i in 0..BATCH {
                        let to = &agents[i % AGENTS];
                        org.send_internal(&hub, to, InternalMessage::task("status?"))
                            .await
                            .expect("delivered");
                    }
                });
                total += start.elapsed();
                for agent in &agents {
                    black_box(org.take_queued(agent));
                }
            }
            total
        })
    });
    group.bench_function("raw_channel_router", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let start = Instant::now();
                for i in 0..BATCH {
                    raw.send(&hub, &agents[i % AGENTS], "status?");
                }
                total += start.elapsed();
                raw.drain();
            }
            total
        })
    });
    group.finish();
}

/// Resident memory of this process, in bytes (Linux), if it can be read.
fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// Memory per idle agent at 10,000 agents: each agent's loop and task loop are real Tokio tasks
/// waiting on an empty queue.
fn idle_memory() {
    const N: usize = 10_000;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .expect("runtime");
    let config = config(N, 256);
    let before = resident_bytes();
    let org = rt.block_on(async {
        let org = Organization::builder(config)
            .stores(Stores::memory())
            .llm(Arc::new(ScriptedLlm::new()))
            .spawner(Arc::new(spacebot_core::rt::TokioSpawner::current()))
            .clock(Arc::new(ManualClock::new(0)))
            .build()
            .await
            .expect("organization");
        org.start_all().await.expect("start");
        tokio::time::sleep(Duration::from_millis(200)).await;
        org
    });
    let after = resident_bytes();
    match (before, after) {
        (Some(b), Some(a)) => println!(
            "idle agents: {N} running agents cost {} KiB resident in all, {:.1} KiB per agent (configuration and link graph included)",
            a.saturating_sub(b) / 1024,
            a.saturating_sub(b) as f64 / 1024.0 / N as f64
        ),
        _ => println!("idle agents: /proc/self/statm is not readable here; memory not measured"),
    }
    rt.block_on(org.shutdown()).expect("shutdown");
}

criterion_group!(benches, delivery);

fn main() {
    idle_memory();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
