//! Property tests of the task lifecycle: the pure state machine (`Task::apply`) against an
//! independent table, and the in-memory store under random interleavings of workers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: failing loudly is the point

use std::collections::HashMap;
use std::time::Duration;

use proptest::prelude::*;
use spacebot_core::memory::MemoryTaskStore;
use spacebot_core::task::{Expect, TaskEvent, TaskEventKind, TaskMetadata};
use spacebot_core::{
    AgentId, ChannelId, NewTask, StoreError, Task, TaskRef, TaskStatus, TaskStore, Timestamp,
};

fn id(s: &str) -> AgentId {
    AgentId::parse(s).unwrap()
}

/// The lifecycle table, written out independently of `Task::apply`: for a status and an event,
/// the statuses the task may end in. Absent means the event is refused.
fn allowed(from: TaskStatus, event: TaskEventKind) -> Option<&'static [TaskStatus]> {
    use TaskEventKind as E;
    use TaskStatus as S;
    Some(match (from, event) {
        (S::PendingApproval, E::Approve) => &[S::Ready],
        (S::PendingApproval, E::Park) => &[S::Backlog],
        (S::Backlog, E::Schedule) => &[S::Ready],
        (S::Ready, E::Park) => &[S::Backlog],
        (S::Ready, E::Claim) => &[S::InProgress],
        (S::InProgress, E::Renew | E::AddChild | E::ChildEnded) => &[S::InProgress],
        (S::InProgress, E::Wait) => &[S::Waiting, S::Ready],
        (S::InProgress, E::Complete) => &[S::Done],
        (S::InProgress, E::Fail | E::ExpireLease) => &[S::Ready, S::Failed],
        (S::Waiting, E::AddChild) => &[S::Waiting],
        (S::Waiting, E::ChildEnded) => &[S::Waiting, S::Ready],
        (S::Waiting, E::Resume) => &[S::Ready],
        (S::PendingApproval, E::ChildEnded) => &[S::PendingApproval],
        (S::Backlog, E::ChildEnded) => &[S::Backlog],
        (S::Ready, E::ChildEnded) => &[S::Ready],
        (s, E::Cancel) if !s.is_terminal() => &[S::Cancelled],
        _ => return None,
    })
}

fn holder() -> impl Strategy<Value = String> {
    prop_oneof![Just("w1".to_string()), Just("w2".to_string())]
}

fn child() -> impl Strategy<Value = TaskRef> {
    (1u64..4).prop_map(|n| TaskRef::new(id("c"), n))
}

fn status() -> impl Strategy<Value = TaskStatus> {
    prop::sample::select(TaskStatus::ALL.to_vec())
}

/// Any event, with arguments drawn so that both accepted and refused cases come up.
fn event() -> impl Strategy<Value = (TaskEvent, i64)> {
    let ev = prop_oneof![
        Just(TaskEvent::Approve),
        Just(TaskEvent::Schedule),
        Just(TaskEvent::Park),
        (holder(), 0i64..200).prop_map(|(holder, d)| TaskEvent::Claim {
            holder,
            lease_until: Timestamp(d)
        }),
        (holder(), 0i64..200).prop_map(|(holder, d)| TaskEvent::Renew {
            holder,
            lease_until: Timestamp(d)
        }),
        child().prop_map(|child| TaskEvent::AddChild { child }),
        holder().prop_map(|holder| TaskEvent::Wait { holder }),
        (child(), status(), "[a-z]{0,6}").prop_map(|(child, status, outcome)| {
            TaskEvent::ChildEnded {
                child,
                status,
                outcome,
            }
        }),
        Just(TaskEvent::Resume),
        (holder(), "[a-z]{0,6}")
            .prop_map(|(holder, result)| TaskEvent::Complete { holder, result }),
        (holder(), "[a-z]{1,6}").prop_map(|(holder, error)| TaskEvent::Fail { holder, error }),
        Just(TaskEvent::ExpireLease),
        "[a-z]{1,6}".prop_map(|reason| TaskEvent::Cancel { reason }),
    ];
    (ev, 0i64..60)
}

/// Lease times in events are offsets from "now": make them absolute.
fn at(event: TaskEvent, now: i64) -> TaskEvent {
    match event {
        TaskEvent::Claim {
            holder,
            lease_until,
        } => TaskEvent::Claim {
            holder,
            lease_until: Timestamp(now + lease_until.0),
        },
        TaskEvent::Renew {
            holder,
            lease_until,
        } => TaskEvent::Renew {
            holder,
            lease_until: Timestamp(now + lease_until.0),
        },
        other => other,
    }
}

fn new_task(initial: TaskStatus, delegated: bool, max_attempts: u32) -> Task {
    let mut new = NewTask::new("Pick a word", "");
    new.status = initial;
    new.max_attempts = max_attempts;
    if delegated {
        new.metadata = TaskMetadata {
            delegated_by: Some(id("a")),
            originating_channel: Some(ChannelId::new("portal:u1")),
            delegation_chain: vec![id("a")],
            ..TaskMetadata::default()
        };
    }
    new.into_task(id("b"), 7, Timestamp(0)).unwrap()
}

fn initial_status() -> impl Strategy<Value = TaskStatus> {
    prop::sample::select(vec![
        TaskStatus::PendingApproval,
        TaskStatus::Backlog,
        TaskStatus::Ready,
    ])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Random event sequences: every accepted event is in the table and lands in a state the table
    /// allows; everything else is refused and changes nothing; the lease is held by at most one
    /// worker, exactly while in progress, and only its holder finishes the attempt; a delegated
    /// task that ends yields exactly one notice.
    #[test]
    fn the_state_machine_follows_the_table(
        initial in initial_status(),
        delegated in any::<bool>(),
        max_attempts in 1u32..4,
        events in prop::collection::vec(event(), 0..60),
    ) {
        let mut task = new_task(initial, delegated, max_attempts);
        let mut now = 0i64;
        let mut notices = Vec::new();
        for (event, step) in events {
            now += step;
            let event = at(event, now);
            let kind = event.kind();
            let before = task.clone();
            match task.apply(event.clone(), Timestamp(now)) {
                Ok(transition) => {
                    let after = transition.task;
                    let allowed = allowed(before.status, kind);
                    prop_assert!(allowed.is_some(), "{kind} accepted from {}", before.status);
                    prop_assert!(
                        allowed.unwrap_or(&[]).contains(&after.status),
                        "{kind} from {} went to {}", before.status, after.status
                    );
                    prop_assert_eq!(after.revision, before.revision + 1);
                    prop_assert_eq!(after.updated_at, Timestamp(now));
                    // Only the current holder acts on a claimed task.
                    if let TaskEvent::Renew { holder, .. }
                    | TaskEvent::Wait { holder }
                    | TaskEvent::Complete { holder, .. }
                    | TaskEvent::Fail { holder, .. } = &event
                    {
                        prop_assert_eq!(before.lease.as_ref().map(|l| &l.holder), Some(holder));
                    }
                    if kind == TaskEventKind::ExpireLease {
                        prop_assert!(before.lease_expired(Timestamp(now)));
                    }
                    if matches!(kind, TaskEventKind::Fail | TaskEventKind::ExpireLease) {
                        prop_assert_eq!(after.attempts, before.attempts + 1);
                        prop_assert_eq!(
                            after.status == TaskStatus::Failed,
                            after.attempts >= after.max_attempts
                        );
                    } else {
                        prop_assert_eq!(after.attempts, before.attempts);
                    }
                    if kind == TaskEventKind::Wait || (before.status == TaskStatus::Waiting && kind == TaskEventKind::ChildEnded) {
                        let all_ended = after.metadata.children.iter().all(|c| c.ended.is_some());
                        prop_assert_eq!(after.status == TaskStatus::Ready, all_ended);
                    }
                    match &transition.notice {
                        Some(n) => {
                            prop_assert!(after.status.is_terminal() && !before.status.is_terminal());
                            prop_assert_eq!(&n.key, &format!("b#7:{}", after.status));
                            prop_assert_eq!(n.status, after.status);
                            prop_assert_eq!(Some(&n.delegated_by), after.metadata.delegated_by.as_ref());
                            notices.push(n.clone());
                        }
                        None => prop_assert!(!delegated || !after.status.is_terminal() || before.status.is_terminal()),
                    }
                    if after.status == TaskStatus::Done {
                        prop_assert!(after.result.is_some());
                    }
                    task = after;
                }
                Err(err) => {
                    match allowed(before.status, kind) {
                        None => prop_assert!(
                            matches!(&err, StoreError::InvalidTransition(t) if t.from == before.status && t.event == kind),
                            "{kind} from {}: {err:?}", before.status
                        ),
                        Some(_) => prop_assert!(
                            matches!(err, StoreError::NotLeaseHolder { .. } | StoreError::Invalid(_) | StoreError::InvalidTransition(_)),
                            "{err:?}"
                        ),
                    }
                }
            }
            // At most one holder, exactly while in progress.
            prop_assert_eq!(task.lease.is_some(), task.status == TaskStatus::InProgress);
            prop_assert!(task.attempts <= task.max_attempts);
        }
        let expected = usize::from(delegated && task.status.is_terminal());
        prop_assert_eq!(notices.len(), expected, "notices {:?} for final {}", notices, task.status);
    }
}

#[derive(Debug, Clone)]
enum Op {
    Create { delegated: bool },
    Claim { worker: usize },
    Complete { worker: usize, task: u64 },
    Fail { worker: usize, task: u64 },
    Advance { secs: u64 },
    Requeue,
    Cancel { task: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => any::<bool>().prop_map(|delegated| Op::Create { delegated }),
        3 => (0usize..3).prop_map(|worker| Op::Claim { worker }),
        2 => (0usize..3, 1u64..6).prop_map(|(worker, task)| Op::Complete { worker, task }),
        1 => (0usize..3, 1u64..6).prop_map(|(worker, task)| Op::Fail { worker, task }),
        1 => (1u64..90).prop_map(|secs| Op::Advance { secs }),
        1 => Just(Op::Requeue),
        1 => (1u64..6).prop_map(|task| Op::Cancel { task }),
    ]
}

const LEASE: Duration = Duration::from_secs(60);

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Three workers claim, finish and lose leases in random order on one board: a task is never
    /// held by two claims, only the latest claim's holder may finish it, and every delegated task
    /// that ended has exactly one notice in the outbox.
    #[test]
    fn the_store_keeps_one_holder_and_one_notice_per_ended_task(ops in prop::collection::vec(op(), 1..80)) {
        futures::executor::block_on(async move {
            let store = MemoryTaskStore::new();
            let b = id("b");
            let mut now = Timestamp(0);
            let mut claims = 0u64;
            // The holder of each task's latest claim, per the store's answers.
            let mut holder_of: HashMap<u64, String> = HashMap::new();
            let mut delegated_tasks = Vec::new();
            for op in ops {
                match op {
                    Op::Create { delegated } => {
                        let task = new_task(TaskStatus::Ready, delegated, 2);
                        let mut new = NewTask::new(task.title, "");
                        new.metadata = task.metadata;
                        new.max_attempts = 2;
                        let created = store.create(&b, new, now).await.unwrap();
                        if delegated {
                            delegated_tasks.push(created.number);
                        }
                    }
                    Op::Claim { worker } => {
                        claims += 1;
                        let holder = format!("w{worker}:{claims}");
                        if let Some(task) = store.claim_next(&b, &holder, LEASE, now).await.unwrap() {
                            prop_assert_eq!(task.status, TaskStatus::InProgress);
                            prop_assert_eq!(task.lease.as_ref().map(|l| l.holder.as_str()), Some(holder.as_str()));
                            holder_of.insert(task.number, holder);
                        }
                    }
                    Op::Complete { worker, task } | Op::Fail { worker, task } => {
                        let is_complete = matches!(op, Op::Complete { .. });
                        // The worker uses the holder id of its own latest claim of this task, if any.
                        let holder = holder_of
                            .get(&task)
                            .filter(|h| h.starts_with(&format!("w{worker}:")))
                            .cloned()
                            .unwrap_or_else(|| format!("w{worker}:stale"));
                        let event = if is_complete {
                            TaskEvent::Complete { holder: holder.clone(), result: "ok".into() }
                        } else {
                            TaskEvent::Fail { holder: holder.clone(), error: "boom".into() }
                        };
                        let before = store.get(&b, task).await.unwrap();
                        let result = store.transition(&b, task, Expect::any(), event, now).await;
                        if result.is_ok() {
                            let before = before.unwrap();
                            prop_assert_eq!(before.status, TaskStatus::InProgress);
                            prop_assert_eq!(before.lease.map(|l| l.holder), Some(holder));
                        }
                    }
                    Op::Advance { secs } => now = now.plus(Duration::from_secs(secs)),
                    Op::Requeue => {
                        for t in store.requeue_expired(&b, now).await.unwrap() {
                            prop_assert!(matches!(t.task.status, TaskStatus::Ready | TaskStatus::Failed));
                            prop_assert!(t.task.lease.is_none());
                        }
                    }
                    Op::Cancel { task } => {
                        let _ = store
                            .transition(&b, task, Expect::any(), TaskEvent::Cancel { reason: "no".into() }, now)
                            .await;
                    }
                }
                for task in store.list(&b, &Default::default()).await.unwrap() {
                    prop_assert_eq!(task.lease.is_some(), task.status == TaskStatus::InProgress);
                    if let Some(lease) = &task.lease {
                        prop_assert_eq!(Some(&lease.holder), holder_of.get(&task.number));
                    }
                }
            }
            let outbox = store.outbox_pending(&b).await.unwrap();
            let board = store.list(&b, &Default::default()).await.unwrap();
            for task in &board {
                let n = outbox.iter().filter(|n| n.task.number == task.number).count();
                let expected = usize::from(delegated_tasks.contains(&task.number) && task.status.is_terminal());
                prop_assert_eq!(n, expected, "task {} ({}) has {} notices", task.number, task.status, n);
            }
            Ok(())
        })?;
    }
}
