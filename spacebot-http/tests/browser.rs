//! The dashboard in a real browser: headless Chromium driven through chromedriver.
//!
//! Needs `/usr/bin/chromium` and `/usr/bin/chromedriver` (Debian: `apt-get install chromium
//! chromium-driver`; elsewhere set `SPACEBOT_CHROMIUM` and `SPACEBOT_CHROMEDRIVER`). Without them the
//! tests are compiled as ignored, with the reason (`cfg(spacebot_chromium)`, set by the build
//! script), unless `SPACEBOT_REQUIRE_CHROMIUM=1` (CI), when they run and fail without them.
//! Screenshots go to `target/browser/` (under `CARGO_TARGET_DIR` when it is set).

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
    // The browser's console, read back by `console_errors`.
    caps.insert("goog:loggingPrefs".into(), json!({"browser": "ALL"}));
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

/// Panics, saying what to install, when the browser or its driver is missing (the tests run
/// without them only when told to, under `SPACEBOT_REQUIRE_CHROMIUM=1`).
fn browser_installed() {
    let (browser_bin, driver_bin) = (chromium(), chromedriver());
    assert!(
        Path::new(&browser_bin).exists() && Path::new(&driver_bin).exists(),
        "{browser_bin} or {driver_bin} is missing; install them with: apt-get install -y chromium chromium-driver"
    );
}

#[tokio::test]
#[cfg_attr(
    not(spacebot_chromium),
    ignore = "no Chromium here: install chromium and chromium-driver, or set SPACEBOT_CHROMIUM and SPACEBOT_CHROMEDRIVER; see README"
)]
async fn the_dashboard_delegates_through_the_chat_and_shows_it_live() {
    browser_installed();
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
#[cfg_attr(
    not(spacebot_chromium),
    ignore = "no Chromium here: install chromium and chromium-driver, or set SPACEBOT_CHROMIUM and SPACEBOT_CHROMEDRIVER; see README"
)]
async fn the_dashboard_shows_shared_notes_live_and_as_text() {
    browser_installed();
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

/// The browser console's errors since the last call (chromedriver's log of the session).
async fn console_errors(driver: &Driver, client: &Client) -> Vec<String> {
    let session = client.session_id().await.unwrap().unwrap();
    let log: serde_json::Value = reqwest::Client::new()
        .post(format!(
            "http://127.0.0.1:{}/session/{session}/se/log",
            driver.port
        ))
        .json(&json!({"type": "browser"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    log["value"]
        .as_array()
        .unwrap_or_else(|| panic!("no browser log: {log}"))
        .iter()
        .filter(|e| e["level"] == "SEVERE")
        .map(|e| e["message"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// A point of the page (CSS pixels from the viewport's corner) the page computes.
async fn point(client: &Client, script: &str) -> (f64, f64) {
    let p = client.execute(script, vec![]).await.unwrap();
    (p["x"].as_f64().unwrap(), p["y"].as_f64().unwrap())
}

/// Presses the left button at `from`, moves to `to` in steps, and lets go.
async fn drag(client: &Client, from: (f64, f64), to: (f64, f64)) {
    use fantoccini::actions::{InputSource, MOUSE_BUTTON_LEFT, MouseActions, PointerAction};
    let mut mouse = MouseActions::new("mouse".into())
        .then(PointerAction::MoveTo {
            duration: None,
            x: from.0,
            y: from.1,
        })
        .then(PointerAction::Down {
            button: MOUSE_BUTTON_LEFT,
        });
    for i in 1..=5 {
        let f = f64::from(i) / 5.0;
        mouse = mouse.then(PointerAction::MoveTo {
            duration: Some(Duration::from_millis(30)),
            x: from.0 + (to.0 - from.0) * f,
            y: from.1 + (to.1 - from.1) * f,
        });
    }
    let mouse = mouse.then(PointerAction::Up {
        button: MOUSE_BUTTON_LEFT,
    });
    client.perform_actions(mouse).await.unwrap();
}

/// Clicks at a point of the page.
async fn click_at(client: &Client, at: (f64, f64)) {
    use fantoccini::actions::{InputSource, MOUSE_BUTTON_LEFT, MouseActions, PointerAction};
    let mouse = MouseActions::new("mouse".into())
        .then(PointerAction::MoveTo {
            duration: None,
            x: at.0,
            y: at.1,
        })
        .then(PointerAction::Down {
            button: MOUSE_BUTTON_LEFT,
        })
        .then(PointerAction::Up {
            button: MOUSE_BUTTON_LEFT,
        });
    client.perform_actions(mouse).await.unwrap();
}

async fn click(client: &Client, css: &str) {
    client
        .find(Locator::Css(css))
        .await
        .unwrap_or_else(|_| panic!("no {css}"))
        .click()
        .await
        .unwrap();
}

async fn no_page_error(client: &Client) {
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
}

/// The chief delegates to the lead, which takes its time; the chief then answers. The community
/// manager answers at length, streamed word by word.
fn console_model() -> ScriptedLlm {
    let llm = ScriptedLlm::new().with_fallback(|request| {
        let agent = request.agent.as_ref().map_or("?", |a| a.as_str());
        let heard_back = request.messages.iter().any(|m| matches!(m, ChatMessage::User { content } if content.contains("release notes are written")));
        Ok(ChatResponse::text(match agent {
            "lead" => "The release notes are written.".to_string(),
            "chief" if heard_back => "Done: the lead wrote the release notes.".to_string(),
            "cm" => STREAMED.to_string(),
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

const STREAMED: &str = "Here is the community update: the release ships on Friday, with notes for every user and a short video.";

async fn send_chat(client: &Client, agent: &str, text: &str) {
    select(client, "#chat-agent", agent).await;
    client
        .find(Locator::Css("#chat-input"))
        .await
        .unwrap()
        .send_keys(text)
        .await
        .unwrap();
    click(client, "#chat-send").await;
}

/// A request's tree grows live across two hops; an answer streams in; the chat keeps its
/// history across a reload.
#[tokio::test]
#[cfg_attr(
    not(spacebot_chromium),
    ignore = "no Chromium here: install chromium and chromium-driver, or set SPACEBOT_CHROMIUM and SPACEBOT_CHROMEDRIVER; see README"
)]
async fn the_console_shows_the_request_tree_live_streams_and_keeps_the_chat() {
    browser_installed();
    let s = serve_with(Options {
        llm: Some(console_model()),
        stream_pause: Some(Duration::from_millis(120)),
        ..Options::default()
    })
    .await;
    let driver = start_driver().await;
    let profile = tempfile::tempdir().unwrap();
    let client = browser(&driver, profile.path()).await;
    run_console(&s, &driver, &client).await;
    let _ = client.close().await;
}

async fn run_console(s: &Server, driver: &Driver, client: &Client) {
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
    wait_js(
        client,
        "an empty request list",
        "return document.querySelector('#request-tree .empty') !== null;",
    )
    .await;

    // Hop one: the chief's turn delegates; the tree shows the task before the lead has answered.
    send_chat(client, "chief", "Please get the release notes written.").await;
    wait_js(client, "the working state", "return document.querySelector('#chat-status').textContent === 'working…' && document.querySelector('#chat-log .msg.working') !== null;").await;
    wait_js(client, "the chief's turn and the task in the tree", "const t = document.querySelector('#request-tree'); return t.querySelector(':scope > li.turn[data-agent=\"chief\"]') !== null && t.querySelector('li.task[data-task=\"lead#1\"]') !== null;").await;
    let early: u64 = client
        .execute(
            "return document.querySelectorAll('#request-tree li').length;",
            vec![],
        )
        .await
        .unwrap()
        .as_u64()
        .unwrap();
    // Hop two: the lead's turn under its task, the task done, the chief's retrigger, the answer.
    wait_js(client, "the lead's turn under the task", "const task = document.querySelector('#request-tree li.task[data-task=\"lead#1\"]'); return task !== null && task.querySelector('li.turn[data-agent=\"lead\"] li.model_call') !== null;").await;
    wait_js(client, "the whole request", "const t = document.querySelector('#request-tree'); return t.dataset.status === 'done' && t.querySelector('li.task[data-task=\"lead#1\"]').dataset.status === 'done' && [...t.querySelectorAll(':scope > li.turn[data-agent=\"chief\"]')].some(li => li.querySelector('.label').textContent.startsWith('retrigger'));").await;
    let late: u64 = client
        .execute(
            "return document.querySelectorAll('#request-tree li').length;",
            vec![],
        )
        .await
        .unwrap()
        .as_u64()
        .unwrap();
    assert!(late > early, "the tree did not grow: {early} then {late}");
    // The tool call under the chief's first turn; its steps shown in the chat.
    wait_js(client, "the tool call in the tree", "return document.querySelector('#request-tree > li.turn li.tool_call .label').textContent === 'send_agent_message';").await;
    wait_js(client, "the reply and the steps", "return [...document.querySelectorAll('#chat-log .msg.agent')].some(m => m.textContent.includes('Done: the lead wrote the release notes.')) && [...document.querySelectorAll('#chat-log .msg.done-steps li')].some(li => li.textContent.includes('send_agent_message')) && document.querySelector('#chat-status').textContent === '';").await;
    // The board followed the work to the lead's board.
    wait_js(client, "the board on the lead", "return document.querySelector('#board-agent').value === 'lead' && document.querySelector('#tasks .task[data-task=\"lead#1\"]') !== null;").await;
    screenshot(client, "console-request-tree.png").await;

    // Streamed text: part of the answer shows before the reply arrives.
    send_chat(client, "cm", "What is the community update?").await;
    wait_js(client, "part of the answer streamed", &format!("const m = document.querySelector('#chat-log .msg.working .streaming'); return m !== null && m.textContent.length > 0 && m.textContent.length < {};", STREAMED.len())).await;
    screenshot(client, "console-streaming.png").await;
    wait_js(client, "the streamed answer complete", &format!("return [...document.querySelectorAll('#chat-log .msg.agent')].some(m => m.textContent.endsWith({STREAMED:?}));")).await;

    // A reload keeps the chat: the history comes from the agent's channel.
    client.refresh().await.unwrap();
    wait_js(
        client,
        "a live event stream again",
        "return document.querySelector('#conn').textContent === 'live';",
    )
    .await;
    select(client, "#chat-agent", "chief").await;
    wait_js(client, "the chief's history", "const msgs = [...document.querySelectorAll('#chat-log .msg.history')]; return msgs.some(m => m.classList.contains('user') && m.textContent.includes('Please get the release notes written.')) && msgs.some(m => m.classList.contains('agent') && m.textContent.includes('Done: the lead wrote the release notes.'));").await;
    select(client, "#chat-agent", "cm").await;
    wait_js(client, "the community manager's history", &format!("return [...document.querySelectorAll('#chat-log .msg.history.agent')].some(m => m.textContent.endsWith({STREAMED:?}));")).await;
    screenshot(client, "console-chat-after-reload.png").await;
    no_page_error(client).await;
    let errors = console_errors(driver, client).await;
    assert!(errors.is_empty(), "console errors: {errors:?}");
}

/// The topology editor: hierarchy, legend, a link made by dragging, an edge changed (policy at
/// once: a delegation allowed, then refused, the refusal in the link's timeline), a task approved
/// from the console, and the page at 800 px.
#[tokio::test]
#[cfg_attr(
    not(spacebot_chromium),
    ignore = "no Chromium here: install chromium and chromium-driver, or set SPACEBOT_CHROMIUM and SPACEBOT_CHROMEDRIVER; see README"
)]
async fn the_topology_editor_changes_policy_at_once_and_approvals_work_from_the_console() {
    browser_installed();
    let s = serve().await;
    let driver = start_driver().await;
    let profile = tempfile::tempdir().unwrap();
    let client = browser(&driver, profile.path()).await;
    run_editor(&s, &driver, &client).await;
    let _ = client.close().await;
}

async fn delegate(s: &Server, from: &str, to: &str, what: &str) -> (u16, serde_json::Value) {
    s.post(
        &format!("/api/agents/{from}/delegate"),
        json!({"target": to, "message": what}),
    )
    .await
}

async fn run_editor(s: &Server, driver: &Driver, client: &Client) {
    client
        .goto(&format!("{}/#token={TOKEN}", s.base))
        .await
        .unwrap();
    wait_js(client, "the graph", "return !!window.cytoscape && document.querySelector('#graph canvas') !== null && document.querySelectorAll('#links tbody tr').length === 2;").await;
    // Superiors above: the chief (superior of the lead) is drawn higher.
    let above = client
        .execute(
            "const d = window.spacebotDashboard; return d.nodeY('chief') < d.nodeY('lead');",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(above, json!(true), "the chief is not above the lead");
    // The legend's colours are the edges' colours.
    let chief_lead = s.link_id("chief", "lead").await;
    let chief_cm = s.link_id("chief", "cm").await;
    let colours = client
        .execute(
            &format!("const n = (c) => c.replace(/\\s/g, ''); const sw = (k) => n(getComputedStyle(document.querySelector('.legend .sw[data-kind=\"' + k + '\"]')).backgroundColor); const d = window.spacebotDashboard; return [n(d.edgeColour('{chief_lead}')), sw('superior'), n(d.edgeColour('{chief_cm}')), sw('peer')];"),
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(colours[0], colours[1], "superior: {colours}");
    assert_eq!(colours[2], colours[3], "peer: {colours}");

    // Dragging from the lead to the community manager creates a link (two-way, peer).
    let from = point(client, "return window.spacebotDashboard.nodePoint('lead');").await;
    let to = point(client, "return window.spacebotDashboard.nodePoint('cm');").await;
    drag(client, from, to).await;
    wait_js(client, "the new link", "return document.querySelectorAll('#links tbody tr').length === 3 && !document.querySelector('#edge-editor').hidden;").await;
    let link = s
        .org
        .link(&id("lead"), &id("cm"))
        .expect("no link lead -> cm");
    assert!(link.enabled);
    assert_eq!(link.relationship, spacebot_core::LinkRelationship::Peer);
    let link_id = link.id.to_string();
    screenshot(client, "console-link-dragged.png").await;

    // A peer's delegation waits for approval (`unless_superior`): approved from the console.
    let (status, task) = delegate(s, "lead", "cm", "Announce the release.").await;
    assert_eq!(status, 201, "{task}");
    assert_eq!(task["status"], "pending_approval", "{task}");
    wait_js(client, "the task waiting for approval", "return document.querySelector('#approvals .task-approval[data-task=\"cm#1\"] button.approve') !== null;").await;
    screenshot(client, "console-approval.png").await;
    click(
        client,
        "#approvals .task-approval[data-task=\"cm#1\"] button.approve",
    )
    .await;
    wait_js(
        client,
        "the approval gone",
        "return document.querySelector('#approvals .task-approval') === null;",
    )
    .await;
    let approved = s
        .org
        .task(&spacebot_core::TaskRef::new(id("cm"), 1))
        .await
        .unwrap()
        .unwrap();
    assert_ne!(approved.status, spacebot_core::TaskStatus::PendingApproval);

    // Clicking the edge opens it; the lead made the superior: applies at once (no approval now).
    click(client, "#edge-close").await;
    let mid = point(
        client,
        &format!("return window.spacebotDashboard.edgePoint('{link_id}');"),
    )
    .await;
    click_at(client, mid).await;
    wait_js(client, "the edge editor", &format!("const f = document.querySelector('#edge-editor'); return !f.hidden && f.dataset.link === '{link_id}';")).await;
    select(client, "#edge-relationship", "superior").await;
    click(client, "#edge-apply").await;
    wait_js(
        client,
        "the change saved",
        "return document.querySelector('#edge-saved').textContent.startsWith('saved');",
    )
    .await;
    assert_eq!(
        s.org.link(&id("lead"), &id("cm")).unwrap().relationship,
        spacebot_core::LinkRelationship::Superior
    );
    // Redrawn by the new hierarchy: chief above lead above the community manager.
    wait_js(client, "the new hierarchy", "const d = window.spacebotDashboard; return d.nodeY('chief') < d.nodeY('lead') && d.nodeY('lead') < d.nodeY('cm');").await;
    let (status, task) = delegate(s, "lead", "cm", "Draft the announcement.").await;
    assert_eq!(status, 201, "{task}");
    assert_ne!(task["status"], "pending_approval", "{task}");
    // Two-way: the community manager may delegate back...
    let (status, task) = delegate(s, "cm", "lead", "Check the announcement.").await;
    assert_eq!(status, 201, "{task}");
    // ...until the link is made one-way from the lead: refused at once, and the link's timeline
    // shows the refused attempt.
    select(client, "#edge-direction", "one_way").await;
    click(client, "#edge-apply").await;
    wait_js(client, "the one-way edge", &format!("return [...document.querySelectorAll('#links tbody tr[data-link=\"{link_id}\"] td')].some(td => td.textContent === 'one_way');")).await;
    let (status, refused) = delegate(s, "cm", "lead", "Check it again.").await;
    assert_eq!(status, 403, "{refused}");
    wait_js(client, "the refusal in the link's timeline", &format!("return document.querySelector('#timeline-link').value === '{link_id}' && [...document.querySelectorAll('#timeline .record')].some(r => r.textContent.includes('refused: cm may not delegate to lead'));")).await;
    wait_js(client, "the refusal in the activity", "return [...document.querySelectorAll('#activity li')].some(li => li.textContent.includes('refused'));").await;
    screenshot(client, "console-edge-edited.png").await;

    // Deleting the link from the editor.
    click(client, "#edge-delete").await;
    wait_js(client, "the link deleted", "return document.querySelectorAll('#links tbody tr').length === 2 && document.querySelector('#edge-editor').hidden;").await;
    assert!(s.org.link(&id("lead"), &id("cm")).is_none());

    // 800 px: no sideways scrolling, the favicon served, no console error.
    client.set_window_size(800, 1000).await.unwrap();
    wait_js(client, "no horizontal scroll at 800 px", "return window.innerWidth <= 800 && document.documentElement.scrollWidth <= document.documentElement.clientWidth && document.body.scrollWidth <= document.documentElement.clientWidth;").await;
    screenshot(client, "console-800px.png").await;
    for path in ["/favicon.ico", "/favicon.svg"] {
        let r = reqwest::get(s.url(path)).await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
    }
    no_page_error(client).await;
    let errors = console_errors(driver, client).await;
    assert!(errors.is_empty(), "console errors: {errors:?}");
}
