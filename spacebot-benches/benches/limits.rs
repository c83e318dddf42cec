//! What request limits cost a turn: the same turn (deliver, the model answers at once reporting
//! usage, the reply is out) with no limits and with `[settings.limits]` set (every model call
//! reserved before it is made and settled after, in the request's ledger record), on in-memory
//! stores and on SQLite in a temporary directory (`synchronous = NORMAL`, set here: the figures
//! in docs/governance.md were taken so, and a turn's CPU is what is compared, not the disk;
//! `SPACEBOT_BENCH_SYNC=full` runs SQLite's default, `FULL`, where each commit is an `fsync`).
//!
//! ```text
//! cargo bench -p spacebot-benches --bench limits
//! ```
//!
//! - `limits/turn/{memory,sqlite}/{off,on}`: criterion's figures, one turn per iteration;
//! - then, per backend, the two organizations measured again in alternation (pairs of blocks of
//!   `SPACEBOT_BENCH_BLOCK` turns, 200 by default, `SPACEBOT_BENCH_PAIRS` pairs, 15 by default): the
//!   median block time of each and the median per-pair ratio on/off are printed
//!   (`limits/turn/{backend}/interleaved` on stderr), a ratio that the machine's drift between
//!   criterion's runs does not move.
//!
//! With `SPACEBOT_BENCH_TURNS=N` set, the binary runs N turns of one organization and exits instead
//! (no criterion; `SPACEBOT_BENCH_STORES=memory|sqlite`, `SPACEBOT_BENCH_LIMITS=on|off`): run it
//! under `perf stat -e instructions:u` with N and 2N turns, and the difference divided by N is what
//! one turn costs in instructions, free of a shared machine's timing noise.
//!
//! Each message is a new request (a new ledger record with limits on); every turn on one channel,
//! whose history the context window bounds.
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
use spacebot::config::OrgConfig;
use spacebot::{InboundMessage, Organization, Replies, Stores};
use spacebot_benches::Stub;

const AGENTS: &str = r#"
[[agents]]
id = "a"
name = "Alpha"
"#;

/// Limits that bind every request but are never reached.
const LIMITS: &str = r#"
[settings.limits]
total_tokens = 1000000000
model_calls = 1000000
tool_calls = 1000000
"#;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Backend {
    Memory,
    Sqlite,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Sqlite => "sqlite",
        }
    }
}

struct Bench {
    org: Organization,
    replies: Replies,
    /// SQLite's stores, for their writer's counters.
    sqlite: Option<spacebot::sqlite::SqliteStores>,
    _dir: Option<tempfile::TempDir>,
}

impl Bench {
    async fn start(backend: Backend, limited: bool) -> Self {
        let (stores, sqlite, dir) = match backend {
            Backend::Memory => (Stores::memory(), None, None),
            Backend::Sqlite => {
                let dir = tempfile::tempdir().unwrap();
                // `SPACEBOT_BENCH_SYNC=full`: the default setting, a commit one `fsync`.
                let sync = if std::env::var("SPACEBOT_BENCH_SYNC").as_deref() == Ok("full") {
                    spacebot::sqlite::Synchronous::Full
                } else {
                    spacebot::sqlite::Synchronous::Normal
                };
                let sqlite = spacebot::sqlite::SqliteOptions::new()
                    .synchronous(sync)
                    .open(dir.path())
                    .await
                    .unwrap();
                (sqlite.stores(), Some(sqlite), Some(dir))
            }
        };
        let toml = if limited {
            format!("{LIMITS}{AGENTS}")
        } else {
            AGENTS.to_owned()
        };
        let llm = Stub;
        let org = Organization::builder(OrgConfig::from_toml_str(&toml).unwrap())
            .stores(stores)
            .llm(Arc::new(llm))
            .build()
            .await
            .unwrap();
        org.start_all().await.unwrap();
        let replies = org.take_replies().unwrap();
        Self {
            org,
            replies,
            sqlite,
            _dir: dir,
        }
    }

    async fn turns(&mut self, n: u64) -> Duration {
        let start = Instant::now();
        for _ in 0..n {
            self.org
                .deliver("a", InboundMessage::new("portal", "u", "hi"))
                .await
                .unwrap();
            self.replies.next().await.unwrap();
        }
        start.elapsed()
    }

    async fn stop(self) {
        self.org.shutdown().await.unwrap();
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn turn(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for backend in [Backend::Memory, Backend::Sqlite] {
        let mut group = c.benchmark_group(format!("limits/turn/{}", backend.name()));
        group
            .sample_size(30)
            .measurement_time(Duration::from_secs(5));
        group.throughput(Throughput::Elements(1));
        let mut off = rt.block_on(Bench::start(backend, false));
        let mut on = rt.block_on(Bench::start(backend, true));
        for (name, bench) in [("off", &mut off), ("on", &mut on)] {
            group.bench_function(name, |b| {
                b.iter_custom(|iters| rt.block_on(bench.turns(iters)));
            });
        }
        group.finish();

        let block = env_u64("SPACEBOT_BENCH_BLOCK", 200);
        let pairs = env_u64("SPACEBOT_BENCH_PAIRS", 15);
        let (mut offs, mut ons, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..pairs {
            // Alternate which goes first, so neither always runs on a warmer cache.
            let (a, b) = if i % 2 == 0 {
                let a = rt.block_on(off.turns(block));
                (a, rt.block_on(on.turns(block)))
            } else {
                let b = rt.block_on(on.turns(block));
                (rt.block_on(off.turns(block)), b)
            };
            let (a, b) = (a.as_secs_f64(), b.as_secs_f64());
            offs.push(a / block as f64 * 1e6);
            ons.push(b / block as f64 * 1e6);
            ratios.push(b / a);
        }
        eprintln!(
            "limits/turn/{}/interleaved: off {:.1} µs, on {:.1} µs a turn (medians of {pairs} blocks of {block}); median ratio on/off {:.3}",
            backend.name(),
            median(offs),
            median(ons),
            median(ratios)
        );
        rt.block_on(off.stop());
        rt.block_on(on.stop());
    }
}

criterion_group!(benches, turn);

/// Runs `turns` turns of one organization (see the module's documentation).
fn count_turns(turns: u64) {
    let backend = match std::env::var("SPACEBOT_BENCH_STORES").as_deref() {
        Ok("sqlite") => Backend::Sqlite,
        _ => Backend::Memory,
    };
    let limited = std::env::var("SPACEBOT_BENCH_LIMITS").as_deref() != Ok("off");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut bench = Bench::start(backend, limited).await;
        let before = bench.sqlite.as_ref().map(|s| s.instance_write_stats());
        let took = bench.turns(turns).await;
        // The writer's counters once the settlements made behind were stored too.
        bench.org.shutdown().await.unwrap();
        let after = bench.sqlite.as_ref().map(|s| s.instance_write_stats());
        let writes = match (before, after) {
            (Some(a), Some(b)) => format!(
                "; {:.2} commits and {:.2} write operations a turn",
                (b.commits - a.commits) as f64 / turns as f64,
                (b.operations - a.operations) as f64 / turns as f64
            ),
            _ => String::new(),
        };
        println!(
            "{turns} turns on {} with limits {} in {took:?}{writes}",
            backend.name(),
            if limited { "on" } else { "off" }
        );
    });
}

fn main() {
    if let Some(turns) = std::env::var("SPACEBOT_BENCH_TURNS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        count_turns(turns);
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
