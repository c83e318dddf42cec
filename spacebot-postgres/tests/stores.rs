//! What PostgreSQL adds to the conformance suite: several processes (here: several pools, each
//! its own `PgStores`, as separate processes would have) on one schema, connecting and migrating,
//! refusing foreign or newer schemas, and errors that name the database.
//!
//! Every test runs in a new schema of the database at `DATABASE_URL`; without it each says so on
//! stderr and passes (it fails instead under `SPACEBOT_REQUIRE_POSTGRES=1`, as in CI).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use futures::future::join_all;
use spacebot_core::task::{Expect, TaskEvent, TaskMetadata};
use spacebot_core::{
    AgentId, DeliveryStore, NewTask, StoreError, TaskStatus, TaskStore, Timestamp,
};
use spacebot_postgres::{PgOptions, PgStores};

fn agent(s: &str) -> AgentId {
    AgentId::parse(s).unwrap()
}

/// A temporary schema and `n` more stores on it, each with a pool of its own: the view of `n`
/// processes sharing one organization. `None` without a database.
async fn processes(n: usize) -> Option<(PgStores, Vec<PgStores>)> {
    let url = support::database_url()?;
    let first = support::options().temporary(&url).await.unwrap();
    let schema = first.schema().unwrap().to_string();
    let mut others = Vec::new();
    for _ in 0..n {
        others.push(
            support::options()
                .schema(schema.clone())
                .connect(&url)
                .await
                .unwrap(),
        );
    }
    Some((first, others))
}

/// A fresh schema name (the caller drops it).
fn schema_name() -> String {
    format!(
        "spacebot_test_{:016x}",
        uuid::Uuid::new_v4().as_u64_pair().0
    )
}

/// Runs `sql` on the database itself (outside any spacebot schema).
async fn admin(url: &str, sql: &str) {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_pg),
    ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README"
)]
async fn claims_from_several_processes_take_each_task_once() {
    let Some((first, procs)) = processes(3).await else {
        return;
    };
    let w = agent("worker");
    for i in 0..40 {
        let mut t = NewTask::new(format!("t{i}"), "");
        t.status = TaskStatus::Ready;
        first.tasks().create(&w, t, Timestamp(1)).await.unwrap();
    }
    // 90 claims from three pools at once: 40 tasks, each claimed once, the rest find nothing.
    let claims = procs.iter().enumerate().flat_map(|(p, store)| {
        let w = w.clone();
        (0..30).map(move |c| {
            let tasks = store.tasks();
            let w = w.clone();
            async move {
                tasks
                    .claim_next(
                        &w,
                        &format!("p{p}c{c}"),
                        Duration::from_secs(60),
                        Timestamp(2),
                    )
                    .await
                    .unwrap()
            }
        })
    });
    let claimed: Vec<_> = join_all(claims).await.into_iter().flatten().collect();
    let numbers: BTreeSet<u64> = claimed.iter().map(|t| t.number).collect();
    assert_eq!(claimed.len(), 40, "every task claimed exactly once");
    assert_eq!(numbers, (1..=40).collect(), "no task claimed twice");
    // The board agrees: every task in progress under the lease its claim returned.
    for t in &claimed {
        let stored = first.tasks().get(&w, t.number).await.unwrap().unwrap();
        assert_eq!(stored.status, TaskStatus::InProgress);
        assert_eq!(stored.lease, t.lease);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_pg),
    ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README"
)]
async fn only_the_lease_holder_acks_and_the_notice_comes_with_the_ack() {
    let Some((first, procs)) = processes(1).await else {
        return;
    };
    let (w, lead) = (agent("worker"), agent("lead"));
    let mut t = NewTask::new("report", "");
    t.status = TaskStatus::Ready;
    t.metadata = TaskMetadata {
        delegated_by: Some(lead.clone()),
        ..TaskMetadata::default()
    };
    first.tasks().create(&w, t, Timestamp(1)).await.unwrap();
    let claimed = procs[0]
        .tasks()
        .claim_next(&w, "holder", Duration::from_secs(60), Timestamp(2))
        .await
        .unwrap()
        .unwrap();
    // Another process may not complete it.
    let e = first
        .tasks()
        .transition(
            &w,
            claimed.number,
            Expect::any(),
            TaskEvent::Complete {
                holder: "intruder".into(),
                result: "no".into(),
            },
            Timestamp(3),
        )
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::NotLeaseHolder { .. }), "{e}");
    assert!(first.tasks().outbox_pending(&w).await.unwrap().is_empty());
    // The holder completes it, from its own process; the notice is there with the status.
    first
        .tasks()
        .transition(
            &w,
            claimed.number,
            Expect::any(),
            TaskEvent::Complete {
                holder: "holder".into(),
                result: "yes".into(),
            },
            Timestamp(4),
        )
        .await
        .unwrap();
    let notices = procs[0].tasks().outbox_pending(&w).await.unwrap();
    assert_eq!(notices.len(), 1);
    assert_eq!(notices[0].status, TaskStatus::Done);
    assert_eq!(notices[0].delegated_by, lead);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_pg),
    ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README"
)]
async fn keyed_creates_and_applied_keys_from_several_processes_happen_once() {
    let Some((first, procs)) = processes(3).await else {
        return;
    };
    let w = agent("worker");
    let creates = procs.iter().flat_map(|store| {
        (0..8).map(|i| {
            let tasks = store.tasks();
            let w = w.clone();
            async move {
                let mut t = NewTask::new(format!("attempt {i}"), "");
                t.idempotency_key = Some("turn:e1:0:0".into());
                tasks.create(&w, t, Timestamp(1)).await.unwrap()
            }
        })
    });
    let made: BTreeSet<u64> = join_all(creates)
        .await
        .into_iter()
        .map(|t| t.number)
        .collect();
    assert_eq!(made, BTreeSet::from([1]));
    assert_eq!(
        first
            .tasks()
            .list(&w, &Default::default())
            .await
            .unwrap()
            .len(),
        1
    );
    let marks = procs.iter().flat_map(|store| {
        (0..8).map(|_| {
            let deliveries = store.deliveries();
            let w = w.clone();
            async move {
                deliveries
                    .mark_applied(&w, "lead#1:done", Timestamp(5))
                    .await
                    .unwrap()
            }
        })
    });
    let firsts = join_all(marks).await.into_iter().filter(|m| *m).count();
    assert_eq!(firsts, 1, "exactly one mark_applied is the first");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_pg),
    ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README"
)]
async fn expired_leases_are_requeued_once_whichever_processes_look() {
    let Some((first, procs)) = processes(2).await else {
        return;
    };
    let w = agent("worker");
    for i in 0..12 {
        let mut t = NewTask::new(format!("t{i}"), "");
        t.status = TaskStatus::Ready;
        first.tasks().create(&w, t, Timestamp(1)).await.unwrap();
        first
            .tasks()
            .claim_next(&w, "gone", Duration::from_millis(10), Timestamp(1))
            .await
            .unwrap()
            .unwrap();
    }
    let sweeps = procs
        .iter()
        .flat_map(|store| (0..4).map(|_| store.tasks()))
        .map(|tasks| {
            let w = w.clone();
            async move { tasks.requeue_expired(&w, Timestamp(100)).await.unwrap() }
        });
    let requeued: Vec<u64> = join_all(sweeps)
        .await
        .into_iter()
        .flatten()
        .map(|tr| tr.task.number)
        .collect();
    let unique: BTreeSet<u64> = requeued.iter().copied().collect();
    assert_eq!(
        requeued.len(),
        12,
        "each expired lease requeued once: {requeued:?}"
    );
    assert_eq!(unique, (1..=12).collect());
    let ready = first
        .tasks()
        .list(
            &w,
            &spacebot_core::task::TaskFilter {
                statuses: vec![TaskStatus::Ready],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(ready.len(), 12);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_pg),
    ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README"
)]
async fn processes_connecting_at_once_migrate_a_new_schema_once() {
    let Some(url) = support::database_url() else {
        return;
    };
    let schema = schema_name();
    let connects = (0..6).map(|_| {
        let (url, schema) = (url.clone(), schema.clone());
        async move {
            PgOptions::new()
                .max_connections(2)
                .schema(schema)
                .connect(&url)
                .await
        }
    });
    let connected: Vec<_> = join_all(connects).await;
    let outcome: Result<Vec<PgStores>, StoreError> = connected.into_iter().collect();
    let stores = outcome.unwrap();
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations")
        .fetch_one(stores[0].pool())
        .await
        .unwrap();
    let known = i64::try_from(std::fs::read_dir("migrations").unwrap().count()).unwrap();
    for s in &stores {
        s.close().await;
    }
    drop(stores);
    admin(&url, &format!("DROP SCHEMA \"{schema}\" CASCADE")).await;
    assert_eq!(applied, known, "each migration applied once");
}

#[tokio::test]
#[cfg_attr(
    not(spacebot_pg),
    ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README"
)]
async fn a_schema_of_another_application_is_refused_and_left_alone() {
    let Some(url) = support::database_url() else {
        return;
    };
    let schema = schema_name();
    admin(
        &url,
        &format!("CREATE SCHEMA \"{schema}\"; CREATE TABLE \"{schema}\".tasks (id int)"),
    )
    .await;
    let e = PgOptions::new()
        .schema(schema.clone())
        .connect(&url)
        .await
        .unwrap_err();
    // Still only the foreign table: nothing was created.
    let conn_url = url.clone();
    let tables: Vec<String> = {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(&conn_url).await.unwrap();
        let t = sqlx::query_scalar(
            "SELECT tablename::text FROM pg_tables WHERE schemaname = $1 ORDER BY 1",
        )
        .bind(&schema)
        .fetch_all(&mut conn)
        .await
        .unwrap();
        conn.close().await.unwrap();
        t
    };
    admin(&url, &format!("DROP SCHEMA \"{schema}\" CASCADE")).await;
    match e {
        StoreError::Corrupt { location, reason } => {
            assert!(location.contains(&schema), "{location}");
            assert!(reason.contains("another application"), "{reason}");
        }
        other => panic!("expected Corrupt, got {other}"),
    }
    assert_eq!(tables, ["tasks"]);
}

#[tokio::test]
#[cfg_attr(
    not(spacebot_pg),
    ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README"
)]
async fn a_schema_from_a_newer_build_is_refused() {
    let Some((first, _)) = processes(0).await else {
        return;
    };
    let schema = first.schema().unwrap().to_string();
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (9999, 'from the future', TRUE, '\\x00', 0)",
    )
    .execute(first.pool())
    .await
    .unwrap();
    let url = support::database_url().unwrap();
    let e = PgOptions::new()
        .schema(schema.clone())
        .connect(&url)
        .await
        .unwrap_err();
    match e {
        StoreError::Corrupt { location, reason } => {
            assert!(location.contains(&schema), "{location}");
            assert!(reason.contains("newer build"), "{reason}");
        }
        other => panic!("expected Corrupt, got {other}"),
    }
}

#[tokio::test]
#[cfg_attr(
    not(spacebot_pg),
    ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README"
)]
async fn reconnecting_keeps_the_data() {
    let Some((first, _)) = processes(0).await else {
        return;
    };
    let w = agent("worker");
    first
        .tasks()
        .create(&w, NewTask::new("kept", ""), Timestamp(1))
        .await
        .unwrap();
    let url = support::database_url().unwrap();
    let again = PgOptions::new()
        .schema(first.schema().unwrap())
        .connect(&url)
        .await
        .unwrap();
    let task = again.tasks().get(&w, 1).await.unwrap().unwrap();
    assert_eq!(task.title, "kept");
    assert!(again.deliveries().is_durable());
}

#[tokio::test]
#[cfg_attr(
    not(spacebot_pg),
    ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README"
)]
async fn bad_settings_are_refused_with_clear_errors() {
    let Some(url) = support::database_url() else {
        return;
    };
    let e = PgStores::connect("not a url").await.unwrap_err();
    assert!(matches!(e, StoreError::Invalid(_)), "{e}");
    for schema in ["Bad", "1x", "a-b", ""] {
        let e = PgOptions::new()
            .schema(schema)
            .connect(&url)
            .await
            .unwrap_err();
        assert!(matches!(e, StoreError::Invalid(_)), "{schema:?}: {e}");
    }
    // Nothing listens on port 1: a backend error naming the server, and never a password.
    let e = PgOptions::new()
        .acquire_timeout(Duration::from_secs(5))
        .connect("postgres://someone:secret-pw@127.0.0.1:1/nowhere")
        .await
        .unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, StoreError::Backend { .. }), "{text}");
    assert!(text.contains("127.0.0.1:1/nowhere"), "{text}");
    assert!(!text.contains("secret-pw"), "{text}");
}

#[tokio::test]
#[cfg_attr(
    not(spacebot_pg),
    ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README"
)]
async fn calls_after_close_fail_naming_the_database() {
    let Some(stores) = support::fresh().await else {
        return;
    };
    stores.close().await;
    let e = stores.tasks().get(&agent("worker"), 1).await.unwrap_err();
    assert!(matches!(e, StoreError::Backend { .. }), "{e}");
    assert!(e.to_string().contains("closed"), "{e}");
    assert!(e.to_string().contains(stores.schema().unwrap()), "{e}");
}

#[tokio::test]
#[cfg_attr(
    not(spacebot_pg),
    ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README"
)]
async fn a_temporary_schema_is_dropped_with_its_last_clone() {
    let Some(url) = support::database_url() else {
        return;
    };
    let stores = support::options().temporary(&url).await.unwrap();
    let schema = stores.schema().unwrap().to_string();
    let clone = stores.clone();
    let exists = |url: String, schema: String| async move {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_namespace WHERE nspname = $1")
            .bind(&schema)
            .fetch_one(&mut conn)
            .await
            .unwrap();
        conn.close().await.unwrap();
        n == 1
    };
    drop(stores);
    assert!(
        exists(url.clone(), schema.clone()).await,
        "a clone still holds it"
    );
    drop(clone);
    assert!(!exists(url, schema).await, "dropped with the last clone");
}

#[tokio::test]
#[cfg_attr(
    not(spacebot_pg),
    ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README"
)]
async fn the_claim_and_the_outbox_are_served_by_their_indexes() {
    let Some(stores) = support::fresh().await else {
        return;
    };
    let w = agent("worker");
    for i in 0..20 {
        let mut t = NewTask::new(format!("t{i}"), "");
        t.status = TaskStatus::Ready;
        stores.tasks().create(&w, t, Timestamp(1)).await.unwrap();
    }
    for _ in 0..5 {
        stores
            .tasks()
            .claim_next(&w, "h", Duration::from_secs(1), Timestamp(1))
            .await
            .unwrap();
    }
    let mut conn = stores.pool().acquire().await.unwrap();
    sqlx::query("ANALYZE tasks")
        .execute(&mut *conn)
        .await
        .unwrap();
    // With so few rows a sequential scan is cheaper: forbid it to see which index serves.
    sqlx::query("SET enable_seqscan = off")
        .execute(&mut *conn)
        .await
        .unwrap();
    // Each query and the index that serves it in the order it sorts.
    use spacebot_postgres::sql::{CLAIM_SQL, EXPIRED_SQL, OUTBOX_PENDING_SQL};
    for (sql, index) in [
        (CLAIM_SQL, "tasks_claim"),
        (OUTBOX_PENDING_SQL, "outbox_unsent"),
        (EXPIRED_SQL, "tasks_lease"),
    ] {
        let explain =
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN {sql}"))).bind("worker");
        let explain = if sql.contains("$2") {
            explain.bind(5_i64)
        } else {
            explain
        };
        let plan: Vec<String> = explain.fetch_all(&mut *conn).await.unwrap();
        let plan = plan.join("\n");
        assert!(plan.contains(index), "{sql}:\n{plan}");
        assert!(!plan.contains("Sort"), "{sql} sorts:\n{plan}");
    }
    sqlx::query("RESET enable_seqscan")
        .execute(&mut *conn)
        .await
        .unwrap();
}

#[tokio::test]
#[cfg_attr(
    not(spacebot_pg),
    ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README"
)]
async fn many_agents_share_one_schema_without_seeing_each_other() {
    let Some(stores) = support::fresh().await else {
        return;
    };
    for name in ["a", "b", "c"] {
        let a = agent(name);
        for _ in 0..3 {
            stores
                .tasks()
                .create(&a, NewTask::new(format!("{name} task"), ""), Timestamp(1))
                .await
                .unwrap();
        }
    }
    for name in ["a", "b", "c"] {
        let tasks = stores
            .tasks()
            .list(&agent(name), &Default::default())
            .await
            .unwrap();
        let numbers: Vec<u64> = tasks.iter().map(|t| t.number).collect();
        assert_eq!(numbers, [1, 2, 3], "{name}: numbered from 1 per agent");
        assert!(tasks.iter().all(|t| t.title == format!("{name} task")));
    }
}

/// Two processes on one schema: a hint sent by one reaches the other's wake-up stream; after
/// `cut_off` every store and placement call of the cut process fails and its stream ends, while
/// the other process's calls go on; after `reconnect` the cut process works again.
#[tokio::test]
#[cfg_attr(
    not(spacebot_pg),
    ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README"
)]
async fn placement_hints_between_processes_and_a_simulated_partition() {
    use futures::StreamExt;
    use spacebot_core::placement::{Placement, ProcessId};
    let Some((_keep, others)) = processes(2).await else {
        return;
    };
    let (one, two) = (&others[0], &others[1]);
    let (p1, p2, a) = (
        ProcessId::new("p1").unwrap(),
        ProcessId::new("p2").unwrap(),
        agent("a"),
    );
    let lease = Duration::from_secs(30);
    let (t1, t2) = (one.placement(), two.placement());
    assert_eq!(t1.channel(), t2.channel());
    let granted = t1
        .acquire(&a, &p1, lease, Timestamp(1_000))
        .await
        .unwrap()
        .unwrap();
    let mut hints = t1.wakeups(&p1);
    // The subscription is set up while the hints are sent: send until one arrives.
    let got = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            t2.notify(&a).await.unwrap();
            if let Ok(Some(hint)) =
                tokio::time::timeout(Duration::from_millis(100), hints.next()).await
            {
                return hint;
            }
        }
    })
    .await
    .expect("no hint within 10 s");
    assert_eq!(got, a);

    one.cut_off();
    let ended = tokio::time::timeout(Duration::from_secs(10), hints.next()).await;
    assert!(
        matches!(ended, Ok(None)),
        "the stream did not end: {ended:?}"
    );
    assert!(t1.acquire(&a, &p1, lease, Timestamp(2_000)).await.is_err());
    assert!(one.deliveries().pending(&a).await.is_err());
    assert!(t1.wakeups(&p1).next().await.is_none());
    // The other process goes on, and takes the agent once the lease has run out.
    assert!(two.deliveries().pending(&a).await.is_ok());
    assert!(
        t2.acquire(&a, &p2, lease, Timestamp(2_000))
            .await
            .unwrap()
            .is_none()
    );
    let taken = t2
        .acquire(&a, &p2, lease, granted.expires_at)
        .await
        .unwrap()
        .unwrap();
    assert!(taken.epoch > granted.epoch);

    one.reconnect();
    assert!(one.deliveries().pending(&a).await.is_ok());
    assert_eq!(
        t1.holder(&a, granted.expires_at)
            .await
            .unwrap()
            .map(|l| l.process),
        Some(p2)
    );
}

/// Writers in several processes (pools) racing on one record: of those with one expectation
/// exactly one is written, of those with one effect key exactly one, and writers expecting
/// nothing are all written with distinct versions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_pg),
    ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README"
)]
async fn record_writers_in_several_processes_race_fairly() {
    use spacebot_core::{Expect as RecordExpect, RecordStore, RecordWrite, WriteOutcome};
    let Some((first, others)) = processes(3).await else {
        return;
    };
    let all: Vec<PgStores> = std::iter::once(first.clone()).chain(others).collect();
    let write = |i: usize, key: &str| {
        RecordWrite::new("notes", key, serde_json::json!(i), format!("p{i}")).at(Timestamp(0))
    };
    first.records().write(write(0, "cas")).await.unwrap();
    const EACH: usize = 6;
    let racers = |key: &'static str, shape: fn(RecordWrite) -> RecordWrite| {
        let all = &all;
        join_all((0..all.len() * EACH).map(move |i| {
            let store = all[i % all.len()].records();
            let w = shape(write(i, key));
            async move { store.write(w).await.unwrap() }
        }))
    };
    let cas = racers("cas", |w| w.expect(RecordExpect::Version(1))).await;
    let won: Vec<_> = cas.iter().filter(|o| o.is_written()).collect();
    assert_eq!(won.len(), 1, "one Version(1) writer wins: {cas:?}");
    assert!(
        cas.iter().all(|o| o.is_written()
            || matches!(o, WriteOutcome::Conflict { current: Some(r) } if r.version == 2)),
        "{cas:?}"
    );
    let effect = racers("effect", |w| w.effect_key("turn-1/call-1")).await;
    assert_eq!(
        effect.iter().filter(|o| o.is_written()).count(),
        1,
        "{effect:?}"
    );
    let winner = effect
        .iter()
        .find(|o| o.is_written())
        .and_then(|o| o.record());
    assert!(
        effect.iter().all(|o| o.record() == winner),
        "the others see the winner's record: {effect:?}"
    );
    let any = racers("any", |w| w).await;
    let versions: BTreeSet<u64> = any
        .iter()
        .map(|o| match o {
            WriteOutcome::Written(r) => r.version,
            other => panic!("an Any writer was not written: {other:?}"),
        })
        .collect();
    assert_eq!(versions, (1..=(all.len() * EACH) as u64).collect());
    let history = first.records().history("notes", "any").await.unwrap();
    assert_eq!(history.len(), all.len() * EACH);
}

/// Records, versions and effect keys survive disconnecting and connecting again to the schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_pg),
    ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README"
)]
async fn records_survive_reconnecting() {
    let Some(url) = support::database_url() else {
        return;
    };
    let schema = schema_name();
    let result = spacebot_core::conformance::record_store_survives_reopen(|| {
        let (url, schema) = (url.clone(), schema.clone());
        async move {
            let stores = support::options().schema(schema).connect(&url).await?;
            Ok(std::sync::Arc::new(stores.records())
                as std::sync::Arc<dyn spacebot_core::RecordStore>)
        }
    })
    .await;
    admin(&url, &format!("DROP SCHEMA \"{schema}\" CASCADE")).await;
    result.unwrap();
}
