//! Delegation refusals (one test per error path), the approval policy, and the board tools.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: failing loudly is the point

use std::sync::Arc;

use super::support::delegation::portal;
use super::support::{delegation::*, *};
use serde_json::json;
use spacebot::delegation::{
    DelegationError, DelegationOrigin, SendAgentMessage, TaskCreate, TaskList, TaskUpdate,
};
use spacebot::error::DenialReason;
use spacebot::event::EventKind;
use spacebot::testing::ScriptedLlm;
use spacebot::{
    AgentId, ChannelId, Clock, Organization, Stores, TaskRef, TaskStatus, Tool, ToolContext,
    ToolError,
};

fn origin() -> DelegationOrigin {
    DelegationOrigin {
        channel: portal(),
        task: None,
        round: 0,
        cause: None,
        key: None,
    }
}

fn from_task(agent: &str, number: u64) -> DelegationOrigin {
    DelegationOrigin {
        channel: ChannelId::new(format!("task:{agent}#{number}")),
        task: Some(TaskRef::new(id(agent), number)),
        round: 0,
        cause: None,
        key: None,
    }
}

/// Claims task `number` of `agent` for a test worker, as the task loop would.
async fn claim(h: &Harness, agent: &str) -> u64 {
    h.stores
        .tasks
        .claim_next(
            &id(agent),
            "test-worker",
            std::time::Duration::from_secs(60),
            h.manual_clock().now(),
        )
        .await
        .unwrap()
        .expect("a ready task")
        .number
}

/// An organization whose agents are not started, so delegated tasks stay where they are created.
async fn idle(stores: Stores, settings: &str) -> Harness {
    harness_with(Arc::new(ScriptedLlm::new()), settings, stores, vec![]).await
}

fn denial(err: DelegationError) -> DenialReason {
    match err {
        DelegationError::Denied(d) => d.reason,
        other => panic!("expected a policy denial, got {other:?}"),
    }
}

/// Nothing was created by a refused delegation, and the only link records are the refusals
/// themselves (recorded in the link timeline: no hidden side channels).
async fn nothing_written(h: &Harness) {
    for agent in ["a", "b", "c", "d", "e"] {
        for peer in ["a", "b", "c", "d", "e"] {
            if agent != peer {
                let texts = h.link_texts(agent, peer).await;
                assert!(
                    texts.iter().all(|t| t.starts_with("refused: ")),
                    "a refused delegation wrote to link:{agent}:{peer}: {texts:?}"
                );
            }
        }
    }
}

pub async fn unknown_agent_lists_the_agents_the_delegator_may_reach(stores: Stores) {
    let h = idle(stores, "").await;
    let err = h
        .org
        .delegate(&id("a"), "zeta", "Do it.", origin())
        .await
        .unwrap_err();
    match &err {
        DelegationError::UnknownAgent { target, reachable } => {
            assert_eq!(target, "zeta");
            assert_eq!(reachable, &["b (Beta)", "c (Gamma)", "d (Delta)"]);
        }
        other => panic!("expected UnknownAgent, got {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        "unknown agent \"zeta\"; agents you can delegate to: b (Beta), c (Gamma), d (Delta)"
    );
    // An agent with nobody to delegate to is told so.
    let err = h
        .org
        .delegate(&id("e"), "zeta", "Do it.", origin())
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .ends_with("agents you can delegate to: none"),
        "{err}"
    );
    nothing_written(&h).await;
}

pub async fn unknown_agent_comes_back_to_the_model_as_a_tool_result_it_can_act_on(stores: Stores) {
    let llm = Arc::new(ScriptedLlm::new());
    let a = id("a");
    llm.push_tool_call(
        &a,
        "send_agent_message",
        json!({"target": "Zeta", "message": "Hi."}),
    );
    llm.push_tool_call(
        &a,
        "send_agent_message",
        json!({"target": "beta", "message": "Hi."}),
    );
    llm.push_text(&a, "done");
    llm.push_text(&id("b"), "hello");
    let mut h = harness(stores, llm.clone(), "").await;
    h.org.deliver("a", user("say hi to someone")).await.unwrap();
    assert_eq!(h.reply().await.content, "done");
    let second = &llm.requests_for(&a)[1];
    let results = tool_results(second);
    assert_eq!(results.len(), 1);
    assert!(
        results[0].contains(
            "unknown agent \"Zeta\"; agents you can delegate to: b (Beta), c (Gamma), d (Delta)"
        ),
        "{results:?}"
    );
    // The model corrected itself with a display name, matched case-insensitively.
    assert_eq!(h.task("b", 1).await.created_by, "agent:a");
}

pub async fn no_link_is_refused(stores: Stores) {
    let h = idle(stores, "").await;
    let err = h
        .org
        .delegate(&id("b"), "d", "Do it.", origin())
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("there is no link between them"),
        "{err}"
    );
    assert_eq!(denial(err), DenialReason::NoLink);
    nothing_written(&h).await;
}

pub async fn a_disabled_link_is_refused(stores: Stores) {
    let h = idle(stores, "").await;
    let err = h
        .org
        .delegate(&id("a"), "e", "Do it.", origin())
        .await
        .unwrap_err();
    assert_eq!(denial(err), DenialReason::LinkDisabled);
    nothing_written(&h).await;
}

pub async fn a_one_way_link_is_refused_in_the_wrong_direction(stores: Stores) {
    let h = idle(stores, "").await;
    let err = h
        .org
        .delegate(&id("d"), "a", "Do it.", origin())
        .await
        .unwrap_err();
    assert!(
        err.to_string().starts_with("d may not delegate to a"),
        "{err}"
    );
    assert_eq!(denial(err), DenialReason::OneWayReverse);
    nothing_written(&h).await;
    // The right direction works.
    let task = h
        .org
        .delegate(&id("a"), "d", "Do it.", origin())
        .await
        .unwrap();
    assert_eq!((task.agent.as_str(), task.number), ("d", 1));
}

pub async fn self_delegation_and_empty_messages_are_refused(stores: Stores) {
    let h = idle(stores, "").await;
    let err = h
        .org
        .delegate(&id("a"), "Alpha", "Do it.", origin())
        .await
        .unwrap_err();
    assert_eq!(denial(err), DenialReason::SelfTarget);
    let err = h
        .org
        .delegate(&id("a"), "b", "  \n ", origin())
        .await
        .unwrap_err();
    assert!(matches!(err, DelegationError::Invalid(_)), "{err:?}");
    assert!(err.to_string().contains("message"), "{err}");
    nothing_written(&h).await;
}

pub async fn a_cycle_is_refused_with_the_chain(stores: Stores) {
    let h = idle(stores, "").await;
    let b1 = h
        .org
        .delegate(&id("a"), "b", "Step one.", origin())
        .await
        .unwrap();
    assert_eq!(b1.metadata.delegation_chain, vec![id("a")]);
    claim(&h, "b").await;
    let c1 = h
        .org
        .delegate(&id("b"), "c", "Step two.", from_task("b", 1))
        .await
        .unwrap();
    assert_eq!(c1.metadata.delegation_chain, vec![id("a"), id("b")]);
    claim(&h, "c").await;
    let err = h
        .org
        .delegate(&id("c"), "a", "Step three.", from_task("c", 1))
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("already in the delegation chain a -> b -> c"),
        "{err}"
    );
    assert_eq!(
        denial(err),
        DenialReason::Cycle {
            chain: vec![id("a"), id("b"), id("c")]
        }
    );
    assert!(h.board("a").await.is_empty());
    let texts = h.link_texts("c", "a").await;
    assert!(
        texts.len() == 1 && texts[0].starts_with("refused: "),
        "only the refusal is recorded on the link: {texts:?}"
    );
    // Without the chain (a fresh request to c) the same pair is allowed.
    h.org
        .delegate(&id("c"), "a", "Fresh request.", origin())
        .await
        .unwrap();
}

pub async fn a_chain_deeper_than_the_limit_is_refused(stores: Stores) {
    let h = idle(stores, "max_delegation_depth = 2").await;
    h.org
        .delegate(&id("a"), "b", "One.", origin())
        .await
        .unwrap();
    claim(&h, "b").await;
    h.org
        .delegate(&id("b"), "c", "Two.", from_task("b", 1))
        .await
        .unwrap();
    claim(&h, "c").await;
    let err = h
        .org
        .delegate(&id("c"), "d", "Three.", from_task("c", 1))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("deeper than the limit of 2"),
        "{err}"
    );
    assert_eq!(denial(err), DenialReason::DepthExceeded { limit: 2 });
    assert!(h.board("d").await.is_empty());
}

pub async fn too_many_rounds_are_refused(stores: Stores) {
    let h = idle(stores, "max_delegation_depth = 2").await;
    let mut late = origin();
    late.round = 3;
    h.org
        .delegate(&id("a"), "b", "Again.", late.clone())
        .await
        .unwrap();
    late.round = 4;
    let err = h
        .org
        .delegate(&id("a"), "b", "Again.", late)
        .await
        .unwrap_err();
    assert!(
        matches!(err, DelegationError::RoundLimit { limit: 4, .. }),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("answer with what you have"),
        "{err}"
    );
    assert_eq!(h.board("b").await.len(), 1);
}

pub async fn only_a_task_in_progress_may_delegate_and_nothing_is_left_behind(stores: Stores) {
    let h = idle(stores, "").await;
    h.org
        .delegate(&id("a"), "b", "One.", origin())
        .await
        .unwrap();
    // b#1 is ready (its worker lost it, say): delegating from it is refused before anything is
    // created.
    let err = h
        .org
        .delegate(&id("b"), "c", "Two.", from_task("b", 1))
        .await
        .unwrap_err();
    assert!(matches!(err, DelegationError::Invalid(_)), "{err:?}");
    assert!(err.to_string().contains("b#1 is ready"), "{err}");
    assert!(h.board("c").await.is_empty(), "no orphan child");
    assert!(h.link_texts("b", "c").await.is_empty());
    assert!(h.task("b", 1).await.metadata.children.is_empty());
}

pub async fn a_delegation_from_a_task_that_does_not_exist_is_an_error(stores: Stores) {
    let h = idle(stores, "").await;
    let err = h
        .org
        .delegate(&id("b"), "c", "Two.", from_task("b", 9))
        .await
        .unwrap_err();
    assert!(matches!(err, DelegationError::Store(_)), "{err:?}");
    assert!(h.board("c").await.is_empty());
}

pub async fn the_send_tool_reports_denials_as_tool_errors(stores: Stores) {
    let h = idle(stores, "").await;
    let ctx = h.org.tool_context(&id("d"), portal());
    let err = SendAgentMessage
        .call(&ctx, json!({"target": "a", "message": "Do it."}))
        .await
        .unwrap_err();
    assert!(matches!(err, ToolError::Denied(_)), "{err:?}");
    assert!(
        err.to_model_text().contains("one-way"),
        "{}",
        err.to_model_text()
    );
    let err = SendAgentMessage
        .call(&ctx, json!({"target": "a"}))
        .await
        .unwrap_err();
    assert!(
        err.to_model_text().contains("message"),
        "{}",
        err.to_model_text()
    );
}

pub async fn approval_always_holds_the_task_until_the_target_approves_it(stores: Stores) {
    let llm = Arc::new(ScriptedLlm::new());
    let (a, b) = (id("a"), id("b"));
    llm.push_tool_call(
        &a,
        "send_agent_message",
        json!({"target": "b", "message": "Deploy it."}),
    );
    llm.push_text(&a, "Beta deployed it");
    let mut h = harness(stores, llm.clone(), "approval = \"always\"").await;
    h.org.deliver("a", user("deploy")).await.unwrap();
    h.wait_count("the task", 1, |k| {
        matches!(k, EventKind::TaskCreated { .. })
    })
    .await;
    // Everything the delegation caused has run: a's turn ended, b's task loop left the task alone.
    h.wait_quiet().await;
    let task = h.task("b", 1).await;
    assert_eq!(task.status, TaskStatus::PendingApproval);
    assert_eq!(h.count(|k| matches!(k, EventKind::TaskClaimed { .. })), 0);
    assert!(
        llm.requests_for(&b).is_empty(),
        "b must not work on an unapproved task"
    );
    assert_eq!(
        h.count(|k| matches!(
            k,
            EventKind::TaskCreated {
                status: TaskStatus::PendingApproval,
                ..
            }
        )),
        1
    );
    let told = tool_results(&llm.requests_for(&a)[0]);
    assert!(told.is_empty());
    // The lease checks come and go; the task still waits.
    h.manual_clock()
        .advance(spacebot::delegation::LEASE_CHECK_INTERVAL * 3);
    h.wait_quiet().await;
    assert_eq!(h.task("b", 1).await.status, TaskStatus::PendingApproval);

    // b's operator asks it to approve; then the task runs.
    llm.push_tool_call(&b, "task_update", json!({"number": 1, "action": "approve"}));
    llm.push_text(&b, "Approved.");
    llm.push_text(&b, "deployed");
    h.org.deliver("b", user("approve task 1")).await.unwrap();
    let approved = h.reply().await;
    assert_eq!(
        (approved.agent.as_str(), approved.content.as_str()),
        ("b", "Approved.")
    );
    let relayed = h.reply().await;
    assert_eq!(
        (relayed.agent.as_str(), relayed.content.as_str()),
        ("a", "Beta deployed it")
    );
    assert_eq!(h.task("b", 1).await.status, TaskStatus::Done);
}

pub async fn the_send_tool_says_when_a_task_waits_for_approval(stores: Stores) {
    let h = idle(stores, "approval = \"always\"").await;
    let ctx = h.org.tool_context(&id("a"), portal());
    let out = SendAgentMessage
        .call(&ctx, json!({"target": "b", "message": "Deploy it."}))
        .await
        .unwrap();
    assert!(out.end_turn);
    assert!(
        out.content
            .contains("Assigned task #1 to Beta (b): Deploy it."),
        "{}",
        out.content
    );
    assert!(
        out.content.contains("waits for approval"),
        "{}",
        out.content
    );
}

pub async fn approval_unless_superior_lets_superiors_through_and_holds_peers(stores: Stores) {
    let h = idle(stores, "approval = \"unless_superior\"").await;
    let from_superior = h
        .org
        .delegate(&id("a"), "b", "Boss says.", origin())
        .await
        .unwrap();
    assert_eq!(from_superior.status, TaskStatus::Ready);
    let from_superior = h
        .org
        .delegate(&id("b"), "c", "Boss says.", origin())
        .await
        .unwrap();
    assert_eq!(from_superior.status, TaskStatus::Ready);
    let from_peer = h
        .org
        .delegate(&id("c"), "a", "Peer asks.", origin())
        .await
        .unwrap();
    assert_eq!(from_peer.status, TaskStatus::PendingApproval);
    let from_peer = h
        .org
        .delegate(&id("c"), "d", "Peer asks.", origin())
        .await
        .unwrap();
    assert_eq!(from_peer.status, TaskStatus::PendingApproval);
}

fn ctx(org: &Organization, agent: &AgentId) -> ToolContext {
    org.tool_context(agent, portal())
}

pub async fn boards_own_board_and_superiors_read_subordinates(stores: Stores) {
    let h = idle(stores, "").await;
    let (a, b, c, d) = (id("a"), id("b"), id("c"), id("d"));
    h.org
        .delegate(&a, "b", "Write the report.", origin())
        .await
        .unwrap();
    let out = TaskCreate
        .call(
            &ctx(&h.org, &b),
            json!({"title": "Tidy up", "priority": "high", "backlog": true}),
        )
        .await
        .unwrap();
    assert_eq!(out.content, "Created task #2 (backlog): Tidy up");
    let own = TaskList.call(&ctx(&h.org, &b), json!({})).await.unwrap();
    assert_eq!(
        own.content,
        "#1 [ready] Write the report. (agent:a)\n#2 [backlog] Tidy up (agent:b)"
    );
    let filtered = TaskList
        .call(&ctx(&h.org, &b), json!({"status": "backlog"}))
        .await
        .unwrap();
    assert_eq!(filtered.content, "#2 [backlog] Tidy up (agent:b)");
    // a is b's superior: it may read b's board, by id or name.
    let read = TaskList
        .call(&ctx(&h.org, &a), json!({"agent": "Beta"}))
        .await
        .unwrap();
    assert_eq!(read.content, own.content);
    assert_eq!(
        TaskList
            .call(&ctx(&h.org, &a), json!({}))
            .await
            .unwrap()
            .content,
        "No tasks on a's board."
    );
    // Not the other way round, not between peers, and not two levels down.
    for (who, whose) in [(&b, "a"), (&c, "d"), (&d, "c"), (&a, "c")] {
        let err = TaskList
            .call(&ctx(&h.org, who), json!({"agent": whose}))
            .await
            .unwrap_err();
        assert!(
            err.to_model_text().contains("does not report to you"),
            "{who} reading {whose}: {}",
            err.to_model_text()
        );
    }
    // Read-only: task_update acts on the caller's own board, so a cannot touch b's task #2.
    let err = TaskUpdate
        .call(&ctx(&h.org, &a), json!({"number": 2, "action": "cancel"}))
        .await
        .unwrap_err();
    assert!(
        err.to_model_text().contains("not found") || err.to_model_text().contains("a#2"),
        "{}",
        err.to_model_text()
    );
    assert_eq!(h.task("b", 2).await.status, TaskStatus::Backlog);
    // b schedules its own backlog task.
    let out = TaskUpdate
        .call(&ctx(&h.org, &b), json!({"number": 2, "action": "schedule"}))
        .await
        .unwrap();
    assert_eq!(out.content, "Task #2 is now ready.");
    let err = TaskUpdate
        .call(&ctx(&h.org, &b), json!({"number": 2, "action": "approve"}))
        .await
        .unwrap_err();
    assert!(
        err.to_model_text().contains("approve"),
        "{}",
        err.to_model_text()
    );
    let err = TaskCreate
        .call(
            &ctx(&h.org, &b),
            json!({"title": "x", "priority": "whenever"}),
        )
        .await
        .unwrap_err();
    assert!(
        err.to_model_text().contains("whenever"),
        "{}",
        err.to_model_text()
    );
}

pub async fn cancelling_a_delegated_task_notifies_the_delegator(stores: Stores) {
    let llm = Arc::new(ScriptedLlm::new());
    let a = id("a");
    llm.push_text(&a, "noted");
    let mut h = harness_with(llm.clone(), "approval = \"always\"", stores, vec![]).await;
    h.org
        .delegate(&a, "b", "Maybe later.", origin())
        .await
        .unwrap();
    h.org.start_agent(&a).await.unwrap();
    let out = TaskUpdate
        .call(
            &ctx(&h.org, &id("b")),
            json!({"number": 1, "action": "cancel", "reason": "not needed"}),
        )
        .await
        .unwrap();
    assert_eq!(out.content, "Task #1 is now cancelled.");
    assert_eq!(h.reply().await.content, "noted");
    assert_eq!(
        last_user_text(&llm.requests_for(&a)[0]),
        "Task #1 assigned to Beta was cancelled: not needed"
    );
    assert_eq!(
        h.link_texts("a", "b").await,
        vec![
            "a assigned task #1 to b: Maybe later.",
            "task #1 assigned to b was cancelled: not needed"
        ]
    );
}
