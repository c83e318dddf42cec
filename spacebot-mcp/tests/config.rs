//! Every invalid `[[mcp_servers]]` entry and `tools` grant is a configuration error naming the
//! entry and the field; the organization's build refuses them, and an `[[agents]]` field no
//! behaviour claims.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use spacebot_core::testing::ScriptedLlm;
use spacebot_core::{OrgConfig, Organization, Stores};
use spacebot_mcp::{Mcp, McpConfig, Start, Transport};

fn issues(toml: &str) -> Vec<String> {
    let config = OrgConfig::from_toml_str(toml).unwrap();
    match McpConfig::from_org(&config) {
        Ok(_) => Vec::new(),
        Err(e) => e.issues().iter().map(ToString::to_string).collect(),
    }
}

#[test]
fn a_valid_configuration_is_read_with_its_defaults() {
    let config = OrgConfig::from_toml_str(
        r#"
        [[agents]]
        id = "a"
        tools = ["files:*", "web:fetch"]
        [[mcp_servers]]
        id = "files"
        command = "files-server"
        args = ["--root", "/srv"]
        env = { LOG = "1" }
        cwd = "/tmp"
        start = "eager"
        [[mcp_servers]]
        id = "web"
        url = "https://example.invalid/mcp"
        bearer_token = "t0ken"
        timeout_ms = 1500
        max_result_bytes = 1000
        "#,
    )
    .unwrap();
    let mcp = McpConfig::from_org(&config).unwrap();
    assert_eq!(mcp.servers.len(), 2);
    let files = mcp.server("files").unwrap();
    assert_eq!(files.start, Start::Eager);
    assert_eq!(files.timeout, spacebot_mcp::DEFAULT_TIMEOUT);
    assert!(
        matches!(&files.transport, Transport::Stdio { args, cwd: Some(_), .. } if args.len() == 2)
    );
    let web = mcp.server("web").unwrap();
    assert_eq!(web.start, Start::Lazy);
    assert_eq!(web.timeout, Duration::from_millis(1500));
    assert_eq!(web.max_result_bytes, 1000);
    assert!(
        matches!(&web.transport, Transport::Http { bearer_token: Some(t), .. } if t == "t0ken")
    );
    let grants: Vec<String> = mcp
        .grants
        .values()
        .next()
        .unwrap()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(grants, ["files:*", "web:fetch"]);
}

#[test]
fn every_mistake_names_its_entry_and_field() {
    let found = issues(
        r#"
        [[agents]]
        id = "a"
        tools = ["files:*", "ghost:*", "files", "files:*", 3]
        [[agents]]
        id = "b"
        tools = "files:*"
        [[mcp_servers]]
        id = "files"
        command = "x"
        [[mcp_servers]]
        id = "files"
        command = "y"
        [[mcp_servers]]
        id = "both"
        command = "x"
        url = "http://127.0.0.1:1/mcp"
        [[mcp_servers]]
        id = "none"
        [[mcp_servers]]
        id = "bad__id"
        command = "x"
        [[mcp_servers]]
        id = "web"
        url = "ftp://example.invalid"
        args = ["x"]
        [[mcp_servers]]
        id = "stdio"
        command = "x"
        bearer_token = "t"
        headers = { A = "b" }
        start = "sometimes"
        timeout_ms = 0
        max_result_bytes = -1
        colour = "red"
        [[mcp_servers]]
        command = "x"
        [[mcp_servers]]
        id = "hdr"
        url = "http://127.0.0.1:1/mcp"
        headers = { "bad header" = "x" }
        "#,
    );
    let expected = [
        "mcp_servers[1] (files): field \"id\": duplicate server id \"files\" (first defined by mcp_servers[0])",
        "mcp_servers[2] (both): field \"url\": give either command (stdio) or url (streamable HTTP), not both",
        "mcp_servers[3] (none): field \"command\": missing: give command (stdio) or url (streamable HTTP)",
        "mcp_servers[4] (bad__id): field \"id\": server id \"bad__id\" may not hold \"__\"",
        "mcp_servers[5] (web): field \"url\": \"ftp://example.invalid\" is not an http:// or https:// URL",
        "mcp_servers[5] (web): field \"args\": only for a stdio server",
        "mcp_servers[6] (stdio): field \"colour\": unknown field",
        "mcp_servers[6] (stdio): field \"headers\": only for a streamable HTTP server",
        "mcp_servers[6] (stdio): field \"bearer_token\": only for a streamable HTTP server",
        "mcp_servers[6] (stdio): field \"start\": unknown value \"sometimes\"; expected one of: lazy, eager",
        "mcp_servers[6] (stdio): field \"timeout_ms\": expected a positive integer",
        "mcp_servers[6] (stdio): field \"max_result_bytes\": expected a positive integer",
        "mcp_servers[7]: field \"id\": missing",
        "mcp_servers[8] (hdr): field \"headers\": \"bad header\" is not a valid HTTP header",
        "agents[0] (a): field \"tools\": grant \"ghost:*\" names the server \"ghost\", which is not in [[mcp_servers]]",
        "agents[0] (a): field \"tools\": grant \"files\" must be \"server:*\"",
        "agents[0] (a): field \"tools\": grant \"files:*\" is listed twice",
        "agents[0] (a): field \"tools\": expected an array of grants: strings such as",
        "agents[1] (b): field \"tools\": expected an array of grants",
    ];
    for want in expected {
        assert!(
            found.iter().any(|f| f.contains(want)),
            "missing {want:?} in {found:#?}"
        );
    }
    assert_eq!(found.len(), expected.len(), "{found:#?}");
}

#[tokio::test]
async fn the_build_refuses_a_bad_entry_and_an_unclaimed_agent_field() {
    let build = |toml: &'static str, with_mcp: bool| async move {
        let mut builder = Organization::builder(OrgConfig::from_toml_str(toml).unwrap())
            .stores(Stores::memory())
            .llm(Arc::new(ScriptedLlm::new()));
        if with_mcp {
            builder = builder.behaviour(Arc::new(Mcp::new()));
        }
        builder.build().await.map(|_| ()).map_err(|e| e.to_string())
    };
    let bad = "[[agents]]\nid = \"a\"\ntools = [\"x:*\"]\n";
    let err = build(bad, true).await.unwrap_err();
    assert!(
        err.contains("agents[0] (a): field \"tools\": grant \"x:*\" names the server \"x\""),
        "{err}"
    );
    let err = build(bad, false).await.unwrap_err();
    assert!(
        err.contains(
            "agents[0] (a): field \"tools\": unknown field; expected id, name, workspace, limits"
        ),
        "without the behaviour nothing claims the field: {err}"
    );
    let typo = "[[agents]]\nid = \"a\"\ntols = [\"x:*\"]\n";
    let err = build(typo, true).await.unwrap_err();
    assert!(
        err.contains("field \"tols\": unknown field; expected id, name, workspace, limits, tools"),
        "{err}"
    );
    let ok = "[[agents]]\nid = \"a\"\n[[mcp_servers]]\nid = \"x\"\ncommand = \"never-run\"\n";
    build(ok, true).await.unwrap();
    let err = build(ok, false).await.unwrap_err();
    assert!(
        err.contains("field \"mcp_servers\": no behaviour claims this section"),
        "{err}"
    );
}
