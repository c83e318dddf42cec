//! The `spacebot` command: every subcommand, exit codes, read-only access to data directories.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use assert_cmd::cargo::CommandCargoExt;
use spacebot_core::delegation::DelegationOrigin;
use spacebot_core::llm::ChatResponse;
use spacebot_core::testing::ScriptedLlm;
use spacebot_core::{AgentId, ChannelId, OrgConfig, Organization, Stores, TaskRef};

const ORG: &str = r#"
[[agents]]
id = "chief"
name = "Chief"

[[agents]]
id = "lead"
name = "Tech Lead"

[[links]]
from = "chief"
to = "lead"
direction = "two_way"
relationship = "superior"
"#;

fn spacebot() -> assert_cmd::Command {
    assert_cmd::Command::cargo_bin("spacebot").unwrap()
}

fn stdout(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn write_config(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("org.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// Every file under `dir` with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                files.insert(path.clone(), std::fs::read(&path).unwrap());
            }
        }
    }
    files
}

#[derive(Clone, Copy, Debug)]
enum Backend {
    Sqlite,
    Redb,
}

enum Opened {
    Sqlite(spacebot_sqlite::SqliteStores),
    Redb(Arc<spacebot_redb::RedbStore>),
}

impl Opened {
    async fn open(backend: Backend, dir: &Path) -> Self {
        match backend {
            Backend::Sqlite => {
                Self::Sqlite(spacebot_sqlite::SqliteStores::open(dir).await.unwrap())
            }
            Backend::Redb => Self::Redb(
                spacebot_redb::RedbStore::open_async(dir, spacebot_redb::RedbOptions::default())
                    .await
                    .unwrap(),
            ),
        }
    }

    fn stores(&self) -> Stores {
        match self {
            Self::Sqlite(s) => s.stores(),
            Self::Redb(s) => s.stores(),
        }
    }

    /// Closes the files and releases the directory's lock.
    async fn close(&self) {
        match self {
            Self::Sqlite(s) => s.close().await,
            Self::Redb(s) => s.close().await,
        }
    }
}

/// A running organization on a data directory, and its stores.
struct Running {
    org: Organization,
    opened: Opened,
}

impl Running {
    async fn stop(self) {
        self.org.shutdown().await.unwrap();
        drop(self.org);
        self.opened.close().await;
    }
}

/// Runs an organization on `dir` long enough for the chief to delegate one task to the lead and
/// get it done, then stops it (and closes its files) unless `keep_running`.
async fn populate(backend: Backend, dir: &Path, keep_running: bool) -> Option<Running> {
    let llm = ScriptedLlm::new().with_fallback(|_| Ok(ChatResponse::text("report written")));
    let opened = Opened::open(backend, dir).await;
    let org = Organization::builder(OrgConfig::from_toml_str(ORG).unwrap())
        .stores(opened.stores())
        .llm(Arc::new(llm))
        .build()
        .await
        .unwrap();
    org.start_all().await.unwrap();
    let chief = AgentId::parse("chief").unwrap();
    let task = org
        .delegate(
            &chief,
            "lead",
            "Write the weekly report",
            DelegationOrigin::new(ChannelId::new("web:cli")),
        )
        .await
        .unwrap();
    let task = TaskRef::new(task.agent, task.number);
    tokio::time::timeout(Duration::from_secs(10), org.wait_task_ended(&task))
        .await
        .unwrap()
        .unwrap();
    let running = Running { org, opened };
    if keep_running {
        return Some(running);
    }
    running.stop().await;
    None
}

/// Asserts two snapshots are equal without printing megabytes of bytes.
fn assert_same(
    after: &BTreeMap<PathBuf, Vec<u8>>,
    before: &BTreeMap<PathBuf, Vec<u8>>,
    what: &str,
) {
    let names = |m: &BTreeMap<PathBuf, Vec<u8>>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(
        names(after),
        names(before),
        "{what}: files were added or removed"
    );
    for (path, bytes) in after {
        assert!(bytes == &before[path], "{what}: {} changed", path.display());
    }
}

#[test]
fn help_everywhere_and_usage_errors_exit_2() {
    let out = spacebot().arg("--help").output().unwrap();
    assert!(out.status.success());
    for command in ["serve", "check", "topology", "tasks", "channel"] {
        assert!(
            stdout(&out).contains(command),
            "{command} missing from --help"
        );
        let sub = spacebot().args([command, "--help"]).output().unwrap();
        assert!(sub.status.success(), "{command} --help");
        assert!(
            stdout(&sub).contains("Usage: spacebot"),
            "{command}: {}",
            stdout(&sub)
        );
    }
    for args in [
        &[][..],
        &["frobnicate"],
        &["tasks"],
        &["topology", "x.toml", "--format", "png"],
        &["serve", "--config", "x"],
    ] {
        let out = spacebot().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
    }
    spacebot().arg("--version").assert().success();
}

#[test]
fn check_lists_every_problem() {
    let dir = tempfile::tempdir().unwrap();
    let good = write_config(dir.path(), ORG);
    let out = spacebot().arg("check").arg(&good).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("ok (2 agents, 1 links)"),
        "{}",
        stdout(&out)
    );

    let bad = write_config(
        dir.path(),
        "[[agents]]\nid = \"a\"\nname = \"A\"\n\n[[links]]\nfrom = \"a\"\nto = \"a\"\ndirection = \"sideways\"\n\n[[links]]\nfrom = \"a\"\nto = \"ghost\"\n",
    );
    let out = spacebot().arg("check").arg(&bad).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("3 problems"), "{err}");
    for needle in ["sideways", "itself", "ghost"] {
        assert!(err.contains(needle), "{needle} not in {err}");
    }
    let out = spacebot()
        .args(["check", "/nonexistent/org.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("/nonexistent/org.toml"),
        "{}",
        stderr(&out)
    );
    std::fs::write(&bad, "[[agents]\n").unwrap();
    let out = spacebot().arg("check").arg(&bad).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("TOML"), "{}", stderr(&out));
}

#[test]
fn topology_in_three_formats() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), ORG);
    let out = spacebot().arg("topology").arg(&config).output().unwrap();
    assert!(out.status.success());
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["agents"][1]["name"], "Tech Lead");
    assert_eq!(json["links"][0]["relationship"], "superior");
    let out = spacebot()
        .arg("topology")
        .arg(&config)
        .args(["--format", "dot"])
        .output()
        .unwrap();
    assert!(
        stdout(&out).contains("\"chief\" -> \"lead\" [label=\"superior\", dir=both];"),
        "{}",
        stdout(&out)
    );
    let out = spacebot()
        .arg("topology")
        .arg(&config)
        .args(["--format", "mermaid"])
        .output()
        .unwrap();
    assert!(stdout(&out).starts_with("flowchart TD"), "{}", stdout(&out));
    let out = spacebot()
        .args(["topology", "/nonexistent.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
}

async fn reads_a_stopped_organization(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    populate(backend, dir.path(), false).await;
    let before = snapshot(dir.path());

    let out = spacebot().arg("tasks").arg(dir.path()).output().unwrap();
    assert!(out.status.success(), "{backend:?}: {}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("lead#1")
            && text.contains("done")
            && text.contains("Write the weekly report"),
        "{text}"
    );
    let out = spacebot()
        .arg("tasks")
        .arg(dir.path())
        .args(["--agent", "lead", "--json"])
        .output()
        .unwrap();
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json[0]["reference"], "lead#1");
    assert_eq!(json[0]["result"], "report written");
    let out = spacebot()
        .arg("tasks")
        .arg(dir.path())
        .args(["--status", "ready"])
        .output()
        .unwrap();
    assert!(stdout(&out).contains("no tasks"), "{}", stdout(&out));
    let out = spacebot()
        .arg("tasks")
        .arg(dir.path())
        .args(["--status", "sleeping"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("--status"), "{}", stderr(&out));
    let out = spacebot()
        .arg("tasks")
        .arg(dir.path())
        .args(["--agent", "ghost"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("no agent ghost"), "{}", stderr(&out));

    let out = spacebot()
        .arg("channel")
        .arg(dir.path())
        .arg("link:lead:chief")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("assigned task #1") && text.contains("completed task #1"),
        "{text}"
    );
    let out = spacebot()
        .arg("channel")
        .arg(dir.path())
        .args(["link:lead:chief", "--limit", "1", "--json"])
        .output()
        .unwrap();
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json.as_array().unwrap().len(), 1);
    let out = spacebot()
        .arg("channel")
        .arg(dir.path())
        .arg("web:cli")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("--agent"), "{}", stderr(&out));
    let out = spacebot()
        .arg("channel")
        .arg(dir.path())
        .args(["web:cli", "--agent", "chief"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));

    // Read-only: not one byte changed, no file added or removed.
    assert_same(
        &snapshot(dir.path()),
        &before,
        &format!("{backend:?}: reading"),
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn tasks_and_channel_read_a_stopped_sqlite_organization() {
    reads_a_stopped_organization(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn tasks_and_channel_read_a_stopped_redb_organization() {
    reads_a_stopped_organization(Backend::Redb).await;
}

async fn damaged(backend: Backend, file: &str) {
    let dir = tempfile::tempdir().unwrap();
    populate(backend, dir.path(), false).await;
    std::fs::write(
        dir.path().join(file),
        b"this is not a database, it was overwritten by mistake",
    )
    .unwrap();
    let before = snapshot(dir.path());
    for args in [&["tasks"][..], &["channel"]] {
        let mut cmd = spacebot();
        cmd.args(args).arg(dir.path());
        if args == ["channel"] {
            cmd.arg("link:lead:chief");
        }
        let out = cmd.output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(1),
            "{backend:?} {args:?}: {}",
            stdout(&out)
        );
        let err = stderr(&out);
        assert!(err.to_lowercase().contains("corrupt"), "{backend:?}: {err}");
        assert!(
            err.contains(&dir.path().display().to_string()),
            "{backend:?}: the error should name the directory: {err}"
        );
        assert!(
            !err.contains("spacebot-read-"),
            "{backend:?}: the error names the private copy: {err}"
        );
    }
    assert_same(
        &snapshot(dir.path()),
        &before,
        &format!("{backend:?}: a damaged directory"),
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_damaged_sqlite_directory_is_a_clear_error_and_untouched() {
    damaged(Backend::Sqlite, "instance.db").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_damaged_redb_directory_is_a_clear_error_and_untouched() {
    damaged(Backend::Redb, "instance.redb").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_running_organization_or_a_foreign_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let running = populate(Backend::Sqlite, dir.path(), true).await.unwrap();
    let out = spacebot().arg("tasks").arg(dir.path()).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("in use by a running organization"),
        "{}",
        stderr(&out)
    );
    running.stop().await;
    let out = spacebot().arg("tasks").arg(dir.path()).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));

    let empty = tempfile::tempdir().unwrap();
    let out = spacebot().arg("tasks").arg(empty.path()).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("not a spacebot data directory"),
        "{}",
        stderr(&out)
    );
    assert!(
        std::fs::read_dir(empty.path()).unwrap().next().is_none(),
        "files were created"
    );
}

struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn serve_prints_the_url_and_token_and_serves_the_api() {
    for store in ["sqlite", "redb"] {
        let dir = tempfile::tempdir().unwrap();
        let config = write_config(dir.path(), ORG);
        let data = dir.path().join("data");
        let mut command = Command::cargo_bin("spacebot").unwrap();
        command
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .arg("--data-dir")
            .arg(&data)
            .args(["--store", store, "--addr", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // The scripted demo model, whatever the developer's environment: built with `openai`,
        // `serve` picks the real provider when OPENAI_API_KEY, OPENAI_BASE_URL, SPACEBOT_MODEL or
        // SPACEBOT_DIALECT is set; SPACEBOT_TOKEN would fix the token.
        for (name, _) in std::env::vars_os() {
            let text = name.to_string_lossy();
            if text.starts_with("SPACEBOT_") || text.starts_with("OPENAI_") {
                command.env_remove(&name);
            }
        }
        let mut child = Child(command.spawn().unwrap());
        let stdout = child.0.stdout.take().unwrap();
        let (found, found_rx) = tokio::sync::oneshot::channel();
        let _reader = std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let mut url = None;
            let mut token = None;
            while let Some(Ok(line)) = lines.next() {
                if let Some(rest) = line.strip_prefix("dashboard: ") {
                    url = Some(rest.split("/#token=").next().unwrap().to_string());
                }
                if let Some(rest) = line.strip_prefix("token:") {
                    token = Some(rest.trim().to_string());
                }
                if let (Some(url), Some(token)) = (&url, &token) {
                    let _ = found.send((url.clone(), token.clone()));
                    // Keep reading so the server never writes to a closed pipe.
                    for _ in lines.by_ref() {}
                    return;
                }
            }
        });
        let (url, token) = tokio::time::timeout(Duration::from_secs(30), found_rx)
            .await
            .unwrap()
            .expect("no dashboard and token lines");
        assert!(url.starts_with("http://127.0.0.1:"), "{url}");
        assert_eq!(token.len(), 64);
        let http = reqwest::Client::new();
        let r = http.get(format!("{url}/api/agents")).send().await.unwrap();
        assert_eq!(r.status(), 401);
        let agents: serde_json::Value = http
            .get(format!("{url}/api/agents"))
            .bearer_auth(&token)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(agents.as_array().unwrap().len(), 2, "{agents}");
        let page = http
            .get(format!("{url}/"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(page.contains("cytoscape"), "{page}");
        // A chat message to the chief is delegated to the lead by the demo model.
        let r = http
            .post(format!("{url}/api/agents/chief/messages"))
            .bearer_auth(&token)
            .json(&serde_json::json!({"content": "Draft the plan"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let tasks: serde_json::Value = http
                .get(format!("{url}/api/agents/lead/tasks?status=done"))
                .bearer_auth(&token)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            if tasks.as_array().is_some_and(|t| t.len() == 1) {
                assert_eq!(tasks[0]["description"], "Draft the plan");
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{store}: no task done within 10 s: {tasks}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        drop(child);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn ctrl_c_stops_serve_while_an_event_stream_is_open() {
    stops_on_signal("INT").await;
}

/// SIGTERM (docker, systemd) stops `serve` as Ctrl-C does.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_stops_serve_like_ctrl_c() {
    stops_on_signal("TERM").await;
}

/// `serve` on a port in use fails at once, before opening the data directory or starting any
/// agent.
#[test]
fn serve_reports_an_address_in_use_before_starting_anything() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), ORG);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let data = dir.path().join("data");
    let out = spacebot()
        .arg("serve")
        .arg("--config")
        .arg(&config)
        .arg("--data-dir")
        .arg(&data)
        .args(["--addr", &addr, "--insecure-no-auth"])
        .timeout(Duration::from_secs(30))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("cannot listen on {addr}")),
        "{}",
        stderr(&out)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).is_empty(),
        "nothing started: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(!data.exists(), "the data directory was not created");
}

/// Starts `serve`, opens an event stream, sends `signal` (`INT` or `TERM`): the stream ends,
/// `stopped` is printed, the process exits with success, and its data directory opens again at
/// once (the lock released, the databases closed).
async fn stops_on_signal(signal: &str) {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), ORG);
    let data = dir.path().join("data");
    let mut command = Command::cargo_bin("spacebot").unwrap();
    command
        .arg("serve")
        .arg("--config")
        .arg(&config)
        .arg("--data-dir")
        .arg(&data)
        .args(["--addr", "127.0.0.1:0", "--insecure-no-auth"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (name, _) in std::env::vars_os() {
        let text = name.to_string_lossy();
        if text.starts_with("SPACEBOT_") || text.starts_with("OPENAI_") {
            command.env_remove(&name);
        }
    }
    let mut child = Child(command.spawn().unwrap());
    let stdout = child.0.stdout.take().unwrap();
    let (found, found_rx) = tokio::sync::oneshot::channel();
    let (stopped, stopped_rx) = tokio::sync::oneshot::channel();
    let _reader = std::thread::spawn(move || {
        let mut found = Some(found);
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("dashboard: ")
                && let Some(found) = found.take()
            {
                let _ = found.send(rest.trim_end_matches('/').to_string());
            }
            if line == "stopped" {
                let _ = stopped.send(());
                return;
            }
        }
    });
    let url = tokio::time::timeout(Duration::from_secs(30), found_rx)
        .await
        .unwrap()
        .expect("no dashboard line");
    // An event-stream client stays connected.
    let mut events = reqwest::Client::new()
        .get(format!("{url}/api/events"))
        .send()
        .await
        .unwrap();
    assert_eq!(events.status(), 200);
    let pid = child.0.id().to_string();
    let status = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &pid])
        .status()
        .unwrap();
    assert!(status.success());
    // The stream ends and the server stops, well before any keep-alive would matter.
    let ended = tokio::time::timeout(Duration::from_secs(20), async {
        while let Ok(Some(_)) = events.chunk().await {}
    })
    .await;
    assert!(
        ended.is_ok(),
        "the event stream did not end after SIG{signal}"
    );
    tokio::time::timeout(Duration::from_secs(20), stopped_rx)
        .await
        .unwrap_or_else(|_| panic!("serve did not stop within 20 s of SIG{signal}"))
        .expect("serve's output ended without `stopped`");
    let exit = tokio::task::spawn_blocking(move || child.0.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(exit.success(), "SIG{signal}: {exit:?}");
    // Closed cleanly: no write-ahead log left, and the directory opens again at once.
    let mut left = Vec::new();
    let mut dirs = vec![data.clone()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.to_string_lossy().ends_with("-wal") {
                left.push(path);
            }
        }
    }
    assert!(left.is_empty(), "SIG{signal} left {left:?}");
    let stores = spacebot_sqlite::open(&data)
        .await
        .unwrap_or_else(|e| panic!("the data directory does not reopen after SIG{signal}: {e}"));
    stores.close().await;
}

/// The rule for links changed at run time: at the next `serve`, the configuration wins for the
/// links it names, and a warning says which it resets.
#[tokio::test(flavor = "multi_thread")]
async fn serve_warns_of_each_run_time_link_change_the_configuration_resets() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), ORG);
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    {
        // A first run's state: the configured link disabled and made a peer link at run time.
        let opened = Opened::open(Backend::Sqlite, &data).await;
        let stores = opened.stores();
        let parsed = OrgConfig::from_toml_str(ORG).unwrap();
        parsed
            .sync_links(stores.links.as_ref(), spacebot_core::Timestamp(1))
            .await
            .unwrap();
        let mut link = stores.links.list().await.unwrap().remove(0);
        link.enabled = false;
        link.relationship = spacebot_core::LinkRelationship::Peer;
        stores.links.update(&link).await.unwrap();
        opened.close().await;
    }
    let mut command = Command::cargo_bin("spacebot").unwrap();
    command
        .arg("serve")
        .arg("--config")
        .arg(&config)
        .arg("--data-dir")
        .arg(&data)
        .args(["--addr", "127.0.0.1:0", "--insecure-no-auth"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (name, _) in std::env::vars_os() {
        let text = name.to_string_lossy();
        if text.starts_with("SPACEBOT_") || text.starts_with("OPENAI_") {
            command.env_remove(&name);
        }
    }
    let mut child = Child(command.spawn().unwrap());
    let stdout = child.0.stdout.take().unwrap();
    let (found, found_rx) = tokio::sync::oneshot::channel();
    let _reader = std::thread::spawn(move || {
        let mut warnings = Vec::new();
        let mut lines = BufReader::new(stdout).lines();
        while let Some(Ok(line)) = lines.next() {
            if line.starts_with("warning: ") {
                warnings.push(line.clone());
            }
            if let Some(rest) = line.strip_prefix("dashboard: ") {
                let _ = found.send((rest.trim_end_matches('/').to_string(), warnings));
                for _ in lines.by_ref() {}
                return;
            }
        }
    });
    let (url, warnings) = tokio::time::timeout(Duration::from_secs(30), found_rx)
        .await
        .unwrap()
        .expect("no dashboard line");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].starts_with(
            "warning: link chief -> lead was changed at run time; the configuration resets it: disabled -> enabled, peer -> superior"
        ),
        "{warnings:?}"
    );
    let links: serde_json::Value = reqwest::get(format!("{url}/api/links"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(links[0]["enabled"], true, "{links}");
    assert_eq!(links[0]["relationship"], "superior", "{links}");
    drop(child);
}
