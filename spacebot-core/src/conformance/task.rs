//! [`TaskStore`] conformance.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::future::join_all;

use super::support::{
    ConformanceError, UNUSUAL_TEXT, agent, ensure, ensure_eq, ensure_err, large_text, ok,
};
use crate::error::StoreError;
use crate::ids::{AgentId, ChannelId, LinkId, TaskRef};
use crate::task::{
    CompletionNotice, Expect, NewTask, Priority, Task, TaskEvent, TaskFilter, TaskMetadata,
    TaskStatus, TaskStore,
};
use crate::time::Timestamp;

#[doc(hidden)]
#[macro_export]
macro_rules! __task_store_tests {
    ($module:ident, $make:expr, |$s:ident| $access:expr) => {
        $crate::__conformance_module!(
            $module,
            $make,
            |$s| $access,
            [
                task_store_create_numbering,
                task_store_create_refuses_bad_input,
                task_store_concurrent_numbering,
                task_store_list_filters,
                task_store_transition_expect,
                task_store_invalid_transition,
                task_store_only_lease_holder_finishes,
                task_store_claim_order,
                task_store_concurrent_claims,
                task_store_lease_expiry_uses_given_now,
                task_store_requeue_then_fail_at_max_attempts,
                task_store_recoveries_are_not_attempts,
                task_store_waiting_on_children,
                task_store_child_end_kept_while_requeued,
                task_store_outbox_written_with_terminal_transition,
                task_store_outbox_only_for_delegated_tasks,
                task_store_outbox_mark_sent_idempotent,
                task_store_outbox_in_write_order,
                task_store_round_trip,
                task_store_create_with_key_is_idempotent,
                task_store_concurrent_creates_with_one_key,
                task_store_idempotency_keys_are_per_agent,
            ]
        );
    };
}

const T0: Timestamp = Timestamp(1_000_000);
const LEASE: Duration = Duration::from_secs(60);

async fn ensure_empty(store: &dyn TaskStore, agents: &[&AgentId]) -> Result<(), ConformanceError> {
    for a in agents {
        let tasks = ok!(store.list(a, &TaskFilter::default()));
        ensure!(
            tasks.is_empty(),
            "the suite needs a fresh, empty task store; agent {a} has {} tasks",
            tasks.len()
        );
        let notices = ok!(store.outbox_pending(a));
        ensure!(
            notices.is_empty(),
            "the suite needs a fresh, empty task store; agent {a} has {} outbox notices",
            notices.len()
        );
    }
    Ok(())
}

fn delegated(title: &str, by: &AgentId) -> NewTask {
    NewTask {
        created_by: format!("agent:{by}"),
        metadata: TaskMetadata {
            delegated_by: Some(by.clone()),
            originating_channel: Some(ChannelId::portal(by)),
            link_id: Some(LinkId::new("link-1")),
            delegation_chain: vec![by.clone()],
            ..TaskMetadata::default()
        },
        ..NewTask::new(title, "")
    }
}

fn claim(holder: &str, until: Timestamp) -> TaskEvent {
    TaskEvent::Claim {
        holder: holder.into(),
        lease_until: until,
    }
}

fn complete(holder: &str, result: &str) -> TaskEvent {
    TaskEvent::Complete {
        holder: holder.into(),
        result: result.into(),
    }
}

fn fail(holder: &str, error: &str) -> TaskEvent {
    TaskEvent::Fail {
        holder: holder.into(),
        error: error.into(),
    }
}

async fn get(store: &dyn TaskStore, a: &AgentId, n: u64) -> Result<Task, ConformanceError> {
    match ok!(store.get(a, n)) {
        Some(t) => Ok(t),
        None => Err(ConformanceError::check(
            "task exists",
            format!("task {a}#{n} is missing"),
            concat!(file!(), ":", line!()),
        )),
    }
}

/// `create` numbers each agent's tasks from 1, returns the stored task (revision 1, as built by
/// `NewTask::into_task`) and `get` returns the same; boards are independent.
pub async fn task_store_create_numbering(store: &dyn TaskStore) -> Result<(), ConformanceError> {
    let (a, b) = (agent("alpha")?, agent("beta")?);
    ensure_empty(store, &[&a, &b]).await?;
    for n in 1..=3u64 {
        let new = NewTask::new(format!("  task {n}  "), format!("description {n}"));
        let expected = new
            .clone()
            .into_task(a.clone(), n, T0)
            .map_err(|e| ConformanceError::check("into_task", e.to_string(), "task.rs"))?;
        let created = ok!(store.create(&a, new, T0));
        ensure_eq!(created, expected, "create returns the stored task");
        ensure_eq!(created.revision, 1, "a new task has revision 1");
        ensure_eq!(created.title, format!("task {n}"), "the title is trimmed");
        ensure_eq!(get(store, &a, n).await?, expected, "get after create");
    }
    for n in 1..=2u64 {
        let created = ok!(store.create(&b, NewTask::new("b task", ""), T0));
        ensure_eq!(created.number, n, "another agent's board numbers from 1");
        ensure_eq!(created.agent, b, "the task belongs to the agent given");
    }
    ensure_eq!(ok!(store.get(&a, 4)), None, "get of a number not yet used");
    ensure_eq!(
        ok!(store.get(&agent("nobody")?, 1)),
        None,
        "get on an unknown board"
    );
    Ok(())
}

/// `create` refuses what `NewTask::into_task` refuses (empty title, zero attempts, a status other
/// than pending_approval, backlog or ready) with `Invalid`, and a refused create uses no number.
pub async fn task_store_create_refuses_bad_input(
    store: &dyn TaskStore,
) -> Result<(), ConformanceError> {
    let a = agent("alpha")?;
    ensure_empty(store, &[&a]).await?;
    ok!(store.create(&a, NewTask::new("first", ""), T0));
    let bad = [
        NewTask::new("   ", ""),
        NewTask {
            max_attempts: 0,
            ..NewTask::new("zero attempts", "")
        },
        NewTask {
            status: TaskStatus::InProgress,
            ..NewTask::new("starts in progress", "")
        },
        NewTask {
            status: TaskStatus::Done,
            ..NewTask::new("starts done", "")
        },
    ];
    for new in bad {
        let title = new.title.clone();
        ensure_err!(
            store.create(&a, new, T0).await,
            StoreError::Invalid(_),
            "create of {title:?}"
        );
    }
    let next = ok!(store.create(&a, NewTask::new("second", ""), T0));
    ensure_eq!(next.number, 2, "refused creates use no number");
    for status in [TaskStatus::PendingApproval, TaskStatus::Backlog] {
        let t = ok!(store.create(
            &a,
            NewTask {
                status,
                ..NewTask::new("starts elsewhere", "")
            },
            T0
        ));
        ensure_eq!(t.status, status, "a new task may start as {status}");
    }
    Ok(())
}

/// Many concurrent `create`s on one board get the numbers 1..=N, each exactly once.
pub async fn task_store_concurrent_numbering(
    store: &dyn TaskStore,
) -> Result<(), ConformanceError> {
    const N: u64 = 64;
    let (a, b) = (agent("alpha")?, agent("beta")?);
    ensure_empty(store, &[&a, &b]).await?;
    let creates = (0..N).map(|i| {
        let board = if i % 4 == 3 { &b } else { &a };
        store.create(board, NewTask::new(format!("concurrent {i}"), ""), T0)
    });
    let mut numbers_a = Vec::new();
    let mut numbers_b = Vec::new();
    for created in join_all(creates).await {
        let task = match created {
            Ok(t) => t,
            Err(e) => {
                return Err(ConformanceError::Store {
                    op: "concurrent create".into(),
                    location: concat!(file!(), ":", line!()),
                    source: e,
                });
            }
        };
        if task.agent == a {
            numbers_a.push(task.number);
        } else {
            numbers_b.push(task.number);
        }
    }
    numbers_a.sort_unstable();
    numbers_b.sort_unstable();
    let expected_a: Vec<u64> = (1..=N - N / 4).collect();
    let expected_b: Vec<u64> = (1..=N / 4).collect();
    ensure_eq!(
        numbers_a,
        expected_a,
        "numbers on a board under concurrency"
    );
    ensure_eq!(
        numbers_b,
        expected_b,
        "numbers on another board under concurrency"
    );
    let listed: Vec<u64> = ok!(store.list(&a, &TaskFilter::default()))
        .iter()
        .map(|t| t.number)
        .collect();
    ensure_eq!(
        listed,
        expected_a,
        "every concurrently created task is stored"
    );
    Ok(())
}

/// `list` returns matching tasks of one board sorted by number, filtered by statuses,
/// `delegated_by`, `created_by` and `limit` (lowest numbers first).
pub async fn task_store_list_filters(store: &dyn TaskStore) -> Result<(), ConformanceError> {
    let (a, b, boss) = (agent("alpha")?, agent("beta")?, agent("boss")?);
    ensure_empty(store, &[&a, &b]).await?;
    // 1 ready human, 2 backlog human, 3 ready delegated, 4 pending delegated, 5 ready human (claimed below)
    ok!(store.create(&a, NewTask::new("one", ""), T0));
    ok!(store.create(
        &a,
        NewTask {
            status: TaskStatus::Backlog,
            ..NewTask::new("two", "")
        },
        T0
    ));
    ok!(store.create(&a, delegated("three", &boss), T0));
    ok!(store.create(
        &a,
        NewTask {
            status: TaskStatus::PendingApproval,
            ..delegated("four", &boss)
        },
        T0
    ));
    ok!(store.create(
        &a,
        NewTask {
            created_by: "cron".into(),
            ..NewTask::new("five", "")
        },
        T0
    ));
    ok!(store.create(&b, delegated("other board", &boss), T0));
    ok!(store.transition(&a, 5, Expect::any(), claim("w", T0.plus(LEASE)), T0));

    let numbers = |tasks: Vec<Task>| tasks.into_iter().map(|t| t.number).collect::<Vec<_>>();
    ensure_eq!(
        numbers(ok!(store.list(&a, &TaskFilter::default()))),
        vec![1, 2, 3, 4, 5],
        "no filter: the whole board, by number"
    );
    let ready = TaskFilter {
        statuses: vec![TaskStatus::Ready],
        ..TaskFilter::default()
    };
    ensure_eq!(
        numbers(ok!(store.list(&a, &ready))),
        vec![1, 3],
        "status ready"
    );
    let some = TaskFilter {
        statuses: vec![TaskStatus::InProgress, TaskStatus::Backlog],
        ..TaskFilter::default()
    };
    ensure_eq!(
        numbers(ok!(store.list(&a, &some))),
        vec![2, 5],
        "several statuses"
    );
    let by_boss = TaskFilter {
        delegated_by: Some(boss.clone()),
        ..TaskFilter::default()
    };
    ensure_eq!(
        numbers(ok!(store.list(&a, &by_boss))),
        vec![3, 4],
        "delegated_by"
    );
    let by_cron = TaskFilter {
        created_by: Some("cron".into()),
        ..TaskFilter::default()
    };
    ensure_eq!(
        numbers(ok!(store.list(&a, &by_cron))),
        vec![5],
        "created_by"
    );
    let combined = TaskFilter {
        statuses: vec![TaskStatus::Ready],
        delegated_by: Some(boss.clone()),
        created_by: Some(format!("agent:{boss}")),
        limit: None,
    };
    ensure_eq!(
        numbers(ok!(store.list(&a, &combined))),
        vec![3],
        "filters combine"
    );
    let limited = TaskFilter {
        limit: Some(2),
        ..TaskFilter::default()
    };
    ensure_eq!(
        numbers(ok!(store.list(&a, &limited))),
        vec![1, 2],
        "limit keeps the lowest numbers"
    );
    let limited_ready = TaskFilter {
        statuses: vec![TaskStatus::Ready, TaskStatus::PendingApproval],
        limit: Some(2),
        ..TaskFilter::default()
    };
    ensure_eq!(
        numbers(ok!(store.list(&a, &limited_ready))),
        vec![1, 3],
        "limit applies after the filter"
    );
    let zero = TaskFilter {
        limit: Some(0),
        ..TaskFilter::default()
    };
    ensure!(
        ok!(store.list(&a, &zero)).is_empty(),
        "limit 0 returns nothing"
    );
    ensure_eq!(
        numbers(ok!(store.list(&b, &TaskFilter::default()))),
        vec![1],
        "another board"
    );
    ensure!(
        ok!(store.list(&agent("nobody")?, &TaskFilter::default())).is_empty(),
        "an unknown board is empty"
    );
    Ok(())
}

/// `transition` checks `Expect` (status and revision) and refuses a stale guard with `Conflict`,
/// writing nothing; it bumps the revision and sets `updated_at`; `NotFound` for absent tasks.
pub async fn task_store_transition_expect(store: &dyn TaskStore) -> Result<(), ConformanceError> {
    let a = agent("alpha")?;
    ensure_empty(store, &[&a]).await?;
    let t = ok!(store.create(
        &a,
        NewTask {
            status: TaskStatus::PendingApproval,
            ..NewTask::new("guarded", "")
        },
        T0
    ));
    let wrong_status = Expect {
        status: Some(TaskStatus::Ready),
        revision: None,
    };
    ensure_err!(
        store
            .transition(&a, 1, wrong_status, TaskEvent::Approve, T0)
            .await,
        StoreError::Conflict { what, .. } if what.contains("alpha#1"),
        "expect with the wrong status (the error names alpha#1)"
    );
    let wrong_revision = Expect {
        status: Some(TaskStatus::PendingApproval),
        revision: Some(2),
    };
    ensure_err!(
        store
            .transition(&a, 1, wrong_revision, TaskEvent::Approve, T0)
            .await,
        StoreError::Conflict { .. },
        "expect with the wrong revision"
    );
    ensure_eq!(
        get(store, &a, 1).await?,
        t.clone(),
        "a refused transition writes nothing"
    );

    let right = Expect {
        status: Some(TaskStatus::PendingApproval),
        revision: Some(1),
    };
    let later = Timestamp(T0.0 + 5);
    let tr = ok!(store.transition(&a, 1, right, TaskEvent::Approve, later));
    ensure_eq!(tr.task.status, TaskStatus::Ready, "approve moves to ready");
    ensure_eq!(tr.task.revision, 2, "a transition bumps the revision");
    ensure_eq!(tr.task.updated_at, later, "a transition sets updated_at");
    ensure_eq!(tr.notice, None, "no notice for a non-terminal transition");
    ensure_eq!(
        get(store, &a, 1).await?,
        tr.task.clone(),
        "the transition is stored"
    );
    ensure_err!(
        store.transition(&a, 1, right, TaskEvent::Park, later).await,
        StoreError::Conflict { .. },
        "a guard that was right before the last change"
    );
    let rev_only = Expect {
        status: None,
        revision: Some(2),
    };
    let tr = ok!(store.transition(&a, 1, rev_only, TaskEvent::Park, later));
    ensure_eq!(
        tr.task.status,
        TaskStatus::Backlog,
        "park with a revision guard"
    );
    ensure_err!(
        store
            .transition(&a, 99, Expect::any(), TaskEvent::Approve, T0)
            .await,
        StoreError::NotFound { what } if what.contains("alpha#99"),
        "transition of an absent task (the error names alpha#99)"
    );
    ensure_err!(
        store
            .transition(&agent("nobody")?, 1, Expect::any(), TaskEvent::Approve, T0)
            .await,
        StoreError::NotFound { .. },
        "transition on an unknown board"
    );
    Ok(())
}

/// Events the lifecycle table does not allow are refused with `InvalidTransition` and write
/// nothing; terminal tasks refuse every event.
pub async fn task_store_invalid_transition(store: &dyn TaskStore) -> Result<(), ConformanceError> {
    let a = agent("alpha")?;
    ensure_empty(store, &[&a]).await?;
    let t = ok!(store.create(&a, NewTask::new("ready task", ""), T0));
    for event in [
        TaskEvent::Approve,
        TaskEvent::Schedule,
        TaskEvent::Resume,
        complete("w", "r"),
        TaskEvent::ExpireLease,
        TaskEvent::Wait { holder: "w".into() },
    ] {
        let kind = event.kind();
        ensure_err!(
            store.transition(&a, 1, Expect::any(), event, T0).await,
            StoreError::InvalidTransition(_),
            "{kind} from ready"
        );
    }
    ensure_eq!(get(store, &a, 1).await?, t, "refused events write nothing");
    ok!(store.transition(
        &a,
        1,
        Expect::any(),
        TaskEvent::Cancel {
            reason: "no longer needed".into()
        },
        T0
    ));
    let cancelled = get(store, &a, 1).await?;
    ensure_eq!(cancelled.status, TaskStatus::Cancelled, "cancel");
    for event in [
        TaskEvent::Cancel {
            reason: "again".into(),
        },
        claim("w", T0.plus(LEASE)),
        TaskEvent::Approve,
        TaskEvent::Schedule,
        TaskEvent::Park,
    ] {
        let kind = event.kind();
        ensure_err!(
            store.transition(&a, 1, Expect::any(), event, T0).await,
            StoreError::InvalidTransition(_),
            "{kind} on a cancelled task"
        );
    }
    ensure_eq!(
        get(store, &a, 1).await?,
        cancelled,
        "a terminal task does not change"
    );
    Ok(())
}

/// Only the lease holder may complete, fail, renew or wait (`NotLeaseHolder` otherwise, writing
/// nothing); the holder may.
pub async fn task_store_only_lease_holder_finishes(
    store: &dyn TaskStore,
) -> Result<(), ConformanceError> {
    let a = agent("alpha")?;
    ensure_empty(store, &[&a]).await?;
    ok!(store.create(&a, NewTask::new("one", ""), T0));
    ok!(store.create(&a, NewTask::new("two", ""), T0));
    let claimed = ok!(store.claim_next(&a, "worker-1", LEASE, T0));
    ensure_eq!(claimed.map(|t| t.number), Some(1), "claim");
    let before = get(store, &a, 1).await?;
    for event in [
        complete("worker-2", "stolen"),
        fail("worker-2", "sabotage"),
        TaskEvent::Renew {
            holder: "worker-2".into(),
            lease_until: T0.plus(LEASE * 10),
        },
        TaskEvent::Wait {
            holder: "worker-2".into(),
        },
    ] {
        let kind = event.kind();
        ensure_err!(
            store.transition(&a, 1, Expect::any(), event, T0).await,
            StoreError::NotLeaseHolder { .. },
            "{kind} by a worker that does not hold the lease"
        );
    }
    ensure_eq!(
        get(store, &a, 1).await?,
        before,
        "refused events write nothing"
    );
    let renewed = ok!(store.transition(
        &a,
        1,
        Expect::any(),
        TaskEvent::Renew {
            holder: "worker-1".into(),
            lease_until: T0.plus(LEASE * 2),
        },
        T0
    ));
    ensure_eq!(
        renewed.task.lease.map(|l| l.expires_at),
        Some(T0.plus(LEASE * 2)),
        "the holder renews"
    );
    let done = ok!(store.transition(&a, 1, Expect::any(), complete("worker-1", "ok"), T0));
    ensure_eq!(done.task.status, TaskStatus::Done, "the holder completes");
    ensure_eq!(
        done.task.result.as_deref(),
        Some("ok"),
        "the result is kept"
    );
    ensure_eq!(done.task.lease, None, "a done task has no lease");

    ok!(store.claim_next(&a, "worker-1", LEASE, T0));
    let failed = ok!(store.transition(&a, 2, Expect::any(), fail("worker-1", "boom"), T0));
    ensure_eq!(
        failed.task.status,
        TaskStatus::Ready,
        "a failed attempt with attempts left"
    );
    ensure_eq!(failed.task.attempts, 1, "a failed attempt counts");
    ensure_eq!(
        failed.task.error.as_deref(),
        Some("boom"),
        "the error is kept"
    );
    ensure_eq!(failed.task.lease, None, "a requeued task has no lease");
    ensure_err!(
        store
            .transition(&a, 2, Expect::any(), complete("worker-1", "late"), T0)
            .await,
        StoreError::InvalidTransition(_),
        "a worker whose attempt failed cannot complete the requeued task"
    );
    Ok(())
}

/// `claim_next` takes the ready task with the highest priority, then the lowest number; skips
/// tasks that are not ready; sets the lease to `now + lease` for the holder; `None` when nothing
/// is ready.
pub async fn task_store_claim_order(store: &dyn TaskStore) -> Result<(), ConformanceError> {
    let (a, b) = (agent("alpha")?, agent("beta")?);
    ensure_empty(store, &[&a, &b]).await?;
    ensure_eq!(
        ok!(store.claim_next(&a, "w", LEASE, T0)),
        None,
        "nothing to claim on an empty board"
    );
    let plan = [
        (Priority::Low, TaskStatus::Ready),              // 1
        (Priority::High, TaskStatus::Ready),             // 2
        (Priority::Medium, TaskStatus::Ready),           // 3
        (Priority::Urgent, TaskStatus::Backlog),         // 4
        (Priority::High, TaskStatus::Ready),             // 5
        (Priority::Urgent, TaskStatus::PendingApproval), // 6
        (Priority::Medium, TaskStatus::Ready),           // 7
        (Priority::Low, TaskStatus::Ready),              // 8
    ];
    for (i, (priority, status)) in plan.iter().enumerate() {
        ok!(store.create(
            &a,
            NewTask {
                priority: *priority,
                status: *status,
                ..NewTask::new(format!("task {}", i + 1), "")
            },
            T0
        ));
    }
    ok!(store.create(
        &b,
        NewTask {
            priority: Priority::Urgent,
            ..NewTask::new("other board", "")
        },
        T0
    ));
    let mut order = Vec::new();
    for i in 0..6i64 {
        let now = Timestamp(T0.0 + i);
        let holder = format!("worker-{i}");
        let Some(task) = ok!(store.claim_next(&a, &holder, LEASE, now)) else {
            break;
        };
        ensure_eq!(
            task.status,
            TaskStatus::InProgress,
            "a claimed task is in progress"
        );
        let lease = task.lease.clone().map(|l| (l.holder, l.expires_at));
        ensure_eq!(lease, Some((holder.clone(), now.plus(LEASE))), "the lease");
        ensure_eq!(task.revision, 2, "a claim bumps the revision");
        ensure_eq!(
            get(store, &a, task.number).await?,
            task,
            "the claim is stored"
        );
        order.push(task.number);
    }
    ensure_eq!(
        order,
        vec![2, 5, 3, 7, 1, 8],
        "claim order: highest priority, then lowest number; only ready tasks"
    );
    ensure_eq!(
        ok!(store.claim_next(&a, "late", LEASE, T0)),
        None,
        "nothing left to claim"
    );
    ensure_eq!(
        get(store, &b, 1).await?.status,
        TaskStatus::Ready,
        "claims on one board leave another alone"
    );
    Ok(())
}

/// Many concurrent `claim_next` calls never hand one task to two holders: each ready task is
/// claimed exactly once, by the holder that got it, and the surplus calls get `None`.
pub async fn task_store_concurrent_claims(store: &dyn TaskStore) -> Result<(), ConformanceError> {
    const TASKS: u64 = 24;
    const CLAIMS: usize = 60;
    let a = agent("alpha")?;
    ensure_empty(store, &[&a]).await?;
    for i in 0..TASKS {
        ok!(store.create(&a, NewTask::new(format!("task {i}"), ""), T0));
    }
    let holders: Vec<String> = (0..CLAIMS).map(|i| format!("worker-{i}")).collect();
    let claims = holders.iter().map(|h| store.claim_next(&a, h, LEASE, T0));
    let mut claimed = BTreeSet::new();
    let mut empty = 0;
    for (holder, result) in holders.iter().zip(join_all(claims).await) {
        match result {
            Ok(Some(task)) => {
                ensure!(
                    claimed.insert(task.number),
                    "task {} was claimed twice",
                    task.number
                );
                let stored = get(store, &a, task.number).await?;
                let stored_holder = stored.lease.map(|l| l.holder);
                ensure_eq!(
                    stored_holder.as_deref(),
                    Some(holder.as_str()),
                    "the stored lease of task {} names the holder that got it",
                    task.number
                );
            }
            Ok(None) => empty += 1,
            Err(e) => {
                return Err(ConformanceError::Store {
                    op: "concurrent claim_next".into(),
                    location: concat!(file!(), ":", line!()),
                    source: e,
                });
            }
        }
    }
    ensure_eq!(
        claimed.len() as u64,
        TASKS,
        "every ready task is claimed once"
    );
    ensure_eq!(empty, CLAIMS - TASKS as usize, "surplus claims get None");
    let in_progress = TaskFilter {
        statuses: vec![TaskStatus::InProgress],
        ..TaskFilter::default()
    };
    ensure_eq!(
        ok!(store.list(&a, &in_progress)).len() as u64,
        TASKS,
        "every task is in progress"
    );
    Ok(())
}

/// Leases expire by the `now` passed in, never by the wall clock: `requeue_expired` requeues
/// exactly the in-progress tasks whose lease ended at or before `now`.
pub async fn task_store_lease_expiry_uses_given_now(
    store: &dyn TaskStore,
) -> Result<(), ConformanceError> {
    let a = agent("alpha")?;
    ensure_empty(store, &[&a]).await?;
    // Times far in the past: a store that looked at the wall clock would expire everything.
    let t = Timestamp(10_000);
    ok!(store.create(&a, NewTask::new("short lease", ""), t));
    ok!(store.create(&a, NewTask::new("long lease", ""), t));
    ok!(store.create(&a, NewTask::new("never claimed", ""), t));
    ok!(store.claim_next(&a, "w1", Duration::from_millis(100), t));
    ok!(store.claim_next(&a, "w2", Duration::from_millis(500), t));
    ensure!(
        ok!(store.requeue_expired(&a, Timestamp(10_099))).is_empty(),
        "no lease has expired before its end"
    );
    ensure_eq!(
        get(store, &a, 1).await?.status,
        TaskStatus::InProgress,
        "a live lease is kept"
    );
    let requeued = ok!(store.requeue_expired(&a, Timestamp(10_100)));
    let numbers: Vec<u64> = requeued.iter().map(|tr| tr.task.number).collect();
    ensure_eq!(
        numbers,
        vec![1],
        "the lease ending exactly at now has expired"
    );
    let t1 = get(store, &a, 1).await?;
    ensure_eq!(
        &t1,
        &requeued[0].task,
        "requeue_expired returns what it stored"
    );
    ensure_eq!(
        t1.status,
        TaskStatus::Ready,
        "an expired task with attempts left is ready"
    );
    ensure_eq!(t1.attempts, 1, "an expired lease counts as an attempt");
    ensure_eq!(t1.lease, None, "a requeued task has no lease");
    ensure_eq!(t1.updated_at, Timestamp(10_100), "updated at the given now");
    ensure_eq!(
        requeued[0].notice,
        None,
        "no notice while attempts are left"
    );
    ensure!(
        ok!(store.requeue_expired(&a, Timestamp(10_100))).is_empty(),
        "requeue_expired is idempotent at one instant"
    );
    ensure_err!(
        store
            .transition(
                &a,
                1,
                Expect::any(),
                complete("w1", "too late"),
                Timestamp(10_101)
            )
            .await,
        StoreError::InvalidTransition(_),
        "a worker whose lease expired cannot complete"
    );
    let again = ok!(store.claim_next(&a, "w3", LEASE, Timestamp(10_200)));
    ensure_eq!(
        again.map(|t| t.number),
        Some(1),
        "a requeued task is claimed again"
    );
    let later = ok!(store.requeue_expired(&a, Timestamp(10_500)));
    let numbers: Vec<u64> = later.iter().map(|tr| tr.task.number).collect();
    ensure_eq!(numbers, vec![2], "the second lease expires at its own end");
    ensure_eq!(
        get(store, &a, 3).await?.status,
        TaskStatus::Ready,
        "an unclaimed task is not touched"
    );
    Ok(())
}

/// A claim recovered after its worker's process ended (`recover`) is not a failed attempt: the
/// task is ready again with its attempts unchanged, the recovery counted (and stored) apart, until
/// the recovery allowance, when it fails for good with an error saying why (and a notice).
pub async fn task_store_recoveries_are_not_attempts(
    store: &dyn TaskStore,
) -> Result<(), ConformanceError> {
    let (a, boss) = (agent("rho")?, agent("boss")?);
    ensure_empty(store, &[&a]).await?;
    let new = NewTask {
        max_attempts: 3,
        ..delegated("killed before the model call", &boss)
    };
    ok!(store.create(&a, new, T0));
    let allowance = 10;
    for n in 1..=allowance {
        let holder = format!("w{n}");
        let claimed = ok!(store.claim_next(&a, &holder, LEASE, T0));
        ensure_eq!(claimed.map(|t| t.number), Some(1), "claim {n}");
        let tr = ok!(store.transition(&a, 1, Expect::any(), TaskEvent::Recover { holder }, T0));
        ensure_eq!(tr.task.attempts, 0, "recovery {n} uses no attempt");
        ensure_eq!(tr.task.metadata.recoveries, n, "recovery {n} is counted");
        let stored = ok!(store.get(&a, 1));
        ensure_eq!(
            stored.map(|t| t.metadata.recoveries),
            Some(n),
            "recovery {n} is stored"
        );
        if n < allowance {
            ensure_eq!(
                tr.task.status,
                TaskStatus::Ready,
                "ready after recovery {n}"
            );
            ensure_eq!(tr.notice, None, "no notice while recoveries are left");
        } else {
            ensure_eq!(
                tr.task.status,
                TaskStatus::Failed,
                "failed at the allowance"
            );
            let error = tr.task.error.clone().unwrap_or_default();
            ensure!(
                error.contains("process ended") && error.contains("10 times"),
                "the error says why: {error}"
            );
            ensure_eq!(
                tr.notice.as_ref().map(|n| n.status),
                Some(TaskStatus::Failed),
                "a notice"
            );
        }
    }
    Ok(())
}

/// An attempt that fails or expires requeues the task until `max_attempts`, then it fails for
/// good (with a notice for a delegated task, written by `requeue_expired` too).
pub async fn task_store_requeue_then_fail_at_max_attempts(
    store: &dyn TaskStore,
) -> Result<(), ConformanceError> {
    let (a, boss) = (agent("alpha")?, agent("boss")?);
    ensure_empty(store, &[&a]).await?;
    let new = NewTask {
        max_attempts: 3,
        ..delegated("flaky", &boss)
    };
    ok!(store.create(&a, new, T0));
    let mut now = T0;
    // Attempt 1 fails, attempt 2 expires, attempt 3 expires: failed.
    ok!(store.claim_next(&a, "w1", LEASE, now));
    let tr = ok!(store.transition(&a, 1, Expect::any(), fail("w1", "first"), now));
    ensure_eq!(
        (tr.task.status, tr.task.attempts),
        (TaskStatus::Ready, 1),
        "after one failed attempt"
    );
    ensure_eq!(tr.notice, None, "no notice while attempts are left");
    for attempt in 2..=3u32 {
        let claimed = ok!(store.claim_next(&a, "w", LEASE, now));
        ensure_eq!(
            claimed.map(|t| t.number),
            Some(1),
            "claim attempt {attempt}"
        );
        now = now.plus(LEASE);
        let requeued = ok!(store.requeue_expired(&a, now));
        ensure_eq!(requeued.len(), 1, "attempt {attempt} expires");
        let tr = &requeued[0];
        ensure_eq!(
            tr.task.attempts,
            attempt,
            "attempts after attempt {attempt}"
        );
        if attempt < 3 {
            ensure_eq!(
                tr.task.status,
                TaskStatus::Ready,
                "requeued after attempt {attempt}"
            );
            ensure_eq!(tr.notice, None, "no notice while attempts are left");
        } else {
            ensure_eq!(tr.task.status, TaskStatus::Failed, "failed at max attempts");
            let notice = tr.notice.clone();
            ensure_eq!(
                notice.as_ref().map(|n| n.status),
                Some(TaskStatus::Failed),
                "a delegated task that fails for good yields a notice"
            );
            ensure_eq!(
                ok!(store.outbox_pending(&a)),
                notice.into_iter().collect::<Vec<_>>(),
                "requeue_expired writes the notice to the outbox"
            );
        }
    }
    ensure_eq!(
        ok!(store.claim_next(&a, "w", LEASE, now)),
        None,
        "a failed task is not claimed"
    );

    // One attempt allowed: a failure is final at once.
    ok!(store.create(
        &a,
        NewTask {
            max_attempts: 1,
            ..NewTask::new("one shot", "")
        },
        now
    ));
    ok!(store.claim_next(&a, "w", LEASE, now));
    let tr = ok!(store.transition(&a, 2, Expect::any(), fail("w", "no luck"), now));
    ensure_eq!(
        (tr.task.status, tr.task.attempts, tr.task.error.as_deref()),
        (TaskStatus::Failed, 1, Some("no luck")),
        "max_attempts 1 fails at the first failure"
    );
    Ok(())
}

/// A task that delegated children keeps them in its metadata through `add_child`, `wait` and
/// `child_ended`, and becomes ready when its last child ends.
pub async fn task_store_waiting_on_children(store: &dyn TaskStore) -> Result<(), ConformanceError> {
    let (a, b) = (agent("alpha")?, agent("beta")?);
    ensure_empty(store, &[&a]).await?;
    ok!(store.create(&a, NewTask::new("parent", ""), T0));
    ok!(store.claim_next(&a, "w", LEASE, T0));
    let (c1, c2) = (TaskRef::new(b.clone(), 1), TaskRef::new(b.clone(), 2));
    for child in [&c1, &c2] {
        ok!(store.transition(
            &a,
            1,
            Expect::any(),
            TaskEvent::AddChild {
                child: child.clone()
            },
            T0
        ));
    }
    let tr = ok!(store.transition(
        &a,
        1,
        Expect::any(),
        TaskEvent::Wait { holder: "w".into() },
        T0
    ));
    ensure_eq!(
        tr.task.status,
        TaskStatus::Waiting,
        "waiting on two children"
    );
    ensure_eq!(tr.task.lease, None, "a waiting task has no lease");
    let ended = |child: &TaskRef, outcome: &str| TaskEvent::ChildEnded {
        child: child.clone(),
        status: TaskStatus::Done,
        outcome: outcome.into(),
    };
    let tr = ok!(store.transition(&a, 1, Expect::any(), ended(&c2, "second"), T0));
    ensure_eq!(
        tr.task.status,
        TaskStatus::Waiting,
        "one child still running"
    );
    let tr = ok!(store.transition(&a, 1, Expect::any(), ended(&c1, "first"), T0));
    ensure_eq!(tr.task.status, TaskStatus::Ready, "the last child ended");
    let stored = get(store, &a, 1).await?;
    ensure_eq!(&stored, &tr.task, "the children are stored");
    let outcomes: Vec<(TaskRef, Option<String>)> = stored
        .metadata
        .children
        .iter()
        .map(|c| (c.task.clone(), c.outcome.clone()))
        .collect();
    ensure_eq!(
        outcomes,
        vec![(c1, Some("first".into())), (c2, Some("second".into()))],
        "children in the order they were added, with outcomes"
    );
    Ok(())
}

/// A child that ends while its parent was requeued (its worker died: ready, not claimed yet) is
/// recorded on the parent, and the parent's next `Wait` goes straight to ready: the notice of that
/// child is sent once, and must not be lost because the parent was between claims.
pub async fn task_store_child_end_kept_while_requeued(
    store: &dyn TaskStore,
) -> Result<(), ConformanceError> {
    let (a, b) = (agent("alpha")?, agent("beta")?);
    ensure_empty(store, &[&a]).await?;
    ok!(store.create(&a, NewTask::new("parent", ""), T0));
    ok!(store.claim_next(&a, "w1", LEASE, T0));
    let child = TaskRef::new(b.clone(), 1);
    ok!(store.transition(
        &a,
        1,
        Expect::any(),
        TaskEvent::AddChild {
            child: child.clone()
        },
        T0
    ));
    // The worker dies; its attempt fails and the parent is ready again.
    let tr = ok!(store.transition(
        &a,
        1,
        Expect::any(),
        TaskEvent::Fail {
            holder: "w1".into(),
            error: "the process ended".into()
        },
        T0
    ));
    ensure_eq!(tr.task.status, TaskStatus::Ready, "requeued");
    let tr = ok!(store.transition(
        &a,
        1,
        Expect::any(),
        TaskEvent::ChildEnded {
            child: child.clone(),
            status: TaskStatus::Done,
            outcome: "forty-two".into(),
        },
        T0
    ));
    ensure_eq!(tr.task.status, TaskStatus::Ready, "still ready");
    ensure_eq!(
        tr.task.metadata.children.first().map(|c| c.ended),
        Some(Some(TaskStatus::Done)),
        "the child's end is recorded"
    );
    // Claimed again, the turn delegates the same child (an idempotent create) and waits: the
    // child has ended already, so the parent is ready to resume at once.
    ok!(store.claim_next(&a, "w2", LEASE, T0));
    ok!(store.transition(
        &a,
        1,
        Expect::any(),
        TaskEvent::AddChild {
            child: child.clone()
        },
        T0
    ));
    let tr = ok!(store.transition(
        &a,
        1,
        Expect::any(),
        TaskEvent::Wait {
            holder: "w2".into()
        },
        T0
    ));
    ensure_eq!(
        tr.task.status,
        TaskStatus::Ready,
        "nothing left to wait for"
    );
    let stored = get(store, &a, 1).await?;
    ensure_eq!(
        stored.metadata.children.len(),
        1,
        "the child is listed once"
    );
    ensure_eq!(
        stored.metadata.children[0].outcome.as_deref(),
        Some("forty-two"),
        "with its outcome"
    );
    Ok(())
}

/// The terminal transition of a delegated task returns its notice and writes it to the owner's
/// outbox in the same step; done, failed and cancelled all do, each exactly once.
pub async fn task_store_outbox_written_with_terminal_transition(
    store: &dyn TaskStore,
) -> Result<(), ConformanceError> {
    let (a, boss) = (agent("alpha")?, agent("boss")?);
    ensure_empty(store, &[&a, &boss]).await?;
    ok!(store.create(&a, delegated("to finish", &boss), T0));
    ok!(store.create(
        &a,
        NewTask {
            max_attempts: 1,
            ..delegated("to fail", &boss)
        },
        T0
    ));
    ok!(store.create(&a, delegated("to cancel", &boss), T0));

    ok!(store.transition(&a, 1, Expect::any(), claim("w", T0.plus(LEASE)), T0));
    let done_at = Timestamp(T0.0 + 10);
    let tr = ok!(store.transition(
        &a,
        1,
        Expect::any(),
        complete("w", "the word is nebula"),
        done_at
    ));
    let Some(notice) = tr.notice.clone() else {
        return Err(ConformanceError::check(
            "notice is Some",
            "completing a delegated task returns its notice",
            concat!(file!(), ":", line!()),
        ));
    };
    let expected = CompletionNotice {
        key: format!("{a}#1:done"),
        task: TaskRef::new(a.clone(), 1),
        title: "to finish".into(),
        status: TaskStatus::Done,
        outcome: "the word is nebula".into(),
        delegated_by: boss.clone(),
        originating_channel: Some(ChannelId::portal(&boss)),
        link_id: Some(LinkId::new("link-1")),
        parent_task: None,
        created_at: done_at,
    };
    ensure_eq!(notice, expected, "the notice of a completed delegated task");
    ensure_eq!(
        ok!(store.outbox_pending(&a)),
        vec![expected.clone()],
        "the notice is in the outbox right after the transition"
    );
    ensure!(
        ok!(store.outbox_pending(&boss)).is_empty(),
        "the notice is in the owner's outbox, not the delegator's"
    );

    ok!(store.transition(&a, 2, Expect::any(), claim("w", T0.plus(LEASE)), T0));
    let tr = ok!(store.transition(&a, 2, Expect::any(), fail("w", "cannot"), done_at));
    ensure_eq!(
        tr.notice
            .as_ref()
            .map(|n| (n.key.clone(), n.status, n.outcome.clone())),
        Some((
            format!("{a}#2:failed"),
            TaskStatus::Failed,
            "cannot".to_string()
        )),
        "the notice of a failed delegated task"
    );
    let tr = ok!(store.transition(
        &a,
        3,
        Expect::any(),
        TaskEvent::Cancel {
            reason: "changed plans".into()
        },
        done_at
    ));
    ensure_eq!(
        tr.notice
            .as_ref()
            .map(|n| (n.key.clone(), n.status, n.outcome.clone())),
        Some((
            format!("{a}#3:cancelled"),
            TaskStatus::Cancelled,
            "changed plans".to_string()
        )),
        "the notice of a cancelled delegated task"
    );
    let keys: Vec<String> = ok!(store.outbox_pending(&a))
        .into_iter()
        .map(|n| n.key)
        .collect();
    ensure_eq!(
        keys,
        vec![
            format!("{a}#1:done"),
            format!("{a}#2:failed"),
            format!("{a}#3:cancelled")
        ],
        "one notice per ended task"
    );
    // Refused events on ended tasks write no further notice.
    ensure_err!(
        store
            .transition(
                &a,
                1,
                Expect::any(),
                TaskEvent::Cancel { reason: "x".into() },
                done_at
            )
            .await,
        StoreError::InvalidTransition(_),
        "cancelling a done task"
    );
    ensure_eq!(
        ok!(store.outbox_pending(&a)).len(),
        3,
        "a refused event writes no notice"
    );
    Ok(())
}

/// Tasks without `delegated_by` end without a notice; non-terminal transitions of delegated tasks
/// write none either.
pub async fn task_store_outbox_only_for_delegated_tasks(
    store: &dyn TaskStore,
) -> Result<(), ConformanceError> {
    let (a, boss) = (agent("alpha")?, agent("boss")?);
    ensure_empty(store, &[&a]).await?;
    ok!(store.create(&a, NewTask::new("own work", ""), T0));
    ok!(store.create(&a, NewTask::new("own work to cancel", ""), T0));
    ok!(store.create(&a, delegated("delegated, still running", &boss), T0));
    ok!(store.claim_next(&a, "w", LEASE, T0));
    let tr = ok!(store.transition(&a, 1, Expect::any(), complete("w", "done"), T0));
    ensure_eq!(
        tr.notice,
        None,
        "a task nobody delegated ends without a notice"
    );
    let tr = ok!(store.transition(
        &a,
        2,
        Expect::any(),
        TaskEvent::Cancel {
            reason: "no".into()
        },
        T0
    ));
    ensure_eq!(tr.notice, None, "a cancelled own task has no notice");
    ok!(store.claim_next(&a, "w", LEASE, T0));
    let tr = ok!(store.transition(&a, 3, Expect::any(), fail("w", "retry me"), T0));
    ensure_eq!(tr.notice, None, "a requeue is not an end");
    ensure!(
        ok!(store.outbox_pending(&a)).is_empty(),
        "the outbox stays empty"
    );
    Ok(())
}

/// `outbox_mark_sent` removes one notice by key and is idempotent (again, or for an unknown key,
/// it succeeds and changes nothing).
pub async fn task_store_outbox_mark_sent_idempotent(
    store: &dyn TaskStore,
) -> Result<(), ConformanceError> {
    let (a, boss) = (agent("alpha")?, agent("boss")?);
    ensure_empty(store, &[&a]).await?;
    for i in 1..=3u64 {
        ok!(store.create(&a, delegated(&format!("task {i}"), &boss), T0));
        ok!(store.transition(
            &a,
            i,
            Expect::any(),
            TaskEvent::Cancel {
                reason: format!("r{i}")
            },
            T0
        ));
    }
    let key2 = format!("{a}#2:cancelled");
    ok!(store.outbox_mark_sent(&a, &key2));
    let keys = |n: Vec<CompletionNotice>| n.into_iter().map(|n| n.key).collect::<Vec<_>>();
    let expected = vec![format!("{a}#1:cancelled"), format!("{a}#3:cancelled")];
    ensure_eq!(
        keys(ok!(store.outbox_pending(&a))),
        expected,
        "after marking one sent"
    );
    ok!(store.outbox_mark_sent(&a, &key2));
    ok!(store.outbox_mark_sent(&a, "no-such-key"));
    ok!(store.outbox_mark_sent(&agent("nobody")?, &key2));
    ensure_eq!(
        keys(ok!(store.outbox_pending(&a))),
        expected,
        "marking again, or an unknown key, changes nothing"
    );
    for key in &expected {
        ok!(store.outbox_mark_sent(&a, key));
    }
    ensure!(ok!(store.outbox_pending(&a)).is_empty(), "all sent");
    Ok(())
}

/// `outbox_pending` lists notices in the order they were written, which is the order the tasks
/// ended, not their numbers.
pub async fn task_store_outbox_in_write_order(
    store: &dyn TaskStore,
) -> Result<(), ConformanceError> {
    let (a, boss) = (agent("alpha")?, agent("boss")?);
    ensure_empty(store, &[&a]).await?;
    for i in 1..=5u64 {
        ok!(store.create(&a, delegated(&format!("task {i}"), &boss), T0));
    }
    let order = [4u64, 1, 5, 3, 2];
    for (i, n) in order.iter().enumerate() {
        // Equal timestamps: the order must come from the writes, not from created_at.
        ok!(store.transition(
            &a,
            *n,
            Expect::any(),
            TaskEvent::Cancel {
                reason: format!("#{i}")
            },
            T0
        ));
    }
    let numbers: Vec<u64> = ok!(store.outbox_pending(&a))
        .into_iter()
        .map(|n| n.task.number)
        .collect();
    ensure_eq!(numbers, order.to_vec(), "notices in write order");
    ok!(store.outbox_mark_sent(&a, &format!("{a}#5:cancelled")));
    let numbers: Vec<u64> = ok!(store.outbox_pending(&a))
        .into_iter()
        .map(|n| n.task.number)
        .collect();
    ensure_eq!(numbers, vec![4, 1, 3, 2], "the order holds after a removal");
    Ok(())
}

/// A task with unusual text (quotes, NUL, unicode, a megabyte of description), full metadata
/// (chain, parent, application JSON) and extreme values round-trips exactly, as does its notice.
pub async fn task_store_round_trip(store: &dyn TaskStore) -> Result<(), ConformanceError> {
    let (a, boss) = (agent("alpha")?, agent("boss")?);
    ensure_empty(store, &[&a]).await?;
    let mut extra = serde_json::Map::new();
    extra.insert("text".into(), UNUSUAL_TEXT.into());
    extra.insert(
        "nested".into(),
        serde_json::json!({"list": [1, 2.5, null, true, "ü"], "empty": {}}),
    );
    extra.insert("big".into(), serde_json::json!(u64::MAX));
    let new = NewTask {
        title: format!("{UNUSUAL_TEXT} {}", "t".repeat(200)),
        description: large_text(),
        status: TaskStatus::Ready,
        priority: Priority::Urgent,
        created_by: format!("agent:{boss} {UNUSUAL_TEXT}"),
        metadata: TaskMetadata {
            delegated_by: Some(boss.clone()),
            originating_channel: Some(ChannelId::new(format!("discord:{UNUSUAL_TEXT}"))),
            link_id: Some(LinkId::new(UNUSUAL_TEXT)),
            delegation_chain: vec![agent("root")?, boss.clone()],
            parent_task: Some(TaskRef::new(boss.clone(), 9_223_372_036_854_775_807)),
            children: Vec::new(),
            round: 7,
            cause: Some(crate::ids::EnvelopeId::new(UNUSUAL_TEXT)),
            usage: crate::llm::Usage {
                prompt_tokens: u32::MAX,
                completion_tokens: 1,
                total_tokens: 0,
            },
            recoveries: 7,
            trace_context: Some(format!(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 {UNUSUAL_TEXT}"
            )),
            extra,
        },
        max_attempts: u32::MAX,
        idempotency_key: None,
    };
    let far = Timestamp(i64::MAX - 1);
    let created = ok!(store.create(&a, new.clone(), far));
    let expected = new
        .into_task(a.clone(), 1, far)
        .map_err(|e| ConformanceError::check("into_task", e.to_string(), "task.rs"))?;
    ensure_eq!(&created, &expected, "create round-trips");
    ensure_eq!(
        get(store, &a, 1).await?,
        expected.clone(),
        "get round-trips"
    );
    ensure_eq!(
        created.title.chars().count(),
        120,
        "the title is cut to 120 characters"
    );
    ensure_eq!(
        ok!(store.list(&a, &TaskFilter::default())),
        vec![expected.clone()],
        "list round-trips"
    );
    let claimed = ok!(store.claim_next(&a, UNUSUAL_TEXT, Duration::from_secs(1), far));
    ensure_eq!(
        claimed
            .and_then(|t| t.lease)
            .map(|l| (l.holder, l.expires_at)),
        Some((UNUSUAL_TEXT.to_string(), Timestamp(i64::MAX))),
        "a holder with unusual text, and a lease end that saturates"
    );
    let result = large_text();
    let tr = ok!(store.transition(&a, 1, Expect::any(), complete(UNUSUAL_TEXT, &result), far));
    ensure_eq!(
        get(store, &a, 1).await?,
        tr.task.clone(),
        "a completed task round-trips"
    );
    ensure_eq!(
        ok!(store.outbox_pending(&a)),
        tr.notice.into_iter().collect::<Vec<_>>(),
        "its notice round-trips"
    );
    // Empty metadata round-trips too.
    let plain = ok!(store.create(&a, NewTask::new("x", ""), Timestamp(0)));
    ensure_eq!(
        get(store, &a, 2).await?,
        plain,
        "a task with empty metadata round-trips"
    );
    ensure_eq!(
        plain.metadata,
        TaskMetadata::default(),
        "empty metadata stays empty"
    );
    Ok(())
}

/// `create` with a key already used on the board returns the task created the first time, as
/// stored now, and changes nothing (no second task, no number used, the rest of the input
/// ignored); without a key, or with another key, it creates; a refused create does not use its key.
pub async fn task_store_create_with_key_is_idempotent(
    store: &dyn TaskStore,
) -> Result<(), ConformanceError> {
    let (a, boss) = (agent("alpha")?, agent("boss")?);
    ensure_empty(store, &[&a]).await?;
    let first = ok!(store.create(
        &a,
        delegated("first", &boss).with_idempotency_key("turn:e1:call-1"),
        T0
    ));
    ensure_eq!(first.number, 1, "the first keyed create makes task 1");
    let again = ok!(store.create(
        &a,
        NewTask {
            priority: Priority::Urgent,
            ..NewTask::new("a different title", "").with_idempotency_key("turn:e1:call-1")
        },
        T0.plus(LEASE)
    ));
    ensure_eq!(
        &again,
        &first,
        "a create with a used key returns the first task, unchanged"
    );
    let invalid_again = ok!(store.create(
        &a,
        NewTask {
            max_attempts: 0,
            ..NewTask::new("   ", "").with_idempotency_key("turn:e1:call-1")
        },
        T0
    ));
    ensure_eq!(
        &invalid_again,
        &first,
        "a create with a used key returns the first task even if the rest would be refused"
    );
    let plain = ok!(store.create(&a, NewTask::new("no key", ""), T0));
    ensure_eq!(plain.number, 2, "a create without a key makes a new task");
    let plain_again = ok!(store.create(&a, NewTask::new("no key", ""), T0));
    ensure_eq!(plain_again.number, 3, "without a key, every create is new");
    ensure_err!(
        store
            .create(
                &a,
                NewTask::new("  ", "").with_idempotency_key(UNUSUAL_TEXT),
                T0
            )
            .await,
        StoreError::Invalid(_),
        "a refused keyed create"
    );
    let unusual = ok!(store.create(
        &a,
        NewTask::new("unusual key", "").with_idempotency_key(UNUSUAL_TEXT),
        T0
    ));
    ensure_eq!(
        unusual.number,
        4,
        "a refused create neither used a number nor its key"
    );
    let empty = ok!(store.create(
        &a,
        NewTask::new("empty key", "").with_idempotency_key(""),
        T0
    ));
    ensure_eq!(empty.number, 5, "the empty key is a key like any other");
    ensure_eq!(
        ok!(store.create(
            &a,
            NewTask::new("empty key again", "").with_idempotency_key(""),
            T0
        )),
        empty,
        "the empty key, again"
    );
    ensure_eq!(
        ok!(store.create(
            &a,
            NewTask::new("unusual again", "").with_idempotency_key(UNUSUAL_TEXT),
            T0
        )),
        unusual,
        "the unusual key, again"
    );
    // The key names the task as it is now, after it moved on.
    let claimed = ok!(store.claim_next(&a, "worker", LEASE, T0.plus(LEASE)));
    ensure_eq!(
        claimed.as_ref().map(|t| t.number),
        Some(1),
        "the first task is claimed"
    );
    let after_claim = ok!(store.create(
        &a,
        NewTask::new("first", "").with_idempotency_key("turn:e1:call-1"),
        T0
    ));
    ensure_eq!(
        Some(&after_claim),
        claimed.as_ref(),
        "a create with a used key returns the task as it is stored now"
    );
    let numbers: Vec<u64> = ok!(store.list(&a, &TaskFilter::default()))
        .iter()
        .map(|t| t.number)
        .collect();
    ensure_eq!(numbers, vec![1, 2, 3, 4, 5], "no task was created twice");
    ensure_eq!(
        get(store, &a, 1).await?.title,
        "first".to_string(),
        "the first task keeps its title"
    );
    Ok(())
}

/// Concurrent creates with one key make exactly one task and all return it; keyless creates run
/// beside them keep numbering without gaps.
pub async fn task_store_concurrent_creates_with_one_key(
    store: &dyn TaskStore,
) -> Result<(), ConformanceError> {
    const KEYED: usize = 16;
    const PLAIN: usize = 4;
    let a = agent("alpha")?;
    ensure_empty(store, &[&a]).await?;
    let creates = (0..KEYED + PLAIN).map(|i| {
        let new = NewTask::new(format!("create {i}"), "");
        let new = if i < KEYED {
            new.with_idempotency_key("contended")
        } else {
            new
        };
        store.create(&a, new, T0)
    });
    let mut keyed = Vec::new();
    let mut plain = Vec::new();
    for (i, created) in join_all(creates).await.into_iter().enumerate() {
        let task = match created {
            Ok(t) => t,
            Err(e) => {
                return Err(ConformanceError::Store {
                    op: "concurrent create".into(),
                    location: concat!(file!(), ":", line!()),
                    source: e,
                });
            }
        };
        if i < KEYED {
            keyed.push(task);
        } else {
            plain.push(task.number);
        }
    }
    let distinct: BTreeSet<u64> = keyed.iter().map(|t| t.number).collect();
    ensure_eq!(
        distinct.len(),
        1,
        "every concurrent create with one key returns one task: {distinct:?}"
    );
    ensure!(
        keyed.windows(2).all(|w| w[0] == w[1]),
        "every concurrent create with one key returns the same task"
    );
    let tasks = ok!(store.list(&a, &TaskFilter::default()));
    let numbers: Vec<u64> = tasks.iter().map(|t| t.number).collect();
    let expected: Vec<u64> = (1..=(PLAIN as u64 + 1)).collect();
    ensure_eq!(
        numbers,
        expected,
        "one keyed task and every keyless one, numbered without gaps"
    );
    ensure_eq!(
        tasks
            .iter()
            .filter(|t| t.title.starts_with("create "))
            .count(),
        PLAIN + 1,
        "the stored tasks"
    );
    ensure!(
        !plain.contains(&keyed[0].number),
        "the keyed task's number is its own"
    );
    Ok(())
}

/// Idempotency keys are per agent: one key on two boards makes two tasks, each numbered on its own
/// board, and each board then returns its own.
pub async fn task_store_idempotency_keys_are_per_agent(
    store: &dyn TaskStore,
) -> Result<(), ConformanceError> {
    let (a, b) = (agent("alpha")?, agent("beta")?);
    ensure_empty(store, &[&a, &b]).await?;
    ok!(store.create(&a, NewTask::new("unkeyed", ""), T0));
    let on_a = ok!(store.create(
        &a,
        NewTask::new("on alpha", "").with_idempotency_key("shared"),
        T0
    ));
    let on_b = ok!(store.create(
        &b,
        NewTask::new("on beta", "").with_idempotency_key("shared"),
        T0
    ));
    ensure_eq!(on_a.number, 2, "the key on one board");
    ensure_eq!(
        on_b.number,
        1,
        "the same key on another board makes a task there"
    );
    ensure_eq!(on_b.agent, b, "on the other agent's board");
    ensure_eq!(on_b.title, "on beta".to_string(), "its own task");
    ensure_eq!(
        ok!(store.create(&a, NewTask::new("x", "").with_idempotency_key("shared"), T0)),
        on_a,
        "each board returns its own task for the key"
    );
    ensure_eq!(
        ok!(store.create(&b, NewTask::new("x", "").with_idempotency_key("shared"), T0)),
        on_b,
        "each board returns its own task for the key (other board)"
    );
    ensure_eq!(
        ok!(store.list(&b, &TaskFilter::default())).len(),
        1,
        "one task on the other board"
    );
    ensure_eq!(
        ok!(store.list(&a, &TaskFilter::default())).len(),
        2,
        "two tasks on the first board"
    );
    Ok(())
}
