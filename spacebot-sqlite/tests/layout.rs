//! The two layouts of a data directory: the organization's one database (the default) and one
//! database per agent; the layout a directory records; the migration of a per-agent directory
//! (every directory written before layouts existed) into the organization's database.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{assert_same, copy_dir, snapshot};
use spacebot_core::channel::{ChannelRecord, NewRecord};
use spacebot_core::task::{CompletionNotice, Expect, TaskEvent, TaskFilter};
use spacebot_core::{
    AgentId, AgentLink, ChannelId, ChannelStore, DeliveryStore, Envelope, EnvelopeKind,
    LinkDirection, LinkRelationship, LinkStore, NewTask, RecordKind, Source, StoreError, Task,
    TaskStore, Timestamp,
};
use spacebot_sqlite::{Layout, SqliteOptions, SqliteStores};

fn agent(id: &str) -> AgentId {
    AgentId::parse(id).unwrap()
}

fn agents() -> Vec<AgentId> {
    ["alpha", "beta", "gamma"].into_iter().map(agent).collect()
}

async fn open(dir: &Path, layout: Layout) -> Result<SqliteStores, StoreError> {
    SqliteOptions::new().layout(layout).open(dir).await
}

/// Some of everything an agent's rows hold, different for each agent (`i`): tasks (one keyed,
/// one claimed, one completed by the worker with its notice sent, one completed with its notice
/// unsent), records on two channels and a channel without records, pending deliveries and applied
/// keys.
async fn fill(stores: &SqliteStores, who: &AgentId, i: i64) {
    let (tasks, channels, deliveries) = (stores.tasks(), stores.channels(), stores.deliveries());
    let boss = agent("boss");
    for n in 0..(4 + i) {
        let mut new = NewTask::new(format!("{who} job {n}"), "some \0 text ünïcode");
        new.metadata.delegated_by = Some(boss.clone());
        new.created_by = format!("agent:{boss}");
        if n == 1 {
            new = new.with_idempotency_key(format!("key-{who}"));
        }
        tasks.create(who, new, Timestamp(10 + n)).await.unwrap();
    }
    for n in 0..3 {
        let claimed = tasks
            .claim_next(who, "holder", Duration::from_secs(600), Timestamp(100))
            .await
            .unwrap()
            .unwrap();
        if n < 2 {
            let done = tasks
                .transition(
                    who,
                    claimed.number,
                    Expect::any(),
                    TaskEvent::Complete {
                        holder: "holder".into(),
                        result: format!("result {n}"),
                    },
                    Timestamp(200 + n),
                )
                .await
                .unwrap();
            if n == 0 {
                let key = done.notice.unwrap().key;
                tasks.outbox_mark_sent(who, &key).await.unwrap();
            }
        }
    }
    for n in 0..(5 + i) {
        let channel = if n % 2 == 0 {
            ChannelId::portal(who)
        } else {
            ChannelId::new(format!("side-{who}"))
        };
        channels
            .append(
                who,
                NewRecord::new(
                    channel,
                    RecordKind::User,
                    "user",
                    format!("{who} says {n}"),
                    Timestamp(300 + n),
                ),
            )
            .await
            .unwrap();
    }
    channels
        .ensure_channel(who, &ChannelId::new(format!("empty-{who}")))
        .await
        .unwrap();
    for n in 0..(2 + i) {
        let envelope = Envelope::new(
            Source::Internal {
                from_agent: boss.clone(),
                link_id: None,
            },
            ChannelId::portal(who),
            EnvelopeKind::Retrigger,
            format!("wake {who} {n}"),
            Timestamp(400 + n),
        )
        .with_idempotency_key(format!("wake-{who}-{n}"));
        deliveries.persist(who, &envelope).await.unwrap();
    }
    for n in 0..(3 + i) {
        deliveries
            .mark_applied(who, &format!("applied-{who}-{n}"), Timestamp(500 + n))
            .await
            .unwrap();
    }
}

/// What the stores say of one agent, through the public API.
#[derive(Debug, PartialEq)]
struct Seen {
    tasks: Vec<Task>,
    outbox: Vec<CompletionNotice>,
    channels: Vec<ChannelId>,
    histories: Vec<Vec<ChannelRecord>>,
    pending: Vec<Envelope>,
    applied: Vec<bool>,
}

async fn seen(stores: &SqliteStores, who: &AgentId) -> Seen {
    let channels = stores.channels().channels(who).await.unwrap();
    let mut histories = Vec::new();
    for channel in &channels {
        histories.push(stores.channels().history(who, channel, None).await.unwrap());
    }
    let mut applied = Vec::new();
    for n in 0..8 {
        applied.push(
            stores
                .deliveries()
                .is_applied(who, &format!("applied-{who}-{n}"))
                .await
                .unwrap(),
        );
    }
    Seen {
        tasks: stores
            .tasks()
            .list(who, &TaskFilter::default())
            .await
            .unwrap(),
        outbox: stores.tasks().outbox_pending(who).await.unwrap(),
        channels,
        histories,
        pending: stores.deliveries().pending(who).await.unwrap(),
        applied,
    }
}

fn link() -> AgentLink {
    AgentLink::new(
        agent("boss"),
        agent("alpha"),
        LinkDirection::OneWay,
        LinkRelationship::Superior,
        Timestamp(1),
    )
}

/// A closed per-agent directory holding every agent's rows and a link, with what the stores
/// said of each agent and the link.
async fn per_agent_dir() -> (tempfile::TempDir, BTreeMap<String, Seen>, AgentLink) {
    let dir = tempfile::tempdir().unwrap();
    let stores = open(dir.path(), Layout::PerAgent).await.unwrap();
    let link = link();
    stores.links().create(&link).await.unwrap();
    let mut before = BTreeMap::new();
    for (i, who) in agents().iter().enumerate() {
        fill(&stores, who, i64::try_from(i).unwrap()).await;
        before.insert(who.to_string(), seen(&stores, who).await);
    }
    stores.close().await;
    for who in agents() {
        assert!(
            dir.path()
                .join(format!("agents/{who}/data/spacebot.db"))
                .is_file()
        );
    }
    (dir, before, link)
}

#[tokio::test]
async fn a_new_directory_keeps_every_agent_in_one_file() {
    let dir = tempfile::tempdir().unwrap();
    let stores = SqliteStores::open(dir.path()).await.unwrap();
    assert_eq!(stores.layout(), Layout::Organization);
    let mut before = BTreeMap::new();
    for (i, who) in agents().iter().enumerate() {
        fill(&stores, who, i64::try_from(i).unwrap()).await;
        before.insert(who.to_string(), seen(&stores, who).await);
        assert_eq!(
            stores.agent_db_path(who),
            Some(dir.path().join("instance.db"))
        );
    }
    // One writer for every agent: their counters are the instance database's.
    assert_eq!(
        stores.agent_write_stats(&agent("alpha")),
        Some(stores.instance_write_stats())
    );
    stores.close().await;
    assert!(!dir.path().join("agents").exists(), "no per-agent files");
    // Each agent sees its own rows only, numbered from 1, and they survive a reopen.
    let stores = SqliteStores::open(dir.path()).await.unwrap();
    for who in agents() {
        let now = seen(&stores, &who).await;
        assert_eq!(now, before[who.as_str()], "{who}");
        let numbers: Vec<u64> = now.tasks.iter().map(|t| t.number).collect();
        assert_eq!(numbers, (1..=numbers.len() as u64).collect::<Vec<_>>());
        let mut seqs: Vec<u64> = now.histories.iter().flatten().map(|r| r.seq).collect();
        seqs.sort_unstable();
        assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>(), "{who}");
        assert!(now.tasks.iter().all(|t| t.agent == who));
    }
    stores.close().await;
}

#[tokio::test]
async fn a_per_agent_directory_is_migrated_whole_into_one_file() {
    let (dir, before, link) = per_agent_dir().await;
    let stores = SqliteStores::open(dir.path()).await.unwrap();
    assert_eq!(stores.layout(), Layout::Organization);
    assert_eq!(stores.links().list().await.unwrap(), vec![link]);
    for who in agents() {
        assert_eq!(seen(&stores, &who).await, before[who.as_str()], "{who}");
    }
    // The old files are kept aside, not read again.
    assert!(!dir.path().join("agents").exists());
    assert!(
        dir.path()
            .join("agents.migrated/alpha/data/spacebot.db")
            .is_file()
    );
    // Numbering goes on where each agent's stopped; a used key still finds its task.
    let alpha = agent("alpha");
    let last_task = before["alpha"].tasks.len() as u64;
    let task = stores
        .tasks()
        .create(&alpha, NewTask::new("after", ""), Timestamp(900))
        .await
        .unwrap();
    assert_eq!(task.number, last_task + 1);
    let keyed = stores
        .tasks()
        .create(
            &alpha,
            NewTask::new("again", "").with_idempotency_key("key-alpha"),
            Timestamp(901),
        )
        .await
        .unwrap();
    assert_eq!(keyed, before["alpha"].tasks[1]);
    let last_seq = before["alpha"]
        .histories
        .iter()
        .flatten()
        .map(|r| r.seq)
        .max()
        .unwrap();
    let record = stores
        .channels()
        .append(
            &alpha,
            NewRecord::new(
                ChannelId::portal(&alpha),
                RecordKind::User,
                "user",
                "after",
                Timestamp(902),
            ),
        )
        .await
        .unwrap();
    assert_eq!(record.seq, last_seq + 1);
    // A pending delivery already stored is not stored twice; the unsent notices are the same.
    let pending = before["beta"].pending[0].clone();
    stores
        .deliveries()
        .persist(&agent("beta"), &pending)
        .await
        .unwrap();
    assert_eq!(
        stores.deliveries().pending(&agent("beta")).await.unwrap(),
        before["beta"].pending
    );
    stores.close().await;
    // Opened again, nothing is migrated twice.
    let stores = SqliteStores::open(dir.path()).await.unwrap();
    for who in [agent("beta"), agent("gamma")] {
        assert_eq!(seen(&stores, &who).await, before[who.as_str()], "{who}");
    }
    assert_eq!(
        stores
            .tasks()
            .list(&alpha, &TaskFilter::default())
            .await
            .unwrap()
            .len() as u64,
        last_task + 1
    );
    stores.close().await;
}

/// A migration that stops half-way (here: the third agent's file is damaged, so its open is
/// refused after the first two agents were copied) leaves the directory in the per-agent
/// layout, the damaged file untouched; once the file is repaired the next open migrates every
/// agent exactly once.
#[tokio::test]
async fn a_migration_stopped_half_way_is_redone_whole_and_writes_no_damaged_file() {
    let (dir, before, _) = per_agent_dir().await;
    let gamma = dir.path().join("agents/gamma/data/spacebot.db");
    let pristine = std::fs::read(&gamma).unwrap();
    let mut damaged = pristine.clone();
    let len = damaged.len();
    damaged.truncate(len - 1);
    std::fs::write(&gamma, &damaged).unwrap();
    let agents_before: BTreeMap<PathBuf, Vec<u8>> = snapshot(&dir.path().join("agents"));

    let err = SqliteStores::open(dir.path()).await.unwrap_err();
    match &err {
        StoreError::Corrupt { location, .. } => assert_eq!(Path::new(location), gamma),
        other => panic!("expected Corrupt naming {}, got {other:?}", gamma.display()),
    }
    // Not one byte of the agents' files changed, the damaged one included; the directory still
    // opens in the per-agent layout, where alpha's rows are its own file's.
    assert_same(&snapshot(&dir.path().join("agents")), &agents_before);
    let stores = open(dir.path(), Layout::PerAgent).await.unwrap();
    assert_eq!(
        seen(&stores, &agent("alpha")).await,
        before["alpha"],
        "alpha in its own file"
    );
    stores.close().await;

    std::fs::write(&gamma, &pristine).unwrap();
    let stores = SqliteStores::open(dir.path()).await.unwrap();
    assert_eq!(stores.layout(), Layout::Organization);
    for who in agents() {
        assert_eq!(seen(&stores, &who).await, before[who.as_str()], "{who}");
    }
    stores.close().await;
}

/// A migration killed after its commit, before `agents/` was moved aside: the next open moves it
/// and copies nothing again.
#[tokio::test]
async fn agents_left_beside_a_migrated_directory_are_moved_aside_not_copied_again() {
    let (dir, before, _) = per_agent_dir().await;
    let stores = SqliteStores::open(dir.path()).await.unwrap();
    stores
        .tasks()
        .create(&agent("alpha"), NewTask::new("after", ""), Timestamp(900))
        .await
        .unwrap();
    stores.close().await;
    std::fs::rename(
        dir.path().join("agents.migrated"),
        dir.path().join("agents"),
    )
    .unwrap();
    let stores = SqliteStores::open(dir.path()).await.unwrap();
    let alpha = stores
        .tasks()
        .list(&agent("alpha"), &TaskFilter::default())
        .await
        .unwrap();
    assert_eq!(alpha.len(), before["alpha"].tasks.len() + 1);
    assert_eq!(alpha.last().unwrap().title, "after");
    stores.close().await;
    assert!(!dir.path().join("agents").exists());
    assert!(dir.path().join("agents.migrated").is_dir());
}

#[tokio::test]
async fn a_directory_in_one_file_is_refused_in_the_per_agent_layout_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let stores = SqliteStores::open(dir.path()).await.unwrap();
    fill(&stores, &agent("alpha"), 0).await;
    stores.close().await;
    let before = snapshot(dir.path());
    let err = open(dir.path(), Layout::PerAgent).await.unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("organization layout") && text.contains("Layout::Organization"),
        "{text}"
    );
    assert_same(&snapshot(dir.path()), &before);
    // The directory's lock was released: it opens at once in its own layout.
    let stores = SqliteStores::open(dir.path()).await.unwrap();
    assert_eq!(
        stores
            .tasks()
            .list(&agent("alpha"), &TaskFilter::default())
            .await
            .unwrap()
            .len(),
        4
    );
    stores.close().await;
}

#[tokio::test]
async fn a_per_agent_directory_stays_per_agent_when_asked() {
    let (dir, before, _) = per_agent_dir().await;
    let stores = open(dir.path(), Layout::PerAgent).await.unwrap();
    assert_eq!(stores.layout(), Layout::PerAgent);
    for who in agents() {
        assert_eq!(seen(&stores, &who).await, before[who.as_str()], "{who}");
    }
    stores.close().await;
    assert!(dir.path().join("agents/alpha/data/spacebot.db").is_file());
}

/// Copies the directory written by the release before layouts (see `tests/fixtures/README.md`)
/// into a new temporary directory.
fn release_dir() -> tempfile::TempDir {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/release_per_agent");
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture, dir.path());
    dir
}

/// A data directory as the release before layouts wrote it (agent and instance schema version
/// 2, one file per agent) opens in both layouts: migrated into one file by default, kept per
/// agent when asked, and both show every row that release wrote, exactly.
#[tokio::test]
async fn a_directory_written_by_the_release_before_layouts_opens_in_both_layouts() {
    let (migrated_dir, per_agent_dir) = (release_dir(), release_dir());
    let migrated = SqliteStores::open(migrated_dir.path()).await.unwrap();
    assert_eq!(migrated.layout(), Layout::Organization);
    assert!(migrated_dir.path().join("agents.migrated").is_dir());
    let per_agent = open(per_agent_dir.path(), Layout::PerAgent).await.unwrap();
    assert_eq!(per_agent.layout(), Layout::PerAgent);
    let links = migrated.links().list().await.unwrap();
    assert_eq!(links, per_agent.links().list().await.unwrap());
    for who in agents() {
        assert_eq!(
            seen(&migrated, &who).await,
            seen(&per_agent, &who).await,
            "{who}"
        );
    }
    check_release_rows(&migrated).await;
    check_release_rows(&per_agent).await;
    migrated.close().await;
    per_agent.close().await;
}

/// Checks that `stores` hold every row the release wrote into `tests/fixtures/release_per_agent`
/// (see its README), value by value, then that numbering goes on where that release stopped.
async fn check_release_rows(stores: &SqliteStores) {
    assert_eq!(stores.agents().await.unwrap(), agents());
    let links = stores.links().list().await.unwrap();
    assert_eq!(
        (links.len(), links[0].from.as_str(), links[0].to.as_str()),
        (1, "boss", "alpha")
    );
    for (i, who) in agents().iter().enumerate() {
        let seen = seen(stores, who).await;
        let i = u64::try_from(i).unwrap();
        let titles: Vec<String> = seen.tasks.iter().map(|t| t.title.clone()).collect();
        let expected: Vec<String> = (0..4 + i).map(|n| format!("{who} job {n}")).collect();
        assert_eq!(titles, expected);
        assert!(
            seen.tasks
                .iter()
                .all(|t| t.description == "some \0 text ünïcode")
        );
        let statuses: Vec<&str> = seen.tasks.iter().map(|t| t.status.as_str()).collect();
        assert_eq!(&statuses[..3], ["done", "done", "in_progress"], "{who}");
        assert!(statuses[3..].iter().all(|s| *s == "ready"), "{who}");
        assert_eq!(seen.tasks[0].result.as_deref(), Some("result 0"));
        assert_eq!(seen.outbox.len(), 1, "{who}: the second notice is unsent");
        assert_eq!(seen.outbox[0].key, format!("{who}#2:done"));
        assert_eq!(
            seen.channels,
            [
                ChannelId::new(format!("empty-{who}")),
                ChannelId::portal(who),
                ChannelId::new(format!("side-{who}")),
            ]
        );
        let mut records: Vec<(u64, String, serde_json::Value)> = seen
            .histories
            .iter()
            .flatten()
            .map(|r| {
                (
                    r.seq,
                    r.record.content.to_string(),
                    serde_json::Value::Object(r.record.metadata.clone()),
                )
            })
            .collect();
        records.sort_by_key(|r| r.0);
        let expected: Vec<(u64, String, serde_json::Value)> = (0..5 + i)
            .map(|n| {
                (
                    n + 1,
                    format!("{who} says {n}"),
                    serde_json::json!({ "n": n }),
                )
            })
            .collect();
        assert_eq!(records, expected, "{who}");
        let pending: Vec<String> = seen.pending.iter().map(|e| e.content.clone()).collect();
        let expected: Vec<String> = (0..2 + i).map(|n| format!("wake {who} {n}")).collect();
        assert_eq!(pending, expected, "{who}");
        let applied = usize::try_from(3 + i).unwrap();
        assert!(seen.applied[..applied].iter().all(|a| *a), "{who}");
        assert!(seen.applied[applied..].iter().all(|a| !*a), "{who}");
        let next = stores
            .tasks()
            .create(who, NewTask::new("next", ""), Timestamp(999))
            .await
            .unwrap();
        assert_eq!(next.number, 5 + i, "{who}");
    }
}

const MIGRATION_CHILD: &str = "SPACEBOT_SQLITE_MIGRATION_CHILD_DIR";

/// The child of [`a_migration_killed_anywhere_is_redone_whole`]: opens its directory with the
/// default options (migrating it), then says so.
#[tokio::test]
#[ignore = "the child process of a_migration_killed_anywhere_is_redone_whole"]
async fn migration_child() {
    let Ok(dir) = std::env::var(MIGRATION_CHILD) else {
        return;
    };
    let stores = SqliteStores::open(&dir).await.unwrap();
    println!("MIGRATED");
    stores.close().await;
}

/// The migration of the release's directory killed with SIGKILL at points spread over its run
/// (the child process opens it; the parent kills it after a delay that grows each round), then
/// opened again: every row is there once, whatever the point.
#[tokio::test]
async fn a_migration_killed_anywhere_is_redone_whole() {
    if std::env::var(MIGRATION_CHILD).is_ok() {
        return;
    }
    let spawn = |dir: &Path| {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args(["migration_child", "--ignored", "--exact", "--nocapture"])
            .env(MIGRATION_CHILD, dir)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap()
    };
    // How long a whole run takes here: the kills are spread over it.
    let dry = release_dir();
    let started = std::time::Instant::now();
    let output = spawn(dry.path()).wait_with_output().unwrap();
    let whole = started.elapsed();
    assert!(String::from_utf8_lossy(&output.stdout).contains("MIGRATED"));
    let stores = SqliteStores::open(dry.path()).await.unwrap();
    check_release_rows(&stores).await;
    stores.close().await;
    let rounds: u32 = 16;
    let mut killed_before_the_end = 0;
    let mut phases: BTreeMap<&str, u32> = BTreeMap::new();
    for round in 0..rounds {
        let dir = release_dir();
        let mut child = spawn(dir.path());
        std::thread::sleep(whole * round / rounds);
        child.kill().unwrap();
        let output = child.wait_with_output().unwrap();
        if !String::from_utf8_lossy(&output.stdout).contains("MIGRATED") {
            killed_before_the_end += 1;
        }
        // Where the kill landed: before the open touched the directory, inside the migration
        // (`instance.db` made, `agents/` still in place), or after it.
        let phase = match (
            dir.path().join("instance.db-wal").exists(),
            dir.path().join("agents").exists(),
        ) {
            (_, false) => "after",
            (true, true) => "inside",
            (false, true) => "before",
        };
        *phases.entry(phase).or_insert(0) += 1;
        let stores = SqliteStores::open(dir.path())
            .await
            .unwrap_or_else(|e| panic!("round {round}: the directory does not open: {e}"));
        assert_eq!(stores.layout(), Layout::Organization, "round {round}");
        check_release_rows(&stores).await;
        stores.close().await;
        assert!(!dir.path().join("agents").exists(), "round {round}");
    }
    eprintln!("kills by phase: {phases:?}");
    assert!(
        killed_before_the_end >= rounds / 2,
        "only {killed_before_the_end} of {rounds} kills landed before the migration ended"
    );
    assert!(
        phases.get("inside").copied().unwrap_or(0) >= 1,
        "no kill landed inside the migration: {phases:?}"
    );
}

/// `agents/` goes to `agents.migrated.1/` when `agents.migrated/` is taken; what was there stays.
#[tokio::test]
async fn a_taken_migrated_name_is_left_alone_and_the_next_is_used() {
    let (dir, before, _) = per_agent_dir().await;
    let taken = dir.path().join("agents.migrated");
    std::fs::create_dir(&taken).unwrap();
    std::fs::write(taken.join("mine.txt"), b"keep me").unwrap();
    let stores = SqliteStores::open(dir.path()).await.unwrap();
    for who in agents() {
        assert_eq!(seen(&stores, &who).await, before[who.as_str()], "{who}");
    }
    stores.close().await;
    assert_eq!(std::fs::read(taken.join("mine.txt")).unwrap(), b"keep me");
    assert!(!taken.join("alpha").exists());
    assert!(
        dir.path()
            .join("agents.migrated.1/alpha/data/spacebot.db")
            .is_file()
    );
    assert!(!dir.path().join("agents").exists());
}
