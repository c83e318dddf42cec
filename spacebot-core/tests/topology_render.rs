//! Topology: seed 003's JSON payload, Graphviz DOT and Mermaid, exactly.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use spacebot_core::config::OrgConfig;
use spacebot_core::memory::MemoryLinkStore;
use spacebot_core::topology::{Topology, TopologyAgent};
use spacebot_core::{AgentId, AgentLink, LinkDirection, LinkRelationship, LinkStore, Timestamp};

const ORG: &str = r#"
[[agents]]
id = "support"
name = "Support Agent"

[[agents]]
id = "engineering"
name = "Engineering Agent"

[[agents]]
id = "manager"
name = "The \"Manager\""

[[links]]
from = "support"
to = "engineering"
relationship = "subordinate"

[[links]]
from = "manager"
to = "support"
direction = "one_way"
relationship = "superior"

[[links]]
from = "engineering"
to = "manager"
enabled = false
"#;

fn small_org() -> Topology {
    Topology::from_config(&OrgConfig::from_toml_str(ORG).unwrap())
}

#[test]
fn json_matches_seed_003() {
    let json: serde_json::Value = serde_json::from_str(&small_org().to_json().unwrap()).unwrap();
    assert_eq!(
        json,
        serde_json::json!({
            "agents": [
                { "id": "support", "name": "Support Agent" },
                { "id": "engineering", "name": "Engineering Agent" },
                { "id": "manager", "name": "The \"Manager\"" }
            ],
            "links": [
                { "id": "support:engineering", "from": "support", "to": "engineering",
                  "direction": "two_way", "relationship": "subordinate", "enabled": true },
                { "id": "manager:support", "from": "manager", "to": "support",
                  "direction": "one_way", "relationship": "superior", "enabled": true },
                { "id": "engineering:manager", "from": "engineering", "to": "manager",
                  "direction": "two_way", "relationship": "peer", "enabled": false }
            ]
        })
    );
    // It reads back to the same topology.
    let back: Topology = serde_json::from_value(json).unwrap();
    assert_eq!(back, small_org());
}

#[test]
fn dot_output() {
    assert_eq!(
        small_org().to_dot(),
        r#"digraph org {
    node [shape=box];
    "support" [label="Support Agent"];
    "engineering" [label="Engineering Agent"];
    "manager" [label="The \"Manager\""];
    "support" -> "engineering" [label="subordinate", dir=both];
    "manager" -> "support" [label="superior", dir=forward];
    "engineering" -> "manager" [label="peer", dir=both, style=dashed];
}
"#
    );
}

#[test]
fn mermaid_output() {
    assert_eq!(
        small_org().to_mermaid(),
        r#"flowchart TD
    a0["Support Agent"]
    a1["Engineering Agent"]
    a2["The #quot;Manager#quot;"]
    a0 <-- subordinate --> a1
    a2 -- superior --> a0
    a1 <-. peer .-> a2
"#
    );
}

#[test]
fn link_descriptions() {
    assert_eq!(
        small_org().describe_links(),
        vec![
            "Support Agent -> Engineering Agent (two_way, subordinate)",
            "The \"Manager\" -> Support Agent (one_way, superior)",
            "Engineering Agent -> The \"Manager\" (two_way, peer, disabled)",
        ]
    );
}

#[test]
fn ends_missing_from_the_agent_list_are_added() {
    let id = |s: &str| AgentId::parse(s).unwrap();
    let link = AgentLink::new(
        id("x"),
        id("y"),
        LinkDirection::OneWay,
        LinkRelationship::Peer,
        Timestamp(0),
    );
    let topology = Topology::from_parts(
        [TopologyAgent {
            id: id("y"),
            name: "Why".into(),
        }],
        [link],
    );
    let names: Vec<&str> = topology.agents.iter().map(|a| a.name.as_str()).collect();
    assert_eq!(names, ["Why", "x"]);
    assert!(topology.to_mermaid().ends_with("    a1 -- peer --> a0\n"));
}

#[test]
fn load_reads_links_from_the_store() {
    futures::executor::block_on(async {
        let config = OrgConfig::from_toml_str(ORG).unwrap();
        let store = MemoryLinkStore::new();
        config.sync_links(&store, Timestamp(5)).await.unwrap();
        let id = |s: &str| AgentId::parse(s).unwrap();
        let mut extra = AgentLink::new(
            id("support"),
            id("manager"),
            LinkDirection::TwoWay,
            LinkRelationship::Subordinate,
            Timestamp(6),
        );
        extra.id = spacebot_core::LinkId::new("runtime-link");
        store.create(&extra).await.unwrap();
        let topology = Topology::load(&config, &store).await.unwrap();
        let pairs: Vec<String> = topology
            .links
            .iter()
            .map(|l| format!("{}>{}", l.from, l.to))
            .collect();
        assert_eq!(
            pairs,
            [
                "engineering>manager",
                "manager>support",
                "support>engineering",
                "support>manager"
            ]
        );
        assert_eq!(topology.agents.len(), 3);
    });
}
