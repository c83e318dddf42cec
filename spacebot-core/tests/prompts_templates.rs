//! Every built-in prompt template, rendered exactly, plus identity files and overrides.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use spacebot_core::policy::{LinkGraph, org_chart};
use spacebot_core::prompts::{
    AgentSummary, ConversationRulesContext, Identity, IdentityError, LinkContext, OrgContext,
    PromptError, Prompts, SendAgentMessageContext, SystemPromptContext, TEMPLATES, TaskOutcome,
    TaskRetriggerContext,
};
use spacebot_core::{AgentId, AgentLink, LinkDirection, LinkRelationship, Timestamp};

fn id(s: &str) -> AgentId {
    AgentId::parse(s).unwrap()
}

fn summary(s: &str, name: &str) -> AgentSummary {
    AgentSummary {
        id: id(s),
        name: name.into(),
    }
}

fn title(id: &AgentId) -> String {
    let mut name = id.to_string();
    if let Some(first) = name.get_mut(0..1) {
        first.make_ascii_uppercase();
    }
    name
}

/// The org of seed 000: chief superior of lead (written top-down), community-manager
/// subordinate of lead (written bottom-up), and one peer.
fn graph() -> LinkGraph {
    let link =
        |f: &str, t: &str, r| AgentLink::new(id(f), id(t), LinkDirection::TwoWay, r, Timestamp(0));
    LinkGraph::new(
        [],
        [
            link("chief", "lead", LinkRelationship::Superior),
            link("cm", "lead", LinkRelationship::Subordinate),
            link("lead", "ops", LinkRelationship::Peer),
        ],
    )
}

#[test]
fn every_built_in_template_compiles() {
    let prompts = Prompts::new();
    for (name, _) in TEMPLATES {
        // Rendering with an empty context must not fail on syntax (only on missing values).
        match prompts.render(name, &serde_json::json!({})) {
            Ok(_) => {}
            Err(PromptError::Template { source, .. }) => assert_ne!(
                source.kind(),
                minijinja::ErrorKind::SyntaxError,
                "{name}: {source}"
            ),
            Err(other) => panic!("{name}: {other}"),
        }
    }
}

#[test]
fn org_context_lists_superiors_reports_and_peers() {
    let prompts = Prompts::new();
    let ctx = OrgContext::from_chart(&org_chart(&graph(), &id("lead")), title);
    assert_eq!(
        prompts.render_org_context(&ctx).unwrap(),
        "## Organization

You are part of a multi-agent system. Here is your position:

**Reports to:**
- **Chief** (`chief`) — your superior. Messages from this agent carry organizational authority.

**Direct reports:**
- **Cm** (`cm`) — reports to you. You can delegate tasks, request status, and send directives.

**Peers:**
- **Ops** (`ops`) — equal peer. Communication is collaborative and informational.

Use the `send_agent_message` tool to hand work to these agents. You are told when each task you hand over completes or fails."
    );
    // Empty groups are left out; an empty context renders nothing.
    let chief = OrgContext::from_chart(&org_chart(&graph(), &id("chief")), title);
    let text = prompts.render_org_context(&chief).unwrap();
    assert!(
        text.contains("**Direct reports:**\n- **Lead** (`lead`)"),
        "{text}"
    );
    assert!(
        !text.contains("Reports to") && !text.contains("Peers"),
        "{text}"
    );
    assert_eq!(
        prompts.render_org_context(&OrgContext::default()).unwrap(),
        ""
    );
}

#[test]
fn link_context_frames_each_relationship() {
    let prompts = Prompts::new();
    let g = graph();
    let render = |me: &str, other: &str| {
        let link = g
            .between(me, other)
            .or_else(|| g.between(other, me))
            .unwrap();
        let ctx = LinkContext::from_link(link, &id(me), title).unwrap();
        prompts.render_link_context(&ctx).unwrap()
    };
    assert_eq!(
        render("lead", "chief"),
        "## Agent Communication\n\nThis is an internal channel with **Chief** (superior).\n\
         Messages from this agent carry organizational authority. Treat directives as assignments."
    );
    assert_eq!(
        render("lead", "cm"),
        "## Agent Communication\n\nThis is an internal channel with **Cm** (subordinate).\n\
         This is a report from a subordinate agent. They may be escalating, reporting status, or requesting guidance."
    );
    assert_eq!(
        render("ops", "lead"),
        "## Agent Communication\n\nThis is an internal channel with **Lead** (peer).\n\
         This is a peer agent. Communication is collaborative and informational."
    );
    assert!(
        LinkContext::from_link(g.between("chief", "lead").unwrap(), &id("ops"), title).is_none()
    );
}

#[test]
fn system_prompt_with_everything() {
    let prompts = Prompts::new();
    let g = graph();
    let ctx = SystemPromptContext {
        agent_name: "Lead".into(),
        identity: Identity {
            soul: Some("Calm and precise.".into()),
            identity: Some("The tech lead of spacebot.".into()),
            user: Some("The user is the founder.".into()),
            role: Some("Review code; escalate budget questions.".into()),
        },
        org_context: Some(OrgContext::from_chart(&org_chart(&g, &id("lead")), title)),
        link_context: LinkContext::from_link(
            g.between("chief", "lead").unwrap(),
            &id("lead"),
            title,
        ),
        extra: Some("Today is Monday.".into()),
    };
    let text = prompts.render_system_prompt(&ctx).unwrap();
    let headings: Vec<&str> = text.lines().filter(|l| l.starts_with("## ")).collect();
    assert_eq!(
        headings,
        [
            "## Identity",
            "## Soul",
            "## Role",
            "## About the user",
            "## Organization",
            "## Agent Communication"
        ]
    );
    assert!(text.starts_with("You are Lead.\n\n## Identity\n\nThe tech lead of spacebot.\n\n## Soul\n\nCalm and precise.\n\n## Role\n\nReview code; escalate budget questions.\n\n## About the user\n\nThe user is the founder.\n\n## Organization\n\n"), "{text}");
    assert!(
        text.ends_with("Treat directives as assignments.\n\nToday is Monday."),
        "{text}"
    );
    assert!(!text.contains("\n\n\n"), "{text}");
}

#[test]
fn system_prompt_with_nothing_but_a_name() {
    let prompts = Prompts::new();
    let ctx = SystemPromptContext {
        agent_name: "Solo".into(),
        org_context: Some(OrgContext::default()),
        ..Default::default()
    };
    assert_eq!(prompts.render_system_prompt(&ctx).unwrap(), "You are Solo.");
}

#[test]
fn send_agent_message_describes_delegation() {
    let prompts = Prompts::new();
    let plain = prompts
        .render_send_agent_message(&SendAgentMessageContext::default())
        .unwrap();
    assert_eq!(
        plain,
        "Assign a task to another agent. The target agent picks it up and works on it on its own. \
         Use this when work falls outside your scope or belongs to a subordinate. Your turn ends \
         after delegation; the result is delivered to you when the task completes or fails."
    );
    let with_targets = prompts
        .render_send_agent_message(&SendAgentMessageContext {
            targets: vec![summary("cm", "Community Manager"), summary("ops", "Ops")],
        })
        .unwrap();
    assert_eq!(
        with_targets,
        format!(
            "{plain}\n\nAgents you can assign tasks to:\n- `cm`: Community Manager\n- `ops`: Ops"
        )
    );
}

#[test]
fn conversation_rules_for_initiator_and_responder() {
    let prompts = Prompts::new();
    let rules = "Rules for this conversation:
1. Never acknowledge before contributing. No \"Great point!\" Start with your content.
2. Never repeat or paraphrase what the others said. Move forward.
3. Never ask a follow-up unless you genuinely cannot proceed without the answer.
4. If you have nothing new to add, stop. Silence is valid.
5. Receiving input does not obligate a response. Absorb and continue working.";
    let initiator = prompts
        .render_conversation_rules(&ConversationRulesContext {
            members: vec!["Lead".into(), "Ops".into()],
            is_initiator: true,
            turn_budget: Some(20),
        })
        .unwrap();
    assert_eq!(
        initiator,
        format!(
            "## Conversation with Lead, Ops\n\n{rules}\n\nYou started this conversation and own it: \
             close it with a final message once you have what you need.\n\n\
             The conversation ends after at most 20 turns."
        )
    );
    let responder = prompts
        .render_conversation_rules(&ConversationRulesContext {
            members: vec!["Chief".into()],
            is_initiator: false,
            turn_budget: None,
        })
        .unwrap();
    assert_eq!(
        responder,
        format!(
            "## Conversation with Chief\n\n{rules}\n\nYou did not start this conversation: \
             deliver your contribution, or stay silent."
        )
    );
}

#[test]
fn task_retrigger_for_each_outcome() {
    let prompts = Prompts::new();
    let render = |outcome| {
        prompts
            .render_task_retrigger(&TaskRetriggerContext {
                agent_name: "community-manager".into(),
                task_number: 42,
                outcome,
                summary: "text".into(),
            })
            .unwrap()
    };
    assert_eq!(
        render(TaskOutcome::Completed),
        "community-manager completed task #42: text"
    );
    assert_eq!(
        render(TaskOutcome::Failed),
        "community-manager's worker failed on task #42: text"
    );
    assert_eq!(
        render(TaskOutcome::Cancelled),
        "Task #42 assigned to community-manager was cancelled: text"
    );
}

#[test]
fn overrides_are_compiled_first_and_a_bad_one_changes_nothing() {
    let mut prompts = Prompts::new();
    let ctx = SystemPromptContext {
        agent_name: "A".into(),
        ..Default::default()
    };
    let err = prompts
        .override_template("system_prompt", "{% for %}")
        .unwrap_err();
    assert!(err.to_string().contains("\"system_prompt\""), "{err}");
    assert_eq!(prompts.render_system_prompt(&ctx).unwrap(), "You are A.");

    prompts
        .override_template("signature", "-- {{ agent_name }}")
        .unwrap();
    prompts
        .override_template(
            "system_prompt",
            "Hi {{ agent_name }}.\n{% include \"signature\" %}",
        )
        .unwrap();
    assert_eq!(prompts.render_system_prompt(&ctx).unwrap(), "Hi A.\n-- A");

    // Printing something the context lacks is an error naming the template, not empty text.
    prompts
        .override_template("system_prompt", "{{ nickname }}")
        .unwrap();
    let err = prompts.render_system_prompt(&ctx).unwrap_err();
    assert!(err.to_string().contains("\"system_prompt\""), "{err}");
    assert!(prompts.render("no_such_template", &ctx).is_err());
}

#[test]
fn identity_files_are_read_and_missing_ones_are_fine() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(Identity::load(dir.path()).unwrap(), Identity::default());
    assert!(
        Identity::load(&dir.path().join("no-such-dir"))
            .unwrap()
            .is_empty()
    );
    std::fs::write(dir.path().join("SOUL.md"), "  Curious.\n\n").unwrap();
    std::fs::write(dir.path().join("ROLE.md"), "Handle tier 1 tickets.").unwrap();
    std::fs::write(dir.path().join("USER.md"), "   \n").unwrap();
    let identity = Identity::load(dir.path()).unwrap();
    assert_eq!(
        identity,
        Identity {
            soul: Some("Curious.".into()),
            identity: None,
            user: None,
            role: Some("Handle tier 1 tickets.".into()),
        }
    );
}

#[test]
fn an_unreadable_identity_file_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("SOUL.md")).unwrap();
    let err = Identity::load(dir.path()).unwrap_err();
    assert!(matches!(err, IdentityError::Unreadable { .. }), "{err}");
    assert!(err.to_string().contains("SOUL.md"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("IDENTITY.md"), [0xff, 0xfe, b'x']).unwrap();
    let err = Identity::load(dir.path()).unwrap_err();
    assert!(matches!(err, IdentityError::NotUtf8 { .. }), "{err}");
    assert!(err.to_string().contains("IDENTITY.md"), "{err}");
}
