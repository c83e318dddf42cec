//! One data directory, one owner: a second open, from this process or another, is refused with an
//! error naming the directory and the holder's pid, until the owner closes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::Duration;

use spacebot_core::StoreError;
use spacebot_redb::{RedbOptions, RedbStore};

const CHILD_ENV: &str = "SPACEBOT_REDB_OWNER_CHILD_DIR";

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

#[test]
fn a_second_open_in_this_process_is_refused_until_the_first_closes() {
    let dir = tempfile::tempdir().unwrap();
    let first = RedbStore::open(dir.path(), RedbOptions::default()).unwrap();
    let err = RedbStore::open(dir.path(), RedbOptions::default()).unwrap_err();
    assert_refused(&err, dir.path(), std::process::id());
    assert!(err.to_string().contains("this process"), "{err}");
    futures::executor::block_on(first.close());
    let second = RedbStore::open(dir.path(), RedbOptions::default()).unwrap();
    futures::executor::block_on(second.close());
}

/// Holds the directory named by [`CHILD_ENV`] open, says `ready`, and closes it when its standard
/// input ends. The child process of the tests below; does nothing otherwise.
#[test]
#[ignore = "the child process of another_process_cannot_open_a_directory_this_one_owns"]
fn owner_child() {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        return;
    };
    let store = RedbStore::open(&dir, RedbOptions::default()).unwrap();
    println!("ready {}", std::process::id());
    let mut rest = Vec::new();
    std::io::stdin().read_to_end(&mut rest).unwrap();
    futures::executor::block_on(store.close());
    println!("released");
}

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
        if let Some(at) = line.find(word) {
            return line[at..].to_string();
        }
    }
}

#[test]
fn another_process_cannot_open_a_directory_this_one_owns() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, lines) = spawn_owner(dir.path());
    assert_eq!(wait_for(&lines, "ready"), format!("ready {}", child.id()));
    let err = RedbStore::open(dir.path(), RedbOptions::default()).unwrap_err();
    assert_refused(&err, dir.path(), child.id());
    assert!(!err.to_string().contains("this process"), "{err}");
    drop(child.stdin.take());
    wait_for(&lines, "released");
    assert!(child.wait().unwrap().success());
    let store = RedbStore::open(dir.path(), RedbOptions::default()).unwrap();
    futures::executor::block_on(store.close());
}

/// An organization whose runtime ends without a shutdown (a process ending, a crash test) lets go
/// of its stores: its agent loops go with the runtime, and the directory opens again. Runs twice
/// on one directory, the second time waiting (up to 10 s) for the first owner's files to close.
#[test]
fn an_organization_dropped_with_its_runtime_releases_the_directory() {
    use futures::StreamExt;
    use spacebot_core::testing::FnLlm;
    use spacebot_core::{ChatResponse, InboundMessage, OrgConfig, Organization};
    use std::sync::Arc;
    use std::time::Instant;

    let dir = tempfile::tempdir().unwrap();
    let config = OrgConfig::from_toml_str(
        "[[agents]]\nid = \"a\"\nname = \"A\"\n[[agents]]\nid = \"b\"\nname = \"B\"\n",
    )
    .unwrap();
    for run in 0..2 {
        let started = Instant::now();
        let stores = loop {
            match spacebot_redb::open(dir.path()) {
                Ok(stores) => break stores,
                Err(e) if started.elapsed() < Duration::from_secs(10) => {
                    assert!(e.to_string().contains("already open"), "{e}");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("run {run}: the directory was not released: {e}"),
            }
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let org = Organization::builder(config.clone())
                .stores(stores)
                .llm(Arc::new(FnLlm::new(|_| Ok(ChatResponse::text("here")))))
                .build()
                .await
                .unwrap();
            org.start_all().await.unwrap();
            let mut replies = org.take_replies().unwrap();
            org.deliver("a", InboundMessage::new("portal", "u", "hi"))
                .await
                .unwrap();
            let reply = tokio::time::timeout(Duration::from_secs(10), replies.next())
                .await
                .expect("a reply")
                .expect("a reply");
            assert_eq!(reply.content, "here");
            // No shutdown: the agents' loops are still running when the runtime goes.
        });
        drop(rt);
    }
}
