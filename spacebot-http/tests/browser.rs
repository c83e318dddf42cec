//! The dashboard in a real browser: headless Chromium driven through chromedriver.
//!
//! Needs `/usr/bin/chromium` and `/usr/bin/chromedriver` (Debian: `apt-get install chromium
//! chromium-driver`; elsewhere set `SPACEBOT_CHROMIUM` and `SPACEBOT_CHROMEDRIVER`). Without them the
//! test is skipped, except under CI (`CI` set), where it fails.
//! Screenshots go to `target/browser/`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;
use spacebot_core::llm::{ChatMessage, ChatResponse};
use spacebot_core::testing::ScriptedLlm;

fn chromium() -> String {
    std::env::var("SPACEBOT_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into())
}

fn chromedriver() -> String {
    std::env::var("SPACEBOT_CHROMEDRIVER").unwrap_or_else(|_| "/usr/bin/chromedriver".into())
}

struct Driver {
    child: Child,
    port: u16,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start_driver() -> Driver {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(chromedriver())
        // Without --allowed-ips chromedriver listens on the loopback interface only.
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("chromedriver did not start");
    let driver = Driver { child, port };
    let status = format!("http://127.0.0.1:{port}/status");
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            if let Ok(r) = reqwest::get(&status).await
                && r.status().is_success()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("chromedriver did not answer within 20 s");
    driver
}

async fn browser(driver: &Driver, profile: &Path) -> Client {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": chromium(),
            "args": [
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1400,1100",
                format!("--user-data-dir={}", profile.display()),
            ]
        }),
    );
    ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{}", driver.port))
        .await
        .expect("no browser session")
}

fn screenshots_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let dir = target.join("browser");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn screenshot(client: &Client, name: &str) {
    let png = client.screenshot().await.unwrap();
    let path = screenshots_dir().join(name);
    std::fs::write(&path, png).unwrap();
    eprintln!("screenshot: {}", path.display());
}

/// Waits (up to 15 s) until the script returns true in the page.
async fn wait_js(client: &Client, what: &str, script: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let value = client.execute(script, vec![]).await.unwrap();
        if value == json!(true) {
            return;
        }
        if tokio::time::Instant::now() > deadline {
            let _ = screenshot(client, &format!("failed-{}.png", what.replace(' ', "-"))).await;
            panic!("the page did not show {what} within 15 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn select(client: &Client, select: &str, value: &str) {
    client
        .find(Locator::Css(&format!("{select} option[value=\"{value}\"]")))
        .await
        .unwrap_or_else(|_| panic!("no option {value} in {select}"))
        .click()
        .await
        .unwrap();
}

/// The chief delegates whatever it is asked to the lead, and reports the lead's result.
fn model() -> ScriptedLlm {
    let llm = ScriptedLlm::new().with_fallback(|request| {
        let agent = request.agent.as_ref().map_or("?", |a| a.as_str());
        let heard_back = request.messages.iter().any(|m| matches!(m, ChatMessage::User { content } if content.contains("release notes are written")));
        Ok(ChatResponse::text(match agent {
            "lead" => "The release notes are written.".to_string(),
            "chief" if heard_back => "Done: the lead wrote the release notes.".to_string(),
            _ => format!("{agent} says ok"),
        }))
    });
    llm.push_tool_call(
        &id("chief"),
        "send_agent_message",
        json!({"target": "lead", "message": "Write the release notes for 0.1."}),
    );
    llm
}

/// Whether the browser and its driver are installed; under CI their absence fails the test.
fn browser_installed() -> bool {
    let (browser_bin, driver_bin) = (chromium(), chromedriver());
    if Path::new(&browser_bin).exists() && Path::new(&driver_bin).exists() {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "{browser_bin} or {driver_bin} is missing; install them with: apt-get install -y chromium chromium-driver"
    );
    eprintln!(
        "skipped: {browser_bin} or {driver_bin} is missing (the test fails instead under CI)"
    );
    false
}

#[tokio::test]
async fn the_dashboard_delegates_through_the_chat_and_shows_it_live() {
    if !browser_installed() {
        return;
    }
    let s = serve_with(Options {
        llm: Some(model()),
        http: spacebot_http::HttpConfig::with_token(TOKEN).with_trace_url(TRACE_URL),
        ..Options::default()
    })
    .await;
    let driver = start_driver().await;
    let profile = tempfile::tempdir().unwrap();
    let client = browser(&driver, profile.path()).await;
    let result = run(&s, &client).await;
    let _ = client.close().await;
    result
}

async fn run(s: &Server, client: &Client) {
    client
        .goto(&format!("{}/#token={TOKEN}", s.base))
        .await
        .unwrap();
    // The graph: three agents, two links, the chief -> cm link one-way.
    wait_js(client, "the graph", "return !!window.cytoscape && document.querySelector('#graph canvas') !== null && document.querySelectorAll('#links tbody tr').length === 2;").await;
    wait_js(
        client,
        "a live event stream",
        "return document.querySelector('#conn').textContent === 'live';",
    )
    .await;
    // Served without shared notes, the notes panel says so and nothing is reported as an error.
    wait_js(
        client,
        "notes not enabled",
        "return !document.querySelector('#notes-status').hidden && document.querySelector('#notes-status').textContent.includes('not enabled') && document.querySelector('#notes').hidden;",
    )
    .await;
    assert_eq!(
        client
            .execute(
                "return document.querySelector('#error').textContent;",
                vec![]
            )
            .await
            .unwrap(),
        json!("")
    );
    screenshot(client, "dashboard-start.png").await;

    select(client, "#board-agent", "lead").await;
    let link = s.link_id("chief", "lead").await;
    select(client, "#timeline-link", &link).await;
    wait_js(client, "an empty board", "return document.querySelectorAll('#tasks .task').length === 0 && document.querySelector('#tasks .col') !== null;").await;
    let before: u64 = client
        .execute(
            "return document.querySelectorAll('#timeline .record').length;",
            vec![],
        )
        .await
        .unwrap()
        .as_u64()
        .unwrap();

    select(client, "#chat-agent", "chief").await;
    client
        .find(Locator::Css("#chat-input"))
        .await
        .unwrap()
        .send_keys("Please get the release notes written.")
        .await
        .unwrap();
    client
        .find(Locator::Css("#chat-send"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();

    wait_js(
        client,
        "the delegated task on the lead's board",
        "return document.querySelector('#tasks .task[data-task=\"lead#1\"]') !== null;",
    )
    .await;
    wait_js(
        client,
        "the link timeline growing",
        &format!("return document.querySelectorAll('#timeline .record').length > {before};"),
    )
    .await;
    wait_js(client, "the reply in the chat", "return [...document.querySelectorAll('#chat-log .msg.agent')].some(m => m.textContent.includes('Done: the lead wrote the release notes.'));").await;
    wait_js(client, "the task done", "return document.querySelector('#tasks .task[data-task=\"lead#1\"]').dataset.status === 'done';").await;
    wait_js(client, "live activity", "return [...document.querySelectorAll('#activity li')].some(li => li.textContent.includes('task_created'));").await;
    screenshot(client, "dashboard-after-delegation.png").await;

    // Disabling a link from the dashboard takes effect at once and shows as a dashed edge.
    client
        .find(Locator::Css(&format!(
            "#links tr[data-link=\"{link}\"] input[type=checkbox]"
        )))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_js(client, "the disabled link", &format!("return document.querySelector('#links tr[data-link=\"{link}\"]').className === 'disabled';")).await;
    assert!(!s.org.link(&id("chief"), &id("lead")).unwrap().enabled);
    wait_js(
        client,
        "a dashed edge",
        &format!("return window.spacebotDashboard.edgeStyle('{link}') === 'dashed';"),
    )
    .await;
    screenshot(client, "dashboard-link-disabled.png").await;

    // A task with a stored trace context links to its trace.
    let mut traced = spacebot_core::NewTask::new("traced", "a task of a traced request");
    traced.status = spacebot_core::TaskStatus::Backlog;
    traced.metadata.trace_context = Some(format!("00-{TRACE_ID}-00f067aa0ba902b7-01"));
    s.org
        .stores()
        .tasks
        .create(&id("cm"), traced, spacebot_core::Timestamp(0))
        .await
        .unwrap();
    select(client, "#board-agent", "cm").await;
    let href = TRACE_URL.replace("{trace_id}", TRACE_ID);
    wait_js(
        client,
        "the task's trace link",
        &format!("const a = document.querySelector('#tasks .task[data-task=\"cm#1\"] a.trace'); return a !== null && a.href === '{href}' && a.dataset.traceId === '{TRACE_ID}';"),
    )
    .await;
}

const TRACE_URL: &str = "http://localhost:16686/trace/{trace_id}";
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

/// The notes panel's organization: the chief writes the release plan, the lead reads it.
fn notes_org() -> String {
    format!(
        "{ORG}\n[[notes]]\nname = \"release-plan\"\ndescription = \"What ships when\"\nreaders = [\"lead\"]\nwriters = [\"chief\"]\n"
    )
}

/// A model-written text that would run script if it were ever taken as markup.
const HOSTILE: &str =
    "Ship 0.1 on Friday.\n<img src=x onerror=\"window.noteMarkupRan = true\"><b>bold?</b>";

#[tokio::test]
async fn the_dashboard_shows_shared_notes_live_and_as_text() {
    if !browser_installed() {
        return;
    }
    let llm = ScriptedLlm::new().with_fallback(|request| {
        let agent = request.agent.as_ref().map_or("?", |a| a.as_str());
        Ok(ChatResponse::text(format!("{agent} says ok")))
    });
    // The chief's first turn writes the note through its tool, as a model would.
    llm.push_tool_call(
        &id("chief"),
        "write_shared_note",
        json!({"name": "release-plan", "text": HOSTILE, "base_version": 0}),
    );
    let s = serve_with(Options {
        llm: Some(llm),
        toml: notes_org(),
        notes: true,
        ..Options::default()
    })
    .await;
    let driver = start_driver().await;
    let profile = tempfile::tempdir().unwrap();
    let client = browser(&driver, profile.path()).await;
    let result = run_notes(&s, &client).await;
    let _ = client.close().await;
    result
}

/// The text of the first element matching `selector`.
async fn text_of(client: &Client, selector: &str) -> String {
    client
        .execute(
            &format!("return document.querySelector('{selector}').textContent;"),
            vec![],
        )
        .await
        .unwrap()
        .as_str()
        .unwrap_or_else(|| panic!("no {selector}"))
        .to_string()
}

async fn run_notes(s: &Server, client: &Client) {
    client
        .goto(&format!("{}/#token={TOKEN}", s.base))
        .await
        .unwrap();
    wait_js(
        client,
        "a live event stream",
        "return document.querySelector('#conn').textContent === 'live';",
    )
    .await;
    // The configured note, never written yet.
    wait_js(client, "the note never written", "const tr = document.querySelector('#notes tr[data-note=\"release-plan\"]'); return tr !== null && tr.dataset.version === '0' && tr.querySelector('.readers').textContent === 'lead' && tr.querySelector('.writers').textContent === 'chief';").await;

    // The chief writes it through write_shared_note: the panel follows from the event stream.
    let (status, body) = s
        .post(
            "/api/agents/chief/messages",
            json!({"content": "Write down the release plan."}),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    wait_js(client, "version 1 by the chief", "const tr = document.querySelector('#notes tr[data-note=\"release-plan\"]'); return tr.dataset.version === '1' && tr.querySelector('.version').textContent === '1' && tr.querySelector('.author').textContent === 'chief' && tr.querySelector('.updated').textContent !== '—';").await;
    client
        .find(Locator::Css("#notes tr[data-note=\"release-plan\"]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_js(
        client,
        "the note's text",
        "return document.querySelector('#note-text').dataset.version === '1';",
    )
    .await;
    // Shown as text, exactly as written: no element made of it, no handler run.
    assert_eq!(text_of(client, "#note-text").await, HOSTILE);
    let markup = client
        .execute(
            "return [document.querySelectorAll('#notes-panel img, #notes-panel b').length, window.noteMarkupRan === true];",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(markup, json!([0, false]), "note text taken as markup");
    assert_eq!(
        text_of(client, "#note-description").await,
        "What ships when"
    );
    screenshot(client, "dashboard-note-v1.png").await;

    // A second write arrives (the operator's, through the API): the page shows it without reload.
    let (status, body) = s
        .send(
            reqwest::Method::PUT,
            "/api/notes/release-plan",
            Some(json!({"text": "Ship 0.1 on Monday.", "base_version": 1})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    wait_js(client, "version 2 live", "const tr = document.querySelector('#notes tr[data-note=\"release-plan\"]'); const text = document.querySelector('#note-text'); return tr.dataset.version === '2' && tr.querySelector('.author').textContent === 'operator' && text.dataset.version === '2' && text.textContent === 'Ship 0.1 on Monday.';").await;

    // The history, newest first; choosing version 1 shows its text, still as text.
    wait_js(client, "two versions in the history", "return [...document.querySelectorAll('#note-history li')].map(li => li.dataset.version).join(',') === '2,1';").await;
    client
        .find(Locator::Css("#note-history li[data-version=\"1\"] button"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_js(
        client,
        "version 1 from the history",
        "return document.querySelector('#note-text').dataset.version === '1' && document.querySelector('#note-history li.current').dataset.version === '1';",
    )
    .await;
    assert_eq!(text_of(client, "#note-text").await, HOSTILE);
    let markup = client
        .execute(
            "return [document.querySelectorAll('#notes-panel img, #notes-panel b').length, window.noteMarkupRan === true];",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(markup, json!([0, false]), "an old version taken as markup");
    screenshot(client, "dashboard-note-history.png").await;

    // Granting from the panel: the lead may now write it, stored and shown.
    client
        .find(Locator::Css(
            "#note-access tr[data-agent=\"lead\"] select option[value=\"read_write\"]",
        ))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_js(client, "the lead among the writers", "const tr = document.querySelector('#notes tr[data-note=\"release-plan\"]'); return tr.querySelector('.writers').textContent === 'chief, lead' && tr.querySelector('.readers').textContent === '—';").await;
    let access = s
        .notes
        .as_ref()
        .unwrap()
        .access("release-plan")
        .await
        .unwrap();
    assert_eq!(
        access.get(&id("lead")),
        Some(&spacebot_notes::Access::ReadWrite)
    );
    // A grant changed elsewhere arrives live too.
    s.notes
        .as_ref()
        .unwrap()
        .revoke("release-plan", &id("lead"))
        .await
        .unwrap();
    wait_js(client, "the revocation live", "const tr = document.querySelector('#notes tr[data-note=\"release-plan\"]'); return tr.querySelector('.writers').textContent === 'chief' && document.querySelector('#note-access tr[data-agent=\"lead\"] select').value === '';").await;
    assert_eq!(
        client
            .execute(
                "return document.querySelector('#error').textContent;",
                vec![]
            )
            .await
            .unwrap(),
        json!("")
    );
    screenshot(client, "dashboard-notes.png").await;
}
