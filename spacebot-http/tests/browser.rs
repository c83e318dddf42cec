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

#[tokio::test]
async fn the_dashboard_delegates_through_the_chat_and_shows_it_live() {
    let (browser_bin, driver_bin) = (chromium(), chromedriver());
    if !Path::new(&browser_bin).exists() || !Path::new(&driver_bin).exists() {
        assert!(
            std::env::var_os("CI").is_none(),
            "{browser_bin} or {driver_bin} is missing; install them with: apt-get install -y chromium chromium-driver"
        );
        eprintln!(
            "skipped: {browser_bin} or {driver_bin} is missing (the test fails instead under CI)"
        );
        return;
    }
    let s = serve_with(Options {
        llm: Some(model()),
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
}
