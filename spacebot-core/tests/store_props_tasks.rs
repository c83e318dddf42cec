//! Property test of the in-memory task store: random sequences of creates, claims by several
//! workers, completions, failures, cancellations, lease expiries (by advancing `now`) and outbox
//! deliveries never leave the lifecycle table, never give one task two lease holders, and every
//! delegated task that ends yields exactly one completion notice.

// The harness below runs outside `#[test]` functions, where clippy does not relax these lints.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use futures::executor::block_on;
use proptest::prelude::*;
use spacebot_core::error::StoreError;
use spacebot_core::memory::MemoryTaskStore;
use spacebot_core::task::{
    Expect, NewTask, Priority, Task, TaskEvent, TaskFilter, TaskMetadata, TaskStatus, TaskStore,
};
use spacebot_core::{AgentId, ChannelId, TaskRef, Timestamp};

#[derive(Debug, Clone)]
enum Op {
    Create {
        priority: Priority,
        start: TaskStatus,
        delegated: bool,
        max_attempts: u32,
    },
    Claim {
        holder: usize,
        lease_ms: u64,
    },
    Complete {
        task: usize,
        holder: usize,
    },
    Fail {
        task: usize,
        holder: usize,
    },
    Renew {
        task: usize,
        holder: usize,
        lease_ms: u64,
    },
    Cancel {
        task: usize,
    },
    Approve {
        task: usize,
    },
    Schedule {
        task: usize,
    },
    Park {
        task: usize,
    },
    ExpireLease {
        task: usize,
    },
    AddChild {
        task: usize,
        child: u64,
    },
    Wait {
        task: usize,
        holder: usize,
    },
    ChildEnded {
        task: usize,
        child: u64,
        done: bool,
    },
    Resume {
        task: usize,
    },
    Advance {
        ms: u64,
    },
    Requeue,
    Deliver {
        count: usize,
    },
}

fn priority() -> impl Strategy<Value = Priority> {
    prop_oneof![
        Just(Priority::Low),
        Just(Priority::Medium),
        Just(Priority::High),
        Just(Priority::Urgent)
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let task = 0usize..16;
    let holder = 0usize..3;
    prop_oneof![
        4 => (
            priority(),
            prop_oneof![
                6 => Just(TaskStatus::Ready),
                1 => Just(TaskStatus::Backlog),
                1 => Just(TaskStatus::PendingApproval)
            ],
            any::<bool>(),
            1u32..4
        )
            .prop_map(|(priority, start, delegated, max_attempts)| Op::Create {
                priority,
                start,
                delegated,
                max_attempts
            }),
        4 => (holder.clone(), 1u64..200).prop_map(|(holder, lease_ms)| Op::Claim { holder, lease_ms }),
        3 => (task.clone(), holder.clone()).prop_map(|(task, holder)| Op::Complete { task, holder }),
        2 => (task.clone(), holder.clone()).prop_map(|(task, holder)| Op::Fail { task, holder }),
        1 => (task.clone(), holder, 1u64..200)
            .prop_map(|(task, holder, lease_ms)| Op::Renew { task, holder, lease_ms }),
        1 => task.clone().prop_map(|task| Op::Cancel { task }),
        1 => task.clone().prop_map(|task| Op::Approve { task }),
        1 => task.clone().prop_map(|task| Op::Schedule { task }),
        1 => task.clone().prop_map(|task| Op::Park { task }),
        1 => task.clone().prop_map(|task| Op::ExpireLease { task }),
        2 => (task.clone(), 1u64..4).prop_map(|(task, child)| Op::AddChild { task, child }),
        2 => (task.clone(), 0usize..3).prop_map(|(task, holder)| Op::Wait { task, holder }),
        2 => (task.clone(), 1u64..4, any::<bool>())
            .prop_map(|(task, child, done)| Op::ChildEnded { task, child, done }),
        1 => task.prop_map(|task| Op::Resume { task }),
        3 => (1u64..150).prop_map(|ms| Op::Advance { ms }),
        2 => Just(Op::Requeue),
        2 => (0usize..4).prop_map(|count| Op::Deliver { count }),
    ]
}

/// The status changes the lifecycle table allows (a status "changing" to itself is always fine).
fn allowed(from: TaskStatus, to: TaskStatus) -> bool {
    use TaskStatus::*;
    from == to
        || matches!(
            (from, to),
            (PendingApproval, Ready | Backlog | Cancelled)
                | (Backlog, Ready | Cancelled)
                | (Ready, Backlog | InProgress | Cancelled)
                | (InProgress, Waiting | Ready | Done | Failed | Cancelled)
                | (Waiting, Ready | Cancelled)
        )
}

fn holder_name(i: usize) -> String {
    format!("worker-{i}")
}

struct Harness {
    store: MemoryTaskStore,
    agent: AgentId,
    boss: AgentId,
    now: Timestamp,
    created: u64,
    /// Every notice key ever seen (returned by a transition or listed in the outbox), with how
    /// often it was written.
    notices_written: HashMap<String, usize>,
    delivered: HashSet<String>,
}

impl Harness {
    fn new() -> Self {
        Self {
            store: MemoryTaskStore::new(),
            agent: AgentId::parse("worker").unwrap(),
            boss: AgentId::parse("boss").unwrap(),
            now: Timestamp(1_000),
            created: 0,
            notices_written: HashMap::new(),
            delivered: HashSet::new(),
        }
    }

    fn snapshot(&self) -> BTreeMap<u64, Task> {
        block_on(self.store.list(&self.agent, &TaskFilter::default()))
            .unwrap()
            .into_iter()
            .map(|t| (t.number, t))
            .collect()
    }

    fn number(&self, index: usize) -> Option<u64> {
        (self.created > 0).then(|| index as u64 % self.created + 1)
    }

    fn event(&self, number: u64, event: TaskEvent) -> Result<(), StoreError> {
        let tr =
            block_on(
                self.store
                    .transition(&self.agent, number, Expect::any(), event, self.now),
            )?;
        assert_eq!(tr.task.number, number);
        Ok(())
    }

    /// Runs one operation and checks what it says about itself against the state before it.
    fn run(&mut self, op: &Op, before: &BTreeMap<u64, Task>) {
        match op {
            Op::Create {
                priority,
                start,
                delegated,
                max_attempts,
            } => {
                let mut new = NewTask::new("task", "");
                new.priority = *priority;
                new.status = *start;
                new.max_attempts = *max_attempts;
                if *delegated {
                    new.metadata = TaskMetadata {
                        delegated_by: Some(self.boss.clone()),
                        originating_channel: Some(ChannelId::portal(&self.boss)),
                        ..TaskMetadata::default()
                    };
                }
                let t = block_on(self.store.create(&self.agent, new, self.now)).unwrap();
                self.created += 1;
                assert_eq!(t.number, self.created, "numbers without gaps");
            }
            Op::Claim { holder, lease_ms } => {
                let got = block_on(self.store.claim_next(
                    &self.agent,
                    &holder_name(*holder),
                    Duration::from_millis(*lease_ms),
                    self.now,
                ))
                .unwrap();
                let best = before
                    .values()
                    .filter(|t| t.status == TaskStatus::Ready)
                    .max_by_key(|t| (t.priority, std::cmp::Reverse(t.number)))
                    .map(|t| t.number);
                assert_eq!(got.as_ref().map(|t| t.number), best, "claim order");
                if let Some(t) = got {
                    assert_eq!(before[&t.number].status, TaskStatus::Ready);
                    let lease = t.lease.expect("a claimed task has a lease");
                    assert_eq!(lease.holder, holder_name(*holder));
                }
            }
            Op::Complete { task, holder } | Op::Fail { task, holder } => {
                let Some(n) = self.number(*task) else { return };
                let name = holder_name(*holder);
                let event = match op {
                    Op::Complete { .. } => TaskEvent::Complete {
                        holder: name.clone(),
                        result: format!("result of {n}"),
                    },
                    _ => TaskEvent::Fail {
                        holder: name.clone(),
                        error: format!("error of {n}"),
                    },
                };
                let prev = &before[&n];
                let result = self.event(n, event);
                let holds = prev.status == TaskStatus::InProgress
                    && prev.lease.as_ref().is_some_and(|l| l.holder == name);
                match result {
                    Ok(()) => assert!(holds, "only the lease holder finishes task {n}"),
                    Err(StoreError::NotLeaseHolder { .. }) => {
                        assert_eq!(prev.status, TaskStatus::InProgress);
                        assert!(!holds);
                    }
                    Err(StoreError::InvalidTransition(_)) => {
                        assert_ne!(prev.status, TaskStatus::InProgress)
                    }
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
            Op::Renew {
                task,
                holder,
                lease_ms,
            } => {
                let Some(n) = self.number(*task) else { return };
                let event = TaskEvent::Renew {
                    holder: holder_name(*holder),
                    lease_until: self.now.plus(Duration::from_millis(*lease_ms)),
                };
                let _ = self.event(n, event);
            }
            Op::Cancel { task } => {
                let Some(n) = self.number(*task) else { return };
                let result = self.event(
                    n,
                    TaskEvent::Cancel {
                        reason: "cancelled".into(),
                    },
                );
                assert_eq!(result.is_ok(), !before[&n].status.is_terminal());
            }
            Op::Approve { task } | Op::Schedule { task } | Op::Park { task } => {
                let Some(n) = self.number(*task) else { return };
                let event = match op {
                    Op::Approve { .. } => TaskEvent::Approve,
                    Op::Schedule { .. } => TaskEvent::Schedule,
                    _ => TaskEvent::Park,
                };
                let _ = self.event(n, event);
            }
            Op::ExpireLease { task } => {
                let Some(n) = self.number(*task) else { return };
                let result = self.event(n, TaskEvent::ExpireLease);
                let prev = &before[&n];
                let expired = prev.status == TaskStatus::InProgress && prev.lease_expired(self.now);
                assert_eq!(result.is_ok(), expired, "expire_lease only when expired");
            }
            Op::AddChild { task, child } => {
                let Some(n) = self.number(*task) else { return };
                let child = TaskRef::new(self.boss.clone(), *child);
                let _ = self.event(n, TaskEvent::AddChild { child });
            }
            Op::Wait { task, holder } => {
                let Some(n) = self.number(*task) else { return };
                let prev = &before[&n];
                let result = self.event(
                    n,
                    TaskEvent::Wait {
                        holder: holder_name(*holder),
                    },
                );
                if result.is_ok() {
                    let all_ended = prev.metadata.children.iter().all(|c| c.ended.is_some());
                    let now = block_on(self.store.get(&self.agent, n)).unwrap().unwrap();
                    let expected = if all_ended {
                        TaskStatus::Ready
                    } else {
                        TaskStatus::Waiting
                    };
                    assert_eq!(now.status, expected, "wait on children of {n}");
                }
            }
            Op::ChildEnded { task, child, done } => {
                let Some(n) = self.number(*task) else { return };
                let event = TaskEvent::ChildEnded {
                    child: TaskRef::new(self.boss.clone(), *child),
                    status: if *done {
                        TaskStatus::Done
                    } else {
                        TaskStatus::Failed
                    },
                    outcome: "child outcome".into(),
                };
                let _ = self.event(n, event);
            }
            Op::Resume { task } => {
                let Some(n) = self.number(*task) else { return };
                let _ = self.event(n, TaskEvent::Resume);
            }
            Op::Advance { ms } => self.now = self.now.plus(Duration::from_millis(*ms)),
            Op::Requeue => {
                let requeued = block_on(self.store.requeue_expired(&self.agent, self.now)).unwrap();
                let got: HashSet<u64> = requeued.iter().map(|tr| tr.task.number).collect();
                let expected: HashSet<u64> = before
                    .values()
                    .filter(|t| t.status == TaskStatus::InProgress && t.lease_expired(self.now))
                    .map(|t| t.number)
                    .collect();
                assert_eq!(
                    got, expected,
                    "requeue_expired takes exactly the expired leases"
                );
            }
            Op::Deliver { count } => {
                let pending = block_on(self.store.outbox_pending(&self.agent)).unwrap();
                for notice in pending.iter().take(*count) {
                    block_on(self.store.outbox_mark_sent(&self.agent, &notice.key)).unwrap();
                    // Delivery is at least once: marking again is harmless.
                    block_on(self.store.outbox_mark_sent(&self.agent, &notice.key)).unwrap();
                    self.delivered.insert(notice.key.clone());
                }
            }
        }
    }

    /// Checks the invariants between the state before and after one operation.
    fn check(&mut self, before: &BTreeMap<u64, Task>, after: &BTreeMap<u64, Task>) {
        let numbers: Vec<u64> = after.keys().copied().collect();
        assert_eq!(numbers, (1..=self.created).collect::<Vec<_>>(), "numbering");
        let pending = block_on(self.store.outbox_pending(&self.agent)).unwrap();
        let pending_keys: Vec<&str> = pending.iter().map(|n| n.key.as_str()).collect();
        let unique: HashSet<&str> = pending_keys.iter().copied().collect();
        assert_eq!(
            unique.len(),
            pending_keys.len(),
            "no key twice in the outbox"
        );
        for key in &pending_keys {
            assert!(
                !self.delivered.contains(*key),
                "a sent notice came back: {key}"
            );
        }

        for (n, t) in after {
            // Lease iff in progress; attempts bounded; failed only at max attempts.
            assert_eq!(
                t.status == TaskStatus::InProgress,
                t.lease.is_some(),
                "lease of {n}"
            );
            assert!(t.attempts <= t.max_attempts, "attempts of {n}");
            if t.status == TaskStatus::Failed {
                assert_eq!(t.attempts, t.max_attempts, "task {n} failed early");
            }
            let Some(prev) = before.get(n) else {
                assert_eq!(t.revision, 1);
                continue;
            };
            assert!(
                allowed(prev.status, t.status),
                "task {n}: {} -> {} is not in the table",
                prev.status,
                t.status
            );
            if prev.status.is_terminal() {
                assert_eq!(prev, t, "terminal task {n} changed");
            }
            if prev != t {
                assert!(t.revision > prev.revision, "revision of {n} did not grow");
            }
            let key = format!("{}#{}:{}", t.agent, t.number, t.status);
            let ended_now = t.status.is_terminal() && !prev.status.is_terminal();
            if ended_now {
                let delegated = t.metadata.delegated_by.is_some();
                // Written in the same step as the terminal transition.
                assert_eq!(
                    pending_keys.contains(&key.as_str()),
                    delegated,
                    "notice of {key}"
                );
                if delegated {
                    *self.notices_written.entry(key).or_default() += 1;
                }
            }
        }
        for key in &pending_keys {
            assert!(
                self.notices_written.contains_key(*key),
                "notice {key} for no terminal transition"
            );
        }
    }

    fn finish(&self, last: &BTreeMap<u64, Task>) {
        let expected: HashSet<String> = last
            .values()
            .filter(|t| t.status.is_terminal() && t.metadata.delegated_by.is_some())
            .map(|t| format!("{}#{}:{}", t.agent, t.number, t.status))
            .collect();
        let written: HashSet<String> = self.notices_written.keys().cloned().collect();
        assert_eq!(written, expected, "one notice per ended delegated task");
        assert!(
            self.notices_written.values().all(|&c| c == 1),
            "a notice was written twice"
        );
        let pending: HashSet<String> = block_on(self.store.outbox_pending(&self.agent))
            .unwrap()
            .into_iter()
            .map(|n| n.key)
            .collect();
        let accounted: HashSet<String> = pending.union(&self.delivered).cloned().collect();
        assert_eq!(accounted, expected, "every notice is pending or delivered");
        assert!(pending.is_disjoint(&self.delivered));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn task_store_keeps_the_lifecycle(ops in prop::collection::vec(op(), 1..80)) {
        let mut h = Harness::new();
        let mut before = h.snapshot();
        for op in &ops {
            h.run(op, &before);
            let after = h.snapshot();
            h.check(&before, &after);
            before = after;
        }
        h.finish(&before);
    }
}

/// Claims from several OS threads at once: every task is claimed exactly once.
#[test]
fn threads_never_share_a_claim() {
    let store = MemoryTaskStore::new();
    let agent = AgentId::parse("worker").unwrap();
    for i in 0..400 {
        block_on(store.create(&agent, NewTask::new(format!("t{i}"), ""), Timestamp(0))).unwrap();
    }
    let claimed: Vec<Vec<u64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|w| {
                let (store, agent) = (&store, &agent);
                s.spawn(move || {
                    let holder = holder_name(w);
                    let mut mine = Vec::new();
                    while let Some(t) = block_on(store.claim_next(
                        agent,
                        &holder,
                        Duration::from_secs(60),
                        Timestamp(0),
                    ))
                    .unwrap()
                    {
                        assert_eq!(t.lease.map(|l| l.holder), Some(holder.clone()));
                        mine.push(t.number);
                    }
                    mine
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut all: Vec<u64> = claimed.into_iter().flatten().collect();
    all.sort_unstable();
    assert_eq!(all, (1..=400).collect::<Vec<_>>());
}
