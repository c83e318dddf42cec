//! Files that are not what they should be: each is refused with an error naming the file, and
//! nothing on disk changes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use common::{assert_same, snapshot};
use spacebot_core::task::TaskFilter;
use spacebot_core::{AgentId, NewTask, StoreError, TaskStore, Timestamp};
use spacebot_sqlite::{Layout, SqliteOptions, SqliteStores};
use sqlx::{Connection, SqliteConnection};

fn agent(id: &str) -> AgentId {
    AgentId::parse(id).unwrap()
}

fn assert_corrupt_naming(err: StoreError, file: &Path, says: &str) {
    match &err {
        StoreError::Corrupt { location, reason } => {
            assert_eq!(Path::new(location), file, "{err}");
            assert!(reason.contains(says), "{err}");
        }
        other => panic!("expected Corrupt naming {}, got {other:?}", file.display()),
    }
    assert!(err.to_string().contains(&file.display().to_string()));
}

/// Opens `dir` in the per-agent layout: these tests damage and replace an agent's own file (the
/// organization's file, `instance.db`, is the instance database they damage too).
async fn open_per_agent(dir: impl AsRef<Path>) -> Result<SqliteStores, StoreError> {
    SqliteOptions::new()
        .layout(Layout::PerAgent)
        .open(dir)
        .await
}

/// A directory with stores holding one task for `worker`, closed.
async fn populated() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let stores = open_per_agent(dir.path()).await.unwrap();
    stores
        .tasks()
        .create(&agent("worker"), NewTask::new("keep me", ""), Timestamp(1))
        .await
        .unwrap();
    stores.close().await;
    let instance = dir.path().join("instance.db");
    let worker = dir.path().join("agents/worker/data/spacebot.db");
    (dir, instance, worker)
}

async fn raw(path: &Path) -> SqliteConnection {
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true);
    SqliteConnection::connect_with(&options).await.unwrap()
}

#[tokio::test]
async fn a_file_that_is_not_a_database_is_refused_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let instance = dir.path().join("instance.db");
    std::fs::write(
        &instance,
        b"these are my notes, not a database\n".repeat(200),
    )
    .unwrap();
    let before = snapshot(dir.path());
    let err = open_per_agent(dir.path()).await.unwrap_err();
    assert_corrupt_naming(err, &instance, "not an SQLite database");
    assert_same(&snapshot(dir.path()), &before);
}

#[tokio::test]
async fn a_corrupted_agent_database_is_refused_untouched() {
    let (dir, _, worker) = populated().await;
    // Keep the SQLite header, garble every page after the first.
    let mut bytes = std::fs::read(&worker).unwrap();
    assert!(bytes.len() > 8192, "expected several pages");
    for b in &mut bytes[4096..] {
        *b = 0xA5;
    }
    std::fs::write(&worker, &bytes).unwrap();
    let before = snapshot(dir.path());
    let stores = open_per_agent(dir.path()).await.unwrap();
    let err = stores
        .tasks()
        .list(&agent("worker"), &TaskFilter::default())
        .await
        .unwrap_err();
    match &err {
        StoreError::Corrupt { location, .. } => assert_eq!(Path::new(location), worker),
        other => panic!("expected Corrupt, got {other:?}"),
    }
    // Other agents are not affected.
    stores
        .tasks()
        .create(&agent("other"), NewTask::new("fine", ""), Timestamp(1))
        .await
        .unwrap();
    stores.close().await;
    assert!(
        std::fs::read(&worker).unwrap() == before[&worker],
        "the corrupted file was written to"
    );
}

#[tokio::test]
async fn a_corrupted_instance_database_is_refused_untouched() {
    let (dir, instance, _) = populated().await;
    let mut bytes = std::fs::read(&instance).unwrap();
    for b in &mut bytes[100..] {
        *b = 0x5A;
    }
    std::fs::write(&instance, &bytes).unwrap();
    let before = snapshot(dir.path());
    let err = open_per_agent(dir.path()).await.unwrap_err();
    match &err {
        StoreError::Corrupt { location, .. } => assert_eq!(Path::new(location), instance),
        other => panic!("expected Corrupt, got {other:?}"),
    }
    assert_same(&snapshot(dir.path()), &before);
}

#[tokio::test]
async fn another_applications_database_is_refused_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let instance = dir.path().join("instance.db");
    let mut conn = raw(&instance).await;
    sqlx::query("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query("INSERT INTO users (name) VALUES ('ada')")
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    let before = snapshot(dir.path());
    let err = open_per_agent(dir.path()).await.unwrap_err();
    assert_corrupt_naming(err, &instance, "not a spacebot instance database");
    assert_same(&snapshot(dir.path()), &before);

    // With an application id of its own, the message says so.
    let mut conn = raw(&instance).await;
    sqlx::query("PRAGMA application_id = 1234")
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    let before = snapshot(dir.path());
    let err = open_per_agent(dir.path()).await.unwrap_err();
    assert_corrupt_naming(err, &instance, "another application (application_id 0x4d2)");
    assert_same(&snapshot(dir.path()), &before);
}

#[tokio::test]
async fn an_instance_database_in_an_agents_place_is_refused_untouched() {
    let (dir, instance, worker) = populated().await;
    std::fs::copy(&instance, &worker).unwrap();
    let before = snapshot(dir.path());
    let stores = open_per_agent(dir.path()).await.unwrap();
    let err = stores.tasks().get(&agent("worker"), 1).await.unwrap_err();
    assert_corrupt_naming(
        err,
        &worker,
        "a spacebot instance database, not a spacebot agent database",
    );
    stores.close().await;
    assert!(
        std::fs::read(&worker).unwrap() == before[&worker],
        "{} changed",
        worker.display()
    );
}

#[tokio::test]
async fn a_schema_newer_than_this_build_is_refused_untouched() {
    let (dir, instance, worker) = populated().await;
    for file in [&instance, &worker] {
        let mut conn = raw(file).await;
        sqlx::query(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
             VALUES (9999, 'from the future', 1, x'00', 0)",
        )
        .execute(&mut conn)
        .await
        .unwrap();
        conn.close().await.unwrap();
    }
    let before = snapshot(dir.path());
    let err = open_per_agent(dir.path()).await.unwrap_err();
    assert_corrupt_naming(err, &instance, "schema version 9999 is newer");
    assert_same(&snapshot(dir.path()), &before);

    // The agent database too, once the instance database is fine again.
    let mut conn = raw(&instance).await;
    sqlx::query("DELETE FROM _sqlx_migrations WHERE version = 9999")
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    let stores = open_per_agent(dir.path()).await.unwrap();
    let err = stores
        .tasks()
        .list(&agent("worker"), &TaskFilter::default())
        .await
        .unwrap_err();
    assert_corrupt_naming(err, &worker, "schema version 9999 is newer");
    stores.close().await;
    assert!(
        std::fs::read(&worker).unwrap() == before[&worker],
        "{} changed",
        worker.display()
    );
}

const READ_ONLY_CHILD: &str = "SPACEBOT_SQLITE_READ_ONLY_DIR";

/// Opens the stores in the read-only directories prepared by
/// [`a_read_only_directory_is_a_clear_error_and_nothing_is_written`]. Runs as a child process
/// when that test runs as root (root ignores directory permissions); does nothing otherwise.
#[tokio::test]
#[ignore = "the child process of a_read_only_directory_is_a_clear_error_and_nothing_is_written"]
async fn read_only_child() {
    let Ok(root) = std::env::var(READ_ONLY_CHILD) else {
        return;
    };
    check_read_only(Path::new(&root)).await;
}

async fn check_read_only(root: &Path) {
    // A fresh directory: instance.db cannot be created.
    let fresh = root.join("fresh");
    let err = open_per_agent(&fresh).await.unwrap_err();
    eprintln!("fresh read-only directory: {err}");
    assert!(matches!(err, StoreError::Backend { .. }), "{err:?}");
    assert!(
        err.to_string().contains(&fresh.display().to_string()),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(&fresh).unwrap().count(), 0);

    // Existing stores: refused (SQLite cannot write or keep its WAL index there).
    let existing = root.join("existing");
    let result = open_per_agent(&existing).await;
    let err = match result {
        Err(err) => err,
        Ok(stores) => {
            // Opening may succeed on some systems (a read-only open of the instance file);
            // then every write must fail, naming the file.
            let err = stores
                .tasks()
                .create(&agent("worker"), NewTask::new("new", ""), Timestamp(2))
                .await
                .unwrap_err();
            stores.close().await;
            err
        }
    };
    eprintln!("existing stores in a read-only directory: {err}");
    assert!(matches!(err, StoreError::Backend { .. }), "{err:?}");
    assert!(
        err.to_string().contains(&existing.display().to_string()),
        "{err}"
    );
}

/// A new temporary directory whose ancestors every user may enter (the system's temporary
/// directory, or `/tmp` when that one sits under a private directory).
fn world_dir() -> tempfile::TempDir {
    let base = std::env::temp_dir();
    let reachable = base
        .ancestors()
        .all(|d| std::fs::metadata(d).is_ok_and(|m| m.mode() & 0o001 != 0));
    let base = if reachable {
        base
    } else {
        PathBuf::from("/tmp")
    };
    tempfile::tempdir_in(base).unwrap()
}

#[tokio::test]
async fn a_read_only_directory_is_a_clear_error_and_nothing_is_written() {
    let root = world_dir();
    let fresh = root.path().join("fresh");
    std::fs::create_dir(&fresh).unwrap();
    let existing = root.path().join("existing");
    let stores = open_per_agent(&existing).await.unwrap();
    stores
        .tasks()
        .create(&agent("worker"), NewTask::new("keep me", ""), Timestamp(1))
        .await
        .unwrap();
    stores.close().await;
    let set_mode = |path: &Path, mode| {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    let before = snapshot(&existing);
    // Read-only everything (directories keep r-x so the files can be found).
    set_mode(root.path(), 0o755);
    let mut dirs = vec![fresh.clone(), existing.clone()];
    dirs.extend(
        ["agents", "agents/worker", "agents/worker/data"]
            .iter()
            .map(|d| existing.join(d)),
    );
    for file in before.keys() {
        set_mode(file, 0o444);
    }
    for d in &dirs {
        set_mode(d, 0o555);
    }

    let probe = fresh.join("probe");
    let privileged = std::fs::write(&probe, b"").is_ok();
    if privileged {
        // Root ignores permissions: run the checks as an unprivileged user in a child process.
        std::fs::remove_file(&probe).unwrap();
        assert_eq!(std::fs::metadata("/proc/self").unwrap().uid(), 0);
        // The unprivileged user may not be able to reach the test binary where it was built (a
        // checkout under a 0700 home): run a copy from a directory everyone can enter.
        let bin_dir = world_dir();
        let bin = bin_dir.path().join("bad_input");
        std::fs::copy(std::env::current_exe().unwrap(), &bin).unwrap();
        set_mode(bin_dir.path(), 0o755);
        set_mode(&bin, 0o755);
        let output = std::process::Command::new(&bin)
            .current_dir(bin_dir.path())
            .args([
                "read_only_child",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(READ_ONLY_CHILD, root.path())
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success() && stdout.contains("1 passed"),
            "the unprivileged checks failed or did not run: {}\n{stdout}\n{stderr}",
            output.status
        );
    } else {
        check_read_only(root.path()).await;
    }

    for d in &dirs {
        set_mode(d, 0o755);
    }
    assert_same(&snapshot(&existing), &before);
    assert_eq!(std::fs::read_dir(&fresh).unwrap().count(), 0);
    // Once writable again, everything is there.
    for file in before.keys() {
        set_mode(file, 0o644);
    }
    let stores = open_per_agent(&existing).await.unwrap();
    let tasks = stores
        .tasks()
        .list(&agent("worker"), &TaskFilter::default())
        .await
        .unwrap();
    assert_eq!(tasks.len(), 1);
    stores.close().await;
}

/// Another application's database in WAL mode, as a crash of that application leaves it: the
/// database file plus a `-wal` file holding commits not yet copied into it. With `in_log_only`,
/// every commit is still in the log (the file itself looks like an empty database).
async fn foreign_wal_database(target: &Path, in_log_only: bool) {
    let scratch = tempfile::tempdir().unwrap();
    let db = scratch.path().join("theirs.db");
    let mut conn = raw(&db).await;
    for sql in ["PRAGMA journal_mode = WAL", "PRAGMA wal_autocheckpoint = 0"] {
        sqlx::query(sql).execute(&mut conn).await.unwrap();
    }
    if !in_log_only {
        for sql in [
            "PRAGMA application_id = 4660",
            "CREATE TABLE notes (body TEXT)",
            "PRAGMA wal_checkpoint(TRUNCATE)",
        ] {
            sqlx::query(sql).execute(&mut conn).await.unwrap();
        }
    }
    for sql in [
        "CREATE TABLE IF NOT EXISTS notes (body TEXT)",
        "INSERT INTO notes VALUES ('theirs, only in the log')",
        "PRAGMA application_id = 4660",
    ] {
        sqlx::query(sql).execute(&mut conn).await.unwrap();
    }
    // Copied while their connection is still open: the log has not been checkpointed.
    std::fs::copy(&db, target).unwrap();
    let mut wal = target.as_os_str().to_owned();
    wal.push("-wal");
    std::fs::copy(scratch.path().join("theirs.db-wal"), PathBuf::from(wal)).unwrap();
    conn.close().await.unwrap();
}

#[tokio::test]
async fn a_foreign_database_with_a_write_ahead_log_is_checked_read_only_and_left_untouched() {
    for in_log_only in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let instance = dir.path().join("instance.db");
        foreign_wal_database(&instance, in_log_only).await;
        let before = snapshot(dir.path());
        assert!(before.keys().any(|p| p.ends_with("instance.db-wal")));
        let err = open_per_agent(dir.path()).await.unwrap_err();
        assert_corrupt_naming(err, &instance, "another application");
        assert_same(&snapshot(dir.path()), &before);
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(!names.iter().any(|n| n.ends_with("-shm")), "{names:?}");
    }
}

#[tokio::test]
async fn our_own_database_with_a_write_ahead_log_is_recovered() {
    // A crash of this process leaves the same shape; it is ours, so it opens and keeps its data.
    let dir = tempfile::tempdir().unwrap();
    let stores = open_per_agent(dir.path()).await.unwrap();
    stores
        .tasks()
        .create(&agent("worker"), NewTask::new("keep me", ""), Timestamp(1))
        .await
        .unwrap();
    let copy = tempfile::tempdir().unwrap();
    // Copied while open, as a crash would leave it: database files and their logs.
    for file in snapshot(dir.path()).keys() {
        let relative = file.strip_prefix(dir.path()).unwrap();
        if relative.ends_with("spacebot.lock") || file.to_string_lossy().ends_with("-shm") {
            continue;
        }
        let target = copy.path().join(relative);
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::copy(file, &target).unwrap();
    }
    stores.close().await;
    assert!(
        copy.path()
            .join("agents/worker/data/spacebot.db-wal")
            .exists()
    );
    let reopened = open_per_agent(copy.path()).await.unwrap();
    let tasks = reopened
        .tasks()
        .list(&agent("worker"), &TaskFilter::default())
        .await
        .unwrap();
    assert_eq!(tasks.len(), 1);
    reopened.close().await;
}
