//! Crash safety: a child process runs a delegation workload on redb and is killed with SIGKILL at
//! random points, several times. After each kill: no task lost or duplicated, expired leases go
//! back to ready, and every completion notice is delivered and applied exactly once.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test helpers fail loudly

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use spacebot_core::channel::ChannelStore;
use spacebot_core::envelope::{DeliveryStore, Envelope, EnvelopeKind, Source};
use spacebot_core::task::{Expect, NewTask, TaskEvent, TaskFilter, TaskStatus, TaskStore};
use spacebot_core::{AgentId, ChannelId, EnvelopeId, StoreError, Timestamp};
use spacebot_redb::{RedbOptions, RedbStore};

const CHILD_ENV: &str = "SPACEBOT_REDB_CRASH_DIR";
const LEASE: Duration = Duration::from_millis(300);

fn worker() -> AgentId {
    AgentId::parse("worker").unwrap()
}

fn boss() -> AgentId {
    AgentId::parse("boss").unwrap()
}

fn job_index(title: &str) -> u64 {
    title.strip_prefix("job-").unwrap().parse().unwrap()
}

/// Hands every pending notice of the worker to the boss: persist (idempotent by envelope id),
/// apply (once, by key), then mark sent. Returns the keys this call applied.
async fn deliver(s: &RedbStore, now: Timestamp) -> Result<Vec<String>, StoreError> {
    let mut applied = Vec::new();
    for notice in TaskStore::outbox_pending(s, &worker()).await? {
        let envelope = Envelope {
            id: EnvelopeId::new(format!("notice:{}", notice.key)),
            ..Envelope::new(
                Source::Internal {
                    from_agent: worker(),
                    link_id: None,
                },
                ChannelId::portal(&boss()),
                EnvelopeKind::Retrigger,
                notice.outcome.clone(),
                now,
            )
        }
        .with_idempotency_key(notice.key.clone());
        s.persist(&boss(), &envelope).await?;
        if s.mark_applied(&boss(), &notice.key, now).await? {
            applied.push(notice.key.clone());
        }
        s.outbox_mark_sent(&worker(), &notice.key).await?;
    }
    Ok(applied)
}

/// The child: runs until killed, printing what the store acknowledged.
#[test]
fn crash_child() {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let s = RedbStore::open(&dir, RedbOptions::default()).unwrap();
        let existing = TaskStore::list(&*s, &worker(), &TaskFilter::default())
            .await
            .unwrap();
        let next = Arc::new(AtomicU64::new(
            existing
                .iter()
                .map(|t| job_index(&t.title) + 1)
                .max()
                .unwrap_or(0),
        ));
        let mut loops = Vec::new();
        for k in 0..3 {
            let s = s.clone();
            let next = next.clone();
            loops.push(tokio::spawn(async move {
                let holder = format!("w{k}-{}", std::process::id());
                for round in 0u64.. {
                    let now = Timestamp::now_utc();
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let mut new = NewTask::new(format!("job-{i}"), "work");
                    new.metadata.delegated_by = Some(boss());
                    new.metadata.originating_channel = Some(ChannelId::portal(&boss()));
                    let task = s.create(&worker(), new, now).await.unwrap();
                    say(&format!("created {i} {}", task.number));
                    if let Some(t) = s.claim_next(&worker(), &holder, LEASE, now).await.unwrap() {
                        if (round + k) % 5 == 0 {
                            // Walk away: the lease must expire and the task come back.
                            say(&format!("abandoned {}", t.number));
                        } else {
                            let done = s
                                .transition(
                                    &worker(),
                                    t.number,
                                    Expect {
                                        status: Some(TaskStatus::InProgress),
                                        revision: Some(t.revision),
                                    },
                                    TaskEvent::Complete {
                                        holder: holder.clone(),
                                        result: format!("r{}", t.number),
                                    },
                                    Timestamp::now_utc(),
                                )
                                .await;
                            match done {
                                Ok(_) | Err(StoreError::Conflict { .. }) => {}
                                Err(e) => panic!("complete failed: {e}"),
                            }
                        }
                    }
                    s.requeue_expired(&worker(), Timestamp::now_utc())
                        .await
                        .unwrap();
                    for key in deliver(&s, Timestamp::now_utc()).await.unwrap() {
                        say(&format!("applied {key}"));
                    }
                }
            }));
        }
        for l in loops {
            l.await.unwrap();
        }
    });
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

#[derive(Default)]
struct Log {
    /// Job index -> task number, as acknowledged.
    created: BTreeMap<u64, u64>,
    /// Applied key -> how many times a child saw `mark_applied` return true.
    applied: BTreeMap<String, u32>,
}

fn run_child(dir: &Path, log: &mut Log, run_for: Duration) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<String>>()
    });
    std::thread::sleep(run_for);
    assert!(
        child.try_wait().unwrap().is_none(),
        "the child stopped on its own"
    );
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    for line in reader.join().unwrap() {
        let parts: Vec<&str> = line.split(' ').collect();
        match parts.as_slice() {
            ["created", i, n] => {
                let previous = log.created.insert(i.parse().unwrap(), n.parse().unwrap());
                assert!(previous.is_none(), "job {i} acknowledged twice");
            }
            ["applied", key] => *log.applied.entry((*key).to_string()).or_default() += 1,
            _ => {}
        }
    }
}

/// Checks the board after a kill; requeues every lease (as a restart long after the crash would).
async fn check_after_kill(dir: &Path, log: &Log, round: usize) -> usize {
    let s = RedbStore::open(dir, RedbOptions::default()).unwrap();
    let tasks = TaskStore::list(&*s, &worker(), &TaskFilter::default())
        .await
        .unwrap();
    // Numbered 1..=n, no gap, no duplicate job.
    assert_eq!(
        tasks.iter().map(|t| t.number).collect::<Vec<_>>(),
        (1..=tasks.len() as u64).collect::<Vec<_>>(),
        "round {round}: task numbers have gaps"
    );
    let by_job: BTreeMap<u64, u64> = tasks
        .iter()
        .map(|t| (job_index(&t.title), t.number))
        .collect();
    assert_eq!(
        by_job.len(),
        tasks.len(),
        "round {round}: a job was stored twice"
    );
    for (job, number) in &log.created {
        assert_eq!(
            by_job.get(job),
            Some(number),
            "round {round}: acknowledged job {job} lost"
        );
    }
    // Every applied key was applied once.
    for (key, times) in &log.applied {
        assert_eq!(*times, 1, "round {round}: {key} applied {times} times");
    }
    // Every notice of an ended task is still in the outbox, or was delivered and applied.
    let outbox: BTreeSet<String> = TaskStore::outbox_pending(&*s, &worker())
        .await
        .unwrap()
        .into_iter()
        .map(|n| n.key)
        .collect();
    let delivered: BTreeSet<String> = s
        .pending(&boss())
        .await
        .unwrap()
        .into_iter()
        .filter_map(|e| e.idempotency_key)
        .collect();
    let now = Timestamp::now_utc();
    for t in tasks.iter().filter(|t| t.status.is_terminal()) {
        let key = format!("worker#{}:{}", t.number, t.status);
        if !outbox.contains(&key) {
            assert!(delivered.contains(&key), "round {round}: notice {key} lost");
            assert!(
                !s.mark_applied(&boss(), &key, now).await.unwrap(),
                "round {round}: notice {key} was marked sent but never applied"
            );
        }
    }
    // Expired leases come back: long after the crash, no task stays in progress.
    let later = now.plus(Duration::from_secs(3600));
    let in_progress = tasks
        .iter()
        .filter(|t| t.status == TaskStatus::InProgress)
        .count();
    let requeued = s.requeue_expired(&worker(), later).await.unwrap();
    assert_eq!(requeued.len(), in_progress, "round {round}");
    let after = TaskStore::list(
        &*s,
        &worker(),
        &TaskFilter {
            statuses: vec![TaskStatus::InProgress],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert!(after.is_empty(), "round {round}: leases survived requeue");
    s.close().await;
    tasks.len()
}

#[test]
fn killed_at_random_points_loses_and_duplicates_nothing() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut log = Log::default();
    let mut sizes = Vec::new();
    for round in 0..12 {
        run_child(
            dir.path(),
            &mut log,
            Duration::from_millis(fastrand::u64(200..900)),
        );
        sizes.push(rt.block_on(check_after_kill(dir.path(), &log, round)));
    }
    eprintln!(
        "tasks after each kill: {sizes:?}, notices applied: {}",
        log.applied.len()
    );
    assert!(log.created.len() > 20, "the workload barely ran: {sizes:?}");
    assert!(!log.applied.is_empty(), "no notice was ever applied");

    // Finish the work and deliver everything, then every task's notice is applied exactly once.
    rt.block_on(async {
        let s = RedbStore::open(dir.path(), RedbOptions::default()).unwrap();
        let now = Timestamp::now_utc().plus(Duration::from_secs(7200));
        s.requeue_expired(&worker(), now).await.unwrap();
        while let Some(t) = s.claim_next(&worker(), "final", LEASE, now).await.unwrap() {
            s.transition(
                &worker(),
                t.number,
                Expect::any(),
                TaskEvent::Complete {
                    holder: "final".into(),
                    result: "late".into(),
                },
                now,
            )
            .await
            .unwrap();
        }
        for key in deliver(&s, now).await.unwrap() {
            *log.applied.entry(key).or_default() += 1;
        }
        let tasks = TaskStore::list(&*s, &worker(), &TaskFilter::default())
            .await
            .unwrap();
        assert!(tasks.iter().all(|t| t.status.is_terminal()));
        assert!(
            TaskStore::outbox_pending(&*s, &worker())
                .await
                .unwrap()
                .is_empty()
        );
        let envelopes = s.pending(&boss()).await.unwrap();
        let mut per_key: BTreeMap<String, u32> = BTreeMap::new();
        for e in &envelopes {
            *per_key
                .entry(e.idempotency_key.clone().unwrap())
                .or_default() += 1;
        }
        for t in &tasks {
            let key = format!("worker#{}:{}", t.number, t.status);
            assert_eq!(
                per_key.get(&key),
                Some(&1),
                "{key} delivered {:?} times",
                per_key.get(&key)
            );
            assert!(
                !s.mark_applied(&boss(), &key, now).await.unwrap(),
                "{key} never applied"
            );
            assert!(
                log.applied.get(&key).copied().unwrap_or(0) <= 1,
                "{key} applied twice"
            );
        }
        assert_eq!(envelopes.len(), tasks.len());
        // Nothing else was written to the boss's history by the workload.
        assert!(s.channels(&boss()).await.unwrap().is_empty());
        s.close().await;
    });
}
