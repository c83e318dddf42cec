//! A full disk: the writes that need space fail, naming the file; once there is space again the
//! same stores write again (no reopening), and an agent's turns resume.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use spacebot_core::event::EventKind;
use spacebot_core::task::TaskFilter;
use spacebot_core::testing::{OrgHarness, ScriptedLlm};
use spacebot_core::{
    AgentId, DeliveryStore, InboundMessage, NewTask, StoreError, TaskStore, Timestamp,
};
use spacebot_sqlite::SqliteStores;

fn agent(id: &str) -> AgentId {
    AgentId::parse(id).unwrap()
}

#[tokio::test]
async fn after_a_full_disk_the_same_stores_write_again() {
    let dir = tempfile::tempdir().unwrap();
    let stores = SqliteStores::open(dir.path()).await.unwrap();
    let w = agent("worker");
    let tasks = stores.tasks();
    let create = |title: &str, size: usize| {
        tasks.create(&w, NewTask::new(title, "x".repeat(size)), Timestamp(1))
    };
    create("before", 10).await.unwrap();
    stores
        .cap_pages_for_testing(Some(&w), Some(0))
        .await
        .unwrap();
    let err = create("refused", 100_000).await.unwrap_err();
    assert!(matches!(err, StoreError::Backend { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("full"), "{text}");
    let file = stores.agent_db_path(&w).unwrap();
    assert!(text.contains(&file.display().to_string()), "{text}");
    // Still full: several writes at once fail too.
    let (a, b) = tokio::join!(create("refused too", 100_000), create("and this", 100_000));
    assert!(a.is_err() && b.is_err(), "{a:?} {b:?}");
    // Space is back: the same stores write, and nothing refused was kept.
    stores.cap_pages_for_testing(Some(&w), None).await.unwrap();
    assert_eq!(create("after", 100_000).await.unwrap().number, 2);
    let titles: Vec<String> = tasks
        .list(&w, &TaskFilter::default())
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.title)
        .collect();
    assert_eq!(titles, ["before", "after"]);
    drop(tasks);
    stores.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_turns_resume_after_a_full_disk() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = SqliteStores::open(dir.path()).await.unwrap();
    // Every answer is large: committing a turn needs new pages.
    let llm = Arc::new(
        ScriptedLlm::new()
            .with_fallback(|_| Ok(spacebot_core::llm::ChatResponse::text("y".repeat(200_000)))),
    );
    let mut h = OrgHarness::builder("[[agents]]\nid = \"a\"\nname = \"A\"\n")
        .stores(sqlite.stores())
        .llm(llm)
        .build()
        .await;
    h.org.start_all().await.unwrap();
    h.org
        .deliver("a", InboundMessage::new("portal", "u1", "first"))
        .await
        .unwrap();
    h.reply().await;
    h.wait_idle("a").await;

    // Room for the small envelope of the next message, not for the turn's answer.
    let a = agent("a");
    sqlite
        .cap_pages_for_testing(Some(&a), Some(2))
        .await
        .unwrap();
    h.org
        .deliver("a", InboundMessage::new("portal", "u1", "second"))
        .await
        .unwrap();
    h.wait_for("a turn commit that failed", |events| {
        events
            .iter()
            .any(|e| matches!(&e.kind, EventKind::Error { message } if message.contains("full")))
    })
    .await;
    // Space is back: the retried commit goes through on the same stores, and the next turn runs.
    sqlite.cap_pages_for_testing(Some(&a), None).await.unwrap();
    h.wait_until("the second message's turn committed", || async {
        sqlite.deliveries().pending(&a).await.unwrap().is_empty()
    })
    .await;
    h.org
        .deliver("a", InboundMessage::new("portal", "u1", "third"))
        .await
        .unwrap();
    h.wait_idle("a").await;
    assert!(sqlite.deliveries().pending(&a).await.unwrap().is_empty());
    let replies = h.replies_now();
    assert!(!replies.is_empty());
    h.org.shutdown().await.unwrap();
}
