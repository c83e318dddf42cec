//! Crash safety: a child process runs a delegation workload on SQLite and is killed with SIGKILL
//! at random points; after each kill the stores are checked, and a last uninterrupted run must
//! finish the work with every task and every completion notice accounted for exactly once.
//!
//! The child is this test binary again, running [`crash_child_workload`] with
//! `SPACEBOT_SQLITE_CRASH_DIR` set. After each commit it appends a line to `journal.log` (one
//! `write` per line, which survives SIGKILL), so the parent knows what was acknowledged. It runs in
//! each layout (`SPACEBOT_SQLITE_CRASH_LAYOUT`): the organization's one database, and one
//! database per agent.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use spacebot_core::channel::NewRecord;
use spacebot_core::task::{TaskEvent, TaskFilter};
use spacebot_core::{
    AgentId, ChannelId, ChannelStore, DeliveryStore, Envelope, EnvelopeKind, NewTask, RecordKind,
    Source, TaskStatus, TaskStore, Timestamp,
};
use spacebot_sqlite::{Layout, SqliteOptions, SqliteStores};

const CHILD_ENV: &str = "SPACEBOT_SQLITE_CRASH_DIR";
const LAYOUT_ENV: &str = "SPACEBOT_SQLITE_CRASH_LAYOUT";

fn layout_name(layout: Layout) -> &'static str {
    match layout {
        Layout::PerAgent => "per_agent",
        _ => "organization",
    }
}

/// Opens the stores under `dir` in `layout`.
async fn open(dir: &Path, layout: Layout) -> SqliteStores {
    SqliteOptions::new().layout(layout).open(dir).await.unwrap()
}
const TASKS: usize = 300;
const KILLS: usize = 10;

fn boss() -> AgentId {
    AgentId::parse("boss").unwrap()
}

fn worker() -> AgentId {
    AgentId::parse("worker").unwrap()
}

fn title(i: usize) -> String {
    format!("job-{i:03}")
}

fn journal(dir: &Path, line: &str) {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("journal.log"))
        .unwrap();
    file.write_all(format!("{line}\n").as_bytes()).unwrap();
}

/// Complete lines of the journal, split into words.
fn read_journal(dir: &Path) -> Vec<Vec<String>> {
    let text = std::fs::read_to_string(dir.join("journal.log")).unwrap_or_default();
    let complete = match text.rfind('\n') {
        Some(end) => &text[..=end],
        None => "",
    };
    complete
        .lines()
        .map(|l| l.split(' ').map(str::to_string).collect())
        .collect()
}

/// The workload: delegate, claim, complete, deliver notices, apply them. Resumes from whatever
/// the stores hold, so every run continues where the killed one stopped.
#[tokio::test]
#[ignore = "the child process of sigkill_at_random_points_loses_and_duplicates_nothing"]
async fn crash_child_workload() {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        return;
    };
    let dir = Path::new(&dir);
    let layout = match std::env::var(LAYOUT_ENV).as_deref() {
        Ok("per_agent") => Layout::PerAgent,
        _ => Layout::Organization,
    };
    let stores = open(&dir.join("data"), layout).await;
    let (tasks, deliveries, channels) = (stores.tasks(), stores.deliveries(), stores.channels());
    let (boss, worker) = (boss(), worker());
    let holder = format!("worker-{}", std::process::id());
    let origin = ChannelId::portal(&boss);
    loop {
        let now = Timestamp::now_utc();
        // Delegate the next few jobs that are not on the board yet.
        let board = tasks.list(&worker, &TaskFilter::default()).await.unwrap();
        let existing: BTreeSet<String> = board.iter().map(|t| t.title.clone()).collect();
        for i in (0..TASKS)
            .filter(|i| !existing.contains(&title(*i)))
            .take(4)
        {
            let mut new = NewTask::new(title(i), "count the stars");
            new.created_by = format!("agent:{boss}");
            new.metadata.delegated_by = Some(boss.clone());
            new.metadata.originating_channel = Some(origin.clone());
            new.max_attempts = 1_000;
            let task = tasks.create(&worker, new, now).await.unwrap();
            journal(dir, &format!("created {} {}", task.number, task.title));
        }
        tasks.requeue_expired(&worker, now).await.unwrap();
        // Work: claim and complete a few.
        for _ in 0..3 {
            let Some(task) = tasks
                .claim_next(&worker, &holder, Duration::from_secs(30), now)
                .await
                .unwrap()
            else {
                break;
            };
            let done = tasks
                .transition(
                    &worker,
                    task.number,
                    spacebot_core::task::Expect::any(),
                    TaskEvent::Complete {
                        holder: holder.clone(),
                        result: format!("result of {}", task.title),
                    },
                    Timestamp::now_utc(),
                )
                .await
                .unwrap();
            assert!(done.notice.is_some());
            journal(dir, &format!("done {}", task.number));
        }
        // Deliver notices: persist for the (not running) delegator, then mark sent.
        for notice in tasks.outbox_pending(&worker).await.unwrap() {
            let envelope = Envelope::new(
                Source::Internal {
                    from_agent: worker.clone(),
                    link_id: None,
                },
                origin.clone(),
                EnvelopeKind::Retrigger,
                format!("{} ended: {}", notice.task, notice.outcome),
                Timestamp::now_utc(),
            )
            .with_idempotency_key(notice.key.clone());
            deliveries.persist(&boss, &envelope).await.unwrap();
            tasks.outbox_mark_sent(&worker, &notice.key).await.unwrap();
            journal(dir, &format!("sent {}", notice.key));
        }
        // The delegator applies what was delivered, each key once.
        for envelope in deliveries.pending(&boss).await.unwrap() {
            let key = envelope.idempotency_key.clone().unwrap();
            if deliveries
                .mark_applied(&boss, &key, Timestamp::now_utc())
                .await
                .unwrap()
            {
                journal(dir, &format!("applied {key}"));
                channels
                    .append(
                        &boss,
                        NewRecord::new(
                            origin.clone(),
                            RecordKind::System,
                            "system",
                            format!("applied {key}"),
                            Timestamp::now_utc(),
                        ),
                    )
                    .await
                    .unwrap();
            }
            deliveries.remove(&boss, &envelope.id).await.unwrap();
        }
        let board = tasks.list(&worker, &TaskFilter::default()).await.unwrap();
        let finished = board.len() == TASKS
            && board.iter().all(|t| t.status == TaskStatus::Done)
            && tasks.outbox_pending(&worker).await.unwrap().is_empty()
            && deliveries.pending(&boss).await.unwrap().is_empty();
        if finished {
            break;
        }
    }
    stores.close().await;
}

fn spawn_child(dir: &Path, layout: Layout) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "crash_child_workload",
            "--ignored",
            "--exact",
            "--test-threads=1",
            "--quiet",
        ])
        .env(CHILD_ENV, dir)
        .env(LAYOUT_ENV, layout_name(layout))
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

/// What the parent checks after every kill, and returns: the board by number.
async fn check_after_restart(
    dir: &Path,
    round: usize,
    layout: Layout,
) -> BTreeMap<u64, (String, TaskStatus)> {
    let stores = open(&dir.join("data"), layout).await;
    let tasks = stores.tasks();
    let (boss, worker) = (boss(), worker());
    let board = tasks.list(&worker, &TaskFilter::default()).await.unwrap();

    // No task duplicated, numbers without gaps.
    let numbers: Vec<u64> = board.iter().map(|t| t.number).collect();
    assert_eq!(
        numbers,
        (1..=board.len() as u64).collect::<Vec<_>>(),
        "round {round}"
    );
    let titles: BTreeSet<&str> = board.iter().map(|t| t.title.as_str()).collect();
    assert_eq!(
        titles.len(),
        board.len(),
        "round {round}: a job was delegated twice"
    );

    // No acknowledged write lost.
    let by_number: BTreeMap<u64, (String, TaskStatus)> = board
        .iter()
        .map(|t| (t.number, (t.title.clone(), t.status)))
        .collect();
    let outbox: BTreeSet<String> = tasks
        .outbox_pending(&worker)
        .await
        .unwrap()
        .into_iter()
        .map(|n| n.key)
        .collect();
    for line in read_journal(dir) {
        match line[0].as_str() {
            "created" => {
                let n: u64 = line[1].parse().unwrap();
                let stored = by_number.get(&n).map(|t| t.0.as_str());
                assert_eq!(stored, Some(line[2].as_str()), "round {round}: task {n}");
            }
            "done" => {
                let n: u64 = line[1].parse().unwrap();
                assert_eq!(by_number[&n].1, TaskStatus::Done, "round {round}: task {n}");
            }
            "sent" => assert!(
                !outbox.contains(&line[1]),
                "round {round}: {} was sent but is pending again",
                line[1]
            ),
            "applied" => assert!(
                applied_keys(dir, layout).await.contains(&line[1]),
                "round {round}: {} was applied but is not marked",
                line[1]
            ),
            other => panic!("unknown journal line {other}"),
        }
    }
    // Every done task has its notice: in the outbox, waiting at the delegator, or applied.
    let delivered: BTreeSet<String> = stores
        .deliveries()
        .pending(&boss)
        .await
        .unwrap()
        .into_iter()
        .filter_map(|e| e.idempotency_key)
        .collect();
    let applied = applied_keys(dir, layout).await;
    for t in board.iter().filter(|t| t.status == TaskStatus::Done) {
        let key = format!("{worker}#{}:done", t.number);
        assert!(
            outbox.contains(&key) || delivered.contains(&key) || applied.contains(&key),
            "round {round}: the notice of {key} is lost"
        );
    }

    // Expired leases (the dead worker's) go back to ready.
    let in_progress: Vec<u64> = board
        .iter()
        .filter(|t| t.status == TaskStatus::InProgress)
        .map(|t| t.number)
        .collect();
    let later = Timestamp::now_utc().plus(Duration::from_secs(3_600));
    let requeued = tasks.requeue_expired(&worker, later).await.unwrap();
    let requeued_numbers: Vec<u64> = requeued.iter().map(|t| t.task.number).collect();
    assert_eq!(requeued_numbers, in_progress, "round {round}");
    assert!(requeued.iter().all(|t| t.task.status == TaskStatus::Ready));
    stores.close().await;
    by_number
}

/// The keys the delegator has marked applied, read straight from the database file that holds
/// them (the trait's only probe, `mark_applied`, would mark them).
async fn applied_keys(dir: &Path, layout: Layout) -> BTreeSet<String> {
    use sqlx::Connection;
    let (path, agent) = match layout {
        Layout::PerAgent => (dir.join("data/agents/boss/data/spacebot.db"), ""),
        _ => (dir.join("data/instance.db"), "boss"),
    };
    if !path.exists() {
        return BTreeSet::new();
    }
    let options = sqlx::sqlite::SqliteConnectOptions::new().filename(&path);
    let mut conn = sqlx::SqliteConnection::connect_with(&options)
        .await
        .unwrap();
    let keys: Vec<String> = sqlx::query_scalar("SELECT key FROM applied_keys WHERE agent = ?")
        .bind(agent)
        .fetch_all(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    keys.into_iter().collect()
}

/// How many times the journal says each key was applied.
fn journal_applied(dir: &Path) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for line in read_journal(dir) {
        if line[0] == "applied" {
            *out.entry(line[1].clone()).or_insert(0) += 1;
        }
    }
    out
}

#[tokio::test]
async fn sigkill_at_random_points_loses_and_duplicates_nothing() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    sigkill_at_random_points(Layout::Organization).await;
}

/// As above, in the per-agent layout.
#[tokio::test]
async fn sigkill_at_random_points_loses_and_duplicates_nothing_per_agent() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    sigkill_at_random_points(Layout::PerAgent).await;
}

async fn sigkill_at_random_points(layout: Layout) {
    let dir = tempfile::tempdir().unwrap();
    let seed = fastrand::u64(..);
    eprintln!("crash test seed {seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut previous: BTreeMap<u64, (String, TaskStatus)> = BTreeMap::new();
    let mut kills = 0;
    for round in 0..KILLS {
        let mut child = spawn_child(dir.path(), layout);
        tokio::time::sleep(Duration::from_millis(rng.u64(30..300))).await;
        let finished_early = child.try_wait().unwrap().is_some();
        child.kill().unwrap(); // SIGKILL
        let status = child.wait().unwrap();
        if finished_early {
            assert!(
                status.success(),
                "round {round}: the workload failed: {status}"
            );
            break;
        }
        kills += 1;
        let board = check_after_restart(dir.path(), round, layout).await;
        let done = board.values().filter(|t| t.1 == TaskStatus::Done).count();
        eprintln!(
            "round {round}: killed with {} tasks, {done} done",
            board.len()
        );
        // Nothing that existed before is gone; nothing done is undone.
        for (n, (title, status)) in &previous {
            let now = &board[n];
            assert_eq!(&now.0, title, "round {round}: task {n} changed");
            if *status == TaskStatus::Done {
                assert_eq!(now.1, TaskStatus::Done, "round {round}: task {n} undone");
            }
        }
        previous = board;
    }
    assert!(
        kills >= 3,
        "only {kills} kills landed before the workload finished"
    );

    // A last run without interruption finishes the work.
    let mut child = spawn_child(dir.path(), layout);
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the final run did not finish"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "the final run failed: {status}");

    let stores = open(&dir.path().join("data"), layout).await;
    assert_eq!(stores.layout(), layout);
    let (boss, worker) = (boss(), worker());
    let board = stores
        .tasks()
        .list(&worker, &TaskFilter::default())
        .await
        .unwrap();
    // Every job exactly once.
    assert_eq!(board.len(), TASKS);
    let titles: BTreeSet<String> = board.iter().map(|t| t.title.clone()).collect();
    assert_eq!(titles, (0..TASKS).map(title).collect::<BTreeSet<_>>());
    assert!(board.iter().all(|t| t.status == TaskStatus::Done));
    assert!(
        stores
            .tasks()
            .outbox_pending(&worker)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(stores.deliveries().pending(&boss).await.unwrap().is_empty());
    // Every notice applied: its key is marked (a probe mark is refused)...
    for t in &board {
        let key = format!("{worker}#{}:done", t.number);
        assert!(
            !stores
                .deliveries()
                .mark_applied(&boss, &key, Timestamp::now_utc())
                .await
                .unwrap(),
            "{key} was never applied"
        );
    }
    // ...and never twice: the journal and the delegator's channel name each key at most once.
    let applied = journal_applied(dir.path());
    assert!(
        applied.values().all(|n| *n == 1),
        "applied twice: {applied:?}"
    );
    let history = stores
        .channels()
        .history(&boss, &ChannelId::portal(&boss), None)
        .await
        .unwrap();
    let mut seen = BTreeSet::new();
    for record in &history {
        assert!(
            seen.insert(record.record.content.clone()),
            "{} twice",
            record.record.content
        );
    }
    assert!(history.len() <= TASKS);
    assert!(
        applied.len() >= TASKS - kills,
        "most applications are journaled"
    );
    stores.close().await;
}
