//! Reading a stopped organization's data directory without writing to it.
//!
//! The backends open their files for writing (a lock file, migrations, logs beside the database),
//! so the directory is copied to a temporary directory first and the copy is opened; the original
//! is only read. A directory whose lock is held by a running organization is refused.

use std::fs::File;
use std::path::{Path, PathBuf};

use spacebot_core::task::TaskFilter;
use spacebot_core::{AgentId, ChannelId, Stores, TaskStatus};

use crate::{CliError, Store};

const LOCK_FILE: &str = "spacebot.lock";

fn failed(message: impl Into<String>) -> CliError {
    CliError::Failed(message.into())
}

/// Which backend wrote `dir`.
pub(crate) fn detect(dir: &Path) -> Result<Store, CliError> {
    if !dir.is_dir() {
        return Err(failed(format!("{}: not a directory", dir.display())));
    }
    let sqlite = dir.join("instance.db").is_file();
    let redb = dir.join(spacebot_redb::INSTANCE_FILE).is_file();
    match (sqlite, redb) {
        (true, false) => Ok(Store::Sqlite),
        (false, true) => Ok(Store::Redb),
        (true, true) => Err(failed(format!(
            "{}: holds both instance.db (SQLite) and instance.redb (redb); cannot tell which is the organization's",
            dir.display()
        ))),
        (false, false) => Err(failed(format!(
            "{}: not a spacebot data directory (no instance.db or instance.redb)",
            dir.display()
        ))),
    }
}

/// Fails if a running organization holds the directory's lock.
fn ensure_stopped(dir: &Path) -> Result<(), CliError> {
    let path = dir.join(LOCK_FILE);
    let Ok(file) = File::open(&path) else {
        return Ok(());
    };
    match file.try_lock_shared() {
        Ok(()) => {
            let _ = file.unlock();
            Ok(())
        }
        Err(std::fs::TryLockError::WouldBlock) => {
            let pid = std::fs::read_to_string(&path).unwrap_or_default();
            let pid = pid.trim();
            Err(failed(format!(
                "{} is in use by a running organization{}; stop it first (or use its HTTP API)",
                dir.display(),
                if pid.is_empty() {
                    String::new()
                } else {
                    format!(" (pid {pid})")
                }
            )))
        }
        Err(std::fs::TryLockError::Error(e)) => Err(failed(format!(
            "{}: cannot check the lock: {e}",
            path.display()
        ))),
    }
}

fn copy_dir(from: &Path, to: &Path) -> Result<(), CliError> {
    std::fs::create_dir_all(to).map_err(|e| failed(format!("{}: {e}", to.display())))?;
    let entries =
        std::fs::read_dir(from).map_err(|e| failed(format!("{}: {e}", from.display())))?;
    for entry in entries {
        let entry = entry.map_err(|e| failed(format!("{}: {e}", from.display())))?;
        let name = entry.file_name();
        if name == LOCK_FILE {
            continue;
        }
        let source = entry.path();
        let target = to.join(&name);
        let kind = entry
            .file_type()
            .map_err(|e| failed(format!("{}: {e}", source.display())))?;
        if kind.is_dir() {
            copy_dir(&source, &target)?;
        } else if kind.is_file() {
            std::fs::copy(&source, &target)
                .map_err(|e| failed(format!("{}: cannot read: {e}", source.display())))?;
        }
    }
    Ok(())
}

/// A read-only view of a data directory: the stores of a private copy.
pub(crate) struct Snapshot {
    pub(crate) stores: Stores,
    pub(crate) agents: Vec<AgentId>,
    original: PathBuf,
    copy: tempfile::TempDir,
}

impl Snapshot {
    pub(crate) async fn open(dir: &Path) -> Result<Self, CliError> {
        let store = detect(dir)?;
        ensure_stopped(dir)?;
        let copy = tempfile::Builder::new()
            .prefix("spacebot-read-")
            .tempdir()
            .map_err(|e| failed(format!("cannot make a temporary directory: {e}")))?;
        copy_dir(dir, copy.path())?;
        let mut snapshot = Self {
            stores: spacebot_core::Stores::memory(),
            agents: Vec::new(),
            original: dir.to_path_buf(),
            copy,
        };
        match store {
            Store::Sqlite => {
                // A directory in the per-agent layout is migrated here, in the copy only.
                let sqlite = spacebot_sqlite::SqliteStores::open(snapshot.copy.path())
                    .await
                    .map_err(|e| snapshot.error(e))?;
                snapshot.agents = sqlite.agents().await.map_err(|e| snapshot.error(e))?;
                snapshot.stores = sqlite.stores();
            }
            Store::Redb => {
                snapshot.stores = spacebot_redb::open_async(snapshot.copy.path())
                    .await
                    .map_err(|e| snapshot.error(e))?;
                snapshot.agents = agents_in(dir)?;
            }
        }
        Ok(snapshot)
    }

    /// A store error, with the copy's paths written as the original's.
    pub(crate) fn error(&self, e: impl std::fmt::Display) -> CliError {
        let copy = self.copy.path().display().to_string();
        let original = self.original.display().to_string();
        failed(e.to_string().replace(&copy, &original))
    }
}

fn agents_in(dir: &Path) -> Result<Vec<AgentId>, CliError> {
    let agents_dir = dir.join("agents");
    let Ok(entries) = std::fs::read_dir(&agents_dir) else {
        return Ok(Vec::new());
    };
    let mut agents: Vec<AgentId> = entries
        .filter_map(Result::ok)
        .filter(|e| e.path().is_dir())
        .filter_map(|e| AgentId::parse(e.file_name().to_string_lossy().to_string()).ok())
        .collect();
    agents.sort();
    Ok(agents)
}

fn agent_arg(raw: &str) -> Result<AgentId, CliError> {
    AgentId::parse(raw).map_err(|e| failed(format!("--agent: {e}")))
}

/// `spacebot tasks`.
pub(crate) async fn tasks(
    dir: &Path,
    agent: Option<&str>,
    status: Option<&str>,
    json: bool,
) -> Result<(), CliError> {
    let agent = agent.map(agent_arg).transpose()?;
    let mut filter = TaskFilter::default();
    if let Some(status) = status {
        filter.statuses = status
            .split(',')
            .map(|s| s.trim().parse::<TaskStatus>())
            .collect::<Result<_, _>>()
            .map_err(|e| failed(format!("--status: {e}")))?;
    }
    let snapshot = Snapshot::open(dir).await?;
    let agents = match agent {
        Some(agent) => {
            if !snapshot.agents.contains(&agent) {
                return Err(failed(format!(
                    "{}: no agent {agent} here (agents: {})",
                    dir.display(),
                    list(&snapshot.agents)
                )));
            }
            vec![agent]
        }
        None => snapshot.agents.clone(),
    };
    let mut all = Vec::new();
    for agent in &agents {
        let tasks = snapshot
            .stores
            .tasks
            .list(agent, &filter)
            .await
            .map_err(|e| snapshot.error(e))?;
        all.extend(tasks);
    }
    if json {
        let views: Vec<spacebot_http::views::TaskView> = all.into_iter().map(Into::into).collect();
        let text = serde_json::to_string_pretty(&views)
            .map_err(|e| failed(format!("cannot write JSON: {e}")))?;
        println!("{text}");
        return Ok(());
    }
    if all.is_empty() {
        println!("no tasks");
        return Ok(());
    }
    println!(
        "{:<28} {:<17} {:<8} {:<22} TITLE",
        "TASK", "STATUS", "PRIORITY", "CREATED BY"
    );
    for t in all {
        println!(
            "{:<28} {:<17} {:<8} {:<22} {}",
            format!("{}#{}", t.agent, t.number),
            t.status.to_string(),
            t.priority.to_string(),
            t.created_by,
            t.title
        );
    }
    Ok(())
}

fn list(agents: &[AgentId]) -> String {
    if agents.is_empty() {
        "none".into()
    } else {
        agents
            .iter()
            .map(AgentId::as_str)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// `spacebot channel`.
pub(crate) async fn channel(
    dir: &Path,
    channel: &str,
    agent: Option<&str>,
    limit: Option<usize>,
    json: bool,
) -> Result<(), CliError> {
    let channel_id = ChannelId::new(channel);
    let owner = match (agent, channel_id.as_link()) {
        (Some(agent), _) => agent_arg(agent)?,
        (None, Some((owner, _))) => owner,
        (None, None) => {
            return Err(failed(format!(
                "{channel:?} is not a link channel (link:{{owner}}:{{peer}}); name its owner with --agent"
            )));
        }
    };
    let snapshot = Snapshot::open(dir).await?;
    if !snapshot.agents.contains(&owner) {
        return Err(failed(format!(
            "{}: no agent {owner} here (agents: {})",
            dir.display(),
            list(&snapshot.agents)
        )));
    }
    let records = snapshot
        .stores
        .channels
        .history(&owner, &channel_id, limit)
        .await
        .map_err(|e| snapshot.error(e))?;
    if json {
        let views: Vec<spacebot_http::views::RecordView> =
            records.into_iter().map(Into::into).collect();
        let text = serde_json::to_string_pretty(&views)
            .map_err(|e| failed(format!("cannot write JSON: {e}")))?;
        println!("{text}");
        return Ok(());
    }
    if records.is_empty() {
        let known = snapshot
            .stores
            .channels
            .channels(&owner)
            .await
            .map_err(|e| snapshot.error(e))?;
        let names: Vec<String> = known.iter().map(|c| c.to_string()).collect();
        println!(
            "{owner}'s channel {channel} is empty (its channels: {})",
            if names.is_empty() {
                "none".into()
            } else {
                names.join(", ")
            }
        );
        return Ok(());
    }
    for r in records {
        println!(
            "#{} {} {} {}: {}",
            r.seq,
            utc(r.record.at.0),
            r.record.kind,
            r.record.author,
            r.record.content
        );
    }
    Ok(())
}

/// `2026-11-24T07:58:18.668Z` for milliseconds since the Unix epoch.
fn utc(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let millis = ms.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use spacebot_core::{NewTask, TaskStore, Timestamp};
    use spacebot_sqlite::{Layout, SqliteOptions};

    /// A directory of either SQLite layout shows every agent with rows; one in the per-agent
    /// layout is read through a migrated copy and left as it was.
    #[tokio::test]
    async fn a_snapshot_lists_the_agents_of_either_layout_and_leaves_the_directory_as_it_was() {
        for layout in [Layout::Organization, Layout::PerAgent] {
            let dir = tempfile::tempdir().unwrap();
            let stores = SqliteOptions::new()
                .layout(layout)
                .open(dir.path())
                .await
                .unwrap();
            for agent in ["lead", "worker"] {
                let agent = super::AgentId::parse(agent).unwrap();
                stores
                    .tasks()
                    .create(&agent, NewTask::new("t", ""), Timestamp(1))
                    .await
                    .unwrap();
            }
            stores.close().await;
            let had_agents_dir = dir.path().join("agents").is_dir();
            assert_eq!(had_agents_dir, layout == Layout::PerAgent);
            let snapshot = super::Snapshot::open(dir.path()).await.unwrap();
            let names: Vec<&str> = snapshot.agents.iter().map(|a| a.as_str()).collect();
            assert_eq!(names, ["lead", "worker"], "{layout:?}");
            assert_eq!(dir.path().join("agents").is_dir(), had_agents_dir);
            assert!(!dir.path().join("agents.migrated").exists());
        }
    }

    #[test]
    fn utc_formats_epoch_milliseconds() {
        assert_eq!(super::utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(super::utc(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(super::utc(1_795_507_098_668), "2026-11-24T07:58:18.668Z");
    }
}
