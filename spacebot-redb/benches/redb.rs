//! Durable task cycles (create, claim, complete with its outbox row) per second:
//! - `raw_redb`: the same writes on redb directly (same tables, same JSON values, one durable
//!   commit per step), on the calling thread;
//! - `store_commit_each`: the stores through [`TaskStore`], one caller, so one durable commit per step;
//! - `store_group_commit/{n}`: `n` concurrent callers on one board; operations that queue up while a
//!   commit is in progress share the next durable commit, and each caller is answered after it.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark stops at the first failure

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use redb::{Database, ReadableTable, TableDefinition};
use spacebot_core::task::{CompletionNotice, Expect, NewTask, Task, TaskEvent, TaskStore};
use spacebot_core::{AgentId, ChannelId, Timestamp};
use spacebot_redb::{RedbOptions, RedbStore};

const TASKS: TableDefinition<u64, &[u8]> = TableDefinition::new("tasks");
const READY: TableDefinition<(u8, u64), ()> = TableDefinition::new("tasks_ready");
const LEASES: TableDefinition<(i64, u64), ()> = TableDefinition::new("tasks_leases");
const OUTBOX: TableDefinition<u64, &[u8]> = TableDefinition::new("outbox");
const OUTBOX_KEYS: TableDefinition<&str, u64> = TableDefinition::new("outbox_keys");

const LEASE: Duration = Duration::from_secs(60);

fn new_task() -> NewTask {
    let mut t = NewTask::new(
        "Summarize the ticket",
        "Read the thread and write three lines.",
    );
    t.metadata.delegated_by = Some(AgentId::parse("boss").unwrap());
    t.metadata.originating_channel = Some(ChannelId::new("portal:chat:boss"));
    t
}

fn decode(bytes: &[u8]) -> Task {
    serde_json::from_slice(bytes).unwrap()
}

/// One cycle on raw redb: the writes the store makes, three durable commits.
fn raw_cycle(db: &Database, agent: &AgentId) {
    let now = Timestamp::now_utc();
    // create
    let tx = db.begin_write().unwrap();
    {
        let mut tasks = tx.open_table(TASKS).unwrap();
        let number = tasks
            .last()
            .unwrap()
            .map(|(k, _)| k.value() + 1)
            .unwrap_or(1);
        let task = new_task().into_task(agent.clone(), number, now).unwrap();
        let rank = 3 - task.priority.rank() as u8;
        tasks
            .insert(number, serde_json::to_vec(&task).unwrap().as_slice())
            .unwrap();
        tx.open_table(READY)
            .unwrap()
            .insert((rank, number), ())
            .unwrap();
    }
    tx.commit().unwrap();
    // claim
    let tx = db.begin_write().unwrap();
    let number = {
        let mut ready = tx.open_table(READY).unwrap();
        let (rank, number) = ready.first().unwrap().map(|(k, _)| k.value()).unwrap();
        let mut tasks = tx.open_table(TASKS).unwrap();
        let task = decode(tasks.get(number).unwrap().unwrap().value());
        let claimed = task
            .apply(
                TaskEvent::Claim {
                    holder: "w".into(),
                    lease_until: now.plus(LEASE),
                },
                now,
            )
            .unwrap()
            .task;
        ready.remove((rank, number)).unwrap();
        let expires = claimed.lease.as_ref().unwrap().expires_at.as_millis();
        tx.open_table(LEASES)
            .unwrap()
            .insert((expires, number), ())
            .unwrap();
        tasks
            .insert(number, serde_json::to_vec(&claimed).unwrap().as_slice())
            .unwrap();
        number
    };
    tx.commit().unwrap();
    // complete, with the outbox row
    let tx = db.begin_write().unwrap();
    {
        let mut tasks = tx.open_table(TASKS).unwrap();
        let task = decode(tasks.get(number).unwrap().unwrap().value());
        let done = task
            .apply(
                TaskEvent::Complete {
                    holder: "w".into(),
                    result: "three lines".into(),
                },
                now,
            )
            .unwrap();
        let expires = task.lease.as_ref().unwrap().expires_at.as_millis();
        tx.open_table(LEASES)
            .unwrap()
            .remove((expires, number))
            .unwrap();
        tasks
            .insert(number, serde_json::to_vec(&done.task).unwrap().as_slice())
            .unwrap();
        let notice: CompletionNotice = done.notice.unwrap();
        let mut outbox = tx.open_table(OUTBOX).unwrap();
        let seq = outbox
            .last()
            .unwrap()
            .map(|(k, _)| k.value() + 1)
            .unwrap_or(1);
        outbox
            .insert(seq, serde_json::to_vec(&notice).unwrap().as_slice())
            .unwrap();
        tx.open_table(OUTBOX_KEYS)
            .unwrap()
            .insert(notice.key.as_str(), seq)
            .unwrap();
    }
    tx.commit().unwrap();
}

async fn store_cycle(store: &RedbStore, agent: &AgentId, holder: &str) {
    let now = Timestamp::now_utc();
    store.create(agent, new_task(), now).await.unwrap();
    let claimed = store
        .claim_next(agent, holder, LEASE, now)
        .await
        .unwrap()
        .unwrap();
    store
        .transition(
            agent,
            claimed.number,
            Expect::any(),
            TaskEvent::Complete {
                holder: holder.into(),
                result: "three lines".into(),
            },
            now,
        )
        .await
        .unwrap();
}

fn cycles(c: &mut Criterion) {
    let agent = AgentId::parse("worker").unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("durable_task_cycle");
    group.throughput(Throughput::Elements(1));
    group.sample_size(10);

    let raw_dir = tempfile::tempdir().unwrap();
    let db = Database::create(raw_dir.path().join("raw.redb")).unwrap();
    group.bench_function("raw_redb", |b| b.iter(|| raw_cycle(&db, &agent)));
    drop(db);

    let dir = tempfile::tempdir().unwrap();
    let store = RedbStore::open(dir.path(), RedbOptions::default().commit_each()).unwrap();
    group.bench_function("store_commit_each", |b| {
        b.to_async(&rt).iter(|| store_cycle(&store, &agent, "w"))
    });
    rt.block_on(store.close());

    for callers in [64usize, 256, 1024] {
        let dir = tempfile::tempdir().unwrap();
        let store = RedbStore::open(
            dir.path(),
            RedbOptions::default().group_commit(callers, Duration::ZERO),
        )
        .unwrap();
        group.bench_function(format!("store_group_commit/{callers}"), |b| {
            b.iter_custom(|iters| {
                let per = iters.div_ceil(callers as u64);
                let start = Instant::now();
                rt.block_on(async {
                    let mut handles = Vec::with_capacity(callers);
                    for i in 0..callers {
                        let store: Arc<RedbStore> = store.clone();
                        let agent = agent.clone();
                        handles.push(tokio::spawn(async move {
                            let holder = format!("w{i}");
                            for _ in 0..per {
                                store_cycle(&store, &agent, &holder).await;
                            }
                        }));
                    }
                    for h in handles {
                        h.await.unwrap();
                    }
                });
                // Scale to the requested number of cycles.
                start
                    .elapsed()
                    .mul_f64(iters as f64 / (per * callers as u64) as f64)
            })
        });
        rt.block_on(store.close());
    }
    group.finish();
}

criterion_group!(benches, cycles);
criterion_main!(benches);
