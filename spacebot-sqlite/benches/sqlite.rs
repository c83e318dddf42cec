//! Durable task cycles per second: create a delegated task, claim it, complete it (writing its
//! outbox row in the same transaction), through the SQLite stores and through raw sqlx running
//! the same statements on the same schema, in the same run. Both use WAL and
//! `synchronous = NORMAL` on a file in a temporary directory.
//!
//! The ratio store / raw is the stores' overhead: decoding rows, the pure lifecycle function,
//! JSON metadata, the per-agent database map. Every sample runs the two cycles alternately and
//! times one of them, so a busy machine slows both alike. The stores run on rusqlite (a batch of
//! statements in one hand-off to the writer's thread), raw sqlx one statement per hand-off: the
//! ratio now also compares the two ways of driving SQLite.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use spacebot_core::task::{Expect, TaskEvent};
use spacebot_core::{AgentId, NewTask, TaskStore, Timestamp};
use spacebot_sqlite::{SqliteStores, sql};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Row, SqlitePool};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// One cycle through the stores.
async fn store_cycle(stores: &SqliteStores, agent: &AgentId, boss: &AgentId, i: u64) {
    let tasks = stores.tasks();
    let now = Timestamp(i as i64);
    let mut new = NewTask::new("count the stars", "all of them");
    new.created_by = "agent:boss".into();
    new.metadata.delegated_by = Some(boss.clone());
    tasks.create(agent, new, now).await.unwrap();
    let claimed = tasks
        .claim_next(agent, "w1", Duration::from_secs(60), now)
        .await
        .unwrap()
        .unwrap();
    let done = tasks
        .transition(
            agent,
            claimed.number,
            Expect::any(),
            TaskEvent::Complete {
                holder: "w1".into(),
                result: "many".into(),
            },
            now,
        )
        .await
        .unwrap();
    assert!(done.notice.is_some());
}

/// The same statements with raw sqlx and values prepared by hand.
async fn raw_cycle(pool: &SqlitePool, i: u64) {
    let now = i as i64;
    let metadata = r#"{"delegated_by":"boss"}"#;
    sqlx::query_scalar::<_, i64>(sql::INSERT_SQL)
        .bind("w")
        .bind("count the stars")
        .bind("all of them")
        .bind("ready")
        .bind(1_i64)
        .bind("agent:boss")
        .bind("boss")
        .bind(metadata)
        .bind(0_i64)
        .bind(3_i64)
        .bind(1_i64)
        .bind(now)
        .bind(now)
        .fetch_one(pool)
        .await
        .unwrap();
    let row = sqlx::query(sql::CLAIM_SQL)
        .bind("w1")
        .bind(now + 60_000)
        .bind(now)
        .bind("w")
        .fetch_one(pool)
        .await
        .unwrap();
    let number: i64 = row.get("number");
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    let row = sqlx::query(sql::SELECT_ONE_SQL)
        .bind("w")
        .bind(number)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let revision: i64 = row.get("revision");
    sqlx::query(sql::UPDATE_SQL)
        .bind("count the stars")
        .bind("all of them")
        .bind("done")
        .bind(1_i64)
        .bind("boss")
        .bind(metadata)
        .bind(0_i64)
        .bind(3_i64)
        .bind(None::<&str>)
        .bind(None::<i64>)
        .bind(revision + 1)
        .bind("many")
        .bind(None::<&str>)
        .bind(now)
        .bind("w")
        .bind(number)
        .bind(revision)
        .execute(&mut *tx)
        .await
        .unwrap();
    let key = format!("w#{number}:done");
    let notice = format!(
        r#"{{"key":"{key}","task":{{"agent":"w","number":{number}}},"title":"count the stars","status":"done","outcome":"many","delegated_by":"boss","originating_channel":null,"link_id":null,"parent_task":null,"created_at":{now}}}"#
    );
    sqlx::query(sql::OUTBOX_INSERT_SQL)
        .bind("w")
        .bind(&key)
        .bind(number)
        .bind(notice)
        .bind(now)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

async fn timed(work: impl std::future::Future<Output = ()>) -> Duration {
    let start = Instant::now();
    work.await;
    start.elapsed()
}

fn task_cycles(c: &mut Criterion) {
    let rt = runtime();
    let agent = AgentId::parse("w").unwrap();
    let boss = AgentId::parse("boss").unwrap();

    // The stores, with the agent's database opened up front.
    let stores = rt.block_on(SqliteStores::temporary()).unwrap();
    rt.block_on(store_cycle(&stores, &agent, &boss, 0));

    // Raw sqlx on a database with the same schema (migrated by the stores, then handed over).
    let raw_stores = rt.block_on(SqliteStores::temporary()).unwrap();
    rt.block_on(store_cycle(&raw_stores, &agent, &boss, 0));
    let raw_path = raw_stores.agent_db_path(&agent).unwrap();
    rt.block_on(raw_stores.close());
    let pool = rt
        .block_on(
            SqlitePoolOptions::new()
                .max_connections(1)
                .test_before_acquire(false)
                .connect_with(
                    SqliteConnectOptions::new()
                        .filename(&raw_path)
                        .journal_mode(SqliteJournalMode::Wal)
                        .synchronous(SqliteSynchronous::Normal)
                        .busy_timeout(Duration::from_secs(5)),
                ),
        )
        .unwrap();

    // Each sample runs both cycles alternately and times only its own, so the load of a shared
    // machine drifts over both measurements alike.
    let mut group = c.benchmark_group("task_cycle");
    group.throughput(Throughput::Elements(1));
    let mut i = 1_u64;
    for measured in ["raw_sqlx", "sqlite_stores"] {
        group.bench_function(measured, |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let (pool, stores, agent, boss) = (&pool, &stores, &agent, &boss);
                let start = i;
                i += iters;
                async move {
                    let mut spent = Duration::ZERO;
                    for k in start..start + iters {
                        // Alternate which goes first: the first of a pair pays for waking up.
                        let (raw, store) = if k % 2 == 0 {
                            let raw = timed(raw_cycle(pool, k)).await;
                            (raw, timed(store_cycle(stores, agent, boss, k)).await)
                        } else {
                            let store = timed(store_cycle(stores, agent, boss, k)).await;
                            (timed(raw_cycle(pool, k)).await, store)
                        };
                        spent += if measured == "raw_sqlx" { raw } else { store };
                    }
                    spent
                }
            })
        });
    }
    group.finish();
    rt.block_on(pool.close());
    rt.block_on(stores.close());
}

criterion_group!(benches, task_cycles);
criterion_main!(benches);
