//! Helpers the integration tests share: a data directory's files as bytes, compared and copied.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Every file under `dir` with its bytes, but the directory's lock file (every open writes its
/// pid there before it looks at the databases).
pub(crate) fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path != dir.join("spacebot.lock") {
                out.insert(path.clone(), std::fs::read(&path).unwrap());
            }
        }
    }
    out
}

/// Asserts two snapshots are equal, naming the files that differ (not their bytes).
#[track_caller]
pub(crate) fn assert_same(after: &BTreeMap<PathBuf, Vec<u8>>, before: &BTreeMap<PathBuf, Vec<u8>>) {
    let mut diff = Vec::new();
    for (path, bytes) in before {
        match after.get(path) {
            None => diff.push(format!("removed {}", path.display())),
            Some(b) if b != bytes => diff.push(format!("changed {}", path.display())),
            Some(_) => {}
        }
    }
    for path in after.keys().filter(|p| !before.contains_key(*p)) {
        diff.push(format!("created {}", path.display()));
    }
    assert!(diff.is_empty(), "files changed: {diff:?}");
}

/// Copies every file under `from` (but the lock file) to the same place under `to`.
pub(crate) fn copy_dir(from: &Path, to: &Path) {
    for (file, content) in snapshot(from) {
        let target = to.join(file.strip_prefix(from).unwrap());
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::write(&target, content).unwrap();
    }
}
