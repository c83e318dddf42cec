//! Behaviour of the SQLite stores that only a durable, multi-connection backend has: reopening,
//! clones of one handle, concurrent claims and numbering, the on-disk layout.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use spacebot_core::channel::NewRecord;
use spacebot_core::conversation::{
    ConversationFilter, ConversationMode, ConversationStatus, Member, MemberRole,
};
use spacebot_core::task::{Expect, Priority, TaskEvent, TaskFilter};
use spacebot_core::{
    AgentId, AgentLink, ChannelId, ChannelStore, Conversation, ConversationId, ConversationStore,
    DeliveryStore, Envelope, EnvelopeKind, LinkDirection, LinkRelationship, LinkStore, NewTask,
    RecordKind, Source, StoreError, TaskStatus, TaskStore, Timestamp,
};
use spacebot_sqlite::{Layout, SqliteOptions, SqliteStores, Synchronous};

fn agent(id: &str) -> AgentId {
    AgentId::parse(id).unwrap()
}

fn delegated(title: &str, by: &AgentId) -> NewTask {
    let mut t = NewTask::new(title, "details");
    t.metadata.delegated_by = Some(by.clone());
    t.metadata.originating_channel = Some(ChannelId::portal(by));
    t.created_by = format!("agent:{by}");
    t
}

/// Opens `dir` in the per-agent layout.
async fn open_per_agent(dir: &std::path::Path) -> SqliteStores {
    SqliteOptions::new()
        .layout(Layout::PerAgent)
        .open(dir)
        .await
        .unwrap()
}

#[tokio::test]
async fn layout_follows_the_instance_and_agent_split() {
    let dir = tempfile::tempdir().unwrap();
    let stores = open_per_agent(dir.path()).await;
    assert_eq!(stores.layout(), Layout::PerAgent);
    assert!(dir.path().join("instance.db").is_file());
    let worker = agent("worker");
    let agent_db = dir.path().join("agents/worker/data/spacebot.db");
    assert!(!agent_db.exists(), "agent databases open lazily");
    stores
        .tasks()
        .create(&worker, NewTask::new("t", ""), Timestamp(1))
        .await
        .unwrap();
    assert!(agent_db.is_file());
    assert_eq!(stores.agent_db_path(&worker), Some(agent_db));
    stores.close().await;
}

#[tokio::test]
async fn everything_survives_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (agent("boss"), agent("worker"));
    let link = AgentLink::new(
        a.clone(),
        b.clone(),
        LinkDirection::OneWay,
        LinkRelationship::Superior,
        Timestamp(5),
    );
    {
        let stores = SqliteStores::open(dir.path()).await.unwrap();
        stores.links().create(&link).await.unwrap();
        let t = stores
            .tasks()
            .create(&b, delegated("job", &a), Timestamp(10))
            .await
            .unwrap();
        stores
            .tasks()
            .claim_next(&b, "w1", Duration::from_secs(60), Timestamp(11))
            .await
            .unwrap();
        stores
            .tasks()
            .transition(
                &b,
                t.number,
                Expect::any(),
                TaskEvent::Complete {
                    holder: "w1".into(),
                    result: "42".into(),
                },
                Timestamp(12),
            )
            .await
            .unwrap();
        stores
            .channels()
            .append(
                &a,
                NewRecord::new(
                    ChannelId::portal(&a),
                    RecordKind::User,
                    "user",
                    "hi",
                    Timestamp(13),
                ),
            )
            .await
            .unwrap();
        let env = Envelope::new(
            Source::System,
            ChannelId::portal(&a),
            EnvelopeKind::Retrigger,
            "wake up",
            Timestamp(14),
        );
        stores.deliveries().persist(&a, &env).await.unwrap();
        assert!(
            stores
                .deliveries()
                .mark_applied(&a, "k1", Timestamp(15))
                .await
                .unwrap()
        );
        stores.close().await;
    }
    let stores = SqliteStores::open(dir.path()).await.unwrap();
    assert_eq!(stores.links().get(&link.id).await.unwrap(), Some(link));
    let task = stores.tasks().get(&b, 1).await.unwrap().unwrap();
    assert_eq!(task.status, TaskStatus::Done);
    assert_eq!(task.result.as_deref(), Some("42"));
    assert_eq!(task.metadata.delegated_by.as_ref(), Some(&a));
    let outbox = stores.tasks().outbox_pending(&b).await.unwrap();
    assert_eq!(outbox.len(), 1);
    assert_eq!(outbox[0].key, "worker#1:done");
    assert_eq!(outbox[0].outcome, "42");
    let history = stores
        .channels()
        .history(&a, &ChannelId::portal(&a), None)
        .await
        .unwrap();
    assert_eq!(history.len(), 1);
    assert_eq!(history[0].record.content, "hi");
    assert_eq!(stores.deliveries().pending(&a).await.unwrap().len(), 1);
    assert!(
        !stores
            .deliveries()
            .mark_applied(&a, "k1", Timestamp(16))
            .await
            .unwrap()
    );
    // Numbering continues after the reopen.
    let next = stores
        .tasks()
        .create(&b, NewTask::new("next", ""), Timestamp(20))
        .await
        .unwrap();
    assert_eq!(next.number, 2);
    stores.close().await;
}

#[tokio::test]
async fn claims_follow_priority_then_number_and_lease_until_now_plus_lease() {
    let stores = SqliteStores::in_memory().await.unwrap();
    let w = agent("w");
    for (title, priority) in [
        ("low", Priority::Low),
        ("high-1", Priority::High),
        ("medium", Priority::Medium),
        ("high-2", Priority::High),
        ("urgent", Priority::Urgent),
    ] {
        let mut t = NewTask::new(title, "");
        t.priority = priority;
        stores.tasks().create(&w, t, Timestamp(1)).await.unwrap();
    }
    let mut order = Vec::new();
    while let Some(t) = stores
        .tasks()
        .claim_next(&w, "h", Duration::from_millis(500), Timestamp(1_000))
        .await
        .unwrap()
    {
        assert_eq!(t.status, TaskStatus::InProgress);
        let lease = t.lease.clone().unwrap();
        assert_eq!(
            (lease.holder.as_str(), lease.expires_at),
            ("h", Timestamp(1_500))
        );
        assert_eq!(t.revision, 2);
        assert_eq!(t.updated_at, Timestamp(1_000));
        order.push(t.title);
    }
    assert_eq!(order, ["urgent", "high-1", "high-2", "medium", "low"]);
}

#[tokio::test]
async fn a_claim_matches_the_pure_lifecycle_function() {
    let stores = SqliteStores::in_memory().await.unwrap();
    let w = agent("w");
    let created = stores
        .tasks()
        .create(&w, NewTask::new("x", "y"), Timestamp(3))
        .await
        .unwrap();
    let claimed = stores
        .tasks()
        .claim_next(&w, "h", Duration::from_secs(9), Timestamp(4))
        .await
        .unwrap()
        .unwrap();
    let expected = created
        .apply(
            TaskEvent::Claim {
                holder: "h".into(),
                lease_until: Timestamp(9_004),
            },
            Timestamp(4),
        )
        .unwrap()
        .task;
    assert_eq!(claimed, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_from_two_clones_never_share_a_task() {
    let dir = tempfile::tempdir().unwrap();
    // One directory has one owner: concurrent callers share the handle's writer connection.
    let one = SqliteStores::open(dir.path()).await.unwrap();
    let two = one.clone();
    let w = agent("w");
    for i in 0..60 {
        one.tasks()
            .create(&w, NewTask::new(format!("t{i}"), ""), Timestamp(1))
            .await
            .unwrap();
    }
    let mut handles = Vec::new();
    for k in 0..8 {
        let store = if k % 2 == 0 { one.clone() } else { two.clone() };
        let w = w.clone();
        handles.push(tokio::spawn(async move {
            let mut got = Vec::new();
            while let Some(t) = store
                .tasks()
                .claim_next(&w, &format!("h{k}"), Duration::from_secs(60), Timestamp(2))
                .await
                .unwrap()
            {
                got.push(t.number);
            }
            got
        }));
    }
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.await.unwrap());
    }
    all.sort_unstable();
    assert_eq!(all, (1..=60).collect::<Vec<u64>>());
    one.close().await;
    two.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_creates_from_two_clones_number_without_gaps() {
    let dir = tempfile::tempdir().unwrap();
    let one = SqliteStores::open(dir.path()).await.unwrap();
    let two = one.clone();
    let w = agent("w");
    let mut handles = Vec::new();
    for k in 0..80 {
        let store = if k % 2 == 0 { one.clone() } else { two.clone() };
        let w = w.clone();
        handles.push(tokio::spawn(async move {
            store
                .tasks()
                .create(&w, NewTask::new(format!("t{k}"), ""), Timestamp(k))
                .await
                .unwrap()
                .number
        }));
    }
    let mut numbers = Vec::new();
    for h in handles {
        numbers.push(h.await.unwrap());
    }
    numbers.sort_unstable();
    assert_eq!(numbers, (1..=80).collect::<Vec<u64>>());
    let listed = one.tasks().list(&w, &TaskFilter::default()).await.unwrap();
    let titles: BTreeSet<String> = listed.iter().map(|t| t.title.clone()).collect();
    assert_eq!(titles.len(), 80);
    one.close().await;
    two.close().await;
}

#[tokio::test]
async fn terminal_transitions_write_their_notice_and_guards_hold() {
    let stores = SqliteStores::in_memory().await.unwrap();
    let (boss, w) = (agent("boss"), agent("w"));
    let t = stores
        .tasks()
        .create(&w, delegated("job", &boss), Timestamp(1))
        .await
        .unwrap();
    // A stale guard is a conflict and changes nothing.
    let err = stores
        .tasks()
        .transition(
            &w,
            t.number,
            Expect {
                status: None,
                revision: Some(7),
            },
            TaskEvent::Park,
            Timestamp(2),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Conflict { .. }), "{err}");
    assert_eq!(stores.tasks().get(&w, 1).await.unwrap(), Some(t.clone()));
    // Not the holder.
    stores
        .tasks()
        .claim_next(&w, "h1", Duration::from_secs(5), Timestamp(3))
        .await
        .unwrap()
        .unwrap();
    let err = stores
        .tasks()
        .transition(
            &w,
            1,
            Expect::any(),
            TaskEvent::Complete {
                holder: "intruder".into(),
                result: "x".into(),
            },
            Timestamp(4),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::NotLeaseHolder { .. }), "{err}");
    assert!(stores.tasks().outbox_pending(&w).await.unwrap().is_empty());
    // The holder fails for good: one notice, written with the transition.
    let tr = stores
        .tasks()
        .transition(
            &w,
            1,
            Expect {
                status: Some(TaskStatus::InProgress),
                revision: Some(2),
            },
            TaskEvent::Cancel {
                reason: "no longer needed".into(),
            },
            Timestamp(5),
        )
        .await
        .unwrap();
    assert_eq!(tr.task.status, TaskStatus::Cancelled);
    let notice = tr.notice.unwrap();
    assert_eq!(
        stores.tasks().outbox_pending(&w).await.unwrap(),
        vec![notice.clone()]
    );
    assert_eq!(notice.outcome, "no longer needed");
    // A missing task.
    let err = stores
        .tasks()
        .transition(&w, 99, Expect::any(), TaskEvent::Approve, Timestamp(6))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::NotFound { .. }), "{err}");
    // Mark sent: idempotent.
    stores
        .tasks()
        .outbox_mark_sent(&w, &notice.key)
        .await
        .unwrap();
    stores
        .tasks()
        .outbox_mark_sent(&w, &notice.key)
        .await
        .unwrap();
    stores
        .tasks()
        .outbox_mark_sent(&w, "unknown")
        .await
        .unwrap();
    assert!(stores.tasks().outbox_pending(&w).await.unwrap().is_empty());
}

#[tokio::test]
async fn expired_leases_are_requeued_then_fail_at_max_attempts() {
    let stores = SqliteStores::in_memory().await.unwrap();
    let (boss, w) = (agent("boss"), agent("w"));
    let mut new = delegated("flaky", &boss);
    new.max_attempts = 2;
    stores.tasks().create(&w, new, Timestamp(0)).await.unwrap();
    stores
        .tasks()
        .create(&w, NewTask::new("other", ""), Timestamp(0))
        .await
        .unwrap();
    stores
        .tasks()
        .claim_next(&w, "h", Duration::from_millis(100), Timestamp(0))
        .await
        .unwrap();
    stores
        .tasks()
        .claim_next(&w, "h", Duration::from_millis(300), Timestamp(0))
        .await
        .unwrap();
    assert!(
        stores
            .tasks()
            .requeue_expired(&w, Timestamp(99))
            .await
            .unwrap()
            .is_empty()
    );
    let requeued = stores
        .tasks()
        .requeue_expired(&w, Timestamp(100))
        .await
        .unwrap();
    assert_eq!(requeued.len(), 1);
    assert_eq!(requeued[0].task.number, 1);
    assert_eq!(requeued[0].task.status, TaskStatus::Ready);
    assert_eq!(requeued[0].task.attempts, 1);
    assert!(requeued[0].notice.is_none());
    // Second expiry: failed for good, with its notice in the outbox.
    stores
        .tasks()
        .claim_next(&w, "h", Duration::from_millis(100), Timestamp(200))
        .await
        .unwrap();
    let requeued = stores
        .tasks()
        .requeue_expired(&w, Timestamp(1_000))
        .await
        .unwrap();
    let numbers: Vec<u64> = requeued.iter().map(|t| t.task.number).collect();
    assert_eq!(numbers, [1, 2]);
    assert_eq!(requeued[0].task.status, TaskStatus::Failed);
    assert_eq!(requeued[1].task.status, TaskStatus::Ready);
    let outbox = stores.tasks().outbox_pending(&w).await.unwrap();
    assert_eq!(outbox.len(), 1);
    assert_eq!(outbox[0].key, "w#1:failed");
}

#[tokio::test]
async fn list_filters_by_status_delegator_creator_and_limit() {
    let stores = SqliteStores::in_memory().await.unwrap();
    let (a, b, w) = (agent("a"), agent("b"), agent("w"));
    stores
        .tasks()
        .create(&w, delegated("from a", &a), Timestamp(1))
        .await
        .unwrap();
    stores
        .tasks()
        .create(&w, delegated("from b", &b), Timestamp(1))
        .await
        .unwrap();
    let mut parked = NewTask::new("human backlog", "");
    parked.status = TaskStatus::Backlog;
    stores
        .tasks()
        .create(&w, parked, Timestamp(1))
        .await
        .unwrap();
    stores
        .tasks()
        .create(&w, delegated("from a again", &a), Timestamp(1))
        .await
        .unwrap();
    let titles = |tasks: Vec<spacebot_core::Task>| -> Vec<String> {
        tasks.into_iter().map(|t| t.title).collect()
    };
    let by_a = TaskFilter {
        delegated_by: Some(a.clone()),
        ..TaskFilter::default()
    };
    assert_eq!(
        titles(stores.tasks().list(&w, &by_a).await.unwrap()),
        ["from a", "from a again"]
    );
    let backlog = TaskFilter {
        statuses: vec![TaskStatus::Backlog, TaskStatus::Done],
        ..TaskFilter::default()
    };
    assert_eq!(
        titles(stores.tasks().list(&w, &backlog).await.unwrap()),
        ["human backlog"]
    );
    let human = TaskFilter {
        created_by: Some("human".into()),
        ..TaskFilter::default()
    };
    assert_eq!(
        titles(stores.tasks().list(&w, &human).await.unwrap()),
        ["human backlog"]
    );
    let first_two = TaskFilter {
        limit: Some(2),
        ..TaskFilter::default()
    };
    assert_eq!(
        titles(stores.tasks().list(&w, &first_two).await.unwrap()),
        ["from a", "from b"]
    );
    // Validation happens before anything is written.
    let err = stores
        .tasks()
        .create(&w, NewTask::new("   ", ""), Timestamp(1))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Invalid(_)), "{err}");
    assert_eq!(
        stores
            .tasks()
            .list(&w, &TaskFilter::default())
            .await
            .unwrap()
            .len(),
        4
    );
}

#[tokio::test]
async fn links_are_unique_per_pair_and_upserts_are_atomic() {
    let stores = SqliteStores::in_memory().await.unwrap();
    let (a, b, c) = (agent("a"), agent("b"), agent("c"));
    let ab = AgentLink::new(
        a.clone(),
        b.clone(),
        LinkDirection::TwoWay,
        LinkRelationship::Peer,
        Timestamp(1),
    );
    stores.links().create(&ab).await.unwrap();
    let mut dup = ab.clone();
    dup.id = spacebot_core::LinkId::new_random();
    assert!(matches!(
        stores.links().create(&dup).await,
        Err(StoreError::AlreadyExists { .. })
    ));
    // The reverse pair is a different link.
    let ba = AgentLink::new(
        b.clone(),
        a.clone(),
        LinkDirection::OneWay,
        LinkRelationship::Subordinate,
        Timestamp(2),
    );
    stores.links().create(&ba).await.unwrap();
    assert_eq!(
        stores.links().get_between(&b, &a).await.unwrap(),
        Some(ba.clone())
    );
    // Upsert: an existing pair keeps id and created_at; a clash of ids rolls everything back.
    let mut ab2 = ab.clone();
    ab2.id = spacebot_core::LinkId::new_random();
    ab2.relationship = LinkRelationship::Superior;
    ab2.created_at = Timestamp(50);
    ab2.updated_at = Timestamp(51);
    let mut clash = AgentLink::new(
        a.clone(),
        c.clone(),
        LinkDirection::TwoWay,
        LinkRelationship::Peer,
        Timestamp(3),
    );
    clash.id = ba.id.clone();
    assert!(
        stores
            .links()
            .upsert_all(&[ab2.clone(), clash])
            .await
            .is_err()
    );
    assert_eq!(stores.links().get(&ab.id).await.unwrap(), Some(ab.clone()));
    assert_eq!(stores.links().get_between(&a, &c).await.unwrap(), None);
    let ac = AgentLink::new(
        a.clone(),
        c.clone(),
        LinkDirection::TwoWay,
        LinkRelationship::Peer,
        Timestamp(3),
    );
    stores.links().upsert_all(&[ab2, ac.clone()]).await.unwrap();
    let stored = stores.links().get_between(&a, &b).await.unwrap().unwrap();
    assert_eq!(
        (stored.id.clone(), stored.created_at),
        (ab.id.clone(), ab.created_at)
    );
    assert_eq!(stored.relationship, LinkRelationship::Superior);
    assert_eq!(stored.updated_at, Timestamp(51));
    let pairs: Vec<(String, String)> = stores
        .links()
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|l| (l.from.into_inner(), l.to.into_inner()))
        .collect();
    assert_eq!(
        pairs,
        [("a", "b"), ("a", "c"), ("b", "a")].map(|(x, y)| (x.to_string(), y.to_string()))
    );
    assert_eq!(stores.links().links_for_agent(&c).await.unwrap(), vec![ac]);
    stores.links().delete(&ab.id).await.unwrap();
    assert!(matches!(
        stores.links().delete(&ab.id).await,
        Err(StoreError::NotFound { .. })
    ));
    assert!(matches!(
        stores.links().update(&ab).await,
        Err(StoreError::NotFound { .. })
    ));
}

fn conversation(pair: &str, a: &AgentId, b: &AgentId) -> Conversation {
    let member = |agent: &AgentId, peer: &AgentId, number, role| Member {
        agent: agent.clone(),
        channel: ChannelId::link(agent, peer),
        name: agent.to_string(),
        number,
        role,
        open: true,
    };
    Conversation {
        id: ConversationId::new_random(),
        mode: ConversationMode::Mirrored,
        members: vec![
            member(a, b, 1, MemberRole::Initiator),
            member(b, a, 2, MemberRole::Responder),
        ],
        initiator: a.clone(),
        initiated_from: Some(ChannelId::portal(a)),
        status: ConversationStatus::Open,
        budget_remaining: 20,
        pair_key: Some(pair.to_string()),
        summary: None,
        revision: 1,
        created_at: Timestamp(1),
        updated_at: Timestamp(1),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn conversations_keep_one_open_per_pair_and_update_by_revision() {
    let dir = tempfile::tempdir().unwrap();
    let stores = Arc::new(SqliteStores::open(dir.path()).await.unwrap());
    let (a, b, c) = (agent("a"), agent("b"), agent("c"));
    // Concurrent creates with one key leave exactly one open conversation.
    let mut handles = Vec::new();
    for _ in 0..8 {
        let (s, conv) = (stores.clone(), conversation("a|b", &a, &b));
        handles.push(tokio::spawn(async move {
            s.conversations().create(&conv).await.is_ok()
        }));
    }
    let mut created = 0;
    for h in handles {
        created += usize::from(h.await.unwrap());
    }
    assert_eq!(created, 1);
    let open = stores
        .conversations()
        .find_open("a|b")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(open.members.len(), 2);
    assert_eq!(
        stores.conversations().get(&open.id).await.unwrap(),
        Some(open.clone())
    );

    let mut next = open.clone();
    next.budget_remaining = 19;
    next.members[1].open = false;
    let stored = stores.conversations().update(&next, 1).await.unwrap();
    assert_eq!(stored.revision, 2);
    assert_eq!(
        stores.conversations().get(&open.id).await.unwrap(),
        Some(stored.clone())
    );
    // Stale revision, raised budget: refused, nothing written.
    assert!(matches!(
        stores.conversations().update(&next, 1).await,
        Err(StoreError::Conflict { .. })
    ));
    let mut raised = stored.clone();
    raised.budget_remaining = 25;
    assert!(matches!(
        stores.conversations().update(&raised, 2).await,
        Err(StoreError::Invalid(_))
    ));
    // Conclude, open another for the same pair, then reopening the first is refused.
    let mut concluded = stored.clone();
    concluded.status = ConversationStatus::Concluded;
    concluded.summary = Some("done".into());
    let concluded = stores.conversations().update(&concluded, 2).await.unwrap();
    let second = conversation("a|b", &a, &b);
    stores.conversations().create(&second).await.unwrap();
    let mut reopened = concluded.clone();
    reopened.status = ConversationStatus::Open;
    assert!(matches!(
        stores.conversations().update(&reopened, 3).await,
        Err(StoreError::AlreadyExists { .. })
    ));
    let mut other = conversation("a|c", &a, &c);
    other.created_at = Timestamp(0);
    stores.conversations().create(&other).await.unwrap();
    let with_c = stores
        .conversations()
        .list(&ConversationFilter {
            member: Some(c.clone()),
            statuses: vec![],
        })
        .await
        .unwrap();
    assert_eq!(with_c, vec![other.clone()]);
    let open_ones = stores
        .conversations()
        .list(&ConversationFilter {
            member: None,
            statuses: vec![ConversationStatus::Open],
        })
        .await
        .unwrap();
    let ids: Vec<_> = open_ones.iter().map(|c| c.id.clone()).collect();
    assert_eq!(ids, vec![other.id.clone(), second.id.clone()]);
    stores.close().await;
}

#[tokio::test]
async fn channels_and_deliveries_keep_order_and_apply_keys_once() {
    let stores = SqliteStores::in_memory().await.unwrap();
    let a = agent("a");
    let (c1, c2) = (ChannelId::new("z-first"), ChannelId::portal(&a));
    stores.channels().ensure_channel(&a, &c1).await.unwrap();
    stores.channels().ensure_channel(&a, &c1).await.unwrap();
    let mut seqs = Vec::new();
    for i in 0..5 {
        let ch = if i % 2 == 0 { &c2 } else { &c1 };
        let mut rec = NewRecord::new(
            ch.clone(),
            RecordKind::Sent,
            "a",
            format!("m{i}"),
            Timestamp(i),
        );
        rec.metadata.insert("i".into(), serde_json::json!(i));
        let stored = stores.channels().append(&a, rec.clone()).await.unwrap();
        assert_eq!(stored.record, rec);
        seqs.push(stored.seq);
    }
    assert!(seqs.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(
        stores.channels().channels(&a).await.unwrap(),
        vec![c2.clone(), c1.clone()]
    );
    let last_two: Vec<String> = stores
        .channels()
        .history(&a, &c2, Some(2))
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.record.content.into_string())
        .collect();
    assert_eq!(last_two, ["m2", "m4"]);
    assert_eq!(
        stores
            .channels()
            .history(&a, &c2, None)
            .await
            .unwrap()
            .len(),
        3
    );

    let envs: Vec<Envelope> = (0..3)
        .map(|i| {
            Envelope::new(
                Source::System,
                c2.clone(),
                EnvelopeKind::Retrigger,
                format!("e{i}"),
                Timestamp(i),
            )
            .with_idempotency_key(format!("k{i}"))
        })
        .collect();
    for e in &envs {
        stores.deliveries().persist(&a, e).await.unwrap();
    }
    stores.deliveries().persist(&a, &envs[0]).await.unwrap();
    assert_eq!(stores.deliveries().pending(&a).await.unwrap(), envs);
    stores.deliveries().remove(&a, &envs[1].id).await.unwrap();
    stores.deliveries().remove(&a, &envs[1].id).await.unwrap();
    assert_eq!(
        stores.deliveries().pending(&a).await.unwrap(),
        vec![envs[0].clone(), envs[2].clone()]
    );
    assert!(
        stores
            .deliveries()
            .mark_applied(&a, "k0", Timestamp(1))
            .await
            .unwrap()
    );
    assert!(
        !stores
            .deliveries()
            .mark_applied(&a, "k0", Timestamp(2))
            .await
            .unwrap()
    );
    // Keys are per agent.
    assert!(
        stores
            .deliveries()
            .mark_applied(&agent("b"), "k0", Timestamp(3))
            .await
            .unwrap()
    );
}

#[tokio::test]
async fn options_are_applied_to_every_database() {
    let dir = tempfile::tempdir().unwrap();
    let stores = SqliteOptions::new()
        .layout(Layout::PerAgent)
        .synchronous(Synchronous::Full)
        .busy_timeout(Duration::from_millis(250))
        .readers(2)
        .open(dir.path())
        .await
        .unwrap();
    stores
        .tasks()
        .create(&agent("w"), NewTask::new("t", ""), Timestamp(1))
        .await
        .unwrap();
    let bundle = stores.stores();
    assert_eq!(
        bundle
            .tasks
            .list(&agent("w"), &TaskFilter::default())
            .await
            .unwrap()
            .len(),
        1
    );
    stores.close().await;
    // WAL is persistent in the file header: check it on both files from a plain connection.
    for file in ["instance.db", "agents/w/data/spacebot.db"] {
        let bytes = std::fs::read(dir.path().join(file)).unwrap();
        // Bytes 18 and 19 of the header are 2 in WAL mode.
        assert_eq!((bytes[18], bytes[19]), (2, 2), "{file} is not in WAL mode");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn handles_opening_a_new_directory_at_once_take_turns() {
    let dir = tempfile::tempdir().unwrap();
    let w = agent("w");
    let opens = (0..6).map(|i| {
        let (path, w) = (dir.path().to_path_buf(), w.clone());
        tokio::spawn(async move {
            // One owner at a time: the others are refused until it closes.
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            let stores = loop {
                match SqliteStores::open(&path).await {
                    Ok(stores) => break stores,
                    Err(e) => {
                        assert!(e.to_string().contains("is already open by"), "{e}");
                        assert!(
                            std::time::Instant::now() < deadline,
                            "never got a turn: {e}"
                        );
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            };
            let task = stores
                .tasks()
                .create(&w, NewTask::new(format!("t{i}"), ""), Timestamp(1))
                .await
                .unwrap();
            stores.close().await;
            task.number
        })
    });
    let mut numbers = Vec::new();
    for open in opens {
        numbers.push(open.await.unwrap());
    }
    numbers.sort_unstable();
    assert_eq!(numbers, (1..=6).collect::<Vec<u64>>());
}

#[tokio::test]
async fn turn_commits_and_task_keys_survive_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let a = agent("boss");
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
    let records: Vec<NewRecord> = ["question", "answer"]
        .into_iter()
        .map(|t| NewRecord::new(portal.clone(), RecordKind::User, "boss", t, Timestamp(5)))
        .collect();
    let keyed = NewTask::new("delegated once", "").with_idempotency_key("turn:e0:call-1");
    let task = {
        let stores = SqliteStores::open(dir.path()).await.unwrap();
        assert!(stores.deliveries().is_durable(), "a directory is durable");
        for e in &envs {
            stores.deliveries().persist(&a, e).await.unwrap();
        }
        let commit = spacebot_core::TurnCommit {
            consumed: vec![envs[0].id.clone(), envs[2].id.clone()],
            records: records.clone(),
            applied: vec!["turn:e0".into()],
        };
        stores
            .deliveries()
            .commit(&a, &commit, Timestamp(6))
            .await
            .unwrap();
        let task = stores
            .tasks()
            .create(&a, keyed.clone(), Timestamp(7))
            .await
            .unwrap();
        stores.close().await;
        task
    };
    let stores = SqliteStores::open(dir.path()).await.unwrap();
    let deliveries = stores.deliveries();
    assert_eq!(deliveries.pending(&a).await.unwrap(), vec![envs[1].clone()]);
    assert!(deliveries.is_applied(&a, "turn:e0").await.unwrap());
    assert!(!deliveries.is_applied(&a, "turn:e1").await.unwrap());
    let history = stores.channels().history(&a, &portal, None).await.unwrap();
    assert_eq!(
        history.into_iter().map(|r| r.record).collect::<Vec<_>>(),
        records
    );
    let again = stores
        .tasks()
        .create(&a, keyed, Timestamp(8))
        .await
        .unwrap();
    assert_eq!(again, task, "the key survives a reopen");
    assert_eq!(
        stores
            .tasks()
            .list(&a, &TaskFilter::default())
            .await
            .unwrap()
            .len(),
        1
    );
    stores.close().await;
    let in_memory = SqliteStores::in_memory().await.unwrap();
    assert!(
        !in_memory.deliveries().is_durable(),
        "an in-memory database does not survive the process"
    );
}

/// A database written by a build that knew only migration 0001 gains task keys on open, keeping
/// its tasks: as an agent's own database (the per-agent layout), and copied into the
/// organization's database (the default layout).
#[tokio::test]
async fn a_database_from_before_task_keys_is_migrated() {
    for layout in [Layout::PerAgent, Layout::Organization] {
        database_from_before_task_keys(layout).await;
    }
}

/// The insert of a task as the schema of migration 0001 took it.
const INSERT_V1_SQL: &str = "INSERT INTO tasks (number, title, description, status, \
     priority, created_by, delegated_by, metadata, attempts, max_attempts, lease_holder, \
     lease_expires_at, revision, result, error, created_at, updated_at) \
     VALUES ((SELECT coalesce(max(number), 0) + 1 FROM tasks), \
             ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL, ?, NULL, NULL, ?, ?) \
     RETURNING number";

async fn database_from_before_task_keys(layout: Layout) {
    let dir = tempfile::tempdir().unwrap();
    let worker = agent("worker");
    let db_path = dir.path().join("agents/worker/data/spacebot.db");
    {
        // Only the first migration, exactly as an older build applied it.
        let old = tempfile::tempdir().unwrap();
        let first =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations/0001_agent.sql");
        std::fs::copy(&first, old.path().join("0001_agent.sql")).unwrap();
        let migrator = sqlx::migrate::Migrator::new(old.path()).await.unwrap();
        std::fs::create_dir_all(db_path.parent().unwrap()).unwrap();
        let options = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(&db_path)
            .create_if_missing(true);
        let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
        migrator.run(&pool).await.unwrap();
        sqlx::query_scalar::<_, i64>(INSERT_V1_SQL)
            .bind("old task")
            .bind("")
            .bind("ready")
            .bind(2i64)
            .bind("human")
            .bind(None::<String>)
            .bind("{}")
            .bind(0i64)
            .bind(3i64)
            .bind(1i64)
            .bind(1i64)
            .bind(1i64)
            .fetch_one(&pool)
            .await
            .unwrap();
        let has_column: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pragma_table_info('tasks') WHERE name = 'idempotency_key'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(has_column, 0, "the old schema has no key column");
        pool.close().await;
    }
    let stores = SqliteOptions::new()
        .layout(layout)
        .open(dir.path())
        .await
        .unwrap();
    assert_eq!(stores.layout(), layout);
    let old = stores.tasks().get(&worker, 1).await.unwrap().unwrap();
    assert_eq!(old.title, "old task");
    let keyed = NewTask::new("new task", "").with_idempotency_key("k");
    let first = stores
        .tasks()
        .create(&worker, keyed.clone(), Timestamp(2))
        .await
        .unwrap();
    assert_eq!(first.number, 2);
    let again = stores
        .tasks()
        .create(&worker, keyed, Timestamp(3))
        .await
        .unwrap();
    assert_eq!(again, first);
    let plain = stores
        .tasks()
        .create(&worker, NewTask::new("plain", ""), Timestamp(4))
        .await
        .unwrap();
    assert_eq!(plain.number, 3);
    stores.close().await;
    assert_eq!(
        dir.path().join("agents.migrated").is_dir(),
        layout == Layout::Organization
    );
}

/// An instance database written by a build that knew only migration 0001 (no records) gains the
/// records table on open, keeping its links; records then work and survive a reopen.
#[tokio::test]
async fn an_instance_database_from_before_records_is_migrated() {
    use spacebot_core::{Expect, RecordStore, RecordWrite, WriteOutcome};
    let dir = tempfile::tempdir().unwrap();
    let db_path = dir.path().join("instance.db");
    let link = AgentLink::new(
        agent("alpha"),
        agent("beta"),
        LinkDirection::TwoWay,
        LinkRelationship::Peer,
        Timestamp(1),
    );
    {
        // Only the first migration, exactly as an older build applied it.
        let old = tempfile::tempdir().unwrap();
        let first = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("migrations_instance/0001_instance.sql");
        std::fs::copy(&first, old.path().join("0001_instance.sql")).unwrap();
        let migrator = sqlx::migrate::Migrator::new(old.path()).await.unwrap();
        let options = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(&db_path)
            .create_if_missing(true);
        let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
        migrator.run(&pool).await.unwrap();
        sqlx::query(
            "INSERT INTO agent_links (id, from_agent_id, to_agent_id, direction, relationship, \
             enabled, created_at, updated_at) VALUES (?, 'alpha', 'beta', 'two_way', 'peer', 1, 1, 1)",
        )
        .bind(link.id.as_str())
        .execute(&pool)
        .await
        .unwrap();
        let tables: i64 =
            sqlx::query_scalar("SELECT count(*) FROM sqlite_schema WHERE name = 'records'")
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(tables, 0, "the old schema has no records table");
        pool.close().await;
    }
    let stores = SqliteStores::open(dir.path()).await.unwrap();
    assert_eq!(stores.links().list().await.unwrap(), vec![link.clone()]);
    let write = RecordWrite::new("notes", "plan", serde_json::json!("v1"), "alice")
        .expect(Expect::Absent)
        .effect_key("turn-1")
        .at(Timestamp(5));
    let outcome = stores.records().write(write.clone()).await.unwrap();
    assert_eq!(outcome, WriteOutcome::Written(write.clone().into_record(1)));
    stores.close().await;

    let stores = SqliteStores::open(dir.path()).await.unwrap();
    assert_eq!(stores.links().list().await.unwrap(), vec![link]);
    assert_eq!(
        stores.records().write(write.clone()).await.unwrap(),
        WriteOutcome::AlreadyApplied(write.into_record(1))
    );
    stores.close().await;
}

/// The migration history of `path` as sqlx recorded it: version, description, success, checksum.
async fn migration_history(path: &std::path::Path) -> Vec<(i64, String, bool, Vec<u8>)> {
    let options = sqlx::sqlite::SqliteConnectOptions::new().filename(path);
    let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
    let rows = sqlx::query_as(
        "SELECT version, description, success, checksum FROM _sqlx_migrations ORDER BY version",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    pool.close().await;
    rows
}

/// A data directory whose databases sqlx's migrator made (as every release before the rusqlite
/// driver did) opens unchanged, and databases this build makes record their migrations exactly as
/// sqlx would: the same history rows, and sqlx's migrator finds nothing to apply or refuse in them.
#[tokio::test]
async fn migration_histories_are_those_sqlx_wrote() {
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let worker = agent("worker");
    // Written the old way: every migration through sqlx, then a task.
    let old = tempfile::tempdir().unwrap();
    let old_agent = old.path().join("agents/worker/data/spacebot.db");
    for (dir, path) in [
        ("migrations_instance", old.path().join("instance.db")),
        ("migrations", old_agent.clone()),
    ] {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let options = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
        let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
        let migrator = sqlx::migrate::Migrator::new(manifest.join(dir))
            .await
            .unwrap();
        migrator.run(&pool).await.unwrap();
        pool.close().await;
    }
    let stores = open_per_agent(old.path()).await;
    let task = stores
        .tasks()
        .create(&worker, NewTask::new("kept", ""), Timestamp(1))
        .await
        .unwrap();
    stores.close().await;
    let stores = open_per_agent(old.path()).await;
    assert_eq!(stores.tasks().get(&worker, 1).await.unwrap(), Some(task));
    stores.close().await;

    // Written by this build.
    let new = tempfile::tempdir().unwrap();
    let stores = open_per_agent(new.path()).await;
    stores
        .tasks()
        .create(&worker, NewTask::new("new", ""), Timestamp(1))
        .await
        .unwrap();
    stores.close().await;
    let new_agent = new.path().join("agents/worker/data/spacebot.db");
    for (dir, old_path, new_path) in [
        (
            "migrations_instance",
            old.path().join("instance.db"),
            new.path().join("instance.db"),
        ),
        ("migrations", old_agent.clone(), new_agent.clone()),
    ] {
        let history = migration_history(&new_path).await;
        assert_eq!(history, migration_history(&old_path).await, "{dir}");
        assert_eq!(
            history.len(),
            std::fs::read_dir(manifest.join(dir)).unwrap().count()
        );
        // sqlx's migrator (what the releases before ran at open) accepts the file as it is.
        let options = sqlx::sqlite::SqliteConnectOptions::new().filename(&new_path);
        let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
        let migrator = sqlx::migrate::Migrator::new(manifest.join(dir))
            .await
            .unwrap();
        migrator.run(&pool).await.unwrap();
        pool.close().await;
        assert_eq!(migration_history(&new_path).await, history, "{dir}");
    }
}
