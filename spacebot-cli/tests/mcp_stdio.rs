//! `spacebot mcp`: the organization as an MCP server over stdio, driven by PyPI `mcp`'s client
//! (`spacebot-http/tests/fixtures/mcp_client.py`), which starts the binary as its child process.
//! The model is the scripted demo model: a message to the chief is delegated down the hierarchy.
//!
//! Needs SPACEBOT_PYTHON (a Python with PyPI's `mcp`, made by `.ci/python`); where neither it nor
//! `.ci/python`'s environment is at hand the tests are compiled as ignored, with the reason
//! (`cfg(spacebot_python)`, set by the build script), unless SPACEBOT_REQUIRE_PYTHON=1 (CI), when
//! they run and fail without it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;

const ORG: &str = r#"
[[agents]]
id = "chief"
name = "Chief"
mcp_expose = true
[[agents]]
id = "lead"
name = "Lead"
[[agents]]
id = "worker"
[[links]]
from = "chief"
to = "lead"
relationship = "superior"
[[links]]
from = "lead"
to = "worker"
relationship = "superior"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(spacebot_python),
    ignore = "no Python with the protocol kits here: set SPACEBOT_PYTHON (see .ci/python); see README"
)]
async fn python_client_asks_the_organization_over_stdio() {
    let python = spacebot_core::testing::external::python();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("org.toml");
    std::fs::write(&config, ORG).unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../spacebot-http/tests/fixtures/mcp_client.py");
    let out = tokio::time::timeout(
        Duration::from_secs(90),
        tokio::process::Command::new(&python)
            .arg(script)
            .arg("stdio")
            .arg(env!("CARGO_BIN_EXE_spacebot"))
            .arg("mcp")
            .arg("--config")
            .arg(&config)
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .env_remove("OPENAI_API_KEY")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the client finished within 90 s")
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the client failed: {}\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let step = |name: &str| {
        lines
            .iter()
            .find(|l| l["step"] == name)
            .unwrap_or_else(|| panic!("no step {name} in {lines:?}"))
            .clone()
    };
    let tools = step("tools");
    assert_eq!(tools["tools"][0]["name"], "ask_chief", "{tools}");
    assert_eq!(tools["tools"].as_array().unwrap().len(), 1);
    let ask = step("ask");
    assert_eq!(ask["is_error"], false, "{ask}");
    assert!(!ask["text"].as_str().unwrap().is_empty(), "{ask}");
    let progress = ask["progress"].as_array().unwrap();
    assert!(
        progress
            .iter()
            .any(|p| p.as_str().unwrap().starts_with("lead: task created")),
        "the delegation is told: {progress:?}"
    );
    assert_eq!(
        step("resources")["topology"]["agents"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
}
