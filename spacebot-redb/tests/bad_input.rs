//! Files that are not ours, damaged or too new: a clear error naming the file, nothing overwritten.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test helpers fail loudly

use std::path::{Path, PathBuf};
use std::time::Duration;

use redb::{Database, ReadableDatabase, TableDefinition};
use spacebot_core::task::{NewTask, TaskStore};
use spacebot_core::{AgentId, StoreError, Timestamp};
use spacebot_redb::{RedbOptions, RedbStore, SCHEMA_VERSION};

const META: TableDefinition<&str, &str> = TableDefinition::new("spacebot_meta");

fn corrupt_naming(err: StoreError, file: &Path) -> String {
    match err {
        StoreError::Corrupt { location, reason } => {
            assert!(
                location.contains(&file.display().to_string()),
                "{location} does not name {}",
                file.display()
            );
            reason
        }
        other => panic!("expected Corrupt naming {}, got {other:?}", file.display()),
    }
}

/// Creates a valid data directory with one task for agent `a`, and closes it.
fn populated(dir: &Path) -> PathBuf {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let s = RedbStore::open(dir, RedbOptions::default()).unwrap();
        let a = AgentId::parse("a").unwrap();
        for i in 0..50 {
            s.create(
                &a,
                NewTask::new(format!("task {i}"), "x".repeat(500)),
                Timestamp(i),
            )
            .await
            .unwrap();
        }
        s.close().await;
    });
    dir.join("agents/a/spacebot.redb")
}

fn open_err(dir: &Path) -> StoreError {
    RedbStore::open(dir, RedbOptions::default()).unwrap_err()
}

async fn agent_err(dir: &Path) -> StoreError {
    let s = RedbStore::open(dir, RedbOptions::default()).unwrap();
    let err = s.get(&AgentId::parse("a").unwrap(), 1).await.unwrap_err();
    s.close().await;
    err
}

#[test]
fn a_file_that_is_not_redb_is_refused_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("instance.redb");
    let content = b"SQLite format 3\0 this is somebody else's data".repeat(200);
    std::fs::write(&path, &content).unwrap();
    let reason = corrupt_naming(open_err(dir.path()), &path);
    assert!(!reason.is_empty());
    let from_async =
        futures::executor::block_on(RedbStore::open_async(dir.path(), RedbOptions::default()))
            .unwrap_err();
    corrupt_naming(from_async, &path);
    assert!(
        std::fs::read(&path).unwrap() == content,
        "the file was changed"
    );
}

#[test]
fn a_short_file_is_refused_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("instance.redb");
    std::fs::write(&path, b"redb").unwrap();
    corrupt_naming(open_err(dir.path()), &path);
    assert!(
        std::fs::read(&path).unwrap() == b"redb",
        "the file was changed"
    );
}

#[test]
fn a_redb_file_without_our_schema_is_refused_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("instance.redb");
    {
        let db = Database::create(&path).unwrap();
        let tx = db.begin_write().unwrap();
        tx.open_table(TableDefinition::<u64, u64>::new("their_table"))
            .unwrap()
            .insert(1, 2)
            .unwrap();
        tx.commit().unwrap();
    }
    let before = std::fs::read(&path).unwrap();
    let reason = corrupt_naming(open_err(dir.path()), &path);
    assert!(reason.contains("their_table"), "{reason}");
    assert!(
        std::fs::read(&path).unwrap() == before,
        "the file was changed"
    );
    // Still their file, with their table only.
    let db = Database::open(&path).unwrap();
    let read = db.begin_read().unwrap();
    let tables: Vec<String> = read
        .list_tables()
        .unwrap()
        .map(|t| redb::TableHandle::name(&t).to_string())
        .collect();
    assert_eq!(tables, vec!["their_table".to_string()]);
    drop(read);
    drop(db);
}

#[test]
fn a_newer_schema_is_refused_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let agent_file = populated(dir.path());
    let instance = dir.path().join("instance.redb");
    for path in [&instance, &agent_file] {
        let db = Database::open(path).unwrap();
        let tx = db.begin_write().unwrap();
        tx.open_table(META)
            .unwrap()
            .insert("schema_version", (SCHEMA_VERSION + 1).to_string().as_str())
            .unwrap();
        tx.commit().unwrap();
    }
    let before = std::fs::read(&instance).unwrap();
    let reason = corrupt_naming(open_err(dir.path()), &instance);
    assert!(
        reason.contains(&format!("schema version {}", SCHEMA_VERSION + 1)),
        "{reason}"
    );
    assert!(
        std::fs::read(&instance).unwrap() == before,
        "the file was changed"
    );

    // The agent file is checked when the agent is first used.
    let db = Database::open(&instance).unwrap();
    let tx = db.begin_write().unwrap();
    tx.open_table(META)
        .unwrap()
        .insert("schema_version", SCHEMA_VERSION.to_string().as_str())
        .unwrap();
    tx.commit().unwrap();
    drop(db);
    let before = std::fs::read(&agent_file).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let err = rt.block_on(agent_err(dir.path()));
    let reason = corrupt_naming(err, &agent_file);
    assert!(reason.contains("newer"), "{reason}");
    assert!(
        std::fs::read(&agent_file).unwrap() == before,
        "the file was changed"
    );
}

#[test]
fn a_file_of_the_wrong_kind_or_agent_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let agent_file = populated(dir.path());
    // Agent b's directory holds agent a's file.
    let b_file = dir.path().join("agents/b/spacebot.redb");
    std::fs::create_dir_all(b_file.parent().unwrap()).unwrap();
    std::fs::copy(&agent_file, &b_file).unwrap();
    // The instance file is an agent file.
    let instance = dir.path().join("instance.redb");
    std::fs::copy(&agent_file, &instance).unwrap();
    let before = std::fs::read(&instance).unwrap();
    let reason = corrupt_naming(open_err(dir.path()), &instance);
    assert!(reason.contains("agent"), "{reason}");
    assert!(
        std::fs::read(&instance).unwrap() == before,
        "the file was changed"
    );

    let other = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(other.path().join("agents/b")).unwrap();
    std::fs::copy(&agent_file, other.path().join("agents/b/spacebot.redb")).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let err = rt.block_on(async {
        let s = RedbStore::open(other.path(), RedbOptions::default()).unwrap();
        let err = s
            .list(&AgentId::parse("b").unwrap(), &Default::default())
            .await
            .unwrap_err();
        s.close().await;
        err
    });
    let reason = corrupt_naming(err, &other.path().join("agents/b/spacebot.redb"));
    assert!(reason.contains("belongs to agent \"a\""), "{reason}");
}

#[test]
fn a_damaged_file_is_refused_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let agent_file = populated(dir.path());
    let mut bytes = std::fs::read(&agent_file).unwrap();
    // Overwrite everything past the header region with garbage.
    let len = bytes.len();
    for (i, b) in bytes[4096..len].iter_mut().enumerate() {
        *b = (i * 7 + 13) as u8;
    }
    std::fs::write(&agent_file, &bytes).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let err = rt.block_on(agent_err(dir.path()));
    corrupt_naming(err, &agent_file);
    assert!(
        std::fs::read(&agent_file).unwrap() == bytes,
        "the file was changed"
    );
}

#[test]
fn a_damaged_header_is_refused_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let agent_file = populated(dir.path());
    let mut bytes = std::fs::read(&agent_file).unwrap();
    bytes[0] ^= 0xff;
    std::fs::write(&agent_file, &bytes).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let err = rt.block_on(agent_err(dir.path()));
    corrupt_naming(err, &agent_file);
    assert!(
        std::fs::read(&agent_file).unwrap() == bytes,
        "the file was changed"
    );
}

#[test]
fn a_failed_agent_open_is_retried_once_the_file_is_fixed() {
    let dir = tempfile::tempdir().unwrap();
    let agent_file = populated(dir.path());
    let good = std::fs::read(&agent_file).unwrap();
    std::fs::write(&agent_file, b"garbage garbage garbage").unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let s = RedbStore::open(dir.path(), RedbOptions::default()).unwrap();
        let a = AgentId::parse("a").unwrap();
        assert!(matches!(
            s.get(&a, 1).await,
            Err(StoreError::Corrupt { .. })
        ));
        // The failed handle is dropped once its thread has stopped; then the file is opened anew.
        std::fs::write(&agent_file, &good).unwrap();
        let mut ok = None;
        for _ in 0..50 {
            match s.get(&a, 1).await {
                Ok(t) => {
                    ok = t;
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
        assert_eq!(ok.unwrap().title, "task 0");
        s.close().await;
    });
}

#[test]
fn a_foreign_file_that_needs_recovery_is_checked_in_memory_and_kept() {
    let scratch = tempfile::tempdir().unwrap();
    let theirs = scratch.path().join("theirs.redb");
    let db = redb::Database::create(&theirs).unwrap();
    let table: redb::TableDefinition<&str, &str> = redb::TableDefinition::new("their_notes");
    let tx = db.begin_write().unwrap();
    tx.open_table(table).unwrap().insert("k", "v").unwrap();
    tx.commit().unwrap();
    // Copied while open: the copy is marked as needing recovery, as after a crash.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("instance.redb");
    std::fs::copy(&theirs, &path).unwrap();
    drop(db);
    assert!(
        matches!(
            redb::Builder::new().open_read_only(&path),
            Err(redb::DatabaseError::RepairAborted)
        ),
        "the copy should need recovery"
    );
    let before = std::fs::read(&path).unwrap();
    let reason = corrupt_naming(open_err(dir.path()), &path);
    assert!(reason.contains("their_notes"), "{reason}");
    assert!(
        std::fs::read(&path).unwrap() == before,
        "the file was changed"
    );
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names
            .iter()
            .all(|n| n == "instance.redb" || n == "spacebot.lock"),
        "{names:?}"
    );
}
