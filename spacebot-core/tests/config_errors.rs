//! Organization config: parsing, defaults, every error case, and syncing links to a store.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use spacebot_core::config::{ConfigError, OrgConfig, Settings};
use spacebot_core::memory::MemoryLinkStore;
use spacebot_core::policy::{ApprovalPolicy, org_chart};
use spacebot_core::{AgentId, LinkDirection, LinkRelationship, LinkStore, Timestamp};

const AGENTS: &str = r#"
[[agents]]
id = "support"
name = "Support Agent"

[[agents]]
id = "engineering"
"#;

/// Parses `AGENTS` followed by `rest`, expecting exactly one issue; returns its message.
fn single_issue(rest: &str) -> String {
    let err = OrgConfig::from_toml_str(&format!("{AGENTS}\n{rest}")).unwrap_err();
    assert_eq!(err.issues().len(), 1, "{err}");
    err.issues()[0].to_string()
}

fn id(s: &str) -> AgentId {
    AgentId::parse(s).unwrap()
}

#[test]
fn a_valid_config_with_defaults() {
    let config = OrgConfig::from_toml_str(&format!(
        "{AGENTS}\n[[links]]\nfrom = \"support\"\nto = \"engineering\"\nrelationship = \"subordinate\"\n"
    ))
    .unwrap();
    assert_eq!(config.agents.len(), 2);
    assert_eq!(config.agents[0].name, "Support Agent");
    assert_eq!(
        config.agents[1].name, "engineering",
        "name defaults to the id"
    );
    assert_eq!(config.agents[1].workspace, None);
    let link = &config.links[0];
    assert_eq!(link.direction, LinkDirection::TwoWay);
    assert_eq!(link.relationship, LinkRelationship::Subordinate);
    assert!(link.enabled);
    assert_eq!(config.settings, Settings::default());
    assert_eq!(config.settings.approval, ApprovalPolicy::Never);
    assert_eq!(
        (
            config.settings.max_delegation_depth,
            config.settings.max_tool_rounds
        ),
        (4, 16)
    );
    assert_eq!(
        (
            config.settings.queue_capacity,
            config.settings.conversation_turn_budget
        ),
        (256, 20)
    );
    let chart = org_chart(&config.graph(), &id("support"));
    assert_eq!(chart.superiors, vec![id("engineering")]);
    assert_eq!(config.name_of("support"), "Support Agent");
    assert_eq!(config.name_of("unknown"), "unknown");
}

#[test]
fn settings_and_workspace_are_read() {
    let config = OrgConfig::from_toml_str(
        r#"
        [[agents]]
        id = "a"
        workspace = "agents/a"
        [settings]
        approval = "unless_superior"
        max_delegation_depth = 2
        max_tool_rounds = 3
        queue_capacity = 8
        conversation_turn_budget = 6
        "#,
    )
    .unwrap();
    assert_eq!(
        config.agents[0].workspace.as_deref(),
        Some(std::path::Path::new("agents/a"))
    );
    let s = &config.settings;
    assert_eq!(s.approval, ApprovalPolicy::UnlessSuperior);
    assert_eq!(
        (
            s.max_delegation_depth,
            s.max_tool_rounds,
            s.queue_capacity,
            s.conversation_turn_budget
        ),
        (2, 3, 8, 6)
    );
}

#[test]
fn the_toml_text_round_trips() {
    let config = OrgConfig::from_toml_str(&format!(
        "{AGENTS}\n[[links]]\nfrom = \"engineering\"\nto = \"support\"\ndirection = \"one_way\"\nenabled = false\n[settings]\nqueue_capacity = 9\n"
    ))
    .unwrap();
    let text = config.to_toml_string().unwrap();
    assert_eq!(OrgConfig::from_toml_str(&text).unwrap(), config);
}

#[test]
fn error_unknown_agent() {
    assert_eq!(
        single_issue("[[links]]\nfrom = \"support\"\nto = \"ghost\""),
        "links[0] (support -> ghost): field \"to\": unknown agent \"ghost\" (not in [[agents]])"
    );
}

#[test]
fn error_self_link() {
    assert_eq!(
        single_issue("[[links]]\nfrom = \"support\"\nto = \"support\""),
        "links[0] (support -> support): field \"to\": a link cannot join \"support\" to itself"
    );
}

#[test]
fn error_duplicate_agent_id() {
    assert_eq!(
        single_issue("[[agents]]\nid = \"support\""),
        "agents[2] (support): field \"id\": duplicate agent id \"support\" (first defined by agents[0])"
    );
}

#[test]
fn error_duplicate_pair() {
    let message = single_issue(
        "[[links]]\nfrom = \"support\"\nto = \"engineering\"\n\
         [[links]]\nfrom = \"support\"\nto = \"engineering\"\nrelationship = \"superior\"",
    );
    assert_eq!(
        message,
        "links[1] (support -> engineering): duplicate of links[0]: only one link per ordered pair (support -> engineering)"
    );
}

#[test]
fn error_contradicting_reverse_link_both_superior() {
    let message = single_issue(
        "[[links]]\nfrom = \"support\"\nto = \"engineering\"\nrelationship = \"superior\"\n\
         [[links]]\nfrom = \"engineering\"\nto = \"support\"\nrelationship = \"superior\"",
    );
    assert_eq!(
        message,
        "links[1] (engineering -> support): field \"relationship\": \"superior\" contradicts \
         links[0] (support -> engineering), which makes \"engineering\" subordinate to \"support\""
    );
}

#[test]
fn error_contradicting_reverse_link_peer_against_superior() {
    let message = single_issue(
        "[[links]]\nfrom = \"support\"\nto = \"engineering\"\n\
         [[links]]\nfrom = \"engineering\"\nto = \"support\"\nrelationship = \"superior\"",
    );
    assert!(
        message.starts_with("links[1] (engineering -> support): field \"relationship\""),
        "{message}"
    );
    assert!(
        message.contains("contradicts links[0] (support -> engineering)"),
        "{message}"
    );
}

#[test]
fn agreeing_reverse_links_are_accepted() {
    let config = OrgConfig::from_toml_str(&format!(
        "{AGENTS}\n[[links]]\nfrom = \"support\"\nto = \"engineering\"\nrelationship = \"superior\"\ndirection = \"one_way\"\n\
         [[links]]\nfrom = \"engineering\"\nto = \"support\"\nrelationship = \"subordinate\"\ndirection = \"one_way\"\n"
    ))
    .unwrap();
    assert_eq!(config.links.len(), 2);
}

#[test]
fn error_unknown_enum_value_direction() {
    assert_eq!(
        single_issue(
            "[[links]]\nfrom = \"support\"\nto = \"engineering\"\ndirection = \"sideways\""
        ),
        "links[0] (support -> engineering): field \"direction\": unknown value \"sideways\"; expected one of: one_way, two_way"
    );
}

#[test]
fn error_unknown_enum_value_relationship() {
    assert_eq!(
        single_issue(
            "[[links]]\nfrom = \"support\"\nto = \"engineering\"\nrelationship = \"boss\""
        ),
        "links[0] (support -> engineering): field \"relationship\": unknown value \"boss\"; expected one of: peer, superior, subordinate"
    );
}

#[test]
fn error_unknown_enum_value_approval() {
    assert_eq!(
        single_issue("[settings]\napproval = \"sometimes\""),
        "settings: field \"approval\": unknown value \"sometimes\"; expected one of: never, always, unless_superior"
    );
}

#[test]
fn error_missing_field() {
    assert_eq!(
        single_issue("[[links]]\nfrom = \"support\""),
        "links[0] (support -> ?): field \"to\": missing"
    );
    let err = OrgConfig::from_toml_str("[[agents]]\nname = \"No Id\"").unwrap_err();
    assert_eq!(
        err.issues()[0].to_string(),
        "agents[0]: field \"id\": missing"
    );
}

#[test]
fn error_bad_agent_id() {
    let message = single_issue("[[agents]]\nid = \"../etc\"");
    assert!(
        message.starts_with("agents[2] (../etc): field \"id\": invalid agent id"),
        "{message}"
    );
}

#[test]
fn error_unknown_field() {
    assert_eq!(
        single_issue("[[links]]\nfrom = \"support\"\nto = \"engineering\"\nweight = 3"),
        "links[0] (support -> engineering): field \"weight\": unknown field; expected from, to, direction, relationship, enabled"
    );
    assert_eq!(
        single_issue("[settings]\nmax_depth = 3"),
        "settings: field \"max_depth\": unknown field; expected approval, max_delegation_depth, max_tool_rounds, queue_capacity, conversation_turn_budget, task_concurrency, max_tool_calls_per_response, limits, agent_limits, org_limits, prices, context_window, compaction"
    );
    // A top-level table other than agents, links, settings is a behaviour's section: kept by the
    // parser, refused when no behaviour claims it (the build checks; so does `spacebot check`).
    let config = OrgConfig::from_toml_str(&format!("{AGENTS}\n[agent]\nid = \"x\"")).unwrap();
    let err = config.check_sections(&["notes"]).unwrap_err();
    assert_eq!(err.issues().len(), 1, "{err}");
    assert_eq!(
        err.issues()[0].to_string(),
        "top level: field \"agent\": no behaviour claims this section; expected agents, links, settings, notes"
    );
}

#[test]
fn error_wrong_type() {
    assert_eq!(
        single_issue("[[links]]\nfrom = \"support\"\nto = \"engineering\"\nenabled = \"yes\""),
        "links[0] (support -> engineering): field \"enabled\": expected true or false, found string \"yes\""
    );
    assert_eq!(
        single_issue("[settings]\nqueue_capacity = 0"),
        "settings: field \"queue_capacity\": expected a whole number from 1 to 4294967295, found integer 0"
    );
    let err = OrgConfig::from_toml_str("links = 3").unwrap_err();
    assert_eq!(
        err.issues()[0].to_string(),
        "links: expected an array of tables ([[links]]), found integer 3"
    );
}

#[test]
fn every_problem_is_reported_and_nothing_is_returned() {
    let err = OrgConfig::from_toml_str(&format!(
        "{AGENTS}\n[[links]]\nfrom = \"support\"\nto = \"ghost\"\n\
         [[links]]\nfrom = \"support\"\nto = \"engineering\"\ndirection = \"sideways\"\n\
         [settings]\nmax_tool_rounds = -1\n"
    ))
    .unwrap_err();
    let entries: Vec<&str> = err.issues().iter().map(|i| i.entry.as_str()).collect();
    assert_eq!(
        entries,
        [
            "links[0] (support -> ghost)",
            "links[1] (support -> engineering)",
            "settings"
        ]
    );
    let text = err.to_string();
    assert!(
        text.starts_with("invalid organization config: links[0]"),
        "{text}"
    );
}

#[test]
fn syntax_and_read_errors_name_the_file() {
    let err = OrgConfig::from_toml_str("[[agents]\nid = ").unwrap_err();
    assert!(matches!(err, ConfigError::Syntax { .. }), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("org.toml");
    std::fs::write(&path, "[[links]]\nfrom = \"a\"\nto = \"b\"\n").unwrap();
    let err = OrgConfig::load(&path).unwrap_err();
    assert!(
        err.to_string().contains(&path.display().to_string()),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("links[0] (a -> b): field \"from\": unknown agent"),
        "{err}"
    );

    let missing = dir.path().join("missing.toml");
    let err = OrgConfig::load(&missing).unwrap_err();
    assert!(matches!(err, ConfigError::Read { .. }), "{err}");
    assert!(err.to_string().contains("missing.toml"), "{err}");

    std::fs::write(&path, AGENTS).unwrap();
    assert_eq!(OrgConfig::load(&path).unwrap().agents.len(), 2);
}

#[test]
fn sync_links_lets_config_win_and_keeps_other_links() {
    futures::executor::block_on(async {
        let store = MemoryLinkStore::new();
        let config = OrgConfig::from_toml_str(&format!(
            "{AGENTS}\n[[agents]]\nid = \"ops\"\n\
             [[links]]\nfrom = \"support\"\nto = \"engineering\"\nrelationship = \"subordinate\"\n"
        ))
        .unwrap();
        // The store already holds the pair with other properties, and a link config does not name.
        let mut stale = spacebot_core::AgentLink::new(
            id("support"),
            id("engineering"),
            LinkDirection::OneWay,
            LinkRelationship::Peer,
            Timestamp(1),
        );
        stale.enabled = false;
        let runtime_link = spacebot_core::AgentLink::new(
            id("ops"),
            id("support"),
            LinkDirection::TwoWay,
            LinkRelationship::Peer,
            Timestamp(1),
        );
        store.create(&stale).await.unwrap();
        store.create(&runtime_link).await.unwrap();

        config.sync_links(&store, Timestamp(50)).await.unwrap();

        let synced = store
            .get_between(&id("support"), &id("engineering"))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(synced.id, stale.id, "the stored link keeps its id");
        assert_eq!(synced.created_at, Timestamp(1));
        assert_eq!(synced.updated_at, Timestamp(50));
        assert_eq!(synced.direction, LinkDirection::TwoWay);
        assert_eq!(synced.relationship, LinkRelationship::Subordinate);
        assert!(synced.enabled);
        assert_eq!(
            store.list().await.unwrap().len(),
            2,
            "links config does not name stay"
        );

        // The runtime's policy snapshot comes from the store: it sees the stored id and the
        // link created at run time.
        let graph = spacebot_core::LinkGraph::load(&store, config.agent_ids().cloned())
            .await
            .unwrap();
        assert_eq!(
            graph.between("support", "engineering").map(|l| &l.id),
            Some(&stale.id)
        );
        assert!(spacebot_core::policy::check_start(&graph, &id("ops"), "support").is_ok());

        // A fresh store gets the config's own ids.
        let fresh = MemoryLinkStore::new();
        config.sync_links(&fresh, Timestamp(7)).await.unwrap();
        let links = fresh.list().await.unwrap();
        assert_eq!(links, config.links_at(Timestamp(7)));
        assert_eq!(links[0].id.as_str(), "support:engineering");
    });
}

#[test]
fn validate_checks_configs_built_in_code() {
    let mut config = OrgConfig::from_toml_str(AGENTS).unwrap();
    assert!(config.validate().is_ok());
    // Deserializing refuses an agent id that `AgentId::parse` refuses ...
    let bad = serde_json::from_value::<spacebot_core::config::AgentConfig>(
        serde_json::json!({"id": "../etc", "name": "x"}),
    );
    assert!(bad.unwrap_err().to_string().contains("agent id"));
    // ... and `validate` catches what serde cannot see: a duplicate agent and a self-link.
    let duplicate = config.agents[0].clone();
    config.agents.push(duplicate);
    config.links.push(spacebot_core::config::LinkConfig {
        from: id("support"),
        to: id("support"),
        direction: LinkDirection::OneWay,
        relationship: LinkRelationship::Peer,
        enabled: true,
    });
    let err = config.validate().unwrap_err();
    let entries: Vec<&str> = err.issues().iter().map(|i| i.entry.as_str()).collect();
    assert_eq!(
        entries,
        ["agents[2] (support)", "links[0] (support -> support)"]
    );
}

/// Period limits and prices: each bad entry names its table and field; a good one reads back,
/// and survives `validate` (serialized and read again).
#[test]
fn period_limits_and_prices_are_checked() {
    assert_eq!(
        single_issue("[settings.agent_limits]\nmodel_calls = 2"),
        "settings.agent_limits: field \"period\": missing (\"hour\" or \"day\")"
    );
    assert_eq!(
        single_issue("[settings.org_limits]\nperiod = \"week\"\ncost = 1.0"),
        "settings.org_limits: field \"period\": expected \"hour\" or \"day\", found \"week\""
    );
    assert!(
        single_issue("[settings.agent_limits]\nperiod = \"hour\"\nwall_time_ms = 5")
            .starts_with("settings.agent_limits: field \"wall_time_ms\": unknown field"),
    );
    assert_eq!(
        single_issue("[settings.prices.m]\ninput_per_million = -1.0"),
        "settings.prices.m: field \"input_per_million\": expected an amount of 0 or more, found -1"
    );
    assert_eq!(
        single_issue("[settings.limits]\ncost = \"lots\""),
        "settings.limits: field \"cost\": expected an amount such as 0.25, found string \"lots\""
    );
    let config = OrgConfig::from_toml_str(&format!(
        "{AGENTS}\n[settings.limits]\ncost = 0.25\n[settings.org_limits]\nperiod = \"day\"\ntotal_tokens = 900\n[settings.prices.default]\ninput_per_million = 1.5\noutput_per_million = 6.0"
    ))
    .unwrap();
    let s = &config.settings;
    assert_eq!(s.limits.cost.map(|c| c.0), Some(250_000));
    let org = s.org_limits.unwrap();
    assert_eq!(
        (org.period, org.limits.total_tokens),
        (spacebot_core::limits::Period::Day, Some(900))
    );
    assert_eq!(s.prices["default"].output_per_million.0, 6_000_000);
    config.validate().unwrap();
}
