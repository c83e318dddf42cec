//! Damaged files, byte by byte: every damage is a named error (`StoreError::Corrupt` naming the
//! file), and once a store has seen damage in a file, not one byte of that file is written again.
//! Each test runs on both layouts: the worker's rows in `instance.db` (the organization layout,
//! the default) and in the worker's own file (the per-agent layout).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::{copy_dir, snapshot};
use spacebot_core::task::TaskFilter;
use spacebot_core::{
    AgentId, ChannelId, ChannelStore, DeliveryStore, NewRecord, NewTask, RecordKind, StoreError,
    TaskStore, Timestamp,
};
use spacebot_sqlite::{Layout, OpenCheck, SqliteOptions, SqliteStores};

const PAGE: usize = 4096;
const WAL_FRAME: usize = 24 + PAGE;

fn worker() -> AgentId {
    AgentId::parse("worker").unwrap()
}

/// The file that holds the worker's rows in `layout`.
fn worker_db(dir: &Path, layout: Layout) -> PathBuf {
    match layout {
        Layout::PerAgent => dir.join("agents/worker/data/spacebot.db"),
        _ => dir.join("instance.db"),
    }
}

/// Opens `dir` in `layout` with the default checks.
async fn open(dir: &Path, layout: Layout) -> Result<SqliteStores, StoreError> {
    SqliteOptions::new().layout(layout).open(dir).await
}

fn record(content: String) -> NewRecord {
    NewRecord::new(
        ChannelId::portal(&worker()),
        RecordKind::User,
        "user",
        content,
        Timestamp(2_000),
    )
}

/// Writes some of everything an agent's database holds.
async fn fill(stores: &SqliteStores) {
    for i in 0..12 {
        stores
            .tasks()
            .create(
                &worker(),
                NewTask::new(
                    format!("keep-me-{i:04}"),
                    "a task that must survive".repeat(8),
                ),
                Timestamp(1_000 + i),
            )
            .await
            .unwrap();
    }
    for i in 0..8 {
        stores
            .channels()
            .append(
                &worker(),
                record(format!("message {i} {}", "text ".repeat(40))),
            )
            .await
            .unwrap();
    }
}

/// A closed data directory holding a filled agent database (no write-ahead log beside it).
async fn closed_dir(layout: Layout) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let stores = open(dir.path(), layout).await.unwrap();
    fill(&stores).await;
    stores.close().await;
    assert!(!wal_of(&worker_db(dir.path(), layout)).exists());
    dir
}

/// A data directory as a killed process leaves it: the databases with their write-ahead logs,
/// every commit still in the logs.
async fn crashed_dir(layout: Layout) -> tempfile::TempDir {
    let live = tempfile::tempdir().unwrap();
    let stores = open(live.path(), layout).await.unwrap();
    fill(&stores).await;
    let copy = tempfile::tempdir().unwrap();
    for file in snapshot(live.path()).keys() {
        if file.to_string_lossy().ends_with("-shm") {
            continue;
        }
        let target = copy.path().join(file.strip_prefix(live.path()).unwrap());
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::copy(file, &target).unwrap();
    }
    stores.close().await;
    copy
}

fn wal_of(db: &Path) -> PathBuf {
    let mut name = db.as_os_str().to_os_string();
    name.push("-wal");
    PathBuf::from(name)
}

/// Cases whose damage may fall in unused space: a named error, or every value reads as before.
const HARMLESS: &str = "(maybe unused space)";

#[derive(Debug, Clone, Copy)]
enum Damage {
    /// Inverts the byte at this offset.
    Flip(usize),
    /// Cuts this many bytes off the end.
    Truncate(usize),
}

fn damage(file: &Path, how: Damage) {
    let mut bytes = std::fs::read(file).unwrap();
    match how {
        Damage::Flip(at) => bytes[at] ^= 0xFF,
        Damage::Truncate(n) => bytes.truncate(bytes.len() - n),
    }
    std::fs::write(file, bytes).unwrap();
}

#[track_caller]
fn assert_corrupt(case: &str, err: &StoreError, file: &Path) {
    match err {
        StoreError::Corrupt { location, .. } => {
            assert_eq!(Path::new(location), file, "{case}: {err}");
        }
        other => panic!(
            "{case}: expected Corrupt naming {}, got {other:?}",
            file.display()
        ),
    }
}

/// The damaged file and the files SQLite keeps beside it (`-wal`, `-shm`), with their bytes.
fn files_of(dir: &Path, file: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let name = file.to_string_lossy().into_owned();
    snapshot(dir)
        .into_iter()
        .filter(|(path, _)| path.to_string_lossy().starts_with(&name))
        .collect()
}

/// Runs every case, each in its own task, and fails naming every case that failed.
async fn run_all(cases: Vec<(String, tempfile::TempDir, PathBuf)>, layout: Layout) {
    let mut failed = Vec::new();
    for (case, dir, file) in cases {
        let path = dir.path().to_path_buf();
        let name = format!("{layout:?}: {case}");
        let outcome = tokio::spawn(async move { check(&name, &path, &file, layout).await }).await;
        if let Err(e) = outcome {
            failed.push(format!("{case}: {e}"));
        }
        drop(dir);
    }
    assert!(
        failed.is_empty(),
        "{} cases failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

/// Opens `dir` through the public API and uses the damaged file: the first read is `Corrupt`
/// naming it (or the open is, for the instance database), every write after it is refused with
/// the same error, and not one byte of the damaged file (or of its write-ahead log) changes.
async fn check(case: &str, dir: &Path, file: &Path, layout: Layout) {
    let before = files_of(dir, file);
    match open(dir, layout).await {
        Err(err) => {
            assert_corrupt(case, &err, file);
            // The bundle's open function says the same.
            let again = spacebot_sqlite::open(dir).await.map(|_| ()).unwrap_err();
            assert_eq!(again.to_string(), err.to_string(), "{case}");
        }
        Ok(stores) => {
            let read = stores.tasks().list(&worker(), &TaskFilter::default()).await;
            let first = match read {
                Err(first) => first,
                Ok(tasks) if case.contains(HARMLESS) => {
                    // Unused space: nothing reads differently.
                    let history = stores
                        .channels()
                        .history(&worker(), &ChannelId::portal(&worker()), None)
                        .await
                        .unwrap();
                    assert_eq!(tasks.len(), 12, "{case}");
                    for (i, task) in tasks.iter().enumerate() {
                        assert_eq!(task.title, format!("keep-me-{i:04}"), "{case}");
                    }
                    assert_eq!(history.len(), 8, "{case}");
                    stores.close().await;
                    return;
                }
                Ok(tasks) => panic!(
                    "{case}: the damage went unseen ({} tasks read)",
                    tasks.len()
                ),
            };
            assert_corrupt(case, &first, file);
            let writes = [
                stores
                    .tasks()
                    .create(&worker(), NewTask::new("after", ""), Timestamp(9))
                    .await
                    .map(|_| ()),
                stores
                    .channels()
                    .append(&worker(), record("after".into()))
                    .await
                    .map(|_| ()),
                stores
                    .deliveries()
                    .mark_applied(&worker(), "after", Timestamp(9))
                    .await
                    .map(|_| ()),
                stores
                    .tasks()
                    .claim_next(
                        &worker(),
                        "w",
                        std::time::Duration::from_secs(5),
                        Timestamp(9),
                    )
                    .await
                    .map(|_| ()),
            ];
            for (n, write) in writes.into_iter().enumerate() {
                let err = write.expect_err(case);
                assert_eq!(
                    err.to_string(),
                    first.to_string(),
                    "{case}: write {n} was not refused with the first error"
                );
            }
            stores.close().await;
        }
    }
    let after = files_of(dir, file);
    let changed: Vec<&PathBuf> = before
        .iter()
        .filter(|(path, bytes)| after.get(*path) != Some(*bytes))
        .map(|(path, _)| path)
        .chain(after.keys().filter(|p| !before.contains_key(*p)))
        .collect();
    assert!(changed.is_empty(), "{case}: files changed: {changed:?}");
}

/// Offsets in the 100-byte header whose inversion must be caught: the page size, the format
/// versions, the payload fractions, the change counter and the page count, the schema format,
/// the vacuum fields, the text encoding, the user version, the reserved bytes, the
/// version-valid-for number and the high bytes of the SQLite version number. (The schema cookie
/// and the low bytes of the SQLite version number may hold any value.)
const HEADER: &[usize] = &[
    0, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 27, 28, 31, 44, 47, 52, 55, 56, 59, 64, 67, 68, 71,
    72, 80, 91, 92, 95, 96, 97,
];

/// Each class of position in a small agent database, flipped or truncated, refused at open or at
/// the first read with `Corrupt`, and left as it was.
#[tokio::test]
async fn every_damaged_position_is_a_named_error_and_nothing_is_written_after() {
    every_damaged_position(Layout::Organization).await;
}

/// As above, in the per-agent layout.
#[tokio::test]
async fn every_damaged_position_is_a_named_error_and_nothing_is_written_after_per_agent() {
    every_damaged_position(Layout::PerAgent).await;
}

async fn every_damaged_position(layout: Layout) {
    let pristine = closed_dir(layout).await;
    let bytes = std::fs::read(worker_db(pristine.path(), layout)).unwrap();
    let pages = bytes.len() / PAGE;
    assert!(pages >= 6, "expected several pages, got {pages}");
    let mut cases: Vec<(String, Damage)> = Vec::new();
    for &at in HEADER {
        cases.push((format!("header byte {at}"), Damage::Flip(at)));
    }
    // The b-tree page header of the schema page and of every other page: type, first freeblock,
    // cell count, content start.
    cases.push(("schema page type".into(), Damage::Flip(100)));
    cases.push(("schema page cell count".into(), Damage::Flip(104)));
    for page in 1..pages {
        for (what, off) in [("type", 0), ("cell count", 4), ("content start", 6)] {
            cases.push((
                format!("page {} {what}", page + 1),
                Damage::Flip(page * PAGE + off),
            ));
        }
    }
    // Row data: a byte of a task's title, of its description and of a channel record.
    for needle in [&b"keep-me-0003"[..], b"must survive", b"message 5"] {
        let at = bytes
            .windows(needle.len())
            .position(|w| w == needle)
            .expect("the text is in the file");
        cases.push((
            format!("text {:?}", String::from_utf8_lossy(needle)),
            Damage::Flip(at + 2),
        ));
    }
    // The last byte, inverted and cut off; a whole page cut off. (The last page of this file is
    // an empty index page: its last byte is unused space, whose value SQLite never reads.)
    cases.push((
        format!("{HARMLESS} last byte"),
        Damage::Flip(bytes.len() - 1),
    ));
    cases.push(("last byte cut off".into(), Damage::Truncate(1)));
    cases.push(("last page cut off".into(), Damage::Truncate(PAGE)));

    let mut prepared = Vec::new();
    for (case, how) in cases {
        let dir = tempfile::tempdir().unwrap();
        copy_dir(pristine.path(), dir.path());
        let file = worker_db(dir.path(), layout);
        damage(&file, how);
        prepared.push((case, dir, file));
    }
    run_all(prepared, layout).await;
}

/// A write-ahead log left by a crash, damaged in its header or in a frame that intact frames
/// follow: SQLite would silently drop the commits from there on; the store refuses the file.
#[tokio::test]
async fn a_damaged_write_ahead_log_is_a_named_error_and_nothing_is_written_after() {
    damaged_write_ahead_log(Layout::Organization).await;
}

/// As above, in the per-agent layout.
#[tokio::test]
async fn a_damaged_write_ahead_log_is_a_named_error_and_nothing_is_written_after_per_agent() {
    damaged_write_ahead_log(Layout::PerAgent).await;
}

async fn damaged_write_ahead_log(layout: Layout) {
    let pristine = crashed_dir(layout).await;
    let wal = std::fs::read(wal_of(&worker_db(pristine.path(), layout))).unwrap();
    let frames = (wal.len() - 32) / WAL_FRAME;
    assert!(frames >= 6, "expected several frames, got {frames}");
    // The undamaged copy opens and keeps every task.
    {
        let dir = tempfile::tempdir().unwrap();
        copy_dir(pristine.path(), dir.path());
        let stores = open(dir.path(), layout).await.unwrap();
        let tasks = stores
            .tasks()
            .list(&worker(), &TaskFilter::default())
            .await
            .unwrap();
        assert_eq!(tasks.len(), 12);
        stores.close().await;
    }
    let frame = |n: usize| 32 + n * WAL_FRAME;
    let middle = frames / 2;
    let cases = [
        ("log magic number", 3),
        ("log format version", 7),
        ("log page size", 10),
        ("log checkpoint sequence", 12),
        ("log salt", 16),
        ("log header checksum", 27),
        ("first frame's page number", frame(0) + 3),
        ("first frame's salt", frame(0) + 8),
        ("first frame's checksum", frame(0) + 16),
        ("middle frame's page number", frame(middle) + 3),
        ("middle frame's commit size", frame(middle) + 7),
        ("middle frame's page data", frame(middle) + 24 + 1000),
        ("middle frame's last byte", frame(middle + 1) - 1),
        (
            "next to last frame's page data",
            frame(frames - 2) + 24 + 17,
        ),
    ];
    let mut prepared = Vec::new();
    for (case, at) in cases {
        let dir = tempfile::tempdir().unwrap();
        copy_dir(pristine.path(), dir.path());
        let file = worker_db(dir.path(), layout);
        damage(&wal_of(&file), Damage::Flip(at));
        prepared.push((case.to_string(), dir, file));
    }
    run_all(prepared, layout).await;
}

/// The instance database damaged: the open is refused with `Corrupt` naming it.
#[tokio::test]
async fn a_damaged_instance_database_is_refused_at_open() {
    for layout in [Layout::Organization, Layout::PerAgent] {
        damaged_instance_database(layout).await;
    }
}

async fn damaged_instance_database(layout: Layout) {
    let pristine = closed_dir(layout).await;
    let instance = pristine.path().join("instance.db");
    assert!(instance.exists());
    let mut prepared = Vec::new();
    for (case, how) in [
        ("instance header page count", Damage::Flip(31)),
        ("instance page 2 type", Damage::Flip(PAGE)),
        ("instance last byte cut off", Damage::Truncate(1)),
    ] {
        let dir = tempfile::tempdir().unwrap();
        copy_dir(pristine.path(), dir.path());
        let file = dir.path().join("instance.db");
        damage(&file, how);
        prepared.push((case.to_string(), dir, file));
    }
    run_all(prepared, layout).await;
}

/// Damage the open check does not look for (it is skipped here) is met by a read: text that is
/// not UTF-8 is `Corrupt` (not `Backend`), and from then on every write to that file is refused
/// with the same error (in the organization layout, every agent's: they share the file), while
/// in the per-agent layout the other agents' files are written as usual.
#[tokio::test]
async fn damage_met_by_a_read_stops_every_later_write_to_that_file() {
    damage_met_by_a_read(Layout::Organization).await;
}

/// As above, in the per-agent layout.
#[tokio::test]
async fn damage_met_by_a_read_stops_every_later_write_to_that_file_per_agent() {
    damage_met_by_a_read(Layout::PerAgent).await;
}

async fn damage_met_by_a_read(layout: Layout) {
    let dir = closed_dir(layout).await;
    let file = worker_db(dir.path(), layout);
    let bytes = std::fs::read(&file).unwrap();
    let at = bytes
        .windows(12)
        .position(|w| w == b"keep-me-0007")
        .unwrap();
    damage(&file, Damage::Flip(at + 3));
    let before = std::fs::read(&file).unwrap();
    let stores = SqliteOptions::new()
        .layout(layout)
        .check_on_open(OpenCheck::Skip)
        .open(dir.path())
        .await
        .unwrap();
    // The task before the damaged one reads; the damaged one is Corrupt, naming the file.
    assert_eq!(
        stores
            .tasks()
            .get(&worker(), 7)
            .await
            .unwrap()
            .unwrap()
            .title,
        "keep-me-0006"
    );
    let err = stores.tasks().get(&worker(), 8).await.unwrap_err();
    assert_corrupt("a title that is not UTF-8", &err, &file);
    assert!(err.to_string().contains("decode"), "{err}");
    // Every later write is refused with that error.
    let refused = stores
        .tasks()
        .create(&worker(), NewTask::new("after", ""), Timestamp(9))
        .await
        .unwrap_err();
    assert_eq!(refused.to_string(), err.to_string());
    let refused = stores
        .deliveries()
        .mark_applied(&worker(), "k", Timestamp(9))
        .await
        .unwrap_err();
    assert_eq!(refused.to_string(), err.to_string());
    // Another agent's own file is not affected; the organization's file is the other agent's too.
    let other = AgentId::parse("other").unwrap();
    let written = stores
        .tasks()
        .create(&other, NewTask::new("fine", ""), Timestamp(9))
        .await;
    match layout {
        Layout::PerAgent => {
            written.unwrap();
        }
        _ => assert_eq!(written.unwrap_err().to_string(), err.to_string()),
    }
    stores.close().await;
    assert!(
        std::fs::read(&file).unwrap() == before,
        "the damaged file was written to"
    );
    // With the check at open (the default), the same file is refused before anything reads it.
    let err = match open(dir.path(), layout).await {
        // The organization's file is checked when the directory is opened.
        Err(err) => err,
        Ok(stores) => stores
            .tasks()
            .list(&worker(), &TaskFilter::default())
            .await
            .unwrap_err(),
    };
    assert_corrupt("checked at open", &err, &file);
    assert!(err.to_string().contains("UTF-8"), "{err}");
}
