//! Shared notes in an organization, through the public API with the scripted mock model: two
//! agents racing a write, an agent without access, a revocation at run time, a restart, the
//! configuration's grants against the stored ones, and a configuration with mistakes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;

use serde_json::json;
use spacebot_core::testing::{MockLlm, OrgHarness, PendingCall, ScriptedLlm, tool_call};
use spacebot_core::{
    ChatMessage, ChatRequest, EventKind, InboundMessage, LlmProvider, OrgConfig, Organization,
    Stores,
};
use spacebot_notes::{Access, LIST_TOOL, Notes, READ_TOOL, WRITE_TOOL};
use support::{CONFIG, agent, org};

async fn harness(llm: &ScriptedLlm, notes: &Notes, stores: Stores) -> OrgHarness {
    harness_with(Arc::new(llm.clone()), notes, stores).await
}

async fn harness_with(llm: Arc<dyn LlmProvider>, notes: &Notes, stores: Stores) -> OrgHarness {
    let h = OrgHarness::builder(CONFIG)
        .llm(llm)
        .stores(stores)
        .behaviour(Arc::new(notes.clone()))
        .build()
        .await;
    h.org.start_all().await.unwrap();
    h
}

async fn ask(h: &OrgHarness, to: &str, text: &str) {
    h.org
        .deliver(to, InboundMessage::new("portal", "u1", text))
        .await
        .unwrap();
}

fn tool_names(request: &ChatRequest) -> Vec<String> {
    request.tools.iter().map(|t| t.name.clone()).collect()
}

/// The tool results the agent's model was shown, in order.
fn tool_results(llm: &ScriptedLlm, id: &str) -> Vec<String> {
    let requests = llm.requests_for(&agent(id));
    let Some(last) = requests.last() else {
        return Vec::new();
    };
    last.messages
        .iter()
        .filter_map(|m| match m {
            ChatMessage::Tool { content, .. } => Some(content.to_string()),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn two_agents_racing_a_write_one_is_refused_and_shown_the_current_text() {
    let llm = ScriptedLlm::new();
    let notes = Notes::new();
    // Both read version 1 and write on top of it.
    for (id, text) in [("a", "plan by a"), ("b", "plan by b")] {
        llm.push_tool_call(
            &agent(id),
            WRITE_TOOL,
            json!({"name": "plan", "text": text, "base_version": 1}),
        );
        llm.push_text(&agent(id), "done");
    }
    let mut h = harness(&llm, &notes, Stores::memory()).await;
    ask(&h, "a", "update the plan").await;
    ask(&h, "b", "update the plan").await;
    h.reply().await;
    h.reply().await;

    let history = notes.history("plan").await.unwrap();
    assert_eq!(history.len(), 2, "exactly one of the two writes happened");
    let winner = history[1].author.clone();
    let loser = if winner == "a" { "b" } else { "a" };
    let winner_text = format!("plan by {winner}");
    assert_eq!(history[1].text, winner_text);

    let won = tool_results(&llm, &winner);
    assert!(won[0].contains("now at version 2"), "{won:?}");
    let lost = tool_results(&llm, loser);
    assert!(lost[0].starts_with("Error:"), "{lost:?}");
    assert!(lost[0].contains("nothing was written"), "{lost:?}");
    assert!(
        lost[0].contains(&winner_text),
        "the current text is shown: {lost:?}"
    );
    assert!(lost[0].contains("base_version 2"), "{lost:?}");
    assert_eq!(
        h.count(|k| matches!(k, EventKind::Behaviour { name, .. } if name == "note_written")),
        2,
        "the configured first version and the one write"
    );
    h.org.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_agent_without_access_never_sees_the_tools_and_is_refused_if_it_names_them() {
    let llm = ScriptedLlm::new();
    let notes = Notes::new();
    // d has no note: it names the tools anyway.
    llm.push_tool_calls(
        &agent("d"),
        [
            (READ_TOOL, json!({"name": "plan"})),
            (
                WRITE_TOOL,
                json!({"name": "plan", "text": "mine", "base_version": 1}),
            ),
            (LIST_TOOL, json!({})),
        ],
    );
    llm.push_text(&agent("d"), "done");
    // c may read plan: it tries to write it, and to read a's secret.
    llm.push_tool_calls(
        &agent("c"),
        [
            (
                WRITE_TOOL,
                json!({"name": "plan", "text": "mine", "base_version": 1}),
            ),
            (READ_TOOL, json!({"name": "secret"})),
            (READ_TOOL, json!({"name": "plan"})),
            (LIST_TOOL, json!({})),
        ],
    );
    llm.push_text(&agent("c"), "done");
    let mut h = harness(&llm, &notes, Stores::memory()).await;
    ask(&h, "d", "go").await;
    h.reply().await;
    ask(&h, "c", "go").await;
    h.reply().await;

    let d_first = &llm.requests_for(&agent("d"))[0];
    for tool in [LIST_TOOL, READ_TOOL, WRITE_TOOL] {
        assert!(
            !tool_names(d_first).contains(&tool.to_owned()),
            "{tool} offered to d"
        );
    }
    let d = tool_results(&llm, "d");
    assert_eq!(d.len(), 3);
    for result in &d {
        assert!(result.contains("unknown tool"), "{result}");
        assert!(
            !result.contains("start"),
            "the note's text leaked: {result}"
        );
    }

    let c_first = &llm.requests_for(&agent("c"))[0];
    assert!(tool_names(c_first).contains(&READ_TOOL.to_owned()));
    let c = tool_results(&llm, "c");
    assert!(
        c[0].contains("may read note plan but not write it"),
        "{}",
        c[0]
    );
    assert!(c[1].contains("no access"), "{}", c[1]);
    assert!(
        c[2].contains("start") && c[2].contains("version 1"),
        "{}",
        c[2]
    );
    assert!(
        c[3].contains("plan") && !c[3].contains("secret"),
        "{}",
        c[3]
    );
    assert_eq!(
        notes.history("plan").await.unwrap().len(),
        1,
        "nothing written"
    );
    h.org.shutdown().await.unwrap();
}

/// The tool results in a request, in order.
fn results_in(request: &ChatRequest) -> Vec<String> {
    request
        .messages
        .iter()
        .filter_map(|m| match m {
            ChatMessage::Tool { content, .. } => Some(content.to_string()),
            _ => None,
        })
        .collect()
}

async fn next_call(handle: &mut spacebot_core::testing::MockLlmHandle) -> PendingCall {
    tokio::time::timeout(std::time::Duration::from_secs(10), handle.next())
        .await
        .expect("a model call within 10 s")
        .expect("the model is still in use")
}

#[tokio::test]
async fn access_revoked_at_run_time_takes_effect_on_the_next_call_and_the_next_turn() {
    let (llm, mut handle) = MockLlm::pair();
    let notes = Notes::new();
    let mut h = harness_with(Arc::new(llm), &notes, Stores::memory()).await;
    notes
        .grant("secret", &agent("c"), Access::Read)
        .await
        .unwrap();

    // One turn of c: it reads plan; the operator revokes c's access to plan; it reads again.
    ask(&h, "c", "read").await;
    next_call(&mut handle)
        .await
        .respond_tool_calls(vec![tool_call(READ_TOOL, json!({"name": "plan"}))]);
    let second = next_call(&mut handle).await;
    assert!(results_in(&second.request)[0].contains("start"));
    notes.revoke("plan", &agent("c")).await.unwrap();
    second.respond_tool_calls(vec![tool_call(READ_TOOL, json!({"name": "plan"}))]);
    let third = next_call(&mut handle).await;
    let results = results_in(&third.request);
    assert!(results[1].contains("no access"), "{}", results[1]);
    third.respond_text("done");
    h.reply().await;

    // Without any grant left, the next turn is not offered the tools at all, and naming one is
    // refused.
    notes.revoke("secret", &agent("c")).await.unwrap();
    ask(&h, "c", "list").await;
    let first = next_call(&mut handle).await;
    assert!(!tool_names(&first.request).contains(&LIST_TOOL.to_owned()));
    first.respond_tool_calls(vec![tool_call(LIST_TOOL, json!({}))]);
    let second = next_call(&mut handle).await;
    assert!(
        results_in(&second.request)
            .last()
            .unwrap()
            .contains("unknown tool")
    );
    second.respond_text("done");
    h.reply().await;

    // A grant at run time offers them on the next turn.
    notes
        .grant("plan", &agent("d"), Access::ReadWrite)
        .await
        .unwrap();
    ask(&h, "d", "write").await;
    let first = next_call(&mut handle).await;
    assert!(tool_names(&first.request).contains(&WRITE_TOOL.to_owned()));
    first.respond_tool_calls(vec![tool_call(
        WRITE_TOOL,
        json!({"name": "plan", "text": "d was here", "base_version": 1}),
    )]);
    next_call(&mut handle).await.respond_text("done");
    h.reply().await;
    assert_eq!(
        notes.read("plan").await.unwrap().latest.unwrap().text,
        "d was here"
    );
    let changes = h
        .count(|k| matches!(k, EventKind::Behaviour { name, .. } if name == "note_access_changed"));
    assert_eq!(changes, 4);
    h.org.shutdown().await.unwrap();
}

#[tokio::test]
async fn notes_and_grants_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let llm = ScriptedLlm::new();
    let notes = Notes::new();
    llm.push_tool_call(
        &agent("a"),
        WRITE_TOOL,
        json!({"name": "plan", "text": "written before the restart", "base_version": 1}),
    );
    llm.push_text(&agent("a"), "done");
    let stores = spacebot_sqlite::open(dir.path()).await.unwrap();
    let mut h = harness(&llm, &notes, stores.clone()).await;
    ask(&h, "a", "write").await;
    h.reply().await;
    notes
        .grant("secret", &agent("d"), Access::Read)
        .await
        .unwrap();
    h.org.shutdown().await.unwrap();
    drop(h);
    stores.close().await;

    let llm = ScriptedLlm::new();
    let notes = Notes::new();
    llm.push_tool_call(&agent("d"), LIST_TOOL, json!({}));
    llm.push_text(&agent("d"), "done");
    let stores = spacebot_sqlite::open(dir.path()).await.unwrap();
    let mut h = harness(&llm, &notes, stores.clone()).await;
    let plan = notes.read("plan").await.unwrap().latest.unwrap();
    assert_eq!(
        (plan.version, plan.text.as_str()),
        (2, "written before the restart")
    );
    ask(&h, "d", "list").await;
    h.reply().await;
    let listed = tool_results(&llm, "d");
    assert!(listed[0].contains("secret (access: read"), "{listed:?}");
    h.org.shutdown().await.unwrap();
    stores.close().await;
}

#[tokio::test]
async fn a_configuration_change_wins_at_start_and_run_time_grants_are_kept_otherwise() {
    let stores = Stores::memory();
    let notes = Notes::new();
    let first = org(CONFIG, stores.clone(), &notes).await;
    notes.revoke("plan", &agent("c")).await.unwrap();
    notes
        .grant("plan", &agent("d"), Access::Read)
        .await
        .unwrap();
    first.shutdown().await.unwrap();

    // The same configuration: the run-time changes stay, and the start says so.
    let events = Arc::new(spacebot_core::testing::RecordingSink::new());
    let notes = Notes::new();
    let _second = Organization::builder(OrgConfig::from_toml_str(CONFIG).unwrap())
        .stores(stores.clone())
        .llm(Arc::new(ScriptedLlm::new()))
        .events(events.clone())
        .behaviour(Arc::new(notes.clone()))
        .build()
        .await
        .unwrap();
    let access = notes.access("plan").await.unwrap();
    assert_eq!(access.get(&agent("c")), None);
    assert_eq!(access.get(&agent("d")), Some(&Access::Read));
    let reported = events.kinds().into_iter().find_map(|k| match k {
        EventKind::Behaviour { name, detail, .. } if name == "note_access_reconciled" => {
            Some(detail)
        }
        _ => None,
    });
    let detail = reported.expect("the start reports the run-time grants it kept");
    assert_eq!(detail["kept"]["c"], serde_json::Value::Null);
    assert_eq!(detail["kept"]["d"], json!("read"));

    // The configuration now makes c a writer: that change wins; d's run-time grant stays.
    let changed = CONFIG
        .replace(r#"readers = ["c"]"#, r#"readers = []"#)
        .replace(r#"writers = ["a", "b"]"#, r#"writers = ["a", "b", "c"]"#);
    let notes = Notes::new();
    let _third = org(&changed, stores.clone(), &notes).await;
    let access = notes.access("plan").await.unwrap();
    assert_eq!(access.get(&agent("c")), Some(&Access::ReadWrite));
    assert_eq!(access.get(&agent("d")), Some(&Access::Read));
}

#[tokio::test]
async fn every_mistake_in_the_configuration_is_named_and_unclaimed_sections_fail() {
    let bad = r#"
[[agents]]
id = "a"
[[notes]]
name = "Bad Name"
[[notes]]
name = "ok"
readers = ["ghost"]
colour = "blue"
[[notes]]
name = "ok"
writers = ["a"]
readers = ["a"]
"#;
    let err = Organization::builder(OrgConfig::from_toml_str(bad).unwrap())
        .stores(Stores::memory())
        .llm(Arc::new(ScriptedLlm::new()))
        .behaviour(Arc::new(Notes::new()))
        .build()
        .await
        .unwrap_err()
        .to_string();
    for expected in [
        "notes[0] (Bad Name): field \"name\": invalid note name",
        "notes[1] (ok): field \"readers\": unknown agent \"ghost\"",
        "notes[1] (ok): field \"colour\": unknown field",
        "notes[2] (ok): field \"name\": duplicate note \"ok\" (first defined by notes[1])",
        "notes[2] (ok): field \"writers\": agent \"a\" is listed in both readers and writers",
    ] {
        assert!(err.contains(expected), "{expected:?} missing from: {err}");
    }

    // A misspelt section, and notes without the behaviour that claims them, fail the build.
    let typo = "[[agents]]\nid = \"a\"\n[[notse]]\nname = \"plan\"\n";
    for (config, with_notes) in [(typo, true), (CONFIG, false)] {
        let mut builder = Organization::builder(OrgConfig::from_toml_str(config).unwrap())
            .stores(Stores::memory())
            .llm(Arc::new(ScriptedLlm::new()));
        if with_notes {
            builder = builder.behaviour(Arc::new(Notes::new()));
        }
        let err = builder.build().await.unwrap_err().to_string();
        assert!(err.contains("no behaviour claims this section"), "{err}");
    }
}
