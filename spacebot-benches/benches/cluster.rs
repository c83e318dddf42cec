//! Durable delegation round trips on PostgreSQL, with one organization spread over 1, 2 and 3
//! "processes", beside SQLite on the same machine.
//!
//! ```text
//! eval "$(.ci/postgres start)"   # or any DATABASE_URL
//! cargo bench -p spacebot-benches --bench cluster
//! ```
//!
//! Without `DATABASE_URL` only the SQLite cases run (a line on stderr says so).
//!
//! A "process" here is an `Organization` in this one OS process, with a connection pool of its own
//! (`PgStores::connect_with` on the same schema) and a `PgPlacement` under its own `ProcessId`:
//! what separate processes share (the schema, the placement table, `NOTIFY`) is real; they share
//! the CPU of one benchmark process and its tokio runtime. Criterion drives one function, so OS
//! processes would need a protocol of their own; see `tests/cluster.rs` for those.
//!
//! - `cluster_delegation/{case}/{1,16}_chains`: a user message to `a-i`, whose model delegates to
//!   `b-i` (`send_agent_message`), `b-i`'s model answers the task, `a-i` is woken by the
//!   completion notice and answers: three model calls per round trip, 1 or 16 chains at once. The
//!   message is delivered through the first organization; with 2 or 3 processes most agents are
//!   hosted elsewhere (stored and hinted with `NOTIFY`), and `a-i` and `b-i` may be in different
//!   processes.
//! - cases: `sqlite_normal` (one process, embedded, no placement), `postgres_no_placement` (one
//!   process, no placement: every agent local), `postgres_{1,2,3}_processes` (under `PgPlacement`).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    missing_docs,
    unreachable_pub
)] // benchmark code: failing loudly is the point

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group};
use futures::StreamExt;
use futures::stream::SelectAll;
use serde_json::json;
use spacebot::llm::ChatResponse;
use spacebot::placement::{PlacementOptions, ProcessId};
use spacebot::postgres::{PgOptions, PgStores};
use spacebot::rt::{TokioClock, TokioSpawner};
use spacebot::testing::{FnLlm, tool_call};
use spacebot::{AgentId, EnvelopeKind, InboundMessage, OrgConfig, Organization, Stores};
use tokio::runtime::Runtime;

/// `n` chains `a-i` → `b-i` (superior).
fn chains_config(n: usize) -> String {
    let mut toml = String::new();
    for i in 0..n {
        toml.push_str(&format!(
            "[[agents]]\nid = \"a-{i}\"\n\n[[agents]]\nid = \"b-{i}\"\n\n\
             [[links]]\nfrom = \"a-{i}\"\nto = \"b-{i}\"\nrelationship = \"superior\"\n\n"
        ));
    }
    toml
}

fn llm() -> FnLlm {
    FnLlm::new(|req| {
        let me = req.agent.as_ref().map(AgentId::as_str).unwrap_or("");
        Ok(match (me.split_once('-'), req.envelope_kind) {
            (Some(("a", n)), Some(EnvelopeKind::UserMessage)) => {
                ChatResponse::tool_calls(vec![tool_call(
                    "send_agent_message",
                    json!({"target": format!("b-{n}"), "message": "Compute the answer."}),
                )])
            }
            (Some(("b", _)), _) => ChatResponse::text("42"),
            (Some(("a", _)), _) => ChatResponse::text("42, relayed"),
            _ => ChatResponse::text("ok"),
        })
    })
}

#[derive(Debug, Clone, Copy)]
enum Case {
    Sqlite,
    PgNoPlacement,
    Pg(usize),
}

impl Case {
    fn name(self) -> String {
        match self {
            Self::Sqlite => "sqlite_normal".into(),
            Self::PgNoPlacement => "postgres_no_placement".into(),
            Self::Pg(n) => format!("postgres_{n}_processes"),
        }
    }
}

/// The organizations of one case, and every reply of any of them.
struct Running {
    orgs: Vec<Organization>,
    replies: SelectAll<spacebot::Replies>,
    _dir: Option<tempfile::TempDir>,
    _schema: Option<PgStores>,
}

fn build(config: &str, stores: Stores) -> spacebot::OrganizationBuilder {
    Organization::builder(OrgConfig::from_toml_str(config).unwrap())
        .stores(stores)
        .llm(Arc::new(llm()))
        .spawner(Arc::new(TokioSpawner::current()))
        .clock(Arc::new(TokioClock))
}

impl Running {
    async fn start(case: Case, chains: usize, url: Option<&str>) -> Self {
        let config = chains_config(chains);
        let mut orgs = Vec::new();
        let mut dir = None;
        let mut schema = None;
        match case {
            Case::Sqlite => {
                let d = tempfile::Builder::new()
                    .prefix("spacebot-bench-")
                    .tempdir()
                    .unwrap();
                let stores = spacebot::sqlite::open(d.path()).await.unwrap();
                orgs.push(build(&config, stores).build().await.unwrap());
                dir = Some(d);
            }
            Case::PgNoPlacement => {
                let pg = PgStores::temporary(url.unwrap()).await.unwrap();
                orgs.push(build(&config, pg.stores()).build().await.unwrap());
                schema = Some(pg);
            }
            Case::Pg(n) => {
                let first = PgStores::temporary(url.unwrap()).await.unwrap();
                let name = first.schema().unwrap().to_string();
                let agents = 2 * chains;
                for p in 0..n {
                    let pg = PgOptions::new()
                        .schema(name.clone())
                        .connect(url.unwrap())
                        .await
                        .unwrap();
                    let options = PlacementOptions::new(ProcessId::new(format!("p{p}")).unwrap())
                        .with_capacity(agents.div_ceil(n))
                        .with_acquire_per_round(4)
                        .with_lease(
                            Duration::from_secs(10),
                            Duration::from_secs(1),
                            Duration::from_secs(3),
                        )
                        .with_check_interval(Duration::from_secs(1));
                    let org = build(&config, pg.stores())
                        .placement(Arc::new(pg.placement()), options)
                        .build()
                        .await
                        .unwrap();
                    orgs.push(org);
                }
                schema = Some(first);
            }
        }
        let mut replies = SelectAll::new();
        for org in &orgs {
            replies.push(org.take_replies().unwrap());
            org.start_all().await.unwrap();
        }
        // Under a placement, wait until every agent is hosted somewhere.
        if let Case::Pg(_) = case {
            let start = Instant::now();
            while orgs.iter().map(|o| o.hosted_agents().len()).sum::<usize>() < 2 * chains {
                assert!(
                    start.elapsed() < Duration::from_secs(60),
                    "agents not placed"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Self {
            orgs,
            replies,
            _dir: dir,
            _schema: schema,
        }
    }

    /// One round trip on each chain at once, delivered through the first organization.
    async fn round_trips(&mut self, chains: usize) {
        let org = &self.orgs[0];
        let done = futures::future::join_all((0..chains).map(|i| async move {
            org.deliver(
                &format!("a-{i}"),
                InboundMessage::new("portal", format!("u{i}"), "What is the answer?"),
            )
            .await
        }))
        .await;
        for r in done {
            r.unwrap();
        }
        let mut answered = 0;
        while answered < chains {
            let reply = self.replies.next().await.unwrap();
            if reply.content == "42, relayed" {
                answered += 1;
            }
        }
    }

    async fn stop(self) {
        for org in &self.orgs {
            org.shutdown().await.unwrap();
        }
    }
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn delegation(c: &mut Criterion) {
    let url = std::env::var("DATABASE_URL")
        .ok()
        .filter(|u| !u.trim().is_empty());
    let mut cases = vec![Case::Sqlite];
    if url.is_some() {
        cases.extend([Case::PgNoPlacement, Case::Pg(1), Case::Pg(2), Case::Pg(3)]);
    } else {
        eprintln!("DATABASE_URL not set: only the SQLite cases of the cluster bench run");
    }
    let rt = runtime();
    let mut group = c.benchmark_group("cluster_delegation");
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(5));
    for case in cases {
        for chains in [1usize, 16] {
            let mut running = rt.block_on(Running::start(case, chains, url.as_deref()));
            group.throughput(Throughput::Elements(chains as u64));
            group.bench_function(format!("{}/{chains}_chains", case.name()), |b| {
                b.iter_custom(|iters| {
                    rt.block_on(async {
                        let start = Instant::now();
                        for _ in 0..iters {
                            running.round_trips(chains).await;
                        }
                        start.elapsed()
                    })
                })
            });
            rt.block_on(running.stop());
        }
    }
    group.finish();
}

criterion_group!(benches, delegation);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
