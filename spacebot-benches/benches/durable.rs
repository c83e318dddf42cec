//! Durable throughput of the whole organization on SQLite and redb, in a temporary directory on
//! the machine's disk (real `fsync`), beside the raw `fsync` rate of the same disk in the same run.
//!
//! ```text
//! cargo bench -p spacebot-benches --bench durable
//! ```
//!
//! - `durable_deliveries/{backend}/1_agent_sequential`: `Organization::deliver` to one running
//!   agent, waiting for its reply before the next message (one delivery per iteration);
//! - `durable_deliveries/{backend}/1_agent_64_in_flight`: 64 messages delivered at once to one
//!   agent, the iteration ends when every one of them is answered (a reply answers every envelope
//!   its turn merged);
//! - `durable_deliveries/{backend}/64_agents`: one message to each of 64 running agents at once,
//!   until all 64 are answered;
//! - `durable_delegation/{backend}/{1,64}_chains`: a user message to `a-i`, whose model delegates
//!   to `b-i` (`send_agent_message`), `b-i`'s model answers the task, `a-i` is woken by the
//!   completion notice and answers the user: three model calls per round trip, 1 or 64 chains at
//!   once;
//! - `durable_history/{sqlite_normal,redb,postgres}/{after_100,after_20000}`: one round trip of a single
//!   chain (as in `durable_delegation`) after 100 earlier round trips on the same agents and after
//!   20,000 (`SPACEBOT_BENCH_HISTORY` sets another count), on two organizations each built when
//!   its bench first runs (the filter `durable_history/redb` builds only redb's). A round trip must cost about the same however long
//!   the boards and channels already are. After criterion's figures, the two are measured again
//!   in alternation (pairs of 20-round-trip blocks, `SPACEBOT_BENCH_PAIRS` pairs, 15 by default)
//!   and the medians and the median per-pair ratio are printed (`.../interleaved` on stderr);
//! - `durable_round_trip/{sqlite_normal,sqlite_full,sqlite_normal_per_agent,sqlite_full_per_agent,sqlite_full_sync_each,redb,postgres}/1_chain` (`postgres` when
//!   `DATABASE_URL` is set): one chain's round trip (as
//!   in `durable_delegation`), then what it costs, measured in blocks after criterion's figures
//!   (`.../cost` on stderr): wall and CPU time of the process per round trip (user and system,
//!   as `getrusage` counts them), the write transactions the store committed per round trip
//!   and the syncs among them (the writer's own count of its `fsync`s; every commit on `redb`),
//!   and the raw `fsync` rate measured before each
//!   block (`SPACEBOT_BENCH_BLOCKS` blocks, 9 by default, of `SPACEBOT_BENCH_BLOCK` round trips,
//!   200); count the `fsync`s themselves with
//!   `strace -c -f -e trace=fsync,fdatasync` around a filtered run. With
//!   `SPACEBOT_BENCH_ONE_CORE=1` every group runs on Tokio's `current_thread` runtime (the CPU
//!   of a round trip on one core) instead of two worker threads. With
//!   `SPACEBOT_BENCH_STATEMENTS=1` the SQL statements sqlx runs (PostgreSQL's) are
//!   counted too (statements per round trip); `=top` lists them by kind;
//! - `durable_store_persist/{backend}/64_concurrent`: the stores alone, 64 concurrent
//!   `DeliveryStore::persist` calls to one agent's database (what group commit is for);
//! - `raw_fsync/write_4k_sync_data`: write 4 KiB at the start of a temporary file and
//!   `File::sync_data` it, in a loop.
//!
//! The model is `FnLlm`, answering at once. Backends: `sqlite_normal` (`synchronous = NORMAL`:
//! WAL commits are not synced), `sqlite_full` (the default `synchronous = FULL` with deferred
//! syncing: an `fsync` per commit carrying a write the application is answered for, the
//! runtime's own commits synced with it; see `SqliteOptions::sync_delay`), `sqlite_full_sync_each`
//! (`FULL` with an `fsync` per commit, the default before deferred syncing), both in the default
//! organization layout (every agent in one database), each also
//! with `_commit_each` (`SqliteOptions::commit_each()`: no group commit, one transaction per
//! write, for comparison in the same run) and with `_per_agent` (`Layout::PerAgent`: one
//! database per agent, the layout before 2026-11-27), and `redb` (the default
//! `Durability::Immediate`: one `fsync` per commit, group commit); `durable_history` also runs on
//! `postgres` (a temporary schema on the server of `DATABASE_URL`, for example the throwaway one of
//! `eval "$(.ci/postgres start)"`) when that variable is set.
//! Each benchmark's organization is built once and serves its warm-up and every sample.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    missing_docs,
    unreachable_pub
)] // benchmark code: failing loudly is the point

use std::collections::HashSet;
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkGroup, Criterion, Throughput, criterion_group, measurement::WallTime};
use futures::StreamExt;
use serde_json::json;
use spacebot::error::LlmError;
use spacebot::llm::{ChatRequest, ChatResponse, LlmProvider};
use spacebot::postgres::PgStores;
use spacebot::rt::{TokioClock, TokioSpawner};
use spacebot::testing::{FnLlm, tool_call};
use spacebot::{
    AgentId, ChannelId, Envelope, EnvelopeKind, InboundMessage, OrgConfig, Organization, Source,
    Stores, Timestamp,
};
use tokio::runtime::Runtime;

#[derive(Debug, Clone, Copy)]
enum Backend {
    SqliteNormal,
    SqliteNormalCommitEach,
    SqliteFull,
    SqliteFullCommitEach,
    /// `synchronous = NORMAL` in the per-agent layout (one database per agent).
    SqliteNormalPerAgent,
    /// `synchronous = FULL` in the per-agent layout.
    SqliteFullPerAgent,
    /// `synchronous = FULL` with every commit synced (`sync_delay(Duration::ZERO)`): the default
    /// before deferred syncing.
    SqliteFullSyncEach,
    Redb,
    /// A temporary schema on the server of `DATABASE_URL` (`durable_history` only).
    Postgres,
}

impl Backend {
    const ALL: [Self; 8] = [
        Self::SqliteNormal,
        Self::SqliteNormalCommitEach,
        Self::SqliteFull,
        Self::SqliteFullCommitEach,
        Self::SqliteNormalPerAgent,
        Self::SqliteFullPerAgent,
        Self::SqliteFullSyncEach,
        Self::Redb,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::SqliteNormal => "sqlite_normal",
            Self::SqliteNormalCommitEach => "sqlite_normal_commit_each",
            Self::SqliteFull => "sqlite_full",
            Self::SqliteFullCommitEach => "sqlite_full_commit_each",
            Self::SqliteNormalPerAgent => "sqlite_normal_per_agent",
            Self::SqliteFullPerAgent => "sqlite_full_per_agent",
            Self::SqliteFullSyncEach => "sqlite_full_sync_each",
            Self::Redb => "redb",
            Self::Postgres => "postgres",
        }
    }

    /// The backend's stores in `dir` (or, for PostgreSQL, in a temporary schema: kept as long as
    /// the returned `PgStores` lives).
    async fn open(self, dir: &Path) -> (Stores, Option<PgStores>) {
        let (stores, schema, _) = self.open_counted(dir).await;
        (stores, schema)
    }

    /// [`open`](Self::open), with the backend's count of committed write transactions (SQLite:
    /// its writers' counters summed over the instance and the agents' files; redb: the store's
    /// own count; none on PostgreSQL).
    async fn open_counted(self, dir: &Path) -> (Stores, Option<PgStores>, Commits) {
        use spacebot::sqlite::{Layout, SqliteOptions, Synchronous};
        let sqlite = |synchronous, commit_each: bool| {
            let options = SqliteOptions::new().synchronous(synchronous);
            if commit_each {
                options.commit_each()
            } else {
                options
            }
        };
        let options = match self {
            Self::SqliteNormal => sqlite(Synchronous::Normal, false),
            Self::SqliteNormalCommitEach => sqlite(Synchronous::Normal, true),
            Self::SqliteFull => sqlite(Synchronous::Full, false),
            Self::SqliteFullCommitEach => sqlite(Synchronous::Full, true),
            Self::SqliteNormalPerAgent => {
                sqlite(Synchronous::Normal, false).layout(Layout::PerAgent)
            }
            Self::SqliteFullPerAgent => sqlite(Synchronous::Full, false).layout(Layout::PerAgent),
            Self::SqliteFullSyncEach => sqlite(Synchronous::Full, false).sync_delay(Duration::ZERO),
            Self::Redb => {
                let store = spacebot::redb::RedbStore::open_async(dir, Default::default())
                    .await
                    .unwrap();
                return (store.stores(), None, Commits::Redb(store));
            }
            Self::Postgres => {
                let url = std::env::var("DATABASE_URL").expect("DATABASE_URL");
                let pg = PgStores::temporary(&url).await.unwrap();
                return (pg.stores(), Some(pg), Commits::None);
            }
        };
        let sqlite = options.open(dir).await.unwrap();
        (sqlite.stores(), None, Commits::Sqlite(sqlite))
    }
}

/// Where a backend counts its committed write transactions.
enum Commits {
    Sqlite(spacebot::sqlite::SqliteStores),
    Redb(Arc<spacebot::redb::RedbStore>),
    None,
}

impl Commits {
    /// Transactions committed so far in the organization's files (`agents`: the agents whose
    /// files count, with the instance's), and the syncs (`fsync`s of a log) among them, or `None`
    /// when the backend does not count them (redb: every commit syncs).
    fn count(&self, agents: &[AgentId]) -> Option<(u64, u64)> {
        match self {
            // One writer for every agent: its counters are the instance database's.
            Self::Sqlite(stores) if stores.layout() == spacebot::sqlite::Layout::Organization => {
                let s = stores.instance_write_stats();
                Some((s.commits, s.syncs))
            }
            Self::Sqlite(stores) => Some(
                std::iter::once(stores.instance_write_stats())
                    .chain(agents.iter().filter_map(|a| stores.agent_write_stats(a)))
                    .fold((0, 0), |(c, f), s| (c + s.commits, f + s.syncs)),
            ),
            Self::Redb(store) => Some((store.commits(), store.commits())),
            Self::None => None,
        }
    }
}

/// CPU time the whole process used so far (user and system, all threads), as
/// `getrusage(RUSAGE_SELF)` reports it, read from `/proc/self/stat` (clock ticks of 10 ms;
/// `None` where that file does not exist).
fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The fields after the command's parenthesis: state is field 3, utime 14, stime 15.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i)?.parse::<u64>().ok();
    let total = ticks(11)? + ticks(12)?;
    Some(Duration::from_millis(total * 10))
}

/// The chains' model: `a-i` delegates a user message to `b-i`, `b-i` answers, `a-i` relays.
fn chains_answer(req: &ChatRequest) -> ChatResponse {
    let me = req.agent.as_ref().map(AgentId::as_str).unwrap_or("");
    match (me.split_once('-'), req.envelope_kind) {
        (Some(("a", n)), Some(EnvelopeKind::UserMessage)) => {
            ChatResponse::tool_calls(vec![tool_call(
                "send_agent_message",
                json!({"target": format!("b-{n}"), "message": "Compute the answer."}),
            )])
        }
        (Some(("b", _)), _) => ChatResponse::text("42"),
        (Some(("a", _)), _) => ChatResponse::text("42, relayed"),
        _ => ChatResponse::text("ok"),
    }
}

/// [`chains_answer`] without keeping the requests (`FnLlm` keeps a copy of each: over 20,000
/// round trips that log would take gigabytes).
#[derive(Debug)]
struct Chains;

#[async_trait::async_trait]
impl LlmProvider for Chains {
    async fn complete(&self, req: ChatRequest) -> Result<ChatResponse, LlmError> {
        Ok(chains_answer(&req))
    }
}

/// A running organization in its own temporary directory.
struct Running {
    org: Organization,
    replies: spacebot::Replies,
    commits: Commits,
    _dir: tempfile::TempDir,
    _schema: Option<PgStores>,
}

impl Running {
    /// `recording`: the model is `FnLlm` (which keeps every request, as the figures of this bench
    /// were first measured with); otherwise [`Chains`], which keeps nothing (long runs).
    async fn start(backend: Backend, toml: &str, recording: bool) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("spacebot-bench-")
            .tempdir()
            .unwrap();
        let (stores, schema, commits) = backend.open_counted(dir.path()).await;
        let llm: Arc<dyn LlmProvider> = if recording {
            Arc::new(FnLlm::new(|req| Ok(chains_answer(req))))
        } else {
            Arc::new(Chains)
        };
        let org = Organization::builder(OrgConfig::from_toml_str(toml).unwrap())
            .stores(stores)
            .llm(llm)
            .spawner(Arc::new(TokioSpawner::current()))
            .clock(Arc::new(TokioClock))
            .build()
            .await
            .unwrap();
        let replies = org.take_replies().unwrap();
        org.start_all().await.unwrap();
        Self {
            org,
            replies,
            commits,
            _dir: dir,
            _schema: schema,
        }
    }

    /// Delivers one message to each agent in `to` at once and waits until every one is answered.
    async fn deliver_and_wait(&mut self, to: &[String]) {
        let ids = futures::future::join_all(to.iter().map(|agent| {
            self.org
                .deliver(agent, InboundMessage::new("portal", "u", "hello"))
        }))
        .await;
        let mut waiting: HashSet<_> = ids.into_iter().map(Result::unwrap).collect();
        while !waiting.is_empty() {
            let reply = self.replies.next().await.unwrap();
            for id in &reply.in_reply_to {
                waiting.remove(id);
            }
        }
    }

    /// Starts one round trip on each chain `a-i` at once and waits for every delegator's answer.
    async fn round_trips(&mut self, chains: usize) {
        let org = &self.org;
        futures::future::join_all((0..chains).map(|i| async move {
            org.deliver(
                &format!("a-{i}"),
                InboundMessage::new("portal", format!("u{i}"), "What is the answer?"),
            )
            .await
        }))
        .await
        .into_iter()
        .for_each(|r| {
            r.unwrap();
        });
        let mut answered = 0;
        while answered < chains {
            let reply = self.replies.next().await.unwrap();
            if reply.content == "42, relayed" {
                answered += 1;
            }
        }
    }

    async fn stop(self) {
        self.org.shutdown().await.unwrap();
    }
}

/// `n` unlinked agents `agent-0` .. `agent-{n-1}`.
fn agents_config(n: usize) -> String {
    (0..n)
        .map(|i| format!("[[agents]]\nid = \"agent-{i}\"\n\n"))
        .collect()
}

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

fn configure(group: &mut BenchmarkGroup<'_, WallTime>) {
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(5));
}

/// Two worker threads, or with `SPACEBOT_BENCH_ONE_CORE=1` Tokio's `current_thread` runtime (the
/// organization's work on one thread: the CPU a round trip costs on one core).
fn runtime() -> Runtime {
    if std::env::var("SPACEBOT_BENCH_ONE_CORE").as_deref() == Ok("1") {
        return tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn deliveries(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("durable_deliveries");
    configure(&mut group);
    // (name, agents in the organization, messages per iteration and to whom)
    let one = vec!["agent-0".to_string()];
    let cases: [(&str, usize, Vec<String>); 3] = [
        ("1_agent_sequential", 1, one.clone()),
        ("1_agent_64_in_flight", 1, vec!["agent-0".to_string(); 64]),
        (
            "64_agents",
            64,
            (0..64).map(|i| format!("agent-{i}")).collect(),
        ),
    ];
    for backend in Backend::ALL {
        for (name, agents, targets) in &cases {
            // Built on first use: a filter that skips the bench builds nothing.
            let mut built: Option<Running> = None;
            group.throughput(Throughput::Elements(targets.len() as u64));
            group.bench_function(format!("{}/{name}", backend.name()), |b| {
                let running = built.get_or_insert_with(|| {
                    rt.block_on(Running::start(backend, &agents_config(*agents), true))
                });
                b.iter_custom(|iters| {
                    rt.block_on(async {
                        let start = Instant::now();
                        for _ in 0..iters {
                            running.deliver_and_wait(targets).await;
                        }
                        start.elapsed()
                    })
                })
            });
            if let Some(running) = built {
                rt.block_on(running.stop());
            }
        }
    }
    group.finish();
}

fn delegation(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("durable_delegation");
    configure(&mut group);
    for backend in Backend::ALL {
        for chains in [1usize, 64] {
            let mut built: Option<Running> = None;
            group.throughput(Throughput::Elements(chains as u64));
            group.bench_function(format!("{}/{chains}_chains", backend.name()), |b| {
                let running = built.get_or_insert_with(|| {
                    rt.block_on(Running::start(backend, &chains_config(chains), true))
                });
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
            if let Some(running) = built {
                rt.block_on(running.stop());
            }
        }
    }
    group.finish();
}

/// One round trip after 100 earlier ones and after many (20,000 by default), on the defaults of
/// each backend (SQLite with `synchronous = NORMAL`, redb with one `fsync` per commit). Each
/// organization is built when its bench first runs; when both ran, they are also measured in
/// alternation (`interleaved`), so that a change in the machine's load hits both alike.
fn history(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("durable_history");
    configure(&mut group);
    group.throughput(Throughput::Elements(1));
    let long: usize = std::env::var("SPACEBOT_BENCH_HISTORY")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(20_000);
    let mut backends = vec![Backend::SqliteNormal, Backend::Redb];
    if std::env::var("DATABASE_URL").is_ok_and(|u| !u.trim().is_empty()) {
        backends.push(Backend::Postgres);
    } else {
        eprintln!("DATABASE_URL not set: durable_history runs on SQLite and redb only");
    }
    for backend in backends {
        // Each organization is built (its earlier round trips run) when its bench first runs: a
        // filter that skips both builds nothing.
        let mut built: Vec<(usize, Option<Running>)> = vec![(100, None), (long, None)];
        for (earlier, slot) in &mut built {
            let earlier = *earlier;
            group.bench_function(format!("{}/after_{earlier}", backend.name()), |b| {
                let running = slot.get_or_insert_with(|| {
                    let set_up = Instant::now();
                    let mut running =
                        rt.block_on(Running::start(backend, &chains_config(1), false));
                    rt.block_on(async {
                        for _ in 0..earlier {
                            running.round_trips(1).await;
                        }
                    });
                    eprintln!(
                        "durable_history/{}: {earlier} round trips of set-up in {:.1} s",
                        backend.name(),
                        set_up.elapsed().as_secs_f64()
                    );
                    running
                });
                b.iter_custom(|iters| {
                    rt.block_on(async {
                        let start = Instant::now();
                        for _ in 0..iters {
                            running.round_trips(1).await;
                        }
                        start.elapsed()
                    })
                })
            });
        }
        let mut built: Vec<(usize, Running)> = built
            .into_iter()
            .filter_map(|(earlier, running)| Some((earlier, running?)))
            .collect();
        interleaved(&rt, backend, &mut built);
        for (_, running) in built {
            rt.block_on(running.stop());
        }
    }
    group.finish();
}

/// The two organizations of `durable_history` measured in alternation: pairs of blocks of round
/// trips, one block on each (which one goes first alternates), so that a change in the machine's
/// load or in the disk's other traffic hits both alike. Prints the median round trip of each and
/// the median of the per-pair ratios (`SPACEBOT_BENCH_PAIRS` pairs, 15 by default, of 20 round
/// trips per block).
fn interleaved(rt: &Runtime, backend: Backend, built: &mut [(usize, Running)]) {
    const BLOCK: u32 = 20;
    let pairs: usize = std::env::var("SPACEBOT_BENCH_PAIRS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(15);
    let [(short_n, short), (long_n, long)] = built else {
        return;
    };
    let block = |running: &mut Running| {
        rt.block_on(async {
            let start = Instant::now();
            for _ in 0..BLOCK {
                running.round_trips(1).await;
            }
            start.elapsed().as_secs_f64() * 1e3 / f64::from(BLOCK)
        })
    };
    let (mut shorts, mut longs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for pair in 0..pairs {
        let (s, l) = if pair % 2 == 0 {
            let s = block(short);
            (s, block(long))
        } else {
            let l = block(long);
            (block(short), l)
        };
        shorts.push(s);
        longs.push(l);
        ratios.push(l / s);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let (s, l, r) = (median(&mut shorts), median(&mut longs), median(&mut ratios));
    let (lowest, highest) = (
        ratios.first().copied().unwrap_or(f64::NAN),
        ratios.last().copied().unwrap_or(f64::NAN),
    );
    eprintln!(
        "durable_history/{}/interleaved: {pairs} pairs of {BLOCK} round trips: after {short_n} \
         median {s:.2} ms, after {long_n} median {l:.2} ms, median pair ratio {r:.2} (ratios \
         {lowest:.2} to {highest:.2})",
        backend.name(),
    );
}

/// What one durable delegation round trip (one chain, as in `durable_delegation`) costs on
/// SQLite (`NORMAL` and `FULL`) and redb: criterion's throughput, then blocks of round trips
/// measured apart, each after a burst of bare `fsync`s in the same directory's file system, and
/// the medians printed (`.../cost` on stderr): wall time and CPU time of the process per round
/// trip, the transactions the store committed per round trip (each one `fsync` on `sqlite_full`
/// and `redb`), the raw `fsync` rate and the round trip in `fsync` times. `SPACEBOT_BENCH_BLOCKS`
/// blocks (9 by default) of `SPACEBOT_BENCH_BLOCK` round trips (200).
fn round_trip(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("durable_round_trip");
    configure(&mut group);
    group.throughput(Throughput::Elements(1));
    let mut backends = vec![
        Backend::SqliteNormal,
        Backend::SqliteFull,
        Backend::SqliteNormalPerAgent,
        Backend::SqliteFullPerAgent,
        Backend::SqliteFullSyncEach,
        Backend::Redb,
    ];
    if std::env::var("DATABASE_URL").is_ok_and(|u| !u.trim().is_empty()) {
        backends.push(Backend::Postgres);
    } else {
        eprintln!("DATABASE_URL not set: durable_round_trip runs on SQLite and redb only");
    }
    for backend in backends {
        let mut built: Option<Running> = None;
        group.bench_function(format!("{}/1_chain", backend.name()), |b| {
            let running = built.get_or_insert_with(|| {
                rt.block_on(Running::start(backend, &chains_config(1), false))
            });
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let start = Instant::now();
                    for _ in 0..iters {
                        running.round_trips(1).await;
                    }
                    start.elapsed()
                })
            })
        });
        if let Some(mut running) = built {
            round_trip_cost(&rt, backend, &mut running);
            rt.block_on(running.stop());
        }
    }
    group.finish();
}

/// Bare `fsync`s per second: `n` writes of 4 KiB at the start of a file in `dir`, each synced.
fn fsync_rate(dir: &Path, n: u32) -> f64 {
    let mut file = std::fs::File::create(dir.join("fsync.bin")).unwrap();
    let block = vec![0x5au8; 4096];
    let start = Instant::now();
    for _ in 0..n {
        file.seek(SeekFrom::Start(0)).unwrap();
        file.write_all(&block).unwrap();
        file.sync_data().unwrap();
    }
    f64::from(n) / start.elapsed().as_secs_f64()
}

/// The blocks of [`round_trip`] and their medians.
fn round_trip_cost(rt: &Runtime, backend: Backend, running: &mut Running) {
    let env = |name: &str, default: u32| {
        std::env::var(name)
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(default)
    };
    let (blocks, per_block) = (
        env("SPACEBOT_BENCH_BLOCKS", 9),
        env("SPACEBOT_BENCH_BLOCK", 200),
    );
    let agents = [
        AgentId::parse("a-0").unwrap(),
        AgentId::parse("b-0").unwrap(),
    ];
    let fsync_dir = tempfile::Builder::new()
        .prefix("spacebot-bench-fsync-")
        .tempdir()
        .unwrap();
    let (mut walls, mut cpus, mut fsyncs) = (Vec::new(), Vec::new(), Vec::new());
    let (mut commits, mut syncs, mut counted) = (0u64, 0u64, 0u64);
    let statements0 = statements::count();
    statements::print_top(0.0); // forgets what criterion's runs made
    for _ in 0..blocks {
        fsyncs.push(fsync_rate(fsync_dir.path(), 100));
        let (cpu0, commits0) = (process_cpu(), running.commits.count(&agents));
        let start = Instant::now();
        rt.block_on(async {
            for _ in 0..per_block {
                running.round_trips(1).await;
            }
        });
        let wall = start.elapsed().as_secs_f64() * 1e3 / f64::from(per_block);
        walls.push(wall);
        if let (Some(a), Some(b)) = (cpu0, process_cpu()) {
            cpus.push((b - a).as_secs_f64() * 1e3 / f64::from(per_block));
        }
        if let (Some(a), Some(b)) = (commits0, running.commits.count(&agents)) {
            commits += b.0 - a.0;
            syncs += b.1 - a.1;
            counted += u64::from(per_block);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let statements = statements::count().map(|n| n - statements0.unwrap_or(0));
    // SQLite's store runs without sqlx: nothing counted there.
    let statements = statements.filter(|n| *n > 0).map(|n| {
        format!(
            "; {:.1} statements per round trip",
            n as f64 / f64::from(blocks * per_block)
        )
    });
    statements::print_top(f64::from(blocks * per_block));
    let (wall, cpu, fsync) = (median(&mut walls), median(&mut cpus), median(&mut fsyncs));
    let per_trip = if counted == 0 {
        "not counted".to_string()
    } else {
        format!(
            "{:.2} ({:.2} synced)",
            commits as f64 / counted as f64,
            syncs as f64 / counted as f64
        )
    };
    eprintln!(
        "durable_round_trip/{}/cost: {blocks} blocks of {per_block}: median {wall:.3} ms per \
         round trip ({:.0}/s), CPU {cpu:.3} ms ({:.2} of the wall time), commits per round \
         trip {per_trip}; raw fsync {fsync:.0}/s: a round trip takes {:.1} fsync times{}",
        backend.name(),
        1e3 / wall,
        cpu / wall,
        wall * fsync / 1e3,
        statements.unwrap_or_default(),
    );
}

/// The stores alone: 64 concurrent `DeliveryStore::persist` calls to one agent's database, until
/// all are answered (what group commit is for: concurrent writers to one file).
fn store_persists(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("durable_store_persist");
    configure(&mut group);
    group.throughput(Throughput::Elements(64));
    let agent = AgentId::parse("inbox").unwrap();
    for backend in Backend::ALL {
        let dir = tempfile::Builder::new()
            .prefix("spacebot-bench-")
            .tempdir()
            .unwrap();
        let (stores, _schema) = rt.block_on(backend.open(dir.path()));
        group.bench_function(format!("{}/64_concurrent", backend.name()), |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let start = Instant::now();
                    for _ in 0..iters {
                        let envelopes: Vec<Envelope> = (0..64)
                            .map(|i| {
                                Envelope::new(
                                    Source::External {
                                        platform: "portal".into(),
                                        reply_target: format!("u{i}"),
                                    },
                                    ChannelId::new("portal:u"),
                                    EnvelopeKind::UserMessage,
                                    "hello",
                                    Timestamp(0),
                                )
                            })
                            .collect();
                        let done = futures::future::join_all(
                            envelopes
                                .iter()
                                .map(|e| stores.deliveries.persist(&agent, e)),
                        )
                        .await;
                        assert!(done.iter().all(Result::is_ok));
                    }
                    start.elapsed()
                })
            })
        });
        drop(stores);
    }
    group.finish();
}

fn raw_fsync(c: &mut Criterion) {
    let dir = tempfile::Builder::new()
        .prefix("spacebot-bench-fsync-")
        .tempdir()
        .unwrap();
    let mut file = std::fs::File::create(dir.path().join("fsync.bin")).unwrap();
    let block = vec![0x5au8; 4096];
    let mut group = c.benchmark_group("raw_fsync");
    configure(&mut group);
    group.throughput(Throughput::Elements(1));
    group.bench_function("write_4k_sync_data", |b| {
        b.iter(|| {
            file.seek(SeekFrom::Start(0)).unwrap();
            file.write_all(&block).unwrap();
            file.sync_data().unwrap();
        })
    });
    group.finish();
}

criterion_group!(
    benches,
    raw_fsync,
    store_persists,
    deliveries,
    delegation,
    round_trip,
    history
);

/// Counts the SQL statements sqlx runs (its `sqlx::query` events, one per statement: PostgreSQL's;
/// the SQLite store does not use sqlx), only when `SPACEBOT_BENCH_STATEMENTS` is set (a subscriber makes sqlx describe
/// every statement, which costs CPU); `=top` also prints the statements of `durable_round_trip`'s
/// blocks by kind (sqlx's summary: the first words), most frequent first.
mod statements {
    use std::collections::HashMap;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU64, Ordering};

    use tracing::field::{Field, Visit};
    use tracing::{Event, Metadata, Subscriber};
    use tracing_subscriber::layer::{Context, Layer};
    use tracing_subscriber::prelude::*;

    static COUNT: AtomicU64 = AtomicU64::new(0);
    static INSTALLED: AtomicU64 = AtomicU64::new(0);
    static TOP: Mutex<Option<HashMap<String, u64>>> = Mutex::new(None);

    struct Counter;

    struct Summary(Option<String>);

    impl Visit for Summary {
        fn record_str(&mut self, field: &Field, value: &str) {
            if field.name() == "summary" {
                self.0 = Some(value.to_string());
            }
        }
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            if field.name() == "summary" {
                self.0 = Some(format!("{value:?}"));
            }
        }
    }

    impl<S: Subscriber> Layer<S> for Counter {
        fn enabled(&self, metadata: &Metadata<'_>, _: Context<'_, S>) -> bool {
            metadata.target() == "sqlx::query"
        }
        fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
            COUNT.fetch_add(1, Ordering::Relaxed);
            let mut top = TOP.lock().unwrap();
            if let Some(top) = top.as_mut() {
                let mut summary = Summary(None);
                event.record(&mut summary);
                *top.entry(summary.0.unwrap_or_default()).or_default() += 1;
            }
        }
    }

    /// Installs the counter when `SPACEBOT_BENCH_STATEMENTS` asks for it.
    pub fn install() {
        let Ok(mode) = std::env::var("SPACEBOT_BENCH_STATEMENTS") else {
            return;
        };
        if mode == "top" {
            *TOP.lock().unwrap() = Some(HashMap::new());
        }
        tracing_subscriber::registry().with(Counter).init();
        INSTALLED.store(1, Ordering::Relaxed);
    }

    /// Statements run so far, when counted.
    pub fn count() -> Option<u64> {
        (INSTALLED.load(Ordering::Relaxed) == 1).then(|| COUNT.load(Ordering::Relaxed))
    }

    /// Prints (and forgets) the statements by kind, each divided by `per` (`0`: forgets them
    /// only).
    pub fn print_top(per: f64) {
        let Some(top) = TOP.lock().unwrap().as_mut().map(std::mem::take) else {
            return;
        };
        if per == 0.0 {
            return;
        }
        let mut top: Vec<_> = top.into_iter().collect();
        top.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
        for (summary, n) in top {
            eprintln!("  {:6.2}  {summary}", n as f64 / per);
        }
    }
}

fn main() {
    statements::install();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
