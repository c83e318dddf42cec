//! Behaviour of the redb stores through the store traits, on files in a temporary directory.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test helpers fail loudly

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use spacebot_core::channel::{ChannelStore, NewRecord, RecordKind};
use spacebot_core::conversation::{
    Conversation, ConversationFilter, ConversationMode, ConversationStatus, ConversationStore,
};
use spacebot_core::envelope::{DeliveryStore, Envelope, EnvelopeKind, Source};
use spacebot_core::link::{AgentLink, LinkDirection, LinkRelationship, LinkStore};
use spacebot_core::task::{
    Expect, NewTask, Priority, TaskEvent, TaskFilter, TaskStatus, TaskStore,
};
use spacebot_core::{AgentId, ChannelId, ConversationId, StoreError, Timestamp};
use spacebot_redb::{RedbOptions, RedbStore};

fn agent(id: &str) -> AgentId {
    AgentId::parse(id).unwrap()
}

fn store(dir: &std::path::Path) -> Arc<RedbStore> {
    RedbStore::open(dir, RedbOptions::default()).unwrap()
}

fn delegated(title: &str, by: &str, priority: Priority) -> NewTask {
    let mut t = NewTask::new(title, "do it");
    t.priority = priority;
    t.metadata.delegated_by = Some(agent(by));
    t.metadata.originating_channel = Some(ChannelId::portal(&agent(by)));
    t
}

#[tokio::test]
async fn tasks_are_numbered_claimed_by_priority_and_leave_notices() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let w = agent("worker");
    let low = TaskStore::create(
        &*s,
        &w,
        delegated("low", "boss", Priority::Low),
        Timestamp(1),
    )
    .await
    .unwrap();
    let urgent = TaskStore::create(
        &*s,
        &w,
        delegated("urgent", "boss", Priority::Urgent),
        Timestamp(2),
    )
    .await
    .unwrap();
    let urgent2 = TaskStore::create(
        &*s,
        &w,
        delegated("urgent2", "boss", Priority::Urgent),
        Timestamp(3),
    )
    .await
    .unwrap();
    assert_eq!((low.number, urgent.number, urgent2.number), (1, 2, 3));

    let order: Vec<u64> = [
        s.claim_next(&w, "h", Duration::from_secs(5), Timestamp(10))
            .await
            .unwrap(),
        s.claim_next(&w, "h", Duration::from_secs(5), Timestamp(10))
            .await
            .unwrap(),
        s.claim_next(&w, "h", Duration::from_secs(5), Timestamp(10))
            .await
            .unwrap(),
    ]
    .into_iter()
    .map(|t| t.unwrap().number)
    .collect();
    assert_eq!(order, vec![2, 3, 1]);
    assert!(
        s.claim_next(&w, "h", Duration::from_secs(5), Timestamp(10))
            .await
            .unwrap()
            .is_none()
    );

    // A stale guard is refused and changes nothing.
    let err = s
        .transition(
            &w,
            2,
            Expect {
                status: None,
                revision: Some(1),
            },
            TaskEvent::Cancel { reason: "x".into() },
            Timestamp(11),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Conflict { .. }), "{err}");
    // Only the lease holder completes.
    let err = s
        .transition(
            &w,
            2,
            Expect::any(),
            TaskEvent::Complete {
                holder: "other".into(),
                result: "r".into(),
            },
            Timestamp(11),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::NotLeaseHolder { .. }), "{err}");
    let done = s
        .transition(
            &w,
            2,
            Expect {
                status: Some(TaskStatus::InProgress),
                revision: Some(2),
            },
            TaskEvent::Complete {
                holder: "h".into(),
                result: "answer".into(),
            },
            Timestamp(12),
        )
        .await
        .unwrap();
    assert_eq!(done.task.status, TaskStatus::Done);
    let notice = done.notice.unwrap();
    assert_eq!(s.outbox_pending(&w).await.unwrap(), vec![notice.clone()]);

    // Leases of 1 and 3 expire: both go back to ready (attempts left).
    let requeued = s.requeue_expired(&w, Timestamp(10 + 5_000)).await.unwrap();
    let mut numbers: Vec<u64> = requeued.iter().map(|t| t.task.number).collect();
    numbers.sort_unstable();
    assert_eq!(numbers, vec![1, 3]);
    assert!(
        requeued
            .iter()
            .all(|t| t.task.status == TaskStatus::Ready && t.task.attempts == 1)
    );
    // They are claimable again, in priority order.
    let next = s
        .claim_next(&w, "h2", Duration::from_secs(5), Timestamp(20_000))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(next.number, 3);

    s.outbox_mark_sent(&w, &notice.key).await.unwrap();
    s.outbox_mark_sent(&w, &notice.key).await.unwrap();
    assert!(s.outbox_pending(&w).await.unwrap().is_empty());

    // Everything survives a reopen.
    s.close().await;
    drop(s);
    let s = store(dir.path());
    let all = TaskStore::list(&*s, &w, &TaskFilter::default())
        .await
        .unwrap();
    assert_eq!(
        all.iter().map(|t| t.number).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    assert_eq!(all[1].result.as_deref(), Some("answer"));
    let ready = TaskStore::list(
        &*s,
        &w,
        &TaskFilter {
            statuses: vec![TaskStatus::Ready],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(ready.iter().map(|t| t.number).collect::<Vec<_>>(), vec![1]);
    assert_eq!(
        s.claim_next(&w, "h3", Duration::from_secs(1), Timestamp(30_000))
            .await
            .unwrap()
            .unwrap()
            .number,
        1
    );
}

#[tokio::test]
async fn failures_at_max_attempts_write_one_notice() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let w = agent("worker");
    let mut new = delegated("flaky", "boss", Priority::High);
    new.max_attempts = 2;
    TaskStore::create(&*s, &w, new, Timestamp(0)).await.unwrap();
    for round in 0..2 {
        let t = s
            .claim_next(&w, "h", Duration::from_millis(10), Timestamp(round * 100))
            .await
            .unwrap()
            .unwrap();
        let out = s
            .requeue_expired(&w, Timestamp(round * 100 + 10))
            .await
            .unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].task.number, t.number);
    }
    let task = TaskStore::get(&*s, &w, 1).await.unwrap().unwrap();
    assert_eq!(task.status, TaskStatus::Failed);
    let pending = s.outbox_pending(&w).await.unwrap();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].key, "worker#1:failed");
    assert!(
        s.claim_next(&w, "h", Duration::from_secs(1), Timestamp(1_000))
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn concurrent_creates_and_claims_never_collide() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let w = agent("busy");
    let mut handles = Vec::new();
    for i in 0..8 {
        let s = s.clone();
        let w = w.clone();
        handles.push(tokio::spawn(async move {
            for j in 0..25 {
                TaskStore::create(&*s, &w, NewTask::new(format!("t{i}-{j}"), ""), Timestamp(j))
                    .await
                    .unwrap();
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    let numbers: Vec<u64> = TaskStore::list(&*s, &w, &TaskFilter::default())
        .await
        .unwrap()
        .iter()
        .map(|t| t.number)
        .collect();
    assert_eq!(numbers, (1..=200).collect::<Vec<_>>());

    let mut handles = Vec::new();
    for i in 0..8 {
        let s = s.clone();
        let w = w.clone();
        handles.push(tokio::spawn(async move {
            let mut got = Vec::new();
            while let Some(t) = s
                .claim_next(&w, &format!("h{i}"), Duration::from_secs(60), Timestamp(1))
                .await
                .unwrap()
            {
                got.push(t.number);
            }
            got
        }));
    }
    let mut claimed = Vec::new();
    for h in handles {
        claimed.extend(h.await.unwrap());
    }
    claimed.sort_unstable();
    assert_eq!(claimed, (1..=200).collect::<Vec<_>>());
}

fn link(from: &str, to: &str) -> AgentLink {
    AgentLink::new(
        agent(from),
        agent(to),
        LinkDirection::TwoWay,
        LinkRelationship::Peer,
        Timestamp(5),
    )
}

#[tokio::test]
async fn links_are_unique_per_pair_and_upserts_are_atomic() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let ab = link("a", "b");
    LinkStore::create(&*s, &ab).await.unwrap();
    let dup = link("a", "b");
    assert!(matches!(
        LinkStore::create(&*s, &dup).await,
        Err(StoreError::AlreadyExists { .. })
    ));
    assert!(LinkStore::get(&*s, &dup.id).await.unwrap().is_none());
    // The reverse pair is another link.
    LinkStore::create(&*s, &link("b", "a")).await.unwrap();
    LinkStore::create(&*s, &link("c", "a")).await.unwrap();
    LinkStore::create(&*s, &link("b", "c")).await.unwrap();
    let for_a: Vec<(String, String)> = s
        .links_for_agent(&agent("a"))
        .await
        .unwrap()
        .into_iter()
        .map(|l| (l.from.to_string(), l.to.to_string()))
        .collect();
    assert_eq!(
        for_a,
        vec![
            ("a".into(), "b".into()),
            ("b".into(), "a".into()),
            ("c".into(), "a".into())
        ]
    );

    // An upsert whose last entry reuses a taken id writes nothing.
    let mut changed = link("a", "b");
    changed.enabled = false;
    let mut clash = link("x", "y");
    clash.id = ab.id.clone();
    assert!(matches!(
        s.upsert_all(&[changed.clone(), link("d", "e"), clash])
            .await,
        Err(StoreError::AlreadyExists { .. })
    ));
    assert!(LinkStore::get(&*s, &ab.id).await.unwrap().unwrap().enabled);
    assert!(
        s.get_between(&agent("d"), &agent("e"))
            .await
            .unwrap()
            .is_none()
    );

    // A good upsert keeps the id and created_at of the existing pair.
    changed.updated_at = Timestamp(99);
    changed.created_at = Timestamp(98);
    s.upsert_all(&[changed.clone(), link("d", "e")])
        .await
        .unwrap();
    let stored = s
        .get_between(&agent("a"), &agent("b"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (
            stored.id.clone(),
            stored.enabled,
            stored.created_at,
            stored.updated_at
        ),
        (ab.id.clone(), false, Timestamp(5), Timestamp(99))
    );
    assert_eq!(LinkStore::list(&*s).await.unwrap().len(), 5);

    LinkStore::delete(&*s, &ab.id).await.unwrap();
    assert!(matches!(
        LinkStore::delete(&*s, &ab.id).await,
        Err(StoreError::NotFound { .. })
    ));
    assert!(
        s.get_between(&agent("a"), &agent("b"))
            .await
            .unwrap()
            .is_none()
    );
}

fn conversation(key: &str, created: i64) -> Conversation {
    Conversation {
        id: ConversationId::new_random(),
        mode: ConversationMode::Mirrored,
        members: vec![],
        initiator: agent("a"),
        initiated_from: None,
        status: ConversationStatus::Open,
        budget_remaining: 20,
        pair_key: Some(key.into()),
        summary: None,
        revision: 1,
        created_at: Timestamp(created),
        updated_at: Timestamp(created),
    }
}

#[tokio::test]
async fn one_open_conversation_per_key_and_updates_are_compare_and_swap() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let first = conversation("a|b", 2);
    ConversationStore::create(&*s, &first).await.unwrap();
    assert!(matches!(
        ConversationStore::create(&*s, &conversation("a|b", 3)).await,
        Err(StoreError::AlreadyExists { .. })
    ));
    let mut concluded = first.clone();
    concluded.status = ConversationStatus::Concluded;
    concluded.budget_remaining = 19;
    let stored = ConversationStore::update(&*s, &concluded, 1).await.unwrap();
    assert_eq!(stored.revision, 2);
    assert!(matches!(
        ConversationStore::update(&*s, &concluded, 1).await,
        Err(StoreError::Conflict { .. })
    ));
    let mut raised = stored.clone();
    raised.budget_remaining = 25;
    assert!(matches!(
        ConversationStore::update(&*s, &raised, 2).await,
        Err(StoreError::Invalid(_))
    ));
    assert!(s.find_open("a|b").await.unwrap().is_none());
    let second = conversation("a|b", 1);
    ConversationStore::create(&*s, &second).await.unwrap();
    // Reopening the first now clashes with the second.
    let mut reopen = stored.clone();
    reopen.status = ConversationStatus::Open;
    assert!(matches!(
        ConversationStore::update(&*s, &reopen, 2).await,
        Err(StoreError::AlreadyExists { .. })
    ));
    assert_eq!(s.find_open("a|b").await.unwrap().unwrap().id, second.id);
    let listed: Vec<ConversationId> = ConversationStore::list(&*s, &ConversationFilter::default())
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.id)
        .collect();
    assert_eq!(listed, vec![second.id.clone(), first.id.clone()]);
    let open_only = ConversationStore::list(
        &*s,
        &ConversationFilter {
            member: None,
            statuses: vec![ConversationStatus::Concluded],
        },
    )
    .await
    .unwrap();
    assert_eq!(open_only.len(), 1);
}

#[tokio::test]
async fn channel_history_keeps_order_and_limits_to_the_latest() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let a = agent("a");
    let one = ChannelId::new("one");
    let two = ChannelId::new("two");
    let mut seqs = Vec::new();
    for i in 0..10 {
        let ch = if i % 2 == 0 { &one } else { &two };
        let r = s
            .append(
                &a,
                NewRecord::new(
                    ch.clone(),
                    RecordKind::User,
                    "user",
                    format!("m{i}"),
                    Timestamp(i),
                ),
            )
            .await
            .unwrap();
        seqs.push(r.seq);
    }
    assert!(seqs.windows(2).all(|w| w[0] < w[1]));
    let all = s.history(&a, &one, None).await.unwrap();
    assert_eq!(
        all.iter()
            .map(|r| r.record.content.as_str())
            .collect::<Vec<_>>(),
        ["m0", "m2", "m4", "m6", "m8"]
    );
    let last = s.history(&a, &two, Some(2)).await.unwrap();
    assert_eq!(
        last.iter()
            .map(|r| r.record.content.as_str())
            .collect::<Vec<_>>(),
        ["m7", "m9"]
    );
    s.ensure_channel(&a, &ChannelId::new("empty"))
        .await
        .unwrap();
    s.ensure_channel(&a, &ChannelId::new("empty"))
        .await
        .unwrap();
    let names: Vec<String> = s
        .channels(&a)
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.to_string())
        .collect();
    assert_eq!(names, ["empty", "one", "two"]);
    // Another agent's file is separate.
    assert!(s.channels(&agent("b")).await.unwrap().is_empty());
}

#[tokio::test]
async fn deliveries_are_idempotent_and_applied_keys_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let a = agent("a");
    let envs: Vec<Envelope> = (0..3)
        .map(|i| {
            Envelope::new(
                Source::System,
                ChannelId::portal(&a),
                EnvelopeKind::Retrigger,
                format!("e{i}"),
                Timestamp(i),
            )
        })
        .collect();
    for e in &envs {
        s.persist(&a, e).await.unwrap();
    }
    s.persist(&a, &envs[0]).await.unwrap();
    assert_eq!(s.pending(&a).await.unwrap(), envs);
    s.remove(&a, &envs[1].id).await.unwrap();
    s.remove(&a, &envs[1].id).await.unwrap();
    assert_eq!(
        s.pending(&a).await.unwrap(),
        vec![envs[0].clone(), envs[2].clone()]
    );
    assert!(s.mark_applied(&a, "k1", Timestamp(1)).await.unwrap());
    assert!(!s.mark_applied(&a, "k1", Timestamp(2)).await.unwrap());
    s.close().await;
    drop(s);
    let s = store(dir.path());
    assert!(!s.mark_applied(&a, "k1", Timestamp(3)).await.unwrap());
    assert!(s.mark_applied(&a, "k2", Timestamp(3)).await.unwrap());
    assert_eq!(s.pending(&a).await.unwrap().len(), 2);
}

#[tokio::test]
async fn the_layout_is_one_instance_file_and_one_file_per_agent() {
    let dir = tempfile::tempdir().unwrap();
    let stores = spacebot_redb::open_async(dir.path()).await.unwrap();
    stores
        .tasks
        .create(&agent("x"), NewTask::new("t", ""), Timestamp(0))
        .await
        .unwrap();
    stores
        .channels
        .ensure_channel(&agent("y"), &ChannelId::new("c"))
        .await
        .unwrap();
    assert!(dir.path().join("instance.redb").is_file());
    assert!(dir.path().join("agents/x/spacebot.redb").is_file());
    assert!(dir.path().join("agents/y/spacebot.redb").is_file());
    assert!(!dir.path().join("agents/z").exists());
}

/// A reference board: the lifecycle applied to an in-memory map, claims by (priority desc, number).
#[derive(Default)]
struct Model {
    tasks: BTreeMap<u64, spacebot_core::Task>,
    outbox: Vec<String>,
}

#[derive(Debug, Clone)]
enum Op {
    Create(Priority, bool),
    Claim,
    Complete(u64),
    Fail(u64),
    Cancel(u64),
    Requeue(i64),
    MarkSent,
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    let priority = prop_oneof![
        Just(Priority::Low),
        Just(Priority::Medium),
        Just(Priority::High),
        Just(Priority::Urgent)
    ];
    prop_oneof![
        3 => (priority, any::<bool>()).prop_map(|(p, d)| Op::Create(p, d)),
        3 => Just(Op::Claim),
        2 => (1u64..12).prop_map(Op::Complete),
        1 => (1u64..12).prop_map(Op::Fail),
        1 => (1u64..12).prop_map(Op::Cancel),
        1 => (0i64..50).prop_map(Op::Requeue),
        1 => Just(Op::MarkSent),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 24, ..Default::default() })]
    /// Any sequence of operations leaves the redb board equal to the reference board.
    #[test]
    fn the_board_matches_the_lifecycle_model(ops in proptest::collection::vec(op(), 1..40)) {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let s = RedbStore::open(dir.path(), RedbOptions::default()).unwrap();
            let w = agent("w");
            let mut m = Model::default();
            for (step, op) in ops.into_iter().enumerate() {
                let now = Timestamp(i64::try_from(step).unwrap() * 10);
                match op {
                    Op::Create(p, d) => {
                        let new = if d { delegated("t", "boss", p) } else { NewTask { priority: p, ..NewTask::new("t", "") } };
                        let got = TaskStore::create(&*s, &w, new.clone(), now).await.unwrap();
                        let n = m.tasks.len() as u64 + 1;
                        let want = new.into_task(w.clone(), n, now).unwrap();
                        assert_eq!(&got, &want);
                        m.tasks.insert(n, want);
                    }
                    Op::Claim => {
                        let got = s.claim_next(&w, "h", Duration::from_millis(25), now).await.unwrap();
                        let pick = m.tasks.values().filter(|t| t.status == TaskStatus::Ready)
                            .min_by_key(|t| (std::cmp::Reverse(t.priority), t.number)).map(|t| t.number);
                        assert_eq!(got.as_ref().map(|t| t.number), pick);
                        if let Some(n) = pick {
                            let tr = m.tasks[&n].apply(TaskEvent::Claim { holder: "h".into(), lease_until: now.plus(Duration::from_millis(25)) }, now).unwrap();
                            assert_eq!(got.as_ref(), Some(&tr.task));
                            m.tasks.insert(n, tr.task);
                        }
                    }
                    Op::Complete(n) | Op::Fail(n) | Op::Cancel(n) => {
                        let event = match op {
                            Op::Complete(_) => TaskEvent::Complete { holder: "h".into(), result: "ok".into() },
                            Op::Fail(_) => TaskEvent::Fail { holder: "h".into(), error: "no".into() },
                            _ => TaskEvent::Cancel { reason: "stop".into() },
                        };
                        let got = s.transition(&w, n, Expect::any(), event.clone(), now).await;
                        match m.tasks.get(&n) {
                            None => assert!(matches!(got, Err(StoreError::NotFound { .. }))),
                            Some(t) => match t.apply(event, now) {
                                Ok(tr) => {
                                    let got = got.unwrap();
                                    assert_eq!(got, tr);
                                    if let Some(notice) = tr.notice { m.outbox.push(notice.key); }
                                    m.tasks.insert(n, tr.task);
                                }
                                Err(want) => assert_eq!(got.unwrap_err().to_string(), want.to_string()),
                            },
                        }
                    }
                    Op::Requeue(dt) => {
                        let at = Timestamp(now.0 + dt);
                        let got = s.requeue_expired(&w, at).await.unwrap();
                        let mut want = Vec::new();
                        for t in m.tasks.values() {
                            if t.status == TaskStatus::InProgress && t.lease_expired(at) {
                                want.push(t.apply(TaskEvent::ExpireLease, at).unwrap());
                            }
                        }
                        let got_set: BTreeSet<u64> = got.iter().map(|t| t.task.number).collect();
                        let want_set: BTreeSet<u64> = want.iter().map(|t| t.task.number).collect();
                        assert_eq!(got_set, want_set);
                        for tr in want {
                            if let Some(notice) = tr.notice { m.outbox.push(notice.key); }
                            m.tasks.insert(tr.task.number, tr.task);
                        }
                    }
                    Op::MarkSent => {
                        if !m.outbox.is_empty() {
                            let key = m.outbox.remove(0);
                            s.outbox_mark_sent(&w, &key).await.unwrap();
                        }
                    }
                }
                let keys: Vec<String> = s.outbox_pending(&w).await.unwrap().into_iter().map(|n| n.key).collect();
                assert_eq!(keys, m.outbox);
            }
            let all = TaskStore::list(&*s, &w, &TaskFilter::default()).await.unwrap();
            assert_eq!(all, m.tasks.values().cloned().collect::<Vec<_>>());
            s.close().await;
        });
    }
}

/// Refused operations share a batch with accepted ones without spoiling them: after a reopen the
/// board holds exactly what the answers said.
#[tokio::test]
async fn a_batch_mixing_refused_and_accepted_operations_keeps_exactly_the_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let options = RedbOptions::default().group_commit(64, Duration::from_millis(5));
    let s = RedbStore::open(dir.path(), options.clone()).unwrap();
    let w = agent("w");
    for i in 0..40 {
        TaskStore::create(&*s, &w, NewTask::new(format!("t{i}"), ""), Timestamp(0))
            .await
            .unwrap();
    }
    // Even numbers are cancelled with the right revision, odd ones with a stale one.
    let calls = (1..=40u64).map(|n| {
        let s = s.clone();
        let w = w.clone();
        async move {
            let revision = if n % 2 == 0 { 1 } else { 7 };
            let expect = Expect {
                status: None,
                revision: Some(revision),
            };
            let r = s
                .transition(
                    &w,
                    n,
                    expect,
                    TaskEvent::Cancel {
                        reason: "stop".into(),
                    },
                    Timestamp(1),
                )
                .await;
            (n, r.is_ok())
        }
    });
    let answers = futures::future::join_all(calls).await;
    assert!(answers.iter().all(|(n, ok)| *ok == (n % 2 == 0)));
    s.close().await;
    drop(s);
    let s = RedbStore::open(dir.path(), options).unwrap();
    for t in TaskStore::list(&*s, &w, &TaskFilter::default())
        .await
        .unwrap()
    {
        let want = if t.number % 2 == 0 {
            TaskStatus::Cancelled
        } else {
            TaskStatus::Ready
        };
        assert_eq!(t.status, want, "task {}", t.number);
    }
    assert_eq!(
        s.claim_next(&w, "h", Duration::from_secs(1), Timestamp(2))
            .await
            .unwrap()
            .unwrap()
            .number,
        1
    );
}

#[tokio::test]
async fn turn_commits_and_task_keys_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    assert!(s.is_durable(), "redb files survive the process");
    let a = agent("a");
    let portal = ChannelId::portal(&a);
    let envs: Vec<Envelope> = (0..3)
        .map(|i| {
            Envelope::new(
                Source::System,
                portal.clone(),
                EnvelopeKind::UserMessage,
                format!("e{i}"),
                Timestamp(i),
            )
        })
        .collect();
    for e in &envs {
        s.persist(&a, e).await.unwrap();
    }
    let records: Vec<NewRecord> = ["question", "answer"]
        .into_iter()
        .map(|t| NewRecord::new(portal.clone(), RecordKind::User, "a", t, Timestamp(5)))
        .collect();
    let commit = spacebot_core::TurnCommit {
        consumed: vec![envs[0].id.clone(), envs[2].id.clone()],
        records: records.clone(),
        applied: vec!["turn:e0".into()],
    };
    s.commit(&a, &commit, Timestamp(6)).await.unwrap();
    let keyed = NewTask::new("delegated once", "").with_idempotency_key("turn:e0:call-1");
    let task = TaskStore::create(&*s, &a, keyed.clone(), Timestamp(7))
        .await
        .unwrap();
    s.close().await;
    drop(s);

    let s = store(dir.path());
    assert_eq!(s.pending(&a).await.unwrap(), vec![envs[1].clone()]);
    assert!(s.is_applied(&a, "turn:e0").await.unwrap());
    assert!(!s.is_applied(&a, "turn:e1").await.unwrap());
    let history = s.history(&a, &portal, None).await.unwrap();
    assert_eq!(
        history.into_iter().map(|r| r.record).collect::<Vec<_>>(),
        records
    );
    let again = TaskStore::create(&*s, &a, keyed, Timestamp(8))
        .await
        .unwrap();
    assert_eq!(again, task, "the key survives a reopen");
    assert_eq!(
        TaskStore::list(&*s, &a, &TaskFilter::default())
            .await
            .unwrap()
            .len(),
        1
    );
}

/// A file written before the task key table existed gets the table on its first keyed create.
#[tokio::test]
async fn a_file_without_the_task_key_table_takes_keyed_creates() {
    let dir = tempfile::tempdir().unwrap();
    let a = agent("a");
    let s = store(dir.path());
    TaskStore::create(&*s, &a, NewTask::new("old", ""), Timestamp(1))
        .await
        .unwrap();
    s.close().await;
    drop(s);
    {
        let db = redb::Database::open(dir.path().join("agents/a/spacebot.redb")).unwrap();
        let tx = db.begin_write().unwrap();
        let table: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("task_keys");
        assert!(tx.delete_table(table).unwrap(), "the file had the table");
        tx.commit().unwrap();
    }
    let s = store(dir.path());
    let keyed = NewTask::new("new", "").with_idempotency_key("k");
    let first = TaskStore::create(&*s, &a, keyed.clone(), Timestamp(2))
        .await
        .unwrap();
    assert_eq!(first.number, 2);
    let again = TaskStore::create(&*s, &a, keyed, Timestamp(3))
        .await
        .unwrap();
    assert_eq!(again, first);
    assert_eq!(
        TaskStore::get(&*s, &a, 1).await.unwrap().unwrap().title,
        "old"
    );
}

/// An instance file written before the record tables existed reads as holding no records, gets
/// the tables on its first write, and keeps its links.
#[tokio::test]
async fn an_instance_file_without_the_record_tables_takes_records() {
    use spacebot_core::records::{Expect as RecordExpect, RecordStore, RecordWrite, WriteOutcome};
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let link = AgentLink::new(
        agent("a"),
        agent("b"),
        LinkDirection::TwoWay,
        LinkRelationship::Peer,
        Timestamp(1),
    );
    LinkStore::create(&*s, &link).await.unwrap();
    s.close().await;
    drop(s);
    {
        let db = redb::Database::open(dir.path().join("instance.redb")).unwrap();
        let tx = db.begin_write().unwrap();
        let records: redb::TableDefinition<(&str, &str, u64), &[u8]> =
            redb::TableDefinition::new("records");
        let heads: redb::TableDefinition<(&str, &str), u64> =
            redb::TableDefinition::new("record_heads");
        let effects: redb::TableDefinition<(&str, &str), (&str, u64)> =
            redb::TableDefinition::new("record_effects");
        assert!(tx.delete_table(records).unwrap(), "the file had the table");
        assert!(tx.delete_table(heads).unwrap(), "the file had the table");
        assert!(tx.delete_table(effects).unwrap(), "the file had the table");
        tx.commit().unwrap();
    }
    let s = store(dir.path());
    assert_eq!(RecordStore::get(&*s, "notes", "k").await.unwrap(), None);
    assert_eq!(RecordStore::list(&*s, "notes", "").await.unwrap(), vec![]);
    let write = RecordWrite::new("notes", "k", serde_json::json!(1), "alice")
        .expect(RecordExpect::Absent)
        .effect_key("e")
        .at(Timestamp(2));
    assert_eq!(
        RecordStore::write(&*s, write.clone()).await.unwrap(),
        WriteOutcome::Written(write.clone().into_record(1))
    );
    assert_eq!(
        RecordStore::write(&*s, write.clone()).await.unwrap(),
        WriteOutcome::AlreadyApplied(write.into_record(1))
    );
    assert_eq!(LinkStore::list(&*s).await.unwrap(), vec![link]);
}
