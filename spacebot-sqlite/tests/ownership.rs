//! One data directory, one owner: a second open, from this process or another, is refused with an
//! error naming the directory and the holder's pid, until the owner closes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::Duration;

use spacebot_core::task::TaskFilter;
use spacebot_core::{AgentId, NewTask, StoreError, TaskStore, Timestamp};
use spacebot_sqlite::SqliteStores;

const CHILD_ENV: &str = "SPACEBOT_SQLITE_OWNER_CHILD_DIR";

fn agent(id: &str) -> AgentId {
    AgentId::parse(id).unwrap()
}

#[track_caller]
fn assert_refused(err: &StoreError, dir: &Path, pid: u32) {
    assert!(matches!(err, StoreError::Backend { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains(&dir.display().to_string()), "{text}");
    assert!(
        text.contains(&format!("pid {pid}")) || text.contains(&format!("process {pid}")),
        "{text}"
    );
    assert!(text.contains("already open"), "{text}");
}

#[tokio::test]
async fn a_second_open_in_this_process_is_refused_until_the_first_closes() {
    let dir = tempfile::tempdir().unwrap();
    let first = SqliteStores::open(dir.path()).await.unwrap();
    first
        .tasks()
        .create(&agent("w"), NewTask::new("kept", ""), Timestamp(1))
        .await
        .unwrap();

    let err = SqliteStores::open(dir.path()).await.unwrap_err();
    assert_refused(&err, dir.path(), std::process::id());
    assert!(err.to_string().contains("this process"), "{err}");
    // The refused open did not disturb the owner.
    let listed = first
        .tasks()
        .list(&agent("w"), &TaskFilter::default())
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);

    // A clone is the same owner; closing any clone releases the directory.
    let clone = first.clone();
    clone.close().await;
    let err = first
        .tasks()
        .create(&agent("other"), NewTask::new("late", ""), Timestamp(2))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Backend { .. }), "{err:?}");
    assert!(!dir.path().join("agents/other").exists());

    let second = SqliteStores::open(dir.path()).await.unwrap();
    let listed = second
        .tasks()
        .list(&agent("w"), &TaskFilter::default())
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    // Dropping the last clone releases the directory too.
    drop(second);
    drop(first);
    let third = SqliteStores::open(dir.path()).await.unwrap();
    third.close().await;
}

#[tokio::test]
async fn temporary_and_in_memory_stores_take_no_lock() {
    let a = SqliteStores::in_memory().await.unwrap();
    let b = SqliteStores::in_memory().await.unwrap();
    let t = SqliteStores::temporary().await.unwrap();
    assert!(!t.dir().unwrap().join("spacebot.lock").exists());
    a.close().await;
    b.close().await;
    t.close().await;
}

/// Holds the directory named by [`CHILD_ENV`] open, says `ready`, and closes it when its standard
/// input ends. Runs as the child process of
/// [`another_process_cannot_open_a_directory_this_one_owns`]; does nothing otherwise.
#[tokio::test]
#[ignore = "the child process of another_process_cannot_open_a_directory_this_one_owns"]
async fn owner_child() {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        return;
    };
    let stores = SqliteStores::open(&dir).await.unwrap();
    println!("ready {}", std::process::id());
    let mut rest = Vec::new();
    std::io::stdin().read_to_end(&mut rest).unwrap();
    stores.close().await;
    println!("released");
}

/// Starts [`owner_child`] on `dir`; its output lines arrive on the receiver.
fn spawn_owner(dir: &Path) -> (Child, Receiver<String>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "owner_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (lines_tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = lines_tx.send(line);
        }
    });
    (child, lines)
}

/// The first line from the child that says `word`, from that word on.
fn wait_for(lines: &Receiver<String>, word: &str) -> String {
    loop {
        let line = lines
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("the child never said {word:?}: {e}"));
        // libtest may print the test's name on the same line first.
        if let Some(at) = line.find(word) {
            return line[at..].to_string();
        }
    }
}

#[tokio::test]
async fn another_process_cannot_open_a_directory_this_one_owns() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, lines) = spawn_owner(dir.path());
    let ready = wait_for(&lines, "ready");
    assert_eq!(ready, format!("ready {}", child.id()));

    let err = SqliteStores::open(dir.path()).await.unwrap_err();
    assert_refused(&err, dir.path(), child.id());
    assert!(!err.to_string().contains("this process"), "{err}");

    drop(child.stdin.take()); // the child closes its stores
    wait_for(&lines, "released");
    assert!(child.wait().unwrap().success());
    let stores = SqliteStores::open(dir.path()).await.unwrap();
    stores.close().await;
}

#[tokio::test]
async fn a_killed_owner_does_not_keep_the_directory() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, lines) = spawn_owner(dir.path());
    wait_for(&lines, "ready");
    let err = SqliteStores::open(dir.path()).await.unwrap_err();
    assert_refused(&err, dir.path(), child.id());
    child.kill().unwrap(); // SIGKILL: the lock goes with the process
    child.wait().unwrap();
    let stores = SqliteStores::open(dir.path()).await.unwrap();
    stores.close().await;
}
